//! The process-wide child reaper.
//!
//! One thread waits for *any* child to become exitable (`waitid(P_ALL, WEXITED | WNOWAIT)`, which does not
//! reap), then reaps every zombie with `waitpid(-1, WNOHANG)` while holding the table lock, and hands each
//! status to whoever registered that pid. Children are spawned through [`spawn`] under the same lock, so a
//! child can never be reaped before its pid is registered. Pids nobody registered (orphans re-parented to us
//! as PID 1) are reaped and forgotten.

use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use tokio::sync::oneshot;

/// How a child ended, as reported by `waitpid`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawExit {
    Code(i32),
    Signal(i32),
}

struct Reaper {
    waiting: Mutex<HashMap<libc::pid_t, oneshot::Sender<RawExit>>>,
    spawned: Condvar,
}

static REAPER: OnceLock<&'static Reaper> = OnceLock::new();

fn reaper() -> &'static Reaper {
    REAPER.get_or_init(|| {
        let r: &'static Reaper = Box::leak(Box::new(Reaper {
            waiting: Mutex::new(HashMap::new()),
            spawned: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || reap_loop(r))
            .unwrap_or_else(|e| panic!("cannot start the reaper thread: {e}"));
        r
    })
}

impl Reaper {
    fn lock(&self) -> MutexGuard<'_, HashMap<libc::pid_t, oneshot::Sender<RawExit>>> {
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Spawn `cmd` and register for its exit status. Never call `wait` on the returned `Child`.
pub fn spawn(cmd: &mut Command) -> std::io::Result<(Child, oneshot::Receiver<RawExit>)> {
    let r = reaper();
    let mut waiting = r.lock();
    let child = cmd.spawn()?;
    let (tx, rx) = oneshot::channel();
    // Pids fit in pid_t: the kernel hands them out as such.
    waiting.insert(child.id() as libc::pid_t, tx);
    r.spawned.notify_all();
    Ok((child, rx))
}

fn reap_loop(r: &'static Reaper) {
    loop {
        // SAFETY: an all-zero siginfo_t is a valid value for waitid to fill in.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waitid only writes into `info`, which lives for the duration of the call.
        let rc = unsafe { libc::waitid(libc::P_ALL, 0, &mut info, libc::WEXITED | libc::WNOWAIT) };
        if rc == -1 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ECHILD) {
                // No children at all: sleep until one is spawned (or an orphan may have arrived).
                let waiting = r.lock();
                if waiting.is_empty() {
                    let _ = r.spawned.wait_timeout(waiting, Duration::from_secs(1));
                }
            }
            continue;
        }
        let mut waiting = r.lock();
        loop {
            let mut status: libc::c_int = 0;
            // SAFETY: waitpid only writes into `status`.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            let exit = if libc::WIFSIGNALED(status) {
                RawExit::Signal(libc::WTERMSIG(status))
            } else {
                RawExit::Code(libc::WEXITSTATUS(status))
            };
            if let Some(tx) = waiting.remove(&pid) {
                let _ = tx.send(exit);
            }
        }
    }
}
