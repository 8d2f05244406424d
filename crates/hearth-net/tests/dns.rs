//! The platform resolver against a recording upstream test resolver in a namespace the test made. The guest
//! side talks to the resolver over loopback. Needs root.

#![allow(clippy::unwrap_used)]

mod proxy_support;

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hearth_api::{EgressDefault, EgressPolicy};
use hearth_net::ctx::SandboxNetCtx;
use hearth_net::dns::{ResolveError, Upstream, spawn_resolver, spawn_tcp_resolver};
use hearth_net::policy::Policy;
use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};
use proxy_support::{Netns, TestDns, answer_ips, ask};

const ZONE: &[(&str, &[&str])] = &[
    ("allowed.test", &["203.0.113.10", "2001:db8::10"]),
    ("a.wild.test", &["203.0.113.11"]),
    ("bad.wild.test", &["203.0.113.12"]),
    ("other.test", &["203.0.113.20"]),
    ("private.test", &["10.0.0.7", "203.0.113.13"]),
    ("meta.test", &["169.254.169.254"]),
    ("mapped.test", &["::ffff:10.0.0.1", "fd00:ec2::254"]),
    (
        "a-rather-long-name-with-many-addresses.test",
        &[
            "2001:db8::1",
            "2001:db8::2",
            "2001:db8::3",
            "2001:db8::4",
            "2001:db8::5",
            "2001:db8::6",
            "2001:db8::7",
            "2001:db8::8",
            "2001:db8::9",
            "2001:db8::a",
            "2001:db8::b",
            "2001:db8::c",
            "2001:db8::d",
            "2001:db8::e",
            "2001:db8::f",
            "2001:db8::10",
            "2001:db8::11",
            "2001:db8::12",
            "2001:db8::13",
            "2001:db8::14",
        ],
    ),
];

struct Fixture {
    _uplink: Netns,
    upstream_dns: TestDns,
    ctx: Arc<SandboxNetCtx>,
    resolver: SocketAddr,
    tcp_resolver: SocketAddr,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn policy(default: EgressDefault, allow: &[&str], deny: &[&str]) -> Policy {
    Policy::parse(&EgressPolicy {
        default,
        allow: allow.iter().map(|s| s.to_string()).collect(),
        deny: deny.iter().map(|s| s.to_string()).collect(),
    })
    .unwrap()
}

async fn fixture() -> Fixture {
    let uplink = Netns::new("dns");
    uplink.add_host("203.0.113.53");
    let upstream_dns = TestDns::start(&uplink, "203.0.113.53:53".parse().unwrap(), ZONE);
    let upstream = Arc::new(Upstream::new(upstream_dns.addr, uplink.path()));
    let ctx = Arc::new(SandboxNetCtx::new(
        "sbx1",
        policy(
            EgressDefault::Deny,
            &[
                "allowed.test",
                "*.wild.test",
                "private.test",
                "meta.test",
                "mapped.test",
                "a-rather-long-name-with-many-addresses.test",
            ],
            &["bad.wild.test"],
        ),
        vec![],
    ));
    ctx.set_private_names(HashMap::from([(
        "sbx2.net1.internal".to_string(),
        "10.213.0.5".parse().unwrap(),
    )]));
    let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let resolver = socket.local_addr().unwrap();
    let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let tcp_resolver = tcp.local_addr().unwrap();
    let tasks = vec![
        spawn_resolver(socket, ctx.clone(), upstream.clone()),
        spawn_tcp_resolver(tcp, ctx.clone(), upstream),
    ];
    Fixture {
        _uplink: uplink,
        upstream_dns,
        ctx,
        resolver,
        tcp_resolver,
        tasks,
    }
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|s| s.parse().unwrap()).collect()
}

#[tokio::test]
async fn allowed_names_are_answered_through_upstream() {
    let f = fixture().await;
    let r = ask(f.resolver, "Allowed.TEST.", RecordType::A).await.unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert_eq!(answer_ips(&r), ips(&["203.0.113.10"]));
    // The question comes back as asked (0x20 case randomisation keeps working).
    assert_eq!(r.queries[0].name().to_ascii(), "Allowed.TEST.");
    let r = ask(f.resolver, "allowed.test.", RecordType::AAAA).await.unwrap();
    assert_eq!(answer_ips(&r), ips(&["2001:db8::10"]));
    let r = ask(f.resolver, "a.wild.test.", RecordType::A).await.unwrap();
    assert_eq!(answer_ips(&r), ips(&["203.0.113.11"]));
    // An allowed name that does not exist upstream.
    let r = ask(f.resolver, "nx.wild.test.", RecordType::A).await.unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    let seen = f.upstream_dns.queries();
    assert!(
        seen.contains(&"allowed.test".to_string()) && seen.contains(&"a.wild.test".to_string()),
        "{seen:?}"
    );

    let log = f.ctx.audit.snapshot();
    let e = log
        .events
        .iter()
        .find(|e| e.name.as_deref() == Some("a.wild.test"))
        .unwrap();
    assert!(e.allowed);
    assert_eq!(
        (e.reason.as_str(), e.rule.as_deref()),
        ("allow_rule", Some("*.wild.test"))
    );
    assert_eq!(e.protocol, hearth_api::NetProtocol::Dns);
}

#[tokio::test]
async fn other_names_are_refused_without_upstream_traffic() {
    let f = fixture().await;
    for (name, why) in [
        ("other.test.", "default_deny"),
        ("bad.wild.test.", "deny_rule"),
        ("exfil-4142.x.io.", "default_deny"),
    ] {
        for rtype in [RecordType::A, RecordType::AAAA, RecordType::TXT] {
            let r = ask(f.resolver, name, rtype).await.unwrap();
            assert_eq!(r.metadata.response_code, ResponseCode::Refused, "{name} {rtype}");
            assert!(r.answers.is_empty());
        }
        let log = f.ctx.audit.snapshot();
        let e = log
            .events
            .iter()
            .find(|e| e.name.as_deref() == Some(name.trim_end_matches('.')))
            .unwrap();
        assert!(!e.allowed);
        assert_eq!(e.reason, why);
    }
    // An allowed query afterwards proves the upstream is reachable and recording.
    ask(f.resolver, "allowed.test.", RecordType::A).await.unwrap();
    let seen = f.upstream_dns.queries();
    assert_eq!(
        seen,
        vec!["allowed.test".to_string()],
        "upstream saw refused names: {seen:?}"
    );
}

#[tokio::test]
async fn private_network_names_are_answered_locally() {
    let f = fixture().await;
    let r = ask(f.resolver, "SBX2.net1.internal.", RecordType::A)
        .await
        .unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::NoError);
    assert_eq!(answer_ips(&r), ips(&["10.213.0.5"]));
    let r = ask(f.resolver, "sbx2.net1.internal.", RecordType::AAAA)
        .await
        .unwrap();
    assert_eq!(
        (r.metadata.response_code, r.answers.len()),
        (ResponseCode::NoError, 0)
    );
    let r = ask(f.resolver, "sbx3.net1.internal.", RecordType::A)
        .await
        .unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
    assert!(
        f.upstream_dns.queries().is_empty(),
        "internal names must never be forwarded"
    );
    let log = f.ctx.audit.snapshot();
    assert!(log.events.iter().any(|e| e.allowed && e.reason == "private_peer"));
    // A peer leaving takes its name with it.
    f.ctx.set_private_names(HashMap::new());
    let r = ask(f.resolver, "sbx2.net1.internal.", RecordType::A)
        .await
        .unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::NXDomain);
}

#[tokio::test]
async fn denied_addresses_are_dropped_from_answers() {
    let f = fixture().await;
    let r = ask(f.resolver, "private.test.", RecordType::A).await.unwrap();
    assert_eq!(answer_ips(&r), ips(&["203.0.113.13"]));
    let r = ask(f.resolver, "meta.test.", RecordType::A).await.unwrap();
    assert_eq!(
        (r.metadata.response_code, answer_ips(&r)),
        (ResponseCode::NoError, vec![])
    );
    let r = ask(f.resolver, "mapped.test.", RecordType::AAAA).await.unwrap();
    assert_eq!(answer_ips(&r), Vec::<IpAddr>::new());
    let log = f.ctx.audit.snapshot();
    let denied: Vec<_> = log
        .events
        .iter()
        .filter(|e| e.reason == "resolves_to_denied")
        .map(|e| (e.name.clone().unwrap(), e.destination.clone().unwrap(), e.allowed))
        .collect();
    for (name, ip) in [
        ("private.test", "10.0.0.7"),
        ("meta.test", "169.254.169.254"),
        ("mapped.test", "::ffff:10.0.0.1"),
        ("mapped.test", "fd00:ec2::254"),
    ] {
        assert!(
            denied.contains(&(name.to_string(), ip.to_string(), false)),
            "{name} {ip}: {denied:?}"
        );
    }
}

#[tokio::test]
async fn malformed_queries_are_ignored_and_serving_goes_on() {
    let f = fixture().await;
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut valid = Message::new(7, MessageType::Query, OpCode::Query);
    valid.add_query(Query::query(
        Name::from_ascii("allowed.test.").unwrap(),
        RecordType::A,
    ));
    let valid = valid.to_vec().unwrap();
    let mut response = Message::response(8, OpCode::Query);
    response.add_query(Query::query(
        Name::from_ascii("allowed.test.").unwrap(),
        RecordType::A,
    ));
    let garbage: Vec<Vec<u8>> = vec![
        vec![],
        vec![0xff; 3],
        valid[..valid.len() - 3].to_vec(),
        (0..600).map(|i| (i * 37 % 251) as u8).collect(),
        response.to_vec().unwrap(),
    ];
    for g in &garbage {
        sock.send_to(g, f.resolver).await.unwrap();
    }
    let mut buf = [0u8; 1024];
    let quiet = tokio::time::timeout(Duration::from_millis(500), sock.recv_from(&mut buf)).await;
    assert!(
        quiet.is_err(),
        "malformed or response datagrams must get no reply"
    );
    // Two questions in one query: FORMERR, not a crash.
    let mut two = Message::new(9, MessageType::Query, OpCode::Query);
    two.add_query(Query::query(
        Name::from_ascii("allowed.test.").unwrap(),
        RecordType::A,
    ));
    two.add_query(Query::query(
        Name::from_ascii("other.test.").unwrap(),
        RecordType::A,
    ));
    sock.send_to(&two.to_vec().unwrap(), f.resolver).await.unwrap();
    let (n, _) = tokio::time::timeout(Duration::from_secs(5), sock.recv_from(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        Message::from_vec(&buf[..n]).unwrap().metadata.response_code,
        ResponseCode::FormErr
    );
    let r = ask(f.resolver, "allowed.test.", RecordType::A).await.unwrap();
    assert_eq!(answer_ips(&r), ips(&["203.0.113.10"]));
    assert!(!f.upstream_dns.queries().contains(&"other.test".to_string()));
}

#[tokio::test]
async fn policy_changes_apply_to_the_next_query() {
    let f = fixture().await;
    let r = ask(f.resolver, "other.test.", RecordType::A).await.unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::Refused);
    f.ctx
        .set_policy(policy(EgressDefault::Deny, &["other.test"], &[]));
    let r = ask(f.resolver, "other.test.", RecordType::A).await.unwrap();
    assert_eq!(answer_ips(&r), ips(&["203.0.113.20"]));
    let r = ask(f.resolver, "allowed.test.", RecordType::A).await.unwrap();
    assert_eq!(r.metadata.response_code, ResponseCode::Refused);
    f.ctx
        .set_policy(policy(EgressDefault::Allow, &[], &["other.test"]));
    let r = ask(f.resolver, "allowed.test.", RecordType::A).await.unwrap();
    assert_eq!(answer_ips(&r), ips(&["203.0.113.10"]));
}

/// An upstream that first sends spoofed answers (wrong id, wrong question, a query instead of a response),
/// then the right one: the client takes only the right one. Silence ends in a timeout.
#[tokio::test]
async fn upstream_client_rejects_mismatched_answers_and_times_out() {
    let ns = Netns::new("dnsspoof");
    ns.add_host("203.0.113.53");
    let server = hearth_net::netns::udp_socket(&ns.path(), "203.0.113.53:53".parse().unwrap()).unwrap();
    let server = tokio::net::UdpSocket::from_std(server).unwrap();
    let task = tokio::spawn(async move {
        let mut buf = [0u8; 1024];
        loop {
            let (n, peer) = server.recv_from(&mut buf).await.unwrap();
            let q = Message::from_vec(&buf[..n]).unwrap();
            let question = q.queries[0].clone();
            let name = question.name().to_ascii();
            if name == "silent.test." {
                continue;
            }
            let answer = |id: u16, qname: &str, ip: [u8; 4], kind: MessageType| {
                let mut m = Message::new(id, kind, OpCode::Query);
                let mut qq = question.clone();
                qq.set_name(Name::from_ascii(qname).unwrap());
                m.add_query(qq);
                m.add_answer(Record::from_rdata(
                    Name::from_ascii(qname).unwrap(),
                    60,
                    RData::A(A(ip.into())),
                ));
                m.to_vec().unwrap()
            };
            if question.query_type() != RecordType::A && name == "noaaaa.test." {
                continue;
            }
            if question.query_type() != RecordType::A {
                let mut m = Message::response(q.metadata.id, OpCode::Query);
                m.add_query(question.clone());
                server.send_to(&m.to_vec().unwrap(), peer).await.unwrap();
                continue;
            }
            let id = q.metadata.id;
            for spoof in [
                answer(
                    id.wrapping_add(1),
                    &name,
                    [203, 0, 113, 66],
                    MessageType::Response,
                ),
                answer(id, "evil.test.", [203, 0, 113, 67], MessageType::Response),
                answer(id, &name, [203, 0, 113, 68], MessageType::Query),
                vec![1, 2, 3],
            ] {
                server.send_to(&spoof, peer).await.unwrap();
            }
            server
                .send_to(&answer(id, &name, [203, 0, 113, 10], MessageType::Response), peer)
                .await
                .unwrap();
        }
    });
    let upstream =
        Upstream::new("203.0.113.53:53".parse().unwrap(), ns.path()).with_timeout(Duration::from_secs(3));
    assert_eq!(
        upstream.resolve("good.test").await.unwrap(),
        ips(&["203.0.113.10"])
    );
    // An upstream that drops AAAA queries does not hold up a name that has IPv4 addresses.
    let started = Instant::now();
    assert_eq!(
        upstream.resolve("noaaaa.test").await.unwrap(),
        ips(&["203.0.113.10"])
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "waited for the AAAA timeout: {:?}",
        started.elapsed()
    );
    let started = Instant::now();
    let err = upstream.resolve("silent.test").await.unwrap_err();
    assert!(matches!(err, ResolveError::Timeout { .. }), "{err}");
    assert!(started.elapsed() < Duration::from_secs(6));
    task.abort();
}

#[tokio::test]
async fn answers_fit_a_plain_udp_reply_and_tcp_works_too() {
    let f = fixture().await;
    let name = "a-rather-long-name-with-many-addresses.test.";
    let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let mut q = Message::new(11, MessageType::Query, OpCode::Query);
    q.add_query(Query::query(Name::from_ascii(name).unwrap(), RecordType::AAAA));
    sock.send_to(&q.to_vec().unwrap(), f.resolver).await.unwrap();
    let mut buf = [0u8; 4096];
    let (n, _) = tokio::time::timeout(Duration::from_secs(5), sock.recv_from(&mut buf))
        .await
        .unwrap()
        .unwrap();
    assert!(
        n <= 512,
        "a reply to a query without EDNS must fit 512 bytes, got {n}"
    );
    let r = Message::from_vec(&buf[..n]).unwrap();
    assert!((8..=16).contains(&r.answers.len()), "{}", r.answers.len());

    // The same over TCP, then a refused name on the same connection.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut tcp = tokio::net::TcpStream::connect(f.tcp_resolver).await.unwrap();
    for (id, qname, want) in [
        (12u16, name, ResponseCode::NoError),
        (13, "other.test.", ResponseCode::Refused),
    ] {
        let mut q = Message::new(id, MessageType::Query, OpCode::Query);
        q.add_query(Query::query(Name::from_ascii(qname).unwrap(), RecordType::AAAA));
        let bytes = q.to_vec().unwrap();
        tcp.write_all(&(bytes.len() as u16).to_be_bytes()).await.unwrap();
        tcp.write_all(&bytes).await.unwrap();
        let mut len = [0u8; 2];
        tcp.read_exact(&mut len).await.unwrap();
        let mut reply = vec![0u8; u16::from_be_bytes(len) as usize];
        tcp.read_exact(&mut reply).await.unwrap();
        let r = Message::from_vec(&reply).unwrap();
        assert_eq!((r.metadata.id, r.metadata.response_code), (id, want));
        if want == ResponseCode::NoError {
            assert_eq!(r.answers.len(), 16);
        }
    }
    assert!(!f.upstream_dns.queries().contains(&"other.test".to_string()));
}
