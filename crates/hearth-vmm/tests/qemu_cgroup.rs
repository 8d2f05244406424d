//! Real-VM tests of QEMU's cgroup per VM (`hearth_vmm::qemu::cgroups`): the process lands in a cgroup of its
//! own with its shape's limits, the limits bite, pause/stop remove it, a resume gets it back, and the sweep
//! removes cgroups nobody owns. Needs root and cgroup v2 (or v1 with `cpu`, `memory` and `pids` mounted below
//! /sys/fs/cgroup); images from `HEARTH_IMAGES` (default `/var/lib/hearth/images`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};
use hearth_vmm::cgroup::{CGROUP_ROOT, CgroupVersion};
use hearth_vmm::qemu::QemuVmm;
use hearth_vmm::qemu::cgroups::{PIDS_MAX, QemuCgroups, overhead_mib};
use hearth_vmm::{Accel, BootImages, SnapshotMode, VmHandle, VmSpec, Vmm, VmmKind};

const READY_TIMEOUT: Duration = Duration::from_secs(120);

fn images_dir() -> PathBuf {
    std::env::var_os("HEARTH_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/hearth/images"))
}

fn require(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: build the guest images first with `bash images/build.sh` (as root)",
        path.display()
    );
    path
}

/// A driver whose VMs get cgroups below a parent of this test process's own (nextest runs each test in a
/// process of its own, so no test sweeps another's).
fn vmm_with_cgroups(tag: &str) -> QemuVmm {
    assert!(
        nix::unistd::geteuid().is_root(),
        "QEMU cgroup tests need root (run the tests as root, as CI does)"
    );
    let parent = format!("hearth-test-{tag}-{}", std::process::id());
    let vmm = QemuVmm::locate(Accel::Tcg)
        .expect("qemu installed")
        .with_cgroups(&parent);
    assert!(
        vmm.cgroups().is_some(),
        "no VM cgroups on this host: {:?}",
        QemuCgroups::detect(&parent).err()
    );
    vmm
}

/// The file `name` of the VM's cgroup in `controller`'s hierarchy.
fn cg_file(c: &QemuCgroups, run: &Path, controller: &str, name: &str) -> PathBuf {
    let dirs = c.vm_dirs(run);
    let dir = match c.version {
        CgroupVersion::V2 => dirs.first(),
        CgroupVersion::V1 => {
            let root = Path::new(CGROUP_ROOT).join(controller);
            dirs.iter().find(|d| d.starts_with(&root))
        }
    };
    dir.expect("the VM's cgroup directory").join(name)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .to_owned()
}

fn stat_field(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key} in:\n{text}"))
}

/// Asserts that `vm`'s QEMU is in its own cgroup and that the cgroup carries the shape's limits.
fn assert_in_its_cgroup(c: &QemuCgroups, vm: &VmHandle, vcpus: u32, memory_mib: u32) {
    let run = &vm.run_dir;
    let name = hearth_vmm::qemu::cgroups::cgroup_name(run).expect("name");
    let own = format!("/{}/{name}", c.parent);
    let membership = read(Path::new(&format!("/proc/{}/cgroup", vm.pid)));
    let memory = (u64::from(memory_mib) + overhead_mib(Accel::Tcg)) << 20;
    let quota = u64::from(vcpus) * 100_000;
    match c.version {
        CgroupVersion::V2 => {
            assert!(
                membership.lines().any(|l| l == format!("0::{own}")),
                "{membership}"
            );
            assert_eq!(
                read(&cg_file(c, run, "cpu", "cpu.max")),
                format!("{quota} 100000")
            );
            assert_eq!(read(&cg_file(c, run, "memory", "memory.max")), memory.to_string());
        }
        CgroupVersion::V1 => {
            for controller in ["cpu", "memory", "pids"] {
                assert!(
                    membership.lines().any(|l| {
                        let mut f = l.splitn(3, ':').skip(1);
                        f.next().is_some_and(|cs| cs.split(',').any(|x| x == controller))
                            && f.next() == Some(own.as_str())
                    }),
                    "{controller}: {membership}"
                );
            }
            assert_eq!(
                read(&cg_file(c, run, "cpu", "cpu.cfs_quota_us")),
                quota.to_string()
            );
            assert_eq!(read(&cg_file(c, run, "cpu", "cpu.cfs_period_us")), "100000");
            assert_eq!(
                read(&cg_file(c, run, "memory", "memory.limit_in_bytes")),
                memory.to_string()
            );
        }
    }
    assert_eq!(read(&cg_file(c, run, "pids", "pids.max")), PIDS_MAX.to_string());
    let procs = read(&cg_file(c, run, "pids", "cgroup.procs"));
    assert_eq!(procs, vm.pid.to_string(), "only QEMU is in the VM's cgroup");
}

fn assert_no_cgroup(c: &QemuCgroups, run: &Path) {
    for dir in c.vm_dirs(run) {
        assert!(!dir.exists(), "{} is still there", dir.display());
    }
}

async fn wait_for_agent(vmm: &QemuVmm, vm: &VmHandle) -> AgentClient {
    let deadline = Instant::now() + READY_TIMEOUT;
    while Instant::now() < deadline {
        assert!(vmm.is_alive(vm), "qemu exited while waiting for the agent");
        if let Ok(stream) = vmm.connect_agent(vm).await
            && let Ok(client) = AgentClient::connect(stream, Duration::from_secs(3)).await
        {
            return client;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("agent not ready after {READY_TIMEOUT:?}");
}

async fn run_in_guest(client: &AgentClient, script: &str) -> (Option<i32>, String) {
    let mut exec = client
        .exec(ExecRequest::argv(["sh", "-c", script]))
        .await
        .expect("exec");
    let mut out = Vec::new();
    loop {
        match exec.next_event().await.expect("event before the end") {
            ExecEvent::Stdout(d) | ExecEvent::Stderr(d) => out.extend_from_slice(&d),
            ExecEvent::Exited { code, .. } => return (code, String::from_utf8_lossy(&out).into_owned()),
            ExecEvent::Error(e) => panic!("exec {script:?}: {e}"),
        }
    }
}

/// Resident bytes of QEMU's mapping of the guest RAM file (`<run>/memory`) and of the whole process.
fn guest_ram_and_total_rss(pid: u32) -> (u64, u64) {
    let smaps = read(Path::new(&format!("/proc/{pid}/smaps")));
    let (mut ram, mut total, mut in_ram) = (0, 0, false);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            // A mapping header: "start-end perms offset dev inode path".
            in_ram = line.ends_with("/memory");
        } else if let Some(kb) = line.strip_prefix("Rss:") {
            let bytes = kb
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .unwrap_or(0)
                * 1024;
            total += bytes;
            if in_ram {
                ram += bytes;
            }
        }
    }
    (ram, total)
}

/// Kills the VM's process when an assertion fails half-way (the parent cgroups are removed at the end).
struct Guard(Option<VmHandle>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let Some(vm) = self.0.take()
            && let Ok(pid) = i32::try_from(vm.pid)
        {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn remove_parents(c: &QemuCgroups) {
    for dir in c.parent_dirs() {
        let _ = std::fs::remove_dir(&dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qemu_runs_in_a_cgroup_of_its_shape_that_throttles_and_goes_with_it() {
    let vmm = vmm_with_cgroups("shape");
    let c = vmm.cgroups().expect("cgroups").clone();
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("prepare disk");
    let dir = images_dir();
    let spec = VmSpec {
        id: "sbx_00000000000000cc".to_string(),
        vcpus: 1,
        memory_mib: 256,
        images: BootImages {
            vmlinuz: require(dir.join("vmlinuz")),
            vmlinux: dir.join("vmlinux"),
            initramfs: require(dir.join("initramfs.cpio.gz")),
        },
        disk: disk.clone(),
        run_dir: run.path().to_path_buf(),
        hostname: "cgroup-test".to_string(),
        net: None,
    };
    let vm = vmm.start(&spec).await.expect("start");
    let mut guard = Guard(Some(vm.clone()));
    assert_in_its_cgroup(&c, &vm, 1, 256);
    let client = wait_for_agent(&vmm, &vm).await;

    // Guest RAM is a shared file mapping: its pages are charged to the VM's cgroup. Touch most of it, then
    // measure what QEMU holds beyond it (what `overhead_mib` allows for).
    let (code, out) = run_in_guest(
        &client,
        "mkdir -p /tmp/fill && mount -t tmpfs -o size=170m fill /tmp/fill && \
         dd if=/dev/zero of=/tmp/fill/x bs=1M count=160 2>&1",
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let (ram, total) = guest_ram_and_total_rss(vm.pid);
    let (charged, stat) = match c.version {
        CgroupVersion::V2 => (
            read(&cg_file(&c, run.path(), "memory", "memory.current")),
            read(&cg_file(&c, run.path(), "memory", "memory.stat")),
        ),
        CgroupVersion::V1 => (
            read(&cg_file(&c, run.path(), "memory", "memory.usage_in_bytes")),
            read(&cg_file(&c, run.path(), "memory", "memory.stat")),
        ),
    };
    let charged: u64 = charged.parse().expect("memory usage");
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    eprintln!(
        "qemu tcg, 256 MiB guest after touching 160 MiB: guest RAM resident {:.1} MiB, process RSS {:.1} MiB \
         (beyond guest RAM {:.1} MiB), cgroup charged {:.1} MiB (beyond guest RAM {:.1} MiB)\nmemory.stat:\n{stat}",
        mib(ram),
        mib(total),
        mib(total.saturating_sub(ram)),
        mib(charged),
        mib(charged.saturating_sub(ram)),
    );
    assert!(
        ram >= 160 << 20,
        "the guest's writes are in its RAM file ({ram} bytes)"
    );
    assert!(
        charged >= ram,
        "the RAM file's pages count against the VM's cgroup ({charged} < {ram})"
    );
    assert!(
        charged.saturating_sub(ram) < overhead_mib(Accel::Tcg) << 20,
        "QEMU's overhead {:.1} MiB exceeds overhead_mib",
        mib(charged.saturating_sub(ram))
    );

    // The quota bites: with a fifth of a CPU, a guest spinning on its vCPU is throttled. (The computed quota of
    // one vCPU is checked above; a loaded 2-core host cannot be relied on to make QEMU exceed it.)
    let (quota_file, low) = match c.version {
        CgroupVersion::V2 => ("cpu.max", "20000 100000"),
        CgroupVersion::V1 => ("cpu.cfs_quota_us", "20000"),
    };
    std::fs::write(cg_file(&c, run.path(), "cpu", quota_file), low).expect("lower the quota");
    let throttled = || stat_field(&read(&cg_file(&c, run.path(), "cpu", "cpu.stat")), "nr_throttled");
    let before = throttled();
    let (code, out) = run_in_guest(
        &client,
        "end=$(( $(date +%s) + 3 )); while [ $(date +%s) -lt $end ]; do :; done",
    )
    .await;
    assert_eq!(code, Some(0), "{out}");
    let after = throttled();
    eprintln!("nr_throttled {before} -> {after} while the guest spun at a 20% quota");
    assert!(after > before, "spinning was not throttled ({before} -> {after})");

    // Pause: QEMU quits and its cgroup goes with it. Resume: the new QEMU gets the cgroup back.
    drop(client);
    let snaps = tempfile::tempdir().expect("tempdir");
    let paused = snaps.path().join("pause");
    std::fs::create_dir(&paused).expect("mkdir");
    let info = vmm
        .snapshot(&vm, &disk, &paused, SnapshotMode::Pause)
        .await
        .expect("pause");
    guard.0 = None;
    assert_no_cgroup(&c, run.path());
    let resumed = vmm.resume(&spec, &paused, &info).await.expect("resume");
    guard.0 = Some(resumed.clone());
    assert_in_its_cgroup(&c, &resumed, 1, 256);
    let client = wait_for_agent(&vmm, &resumed).await;
    assert_eq!(
        run_in_guest(&client, "cat /tmp/fill/x | wc -c").await.1.trim(),
        (160 << 20).to_string()
    );
    drop(client);

    vmm.stop(&resumed).await.expect("stop");
    guard.0 = None;
    assert!(!vmm.is_alive(&resumed));
    assert_no_cgroup(&c, run.path());
    remove_parents(&c);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_kills_and_removes_cgroups_nobody_owns() {
    let vmm = vmm_with_cgroups("sweep");
    let c = vmm.cgroups().expect("cgroups").clone();
    let (owned_run, orphan_run) = (
        Path::new("/nonexistent/sbx_owned"),
        Path::new("/nonexistent/sbx_orphan"),
    );
    // A process in each VM cgroup stands in for a QEMU (the sweep looks at cgroups, not at binaries).
    let spawn_in = |run: &Path| {
        let procs = c.create(run, 1, 64, Accel::Tcg).expect("create the VM cgroup");
        let child = Command::new("sleep").arg("600").spawn().expect("spawn sleep");
        for mut f in procs {
            use std::io::Write;
            f.write_all(child.id().to_string().as_bytes())
                .expect("move into the cgroup");
        }
        child
    };
    let mut owned = spawn_in(owned_run);
    let mut orphan = spawn_in(orphan_run);
    let live = VmHandle {
        kind: VmmKind::Qemu,
        pid: owned.id(),
        start_ticks: 0,
        run_dir: owned_run.to_path_buf(),
    };
    vmm.sweep(&[live]).await;

    let status = orphan.wait().expect("wait orphan");
    assert!(!status.success(), "the orphan's process was killed: {status}");
    assert_no_cgroup(&c, orphan_run);
    assert!(
        owned.try_wait().expect("try_wait").is_none(),
        "the owned VM's process runs on"
    );
    for dir in c.vm_dirs(owned_run) {
        assert!(dir.is_dir(), "{} was removed", dir.display());
    }

    owned.kill().expect("kill");
    owned.wait().expect("wait");
    vmm.sweep(&[]).await;
    assert_no_cgroup(&c, owned_run);
    remove_parents(&c);
}
