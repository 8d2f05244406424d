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
    /// Whether a call that needs the guest (commands, files, processes) resumes a paused sandbox by itself.
    /// Default true; with false such calls fail with `conflict` until `POST .../resume`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_resume: Option<bool>,
    /// What the TTL does when it passes: `kill` (default) destroys the sandbox, `pause` pauses it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_timeout: Option<OnTimeout>,
    /// Start from this snapshot (`snp_...`) instead of booting a template: the new sandbox continues the
    /// snapshot's processes, memory and files (its template, vCPUs and memory are the snapshot's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<String>,
    /// Egress policy (default: allow everything except the always-denied destinations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::NetworkPolicy>,
    /// Private networks (names or `net_` ids) to attach the sandbox to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub networks: Vec<String>,
    /// Optional name, unique among live sandboxes: peers on a private network reach the sandbox as
    /// `<name>.<network>.internal` (as well as `<id>.<network>.internal`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Buckets to mount (registered with `POST /v1/buckets`); needs the daemon's networking. Not allowed with
    /// `snapshot`: a sandbox restored from a snapshot gets the snapshot's mounts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<crate::MountSpec>,
    /// Upload a crash-consistent image of the sandbox's disk to the storage bucket every this many seconds
    /// while it runs (like `POST /v1/sandboxes/{id}/sync`). Needs `hearthd --storage`; at least
    /// [`crate::MIN_DISK_SYNC_INTERVAL_S`]. Absent: no periodic sync (pauses still upload the disk).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_sync_interval_s: Option<u64>,
    /// Start a NEW sandbox (a cold boot of the same template, vCPUs and memory) whose disk is the last disk
    /// synced from this sandbox (`sbx_...`), fetched from the storage bucket when this host does not have it.
    /// Not with `snapshot`; `template`, `vcpus` and `memory_mib`, when given, must match the source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_sync: Option<String>,
}

/// What happens to a sandbox when its TTL passes.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// Destroy the sandbox.
    #[default]
    Kill,
    /// Pause it (its state is kept on disk; a paused sandbox does not expire).
    Pause,
}

impl OnTimeout {
    pub fn as_str(self) -> &'static str {
        match self {
            OnTimeout::Kill => "kill",
            OnTimeout::Pause => "pause",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "kill" => Some(OnTimeout::Kill),
            "pause" => Some(OnTimeout::Pause),
            _ => None,
        }
    }
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
    /// The VM's state is being saved to disk; the VM process ends when it is done.
    Pausing,
    /// No VM process and no RAM: the sandbox exists only as files (memory, device state, disk).
    Paused,
    /// A fresh VM process is being restored from the paused state.
    Resuming,
}

impl SandboxState {
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Creating => "creating",
            SandboxState::Running => "running",
            SandboxState::Stopping => "stopping",
            SandboxState::Failed => "failed",
            SandboxState::Pausing => "pausing",
            SandboxState::Paused => "paused",
            SandboxState::Resuming => "resuming",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "creating" => SandboxState::Creating,
            "running" => SandboxState::Running,
            "stopping" => SandboxState::Stopping,
            "failed" => SandboxState::Failed,
            "pausing" => SandboxState::Pausing,
            "paused" => SandboxState::Paused,
            "resuming" => SandboxState::Resuming,
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
    /// Whether calls that need the guest resume a paused sandbox by themselves.
    #[serde(default = "yes")]
    pub auto_resume: bool,
    /// What the TTL does when it passes.
    #[serde(default)]
    pub on_timeout: OnTimeout,
    /// The sandbox this one was forked from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_id: Option<String>,
    /// The snapshot this sandbox was created from (recreated from a synced disk: the snapshot that disk builds
    /// on, if any).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// How often its disk is synced to the storage bucket (`disk_sync_interval_s` at create).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_sync_interval_s: Option<u64>,
    /// Where it lives with `hearthd --storage`: local disk, the bucket or both (for a sandbox: its paused state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<crate::ObjectStorage>,
}

fn yes() -> bool {
    true
}

/// Body of `GET /v1/sandboxes`: one page, in id order.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SandboxList {
    pub sandboxes: Vec<Sandbox>,
    /// Present when more sandboxes match: pass it as `cursor` to get the next page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// Most sandboxes in one page of `GET /v1/sandboxes` (also the default `limit`).
pub const MAX_LIST_LIMIT: usize = 1000;

/// Body of `POST /v1/sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SetTimeoutRequest {
    /// New TTL in seconds, counted from now (1-86400).
    pub timeout_s: u64,
}

/// Usage of one sandbox over a time window (`GET /v1/sandboxes/{id}/usage`, `GET /v1/usage`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SandboxUsage {
    pub sandbox_id: String,
    /// Seconds the VM ran (booting, running, pausing, resuming).
    pub running_seconds: f64,
    /// Running seconds times vCPUs.
    pub vcpu_seconds: f64,
    /// Running seconds times guest memory in MiB.
    pub mib_seconds: f64,
    /// Seconds the sandbox was paused (no compute accrues).
    pub paused_seconds: f64,
    /// Bytes on disk of the sandbox's paused state and of the snapshots taken from it (now).
    pub snapshot_bytes: u64,
    /// Bytes read from mounted buckets since the sandbox was created (not clipped to the window).
    #[serde(default)]
    pub bytes_read: u64,
    /// Bytes written to mounted buckets since the sandbox was created (not clipped to the window).
    #[serde(default)]
    pub bytes_written: u64,
}

/// Body of `GET /v1/usage`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct UsageReport {
    /// RFC 3339 start of the window.
    pub from: String,
    /// RFC 3339 end of the window.
    pub to: String,
    pub sandboxes: Vec<SandboxUsage>,
}

/// Body of `POST /v1/sandboxes/{id}/fork`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ForkRequest {
    /// How many children (1-16). Default 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
}

/// Answer of `POST /v1/sandboxes/{id}/fork`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ForkResponse {
    /// The snapshot the children were restored from.
    pub snapshot_id: String,
    pub sandboxes: Vec<Sandbox>,
}

/// A snapshot: a sandbox's running state (memory, devices, disk) at one moment.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SnapshotObject {
    pub id: String,
    /// The sandbox it was taken from (which may since be gone).
    pub sandbox_id: String,
    /// RFC 3339.
    pub created_at: String,
    pub size_bytes: u64,
    pub template: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    /// Where it lives with `hearthd --storage`: local disk, the bucket or both (for a sandbox: its paused state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<crate::ObjectStorage>,
}

/// Body of `GET /v1/snapshots`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SnapshotList {
    pub snapshots: Vec<SnapshotObject>,
}

/// Body of `POST /v1/templates`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateTemplateRequest {
    /// New template name (`[a-z0-9-]`, 1-63 characters).
    pub name: String,
    /// Save this sandbox's root filesystem (flattened into a standalone image). Exactly one of
    /// `from_sandbox` and `recipe`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_sandbox: Option<String>,
    /// Also save its running memory: sandboxes created from the template then start by restore, not boot,
    /// with the sandbox's processes running.
    #[serde(default)]
    pub include_memory: bool,
    /// Build the template in a build sandbox instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipe: Option<Recipe>,
}

/// How to build a template: start from `base`, run `steps` in order (each with `/bin/sh -c`; the first that
/// fails fails the build with its output), then optionally start `start_cmd` in the background and wait for
/// `ready_cmd` to succeed; the template then keeps the running memory (when `start_cmd` is given) or only the
/// disk.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Recipe {
    /// Template to start from.
    pub base: String,
    pub steps: Vec<String>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_cmd: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_cmd: Option<String>,
}

/// A template: a root filesystem new sandboxes start from.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Template {
    pub name: String,
    /// `true` for the images built with the host (`images/rootfs/*.ext4`), which cannot be deleted here.
    pub builtin: bool,
    /// The sandbox it was saved from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_sandbox: Option<String>,
    /// The memory snapshot sandboxes of this template restore from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_id: Option<String>,
    /// Bytes on disk of the root filesystem image.
    pub size_bytes: u64,
    /// RFC 3339; absent for built-in templates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<String>,
    /// Where it lives with `hearthd --storage`: local disk, the bucket or both (for a sandbox: its paused state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage: Option<crate::ObjectStorage>,
}

/// Body of `GET /v1/templates`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct TemplateList {
    pub templates: Vec<Template>,
}

/// Which output stream a [`TemplateBuildEvent::StepOutput`] line came from.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum OutputStream {
    Stdout,
    Stderr,
}

/// A stage of a template build outside the recipe's steps.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum BuildPhase {
    /// Creating (booting) the build sandbox from the recipe's `base`.
    CreatingSandbox,
    /// Starting `start_cmd` in the background.
    StartCmd,
    /// Running `ready_cmd` until it succeeds.
    WaitingReady,
    /// Checkpointing the sandbox and flattening its disk into the template image.
    Saving,
}

/// One progress event of `POST /v1/templates` asked for with `Accept: text/event-stream`. The SSE `event:` name
/// is the variant (`started`, `phase`, `step_started`, `step_output`, `step_finished`, `done`, `failed`) and
/// `data:` is this JSON. Steps are numbered from 1. The stream ends after `done` or `failed`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TemplateBuildEvent {
    /// The build began: `steps` recipe steps will run (0 when saving from a sandbox).
    Started {
        name: String,
        steps: u32,
    },
    Phase {
        phase: BuildPhase,
    },
    StepStarted {
        step: u32,
        cmd: String,
    },
    /// One line of a step's output without its line end (lines longer than 4 KiB arrive in pieces; bytes that
    /// are not UTF-8 are replaced).
    StepOutput {
        step: u32,
        stream: OutputStream,
        line: String,
    },
    StepFinished {
        step: u32,
        exit_code: i32,
        duration_ms: u64,
    },
    /// The template is saved.
    Done {
        template: Template,
    },
    /// The build failed (a failing step's message carries the end of its output); nothing was saved.
    Failed {
        code: crate::ErrorCode,
        message: String,
    },
}

impl TemplateBuildEvent {
    /// The SSE `event:` name of this event.
    pub fn name(&self) -> &'static str {
        match self {
            TemplateBuildEvent::Started { .. } => "started",
            TemplateBuildEvent::Phase { .. } => "phase",
            TemplateBuildEvent::StepStarted { .. } => "step_started",
            TemplateBuildEvent::StepOutput { .. } => "step_output",
            TemplateBuildEvent::StepFinished { .. } => "step_finished",
            TemplateBuildEvent::Done { .. } => "done",
            TemplateBuildEvent::Failed { .. } => "failed",
        }
    }

    /// True for the last event of a build (`done` or `failed`).
    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            TemplateBuildEvent::Done { .. } | TemplateBuildEvent::Failed { .. }
        )
    }
}

/// One event of `POST /v1/sandboxes` or `POST /v1/sandboxes/{id}/resume` asked for with
/// `Accept: text/event-stream`. The SSE `event:` name is the variant (`fetch`, `done`, `failed`) and `data:` is
/// this JSON. `fetch` events come while state the sandbox starts from (a paused sandbox's state, a snapshot, a
/// saved template, a synced disk) is fetched from the storage bucket because its local copy is gone: one per
/// object as it starts, as it advances (at most about five a second) and as it ends (`done_bytes` =
/// `total_bytes`). The stream ends after `done` or `failed`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum SandboxStartEvent {
    /// Progress of one object's fetch (`object` as in `GET /v1/storage`, e.g. `sandboxes/<id>/pause`).
    Fetch {
        object: String,
        done_bytes: u64,
        total_bytes: u64,
    },
    /// The sandbox runs (the answer a JSON request gets).
    Done { sandbox: Box<Sandbox> },
    /// The create or resume failed (what a JSON request gets as its error answer).
    Failed { code: crate::ErrorCode, message: String },
}

impl SandboxStartEvent {
    /// The SSE `event:` name of this event.
    pub fn name(&self) -> &'static str {
        match self {
            SandboxStartEvent::Fetch { .. } => "fetch",
            SandboxStartEvent::Done { .. } => "done",
            SandboxStartEvent::Failed { .. } => "failed",
        }
    }

    /// True for the last event (`done` or `failed`).
    pub fn is_terminal(&self) -> bool {
        !matches!(self, SandboxStartEvent::Fetch { .. })
    }
}
