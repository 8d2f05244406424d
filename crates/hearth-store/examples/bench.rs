//! The store's benchmark: chunk size trade-off, throughput against raw object_store put/get of the same bytes to
//! the same server (side by side in one run), re-save bytes, dedup of a template and forks, encryption cost.
//!
//! `cargo run --release -p hearth-store --example bench -- [--mib N] [--rounds N] [--server s3s-fs|moto]`
//! (needs `scripts/install-test-deps.sh`). Prints markdown tables.

use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use futures::StreamExt;
use hearth_store::{FileSource, PutOptions, Store, StoreConfig, StoreKey};
use hearth_testkit::s3::{S3Kind, S3Server};
use object_store::{ObjectStoreExt, WriteMultipart};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

#[tokio::main]
async fn main() -> anyhow_free::Result {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let mib: u64 = arg("--mib").map_or(Ok(256), |v| v.parse())?;
    let kind = match arg("--server").as_deref() {
        Some("moto") => S3Kind::Moto,
        _ => S3Kind::S3sFs,
    };
    let server = S3Server::start(kind, "bench");
    let work = tempfile::tempdir()?;
    println!(
        "server: {kind:?} on 127.0.0.1; object: {mib} MiB; {} cores",
        num_cpus()
    );

    // A memory-like file: data in runs of 64 KiB..4 MiB separated by holes, ~60% data.
    let memory = work.path().join("memory");
    let data_bytes = memory_like(&memory, mib * MIB, 1)?;
    // A dense file of the same size for the raw comparison (identical bytes both ways).
    let dense = work.path().join("dense");
    write_noise(&dense, mib * MIB, 2)?;

    let rounds: usize = arg("--rounds").map_or(Ok(3), |v| v.parse())?;
    println!("\n## Throughput: hearth-store vs raw object_store on the same dense {mib} MiB, same server");
    println!("(median of {rounds} interleaved rounds)\n");
    println!("| method | upload MB/s | download MB/s | requests (upload) |");
    println!("|---|---|---|---|");
    let raw = raw_store(&server);
    let default = hearth_store::config::DEFAULT_CHUNK_SIZE;
    let methods: [(&str, usize, Option<u8>); 3] = [
        ("hearth-store, 256 KiB chunks (default)", default, None),
        ("hearth-store, 256 KiB chunks, encrypted", default, Some(9u8)),
        ("hearth-store, 1 MiB chunks", MIB as usize, None),
    ];
    let mut results: Vec<Vec<(f64, f64)>> = vec![Vec::new(); methods.len() + 1];
    let mut requests = vec![mib / 8 + 2; methods.len() + 1];
    for round in 0..rounds {
        results[0].push(raw_put_get(&raw, &dense, mib * MIB).await?);
        for (i, (_, chunk, key)) in methods.iter().enumerate() {
            // A fresh prefix each round: every chunk is really uploaded.
            let store = open(
                &server,
                &format!("tp-{round}-{chunk}-{}", key.unwrap_or(0)),
                *chunk,
                *key,
            )
            .await?;
            let (up, down, chunks) = put_get(&store, &dense, work.path(), mib * MIB).await?;
            results[i + 1].push((up, down));
            requests[i + 1] = chunks * 2 + 1;
        }
    }
    let labels = std::iter::once("raw object_store, one object, multipart 8 MiB parts x16 / one GET")
        .chain(methods.iter().map(|m| m.0));
    for ((label, r), req) in labels.zip(&results).zip(&requests) {
        let (up, down) = (median(r.iter().map(|x| x.0)), median(r.iter().map(|x| x.1)));
        println!("| {label} | {up:.0} | {down:.0} | {req} |");
    }

    println!(
        "\n## Chunk size: memory-like {mib} MiB file ({} MiB data), 64 dirty 4 KiB pages per save or fork\n",
        data_bytes / MIB
    );
    println!(
        "| chunk | upload MB/s | download MB/s | chunks stored | manifest bytes | re-save uploaded | re-save / data | template + 4 forks stored / 5 copies |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for chunk in [64 * 1024, 256 * 1024, MIB, 4 * MIB] {
        let store = open(&server, &format!("cs-{chunk}"), chunk as usize, None).await?;
        let copy = work.path().join(format!("m-{chunk}"));
        std::fs::copy(&memory, &copy)?;
        let t = Instant::now();
        let first = store
            .put_object("m", &[FileSource::new("memory", &copy)], PutOptions::default())
            .await?;
        let up = mbps(data_bytes, t.elapsed());
        let dest = work.path().join(format!("out-{chunk}"));
        let t = Instant::now();
        store.get_object("m", &dest, None).await?;
        let down = mbps(data_bytes, t.elapsed());
        std::fs::remove_dir_all(&dest)?;
        dirty_scattered(&copy, mib * MIB, 64, chunk)?;
        let second = store
            .put_object("m", &[FileSource::new("memory", &copy)], PutOptions::default())
            .await?;
        // Dedup: the template and 4 forks, each fork with its own 64 dirty pages, in a prefix of their own.
        let dd = open(&server, &format!("dd-{chunk}"), chunk as usize, None).await?;
        dd.put_object("t", &[FileSource::new("memory", &memory)], PutOptions::default())
            .await?;
        for fork in 0..4u64 {
            std::fs::copy(&memory, &copy)?;
            dirty_scattered(&copy, mib * MIB, 64, 1000 + fork)?;
            dd.put_object(
                &format!("f{fork}"),
                &[FileSource::new("memory", &copy)],
                PutOptions::default(),
            )
            .await?;
        }
        let usage = dd.usage().await?;
        println!(
            "| {} KiB | {up:.0} | {down:.0} | {} | {} | {:.1} MiB | {:.2}% | {:.0} / {:.0} MiB = {:.1}% |",
            chunk / 1024,
            first.chunks_uploaded,
            first.manifest_bytes,
            second.uploaded_bytes as f64 / MIB as f64,
            100.0 * second.uploaded_bytes as f64 / data_bytes as f64,
            usage.chunk_bytes as f64 / MIB as f64,
            (5 * data_bytes) as f64 / MIB as f64,
            100.0 * usage.chunk_bytes as f64 / (5 * data_bytes) as f64
        );
    }
    Ok(())
}

async fn open(
    server: &S3Server,
    prefix: &str,
    chunk: usize,
    key: Option<u8>,
) -> Result<Store, Box<dyn std::error::Error>> {
    let env = server.env();
    let mut config = StoreConfig::from_url_with_env(&server.url(prefix), |k| {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })?;
    config.chunk_size = chunk;
    config.key = key.map(|b| StoreKey::from_bytes([b; 32]));
    Ok(Store::open(config).await?)
}

/// Upload then download `file` as one object; returns MB/s both ways and the chunk count.
async fn put_get(
    store: &Store,
    file: &Path,
    work: &Path,
    bytes: u64,
) -> Result<(f64, f64, u64), Box<dyn std::error::Error>> {
    let t = Instant::now();
    let stats = store
        .put_object("o", &[FileSource::new("f", file)], PutOptions::default())
        .await?;
    let up = mbps(bytes, t.elapsed());
    let dest = work.join(format!("get-{}", rand_suffix()));
    let t = Instant::now();
    store.get_object("o", &dest, None).await?;
    let down = mbps(bytes, t.elapsed());
    std::fs::remove_dir_all(&dest)?;
    Ok((up, down, stats.chunks_uploaded))
}

fn raw_store(server: &S3Server) -> std::sync::Arc<object_store::aws::AmazonS3> {
    std::sync::Arc::new(
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

/// Raw object_store: the file as one object (multipart, 8 MiB parts, 16 in flight), then one streaming GET.
async fn raw_put_get(
    raw: &std::sync::Arc<object_store::aws::AmazonS3>,
    file: &Path,
    bytes: u64,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    let path = object_store::path::Path::from("raw/dense");
    let f = std::fs::File::open(file)?;
    let t = Instant::now();
    let upload = raw.put_multipart(&path).await?;
    let mut writer = WriteMultipart::new_with_chunk_size(upload, 8 << 20);
    let mut buf = vec![0u8; 8 << 20];
    let mut offset = 0;
    while offset < bytes {
        let n = (bytes - offset).min(buf.len() as u64) as usize;
        f.read_exact_at(&mut buf[..n], offset)?;
        writer.wait_for_capacity(16).await?;
        writer.write(&buf[..n]);
        offset += n as u64;
    }
    writer.finish().await?;
    let up = mbps(bytes, t.elapsed());
    let t = Instant::now();
    let mut stream = raw.get(&path).await?.into_stream();
    let mut got = 0u64;
    while let Some(part) = stream.next().await {
        got += part?.len() as u64;
    }
    assert_eq!(got, bytes);
    let down = mbps(bytes, t.elapsed());
    Ok((up, down))
}

/// Writes runs of noise (64 KiB..4 MiB, page-aligned) separated by holes until ~60% is data; returns the data
/// bytes.
fn memory_like(path: &Path, size: u64, seed: u64) -> std::io::Result<u64> {
    let f = std::fs::File::create(path)?;
    f.set_len(size)?;
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut offset, mut data) = (0u64, 0u64);
    while offset < size {
        let run = ((16 + next() % 1009) * PAGE).min(size - offset);
        f.write_all_at(&noise(next(), run as usize), offset)?;
        data += run;
        offset += run + (8 + next() % 700) * PAGE;
    }
    f.sync_all()?;
    Ok(data)
}

fn write_noise(path: &Path, size: u64, seed: u64) -> std::io::Result<()> {
    let f = std::fs::File::create(path)?;
    let mut offset = 0;
    while offset < size {
        let n = (size - offset).min(8 * MIB);
        f.write_all_at(&noise(seed + offset, n as usize), offset)?;
        offset += n;
    }
    f.sync_all()
}

/// Overwrites `pages` pages spread evenly over the file (a guest that ran a little between two pauses).
fn dirty_scattered(path: &Path, size: u64, pages: u64, seed: u64) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new().write(true).open(path)?;
    let step = size / pages;
    for i in 0..pages {
        let page = (i * step + (seed.wrapping_mul(7919) + i * 104_729) % step) / PAGE * PAGE;
        f.write_all_at(&noise(seed ^ i, PAGE as usize), page)?;
    }
    f.sync_all()
}

fn noise(seed: u64, len: usize) -> Vec<u8> {
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

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = values.collect();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn mbps(bytes: u64, elapsed: std::time::Duration) -> f64 {
    bytes as f64 / 1e6 / elapsed.as_secs_f64()
}

fn rand_suffix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn num_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// `main`'s error type without anyhow (not a dependency of this crate).
mod anyhow_free {
    pub type Result = std::result::Result<(), Box<dyn std::error::Error>>;
}
