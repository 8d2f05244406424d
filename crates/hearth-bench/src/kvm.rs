//! `--kvm-host`: Firecracker against QEMU with KVM, side by side in one KVM test host (hearth-testkit's
//! `kvm_host`: a VM under QEMU TCG with nested SVM). The same L1 runs hearthd with `--vmm firecracker`
//! (jailed, as by default) and then with `--vmm qemu` (QEMU with KVM), each on a fresh data directory, through
//! the same scenarios. Two levels of virtualization under software emulation make every figure slow: only
//! the ratios between the two VMMs, measured in the same run, mean something (docs/benchmarks.md).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hearth_api::{CreateSandboxRequest, CreateTemplateRequest, RunCommandRequest};
use hearth_client::Client;
use hearth_testkit::kvm_host::{KvmHost, KvmHostOptions, L1HearthdOptions};

use crate::stats::{Row, Samples};

/// How much of each scenario to run per VMM.
#[derive(Debug, Clone)]
pub struct KvmArgs {
    pub creates: usize,
    pub pause_cycles: usize,
    pub template_creates: usize,
    pub memory_mib: u32,
    /// `hearthd` and `hearth` to put into L1 (default: next to this binary).
    pub bins: PathBuf,
}

/// One VMM's samples.
#[derive(Debug, Default)]
struct Measured {
    first_cmd: Samples,
    /// The first pause after the cold boot.
    pause: Samples,
    /// Pauses after a resume (Firecracker: a diff snapshot into the memory file it resumed from).
    repause: Samples,
    resume: Samples,
    fork4: Samples,
    template_save: Samples,
    template_create: Samples,
}

const VMMS: [&str; 2] = ["firecracker", "qemu"];

/// Boots the KVM test host and measures both VMMs in it; returns the comparison rows.
pub async fn rows(args: &KvmArgs) -> Result<Vec<Row>> {
    let t = Instant::now();
    let mut host = KvmHost::boot(KvmHostOptions::new().bins(&args.bins)).await;
    eprintln!("hearth-bench: KVM test host up in {:.1?}", t.elapsed());
    let mut measured = Vec::new();
    for vmm in VMMS {
        let d = host.start_hearthd(&L1HearthdOptions::new().vmm(vmm)).await;
        let client = Client::new(&d.url, d.key.clone())?;
        let system = client.system().await.context("GET /v1/system in L1")?;
        eprintln!(
            "hearth-bench: in L1, {} ({}) - {}",
            system.vmm, system.accel, system.vmm_reason
        );
        anyhow::ensure!(
            system.vmm == vmm && system.accel == "kvm",
            "hearthd in L1 runs {} ({}), not {vmm} with KVM",
            system.vmm,
            system.accel
        );
        let m = measure(&client, args)
            .await
            .with_context(|| format!("{vmm} in L1"));
        host.stop_hearthd().await;
        // The next VMM starts from nothing: no sandbox, snapshot or template of this one.
        host.sh(
            "for p in /proc/[0-9]*; do case \"$(readlink $p/exe 2>/dev/null)\" in \
                 */qemu-system-*|/firecracker|*/firecracker) kill -9 ${p#/proc/};; esac; done; rm -rf /hearth/data",
        )
        .await;
        measured.push(m?);
    }
    Ok(compare(&measured[0], &measured[1], args))
}

fn create_request(args: &KvmArgs, template: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        template: Some(template.to_owned()),
        vcpus: Some(1),
        memory_mib: Some(args.memory_mib),
        timeout_s: Some(3600),
        ..Default::default()
    }
}

async fn first_command(client: &Client, id: &str) -> Result<()> {
    let r = client
        .run_command(
            id,
            &RunCommandRequest {
                argv: Some(vec!["true".into()]),
                ..Default::default()
            },
        )
        .await?;
    anyhow::ensure!(r.exit_code == 0, "true exited {}", r.exit_code);
    Ok(())
}

/// Creates a sandbox from `template` and runs its first command; returns it and the time to that result.
async fn create_to_first(client: &Client, args: &KvmArgs, template: &str) -> Result<(String, Duration)> {
    let t = Instant::now();
    let sbx = client.create_sandbox(&create_request(args, template)).await?;
    first_command(client, &sbx.id).await?;
    Ok((sbx.id, t.elapsed()))
}

async fn measure(client: &Client, args: &KvmArgs) -> Result<Measured> {
    let mut m = Measured::default();
    let mut kept = None;
    for i in 0..args.creates.max(1) {
        let (id, took) = create_to_first(client, args, "minimal").await.context("create")?;
        m.first_cmd.push(took);
        if i + 1 < args.creates {
            client.delete_sandbox(&id).await?;
        } else {
            kept = Some(id);
        }
    }
    let kept = kept.context("no sandbox")?;
    for cycle in 0..args.pause_cycles {
        // Something to save: 16 MiB written in guest memory since the last resume (a tmpfs file rewritten).
        let dirty = "mkdir -p /mnt/b && (grep -q ' /mnt/b ' /proc/mounts || mount -t tmpfs tmpfs /mnt/b) && \
                     dd if=/dev/urandom of=/mnt/b/f bs=1M count=16 2>/dev/null";
        let r = client
            .run_command(
                &kept,
                &RunCommandRequest {
                    cmd: Some(dirty.into()),
                    ..Default::default()
                },
            )
            .await?;
        anyhow::ensure!(r.exit_code == 0, "dirtying guest memory: {r:?}");
        let t = Instant::now();
        client.pause_sandbox(&kept).await.context("pause")?;
        if cycle == 0 {
            m.pause.push(t.elapsed());
        } else {
            m.repause.push(t.elapsed());
        }
        let t = Instant::now();
        client.resume_sandbox(&kept).await.context("resume")?;
        first_command(client, &kept).await?;
        m.resume.push(t.elapsed());
    }
    let t = Instant::now();
    let fork = client.fork_sandbox(&kept, 4).await.context("fork into 4")?;
    for child in &fork.sandboxes {
        first_command(client, &child.id).await?;
    }
    m.fork4.push(t.elapsed());
    for child in &fork.sandboxes {
        client.delete_sandbox(&child.id).await?;
    }
    let _ = client.delete_snapshot(&fork.snapshot_id).await;
    let name = "bench-kvm-warm";
    let t = Instant::now();
    client
        .create_template(&CreateTemplateRequest {
            name: name.into(),
            from_sandbox: Some(kept.clone()),
            include_memory: true,
            recipe: None,
        })
        .await
        .context("save a template with memory")?;
    m.template_save.push(t.elapsed());
    for _ in 0..args.template_creates {
        let (id, took) = create_to_first(client, args, name)
            .await
            .context("create from the template")?;
        m.template_create.push(took);
        client.delete_sandbox(&id).await?;
    }
    client.delete_sandbox(&kept).await?;
    let _ = client.delete_template(name).await;
    Ok(m)
}

/// One row per scenario: both VMMs' medians and their ratio.
fn compare(fc: &Measured, qemu: &Measured, args: &KvmArgs) -> Vec<Row> {
    let pairs: [(&str, &Samples, &Samples); 7] = [
        ("create -> first command", &fc.first_cmd, &qemu.first_cmd),
        (
            "first pause after the boot (memory + devices to disk, VMM exits)",
            &fc.pause,
            &qemu.pause,
        ),
        (
            "re-pause after a resume, 16 MiB dirtied (Firecracker: diff into the resumed file)",
            &fc.repause,
            &qemu.repause,
        ),
        ("resume -> first command", &fc.resume, &qemu.resume),
        (
            "fork into 4 -> each child's first command",
            &fc.fork4,
            &qemu.fork4,
        ),
        (
            "save a template with memory",
            &fc.template_save,
            &qemu.template_save,
        ),
        (
            "create from the memory template -> first command",
            &fc.template_create,
            &qemu.template_create,
        ),
    ];
    let mut rows = vec![Row::value(
        "in L1 (nested, under TCG): Firecracker (jailed) / QEMU+KVM, p50",
        format!("{} MiB guests, 1 vCPU", args.memory_mib),
    )];
    for (name, a, b) in pairs {
        let (pa, pb) = (a.p50().as_secs_f64(), b.p50().as_secs_f64());
        rows.push(Row::value_with(
            name,
            a.len().min(b.len()),
            format!("{pa:.1} s / {pb:.1} s = {:.2}x", pa / pb.max(1e-9)),
            String::new(),
        ));
    }
    rows
}
