//! The Firecracker process: spawn it detached, wait for its API socket, find it again, stop it.
//!
//! The process is started in a new session (so it keeps running when the daemon exits or is killed) with its
//! stdio in a log file. While the daemon lives the process is still its child: the [`tokio::process::Child`]
//! is dropped without waiting, and tokio reaps the process in the background once it exits, so no zombie stays
//! behind. After a daemon restart the process belongs to init (or a subreaper), which reaps it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// A process identified by pid and start time, which together survive pid reuse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessId {
    pub pid: u32,
    pub start_ticks: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The log file could not be opened.
    #[error("log file {path}: {source}")]
    Log { path: PathBuf, source: std::io::Error },
    /// The network namespace to run in could not be opened.
    #[error("network namespace {path}: {source}")]
    Netns { path: PathBuf, source: std::io::Error },
    /// The program could not be executed.
    #[error("spawn {program}: {source}")]
    Spawn {
        program: PathBuf,
        source: std::io::Error,
    },
    /// The process exited before it was ready.
    #[error("exited during startup; log tail: {log_tail}")]
    ExitedEarly { log_tail: String },
    /// The API socket did not appear in time.
    #[error("api socket {path} not ready after {waited:?}; log tail: {log_tail}")]
    SocketTimeout {
        path: String,
        waited: Duration,
        log_tail: String,
    },
    /// The process outlived SIGKILL.
    #[error("pid {pid} still alive after SIGKILL")]
    Unkillable { pid: u32 },
    /// Signalling the process failed for a reason other than it being gone.
    #[error("signal pid {pid}: {source}")]
    Signal { pid: u32, source: nix::Error },
}

/// [`spawn_detached_in`] without a working directory or network namespace (tests).
#[cfg(test)]
pub fn spawn_detached(
    program: &Path,
    args: &[std::ffi::OsString],
    log: &Path,
) -> Result<ProcessId, ProcessError> {
    spawn_detached_in(program, args, log, None, None)
}

/// Spawns `program args` in a new session with stdin from /dev/null and stdout+stderr appended to `log`, in
/// the working directory `cwd` when given (relative paths given to the program resolve there), inside the
/// network namespace `netns` when given (a file such as `/run/netns/<name>`).
pub fn spawn_detached_in(
    program: &Path,
    args: &[std::ffi::OsString],
    log: &Path,
    cwd: Option<&Path>,
    netns: Option<&Path>,
) -> Result<ProcessId, ProcessError> {
    let log_err = |source| ProcessError::Log {
        path: log.to_path_buf(),
        source,
    };
    // Opened here: the child may only make async-signal-safe calls between fork and exec (setns is one).
    let netns = netns
        .map(|path| {
            File::open(path).map_err(|source| ProcessError::Netns {
                path: path.to_path_buf(),
                source,
            })
        })
        .transpose()?;
    let netns_fd = netns.as_ref().map(std::os::fd::AsRawFd::as_raw_fd);
    let out = File::options()
        .create(true)
        .append(true)
        .open(log)
        .map_err(log_err)?;
    let err = out.try_clone().map_err(log_err)?;

    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .kill_on_drop(false);
    if let Some(dir) = cwd {
        cmd.current_dir(dir);
    }
    // SAFETY: the closure runs in the forked child before exec and only calls setsid(2) and setns(2), which
    // are async-signal-safe and touch no memory shared with the parent; the namespace file stays open in the
    // parent until after the spawn.
    unsafe {
        cmd.pre_exec(move || {
            nix::unistd::setsid().map_err(std::io::Error::from)?;
            if let Some(fd) = netns_fd
                && libc::setns(fd, libc::CLONE_NEWNET) < 0
            {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|source| ProcessError::Spawn {
        program: program.to_path_buf(),
        source,
    })?;
    drop(netns);
    let pid = child.id().ok_or_else(|| ProcessError::ExitedEarly {
        log_tail: crate::log::tail(log),
    })?;
    // Read while the handle is held: until then nothing reaps the child, so even a process that already
    // exited is still in /proc (as a zombie).
    let start_ticks = crate::process_start_ticks(pid).ok_or_else(|| ProcessError::ExitedEarly {
        log_tail: crate::log::tail(log),
    })?;
    // Dropping the handle neither kills nor waits: tokio keeps reaping it in the background.
    drop(child);
    Ok(ProcessId { pid, start_ticks })
}

/// Waits until something accepts connections on `socket`, failing early if the process dies.
pub async fn wait_for_socket(
    proc_id: ProcessId,
    socket: &super::sock::SocketAddr,
    log: &Path,
    timeout: Duration,
) -> Result<(), ProcessError> {
    let started = Instant::now();
    loop {
        if socket.connect().await.is_ok() {
            return Ok(());
        }
        if !is_running(proc_id) {
            return Err(ProcessError::ExitedEarly {
                log_tail: crate::log::tail(log),
            });
        }
        if started.elapsed() >= timeout {
            return Err(ProcessError::SocketTimeout {
                path: socket.display(),
                waited: timeout,
                log_tail: crate::log::tail(log),
            });
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// One-letter process state from `/proc/<pid>/stat` (R, S, D, Z, ...).
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.get(stat.rfind(')')? + 2..)?.chars().next()
}

/// True while the process runs: same pid and start time, and not a zombie. A thread-group leader that
/// exited while other threads of the process still run (e.g. a vCPU thread leaving KVM) shows as a zombie
/// too, but the process still holds its sockets and memory: it only counts as gone once it is the last
/// thread.
pub fn is_running(proc_id: ProcessId) -> bool {
    if crate::process_start_ticks(proc_id.pid) != Some(proc_id.start_ticks) {
        return false;
    }
    match process_state(proc_id.pid) {
        None => false,
        Some('Z' | 'X') => thread_count(proc_id.pid) > 1,
        Some(_) => true,
    }
}

/// Number of threads of a process still listed in `/proc/<pid>/task` (0 if it is gone).
fn thread_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |dir| dir.filter_map(|e| e.ok()).count())
}

/// Target of `/proc/<pid>/exe`, without the " (deleted)" suffix of a replaced binary.
pub fn exe_of(pid: u32) -> Option<PathBuf> {
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok()?;
    let text = exe.to_string_lossy();
    match text.strip_suffix(" (deleted)") {
        Some(stripped) => Some(PathBuf::from(stripped)),
        None => Some(exe),
    }
}

/// SIGTERM, wait up to `grace`, then SIGKILL and wait until the process is gone. A process that is already
/// gone (or whose pid now belongs to another process) is not an error.
pub async fn terminate(proc_id: ProcessId, grace: Duration) -> Result<(), ProcessError> {
    if !is_running(proc_id) {
        return Ok(());
    }
    signal(proc_id, Signal::SIGTERM)?;
    if wait_gone(proc_id, grace).await {
        return Ok(());
    }
    signal(proc_id, Signal::SIGKILL)?;
    if wait_gone(proc_id, Duration::from_secs(10)).await {
        return Ok(());
    }
    Err(ProcessError::Unkillable { pid: proc_id.pid })
}

/// Signals the process through a pidfd, checking its identity (start time) after the pidfd pins it: a pid
/// recycled by another process in between is never hit.
fn signal(proc_id: ProcessId, sig: Signal) -> Result<(), ProcessError> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let err = |source| ProcessError::Signal {
        pid: proc_id.pid,
        source,
    };
    let pid = libc::pid_t::try_from(proc_id.pid).map_err(|_| err(nix::Error::EINVAL))?;
    // SAFETY: pidfd_open(2) takes a pid and flags and returns a new file descriptor or -1; no memory is
    // passed.
    let raw = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if raw < 0 {
        return match nix::Error::last() {
            nix::Error::ESRCH => Ok(()),
            e => Err(err(e)),
        };
    }
    let raw = std::os::fd::RawFd::try_from(raw).map_err(|_| err(nix::Error::EBADF))?;
    // SAFETY: `raw` was just returned by pidfd_open and nothing else owns it.
    let pidfd = unsafe { OwnedFd::from_raw_fd(raw) };
    if !is_running(proc_id) {
        return Ok(());
    }
    // SAFETY: a valid pidfd, a signal number, a null siginfo (meaning: as kill(2) would send it), flags 0.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig as libc::c_int,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if rc < 0 {
        return match nix::Error::last() {
            nix::Error::ESRCH => Ok(()),
            e => Err(err(e)),
        };
    }
    Ok(())
}

/// Polls until the process is no longer running (a zombie counts as gone: it holds no resources and its
/// parent reaps it). Returns false on timeout.
async fn wait_gone(proc_id: ProcessId, timeout: Duration) -> bool {
    let started = Instant::now();
    loop {
        if !is_running(proc_id) {
            reap_if_child(proc_id);
            return true;
        }
        if started.elapsed() >= timeout {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Reaps the process if it is a zombie child of ours (a no-op otherwise, e.g. after adoption). The start
/// time is checked so that another child's exit status is never taken.
fn reap_if_child(proc_id: ProcessId) {
    use nix::sys::wait::{WaitPidFlag, waitpid};
    if process_state(proc_id.pid) != Some('Z')
        || crate::process_start_ticks(proc_id.pid) != Some(proc_id.start_ticks)
    {
        return;
    }
    if let Ok(raw) = i32::try_from(proc_id.pid) {
        // ECHILD when it is not our child or tokio reaped it first: both are fine.
        let _ = waitpid(Pid::from_raw(raw), Some(WaitPidFlag::WNOHANG));
    }
}

/// Cuts `log` down to its last `max / 2` bytes once it is larger than `max`. The writer must have the file
/// open with `O_APPEND` (as [`spawn_detached_in`] does), so its next write lands at the new end. Bytes the
/// writer appends between the read and the truncation are lost, which is acceptable for a flood.
pub fn trim_log(log: &Path, max: u64) -> std::io::Result<bool> {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut file = match File::options().read(true).write(true).open(log) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    let len = file.metadata()?.len();
    if len <= max {
        return Ok(false);
    }
    let keep = max / 2;
    file.seek(SeekFrom::Start(len - keep))?;
    let mut tail = Vec::with_capacity(usize::try_from(keep).unwrap_or(0));
    Read::by_ref(&mut file).take(keep).read_to_end(&mut tail)?;
    file.set_len(0)?;
    file.seek(SeekFrom::Start(0))?;
    writeln!(file, "[hearth: log trimmed, {} bytes dropped]", len - keep)?;
    file.write_all(&tail)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn detached_child_is_terminated_and_gone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let p = spawn_detached(Path::new("/bin/sleep"), &["30".into()], &log).expect("spawn");
        assert!(is_running(p));
        // A new session: the child leads its own session.
        assert_eq!(
            nix::unistd::getsid(Some(Pid::from_raw(p.pid as i32))).ok(),
            Some(Pid::from_raw(p.pid as i32))
        );
        assert_eq!(
            exe_of(p.pid).as_deref(),
            std::fs::canonicalize("/bin/sleep").ok().as_deref()
        );
        terminate(p, Duration::from_secs(2)).await.expect("terminate");
        assert!(!is_running(p));
        // Idempotent.
        terminate(p, Duration::from_secs(2))
            .await
            .expect("second terminate");
    }

    #[tokio::test]
    async fn sigterm_ignored_means_sigkill() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let p = spawn_detached(
            Path::new("/bin/sh"),
            &[
                "-c".into(),
                "trap '' TERM; echo ready; while :; do sleep 0.1; done".into(),
            ],
            &log,
        )
        .expect("spawn");
        // Let the shell install its trap.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let started = Instant::now();
        terminate(p, Duration::from_millis(300)).await.expect("terminate");
        assert!(!is_running(p));
        assert!(started.elapsed() >= Duration::from_millis(300));
        assert!(crate::log::tail(&log).contains("ready"));
    }

    #[tokio::test]
    async fn socket_wait_reports_early_exit_with_log() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let p = spawn_detached(
            Path::new("/bin/sh"),
            &["-c".into(), "echo boom >&2; exit 3".into()],
            &log,
        )
        .expect("spawn");
        let none = super::super::sock::SocketAddr::Path(dir.path().join("none.sock"));
        let err = wait_for_socket(p, &none, &log, Duration::from_secs(5))
            .await
            .expect_err("no socket");
        match err {
            ProcessError::ExitedEarly { log_tail } => assert!(log_tail.contains("boom")),
            other => panic!("unexpected {other}"),
        }
    }

    #[test]
    fn trimming_keeps_the_tail_and_appends_continue() {
        use std::io::Write;
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let mut writer = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .expect("open");
        for i in 0..2000 {
            writeln!(writer, "line {i:05}").expect("write");
        }
        assert!(!trim_log(&log, 1 << 20).expect("no trim needed"));
        assert!(trim_log(&log, 4000).expect("trim"));
        writeln!(writer, "after trim").expect("write");
        let text = std::fs::read_to_string(&log).expect("read");
        assert!(text.len() < 2100, "{}", text.len());
        assert!(text.starts_with("[hearth: log trimmed,"));
        assert!(text.contains("line 01999\nafter trim\n"), "{text}");
        assert!(!text.contains("line 00000"));
        assert!(!trim_log(&dir.path().join("absent"), 10).expect("absent log"));
    }

    #[tokio::test]
    async fn a_stale_identity_is_never_signalled() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p =
            spawn_detached(Path::new("/bin/sleep"), &["30".into()], &dir.path().join("log")).expect("spawn");
        let stale = ProcessId {
            start_ticks: p.start_ticks + 1,
            ..p
        };
        terminate(stale, Duration::from_millis(100))
            .await
            .expect("stale terminate");
        signal(stale, Signal::SIGKILL).expect("stale signal");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(is_running(p), "a process with another start time was signalled");
        terminate(p, Duration::from_secs(2)).await.expect("terminate");
        assert!(!is_running(p));
    }

    #[test]
    fn stale_identity_is_not_running() {
        let me = ProcessId {
            pid: std::process::id(),
            start_ticks: crate::process_start_ticks(std::process::id()).expect("self"),
        };
        assert!(is_running(me));
        assert!(!is_running(ProcessId {
            start_ticks: me.start_ticks + 1,
            ..me
        }));
    }
}
