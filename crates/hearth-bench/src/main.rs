//! `hearth-bench`: measures a running (or self-started) hearthd and prints a Markdown table.
//!
//! # Layout
//! - [`daemon`]: start a private hearthd on a temporary data dir, or use `HEARTH_URL`/`HEARTH_API_KEY`.
//! - [`stats`]: percentiles and table rendering.
//! - [`fakenet`]: the private daemon's fake internet (namespaces the bench makes), [`net`]: the network rows.
//! - [`mounts`]: the bucket-mount rows (`--only-mounts`): a local S3 server, a mount vs a plain S3 client.
//! - [`storage_rows`]: `--only-storage`, sandbox state in a bucket (s3s-fs) against a plain S3 client.
//! - [`abuse`]: `--only-abuse`, a neighbour's latency while another sandbox spins, hogs, fork-bombs, fills.
//! - [`kvm`]: `--kvm-host`, Firecracker against QEMU with KVM inside a KVM test host (nested; ratios only).
//! - `main`: the scenarios, each measured in the same run so that ratios compare like with like on a noisy
//!   machine.

mod abuse;
mod boot;
mod daemon;
mod fakenet;
mod idle;
mod kvm;
mod mounts;
mod net;
mod state;
mod stats;
mod storage_rows;
mod warm_ab;

use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use hearth_api::{CreateSandboxRequest, CreateTemplateRequest, RunCommandRequest, Sandbox};
use hearth_client::Client;
use hearth_vmm::qemu::KernelChoice;

use crate::stats::{Row, Samples};

#[derive(Parser, Debug)]
#[command(
    name = "hearth-bench",
    about = "Benchmark hearthd: create, first command, round trips, memory"
)]
struct Args {
    /// Use the daemon at HEARTH_URL / HEARTH_API_KEY instead of starting a private one.
    #[arg(long)]
    external: bool,
    /// Template to create sandboxes from.
    #[arg(long, default_value = "minimal")]
    template: String,
    /// Sequential cold creates to measure.
    #[arg(long, default_value_t = 5)]
    creates: usize,
    /// Command round trips to measure.
    #[arg(long, default_value_t = 50)]
    round_trips: usize,
    /// Sandboxes created at once in the concurrency scenario.
    #[arg(long, default_value_t = 4)]
    concurrent: usize,
    /// Pause/resume cycles to measure (`--kvm-host`: re-pauses after a resume, besides each created
    /// sandbox's first pause).
    #[arg(long, default_value_t = 3)]
    pause_cycles: usize,
    /// Creates from a template with memory, each next to a cold create (same run, alternating).
    #[arg(long, default_value_t = 3)]
    template_creates: usize,
    /// Memory per sandbox (MiB).
    #[arg(long, default_value_t = 256)]
    memory_mib: u32,
    /// hearthd binary for the private daemon (default: next to this binary).
    #[arg(long)]
    hearthd: Option<std::path::PathBuf>,
    /// Skip the network rows (the private daemon then runs with `--network off`). `HEARTH_NETWORK=off` in the
    /// environment does the same.
    #[arg(long, conflicts_with = "only_net")]
    no_net: bool,
    /// Only the network rows.
    #[arg(long)]
    only_net: bool,
    /// Template of the network rows' sandbox (needs python3).
    #[arg(long, default_value = "debian")]
    net_template: String,
    /// MiB per transfer in the throughput rows.
    #[arg(long, default_value_t = 16)]
    net_mib: u64,
    /// Transfers per path (direct, proxy) and direction.
    #[arg(long, default_value_t = 3)]
    net_rounds: usize,
    /// Batches of connections per path in the connection set-up rows (p50 over batch means).
    #[arg(long, default_value_t = 10)]
    net_batches: usize,
    /// Connections per batch.
    #[arg(long, default_value_t = 10)]
    net_per_batch: usize,
    /// Allow/deny cycles in the policy-change rows.
    #[arg(long, default_value_t = 5)]
    policy_cycles: usize,
    /// Kernel images of the QEMU boot breakdown, comma-separated, each booted in turn every round: `bzimage`
    /// (vmlinuz), `pvh` (vmlinux through its PVH entry), `auto` (what the daemon picks).
    #[arg(long, default_value = "bzimage,pvh", value_delimiter = ',', value_parser = parse_kernel)]
    boot_kernels: Vec<KernelChoice>,
    /// Boots per kernel image in the boot breakdown.
    #[arg(long, default_value_t = 1)]
    boot_rounds: usize,
    /// Guest memory (MiB) of the second sandbox whose resumes are compared with the main one's (0: skip).
    #[arg(long, default_value_t = 2048)]
    big_memory_mib: u32,
    /// MiB the guest dirties (in a tmpfs file) before the measured re-pause.
    #[arg(long, default_value_t = 16)]
    dirty_mib: u32,
    /// Only the driver-level boot breakdown (no daemon; QEMU with KVM when the host probe finds it usable, else
    /// TCG).
    #[arg(long, conflicts_with_all = ["only_net", "external"])]
    only_boot: bool,
    /// Only the bucket-mount rows: a private daemon with networking, a local s3s-fs, a `--mount-template`
    /// sandbox (needs python3).
    #[arg(long, conflicts_with_all = ["only_net", "external", "only_boot", "no_net"])]
    only_mounts: bool,
    /// MiB of the mount rows' sequential file.
    #[arg(long, default_value_t = 256)]
    mount_mib: u64,
    /// Template of the mount rows' sandbox.
    #[arg(long, default_value = "debian")]
    mount_template: String,
    /// Firecracker (jailed) against QEMU with KVM, side by side in a KVM test host (a VM under QEMU TCG with
    /// nested SVM; needs `images/build.sh --kvm-host`): create -> first command, pause, resume, fork into 4,
    /// template with memory. Uses --creates, --pause-cycles, --template-creates and --memory-mib.
    #[arg(long, conflicts_with_all = ["only_net", "external", "only_boot", "only_mounts"])]
    kvm_host: bool,
    /// `KEY=VALUE` (repeatable) for a third setup of `--kvm-host`: Firecracker again, with this environment in
    /// L1's hearthd (e.g. `HEARTH_FIRECRACKER_FEATURES_OFF=boot-diff`), measured in the same run.
    #[arg(long, requires = "kvm_host")]
    kvm_firecracker_env: Vec<String>,
    /// Rounds of `--kvm-host` (every other one measures the setups in reverse order).
    #[arg(long, default_value_t = 1, requires = "kvm_host")]
    kvm_rounds: usize,
    /// `--kvm-host` cold-boot soak instead of the scenarios: N creates -> first command -> delete per
    /// Firecracker setup (QEMU+KVM left out), counting the boots that fail or hang rather than stopping at one.
    #[arg(long, default_value_t = 0, requires = "kvm_host")]
    kvm_boots: usize,
    /// Only the abuse rows: a neighbour's `true` latency (p50, p99) with nothing beside it and during a CPU
    /// spinner, memory hog, fork bomb and disk fill in another sandbox (template `--template`, `--memory-mib`).
    #[arg(long, conflicts_with_all = ["only_net", "only_boot", "only_mounts", "kvm_host"])]
    only_abuse: bool,
    /// Samples per abuse row.
    #[arg(long, default_value_t = 40)]
    abuse_samples: usize,
    /// Only the storage-bucket rows (`hearthd --storage` against a local s3s-fs; template `--template`,
    /// `--memory-mib`): upload/download vs a plain S3 client, re-pause bytes, template + 4 forks in the bucket,
    /// resume from the bucket vs from the local copy vs cold create.
    #[arg(long, conflicts_with_all = ["only_net", "external", "only_boot", "only_mounts", "kvm_host", "only_abuse"])]
    only_storage: bool,
    /// Resume rounds of the storage rows (each: from the bucket, from the local copy, a cold create).
    #[arg(long, default_value_t = 3)]
    storage_rounds: usize,
    /// Seconds after a sandbox's last command (in `--only-idle` its only one) at which its host memory is
    /// sampled.
    #[arg(long, default_value = "2,15", value_delimiter = ',')]
    idle_at: Vec<u64>,
    /// Only the idle-memory rows (template `--template`, `--memory-mib`): one sandbox sampled at `--idle-at`,
    /// then `--idle-sandboxes` idle at once for sandboxes per GiB of host memory.
    #[arg(long, conflicts_with_all = ["only_net", "external", "only_boot", "only_mounts", "kvm_host", "only_abuse", "only_storage"])]
    only_idle: bool,
    /// Idle sandboxes kept at once in the density rows.
    #[arg(long, default_value_t = 4)]
    idle_sandboxes: usize,
    /// `KEY=VALUE` for a second private daemon measured after the first in the same run (repeatable), e.g.
    /// `HEARTH_GUEST_KERNEL_ARGS=...` to compare a guest setting with the default side by side, or
    /// `HEARTH_IMAGES=DIR` to compare two image sets (e.g. two guest kernels).
    #[arg(long)]
    idle_compare_env: Vec<String>,
    /// Only warm creates against cold boots (template `--template`, `--memory-mib`): two private daemons, A
    /// with `--warm-creates off` and B with it on, creates alternating; then each one's idle memory, first
    /// pause and resume.
    #[arg(long, conflicts_with_all = ["only_net", "external", "only_boot", "only_mounts", "kvm_host", "only_abuse", "only_storage", "only_idle"])]
    only_warm: bool,
    /// Alternating create pairs of `--only-warm`.
    #[arg(long, default_value_t = 5)]
    warm_rounds: usize,
}

/// The `KEY=VALUE` words of `flag`, split.
fn key_values(flag: &str, words: &[String]) -> Result<Vec<(String, String)>> {
    words
        .iter()
        .map(|kv| {
            kv.split_once('=')
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .with_context(|| format!("{flag} {kv:?}: expected KEY=VALUE"))
        })
        .collect()
}

fn parse_kernel(s: &str) -> Result<KernelChoice, String> {
    KernelChoice::parse(s).ok_or_else(|| format!("{s:?}: expected bzimage, pvh or auto"))
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    if args.kvm_host {
        let bins = match &args.hearthd {
            Some(h) => h.parent().map(std::path::Path::to_path_buf).unwrap_or_default(),
            None => std::env::current_exe()?
                .parent()
                .context("the directory of hearth-bench")?
                .to_path_buf(),
        };
        let kvm_args = kvm::KvmArgs {
            creates: args.creates,
            pause_cycles: args.pause_cycles,
            template_creates: args.template_creates,
            memory_mib: args.memory_mib,
            bins,
            firecracker_env: key_values("--kvm-firecracker-env", &args.kvm_firecracker_env)?,
            rounds: args.kvm_rounds,
            boots: args.kvm_boots,
        };
        let rows = kvm::rows(&kvm_args).await?;
        println!(
            "hearth-bench: KVM test host (nested under TCG; compare ratios, not seconds) memory={} MiB\n",
            args.memory_mib
        );
        println!("{}", stats::render(&rows));
        return Ok(());
    }
    if args.only_boot {
        let accel = if hearth_vmm::detect::probe().kvm.is_usable() {
            hearth_vmm::Accel::Kvm
        } else {
            hearth_vmm::Accel::Tcg
        };
        let rows = boot::breakdown(
            accel,
            &args.template,
            args.memory_mib,
            &args.boot_kernels,
            args.boot_rounds,
        )
        .await?;
        println!(
            "hearth-bench: vmm=qemu accel={accel:?} template={} memory={} MiB (boot breakdown only)\n",
            args.template, args.memory_mib
        );
        println!("{}", stats::render(&rows));
        return Ok(());
    }
    if args.only_mounts {
        return only_mounts(&args).await;
    }
    if args.only_abuse {
        return only_abuse(&args).await;
    }
    if args.only_idle {
        return only_idle(&args).await;
    }
    if args.only_storage {
        return only_storage(&args).await;
    }
    if args.only_warm {
        return warm_ab::only_warm(&args).await;
    }
    // A private daemon's sandboxes reach only the bench's fake internet, or no network at all.
    let network_off = std::env::var("HEARTH_NETWORK").is_ok_and(|v| v == "off");
    if network_off && !args.no_net && !args.external {
        eprintln!("hearth-bench: HEARTH_NETWORK=off: network rows skipped (as with --no-net)");
    }
    let fake = if args.external || args.no_net || network_off {
        None
    } else {
        Some(fakenet::FakeNet::new().context("build the fake internet (root, ip, nft needed; or --no-net)")?)
    };
    let daemon = if args.external {
        daemon::Daemon::external()?
    } else {
        let mut flags = match &fake {
            Some(f) => f.daemon_flags(),
            None => vec!["--network".to_owned(), "off".to_owned()],
        };
        // Its creates are cold boots, as the rows say (warm creates against them: `--only-warm`).
        flags.extend(["--warm-creates".to_owned(), "off".to_owned()]);
        daemon::Daemon::spawn(args.hearthd.clone(), &flags).await?
    };
    let client = daemon.client.clone();
    let system = client.system().await.context("GET /v1/system")?;
    eprintln!(
        "hearth-bench: vmm {} ({}) - {}",
        system.vmm, system.accel, system.vmm_reason
    );

    let mut result = if args.only_net {
        Ok(Vec::new())
    } else {
        run(&args, &client, daemon.data_dir()).await
    };
    if let (Some(fake), Ok(rows)) = (&fake, result.as_mut()) {
        let net_args = net::NetArgs {
            template: args.net_template.clone(),
            memory_mib: args.memory_mib,
            bytes: args.net_mib << 20,
            rounds: args.net_rounds,
            connect_batches: args.net_batches,
            connects_per_batch: args.net_per_batch,
            policy_cycles: args.policy_cycles,
        };
        match net::rows(&client, fake, &net_args).await {
            Ok(mut more) => rows.append(&mut more),
            Err(e) => result = Err(e.context("network rows")),
        }
    } else if args.external && !args.no_net {
        eprintln!("hearth-bench: network rows skipped (an external daemon has no fake internet)");
    }
    if system.vmm == "qemu" && !args.only_net {
        let accel = if system.accel == "kvm" {
            hearth_vmm::Accel::Kvm
        } else {
            hearth_vmm::Accel::Tcg
        };
        match boot::breakdown(
            accel,
            &args.template,
            args.memory_mib,
            &args.boot_kernels,
            args.boot_rounds,
        )
        .await
        {
            Ok(mut more) => {
                if let Ok(rows) = result.as_mut() {
                    rows.append(&mut more);
                }
            }
            Err(e) => eprintln!("hearth-bench: boot breakdown skipped: {e:#}"),
        }
    }
    // Leave nothing behind, whatever happened.
    if let Ok(list) = client.list_sandboxes(&Default::default()).await {
        for s in list.sandboxes {
            if s.metadata.get("bench").is_some_and(|v| v == "hearth-bench") {
                let _ = client.delete_sandbox(&s.id).await;
            }
        }
    }
    drop(daemon);
    // Only now: the daemon's sandbox links live in the uplink namespace.
    let fake_used = fake.is_some();
    drop(fake);
    let rows = result?;

    println!(
        "hearth-bench: vmm={} accel={} template={} net_template={} memory={} MiB host_cpus={}\n",
        system.vmm,
        system.accel,
        args.template,
        if fake_used {
            args.net_template.as_str()
        } else {
            "-"
        },
        args.memory_mib,
        system.capacity.host_cpus
    );
    println!("{}", stats::render(&rows));
    Ok(())
}

/// `--only-abuse`: a private daemon without networking (or `--external`).
async fn only_abuse(args: &Args) -> Result<()> {
    let daemon = if args.external {
        daemon::Daemon::external()?
    } else {
        daemon::Daemon::spawn(args.hearthd.clone(), &["--network".into(), "off".into()]).await?
    };
    let system = daemon.client.system().await.context("GET /v1/system")?;
    let rows = abuse::rows(
        &daemon.client,
        &args.template,
        args.memory_mib,
        args.abuse_samples,
    )
    .await;
    drop(daemon);
    let rows = rows?;
    println!(
        "hearth-bench: vmm={} accel={} template={} memory={} MiB host_cpus={} (abuse rows only; columns: p50 | p99)\n",
        system.vmm, system.accel, args.template, args.memory_mib, system.capacity.host_cpus
    );
    println!("{}", stats::render(&rows));
    Ok(())
}

/// `--only-idle`: a private daemon without networking (and a second one with `--idle-compare-env`).
async fn only_idle(args: &Args) -> Result<()> {
    let idle_args = idle::IdleArgs {
        template: args.template.clone(),
        memory_mib: args.memory_mib,
        sandboxes: args.idle_sandboxes,
        at: args.idle_at.iter().map(|s| Duration::from_secs(*s)).collect(),
    };
    let mut setups = vec![("default".to_owned(), Vec::new())];
    if !args.idle_compare_env.is_empty() {
        let env = key_values("--idle-compare-env", &args.idle_compare_env)?;
        setups.push((args.idle_compare_env.join(" "), env));
    }
    let off = ["--network".to_owned(), "off".to_owned()];
    let mut rows = Vec::new();
    let mut system = None;
    for (i, (name, env)) in setups.iter().enumerate() {
        let daemon = daemon::Daemon::spawn_env(args.hearthd.clone(), &off, env).await?;
        system = Some(daemon.client.system().await.context("GET /v1/system")?);
        let label = if setups.len() > 1 {
            format!("{}: ", (b'A' + i as u8) as char)
        } else {
            String::new()
        };
        if setups.len() > 1 {
            eprintln!("hearth-bench: {label}{name}");
        }
        rows.extend(idle::rows(&daemon.client, &idle_args, &label).await?);
    }
    let system = system.context("no daemon ran")?;
    println!(
        "hearth-bench: vmm={} accel={} template={} memory={} MiB host_cpus={} (idle memory rows only)",
        system.vmm, system.accel, args.template, args.memory_mib, system.capacity.host_cpus
    );
    for (i, (name, _)) in setups.iter().enumerate().skip(1) {
        println!("{}: {name}", (b'A' + i as u8) as char);
    }
    println!("\n{}", stats::render(&rows));
    Ok(())
}

/// `--only-storage`: a private daemon without networking, its state in a local s3s-fs.
async fn only_storage(args: &Args) -> Result<()> {
    let run = storage_rows::run(&storage_rows::StorageArgs {
        template: args.template.clone(),
        memory_mib: args.memory_mib,
        rounds: args.storage_rounds,
        hearthd: args.hearthd.clone(),
    })
    .await?;
    println!(
        "hearth-bench: vmm={} accel={} template={} memory={} MiB host_cpus={} (storage rows only, s3s-fs on loopback)\n",
        run.system.vmm, run.system.accel, args.template, args.memory_mib, run.system.capacity.host_cpus
    );
    println!("{}", stats::render(&run.rows));
    Ok(())
}

/// `--only-mounts`: a private daemon (networking through the fake internet, loopback bucket endpoints allowed).
async fn only_mounts(args: &Args) -> Result<()> {
    let fake = fakenet::FakeNet::new().context("build the fake internet (root, ip, nft needed)")?;
    let mut flags = fake.daemon_flags();
    flags.push("--allow-private-bucket-endpoints".into());
    let daemon = daemon::Daemon::spawn(args.hearthd.clone(), &flags).await?;
    let system = daemon.client.system().await.context("GET /v1/system")?;
    let margs = mounts::MountArgs {
        template: args.mount_template.clone(),
        memory_mib: args.memory_mib.max(512),
        mib: args.mount_mib,
        ls_rounds: 3,
        small_files: 10,
    };
    let result = mounts::rows(&daemon.client, &margs).await;
    drop(daemon);
    drop(fake);
    let rows = result?;
    println!(
        "hearth-bench: vmm={} accel={} template={} memory={} MiB host_cpus={} (mount rows only)\n",
        system.vmm, system.accel, args.mount_template, margs.memory_mib, system.capacity.host_cpus
    );
    println!("{}", stats::render(&rows));
    Ok(())
}

fn create_request(args: &Args) -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: Some(args.template.clone()),
        vcpus: Some(1),
        memory_mib: Some(args.memory_mib),
        timeout_s: Some(900),
        metadata: [("bench".to_owned(), "hearth-bench".to_owned())].into(),
        ..Default::default()
    }
}

fn true_cmd() -> RunCommandRequest {
    RunCommandRequest {
        argv: Some(vec!["true".to_owned()]),
        ..Default::default()
    }
}

/// Creates a sandbox and runs its first command; returns (create, first command, total) durations.
async fn cold_create(client: &Client, args: &Args) -> Result<(Sandbox, Duration, Duration)> {
    let t0 = Instant::now();
    let sbx = client
        .create_sandbox(&create_request(args))
        .await
        .context("create sandbox")?;
    let created = t0.elapsed();
    let res = client
        .run_command(&sbx.id, &true_cmd())
        .await
        .context("first command")?;
    anyhow::ensure!(res.exit_code == 0, "first command exited {}", res.exit_code);
    Ok((sbx, created, t0.elapsed()))
}

async fn run(args: &Args, client: &Client, data_dir: Option<&std::path::Path>) -> Result<Vec<Row>> {
    let mut rows = Vec::new();

    // Baseline: an HTTP round trip that does not touch a VM.
    let mut health = Samples::default();
    for _ in 0..args.round_trips {
        let t = Instant::now();
        client.health().await?;
        health.push(t.elapsed());
    }

    // Cold creates, one after another.
    let mut create = Samples::default();
    let mut first_cmd = Samples::default();
    let mut destroy = Samples::default();
    let mut kept: Option<Sandbox> = None;
    for i in 0..args.creates {
        let (sbx, created, total) = cold_create(client, args).await?;
        create.push(created);
        first_cmd.push(total);
        if i + 1 == args.creates {
            kept = Some(sbx);
        } else {
            let t = Instant::now();
            client.delete_sandbox(&sbx.id).await?;
            destroy.push(t.elapsed());
        }
    }
    let kept = kept.context("no sandbox created (--creates 0?)")?;

    // Command round trips on an idle, booted sandbox.
    let mut rtt = Samples::default();
    for _ in 0..args.round_trips {
        let t = Instant::now();
        let res = client.run_command(&kept.id, &true_cmd()).await?;
        anyhow::ensure!(res.exit_code == 0, "true exited {}", res.exit_code);
        rtt.push(t.elapsed());
    }

    // Host memory of the idle sandbox at points in time after its last command.
    let idle_at: Vec<Duration> = args.idle_at.iter().map(|s| Duration::from_secs(*s)).collect();
    let idle = idle::samples_at(&kept.id, Instant::now(), &idle_at).await;

    // Pause to zero and resume, on the same idle sandbox.
    let mut pause = Samples::default();
    let mut resume = Samples::default();
    let mut paused_pss = None;
    for i in 0..args.pause_cycles {
        let t = Instant::now();
        client.pause_sandbox(&kept.id).await.context("pause")?;
        pause.push(t.elapsed());
        if i == 0 {
            paused_pss = Some(daemon::vmm_pss_kib(&kept.id).unwrap_or(0));
        }
        let t = Instant::now();
        client.resume_sandbox(&kept.id).await.context("resume")?;
        let res = client.run_command(&kept.id, &true_cmd()).await?;
        anyhow::ensure!(res.exit_code == 0, "true after resume exited {}", res.exit_code);
        resume.push(t.elapsed());
    }
    // The same idle sandbox in the VMM process its last resume started: what booting left behind in QEMU (under
    // TCG its translated-code buffer) is gone, guest RAM is still the memory file's page cache.
    let resumed_idle = if args.pause_cycles > 0 {
        idle::samples_at(&kept.id, Instant::now(), &idle_at).await
    } else {
        Vec::new()
    };

    // Bytes a re-pause writes, idle and after the guest dirtied some memory.
    let repause = match data_dir {
        Some(dir) => Some(state::repause_bytes(client, &kept.id, dir, args.dirty_mib).await?),
        None => None,
    };
    // The same pause/resume cycles on a bigger guest.
    let big = if args.big_memory_mib > 0 {
        Some(state::resume_samples(client, &args.template, args.big_memory_mib, args.pause_cycles).await?)
    } else {
        None
    };

    // Fork into four children next to the running parent; snapshot size on disk.
    let t = Instant::now();
    let fork = client.fork_sandbox(&kept.id, 4).await.context("fork")?;
    let fork_wall = t.elapsed();
    for child in &fork.sandboxes {
        client.delete_sandbox(&child.id).await?;
    }
    let snap_bytes = client
        .list_snapshots()
        .await?
        .snapshots
        .into_iter()
        .find(|s| s.id == fork.snapshot_id)
        .map(|s| s.size_bytes);
    let _ = client.delete_snapshot(&fork.snapshot_id).await;

    // A template with memory saved from the idle sandbox, then creates from it alternating with cold creates.
    let warm = warm_template_creates(client, args, &kept.id).await?;

    // Concurrent creates, measured in the same run as the sequential ones.
    let t = Instant::now();
    let futs = (0..args.concurrent).map(|_| cold_create(client, args));
    let results = futures::future::join_all(futs).await;
    let wall = t.elapsed();
    let mut conc = Samples::default();
    for r in results {
        let (sbx, _, total) = r?;
        conc.push(total);
        client.delete_sandbox(&sbx.id).await?;
    }
    client.delete_sandbox(&kept.id).await?;

    rows.push(Row::samples("HTTP round trip (`/healthz`, baseline)", &health));
    rows.push(Row::samples("command round trip (`true`)", &rtt));
    rows.push(Row::ratio(
        "command round trip / HTTP round trip (p50)",
        rtt.p50().as_secs_f64() / health.p50().as_secs_f64().max(1e-9),
    ));
    rows.push(Row::samples("create (API returns, agent ready)", &create));
    rows.push(Row::samples("create -> first command result", &first_cmd));
    rows.push(Row::samples("destroy", &destroy));
    rows.push(Row::samples(
        &format!("create -> first command, {} at once (each)", args.concurrent),
        &conc,
    ));
    rows.push(Row::value(
        &format!("{} concurrent creates, wall clock", args.concurrent),
        format!("{:.2} s", wall.as_secs_f64()),
    ));
    rows.push(Row::ratio(
        &format!(
            "{} concurrent wall / {} x sequential p50",
            args.concurrent, args.concurrent
        ),
        wall.as_secs_f64() / (args.concurrent as f64 * first_cmd.p50().as_secs_f64()).max(1e-9),
    ));
    rows.extend(idle::time_rows("", &idle_at, &idle, args.memory_mib));
    rows.extend(idle::time_rows(
        "after pause + resume: ",
        &idle_at,
        &resumed_idle,
        args.memory_mib,
    ));
    rows.push(Row::samples(
        "pause (device state to disk, memory file synced, VMM exits)",
        &pause,
    ));
    rows.push(Row::samples("resume -> first command result", &resume));
    rows.push(Row::ratio(
        "resume -> first command / cold create -> first command (p50)",
        resume.p50().as_secs_f64() / first_cmd.p50().as_secs_f64().max(1e-9),
    ));
    rows.push(Row::value(
        "host memory of a paused sandbox (VMM PSS)",
        match paused_pss {
            Some(0) => "0 (no VMM process)".to_owned(),
            Some(kib) => format!("{:.1} MiB", kib as f64 / 1024.0),
            None => "n/a (--pause-cycles 0)".to_owned(),
        },
    ));
    rows.push(Row::value(
        "fork into 4 (total / per child)",
        format!(
            "{:.2} s / {:.2} s",
            fork_wall.as_secs_f64(),
            fork_wall.as_secs_f64() / 4.0
        ),
    ));
    rows.extend(state::rows(
        &resume,
        args.memory_mib,
        big.as_ref().map(|b| (b, args.big_memory_mib)),
        fork_wall,
        repause,
        args.dirty_mib,
    ));
    rows.push(Row::value(
        "fork snapshot on disk / guest memory",
        match snap_bytes {
            Some(b) => format!(
                "{:.0} MiB / {} MiB = {:.2}",
                b as f64 / 1048576.0,
                args.memory_mib,
                b as f64 / 1048576.0 / f64::from(args.memory_mib)
            ),
            None => "n/a".to_owned(),
        },
    ));
    rows.push(Row::value(
        "save a template with memory from a running sandbox",
        format!("{:.2} s", warm.save.as_secs_f64()),
    ));
    rows.push(Row::samples(
        "create from a memory template -> first command result",
        &warm.warm,
    ));
    rows.push(Row::samples(
        "cold create -> first command result (alternating with the row above)",
        &warm.cold,
    ));
    rows.push(Row::ratio(
        "create from memory template / cold create, to first command (p50, same run)",
        warm.warm.p50().as_secs_f64() / warm.cold.p50().as_secs_f64().max(1e-9),
    ));
    Ok(rows)
}

/// Creates from a memory template next to cold creates.
struct WarmCreates {
    save: Duration,
    warm: Samples,
    cold: Samples,
}

/// Saves sandbox `from` as a template with memory, then `args.template_creates` times: a cold create and a
/// create from the template, each to its first command result, alternating so that both see the same machine
/// load. The template is deleted afterwards.
async fn warm_template_creates(client: &Client, args: &Args, from: &str) -> Result<WarmCreates> {
    let name = format!("bench-warm-{}", std::process::id());
    let t = Instant::now();
    client
        .create_template(&CreateTemplateRequest {
            name: name.clone(),
            from_sandbox: Some(from.to_owned()),
            include_memory: true,
            recipe: None,
        })
        .await
        .context("save a template with memory")?;
    let save = t.elapsed();
    let mut warm = Samples::default();
    let mut cold = Samples::default();
    let result = async {
        for _ in 0..args.template_creates {
            let (sbx, _, total) = cold_create(client, args).await?;
            cold.push(total);
            client.delete_sandbox(&sbx.id).await?;
            let req = CreateSandboxRequest {
                template: Some(name.clone()),
                ..create_request(args)
            };
            let t = Instant::now();
            let sbx = client
                .create_sandbox(&req)
                .await
                .context("create from template")?;
            let res = client.run_command(&sbx.id, &true_cmd()).await?;
            anyhow::ensure!(res.exit_code == 0, "first command exited {}", res.exit_code);
            warm.push(t.elapsed());
            client.delete_sandbox(&sbx.id).await?;
        }
        anyhow::Ok(())
    }
    .await;
    let _ = client.delete_template(&name).await;
    result?;
    Ok(WarmCreates { save, warm, cold })
}
