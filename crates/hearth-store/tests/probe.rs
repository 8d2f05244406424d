//! The start-up probe against real servers: a healthy bucket passes and leaves nothing behind; no such bucket,
//! bad credentials (s3s-fs checks SigV4) and an unreachable endpoint are classified, quickly, without secrets
//! in the message.

mod common;

use std::time::{Duration, Instant};

use common::*;
use hearth_store::{ProbeStep, RemoteErrorKind, Secret, Store, StoreError, probe};
use hearth_testkit::s3::S3Kind;

#[tokio::test]
async fn a_healthy_bucket_passes_on_both_servers() {
    for kind in S3Kind::ALL {
        let server = server(kind);
        probe(&config(&server, "p"))
            .await
            .unwrap_or_else(|e| panic!("{kind:?}: {e}"));
        assert!(
            raw_list(&server, "p/probe").await.is_empty(),
            "{kind:?}: the probe object is deleted"
        );
    }
}

#[tokio::test]
async fn no_such_bucket() {
    for kind in S3Kind::ALL {
        let server = server(kind);
        let mut cfg = config(&server, "p");
        cfg.bucket = "no-such-bucket".to_owned();
        let err = probe(&cfg).await.expect_err("missing bucket");
        println!("{kind:?}: {err}");
        assert_eq!(
            (err.step, err.kind()),
            (ProbeStep::Bucket, RemoteErrorKind::NoSuchBucket),
            "{kind:?}: {err}"
        );
        let open = Store::open(cfg).await.err().expect("open fails too");
        assert!(
            matches!(open, StoreError::Remote(ref r) if r.kind == RemoteErrorKind::NoSuchBucket),
            "{open:?}"
        );
    }
}

#[tokio::test]
async fn bad_credentials() {
    let server = server(S3Kind::S3sFs);
    let mut cfg = config(&server, "p");
    let secret = "wrong-secret-Zq81xLmv";
    cfg.credentials.secret_access_key = Secret::new(secret);
    let err = probe(&cfg).await.expect_err("bad secret");
    println!("bad secret: {err}");
    assert_eq!(err.kind(), RemoteErrorKind::AccessDenied, "{err}");
    assert!(!err.to_string().contains(secret) && !format!("{err:?}").contains(secret));

    cfg.credentials.access_key_id = "unknown-key-id".to_owned();
    let err = probe(&cfg).await.expect_err("unknown key id");
    println!("unknown key id: {err}");
    assert_eq!(err.kind(), RemoteErrorKind::AccessDenied, "{err}");
    assert!(
        !err.to_string().contains("unknown-key-id"),
        "the key id is scrubbed too: {err}"
    );
    assert!(
        !format!("{cfg:?}").contains(secret),
        "Debug of the config hides the secret"
    );
}

#[tokio::test]
async fn unreachable_endpoint() {
    // A port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let env = [
        ("AWS_ENDPOINT_URL", format!("http://127.0.0.1:{port}")),
        ("AWS_ACCESS_KEY_ID", "id".to_owned()),
        ("AWS_SECRET_ACCESS_KEY", "secret-value".to_owned()),
    ];
    let cfg = hearth_store::StoreConfig::from_url_with_env("s3://bucket/p", |k| {
        env.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
    })
    .expect("config");
    let started = Instant::now();
    let err = probe(&cfg).await.expect_err("nothing listens");
    println!("unreachable after {:?}: {err}", started.elapsed());
    assert_eq!(
        (err.step, err.kind()),
        (ProbeStep::Bucket, RemoteErrorKind::Unreachable),
        "{err}"
    );
    assert!(err.source.is_retryable());
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the probe gives up quickly"
    );
}
