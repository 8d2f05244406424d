//! The cgroups of jailed Firecracker VMs: the limits a VM's shape implies, the parent cgroup they live in, and
//! their removal (after a stop, and at daemon start for VMs nobody owns any more).
//!
//! The jailer creates `<hierarchy>/<parent>/<instance id>` and writes the `--cgroup file=value` settings there
//! before it execs Firecracker. With [`super::JailerConfig::shape_limits`] the driver passes, for cgroup v2:
//! - `cpu.max = <vcpus * 100000> 100000`: the VMM (vCPU threads and its own) gets at most its vCPUs' worth of
//!   CPU time;
//! - `memory.max = guest memory + `[`VMM_OVERHEAD_MIB`]: the guest's RAM plus what the VMM itself needs;
//!   a VMM that goes beyond is reclaimed or OOM-killed alone;
//! - `pids.max = `[`PIDS_MAX`]: Firecracker runs a handful of threads; nothing in the jail may fork more.
//!
//! and the v1 equivalents (`cpu.cfs_quota_us`, `memory.limit_in_bytes`, `pids.max`) on a v1 hierarchy. On v2
//! the controllers must be enabled in every ancestor's `cgroup.subtree_control`: [`prepare_parent`] does that
//! for the root and the parent before each start (idempotent).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::jailer::{CgroupVersion, JailerConfig};

/// The cgroup hierarchy's mount point.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// Memory a Firecracker process may use beyond the guest's RAM. Measured on the KVM test host: a 256 MiB guest
/// that touched all its memory left the VM's cgroup with 258.5 MiB anonymous memory (guest + ~2.5 MiB of
/// Firecracker's own), 2.5 MiB kernel memory and page tables, and ~51 MiB page cache (the kernel image and
/// initramfs read at boot, the disk's cache) that the kernel reclaims under the limit. The margin keeps that
/// cache from thrashing; the guest itself can never use more than its RAM.
pub const VMM_OVERHEAD_MIB: u64 = 64;
/// Tasks (threads) a jailed Firecracker may have: it runs about 3 + vCPUs threads.
pub const PIDS_MAX: u32 = 64;
/// The controllers the shape limits need.
const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

impl CgroupVersion {
    /// The version of this host's cgroup hierarchy at [`CGROUP_ROOT`]: v2 when it is the unified hierarchy.
    pub fn detect() -> Self {
        if Path::new(CGROUP_ROOT).join("cgroup.controllers").is_file() {
            CgroupVersion::V2
        } else {
            CgroupVersion::V1
        }
    }
}

/// The `file=value` settings that limit a VM of `vcpus` and `memory_mib` to its shape.
pub fn shape_settings(version: CgroupVersion, vcpus: u32, memory_mib: u32) -> Vec<String> {
    let period: u64 = 100_000;
    let quota = u64::from(vcpus.max(1)) * period;
    let memory = (u64::from(memory_mib) + VMM_OVERHEAD_MIB) * 1024 * 1024;
    match version {
        CgroupVersion::V2 => vec![
            format!("cpu.max={quota} {period}"),
            format!("memory.max={memory}"),
            format!("pids.max={PIDS_MAX}"),
        ],
        CgroupVersion::V1 => vec![
            format!("cpu.cfs_quota_us={quota}"),
            format!("memory.limit_in_bytes={memory}"),
            format!("pids.max={PIDS_MAX}"),
        ],
    }
}

/// The parent cgroup's name (relative to the hierarchy): the configured one, else the jailer's default (the
/// executable's file name).
pub fn parent_name(cfg: &JailerConfig, firecracker: &Path) -> String {
    cfg.parent_cgroup.clone().unwrap_or_else(|| {
        firecracker
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "firecracker".into())
    })
}

/// The controllers whose hierarchies hold a VM's cgroup (v1 has one hierarchy per controller).
fn controllers(cfg: &JailerConfig) -> Vec<String> {
    let mut names: Vec<String> = cfg
        .cgroups
        .iter()
        .filter_map(|s| s.split('.').next().map(str::to_owned))
        .collect();
    if cfg.shape_limits {
        names.extend(CONTROLLERS.iter().map(|c| (*c).to_owned()));
    }
    names.sort_unstable();
    names.dedup();
    names
}

/// The directories holding every VM's cgroup: `<root>/<parent>` on v2, `<root>/<controller>/<parent>` per
/// controller on v1.
pub fn parent_dirs(cfg: &JailerConfig, firecracker: &Path) -> Vec<PathBuf> {
    let parent = parent_name(cfg, firecracker);
    match cfg.cgroup_version {
        CgroupVersion::V2 => vec![Path::new(CGROUP_ROOT).join(&parent)],
        CgroupVersion::V1 => controllers(cfg)
            .into_iter()
            .map(|c| Path::new(CGROUP_ROOT).join(c).join(&parent))
            .collect(),
    }
}

/// On cgroup v2, makes the parent cgroup and enables the limits' controllers in the root's and the parent's
/// `cgroup.subtree_control` (a child can only use a controller its parent delegates). A no-op on v1 and
/// without shape limits.
pub fn prepare_parent(cfg: &JailerConfig, firecracker: &Path) -> std::io::Result<()> {
    if cfg.cgroup_version != CgroupVersion::V2 || !cfg.shape_limits {
        return Ok(());
    }
    let root = Path::new(CGROUP_ROOT);
    let parent = root.join(parent_name(cfg, firecracker));
    match std::fs::create_dir(&parent) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    for dir in [root, parent.as_path()] {
        enable_controllers(dir)?;
    }
    Ok(())
}

/// Writes `+<controller>` into `dir/cgroup.subtree_control` for each limit controller not enabled yet.
fn enable_controllers(dir: &Path) -> std::io::Result<()> {
    let control = dir.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&control)?;
    let missing: Vec<String> = CONTROLLERS
        .iter()
        .filter(|c| !enabled.split_whitespace().any(|e| e == **c))
        .map(|c| format!("+{c}"))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    std::fs::write(&control, missing.join(" ")).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("enabling {} in {}: {e}", missing.join(" "), control.display()),
        )
    })
}

/// The cgroup directories of VM `instance_id`.
pub fn vm_dirs(cfg: &JailerConfig, firecracker: &Path, instance_id: &str) -> Vec<PathBuf> {
    parent_dirs(cfg, firecracker)
        .into_iter()
        .map(|p| p.join(instance_id))
        .collect()
}

/// Removes a cgroup directory whose processes are gone. The kernel releases a cgroup a moment after its last
/// task is reaped, so `EBUSY` is retried for up to two seconds. A missing directory is fine.
pub async fn remove(dir: &Path) -> std::io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

/// The pids in a cgroup (`cgroup.procs`), empty when it has none or is gone.
pub fn pids_in(dir: &Path) -> Vec<u32> {
    std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// SIGKILLs every process of a cgroup: `cgroup.kill` on v2 (atomic, also catches forks in flight), one kill
/// per listed pid otherwise; then waits up to two seconds until it is empty.
pub async fn kill_all(dir: &Path) {
    if std::fs::write(dir.join("cgroup.kill"), "1").is_err() {
        for pid in pids_in(dir) {
            if let Ok(pid) = i32::try_from(pid)
                && pid > 1
            {
                // SAFETY: kill(2) has no memory-safety preconditions; the pid is in a VM's own cgroup.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    while !pids_in(dir).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_settings_follow_vcpus_and_memory() {
        assert_eq!(
            shape_settings(CgroupVersion::V2, 2, 512),
            vec![
                "cpu.max=200000 100000".to_owned(),
                format!("memory.max={}", (512 + VMM_OVERHEAD_MIB) << 20),
                format!("pids.max={PIDS_MAX}"),
            ]
        );
        let v1 = shape_settings(CgroupVersion::V1, 1, 256);
        assert_eq!(v1[0], "cpu.cfs_quota_us=100000");
        assert_eq!(
            v1[1],
            format!("memory.limit_in_bytes={}", (256 + VMM_OVERHEAD_MIB) << 20)
        );
    }

    #[test]
    fn dirs_per_version_and_parent() {
        let mut cfg = JailerConfig::new(1, 1);
        cfg.parent_cgroup = Some("hearth-fc-x".into());
        cfg.shape_limits = true;
        let fc = Path::new("/opt/fc/firecracker");
        assert_eq!(
            vm_dirs(&cfg, fc, "sbx-1"),
            vec![PathBuf::from("/sys/fs/cgroup/hearth-fc-x/sbx-1")]
        );
        cfg.cgroup_version = CgroupVersion::V1;
        cfg.cgroups = vec!["cpu.shares=10".into()];
        assert_eq!(
            vm_dirs(&cfg, fc, "sbx-1"),
            ["cpu", "memory", "pids"]
                .iter()
                .map(|c| PathBuf::from(format!("/sys/fs/cgroup/{c}/hearth-fc-x/sbx-1")))
                .collect::<Vec<_>>()
        );
        cfg.parent_cgroup = None;
        cfg.shape_limits = false;
        assert_eq!(
            vm_dirs(&cfg, fc, "a"),
            vec![PathBuf::from("/sys/fs/cgroup/cpu/firecracker/a")]
        );
    }
}
