use bytes::Bytes;
use futures::stream::{self, BoxStream};
use futures::{Stream, StreamExt, TryStreamExt};
use hearth_api::{
    BackgroundStarted, CommandEvent, CommandResult, KillProcessRequest, ProcessList, RunCommandRequest,
};
use reqwest::header::{ACCEPT, CONTENT_TYPE};
use reqwest::{Method, Url};

use crate::sse::SseEvent;
use crate::{Client, Error};

/// The events of one streamed command, ending after its `Exit` or `Error` event (or the first `Err`).
pub type CommandStream = crate::sse::EventStream<CommandEvent>;

impl Client {
    /// Runs a command to completion and returns its buffered output. `req.background` is ignored (use
    /// [`Client::start_background`]).
    pub async fn run_command(&self, id: &str, req: &RunCommandRequest) -> Result<CommandResult, Error> {
        let req = RunCommandRequest {
            background: false,
            ..req.clone()
        };
        self.call(Method::POST, self.commands_url(id), Some(&req)).await
    }

    /// Starts a command in the background and returns its pid at once.
    pub async fn start_background(&self, id: &str, req: &RunCommandRequest) -> Result<u32, Error> {
        let req = RunCommandRequest {
            background: true,
            ..req.clone()
        };
        let started: BackgroundStarted = self.call(Method::POST, self.commands_url(id), Some(&req)).await?;
        Ok(started.pid)
    }

    /// Runs a command and streams its events as they happen (SSE). Nothing is sent until the stream is first
    /// polled; an HTTP error is the stream's first and only item. `req.background` is ignored.
    pub fn run_command_stream(&self, id: &str, req: &RunCommandRequest) -> CommandStream {
        let req = RunCommandRequest {
            background: false,
            ..req.clone()
        };
        let url = self.commands_url(id);
        let builder = self
            .request(Method::POST, &url)
            .header(ACCEPT, "text/event-stream")
            .json(&req);
        let client = self.clone();
        let start = async move {
            let resp = client.send(builder, &url).await?;
            Ok::<_, Error>(command_events(crate::sse::event_body(resp)?, url))
        };
        CommandStream::new(stream::once(start).try_flatten().boxed())
    }

    /// `GET .../processes`.
    pub async fn list_processes(&self, id: &str) -> Result<ProcessList, Error> {
        let url = self.url(&["v1", "sandboxes", id, "processes"]);
        self.call::<(), _>(Method::GET, url, None).await
    }

    /// Waits for a process to exit and returns its status and output tail. With `timeout_s`, gives up after
    /// that many seconds with a `conflict` error if it still runs.
    pub async fn wait_process(
        &self,
        id: &str,
        pid: u32,
        timeout_s: Option<u64>,
    ) -> Result<CommandResult, Error> {
        let mut url = self.process_url(id, pid, "wait");
        if let Some(t) = timeout_s {
            url.query_pairs_mut().append_pair("timeout_s", &t.to_string());
        }
        self.call::<(), _>(Method::POST, url, None).await
    }

    /// Sends `signal` (default SIGKILL) to a process.
    pub async fn kill_process(&self, id: &str, pid: u32, signal: Option<i32>) -> Result<(), Error> {
        let url = self.process_url(id, pid, "kill");
        self.call_no_content(Method::POST, url, Some(&KillProcessRequest { signal }))
            .await
    }

    /// Writes bytes to a process's stdin; `eof` closes it afterwards.
    pub async fn write_stdin(
        &self,
        id: &str,
        pid: u32,
        data: impl Into<reqwest::Body>,
        eof: bool,
    ) -> Result<(), Error> {
        let mut url = self.process_url(id, pid, "stdin");
        url.query_pairs_mut()
            .append_pair("eof", if eof { "true" } else { "false" });
        let builder = self
            .request(Method::POST, &url)
            .header(CONTENT_TYPE, "application/octet-stream")
            .body(data);
        let resp = self.send(builder, &url).await?;
        drop(resp);
        Ok(())
    }

    fn commands_url(&self, id: &str) -> Url {
        self.url(&["v1", "sandboxes", id, "commands"])
    }

    fn process_url(&self, id: &str, pid: u32, action: &str) -> Url {
        self.url(&["v1", "sandboxes", id, "processes", &pid.to_string(), action])
    }
}

/// Decodes a chunk of command output carried base64-encoded in `Stdout`/`Stderr` events.
pub fn decode_output(data_b64: &str) -> Result<Vec<u8>, Error> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD
        .decode(data_b64)
        .map_err(|e| Error::Decode(format!("output chunk is not base64: {e}")))
}

/// Turns an SSE byte stream into command events (the stream ends after `exit` or `error`).
fn command_events(
    body: BoxStream<'static, Result<Bytes, reqwest::Error>>,
    url: Url,
) -> impl Stream<Item = Result<CommandEvent, Error>> + Send + 'static {
    crate::sse::typed_events(
        body,
        url,
        to_command_event,
        |e| matches!(e, CommandEvent::Exit { .. } | CommandEvent::Error { .. }),
        "the event stream ended before the command's exit event",
    )
}

const KNOWN_EVENTS: [&str; 5] = ["start", "stdout", "stderr", "exit", "error"];

/// Maps one SSE event to a command event; `None` for events this client does not know (skipped, so a newer
/// daemon may add some).
pub(crate) fn to_command_event(ev: SseEvent) -> Option<Result<CommandEvent, Error>> {
    if let Ok(parsed) = serde_json::from_str::<CommandEvent>(&ev.data) {
        return Some(Ok(parsed));
    }
    if !KNOWN_EVENTS.contains(&ev.event.as_str()) {
        return None;
    }
    // Tolerate a daemon that names the variant only in `event:` and leaves `type` out of the data.
    let decoded = serde_json::from_str::<serde_json::Value>(&ev.data).and_then(|mut value| {
        if let Some(obj) = value.as_object_mut() {
            obj.entry("type")
                .or_insert_with(|| serde_json::Value::String(ev.event.clone()));
        }
        serde_json::from_value::<CommandEvent>(value)
    });
    Some(decoded.map_err(|e| Error::Decode(format!("bad `{}` event: {e}", ev.event))))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn body_of(chunks: &[&'static [u8]]) -> BoxStream<'static, Result<Bytes, reqwest::Error>> {
        let items: Vec<Result<Bytes, reqwest::Error>> =
            chunks.iter().map(|c| Ok(Bytes::from_static(c))).collect();
        stream::iter(items).boxed()
    }

    fn url() -> Url {
        Url::parse("http://127.0.0.1:1/v1/sandboxes/x/commands").unwrap()
    }

    async fn collect(chunks: &[&'static [u8]]) -> Vec<Result<CommandEvent, Error>> {
        command_events(body_of(chunks), url()).collect().await
    }

    #[tokio::test]
    async fn a_split_stream_yields_typed_events_and_stops_at_exit() {
        let got = collect(&[
            b"event: start\ndata: {\"type\":\"start\",\"pid\":42}\n",
            b"\n: ping\n\nevent: stdout\ndata: {\"type\":\"stdout\",\"data",
            b"_b64\":\"aGk=\"}\n\nevent: exit\ndata: {\"type\":\"exit\",\"exit_code\":7}\n\n",
            b"event: stdout\ndata: {\"type\":\"stdout\",\"data_b64\":\"eA==\"}\n\n",
        ])
        .await;
        let got: Vec<CommandEvent> = got.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(
            got,
            vec![
                CommandEvent::Start { pid: 42 },
                CommandEvent::Stdout {
                    data_b64: "aGk=".into()
                },
                CommandEvent::Exit {
                    exit_code: 7,
                    signal: None,
                    timed_out: false
                },
            ]
        );
        assert_eq!(decode_output("aGk=").unwrap(), b"hi");
    }

    #[tokio::test]
    async fn missing_type_is_taken_from_the_event_name_and_unknown_events_are_skipped() {
        let got = collect(&[
            b"event: progress\ndata: {\"whatever\":1}\n\n",
            b"event: exit\ndata: {\"exit_code\":0,\"timed_out\":true}\n\n",
        ])
        .await;
        assert_eq!(got.len(), 1);
        assert!(matches!(
            got[0],
            Ok(CommandEvent::Exit {
                exit_code: 0,
                timed_out: true,
                ..
            })
        ));
    }

    #[tokio::test]
    async fn garbage_and_truncation_are_errors() {
        let got = collect(&[b"event: stdout\ndata: not json\n\n"]).await;
        assert_eq!(got.len(), 1);
        assert!(matches!(&got[0], Err(Error::Decode(m)) if m.contains("stdout")));

        let got = collect(&[b"event: start\ndata: {\"type\":\"start\",\"pid\":1}\n\n"]).await;
        assert_eq!(got.len(), 2);
        assert!(matches!(&got[1], Err(Error::Decode(m)) if m.contains("ended")));
    }

    #[test]
    fn bad_base64_is_a_decode_error() {
        assert!(matches!(decode_output("***"), Err(Error::Decode(_))));
    }
}
