//! The consumer end of one request stream.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::sync::mpsc::UnboundedReceiver;

use super::{AgentClient, ClientError, Delivery, Pending, Route};
use crate::io::{CreditWindow, RecvWindow};
use crate::msg::{GuestMsg, HostMsg};

/// Messages of one stream, in order. Taking a data message out returns its credit to the guest. Dropping the
/// receiver before the terminal message tells the agent to `Abandon` the stream, and frames that still
/// arrive for it are ignored by the reader (no buffering).
pub struct StreamRx {
    client: AgentClient,
    id: u32,
    rx: UnboundedReceiver<Delivery>,
    recv: Arc<RecvWindow>,
    send: Arc<CreditWindow>,
    pending: Arc<Pending>,
    done: bool,
}

impl StreamRx {
    pub(crate) fn new(client: AgentClient, id: u32, rx: UnboundedReceiver<Delivery>, route: &Route) -> Self {
        StreamRx {
            client,
            id,
            rx,
            recv: route.recv.clone(),
            send: route.send.clone(),
            pending: route.pending.clone(),
            done: false,
        }
    }

    /// Stream id.
    pub fn id(&self) -> u32 {
        self.id
    }

    pub(crate) fn client(&self) -> &AgentClient {
        &self.client
    }

    /// Credit window for data the host sends on this stream.
    pub(crate) fn send_window(&self) -> &Arc<CreditWindow> {
        &self.send
    }

    /// Next message; [`ClientError::Closed`] (or the protocol error) when the connection is lost.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Result<(GuestMsg, Bytes), ClientError>> {
        if self.done {
            return Poll::Ready(Err(ClientError::StreamEnded));
        }
        match self.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.done = true;
                Poll::Ready(Err(self.client.shared.closed_error()))
            }
            Poll::Ready(Some(Delivery {
                msg,
                data,
                header_len,
            })) => {
                self.pending.pop(header_len);
                if msg.is_terminal() {
                    self.done = true;
                } else if msg.carries_data() {
                    let cost = crate::data_cost(data.len());
                    self.recv.on_consume(cost);
                    // Losing the credit message only matters if the connection is gone anyway.
                    let _ =
                        self.client
                            .shared
                            .out
                            .send(self.id, &HostMsg::Credit { bytes: cost }, Bytes::new());
                }
                Poll::Ready(Ok((msg, data)))
            }
        }
    }

    /// Next message (see [`StreamRx::poll_recv`]).
    pub async fn recv(&mut self) -> Result<(GuestMsg, Bytes), ClientError> {
        std::future::poll_fn(|cx| self.poll_recv(cx)).await
    }

    /// The stream is over from the host's point of view (terminal seen, or a reply that ends it such as
    /// `Started` for a background exec): forget it without sending `Abandon`.
    pub(crate) fn finish(mut self) {
        self.done = true;
        self.client.shared.remove_route(self.id);
    }

    pub(crate) fn is_done(&self) -> bool {
        self.done
    }
}

impl Drop for StreamRx {
    fn drop(&mut self) {
        self.client.shared.remove_route(self.id);
        if !self.done {
            let _ = self
                .client
                .shared
                .out
                .send(self.id, &HostMsg::Abandon, Bytes::new());
        }
    }
}

impl std::fmt::Debug for StreamRx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamRx")
            .field("id", &self.id)
            .field("done", &self.done)
            .finish()
    }
}
