//! The egress policy parser (user input through the API: JSON, and rules as free text).
//! Invariants: a policy that parses never allows an always-denied address, in any IPv6 spelling; a name a deny
//! rule names is never resolvable.
#![no_main]

use std::net::IpAddr;

use hearth_api::{EgressDefault, EgressPolicy, NetworkPolicy};
use hearth_net::policy::{MAX_RULES, Policy};
use libfuzzer_sys::fuzz_target;

const DENIED: &[&str] = &[
    "10.0.0.1",
    "127.0.0.1",
    "169.254.169.254",
    "168.63.129.16",
    "100.100.100.200",
    "::1",
    "::ffff:10.0.0.1",
    "::a9fe:a9fe",
    "64:ff9b::a9fe:a9fe",
    "64:ff9b:1::1",
    "2002:a9fe:a9fe::1",
    "2001:0:a9fe:a9fe::1",
    "fd00:ec2::254",
    "fe80::1",
];

fn check(policy: &EgressPolicy) {
    let Ok(p) = Policy::parse(policy) else {
        return;
    };
    assert!(p.allow_cidrs().len() + p.deny_cidrs().len() <= MAX_RULES);
    for ip in DENIED {
        let ip: IpAddr = ip.parse().expect("a valid probe");
        let d = p.decide_addr(ip, &[]);
        assert!(!d.allowed, "{ip} allowed by {policy:?}");
    }
    for rule in &policy.deny {
        let name = rule.strip_prefix("*.").map(|n| format!("x.{n}"));
        let name = name.as_deref().unwrap_or(rule);
        if p.decide_name(name).is_some() {
            assert!(
                !p.resolvable(name).allowed,
                "{name} resolvable despite deny rule {rule}"
            );
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(wire) = serde_json::from_slice::<NetworkPolicy>(data) {
        check(&wire.egress);
    }
    let text = String::from_utf8_lossy(data);
    let mut policy = EgressPolicy {
        default: if data.first().is_some_and(|b| b & 1 == 1) {
            EgressDefault::Allow
        } else {
            EgressDefault::Deny
        },
        allow: Vec::new(),
        deny: Vec::new(),
    };
    for line in text.split('\n').skip(1) {
        match line.strip_prefix('!') {
            Some(rule) => policy.deny.push(rule.to_owned()),
            None => policy.allow.push(line.to_owned()),
        }
    }
    check(&policy);
});
