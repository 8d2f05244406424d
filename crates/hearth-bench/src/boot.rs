//! Where the boot time goes, measured at the driver level (no daemon): VMM process start, then kernel +
//! initramfs + agent until the agent's handshake, split by the guest's own uptime at that moment.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};
use hearth_vmm::qemu::QemuVmm;
use hearth_vmm::{Accel, BootImages, VmSpec, Vmm};

use crate::stats::Row;

pub async fn breakdown(accel: Accel, template: &str, memory_mib: u32) -> Result<Vec<Row>> {
    let images: PathBuf = std::env::var_os("HEARTH_IMAGES")
        .map_or_else(|| PathBuf::from("/var/lib/hearth/images"), PathBuf::from);
    let vmm = QemuVmm::locate(accel)?;
    let run = tempfile::Builder::new().prefix("hearth-bench-boot").tempdir()?;
    let disk = vmm
        .prepare_disk(
            &images.join("rootfs").join(format!("{template}.ext4")),
            run.path(),
        )
        .await?;
    let spec = VmSpec {
        id: "sbx_00000000000000be".to_owned(),
        vcpus: 1,
        memory_mib,
        images: BootImages {
            vmlinuz: images.join("vmlinuz"),
            vmlinux: images.join("vmlinux"),
            initramfs: images.join("initramfs.cpio.gz"),
        },
        disk,
        run_dir: run.path().to_path_buf(),
        hostname: "bench".to_owned(),
        net: None,
    };
    let t0 = Instant::now();
    let vm = vmm.start(&spec).await?;
    let vmm_started = t0.elapsed();
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
        let uptime = guest_uptime(&client).await.context("read /proc/uptime")?;
        Ok((ready, uptime))
    }
    .await;
    let _ = vmm.stop(&vm).await;
    let (ready, uptime) = result?;
    let secs = |d: Duration| format!("{:.2} s", d.as_secs_f64());
    Ok(vec![
        Row::value("boot: VMM process started (driver `start`)", secs(vmm_started)),
        Row::value(
            "boot: VMM start -> agent handshake (kernel + initramfs + agent)",
            secs(ready),
        ),
        Row::value(
            "boot: of which in the guest (its /proc/uptime at handshake)",
            format!("{uptime:.2} s"),
        ),
    ])
}

async fn guest_uptime(c: &AgentClient) -> Result<f64> {
    let mut h = c.exec(ExecRequest::shell("cat /proc/uptime")).await?;
    let mut out = Vec::new();
    while let Some(ev) = h.next_event().await {
        match ev {
            ExecEvent::Stdout(d) => out.extend_from_slice(&d),
            ExecEvent::Exited { .. } => break,
            _ => {}
        }
    }
    let text = String::from_utf8_lossy(&out);
    let first = text.split_whitespace().next().context("empty /proc/uptime")?;
    Ok(first.parse()?)
}
