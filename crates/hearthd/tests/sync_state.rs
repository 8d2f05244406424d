//! In-process disk-sync tests with the fake VMM (`fake/`), daemon without a storage bucket: the typed errors a
//! sync and a recreate get, and the validation of `disk_sync_interval_s`. The sync itself, with real VMs and a
//! real S3 server, is in `disk_sync.rs`.

mod fake;

use fake::*;
use hearth_api::{CreateSandboxRequest, ErrorCode};

#[tokio::test]
async fn without_storage_sync_is_a_typed_error_and_bad_intervals_are_refused() {
    let f = fixture(20);
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    assert_eq!(sbx.disk_sync_interval_s, None);

    let e = f.svc.sync_disk(&sbx.id).await.expect_err("no bucket");
    assert_eq!(e.code(), ErrorCode::StorageNotConfigured, "{e}");
    assert_eq!(e.code().http_status(), 409);
    assert!(e.to_string().contains("--storage"), "{e}");
    // The sandbox is untouched.
    assert_eq!(
        f.svc.get(&sbx.id).expect("get").state,
        hearth_api::SandboxState::Running
    );
    let e = f
        .svc
        .sync_disk("sbx_0000000000000000")
        .await
        .expect_err("unknown");
    assert_eq!(e.code(), ErrorCode::NotFound);

    for bad in [0, 59, 86_401, u64::MAX] {
        let req = CreateSandboxRequest {
            disk_sync_interval_s: Some(bad),
            ..create_req(60)
        };
        let e = f.svc.create(req).await.expect_err("bad interval");
        assert_eq!(e.code(), ErrorCode::InvalidArgument, "{bad}: {e}");
        assert!(e.to_string().contains("disk_sync_interval_s"), "{e}");
    }
    let req = CreateSandboxRequest {
        disk_sync_interval_s: Some(60),
        ..create_req(60)
    };
    let e = f.svc.create(req).await.expect_err("no bucket");
    assert_eq!(e.code(), ErrorCode::StorageNotConfigured, "{e}");

    // A recreate from a sandbox that was never synced, or from one that does not exist.
    let req = CreateSandboxRequest {
        from_sync: Some(sbx.id.clone()),
        ..create_req(60)
    };
    let e = f.svc.create(req).await.expect_err("never synced");
    assert_eq!(e.code(), ErrorCode::NoDiskSync, "{e}");
    assert_eq!(e.code().http_status(), 404);
    let req = CreateSandboxRequest {
        from_sync: Some("sbx_0000000000000000".into()),
        ..create_req(60)
    };
    let e = f.svc.create(req).await.expect_err("no such sandbox");
    assert_eq!(e.code(), ErrorCode::NotFound, "{e}");
    let req = CreateSandboxRequest {
        from_sync: Some(sbx.id.clone()),
        snapshot: Some("snp_0000000000000000".into()),
        ..create_req(60)
    };
    let e = f.svc.create(req).await.expect_err("both");
    assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
    assert_eq!(
        f.svc.list(&[], None).expect("list").0.len(),
        1,
        "nothing was created"
    );
}
