//! Background processes: table, wait with output tails, kill, stdin, and survival across reconnects.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use hearth_proto::{ErrorKind, ExecRequest};

#[tokio::test]
async fn background_process_outlives_the_request_and_reports_tails() {
    let (_a, c) = setup().await;
    let pid = c
        .spawn_background(ExecRequest::shell(
            "sleep 0.5; echo bg-out; echo bg-err >&2; exit 4",
        ))
        .await
        .expect("spawn");
    // The request has returned; the process is alive and listed as running.
    assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
    let list = c.list_processes().await.expect("list");
    let p = list.iter().find(|p| p.pid == pid).expect("listed");
    assert!(p.background);
    assert!(p.exit.is_none());
    assert!(p.cmd.contains("bg-out"));
    // A short wait times out while it runs.
    assert!(
        c.wait_process_timeout(pid, Duration::from_millis(50))
            .await
            .expect("wait")
            .is_none()
    );
    let exit = c.wait_process(pid).await.expect("wait");
    assert_eq!((exit.code, exit.signal, exit.timed_out), (Some(4), None, false));
    assert_eq!(&exit.stdout_tail[..], b"bg-out\n");
    assert_eq!(&exit.stderr_tail[..], b"bg-err\n");
    // Waiting again still answers (finished processes stay in the table).
    assert_eq!(c.wait_process(pid).await.expect("wait again").code, Some(4));
    let list = c.list_processes().await.expect("list");
    assert_eq!(
        list.iter()
            .find(|p| p.pid == pid)
            .and_then(|p| p.exit)
            .and_then(|e| e.code),
        Some(4)
    );
}

#[tokio::test]
async fn kill_reaches_the_process_group() {
    let (_a, c) = setup().await;
    let pid = c
        .spawn_background(ExecRequest::shell("sleep 30 & sleep 30; wait"))
        .await
        .expect("spawn");
    tokio::time::sleep(Duration::from_millis(100)).await;
    c.kill_process(pid, 15).await.expect("kill");
    let exit = tokio::time::timeout(T, c.wait_process(pid))
        .await
        .expect("in time")
        .expect("wait");
    assert_eq!(exit.signal, Some(15));
    // Killing a finished process is not an error; an unknown pid is.
    c.kill_process(pid, 9).await.expect("kill finished");
    let err = c.kill_process(999_999_999, 9).await.expect_err("unknown pid");
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
    let err = c.kill_process(pid, 1000).await.expect_err("bad signal");
    assert_eq!(err.guest_kind(), Some(ErrorKind::InvalidRequest));
    let err = c.wait_process(999_999_999).await.expect_err("unknown pid");
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
}

#[tokio::test]
async fn background_stdin_write_and_close() {
    let (_a, c) = setup().await;
    let pid = c
        .spawn_background(ExecRequest::argv(["cat"]).with_stdin())
        .await
        .expect("spawn");
    c.write_stdin(pid, Bytes::from_static(b"abc"), false)
        .await
        .expect("write");
    // More than one frame's worth, to exercise chunking.
    let big = Bytes::from(noise(600 * 1024, 3));
    c.write_stdin(pid, big.clone(), true)
        .await
        .expect("write and close");
    let exit = tokio::time::timeout(T, c.wait_process(pid))
        .await
        .expect("in time")
        .expect("wait");
    assert_eq!(exit.code, Some(0));
    assert_eq!(&exit.stdout_tail[..3], b"abc");
    assert!(exit.stdout_tail[3..] == big[..]);
    // Stdin is closed now.
    let err = c
        .write_stdin(pid, Bytes::from_static(b"x"), false)
        .await
        .expect_err("closed stdin");
    assert_eq!(err.guest_kind(), Some(ErrorKind::InvalidRequest));
}

#[tokio::test]
async fn output_tails_keep_the_last_mebibyte() {
    let (_a, c) = setup().await;
    // 3 MiB of numbered lines; the tail must be exactly the end of it.
    let pid = c
        .spawn_background(ExecRequest::shell("seq 1 400000"))
        .await
        .expect("spawn");
    let exit = tokio::time::timeout(Duration::from_secs(60), c.wait_process(pid))
        .await
        .expect("in time")
        .expect("wait");
    assert_eq!(exit.code, Some(0));
    assert_eq!(exit.stdout_tail.len(), hearth_proto::TAIL_MAX);
    assert!(exit.stdout_tail.ends_with(b"399999\n400000\n"));
}

#[tokio::test]
async fn processes_survive_a_reconnect() {
    let agent = hearth_agent::Agent::new();
    let c1 = connect(&agent).await;
    let pid = c1
        .spawn_background(ExecRequest::shell("sleep 30"))
        .await
        .expect("spawn");
    // A foreground exec whose connection is lost stays waitable, with its output.
    let fg = c1
        .exec(ExecRequest::shell("sleep 0.3; echo late"))
        .await
        .expect("exec");
    let fg_pid = fg.pid;
    c1.close();
    drop(fg);
    assert!(c1.is_closed());
    assert!(c1.ping().await.is_err());

    let c2 = connect(&agent).await;
    let list = c2.list_processes().await.expect("list");
    let p = list
        .iter()
        .find(|p| p.pid == pid)
        .expect("background process still listed");
    assert!(p.exit.is_none());
    let exit = tokio::time::timeout(T, c2.wait_process(fg_pid))
        .await
        .expect("in time")
        .expect("wait fg");
    assert_eq!(exit.code, Some(0));
    assert_eq!(&exit.stdout_tail[..], b"late\n");
    c2.kill_process(pid, 9).await.expect("kill");
    assert_eq!(c2.wait_process(pid).await.expect("wait").signal, Some(9));
}

#[tokio::test]
async fn hello_again_on_the_same_channel_starts_a_new_session() {
    use hearth_proto::frame::encode;
    use hearth_proto::io::FrameReader;
    use hearth_proto::{GuestMsg, HostMsg};
    use tokio::io::AsyncWriteExt;

    let agent = hearth_agent::Agent::new();
    let (a, b) = tokio::net::UnixStream::pair().expect("pair");
    let ag = agent.clone();
    tokio::spawn(async move { ag.serve(a).await });
    let (rd, mut wr) = tokio::io::split(b);
    let mut reader = FrameReader::new(rd);
    let send = |stream: u32, msg: HostMsg| encode(stream, &msg, Bytes::new()).expect("encode").to_vec();

    // Garbage and requests before Hello are ignored; a wrong version is refused clearly.
    wr.write_all(b"leftover bytes HRTH\x01").await.expect("write");
    wr.write_all(&send(1, HostMsg::Ping)).await.expect("write");
    wr.write_all(&send(
        0,
        HostMsg::Hello {
            version: 99,
            nonce: 1,
            post_restore: None,
        },
    ))
    .await
    .expect("write");
    let f = reader.next().await.expect("io").expect("frame").expect("valid");
    let h = f.parse::<GuestMsg>().expect("parse");
    assert_eq!(h.stream, 0);
    match h.msg {
        GuestMsg::Error { kind, message } => {
            assert_eq!(kind, hearth_proto::ErrorKind::VersionMismatch);
            assert!(message.contains("99"), "{message}");
        }
        other => panic!("expected a version error, got {other:?}"),
    }
    for nonce in [7u64, 8] {
        wr.write_all(&send(
            0,
            HostMsg::Hello {
                version: hearth_proto::PROTOCOL_VERSION,
                nonce,
                post_restore: None,
            },
        ))
        .await
        .expect("write");
        wr.write_all(&send(3, HostMsg::Ping)).await.expect("write");
        let mut got = Vec::new();
        while got.len() < 2 {
            let f = reader.next().await.expect("io").expect("frame").expect("valid");
            let h = f.parse::<GuestMsg>().expect("parse");
            got.push((h.stream, h.msg));
        }
        assert!(
            matches!(got[0], (0, GuestMsg::HelloOk { nonce: n, .. }) if n == nonce),
            "{got:?}"
        );
        assert_eq!(got[1], (3, GuestMsg::Pong));
    }
}

#[tokio::test]
async fn exit_is_reported_while_a_stdin_write_is_blocked() {
    let (_a, c) = setup().await;
    // The leader exits at once; a descendant keeps stdin (and stdout) open without reading.
    let pid = c
        .spawn_background(ExecRequest::shell("sleep 20 & exit 0").with_stdin())
        .await
        .expect("spawn");
    let writer = tokio::spawn({
        let c = c.clone();
        async move { c.write_stdin(pid, Bytes::from(vec![b'x'; 2 << 20]), false).await }
    });
    let exit = tokio::time::timeout(Duration::from_secs(5), c.wait_process(pid))
        .await
        .expect("exit reported despite the blocked write")
        .expect("wait");
    assert_eq!(exit.code, Some(0));
    // Killing the group reaches the leftover descendant, which unblocks (fails) the write.
    c.kill_process(pid, 9).await.expect("kill group");
    let res = tokio::time::timeout(T, writer)
        .await
        .expect("write ended")
        .expect("join");
    assert!(res.is_err(), "writing to a dead pipe must fail");
}
