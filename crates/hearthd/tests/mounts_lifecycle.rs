//! Mounts across the sandbox lifecycle on real VMs: pause/resume and daemon restarts (the guest's NFS client
//! reconnects to a new server with the same file ids), forks get the parent's mounts, templates never capture
//! bucket data, destroy leaves no mount, process, socket or file behind.

#![allow(clippy::unwrap_used)]

mod common;
mod mountfix;

use std::time::Duration;

use mountfix::{Fixture, eventually};
use reqwest::{Method, StatusCode};
use serde_json::json;

fn mount(prefix: &str) -> serde_json::Value {
    json!({"template": "minimal", "mounts": [{"path": "/mnt/m", "bucket": "data", "prefix": prefix}]})
}

async fn post(f: &Fixture, path: &str) -> serde_json::Value {
    let (st, v) = f.d.call(Method::POST, path, Some(json!({}))).await;
    assert!(st.is_success(), "{path}: {st} {v}\n{}", f.d.log());
    v
}

#[tokio::test]
async fn mounts_survive_pause_resume_and_daemon_restarts() {
    let _vm = common::VM_LOCK.lock().await;
    let mut f = Fixture::start("10.213.89.0/24").await;
    f.register("data", "s3://bkt").await;
    let id = f.d.create(mount("l")).await.id;
    f.ok(&id, "echo before > /mnt/m/a.txt").await;
    // A process keeps a file of the mount open across everything below.
    let holder = f.bg(&id, "exec 3</mnt/m/a.txt; exec sleep 600").await;

    post(&f, &format!("/v1/sandboxes/{id}/pause")).await;
    post(&f, &format!("/v1/sandboxes/{id}/resume")).await;
    assert_eq!(f.ok(&id, "cat /mnt/m/a.txt").await, "before\n");
    f.ok(&id, "echo after-resume > /mnt/m/b.txt").await;
    assert_eq!(f.get("l/b.txt").await.as_deref(), Some(&b"after-resume\n"[..]));

    // The daemon dies; the new one serves the mount again and the guest reconnects (same file ids: the open
    // file still reads).
    f.d.kill9_and_restart().await;
    assert_eq!(f.ok(&id, "cat /mnt/m/a.txt").await, "before\n");
    assert_eq!(
        f.ok(&id, &format!("cat /proc/{holder}/fd/3")).await,
        "before\n",
        "the file opened before the restart still reads"
    );
    f.ok(&id, "echo after-restart > /mnt/m/c.txt").await;
    assert_eq!(f.get("l/c.txt").await.as_deref(), Some(&b"after-restart\n"[..]));

    // Paused across a restart: resumed by the new daemon, whose server the guest has never seen.
    post(&f, &format!("/v1/sandboxes/{id}/pause")).await;
    f.d.kill9_and_restart().await;
    post(&f, &format!("/v1/sandboxes/{id}/resume")).await;
    assert_eq!(f.ok(&id, "cat /mnt/m/c.txt").await, "after-restart\n");
    f.ok(&id, "echo after-both > /mnt/m/d.txt").await;
    assert_eq!(f.get("l/d.txt").await.as_deref(), Some(&b"after-both\n"[..]));
    f.d.destroy(&id).await;
}

#[tokio::test]
async fn forks_get_the_parents_mounts() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.90.0/24").await;
    f.register("data", "s3://bkt").await;
    let parent = f.d.create(mount("fk")).await.id;
    f.ok(&parent, "echo parent > /mnt/m/p.txt").await;
    let v = post(&f, &format!("/v1/sandboxes/{parent}/fork")).await;
    let child = v["sandboxes"][0]["id"].as_str().unwrap().to_string();
    assert_eq!(f.ok(&child, "cat /mnt/m/p.txt").await, "parent\n");
    f.ok(&child, "echo child > /mnt/m/c.txt").await;
    assert_eq!(f.get("fk/c.txt").await.as_deref(), Some(&b"child\n"[..]));
    eventually(
        "the parent sees the child's file",
        Duration::from_secs(10),
        || async { f.sh(&parent, "cat /mnt/m/c.txt").await == (0, "child\n".into()) },
    )
    .await;
    let (_, m) =
        f.d.call(Method::GET, &format!("/v1/sandboxes/{child}/mounts"), None)
            .await;
    assert_eq!(m["mounts"][0]["path"], "/mnt/m", "{m}");
    // The parent goes; the child's mount is its own.
    f.d.destroy(&parent).await;
    f.ok(&child, "echo still > /mnt/m/s.txt").await;
    assert_eq!(f.get("fk/s.txt").await.as_deref(), Some(&b"still\n"[..]));
    f.d.destroy(&child).await;
}

#[tokio::test]
async fn templates_do_not_capture_bucket_data() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.91.0/24").await;
    f.register("data", "s3://bkt").await;
    let marker = format!("bucket-only-{:016x}", rand::random::<u64>());
    f.put("t/data.txt", marker.as_bytes()).await;
    let id = f.d.create(mount("t")).await.id;
    assert_eq!(f.ok(&id, "cat /mnt/m/data.txt").await, marker);
    let (st, v) =
        f.d.call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "with-mem", "from_sandbox": id, "include_memory": true})),
        )
        .await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("conflict")),
        "{v}"
    );
    let (st, v) =
        f.d.call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "disk-only", "from_sandbox": id})),
        )
        .await;
    assert!(st.is_success(), "{v}");
    let image = std::fs::read(f.d.data_dir().join("templates/disk-only/rootfs.ext4")).unwrap();
    assert!(
        !image.windows(marker.len()).any(|w| w == marker.as_bytes()),
        "the template image holds bucket data"
    );
    let from = f.d.create(json!({"template": "disk-only"})).await.id;
    let (code, out) = f.sh(&from, "cat /mnt/m/data.txt").await;
    assert!(code != 0 && !out.contains(&marker), "{out}");
    let (_, m) =
        f.d.call(Method::GET, &format!("/v1/sandboxes/{from}/mounts"), None)
            .await;
    assert_eq!(m["mounts"].as_array().unwrap().len(), 0, "{m}");
    f.d.destroy(&from).await;
    f.d.destroy(&id).await;
}

/// Inodes of the sockets the daemon holds that live in another network namespace than its own (those of
/// sandbox namespaces: the resolver, the proxy, the mount server and its connections). Its own namespace's
/// sockets (the API, connections to the S3 endpoint) are listed in its /proc/PID/net tables; these are not.
fn foreign_sockets(pid: u32) -> Vec<String> {
    let mut own = std::collections::HashSet::new();
    for table in [
        "tcp", "tcp6", "udp", "udp6", "unix", "netlink", "raw", "raw6", "packet",
    ] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            let inode = match table {
                "unix" => cols.get(6),
                "netlink" => cols.get(8),
                "packet" => cols.get(8),
                _ => cols.get(9),
            };
            if let Some(i) = inode {
                own.insert(i.to_string());
            }
        }
    }
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| std::fs::read_link(e.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().into_owned();
                    l.strip_prefix("socket:[")
                        .and_then(|r| r.strip_suffix(']'))
                        .map(String::from)
                })
                .filter(|i| !own.contains(i))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn destroy_leaves_no_mount_process_socket_or_file() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.92.0/24").await;
    f.register("data", "s3://bkt").await;
    let pid = f.d.pid().unwrap();
    assert!(
        foreign_sockets(pid).is_empty(),
        "no sandbox yet: {:?}",
        foreign_sockets(pid)
    );
    let id = f.d.create(mount("z")).await.id;
    f.ok(&id, "echo z > /mnt/m/z.txt && cat /mnt/m/z.txt && ls /mnt/m")
        .await;
    // The listener and the guest's connection of the mount server, the resolver and the proxy.
    assert!(
        foreign_sockets(pid).len() >= 4,
        "sandbox sockets while it runs: {:?}",
        foreign_sockets(pid)
    );
    let handles = f.d.data_dir().join("mounts/handles");
    assert_eq!(
        std::fs::read_dir(&handles).unwrap().count(),
        1,
        "one handle table"
    );
    f.d.destroy(&id).await;
    assert!(f.d.vm_pids(&id).is_empty(), "no VM process");
    assert!(
        !hearth_net::netns_path(&id).exists(),
        "no namespace (so no listener on its gateway)"
    );
    eventually(
        "the daemon holds no socket of the sandbox's namespace",
        Duration::from_secs(20),
        || async { foreign_sockets(pid).is_empty() },
    )
    .await;
    assert_eq!(std::fs::read_dir(&handles).unwrap().count(), 0, "no handle table");
    assert_eq!(
        std::fs::read_dir(f.d.data_dir().join("mounts/tmp"))
            .unwrap()
            .count(),
        0,
        "no temporary file"
    );
    let (_, b) = f.d.call(Method::GET, "/v1/buckets/data", None).await;
    assert_eq!(b["mounted_by"], json!([]), "{b}");
    assert_eq!(f.keys("z").await, vec!["z/z.txt"], "the data stays in the bucket");
}
