//! Directory watches: `GET .../files/watch` as a [`WatchStream`] of [`WatchEvent`]s.

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use hearth_api::WatchEvent;
use reqwest::header::ACCEPT;
use reqwest::{Method, Url};

use crate::{Client, Error};

/// The events of one directory watch: `Ready` first, then changes, until the stream is dropped (which stops
/// the watch), or it ends after `End` or `Error` (or the first `Err`).
pub type WatchStream = crate::sse::EventStream<WatchEvent>;

impl Client {
    /// Watches directory `path` in sandbox `id` (and its subdirectories with `recursive`). Returns once the
    /// daemon accepted the watch, so an error such as `not_found` comes from this call; the first event is
    /// `Ready`, after which every change is reported.
    pub async fn watch_dir(&self, id: &str, path: &str, recursive: bool) -> Result<WatchStream, Error> {
        let mut url = self.url(&["v1", "sandboxes", id, "files", "watch"]);
        url.query_pairs_mut()
            .append_pair("path", path)
            .append_pair("recursive", if recursive { "true" } else { "false" });
        let builder = self
            .request(Method::GET, &url)
            .header(ACCEPT, "text/event-stream");
        let resp = self.send(builder, &url).await?;
        let body = crate::sse::event_body(resp)?;
        Ok(WatchStream::new(watch_events(body, url).boxed()))
    }
}

fn watch_events(
    body: BoxStream<'static, Result<Bytes, reqwest::Error>>,
    url: Url,
) -> impl Stream<Item = Result<WatchEvent, Error>> + Send + 'static {
    // Events this client does not know (a newer daemon) are skipped.
    crate::sse::typed_events(
        body,
        url,
        |ev| serde_json::from_str::<WatchEvent>(&ev.data).ok().map(Ok),
        WatchEvent::is_terminal,
        "the watch stream ended without an end event",
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn events_are_parsed_and_the_stream_ends_after_end() {
        let chunks: Vec<Result<Bytes, reqwest::Error>> =
            vec![
            Ok(Bytes::from_static(
                b"event: ready\ndata: {\"type\":\"ready\",\"path\":\"/w\",\"recursive\":false}\n\n",
            )),
            Ok(Bytes::from_static(b": keep-alive\n\nevent: create\ndata: {\"type\":\"create\",")),
            Ok(Bytes::from_static(
                b"\"path\":\"a\",\"is_dir\":false}\n\nevent: future\ndata: {\"type\":\"future\"}\n\n",
            )),
            Ok(Bytes::from_static(
                b"event: end\ndata: {\"type\":\"end\"}\n\nevent: create\ndata: {\"type\":\"overflow\"}\n\n",
            )),
        ];
        let url = Url::parse("http://127.0.0.1:1/x").unwrap();
        let got: Vec<WatchEvent> = watch_events(futures::stream::iter(chunks).boxed(), url)
            .map(|r| r.unwrap())
            .collect()
            .await;
        assert_eq!(
            got,
            vec![
                WatchEvent::Ready {
                    path: "/w".into(),
                    recursive: false
                },
                WatchEvent::Create {
                    path: "a".into(),
                    is_dir: false
                },
                WatchEvent::End,
            ]
        );
    }
}
