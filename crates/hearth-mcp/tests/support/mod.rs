//! Test harness: the real `hearthd` (serving `/mcp`) on a temporary data directory, the real `hearth` binary
//! (`hearth mcp`), and the MCP configuration examples of docs/mcp.md filled in for them.
//! Dropping the [`Daemon`] destroys every sandbox it still has, then stops it.

#![allow(clippy::unwrap_used, dead_code)]

use std::ops::Deref;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use hearth_testkit::{Hearthd, Options};
// Not every test binary uses each of these.
#[allow(unused_imports)]
pub use hearth_testkit::{TestNetns, images_dir, workspace_root};
use serde_json::Value;

/// Builds `hearthd` and `hearth` (binaries of other packages, which cargo does not build for these tests) once
/// per test process; returns the directory holding them (the profile directory of this test binary).
pub fn bin_dir() -> PathBuf {
    hearth_testkit::build_bins(&[("hearthd", "hearthd"), ("hearth-cli", "hearth")])
}

pub fn hearth_bin() -> PathBuf {
    bin_dir().join("hearth")
}

/// The kit's [`Hearthd`] (`url`, `key`, `log()`, ...): networking off (`HEARTH_NETWORK=off`) unless started
/// networked; dropping it destroys every sandbox it still has, then stops it.
pub struct Daemon(Hearthd);

impl Deref for Daemon {
    type Target = Hearthd;

    fn deref(&self) -> &Hearthd {
        &self.0
    }
}

fn options() -> Options {
    Options::new()
        .bin(bin_dir().join("hearthd"))
        .cleanup_with_cli(hearth_bin())
}

impl Daemon {
    pub fn start() -> Daemon {
        Daemon(Hearthd::start(options()))
    }

    /// Sandbox networking on: egress leaves through `uplink` (a namespace the test made, no route anywhere) and
    /// sandbox addresses come from `range`, which must differ from every other test's range.
    pub fn start_networked(uplink: &TestNetns, range: &str) -> Daemon {
        Daemon(Hearthd::start(options().uplink(uplink, range)))
    }

    /// [`Daemon::start_networked`] with more daemon flags.
    pub fn start_networked_with(uplink: &TestNetns, range: &str, args: &[&str]) -> Daemon {
        Daemon(Hearthd::start(options().uplink(uplink, range).args(args)))
    }

    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.url)
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
