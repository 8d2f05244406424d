//! The nftables rulesets of the data plane, as text for `nft -f -` (one atomic transaction per call).
//!
//! Only parsed addresses and networks (whose `Display` is plain digits, dots and colons) and fixed names are
//! ever written into the text, so no caller-supplied string can change a rule.
//!
//! # Sandbox table `inet hearth` (in the sandbox's namespace)
//! - `raw` prerouting: from the guest link only [`GUEST_MAC`] with [`GUEST_ADDR`] passes; IPv6 from the guest is
//!   dropped when the plane has no IPv6 range, otherwise only [`GUEST_ADDR6`] (and link-local or unspecified
//!   sources, which are never forwarded: neighbour discovery) passes.
//! - nat: peers' connections to the sandbox address are DNATed to the guest; the guest's traffic leaving by
//!   `up0` is SNATed to the sandbox address; with `proxy_tcp`, guest TCP to ports 80 and 443 (except to the
//!   gateway and to peers) is DNATed to the egress proxy on [`GATEWAY`]:[`PROXY_PORT`].
//!   IPv6 (with a range): the guest's traffic leaving by `up0` is SNATed to the sandbox's IPv6 address.
//! - input: from the guest only DNS (UDP/TCP 53) and the proxy port on the gateway, and neighbour discovery
//!   (hop limit 255) on `tap0` and `up0`; nothing new from `up0`.
//! - forward: established traffic passes; a new guest connection goes through [`EGRESS_CHAIN`] whose rules
//!   decide in this order: DNS/DoT to anyone (`dns_blocked`), peers (`private_peer`), always-denied ranges
//!   (`always_denied`), deny CIDRs (`deny_rule`), allow CIDRs (`allow_rule`), the default (`default_allow` /
//!   `default_deny`). Every decision is logged to NFLOG group [`NFLOG_GROUP`] with the prefix
//!   `allow:<reason>` or `deny:<reason>` (see [`crate::nflog`]). New connections towards the guest are
//!   accepted only from peers.
//!
//! # Hub table `inet hearth_hub` (in the uplink namespace)
//! - forward: between two sandbox links (`hrth*`) only the address pairs in the set `peer_pairs` pass (every
//!   packet is checked, so removing a pair cuts established connections too); anything new towards a sandbox
//!   link from elsewhere is dropped (no ingress); a sandbox link may only carry sources from the sandbox range.
//! - input/output: the uplink namespace itself neither accepts new connections from sandbox links nor opens
//!   any towards them (the host's services are invisible, the host cannot reach a guest).
//! - postrouting: traffic from the sandbox range leaving by any other interface is masqueraded.
//! - IPv6: without a range every IPv6 packet from a sandbox link is dropped; with one, only sources from the
//!   range pass and are masqueraded like IPv4, and neighbour discovery with the sandbox links is accepted.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};

use crate::plane::SandboxNet;
use crate::{GATEWAY, GUEST_ADDR, GUEST_ADDR6, GUEST_MAC, GUEST_PREFIX, PROXY_PORT, TAP_NAME};

/// NFLOG group of the sandbox table's log rules. NFLOG groups are per network namespace, so every sandbox
/// uses the same group in its own namespace.
pub const NFLOG_GROUP: u16 = 4;
/// Name of the sandbox table (family `inet`).
pub const SANDBOX_TABLE: &str = "hearth";
/// Name of the hub table (family `inet`).
pub const HUB_TABLE: &str = "hearth_hub";
/// Name of the hub's set of (source, destination) sandbox address pairs allowed to talk.
pub const PEER_SET: &str = "peer_pairs";
/// The chain of the sandbox table that decides a new guest connection.
pub const EGRESS_CHAIN: &str = "egress";
/// Name of the sandbox end of the uplink veth pair.
pub const UPLINK_IF: &str = "up0";
/// Interface-name pattern of the uplink ends (`hrth<8 hex>`) in the uplink namespace.
pub const HUB_IF_PATTERN: &str = "hrth*";

/// Spoofed packets are logged at most this often (per second) so a flooding guest cannot flood the log.
const SPOOF_LOG_RATE: u32 = 10;
/// Neighbour discovery messages (valid only with hop limit 255, i.e. from the link itself).
const ND: &str = "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } ip6 hoplimit 255";

/// The full text that replaces a sandbox's table: creates it if missing, deletes it, then adds the new one,
/// all in one transaction (established connections keep their conntrack state and NAT bindings).
pub fn sandbox_table(sb: &SandboxNet, sandbox_net: Ipv4Net, sandbox_net6: Option<Ipv6Net>) -> String {
    let hub = hub_address(sandbox_net);
    // Only addresses of other sandboxes count as peers: a peer outside the sandbox range must never open a
    // hole into the always-denied ranges.
    let peers: Vec<Ipv4Addr> = sb
        .peers
        .iter()
        .copied()
        .filter(|p| sandbox_net.contains(p) && *p != hub && *p != sb.address)
        .collect();

    let mut denied: Vec<IpNet> = crate::always_denied();
    denied.extend(sb.extra_denied.iter().map(|a| IpNet::from(*a)));
    denied.push(IpNet::V4(sandbox_net));
    denied.extend(sandbox_net6.map(IpNet::V6));
    let addr6 = sandbox_net6.map(|n| address6(n, sb.address));

    let (denied4, denied6) = split(&denied);
    let (deny4, deny6) = split(&sb.deny);
    let (allow4, allow6) = split(&sb.allow);
    let g = NFLOG_GROUP;
    let tap = TAP_NAME;
    let up = UPLINK_IF;
    let addr = sb.address;
    let guest_net = Ipv4Net::new(GUEST_ADDR, GUEST_PREFIX).map(|n| n.trunc()).ok();

    let mut t = String::new();
    let _ = writeln!(t, "table inet {SANDBOX_TABLE}");
    let _ = writeln!(t, "delete table inet {SANDBOX_TABLE}");
    let _ = writeln!(t, "table inet {SANDBOX_TABLE} {{");
    t.push_str(&addr_set(
        "peers",
        "ipv4_addr",
        &peers.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
    ));
    t.push_str(&net_set("always_denied4", "ipv4_addr", &denied4));
    t.push_str(&net_set("always_denied6", "ipv6_addr", &denied6));
    t.push_str(&net_set("deny4", "ipv4_addr", &deny4));
    t.push_str(&net_set("deny6", "ipv6_addr", &deny6));
    t.push_str(&net_set("allow4", "ipv4_addr", &allow4));
    t.push_str(&net_set("allow6", "ipv6_addr", &allow6));

    // Anti-spoofing, before conntrack sees the packet.
    let _ = writeln!(t, "\tchain antispoof {{");
    let _ = writeln!(t, "\t\ttype filter hook prerouting priority raw; policy accept;");
    let _ = writeln!(t, "\t\tiifname \"{tap}\" ether saddr != {GUEST_MAC} drop");
    match addr6 {
        None => {
            let _ = writeln!(t, "\t\tiifname \"{tap}\" meta nfproto ipv6 drop");
        }
        Some(_) => {
            let _ = writeln!(
                t,
                "\t\tiifname \"{tap}\" ip6 saddr != {{ {GUEST_ADDR6}, fe80::/10, :: }} limit rate {SPOOF_LOG_RATE}/second log group {g} prefix \"deny:spoofed\""
            );
            let _ = writeln!(
                t,
                "\t\tiifname \"{tap}\" ip6 saddr != {{ {GUEST_ADDR6}, fe80::/10, :: }} drop"
            );
        }
    }
    let _ = writeln!(
        t,
        "\t\tiifname \"{tap}\" ip saddr != {GUEST_ADDR} limit rate {SPOOF_LOG_RATE}/second log group {g} prefix \"deny:spoofed\""
    );
    let _ = writeln!(t, "\t\tiifname \"{tap}\" ip saddr != {GUEST_ADDR} drop");
    let _ = writeln!(t, "\t}}");

    let _ = writeln!(t, "\tchain nat_pre {{");
    let _ = writeln!(t, "\t\ttype nat hook prerouting priority dstnat; policy accept;");
    let _ = writeln!(t, "\t\tiifname \"{up}\" ip daddr {addr} dnat ip to {GUEST_ADDR}");
    if sb.proxy_tcp {
        let _ = writeln!(
            t,
            "\t\tiifname \"{tap}\" ip daddr != {GATEWAY} ip daddr != @peers tcp dport {{ 80, 443 }} dnat ip to {GATEWAY}:{PROXY_PORT}"
        );
    }
    let _ = writeln!(t, "\t}}");

    let _ = writeln!(t, "\tchain nat_post {{");
    let _ = writeln!(t, "\t\ttype nat hook postrouting priority srcnat; policy accept;");
    let _ = writeln!(t, "\t\toifname \"{up}\" ip saddr {GUEST_ADDR} snat ip to {addr}");
    if let Some(a6) = addr6 {
        let _ = writeln!(t, "\t\toifname \"{up}\" ip6 saddr {GUEST_ADDR6} snat ip6 to {a6}");
    }
    let _ = writeln!(t, "\t}}");

    let _ = writeln!(t, "\tchain to_gateway {{");
    let _ = writeln!(t, "\t\ttype filter hook input priority filter; policy drop;");
    let _ = writeln!(t, "\t\tiifname \"lo\" accept");
    let _ = writeln!(t, "\t\tct state established,related accept");
    if addr6.is_some() {
        let _ = writeln!(t, "\t\tiifname {{ \"{tap}\", \"{up}\" }} {ND} accept");
    }
    let _ = writeln!(t, "\t\tiifname \"{tap}\" ip daddr {GATEWAY} udp dport 53 accept");
    let _ = writeln!(
        t,
        "\t\tiifname \"{tap}\" ip daddr {GATEWAY} tcp dport {{ 53, {PROXY_PORT} }} accept"
    );
    let _ = writeln!(t, "\t}}");

    let _ = writeln!(t, "\tchain forwarding {{");
    let _ = writeln!(t, "\t\ttype filter hook forward priority filter; policy drop;");
    let _ = writeln!(t, "\t\tct state established,related accept");
    let _ = writeln!(t, "\t\tct state invalid drop");
    if let Some(net) = guest_net {
        // Nothing but the guest itself may be forwarded from the guest link (the raw chain already dropped
        // other sources; this keeps the forward path correct on its own).
        let _ = writeln!(t, "\t\tiifname \"{tap}\" ip saddr != {net} drop");
    }
    if addr6.is_some() {
        let _ = writeln!(t, "\t\tiifname \"{tap}\" ip6 saddr != {GUEST_ADDR6} drop");
    }
    let _ = writeln!(t, "\t\tiifname \"{tap}\" oifname \"{up}\" jump {EGRESS_CHAIN}");
    let _ = writeln!(t, "\t\tiifname \"{up}\" oifname \"{tap}\" ip saddr @peers accept");
    let _ = writeln!(t, "\t}}");

    let log = |verdict: &str, reason: &str| format!("log group {g} prefix \"{verdict}:{reason}\"");
    let _ = writeln!(t, "\tchain {EGRESS_CHAIN} {{");
    let _ = writeln!(
        t,
        "\t\tmeta l4proto {{ tcp, udp }} th dport {{ 53, 853 }} {} drop",
        log("deny", "dns_blocked")
    );
    if sb.proxy_tcp {
        // Domain rules are enforced by the proxy, which takes IPv4 only: IPv6 to the proxied ports would bypass
        // them. A reset (not a silent drop) makes clients fall back to IPv4 at once.
        let _ = writeln!(
            t,
            "\t\tmeta nfproto ipv6 tcp dport {{ 80, 443 }} {} reject with tcp reset",
            log("deny", "domain_rules_ipv4_only")
        );
    }
    let _ = writeln!(t, "\t\tip daddr @peers {} accept", log("allow", "private_peer"));
    let _ = writeln!(
        t,
        "\t\tip daddr @always_denied4 {} drop",
        log("deny", "always_denied")
    );
    let _ = writeln!(
        t,
        "\t\tip6 daddr @always_denied6 {} drop",
        log("deny", "always_denied")
    );
    let _ = writeln!(t, "\t\tip daddr @deny4 {} drop", log("deny", "deny_rule"));
    let _ = writeln!(t, "\t\tip6 daddr @deny6 {} drop", log("deny", "deny_rule"));
    let _ = writeln!(t, "\t\tip daddr @allow4 {} accept", log("allow", "allow_rule"));
    let _ = writeln!(t, "\t\tip6 daddr @allow6 {} accept", log("allow", "allow_rule"));
    if sb.default_allow {
        let _ = writeln!(t, "\t\t{} accept", log("allow", "default_allow"));
    } else {
        let _ = writeln!(t, "\t\t{} drop", log("deny", "default_deny"));
    }
    let _ = writeln!(t, "\t}}");
    t.push_str("}\n");
    t
}

/// The hub table, (re)built so that running it again changes nothing but the chains: the table and the set
/// of peer pairs are only added if missing (a daemon restart keeps the pairs of running sandboxes), the
/// chains are deleted and added anew.
pub fn hub_table(sandbox_net: Ipv4Net, sandbox_net6: Option<Ipv6Net>) -> String {
    let hrth = HUB_IF_PATTERN;
    let (v6_source, v6_nd, v6_masquerade) = match sandbox_net6 {
        None => (format!("iifname \"{hrth}\" meta nfproto ipv6 drop"), None, None),
        Some(n6) => (
            format!("iifname \"{hrth}\" ip6 saddr != {n6} drop"),
            Some(ND),
            Some(format!("oifname != \"{hrth}\" ip6 saddr {n6} masquerade")),
        ),
    };
    let nd_in: Vec<String> = v6_nd
        .iter()
        .map(|nd| format!("iifname \"{hrth}\" {nd} accept"))
        .collect();
    let nd_out: Vec<String> = v6_nd
        .iter()
        .map(|nd| format!("oifname \"{hrth}\" {nd} accept"))
        .collect();
    let chains: [(&str, &str, Vec<String>); 4] = [
        (
            "forwarding",
            "type filter hook forward priority filter; policy accept;",
            vec![
                format!("iifname \"{hrth}\" ip saddr != {sandbox_net} drop"),
                v6_source,
                format!("iifname \"{hrth}\" oifname \"{hrth}\" ip saddr . ip daddr @{PEER_SET} accept"),
                format!("iifname \"{hrth}\" oifname \"{hrth}\" drop"),
                format!("oifname \"{hrth}\" ct state established,related accept"),
                format!("oifname \"{hrth}\" drop"),
            ],
        ),
        (
            "from_sandboxes",
            "type filter hook input priority filter; policy accept;",
            [
                nd_in,
                vec![
                    format!("iifname \"{hrth}\" ct state established,related accept"),
                    format!("iifname \"{hrth}\" drop"),
                ],
            ]
            .concat(),
        ),
        (
            "to_sandboxes",
            "type filter hook output priority filter; policy accept;",
            [
                nd_out,
                vec![
                    format!("oifname \"{hrth}\" ct state established,related accept"),
                    format!("oifname \"{hrth}\" drop"),
                ],
            ]
            .concat(),
        ),
        (
            "masquerade_out",
            "type nat hook postrouting priority srcnat; policy accept;",
            std::iter::once(format!("oifname != \"{hrth}\" ip saddr {sandbox_net} masquerade"))
                .chain(v6_masquerade)
                .collect(),
        ),
    ];
    let mut t = String::new();
    let _ = writeln!(t, "add table inet {HUB_TABLE}");
    let _ = writeln!(
        t,
        "add set inet {HUB_TABLE} {PEER_SET} {{ type ipv4_addr . ipv4_addr; }}"
    );
    for (name, _, _) in &chains {
        let _ = writeln!(t, "add chain inet {HUB_TABLE} {name}");
        let _ = writeln!(t, "delete chain inet {HUB_TABLE} {name}");
    }
    let _ = writeln!(t, "table inet {HUB_TABLE} {{");
    for (name, spec, rules) in &chains {
        let _ = writeln!(t, "\tchain {name} {{");
        let _ = writeln!(t, "\t\t{spec}");
        for r in rules {
            let _ = writeln!(t, "\t\t{r}");
        }
        let _ = writeln!(t, "\t}}");
    }
    t.push_str("}\n");
    t
}

/// Replaces the hub's peer pairs: each pair is allowed in both directions.
pub fn peer_pairs(pairs: &[(Ipv4Addr, Ipv4Addr)]) -> String {
    let mut t = format!("flush set inet {HUB_TABLE} {PEER_SET}\n");
    let mut elems: Vec<String> = Vec::new();
    for (a, b) in pairs {
        for e in [format!("{a} . {b}"), format!("{b} . {a}")] {
            if !elems.contains(&e) {
                elems.push(e);
            }
        }
    }
    if !elems.is_empty() {
        let _ = writeln!(
            t,
            "add element inet {HUB_TABLE} {PEER_SET} {{ {} }}",
            elems.join(", ")
        );
    }
    t
}

/// Removes single (directed) pairs from the hub's set.
pub fn remove_peer_pairs(pairs: &[(Ipv4Addr, Ipv4Addr)]) -> String {
    if pairs.is_empty() {
        return String::new();
    }
    let elems: Vec<String> = pairs.iter().map(|(a, b)| format!("{a} . {b}")).collect();
    format!(
        "delete element inet {HUB_TABLE} {PEER_SET} {{ {} }}\n",
        elems.join(", ")
    )
}

/// The IPv6 address of the sandbox (or hub) whose IPv4 address is `v4`: the range's prefix with `v4` in the
/// low 32 bits (e.g. `2001:db8:5::/64` and `10.213.0.7` give `2001:db8:5::ad5:7`). The range is at most a /64
/// ([`crate::plane::Plane::new`] checks), so distinct IPv4 addresses map to distinct IPv6 addresses.
pub fn address6(sandbox_net6: Ipv6Net, v4: Ipv4Addr) -> Ipv6Addr {
    Ipv6Addr::from(u128::from(sandbox_net6.network()) | u128::from(u32::from(v4)))
}

/// The hub's address: the first host of the sandbox range.
pub fn hub_address(sandbox_net: Ipv4Net) -> Ipv4Addr {
    let base = u32::from(sandbox_net.network());
    Ipv4Addr::from(base.wrapping_add(1))
}

fn split(nets: &[IpNet]) -> (Vec<IpNet>, Vec<IpNet>) {
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for n in nets {
        match n {
            IpNet::V4(_) => v4.push(n.trunc()),
            IpNet::V6(_) => v6.push(n.trunc()),
        }
    }
    (v4, v6)
}

fn net_set(name: &str, ty: &str, nets: &[IpNet]) -> String {
    let elems: Vec<String> = nets.iter().map(fmt_net).collect();
    let mut t = format!("\tset {name} {{\n\t\ttype {ty}; flags interval; auto-merge;\n");
    if !elems.is_empty() {
        let _ = writeln!(t, "\t\telements = {{ {} }}", elems.join(", "));
    }
    t.push_str("\t}\n");
    t
}

fn addr_set(name: &str, ty: &str, elems: &[String]) -> String {
    let mut t = format!("\tset {name} {{\n\t\ttype {ty};\n");
    if !elems.is_empty() {
        let _ = writeln!(t, "\t\telements = {{ {} }}", elems.join(", "));
    }
    t.push_str("\t}\n");
    t
}

/// A single address as itself, a network as `addr/len`.
fn fmt_net(n: &IpNet) -> String {
    match n {
        IpNet::V4(v) if v.prefix_len() == 32 => IpAddr::V4(v.addr()).to_string(),
        IpNet::V6(v) if v.prefix_len() == 128 => IpAddr::V6(v.addr()).to_string(),
        _ => n.to_string(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::plane::GuestLink;

    fn sb() -> SandboxNet {
        SandboxNet {
            id: "sbx_0123456789abcdef".into(),
            address: "10.213.0.7".parse().unwrap(),
            default_allow: false,
            allow: vec![
                "203.0.113.0/24".parse().unwrap(),
                "2001:db8::/32".parse().unwrap(),
            ],
            deny: vec!["203.0.113.7/32".parse().unwrap()],
            proxy_tcp: true,
            peers: vec!["10.213.0.9".parse().unwrap(), "169.254.169.254".parse().unwrap()],
            extra_denied: vec!["192.0.2.1".parse().unwrap()],
            guest_link: GuestLink::Tap,
        }
    }

    #[test]
    fn sandbox_table_orders_decisions_and_keeps_foreign_peers_out() {
        let t = sandbox_table(&sb(), "10.213.0.0/16".parse().unwrap(), None);
        let pos = |needle: &str| {
            t.find(needle)
                .unwrap_or_else(|| panic!("missing {needle:?} in\n{t}"))
        };
        assert!(pos("deny:dns_blocked") < pos("allow:private_peer"));
        assert!(pos("allow:private_peer") < pos("deny:always_denied"));
        assert!(pos("deny:always_denied") < pos("deny:deny_rule"));
        assert!(pos("deny:deny_rule") < pos("allow:allow_rule"));
        assert!(pos("allow:allow_rule") < pos("deny:default_deny"));
        assert!(!t.contains("default_allow"));
        // The peer outside the sandbox range is ignored.
        assert!(t.contains("elements = { 10.213.0.9 }"), "{t}");
        assert!(!t.contains("169.254.169.254 }"));
        assert!(t.contains("dnat ip to 172.16.0.1:15001"));
        assert!(t.contains("snat ip to 10.213.0.7"));
        assert!(t.contains("192.0.2.1"));
        assert!(t.contains("10.213.0.0/16"));
        assert!(t.contains("2001:db8::/32"));
        assert!(t.starts_with("table inet hearth\ndelete table inet hearth\n"));
    }

    #[test]
    fn always_denied_sets_hold_the_ipv4_carrying_prefixes_and_host_services() {
        let t = sandbox_table(&sb(), "10.213.0.0/16".parse().unwrap(), None);
        let set = |name: &str| {
            let start = t.find(&format!("set {name} {{")).unwrap();
            let end = start + t[start..].find("\t}").unwrap();
            t[start..end].to_string()
        };
        let (v4, v6) = (set("always_denied4"), set("always_denied6"));
        for net in [
            "168.63.129.16",
            "192.88.99.0/24",
            "169.254.0.0/16",
            "100.64.0.0/10",
        ] {
            assert!(v4.contains(net), "{net} missing from {v4}");
        }
        for net in [
            "::/96",
            "::ffff:0.0.0.0/96",
            "::ffff:0:0:0/96",
            "64:ff9b::/96",
            "64:ff9b:1::/48",
            "2001::/32",
            "2002::/16",
            "fc00::/7",
        ] {
            assert!(v6.contains(net), "{net} missing from {v6}");
        }
        // Checked before the allow sets, which may name the same space.
        assert!(t.find("@always_denied6").unwrap() < t.find("@allow6").unwrap());
    }

    #[test]
    fn proxied_ports_are_refused_over_ipv6_when_domain_rules_apply() {
        let s = sb();
        assert!(s.proxy_tcp);
        let t = sandbox_table(&s, "10.213.0.0/16".parse().unwrap(), None);
        assert!(
            t.contains("meta nfproto ipv6 tcp dport { 80, 443 } log group 4 prefix \"deny:domain_rules_ipv4_only\" reject with tcp reset"),
            "{t}"
        );
        let mut s = sb();
        s.proxy_tcp = false;
        assert!(
            !sandbox_table(&s, "10.213.0.0/16".parse().unwrap(), None).contains("domain_rules_ipv4_only")
        );
    }

    #[test]
    fn no_proxy_redirect_without_proxy_tcp() {
        let mut s = sb();
        s.proxy_tcp = false;
        s.default_allow = true;
        let t = sandbox_table(&s, "10.213.0.0/16".parse().unwrap(), None);
        assert!(!t.contains("dnat ip to 172.16.0.1:15001"));
        assert!(t.contains("allow:default_allow\" accept"));
    }

    #[test]
    fn ipv6_is_dropped_without_a_range_and_judged_like_ipv4_with_one() {
        let net: Ipv4Net = "10.213.0.0/16".parse().unwrap();
        let t = sandbox_table(&sb(), net, None);
        assert!(t.contains("iifname \"tap0\" meta nfproto ipv6 drop"), "{t}");
        assert!(!t.contains("snat ip6"));
        let h = hub_table(net, None);
        assert!(h.contains("iifname \"hrth*\" meta nfproto ipv6 drop"), "{h}");
        assert!(!h.contains("ip6 saddr"));

        let net6: Ipv6Net = "2001:db8:5::/64".parse().unwrap();
        let t = sandbox_table(&sb(), net, Some(net6));
        assert!(!t.contains("meta nfproto ipv6 drop"), "{t}");
        assert!(t.contains("snat ip6 to 2001:db8:5::ad5:7"), "{t}");
        assert!(
            t.contains("ip6 saddr != { fd68:6872:7468::2, fe80::/10, :: } drop"),
            "{t}"
        );
        assert!(t.contains("ip6 saddr != fd68:6872:7468::2 drop"), "{t}");
        assert!(t.contains("nd-neighbor-solicit"));
        // The sandbox IPv6 range is always denied, like the IPv4 one.
        assert!(t.contains("2001:db8:5::/64"), "{t}");
        let h = hub_table(net, Some(net6));
        assert!(
            h.contains("iifname \"hrth*\" ip6 saddr != 2001:db8:5::/64 drop"),
            "{h}"
        );
        assert!(
            h.contains("oifname != \"hrth*\" ip6 saddr 2001:db8:5::/64 masquerade"),
            "{h}"
        );
        assert!(h.contains("iifname \"hrth*\" icmpv6 type"), "{h}");
        assert!(h.contains("oifname \"hrth*\" icmpv6 type"), "{h}");
        assert_eq!(
            address6("2001:db8:5::/64".parse().unwrap(), Ipv4Addr::new(10, 213, 0, 1)).to_string(),
            "2001:db8:5::ad5:1"
        );
    }

    #[test]
    fn peer_pairs_go_both_ways_once() {
        let a: Ipv4Addr = "10.213.0.2".parse().unwrap();
        let b: Ipv4Addr = "10.213.0.3".parse().unwrap();
        let t = peer_pairs(&[(a, b), (b, a)]);
        assert_eq!(
            t,
            "flush set inet hearth_hub peer_pairs\nadd element inet hearth_hub peer_pairs { 10.213.0.2 . 10.213.0.3, 10.213.0.3 . 10.213.0.2 }\n"
        );
        assert_eq!(peer_pairs(&[]), "flush set inet hearth_hub peer_pairs\n");
    }

    #[test]
    fn hub_address_is_the_first_host() {
        assert_eq!(
            hub_address("10.213.0.0/16".parse().unwrap()),
            Ipv4Addr::new(10, 213, 0, 1)
        );
        assert_eq!(
            hub_address("10.213.5.0/24".parse().unwrap()),
            Ipv4Addr::new(10, 213, 5, 1)
        );
    }
}
