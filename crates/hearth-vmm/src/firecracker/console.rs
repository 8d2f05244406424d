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
