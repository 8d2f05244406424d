//! Buckets mounted in real VMs (QEMU), served by the daemon's NFS server on the sandbox's gateway, backed by a
//! real S3 server on loopback: data flows both ways through a prefix, read-only mounts refuse every write with
//! EROFS, mounts work with egress denied, and another sandbox and a plain S3 client see what one wrote.

#![allow(clippy::unwrap_used)]

mod common;
mod mountfix;

use mountfix::Fixture;
use serde_json::json;

#[tokio::test]
async fn write_in_the_guest_read_on_the_host_and_back_through_a_prefix() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.81.0/24").await;
    f.register("data", "s3://bkt").await;
    f.put("runs/42/from-host.txt", b"written by a plain S3 client\n").await;
    f.put("runs/42/sub/deep.txt", b"deep\n").await;
    f.put("elsewhere.txt", b"outside the prefix\n").await;
    let sbx = f
        .d
        .create(json!({
            "template": "minimal",
            "mounts": [
                {"path": "/mnt/data", "bucket": "data", "prefix": "runs/42/"},
                {"path": "/mnt/ro", "bucket": "data", "prefix": "runs/42", "read_only": true},
            ],
        }))
        .await;
    let id = &sbx.id;
    assert_eq!(f.ok(id, "cat /mnt/data/from-host.txt").await, "written by a plain S3 client\n");
    assert_eq!(f.ok(id, "ls /mnt/data").await, "from-host.txt\nsub\n");
    assert_eq!(f.ok(id, "cat /mnt/data/sub/deep.txt").await, "deep\n");
    f.ok(id, "echo 'from the guest' > /mnt/data/from-guest.txt").await;
    assert_eq!(f.get("runs/42/from-guest.txt").await.as_deref(), Some(&b"from the guest\n"[..]));
    f.ok(id, "echo more >> /mnt/data/from-guest.txt").await;
    assert_eq!(f.get("runs/42/from-guest.txt").await.as_deref(), Some(&b"from the guest\nmore\n"[..]));
    assert_eq!(f.ok(id, "cat /mnt/ro/from-guest.txt").await, "from the guest\nmore\n");
    let (code, out) = f.sh(id, "echo x > /mnt/ro/new.txt").await;
    assert_ne!(code, 0);
    assert!(out.contains("Read-only file system"), "{out}");
    f.d.destroy(id).await;
}
