//! Client-side encryption against real servers: the bucket never holds a plaintext chunk of a known file (the
//! same search finds it in a plaintext store, so the search itself works), a wrong or missing key is refused at
//! open, dedup still works under one key, and sealed manifests cannot be swapped between objects.

mod common;

use common::*;
use hearth_store::{FileSource, PutOptions, Store, StoreError};
use hearth_testkit::s3::{S3Kind, S3Server};

/// 4 KiB that appear nowhere else: the needle.
fn known_page() -> Vec<u8> {
    let mut page = b"HEARTH-KNOWN-PAGE:".to_vec();
    page.extend(noise(4242, 4096 - page.len()));
    page
}

/// A file holding the known page at several offsets among other data.
fn file_with_known_page(dir: &std::path::Path) -> std::path::PathBuf {
    let path = dir.join("memory");
    sparse_file(&path, 8 * MIB, &[(0, 3 * MIB)], 77);
    let page = known_page();
    let f = std::fs::OpenOptions::new().write(true).open(&path).expect("open");
    for offset in [0, 5 * PAGE, 2 * MIB + 3 * PAGE, 6 * MIB] {
        std::os::unix::fs::FileExt::write_all_at(&f, &page, offset).expect("write");
    }
    path
}

/// Every stored object's bytes under `prefix`: the server's own files for s3s-fs, raw GETs for moto.
async fn bucket_contents(server: &S3Server, prefix: &str) -> Vec<(String, Vec<u8>)> {
    match server.data_dir() {
        Some(dir) => {
            let root = dir.join(server.bucket()).join(prefix);
            hearth_testkit::s3::files_under(&root)
                .into_iter()
                .map(|p| (p.display().to_string(), std::fs::read(&p).expect("read")))
                .collect()
        }
        None => {
            let mut out = Vec::new();
            for (key, _) in raw_list(server, prefix).await {
                let bytes = raw_get(server, &key).await;
                out.push((key, bytes));
            }
            out
        }
    }
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

async fn no_plaintext_in_the_bucket(kind: S3Kind) {
    let server = server(kind);
    let work = tempdir();
    let file = file_with_known_page(work.path());
    let files = [FileSource::new("memory", &file)];
    let needle = known_page();

    // Control: without a key the known page is found, so the search would catch a leak.
    let plain = Store::open(config(&server, "plain")).await.expect("open");
    plain
        .put_object("o", &files, PutOptions::default())
        .await
        .expect("put");
    let plain_hits = bucket_contents(&server, "plain")
        .await
        .into_iter()
        .filter(|(_, b)| contains(b, &needle))
        .count();
    assert!(
        plain_hits >= 1,
        "the control found no plaintext: the search is broken"
    );

    let mut cfg = config(&server, "secret");
    cfg.key = Some(key(1));
    let store = Store::open(cfg).await.expect("open");
    let metadata = serde_json::json!({"owner": "HEARTH-SECRET-METADATA"});
    let options = PutOptions {
        metadata: Some(metadata),
        ..PutOptions::default()
    };
    let stats = store.put_object("o", &files, options).await.expect("put");
    let stored = bucket_contents(&server, "secret").await;
    assert!(
        stored.len() >= 4,
        "chunks, manifest and marker are stored: {}",
        stored.len()
    );
    let total: usize = stored.iter().map(|(_, b)| b.len()).sum();
    println!(
        "{kind:?}: searched {} objects, {total} bytes; upload {stats:?}",
        stored.len()
    );
    for (name, bytes) in &stored {
        assert!(
            !contains(bytes, &needle),
            "{name} holds the known page in plaintext"
        );
        assert!(
            !contains(bytes, &needle[..64]),
            "{name} holds part of the known page"
        );
        assert!(
            !contains(bytes, b"HEARTH-SECRET-METADATA"),
            "{name} holds the manifest's metadata in plaintext"
        );
        assert!(
            !contains(bytes, b"\"chunks\""),
            "{name} holds a plaintext manifest"
        );
    }

    // The right key restores it, and dedup still works within the key.
    let dest = work.path().join("out");
    store.get_object("o", &dest, None).await.expect("get");
    assert_same_file(&file, &dest.join("memory"));
    let again = store
        .put_object("o2", &files, PutOptions::default())
        .await
        .expect("put again");
    assert_eq!((again.chunks_uploaded, again.chunk_hits), (0, 4), "{again:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_plaintext_in_the_bucket_s3s_fs() {
    no_plaintext_in_the_bucket(S3Kind::S3sFs).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_plaintext_in_the_bucket_moto() {
    no_plaintext_in_the_bucket(S3Kind::Moto).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_or_missing_key_is_refused_at_open() {
    let server = server(S3Kind::S3sFs);
    let work = tempdir();
    let file = file_with_known_page(work.path());
    let mut cfg = config(&server, "enc");
    cfg.key = Some(key(1));
    let store = Store::open(cfg.clone()).await.expect("open");
    store
        .put_object("o", &[FileSource::new("memory", &file)], PutOptions::default())
        .await
        .expect("put");

    cfg.key = Some(key(2));
    let wrong = Store::open(cfg.clone())
        .await
        .err()
        .expect("a wrong key is refused");
    assert!(matches!(wrong, StoreError::WrongKey), "{wrong:?}");
    println!("wrong key: {wrong}");
    cfg.key = None;
    let missing = Store::open(cfg.clone()).await.err().expect("no key is refused");
    assert!(matches!(missing, StoreError::KeyRequired), "{missing:?}");

    let plain = Store::open(config(&server, "plain"))
        .await
        .expect("plaintext store");
    drop(plain);
    let mut with_key = config(&server, "plain");
    with_key.key = Some(key(1));
    let err = Store::open(with_key)
        .await
        .err()
        .expect("a key on a plaintext store is refused");
    assert!(matches!(err, StoreError::NotEncrypted), "{err:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_manifests_cannot_be_swapped() {
    let server = server(S3Kind::Moto);
    let work = tempdir();
    let file = file_with_known_page(work.path());
    let mut cfg = config(&server, "swap");
    cfg.key = Some(key(3));
    let store = Store::open(cfg).await.expect("open");
    let files = [FileSource::new("memory", &file)];
    store
        .put_object("a", &files, PutOptions::default())
        .await
        .expect("a");
    store
        .put_object("b", &files, PutOptions::default())
        .await
        .expect("b");
    let a = raw_get(&server, "swap/manifests/a/MANIFEST").await;
    raw_put(&server, "swap/manifests/b/MANIFEST", a).await;
    let err = store
        .get_object("b", &work.path().join("out"), None)
        .await
        .expect_err("swapped");
    assert!(
        matches!(&err, StoreError::ManifestCorrupt { object, .. } if object == "b"),
        "{err:?}"
    );
    assert!(!work.path().join("out").exists());
}
