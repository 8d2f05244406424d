//! The mount server against real S3 servers (s3s-fs and moto on loopback), driven by a raw NFSv3 client: what
//! works, what is refused and with which status, and that nothing escapes the export's prefix or read-only flag.
#![allow(clippy::unwrap_used)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use hearth_mount::BucketOptions;
use hearth_testkit::s3::S3Kind;

const RW: u64 = 0x1111;
const RO: u64 = 0x2222;

async fn seeded(kind: S3Kind) -> Fixture {
    let f = Fixture::start(kind, BucketOptions::default()).await;
    f.put("runs/42/a.txt", b"hello from the bucket").await;
    f.put("runs/42/sub/b.txt", b"bee").await;
    f.put("runs/420/sibling.txt", b"not yours").await;
    f.put("secret.txt", b"top secret").await;
    f.export(RW, "runs/42", false);
    f.export(RO, "runs/42", true);
    f
}

#[tokio::test]
async fn read_write_and_namespace_on_both_servers() {
    for kind in S3Kind::ALL {
        let f = seeded(kind).await;
        let mut c = Client::connect(f.addr).await;
        let root = c.mnt(&hearth_mount::export_name(RW)).await.unwrap();
        assert_eq!(c.mnt("/nope").await, Err(2), "{kind:?}: unknown export");

        let (st, names) = c.readdir(&root).await;
        assert_eq!(
            (st, names.clone()),
            (OK, vec!["a.txt".to_string(), "sub".to_string()]),
            "{kind:?}"
        );
        let (st, a) = c.lookup(&root, b"a.txt").await;
        assert_eq!(st, OK);
        assert_eq!(c.read(&a, 0, 4096).await, (OK, b"hello from the bucket".to_vec()));
        assert_eq!(
            c.read(&a, 6, 4).await,
            (OK, b"from".to_vec()),
            "{kind:?}: ranged read"
        );
        assert_eq!(c.getattr(&a).await, (OK, Some((1, 21))));

        // New file: created, written in two pieces, committed: a plain object.
        let (st, n) = c.create(&root, b"new.txt").await;
        assert_eq!(st, OK, "{kind:?}: create");
        assert_eq!(
            f.get("runs/42/new.txt").await,
            Some(Vec::new()),
            "{kind:?}: create makes the object"
        );
        assert_eq!(c.write(&n, 0, b"abc", 0).await, OK);
        assert_eq!(c.write(&n, 3, b"def", 0).await, OK);
        assert_eq!(
            c.read(&n, 0, 100).await,
            (OK, b"abcdef".to_vec()),
            "reads see unstable writes"
        );
        assert_eq!(c.commit(&n).await, OK);
        assert_eq!(
            f.get("runs/42/new.txt").await,
            Some(b"abcdef".to_vec()),
            "{kind:?}: committed"
        );

        // Append to an existing object (downloaded, rewritten whole).
        assert_eq!(c.write(&a, 21, b"!", 2).await, OK, "{kind:?}: stable append");
        assert_eq!(
            f.get("runs/42/a.txt").await,
            Some(b"hello from the bucket!".to_vec())
        );
        // Truncate.
        assert_eq!(c.truncate(&a, 5).await, OK);
        assert_eq!(c.commit(&a).await, OK);
        assert_eq!(
            f.get("runs/42/a.txt").await,
            Some(b"hello".to_vec()),
            "{kind:?}: truncated"
        );

        // Directories: marker, refusal to remove a full one, rename of an empty one, EXDEV for a full one.
        // s3s-fs keeps objects as plain files, so a marker key (`d/`) becomes a directory on its disk that it
        // neither lists nor answers HEAD for: directory markers are checked on moto (AWS semantics) only.
        if kind == S3Kind::Moto {
            directories(&f, &mut c, &root).await;
        }
        assert_eq!(c.remove(&root, b"sub").await, ISDIR);

        // Rename of a file: copy and delete.
        assert_eq!(c.rename(&root, b"new.txt", &root, b"moved.txt").await, OK);
        assert_eq!(f.get("runs/42/new.txt").await, None);
        assert_eq!(f.get("runs/42/moved.txt").await, Some(b"abcdef".to_vec()));
        assert_eq!(c.remove(&root, b"moved.txt").await, OK);
        assert_eq!(c.remove(&root, b"moved.txt").await, NOENT);

        // What a bucket cannot hold.
        assert_eq!(
            c.symlink(&root, b"link", b"/etc/passwd").await,
            PERM,
            "{kind:?}: symlink"
        );
        assert_eq!(
            f.keys().await,
            vec![
                "runs/42/a.txt",
                "runs/42/sub/b.txt",
                "runs/420/sibling.txt",
                "secret.txt"
            ],
            "{kind:?}: nothing else was made"
        );
    }
}

#[tokio::test]
async fn nothing_escapes_the_prefix_or_the_read_only_flag() {
    let f = seeded(S3Kind::S3sFs).await;
    let before = f.keys().await;
    let mut c = Client::connect(f.addr).await;
    let root = c.mnt(&hearth_mount::export_name(RW)).await.unwrap();
    let ro = c.mnt(&hearth_mount::export_name(RO)).await.unwrap();

    // Names that would leave the directory are refused; `..` of the root is the root.
    for bad in [
        &b"../secret.txt"[..],
        b"..%2fsecret.txt",
        b"a/../../secret.txt",
        b"/secret.txt",
        b"sub/b.txt",
    ] {
        let (st, _) = c.lookup(&root, bad).await;
        assert!(
            st == INVAL || st == NOENT,
            "{:?}: {st}",
            String::from_utf8_lossy(bad)
        );
    }
    let (st, up) = c.lookup(&root, b"..").await;
    assert_eq!(st, OK);
    assert_eq!(
        c.readdir(&up).await.1,
        vec!["a.txt", "sub"],
        ".. of the root is the root"
    );
    let (st, _) = c.lookup(&root, b"sibling.txt").await;
    assert_eq!(st, NOENT, "the sibling prefix runs/420 is not under runs/42");
    let (st, _) = c.create(&root, b"..").await;
    assert_eq!(st, INVAL);

    // Forged handles: ids never handed out, other exports, wrong lengths.
    for id in [0u64, 2, 3, 15, 16, 0xdead_beef, u64::MAX] {
        assert_eq!(c.getattr(&handle(RW, id)).await.0, STALE, "id {id}");
        assert_eq!(c.read(&handle(RW, id), 0, 10).await.0, STALE);
    }
    assert_eq!(c.getattr(&handle(0x3333, 1)).await.0, STALE, "unknown export");
    assert_eq!(c.getattr(&[1, 2, 3]).await.0, BADHANDLE);
    assert_eq!(c.getattr(&[0u8; 64]).await.0, BADHANDLE);

    // The read-only export refuses every change, whatever the client claims.
    let (_, a) = c.lookup(&ro, b"a.txt").await;
    assert_eq!(c.read(&a, 0, 5).await, (OK, b"hello".to_vec()));
    assert_eq!(c.write(&a, 0, b"X", 2).await, ROFS);
    assert_eq!(c.write(&a, 0, b"X", 0).await, ROFS);
    assert_eq!(c.truncate(&a, 0).await, ROFS);
    assert_eq!(c.create(&ro, b"x").await.0, ROFS);
    assert_eq!(c.mkdir(&ro, b"x").await, ROFS);
    assert_eq!(c.remove(&ro, b"a.txt").await, ROFS);
    assert_eq!(c.rmdir(&ro, b"sub").await, ROFS);
    assert_eq!(c.rename(&ro, b"a.txt", &ro, b"b.txt").await, ROFS);
    assert_eq!(c.symlink(&ro, b"l", b"x").await, ROFS);
    // A rename from the read-only export into the writable one is a cross-device rename.
    assert_eq!(c.rename(&ro, b"a.txt", &root, b"b.txt").await, XDEV);
    assert_eq!(f.keys().await, before, "the bucket is unchanged");
    assert_eq!(
        f.get("runs/42/a.txt").await,
        Some(b"hello from the bucket".to_vec())
    );
}

#[tokio::test]
async fn hostile_records_are_bounded_and_the_server_lives_on() {
    let f = seeded(S3Kind::Moto).await;
    // Garbage arguments: GARBAGE_ARGS, the connection stays usable.
    let mut c = Client::connect(f.addr).await;
    let (accept, _) = c.call(NFS, 3, &[0, 0, 0]).await;
    assert_eq!(accept, 4, "GARBAGE_ARGS");
    let (accept, _) = c.call(NFS, 99, &[]).await;
    assert_eq!(accept, 3, "PROC_UNAVAIL");
    let (accept, _) = c.call(4242, 0, &[]).await;
    assert_eq!(accept, 1, "PROG_UNAVAIL");
    // A string claiming 4 GiB inside a small record.
    let (accept, _) = c
        .call(
            NFS,
            3,
            &[
                0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff,
            ],
        )
        .await;
    assert_eq!(accept, 4);
    let root = c.mnt(&hearth_mount::export_name(RW)).await.unwrap();

    // A record header claiming 2 GiB: the connection is closed, nothing is allocated for it.
    let mut bad = Client::connect(f.addr).await;
    use tokio::io::AsyncWriteExt;
    let _ = bad_write(&mut bad, &0x7fff_ffffu32.to_be_bytes()).await;
    assert!(bad.read_reply().await.is_err(), "closed");

    // Random records from a seeded generator: answered or dropped, never a crash.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for i in 0..300 {
        let mut fuzz = Client::connect(f.addr).await;
        let len = (next() % 200) as usize;
        let mut rec: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        if i % 2 == 0 && rec.len() >= 24 {
            // A plausible call header so the decoders behind it get exercised.
            rec[4..8].copy_from_slice(&0u32.to_be_bytes());
            rec[8..12].copy_from_slice(&2u32.to_be_bytes());
            rec[12..16].copy_from_slice(&NFS.to_be_bytes());
            rec[16..20].copy_from_slice(&3u32.to_be_bytes());
            rec[20..24].copy_from_slice(&((next() % 23) as u32).to_be_bytes());
        }
        let mut framed = ((rec.len() as u32) | 0x8000_0000).to_be_bytes().to_vec();
        framed.extend_from_slice(&rec);
        let _ = fuzz_stream(&mut fuzz).write_all(&framed).await;
    }
    let (st, names) = c.readdir(&root).await;
    assert_eq!((st, names.len()), (OK, 2), "the server still serves");
}

async fn directories(f: &Fixture, c: &mut Client, root: &[u8]) {
    assert_eq!(c.mkdir(root, b"d").await, OK, "mkdir");
    assert!(
        f.keys().await.contains(&"runs/42/d/".to_string()),
        "marker {:?}",
        f.keys().await
    );
    assert_eq!(c.readdir(root).await.1, vec!["a.txt", "d", "new.txt", "sub"]);
    assert_eq!(c.mkdir(root, b"d").await, EXIST);
    let (_, d) = c.lookup(root, b"d").await;
    let (st, _) = c.create(&d, b"inner").await;
    assert_eq!(st, OK);
    assert_eq!(c.rmdir(root, b"d").await, NOTEMPTY);
    assert_eq!(c.rename(root, b"d", root, b"d2").await, XDEV, "full dir rename");
    assert_eq!(c.remove(&d, b"inner").await, OK);
    assert_eq!(c.rename(root, b"d", root, b"d2").await, OK, "empty dir rename");
    assert!(f.keys().await.contains(&"runs/42/d2/".to_string()));
    assert_eq!(c.rmdir(root, b"d2").await, OK);
    assert_eq!(c.rmdir(root, b"d2").await, NOENT);
}

async fn bad_write(c: &mut Client, bytes: &[u8]) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    fuzz_stream(c).write_all(bytes).await
}

fn fuzz_stream(c: &mut Client) -> &mut tokio::net::TcpStream {
    c.stream_mut()
}

#[tokio::test]
async fn a_bucket_that_stops_answering_gives_eio_in_bounded_time() {
    let opts = BucketOptions {
        op_timeout: Duration::from_secs(3),
        request_timeout: Duration::from_secs(2),
        max_retries: 1,
    };
    let f = Fixture::start(S3Kind::S3sFs, opts).await;
    f.put("p/x.txt", b"x").await;
    f.export(RW, "p", false);
    let mut c = Client::connect(f.addr).await;
    let root = c.mnt(&hearth_mount::export_name(RW)).await.unwrap();
    f.s3.freeze();
    let t = Instant::now();
    let (st, _) = c.lookup(&root, b"x.txt").await;
    let took = t.elapsed();
    f.s3.thaw();
    assert_eq!(st, IO, "EIO while the bucket is frozen");
    assert!(took < Duration::from_secs(10), "answered in {took:?}");
    // Taken as down for a few seconds (a client's retries fail at once), then used again.
    let (st, _) = c.lookup(&root, b"x.txt").await;
    assert_eq!(st, IO, "still taken as down right after the timeout");
    let deadline = Instant::now() + Duration::from_secs(15);
    let x = loop {
        let (st, x) = c.lookup(&root, b"x.txt").await;
        if st == OK {
            break x;
        }
        assert!(Instant::now() < deadline, "works again once it answers");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    assert_eq!(c.read(&x, 0, 10).await, (OK, b"x".to_vec()));
}
