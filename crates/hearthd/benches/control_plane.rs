//! Control plane under load (issue 13, item 4): p50/p95/p99 of `GET /v1/sandboxes` (one page of 100) and
//! `GET /v1/sandboxes/{id}` over real HTTP against the daemon's real router, state database and lifecycle
//! code, with 100 and then 1,000 sandboxes (8 running, the rest paused), idle and while 4 clients create, exec
//! in and destroy sandboxes and 4 more run commands, each back to back (a load far above what real guests
//! allow, since the test VMM answers at once), and then with the same clients paced to real guests' rates
//! (each creator starts one create every [`CREATE_PERIOD`], each command runner one command every
//! [`COMMAND_PERIOD`]). The VMM is the in-process test VMM of
//! `tests/fake` (a `sleep` process per VM, a small agent that answers commands): what is measured is hearthd's
//! own bookkeeping, not a guest. Last, with `--key-rate-limit 50`: the p50-p99 of one member key's requests
//! while another member key floods the daemon from 8 clients (most of its requests answered 429), beside the
//! same key's numbers without the flood. Run: `cargo bench -p hearthd --bench control_plane` (prints a table).

#[path = "../tests/fake/mod.rs"]
mod fake;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hearthd::AppState;
use serde_json::{Value, json};

/// Requests per measured route and phase.
const SAMPLES: usize = 400;
/// Clients of each kind that keep the daemon busy in the loaded phases.
const CLIENTS: usize = 4;
/// A paced creator's cycle (create, one command, destroy) starts at most this often: a cold create of a real
/// guest takes 0.2 s (Firecracker on KVM, from a memory template) to seconds, so 1 s per client is a busy host.
const CREATE_PERIOD: Duration = Duration::from_secs(1);
/// A paced command runner starts a command at most this often (20 a second per client: an agent issuing
/// short commands back to back against a real guest, each of which takes milliseconds to run).
const COMMAND_PERIOD: Duration = Duration::from_millis(50);

/// How the load's clients run.
#[derive(Clone, Copy, PartialEq)]
enum Load {
    Idle,
    /// Each client back to back, as fast as the daemon answers.
    FlatOut,
    /// Each client paced to [`CREATE_PERIOD`] or [`COMMAND_PERIOD`].
    Paced,
}

/// Waits for the next tick of a paced client (nothing when flat out).
async fn pace(ticker: &mut Option<tokio::time::Interval>) {
    if let Some(t) = ticker {
        t.tick().await;
    }
}

fn ticker(load: Load, period: Duration) -> Option<tokio::time::Interval> {
    (load == Load::Paced).then(|| {
        let mut t = tokio::time::interval(period);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        t
    })
}

struct Bench {
    base: String,
    key: String,
    http: reqwest::Client,
}

impl Bench {
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.key);
        if let Some(b) = body {
            req = req.json(&b);
        }
        match req.send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                (status, resp.json().await.unwrap_or(Value::Null))
            }
            Err(e) => (0, json!({ "transport": e.to_string() })),
        }
    }

    /// Runs `cmd` in sandbox `id`; it must answer 200.
    async fn run_command(&self, id: &str, cmd: &str) {
        let path = format!("/v1/sandboxes/{id}/commands");
        let (s, v) = self
            .call(reqwest::Method::POST, &path, Some(json!({ "cmd": cmd })))
            .await;
        assert_eq!(s, 200, "command: {v}");
    }

    /// Times `n` sequential GETs of `path(i)`; every answer must be 200.
    async fn time_gets(&self, n: usize, path: impl Fn(usize) -> String) -> Vec<Duration> {
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let p = path(i);
            let t = Instant::now();
            let (status, v) = self.call(reqwest::Method::GET, &p, None).await;
            out.push(t.elapsed());
            assert_eq!(status, 200, "GET {p}: {v}");
        }
        out
    }
}

fn pct(sorted: &[Duration], p: f64) -> f64 {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1].as_secs_f64() * 1000.0
}

fn row(what: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "| {what} | {} | {:.2} ms | {:.2} ms | {:.2} ms |",
        samples.len(),
        pct(&samples, 50.0),
        pct(&samples, 95.0),
        pct(&samples, 99.0)
    );
}

/// Sandboxes kept running (the host admits 8 vCPUs per core: 2 cores hold 16, and the load's creates need 4).
const RUNNING: usize = 8;

/// Brings the daemon to `total` sandboxes: [`RUNNING`] running (listed in `running`), the rest paused.
async fn populate(f: &fake::Fixture, ids: &mut Vec<String>, running: &mut Vec<String>, total: usize) {
    while ids.len() < total {
        let sbx = f.svc.create(fake::create_req(3600)).await.expect("create");
        if running.len() < RUNNING {
            running.push(sbx.id.clone());
        } else {
            f.svc.pause(&sbx.id).await.expect("pause");
        }
        ids.push(sbx.id);
    }
}

/// Starts the load: creators (create, one command, destroy) and command runners on the running sandboxes.
fn load(
    how: Load,
    b: &Arc<Bench>,
    running: &[String],
    stop: &Arc<AtomicBool>,
    done: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (b, stop, done) = (b.clone(), stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut ticker = ticker(how, CREATE_PERIOD);
            while !stop.load(Ordering::Relaxed) {
                pace(&mut ticker).await;
                let (s, v) = b
                    .call(
                        reqwest::Method::POST,
                        "/v1/sandboxes",
                        Some(json!({"template": "minimal"})),
                    )
                    .await;
                assert_eq!(s, 201, "create: {v}");
                let id = v["id"].as_str().unwrap_or_default().to_string();
                b.run_command(&id, &format!("echo {c}")).await;
                let (s, v) = b
                    .call(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
                    .await;
                assert_eq!(s, 204, "destroy: {v}");
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for c in 0..CLIENTS {
        let id = running[c % running.len()].clone();
        let (b, stop, done) = (b.clone(), stop.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let mut ticker = ticker(how, COMMAND_PERIOD);
            while !stop.load(Ordering::Relaxed) {
                pace(&mut ticker).await;
                b.run_command(&id, "echo busy").await;
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    tasks
}

async fn measure(b: &Arc<Bench>, ids: &[String], running: &[String], label: &str, how: Load) {
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let tasks = if how == Load::Idle {
        Vec::new()
    } else {
        load(how, b, running, &stop, &done)
    };
    let started = Instant::now();
    let n = ids.len();
    let page = b
        .time_gets(SAMPLES, |i| {
            // Pages from all over the id space: the cursor is an existing id.
            let mut sorted_pos = (i * 97) % n;
            sorted_pos -= sorted_pos % 100;
            if sorted_pos == 0 {
                "/v1/sandboxes?limit=100".to_string()
            } else {
                format!("/v1/sandboxes?limit=100&cursor={}", ids[sorted_pos])
            }
        })
        .await;
    let get = b
        .time_gets(SAMPLES, |i| format!("/v1/sandboxes/{}", ids[(i * 131) % n]))
        .await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("load task");
    }
    let load_note = match how {
        Load::Idle => ", idle".to_string(),
        Load::FlatOut | Load::Paced => format!(
            ", under {} load ({} creates+commands / commands done, {:.1}/s)",
            if how == Load::Paced { "paced" } else { "flat-out" },
            done.load(Ordering::Relaxed),
            done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64()
        ),
    };
    row(&format!("list a page of 100, {label}{load_note}"), page);
    row(&format!("get one sandbox, {label}{load_note}"), get);
}

#[tokio::main]
async fn main() {
    let f = fake::fixture(usize::MAX / 2);
    let db = hearthd::db::Db::open(&f.svc.settings().paths.db()).expect("db");
    let key_file = f.svc.settings().paths.api_key();
    let keys = hearthd::auth::ensure_key(&db, &key_file, 0).expect("key");
    let key = std::fs::read_to_string(&key_file)
        .expect("key file")
        .trim()
        .to_string();
    let settings = hearthd::tenancy::TenancySettings {
        key_rate_limit: RATE_LIMIT,
        ..Default::default()
    };
    let tenancy = hearthd::tenancy::Tenancy::new(f.svc.clone(), keys.clone(), settings);
    let state = AppState {
        sandboxes: f.svc.clone(),
        keys,
        metrics: None,
        tenancy,
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        let app = hearthd::app(state).into_make_service_with_connect_info::<std::net::SocketAddr>();
        axum::serve(listener, app).await.expect("serve")
    });
    let b = Arc::new(Bench {
        base: format!("http://{addr}"),
        key,
        http: reqwest::Client::new(),
    });
    println!("| measurement | n | p50 | p95 | p99 |");
    println!("|---|---:|---:|---:|---:|");
    let (mut ids, mut running) = (Vec::new(), Vec::new());
    for total in [100, 1000] {
        populate(&f, &mut ids, &mut running, total).await;
        ids.sort();
        let label = format!("{total} sandboxes ({} paused)", total - running.len());
        for how in [Load::Idle, Load::FlatOut, Load::Paced] {
            measure(&b, &ids, &running, &label, how).await;
        }
    }
    flood(&b, &ids).await;
}

/// Requests per second per key (`--key-rate-limit`); the bootstrap key above is not limited.
const RATE_LIMIT: u32 = 50;

/// A member key of a new project.
async fn member_key(b: &Bench, project: &str) -> String {
    let (s, v) = b
        .call(
            reqwest::Method::POST,
            "/v1/projects",
            Some(json!({"name": project})),
        )
        .await;
    assert_eq!(s, 201, "project: {v}");
    let body = json!({"project": project, "role": "member"});
    let (s, v) = b.call(reqwest::Method::POST, "/v1/keys", Some(body)).await;
    assert_eq!(s, 201, "key: {v}");
    v["key"].as_str().unwrap_or_default().to_string()
}

/// One key floods the API while another key's requests are timed, beside the same requests without the flood.
async fn flood(admin: &Arc<Bench>, ids: &[String]) {
    let as_key = |key: String| {
        Arc::new(Bench {
            base: admin.base.clone(),
            key,
            http: reqwest::Client::new(),
        })
    };
    let quiet = as_key(member_key(admin, "quiet").await);
    let noisy = as_key(member_key(admin, "noisy").await);
    // The quiet key's own project has no sandboxes: it lists an empty page, under its own rate limit.
    let paced = |b: Arc<Bench>| async move {
        let mut out = Vec::with_capacity(200);
        for _ in 0..200 {
            let t = Instant::now();
            let (s, v) = b.call(reqwest::Method::GET, "/v1/sandboxes?limit=10", None).await;
            out.push(t.elapsed());
            assert_eq!(s, 200, "quiet key: {v}");
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        out
    };
    row(
        &format!("second key: list a page ({RATE_LIMIT} req/s limit), no flood"),
        paced(quiet.clone()).await,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let (sent, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for i in 0..8 {
        let (b, stop, sent, refused) = (noisy.clone(), stop.clone(), sent.clone(), refused.clone());
        let id = ids[i % ids.len()].clone();
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let (s, _) = b
                    .call(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
                    .await;
                sent.fetch_add(1, Ordering::Relaxed);
                if s == 429 {
                    refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    let started = Instant::now();
    let samples = paced(quiet).await;
    let secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("flood task");
    }
    let (n, r) = (sent.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
    row(
        &format!(
            "second key: list a page, while a first key floods ({:.0} req/s, {:.0}% answered 429)",
            n as f64 / secs,
            100.0 * r as f64 / n.max(1) as f64
        ),
        samples,
    );
}
