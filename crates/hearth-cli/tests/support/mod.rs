//! Test harness: a real `hearthd` on a temporary data directory and the real `hearth` binary pointed at it.
//! Dropping the [`Daemon`] destroys every sandbox it still has, then stops it.

#![allow(clippy::unwrap_used, dead_code)]

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use hearth_testkit::{Hearthd, Options};
// Not every test binary uses each of these.
#[allow(unused_imports)]
pub use hearth_testkit::{TestNetns, images_dir};

/// `hearthd`, built once per test process (a binary of another package, so cargo does not build it for these
/// tests), next to the `hearth` binary under test.
pub fn hearthd_bin() -> PathBuf {
    hearth_testkit::hearthd_bin()
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
        .bin(hearthd_bin())
        .cleanup_with_cli(env!("CARGO_BIN_EXE_hearth"))
}

impl Daemon {
    pub fn start() -> Daemon {
        Daemon(Hearthd::start(options()))
    }

    /// A daemon whose options `f` adjusts.
    pub fn start_with(f: impl FnOnce(Options) -> Options) -> Daemon {
        Daemon(Hearthd::start(f(options())))
    }

    /// Sandbox networking on: egress leaves through `uplink` (a namespace the test made, no route anywhere) and
    /// sandbox addresses come from `range`, which must differ from every other test's range.
    pub fn start_networked(uplink: &TestNetns, range: &str) -> Daemon {
        Daemon(Hearthd::start(options().uplink(uplink, range)))
    }

    /// The `hearth` binary with this daemon's URL and key in its environment.
    pub fn hearth(&self) -> Command {
        self.0.hearth(Path::new(env!("CARGO_BIN_EXE_hearth")))
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
