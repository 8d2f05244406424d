//! Test harness: the real `hearthd` (serving `/mcp`) on a temporary data directory, the real `hearth` binary
//! (`hearth mcp`), and the MCP configuration examples of docs/mcp.md filled in for them.
//! Dropping the [`Daemon`] destroys every sandbox it still has, then stops it.

#![allow(clippy::unwrap_used, dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::Value;

/// Where `images/build.sh` puts the guest images (overridable like the daemon's own flag).
pub fn images_dir() -> PathBuf {
    std::env::var_os("HEARTH_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/hearth/images"))
}

pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds `hearthd` and `hearth` (binaries of other packages, which cargo does not build for these tests) once
/// per test process; returns the directory holding them (the profile directory of this test binary).
pub fn bin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        // This test runs from <target>/<profile>/deps/.
        let exe = std::env::current_exe().unwrap();
        let dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let mut build = Command::new(cargo);
        build
            .args([
                "build",
                "-q",
                "-p",
                "hearthd",
                "--bin",
                "hearthd",
                "-p",
                "hearth-cli",
                "--bin",
                "hearth",
            ])
            .current_dir(workspace_root());
        if dir.file_name().is_some_and(|n| n == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("cargo runs");
        assert!(status.success(), "building hearthd and hearth failed");
        for bin in ["hearthd", "hearth"] {
            assert!(
                dir.join(bin).is_file(),
                "{bin} missing in {} after the build",
                dir.display()
            );
        }
        dir
    })
}

pub fn hearth_bin() -> PathBuf {
    bin_dir().join("hearth")
}

pub struct Daemon {
    child: Child,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub key: String,
    data: tempfile::TempDir,
}

impl Daemon {
    /// Starts hearthd on 127.0.0.1 (a free port) with a fresh data directory and the shared images, sandbox
    /// networking off.
    pub fn start() -> Daemon {
        // Sandbox networking is exercised by its own tests, each with an uplink namespace of its own.
        Daemon::start_with(&[], &[("HEARTH_NETWORK", "off")])
    }

    /// Starts hearthd with sandbox networking on: `uplink` (a namespace the test made, with no route anywhere,
    /// so nothing a guest sends leaves it) as the uplink and `range` (e.g. `10.213.70.0/24`, distinct from
    /// every other test's) as the sandbox range.
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
        let bin = bin_dir().join("hearthd");
        let data = tempfile::tempdir().unwrap();
        let log = data.path().join("hearthd.log");
        let log_file = std::fs::File::create(&log).unwrap();
        let state = data.path().join("state");
        let mut child = Command::new(bin)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--data-dir")
            .arg(&state)
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
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = loop {
            if let Ok(text) = std::fs::read_to_string(state.join("listen-addr"))
                && text.ends_with('\n')
            {
                break text.trim().to_owned();
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "hearthd exited ({status}) before listening:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            assert!(Instant::now() < deadline, "hearthd did not start in time");
            std::thread::sleep(Duration::from_millis(50));
        };
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

    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.url)
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.data.path().join("hearthd.log")).unwrap_or_default()
    }

    /// One server entry of docs/mcp.md's example `name` (`stdio` or `http`), pointed at this daemon and this
    /// build of `hearth`.
    pub fn doc_config(&self, name: &str) -> Value {
        let text = doc_example(name)
            .replace("http://127.0.0.1:7070", &self.url)
            .replace("<your API key>", &self.key);
        let doc: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("docs/mcp.md {name}: {e}"));
        let mut entry = doc["mcpServers"]["hearth"].clone();
        assert!(entry.is_object(), "docs/mcp.md {name}: no mcpServers.hearth");
        if entry["command"] == "hearth" {
            entry["command"] = Value::String(hearth_bin().to_string_lossy().into_owned());
        }
        entry
    }

    fn remove_all_sandboxes(&self) {
        let client = || {
            let mut cmd = Command::new(hearth_bin());
            cmd.env("HEARTH_URL", &self.url)
                .env("HEARTH_API_KEY", &self.key)
                .stdin(Stdio::null());
            cmd
        };
        let Ok(out) = client().args(["--json", "ls"]).output() else {
            return;
        };
        let Ok(list) = serde_json::from_slice::<Value>(&out.stdout) else {
            return;
        };
        for sbx in list["sandboxes"].as_array().into_iter().flatten() {
            if let Some(id) = sbx["id"].as_str() {
                let _ = client().args(["rm", id]).output();
            }
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

/// A network namespace made for one test (`ip netns add`, loopback up), deleted on drop, even when the test
/// fails. Declare it before the [`Daemon`] using it, so that it is dropped after the daemon.
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

/// The JSON block following `<!-- example: NAME -->` in docs/mcp.md.
pub fn doc_example(name: &str) -> String {
    let doc = std::fs::read_to_string(workspace_root().join("docs/mcp.md")).unwrap();
    let marker = format!("<!-- example: {name} -->");
    let after = &doc[doc
        .find(&marker)
        .unwrap_or_else(|| panic!("no {marker} in docs/mcp.md"))
        + marker.len()..];
    let start = after.find("```json\n").expect("a json block after the marker") + "```json\n".len();
    let len = after[start..].find("```").expect("the json block ends");
    after[start..start + len].to_owned()
}

/// tests/js: the JavaScript MCP clients and their lock file.
pub fn js_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/js")
}

/// `npm ci` when node_modules does not match package-lock.json. Test runners may run these tests in parallel
/// processes (nextest does), so the check and the install happen under an exclusive lock, and an install that
/// is already done is not repeated (`npm ci` would delete node_modules under a running test).
pub fn npm_ci() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        let dir = js_dir();
        let lock_path = std::env::temp_dir().join("hearth-mcp-npm-ci.lock");
        let lock = std::fs::File::create(&lock_path).unwrap();
        // SAFETY: flock(2) on a descriptor we own; released when `lock` is closed at the end of this block.
        let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) };
        assert_eq!(rc, 0, "flock {}", lock_path.display());
        let wanted = std::fs::read(dir.join("package-lock.json")).unwrap();
        let marker = dir.join("node_modules/.hearth-installed-from");
        if std::fs::read(&marker).ok().as_deref() == Some(&wanted[..]) {
            return;
        }
        let out = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&dir)
            .output()
            .expect("npm runs (Node.js and npm must be installed)");
        assert!(
            out.status.success(),
            "npm ci failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        std::fs::write(&marker, &wanted).unwrap();
        drop(lock);
    });
}
