//! Test harness: the real `hearthd` (serving `/mcp`) on a temporary data directory, the real `hearth` binary
//! (`hearth mcp`), and the MCP configuration examples of docs/mcp.md filled in for them.
//! Dropping the [`Daemon`] destroys every sandbox it still has, then stops it.

#![allow(clippy::unwrap_used, dead_code)]

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use hearth_testkit::{Hearthd, Network, Options};
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

pub struct Daemon {
    hearthd: Hearthd,
    /// `http://127.0.0.1:PORT`
    pub url: String,
    pub key: String,
}

impl Daemon {
    /// Starts hearthd on 127.0.0.1 (a free port) with a fresh data directory and the shared images, sandbox
    /// networking off (`HEARTH_NETWORK=off`: it is exercised by its own tests, each with an uplink namespace).
    pub fn start() -> Daemon {
        Daemon::start_with(Options::new())
    }

    /// Starts hearthd with sandbox networking on: `uplink` (a namespace the test made, with no route anywhere,
    /// so nothing a guest sends leaves it) as the uplink and `range` (e.g. `10.213.70.0/24`, distinct from
    /// every other test's) as the sandbox range.
    pub fn start_networked(uplink: &TestNetns, range: &str) -> Daemon {
        Daemon::start_with(Options::new().network(Network::Uplink {
            uplink: uplink.path.clone(),
            range: range.to_owned(),
        }))
    }

    fn start_with(opts: Options) -> Daemon {
        let bins = bin_dir();
        let hearthd = Hearthd::start(
            opts.bin(bins.join("hearthd"))
                .cleanup_with_cli(bins.join("hearth")),
        );
        Daemon {
            url: hearthd.url(),
            key: hearthd.key().to_owned(),
            hearthd,
        }
    }

    pub fn mcp_url(&self) -> String {
        format!("{}/mcp", self.url)
    }

    pub fn log(&self) -> String {
        self.hearthd.log()
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
