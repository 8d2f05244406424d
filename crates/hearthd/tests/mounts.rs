//! Buckets mounted in real VMs (QEMU), served by the daemon's NFS server on the sandbox's gateway, backed by a
//! real S3 server on loopback: data flows both ways through a prefix, another sandbox and a plain S3 client see
//! what one wrote, read-only mounts refuse every write with EROFS and leave the bucket as it was, unsupported
//! operations get their documented errno, mounts work with egress denied, attach/detach at run time, a warm
//! create restores its template's boot snapshot and then mounts (and never saves a boot snapshot with mounts),
//! and bad input is refused with a typed error before anything is made.

#![allow(clippy::unwrap_used)]

mod common;
mod mountfix;

use std::time::{Duration, Instant};

use common::Daemon;
use hearth_testkit::s3::S3Kind;
use mountfix::{Fixture, eventually};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

#[tokio::test]
async fn write_in_the_guest_read_on_the_host_and_back_through_a_prefix() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.81.0/24").await;
    f.register("data", "s3://bkt").await;
    f.put("runs/42/from-host.txt", b"written by a plain S3 client\n")
        .await;
    f.put("runs/42/sub/deep.txt", b"deep\n").await;
    f.put("elsewhere.txt", b"outside the prefix\n").await;
    let sbx =
        f.d.create(json!({
            "template": "minimal",
            "mounts": [
                {"path": "/mnt/data", "bucket": "data", "prefix": "runs/42/"},
                {"path": "/mnt/ro", "bucket": "data", "prefix": "runs/42", "read_only": true},
            ],
        }))
        .await;
    let id = &sbx.id;
    assert_eq!(
        f.ok(id, "cat /mnt/data/from-host.txt").await,
        "written by a plain S3 client\n"
    );
    assert_eq!(f.ok(id, "ls /mnt/data").await, "from-host.txt\nsub\n");
    assert_eq!(f.ok(id, "cat /mnt/data/sub/deep.txt").await, "deep\n");
    f.ok(id, "echo 'from the guest' > /mnt/data/from-guest.txt").await;
    assert_eq!(
        f.get("runs/42/from-guest.txt").await.as_deref(),
        Some(&b"from the guest\n"[..])
    );
    f.ok(id, "echo more >> /mnt/data/from-guest.txt").await;
    assert_eq!(
        f.get("runs/42/from-guest.txt").await.as_deref(),
        Some(&b"from the guest\nmore\n"[..])
    );
    // A 3 MiB file with a known pattern, written in the guest and checked byte for byte on the host.
    f.ok(
        id,
        "i=0; while [ $i -lt 3072 ]; do printf '%01023d\\n' $i; i=$((i+1)); done > /mnt/data/big.txt",
    )
    .await;
    let big = f.get("runs/42/big.txt").await.unwrap();
    assert_eq!(big.len(), 3 << 20);
    assert_eq!(&big[1024 * 3071..], format!("{:01023}\n", 3071).as_bytes());
    // The other mount of the same prefix sees it (the same holds for another sandbox, below).
    assert_eq!(
        f.ok(id, "cat /mnt/ro/from-guest.txt").await,
        "from the guest\nmore\n"
    );
    assert_eq!(
        f.ok(id, "md5sum < /mnt/ro/big.txt").await,
        f.ok(id, "md5sum < /mnt/data/big.txt").await
    );

    // A second sandbox mounting the same prefix reads what the first wrote and closed.
    let other = f
        .d
        .create(json!({"template": "minimal", "mounts": [{"path": "/data", "bucket": "data", "prefix": "runs/42"}]}))
        .await;
    assert_eq!(
        f.ok(&other.id, "cat /data/from-guest.txt").await,
        "from the guest\nmore\n"
    );
    f.ok(&other.id, "echo back > /data/from-other.txt").await;
    eventually(
        "the first sandbox sees the second's file",
        Duration::from_secs(10),
        || async { f.sh(id, "cat /mnt/data/from-other.txt").await == (0, "back\n".into()) },
    )
    .await;
    // The host's object under the prefix, nothing outside it changed.
    assert_eq!(
        f.keys("").await,
        vec![
            "elsewhere.txt",
            "runs/42/big.txt",
            "runs/42/from-guest.txt",
            "runs/42/from-host.txt",
            "runs/42/from-other.txt",
            "runs/42/sub/deep.txt"
        ]
    );
    // Usage counts the bytes moved through mounts.
    let (_, u) =
        f.d.call(Method::GET, &format!("/v1/sandboxes/{id}/usage"), None)
            .await;
    assert!(u["bytes_written"].as_u64().unwrap() >= 3 << 20, "{u}");
    assert!(u["bytes_read"].as_u64().unwrap() >= 3 << 20, "{u}");
    let (_, m) =
        f.d.call(Method::GET, &format!("/v1/sandboxes/{id}/mounts"), None)
            .await;
    assert_eq!(m["mounts"].as_array().unwrap().len(), 2, "{m}");
    f.d.destroy(&other.id).await;
    f.d.destroy(id).await;
}

#[tokio::test]
async fn a_read_only_mount_refuses_every_write_with_erofs() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.82.0/24").await;
    f.register("data", "s3://bkt").await;
    f.put("in/a.txt", b"original\n").await;
    f.put("in/dir/b.txt", b"b\n").await;
    let before = f.keys("").await;
    let sbx = f
        .d
        .create(json!({"template": "minimal", "mounts": [{"path": "/mnt/in", "bucket": "data", "prefix": "in", "read_only": true}]}))
        .await;
    let id = &sbx.id;
    assert_eq!(f.ok(id, "cat /mnt/in/a.txt").await, "original\n");
    // Every write syscall, through busybox tools (each prints strerror).
    for cmd in [
        "echo x > /mnt/in/a.txt",
        "echo x >> /mnt/in/a.txt",
        "echo x > /mnt/in/new.txt",
        "touch /mnt/in/a.txt",
        "touch /mnt/in/new.txt",
        "truncate -s 0 /mnt/in/a.txt",
        "rm /mnt/in/a.txt",
        "mv /mnt/in/a.txt /mnt/in/c.txt",
        "mkdir /mnt/in/d",
        "rmdir /mnt/in/dir",
        "ln -s a.txt /mnt/in/l",
        "ln /mnt/in/a.txt /mnt/in/h",
        "chmod 600 /mnt/in/a.txt",
        "mkfifo /mnt/in/fifo",
        "dd if=/dev/zero of=/mnt/in/a.txt bs=1 count=1 conv=notrunc",
    ] {
        let (code, out) = f.sh(id, cmd).await;
        assert_ne!(code, 0, "{cmd} succeeded");
        assert!(out.contains("Read-only file system"), "{cmd}: {out}");
    }
    assert_eq!(f.keys("").await, before, "the bucket is unchanged");
    assert_eq!(f.get("in/a.txt").await.as_deref(), Some(&b"original\n"[..]));
    f.d.destroy(id).await;
}

/// The semantics table of docs/storage.md, on moto (S3 semantics for directory markers).
#[tokio::test]
async fn semantics_and_errnos_of_unsupported_operations() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start_kind("10.213.83.0/24", S3Kind::Moto).await;
    f.register("data", "s3://bkt/w").await;
    let sbx =
        f.d.create(json!({"template": "minimal", "mounts": [{"path": "/mnt/w", "bucket": "data"}]}))
            .await;
    let id = &sbx.id;
    let m = "/mnt/w";
    // Works: mkdir (a marker a plain client sees), files in it, rename, random reads, in-place edits, rmdir.
    f.ok(
        id,
        &format!("mkdir {m}/d && echo one > {m}/d/f && mv {m}/d/f {m}/d/g && ls {m}/d"),
    )
    .await;
    assert!(
        f.keys("w").await.contains(&"w/d/".to_string()),
        "{:?}",
        f.keys("w").await
    );
    assert_eq!(f.get("w/d/g").await.as_deref(), Some(&b"one\n"[..]));
    assert_eq!(f.get("w/d/f").await, None);
    f.ok(
        id,
        &format!("printf 0123456789 > {m}/r && dd if={m}/r bs=1 skip=4 count=3 2>/dev/null > /tmp/o"),
    )
    .await;
    assert_eq!(f.ok(id, "cat /tmp/o").await, "456");
    f.ok(
        id,
        &format!("printf XY | dd of={m}/r bs=1 seek=2 conv=notrunc 2>/dev/null"),
    )
    .await;
    assert_eq!(f.get("w/r").await.as_deref(), Some(&b"01XY456789"[..]));
    let (code, out) = f.sh(id, &format!("rmdir {m}/d")).await;
    assert!(code != 0 && out.contains("not empty"), "{out}");
    // A directory with content is moved by mv itself (EXDEV from rename, then copy and delete).
    f.ok(id, &format!("mv {m}/d {m}/e && cat {m}/e/g")).await;
    f.ok(id, &format!("rm {m}/e/g && rmdir {m}/e")).await;
    assert!(
        !f.keys("w")
            .await
            .iter()
            .any(|k| k.starts_with("w/d") || k.starts_with("w/e")),
        "{:?}",
        f.keys("w").await
    );
    // What an object store cannot hold: EPERM.
    for (cmd, errno) in [
        (format!("ln -s r {m}/sym"), "Operation not permitted"),
        (format!("ln {m}/r {m}/hard"), "Operation not permitted"),
        (format!("mkfifo {m}/fifo"), "Operation not permitted"),
    ] {
        let (code, out) = f.sh(id, &cmd).await;
        assert!(code != 0 && out.contains(errno), "{cmd}: {out}");
    }
    f.d.destroy(id).await;
}

#[tokio::test]
async fn mounts_work_with_egress_denied_and_attach_detach_at_run_time() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.94.0/24").await;
    f.register("data", "s3://bkt").await;
    f.put("x/hello.txt", b"hi\n").await;
    let sbx =
        f.d.create(json!({
            "template": "minimal",
            "network": {"egress": {"default": "deny"}},
            "mounts": [{"path": "/mnt/x", "bucket": "data", "prefix": "x"}],
        }))
        .await;
    let id = &sbx.id;
    assert_eq!(f.ok(id, "cat /mnt/x/hello.txt").await, "hi\n");
    let (_, net) =
        f.d.call(Method::GET, &format!("/v1/sandboxes/{id}/network"), None)
            .await;
    assert_eq!(net["egress"]["default"], "deny", "{net}");

    // Attach a second mount at run time, use it, detach it (written data reaches the bucket first).
    let (st, v) =
        f.d.call(
            Method::PUT,
            &format!("/v1/sandboxes/{id}/mounts?path=/mnt/y"),
            Some(json!({"bucket": "data", "prefix": "y"})),
        )
        .await;
    assert_eq!(st, StatusCode::OK, "{v}");
    f.ok(id, "echo attached > /mnt/y/a.txt").await;
    let (st, v) =
        f.d.call(
            Method::DELETE,
            &format!("/v1/sandboxes/{id}/mounts?path=/mnt/y"),
            None,
        )
        .await;
    assert_eq!(st, StatusCode::NO_CONTENT, "{v}");
    assert_eq!(f.get("y/a.txt").await.as_deref(), Some(&b"attached\n"[..]));
    assert!(
        !f.ok(id, "cat /proc/mounts").await.contains("/mnt/y"),
        "unmounted in the guest"
    );
    let (st, v) =
        f.d.call(
            Method::DELETE,
            &format!("/v1/sandboxes/{id}/mounts?path=/mnt/y"),
            None,
        )
        .await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    // The bucket cannot go while mounted.
    let (st, v) = f.d.call(Method::DELETE, "/v1/buckets/data", None).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("conflict")),
        "{v}"
    );
    f.d.destroy(id).await;
    let (st, _) = f.d.call(Method::DELETE, "/v1/buckets/data", None).await;
    assert_eq!(st, StatusCode::NO_CONTENT, "deletable once nothing mounts it");
}

#[tokio::test]
async fn a_warm_create_restores_the_boot_snapshot_then_mounts() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start_with("10.213.95.0/24", S3Kind::S3sFs, &["--warm-creates", "on"]).await;
    f.register("data", "s3://bkt").await;
    f.put("w/seed.txt", b"seed\n").await;
    let saved = |f: &Fixture| f.d.log().matches("boot snapshot saved").count();
    let restores = |f: &Fixture| {
        f.d.log()
            .lines()
            .filter(|l| l.contains("snapshot verified"))
            .count()
    };
    let mount = json!([{"path": "/mnt/w", "bucket": "data", "prefix": "w"}]);

    // A create with mounts and no boot snapshot yet boots, and saves none (its guest has mounted the bucket).
    let first = f.d.create(json!({"template": "minimal", "mounts": mount})).await;
    assert_eq!(saved(&f), 0, "{}", f.d.log());
    assert_eq!(f.ok(&first.id, "cat /mnt/w/seed.txt").await, "seed\n");
    // One without mounts saves it.
    let plain = f.d.create(json!({"template": "minimal"})).await;
    assert_eq!(saved(&f), 1, "{}", f.d.log());
    assert_eq!(
        f.ok(&plain.id, "grep -c /mnt/w /proc/mounts || true").await,
        "0\n"
    );

    // The next create with mounts restores it, then mounts: the bucket reads and writes through the prefix.
    let warm = f.d.create(json!({"template": "minimal", "mounts": mount})).await;
    assert_eq!(restores(&f), 1, "restored from the boot snapshot: {}", f.d.log());
    assert_eq!(saved(&f), 1);
    assert_eq!(warm.snapshot_id, None);
    assert_eq!(f.ok(&warm.id, "hostname").await.trim(), warm.id.replace('_', "-"));
    assert_eq!(f.ok(&warm.id, "cat /mnt/w/seed.txt").await, "seed\n");
    f.ok(&warm.id, "echo from-warm > /mnt/w/out.txt && sync").await;
    assert_eq!(f.get("w/out.txt").await.as_deref(), Some(&b"from-warm\n"[..]));
    let (_, m) =
        f.d.call(Method::GET, &format!("/v1/sandboxes/{}/mounts", warm.id), None)
            .await;
    assert_eq!(m["mounts"].as_array().map(Vec::len), Some(1), "{m}");
    // The first sandbox sees what the warm one wrote.
    assert_eq!(f.ok(&first.id, "cat /mnt/w/out.txt").await, "from-warm\n");
    for id in [&first.id, &plain.id, &warm.id] {
        f.d.destroy(id).await;
    }
}

#[tokio::test]
async fn an_unreachable_bucket_gives_eio_in_bounded_time_and_the_sandbox_lives_on() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.85.0/24").await;
    f.register("data", "s3://bkt").await;
    f.put("p/cached.txt", b"c\n").await;
    f.put("p/later.txt", b"l\n").await;
    let sbx =
        f.d.create(
            json!({"template": "minimal", "mounts": [{"path": "/mnt/p", "bucket": "data", "prefix": "p"}]}),
        )
        .await;
    let id = &sbx.id;
    assert_eq!(f.ok(id, "cat /mnt/p/cached.txt").await, "c\n");
    f.s3.freeze();
    let t = Instant::now();
    let (code, out) = f.sh(id, "cat /mnt/p/later.txt").await;
    let took = t.elapsed();
    let (code2, out2) = f.sh(id, "echo x > /mnt/p/new.txt").await;
    f.s3.thaw();
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("Input/output error"), "EIO: {out}");
    assert!(code2 != 0 && out2.contains("Input/output error"), "EIO: {out2}");
    // One S3 request is bounded at 20 s; an NFS operation makes at most two in a row.
    assert!(took < Duration::from_secs(45), "answered after {took:?}");
    eprintln!("EIO after {took:?}");
    // The sandbox lives on, and the mount works again once the bucket answers.
    assert_eq!(f.ok(id, "echo alive").await, "alive\n");
    eventually("the mount recovers", Duration::from_secs(60), || async {
        f.sh(id, "cat /mnt/p/later.txt").await == (0, "l\n".into())
    })
    .await;
    f.d.destroy(id).await;
}

async fn code(d: &Daemon, method: Method, path: &str, body: Value) -> (StatusCode, String) {
    let (st, v) = d.call(method, path, Some(body)).await;
    (st, v["error"]["code"].as_str().unwrap_or_default().to_string())
}

#[tokio::test]
async fn bad_input_is_refused_with_a_typed_error_and_nothing_is_made() {
    let _vm = common::VM_LOCK.lock().await;
    let f = Fixture::start("10.213.86.0/24").await;
    let secret = hearth_testkit::s3::SECRET_ACCESS_KEY;
    // Registration: wrong secret, missing bucket, dead endpoint, malformed input.
    let (st, v) = f.register_with("data", "s3://bkt", "wrong-secret-value").await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("bucket_access_denied")),
        "{v}"
    );
    assert!(
        !v.to_string().contains("wrong-secret-value"),
        "no secret in errors: {v}"
    );
    let (st, v) = f.register_with("data", "s3://no-such-bucket", secret).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, Some("bucket_not_found")),
        "{v}"
    );
    let dead = json!({"name": "data", "url": "s3://bkt", "endpoint": "http://127.0.0.1:1",
        "access_key_id": "k", "secret_access_key": secret});
    assert_eq!(
        code(&f.d, Method::POST, "/v1/buckets", dead).await,
        (StatusCode::UNPROCESSABLE_ENTITY, "bucket_unreachable".into())
    );
    for body in [
        json!({"name": "Bad_Name", "url": "s3://bkt", "access_key_id": "k", "secret_access_key": "s"}),
        json!({"name": "ok", "url": "https://bkt", "access_key_id": "k", "secret_access_key": "s"}),
        json!({"name": "ok", "url": "s3://bkt/../x", "access_key_id": "k", "secret_access_key": "s"}),
        json!({"name": "ok", "url": "s3://bkt", "endpoint": "ftp://x", "access_key_id": "k", "secret_access_key": "s"}),
    ] {
        assert_eq!(
            code(&f.d, Method::POST, "/v1/buckets", body.clone()).await.0,
            StatusCode::BAD_REQUEST,
            "{body}"
        );
    }
    let (st, v) =
        f.d.call(
            Method::POST,
            "/v1/buckets",
            Some(json!({"name": "x", "url": "s3://bkt", "access_key_id": "k", "secret_access_key": 12345})),
        )
        .await;
    assert_eq!(st, StatusCode::BAD_REQUEST);
    assert!(
        !v.to_string().contains("12345"),
        "a wrongly typed secret is not echoed: {v}"
    );
    let (_, list) = f.d.call(Method::GET, "/v1/buckets", None).await;
    assert_eq!(
        list["buckets"].as_array().unwrap().len(),
        0,
        "nothing registered: {list}"
    );

    // A good registration never shows its secret.
    f.register("data", "s3://bkt").await;
    let (_, b) = f.d.call(Method::GET, "/v1/buckets/data", None).await;
    assert!(
        !b.to_string().contains(secret) && b["access_key_hint"] == "tkey",
        "{b}"
    );
    assert!(!f.d.log().contains(secret), "the secret is not logged");
    assert_eq!(
        code(
            &f.d,
            Method::POST,
            "/v1/buckets",
            json!({"name": "data", "url": "s3://bkt", "access_key_id": "k", "secret_access_key": "s"})
        )
        .await
        .0,
        StatusCode::CONFLICT
    );

    // Mounts at create: unknown bucket, relative path, system directory, duplicates, nested, with a snapshot.
    let m = |mounts: Value| json!({"template": "minimal", "mounts": mounts});
    for (body, want) in [
        (
            m(json!([{"path": "/mnt/a", "bucket": "nope"}])),
            (StatusCode::NOT_FOUND, "not_found"),
        ),
        (
            m(json!([{"path": "mnt/a", "bucket": "data"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/proc", "bucket": "data"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/proc/x", "bucket": "data"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/", "bucket": "data"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/etc", "bucket": "data"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/mnt/a/../b", "bucket": "data"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/mnt/a", "bucket": "data"}, {"path": "/mnt/a", "bucket": "data"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/mnt/a", "bucket": "data"}, {"path": "/mnt/a/b", "bucket": "data"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/mnt/a", "bucket": "data", "prefix": "../x"}])),
            (StatusCode::BAD_REQUEST, "invalid_argument"),
        ),
        (
            m(json!([{"path": "/mnt/a", "bucket": "data", "extra": 1}])),
            (StatusCode::BAD_REQUEST, "invalid_json"),
        ),
        (
            json!({"snapshot": "snp_0123456789abcdef", "mounts": [{"path": "/mnt/a", "bucket": "data"}]}),
            (StatusCode::NOT_FOUND, "not_found"),
        ),
    ] {
        let got = code(&f.d, Method::POST, "/v1/sandboxes", body.clone()).await;
        assert_eq!((got.0, got.1.as_str()), want, "{body}");
    }
    assert!(f.d.list_ids().await.is_empty(), "no sandbox was made");
    assert!(
        hearth_testkit::pids_mentioning(&f.d.data_dir().join("sandboxes")).is_empty(),
        "no VM was started"
    );

    // Without --allow-private-bucket-endpoints a loopback endpoint is refused; a daemon without networking
    // refuses mounts with its own code.
    let reg = json!({"name": "data", "url": "s3://bkt", "endpoint": f.s3.endpoint(),
        "access_key_id": hearth_testkit::s3::ACCESS_KEY_ID, "secret_access_key": secret});
    let strict = Daemon::start().await;
    assert_eq!(
        code(&strict, Method::POST, "/v1/buckets", reg.clone()).await,
        (StatusCode::UNPROCESSABLE_ENTITY, "bucket_unreachable".into())
    );
    let off = Daemon::start_with(&["--network", "off", "--allow-private-bucket-endpoints"]).await;
    assert_eq!(
        code(&off, Method::POST, "/v1/buckets", reg).await.0,
        StatusCode::CREATED
    );
    assert_eq!(
        code(
            &off,
            Method::POST,
            "/v1/sandboxes",
            m(json!([{"path": "/mnt/a", "bucket": "data"}]))
        )
        .await,
        (StatusCode::BAD_REQUEST, "network_required".into())
    );
    assert!(off.list_ids().await.is_empty());
}
