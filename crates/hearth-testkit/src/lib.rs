//! Test harness shared by the workspace's integration tests (a dev-dependency only, never published): builds and
//! finds the `hearthd` and `hearth` binaries, starts a real `hearthd` on a temporary data directory and waits until
//! it listens, restarts it after `kill -9` or SIGTERM, and stops it (and what it left) on drop. [`TestNetns`] is a
//! network namespace made for one test.
//!
//! # Layout
//! - binaries: [`build_bins`], [`hearthd_bin`], [`hearth_bin`] (built once per test process), [`images_dir`].
//! - the daemon: [`Options`] (how to start it, a builder), [`Hearthd`] (the running daemon, its address, key and
//!   log, restarts, cleanup on drop), [`pids_mentioning`] (what it left running).
//! - [`TestNetns`]: `ip netns add`, removed on drop.
//! - [`kvm_host`]: a VM with a working `/dev/kvm` (nested SVM under QEMU TCG) running hearthd, Firecracker and
//!   QEMU+KVM, for tests of what only KVM shows.
//! - [`hostile_disk`]: disk headers a hostile guest writes to steer the host, and a watched canary host file.
//! - [`s3`]: real S3-compatible servers (s3s-fs, moto) on 127.0.0.1 for object-storage tests.

pub mod hostile_disk;
pub mod s3;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

pub mod kvm_host;

/// Where `images/build.sh` puts the guest images (overridable like the daemon's own flag).
pub fn images_dir() -> PathBuf {
    std::env::var_os("HEARTH_IMAGES").map_or_else(|| PathBuf::from("/var/lib/hearth/images"), PathBuf::from)
}

/// The workspace's root directory.
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The profile directory (`<target>/<profile>`) of the running test binary, which runs from its `deps/`; cargo
/// puts the workspace's binaries there.
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    exe.parent()
        .and_then(Path::parent)
        .expect("the test binary runs from <target>/<profile>/deps/")
        .to_path_buf()
}

/// Builds the `(package, binary)` pairs not built yet by this test process, in one `cargo build` (cargo does not
/// build other packages' binaries for a package's tests), and returns the directory holding them.
pub fn build_bins(bins: &[(&str, &str)]) -> PathBuf {
    static BUILT: Mutex<Vec<(String, String)>> = Mutex::new(Vec::new());
    let dir = profile_dir();
    let mut built = BUILT.lock().unwrap_or_else(PoisonError::into_inner);
    let missing: Vec<(&str, &str)> = bins
        .iter()
        .copied()
        .filter(|(p, b)| !built.iter().any(|(bp, bb)| bp == p && bb == b))
        .collect();
    if missing.is_empty() {
        return dir;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut build = Command::new(cargo);
    build.args(["build", "-q"]);
    for (package, bin) in &missing {
        build.args(["-p", package, "--bin", bin]);
    }
    build.current_dir(workspace_root());
    if dir.file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    let names: Vec<&str> = missing.iter().map(|(_, b)| *b).collect();
    let status = build.status().expect("cargo runs");
    assert!(status.success(), "building {} failed", names.join(" and "));
    for (package, bin) in missing {
        assert!(
            dir.join(bin).is_file(),
            "{bin} missing in {} after the build",
            dir.display()
        );
        built.push((package.to_owned(), bin.to_owned()));
    }
    dir
}

/// Builds the integration test binaries `tests` of `package` (`cargo test --no-run`) and returns each one's
/// name and executable, for tests that run other tests elsewhere (e.g. inside a [`kvm_host::KvmHost`]).
pub fn build_test_bins(package: &str, tests: &[&str]) -> Vec<(String, PathBuf)> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut build = Command::new(cargo);
    build.args(["test", "-q", "--no-run", "--message-format=json", "-p", package]);
    for t in tests {
        build.args(["--test", t]);
    }
    if profile_dir().file_name().is_some_and(|n| n == "release") {
        build.arg("--release");
    }
    let out = build
        .current_dir(workspace_root())
        .stderr(Stdio::inherit())
        .output()
        .expect("cargo runs");
    assert!(
        out.status.success(),
        "building the tests {tests:?} of {package} failed"
    );
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let (Some(name), Some(exe)) = (msg["target"]["name"].as_str(), msg["executable"].as_str()) else {
            continue;
        };
        if msg["target"]["kind"][0] == "test" && tests.contains(&name) {
            found.push((name.to_owned(), PathBuf::from(exe)));
        }
    }
    for t in tests {
        assert!(
            found.iter().any(|(n, _)| n == t),
            "cargo built no test binary {t} of {package}"
        );
    }
    found
}

/// The `hearthd` binary, built once per test process.
pub fn hearthd_bin() -> PathBuf {
    build_bins(&[("hearthd", "hearthd")]).join("hearthd")
}

/// The `hearth` binary, built once per test process.
pub fn hearth_bin() -> PathBuf {
    build_bins(&[("hearth-cli", "hearth")]).join("hearth")
}

/// The daemon's sandbox networking.
#[derive(Clone, Debug, Default)]
pub enum Network {
    /// `HEARTH_NETWORK=off` in the daemon's environment. Networking is exercised by its own tests, each with an
    /// uplink namespace of its own.
    #[default]
    Off,
    /// Networking on: egress leaves through the namespace at `uplink` (one the test made) and sandbox addresses
    /// come from `range` (e.g. `10.213.70.0/24`), which must differ from every other test's range.
    Uplink { uplink: PathBuf, range: String },
    /// Like [`Network::Uplink`], through a [`TestNetns`] named after `prefix` that the daemon owns: it is removed
    /// after the daemon has stopped.
    OwnUplink { prefix: String, range: String },
    /// Neither flags nor environment: the extra flags decide.
    Unset,
}

/// How a dropped daemon is stopped.
#[derive(Clone, Copy, Debug)]
pub enum Stop {
    /// SIGTERM (the daemon leaves its VMs running, for adoption), then SIGKILL if it is still running after this.
    Term(Duration),
    /// SIGKILL.
    Kill,
}

/// How to start a [`Hearthd`]. The defaults: the built `hearthd`, sandbox networking off, `RUST_LOG=info`, data
/// in `state/` of a fresh temporary directory, stopped with SIGTERM (15 s, then SIGKILL) and its log printed
/// when the test panicked.
#[derive(Clone, Debug)]
pub struct Options {
    bin: Option<PathBuf>,
    network: Network,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    rust_log: String,
    tempdir_prefix: Option<String>,
    data_subdir: Option<PathBuf>,
    cleanup_cli: Option<PathBuf>,
    stop: Stop,
    kill_leftover_vmms: bool,
    log_on_panic: bool,
    start_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            bin: None,
            network: Network::Off,
            args: Vec::new(),
            env: Vec::new(),
            rust_log: "info".to_owned(),
            tempdir_prefix: None,
            data_subdir: Some(PathBuf::from("state")),
            cleanup_cli: None,
            stop: Stop::Term(Duration::from_secs(15)),
            kill_leftover_vmms: false,
            log_on_panic: true,
            start_timeout: Duration::from_secs(60),
        }
    }
}

impl Options {
    pub fn new() -> Options {
        Options::default()
    }

    /// The `hearthd` binary to run (default: [`hearthd_bin`]).
    pub fn bin(mut self, bin: impl Into<PathBuf>) -> Options {
        self.bin = Some(bin.into());
        self
    }

    pub fn network(mut self, network: Network) -> Options {
        self.network = network;
        self
    }

    /// Networking on through `uplink` (a namespace the test made) with sandbox addresses from `range`
    /// ([`Network::Uplink`]).
    pub fn uplink(self, uplink: &TestNetns, range: &str) -> Options {
        self.network(Network::Uplink {
            uplink: uplink.path.clone(),
            range: range.to_owned(),
        })
    }

    /// Extra flags, after the harness's own (kept for restarts).
    pub fn args<I, S>(mut self, args: I) -> Options
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// An extra environment variable for the daemon.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Options {
        self.env.push((key.into(), value.into()));
        self
    }

    pub fn rust_log(mut self, filter: impl Into<String>) -> Options {
        self.rust_log = filter.into();
        self
    }

    /// The temporary directory's name prefix (short ones keep Unix socket paths under the sandboxes short).
    pub fn tempdir_prefix(mut self, prefix: impl Into<String>) -> Options {
        self.tempdir_prefix = Some(prefix.into());
        self
    }

    /// The data directory is the temporary directory itself (beside the log) instead of its `state/`.
    pub fn data_in_tempdir_root(mut self) -> Options {
        self.data_subdir = None;
        self
    }

    /// Before stopping, destroy every sandbox the daemon still has with this `hearth` binary.
    pub fn cleanup_with_cli(mut self, hearth: impl Into<PathBuf>) -> Options {
        self.cleanup_cli = Some(hearth.into());
        self
    }

    pub fn stop_on_drop(mut self, stop: Stop) -> Options {
        self.stop = stop;
        self
    }

    /// After stopping, SIGKILL every process whose command line names the temporary directory (the VMMs the
    /// daemon leaves running for adoption).
    pub fn kill_leftover_vmms(mut self, yes: bool) -> Options {
        self.kill_leftover_vmms = yes;
        self
    }

    /// Print the daemon's log on drop when the test is panicking.
    pub fn log_on_panic(mut self, yes: bool) -> Options {
        self.log_on_panic = yes;
        self
    }
}

/// A real `hearthd` on 127.0.0.1 (a free port) with a fresh data directory and the shared images. Its stdout and
/// stderr go to a log file beside the data; restarts append to it.
pub struct Hearthd {
    /// `127.0.0.1:PORT` (updated by restarts)
    pub addr: String,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    /// The API key.
    pub key: String,
    opts: Options,
    child: Option<Child>,
    root: tempfile::TempDir,
    data: PathBuf,
    /// Dropped after the daemon has been stopped (fields drop after `Drop::drop`).
    own_uplink: Option<TestNetns>,
}

impl Hearthd {
    /// Starts the daemon and waits until it listens (blocking the thread).
    pub fn start(opts: Options) -> Hearthd {
        let mut d = Hearthd::launch(opts);
        d.wait_ready();
        d
    }

    /// Like [`Hearthd::start`], waiting without blocking the async runtime.
    pub async fn start_async(opts: Options) -> Hearthd {
        let mut d = Hearthd::launch(opts);
        d.wait_ready_async().await;
        d
    }

    fn launch(opts: Options) -> Hearthd {
        let mut builder = tempfile::Builder::new();
        if let Some(prefix) = &opts.tempdir_prefix {
            builder.prefix(prefix);
        }
        let root = builder.tempdir().expect("a temporary directory");
        let data = match &opts.data_subdir {
            Some(sub) => root.path().join(sub),
            None => root.path().to_path_buf(),
        };
        let own_uplink = match &opts.network {
            Network::OwnUplink { prefix, .. } => Some(TestNetns::new(prefix)),
            _ => None,
        };
        let mut d = Hearthd {
            opts,
            child: None,
            addr: String::new(),
            url: String::new(),
            key: String::new(),
            root,
            data,
            own_uplink,
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        let bin = self.opts.bin.clone().unwrap_or_else(hearthd_bin);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("the log file");
        let mut cmd = Command::new(bin);
        cmd.arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(&self.data)
            .arg("--images-dir")
            .arg(images_dir())
            .arg("--default-template")
            .arg("minimal");
        let uplink = match &self.opts.network {
            Network::Off => {
                cmd.env("HEARTH_NETWORK", "off");
                None
            }
            Network::Uplink { uplink, range } => Some((uplink.clone(), range)),
            Network::OwnUplink { range, .. } => {
                let ns = self.own_uplink.as_ref().expect("the daemon's uplink namespace");
                Some((ns.path.clone(), range))
            }
            Network::Unset => None,
        };
        if let Some((uplink, range)) = uplink {
            cmd.args(["--network", "on", "--uplink-netns"])
                .arg(uplink)
                .args(["--sandbox-net", range.as_str()])
                // Nothing answers there: the uplink namespace has no route anywhere.
                .args(["--dns-upstream", "192.0.2.53:53"]);
        }
        cmd.args(&self.opts.args)
            .envs(self.opts.env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", &self.opts.rust_log)
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log file"))
            .stderr(log);
        self.child = Some(cmd.spawn().expect("hearthd starts"));
    }

    /// Whether the daemon has written its address (then read with its key); panics if it exited or `deadline`
    /// passed.
    fn poll_ready(&mut self, deadline: Instant) -> bool {
        if let Ok(text) = std::fs::read_to_string(self.data.join("listen-addr"))
            && text.ends_with('\n')
        {
            self.addr = text.trim().to_owned();
            self.url = format!("http://{}", self.addr);
            self.key = std::fs::read_to_string(self.data.join("api-key"))
                .expect("the api-key file")
                .trim()
                .to_owned();
            return true;
        }
        if let Some(status) = self.try_wait() {
            panic!("hearthd exited ({status}) before listening:\n{}", self.log());
        }
        assert!(
            Instant::now() < deadline,
            "hearthd did not listen in time:\n{}",
            self.log()
        );
        false
    }

    fn wait_ready(&mut self) {
        let deadline = Instant::now() + self.opts.start_timeout;
        while !self.poll_ready(deadline) {
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    async fn wait_ready_async(&mut self) {
        let deadline = Instant::now() + self.opts.start_timeout;
        while !self.poll_ready(deadline) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `kill -9` the daemon (its VMs keep running).
    fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        std::fs::remove_file(self.data.join("listen-addr")).ok();
    }

    /// SIGTERM the daemon (graceful: its VMs keep running) and assert it exits with success.
    fn term(&mut self) {
        if let Some(mut child) = self.child.take() {
            sigterm(&child);
            let status = child.wait().expect("wait for hearthd");
            assert!(status.success(), "hearthd exited with {status} on SIGTERM");
        }
        std::fs::remove_file(self.data.join("listen-addr")).ok();
    }

    /// Sets an environment variable for the daemon's next starts (a setting changed between two runs on one
    /// data directory, e.g. `HEARTH_CACHE_SIZE`); takes effect at the next restart.
    pub fn set_env_for_restarts(&mut self, key: impl Into<OsString>, value: impl Into<OsString>) {
        self.opts.env.push((key.into(), value.into()));
    }

    /// `kill -9` the daemon (VMs keep running) and start it again on the same data directory.
    pub fn kill9_and_restart(&mut self) {
        self.kill9();
        self.spawn();
        self.wait_ready();
    }

    pub async fn kill9_and_restart_async(&mut self) {
        self.kill9();
        self.spawn();
        self.wait_ready_async().await;
    }

    /// SIGTERM the daemon, assert it exited with success, and start it again on the same data directory.
    pub fn term_and_restart(&mut self) {
        self.term();
        self.spawn();
        self.wait_ready();
    }

    pub async fn term_and_restart_async(&mut self) {
        self.term();
        self.spawn();
        self.wait_ready_async().await;
    }

    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// The temporary directory holding the data directory and the log.
    pub fn root(&self) -> &Path {
        self.root.path()
    }

    pub fn log_path(&self) -> PathBuf {
        self.root.path().join("hearthd.log")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The daemon's exit status once it has exited.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    /// The uplink namespace the daemon owns ([`Network::OwnUplink`]).
    pub fn uplink(&self) -> Option<&TestNetns> {
        self.own_uplink.as_ref()
    }

    /// The `hearth` binary at `hearth` with this daemon's URL and key in its environment.
    pub fn hearth(&self, hearth: &Path) -> Command {
        let mut cmd = Command::new(hearth);
        cmd.env("HEARTH_URL", &self.url)
            .env("HEARTH_API_KEY", &self.key)
            .env("NO_COLOR", "1")
            .env_remove("HEARTH_DATA_DIR")
            .stdin(Stdio::null());
        cmd
    }

    /// Destroys every sandbox the daemon has, with `hearth ls` and `hearth rm`; errors are ignored.
    pub fn remove_all_sandboxes(&self, hearth: &Path) {
        let Ok(out) = self.hearth(hearth).args(["--json", "ls"]).output() else {
            return;
        };
        let Ok(list) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
            return;
        };
        for sbx in list["sandboxes"].as_array().into_iter().flatten() {
            if let Some(id) = sbx["id"].as_str() {
                let _ = self.hearth(hearth).args(["rm", id]).output();
            }
        }
    }
}

fn sigterm(child: &Child) {
    // SAFETY: kill(2) on our own child's pid, which has not been reaped yet (so it cannot be reused).
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
}

impl Drop for Hearthd {
    fn drop(&mut self) {
        if let Some(hearth) = self.opts.cleanup_cli.clone() {
            // The daemon leaves VMs running on SIGTERM (for adoption); a test must not.
            self.remove_all_sandboxes(&hearth);
        }
        if let Some(mut child) = self.child.take() {
            if let Stop::Term(grace) = self.opts.stop {
                sigterm(&child);
                let deadline = Instant::now() + grace;
                while Instant::now() < deadline {
                    if let Ok(Some(_)) = child.try_wait() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        if self.opts.kill_leftover_vmms {
            for pid in pids_mentioning(self.root.path()) {
                // SAFETY: kill(2) has no memory-safety preconditions; the pid runs from this test's directory.
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                }
            }
        }
        if self.opts.log_on_panic && std::thread::panicking() {
            eprintln!("---- hearthd log ----\n{}", self.log());
        }
    }
}

/// Pids of live (non-zombie) processes whose command line contains `needle`.
pub fn pids_mentioning(needle: &Path) -> Vec<u32> {
    let needle = needle.as_os_str().as_encoded_bytes().to_vec();
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in entries.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rfind(')').and_then(|i| s.get(i + 2..i + 3)).map(|st| st == "Z"))
            .unwrap_or(true);
        if !zombie && cmd.windows(needle.len()).any(|w| w == needle.as_slice()) {
            out.push(pid);
        }
    }
    out
}

/// A network namespace made for one test (`ip netns add`, loopback up, nothing else), deleted on drop, even when
/// the test fails. Declare it before the daemon using it, so that it is dropped after the daemon.
pub struct TestNetns {
    pub name: String,
    pub path: PathBuf,
}

impl TestNetns {
    pub fn new(prefix: &str) -> TestNetns {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("the clock is after 1970")
            .subsec_nanos();
        let name = format!("{prefix}-{}-{nanos:08x}", std::process::id());
        let ns = TestNetns {
            path: PathBuf::from("/run/netns").join(&name),
            name,
        };
        for args in [
            vec!["netns", "add", ns.name.as_str()],
            vec!["-n", ns.name.as_str(), "link", "set", "lo", "up"],
        ] {
            let out = Command::new("ip").args(&args).output().expect("ip runs");
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        ns
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}
