//! A fake internet for the daemon's network tests: every packet stays inside namespaces the test made.
//!
//! ```text
//!  sandbox namespaces ── hrth… [uplink ns] inet0 192.0.2.1 ──── 192.0.2.2 up0 [internet ns]
//!                                                                 test hosts on lo:
//!                                                                 203.0.113.10 (a.test)   HTTP :80, TLS :443, TCP :8080, UDP :5353
//!                                                                 198.51.100.20 (b.test)  the same
//!                                                                 203.0.113.53            DNS (records every query)
//!                                                                 169.254.169.254, 10.99.0.1: HTTP :80 (must never be reached)
//! ```
//! The daemon under test gets `--uplink-netns` = the uplink namespace (whose only route leads to the internet
//! namespace) and `--dns-upstream 203.0.113.53:53`, so even a broken policy cannot put a packet on the
//! machine's real network. Everything is removed on drop.

#![allow(dead_code, clippy::unwrap_used)]

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const UPLINK_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
pub const INET_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
pub const HOST_A: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const HOST_B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
pub const DNS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
pub const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
/// An IPv6 test host (documentation range) and a ULA one that must never be reached.
pub const HOST_V6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10);
pub const ULA_V6: std::net::Ipv6Addr = std::net::Ipv6Addr::new(0xfd12, 0x3456, 0, 0, 0, 0, 0, 0x10);
/// The IPv6 link between the uplink and the internet namespaces.
const UPLINK_V6: &str = "2001:db8:ff::1";
const INET_V6: &str = "2001:db8:ff::2";

/// Names the test resolver knows.
pub fn zone(name: &str) -> Option<Ipv4Addr> {
    match name.trim_end_matches('.').to_ascii_lowercase().as_str() {
        "a.test" | "www.a.test" => Some(HOST_A),
        "b.test" => Some(HOST_B),
        "private.test" => Some(PRIVATE),
        "meta.test" => Some(METADATA),
        _ => None,
    }
}

fn unique() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!(
        "{:08x}",
        (nanos as u64 ^ u64::from(std::process::id()).rotate_left(32)) as u32
    )
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

struct Netns {
    name: String,
    path: PathBuf,
}

impl Netns {
    fn new(prefix: &str) -> Netns {
        let name = format!("{prefix}-{}", unique());
        ip(&["netns", "add", &name]);
        ip(&["-n", &name, "link", "set", "lo", "up"]);
        Netns {
            path: PathBuf::from("/run/netns").join(&name),
            name,
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// What the test hosts saw.
#[derive(Clone, Default)]
pub struct Seen {
    /// (server, peer, first line / payload) of each TCP connection or UDP datagram.
    pub conns: Arc<Mutex<Vec<(SocketAddr, SocketAddr, String)>>>,
    /// Names the DNS server was asked for.
    pub queries: Arc<Mutex<Vec<String>>>,
}

impl Seen {
    pub fn queried(&self, name: &str) -> bool {
        self.queries
            .lock()
            .unwrap()
            .iter()
            .any(|q| q.trim_end_matches('.').eq_ignore_ascii_case(name))
    }
    pub fn conns_to_v6(&self, ip: std::net::Ipv6Addr) -> usize {
        self.conns
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, _, _)| l.ip() == IpAddr::V6(ip))
            .count()
    }
    pub fn conns_to(&self, ip: Ipv4Addr) -> usize {
        self.conns
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, _, _)| l.ip() == IpAddr::V4(ip))
            .count()
    }
}

pub struct FakeInternet {
    up: Netns,
    inet: Netns,
    pub seen: Seen,
    _rt: Option<tokio::runtime::Runtime>,
}

impl Drop for FakeInternet {
    fn drop(&mut self) {
        // Dropped inside the test's runtime: the servers' runtime must not block on its way out.
        if let Some(rt) = self._rt.take() {
            rt.shutdown_background();
        }
    }
}

impl FakeInternet {
    pub fn new() -> FakeInternet {
        let up = Netns::new("hxt-dup");
        let inet = Netns::new("hxt-dinet");
        ip(&[
            "-n", &up.name, "link", "add", "inet0", "type", "veth", "peer", "name", "up0", "netns",
            &inet.name,
        ]);
        ip(&[
            "-n",
            &up.name,
            "addr",
            "add",
            &format!("{UPLINK_ADDR}/30"),
            "dev",
            "inet0",
        ]);
        ip(&["-n", &up.name, "link", "set", "inet0", "up"]);
        ip(&[
            "-n",
            &up.name,
            "route",
            "add",
            "default",
            "via",
            &INET_ADDR.to_string(),
        ]);
        ip(&[
            "-n",
            &inet.name,
            "addr",
            "add",
            &format!("{INET_ADDR}/30"),
            "dev",
            "up0",
        ]);
        ip(&["-n", &inet.name, "link", "set", "up0", "up"]);
        for host in [HOST_A, HOST_B, DNS, METADATA, PRIVATE] {
            ip(&[
                "-n",
                &inet.name,
                "addr",
                "add",
                &format!("{host}/32"),
                "dev",
                "lo",
            ]);
        }
        // IPv6: the same shape (no duplicate address detection, so the addresses are usable at once).
        for (ns, dev, addr) in [(&up.name, "inet0", UPLINK_V6), (&inet.name, "up0", INET_V6)] {
            ip(&[
                "-n",
                ns,
                "addr",
                "add",
                &format!("{addr}/64"),
                "dev",
                dev,
                "nodad",
            ]);
        }
        ip(&["-n", &up.name, "-6", "route", "add", "default", "via", INET_V6]);
        for host in [HOST_V6, ULA_V6] {
            ip(&[
                "-n",
                &inet.name,
                "addr",
                "add",
                &format!("{host}/128"),
                "dev",
                "lo",
                "nodad",
            ]);
        }
        ip(&[
            "-n",
            &inet.name,
            "-6",
            "route",
            "add",
            "2001:db8::/40",
            "via",
            UPLINK_V6,
        ]);
        // Replies (and ingress attempts) towards sandbox addresses go back through the uplink.
        ip(&[
            "-n",
            &inet.name,
            "route",
            "add",
            "10.0.0.0/8",
            "via",
            &UPLINK_ADDR.to_string(),
        ]);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let seen = Seen::default();
        let fi = FakeInternet {
            up,
            inet,
            seen,
            _rt: Some(rt),
        };
        fi.start_servers();
        fi
    }

    /// Path of the uplink namespace (for `--uplink-netns`).
    pub fn uplink(&self) -> &std::path::Path {
        &self.up.path
    }

    /// Path of the internet namespace.
    pub fn internet(&self) -> &std::path::Path {
        &self.inet.path
    }

    /// Flags for a daemon whose sandboxes live on this fake internet.
    pub fn daemon_flags(&self, range: &str) -> Vec<String> {
        vec![
            "--network".into(),
            "on".into(),
            "--uplink-netns".into(),
            self.up.path.display().to_string(),
            "--sandbox-net".into(),
            range.into(),
            "--dns-upstream".into(),
            format!("{DNS}:53"),
        ]
    }

    fn start_servers(&self) {
        let ns = self.inet.path.clone();
        let rt = self._rt.as_ref().unwrap();
        let _guard = rt.enter();
        for host in [HOST_V6, ULA_V6] {
            for port in [80u16, 8080] {
                let l = hearth_net::netns::tcp_listener(&ns, SocketAddr::from((host, port))).unwrap();
                let seen = self.seen.clone();
                rt.spawn(serve_text(tokio::net::TcpListener::from_std(l).unwrap(), seen));
            }
        }
        for host in [HOST_A, HOST_B, METADATA, PRIVATE] {
            for port in [80u16, 8080] {
                let l = hearth_net::netns::tcp_listener(&ns, SocketAddr::from((host, port))).unwrap();
                let seen = self.seen.clone();
                rt.spawn(serve_text(tokio::net::TcpListener::from_std(l).unwrap(), seen));
            }
            let l = hearth_net::netns::tcp_listener(&ns, SocketAddr::from((host, 443))).unwrap();
            let seen = self.seen.clone();
            rt.spawn(serve_tls(tokio::net::TcpListener::from_std(l).unwrap(), seen));
            let u = hearth_net::netns::udp_socket(&ns, SocketAddr::from((host, 5353))).unwrap();
            let seen = self.seen.clone();
            rt.spawn(serve_udp_echo(tokio::net::UdpSocket::from_std(u).unwrap(), seen));
        }
        let u = hearth_net::netns::udp_socket(&ns, SocketAddr::from((DNS, 53))).unwrap();
        let seen = self.seen.clone();
        rt.spawn(serve_dns(tokio::net::UdpSocket::from_std(u).unwrap(), seen));
    }

    /// Opens a TCP connection from the internet namespace (an "ingress" attempt); true when it connected.
    pub fn connect_from_internet(&self, to: SocketAddr) -> bool {
        hearth_net::netns::in_netns(&self.inet.path, move || {
            Ok(std::net::TcpStream::connect_timeout(&to, Duration::from_millis(1500)).is_ok())
        })
        .unwrap()
    }

    /// A TCP server on the uplink namespace's own address (the "host"), counting connections.
    pub fn uplink_server(&self, port: u16) -> Arc<Mutex<usize>> {
        let count = Arc::new(Mutex::new(0usize));
        let l =
            hearth_net::netns::tcp_listener(&self.up.path, SocketAddr::from((UPLINK_ADDR, port))).unwrap();
        let c = count.clone();
        std::thread::spawn(move || {
            let _ = l.set_nonblocking(false);
            for s in l.incoming().flatten() {
                *c.lock().unwrap() += 1;
                drop(s);
            }
        });
        count
    }
}

/// Answers each connection with one line: `host=<server address> req=<first request line or host header>`.
async fn serve_text(l: tokio::net::TcpListener, seen: Seen) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    while let Ok((mut s, peer)) = l.accept().await {
        let seen = seen.clone();
        tokio::spawn(async move {
            let local = s.local_addr().unwrap();
            let mut buf = vec![0u8; 2048];
            let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
                .await
                .ok()
                .and_then(|r| r.ok())
                .unwrap_or(0);
            let req = String::from_utf8_lossy(&buf[..n]).to_string();
            let host = req
                .lines()
                .find_map(|l| l.strip_prefix("Host: ").or_else(|| l.strip_prefix("host: ")))
                .unwrap_or("-")
                .trim()
                .to_string();
            seen.conns
                .lock()
                .unwrap()
                .push((local, peer, req.lines().next().unwrap_or("").to_string()));
            let body = format!("host={} hosthdr={host}\n", local.ip());
            let resp = if req.starts_with("GET ") {
                format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len())
            } else {
                body
            };
            let _ = s.write_all(resp.as_bytes()).await;
        });
    }
}

/// TLS with a self-signed certificate; answers `tls host=<server address> sni=<SNI>`.
async fn serve_tls(l: tokio::net::TcpListener, seen: Seen) {
    use tokio::io::AsyncWriteExt;
    let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
    let cert = rcgen::generate_simple_self_signed(vec!["a.test".into(), "b.test".into()]).unwrap();
    let key =
        tokio_rustls::rustls::pki_types::PrivateKeyDer::try_from(cert.signing_key.serialize_der()).unwrap();
    let config = tokio_rustls::rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(vec![cert.cert.der().clone()], key)
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    while let Ok((s, peer)) = l.accept().await {
        let acceptor = acceptor.clone();
        let seen = seen.clone();
        tokio::spawn(async move {
            let local = s.local_addr().unwrap();
            if let Ok(Ok(mut tls)) = tokio::time::timeout(Duration::from_secs(5), acceptor.accept(s)).await {
                let sni = tls.get_ref().1.server_name().unwrap_or("-").to_string();
                seen.conns
                    .lock()
                    .unwrap()
                    .push((local, peer, format!("tls sni={sni}")));
                let _ = tls
                    .write_all(format!("tls host={} sni={sni}\n", local.ip()).as_bytes())
                    .await;
                let _ = tls.shutdown().await;
            }
        });
    }
}

async fn serve_udp_echo(s: tokio::net::UdpSocket, seen: Seen) {
    let mut buf = [0u8; 1500];
    while let Ok((n, peer)) = s.recv_from(&mut buf).await {
        let local = s.local_addr().unwrap();
        seen.conns
            .lock()
            .unwrap()
            .push((local, peer, String::from_utf8_lossy(&buf[..n]).to_string()));
        let _ = s
            .send_to(format!("udp host={}", local.ip()).as_bytes(), peer)
            .await;
    }
}

/// A DNS server for the names of [`zone`] (A records), recording every question.
async fn serve_dns(s: tokio::net::UdpSocket, seen: Seen) {
    use hickory_proto::op::{Message, ResponseCode};
    use hickory_proto::rr::{RData, Record, RecordType, rdata::A};
    let mut buf = [0u8; 1500];
    while let Ok((n, peer)) = s.recv_from(&mut buf).await {
        let Ok(q) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        let mut resp = Message::response(q.metadata.id, q.metadata.op_code);
        resp.metadata.recursion_desired = q.metadata.recursion_desired;
        resp.metadata.recursion_available = true;
        for question in &q.queries {
            let name = question.name().to_string();
            seen.queries.lock().unwrap().push(name.clone());
            resp.add_query(question.clone());
            if question.query_type() == RecordType::A
                && let Some(addr) = zone(&name)
            {
                resp.add_answer(Record::from_rdata(question.name().clone(), 30, RData::A(A(addr))));
            } else if zone(&name).is_none() {
                resp.metadata.response_code = ResponseCode::NXDomain;
            }
        }
        if let Ok(bytes) = resp.to_vec() {
            let _ = s.send_to(&bytes, peer).await;
        }
    }
}

/// The probe the guest runs: one python3 process tries every probe of a JSON list and prints one JSON
/// result per probe (`"OK <answer>"` or `"ERR <exception>"`).
pub const PROBE_PY: &str = r#"
import json, socket, ssl, sys, urllib.request
T = 2.5
def run(p):
    kind = p[0]
    if kind == "http":
        req = urllib.request.Request(p[1], headers=p[2] if len(p) > 2 else {})
        return urllib.request.urlopen(req, timeout=T).read().decode().strip()
    if kind == "tls":
        ctx = ssl._create_unverified_context()
        with socket.create_connection((p[1], int(p[2])), timeout=T) as s:
            with ctx.wrap_socket(s, server_hostname=p[3]) as t:
                return t.recv(200).decode().strip()
    if kind == "tcp":
        with socket.create_connection((p[1], int(p[2])), timeout=T) as s:
            s.sendall(b"hello\n")
            return s.recv(200).decode().strip()
    if kind == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(T)
        s.sendto(b"ping", (p[1], int(p[2])))
        return s.recvfrom(200)[0].decode()
    if kind == "resolve":
        return socket.gethostbyname(p[1])
    if kind == "dns":
        q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00" + b"".join(bytes([len(x)]) + x.encode() for x in p[2].split(".")) + b"\x00\x00\x01\x00\x01"
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(T)
        s.sendto(q, (p[1], 53))
        r = s.recvfrom(512)[0]
        return "rcode=%d answers=%d" % (r[3] & 15, r[7])
    raise ValueError(kind)
out = []
for p in json.loads(sys.argv[1]):
    try:
        out.append("OK " + str(run(p)))
    except Exception as e:
        out.append("ERR %s %s" % (type(e).__name__, e))
print(json.dumps(out))
"#;
