//! Fixture of the mount tests: a real S3 server on loopback (s3s-fs, which checks signatures), a daemon with
//! networking (through an uplink namespace of its own that leads nowhere) that may reach loopback endpoints,
//! a bucket client on the host (the "plain S3 client"), and small helpers.
#![allow(dead_code, clippy::unwrap_used)]

use std::time::Duration;

use bytes::Bytes;
use hearth_testkit::s3::{ACCESS_KEY_ID, REGION, S3Kind, S3Server, SECRET_ACCESS_KEY};
use hearth_testkit::{Network, Options, Stop};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::common::Daemon;

pub const BUCKET: &str = "bkt";

pub struct Fixture {
    pub s3: S3Server,
    pub host: hearth_mount::Bucket,
    pub d: Daemon,
}

/// The options of the daemon under test (`range`: a sandbox range no other test uses).
pub fn options(range: &str) -> Options {
    Options::new()
        .bin(env!("CARGO_BIN_EXE_hearthd"))
        .network(Network::OwnUplink {
            prefix: "hmnt".into(),
            range: range.into(),
        })
        .args([
            "--vmm",
            &crate::common::test_vmm(),
            "--allow-private-bucket-endpoints",
        ])
        .tempdir_prefix("hm")
        .data_in_tempdir_root()
        .stop_on_drop(Stop::Kill)
        .kill_leftover_vmms(true)
        .log_on_panic(true)
        .rust_log("info,hearth_mount=debug")
}

pub fn store_config(s3: &S3Server, secret: &str) -> hearth_store::StoreConfig {
    let env = s3.env();
    let mut c = hearth_store::StoreConfig::from_url_with_env(&s3.url(""), |k| {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })
    .unwrap();
    c.credentials.secret_access_key = hearth_store::Secret::new(secret);
    c
}

impl Fixture {
    pub async fn start(range: &str) -> Fixture {
        Self::start_kind(range, S3Kind::S3sFs).await
    }

    pub async fn start_kind(range: &str, kind: S3Kind) -> Fixture {
        Self::start_with(range, kind, &[]).await
    }

    /// [`Self::start_kind`] with more daemon arguments.
    pub async fn start_with(range: &str, kind: S3Kind, args: &[&str]) -> Fixture {
        let s3 = tokio::task::spawn_blocking(move || S3Server::start(kind, BUCKET))
            .await
            .unwrap();
        let host =
            hearth_mount::Bucket::new(store_config(&s3, SECRET_ACCESS_KEY), Default::default()).unwrap();
        let d = Daemon::start_opts(options(range).args(args)).await;
        Fixture { s3, host, d }
    }

    /// `POST /v1/buckets` with the server's real credentials (or `secret`).
    pub async fn register_with(&self, name: &str, url: &str, secret: &str) -> (StatusCode, Value) {
        self.d
            .call(
                Method::POST,
                "/v1/buckets",
                Some(json!({
                    "name": name, "url": url, "endpoint": self.s3.endpoint(), "region": REGION,
                    "access_key_id": ACCESS_KEY_ID, "secret_access_key": secret,
                })),
            )
            .await
    }

    pub async fn register(&self, name: &str, url: &str) {
        let (st, v) = self.register_with(name, url, SECRET_ACCESS_KEY).await;
        assert_eq!(st, StatusCode::CREATED, "register {name}: {v}");
    }

    pub async fn put(&self, key: &str, body: &[u8]) {
        self.host.put(key, Bytes::copy_from_slice(body)).await.unwrap();
    }

    /// The object's bytes as a plain S3 client sees them.
    pub async fn get(&self, key: &str) -> Option<Vec<u8>> {
        let meta = self.host.head(key).await.unwrap()?;
        if meta.size == 0 {
            return Some(Vec::new());
        }
        Some(self.host.get_range(key, 0..meta.size).await.unwrap().0.to_vec())
    }

    /// Every key under `prefix` (recursively, markers as `dir/`), sorted.
    pub async fn keys(&self, prefix: &str) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![prefix.trim_end_matches('/').to_string()];
        while let Some(p) = stack.pop() {
            let l = self.host.list_dir(&p).await.unwrap();
            let join = |n: &str| {
                if p.is_empty() {
                    n.to_string()
                } else {
                    format!("{p}/{n}")
                }
            };
            if l.marker {
                out.push(format!("{p}/"));
            }
            out.extend(l.files.iter().map(|(n, _)| join(n)));
            stack.extend(l.dirs.iter().map(|n| join(n)));
        }
        out.sort();
        out
    }

    /// Runs a shell line in the guest; returns (exit code, stdout + stderr).
    pub async fn sh(&self, id: &str, cmd: &str) -> (i32, String) {
        let r = self.d.run(id, json!({ "cmd": cmd, "timeout_s": 120 })).await;
        (r.exit_code, format!("{}{}", r.stdout, r.stderr))
    }

    /// Runs a shell line that must succeed; returns its stdout.
    pub async fn ok(&self, id: &str, cmd: &str) -> String {
        let r = self.d.run(id, json!({ "cmd": cmd, "timeout_s": 120 })).await;
        assert_eq!(
            r.exit_code,
            0,
            "{cmd}: {} {}\n{}",
            r.stdout,
            r.stderr,
            self.d.log()
        );
        r.stdout
    }
}

impl Fixture {
    /// Starts a background command in the guest; returns its pid.
    pub async fn bg(&self, id: &str, cmd: &str) -> u64 {
        let (st, v) = self
            .d
            .run_raw(id, json!({ "cmd": cmd, "background": true }))
            .await;
        assert!(st.is_success(), "{cmd}: {st} {v}");
        v["pid"].as_u64().unwrap()
    }
}

/// Polls until `f` holds (or fails after `timeout`).
pub async fn eventually<F, Fut>(what: &str, timeout: Duration, f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    assert!(
        crate::common::wait_until(timeout, f).await,
        "{what} within {timeout:?}"
    );
}
