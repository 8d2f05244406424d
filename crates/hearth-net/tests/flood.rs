//! One guest cannot exhaust the daemon's descriptors through its proxy and DNS-over-TCP connections: per-sandbox
//! bounds, a budget shared by all sandboxes, resets that leave nothing behind, idle timeouts. Guests are the
//! guest namespaces of the fake internet's sandboxes (`stack_support`); their connections go through the real
//! nftables redirect to the daemon's real services in this process. Needs root. The daemon-side descriptor
//! counts read `/proc/self/fd` of this process, so run these tests one per process (nextest does).

#![allow(clippy::unwrap_used)]

mod plane_fixture;
mod proxy_support;
mod stack_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hearth_api::{EgressDefault, EgressPolicy};
use hearth_net::limits::{ConnBudget, NetLimits};
use hearth_net::policy::Policy;
use hearth_net::proxy::ProxyLimits;
use hearth_net::{GATEWAY, PROXY_PORT};
use stack_support::{Client, Stack, connect, try_connect, web};

fn allowed_only() -> Policy {
    Policy::parse(&EgressPolicy {
        default: EgressDefault::Deny,
        allow: vec!["allowed.test".into()],
        deny: vec![],
    })
    .unwrap()
}

/// Descriptors this process holds.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// The guest side holds one socket per connection: let this process hold them all.
fn raise_nofile(want: u64) {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    let hard = hard.max(want);
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
        .unwrap_or_else(|e| panic!("this test needs {want} descriptors (run as root): {e}"));
}

/// One HTTP request from the neighbour's guest through its proxy: its latency, or why it failed.
async fn neighbour_request(guest: &std::path::Path) -> Result<Duration, String> {
    let started = Instant::now();
    let attempt = async {
        let mut c = Client::new(connect(guest, web()).await);
        c.send("GET /n HTTP/1.1\r\nHost: allowed.test\r\n\r\n").await;
        c.response().await
    };
    match tokio::time::timeout(Duration::from_secs(5), attempt).await {
        Ok(Some((200, _))) => Ok(started.elapsed()),
        other => Err(format!("{other:?}")),
    }
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

/// The flood's outcome, counted by the guest.
#[derive(Debug, Default)]
struct Outcome {
    connected: usize,
    failed: usize,
    reset: usize,
    closed: usize,
    open: usize,
}

/// Opens `total` connections from `guest` on `threads` threads and holds them: 9 in 10 to the proxy (half
/// of them sending the start of a request and no more), 1 in 10 to the resolver's TCP port. `held` counts
/// the sockets the flood owns (for the descriptor accounting); `done` turns true at the end.
fn flood(
    guest: PathBuf,
    total: usize,
    threads: usize,
    held: Arc<AtomicUsize>,
    done: Arc<AtomicBool>,
) -> std::thread::JoinHandle<(Vec<TcpStream>, usize)> {
    std::thread::spawn(move || {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (guest, held) = (guest.clone(), held.clone());
                std::thread::spawn(move || {
                    hearth_net::netns::in_netns(&guest, move || {
                        let mut streams = Vec::new();
                        let mut failed = 0;
                        for i in (t..total).step_by(threads) {
                            let to = if i % 10 == 9 {
                                SocketAddr::from((GATEWAY, 53))
                            } else {
                                web()
                            };
                            held.fetch_add(1, Ordering::SeqCst);
                            match TcpStream::connect_timeout(&to, Duration::from_secs(2)) {
                                Ok(mut s) => {
                                    if i % 2 == 0 && to.port() == 80 {
                                        let _ = s.write_all(b"GET / HTTP/1.1\r\nHost: allowed.test\r\n");
                                    }
                                    streams.push(s);
                                }
                                Err(_) => {
                                    held.fetch_sub(1, Ordering::SeqCst);
                                    failed += 1;
                                }
                            }
                        }
                        Ok((streams, failed))
                    })
                    .unwrap()
                })
            })
            .collect();
        let mut all = Vec::new();
        let mut failed = 0;
        for w in workers {
            let (s, f) = w.join().unwrap();
            all.extend(s);
            failed += f;
        }
        done.store(true, Ordering::SeqCst);
        (all, failed)
    })
}

/// What became of the flood's connections (reset, closed or still open).
fn outcome(streams: &[TcpStream], failed: usize) -> Outcome {
    let mut o = Outcome {
        connected: streams.len(),
        failed,
        ..Outcome::default()
    };
    for s in streams {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 512];
        match (&*s).read(&mut b) {
            Ok(0) => o.closed += 1,
            Ok(_) => o.closed += 1,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => o.open += 1,
            Err(_) => o.reset += 1,
        }
    }
    o
}

/// Sockets of the proxy port in TIME_WAIT in the namespace at `ns`.
fn time_wait_on_proxy_port(ns: &std::path::Path) -> usize {
    let table =
        hearth_net::netns::in_netns(ns, || std::fs::read_to_string("/proc/thread-self/net/tcp")).unwrap();
    let port = format!(":{PROXY_PORT:04X}");
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let cols: Vec<&str> = l.split_whitespace().collect();
            cols.get(1).is_some_and(|local| local.ends_with(&port)) && cols.get(3) == Some(&"06")
        })
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_connections_from_one_guest_leave_a_neighbour_served() {
    const FLOOD: usize = 10_000;
    raise_nofile(FLOOD as u64 + 4096);
    let stack = Stack::new(46);
    // Sized for the daemon's usual soft limit (1024), one budget for both sandboxes.
    let limits = NetLimits::for_nofile(1024);
    let (flooder, flooder_svc) = stack.sandbox(2, allowed_only(), limits.clone(), ProxyLimits::default());
    let (neighbour, _neighbour_svc) =
        stack.sandbox(3, allowed_only(), limits.clone(), ProxyLimits::default());
    let g = neighbour.guest.path.clone();

    // The neighbour's usual latency, then the same during the flood, side by side in one run.
    for _ in 0..5 {
        neighbour_request(&g).await.unwrap();
    }
    let mut quiet = Vec::new();
    for _ in 0..200 {
        quiet.push(neighbour_request(&g).await.unwrap());
    }
    let fds_before = open_fds();
    let held = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let flooding = flood(flooder.guest.path.clone(), FLOOD, 4, held.clone(), done.clone());
    let mut during = Vec::new();
    let mut daemon_fds_max = 0usize;
    let mut budget_used_max = 0usize;
    while !done.load(Ordering::SeqCst) || during.len() < 200 {
        let latency = neighbour_request(&g)
            .await
            .unwrap_or_else(|e| panic!("the neighbour's request failed during the flood: {e}"));
        if !done.load(Ordering::SeqCst) {
            during.push(latency);
        } else if during.len() < 200 && started.elapsed() > Duration::from_secs(120) {
            break;
        }
        let daemon_fds = open_fds().saturating_sub(fds_before + held.load(Ordering::SeqCst));
        daemon_fds_max = daemon_fds_max.max(daemon_fds);
        budget_used_max = budget_used_max.max(limits.budget.capacity() - limits.budget.available());
        if done.load(Ordering::SeqCst) && during.len() < 200 {
            // The flood ended before enough samples: count the rest as "after", not "during".
            break;
        }
    }
    let flood_time = started.elapsed();
    let (streams, failed) = flooding.join().unwrap();
    let o = outcome(&streams, failed);

    quiet.sort();
    during.sort();
    // Per sandbox: its proxied connections (two descriptors each) and DNS-over-TCP connections; plus the
    // neighbour's one connection, a few upstream DNS sockets and the descriptors of threads that create
    // sockets in namespaces.
    let bound = 2 * limits.proxy_per_sandbox + limits.dns_tcp_per_sandbox + 32;
    eprintln!(
        "flood: {FLOOD} connections in {:.1} s: {} connected ({} reset by the daemon, {} closed, {} open), {} not \
         connected; daemon-side descriptors at most {daemon_fds_max} (bound {bound}); shared budget used at most \
         {budget_used_max} of {}",
        flood_time.as_secs_f64(),
        o.connected,
        o.reset,
        o.closed,
        o.open,
        o.failed,
        limits.budget.capacity()
    );
    eprintln!(
        "neighbour HTTP through its proxy, ms: quiet p50 {:.2} p99 {:.2} (n={}); during the flood p50 {:.2} p99 {:.2} \
         (n={})",
        percentile(&quiet, 0.5),
        percentile(&quiet, 0.99),
        quiet.len(),
        percentile(&during, 0.5),
        percentile(&during, 0.99),
        during.len()
    );
    assert_eq!(o.connected + o.failed, FLOOD);
    assert!(!during.is_empty(), "no neighbour request ran during the flood");
    assert!(
        daemon_fds_max <= bound,
        "daemon-side descriptors {daemon_fds_max} > {bound}"
    );
    assert!(
        o.reset >= FLOOD / 2,
        "the daemon should have reset most of the flood: {o:?}"
    );
    // Resets leave no TIME_WAIT behind (only connections the proxy served and closed may).
    let tw = time_wait_on_proxy_port(&flooder.ns());
    assert!(tw < 1000, "{tw} proxy sockets in TIME_WAIT");
    // The flooder's refusals are in its log (rate-limited), not the neighbour's.
    assert!(
        flooder_svc
            .ctx
            .audit
            .snapshot()
            .events
            .iter()
            .any(|e| e.reason == "connection_limit")
    );

    // Nothing lasting: once the guest lets go, the daemon's side goes back to where it was.
    drop(streams);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let now = open_fds();
        let used = limits.budget.capacity() - limits.budget.available();
        if now <= fds_before + 8 && used == 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "after the flood: {now} descriptors (before {fds_before}), {used} of the budget in use"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    neighbour_request(&flooder.guest.path).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_budget_caps_every_sandbox_together() {
    let stack = Stack::new(47);
    // Room for five proxied connections in all; four per sandbox.
    let limits = NetLimits {
        proxy_per_sandbox: 4,
        dns_tcp_per_sandbox: 2,
        budget: ConnBudget::new(10),
    };
    let slow = ProxyLimits {
        peek_timeout: Duration::from_secs(60),
        ..ProxyLimits::default()
    };
    let (a, _a_svc) = stack.sandbox(2, allowed_only(), limits.clone(), slow.clone());
    let (b, b_svc) = stack.sandbox(3, allowed_only(), limits.clone(), slow);
    // A connection that says nothing is held (waiting for its first bytes) or reset at once.
    let held = |guest: PathBuf| async move {
        let Ok(s) = try_connect(&guest, web()).await else {
            return (None, false);
        };
        let s = s.into_std().unwrap();
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
        let kept = matches!((&s).read(&mut [0u8; 1]), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        (Some(s), kept)
    };
    let mut a_conns = Vec::new();
    for _ in 0..4 {
        let (s, kept) = held(a.guest.path.clone()).await;
        assert!(kept);
        a_conns.push(s);
    }
    let (_, kept) = held(a.guest.path.clone()).await;
    assert!(!kept, "a fifth connection of one sandbox must be reset");
    let (b1, kept) = held(b.guest.path.clone()).await;
    assert!(kept, "the budget has room for one more connection");
    let (_, kept) = held(b.guest.path.clone()).await;
    assert!(
        !kept,
        "the shared budget is spent: the other sandbox's next connection is reset"
    );
    assert_eq!(limits.budget.available(), 0);
    assert!(
        b_svc
            .ctx
            .audit
            .snapshot()
            .events
            .iter()
            .any(|e| e.reason == "connection_limit")
    );
    drop(a_conns);
    drop(b1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while limits.budget.available() < 10 {
        assert!(Instant::now() < deadline, "the budget did not come back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (_, kept) = held(b.guest.path.clone()).await;
    assert!(kept);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_over_tcp_connections_are_bounded_and_still_answer() {
    let stack = Stack::new(48);
    let limits = NetLimits {
        proxy_per_sandbox: 4,
        dns_tcp_per_sandbox: 2,
        budget: ConnBudget::new(100),
    };
    let (sb, _svc) = stack.sandbox(2, allowed_only(), limits.clone(), ProxyLimits::default());
    let resolver = SocketAddr::from((GATEWAY, 53));
    let mut conns = Vec::new();
    for _ in 0..30 {
        if let Ok(c) = try_connect(&sb.guest.path, resolver).await {
            conns.push(c);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(limits.budget.available(), 98, "two DNS-over-TCP connections held");
    // The held ones still answer (the first two accepted); the rest were reset.
    let query = {
        use hickory_proto::op::{Message, MessageType, OpCode, Query};
        use hickory_proto::rr::{Name, RecordType};
        let mut q = Message::new(7, MessageType::Query, OpCode::Query);
        q.add_query(Query::query(
            Name::from_ascii("allowed.test.").unwrap(),
            RecordType::A,
        ));
        let bytes = q.to_vec().unwrap();
        let mut framed = (bytes.len() as u16).to_be_bytes().to_vec();
        framed.extend(bytes);
        framed
    };
    let mut answered = 0;
    for c in &mut conns {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        if c.write_all(&query).await.is_err() {
            continue;
        }
        let mut len = [0u8; 2];
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut len)).await {
            answered += 1;
        }
    }
    assert_eq!(answered, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_proxied_connections_are_closed() {
    let stack = Stack::new(49);
    let limits = NetLimits::for_nofile(4096);
    let proxy = ProxyLimits {
        idle_timeout: Duration::from_millis(800),
        ..ProxyLimits::default()
    };
    let (sb, _svc) = stack.sandbox(2, allowed_only(), limits.clone(), proxy);
    let mut c = Client::new(connect(&sb.guest.path, web()).await);
    c.send("GET /idle HTTP/1.1\r\nHost: allowed.test\r\n\r\n").await;
    assert_eq!(c.response().await.unwrap().0, 200);
    let held = limits.budget.capacity() - limits.budget.available();
    assert_eq!(held, 2);
    let started = Instant::now();
    assert!(c.closed().await, "the idle connection must be closed");
    assert!(started.elapsed() < Duration::from_secs(5));
    let deadline = Instant::now() + Duration::from_secs(5);
    while limits.budget.available() < limits.budget.capacity() {
        assert!(
            Instant::now() < deadline,
            "the idle connection's descriptors were not returned"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
