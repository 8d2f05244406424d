//! The egress proxy against a fake internet: test hosts on the loopback of a namespace the test made (the
//! proxy's uplink), a recording upstream resolver there, and "trap" hosts on always-denied addresses that count
//! any connection that should never happen. Guest connections come over loopback with an explicit original
//! destination, and in one test through real nftables REDIRECT in another test namespace (SO_ORIGINAL_DST).
//! Needs root.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hearth_api::{EgressDefault, EgressEvent, EgressPolicy};
use hearth_net::ctx::SandboxNetCtx;
use hearth_net::dns::Upstream;
use hearth_net::limits::{ConnBudget, NetLimits};
use hearth_net::policy::Policy;
use hearth_net::proxy::{Proxy, ProxyLimits, spawn_proxy};
use proxy_support::{Netns, TestDns, TestHost, http_get, tcp_host, tls_host, tls_read};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::CertificateDer;

const ZONE: &[(&str, &[&str])] = &[
    ("allowed.test", &["203.0.113.10"]),
    ("other.test", &["203.0.113.20"]),
    ("x.evil.test", &["203.0.113.10"]),
    ("rebind.test", &["10.0.0.7"]),
    ("meta.test", &["169.254.169.254"]),
    ("mixed.test", &["10.0.0.7", "203.0.113.10"]),
];

struct Internet {
    ns: Netns,
    dns: TestDns,
    ten: TestHost,
    twenty: TestHost,
    traps: Vec<TestHost>,
    tls_ten: TestHost,
    tls_twenty: TestHost,
    cert_ten: CertificateDer<'static>,
}

impl Internet {
    fn start() -> Internet {
        let ns = Netns::new("px");
        for ip in [
            "203.0.113.10",
            "203.0.113.20",
            "203.0.113.30",
            "203.0.113.53",
            "10.0.0.7",
            "169.254.169.254",
        ] {
            ns.add_host(ip);
        }
        let dns = TestDns::start(&ns, addr("203.0.113.53:53"), ZONE);
        let ten = tcp_host(&ns, addr("203.0.113.10:80"), "ten", false);
        let twenty = tcp_host(&ns, addr("203.0.113.20:80"), "twenty", false);
        let traps = vec![
            tcp_host(&ns, addr("10.0.0.7:80"), "trap-private", false),
            tcp_host(&ns, addr("169.254.169.254:80"), "trap-metadata", false),
            tcp_host(&ns, addr("10.0.0.7:443"), "trap-private-tls", false),
        ];
        let (tls_ten, cert_ten) = tls_host(&ns, addr("203.0.113.10:443"), "tls-ten", &["allowed.test"]);
        let (tls_twenty, _) = tls_host(
            &ns,
            addr("203.0.113.20:443"),
            "tls-twenty",
            &["allowed.test", "other.test"],
        );
        Internet {
            ns,
            dns,
            ten,
            twenty,
            traps,
            tls_ten,
            tls_twenty,
            cert_ten,
        }
    }

    fn proxy(&self, default: EgressDefault, allow: &[&str], deny: &[&str]) -> Arc<Proxy> {
        let ctx = Arc::new(SandboxNetCtx::new("sbx1", policy(default, allow, deny), vec![]));
        let upstream = Arc::new(Upstream::new(self.dns.addr, self.ns.path()));
        let limits = ProxyLimits {
            peek_timeout: Duration::from_millis(700),
            ..ProxyLimits::default()
        };
        Arc::new(Proxy::new(ctx, upstream, self.ns.path(), limits))
    }

    fn trap_hits(&self) -> usize {
        self.traps
            .iter()
            .map(|t| t.connections.load(Ordering::SeqCst))
            .sum()
    }
}

fn addr(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

fn policy(default: EgressDefault, allow: &[&str], deny: &[&str]) -> Policy {
    Policy::parse(&EgressPolicy {
        default,
        allow: allow.iter().map(|s| s.to_string()).collect(),
        deny: deny.iter().map(|s| s.to_string()).collect(),
    })
    .unwrap()
}

/// A guest connection over loopback whose proxy side is handled as if redirected from `orig_dst`.
async fn guest(proxy: &Arc<Proxy>, orig_dst: &str) -> TcpStream {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
    let (server_side, _) = listener.accept().await.unwrap();
    let proxy = proxy.clone();
    let orig = addr(orig_dst);
    tokio::spawn(async move { proxy.handle(server_side, orig).await });
    client
}

fn events(proxy: &Proxy) -> Vec<EgressEvent> {
    proxy.ctx().audit.snapshot().events
}

fn last(proxy: &Proxy) -> EgressEvent {
    events(proxy).pop().expect("an audit entry")
}

#[tokio::test]
async fn http_host_goes_where_the_resolver_says_not_where_the_guest_dialed() {
    let net = Internet::start();
    let proxy = net.proxy(EgressDefault::Deny, &["allowed.test"], &[]);
    // The guest dials .20 (not allowed) but names allowed.test: the proxy connects to allowed.test's address.
    let resp = http_get(guest(&proxy, "203.0.113.20:80").await, "allowed.test").await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.ends_with("ten host=allowed.test"), "{resp}");
    assert_eq!(net.twenty.connections.load(Ordering::SeqCst), 0);
    let e = last(&proxy);
    assert!(e.allowed);
    assert_eq!(e.destination.as_deref(), Some("203.0.113.10"));
    assert_eq!((e.port, e.name.as_deref()), (Some(80), Some("allowed.test")));
    assert_eq!(
        (e.reason.as_str(), e.rule.as_deref()),
        ("allow_rule", Some("allowed.test"))
    );
    assert!(net.dns.queries().contains(&"allowed.test".to_string()));
}

#[tokio::test]
async fn tls_sni_goes_where_the_resolver_says() {
    let net = Internet::start();
    let proxy = net.proxy(EgressDefault::Deny, &["allowed.test"], &[]);
    let got = tls_read(
        guest(&proxy, "203.0.113.20:443").await,
        "allowed.test",
        &net.cert_ten,
    )
    .await
    .unwrap();
    assert_eq!(got, "tls-ten");
    assert_eq!(net.tls_twenty.connections.load(Ordering::SeqCst), 0);
    assert_eq!(net.tls_ten.connections.load(Ordering::SeqCst), 1);
    let e = last(&proxy);
    assert_eq!(
        (e.allowed, e.name.as_deref(), e.port),
        (true, Some("allowed.test"), Some(443))
    );
    assert_eq!(e.destination.as_deref(), Some("203.0.113.10"));
}

#[tokio::test]
async fn names_the_policy_does_not_allow_are_refused() {
    let net = Internet::start();
    let proxy = net.proxy(
        EgressDefault::Deny,
        &["allowed.test", "*.evil.test"],
        &["x.evil.test"],
    );
    // Not named by any rule, default deny, dialed address not allowed.
    let resp = http_get(guest(&proxy, "203.0.113.20:80").await, "other.test").await;
    assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
    let e = last(&proxy);
    assert_eq!(
        (e.allowed, e.reason.as_str(), e.name.as_deref()),
        (false, "default_deny", Some("other.test"))
    );
    assert_eq!(e.destination.as_deref(), Some("203.0.113.20"));
    // Named by a deny rule (which wins over the wildcard allow), even though it resolves to an allowed host.
    let resp = http_get(guest(&proxy, "203.0.113.10:80").await, "x.evil.test").await;
    assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
    let e = last(&proxy);
    assert_eq!(
        (e.reason.as_str(), e.rule.as_deref()),
        ("deny_rule", Some("x.evil.test"))
    );
    // TLS to a refused name: the handshake fails.
    assert!(
        tls_read(
            guest(&proxy, "203.0.113.20:443").await,
            "other.test",
            &net.cert_ten
        )
        .await
        .is_err()
    );
    assert_eq!(net.ten.connections.load(Ordering::SeqCst), 0);
    assert_eq!(net.twenty.connections.load(Ordering::SeqCst), 0);
    assert_eq!(net.tls_twenty.connections.load(Ordering::SeqCst), 0);
    // A denied name is never looked up.
    assert!(
        !net.dns
            .queries()
            .iter()
            .any(|q| q == "x.evil.test" || q == "other.test"),
        "{:?}",
        net.dns.queries()
    );
}

#[tokio::test]
async fn allowed_names_resolving_to_denied_space_are_refused() {
    let net = Internet::start();
    let proxy = net.proxy(
        EgressDefault::Allow,
        &["rebind.test", "meta.test", "mixed.test"],
        &[],
    );
    for (name, port) in [("rebind.test", 80), ("meta.test", 80)] {
        let resp = http_get(guest(&proxy, &format!("203.0.113.20:{port}")).await, name).await;
        assert!(resp.starts_with("HTTP/1.1 403"), "{name}: {resp}");
        let e = last(&proxy);
        assert_eq!(
            (e.allowed, e.reason.as_str(), e.name.as_deref()),
            (false, "resolves_to_denied", Some(name))
        );
    }
    assert!(
        tls_read(
            guest(&proxy, "203.0.113.20:443").await,
            "rebind.test",
            &net.cert_ten
        )
        .await
        .is_err()
    );
    assert_eq!(last(&proxy).reason, "resolves_to_denied");
    // A name with one denied and one public address goes to the public one only.
    let resp = http_get(guest(&proxy, "10.0.0.7:80").await, "mixed.test").await;
    assert!(resp.ends_with("ten host=mixed.test"), "{resp}");
    assert_eq!(
        net.trap_hits(),
        0,
        "a connection reached an always-denied address"
    );
}

#[tokio::test]
async fn connections_without_a_name_follow_the_cidr_rules() {
    let net = Internet::start();
    let proxy = net.proxy(EgressDefault::Deny, &["203.0.113.20", "allowed.test"], &[]);
    // A non-HTTP, non-TLS client: decided on the dialed address at once.
    let mut s = guest(&proxy, "203.0.113.20:80").await;
    s.write_all(b"ping\n").await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    assert_eq!(out, "twenty:ping\n");
    let e = last(&proxy);
    assert_eq!(
        (e.allowed, e.reason.as_str(), e.rule.as_deref()),
        (true, "allow_rule", Some("203.0.113.20"))
    );
    assert_eq!(e.name, None);
    // Opened and closed without a byte: decided and logged, but no connection is made for it.
    let mut s = guest(&proxy, "203.0.113.20:80").await;
    s.shutdown().await.unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(net.twenty.connections.load(Ordering::SeqCst), 1);
    assert_eq!(last(&proxy).port, Some(80));
    // HTTP with an IP literal Host names nothing: the dialed address decides.
    let resp = http_get(guest(&proxy, "203.0.113.20:80").await, "203.0.113.20").await;
    assert!(resp.ends_with("twenty host=203.0.113.20"), "{resp}");
    // Not allowed by any CIDR.
    let mut s = guest(&proxy, "203.0.113.10:80").await;
    s.write_all(b"ping\n").await.unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    assert!(out.is_empty());
    let e = last(&proxy);
    assert_eq!((e.allowed, e.reason.as_str()), (false, "default_deny"));
    assert_eq!(net.ten.connections.load(Ordering::SeqCst), 0);
    // Always denied, even with an allow rule for it.
    let proxy = net.proxy(EgressDefault::Allow, &["10.0.0.0/8", "169.254.169.254"], &[]);
    for dst in ["10.0.0.7:80", "169.254.169.254:80"] {
        let mut s = guest(&proxy, dst).await;
        s.write_all(b"ping\n").await.unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out).await;
        assert!(out.is_empty(), "{dst}");
        assert_eq!(last(&proxy).reason, "always_denied");
    }
    assert_eq!(net.trap_hits(), 0);
}

#[tokio::test]
async fn a_silent_client_is_decided_after_the_peek_timeout() {
    let net = Internet::start();
    let greeter = tcp_host(&net.ns, addr("203.0.113.30:22"), "ssh", true);
    let proxy = net.proxy(EgressDefault::Deny, &["203.0.113.30"], &[]);
    let mut s = guest(&proxy, "203.0.113.30:22").await;
    let mut line = vec![0u8; 15];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut line))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(line, b"hello from ssh\n");
    assert_eq!(greeter.connections.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_policy_change_applies_to_the_next_connection() {
    let net = Internet::start();
    let proxy = net.proxy(EgressDefault::Deny, &["allowed.test"], &[]);
    let resp = http_get(guest(&proxy, "203.0.113.20:80").await, "other.test").await;
    assert!(resp.starts_with("HTTP/1.1 403"));
    proxy
        .ctx()
        .set_policy(policy(EgressDefault::Deny, &["other.test"], &[]));
    let resp = http_get(guest(&proxy, "203.0.113.20:80").await, "other.test").await;
    assert!(resp.ends_with("twenty host=other.test"), "{resp}");
    let resp = http_get(guest(&proxy, "203.0.113.10:80").await, "allowed.test").await;
    assert!(resp.starts_with("HTTP/1.1 403"));
    let log = proxy.ctx().audit.snapshot();
    let verdicts: Vec<_> = log
        .events
        .iter()
        .map(|e| (e.name.clone().unwrap(), e.allowed))
        .collect();
    assert_eq!(
        verdicts,
        [
            ("other.test".to_string(), false),
            ("other.test".to_string(), true),
            ("allowed.test".to_string(), false)
        ]
    );
}

/// A "sandbox" namespace whose TCP to 203.0.113.0/24 ports 80 and 443 nftables REDIRECTs to port 15001 there.
/// Its route towards the fake internet leads nowhere: only the redirect can get a connection through.
fn redirecting_sandbox() -> Netns {
    let sbx = Netns::new("pxsbx");
    sbx.ip("link add v0 type veth peer name v1");
    sbx.ip("addr add 192.0.2.1/24 dev v0");
    sbx.ip("link set v0 up");
    sbx.ip("link set v1 up");
    sbx.ip("route add 203.0.113.0/24 via 192.0.2.2 dev v0");
    sbx.nft(
        "table ip hearth_test {
            chain out {
                type nat hook output priority -100; policy accept;
                ip daddr 203.0.113.0/24 tcp dport { 80, 443 } redirect to :15001
            }
        }",
    );
    sbx
}

/// The whole path: a client in a "sandbox" namespace dials 203.0.113.20:80, nftables REDIRECTs it to the proxy
/// listening in that namespace, the proxy reads SO_ORIGINAL_DST and connects out from the uplink namespace.
#[tokio::test]
async fn redirected_connections_through_nftables() {
    let net = Internet::start();
    let sbx = redirecting_sandbox();
    let listener = hearth_net::netns::tcp_listener(&sbx.path(), addr("0.0.0.0:15001")).unwrap();
    let ctx = Arc::new(SandboxNetCtx::new(
        "sbx1",
        policy(EgressDefault::Deny, &["allowed.test", "203.0.113.20"], &[]),
        vec![],
    ));
    let upstream = Arc::new(Upstream::new(net.dns.addr, net.ns.path()));
    let task = spawn_proxy(listener, ctx.clone(), upstream, net.ns.path());

    let connect = |dst: &'static str| {
        let ns = sbx.path();
        async move { hearth_net::netns::connect_tcp(&ns, addr(dst)).await.unwrap() }
    };
    // No name: the original destination (.20, allowed by CIDR) is where it goes.
    let resp = http_get(connect("203.0.113.20:80").await, "203.0.113.20").await;
    assert!(resp.ends_with("twenty host=203.0.113.20"), "{resp}");
    // A name: resolved by the proxy, whatever was dialed.
    let resp = http_get(connect("203.0.113.20:80").await, "allowed.test").await;
    assert!(resp.ends_with("ten host=allowed.test"), "{resp}");
    let got = tls_read(connect("203.0.113.20:443").await, "allowed.test", &net.cert_ten)
        .await
        .unwrap();
    assert_eq!(got, "tls-ten");
    // Not allowed: refused.
    let resp = http_get(connect("203.0.113.10:80").await, "203.0.113.10").await;
    assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");

    let log = ctx.audit.snapshot();
    let seen: Vec<_> = log
        .events
        .iter()
        .map(|e| {
            (
                e.destination.clone().unwrap(),
                e.port.unwrap(),
                e.allowed,
                e.reason.clone(),
            )
        })
        .collect();
    let want = [
        ("203.0.113.20", 80, true, "allow_rule"),
        ("203.0.113.10", 80, true, "allow_rule"),
        ("203.0.113.10", 443, true, "allow_rule"),
        ("203.0.113.10", 80, false, "default_deny"),
    ];
    let want: Vec<_> = want
        .iter()
        .map(|(d, p, a, r)| (d.to_string(), *p, *a, r.to_string()))
        .collect();
    assert_eq!(seen, want);
    task.abort();
}

#[tokio::test]
async fn connections_beyond_the_limit_are_closed() {
    let net = Internet::start();
    let greeter = tcp_host(&net.ns, addr("203.0.113.30:80"), "slow", true);
    let sbx = redirecting_sandbox();
    let listener = hearth_net::netns::tcp_listener(&sbx.path(), addr("0.0.0.0:15001")).unwrap();
    let ctx = Arc::new(
        SandboxNetCtx::new(
            "sbx1",
            policy(EgressDefault::Deny, &["203.0.113.30"], &[]),
            vec![],
        )
        .with_limits(NetLimits {
            proxy_per_sandbox: 1,
            dns_tcp_per_sandbox: 1,
            budget: ConnBudget::new(100),
        }),
    );
    let upstream = Arc::new(Upstream::new(net.dns.addr, net.ns.path()));
    let limits = ProxyLimits {
        peek_timeout: Duration::from_millis(300),
        ..ProxyLimits::default()
    };
    let task = tokio::spawn(Arc::new(Proxy::new(ctx, upstream, net.ns.path(), limits)).serve(listener));
    let open = || async {
        hearth_net::netns::connect_tcp(&sbx.path(), addr("203.0.113.30:80"))
            .await
            .unwrap()
    };
    let greeting = |mut s: TcpStream| async move {
        let mut buf = vec![0u8; 16];
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap_or(0);
        (s, String::from_utf8_lossy(&buf[..n]).to_string())
    };
    let (first, got) = greeting(open().await).await;
    assert_eq!(got, "hello from slow\n");
    let (_, got) = greeting(open().await).await;
    assert_eq!(
        got, "",
        "a second connection must be closed while the first is open"
    );
    drop(first);
    // Once the first connection is over, there is room again.
    let mut got = String::new();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, g) = greeting(open().await).await;
        got = g;
        if !got.is_empty() {
            break;
        }
    }
    assert_eq!(got, "hello from slow\n");
    assert_eq!(greeter.connections.load(Ordering::SeqCst), 2);
    task.abort();
}

#[tokio::test]
async fn allowed_names_that_do_not_resolve_are_refused() {
    let net = Internet::start();
    let proxy = net.proxy(EgressDefault::Deny, &["*.allowed.test"], &[]);
    let resp = http_get(guest(&proxy, "203.0.113.20:80").await, "nx.allowed.test").await;
    assert!(resp.starts_with("HTTP/1.1 403"), "{resp}");
    let e = last(&proxy);
    assert_eq!(
        (e.allowed, e.reason.as_str(), e.name.as_deref()),
        (false, "unresolvable", Some("nx.allowed.test"))
    );
    assert!(net.dns.queries().contains(&"nx.allowed.test".to_string()));
    assert_eq!(net.twenty.connections.load(Ordering::SeqCst), 0);
}
