//! Faults during uploads, against real servers: the S3 server killed and restarted mid-upload (s3s-fs, data
//! kept), frozen and thawed (moto), an upload dropped halfway (a crash of its task), and GC running while an
//! upload relies on chunks it would otherwise delete.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use hearth_store::{FileSource, GcOptions, Progress, PutOptions, RemoteErrorKind, Store, StoreError};
use hearth_testkit::s3::{S3Kind, S3Server};

/// A progress callback that, the first time the upload has done `mark` bytes, stops inside the callback (so the
/// upload is certainly mid-way) until the test calls `release`.
struct Gate {
    reached: tokio::sync::oneshot::Receiver<u64>,
    release: std::sync::mpsc::Sender<()>,
}

fn gate_at(mark: u64) -> (Gate, hearth_store::ProgressFn) {
    let (reached_tx, reached) = tokio::sync::oneshot::channel();
    let (release, release_rx) = std::sync::mpsc::channel::<()>();
    let reached_tx = std::sync::Mutex::new(Some(reached_tx));
    let release_rx = std::sync::Mutex::new(release_rx);
    let progress: hearth_store::ProgressFn = Arc::new(move |p: Progress| {
        if p.done_bytes < mark {
            return;
        }
        let Some(tx) = reached_tx.lock().expect("lock").take() else {
            return;
        };
        let _ = tx.send(p.done_bytes);
        let _ = release_rx
            .lock()
            .expect("lock")
            .recv_timeout(Duration::from_secs(60));
    });
    (Gate { reached, release }, progress)
}

impl Gate {
    /// Waits until the upload reached the mark; returns the bytes done then.
    async fn reached(&mut self) -> u64 {
        tokio::time::timeout(Duration::from_secs(60), &mut self.reached)
            .await
            .expect("the upload reaches the mark within a minute")
            .expect("the upload is running")
    }

    fn release(&self) {
        let _ = self.release.send(());
    }
}

fn data_file(dir: &Path, name: &str, seed: u64) -> std::path::PathBuf {
    let path = dir.join(name);
    sparse_file(&path, 48 * MIB, &[(0, 48 * MIB)], seed);
    path
}

fn slow_config(server: &S3Server, prefix: &str) -> hearth_store::StoreConfig {
    let mut c = config(server, prefix);
    c.concurrency = 2;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_killed_and_restarted_mid_upload_the_same_call_completes() {
    let mut server = server(S3Kind::S3sFs);
    let mut cfg = slow_config(&server, "outage");
    cfg.max_retries = 20;
    cfg.retry_timeout = Duration::from_secs(60);
    let store = Store::open(cfg).await.expect("open");
    let work = tempdir();
    let file = data_file(work.path(), "memory", 1);
    let (mut gate, progress) = gate_at(4 * MIB);
    let upload = {
        let (store, file) = (store.clone(), file.clone());
        tokio::spawn(async move {
            let options = PutOptions {
                progress: Some(progress),
                ..PutOptions::default()
            };
            store
                .put_object("o", &[FileSource::new("memory", file)], options)
                .await
        })
    };
    let at_stop = gate.reached().await;
    server.stop();
    gate.release();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!upload.is_finished(), "the upload waits for the server");
    server.start_again();
    let stats = upload
        .await
        .expect("join")
        .expect("the upload completes after the restart");
    println!("stopped at {at_stop} bytes, completed: {stats:?}");
    assert!(at_stop < 48 * MIB);
    let dest = work.path().join("out");
    store.get_object("o", &dest, None).await.expect("get");
    assert_same_file(&file, &dest.join("memory"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_outage_fails_retryably_keeps_the_old_version_and_a_retry_sends_only_the_rest() {
    let mut server = server(S3Kind::S3sFs);
    let store = Store::open(slow_config(&server, "outage")).await.expect("open");
    let work = tempdir();
    let v1 = data_file(work.path(), "v1", 1);
    store
        .put_object("o", &[FileSource::new("memory", &v1)], PutOptions::default())
        .await
        .expect("v1");
    let v2 = data_file(work.path(), "v2", 2);
    let (mut gate, progress) = gate_at(8 * MIB);
    let upload = {
        let (store, v2) = (store.clone(), v2.clone());
        tokio::spawn(async move {
            let options = PutOptions {
                progress: Some(progress),
                ..PutOptions::default()
            };
            store
                .put_object("o", &[FileSource::new("memory", v2)], options)
                .await
        })
    };
    gate.reached().await;
    server.stop();
    gate.release();
    let started = Instant::now();
    let err = upload.await.expect("join").expect_err("the bucket is gone");
    println!("after {:?}: {err}", started.elapsed());
    assert!(err.is_retryable(), "{err:?}");
    assert!(
        matches!(&err, StoreError::Remote(r) if r.kind == RemoteErrorKind::Unreachable),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(30), "bounded retries");

    server.start_again();
    let dest = work.path().join("old");
    store
        .get_object("o", &dest, None)
        .await
        .expect("v1 is still the committed version");
    assert_same_file(&v1, &dest.join("memory"));
    let retry = store
        .put_object("o", &[FileSource::new("memory", &v2)], PutOptions::default())
        .await
        .expect("retry");
    println!("retry: {retry:?}");
    assert!(
        retry.chunk_hits >= 6,
        "chunks sent before the outage are not sent again: {retry:?}"
    );
    assert_eq!(retry.chunk_hits + retry.chunks_uploaded, 48);
    let dest = work.path().join("new");
    store.get_object("o", &dest, None).await.expect("v2");
    assert_same_file(&v2, &dest.join("memory"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_server_thawed_mid_upload_the_upload_completes() {
    let server = server(S3Kind::Moto);
    let store = Store::open(slow_config(&server, "frozen")).await.expect("open");
    let work = tempdir();
    let file = data_file(work.path(), "memory", 3);
    let (mut gate, progress) = gate_at(4 * MIB);
    let upload = {
        let (store, file) = (store.clone(), file.clone());
        tokio::spawn(async move {
            let options = PutOptions {
                progress: Some(progress),
                ..PutOptions::default()
            };
            store
                .put_object("o", &[FileSource::new("memory", file)], options)
                .await
        })
    };
    let during = gate.reached().await;
    server.freeze();
    gate.release();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!upload.is_finished(), "the upload waits for the frozen server");
    server.thaw();
    let stats = upload.await.expect("join").expect("completes after the thaw");
    println!("frozen at {during} bytes: {stats:?}");
    let dest = work.path().join("out");
    store.get_object("o", &dest, None).await.expect("get");
    assert_same_file(&file, &dest.join("memory"));
}

async fn dropped_upload_keeps_the_old_manifest(kind: S3Kind) {
    let server = server(kind);
    let store = Store::open(slow_config(&server, "crash")).await.expect("open");
    let work = tempdir();
    let v1 = data_file(work.path(), "v1", 10);
    let meta = |v: &str| PutOptions {
        metadata: Some(serde_json::json!({ "version": v })),
        ..PutOptions::default()
    };
    store
        .put_object("o", &[FileSource::new("memory", &v1)], meta("v1"))
        .await
        .expect("v1");
    let v2 = data_file(work.path(), "v2", 20);
    let (mut gate, progress) = gate_at(16 * MIB);
    let upload = {
        let (store, v2) = (store.clone(), v2.clone());
        tokio::spawn(async move {
            let options = PutOptions {
                progress: Some(progress),
                ..meta("v2")
            };
            store
                .put_object("o", &[FileSource::new("memory", v2)], options)
                .await
        })
    };
    gate.reached().await;
    upload.abort(); // the upload's future is dropped mid-way, as when its process dies
    gate.release();
    assert!(upload.await.expect_err("aborted").is_cancelled());

    let m = store.get_manifest("o").await.expect("a manifest is committed");
    assert_eq!(
        m.metadata,
        Some(serde_json::json!({"version": "v1"})),
        "never a half-new one"
    );
    let dest = work.path().join("old");
    store
        .get_object("o", &dest, None)
        .await
        .expect("the old version restores");
    assert_same_file(&v1, &dest.join("memory"));

    // A new process retries: the chunks sent before the crash are found in the bucket.
    let fresh = Store::open(slow_config(&server, "crash")).await.expect("open");
    let retry = fresh
        .put_object("o", &[FileSource::new("memory", &v2)], meta("v2"))
        .await
        .expect("retry");
    println!("{kind:?} retry after the crash: {retry:?}");
    assert!(retry.chunk_hits >= 12, "{retry:?}");
    let dest = work.path().join("new");
    fresh.get_object("o", &dest, None).await.expect("v2");
    assert_same_file(&v2, &dest.join("memory"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_upload_keeps_the_old_manifest_s3s_fs() {
    dropped_upload_keeps_the_old_manifest(S3Kind::S3sFs).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_upload_keeps_the_old_manifest_moto() {
    dropped_upload_keeps_the_old_manifest(S3Kind::Moto).await
}

/// An upload that relies on chunks nobody references (its object was deleted) keeps them through a GC pass
/// that runs while it is in flight with no grace period at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pinned_upload_survives_a_concurrent_gc() {
    let server = server(S3Kind::S3sFs);
    let store = Store::open(slow_config(&server, "pins")).await.expect("open");
    let work = tempdir();
    let file = work.path().join("memory");
    sparse_file(&file, 16 * MIB, &[(0, 16 * MIB)], 30);
    let files = [FileSource::new("memory", &file)];
    store
        .put_object("old", &files, PutOptions::default())
        .await
        .expect("old");
    store.delete_object("old").await.expect("delete");

    // The new upload stops inside its first progress callback (after its first chunks are pinned and found)
    // until the GC pass is over.
    let (mut gate, progress) = gate_at(1);
    let upload = {
        let (store, files) = (store.clone(), files.clone());
        tokio::spawn(async move {
            let options = PutOptions {
                progress: Some(progress),
                ..PutOptions::default()
            };
            store.put_object("new", &files, options).await
        })
    };
    gate.reached().await;
    let gc = GcOptions {
        grace: Duration::ZERO,
        ..GcOptions::default()
    };
    let report = store.gc(&gc).await.expect("gc");
    println!("gc during the upload: {report:?}");
    assert!(report.kept_pinned >= 1, "{report:?}");
    gate.release();
    let stats = upload.await.expect("join").expect("upload");
    println!("upload: {stats:?}");
    let dest = work.path().join("out");
    store
        .get_object("new", &dest, None)
        .await
        .expect("the new object is whole");
    assert_same_file(&file, &dest.join("memory"));
    let after = store.gc(&gc).await.expect("gc");
    assert_eq!(after.deleted, 0, "everything left is referenced: {after:?}");
}
