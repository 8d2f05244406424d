//! The mount's security promises on real VMs: the bucket's secret appears nowhere in the guest (files, every
//! process's environment and command line, the kernel command line, mount options, a dump of guest memory),
//! and a guest that speaks NFS to the server directly can neither leave its prefix nor write through a
//! read-only export.

#![allow(clippy::unwrap_used)]

mod common;
mod mountfix;

use std::path::PathBuf;

use base64::Engine;
use mountfix::Fixture;
use reqwest::Method;
use serde_json::{Value, json};

const NFS_PROBE: &str = include_str!("mountfix/nfs_probe.py");

/// The needles a leak would show: the secret and its base64 at each of the three alignments.
fn needles(secret: &str) -> Vec<Vec<u8>> {
    let mut out = vec![secret.as_bytes().to_vec()];
    for pad in 0..3 {
        let mut s = vec![b'x'; pad];
        s.extend_from_slice(secret.as_bytes());
        let enc = base64::engine::general_purpose::STANDARD.encode(&s);
        // Skip the characters that depend on the padding bytes; keep the part that only the secret decides.
        let skip = (pad * 4).div_ceil(3) + 1;
        out.push(enc.as_bytes()[skip..enc.len() - 4].to_vec());
    }
    out
}

/// Which of `needles` occur in `files`, in one `grep -F` pass. A byte-by-byte scan in this debug-built test (a
/// slice comparison per offset and needle over hundreds of MiB of guest memory) had not finished after 7
/// minutes in the KVM test host (under TCG); with grep the whole test takes 83 s there. `-z` cuts records at NUL
/// bytes (no needle has one), so no record grows to the size of a memory dump full of zero pages.
fn found(files: &[PathBuf], needles: &[&[u8]]) -> Vec<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    let mut grep = std::process::Command::new("grep");
    grep.env("LC_ALL", "C").args(["-a", "-z", "-F", "-o", "-h"]);
    for n in needles {
        grep.arg("-e").arg(std::ffi::OsStr::from_bytes(n));
    }
    let out = grep.arg("--").args(files).output().expect("grep runs");
    // 0: something found, 1: nothing found, else an error.
    assert!(
        matches!(out.status.code(), Some(0 | 1)),
        "grep: {:?} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let mut hits: Vec<Vec<u8>> = out
        .stdout
        .split(|b| *b == 0)
        .filter(|h| !h.is_empty())
        .map(<[u8]>::to_vec)
        .collect();
    hits.sort();
    hits.dedup();
    hits
}

/// Asserts that none of the leak needles is among `hits` (`what`: where they were searched).
fn assert_no_leak(hits: &[Vec<u8>], leaks: &[Vec<u8>], what: &str) {
    for n in leaks {
        assert!(!hits.contains(n), "{what} holds {:?}", String::from_utf8_lossy(n));
    }
}

fn files_under(dir: &std::path::Path) -> Vec<PathBuf> {
    hearth_testkit::s3::files_under(dir)
}

#[tokio::test]
async fn the_secret_appears_nowhere_in_the_guest() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.87.0/24").await;
    let secret = hearth_testkit::s3::SECRET_ACCESS_KEY;
    f.register("data", "s3://bkt").await;
    f.put("s/in.txt", b"bucket data\n").await;
    let sbx =
        f.d.create(
            json!({"template": "minimal", "mounts": [{"path": "/mnt/s", "bucket": "data", "prefix": "s"}]}),
        )
        .await;
    let id = &sbx.id;
    // Traffic through the mount, so that whatever the guest learns of the bucket is in its memory.
    f.ok(id, "cat /mnt/s/in.txt; echo out > /mnt/s/out.txt; ls -l /mnt/s")
        .await;
    let canary = format!("hearth-canary-{:016x}", rand::random::<u64>());
    f.bg(id, &format!("export C={canary}; exec sleep 600")).await;

    // Files (all but the virtual file systems and the mount itself), every process's environment and
    // command line, the kernel command line, the mount table.
    f.ok(
        id,
        "cd / && tar -cf /tmp/root.tar $(ls -A / | grep -v -x -e proc -e sys -e dev -e mnt -e tmp)",
    )
    .await;
    f.ok(
        id,
        "for p in /proc/[0-9]*; do cat $p/environ $p/cmdline 2>/dev/null; done > /tmp/proc.bin; \
         cat /proc/cmdline /proc/mounts /proc/self/mountinfo >> /tmp/proc.bin",
    )
    .await;
    let (_, root) = f.d.get_file(id, "/tmp/root.tar").await;
    let (_, procs) = f.d.get_file(id, "/tmp/proc.bin").await;
    assert!(
        root.len() > 100_000,
        "the file dump has the guest's files ({} bytes)",
        root.len()
    );
    let dumps = tempfile::tempdir().unwrap();
    let (root_file, procs_file) = (dumps.path().join("root.tar"), dumps.path().join("proc.bin"));
    std::fs::write(&root_file, &root).unwrap();
    std::fs::write(&procs_file, &procs).unwrap();
    let leaks = needles(secret);
    let mut wanted: Vec<&[u8]> = leaks.iter().map(Vec::as_slice).collect();
    wanted.extend([canary.as_bytes(), b"172.16.0.1:/"]);
    let hits = found(&[procs_file], &wanted);
    assert!(
        hits.contains(&canary.as_bytes().to_vec()),
        "the process dump has the processes' environments"
    );
    assert!(
        hits.contains(&b"172.16.0.1:/".to_vec()),
        "the mount table is in the dump"
    );
    assert_no_leak(&hits, &leaks, "a process, the command line or a mount");
    assert_no_leak(&found(&[root_file], &wanted), &leaks, "a guest file");

    // Guest memory: a pause writes all of it to the host; the canary proves the dump is the guest's RAM.
    let (st, v) =
        f.d.call(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None)
            .await;
    assert!(st.is_success(), "pause: {v}");
    let memory = files_under(&f.d.sandbox_dir(id).join("paused"));
    let size: u64 = memory.iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
    assert!(size > 10 << 20, "the memory dump is there ({size} bytes)");
    let key_id = hearth_testkit::s3::ACCESS_KEY_ID.as_bytes();
    wanted.push(key_id);
    let hits = found(&memory, &wanted);
    assert!(
        hits.contains(&canary.as_bytes().to_vec()),
        "the canary is in the memory dump (the search works)"
    );
    assert_no_leak(&hits, &leaks, "guest memory");
    // The access key id stays out too (it is not a secret, but the guest has no use for it).
    assert_no_leak(&hits, &[key_id.to_vec()], "guest memory");
    // Resumed, the mount works on.
    assert_eq!(f.ok(id, "cat /mnt/s/out.txt").await, "out\n");
    f.d.destroy(id).await;
}

#[tokio::test]
async fn a_guest_speaking_nfs_directly_cannot_escape_its_prefix_or_read_only_flag() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.88.0/24").await;
    f.register("data", "s3://bkt").await;
    f.put("p/a.txt", b"inside\n").await;
    f.put("p/sub/b.txt", b"b\n").await;
    f.put("outside.txt", b"TOP-SECRET-OUTSIDE\n").await;
    f.put("p2/sibling.txt", b"SIBLING-PREFIX\n").await;
    let before = f.keys("").await;
    let sbx =
        f.d.create(json!({
            "template": "debian",
            "mounts": [
                {"path": "/mnt/rw", "bucket": "data", "prefix": "p"},
                {"path": "/mnt/ro", "bucket": "data", "prefix": "p", "read_only": true},
            ],
        }))
        .await;
    let id = &sbx.id;
    let mounts = f.ok(id, "cat /proc/mounts").await;
    let export = |path: &str| {
        mounts
            .lines()
            .find(|l| l.split(' ').nth(1) == Some(path))
            .and_then(|l| l.split(' ').next())
            .and_then(|src| src.strip_prefix("172.16.0.1:"))
            .unwrap_or_else(|| panic!("{path} in {mounts}"))
            .to_string()
    };
    let exports = json!({"rw": export("/mnt/rw"), "ro": export("/mnt/ro")});
    let (st, _) =
        f.d.put_file(id, "/root/nfs_probe.py", NFS_PROBE.as_bytes().to_vec())
            .await;
    assert!(st.is_success());
    let r =
        f.d.run(
            id,
            json!({"argv": ["python3", "/root/nfs_probe.py", exports.to_string()], "timeout_s": 120}),
        )
        .await;
    assert_eq!(r.exit_code, 0, "probe: {} {}", r.stdout, r.stderr);
    assert!(
        !r.stdout.contains("TOP-SECRET") && !r.stdout.contains("SIBLING"),
        "{}",
        r.stdout
    );
    let out: Value = serde_json::from_str(r.stdout.trim()).unwrap();
    let (ok, noent, io, inval, xdev, rofs, stale, badhandle) = (0, 2, 5, 22, 18, 30, 70, 10001);
    let want = |k: &str, v: Value| assert_eq!(out[k], v, "{k}: {out}");
    want("mnt rw", json!(ok));
    want("mnt ro", json!(ok));
    for bad in ["/", "/0000000000000000", "/../", "/etc/exports"] {
        want(&format!("mnt {bad}"), json!(noent));
    }
    want("lookup .. is the root", json!("ok"));
    for name in [
        "../outside.txt",
        "..%2foutside.txt",
        "a/../../outside.txt",
        "/outside.txt",
    ] {
        assert!(
            [inval, noent].contains(&out[format!("lookup {name}")].as_u64().unwrap()),
            "{name}: {out}"
        );
    }
    want("lookup sibling.txt", json!(noent));
    for i in 0..7 {
        want(&format!("getattr forged {i}"), json!(stale));
    }
    want("getattr unknown export", json!(stale));
    want("getattr 64 zero bytes", json!(badhandle));
    want("read rw id through ro key", json!(stale));
    want("lookup ro a.txt", json!(ok));
    for k in [
        "write ro file_sync",
        "write ro unstable",
        "setattr size 0 ro",
        "create ro",
        "create exclusive ro",
        "mkdir ro",
        "remove ro",
        "rmdir ro",
        "rename ro",
        "symlink ro",
    ] {
        want(k, json!(rofs));
    }
    want("rename ro to rw", json!(xdev));
    want("readdir rw", json!(["a.txt", "sub"]));
    want("huge record", json!("closed"));
    want("mnt rw after abuse", json!(ok));
    let _ = io;
    assert_eq!(f.keys("").await, before, "the bucket is unchanged");
    // The guest's own mounts still work.
    assert_eq!(f.ok(id, "cat /mnt/ro/a.txt").await, "inside\n");
    f.d.destroy(id).await;
}
