//! Warm creates on real VMs (`--warm-creates on`; QEMU here, Firecracker jailed in the KVM test host's
//! `firecracker_runs_jailed_and_leaves_nothing`): the first create of a template at a shape saves its boot
//! snapshot, the next ones restore it with their own identity and nothing an earlier sandbox did; another shape
//! boots; a corrupted boot snapshot is refused, the create boots instead and saves a new one, and the old one is
//! deleted once the last sandbox whose disk builds on it is gone; beyond `--boot-snapshots-max` the least
//! recently restored goes. With a storage bucket (a real S3 server) and a
//! local cache too small to keep it, a boot snapshot evicted from the local disk comes back from the bucket for
//! the next create instead of being made again, a create while the bucket is down boots and keeps it, and one
//! whose bucket copy was tampered with is refused by the fetch, retired and replaced. Deleting a saved template
//! deletes its boot snapshot.

mod common;
mod storagefix;

use std::time::Duration;

use common::{Daemon, VM_LOCK};
use hearth_testkit::s3::{S3Kind, S3Server};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use storagefix::{chunk_path, flip_byte, manifest_chunks, poll_storage, start_daemon_with};

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

/// The memory file of boot snapshot `snap` (QEMU: `memory`, Firecracker: `vm.mem`).
fn memory_file(d: &Daemon, snap: &str) -> std::path::PathBuf {
    let dir = d.data_dir().join("snapshots").join(snap);
    ["memory", "vm.mem"]
        .iter()
        .map(|n| dir.join(n))
        .find(|p| p.is_file())
        .expect("the boot snapshot's memory file")
}

/// SHA-256 of the file at `path`.
fn digest(path: &std::path::Path) -> Vec<u8> {
    use sha2::Digest;
    let mut f = std::fs::File::open(path).expect("open");
    let mut h = sha2::Sha256::new();
    std::io::copy(&mut f, &mut h).expect("read");
    h.finalize().to_vec()
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
    let d = Daemon::start_with(&[
        "--network",
        "off",
        "--warm-creates",
        "on",
        "--boot-snapshots-max",
        "2",
    ])
    .await;
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
    let boot_memory = digest(&memory_file(&d, &boot[0]));
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
        if common::test_vmm() == "qemu" {
            // QEMU gives a warm sandbox a copy of the boot snapshot's memory as its own file (so that its
            // pauses only flush it), not a mapping of the boot snapshot's.
            assert!(
                d.sandbox_dir(&b.id).join("memory").is_file(),
                "its own memory file"
            );
        }
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
        // It writes to its memory (a tmpfs file) and pauses and resumes: none of it reaches the boot snapshot.
        let r = d
            .sh(
                &b.id,
                "mkdir -p /mnt/w && mount -t tmpfs t /mnt/w && dd if=/dev/urandom of=/mnt/w/x bs=1M count=8 2>/dev/null",
            )
            .await;
        assert_eq!(r.exit_code, 0, "{r:?}");
        let (status, v) = d
            .call(Method::POST, &format!("/v1/sandboxes/{}/pause", b.id), None)
            .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let (status, v) = d
            .call(Method::POST, &format!("/v1/sandboxes/{}/resume", b.id), None)
            .await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(d.sh(&b.id, "ls -l /mnt/w/x | wc -l").await.stdout.trim(), "1");
        assert_eq!(
            digest(&memory_file(&d, &boot[0])),
            boot_memory,
            "the boot snapshot's memory is never written"
        );
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
    let memory = memory_file(&d, &boot[0]);
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

    // A third shape makes three live boot snapshots, one more than the limit: the least recently restored (the
    // other shape's, never restored) is retired, and deleted at once (no disk builds on it).
    let other_snap = with_other
        .iter()
        .find(|n| **n != boot[0])
        .expect("the other shape's")
        .clone();
    let third = d
        .create(json!({ "template": "minimal", "memory_mib": 384, "timeout_s": 600 }))
        .await;
    assert_eq!(saved_count(&d), 4);
    let dirs = snapshot_dirs(&d);
    assert!(!dirs.contains(&other_snap), "retired and deleted: {dirs:?}");
    assert!(dirs.contains(new), "the recently restored one stays: {dirs:?}");
    assert_eq!(
        dirs.len(),
        3,
        "the corrupted one (disks build on it), the new one, the third shape's: {dirs:?}"
    );
    let f = d.create(shape.clone()).await;
    assert_eq!(restores_of(&d, new), 2, "still restored");

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
    for id in [&a.id, &other.id, &c.id, &e.id, &third.id, &f.id] {
        d.destroy(id).await;
    }
    // The live boot snapshots stay for the next creates.
    assert_eq!(snapshot_dirs(&d).len(), 2);
    let (status, v): (StatusCode, Value) = d.call(Method::GET, "/v1/sandboxes", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["sandboxes"], json!([]), "{v}");
}

/// Where `GET /v1/storage` says snapshot `snap`'s object is (`local`, `both`, `remote`).
fn location(st: &Value, snap: &str) -> String {
    let name = format!("snapshots/{snap}");
    st["objects"]
        .as_array()
        .and_then(|a| a.iter().find(|o| o["name"] == name.as_str()))
        .and_then(|o| o["location"].as_str())
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_evicted_boot_snapshot_comes_back_from_the_bucket() {
    let _vm = VM_LOCK.lock().await;
    let mut s3 = tokio::task::spawn_blocking(|| S3Server::start(S3Kind::S3sFs, "hearth-warm"))
        .await
        .expect("s3 server");
    // A 1-byte cache: whatever the bucket holds and no sandbox needs leaves the local disk.
    let d = start_daemon_with(&s3, "hw", &["--warm-creates", "on", "--cache-size", "1"]).await;
    let shape = json!({ "template": "minimal", "memory_mib": 256, "timeout_s": 600 });
    let within = Duration::from_secs(180);

    let a = d.create(shape.clone()).await;
    assert_eq!(saved_count(&d), 1, "{}", d.log());
    let boot = snapshot_dirs(&d);
    assert_eq!(boot.len(), 1, "{boot:?}");
    let snap = boot[0].clone();
    // Uploaded, then evicted: no sandbox's disk builds on it (the first create booted from the template).
    poll_storage(&d, "the boot snapshot evicted", within, |st| {
        location(st, &snap) == "remote"
    })
    .await;
    assert!(snapshot_dirs(&d).is_empty(), "its local copy is gone");

    // The next create fetches it back and restores it: nothing is saved again.
    let b = d.create(shape.clone()).await;
    assert_eq!(restores_of(&d, &snap), 1, "{}", d.log());
    assert_eq!(saved_count(&d), 1, "fetched, not made again");
    assert!(
        d.log()
            .lines()
            .any(|l| l.contains("fetched from the storage bucket") && l.contains(&snap)),
        "{}",
        d.log()
    );
    assert_eq!(
        d.sh(&b.id, "hostname").await.stdout.trim(),
        b.id.replace('_', "-")
    );
    // Evicted again once the sandbox whose disk builds on it is gone.
    d.destroy(&b.id).await;
    poll_storage(&d, "the boot snapshot evicted again", within, |st| {
        location(st, &snap) == "remote"
    })
    .await;

    // The bucket is down: the create boots (no error) and the boot snapshot stays for later creates.
    s3.stop();
    let c = d.create(shape.clone()).await;
    assert_eq!(restores_of(&d, &snap), 1, "{}", d.log());
    assert_eq!(saved_count(&d), 1, "a bucket outage makes no new boot snapshot");
    assert!(
        d.log().contains("could not be fetched from the storage bucket"),
        "{}",
        d.log()
    );
    assert_eq!(
        d.sh(&c.id, "hostname").await.stdout.trim(),
        c.id.replace('_', "-")
    );

    // Back: the next create restores it again.
    let s3 = tokio::task::spawn_blocking(move || {
        s3.start_again();
        s3
    })
    .await
    .expect("restart s3");
    let e = d.create(shape.clone()).await;
    assert_eq!(restores_of(&d, &snap), 2, "{}", d.log());
    assert_eq!(saved_count(&d), 1);
    assert_eq!(
        d.sh(&e.id, "hostname").await.stdout.trim(),
        e.id.replace('_', "-")
    );

    // Whoever can write the bucket cannot have a create restore what they wrote: with the local copy evicted
    // again, one flipped bit in a chunk of the boot snapshot's object is caught by the fetch's chunk check, the
    // create retires that boot snapshot and boots (no error), saves a new one, and the tampered one is deleted,
    // in the bucket too.
    d.destroy(&e.id).await;
    poll_storage(&d, "the boot snapshot evicted a third time", within, |st| {
        location(st, &snap) == "remote"
    })
    .await;
    let chunks = manifest_chunks(&s3, &format!("snapshots/{snap}"));
    flip_byte(&chunk_path(
        &s3,
        chunks.first().expect("the boot snapshot has chunks"),
    ));
    let g = d.create(shape.clone()).await;
    assert_eq!(restores_of(&d, &snap), 2, "the tampered copy never got to a VMM");
    assert!(
        d.log().contains("restoring the boot snapshot failed"),
        "{}",
        d.log()
    );
    assert_eq!(saved_count(&d), 2, "the booted create saved a new boot snapshot");
    assert_eq!(
        d.sh(&g.id, "hostname").await.stdout.trim(),
        g.id.replace('_', "-")
    );
    assert!(
        !snapshot_dirs(&d).contains(&snap),
        "nothing of the tampered copy kept locally"
    );
    poll_storage(&d, "the tampered boot snapshot deleted", within, |st| {
        location(st, &snap).is_empty()
    })
    .await;
    for id in [&a.id, &c.id, &g.id] {
        d.destroy(id).await;
    }
    drop(s3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_template_deletes_its_boot_snapshot() {
    let _vm = VM_LOCK.lock().await;
    let d = Daemon::start_with(&["--network", "off", "--warm-creates", "on"]).await;
    let a = d
        .create(json!({ "template": "minimal", "memory_mib": 256, "timeout_s": 600 }))
        .await;
    let (status, t) = d
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "warm-gone", "from_sandbox": a.id})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{t}\n{}", d.log());
    let minimal_boot = snapshot_dirs(&d);
    assert_eq!(minimal_boot.len(), 1, "{minimal_boot:?}");

    // The saved template's first create saves its boot snapshot, the second restores it.
    let shape = json!({ "template": "warm-gone", "memory_mib": 256, "timeout_s": 600 });
    let b = d.create(shape.clone()).await;
    let own: Vec<String> = snapshot_dirs(&d)
        .into_iter()
        .filter(|n| !minimal_boot.contains(n))
        .collect();
    assert_eq!(own.len(), 1, "{own:?}\n{}", d.log());
    let c = d.create(shape).await;
    assert_eq!(restores_of(&d, &own[0]), 1, "{}", d.log());
    assert_eq!(
        d.sh(&c.id, "hostname").await.stdout.trim(),
        c.id.replace('_', "-")
    );

    // Once its sandboxes are gone the template can be deleted, and its boot snapshot goes with it (after the
    // answer, in the background); the built-in template's stays.
    for id in [&b.id, &c.id] {
        d.destroy(id).await;
    }
    let (status, v) = d.call(Method::DELETE, "/v1/templates/warm-gone", None).await;
    assert!(status.is_success(), "{status} {v}");
    assert!(
        common::wait_until(Duration::from_secs(30), || async {
            !snapshot_dirs(&d).contains(&own[0])
        })
        .await,
        "the deleted template's boot snapshot is deleted: {:?}\n{}",
        snapshot_dirs(&d),
        d.log()
    );
    assert_eq!(snapshot_dirs(&d), minimal_boot);
    d.destroy(&a.id).await;
}
