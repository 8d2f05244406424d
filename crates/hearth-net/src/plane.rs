//! The data plane: a sandbox's network namespace, its links, routes and nftables table, and the "hub" in the
//! uplink namespace that connects every sandbox to the uplink (see the crate doc for the topology and
//! [`crate::ruleset`] for the rules).
//!
//! Everything is done with `ip` and `nft` child processes (spawned from a thread inside the namespace
//! concerned), so each call here blocks for a few milliseconds: call from `spawn_blocking` in async code.
//!
//! # IPv6
//! Without a sandbox IPv6 range ([`PlaneConfig::sandbox_net6`] `None`, the default) sandboxes have no IPv6
//! path: IPv6 is disabled in the sandbox namespace and on its uplink link, and the sandbox table drops every
//! IPv6 packet from the guest, so a guest's IPv6 attempt is always denied whatever the policy says.
//!
//! With a range (a /64 or larger), IPv6 mirrors IPv4: the guest is [`GUEST_ADDR6`]/64 behind [`GATEWAY6`] on
//! `tap0` (same in every sandbox); `up0` carries the sandbox's own IPv6 address, the range's prefix with the
//! sandbox's IPv4 address in the low 32 bits ([`ruleset::address6`]), to which the guest's IPv6 traffic is
//! SNATed; the hub (the mapping of the IPv4 hub address) routes it and masquerades it towards the uplink. The
//! egress chain judges IPv6 like IPv4 (always-denied ranges, the range itself and the uplink's own addresses,
//! deny and allow CIDRs, the default). Neighbour discovery is accepted on `tap0`, `up0` and the hub links;
//! addresses are added without duplicate address detection, router advertisements are not accepted. IPv6
//! forwarding is turned on in the uplink namespace, which makes a host uplink stop accepting router
//! advertisements unless its interfaces have `accept_ra=2`.
//!
//! # Ownership
//! Namespaces are named `hearth-<id>` in `/run/netns`, which every process on the machine shares; the uplink
//! ends are named `hrth<8 hex>`. Each plane stamps what it creates with a tag derived from its uplink
//! namespace and sandbox range (the alias of `lo` in the sandbox namespace and of the uplink link), and
//! [`Plane::sweep`] only removes what carries its own tag, no tag (a creation that died half-way), or has lost
//! its uplink link (its uplink namespace is gone), so two planes on one machine (e.g. tests running in
//! parallel) never sweep each other's live sandboxes. Creation and the sweep's scan are serialised by a lock
//! file. One plane per uplink namespace: the hub table belongs to it.

mod cmd;
mod sweep;

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use nix::fcntl::{Flock, FlockArg};

use crate::ruleset::{self, UPLINK_IF};
use crate::{
    GATEWAY, GATEWAY_MAC, GATEWAY6, GUEST_ADDR, GUEST_ADDR6, GUEST_MAC, GUEST_PREFIX, GUEST_PREFIX6,
    TAP_NAME, netns_name, netns_path,
};
use cmd::{IP, ip_batch, ip_json, is_missing, nft, run, sysctls};

/// Name of the guest's interface in a [`GuestLink::Veth`] guest namespace.
pub const VETH_GUEST_IF: &str = "eth0";
/// Serialises sandbox creation with [`Plane::sweep`]'s scan of namespaces, across processes.
const LOCK_PATH: &str = "/run/hearth-net.lock";

/// Errors of the data plane. Each carries the object or command it concerns.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("invalid sandbox id {0:?}")]
    InvalidId(String),
    #[error("{address} is not a sandbox address of {net}")]
    InvalidAddress { address: Ipv4Addr, net: Ipv4Net },
    #[error("sandbox range {0} is too small (at most /30)")]
    InvalidRange(Ipv4Net),
    #[error("sandbox IPv6 range {0} is too small (at most /64)")]
    InvalidRange6(Ipv6Net),
    #[error("sandbox {0} already has a network namespace")]
    Exists(String),
    #[error("uplink link {link} of sandbox {id} is taken by another sandbox")]
    LinkTaken { id: String, link: String },
    #[error("`{command}` failed: {stderr}")]
    Command { command: String, stderr: String },
    #[error("unexpected output of `{command}`: {detail}")]
    Parse { command: String, detail: String },
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

/// Where sandboxes connect to and which addresses they get.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaneConfig {
    /// Namespace of the uplink: the host's by default; tests pass a namespace they made (a fake internet).
    pub uplink_netns: PathBuf,
    /// The range sandbox addresses come from; its first host is the hub address on every uplink link.
    pub sandbox_net: Ipv4Net,
    /// The IPv6 range sandboxes' IPv6 addresses come from (a /64 or larger): `None` gives sandboxes no IPv6
    /// path (every IPv6 packet from a guest is dropped). See the module doc.
    pub sandbox_net6: Option<Ipv6Net>,
}

impl Default for PlaneConfig {
    fn default() -> Self {
        PlaneConfig {
            uplink_netns: crate::netns::host_netns().to_path_buf(),
            sandbox_net: Ipv4Net::new(Ipv4Addr::new(10, 213, 0, 0), 16).unwrap_or_default(),
            sandbox_net6: None,
        }
    }
}

/// What the guest side of `tap0` is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestLink {
    /// A persistent tap device the VMM attaches to.
    Tap,
    /// A veth pair whose other end (`eth0`, configured as the guest would be) goes into `guest_netns`: a
    /// stand-in for a VM in tests.
    Veth { guest_netns: PathBuf },
}

/// One sandbox's network: identity, egress policy (CIDR part) and peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxNet {
    /// `sbx_<16 hex>`; the namespace is [`netns_name`] of it.
    pub id: String,
    /// The sandbox's unique address from the sandbox range (the daemon allocates it).
    pub address: Ipv4Addr,
    /// Egress default when no CIDR rule matches.
    pub default_allow: bool,
    /// CIDRs the guest may reach.
    pub allow: Vec<IpNet>,
    /// CIDRs the guest may not reach (deny wins over allow).
    pub deny: Vec<IpNet>,
    /// Redirect guest TCP to ports 80 and 443 to the egress proxy on [`GATEWAY`]:[`crate::PROXY_PORT`].
    pub proxy_tcp: bool,
    /// Addresses of private-network peers (reachable both ways; the hub must allow the pairs too, see
    /// [`Plane::set_peer_pairs`]).
    pub peers: Vec<Ipv4Addr>,
    /// Further always-denied addresses: the uplink's own ([`Plane::uplink_addresses`]), the daemon's API.
    pub extra_denied: Vec<IpAddr>,
    pub guest_link: GuestLink,
}

/// The data plane over one uplink namespace.
#[derive(Debug)]
pub struct Plane {
    cfg: PlaneConfig,
    hub: Ipv4Addr,
    tag: String,
}

impl Plane {
    /// Sets up the hub in the uplink namespace (idempotent): IPv4 forwarding on and the table `inet
    /// hearth_hub` (peer pairs already set are kept).
    pub fn new(cfg: PlaneConfig) -> Result<Plane, NetError> {
        let net = cfg.sandbox_net.trunc();
        if net.prefix_len() > 30 {
            return Err(NetError::InvalidRange(net));
        }
        let net6 = cfg.sandbox_net6.map(|n| n.trunc());
        if let Some(n6) = net6
            && n6.prefix_len() > 64
        {
            return Err(NetError::InvalidRange6(n6));
        }
        let meta = std::fs::metadata(&cfg.uplink_netns).map_err(|source| NetError::Io {
            context: format!("uplink namespace {}", cfg.uplink_netns.display()),
            source,
        })?;
        let tag = format!(
            "hearth:{:016x}",
            fnv1a64(format!("{}:{}:{net}", meta.dev(), meta.ino()).as_bytes())
        );
        let cfg = PlaneConfig {
            uplink_netns: cfg.uplink_netns,
            sandbox_net: net,
            sandbox_net6: net6,
        };
        let plane = Plane {
            hub: ruleset::hub_address(net),
            tag,
            cfg,
        };
        sysctls(&plane.cfg.uplink_netns, &[("ipv4/ip_forward", "1", false)])?;
        if net6.is_some() {
            sysctls(
                &plane.cfg.uplink_netns,
                &[("ipv6/conf/all/forwarding", "1", false)],
            )?;
        }
        nft(Some(&plane.cfg.uplink_netns), &ruleset::hub_table(net, net6))?;
        Ok(plane)
    }

    pub fn config(&self) -> &PlaneConfig {
        &self.cfg
    }

    /// The hub address (first host of the sandbox range), the sandboxes' next hop.
    pub fn hub_address(&self) -> Ipv4Addr {
        self.hub
    }

    /// The hub's IPv6 address (the IPv4 hub address mapped into the IPv6 range), when there is a range.
    pub fn hub_address6(&self) -> Option<Ipv6Addr> {
        self.cfg.sandbox_net6.map(|n| ruleset::address6(n, self.hub))
    }

    /// The IPv6 address of the sandbox whose IPv4 address is `address`, when there is a range.
    pub fn sandbox_address6(&self, address: Ipv4Addr) -> Option<Ipv6Addr> {
        self.cfg.sandbox_net6.map(|n| ruleset::address6(n, address))
    }

    /// The tag this plane stamps on what it creates (interface alias).
    pub fn tag(&self) -> &str {
        &self.tag
    }

    /// Creates the sandbox's namespace, links, routes and table. On error nothing is left behind.
    pub fn create_sandbox(&self, sb: &SandboxNet) -> Result<(), NetError> {
        validate_id(&sb.id)?;
        self.validate_address(sb.address)?;
        let name = netns_name(&sb.id);
        if netns_path(&sb.id).exists() {
            return Err(NetError::Exists(sb.id.clone()));
        }
        // Held for the whole creation, so a sweep (in any process) never sees a half-made namespace.
        let _lock = lock()?;
        // A link of that name belongs to another sandbox (ids hashing alike): refuse before making anything,
        // since cleaning up would delete it.
        let hrth = link_name(&sb.id);
        if run(
            Some(&self.cfg.uplink_netns),
            IP,
            &["link", "show", "dev", &hrth],
            None,
        )
        .is_ok()
        {
            return Err(NetError::LinkTaken {
                id: sb.id.clone(),
                link: hrth,
            });
        }
        run(None, IP, &["netns", "add", &name], None)?;
        let made = run(
            None,
            IP,
            &["-n", &name, "link", "set", "lo", "alias", &self.tag],
            None,
        )
        .and_then(|_| self.build(sb));
        if let Err(e) = made {
            self.cleanup_after_failure(&sb.id);
            return Err(e);
        }
        Ok(())
    }

    fn build(&self, sb: &SandboxNet) -> Result<(), NetError> {
        let name = netns_name(&sb.id);
        let ns = netns_path(&sb.id);
        let uplink = Some(self.cfg.uplink_netns.as_path());
        let hrth = link_name(&sb.id);
        let hub = self.hub;
        let addr = sb.address;

        let v6 = self.hub_address6().zip(self.sandbox_address6(addr));
        // Defaults first, so the links created below inherit them: no IPv6 at all, or IPv6 forwarding
        // without duplicate address detection, autoconfiguration or router advertisements.
        if v6.is_some() {
            sysctls(
                &ns,
                &[
                    ("ipv6/conf/all/disable_ipv6", "0", false),
                    ("ipv6/conf/default/disable_ipv6", "0", false),
                    ("ipv6/conf/all/accept_dad", "0", false),
                    ("ipv6/conf/default/accept_dad", "0", false),
                    ("ipv6/conf/all/accept_ra", "0", false),
                    ("ipv6/conf/default/accept_ra", "0", false),
                    ("ipv6/conf/all/autoconf", "0", false),
                    ("ipv6/conf/default/autoconf", "0", false),
                    ("ipv6/conf/all/forwarding", "1", false),
                    ("ipv4/ip_forward", "1", false),
                ],
            )?;
        } else {
            sysctls(
                &ns,
                &[
                    ("ipv6/conf/all/disable_ipv6", "1", true),
                    ("ipv6/conf/default/disable_ipv6", "1", true),
                    ("ipv4/ip_forward", "1", false),
                ],
            )?;
        }

        // The uplink pair: `up0` is created straight into the sandbox namespace.
        ip_batch(
            uplink,
            &format!(
                "link add {hrth} type veth peer name {UPLINK_IF} netns {name}\nlink set {hrth} alias {}\n",
                self.tag
            ),
        )?;
        let mut hub_script = format!(
            "link set {hrth} up\naddr add {hub}/32 dev {hrth}\nroute add {addr}/32 dev {hrth} scope link\n"
        );
        match v6 {
            None => sysctls(
                &self.cfg.uplink_netns,
                &[(&format!("ipv6/conf/{hrth}/disable_ipv6"), "1", true)],
            )?,
            Some((hub6, addr6)) => {
                sysctls(
                    &self.cfg.uplink_netns,
                    &[
                        (&format!("ipv6/conf/{hrth}/disable_ipv6"), "0", false),
                        (&format!("ipv6/conf/{hrth}/accept_dad"), "0", false),
                        (&format!("ipv6/conf/{hrth}/accept_ra"), "0", false),
                        (&format!("ipv6/conf/{hrth}/autoconf"), "0", false),
                    ],
                )?;
                hub_script.push_str(&format!(
                    "addr add {hub6}/128 dev {hrth} nodad\nroute add {addr6}/128 dev {hrth}\n"
                ));
            }
        }
        ip_batch(uplink, &hub_script)?;

        // The guest link.
        let mut script = String::from("link set lo up\n");
        match &sb.guest_link {
            GuestLink::Tap => script.push_str(&format!("tuntap add dev {TAP_NAME} mode tap\n")),
            GuestLink::Veth { guest_netns } => ip_batch(
                Some(guest_netns),
                &format!("link add {VETH_GUEST_IF} type veth peer name {TAP_NAME} netns {name}\n"),
            )?,
        }

        // Rules before any link is up.
        self.apply_rules(sb)?;

        script.push_str(&format!(
            "link set {TAP_NAME} address {GATEWAY_MAC}\n\
             addr add {GATEWAY}/{GUEST_PREFIX} dev {TAP_NAME}\n\
             link set {TAP_NAME} up\n\
             link set {UPLINK_IF} up\n\
             addr add {addr}/32 dev {UPLINK_IF}\n\
             route add {hub}/32 dev {UPLINK_IF} scope link\n\
             route add default via {hub} dev {UPLINK_IF} onlink\n"
        ));
        if let Some((hub6, addr6)) = v6 {
            script.push_str(&format!(
                "addr add {GATEWAY6}/{GUEST_PREFIX6} dev {TAP_NAME} nodad\n\
                 addr add {addr6}/128 dev {UPLINK_IF} nodad\n\
                 route add {hub6}/128 dev {UPLINK_IF}\n\
                 route add default via {hub6} dev {UPLINK_IF}\n"
            ));
        }
        ip_batch(Some(&ns), &script)?;

        if let GuestLink::Veth { guest_netns } = &sb.guest_link {
            ip_batch(
                Some(guest_netns),
                &format!(
                    "link set {VETH_GUEST_IF} address {GUEST_MAC}\n\
                     addr add {GUEST_ADDR}/{GUEST_PREFIX} dev {VETH_GUEST_IF}\n\
                     link set {VETH_GUEST_IF} up\n\
                     route add default via {GATEWAY} dev {VETH_GUEST_IF}\n"
                ),
            )?;
            if v6.is_some() {
                sysctls(
                    guest_netns,
                    &[
                        (&format!("ipv6/conf/{VETH_GUEST_IF}/disable_ipv6"), "0", false),
                        (&format!("ipv6/conf/{VETH_GUEST_IF}/accept_dad"), "0", false),
                    ],
                )?;
                ip_batch(
                    Some(guest_netns),
                    &format!(
                        "addr add {GUEST_ADDR6}/{GUEST_PREFIX6} dev {VETH_GUEST_IF} nodad\n\
                         route add default via {GATEWAY6} dev {VETH_GUEST_IF}\n"
                    ),
                )?;
            }
        }
        Ok(())
    }

    fn cleanup_after_failure(&self, id: &str) {
        if let Err(e) = self.teardown(id).map(drop) {
            tracing::warn!(sandbox = id, error = %e, "cleaning up a failed sandbox network");
        }
    }

    /// Replaces the sandbox's table atomically (policy or peers changed). Effective at once for new
    /// connections; established ones keep going.
    pub fn apply_rules(&self, sb: &SandboxNet) -> Result<(), NetError> {
        validate_id(&sb.id)?;
        self.validate_address(sb.address)?;
        nft(
            Some(&netns_path(&sb.id)),
            &ruleset::sandbox_table(sb, self.cfg.sandbox_net, self.cfg.sandbox_net6),
        )
    }

    /// Replaces the hub's set of sandbox address pairs that may talk (both directions). Takes effect for every
    /// packet at once, established connections included.
    pub fn set_peer_pairs(&self, pairs: &[(Ipv4Addr, Ipv4Addr)]) -> Result<(), NetError> {
        nft(Some(&self.cfg.uplink_netns), &ruleset::peer_pairs(pairs))
    }

    /// Removes the sandbox's namespace (with its links and table), its uplink link and the hub's peer pairs
    /// naming its address. Idempotent.
    pub fn destroy_sandbox(&self, id: &str) -> Result<(), NetError> {
        validate_id(id)?;
        self.teardown(id).map(drop)
    }

    /// Removes everything of sandbox `id`; returns the hub pairs it removed.
    fn teardown(&self, id: &str) -> Result<Vec<(Ipv4Addr, Ipv4Addr)>, NetError> {
        let hrth = link_name(id);
        let uplink = Some(self.cfg.uplink_netns.as_path());
        // The sandbox's address is what the uplink routes to its link (unknown once the link is gone).
        let addresses: Vec<Ipv4Addr> = ip_json(uplink, &["-4", "route", "show", "dev", &hrth])
            .ok()
            .and_then(|v| v.as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|r| r["dst"].as_str()?.parse().ok())
            .collect();
        // Deleting one end of a veth deletes both, at once (a namespace's devices go away asynchronously
        // after `netns del`, so the links are deleted explicitly first).
        ignore_missing(run(uplink, IP, &["link", "del", &hrth], None))?;
        let name = netns_name(id);
        if netns_path(id).exists() {
            for dev in [TAP_NAME, UPLINK_IF] {
                ignore_missing(run(None, IP, &["-n", &name, "link", "del", dev], None))?;
            }
            ignore_missing(run(None, IP, &["netns", "del", &name], None))?;
        }
        if addresses.is_empty() {
            return Ok(Vec::new());
        }
        let stale: Vec<(Ipv4Addr, Ipv4Addr)> = sweep::peer_pairs(self)?
            .into_iter()
            .filter(|(a, b)| addresses.contains(a) || addresses.contains(b))
            .collect();
        if !stale.is_empty() {
            nft(uplink, &ruleset::remove_peer_pairs(&stale))?;
        }
        Ok(stale)
    }

    /// Removes `hearth-*` namespaces, `hrth*` uplink links and hub peer pairs that belong to this plane but
    /// to no sandbox in `live`. Returns what it removed (`netns <name>`, `link <name>`, `peer <a> . <b>`).
    pub fn sweep(&self, live: &HashSet<String>) -> Result<Vec<String>, NetError> {
        sweep::sweep(self, live)
    }

    /// Every address of the uplink namespace (to put into [`SandboxNet::extra_denied`]).
    pub fn uplink_addresses(&self) -> Result<Vec<IpAddr>, NetError> {
        let v = ip_json(Some(&self.cfg.uplink_netns), &["addr", "show"])?;
        let mut out = Vec::new();
        for link in v.as_array().into_iter().flatten() {
            for a in link["addr_info"].as_array().into_iter().flatten() {
                if let Some(ip) = a["local"].as_str().and_then(|s| s.parse::<IpAddr>().ok())
                    && !out.contains(&ip)
                {
                    out.push(ip);
                }
            }
        }
        Ok(out)
    }

    fn validate_address(&self, address: Ipv4Addr) -> Result<(), NetError> {
        let net = self.cfg.sandbox_net;
        if !net.contains(&address)
            || address == net.network()
            || address == net.broadcast()
            || address == self.hub
        {
            return Err(NetError::InvalidAddress { address, net });
        }
        Ok(())
    }
}

/// Name of a sandbox's uplink link in the uplink namespace: `hrth` + 8 hex digits of a hash of the id.
pub fn link_name(sandbox_id: &str) -> String {
    format!("hrth{:08x}", fnv1a64(sandbox_id.as_bytes()) as u32)
}

/// Ids become namespace names and command arguments: letters, digits, `_` and `-` only.
fn validate_id(id: &str) -> Result<(), NetError> {
    let ok = !id.is_empty()
        && id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(NetError::InvalidId(id.to_owned()))
    }
}

fn ignore_missing(r: Result<String, NetError>) -> Result<(), NetError> {
    match r {
        Ok(_) => Ok(()),
        Err(e) if is_missing(&e) => Ok(()),
        Err(NetError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

fn lock() -> Result<Flock<File>, NetError> {
    let io = |source| NetError::Io {
        context: format!("lock {LOCK_PATH}"),
        source,
    };
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(Path::new(LOCK_PATH))
        .map_err(io)?;
    Flock::lock(f, FlockArg::LockExclusive).map_err(|(_, e)| io(std::io::Error::from(e)))
}

/// FNV-1a, 64 bits: stable across builds and platforms (names derived from it must not change).
fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_names_are_stable_and_short() {
        let n = link_name("sbx_0123456789abcdef");
        assert_eq!(n.len(), 12);
        assert!(n.starts_with("hrth"));
        assert_eq!(n, link_name("sbx_0123456789abcdef"));
        assert_ne!(n, link_name("sbx_0123456789abcdee"));
        // FNV-1a test vector: the empty input hashes to the offset basis.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn an_ipv6_range_smaller_than_a_64_is_refused_before_anything_is_done() {
        let cfg = PlaneConfig {
            uplink_netns: PathBuf::from("/nonexistent/netns"),
            sandbox_net: "10.213.0.0/16".parse().expect("v4 range"),
            sandbox_net6: Some("2001:db8::/80".parse().expect("v6 range")),
        };
        assert!(matches!(Plane::new(cfg), Err(NetError::InvalidRange6(_))));
    }

    #[test]
    fn ids_that_could_escape_a_name_are_refused() {
        for bad in ["", "../x", "a b", "a/b", "x\0", "ä", &"a".repeat(65)] {
            assert!(validate_id(bad).is_err(), "{bad:?}");
        }
        assert!(validate_id("sbx_0123456789abcdef").is_ok());
    }
}
