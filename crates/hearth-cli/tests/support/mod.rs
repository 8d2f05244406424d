//! Test harness: a real `hearthd` on a temporary data directory and the real `hearth` binary pointed at it.
//! Dropping the [`Daemon`] destroys every sandbox it still has, then stops it.

#![allow(clippy::unwrap_used, dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Where `images/build.sh` puts the guest images (overridable like the daemon's own flag).
pub fn images_dir() -> PathBuf {
    std::env::var_os("HEARTH_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/hearth/images"))
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds `hearthd` (a binary of another package, so cargo does not build it for these tests) once per test
/// process and returns its path, next to the `hearth` binary under test.
pub fn hearthd_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let hearth = Path::new(env!("CARGO_BIN_EXE_hearth"));
        let dir = hearth.parent().unwrap();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let mut build = Command::new(cargo);
        build
            .args(["build", "-q", "-p", "hearthd", "--bin", "hearthd"])
            .current_dir(workspace_root());
        if dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("cargo runs");
        assert!(status.success(), "building hearthd failed");
        let bin = dir.join("hearthd");
        assert!(bin.is_file(), "{} missing after the build", bin.display());
        bin
    })
}

pub struct Daemon {
    child: Child,
    pub url: String,
    pub key: String,
    data: tempfile::TempDir,
}

fn wait_for_file(path: &Path, child: &mut Child, log: &Path, within: Duration) -> String {
    let deadline = Instant::now() + within;
    loop {
        if let Ok(text) = std::fs::read_to_string(path)
            && text.ends_with('\n')
        {
            return text.trim().to_owned();
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "hearthd exited ({status}) before writing {}:\n{}",
                path.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "hearthd did not write {} in time",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Daemon {
    /// Starts hearthd on 127.0.0.1 (a free port) with a fresh data directory and the shared images.
    pub fn start() -> Daemon {
        // Sandbox networking is exercised by its own tests, each with an uplink namespace of its own.
        Daemon::start_with(&[], &[("HEARTH_NETWORK", "off")])
    }

    /// Like [`Daemon::start`], with sandbox networking on: egress leaves through `uplink` (a namespace the test
    /// made) and sandbox addresses come from `range`, which must differ from every other test's range.
    pub fn start_networked(uplink: &TestNetns, range: &str) -> Daemon {
        let uplink = uplink.path.display().to_string();
        Daemon::start_with(
            &[
                "--network",
                "on",
                "--uplink-netns",
                &uplink,
                "--sandbox-net",
                range,
                // Nothing answers there: the uplink namespace has no route anywhere.
                "--dns-upstream",
                "192.0.2.53:53",
            ],
            &[],
        )
    }

    fn start_with(args: &[&str], env: &[(&str, &str)]) -> Daemon {
        let bin = hearthd_bin();
        let data = tempfile::tempdir().unwrap();
        let log = data.path().join("hearthd.log");
        let log_file = std::fs::File::create(&log).unwrap();
        let mut child = Command::new(bin)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(data.path().join("state"))
            .arg("--images-dir")
            .arg(images_dir())
            .arg("--default-template")
            .arg("minimal")
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file)
            .spawn()
            .expect("hearthd starts");
        let state = data.path().join("state");
        let addr = wait_for_file(
            &state.join("listen-addr"),
            &mut child,
            &log,
            Duration::from_secs(60),
        );
        let key = std::fs::read_to_string(state.join("api-key"))
            .unwrap()
            .trim()
            .to_owned();
        Daemon {
            child,
            url: format!("http://{addr}"),
            key,
            data,
        }
    }

    /// The `hearth` binary with this daemon's URL and key in its environment.
    pub fn hearth(&self) -> Command {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_hearth"));
        cmd.env("HEARTH_URL", &self.url)
            .env("HEARTH_API_KEY", &self.key)
            .env("NO_COLOR", "1")
            .env_remove("HEARTH_DATA_DIR")
            .stdin(Stdio::null());
        cmd
    }

    /// Runs `hearth ARGS...` to completion.
    pub fn run(&self, args: &[&str]) -> Output {
        self.hearth().args(args).output().unwrap()
    }

    /// Runs `hearth ARGS...` with `input` on its stdin.
    pub fn run_with_stdin(&self, args: &[&str], input: &[u8]) -> Output {
        use std::io::Write;
        let mut child = self
            .hearth()
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let input = input.to_vec();
        let writer = std::thread::spawn(move || {
            // The command may exit before reading everything; a broken pipe is its answer, not ours.
            let _ = stdin.write_all(&input);
        });
        let out = child.wait_with_output().unwrap();
        writer.join().unwrap();
        out
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data.path().join("hearthd.log")).unwrap_or_default()
    }

    fn remove_all_sandboxes(&self) {
        let Ok(out) = self.hearth().args(["--json", "ls"]).output() else {
            return;
        };
        let Ok(list) = serde_json::from_slice::<hearth_api::SandboxList>(&out.stdout) else {
            return;
        };
        for sbx in list.sandboxes {
            let _ = self.hearth().args(["rm", &sbx.id]).output();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // The daemon leaves VMs running on SIGTERM (for adoption); a test must not.
        self.remove_all_sandboxes();
        // SAFETY: kill(2) on our own child's pid, which has not been reaped yet (so it cannot be reused).
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("---- hearthd log ----\n{}", self.log());
        }
    }
}

/// A network namespace the test made (`ip netns add`, loopback up, nothing else), deleted on drop. Declare it
/// before the [`Daemon`] that uses it, so that the daemon (and its sandboxes) go first.
pub struct TestNetns {
    pub name: String,
    pub path: PathBuf,
}

impl TestNetns {
    pub fn new(prefix: &str) -> TestNetns {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        let name = format!("{prefix}-{}-{nanos:08x}", std::process::id());
        for args in [
            vec!["netns", "add", name.as_str()],
            vec!["-n", name.as_str(), "link", "set", "lo", "up"],
        ] {
            let out = Command::new("ip").args(&args).output().expect("ip runs");
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        TestNetns {
            path: PathBuf::from("/run/netns").join(&name),
            name,
        }
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// stdout as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// stderr as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts success and returns stdout.
#[track_caller]
pub fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "hearth failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        stdout(&out),
        stderr(&out)
    );
    stdout(&out)
}
