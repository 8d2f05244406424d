//! The storage bucket (`hearthd --storage`) with real VMs (QEMU TCG, `minimal`) and a real S3 server (s3s-fs on
//! loopback). One daemon and a handful of sandboxes are shared between the assertions, because every boot costs
//! seconds: a pause is uploaded, its local copy wiped and the resume fetches it (same process, same files); a
//! re-pause after changing one file sends a small part; an outage leaves the pause `pending` until the server
//! is back (and a daemon killed with it pending uploads it after its restart); a daemon killed (`kill -9`) in the
//! middle of an upload leaves the old version committed and its restart commits the new one whole; a template
//! and 4 sandboxes started from it store far less than 5 copies; a flipped byte in a chunk
//! is a typed error naming the object while another sandbox still resumes; deleting everything and a GC pass
//! leave no chunk. A second test starts the daemon with bad storage settings, which it must refuse.

mod common;
mod storagefix;

use std::process::Stdio;
use std::time::Duration;

use common::{Daemon, VM_LOCK, test_vmm, wait_until};
use hearth_testkit::s3::{S3Kind, S3Server};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use storagefix::{
    COUNTER, PREFIX, bucket_root, chunk_path, cli_storage_status, flip_byte, manifest_chunks, pause,
    poll_storage, start_daemon_with, storage,
};

const BUCKET: &str = "hearth-state";

fn object<'a>(status: &'a Value, name: &str) -> Option<&'a Value> {
    status["objects"].as_array()?.iter().find(|o| o["name"] == name)
}

/// Waits until `name` is synced and returns its entry.
async fn synced(d: &Daemon, name: &str) -> Value {
    poll_object(d, name, |o| o["sync"] == "synced").await
}

/// Polls `GET /v1/storage` until `name`'s entry satisfies `done` (2 minutes at most) and returns it.
async fn poll_object(d: &Daemon, name: &str, done: impl Fn(&Value) -> bool) -> Value {
    let entry = |st: &Value| object(st, name).cloned().unwrap_or_default();
    let st = poll_storage(d, name, Duration::from_secs(120), |st| done(&entry(st))).await;
    entry(&st)
}

async fn resume(d: &Daemon, id: &str) -> (StatusCode, Value) {
    d.call(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None)
        .await
}

/// Chunk objects in the bucket and their bytes.
fn chunk_usage(s3: &S3Server) -> (usize, u64) {
    let files = hearth_testkit::s3::files_under(&bucket_root(s3).join("chunks"));
    let bytes = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum();
    (files.len(), bytes)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// Kills the daemon process (SIGKILL), leaving its VMs and files as a crash would.
fn kill9(d: &Daemon) {
    let pid = d.pid().expect("daemon pid");
    let killed = std::process::Command::new("kill")
        .args(["-9", &pid.to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
}

async fn counter(d: &Daemon, id: &str) -> u64 {
    let r = d.sh(id, "cat /dev/shm/counter").await;
    r.stdout.trim().parse().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_state_lives_in_the_bucket() {
    let _serial = VM_LOCK.lock().await;
    let mut s3 = tokio::task::spawn_blocking(|| S3Server::start(S3Kind::S3sFs, BUCKET))
        .await
        .expect("s3 server");
    // Cold boots: the bucket's objects below are the sandboxes' alone (a boot snapshot in the bucket is
    // `warm.rs::an_evicted_boot_snapshot_comes_back_from_the_bucket`).
    let mut d = start_daemon_with(&s3, "hd", &["--warm-creates", "off"]).await;
    let st = storage(&d).await;
    assert_eq!(st["health"], "ok", "{st}");
    let (_, system) = d.call(Method::GET, "/v1/system", None).await;
    let checks = system["checks"].as_array().cloned().unwrap_or_default();
    assert!(
        checks
            .iter()
            .any(|c| c["name"] == "storage" && c["status"] == "ok"),
        "{system:#}"
    );

    // Pause, wipe the local copy, resume from the bucket: same process, same files.
    let a = d
        .create(json!({"template": "minimal", "memory_mib": 128}))
        .await
        .id;
    let (status, v) = d.run_raw(&a, json!({"cmd": COUNTER, "background": true})).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{v}");
    let pid = v["pid"].as_u64().expect("pid");
    assert_eq!(
        d.sh(&a, "echo kept > /root/before-pause && sync").await.exit_code,
        0
    );
    assert!(wait_until(Duration::from_secs(10), || async { counter(&d, &a).await >= 2 }).await);
    let before = counter(&d, &a).await;
    pause(&d, &a).await;
    let first = synced(&d, &format!("sandboxes/{a}/pause")).await;
    let (chunks_a, bytes_a) = chunk_usage(&s3);
    println!(
        "first pause: state {:.1} MiB, sent {:.1} MiB, bucket {chunks_a} chunks {:.1} MiB",
        mib(first["size_bytes"].as_u64().unwrap_or(0)),
        mib(first["sent_bytes"].as_u64().unwrap_or(0)),
        mib(bytes_a)
    );
    let (ok, text) = cli_storage_status(&d).await;
    assert!(ok, "{text}");
    assert!(
        text.contains(&format!("sandboxes/{a}/pause")) && text.contains("synced") && text.contains("both"),
        "{text}"
    );
    println!("hearth storage status:\n{text}");
    let manifest_path = bucket_root(&s3)
        .join("manifests")
        .join(format!("sandboxes/{a}/pause"))
        .join("MANIFEST");
    let first_manifest = std::fs::read(&manifest_path).expect("the first pause's manifest");
    std::fs::remove_dir_all(d.sandbox_dir(&a)).expect("wipe the sandbox's local files");
    let (status, v) = resume(&d, &a).await;
    assert_eq!(status, StatusCode::OK, "resume from the bucket: {v}\n{}", d.log());
    assert_eq!(
        d.sh(&a, &format!("kill -0 {pid}")).await.exit_code,
        0,
        "the counter survived"
    );
    assert_eq!(d.sh(&a, "cat /root/before-pause").await.stdout, "kept\n");
    assert!(
        wait_until(Duration::from_secs(10), || async {
            counter(&d, &a).await > before
        })
        .await,
        "the counter goes on from {before}"
    );
    assert!(d.log().contains("fetched from the storage bucket"));

    // Re-pause after changing one file: only changed chunks go up.
    assert_eq!(
        d.sh(&a, "echo changed > /root/one-file && sync").await.exit_code,
        0
    );
    pause(&d, &a).await;
    let again = wait_resynced(&d, &format!("sandboxes/{a}/pause"), &first).await;
    let (size, sent) = (
        again["size_bytes"].as_u64().unwrap_or(0),
        again["sent_bytes"].as_u64().unwrap_or(0),
    );
    println!(
        "re-pause: state {:.1} MiB, sent {:.2} MiB = {:.1}%",
        mib(size),
        mib(sent),
        100.0 * sent as f64 / size.max(1) as f64
    );
    assert!(sent * 4 < size, "a re-pause sends a small part: {sent} of {size}");

    // Whoever can write the bucket cannot roll the sandbox back: the first pause's genuine manifest (its chunks
    // all still there) put back in place of the second is refused, because this host recorded which version
    // it committed. The right one is accepted again.
    let second_manifest = std::fs::read(&manifest_path).expect("the second pause's manifest");
    assert_ne!(first_manifest, second_manifest);
    std::fs::write(&manifest_path, &first_manifest).expect("roll the bucket back");
    std::fs::remove_dir_all(d.sandbox_dir(&a)).expect("wipe");
    let (status, v) = resume(&d, &a).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_eq!(v["error"]["code"], "storage_corrupt", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("not the version"),
        "{v}"
    );
    let (_, row) = d.get(&a).await;
    assert_eq!(row["state"], "paused", "{row}");
    std::fs::write(&manifest_path, &second_manifest).expect("put the committed version back");

    // Outage: the pause commits locally and stays pending; the upload completes when the server is back.
    let (status, v) = resume(&d, &a).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    s3.stop();
    pause(&d, &a).await;
    let name = format!("sandboxes/{a}/pause");
    assert!(
        wait_until(Duration::from_secs(60), || async {
            let st = storage(&d).await;
            object(&st, &name).is_some_and(|o| o["sync"] == "pending" && o["attempts"].as_u64() >= Some(1))
                && st["health"] == "unavailable"
        })
        .await,
        "pending during the outage: {:#}",
        storage(&d).await
    );
    println!(
        "during the outage: {}",
        object(&storage(&d).await, &name).cloned().unwrap_or_default()
    );
    // The daemon dies (kill -9) with the upload pending; the server comes back, then the daemon: the pending
    // row in the state database is uploaded by the new process.
    kill9(&d);
    let s3 = tokio::task::spawn_blocking(move || {
        s3.start_again();
        s3
    })
    .await
    .expect("restart s3");
    d.kill9_and_restart().await;
    synced(&d, &name).await;

    // kill -9 in the middle of an upload: some chunks of a new version are in the bucket, its manifest is not.
    // The bucket keeps the old version committed until the restarted daemon finishes the upload; the new
    // version then comes back whole.
    let (status, v) = resume(&d, &a).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let r = d
        .sh(
            &a,
            "head -c 33554432 /dev/urandom > /dev/shm/big && md5sum /dev/shm/big",
        )
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let big_sum = r.stdout.split_whitespace().next().expect("md5").to_owned();
    let old_manifest = std::fs::read(&manifest_path).expect("the committed manifest");
    let (chunks_before, _) = chunk_usage(&s3);
    pause(&d, &a).await;
    let root = bucket_root(&s3);
    let started = tokio::task::spawn_blocking(move || {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while std::time::Instant::now() < deadline {
            let n = hearth_testkit::s3::files_under(&root.join("chunks")).len();
            if n >= chunks_before + 4 {
                return Some(n - chunks_before);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    })
    .await
    .expect("watch");
    s3.freeze();
    let new_chunks = started.expect("the upload of the new version started");
    kill9(&d);
    let manifest_at_kill = std::fs::read(&manifest_path).expect("a manifest");
    let (chunks_at_kill, _) = chunk_usage(&s3);
    println!(
        "killed mid-upload: {} new chunks in the bucket when seen, {} at the kill",
        new_chunks,
        chunks_at_kill - chunks_before
    );
    assert!(
        manifest_at_kill == old_manifest,
        "the manifest of the version being uploaded is not written before all its chunks"
    );
    s3.thaw();
    d.kill9_and_restart().await;
    let resynced = synced(&d, &name).await;
    let new_manifest = std::fs::read(&manifest_path).expect("the new manifest");
    assert_ne!(
        new_manifest, old_manifest,
        "the restarted daemon committed the new version"
    );
    for id in manifest_chunks(&s3, &name) {
        assert!(
            chunk_path(&s3, &id).is_file(),
            "chunk {id} of the committed manifest"
        );
    }
    println!(
        "after the restart: synced {} bytes sent of {}",
        resynced["sent_bytes"], resynced["size_bytes"]
    );
    // Fetched from the bucket (the local copy wiped): the data written before the pause is whole.
    std::fs::remove_dir_all(d.sandbox_dir(&a)).expect("wipe the sandbox's local files");
    let (status, v) = resume(&d, &a).await;
    assert_eq!(status, StatusCode::OK, "{v}\n{}", d.log());
    let r = d.sh(&a, "md5sum /dev/shm/big && rm /dev/shm/big").await;
    assert_eq!(
        r.stdout.split_whitespace().next(),
        Some(big_sum.as_str()),
        "{r:?}"
    );
    pause(&d, &a).await;
    synced(&d, &name).await;

    // A template saved with memory and 4 sandboxes started from it, each paused: far less than 5 copies.
    let (status, v) = resume(&d, &a).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (_, bytes_before) = chunk_usage(&s3);
    let (status, t) = d
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "warm", "from_sandbox": a, "include_memory": true})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{t}\n{}", d.log());
    let snap = t["snapshot_id"].as_str().expect("template snapshot").to_owned();
    let snap_obj = synced(&d, &format!("snapshots/{snap}")).await;
    let tpl_obj = synced(&d, "templates/warm").await;
    let size = |o: &Value| o["size_bytes"].as_u64().unwrap_or(0);
    let (_, bytes_tpl) = chunk_usage(&s3);
    let mut forks = Vec::new();
    for _ in 0..4 {
        let id = d.create(json!({"template": "warm"})).await.id;
        assert_eq!(d.sh(&id, &format!("kill -0 {pid}")).await.exit_code, 0);
        let r = d.sh(&id, &format!("echo {id} > /root/me && sync")).await;
        assert_eq!(r.exit_code, 0);
        pause(&d, &id).await;
        forks.push(id);
    }
    let mut fork_copies = 0;
    for id in &forks {
        fork_copies += size(&synced(&d, &format!("sandboxes/{id}/pause")).await);
    }
    let (_, bytes_after) = chunk_usage(&s3);
    // The template: its memory snapshot and its flattened disk (a raw image, new bytes); then 4 forks.
    let tpl_full = size(&snap_obj) + size(&tpl_obj);
    let (tpl_grown, fork_grown) = (bytes_tpl - bytes_before, bytes_after - bytes_tpl);
    let pct = |a: u64, b: u64| 100.0 * a as f64 / b.max(1) as f64;
    println!(
        "template (snapshot {:.1} MiB + disk {:.1} MiB): bucket grew {:.1} MiB ({:.1}%); 4 forks paused \
         ({:.1} MiB of state): grew {:.1} MiB ({:.1}%); template + 4 forks: {:.1} of {:.1} MiB ({:.1}%)",
        mib(size(&snap_obj)),
        mib(size(&tpl_obj)),
        mib(tpl_grown),
        pct(tpl_grown, tpl_full),
        mib(fork_copies),
        mib(fork_grown),
        pct(fork_grown, fork_copies),
        mib(tpl_grown + fork_grown),
        mib(tpl_full + fork_copies),
        pct(tpl_grown + fork_grown, tpl_full + fork_copies),
    );
    // The template shares nearly everything with the sandbox's last pause. A sandbox started from the template
    // runs on a copy-on-write mapping of its memory file; its pause writes its RAM with QEMU's `mapped-ram` (each
    // page at its own offset, as in the template's memory file), so the chunks it did not change are the
    // template's. (Before `mapped-ram` the 4 forks sent ~60% of their state; now ~18%: their disks' own
    // writes and the pages they touched.)
    assert!(
        tpl_grown * 4 < tpl_full,
        "a template saved from a paused-and-stored sandbox adds little: {tpl_grown} vs {tpl_full}"
    );
    assert!(
        fork_grown * 3 < fork_copies,
        "4 sandboxes of a memory template share its chunks: {fork_grown} vs {fork_copies}"
    );
    assert!(
        (tpl_grown + fork_grown) * 2 < tpl_full + fork_copies,
        "template + 4 forks: {} vs {}",
        tpl_grown + fork_grown,
        tpl_full + fork_copies
    );

    // A flipped byte in a chunk only fork 0 uses: its resume fails naming the object, fork 1 still resumes.
    let (bad, good) = (&forks[0], &forks[1]);
    let others: std::collections::HashSet<String> = forks[1..]
        .iter()
        .map(|f| format!("sandboxes/{f}/pause"))
        .chain([format!("snapshots/{snap}"), "templates/warm".into(), name.clone()])
        .flat_map(|n| manifest_chunks(&s3, &n))
        .collect();
    let own = manifest_chunks(&s3, &format!("sandboxes/{bad}/pause"))
        .into_iter()
        .find(|c| !others.contains(c))
        .expect("a chunk only the first fork has");
    flip_byte(&chunk_path(&s3, &own));
    std::fs::remove_dir_all(d.sandbox_dir(bad)).expect("wipe");
    std::fs::remove_dir_all(d.sandbox_dir(good)).expect("wipe");
    // The forks' disks are overlays over the template snapshot's disk copy: gone too, fetched back first.
    std::fs::remove_dir_all(d.data_dir().join("snapshots").join(&snap)).expect("wipe the snapshot");
    let (status, v) = resume(&d, bad).await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{v}");
    assert_eq!(v["error"]["code"], "storage_corrupt", "{v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains(&format!("sandboxes/{bad}/pause")) && msg.contains(&own),
        "{msg}"
    );
    assert!(
        !d.sandbox_dir(bad).join("paused").exists(),
        "nothing half-fetched is left"
    );
    let (_, row) = d.get(bad).await;
    assert_eq!(row["state"], "paused", "{row}");
    let (status, v) = resume(&d, good).await;
    assert_eq!(status, StatusCode::OK, "the other fork resumes: {v}");
    assert_eq!(d.sh(good, "cat /root/me").await.stdout, format!("{good}\n"));

    // Delete everything; after a GC pass the bucket holds no chunk.
    for id in forks.iter().chain([&a]) {
        d.destroy(id).await;
    }
    let (status, v) = d.call(Method::DELETE, "/v1/templates/warm", None).await;
    assert!(status.is_success(), "{v}");
    assert!(
        wait_until(Duration::from_secs(60), || async {
            storage(&d).await["objects"]
                .as_array()
                .is_some_and(|o| o.is_empty())
        })
        .await,
        "remote objects removed: {:#}",
        storage(&d).await
    );
    let metrics = d
        .http
        .get(d.url("/metrics"))
        .send()
        .await
        .expect("metrics")
        .text()
        .await
        .unwrap_or_default();
    assert!(
        metrics.contains("hearth_storage_bytes_uploaded_total"),
        "{metrics}"
    );
    assert!(
        metrics.contains("hearth_storage_bytes_downloaded_total"),
        "{metrics}"
    );
    let (status, gc) = d.call(Method::POST, "/v1/storage/gc?grace_s=0", None).await;
    assert_eq!(status, StatusCode::OK, "{gc}");
    println!("gc: {gc}");
    assert_eq!(gc["chunks_after"], 0, "{gc}");
    assert_eq!(chunk_usage(&s3).0, 0, "no chunk file left in the bucket");
}

/// Waits until `name` is synced with a newer version than `old`.
async fn wait_resynced(d: &Daemon, name: &str, old: &Value) -> Value {
    poll_object(d, name, |o| {
        o["sync"] == "synced" && o["synced_at"] != old["synced_at"]
    })
    .await
}

/// Starts hearthd with `args` and storage environment `env`, expects it to exit with an error; returns stderr.
fn refused(args: &[&str], env: &[(String, String)]) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_hearthd"));
    cmd.args([
        "--vmm",
        &test_vmm(),
        "--network",
        "off",
        "--listen",
        "127.0.0.1:0",
    ])
    .arg("--data-dir")
    .arg(dir.path().join("state"))
    .args(args)
    .env("RUST_LOG", "warn")
    .env("RUST_BACKTRACE", "0")
    .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run hearthd");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "hearthd started with {args:?}: {stderr}");
    assert!(
        !dir.path().join("state/listen-addr").exists(),
        "it never listened"
    );
    stderr
}

#[test]
fn bad_storage_settings_stop_the_start() {
    let s3 = S3Server::start(S3Kind::S3sFs, BUCKET);
    let env = s3.env();
    let e = refused(&["--storage", "s3://no-such-bucket/x"], &env);
    assert!(e.contains("no such bucket"), "{e}");
    println!("refused (no such bucket): {e}");
    let bad_secret: Vec<_> = env
        .iter()
        .map(|(k, v)| match k.as_str() {
            "AWS_SECRET_ACCESS_KEY" => (k.clone(), "not-the-secret".to_owned()),
            _ => (k.clone(), v.clone()),
        })
        .collect();
    let e = refused(&["--storage", &s3.url(PREFIX)], &bad_secret);
    assert!(e.contains("access denied"), "{e}");
    assert!(!e.contains("not-the-secret"), "no secret in messages: {e}");
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let unreachable: Vec<_> = env
        .iter()
        .map(|(k, v)| match k.as_str() {
            "AWS_ENDPOINT_URL" => (k.clone(), format!("http://127.0.0.1:{port}")),
            _ => (k.clone(), v.clone()),
        })
        .collect();
    let e = refused(&["--storage", &s3.url(PREFIX)], &unreachable);
    assert!(e.contains("unreachable"), "{e}");
    println!("refused (unreachable endpoint): {e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_storage_holds_no_plaintext_and_refuses_a_wrong_key() {
    let _serial = VM_LOCK.lock().await;
    let s3 = tokio::task::spawn_blocking(|| S3Server::start(S3Kind::S3sFs, BUCKET))
        .await
        .expect("s3 server");
    let keys = tempfile::tempdir().expect("tempdir");
    let (key, wrong) = (keys.path().join("key"), keys.path().join("wrong"));
    std::fs::write(&key, format!("{}\n", "ab".repeat(32))).expect("key");
    std::fs::write(&wrong, format!("{}\n", "cd".repeat(32))).expect("key");
    let key_arg = key.to_string_lossy().into_owned();
    let d = start_daemon_with(&s3, "hd", &["--storage-key", &key_arg]).await;
    assert_eq!(storage(&d).await["encrypted"], true);
    let id = d
        .create(json!({"template": "minimal", "memory_mib": 128}))
        .await
        .id;
    // A known text, in the guest's page cache (memory) and on its disk.
    let marker = "HEARTH-KNOWN-PLAINTEXT-0123456789";
    let line = format!("yes {marker} | head -c 1048576 > /root/known && sync && cat /root/known > /dev/null");
    let r = d.sh(&id, &line).await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    pause(&d, &id).await;
    synced(&d, &format!("sandboxes/{id}/pause")).await;
    let files = hearth_testkit::s3::files_under(&bucket_root(&s3));
    assert!(files.len() > 10, "{files:?}");
    for f in &files {
        let bytes = std::fs::read(f).expect("read");
        assert!(
            !bytes.windows(marker.len()).any(|w| w == marker.as_bytes()),
            "plaintext in {}",
            f.display()
        );
    }
    // Fetched and decrypted: the file is back.
    std::fs::remove_dir_all(d.sandbox_dir(&id)).expect("wipe");
    let (status, v) = resume(&d, &id).await;
    assert_eq!(status, StatusCode::OK, "{v}\n{}", d.log());
    let r = d.sh(&id, &format!("grep -c {marker} /root/known")).await;
    assert_eq!(r.stdout.trim(), "30840", "{r:?}");
    // Another key is refused at start.
    let wrong_arg = wrong.to_string_lossy().into_owned();
    let url = s3.url(PREFIX);
    let e = refused(&["--storage", &url, "--storage-key", &wrong_arg], &s3.env());
    assert!(e.contains("wrong encryption key"), "{e}");
    d.destroy(&id).await;
}
