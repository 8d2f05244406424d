//! Objects against real S3 servers (s3s-fs and moto): round trips of sparse multi-file objects, dedup across
//! variants, re-saves, listing and deletion, bad names, corrupted and missing chunks.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use common::*;
use hearth_store::{FileSource, GcOptions, PutOptions, Store, StoreError};
use hearth_testkit::s3::S3Kind;
use object_store::ObjectStoreExt;

/// Runs `$body` (an async fn taking an `S3Kind`) as one test per server.
macro_rules! on_both {
    ($name:ident) => {
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn s3s_fs() {
                super::$name(hearth_testkit::s3::S3Kind::S3sFs).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn moto() {
                super::$name(hearth_testkit::s3::S3Kind::Moto).await
            }
        }
    };
}

/// A paused-VM-like object: sparse memory, a small device state, a sparse disk image with a tail that is not
/// chunk-aligned, and an empty file.
fn vm_like(dir: &std::path::Path, seed: u64) -> Vec<FileSource> {
    let memory = dir.join("memory");
    sparse_file(
        &memory,
        48 * MIB,
        &[
            (0, 2 * MIB),
            (5 * MIB + 3 * PAGE, PAGE),
            (20 * MIB, 3 * MIB + 512),
            (47 * MIB, MIB),
        ],
        seed,
    );
    let state = dir.join("state");
    std::fs::write(&state, noise(seed + 100, 100_000)).expect("state");
    let disk = dir.join("disk");
    sparse_file(
        &disk,
        32 * MIB + 1234,
        &[(MIB, MIB), (32 * MIB, 1234)],
        seed + 200,
    );
    let empty = dir.join("empty");
    std::fs::write(&empty, b"").expect("empty");
    vec![
        FileSource::new("memory", memory),
        FileSource::new("state", state),
        FileSource::new("disk.ext4", disk),
        FileSource::new("empty", empty),
    ]
}

async fn round_trip(kind: S3Kind) {
    let server = server(kind);
    let mut cfg = config(&server, "rt");
    cfg.chunk_size = hearth_store::config::DEFAULT_CHUNK_SIZE;
    let store = Store::open(cfg).await.expect("open");
    let work = tempdir();
    let files = vm_like(work.path(), 1);
    let seen = Arc::new(AtomicU64::new(0));
    let progress = {
        let seen = seen.clone();
        Arc::new(move |p: hearth_store::Progress| {
            assert!(p.done_bytes <= p.total_bytes);
            seen.fetch_max(p.done_bytes, Ordering::Relaxed);
        })
    };
    let options = PutOptions {
        metadata: Some(serde_json::json!({"vmm": "qemu", "kernel": "6.1"})),
        progress: Some(progress),
    };
    let stats = store
        .put_object("sandboxes/sb-1/pause", &files, options)
        .await
        .expect("put");
    println!("{kind:?} upload: {stats:?}");
    let total = 48 * MIB + 100_000 + 32 * MIB + 1234;
    assert_eq!(stats.total_bytes, total);
    assert_eq!(seen.load(Ordering::Relaxed), total, "progress reaches the total");
    assert!(stats.zero_bytes > 60 * MIB, "holes are not uploaded: {stats:?}");
    assert!(stats.uploaded_bytes < 10 * MIB, "{stats:?}");

    let manifest = store
        .get_manifest("sandboxes/sb-1/pause")
        .await
        .expect("manifest");
    assert_eq!(
        manifest.metadata,
        Some(serde_json::json!({"vmm": "qemu", "kernel": "6.1"}))
    );
    assert_eq!(manifest.files.len(), 4);

    let dest = work.path().join("restored");
    let got = store
        .get_object("sandboxes/sb-1/pause", &dest, None)
        .await
        .expect("get");
    assert_eq!(got.total_bytes, total);
    for f in &files {
        let restored = dest.join(&f.name);
        assert_same_file(&f.path, &restored);
        assert!(
            allocated(&restored) <= allocated(&f.path) + 64 * 1024,
            "{}: {} bytes allocated, source {}",
            f.name,
            allocated(&restored),
            allocated(&f.path)
        );
    }
    // Holes of the source stay holes: inside an all-zero chunk and inside a partly written chunk.
    assert!(in_hole(&dest.join("memory"), 10 * MIB));
    assert!(in_hole(&dest.join("memory"), 5 * MIB + 10 * PAGE));
    assert!(in_hole(&dest.join("disk.ext4"), 16 * MIB));

    // A second get to an existing destination is refused without touching it.
    let again = store.get_object("sandboxes/sb-1/pause", &dest, None).await;
    assert!(
        matches!(again, Err(StoreError::DestinationExists(_))),
        "{again:?}"
    );

    let listed = store.list_objects("sandboxes").await.expect("list");
    assert_eq!(
        listed.iter().map(|o| o.name.as_str()).collect::<Vec<_>>(),
        ["sandboxes/sb-1/pause"]
    );
    assert!(
        store.list_objects("sandbox").await.expect("list").is_empty(),
        "prefixes match whole segments"
    );
    assert!(matches!(
        store.get_manifest("nope").await,
        Err(StoreError::NotFound(_))
    ));
    assert!(matches!(
        store.put_object("../escape", &files, PutOptions::default()).await,
        Err(StoreError::InvalidName { .. })
    ));
    let bad_file = [FileSource::new("../x", &files[0].path)];
    assert!(matches!(
        store.put_object("ok", &bad_file, PutOptions::default()).await,
        Err(StoreError::InvalidFileName { .. })
    ));
}
on_both!(round_trip);

async fn dedup_across_variants(kind: S3Kind) {
    let server = server(kind);
    let store = Store::open(config(&server, "dedup")).await.expect("open");
    let work = tempdir();
    let base = work.path().join("base");
    // 24 MiB of data in a 32 MiB file: a template's memory.
    sparse_file(&base, 32 * MIB, &[(0, 24 * MIB)], 7);
    store
        .put_object(
            "templates/t",
            &[FileSource::new("memory", &base)],
            PutOptions::default(),
        )
        .await
        .expect("put");
    let one_copy = store.usage().await.expect("usage").chunk_bytes;
    for fork in 0..4u64 {
        let path = work.path().join(format!("fork{fork}"));
        std::fs::copy(&base, &path).expect("copy");
        // Each fork changes a few pages of its own.
        dirty_pages(
            &path,
            &[fork * 700 + 3, fork * 700 + 300, 6000 + fork],
            1000 + fork,
        );
        let stats = store
            .put_object(
                &format!("forks/f{fork}"),
                &[FileSource::new("memory", &path)],
                PutOptions::default(),
            )
            .await
            .expect("put fork");
        assert!(stats.chunks_uploaded <= 3, "{stats:?}");
    }
    let usage = store.usage().await.expect("usage");
    let full = 5 * 24 * MIB;
    println!(
        "{kind:?} dedup: template + 4 forks store {} bytes in {} chunks; 5 full copies of the data: {full} bytes \
         ({:.1}%); one copy {one_copy}",
        usage.chunk_bytes,
        usage.chunks,
        100.0 * usage.chunk_bytes as f64 / full as f64
    );
    assert!(usage.chunk_bytes < one_copy + 13 * MIB, "{usage:?}");
    assert!(usage.chunk_bytes * 3 < full, "far less than 5 copies");
    for fork in 0..4u64 {
        let dest = work.path().join(format!("out{fork}"));
        store
            .get_object(&format!("forks/f{fork}"), &dest, None)
            .await
            .expect("get");
        assert_same_file(&work.path().join(format!("fork{fork}")), &dest.join("memory"));
    }
}
on_both!(dedup_across_variants);

async fn resave_uploads_only_changed_chunks(kind: S3Kind) {
    let server = server(kind);
    let store = Store::open(config(&server, "resave")).await.expect("open");
    let work = tempdir();
    let memory = work.path().join("memory");
    sparse_file(&memory, 64 * MIB, &[(0, 40 * MIB)], 3);
    let files = [FileSource::new("memory", &memory)];
    let first = store
        .put_object("sb/pause", &files, PutOptions::default())
        .await
        .expect("put");
    // Change 6 pages: two in one chunk, four in four other chunks (one of them in a hole).
    dirty_pages(&memory, &[10, 11, 1000, 3000, 7000, 12_000], 99);
    let second = store
        .put_object("sb/pause", &files, PutOptions::default())
        .await
        .expect("re-save");
    println!(
        "{kind:?} re-save after 6 dirty pages: uploaded {} of {} bytes ({:.2}%), first save {}",
        second.uploaded_bytes,
        second.total_bytes,
        100.0 * second.uploaded_bytes as f64 / second.total_bytes as f64,
        first.uploaded_bytes
    );
    assert_eq!(second.chunks_uploaded, 5, "{second:?}");
    assert_eq!(second.uploaded_bytes, 5 * MIB);
    // A fresh process (no index of known chunks) asks the bucket and still uploads nothing.
    let fresh = Store::open(config(&server, "resave")).await.expect("open");
    let third = fresh
        .put_object("sb/pause", &files, PutOptions::default())
        .await
        .expect("third");
    assert_eq!((third.chunks_uploaded, third.chunk_hits), (0, 41), "{third:?}");
    let dest = work.path().join("out");
    fresh.get_object("sb/pause", &dest, None).await.expect("get");
    assert_same_file(&memory, &dest.join("memory"));
}
on_both!(resave_uploads_only_changed_chunks);

/// Finds the stored chunk of `object`'s first file at chunk index `index`.
async fn chunk_key(store: &Store, object: &str, index: usize) -> String {
    let m = store.get_manifest(object).await.expect("manifest");
    let id = m.files[0].chunks[index].clone().expect("a data chunk");
    format!("{}/chunks/{}/{id}", store.config().prefix, &id[..2])
}

async fn corrupted_and_missing_chunks(kind: S3Kind) {
    let server = server(kind);
    let store = Store::open(config(&server, "bad")).await.expect("open");
    let work = tempdir();
    let a = work.path().join("a");
    let b = work.path().join("b");
    sparse_file(&a, 4 * MIB, &[(0, 4 * MIB)], 11);
    sparse_file(&b, 4 * MIB, &[(0, 4 * MIB)], 22);
    store
        .put_object("objects/a", &[FileSource::new("data", &a)], PutOptions::default())
        .await
        .expect("a");
    store
        .put_object("objects/b", &[FileSource::new("data", &b)], PutOptions::default())
        .await
        .expect("b");

    let key = chunk_key(&store, "objects/a", 2).await;
    match server.data_dir() {
        // s3s-fs: flip the byte in the server's own file, as bit rot would.
        Some(dir) => {
            let path = dir.join(server.bucket()).join(&key);
            let mut bytes = std::fs::read(&path).expect("the chunk's file");
            bytes[12345] ^= 0x01;
            std::fs::write(&path, bytes).expect("write");
        }
        None => {
            let mut bytes = raw_get(&server, &key).await;
            bytes[12345] ^= 0x01;
            raw_put(&server, &key, bytes).await;
        }
    }
    let out = work.path().join("out");
    std::fs::create_dir(&out).expect("out");
    let err = store.get_object("objects/a", &out.join("a"), None).await;
    let err = match err {
        Err(e) => e,
        Ok(_) => panic!("a flipped byte must fail the download"),
    };
    println!("{kind:?} flipped byte: {err}");
    assert!(
        matches!(&err, StoreError::ChunkCorrupt { object, .. } if object == "objects/a"),
        "{err:?}"
    );
    assert!(err.to_string().contains("objects/a") && err.to_string().contains(&key[key.len() - 64..]));
    assert!(
        entries(&out).is_empty(),
        "nothing half-written: {:?}",
        entries(&out)
    );
    let got_b = store
        .get_object("objects/b", &out.join("b"), None)
        .await
        .expect("b still restores");
    assert_eq!(got_b.downloaded_bytes, 4 * MIB);
    assert_same_file(&b, &out.join("b").join("data"));

    let key = chunk_key(&store, "objects/b", 1).await;
    raw(&server)
        .delete(&object_store::path::Path::from(key.as_str()))
        .await
        .expect("delete");
    let err = store
        .get_object("objects/b", &out.join("b2"), None)
        .await
        .expect_err("missing chunk");
    assert!(
        matches!(&err, StoreError::ChunkMissing { object, .. } if object == "objects/b"),
        "{err:?}"
    );
    assert_eq!(entries(&out), vec![out.join("b")]);
}
on_both!(corrupted_and_missing_chunks);

async fn delete_and_gc(kind: S3Kind) {
    let server = server(kind);
    let store = Store::open(config(&server, "gc")).await.expect("open");
    let work = tempdir();
    let shared = work.path().join("shared");
    sparse_file(&shared, 8 * MIB, &[(0, 8 * MIB)], 5);
    let other = work.path().join("other");
    std::fs::copy(&shared, &other).expect("copy");
    dirty_pages(&other, &[0, 600, 1500], 55);
    store
        .put_object("x/one", &[FileSource::new("m", &shared)], PutOptions::default())
        .await
        .expect("one");
    store
        .put_object("x/two", &[FileSource::new("m", &other)], PutOptions::default())
        .await
        .expect("two");
    let before = store.usage().await.expect("usage");
    assert_eq!(before.chunks, 8 + 3);

    // Fresh chunks are protected by the grace period, even when unreferenced.
    assert!(store.delete_object("x/one").await.expect("delete"));
    assert!(!store.delete_object("x/one").await.expect("delete again"));
    let young = store.gc(&GcOptions::default()).await.expect("gc");
    assert_eq!((young.deleted, young.kept_young), (0, 3), "{young:?}");

    // Deleting one of two sharers removes only its own chunks; the other stays whole.
    let now = GcOptions {
        grace: std::time::Duration::ZERO,
        max_deletions: 2,
    };
    let first = store.gc(&now).await.expect("gc");
    assert_eq!(
        (first.deleted, first.remaining, first.referenced),
        (2, 1, 8),
        "{first:?}"
    );
    let second = store.gc(&now).await.expect("gc");
    assert_eq!((second.deleted, second.remaining), (1, 0), "{second:?}");
    assert_eq!(store.usage().await.expect("usage").chunks, 8);
    let dest = work.path().join("two");
    store
        .get_object("x/two", &dest, None)
        .await
        .expect("the other sharer restores");
    assert_same_file(&other, &dest.join("m"));

    // After deleting everything, no chunk remains.
    assert!(store.delete_object("x/two").await.expect("delete"));
    let last = store
        .gc(&GcOptions {
            grace: std::time::Duration::ZERO,
            ..GcOptions::default()
        })
        .await
        .expect("gc");
    assert_eq!(last.deleted, 8, "{last:?}");
    let left = raw_list(&server, "gc/chunks").await;
    assert!(left.is_empty(), "chunks left: {left:?}");
    assert!(raw_list(&server, "gc/manifests").await.is_empty());
}
on_both!(delete_and_gc);
