//! Test fixtures for the resolver and proxy tests: network namespaces the test makes (and always deletes), a
//! "fake internet" of addresses on the loopback of such a namespace, a recording upstream DNS server, plain HTTP
//! and TLS test hosts. Needs root (CI runs as root).

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{Name, RData, Record, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::task::JoinHandle;

/// A network namespace made by the test, deleted on drop (also when the test fails).
pub struct Netns {
    pub name: String,
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("hnt-{tag}-{}-{n}", std::process::id());
        let _ = Command::new("ip")
            .args(["netns", "del", &name])
            .stderr(std::process::Stdio::null())
            .status();
        run("ip", &["netns", "add", &name]);
        let ns = Netns { name };
        ns.ip("link set lo up");
        ns
    }

    pub fn path(&self) -> PathBuf {
        PathBuf::from("/run/netns").join(&self.name)
    }

    /// Runs `ip -n <ns> <args>`; panics if it fails.
    pub fn ip(&self, args: &str) {
        let mut all = vec!["-n", &self.name];
        all.extend(args.split_whitespace());
        run("ip", &all);
    }

    /// Gives the namespace's loopback the address `ip` (a host of the fake internet).
    pub fn add_host(&self, ip: &str) {
        let prefix = if ip.contains(':') { 128 } else { 32 };
        self.ip(&format!("addr add {ip}/{prefix} dev lo"));
    }

    /// Runs `nft -f -` inside the namespace with `ruleset`.
    pub fn nft(&self, ruleset: &str) {
        use std::io::Write;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(ruleset.as_bytes()).unwrap();
        assert!(child.wait().unwrap().success(), "nft failed for:\n{ruleset}");
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

fn run(cmd: &str, args: &[&str]) {
    let out = Command::new(cmd).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// An upstream DNS server in a test namespace that answers from a fixed zone and records every question.
pub struct TestDns {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl TestDns {
    /// Serves `zone` (name -> addresses) on `addr` inside `ns`; other names get NXDOMAIN.
    pub fn start(ns: &Netns, addr: SocketAddr, zone: &[(&str, &[&str])]) -> TestDns {
        TestDns::start_in(&ns.path(), addr, zone)
    }

    /// Serves `zone` on `addr` inside the namespace at `ns` (any test namespace, e.g. a fake internet's).
    pub fn start_in(ns: &std::path::Path, addr: SocketAddr, zone: &[(&str, &[&str])]) -> TestDns {
        let zone: HashMap<String, Vec<IpAddr>> = zone
            .iter()
            .map(|(n, ips)| (n.to_string(), ips.iter().map(|i| i.parse().unwrap()).collect()))
            .collect();
        let socket = hearth_net::netns::udp_socket(ns, addr).unwrap();
        let socket = tokio::net::UdpSocket::from_std(socket).unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let Ok((len, peer)) = socket.recv_from(&mut buf).await else {
                    continue;
                };
                let Ok(query) = Message::from_vec(&buf[..len]) else {
                    continue;
                };
                let Some(q) = query.queries.first() else { continue };
                let name = q.name().to_ascii().trim_end_matches('.').to_ascii_lowercase();
                log.lock().unwrap().push(name.clone());
                let mut reply = Message::response(query.metadata.id, OpCode::Query);
                reply.add_query(q.clone());
                match zone.get(&name) {
                    None => reply.metadata.response_code = ResponseCode::NXDomain,
                    Some(ips) => {
                        for ip in ips {
                            let data = match (ip, q.query_type()) {
                                (IpAddr::V4(v4), RecordType::A) => RData::A(A(*v4)),
                                (IpAddr::V6(v6), RecordType::AAAA) => RData::AAAA(AAAA(*v6)),
                                _ => continue,
                            };
                            reply.add_answer(Record::from_rdata(q.name().clone(), 300, data));
                        }
                    }
                }
                let _ = socket.send_to(&reply.to_vec().unwrap(), peer).await;
            }
        });
        TestDns { addr, seen, task }
    }

    /// The names asked so far (lower case, no trailing dot).
    pub fn queries(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for TestDns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Sends one DNS query to `server` from a loopback socket and returns the decoded reply (None on timeout).
pub async fn ask(server: SocketAddr, name: &str, rtype: RecordType) -> Option<Message> {
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let id: u16 = rand::random();
    let mut q = Message::new(id, MessageType::Query, OpCode::Query);
    q.metadata.recursion_desired = true;
    q.add_query(Query::query(Name::from_ascii(name).unwrap(), rtype));
    socket.send_to(&q.to_vec().unwrap(), server).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let (len, _) = tokio::time::timeout(Duration::from_secs(5), socket.recv_from(&mut buf))
        .await
        .ok()?
        .ok()?;
    let reply = Message::from_vec(&buf[..len]).unwrap();
    assert_eq!(reply.metadata.id, id);
    Some(reply)
}

/// The addresses in a reply's answer section.
pub fn answer_ips(reply: &Message) -> Vec<IpAddr> {
    reply
        .answers
        .iter()
        .filter_map(|r| match &r.data {
            RData::A(a) => Some(IpAddr::V4(a.0)),
            RData::AAAA(a) => Some(IpAddr::V6(a.0)),
            _ => None,
        })
        .collect()
}

/// A TCP test host: counts connections; answers HTTP requests with `label` and the Host it saw, and echoes
/// `label:` plus any line of a non-HTTP client. Writes `hello from <label>` first if `greets`.
pub struct TestHost {
    pub connections: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Drop for TestHost {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn tcp_host(ns: &Netns, addr: SocketAddr, label: &'static str, greets: bool) -> TestHost {
    let listener = hearth_net::netns::tcp_listener(&ns.path(), addr).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(async move {
                if greets {
                    let _ = s.write_all(format!("hello from {label}\n").as_bytes()).await;
                }
                let mut buf = Vec::new();
                let mut chunk = [0u8; 1024];
                loop {
                    let Ok(n) = s.read(&mut chunk).await else { return };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if text.contains("\r\n\r\n") {
                        let host = text
                            .lines()
                            .find_map(|l| l.strip_prefix("Host: ").or_else(|| l.strip_prefix("host: ")))
                            .unwrap_or("-")
                            .to_string();
                        let body = format!("{label} host={host}");
                        let resp = format!(
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = s.write_all(resp.as_bytes()).await;
                        return;
                    }
                    if !text.starts_with(|c: char| c.is_ascii_uppercase()) && text.contains('\n') {
                        let _ = s.write_all(format!("{label}:{text}").as_bytes()).await;
                        return;
                    }
                }
            });
        }
    });
    TestHost { connections, task }
}

/// A TLS test host with a self-signed certificate for `names`: after the handshake, writes `label` and closes.
/// Returns the host and the certificate (to trust it in the client).
pub fn tls_host(
    ns: &Netns,
    addr: SocketAddr,
    label: &'static str,
    names: &[&str],
) -> (TestHost, tokio_rustls::rustls::pki_types::CertificateDer<'static>) {
    use tokio_rustls::rustls;
    let ck =
        rcgen::generate_simple_self_signed(names.iter().map(|s| s.to_string()).collect::<Vec<_>>()).unwrap();
    let cert = ck.cert.der().clone();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.signing_key.serialize_der().into());
    let config =
        rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], key)
            .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = hearth_net::netns::tcp_listener(&ns.path(), addr).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let count = connections.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                continue;
            };
            count.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                if let Ok(mut tls) = acceptor.accept(s).await {
                    let _ = tls.write_all(label.as_bytes()).await;
                    let _ = tls.shutdown().await;
                }
            });
        }
    });
    (TestHost { connections, task }, cert)
}

/// Opens a TLS session for `name` over `stream`, trusting only `cert`, and reads what the server sends.
pub async fn tls_read(
    stream: tokio::net::TcpStream,
    name: &str,
    cert: &tokio_rustls::rustls::pki_types::CertificateDer<'static>,
) -> std::io::Result<String> {
    use tokio_rustls::rustls;
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.clone()).unwrap();
    let config =
        rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let server_name = rustls::pki_types::ServerName::try_from(name.to_string()).unwrap();
    let mut tls = connector.connect(server_name, stream).await?;
    let mut out = String::new();
    let _ = tls.read_to_string(&mut out).await;
    Ok(out)
}

/// Sends a plain HTTP GET for `host` over `stream` and returns the whole response ("" if closed).
pub async fn http_get(mut stream: tokio::net::TcpStream, host: &str) -> String {
    let req = format!("GET / HTTP/1.1\r\nHost: {host}\r\nUser-Agent: hearth-test\r\n\r\n");
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).to_string()
}
