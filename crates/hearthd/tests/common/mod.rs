//! Harness for real-VM tests: starts the real `hearthd` binary on a temporary data directory, reads its address
//! and API key, offers small client helpers, and on drop kills the daemon and every VMM process whose files
//! live in that directory.

#![allow(dead_code)]

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine;
use hearth_api::{CommandResult, Sandbox};
use hearth_testkit::{Hearthd, Network, Options, Stop};
// Not every test binary uses each of these.
#[allow(unused_imports)]
pub use hearth_testkit::{images_dir, pids_mentioning};
use reqwest::StatusCode;
use serde_json::{Value, json};

/// The answer of [`Daemon::post_sse`].
#[derive(Debug)]
pub struct SseAnswer {
    pub status: StatusCode,
    pub events: Vec<(String, Value)>,
    /// The JSON body of an answer that is not an event stream.
    pub body: Option<Value>,
}

/// Serialises the VM tests of one test binary: TCG guests on two cores boot much faster one group at a time.
pub static VM_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The `--vmm` the daemon under test gets: `HEARTH_TEST_VMM`, else `qemu`.
pub fn test_vmm() -> String {
    std::env::var("HEARTH_TEST_VMM").unwrap_or_else(|_| "qemu".to_owned())
}

pub fn template_built(name: &str) -> bool {
    images_dir().join("rootfs").join(format!("{name}.ext4")).is_file()
}

/// The kit's [`Hearthd`] (`addr`, `key`, `data_dir()`, `log()`, `pid()`, `try_wait()`, ...) with API helpers.
pub struct Daemon {
    hearthd: Hearthd,
    pub http: reqwest::Client,
}

impl Deref for Daemon {
    type Target = Hearthd;

    fn deref(&self) -> &Hearthd {
        &self.hearthd
    }
}

impl DerefMut for Daemon {
    fn deref_mut(&mut self) -> &mut Hearthd {
        &mut self.hearthd
    }
}

impl Daemon {
    /// A daemon without sandbox networking (the network tests bring their own uplink namespace).
    pub async fn start() -> Daemon {
        Self::start_with(&["--network", "off"]).await
    }

    /// A daemon with extra flags (kept for restarts). Its data directory is a short temporary directory (Unix
    /// socket paths under it stay short); on drop it is killed with every VMM process whose files live there.
    /// The VMM is QEMU, or `HEARTH_TEST_VMM` (the KVM test host runs these tests on `firecracker` too).
    pub async fn start_with(extra: &[&str]) -> Daemon {
        let opts = Options::new()
            .bin(env!("CARGO_BIN_EXE_hearthd"))
            .network(Network::Unset)
            .args(["--vmm", &test_vmm()])
            .args(extra)
            .tempdir_prefix("hd")
            .data_in_tempdir_root()
            .stop_on_drop(Stop::Kill)
            .kill_leftover_vmms(true)
            .log_on_panic(false);
        Daemon {
            hearthd: Hearthd::start_async(opts).await,
            http: http_client(),
        }
    }

    /// A daemon started with `opts` as given (the caller picks networking and flags).
    pub async fn start_opts(opts: Options) -> Daemon {
        Daemon {
            hearthd: Hearthd::start_async(opts).await,
            http: http_client(),
        }
    }

    /// `kill -9` the daemon (VMs keep running) and start it again on the same data directory.
    pub async fn kill9_and_restart(&mut self) {
        self.hearthd.kill9_and_restart_async().await;
    }

    /// SIGTERM the daemon (graceful: VMs keep running), wait for it to exit, start it again on the same dir.
    pub async fn term_and_restart(&mut self) {
        self.hearthd.term_and_restart_async().await;
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn req(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, self.url(path)).bearer_auth(&self.key)
    }

    pub async fn create(&self, body: Value) -> Sandbox {
        let resp = self
            .req(reqwest::Method::POST, "/v1/sandboxes")
            .json(&body)
            .send()
            .await
            .expect("create");
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        assert_eq!(status, StatusCode::CREATED, "create: {text}\n{}", self.log());
        serde_json::from_str(&text).expect("sandbox json")
    }

    pub async fn get(&self, id: &str) -> (StatusCode, Value) {
        let resp = self
            .req(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"))
            .send()
            .await
            .expect("get");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    pub async fn list_ids(&self) -> Vec<String> {
        let v: Value = self
            .req(reqwest::Method::GET, "/v1/sandboxes")
            .send()
            .await
            .expect("list")
            .json()
            .await
            .expect("json");
        v["sandboxes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s["id"].as_str().map(String::from))
            .collect()
    }

    pub async fn destroy(&self, id: &str) {
        let resp = self
            .req(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"))
            .send()
            .await
            .expect("delete");
        assert_eq!(
            resp.status(),
            StatusCode::NO_CONTENT,
            "{}",
            resp.text().await.unwrap_or_default()
        );
    }

    /// Runs a command (buffered) and returns its result; panics on a non-200 answer.
    pub async fn run(&self, id: &str, body: Value) -> CommandResult {
        let (status, v) = self.run_raw(id, body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        serde_json::from_value(v).expect("command result")
    }

    pub async fn sh(&self, id: &str, cmd: &str) -> CommandResult {
        self.run(id, json!({ "cmd": cmd })).await
    }

    pub async fn run_raw(&self, id: &str, body: Value) -> (StatusCode, Value) {
        let resp = self
            .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/commands"))
            .json(&body)
            .send()
            .await
            .expect("command");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Runs a command with `Accept: text/event-stream` and collects its events.
    pub async fn run_sse(&self, id: &str, body: Value) -> SseOutcome {
        let mut resp = self
            .req(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/commands"))
            .header("accept", "text/event-stream")
            .json(&body)
            .send()
            .await
            .expect("command");
        assert_eq!(resp.status(), StatusCode::OK);
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        let mut out = SseOutcome::default();
        let mut buf = Vec::new();
        let mut event = String::new();
        while let Some(chunk) = resp.chunk().await.expect("chunk") {
            buf.extend_from_slice(&chunk);
            while let Some(nl) = buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                let line = String::from_utf8(line).expect("utf8");
                let line = line.trim_end_matches(['\n', '\r']);
                if let Some(e) = line.strip_prefix("event:") {
                    event = e.trim().to_string();
                } else if let Some(d) = line.strip_prefix("data:") {
                    let v: Value = serde_json::from_str(d.trim()).expect("event json");
                    out.events.push(event.clone());
                    let b64 = |v: &Value| {
                        base64::engine::general_purpose::STANDARD
                            .decode(v["data_b64"].as_str().unwrap_or(""))
                            .expect("base64")
                    };
                    match event.as_str() {
                        "stdout" => out.stdout.extend(b64(&v)),
                        "stderr" => out.stderr.extend(b64(&v)),
                        "exit" | "error" => out.end = Some(v),
                        "start" => out.pid = v["pid"].as_u64(),
                        other => panic!("unexpected event {other}"),
                    }
                }
            }
        }
        out
    }

    /// `POST path` with `Accept: text/event-stream`, authenticated with `key`: the status and either the SSE
    /// events as `(event name, JSON data)` pairs (keep-alive comments skipped), or, when the answer is not a
    /// stream (an error answered before the stream began), its JSON body.
    pub async fn post_sse(&self, key: &str, path: &str, body: Value) -> SseAnswer {
        let resp = self
            .http
            .post(self.url(path))
            .bearer_auth(key)
            .header("accept", "text/event-stream")
            .json(&body)
            .send()
            .await
            .expect("request");
        let status = resp.status();
        let streamed = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let text = resp.text().await.expect("body");
        if !streamed {
            let body = serde_json::from_str(&text).unwrap_or(Value::Null);
            return SseAnswer {
                status,
                events: Vec::new(),
                body: Some(body),
            };
        }
        let mut events = Vec::new();
        for block in text.split("\n\n") {
            let mut name = String::new();
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = v.trim().to_string();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim_start());
                }
            }
            if !data.is_empty() {
                events.push((name, serde_json::from_str(&data).expect("event json")));
            }
        }
        SseAnswer {
            status,
            events,
            body: None,
        }
    }

    pub async fn put_file(&self, id: &str, path: &str, data: Vec<u8>) -> (StatusCode, Value) {
        let resp = self
            .req(
                reqwest::Method::PUT,
                &format!("/v1/sandboxes/{id}/files?path={path}"),
            )
            .body(data)
            .send()
            .await
            .expect("put");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    pub async fn get_file(&self, id: &str, path: &str) -> (StatusCode, Vec<u8>) {
        let resp = self
            .req(
                reqwest::Method::GET,
                &format!("/v1/sandboxes/{id}/files?path={path}"),
            )
            .send()
            .await
            .expect("get file");
        let status = resp.status();
        (status, resp.bytes().await.expect("bytes").to_vec())
    }

    /// A request with an optional JSON body; returns the status and the JSON answer (or null).
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (StatusCode, Value) {
        let mut rb = self.req(method, path);
        if let Some(b) = body {
            rb = rb.json(&b);
        }
        let resp = rb.send().await.expect("request");
        let status = resp.status();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// Pids of live (non-zombie) processes whose command line mentions this sandbox's directory, or its
    /// Firecracker instance id (a jailed Firecracker only names paths inside its chroot).
    pub fn vm_pids(&self, id: &str) -> Vec<u32> {
        let mut pids = pids_mentioning(&self.sandbox_dir(id));
        let instance = hearth_vmm::firecracker::FirecrackerVmm::instance_id(id);
        for pid in pids_mentioning(std::path::Path::new(&instance)) {
            if !pids.contains(&pid) {
                pids.push(pid);
            }
        }
        pids
    }

    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.data_dir().join("sandboxes").join(id)
    }
}

#[derive(Default, Debug)]
pub struct SseOutcome {
    pub pid: Option<u64>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub events: Vec<String>,
    pub end: Option<Value>,
}

/// Polls `f` until it returns true or `timeout` passes.
pub async fn wait_until<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if f().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    false
}

/// A client whose idle pooled connections close after 30 s (as hearth-client's).
fn http_client() -> reqwest::Client {
    reqwest::Client::builder()
        .pool_idle_timeout(std::time::Duration::from_secs(30))
        .build()
        .expect("http client")
}
