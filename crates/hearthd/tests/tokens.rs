//! Short-lived access tokens (`POST /v1/tokens`) against the real `hearthd` binary, without VMs: who may mint
//! them and how wide, where each purpose reaches, tampering, expiry, the minting key's revocation, the audit
//! log naming the minting key, and the MCP endpoint serving a `mcp` token (its tools' calls carry the token's
//! rights).

mod common;
mod tenancyfix;

use std::time::Duration;

use common::Daemon;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tenancyfix::{Key, call, create_key, create_project};

const NO_SANDBOX: &str = "sbx_0000000000000000";

async fn mint(d: &Daemon, key: &str, body: Value) -> (StatusCode, Value) {
    let (s, v, _) = call(d, key, Method::POST, "/v1/tokens", Some(body)).await;
    (s, v)
}

async fn token(d: &Daemon, key: &Key, body: Value) -> String {
    let (s, v) = mint(d, &key.key, body).await;
    assert_eq!(s, StatusCode::CREATED, "mint: {v}");
    assert!(v["expires_at"].is_string(), "{v}");
    v["token"].as_str().expect("token").to_string()
}

/// A JSON-RPC request to `/mcp` with `auth`; the answer's status and body text.
async fn mcp(
    d: &Daemon,
    auth: &str,
    session: Option<&str>,
    body: Value,
) -> (StatusCode, String, Option<String>) {
    let mut req = d
        .http
        .post(d.url("/mcp"))
        .bearer_auth(auth)
        .header("accept", "application/json, text/event-stream")
        .json(&body);
    if let Some(s) = session {
        req = req
            .header("mcp-session-id", s)
            .header("mcp-protocol-version", "2025-06-18");
    }
    let resp = req.send().await.expect("mcp");
    let status = resp.status();
    let sid = resp
        .headers()
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    (status, resp.text().await.unwrap_or_default(), sid)
}

#[tokio::test]
async fn tokens_are_never_wider_than_their_key_and_reach_only_their_purpose() {
    let d = Daemon::start().await;
    create_project(&d, "tok-a", json!({})).await;
    let member = create_key(&d, "tok-a", "member", None).await;
    let viewer = create_key(&d, "tok-a", "viewer", None).await;

    // Who may mint, and how wide.
    let (s, v) = mint(&d, &viewer.key, json!({"scope": "project", "purpose": "api"})).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "a viewer key mints nothing: {v}");
    let (s, v) = mint(
        &d,
        &member.key,
        json!({"scope": "project", "purpose": "api", "role": "admin"}),
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "no role above the key's: {v}");
    for ttl in [0, 3601] {
        let (s, v) = mint(
            &d,
            &member.key,
            json!({"scope": "project", "purpose": "api", "ttl_s": ttl}),
        )
        .await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "ttl_s {ttl}: {v}");
    }
    let (s, v) = mint(
        &d,
        &member.key,
        json!({"scope": {"sandbox": NO_SANDBOX}, "purpose": "api"}),
    )
    .await;
    assert_eq!(s, StatusCode::NOT_FOUND, "a sandbox the project lacks: {v}");

    // An API token works like its key, in a header only.
    let api = token(&d, &member, json!({"scope": "project", "purpose": "api"})).await;
    assert!(api.starts_with("ht1."), "{api}");
    let (s, v, _) = call(&d, &api, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, _, _) = call(&d, &api, Method::GET, "/v1/projects/tok-a/usage", None).await;
    assert_eq!(s, StatusCode::OK);
    let in_query = d.url(&format!("/v1/sandboxes?access_token={api}"));
    let s = d.http.get(in_query).send().await.expect("send").status();
    assert_eq!(s, StatusCode::UNAUTHORIZED, "never in a URL");
    // It cannot mint tokens or keys (its life would outlast it).
    let (s, v) = mint(&d, &api, json!({"scope": "project", "purpose": "api"})).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");

    // A viewer token of a member key reads but changes nothing.
    let read_only = token(
        &d,
        &member,
        json!({"scope": "project", "purpose": "api", "role": "viewer"}),
    )
    .await;
    let (s, _, _) = call(&d, &read_only, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, v, _) = call(
        &d,
        &read_only,
        Method::DELETE,
        &format!("/v1/sandboxes/{NO_SANDBOX}"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");

    // Purposes: mcp reaches only /mcp, pty only the terminal route, api not /mcp.
    let mcp_token = token(&d, &member, json!({"scope": "project", "purpose": "mcp"})).await;
    let (s, v, _) = call(&d, &mcp_token, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "{v}");
    let ping = json!({"jsonrpc": "2.0", "id": 1, "method": "ping"});
    let (s, body, _) = mcp(&d, &api, None, ping.clone()).await;
    assert_eq!(s, StatusCode::FORBIDDEN, "an api token on /mcp: {body}");
    let pty = token(&d, &member, json!({"scope": "project", "purpose": "pty"})).await;
    let (s, _, _) = call(&d, &pty, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    // On the terminal route the pty token is accepted as a WebSocket subprotocol: the sandbox is absent (404),
    // not the credential (401).
    let resp = d
        .http
        .get(d.url(&format!("/v1/sandboxes/{NO_SANDBOX}/pty")))
        .header("connection", "upgrade")
        .header("upgrade", "websocket")
        .header("sec-websocket-version", "13")
        .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
        .header(
            "sec-websocket-protocol",
            format!("hearth.pty.v1, hearth.key.{pty}"),
        )
        .send()
        .await
        .expect("pty");
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);

    // Tampered: 401.
    let wider = api.replacen(".member.", ".admin.", 1);
    assert_ne!(wider, api);
    let (s, _, _) = call(&d, &wider, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);

    // Expired: 401.
    let short = token(
        &d,
        &member,
        json!({"scope": "project", "purpose": "api", "ttl_s": 1}),
    )
    .await;
    let (s, _, _) = call(&d, &short, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK);
    let expired = common::wait_until(Duration::from_secs(10), || async {
        call(&d, &short, Method::GET, "/v1/sandboxes", None).await.0 == StatusCode::UNAUTHORIZED
    })
    .await;
    assert!(expired, "a token past its ttl_s is refused");

    // The audit log names the minting key; revoking that key ends its tokens at once.
    let (_, _, rid) = call(
        &d,
        &api,
        Method::DELETE,
        &format!("/v1/sandboxes/{NO_SANDBOX}"),
        None,
    )
    .await;
    let client = hearth_client::Client::new(&format!("http://{}", d.addr), d.key.clone()).expect("client");
    let entries = client.audit_all().await.expect("audit");
    let entry = entries
        .iter()
        .find(|e| e.request_id == rid)
        .expect("the token's request is audited");
    assert_eq!(entry.key_id, member.id);
    assert_eq!(entry.project, "tok-a");
    let (s, v, _) = call(
        &d,
        &d.key,
        Method::DELETE,
        &format!("/v1/keys/{}", member.id),
        None,
    )
    .await;
    assert!(s.is_success(), "revoke: {v}");
    for t in [&api, &read_only, &mcp_token] {
        let (s, _, _) = call(&d, t, Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED);
    }
}

#[tokio::test]
async fn an_mcp_token_serves_mcp_and_its_tools_call_the_api_with_its_rights() {
    let d = Daemon::start().await;
    create_project(&d, "tok-m", json!({})).await;
    let member = create_key(&d, "tok-m", "member", None).await;
    let t = token(&d, &member, json!({"scope": "project", "purpose": "mcp"})).await;
    let init = json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    });
    let (s, body, sid) = mcp(&d, &t, None, init).await;
    assert_eq!(s, StatusCode::OK, "{body}");
    let sid = sid.expect("mcp-session-id");
    let (s, _, _) = mcp(
        &d,
        &t,
        Some(&sid),
        json!({"jsonrpc": "2.0", "method": "notifications/initialized"}),
    )
    .await;
    assert!(s.is_success(), "{s}");
    let (s, body, _) = mcp(
        &d,
        &t,
        Some(&sid),
        json!({"jsonrpc": "2.0", "id": 2, "method": "tools/list"}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert!(body.contains("list_sandboxes"), "{body}");
    // A tool call reaches `/v1` with the token's project and role.
    let (s, body, _) = mcp(
        &d,
        &t,
        Some(&sid),
        json!({"jsonrpc": "2.0", "id": 3, "method": "tools/call",
               "params": {"name": "list_sandboxes", "arguments": {}}}),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert!(!body.contains("\"isError\":true"), "{body}");
}
