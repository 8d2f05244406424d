//! The daemon's per-sandbox network services (platform resolver over UDP and TCP, egress proxy) started the way
//! hearthd starts them, in sandboxes of the fake internet of `plane_fixture` (real namespaces, real nftables
//! with the proxy redirect), with a recording upstream DNS server and a keep-alive HTTP test host on it. Guests
//! are the sandboxes' guest namespaces. Needs root.
//!
//! The test host on [`HOST_A`]:80 answers every HTTP/1 request on a connection (it keeps connections open)
//! with `200` and `<label> host=<Host> path=<target> body=<body bytes>`, reading `Content-Length` and chunked
//! bodies with its own small parser; it records every request it read. `Upgrade: websocket` on a target other
//! than `/no-upgrade` gets `101`, after which it echoes bytes.

#![allow(dead_code, clippy::unwrap_used)]

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_net::ctx::SandboxNetCtx;
use hearth_net::dns::Upstream;
use hearth_net::limits::NetLimits;
use hearth_net::policy::Policy;
use hearth_net::proxy::{Proxy, ProxyLimits};
use hearth_net::{GATEWAY, PROXY_PORT};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

use crate::plane_fixture::{FakeNet, HOST_A, HOST_B, Sandbox, ip_batch};
use crate::proxy_support::TestDns;

/// The fake internet's DNS server.
pub const DNS: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 53);
/// `allowed.test` is HOST_A, `other.test` HOST_B.
pub const ZONE: &[(&str, &[&str])] = &[
    ("allowed.test", &["203.0.113.10"]),
    ("other.test", &["198.51.100.20"]),
];

/// One request as the test host read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub host: String,
    pub path: String,
    pub body: Vec<u8>,
}

/// A fake internet with a DNS server and the keep-alive test host, and the upstream client of the daemon.
pub struct Stack {
    pub net: FakeNet,
    pub dns: TestDns,
    pub upstream: Arc<Upstream>,
    pub seen: Arc<Mutex<Vec<Seen>>>,
    pub host_connections: Arc<AtomicUsize>,
    host: JoinHandle<()>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        self.host.abort();
    }
}

impl Stack {
    /// `n` picks the sandbox range (see [`FakeNet::new`]). Must be called inside a Tokio runtime.
    pub fn new(n: u8) -> Stack {
        let net = FakeNet::new(n);
        ip_batch(&net.inet.name, &format!("addr add {DNS}/32 dev lo\n"));
        let dns = TestDns::start_in(&net.inet.path, SocketAddr::from((DNS, 53)), ZONE);
        let upstream = Arc::new(Upstream::new(dns.addr, net.up.path.clone()));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let host_connections = Arc::new(AtomicUsize::new(0));
        let host = keepalive_host(
            &net.inet.path,
            SocketAddr::from((HOST_A, 80)),
            "ten",
            seen.clone(),
            host_connections.clone(),
        );
        Stack {
            net,
            dns,
            upstream,
            seen,
            host_connections,
            host,
        }
    }

    /// A sandbox whose kernel rules deny everything but what the proxy and the resolver carry (TCP 80/443 is
    /// redirected to the proxy), with the daemon's services for `policy` and `limits` running.
    pub fn sandbox(
        &self,
        i: u8,
        policy: Policy,
        limits: NetLimits,
        proxy: ProxyLimits,
    ) -> (Sandbox, Services) {
        let sb = self.net.with(i, |s| {
            s.default_allow = false;
            s.proxy_tcp = true;
        });
        let ctx = Arc::new(SandboxNetCtx::new(sb.net.id.clone(), policy, vec![]).with_limits(limits));
        let services = Services::start(&sb.ns(), ctx, self.upstream.clone(), &self.net.up.path, proxy);
        (sb, services)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// A sandbox's resolver (UDP, TCP) and proxy, stopped on drop.
pub struct Services {
    pub ctx: Arc<SandboxNetCtx>,
    tasks: Vec<JoinHandle<()>>,
}

impl Services {
    pub fn start(
        ns: &Path,
        ctx: Arc<SandboxNetCtx>,
        upstream: Arc<Upstream>,
        uplink: &Path,
        limits: ProxyLimits,
    ) -> Services {
        let gw = SocketAddr::from((GATEWAY, 53));
        let udp = hearth_net::netns::udp_socket(ns, gw).unwrap();
        let tcp = hearth_net::netns::tcp_listener(ns, gw).unwrap();
        let proxy_listener =
            hearth_net::netns::tcp_listener(ns, SocketAddr::from((GATEWAY, PROXY_PORT))).unwrap();
        let proxy = Arc::new(Proxy::new(
            ctx.clone(),
            upstream.clone(),
            uplink.to_path_buf(),
            limits,
        ));
        let tasks = vec![
            hearth_net::dns::spawn_resolver(udp, ctx.clone(), upstream.clone()),
            hearth_net::dns::spawn_tcp_resolver(tcp, ctx.clone(), upstream),
            tokio::spawn(proxy.serve(proxy_listener)),
        ];
        Services { ctx, tasks }
    }
}

impl Drop for Services {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Opens a TCP connection from the guest namespace at `guest` (the plane redirects 80/443 to the proxy).
pub async fn connect(guest: &Path, to: SocketAddr) -> TcpStream {
    try_connect(guest, to).await.expect("connect")
}

/// The same, for a connection that may be reset as soon as it is made (over a limit).
pub async fn try_connect(guest: &Path, to: SocketAddr) -> std::io::Result<TcpStream> {
    tokio::time::timeout(Duration::from_secs(5), hearth_net::netns::connect_tcp(guest, to))
        .await
        .expect("connect in time")
}

/// An HTTP/1 client over one connection: writes raw requests, reads `Content-Length` responses.
pub struct Client {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl Client {
    pub fn new(stream: TcpStream) -> Client {
        Client {
            stream,
            buf: Vec::new(),
        }
    }

    pub async fn send(&mut self, raw: &str) {
        self.stream.write_all(raw.as_bytes()).await.unwrap();
    }

    /// The next response's status and body; `None` if the connection ends first (or nothing comes in 10 s).
    pub async fn response(&mut self) -> Option<(u16, String)> {
        let end = loop {
            if let Some(end) = find(&self.buf, b"\r\n\r\n") {
                break end + 4;
            }
            self.fill().await?;
        };
        let head = String::from_utf8_lossy(&self.buf[..end]).to_string();
        let status: u16 = head.get(9..12)?.parse().ok()?;
        let len: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())?
            })
            .unwrap_or(0);
        while self.buf.len() < end + len {
            self.fill().await?;
        }
        let body = String::from_utf8_lossy(&self.buf[end..end + len]).to_string();
        self.buf.drain(..end + len);
        Some((status, body))
    }

    /// Reads exactly `n` bytes (after any buffered ones).
    pub async fn bytes(&mut self, n: usize) -> Option<Vec<u8>> {
        while self.buf.len() < n {
            self.fill().await?;
        }
        Some(self.buf.drain(..n).collect())
    }

    /// Whether the connection ends (EOF or reset) with nothing more to read.
    pub async fn closed(&mut self) -> bool {
        self.buf.is_empty() && self.fill().await.is_none()
    }

    async fn fill(&mut self) -> Option<()> {
        let mut chunk = [0u8; 4096];
        match tokio::time::timeout(Duration::from_secs(10), self.stream.read(&mut chunk)).await {
            Ok(Ok(n)) if n > 0 => {
                self.buf.extend_from_slice(&chunk[..n]);
                Some(())
            }
            _ => None,
        }
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// The keep-alive test host (see the module doc).
fn keepalive_host(
    ns: &Path,
    addr: SocketAddr,
    label: &'static str,
    seen: Arc<Mutex<Vec<Seen>>>,
    connections: Arc<AtomicUsize>,
) -> JoinHandle<()> {
    let listener = hearth_net::netns::tcp_listener(ns, addr).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                continue;
            };
            connections.fetch_add(1, Ordering::SeqCst);
            let seen = seen.clone();
            tokio::spawn(async move {
                let _ = serve_keepalive(s, label, &seen).await;
            });
        }
    })
}

async fn serve_keepalive(s: TcpStream, label: &str, seen: &Mutex<Vec<Seen>>) -> Option<()> {
    let mut c = Client::new(s);
    loop {
        let end = loop {
            if let Some(end) = find(&c.buf, b"\r\n\r\n") {
                break end + 4;
            }
            c.fill().await?;
        };
        let head = String::from_utf8_lossy(&c.buf[..end]).to_string();
        c.buf.drain(..end);
        let path = head.split(' ').nth(1).unwrap_or("").to_string();
        let field = |name: &str| {
            head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_string())
            })
        };
        let host = field("host").unwrap_or_default();
        let body = if field("transfer-encoding").is_some() {
            chunked_body(&mut c).await?
        } else {
            let len: usize = field("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
            c.bytes(len).await?
        };
        seen.lock().unwrap().push(Seen {
            host: host.clone(),
            path: path.clone(),
            body: body.clone(),
        });
        if field("upgrade").is_some() && path != "/no-upgrade" {
            c.stream
                .write_all(
                    b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
                )
                .await
                .ok()?;
            let mut rest = std::mem::take(&mut c.buf);
            loop {
                if !rest.is_empty() {
                    c.stream.write_all(&rest).await.ok()?;
                }
                let mut chunk = [0u8; 4096];
                let n = c.stream.read(&mut chunk).await.ok()?;
                if n == 0 {
                    return Some(());
                }
                rest = chunk[..n].to_vec();
            }
        }
        let text = format!("{label} host={host} path={path} body={}", body.len());
        let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{text}", text.len());
        c.stream.write_all(resp.as_bytes()).await.ok()?;
    }
}

/// Reads a chunked body (sizes, data, trailers) and returns its data.
async fn chunked_body(c: &mut Client) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let end = loop {
            if let Some(end) = find(&c.buf, b"\r\n") {
                break end;
            }
            c.fill().await?;
        };
        let line = String::from_utf8_lossy(&c.buf[..end]).to_string();
        c.buf.drain(..end + 2);
        let size = usize::from_str_radix(line.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            // Trailers up to an empty line.
            loop {
                let end = loop {
                    if let Some(end) = find(&c.buf, b"\r\n") {
                        break end;
                    }
                    c.fill().await?;
                };
                c.buf.drain(..end + 2);
                if end == 0 {
                    return Some(body);
                }
            }
        }
        body.extend(c.bytes(size).await?);
        c.bytes(2).await?;
    }
}

/// The address a guest dials for `allowed.test`-style requests: HOST_B (the proxy goes where the name says).
pub fn web() -> SocketAddr {
    SocketAddr::from((HOST_B, 80))
}
