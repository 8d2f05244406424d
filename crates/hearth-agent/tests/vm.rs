//! The agent as the real PID 1 of a QEMU guest (TCG), over the real virtio-serial channel: what only a VM
//! shows. Uses the images built by `images/build.sh` (`HEARTH_IMAGES`, default `/var/lib/hearth/images`),
//! whose initramfs carries the agent built by `images/build-agent.sh`; a missing image fails the test.
//!
//! Covered: system set-up by PID 1 (hostname from the kernel command line, mounts, `lo`, SIGTERM ignored,
//! orphans reaped), rapid reconnects (each a new session on the same port, nothing lost), a host that
//! vanishes mid-stream, processes and output tails surviving reconnects, timeouts killing process groups.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};
use hearth_vmm::qemu::QemuVmm;
use hearth_vmm::{Accel, BootImages, VmHandle, VmSpec, Vmm};

const READY_TIMEOUT: Duration = Duration::from_secs(180);

fn images_dir() -> PathBuf {
    std::env::var_os("HEARTH_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/hearth/images"))
}

fn require(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: build the guest images with `images/build.sh`",
        path.display()
    );
    path
}

/// Kills the VM even when an assertion fails half-way.
struct Guard<'a> {
    vmm: &'a QemuVmm,
    vm: VmHandle,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if self.vmm.is_alive(&self.vm)
            && let Ok(pid) = i32::try_from(self.vm.pid)
        {
            // SAFETY: kill has no memory-safety preconditions; the pid was checked to be our QEMU.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

fn console(vm: &VmHandle) -> String {
    std::fs::read_to_string(vm.run_dir.join("console.log")).unwrap_or_default()
}

/// One connection attempt with a handshake deadline.
async fn connect(vmm: &QemuVmm, vm: &VmHandle, timeout: Duration) -> Result<AgentClient, String> {
    let stream = vmm.connect_agent(vm).await.map_err(|e| e.to_string())?;
    AgentClient::connect(stream, timeout)
        .await
        .map_err(|e| e.to_string())
}

async fn sh(c: &AgentClient, line: &str) -> (Option<i32>, Option<i32>, bool, String) {
    let mut h = c.exec(ExecRequest::shell(line)).await.expect("exec");
    let mut out = Vec::new();
    loop {
        match h.next_event().await.expect("event") {
            ExecEvent::Stdout(d) | ExecEvent::Stderr(d) => out.extend_from_slice(&d),
            ExecEvent::Exited {
                code,
                signal,
                timed_out,
            } => {
                return (
                    code,
                    signal,
                    timed_out,
                    String::from_utf8_lossy(&out).into_owned(),
                );
            }
            ExecEvent::Error(e) => panic!("{line}: {e}"),
        }
    }
}

async fn out(c: &AgentClient, line: &str) -> String {
    let (code, _, _, text) = sh(c, line).await;
    assert_eq!(code, Some(0), "{line}: {text}");
    text.trim().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_in_a_real_guest() {
    let images = images_dir();
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images.join("rootfs/minimal.ext4"));
    let disk = vmm.prepare_disk(&base, run.path()).await.expect("disk");
    let spec = VmSpec {
        id: "sbx_00000000000000ab".into(),
        vcpus: 1,
        memory_mib: 256,
        images: BootImages {
            vmlinuz: require(images.join("vmlinuz")),
            vmlinux: images.join("vmlinux"),
            initramfs: require(images.join("initramfs.cpio.gz")),
        },
        disk,
        run_dir: run.path().to_path_buf(),
        hostname: "agent-vm-test".into(),
    };
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = Guard {
        vmm: &vmm,
        vm: vm.clone(),
    };

    // The host may connect before the agent opened its port: the repeated Hello gets through.
    let deadline = Instant::now() + READY_TIMEOUT;
    let c = loop {
        match connect(&vmm, &vm, Duration::from_secs(30)).await {
            Ok(c) => break c,
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "agent not ready: {e}\n{}",
                    console(&vm)
                );
                assert!(vmm.is_alive(&vm), "qemu died\n{}", console(&vm));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };

    // PID 1 set the system up.
    assert_eq!(out(&c, "cat /proc/1/comm").await, "hearth-agent");
    assert_eq!(out(&c, "hostname").await, "agent-vm-test");
    let mounts = out(&c, "cat /proc/mounts").await;
    for m in [
        " /proc proc ",
        " /sys sysfs ",
        " /dev devtmpfs ",
        " /dev/pts devpts ",
        " /dev/shm tmpfs ",
        " /tmp tmpfs ",
    ] {
        assert!(mounts.contains(m), "{m} missing:\n{mounts}");
    }
    let flags = out(&c, "cat /sys/class/net/lo/flags").await;
    let flags = u32::from_str_radix(flags.trim_start_matches("0x"), 16).expect("lo flags");
    assert_eq!(flags & 1, 1, "lo is not up (flags {flags:#x})");
    let (code, ..) = sh(&c, "kill -TERM 1; kill -INT 1; sleep 0.5").await;
    assert_eq!(code, Some(0));
    c.ping().await.expect("PID 1 survived SIGTERM and SIGINT");
    let orphan = out(&c, "(sleep 1 & echo $!); true").await;
    assert_eq!(
        out(&c, &format!("cut -d' ' -f4 /proc/{orphan}/stat")).await,
        "1",
        "orphan adopted by PID 1"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let left = out(
        &c,
        &format!("test -e /proc/{orphan} && echo present || echo reaped"),
    )
    .await;
    assert_eq!(left, "reaped");

    // A timeout kills the whole group inside the guest.
    let (_, signal, timed_out, pid) = {
        let req = ExecRequest::shell("sleep 100 & echo $!; wait").timeout(Duration::from_secs(1));
        let mut h = c.exec(req).await.expect("exec");
        let mut text = Vec::new();
        loop {
            match h.next_event().await.expect("event") {
                ExecEvent::Stdout(d) => text.extend_from_slice(&d),
                ExecEvent::Exited {
                    code,
                    signal,
                    timed_out,
                } => {
                    break (
                        code,
                        signal,
                        timed_out,
                        String::from_utf8_lossy(&text).trim().to_owned(),
                    );
                }
                other => panic!("unexpected {other:?}"),
            }
        }
    };
    assert!(timed_out);
    assert_eq!(signal, Some(9));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        out(&c, &format!("test -e /proc/{pid} && echo alive || echo gone")).await,
        "gone"
    );

    // Processes outlive the session: a background one, and a foreground one whose host vanishes mid-stream.
    let bg = c
        .spawn_background(ExecRequest::shell("sleep 600"))
        .await
        .expect("spawn");
    let mut fg = c.exec(ExecRequest::shell("seq 1 300000")).await.expect("exec");
    let fg_pid = fg.pid;
    assert!(matches!(fg.next_event().await, Some(ExecEvent::Stdout(_))));
    drop(fg);
    drop(c);

    // Many quick reconnects: every one is a fresh session on the same port and answers at once.
    let t = Instant::now();
    for i in 0..25 {
        let c = connect(&vmm, &vm, Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("reconnect {i}: {e}\n{}", console(&vm)));
        c.ping().await.expect("ping");
    }
    eprintln!("25 reconnects in {:?}", t.elapsed());

    let c = connect(&vmm, &vm, Duration::from_secs(20))
        .await
        .expect("reconnect");
    let procs = c.list_processes().await.expect("list");
    assert!(procs.iter().any(|p| p.pid == bg && p.exit.is_none()), "{procs:?}");
    let exit = tokio::time::timeout(Duration::from_secs(60), c.wait_process(fg_pid))
        .await
        .expect("in time")
        .expect("wait for the orphaned foreground exec");
    assert_eq!(exit.code, Some(0));
    assert!(exit.stdout_tail.ends_with(b"299999\n300000\n"));
    c.kill_process(bg, 9).await.expect("kill");
    assert_eq!(c.wait_process(bg).await.expect("wait").signal, Some(9));

    vmm.stop(&vm).await.expect("stop");
}
