//! The always-denied ranges added for IPv6 prefixes that carry IPv4 (NAT64, 6to4, Teredo, IPv4-compatible and
//! SIIT forms) and for cloud host services in public space (Azure's `168.63.129.16`, the 6to4 relay anycast),
//! on the kernel path: test hosts on the fake internet (see `plane_fixture`) answer on those addresses, the
//! uplink namespace reaches them, and a guest whose policy allows them by name still cannot: every attempt is
//! dropped by the sandbox's nftables rules with reason `always_denied` (read back from NFLOG). Needs root.

#![allow(clippy::unwrap_used)]

mod plane_fixture;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use hearth_api::network::NetProtocol;
use hearth_net::nflog::KernelEvent;
use plane_fixture::*;

/// Test hosts on the new always-denied addresses: each "would answer if reached".
fn denied_hosts() -> Vec<IpAddr> {
    let v4 = [Ipv4Addr::new(168, 63, 129, 16), Ipv4Addr::new(192, 88, 99, 1)];
    let v6 = [
        // NAT64 (well-known and local-use prefixes) of HOST_A, 203.0.113.10.
        "64:ff9b::cb00:710a",
        "64:ff9b:1::cb00:710a",
        // 6to4 of HOST_A; Teredo with HOST_A as server.
        "2002:cb00:710a::1",
        "2001:0:cb00:710a::1",
        // IPv4-compatible and SIIT-translated forms of HOST_A.
        "::cb00:710a",
        "::ffff:0:cb00:710a",
    ];
    v4.into_iter()
        .map(IpAddr::V4)
        .chain(v6.iter().map(|a| IpAddr::V6(a.parse::<Ipv6Addr>().unwrap())))
        .collect()
}

#[test]
fn ipv4_carrying_prefixes_and_host_services_are_dropped_by_the_kernel() {
    let net = FakeNet::new6(31);
    let hosts = denied_hosts();
    let mut script = String::new();
    for h in &hosts {
        let len = if h.is_ipv4() { 32 } else { 128 };
        script.push_str(&format!("addr add {h}/{len} dev lo\n"));
    }
    ip_batch(&net.inet.name, &script);
    let (tcp_srv, udp_srv) = (Server::default(), Server::default());
    for h in &hosts {
        tcp_server_on(&net.inet.path, SocketAddr::new(*h, 8080), &tcp_srv);
        udp_server_on(&net.inet.path, SocketAddr::new(*h, 8080), &udp_srv);
    }
    // The fake internet answers on every one of them (so a drop below is the sandbox's rules, not a missing
    // route): from the uplink namespace, which routes to it like the host would.
    for h in &hosts {
        must_tcp(&net.up.path, SocketAddr::new(*h, 8080));
    }
    let reached_from_uplink = tcp_srv.count();
    assert_eq!(reached_from_uplink, hosts.len());

    // The policy allows them all by CIDR (and everything else by default): always-denied wins.
    let sb = net.with(2, |s| {
        s.default_allow = true;
        s.allow = [
            "168.63.129.16/32",
            "192.88.99.0/24",
            "64:ff9b::/96",
            "64:ff9b:1::/48",
            "2002::/16",
            "2001::/32",
            "::/96",
            "::ffff:0:0:0/96",
        ]
        .iter()
        .map(|n| n.parse().unwrap())
        .collect();
    });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::channel(256);
    let task = {
        let _entered = rt.enter();
        hearth_net::nflog::spawn_nflog(&sb.ns(), hearth_net::ruleset::NFLOG_GROUP, tx).unwrap()
    };

    let g = &sb.guest.path;
    let _control = net.tcp_server(8081);
    must_tcp(g, sa(HOST_A, 8081)); // the path works
    let targets: Vec<SocketAddr> = hosts.iter().map(|h| SocketAddr::new(*h, 8080)).collect();
    must_not_tcp_any(g, &targets);
    for t in &targets {
        must_not_udp(g, *t);
    }
    assert_eq!(
        tcp_srv.count(),
        reached_from_uplink,
        "a guest connection reached an always-denied test host: {:?}",
        tcp_srv.seen.lock().unwrap()
    );
    assert_eq!(
        udp_srv.count(),
        0,
        "a guest datagram reached an always-denied test host"
    );

    let mut events: Vec<KernelEvent> = Vec::new();
    rt.block_on(async {
        while let Ok(Some(ev)) = tokio::time::timeout(Duration::from_millis(1500), rx.recv()).await {
            events.push(ev);
        }
    });
    for h in &hosts {
        for protocol in [NetProtocol::Tcp, NetProtocol::Udp] {
            let want = KernelEvent {
                allowed: false,
                reason: "always_denied".into(),
                protocol,
                destination: *h,
                port: Some(8080),
            };
            assert!(events.contains(&want), "{want:?} missing from {events:?}");
        }
        assert!(
            !events.iter().any(|e| e.destination == *h && e.allowed),
            "{h} was allowed: {events:?}"
        );
    }
    task.abort();
}
