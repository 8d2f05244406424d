//! rmcp's own client spawns the real `hearth mcp` (as docs/mcp.md's stdio example configures it) against a
//! real daemon: tools are listed with their schemas, calls succeed, and bad calls are tool errors on a
//! connection that keeps working.

#![allow(clippy::unwrap_used)]

mod support;

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult, ClientConfig};
use rmcp::transport::TokioChildProcess;
use serde_json::{Value, json};
use support::Daemon;

fn args(v: Value) -> serde_json::Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn structured(r: &CallToolResult) -> &Value {
    r.structured_content.as_ref().expect("structured content")
}

#[tokio::test]
async fn rmcp_client_over_stdio() {
    let daemon = Daemon::start();
    let config = daemon.doc_config("stdio");
    let mut cmd = tokio::process::Command::new(config["command"].as_str().unwrap());
    for a in config["args"].as_array().unwrap() {
        cmd.arg(a.as_str().unwrap());
    }
    for (k, v) in config["env"].as_object().unwrap() {
        cmd.env(k, v.as_str().unwrap());
    }
    // Nothing from the user's environment may leak in: the config alone must be enough.
    cmd.env_remove("HEARTH_DATA_DIR");
    let client = ClientConfig::default()
        .serve(TokioChildProcess::new(cmd).unwrap())
        .await
        .unwrap();

    let info = client.peer_info().expect("server info after the handshake");
    assert_eq!(info.server_info.as_ref().map(|s| s.name.as_str()), Some("hearth"));
    assert!(
        info.instructions
            .as_deref()
            .unwrap_or_default()
            .contains("sandbox_id")
    );

    let tools = client.list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    assert_eq!(
        names,
        [
            "create_sandbox",
            "create_template",
            "delete_template",
            "exec",
            "fork_sandbox",
            "kill_sandbox",
            "list_files",
            "list_sandboxes",
            "list_templates",
            "pause_sandbox",
            "read_file",
            "resume_sandbox",
            "sandbox_info",
            "set_timeout",
            "write_file"
        ]
    );
    for t in &tools {
        assert!(
            t.description.as_deref().is_some_and(|d| d.len() > 30),
            "{} has no real description",
            t.name
        );
        let schema = Value::Object((*t.input_schema).clone());
        assert_eq!(schema["type"], "object", "{}", t.name);
        let needs_id = !matches!(
            t.name.as_ref(),
            "create_sandbox" | "list_sandboxes" | "list_templates" | "delete_template"
        );
        let required = schema["required"].as_array().cloned().unwrap_or_default();
        assert_eq!(
            required.contains(&json!("sandbox_id")),
            needs_id,
            "{}: {schema}",
            t.name
        );
        let read_only = t.annotations.as_ref().and_then(|a| a.read_only_hint) == Some(true);
        let expect_read_only = matches!(
            t.name.as_ref(),
            "list_sandboxes" | "list_templates" | "sandbox_info" | "read_file" | "list_files"
        );
        assert_eq!(read_only, expect_read_only, "{}", t.name);
    }

    let listed = client
        .call_tool(CallToolRequestParams::new("list_sandboxes"))
        .await
        .unwrap();
    assert_eq!(listed.is_error, Some(false));
    assert_eq!(structured(&listed)["sandboxes"], json!([]));

    let templates = client
        .call_tool(CallToolRequestParams::new("list_templates"))
        .await
        .unwrap();
    assert_eq!(templates.is_error, Some(false));
    assert_eq!(structured(&templates)["default_template"], "minimal");
    let listed = structured(&templates)["templates"].as_array().unwrap().clone();
    let minimal = listed.iter().find(|t| t["name"] == "minimal");
    assert!(
        minimal.is_some_and(|t| t["builtin"] == true && t["has_memory"] == false),
        "{listed:?}"
    );

    // Template tools check their arguments before calling the daemon.
    let bad = client
        .call_tool(CallToolRequestParams::new("create_template").with_arguments(args(
            json!({ "sandbox_id": "sbx_0000000000000000", "name": "Bad Name" }),
        )))
        .await
        .unwrap();
    assert_eq!(bad.is_error, Some(true));
    assert_eq!(structured(&bad)["error"]["code"], "invalid_argument");
    let builtin = client
        .call_tool(
            CallToolRequestParams::new("delete_template").with_arguments(args(json!({ "name": "minimal" }))),
        )
        .await
        .unwrap();
    assert_eq!(builtin.is_error, Some(true));
    assert_eq!(structured(&builtin)["error"]["code"], "conflict");

    // Missing argument, unknown field, unknown sandbox: tool errors, not protocol errors.
    let missing = client
        .call_tool(CallToolRequestParams::new("exec").with_arguments(args(json!({ "command": "ls" }))))
        .await
        .unwrap();
    assert_eq!(missing.is_error, Some(true));
    let text = missing.content[0].as_text().unwrap().text.clone();
    assert!(text.contains("missing field `sandbox_id`"), "{text}");

    let unknown_field = client
        .call_tool(
            CallToolRequestParams::new("sandbox_info").with_arguments(args(json!({
                "sandbox_id": "sb_x", "sandboxid": "sb_x",
            }))),
        )
        .await
        .unwrap();
    assert_eq!(unknown_field.is_error, Some(true));

    let unknown = client
        .call_tool(CallToolRequestParams::new("write_file").with_arguments(args(
            json!({ "sandbox_id": "sb_nope", "path": "/root/a", "content": "x" }),
        )))
        .await
        .unwrap();
    assert_eq!(unknown.is_error, Some(true));
    assert_eq!(structured(&unknown)["error"]["code"], "not_found");
    assert_eq!(structured(&unknown)["error"]["status"], 404);

    // An unknown tool is the one protocol-level error, and the session survives it.
    let err = client
        .call_tool(CallToolRequestParams::new("no_such_tool"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("tool not found"), "{err}");
    let again = client
        .call_tool(CallToolRequestParams::new("list_sandboxes"))
        .await
        .unwrap();
    assert_eq!(again.is_error, Some(false));

    client.cancel().await.unwrap();
}

#[tokio::test]
async fn stdio_server_reports_an_unreachable_daemon_as_tool_errors() {
    support::bin_dir();
    // A port nothing listens on: bind one, note it, close it.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut cmd = tokio::process::Command::new(support::hearth_bin());
    cmd.arg("mcp")
        .env("HEARTH_URL", format!("http://{addr}"))
        .env("HEARTH_API_KEY", "hk_test")
        .env_remove("HEARTH_DATA_DIR");
    let client = ClientConfig::default()
        .serve(TokioChildProcess::new(cmd).unwrap())
        .await
        .unwrap();
    let r = client
        .call_tool(CallToolRequestParams::new("list_sandboxes"))
        .await
        .unwrap();
    assert_eq!(r.is_error, Some(true));
    let msg = structured(&r)["error"]["message"].as_str().unwrap().to_owned();
    assert!(msg.contains("cannot reach hearthd"), "{msg}");
    client.cancel().await.unwrap();
}
