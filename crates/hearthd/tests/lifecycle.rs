//! In-process lifecycle tests with a fake VMM whose "VM" is a real child process (`sleep`) and whose agent is a
//! small in-test implementation of the protocol. They check create → running → command, the health watcher
//! (dead VM process, agent channel gone for good), the TTL reaper, and that teardown kills the VM process.

mod fake;

use std::time::Duration;

use fake::*;
use hearth_api::{RunCommandRequest, SandboxState};
use hearth_vmm::Vmm;

#[tokio::test]
async fn create_run_and_destroy_kills_the_vm_process() {
    let f = fixture(10);
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    assert_eq!(sbx.state, SandboxState::Running);
    let row = f.svc.db().get(&sbx.id).expect("get").expect("row");
    let handle = row.handle.expect("handle recorded");
    assert!(f.vmm.is_alive(&handle));
    let req = RunCommandRequest {
        cmd: Some("echo".into()),
        ..Default::default()
    };
    let r = f.svc.run_command(&sbx.id, &req).await.expect("run");
    assert_eq!((r.exit_code, r.stdout.as_str()), (0, "ran echo with FOO=bar\n"));
    f.svc.destroy(&sbx.id, "test").await.expect("destroy");
    assert!(!f.vmm.is_alive(&handle));
    assert!(f.svc.db().get(&sbx.id).expect("get").is_none());
    assert!(!f.svc.settings().paths.sandbox_dir(&sbx.id).exists());
}

#[tokio::test]
async fn watcher_fails_a_sandbox_whose_vm_died() {
    let f = fixture(10);
    tokio::spawn(hearthd::reaper::watcher(f.svc.clone()));
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    let handle = f
        .svc
        .db()
        .get(&sbx.id)
        .expect("get")
        .and_then(|r| r.handle)
        .expect("handle");
    f.vmm
        .stop(&handle)
        .await
        .expect("kill the VM behind the daemon's back");
    let svc = f.svc.clone();
    let id = sbx.id.clone();
    assert!(
        wait_for(
            move || svc.get(&id).is_ok_and(|s| s.state == SandboxState::Failed),
            10
        )
        .await
    );
    let s = f.svc.get(&sbx.id).expect("get");
    assert!(
        s.error
            .as_deref()
            .is_some_and(|e| e.contains("VM process exited") && e.contains("; its log: ")),
        "{:?}",
        s.error
    );
    assert!(
        !f.svc.settings().paths.sandbox_dir(&sbx.id).exists(),
        "files of a failed sandbox are removed"
    );
}

#[tokio::test]
async fn watcher_fails_a_sandbox_whose_agent_stops_answering() {
    let f = fixture(10);
    tokio::spawn(hearthd::reaper::watcher(f.svc.clone()));
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    let quiet = f.svc.clone();
    let id = sbx.id.clone();
    // Answering agents keep the sandbox running past the silence limit (3 s here).
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(quiet.get(&id).expect("get").state, SandboxState::Running);
    // The channel stays open but nothing answers: failed once the limit has passed, with the reason.
    f.vmm.mute_pings.store(true, std::sync::atomic::Ordering::SeqCst);
    let started = std::time::Instant::now();
    assert!(
        wait_for(
            move || quiet.get(&id).is_ok_and(|s| s.state == SandboxState::Failed),
            20
        )
        .await
    );
    let took = started.elapsed();
    assert!(
        took >= Duration::from_secs(3),
        "failed after {took:?}, before the limit"
    );
    let s = f.svc.get(&sbx.id).expect("get");
    assert!(
        s.error.as_deref().is_some_and(|e| e.contains("has not answered")),
        "{:?}",
        s.error
    );
}

#[tokio::test]
async fn watcher_fails_a_sandbox_whose_agent_channel_is_gone_for_good() {
    // One connection for create, none after: the channel cannot be re-established.
    let f = fixture(1);
    tokio::spawn(hearthd::reaper::watcher(f.svc.clone()));
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    let handle = f
        .svc
        .db()
        .get(&sbx.id)
        .expect("get")
        .and_then(|r| r.handle)
        .expect("handle");
    f.vmm.cut_agents();
    let svc = f.svc.clone();
    let id = sbx.id.clone();
    assert!(
        wait_for(
            move || svc.get(&id).is_ok_and(|s| s.state == SandboxState::Failed),
            15
        )
        .await
    );
    let s = f.svc.get(&sbx.id).expect("get");
    assert!(
        s.error.as_deref().is_some_and(|e| e.contains("agent channel")),
        "{:?}",
        s.error
    );
    assert!(!f.vmm.is_alive(&handle), "the VM of a failed sandbox is stopped");
}

#[tokio::test]
async fn a_dropped_channel_is_re_established_for_the_next_request() {
    let f = fixture(10);
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    f.vmm.cut_agents();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let req = RunCommandRequest {
        argv: Some(vec!["true".into()]),
        ..Default::default()
    };
    let r = f
        .svc
        .run_command(&sbx.id, &req)
        .await
        .expect("run after reconnect");
    assert_eq!(r.stdout, "ran true with FOO=bar\n");
}

#[tokio::test]
async fn reaper_destroys_expired_sandboxes() {
    let f = fixture(10);
    tokio::spawn(hearthd::reaper::reaper(f.svc.clone()));
    let short = f.svc.create(create_req(1)).await.expect("create");
    let long = f.svc.create(create_req(600)).await.expect("create");
    let handle = f
        .svc
        .db()
        .get(&short.id)
        .expect("get")
        .and_then(|r| r.handle)
        .expect("handle");
    let svc = f.svc.clone();
    let id = short.id.clone();
    assert!(
        wait_for(move || svc.db().get(&id).is_ok_and(|r| r.is_none()), 10).await,
        "TTL did not fire"
    );
    assert!(!f.vmm.is_alive(&handle));
    assert_eq!(
        f.svc.get(&long.id).expect("long one stays").state,
        SandboxState::Running
    );
}

#[tokio::test]
async fn a_vm_that_never_answers_fails_the_create_within_the_deadline() {
    let f = fixture(0);
    let started = tokio::time::Instant::now();
    let err = f.svc.create(create_req(60)).await.expect_err("must fail");
    assert_eq!(err.code(), hearth_api::ErrorCode::VmmFailed);
    assert!(
        err.to_string().contains("guest agent not ready after 5 s"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(9));
    assert!(f.svc.db().list().expect("list").is_empty());
    let children_alive = f
        .vmm
        .children
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter_mut()
        .any(|c| matches!(c.try_wait(), Ok(None)));
    assert!(!children_alive, "the VM process of a failed create is stopped");
}

/// Admission counts vCPUs (up to 8 per host CPU) and is atomic: of more parallel creates than fit, exactly
/// as many as fit pass and the rest get `capacity_exceeded`, naming the vCPUs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn parallel_creates_cannot_pass_the_last_vcpu_slot_together() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u32);
    let max = cpus * hearthd::service::admission::VCPU_OVERCOMMIT as u32;
    let per = max.min(16);
    let fit = (max / per) as usize;
    let f = fixture(fit + 3);
    let req = || hearth_api::CreateSandboxRequest {
        vcpus: Some(per),
        memory_mib: Some(128),
        ..create_req(60)
    };
    let results = futures::future::join_all((0..fit + 3).map(|_| f.svc.create(req()))).await;
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(ok, fit, "{results:?}");
    for r in &results {
        if let Err(e) = r {
            let msg = e.to_string();
            assert!(
                matches!(e, hearthd::service::ServiceError::CapacityExceeded(_)) && msg.contains("vCPUs"),
                "{msg}"
            );
        }
    }
    // A destroyed sandbox gives its vCPUs back.
    let first = results.into_iter().flatten().next().expect("one created");
    f.svc.destroy(&first.id, "test").await.expect("destroy");
    f.svc.create(req()).await.expect("fits again");
}

/// `GET /v1/sandboxes` pages: `limit` sandboxes at a time in id order, a cursor while more match, every
/// sandbox exactly once over all pages, filters (and the caller's project) applied before paging; bad limits and cursors are refused.
#[tokio::test]
async fn listing_pages_through_every_sandbox_once() {
    let f = fixture(10);
    let mut made = Vec::new();
    for _ in 0..5 {
        made.push(f.svc.create(create_req(60)).await.expect("create").id);
    }
    made.sort();
    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    let mut pages = 0;
    loop {
        let mut q = vec![("limit".to_string(), "2".to_string())];
        if let Some(c) = &cursor {
            q.push(("cursor".into(), c.clone()));
        }
        let (page, next) = f.svc.list(&q, None).expect("page");
        pages += 1;
        assert!(page.len() <= 2);
        seen.extend(page.into_iter().map(|s| s.id));
        match next {
            Some(c) => cursor = Some(c),
            None => break,
        }
    }
    assert_eq!((pages, &seen), (3, &made));
    // Filters apply before paging: one sandbox in state paused, whatever the limit.
    f.svc.pause(&made[3]).await.expect("pause");
    let (page, next) = f
        .svc
        .list(
            &[("state".into(), "paused".into()), ("limit".into(), "1".into())],
            None,
        )
        .expect("filtered");
    assert_eq!((page.len(), next), (1, None));
    assert_eq!(page[0].id, made[3]);
    // So does a project: a page of 2 of project b's holds 2 of its sandboxes even though project a owns the
    // first ids.
    for (i, id) in made.iter().enumerate() {
        let project = if i < 2 { "a" } else { "b" };
        f.svc
            .db()
            .set_owner("sandbox", id, &[id], project)
            .expect("owner");
    }
    let limit = [("limit".to_string(), "2".to_string())];
    let (page, next) = f.svc.list(&limit, Some("b")).expect("project page");
    let ids: Vec<String> = page.into_iter().map(|s| s.id).collect();
    assert_eq!(ids, made[2..4].to_vec());
    assert_eq!(next.as_deref(), Some(made[3].as_str()));
    let (page, _) = f.svc.list(&[], Some("c")).expect("empty project");
    assert!(page.is_empty());
    for bad in [
        ("limit", "0"),
        ("limit", "1001"),
        ("limit", "x"),
        ("cursor", "../x"),
    ] {
        let err = f
            .svc
            .list(&[(bad.0.into(), bad.1.into())], None)
            .expect_err("refused");
        assert!(
            matches!(err, hearthd::service::ServiceError::InvalidArgument(_)),
            "{bad:?}: {err}"
        );
    }
}
