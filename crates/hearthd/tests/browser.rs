//! A real headless Chromium (Debian's `chromium-headless-shell`, installed by scripts/install-test-deps.sh)
//! loads a page from an origin the daemon allows (`--cors-origin`); the page's script calls `/mcp`
//! (initialize, then tools/list over the streamable HTTP transport) with a short-lived `mcp` token in
//! `Authorization` and writes the outcome into the DOM, which the test reads (`--dump-dom`). The same page from
//! another origin is refused by the browser (the daemon allows that origin no CORS). Everything is on
//! 127.0.0.1.

mod common;
mod tenancyfix;

use std::path::PathBuf;
use std::time::Duration;

use common::Daemon;
use reqwest::{Method, StatusCode};
use serde_json::json;
use tenancyfix::{call, create_key, create_project};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The page: synchronous XHRs (so the script has finished when `--dump-dom` prints the DOM), then the outcome
/// in `<pre id="out">`.
fn page(api: &str, token: &str) -> String {
    format!(
        r#"<!doctype html><html><body><pre id="out">pending</pre><script>
const out = document.getElementById("out");
function rpc(body, session) {{
  const x = new XMLHttpRequest();
  x.open("POST", "{api}/mcp", false);
  x.setRequestHeader("Authorization", "Bearer {token}");
  x.setRequestHeader("Content-Type", "application/json");
  x.setRequestHeader("Accept", "application/json, text/event-stream");
  if (session) {{
    x.setRequestHeader("Mcp-Session-Id", session);
    x.setRequestHeader("Mcp-Protocol-Version", "2025-06-18");
  }}
  x.send(JSON.stringify(body));
  return x;
}}
function result(x) {{
  // JSON, or one server-sent event whose data is the JSON-RPC answer.
  const t = x.responseText;
  // (The stream may open with an event whose data is empty.)
  const line = t.split("\n").find(l => l.startsWith("data:") && l.slice(5).trim().startsWith("{{"));
  return JSON.parse(line ? line.slice(5) : t);
}}
try {{
  const init = rpc({{jsonrpc: "2.0", id: 1, method: "initialize", params: {{
    protocolVersion: "2025-06-18", capabilities: {{}}, clientInfo: {{name: "browser-test", version: "1"}}}}}});
  if (init.status !== 200) throw new Error("initialize: HTTP " + init.status);
  const session = init.getResponseHeader("Mcp-Session-Id");
  rpc({{jsonrpc: "2.0", method: "notifications/initialized"}}, session);
  const list = rpc({{jsonrpc: "2.0", id: 2, method: "tools/list"}}, session);
  const tools = result(list).result.tools.map(t => t.name);
  out.textContent = "TOOLS " + tools.join(",");
}} catch (e) {{
  out.textContent = "REFUSED " + e;
}}
</script></body></html>"#
    )
}

/// Serves `html` to every request on `listener` (a tiny HTTP/1.1 server: one answer per connection).
fn serve(listener: TcpListener, html: String) {
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let html = html.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                    match conn.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => buf.extend_from_slice(&chunk[..n]),
                    }
                }
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    html.len()
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(html.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
}

fn chromium() -> PathBuf {
    for name in ["chromium-headless-shell", "chromium"] {
        for dir in ["/usr/bin", "/usr/local/bin"] {
            let p = PathBuf::from(dir).join(name);
            if p.is_file() {
                return p;
            }
        }
    }
    panic!(
        "no headless Chromium: install Debian's chromium-headless-shell (bash scripts/install-test-deps.sh)"
    );
}

/// The DOM of `url` after its scripts ran, as Chromium prints it.
async fn dump_dom(url: &str) -> String {
    let profile = tempfile::tempdir().expect("profile dir");
    let mut cmd = tokio::process::Command::new(chromium());
    cmd.arg("--headless")
        // The test machines run as root, where Chromium refuses to start with its sandbox on.
        .arg("--no-sandbox")
        .arg("--disable-gpu")
        .arg("--no-proxy-server")
        .arg("--no-first-run")
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("--dump-dom")
        .arg(url)
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(180), cmd.output())
        .await
        .expect("chromium finished within 180 s")
        .expect("chromium runs");
    let dom = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        dom.contains("id=\"out\""),
        "chromium printed no DOM (status {}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    dom
}

#[tokio::test]
async fn a_browser_page_of_an_allowed_origin_lists_mcp_tools_with_a_token_and_another_origin_is_refused() {
    let allowed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let other = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let allowed_origin = format!("http://{}", allowed.local_addr().expect("addr"));
    let other_origin = format!("http://{}", other.local_addr().expect("addr"));
    let d = Daemon::start_with(&["--network", "off", "--cors-origin", &allowed_origin]).await;
    create_project(&d, "web", json!({})).await;
    let member = create_key(&d, "web", "member", None).await;
    let (s, v, _) = call(
        &d,
        &member.key,
        Method::POST,
        "/v1/tokens",
        Some(json!({"scope": "project", "purpose": "mcp", "ttl_s": 600})),
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let token = v["token"].as_str().expect("token").to_string();
    let api = format!("http://{}", d.addr);
    serve(allowed, page(&api, &token));
    serve(other, page(&api, &token));

    let dom = dump_dom(&format!("{allowed_origin}/")).await;
    assert!(
        dom.contains("TOOLS ") && dom.contains("create_sandbox") && dom.contains("list_sandboxes"),
        "the allowed origin's page lists the tools: {dom}"
    );

    let dom = dump_dom(&format!("{other_origin}/")).await;
    assert!(
        dom.contains("REFUSED") && !dom.contains("list_sandboxes"),
        "another origin's page is refused: {dom}"
    );
    // What the browser was told: no CORS allowance for that origin (loopback origins pass the daemon's own
    // Origin check, so the refusal is the browser's, on the daemon's word).
    let preflight = d
        .http
        .request(Method::OPTIONS, d.url("/mcp"))
        .header("origin", &other_origin)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization, content-type")
        .send()
        .await
        .expect("preflight");
    assert!(preflight.headers().get("access-control-allow-origin").is_none());
    let preflight = d
        .http
        .request(Method::OPTIONS, d.url("/mcp"))
        .header("origin", &allowed_origin)
        .header("access-control-request-method", "POST")
        .header("access-control-request-headers", "authorization, content-type")
        .send()
        .await
        .expect("preflight");
    assert_eq!(
        preflight
            .headers()
            .get("access-control-allow-origin")
            .and_then(|v| v.to_str().ok()),
        Some(allowed_origin.as_str())
    );
}
