//! The host client against a scripted, misbehaving guest: stale handshake frames, version mismatch, credit
//! overrun, unknown streams, malformed headers, message floods, lying file reads, abandoned streams.

use std::time::Duration;

use bytes::Bytes;
use hearth_proto::client::{AgentClient, ClientError, ExecEvent};
use hearth_proto::frame::{MAGIC, encode};
use hearth_proto::io::FrameReader;
use hearth_proto::{ErrorKind, ExecRequest, GuestMsg, HostMsg, PROTOCOL_VERSION, WINDOW};
use tokio::io::{AsyncWriteExt, DuplexStream, ReadHalf, WriteHalf};

struct FakeGuest {
    rd: FrameReader<ReadHalf<DuplexStream>>,
    wr: WriteHalf<DuplexStream>,
}

impl FakeGuest {
    async fn next(&mut self) -> (u32, HostMsg, Bytes) {
        let f = self
            .rd
            .next()
            .await
            .expect("io")
            .expect("open")
            .expect("valid frame");
        let h = f.parse::<HostMsg>().expect("host header");
        (h.stream, h.msg, f.data)
    }

    /// Next message that is not a credit grant or a repeated Hello.
    async fn next_request(&mut self) -> (u32, HostMsg, Bytes) {
        loop {
            let m = self.next().await;
            if !matches!(m.1, HostMsg::Credit { .. } | HostMsg::Hello { .. }) {
                return m;
            }
        }
    }

    async fn send(&mut self, stream: u32, msg: GuestMsg, data: &[u8]) {
        let f = encode(stream, &msg, Bytes::copy_from_slice(data)).expect("encode");
        self.wr.write_all(&f.to_vec()).await.expect("write");
    }

    /// Send, ignoring a closed connection (the client may hang up mid-flood).
    async fn try_send(&mut self, stream: u32, msg: GuestMsg, data: &[u8]) {
        let f = encode(stream, &msg, Bytes::copy_from_slice(data)).expect("encode");
        let _ = self.wr.write_all(&f.to_vec()).await;
    }

    async fn raw(&mut self, bytes: &[u8]) {
        self.wr.write_all(bytes).await.expect("write");
    }
}

fn pair() -> (DuplexStream, FakeGuest) {
    let (host, guest) = tokio::io::duplex(4 << 20);
    let (rd, wr) = tokio::io::split(guest);
    (
        host,
        FakeGuest {
            rd: FrameReader::new(rd),
            wr,
        },
    )
}

/// Connect a client to a fake guest that answers the handshake correctly.
async fn connected() -> (AgentClient, FakeGuest) {
    let (host, mut g) = pair();
    let connect = tokio::spawn(AgentClient::connect(host, Duration::from_secs(5)));
    let (_, hello, _) = g.next().await;
    let HostMsg::Hello { version, nonce, .. } = hello else {
        panic!("expected Hello, got {hello:?}")
    };
    assert_eq!(version, PROTOCOL_VERSION);
    g.send(
        0,
        GuestMsg::HelloOk {
            version,
            agent_version: "fake".into(),
            nonce,
            post_restore: None,
        },
        b"",
    )
    .await;
    let c = connect.await.expect("join").expect("connect");
    (c, g)
}

async fn wait_closed(c: &AgentClient) {
    for _ in 0..200 {
        if c.is_closed() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("client did not close the connection");
}

/// A `Hello` carrying a post-restore setup, answered by an agent from before that field (its `HelloOk` says
/// nothing of it): the client connects and reports no outcome, so the caller sends `PostRestore` itself.
#[tokio::test]
async fn an_older_agent_ignoring_the_handshake_post_restore_gives_no_outcome() {
    let (host, mut g) = pair();
    let make = || hearth_proto::PostRestore {
        unix_time_ns: 1_800_000_000_000_000_000,
        entropy: vec![9; hearth_proto::POST_RESTORE_ENTROPY_LEN],
        hostname: None,
        machine_id: None,
    };
    let connect =
        tokio::spawn(
            async move { AgentClient::connect_after_restore(host, Duration::from_secs(5), &make).await },
        );
    let (_, hello, _) = g.next().await;
    let HostMsg::Hello {
        nonce,
        post_restore: Some(req),
        ..
    } = hello
    else {
        panic!("expected a Hello with the setup, got {hello:?}")
    };
    assert_eq!(req.entropy.len(), hearth_proto::POST_RESTORE_ENTROPY_LEN);
    g.send(
        0,
        GuestMsg::HelloOk {
            version: PROTOCOL_VERSION,
            agent_version: "old".into(),
            nonce,
            post_restore: None,
        },
        b"",
    )
    .await;
    let (c, outcome) = connect.await.expect("join").expect("connect");
    assert!(outcome.is_none());
    assert!(!c.is_closed());
}

#[tokio::test]
async fn handshake_skips_stale_frames_and_garbage() {
    let (host, mut g) = pair();
    let connect = tokio::spawn(AgentClient::connect(host, Duration::from_secs(5)));
    let (_, HostMsg::Hello { nonce, .. }, _) = g.next().await else {
        panic!("no hello")
    };
    g.raw(b"junk from a previous session HRT").await;
    let mut oversize = MAGIC.to_vec();
    oversize.extend_from_slice(&u32::MAX.to_le_bytes());
    oversize.extend_from_slice(&u32::MAX.to_le_bytes());
    g.raw(&oversize).await;
    g.send(
        0,
        GuestMsg::HelloOk {
            version: PROTOCOL_VERSION,
            agent_version: "old".into(),
            nonce: nonce ^ 1,
            post_restore: None,
        },
        b"",
    )
    .await;
    g.send(5, GuestMsg::Stdout, b"stale output").await;
    g.send(
        0,
        GuestMsg::HelloOk {
            version: PROTOCOL_VERSION,
            agent_version: "new".into(),
            nonce,
            post_restore: None,
        },
        b"",
    )
    .await;
    let c = connect.await.expect("join").expect("connect");
    assert_eq!(c.agent_version(), "new");
}

#[tokio::test]
async fn hello_is_repeated_until_answered() {
    let (host, mut g) = pair();
    let connect = tokio::spawn(AgentClient::connect(host, Duration::from_secs(5)));
    // The first Hello is "lost" (the guest was not listening yet); the repeat gets through.
    let (_, HostMsg::Hello { nonce: n1, .. }, _) = g.next().await else {
        panic!("no hello")
    };
    let (_, HostMsg::Hello { nonce: n2, .. }, _) = g.next().await else {
        panic!("no repeated hello")
    };
    assert_eq!(n1, n2, "a repeat carries the same nonce");
    g.send(
        0,
        GuestMsg::HelloOk {
            version: PROTOCOL_VERSION,
            agent_version: "late".into(),
            nonce: n2,
            post_restore: None,
        },
        b"",
    )
    .await;
    let c = connect.await.expect("join").expect("connect");
    assert_eq!(c.agent_version(), "late");
}

#[tokio::test]
async fn version_mismatch_is_a_clear_error() {
    let (host, mut g) = pair();
    let connect = tokio::spawn(AgentClient::connect(host, Duration::from_secs(5)));
    let (_, HostMsg::Hello { nonce, .. }, _) = g.next().await else {
        panic!("no hello")
    };
    g.send(
        0,
        GuestMsg::HelloOk {
            version: PROTOCOL_VERSION + 1,
            agent_version: "x".into(),
            nonce,
            post_restore: None,
        },
        b"",
    )
    .await;
    match connect.await.expect("join") {
        Err(ClientError::VersionMismatch { host, agent }) => {
            assert_eq!((host, agent), (PROTOCOL_VERSION, PROTOCOL_VERSION + 1))
        }
        other => panic!("expected a version mismatch, got {other:?}"),
    }
    let (host, mut g) = pair();
    let connect = tokio::spawn(AgentClient::connect(host, Duration::from_secs(5)));
    g.next().await;
    g.send(
        0,
        GuestMsg::error(ErrorKind::VersionMismatch, "host speaks 1, agent speaks 7"),
        b"",
    )
    .await;
    let err = connect.await.expect("join").expect_err("mismatch");
    assert!(
        matches!(err, ClientError::VersionMismatch { agent: 7, .. }),
        "{err:?}"
    );
    assert!(err.to_string().contains("version 7"), "{err}");
}

#[tokio::test]
async fn silent_guest_times_out() {
    let (host, _g) = pair();
    let err = AgentClient::connect(host, Duration::from_millis(200))
        .await
        .expect_err("timeout");
    assert!(matches!(err, ClientError::Timeout), "{err:?}");
}

#[tokio::test]
async fn exceeding_credit_closes_the_connection() {
    let (c, mut g) = connected().await;
    let exec = tokio::spawn({
        let c = c.clone();
        async move { c.exec(ExecRequest::shell("yes")).await }
    });
    let (s, HostMsg::Exec(_), _) = g.next_request().await else {
        panic!("expected exec")
    };
    g.send(s, GuestMsg::Started { pid: 42 }, b"").await;
    let mut h = exec.await.expect("join").expect("exec");
    let chunk = vec![b'y'; 256 * 1024];
    for _ in 0..(WINDOW as usize / chunk.len() + 1) {
        g.try_send(s, GuestMsg::Stdout, &chunk).await;
    }
    wait_closed(&c).await;
    assert!(
        c.close_reason().expect("reason").contains("window"),
        "{:?}",
        c.close_reason()
    );
    // What was within the window is still delivered, then the stream fails.
    let mut got = 0;
    let err = loop {
        match h.next_event().await.expect("event") {
            ExecEvent::Stdout(d) => got += d.len(),
            ExecEvent::Error(e) => break e,
            other => panic!("unexpected {other:?}"),
        }
    };
    assert_eq!(got as u64, WINDOW);
    assert!(matches!(err, ClientError::Protocol(_)), "{err:?}");
    assert!(matches!(c.ping().await, Err(ClientError::Protocol(_))));
}

#[tokio::test]
async fn unknown_streams_are_ignored() {
    let (c, mut g) = connected().await;
    let ping = tokio::spawn({
        let c = c.clone();
        async move { c.ping().await }
    });
    let (s, HostMsg::Ping, _) = g.next_request().await else {
        panic!("expected ping")
    };
    for id in [0, 2, 999, s + 2, u32::MAX] {
        g.send(id, GuestMsg::Stdout, &[0u8; 200 * 1024]).await;
        g.send(id, GuestMsg::Pong, b"").await;
        g.send(id, GuestMsg::Credit { bytes: u64::MAX }, b"").await;
    }
    g.send(s, GuestMsg::Pong, b"").await;
    ping.await.expect("join").expect("ping");
    assert!(!c.is_closed());
}

#[tokio::test]
async fn data_on_a_message_without_data_is_a_protocol_error() {
    let (c, mut g) = connected().await;
    let ping = tokio::spawn({
        let c = c.clone();
        async move { c.ping().await }
    });
    let (s, _, _) = g.next_request().await;
    g.send(s, GuestMsg::Pong, b"smuggled").await;
    assert!(matches!(ping.await.expect("join"), Err(ClientError::Protocol(_))));
    assert!(c.is_closed());
}

#[tokio::test]
async fn malformed_header_and_oversize_frames_close() {
    for bad in [
        br#"{"stream":1,"msg":{"type":"bogus"}}"#.to_vec(),
        b"not json".to_vec(),
        vec![],
    ] {
        let (c, mut g) = connected().await;
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&(bad.len() as u32).to_le_bytes());
        f.extend_from_slice(&0u32.to_le_bytes());
        f.extend_from_slice(&bad);
        g.raw(&f).await;
        wait_closed(&c).await;
    }
    let (c, mut g) = connected().await;
    let mut f = MAGIC.to_vec();
    f.extend_from_slice(&10u32.to_le_bytes());
    f.extend_from_slice(&(1u32 << 30).to_le_bytes());
    g.raw(&f).await;
    wait_closed(&c).await;
    assert!(c.close_reason().expect("reason").contains("256 KiB"));
}

#[tokio::test]
async fn message_floods_are_bounded() {
    let (c, mut g) = connected().await;
    let exec = tokio::spawn({
        let c = c.clone();
        async move { c.exec(ExecRequest::shell("x")).await }
    });
    let (s, _, _) = g.next_request().await;
    g.send(s, GuestMsg::Started { pid: 1 }, b"").await;
    let _h = exec.await.expect("join").expect("exec");
    // Replies that carry no data are not flow-controlled, but the number of unconsumed messages is capped.
    for _ in 0..9000 {
        g.try_send(s, GuestMsg::Procs { procs: vec![] }, b"").await;
    }
    wait_closed(&c).await;
    assert!(
        c.close_reason().expect("reason").contains("unconsumed"),
        "{:?}",
        c.close_reason()
    );
}

#[tokio::test]
async fn tiny_data_frames_still_cost_credit() {
    let (c, mut g) = connected().await;
    let exec = tokio::spawn({
        let c = c.clone();
        async move { c.exec(ExecRequest::shell("x")).await }
    });
    let (s, _, _) = g.next_request().await;
    g.send(s, GuestMsg::Started { pid: 1 }, b"").await;
    let _h = exec.await.expect("join").expect("exec");
    // Each frame costs at least MIN_DATA_COST, so empty or 1-byte frames exhaust the window too.
    let frames = WINDOW / hearth_proto::MIN_DATA_COST;
    for i in 0..=frames {
        g.try_send(s, GuestMsg::Stdout, if i % 2 == 0 { b"" } else { b"y" })
            .await;
    }
    wait_closed(&c).await;
    assert!(
        c.close_reason().expect("reason").contains("window"),
        "{:?}",
        c.close_reason()
    );
}

#[tokio::test]
async fn file_reader_rejects_a_lying_size() {
    let (c, mut g) = connected().await;
    let read = tokio::spawn({
        let c = c.clone();
        async move {
            use futures::StreamExt;
            let (_, mut r) = c.read_file("/x").await?;
            let mut n = 0;
            while let Some(chunk) = r.next().await {
                n += chunk?.len();
            }
            Ok::<usize, ClientError>(n)
        }
    });
    let (s, HostMsg::ReadFile { path }, _) = g.next_request().await else {
        panic!("expected read")
    };
    assert_eq!(path, "/x");
    let info = hearth_proto::FileInfo {
        name: "x".into(),
        path: "/x".into(),
        kind: hearth_proto::FileKind::File,
        size: 3,
        mode: 0o644,
        mtime: 0,
        link_target: None,
    };
    g.send(s, GuestMsg::ReadStart { info }, b"").await;
    g.send(s, GuestMsg::FileData, b"abc").await;
    g.send(s, GuestMsg::ReadDone { bytes: 1000 }, b"").await;
    let err = read.await.expect("join").expect_err("lie detected");
    assert!(matches!(err, ClientError::Protocol(_)), "{err:?}");
}

#[tokio::test]
async fn abandoned_stream_frames_are_dropped_not_buffered() {
    let (c, mut g) = connected().await;
    let exec = tokio::spawn({
        let c = c.clone();
        async move { c.exec(ExecRequest::shell("yes")).await }
    });
    let (s, _, _) = g.next_request().await;
    g.send(s, GuestMsg::Started { pid: 7 }, b"").await;
    let h = exec.await.expect("join").expect("exec");
    drop(h);
    let (s2, msg, _) = g.next_request().await;
    assert_eq!((s2, msg), (s, HostMsg::Abandon));
    // A guest that ignores the Abandon and keeps sending far more than a window: dropped, no close.
    let chunk = vec![0u8; 256 * 1024];
    for _ in 0..16 {
        g.send(s, GuestMsg::Stdout, &chunk).await;
    }
    let ping = tokio::spawn({
        let c = c.clone();
        async move { c.ping().await }
    });
    let (p, HostMsg::Ping, _) = g.next_request().await else {
        panic!("expected ping")
    };
    g.send(p, GuestMsg::Pong, b"").await;
    ping.await.expect("join").expect("ping");
    assert!(!c.is_closed());
}

#[tokio::test]
async fn guest_errors_are_typed() {
    let (c, mut g) = connected().await;
    let stat = tokio::spawn({
        let c = c.clone();
        async move { c.stat("relative").await }
    });
    let (s, _, _) = g.next_request().await;
    g.send(
        s,
        GuestMsg::error(ErrorKind::InvalidPath, "path must be absolute"),
        b"",
    )
    .await;
    let err = stat.await.expect("join").expect_err("error");
    assert_eq!(err.guest_kind(), Some(ErrorKind::InvalidPath));
    assert!(!c.is_closed());
}

#[tokio::test]
async fn snapshot_requests_reject_wrong_answers() {
    use hearth_proto::{PostRestore, PostRestoreReport};
    let (c, mut g) = connected().await;
    let req = PostRestore {
        unix_time_ns: 1,
        entropy: vec![1; 64],
        hostname: Some("h".into()),
        machine_id: None,
    };
    // What goes on the wire is the typed request, unchanged.
    let call = tokio::spawn({
        let c = c.clone();
        let req = req.clone();
        async move { c.post_restore(req).await }
    });
    let (stream, msg, _) = g.next_request().await;
    assert_eq!(msg, HostMsg::PostRestore(req.clone()));
    let report = PostRestoreReport {
        clock_set: true,
        entropy_bits_credited: 512,
        crng_reseeded: true,
        hostname_set: true,
        machine_id_written: false,
    };
    g.send(stream, GuestMsg::PostRestored(report), b"").await;
    assert_eq!(call.await.expect("join").expect("report"), report);

    // A sync answered with a post-restore report, and a post-restore answered with a plain Ok: refused.
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.sync().await }
    });
    let (stream, msg, _) = g.next_request().await;
    assert_eq!(msg, HostMsg::Sync);
    g.send(stream, GuestMsg::PostRestored(report), b"").await;
    assert!(matches!(call.await.expect("join"), Err(ClientError::Protocol(_))));
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.post_restore(req).await }
    });
    let (stream, _, _) = g.next_request().await;
    g.send(stream, GuestMsg::Ok, b"").await;
    assert!(matches!(call.await.expect("join"), Err(ClientError::Protocol(_))));
    // The answer of an agent that does not know a request (a newer one) is a typed guest error, not a hang.
    let call = tokio::spawn({
        let c = c.clone();
        async move { c.sync().await }
    });
    let (stream, _, _) = g.next_request().await;
    g.send(
        stream,
        GuestMsg::error(ErrorKind::InvalidRequest, "unknown or malformed request"),
        b"",
    )
    .await;
    let err = call.await.expect("join").expect_err("refused");
    assert_eq!(err.guest_kind(), Some(ErrorKind::InvalidRequest));
    assert!(!c.is_closed());
}

#[tokio::test]
async fn watch_events_from_the_guest_are_checked() {
    let (c, mut g) = connected().await;
    let c2 = c.clone();
    let watch = tokio::spawn(async move { c2.watch_dir("/w", false).await });
    let (s, req, _) = g.next_request().await;
    assert!(
        matches!(req, HostMsg::WatchDir(ref r) if r.path == "/w"),
        "{req:?}"
    );
    g.send(s, GuestMsg::Watching, b"").await;
    let mut w = watch.await.expect("join").expect("watching");

    // A well-formed batch; an empty one is skipped; an event kind from the future is kept as `Unknown`.
    let good = br#"[{"kind":"create","path":"a"},{"kind":"teleport","path":"b"}]"#;
    g.send(s, GuestMsg::WatchEvents, b"[]").await;
    g.send(s, GuestMsg::WatchEvents, good).await;
    let batch = w.next_batch().await.expect("batch").expect("valid");
    assert_eq!(batch.len(), 2);
    assert_eq!(batch[1].kind, hearth_proto::watch::WatchEventKind::Unknown);

    // Not JSON: the watch ends with a protocol error, and nothing follows.
    g.send(s, GuestMsg::WatchEvents, b"{not json").await;
    assert!(matches!(
        w.next_batch().await,
        Some(Err(ClientError::Protocol(_)))
    ));
    assert!(w.next_batch().await.is_none());

    // An overlong path is refused the same way.
    let c2 = c.clone();
    let watch = tokio::spawn(async move { c2.watch_dir("/w", true).await });
    let (s, _, _) = g.next_request().await;
    g.send(s, GuestMsg::Watching, b"").await;
    let mut w = watch.await.expect("join").expect("watching");
    let long = format!(r#"[{{"kind":"write","path":"{}"}}]"#, "x".repeat(5000));
    g.send(s, GuestMsg::WatchEvents, long.as_bytes()).await;
    assert!(matches!(
        w.next_batch().await,
        Some(Err(ClientError::Protocol(_)))
    ));

    // A watch answered with something else fails to start.
    let c2 = c.clone();
    let watch = tokio::spawn(async move { c2.watch_dir("/w", false).await });
    let (s, _, _) = g.next_request().await;
    g.send(s, GuestMsg::Pong, b"").await;
    assert!(matches!(
        watch.await.expect("join"),
        Err(ClientError::Protocol(_))
    ));
    // Those were faults of single streams: the connection stays up.
    assert!(!c.is_closed());
}

#[tokio::test]
async fn listings_are_bounded_in_bytes_not_only_in_entries() {
    use hearth_proto::{FileInfo, FileKind, ProcInfo};
    let entry = |name: String| FileInfo {
        path: format!("/d/{name}"),
        name,
        kind: FileKind::File,
        size: 0,
        mode: 0o644,
        mtime: 0,
        link_target: None,
    };

    // One entry with a name longer than any path Linux allows.
    let (c, mut g) = connected().await;
    let list = tokio::spawn({
        let c = c.clone();
        async move { c.list_dir("/d").await }
    });
    let (s, _, _) = g.next_request().await;
    let huge = entry("n".repeat(20_000));
    g.send(s, GuestMsg::Entries { entries: vec![huge] }, b"").await;
    let err = list.await.expect("join").expect_err("a 20 KB name");
    assert!(err.to_string().contains("20000 bytes"), "{err}");

    // Far fewer entries than the count limit, but each as large as allowed: refused at the byte budget (32 MiB)
    // long before the guest's stream ends, while the daemon holds at most that much.
    let (c, mut g) = connected().await;
    let list = tokio::spawn({
        let c = c.clone();
        async move { c.list_dir("/d").await }
    });
    let (s, _, _) = g.next_request().await;
    let mut sent = 0usize;
    let mut batch_no = 0u32;
    while !list.is_finished() && sent < (64 << 20) {
        let batch: Vec<FileInfo> = (0..7)
            .map(|i| entry(format!("{batch_no}-{i}-{}", "x".repeat(4000))))
            .collect();
        batch_no += 1;
        sent += batch.iter().map(|e| e.name.len() + e.path.len()).sum::<usize>();
        g.try_send(s, GuestMsg::Entries { entries: batch }, b"").await;
        tokio::task::yield_now().await;
    }
    let err = list.await.expect("join").expect_err("a listing of 64 MiB");
    assert!(err.to_string().contains("MiB"), "{err}");
    assert!(sent <= 40 << 20, "refused only after {} MiB", sent >> 20);

    // The same for the process table's command lines.
    let (c, mut g) = connected().await;
    let procs = tokio::spawn({
        let c = c.clone();
        async move { c.list_processes().await }
    });
    let (s, _, _) = g.next_request().await;
    let p = ProcInfo {
        pid: 1,
        cmd: "c".repeat(8000),
        background: true,
        started_ms: 0,
        exit: None,
    };
    g.send(s, GuestMsg::Procs { procs: vec![p] }, b"").await;
    let err = procs.await.expect("join").expect_err("an 8 KB command line");
    assert!(err.to_string().contains("8000 bytes"), "{err}");
}

/// One sandbox's callers can hold at most `MAX_OPEN_STREAMS` streams (each may buffer a window of guest data):
/// the next is refused with a typed error before anything reaches the agent, and closing one frees a slot.
#[tokio::test]
async fn open_streams_per_connection_are_bounded() {
    use hearth_proto::client::MAX_OPEN_STREAMS;
    let (c, mut g) = connected().await;
    let mut handles = Vec::new();
    for i in 0..MAX_OPEN_STREAMS {
        let exec = tokio::spawn({
            let c = c.clone();
            async move { c.exec(ExecRequest::shell("sleep 1000")).await }
        });
        let (s, _, _) = g.next_request().await;
        g.send(s, GuestMsg::Started { pid: i as u32 + 2 }, b"").await;
        handles.push(exec.await.expect("join").expect("exec within the bound"));
    }
    let refused = c
        .exec(ExecRequest::shell("true"))
        .await
        .expect_err("one stream too many");
    assert!(
        matches!(refused, ClientError::TooManyStreams(n) if n == MAX_OPEN_STREAMS),
        "{refused}"
    );
    assert!(!c.is_closed(), "a refusal does not close the connection");
    // Nothing about the refused stream reached the agent: the next frame it sees is the Abandon below.
    drop(handles.pop());
    let (_, msg, _) = g.next_request().await;
    assert_eq!(msg, HostMsg::Abandon);
    let again = tokio::spawn({
        let c = c.clone();
        async move { c.exec(ExecRequest::shell("true")).await }
    });
    let (s, msg, _) = g.next_request().await;
    assert!(matches!(msg, HostMsg::Exec(_)), "{msg:?}");
    g.send(s, GuestMsg::Started { pid: 9999 }, b"").await;
    again.await.expect("join").expect("a freed slot is usable");
}
