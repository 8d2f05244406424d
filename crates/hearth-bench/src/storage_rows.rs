//! `--only-storage` (issue 11): sandbox state in the user's bucket (`hearthd --storage s3://BUCKET/PREFIX`),
//! against a real S3 server (s3s-fs on loopback, the test tool) and a plain S3 client on the host, in one run:
//! - the daemon's upload (state bytes from the end of the pause to `synced` in `GET /v1/storage`) and download
//!   (resume with the local copy wiped; the daemon logs how long the fetch took) against a PUT and a GET of a
//!   file of the same size with the plain client (object_store through `hearth_mount::Bucket`), same server;
//! - a re-pause after changing one file: bytes sent / full state;
//! - a template saved with memory plus 4 sandboxes created from it and paused: how much the bucket grew against
//!   5 full copies;
//! - resume -> first command from the bucket (local copy wiped), from the local copy, and cold create -> first
//!   command, alternating so that all three see the same machine load.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hearth_api::{CreateSandboxRequest, CreateTemplateRequest, RunCommandRequest, StoredObject};
use hearth_client::Client;
use hearth_testkit::s3::{S3Kind, S3Server};

use crate::daemon::Daemon;
use crate::stats::{Row, Samples, fmt_d};

const BUCKET: &str = "hearth-state";
const PREFIX: &str = "hearth";

/// Options of the storage rows.
pub struct StorageArgs {
    pub template: String,
    pub memory_mib: u32,
    /// Resume rounds (each: from the bucket, from the local copy, cold create).
    pub rounds: usize,
    pub hearthd: Option<PathBuf>,
}

/// The measured rows and the daemon's `GET /v1/system` answer.
pub struct StorageRun {
    pub rows: Vec<Row>,
    pub system: hearth_api::SystemInfo,
}

fn mib(b: u64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn mib_s(bytes: u64, d: Duration) -> f64 {
    mib(bytes) / d.as_secs_f64().max(1e-9)
}

fn sh(script: &str) -> RunCommandRequest {
    RunCommandRequest {
        argv: Some(vec!["sh".into(), "-c".into(), script.into()]),
        ..Default::default()
    }
}

async fn run_ok(client: &Client, id: &str, script: &str) -> Result<()> {
    let r = client.run_command(id, &sh(script)).await?;
    anyhow::ensure!(
        r.exit_code == 0,
        "{script:?} exited {}: {}",
        r.exit_code,
        r.stderr
    );
    Ok(())
}

/// Polls `GET /v1/storage` until object `name` is synced with a `synced_at` other than `old` (3 minutes at most).
async fn wait_synced(client: &Client, name: &str, old: Option<&str>) -> Result<StoredObject> {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let st = client.storage_status().await.context("GET /v1/storage")?;
        if let Some(o) = st.objects.into_iter().find(|o| o.name == name)
            && o.sync == "synced"
            && o.synced_at.as_deref() != old
        {
            return Ok(o);
        }
        if Instant::now() > deadline {
            bail!("{name} not synced within 180 s");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One upload: the pause, then the background upload until `synced`.
struct Upload {
    pause: Duration,
    upload: Duration,
    obj: StoredObject,
}

async fn pause_and_sync(client: &Client, id: &str, old: Option<&str>) -> Result<Upload> {
    let t = Instant::now();
    client.pause_sandbox(id).await.context("pause")?;
    let pause = t.elapsed();
    let t = Instant::now();
    let obj = wait_synced(client, &format!("sandboxes/{id}/pause"), old).await?;
    Ok(Upload {
        pause,
        upload: t.elapsed(),
        obj,
    })
}

/// Resumes `id` and runs its first command; returns the time of both.
async fn resume_first_cmd(client: &Client, id: &str) -> Result<Duration> {
    let t = Instant::now();
    client.resume_sandbox(id).await.context("resume")?;
    run_ok(client, id, "true").await?;
    Ok(t.elapsed())
}

/// `s` without ANSI colour sequences (`ESC [ ... m`; the daemon's log has them).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut in_escape = false;
    for c in s.chars() {
        match (in_escape, c) {
            (false, '\x1b') => in_escape = true,
            (false, c) => out.push(c),
            (true, 'm') => in_escape = false,
            (true, _) => {}
        }
    }
    out
}

/// The seconds of the daemon's last "fetched from the storage bucket" log line for `object`.
fn logged_fetch_secs(log: &Path, object: &str) -> Option<f64> {
    let text = strip_ansi(&std::fs::read_to_string(log).ok()?);
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains("fetched from the storage bucket") && l.contains(object))?;
    let rest = &line[line.find("secs")? + 4..];
    let num: String = rest
        .trim_start_matches(['=', '"', ':', ' '])
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse().ok()
}

/// Bytes of all files under `dir` (the bucket's prefix in the s3s-fs data directory).
fn dir_bytes(dir: &Path) -> u64 {
    hearth_testkit::s3::files_under(dir)
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum()
}

fn raw_bucket(s3: &S3Server) -> Result<hearth_mount::Bucket> {
    let env = s3.env();
    let config = hearth_store::StoreConfig::from_url_with_env(&s3.url(""), |k| {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })?;
    let opts = hearth_mount::BucketOptions {
        op_timeout: Duration::from_secs(300),
        request_timeout: Duration::from_secs(120),
        max_retries: 2,
    };
    Ok(hearth_mount::Bucket::new(config, opts)?)
}

/// The plain S3 client and a file of `bytes` non-zero, incompressible bytes it PUTs and GETs.
struct RawClient {
    bucket: hearth_mount::Bucket,
    file: std::fs::File,
    bytes: u64,
}

impl RawClient {
    fn new(s3: &S3Server, bytes: u64) -> Result<RawClient> {
        use std::io::Write;
        let file = tempfile::tempfile()?;
        let mut w = std::io::BufWriter::new(&file);
        // xorshift: no zero pages, nothing a server could compress.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut left = bytes;
        let mut buf = vec![0u8; 1 << 20];
        while left > 0 {
            for c in buf.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
            }
            let n = left.min(buf.len() as u64) as usize;
            w.write_all(&buf[..n])?;
            left -= n as u64;
        }
        drop(w);
        Ok(RawClient {
            bucket: raw_bucket(s3)?,
            file,
            bytes,
        })
    }

    /// PUT (8 MiB parts, 4 in flight) then GET of the file under `key`; returns both durations.
    async fn put_get(&self, key: &str) -> Result<(Duration, Duration)> {
        let t = Instant::now();
        self.bucket.put_file(key, &self.file, self.bytes, 8 << 20).await?;
        let put = t.elapsed();
        let sink = tempfile::tempfile()?;
        let t = Instant::now();
        let got = self.bucket.get_into(key, &sink, u64::MAX).await?;
        let get = t.elapsed();
        anyhow::ensure!(got == self.bytes, "GET returned {got} of {} bytes", self.bytes);
        Ok((put, get))
    }

    async fn sample(&self, key: &str, m: &mut Measured) -> Result<()> {
        let (put, get) = self.put_get(key).await?;
        m.raw_put.push(put);
        m.raw_get.push(get);
        Ok(())
    }
}

/// Starts the S3 server and a private daemon storing state in it, then measures.
pub async fn run(args: &StorageArgs) -> Result<StorageRun> {
    let s3 = tokio::task::spawn_blocking(|| S3Server::start(S3Kind::S3sFs, BUCKET))
        .await
        .context("start s3s-fs (scripts/install-test-deps.sh installs it)")?;
    let flags: Vec<String> = ["--network", "off", "--storage", &s3.url(PREFIX)]
        .into_iter()
        .map(String::from)
        .collect();
    let daemon = Daemon::spawn_env(args.hearthd.clone(), &flags, &s3.env()).await?;
    let system = daemon.client.system().await.context("GET /v1/system")?;
    let result = measure(&daemon, &s3, args).await;
    // Leave nothing behind.
    if let Ok(list) = daemon.client.list_sandboxes(&Default::default()).await {
        for s in list.sandboxes {
            let _ = daemon.client.delete_sandbox(&s.id).await;
        }
    }
    drop(daemon);
    drop(s3);
    Ok(StorageRun {
        rows: result?,
        system,
    })
}

fn create_req(template: &str, memory_mib: Option<u32>) -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: Some(template.to_owned()),
        vcpus: Some(1),
        memory_mib,
        timeout_s: Some(1800),
        metadata: [("bench".to_owned(), "hearth-bench".to_owned())].into(),
        ..Default::default()
    }
}

/// Cold create -> first command; returns the sandbox id and the time.
async fn cold(client: &Client, args: &StorageArgs) -> Result<(String, Duration)> {
    let t = Instant::now();
    let sbx = client
        .create_sandbox(&create_req(&args.template, Some(args.memory_mib)))
        .await
        .context("create")?;
    run_ok(client, &sbx.id, "true").await?;
    Ok((sbx.id, t.elapsed()))
}

/// Everything the rows are made of.
#[derive(Default)]
struct Measured {
    first: Option<Upload>,
    raw_put: Samples,
    raw_get: Samples,
    /// (bytes downloaded, fetch seconds from the daemon's log, resume -> first command) per wiped resume.
    downloads: Vec<(u64, Option<f64>, Duration)>,
    repause: Vec<Upload>,
    from_bucket: Samples,
    from_local: Samples,
    cold: Samples,
    /// (template's full size, 4 forks' full size, bucket growth for the template, for the forks, bucket at end).
    forks: (u64, u64, u64, u64, u64),
}

async fn measure(daemon: &Daemon, s3: &S3Server, args: &StorageArgs) -> Result<Vec<Row>> {
    let client = &daemon.client;
    let data = daemon.data_dir().context("a private daemon")?.to_path_buf();
    let log = data.join("hearthd.log");
    let mut m = Measured::default();
    let (a, first_cold) = cold(client, args).await?;
    m.cold.push(first_cold);
    run_ok(client, &a, "echo kept > /root/before-pause && sync").await?;
    let name = format!("sandboxes/{a}/pause");

    // The first pause: a full upload; then the plain client moves the same number of bytes.
    let first = pause_and_sync(client, &a, None).await?;
    let raw = RawClient::new(s3, first.obj.size_bytes)?;
    raw.sample("raw/0", &mut m).await?;
    let mut last_synced = first.obj.synced_at.clone();
    m.first = Some(first);

    for round in 0..args.rounds.max(1) {
        if round > 0 {
            let up = pause_and_sync(client, &a, last_synced.as_deref()).await?;
            last_synced = up.obj.synced_at.clone();
        }
        // From the bucket: the sandbox's local directory is gone.
        let down_before = client.storage_status().await?.bytes_downloaded;
        std::fs::remove_dir_all(data.join("sandboxes").join(&a)).context("wipe the local copy")?;
        let took = resume_first_cmd(client, &a)
            .await
            .context("resume from the bucket")?;
        let down = client.storage_status().await?.bytes_downloaded - down_before;
        m.downloads.push((down, logged_fetch_secs(&log, &name), took));
        // The plain client's PUT and GET of the same size, next to each round's fetch.
        raw.sample(&format!("raw/{}", round + 1), &mut m).await?;
        m.from_bucket.push(took);
        // Change one file, pause (a re-pause: only changed chunks go up), resume from the local copy.
        run_ok(
            client,
            &a,
            &format!("echo changed {round} > /root/one-file && sync"),
        )
        .await?;
        let up = pause_and_sync(client, &a, last_synced.as_deref()).await?;
        last_synced = up.obj.synced_at.clone();
        m.repause.push(up);
        m.from_local
            .push(resume_first_cmd(client, &a).await.context("resume from local")?);
        // Cold, in the same round.
        let (c, took) = cold(client, args).await?;
        m.cold.push(took);
        client.delete_sandbox(&c).await?;
    }
    m.forks = template_and_forks(client, s3, &a).await?;
    Ok(rows(&m))
}

/// Saves a template with memory from the running sandbox `from`, creates 4 sandboxes from it, changes a file in
/// each and pauses them; returns (template full, forks full, template growth, forks growth, bucket at end).
async fn template_and_forks(client: &Client, s3: &S3Server, from: &str) -> Result<(u64, u64, u64, u64, u64)> {
    let root = s3
        .data_dir()
        .context("s3s-fs keeps files")?
        .join(BUCKET)
        .join(PREFIX);
    let before = dir_bytes(&root);
    let name = format!("bench-store-{}", std::process::id());
    let tpl = client
        .create_template(&CreateTemplateRequest {
            name: name.clone(),
            from_sandbox: Some(from.to_owned()),
            include_memory: true,
            recipe: None,
        })
        .await
        .context("save a template with memory")?;
    let snap = tpl.snapshot_id.context("the template's snapshot")?;
    let snap_obj = wait_synced(client, &format!("snapshots/{snap}"), None).await?;
    let tpl_obj = wait_synced(client, &format!("templates/{name}"), None).await?;
    let tpl_full = snap_obj.size_bytes + tpl_obj.size_bytes;
    let after_tpl = dir_bytes(&root);
    let mut forks_full = 0;
    for i in 0..4 {
        let id = client.create_sandbox(&create_req(&name, None)).await?.id;
        run_ok(client, &id, &format!("echo fork {i} > /root/me && sync")).await?;
        forks_full += pause_and_sync(client, &id, None).await?.obj.size_bytes;
    }
    let end = dir_bytes(&root);
    Ok((tpl_full, forks_full, after_tpl - before, end - after_tpl, end))
}

fn rows(m: &Measured) -> Vec<Row> {
    let mut rows = Vec::new();
    let Some(first) = &m.first else {
        return rows;
    };
    let (size, sent) = (first.obj.size_bytes, first.obj.sent_bytes);
    rows.push(Row::value(
        "paused state (memory + device state + disk), first pause",
        format!(
            "{:.1} MiB, {:.1} MiB sent (zero chunks skipped)",
            mib(size),
            mib(sent)
        ),
    ));
    rows.push(Row::value("pause (local commit)", fmt_d(first.pause)));
    let raw_put = mib_s(size, m.raw_put.p50());
    let up = mib_s(size, first.upload);
    rows.push(Row::value_with(
        &format!(
            "plain S3 client PUT {:.0} MiB (8 MiB parts, 4 in flight)",
            mib(size)
        ),
        m.raw_put.len(),
        format!("{raw_put:.1} MiB/s ({})", fmt_d(m.raw_put.p50())),
        String::new(),
    ));
    rows.push(Row::value(
        "daemon upload, first pause -> synced: state bytes / time (sent bytes / time)",
        format!(
            "{up:.1} MiB/s ({:.1} MiB/s sent; {})",
            mib_s(sent, first.upload),
            fmt_d(first.upload)
        ),
    ));
    rows.push(Row::ratio(
        "daemon upload / plain PUT (state bytes)",
        up / raw_put.max(1e-9),
    ));
    rows.push(Row::ratio(
        "daemon upload / plain PUT (bytes actually sent)",
        mib_s(sent, first.upload) / raw_put.max(1e-9),
    ));
    download_rows(m, size, &mut rows);
    repause_rows(m, &mut rows);
    fork_rows(m, &mut rows);
    resume_rows(m, &mut rows);
    rows
}

fn download_rows(m: &Measured, size: u64, rows: &mut Vec<Row>) {
    let raw_get = mib_s(size, m.raw_get.p50());
    rows.push(Row::value_with(
        &format!("plain S3 client GET {:.0} MiB", mib(size)),
        m.raw_get.len(),
        format!("{raw_get:.1} MiB/s ({})", fmt_d(m.raw_get.p50())),
        String::new(),
    ));
    // The fetch alone (from the daemon's log), median over the wiped resumes.
    let mut fetch: Vec<(f64, u64)> = m
        .downloads
        .iter()
        .filter_map(|(down, secs, _)| secs.map(|s| (s, *down)))
        .collect();
    fetch.sort_by(|a, b| a.0.total_cmp(&b.0));
    let Some(&(secs, down)) = fetch.get(fetch.len().saturating_sub(1) / 2) else {
        rows.push(Row::value(
            "daemon download (fetch)",
            "n/a (no fetch line in the log)".into(),
        ));
        return;
    };
    let took = Duration::from_secs_f64(secs);
    let rate = mib_s(size, took);
    rows.push(Row::value_with(
        "daemon download on resume, local copy wiped: state bytes / fetch time (downloaded bytes / time)",
        fetch.len(),
        format!(
            "{rate:.1} MiB/s ({:.1} MiB/s downloaded, {:.1} MiB; {})",
            mib_s(down, took),
            mib(down),
            fmt_d(took)
        ),
        String::new(),
    ));
    rows.push(Row::ratio(
        "daemon download / plain GET (state bytes)",
        rate / raw_get.max(1e-9),
    ));
    rows.push(Row::ratio(
        "daemon download / plain GET (bytes actually downloaded)",
        mib_s(down, took) / raw_get.max(1e-9),
    ));
}

fn repause_rows(m: &Measured, rows: &mut Vec<Row>) {
    let mut pct: Vec<f64> = m
        .repause
        .iter()
        .map(|u| 100.0 * u.obj.sent_bytes as f64 / u.obj.size_bytes.max(1) as f64)
        .collect();
    pct.sort_by(f64::total_cmp);
    let Some(u) = m.repause.first() else {
        return;
    };
    rows.push(Row::value_with(
        "re-pause after changing one file: sent / full state",
        pct.len(),
        format!(
            "{:.2} MiB / {:.1} MiB = {:.1}% (first; median {:.1}%)",
            mib(u.obj.sent_bytes),
            mib(u.obj.size_bytes),
            100.0 * u.obj.sent_bytes as f64 / u.obj.size_bytes.max(1) as f64,
            pct[(pct.len() - 1) / 2]
        ),
        String::new(),
    ));
    let mut ups = Samples::default();
    for u in &m.repause {
        ups.push(u.upload);
    }
    rows.push(Row::samples("re-pause upload, pause -> synced", &ups));
}

fn fork_rows(m: &Measured, rows: &mut Vec<Row>) {
    let (tpl_full, forks_full, tpl_grown, forks_grown, end) = m.forks;
    let full = tpl_full + forks_full;
    let grown = tpl_grown + forks_grown;
    let pct = |a: u64, b: u64| 100.0 * a as f64 / b.max(1) as f64;
    rows.push(Row::value(
        "template with memory: bucket growth / its full size",
        format!(
            "{:.1} / {:.1} MiB = {:.1}%",
            mib(tpl_grown),
            mib(tpl_full),
            pct(tpl_grown, tpl_full)
        ),
    ));
    rows.push(Row::value(
        "4 sandboxes from it, paused: bucket growth / their full state",
        format!(
            "{:.1} / {:.1} MiB = {:.1}%",
            mib(forks_grown),
            mib(forks_full),
            pct(forks_grown, forks_full)
        ),
    ));
    rows.push(Row::value(
        "template + 4 forks: bucket growth / 5 full copies",
        format!(
            "{:.1} / {:.1} MiB = {:.1}%",
            mib(grown),
            mib(full),
            pct(grown, full)
        ),
    ));
    rows.push(Row::value(
        "bucket total at the end (every version, no GC pass yet)",
        format!("{:.1} MiB", mib(end)),
    ));
}

fn resume_rows(m: &Measured, rows: &mut Vec<Row>) {
    rows.push(Row::samples(
        "resume -> first command, from the bucket (local copy wiped)",
        &m.from_bucket,
    ));
    rows.push(Row::samples(
        "resume -> first command, from the local copy",
        &m.from_local,
    ));
    rows.push(Row::samples("cold create -> first command", &m.cold));
    let cold = m.cold.p50().as_secs_f64().max(1e-9);
    rows.push(Row::ratio(
        "resume from the bucket / cold create (p50)",
        m.from_bucket.p50().as_secs_f64() / cold,
    ));
    rows.push(Row::ratio(
        "resume from the local copy / cold create (p50)",
        m.from_local.p50().as_secs_f64() / cold,
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetch_seconds_come_from_a_coloured_log_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("hearthd.log");
        let line = "\x1b[32m INFO\x1b[0m hearthd: fetched from the storage bucket \x1b[3mobject\x1b[0m\x1b[2m=\x1b[0m\
                    sandboxes/sbx_1/pause \x1b[3msecs\x1b[0m\x1b[2m=\x1b[0m1.25\n";
        std::fs::write(&log, line).expect("write");
        assert_eq!(logged_fetch_secs(&log, "sandboxes/sbx_1/pause"), Some(1.25));
        assert_eq!(logged_fetch_secs(&log, "sandboxes/sbx_2/pause"), None);
    }
}
