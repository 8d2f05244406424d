//! Warm creates on real VMs (`--warm-creates on`; QEMU here, Firecracker jailed in the KVM test host's
//! `firecracker_runs_jailed_and_leaves_nothing`): the first create of a template at a shape saves its boot
//! snapshot, the next ones restore it with their own identity and nothing an earlier sandbox did; another shape
//! boots; a corrupted boot snapshot is refused, the create boots instead and saves a new one, and the old one is
//! deleted once the last sandbox whose disk builds on it is gone.

mod common;

use common::{Daemon, VM_LOCK};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

/// The guest's boot id (made when first read, so a restore that had not read it makes its own), hostname,
/// machine-id and 16 random bytes, one per line.
const IDENT: &str = "cat /proc/sys/kernel/random/boot_id; hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1";

async fn ident(d: &Daemon, id: &str) -> Vec<String> {
    let r = d.sh(id, IDENT).await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let lines: Vec<String> = r.stdout.lines().map(str::to_owned).collect();
    assert_eq!(lines.len(), 4, "{r:?}");
    lines
}

/// The snapshot directories on disk (boot snapshots are the only snapshots this test makes).
fn snapshot_dirs(d: &Daemon) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(d.data_dir().join("snapshots"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with("snp_"))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

fn saved_count(d: &Daemon) -> usize {
    d.log().matches("boot snapshot saved").count()
}

/// Restores of snapshot `snap` so far: each is verified against its manifest first, and the daemon logs it.
fn restores_of(d: &Daemon, snap: &str) -> usize {
    d.log()
        .lines()
        .filter(|l| l.contains("snapshot verified") && l.contains(snap))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_restore_the_boot_snapshot_with_their_own_identity() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start_with(&["--network", "off", "--warm-creates", "on"]).await;
    let shape = json!({ "template": "minimal", "memory_mib": 256, "timeout_s": 600 });

    // The first create boots, then saves the booted guest before it hands the sandbox out.
    let a = d.create(shape.clone()).await;
    assert_eq!(saved_count(&d), 1, "{}", d.log());
    let boot = snapshot_dirs(&d);
    assert_eq!(boot.len(), 1, "{boot:?}");
    let a_ident = ident(&d, &a.id).await;
    assert_eq!(
        a_ident[1],
        a.id.replace('_', "-"),
        "its own hostname after the save"
    );
    let r = d
        .sh(&a.id, "echo mine > /root/a-was-here; mkdir -p /mnt/m && mount -t tmpfs t /mnt/m && echo x > /mnt/m/a; sync")
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");

    // The next creates of the template and shape restore it: the same boot, their own identity and entropy,
    // their own environment, nothing the first sandbox did after its create, and no snapshot shown.
    let mut b_ids = Vec::new();
    for n in 0..2 {
        let mut body = shape.clone();
        body["env"] = json!({ "WARM": format!("yes-{n}") });
        let b = d.create(body).await;
        assert_eq!(saved_count(&d), 1, "a restore saves nothing");
        assert_eq!(
            restores_of(&d, &boot[0]),
            n + 1,
            "restored from the boot snapshot"
        );
        assert_eq!(b.snapshot_id, None, "a boot snapshot is not the sandbox's");
        assert_eq!(b.template, "minimal");
        assert_eq!(b.memory_mib, 256);
        let b_ident = ident(&d, &b.id).await;
        assert_ne!(b_ident[0], a_ident[0], "its own boot id");
        assert_eq!(b_ident[1], b.id.replace('_', "-"), "its own hostname");
        assert_ne!(b_ident[2], a_ident[2], "its own machine-id");
        assert_ne!(b_ident[3], a_ident[3], "its own entropy");
        let r = d
            .sh(
                &b.id,
                "echo $WARM; ls /root/a-was-here /mnt/m/a 2>&1 | grep -c 'No such'; grep MemTotal /proc/meminfo; \
                 cat /proc/cmdline",
            )
            .await;
        let lines: Vec<&str> = r.stdout.lines().collect();
        assert_eq!(lines[..2], [format!("yes-{n}").as_str(), "2"], "{r:?}");
        // The boot the snapshot holds names no sandbox (its kernel command line is in guest memory).
        assert!(
            !r.stdout.contains(&a.id.replace('_', "-")) && lines[3].contains("hearth.hostname=sandbox"),
            "{r:?}"
        );
        let kib: u64 = lines[2]
            .split_whitespace()
            .nth(1)
            .and_then(|k| k.parse().ok())
            .expect("MemTotal");
        assert!((200 * 1024..=256 * 1024).contains(&kib), "{r:?}");
        b_ids.push(b.id);
    }
    // Boot snapshots are not snapshot objects: not listed, not deletable.
    let (status, list) = d.call(Method::GET, "/v1/snapshots", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["snapshots"], json!([]), "{list}");
    let (status, body) = d
        .call(Method::DELETE, &format!("/v1/snapshots/{}", boot[0]), None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");

    // Another shape boots and saves its own.
    let other = d
        .create(json!({ "template": "minimal", "memory_mib": 320, "timeout_s": 600 }))
        .await;
    assert_eq!(saved_count(&d), 2);
    let with_other: Vec<String> = snapshot_dirs(&d);
    assert_eq!(with_other.len(), 2, "{with_other:?}");
    assert_eq!(restores_of(&d, &boot[0]), 2, "another shape does not restore it");

    // A corrupted boot snapshot (its memory file cut short) is refused by its manifest check before the VMM
    // runs: the create boots instead and saves a new one, which the next create restores.
    let dir = d.data_dir().join("snapshots").join(&boot[0]);
    let memory = ["memory", "vm.mem"]
        .iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .expect("the boot snapshot's memory file");
    let len = std::fs::metadata(&memory).expect("stat").len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&memory)
        .and_then(|f| f.set_len(len / 2))
        .expect("truncate");
    let c = d.create(shape.clone()).await;
    assert_eq!(
        restores_of(&d, &boot[0]),
        2,
        "the corrupted snapshot never got to a VMM"
    );
    assert_eq!(
        d.sh(&c.id, "hostname").await.stdout.trim(),
        c.id.replace('_', "-")
    );
    assert!(
        d.log().contains("restoring the boot snapshot failed"),
        "{}",
        d.log()
    );
    assert_eq!(saved_count(&d), 3, "the booted create saved a new boot snapshot");
    let now: Vec<String> = snapshot_dirs(&d);
    let new = now
        .iter()
        .find(|n| !with_other.contains(n))
        .expect("the new boot snapshot");
    let e = d.create(shape.clone()).await;
    assert_eq!(restores_of(&d, new), 1, "restored from the new one");
    assert_eq!(
        d.sh(&e.id, "hostname").await.stdout.trim(),
        e.id.replace('_', "-")
    );

    // The corrupted one stays while disks build on it (the two restored from it), and goes with the last.
    assert!(dir.is_dir());
    d.destroy(&b_ids[0]).await;
    assert!(dir.is_dir(), "a sandbox's disk still builds on it");
    d.destroy(&b_ids[1]).await;
    assert!(
        !dir.exists(),
        "the retired boot snapshot is deleted with its last user"
    );
    assert_eq!(snapshot_dirs(&d).len(), 2, "{:?}", snapshot_dirs(&d));
    for id in [&a.id, &other.id, &c.id, &e.id] {
        d.destroy(id).await;
    }
    // The live boot snapshots stay for the next creates.
    assert_eq!(snapshot_dirs(&d).len(), 2);
    let (status, v): (StatusCode, Value) = d.call(Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["sandboxes"], json!([]), "{v}");
}
