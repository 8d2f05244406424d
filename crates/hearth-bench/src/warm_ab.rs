//! `--only-warm`: warm creates against cold boots, side by side on this machine's VMM. Two private daemons run
//! at once (`--network off`, the same images): A with `--warm-creates off`, B with `--warm-creates on`. B's
//! first create of the shape boots and saves the boot snapshot; then, `--warm-rounds` times, a create on A and
//! one on B alternate (each to its first command, then destroyed), so both see the same machine load. The last
//! round's two sandboxes stay for what a warm create changes later in a sandbox's life: its idle memory (the
//! VMM's PSS, and the host memory [`crate::idle`] counts: PSS with the guest's memory file counted as its pages
//! in the page cache), its first pause (16 MiB dirtied first) and the resume after it.

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hearth_api::Sandbox;
use hearth_client::Client;

use crate::stats::{Row, Samples};
use crate::{Args, cold_create, daemon, true_cmd};

/// What one setup measured.
#[derive(Default)]
struct Side {
    creates: Samples,
    idle: Option<crate::idle::VmmMemory>,
    pause: Option<Duration>,
    resume: Option<Duration>,
}

fn ms(d: Option<Duration>) -> String {
    d.map_or_else(
        || "n/a".to_owned(),
        |d| format!("{:.0} ms", d.as_secs_f64() * 1000.0),
    )
}

fn mib(kib: Option<u64>) -> String {
    kib.map_or_else(|| "n/a".to_owned(), |k| format!("{:.0} MiB", k as f64 / 1024.0))
}

/// Dirties 16 MiB, pauses, resumes and runs a command: records the pause and the resume -> first command.
async fn pause_cycle(client: &Client, sbx: &Sandbox, side: &mut Side) -> Result<()> {
    // Let the guest settle as an idle sandbox would before its memory is read.
    tokio::time::sleep(Duration::from_secs(2)).await;
    side.idle = crate::idle::vmm_memory(&sbx.id);
    let dirty = hearth_api::RunCommandRequest {
        cmd: Some("dd if=/dev/urandom of=/dev/shm/dirty bs=1M count=16 2>/dev/null".to_owned()),
        ..Default::default()
    };
    let r = client.run_command(&sbx.id, &dirty).await.context("dirty")?;
    anyhow::ensure!(r.exit_code == 0, "dirtying memory exited {}", r.exit_code);
    let t = Instant::now();
    client.pause_sandbox(&sbx.id).await.context("pause")?;
    side.pause = Some(t.elapsed());
    let t = Instant::now();
    client.resume_sandbox(&sbx.id).await.context("resume")?;
    let r = client.run_command(&sbx.id, &true_cmd()).await?;
    anyhow::ensure!(r.exit_code == 0, "true after resume exited {}", r.exit_code);
    side.resume = Some(t.elapsed());
    Ok(())
}

pub async fn only_warm(args: &Args) -> Result<()> {
    let rounds = args.warm_rounds.max(1);
    let flags = |warm: &str| {
        ["--network", "off", "--warm-creates", warm]
            .map(str::to_owned)
            .to_vec()
    };
    let cold_d = daemon::Daemon::spawn(args.hearthd.clone(), &flags("off")).await?;
    let warm_d = daemon::Daemon::spawn(args.hearthd.clone(), &flags("on")).await?;
    let system = cold_d.client.system().await.context("GET /v1/system")?;
    let (cold_c, warm_c) = (&cold_d.client, &warm_d.client);

    let (first, _, first_total) = cold_create(warm_c, args).await.context("B: first create")?;
    warm_c.delete_sandbox(&first.id).await?;
    let (mut cold, mut warm) = (Side::default(), Side::default());
    let mut kept = None;
    for round in 0..rounds {
        let (a, _, total) = cold_create(cold_c, args).await.context("A: create")?;
        cold.creates.push(total);
        let (b, _, total) = cold_create(warm_c, args).await.context("B: create")?;
        warm.creates.push(total);
        if round + 1 == rounds {
            kept = Some((a, b));
        } else {
            cold_c.delete_sandbox(&a.id).await?;
            warm_c.delete_sandbox(&b.id).await?;
        }
    }
    let (a, b) = kept.context("no round ran")?;
    pause_cycle(cold_c, &a, &mut cold)
        .await
        .context("A: pause cycle")?;
    pause_cycle(warm_c, &b, &mut warm)
        .await
        .context("B: pause cycle")?;
    cold_c.delete_sandbox(&a.id).await?;
    warm_c.delete_sandbox(&b.id).await?;

    let rows = vec![
        Row::value(
            "B: the shape's first create -> first command (boots, saves the boot snapshot)",
            format!("{:.2} s", first_total.as_secs_f64()),
        ),
        Row::samples("A: cold create -> first command", &cold.creates),
        Row::samples(
            "B: warm create -> first command (restores the boot snapshot)",
            &warm.creates,
        ),
        Row::ratio(
            "warm / cold create -> first command (p50, alternating)",
            warm.creates.p50().as_secs_f64() / cold.creates.p50().as_secs_f64().max(1e-9),
        ),
        Row::value(
            "idle VMM PSS 2 s after create: A cold / B warm",
            format!(
                "{} / {}",
                mib(cold.idle.map(|m| m.pss)),
                mib(warm.idle.map(|m| m.pss))
            ),
        ),
        Row::value(
            "idle host memory 2 s after create (PSS + its memory file's page cache): A cold / B warm",
            format!(
                "{} / {}",
                mib(cold.idle.map(|m| m.host())),
                mib(warm.idle.map(|m| m.host()))
            ),
        ),
        Row::value(
            "first pause, 16 MiB dirtied: A cold / B warm",
            format!("{} / {}", ms(cold.pause), ms(warm.pause)),
        ),
        Row::value(
            "resume -> first command after it: A cold / B warm",
            format!("{} / {}", ms(cold.resume), ms(warm.resume)),
        ),
    ];
    println!(
        "hearth-bench: vmm={} accel={} template={} memory={} MiB host_cpus={} (warm creates A/B only)",
        system.vmm, system.accel, args.template, args.memory_mib, system.capacity.host_cpus
    );
    println!("A: --warm-creates off, B: --warm-creates on\n");
    println!("{}", crate::stats::render(&rows));
    Ok(())
}
