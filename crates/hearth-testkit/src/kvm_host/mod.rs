//! A KVM test host: a machine with a working `/dev/kvm` for tests on hosts without one (docs ENVIRONMENT.md,
//! "A KVM host inside a TCG VM").
//!
//! QEMU under TCG with `-cpu max` emulates an AMD CPU with SVM and nested paging. The test kit boots such a VM
//! ("L1") from what `images/build.sh --kvm-host` builds for it: Debian's kernel (`kvm-host/vmlinux`, whatever
//! kernel the guests boot), its initramfs and a root filesystem (bookworm, QEMU 10, nftables, the kernel's
//! modules); the guest images go onto L1's run disk for the sandboxes it runs. The initramfs hands over
//! to hearth's own agent as L1's PID 1, and the kit talks to it over a virtio-serial port with the daemon's
//! agent client: that is how it runs commands in L1 ([`KvmHost::exec`]). In L1, `kvm-amd` loads and `/dev/kvm`
//! works, so Firecracker (under its jailer) and QEMU with KVM run real guests there, slowly but for real.
//!
//! # Per boot
//! - a qcow2 overlay over the (shared, read-only) L1 root filesystem: L1 may write, the image never changes;
//! - the run disk ([`payload`]): this build's binaries, Firecracker, the guest images, the test's files, and
//!   room for hearthd's data, mounted at `/hearth` in L1;
//! - QEMU user networking restricted to the host (`restrict=on`: nothing in L1 reaches any network), with one
//!   forward `127.0.0.1:<free port>` -> L1's port 7070, where [`KvmHost::start_hearthd`] runs the daemon;
//! - L1's console and hearthd's output (a second virtio-serial port) go to files on the host, printed when the
//!   test fails, even if L1 died.
//!
//! Dropping the host kills QEMU and removes every file of the boot (QEMU also dies with the test process).
//!
//! # Layout
//! - this file: [`KvmHostOptions`], [`KvmHost`] (boot, exec, logs, teardown);
//! - [`payload`]: the run disk;
//! - `daemon`: [`L1Hearthd`], hearthd inside L1, reached through the forward.

mod daemon;
pub mod payload;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use hearth_proto::client::{AgentClient, ExecEvent};
use hearth_proto::msg::ExecRequest;

pub use daemon::{L1Hearthd, L1HearthdOptions};

/// L1's address on QEMU's user network, and its gateway and resolver (QEMU's defaults).
const L1_NET: &str = "10.0.2.15/24,10.0.2.2,10.0.2.3";
/// The port of L1 the host forward leads to.
pub const L1_API_PORT: u16 = 7070;

/// Prefix of a boot's temporary directory, and the file in it naming the test process that owns it.
const DIR_PREFIX: &str = "kvmhost";
const OWNER_FILE: &str = "owner.pid";

/// Removes the directories of boots whose test process is gone (a test killed by its runner: its QEMU died
/// with it, but nothing removed its disks, which are gigabytes).
fn remove_stale_boots() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let owned = entry.file_name().to_string_lossy().starts_with(DIR_PREFIX);
        let owner = std::fs::read_to_string(path.join(OWNER_FILE)).ok();
        if let (true, Some(pid)) = (owned, owner.and_then(|p| p.trim().parse::<u32>().ok()))
            && !Path::new(&format!("/proc/{pid}")).exists()
        {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

/// What `images/build.sh --kvm-host` builds for L1: its kernel, initramfs and root filesystem.
fn l1_images() -> PathBuf {
    crate::images_dir().join("kvm-host")
}

/// The KVM host root filesystem `images/build.sh --kvm-host` builds.
pub fn l1_rootfs() -> PathBuf {
    l1_images().join("rootfs.ext4")
}

/// How to boot a [`KvmHost`].
#[derive(Debug, Clone)]
pub struct KvmHostOptions {
    memory_mib: u32,
    vcpus: u32,
    templates: Vec<String>,
    firecracker: bool,
    files: Vec<(PathBuf, String, bool)>,
    disk_gib: u64,
    boot_timeout: Duration,
    bins: Option<PathBuf>,
}

impl Default for KvmHostOptions {
    fn default() -> Self {
        KvmHostOptions {
            memory_mib: 4096,
            vcpus: 2,
            templates: vec!["minimal".to_owned()],
            firecracker: true,
            files: Vec::new(),
            disk_gib: 32,
            boot_timeout: Duration::from_secs(180),
            bins: None,
        }
    }
}

impl KvmHostOptions {
    /// 4 GiB of RAM, 2 vCPUs, the `minimal` template, Firecracker and its jailer installed.
    pub fn new() -> Self {
        Self::default()
    }

    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }

    pub fn vcpus(mut self, vcpus: u32) -> Self {
        self.vcpus = vcpus;
        self
    }

    /// The guest templates (`rootfs/<name>.ext4` of the images directory) L1's hearthd gets.
    pub fn templates<I, S>(mut self, names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.templates = names.into_iter().map(Into::into).collect();
        self
    }

    /// Whether L1 has Firecracker and its jailer at `/opt/hearth/firecracker` (default yes; without them
    /// hearthd's `auto` picks QEMU with KVM).
    pub fn firecracker(mut self, yes: bool) -> Self {
        self.firecracker = yes;
        self
    }

    /// A host file that L1 finds at `/hearth/files/<name>`.
    pub fn file(mut self, host: impl Into<PathBuf>, name: &str) -> Self {
        self.files.push((host.into(), format!("files/{name}"), false));
        self
    }

    /// A program (e.g. a test binary of this build) that L1 finds at `/hearth/files/<name>`, without its debug
    /// info (symbols stay, for backtraces).
    pub fn program(mut self, host: impl Into<PathBuf>, name: &str) -> Self {
        self.files.push((host.into(), format!("files/{name}"), true));
        self
    }

    /// Size of the run disk (sparse on the host): the images plus hearthd's sandboxes and snapshots.
    pub fn disk_gib(mut self, gib: u64) -> Self {
        self.disk_gib = gib;
        self
    }

    /// Take `hearthd` and `hearth` from `dir` (e.g. a release build next to hearth-bench) instead of building
    /// them for the running test.
    pub fn bins(mut self, dir: impl Into<PathBuf>) -> Self {
        self.bins = Some(dir.into());
        self
    }

    /// How long L1 may take to boot and answer, measured on the host.
    pub fn boot_timeout(mut self, timeout: Duration) -> Self {
        self.boot_timeout = timeout;
        self
    }
}

/// What a command run in L1 printed and how it ended.
#[derive(Debug, Clone, Default)]
pub struct Output {
    /// The exit code; `None` when a signal ended it (or it timed out).
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// A running KVM test host. See the module documentation.
pub struct KvmHost {
    agent: AgentClient,
    qemu: Child,
    /// `127.0.0.1:<port>` forwarded to L1's [`L1_API_PORT`].
    pub api_addr: String,
    /// How long the run disk took to make (binaries built or found, `mkfs.ext4 -d`).
    pub disk_time: Duration,
    /// How long L1 took from QEMU's start until its agent answered and `/dev/kvm` was there.
    pub boot_time: Duration,
    dir: tempfile::TempDir,
    hearthd: Option<u32>,
}

impl KvmHost {
    /// Boots L1, waits for its agent, mounts the run disk and loads KVM; panics (with L1's console) when any
    /// of that fails, and when `/dev/kvm` does not work in L1.
    pub async fn boot(opts: KvmHostOptions) -> KvmHost {
        let started = Instant::now();
        for name in ["vmlinux", "initramfs.cpio.gz"] {
            let file = l1_images().join(name);
            assert!(
                file.is_file(),
                "the KVM test host's {} is missing: build it with `bash images/build.sh --kvm-host` (as root)",
                file.display()
            );
        }
        let rootfs = l1_rootfs();
        let rootfs = std::fs::canonicalize(&rootfs).unwrap_or_else(|e| {
            panic!(
                "the KVM test host's root filesystem {} is missing ({e}): build it with \
                 `bash images/build.sh --kvm-host` (as root)",
                rootfs.display()
            )
        });
        remove_stale_boots();
        let dir = tempfile::Builder::new()
            .prefix(DIR_PREFIX)
            .tempdir()
            .expect("a temporary directory");
        std::fs::write(dir.path().join(OWNER_FILE), std::process::id().to_string()).expect("owner file");
        let payload = payload_of(&opts);
        let disk = dir.path().join("run.ext4");
        payload.write(&dir.path().join("stage"), &disk, opts.disk_gib);
        // The staged hard links are in the image now.
        let _ = std::fs::remove_dir_all(dir.path().join("stage"));
        let overlay = dir.path().join("root.qcow2");
        run_ok(
            Command::new("qemu-img")
                .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
                .arg(&rootfs)
                .arg(&overlay),
        );
        let disk_time = started.elapsed();
        let booted = Instant::now();
        let mut tries = 0;
        let (qemu, port) = loop {
            let port = free_port();
            let mut qemu = spawn_qemu(&opts, dir.path(), &overlay, &disk, port);
            // QEMU exits at once when the forward's port was taken meanwhile: try another.
            std::thread::sleep(Duration::from_millis(300));
            match qemu.try_wait() {
                Ok(None) => break (qemu, port),
                _ if tries < 3 => tries += 1,
                status => panic!(
                    "QEMU for the KVM test host exited at once ({status:?}):\n{}",
                    read_lossy(&dir.path().join("qemu.log"))
                ),
            }
        };
        let mut host = KvmHost {
            agent: connect_agent(dir.path(), booted + opts.boot_timeout).await,
            qemu,
            api_addr: format!("127.0.0.1:{port}"),
            disk_time,
            boot_time: Duration::ZERO,
            dir,
            hearthd: None,
        };
        host.prepare(&opts).await;
        host.boot_time = booted.elapsed();
        host
    }

    /// Mounts the run disk and cgroup2, puts the binaries in place and loads KVM.
    async fn prepare(&mut self, opts: &KvmHostOptions) {
        let mut script = format!(
            "set -e
             mkdir -p {m}
             mount -o noatime LABEL={label} {m}
             mountpoint -q /sys/fs/cgroup || mount -t cgroup2 -o nsdelegate cgroup2 /sys/fs/cgroup
             for b in {m}/bin/*; do ln -sf \"$b\" /usr/local/bin/; done
             # KVM, and what udev would have given a real host: /dev/net/tun (the rest loads on demand).
             modprobe -a kvm_amd tun
             test -c /dev/kvm && test -c /dev/net/tun
             ",
            m = payload::MOUNT,
            label = payload::LABEL,
        );
        if opts.bins.is_none() {
            // Test binaries find the daemon where cargo built it on the host (env!("CARGO_BIN_EXE_hearthd")).
            script.push_str(&format!(
                "mkdir -p '{profile}' && mount --bind {m}/bin '{profile}'\n",
                profile = crate::profile_dir().display(),
                m = payload::MOUNT
            ));
        }
        if opts.firecracker {
            script.push_str(&format!(
                "mkdir -p /opt/hearth && ln -sfn {}/firecracker /opt/hearth/firecracker\n",
                payload::MOUNT
            ));
        }
        let out = self.exec(&script).await;
        assert!(
            out.success(),
            "preparing the KVM test host failed ({out:?}); its kernel says:\n{}\n---- console ----\n{}",
            self.exec("dmesg | tail -40").await.stdout,
            self.console_tail(60)
        );
    }

    /// Runs `cmd` with `/bin/sh -c` in L1 (as root, in `/root`, `TMPDIR` on the run disk) and waits for it.
    pub async fn exec(&self, cmd: &str) -> Output {
        self.exec_with(cmd, &[], None, false).await
    }

    /// Runs `cmd` in L1 and panics with its output unless it exits with 0; returns its stdout.
    pub async fn sh(&self, cmd: &str) -> String {
        let out = self.exec(cmd).await;
        assert!(out.success(), "in L1: {cmd}\n{out:?}");
        out.stdout
    }

    /// [`KvmHost::exec`] with extra environment variables, a timeout (the process group is killed when it
    /// passes), and `echo`: copy the output to this process's stderr as it comes (long test runs in L1).
    pub async fn exec_with(
        &self,
        cmd: &str,
        env: &[(&str, &str)],
        timeout: Option<Duration>,
        echo: bool,
    ) -> Output {
        let mut req = ExecRequest::shell(cmd);
        req.env.insert("TMPDIR".into(), format!("{}/tmp", payload::MOUNT));
        for (k, v) in env {
            req.env.insert((*k).to_owned(), (*v).to_owned());
        }
        req.timeout_ms = timeout.map(|t| t.as_millis() as u64);
        let mut handle = match self.agent.exec(req).await {
            Ok(h) => h,
            Err(e) => panic!(
                "exec in L1 ({cmd}): {e}\n---- console ----\n{}",
                self.console_tail(40)
            ),
        };
        let mut out = Output::default();
        let (mut stdout, mut stderr) = (Vec::new(), Vec::new());
        while let Some(ev) = handle.next_event().await {
            match ev {
                ExecEvent::Stdout(b) => {
                    if echo {
                        eprint!("{}", String::from_utf8_lossy(&b));
                    }
                    stdout.extend_from_slice(&b);
                }
                ExecEvent::Stderr(b) => {
                    if echo {
                        eprint!("{}", String::from_utf8_lossy(&b));
                    }
                    stderr.extend_from_slice(&b);
                }
                ExecEvent::Exited {
                    code,
                    signal,
                    timed_out,
                } => {
                    (out.code, out.signal, out.timed_out) = (code, signal, timed_out);
                }
                ExecEvent::Error(e) => {
                    panic!(
                        "exec in L1 ({cmd}): {e}\n---- console ----\n{}",
                        self.console_tail(40)
                    )
                }
            }
        }
        out.stdout = String::from_utf8_lossy(&stdout).into_owned();
        out.stderr = String::from_utf8_lossy(&stderr).into_owned();
        out
    }

    /// The last `lines` lines of L1's console (its kernel log and the agent's messages).
    pub fn console_tail(&self, lines: usize) -> String {
        tail(&read_lossy(&self.dir.path().join("console.log")), lines)
    }

    /// Everything hearthd in L1 printed (its log), across restarts.
    pub fn hearthd_log(&self) -> String {
        read_lossy(&self.dir.path().join("hearthd.log"))
    }

    /// The host directory holding this boot's files (console.log, hearthd.log, the disks).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// L1's QEMU process on the host.
    pub fn qemu_pid(&self) -> u32 {
        self.qemu.id()
    }

    /// Whether L1's QEMU still runs.
    pub fn is_running(&mut self) -> bool {
        matches!(self.qemu.try_wait(), Ok(None))
    }
}

impl Drop for KvmHost {
    fn drop(&mut self) {
        let _ = self.qemu.kill();
        let _ = self.qemu.wait();
        if std::thread::panicking() {
            eprintln!(
                "---- KVM test host: console (last 80 lines) ----\n{}\n---- KVM test host: hearthd log (last 200 \
                 lines) ----\n{}",
                self.console_tail(80),
                tail(&self.hearthd_log(), 200)
            );
        }
    }
}

/// The run disk's contents for `opts`: this build's binaries, Firecracker, the guest images.
fn payload_of(opts: &KvmHostOptions) -> payload::Payload {
    let mut p = payload::Payload::default();
    let bins = match &opts.bins {
        Some(dir) => dir.clone(),
        None => crate::build_bins(&[("hearthd", "hearthd"), ("hearth-cli", "hearth")]),
    };
    p.add_program(bins.join("hearthd"), "bin/hearthd");
    p.add_program(bins.join("hearth"), "bin/hearth");
    p.add(agent_bin(), "bin/hearth-agent");
    if opts.firecracker {
        let fc = Path::new("/opt/hearth/firecracker");
        for name in ["firecracker", "jailer", "LICENSE"] {
            p.add(fc.join(name), format!("firecracker/{name}"));
        }
    }
    let images = crate::images_dir();
    for name in ["vmlinux", "vmlinuz", "initramfs.cpio.gz", "manifest.json"] {
        if name != "manifest.json" || images.join(name).is_file() {
            p.add(images.join(name), format!("images/{name}"));
        }
    }
    for t in &opts.templates {
        p.add(
            images.join("rootfs").join(format!("{t}.ext4")),
            format!("images/rootfs/{t}.ext4"),
        );
    }
    for (host, dest, strip) in &opts.files {
        if *strip {
            p.add_program(host, dest.clone());
        } else {
            p.add(host, dest.clone());
        }
    }
    p
}

/// The static guest agent: `HEARTH_AGENT_BIN`, else what `images/build-agent.sh` builds (and prints).
pub fn agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("HEARTH_AGENT_BIN") {
        return PathBuf::from(p);
    }
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let out = Command::new("bash")
                .arg(crate::workspace_root().join("images/build-agent.sh"))
                .stderr(Stdio::inherit())
                .output()
                .expect("images/build-agent.sh runs");
            assert!(out.status.success(), "images/build-agent.sh failed");
            let text = String::from_utf8_lossy(&out.stdout);
            PathBuf::from(text.lines().last().unwrap_or_default().trim())
        })
        .clone()
}

fn spawn_qemu(opts: &KvmHostOptions, dir: &Path, overlay: &Path, disk: &Path, port: u16) -> Child {
    let l1 = l1_images();
    let mut append = String::from("console=ttyS0 reboot=k panic=-1 pci=off");
    if let Some(khz) = hearth_vmm::qemu::host_tsc_khz() {
        append.push_str(&format!(" tsc_early_khz={khz}"));
    }
    append.push_str(&format!(
        " hearth.transport=serial hearth.hostname=hearth-l1 hearth.net={L1_NET}"
    ));
    let path = |p: &Path| p.display().to_string();
    let log = std::fs::File::create(dir.join("qemu.log")).expect("qemu.log");
    let mut cmd = Command::new(hearth_vmm::detect::QEMU_BINARY);
    cmd.args(["-M", "microvm,acpi=on", "-accel", "tcg", "-cpu", "max"])
        .args([
            "-smp",
            &opts.vcpus.to_string(),
            "-m",
            &opts.memory_mib.to_string(),
        ])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot"])
        .args(["-kernel", &path(&l1.join("vmlinux"))])
        .args(["-initrd", &path(&l1.join("initramfs.cpio.gz"))])
        .args(["-append", &append])
        // vda: L1's root (the initramfs mounts /dev/vda), vdb: the run disk. Writes are throwaway.
        .arg("-drive")
        .arg(format!(
            "if=none,id=root,file={},format=qcow2,cache=unsafe,discard=unmap",
            path(overlay)
        ))
        .args(["-device", "virtio-blk-device,drive=root"])
        .arg("-drive")
        .arg(format!(
            "if=none,id=run,file={},format=raw,cache=unsafe,discard=unmap",
            path(disk)
        ))
        .args(["-device", "virtio-blk-device,drive=run"])
        .args(["-device", "virtio-rng-device"])
        .args(["-device", "virtio-serial-device"])
        .arg("-chardev")
        .arg(format!(
            "socket,id=agent,path={},server=on,wait=off",
            path(&dir.join("agent.sock"))
        ))
        .args(["-device", "virtserialport,chardev=agent,name=hearth.agent"])
        .arg("-chardev")
        .arg(format!("file,id=hdlog,path={}", path(&dir.join("hearthd.log"))))
        .args(["-device", "virtserialport,chardev=hdlog,name=hearth.log"])
        .arg("-netdev")
        .arg(format!(
            "user,id=n0,restrict=on,hostfwd=tcp:127.0.0.1:{port}-:{L1_API_PORT}"
        ))
        .args(["-device", "virtio-net-device,netdev=n0"])
        .arg("-chardev")
        .arg(format!("file,id=con,path={}", path(&dir.join("console.log"))))
        .args(["-serial", "chardev:con"])
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("qemu.log"))
        .stderr(log);
    // SAFETY: prctl(PR_SET_PDEATHSIG) in the child before exec touches no memory of the parent; it makes
    // QEMU die with the test process (a test killed by its runner leaves no L1 behind).
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn()
        .expect("qemu-system-x86_64 starts (bash scripts/install-deps.sh installs it)")
}

/// Connects to L1's agent once its virtio-serial socket is up, retrying until `deadline`.
async fn connect_agent(dir: &Path, deadline: Instant) -> AgentClient {
    let sock = dir.join("agent.sock");
    let mut last = String::from("no attempt");
    while Instant::now() < deadline {
        match tokio::net::UnixStream::connect(&sock).await {
            Ok(stream) => match AgentClient::connect(stream, Duration::from_secs(5)).await {
                Ok(agent) => return agent,
                Err(e) => last = e.to_string(),
            },
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!(
        "L1's agent did not answer in time ({last})\n---- console ----\n{}\n---- qemu ----\n{}",
        tail(&read_lossy(&dir.join("console.log")), 60),
        read_lossy(&dir.join("qemu.log"))
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on 127.0.0.1")
        .port()
}

fn run_ok(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn read_lossy(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
