//! Directory watches through the daemon on a real VM: `GET .../files/watch` streams what a command in the
//! guest does to a directory, in order; recursive watches pick up new subdirectories; bad paths are refused.

mod common;

use std::time::Duration;

use common::{Daemon, VM_LOCK};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

/// An open watch: the response body read event by event.
struct Watch {
    resp: reqwest::Response,
    buf: Vec<u8>,
}

impl Watch {
    async fn open(d: &Daemon, id: &str, path: &str, recursive: bool) -> Watch {
        let resp = d
            .req(
                Method::GET,
                &format!("/v1/sandboxes/{id}/files/watch?path={path}&recursive={recursive}"),
            )
            .send()
            .await
            .expect("watch request");
        assert_eq!(resp.status(), StatusCode::OK);
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        Watch {
            resp,
            buf: Vec::new(),
        }
    }

    /// The next event as (SSE event name, JSON data); `None` at the end of the body.
    async fn next(&mut self) -> Option<(String, Value)> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let block: Vec<u8> = self.buf.drain(..end + 2).collect();
                let text = String::from_utf8(block).expect("utf-8");
                let mut name = String::new();
                let mut data = String::new();
                for line in text.lines() {
                    if let Some(v) = line.strip_prefix("event:") {
                        name = v.trim().to_owned();
                    } else if let Some(v) = line.strip_prefix("data:") {
                        data.push_str(v.trim());
                    }
                }
                if data.is_empty() {
                    continue; // keep-alive comment
                }
                let v: Value = serde_json::from_str(&data).expect("event json");
                assert_eq!(v["type"], name.as_str(), "event name and type differ");
                return Some((name, v));
            }
            match tokio::time::timeout(Duration::from_secs(60), self.resp.chunk()).await {
                Ok(Ok(Some(chunk))) => self.buf.extend_from_slice(&chunk),
                Ok(Ok(None)) => return None,
                Ok(Err(e)) => panic!("watch body: {e}"),
                Err(_) => panic!("no watch event within 60 s"),
            }
        }
    }

    /// Events as `type path[->new_path]` until `last` is seen (chmod events dropped: their timing depends
    /// on the file system; repeated writes coalesced).
    async fn until(&mut self, last: &str) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        while let Some((name, v)) = self.next().await {
            if name == "chmod" {
                continue;
            }
            let mut s = format!("{name} {}", v["path"].as_str().unwrap_or(""));
            if let Some(n) = v["new_path"].as_str() {
                s.push_str(&format!("->{n}"));
            }
            if out.last() != Some(&s) {
                out.push(s.clone());
            }
            if s == last || name == "end" || name == "error" {
                break;
            }
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_reports_a_commands_changes_in_order() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let id = d
        .create(json!({"template": "minimal", "memory_mib": 256}))
        .await
        .id;
    let r = d.sh(&id, "mkdir -p /srv/w/old && echo x > /srv/f").await;
    assert_eq!(r.exit_code, 0, "{r:?}");

    // Bad paths are refused before any stream starts.
    for (path, status) in [
        ("/srv/missing", StatusCode::NOT_FOUND),
        ("/srv/f", StatusCode::CONFLICT),
        ("relative", StatusCode::BAD_REQUEST),
    ] {
        let resp = d
            // (These paths need no percent-encoding.)
            .req(
                Method::GET,
                &format!("/v1/sandboxes/{id}/files/watch?path={path}"),
            )
            .send()
            .await
            .expect("request");
        assert_eq!(resp.status(), status, "{path}");
    }

    // Flat: create, write, rename, remove, in the order the guest did them.
    let mut w = Watch::open(&d, &id, "/srv/w", false).await;
    let (name, ready) = w.next().await.expect("ready");
    assert_eq!((name.as_str(), ready["path"].as_str()), ("ready", Some("/srv/w")));
    let r = d
        .sh(
            &id,
            "cd /srv/w && echo one > a.txt && sleep 0.2 && echo two >> a.txt && mv a.txt b.txt && rm b.txt \
             && echo hidden > old/inner",
        )
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let events = w.until("remove b.txt").await;
    assert_eq!(
        events,
        [
            "create a.txt",
            "write a.txt",
            "rename a.txt->b.txt",
            "remove b.txt"
        ]
    );
    drop(w);

    // Recursive: an existing subdirectory and a new one (and the file made in it) are covered.
    let mut w = Watch::open(&d, &id, "/srv/w", true).await;
    assert_eq!(w.next().await.expect("ready").0, "ready");
    let r = d
        .sh(
            &id,
            "cd /srv/w && echo 1 > old/f1 && mkdir sub && sleep 0.3 && echo 2 > sub/f2",
        )
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let events = w.until("write sub/f2").await;
    assert_eq!(
        events,
        [
            "create old/f1",
            "write old/f1",
            "create sub",
            "create sub/f2",
            "write sub/f2"
        ]
    );

    // Removing the watched directory ends the stream with `end`.
    let r = d.sh(&id, "rm -r /srv/w").await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let mut last = None;
    while let Some((name, _)) = w.next().await {
        last = Some(name);
    }
    assert_eq!(last.as_deref(), Some("end"));
    d.destroy(&id).await;
}
