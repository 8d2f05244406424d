//! Real-VM tests: the real `hearthd` binary drives QEMU (TCG here) with the images from
//! `/var/lib/hearth/images` (or `$HEARTH_IMAGES`). Sandboxes are shared between assertions because every boot
//! costs seconds; the tests of this file run one at a time (`VM_LOCK`).

mod common;

use std::time::Duration;

use base64::Engine;
use common::{Daemon, VM_LOCK, template_built, wait_until};
use rand::RngCore;
use reqwest::{Method, StatusCode};
use serde_json::json;
use sha2::{Digest, Sha256};

fn random_bytes(n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rng().fill_bytes(&mut v);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_files_and_isolation() {
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let a = d
        .create(
            json!({"template": "minimal", "memory_mib": 256, "env": {"FOO": "from-create", "BAR": "keep"},
            "metadata": {"test": "vm"}}),
        )
        .await;
    let b = d.create(json!({"template": "minimal", "memory_mib": 256})).await;
    assert_eq!(a.state, hearth_api::SandboxState::Running);
    let (a, b) = (a.id, b.id);

    // Its own kernel: another boot than the host's (the release may be the same, e.g. on the KVM test host).
    let guest = d.sh(&a, "uname -r; cat /proc/sys/kernel/random/boot_id").await;
    assert_eq!(guest.exit_code, 0, "{guest:?}");
    let host = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let mut lines = guest.stdout.lines();
    assert!(!lines.next().unwrap_or_default().is_empty(), "{guest:?}");
    let boot_id = lines.next().unwrap_or_default();
    assert_eq!(boot_id.len(), 36, "{guest:?}");
    assert_ne!(boot_id, host.trim());

    // Exit codes, signals, stdout/stderr separation.
    let r = d.sh(&a, "echo out; echo err >&2; exit 3").await;
    assert_eq!(
        (r.exit_code, r.stdout.as_str(), r.stderr.as_str()),
        (3, "out\n", "err\n")
    );
    let r = d.sh(&a, "kill -9 $$").await;
    assert_eq!((r.exit_code, r.signal), (137, Some(9)), "{r:?}");
    let r = d
        .run(&a, json!({"argv": ["/bin/sh", "-c", "echo $0-$1", "x", "y"]}))
        .await;
    assert_eq!(r.stdout, "x-y\n");

    // stdin, env (create env merged under command env), cwd.
    let r = d
        .run(&a, json!({"cmd": "cat; echo", "stdin": "hello stdin"}))
        .await;
    assert_eq!(r.stdout, "hello stdin\n");
    let r = d
        .run(
            &a,
            json!({"cmd": "echo $FOO $BAR $BAZ", "env": {"FOO": "from-cmd", "BAZ": "z"}}),
        )
        .await;
    assert_eq!(r.stdout, "from-cmd keep z\n");
    let r = d.run(&a, json!({"cmd": "pwd", "cwd": "/tmp"})).await;
    assert_eq!(r.stdout, "/tmp\n");

    // Timeout kills and says so.
    let started = std::time::Instant::now();
    let r = d.run(&a, json!({"cmd": "sleep 30", "timeout_s": 1})).await;
    assert!(r.timed_out, "{r:?}");
    assert!(started.elapsed() < Duration::from_secs(20));

    // Bad command requests.
    let (status, v) = d.run_raw(&a, json!({"cmd": "true", "argv": ["true"]})).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_argument"))
    );
    let (status, v) = d.run_raw(&a, json!({})).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_argument"))
    );

    // 10 MB streamed through SSE, intact.
    let r = d
        .sh(
            &a,
            "head -c 10485760 /dev/urandom > /tmp/big && sha256sum /tmp/big",
        )
        .await;
    let guest_sum = r.stdout.split_whitespace().next().unwrap_or("").to_string();
    assert_eq!(guest_sum.len(), 64, "{r:?}");
    let s = d.run_sse(&a, json!({"cmd": "cat /tmp/big; echo done >&2"})).await;
    assert_eq!(s.events.first().map(String::as_str), Some("start"));
    assert_eq!(s.stdout.len(), 10 * 1024 * 1024);
    assert_eq!(hex::encode(Sha256::digest(&s.stdout)), guest_sum);
    assert_eq!(s.stderr, b"done\n");
    assert!(
        s.events.iter().filter(|e| *e == "stdout").count() > 1,
        "output must arrive in chunks"
    );
    let end = s.end.expect("exit event");
    assert_eq!(end["type"], "exit");
    assert_eq!(end["exit_code"], 0);

    // Background processes outlive the request; processes, wait, kill, stdin.
    let (status, v) = d
        .run_raw(&a, json!({"cmd": "sleep 1000", "background": true}))
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{v}");
    let sleeper = v["pid"].as_u64().expect("pid");
    let (status, v) = d
        .run_raw(
            &a,
            json!({"cmd": "read line; echo got-$line", "background": true}),
        )
        .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{v}");
    let reader = v["pid"].as_u64().expect("pid");
    let (status, procs) = d
        .call(Method::GET, &format!("/v1/sandboxes/{a}/processes"), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let running = procs["processes"].as_array().cloned().unwrap_or_default();
    assert!(
        running
            .iter()
            .any(|p| p["pid"] == sleeper && p["exit_code"].is_null()),
        "{procs}"
    );
    let resp = d
        .req(
            Method::POST,
            &format!("/v1/sandboxes/{a}/processes/{reader}/stdin?eof=true"),
        )
        .body("hi\n")
        .send()
        .await
        .expect("stdin");
    assert_eq!(resp.status(), StatusCode::NO_CONTENT);
    let (status, v) = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/processes/{reader}/wait"),
            None,
        )
        .await;
    assert_eq!(
        (status, v["exit_code"].as_i64(), v["stdout"].as_str()),
        (StatusCode::OK, Some(0), Some("got-hi\n"))
    );
    // A streamed (foreground) command with `keep_stdin_open` reads what `.../stdin` sends while its output
    // streams; without the flag its stdin is empty.
    let r = d.run(&a, json!({"cmd": "cat; echo end"})).await;
    assert_eq!(r.stdout, "end\n", "stdin is empty by default");
    let mut resp = d
        .req(Method::POST, &format!("/v1/sandboxes/{a}/commands"))
        .header("accept", "text/event-stream")
        .json(&json!({"cmd": "read line; echo got-$line; cat", "keep_stdin_open": true, "stdin": "one\n"}))
        .send()
        .await
        .expect("streamed command");
    assert_eq!(resp.status(), StatusCode::OK);
    let mut text = String::new();
    let pid = loop {
        let chunk = resp.chunk().await.expect("chunk").expect("stream open");
        text.push_str(&String::from_utf8_lossy(&chunk));
        if let Some(p) = text.find("\"pid\":") {
            let digits: String = text[p + 6..].chars().take_while(char::is_ascii_digit).collect();
            if !digits.is_empty() && text[p + 6 + digits.len()..].starts_with('}') {
                break digits.parse::<u64>().expect("pid");
            }
        }
    };
    let stdin = d
        .req(
            Method::POST,
            &format!("/v1/sandboxes/{a}/processes/{pid}/stdin?eof=true"),
        )
        .body("two\n")
        .send()
        .await
        .expect("stdin");
    assert_eq!(stdin.status(), StatusCode::NO_CONTENT);
    while let Some(chunk) = resp.chunk().await.expect("chunk") {
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let out: Vec<u8> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter(|v| v["type"] == "stdout")
        .flat_map(|v| {
            base64::engine::general_purpose::STANDARD
                .decode(v["data_b64"].as_str().unwrap_or(""))
                .expect("base64")
        })
        .collect();
    assert_eq!(String::from_utf8_lossy(&out), "got-one\ntwo\n", "{text}");
    assert!(text.contains("\"exit_code\":0"), "{text}");

    let path = format!("/v1/sandboxes/{a}/processes/{sleeper}/wait?timeout_s=1");
    let (status, v) = d.call(Method::POST, &path, None).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("conflict"))
    );
    let path = format!("/v1/sandboxes/{a}/processes/{sleeper}/kill");
    let (status, _) = d.call(Method::POST, &path, Some(json!({"signal": 15}))).await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, v) = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/processes/{sleeper}/wait"),
            None,
        )
        .await;
    assert_eq!((status, v["signal"].as_i64()), (StatusCode::OK, Some(15)), "{v}");
    let (status, v) = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/processes/999999/wait"),
            None,
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found")),
        "{v}"
    );

    // Files: 20 MiB binary round trip, and the metadata operations.
    let data = random_bytes(20 * 1024 * 1024);
    let (status, info) = d.put_file(&a, "/root/blob.bin", data.clone()).await;
    assert_eq!(status, StatusCode::OK, "{info}");
    assert_eq!(info["size"].as_u64(), Some(data.len() as u64));
    let (status, back) = d.get_file(&a, "/root/blob.bin").await;
    assert_eq!(status, StatusCode::OK);
    assert!(back == data, "20 MiB file differs after the round trip");
    let r = d.sh(&a, "sha256sum /root/blob.bin").await;
    assert!(r.stdout.starts_with(&hex::encode(Sha256::digest(&data))));
    let (status, _) = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/files/mkdir"),
            Some(json!({"path": "/root/d1/d2"})),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, _) = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{a}/files/rename"),
            Some(json!({"from": "/root/blob.bin", "to": "/root/d1/d2/moved.bin"})),
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, list) = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{a}/files/list?path=/root/d1/d2"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(list["entries"][0]["name"], "moved.bin", "{list}");
    let (status, st) = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{a}/files/stat?path=/root/d1"),
            None,
        )
        .await;
    assert_eq!((status, st["kind"].as_str()), (StatusCode::OK, Some("dir")));
    let (status, v) = d
        .call(
            Method::DELETE,
            &format!("/v1/sandboxes/{a}/files?path=/root/d1"),
            None,
        )
        .await;
    assert_eq!(
        status,
        StatusCode::CONFLICT,
        "non-empty dir without recursive: {v}"
    );
    let (status, _) = d
        .call(
            Method::DELETE,
            &format!("/v1/sandboxes/{a}/files?path=/root/d1&recursive=true"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NO_CONTENT);
    let (status, v) = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{a}/files/stat?path=/root/d1"),
            None,
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (StatusCode::NOT_FOUND, Some("not_found"))
    );
    let (status, v) = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{a}/files/stat?path=relative"),
            None,
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (StatusCode::BAD_REQUEST, Some("invalid_argument"))
    );

    // Two sandboxes do not see each other's files.
    let (status, _) = d.put_file(&a, "/root/only-in-a", b"secret".to_vec()).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _) = d
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{b}/files/stat?path=/root/only-in-a"),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let r = d.sh(&b, "cat /root/only-in-a").await;
    assert_ne!(r.exit_code, 0);

    // Destroy leaves no process, socket or file of the sandbox.
    assert!(
        !d.vm_pids(&a).is_empty(),
        "the VMM process should mention the sandbox directory"
    );
    d.destroy(&a).await;
    assert!(d.vm_pids(&a).is_empty(), "VMM process left behind");
    assert!(!d.sandbox_dir(&a).exists(), "sandbox directory left behind");
    assert_eq!(d.get(&a).await.0, StatusCode::NOT_FOUND);
    assert_eq!(d.list_ids().await, vec![b.clone()]);
    d.destroy(&b).await;
    assert!(d.vm_pids(&b).is_empty() && !d.sandbox_dir(&b).exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_health_and_restart_adoption() {
    let _serial = VM_LOCK.lock().await;
    let mut d = Daemon::start().await;
    let short = d
        .create(json!({"template": "minimal", "memory_mib": 256, "timeout_s": 5}))
        .await
        .id;
    let keep1 = d
        .create(json!({"template": "minimal", "memory_mib": 256, "timeout_s": 600}))
        .await
        .id;
    let keep2 = d
        .create(json!({"template": "minimal", "memory_mib": 256, "timeout_s": 600}))
        .await
        .id;
    d.sh(&keep1, "echo state > /root/mark").await;

    // TTL: gone shortly after, with its VMM process and files.
    let gone = wait_until(Duration::from_secs(30), || async {
        d.get(&short).await.0 == StatusCode::NOT_FOUND
    })
    .await;
    assert!(gone, "TTL sandbox still listed");
    assert!(d.vm_pids(&short).is_empty(), "TTL sandbox VMM still running");
    assert!(!d.sandbox_dir(&short).exists());

    // kill -9 the daemon; both sandboxes survive, are adopted, and stay usable.
    d.kill9_and_restart().await;
    let mut ids = d.list_ids().await;
    ids.sort();
    let mut want = vec![keep1.clone(), keep2.clone()];
    want.sort();
    assert_eq!(ids, want);
    for id in [&keep1, &keep2] {
        let (_, v) = d.get(id).await;
        assert_eq!(v["state"], "running", "{v}\n{}", d.log());
        let r = d.sh(id, "echo alive").await;
        assert_eq!(r.stdout, "alive\n");
    }
    assert_eq!(d.sh(&keep1, "cat /root/mark").await.stdout, "state\n");
    // A graceful stop (SIGTERM) leaves the VMs running for the next start as well.
    d.term_and_restart().await;
    assert_eq!(d.sh(&keep1, "cat /root/mark").await.stdout, "state\n");
    // The TTL is persisted too: shorten it after the restart and watch it go.
    let (status, _) = d
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{keep2}/timeout"),
            Some(json!({"timeout_s": 1})),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let gone = wait_until(Duration::from_secs(30), || async {
        d.get(&keep2).await.0 == StatusCode::NOT_FOUND
    })
    .await;
    assert!(gone && d.vm_pids(&keep2).is_empty());

    // Health: the VMM process dies under us: the sandbox becomes failed with a reason, not a zombie "running".
    for pid in d.vm_pids(&keep1) {
        // SAFETY: kill(2) has no memory-safety preconditions; the pid is this test's VMM.
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
        }
    }
    let failed = wait_until(Duration::from_secs(20), || async {
        d.get(&keep1).await.1["state"] == "failed"
    })
    .await;
    let (_, v) = d.get(&keep1).await;
    assert!(failed, "{v}");
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    let (status, v) = d.run_raw(&keep1, json!({"cmd": "true"})).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (StatusCode::CONFLICT, Some("conflict"))
    );
    d.destroy(&keep1).await;
    assert!(d.list_ids().await.is_empty());
    let leftovers: Vec<_> = std::fs::read_dir(d.data_dir().join("sandboxes"))
        .expect("dir")
        .flatten()
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debian_template_has_python() {
    assert!(
        template_built("debian"),
        "rootfs/debian.ext4 must be built (images/build.sh)"
    );
    let _serial = VM_LOCK.lock().await;
    let d = Daemon::start().await;
    let s = d.create(json!({"template": "debian", "memory_mib": 512})).await;
    assert_eq!(s.template, "debian");
    let r = d
        .run(
            &s.id,
            json!({"argv": ["python3", "-c", "import sys; print(sys.version_info[0] * 2)"]}),
        )
        .await;
    assert_eq!((r.exit_code, r.stdout.as_str()), (0, "6\n"), "{r:?}");
    let (status, v) = d.call(Method::GET, "/v1/system", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        (v["vmm"].as_str(), v["capacity"]["sandboxes_running"].as_u64()),
        (Some("qemu"), Some(1)),
        "{v}"
    );
    d.destroy(&s.id).await;
}
