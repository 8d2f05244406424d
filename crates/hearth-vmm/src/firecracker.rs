//! Firecracker driver: one `firecracker` process per VM, configured over its REST API on a Unix socket.
//!
//! # Layout
//! - this file: [`FirecrackerVmm`], the [`Vmm`] implementation (disk, start/configure, agent, stop, adopt);
//! - [`api`]: typed client for Firecracker's API (every route one [`api::Request`] variant), including
//!   pause/resume and snapshot create/load;
//! - `http`: the small HTTP/1.1 client under it;
//! - `process`: detached spawn, readiness wait, identity checks, SIGTERM/SIGKILL;
//! - `vsock`: the `CONNECT <port>` handshake on Firecracker's vsock socket;
//! - `sock`: socket addresses, including symlink-proof ones inside a jail;
//! - `snapshot`: pause, resume, snapshot create and load ([`SnapshotFiles`]);
//! - [`snapshot_dir`]: the trait's `snapshot` (pause or checkpoint into a directory) and `restore`;
//! - [`jailer`]: the jailer (chroot, uid/gid, PID and mount namespaces), [`cgroups`]: the jailed VM's cgroup
//!   limits, their removal and the sweep of those nobody owns;
//! - `console`: keeps `firecracker.log` (the guest's serial console) bounded while the VM runs.
//!
//! # Network
//! With [`VmSpec::net`] the process runs inside the sandbox's network namespace (`setns` before exec, or the
//! jailer's `--netns`) and is given the tap by name (`PUT /network-interfaces/eth0`). A snapshot records that
//! name and Firecracker reopens it on load, in whatever namespace the new process runs: every sandbox
//! namespace names its tap `tap0`, so a snapshot restores (or forks) into any of them.
//!
//! # Files in the run directory
//! `fc.sock` (API), `vsock.sock` (agent channel), `firecracker.log` (Firecracker's stdio: its log and the
//! guest's serial console), `firecracker.pid`, `rootfs.disk` (a symlink to the sandbox's disk).
//! Firecracker runs with the run directory as its working directory and is given the relative paths
//! `rootfs.disk` and `vsock.sock`: a snapshot records the paths the VM was configured with and reopens them
//! on load, so relative ones let any run directory restore it (a fork next to the running original) and
//! attach its own `spec.disk` through its own link. With the jailer, `jail/<exec name>/<id>/root/` is the chroot
//! and the sockets are in its `run/`; the driver reaches them without following symlinks (`sock`), since the
//! jailed process owns everything in the chroot.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::net::UnixStream;

use crate::{Accel, DiskFormat, SnapshotInfo, SnapshotMode, VmHandle, VmSpec, Vmm, VmmError, VmmKind};

pub mod api;
pub mod cgroups;
mod console;
mod http;
pub mod jailer;
mod process;
mod snapshot;
pub mod snapshot_dir;
mod sock;
mod vsock;

pub use api::ApiClient;
pub use jailer::{CgroupVersion, JailLaunch, JailerConfig};
pub use snapshot::SnapshotFiles;
pub use sock::SocketAddr;

use process::ProcessId;

/// Where `scripts/install-deps.sh` installs the binaries.
pub const DEFAULT_BINARY: &str = "/opt/hearth/firecracker/firecracker";
pub const DEFAULT_JAILER: &str = "/opt/hearth/firecracker/jailer";

/// File names in the run directory.
pub const API_SOCKET: &str = "fc.sock";
pub const VSOCK_SOCKET: &str = "vsock.sock";
pub const LOG_FILE: &str = "firecracker.log";
pub const PID_FILE: &str = "firecracker.pid";
/// Symlink to [`VmSpec::disk`] in the run directory (unjailed VMs), the drive path Firecracker is given.
pub const DISK_LINK: &str = "rootfs.disk";
/// Present while the guest may still have to act on the vsock reset of a snapshot (after a restore or a
/// checkpoint): the next [`Vmm::connect_agent`] pokes the guest first (see `vsock::poke`). A file, so that a
/// daemon restarted in between still knows.
const VSOCK_RESET_MARK: &str = "vsock.reset-pending";
const JAIL_DIR: &str = "jail";

/// Comma-separated features of this driver to leave out, so that a benchmark can compare with and without
/// them side by side: [`FEATURE_BOOT_DIFF`], [`FEATURE_CHECKPOINT_DIFF`], [`FEATURE_RESTORE_DIFF`],
/// [`FEATURE_SEAL_IN_PLACE`].
pub const FEATURES_OFF_VAR: &str = "HEARTH_FIRECRACKER_FEATURES_OFF";
/// A jailed VM boots with dirty-page tracking and its first pause is a diff snapshot into an empty file:
/// what the guest (and Firecracker, loading the kernel) wrote since the boot, instead of all of guest memory
/// (`snapshot` module doc). Off: the first pause after a boot writes a full snapshot.
pub const FEATURE_BOOT_DIFF: &str = "boot-diff";
/// A checkpoint (fork, template) of a VM with a diff base is a diff laid over a copy of that base, and the
/// checkpoint becomes the base of the VM's next snapshot (`snapshot` module doc). Off: every checkpoint is a
/// full snapshot, and the snapshot after it too.
pub const FEATURE_CHECKPOINT_DIFF: &str = "checkpoint-diff";
/// A jailed VM restored from a checkpoint (a fork's child, a sandbox of a memory template) tracks dirty pages,
/// and the checkpoint's memory file is the base of its first snapshot, laid over a copy (`snapshot` module
/// doc). Off: such a VM restores without tracking and its first pause or checkpoint is a full snapshot.
pub const FEATURE_RESTORE_DIFF: &str = "restore-diff";
/// A checkpoint's files, written by a jailed process that runs on, are kept as written once nothing can write
/// to them any more (`snapshot_dir`). Off: always replaced by copies.
pub const FEATURE_SEAL_IN_PLACE: &str = "seal-in-place";

/// Guest vsock port the agent listens on, and the guest's context id.
pub const AGENT_VSOCK_PORT: u32 = 1024;
pub const GUEST_CID: u32 = 3;

/// Drive id of the sandbox disk (the initramfs mounts it; it is not the kernel's root device).
const ROOT_DRIVE: &str = "rootfs";
/// Interface id of the guest's NIC in Firecracker's API.
pub const GUEST_IFACE: &str = "eth0";

/// Timeouts of the driver's steps.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// From spawn until the API socket accepts connections.
    pub api_socket: Duration,
    /// Each API call (snapshot calls get more, see [`api`]).
    pub api_call: Duration,
    /// The vsock handshake in [`Vmm::connect_agent`].
    pub agent_handshake: Duration,
    /// Between SIGTERM and SIGKILL in [`Vmm::stop`].
    pub stop_grace: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            api_socket: Duration::from_secs(5),
            api_call: Duration::from_secs(10),
            agent_handshake: Duration::from_secs(2),
            stop_grace: Duration::from_secs(3),
        }
    }
}

/// The Firecracker [`Vmm`].
#[derive(Debug, Clone)]
pub struct FirecrackerVmm {
    binary: PathBuf,
    version: String,
    jailer: Option<JailerConfig>,
    timeouts: Timeouts,
    /// The VMs whose serial log a task keeps bounded (see `console`).
    consoles: console::Trimmers,
}

impl FirecrackerVmm {
    /// [`crate::Vmm::stop`] with SIGKILL after `grace` (zero: at once, for a VM whose state is saved).
    pub(crate) async fn stop_within(&self, vm: &VmHandle, grace: Duration) -> Result<(), VmmError> {
        let proc_id = Self::proc_id(vm);
        // Only signal a process that is provably ours: same pid and start time, and our binary (unless the
        // binary can no longer be read because the process is already exiting).
        let ours = vm.kind == VmmKind::Firecracker
            && process::is_running(proc_id)
            && process::exe_of(vm.pid).is_none_or(|exe| self.is_our_exe(&exe, &vm.run_dir));
        if ours {
            process::terminate(proc_id, grace)
                .await
                .map_err(|e| VmmError::Api {
                    id: vm.run_dir.display().to_string(),
                    endpoint: "stop".into(),
                    detail: e.to_string(),
                })?;
        }
        // A stale handle (the VM was restarted in the same directory since) must not break the live VM.
        if self.socket_addr(&vm.run_dir, API_SOCKET).accepts() {
            return Ok(());
        }
        self.remove_cgroups(&vm.run_dir).await;
        // Sockets of a dead process are useless, and so is the jail (device nodes, links); the log stays
        // for post-mortems until the daemon removes the run directory.
        for name in [API_SOCKET, VSOCK_SOCKET, PID_FILE] {
            let _ = std::fs::remove_file(vm.run_dir.join(name));
        }
        remove_disk_link(&vm.run_dir);
        let _ = std::fs::remove_dir_all(vm.run_dir.join(JAIL_DIR));
        // A stopped VM takes no more snapshots: its diff base record goes, and the checkpoint it kept (blocks).
        Self::forget_diff_base(&vm.run_dir);
        Ok(())
    }

    /// Uses the Firecracker binary at `binary` (checked by running `--version`).
    pub fn new(binary: impl Into<PathBuf>) -> Result<Self, VmmError> {
        let binary = binary.into();
        let missing = |detail: String| VmmError::BinaryMissing {
            binary: binary.display().to_string(),
            detail,
        };
        let out = std::process::Command::new(&binary)
            .arg("--version")
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| missing(e.to_string()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let version = stdout
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with("Firecracker v"))
            .ok_or_else(|| missing(format!("unexpected --version output {:?}", stdout.trim())))?
            .to_string();
        Ok(Self {
            binary,
            version,
            jailer: None,
            timeouts: Timeouts::default(),
            consoles: console::Trimmers::default(),
        })
    }

    /// Runs every VM under the jailer.
    pub fn with_jailer(mut self, jailer: JailerConfig) -> Self {
        self.jailer = Some(jailer);
        self
    }

    pub fn with_timeouts(mut self, timeouts: Timeouts) -> Self {
        self.timeouts = timeouts;
        self
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The jailer configuration, when VMs run jailed.
    pub fn jailer(&self) -> Option<&JailerConfig> {
        self.jailer.as_ref()
    }

    /// Typed API client for a VM's socket (pause, resume, snapshots).
    pub fn api(&self, run_dir: &Path) -> ApiClient {
        ApiClient::new(self.socket_addr(run_dir, API_SOCKET), self.timeouts.api_call)
    }

    /// Where to reach socket `name` ([`API_SOCKET`] or [`VSOCK_SOCKET`]) of the VM in `run_dir`: in the run
    /// directory, or inside the VM's jail without following symlinks when it is jailed.
    fn socket_addr(&self, run_dir: &Path, name: &str) -> SocketAddr {
        let jailed = std::fs::symlink_metadata(run_dir.join(JAIL_DIR)).is_ok_and(|m| m.is_dir());
        match jailed
            .then(|| jailed_instance_id(run_dir, &self.binary))
            .flatten()
        {
            Some(iid) => {
                let inner = if name == API_SOCKET {
                    jailer::API_SOCKET
                } else {
                    jailer::VSOCK_SOCKET
                };
                jailer::Jail::new(run_dir, &self.binary, &iid).socket(run_dir, inner)
            }
            None => SocketAddr::Path(run_dir.join(name)),
        }
    }

    /// Keeps `<run>/firecracker.log` (Firecracker's log and the guest's serial console, which a hostile
    /// guest can flood) under `max_bytes`: when it is larger, it is cut down to its last `max_bytes / 2`
    /// bytes. Safe while the VM runs (its stdio appends). Returns whether it trimmed. The driver does this
    /// every second for each VM it started or adopted (`console`).
    pub fn trim_log(&self, vm: &VmHandle, max_bytes: u64) -> Result<bool, VmmError> {
        let path = vm.run_dir.join(LOG_FILE);
        process::trim_log(&path, max_bytes).map_err(|source| VmmError::Io { path, source })
    }

    /// Firecracker (and the jailer) accept ids of `[A-Za-z0-9-]`, at most 64 characters; sandbox ids look like
    /// `sbx_<hex>`, so anything else becomes `-`.
    pub fn instance_id(id: &str) -> String {
        id.chars()
            .take(64)
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect()
    }

    fn boot_args(hostname: &str, net: Option<&crate::NetAttach>) -> String {
        let mut args = format!(
            "console=ttyS0 reboot=k panic=-1 pci=off quiet hearth.transport=vsock \
             hearth.vsock_port={AGENT_VSOCK_PORT} hearth.hostname={hostname}"
        );
        if let Some(n) = net {
            args.push(' ');
            args.push_str(&crate::net_kernel_arg());
            if n.ipv6 {
                args.push(' ');
                args.push_str(&crate::net6_kernel_arg());
            }
        }
        args
    }

    /// Spawns Firecracker (directly or jailed) and returns it with the paths Firecracker must be given.
    fn spawn(&self, spec: &VmSpec, iid: &str) -> Result<(ProcessId, GuestPaths), VmmError> {
        let run = &spec.run_dir;
        let log = run.join(LOG_FILE);
        let start_failed = |detail: String| VmmError::StartFailed {
            id: spec.id.clone(),
            detail,
        };
        let (program, args, paths): (&Path, Vec<OsString>, GuestPaths) = match &self.jailer {
            None => {
                let target = std::path::absolute(&spec.disk)
                    .map_err(|e| start_failed(format!("disk path {}: {e}", spec.disk.display())))?;
                let link = run.join(DISK_LINK);
                // The disk itself may be called `rootfs.disk` in the run directory: then it is its own link.
                if target != link {
                    remove_disk_link(run);
                    std::os::unix::fs::symlink(&target, &link)
                        .map_err(|e| start_failed(format!("linking {}: {e}", link.display())))?;
                }
                (
                    &self.binary,
                    vec![
                        "--api-sock".into(),
                        run.join(API_SOCKET).into(),
                        "--id".into(),
                        iid.into(),
                    ],
                    GuestPaths {
                        kernel: spec.images.vmlinux.clone(),
                        initramfs: spec.images.initramfs.clone(),
                        disk: DISK_LINK.into(),
                        vsock: VSOCK_SOCKET.into(),
                    },
                )
            }
            Some(cfg) => {
                let jail = jailer::Jail::new(run, &self.binary, iid);
                let ids = cfg.ids_for(&spec.id);
                jail.populate(ids, &spec.images.vmlinux, &spec.images.initramfs, &spec.disk)
                    .map_err(|e| start_failed(format!("preparing the jail: {e}")))?;
                cgroups::prepare_parent(cfg, &self.binary)
                    .map_err(|e| start_failed(format!("preparing the parent cgroup: {e}")))?;
                let limits = if cfg.shape_limits {
                    cgroups::shape_settings(cfg.cgroup_version, spec.vcpus, spec.memory_mib)
                } else {
                    Vec::new()
                };
                let launch = JailLaunch {
                    firecracker: &self.binary,
                    instance_id: iid,
                    ids,
                    netns: spec.net.as_ref().map(|n| n.netns.as_path()),
                    limits: &limits,
                };
                let args = jail
                    .args(cfg, &launch, &["--api-sock", jailer::API_SOCKET])
                    .map_err(|e| start_failed(e.to_string()))?;
                let paths = GuestPaths {
                    kernel: jailer::KERNEL.into(),
                    initramfs: jailer::INITRAMFS.into(),
                    disk: jailer::DISK.into(),
                    vsock: jailer::VSOCK_SOCKET.into(),
                };
                (&cfg.jailer, args, paths)
            }
        };
        // Unjailed: relative paths resolve in the run directory, and the process starts in the VM's network
        // namespace. Jailed: the jailer chroots, chdirs and joins the namespace itself (`--netns`).
        let cwd = self.jailer.is_none().then_some(run.as_path());
        let netns = spec
            .net
            .as_ref()
            .filter(|_| self.jailer.is_none())
            .map(|n| n.netns.as_path());
        let proc_id = process::spawn_detached_in(program, &args, &log, cwd, netns)
            .map_err(|e| start_failed(e.to_string()))?;
        Ok((proc_id, paths))
    }

    /// With `--new-pid-ns` the jailer forks Firecracker into a new PID namespace, writes its pid into the
    /// chroot and exits: waits for that, and returns Firecracker's identity. Without, the jailer execs
    /// Firecracker in place and `spawned` is already it.
    async fn jailed_process(
        &self,
        spec: &VmSpec,
        iid: &str,
        spawned: ProcessId,
    ) -> Result<ProcessId, VmmError> {
        if !self.jailer.as_ref().is_some_and(|c| c.new_pid_ns) {
            return Ok(spawned);
        }
        let jail = jailer::Jail::new(&spec.run_dir, &self.binary, iid);
        let log = spec.run_dir.join(LOG_FILE);
        let failed = |what: String| VmmError::StartFailed {
            id: spec.id.clone(),
            detail: format!("{what}; log tail: {}", crate::log::tail(&log)),
        };
        let deadline = Instant::now() + self.timeouts.api_socket;
        let mut pid = None;
        loop {
            // The jailer writes the file, then exits: once it is gone the file is complete (or missing).
            if pid.is_none() && !process::is_running(spawned) {
                pid = Some(
                    jail.read_pid_file(&self.binary)
                        .ok_or_else(|| failed("the jailer exited without starting Firecracker".into()))?,
                );
            }
            if let Some(pid) = pid {
                match self.jailed_identity(pid, iid, spawned) {
                    Some(Ok(id)) => return Ok(id),
                    Some(Err(what)) => return Err(failed(what)),
                    None => {} // still between the jailer's fork and Firecracker's exec
                }
            }
            if Instant::now() >= deadline {
                return Err(failed(format!(
                    "no jailed Firecracker within {:?} (pid file: {pid:?})",
                    self.timeouts.api_socket
                )));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Whether `pid` (from the jailer's pid file) is this launch's Firecracker: started after the jailer, its
    /// executable the jail's copy of Firecracker and its command line naming the instance (`--id <iid>`).
    /// `None` while the jailer's child has not exec'ed Firecracker yet (during exec, the command line is
    /// briefly empty), an error when the process is gone or is something else.
    fn jailed_identity(&self, pid: u32, iid: &str, spawned: ProcessId) -> Option<Result<ProcessId, String>> {
        let Some(start_ticks) = crate::process_start_ticks(pid) else {
            return Some(Err(format!(
                "the jailed Firecracker (pid {pid}) exited during startup"
            )));
        };
        if start_ticks < spawned.start_ticks {
            return Some(Err(format!(
                "the jailer's pid file names pid {pid}, an older process"
            )));
        }
        let exe_ok = process::exe_of(pid).is_some_and(|exe| self.is_jailed_exe(&exe));
        let needle = [b"--id\0".as_slice(), iid.as_bytes(), b"\0"].concat();
        let named = std::fs::read(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle));
        (exe_ok && named).then_some(Ok(ProcessId { pid, start_ticks }))
    }

    /// Everything after the API socket is up: machine (with dirty-page tracking from the boot on when
    /// `track`), boot source, disk, vsock, NIC, entropy, start.
    async fn configure(
        &self,
        api: &ApiClient,
        spec: &VmSpec,
        paths: &GuestPaths,
        track: bool,
    ) -> Result<(), api::ApiError> {
        api.put_machine_config(api::MachineConfig {
            vcpu_count: spec.vcpus,
            mem_size_mib: spec.memory_mib,
            smt: None,
            track_dirty_pages: track.then_some(true),
        })
        .await?;
        api.put_boot_source(api::BootSource {
            kernel_image_path: paths.kernel.clone(),
            initrd_path: Some(paths.initramfs.clone()),
            boot_args: Some(Self::boot_args(&spec.hostname, spec.net.as_ref())),
        })
        .await?;
        api.put_drive(api::Drive {
            drive_id: ROOT_DRIVE.into(),
            path_on_host: paths.disk.clone(),
            is_root_device: false,
            is_read_only: false,
        })
        .await?;
        api.put_vsock(api::Vsock {
            guest_cid: GUEST_CID,
            uds_path: paths.vsock.clone(),
        })
        .await?;
        if let Some(net) = &spec.net {
            // The tap is opened by name in the process's namespace; a snapshot records the name and reopens it
            // on load, so restores go into a namespace with the same tap name.
            api.put_network_interface(api::NetworkInterface {
                iface_id: GUEST_IFACE.into(),
                host_dev_name: net.tap.clone(),
                guest_mac: Some(net.guest_mac.clone()),
            })
            .await?;
        }
        // virtio-rng: the guest can reseed from the host (clones need fresh entropy, promise 10).
        api.send(&api::Request::Entropy).await?;
        api.instance_start().await
    }

    /// Checks the spec, clears leftovers, spawns Firecracker and waits for its API socket. On error nothing
    /// is left running.
    async fn launch(&self, spec: &VmSpec) -> Result<Launched, VmmError> {
        let run = &spec.run_dir;
        let start_failed = |detail: String| VmmError::StartFailed {
            id: spec.id.clone(),
            detail,
        };
        if spec.hostname.is_empty()
            || spec.hostname.len() > 253
            || !spec
                .hostname
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        {
            return Err(start_failed(format!("invalid hostname {:?}", spec.hostname)));
        }
        if let Some(net) = &spec.net {
            net.validate().map_err(start_failed)?;
            match crate::tap::tap_exists(&net.netns, &net.tap) {
                Ok(true) => {}
                Ok(false) => {
                    return Err(start_failed(format!(
                        "no tap {} in {}",
                        net.tap,
                        net.netns.display()
                    )));
                }
                Err(e) => {
                    return Err(start_failed(format!(
                        "network namespace {}: {e}",
                        net.netns.display()
                    )));
                }
            }
        }
        if !run.is_dir() {
            return Err(start_failed(format!("run directory {} missing", run.display())));
        }
        // A VM already answering in this run directory is never disturbed (its sockets would be unlinked).
        if self.socket_addr(run, API_SOCKET).accepts() {
            return Err(start_failed(format!(
                "a Firecracker is already running in {}",
                run.display()
            )));
        }
        // Leftovers of an earlier run would make Firecracker refuse to bind its sockets.
        Self::remove_run_files(run);

        let spawned_at = Instant::now();
        let iid = Self::instance_id(&spec.id);
        let (spawned, paths) = match self.spawn(spec, &iid) {
            Ok(v) => v,
            Err(e) => {
                Self::remove_run_files(run);
                return Err(e);
            }
        };
        let proc_id = match self.jailed_process(spec, &iid, spawned).await {
            Ok(p) => p,
            Err(e) => return Err(self.abort(spec, spawned, e).await),
        };
        let log = run.join(LOG_FILE);
        if let Err(e) = process::wait_for_socket(
            proc_id,
            &self.socket_addr(run, API_SOCKET),
            &log,
            self.timeouts.api_socket,
        )
        .await
        {
            return Err(self.abort(spec, proc_id, start_failed(e.to_string())).await);
        }
        Ok(Launched {
            proc_id,
            paths,
            api: self.api(run),
            spawned_at,
            socket_ready: spawned_at.elapsed(),
        })
    }

    /// Kills a VM that failed to start and removes what it created; returns `err` for the caller.
    async fn abort(&self, spec: &VmSpec, proc_id: ProcessId, err: VmmError) -> VmmError {
        if let Err(e) = process::terminate(proc_id, Duration::ZERO).await {
            tracing::error!(id = %spec.id, error = %e, "cannot kill a firecracker that failed to start");
        }
        self.remove_cgroups(&spec.run_dir).await;
        Self::remove_run_files(&spec.run_dir);
        err
    }

    /// Records the pid file of a configured VM and returns its handle.
    async fn finish(&self, spec: &VmSpec, launched: &Launched, what: &str) -> Result<VmHandle, VmmError> {
        let proc_id = launched.proc_id;
        let pid_file = spec.run_dir.join(PID_FILE);
        if let Err(source) = std::fs::write(&pid_file, format!("{}\n", proc_id.pid)) {
            return Err(self
                .abort(
                    spec,
                    proc_id,
                    VmmError::Io {
                        path: pid_file,
                        source,
                    },
                )
                .await);
        }
        self.consoles.watch(&spec.run_dir, proc_id);
        tracing::info!(
            id = %spec.id,
            pid = proc_id.pid,
            jailed = self.jailer.is_some(),
            api_socket_ms = launched.socket_ready.as_millis() as u64,
            total_ms = launched.spawned_at.elapsed().as_millis() as u64,
            "firecracker {what}"
        );
        Ok(VmHandle {
            kind: VmmKind::Firecracker,
            pid: proc_id.pid,
            start_ticks: proc_id.start_ticks,
            run_dir: spec.run_dir.clone(),
        })
    }

    /// Removes what `start` created in the run directory (never the disk or the directory itself).
    fn remove_run_files(run: &Path) {
        for name in [API_SOCKET, VSOCK_SOCKET, PID_FILE, LOG_FILE, VSOCK_RESET_MARK] {
            let _ = std::fs::remove_file(run.join(name));
        }
        remove_disk_link(run);
        let _ = std::fs::remove_dir_all(run.join(JAIL_DIR));
        Self::forget_diff_base(run);
    }

    /// Records that the guest in `run_dir` has a vsock reset pending (see [`VSOCK_RESET_MARK`]).
    pub(super) fn mark_vsock_reset(run_dir: &Path) {
        if let Err(e) = std::fs::write(run_dir.join(VSOCK_RESET_MARK), b"") {
            tracing::warn!(run_dir = %run_dir.display(), error = %e, "cannot record the pending vsock reset");
        }
    }

    /// Removes the cgroups the jailer made for a VM whose process is gone (anything still in them, e.g. a
    /// Firecracker whose start was aborted, is killed first).
    async fn remove_cgroups(&self, run_dir: &Path) {
        let Some(cfg) = &self.jailer else { return };
        let Some(iid) = jailed_instance_id(run_dir, &self.binary) else {
            return;
        };
        crate::cgroup::remove_vm(&cgroups::vm_dirs(cfg, &self.binary, &iid)).await;
    }

    /// Removes the cgroups of VMs that are not in `keep` (the daemon's live VMs), killing what still runs in
    /// them: a VM nobody owns any more (its sandbox was removed while the daemon was down, or a crash came
    /// between its start and its record). Only the parent cgroup of this configuration is looked at.
    pub async fn sweep_cgroups(&self, keep: &[VmHandle]) {
        let Some(cfg) = &self.jailer else { return };
        let keep: Vec<String> = keep
            .iter()
            .filter_map(|h| jailed_instance_id(&h.run_dir, &self.binary))
            .collect();
        crate::cgroup::sweep(&cgroups::parent_dirs(cfg, &self.binary), &keep).await;
    }

    fn proc_id(vm: &VmHandle) -> ProcessId {
        ProcessId {
            pid: vm.pid,
            start_ticks: vm.start_ticks,
        }
    }

    /// Whether `exe` is the Firecracker binary this driver starts for the VM in `run_dir`. A jailed
    /// Firecracker runs in its own mount namespace, where the binary is `/<exec name>` at the root of the
    /// chroot; that form is accepted when the run directory holds a jail (whatever this driver's current
    /// configuration, so a daemon restarted without the jailer can still stop jailed VMs).
    fn is_our_exe(&self, exe: &Path, run_dir: &Path) -> bool {
        if exe == self.binary || std::fs::canonicalize(&self.binary).is_ok_and(|b| b == exe) {
            return true;
        }
        run_dir.join(JAIL_DIR).is_dir() && self.is_jailed_exe(exe)
    }

    /// `/<exec name>`: Firecracker's executable as a jailed process (in its own mount namespace) shows it.
    fn is_jailed_exe(&self, exe: &Path) -> bool {
        self.binary
            .file_name()
            .is_some_and(|name| exe == Path::new("/").join(name))
    }
}

/// A Firecracker process whose API socket is up, not yet configured.
struct Launched {
    proc_id: ProcessId,
    paths: GuestPaths,
    api: ApiClient,
    spawned_at: Instant,
    socket_ready: Duration,
}

/// Maps an API failure to the trait's error, keeping Firecracker's `fault_message`.
fn api_error(id: &str, e: &api::ApiError) -> VmmError {
    VmmError::Api {
        id: id.to_string(),
        endpoint: e.endpoint().to_string(),
        detail: e.detail(),
    }
}

/// Paths handed to Firecracker (host paths, or paths inside the chroot when jailed).
struct GuestPaths {
    kernel: PathBuf,
    initramfs: PathBuf,
    disk: PathBuf,
    vsock: PathBuf,
}

/// Removes `<run>/rootfs.disk` only when it is a symlink (never a disk that happens to have that name).
fn remove_disk_link(run: &Path) {
    let link = run.join(DISK_LINK);
    if std::fs::symlink_metadata(&link).is_ok_and(|m| m.file_type().is_symlink()) {
        let _ = std::fs::remove_file(&link);
    }
}

/// The instance id of a jailed VM, read back from `<run>/jail/<exec name>/<id>`.
fn jailed_instance_id(run_dir: &Path, binary: &Path) -> Option<String> {
    let dir = run_dir.join(JAIL_DIR).join(binary.file_name()?);
    let mut ids = std::fs::read_dir(dir).ok()?.filter_map(|e| e.ok());
    let first = ids.next()?.file_name().into_string().ok()?;
    Some(first)
}

#[async_trait::async_trait]
impl Vmm for FirecrackerVmm {
    fn kind(&self) -> VmmKind {
        VmmKind::Firecracker
    }

    fn accel(&self) -> Accel {
        Accel::Kvm
    }

    fn version(&self) -> String {
        self.version.clone()
    }

    async fn prepare_disk(
        &self,
        base: &Path,
        format: DiskFormat,
        dest_dir: &Path,
    ) -> Result<PathBuf, VmmError> {
        let dest = dest_dir.join("disk.ext4");
        // Firecracker's block device is raw bytes and knows no backing files: only a raw base can be copied.
        if format != DiskFormat::Raw {
            return Err(VmmError::Disk {
                path: base.to_path_buf(),
                detail: format!(
                    "Firecracker disks are raw; a {} base cannot be used",
                    format.as_str()
                ),
            });
        }
        // Templates are read-only; the sandbox's own disk (created 0600) is writable by its owner only.
        crate::disk::copy_raw(base, &dest).await?;
        Ok(dest)
    }

    async fn start(&self, spec: &VmSpec) -> Result<VmHandle, VmmError> {
        // A jailed VM tracks the pages written from its boot on, so its first pause writes only those.
        let boot_diff = self.jailer.is_some() && !crate::feature_off(FEATURES_OFF_VAR, FEATURE_BOOT_DIFF);
        let launched = self.launch(spec).await?;
        if let Err(e) = self
            .configure(&launched.api, spec, &launched.paths, boot_diff)
            .await
        {
            return Err(self.abort(spec, launched.proc_id, api_error(&spec.id, &e)).await);
        }
        let vm = self.finish(spec, &launched, "started").await?;
        if boot_diff {
            self.record_boot_diff_base(&spec.run_dir);
        } else {
            Self::forget_diff_base(&spec.run_dir);
        }
        Ok(vm)
    }

    async fn capture_disk(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
    ) -> Result<crate::DiskCapture, VmmError> {
        self.capture_disk_to(vm, disk, dest).await
    }

    async fn connect_agent(&self, vm: &VmHandle) -> Result<UnixStream, VmmError> {
        // Adopted VMs (after a daemon restart) get their log bounded again here.
        self.consoles.watch(&vm.run_dir, Self::proc_id(vm));
        let uds = self.socket_addr(&vm.run_dir, VSOCK_SOCKET);
        let mark = vm.run_dir.join(VSOCK_RESET_MARK);
        if mark.exists() && vsock::poke(&uds, self.timeouts.agent_handshake).await {
            let _ = std::fs::remove_file(&mark);
        }
        vsock::connect(&uds, AGENT_VSOCK_PORT, self.timeouts.agent_handshake)
            .await
            .map_err(|e| VmmError::AgentChannel {
                id: vm.run_dir.display().to_string(),
                detail: e.to_string(),
            })
    }

    async fn stop(&self, vm: &VmHandle) -> Result<(), VmmError> {
        self.stop_within(vm, self.timeouts.stop_grace).await
    }

    fn snapshot_resets_agent_channel(&self) -> bool {
        true
    }

    async fn continue_if_stopped(&self, vm: &VmHandle) -> Result<bool, VmmError> {
        let api = self.api(&vm.run_dir);
        let id = vm.run_dir.display().to_string();
        let info = api.describe().await.map_err(|e| api_error(&id, &e))?;
        if info.state != "Paused" {
            return Ok(false);
        }
        api.resume().await.map_err(|e| api_error(&id, &e))?;
        Ok(true)
    }

    async fn sweep(&self, live: &[VmHandle]) {
        self.sweep_cgroups(live).await;
    }

    fn exit_log(&self, vm: &VmHandle) -> String {
        crate::log::tail(&vm.run_dir.join(LOG_FILE))
    }

    fn is_alive(&self, vm: &VmHandle) -> bool {
        vm.kind == VmmKind::Firecracker
            && process::is_running(Self::proc_id(vm))
            && process::exe_of(vm.pid).is_some_and(|exe| self.is_our_exe(&exe, &vm.run_dir))
    }

    async fn snapshot(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, VmmError> {
        self.snapshot_to_dir(vm, disk, dest, mode).await
    }

    async fn restore(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        self.restore_from_dir(spec, snapshot, info, false).await
    }

    async fn resume(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        self.restore_from_dir(spec, snapshot, info, true).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instance_ids_are_what_firecracker_accepts() {
        assert_eq!(
            FirecrackerVmm::instance_id("sbx_0123456789abcdef"),
            "sbx-0123456789abcdef"
        );
        assert_eq!(FirecrackerVmm::instance_id("a/../b é"), "a----b--");
        assert_eq!(FirecrackerVmm::instance_id(&"x".repeat(100)).len(), 64);
    }

    #[test]
    fn boot_args_name_the_vsock_transport() {
        let args = FirecrackerVmm::boot_args("box-1", None);
        assert!(args.contains("hearth.transport=vsock"));
        assert!(args.contains("hearth.vsock_port=1024"));
        assert!(args.ends_with("hearth.hostname=box-1"));
        assert!(args.starts_with("console=ttyS0 "));
        assert!(!args.contains("hearth.net="));
        let with_net = FirecrackerVmm::boot_args(
            "box-1",
            Some(&crate::NetAttach::for_sandbox("sbx_0123456789abcdef")),
        );
        assert!(with_net.ends_with("hearth.hostname=box-1 hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1"));
        let with_v6 = FirecrackerVmm::boot_args(
            "box-1",
            Some(&crate::NetAttach::for_sandbox("sbx_0123456789abcdef").with_ipv6(true)),
        );
        assert!(
            with_v6.ends_with(" hearth.net6=fd68:6872:7468::2/64,fd68:6872:7468::1"),
            "{with_v6}"
        );
    }
}
