//! The official E2B SDKs, unchanged, against the real `hearthd` with real VMs: npm `e2b` 2.51.0 under Node
//! (tests/js/flow.mjs) and PyPI `e2b` 2.63.0 under Python (tests/py/flow.py), configured only by
//! `E2B_API_URL`, `E2B_SANDBOX_URL` (both the daemon's address) and `E2B_API_KEY` (its key). Each program
//! runs create → commands with streamed output and exit codes → background commands with stdin, connect and
//! kill → files (write, read, list, rename, remove, watch) → setTimeout → pause → connect (resumed, state
//! intact) → list → kill → the not-found errors, plus a bash template. `wire_level_answers` checks what the
//! SDKs cannot show (statuses, framing, routing). The SDKs are installed by scripts/install-e2b-test-deps.sh.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use hearth_testkit::{Hearthd, Options, images_dir};
use serde_json::{Value, json};

fn bin_dir() -> PathBuf {
    hearth_testkit::build_bins(&[("hearthd", "hearthd"), ("hearth-cli", "hearth")])
}

fn start() -> Hearthd {
    Hearthd::start(
        Options::new()
            .bin(bin_dir().join("hearthd"))
            .cleanup_with_cli(bin_dir().join("hearth")),
    )
}

fn tests_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests")
}

fn require(path: &Path, what: &str) {
    assert!(
        path.exists(),
        "{what} is missing ({}): run `bash scripts/install-e2b-test-deps.sh`",
        path.display()
    );
}

/// Runs an SDK program against `daemon` with nothing but E2B's own environment variables pointing at it.
fn run_sdk(daemon: &Hearthd, mut program: Command, tag: &str) {
    let bash_template = "debian";
    require(
        &images_dir().join(format!("rootfs/{bash_template}.ext4")),
        "the debian guest image (images/build.sh)",
    );
    for var in [
        "E2B_DOMAIN",
        "E2B_DEBUG",
        "E2B_ACCESS_TOKEN",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
    ] {
        program.env_remove(var).env_remove(var.to_lowercase());
    }
    let out = program
        .env("E2B_API_URL", &daemon.url)
        .env("E2B_SANDBOX_URL", &daemon.url)
        .env("E2B_API_KEY", &daemon.key)
        .env("NO_PROXY", "127.0.0.1,localhost")
        .env("HEARTH_E2B_TEMPLATE", "minimal")
        .env("HEARTH_E2B_BASH_TEMPLATE", bash_template)
        .output()
        .unwrap_or_else(|e| panic!("{tag}: cannot run the SDK program: {e}"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stderr.contains(&format!("[{tag}] ok")),
        "{tag} failed ({}):\n{}{stderr}\n---- hearthd log ----\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        daemon.log()
    );
}

#[test]
fn js_sdk_drives_a_sandbox_through_its_whole_life() {
    let js = tests_dir().join("js");
    let node = js.join("node_modules/.bin/node");
    require(&node, "Node.js 22 for the E2B JavaScript SDK");
    require(&js.join("node_modules/e2b/package.json"), "the npm package e2b");
    let daemon = start();
    let mut cmd = Command::new(node);
    cmd.arg("flow.mjs").current_dir(&js);
    run_sdk(&daemon, cmd, "js");
}

#[test]
fn python_sdk_drives_a_sandbox_through_its_whole_life() {
    let py = tests_dir().join("py");
    let python = py.join(".venv/bin/python");
    require(
        &python,
        "the Python virtual environment with the PyPI package e2b",
    );
    let daemon = start();
    let mut cmd = Command::new(python);
    cmd.arg("flow.py").current_dir(&py);
    run_sdk(&daemon, cmd, "py");
}

struct Wire {
    http: reqwest::Client,
    url: String,
    key: String,
}

impl Wire {
    async fn control(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.url))
            .header("x-api-key", &self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    fn envd(&self, id: &str, path: &str) -> reqwest::RequestBuilder {
        self.http
            .post(format!("{}{path}", self.url))
            .header("e2b-sandbox-id", id)
            .header("e2b-sandbox-port", "49983")
            .header("x-access-token", &self.key)
    }

    async fn unary(&self, id: &str, method: &str, msg: Value) -> (u16, Value) {
        let resp = self
            .envd(id, method)
            .header("content-type", "application/json")
            .body(msg.to_string())
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }
}

/// Splits a Connect stream body into (flags, JSON) envelopes.
fn envelopes(mut body: &[u8]) -> Vec<(u8, Value)> {
    let mut out = Vec::new();
    while body.len() >= 5 {
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        let msg = serde_json::from_slice(&body[5..5 + len]).unwrap();
        out.push((body[0], msg));
        body = &body[5 + len..];
    }
    assert!(body.is_empty(), "trailing bytes in the stream");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wire_level_answers() {
    let bins = tokio::task::spawn_blocking(bin_dir).await.unwrap();
    let daemon = Hearthd::start_async(
        Options::new()
            .bin(bins.join("hearthd"))
            .cleanup_with_cli(bins.join("hearth")),
    )
    .await;
    let w = Wire {
        http: reqwest::Client::new(),
        url: daemon.url.clone(),
        key: daemon.key.clone(),
    };
    use reqwest::Method;

    // Control plane: the key is required, errors are E2B's `{code, message}`.
    for key in [None, Some("hk_wrong")] {
        let mut req = w.http.get(format!("{}/v2/sandboxes", w.url));
        if let Some(k) = key {
            req = req.header("x-api-key", k);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{key:?}");
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["code"], 401, "{body}");
    }
    let (s, v) = w
        .control(Method::GET, "/sandboxes/sbx_0000000000000000", None)
        .await;
    assert_eq!((s, v["code"].as_u64()), (404, Some(404)), "{v}");
    let resp = w
        .http
        .post(format!("{}/v2/sandboxes", w.url))
        .header("x-api-key", &w.key)
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    let (s, v) = w
        .control(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "minimal", "mcp": {"github/x": {}}})),
        )
        .await;
    assert_eq!(
        (s, v["code"].as_u64()),
        (400, Some(400)),
        "unsupported options are refused: {v}"
    );
    let (s, v) = w
        .control(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "no-such-template"})),
        )
        .await;
    assert!((400..500).contains(&s) && v["code"] == s, "{s} {v}");

    // Create: 201 with the fields the SDKs require; the envd token is the caller's key.
    let (s, sbx) = w
        .control(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "minimal", "timeout": 300})),
        )
        .await;
    assert_eq!(s, 201, "{sbx}");
    let id = sbx["sandboxID"].as_str().unwrap().to_owned();
    assert_eq!(sbx["templateID"], "minimal");
    assert_eq!(sbx["clientID"], "hearth");
    assert_eq!(sbx["envdVersion"], hearth_e2b::ENVD_VERSION);
    assert_eq!(sbx["envdAccessToken"], w.key.as_str());
    // The E2B form of the id (`-` for hearth's `_`); hearth's own form is accepted too.
    let hearth_id = id.replacen("sbx-", "sbx_", 1);
    assert!(hearth_api_id_ok(&hearth_id), "{id}");
    let (s, v) = w
        .control(Method::GET, &format!("/sandboxes/{hearth_id}"), None)
        .await;
    assert_eq!((s, v["sandboxID"].as_str()), (200, Some(id.as_str())), "{v}");
    let (s, _) = w
        .control(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 200, "connect to a running sandbox");
    // Some SDK releases send the sandbox headers on control-plane calls: still the control plane.
    let resp = w
        .http
        .post(format!("{}/sandboxes/{id}/connect", w.url))
        .header("x-api-key", &w.key)
        .header("e2b-sandbox-id", &id)
        .header("e2b-sandbox-port", "49983")
        .json(&json!({"timeout": 300}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);

    // envd: routed by header or host name, never by path alone; the key is required.
    let health = |req: reqwest::RequestBuilder| async move { req.send().await.unwrap().status().as_u16() };
    let get_health = || {
        w.http
            .get(format!("{}/health", w.url))
            .header("e2b-sandbox-id", &id)
            .header("x-access-token", &w.key)
    };
    assert_eq!(health(get_health()).await, 204);
    let resp = w
        .http
        .get(format!("{}/health", w.url))
        .header("e2b-sandbox-id", &id)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "envd without a token");
    let resp = w
        .http
        .get(format!("{}/health", w.url))
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", "hk_wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401, "envd with a wrong token");
    let (s, v) = w
        .unary(&id, "/filesystem.Filesystem/Stat", json!({"path": "/"}))
        .await;
    assert_eq!(s, 200, "{v}");
    let resp = w
        .http
        .post(format!("{}/filesystem.Filesystem/Stat", w.url))
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", "hk_wrong")
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["code"], "unauthenticated", "{body}");
    let by_host = w
        .http
        .get(format!("{}/health", w.url))
        .header("host", format!("49983-{id}.e2b.test"))
        .header("x-access-token", &w.key);
    assert_eq!(health(by_host).await, 204, "routed by host name");
    let plain = w.http.get(format!("{}/health", w.url)).send().await.unwrap();
    assert_eq!(plain.status(), 404, "no envd route without the header");
    let gone = w
        .http
        .get(format!("{}/health", w.url))
        .header("e2b-sandbox-id", "sbx_0000000000000000")
        .header("x-access-token", &w.key)
        .send()
        .await
        .unwrap();
    assert_eq!(gone.status(), 502);
    assert!(gone.text().await.unwrap().contains("was not found"));

    // Connect unary: a missing file is not_found; a missing sandbox is unavailable ("was not found").
    let (s, v) = w
        .unary(&id, "/filesystem.Filesystem/Stat", json!({"path": "/nope"}))
        .await;
    assert_eq!((s, v["code"].as_str()), (404, Some("not_found")), "{v}");
    let (s, v) = w
        .unary(
            "sbx_0000000000000000",
            "/filesystem.Filesystem/Stat",
            json!({"path": "/"}),
        )
        .await;
    assert_eq!((s, v["code"].as_str()), (503, Some("unavailable")), "{v}");
    let (s, v) = w.unary(&id, "/process.Process/Nope", json!({})).await;
    assert_eq!((s, v["code"].as_str()), (501, Some("unimplemented")), "{v}");

    // Connect server streaming: start, data, end, then the end-of-stream message.
    let start =
        json!({"process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo hi; exit 3"]}, "stdin": false});
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(start.to_string().len() as u32).to_be_bytes());
    frame.extend_from_slice(start.to_string().as_bytes());
    let resp = w
        .envd(&id, "/process.Process/Start")
        .header("content-type", "application/connect+json")
        .body(frame)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/connect+json");
    let frames = envelopes(&resp.bytes().await.unwrap());
    assert!(
        frames[0].1["event"]["start"]["pid"].as_u64().is_some(),
        "{frames:?}"
    );
    let out: String = frames
        .iter()
        .filter_map(|(_, m)| m["event"]["data"]["stdout"].as_str())
        .map(|b| String::from_utf8(base64_decode(b)).unwrap())
        .collect();
    assert_eq!(out, "hi\n");
    let (flags, end) = frames.last().unwrap();
    assert_eq!((*flags, end), (2, &json!({})));
    let exit = &frames[frames.len() - 2].1["event"]["end"];
    assert_eq!(
        (exit["exitCode"].as_i64(), exit["status"].as_str()),
        (Some(3), Some("exit status 3"))
    );

    // Pause: 204, again 409; connect resumes (201), then it is running (200).
    let (s, _) = w
        .control(Method::POST, &format!("/sandboxes/{id}/pause"), None)
        .await;
    assert_eq!(s, 204);
    let (s, v) = w
        .control(Method::POST, &format!("/sandboxes/{id}/pause"), None)
        .await;
    assert_eq!((s, v["code"].as_u64()), (409, Some(409)));
    assert_eq!(health(get_health()).await, 502, "a paused sandbox is not running");
    let (s, v) = w
        .control(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({"timeout": 600})),
        )
        .await;
    assert_eq!((s, v["sandboxID"].as_str()), (201, Some(id.as_str())), "{v}");
    let (s, _) = w
        .control(
            Method::POST,
            &format!("/v2/sandboxes/{id}/connect"),
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 200);
    let (s, list) = w.control(Method::GET, "/v2/sandboxes?state=running", None).await;
    assert_eq!(s, 200);
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .any(|x| x["sandboxID"] == id.as_str()),
        "{list}"
    );

    // Kill: 204, then 404.
    let (s, _) = w.control(Method::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, 204);
    let (s, _) = w.control(Method::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, 404);
}

fn hearth_api_id_ok(id: &str) -> bool {
    id.len() == 20 && id.starts_with("sbx_") && id[4..].bytes().all(|b| b.is_ascii_hexdigit())
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

/// E2B's network options become hearth egress policies (a daemon with sandbox networking on; its uplink a
/// namespace this test made, with no route anywhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_options_become_hearth_policies() {
    use reqwest::Method;
    // Declared first so that it is removed last, after the daemon and its sandboxes.
    let uplink = hearth_testkit::TestNetns::new("he2b");
    let bins = tokio::task::spawn_blocking(bin_dir).await.unwrap();
    let daemon = Hearthd::start_async(
        Options::new()
            .bin(bins.join("hearthd"))
            .cleanup_with_cli(bins.join("hearth"))
            .uplink(&uplink, "10.213.84.0/24"),
    )
    .await;
    let w = Wire {
        http: reqwest::Client::new(),
        url: daemon.url.clone(),
        key: daemon.key.clone(),
    };
    let policy = |id: String| {
        let (http, url, key) = (w.http.clone(), w.url.clone(), w.key.clone());
        async move {
            let id = id.replacen("sbx-", "sbx_", 1);
            let resp = http
                .get(format!("{url}/v1/sandboxes/{id}/network"))
                .bearer_auth(key)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200);
            resp.json::<Value>().await.unwrap()["egress"].clone()
        }
    };
    // The usual E2B pattern: deny everything, allow a few destinations (domains included).
    let body = json!({"templateID": "minimal", "network": {
        "denyOut": ["0.0.0.0/0"], "allowOut": ["pypi.org", "1.1.1.1"]}});
    let (s, sbx) = w.control(Method::POST, "/v2/sandboxes", Some(body)).await;
    assert_eq!(s, 201, "{sbx}");
    let id = sbx["sandboxID"].as_str().unwrap().to_owned();
    assert_eq!(
        policy(id.clone()).await,
        json!({"default": "deny", "allow": ["pypi.org", "1.1.1.1"]})
    );
    // updateNetwork replaces it at once: no internet at all.
    let (s, v) = w
        .control(
            Method::PUT,
            &format!("/sandboxes/{id}/network"),
            Some(json!({"allow_internet_access": false})),
        )
        .await;
    assert_eq!(s, 204, "{v}");
    assert_eq!(policy(id.clone()).await, json!({"default": "deny"}));
    // An empty update is hearth's default (everything but the always-denied destinations).
    let (s, _) = w
        .control(Method::PUT, &format!("/sandboxes/{id}/network"), Some(json!({})))
        .await;
    assert_eq!(s, 204);
    assert_eq!(policy(id.clone()).await, json!({"default": "allow"}));
    let (s, _) = w.control(Method::DELETE, &format!("/sandboxes/{id}"), None).await;
    assert_eq!(s, 204);
}

/// Issue 16 item 4, "same guarantees as hearth's own API": the adapter forwards the caller's key, so E2B calls
/// are scoped to the key's project and its quotas apply. A member key of another project sees an admin's
/// sandbox as absent on both E2B APIs and cannot list it; its own creates stop at the project's quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e2b_calls_are_scoped_to_the_callers_project_and_quota() {
    use reqwest::Method;
    let bins = tokio::task::spawn_blocking(bin_dir).await.unwrap();
    let daemon = Hearthd::start_async(
        Options::new()
            .bin(bins.join("hearthd"))
            .cleanup_with_cli(bins.join("hearth")),
    )
    .await;
    let http = reqwest::Client::new();
    let admin = Wire {
        http: http.clone(),
        url: daemon.url.clone(),
        key: daemon.key.clone(),
    };
    let v1 = |method: Method, path: &str, body: Value| {
        http.request(method, format!("{}{path}", daemon.url))
            .bearer_auth(&daemon.key)
            .json(&body)
            .send()
    };
    let r = v1(
        Method::POST,
        "/v1/projects",
        json!({"name": "other", "quota": {"max_running": 1}}),
    )
    .await
    .unwrap();
    assert!(r.status().is_success(), "{}", r.text().await.unwrap());
    let r = v1(
        Method::POST,
        "/v1/keys",
        json!({"project": "other", "role": "member"}),
    )
    .await
    .unwrap();
    assert!(r.status().is_success());
    let created: Value = r.json().await.unwrap();
    let other = Wire {
        http: http.clone(),
        url: daemon.url.clone(),
        key: created["key"].as_str().unwrap().to_owned(),
    };

    let (s, sbx) = admin
        .control(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "minimal", "timeout": 300})),
        )
        .await;
    assert_eq!(s, 201, "{sbx}");
    let mine = sbx["sandboxID"].as_str().unwrap().to_owned();
    // Another project's key: absent on the control plane and on envd, and not listed.
    let (s, v) = other
        .control(Method::GET, &format!("/sandboxes/{mine}"), None)
        .await;
    assert_eq!((s, v["code"].as_u64()), (404, Some(404)), "{v}");
    let (s, v) = other
        .unary(&mine, "/filesystem.Filesystem/Stat", json!({"path": "/"}))
        .await;
    assert_ne!(s, 200, "envd of another project's sandbox: {v}");
    let (s, v) = other.control(Method::GET, "/v2/sandboxes", None).await;
    assert_eq!(s, 200, "{v}");
    assert!(!v.to_string().contains(&mine), "listed to another project: {v}");

    // Its own sandbox, then the project's quota (max_running 1) refuses the next with a clear message.
    let (s, own) = other
        .control(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "minimal", "timeout": 300})),
        )
        .await;
    assert_eq!(s, 201, "{own}");
    let (s, v) = other
        .control(
            Method::POST,
            "/v2/sandboxes",
            Some(json!({"templateID": "minimal", "timeout": 300})),
        )
        .await;
    assert_eq!(s, 429, "over the project's quota: {v}");
    assert!(
        v["message"].as_str().unwrap_or_default().contains("max_running"),
        "{v}"
    );
    let (s, v) = other.control(Method::GET, "/v2/sandboxes", None).await;
    assert_eq!(s, 200);
    let own_id = own["sandboxID"].as_str().unwrap();
    assert!(v.to_string().contains(own_id), "its own sandbox is listed: {v}");
    for (w, id) in [(&admin, mine.as_str()), (&other, own_id)] {
        let (s, v) = w.control(Method::DELETE, &format!("/sandboxes/{id}"), None).await;
        assert!((200..300).contains(&s), "{v}");
    }
}
