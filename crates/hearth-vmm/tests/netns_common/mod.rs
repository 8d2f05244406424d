//! A network namespace made by a test, laid out like a sandbox's (hearth-net's contract): `tap0` holding the
//! gateway address and the gateway's fixed MAC. Deleted on drop, with its tap, even when the test fails.

#![allow(dead_code)]

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::process::Command;

pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn ip_out(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("run ip");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub struct TestNetns {
    pub name: String,
    pub path: PathBuf,
}

impl TestNetns {
    /// `hxt-nic-<unique>` with `lo` up and `tap0` (persistent, gateway address and MAC, up).
    pub fn new() -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let name = format!(
            "hxt-nic-{:05x}{:02x}{:04x}",
            std::process::id() & 0xfffff,
            SEQ.fetch_add(1, Ordering::Relaxed) & 0xff,
            nanos & 0xffff
        );
        ip(&["netns", "add", &name]);
        let ns = TestNetns {
            path: PathBuf::from("/run/netns").join(&name),
            name,
        };
        let gw = format!("{}/{}", hearth_net::GATEWAY, hearth_net::GUEST_PREFIX);
        let n = ns.name.as_str();
        let tap = hearth_net::TAP_NAME;
        ip(&["-n", n, "link", "set", "lo", "up"]);
        ip(&["-n", n, "tuntap", "add", "dev", tap, "mode", "tap"]);
        ip(&[
            "-n",
            n,
            "link",
            "set",
            "dev",
            tap,
            "address",
            hearth_net::GATEWAY_MAC,
        ]);
        ip(&["-n", n, "addr", "add", &gw, "dev", tap]);
        ip(&["-n", n, "link", "set", "dev", tap, "up"]);
        ns
    }

    /// `ip link show dev tap0` in the namespace.
    pub fn tap_link(&self) -> String {
        ip_out(&["-n", &self.name, "link", "show", "dev", hearth_net::TAP_NAME])
    }

    /// True while some process has the tap open (the kernel reports NO-CARRIER otherwise).
    pub fn tap_attached(&self) -> bool {
        let link = self.tap_link();
        assert!(!link.is_empty(), "tap0 is gone from {}", self.name);
        !link.contains("NO-CARRIER")
    }

    /// The namespace's inode, as `/proc/<pid>/ns/net` of a process inside it shows.
    pub fn inode(&self) -> u64 {
        std::fs::metadata(&self.path).expect("netns file").ino()
    }
}

impl Drop for TestNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// The network namespace inode of process `pid`.
pub fn netns_inode_of(pid: u32) -> u64 {
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .expect("process netns")
        .ino()
}
