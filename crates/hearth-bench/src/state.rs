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

/// Sectors written to the block device holding `path`, from /sys/dev/block (whole machine: other writers
/// count too, so run it on a quiet machine).
fn sectors_written(path: &Path) -> Option<u64> {
    let dev = std::fs::metadata(path).ok()?.dev();
    let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
    let stat = std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/stat")).ok()?;
    stat.split_whitespace().nth(6)?.parse().ok()
}

/// Bytes written to the data directory's disk by a re-pause after the guest dirtied `dirty_mib` of memory
/// (a tmpfs file), and by one after it dirtied nothing. `None` when the device's counters cannot be read.
pub async fn repause_bytes(
    client: &Client,
    id: &str,
    data_dir: &Path,
    dirty_mib: u32,
) -> Result<Option<(u64, u64)>> {
    let measure = async |script: &str| -> Result<Option<u64>> {
        client.run_command(id, &sh(script)).await?;
        // Let the page cache settle so the counter sees only the pause's own writes.
        client.run_command(id, &sh("sync")).await?;
        tokio::task::spawn_blocking(nix::unistd::sync).await?;
        let before = sectors_written(data_dir);
        client.pause_sandbox(id).await.context("pause")?;
        let after = sectors_written(data_dir);
        client.resume_sandbox(id).await.context("resume")?;
        Ok(before.zip(after).map(|(b, a)| a.saturating_sub(b) * 512))
    };
    let idle = measure("true").await?;
    let dirty = measure(&format!(
        "dd if=/dev/urandom of=/dev/shm/bench-dirty bs=1M count={dirty_mib} 2>/dev/null"
    ))
    .await?;
    client.run_command(id, &sh("rm -f /dev/shm/bench-dirty")).await?;
    Ok(idle.zip(dirty))
}

/// The rows of this module.
pub fn rows(
    small: &Samples,
    small_mib: u32,
    big: Option<(&Samples, u32)>,
    fork_wall: std::time::Duration,
    repause: Option<(u64, u64)>,
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
    match repause {
        Some((idle, dirty)) => {
            let mib = |b: u64| b as f64 / 1048576.0;
            rows.push(Row::value(
                "re-pause of an idle sandbox: bytes written to disk / guest memory",
                format!(
                    "{:.1} MiB / {small_mib} MiB = {:.3}",
                    mib(idle),
                    mib(idle) / f64::from(small_mib)
                ),
            ));
            rows.push(Row::value(
                &format!("re-pause after the guest dirtied {dirty_mib} MiB: bytes written"),
                format!("{:.1} MiB", mib(dirty)),
            ));
        }
        None => rows.push(Row::value(
            "re-pause bytes written",
            "n/a (no private data dir or no device counters)".into(),
        )),
    }
    rows
}
