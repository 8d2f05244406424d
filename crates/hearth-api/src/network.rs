//! Sandbox networking: egress policy, private networks, the egress audit log and exposed ports.
//!
//! A policy rule is a string: an IPv4/IPv6 address or CIDR (`203.0.113.7`, `203.0.113.0/24`, `2001:db8::/32`),
//! a domain name (`example.com`, matching that name only) or a wildcard (`*.example.com`, matching every name
//! below `example.com` but not `example.com` itself). Deny rules win over allow rules; what neither names gets
//! the default. Some destinations are denied whatever the policy says (the host, link-local and metadata
//! addresses, private and CGNAT ranges, loopback, other sandboxes except private-network peers).

use serde::{Deserialize, Serialize};

/// What egress a rule list does not name gets.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum EgressDefault {
    /// Everything not denied may leave (the always-denied destinations stay denied).
    #[default]
    Allow,
    /// Nothing leaves that an allow rule does not name.
    Deny,
}

impl EgressDefault {
    pub fn as_str(self) -> &'static str {
        match self {
            EgressDefault::Allow => "allow",
            EgressDefault::Deny => "deny",
        }
    }
}

/// A sandbox's egress policy.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EgressPolicy {
    /// What a destination no rule names gets. Default `allow`.
    #[serde(default)]
    pub default: EgressDefault,
    /// Destinations that may be reached: CIDRs, addresses, domains, `*.domain` wildcards.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// Destinations that may not be reached (wins over `allow`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub deny: Vec<String>,
}

/// `network` at create, and the body of `PATCH /v1/sandboxes/{id}/network`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkPolicy {
    #[serde(default)]
    pub egress: EgressPolicy,
}

/// A sandbox's network as the API reports it (`GET /v1/sandboxes/{id}/network`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct SandboxNetwork {
    /// The sandbox's address as its private-network peers see it.
    pub address: String,
    /// The address the guest itself has on its interface (the same in every sandbox).
    pub guest_address: String,
    pub egress: EgressPolicy,
    /// Names of the private networks the sandbox is attached to.
    pub networks: Vec<String>,
}

/// Body of `POST /v1/networks`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateNetworkRequest {
    /// 1-32 characters: lowercase letters, digits and `-`, starting with a letter (it becomes a DNS label).
    pub name: String,
}

/// A private network.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct NetworkInfo {
    /// `net_` + 16 hex digits.
    pub id: String,
    pub name: String,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// Ids of the sandboxes attached to it.
    pub members: Vec<String>,
}

/// Body of `GET /v1/networks`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct NetworkList {
    pub networks: Vec<NetworkInfo>,
}

/// Transport protocol of an egress attempt.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum NetProtocol {
    Tcp,
    Udp,
    Icmp,
    Dns,
    Other,
}

impl NetProtocol {
    pub fn as_str(self) -> &'static str {
        match self {
            NetProtocol::Tcp => "tcp",
            NetProtocol::Udp => "udp",
            NetProtocol::Icmp => "icmp",
            NetProtocol::Dns => "dns",
            NetProtocol::Other => "other",
        }
    }
}

/// One egress attempt, as recorded in the audit log.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct EgressEvent {
    /// RFC 3339 UTC with milliseconds.
    pub at: String,
    pub protocol: NetProtocol,
    /// Destination address (absent for a DNS query that was refused before any address was known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Name the guest asked for (DNS query, TLS SNI or HTTP Host), where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub allowed: bool,
    /// Why: `allow_rule`, `deny_rule`, `default_allow`, `default_deny`, `always_denied`, `private_peer`,
    /// `dns_blocked`, `resolves_to_denied`, `unresolvable`, `spoofed`, `host_changed` (a later request on a
    /// kept-alive connection named another host), `malformed_http` (a request the proxy cannot frame),
    /// `connection_limit` (the sandbox's or the host's connection budget is spent).
    pub reason: String,
    /// The rule that decided, when one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

/// Body of `GET /v1/sandboxes/{id}/network/log`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct EgressLog {
    /// Oldest first; the log keeps the newest entries when it is full.
    pub events: Vec<EgressEvent>,
    /// Entries dropped because the log was full.
    pub dropped: u64,
}

/// Body of `POST /v1/sandboxes/{id}/ports/{port}/token`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PortTokenRequest {
    /// Seconds the token stays valid (1-86400). Default 3600.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
}

/// A signed, expiring token that opens one exposed port of one sandbox without the API key.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct PortToken {
    pub token: String,
    /// Path on the daemon that forwards to the port, with the token as a query parameter.
    pub url: String,
    /// RFC 3339 UTC.
    pub expires_at: String,
}
