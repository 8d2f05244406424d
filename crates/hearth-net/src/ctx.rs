//! What a sandbox's resolver and egress proxy share: its policy (swappable at run time), the names of its
//! private-network peers, the addresses the daemon denies besides the fixed ranges, its audit log and the bounds
//! on the connections it may hold (with the budget shared by every sandbox).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, RwLock};

use crate::audit::AuditLog;
use crate::limits::NetLimits;
use crate::policy::Policy;

/// Per-sandbox network state shared (through an `Arc`) by the DNS resolver and the egress proxy. Locks are
/// never held across an await.
#[derive(Debug)]
pub struct SandboxNetCtx {
    pub id: String,
    /// The current policy. Readers clone the `Arc` and decide on that copy, so a swap takes effect for every
    /// connection and query that starts after it.
    pub policy: RwLock<Arc<Policy>>,
    /// Fully qualified private-network names (`<id>.<network>.internal`, `<name>.<network>.internal`),
    /// lower case without a trailing dot, to the peer's address.
    pub private_names: RwLock<HashMap<String, Ipv4Addr>>,
    /// Addresses denied besides [`crate::always_denied`]: the host's own, the daemon's API, other sandboxes.
    pub extra_denied: Vec<IpAddr>,
    pub audit: AuditLog,
    /// How many proxied and DNS-over-TCP connections this sandbox may hold, and the budget every sandbox draws
    /// from (read when the proxy and the resolver start).
    pub limits: NetLimits,
}

impl SandboxNetCtx {
    /// A sandbox's state with the process's limits ([`NetLimits::process`]: sized from the open-file limit at
    /// first use, one budget shared by every sandbox).
    pub fn new(id: impl Into<String>, policy: Policy, extra_denied: Vec<IpAddr>) -> Self {
        SandboxNetCtx {
            id: id.into(),
            policy: RwLock::new(Arc::new(policy)),
            private_names: RwLock::new(HashMap::new()),
            extra_denied,
            audit: AuditLog::default(),
            limits: NetLimits::process(),
        }
    }

    /// The same with other limits (e.g. [`NetLimits::for_nofile`] of the daemon's limit; give every sandbox a
    /// clone of the same value so that they share its budget).
    pub fn with_limits(mut self, limits: NetLimits) -> Self {
        self.limits = limits;
        self
    }

    /// The policy in force now.
    pub fn policy(&self) -> Arc<Policy> {
        self.policy.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Replaces the policy; effective for every new connection and query.
    pub fn set_policy(&self, policy: Policy) {
        *self.policy.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(policy);
    }

    /// Replaces the private-network names (keys are normalised: lower case, no trailing dot).
    pub fn set_private_names(&self, names: HashMap<String, Ipv4Addr>) {
        let names = names
            .into_iter()
            .map(|(k, v)| (crate::policy::normalize_name(&k), v))
            .collect();
        *self.private_names.write().unwrap_or_else(|p| p.into_inner()) = names;
    }

    /// The peer address of a private-network name (any case, trailing dot ignored).
    pub fn private_addr(&self, name: &str) -> Option<Ipv4Addr> {
        let name = crate::policy::normalize_name(name);
        self.private_names
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&name)
            .copied()
    }

    /// Whether `ip` is one of this sandbox's private-network peers.
    pub fn is_private_peer(&self, ip: IpAddr) -> bool {
        let IpAddr::V4(v4) = ip else { return false };
        self.private_names
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .any(|a| *a == v4)
    }
}
