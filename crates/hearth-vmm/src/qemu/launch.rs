//! Starting a QEMU process: spawn detached, wait for QMP, attach the console, then boot or load a snapshot.

use std::ffi::OsString;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;
use std::time::Instant;

use nix::sys::signal::Signal;

use super::memory::{self, Machine};
use super::qmp::Qmp;
use super::small_pages;
use super::{QMP_TIMEOUT, QemuVmm, RunFiles, START_TIMEOUT, STOP_STEP, snapshot, vm_uid};
use crate::tap;
use crate::{VmHandle, VmSpec, VmmError, VmmKind, process_start_ticks};

/// How a launched QEMU gets its guest going.
pub(super) enum Boot {
    /// Boot the kernel.
    Fresh,
    /// Load this migration stream (a snapshot's `vmstate`) first, with the capabilities it was written with.
    Incoming { state: File, caps: snapshot::StreamCaps },
}

impl QemuVmm {
    /// Spawns QEMU for `spec`, waits until QMP answers, attaches the console, then either lets a fresh guest
    /// run or first loads an incoming migration stream. On error nothing of the VM is left running.
    pub(super) async fn launch(
        &self,
        spec: &VmSpec,
        machine: &Machine,
        boot: Boot,
    ) -> Result<VmHandle, VmmError> {
        let files = RunFiles::new(&spec.run_dir);
        let failed = |detail: String| VmmError::StartFailed {
            id: spec.id.clone(),
            detail,
        };
        if !self.binary.exists() {
            return Err(VmmError::BinaryMissing {
                binary: self.binary.display().to_string(),
                detail: "no such file".to_string(),
            });
        }
        // The guest's NIC: a descriptor on the sandbox's tap, opened here (QEMU cannot) and inherited by QEMU.
        let tap = match &spec.net {
            None => None,
            Some(net) => {
                net.validate().map_err(failed)?;
                let fd = tap::open_tap(&net.netns, &net.tap)
                    .map_err(|e| failed(format!("tap {} in {}: {e}", net.tap, net.netns.display())))?;
                Some(fd)
            }
        };
        let tap_fd = tap.as_ref().map(AsRawFd::as_raw_fd);
        let mut args = self.command_line_for(spec, tap_fd, machine)?;
        if matches!(boot, Boot::Incoming { .. }) {
            args.extend(["-incoming", "defer"].map(OsString::from));
        }
        // Leftovers of an earlier run would make readiness checks lie.
        for stale in [
            &files.agent_sock,
            &files.qmp_sock,
            &files.console_sock,
            &files.pid_file,
        ] {
            match std::fs::remove_file(stale) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(VmmError::Io {
                        path: stale.clone(),
                        source: e,
                    });
                }
            }
        }
        // A fresh boot starts a fresh console log; a restored VM goes on with its old one.
        if matches!(boot, Boot::Fresh) {
            let _ = std::fs::remove_file(&files.console_log);
        }
        let log = File::create(&files.qemu_log).map_err(|e| VmmError::Io {
            path: files.qemu_log.clone(),
            source: e,
        })?;
        let log2 = log.try_clone().map_err(|e| VmmError::Io {
            path: files.qemu_log.clone(),
            source: e,
        })?;
        // The reaper's note of how QEMU ended (a signal leaves nothing in QEMU's own output), appended after it.
        let exit_note = std::fs::OpenOptions::new()
            .append(true)
            .open(&files.qemu_log)
            .map_err(|e| VmmError::Io {
                path: files.qemu_log.clone(),
                source: e,
            })?;
        if self.drop_privileges {
            self.prepare_unprivileged(spec)?;
        }
        // The VM's cgroup: the child writes itself into each `cgroup.procs` before it execs QEMU.
        let cgroup = match &self.cgroups {
            None => Vec::new(),
            Some(c) => match c.create(&spec.run_dir, spec.vcpus, spec.memory_mib, self.accel) {
                Ok(procs) => procs,
                Err(e) => {
                    self.remove_cgroup(&spec.run_dir, true, None).await;
                    return Err(failed(format!("the VM's cgroup: {e}")));
                }
            },
        };
        let cgroup_fds: Vec<i32> = cgroup.iter().map(AsRawFd::as_raw_fd).collect();
        let small_pages = (!memory::feature_off(small_pages::FEATURE)).then(small_pages::SmallPages::new);
        let mut cmd = std::process::Command::new(&self.binary);
        cmd.args(&args)
            .current_dir(&spec.run_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2));
        // The tap descriptor is close-on-exec like every descriptor here; the child alone clears that flag
        // (after the fork), so no other process spawned meanwhile inherits it.
        // SAFETY: runs in the forked child before exec; setsid(2), write(2), fcntl(2) and prctl(2) are
        // async-signal-safe, nothing is allocated (the filter program was built before the fork), and the
        // descriptors were opened by the parent and stay open until after spawn.
        unsafe {
            cmd.pre_exec(move || {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                // "0" moves the writing process: this child, and QEMU after the exec.
                for fd in &cgroup_fds {
                    if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some(fd) = tap_fd
                    && libc::fcntl(fd, libc::F_SETFD, 0) < 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // Last: the filter applies to everything after it.
                if let Some(filter) = &small_pages {
                    filter.install()?;
                }
                Ok(())
            });
        }
        let spawned = cmd.spawn();
        // QEMU holds its own copy now; ours would keep the tap attached after QEMU exits.
        drop(tap);
        drop(cgroup);
        let mut child = match spawned {
            Ok(child) => child,
            Err(e) => {
                self.remove_cgroup(&spec.run_dir, true, None).await;
                return Err(failed(format!("spawn {}: {e}", self.binary.display())));
            }
        };
        let pid = child.id();
        let start_ticks = process_start_ticks(pid);
        // Reap QEMU whenever it exits while we live; report the exit to the readiness loop below.
        let (exit_tx, mut exit_rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name(format!("qemu-reap-{pid}"))
            .spawn(move || {
                let status = child.wait();
                let what = match &status {
                    Ok(s) => s.to_string(),
                    Err(e) => format!("not known ({e})"),
                };
                let mut note = exit_note;
                let _ = writeln!(note, "hearth: QEMU (pid {pid}) ended: {what}");
                let _ = exit_tx.send(status);
            })
            .map_err(|e| failed(format!("reaper thread: {e}")))?;
        let handle = VmHandle {
            kind: VmmKind::Qemu,
            pid,
            start_ticks: start_ticks.unwrap_or(0),
            run_dir: spec.run_dir.clone(),
        };

        let deadline = Instant::now() + START_TIMEOUT;
        let mut exited = false;
        let mut poll = crate::poll::Backoff::new();
        let ready = loop {
            if let Ok(status) = exit_rx.try_recv() {
                exited = true;
                let status = status.map(|s| s.to_string()).unwrap_or_else(|e| e.to_string());
                break Err(format!(
                    "qemu exited during startup ({status}): {}",
                    crate::log::tail(&files.qemu_log)
                ));
            }
            if start_ticks.is_none() {
                break Err("cannot read the start time of the qemu process".to_string());
            }
            if files.qmp_sock.exists() {
                let probe = async {
                    let mut q = Qmp::connect(&files.qmp_sock).await?;
                    q.query_status().await.map(|_| q)
                };
                if let Ok(Ok(q)) = tokio::time::timeout(QMP_TIMEOUT, probe).await {
                    break self.run_guest(&handle, q, boot).await;
                }
            }
            if Instant::now() > deadline {
                break Err(format!(
                    "qmp not ready after {START_TIMEOUT:?}: {}",
                    crate::log::tail(&files.qemu_log)
                ));
            }
            poll.sleep().await;
        };
        match ready {
            Ok(()) => Ok(handle),
            Err(detail) => {
                // Nothing of the VM may be left running.
                if !exited && start_ticks.is_some() {
                    let _ = Self::signal(&handle, Signal::SIGKILL).await;
                    let _ = tokio::time::timeout(STOP_STEP, exit_rx).await;
                }
                self.remove_cgroup(&spec.run_dir, true, None).await;
                Err(failed(detail))
            }
        }
    }

    /// Lets the VM's own uid reach what it reopens after the privilege drop: the run directory (its chroot)
    /// becomes searchable (0711, not listable) and the sandbox disk becomes the VM uid's (0600).
    fn prepare_unprivileged(&self, spec: &VmSpec) -> Result<(), VmmError> {
        use std::os::unix::fs::PermissionsExt;
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| VmmError::Io { path, source }
        };
        let id = nix::unistd::Uid::from_raw(vm_uid(&spec.id));
        let gid = nix::unistd::Gid::from_raw(vm_uid(&spec.id));
        std::fs::set_permissions(&spec.run_dir, std::fs::Permissions::from_mode(0o711))
            .map_err(io(&spec.run_dir))?;
        nix::unistd::chown(&spec.disk, Some(id), Some(gid))
            .map_err(|e| io(&spec.disk)(std::io::Error::from(e)))?;
        std::fs::set_permissions(&spec.disk, std::fs::Permissions::from_mode(0o600))
            .map_err(io(&spec.disk))?;
        Ok(())
    }

    /// Attaches the console reader to a VM started with `-S`, loads the incoming state if any, then lets its
    /// CPUs run.
    async fn run_guest(&self, vm: &VmHandle, mut q: Qmp, boot: Boot) -> Result<(), String> {
        self.attach_console(vm).map_err(|e| format!("console: {e}"))?;
        if let Boot::Incoming { state, caps } = boot {
            snapshot::load_incoming(&mut q, &state, caps).await?;
        }
        match tokio::time::timeout(QMP_TIMEOUT, q.execute("cont", None)).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err("qmp cont timed out".to_string()),
        }
    }
}
