//! In-process fork and snapshot-object tests with the fake VMM (`fake/`): a fork of 3 restores 3 children
//! from one checkpoint while the parent keeps running, lineage is recorded, a snapshot backing live disks
//! cannot be deleted, a corrupted snapshot is refused before any restore, and bad counts are refused.

mod fake;

use std::sync::atomic::Ordering;

use fake::*;
use hearth_api::{CreateSandboxRequest, ErrorCode, SandboxState};
use hearth_vmm::Vmm;

#[tokio::test]
async fn fork_snapshots_and_their_deletion_rules() {
    let f = fixture(40);
    let parent = f.svc.create(create_req(60)).await.expect("create");
    let parent_vm = f
        .svc
        .db()
        .get(&parent.id)
        .expect("db")
        .and_then(|r| r.handle)
        .expect("handle");

    for bad in [0, 17] {
        let e = f.svc.fork(&parent.id, bad).await.expect_err("bad count");
        assert_eq!(e.code(), ErrorCode::InvalidArgument);
    }
    let forked = f.svc.fork(&parent.id, 3).await.expect("fork");
    assert_eq!(forked.sandboxes.len(), 3);
    assert_eq!(f.vmm.restores.load(Ordering::SeqCst), 3);
    assert!(f.vmm.is_alive(&parent_vm), "the parent keeps running");
    assert_eq!(
        f.svc.get(&parent.id).expect("parent").state,
        SandboxState::Running
    );
    let mut ids: Vec<_> = forked.sandboxes.iter().map(|s| s.id.clone()).collect();
    ids.dedup();
    assert_eq!(ids.len(), 3);
    for c in &forked.sandboxes {
        assert_eq!(c.parent_id.as_deref(), Some(parent.id.as_str()));
        assert_eq!(c.snapshot_id.as_deref(), Some(forked.snapshot_id.as_str()));
        assert_eq!(c.state, SandboxState::Running);
        // The parent's environment came along.
        let r = f
            .svc
            .run_command(
                &c.id,
                &hearth_api::RunCommandRequest {
                    cmd: Some("env".into()),
                    ..Default::default()
                },
            )
            .await
            .expect("run in child");
        assert!(r.stdout.contains("FOO=bar"), "{r:?}");
    }
    let snaps = f.svc.list_snapshots().expect("list");
    assert_eq!(snaps.len(), 1);
    assert_eq!(snaps[0].sandbox_id, parent.id);
    assert!(snaps[0].size_bytes > 0);
    let u = f.svc.sandbox_usage(&parent.id).expect("usage");
    assert_eq!(
        u.snapshot_bytes, snaps[0].size_bytes,
        "the parent's usage counts its snapshot"
    );

    // In use: refused; once the children are gone: deleted with its files.
    let e = f
        .svc
        .delete_snapshot(&forked.snapshot_id)
        .await
        .expect_err("in use");
    assert_eq!(e.code(), ErrorCode::Conflict);
    for c in &forked.sandboxes {
        f.svc.destroy(&c.id, "test").await.expect("destroy child");
    }
    // A new sandbox from the snapshot, then a checkpoint object of its own.
    let req = CreateSandboxRequest {
        snapshot: Some(forked.snapshot_id.clone()),
        ..Default::default()
    };
    let from = f.svc.create(req).await.expect("create from snapshot");
    assert_eq!(from.parent_id, None);
    let own = f.svc.checkpoint(&from.id).await.expect("checkpoint");
    assert_eq!(own.sandbox_id, from.id);
    f.svc.destroy(&from.id, "test").await.expect("destroy");
    f.svc.delete_snapshot(&forked.snapshot_id).await.expect("delete");
    assert!(!f.svc.settings().paths.snapshot_dir(&forked.snapshot_id).exists());
    assert_eq!(
        f.svc
            .delete_snapshot(&forked.snapshot_id)
            .await
            .expect_err("gone")
            .code(),
        ErrorCode::NotFound
    );

    // A corrupted snapshot is refused before the VMM restores anything.
    let disk = f.svc.settings().paths.snapshot_dir(&own.id).join("disk");
    std::fs::write(&disk, b"disk copz").expect("corrupt");
    let before = f.vmm.restores.load(Ordering::SeqCst);
    let req = CreateSandboxRequest {
        snapshot: Some(own.id.clone()),
        ..Default::default()
    };
    let e = f.svc.create(req).await.expect_err("corrupt");
    assert_eq!(e.code(), ErrorCode::SnapshotCorrupt, "{e}");
    assert_eq!(f.vmm.restores.load(Ordering::SeqCst), before);
    let req = CreateSandboxRequest {
        snapshot: Some("snp_0000000000000000".into()),
        ..Default::default()
    };
    assert_eq!(
        f.svc.create(req).await.expect_err("unknown").code(),
        ErrorCode::NotFound
    );
}
