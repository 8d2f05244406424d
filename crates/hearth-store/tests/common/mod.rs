//! Shared helpers of the store's integration tests: a real S3 server per test, configurations pointing at it,
//! sparse test files, raw bucket access for fault injection.
#![allow(dead_code)]

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hearth_store::{StoreConfig, StoreKey};
use hearth_testkit::s3::{S3Kind, S3Server};
use object_store::ObjectStoreExt;

pub const MIB: u64 = 1 << 20;
pub const PAGE: u64 = 4096;

/// A server with a bucket named `bucket`.
pub fn server(kind: S3Kind) -> S3Server {
    S3Server::start(kind, "hearth-test")
}

/// A configuration for `server` under `prefix`, built the way the daemon builds it: from the URL and the
/// environment an operator would set.
pub fn config(server: &S3Server, prefix: &str) -> StoreConfig {
    let env = server.env();
    let mut c = StoreConfig::from_url_with_env(&server.url(prefix), |k| {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })
    .expect("config");
    // The tests count chunks of 1 MiB (the default is smaller; `round_trip` uses it).
    c.chunk_size = MIB as usize;
    // Tests make outages on purpose: give up on a request within a few seconds.
    c.max_retries = 3;
    c.retry_timeout = std::time::Duration::from_secs(5);
    c.request_timeout = std::time::Duration::from_secs(5);
    c
}

pub fn key(byte: u8) -> StoreKey {
    StoreKey::from_bytes([byte; 32])
}

/// Raw access to the bucket, beside the store (to corrupt or count objects).
pub fn raw(server: &S3Server) -> Arc<object_store::aws::AmazonS3> {
    Arc::new(
        object_store::aws::AmazonS3Builder::new()
            .with_bucket_name(server.bucket())
            .with_region(hearth_testkit::s3::REGION)
            .with_endpoint(server.endpoint())
            .with_allow_http(true)
            .with_access_key_id(hearth_testkit::s3::ACCESS_KEY_ID)
            .with_secret_access_key(hearth_testkit::s3::SECRET_ACCESS_KEY)
            .build()
            .expect("raw client"),
    )
}

/// Every key in the bucket with its size.
pub async fn raw_list(server: &S3Server, prefix: &str) -> Vec<(String, u64)> {
    use futures::TryStreamExt;
    use object_store::ObjectStore;
    let store = raw(server);
    let p = object_store::path::Path::from(prefix);
    let metas: Vec<object_store::ObjectMeta> = store.list(Some(&p)).try_collect().await.expect("list");
    metas
        .into_iter()
        .map(|m| (m.location.to_string(), m.size))
        .collect()
}

pub async fn raw_get(server: &S3Server, key: &str) -> Vec<u8> {
    let store = raw(server);
    let r = store
        .get(&object_store::path::Path::from(key))
        .await
        .expect("get");
    r.bytes().await.expect("bytes").to_vec()
}

pub async fn raw_put(server: &S3Server, key: &str, data: Vec<u8>) {
    let store = raw(server);
    store
        .put(&object_store::path::Path::from(key), data.into())
        .await
        .expect("put");
}

/// Deterministic pseudo-random bytes (xorshift), so that test data is incompressible and reproducible.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A sparse file of `size` bytes with noise written at each `(offset, len)`.
pub fn sparse_file(path: &Path, size: u64, regions: &[(u64, u64)], seed: u64) {
    let f = File::create(path).expect("create");
    f.set_len(size).expect("set_len");
    for (i, (off, len)) in regions.iter().enumerate() {
        f.write_all_at(&noise(seed + i as u64, *len as usize), *off)
            .expect("write");
    }
    f.sync_all().expect("sync");
}

/// Overwrites the 4 KiB pages at `pages` (page indexes) with new noise.
pub fn dirty_pages(path: &Path, pages: &[u64], seed: u64) {
    let f = std::fs::OpenOptions::new().write(true).open(path).expect("open");
    for (i, p) in pages.iter().enumerate() {
        f.write_all_at(&noise(seed + i as u64, PAGE as usize), p * PAGE)
            .expect("write");
    }
    f.sync_all().expect("sync");
}

/// Bytes actually allocated on disk.
pub fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).expect("metadata").blocks() * 512
}

/// Whether the byte at `offset` lies in a hole.
pub fn in_hole(path: &Path, offset: u64) -> bool {
    use nix::unistd::{Whence, lseek};
    let f = File::open(path).expect("open");
    let start = i64::try_from(offset).expect("offset");
    lseek(&f, start, Whence::SeekHole).expect("SEEK_HOLE") == start
}

pub fn assert_same_file(a: &Path, b: &Path) {
    let (x, y) = (
        std::fs::read(a).expect("read a"),
        std::fs::read(b).expect("read b"),
    );
    assert_eq!(
        x.len(),
        y.len(),
        "{} and {} differ in size",
        a.display(),
        b.display()
    );
    assert!(x == y, "{} and {} differ", a.display(), b.display());
}

pub fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("hearth-store-test-")
        .tempdir()
        .expect("tempdir")
}

/// Entries of `dir` (to check that a failed download left nothing behind).
pub fn entries(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read_dir")
        .flatten()
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}
