//! PTY sessions through the real protocol, on the host: terminal size and resize (SIGWINCH), echo of input,
//! Ctrl-C as a byte, TERM, exit codes, signals, and the hang-up of an abandoned session.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use hearth_proto::client::{PtyEvent, PtyHandle};
use hearth_proto::msg::Command;
use hearth_proto::{ErrorKind, PtyRequest};

fn req(line: &str, rows: u16, cols: u16) -> PtyRequest {
    PtyRequest {
        command: Command::Argv(vec!["/bin/sh".into(), "-c".into(), line.into()]),
        env: Default::default(),
        cwd: Some("/".into()),
        rows,
        cols,
    }
}

/// Reads output until it contains `want` (or fails after 10 s); returns everything read.
async fn until(h: &mut PtyHandle, seen: &mut String, want: &str) {
    let fut = async {
        while !seen.contains(want) {
            match h.next_event().await {
                Some(PtyEvent::Output(d)) => seen.push_str(&String::from_utf8_lossy(&d)),
                other => panic!("waiting for {want:?}: {other:?}; output so far:\n{seen}"),
            }
        }
    };
    if tokio::time::timeout(T, fut).await.is_err() {
        panic!("no {want:?} in time; output so far:\n{seen}");
    }
}

/// Reads to the end; returns (code, signal).
async fn exit(h: &mut PtyHandle, seen: &mut String) -> (Option<i32>, Option<i32>) {
    let fut = async {
        loop {
            match h.next_event().await {
                Some(PtyEvent::Output(d)) => seen.push_str(&String::from_utf8_lossy(&d)),
                Some(PtyEvent::Exited { code, signal }) => return (code, signal),
                other => panic!("{other:?}"),
            }
        }
    };
    tokio::time::timeout(T, fut).await.expect("exit in time")
}

#[tokio::test]
async fn interactive_shell_size_echo_ctrl_c_and_exit_code() {
    let (_a, c) = setup().await;
    let mut h = c.pty(req("exec /bin/sh -i", 24, 80)).await.expect("pty");
    let input = h.input();
    let mut seen = String::new();

    // A real terminal, with the requested size and TERM.
    input
        .send(Bytes::from_static(b"stty size; echo term=$TERM; tty\n"))
        .await
        .expect("input");
    until(&mut h, &mut seen, "24 80").await;
    until(&mut h, &mut seen, "term=xterm-256color").await;
    until(&mut h, &mut seen, "/dev/pts/").await;

    // Resize: `stty size` follows.
    input.resize(40, 120).expect("resize");
    input
        .send(Bytes::from_static(b"stty size\n"))
        .await
        .expect("input");
    until(&mut h, &mut seen, "40 120").await;

    // Typed input is echoed by the terminal, and the command's output follows.
    input
        .send(Bytes::from_static(b"echo 'ab''cd'\n"))
        .await
        .expect("input");
    until(&mut h, &mut seen, "echo 'ab''cd'").await;
    until(&mut h, &mut seen, "abcd").await;

    // Ctrl-C is a byte: the line discipline turns it into SIGINT for the foreground job.
    input
        .send(Bytes::from_static(b"sleep 100\n"))
        .await
        .expect("input");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = std::time::Instant::now();
    input.send(Bytes::from_static(b"\x03")).await.expect("ctrl-c");
    input
        .send(Bytes::from_static(b"echo status=$?\n"))
        .await
        .expect("input");
    until(&mut h, &mut seen, "status=130").await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "sleep was not interrupted"
    );

    input.send(Bytes::from_static(b"exit 7\n")).await.expect("input");
    assert_eq!(exit(&mut h, &mut seen).await, (Some(7), None));
    assert!(h.next_event().await.is_none());
}

#[tokio::test]
async fn resize_sends_sigwinch() {
    let (_a, c) = setup().await;
    let line = "trap 'echo winch=$(stty size)' WINCH; echo ready; while :; do sleep 0.1; done";
    let mut h = c.pty(req(line, 10, 20)).await.expect("pty");
    let mut seen = String::new();
    until(&mut h, &mut seen, "ready").await;
    h.input().resize(33, 99).expect("resize");
    until(&mut h, &mut seen, "winch=33 99").await;
    h.input().signal(libc::SIGKILL).expect("signal");
    assert_eq!(exit(&mut h, &mut seen).await, (None, Some(libc::SIGKILL)));
}

#[tokio::test]
async fn output_after_exit_is_delivered_before_exited() {
    let (_a, c) = setup().await;
    let mut h = c.pty(req("seq 1 20000; exit 3", 24, 80)).await.expect("pty");
    let mut seen = String::new();
    assert_eq!(exit(&mut h, &mut seen).await, (Some(3), None));
    assert!(
        seen.contains("\r\n20000\r\n"),
        "output cut: {}",
        &seen[seen.len().saturating_sub(200)..]
    );
}

#[tokio::test]
async fn abandoned_session_is_hung_up() {
    let (_a, c) = setup().await;
    // The shell ignores nothing: SIGHUP ends it; the pid file tells us the sleeping child's pid.
    let mut h = c
        .pty(req("sleep 100 & echo child=$!; wait", 24, 80))
        .await
        .expect("pty");
    let mut seen = String::new();
    until(&mut h, &mut seen, "\n").await;
    let child: i32 = seen
        .split("child=")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .expect("child pid");
    let leader = h.pid as i32;
    drop(h);
    let gone = |pid: i32| {
        // SAFETY: kill with signal 0 only checks existence.
        unsafe { libc::kill(pid, 0) == -1 }
    };
    let deadline = std::time::Instant::now() + T;
    while !(gone(leader) && gone(child)) {
        assert!(std::time::Instant::now() < deadline, "session not hung up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The connection is still fine.
    c.ping().await.expect("ping");
}

#[tokio::test]
async fn bad_requests_are_refused() {
    let (_a, c) = setup().await;
    let err = c.pty(req("true", 0, 80)).await.expect_err("zero rows");
    assert_eq!(err.guest_kind(), Some(ErrorKind::InvalidRequest));
    let mut r = req("true", 24, 80);
    r.command = Command::Argv(vec!["/definitely/not/here".into()]);
    let err = c.pty(r).await.expect_err("missing program");
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
}

/// After a restore, a terminal opened on a connection from before the snapshot is hung up: the agent closes
/// every connection but the one that ran `PostRestore` (a restored Firecracker guest may keep its old vsock
/// connections open forever). A connection opened after the restore is left alone.
#[tokio::test]
async fn a_restore_closes_the_older_connections_and_their_terminals() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir(dir.path().join("etc")).expect("etc");
    let agent = hearth_agent::Agent::with_system(hearth_agent::SystemConfig {
        root: dir.path().to_owned(),
        set_clock: false,
        set_hostname: false,
    });
    let old = connect(&agent).await;
    let mut h = old.pty(req("echo up; sleep 100", 24, 80)).await.expect("pty");
    let mut seen = String::new();
    until(&mut h, &mut seen, "up").await;
    let leader = h.pid as i32;
    let restoring = connect(&agent).await;
    restoring
        .post_restore(hearth_proto::PostRestore {
            unix_time_ns: 1_800_000_000_000_000_000,
            entropy: vec![7; hearth_proto::POST_RESTORE_ENTROPY_LEN],
            hostname: None,
            machine_id: None,
        })
        .await
        .expect("post_restore");
    let later = connect(&agent).await;
    let deadline = std::time::Instant::now() + T;
    // SAFETY: kill with signal 0 only checks existence.
    while !(old.is_closed() && unsafe { libc::kill(leader, 0) } == -1) {
        assert!(
            std::time::Instant::now() < deadline,
            "the old connection or its terminal lives on"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    restoring.ping().await.expect("the restoring connection stays");
    later.ping().await.expect("a later connection stays");
}
