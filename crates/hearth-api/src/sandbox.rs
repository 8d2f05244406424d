use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Body of `POST /v1/sandboxes`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxRequest {
    /// Template (root filesystem) to start from. Defaults to the daemon's default template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template: Option<String>,
    /// Virtual CPUs (1-16). Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vcpus: Option<u32>,
    /// Guest memory in MiB (128-16384). Default 512.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u32>,
    /// Seconds until the sandbox is destroyed (1-86400). Default 300.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    /// Environment variables every command in the sandbox starts with.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Free-form labels, usable as list filters.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
}

/// Lifecycle state of a sandbox.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SandboxState {
    /// The VM is booting; not yet able to run commands.
    Creating,
    /// The VM is up and its agent answers.
    Running,
    /// The sandbox is being destroyed.
    Stopping,
    /// The VM died or could not be reached; see `error`.
    Failed,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Stopping => "stopping",
            SandboxState::Failed => "failed",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "creating" => SandboxState::Creating,
            "running" => SandboxState::Running,
            "stopping" => SandboxState::Stopping,
            "failed" => SandboxState::Failed,
            _ => return None,
        })
    }
}

/// A sandbox as the API reports it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Sandbox {
    pub id: String,
    pub state: SandboxState,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// RFC 3339 creation time.
    pub created_at: String,
    /// RFC 3339 time at which the TTL destroys the sandbox.
    pub end_at: String,
    pub metadata: BTreeMap<String, String>,
    /// VMM driving this sandbox (`qemu` or `firecracker`).
    pub vmm: String,
    /// Why the sandbox failed, when `state` is `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Body of `GET /v1/sandboxes`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
}

/// Body of `POST /v1/sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetTimeoutRequest {
    /// New TTL in seconds, counted from now (1-86400).
    pub timeout_s: u64,
}
