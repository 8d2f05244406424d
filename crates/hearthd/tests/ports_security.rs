//! Exposed ports on real VMs: cookies neither reach a guest nor come back from it (every sandbox is served
//! from the API's origin), port tokens are revoked at once and stay revoked over a restart, and a token scoped
//! to one sandbox opens that sandbox (API and ports) and no other.

#![allow(clippy::unwrap_used)]

mod common;
mod netfix;

use common::Daemon;
use netfix::FakeInternet;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

const TEMPLATE: &str = "debian";

/// A guest server on port 8000 that sets a cookie and echoes the `Cookie` it received.
const COOKIE_SERVER: &str = r#"
import http.server
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("cookie=" + (self.headers.get("Cookie") or "none")).encode()
        self.send_response(200)
        self.send_header("Set-Cookie", "session=guest-secret; Path=/")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"#;

async fn port_get(d: &Daemon, path: &str, auth: Option<&str>) -> reqwest::Response {
    let mut req = d.http.get(d.url(path)).header("cookie", "session=other-sandbox");
    if let Some(a) = auth {
        req = req.bearer_auth(a);
    }
    req.send().await.unwrap()
}

async fn port_token(d: &Daemon, id: &str) -> String {
    let v: Value = d
        .req(Method::POST, &format!("/v1/sandboxes/{id}/ports/8000/token"))
        .json(&json!({"ttl_s": 600}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["token"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn exposed_ports_drop_cookies_revoke_tokens_and_honour_sandbox_scoped_tokens() {
    let _vm = common::VM_LOCK.lock().await;
    let fi = FakeInternet::new();
    let flags = fi.daemon_flags("10.213.31.0/24");
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let mut d = Daemon::start_with(&flags).await;
    let web = d.create(json!({"template": TEMPLATE})).await;
    let other = d.create(json!({"template": TEMPLATE})).await;
    let (s, _) = d
        .put_file(&web.id, "/root/srv.py", COOKIE_SERVER.as_bytes().to_vec())
        .await;
    assert!(s.is_success());
    let (s, body) = d
        .run_raw(
            &web.id,
            json!({"cmd": "exec python3 /root/srv.py >/dev/null 2>&1", "background": true}),
        )
        .await;
    assert_eq!(s, StatusCode::ACCEPTED, "{body}");
    let path = format!("/v1/sandboxes/{}/ports/8000/", web.id);
    let up = common::wait_until(std::time::Duration::from_secs(60), || async {
        port_get(&d, &path, Some(&d.key)).await.status() == StatusCode::OK
    })
    .await;
    assert!(up, "the guest server answers");

    // Cookies: the browser's cookie does not reach the guest, the guest's cookie does not reach the browser.
    let resp = port_get(&d, &path, Some(&d.key)).await;
    assert!(resp.headers().get("set-cookie").is_none(), "{:?}", resp.headers());
    assert_eq!(resp.text().await.unwrap(), "cookie=none");

    // Port tokens: revoked at once, new ones work, revocation survives a restart.
    let old = port_token(&d, &web.id).await;
    let with_token = |t: &str| format!("{path}?hearth_token={t}");
    assert_eq!(
        port_get(&d, &with_token(&old), None).await.status(),
        StatusCode::OK
    );
    let resp = d
        .req(
            Method::DELETE,
            &format!("/v1/sandboxes/{}/ports/8000/token", web.id),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::NO_CONTENT);
    assert_eq!(
        port_get(&d, &with_token(&old), None).await.status(),
        StatusCode::UNAUTHORIZED
    );
    let new = port_token(&d, &web.id).await;
    assert_eq!(
        port_get(&d, &with_token(&new), None).await.status(),
        StatusCode::OK
    );
    d.kill9_and_restart().await;
    assert_eq!(
        port_get(&d, &with_token(&old), None).await.status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        port_get(&d, &with_token(&new), None).await.status(),
        StatusCode::OK
    );

    // A token for one sandbox: that sandbox's routes and ports; 404 for another sandbox, 403 elsewhere.
    let v: Value = d
        .req(Method::POST, "/v1/tokens")
        .json(&json!({"scope": {"sandbox": web.id}, "purpose": "api"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let t = v["token"].as_str().unwrap().to_string();
    let get = |p: String| {
        let t = t.clone();
        let d = &d;
        async move {
            d.http
                .get(d.url(&p))
                .bearer_auth(t)
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    assert_eq!(get(format!("/v1/sandboxes/{}", web.id)).await, StatusCode::OK);
    assert_eq!(
        get(format!("/v1/sandboxes/{}", other.id)).await,
        StatusCode::NOT_FOUND
    );
    assert_eq!(get("/v1/sandboxes".into()).await, StatusCode::FORBIDDEN);
    assert_eq!(port_get(&d, &path, Some(&t)).await.status(), StatusCode::OK);
    let other_port = format!("/v1/sandboxes/{}/ports/8000/", other.id);
    assert_eq!(
        port_get(&d, &other_port, Some(&t)).await.status(),
        StatusCode::NOT_FOUND
    );

    d.destroy(&web.id).await;
    d.destroy(&other.id).await;
}
