//! Async plumbing shared by both ends (feature `io`): a frame reader, a writer task fed by an [`Outbox`], and
//! the two halves of per-stream flow control ([`CreditWindow`] for the sender, [`RecvWindow`] for the
//! receiver).

use std::io;
use std::sync::Mutex;

use bytes::Bytes;
use serde::Serialize;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};

use crate::WINDOW;
use crate::frame::{EncodeError, EncodedFrame, FrameDecoder, FrameError, RawFrame, encode};

/// Reads frames from a byte stream, keeping at most one maximal frame (plus one read) buffered.
pub struct FrameReader<R> {
    inner: R,
    dec: FrameDecoder,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    pub fn new(inner: R) -> Self {
        FrameReader {
            inner,
            dec: FrameDecoder::new(),
        }
    }

    /// The next frame or decode problem; `Ok(None)` at end of stream.
    pub async fn next(&mut self) -> io::Result<Option<Result<RawFrame, FrameError>>> {
        loop {
            match self.dec.decode() {
                Ok(Some(frame)) => return Ok(Some(Ok(frame))),
                Err(e) => return Ok(Some(Err(e))),
                Ok(None) => {}
            }
            let want = self.dec.wants().clamp(1, 64 * 1024);
            let buf = self.dec.buf_mut();
            buf.reserve(want);
            if self.inner.read_buf(buf).await? == 0 {
                return Ok(None);
            }
        }
    }
}

/// The sending side of a connection: frames queued here are written in order by [`write_loop`].
///
/// The queue is unbounded on purpose (a bounded one can deadlock two peers that both wait to write credit);
/// what bounds it is flow control: data frames are only queued once the peer granted credit for them, and
/// other messages are small and answer requests.
#[derive(Debug, Clone)]
pub struct Outbox {
    tx: mpsc::UnboundedSender<EncodedFrame>,
}

/// The connection's writer is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("connection closed")]
pub struct OutboxClosed;

/// Why a message could not be queued.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error(transparent)]
    Closed(#[from] OutboxClosed),
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

impl Outbox {
    /// A new outbox and the receiver to hand to [`write_loop`].
    pub fn new() -> (Outbox, mpsc::UnboundedReceiver<EncodedFrame>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Outbox { tx }, rx)
    }

    /// Encode and queue one message.
    pub fn send<M: Serialize>(&self, stream: u32, msg: &M, data: Bytes) -> Result<(), SendError> {
        let frame = encode(stream, msg, data)?;
        self.tx.send(frame).map_err(|_| OutboxClosed)?;
        Ok(())
    }

    /// True once the writer has stopped.
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }
}

/// Write queued frames until the queue closes or the stream fails; coalesces small frames into one write.
pub async fn write_loop<W: AsyncWrite + Unpin>(
    writer: W,
    mut rx: mpsc::UnboundedReceiver<EncodedFrame>,
) -> io::Result<()> {
    let mut w = tokio::io::BufWriter::with_capacity(64 * 1024, writer);
    while let Some(frame) = rx.recv().await {
        w.write_all(&frame.head).await?;
        w.write_all(&frame.data).await?;
        while let Ok(frame) = rx.try_recv() {
            w.write_all(&frame.head).await?;
            w.write_all(&frame.data).await?;
        }
        w.flush().await?;
    }
    w.shutdown().await.ok();
    Ok(())
}

/// The stream ended (terminal message, abandon, or connection loss) while waiting for credit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stream closed")]
pub struct WindowClosed;

/// Sender side of a stream's flow control: bytes we may still send before the peer grants more.
#[derive(Debug)]
pub struct CreditWindow {
    state: Mutex<(u64, bool)>,
    notify: Notify,
}

impl Default for CreditWindow {
    fn default() -> Self {
        Self::new()
    }
}

impl CreditWindow {
    /// A window with the full initial credit ([`WINDOW`]).
    pub fn new() -> Self {
        CreditWindow {
            state: Mutex::new((WINDOW, false)),
            notify: Notify::new(),
        }
    }

    /// Wait until `n` bytes (at most [`WINDOW`]) may be sent, and take them.
    pub async fn acquire(&self, n: u64) -> Result<(), WindowClosed> {
        let n = n.min(WINDOW);
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
                if st.1 {
                    return Err(WindowClosed);
                }
                if st.0 >= n {
                    st.0 -= n;
                    return Ok(());
                }
            }
            notified.await;
        }
    }

    /// The peer granted `n` more bytes. Credit never accumulates beyond [`WINDOW`], so a peer that grants
    /// too much cannot make us exceed what it promised to buffer.
    pub fn grant(&self, n: u64) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.0 = st.0.saturating_add(n).min(WINDOW);
        drop(st);
        self.notify.notify_waiters();
    }

    /// End the stream: current and future `acquire` calls fail.
    pub fn close(&self) {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1 = true;
        self.notify.notify_waiters();
    }

    pub fn is_closed(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).1
    }
}

/// The peer sent more data than the credit it had.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("peer sent {outstanding} unacknowledged bytes on one stream, more than the 1 MiB window")]
pub struct WindowExceeded {
    pub outstanding: u64,
}

/// Receiver side of a stream's flow control: data received and not yet consumed (credited back).
#[derive(Debug, Default)]
pub struct RecvWindow {
    outstanding: Mutex<u64>,
}

impl RecvWindow {
    pub fn new() -> Self {
        Self::default()
    }

    /// Account for `n` received bytes; fails when the peer exceeded its credit.
    pub fn on_receive(&self, n: u64) -> Result<(), WindowExceeded> {
        let mut o = self.outstanding.lock().unwrap_or_else(|p| p.into_inner());
        let next = o.saturating_add(n);
        if next > WINDOW {
            return Err(WindowExceeded { outstanding: next });
        }
        *o = next;
        Ok(())
    }

    /// `n` bytes were consumed: call this *before* sending the matching `Credit` to the peer.
    pub fn on_consume(&self, n: u64) {
        let mut o = self.outstanding.lock().unwrap_or_else(|p| p.into_inner());
        *o = o.saturating_sub(n);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn credit_window_blocks_until_granted_and_wakes_on_close() {
        let w = Arc::new(CreditWindow::new());
        w.acquire(WINDOW).await.expect("initial window");
        let w2 = w.clone();
        let t = tokio::spawn(async move { w2.acquire(10).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!t.is_finished());
        w.grant(10);
        assert_eq!(t.await.expect("join"), Ok(()));
        let w3 = w.clone();
        let t = tokio::spawn(async move { w3.acquire(10).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        w.close();
        assert_eq!(t.await.expect("join"), Err(WindowClosed));
    }

    #[tokio::test]
    async fn over_granting_is_capped() {
        let w = CreditWindow::new();
        w.grant(u64::MAX);
        w.acquire(WINDOW).await.expect("window");
        let r = tokio::time::timeout(Duration::from_millis(20), w.acquire(1)).await;
        assert!(r.is_err(), "credit beyond the window must not accumulate");
    }

    #[test]
    fn recv_window_detects_overrun() {
        let r = RecvWindow::new();
        r.on_receive(WINDOW).expect("exactly the window");
        assert!(r.on_receive(1).is_err());
        r.on_consume(100);
        r.on_receive(100).expect("credit returned");
    }

    #[tokio::test]
    async fn reader_and_writer_round_trip() {
        let (a, b) = tokio::io::duplex(1024);
        let (outbox, rx) = Outbox::new();
        let writer = tokio::spawn(write_loop(a, rx));
        let payload = Bytes::from(vec![7u8; 200 * 1024]);
        outbox
            .send(9, &crate::GuestMsg::Stdout, payload.clone())
            .expect("send");
        outbox.send(9, &crate::GuestMsg::Ok, Bytes::new()).expect("send");
        drop(outbox);
        let mut reader = FrameReader::new(b);
        let f = reader.next().await.expect("io").expect("frame").expect("valid");
        assert_eq!(f.data, payload);
        let f = reader.next().await.expect("io").expect("frame").expect("valid");
        assert_eq!(
            f.parse::<crate::GuestMsg>().expect("parse").msg,
            crate::GuestMsg::Ok
        );
        assert!(reader.next().await.expect("io").is_none());
        writer.await.expect("join").expect("write");
    }
}
