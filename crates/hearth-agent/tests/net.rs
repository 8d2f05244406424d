//! The agent's network set-up (`hearth_agent::net::configure`) on real interfaces, without a VM: it runs on a
//! thread inside a "guest" network namespace made by the test, whose `eth0` is one end of a veth pair; the
//! other end is the gateway in a second namespace, with a TCP test host on the gateway address. Needs root.
//! Every namespace is the test's own and is deleted on drop; traffic stays between the two.

use std::fs::File;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use hearth_agent::net::{NetConfig, NetError, configure, configure6, parse, parse6, prepare6};

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn ip_out(args: &[&str]) -> String {
    let out = Command::new("ip").args(args).output().expect("run ip");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A namespace of the test's, deleted on drop.
struct Netns {
    name: String,
    path: PathBuf,
}

impl Netns {
    fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "hxt-nic-{:05x}{:02x}{tag}",
            std::process::id() & 0xfffff,
            SEQ.fetch_add(1, Ordering::Relaxed) & 0xff
        );
        ip(&["netns", "add", &name]);
        Netns {
            path: PathBuf::from("/run/netns").join(&name),
            name,
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).status();
    }
}

/// Runs `f` on a thread that joined the namespace at `ns`.
fn in_netns<R: Send + 'static>(ns: &Path, f: impl FnOnce() -> R + Send + 'static) -> R {
    let file = File::open(ns).expect("netns file");
    std::thread::spawn(move || {
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        f()
    })
    .join()
    .expect("netns thread")
}

fn hearth_config() -> NetConfig {
    parse("172.16.0.2/30,172.16.0.1,172.16.0.1").expect("valid")
}

#[test]
fn configures_eth0_route_and_resolver_and_reaches_the_gateway() {
    let guest = Netns::new("g");
    let gw = Netns::new("h");
    // Another Ethernet interface with a lower index than eth0: eth0 is still the one chosen.
    ip(&[
        "-n",
        &guest.name,
        "link",
        "add",
        "aaa0",
        "type",
        "veth",
        "peer",
        "name",
        "aaa1",
    ]);
    ip(&[
        "link",
        "add",
        "eth0",
        "netns",
        &guest.name,
        "type",
        "veth",
        "peer",
        "name",
        "gw0",
        "netns",
        &gw.name,
    ]);
    ip(&["-n", &gw.name, "addr", "add", "172.16.0.1/30", "dev", "gw0"]);
    ip(&["-n", &gw.name, "link", "set", "gw0", "up"]);
    let listener = in_netns(&gw.path, || {
        TcpListener::bind("172.16.0.1:0").expect("bind in the gateway ns")
    });
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut conn, peer) = listener.accept().expect("accept");
        conn.write_all(b"hello guest\n").expect("write");
        peer
    });

    let etc = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink("/nonexistent/stub-resolv.conf", etc.path().join("resolv.conf"))
        .expect("symlink");
    let etc_path = etc.path().to_path_buf();
    let (iface, again, reply) = in_netns(&guest.path, move || {
        let iface = configure(&hearth_config(), &etc_path).expect("configure");
        // Once more (an agent restarted by its supervisor loop): the existing route is no error.
        let again = configure(&hearth_config(), &etc_path).map_err(|e| e.to_string());
        let mut conn = TcpStream::connect_timeout(
            &SocketAddr::from((Ipv4Addr::new(172, 16, 0, 1), port)),
            Duration::from_secs(10),
        )
        .expect("connect to the gateway's test host");
        let mut reply = String::new();
        conn.read_to_string(&mut reply).expect("read");
        (iface, again, reply)
    });
    assert_eq!(iface, "eth0");
    assert_eq!(again.as_deref(), Ok("eth0"));
    assert_eq!(reply, "hello guest\n");
    let peer = server.join().expect("server");
    assert_eq!(peer.ip(), std::net::IpAddr::V4(Ipv4Addr::new(172, 16, 0, 2)));

    let addr = ip_out(&["-n", &guest.name, "-4", "-o", "addr", "show", "dev", "eth0"]);
    assert!(addr.contains("inet 172.16.0.2/30 "), "{addr}");
    let route = ip_out(&["-n", &guest.name, "route", "show", "default"]);
    assert_eq!(route.trim(), "default via 172.16.0.1 dev eth0", "{route}");
    let link = ip_out(&["-n", &guest.name, "link", "show", "dev", "lo"]);
    assert!(link.contains(",UP"), "{link}");
    // The other interface was left alone.
    assert!(
        ip_out(&["-n", &guest.name, "-4", "addr", "show", "dev", "aaa0"])
            .trim()
            .is_empty()
    );
    let meta = std::fs::symlink_metadata(etc.path().join("resolv.conf")).expect("resolv.conf");
    assert!(meta.file_type().is_file(), "the symlink was not replaced");
    let resolv = std::fs::read_to_string(etc.path().join("resolv.conf")).expect("read");
    assert!(resolv.lines().any(|l| l == "nameserver 172.16.0.1"), "{resolv}");
}

#[test]
fn no_interface_is_an_error_and_changes_nothing() {
    let guest = Netns::new("e");
    let etc = tempfile::tempdir().expect("tempdir");
    let etc_path = etc.path().to_path_buf();
    let result = in_netns(&guest.path, move || configure(&hearth_config(), &etc_path));
    assert!(matches!(result, Err(NetError::NoInterface(_))), "{result:?}");
    assert!(!etc.path().join("resolv.conf").exists());
}

#[test]
fn configures_ipv6_next_to_ipv4_and_reaches_the_gateway_over_it() {
    let guest = Netns::new("6");
    let gw = Netns::new("7");
    ip(&[
        "link",
        "add",
        "eth0",
        "netns",
        &guest.name,
        "type",
        "veth",
        "peer",
        "name",
        "gw0",
        "netns",
        &gw.name,
    ]);
    ip(&["-n", &gw.name, "addr", "add", "172.16.0.1/30", "dev", "gw0"]);
    ip(&[
        "-n",
        &gw.name,
        "addr",
        "add",
        "fd68:6872:7468::1/64",
        "dev",
        "gw0",
        "nodad",
    ]);
    ip(&["-n", &gw.name, "link", "set", "gw0", "up"]);
    // IPv6 delivers to local addresses through lo.
    ip(&["-n", &gw.name, "link", "set", "lo", "up"]);
    let gateway6: Ipv6Addr = "fd68:6872:7468::1".parse().expect("gateway address");
    let listener = in_netns(&gw.path, move || {
        TcpListener::bind(SocketAddr::from((gateway6, 0))).expect("bind in the gateway ns")
    });
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut conn, peer) = listener.accept().expect("accept");
        conn.write_all(b"hello v6 guest\n").expect("write");
        peer
    });

    let etc = tempfile::tempdir().expect("tempdir");
    let etc_path = etc.path().to_path_buf();
    let cfg6 = parse6("fd68:6872:7468::2/64,fd68:6872:7468::1").expect("valid");
    let (again, reply) = in_netns(&guest.path, move || {
        // As the agent does with `hearth.net6=`: the IPv6 options before the NIC comes up.
        prepare6().expect("prepare6");
        let iface = configure(&hearth_config(), &etc_path).expect("configure");
        configure6(&cfg6, &iface).expect("configure6");
        // Once more (an agent restarted): the existing address and route are no error.
        let again = configure6(&cfg6, &iface).map_err(|e| e.to_string());
        // No duplicate address detection: the address is usable at once.
        let mut conn =
            TcpStream::connect_timeout(&SocketAddr::from((gateway6, port)), Duration::from_secs(10))
                .expect("connect to the gateway's test host over IPv6");
        let mut reply = String::new();
        conn.read_to_string(&mut reply).expect("read");
        (again, reply)
    });
    assert_eq!(again, Ok(()));
    assert_eq!(reply, "hello v6 guest\n");
    let peer = server.join().expect("server");
    assert_eq!(
        peer.ip(),
        IpAddr::V6("fd68:6872:7468::2".parse().expect("guest address"))
    );
    let addr = ip_out(&[
        "-n",
        &guest.name,
        "-6",
        "-o",
        "addr",
        "show",
        "dev",
        "eth0",
        "scope",
        "global",
    ]);
    assert!(addr.contains("inet6 fd68:6872:7468::2/64 "), "{addr}");
    // Neither address waits for duplicate address detection (a tentative link-local one stalls connections).
    let all = ip_out(&["-n", &guest.name, "-6", "-o", "addr", "show", "dev", "eth0"]);
    assert!(!all.contains("tentative"), "{all}");
    let route = ip_out(&["-n", &guest.name, "-6", "route", "show", "default"]);
    assert!(
        route.starts_with("default via fd68:6872:7468::1 dev eth0 "),
        "{route}"
    );
    let dad = in_netns(&guest.path, || {
        std::fs::read_to_string("/proc/sys/net/ipv6/conf/eth0/accept_dad").expect("accept_dad")
    });
    assert_eq!(dad.trim(), "0");
    // The IPv4 side is as before.
    let route4 = ip_out(&["-n", &guest.name, "route", "show", "default"]);
    assert_eq!(route4.trim(), "default via 172.16.0.1 dev eth0", "{route4}");
}
