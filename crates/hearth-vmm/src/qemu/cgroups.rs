//! The cgroup of each QEMU process (SECURITY.md: a guest that spins or allocates slows only itself).
//!
//! With [`super::QemuVmm::with_cgroups`] (hearthd passes `hearth-<hash of its data dir>`, the parent jailed
//! Firecracker VMs use), every launch (boot, restore, resume, fork) puts QEMU into `<parent>/<name>`, where
//! `<name>` is the VM's run directory's name ([`cgroup_name`]; hearthd names run directories after sandbox
//! ids), with the limits of [`crate::cgroup::shape_settings`]: `cpu.max` of its vCPUs, `memory.max` of its
//! memory plus [`overhead_mib`], `pids.max` [`PIDS_MAX`], and on v2 `io.weight` when the `io` controller
//! exists. The child writes itself into `cgroup.procs` between fork and exec, so QEMU runs in its cgroup from
//! its first instruction, long before the guest's (QEMU starts with `-S`).
//!
//! Guest RAM is a shared file mapping (`memory-backend-file,share=on`, see [`super::memory`]): its page cache
//! is charged to the cgroup of the process that faults it in, i.e. this one, and counts against `memory.max`
//! like anonymous memory would. Pages a resumed VM finds already cached stay charged where they were first
//! faulted.
//!
//! Removal: QEMU cannot fork (`-sandbox spawn=deny`), so once its process is gone its cgroup is empty and
//! `stop` removes it. A cgroup that still holds processes then holds a newer QEMU of the same run directory
//! and is left alone. A failed launch kills what is in its cgroup and removes it; [`crate::Vmm::sweep`] at
//! daemon start kills and removes the cgroups of VMs the daemon does not run.
//!
//! Both hierarchies work: v2 (the unified one at `/sys/fs/cgroup`) and v1 with `cpu`, `memory` and `pids`
//! mounted below it (a cgroup of the same name in each; no I/O weight there). Without root, or without those
//! controllers, QEMU runs in the daemon's cgroup as before (logged once, when the driver is configured).

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::Accel;
use crate::cgroup::{self, CGROUP_ROOT, CgroupVersion, Shape};

/// TCG's translated-code buffer (`-accel tcg,tb-size=`, MiB) unless `HEARTH_TCG_TB_MIB` says otherwise.
/// QEMU's default is 1 GiB (or an eighth of host RAM), which a busy guest fills and keeps resident; when full,
/// QEMU flushes it and translates anew. docs/benchmarks.md ("TCG code buffer") measures what the bound costs.
pub const TCG_TB_MIB: u64 = 512;

/// The code buffer each TCG QEMU gets: [`TCG_TB_MIB`], or `HEARTH_TCG_TB_MIB` (32..=2048) for operators who
/// trade host memory for fewer retranslations. Read once per process; an unparsable value is ignored.
pub fn tcg_tb_mib() -> u64 {
    static TB: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TB.get_or_init(|| {
        std::env::var("HEARTH_TCG_TB_MIB")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .filter(|v| (32..=2048).contains(v))
            .unwrap_or(TCG_TB_MIB)
    })
}
/// Memory QEMU needs beyond the guest's RAM and TCG's code buffer. Measured on the TCG development host (QEMU
/// 10.0, cgroup v1; `tests/qemu_cgroup.rs` prints it): a 256 MiB guest booted to its agent that then wrote
/// 160 MiB into a tmpfs had 247 MiB of its RAM file resident and 350 MiB charged to its cgroup: ~62 MiB of
/// code buffer (huge pages), ~25 MiB of other anonymous memory (QEMU's heap and stacks), ~21 MiB of page
/// cache beyond guest RAM (the kernel, initramfs and disk blocks QEMU read) and ~9 MiB of kernel memory. The
/// rest is margin so that reclaiming that cache does not thrash.
pub const QEMU_BASE_OVERHEAD_MIB: u64 = 96;

/// Memory a QEMU process of `accel` may use beyond the guest's RAM: [`QEMU_BASE_OVERHEAD_MIB`], plus the code
/// buffer under TCG. Guest RAM is never more than the VM's memory; the overhead is QEMU's own.
pub fn overhead_mib(accel: Accel) -> u64 {
    match accel {
        Accel::Kvm => QEMU_BASE_OVERHEAD_MIB,
        Accel::Tcg => QEMU_BASE_OVERHEAD_MIB + tcg_tb_mib(),
    }
}
/// Tasks (threads) QEMU may have: main loop, RCU, one per vCPU, its I/O thread pool (up to 64 workers), and a
/// few more around migration. QEMU cannot fork (`spawn=deny`), so this bounds threads only; a QEMU that
/// cannot create a thread it needs would abort, hence the room.
pub const PIDS_MAX: u32 = 256;

/// Where QEMU VMs' cgroups live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuCgroups {
    pub version: CgroupVersion,
    /// The parent cgroup, relative to the hierarchy root (one path component).
    pub parent: String,
    /// `io` is delegated to VMs (v2 only).
    io: bool,
}

impl QemuCgroups {
    /// VM cgroups below `parent` on this host's hierarchy, or why there cannot be any.
    pub fn detect(parent: &str) -> Result<Self, String> {
        if !nix::unistd::geteuid().is_root() {
            return Err("the daemon does not run as root".into());
        }
        let parent_ok = !parent.is_empty()
            && parent != "."
            && parent != ".."
            && parent
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.');
        if !parent_ok {
            return Err(format!("invalid parent cgroup name {parent:?}"));
        }
        let version = CgroupVersion::detect();
        let missing: Vec<&str> = cgroup::CONTROLLERS
            .into_iter()
            .filter(|c| match version {
                CgroupVersion::V2 => !cgroup::v2_available(c),
                CgroupVersion::V1 => !Path::new(CGROUP_ROOT).join(c).join("cgroup.procs").is_file(),
            })
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "cgroup {version:?} at {CGROUP_ROOT} lacks the {} controller(s)",
                missing.join(", ")
            ));
        }
        Ok(QemuCgroups {
            version,
            parent: parent.to_owned(),
            io: version == CgroupVersion::V2 && cgroup::v2_available("io"),
        })
    }

    fn controllers(&self) -> Vec<&'static str> {
        let mut c = cgroup::CONTROLLERS.to_vec();
        if self.io {
            c.push("io");
        }
        c
    }

    /// The directories holding every VM's cgroup (one per controller hierarchy on v1).
    pub fn parent_dirs(&self) -> Vec<PathBuf> {
        cgroup::parent_dirs(self.version, &self.parent, &cgroup::shape_controllers())
    }

    /// The cgroup directories of the VM in `run_dir`.
    pub fn vm_dirs(&self, run_dir: &Path) -> Vec<PathBuf> {
        let Some(name) = cgroup_name(run_dir) else {
            return Vec::new();
        };
        self.parent_dirs().into_iter().map(|p| p.join(&name)).collect()
    }

    /// Makes the cgroup(s) of the VM in `run_dir` with the limits of its shape, and opens each one's
    /// `cgroup.procs` for the child to write itself into (close-on-exec: QEMU inherits none).
    pub fn create(
        &self,
        run_dir: &Path,
        vcpus: u32,
        memory_mib: u32,
        accel: Accel,
    ) -> std::io::Result<Vec<File>> {
        cgroup::prepare_parent(self.version, &self.parent, &self.controllers())?;
        let dirs = self.vm_dirs(run_dir);
        if dirs.is_empty() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("no cgroup name for run directory {}", run_dir.display()),
            ));
        }
        let shape = Shape {
            vcpus,
            memory_mib,
            overhead_mib: overhead_mib(accel),
            pids_max: PIDS_MAX,
        };
        let settings = cgroup::shape_settings(self.version, shape);
        let mut procs = Vec::new();
        for dir in &dirs {
            if let Some(parent) = dir.parent() {
                cgroup::create_dir(parent)?;
            }
            cgroup::create_dir(dir)?;
            for setting in &settings {
                // On v1 each hierarchy holds one controller's files: `cpu.*` go to `<root>/cpu/...`.
                let controller = setting.split('.').next().unwrap_or_default();
                let here = match self.version {
                    CgroupVersion::V2 => true,
                    CgroupVersion::V1 => dir.starts_with(Path::new(CGROUP_ROOT).join(controller)),
                };
                if here {
                    cgroup::write_setting(dir, setting)?;
                }
            }
            if self.io && dir.join("io.weight").is_file() {
                // Every VM the same share of contended disks, whatever the daemon's own weight.
                cgroup::write_setting(dir, "io.weight=default 100")?;
            }
            let path = dir.join("cgroup.procs");
            let file = File::options()
                .write(true)
                .open(&path)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
            procs.push(file);
        }
        Ok(procs)
    }
}

impl super::QemuVmm {
    /// Runs each QEMU process in a cgroup of its own below `parent` (see the module doc). Without root or the
    /// cgroup controllers, logs why once and goes on without.
    pub fn with_cgroups(mut self, parent: &str) -> Self {
        match QemuCgroups::detect(parent) {
            Ok(c) => {
                tracing::info!(parent = %c.parent, version = ?c.version, "QEMU VMs run in cgroups of their own");
                self.cgroups = Some(c);
            }
            Err(why) => {
                tracing::warn!(reason = %why, "QEMU VMs run without cgroups of their own");
                self.cgroups = None;
            }
        }
        self
    }

    /// Where VMs' cgroups live, when they have them.
    pub fn cgroups(&self) -> Option<&QemuCgroups> {
        self.cgroups.as_ref()
    }

    /// Removes the cgroup of the VM in `run_dir` (see the module doc). With `kill`, kills what is in it first;
    /// without, leaves it when it holds a process other than `gone` (the stopped QEMU, which may linger as a
    /// zombie until its reaper thread runs).
    pub(super) async fn remove_cgroup(&self, run_dir: &Path, kill: bool, gone: Option<u32>) {
        let Some(c) = &self.cgroups else { return };
        let dirs = c.vm_dirs(run_dir);
        if kill {
            crate::cgroup::remove_vm(&dirs).await;
            return;
        }
        for dir in dirs {
            // KVM runs a kernel worker per VM (`kvm-nx-lpage-recovery`) in the VMM's cgroups; it ends when the
            // VM is torn down, a moment after QEMU itself. It and a lingering zombie are not a newer VM: wait
            // for them to go.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let mut poll = crate::poll::Backoff::new();
            let newer = loop {
                let pids = crate::cgroup::pids_in(&dir);
                let newer: Vec<u32> = pids
                    .iter()
                    .copied()
                    .filter(|p| Some(*p) != gone && !kernel_thread_or_zombie(*p))
                    .collect();
                if !newer.is_empty() || pids.is_empty() || std::time::Instant::now() >= deadline {
                    break newer;
                }
                poll.sleep().await;
            };
            if !newer.is_empty() {
                tracing::info!(cgroup = %dir.display(), pids = ?newer, "cgroup holds a newer VM; left in place");
                continue;
            }
            if let Err(e) = crate::cgroup::remove(&dir).await {
                tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove the VM's cgroup");
            }
        }
    }
}

/// Whether `pid` is a kernel thread or a zombie (or gone): an empty `/proc/<pid>/cmdline`. A QEMU process
/// always has a command line (a guest that took over QEMU can change it, but only to keep its own cgroup).
fn kernel_thread_or_zombie(pid: u32) -> bool {
    use std::io::Read;
    // One byte tells: a process's command line is its own to make as long as it likes.
    let mut first = [0u8; 1];
    std::fs::File::open(format!("/proc/{pid}/cmdline"))
        .and_then(|mut f| f.read(&mut first))
        .map_or(true, |n| n == 0)
}

/// The cgroup name of the VM in `run_dir`: the directory's own name, reduced to `[A-Za-z0-9_-]` (anything else
/// becomes `-`) and at most 64 characters.
pub fn cgroup_name(run_dir: &Path) -> Option<String> {
    let name = run_dir.file_name()?.to_string_lossy();
    let name: String = name
        .chars()
        .take(64)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect();
    (!name.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_threads_and_gone_processes_are_not_vms() {
        // kthreadd is pid 2 on Linux; this test process has a command line.
        assert!(kernel_thread_or_zombie(2));
        assert!(kernel_thread_or_zombie(u32::MAX));
        assert!(!kernel_thread_or_zombie(std::process::id()));
    }

    #[test]
    fn names_and_dirs() {
        assert_eq!(
            cgroup_name(Path::new("/var/lib/hearth/run/sbx_0123")).as_deref(),
            Some("sbx_0123")
        );
        assert_eq!(cgroup_name(Path::new("/r/a.b é")).as_deref(), Some("a-b--"));
        assert_eq!(cgroup_name(Path::new("/")), None);
        let v2 = QemuCgroups {
            version: CgroupVersion::V2,
            parent: "hearth-1".into(),
            io: true,
        };
        assert_eq!(
            v2.vm_dirs(Path::new("/run/sbx_1")),
            vec![PathBuf::from("/sys/fs/cgroup/hearth-1/sbx_1")]
        );
        assert_eq!(v2.controllers(), vec!["cpu", "memory", "pids", "io"]);
        let v1 = QemuCgroups {
            version: CgroupVersion::V1,
            io: false,
            ..v2
        };
        assert_eq!(
            v1.vm_dirs(Path::new("/run/sbx_1")),
            ["cpu", "memory", "pids"]
                .iter()
                .map(|c| PathBuf::from(format!("/sys/fs/cgroup/{c}/hearth-1/sbx_1")))
                .collect::<Vec<_>>()
        );
        assert!(QemuCgroups::detect("../x").is_err());
    }
}
