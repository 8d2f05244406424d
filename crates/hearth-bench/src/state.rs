//! Rows for state at memory speed (issue 13): how resume scales with guest size, how many bytes a re-pause
//! writes, and fork against one resume, all next to the main rows of the same run.

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use hearth_api::{CreateSandboxRequest, RunCommandRequest};
use hearth_client::Client;

use crate::stats::{Row, Samples};

fn sh(script: &str) -> RunCommandRequest {
    RunCommandRequest {
        argv: Some(vec!["sh".into(), "-c".into(), script.into()]),
        ..Default::default()
    }
}

/// Pause/resume cycles of an idle sandbox with `memory_mib` of guest memory; returns resume -> first command.
pub async fn resume_samples(
    client: &Client,
    template: &str,
    memory_mib: u32,
    cycles: usize,
) -> Result<Samples> {
    let sbx = client
        .create_sandbox(&CreateSandboxRequest {
            template: Some(template.to_owned()),
            vcpus: Some(1),
            memory_mib: Some(memory_mib),
            timeout_s: Some(900),
            metadata: [("bench".to_owned(), "hearth-bench".to_owned())].into(),
            ..Default::default()
        })
        .await
        .with_context(|| format!("create a {memory_mib} MiB sandbox"))?;
    let mut resume = Samples::default();
    let result = async {
        client.run_command(&sbx.id, &sh("true")).await?;
        for _ in 0..cycles {
            client.pause_sandbox(&sbx.id).await.context("pause")?;
            let t = Instant::now();
            client.resume_sandbox(&sbx.id).await.context("resume")?;
            let r = client.run_command(&sbx.id, &sh("true")).await?;
            anyhow::ensure!(r.exit_code == 0, "true after resume exited {}", r.exit_code);
            resume.push(t.elapsed());
        }
        Ok(())
    }
    .await;
    let _ = client.delete_sandbox(&sbx.id).await;
    result.map(|()| resume)
}

/// The page-cache state of a file, as cachestat(2) reports it (pages).
#[repr(C)]
#[derive(Default)]
struct CacheStat {
    nr_cache: u64,
    nr_dirty: u64,
    nr_writeback: u64,
    nr_evicted: u64,
    nr_recently_evicted: u64,
}

/// The byte range cachestat(2) looks at (`len` 0: to the end of the file).
#[repr(C)]
struct CacheStatRange {
    off: u64,
    len: u64,
}

/// cachestat(2) (Linux 6.5): the same number on every architecture; the libc crate lacks it for x86_64 glibc.
const SYS_CACHESTAT: libc::c_long = 451;

/// Bytes of the file at `path` that are dirty or under writeback in the page cache: what an fsync of it must
/// write now. `None` where cachestat(2) is missing (kernels before 6.5) or the file is gone.
fn unwritten_bytes(path: &str) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).ok()?;
    let range = CacheStatRange { off: 0, len: 0 };
    let mut stat = CacheStat::default();
    // SAFETY: cachestat(2) reads `range` and writes one `struct cachestat` into `stat`, both live and laid out
    // as the kernel's structs (five and two u64); the descriptor is held open by `file`.
    let rc = unsafe {
        libc::syscall(
            SYS_CACHESTAT,
            file.as_raw_fd(),
            &range as *const CacheStatRange,
            &mut stat as *mut CacheStat,
            0u32,
        )
    };
    let page = 4096;
    (rc == 0).then(|| (stat.nr_dirty + stat.nr_writeback) * page)
}

/// Sectors written to the block device holding `path`, from /sys/dev/block (whole machine: other writers
/// count too, so run it on a quiet machine).
fn sectors_written(path: &Path) -> Option<u64> {
    let dev = std::fs::metadata(path).ok()?.dev();
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let stat = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/stat")).ok()?;
    stat.split_whitespace().nth(6)?.parse().ok()
}

/// What one re-pause wrote, bytes.
#[derive(Debug, Clone, Copy)]
pub struct Repause {
    /// Guest memory the pause had to flush: the memory file's dirty pages right before it (cachestat).
    pub memory: Option<u64>,
    /// Everything written to the data directory's device meanwhile, by anyone (the device's counter).
    pub device: Option<u64>,
}

/// What a re-pause writes after the guest dirtied `dirty_mib` of memory (a tmpfs file), and after it dirtied
/// nothing: `(idle, dirty)`.
pub async fn repause_bytes(
    client: &Client,
    id: &str,
    data_dir: &Path,
    dirty_mib: u32,
) -> Result<(Repause, Repause)> {
    let measure = async |script: &str| -> Result<Repause> {
        // Flush what is dirty now (guest and host), then count what the guest's work and the pause write: the
        // pages the guest dirtied reach the disk when the pause syncs the memory file.
        client.run_command(id, &sh("sync")).await?;
        tokio::task::spawn_blocking(nix::unistd::sync).await?;
        let before = sectors_written(data_dir);
        client.run_command(id, &sh(script)).await?;
        let memory = crate::idle::memory_file(id).and_then(|f| unwritten_bytes(&f));
        client.pause_sandbox(id).await.context("pause")?;
        let after = sectors_written(data_dir);
        client.resume_sandbox(id).await.context("resume")?;
        let device = before.zip(after).map(|(b, a)| a.saturating_sub(b) * 512);
        Ok(Repause { memory, device })
    };
    let idle = measure("true").await?;
    let dirty = measure(&format!(
        "dd if=/dev/urandom of=/dev/shm/bench-dirty bs=1M count={dirty_mib} 2>/dev/null"
    ))
    .await?;
    client.run_command(id, &sh("rm -f /dev/shm/bench-dirty")).await?;
    Ok((idle, dirty))
}

/// The rows of this module.
pub fn rows(
    small: &Samples,
    small_mib: u32,
    big: Option<(&Samples, u32)>,
    fork_wall: std::time::Duration,
    repause: Option<(Repause, Repause)>,
    dirty_mib: u32,
) -> Vec<Row> {
    let mut rows = vec![Row::ratio(
        "fork into 4, total / one resume -> first command (p50)",
        fork_wall.as_secs_f64() / small.p50().as_secs_f64().max(1e-9),
    )];
    if let Some((big, big_mib)) = big {
        rows.push(Row::samples(
            &format!("resume -> first command, {big_mib} MiB guest"),
            big,
        ));
        rows.push(Row::ratio(
            &format!("resume {big_mib} MiB guest / {small_mib} MiB guest (p50, same run)"),
            big.p50().as_secs_f64() / small.p50().as_secs_f64().max(1e-9),
        ));
    }
    if let Some((idle, dirty)) = repause {
        let mib = |b: Option<u64>| b.map_or("n/a".to_owned(), |b| format!("{:.1} MiB", b as f64 / 1048576.0));
        let ratio = idle.memory.map_or(String::new(), |b| {
            format!(" = {:.3}", b as f64 / 1048576.0 / f64::from(small_mib))
        });
        rows.push(Row::value(
            "re-pause of an idle sandbox: guest memory flushed / guest memory",
            format!("{} / {small_mib} MiB{ratio}", mib(idle.memory)),
        ));
        rows.push(Row::value(
            &format!("re-pause after the guest dirtied {dirty_mib} MiB: guest memory flushed"),
            mib(dirty.memory),
        ));
        rows.push(Row::value(
            "the same two re-pauses: bytes written to the device (by anyone)",
            format!("{}; {}", mib(idle.device), mib(dirty.device)),
        ));
    } else {
        rows.push(Row::value(
            "re-pause bytes written",
            "n/a (the daemon's data directory is not known)".into(),
        ));
    }
    rows
}
