//! The bench daemon's fake internet: two namespaces the bench makes and removes, so that no packet of the
//! network measurements can reach the machine's real network.
//!
//! ```text
//!  sandbox namespaces ── hrth… [uplink ns] inet0 192.0.2.1 ──── 192.0.2.2 up0 [internet ns]
//!                                                                  on lo:
//!                                                                  203.0.113.10  (a.test) bench HTTP server :80, :8080
//!                                                                  198.51.100.20 (b.test) connection counters :80, :8080
//!                                                                  203.0.113.53  DNS for a.test and b.test
//! ```
//! The daemon gets `--uplink-netns` = the uplink namespace, whose only route leads to the internet namespace,
//! and `--dns-upstream 203.0.113.53:53`.
//!
//! The bench HTTP server answers, one request per connection:
//! - `POST` with `Content-Length: N`: reads and discards the N body bytes, then answers `received N`;
//! - `GET /bytes/N`: answers N zero bytes;
//! - anything else: answers `ok`.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};
use tokio::task::JoinHandle;

pub const UPLINK_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
pub const INET_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
/// `a.test`: the bench HTTP server.
pub const HOST_A: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// `b.test`: counts the connections it accepts.
pub const HOST_B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
pub const DNS: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 53);
/// Sandbox addresses of the bench daemon (distinct from the test suites' ranges).
pub const SANDBOX_NET: &str = "10.213.60.0/24";

/// Names the fake internet's resolver knows.
fn zone(name: &str) -> Option<Ipv4Addr> {
    match name.trim_end_matches('.').to_ascii_lowercase().as_str() {
        "a.test" => Some(HOST_A),
        "b.test" => Some(HOST_B),
        _ => None,
    }
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip")?;
    if !out.status.success() {
        bail!("ip {args:?}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// A namespace made by the bench, deleted on drop.
struct Netns {
    name: String,
    path: PathBuf,
}

impl Netns {
    fn new(prefix: &str) -> Result<Netns> {
        let name = format!("{prefix}-{}", std::process::id());
        ip(&["netns", "add", &name])?;
        let ns = Netns {
            path: PathBuf::from("/run/netns").join(&name),
            name,
        };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

pub struct FakeNet {
    // Servers first: they are stopped before their namespaces go.
    servers: Vec<JoinHandle<()>>,
    /// When `b.test:8080` accepted each connection (the bench's clock).
    pub b_accepts: Arc<Mutex<Vec<Instant>>>,
    /// When `b.test:80` accepted each connection.
    pub b_http_accepts: Arc<Mutex<Vec<Instant>>>,
    up: Netns,
    _inet: Netns,
}

impl Drop for FakeNet {
    fn drop(&mut self) {
        for s in &self.servers {
            s.abort();
        }
    }
}

impl FakeNet {
    /// Builds the namespaces and starts the servers on the current tokio runtime.
    pub fn new() -> Result<FakeNet> {
        let up = Netns::new("hbench-up")?;
        let inet = Netns::new("hbench-inet")?;
        let (u, i) = (up.name.as_str(), inet.name.as_str());
        ip(&[
            "-n", u, "link", "add", "inet0", "type", "veth", "peer", "name", "up0", "netns", i,
        ])?;
        ip(&[
            "-n",
            u,
            "addr",
            "add",
            &format!("{UPLINK_ADDR}/30"),
            "dev",
            "inet0",
        ])?;
        ip(&["-n", u, "link", "set", "inet0", "up"])?;
        ip(&["-n", u, "route", "add", "default", "via", &INET_ADDR.to_string()])?;
        ip(&["-n", i, "addr", "add", &format!("{INET_ADDR}/30"), "dev", "up0"])?;
        ip(&["-n", i, "link", "set", "up0", "up"])?;
        for host in [HOST_A, HOST_B, DNS] {
            ip(&["-n", i, "addr", "add", &format!("{host}/32"), "dev", "lo"])?;
        }
        // Replies towards sandbox addresses go back through the uplink.
        ip(&[
            "-n",
            i,
            "route",
            "add",
            "10.0.0.0/8",
            "via",
            &UPLINK_ADDR.to_string(),
        ])?;

        let ns = inet.path.clone();
        let mut servers = Vec::new();
        for port in [80u16, 8080] {
            let l = listener(&ns, SocketAddr::from((HOST_A, port)))?;
            servers.push(tokio::spawn(serve_http(l)));
        }
        let b_accepts = Arc::new(Mutex::new(Vec::new()));
        let l = listener(&ns, SocketAddr::from((HOST_B, 8080)))?;
        servers.push(tokio::spawn(count_accepts(l, b_accepts.clone())));
        let b_http_accepts = Arc::new(Mutex::new(Vec::new()));
        let l = listener(&ns, SocketAddr::from((HOST_B, 80)))?;
        servers.push(tokio::spawn(count_accepts(l, b_http_accepts.clone())));
        let s = hearth_net::netns::udp_socket(&ns, SocketAddr::from((DNS, 53)))?;
        servers.push(tokio::spawn(serve_dns(UdpSocket::from_std(s)?)));
        Ok(FakeNet {
            servers,
            b_accepts,
            b_http_accepts,
            up,
            _inet: inet,
        })
    }

    /// Path of the uplink namespace.
    pub fn uplink(&self) -> &Path {
        &self.up.path
    }

    /// hearthd flags for a daemon whose sandboxes live on this fake internet.
    pub fn daemon_flags(&self) -> Vec<String> {
        vec![
            "--network".into(),
            "on".into(),
            "--uplink-netns".into(),
            self.uplink().display().to_string(),
            "--sandbox-net".into(),
            SANDBOX_NET.into(),
            "--dns-upstream".into(),
            format!("{DNS}:53"),
        ]
    }
}

fn listener(ns: &Path, addr: SocketAddr) -> Result<TcpListener> {
    let l = hearth_net::netns::tcp_listener(ns, addr).with_context(|| format!("listen on {addr}"))?;
    Ok(TcpListener::from_std(l)?)
}

async fn serve_http(l: TcpListener) {
    while let Ok((s, _)) = l.accept().await {
        tokio::spawn(async move {
            let _ = http_exchange(s).await;
        });
    }
}

/// One request, one answer (see the module docs).
async fn http_exchange(mut s: TcpStream) -> std::io::Result<()> {
    let _ = s.set_nodelay(true);
    let mut head = Vec::with_capacity(1024);
    let mut buf = vec![0u8; 64 * 1024];
    let end = loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if let Some(p) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        if head.len() > 16 * 1024 {
            return Ok(());
        }
    };
    let text = String::from_utf8_lossy(&head[..end]).into_owned();
    let first = text.lines().next().unwrap_or("").to_owned();
    let length: u64 = text
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    if first.starts_with("POST ") {
        let mut got = (head.len() - end) as u64;
        while got < length {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            got += n as u64;
        }
        let body = format!("received {got}\n");
        let resp = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(resp.as_bytes()).await?;
    } else if let Some(n) = first
        .strip_prefix("GET /bytes/")
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse::<u64>().ok())
    {
        let resp = format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n");
        s.write_all(resp.as_bytes()).await?;
        buf.fill(0);
        let mut left = n;
        while left > 0 {
            let k = left.min(buf.len() as u64) as usize;
            s.write_all(&buf[..k]).await?;
            left -= k as u64;
        }
    } else {
        s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n")
            .await?;
    }
    s.shutdown().await
}

async fn count_accepts(l: TcpListener, at: Arc<Mutex<Vec<Instant>>>) {
    while let Ok((s, _)) = l.accept().await {
        at.lock().unwrap_or_else(|e| e.into_inner()).push(Instant::now());
        drop(s);
    }
}

/// A resolver for [`zone`]: A records, NXDOMAIN for unknown names, an empty answer for other types.
async fn serve_dns(s: UdpSocket) {
    let mut buf = [0u8; 1500];
    while let Ok((n, peer)) = s.recv_from(&mut buf).await {
        if let Some(resp) = dns_answer(&buf[..n]) {
            let _ = s.send_to(&resp, peer).await;
        }
    }
}

/// The answer to one DNS query with a single question (None for anything else).
fn dns_answer(q: &[u8]) -> Option<Vec<u8>> {
    if q.len() < 12 || q[4..6] != [0, 1] {
        return None;
    }
    // The question name: labels up to the root.
    let mut i = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*q.get(i)?);
        i += 1;
        if len == 0 {
            break;
        }
        if len > 63 {
            return None;
        }
        labels.push(String::from_utf8_lossy(q.get(i..i + len)?).into_owned());
        i += len;
    }
    let qtype = u16::from_be_bytes([*q.get(i)?, *q.get(i + 1)?]);
    let question = q.get(12..i + 4)?;
    let addr = zone(&labels.join("."));
    let answer = match addr {
        Some(a) if qtype == 1 => Some(a),
        _ => None,
    };
    let mut r = Vec::with_capacity(64);
    r.extend_from_slice(&q[0..2]);
    // QR, opcode 0, RD copied; RA; rcode NXDOMAIN for an unknown name.
    r.push(0x80 | (q[2] & 0x01));
    r.push(0x80 | if addr.is_none() { 3 } else { 0 });
    r.extend_from_slice(&[0, 1, 0, u8::from(answer.is_some()), 0, 0, 0, 0]);
    r.extend_from_slice(question);
    if let Some(a) = answer {
        r.extend_from_slice(&[0xc0, 0x0c, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4]);
        r.extend_from_slice(&a.octets());
    }
    Some(r)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u16) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            q.push(l.len() as u8);
            q.extend_from_slice(l.as_bytes());
        }
        q.push(0);
        q.extend_from_slice(&qtype.to_be_bytes());
        q.extend_from_slice(&[0, 1]);
        q
    }

    #[test]
    fn dns_answers_a_records_of_the_zone() {
        let r = dns_answer(&query("a.test", 1)).unwrap();
        assert_eq!(&r[0..2], &[0x12, 0x34]);
        assert_eq!(r[3] & 0x0f, 0, "NOERROR");
        assert_eq!(&r[6..8], &[0, 1], "one answer");
        assert_eq!(&r[r.len() - 4..], &HOST_A.octets());

        let r = dns_answer(&query("a.test", 28)).unwrap();
        assert_eq!(r[3] & 0x0f, 0);
        assert_eq!(&r[6..8], &[0, 0], "no AAAA");

        let r = dns_answer(&query("c.test", 1)).unwrap();
        assert_eq!(r[3] & 0x0f, 3, "NXDOMAIN");
        assert_eq!(&r[6..8], &[0, 0]);
        assert!(dns_answer(&[0; 5]).is_none());
    }
}
