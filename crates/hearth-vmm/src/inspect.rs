//! What the host's kernel says about a VMM process (`/proc/<pid>`, cgroupfs): its identity, privileges,
//! namespaces and cgroup limits. Knows nothing of sandboxes; `hearthd` turns it into `hearth inspect`.

use std::path::Path;

use crate::cgroup::CGROUP_ROOT;

/// One process's isolation as `/proc` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessBoundary {
    pub pid: u32,
    pub binary: String,
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
    pub root: String,
    pub seccomp: String,
    pub seccomp_filters: u32,
    pub no_new_privs: bool,
    pub capabilities: String,
    pub threads: u32,
    pub rss_bytes: u64,
    /// (kind, id, shared with the calling process).
    pub namespaces: Vec<(String, String, bool)>,
    pub cgroup: CgroupLimits,
}

/// A process's cgroup and the limits on it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CgroupLimits {
    /// `v1` or `v2`.
    pub version: String,
    pub path: String,
    pub shared_with_caller: bool,
    pub cpu_max: Option<String>,
    pub memory_max: Option<String>,
    pub memory_current: Option<u64>,
    pub pids_max: Option<String>,
    pub pids_current: Option<u64>,
}

const NAMESPACES: [&str; 6] = ["net", "pid", "mnt", "ipc", "uts", "user"];

/// Reads the boundary of `pid` (`None` when the process is gone or unreadable). Every value comes from the
/// kernel at the moment of the call.
pub fn process_boundary(pid: u32) -> Option<ProcessBoundary> {
    let proc = Path::new("/proc").join(pid.to_string());
    let status = std::fs::read_to_string(proc.join("status")).ok()?;
    let field = |name: &str| -> Option<&str> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
            .map(str::trim)
    };
    let ids = |name: &str| -> Vec<u32> {
        field(name)
            .map(|v| v.split_whitespace().filter_map(|x| x.parse().ok()).collect())
            .unwrap_or_default()
    };
    let number = |name: &str| -> u64 {
        field(name)
            .and_then(|v| v.split_whitespace().next())
            .and_then(|x| x.parse().ok())
            .unwrap_or(0)
    };
    let link = |name: &str| {
        std::fs::read_link(proc.join(name))
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default()
    };
    let seccomp = match field("Seccomp") {
        Some("0") => "disabled",
        Some("1") => "strict",
        Some("2") => "filter",
        _ => "unknown",
    };
    let namespaces = NAMESPACES
        .iter()
        .map(|kind| {
            let theirs = link(&format!("ns/{kind}"));
            let ours = std::fs::read_link(format!("/proc/self/ns/{kind}"))
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_default();
            let shared = !theirs.is_empty() && theirs == ours;
            ((*kind).to_owned(), theirs, shared)
        })
        .collect();
    let cgroups = std::fs::read_to_string(proc.join("cgroup")).ok()?;
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    Some(ProcessBoundary {
        pid,
        binary: link("exe"),
        uids: ids("Uid"),
        gids: ids("Gid"),
        root: link("root"),
        seccomp: seccomp.to_owned(),
        seccomp_filters: number("Seccomp_filters") as u32,
        no_new_privs: field("NoNewPrivs") == Some("1"),
        capabilities: field("CapEff").unwrap_or_default().to_owned(),
        threads: number("Threads") as u32,
        rss_bytes: number("VmRSS") * 1024,
        namespaces,
        cgroup: cgroup_limits(&cgroups, &own, Path::new(CGROUP_ROOT)),
    })
}

/// The cgroup named by a `/proc/<pid>/cgroup` text and the limits read below `root`. On a v2 host the one
/// `0::PATH` line names it; on v1 the memory controller's line names the path and each controller's own line
/// its directory.
pub fn cgroup_limits(proc_cgroup: &str, caller_cgroup: &str, root: &Path) -> CgroupLimits {
    // (controllers, path) per line: `ID:CONTROLLERS:PATH`.
    let lines = |text: &str| -> Vec<(String, String)> {
        text.lines()
            .filter_map(|l| {
                let mut it = l.splitn(3, ':');
                let _id = it.next()?;
                Some((it.next()?.to_owned(), it.next()?.to_owned()))
            })
            .collect()
    };
    let theirs = lines(proc_cgroup);
    let ours = lines(caller_cgroup);
    let path_of = |set: &[(String, String)], controller: &str| -> Option<String> {
        set.iter()
            .find(|(c, _)| c.split(',').any(|x| x == controller))
            .map(|(_, p)| p.clone())
    };
    let read = |p: &Path| std::fs::read_to_string(p).ok().map(|s| s.trim().to_owned());
    if root.join("cgroup.controllers").is_file() {
        let path = theirs
            .iter()
            .find(|(c, _)| c.is_empty())
            .map(|(_, p)| p.clone())
            .unwrap_or_default();
        let shared = ours.iter().any(|(c, p)| c.is_empty() && *p == path);
        let dir = root.join(path.trim_start_matches('/'));
        return CgroupLimits {
            version: "v2".into(),
            shared_with_caller: shared,
            cpu_max: read(&dir.join("cpu.max")),
            memory_max: read(&dir.join("memory.max")),
            memory_current: read(&dir.join("memory.current")).and_then(|v| v.parse().ok()),
            pids_max: read(&dir.join("pids.max")),
            pids_current: read(&dir.join("pids.current")).and_then(|v| v.parse().ok()),
            path,
        };
    }
    let dir = |controller: &str| -> Option<std::path::PathBuf> {
        let path = path_of(&theirs, controller)?;
        Some(root.join(controller).join(path.trim_start_matches('/')))
    };
    let path = path_of(&theirs, "memory").unwrap_or_default();
    let shared = path_of(&ours, "memory").is_some_and(|p| p == path);
    let cpu_max = dir("cpu").and_then(|d| {
        let quota: i64 = read(&d.join("cpu.cfs_quota_us"))?.parse().ok()?;
        let period = read(&d.join("cpu.cfs_period_us"))?;
        Some(if quota < 0 {
            format!("max {period}")
        } else {
            format!("{quota} {period}")
        })
    });
    let memory_max = dir("memory").and_then(|d| {
        let v: u64 = read(&d.join("memory.limit_in_bytes"))?.parse().ok()?;
        // v1 says "no limit" with the largest page-aligned value.
        Some(if v >= (i64::MAX as u64) & !0xfff {
            "max".to_owned()
        } else {
            v.to_string()
        })
    });
    CgroupLimits {
        version: "v1".into(),
        shared_with_caller: shared,
        cpu_max,
        memory_max,
        memory_current: dir("memory")
            .and_then(|d| read(&d.join("memory.usage_in_bytes")))
            .and_then(|v| v.parse().ok()),
        pids_max: dir("pids").and_then(|d| read(&d.join("pids.max"))),
        pids_current: dir("pids")
            .and_then(|d| read(&d.join("pids.current")))
            .and_then(|v| v.parse().ok()),
        path,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_limits_come_from_each_controllers_directory() {
        let root = tempfile::tempdir().expect("tempdir");
        for (c, f, v) in [
            ("cpu", "cpu.cfs_quota_us", "200000"),
            ("cpu", "cpu.cfs_period_us", "100000"),
            ("memory", "memory.limit_in_bytes", "1073741824"),
            ("memory", "memory.usage_in_bytes", "4096"),
            ("pids", "pids.max", "256"),
            ("pids", "pids.current", "7"),
        ] {
            let d = root.path().join(c).join("hearth/sb1");
            std::fs::create_dir_all(&d).expect("mkdir");
            std::fs::write(d.join(f), format!("{v}\n")).expect("write");
        }
        let theirs = "12:pids:/hearth/sb1\n5:cpu,cpuacct:/hearth/sb1\n4:memory:/hearth/sb1\n0::/x\n";
        let ours = "12:pids:/\n5:cpu,cpuacct:/\n4:memory:/user.slice\n";
        let l = cgroup_limits(theirs, ours, root.path());
        assert_eq!(l.version, "v1");
        assert_eq!(l.path, "/hearth/sb1");
        assert!(!l.shared_with_caller);
        assert_eq!(l.cpu_max.as_deref(), Some("200000 100000"));
        assert_eq!(l.memory_max.as_deref(), Some("1073741824"));
        assert_eq!(l.memory_current, Some(4096));
        assert_eq!((l.pids_max.as_deref(), l.pids_current), (Some("256"), Some(7)));
        // Same memory cgroup as the caller: no limits of its own.
        assert!(cgroup_limits(theirs, "4:memory:/hearth/sb1\n", root.path()).shared_with_caller);
    }

    #[test]
    fn v2_limits_come_from_the_unified_directory() {
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::write(root.path().join("cgroup.controllers"), "cpu memory pids\n").expect("write");
        let d = root.path().join("hearth/sb2");
        std::fs::create_dir_all(&d).expect("mkdir");
        for (f, v) in [
            ("cpu.max", "100000 100000"),
            ("memory.max", "max"),
            ("pids.max", "64"),
        ] {
            std::fs::write(d.join(f), format!("{v}\n")).expect("write");
        }
        let l = cgroup_limits(
            "0::/hearth/sb2\n",
            "0::/system.slice/hearthd.service\n",
            root.path(),
        );
        assert_eq!((l.version.as_str(), l.path.as_str()), ("v2", "/hearth/sb2"));
        assert_eq!(l.cpu_max.as_deref(), Some("100000 100000"));
        assert_eq!(l.memory_max.as_deref(), Some("max"));
        assert_eq!(l.pids_max.as_deref(), Some("64"));
        assert_eq!(l.memory_current, None);
        assert!(!l.shared_with_caller);
    }

    #[test]
    fn this_process_is_readable_and_shares_every_namespace_with_itself() {
        let b = process_boundary(std::process::id()).expect("own /proc entry");
        assert!(b.threads >= 1 && b.rss_bytes > 0);
        assert_eq!(b.namespaces.len(), NAMESPACES.len());
        assert!(
            b.namespaces
                .iter()
                .all(|(_, id, shared)| !id.is_empty() && *shared)
        );
        assert!(b.cgroup.shared_with_caller);
        assert!(process_boundary(u32::MAX).is_none());
    }
}
