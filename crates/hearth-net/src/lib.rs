//! Sandbox networking.
//!
//! # Topology
//! Every sandbox gets a network namespace of its own (`hearth-<sandbox id>`) holding:
//! - `tap0`, the guest's NIC (the VMM attaches to it), address [`GATEWAY`] with the fixed MAC [`GATEWAY_MAC`];
//!   the guest is always [`GUEST_ADDR`]/30 behind it. Because every namespace looks the same from inside, a
//!   snapshot restored or forked into a fresh namespace finds its gateway again without reconfiguration
//!   (Firecracker's guidance for clones).
//! - `up0`, one end of a veth pair whose other end (`hrth<8 hex>`) lives in the *uplink* namespace (the host's
//!   own by default; tests pass a namespace they made). `up0` carries the sandbox's unique address from the
//!   sandbox range (default 10.213.0.0/16); guest traffic is SNATed to it, and private-network peers reach the
//!   guest at that address (DNAT to [`GUEST_ADDR`]).
//! - an nftables table `inet hearth` with the sandbox's egress policy, anti-spoofing, the always-denied ranges
//!   and the redirect of TCP 80/443 to the egress proxy when the policy names domains.
//!
//! The daemon's per-sandbox services (DNS resolver on [`GATEWAY`]:53, egress proxy on [`GATEWAY`]:[`PROXY_PORT`])
//! listen on sockets created inside the sandbox namespace ([`netns::in_netns`]); their upstream sockets are
//! created in the uplink namespace, so a test can give the daemon a fake internet. How many connections they
//! hold per sandbox and together is bounded ([`limits`]); everything they read from a guest is hostile and each
//! decoder of it has a fuzz target (`crates/hearth-net/fuzz`).
//!
//! # Layout
//! - [`netns`]: run code in a named network namespace; create sockets there.
//! - [`plane`]: create/destroy a sandbox's namespace, links, routes and nftables rules; the uplink "hub";
//!   sweeping what belongs to no live sandbox.
//! - [`nflog`]: reads the kernel's NFLOG records of the nftables rules into audit events.
//! - [`ruleset`]: the nftables rulesets (sandbox table, hub table, peer pairs) as text for `nft -f -`.
//! - [`policy`]: parsed egress policy and its decisions.
//! - [`limits`]: how many connections one sandbox, and all together, may make the daemon hold.
//! - [`dns`]: the per-sandbox resolver and the upstream client.
//! - [`proxy`]: the transparent TCP egress proxy (TLS SNI / HTTP Host; every request of a kept-alive HTTP/1
//!   connection is framed and judged).
//! - [`audit`]: the bounded per-sandbox egress log and its counters.

use std::net::{Ipv4Addr, Ipv6Addr};

pub mod audit;
pub mod ctx;
pub mod dns;
pub mod limits;
pub mod netns;
pub mod nflog;
pub mod plane;
pub mod policy;
pub mod proxy;
pub mod ruleset;

/// The guest's own address (same in every sandbox).
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
/// The guest's gateway and resolver: `tap0`'s address in the sandbox namespace.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// Prefix length of the guest link.
pub const GUEST_PREFIX: u8 = 30;
/// The guest's own IPv6 address (same in every sandbox; a ULA, `fd68:6872:7468::/64`, "hrth" in hex), used
/// when the plane has a sandbox IPv6 range ([`plane::PlaneConfig::sandbox_net6`]).
pub const GUEST_ADDR6: Ipv6Addr = Ipv6Addr::new(0xfd68, 0x6872, 0x7468, 0, 0, 0, 0, 2);
/// The guest's IPv6 gateway: `tap0`'s IPv6 address in the sandbox namespace.
pub const GATEWAY6: Ipv6Addr = Ipv6Addr::new(0xfd68, 0x6872, 0x7468, 0, 0, 0, 0, 1);
/// Prefix length of the guest link's IPv6 subnet.
pub const GUEST_PREFIX6: u8 = 64;
/// MAC of `tap0` (fixed so a restored guest's ARP cache stays right).
pub const GATEWAY_MAC: &str = "02:68:72:74:68:01";
/// MAC of the guest's NIC.
pub const GUEST_MAC: &str = "02:68:72:74:68:02";
/// Name of the guest's tap inside the sandbox namespace.
pub const TAP_NAME: &str = "tap0";
/// Port of the egress proxy on [`GATEWAY`].
pub const PROXY_PORT: u16 = 15001;

/// Destinations denied whatever a policy says (besides the uplink's own addresses and other sandboxes, which
/// the daemon knows at run time). Parse with `str::parse::<ipnet::IpNet>()`. They are checked before any policy
/// rule, in the kernel (the sandbox table's `always_denied4`/`always_denied6` sets) as in the proxy and the
/// resolver, so an allow rule naming them is accepted but never takes effect.
///
/// - IPv4: "this network", private (RFC 1918), CGNAT (also Alibaba Cloud's metadata `100.100.100.200`),
///   loopback, link-local (every cloud's metadata service at `169.254.169.254`, AWS's DNS and time servers),
///   IETF protocol assignments (Oracle Cloud's `192.0.0.192`), the deprecated 6to4 relay anycast range (a
///   tunnel out of the IPv6 rules), benchmarking, multicast, reserved and broadcast, and Azure's host-service
///   address `168.63.129.16` (WireServer and the host's DNS: public space that only the host answers).
/// - IPv6: unspecified, loopback and the deprecated IPv4-compatible `::/96` (routed through a `sit` tunnel
///   where one exists), IPv4-mapped and SIIT-translated forms, NAT64 (`64:ff9b::/96` and the local-use
///   `64:ff9b:1::/48`: a NAT64 gateway would carry the guest to any IPv4 address, private ones included,
///   outside the IPv4 rules), 6to4 (`2002::/16`) and Teredo (`2001::/32`), which embed IPv4 addresses and
///   tunnel over IPv4, unique local (with AWS's `fd00:ec2::254` and GCP's `fd20:ce::254` metadata),
///   link-local, site-local and multicast.
pub const ALWAYS_DENIED: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "168.63.129.16/32",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.88.99.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "::/96",
    "::ffff:0:0/96",
    "::ffff:0:0:0/96",
    "64:ff9b::/96",
    "64:ff9b:1::/48",
    "2001::/32",
    "2002::/16",
    "fc00::/7",
    "fe80::/10",
    "fec0::/10",
    "ff00::/8",
];

/// [`ALWAYS_DENIED`], parsed.
pub fn always_denied() -> Vec<ipnet::IpNet> {
    ALWAYS_DENIED
        .iter()
        .map(|s| s.parse().expect("ALWAYS_DENIED entries are valid CIDRs"))
        .collect()
}

/// Name of a sandbox's network namespace (`/run/netns/<name>`).
pub fn netns_name(sandbox_id: &str) -> String {
    format!("hearth-{sandbox_id}")
}

/// Path of a sandbox's network namespace.
pub fn netns_path(sandbox_id: &str) -> std::path::PathBuf {
    std::path::PathBuf::from("/run/netns").join(netns_name(sandbox_id))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    #[test]
    fn always_denied_ranges_parse_and_cover_the_metadata_address() {
        let ranges = super::always_denied();
        assert_eq!(ranges.len(), super::ALWAYS_DENIED.len());
        for probe in [
            "169.254.169.254",
            "fd00:ec2::254",
            "fd20:ce::254",
            "10.1.2.3",
            "127.0.0.1",
            "100.64.0.1",
            "100.100.100.200",
            "192.0.0.192",
            "168.63.129.16",
            "192.88.99.1",
            "::",
            "::1",
            "::203.0.113.10",
            "::ffff:203.0.113.10",
            "::ffff:0:203.0.113.10",
            "64:ff9b::203.0.113.10",
            "64:ff9b:1::1",
            "2002:cb00:710a::1",
            "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        ] {
            let ip: std::net::IpAddr = probe.parse().unwrap();
            assert!(ranges.iter().any(|n| n.contains(&ip)), "{probe} must be denied");
        }
        for public in [
            "203.0.113.10",
            "168.63.129.17",
            "2001:db8::1",
            "2001:1::1",
            "2003::1",
        ] {
            let public: std::net::IpAddr = public.parse().unwrap();
            assert!(
                !ranges.iter().any(|n| n.contains(&public)),
                "{public} must not be denied"
            );
        }
    }
}
