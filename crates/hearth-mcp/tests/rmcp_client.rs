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
            "bucket_list",
            "create_sandbox",
            "create_template",
            "delete_template",
            "exec",
            "fork_sandbox",
            "kill_sandbox",
            "list_files",
            "list_sandboxes",
            "list_templates",
            "mount_add",
            "mount_remove",
            "network_attach",
            "network_create",
            "network_delete",
            "network_detach",
            "network_list",
            "network_log",
            "network_policy_get",
            "network_policy_set",
            "pause_sandbox",
            "port_expose",
            "project_usage",
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
            "create_sandbox"
                | "bucket_list"
                | "project_usage"
                | "list_sandboxes"
                | "list_templates"
                | "delete_template"
                | "network_create"
                | "network_list"
                | "network_delete"
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
            "list_sandboxes"
                | "bucket_list"
                | "project_usage"
                | "list_templates"
                | "sandbox_info"
                | "read_file"
                | "list_files"
                | "network_policy_get"
                | "network_log"
                | "network_list"
        );
        assert_eq!(read_only, expect_read_only, "{}", t.name);
    }

    let listed = client
        .call_tool(CallToolRequestParams::new("list_sandboxes"))
        .await
        .unwrap();
    assert_eq!(listed.is_error, Some(false));
    assert_eq!(structured(&listed)["sandboxes"], json!([]));
    let buckets = client
        .call_tool(CallToolRequestParams::new("bucket_list"))
        .await
        .unwrap();
    assert_eq!(buckets.is_error, Some(false));
    assert_eq!(structured(&buckets)["buckets"], json!([]));

    // The admin key of a fresh daemon sees one project, `default`: its usage, no limits, nothing held.
    let usage = client
        .call_tool(CallToolRequestParams::new("project_usage"))
        .await
        .unwrap();
    assert_eq!(usage.is_error, Some(false));
    let usage = structured(&usage);
    assert_eq!(
        (&usage["project"], &usage["running"], &usage["disk_bytes"]),
        (&json!("default"), &json!(0), &json!(0)),
        "{usage}"
    );
    let other = client
        .call_tool(
            CallToolRequestParams::new("project_usage").with_arguments(args(json!({ "project": "nope" }))),
        )
        .await
        .unwrap();
    assert_eq!(other.is_error, Some(true));
    assert_eq!(structured(&other)["error"]["code"], "not_found");

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

/// rmcp's client over stdio, configured as docs/mcp.md says, against `daemon`.
async fn connect(daemon: &Daemon) -> rmcp::service::RunningService<rmcp::RoleClient, ClientConfig> {
    let config = daemon.doc_config("stdio");
    let mut cmd = tokio::process::Command::new(config["command"].as_str().unwrap());
    for a in config["args"].as_array().unwrap() {
        cmd.arg(a.as_str().unwrap());
    }
    for (k, v) in config["env"].as_object().unwrap() {
        cmd.env(k, v.as_str().unwrap());
    }
    cmd.env_remove("HEARTH_DATA_DIR");
    ClientConfig::default()
        .serve(TokioChildProcess::new(cmd).unwrap())
        .await
        .unwrap()
}

/// Sandbox addresses of the networked test's daemon (distinct from every other test's range).
const RANGE: &str = "10.213.70.0/24";

/// The network tools against a daemon with sandbox networking on (its uplink an empty namespace this test made,
/// so nothing the guest sends leaves it) and a real QEMU guest: create with a policy, a network and a name;
/// policy get/set, a bad rule as a tool error naming it; private networks; the egress log of real attempts;
/// an exposed port answering with the guest's HTTP server.
#[tokio::test]
async fn rmcp_client_drives_the_network_tools() {
    // Declared first so that it is removed last, after the daemon and its sandboxes.
    let uplink = support::TestNetns::new("hmcp-net");
    let daemon = Daemon::start_networked(&uplink, RANGE);
    let client = connect(&daemon).await;
    let call = |name: &'static str, a: Value| {
        let client = &client;
        async move {
            client
                .call_tool(CallToolRequestParams::new(name).with_arguments(args(a)))
                .await
                .unwrap()
        }
    };
    let ok = |r: CallToolResult| {
        assert_eq!(r.is_error, Some(false), "{r:?}");
        structured(&r).clone()
    };
    let tool_error = |r: CallToolResult| {
        assert_eq!(r.is_error, Some(true), "{r:?}");
        structured(&r)["error"].clone()
    };

    // A bad rule at create is refused, naming the rule, and nothing is created.
    let err = tool_error(
        call(
            "create_sandbox",
            json!({ "template": "minimal", "deny_all": true, "allow": ["not a rule"] }),
        )
        .await,
    );
    assert_eq!(err["code"], "invalid_argument");
    assert!(err["message"].as_str().unwrap().contains("not a rule"), "{err}");
    assert_eq!(
        ok(call("list_sandboxes", json!({})).await)["sandboxes"],
        json!([])
    );

    let blue = ok(call("network_create", json!({ "name": "blue" })).await);
    assert!(blue["id"].as_str().unwrap().starts_with("net_"), "{blue}");
    assert_eq!(blue["name"], "blue");
    let err = tool_error(call("network_create", json!({ "name": "Not Valid" })).await);
    assert_eq!(err["code"], "invalid_argument");

    let sbx = ok(call(
        "create_sandbox",
        json!({
            "template": "minimal", "timeout_s": 600, "deny_all": true, "allow": ["203.0.113.0/24"],
            "networks": ["blue"], "name": "web",
        }),
    )
    .await);
    let id = sbx["id"].as_str().unwrap().to_owned();

    let net = ok(call("network_policy_get", json!({ "sandbox_id": id })).await);
    assert!(
        net["address"].as_str().unwrap().starts_with("10.213.70."),
        "{net}"
    );
    assert_eq!(
        net["egress"],
        json!({ "default": "deny", "allow": ["203.0.113.0/24"], "deny": [] })
    );
    assert_eq!(net["networks"], json!(["blue"]));

    // policy set replaces the policy; get reports it.
    let set = ok(call(
        "network_policy_set",
        json!({
            "sandbox_id": id, "default": "allow", "allow": ["example.com", "*.pypi.org"],
            "deny": ["198.51.100.0/24"],
        }),
    )
    .await);
    let want =
        json!({ "default": "allow", "allow": ["example.com", "*.pypi.org"], "deny": ["198.51.100.0/24"] });
    assert_eq!(set["egress"], want);
    assert_eq!(
        ok(call("network_policy_get", json!({ "sandbox_id": id })).await)["egress"],
        want
    );
    // A bad rule is a tool error naming it, and the policy stays as it was.
    let err = tool_error(
        call(
            "network_policy_set",
            json!({ "sandbox_id": id, "default": "deny", "allow": ["10.0.0.1/8"] }),
        )
        .await,
    );
    assert_eq!(err["code"], "invalid_argument");
    assert!(err["message"].as_str().unwrap().contains("10.0.0.1/8"), "{err}");
    // So is a default that is neither allow nor deny (refused by the argument schema).
    let r = call(
        "network_policy_set",
        json!({ "sandbox_id": id, "default": "maybe" }),
    )
    .await;
    assert_eq!(r.is_error, Some(true));
    let text = r.content[0].as_text().unwrap().text.clone();
    assert!(text.contains("unknown variant `maybe`"), "{text}");
    assert_eq!(
        ok(call("network_policy_get", json!({ "sandbox_id": id })).await)["egress"],
        want
    );

    // Private networks: attach, detach, list, delete (refused while in use).
    ok(call("network_create", json!({ "name": "green" })).await);
    let green = ok(call("network_attach", json!({ "network": "green", "sandbox_id": id })).await);
    assert_eq!(green["members"], json!([id]));
    let mut nets: Vec<String> = serde_json::from_value(
        ok(call("network_policy_get", json!({ "sandbox_id": id })).await)["networks"].clone(),
    )
    .unwrap();
    nets.sort();
    assert_eq!(nets, ["blue", "green"]);
    let green = ok(call("network_detach", json!({ "network": "green", "sandbox_id": id })).await);
    assert_eq!(green["members"], json!([]));
    let list = ok(call("network_list", json!({})).await);
    let members = |name: &str| {
        list["networks"]
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["name"] == name)
            .map(|n| n["members"].clone())
    };
    assert_eq!(members("blue"), Some(json!([id])));
    assert_eq!(members("green"), Some(json!([])));
    assert_eq!(
        ok(call("network_delete", json!({ "network": "green" })).await)["deleted"],
        "green"
    );
    let err = tool_error(call("network_delete", json!({ "network": "blue" })).await);
    assert_eq!(err["code"], "conflict");

    // The egress log shows real attempts from the guest: one allowed, one denied by a rule.
    ok(call(
        "network_policy_set",
        json!({ "sandbox_id": id, "default": "deny", "allow": ["203.0.113.0/24"], "deny": ["198.51.100.0/24"] }),
    )
    .await);
    ok(call(
        "exec",
        json!({
            "sandbox_id": id,
            "command": "nc -w 1 203.0.113.7 8080 </dev/null; nc -w 1 198.51.100.7 8080 </dev/null; true",
        }),
    )
    .await);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let log = loop {
        let log = ok(call("network_log", json!({ "sandbox_id": id, "limit": 1000 })).await);
        let seen = |dest: &str, allowed: bool| {
            log["events"]
                .as_array()
                .unwrap()
                .iter()
                .any(|e| e["destination"] == dest && e["port"] == 8080 && e["allowed"] == allowed)
        };
        if seen("203.0.113.7", true) && seen("198.51.100.7", false) {
            break log;
        }
        assert!(std::time::Instant::now() < deadline, "attempts not logged: {log}");
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    };
    let denied = log["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["destination"] == "198.51.100.7")
        .unwrap();
    assert_eq!(denied["reason"], "deny_rule", "{denied}");
    assert!(log.get("truncated").is_none(), "{log}");
    // A small limit keeps the newest entries and says so.
    let total = log["total"].as_u64().unwrap();
    assert!(total >= 2, "{log}");
    let short = ok(call("network_log", json!({ "sandbox_id": id, "limit": 1 })).await);
    assert_eq!(short["events"].as_array().unwrap().len(), 1);
    assert_eq!(short["events"][0], log["events"][total as usize - 1]);
    assert!(
        short["truncated"]
            .as_str()
            .unwrap()
            .contains(&format!("newest 1 of {total}")),
        "{short}"
    );
    let err = tool_error(call("network_log", json!({ "sandbox_id": id, "limit": 0 })).await);
    assert_eq!(err["code"], "invalid_argument");

    // An exposed port: the URL (with its token, no key) reaches the guest's HTTP server.
    ok(call(
        "exec",
        json!({
            "sandbox_id": id,
            "command": "mkdir -p /srv && echo served-by-mcp > /srv/index.html && \
                        (setsid busybox httpd -f -p 8000 -h /srv </dev/null >/dev/null 2>&1 &)",
        }),
    )
    .await);
    let exposed = ok(call(
        "port_expose",
        json!({ "sandbox_id": id, "port": 8000, "ttl_s": 600 }),
    )
    .await);
    let url = exposed["url"].as_str().unwrap();
    assert!(
        url.starts_with(&format!(
            "{}/v1/sandboxes/{id}/ports/8000/?hearth_token=",
            daemon.url
        )),
        "{url}"
    );
    assert!(url.ends_with(exposed["token"].as_str().unwrap()), "{exposed}");
    let index = url.replacen("/ports/8000/?", "/ports/8000/index.html?", 1);
    let http = reqwest::Client::new();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let resp = http.get(&index).send().await.unwrap();
        let status = resp.status();
        let body = resp.text().await.unwrap();
        if status == 200 {
            assert_eq!(body, "served-by-mcp\n");
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{status}: {body}");
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    // Without the token the port is closed.
    let bare = index.split_once('?').unwrap().0;
    assert_eq!(http.get(bare).send().await.unwrap().status(), 401);
    let err = tool_error(call("port_expose", json!({ "sandbox_id": id, "port": 0 })).await);
    assert_eq!(err["code"], "invalid_argument");

    ok(call("kill_sandbox", json!({ "sandbox_id": id })).await);
    assert_eq!(
        ok(call("network_delete", json!({ "network": "blue" })).await)["deleted"],
        "blue"
    );
    client.cancel().await.unwrap();
}

/// The mount tools against a networked daemon, a real S3 server on loopback (s3s-fs, which keeps objects as plain
/// files) and a real guest: a bucket registered over HTTP (no tool registers one) is listed without its secret;
/// a mount of an unknown bucket is a tool error and creates nothing; a file written through a mount made at
/// create is an object in the bucket; mount_add read-only at run time reads it and refuses writes with EROFS;
/// mount_remove unmounts.
#[tokio::test]
async fn rmcp_client_drives_the_mount_tools() {
    use hearth_testkit::s3::{ACCESS_KEY_ID, REGION, S3Kind, S3Server, SECRET_ACCESS_KEY};
    let uplink = support::TestNetns::new("hmcp-mnt");
    let s3 = tokio::task::spawn_blocking(|| S3Server::start(S3Kind::S3sFs, "mcp-bucket"))
        .await
        .unwrap();
    let daemon =
        Daemon::start_networked_with(&uplink, "10.213.95.0/24", &["--allow-private-bucket-endpoints"]);
    let resp = reqwest::Client::new()
        .post(format!("{}/v1/buckets", daemon.url))
        .bearer_auth(&daemon.key)
        .json(&json!({
            "name": "data", "url": s3.url("projects"), "endpoint": s3.endpoint(), "region": REGION,
            "access_key_id": ACCESS_KEY_ID, "secret_access_key": SECRET_ACCESS_KEY,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 201, "{}", resp.text().await.unwrap());
    let client = connect(&daemon).await;
    let call = |name: &'static str, a: Value| {
        let client = &client;
        async move {
            client
                .call_tool(CallToolRequestParams::new(name).with_arguments(args(a)))
                .await
                .unwrap()
        }
    };
    let ok = |r: CallToolResult| {
        assert_eq!(r.is_error, Some(false), "{r:?}");
        structured(&r).clone()
    };

    let listed = ok(call("bucket_list", json!({})).await);
    assert_eq!(listed["buckets"][0]["name"], "data", "{listed}");
    assert_eq!(listed["buckets"][0]["url"], "s3://mcp-bucket/projects");
    assert!(!listed.to_string().contains(SECRET_ACCESS_KEY), "{listed}");

    let r = call(
        "create_sandbox",
        json!({ "template": "minimal", "mounts": [{ "path": "/mnt/a", "bucket": "nope" }] }),
    )
    .await;
    assert_eq!(r.is_error, Some(true), "{r:?}");
    assert_eq!(structured(&r)["error"]["code"], "not_found", "{r:?}");
    assert_eq!(
        ok(call("list_sandboxes", json!({})).await)["sandboxes"],
        json!([])
    );

    let sbx = ok(call(
        "create_sandbox",
        json!({
            "template": "minimal", "timeout_s": 600,
            "mounts": [{ "path": "/mnt/data", "bucket": "data", "prefix": "runs/1/" }],
        }),
    )
    .await);
    let id = sbx["id"].as_str().unwrap().to_owned();
    let run = ok(call(
        "exec",
        json!({ "sandbox_id": id, "command": "echo from-mcp > /mnt/data/out.txt" }),
    )
    .await);
    assert_eq!(run["exit_code"], 0, "{run}");
    // close() returned once the object was uploaded: s3s-fs has it as a file already.
    let object = s3.data_dir().unwrap().join("mcp-bucket/projects/runs/1/out.txt");
    assert_eq!(std::fs::read_to_string(&object).unwrap(), "from-mcp\n");

    let m = ok(call(
        "mount_add",
        json!({ "sandbox_id": id, "path": "/mnt/in", "bucket": "data", "prefix": "runs/", "read_only": true }),
    )
    .await);
    assert_eq!(
        (&m["path"], &m["read_only"]),
        (&json!("/mnt/in"), &json!(true)),
        "{m}"
    );
    let run = ok(call(
        "exec",
        json!({ "sandbox_id": id, "command": "cat /mnt/in/1/out.txt; echo no > /mnt/in/x.txt" }),
    )
    .await);
    assert_eq!(run["stdout"], "from-mcp\n", "{run}");
    assert_ne!(run["exit_code"], 0, "{run}");
    assert!(
        run["stderr"].as_str().unwrap().contains("Read-only file system"),
        "{run}"
    );
    let listed = ok(call("bucket_list", json!({})).await);
    assert_eq!(listed["buckets"][0]["mounted_by"], json!([id]), "{listed}");

    ok(call("mount_remove", json!({ "sandbox_id": id, "path": "/mnt/in" })).await);
    let run = ok(call(
        "exec",
        json!({ "sandbox_id": id, "command": "grep -c ' /mnt/in ' /proc/mounts || true" }),
    )
    .await);
    assert_eq!(run["stdout"], "0\n", "{run}");
    ok(call("kill_sandbox", json!({ "sandbox_id": id })).await);
    client.cancel().await.unwrap();
}
