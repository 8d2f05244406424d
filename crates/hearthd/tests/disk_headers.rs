//! SECURITY promise 11 on real VMs (QEMU TCG, `minimal`): the guest, as root, writes a disk-image header at
//! offset 0 of its own disk naming a canary host file (qcow2 with a backing file, qcow2 with a `json:` backing
//! name, a VMDK descriptor with the file as its extent, a VHDX identifier), then the host does everything that
//! copies or reopens that disk: a template from the sandbox (flatten) and a sandbox from the template, a fork,
//! a snapshot and a sandbox from it, a template with memory and a sandbox restored from it, pause and resume.
//! With warm creates on, the first create of each template saves its booted guest as a boot snapshot, and a
//! second create of the qcow2-headed template restores that boot snapshot (its disk copy carries the header).
//! After every step the canary has never been opened (inotify) and every new guest sees its disk start with the
//! header bytes as plain data, with none of the canary's bytes anywhere near.

mod common;

use common::{Daemon, VM_LOCK};
use hearth_testkit::hostile_disk::{Canary, Header};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

/// Writes `bytes` at offset 0 of the guest's root disk, past nothing the ext4 file system uses.
async fn write_header(d: &Daemon, id: &str, bytes: &[u8]) {
    let (status, v) = d.put_file(id, "/root/header.bin", bytes.to_vec()).await;
    assert!(status.is_success(), "{v}");
    let r = d
        .sh(
            id,
            "dd if=/root/header.bin of=/dev/vda bs=1024 count=1 conv=notrunc,fsync 2>&1 && sync",
        )
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    check_disk(d, id, bytes, "right after writing").await;
}

/// The guest's disk starts with `bytes` (it is used as raw data) and its first MiB holds nothing of the canary.
async fn check_disk(d: &Daemon, id: &str, bytes: &[u8], when: &str) {
    let r = d
        .sh(
            id,
            "dd if=/dev/vda of=/tmp/head.bin bs=1024 count=1024 2>/dev/null && echo 3 > /proc/sys/vm/drop_caches",
        )
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let (status, head) = d.get_file(id, "/tmp/head.bin").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        &head[..bytes.len()],
        bytes,
        "{id} {when}: the disk does not start with the guest's header"
    );
    assert!(
        !head.windows(14).any(|w| w == b"HEARTH-CANARY-"),
        "{id} {when}: the canary's bytes are in the guest"
    );
}

async fn template(d: &Daemon, name: &str, from: &str, memory: bool) {
    let (status, t) = d
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": name, "from_sandbox": from, "include_memory": memory})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "{t}\n{}", d.log());
}

/// The id of the boot snapshot saved for template `template` (from the daemon's log).
fn boot_snapshot_of(d: &Daemon, template: &str) -> String {
    let log = d.log();
    let line = log
        .lines()
        .find(|l| l.contains("boot snapshot saved") && l.contains(template))
        .unwrap_or_else(|| panic!("no boot snapshot of {template}:\n{log}"));
    let at = line.find("snp_").expect("a snapshot id");
    line[at..at + 20].to_owned()
}

fn first_child(v: &Value) -> String {
    v["sandboxes"][0]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("no child in {v}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_disk_headers_never_make_the_host_open_a_host_file() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start_with(&["--warm-creates", "on"]).await;
    // The canary sits next to the daemon's own files, where a root host process could reach it.
    let canary = Canary::new(d.data_dir());
    let [qcow2, json, vmdk, vhdx] = Header::ALL.map(|h| h.bytes(&canary.path));
    let small = json!({"template": "minimal", "memory_mib": 256});

    // qcow2 + backing file -> a template (flatten) -> a sandbox booted from it.
    let a = d.create(small.clone()).await.id;
    write_header(&d, &a, &qcow2).await;
    template(&d, "hdr-qcow2", &a, false).await;
    canary.assert_untouched("a template from a disk with a qcow2 header");
    let b = d
        .create(json!({"template": "hdr-qcow2", "memory_mib": 256}))
        .await
        .id;
    canary.assert_untouched("creating a sandbox from that template");
    check_disk(&d, &b, &qcow2, "booted from the template").await;
    d.destroy(&a).await;
    // A second create of that template restores its boot snapshot, whose disk copy has the header.
    let boot = boot_snapshot_of(&d, "hdr-qcow2");
    let b2 = d
        .create(json!({"template": "hdr-qcow2", "memory_mib": 256}))
        .await
        .id;
    assert!(
        d.log()
            .lines()
            .any(|l| l.contains("snapshot verified") && l.contains(&boot)),
        "restored from boot snapshot {boot}:\n{}",
        d.log()
    );
    canary.assert_untouched("a warm create restoring a boot snapshot whose disk has a qcow2 header");
    check_disk(&d, &b2, &qcow2, "restored from the template's boot snapshot").await;
    d.destroy(&b2).await;

    // VMDK descriptor -> a fork (checkpoint + a disk over its copy).
    write_header(&d, &b, &vmdk).await;
    let (status, v) = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{b}/fork"),
            Some(json!({"count": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::CREATED, "fork: {v}\n{}", d.log());
    let c = first_child(&v);
    canary.assert_untouched("forking a sandbox with a VMDK header");
    check_disk(&d, &c, &vmdk, "forked").await;
    d.destroy(&b).await;

    // json: backing name -> a snapshot -> a sandbox from the snapshot.
    write_header(&d, &c, &json).await;
    let (status, s) = d
        .call(Method::POST, &format!("/v1/sandboxes/{c}/snapshots"), None)
        .await;
    assert_eq!(status, StatusCode::CREATED, "{s}\n{}", d.log());
    let e = d
        .create(json!({"snapshot": s["id"].as_str().expect("snapshot id")}))
        .await
        .id;
    canary.assert_untouched("a snapshot and a sandbox from it, json: header");
    check_disk(&d, &e, &json, "created from the snapshot").await;
    d.destroy(&c).await;

    // VHDX -> a template with memory -> a sandbox restored from it -> pause and resume.
    write_header(&d, &e, &vhdx).await;
    template(&d, "hdr-warm", &e, true).await;
    let f = d.create(json!({"template": "hdr-warm"})).await.id;
    canary.assert_untouched("a memory template from a disk with a VHDX header");
    check_disk(&d, &f, &vhdx, "restored from the memory template").await;
    let (status, v) = d
        .call(Method::POST, &format!("/v1/sandboxes/{f}/pause"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "pause: {v}\n{}", d.log());
    let (status, v) = d
        .call(Method::POST, &format!("/v1/sandboxes/{f}/resume"), None)
        .await;
    assert_eq!(status, StatusCode::OK, "resume: {v}\n{}", d.log());
    canary.assert_untouched("pause and resume with a VHDX header");
    check_disk(&d, &f, &vhdx, "resumed").await;

    // Back to the qcow2 header for a last flatten of a restored sandbox's disk.
    write_header(&d, &f, &qcow2).await;
    template(&d, "hdr-last", &f, false).await;
    let g = d
        .create(json!({"template": "hdr-last", "memory_mib": 256}))
        .await
        .id;
    canary.assert_untouched("a template from a restored sandbox's disk and a sandbox from it");
    check_disk(&d, &g, &qcow2, "booted from the last template").await;
    for id in [e, f, g] {
        d.destroy(&id).await;
    }
    canary.assert_untouched("destroying everything");
}
