//! Helpers of the storage-bucket tests (`storage.rs`, `cache.rs`, `disk_sync.rs`): a daemon with `--storage`
//! on a real S3 server of the test, `GET /v1/storage`, a pause that must succeed, and the bucket's objects as
//! s3s-fs keeps them on disk (manifests, chunks) for the tests that tamper with them.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use hearth_testkit::s3::S3Server;
use hearth_testkit::{Network, Options, Stop};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::common::{Daemon, test_vmm};

/// The prefix inside the test bucket the daemon stores under.
pub const PREFIX: &str = "hearth";
/// A background command that counts in `/dev/shm/counter` five times a second (a process whose state only a
/// memory restore keeps).
pub const COUNTER: &str = "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/counter; sleep 0.2; done";

/// A daemon storing in `s3` (under [`PREFIX`], GC grace 0) with `extra` arguments; its data directory is under
/// a temporary directory named `tag...`.
pub async fn start_daemon_with(s3: &S3Server, tag: &str, extra: &[&str]) -> Daemon {
    let mut opts = Options::new()
        .bin(env!("CARGO_BIN_EXE_hearthd"))
        .network(Network::Unset)
        .args(["--vmm", &test_vmm(), "--network", "off"])
        .args(["--storage", &s3.url(PREFIX), "--storage-gc-grace-s", "0"])
        .args(extra)
        .tempdir_prefix(tag)
        .data_in_tempdir_root()
        .stop_on_drop(Stop::Kill)
        .kill_leftover_vmms(true)
        .log_on_panic(false);
    for (k, v) in s3.env() {
        opts = opts.env(k, v);
    }
    Daemon::start_opts(opts).await
}

/// `GET /v1/storage`.
pub async fn storage(d: &Daemon) -> Value {
    let (status, v) = d.call(Method::GET, "/v1/storage", None).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    v
}

/// Pauses `id`, which must succeed.
pub async fn pause(d: &Daemon, id: &str) {
    let (status, v) = d
        .call(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "pause {id}: {v}\n{}", d.log());
}

/// Polls `GET /v1/storage` until `done` holds (for `within` at most, else fails naming `what`) and returns the
/// last answer.
pub async fn poll_storage(d: &Daemon, what: &str, within: Duration, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let st = storage(d).await;
        if done(&st) {
            return st;
        }
        assert!(Instant::now() < deadline, "{what}: {st:#}\n{}", d.log());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `hearth storage status` against `d`: whether it exited 0, and what it printed.
pub async fn cli_storage_status(d: &Daemon) -> (bool, String) {
    let hearth = tokio::task::spawn_blocking(hearth_testkit::hearth_bin)
        .await
        .expect("hearth");
    let out = d
        .hearth(&hearth)
        .args(["storage", "status"])
        .output()
        .expect("hearth storage status");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// The prefix's directory in the s3s-fs data directory.
pub fn bucket_root(s3: &S3Server) -> PathBuf {
    s3.data_dir()
        .expect("s3s-fs keeps files")
        .join(s3.bucket())
        .join(PREFIX)
}

/// The chunk ids an object's (plaintext) manifest references.
pub fn manifest_chunks(s3: &S3Server, name: &str) -> Vec<String> {
    let path = bucket_root(s3).join("manifests").join(name).join("MANIFEST");
    let m: Value = serde_json::from_slice(&std::fs::read(&path).expect("manifest")).expect("json");
    let mut ids = Vec::new();
    for f in m["files"].as_array().cloned().unwrap_or_default() {
        for c in f["chunks"].as_array().cloned().unwrap_or_default() {
            if let Some(id) = c.as_str() {
                ids.push(id.to_owned());
            }
        }
    }
    ids
}

pub fn chunk_path(s3: &S3Server, id: &str) -> PathBuf {
    bucket_root(s3).join("chunks").join(&id[..2]).join(id)
}

/// Flips one bit in the middle of the file at `path` (a chunk object in the s3s-fs data directory).
pub fn flip_byte(path: &Path) {
    let mut bytes = std::fs::read(path).expect("chunk");
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(path, bytes).expect("write chunk");
}
