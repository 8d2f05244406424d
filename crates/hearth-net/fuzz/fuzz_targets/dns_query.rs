//! The platform resolver's handling of a guest query: hickory-proto decoding, the decision ([`plan`]), the
//! reply built from an upstream answer chosen by the input ([`finish`]) and its encoding.
//! Invariants: a lookup only ever leaves for a plain host name the policy makes resolvable (never for
//! `*.internal`, never for a refused name: no DNS exfiltration); replies carry the query's id, at most
//! `MAX_ANSWERS` addresses, none always denied; an encoded reply fits the size limit and decodes again.
#![no_main]

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::OnceLock;

use hearth_api::{EgressDefault, EgressPolicy};
use hearth_net::ctx::SandboxNetCtx;
use hearth_net::dns::{MAX_ANSWERS, Plan, encode, finish, parse_query, plan, udp_limit};
use hearth_net::policy::{Policy, always_denied_addr};
use hickory_proto::op::Message;
use hickory_proto::rr::{RData, RecordType};
use libfuzzer_sys::fuzz_target;

fn ctx(default: EgressDefault) -> SandboxNetCtx {
    let policy = Policy::parse(&EgressPolicy {
        default,
        allow: vec!["*.test".into(), "example.com".into()],
        deny: vec!["bad.test".into()],
    })
    .expect("a valid policy");
    let ctx = SandboxNetCtx::new("sbx_fuzz", policy, vec!["192.0.2.1".parse().expect("an address")]);
    ctx.set_private_names(HashMap::from([(
        "web.net.internal".to_string(),
        Ipv4Addr::new(10, 213, 0, 5),
    )]));
    ctx
}

fn contexts() -> &'static [SandboxNetCtx; 2] {
    static CTX: OnceLock<[SandboxNetCtx; 2]> = OnceLock::new();
    CTX.get_or_init(|| [ctx(EgressDefault::Deny), ctx(EgressDefault::Allow)])
}

/// Addresses an upstream might answer, taken from the input (always-denied ones included).
fn upstream_answer(data: &[u8]) -> Vec<IpAddr> {
    data.chunks(5)
        .take(40)
        .map(|c| {
            let b = |i: usize| c.get(i).copied().unwrap_or(0);
            if b(0) & 1 == 0 {
                IpAddr::V4(Ipv4Addr::new(b(1), b(2), b(3), b(4)))
            } else {
                let hi = u16::from_be_bytes([b(1), b(2)]);
                IpAddr::V6(Ipv6Addr::new(
                    hi,
                    0xff9b & u16::from(b(3)),
                    0,
                    0,
                    0,
                    0,
                    u16::from(b(4)),
                    1,
                ))
            }
        })
        .collect()
}

fn check(request: &Message, reply: Message) {
    assert_eq!(reply.metadata.id, request.metadata.id);
    assert!(reply.answers.len() <= MAX_ANSWERS);
    for r in &reply.answers {
        match &r.data {
            RData::A(a) => assert!(!always_denied_addr(IpAddr::V4(a.0)) || a.0.octets()[..2] == [10, 213]),
            RData::AAAA(a) => assert!(!always_denied_addr(IpAddr::V6(a.0))),
            other => panic!("unexpected answer {other:?}"),
        }
    }
    for limit in [udp_limit(request), usize::from(u16::MAX)] {
        if let Some(bytes) = encode(request, reply.clone(), limit) {
            assert!(bytes.len() <= limit, "{} > {limit}", bytes.len());
            Message::from_vec(&bytes).expect("the resolver's own reply decodes");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    // A big-endian length, the query, then the upstream's answer.
    let Some((len, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let (query, answer) = rest.split_at(usize::from(u16::from_be_bytes(*len)).min(rest.len()));
    let Some(request) = parse_query(query) else {
        return;
    };
    for ctx in contexts() {
        match plan(&request, ctx) {
            Plan::Reply(reply) => check(&request, reply),
            Plan::Lookup {
                reply,
                name,
                rtype,
                decision,
            } => {
                assert!(
                    decision.allowed && ctx.policy().resolvable(&name).allowed,
                    "{name}"
                );
                assert!(
                    name.len() <= 253 && name.split('.').all(|l| !l.is_empty()),
                    "{name:?}"
                );
                assert!(
                    name.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b)),
                    "{name:?}"
                );
                assert!(!name.ends_with("internal"), "{name}");
                assert!(rtype == RecordType::A || rtype == RecordType::AAAA);
                let reply = finish(reply, &name, &decision, Ok(upstream_answer(answer)), ctx);
                check(&request, reply);
            }
        }
    }
});
