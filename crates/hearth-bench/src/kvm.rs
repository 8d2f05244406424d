//! `--kvm-host`: Firecracker against QEMU with KVM, side by side in one KVM test host (hearth-testkit's
//! `kvm_host`: a VM under QEMU TCG with nested SVM). The same L1 runs hearthd with `--vmm firecracker`
//! (jailed, as by default) and then with `--vmm qemu` (QEMU with KVM), each on a fresh data directory, through
//! the same scenarios. Two levels of virtualization under software emulation make every figure slow: only
//! the ratios between the two VMMs, measured in the same run, mean something (docs/benchmarks.md).
//! `--kvm-firecracker-env KEY=VALUE` adds a third setup, Firecracker again with that environment in L1's
//! hearthd (e.g. `HEARTH_FIRECRACKER_FEATURES_OFF=boot-diff`), for an A/B of a driver feature in the same run.
//! hearthd makes warm creates by default, with both VMMs (the first create of a shape saves a boot snapshot, later
//! ones restore it): `--kvm-firecracker-env HEARTH_WARM_CREATES=off` measures Firecracker's against cold boots.
//! `--kvm-boots N` replaces the scenarios with a cold-boot soak of the Firecracker setups: N creates each,
//! every failure counted (with its error) instead of ending the run, to tell a flaky boot path from noise.

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
    /// `KEY=VALUE` for a third setup: Firecracker with this environment (none: no third setup).
    pub firecracker_env: Vec<(String, String)>,
    /// Times every setup is measured: the order of setups is reversed every other round, so that a drift
    /// of the machine over the run does not favour the setup measured first.
    pub rounds: usize,
    /// Cold-boot soak: creates per Firecracker setup and round (0: the scenarios instead).
    pub boots: usize,
}

/// One VMM's samples.
#[derive(Debug, Default)]
struct Measured {
    /// Every create -> its first command.
    first_cmd: Samples,
    /// The first create of the run (the shape's first: a cold boot, which with warm creates on also saves
    /// the boot snapshot) and the later ones (with warm creates on: restores of that boot snapshot).
    first_create: Samples,
    later_creates: Samples,
    /// The first pause after the cold boot (of every created sandbox).
    pause: Samples,
    /// MiB allocated by the guest memory file after each first pause.
    pause_mib: Vec<f64>,
    /// Pauses after a resume (Firecracker: a diff snapshot into the memory file it resumed from).
    repause: Samples,
    resume: Samples,
    fork4: Samples,
    template_save: Samples,
    template_create: Samples,
    /// The first pause of a sandbox created from the memory template (16 MiB written first), and the MiB its
    /// memory file allocates.
    template_pause: Samples,
    template_pause_mib: Vec<f64>,
    /// Host memory (PSS, MiB) of the VMM of an idle sandbox, [`IDLE`] after its command: after its cold boot,
    /// and after a resume.
    idle_boot_mib: Vec<f64>,
    idle_resume_mib: Vec<f64>,
    /// The same after the second create (a warm create's restore, when warm creates are on).
    idle_second_mib: Vec<f64>,
    /// Soak: boots attempted, and the errors of those that failed.
    boots: usize,
    boot_errors: Vec<String>,
}

impl Measured {
    fn merge(&mut self, other: Measured) {
        for (mine, theirs) in [
            (&mut self.first_cmd, other.first_cmd),
            (&mut self.first_create, other.first_create),
            (&mut self.later_creates, other.later_creates),
            (&mut self.pause, other.pause),
            (&mut self.repause, other.repause),
            (&mut self.resume, other.resume),
            (&mut self.fork4, other.fork4),
            (&mut self.template_save, other.template_save),
            (&mut self.template_create, other.template_create),
            (&mut self.template_pause, other.template_pause),
        ] {
            mine.extend(&theirs);
        }
        self.pause_mib.extend(other.pause_mib);
        self.template_pause_mib.extend(other.template_pause_mib);
        self.idle_boot_mib.extend(other.idle_boot_mib);
        self.idle_resume_mib.extend(other.idle_resume_mib);
        self.idle_second_mib.extend(other.idle_second_mib);
        self.boots += other.boots;
        self.boot_errors.extend(other.boot_errors);
    }
}

/// One hearthd in L1: a label for the table, its VMM and extra environment.
struct Setup {
    label: String,
    vmm: &'static str,
    env: Vec<(String, String)>,
}

fn setups(args: &KvmArgs) -> Vec<Setup> {
    let plain = |label: &str, vmm| Setup {
        label: label.into(),
        vmm,
        env: Vec::new(),
    };
    let mut all = vec![
        plain("Firecracker (jailed)", "firecracker"),
        plain("QEMU+KVM", "qemu"),
    ];
    if args.boots > 0 {
        // The soak is about Firecracker's boot path; QEMU+KVM's cold create takes 3x as long in L1.
        all.retain(|s| s.vmm == "firecracker");
    }
    if !args.firecracker_env.is_empty() {
        let kv: Vec<String> = args
            .firecracker_env
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        all.push(Setup {
            label: format!("Firecracker with {}", kv.join(" ")),
            vmm: "firecracker",
            env: args.firecracker_env.clone(),
        });
    }
    all
}

/// Boots the KVM test host and measures every setup in it; returns the comparison rows.
pub async fn rows(args: &KvmArgs) -> Result<Vec<Row>> {
    let t = Instant::now();
    let mut host = KvmHost::boot(KvmHostOptions::new().bins(&args.bins)).await;
    eprintln!("hearth-bench: KVM test host up in {:.1?}", t.elapsed());
    let setups = setups(args);
    let mut measured: Vec<Measured> = setups.iter().map(|_| Measured::default()).collect();
    for round in 0..args.rounds.max(1) {
        let mut order: Vec<usize> = (0..setups.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for i in order {
            let m = measure_setup(&mut host, &setups[i], args).await?;
            measured[i].merge(m);
        }
    }
    if args.boots > 0 {
        return Ok(compare_boots(&setups, &measured, args));
    }
    Ok(compare(&setups, &measured, args))
}

/// Starts hearthd in L1 for `setup` on a fresh data directory, measures it, and stops it.
async fn measure_setup(host: &mut KvmHost, setup: &Setup, args: &KvmArgs) -> Result<Measured> {
    let mut opts = L1HearthdOptions::new().vmm(setup.vmm);
    for (k, v) in &setup.env {
        opts = opts.env(k, v);
    }
    if args.boots > 0 {
        // The soak is of cold boots.
        opts = opts.arg("--warm-creates").arg("off");
    }
    let d = host.start_hearthd(&opts).await;
    let client = Client::new(&d.url, d.key.clone())?;
    let system = client.system().await.context("GET /v1/system in L1")?;
    eprintln!(
        "hearth-bench: in L1, {} ({}) - {}",
        system.vmm, system.accel, system.vmm_reason
    );
    anyhow::ensure!(
        system.vmm == setup.vmm && system.accel == "kvm",
        "hearthd in L1 runs {} ({}), not {} with KVM",
        system.vmm,
        system.accel,
        setup.vmm
    );
    let m = if args.boots > 0 {
        Ok(soak_boots(&client, args).await)
    } else {
        measure(host, &client, args).await
    }
    .with_context(|| setup.label.clone());
    host.stop_hearthd().await;
    // The next setup starts from nothing: no sandbox, snapshot or template of this one.
    host.sh(
        "for p in /proc/[0-9]*; do case \"$(readlink $p/exe 2>/dev/null)\" in \
             */qemu-system-*|/firecracker|*/firecracker) kill -9 ${p#/proc/};; esac; done; rm -rf /hearth/data",
    )
    .await;
    m
}

/// MiB allocated on L1's disk by the guest memory of paused sandbox `id`: Firecracker's `vm.mem` of the pause,
/// QEMU's `memory` file and `vmstate` (device state, and the RAM of a fork's child or a template's sandbox,
/// which has no memory file of its own).
async fn memory_file_mib(host: &KvmHost, id: &str) -> Result<f64> {
    let out = host
        .sh(&format!(
            "find /hearth/data/sandboxes/{id} -type f \\( -name vm.mem -o -name memory -o -name vmstate \\) -exec stat -c '%b %B' {{}} +"
        ))
        .await;
    let bytes: u64 = out
        .lines()
        .filter_map(|l| {
            let (blocks, size) = l.split_once(' ')?;
            Some(blocks.parse::<u64>().ok()? * size.trim().parse::<u64>().ok()?)
        })
        .sum();
    anyhow::ensure!(bytes > 0, "no guest memory file of {id} in L1: {out:?}");
    Ok(bytes as f64 / (1 << 20) as f64)
}

/// How long a sandbox is left idle after its command before its host memory is sampled.
const IDLE: Duration = Duration::from_secs(10);

/// Host memory (PSS, MiB) in L1 of the VMM process of sandbox `id` (a QEMU names its sandbox directory, a jailed
/// Firecracker its instance id), after [`IDLE`].
async fn idle_vmm_pss_mib(host: &KvmHost, id: &str) -> Result<f64> {
    tokio::time::sleep(IDLE).await;
    let iid = hearth_vmm::firecracker::FirecrackerVmm::instance_id(id);
    let out = host
        .sh(&format!(
            "for p in /proc/[0-9]*; do case \"$(readlink $p/exe 2>/dev/null)\" in \
               */qemu-system-*|/firecracker|*/firecracker) \
                 case \" $(tr '\\0' ' ' < $p/cmdline 2>/dev/null) \" in \
                   *sandboxes/{id}*|*\" {iid} \"*) awk '/^Pss:/ {{print $2}}' $p/smaps_rollup;; esac;; \
             esac; done"
        ))
        .await;
    let kib: Vec<u64> = out.lines().filter_map(|l| l.trim().parse().ok()).collect();
    anyhow::ensure!(!kib.is_empty(), "no VMM process of {id} in L1: {out:?}");
    Ok(kib.iter().sum::<u64>() as f64 / 1024.0)
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

/// Something to save: 16 MiB written in guest memory (a tmpfs file rewritten).
async fn dirty(client: &Client, id: &str) -> Result<()> {
    let dirty = "mkdir -p /mnt/b && (grep -q ' /mnt/b ' /proc/mounts || mount -t tmpfs tmpfs /mnt/b) && \
                 dd if=/dev/urandom of=/mnt/b/f bs=1M count=16 2>/dev/null";
    let r = client
        .run_command(
            id,
            &RunCommandRequest {
                cmd: Some(dirty.into()),
                ..Default::default()
            },
        )
        .await?;
    anyhow::ensure!(r.exit_code == 0, "dirtying guest memory: {r:?}");
    Ok(())
}

/// Resumes `id` and runs its first command; returns the time to that result.
async fn resume_to_first(client: &Client, id: &str) -> Result<Duration> {
    let t = Instant::now();
    client.resume_sandbox(id).await.context("resume")?;
    first_command(client, id).await?;
    Ok(t.elapsed())
}

async fn measure(host: &KvmHost, client: &Client, args: &KvmArgs) -> Result<Measured> {
    let mut m = Measured::default();
    let mut kept = None;
    // Every created sandbox: its first command, then (16 MiB written) its first pause.
    for i in 0..args.creates.max(1) {
        let (id, took) = create_to_first(client, args, "minimal").await.context("create")?;
        m.first_cmd.push(took);
        if i == 0 {
            m.first_create.push(took);
            m.idle_boot_mib.push(idle_vmm_pss_mib(host, &id).await?);
        } else {
            m.later_creates.push(took);
        }
        if i == 1 {
            m.idle_second_mib.push(idle_vmm_pss_mib(host, &id).await?);
        }
        dirty(client, &id).await?;
        let t = Instant::now();
        client.pause_sandbox(&id).await.context("first pause")?;
        m.pause.push(t.elapsed());
        m.pause_mib.push(memory_file_mib(host, &id).await?);
        if i + 1 < args.creates {
            client.delete_sandbox(&id).await?;
        } else {
            kept = Some(id);
        }
    }
    let kept = kept.context("no sandbox")?;
    for _ in 0..args.pause_cycles {
        m.resume.push(resume_to_first(client, &kept).await?);
        dirty(client, &kept).await?;
        let t = Instant::now();
        client.pause_sandbox(&kept).await.context("re-pause")?;
        m.repause.push(t.elapsed());
    }
    m.resume.push(resume_to_first(client, &kept).await?);
    m.idle_resume_mib.push(idle_vmm_pss_mib(host, &kept).await?);
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
    for i in 0..args.template_creates {
        let (id, took) = create_to_first(client, args, name)
            .await
            .context("create from the template")?;
        m.template_create.push(took);
        if i == 0 {
            // Its first pause: Firecracker restored it from the template's checkpoint (with dirty-page
            // tracking unless `restore-diff` is off).
            dirty(client, &id).await?;
            let t = Instant::now();
            client
                .pause_sandbox(&id)
                .await
                .context("pause a sandbox of the template")?;
            m.template_pause.push(t.elapsed());
            m.template_pause_mib.push(memory_file_mib(host, &id).await?);
        }
        client.delete_sandbox(&id).await?;
    }
    client.delete_sandbox(&kept).await?;
    let _ = client.delete_template(name).await;
    Ok(m)
}

/// Cold boots, one after another: create -> first command -> delete. A failed create or command is
/// counted with its error (and the sandbox, if any, deleted) and the soak goes on.
async fn soak_boots(client: &Client, args: &KvmArgs) -> Measured {
    let mut m = Measured::default();
    for i in 0..args.boots {
        m.boots += 1;
        let t = Instant::now();
        let outcome = match client.create_sandbox(&create_request(args, "minimal")).await {
            Ok(sbx) => {
                let ran = first_command(client, &sbx.id).await;
                let took = t.elapsed();
                if let Err(e) = client.delete_sandbox(&sbx.id).await {
                    eprintln!("hearth-bench: boot {i}: delete {}: {e:#}", sbx.id);
                }
                ran.map(|()| took)
            }
            Err(e) => Err(e.into()),
        };
        match outcome {
            Ok(took) => m.first_cmd.push(took),
            Err(e) => {
                eprintln!("hearth-bench: boot {i} failed: {e:#}");
                m.boot_errors.push(format!("{e:#}"));
            }
        }
    }
    m
}

/// The soak's rows: boots attempted and failed per setup, and the p50 of those that succeeded.
fn compare_boots(setups: &[Setup], measured: &[Measured], args: &KvmArgs) -> Vec<Row> {
    let mut rows = vec![Row::value(
        "cold-boot soak in L1 (nested, under TCG)",
        format!(
            "{} MiB guests, 1 vCPU, {} round(s)",
            args.memory_mib,
            args.rounds.max(1)
        ),
    )];
    for (setup, m) in setups.iter().zip(measured) {
        rows.push(Row::value_with(
            &format!("{}: boots failed / attempted", setup.label),
            m.boots,
            format!("{} / {}", m.boot_errors.len(), m.boots),
            String::new(),
        ));
        rows.push(Row::samples(
            &format!("{}: create -> first command", setup.label),
            &m.first_cmd,
        ));
        for e in &m.boot_errors {
            rows.push(Row::value(&format!("{}: failure", setup.label), e.clone()));
        }
    }
    rows
}

/// One row per scenario: every setup's median, and its ratio to the first setup's.
fn compare(setups: &[Setup], measured: &[Measured], args: &KvmArgs) -> Vec<Row> {
    type Pick = fn(&Measured) -> &Samples;
    let scenarios: [(&str, Pick); 10] = [
        ("create -> first command", |m| &m.first_cmd),
        (
            "the shape's first create -> first command (boots; warm creates: + saves the boot snapshot)",
            |m| &m.first_create,
        ),
        (
            "later creates -> first command (warm creates: restore the boot snapshot)",
            |m| &m.later_creates,
        ),
        (
            "first pause after the create, 16 MiB dirtied (memory + devices to disk, VMM exits)",
            |m| &m.pause,
        ),
        (
            "re-pause after a resume, 16 MiB dirtied (Firecracker: diff into the resumed file)",
            |m| &m.repause,
        ),
        ("resume -> first command", |m| &m.resume),
        ("fork into 4 -> each child's first command", |m| &m.fork4),
        ("save a template with memory", |m| &m.template_save),
        ("create from the memory template -> first command", |m| {
            &m.template_create
        }),
        (
            "first pause of a sandbox of the memory template, 16 MiB dirtied",
            |m| &m.template_pause,
        ),
    ];
    let labels: Vec<&str> = setups.iter().map(|s| s.label.as_str()).collect();
    let mut rows = vec![Row::value(
        &format!("in L1 (nested, under TCG): {}, p50", labels.join(" / ")),
        format!(
            "{} MiB guests, 1 vCPU, {} round(s)",
            args.memory_mib,
            args.rounds.max(1)
        ),
    )];
    for (name, pick) in scenarios {
        let samples: Vec<&Samples> = measured.iter().map(pick).collect();
        let secs: Vec<f64> = samples.iter().map(|s| s.p50().as_secs_f64()).collect();
        let times: Vec<String> = secs.iter().map(|s| format!("{s:.1} s")).collect();
        let ratios: Vec<String> = secs[1..]
            .iter()
            .map(|s| format!("{:.2}x", secs[0] / s.max(1e-9)))
            .collect();
        rows.push(Row::value_with(
            name,
            samples.iter().map(|s| s.len()).min().unwrap_or(0),
            format!("{} = {}", times.join(" / "), ratios.join(" / ")),
            String::new(),
        ));
    }
    type PickMib = fn(&Measured) -> &Vec<f64>;
    let sizes: [(&str, PickMib); 5] = [
        ("first pause: guest memory file allocated on disk (MiB)", |m| {
            &m.pause_mib
        }),
        (
            "first pause of a sandbox of the template: memory file allocated (MiB)",
            |m| &m.template_pause_mib,
        ),
        (
            "host memory (PSS) of the VMM, idle 10 s after its command: after the boot (MiB)",
            |m| &m.idle_boot_mib,
        ),
        (
            "host memory (PSS) of the VMM, idle 10 s after its command: after the second create (MiB)",
            |m| &m.idle_second_mib,
        ),
        (
            "host memory (PSS) of the VMM, idle 10 s after its command: after a resume (MiB)",
            |m| &m.idle_resume_mib,
        ),
    ];
    for (name, pick) in sizes {
        let mib: Vec<String> = measured
            .iter()
            .map(|m| {
                let mut v = pick(m).clone();
                v.sort_by(f64::total_cmp);
                v.get(v.len().saturating_sub(1) / 2)
                    .map_or("-".into(), |x| format!("{x:.0}"))
            })
            .collect();
        rows.push(Row::value_with(
            name,
            measured.iter().map(|m| pick(m).len()).min().unwrap_or(0),
            mib.join(" / "),
            String::new(),
        ));
    }
    rows
}
