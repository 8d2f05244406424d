//! PTY sessions: a program on a new pseudo-terminal, its output streamed with flow control, input, resize and
//! signals, and a hang-up when the host goes away.
//!
//! The program is the session leader of its own session, with the terminal's slave side as stdin, stdout,
//! stderr and controlling terminal, so the terminal's line discipline does what a terminal does: Ctrl-C (the
//! byte 0x03) becomes SIGINT for the foreground process group, a resize (`TIOCSWINSZ`) sends SIGWINCH. PTY
//! programs are not in the process table: the session lives exactly as long as its stream.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hearth_proto::msg::{DEFAULT_TERM, valid_pty_size};
use hearth_proto::{ErrorKind, ExecRequest, ExitStatus, GuestMsg, HostMsg, PtyRequest};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};

use crate::conn::{After, Ctx, Inbound, STOP_GRACE};
use crate::reaper::{self, RawExit};
use crate::{AgentError, fail};

/// Terminal read size.
const READ_CHUNK: usize = 64 * 1024;
/// After the program exited, a read that waits longer than this ends the output (a background child may
/// hold the terminal open forever).
const DRAIN_GRACE: Duration = Duration::from_millis(250);

/// The exit of the session leader, once known (`None` inside: the reaper lost it).
type ExitWatch = watch::Receiver<Option<Option<RawExit>>>;

/// Serve a `Pty` request: start the program, then pump output, input and control until it exits.
pub(crate) async fn run(
    ctx: &Ctx,
    req: PtyRequest,
    inbound: mpsc::UnboundedReceiver<Inbound>,
) -> Result<After, AgentError> {
    if !valid_pty_size(req.rows, req.cols) {
        return Err(fail(
            ErrorKind::InvalidRequest,
            format!("invalid terminal size {}x{}", req.rows, req.cols),
        ));
    }
    let (master, pid, exit, cgroup) = spawn(&req)?;
    // From here on, leaving early (the task is aborted when the stream is abandoned or the connection lost)
    // hangs the session up.
    let mut hangup = Hangup {
        pid,
        exit: exit.clone(),
        armed: true,
        cgroup: cgroup.map(Arc::new),
    };
    ctx.reply(GuestMsg::Started { pid });
    let master = Arc::new(master);
    let input = feed_input(ctx, &master, pid, inbound);
    let output = async { tokio::join!(pump_output(ctx, &master, exit.clone()), wait_exit(exit.clone())).1 };
    let raw = tokio::select! {
        raw = output => raw,
        () = input => return Ok(After::Done),
    };
    hangup.armed = false;
    let status = match raw {
        Some(RawExit::Code(c)) => ExitStatus {
            code: Some(c),
            signal: None,
            timed_out: false,
        },
        Some(RawExit::Signal(s)) => ExitStatus {
            code: None,
            signal: Some(s),
            timed_out: false,
        },
        None => ExitStatus {
            code: None,
            signal: None,
            timed_out: false,
        },
    };
    ctx.reply(GuestMsg::Exited(status));
    Ok(After::Done)
}

/// What [`spawn`] returns: the master side, the pid, its exit and its cgroup.
type Spawned = (AsyncFd<OwnedFd>, u32, ExitWatch, Option<crate::contain::Cgroup>);

/// Open the terminal and start the program on it, in a cgroup of its own.
fn spawn(req: &PtyRequest) -> Result<Spawned, AgentError> {
    let mut env = req.env.clone();
    env.entry("TERM".into()).or_insert_with(|| DEFAULT_TERM.into());
    let exec = ExecRequest {
        command: req.command.clone(),
        env,
        cwd: req.cwd.clone(),
        stdin: false,
        timeout_ms: None,
        background: false,
    };
    let mut cmd = crate::procs::build_command(&exec)?;
    let size = nix::pty::Winsize {
        ws_row: req.rows,
        ws_col: req.cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = nix::pty::openpty(&size, None)
        .map_err(|e| fail(ErrorKind::Other, format!("cannot open a pseudo-terminal: {e}")))?;
    let dup = |fd: &OwnedFd| {
        fd.try_clone()
            .map_err(|e| fail(ErrorKind::Other, format!("dup of the terminal: {e}")))
    };
    cmd.stdin(Stdio::from(dup(&pty.slave)?))
        .stdout(Stdio::from(dup(&pty.slave)?))
        .stderr(Stdio::from(dup(&pty.slave)?));
    // SAFETY: runs after build_command's pre_exec (setsid); ioctl is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            // The terminal on stdin becomes the controlling terminal of the new session.
            if libc::ioctl(0, libc::TIOCSCTTY as _, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let cgroup = crate::contain::enter_on_exec(&mut cmd).map_err(|e| {
        fail(
            ErrorKind::Other,
            format!("cannot make the terminal's cgroup: {e}"),
        )
    })?;
    let (child, exit_rx) = reaper::spawn(&mut cmd).map_err(|e| {
        fail(
            crate::files::errno_kind(&e),
            format!("cannot start {}: {e}", req.command.display()),
        )
    })?;
    let pid = child.id();
    drop(child);
    // The parent's copies of the slave side must go, or the master never sees the hang-up.
    drop(cmd);
    drop(pty.slave);
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let raw = exit_rx.await.ok();
        let _ = tx.send(Some(raw));
    });
    set_nonblocking(&pty.master).map_err(|e| fail(ErrorKind::Other, format!("terminal: {e}")))?;
    // SAFETY: the AsyncFd owns the descriptor, which nothing else closes or registers.
    let master =
        unsafe { AsyncFd::register_with_interest(pty.master, Interest::READABLE | Interest::WRITABLE) }
            .map_err(|e| fail(ErrorKind::Other, format!("terminal: {e}")))?;
    Ok((master, pid, rx, cgroup))
}

fn set_nonblocking(fd: &OwnedFd) -> std::io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; no pointers involved.
    let flags = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if flags == -1 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK) } == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

async fn wait_exit(mut exit: ExitWatch) -> Option<RawExit> {
    loop {
        if let Some(raw) = *exit.borrow_and_update() {
            return raw;
        }
        if exit.changed().await.is_err() {
            return None;
        }
    }
}

/// One read of the master side: `Ok(0)` when the terminal is hung up (EIO: every slave side closed).
async fn read_master(master: &AsyncFd<OwnedFd>, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        let mut guard = master.readable().await?;
        let res = guard.try_io(|fd| {
            // SAFETY: reads into `buf`, which is valid for `buf.len()` bytes.
            let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match res {
            Ok(Ok(n)) => return Ok(n),
            Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return Ok(0),
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => continue,
        }
    }
}

/// Write all of `data` to the master side (the program's input).
async fn write_master(master: &AsyncFd<OwnedFd>, mut data: &[u8]) -> std::io::Result<()> {
    while !data.is_empty() {
        let mut guard = master.writable().await?;
        let res = guard.try_io(|fd| {
            // SAFETY: reads from `data`, which is valid for `data.len()` bytes.
            let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
            if n < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(n as usize)
            }
        });
        match res {
            Ok(Ok(n)) => data = &data[n..],
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => {}
        }
    }
    Ok(())
}

/// Copy the terminal's output to the host, with flow control, until it is hung up (or, once the program
/// exited, until it stays quiet for [`DRAIN_GRACE`]).
async fn pump_output(ctx: &Ctx, master: &AsyncFd<OwnedFd>, mut exit: ExitWatch) {
    let mut buf = vec![0u8; READ_CHUNK];
    loop {
        let exited = exit.borrow().is_some();
        let n = if exited {
            match tokio::time::timeout(DRAIN_GRACE, read_master(master, &mut buf)).await {
                Ok(Ok(n)) => n,
                Ok(Err(_)) | Err(_) => 0,
            }
        } else {
            tokio::select! {
                r = read_master(master, &mut buf) => r.unwrap_or(0),
                _ = exit.changed() => continue,
            }
        };
        if n == 0 {
            return;
        }
        let chunk = Bytes::copy_from_slice(&buf[..n]);
        if ctx.send_data(&GuestMsg::Stdout, chunk).await.is_err() {
            return;
        }
    }
}

/// Apply what the host sends on the stream: input bytes, resizes, signals. Never returns while the stream
/// is open; returns when it is gone.
async fn feed_input(
    ctx: &Ctx,
    master: &AsyncFd<OwnedFd>,
    pid: u32,
    mut inbound: mpsc::UnboundedReceiver<Inbound>,
) {
    let mut writable = true;
    while let Some(item) = inbound.recv().await {
        match item {
            Inbound::Data(d) => {
                if writable && write_master(master, &d).await.is_err() {
                    // The terminal is gone: keep returning credit until the exit is reported.
                    writable = false;
                }
                ctx.credit(d.len());
            }
            // A terminal has no end of input of its own (Ctrl-D is the byte 0x04).
            Inbound::End => {}
            Inbound::Control(HostMsg::PtyResize { rows, cols }) if valid_pty_size(rows, cols) => {
                let size = libc::winsize {
                    ws_row: rows,
                    ws_col: cols,
                    ws_xpixel: 0,
                    ws_ypixel: 0,
                };
                // SAFETY: TIOCSWINSZ reads a winsize that lives for the duration of the call.
                unsafe { libc::ioctl(master.get_ref().as_raw_fd(), libc::TIOCSWINSZ, &size) };
            }
            Inbound::Control(HostMsg::PtySignal { signal }) if (1..=64).contains(&signal) => {
                // SAFETY: kill has no memory-safety preconditions.
                unsafe { libc::kill(-(pid as libc::pid_t), signal) };
            }
            Inbound::Control(_) => {}
        }
    }
    std::future::pending::<()>().await;
}

/// Hangs the session up if the request ends before the program did (stream abandoned, connection lost):
/// SIGHUP and SIGTERM to its process group now, SIGKILL after [`STOP_GRACE`].
struct Hangup {
    pid: u32,
    exit: ExitWatch,
    armed: bool,
    /// Killed with the group when the program outlives the grace: descendants that left it die too.
    cgroup: Option<Arc<crate::contain::Cgroup>>,
}

impl Drop for Hangup {
    fn drop(&mut self) {
        if !self.armed || self.exit.borrow().is_some() {
            return;
        }
        let pgid = -(self.pid as libc::pid_t);
        // SAFETY: kill has no memory-safety preconditions; the leader is not reaped yet, so its pid (and
        // process group id) cannot have been reused.
        unsafe {
            libc::kill(pgid, libc::SIGHUP);
            libc::kill(pgid, libc::SIGTERM);
        }
        let exit = self.exit.clone();
        let cgroup = self.cgroup.clone();
        tokio::spawn(async move {
            if tokio::time::timeout(STOP_GRACE, wait_exit(exit)).await.is_err() {
                if let Some(cg) = cgroup {
                    cg.kill();
                }
                // SAFETY: as above; still not reaped.
                unsafe { libc::kill(pgid, libc::SIGKILL) };
            }
        });
    }
}
