//! Start-up recovery: adopt the VMs that survived a daemon restart, finish or roll back half-done operations,
//! and remove what nobody owns. Also the process-killing helpers used when tearing a sandbox down.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hearth_api::SandboxState;
use hearth_vmm::VmHandle;
use tokio::time::Instant;

use crate::db::usage::UsageKind;
use crate::db::{PausedState, SandboxRow};
use crate::service::pause::PAUSED_DIR;
use crate::service::{Live, Sandboxes, ServiceError, snapshot};

/// How long recovery keeps trying to finish an interrupted pause while the VMM may still be capturing.
const REDO_PAUSE_FOR: Duration = Duration::from_secs(40);
/// How long an adopted VM's agent has to answer after a daemon restart.
const ADOPT_CONNECT: Duration = Duration::from_secs(15);

/// State letter and start time of a process, from `/proc/<pid>/stat`.
fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let mut fields = rest.split(' ');
    let state = fields.next()?.chars().next()?;
    let ticks = fields.nth(18)?.parse().ok()?;
    Some((state, ticks))
}

/// True while `pid` runs and is not a zombie; with `ticks`, also checks its start time (pid reuse).
fn running(pid: u32, ticks: Option<u64>) -> bool {
    match proc_stat(pid) {
        Some((state, t)) => !matches!(state, 'Z' | 'X') && ticks.is_none_or(|want| want == t),
        None => false,
    }
}

fn sigkill_and_wait(pid: u32, ticks: Option<u64>) {
    let Ok(raw) = i32::try_from(pid) else { return };
    if raw <= 1 {
        return;
    }
    // SAFETY: kill(2) has no memory-safety preconditions; the pid was checked to be our VMM a moment ago.
    unsafe {
        libc::kill(raw, libc::SIGKILL);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while running(pid, ticks) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills the VMM process of `vm` if it still runs (same pid and start time).
pub fn kill_vm_process(vm: &VmHandle) {
    if running(vm.pid, Some(vm.start_ticks)) {
        tracing::info!(pid = vm.pid, "killing leftover VMM process");
        sigkill_and_wait(vm.pid, Some(vm.start_ticks));
    }
}

/// Kills every process named by a `*.pid` file in `dir` whose command line mentions `dir` (so a reused pid of
/// an unrelated process is left alone).
pub fn kill_dir_processes(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let needle = dir.as_os_str().as_encoded_bytes();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "pid") {
            continue;
        }
        let Some(pid) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        if running(pid, None) && cmdline.windows(needle.len()).any(|w| w == needle) {
            tracing::info!(pid, dir = %dir.display(), "killing VMM process of an unowned sandbox directory");
            sigkill_and_wait(pid, None);
        }
    }
}

/// Brings the state database and the sandboxes directory in line with what is really running.
pub async fn recover(svc: &Arc<Sandboxes>) -> Result<(), ServiceError> {
    let rows = svc.db().list()?;
    let mut adopting = Vec::new();
    for row in rows {
        match row.state {
            SandboxState::Creating | SandboxState::Stopping => {
                tracing::info!(sandbox = %row.id, state = row.state.as_str(), "rolling back an interrupted operation");
                svc.teardown(&row.id, row.handle.as_ref()).await;
                svc.db().delete(&row.id)?;
            }
            SandboxState::Failed => svc.teardown(&row.id, row.handle.as_ref()).await,
            SandboxState::Running => {
                let svc = svc.clone();
                adopting.push(tokio::spawn(async move { adopt_one(&svc, row).await }));
            }
            SandboxState::Pausing => {
                let svc = svc.clone();
                adopting.push(tokio::spawn(async move { finish_pause(&svc, row).await }));
            }
            SandboxState::Resuming => {
                let svc = svc.clone();
                adopting.push(tokio::spawn(async move { finish_resume(&svc, row).await }));
            }
            SandboxState::Paused => {
                let dir = svc.settings().paths.sandbox_dir(&row.id);
                snapshot::remove_temporaries(&dir);
                kill_dir_processes(&dir);
            }
        }
    }
    for task in adopting {
        if let Ok(Err(e)) = task.await {
            tracing::warn!(error = %e, "adoption");
        }
    }
    remove_orphans(svc)?;
    remove_orphan_snapshots(svc)?;
    snapshot::remove_temporaries(&svc.settings().paths.user_templates_dir());
    reconcile_usage(svc)?;
    Ok(())
}

/// After recovery: lets the VMM driver remove what it keeps outside run directories (VMs'
/// cgroups) for every VM the daemon does not run, like the network sweep does for namespaces.
pub async fn sweep_vmm(svc: &Sandboxes) {
    let live: Vec<VmHandle> = match svc.db().list() {
        Ok(rows) => rows
            .into_iter()
            .filter_map(|r| r.handle)
            .filter(|h| h.kind == svc.vmm.kind() && svc.vmm.is_alive(h))
            .collect(),
        Err(e) => {
            tracing::warn!(error = %e, "cannot list sandboxes; VMM sweep skipped");
            return;
        }
    };
    svc.vmm.sweep(&live).await;
}

/// A pause interrupted by the restart: a complete, valid snapshot means the pause happened (commit it);
/// otherwise the VM keeps running if it still does, else the sandbox failed.
async fn finish_pause(svc: &Arc<Sandboxes>, row: SandboxRow) -> Result<(), ServiceError> {
    let dir = svc.settings().paths.sandbox_dir(&row.id);
    snapshot::remove_temporaries(&dir);
    let snap = dir.join(PAUSED_DIR);
    let kind = svc.vmm.kind();
    let snap2 = snap.clone();
    let verified = tokio::task::spawn_blocking(move || snapshot::verify(&snap2, kind))
        .await
        .map_err(|e| ServiceError::Internal(format!("verify task: {e}")))?;
    match verified {
        Ok(manifest) => {
            if let Some(h) = &row.handle {
                let _ = svc.vmm.stop(h).await;
                kill_vm_process(h);
            }
            let paused = PausedState {
                dir: PAUSED_DIR.to_string(),
                size_bytes: manifest.size_bytes(),
                info: manifest.info,
            };
            svc.db().commit_pause(&row.id, &paused)?;
            tracing::info!(sandbox = %row.id, "finished a pause interrupted by the restart");
            Ok(())
        }
        Err(e) => {
            if snap.exists() {
                tracing::warn!(sandbox = %row.id, error = %e, "discarding an incomplete pause snapshot");
                let _ = std::fs::remove_dir_all(&snap);
            }
            svc.db()
                .transition(&row.id, SandboxState::Pausing, SandboxState::Running)?;
            let alive = row
                .handle
                .as_ref()
                .is_some_and(|h| h.kind == svc.vmm.kind() && svc.vmm.is_alive(h));
            if alive {
                // The VMM may have stopped the guest for the capture we did not see finish: do the pause
                // again (the guest's disks were flushed before `pausing` was recorded). If that fails, the
                // driver lets the guest run again and the sandbox is adopted as running.
                // The VMM may still be writing the interrupted capture (it does not need us for that): a new
                // one is refused until it is done, so try again for a while.
                let deadline = Instant::now() + REDO_PAUSE_FOR;
                loop {
                    match svc.pause_now(&row.id).await {
                        Ok(_) => {
                            tracing::info!(sandbox = %row.id, "finished a pause interrupted by the restart (captured again)");
                            return Ok(());
                        }
                        Err(e) => {
                            tracing::warn!(sandbox = %row.id, error = %e, "redoing an interrupted pause failed")
                        }
                    }
                    let running = svc
                        .db()
                        .get(&row.id)?
                        .is_some_and(|r| r.state == SandboxState::Running);
                    if !running {
                        return Ok(());
                    }
                    let alive = row.handle.as_ref().is_some_and(|h| svc.vmm.is_alive(h));
                    if !alive || Instant::now() >= deadline {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
            tracing::info!(sandbox = %row.id, "rolled an interrupted pause back to running");
            adopt_one(
                svc,
                SandboxRow {
                    state: SandboxState::Running,
                    ..row
                },
            )
            .await
        }
    }
}

/// A resume interrupted by the restart: a restored VM that runs is adopted (the resume completes); otherwise
/// the sandbox goes back to `paused` with its snapshot.
async fn finish_resume(svc: &Arc<Sandboxes>, row: SandboxRow) -> Result<(), ServiceError> {
    let dir = svc.settings().paths.sandbox_dir(&row.id);
    if let Some(h) = row
        .handle
        .clone()
        .filter(|h| h.kind == svc.vmm.kind() && svc.vmm.is_alive(h))
        && let Ok(client) = svc.connect_agent_until(&h, Instant::now() + ADOPT_CONNECT).await
    {
        let _ = crate::service::pause::guest_after_restore(&client, &row.id, None).await;
        let end =
            crate::service::now_ms().saturating_add(i64::try_from(row.timeout_s * 1000).unwrap_or(i64::MAX));
        svc.db().commit_resume(&row.id, &h, end)?;
        svc.set_live(Arc::new(Live::new(
            row.id.clone(),
            h,
            row.env.clone(),
            Some(client),
        )));
        let _ = std::fs::remove_dir_all(dir.join(PAUSED_DIR));
        tracing::info!(sandbox = %row.id, "finished a resume interrupted by the restart");
        return Ok(());
    }
    if let Some(h) = &row.handle {
        let _ = svc.vmm.stop(h).await;
        kill_vm_process(h);
    }
    kill_dir_processes(&dir);
    svc.db().clear_handle(&row.id)?;
    svc.db()
        .transition(&row.id, SandboxState::Resuming, SandboxState::Paused)?;
    tracing::info!(sandbox = %row.id, "rolled an interrupted resume back to paused");
    Ok(())
}

/// Removes snapshot directories that no row owns (a checkpoint interrupted between the rename and the
/// insert) and interrupted writes.
fn remove_orphan_snapshots(svc: &Sandboxes) -> Result<(), ServiceError> {
    let dir = svc.settings().paths.snapshots_dir();
    snapshot::remove_temporaries(&dir);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let owned = match name.to_str() {
            Some(id) if hearth_api::is_valid_snapshot_id(id) => svc.db().get_snapshot(id)?.is_some(),
            _ => false,
        };
        if !owned {
            tracing::info!(path = %entry.path().display(), "removing unowned snapshot directory");
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
    Ok(())
}

/// Makes the open usage interval of every sandbox match its state (a restart may have come between a state
/// change and its usage record).
fn reconcile_usage(svc: &Sandboxes) -> Result<(), ServiceError> {
    let now = crate::service::now_ms();
    let rows = svc.db().list()?;
    for row in &rows {
        let kind = match row.state {
            SandboxState::Running | SandboxState::Pausing | SandboxState::Resuming => {
                Some(UsageKind::Running)
            }
            SandboxState::Paused => Some(UsageKind::Paused),
            SandboxState::Creating | SandboxState::Stopping | SandboxState::Failed => None,
        };
        svc.db()
            .usage_switch(&row.id, kind, now, row.vcpus, row.memory_mib)?;
    }
    for id in svc.db().usage_open_ids()? {
        if !rows.iter().any(|r| r.id == id) {
            svc.db().usage_switch(&id, None, now, 0, 0)?;
        }
    }
    Ok(())
}

async fn adopt_one(svc: &Sandboxes, row: SandboxRow) -> Result<(), ServiceError> {
    let vm = match &row.handle {
        Some(h) if h.kind == svc.vmm.kind() && svc.vmm.is_alive(h) => h.clone(),
        Some(h) if h.kind != svc.vmm.kind() => {
            return svc
                .fail(
                    &row.id,
                    &format!("daemon restarted with another VMM than {}", h.kind.as_str()),
                )
                .await;
        }
        _ => {
            return svc
                .fail(&row.id, "VM process is gone (found after a daemon restart)")
                .await;
        }
    };
    // A checkpoint or fork interrupted by the restart may have left the vCPUs stopped.
    match svc.vmm.continue_if_stopped(&vm).await {
        Ok(true) => {
            tracing::info!(sandbox = %row.id, "continued a VM an interrupted checkpoint left stopped")
        }
        Ok(false) => {}
        Err(e) => tracing::warn!(sandbox = %row.id, error = %e, "cannot tell whether the VM runs"),
    }
    match svc.connect_agent_until(&vm, Instant::now() + ADOPT_CONNECT).await {
        Ok(client) => {
            svc.set_live(Arc::new(Live::new(
                row.id.clone(),
                vm,
                row.env.clone(),
                Some(client),
            )));
            tracing::info!(sandbox = %row.id, "adopted running sandbox");
            Ok(())
        }
        Err(e) => {
            svc.fail(&row.id, &format!("agent unreachable after a daemon restart: {e}"))
                .await
        }
    }
}

/// Removes sandbox directories that no row owns (and kills any VMM process running from one).
fn remove_orphans(svc: &Sandboxes) -> Result<(), ServiceError> {
    let dir = svc.settings().paths.sandboxes_dir();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let owned = match name.to_str() {
            Some(id) if hearth_api::is_valid_sandbox_id(id) => svc.db().get(id)?.is_some(),
            _ => false,
        };
        if owned {
            continue;
        }
        let path = entry.path();
        tracing::info!(path = %path.display(), "removing unowned sandbox directory");
        kill_dir_processes(&path);
        let removed = if path.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        if let Err(e) = removed {
            tracing::warn!(path = %path.display(), error = %e, "could not remove");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kills_only_processes_that_name_the_directory() -> Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let marker = dir.path().join("marker");
        // A process whose command line mentions the directory, and one that does not.
        std::fs::write(&marker, b"")?;
        let mut mine = std::process::Command::new("tail")
            .arg("-f")
            .arg(&marker)
            .spawn()?;
        let mut other = std::process::Command::new("sleep").arg("30").spawn()?;
        std::fs::write(dir.path().join("vmm.pid"), format!("{}\n", mine.id()))?;
        std::fs::write(dir.path().join("other.pid"), format!("{}\n", other.id()))?;
        // Until the child has exec'd, its command line is still this test's (a loaded machine can take a while).
        let needle = marker.as_os_str().as_encoded_bytes().to_vec();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !std::fs::read(format!("/proc/{}/cmdline", mine.id()))
            .is_ok_and(|c| c.windows(needle.len()).any(|w| w == needle))
        {
            assert!(std::time::Instant::now() < deadline, "tail never exec'd");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        kill_dir_processes(dir.path());
        let status = mine.wait()?;
        assert!(!status.success());
        assert!(other.try_wait()?.is_none(), "unrelated process must survive");
        other.kill()?;
        other.wait()?;
        Ok(())
    }

    #[test]
    fn proc_stat_of_self() {
        let me = std::process::id();
        let (state, ticks) = proc_stat(me).unwrap_or(('?', 0));
        assert!(matches!(state, 'R' | 'S'));
        assert_eq!(Some(ticks), hearth_vmm::process_start_ticks(me));
    }
}
