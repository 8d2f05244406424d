//! File operations through the real protocol.

mod common;

use bytes::Bytes;
use common::*;
use futures::StreamExt;
use hearth_proto::client::AgentClient;
use hearth_proto::{ErrorKind, FileKind};

fn p(dir: &tempfile::TempDir, name: &str) -> String {
    dir.path().join(name).to_str().expect("utf-8").to_owned()
}

async fn read_all(c: &AgentClient, path: &str) -> Vec<u8> {
    let (_, mut r) = c.read_file(path).await.expect("read");
    let mut v = Vec::new();
    while let Some(chunk) = r.next().await {
        v.extend_from_slice(&chunk.expect("chunk"));
    }
    v
}

fn body(
    data: &[u8],
    chunk: usize,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + use<> {
    let chunks: Vec<Result<Bytes, std::io::Error>> = data
        .chunks(chunk)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    futures::stream::iter(chunks)
}

#[tokio::test]
async fn twenty_mebibytes_round_trip_byte_identical() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let path = p(&dir, "big.bin");
    let data = noise(20 * 1024 * 1024 + 123, 42);
    let n = c
        .write_file(&path, Some(0o600), body(&data, 1024 * 1024 + 7))
        .await
        .expect("write");
    assert_eq!(n, data.len() as u64);
    assert!(
        std::fs::read(&path).expect("on disk") == data,
        "file on disk differs"
    );
    let (info, mut r) = c.read_file(&path).await.expect("read");
    assert_eq!(info.size, data.len() as u64);
    assert_eq!(info.kind, FileKind::File);
    assert_eq!(info.mode, 0o600);
    let mut got = Vec::with_capacity(data.len());
    while let Some(chunk) = r.next().await {
        let chunk = chunk.expect("chunk");
        assert!(chunk.len() <= hearth_proto::frame::MAX_DATA_LEN);
        got.extend_from_slice(&chunk);
    }
    assert!(got == data, "read back differs");
    assert!(r.is_finished());
    // No temporary files left behind.
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[tokio::test]
async fn write_truncates_keeps_mode_and_handles_empty_files() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let path = p(&dir, "f.txt");
    c.write_file(&path, Some(0o751), body(b"a long first version", 4))
        .await
        .expect("write 1");
    c.write_file(&path, None, body(b"short", 4))
        .await
        .expect("write 2");
    assert_eq!(read_all(&c, &path).await, b"short");
    assert_eq!(
        c.stat(&path).await.expect("stat").mode,
        0o751,
        "mode of the replaced file is kept"
    );
    let empty = p(&dir, "empty");
    let n = c
        .write_file(&empty, None, body(b"", 1))
        .await
        .expect("write empty");
    assert_eq!(n, 0);
    let info = c.stat(&empty).await.expect("stat");
    assert_eq!((info.size, info.mode), (0, 0o644));
    assert!(read_all(&c, &empty).await.is_empty());
}

#[tokio::test]
async fn stat_list_mkdir_rename_remove() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let sub = p(&dir, "a/b/c");
    let err = c.mkdir(&sub, false).await.expect_err("missing parents");
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
    c.mkdir(&sub, true).await.expect("mkdir -p");
    c.mkdir(&sub, true).await.expect("mkdir -p is idempotent");
    let err = c.mkdir(&sub, false).await.expect_err("exists");
    assert_eq!(err.guest_kind(), Some(ErrorKind::AlreadyExists));
    c.write_file(&format!("{sub}/x.txt"), None, body(b"xyz", 2))
        .await
        .expect("write");
    std::os::unix::fs::symlink("x.txt", format!("{sub}/link")).expect("symlink");

    let info = c.stat(&sub).await.expect("stat dir");
    assert_eq!(
        (info.kind, info.name.as_str(), info.path.as_str()),
        (FileKind::Dir, "c", sub.as_str())
    );
    let link = c.stat(&format!("{sub}/link")).await.expect("stat link");
    assert_eq!(link.kind, FileKind::Symlink);
    assert_eq!(link.link_target.as_deref(), Some("x.txt"));
    assert!(link.mtime > 1_600_000_000);

    let entries = c.list_dir(&sub).await.expect("list");
    let names: Vec<_> = entries
        .iter()
        .map(|e| (e.name.as_str(), e.kind, e.size))
        .collect();
    assert_eq!(
        names,
        [("link", FileKind::Symlink, 5), ("x.txt", FileKind::File, 3)]
    );
    assert_eq!(entries[1].path, format!("{sub}/x.txt"));
    // Reading through a symlink reads the target.
    assert_eq!(read_all(&c, &format!("{sub}/link")).await, b"xyz");

    c.rename(&format!("{sub}/x.txt"), &format!("{sub}/y.txt"))
        .await
        .expect("rename");
    assert_eq!(
        c.stat(&format!("{sub}/x.txt"))
            .await
            .expect_err("gone")
            .guest_kind(),
        Some(ErrorKind::NotFound)
    );
    assert_eq!(c.stat(&format!("{sub}/y.txt")).await.expect("renamed").size, 3);

    let top = p(&dir, "a");
    let err = c.remove(&top, false).await.expect_err("non-empty");
    assert_eq!(err.guest_kind(), Some(ErrorKind::DirectoryNotEmpty));
    c.remove(&format!("{sub}/link"), false)
        .await
        .expect("remove link");
    assert!(
        std::fs::metadata(format!("{sub}/y.txt")).is_ok(),
        "removing a link keeps its target"
    );
    c.remove(&top, true).await.expect("remove -r");
    assert!(!std::path::Path::new(&top).exists());
    let err = c.remove(&top, true).await.expect_err("already gone");
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
}

#[tokio::test]
async fn large_directories_come_in_batches() {
    let (_a, c) = setup().await;
    let dir = scratch();
    for i in 0..1500 {
        std::fs::write(dir.path().join(format!("file-with-a-long-name-{i:05}")), b"").expect("create");
    }
    let entries = c
        .list_dir(dir.path().to_str().expect("utf-8"))
        .await
        .expect("list");
    assert_eq!(entries.len(), 1500);
    assert!(
        entries.windows(2).all(|w| w[0].name < w[1].name),
        "sorted by name"
    );
}

fn kind<T>(what: &str, r: Result<T, hearth_proto::client::ClientError>) -> Option<ErrorKind> {
    match r {
        Ok(_) => panic!("{what:?} was accepted"),
        Err(e) => e.guest_kind(),
    }
}

#[tokio::test]
async fn bad_paths_get_typed_errors() {
    let (_a, c) = setup().await;
    let dir = scratch();
    for bad in ["", "relative/path", "./x", "/tmp/nul\0byte"] {
        assert_eq!(
            kind(bad, c.stat(bad).await),
            Some(ErrorKind::InvalidPath),
            "stat {bad:?}"
        );
        assert_eq!(
            kind(bad, c.read_file(bad).await),
            Some(ErrorKind::InvalidPath),
            "read {bad:?}"
        );
        assert_eq!(
            kind(bad, c.write_file(bad, None, body(b"x", 1)).await),
            Some(ErrorKind::InvalidPath),
            "write {bad:?}"
        );
        assert_eq!(
            kind(bad, c.mkdir(bad, true).await),
            Some(ErrorKind::InvalidPath),
            "mkdir {bad:?}"
        );
        assert_eq!(
            kind(bad, c.remove(bad, true).await),
            Some(ErrorKind::InvalidPath),
            "remove {bad:?}"
        );
        assert_eq!(
            kind(bad, c.list_dir(bad).await),
            Some(ErrorKind::InvalidPath),
            "list {bad:?}"
        );
        assert_eq!(
            kind(bad, c.rename("/tmp", bad).await),
            Some(ErrorKind::InvalidPath),
            "rename {bad:?}"
        );
    }
    let long = format!("/{}", "a/".repeat(3000));
    assert_eq!(
        c.stat(&long).await.expect_err("long").guest_kind(),
        Some(ErrorKind::InvalidPath)
    );

    let missing = p(&dir, "nope/file");
    let err = c
        .write_file(&missing, None, body(&noise(3 << 20, 1), 1 << 20))
        .await
        .expect_err("no parent");
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
    let err = c.read_file(&p(&dir, "nope")).await.expect_err("missing");
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotFound));
    let d = dir.path().to_str().expect("utf-8");
    assert_eq!(
        c.read_file(d).await.expect_err("dir").guest_kind(),
        Some(ErrorKind::IsADirectory)
    );
    assert_eq!(
        c.write_file(d, None, body(b"x", 1))
            .await
            .expect_err("dir")
            .guest_kind(),
        Some(ErrorKind::IsADirectory)
    );
    let f = p(&dir, "plain");
    std::fs::write(&f, b"x").expect("create");
    let err = c
        .write_file(&format!("{f}/child"), None, body(b"x", 1))
        .await
        .expect_err("file as dir");
    assert_eq!(err.guest_kind(), Some(ErrorKind::NotADirectory));
    assert_eq!(
        c.list_dir(&f).await.expect_err("file").guest_kind(),
        Some(ErrorKind::NotADirectory)
    );
    // The connection is still fine after all that.
    c.ping().await.expect("ping");
}

#[tokio::test]
async fn abandoned_read_and_failed_body_leave_nothing_behind() {
    let (_a, c) = setup().await;
    let dir = scratch();
    let path = p(&dir, "big");
    std::fs::write(&path, noise(8 << 20, 2)).expect("create");
    let (_, mut r) = c.read_file(&path).await.expect("read");
    let first = r.next().await.expect("chunk").expect("ok");
    assert!(!first.is_empty());
    drop(r);
    c.ping().await.expect("ping after abandoning a read");

    // A body stream that fails half-way: error reported, no file and no temp file left.
    let target = p(&dir, "half");
    let items: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::from(noise(2 << 20, 3))),
        Err(std::io::Error::other("client went away")),
    ];
    let err = c
        .write_file(&target, None, futures::stream::iter(items))
        .await
        .expect_err("body error");
    assert!(
        matches!(err, hearth_proto::client::ClientError::Body(_)),
        "{err:?}"
    );
    let clean = wait_until(std::time::Duration::from_secs(5), || {
        std::fs::read_dir(dir.path())
            .map(|d| d.count() == 1)
            .unwrap_or(false)
    })
    .await;
    assert!(clean, "temporary file left behind");
    c.ping().await.expect("ping");
}
