//! `GET /v1/sandboxes/{id}/boundary` (`hearth inspect`): the isolation around one sandbox as the host's kernel
//! reports it (`/proc`, cgroupfs), not as configured.

use serde::{Deserialize, Serialize};

use crate::{EgressPolicy, Mount, SandboxState};

/// The boundary of one sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SandboxBoundary {
    pub sandbox_id: String,
    pub state: SandboxState,
    /// The VMM process, read from `/proc/<pid>`; absent while the sandbox has no VM process (paused, failed).
    pub vmm: Option<VmmProcess>,
    pub guest: GuestBoundary,
    pub network: NetworkBoundary,
    /// Guest paths where buckets are mounted (served by the host; credentials stay on the host).
    pub mounts: Vec<Mount>,
}

/// The process that runs a sandbox's VM.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct VmmProcess {
    /// `qemu` or `firecracker`.
    pub kind: String,
    /// The VMM's version as its binary reported it at daemon start.
    pub version: String,
    /// `kvm` or `tcg`.
    pub accel: String,
    pub pid: u32,
    /// `/proc/<pid>/exe`.
    pub binary: String,
    /// Real, effective, saved and filesystem uids (`/proc/<pid>/status`).
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
    /// The process's root directory (`/proc/<pid>/root`): the jail when chrooted (QEMU); `/` for a process
    /// pivoted into a jail inside a mount namespace of its own (Firecracker's jailer: see `namespaces`).
    pub root: String,
    /// `disabled`, `strict` or `filter` (`Seccomp:`), and how many filters are installed.
    pub seccomp: String,
    pub seccomp_filters: u32,
    pub no_new_privs: bool,
    /// Effective capabilities (`CapEff:`, hex); `0000000000000000` is none.
    pub capabilities: String,
    pub threads: u32,
    pub rss_bytes: u64,
    /// The namespaces the VMM is in, and whether each is the daemon's own.
    pub namespaces: Vec<NamespaceInfo>,
    /// The VMM's cgroup and its limits, read from cgroupfs.
    pub cgroup: CgroupBoundary,
}

/// One namespace of the VMM process.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct NamespaceInfo {
    /// `net`, `pid`, `mnt`, `ipc`, `uts`, `user`.
    pub kind: String,
    /// The namespace's identity (`net:[4026531840]`).
    pub id: String,
    /// True when the daemon is in the same one (no isolation of that kind).
    pub shared_with_daemon: bool,
}

/// The cgroup the VMM runs in and its limits. `max` means unlimited; a field is absent when its controller is
/// not available.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct CgroupBoundary {
    /// `v1` or `v2`.
    pub version: String,
    /// The path below the hierarchy's root (memory controller's on v1).
    pub path: String,
    /// True when the VMM is in the daemon's own cgroup (no per-sandbox limits).
    pub shared_with_daemon: bool,
    /// CPU bandwidth as `cpu.max` spells it (`QUOTA PERIOD` in microseconds, or `max PERIOD`).
    pub cpu_max: Option<String>,
    pub memory_max: Option<String>,
    pub memory_current_bytes: Option<u64>,
    pub pids_max: Option<String>,
    pub pids_current: Option<u64>,
}

/// What the guest runs on.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct GuestBoundary {
    /// The guest kernel's release, as the guest reports it (`/proc/sys/kernel/osrelease`); absent when the
    /// sandbox is not running.
    pub kernel: Option<String>,
    pub vcpus: u32,
    pub memory_mib: u32,
}

/// The sandbox's network as the daemon enforces it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct NetworkBoundary {
    /// False when the sandbox has no network device at all.
    pub enabled: bool,
    /// The guest's address inside its own namespace's link.
    pub address: Option<String>,
    /// The egress policy the proxy and kernel rules enforce; inbound connections are always refused.
    pub egress: Option<EgressPolicy>,
    /// Private networks the sandbox is a member of (ids).
    pub private_networks: Vec<String>,
}
