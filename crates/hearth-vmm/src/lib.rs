//! The VMM seam: one trait, two drivers.
//!
//! # Layout
//! - [`Vmm`]: what the daemon asks of any VMM (prepare a disk, start, connect to the agent, stop, adopt).
//! - [`VmSpec`], [`NetAttach`]: what one VM is made of, including its NIC (a tap in a network namespace).
//! - [`qemu`]: QEMU `microvm` driver (KVM when usable, TCG otherwise).
//! - [`firecracker`]: Firecracker driver over its REST API on a Unix socket.
//! - [`cgroup`]: the cgroup of each VMM process (limits from the VM's shape, removal, sweep), both drivers.
//! - [`detect`]: host probe (KVM, PVM, binaries) and the `auto` choice with its reason.
//!
//! A driver owns its process, its sockets and its files under [`VmSpec::run_dir`]; nothing else reaches into
//! them. VMM processes are started detached from the daemon so that they survive a daemon restart.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokio::net::UnixStream;

pub use disk::{CopyMethod, DiskFormat};

pub mod cgroup;
pub mod detect;
pub mod disk;
pub mod firecracker;
pub mod inspect;
pub mod log;
mod poll;
pub mod qemu;
mod tap;

/// Which VMM drives a sandbox.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum VmmKind {
    Qemu,
    Firecracker,
}

impl VmmKind {
    pub fn as_str(self) -> &'static str {
        match self {
            VmmKind::Qemu => "qemu",
            VmmKind::Firecracker => "firecracker",
        }
    }
}

/// CPU acceleration in use.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[serde(rename_all = "snake_case")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// Guest boot artifacts (from the images directory).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BootImages {
    /// bzImage, used by QEMU when `vmlinux` cannot be booted through PVH (see `qemu::KernelChoice`).
    pub vmlinuz: PathBuf,
    /// Uncompressed ELF kernel, used by Firecracker, and by QEMU through its PVH entry.
    pub vmlinux: PathBuf,
    /// Concatenated initramfs (base + agent).
    pub initramfs: PathBuf,
}

/// Everything needed to start one VM.
#[derive(Debug, Clone)]
pub struct VmSpec {
    /// Sandbox id (validated by the daemon; safe to use in names).
    pub id: String,
    pub vcpus: u32,
    pub memory_mib: u32,
    pub images: BootImages,
    /// The sandbox's own root disk, as produced by [`Vmm::prepare_disk`].
    pub disk: PathBuf,
    /// Directory owned by the driver for this VM: sockets, logs, pid file. Exists before `start`.
    pub run_dir: PathBuf,
    /// Guest hostname (passed on the kernel command line as `hearth.hostname=`).
    pub hostname: String,
    /// The guest's network interface, if it has one (see [`NetAttach`]).
    pub net: Option<NetAttach>,
}

/// The guest's NIC: a virtio-net device backed by a tap that already exists inside a network namespace
/// (hearth-net's contract: `/run/netns/hearth-<id>` holding a persistent `tap0`). The guest configures its
/// address, route and resolver from the kernel command line ([`net_kernel_arg`]).
///
/// QEMU: the driver opens the tap inside the namespace and hands QEMU the descriptor (QEMU runs chrooted
/// and unprivileged). Firecracker: the process runs inside the namespace and opens the tap by name, which is
/// also what a restored snapshot does, so a snapshot restores into any namespace that names its tap the same.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct NetAttach {
    /// The network namespace holding the tap (a file such as `/run/netns/hearth-<id>`).
    pub netns: PathBuf,
    /// The tap's name inside that namespace (`tap0`).
    pub tap: String,
    /// MAC address of the guest's NIC (`02:68:72:74:68:02`).
    pub guest_mac: String,
    /// The namespace has an IPv6 path: the guest also gets [`net6_kernel_arg`] at boot.
    #[serde(default)]
    pub ipv6: bool,
}

impl NetAttach {
    /// The NIC of sandbox `id` as hearth-net lays it out: its namespace, `tap0`, the fixed guest MAC.
    pub fn for_sandbox(id: &str) -> Self {
        NetAttach {
            netns: hearth_net::netns_path(id),
            tap: hearth_net::TAP_NAME.to_string(),
            guest_mac: hearth_net::GUEST_MAC.to_string(),
            ipv6: false,
        }
    }

    /// The same with (or without) the IPv6 path.
    pub fn with_ipv6(mut self, ipv6: bool) -> Self {
        self.ipv6 = ipv6;
        self
    }

    /// Checks what ends up in VMM arguments and API bodies: an interface name the kernel accepts and a
    /// unicast MAC in `aa:bb:cc:dd:ee:ff` form (so neither can inject QEMU options).
    pub fn validate(&self) -> Result<(), String> {
        let tap_ok = (1..16).contains(&self.tap.len())
            && self
                .tap
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
            && self.tap != "."
            && self.tap != "..";
        if !tap_ok {
            return Err(format!("invalid tap name {:?}", self.tap));
        }
        let octets: Vec<&str> = self.guest_mac.split(':').collect();
        let mac_ok = octets.len() == 6
            && octets
                .iter()
                .all(|o| o.len() == 2 && o.bytes().all(|b| b.is_ascii_hexdigit()));
        let unicast = u8::from_str_radix(octets[0], 16).is_ok_and(|b| b & 1 == 0);
        if !mac_ok || !unicast {
            return Err(format!("invalid guest MAC {:?}", self.guest_mac));
        }
        if !self.netns.is_absolute() {
            return Err(format!(
                "network namespace path {} is not absolute",
                self.netns.display()
            ));
        }
        Ok(())
    }
}

/// The kernel command line word that tells the guest agent its network configuration:
/// `hearth.net=<guest addr>/<prefix>,<gateway>,<dns>` (the resolver is the gateway, see hearth-net).
pub fn net_kernel_arg() -> String {
    format!(
        "hearth.net={}/{},{},{}",
        hearth_net::GUEST_ADDR,
        hearth_net::GUEST_PREFIX,
        hearth_net::GATEWAY,
        hearth_net::GATEWAY
    )
}

/// The kernel command line word for a sandbox whose namespace has an IPv6 path (hearth-net's
/// `PlaneConfig::sandbox_net6`), to append after [`net_kernel_arg`]:
/// `hearth.net6=<guest addr>/<prefix>,<gateway>` (the same in every sandbox). Without it the guest has no IPv6
/// route, which is right for a namespace that drops IPv6 (programs fall back to IPv4 at once). Agents that
/// predate it ignore it.
pub fn net6_kernel_arg() -> String {
    format!(
        "hearth.net6={}/{},{}",
        hearth_net::GUEST_ADDR6,
        hearth_net::GUEST_PREFIX6,
        hearth_net::GATEWAY6
    )
}

/// What the daemon persists about a started VM, enough to find it again after a restart.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct VmHandle {
    pub kind: VmmKind,
    pub pid: u32,
    /// Start time of the process in clock ticks since boot (field 22 of `/proc/<pid>/stat`): guards against
    /// pid reuse when adopting.
    pub start_ticks: u64,
    pub run_dir: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The VMM binary is missing or not executable.
    #[error("{binary} not found: {detail}")]
    BinaryMissing { binary: String, detail: String },
    /// The VMM process failed to start or exited early.
    #[error("vmm for {id} failed to start: {detail}")]
    StartFailed { id: String, detail: String },
    /// The VMM's control API refused a request.
    #[error("vmm api {endpoint} for {id}: {detail}")]
    Api {
        id: String,
        endpoint: String,
        detail: String,
    },
    /// The guest's agent channel could not be opened.
    #[error("agent channel for {id}: {detail}")]
    AgentChannel { id: String, detail: String },
    /// Preparing the sandbox disk failed.
    #[error("disk {path}: {detail}")]
    Disk { path: PathBuf, detail: String },
    #[error("io error on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The driver does not implement this operation.
    #[error("{operation} is not supported by the {vmm} driver")]
    Unsupported { vmm: String, operation: String },
    /// A snapshot directory is missing files, or they do not match what the restore needs.
    #[error("snapshot {path}: {detail}")]
    Snapshot { path: PathBuf, detail: String },
}

/// How [`Vmm::snapshot`] treats the running VM.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum SnapshotMode {
    /// Pause to zero: after the state is saved the VMM process exits; the VM's disk stays where it is
    /// (resume attaches the same disk).
    Pause,
    /// Checkpoint: the VM is stopped only while its state (and a copy of its disk) is captured, then continues.
    Checkpoint,
}

/// What a driver wrote into a snapshot directory.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SnapshotInfo {
    pub kind: VmmKind,
    /// VMM version that wrote the snapshot (a restore with another version may be refused).
    pub vmm_version: String,
    /// Files in the snapshot directory, relative names (memory, device state, disk copy for checkpoints).
    pub files: Vec<String>,
    /// For [`SnapshotMode::Checkpoint`]: the relative name of the disk copy taken while the VM was stopped.
    pub disk: Option<String>,
    /// The disk copy's format as the driver wrote it (manifests from before this field: see
    /// [`SnapshotInfo::disk_format`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_format: Option<DiskFormat>,
    /// Guest memory size and vCPUs the snapshot needs (a restore must use the same shape).
    pub memory_mib: u32,
    pub vcpus: u32,
    /// The file (one of `files`) holding guest RAM page for page when the VMM keeps RAM in a file; `None`:
    /// RAM travels in the device-state stream (or the VMM's own memory file format).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_file: Option<String>,
    /// Features of the machine the snapshot was taken from; a restore builds the same machine (a snapshot
    /// from before a feature existed restores without it). Driver-defined names, e.g. QEMU's `memfile`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub features: Vec<String>,
}

impl SnapshotInfo {
    /// Whether [`Vmm::resume`] takes the snapshot over: the resumed VM keeps running on its memory file, so
    /// once a resume succeeded the snapshot is no longer the paused state (a failure after that cannot fall
    /// back to it).
    pub fn resume_consumes(&self) -> bool {
        self.kind == VmmKind::Qemu && self.memory_file.is_some()
    }

    /// The format of the disk copy, from the record: what the driver wrote, or for manifests written before
    /// the format was recorded, what that driver always wrote (QEMU a qcow2 overlay, Firecracker a raw copy).
    /// Never read from the file itself.
    pub fn disk_format(&self) -> DiskFormat {
        self.disk_format.unwrap_or(match self.kind {
            VmmKind::Qemu => DiskFormat::Qcow2,
            VmmKind::Firecracker => DiskFormat::Raw,
        })
    }
}

/// What [`Vmm::capture_disk`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskCapture {
    /// How long the vCPUs were stopped (from the stop request to the answer of the continue request).
    pub stopped: std::time::Duration,
    pub method: CopyMethod,
    /// The copy's format (the VM's disk format: QEMU a qcow2 overlay, Firecracker raw).
    pub format: DiskFormat,
}

/// The operations every VMM driver provides.
#[async_trait::async_trait]
pub trait Vmm: Send + Sync {
    fn kind(&self) -> VmmKind;
    fn accel(&self) -> Accel;
    /// Version string of the VMM binary (e.g. "QEMU 10.0.2", "Firecracker v1.12.1").
    fn version(&self) -> String;

    /// Creates the sandbox's own disk in `dest_dir` from `base` (a template image, or a checkpoint's disk copy),
    /// copy-on-write where possible (QEMU: qcow2 overlay backed by `base`; Firecracker: reflink or sparse copy).
    /// `format` is `base`'s format from hearth's records; the driver never guesses it from the file's bytes,
    /// which a guest may have written. Returns the path to give [`VmSpec::disk`].
    async fn prepare_disk(
        &self,
        base: &std::path::Path,
        format: DiskFormat,
        dest_dir: &std::path::Path,
    ) -> Result<PathBuf, VmmError>;

    /// Writes `src` (a checkpoint's disk copy, of the recorded `format`) as a new standalone raw image `dest`
    /// (a template image), fsynced. The format is named, never probed. Raw sources are copied (sparse or
    /// reflinked); drivers whose disks are overlays override this to flatten their format.
    async fn flatten_disk(
        &self,
        src: &std::path::Path,
        format: DiskFormat,
        dest: &std::path::Path,
    ) -> Result<(), VmmError> {
        if format != DiskFormat::Raw {
            return Err(VmmError::Unsupported {
                vmm: self.kind().as_str().to_owned(),
                operation: format!("flattening a {} disk", format.as_str()),
            });
        }
        disk::copy_raw(src, dest).await
    }

    /// Starts the VM process detached from the caller and returns once the process runs (the guest may still be
    /// booting). With [`VmSpec::net`] the tap must already exist in the namespace (a missing one is an error,
    /// never created). On error nothing of the VM is left running.
    async fn start(&self, spec: &VmSpec) -> Result<VmHandle, VmmError>;

    /// Opens the byte stream to the guest agent. Fails fast (no long retry) if the channel is not there yet; the
    /// caller retries until its readiness deadline.
    async fn connect_agent(&self, vm: &VmHandle) -> Result<UnixStream, VmmError>;

    /// Stops the VM: asks politely, then kills; waits until the process is gone. Idempotent: a VM that is
    /// already gone is not an error. Does not remove `run_dir` (the daemon owns its removal).
    async fn stop(&self, vm: &VmHandle) -> Result<(), VmmError>;

    /// True when the VM process recorded in `vm` still runs (same pid, same start time, our binary).
    fn is_alive(&self, vm: &VmHandle) -> bool;

    /// The VMM process's own last words (the tail of its log, bounded, control characters replaced), for the
    /// error when it exited under a running sandbox. Default: none kept.
    fn exit_log(&self, vm: &VmHandle) -> String {
        let _ = vm;
        "(no log)".into()
    }

    /// Whether a snapshot of a running VM drops the guest's end of the agent channel. Firecracker resets every
    /// vsock connection of the VM it snapshots (`VIRTIO_VSOCK_EVENT_TRANSPORT_RESET`), so after a checkpoint
    /// the caller replaces its connection before sending anything on it. Default: no (QEMU's virtio-serial
    /// port is untouched).
    fn snapshot_resets_agent_channel(&self) -> bool {
        false
    }

    /// After a daemon restart, before talking to an adopted VM's guest: a checkpoint (snapshot, fork) stops
    /// the vCPUs and the daemon that would have let them go on may have died in between, leaving the guest
    /// frozen for good. Waits for a capture still being written, then lets the VM run again. Returns whether it
    /// was stopped. Default: nothing can be stopped.
    async fn continue_if_stopped(&self, vm: &VmHandle) -> Result<bool, VmmError> {
        let _ = vm;
        Ok(false)
    }

    /// Removes what the driver keeps on the host outside run directories (VMs' cgroups)
    /// for every VM not in `live`, killing a VMM that still runs there: the daemon calls it once at start,
    /// after recovery, with the VMs it adopted. Default: nothing to remove.
    async fn sweep(&self, live: &[VmHandle]) {
        let _ = live;
    }

    /// Saves the VM's full running state (memory and device state) into `dest`, a fresh empty directory, and
    /// fsyncs every file written. `disk` is the VM's current disk ([`VmSpec::disk`]); with
    /// [`SnapshotMode::Checkpoint`] the driver copies it into `dest` while the VM is stopped, so memory and
    /// disk are consistent. The caller flushes the guest's file systems (agent `sync`) first.
    async fn snapshot(
        &self,
        vm: &VmHandle,
        disk: &std::path::Path,
        dest: &std::path::Path,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, VmmError> {
        let _ = (vm, disk, dest, mode);
        Err(VmmError::Unsupported {
            vmm: self.kind().as_str().to_owned(),
            operation: "snapshot".to_owned(),
        })
    }

    /// Copies the running VM's disk `disk` into `dest` (a new file) as of one instant, for a crash-consistent
    /// image while the VM keeps running: the vCPUs are stopped only for the copy, with the driver's own pause
    /// (QEMU `stop`/`cont`, which also drains and flushes its block layer; Firecracker `PATCH /vm`), then run
    /// again; `dest` is fsynced after that. The caller flushes the guest's file systems first. On error the
    /// VM runs again and `dest` is removed. Default: unsupported.
    async fn capture_disk(
        &self,
        vm: &VmHandle,
        disk: &std::path::Path,
        dest: &std::path::Path,
    ) -> Result<DiskCapture, VmmError> {
        let _ = (vm, disk, dest);
        Err(VmmError::Unsupported {
            vmm: self.kind().as_str().to_owned(),
            operation: "disk capture".to_owned(),
        })
    }

    /// Resumes the sandbox whose own paused state is `snapshot` (taken with [`SnapshotMode::Pause`]): like
    /// [`Vmm::restore`], but the driver may take the snapshot's files over instead of copying them (see
    /// [`SnapshotInfo::resume_consumes`]). On error the snapshot is left as it was.
    async fn resume(
        &self,
        spec: &VmSpec,
        snapshot: &std::path::Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        self.restore(spec, snapshot, info).await
    }

    /// Starts a fresh VMM process from the snapshot in `snapshot` with `spec.disk` attached (the daemon
    /// prepares it: the sandbox's own disk for a resume, a new copy-on-write disk over the snapshot's disk copy
    /// for a fork or template). Never modifies the files in `snapshot`: several VMs may restore from one
    /// snapshot at once. A snapshot of a VM with a NIC needs `spec.net` too, naming a namespace whose tap has
    /// the same name (every sandbox's is `tap0`); the guest keeps the addresses it configured at boot. Returns
    /// once the VM runs again.
    async fn restore(
        &self,
        spec: &VmSpec,
        snapshot: &std::path::Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        let _ = (spec, snapshot, info);
        Err(VmmError::Unsupported {
            vmm: self.kind().as_str().to_owned(),
            operation: "restore".to_owned(),
        })
    }

    /// [`Vmm::restore`] for a VM that then lives as any booted one (a warm create from a boot snapshot), not
    /// as one of a fork's children sharing a base: the driver may give it a copy of the snapshot's memory of
    /// its own, so that its pauses cost what a booted VM's do. Never modifies the files in `snapshot`.
    async fn restore_as_own(
        &self,
        spec: &VmSpec,
        snapshot: &std::path::Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        self.restore(spec, snapshot, info).await
    }
}

/// Whether the environment variable `var` (comma-separated feature names, e.g. `HEARTH_QEMU_FEATURES_OFF`)
/// turns a driver's `feature` off, so that a benchmark can compare with and without it side by side.
pub(crate) fn feature_off(var: &str, feature: &str) -> bool {
    std::env::var(var)
        .unwrap_or_default()
        .split(',')
        .any(|f| f.trim() == feature)
}

/// Reads the start time (clock ticks since boot) of a process, for pid-reuse checks.
pub fn process_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces: split after the last ')'.
    let rest = &stat[stat.rfind(')')? + 2..];
    rest.split(' ').nth(19)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_attach_of_a_sandbox_and_its_validation() {
        let net = NetAttach::for_sandbox("sbx_0123456789abcdef");
        assert_eq!(net.netns, PathBuf::from("/run/netns/hearth-sbx_0123456789abcdef"));
        assert_eq!(net.tap, "tap0");
        assert_eq!(net.guest_mac, "02:68:72:74:68:02");
        assert_eq!(net.validate(), Ok(()));
        for tap in ["", "a,b", "tap0 x", "0123456789abcdef", "..", "a/b"] {
            let bad = NetAttach {
                tap: tap.into(),
                ..net.clone()
            };
            assert!(bad.validate().is_err(), "{tap:?}");
        }
        for mac in [
            "",
            "02:68:72:74:68",
            "02:68:72:74:68:02,id=x",
            "03:68:72:74:68:02",
            "zz:68:72:74:68:02",
        ] {
            let bad = NetAttach {
                guest_mac: mac.into(),
                ..net.clone()
            };
            assert!(bad.validate().is_err(), "{mac:?}");
        }
        let relative = NetAttach {
            netns: "netns/x".into(),
            ..net
        };
        assert!(relative.validate().is_err());
        assert_eq!(net_kernel_arg(), "hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1");
        assert_eq!(
            net6_kernel_arg(),
            "hearth.net6=fd68:6872:7468::2/64,fd68:6872:7468::1"
        );
    }

    #[test]
    fn start_ticks_of_self() {
        let me = std::process::id();
        assert!(process_start_ticks(me).is_some());
        assert!(process_start_ticks(u32::MAX - 1).is_none());
    }
}
