//! Template builds with their progress streamed as [`TemplateBuildEvent`]s (SSE).

use bytes::Bytes;
use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt, TryStreamExt};
use hearth_api::{CreateTemplateRequest, TemplateBuildEvent};
use reqwest::header::ACCEPT;
use reqwest::{Method, Url};

use crate::sse::SseEvent;
use crate::{Client, Error};

/// The progress events of one template build, ending after its `Done` or `Failed` event (or the first `Err`).
pub type TemplateBuildStream = crate::sse::EventStream<TemplateBuildEvent>;

impl Client {
    /// `POST /v1/templates` with `Accept: text/event-stream`: saves or builds a template and streams its
    /// progress. Nothing is sent until the stream is first polled; an error answer (a bad request, a taken name)
    /// is the stream's first and only item. A failed build ends with a `Failed` event, not an `Err`.
    pub fn build_template_stream(&self, req: &CreateTemplateRequest) -> TemplateBuildStream {
        let url = self.url(&["v1", "templates"]);
        let builder = self
            .request(Method::POST, &url)
            .header(ACCEPT, "text/event-stream")
            .json(req);
        let client = self.clone();
        let start = async move {
            let resp = client.send(builder, &url).await?;
            Ok::<_, Error>(build_events(crate::sse::event_body(resp)?, url))
        };
        TemplateBuildStream::new(stream::once(start).try_flatten().boxed())
    }
}

fn build_events(
    body: BoxStream<'static, Result<Bytes, reqwest::Error>>,
    url: Url,
) -> impl Stream<Item = Result<TemplateBuildEvent, Error>> + Send + 'static {
    crate::sse::typed_events(
        body,
        url,
        to_build_event,
        TemplateBuildEvent::is_terminal,
        "the event stream ended before the build's result",
    )
}

const KNOWN_EVENTS: [&str; 7] = [
    "started",
    "phase",
    "step_started",
    "step_output",
    "step_finished",
    "done",
    "failed",
];

/// One SSE event as a build event; `None` for event names this client does not know (a newer daemon may add
/// some).
fn to_build_event(ev: SseEvent) -> Option<Result<TemplateBuildEvent, Error>> {
    if !KNOWN_EVENTS.contains(&ev.event.as_str()) {
        return None;
    }
    Some(
        serde_json::from_str::<TemplateBuildEvent>(&ev.data)
            .map_err(|e| Error::Decode(format!("bad `{}` event: {e}", ev.event))),
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use hearth_api::{ErrorCode, OutputStream};

    use super::*;

    async fn collect(chunks: &[&'static [u8]]) -> Vec<Result<TemplateBuildEvent, Error>> {
        let items: Vec<Result<Bytes, reqwest::Error>> =
            chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
        let url = Url::parse("http://127.0.0.1:1/v1/templates").unwrap();
        build_events(stream::iter(items).boxed(), url).collect().await
    }

    #[tokio::test]
    async fn events_in_split_chunks_end_at_the_result() {
        let got = collect(&[
            b"event: started\ndata: {\"type\":\"started\",\"name\":\"t\",\"steps\":1}\n\nevent: step_out",
            b"put\ndata: {\"type\":\"step_output\",\"step\":1,\"stream\":\"stderr\",\"line\":\"hi\"}\n\n",
            b": keep-alive\n\nevent: novel\ndata: {}\n\n",
            b"event: failed\ndata: {\"type\":\"failed\",\"code\":\"guest_error\",\"message\":\"step 1\"}\n\n",
            b"event: phase\ndata: {\"type\":\"phase\",\"phase\":\"saving\"}\n\n",
        ])
        .await;
        let got: Vec<TemplateBuildEvent> = got.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(
            got,
            vec![
                TemplateBuildEvent::Started {
                    name: "t".into(),
                    steps: 1
                },
                TemplateBuildEvent::StepOutput {
                    step: 1,
                    stream: OutputStream::Stderr,
                    line: "hi".into()
                },
                TemplateBuildEvent::Failed {
                    code: ErrorCode::GuestError,
                    message: "step 1".into()
                },
            ]
        );
    }

    #[tokio::test]
    async fn a_cut_stream_and_garbage_are_errors() {
        let got = collect(&[b"event: phase\ndata: {\"type\":\"phase\",\"phase\":\"saving\"}\n\n"]).await;
        assert_eq!(got.len(), 2);
        assert!(matches!(&got[1], Err(Error::Decode(m)) if m.contains("ended")));
        let got = collect(&[b"event: done\ndata: nonsense\n\n"]).await;
        assert!(matches!(&got[..], [Err(Error::Decode(m))] if m.contains("done")));
    }
}
