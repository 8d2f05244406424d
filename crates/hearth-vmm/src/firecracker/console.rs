//! A bound on `firecracker.log`: Firecracker writes its own log and the guest's serial console to its stdio,
//! an append-only file in the run directory, which a guest printing without end would grow without limit.
//! While a VM runs, a task trims the file to its last half ([`super::process::trim_log`]) whenever it holds
//! more than [`crate::qemu::console::CONSOLE_MAX`], the same bound as QEMU's console. One task per VM, started
//! when the driver starts or restores it and again when it first reaches an adopted one (after a daemon
//! restart); the task ends with the process.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::LOG_FILE;
use super::process::{self, ProcessId};

/// How often the log's size is checked.
const PERIOD: Duration = Duration::from_secs(1);

/// The VMs (run directory, pid) whose log a task watches.
#[derive(Debug, Clone, Default)]
pub struct Trimmers(Arc<Mutex<HashSet<(PathBuf, u32)>>>);

impl Trimmers {
    /// Starts the task for the VM `proc_id` in `run_dir` unless one runs already. Needs a tokio runtime (a
    /// call outside one is ignored: nothing to trim with).
    pub fn watch(&self, run_dir: &Path, proc_id: ProcessId) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let key = (run_dir.to_path_buf(), proc_id.pid);
        if !self
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone())
        {
            return;
        }
        let set = self.0.clone();
        let log = run_dir.join(LOG_FILE);
        rt.spawn(async move {
            while process::is_running(proc_id) {
                if let Err(e) = process::trim_log(&log, crate::qemu::console::CONSOLE_MAX) {
                    tracing::debug!(log = %log.display(), error = %e, "cannot trim the VM's log");
                }
                tokio::time::sleep(PERIOD).await;
            }
            set.lock().unwrap_or_else(PoisonError::into_inner).remove(&key);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A "VM" (a shell appending to the log, as Firecracker's stdio does) floods 6 MiB: the watched log stays
    /// bounded and keeps the newest output; the task ends with the process.
    #[tokio::test]
    async fn a_flooded_log_stays_bounded_while_the_vm_runs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join(LOG_FILE);
        let script = "i=0; while [ $i -lt 96 ]; do head -c 65536 /dev/zero | tr '\\0' x; echo; i=$((i+1)); \
                      sleep 0.02; done; echo last-line; sleep 30";
        let proc_id = process::spawn_detached(Path::new("/bin/sh"), &["-c".into(), script.into()], &log)
            .expect("spawn");
        let trimmers = Trimmers::default();
        trimmers.watch(dir.path(), proc_id);
        trimmers.watch(dir.path(), proc_id); // a second watch of the same VM is a no-op
        assert_eq!(trimmers.0.lock().expect("lock").len(), 1);
        let max = crate::qemu::console::CONSOLE_MAX;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut largest = 0;
        loop {
            let len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
            largest = largest.max(len);
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.contains("last-line") && len <= max {
                assert!(
                    text.starts_with("[hearth: log trimmed,"),
                    "{}",
                    &text[..80.min(text.len())]
                );
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the log was not trimmed ({len} bytes)"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // One period of writing (~3 MiB/s here) at most beyond the bound, never the whole 6 MiB.
        assert!(largest < max + 4 * 1024 * 1024, "the log reached {largest} bytes");
        process::terminate(proc_id, Duration::ZERO).await.expect("stop");
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while !trimmers.0.lock().expect("lock").is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "the task outlived the process"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
