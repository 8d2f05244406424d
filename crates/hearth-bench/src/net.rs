//! The network rows: a sandbox on the bench's fake internet ([`crate::fakenet`]) measures, from inside the
//! guest (python3), TCP throughput and connection set-up direct and through the egress proxy, alternating in
//! one process so that both paths see the same machine load; then how long a runtime policy change takes to
//! reach the guest.
//!
//! The sandbox's policy is `default: deny, allow: [a.test, 203.0.113.10/32]`: the domain rule makes the daemon
//! send the guest's TCP to ports 80/443 through its proxy (which reads the Host header, resolves `a.test` itself
//! and checks the address), while the CIDR rule lets port 8080 of the same host through the plain forwarding
//! path, which the proxy never sees.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hearth_api::{CreateSandboxRequest, EgressDefault, EgressPolicy, NetworkPolicy, RunCommandRequest};
use hearth_client::Client;
use serde_json::Value;

use crate::fakenet::{FakeNet, HOST_A, HOST_B};
use crate::stats::{Row, Samples};

/// What the guest runs. `python3 netbench.py MODE ARGS...` prints one JSON object.
/// - `transfer IP N ROUNDS`: per round, upload N bytes direct (IP:8080) then through the proxy (IP:80, Host
///   a.test), then download N bytes the same two ways; seconds from before connect to the last byte.
/// - `connect IP BATCHES PER`: batches of PER connections, alternating direct and proxy: per batch, the mean
///   seconds until connect() returned, and until the first byte of the answer to a small GET came back.
/// - `resolve NAME BATCHES PER`: per batch, the mean seconds per lookup through the platform resolver.
/// - `clock`: the guest's clocksource (`jiffies` ticks in 4 ms steps: single short samples would be useless,
///   hence the batch means above).
/// - `poll tcp|http IP PORT`: forever: a fresh connection attempt every ~5 ms, each closed after 100 ms; with
///   `http`, a request for `b.test` is sent once connected.
const SCRIPT: &str = r#"
import json, socket, sys, time
now = time.perf_counter
HEAD = "Host: a.test\r\nConnection: close\r\n"

def read_all(s, buf):
    got = 0
    while True:
        k = s.recv_into(buf)
        if not k:
            return got
        got += k

def upload(ip, port, n):
    chunk = memoryview(bytes(1 << 20))
    t = now()
    s = socket.create_connection((ip, port), timeout=120)
    s.sendall(("POST /sink HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n" % (HEAD, n)).encode())
    left = n
    while left > 0:
        k = min(left, len(chunk))
        s.sendall(chunk[:k])
        left -= k
    resp = s.recv(4096)
    while resp.count(b"\n") < 5:
        more = s.recv(4096)
        if not more:
            break
        resp += more
    dt = now() - t
    s.close()
    if ("received %d" % n).encode() not in resp:
        raise RuntimeError("upload to port %d: %r" % (port, resp[:200]))
    return dt

def download(ip, port, n):
    buf = bytearray(1 << 20)
    t = now()
    s = socket.create_connection((ip, port), timeout=120)
    s.sendall(("GET /bytes/%d HTTP/1.1\r\n%s\r\n" % (n, HEAD)).encode())
    got = read_all(s, buf)
    dt = now() - t
    s.close()
    if got < n:
        raise RuntimeError("download from port %d: %d of %d bytes" % (port, got, n))
    return dt

def ping(ip, port):
    buf = bytearray(4096)
    t = now()
    s = socket.create_connection((ip, port), timeout=30)
    tc = now()
    s.sendall(("GET / HTTP/1.1\r\n%s\r\n" % HEAD).encode())
    if not s.recv(1):
        raise RuntimeError("no answer on port %d" % port)
    tf = now()
    read_all(s, buf)
    s.close()
    return tc - t, tf - t

mode = sys.argv[1]
out = {}
if mode == "transfer":
    ip, n, rounds = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    for k in ("up_direct", "up_proxy", "down_direct", "down_proxy"):
        out[k] = []
    for _ in range(rounds):
        out["up_direct"].append(upload(ip, 8080, n))
        out["up_proxy"].append(upload(ip, 80, n))
        out["down_direct"].append(download(ip, 8080, n))
        out["down_proxy"].append(download(ip, 80, n))
elif mode == "connect":
    # Means per connection over batches (the guest clock may tick in jiffies, so single samples are not used).
    ip, batches, per = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    for k in ("connect_direct", "connect_proxy", "first_byte_direct", "first_byte_proxy"):
        out[k] = []
    for b in range(batches):
        for port, name in ((8080, "direct"), (80, "proxy")) if b % 2 == 0 else ((80, "proxy"), (8080, "direct")):
            c = f = 0.0
            for _ in range(per):
                dc, df = ping(ip, port)
                c += dc
                f += df
            out["connect_" + name].append(c / per)
            out["first_byte_" + name].append(f / per)
elif mode == "resolve":
    name, batches, per = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    out["addr"] = socket.gethostbyname(name)
    out["lookup"] = []
    for _ in range(batches):
        t = now()
        for _ in range(per):
            socket.gethostbyname(name)
        out["lookup"].append((now() - t) / per)
elif mode == "clock":
    with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as f:
        out["clocksource"] = f.read().strip()
elif mode == "poll":
    # A fresh non-blocking attempt every ~5 ms; each is closed 100 ms after it started. "http" sends a request
    # for b.test once connected (through the proxy, connect() completes at the gateway whatever the policy).
    import selectors
    kind, ip, port = sys.argv[2], sys.argv[3], int(sys.argv[4])
    req = b"GET / HTTP/1.1\r\nHost: b.test\r\nConnection: close\r\n\r\n"
    sel = selectors.DefaultSelector()
    live = []
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex((ip, port))
        sel.register(s, selectors.EVENT_WRITE)
        live.append((now(), s))
        for key, _ in sel.select(timeout=0.005):
            sel.unregister(key.fileobj)
            if kind == "http":
                try:
                    key.fileobj.send(req)
                except OSError:
                    pass
        t = now()
        while live and t - live[0][0] > 0.1:
            old = live.pop(0)[1]
            try:
                sel.unregister(old)
            except (KeyError, ValueError):
                pass
            old.close()
print(json.dumps(out))
"#;

const SCRIPT_PATH: &str = "/root/netbench.py";

/// Knobs of the network rows.
pub struct NetArgs {
    pub template: String,
    pub memory_mib: u32,
    /// Bytes per transfer.
    pub bytes: u64,
    /// Transfers per path and direction.
    pub rounds: usize,
    /// Batches of connections (and of DNS lookups) per path.
    pub connect_batches: usize,
    /// Connections (lookups) per batch.
    pub connects_per_batch: usize,
    /// Allow/deny cycles of the policy-change measurement.
    pub policy_cycles: usize,
}

/// The sandbox's policy, with one more allow rule.
fn policy(extra: Option<&str>) -> NetworkPolicy {
    let mut allow = vec!["a.test".to_owned(), format!("{HOST_A}/32")];
    allow.extend(extra.map(str::to_owned));
    NetworkPolicy {
        egress: EgressPolicy {
            default: EgressDefault::Deny,
            allow,
            deny: vec![],
        },
    }
}

async fn guest_json(client: &Client, id: &str, args: &[String]) -> Result<Value> {
    let mut argv = vec!["python3".to_owned(), SCRIPT_PATH.to_owned()];
    argv.extend_from_slice(args);
    let res = client
        .run_command(
            id,
            &RunCommandRequest {
                argv: Some(argv),
                timeout_s: Some(600),
                ..Default::default()
            },
        )
        .await
        .with_context(|| format!("guest {args:?}"))?;
    if res.exit_code != 0 {
        bail!("guest {args:?} exited {}: {}", res.exit_code, res.stderr.trim());
    }
    serde_json::from_str(res.stdout.trim()).with_context(|| format!("guest output {:?}", res.stdout))
}

/// The samples (seconds) under `key` of the guest's output.
fn samples(v: &Value, key: &str) -> Result<Samples> {
    let mut s = Samples::default();
    for x in v[key].as_array().with_context(|| format!("{key} missing"))? {
        s.push(Duration::from_secs_f64(x.as_f64().context("a number")?));
    }
    Ok(s)
}

/// MB/s (10^6 bytes) at the median time of `s`.
fn mbps(bytes: u64, s: &Samples) -> f64 {
    bytes as f64 / 1e6 / s.p50().as_secs_f64().max(1e-9)
}

fn throughput_row(name: &str, bytes: u64, s: &Samples) -> Row {
    let best = s.percentile(0.0);
    Row::value_with(
        name,
        s.len(),
        format!("{:.1} MB/s", mbps(bytes, s)),
        format!(
            "best {:.1} MB/s",
            bytes as f64 / 1e6 / best.as_secs_f64().max(1e-9)
        ),
    )
}

/// Creates the sandbox, measures, deletes it.
pub async fn rows(client: &Client, fake: &FakeNet, args: &NetArgs) -> Result<Vec<Row>> {
    let sbx = client
        .create_sandbox(&CreateSandboxRequest {
            template: Some(args.template.clone()),
            vcpus: Some(1),
            memory_mib: Some(args.memory_mib),
            timeout_s: Some(1800),
            metadata: [("bench".to_owned(), "hearth-bench".to_owned())].into(),
            network: Some(policy(None)),
            ..Default::default()
        })
        .await
        .context("create the network sandbox")?;
    let result = measure(client, fake, &sbx.id, args).await;
    let _ = client.delete_sandbox(&sbx.id).await;
    result
}

async fn measure(client: &Client, fake: &FakeNet, id: &str, args: &NetArgs) -> Result<Vec<Row>> {
    client
        .write_file(id, SCRIPT_PATH, SCRIPT.as_bytes().to_vec())
        .await
        .context("upload the guest script")?;

    // Name lookups through the platform resolver (which asks the fake internet's DNS).
    let v = guest_json(client, id, &["clock".into()]).await?;
    let clocksource = v["clocksource"].as_str().unwrap_or("?").to_owned();
    let per = args.connects_per_batch.to_string();
    let batches = args.connect_batches.to_string();
    let v = guest_json(
        client,
        id,
        &["resolve".into(), "a.test".into(), batches.clone(), per.clone()],
    )
    .await?;
    if v["addr"].as_str() != Some(HOST_A.to_string().as_str()) {
        bail!("a.test resolved to {} in the guest", v["addr"]);
    }
    let lookup = samples(&v, "lookup")?;
    let ip = HOST_A.to_string();

    let v = guest_json(
        client,
        id,
        &[
            "transfer".into(),
            ip.clone(),
            args.bytes.to_string(),
            args.rounds.to_string(),
        ],
    )
    .await?;
    let (up_d, up_p) = (samples(&v, "up_direct")?, samples(&v, "up_proxy")?);
    let (down_d, down_p) = (samples(&v, "down_direct")?, samples(&v, "down_proxy")?);

    let v = guest_json(client, id, &["connect".into(), ip, batches, per]).await?;
    let (conn_d, conn_p) = (samples(&v, "connect_direct")?, samples(&v, "connect_proxy")?);
    let (first_d, first_p) = (
        samples(&v, "first_byte_direct")?,
        samples(&v, "first_byte_proxy")?,
    );

    let cidr = policy_change(client, fake, id, args.policy_cycles, Path::Cidr).await?;
    let domain = policy_change(client, fake, id, args.policy_cycles, Path::Domain).await?;

    let mib = args.bytes as f64 / 1048576.0;
    let each = format!("mean of {} per sample", args.connects_per_batch);
    let mut rows = vec![
        Row::value("guest clocksource", clocksource),
        Row::samples(
            &format!("DNS lookup in the guest via the platform resolver (`a.test`, {each})"),
            &lookup,
        ),
        throughput_row(
            &format!("upload {mib:.0} MiB guest -> test host, direct (:8080)"),
            args.bytes,
            &up_d,
        ),
        throughput_row(
            &format!("upload {mib:.0} MiB guest -> test host, through the proxy (:80)"),
            args.bytes,
            &up_p,
        ),
        Row::ratio(
            "upload throughput proxy / direct (p50, same run)",
            mbps(args.bytes, &up_p) / mbps(args.bytes, &up_d).max(1e-9),
        ),
        throughput_row(
            &format!("download {mib:.0} MiB test host -> guest, direct (:8080)"),
            args.bytes,
            &down_d,
        ),
        throughput_row(
            &format!("download {mib:.0} MiB test host -> guest, through the proxy (:80)"),
            args.bytes,
            &down_p,
        ),
        Row::ratio(
            "download throughput proxy / direct (p50, same run)",
            mbps(args.bytes, &down_p) / mbps(args.bytes, &down_d).max(1e-9),
        ),
        Row::samples(&format!("connect() returns, direct ({each})"), &conn_d),
        Row::samples(&format!("connect() returns, through the proxy ({each})"), &conn_p),
        Row::samples(
            &format!("connect + small GET -> first answer byte, direct ({each})"),
            &first_d,
        ),
        Row::samples(
            &format!("connect + small GET -> first answer byte, through the proxy ({each})"),
            &first_p,
        ),
        Row::ratio(
            "connection set-up to first byte, proxy / direct (p50, same run)",
            first_p.p50().as_secs_f64() / first_d.p50().as_secs_f64().max(1e-9),
        ),
    ];
    rows.extend(cidr);
    rows.extend(domain);
    Ok(rows)
}

/// Which enforcement path a policy change goes through.
#[derive(Clone, Copy)]
enum Path {
    /// `198.51.100.20/32` allowed and denied again; the guest polls `b.test:8080` (nftables, no proxy).
    Cidr,
    /// `b.test` allowed and denied again; the guest polls `b.test:80` with a request naming it (the proxy).
    Domain,
}

/// A guest loop starts a fresh connection attempt to `b.test` every ~5 ms (each given up after 100 ms: a denied
/// SYN is dropped, and through the proxy a denied request is never forwarded). Per cycle: with `b.test` denied
/// and nothing arriving there for a second, PATCH the policy to allow it, and take the time from sending the
/// PATCH until `b.test` accepts the first connection (the bench's clock on both ends); after 0.5 s, PATCH it
/// denied again and take the time until the last connection arrives.
async fn policy_change(
    client: &Client,
    fake: &FakeNet,
    id: &str,
    cycles: usize,
    path: Path,
) -> Result<Vec<Row>> {
    let (kind, port, rule, accepts, what) = match path {
        Path::Cidr => (
            "tcp",
            8080,
            format!("{HOST_B}/32"),
            &fake.b_accepts,
            "CIDR rule, direct",
        ),
        Path::Domain => (
            "http",
            80,
            "b.test".to_owned(),
            &fake.b_http_accepts,
            "domain rule, proxy",
        ),
    };
    let pid = client
        .start_background(
            id,
            &RunCommandRequest {
                argv: Some(vec![
                    "python3".into(),
                    SCRIPT_PATH.into(),
                    "poll".into(),
                    kind.into(),
                    HOST_B.to_string(),
                    port.to_string(),
                ]),
                ..Default::default()
            },
        )
        .await
        .context("start the guest's poll loop")?;
    let result = policy_cycles(client, id, cycles, &rule, accepts).await;
    let _ = client.kill_process(id, pid, Some(9)).await;
    let (allow, deny) = result?;
    Ok(vec![
        Row::samples(
            &format!("policy change ({what}): PATCH allowing a denied destination, API latency"),
            &allow.0,
        ),
        Row::samples(
            &format!(
                "policy change ({what}): PATCH sent -> first guest connection accepted by the newly allowed host"
            ),
            &allow.1,
        ),
        Row::samples(
            &format!("policy change ({what}): PATCH denying it again, API latency"),
            &deny.0,
        ),
        Row::samples(
            &format!("policy change ({what}): PATCH sent -> last guest connection accepted after denying"),
            &deny.1,
        ),
    ])
}

/// ((PATCH latency, time to effect) when allowing, the same when denying).
type Cycles = ((Samples, Samples), (Samples, Samples));

async fn policy_cycles(
    client: &Client,
    id: &str,
    cycles: usize,
    rule: &str,
    accepts: &Mutex<Vec<Instant>>,
) -> Result<Cycles> {
    let accepts_since = |t: Instant| -> Vec<Instant> {
        let at = accepts.lock().unwrap_or_else(|e| e.into_inner());
        at.iter().copied().filter(|a| *a >= t).collect()
    };
    let mut patch_allow = Samples::default();
    let mut effect_allow = Samples::default();
    let mut patch_deny = Samples::default();
    let mut effect_deny = Samples::default();
    // Give the loop time to start (python3 under emulation) while b.test is still denied.
    let start = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    if !accepts_since(start).is_empty() {
        bail!("b.test accepted a connection while the policy denied it");
    }
    for _ in 0..cycles {
        // Quiet: nothing has arrived for a second.
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let since = Instant::now() - Duration::from_secs(1);
            if accepts_since(since).is_empty() {
                break;
            }
            if Instant::now() > deadline {
                bail!("connections to b.test went on after it was denied");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        let t0 = Instant::now();
        client
            .set_network_policy(id, &policy(Some(rule)))
            .await
            .context("PATCH allow")?;
        patch_allow.push(t0.elapsed());
        let deadline = t0 + Duration::from_secs(20);
        let first = loop {
            if let Some(a) = accepts_since(t0).first() {
                break *a;
            }
            if Instant::now() > deadline {
                bail!("no connection reached b.test within 20 s of allowing it");
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        effect_allow.push(first - t0);
        // Let connections through for a while, then deny again.
        tokio::time::sleep(Duration::from_millis(500)).await;
        if accepts_since(first).len() < 2 {
            bail!("the guest's loop is not reaching b.test while it is allowed");
        }

        let t1 = Instant::now();
        client
            .set_network_policy(id, &policy(None))
            .await
            .context("PATCH deny")?;
        patch_deny.push(t1.elapsed());
        tokio::time::sleep(Duration::from_secs(2)).await;
        let last = accepts_since(t1).last().copied().unwrap_or(t1);
        effect_deny.push(last - t1);
    }
    Ok(((patch_allow, effect_allow), (patch_deny, effect_deny)))
}
