//! The MCP Inspector's CLI (`@modelcontextprotocol/inspector`, `mcp-inspector --cli`) against the real
//! `hearth mcp` (stdio) and the real daemon's `/mcp` (streamable HTTP): it lists the tools and calls them, one
//! Inspector process per call (so each call is a fresh session), including a create -> exec -> kill cycle on a
//! real VM. The Inspector needs Node.js 22, which tests/js installs as the `node` package next to it.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;
use support::{Daemon, js_dir, npm_ci};

/// What one Inspector run printed and whether it succeeded.
struct Run {
    ok: bool,
    json: Value,
    stderr: String,
}

fn node22() -> PathBuf {
    js_dir().join("node_modules/node/bin/node")
}

fn inspector() -> PathBuf {
    js_dir().join("node_modules/@modelcontextprotocol/inspector/clients/launcher/build/index.js")
}

/// `mcp-inspector --cli TARGET... ARGS...` with Node 22.
fn inspect(target: &[String], args: &[&str]) -> Run {
    npm_ci();
    let out = Command::new(node22())
        .arg(inspector())
        .arg("--cli")
        .args(target)
        .args(args)
        .current_dir(js_dir())
        // Keep the Inspector's catalog out of the home directory.
        .env(
            "MCP_CATALOG_PATH",
            std::env::temp_dir().join("hearth-mcp-inspector-catalog.json"),
        )
        .output()
        .expect("the Inspector runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let json = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("Inspector output is not JSON ({e}):\n{stdout}\n{stderr}"));
    Run {
        ok: out.status.success(),
        json,
        stderr,
    }
}

fn stdio_target(d: &Daemon) -> Vec<String> {
    vec![
        "-e".into(),
        format!("HEARTH_URL={}", d.url),
        "-e".into(),
        format!("HEARTH_API_KEY={}", d.key),
        support::hearth_bin().display().to_string(),
        "mcp".into(),
    ]
}

fn http_target(d: &Daemon, key: &str) -> Vec<String> {
    vec![
        d.mcp_url(),
        "--transport".into(),
        "http".into(),
        "--header".into(),
        format!("Authorization: Bearer {key}"),
    ]
}

/// Calls `tool` with `key=value` arguments and returns its structured answer; `want_error` says whether a tool
/// error is expected.
fn call(target: &[String], tool: &str, args: &[&str], want_error: bool) -> Value {
    let mut cli = vec!["--method", "tools/call", "--tool-name", tool];
    if !args.is_empty() {
        cli.push("--tool-arg");
        cli.extend_from_slice(args);
    }
    let r = inspect(target, &cli);
    assert_eq!(
        r.json["isError"],
        Value::Bool(want_error),
        "{tool}: {}\n{}",
        r.json,
        r.stderr
    );
    assert_eq!(r.ok, !want_error, "{tool}: exit status; {}", r.stderr);
    r.json["structuredContent"].clone()
}

fn check_tool_list(target: &[String]) {
    let r = inspect(target, &["--method", "tools/list"]);
    assert!(r.ok, "{}", r.stderr);
    let tools = r.json["tools"].as_array().unwrap();
    let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
    for want in [
        "create_sandbox",
        "exec",
        "read_file",
        "write_file",
        "list_templates",
        "create_template",
        "kill_sandbox",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    for t in tools {
        assert_eq!(t["inputSchema"]["type"], "object", "{t}");
        assert!(t["description"].as_str().is_some_and(|d| d.len() > 30), "{t}");
    }
}

#[test]
fn inspector_cli_over_stdio_lists_and_drives_the_tools() {
    let d = Daemon::start();
    let target = stdio_target(&d);
    check_tool_list(&target);

    let templates = call(&target, "list_templates", &[], false);
    assert_eq!(templates["default_template"], "minimal");

    let sbx = call(&target, "create_sandbox", &["template=minimal"], false);
    let id = sbx["id"].as_str().unwrap().to_owned();
    let out = call(
        &target,
        "exec",
        &[&format!("sandbox_id={id}"), "command=echo inspected; uname -s"],
        false,
    );
    assert_eq!(out["exit_code"], 0);
    assert_eq!(out["stdout"], "inspected\nLinux\n");
    call(&target, "kill_sandbox", &[&format!("sandbox_id={id}")], false);
    let gone = call(&target, "sandbox_info", &[&format!("sandbox_id={id}")], true);
    assert_eq!(gone["error"]["code"], "not_found");
}

#[test]
fn inspector_cli_over_http_needs_the_key() {
    let d = Daemon::start();
    let target = http_target(&d, &d.key);
    check_tool_list(&target);
    let listed = call(&target, "list_sandboxes", &["state=running"], false);
    assert_eq!(listed["sandboxes"], serde_json::json!([]));
    let bad = call(&target, "list_sandboxes", &["state=sleeping"], true);
    assert_eq!(bad["error"]["code"], "invalid_argument");

    // A wrong key never gets to the tools.
    let out = Command::new(node22())
        .arg(inspector())
        .arg("--cli")
        .args(http_target(&d, "hk_wrong"))
        .args(["--method", "tools/list"])
        .current_dir(js_dir())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stdout).contains("create_sandbox"));
}
