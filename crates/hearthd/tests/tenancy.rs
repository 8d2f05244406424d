//! Projects against real VMs: a matrix over every route of the daemon's OpenAPI document (another project's key
//! gets 404 on objects it does not own, a viewer cannot change anything, a revoked or expired key gets 401), and
//! atomic quota admission (10 parallel creates against a limit of 3; a command waking a paused sandbox), a spent budget
//! pausing the project, a lifetime destroying old sandboxes, disk bytes counted against `max_disk_bytes`, and
//! creates asked for as event streams owned and admitted like JSON ones.

mod common;
mod tenancyfix;

use std::time::Duration;

use common::{Daemon, VM_LOCK, wait_until};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tenancyfix::{Key, Route, call, create_key, create_project, fill, routes};

const SMALL: u32 = 256;

fn ids(v: &Value, field: &str, id: &str) -> Vec<String> {
    v[field]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|x| x[id].as_str().map(String::from))
        .collect()
}

/// Project a's objects, as routes name them.
struct Owned {
    sandbox: String,
    snapshot: String,
    template: String,
    key_id: String,
}

impl Owned {
    fn path(&self, r: &Route) -> String {
        fill(&r.path, |p| match p {
            "id" if r.path.starts_with("/v1/snapshots") => self.snapshot.clone(),
            "id" if r.path.starts_with("/v1/keys") => self.key_id.clone(),
            "id" | "sandbox" => self.sandbox.clone(),
            "name" if r.path.starts_with("/v1/templates") => self.template.clone(),
            "name" if r.path.starts_with("/v1/projects") => "team-a".into(),
            "pid" => "1".into(),
            "port" => "8080".into(),
            "path" => "index.html".into(),
            _ => "absent-object".into(),
        })
    }

    /// Whether the route names one of project a's objects in its path.
    fn names_owned(r: &Route) -> bool {
        r.path.starts_with("/v1/sandboxes/")
            || r.path.starts_with("/v1/snapshots/")
            || r.path.starts_with("/v1/templates/")
            || r.path.contains("/members/{sandbox}")
    }
}

fn admin_only(r: &Route) -> bool {
    r.path.starts_with("/v1/keys")
        || r.path.starts_with("/v1/audit")
        || (r.path.starts_with("/v1/projects") && r.method != Method::GET)
}

async fn expect(d: &Daemon, k: &Key, r: &Route, path: &str, want: StatusCode, code: &str) {
    let body = (r.method != Method::GET && r.method != Method::DELETE).then(|| json!({}));
    let (s, v, _) = call(d, &k.key, r.method.clone(), path, body).await;
    assert_eq!(s, want, "{} {path}: {v}", r.method);
    assert_eq!(v["error"]["code"], json!(code), "{} {path}: {v}", r.method);
}

#[tokio::test]
async fn every_route_is_scoped_to_its_project_and_role() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    create_project(&d, "team-a", json!({})).await;
    create_project(&d, "team-b", json!({})).await;
    let a = create_key(&d, "team-a", "member", None).await;
    let a_viewer = create_key(&d, "team-a", "viewer", None).await;
    let b = create_key(&d, "team-b", "member", None).await;
    let revoked = create_key(&d, "team-a", "admin", None).await;
    let expired = create_key(&d, "team-a", "admin", Some(1)).await;
    let (s, _, _) = call(
        &d,
        &d.key,
        Method::DELETE,
        &format!("/v1/keys/{}", revoked.id),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT);

    // Project a's objects: a sandbox, a snapshot of it, a template saved from it.
    let body = json!({"template": "minimal", "memory_mib": SMALL});
    let (s, sbx, _) = call(&d, &a.key, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{sbx}\n{}", d.log());
    let sandbox = sbx["id"].as_str().expect("id").to_string();
    let (s, snap, _) = call(
        &d,
        &a.key,
        Method::POST,
        &format!("/v1/sandboxes/{sandbox}/snapshots"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::CREATED, "{snap}");
    let body = json!({"name": "a-tpl", "from_sandbox": sandbox});
    let (s, tpl, _) = call(&d, &a.key, Method::POST, "/v1/templates", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{tpl}");
    let owned = Owned {
        sandbox: sandbox.clone(),
        snapshot: snap["id"].as_str().expect("snapshot id").to_string(),
        template: "a-tpl".into(),
        key_id: a.id.clone(),
    };

    let expired_now = wait_until(Duration::from_secs(10), || async {
        call(&d, &expired.key, Method::GET, "/v1/system", None).await.0 == StatusCode::UNAUTHORIZED
    })
    .await;
    assert!(expired_now, "the 1-second key expires");

    let all = routes(&d).await;
    let mut checked = (0, 0, 0);
    for r in all.iter().filter(|r| r.secured) {
        let path = owned.path(r);
        // Revoked and expired keys: 401 everywhere.
        for k in [&revoked, &expired] {
            expect(&d, k, r, &path, StatusCode::UNAUTHORIZED, "unauthorized").await;
        }
        // Another project's member: admin routes are forbidden, a's objects do not exist.
        if admin_only(r) {
            expect(&d, &b, r, &path, StatusCode::FORBIDDEN, "forbidden").await;
        } else if Owned::names_owned(r) {
            expect(&d, &b, r, &path, StatusCode::NOT_FOUND, "not_found").await;
            checked.0 += 1;
        }
        // The viewer changes nothing.
        if r.mutating() {
            expect(&d, &a_viewer, r, &path, StatusCode::FORBIDDEN, "forbidden").await;
            checked.1 += 1;
        }
        checked.2 += 1;
    }
    assert!(checked.0 >= 25, "routes naming a's objects checked: {checked:?}");
    assert!(checked.1 >= 30, "mutating routes checked: {checked:?}");

    // Objects named in bodies are a's too.
    for (path, body) in [
        ("/v1/sandboxes", json!({"snapshot": owned.snapshot})),
        ("/v1/sandboxes", json!({"template": owned.template})),
        ("/v1/templates", json!({"name": "b-tpl", "from_sandbox": sandbox})),
        ("/v1/sandboxes", json!({"from_sync": sandbox})),
    ] {
        let (s, v, _) = call(&d, &b.key, Method::POST, path, Some(body.clone())).await;
        assert_eq!(s, StatusCode::NOT_FOUND, "{path} {body}: {v}");
    }

    // Lists: a sees its objects and the built-in templates, b only the built-in templates.
    for (k, sees) in [(&a, true), (&a_viewer, true), (&b, false)] {
        let (_, v, _) = call(&d, &k.key, Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(ids(&v, "sandboxes", "id").contains(&sandbox), sees, "{v}");
        let (_, v, _) = call(&d, &k.key, Method::GET, "/v1/snapshots", None).await;
        assert_eq!(ids(&v, "snapshots", "id").contains(&owned.snapshot), sees, "{v}");
        let (_, v, _) = call(&d, &k.key, Method::GET, "/v1/templates", None).await;
        let names = ids(&v, "templates", "name");
        assert_eq!(names.contains(&owned.template), sees, "{v}");
        assert!(
            names.contains(&"minimal".to_string()),
            "built-in templates are readable by all: {v}"
        );
        let (_, v, _) = call(&d, &k.key, Method::GET, "/v1/usage", None).await;
        assert_eq!(ids(&v, "sandboxes", "sandbox_id").contains(&sandbox), sees, "{v}");
        let (s, _, _) = call(&d, &k.key, Method::GET, &format!("/v1/sandboxes/{sandbox}"), None).await;
        assert_eq!(s == StatusCode::OK, sees);
    }
    // The bootstrap admin sees every project's objects.
    assert!(d.list_ids().await.contains(&sandbox));

    // The owner cleans up; names are freed.
    for path in [
        "/v1/templates/a-tpl".to_string(),
        format!("/v1/sandboxes/{sandbox}"),
        format!("/v1/snapshots/{}", owned.snapshot),
    ] {
        let (s, v, _) = call(&d, &a.key, Method::DELETE, &path, None).await;
        assert!(s.is_success(), "DELETE {path}: {s} {v}");
    }
}

#[tokio::test]
async fn ten_parallel_creates_against_a_limit_of_three_admit_exactly_three() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    create_project(&d, "q", json!({"max_running": 3})).await;
    let k = create_key(&d, "q", "member", None).await;
    let creates = (0..10).map(|_| {
        let body = json!({"template": "minimal", "memory_mib": SMALL});
        call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body))
    });
    let answers = futures::future::join_all(creates).await;
    let created: Vec<String> = answers
        .iter()
        .filter(|(s, _, _)| *s == StatusCode::CREATED)
        .filter_map(|(_, v, _)| v["id"].as_str().map(String::from))
        .collect();
    let refused = answers
        .iter()
        .filter(|(s, v, _)| {
            *s == StatusCode::TOO_MANY_REQUESTS
                && v["error"]["code"] == json!("quota_exceeded")
                && v["error"]["message"]
                    .as_str()
                    .unwrap_or("")
                    .contains("max_running = 3")
        })
        .count();
    let statuses: Vec<u16> = answers.iter().map(|(s, _, _)| s.as_u16()).collect();
    assert_eq!((created.len(), refused), (3, 7), "{statuses:?}\n{}", d.log());
    // At the limit: one more is refused; after one is destroyed, one fits again.
    let body = json!({"template": "minimal", "memory_mib": SMALL});
    let (s, _, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body.clone())).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    let (s, _, _) = call(
        &d,
        &k.key,
        Method::DELETE,
        &format!("/v1/sandboxes/{}", created[0]),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let mut rest: Vec<String> = created[1..].to_vec();
    rest.extend(v["id"].as_str().map(String::from));
    for id in rest {
        d.destroy(&id).await;
    }
}

#[tokio::test]
async fn waking_a_paused_sandbox_counts_against_max_running_like_a_resume() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    create_project(&d, "w", json!({"max_running": 1})).await;
    let k = create_key(&d, "w", "member", None).await;
    let body = json!({"template": "minimal", "memory_mib": SMALL});
    let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body.clone())).await;
    assert_eq!(s, StatusCode::CREATED, "{v}\n{}", d.log());
    let a = v["id"].as_str().unwrap_or_default().to_string();
    let (s, v, _) = call(
        &d,
        &k.key,
        Method::POST,
        &format!("/v1/sandboxes/{a}/pause"),
        None,
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    let b = v["id"].as_str().unwrap_or_default().to_string();
    // A command would auto-resume `a`: with `b` running, that is a second running sandbox.
    let cmd = json!({"cmd": "echo awake"});
    let commands = format!("/v1/sandboxes/{a}/commands");
    let (s, v, _) = call(&d, &k.key, Method::POST, &commands, Some(cmd.clone())).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{v}");
    assert_eq!(v["error"]["code"], json!("quota_exceeded"), "{v}");
    let (_, v, _) = call(&d, &k.key, Method::GET, &format!("/v1/sandboxes/{a}"), None).await;
    assert_eq!(v["state"], json!("paused"), "{v}");
    // With `b` gone there is room: the same command wakes `a` and runs.
    let (s, _, _) = call(&d, &k.key, Method::DELETE, &format!("/v1/sandboxes/{b}"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, v, _) = call(&d, &k.key, Method::POST, &commands, Some(cmd)).await;
    assert_eq!(s, StatusCode::OK, "{v}\n{}", d.log());
    assert_eq!(v["stdout"], json!("awake\n"), "{v}");
    d.destroy(&a).await;
}

/// Polls `GET path` with `key` until `done` holds for its status and answer, or panics after `secs`.
async fn poll(
    d: &Daemon,
    key: &str,
    path: &str,
    secs: u64,
    done: impl Fn(StatusCode, &Value) -> bool,
) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    loop {
        let (s, v, _) = call(d, key, Method::GET, path, None).await;
        if done(s, &v) {
            return v;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{path}: still {s} {v}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test]
async fn a_spent_budget_pauses_the_project_and_raising_it_resumes_intact() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    // 1 vCPU + 0.25 GiB at the default prices (1 credit each per second): 1.25 credits a running second.
    create_project(&d, "b", json!({"budget_credits": 20})).await;
    let k = create_key(&d, "b", "member", None).await;
    let body = json!({"template": "minimal", "memory_mib": SMALL});
    let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body.clone())).await;
    assert_eq!(s, StatusCode::CREATED, "{v}\n{}", d.log());
    let id = v["id"].as_str().unwrap_or_default().to_string();
    let cmd = json!({"cmd": "echo kept > /root/note && sync"});
    let commands = format!("/v1/sandboxes/{id}/commands");
    let (s, v, _) = call(&d, &k.key, Method::POST, &commands, Some(cmd)).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    // Within a minute the budget is spent and the sandbox is paused, not destroyed.
    let sandbox = format!("/v1/sandboxes/{id}");
    poll(&d, &k.key, &sandbox, 90, |_, v| v["state"] == json!("paused")).await;
    let (_, usage, _) = call(&d, &k.key, Method::GET, "/v1/projects/b/usage", None).await;
    let spent = usage["spent_credits"].as_f64().unwrap_or(0.0);
    assert!((20.0..40.0).contains(&spent), "{usage}");
    // Nothing starts while it is spent: not a create, not a resume, not a command waking the sandbox.
    for (method, path, body) in [
        (Method::POST, "/v1/sandboxes".to_string(), Some(body)),
        (Method::POST, format!("{sandbox}/resume"), None),
        (Method::POST, commands.clone(), Some(json!({"cmd": "true"}))),
    ] {
        let (s, v, _) = call(&d, &k.key, method, &path, body).await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{path}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("budget_credits = 20"),
            "{v}"
        );
    }
    // The admin raises it: the sandbox resumes with its files.
    let (s, v, _) = call(
        &d,
        &d.key,
        Method::PUT,
        "/v1/projects/b/quota",
        Some(json!({"budget_credits": 100000})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v, _) = call(&d, &k.key, Method::POST, &format!("{sandbox}/resume"), None).await;
    assert_eq!(s, StatusCode::OK, "{v}\n{}", d.log());
    let (s, v, _) = call(
        &d,
        &k.key,
        Method::POST,
        &commands,
        Some(json!({"cmd": "cat /root/note"})),
    )
    .await;
    assert_eq!((s, &v["stdout"]), (StatusCode::OK, &json!("kept\n")), "{v}");
    d.destroy(&id).await;
}

#[tokio::test]
async fn sandboxes_older_than_the_project_lifetime_are_destroyed() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    create_project(&d, "l", json!({"max_lifetime_s": 20})).await;
    let k = create_key(&d, "l", "member", None).await;
    let started = std::time::Instant::now();
    let body = json!({"template": "minimal", "memory_mib": SMALL, "timeout_s": 3600});
    let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}\n{}", d.log());
    let id = v["id"].as_str().unwrap_or_default().to_string();
    let sandbox = format!("/v1/sandboxes/{id}");
    poll(&d, &k.key, &sandbox, 90, |s, _| s == StatusCode::NOT_FOUND).await;
    assert!(
        started.elapsed() >= Duration::from_secs(20),
        "destroyed early: {:?}",
        started.elapsed()
    );
}

async fn disk_bytes(d: &Daemon, key: &str, project: &str) -> u64 {
    let path = format!("/v1/projects/{project}/usage");
    let (s, v, _) = call(d, key, Method::GET, &path, None).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    v["disk_bytes"].as_u64().unwrap_or(0)
}

#[tokio::test]
async fn disk_bytes_are_counted_and_at_the_limit_nothing_new_is_written() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    create_project(&d, "disk", json!({})).await;
    let k = create_key(&d, "disk", "member", None).await;
    let body = json!({"template": "minimal", "memory_mib": SMALL});
    let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body.clone())).await;
    assert_eq!(s, StatusCode::CREATED, "{v}\n{}", d.log());
    let id = v["id"].as_str().unwrap_or_default().to_string();
    let before = disk_bytes(&d, &k.key, "disk").await;
    // 32 MiB the guest writes land in the sandbox's disk on the host and count.
    let commands = format!("/v1/sandboxes/{id}/commands");
    let fill = json!({"cmd": "head -c 33554432 /dev/urandom > /root/big && sync"});
    let (s, v, _) = call(&d, &k.key, Method::POST, &commands, Some(fill)).await;
    assert_eq!((s, &v["exit_code"]), (StatusCode::OK, &json!(0)), "{v}");
    let after = disk_bytes(&d, &k.key, "disk").await;
    eprintln!("project disk: {before} bytes after create, {after} after writing 32 MiB");
    assert!(after >= before + (30 << 20), "{before} -> {after}");
    // At the limit: what would add to the disk is refused, naming the limit; the sandbox keeps working.
    let (s, v, _) = call(
        &d,
        &d.key,
        Method::PUT,
        "/v1/projects/disk/quota",
        Some(json!({"max_disk_bytes": after})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let sandbox = format!("/v1/sandboxes/{id}");
    for (path, body) in [
        ("/v1/sandboxes".to_string(), Some(body.clone())),
        (format!("{sandbox}/fork"), None),
        (format!("{sandbox}/snapshots"), None),
        (
            "/v1/templates".to_string(),
            Some(json!({"sandbox_id": id, "name": "disk-tpl"})),
        ),
    ] {
        let (s, v, _) = call(&d, &k.key, Method::POST, &path, body).await;
        assert_eq!(s, StatusCode::TOO_MANY_REQUESTS, "{path}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or("");
        assert!(
            v["error"]["code"] == json!("quota_exceeded")
                && message.contains(&format!("max_disk_bytes = {after}")),
            "{path}: {v}"
        );
    }
    let (s, v, _) = call(
        &d,
        &k.key,
        Method::POST,
        &commands,
        Some(json!({"cmd": "wc -c < /root/big"})),
    )
    .await;
    assert_eq!((s, &v["stdout"]), (StatusCode::OK, &json!("33554432\n")), "{v}");
    // Another project's usage does not include these bytes.
    let other = disk_bytes(&d, &d.key, "default").await;
    assert!(other < before, "{other} >= {before}");
    // Raised: a create fits again.
    let (s, v, _) = call(
        &d,
        &d.key,
        Method::PUT,
        "/v1/projects/disk/quota",
        Some(json!({"max_disk_bytes": after + (1 << 30)})),
    )
    .await;
    assert_eq!(s, StatusCode::OK, "{v}");
    let (s, v, _) = call(&d, &k.key, Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, StatusCode::CREATED, "{v}");
    d.destroy(&id).await;
    d.destroy(v["id"].as_str().unwrap_or_default()).await;
}

/// [`Daemon::post_sse`] as `(status, events, JSON error body or null)`.
async fn call_sse(
    d: &Daemon,
    key: &str,
    path: &str,
    body: Value,
) -> (StatusCode, Vec<(String, Value)>, Value) {
    let answer = d.post_sse(key, path, body).await;
    (answer.status, answer.events, answer.body.unwrap_or(Value::Null))
}

/// Creates and template saves asked for as event streams are recorded as their project's like JSON ones (the
/// object in the `done` event), and a streamed create holds its quota slot until it ends.
#[tokio::test]
async fn streamed_creates_are_owned_by_their_project_and_hold_their_quota() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    create_project(&d, "s", json!({"max_running": 1})).await;
    create_project(&d, "other", json!({})).await;
    let k = create_key(&d, "s", "member", None).await;
    let other = create_key(&d, "other", "member", None).await;
    // Three at once against a limit of one: one streams to `done`, two are refused with the JSON error.
    let creates = (0..3).map(|_| {
        let body = json!({"template": "minimal", "memory_mib": SMALL});
        call_sse(&d, &k.key, "/v1/sandboxes", body)
    });
    let answers = futures::future::join_all(creates).await;
    let mut ids = Vec::new();
    let mut refused = 0;
    for (status, events, error) in &answers {
        match status.as_u16() {
            200 => {
                let (name, data) = events.last().expect("events");
                assert_eq!(name, "done", "{events:?}");
                assert_eq!(data["sandbox"]["state"], "running", "{data}");
                ids.push(data["sandbox"]["id"].as_str().expect("id").to_string());
            }
            429 => {
                assert_eq!(error["error"]["code"], "quota_exceeded", "{error}");
                refused += 1;
            }
            other => panic!("unexpected {other}: {events:?} {error}\n{}", d.log()),
        }
    }
    assert_eq!((ids.len(), refused), (1, 2), "{answers:?}");
    let id = &ids[0];
    let path = format!("/v1/sandboxes/{id}");
    assert_eq!(call(&d, &k.key, Method::GET, &path, None).await.0, StatusCode::OK);
    assert_eq!(
        call(&d, &other.key, Method::GET, &path, None).await.0,
        StatusCode::NOT_FOUND
    );
    // A template saved through the event stream is the project's too.
    let (status, events, error) = call_sse(
        &d,
        &k.key,
        "/v1/templates",
        json!({"name": "streamed-t", "from_sandbox": id}),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{error}");
    assert_eq!(events.last().map(|e| e.0.as_str()), Some("done"), "{events:?}");
    assert_eq!(
        call(&d, &k.key, Method::GET, "/v1/templates/streamed-t", None)
            .await
            .0,
        StatusCode::OK
    );
    assert_eq!(
        call(&d, &other.key, Method::GET, "/v1/templates/streamed-t", None)
            .await
            .0,
        StatusCode::NOT_FOUND
    );
    let (s, _, _) = call(&d, &k.key, Method::DELETE, "/v1/templates/streamed-t", None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    let (s, _, _) = call(&d, &k.key, Method::DELETE, &path, None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
}
