//! The client over real HTTP against a small in-process stand-in for hearthd: what goes on the wire (auth,
//! paths, query strings, bodies) and how answers (SSE split at awkward places, error bodies, streamed files,
//! a closed port) come back.

#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use futures::StreamExt;
use hearth_api::{CommandEvent, ErrorCode, RunCommandRequest};
use hearth_client::{Client, Error};

#[derive(Default, Clone)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
    fn all(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

/// SSE body delivered in pieces that split a field name, a CRLF pair and a JSON string.
async fn sse(State(seen): State<Seen>, headers: HeaderMap, body: String) -> Response {
    seen.push(format!(
        "accept={} auth={} body={body}",
        headers.get("accept").unwrap().to_str().unwrap(),
        headers.get("authorization").unwrap().to_str().unwrap()
    ));
    let pieces: Vec<&'static [u8]> = vec![
        b"event: start\r\nda",
        b"ta: {\"type\":\"start\",\"pid\":9}\r",
        b"\n\r\n: keep-alive\n\nevent: stdout\ndata: {\"type\":\"stdout\",\"data_b64\":\"AP8=\"}\n\nevent: ex",
        b"it\ndata: {\"type\":\"exit\",\"exit_code\":7}\n\n",
    ];
    let stream = futures::stream::iter(pieces).then(|p| async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok::<_, std::convert::Infallible>(Bytes::from_static(p))
    });
    ([("content-type", "text/event-stream")], Body::from_stream(stream)).into_response()
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        [("content-type", "application/json")],
        r#"{"error":{"code":"not_found","message":"sandbox sbx_0123456789abcdef not found"}}"#,
    )
        .into_response()
}

async fn files(
    State(seen): State<Seen>,
    uri: Uri,
    Query(q): Query<Vec<(String, String)>>,
    method: axum::http::Method,
    body: Bytes,
) -> Response {
    seen.push(format!("{method} {} {:?} {} bytes", uri.path(), q, body.len()));
    if method == axum::http::Method::GET {
        // 1 MiB in 64 KiB pieces.
        let stream = futures::stream::iter(0..16u8)
            .map(|i| Ok::<_, std::convert::Infallible>(Bytes::from(vec![i; 64 * 1024])));
        return Body::from_stream(stream).into_response();
    }
    let info = serde_json::json!({
        "name": "f", "path": "/root/f", "kind": "file", "size": body.len(), "mode": 420, "mtime": 0
    });
    axum::Json(info).into_response()
}

async fn list(State(seen): State<Seen>, uri: Uri) -> Response {
    seen.push(format!("list {}", uri.query().unwrap_or("")));
    axum::Json(serde_json::json!({"sandboxes": []})).into_response()
}

async fn serve(seen: Seen) -> String {
    let app = Router::new()
        .route("/v1/sandboxes", get(list))
        .route("/v1/sandboxes/{id}/commands", post(sse))
        .route("/v1/sandboxes/{id}", get(not_found))
        .route("/v1/sandboxes/{id}/files", any(files))
        .with_state(seen);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

#[tokio::test]
async fn streamed_command_events_arrive_typed_and_in_order() {
    let seen = Seen::default();
    let client = Client::new(&serve(seen.clone()).await, "hk_test").unwrap();
    let req = RunCommandRequest {
        argv: Some(vec!["true".into()]),
        ..Default::default()
    };
    let events: Vec<CommandEvent> = client
        .run_command_stream("sbx_0123456789abcdef", &req)
        .map(|e| e.unwrap())
        .collect()
        .await;
    assert_eq!(
        events,
        vec![
            CommandEvent::Start { pid: 9 },
            CommandEvent::Stdout {
                data_b64: "AP8=".into()
            },
            CommandEvent::Exit {
                exit_code: 7,
                signal: None,
                timed_out: false
            },
        ]
    );
    assert_eq!(hearth_client::decode_output("AP8=").unwrap(), vec![0, 255]);
    assert_eq!(
        seen.all(),
        vec![r#"accept=text/event-stream auth=Bearer hk_test body={"argv":["true"],"background":false}"#]
    );
}

#[tokio::test]
async fn api_errors_keep_status_and_code() {
    let client = Client::new(&serve(Seen::default()).await, "k").unwrap();
    let err = client.get_sandbox("sbx_0123456789abcdef").await.unwrap_err();
    assert!(
        matches!(&err, Error::Api { status: 404, code: ErrorCode::NotFound, message } if message.contains("sbx_")),
        "{err:?}"
    );
    // A stream reports the HTTP error as its only item; a body that is not ours still gives a status and code.
    let base = format!("{}/elsewhere", serve(Seen::default()).await);
    let items = Client::new(&base, "k")
        .unwrap()
        .run_command_stream("sbx_0123456789abcdef", &RunCommandRequest::default())
        .collect::<Vec<_>>()
        .await;
    assert_eq!(items.len(), 1);
    assert!(
        matches!(
            &items[0],
            Err(Error::Api {
                status: 404,
                code: ErrorCode::NotFound,
                ..
            })
        ),
        "{items:?}"
    );
}

#[tokio::test]
async fn list_filters_become_query_pairs() {
    let seen = Seen::default();
    let client = Client::new(&serve(seen.clone()).await, "k").unwrap();
    let filter = hearth_client::ListFilter {
        state: Some(hearth_api::SandboxState::Running),
        metadata: [("team".to_owned(), "a&b".to_owned())].into(),
    };
    assert!(client.list_sandboxes(&filter).await.unwrap().sandboxes.is_empty());
    assert_eq!(seen.all(), vec!["list state=running&metadata.team=a%26b"]);
}

#[tokio::test]
async fn files_stream_both_ways() {
    let seen = Seen::default();
    let client = Client::new(&serve(seen.clone()).await, "k").unwrap();
    let id = "sbx_0123456789abcdef";

    let mut out = Vec::new();
    let n = client.download(id, "/root/big", &mut out).await.unwrap();
    assert_eq!(n, 1024 * 1024);
    assert!(
        out.chunks(64 * 1024)
            .enumerate()
            .all(|(i, c)| c.iter().all(|&b| b == i as u8))
    );

    // Upload from an async reader (a pipe), so the body is streamed with no length known in advance.
    let (mut tx, rx) = tokio::io::duplex(4096);
    let writer = tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        for _ in 0..100 {
            tx.write_all(&[7u8; 3000]).await.unwrap();
        }
    });
    let info = client.upload(id, "/root/f", rx).await.unwrap();
    writer.await.unwrap();
    assert_eq!(info.size, 300_000);

    client.delete_file(id, "/root/d", true).await.unwrap();
    let seen = seen.all();
    assert_eq!(
        seen[0],
        r#"GET /v1/sandboxes/sbx_0123456789abcdef/files [("path", "/root/big")] 0 bytes"#
    );
    assert_eq!(
        seen[1],
        r#"PUT /v1/sandboxes/sbx_0123456789abcdef/files [("path", "/root/f")] 300000 bytes"#
    );
    assert_eq!(
        seen[2],
        r#"DELETE /v1/sandboxes/sbx_0123456789abcdef/files [("path", "/root/d"), ("recursive", "true")] 0 bytes"#
    );
}

#[tokio::test]
async fn a_closed_port_is_a_connect_error() {
    // Bind and drop: the port is then (almost certainly) closed.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let client = Client::new(&format!("http://{addr}"), "k").unwrap();
    let err = client.system().await.unwrap_err();
    assert!(err.is_connect(), "{err:?}");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
}
