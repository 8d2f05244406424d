//! Creates and resumes with the progress of their fetches from the storage bucket streamed as
//! [`SandboxStartEvent`]s (SSE).

use bytes::Bytes;
use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt, TryStreamExt};
use hearth_api::{CreateSandboxRequest, SandboxStartEvent};
use reqwest::header::ACCEPT;
use reqwest::{Method, RequestBuilder, Url};

use crate::sse::SseEvent;
use crate::{Client, Error};

/// The events of one create or resume, ending after its `Done` or `Failed` event (or the first `Err`).
pub type SandboxStartStream = crate::sse::EventStream<SandboxStartEvent>;

impl Client {
    /// `POST /v1/sandboxes` with `Accept: text/event-stream`: creates a sandbox, streaming the progress of what
    /// it fetches from the storage bucket. Nothing is sent until the stream is first polled; an error answered
    /// before anything was fetched is the stream's first and only item; a later failure is a `Failed` event.
    pub fn create_sandbox_stream(&self, req: &CreateSandboxRequest) -> SandboxStartStream {
        let url = self.url(&["v1", "sandboxes"]);
        let builder = self.request(Method::POST, &url).json(req);
        self.start_stream(builder, url)
    }

    /// `POST /v1/sandboxes/{id}/resume` with `Accept: text/event-stream`: like
    /// [`Client::create_sandbox_stream`], for a resume (its paused state may come from the bucket).
    pub fn resume_sandbox_stream(&self, id: &str) -> SandboxStartStream {
        let url = self.url(&["v1", "sandboxes", id, "resume"]);
        let builder = self.request(Method::POST, &url);
        self.start_stream(builder, url)
    }

    fn start_stream(&self, builder: RequestBuilder, url: Url) -> SandboxStartStream {
        let builder = builder.header(ACCEPT, "text/event-stream");
        let client = self.clone();
        let start = async move {
            let resp = client.send(builder, &url).await?;
            Ok::<_, Error>(start_events(crate::sse::event_body(resp)?, url))
        };
        SandboxStartStream::new(stream::once(start).try_flatten().boxed())
    }
}

fn start_events(
    body: BoxStream<'static, Result<Bytes, reqwest::Error>>,
    url: Url,
) -> impl Stream<Item = Result<SandboxStartEvent, Error>> + Send + 'static {
    crate::sse::typed_events(
        body,
        url,
        to_start_event,
        SandboxStartEvent::is_terminal,
        "the event stream ended before the sandbox ran",
    )
}

/// One SSE event as a start event; `None` for event names this client does not know.
fn to_start_event(ev: SseEvent) -> Option<Result<SandboxStartEvent, Error>> {
    if !["fetch", "done", "failed"].contains(&ev.event.as_str()) {
        return None;
    }
    Some(
        serde_json::from_str::<SandboxStartEvent>(&ev.data)
            .map_err(|e| Error::Decode(format!("bad `{}` event: {e}", ev.event))),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use hearth_api::ErrorCode;

    use super::*;

    async fn collect(chunks: &[&'static [u8]]) -> Vec<Result<SandboxStartEvent, Error>> {
        let items: Vec<Result<Bytes, reqwest::Error>> =
            chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
        let url = Url::parse("http://127.0.0.1:1/v1/sandboxes").unwrap();
        start_events(stream::iter(items).boxed(), url).collect().await
    }

    #[tokio::test]
    async fn fetch_events_then_the_result_end_the_stream() {
        let got = collect(&[
            b"event: fetch\ndata: {\"type\":\"fetch\",\"object\":\"snapshots/s\",\"done_bytes\":1,",
            b"\"total_bytes\":4}\n\n: keep-alive\n\nevent: novel\ndata: {}\n\n",
            b"event: failed\ndata: {\"type\":\"failed\",\"code\":\"storage_corrupt\",\"message\":\"m\"}\n\n",
            b"event: fetch\ndata: {\"type\":\"fetch\",\"object\":\"x\",\"done_bytes\":1,\"total_bytes\":1}\n\n",
        ])
        .await;
        let got: Vec<SandboxStartEvent> = got.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(
            got,
            vec![
                SandboxStartEvent::Fetch {
                    object: "snapshots/s".into(),
                    done_bytes: 1,
                    total_bytes: 4
                },
                SandboxStartEvent::Failed {
                    code: ErrorCode::StorageCorrupt,
                    message: "m".into()
                },
            ]
        );
    }

    #[tokio::test]
    async fn a_stream_cut_before_the_result_is_an_error() {
        let got = collect(&[b"event: fetch\ndata: {\"type\":\"fetch\",\"object\":\"o\",\"done_bytes\":0,\"total_bytes\":9}\n\n"]).await;
        assert_eq!(got.len(), 2);
        assert!(matches!(&got[1], Err(Error::Decode(m)) if m.contains("ended")));
    }
}
