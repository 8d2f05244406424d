//! The real binary as PID 1 of fresh PID, mount, UTS and network namespaces (the closest thing to a guest
//! boot without a VM): mounts, hostname from the command line, `lo` up, orphan reaping, SIGTERM/SIGINT
//! ignored, and serving the channel (over a Unix socket here).

use std::path::Path;
use std::process::{Child, Command};
use std::time::Duration;

use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};

/// Kills the namespace (through `unshare --kill-child`) when the test ends.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn sh(c: &AgentClient, line: &str) -> (Option<i32>, String) {
    let mut h = c.exec(ExecRequest::shell(line)).await.expect("exec");
    let mut out = Vec::new();
    loop {
        match h.next_event().await.expect("event") {
            ExecEvent::Stdout(d) | ExecEvent::Stderr(d) => out.extend_from_slice(&d),
            ExecEvent::Exited { code, .. } => return (code, String::from_utf8_lossy(&out).into_owned()),
            ExecEvent::Error(e) => panic!("{e}"),
        }
    }
}

fn start(sock: &Path) -> Guard {
    let bin = env!("CARGO_BIN_EXE_hearth-agent");
    let child = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "--uts",
            "--net",
            "--propagation",
            "private",
        ])
        .arg(bin)
        .arg("--unix")
        .arg(sock)
        .env(
            "HEARTH_AGENT_CMDLINE",
            "quiet hearth.hostname=pid1-test hearth.transport=serial",
        )
        .spawn()
        .expect("unshare");
    Guard(child)
}

#[tokio::test]
async fn agent_as_pid1_sets_up_the_system_and_reaps_orphans() {
    // Not under /tmp (nor under a checkout that lives in /tmp, as CI's may): the agent mounts a fresh tmpfs on
    // /tmp inside its namespace, which would hide the socket from the host.
    let dir = tempfile::Builder::new()
        .prefix("hearth-pid1")
        .tempdir_in("/var/tmp")
        .expect("tempdir");
    let sock = dir.path().join("agent.sock");
    let _guard = start(&sock);
    let mut client = None;
    for _ in 0..600 {
        if let Ok(s) = tokio::net::UnixStream::connect(&sock).await
            && let Ok(c) = AgentClient::connect(s, Duration::from_secs(5)).await
        {
            client = Some(c);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c = client.expect("the agent in the namespace answers");

    let (_, pid) = sh(&c, "cat /proc/1/comm").await;
    assert_eq!(pid.trim(), "hearth-agent");
    let (_, host) = sh(&c, "cat /proc/sys/kernel/hostname").await;
    assert_eq!(host.trim(), "pid1-test");
    let (_, mounts) = sh(&c, "cat /proc/mounts").await;
    for m in [" /tmp tmpfs ", " /dev/shm tmpfs "] {
        assert!(mounts.contains(m), "{m} missing from\n{mounts}");
    }
    let (_, tmp_mode) = sh(&c, "stat -c %a /tmp").await;
    assert_eq!(tmp_mode.trim(), "1777");
    let (_, lo) = sh(&c, "ip -o link show lo").await;
    assert!(lo.contains("UP"), "lo is not up: {lo}");

    // PID 1 shrugs off SIGTERM and SIGINT.
    let (code, _) = sh(&c, "kill -TERM 1; kill -INT 1; sleep 0.2").await;
    assert_eq!(code, Some(0));
    c.ping().await.expect("still alive after SIGTERM/SIGINT");

    // An orphan is re-parented to the agent and reaped when it exits: no zombies remain.
    let (_, out) = sh(&c, "(sleep 1 & echo $!) ; true").await;
    let orphan: u32 = out.trim().parse().expect("orphan pid");
    let (_, ppid) = sh(&c, &format!("awk '{{print $4}}' /proc/{orphan}/stat")).await;
    assert_eq!(ppid.trim(), "1", "orphan adopted by PID 1");
    let mut reaped = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, left) = sh(
            &c,
            &format!("test -e /proc/{orphan} && echo present || echo gone"),
        )
        .await;
        if left.trim() == "gone" {
            reaped = true;
            break;
        }
    }
    assert!(reaped, "orphan {orphan} was never reaped");
    let (_, zombies) = sh(&c, "cat /proc/[0-9]*/stat 2>/dev/null | awk '$3 == \"Z\"'").await;
    assert_eq!(zombies.trim(), "", "zombies left");
}
