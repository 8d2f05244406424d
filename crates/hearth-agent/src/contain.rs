//! Containment of guest programs: every command, background process and terminal runs in a cgroup of its own,
//! under one parent that holds all of them, so that whatever they do the agent keeps answering.
//!
//! Layout (cgroup v2, mounted on `/sys/fs/cgroup` by PID 1):
//! ```text
//! /sys/fs/cgroup/hearth-agent   the agent itself: cpu.weight 10000, memory.min = the reserve
//! /sys/fs/cgroup/hearth-cmds    every program: memory.max = RAM - reserve, pids.max, cpu.weight 100
//!               /hearth-cmds/<n>   one per command, background process or terminal: memory.oom.group = 1
//! ```
//! A program enters its leaf between fork and exec (the child writes `0` to the leaf's `cgroup.procs`), so it
//! and everything it starts stay inside, whatever sessions or process groups they make (`setsid` does not
//! escape a cgroup). Killing a command kills its leaf (`cgroup.kill`). A fork bomb runs into `pids.max`, a
//! memory hog into `memory.max` (the kernel's OOM killer then picks inside `hearth-cmds`, never the agent),
//! and a CPU spinner gets 1/100 of the agent's share whenever the agent has work.
//!
//! Containment is on in a VM (PID 1 reading the real kernel command line) unless `hearth.contain=0`; the
//! host-side tests that run the agent as PID 1 of a namespace (`HEARTH_AGENT_CMDLINE`) leave the host's
//! cgroups alone unless they ask for `hearth.contain=1`.

use std::collections::HashSet;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use nix::mount::{MsFlags, mount};

/// Where cgroup v2 is mounted in the guest.
const ROOT: &str = "/sys/fs/cgroup";
/// The agent's own cgroup.
const AGENT: &str = "hearth-agent";
/// The parent of every program's cgroup.
const CMDS: &str = "hearth-cmds";
/// Memory kept for the agent and the kernel: at least this much ...
const RESERVE_MIN: u64 = 32 << 20;
/// ... or this fraction of RAM (1/8), whichever is larger.
const RESERVE_SHIFT: u32 = 3;
/// Default for `pids.max` of all programs together (`hearth.pids_max=` overrides).
pub const DEFAULT_PIDS_MAX: u64 = 4096;

/// The limits in force, for `describe` and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    pub memory_max: u64,
    pub reserve: u64,
    pub pids_max: u64,
}

struct Containment {
    cmds: PathBuf,
    next: AtomicU64,
    /// Leaves owned by a live [`Cgroup`] (a sweep must not remove one before its program entered it).
    owned: Mutex<HashSet<u64>>,
    limits: Limits,
}

static STATE: OnceLock<Option<Containment>> = OnceLock::new();

fn state() -> Option<&'static Containment> {
    STATE.get().and_then(Option::as_ref)
}

/// Sets up the hierarchy and moves the agent into its own cgroup. Called once by PID 1; failures are logged
/// and leave containment off (programs then run as before, uncontained).
pub fn setup(pids_max: Option<u64>) {
    let st = match build(pids_max) {
        Ok(c) => {
            crate::log(&format!(
                "containment: programs limited to {} MiB (agent reserve {} MiB) and {} processes",
                c.limits.memory_max >> 20,
                c.limits.reserve >> 20,
                c.limits.pids_max
            ));
            Some(c)
        }
        Err(e) => {
            crate::log(&format!("containment off: {e}"));
            None
        }
    };
    let _ = STATE.set(st);
}

/// The limits in force, or `None` when containment is off.
pub fn limits() -> Option<Limits> {
    state().map(|c| c.limits.clone())
}

fn build(pids_max: Option<u64>) -> Result<Containment, String> {
    let root = Path::new(ROOT);
    if !root.join("cgroup.controllers").exists() {
        std::fs::create_dir_all(root).map_err(|e| format!("mkdir {ROOT}: {e}"))?;
        let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
        mount(Some("cgroup2"), root, Some("cgroup2"), flags, None::<&str>)
            .map_err(|e| format!("mounting cgroup2: {e}"))?;
    }
    // Each controller on its own: a kernel without one (io, say) still gets the others.
    for ctl in ["+cpu", "+memory", "+pids", "+io"] {
        let _ = write(&root.join("cgroup.subtree_control"), ctl);
    }
    let enabled = std::fs::read_to_string(root.join("cgroup.subtree_control")).unwrap_or_default();
    for need in ["memory", "pids", "cpu"] {
        if !enabled.split_whitespace().any(|c| c == need) {
            return Err(format!("the {need} controller is not available"));
        }
    }
    let total = mem_total().ok_or("cannot read MemTotal")?;
    let reserve = RESERVE_MIN.max(total >> RESERVE_SHIFT);
    let limits = Limits {
        memory_max: total.saturating_sub(reserve),
        reserve,
        pids_max: pids_max.unwrap_or(DEFAULT_PIDS_MAX).max(16),
    };
    let agent = root.join(AGENT);
    mkdir(&agent)?;
    write(&agent.join("cpu.weight"), "10000")?;
    let _ = write(&agent.join("memory.min"), &reserve.to_string());
    let _ = write(&agent.join("io.weight"), "1000");
    // `0` moves the writing process (every thread of it).
    write(&agent.join("cgroup.procs"), "0")?;

    let cmds = root.join(CMDS);
    mkdir(&cmds)?;
    write(&cmds.join("memory.max"), &limits.memory_max.to_string())?;
    write(&cmds.join("pids.max"), &limits.pids_max.to_string())?;
    write(&cmds.join("cpu.weight"), "100")?;
    let _ = write(&cmds.join("io.weight"), "100");
    for ctl in ["+cpu", "+memory", "+pids", "+io"] {
        let _ = write(&cmds.join("cgroup.subtree_control"), ctl);
    }
    Ok(Containment {
        cmds,
        next: AtomicU64::new(1),
        owned: Mutex::new(HashSet::new()),
        limits,
    })
}

/// One program's cgroup. Dropping it removes the cgroup when nothing lives in it any more.
pub struct Cgroup {
    n: u64,
    dir: PathBuf,
    /// `cgroup.procs`, open for the child to write between fork and exec (held, never read).
    _procs: OwnedFd,
}

impl Cgroup {
    /// Kills everything in the cgroup at once (`cgroup.kill`), descendants that left the process group
    /// included.
    pub fn kill(&self) {
        if let Err(e) = write(&self.dir.join("cgroup.kill"), "1") {
            crate::log(&format!("killing {}: {e}", self.dir.display()));
        }
    }

    /// True when no process is left in the cgroup.
    pub fn is_empty(&self) -> bool {
        std::fs::read_to_string(self.dir.join("cgroup.procs")).is_ok_and(|p| p.trim().is_empty())
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        if let Some(c) = state() {
            c.owned.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.n);
        }
        // Fails (EBUSY) while processes are left; the next sweep takes it once they are gone.
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Puts the program `cmd` will start into a new cgroup of its own, entered between fork and exec. `None` when
/// containment is off. Hold the returned [`Cgroup`] until the program is spawned (its descriptor is written
/// by the child) and for as long as the program may need killing.
pub fn enter_on_exec(cmd: &mut std::process::Command) -> Result<Option<Cgroup>, std::io::Error> {
    let Some(c) = state() else {
        return Ok(None);
    };
    let n = c.next.fetch_add(1, Ordering::Relaxed);
    if n % 64 == 0 {
        sweep(c);
    }
    let dir = c.cmds.join(n.to_string());
    std::fs::create_dir(&dir)?;
    c.owned.lock().unwrap_or_else(|p| p.into_inner()).insert(n);
    // One command is killed as a whole by the OOM killer, not piece by piece.
    let _ = write(&dir.join("memory.oom.group"), "1");
    let procs: OwnedFd = File::options().write(true).open(dir.join("cgroup.procs"))?.into();
    let fd = procs.as_raw_fd();
    // SAFETY: the closure only calls write(2), which is async-signal-safe, on a descriptor that stays open
    // until after the spawn (the returned Cgroup owns it; it is close-on-exec).
    unsafe {
        cmd.pre_exec(move || {
            if libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Ok(Some(Cgroup {
        n,
        dir,
        _procs: procs,
    }))
}

/// Removes leaves nobody owns any more once they are empty.
fn sweep(c: &Containment) {
    let Ok(entries) = std::fs::read_dir(&c.cmds) else {
        return;
    };
    let owned = c.owned.lock().unwrap_or_else(|p| p.into_inner()).clone();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(n) = name.to_str().and_then(|s| s.parse::<u64>().ok()) else {
            continue;
        };
        if !owned.contains(&n) {
            let _ = std::fs::remove_dir(e.path());
        }
    }
}

fn mkdir(p: &Path) -> Result<(), String> {
    match std::fs::create_dir(p) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!("mkdir {}: {e}", p.display())),
    }
}

fn write(p: &Path, value: &str) -> Result<(), String> {
    File::options()
        .write(true)
        .open(p)
        .and_then(|mut f| f.write_all(value.as_bytes()))
        .map_err(|e| format!("{} <- {value}: {e}", p.display()))
}

fn mem_total() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}
