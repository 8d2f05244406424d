//! The audit log, scoped keys and the Host/Origin check against the real `hearthd` binary. No VM boots here:
//! every request names objects that do not exist or carries a body the daemon refuses, so nothing is created,
//! yet each is a state-changing request the log must account for.

mod common;
mod tenancyfix;

use std::time::Duration;

use common::{Daemon, wait_until};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tenancyfix::{call, create_key, create_project, fill, routes};

const NO_SANDBOX: &str = "sbx_0000000000000000";

/// A value for path parameter `name` of route `path` that names an object nobody has.
fn path_value(path: &str, name: &str) -> String {
    match name {
        "id" if path.starts_with("/v1/keys") => "key_0000000000000000".into(),
        "id" if path.starts_with("/v1/snapshots") => "snap_0000000000000000".into(),
        "id" | "sandbox" => NO_SANDBOX.into(),
        "pid" => "1".into(),
        "port" => "8080".into(),
        _ => "absent-object".into(),
    }
}

async fn audit_entries(d: &Daemon) -> Vec<hearth_api::AuditEntry> {
    let client = hearth_client::Client::new(&format!("http://{}", d.addr), d.key.clone()).expect("client");
    client.audit_all().await.expect("audit log")
}

#[tokio::test]
async fn every_mutating_route_of_the_openapi_document_writes_an_audit_entry() {
    let d = Daemon::start().await;
    let mut expected = Vec::new();
    for r in routes(&d).await.into_iter().filter(|r| r.secured && r.mutating()) {
        let path = fill(&r.path, |p| path_value(&r.path, p));
        // A body with an unknown field: every JSON route refuses it (400) before acting.
        let body = (r.method != Method::GET && r.method != Method::DELETE).then(|| json!({"zz_unknown": 1}));
        let (status, v, rid) = call(&d, &d.key, r.method.clone(), &path, body).await;
        assert!(
            status.is_client_error(),
            "{} {path}: expected a refusal, got {status} {v}",
            r.method
        );
        assert!(
            rid.starts_with("req_"),
            "{} {path}: x-request-id {rid:?}",
            r.method
        );
        expected.push((format!("{} {}", r.method, r.path), rid, status.as_u16()));
    }
    assert!(expected.len() >= 30, "mutating routes found: {}", expected.len());
    // A read is not a state change: it leaves no entry.
    let (s, _, read_rid) = call(&d, &d.key, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK);
    let entries = audit_entries(&d).await;
    for (action, rid, status) in &expected {
        let e = entries
            .iter()
            .find(|e| &e.request_id == rid)
            .unwrap_or_else(|| panic!("no audit entry for {action} ({rid})"));
        assert_eq!(&e.action, action);
        assert_eq!(e.status, *status, "{action}");
        assert_eq!(e.key_id, "bootstrap");
        assert_eq!(e.project, "default");
        assert_eq!(e.role, "admin");
        assert!(e.source.starts_with("127.0.0.1:"), "{}", e.source);
        assert!(e.target.starts_with("/v1/"), "{}", e.target);
    }
    assert!(!entries.iter().any(|e| e.request_id == read_rid));
    hearth_client::tenancy::verify_audit_log(&entries).expect("chain verifies");
}

#[tokio::test]
async fn refused_keys_are_audited_and_one_changed_byte_breaks_the_chain() {
    let d = Daemon::start().await;
    let (s, v, rid) = call(&d, "hk_wrong", Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED, "{v}");
    for i in 0..3 {
        let (s, _, _) = call(&d, &d.key, Method::DELETE, &format!("/v1/networks/n{i}"), None).await;
        assert_eq!(s, StatusCode::NOT_FOUND);
    }
    let entries = audit_entries(&d).await;
    let refused = entries
        .iter()
        .find(|e| e.request_id == rid)
        .expect("refusal entry");
    assert_eq!((refused.status, refused.key_id.as_str()), (401, ""));
    assert_eq!(refused.action, "GET /v1/sandboxes");
    hearth_client::tenancy::verify_audit_log(&entries).expect("intact chain verifies");
    let victim = entries
        .iter()
        .find(|e| e.target == "/v1/networks/n1")
        .unwrap_or_else(|| panic!("no entry: {entries:#?}"))
        .seq;

    let db = rusqlite::Connection::open(d.data_dir().join("state.db")).expect("open state db");
    db.busy_timeout(Duration::from_secs(5)).expect("busy timeout");
    let refused_update = db.execute("UPDATE audit SET status = 204 WHERE seq = ?1", [victim as i64]);
    assert!(refused_update.is_err(), "the table refuses updates");
    // Someone with the database in hand removes the guard and changes one byte.
    db.execute_batch("DROP TRIGGER audit_no_update")
        .expect("drop trigger");
    let n = db
        .execute(
            "UPDATE audit SET target = '/v1/networks/n2' WHERE seq = ?1",
            [victim as i64],
        )
        .expect("tamper");
    assert_eq!(n, 1);
    let entries = audit_entries(&d).await;
    let broken = hearth_client::tenancy::verify_audit_log(&entries).expect_err("tampering is detected");
    assert_eq!(broken.seq, victim, "{broken}");
}

#[tokio::test]
async fn keys_are_scoped_to_roles_revocable_at_once_and_expire() {
    let d = Daemon::start().await;
    create_project(&d, "team-a", json!({})).await;
    let member = create_key(&d, "team-a", "member", None).await;
    let viewer = create_key(&d, "team-a", "viewer", None).await;
    let short = create_key(&d, "team-a", "member", Some(1)).await;
    assert!(member.key.starts_with("hk_") && member.id.starts_with("key_"));

    // Listing shows ids, never keys, and records use.
    let (s, _, _) = call(&d, &member.key, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, list, _) = call(&d, &d.key, Method::GET, "/v1/keys", None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(
        !list.to_string().contains(&member.key),
        "a key list never shows keys"
    );
    let listed = list["keys"]
        .as_array()
        .and_then(|k| k.iter().find(|k| k["id"] == json!(member.id)))
        .cloned()
        .unwrap_or(Value::Null);
    assert_eq!(listed["project"], json!("team-a"));
    assert!(listed["last_used_at"].is_string(), "{listed}");

    // Roles: a viewer reads but changes nothing; keys, audit and projects are for admins.
    let (s, v, _) = call(&d, &viewer.key, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v, _) = call(&d, &viewer.key, Method::POST, "/v1/sandboxes", Some(json!({}))).await;
    assert_eq!(
        (s, v["error"]["code"].clone()),
        (StatusCode::FORBIDDEN, json!("forbidden"))
    );
    for (m, p) in [
        (Method::GET, "/v1/keys"),
        (Method::GET, "/v1/audit"),
        (Method::POST, "/v1/projects"),
    ] {
        let (s, _, _) = call(&d, &member.key, m.clone(), p, Some(json!({"name": "x"}))).await;
        assert_eq!(s, StatusCode::FORBIDDEN, "member {m} {p}");
    }
    let (s, v, _) = call(&d, &member.key, Method::GET, "/v1/projects", None).await;
    assert_eq!(s, StatusCode::OK);
    let names: Vec<&str> = v["projects"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["name"].as_str())
        .collect();
    assert_eq!(names, ["team-a"], "a member sees only its project");

    // Revocation takes effect on the next request.
    let (s, _, _) = call(
        &d,
        &d.key,
        Method::DELETE,
        &format!("/v1/keys/{}", member.id),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v, _) = call(&d, &member.key, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(
        (s, v["error"]["code"].clone()),
        (StatusCode::UNAUTHORIZED, json!("unauthorized"))
    );
    let (s, _, _) = call(&d, &d.key, Method::DELETE, "/v1/keys/bootstrap", None).await;
    assert_eq!(
        s,
        StatusCode::CONFLICT,
        "the bootstrap key is not revoked through the API"
    );

    // Expiry.
    let expired = wait_until(Duration::from_secs(10), || async {
        call(&d, &short.key, Method::GET, "/v1/sandboxes", None).await.0 == StatusCode::UNAUTHORIZED
    })
    .await;
    assert!(expired, "a key with expires_in_s = 1 stops working");
    // The bootstrap key still works.
    let (s, _, _) = call(&d, &d.key, Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(s, StatusCode::OK);
}

#[tokio::test]
async fn host_and_origin_are_checked_even_with_a_valid_key_and_keys_stay_out_of_urls() {
    let d = Daemon::start_with(&["--network", "off", "--cors-origin", "https://app.example"]).await;
    let get = |origin: Option<&'static str>, host: Option<&'static str>, path: &'static str| {
        let mut r = d.http.get(d.url(path)).bearer_auth(&d.key);
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        if let Some(h) = host {
            r = r.header("host", h);
        }
        async move { r.send().await.expect("send").status() }
    };
    assert_eq!(get(Some("http://evil.example"), None, "/v1/sandboxes").await, 403);
    assert_eq!(get(Some("null"), None, "/v1/sandboxes").await, 403);
    assert_eq!(get(None, Some("evil.example"), "/v1/sandboxes").await, 403);
    assert_eq!(
        get(None, Some("localhost.evil.example:80"), "/v1/system").await,
        403
    );
    assert_eq!(get(Some("https://app.example"), None, "/v1/sandboxes").await, 200);
    assert_eq!(
        get(Some("http://localhost:5173"), None, "/v1/sandboxes").await,
        200
    );
    assert_eq!(get(None, Some("localhost"), "/v1/sandboxes").await, 200);
    // `/mcp` too (the MCP specification requires Origin validation against DNS rebinding).
    let mcp = d
        .http
        .post(d.url("/mcp"))
        .bearer_auth(&d.key)
        .header("origin", "http://evil.example")
        .header("accept", "application/json, text/event-stream")
        .json(&json!({"jsonrpc": "2.0", "id": 1, "method": "ping"}))
        .send()
        .await
        .expect("mcp");
    assert_eq!(mcp.status(), 403);
    // CORS: a preflight from the allowed origin is answered for it; another origin gets no allowance.
    let preflight = |origin: &'static str| {
        d.http
            .request(Method::OPTIONS, d.url("/v1/sandboxes"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization, content-type")
            .send()
    };
    let ok = preflight("https://app.example").await.expect("preflight");
    assert!(ok.status().is_success(), "{}", ok.status());
    let allow = ok
        .headers()
        .get("access-control-allow-origin")
        .and_then(|v| v.to_str().ok());
    assert_eq!(allow, Some("https://app.example"));
    let evil = preflight("http://evil.example").await.expect("preflight");
    assert!(evil.headers().get("access-control-allow-origin").is_none());
    // A key in the query string is not a key.
    let url = d.url(&format!("/v1/sandboxes?access_token={}", d.key));
    let s = d.http.get(url).send().await.expect("send").status();
    assert_eq!(s, 401);
}

#[tokio::test]
async fn quotas_refuse_at_their_edges_with_the_limit_named() {
    let d = Daemon::start().await;
    let cases = [
        (
            "q-running",
            json!({"max_running": 0}),
            json!({}),
            "max_running = 0",
        ),
        (
            "q-vcpus",
            json!({"max_vcpus": 2}),
            json!({"vcpus": 3}),
            "max_vcpus = 2",
        ),
        (
            "q-memory",
            json!({"max_memory_mib": 256}),
            json!({"memory_mib": 257}),
            "max_memory_mib = 256",
        ),
        (
            "q-rate",
            json!({"max_creates_per_minute": 0}),
            json!({}),
            "max_creates_per_minute = 0",
        ),
    ];
    for (project, quota, body, named) in cases {
        create_project(&d, project, quota).await;
        let k = create_key(&d, project, "member", None).await;
        let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body)).await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{project}: {v}");
        assert_eq!(v["error"]["code"], json!("quota_exceeded"));
        assert!(
            v["error"]["message"].as_str().unwrap_or("").contains(named),
            "{v}"
        );
    }
    // Raising a quota takes effect at once (the request then fails later, on the template, not the quota).
    let (s, _, _) = call(
        &d,
        &d.key,
        Method::PUT,
        "/v1/projects/q-vcpus/quota",
        Some(json!({"max_vcpus": 3})),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let k = create_key(&d, "q-vcpus", "member", None).await;
    let body = json!({"vcpus": 3, "template": "no-such-template"});
    let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(
        (s, v["error"]["code"].clone()),
        (StatusCode::NOT_FOUND, json!("not_found")),
        "{v}"
    );

    // Usage against limits: one's own project, not another's.
    let (s, v, _) = call(&d, &k.key, Method::GET, "/v1/projects/q-vcpus/usage", None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["running"].clone(), v["quota"]["max_vcpus"].clone()),
        (json!(0), json!(3))
    );
    let (s, _, _) = call(&d, &k.key, Method::GET, "/v1/projects/q-memory/usage", None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);

    // A fork counts every child it asks for.
    let quota = Some(json!({"max_running": 2}));
    let (s, _, _) = call(&d, &d.key, Method::PUT, "/v1/projects/default/quota", quota).await;
    assert_eq!(s, StatusCode::OK);
    let path = "/v1/sandboxes/sbx_0000000000000000/fork";
    let (s, v, _) = call(&d, &d.key, Method::POST, path, Some(json!({"count": 3}))).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("max_running = 2"),
        "{v}"
    );
    let (s, _, _) = call(&d, &d.key, Method::POST, path, Some(json!({"count": 2}))).await;
    assert_eq!(
        s,
        StatusCode::NOT_FOUND,
        "within the quota, the missing parent answers"
    );
}

#[tokio::test]
async fn a_flooding_key_is_rate_limited_alone() {
    let d = Daemon::start_with(&["--network", "off", "--key-rate-limit", "5"]).await;
    create_project(&d, "flood", json!({})).await;
    let flooder = create_key(&d, "flood", "member", None).await;
    let other = create_key(&d, "flood", "viewer", None).await;
    let mut limited = None;
    for _ in 0..40 {
        let resp = d
            .http
            .get(d.url("/v1/system"))
            .bearer_auth(&flooder.key)
            .send()
            .await
            .expect("send");
        if resp.status() == StatusCode::TOO_MANY_REQUESTS {
            limited = Some(resp);
            break;
        }
    }
    let resp = limited.expect("40 requests at once pass a 5/s limit (burst 10)");
    let retry: u64 = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("Retry-After in seconds");
    assert!((1..=2).contains(&retry), "{retry}");
    let v: Value = resp.json().await.expect("json");
    assert_eq!(v["error"]["code"], json!("rate_limited"));
    // Another key, and the bootstrap key, are not slowed by it.
    let (s, _, _) = call(&d, &other.key, Method::GET, "/v1/system", None).await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, _) = call(&d, &d.key, Method::GET, "/v1/system", None).await;
    assert_eq!(s, StatusCode::OK);
    // The flooder recovers at the rate.
    let recovered = wait_until(Duration::from_secs(5), || async {
        call(&d, &flooder.key, Method::GET, "/v1/system", None).await.0 == StatusCode::OK
    })
    .await;
    assert!(recovered);
}
