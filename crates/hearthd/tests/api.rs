//! In-process API tests (no VM): the router is called directly, with a VMM driver that cannot start machines.
//! They check that every kind of bad input gets its typed error and that the daemon keeps answering.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use hearth_api::{ErrorBody, ErrorCode, SandboxList, SandboxState, SystemInfo};
use hearth_vmm::{Accel, VmHandle, VmSpec, Vmm, VmmError, VmmKind};
use hearthd::config::Paths;
use hearthd::db::{Db, SandboxRow};
use hearthd::service::{Sandboxes, Settings, VmmInfo};
use hearthd::{AppState, auth};
use tower::ServiceExt;

/// What the fake driver does on `start`.
#[derive(Clone, Copy)]
enum StartBehaviour {
    Fail,
    Panic,
}

struct FakeVmm(StartBehaviour);

#[async_trait::async_trait]
impl Vmm for FakeVmm {
    fn kind(&self) -> VmmKind {
        VmmKind::Qemu
    }
    fn accel(&self) -> Accel {
        Accel::Tcg
    }
    fn version(&self) -> String {
        "fake 0".into()
    }
    async fn prepare_disk(
        &self,
        _base: &Path,
        _format: hearth_vmm::DiskFormat,
        dest_dir: &Path,
    ) -> Result<PathBuf, VmmError> {
        let disk = dest_dir.join("disk.img");
        std::fs::write(&disk, b"disk").map_err(|source| VmmError::Io {
            path: disk.clone(),
            source,
        })?;
        Ok(disk)
    }
    async fn start(&self, spec: &VmSpec) -> Result<VmHandle, VmmError> {
        std::fs::write(spec.run_dir.join("console.log"), "booting\nkernel panic: fake\n").map_err(
            |source| VmmError::Io {
                path: spec.run_dir.clone(),
                source,
            },
        )?;
        match self.0 {
            StartBehaviour::Fail => Err(VmmError::StartFailed {
                id: spec.id.clone(),
                detail: "no VMM in this test".into(),
            }),
            StartBehaviour::Panic => panic!("driver bug"),
        }
    }
    async fn connect_agent(&self, vm: &VmHandle) -> Result<tokio::net::UnixStream, VmmError> {
        Err(VmmError::AgentChannel {
            id: vm.run_dir.display().to_string(),
            detail: "fake".into(),
        })
    }
    async fn stop(&self, _vm: &VmHandle) -> Result<(), VmmError> {
        Ok(())
    }
    fn is_alive(&self, _vm: &VmHandle) -> bool {
        false
    }
}

struct Fixture {
    dir: tempfile::TempDir,
    key: String,
    state: AppState,
}

impl Fixture {
    fn new(behaviour: StartBehaviour) -> Fixture {
        let dir = tempfile::tempdir().expect("tempdir");
        let paths = Paths::new(dir.path().join("data"), Some(dir.path().join("images")));
        std::fs::create_dir_all(paths.images_dir.join("rootfs")).expect("images dir");
        std::fs::write(paths.images_dir.join("rootfs/minimal.ext4"), b"").expect("template");
        std::fs::create_dir_all(paths.sandboxes_dir()).expect("sandboxes dir");
        let db = Db::open(&paths.db()).expect("db");
        let keys = auth::ensure_key(&db, &paths.api_key(), 0).expect("key");
        let key = std::fs::read_to_string(paths.api_key())
            .expect("key file")
            .trim()
            .to_string();
        let settings = Settings {
            paths,
            default_template: "minimal".into(),
            ready_timeout: Duration::from_secs(5),
            agent_unresponsive: Duration::from_secs(3),
            max_snapshots_per_sandbox: 64,
            warm_creates: false,
            boot_snapshots_max: 8,
            credit_prices: Default::default(),
        };
        let info = VmmInfo {
            reason: "test".into(),
            checks: vec![],
        };
        let sandboxes = Sandboxes::new(db, Arc::new(FakeVmm(behaviour)), info, settings);
        let tenancy = hearthd::tenancy::Tenancy::new(sandboxes.clone(), keys.clone(), Default::default());
        let state = AppState {
            sandboxes,
            keys,
            metrics: hearthd::metrics::install(),
            tenancy,
        };
        Fixture { dir, key, state }
    }

    fn paths(&self) -> &Paths {
        &self.state.sandboxes.settings().paths
    }

    async fn send(&self, req: Request<Body>) -> (StatusCode, Vec<u8>) {
        let resp = hearthd::app(self.state.clone())
            .oneshot(req)
            .await
            .expect("infallible");
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .expect("body");
        (status, body.to_vec())
    }

    fn req(&self, method: &str, uri: &str) -> axum::http::request::Builder {
        Request::builder()
            .method(method)
            .uri(uri)
            .header(header::AUTHORIZATION, format!("Bearer {}", self.key))
    }

    async fn json(&self, method: &str, uri: &str, body: &str) -> (StatusCode, Vec<u8>) {
        let req = self
            .req(method, uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body.to_string()))
            .expect("request");
        self.send(req).await
    }

    async fn get(&self, uri: &str) -> (StatusCode, Vec<u8>) {
        self.send(self.req("GET", uri).body(Body::empty()).expect("request"))
            .await
    }

    /// Asserts an error status and code, then that the daemon still answers `/healthz`.
    async fn expect_error(&self, got: (StatusCode, Vec<u8>), status: u16, code: ErrorCode) {
        let text = String::from_utf8_lossy(&got.1).into_owned();
        assert_eq!(got.0.as_u16(), status, "body: {text}");
        let body: ErrorBody = serde_json::from_slice(&got.1).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(body.error.code, code, "body: {text}");
        assert!(!body.error.message.is_empty());
        self.expect_healthy().await;
    }

    async fn expect_healthy(&self) {
        let (status, body) = self
            .send(
                Request::builder()
                    .uri("/healthz")
                    .body(Body::empty())
                    .expect("request"),
            )
            .await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, b"ok");
    }

    fn insert_row(&self, id: &str, state: SandboxState, metadata: &[(&str, &str)]) {
        let row = SandboxRow {
            id: id.into(),
            state,
            template: "minimal".into(),
            vcpus: 1,
            memory_mib: 256,
            created_at_ms: 1_000,
            end_at_ms: i64::MAX / 2,
            env: BTreeMap::new(),
            metadata: metadata
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            vmm: VmmKind::Qemu,
            handle: None,
            error: (state == SandboxState::Failed).then(|| "VM process exited".into()),
            auto_resume: true,
            on_timeout: hearth_api::OnTimeout::Kill,
            timeout_s: 300,
            parent_id: None,
            snapshot_id: None,
            paused: None,
            disk: None,
        };
        self.state.sandboxes.db().insert(&row).expect("insert");
    }
}

#[tokio::test]
async fn auth_is_required_on_v1_only() {
    let f = Fixture::new(StartBehaviour::Fail);
    for uri in [
        "/v1/sandboxes",
        "/v1/system",
        "/v1/sandboxes/sbx_0123456789abcdef",
    ] {
        let none = Request::builder().uri(uri).body(Body::empty()).expect("request");
        f.expect_error(f.send(none).await, 401, ErrorCode::Unauthorized)
            .await;
        for bad in [
            "Bearer hk_wrong",
            "Basic abc",
            &f.key,
            &format!("Bearer {}x", f.key),
            "Bearer ",
        ] {
            let req = Request::builder()
                .uri(uri)
                .header(header::AUTHORIZATION, bad)
                .body(Body::empty());
            f.expect_error(f.send(req.expect("request")).await, 401, ErrorCode::Unauthorized)
                .await;
        }
    }
    let (status, body) = f.get("/v1/sandboxes").await;
    assert_eq!(status, StatusCode::OK);
    let list: SandboxList = serde_json::from_slice(&body).expect("list");
    assert!(list.sandboxes.is_empty());
    for open in ["/openapi.json", "/metrics"] {
        let (status, _) = f
            .send(Request::builder().uri(open).body(Body::empty()).expect("request"))
            .await;
        assert_eq!(status, StatusCode::OK, "{open}");
    }
}

#[tokio::test]
async fn malformed_bodies_are_invalid_json() {
    let f = Fixture::new(StartBehaviour::Fail);
    for body in [
        "{",
        "not json",
        "[]",
        r#"{"vcpus": "two"}"#,
        r#"{"vcpus": -1}"#,
        r#"{"bogus": 1}"#,
        r#"{"template": 5}"#,
        r#"{"env": {"A": 1}}"#,
    ] {
        f.expect_error(
            f.json("POST", "/v1/sandboxes", body).await,
            400,
            ErrorCode::InvalidJson,
        )
        .await;
    }
    // No content type.
    let req = f
        .req("POST", "/v1/sandboxes")
        .body(Body::from("{}"))
        .expect("request");
    f.expect_error(f.send(req).await, 400, ErrorCode::InvalidJson)
        .await;
    f.insert_row("sbx_00000000000000c1", SandboxState::Running, &[]);
    for body in [
        r#"{"cmd": "true", "shell": 1}"#,
        r#"{"cmd": ["a"]}"#,
        r#"{"timeout_s": "x"}"#,
    ] {
        let uri = "/v1/sandboxes/sbx_00000000000000c1/commands";
        f.expect_error(f.json("POST", uri, body).await, 400, ErrorCode::InvalidJson)
            .await;
    }
}

#[tokio::test]
async fn out_of_range_values_are_invalid_arguments() {
    let f = Fixture::new(StartBehaviour::Fail);
    for body in [
        r#"{"vcpus": 0}"#,
        r#"{"vcpus": 1000}"#,
        r#"{"memory_mib": 1}"#,
        r#"{"memory_mib": 10000000}"#,
        r#"{"timeout_s": 0}"#,
        r#"{"timeout_s": 100000}"#,
        r#"{"template": "../etc"}"#,
        r#"{"template": "Debian"}"#,
        r#"{"env": {"1BAD": "x"}}"#,
        r#"{"env": {"A": "x\u0000y"}}"#,
        r#"{"metadata": {"": "x"}}"#,
    ] {
        f.expect_error(
            f.json("POST", "/v1/sandboxes", body).await,
            400,
            ErrorCode::InvalidArgument,
        )
        .await;
    }
    for q in ["state=sleeping", "color=blue"] {
        f.expect_error(
            f.get(&format!("/v1/sandboxes?{q}")).await,
            400,
            ErrorCode::InvalidArgument,
        )
        .await;
    }
    assert!(
        std::fs::read_dir(f.paths().sandboxes_dir())
            .expect("dir")
            .next()
            .is_none()
    );
}

#[tokio::test]
async fn unknown_template_is_not_found() {
    let f = Fixture::new(StartBehaviour::Fail);
    f.expect_error(
        f.json("POST", "/v1/sandboxes", r#"{"template": "nope"}"#).await,
        404,
        ErrorCode::NotFound,
    )
    .await;
}

#[tokio::test]
async fn garbage_ids_are_not_found() {
    let f = Fixture::new(StartBehaviour::Fail);
    let ids = [
        "sbx_..%2F..%2Fx",
        "sbx_..",
        "..%2F..%2Fetc%2Fpasswd",
        "sbx_0123456789abcde%00",
        "sbx_%C3%A9%C3%A9",
        "sbx_0123456789ABCDEF",
        "sbx_0123456789abcdef0",
        "%FF%FE",
        "sbx_0123456789abcdef",
    ];
    for id in ids {
        for (method, suffix) in [
            ("GET", ""),
            ("DELETE", ""),
            ("GET", "/processes"),
            ("GET", "/files/stat?path=/"),
        ] {
            let uri = format!("/v1/sandboxes/{id}{suffix}");
            let req = f.req(method, &uri).body(Body::empty()).expect("request");
            f.expect_error(f.send(req).await, 404, ErrorCode::NotFound).await;
        }
        let uri = format!("/v1/sandboxes/{id}/commands");
        f.expect_error(
            f.json("POST", &uri, r#"{"cmd": "true"}"#).await,
            404,
            ErrorCode::NotFound,
        )
        .await;
        let uri = format!("/v1/sandboxes/{id}/timeout");
        f.expect_error(
            f.json("POST", &uri, r#"{"timeout_s": 5}"#).await,
            404,
            ErrorCode::NotFound,
        )
        .await;
    }
    // Nothing was created next to the data directory by any of those.
    let names: Vec<_> = std::fs::read_dir(f.dir.path())
        .expect("dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
}

#[tokio::test]
async fn oversized_bodies_are_rejected() {
    let f = Fixture::new(StartBehaviour::Fail);
    let big = format!(r#"{{"metadata": {{"k": "{}"}}}}"#, "x".repeat(2 * 1024 * 1024));
    f.expect_error(
        f.json("POST", "/v1/sandboxes", &big).await,
        413,
        ErrorCode::PayloadTooLarge,
    )
    .await;
    f.insert_row("sbx_00000000000000c2", SandboxState::Running, &[]);
    let req = f
        .req("POST", "/v1/sandboxes/sbx_00000000000000c2/processes/7/stdin")
        .body(Body::from(vec![b'a'; 2 * 1024 * 1024]))
        .expect("request");
    f.expect_error(f.send(req).await, 413, ErrorCode::PayloadTooLarge)
        .await;
    let req = f
        .req("PUT", "/v1/sandboxes/sbx_00000000000000c2/files?path=/big")
        .header(header::CONTENT_LENGTH, (2u64 << 30).to_string())
        .body(Body::empty())
        .expect("request");
    f.expect_error(f.send(req).await, 413, ErrorCode::PayloadTooLarge)
        .await;
}

#[tokio::test]
async fn unknown_routes_and_methods() {
    let f = Fixture::new(StartBehaviour::Fail);
    for uri in [
        "/",
        "/v2/sandboxes",
        "/v1/nope",
        "/v1/sandboxes/sbx_0123456789abcdef/nope",
        "/healthz/x",
    ] {
        f.expect_error(f.get(uri).await, 404, ErrorCode::UnknownRoute)
            .await;
    }
    let req = f
        .req("PATCH", "/v1/sandboxes")
        .body(Body::empty())
        .expect("request");
    f.expect_error(f.send(req).await, 405, ErrorCode::MethodNotAllowed)
        .await;
    let req = Request::builder()
        .method("POST")
        .uri("/healthz")
        .body(Body::empty())
        .expect("request");
    f.expect_error(f.send(req).await, 405, ErrorCode::MethodNotAllowed)
        .await;
}

#[tokio::test]
async fn failed_create_rolls_back_and_reports_the_console() {
    let f = Fixture::new(StartBehaviour::Fail);
    let (status, body) = f
        .json(
            "POST",
            "/v1/sandboxes",
            r#"{"template": "minimal", "memory_mib": 128}"#,
        )
        .await;
    let text = String::from_utf8_lossy(&body).into_owned();
    f.expect_error((status, body), 502, ErrorCode::VmmFailed).await;
    assert!(text.contains("no VMM in this test"), "{text}");
    assert!(
        text.contains("kernel panic: fake"),
        "console tail expected: {text}"
    );
    assert!(
        f.state.sandboxes.db().list().expect("list").is_empty(),
        "row must be deleted"
    );
    assert!(
        std::fs::read_dir(f.paths().sandboxes_dir())
            .expect("dir")
            .next()
            .is_none(),
        "dir must be removed"
    );
}

#[tokio::test]
async fn a_panicking_driver_does_not_kill_the_daemon() {
    let f = Fixture::new(StartBehaviour::Panic);
    f.expect_error(
        f.json("POST", "/v1/sandboxes", "{}").await,
        500,
        ErrorCode::Internal,
    )
    .await;
    assert!(
        f.state.sandboxes.db().list().expect("list").is_empty(),
        "row must be rolled back"
    );
    assert!(
        std::fs::read_dir(f.paths().sandboxes_dir())
            .expect("dir")
            .next()
            .is_none()
    );
}

#[tokio::test]
async fn list_filters_get_timeout_and_state_conflicts() {
    let f = Fixture::new(StartBehaviour::Fail);
    f.insert_row("sbx_00000000000000a1", SandboxState::Running, &[("team", "red")]);
    f.insert_row("sbx_00000000000000a2", SandboxState::Failed, &[("team", "blue")]);
    let list = |body: Vec<u8>| -> Vec<String> {
        let l: SandboxList = serde_json::from_slice(&body).expect("list");
        l.sandboxes.into_iter().map(|s| s.id).collect()
    };
    assert_eq!(list(f.get("/v1/sandboxes").await.1).len(), 2);
    assert_eq!(
        list(f.get("/v1/sandboxes?state=running").await.1),
        vec!["sbx_00000000000000a1"]
    );
    assert_eq!(
        list(f.get("/v1/sandboxes?metadata.team=blue").await.1),
        vec!["sbx_00000000000000a2"]
    );
    assert!(list(f.get("/v1/sandboxes?metadata.team=blue&state=running").await.1).is_empty());

    let (status, body) = f.get("/v1/sandboxes/sbx_00000000000000a2").await;
    assert_eq!(status, StatusCode::OK);
    let sbx: hearth_api::Sandbox = serde_json::from_slice(&body).expect("sandbox");
    assert_eq!(sbx.state, SandboxState::Failed);
    assert_eq!(sbx.error.as_deref(), Some("VM process exited"));

    let (status, body) = f
        .json(
            "POST",
            "/v1/sandboxes/sbx_00000000000000a1/timeout",
            r#"{"timeout_s": 60}"#,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let sbx: hearth_api::Sandbox = serde_json::from_slice(&body).expect("sandbox");
    let end = time::OffsetDateTime::parse(&sbx.end_at, &time::format_description::well_known::Rfc3339)
        .expect("rfc3339");
    let left = end - time::OffsetDateTime::now_utc();
    assert!(
        left > time::Duration::seconds(55) && left <= time::Duration::seconds(61),
        "{left}"
    );
    let uri = "/v1/sandboxes/sbx_00000000000000a1/timeout";
    f.expect_error(
        f.json("POST", uri, r#"{"timeout_s": 0}"#).await,
        400,
        ErrorCode::InvalidArgument,
    )
    .await;

    // A failed sandbox cannot run commands; a running one without a live agent reports the agent.
    let uri = "/v1/sandboxes/sbx_00000000000000a2/commands";
    f.expect_error(
        f.json("POST", uri, r#"{"cmd": "true"}"#).await,
        409,
        ErrorCode::Conflict,
    )
    .await;
    let uri = "/v1/sandboxes/sbx_00000000000000a1/commands";
    f.expect_error(
        f.json("POST", uri, r#"{"cmd": "true"}"#).await,
        502,
        ErrorCode::AgentUnavailable,
    )
    .await;

    // Destroying the failed one removes it.
    let req = f
        .req("DELETE", "/v1/sandboxes/sbx_00000000000000a2")
        .body(Body::empty())
        .expect("request");
    assert_eq!(f.send(req).await.0, StatusCode::NO_CONTENT);
    f.expect_error(
        f.get("/v1/sandboxes/sbx_00000000000000a2").await,
        404,
        ErrorCode::NotFound,
    )
    .await;
}

#[tokio::test]
async fn system_report_and_metrics() {
    let f = Fixture::new(StartBehaviour::Fail);
    f.insert_row("sbx_00000000000000b1", SandboxState::Running, &[]);
    let (status, body) = f.get("/v1/system").await;
    assert_eq!(status, StatusCode::OK);
    let info: SystemInfo = serde_json::from_slice(&body).expect("system");
    assert_eq!(info.vmm, "qemu");
    assert_eq!(info.accel, "tcg");
    assert_eq!(info.templates, vec!["minimal"]);
    assert_eq!(info.capacity.sandboxes_running, 1);
    assert_eq!(info.capacity.memory_mib_allocated, 256);
    assert!(info.capacity.host_cpus >= 1 && info.capacity.host_memory_mib > 0);
    // Made-up methods (a client may send any token) share one label value instead of adding one each.
    for method in ["BREW1", "BREW2", "BREW3"] {
        let (status, _) = f
            .send(
                Request::builder()
                    .method(method)
                    .uri("/v1/nowhere")
                    .body(Body::empty())
                    .expect("request"),
            )
            .await;
        assert!(status.is_client_error(), "{method}: {status}");
    }
    let (_, metrics) = f
        .send(
            Request::builder()
                .uri("/metrics")
                .body(Body::empty())
                .expect("request"),
        )
        .await;
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(metrics.contains("hearth_http_requests_total"), "{metrics}");
    assert!(metrics.contains("route=\"/v1/system\""), "{metrics}");
    assert!(!metrics.contains("BREW"), "{metrics}");
    assert!(metrics.contains("method=\"other\""), "{metrics}");
    assert!(
        metrics.contains("hearth_sandboxes{state=\"running\"}"),
        "{metrics}"
    );
}

#[tokio::test]
async fn serves_on_a_real_listener_and_shuts_down() {
    let f = Fixture::new(StartBehaviour::Fail);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(hearthd::run(listener, f.state.clone(), async move {
        let _ = rx.await;
    }));
    let client = reqwest::Client::new();
    let resp = client
        .get(format!("http://{addr}/healthz"))
        .send()
        .await
        .expect("healthz");
    assert_eq!(resp.text().await.expect("text"), "ok");
    let resp = client
        .get(format!("http://{addr}/v1/sandboxes"))
        .bearer_auth(&f.key)
        .send()
        .await
        .expect("list");
    assert_eq!(resp.status(), 200);
    let _ = tx.send(());
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("stops")
        .expect("join")
        .expect("serve");
}

#[test]
fn committed_openapi_document_is_current() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let current = hearthd::openapi::document_json();
    assert!(
        committed == current,
        "docs/openapi.json is stale: run `cargo run -p hearthd -- --print-openapi > docs/openapi.json`"
    );
    let doc: serde_json::Value = serde_json::from_str(&current).expect("json");
    for p in [
        "/v1/sandboxes",
        "/v1/sandboxes/{id}/commands",
        "/v1/sandboxes/{id}/files",
        "/healthz",
    ] {
        assert!(doc["paths"][p].is_object(), "{p} missing");
    }
    assert!(doc["components"]["schemas"]["CreateSandboxRequest"].is_object());
}

#[tokio::test]
async fn recovery_rolls_back_fails_the_dead_and_removes_orphans() {
    let f = Fixture::new(StartBehaviour::Fail);
    let handle = |id: &str| VmHandle {
        kind: VmmKind::Qemu,
        pid: u32::MAX - 7,
        start_ticks: 1,
        run_dir: f.paths().sandbox_dir(id),
    };
    // A create that was interrupted, a running sandbox whose VM is gone, a failed one.
    f.insert_row("sbx_00000000000000d1", SandboxState::Creating, &[]);
    f.insert_row("sbx_00000000000000d2", SandboxState::Running, &[]);
    f.insert_row("sbx_00000000000000d3", SandboxState::Failed, &[]);
    for id in [
        "sbx_00000000000000d1",
        "sbx_00000000000000d2",
        "sbx_00000000000000d3",
    ] {
        std::fs::create_dir_all(f.paths().sandbox_dir(id)).expect("dir");
        f.state
            .sandboxes
            .db()
            .set_handle(id, &handle(id))
            .expect("handle");
    }
    // A directory nobody owns, with a process running from it, and a stray file.
    let orphan = f.paths().sandbox_dir("sbx_00000000deadbeef");
    std::fs::create_dir_all(&orphan).expect("orphan dir");
    let marker = orphan.join("console.log");
    std::fs::write(&marker, b"").expect("marker");
    let mut stray = std::process::Command::new("tail")
        .arg("-f")
        .arg(&marker)
        .spawn()
        .expect("spawn");
    std::fs::write(orphan.join("qemu.pid"), format!("{}\n", stray.id())).expect("pid file");
    std::fs::write(f.paths().sandboxes_dir().join("junk"), b"x").expect("junk");

    hearthd::adopt::recover(&f.state.sandboxes)
        .await
        .expect("recover");

    let db = f.state.sandboxes.db();
    assert_eq!(
        db.get("sbx_00000000000000d1").expect("get"),
        None,
        "interrupted create rolled back"
    );
    let dead = db.get("sbx_00000000000000d2").expect("get").expect("row kept");
    assert_eq!(dead.state, SandboxState::Failed);
    assert!(
        dead.error.as_deref().is_some_and(|e| e.contains("gone")),
        "{:?}",
        dead.error
    );
    assert_eq!(
        db.get("sbx_00000000000000d3").expect("get").map(|r| r.state),
        Some(SandboxState::Failed)
    );
    let mut killed = false;
    for _ in 0..100 {
        if stray.try_wait().expect("wait").is_some() {
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if !killed {
        let _ = stray.kill();
        let _ = stray.wait();
    }
    assert!(
        killed,
        "the process running from the orphan directory must be killed"
    );
    let left: Vec<_> = std::fs::read_dir(f.paths().sandboxes_dir())
        .expect("dir")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn kill_body_is_optional_but_must_be_json_when_present() {
    let f = Fixture::new(StartBehaviour::Fail);
    f.insert_row("sbx_00000000000000e1", SandboxState::Running, &[]);
    let uri = "/v1/sandboxes/sbx_00000000000000e1/processes/5/kill";
    // Extraction passes (empty body = default signal); the request then fails for lack of an agent.
    let req = f.req("POST", uri).body(Body::empty()).expect("request");
    f.expect_error(f.send(req).await, 502, ErrorCode::AgentUnavailable)
        .await;
    f.expect_error(
        f.json("POST", uri, r#"{"signal": "TERM"}"#).await,
        400,
        ErrorCode::InvalidJson,
    )
    .await;
    f.expect_error(
        f.json("POST", uri, r#"{"sig": 9}"#).await,
        400,
        ErrorCode::InvalidJson,
    )
    .await;
    let bad_pid = "/v1/sandboxes/sbx_00000000000000e1/processes/-1/kill";
    f.expect_error(f.json("POST", bad_pid, "{}").await, 404, ErrorCode::NotFound)
        .await;
}

#[tokio::test]
async fn memory_is_not_overcommitted() {
    let f = Fixture::new(StartBehaviour::Fail);
    let (_, body) = f.get("/v1/system").await;
    let info: SystemInfo = serde_json::from_slice(&body).expect("system");
    // Fill the host with (pretend) running sandboxes of 16 GiB.
    let per = 16384u64;
    let n = info.capacity.host_memory_mib / per + 1;
    for i in 0..n {
        f.insert_row(&format!("sbx_{i:016x}"), SandboxState::Running, &[]);
    }
    let db = f.state.sandboxes.db();
    for r in db.list().expect("list") {
        db.delete(&r.id).expect("delete");
        db.insert(&SandboxRow {
            memory_mib: per as u32,
            ..r
        })
        .expect("insert");
    }
    f.expect_error(
        f.json("POST", "/v1/sandboxes", r#"{"memory_mib": 128}"#).await,
        503,
        ErrorCode::CapacityExceeded,
    )
    .await;
    assert_eq!(db.list().expect("list").len() as u64, n, "nothing was created");
}

/// SECURITY promise 7 on the API server: a client that never finishes its request head is disconnected after
/// the header deadline, and when every connection slot is held the next client waits until one closes.
#[tokio::test]
async fn slow_heads_are_cut_and_connections_are_capped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let f = Fixture::new(StartBehaviour::Fail);
    let start = |limits: hearthd::http::serve::ServeLimits| {
        let state = f.state.clone();
        async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let addr = listener.local_addr().expect("addr");
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let server = tokio::spawn(hearthd::run_with(listener, state, limits, async move {
                let _ = rx.await;
            }));
            (addr, tx, server)
        }
    };

    // A head sent a piece at a time and never finished: cut within the deadline (1 s here).
    let (addr, stop, server) = start(hearthd::http::serve::ServeLimits {
        max_connections: 100,
        header_read_timeout: Duration::from_secs(1),
        keep_alive_idle: Duration::from_secs(4),
    })
    .await;
    let mut slow = tokio::net::TcpStream::connect(addr).await.expect("connect");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n")
        .await
        .expect("write");
    let mut buf = [0u8; 256];
    let read = tokio::time::timeout(Duration::from_secs(10), slow.read(&mut buf))
        .await
        .expect("the server closes a slow head within its deadline");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    // A complete request on a fresh connection is still served.
    let ok = reqwest::get(format!("http://{addr}/healthz"))
        .await
        .expect("healthz");
    assert_eq!(ok.text().await.expect("text"), "ok");
    // The deadline is for a connection's first head only: a connection that sits past it between requests
    // (or, the same to hyper, while a long response streams) is not cut.
    let mut kept = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let req = b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n";
    kept.write_all(req).await.expect("first");
    let n = kept.read(&mut buf).await.expect("first answer");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    tokio::time::sleep(Duration::from_millis(2500)).await;
    kept.write_all(req).await.expect("second");
    let n = kept.read(&mut buf).await.expect("second answer");
    assert!(
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"),
        "{:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    // Its next head, trickled and never finished, is cut once the connection has been without a request for
    // its keep-alive deadline (4 s here) after the last answer.
    let answered = std::time::Instant::now();
    kept.write_all(b"GET /healthz HTTP/1.1\r\n")
        .await
        .expect("partial head");
    let mut read = Ok(1);
    while matches!(read, Ok(n) if n > 0) {
        if answered.elapsed() < Duration::from_secs(3) {
            let _ = kept.write_all(b"X-Slow: 1\r\n").await;
        }
        read = tokio::time::timeout(Duration::from_secs(15), kept.read(&mut buf))
            .await
            .expect("a trickled second head is cut within its deadline");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert!(
        answered.elapsed() >= Duration::from_secs(3),
        "cut before its deadline: {:?}",
        answered.elapsed()
    );
    // Time while a request is in flight does not count: a body sent a byte at a time for longer than the
    // keep-alive deadline (and the first-head deadline) still gets its answer.
    let mut slow_body = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let head = format!(
        "POST /v1/sandboxes HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 12\r\n\r\n",
        f.key
    );
    slow_body.write_all(head.as_bytes()).await.expect("head");
    for byte in b"{\"x\":     1}" {
        slow_body.write_all(&[*byte]).await.expect("body byte");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let n = tokio::time::timeout(Duration::from_secs(10), slow_body.read(&mut buf))
        .await
        .expect("answer")
        .expect("read");
    // The handler read the whole body before it answered: 400 for the unknown field, not 401 or a cut.
    assert!(
        String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 400"),
        "a request in flight for 6 s was cut: {:?}",
        String::from_utf8_lossy(&buf[..n])
    );
    let _ = stop.send(());
    server.await.expect("join").expect("serve");

    // Two slots, both held by idle connections: a third client is not served until one closes.
    let (addr, stop, server) = start(hearthd::http::serve::ServeLimits {
        max_connections: 2,
        header_read_timeout: Duration::from_secs(30),
        keep_alive_idle: Duration::from_secs(30),
    })
    .await;
    let a = tokio::net::TcpStream::connect(addr).await.expect("connect a");
    let _b = tokio::net::TcpStream::connect(addr).await.expect("connect b");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(1500))
        .build()
        .expect("client");
    let waiting = client.get(format!("http://{addr}/healthz")).send().await;
    assert!(waiting.is_err(), "served past the cap: {waiting:?}");
    drop(a);
    let served = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Ok(r) = client.get(format!("http://{addr}/healthz")).send().await {
                return r.status();
            }
        }
    })
    .await
    .expect("served once a slot is free");
    assert_eq!(served, 200);
    let _ = stop.send(());
    drop(_b);
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("stops")
        .expect("join")
        .expect("serve");
}
