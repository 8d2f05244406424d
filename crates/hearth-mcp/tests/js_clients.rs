//! The official TypeScript MCP clients against the real `hearth mcp` (stdio) and the real daemon's `/mcp`
//! (streamable HTTP), configured exactly as docs/mcp.md tells users to: `@modelcontextprotocol/sdk` (v1,
//! protocol 2025-11-25 with the initialize handshake and sessions) runs a full sandbox cycle on a real VM per
//! transport; `@modelcontextprotocol/client` (v2) pinned to the stateless 2026-07-28 revision lists the tools
//! and calls them. The script is tests/js/client.mjs; `npm ci` installs the clients from the lock file.

#![allow(clippy::unwrap_used)]

mod support;

use std::process::Command;

use support::{Daemon, TestNetns, js_dir, npm_ci};

/// Runs `node client.mjs SDK TRANSPORT MODE` against `config` (one server entry of docs/mcp.md).
fn run_client(daemon: &Daemon, sdk: &str, transport: &str, mode: &str, config: &serde_json::Value) {
    npm_ci();
    let out = Command::new("node")
        .args(["client.mjs", sdk, transport, mode])
        .current_dir(js_dir())
        .env("HEARTH_MCP_CONFIG", config.to_string())
        .output()
        .expect("node runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{sdk}/{transport}/{mode} failed ({}):\n{}{stderr}\n---- hearthd log ----\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        daemon.log()
    );
    assert!(stderr.contains(&format!("[{sdk}/{transport}] ok")), "{stderr}");
}

#[test]
fn ts_sdk_over_stdio_runs_a_sandbox_cycle() {
    let daemon = Daemon::start();
    let config = daemon.doc_config("stdio");
    assert_eq!(config["args"], serde_json::json!(["mcp"]));
    run_client(&daemon, "v1", "stdio", "full", &config);
}

#[test]
fn ts_sdk_over_http_runs_a_sandbox_cycle() {
    let daemon = Daemon::start();
    let config = daemon.doc_config("http");
    assert_eq!(config["url"], daemon.mcp_url().as_str());
    run_client(&daemon, "v1", "http", "full", &config);
}

#[test]
fn ts_client_v2_speaks_the_stateless_revision() {
    let daemon = Daemon::start();
    run_client(&daemon, "v2", "stdio", "quick", &daemon.doc_config("stdio"));
    run_client(&daemon, "v2", "http", "quick", &daemon.doc_config("http"));
}

/// The network policy tools from the official client, against a daemon with sandbox networking on (its uplink an
/// empty namespace this test made): create with a policy, network_policy_set and _get, a bad rule as a tool error.
#[test]
fn ts_sdk_sets_and_gets_a_network_policy() {
    // Declared first so that it is removed last, after the daemon and its sandboxes.
    let uplink = TestNetns::new("hmcp-js");
    let daemon = Daemon::start_networked(&uplink, "10.213.71.0/24");
    run_client(&daemon, "v1", "http", "network", &daemon.doc_config("http"));
    run_client(&daemon, "v2", "stdio", "network", &daemon.doc_config("stdio"));
}

#[tokio::test]
async fn mcp_endpoint_refuses_requests_without_the_key() {
    let daemon = Daemon::start();
    let http = reqwest::Client::new();
    let init = serde_json::json!({
        "jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25", "capabilities": {},
            "clientInfo": { "name": "t", "version": "1" },
        },
    });
    let post = || {
        http.post(daemon.mcp_url())
            .header("accept", "application/json, text/event-stream")
            .json(&init)
    };
    for (what, req) in [
        ("no key", post()),
        ("wrong key", post().bearer_auth("hk_wrong")),
        (
            "GET without key",
            http.get(daemon.mcp_url()).header("accept", "text/event-stream"),
        ),
        ("DELETE without key", http.delete(daemon.mcp_url())),
    ] {
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{what}");
        let body: serde_json::Value = resp.json().await.unwrap();
        assert_eq!(body["error"]["code"], "unauthorized", "{what}");
    }
    // The same request with the key is served: the refusals above were the key check, not a broken route.
    let resp = post().bearer_auth(&daemon.key).send().await.unwrap();
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("mcp-session-id"));
    let body = resp.text().await.unwrap();
    assert!(body.contains("\"serverInfo\":{\"name\":\"hearth\""), "{body}");
}
