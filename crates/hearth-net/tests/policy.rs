//! Egress policies as the API receives them (JSON), parsed and asked for decisions through the public API: one
//! table per question the resolver, the proxy and the data plane ask.

#![allow(clippy::unwrap_used)]

use std::net::IpAddr;

use hearth_api::{EgressPolicy, NetworkPolicy};
use hearth_net::policy::{Policy, PolicyError};

fn parse(json: &str) -> Result<Policy, PolicyError> {
    let wire: NetworkPolicy = serde_json::from_str(json).unwrap();
    Policy::parse(&wire.egress)
}

/// `name -> (allowed, reason, rule)` for `decide_name` (None = no domain rule names it) and `resolvable`.
#[test]
fn name_table() {
    let p = parse(
        r#"{"egress": {"default": "deny",
            "allow": ["api.example.com", "*.cdn.example.net", "203.0.113.0/24"],
            "deny": ["*.evil.cdn.example.net", "tracker.cdn.example.net"]}}"#,
    )
    .unwrap();
    assert!(p.has_domain_rules());
    type Row<'a> = (&'a str, Option<(bool, &'a str, &'a str)>, bool);
    let table: &[Row] = &[
        (
            "api.example.com",
            Some((true, "allow_rule", "api.example.com")),
            true,
        ),
        (
            "API.Example.Com.",
            Some((true, "allow_rule", "api.example.com")),
            true,
        ),
        ("example.com", None, false),
        ("x.api.example.com", None, false),
        ("cdn.example.net", None, false),
        (
            "img.cdn.example.net",
            Some((true, "allow_rule", "*.cdn.example.net")),
            true,
        ),
        (
            "a.b.cdn.example.net",
            Some((true, "allow_rule", "*.cdn.example.net")),
            true,
        ),
        (
            "tracker.cdn.example.net",
            Some((false, "deny_rule", "tracker.cdn.example.net")),
            false,
        ),
        (
            "x.evil.cdn.example.net",
            Some((false, "deny_rule", "*.evil.cdn.example.net")),
            false,
        ),
        (
            "evil.cdn.example.net",
            Some((true, "allow_rule", "*.cdn.example.net")),
            true,
        ),
        ("cdn.example.net.attacker.io", None, false),
    ];
    for (name, by_name, resolvable) in table {
        let d = p.decide_name(name);
        assert_eq!(
            d.as_ref()
                .map(|d| (d.allowed, d.reason, d.rule.as_deref().unwrap())),
            *by_name,
            "{name}"
        );
        assert_eq!(p.resolvable(name).allowed, *resolvable, "resolvable({name})");
    }
    assert_eq!(p.resolvable("example.com").reason, "default_deny");
}

/// `ip -> (allowed, reason)` for `decide_addr` with a default-allow policy: the always-denied ranges hold
/// whatever the rules say, in every spelling of the address.
#[test]
fn address_table() {
    let p = parse(
        r#"{"egress": {"allow": ["10.0.0.0/8", "169.254.169.254", "fd00:ec2::254"],
            "deny": ["198.51.100.0/24", "2001:db8:dead::/48"]}}"#,
    )
    .unwrap();
    let host: Vec<IpAddr> = vec!["203.0.113.1".parse().unwrap()];
    let table: &[(&str, bool, &str)] = &[
        ("203.0.113.9", true, "default_allow"),
        ("2001:db8::1", true, "default_allow"),
        ("198.51.100.7", false, "deny_rule"),
        ("::ffff:198.51.100.7", false, "always_denied"),
        ("2001:db8:dead::1", false, "deny_rule"),
        ("203.0.113.1", false, "always_denied"),
        ("10.0.0.1", false, "always_denied"),
        ("10.255.255.255", false, "always_denied"),
        ("::ffff:10.0.0.1", false, "always_denied"),
        ("::ffff:a00:1", false, "always_denied"),
        ("169.254.169.254", false, "always_denied"),
        ("::ffff:169.254.169.254", false, "always_denied"),
        ("fd00:ec2::254", false, "always_denied"),
        ("172.31.255.1", false, "always_denied"),
        ("192.168.0.1", false, "always_denied"),
        ("100.100.100.100", false, "always_denied"),
        ("127.0.0.53", false, "always_denied"),
        ("::1", false, "always_denied"),
        ("fe80::1", false, "always_denied"),
        ("fd12:3456::1", false, "always_denied"),
        ("64:ff9b::7f00:1", false, "always_denied"),
    ];
    for (ip, allowed, reason) in table {
        let d = p.decide_addr(ip.parse().unwrap(), &host);
        assert_eq!((d.allowed, d.reason), (*allowed, *reason), "{ip}");
    }
    assert_eq!(p.allow_cidrs().len(), 3);
    assert_eq!(p.deny_cidrs().len(), 2);
    assert!(!p.has_domain_rules());
}

/// Default deny: only what an allow rule names, and deny rules still win inside allowed ranges.
#[test]
fn default_deny_table() {
    let p = parse(
        r#"{"egress": {"default": "deny", "allow": ["203.0.113.0/24"], "deny": ["203.0.113.128/25"]}}"#,
    )
    .unwrap();
    for (ip, allowed, reason, rule) in [
        ("203.0.113.5", true, "allow_rule", Some("203.0.113.0/24")),
        ("203.0.113.200", false, "deny_rule", Some("203.0.113.128/25")),
        ("198.51.100.1", false, "default_deny", None),
        ("2001:db8::1", false, "default_deny", None),
    ] {
        let d = p.decide_addr(ip.parse().unwrap(), &[]);
        assert_eq!(
            (d.allowed, d.reason, d.rule.as_deref()),
            (allowed, reason, rule),
            "{ip}"
        );
    }
    // No domain rules: the resolver answers nothing under default deny.
    assert!(!p.resolvable("example.com").allowed);
}

#[test]
fn invalid_policies_name_the_rule() {
    let cases = [
        (
            r#"{"egress": {"allow": ["exa mple.com"]}}"#,
            "\"exa mple.com\" in egress.allow",
        ),
        (
            r#"{"egress": {"deny": ["10.0.0.1/8"]}}"#,
            "host bits are set (the network is 10.0.0.0/8)",
        ),
        (r#"{"egress": {"deny": ["*"]}}"#, "\"*\" in egress.deny"),
        (r#"{"egress": {"allow": ["a.*.com"]}}"#, "leading `*.`"),
        (r#"{"egress": {"allow": [""]}}"#, "empty rule in egress.allow"),
    ];
    for (json, want) in cases {
        let err = parse(json).unwrap_err().to_string();
        assert!(err.contains(want), "{json}: {err}");
    }
    let many = EgressPolicy {
        allow: (0..300).map(|i| format!("h{i}.example.com")).collect(),
        ..Default::default()
    };
    assert_eq!(
        Policy::parse(&many).unwrap_err().to_string(),
        "too many egress rules: 300 (at most 256)"
    );
}
