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
//! for the root and the parent before each start (idempotent). The helpers both drivers share are in
//! [`crate::cgroup`].

use std::path::{Path, PathBuf};

use super::jailer::{CgroupVersion, JailerConfig};
use crate::cgroup::Shape;

pub use crate::cgroup::{CGROUP_ROOT, kill_all, pids_in, remove};

/// Memory a Firecracker process may use beyond the guest's RAM. Measured on the KVM test host: a 256 MiB guest
/// that touched all its memory left the VM's cgroup with 258.5 MiB anonymous memory (guest + ~2.5 MiB of
/// Firecracker's own), 2.5 MiB kernel memory and page tables, and ~51 MiB page cache (the kernel image and
/// initramfs read at boot, the disk's cache) that the kernel reclaims under the limit. The margin keeps that
/// cache from thrashing; the guest itself can never use more than its RAM.
pub const VMM_OVERHEAD_MIB: u64 = 64;
/// Tasks (threads) a jailed Firecracker may have: it runs about 3 + vCPUs threads.
pub const PIDS_MAX: u32 = 64;

/// The `file=value` settings that limit a VM of `vcpus` and `memory_mib` to its shape.
pub fn shape_settings(version: CgroupVersion, vcpus: u32, memory_mib: u32) -> Vec<String> {
    crate::cgroup::shape_settings(
        version,
        Shape {
            vcpus,
            memory_mib,
            overhead_mib: VMM_OVERHEAD_MIB,
            pids_max: PIDS_MAX,
        },
    )
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
        names.extend(crate::cgroup::shape_controllers());
    }
    names.sort_unstable();
    names.dedup();
    names
}

/// The directories holding every VM's cgroup: `<root>/<parent>` on v2, `<root>/<controller>/<parent>` per
/// controller on v1.
pub fn parent_dirs(cfg: &JailerConfig, firecracker: &Path) -> Vec<PathBuf> {
    crate::cgroup::parent_dirs(
        cfg.cgroup_version,
        &parent_name(cfg, firecracker),
        &controllers(cfg),
    )
}

/// On cgroup v2, makes the parent cgroup and enables the limits' controllers in the root's and the parent's
/// `cgroup.subtree_control`. A no-op on v1 and without shape limits.
pub fn prepare_parent(cfg: &JailerConfig, firecracker: &Path) -> std::io::Result<()> {
    if !cfg.shape_limits {
        return Ok(());
    }
    crate::cgroup::prepare_parent(
        cfg.cgroup_version,
        &parent_name(cfg, firecracker),
        &crate::cgroup::CONTROLLERS,
    )
}

/// The cgroup directories of VM `instance_id`.
pub fn vm_dirs(cfg: &JailerConfig, firecracker: &Path, instance_id: &str) -> Vec<PathBuf> {
    parent_dirs(cfg, firecracker)
        .into_iter()
        .map(|p| p.join(instance_id))
        .collect()
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
