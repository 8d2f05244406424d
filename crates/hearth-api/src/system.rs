use serde::{Deserialize, Serialize};

/// Body of `GET /v1/system`: which VMM the daemon uses and why, and what the host can hold.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SystemInfo {
    pub version: String,
    /// `qemu` or `firecracker`.
    pub vmm: String,
    /// `kvm` or `tcg`.
    pub accel: String,
    /// Human-readable reason for the choice.
    pub vmm_reason: String,
    /// Findings of the host probe (KVM, PVM, binaries, images), one per check.
    pub checks: Vec<Check>,
    pub capacity: Capacity,
    pub templates: Vec<String>,
    pub default_template: String,
}

/// One finding of the host probe.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Check {
    pub name: String,
    /// `ok`, `warn` or `fail`.
    pub status: String,
    pub detail: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Capacity {
    pub host_cpus: u32,
    pub host_memory_mib: u64,
    pub sandboxes_running: u32,
    pub vcpus_allocated: u32,
    pub memory_mib_allocated: u64,
}
