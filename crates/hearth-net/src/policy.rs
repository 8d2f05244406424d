//! A sandbox's egress policy, parsed and validated, and the decisions the resolver, the proxy and the data
//! plane take from it.
//!
//! Rules (see [`hearth_api::EgressPolicy`]): an address or CIDR, a domain name (that name only) or a wildcard
//! `*.domain` (every name below `domain`, not `domain` itself). Deny rules win over allow rules; the default
//! covers what no rule names. Whatever the policy says, [`crate::always_denied`] ranges and the addresses the
//! daemon adds at run time (the host's own, other sandboxes) stay denied.
//!
//! # Allow rules over always-denied space
//! An allow rule may name always-denied space (`10.0.0.0/8`, `64:ff9b::/96`, `168.63.129.16`, or `::/0`, which
//! covers all of it): the policy is accepted, so one written for another platform still loads, but such a rule
//! never takes effect. The always-denied check comes first everywhere a decision is taken: in the kernel (the
//! egress chain drops `@always_denied4`/`@always_denied6` before it looks at `@allow4`/`@allow6`), in the proxy
//! and in the resolver ([`Policy::decide_addr`]); and an IPv6 address that carries an IPv4 address (mapped,
//! compatible, NAT64, 6to4) is judged as that IPv4 address too, so no IPv6 spelling re-opens an IPv4 range.
//! Deny rules act on always-denied space harmlessly.
//!
//! Names compare case-insensitively and a trailing dot is ignored.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::OnceLock;

use hearth_api::{EgressDefault, EgressPolicy};
use ipnet::IpNet;

/// Most rules a policy may hold (allow and deny together).
pub const MAX_RULES: usize = 256;

/// The `reason` strings of [`hearth_api::EgressEvent`].
pub mod reason {
    pub const ALLOW_RULE: &str = "allow_rule";
    pub const DENY_RULE: &str = "deny_rule";
    pub const DEFAULT_ALLOW: &str = "default_allow";
    pub const DEFAULT_DENY: &str = "default_deny";
    pub const ALWAYS_DENIED: &str = "always_denied";
    pub const PRIVATE_PEER: &str = "private_peer";
    pub const DNS_BLOCKED: &str = "dns_blocked";
    pub const RESOLVES_TO_DENIED: &str = "resolves_to_denied";
    pub const UNRESOLVABLE: &str = "unresolvable";
    pub const SPOOFED: &str = "spoofed";
    /// A later request on a kept-alive HTTP connection names another host than the first.
    pub const HOST_CHANGED: &str = "host_changed";
    /// An HTTP request the proxy cannot frame with certainty (see [`crate::proxy`]).
    pub const MALFORMED_HTTP: &str = "malformed_http";
    /// The sandbox (or all sandboxes together) holds as many connections as it may ([`crate::limits`]).
    pub const CONNECTION_LIMIT: &str = "connection_limit";
}

/// A policy that cannot be used. Each message names the rule at fault.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    /// The policy holds more rules than [`MAX_RULES`].
    #[error("too many egress rules: {count} (at most {MAX_RULES})")]
    TooMany { count: usize },
    /// A rule is the empty string.
    #[error("empty rule in egress.{list}")]
    Empty { list: &'static str },
    /// A rule is neither an address, a CIDR, a domain name nor a `*.domain` wildcard.
    #[error("invalid rule {rule:?} in egress.{list}: {why}")]
    Invalid {
        list: &'static str,
        rule: String,
        why: String,
    },
}

/// The outcome of a decision: whether the traffic may go, why (one of [`reason`]) and the rule that decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub allowed: bool,
    pub reason: &'static str,
    pub rule: Option<String>,
}

impl Decision {
    fn by(allowed: bool, reason: &'static str, rule: Option<&str>) -> Self {
        Decision {
            allowed,
            reason,
            rule: rule.map(str::to_owned),
        }
    }

    /// A decision taken by the always-denied ranges (not by the policy).
    pub fn always_denied() -> Self {
        Decision::by(false, reason::ALWAYS_DENIED, None)
    }

    /// A denial for `reason` with no rule (e.g. [`reason::UNRESOLVABLE`]).
    pub fn denied(reason: &'static str) -> Self {
        Decision::by(false, reason, None)
    }

    /// An allowance for `reason` with no rule (e.g. [`reason::PRIVATE_PEER`]).
    pub fn allowed(reason: &'static str) -> Self {
        Decision::by(true, reason, None)
    }
}

/// A domain rule: an exact name or every name below a suffix.
#[derive(Debug, Clone, PartialEq, Eq)]
enum NameRule {
    Exact { name: String, rule: String },
    Below { suffix: String, rule: String },
}

impl NameRule {
    fn matches(&self, name: &str) -> bool {
        match self {
            NameRule::Exact { name: n, .. } => n == name,
            NameRule::Below { suffix, .. } => {
                name.len() > suffix.len() + 1
                    && name.ends_with(suffix.as_str())
                    && name.as_bytes()[name.len() - suffix.len() - 1] == b'.'
            }
        }
    }

    fn rule(&self) -> &str {
        match self {
            NameRule::Exact { rule, .. } | NameRule::Below { rule, .. } => rule,
        }
    }
}

/// A parsed, validated egress policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    source: EgressPolicy,
    default: EgressDefault,
    allow_nets: Vec<(IpNet, String)>,
    deny_nets: Vec<(IpNet, String)>,
    allow_names: Vec<NameRule>,
    deny_names: Vec<NameRule>,
}

impl Default for Policy {
    /// Default allow, no rules.
    fn default() -> Self {
        Policy::parse(&EgressPolicy::default()).expect("the empty policy is valid")
    }
}

impl Policy {
    /// Validates and parses `policy`.
    pub fn parse(policy: &EgressPolicy) -> Result<Policy, PolicyError> {
        let count = policy.allow.len() + policy.deny.len();
        if count > MAX_RULES {
            return Err(PolicyError::TooMany { count });
        }
        let mut parsed = Policy {
            source: policy.clone(),
            default: policy.default,
            allow_nets: Vec::new(),
            deny_nets: Vec::new(),
            allow_names: Vec::new(),
            deny_names: Vec::new(),
        };
        for (list, rules) in [("allow", &policy.allow), ("deny", &policy.deny)] {
            for rule in rules {
                let (nets, names) = if list == "allow" {
                    (&mut parsed.allow_nets, &mut parsed.allow_names)
                } else {
                    (&mut parsed.deny_nets, &mut parsed.deny_names)
                };
                match parse_rule(list, rule)? {
                    Rule::Net(net) => nets.push((net, rule.clone())),
                    Rule::Name(name) => names.push(name),
                }
            }
        }
        Ok(parsed)
    }

    /// The policy as it was given (for reporting it back through the API).
    pub fn source(&self) -> &EgressPolicy {
        &self.source
    }

    pub fn default_action(&self) -> EgressDefault {
        self.default
    }

    /// CIDRs (and single addresses as /32 or /128) the allow list names.
    pub fn allow_cidrs(&self) -> Vec<IpNet> {
        self.allow_nets.iter().map(|(n, _)| *n).collect()
    }

    /// CIDRs (and single addresses as /32 or /128) the deny list names.
    pub fn deny_cidrs(&self) -> Vec<IpNet> {
        self.deny_nets.iter().map(|(n, _)| *n).collect()
    }

    /// Whether any rule names a domain (then TCP goes through the egress proxy).
    pub fn has_domain_rules(&self) -> bool {
        !self.allow_names.is_empty() || !self.deny_names.is_empty()
    }

    /// What the domain rules say about `name`: a deny rule naming it wins, then an allow rule; `None` when no
    /// domain rule names it (the address decides).
    pub fn decide_name(&self, name: &str) -> Option<Decision> {
        let name = normalize_name(name);
        if let Some(r) = self.deny_names.iter().find(|r| r.matches(&name)) {
            return Some(Decision::by(false, reason::DENY_RULE, Some(r.rule())));
        }
        if let Some(r) = self.allow_names.iter().find(|r| r.matches(&name)) {
            return Some(Decision::by(true, reason::ALLOW_RULE, Some(r.rule())));
        }
        None
    }

    /// Whether the platform resolver may look `name` up upstream. With default allow, any name a deny rule does
    /// not name; with default deny, only names an allow rule names (and no deny rule does).
    pub fn resolvable(&self, name: &str) -> Decision {
        match self.decide_name(name) {
            Some(d) => d,
            None => self.default_decision(),
        }
    }

    /// What the policy says about sending to `ip`: the always-denied ranges and `extra_denied` (the host's
    /// addresses, other sandboxes) first, then deny CIDRs, allow CIDRs and the default. IPv4 addresses embedded
    /// in IPv6 ones (mapped, compatible, NAT64, 6to4) are judged as the IPv4 address too.
    pub fn decide_addr(&self, ip: IpAddr, extra_denied: &[IpAddr]) -> Decision {
        let forms = ip_forms(ip);
        let forms = forms.as_slice();
        if is_always_denied(forms)
            || forms
                .iter()
                .any(|f| extra_denied.iter().any(|d| canonical(*d) == *f))
        {
            return Decision::always_denied();
        }
        if let Some((_, rule)) = self
            .deny_nets
            .iter()
            .find(|(n, _)| forms.iter().any(|f| n.contains(f)))
        {
            return Decision::by(false, reason::DENY_RULE, Some(rule));
        }
        if let Some((_, rule)) = self.allow_nets.iter().find(|(n, _)| n.contains(&ip)) {
            return Decision::by(true, reason::ALLOW_RULE, Some(rule));
        }
        self.default_decision()
    }

    fn default_decision(&self) -> Decision {
        match self.default {
            EgressDefault::Allow => Decision::by(true, reason::DEFAULT_ALLOW, None),
            EgressDefault::Deny => Decision::by(false, reason::DEFAULT_DENY, None),
        }
    }
}

/// Whether `ip` (in any of its forms) lies in [`crate::always_denied`].
pub fn always_denied_addr(ip: IpAddr) -> bool {
    is_always_denied(ip_forms(ip).as_slice())
}

fn is_always_denied(forms: &[IpAddr]) -> bool {
    static RANGES: OnceLock<Vec<IpNet>> = OnceLock::new();
    let ranges = RANGES.get_or_init(crate::always_denied);
    forms.iter().any(|f| ranges.iter().any(|n| n.contains(f)))
}

/// `ip` itself plus the IPv4 address it carries, if it is an IPv6 address that embeds one in a well-known way.
struct Forms {
    items: [IpAddr; 2],
    len: usize,
}

impl Forms {
    fn as_slice(&self) -> &[IpAddr] {
        &self.items[..self.len]
    }
}

fn ip_forms(ip: IpAddr) -> Forms {
    match ip {
        IpAddr::V4(_) => Forms {
            items: [ip, ip],
            len: 1,
        },
        IpAddr::V6(v6) => match embedded_v4(v6) {
            Some(v4) => Forms {
                items: [ip, IpAddr::V4(v4)],
                len: 2,
            },
            None => Forms {
                items: [ip, ip],
                len: 1,
            },
        },
    }
}

/// An IPv4 address in IPv4-mapped form becomes that IPv4 address; others are unchanged.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => ip,
        },
        v4 => v4,
    }
}

/// The IPv4 address inside an IPv4-mapped (`::ffff:a.b.c.d`), IPv4-compatible (`::a.b.c.d`), NAT64
/// (`64:ff9b::/96`) or 6to4 (`2002:AABB:CCDD::/48`) address.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = v6.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    if s[..5] == [0; 5] && (s[5] == 0xffff || (s[5] == 0 && !(s[6] == 0 && s[7] <= 1))) {
        return Some(low);
    }
    if s[..6] == [0x64, 0xff9b, 0, 0, 0, 0] {
        return Some(low);
    }
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(
            (s[1] >> 8) as u8,
            s[1] as u8,
            (s[2] >> 8) as u8,
            s[2] as u8,
        ));
    }
    None
}

enum Rule {
    Net(IpNet),
    Name(NameRule),
}

fn parse_rule(list: &'static str, rule: &str) -> Result<Rule, PolicyError> {
    let invalid = |why: &str| PolicyError::Invalid {
        list,
        rule: rule.to_owned(),
        why: why.to_owned(),
    };
    if rule.is_empty() {
        return Err(PolicyError::Empty { list });
    }
    if let Ok(ip) = rule.parse::<IpAddr>() {
        return Ok(Rule::Net(IpNet::from(ip)));
    }
    if rule.contains('/') {
        let net: IpNet = rule.parse().map_err(|_| invalid("not a valid CIDR"))?;
        if net.trunc() != net {
            return Err(invalid(&format!(
                "host bits are set (the network is {})",
                net.trunc()
            )));
        }
        return Ok(Rule::Net(net));
    }
    let (wildcard, name) = match rule.strip_prefix("*.") {
        Some(rest) => (true, rest),
        None => (false, rule),
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    check_hostname(name).map_err(invalid)?;
    let name = name.to_ascii_lowercase();
    Ok(Rule::Name(if wildcard {
        NameRule::Below {
            suffix: name,
            rule: rule.to_owned(),
        }
    } else {
        NameRule::Exact {
            name,
            rule: rule.to_owned(),
        }
    }))
}

/// Checks RFC 1123 host name syntax: labels of 1-63 letters, digits and `-` (not at either end), at most 253
/// characters, and a last label that is not all digits (so that it cannot be mistaken for an address).
fn check_hostname(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("no domain name");
    }
    if name.len() > 253 {
        return Err("domain name longer than 253 characters");
    }
    if name.contains('*') {
        return Err("a wildcard may only be a leading `*.`");
    }
    for label in name.split('.') {
        if label.is_empty() {
            return Err("empty label in domain name");
        }
        if label.len() > 63 {
            return Err("domain label longer than 63 characters");
        }
        if !label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err("a domain name holds only letters, digits, `-` and `.`");
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err("a domain label may not start or end with `-`");
        }
    }
    if name
        .rsplit('.')
        .next()
        .is_some_and(|tld| tld.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err("neither an address nor a domain name");
    }
    Ok(())
}

/// Lower-cases `name` and drops one trailing dot.
pub fn normalize_name(name: &str) -> String {
    let name = name.strip_suffix('.').unwrap_or(name);
    name.to_ascii_lowercase()
}

/// `name` normalised, if it is a plausible host name (letters, digits, `-`, `_`, dots; not an address). Used for
/// names read from guest traffic (TLS SNI, HTTP Host), which are hostile input.
pub fn guest_hostname(name: &str) -> Option<String> {
    let name = normalize_name(name);
    if name.is_empty() || name.len() > 253 || name.parse::<IpAddr>().is_ok() {
        return None;
    }
    let ok = name.split('.').all(|l| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    });
    ok.then_some(name)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn policy(default: EgressDefault, allow: &[&str], deny: &[&str]) -> Result<Policy, PolicyError> {
        Policy::parse(&EgressPolicy {
            default,
            allow: allow.iter().map(|s| s.to_string()).collect(),
            deny: deny.iter().map(|s| s.to_string()).collect(),
        })
    }

    #[test]
    fn rule_syntax() {
        let ok = [
            "203.0.113.7",
            "203.0.113.0/24",
            "2001:db8::/32",
            "2001:db8::1",
            "example.com",
            "*.example.com",
            "Example.COM.",
            "a-b.c0.io",
            "xn--nxasmq6b.com",
            "localhost",
        ];
        for rule in ok {
            policy(EgressDefault::Deny, &[rule], &[]).unwrap_or_else(|e| panic!("{rule}: {e}"));
        }
        let bad = [
            "",
            " example.com",
            "exa mple.com",
            "*",
            "*.",
            "a.*.com",
            "**.com",
            "ex_ample.com",
            "-a.com",
            "a-.com",
            "a..com",
            ".a.com",
            "1.2.3",
            "203.0.113.7/24",
            "10.0.0.0/33",
            "http://example.com",
            "example.com:443",
            "é.com",
        ];
        for rule in bad {
            let err = policy(EgressDefault::Deny, &[], &[rule]).unwrap_err();
            if !rule.is_empty() {
                assert!(
                    err.to_string().contains(&format!("{rule:?}")),
                    "{err} should name {rule:?}"
                );
                assert!(err.to_string().contains("egress.deny"), "{err}");
            } else {
                assert_eq!(err, PolicyError::Empty { list: "deny" });
            }
        }
        let long = format!("{}.com", "a".repeat(64));
        assert!(policy(EgressDefault::Allow, &[&long], &[]).is_err());
        let many: Vec<String> = (0..=MAX_RULES).map(|i| format!("h{i}.example.com")).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(
            policy(EgressDefault::Allow, &many, &[]).unwrap_err(),
            PolicyError::TooMany { count: 257 }
        );
        assert!(policy(EgressDefault::Allow, &many[..MAX_RULES], &[]).is_ok());
    }

    #[test]
    fn accessors() {
        let p = policy(
            EgressDefault::Deny,
            &["203.0.113.7", "2001:db8::/32"],
            &["198.51.100.0/24"],
        )
        .unwrap();
        assert_eq!(
            p.allow_cidrs(),
            vec![
                "203.0.113.7/32".parse::<IpNet>().unwrap(),
                "2001:db8::/32".parse().unwrap()
            ]
        );
        assert_eq!(p.deny_cidrs(), vec!["198.51.100.0/24".parse::<IpNet>().unwrap()]);
        assert!(!p.has_domain_rules());
        assert!(
            policy(EgressDefault::Deny, &[], &["*.x.io"])
                .unwrap()
                .has_domain_rules()
        );
        assert_eq!(p.source().allow.len(), 2);
    }

    #[test]
    fn name_decisions() {
        let p = policy(
            EgressDefault::Deny,
            &["example.com", "*.svc.example.org", "Mixed.Case.NET"],
            &["bad.svc.example.org", "*.evil.svc.example.org"],
        )
        .unwrap();
        type Case<'a> = (&'a str, Option<(bool, &'a str, &'a str)>);
        let cases: &[Case] = &[
            ("example.com", Some((true, "allow_rule", "example.com"))),
            ("EXAMPLE.com.", Some((true, "allow_rule", "example.com"))),
            ("www.example.com", None),
            ("notexample.com", None),
            ("svc.example.org", None),
            (
                "a.svc.example.org",
                Some((true, "allow_rule", "*.svc.example.org")),
            ),
            (
                "a.b.svc.example.org",
                Some((true, "allow_rule", "*.svc.example.org")),
            ),
            ("xsvc.example.org", None),
            (
                "bad.svc.example.org",
                Some((false, "deny_rule", "bad.svc.example.org")),
            ),
            (
                "evil.svc.example.org",
                Some((true, "allow_rule", "*.svc.example.org")),
            ),
            (
                "x.evil.svc.example.org",
                Some((false, "deny_rule", "*.evil.svc.example.org")),
            ),
            ("mixed.case.net", Some((true, "allow_rule", "Mixed.Case.NET"))),
        ];
        for (name, want) in cases {
            let got = p.decide_name(name);
            let got = got
                .as_ref()
                .map(|d| (d.allowed, d.reason, d.rule.as_deref().unwrap()));
            assert_eq!(got, *want, "{name}");
        }
        // Default deny: only what an allow rule names resolves.
        assert!(p.resolvable("a.svc.example.org").allowed);
        let d = p.resolvable("other.net");
        assert_eq!((d.allowed, d.reason, d.rule), (false, "default_deny", None));
        assert_eq!(p.resolvable("bad.svc.example.org").reason, "deny_rule");

        // Default allow: anything a deny rule does not name.
        let p = policy(EgressDefault::Allow, &[], &["*.tracker.io"]).unwrap();
        assert_eq!(p.resolvable("anything.net").reason, "default_allow");
        assert!(p.resolvable("tracker.io").allowed);
        let d = p.resolvable("x.tracker.io");
        assert_eq!(
            (d.allowed, d.reason, d.rule.as_deref()),
            (false, "deny_rule", Some("*.tracker.io"))
        );
    }

    #[test]
    fn address_decisions() {
        let p = policy(
            EgressDefault::Deny,
            &[
                "203.0.113.0/24",
                "10.1.0.0/16",
                "2001:db8::/32",
                "169.254.169.254",
                "64:ff9b::/96",
                "2002::/16",
                "2001::/32",
                "::/96",
                "168.63.129.16",
                "192.88.99.0/24",
            ],
            &["203.0.113.66", "2001:db8:bad::/48"],
        )
        .unwrap();
        let extra: Vec<IpAddr> = vec!["198.51.100.1".parse().unwrap(), "2001:db8::53".parse().unwrap()];
        let cases: &[(&str, bool, &str, Option<&str>)] = &[
            ("203.0.113.10", true, "allow_rule", Some("203.0.113.0/24")),
            ("203.0.113.66", false, "deny_rule", Some("203.0.113.66")),
            ("198.51.100.7", false, "default_deny", None),
            // Always denied, even when an allow rule names them.
            ("10.1.2.3", false, "always_denied", None),
            ("169.254.169.254", false, "always_denied", None),
            ("fd00:ec2::254", false, "always_denied", None),
            ("127.0.0.1", false, "always_denied", None),
            ("::1", false, "always_denied", None),
            ("100.64.1.1", false, "always_denied", None),
            ("172.20.0.1", false, "always_denied", None),
            ("192.168.1.1", false, "always_denied", None),
            ("fe80::1", false, "always_denied", None),
            ("fc00::1", false, "always_denied", None),
            ("0.0.0.0", false, "always_denied", None),
            ("255.255.255.255", false, "always_denied", None),
            ("224.0.0.1", false, "always_denied", None),
            // IPv4 in IPv6 clothing.
            ("::ffff:10.0.0.1", false, "always_denied", None),
            ("::ffff:169.254.169.254", false, "always_denied", None),
            ("::10.0.0.1", false, "always_denied", None),
            ("64:ff9b::a00:1", false, "always_denied", None),
            ("64:ff9b::a9fe:a9fe", false, "always_denied", None),
            ("2002:a00:1::1", false, "always_denied", None),
            // Prefixes that embed or tunnel IPv4 are denied as a whole, whatever IPv4 address they carry.
            ("64:ff9b::cb00:710a", false, "always_denied", None),
            ("64:ff9b:1::cb00:710a", false, "always_denied", None),
            ("2002:cb00:710a::1", false, "always_denied", None),
            (
                "2001:0:4136:e378:8000:63bf:3fff:fdd2",
                false,
                "always_denied",
                None,
            ),
            ("::cb00:710a", false, "always_denied", None),
            ("::ffff:0:cb00:710a", false, "always_denied", None),
            // Cloud host services in public space.
            ("168.63.129.16", false, "always_denied", None),
            ("192.88.99.1", false, "always_denied", None),
            // The daemon's extra denials, in either form.
            ("198.51.100.1", false, "always_denied", None),
            ("::ffff:198.51.100.1", false, "always_denied", None),
            ("2001:db8::53", false, "always_denied", None),
            ("2001:db8::1", true, "allow_rule", Some("2001:db8::/32")),
            ("2001:db8:bad::1", false, "deny_rule", Some("2001:db8:bad::/48")),
        ];
        for (ip, allowed, why, rule) in cases {
            let d = p.decide_addr(ip.parse().unwrap(), &extra);
            assert_eq!(
                (d.allowed, d.reason, d.rule.as_deref()),
                (*allowed, *why, *rule),
                "{ip}"
            );
        }
        let p = policy(EgressDefault::Allow, &[], &[]).unwrap();
        assert_eq!(
            p.decide_addr("203.0.113.10".parse().unwrap(), &[]).reason,
            "default_allow"
        );
        assert_eq!(
            p.decide_addr("10.0.0.1".parse().unwrap(), &[]).reason,
            "always_denied"
        );
        assert!(always_denied_addr("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!always_denied_addr("2001:db8::1".parse().unwrap()));
    }

    #[test]
    fn guest_hostnames() {
        assert_eq!(guest_hostname("Example.COM.").as_deref(), Some("example.com"));
        assert_eq!(guest_hostname("_srv.x-y.io").as_deref(), Some("_srv.x-y.io"));
        for bad in [
            "",
            ".",
            "203.0.113.1",
            "::1",
            "a..b",
            "a b",
            "a/b",
            "x\0y",
            &"a".repeat(64),
        ] {
            assert_eq!(guest_hostname(bad), None, "{bad:?}");
        }
    }
}
