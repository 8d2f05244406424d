//! Typed client for Firecracker's REST API (the subset hearth uses), following upstream's `firecracker.yaml`.
//!
//! Every route is one variant of [`Request`]; [`ApiClient::send`] is the one place that turns a variant into
//! an HTTP exchange and an answer into a result. Request bodies are plain serde structs; optional fields are
//! left out when unset so Firecracker applies its own defaults.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::http::{self, HttpError, Method};
use super::sock::SocketAddr;

/// Longest `fault_message` kept in an error (Firecracker's are one sentence).
const MAX_FAULT: usize = 2048;

/// `PUT /machine-config`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MachineConfig {
    pub vcpu_count: u32,
    pub mem_size_mib: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub smt: Option<bool>,
    /// Needed for diff snapshots.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub track_dirty_pages: Option<bool>,
}

/// `PUT /boot-source`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct BootSource {
    pub kernel_image_path: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub initrd_path: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub boot_args: Option<String>,
}

/// `PUT /drives/{drive_id}`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Drive {
    pub drive_id: String,
    pub path_on_host: PathBuf,
    pub is_root_device: bool,
    pub is_read_only: bool,
}

/// `PUT /vsock`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Vsock {
    pub guest_cid: u32,
    pub uds_path: PathBuf,
}

/// `PUT /network-interfaces/{iface_id}`: a virtio-net device backed by the tap `host_dev_name`, which
/// Firecracker opens by name in its own network namespace (at start, and again on snapshot load).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct NetworkInterface {
    pub iface_id: String,
    pub host_dev_name: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub guest_mac: Option<String>,
}

/// `PUT /logger`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Logger {
    pub log_path: PathBuf,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub level: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub show_level: Option<bool>,
}

/// `PUT /metrics`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Metrics {
    pub metrics_path: PathBuf,
}

/// Body of `PUT /actions`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum ActionType {
    InstanceStart,
    SendCtrlAltDel,
    FlushMetrics,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
struct Action {
    action_type: ActionType,
}

/// Body of `PATCH /vm`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum VmState {
    Paused,
    Resumed,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
struct VmStateBody {
    state: VmState,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum SnapshotType {
    Full,
    Diff,
}

/// `PUT /snapshot/create` (the VM must be paused).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SnapshotCreate {
    pub snapshot_type: SnapshotType,
    /// Device and vCPU state.
    pub snapshot_path: PathBuf,
    /// Guest memory.
    pub mem_file_path: PathBuf,
}

#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub enum MemBackendType {
    File,
    Uffd,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct MemBackend {
    pub backend_type: MemBackendType,
    pub backend_path: PathBuf,
}

/// `PUT /snapshot/load` (only on a fresh process, before any configuration).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SnapshotLoad {
    pub snapshot_path: PathBuf,
    pub mem_backend: MemBackend,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_diff_snapshots: Option<bool>,
    pub resume_vm: bool,
}

/// Answer of `GET /`.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct InstanceInfo {
    pub id: String,
    /// "Not started", "Running" or "Paused".
    pub state: String,
    pub vmm_version: String,
    pub app_name: String,
}

/// One API call: every route hearth uses.
#[derive(Debug, Clone, PartialEq)]
pub enum Request {
    DescribeInstance,
    /// `GET /vm/config`: the full configuration, as Firecracker reports it.
    VmConfig,
    MachineConfig(MachineConfig),
    BootSource(BootSource),
    Drive(Drive),
    Vsock(Vsock),
    NetworkInterface(NetworkInterface),
    Logger(Logger),
    Metrics(Metrics),
    /// `PUT /entropy` with an empty body: a virtio-rng device fed from the host.
    Entropy,
    Action(ActionType),
    SetVmState(VmState),
    SnapshotCreate(SnapshotCreate),
    SnapshotLoad(SnapshotLoad),
}

impl Request {
    /// Method and path of the route.
    pub fn route(&self) -> (Method, String) {
        let put = |p: &str| (Method::Put, p.to_string());
        match self {
            Request::DescribeInstance => (Method::Get, "/".into()),
            Request::VmConfig => (Method::Get, "/vm/config".into()),
            Request::MachineConfig(_) => put("/machine-config"),
            Request::BootSource(_) => put("/boot-source"),
            Request::Drive(d) => (Method::Put, format!("/drives/{}", d.drive_id)),
            Request::Vsock(_) => put("/vsock"),
            Request::NetworkInterface(n) => (Method::Put, format!("/network-interfaces/{}", n.iface_id)),
            Request::Logger(_) => put("/logger"),
            Request::Metrics(_) => put("/metrics"),
            Request::Entropy => put("/entropy"),
            Request::Action(_) => put("/actions"),
            Request::SetVmState(_) => (Method::Patch, "/vm".into()),
            Request::SnapshotCreate(_) => put("/snapshot/create"),
            Request::SnapshotLoad(_) => put("/snapshot/load"),
        }
    }

    /// JSON body, if the route takes one.
    pub fn body(&self) -> Result<Option<Vec<u8>>, serde_json::Error> {
        let json = match self {
            Request::DescribeInstance | Request::VmConfig => return Ok(None),
            Request::MachineConfig(b) => serde_json::to_vec(b),
            Request::BootSource(b) => serde_json::to_vec(b),
            Request::Drive(b) => serde_json::to_vec(b),
            Request::Vsock(b) => serde_json::to_vec(b),
            Request::NetworkInterface(b) => serde_json::to_vec(b),
            Request::Logger(b) => serde_json::to_vec(b),
            Request::Metrics(b) => serde_json::to_vec(b),
            Request::Entropy => Ok(b"{}".to_vec()),
            Request::Action(action_type) => serde_json::to_vec(&Action {
                action_type: *action_type,
            }),
            Request::SetVmState(state) => serde_json::to_vec(&VmStateBody { state: *state }),
            Request::SnapshotCreate(b) => serde_json::to_vec(b),
            Request::SnapshotLoad(b) => serde_json::to_vec(b),
        };
        json.map(Some)
    }

    /// How long Firecracker may take: snapshot calls write or map the whole guest memory.
    fn timeout(&self, base: Duration) -> Duration {
        match self {
            Request::SnapshotCreate(_) | Request::SnapshotLoad(_) => base.max(SNAPSHOT_TIMEOUT),
            _ => base,
        }
    }
}

/// Floor for snapshot calls (a multi-GiB guest is written to disk).
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request could not be exchanged.
    #[error("{endpoint}: {source}")]
    Transport { endpoint: String, source: HttpError },
    /// Firecracker refused the request; `message` is its `fault_message`.
    #[error("{endpoint}: HTTP {status}: {message}")]
    Fault {
        endpoint: String,
        status: u16,
        message: String,
    },
    /// The answer did not have the expected shape.
    #[error("{endpoint}: unexpected answer: {detail}")]
    BadAnswer { endpoint: String, detail: String },
}

impl ApiError {
    /// `METHOD /path` of the failed call.
    pub fn endpoint(&self) -> &str {
        match self {
            ApiError::Transport { endpoint, .. }
            | ApiError::Fault { endpoint, .. }
            | ApiError::BadAnswer { endpoint, .. } => endpoint,
        }
    }

    /// The error without the endpoint prefix (for errors that carry the endpoint separately).
    pub fn detail(&self) -> String {
        match self {
            ApiError::Transport { source, .. } => source.to_string(),
            ApiError::Fault { status, message, .. } => format!("HTTP {status}: {message}"),
            ApiError::BadAnswer { detail, .. } => detail.clone(),
        }
    }
}

#[derive(Deserialize)]
struct Fault {
    fault_message: String,
}

/// Client bound to one Firecracker API socket.
#[derive(Debug, Clone)]
pub struct ApiClient {
    socket: SocketAddr,
    timeout: Duration,
}

impl ApiClient {
    /// `timeout` bounds each call (snapshot calls get at least five minutes).
    pub fn new(socket: SocketAddr, timeout: Duration) -> Self {
        Self { socket, timeout }
    }

    pub fn socket(&self) -> &SocketAddr {
        &self.socket
    }

    /// Sends one request; a 2xx answer yields its body (empty for 204).
    pub async fn send(&self, req: &Request) -> Result<Vec<u8>, ApiError> {
        let (method, path) = req.route();
        let endpoint = format!("{} {path}", method.as_str());
        let body = req.body().map_err(|e| ApiError::BadAnswer {
            endpoint: endpoint.clone(),
            detail: format!("cannot encode request: {e}"),
        })?;
        let resp = http::request(
            &self.socket,
            method,
            &path,
            body.as_deref(),
            req.timeout(self.timeout),
        )
        .await
        .map_err(|source| ApiError::Transport {
            endpoint: endpoint.clone(),
            source,
        })?;
        if (200..300).contains(&resp.status) {
            return Ok(resp.body);
        }
        Err(ApiError::Fault {
            endpoint,
            status: resp.status,
            message: fault_message(&resp.body),
        })
    }

    pub async fn describe(&self) -> Result<InstanceInfo, ApiError> {
        let body = self.send(&Request::DescribeInstance).await?;
        serde_json::from_slice(&body).map_err(|e| ApiError::BadAnswer {
            endpoint: "GET /".into(),
            detail: e.to_string(),
        })
    }

    pub async fn vm_config(&self) -> Result<serde_json::Value, ApiError> {
        let body = self.send(&Request::VmConfig).await?;
        serde_json::from_slice(&body).map_err(|e| ApiError::BadAnswer {
            endpoint: "GET /vm/config".into(),
            detail: e.to_string(),
        })
    }

    pub async fn put_machine_config(&self, cfg: MachineConfig) -> Result<(), ApiError> {
        self.send(&Request::MachineConfig(cfg)).await.map(drop)
    }

    pub async fn put_boot_source(&self, boot: BootSource) -> Result<(), ApiError> {
        self.send(&Request::BootSource(boot)).await.map(drop)
    }

    pub async fn put_drive(&self, drive: Drive) -> Result<(), ApiError> {
        self.send(&Request::Drive(drive)).await.map(drop)
    }

    pub async fn put_vsock(&self, vsock: Vsock) -> Result<(), ApiError> {
        self.send(&Request::Vsock(vsock)).await.map(drop)
    }

    pub async fn put_network_interface(&self, iface: NetworkInterface) -> Result<(), ApiError> {
        self.send(&Request::NetworkInterface(iface)).await.map(drop)
    }

    pub async fn put_logger(&self, logger: Logger) -> Result<(), ApiError> {
        self.send(&Request::Logger(logger)).await.map(drop)
    }

    pub async fn put_metrics(&self, metrics: Metrics) -> Result<(), ApiError> {
        self.send(&Request::Metrics(metrics)).await.map(drop)
    }

    pub async fn action(&self, action: ActionType) -> Result<(), ApiError> {
        self.send(&Request::Action(action)).await.map(drop)
    }

    pub async fn instance_start(&self) -> Result<(), ApiError> {
        self.action(ActionType::InstanceStart).await
    }

    pub async fn pause(&self) -> Result<(), ApiError> {
        self.send(&Request::SetVmState(VmState::Paused)).await.map(drop)
    }

    pub async fn resume(&self) -> Result<(), ApiError> {
        self.send(&Request::SetVmState(VmState::Resumed)).await.map(drop)
    }

    /// Writes a snapshot of a paused VM.
    pub async fn create_snapshot(&self, snap: SnapshotCreate) -> Result<(), ApiError> {
        self.send(&Request::SnapshotCreate(snap)).await.map(drop)
    }

    /// Loads a snapshot into a fresh (unconfigured) Firecracker process.
    pub async fn load_snapshot(&self, load: SnapshotLoad) -> Result<(), ApiError> {
        self.send(&Request::SnapshotLoad(load)).await.map(drop)
    }
}

/// Extracts `fault_message` from an error body; falls back to the (bounded, lossy) raw body.
fn fault_message(body: &[u8]) -> String {
    let msg = match serde_json::from_slice::<Fault>(body) {
        Ok(f) => f.fault_message,
        Err(_) if body.is_empty() => "(empty body)".to_string(),
        Err(_) => String::from_utf8_lossy(body).into_owned(),
    };
    truncate(msg, MAX_FAULT)
}

fn truncate(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body_json(req: &Request) -> serde_json::Value {
        let body = req.body().expect("encodes").expect("has a body");
        serde_json::from_slice(&body).expect("json")
    }

    #[test]
    fn bodies_match_the_swagger_shapes() {
        let cfg = Request::MachineConfig(MachineConfig {
            vcpu_count: 2,
            mem_size_mib: 512,
            smt: None,
            track_dirty_pages: None,
        });
        assert_eq!(cfg.route(), (Method::Put, "/machine-config".into()));
        assert_eq!(
            body_json(&cfg),
            serde_json::json!({"vcpu_count": 2, "mem_size_mib": 512})
        );
        let drive = Request::Drive(Drive {
            drive_id: "rootfs".into(),
            path_on_host: "/d/disk.ext4".into(),
            is_root_device: false,
            is_read_only: false,
        });
        assert_eq!(drive.route(), (Method::Put, "/drives/rootfs".into()));
        assert_eq!(body_json(&drive)["path_on_host"], "/d/disk.ext4");
        assert_eq!(
            body_json(&Request::Action(ActionType::InstanceStart)),
            serde_json::json!({"action_type": "InstanceStart"})
        );
        let pause = Request::SetVmState(VmState::Paused);
        assert_eq!(pause.route(), (Method::Patch, "/vm".into()));
        assert_eq!(body_json(&pause), serde_json::json!({"state": "Paused"}));
        let load = Request::SnapshotLoad(SnapshotLoad {
            snapshot_path: "/s/state".into(),
            mem_backend: MemBackend {
                backend_type: MemBackendType::File,
                backend_path: "/s/mem".into(),
            },
            enable_diff_snapshots: None,
            resume_vm: true,
        });
        assert_eq!(
            body_json(&load),
            serde_json::json!({
                "snapshot_path": "/s/state",
                "mem_backend": {"backend_type": "File", "backend_path": "/s/mem"},
                "resume_vm": true
            })
        );
        assert_eq!(Request::DescribeInstance.body().expect("encodes"), None);
        let nic = Request::NetworkInterface(NetworkInterface {
            iface_id: "eth0".into(),
            host_dev_name: "tap0".into(),
            guest_mac: Some("02:68:72:74:68:02".into()),
        });
        assert_eq!(nic.route(), (Method::Put, "/network-interfaces/eth0".into()));
        assert_eq!(
            body_json(&nic),
            serde_json::json!({"iface_id": "eth0", "host_dev_name": "tap0", "guest_mac": "02:68:72:74:68:02"})
        );
    }

    #[test]
    fn fault_messages_are_extracted_and_bounded() {
        assert_eq!(
            fault_message(br#"{"fault_message":"Invalid kernel path."}"#),
            "Invalid kernel path."
        );
        assert_eq!(fault_message(b""), "(empty body)");
        assert_eq!(fault_message(b"not json"), "not json");
        let long = format!(r#"{{"fault_message":"{}"}}"#, "é".repeat(5000));
        let msg = fault_message(long.as_bytes());
        assert!(msg.len() <= MAX_FAULT + '…'.len_utf8());
        assert!(msg.ends_with('…'));
    }

    #[test]
    fn snapshot_calls_get_a_longer_deadline() {
        let base = Duration::from_secs(5);
        let create = Request::SnapshotCreate(SnapshotCreate {
            snapshot_type: SnapshotType::Full,
            snapshot_path: "/a".into(),
            mem_file_path: "/b".into(),
        });
        assert_eq!(create.timeout(base), SNAPSHOT_TIMEOUT);
        assert_eq!(Request::DescribeInstance.timeout(base), base);
    }
}
