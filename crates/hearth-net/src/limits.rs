//! How many descriptors the daemon's per-sandbox network services may hold, so that no guest (and no group of
//! guests) can exhaust the daemon's open-file limit through them.
//!
//! - Per sandbox: at most [`NetLimits::proxy_per_sandbox`] proxied connections (each holds two descriptors: the
//!   guest's connection and the upstream one) and [`NetLimits::dns_tcp_per_sandbox`] DNS-over-TCP connections
//!   (one each).
//! - Across sandboxes: every such connection also takes its descriptors from one [`ConnBudget`] shared by all
//!   sandboxes. [`NetLimits::for_nofile`] sizes it from the daemon's open-file limit, keeping a quarter (at
//!   least 256) for everything else the daemon opens and [`UPSTREAM_SOCKETS`] for the upstream DNS client,
//!   whose sockets have a bound of their own ([`crate::dns::Upstream`]).
//! - A connection beyond either bound is accepted and reset at once (no `TIME_WAIT`, no task, no lasting
//!   descriptor), counted in `hearth_net_refused_total{service,limit}` and logged in the sandbox's egress log
//!   at most once a second (reason `connection_limit`).
//! - Idle connections are closed (the proxy's [`crate::proxy::ProxyLimits::idle_timeout`], the resolver's
//!   10 s), so slots held by a silent guest come back.
//!
//! Worst case, the per-sandbox services hold `budget + UPSTREAM_SOCKETS` descriptors plus four fixed ones per
//! sandbox (the resolver's UDP socket, its TCP listener, the proxy's listener, the NFLOG socket).

use std::sync::{Arc, OnceLock};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Proxied connections one sandbox may hold at most, however large the open-file limit.
pub const MAX_PROXY_PER_SANDBOX: usize = 256;
/// DNS-over-TCP connections one sandbox may hold at most.
pub const MAX_DNS_TCP_PER_SANDBOX: usize = 16;
/// Sockets the upstream DNS client holds at most (one per lookup in flight), across sandboxes.
pub const UPSTREAM_SOCKETS: usize = 128;
/// Descriptors a proxied connection holds.
pub const PROXY_CONNECTION_FDS: u32 = 2;
/// Descriptors a DNS-over-TCP connection holds.
pub const DNS_TCP_CONNECTION_FDS: u32 = 1;

/// A pool of descriptors shared by every sandbox's network services. Cloning shares the pool.
#[derive(Debug, Clone)]
pub struct ConnBudget {
    slots: Arc<Semaphore>,
    capacity: usize,
}

impl ConnBudget {
    /// A pool of `capacity` descriptors.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.clamp(1, Semaphore::MAX_PERMITS);
        ConnBudget {
            slots: Arc::new(Semaphore::new(capacity)),
            capacity,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Descriptors not taken now.
    pub fn available(&self) -> usize {
        self.slots.available_permits()
    }

    /// Takes `fds` descriptors from the pool until the permit is dropped; `None` if the pool has fewer left.
    pub fn try_take(&self, fds: u32) -> Option<OwnedSemaphorePermit> {
        self.slots.clone().try_acquire_many_owned(fds).ok()
    }
}

/// The bounds of [`crate::ctx::SandboxNetCtx::limits`] (see the module doc).
#[derive(Debug, Clone)]
pub struct NetLimits {
    /// Proxied connections one sandbox may hold at once.
    pub proxy_per_sandbox: usize,
    /// DNS-over-TCP connections one sandbox may hold at once.
    pub dns_tcp_per_sandbox: usize,
    /// Descriptors all sandboxes' proxies and DNS-over-TCP servers hold together at most.
    pub budget: ConnBudget,
}

impl NetLimits {
    /// Limits for a daemon whose open-file limit is `nofile`: the budget is what is left after a quarter of
    /// `nofile` (at least 256) and [`UPSTREAM_SOCKETS`]; one sandbox may hold an eighth of it in proxied
    /// connections (at most [`MAX_PROXY_PER_SANDBOX`], at least 8 where the budget has room for 32) and a
    /// sixty-fourth in DNS-over-TCP connections (at most [`MAX_DNS_TCP_PER_SANDBOX`], at least 4 where it has
    /// room). With the usual soft limit of 1024: a budget of 640 descriptors, 40 proxied and 10 DNS-over-TCP
    /// connections per sandbox; from a limit of about 5,700 on, the per-sandbox maxima.
    pub fn for_nofile(nofile: u64) -> NetLimits {
        let nofile = usize::try_from(nofile).unwrap_or(usize::MAX);
        let reserve = (nofile / 4).max(256);
        let budget = nofile.saturating_sub(reserve + UPSTREAM_SOCKETS).max(16);
        let connections = budget / PROXY_CONNECTION_FDS as usize;
        let at_least = |floor: usize, share: usize| floor.min(share).max(1);
        NetLimits {
            proxy_per_sandbox: (connections / 8).clamp(at_least(8, connections / 4), MAX_PROXY_PER_SANDBOX),
            dns_tcp_per_sandbox: (budget / 64).clamp(at_least(4, budget / 16), MAX_DNS_TCP_PER_SANDBOX),
            budget: ConnBudget::new(budget),
        }
    }

    /// The process's limits: [`NetLimits::for_nofile`] of the soft `RLIMIT_NOFILE` at the first call (so a
    /// daemon that raises its limit at start-up, before any sandbox's network, gets a budget to match), shared
    /// by every caller.
    pub fn process() -> NetLimits {
        static LIMITS: OnceLock<NetLimits> = OnceLock::new();
        LIMITS
            .get_or_init(|| {
                let soft = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
                    .map(|(soft, _)| soft)
                    .unwrap_or(1024);
                NetLimits::for_nofile(soft)
            })
            .clone()
    }
}

/// Logs and counts a refusal at most once a second per instance (a flood must not flood the log).
#[derive(Debug, Default)]
pub(crate) struct RefusalLog {
    last: std::sync::Mutex<Option<std::time::Instant>>,
}

impl RefusalLog {
    /// Counts one refusal by `service` at `limit`; true if it should also be logged now.
    pub(crate) fn refused(&self, service: &'static str, limit: &'static str) -> bool {
        metrics::counter!("hearth_net_refused_total", "service" => service, "limit" => limit).increment(1);
        let now = std::time::Instant::now();
        let mut last = self.last.lock().unwrap_or_else(|p| p.into_inner());
        match *last {
            Some(at) if now.saturating_duration_since(at) < std::time::Duration::from_secs(1) => false,
            _ => {
                *last = Some(now);
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_from_the_open_file_limit() {
        let l = NetLimits::for_nofile(1024);
        assert_eq!(l.budget.capacity(), 640);
        assert_eq!((l.proxy_per_sandbox, l.dns_tcp_per_sandbox), (40, 10));
        let l = NetLimits::for_nofile(5700);
        assert_eq!(l.proxy_per_sandbox, MAX_PROXY_PER_SANDBOX);
        assert!(NetLimits::for_nofile(5600).proxy_per_sandbox < MAX_PROXY_PER_SANDBOX);
        let l = NetLimits::for_nofile(1 << 20);
        assert_eq!(l.budget.capacity(), (1 << 20) - (1 << 18) - UPSTREAM_SOCKETS);
        assert_eq!(
            (l.proxy_per_sandbox, l.dns_tcp_per_sandbox),
            (MAX_PROXY_PER_SANDBOX, MAX_DNS_TCP_PER_SANDBOX)
        );
        // Even a tiny limit leaves a usable (if small) budget, and one sandbox never gets all of it.
        let l = NetLimits::for_nofile(64);
        assert_eq!(l.budget.capacity(), 16);
        assert_eq!((l.proxy_per_sandbox, l.dns_tcp_per_sandbox), (2, 1));
        for nofile in [64u64, 256, 1024, 4096, 65536, 1 << 20] {
            let l = NetLimits::for_nofile(nofile);
            let one = l.proxy_per_sandbox * PROXY_CONNECTION_FDS as usize
                + l.dns_tcp_per_sandbox * DNS_TCP_CONNECTION_FDS as usize;
            let share = if nofile >= 1024 { 4 } else { 2 };
            assert!(one * share <= l.budget.capacity(), "{nofile}: {l:?}");
            if nofile >= 1024 {
                assert!(
                    (l.budget.capacity() + UPSTREAM_SOCKETS) as u64 <= nofile * 3 / 4,
                    "{nofile}"
                );
            }
        }
    }

    #[test]
    fn the_budget_is_shared_and_returned() {
        let b = ConnBudget::new(5);
        let other = b.clone();
        let p1 = b.try_take(2).expect("room");
        let p2 = other.try_take(2).expect("room");
        assert!(b.try_take(2).is_none());
        assert_eq!(other.available(), 1);
        drop(p1);
        assert!(b.try_take(2).is_some());
        drop(p2);
        assert_eq!(b.available(), 5);
    }
}
