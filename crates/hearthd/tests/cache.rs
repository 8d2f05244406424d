//! Local disk as a cache of the storage bucket (`hearthd --cache-size`), with real VMs (QEMU TCG, `minimal`) and
//! a real S3 server (s3s-fs on loopback). Three sandboxes run a counter and hold a file of their own, and are
//! paused; without a limit nothing leaves the local disk. The daemon restarts with a limit that holds the newest
//! pause and a quarter of another: the two older ones are evicted (local files gone, the bucket has them) and
//! resume from the bucket with their process and files. With the bucket stopped, pausing them again leaves two
//! pending pauses over the limit that are never evicted, and nothing else is evicted while the bucket is down;
//! when it is back, the least recently used of what the bucket holds go until the cache fits (one of the two),
//! and every sandbox resumes intact (one of them while its GET shows the fetch in progress, one through the
//! resume's event stream with the fetch's progress).

mod common;
mod storagefix;

use std::time::Duration;

use common::{Daemon, VM_LOCK, wait_until};
use futures::StreamExt;
use hearth_api::SandboxStartEvent;
use hearth_testkit::s3::{S3Kind, S3Server};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use storagefix::{COUNTER, PREFIX, cli_storage_status, pause, poll_storage, start_daemon_with, storage};

const BUCKET: &str = "hearth-cache";

fn object(status: &Value, id: &str) -> Value {
    let name = format!("sandboxes/{id}/pause");
    status["objects"]
        .as_array()
        .and_then(|a| a.iter().find(|o| o["name"] == name.as_str()))
        .cloned()
        .unwrap_or_default()
}

/// Polls `GET /v1/storage` until `done` holds (3 minutes at most) and returns the last answer.
async fn poll(d: &Daemon, what: &str, done: impl Fn(&Value) -> bool) -> Value {
    poll_storage(d, what, Duration::from_secs(180), done).await
}

async fn counter(d: &Daemon, id: &str) -> u64 {
    let r = d.sh(id, "cat /dev/shm/counter").await;
    r.stdout.trim().parse().unwrap_or(0)
}

/// A sandbox with a counter process and a file naming it.
struct Guest {
    id: String,
    pid: u64,
}

async fn guest(d: &Daemon) -> Guest {
    let id = d
        .create(json!({"template": "minimal", "memory_mib": 128}))
        .await
        .id;
    let (status, v) = d.run_raw(&id, json!({"cmd": COUNTER, "background": true})).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{v}");
    let pid = v["pid"].as_u64().expect("pid");
    let r = d.sh(&id, &format!("echo {id} > /root/me && sync")).await;
    assert_eq!(r.exit_code, 0);
    assert!(wait_until(Duration::from_secs(10), || async { counter(d, &id).await >= 2 }).await);
    Guest { id, pid }
}

/// Resumes `g` and checks its process and file came back with it.
async fn resume_intact(d: &Daemon, g: &Guest) {
    let (status, v) = d
        .call(Method::POST, &format!("/v1/sandboxes/{}/resume", g.id), None)
        .await;
    assert_eq!(status, StatusCode::OK, "resume {}: {v}\n{}", g.id, d.log());
    intact(d, g).await;
}

/// Checks that `g` runs with its process and file.
async fn intact(d: &Daemon, g: &Guest) {
    assert_eq!(d.sh(&g.id, "cat /root/me").await.stdout, format!("{}\n", g.id));
    assert_eq!(
        d.sh(&g.id, &format!("kill -0 {}", g.pid)).await.exit_code,
        0,
        "the counter of {} survived",
        g.id
    );
    let before = counter(d, &g.id).await;
    assert!(
        wait_until(Duration::from_secs(10), || async {
            counter(d, &g.id).await > before
        })
        .await,
        "the counter of {} goes on from {before}",
        g.id
    );
}

fn local(st: &Value, id: &str) -> u64 {
    object(st, id)["local_bytes"].as_u64().unwrap_or(0)
}

fn location(st: &Value, id: &str) -> String {
    object(st, id)["location"].as_str().unwrap_or_default().to_owned()
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_disk_is_a_cache_of_the_bucket() {
    let _serial = VM_LOCK.lock().await;
    let mut s3 = tokio::task::spawn_blocking(|| S3Server::start(S3Kind::S3sFs, BUCKET))
        .await
        .expect("s3 server");
    // Cold boots: the cache's sizes and eviction counts below are those of the three pauses alone (a boot
    // snapshot in the cache is `warm.rs::an_evicted_boot_snapshot_comes_back_from_the_bucket`).
    let mut d = start_daemon_with(&s3, "hc", &["--warm-creates", "off"]).await;

    // Without --cache-size: unbounded, nothing evicted.
    let (a, b, c) = (guest(&d).await, guest(&d).await, guest(&d).await);
    for g in [&a, &b, &c] {
        pause(&d, &g.id).await;
    }
    let st = poll(&d, "all three synced", |st| {
        [&a, &b, &c].iter().all(|g| object(st, &g.id)["sync"] == "synced")
    })
    .await;
    assert!(st["cache"]["limit_bytes"].is_null(), "{st:#}");
    assert_eq!(st["cache"]["evictions"], 0, "{st:#}");
    let (la, lb, lc) = (local(&st, &a.id), local(&st, &b.id), local(&st, &c.id));
    assert!(la > 0 && lb > 0 && lc > 0, "{st:#}");
    assert!(st["cache"]["used_bytes"].as_u64() >= Some(la + lb + lc), "{st:#}");
    // A paused sandbox's GET shows where its state lives.
    let (_, row) = d.get(&a.id).await;
    assert_eq!(row["storage"]["location"], "both", "{row}");
    assert_eq!(row["storage"]["sync"], "synced", "{row}");
    assert!(row["storage"]["bytes"].as_u64() > Some(0), "{row}");
    assert!(row["storage"]["synced_at"].is_string(), "{row}");

    // Restart with room for the newest pause and a quarter of another: the two older ones leave the local disk.
    let limit = lc + lb / 4;
    println!(
        "paused states on disk: {:.1}, {:.1}, {:.1} MiB; limit {:.1} MiB",
        mib(la),
        mib(lb),
        mib(lc),
        mib(limit)
    );
    d.set_env_for_restarts("HEARTH_CACHE_SIZE", limit.to_string());
    d.term_and_restart().await;
    let st = poll(&d, "the two older pauses evicted", |st| {
        location(st, &a.id) == "remote" && location(st, &b.id) == "remote"
    })
    .await;
    assert_eq!(location(&st, &c.id), "both", "the newest stays: {st:#}");
    assert_eq!(st["cache"]["limit_bytes"], limit, "{st:#}");
    assert_eq!(st["cache"]["evictions"], 2, "{st:#}");
    assert!(st["cache"]["used_bytes"].as_u64() <= Some(limit), "{st:#}");
    for g in [&a, &b] {
        assert!(!d.sandbox_dir(&g.id).join("paused").exists(), "{} evicted", g.id);
        let (_, row) = d.get(&g.id).await;
        assert_eq!(row["storage"]["location"], "remote", "{row}");
        assert_eq!(row["state"], "paused", "{row}");
    }
    let manifests = s3
        .data_dir()
        .expect("s3s-fs keeps files")
        .join(BUCKET)
        .join(PREFIX)
        .join("manifests");
    for g in [&a, &b] {
        assert!(
            manifests
                .join(format!("sandboxes/{}/pause/MANIFEST", g.id))
                .is_file(),
            "the bucket holds {}",
            g.id
        );
    }
    let (_, system) = d.call(Method::GET, "/v1/system", None).await;
    let check = system["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "storage"))
        .cloned()
        .unwrap_or_default();
    assert!(
        check["detail"]
            .as_str()
            .unwrap_or_default()
            .contains("local cache"),
        "{system:#}"
    );
    let (ok, text) = cli_storage_status(&d).await;
    assert!(
        ok && text.contains("local cache") && text.contains("2 evicted"),
        "{text}"
    );
    println!("hearth storage status:\n{text}");

    // Fetched back: the same processes and files. (c may leave meanwhile: a fetched copy counts while its resume
    // runs, and c was used least recently.)
    resume_intact(&d, &a).await;
    resume_intact(&d, &b).await;
    assert!(d.log().contains("fetched from the storage bucket"));

    // The bucket stops: pauses commit locally and stay pending; nothing is evicted although the cache is full.
    // (The daemon learns of the outage from a failed request: a GC pass here, before the cache overflows.)
    s3.stop();
    let (status, v) = d.call(Method::POST, "/v1/storage/gc", None).await;
    assert!(status.is_server_error(), "{status} {v}");
    let st = storage(&d).await;
    assert_eq!(st["health"], "unavailable", "{st:#}");
    let evictions = st["cache"]["evictions"].clone();
    pause(&d, &a.id).await;
    pause(&d, &b.id).await;
    let st = poll(&d, "pending during the outage", |st| {
        st["health"] == "unavailable"
            && [&a, &b].iter().all(|g| {
                object(st, &g.id)["sync"] == "pending" && object(st, &g.id)["attempts"].as_u64() >= Some(1)
            })
    })
    .await;
    // A few worker passes over the full cache.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let st2 = storage(&d).await;
    assert!(
        st2["cache"]["used_bytes"].as_u64() > Some(limit),
        "over the limit: {st2:#}"
    );
    for g in [&a, &b] {
        assert_eq!(location(&st2, &g.id), "local", "{st2:#}");
        assert!(d.sandbox_dir(&g.id).join("paused").is_dir());
    }
    assert_eq!(
        st2["cache"]["evictions"],
        evictions,
        "nothing evicted during the outage: {st:#}\n{st2:#}\n{}",
        d.log()
    );

    // The bucket is back: the uploads finish, and the least recently used of what the bucket holds go until the
    // cache fits: c's pause (if still here), then whichever of a's and b's is evictable first. A pending upload
    // is never evicted, so when b's upload finishes before a's, b's copy goes while a's still waits; either way
    // exactly one of the two stays, and the cache fits.
    let s3 = tokio::task::spawn_blocking(move || {
        s3.start_again();
        s3
    })
    .await
    .expect("restart s3");
    let st = poll(&d, "synced and evicted after the outage", |st| {
        [&a, &b].iter().all(|g| object(st, &g.id)["sync"] == "synced")
            && location(st, &c.id) == "remote"
            && [&a, &b].iter().any(|g| location(st, &g.id) == "remote")
            && st["cache"]["used_bytes"].as_u64() <= Some(limit)
    })
    .await;
    let mut kept = [location(&st, &a.id), location(&st, &b.id)];
    kept.sort();
    assert_eq!(kept, ["both", "remote"], "exactly one of a and b stays: {st:#}");
    println!(
        "after the outage: a is {}, b is {}, cache {:.1} of {:.1} MiB",
        location(&st, &a.id),
        location(&st, &b.id),
        mib(st["cache"]["used_bytes"].as_u64().unwrap_or(0)),
        mib(limit)
    );
    // While a resume fetches, the sandbox's GET shows the fetch (the server is frozen a moment to see it).
    s3.freeze();
    let watch = async {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let seen = loop {
            let (_, row) = d.get(&c.id).await;
            if row["storage"]["fetch"].is_object() || std::time::Instant::now() > deadline {
                break row;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        s3.thaw();
        seen
    };
    let ((), seen) = tokio::join!(resume_intact(&d, &c), watch);
    assert_eq!(seen["state"], "resuming", "{seen}");
    assert_eq!(seen["storage"]["location"], "remote", "{seen}");
    assert!(seen["storage"]["fetch"]["done_bytes"].is_u64(), "{seen}");
    let (_, row) = d.get(&c.id).await;
    assert!(
        row.get("storage").is_none(),
        "a running sandbox has no stored state: {row}"
    );
    // The one of a and b that left resumes through the event stream that `hearth resume` draws its bar from
    // (the Rust client): fetch progress for its pause, the last at its whole size, then the running sandbox.
    let (gone, kept) = if location(&st, &a.id) == "remote" {
        (&a, &b)
    } else {
        (&b, &a)
    };
    let client = hearth_client::Client::new(&format!("http://{}", d.addr), d.key.clone()).expect("client");
    let events: Vec<SandboxStartEvent> = client
        .resume_sandbox_stream(&gone.id)
        .map(|e| e.expect("event"))
        .collect()
        .await;
    let name = format!("sandboxes/{}/pause", gone.id);
    let fetched: Vec<(u64, u64)> = events
        .iter()
        .filter_map(|e| match e {
            SandboxStartEvent::Fetch {
                object,
                done_bytes,
                total_bytes,
            } if *object == name => Some((*done_bytes, *total_bytes)),
            _ => None,
        })
        .collect();
    println!(
        "resume events of {}: {} fetch events, last {:?}",
        gone.id,
        fetched.len(),
        fetched.last()
    );
    let (done, total) = *fetched
        .last()
        .unwrap_or_else(|| panic!("no fetch event: {events:?}"));
    assert!(total > 50 << 20 && done == total, "{events:?}");
    assert!(fetched.windows(2).all(|w| w[0].0 <= w[1].0), "{events:?}");
    match events.last() {
        Some(SandboxStartEvent::Done { sandbox }) => {
            assert_eq!(sandbox.id, gone.id);
            assert_eq!(sandbox.state, hearth_api::SandboxState::Running);
        }
        other => panic!("last event {other:?}"),
    }
    intact(&d, gone).await;
    resume_intact(&d, kept).await;
    // An error before anything was fetched is the JSON answer, not a stream.
    let err = client
        .resume_sandbox_stream("sbx_0000000000000000")
        .next()
        .await
        .expect("one item");
    assert!(
        matches!(&err, Err(hearth_client::Error::Api { status: 404, .. })),
        "{err:?}"
    );
    drop(s3);
}
