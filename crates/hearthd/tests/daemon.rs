//! The real `hearthd` binary without VMs: key file, listen address, open and protected routes, graceful
//! shutdown on SIGTERM, and a restart that keeps the key.

mod common;

use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use common::Daemon;
use reqwest::StatusCode;

#[tokio::test]
async fn key_file_listen_addr_sigterm_and_restart() {
    let mut d = Daemon::start().await;
    let key_file = d.data_dir().join("api-key");
    assert_eq!(
        std::fs::metadata(&key_file).expect("key file").mode() & 0o777,
        0o600
    );
    assert!(d.key.starts_with("hk_") && d.key.len() == 67, "{}", d.key);
    let db = std::fs::read(d.data_dir().join("state.db")).expect("db");
    assert!(
        !db.windows(d.key.len()).any(|w| w == d.key.as_bytes()),
        "the plain key must not be stored"
    );

    let health = d.http.get(d.url("/healthz")).send().await.expect("healthz");
    assert_eq!(health.text().await.expect("text"), "ok");
    let anon = d.http.get(d.url("/v1/sandboxes")).send().await.expect("list");
    assert_eq!(anon.status(), StatusCode::UNAUTHORIZED);
    let (status, sys) = d.call(reqwest::Method::GET, "/v1/system", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(sys["vmm"], "qemu");
    assert!(sys["vmm_reason"].as_str().is_some_and(|r| !r.is_empty()), "{sys}");
    assert!(!d.log().contains(&d.key), "the key must never be logged");

    // SIGTERM: the server stops promptly and cleanly.
    let pid = d.pid().expect("pid");
    // SAFETY: kill(2) has no memory-safety preconditions; the pid is our child.
    unsafe {
        libc::kill(pid as i32, libc::SIGTERM);
    }
    let started = Instant::now();
    let status = loop {
        if let Some(s) = d.try_wait() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "hearthd ignored SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}: {}", d.log());

    // A restart on the same data dir keeps the key.
    let key = d.key.clone();
    d.kill9_and_restart().await;
    assert_eq!(d.key, key);
    let (status, _) = d.call(reqwest::Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(status, StatusCode::OK);
}
