//! `Sync` and `PostRestore` through the real protocol, on the host. The agent is given a scratch root and
//! must leave the host's clock and hostname alone; the RNG ioctls do run against the host's kernel (adding
//! entropy and reseeding is harmless). The clock and the fork-distinct RNG are checked in a real VM (`vm.rs`).

mod common;

use common::*;
use hearth_agent::{Agent, SystemConfig};
use hearth_proto::{ErrorKind, POST_RESTORE_ENTROPY_LEN, PostRestore};

fn scratch_agent() -> (Agent, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("etc")).expect("etc");
    let agent = Agent::with_system(SystemConfig {
        root: dir.path().to_owned(),
        set_clock: false,
        set_hostname: false,
    });
    (agent, dir)
}

fn good() -> PostRestore {
    PostRestore {
        unix_time_ns: 1_800_000_000_123_456_789,
        entropy: (0..POST_RESTORE_ENTROPY_LEN as u8).collect(),
        hostname: Some("sbx-fork-1".into()),
        machine_id: Some("0123456789abcdef0123456789abcdef".into()),
    }
}

#[tokio::test]
async fn sync_flushes_and_answers() {
    let (_a, c) = setup().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("data");
    let o = sh(&c, &format!("echo synced > {}", f.display())).await;
    assert_eq!(o.code, Some(0));
    tokio::time::timeout(T, c.sync())
        .await
        .expect("sync in time")
        .expect("sync");
    assert_eq!(std::fs::read_to_string(&f).expect("read"), "synced\n");
    // Twice in a row, and concurrently with other requests.
    let (a, b) = tokio::join!(c.sync(), c.ping());
    a.expect("second sync");
    b.expect("ping");
}

#[tokio::test]
async fn post_restore_applies_what_it_may() {
    let (agent, root) = scratch_agent();
    std::fs::write(
        root.path().join("etc/machine-id"),
        "ffffffffffffffffffffffffffffffff\n",
    )
    .expect("old id");
    let c = connect(&agent).await;
    let before = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let report = c.post_restore(good()).await.expect("post_restore");
    // Entropy credited in full and the CRNG reseeded through the real ioctls (the test runs as root).
    assert_eq!(report.entropy_bits_credited, 512);
    assert!(report.crng_reseeded);
    assert!(!report.clock_set, "the clock is off limits here");
    assert!(!report.hostname_set);
    assert!(report.machine_id_written);
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/machine-id")).expect("id"),
        "0123456789abcdef0123456789abcdef\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/hostname")).expect("hostname file"),
        "sbx-fork-1\n"
    );
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname"),
        before
    );
    // Without hostname and machine-id only the clock and RNG are touched.
    let report = c
        .post_restore(PostRestore {
            hostname: None,
            machine_id: None,
            ..good()
        })
        .await
        .expect("minimal post_restore");
    assert!(report.crng_reseeded && !report.machine_id_written);
}

/// The post-restore setup in the handshake (`connect_after_restore`): done before `HelloOk`, reported in it,
/// a fresh request for each `Hello` sent; a malformed one is refused there with nothing changed, and the
/// connection serves requests either way.
#[tokio::test]
async fn post_restore_rides_in_the_handshake() {
    let (agent, root) = scratch_agent();
    let (a, b) = tokio::net::UnixStream::pair().expect("socketpair");
    let ag = agent.clone();
    tokio::spawn(async move { ag.serve(a).await });
    let made = std::sync::atomic::AtomicU32::new(0);
    let make = || {
        made.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        good()
    };
    let (c, outcome) = hearth_proto::client::AgentClient::connect_after_restore(b, T, &make)
        .await
        .expect("handshake");
    let report = outcome
        .expect("this agent answers in the handshake")
        .expect("done");
    assert_eq!(report.entropy_bits_credited, 512);
    assert!(report.crng_reseeded && report.machine_id_written && !report.clock_set);
    assert!(made.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    assert_eq!(
        std::fs::read_to_string(root.path().join("etc/machine-id")).expect("id"),
        "0123456789abcdef0123456789abcdef\n"
    );
    c.ping().await.expect("the session serves requests");

    let (agent, root) = scratch_agent();
    let (a, b) = tokio::net::UnixStream::pair().expect("socketpair");
    tokio::spawn(async move { agent.serve(a).await });
    let bad = || PostRestore {
        machine_id: Some("0".repeat(32)),
        ..good()
    };
    let (c, outcome) = hearth_proto::client::AgentClient::connect_after_restore(b, T, &bad)
        .await
        .expect("the handshake itself succeeds");
    let err = outcome.expect("answered").expect_err("refused");
    assert_eq!(err.guest_kind(), Some(ErrorKind::InvalidRequest), "{err}");
    assert!(!root.path().join("etc/machine-id").exists());
    assert!(!root.path().join("etc/hostname").exists());
    c.ping().await.expect("connection healthy");
}

#[tokio::test]
async fn malformed_post_restore_is_refused_before_changing_anything() {
    let (agent, root) = scratch_agent();
    let c = connect(&agent).await;
    let bad = [
        PostRestore {
            entropy: vec![7; 63],
            ..good()
        },
        PostRestore {
            entropy: vec![7; 65],
            ..good()
        },
        PostRestore {
            entropy: Vec::new(),
            ..good()
        },
        PostRestore {
            unix_time_ns: 0,
            ..good()
        },
        PostRestore {
            unix_time_ns: -5,
            ..good()
        },
        PostRestore {
            hostname: Some(String::new()),
            ..good()
        },
        PostRestore {
            hostname: Some("a b".into()),
            ..good()
        },
        PostRestore {
            hostname: Some("-lead".into()),
            ..good()
        },
        PostRestore {
            hostname: Some("x".repeat(65)),
            ..good()
        },
        PostRestore {
            hostname: Some("../../etc".into()),
            ..good()
        },
        PostRestore {
            machine_id: Some("0123456789ABCDEF0123456789ABCDEF".into()),
            ..good()
        },
        PostRestore {
            machine_id: Some("0123456789abcdef".into()),
            ..good()
        },
        PostRestore {
            machine_id: Some("0123456789abcdef0123456789abcdeg".into()),
            ..good()
        },
        PostRestore {
            machine_id: Some("0".repeat(32)),
            ..good()
        },
        PostRestore {
            machine_id: Some("0123456789abcdef0123456789abcdef\n".into()),
            ..good()
        },
    ];
    for req in bad {
        let shown = format!("{req:?}");
        assert!(req.validate().is_err(), "{shown} validates");
        let err = c.post_restore(req).await.expect_err(&shown);
        assert_eq!(
            err.guest_kind(),
            Some(ErrorKind::InvalidRequest),
            "{shown}: {err}"
        );
    }
    // Nothing was written by any of them.
    assert!(!root.path().join("etc/machine-id").exists());
    assert!(!root.path().join("etc/hostname").exists());
    c.ping().await.expect("connection healthy");
}

#[tokio::test]
async fn unknown_requests_are_answered_not_ignored() {
    use hearth_proto::frame::encode;
    use hearth_proto::io::FrameReader;
    use tokio::io::AsyncWriteExt;

    let agent = Agent::new();
    let (a, b) = tokio::net::UnixStream::pair().expect("socketpair");
    tokio::spawn(async move { agent.serve(a).await });
    let (rd, mut wr) = b.into_split();
    let hello = hearth_proto::HostMsg::Hello {
        version: hearth_proto::PROTOCOL_VERSION,
        nonce: 9,
        post_restore: None,
    };
    let mut bytes = encode(0, &hello, bytes::Bytes::new()).expect("hello").to_vec();
    // A request type from a future protocol, hand-written.
    let header = br#"{"stream":5,"msg":{"type":"teleport","to":"mars"}}"#;
    bytes.extend_from_slice(b"HRTH");
    bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&0u32.to_le_bytes());
    bytes.extend_from_slice(header);
    wr.write_all(&bytes).await.expect("write");
    let mut reader = FrameReader::new(rd);
    let mut answered = false;
    for _ in 0..2 {
        let f = tokio::time::timeout(T, reader.next())
            .await
            .expect("in time")
            .expect("io")
            .expect("open")
            .expect("frame");
        let h = f.parse::<hearth_proto::GuestMsg>().expect("header");
        if h.stream == 5 {
            assert!(matches!(
                h.msg,
                hearth_proto::GuestMsg::Error {
                    kind: ErrorKind::InvalidRequest,
                    ..
                }
            ));
            answered = true;
        }
    }
    assert!(answered);
}
