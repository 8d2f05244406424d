//! A fake internet for the data-plane tests: every packet stays inside namespaces the test made.
//!
//! ```text
//!  guest ns (eth0 172.16.0.2) ── tap0 [hearth-<id>] up0 ── hrth… [hxt-up-R] inet0 ── up0 [hxt-inet-R]
//!                                                            192.0.2.1/30           192.0.2.2/30 + test hosts
//! ```
//! The uplink namespace's only route leads to the "internet" namespace, which holds the test hosts
//! ([`HOST_A`], [`HOST_B`], [`METADATA`], [`PRIVATE`]) on its `lo`; servers are std sockets bound there.
//! The fake internet speaks IPv6 too (`2001:db8:2::1/64` on `inet0`, `2001:db8:2::2/64` on its peer, test hosts
//! [`HOST_A6`], [`HOST_B6`], [`ULA6`] and [`METADATA6`] on its `lo`); a plane made by [`FakeNet::new6`] has a
//! sandbox IPv6 range, one made by [`FakeNet::new`] has none.
//! Every namespace and sandbox is removed by `Drop`, also when a test fails.

#![allow(dead_code, clippy::unwrap_used)]

use std::collections::HashSet;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hearth_net::netns::in_netns;
use hearth_net::plane::{GuestLink, Plane, PlaneConfig, SandboxNet};

pub const UPLINK_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
pub const INET_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
pub const HOST_A: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const HOST_B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 20);
pub const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
pub const UPLINK_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 1);
pub const INET_ADDR6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 2);
pub const HOST_A6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 1, 0, 0, 0, 0, 0x10);
pub const HOST_B6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 3, 0, 0, 0, 0, 0x20);
/// A unique local address (fc00::/7), routed like a public one on the fake internet.
pub const ULA6: Ipv6Addr = Ipv6Addr::new(0xfd12, 0x3456, 0, 0, 0, 0, 0, 1);
pub const METADATA6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254);
/// How long a "must not connect" probe waits.
pub const DENY_TIMEOUT: Duration = Duration::from_millis(1500);
pub const ALLOW_TIMEOUT: Duration = Duration::from_secs(5);

pub fn unique() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::hash::Hash::hash(
        &(std::process::id(), nanos, COUNTER.fetch_add(1, Ordering::Relaxed)),
        &mut h,
    );
    format!("{:016x}", std::hash::Hasher::finish(&h))
}

pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn ip_batch(ns: &str, script: &str) {
    let mut child = Command::new("ip")
        .args(["-n", ns, "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run ip");
    child.stdin.take().unwrap().write_all(script.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "ip -n {ns} -batch: {}\n{script}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn output(program: &str, args: &[&str]) -> String {
    let out = Command::new(program).args(args).output().expect("run");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A network namespace the test made; deleted on drop.
pub struct Netns {
    pub name: String,
    pub path: PathBuf,
}

impl Netns {
    pub fn new(prefix: &str) -> Netns {
        let name = format!("{prefix}-{}", &unique()[..10]);
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

/// A sandbox of the fake internet, with its guest namespace.
pub struct Sandbox {
    pub net: SandboxNet,
    pub guest: Arc<Netns>,
}

impl Sandbox {
    pub fn ns(&self) -> PathBuf {
        hearth_net::netns_path(&self.net.id)
    }
}

pub struct FakeNet {
    pub plane: Plane,
    pub sandbox_net: ipnet::Ipv4Net,
    pub sandboxes: Mutex<Vec<String>>,
    pub guests: Mutex<Vec<Arc<Netns>>>,
    pub inet: Netns,
    pub up: Netns,
}

impl FakeNet {
    /// `n` picks the sandbox range 10.213.n.0/24 (one per test, so tests can run in parallel).
    pub fn new(n: u8) -> FakeNet {
        FakeNet::make(n, None)
    }

    /// Like [`FakeNet::new`], with the sandbox IPv6 range `2001:db8:ff00:<n>::/64`.
    pub fn new6(n: u8) -> FakeNet {
        FakeNet::make(n, Some(format!("2001:db8:ff00:{n}::/64").parse().unwrap()))
    }

    fn make(n: u8, sandbox_net6: Option<ipnet::Ipv6Net>) -> FakeNet {
        assert!(nix::unistd::geteuid().is_root(), "the data-plane tests need root");
        let up = Netns::new("hxt-up");
        let inet = Netns::new("hxt-inet");
        let sandbox_net: ipnet::Ipv4Net = format!("10.213.{n}.0/24").parse().unwrap();
        ip(&[
            "-n", &up.name, "link", "add", "inet0", "type", "veth", "peer", "name", "up0", "netns",
            &inet.name,
        ]);
        ip_batch(
            &up.name,
            &format!(
                "addr add {UPLINK_ADDR}/30 dev inet0\nlink set inet0 up\nroute add default via {INET_ADDR}\n\
                 addr add {UPLINK_ADDR6}/64 dev inet0 nodad\nroute add ::/0 via {INET_ADDR6}\n"
            ),
        );
        let mut inet_script = format!(
            "addr add {INET_ADDR}/30 dev up0\nlink set up0 up\naddr add {INET_ADDR6}/64 dev up0 nodad\n"
        );
        for host in [HOST_A, HOST_B, METADATA, PRIVATE] {
            inet_script.push_str(&format!("addr add {host}/32 dev lo\n"));
        }
        for host in [HOST_A6, HOST_B6, ULA6, METADATA6] {
            inet_script.push_str(&format!("addr add {host}/128 dev lo\n"));
        }
        if let Some(n6) = sandbox_net6 {
            inet_script.push_str(&format!("route add {n6} via {UPLINK_ADDR6}\n"));
        }
        // So that an attempt from the internet towards a sandbox is routed to the uplink (and must be dropped).
        inet_script.push_str(&format!("route add {sandbox_net} via {UPLINK_ADDR}\n"));
        ip_batch(&inet.name, &inet_script);
        let plane = Plane::new(PlaneConfig {
            uplink_netns: up.path.clone(),
            sandbox_net,
            sandbox_net6,
        })
        .expect("plane");
        FakeNet {
            plane,
            sandbox_net,
            sandboxes: Mutex::new(Vec::new()),
            guests: Mutex::new(Vec::new()),
            inet,
            up,
        }
    }

    /// The `i`-th sandbox address of the range (`.1` is the hub).
    pub fn addr(&self, i: u8) -> Ipv4Addr {
        let o = self.sandbox_net.network().octets();
        Ipv4Addr::new(o[0], o[1], o[2], i)
    }

    /// A sandbox description with a fresh id and guest namespace (not yet created).
    pub fn sandbox(&self, i: u8) -> Sandbox {
        let guest = Arc::new(Netns::new("hxt-g"));
        self.guests.lock().unwrap().push(guest.clone());
        let net = SandboxNet {
            id: format!("sbx_{}", unique()),
            address: self.addr(i),
            default_allow: true,
            allow: Vec::new(),
            deny: Vec::new(),
            proxy_tcp: false,
            peers: Vec::new(),
            extra_denied: Vec::new(),
            guest_link: GuestLink::Veth {
                guest_netns: guest.path.clone(),
            },
        };
        Sandbox { net, guest }
    }

    pub fn create(&self, sb: &Sandbox) {
        self.sandboxes.lock().unwrap().push(sb.net.id.clone());
        self.plane.create_sandbox(&sb.net).expect("create sandbox");
    }

    /// Creates a sandbox with `configure` applied to its description.
    pub fn with(&self, i: u8, configure: impl FnOnce(&mut SandboxNet)) -> Sandbox {
        let mut sb = self.sandbox(i);
        configure(&mut sb.net);
        self.create(&sb);
        sb
    }

    /// Starts a TCP server on `port` of every test host (and the uplink's addresses when `ns` is the uplink).
    pub fn tcp_server(&self, port: u16) -> Server {
        tcp_server(&self.inet.path, SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)))
    }

    /// Starts a UDP echo server on `port` of each test host.
    pub fn udp_server(&self, port: u16) -> Server {
        let server = Server::default();
        for host in [HOST_A, HOST_B, METADATA, PRIVATE] {
            udp_server_on(&self.inet.path, SocketAddr::from((host, port)), &server);
        }
        server
    }
}

impl Drop for FakeNet {
    fn drop(&mut self) {
        for id in self.sandboxes.lock().unwrap().drain(..) {
            if let Err(e) = self.plane.destroy_sandbox(&id) {
                eprintln!("cleanup {id}: {e}");
            }
        }
        self.guests.lock().unwrap().clear();
    }
}

/// What a server saw: (local address, peer address, payload) of each connection or datagram.
#[derive(Clone, Default)]
pub struct Server {
    pub seen: Arc<Mutex<Vec<(SocketAddr, SocketAddr, String)>>>,
}

impl Server {
    pub fn seen_to(&self, ip: IpAddr) -> Vec<(SocketAddr, SocketAddr, String)> {
        self.seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(l, _, _)| l.ip() == ip)
            .cloned()
            .collect()
    }
    pub fn count(&self) -> usize {
        self.seen.lock().unwrap().len()
    }
}

/// A TCP server in `ns` that answers every connection with "peer=<peer address>" and closes it.
pub fn tcp_server(ns: &Path, addr: SocketAddr) -> Server {
    let listener = in_netns(ns, move || TcpListener::bind(addr)).expect("bind tcp server");
    let server = Server::default();
    let seen = server.seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let (Ok(local), Ok(peer)) = (conn.local_addr(), conn.peer_addr()) else {
                continue;
            };
            seen.lock().unwrap().push((local, peer, String::new()));
            let _ = conn.write_all(format!("peer={}", peer.ip()).as_bytes());
        }
    });
    server
}

/// A TCP server in `ns` that echoes what it reads, connection after connection.
pub fn echo_server(ns: &Path, addr: SocketAddr) {
    let listener = in_netns(ns, move || TcpListener::bind(addr)).expect("bind echo server");
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                while let Ok(n) = conn.read(&mut buf) {
                    if n == 0 || conn.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
}

/// Sends `text` on an echo connection and reads the answer.
pub fn echo(conn: &mut TcpStream, text: &str) -> String {
    conn.write_all(text.as_bytes())
        .expect("send on the open connection");
    let mut buf = vec![0u8; text.len()];
    conn.read_exact(&mut buf).expect("answer on the open connection");
    String::from_utf8_lossy(&buf).into_owned()
}

/// A UDP server in `ns` bound to `addr` that answers each datagram with "peer=<peer address>".
pub fn udp_server_on(ns: &Path, addr: SocketAddr, server: &Server) {
    let sock = in_netns(ns, move || UdpSocket::bind(addr)).expect("bind udp server");
    let seen = server.seen.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((n, peer)) = sock.recv_from(&mut buf) {
            let payload = String::from_utf8_lossy(&buf[..n]).into_owned();
            seen.lock().unwrap().push((addr, peer, payload));
            let _ = sock.send_to(format!("peer={}", peer.ip()).as_bytes(), peer);
        }
    });
}

/// A TCP server in `ns` bound to `addr` (added to `server`) that answers like [`tcp_server`].
pub fn tcp_server_on(ns: &Path, addr: SocketAddr, server: &Server) {
    let listener = in_netns(ns, move || TcpListener::bind(addr)).expect("bind tcp server");
    let seen = server.seen.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let (Ok(local), Ok(peer)) = (conn.local_addr(), conn.peer_addr()) else {
                continue;
            };
            seen.lock().unwrap().push((local, peer, String::new()));
            let _ = conn.write_all(format!("peer={}", peer.ip()).as_bytes());
        }
    });
}

/// TCP and UDP servers on `port` of each IPv6 test host of the internet namespace.
pub fn servers6(inet: &Path, port: u16) -> (Server, Server) {
    let (tcp, udp) = (Server::default(), Server::default());
    for host in [HOST_A6, HOST_B6, ULA6, METADATA6] {
        tcp_server_on(inet, sa6(host, port), &tcp);
        udp_server_on(inet, sa6(host, port), &udp);
    }
    (tcp, udp)
}

pub fn sa6(ip: Ipv6Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

/// Connects from `ns` and returns what the server said, or the error (timeout after `timeout`).
pub fn tcp(ns: &Path, to: SocketAddr, timeout: Duration) -> std::io::Result<String> {
    in_netns(ns, move || {
        let mut s = TcpStream::connect_timeout(&to, timeout)?;
        s.set_read_timeout(Some(timeout))?;
        let mut reply = String::new();
        s.read_to_string(&mut reply)?;
        Ok(reply)
    })
}

/// Sends one datagram from `ns` (from `from` when given) and waits for an answer.
pub fn udp(
    ns: &Path,
    from: Option<IpAddr>,
    to: SocketAddr,
    payload: &str,
    timeout: Duration,
) -> std::io::Result<String> {
    let payload = payload.to_owned();
    in_netns(ns, move || {
        let any = match to {
            SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let bind = SocketAddr::new(from.unwrap_or(any), 0);
        let s = UdpSocket::bind(bind)?;
        s.set_read_timeout(Some(timeout))?;
        s.send_to(payload.as_bytes(), to)?;
        let mut buf = [0u8; 1500];
        let n = s.recv(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
    })
}

pub fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

/// Asserts a TCP connection from `ns` to `to` works and returns the server's reply.
#[track_caller]
pub fn must_tcp(ns: &Path, to: SocketAddr) -> String {
    match tcp(ns, to, ALLOW_TIMEOUT) {
        Ok(r) => r,
        Err(e) => panic!("tcp to {to} must connect: {e}"),
    }
}

/// Asserts a TCP connection from `ns` to `to` does not get through.
#[track_caller]
pub fn must_not_tcp(ns: &Path, to: SocketAddr) {
    if let Ok(r) = tcp(ns, to, DENY_TIMEOUT) {
        panic!("tcp to {to} must not connect, got {r:?}");
    }
}

/// Asserts that none of the TCP connections from `ns` gets through (probed in parallel).
#[track_caller]
pub fn must_not_tcp_any(ns: &Path, targets: &[SocketAddr]) {
    let results: Vec<(SocketAddr, std::io::Result<String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = targets
            .iter()
            .map(|t| (*t, s.spawn(move || tcp(ns, *t, DENY_TIMEOUT))))
            .collect();
        handles.into_iter().map(|(t, h)| (t, h.join().unwrap())).collect()
    });
    for (to, r) in results {
        if let Ok(reply) = r {
            panic!("tcp to {to} must not connect, got {reply:?}");
        }
    }
}

#[track_caller]
pub fn must_udp(ns: &Path, to: SocketAddr) -> String {
    match udp(ns, None, to, "ping", ALLOW_TIMEOUT) {
        Ok(r) => r,
        Err(e) => panic!("udp to {to} must be answered: {e}"),
    }
}

#[track_caller]
pub fn must_not_udp(ns: &Path, to: SocketAddr) {
    if let Ok(r) = udp(ns, None, to, "ping", DENY_TIMEOUT) {
        panic!("udp to {to} must not be answered, got {r:?}");
    }
}

/// Names of the network namespaces in /run/netns.
pub fn namespaces() -> HashSet<String> {
    std::fs::read_dir("/run/netns")
        .map(|d| d.filter_map(|e| e.ok()?.file_name().into_string().ok()).collect())
        .unwrap_or_default()
}

/// Names of the links in namespace `ns`.
pub fn links(ns: &str) -> Vec<String> {
    let out = output("ip", &["-n", ns, "-o", "link", "show"]);
    out.lines()
        .filter_map(|l| l.split(": ").nth(1))
        .map(|n| n.split('@').next().unwrap_or(n).to_owned())
        .collect()
}
