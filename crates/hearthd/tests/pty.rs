//! Real-VM test of `GET /v1/sandboxes/{id}/pty` with a real WebSocket client (tokio-tungstenite): the
//! agent's terminal in a QEMU guest (`minimal` template), driven through the daemon. Covers the three ways of
//! presenting the key, terminal size and resize (`stty size`), echo of typed input, Ctrl-C interrupting
//! `sleep 100`, the exit message and code, the hang-up when the client goes away, bad requests as HTTP
//! errors, a session ended by a pause, and the resume of a paused sandbox.

mod common;

use std::time::Duration;

use common::{Daemon, VM_LOCK, wait_until};
use futures::{SinkExt, StreamExt};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::http::HeaderValue;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};

type Ws = tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

const T: Duration = Duration::from_secs(30);

enum Auth<'a> {
    Header(&'a str),
    Protocol(&'a str),
    Query(&'a str),
    None,
}

async fn open(d: &Daemon, id: &str, query: &str, auth: Auth<'_>) -> Result<Ws, WsError> {
    let mut url = format!("ws://{}/v1/sandboxes/{id}/pty?{query}", d.addr);
    if let Auth::Query(k) = auth {
        url.push_str(&format!("&access_token={k}"));
    }
    let mut req = url.into_client_request()?;
    let h = req.headers_mut();
    match auth {
        Auth::Header(k) => {
            h.insert(
                "authorization",
                HeaderValue::from_str(&format!("Bearer {k}")).expect("header"),
            );
        }
        Auth::Protocol(k) => {
            let v = format!("hearth.pty.v1, hearth.key.{k}");
            h.insert(
                "sec-websocket-protocol",
                HeaderValue::from_str(&v).expect("header"),
            );
        }
        Auth::Query(_) | Auth::None => {}
    }
    let (ws, resp) = tokio_tungstenite::connect_async(req).await?;
    if matches!(auth, Auth::Protocol(_)) {
        // The server picks the plain protocol, never echoes the key.
        assert_eq!(
            resp.headers()
                .get("sec-websocket-protocol")
                .and_then(|v| v.to_str().ok()),
            Some("hearth.pty.v1")
        );
    }
    Ok(ws)
}

fn http_status(e: &WsError) -> Option<u16> {
    match e {
        WsError::Http(resp) => Some(resp.status().as_u16()),
        _ => None,
    }
}

/// Reads until the output contains `want`.
async fn until(ws: &mut Ws, seen: &mut String, want: &str) {
    let fut = async {
        while !seen.contains(want) {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => seen.push_str(&String::from_utf8_lossy(&b)),
                other => panic!("waiting for {want:?}: {other:?}\noutput:\n{seen}"),
            }
        }
    };
    if tokio::time::timeout(T, fut).await.is_err() {
        panic!("no {want:?} in time; output:\n{seen}");
    }
}

/// Reads to the exit message and the close; returns the exit message.
async fn exit_message(ws: &mut Ws, seen: &mut String) -> Value {
    let fut = async {
        let mut exit = None;
        loop {
            match ws.next().await {
                Some(Ok(Message::Binary(b))) => seen.push_str(&String::from_utf8_lossy(&b)),
                Some(Ok(Message::Text(t))) => exit = Some(serde_json::from_str::<Value>(&t).expect("json")),
                Some(Ok(Message::Close(_))) | None => return exit.expect("exit message before close"),
                other => panic!("{other:?}"),
            }
        }
    };
    tokio::time::timeout(T, fut).await.expect("exit in time")
}

async fn send(ws: &mut Ws, bytes: &[u8]) {
    ws.send(Message::Binary(bytes.to_vec().into()))
        .await
        .expect("send");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_over_websocket() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let id = d
        .create(json!({"template": "minimal", "memory_mib": 256}))
        .await
        .id;

    // Authentication: none is refused before any upgrade; a wrong key too.
    let e = open(&d, &id, "", Auth::None).await.expect_err("no key");
    assert_eq!(http_status(&e), Some(401), "{e}");
    let e = open(&d, &id, "", Auth::Protocol("hk_wrong"))
        .await
        .expect_err("wrong key");
    assert_eq!(http_status(&e), Some(401), "{e}");
    // Bad requests and unknown sandboxes are HTTP errors, not sockets.
    let e = open(&d, &id, "rows=0", Auth::Header(&d.key))
        .await
        .expect_err("rows=0");
    assert_eq!(http_status(&e), Some(400), "{e}");
    let e = open(&d, &id, "env=notjson", Auth::Header(&d.key))
        .await
        .expect_err("bad env");
    assert_eq!(http_status(&e), Some(400), "{e}");
    let e = open(&d, "sbx_00000000000000ff", "", Auth::Header(&d.key))
        .await
        .expect_err("unknown sandbox");
    assert_eq!(http_status(&e), Some(404), "{e}");

    // The default shell, with the key as a subprotocol entry (what browsers do).
    let mut ws = open(&d, &id, "rows=24&cols=80", Auth::Protocol(&d.key))
        .await
        .expect("open");
    let mut seen = String::new();
    send(&mut ws, b"stty size; echo term=$TERM\n").await;
    until(&mut ws, &mut seen, "24 80").await;
    until(&mut ws, &mut seen, "term=xterm-256color").await;
    let resize = json!({"type": "resize", "rows": 40, "cols": 120}).to_string();
    ws.send(Message::Text(resize.into())).await.expect("resize");
    send(&mut ws, b"stty size\n").await;
    until(&mut ws, &mut seen, "40 120").await;
    // Typed input is echoed by the terminal; the output follows.
    send(&mut ws, b"echo 'ab''cd'\n").await;
    until(&mut ws, &mut seen, "echo 'ab''cd'").await;
    until(&mut ws, &mut seen, "\nabcd").await;
    // Ctrl-C reaches the foreground job through the terminal.
    send(&mut ws, b"sleep 100\n").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let started = std::time::Instant::now();
    send(&mut ws, b"\x03").await;
    send(&mut ws, b"echo status=$?\n").await;
    until(&mut ws, &mut seen, "status=130").await;
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "sleep 100 was not interrupted"
    );
    send(&mut ws, b"exit 5\n").await;
    let exit = exit_message(&mut ws, &mut seen).await;
    assert_eq!(exit["type"], "exit");
    assert_eq!(exit["exit_code"], 5, "{exit}");

    // A command with cwd and env; a signal message ends it. A key in the query string is refused (keys stay
    // out of URLs): the key goes in the subprotocol.
    let env = "%7B%22GREETING%22%3A%22hi%22%7D";
    let q = format!("cmd=echo+$GREETING+$(pwd);+sleep+100&cwd=/tmp&env={env}");
    match open(&d, &id, &q, Auth::Query(&d.key)).await {
        Err(WsError::Http(resp)) => assert_eq!(resp.status(), 401),
        Err(e) => panic!("expected 401, got {e}"),
        Ok(_) => panic!("a key in the URL opened a terminal"),
    }
    let mut ws = open(&d, &id, &q, Auth::Protocol(&d.key)).await.expect("open");
    let mut seen = String::new();
    until(&mut ws, &mut seen, "hi /tmp").await;
    ws.send(Message::Text(
        json!({"type": "signal", "signal": 9}).to_string().into(),
    ))
    .await
    .expect("signal");
    let exit = exit_message(&mut ws, &mut seen).await;
    assert_eq!(
        (exit["exit_code"].as_i64(), exit["signal"].as_i64()),
        (Some(137), Some(9)),
        "{exit}"
    );

    // A client that goes away hangs the session up: its processes end in the guest.
    let mut ws = open(&d, &id, "cmd=echo+started;+sleep+1234", Auth::Header(&d.key))
        .await
        .expect("open");
    let mut seen = String::new();
    until(&mut ws, &mut seen, "started").await;
    assert!(d.sh(&id, "ps").await.stdout.contains("sleep 1234"));
    drop(ws);
    let gone = wait_until(Duration::from_secs(20), || async {
        !d.sh(&id, "ps").await.stdout.contains("sleep 1234")
    })
    .await;
    assert!(gone, "the session outlived its socket");

    // A terminal does not survive a pause: its socket is closed with 1011 and no exit message.
    let mut ws = open(&d, &id, "cmd=echo+started;+sleep+4444", Auth::Header(&d.key))
        .await
        .expect("open");
    let mut seen = String::new();
    until(&mut ws, &mut seen, "started").await;
    let resp = d
        .req(Method::POST, &format!("/v1/sandboxes/{id}/pause"))
        .send()
        .await
        .expect("pause");
    assert_eq!(
        resp.status(),
        StatusCode::OK,
        "{}",
        resp.text().await.unwrap_or_default()
    );
    let end = tokio::time::timeout(T, async {
        loop {
            match ws.next().await {
                Some(Ok(Message::Binary(_) | Message::Ping(_))) => {}
                other => return other,
            }
        }
    })
    .await
    .expect("the socket ends when the sandbox pauses");
    match end {
        Some(Ok(Message::Close(Some(frame)))) => assert_eq!(u16::from(frame.code), 1011, "{frame:?}"),
        // The connection may also just drop.
        None | Some(Err(_)) => {}
        other => panic!("unexpected end of a paused terminal: {other:?}"),
    }

    // A paused sandbox is resumed by the terminal request; the old session's processes are gone.
    let mut ws = open(&d, &id, "cmd=echo+awake;+exit+0", Auth::Header(&d.key))
        .await
        .expect("open after pause");
    let mut seen = String::new();
    let exit = exit_message(&mut ws, &mut seen).await;
    assert!(seen.contains("awake"), "{seen}");
    assert_eq!(exit["exit_code"], 0);
    let gone = wait_until(Duration::from_secs(20), || async {
        !d.sh(&id, "ps").await.stdout.contains("sleep 4444")
    })
    .await;
    assert!(gone, "a session from before the pause still runs");

    d.destroy(&id).await;
}
