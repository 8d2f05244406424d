//! The agent as the real PID 1 of a QEMU guest (TCG), over the real virtio-serial channel: what only a VM
//! shows. Uses the images built by `images/build.sh` (`HEARTH_IMAGES`, default `/var/lib/hearth/images`),
//! whose initramfs carries the agent built by `images/build-agent.sh`; a missing image fails the test.
//!
//! Covered: system set-up by PID 1 (hostname from the kernel command line, mounts, `lo`, SIGTERM ignored,
//! orphans reaped), rapid reconnects (each a new session on the same port, nothing lost, the agent idle
//! afterwards), a host that
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
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("disk");
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
        net: None,
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
    // The connection dies first (no `Abandon` reaches the agent, which would stop the process).
    c.close();
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

    // After all those hang-ups the idle agent waits for the host instead of retrying reads: a virtio port that
    // saw its host go away stays "closed" to the reactor, and retrying would-block reads then spun PID 1 at
    // full CPU (hundreds of thousands of reads a second), starving every program in the guest.
    let reads = out(
        &c,
        "a=$(sed -n 's/^syscr: //p' /proc/1/io); sleep 3; b=$(sed -n 's/^syscr: //p' /proc/1/io); echo $((b-a))",
    )
    .await;
    let reads: u64 = reads.parse().expect("a number of reads");
    assert!(reads < 1000, "the idle agent made {reads} read calls in 3 s");
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

fn test_spec(run: &std::path::Path, disk: PathBuf, id: &str, hostname: &str) -> VmSpec {
    let images = images_dir();
    VmSpec {
        id: id.into(),
        vcpus: 1,
        memory_mib: 256,
        images: BootImages {
            vmlinuz: require(images.join("vmlinuz")),
            vmlinux: images.join("vmlinux"),
            initramfs: require(images.join("initramfs.cpio.gz")),
        },
        disk,
        run_dir: run.to_path_buf(),
        hostname: hostname.into(),
        net: None,
    }
}

async fn wait_agent(vmm: &QemuVmm, vm: &VmHandle) -> AgentClient {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        match connect(vmm, vm, Duration::from_secs(10)).await {
            Ok(c) => return c,
            Err(e) => {
                assert!(Instant::now() < deadline, "agent not ready: {e}\n{}", console(vm));
                assert!(vmm.is_alive(vm), "qemu died\n{}", console(vm));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

fn host_random(n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .expect("host urandom");
    buf
}

fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .expect("clock after epoch")
}

/// Two VMs restored from one checkpoint: before `post_restore` they share the kernel RNG state (measured and
/// printed: whether the 6.1 kernel already tells them apart on its own), after it they differ; the wall clock
/// moves to the value set; hostname and machine-id change. Also: `sync` before the checkpoint, and an
/// abandoned foreground exec stopped in the guest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_get_fresh_clock_rng_and_identity() {
    use hearth_proto::PostRestore;
    use hearth_vmm::SnapshotMode;

    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("disk");
    let spec = test_spec(run.path(), disk.clone(), "sbx_00000000000000c1", "origin");
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = Guard {
        vmm: &vmm,
        vm: vm.clone(),
    };
    let c = wait_agent(&vmm, &vm).await;

    // An abandoned foreground exec (`hearth exec ID -- yes | head -2`) is stopped in the guest.
    let mut h = c.exec(ExecRequest::argv(["yes"])).await.expect("exec yes");
    let yes = h.pid;
    assert!(matches!(h.next_event().await, Some(ExecEvent::Stdout(_))));
    drop(h);
    let exit = tokio::time::timeout(Duration::from_secs(30), c.wait_process(yes))
        .await
        .expect("yes stopped in time")
        .expect("wait yes");
    assert_eq!(exit.signal, Some(libc::SIGHUP));

    // Data written just before the checkpoint is on the disk copy once `sync` returned.
    assert_eq!(
        out(&c, "echo before-checkpoint > /root/synced; echo ok").await,
        "ok"
    );
    let t = Instant::now();
    c.sync().await.expect("sync");
    eprintln!("sync in the guest: {:?}", t.elapsed());
    let snaps = tempfile::tempdir().expect("tempdir");
    let ck = snaps.path().join("ck");
    std::fs::create_dir(&ck).expect("mkdir");
    let info = vmm
        .snapshot(&vm, &disk, &ck, SnapshotMode::Checkpoint)
        .await
        .expect("checkpoint");
    drop(c);
    vmm.stop(&vm).await.expect("stop the original");
    let ck_disk = ck.join(info.disk.as_deref().expect("checkpoint has a disk"));

    let mut forks = Vec::new();
    for (i, name) in ["fork-a", "fork-b"].into_iter().enumerate() {
        let dir = tempfile::tempdir().expect("tempdir");
        let fdisk = vmm
            .prepare_disk(&ck_disk, hearth_vmm::DiskFormat::Qcow2, dir.path())
            .await
            .expect("fork disk");
        let fspec = test_spec(dir.path(), fdisk, &format!("sbx_00000000000000d{i}"), name);
        let f = vmm.restore(&fspec, &ck, &info).await.expect("restore");
        let guard = Guard {
            vmm: &vmm,
            vm: f.clone(),
        };
        let fc = wait_agent(&vmm, &f).await;
        forks.push((name, dir, f, guard, fc));
    }

    // Before post_restore: the RNG output of the two forks (what a kernel without help gives them).
    let mut before = Vec::new();
    for (_, _, _, _, fc) in &forks {
        before.push(out(fc, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").await);
    }
    eprintln!(
        "urandom right after restore, before post_restore: {} ({} / {})",
        if before[0] == before[1] {
            "IDENTICAL in both forks"
        } else {
            "different"
        },
        before[0],
        before[1]
    );

    let mut after = Vec::new();
    for (i, (name, _, _, _, fc)) in forks.iter().enumerate() {
        assert_eq!(out(fc, "cat /root/synced").await, "before-checkpoint");
        // The clock moves to the value set: a day ahead first, then back to now.
        let ahead = now_ns() + 86_400 * 1_000_000_000;
        let machine_id = format!("{:032x}", 0xabc0_u128 + i as u128);
        let report = fc
            .post_restore(PostRestore {
                unix_time_ns: ahead,
                entropy: host_random(64),
                hostname: Some((*name).to_owned()),
                machine_id: Some(machine_id.clone()),
            })
            .await
            .expect("post_restore");
        assert!(report.clock_set && report.crng_reseeded && report.hostname_set && report.machine_id_written);
        assert_eq!(report.entropy_bits_credited, 512);
        let guest: i64 = out(fc, "date +%s").await.parse().expect("guest date");
        let want = ahead / 1_000_000_000;
        assert!((guest - want).abs() < 60, "guest clock {guest}, set to {want}");
        fc.post_restore(PostRestore {
            unix_time_ns: now_ns(),
            entropy: host_random(64),
            hostname: None,
            machine_id: None,
        })
        .await
        .expect("post_restore again");
        let guest: i64 = out(fc, "date +%s").await.parse().expect("guest date");
        let host = now_ns() / 1_000_000_000;
        assert!((guest - host).abs() < 60, "guest clock {guest}, host {host}");
        assert_eq!(out(fc, "hostname").await, *name);
        assert_eq!(out(fc, "cat /etc/hostname").await, *name);
        assert_eq!(out(fc, "cat /etc/machine-id").await, machine_id);
        after.push(out(fc, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").await);
        // Malformed values are refused in the guest too, and change nothing.
        let err = fc
            .post_restore(PostRestore {
                unix_time_ns: now_ns(),
                entropy: vec![0; 8],
                hostname: Some("bad name".into()),
                machine_id: None,
            })
            .await
            .expect_err("malformed");
        assert_eq!(err.guest_kind(), Some(hearth_proto::ErrorKind::InvalidRequest));
        assert_eq!(out(fc, "hostname").await, *name);
    }
    assert_eq!(after[0].len(), 64);
    assert_ne!(
        after[0], after[1],
        "forks produce the same random bytes after post_restore"
    );
    assert!(!before.contains(&after[0]) && !before.contains(&after[1]));
    for (_, _, f, _, fc) in forks {
        drop(fc);
        vmm.stop(&f).await.expect("stop fork");
    }
}

/// A terminal in the guest: the agent as PID 1 opens a pseudo-terminal on the guest's devpts; `stty size`
/// follows a resize, typed input is echoed, Ctrl-C (a byte) interrupts `sleep 100`, the exit code comes back,
/// and dropping the session hangs its processes up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pty_in_a_real_guest() {
    use bytes::Bytes;
    use hearth_proto::client::{PtyEvent, PtyHandle};
    use hearth_proto::msg::Command;

    async fn until(h: &mut PtyHandle, seen: &mut String, want: &str) {
        let fut = async {
            while !seen.contains(want) {
                match h.next_event().await {
                    Some(PtyEvent::Output(d)) => seen.push_str(&String::from_utf8_lossy(&d)),
                    other => panic!("waiting for {want:?}: {other:?}\n{seen}"),
                }
            }
        };
        if tokio::time::timeout(Duration::from_secs(60), fut).await.is_err() {
            panic!("no {want:?} in time; output:\n{seen}");
        }
    }

    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("disk");
    let spec = test_spec(run.path(), disk, "sbx_00000000000000d1", "pty-test");
    let vm = vmm.start(&spec).await.expect("start");
    let _guard = Guard {
        vmm: &vmm,
        vm: vm.clone(),
    };
    let c = wait_agent(&vmm, &vm).await;

    let req = |line: &str| hearth_proto::PtyRequest {
        command: Command::Shell(line.into()),
        env: Default::default(),
        cwd: None,
        rows: 24,
        cols: 80,
    };
    let mut h = c.pty(req("exec /bin/sh -i")).await.expect("pty");
    let input = h.input();
    let mut seen = String::new();
    let send = |s: &'static str| {
        let input = input.clone();
        async move { input.send(Bytes::from_static(s.as_bytes())).await.expect("input") }
    };
    send("stty size; tty\n").await;
    until(&mut h, &mut seen, "24 80").await;
    until(&mut h, &mut seen, "/dev/pts/").await;
    input.resize(50, 132).expect("resize");
    send("stty size\n").await;
    until(&mut h, &mut seen, "50 132").await;
    send("echo 'ab''cd'\n").await;
    until(&mut h, &mut seen, "echo 'ab''cd'").await;
    until(&mut h, &mut seen, "\nabcd").await;
    send("sleep 100\n").await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let t = Instant::now();
    send("\x03").await;
    send("echo status=$?\n").await;
    until(&mut h, &mut seen, "status=130").await;
    assert!(t.elapsed() < Duration::from_secs(20), "sleep 100 not interrupted");
    send("exit 9\n").await;
    let exit = loop {
        match tokio::time::timeout(Duration::from_secs(60), h.next_event())
            .await
            .expect("exit in time")
        {
            Some(PtyEvent::Output(_)) => {}
            Some(PtyEvent::Exited { code, signal }) => break (code, signal),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(exit, (Some(9), None));

    // Dropping a session hangs it up: its sleep is gone from the guest.
    let mut h = c.pty(req("echo started; sleep 4321")).await.expect("pty");
    let mut seen = String::new();
    until(&mut h, &mut seen, "started").await;
    assert!(out(&c, "ps").await.contains("sleep 4321"));
    drop(h);
    let deadline = Instant::now() + Duration::from_secs(30);
    while out(&c, "ps").await.contains("sleep 4321") {
        assert!(Instant::now() < deadline, "the session outlived its stream");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    vmm.stop(&vm).await.expect("stop");
}
