//! `--only-abuse` (issue 15): a neighbour's command latency while another sandbox on the same host spins its
//! CPUs, hogs memory, fork-bombs or fills its disk, against the same neighbour's latency with nothing running
//! beside it, measured in one run. Each abuse runs in a fresh sandbox, destroyed after its rows; the abused
//! sandbox's own agent is timed too (it must keep answering: its programs run in a limited cgroup).

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hearth_api::{CreateSandboxRequest, RunCommandRequest};
use hearth_client::Client;

use crate::stats::{Row, Samples, fmt_d};

/// What each abuse runs in the background of its sandbox.
const ABUSES: [(&str, &str); 4] = [
    (
        "CPU spinner (4 loops)",
        "for i in 1 2 3 4; do (while :; do :; done) & done; wait",
    ),
    (
        "memory hog",
        "while :; do head -c 2000m /dev/zero | tail > /dev/null; done",
    ),
    ("fork bomb", "b() { b | b & }; b; sleep 100000"),
    (
        "disk fill",
        "while :; do dd if=/dev/zero of=/fill bs=1M 2>/dev/null; rm -f /fill; done",
    ),
];

fn sh(script: &str, background: bool) -> RunCommandRequest {
    RunCommandRequest {
        argv: Some(vec!["sh".into(), "-c".into(), script.into()]),
        background,
        ..Default::default()
    }
}

async fn create(client: &Client, template: &str, memory_mib: u32) -> Result<String> {
    let sbx = client
        .create_sandbox(&CreateSandboxRequest {
            template: Some(template.to_owned()),
            vcpus: Some(1),
            memory_mib: Some(memory_mib),
            timeout_s: Some(1800),
            metadata: [("bench".to_owned(), "hearth-bench".to_owned())].into(),
            ..Default::default()
        })
        .await
        .context("create a sandbox")?;
    Ok(sbx.id)
}

/// `n` sequential `true` commands in `id`, each timed from request to result.
async fn latency(client: &Client, id: &str, n: usize) -> Result<Samples> {
    let mut s = Samples::default();
    for _ in 0..n {
        let t = Instant::now();
        let r = client.run_command(id, &sh("true", false)).await?;
        anyhow::ensure!(r.exit_code == 0, "true exited {}", r.exit_code);
        s.push(t.elapsed());
    }
    Ok(s)
}

fn row(name: &str, s: &Samples) -> Row {
    Row::value_with(name, s.len(), fmt_d(s.p50()), fmt_d(s.percentile(99.0)))
}

/// The rows: baseline, then each abuse (neighbour p50/p99, the abused agent's p50/p99, p99 ratio).
pub async fn rows(client: &Client, template: &str, memory_mib: u32, samples: usize) -> Result<Vec<Row>> {
    let neighbour = create(client, template, memory_mib).await?;
    let result = async {
        let mut rows = Vec::new();
        latency(client, &neighbour, 3).await?; // warm
        let base = latency(client, &neighbour, samples).await?;
        rows.push(row("neighbour `true`, nothing beside it (p50 | p99)", &base));
        for (name, script) in ABUSES {
            let abused = create(client, template, memory_mib).await?;
            let measured = async {
                client
                    .start_background(&abused, &sh(script, true))
                    .await
                    .with_context(|| format!("start the {name}"))?;
                // Let it ramp up (the fork bomb reaches its task limit, the hog its memory limit).
                tokio::time::sleep(Duration::from_secs(3)).await;
                let during = latency(client, &neighbour, samples).await?;
                let own = latency(client, &abused, samples.min(10)).await?;
                Ok::<_, anyhow::Error>((during, own))
            }
            .await;
            let _ = client.delete_sandbox(&abused).await;
            let (during, own) = measured?;
            rows.push(row(
                &format!("neighbour `true` during a {name} (p50 | p99)"),
                &during,
            ));
            rows.push(Row::ratio(
                &format!("neighbour p99 during the {name} / nothing beside it"),
                during.percentile(99.0).as_secs_f64() / base.percentile(99.0).as_secs_f64().max(1e-9),
            ));
            rows.push(row(
                &format!("the abused sandbox's own `true` during its {name} (p50 | p99)"),
                &own,
            ));
        }
        Ok(rows)
    }
    .await;
    let _ = client.delete_sandbox(&neighbour).await;
    result
}
