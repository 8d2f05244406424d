//! The mount rows (`--only-mounts`): a bucket on a local S3 server (s3s-fs on loopback, the test tool) mounted in
//! a sandbox, measured from inside the guest (python3, monotonic clock) against the same bytes moved by a plain
//! S3 client on the host (object_store) against the same server, in the same run:
//! - sequential write and read of one file (256 MiB by default) through the mount, vs PUT (8 MiB parts, 4 in
//!   flight) and GET of it from the host; the guest's page cache is dropped before its read;
//! - `ls` (listdir) of a prefix holding 1,000 objects, each round a prefix the mount has not listed before;
//! - time to first byte of a small file (open + read of 1 byte; the file never looked up before);
//! - for the design notes: the agent channel (files API download of a file on the guest's disk) in MiB/s,
//!   the transport a FUSE file system served over it would have.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hearth_api::{CreateBucketRequest, CreateSandboxRequest, MountSpec, RunCommandRequest};
use hearth_client::Client;
use serde_json::Value;

use crate::stats::{Row, Samples};

const BUCKET: &str = "bench";
const KEY_ID: &str = "benchkey";
const SECRET: &str = "bench-secret-0123456789";

/// What the guest runs: `python3 mountbench.py DIR MIB LS_DIRS SMALL_N` prints one JSON object.
const SCRIPT: &str = r#"
import json, os, sys, time
now = time.monotonic
d, mib, ls_dirs, small = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), int(sys.argv[4])
out = {}
chunk = b"\xa5" * (1 << 20)
t = now()
with open(d + "/big", "wb") as f:
    for _ in range(mib):
        f.write(chunk)
out["write_s"] = now() - t          # close() returns once the object is uploaded
os.sync()
with open("/proc/sys/vm/drop_caches", "w") as f:
    f.write("3")
t = now(); n = 0
with open(d + "/big", "rb", buffering=0) as f:
    while True:
        b = f.read(1 << 20)
        if not b:
            break
        n += len(b)
out["read_s"] = now() - t
assert n == mib << 20, n
out["ls_s"] = []
for p in ls_dirs:
    t = now(); names = os.listdir(d + "/" + p); out["ls_s"].append(now() - t)
    assert len(names) == 1000, len(names)
out["ttfb_s"] = []
for i in range(small):
    t = now()
    with open("%s/small/%d.txt" % (d, i), "rb") as f:
        f.read(1)
    out["ttfb_s"].append(now() - t)
print(json.dumps(out))
"#;

/// Options of the mount rows.
pub struct MountArgs {
    pub template: String,
    pub memory_mib: u32,
    pub mib: u64,
    pub ls_rounds: usize,
    pub small_files: usize,
}

/// A private s3s-fs on a free loopback port.
pub struct S3sFs {
    child: Child,
    _dir: tempfile::TempDir,
    pub endpoint: String,
}

impl S3sFs {
    pub fn start() -> Result<S3sFs> {
        let bin = std::env::var_os("HEARTH_S3S_FS")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/opt/hearth/test-tools/bin/s3s-fs"));
        if !bin.is_file() {
            bail!(
                "{} is missing: run `sudo bash scripts/install-test-deps.sh` (or set HEARTH_S3S_FS)",
                bin.display()
            );
        }
        let dir = tempfile::Builder::new().prefix("hearth-bench-s3-").tempdir()?;
        std::fs::create_dir_all(dir.path().join(BUCKET))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(&bin)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--access-key", KEY_ID, "--secret-key", SECRET])
            .arg(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("start {}", bin.display()))?;
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if Instant::now() > deadline {
                bail!("s3s-fs did not listen within 30 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(S3sFs {
            child,
            _dir: dir,
            endpoint: format!("http://127.0.0.1:{port}"),
        })
    }

    fn bucket(&self) -> Result<hearth_mount::Bucket> {
        let endpoint = self.endpoint.clone();
        let config = hearth_store::StoreConfig::from_url_with_env(&format!("s3://{BUCKET}"), |k| match k {
            "AWS_ENDPOINT_URL" => Some(endpoint.clone()),
            "AWS_ACCESS_KEY_ID" => Some(KEY_ID.into()),
            "AWS_SECRET_ACCESS_KEY" => Some(SECRET.into()),
            _ => None,
        })?;
        let opts = hearth_mount::BucketOptions {
            op_timeout: Duration::from_secs(120),
            request_timeout: Duration::from_secs(60),
            max_retries: 2,
        };
        Ok(hearth_mount::Bucket::new(config, opts)?)
    }
}

impl Drop for S3sFs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn mib_s(bytes: u64, d: Duration) -> String {
    format!(
        "{:.1} MiB/s",
        bytes as f64 / (1 << 20) as f64 / d.as_secs_f64().max(1e-9)
    )
}

/// The host-side baseline: PUT and GET of `mib` MiB with the plain client.
async fn host_rows(bucket: &hearth_mount::Bucket, mib: u64, rows: &mut Vec<Row>) -> Result<()> {
    let file = tempfile::tempfile()?;
    file.set_len(0)?;
    {
        use std::io::Write;
        let mut w = std::io::BufWriter::new(&file);
        let chunk = vec![0xa5u8; 1 << 20];
        for _ in 0..mib {
            w.write_all(&chunk)?;
        }
    }
    let bytes = mib << 20;
    let t = Instant::now();
    bucket.put_file("host/big", &file, bytes, 8 << 20).await?;
    rows.push(Row::value(
        &format!("plain S3 client PUT {mib} MiB (host)"),
        mib_s(bytes, t.elapsed()),
    ));
    let t = Instant::now();
    let sink = tempfile::tempfile()?;
    let got = bucket.get_into("host/big", &sink, u64::MAX).await?;
    anyhow::ensure!(got == bytes, "GET returned {got} bytes");
    rows.push(Row::value(
        &format!("plain S3 client GET {mib} MiB (host)"),
        mib_s(bytes, t.elapsed()),
    ));
    let mut ttfb = Samples::default();
    for i in 0..10 {
        let key = format!("hostsmall/{i}.txt");
        bucket
            .put(&key, bytes::Bytes::from_static(b"small file\n"))
            .await?;
        let t = Instant::now();
        let meta = bucket.head(&key).await?.context("the small object")?;
        bucket.get_range(&key, 0..meta.size.min(1)).await?;
        ttfb.push(t.elapsed());
    }
    rows.push(Row::samples(
        "plain S3 client small object: HEAD + first byte (host)",
        &ttfb,
    ));
    Ok(())
}

pub async fn rows(client: &Client, args: &MountArgs) -> Result<Vec<Row>> {
    let s3 = S3sFs::start()?;
    let bucket = s3.bucket()?;
    let mut rows = Vec::new();
    host_rows(&bucket, args.mib, &mut rows).await?;
    // The listing and small-file fixtures, written by the host.
    let ls_dirs: Vec<String> = (0..args.ls_rounds).map(|r| format!("ls{r}")).collect();
    for dir in &ls_dirs {
        let mut puts = futures::stream::iter(0..1000).map(|i| {
            let (b, key) = (bucket.clone(), format!("m/{dir}/{i:04}.txt"));
            async move { b.put(&key, bytes::Bytes::from_static(b"x")).await }
        });
        use futures::StreamExt;
        let mut buffered = (&mut puts).buffer_unordered(16);
        while let Some(r) = buffered.next().await {
            r?;
        }
    }
    for i in 0..args.small_files {
        bucket
            .put(
                &format!("m/small/{i}.txt"),
                bytes::Bytes::from_static(b"small file\n"),
            )
            .await?;
    }
    client
        .create_bucket(&CreateBucketRequest {
            name: "bench".into(),
            url: format!("s3://{BUCKET}"),
            endpoint: Some(s3.endpoint.clone()),
            access_key_id: KEY_ID.into(),
            secret_access_key: SECRET.into(),
            ..Default::default()
        })
        .await?;
    let sbx = client
        .create_sandbox(&CreateSandboxRequest {
            template: Some(args.template.clone()),
            memory_mib: Some(args.memory_mib),
            metadata: [("bench".to_owned(), "hearth-bench".to_owned())].into(),
            mounts: vec![MountSpec {
                path: "/mnt/b".into(),
                bucket: "bench".into(),
                prefix: Some("m".into()),
                read_only: None,
            }],
            ..Default::default()
        })
        .await?;
    let result = guest_rows(client, &sbx.id, args, &ls_dirs, &mut rows).await;
    let _ = client.delete_sandbox(&sbx.id).await;
    let _ = client.delete_bucket("bench").await;
    result?;
    Ok(rows)
}

async fn guest_rows(
    client: &Client,
    id: &str,
    args: &MountArgs,
    ls_dirs: &[String],
    rows: &mut Vec<Row>,
) -> Result<()> {
    client
        .write_file(id, "/root/mountbench.py", SCRIPT.as_bytes().to_vec())
        .await?;
    let argv = vec![
        "python3".into(),
        "/root/mountbench.py".into(),
        "/mnt/b".into(),
        args.mib.to_string(),
        ls_dirs.join(","),
        args.small_files.to_string(),
    ];
    let r = client
        .run_command(
            id,
            &RunCommandRequest {
                argv: Some(argv),
                timeout_s: Some(3600),
                ..Default::default()
            },
        )
        .await?;
    if r.exit_code != 0 {
        bail!("mount bench in the guest: {} {}", r.stdout, r.stderr);
    }
    let v: Value =
        serde_json::from_str(r.stdout.trim()).with_context(|| format!("bench output {:?}", r.stdout))?;
    let secs = |k: &str| Duration::from_secs_f64(v[k].as_f64().unwrap_or(f64::NAN));
    let bytes = args.mib << 20;
    let mib = args.mib;
    rows.push(Row::value(
        &format!("mount: sequential write {mib} MiB, close included (guest)"),
        mib_s(bytes, secs("write_s")),
    ));
    rows.push(Row::value(
        &format!("mount: sequential read {mib} MiB, cold cache (guest)"),
        mib_s(bytes, secs("read_s")),
    ));
    let samples = |k: &str| {
        let mut s = Samples::default();
        for x in v[k].as_array().into_iter().flatten() {
            s.push(Duration::from_secs_f64(x.as_f64().unwrap_or(0.0)));
        }
        s
    };
    rows.push(Row::samples(
        "mount: ls of a 1,000-object prefix, first listing (guest)",
        &samples("ls_s"),
    ));
    rows.push(Row::samples(
        "mount: small file, open + first byte (guest)",
        &samples("ttfb_s"),
    ));
    // In order: which of the files was slow (the first? a random one?) is what explains a p95.
    eprintln!("mount: small file samples in order (s): {}", v["ttfb_s"]);
    // The agent channel, for comparison: a file of the same size on the guest's own disk, downloaded.
    let line = format!("head -c {bytes} /dev/zero > /root/agent.bin");
    client
        .run_command(
            id,
            &RunCommandRequest {
                cmd: Some(line),
                ..Default::default()
            },
        )
        .await?;
    let t = Instant::now();
    let data = client.read_file(id, "/root/agent.bin").await?;
    anyhow::ensure!(
        data.len() as u64 == bytes,
        "agent channel read {} bytes",
        data.len()
    );
    rows.push(Row::value(
        &format!("agent channel: download {mib} MiB (files API)"),
        mib_s(bytes, t.elapsed()),
    ));
    Ok(())
}
