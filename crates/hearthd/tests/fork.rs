//! Real-VM fork and snapshot tests (QEMU TCG, `minimal`): a fork of 3 gives children with the parent's files
//! and processes that diverge independently, with distinct entropy, hostnames and machine-ids; the parent
//! keeps running; a snapshot object starts a new sandbox and cannot be deleted while that sandbox lives.

mod common;

use std::collections::HashSet;

use common::{Daemon, VM_LOCK};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_of_three_and_snapshot_objects() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let parent = d
        .create(json!({"template": "minimal", "memory_mib": 256}))
        .await
        .id;
    assert_eq!(
        d.sh(&parent, "echo from-parent > /root/parent-file")
            .await
            .exit_code,
        0
    );
    let (status, v) = d
        .run_raw(&parent, json!({"cmd": "sleep 100000", "background": true}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{v}");
    let sleeper = v["pid"].as_u64().expect("pid");

    let (status, v) = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{parent}/fork"),
            Some(json!({"count": 3})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "fork: {v}\n{}", d.log());
    let snap = v["snapshot_id"].as_str().expect("snapshot id").to_string();
    let children: Vec<String> = v["sandboxes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["id"].as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    assert_eq!(children.len(), 3, "{v}");
    for c in v["sandboxes"].as_array().into_iter().flatten() {
        assert_eq!(c["parent_id"], Value::String(parent.clone()));
        assert_eq!(c["state"], "running");
    }
    let (_, p) = d.get(&parent).await;
    assert_eq!(p["state"], "running", "the parent keeps running");

    let mut random = HashSet::new();
    let mut hostnames = HashSet::new();
    let mut machine_ids = HashSet::new();
    for (i, c) in children.iter().enumerate() {
        assert_eq!(d.sh(c, "cat /root/parent-file").await.stdout, "from-parent\n");
        let r = d.sh(c, &format!("kill -0 {sleeper} && echo alive")).await;
        assert_eq!(r.stdout, "alive\n", "parent's process in child {c}: {r:?}");
        assert_eq!(
            d.sh(c, &format!("echo {i} > /root/child-file")).await.exit_code,
            0
        );
        let r = d
            .sh(c, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
            .await;
        assert_eq!(r.stdout.len(), 64, "{r:?}");
        random.insert(r.stdout);
        hostnames.insert(d.sh(c, "hostname").await.stdout);
        machine_ids.insert(d.sh(c, "cat /etc/machine-id").await.stdout);
    }
    assert_eq!(random.len(), 3, "urandom must differ between children");
    assert_eq!(hostnames.len(), 3, "{hostnames:?}");
    assert_eq!(machine_ids.len(), 3, "{machine_ids:?}");
    // Each child sees only its own write; the parent sees none.
    for (i, c) in children.iter().enumerate() {
        assert_eq!(d.sh(c, "cat /root/child-file").await.stdout, format!("{i}\n"));
    }
    assert_ne!(d.sh(&parent, "cat /root/child-file").await.exit_code, 0);

    // The fork's snapshot backs the children's disks: deleting it is refused until they are gone.
    let (status, v) = d
        .call(Method::DELETE, &format!("/v1/snapshots/{snap}"), None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    for c in &children {
        d.destroy(c).await;
    }
    let (status, v) = d
        .call(Method::DELETE, &format!("/v1/snapshots/{snap}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{v}");

    // A snapshot object of the parent starts a new sandbox with its state.
    let (status, s) = d
        .call(Method::POST, &format!("/v1/sandboxes/{parent}/snapshots"), None)
        .await;
    assert_eq!(status, StatusCode::CREATED, "{s}\n{}", d.log());
    let snap = s["id"].as_str().expect("id").to_string();
    let (status, list) = d.call(Method::GET, "/v1/snapshots", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["snapshots"][0]["id"], Value::String(snap.clone()));
    assert_eq!(
        d.sh(&parent, "echo after-snapshot > /root/later").await.exit_code,
        0
    );
    let from = d.create(json!({"snapshot": snap})).await.id;
    assert_eq!(d.sh(&from, "cat /root/parent-file").await.stdout, "from-parent\n");
    assert_ne!(
        d.sh(&from, "cat /root/later").await.exit_code,
        0,
        "written after the snapshot"
    );
    let r = d.sh(&from, &format!("kill -0 {sleeper} && echo alive")).await;
    assert_eq!(r.stdout, "alive\n");
    d.destroy(&from).await;
    d.destroy(&parent).await;
}

/// Issue 15: one sandbox's snapshots are bounded in number (each is a copy of its memory and disk), so the host
/// disk they can take is bounded; the refusal is typed and nothing is written, and deleting one frees a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_per_sandbox_are_bounded() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start_with(&["--network", "off", "--max-snapshots-per-sandbox", "2"]).await;
    let id = d
        .create(json!({"template": "minimal", "memory_mib": 256}))
        .await
        .id;
    let path = format!("/v1/sandboxes/{id}/snapshots");
    let (s1, first) = d.call(Method::POST, &path, None).await;
    assert_eq!(s1, StatusCode::CREATED, "{first}");
    let (s2, v) = d.call(Method::POST, &path, None).await;
    assert_eq!(s2, StatusCode::CREATED, "{v}");
    let snapshots_dir = d.data_dir().join("snapshots");
    let before = std::fs::read_dir(&snapshots_dir).expect("snapshots dir").count();
    let (s3, v) = d.call(Method::POST, &path, None).await;
    assert_eq!(s3, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert_eq!(v["error"]["code"], "capacity_exceeded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("max-snapshots-per-sandbox"),
        "{v}"
    );
    assert_eq!(
        std::fs::read_dir(&snapshots_dir).expect("snapshots dir").count(),
        before,
        "a refused snapshot writes nothing"
    );
    let first_id = first["id"].as_str().expect("snapshot id");
    let (status, v) = d
        .call(Method::DELETE, &format!("/v1/snapshots/{first_id}"), None)
        .await;
    assert!(status.is_success(), "{v}");
    let (s4, v) = d.call(Method::POST, &path, None).await;
    assert_eq!(s4, StatusCode::CREATED, "a deleted snapshot frees its slot: {v}");
    assert_eq!(d.sh(&id, "true").await.exit_code, 0, "the sandbox runs on");
}
