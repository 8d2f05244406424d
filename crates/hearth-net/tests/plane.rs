//! The data plane against a fake internet made of network namespaces (see `plane_fixture`). Needs root and
//! `ip`/`nft`. Every test uses its own sandbox range (10.213.<n>.0/24) and namespaces, so they run in parallel.

#![allow(clippy::unwrap_used)]

mod plane_fixture;

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use hearth_net::netns::in_netns;
use hearth_net::plane::{GuestLink, link_name};
use hearth_net::{GATEWAY, GUEST_ADDR, PROXY_PORT};
use plane_fixture::*;

#[test]
fn default_allow_reaches_test_hosts_over_tcp_and_udp() {
    let net = FakeNet::new(10);
    let tcp_srv = net.tcp_server(8080);
    let udp_srv = net.udp_server(7000);
    let sb = net.with(2, |_| {});
    let g = &sb.guest.path;

    // Masqueraded at the hub: the host sees the uplink's address.
    assert_eq!(must_tcp(g, sa(HOST_A, 8080)), format!("peer={UPLINK_ADDR}"));
    assert_eq!(must_tcp(g, sa(HOST_B, 8080)), format!("peer={UPLINK_ADDR}"));
    assert_eq!(must_udp(g, sa(HOST_A, 7000)), format!("peer={UPLINK_ADDR}"));
    assert_eq!(tcp_srv.seen_to(HOST_A.into()).len(), 1);
    assert_eq!(udp_srv.seen_to(HOST_A.into()).len(), 1);

    // The guest has no IPv6 path: no IPv6 address anywhere in the sandbox namespace.
    let v6 = output(
        "ip",
        &["-n", &hearth_net::netns_name(&sb.net.id), "-6", "addr", "show"],
    );
    assert!(v6.trim().is_empty(), "{v6}");
}

#[test]
fn default_deny_with_a_cidr_allow_reaches_only_that_cidr() {
    let net = FakeNet::new(11);
    let _tcp = net.tcp_server(8080);
    let udp_srv = net.udp_server(7000);
    let sb = net.with(2, |s| {
        s.default_allow = false;
        s.allow = vec!["203.0.113.0/24".parse().unwrap()];
    });
    let g = &sb.guest.path;
    must_tcp(g, sa(HOST_A, 8080));
    must_udp(g, sa(HOST_A, 7000));
    must_not_tcp(g, sa(HOST_B, 8080));
    must_not_udp(g, sa(HOST_B, 7000));
    assert!(
        udp_srv.seen_to(HOST_B.into()).is_empty(),
        "a denied datagram reached the host"
    );
}

#[test]
fn deny_wins_over_allow() {
    let net = FakeNet::new(12);
    let _tcp = net.tcp_server(8080);
    let sb = net.with(2, |s| {
        s.default_allow = true;
        s.allow = vec!["203.0.113.10/32".parse().unwrap()];
        s.deny = vec!["203.0.113.0/24".parse().unwrap()];
    });
    must_not_tcp(&sb.guest.path, sa(HOST_A, 8080));
    must_tcp(&sb.guest.path, sa(HOST_B, 8080));
}

#[test]
fn always_denied_destinations_are_unreachable_whatever_the_policy() {
    let net = FakeNet::new(13);
    let inet = net.tcp_server(8080);
    let uplink_srv = tcp_server(&net.up.path, sa(Ipv4Addr::UNSPECIFIED, 8080));
    let uplink_addrs = net.plane.uplink_addresses().unwrap();
    assert!(
        uplink_addrs.contains(&IpAddr::V4(UPLINK_ADDR)),
        "{uplink_addrs:?}"
    );
    let sb = net.with(2, |s| {
        s.default_allow = true;
        s.allow = vec!["0.0.0.0/0".parse().unwrap()];
        s.extra_denied = uplink_addrs.clone();
    });
    let g = &sb.guest.path;
    must_tcp(g, sa(HOST_A, 8080)); // the path works
    let denied = [METADATA, PRIVATE, UPLINK_ADDR, net.plane.hub_address(), GATEWAY];
    must_not_tcp_any(g, &denied.map(|d| sa(d, 8080)));
    assert!(inet.seen_to(METADATA.into()).is_empty());
    assert!(inet.seen_to(PRIVATE.into()).is_empty());
    assert_eq!(
        uplink_srv.count(),
        0,
        "the uplink namespace accepted a connection from the guest"
    );
}

#[test]
fn nothing_from_the_uplink_or_the_internet_reaches_the_guest() {
    let net = FakeNet::new(14);
    let sb = net.with(2, |_| {});
    let guest_srv = tcp_server(&sb.guest.path, sa(Ipv4Addr::UNSPECIFIED, 8080));
    // From the hub/uplink namespace itself, and from a host of the internet (routed via the uplink).
    must_not_tcp(&net.up.path, sa(sb.net.address, 8080));
    must_not_tcp(&net.inet.path, sa(sb.net.address, 8080));
    assert!(udp(&net.up.path, None, sa(sb.net.address, 8080), "x", DENY_TIMEOUT).is_err());
    assert_eq!(guest_srv.count(), 0);
    // The guest's own connections out still work, and their answers come back.
    let _srv = net.tcp_server(8081);
    must_tcp(&sb.guest.path, sa(HOST_A, 8081));
}

#[test]
fn peers_reach_each_other_and_nobody_else_and_changes_apply_at_once() {
    let net = FakeNet::new(15);
    let (a_addr, b_addr, c_addr) = (net.addr(2), net.addr(3), net.addr(4));
    let a = net.with(2, |s| s.peers = vec![b_addr]);
    let mut b = net.with(3, |s| s.peers = vec![a_addr]);
    let c = net.with(4, |_| {});
    net.plane.set_peer_pairs(&[(a_addr, b_addr)]).unwrap();
    let port = 9000;
    let a_srv = tcp_server(&a.guest.path, sa(Ipv4Addr::UNSPECIFIED, port));
    let b_srv = tcp_server(&b.guest.path, sa(Ipv4Addr::UNSPECIFIED, port));
    let c_srv = tcp_server(&c.guest.path, sa(Ipv4Addr::UNSPECIFIED, port));

    // A and B reach each other at their sandbox addresses and see each other's.
    assert_eq!(
        must_tcp(&a.guest.path, sa(b_addr, port)),
        format!("peer={a_addr}")
    );
    assert_eq!(
        must_tcp(&b.guest.path, sa(a_addr, port)),
        format!("peer={b_addr}")
    );
    // C is nobody's peer.
    must_not_tcp_any(&c.guest.path, &[sa(a_addr, port), sa(b_addr, port)]);
    must_not_tcp(&a.guest.path, sa(c_addr, port));
    assert_eq!(c_srv.count(), 0);
    let (a_seen, b_seen) = (a_srv.count(), b_srv.count());

    // Removing the pair at the hub cuts them at once; putting it back restores them.
    net.plane.set_peer_pairs(&[]).unwrap();
    must_not_tcp(&a.guest.path, sa(b_addr, port));
    net.plane.set_peer_pairs(&[(b_addr, a_addr)]).unwrap();
    must_tcp(&a.guest.path, sa(b_addr, port));

    // B's own rules drop A once A is no longer B's peer, even with the hub still allowing the pair.
    b.net.peers.clear();
    net.plane.apply_rules(&b.net).unwrap();
    must_not_tcp(&a.guest.path, sa(b_addr, port));
    b.net.peers = vec![a_addr];
    net.plane.apply_rules(&b.net).unwrap();
    must_tcp(&a.guest.path, sa(b_addr, port));
    assert_eq!(b_srv.count(), b_seen + 2);
    assert_eq!(a_srv.count(), a_seen);
}

#[test]
fn a_policy_change_takes_effect_at_once() {
    let net = FakeNet::new(16);
    let _srv = net.tcp_server(8080);
    let mut sb = net.with(2, |_| {});
    let g = sb.guest.path.clone();
    must_tcp(&g, sa(HOST_A, 8080));
    // A connection open across the change (table replaced) keeps working: only new ones are judged again.
    echo_server(&net.inet.path, sa(HOST_A, 9000));
    let mut open = in_netns(&g, || {
        std::net::TcpStream::connect_timeout(&sa(HOST_A, 9000), ALLOW_TIMEOUT)
    })
    .unwrap();
    open.set_read_timeout(Some(ALLOW_TIMEOUT)).unwrap();
    assert_eq!(echo(&mut open, "before"), "before");
    sb.net.default_allow = false;
    net.plane.apply_rules(&sb.net).unwrap();
    must_not_tcp(&g, sa(HOST_A, 8080));
    assert_eq!(echo(&mut open, "after"), "after");
    sb.net.allow = vec!["203.0.113.10/32".parse().unwrap()];
    net.plane.apply_rules(&sb.net).unwrap();
    must_tcp(&g, sa(HOST_A, 8080));
    must_not_tcp(&g, sa(HOST_B, 8080));
}

#[test]
fn spoofed_sources_from_the_guest_are_dropped() {
    let net = FakeNet::new(17);
    let srv = net.udp_server(7000);
    let sb = net.with(2, |_| {});
    let g = &sb.guest.path;
    // Further addresses on the guest's NIC, used as spoofed sources: a public one, and another sandbox's
    // (which the hub would pass and masquerade, so only the sandbox's own rules stop it).
    for (i, spoofed) in [Ipv4Addr::new(203, 0, 113, 99), net.addr(3)]
        .into_iter()
        .enumerate()
    {
        ip(&[
            "-n",
            &sb.guest.name,
            "addr",
            "add",
            &format!("{spoofed}/32"),
            "dev",
            "eth0",
        ]);
        let payload = format!("spoofed-ip-{i}");
        assert!(udp(g, Some(spoofed.into()), sa(HOST_A, 7000), &payload, DENY_TIMEOUT).is_err());
    }
    assert!(
        udp(
            g,
            Some(GUEST_ADDR.into()),
            sa(HOST_A, 7000),
            "genuine",
            ALLOW_TIMEOUT
        )
        .is_ok()
    );
    // A foreign MAC with the right address is dropped too.
    ip(&[
        "-n",
        &sb.guest.name,
        "link",
        "set",
        "eth0",
        "address",
        "02:00:00:00:00:99",
    ]);
    assert!(
        udp(
            g,
            Some(GUEST_ADDR.into()),
            sa(HOST_A, 7000),
            "spoofed-mac",
            DENY_TIMEOUT
        )
        .is_err()
    );
    let payloads: Vec<String> = srv.seen.lock().unwrap().iter().map(|s| s.2.clone()).collect();
    assert_eq!(payloads, vec!["genuine".to_owned()]);
}

#[test]
fn dns_to_anyone_but_the_gateway_is_dropped() {
    let net = FakeNet::new(18);
    let udp53 = Server::default();
    udp_server_on(&net.inet.path, sa(HOST_A, 53), &udp53);
    let tcp53 = tcp_server(&net.inet.path, sa(HOST_A, 53));
    let dot = tcp_server(&net.inet.path, sa(HOST_A, 853));
    let _control = net.udp_server(5353);
    let sb = net.with(2, |s| s.allow = vec!["203.0.113.0/24".parse().unwrap()]);
    let g = &sb.guest.path;
    must_udp(g, sa(HOST_A, 5353));
    must_not_udp(g, sa(HOST_A, 53));
    must_not_tcp(g, sa(HOST_A, 53));
    must_not_tcp(g, sa(HOST_A, 853));
    assert_eq!(udp53.count() + tcp53.count() + dot.count(), 0);
    // The platform resolver's place, the gateway, is reachable on 53.
    let resolver = Server::default();
    udp_server_on(&sb.ns(), sa(GATEWAY, 53), &resolver);
    assert_eq!(must_udp(g, sa(GATEWAY, 53)), format!("peer={GUEST_ADDR}"));
}

#[test]
fn proxy_tcp_redirects_web_ports_to_the_gateway() {
    let net = FakeNet::new(19);
    let web = net.tcp_server(80);
    let other = net.tcp_server(8080);
    let sb = net.with(2, |s| s.proxy_tcp = true);
    let g = sb.guest.path.clone();
    let proxy = hearth_net::netns::tcp_listener(&sb.ns(), sa(GATEWAY, PROXY_PORT)).unwrap();
    let gateway_ssh = tcp_server(&sb.ns(), sa(GATEWAY, 22));
    let client = std::thread::spawn(move || tcp(&g, sa(HOST_A, 80), ALLOW_TIMEOUT));
    let (mut conn, peer) =
        accept_within(&proxy, ALLOW_TIMEOUT).expect("the redirected connection reaches the proxy");
    assert_eq!(peer.ip(), IpAddr::V4(GUEST_ADDR));
    // The proxy learns where the guest wanted to go.
    let orig = nix::sys::socket::getsockopt(&conn, nix::sys::socket::sockopt::OriginalDst).unwrap();
    let orig = SocketAddr::from((
        Ipv4Addr::from(u32::from_be(orig.sin_addr.s_addr)),
        u16::from_be(orig.sin_port),
    ));
    assert_eq!(orig, sa(HOST_A, 80));
    std::io::Write::write_all(&mut conn, b"from-proxy").unwrap();
    drop(conn);
    assert_eq!(client.join().unwrap().unwrap(), "from-proxy");
    assert_eq!(web.count(), 0, "port 80 bypassed the proxy");
    // Other ports go straight out; other gateway ports are closed to the guest.
    must_tcp(&sb.guest.path, sa(HOST_A, 8080));
    assert_eq!(other.count(), 1);
    must_not_tcp(&sb.guest.path, sa(GATEWAY, 22));
    assert_eq!(gateway_ssh.count(), 0);
}

#[test]
fn destroy_and_sweep_leave_nothing_behind() {
    let net = FakeNet::new(20);
    let _srv = net.tcp_server(8080);
    let a = net.with(2, |_| {});
    let b = net.with(3, |_| {});
    let c = net.with(4, |_| {});
    let ghost = net.addr(77); // an address no sandbox has (any more)
    let (a_addr, b_addr, c_addr) = (a.net.address, b.net.address, c.net.address);
    net.plane
        .set_peer_pairs(&[(a_addr, b_addr), (b_addr, c_addr), (b_addr, ghost)])
        .unwrap();
    let hub_links = || {
        links(&net.up.name)
            .into_iter()
            .filter(|l| l.starts_with("hrth"))
            .collect::<HashSet<_>>()
    };
    let hub_pairs = || {
        let up = net.up.name.as_str();
        output(
            "ip",
            &[
                "netns",
                "exec",
                up,
                "nft",
                "list",
                "set",
                "inet",
                "hearth_hub",
                "peer_pairs",
            ],
        )
    };
    assert_eq!(hub_links().len(), 3);

    // Destroying A removes its namespace, its link, the guest's end and every pair naming A.
    net.plane.destroy_sandbox(&a.net.id).unwrap();
    net.plane.destroy_sandbox(&a.net.id).unwrap(); // idempotent
    assert!(!namespaces().contains(&hearth_net::netns_name(&a.net.id)));
    assert!(!hub_links().contains(&link_name(&a.net.id)));
    assert!(
        links(&a.guest.name).iter().all(|l| l == "lo"),
        "the guest end went with the sandbox"
    );
    let pairs = hub_pairs();
    assert!(!pairs.contains(&a_addr.to_string()), "{pairs}");
    assert!(pairs.contains(&format!("{b_addr} . {c_addr}")), "{pairs}");

    // After a "restart" only B is live: C goes, and so do the pairs naming C or the ghost.
    let plane = hearth_net::plane::Plane::new(net.plane.config().clone()).unwrap();
    let live: HashSet<String> = [b.net.id.clone()].into();
    let removed = plane.sweep(&live).unwrap();
    let c_ns = hearth_net::netns_name(&c.net.id);
    assert!(removed.contains(&format!("netns {c_ns}")), "{removed:?}");
    for (x, y) in [(b_addr, c_addr), (b_addr, ghost)] {
        assert!(removed.contains(&format!("peer {x} . {y}")), "{removed:?}");
        assert!(removed.contains(&format!("peer {y} . {x}")), "{removed:?}");
    }
    assert!(!namespaces().contains(&c_ns));
    assert_eq!(hub_links(), [link_name(&b.net.id)].into());
    let pairs = hub_pairs();
    assert!(!pairs.contains("10.213."), "{pairs}");
    // B is untouched and still works; a second sweep finds nothing.
    must_tcp(&b.guest.path, sa(HOST_A, 8080));
    // (Another test's namespace that lost its uplink may be swept too: only ours are compared.)
    let ours = |removed: Vec<String>| -> Vec<String> {
        removed
            .into_iter()
            .filter(|r| !r.starts_with("netns ") || r.contains(&b.net.id))
            .collect()
    };
    assert_eq!(ours(plane.sweep(&live).unwrap()), Vec::<String>::new());

    // Everything gone with the last sandbox.
    let removed = ours(plane.sweep(&HashSet::new()).unwrap());
    assert_eq!(
        removed,
        vec![format!("netns {}", hearth_net::netns_name(&b.net.id))]
    );
    assert!(hub_links().is_empty());
    for sb in [&a, &b, &c] {
        assert!(!namespaces().contains(&hearth_net::netns_name(&sb.net.id)));
    }
}

#[test]
fn a_failed_create_leaves_nothing_behind() {
    let net = FakeNet::new(21);
    let mut sb = net.sandbox(2);
    sb.net.guest_link = GuestLink::Veth {
        guest_netns: "/run/netns/hxt-does-not-exist".into(),
    };
    assert!(net.plane.create_sandbox(&sb.net).is_err());
    assert!(!namespaces().contains(&hearth_net::netns_name(&sb.net.id)));
    assert!(links(&net.up.name).iter().all(|l| !l.starts_with("hrth")));
    // An address outside the range is refused before anything is made.
    let mut bad = net.sandbox(2);
    bad.net.address = "10.99.0.5".parse().unwrap();
    assert!(net.plane.create_sandbox(&bad.net).is_err());
    assert!(!namespaces().contains(&hearth_net::netns_name(&bad.net.id)));
    // A taken uplink link name (two ids hashing alike) is refused, and the link's owner is untouched.
    let mut twin = net.sandbox(4);
    ip(&[
        "-n",
        &net.up.name,
        "link",
        "add",
        &link_name(&twin.net.id),
        "type",
        "veth",
        "peer",
        "name",
        "twin0",
    ]);
    twin.net.guest_link = GuestLink::Tap;
    assert!(matches!(
        net.plane.create_sandbox(&twin.net),
        Err(hearth_net::plane::NetError::LinkTaken { .. })
    ));
    assert!(links(&net.up.name).contains(&link_name(&twin.net.id)));
    assert!(!namespaces().contains(&hearth_net::netns_name(&twin.net.id)));
    ip(&["-n", &net.up.name, "link", "del", &link_name(&twin.net.id)]);
    // The same id can be created afterwards.
    sb.net.guest_link = GuestLink::Veth {
        guest_netns: sb.guest.path.clone(),
    };
    net.create(&sb);
    let _srv = net.tcp_server(8080);
    must_tcp(&sb.guest.path, sa(HOST_A, 8080));
}

#[test]
fn tap_sandboxes_get_a_persistent_tap() {
    let net = FakeNet::new(22);
    let mut sb = net.sandbox(2);
    sb.net.guest_link = GuestLink::Tap;
    net.create(&sb);
    let name = hearth_net::netns_name(&sb.net.id);
    let detail = output("ip", &["-n", &name, "-d", "link", "show", "tap0"]);
    assert!(
        detail.contains("tun type tap") && detail.contains("persist"),
        "{detail}"
    );
    assert!(detail.contains(hearth_net::GATEWAY_MAC), "{detail}");
    let addrs = output("ip", &["-n", &name, "-4", "addr", "show", "tap0"]);
    assert!(addrs.contains("172.16.0.1/30"), "{addrs}");
    net.plane.destroy_sandbox(&sb.net.id).unwrap();
    assert!(!namespaces().contains(&name));
}

#[test]
fn nflog_reports_allowed_and_denied_attempts() {
    let net = FakeNet::new(23);
    let _srv = net.tcp_server(8080);
    let sb = net.with(2, |s| {
        s.default_allow = false;
        s.allow = vec!["203.0.113.0/24".parse().unwrap()];
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(64);
    let task = {
        let _entered = rt.enter();
        hearth_net::nflog::spawn_nflog(&sb.ns(), hearth_net::ruleset::NFLOG_GROUP, tx).unwrap()
    };
    // A second reader for the same group in the same namespace is refused.
    let (tx2, _rx2) = tokio::sync::mpsc::channel(1);
    {
        let _entered = rt.enter();
        assert!(hearth_net::nflog::spawn_nflog(&sb.ns(), hearth_net::ruleset::NFLOG_GROUP, tx2).is_err());
    }

    must_tcp(&sb.guest.path, sa(HOST_A, 8080));
    must_not_tcp(&sb.guest.path, sa(HOST_B, 8080));
    must_not_udp(&sb.guest.path, sa(HOST_A, 53));
    let spoofed = Ipv4Addr::new(203, 0, 113, 99);
    ip(&[
        "-n",
        &sb.guest.name,
        "addr",
        "add",
        &format!("{spoofed}/32"),
        "dev",
        "eth0",
    ]);
    assert!(
        udp(
            &sb.guest.path,
            Some(spoofed.into()),
            sa(HOST_A, 7000),
            "x",
            Duration::from_millis(300)
        )
        .is_err()
    );

    use hearth_api::network::NetProtocol;
    use hearth_net::nflog::KernelEvent;
    let expect = |allowed, reason: &str, protocol, destination: Ipv4Addr, port| KernelEvent {
        allowed,
        reason: reason.into(),
        protocol,
        destination: destination.into(),
        port: Some(port),
    };
    let wanted = [
        expect(true, "allow_rule", NetProtocol::Tcp, HOST_A, 8080),
        expect(false, "default_deny", NetProtocol::Tcp, HOST_B, 8080),
        expect(false, "dns_blocked", NetProtocol::Udp, HOST_A, 53),
        expect(false, "spoofed", NetProtocol::Udp, HOST_A, 7000),
    ];
    // The denied SYN was retransmitted during the probe and logged again by the kernel: the reader reports
    // each attempt once.
    let mut events = Vec::new();
    rt.block_on(async {
        while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(1500), rx.recv()).await {
            events.push(ev);
        }
    });
    assert_eq!(events.len(), wanted.len(), "{events:?}");
    for w in &wanted {
        assert!(events.contains(w), "{w:?} missing from {events:?}");
    }
    task.abort();
}

/// Accepts one connection on a non-blocking listener, or gives up after `timeout`.
fn accept_within(l: &std::net::TcpListener, timeout: Duration) -> Option<(std::net::TcpStream, SocketAddr)> {
    let deadline = std::time::Instant::now() + timeout;
    while std::time::Instant::now() < deadline {
        match l.accept() {
            Ok((s, peer)) => {
                s.set_nonblocking(false).unwrap();
                return Some((s, peer));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) => panic!("accept: {e}"),
        }
    }
    None
}

#[test]
fn sweep_removes_sandboxes_whose_uplink_is_gone() {
    let gone = FakeNet::new(24);
    let orphan = gone.with(2, |_| {});
    let orphan_ns = hearth_net::netns_name(&orphan.net.id);
    // The uplink namespace disappears (a test or daemon that died): the sandbox loses its uplink link.
    ip(&["netns", "del", &gone.up.name]);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while links(&orphan_ns).iter().any(|l| l == "up0") {
        assert!(
            std::time::Instant::now() < deadline,
            "up0 outlived its peer's namespace"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Any plane's sweep removes it, and leaves a live sandbox of another plane alone.
    let other = FakeNet::new(25);
    let mine = other.with(2, |_| {});
    let live: HashSet<String> = [mine.net.id.clone()].into();
    let removed = other.plane.sweep(&live).unwrap();
    // (A sweep of another test running at the same time may have taken it first.)
    assert!(!namespaces().contains(&orphan_ns), "{removed:?}");
    assert!(!removed.iter().any(|r| r.contains(&mine.net.id)), "{removed:?}");
    let _srv = other.tcp_server(8080);
    must_tcp(&mine.guest.path, sa(HOST_A, 8080));
}

/// tap0's link-local address, with the guest's interface as scope, port 8080.
fn tap_link_local(sb: &Sandbox) -> SocketAddr {
    let ns = hearth_net::netns_name(&sb.net.id);
    let addrs = output(
        "ip",
        &[
            "-n", &ns, "-6", "-o", "addr", "show", "dev", "tap0", "scope", "link",
        ],
    );
    let ll: std::net::Ipv6Addr = addrs
        .split_whitespace()
        .skip_while(|w| *w != "inet6")
        .nth(1)
        .and_then(|a| a.split('/').next()?.parse().ok())
        .unwrap_or_else(|| panic!("no link-local address on tap0: {addrs:?}"));
    let link = output("ip", &["-n", &sb.guest.name, "-o", "link", "show", "eth0"]);
    let scope: u32 = link.split(':').next().unwrap().trim().parse().unwrap();
    SocketAddr::V6(std::net::SocketAddrV6::new(ll, 8080, 0, scope))
}

#[test]
fn ipv6_default_allow_reaches_test_hosts_over_tcp_and_udp_and_nothing_gets_in() {
    let net = FakeNet::new6(26);
    let (tcp_srv, udp_srv) = servers6(&net.inet.path, 8080);
    let _v4 = net.tcp_server(8080);
    let sb = net.with(2, |_| {});
    let g = &sb.guest.path;
    // Masqueraded at the hub: the host sees the uplink's IPv6 address.
    assert_eq!(must_tcp(g, sa6(HOST_A6, 8080)), format!("peer={UPLINK_ADDR6}"));
    assert_eq!(must_udp(g, sa6(HOST_A6, 8080)), format!("peer={UPLINK_ADDR6}"));
    assert_eq!(must_tcp(g, sa6(HOST_B6, 8080)), format!("peer={UPLINK_ADDR6}"));
    assert_eq!(tcp_srv.seen_to(HOST_A6.into()).len(), 1);
    assert_eq!(udp_srv.seen_to(HOST_A6.into()).len(), 1);
    // IPv4 still works alongside.
    assert_eq!(must_tcp(g, sa(HOST_A, 8080)), format!("peer={UPLINK_ADDR}"));

    // The sandbox's IPv6 address is the range's prefix with its IPv4 address in the low bits, and nothing
    // from the uplink or the internet opens a connection to it.
    let addr6 = net.plane.sandbox_address6(sb.net.address).unwrap();
    assert_eq!(addr6.to_string(), "2001:db8:ff00:26::ad5:1a02");
    let guest_srv = tcp_server(&sb.guest.path, sa6(std::net::Ipv6Addr::UNSPECIFIED, 9000));
    must_not_tcp(&net.up.path, sa6(addr6, 9000));
    must_not_tcp(&net.inet.path, sa6(addr6, 9000));
    must_not_tcp(&net.inet.path, sa6(hearth_net::GUEST_ADDR6, 9000));
    assert_eq!(guest_srv.count(), 0);
}

#[test]
fn ipv6_default_deny_with_a_v6_cidr_allowed_reaches_only_that() {
    let net = FakeNet::new6(27);
    let (_tcp, udp_srv) = servers6(&net.inet.path, 8080);
    let _v4 = net.tcp_server(8080);
    let mut sb = net.with(2, |s| {
        s.default_allow = false;
        s.allow = vec!["2001:db8:1::/48".parse().unwrap()];
    });
    let g = sb.guest.path.clone();
    must_tcp(&g, sa6(HOST_A6, 8080));
    must_udp(&g, sa6(HOST_A6, 8080));
    must_not_tcp(&g, sa6(HOST_B6, 8080));
    must_not_udp(&g, sa6(HOST_B6, 8080));
    must_not_tcp(&g, sa(HOST_A, 8080));
    assert!(
        udp_srv.seen_to(HOST_B6.into()).is_empty(),
        "a denied datagram reached the host"
    );
    // A deny CIDR wins over the allow, at once.
    sb.net.deny = vec![IpAddr::V6(HOST_A6).into()];
    net.plane.apply_rules(&sb.net).unwrap();
    must_not_tcp(&g, sa6(HOST_A6, 8080));
}

#[test]
fn ipv6_always_denied_destinations_are_unreachable_whatever_the_policy() {
    let net = FakeNet::new6(28);
    let (tcp_srv, udp_srv) = servers6(&net.inet.path, 8080);
    let uplink_srv = tcp_server(&net.up.path, sa6(std::net::Ipv6Addr::UNSPECIFIED, 8080));
    let uplink_addrs = net.plane.uplink_addresses().unwrap();
    assert!(
        uplink_addrs.contains(&IpAddr::V6(UPLINK_ADDR6)),
        "{uplink_addrs:?}"
    );
    let sb = net.with(2, |s| {
        s.default_allow = true;
        s.allow = vec!["::/0".parse().unwrap()];
        s.extra_denied = uplink_addrs.clone();
    });
    let other = net.with(3, |_| {});
    let other_srv = tcp_server(&other.guest.path, sa6(std::net::Ipv6Addr::UNSPECIFIED, 8080));
    // Something listens in the sandbox namespace too (the gateway's addresses).
    let gw_srv = tcp_server(&sb.ns(), sa6(std::net::Ipv6Addr::UNSPECIFIED, 8080));
    let g = &sb.guest.path;
    must_tcp(g, sa6(HOST_A6, 8080)); // the path works
    let denied = [
        sa6(ULA6, 8080),
        sa6(METADATA6, 8080),
        sa6(UPLINK_ADDR6, 8080),
        sa6(net.plane.hub_address6().unwrap(), 8080),
        sa6(net.plane.sandbox_address6(other.net.address).unwrap(), 8080),
        sa6(hearth_net::GATEWAY6, 8080),
        tap_link_local(&sb),
    ];
    must_not_tcp_any(g, &denied);
    must_not_udp(g, sa6(ULA6, 8080));
    must_not_udp(g, sa6(METADATA6, 8080));
    assert!(tcp_srv.seen_to(ULA6.into()).is_empty());
    assert!(tcp_srv.seen_to(METADATA6.into()).is_empty());
    assert!(udp_srv.seen_to(ULA6.into()).is_empty());
    assert!(udp_srv.seen_to(METADATA6.into()).is_empty());
    assert_eq!(
        uplink_srv.count(),
        0,
        "the uplink namespace accepted a connection from the guest"
    );
    assert_eq!(other_srv.count(), 0, "another sandbox accepted a connection");
    assert_eq!(
        gw_srv.count(),
        0,
        "the sandbox namespace accepted a connection from the guest"
    );
}

#[test]
fn ipv6_spoofed_sources_from_the_guest_are_dropped() {
    let net = FakeNet::new6(29);
    let (_tcp, srv) = servers6(&net.inet.path, 7000);
    let sb = net.with(2, |_| {});
    let g = &sb.guest.path;
    // A public address, another sandbox's IPv6 address (which the hub would pass and masquerade) and another
    // address of the guest's own subnet.
    let spoofs: [std::net::Ipv6Addr; 3] = [
        "2001:db8:1::99".parse().unwrap(),
        net.plane.sandbox_address6(net.addr(3)).unwrap(),
        "fd68:6872:7468::3".parse().unwrap(),
    ];
    for (i, spoofed) in spoofs.into_iter().enumerate() {
        ip(&[
            "-n",
            &sb.guest.name,
            "addr",
            "add",
            &format!("{spoofed}/128"),
            "dev",
            "eth0",
            "nodad",
        ]);
        let payload = format!("spoofed-ip6-{i}");
        assert!(
            udp(
                g,
                Some(spoofed.into()),
                sa6(HOST_A6, 7000),
                &payload,
                DENY_TIMEOUT
            )
            .is_err()
        );
    }
    let genuine = udp(
        g,
        Some(hearth_net::GUEST_ADDR6.into()),
        sa6(HOST_A6, 7000),
        "genuine",
        ALLOW_TIMEOUT,
    );
    assert_eq!(genuine.unwrap(), format!("peer={UPLINK_ADDR6}"));
    let payloads: Vec<String> = srv.seen.lock().unwrap().iter().map(|s| s.2.clone()).collect();
    assert_eq!(payloads, vec!["genuine".to_owned()]);
}

#[test]
fn without_an_ipv6_range_a_guest_that_configures_ipv6_itself_gets_nothing_out() {
    let net = FakeNet::new(30);
    let (tcp_srv, udp_srv) = servers6(&net.inet.path, 8080);
    let sb = net.with(2, |s| s.allow = vec!["::/0".parse().unwrap()]);
    ip_batch(
        &sb.guest.name,
        &format!(
            "addr add {}/64 dev eth0 nodad\nroute add ::/0 via {} dev eth0\n",
            hearth_net::GUEST_ADDR6,
            hearth_net::GATEWAY6
        ),
    );
    must_not_tcp(&sb.guest.path, sa6(HOST_A6, 8080));
    must_not_udp(&sb.guest.path, sa6(HOST_A6, 8080));
    assert_eq!(tcp_srv.count() + udp_srv.count(), 0);
    assert!(net.plane.hub_address6().is_none());
    assert!(net.plane.sandbox_address6(sb.net.address).is_none());
}
