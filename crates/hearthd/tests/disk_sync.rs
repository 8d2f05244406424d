//! Disk sync with real VMs (QEMU TCG, `minimal`) and a real S3 server (s3s-fs on loopback): a file written in a
//! running sandbox is synced (two syncs at once: both answer, one after the other) while the sandbox keeps
//! running; a later write is not synced; the host then loses the sandbox (its VMM killed, so it fails and its
//! files go) and the local image; a new sandbox recreated from the sync has the file, fetched from the bucket and
//! verified, and not the later write. Also: a bad interval is a 400, a paused sandbox's sync a 409, a recreate
//! from a sandbox never synced a 404, destroying the source removes its image from the bucket, and a sandbox
//! created with `disk_sync_interval_s: 60` is synced by the daemon after a minute. A second test: synced images
//! in the bounded local cache, and a recreate standing on its source's snapshot.

mod common;
mod storagefix;

use std::time::Duration;

use common::{Daemon, VM_LOCK, wait_until};
use hearth_testkit::s3::{S3Kind, S3Server};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use storagefix::start_daemon_with;

const BUCKET: &str = "hearth-state";

/// `name`'s entry in `GET /v1/storage`, if any.
async fn stored(d: &Daemon, name: &str) -> Option<Value> {
    let (status, v) = d.call(Method::GET, "/v1/storage", None).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    v["objects"]
        .as_array()?
        .iter()
        .find(|o| o["name"] == name)
        .cloned()
}

async fn sync(d: &Daemon, id: &str) -> (StatusCode, Value) {
    d.call(Method::POST, &format!("/v1/sandboxes/{id}/sync"), None)
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_synced_disk_recreates_a_sandbox_its_host_lost() {
    let _serial = VM_LOCK.lock().await;
    let s3 = tokio::task::spawn_blocking(|| S3Server::start(S3Kind::S3sFs, BUCKET))
        .await
        .expect("s3 server");
    let d = start_daemon_with(&s3, "hd", &[]).await;

    // The interval is validated at create.
    let (status, v) = d
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "minimal", "memory_mib": 128, "disk_sync_interval_s": 5})),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "invalid_argument", "{v}");

    // Synced by the daemon itself once a minute (the shortest interval): checked at the end.
    let periodic = d
        .create(json!({"template": "minimal", "memory_mib": 128, "disk_sync_interval_s": 60}))
        .await
        .id;
    let periodic_since = std::time::Instant::now();
    let r = d.sh(&periodic, "echo periodic > /root/p").await;
    assert_eq!(r.exit_code, 0);
    let a = d
        .create(json!({"template": "minimal", "memory_mib": 128, "disk_sync_interval_s": 3600}))
        .await
        .id;
    let (_, row) = d.get(&a).await;
    assert_eq!(row["disk_sync_interval_s"], 3600, "{row}");
    // No `sync` in the shell: the daemon has the guest agent flush before the capture.
    let r = d
        .sh(
            &a,
            "head -c 3000000 /dev/urandom > /root/data && md5sum /root/data",
        )
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let sum = r.stdout.split_whitespace().next().expect("md5").to_owned();

    // Two syncs at once: both succeed, one after the other; the sandbox runs on.
    let (first, second) = tokio::join!(sync(&d, &a), sync(&d, &a));
    for (status, v) in [&first, &second] {
        assert_eq!(*status, StatusCode::OK, "{v}\n{}", d.log());
        assert_eq!(v["object"], format!("sandboxes/{a}/sync"), "{v}");
        assert!(v["stopped_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{v}");
        assert!(v["size_bytes"].as_u64().is_some_and(|b| b > 3_000_000), "{v}");
        println!(
            "sync: guest stopped {:.1} ms ({} copy), image {:.1} MiB, upload {}",
            v["stopped_ms"].as_f64().unwrap_or(0.0),
            v["copy"],
            v["size_bytes"].as_f64().unwrap_or(0.0) / 1048576.0,
            v["upload"]
        );
    }
    assert_ne!(first.1["version"], second.1["version"]);
    assert_eq!(d.sh(&a, "echo alive").await.stdout, "alive\n");
    let name = format!("sandboxes/{a}/sync");
    assert!(
        wait_until(Duration::from_secs(120), || async {
            stored(&d, &name).await.is_some_and(|o| o["sync"] == "synced")
        })
        .await,
        "the sync is uploaded: {:?}\n{}",
        stored(&d, &name).await,
        d.log()
    );
    let o = stored(&d, &name).await.unwrap_or_default();
    println!(
        "uploaded: size {} bytes, sent {} bytes",
        o["size_bytes"], o["sent_bytes"]
    );

    // The CLI: `hearth sync ID --wait` answers once the bucket holds the image.
    let hearth = tokio::task::spawn_blocking(hearth_testkit::hearth_bin)
        .await
        .expect("hearth");
    let out = d
        .hearth(&hearth)
        .args(["sync", &a, "--wait"])
        .output()
        .expect("hearth sync");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&name) && text.contains("synced"), "{text}");
    println!("hearth sync --wait:\n{text}");
    assert_eq!(
        stored(&d, &name).await.map(|o| o["sync"].clone()),
        Some(json!("synced"))
    );

    // Written after the sync: must not come back.
    let r = d.sh(&a, "echo late > /root/after-sync && sync").await;
    assert_eq!(r.exit_code, 0);

    // The host loses the sandbox: its VMM dies (the daemon marks it failed and removes its files), and the
    // local image is gone too.
    let pids = d.vm_pids(&a);
    assert!(!pids.is_empty(), "the VMM of {a}");
    for pid in pids {
        let _ = std::process::Command::new("kill")
            .args(["-9", &pid.to_string()])
            .status();
    }
    assert!(
        wait_until(Duration::from_secs(120), || async {
            d.get(&a).await.1["state"] == "failed"
        })
        .await,
        "{:#}",
        d.get(&a).await.1
    );
    let local = d.data_dir().join("syncs").join(&a);
    assert!(local.join("disk").is_file(), "the local image is where expected");
    std::fs::remove_dir_all(&local).expect("remove the local image");

    // Recreate: a new sandbox, same template and shape, with the synced files.
    let (status, b) = d
        .call(Method::POST, "/v1/sandboxes", Some(json!({"from_sync": a})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{b}\n{}", d.log());
    let b = b["id"].as_str().expect("id").to_owned();
    assert_ne!(b, a);
    let (_, row) = d.get(&b).await;
    assert_eq!(
        (row["template"].as_str(), row["memory_mib"].as_u64()),
        (Some("minimal"), Some(128))
    );
    assert!(d.log().contains("fetched from the storage bucket"));
    let r = d.sh(&b, "md5sum /root/data").await;
    assert_eq!(r.stdout.split_whitespace().next(), Some(sum.as_str()), "{r:?}");
    let r = d.sh(&b, "test -e /root/after-sync; echo $?").await;
    assert_eq!(
        r.stdout, "1\n",
        "a write after the sync is not in the recreated sandbox"
    );

    // The new sandbox was never synced; paused, its pause holds its disk.
    let (status, v) = d
        .call(Method::POST, "/v1/sandboxes", Some(json!({"from_sync": b})))
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["code"], "no_disk_sync", "{v}");
    let (status, v) = d
        .call(Method::POST, &format!("/v1/sandboxes/{b}/pause"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, v) = sync(&d, &b).await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("paused"),
        "{v}"
    );

    // Destroying the source removes its image from the bucket.
    d.destroy(&a).await;
    assert!(
        wait_until(Duration::from_secs(60), || async {
            stored(&d, &name).await.is_none()
        })
        .await,
        "{:?}",
        stored(&d, &name).await
    );
    d.destroy(&b).await;

    // The periodic sync: no request asked for it, yet the bucket gets the image after the interval.
    let pname = format!("sandboxes/{periodic}/sync");
    assert!(
        wait_until(Duration::from_secs(180), || async {
            stored(&d, &pname).await.is_some_and(|o| o["sync"] == "synced")
        })
        .await,
        "periodic sync: {:?}\n{}",
        stored(&d, &pname).await,
        d.log()
    );
    let after = periodic_since.elapsed();
    println!(
        "periodic sync in the bucket {:.0} s after the sandbox was created",
        after.as_secs_f64()
    );
    // The interval counts from the creation, a few seconds before `create` answered (the boot).
    assert!(
        after >= Duration::from_secs(30),
        "not before the interval: {after:?}"
    );
    assert!(d.log().contains("periodic disk sync"));
    d.destroy(&periodic).await;
}

/// Synced images are part of the local cache (`--cache-size`): once in the bucket, an image over the limit is
/// evicted and a recreate fetches it back. A sandbox recreated from a source that was itself restored from a
/// snapshot stands on that snapshot (its disk copy is an overlay over it): it records it as its `snapshot_id`,
/// and the snapshot cannot be deleted while the new sandbox runs, even after the source is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synced_images_are_cached_and_a_recreate_keeps_its_base_snapshot() {
    let _serial = VM_LOCK.lock().await;
    let s3 = tokio::task::spawn_blocking(|| S3Server::start(S3Kind::S3sFs, BUCKET))
        .await
        .expect("s3 server");
    let d = start_daemon_with(&s3, "hc", &["--cache-size", "1M"]).await;
    let origin = d
        .create(json!({"template": "minimal", "memory_mib": 128}))
        .await
        .id;
    assert_eq!(d.sh(&origin, "echo base > /root/base && sync").await.exit_code, 0);
    let (status, snap) = d
        .call(Method::POST, &format!("/v1/sandboxes/{origin}/snapshots"), None)
        .await;
    assert_eq!(status, StatusCode::CREATED, "{snap}\n{}", d.log());
    let snap = snap["id"].as_str().expect("snapshot id").to_owned();
    d.destroy(&origin).await;
    let src = d.create(json!({"snapshot": snap})).await.id;
    assert_eq!(d.sh(&src, "echo mine > /root/mine").await.exit_code, 0);
    let (status, v) = sync(&d, &src).await;
    assert_eq!(status, StatusCode::OK, "{v}");

    // In the bucket, then evicted (the snapshot stays: a running sandbox stands on it).
    let name = format!("sandboxes/{src}/sync");
    let image = d.data_dir().join("syncs").join(&src);
    assert!(
        wait_until(Duration::from_secs(120), || async {
            stored(&d, &name)
                .await
                .is_some_and(|o| o["sync"] == "synced" && o["location"] == "remote")
        })
        .await,
        "the synced image is evicted once uploaded: {:?}\n{}",
        stored(&d, &name).await,
        d.log()
    );
    assert!(!image.exists(), "{}", image.display());
    let snap_name = format!("snapshots/{snap}");
    assert!(
        wait_until(Duration::from_secs(120), || async {
            stored(&d, &snap_name)
                .await
                .is_some_and(|o| o["sync"] == "synced")
        })
        .await,
        "{:?}",
        stored(&d, &snap_name).await
    );
    // A few worker rounds over the full cache.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        stored(&d, &snap_name).await.map(|o| o["location"].clone()),
        Some(json!("both")),
        "a snapshot a running sandbox stands on stays local"
    );

    // Recreated: the image comes back from the bucket; the new sandbox names the snapshot its disk builds on.
    let (status, n) = d
        .call(Method::POST, "/v1/sandboxes", Some(json!({"from_sync": src})))
        .await;
    assert_eq!(status, StatusCode::CREATED, "{n}\n{}", d.log());
    let n = n["id"].as_str().expect("id").to_owned();
    assert_eq!(d.get(&n).await.1["snapshot_id"], json!(snap));
    assert_eq!(d.sh(&n, "cat /root/base /root/mine").await.stdout, "base\nmine\n");
    d.destroy(&src).await;
    let (status, v) = d
        .call(Method::DELETE, &format!("/v1/snapshots/{snap}"), None)
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "the recreated sandbox uses it: {v}");
    assert!(
        v["error"]["message"].as_str().unwrap_or_default().contains(&n),
        "{v}"
    );
    // Still local and whole for the sandbox standing on it.
    assert!(d.data_dir().join("snapshots").join(&snap).is_dir());
    assert_eq!(d.sh(&n, "cat /root/base").await.stdout, "base\n");
    d.destroy(&n).await;
    let (status, v) = d
        .call(Method::DELETE, &format!("/v1/snapshots/{snap}"), None)
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT, "{v}");
}
