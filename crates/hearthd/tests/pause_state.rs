//! In-process pause/resume tests with the fake VMM (`fake/`): the state machine, auto-resume, the manifest
//! check before a restore, a failed capture, usage intervals, the TTL's `on_timeout: pause`, and recovery of
//! a pause or resume interrupted by a daemon restart.

mod fake;

use std::sync::atomic::Ordering;
use std::time::Duration;

use fake::*;
use hearth_api::{CreateSandboxRequest, ErrorCode, OnTimeout, RunCommandRequest, SandboxState};
use hearth_vmm::Vmm;
use hearthd::service::pause::PAUSED_DIR;

fn echo() -> RunCommandRequest {
    RunCommandRequest {
        cmd: Some("echo".into()),
        ..Default::default()
    }
}

#[tokio::test]
async fn pause_leaves_only_files_and_a_command_resumes() {
    let f = fixture(20);
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    let handle = f
        .svc
        .db()
        .get(&sbx.id)
        .expect("db")
        .and_then(|r| r.handle)
        .expect("handle");
    let paused = f.svc.pause(&sbx.id).await.expect("pause");
    assert_eq!(paused.state, SandboxState::Paused);
    assert!(!f.vmm.is_alive(&handle), "no VM process while paused");
    let row = f.svc.db().get(&sbx.id).expect("db").expect("row");
    assert!(row.handle.is_none());
    let snap = f.svc.settings().paths.sandbox_dir(&sbx.id).join(PAUSED_DIR);
    assert!(snap.join("manifest.json").is_file());
    assert_eq!(
        row.paused.map(|p| p.size_bytes),
        Some(256 * 1024 + "pid ".len() as u64 + handle.pid.to_string().len() as u64)
    );
    // Pausing again is a no-op; the list shows the state.
    assert_eq!(
        f.svc.pause(&sbx.id).await.expect("pause again").state,
        SandboxState::Paused
    );
    let (listed, _) = f
        .svc
        .list(&[("state".into(), "paused".into())], None)
        .expect("list");
    assert_eq!(listed.len(), 1);
    // A command wakes it.
    let r = f
        .svc
        .run_command(&sbx.id, &echo())
        .await
        .expect("run after pause");
    assert_eq!(r.exit_code, 0);
    assert_eq!(f.vmm.restores.load(Ordering::SeqCst), 1);
    let row = f.svc.db().get(&sbx.id).expect("db").expect("row");
    assert_eq!(row.state, SandboxState::Running);
    let new = row.handle.expect("new handle");
    assert!(f.vmm.is_alive(&new) && new.pid != handle.pid);
    // Removed in the background once the resume is committed (the answer does not wait for it).
    assert!(
        wait_for(|| !snap.exists(), 10).await,
        "the snapshot is removed once the resume is committed"
    );
    let u = f.svc.sandbox_usage(&sbx.id).expect("usage");
    assert!(u.running_seconds > 0.0 && u.paused_seconds > 0.0, "{u:?}");
    assert_eq!(u.snapshot_bytes, 0);
    f.svc.destroy(&sbx.id, "test").await.expect("destroy");
}

#[tokio::test]
async fn auto_resume_false_refuses_guest_calls_until_resumed() {
    let f = fixture(20);
    let req = CreateSandboxRequest {
        auto_resume: Some(false),
        ..create_req(60)
    };
    let sbx = f.svc.create(req).await.expect("create");
    assert!(!sbx.auto_resume);
    f.svc.pause(&sbx.id).await.expect("pause");
    let e = f
        .svc
        .run_command(&sbx.id, &echo())
        .await
        .expect_err("must refuse");
    assert_eq!(e.code(), ErrorCode::Conflict);
    assert!(e.to_string().contains("auto_resume false"), "{e}");
    assert_eq!(f.vmm.restores.load(Ordering::SeqCst), 0);
    assert_eq!(
        f.svc.resume(&sbx.id).await.expect("resume").state,
        SandboxState::Running
    );
    assert_eq!(
        f.svc.resume(&sbx.id).await.expect("resume again").state,
        SandboxState::Running
    );
    f.svc.run_command(&sbx.id, &echo()).await.expect("run");
}

#[tokio::test]
async fn a_corrupt_snapshot_is_refused_before_the_vmm_sees_it() {
    let f = fixture(20);
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    f.svc.pause(&sbx.id).await.expect("pause");
    let mem = f
        .svc
        .settings()
        .paths
        .sandbox_dir(&sbx.id)
        .join(PAUSED_DIR)
        .join("memory");
    let good = std::fs::read(&mem).expect("read");
    // Truncated.
    std::fs::write(&mem, &good[..1000]).expect("truncate");
    let e = f.svc.resume(&sbx.id).await.expect_err("truncated");
    assert_eq!(e.code(), ErrorCode::SnapshotCorrupt);
    assert!(e.to_string().contains("memory has 1000 bytes"), "{e}");
    // Same size, one byte altered.
    let mut bad = good.clone();
    bad[12345] ^= 1;
    std::fs::write(&mem, &bad).expect("alter");
    let e = f.svc.resume(&sbx.id).await.expect_err("altered");
    assert_eq!(e.code(), ErrorCode::SnapshotCorrupt);
    assert!(e.to_string().contains("checksum"), "{e}");
    assert_eq!(f.vmm.restores.load(Ordering::SeqCst), 0, "the VMM never saw it");
    assert_eq!(f.svc.get(&sbx.id).expect("get").state, SandboxState::Paused);
    // Put right, it resumes.
    std::fs::write(&mem, &good).expect("repair");
    assert_eq!(
        f.svc.resume(&sbx.id).await.expect("resume").state,
        SandboxState::Running
    );
}

#[tokio::test]
async fn a_failed_capture_keeps_the_sandbox_running() {
    let f = fixture(20);
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    f.vmm.fail_snapshot.store(true, Ordering::SeqCst);
    let e = f.svc.pause(&sbx.id).await.expect_err("must fail");
    assert_eq!(e.code(), ErrorCode::VmmFailed);
    assert!(
        e.to_string().contains("keeps running") && e.to_string().contains("No space left"),
        "{e}"
    );
    let row = f.svc.db().get(&sbx.id).expect("db").expect("row");
    assert_eq!(row.state, SandboxState::Running);
    assert!(f.vmm.is_alive(&row.handle.expect("handle")));
    let dir = f.svc.settings().paths.sandbox_dir(&sbx.id);
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .expect("dir")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("paused"))
        .collect();
    assert!(leftovers.is_empty(), "no temporary snapshot left: {leftovers:?}");
    f.svc.run_command(&sbx.id, &echo()).await.expect("still usable");
    f.vmm.fail_snapshot.store(false, Ordering::SeqCst);
    f.svc.pause(&sbx.id).await.expect("pause now works");
}

#[tokio::test]
async fn ttl_with_on_timeout_pause_pauses_and_keeps_the_sandbox() {
    let f = fixture(20);
    tokio::spawn(hearthd::reaper::reaper(f.svc.clone()));
    let req = CreateSandboxRequest {
        on_timeout: Some(OnTimeout::Pause),
        ..create_req(1)
    };
    let sbx = f.svc.create(req).await.expect("create");
    assert_eq!(sbx.on_timeout, OnTimeout::Pause);
    let svc = f.svc.clone();
    let id = sbx.id.clone();
    let paused = move || svc.get(&id).map(|s| s.state).ok() == Some(SandboxState::Paused);
    assert!(wait_for(paused, 10).await, "the TTL paused it");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        f.svc.get(&sbx.id).expect("still there").state,
        SandboxState::Paused
    );
}

#[tokio::test]
async fn restart_finishes_or_rolls_back_interrupted_pauses_and_resumes() {
    let f = fixture(40);
    // A: the snapshot was complete when the daemon died → paused.
    let a = f.svc.create(create_req(60)).await.expect("create a");
    f.svc.pause(&a.id).await.expect("pause a");
    f.svc
        .db()
        .set_state(&a.id, SandboxState::Pausing, None)
        .expect("set");
    // B: only a temporary directory was written and the VM still runs → the pause is done again.
    let b = f.svc.create(create_req(60)).await.expect("create b");
    f.svc
        .db()
        .set_state(&b.id, SandboxState::Pausing, None)
        .expect("set");
    let b_dir = f.svc.settings().paths.sandbox_dir(&b.id);
    std::fs::create_dir(b_dir.join(".tmp-paused-0123")).expect("tmp");
    std::fs::write(b_dir.join(".tmp-paused-0123/memory"), b"half").expect("half");
    // C: a resume died before its VM ran → paused again, snapshot intact.
    let c = f.svc.create(create_req(60)).await.expect("create c");
    f.svc.pause(&c.id).await.expect("pause c");
    f.svc
        .db()
        .set_state(&c.id, SandboxState::Resuming, None)
        .expect("set");

    let svc = f.restart();
    hearthd::adopt::recover(&svc).await.expect("recover");
    assert_eq!(svc.get(&a.id).expect("a").state, SandboxState::Paused);
    assert_eq!(svc.get(&b.id).expect("b").state, SandboxState::Paused);
    assert!(!b_dir.join(".tmp-paused-0123").exists());
    assert_eq!(svc.get(&c.id).expect("c").state, SandboxState::Paused);
    // All three are usable.
    for id in [&a.id, &b.id, &c.id] {
        let r = svc.run_command(id, &echo()).await.expect("run after restart");
        assert_eq!(r.exit_code, 0);
    }
    let u = svc.usage(None, None).expect("usage");
    assert_eq!(u.sandboxes.len(), 3);

    // D: an interrupted pause that cannot be captured again while its VM runs → running, adopted.
    let d = svc.create(create_req(60)).await.expect("create d");
    svc.db()
        .set_state(&d.id, SandboxState::Pausing, None)
        .expect("set");
    f.vmm.fail_snapshot.store(true, Ordering::SeqCst);
    let svc = f.restart();
    hearthd::adopt::recover(&svc).await.expect("recover");
    assert_eq!(svc.get(&d.id).expect("d").state, SandboxState::Running);
    let r = svc.run_command(&d.id, &echo()).await.expect("run in d");
    assert_eq!(r.exit_code, 0);
}
