//! Where the boot time goes, measured at the driver level (no daemon): VMM process start, then kernel +
//! initramfs + agent until the agent's handshake, split by the guest's own uptime at that moment; for each
//! kernel image QEMU can boot (bzImage, or the ELF vmlinux through its PVH entry), side by side.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};
use hearth_vmm::qemu::{KernelChoice, QemuVmm};
use hearth_vmm::{Accel, BootImages, VmSpec, Vmm};

use crate::stats::{Row, Samples};

/// Boots `rounds` times with each of `kernels`, alternating (so both see the same machine load), and reports
/// per kernel the p50/p95 of: the driver's `start`, QEMU start to the agent handshake, the guest's uptime at
/// the handshake, and the difference (time before the kernel's clock starts: firmware, and for a bzImage its
/// self-decompression).
pub async fn breakdown(
    accel: Accel,
    template: &str,
    memory_mib: u32,
    kernels: &[KernelChoice],
    rounds: usize,
) -> Result<Vec<Row>> {
    let images: PathBuf = std::env::var_os("HEARTH_IMAGES")
        .map_or_else(|| PathBuf::from("/var/lib/hearth/images"), PathBuf::from);
    let boot_images = BootImages {
        vmlinuz: images.join("vmlinuz"),
        vmlinux: images.join("vmlinux"),
        initramfs: images.join("initramfs.cpio.gz"),
    };
    let base = images.join("rootfs").join(format!("{template}.ext4"));
    let mut per_kernel: Vec<[Samples; 4]> = kernels.iter().map(|_| Default::default()).collect();
    let mut mem_total = vec![0u64; kernels.len()];
    for _ in 0..rounds {
        for (i, kernel) in kernels.iter().enumerate() {
            let vmm = QemuVmm::locate(accel)?.with_kernel(*kernel);
            let b = boot_once(&vmm, &boot_images, &base, memory_mib)
                .await
                .with_context(|| format!("boot with {}", kernel_name(*kernel)))?;
            let [started, ready, uptime, before] = &mut per_kernel[i];
            started.push(b.started);
            ready.push(b.ready);
            uptime.push(b.uptime);
            before.push(b.ready.saturating_sub(b.uptime));
            mem_total[i] = b.mem_total_kib;
        }
    }
    let mut rows = Vec::new();
    for (i, kernel) in kernels.iter().enumerate() {
        let k = kernel_name(*kernel);
        let [started, ready, uptime, before] = &per_kernel[i];
        rows.push(Row::samples(
            &format!("boot ({k}): VMM process started (driver `start`)"),
            started,
        ));
        rows.push(Row::samples(
            &format!("boot ({k}): VMM start -> agent handshake (kernel + initramfs + agent)"),
            ready,
        ));
        rows.push(Row::samples(
            &format!("boot ({k}): of which in the guest (its /proc/uptime at handshake)"),
            uptime,
        ));
        rows.push(Row::samples(
            &format!("boot ({k}): before the guest clock starts (handshake - uptime)"),
            before,
        ));
        rows.push(Row::value(
            &format!("boot ({k}): guest MemTotal"),
            format!("{} KiB", mem_total[i]),
        ));
    }
    if let [a, b] = per_kernel.as_slice() {
        rows.push(Row::ratio(
            &format!(
                "boot: handshake {} / {} (p50)",
                kernel_name(kernels[0]),
                kernel_name(kernels[1])
            ),
            a[1].p50().as_secs_f64() / b[1].p50().as_secs_f64(),
        ));
    }
    Ok(rows)
}

pub fn kernel_name(k: KernelChoice) -> &'static str {
    match k {
        KernelChoice::Auto => "auto",
        KernelChoice::BzImage => "bzImage",
        KernelChoice::Pvh => "PVH vmlinux",
    }
}

struct Boot {
    started: Duration,
    ready: Duration,
    uptime: Duration,
    mem_total_kib: u64,
}

async fn boot_once(vmm: &QemuVmm, images: &BootImages, base: &Path, memory_mib: u32) -> Result<Boot> {
    let run = tempfile::Builder::new().prefix("hearth-bench-boot").tempdir()?;
    let disk = vmm
        .prepare_disk(base, hearth_vmm::DiskFormat::Raw, run.path())
        .await?;
    let spec = VmSpec {
        id: "sbx_00000000000000be".to_owned(),
        vcpus: 1,
        memory_mib,
        images: images.clone(),
        disk,
        run_dir: run.path().to_path_buf(),
        hostname: "bench".to_owned(),
        net: None,
    };
    let t0 = Instant::now();
    let vm = vmm.start(&spec).await?;
    let started = t0.elapsed();
    let result = async {
        let deadline = t0 + Duration::from_secs(300);
        let client = loop {
            if Instant::now() > deadline {
                bail!("agent not ready after 300 s");
            }
            if let Ok(stream) = vmm.connect_agent(&vm).await
                && let Ok(c) = AgentClient::connect(stream, Duration::from_secs(3)).await
            {
                break c;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let ready = t0.elapsed();
        let (uptime, mem_total_kib) = guest_facts(&client).await.context("read /proc/uptime")?;
        Ok(Boot {
            started,
            ready,
            uptime: Duration::from_secs_f64(uptime),
            mem_total_kib,
        })
    }
    .await;
    let _ = vmm.stop(&vm).await;
    result
}

/// The guest's uptime (s) and MemTotal (KiB).
async fn guest_facts(c: &AgentClient) -> Result<(f64, u64)> {
    let mut h = c
        .exec(ExecRequest::shell(
            "cat /proc/uptime; grep MemTotal /proc/meminfo",
        ))
        .await?;
    let mut out = Vec::new();
    while let Some(ev) = h.next_event().await {
        match ev {
            ExecEvent::Stdout(d) => out.extend_from_slice(&d),
            ExecEvent::Exited { .. } => break,
            _ => {}
        }
    }
    let text = String::from_utf8_lossy(&out);
    let mut words = text.split_whitespace();
    let uptime = words.next().context("empty /proc/uptime")?.parse()?;
    let mem = words
        .skip_while(|w| *w != "MemTotal:")
        .nth(1)
        .context("no MemTotal")?
        .parse()?;
    Ok((uptime, mem))
}
