//! The harness on a real `hearthd` (no VM): it listens with its key, a `kill -9` restart comes back on the same data
//! directory with the same key, and a networked start makes its uplink namespace and removes it with the daemon.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;

use hearth_testkit::{Hearthd, Network, Options};

/// `GET /v1/sandboxes` with the key; returns the status line.
fn list_status(d: &Hearthd) -> String {
    let mut conn = TcpStream::connect(&d.addr).expect("the daemon accepts");
    write!(
        conn,
        "GET /v1/sandboxes HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
        d.addr, d.key
    )
    .expect("request");
    let mut answer = String::new();
    conn.read_to_string(&mut answer).expect("answer");
    answer.lines().next().unwrap_or_default().to_owned()
}

fn netns_exists(name: &str) -> bool {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.split_whitespace().next() == Some(name))
}

fn cmdline(pid: u32) -> String {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
        .unwrap_or_default()
}

#[test]
fn starts_restarts_after_kill9_and_stops() {
    let mut d = Hearthd::start(Options::new());
    assert_eq!(list_status(&d), "HTTP/1.1 200 OK");
    assert!(d.data_dir().starts_with(d.root()) && d.data_dir().join("api-key").is_file());
    let (pid, key, data) = (
        d.pid().expect("running"),
        d.key.clone(),
        d.data_dir().to_path_buf(),
    );
    let environ = String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/environ")).expect("environ"))
        .replace('\0', "\n");
    assert!(
        environ.lines().any(|l| l == "HEARTH_NETWORK=off") && environ.lines().any(|l| l == "RUST_LOG=info"),
        "networking off and RUST_LOG=info by default"
    );
    assert!(
        cmdline(pid).contains("--default-template minimal"),
        "{}",
        cmdline(pid)
    );

    d.kill9_and_restart();
    assert_ne!(d.pid(), Some(pid), "a new process");
    assert_eq!(d.key, key, "the same data directory keeps its key");
    assert_eq!(list_status(&d), "HTTP/1.1 200 OK");
    assert!(d.log().contains("listening"), "the log is kept:\n{}", d.log());

    let pid = d.pid().expect("running");
    drop(d);
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "the daemon is gone"
    );
    assert!(!data.exists(), "the temporary directory is gone");
}

#[test]
fn a_networked_start_owns_its_uplink_namespace() {
    let d = Hearthd::start(Options::new().network(Network::OwnUplink {
        prefix: "htk-up".to_owned(),
        range: "10.213.72.0/24".to_owned(),
    }));
    let ns = d.uplink().expect("the daemon's uplink").name.clone();
    assert!(netns_exists(&ns), "{ns} is made");
    let cmd = cmdline(d.pid().expect("running"));
    assert!(
        cmd.contains(&format!(
            "--network on --uplink-netns /run/netns/{ns} --sandbox-net 10.213.72.0/24"
        )),
        "{cmd}"
    );
    assert_eq!(list_status(&d), "HTTP/1.1 200 OK");
    drop(d);
    assert!(!netns_exists(&ns), "{ns} is removed with the daemon");
}
