//! Cgroups of VMM processes, shared by both drivers: the limits a VM's shape implies, the parent cgroup every
//! VM of one daemon lives below, and their removal (after a stop, and at daemon start for VMs nobody owns).
//!
//! A VM of `vcpus` and `memory_mib` gets ([`shape_settings`]):
//! - `cpu.max = <vcpus * 100000> 100000` (v1: `cpu.cfs_quota_us`): the VMM, vCPU threads and its own, gets at
//!   most its vCPUs' worth of CPU time;
//! - `memory.max = guest memory + the VMM's overhead` (v1: `memory.limit_in_bytes`): a VMM that goes beyond is
//!   reclaimed or OOM-killed alone;
//! - `pids.max`: the VMM's threads; nothing it runs may fork beyond.
//!
//! On v2 the controllers must be enabled in every ancestor's `cgroup.subtree_control`: [`prepare_parent`] does
//! that for the root and the parent (idempotent). On v1 each controller has its own hierarchy and the VM has a
//! cgroup of the same name in each.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The cgroup hierarchy's mount point.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// The controllers the shape limits need.
pub const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];
/// CPU bandwidth period (µs) of `cpu.max`.
const CPU_PERIOD: u64 = 100_000;

/// Which cgroup hierarchy is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

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

/// What bounds one VM's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub vcpus: u32,
    pub memory_mib: u32,
    /// Memory the VMM process needs beyond the guest's RAM.
    pub overhead_mib: u64,
    pub pids_max: u32,
}

/// The `file=value` settings that limit a VM to `shape`.
pub fn shape_settings(version: CgroupVersion, shape: Shape) -> Vec<String> {
    let quota = u64::from(shape.vcpus.max(1)) * CPU_PERIOD;
    let memory = (u64::from(shape.memory_mib) + shape.overhead_mib) * 1024 * 1024;
    let pids = shape.pids_max;
    match version {
        CgroupVersion::V2 => vec![
            format!("cpu.max={quota} {CPU_PERIOD}"),
            format!("memory.max={memory}"),
            format!("pids.max={pids}"),
        ],
        CgroupVersion::V1 => vec![
            format!("cpu.cfs_quota_us={quota}"),
            format!("memory.limit_in_bytes={memory}"),
            format!("pids.max={pids}"),
        ],
    }
}

/// The directories holding every VM's cgroup below `parent`: `<root>/<parent>` on v2,
/// `<root>/<controller>/<parent>` per controller on v1.
pub fn parent_dirs(version: CgroupVersion, parent: &str, controllers: &[String]) -> Vec<PathBuf> {
    match version {
        CgroupVersion::V2 => vec![Path::new(CGROUP_ROOT).join(parent)],
        CgroupVersion::V1 => controllers
            .iter()
            .map(|c| Path::new(CGROUP_ROOT).join(c).join(parent))
            .collect(),
    }
}

/// [`CONTROLLERS`] as owned names.
pub fn shape_controllers() -> Vec<String> {
    CONTROLLERS.iter().map(|c| (*c).to_owned()).collect()
}

/// On cgroup v2, makes `<root>/<parent>` and enables `controllers` in the root's and the parent's
/// `cgroup.subtree_control` (a child can only use a controller its parent delegates). A no-op on v1.
pub fn prepare_parent(version: CgroupVersion, parent: &str, controllers: &[&str]) -> std::io::Result<()> {
    if version != CgroupVersion::V2 {
        return Ok(());
    }
    let root = Path::new(CGROUP_ROOT);
    let parent = root.join(parent);
    create_dir(&parent)?;
    for dir in [root, parent.as_path()] {
        enable_controllers(dir, controllers)?;
    }
    Ok(())
}

/// `mkdir`, where an existing directory is fine.
pub fn create_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(std::io::Error::new(e.kind(), format!("{}: {e}", dir.display()))),
    }
}

/// Writes `+<controller>` into `dir/cgroup.subtree_control` for each of `controllers` not enabled yet.
fn enable_controllers(dir: &Path, controllers: &[&str]) -> std::io::Result<()> {
    let control = dir.join("cgroup.subtree_control");
    let enabled = std::fs::read_to_string(&control)?;
    let missing: Vec<String> = controllers
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

/// Whether the v2 root offers `controller` (e.g. `io`, absent where the kernel or a v1 mount holds it).
pub fn v2_available(controller: &str) -> bool {
    std::fs::read_to_string(Path::new(CGROUP_ROOT).join("cgroup.controllers"))
        .is_ok_and(|c| c.split_whitespace().any(|x| x == controller))
}

/// Writes one `file=value` setting into cgroup `dir`.
pub fn write_setting(dir: &Path, setting: &str) -> std::io::Result<()> {
    let (file, value) = setting.split_once('=').ok_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("bad setting {setting:?}"),
        )
    })?;
    let path = dir.join(file);
    std::fs::write(&path, value)
        .map_err(|e| std::io::Error::new(e.kind(), format!("{} = {value}: {e}", path.display())))
}

/// Removes a cgroup directory whose processes are gone. The kernel releases a cgroup a moment after its last
/// task is reaped, so `EBUSY` is retried for up to two seconds. A missing directory is fine.
pub async fn remove(dir: &Path) -> std::io::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(2);
    let mut poll = crate::poll::Backoff::new();
    loop {
        match std::fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                poll.sleep().await;
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
    let mut poll = crate::poll::Backoff::new();
    while !pids_in(dir).is_empty() && Instant::now() < deadline {
        poll.sleep().await;
    }
}

/// Kills what still runs in each of one VM's cgroup directories, then removes them; failures are logged.
pub async fn remove_vm(dirs: &[PathBuf]) {
    for dir in dirs {
        if !pids_in(dir).is_empty() {
            kill_all(dir).await;
        }
        if let Err(e) = remove(dir).await {
            tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove the VM's cgroup");
        }
    }
}

/// Removes every VM cgroup below `parents` whose name is not in `keep`, killing what still runs in it: VMs
/// nobody owns any more (their sandbox was removed while the daemon was down, or a crash came between a VM's
/// start and its record).
pub async fn sweep(parents: &[PathBuf], keep: &[String]) {
    for parent in parents {
        let Ok(entries) = std::fs::read_dir(parent) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !entry.path().is_dir() || keep.contains(&name) {
                continue;
            }
            let dir = entry.path();
            let pids = pids_in(&dir);
            if !pids.is_empty() {
                tracing::info!(cgroup = %dir.display(), ?pids, "killing the VMM of a VM nobody owns");
                kill_all(&dir).await;
            }
            match remove(&dir).await {
                Ok(()) => tracing::info!(cgroup = %dir.display(), "removed an unowned VM cgroup"),
                Err(e) => {
                    tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove an unowned VM cgroup")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_follow_the_shape() {
        let shape = Shape {
            vcpus: 2,
            memory_mib: 512,
            overhead_mib: 64,
            pids_max: 100,
        };
        assert_eq!(
            shape_settings(CgroupVersion::V2, shape),
            vec![
                "cpu.max=200000 100000".to_owned(),
                format!("memory.max={}", 576u64 << 20),
                "pids.max=100".to_owned(),
            ]
        );
        let v1 = shape_settings(CgroupVersion::V1, Shape { vcpus: 0, ..shape });
        assert_eq!(v1[0], "cpu.cfs_quota_us=100000");
        assert_eq!(v1[1], format!("memory.limit_in_bytes={}", 576u64 << 20));
        assert_eq!(
            parent_dirs(CgroupVersion::V1, "p", &shape_controllers()),
            ["cpu", "memory", "pids"]
                .iter()
                .map(|c| PathBuf::from(format!("/sys/fs/cgroup/{c}/p")))
                .collect::<Vec<_>>()
        );
        assert_eq!(
            parent_dirs(CgroupVersion::V2, "p", &shape_controllers()),
            vec![PathBuf::from("/sys/fs/cgroup/p")]
        );
    }
}
