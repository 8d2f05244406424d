//! The per-sandbox egress audit log: a bounded ring of [`EgressEvent`]s (the newest kept) and the
//! `hearth_egress_attempts_total{protocol,verdict}` counter.

use std::collections::VecDeque;
use std::net::IpAddr;
use std::sync::Mutex;

use hearth_api::{EgressEvent, EgressLog, NetProtocol};

use crate::policy::Decision;

/// Entries a log keeps by default.
pub const DEFAULT_CAPACITY: usize = 1000;

/// A bounded, thread-safe log of egress attempts. Pushing is a short critical section and never blocks on I/O.
#[derive(Debug)]
pub struct AuditLog {
    capacity: usize,
    inner: Mutex<Ring>,
}

#[derive(Debug, Default)]
struct Ring {
    events: VecDeque<EgressEvent>,
    dropped: u64,
}

impl Default for AuditLog {
    fn default() -> Self {
        AuditLog::new(DEFAULT_CAPACITY)
    }
}

impl AuditLog {
    /// A log keeping at most `capacity` (at least 1) entries.
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        AuditLog {
            capacity,
            inner: Mutex::new(Ring {
                events: VecDeque::with_capacity(capacity.min(64)),
                dropped: 0,
            }),
        }
    }

    /// Appends `event` (dropping the oldest entry when full) and counts it.
    pub fn push(&self, event: EgressEvent) {
        metrics::counter!(
            "hearth_egress_attempts_total",
            "protocol" => event.protocol.as_str(),
            "verdict" => if event.allowed { "allowed" } else { "denied" }
        )
        .increment(1);
        tracing::debug!(
            protocol = event.protocol.as_str(),
            destination = event.destination.as_deref(),
            port = event.port,
            name = event.name.as_deref(),
            allowed = event.allowed,
            reason = %event.reason,
            "egress"
        );
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if ring.events.len() >= self.capacity {
            ring.events.pop_front();
            ring.dropped += 1;
        }
        ring.events.push_back(event);
    }

    /// Records an attempt decided by `decision`.
    pub fn record(
        &self,
        protocol: NetProtocol,
        destination: Option<IpAddr>,
        port: Option<u16>,
        name: Option<&str>,
        decision: &Decision,
    ) {
        self.push(EgressEvent {
            at: now_rfc3339(),
            protocol,
            destination: destination.map(|ip| ip.to_string()),
            port,
            name: name.map(str::to_owned),
            allowed: decision.allowed,
            reason: decision.reason.to_owned(),
            rule: decision.rule.clone(),
        });
    }

    /// The entries, oldest first, and how many were dropped.
    pub fn snapshot(&self) -> EgressLog {
        let ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        EgressLog {
            events: ring.events.iter().cloned().collect(),
            dropped: ring.dropped,
        }
    }
}

/// The current UTC time as RFC 3339 with milliseconds (`2026-01-02T03:04:05.678Z`).
pub fn now_rfc3339() -> String {
    let t = time::OffsetDateTime::now_utc();
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.millisecond()
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::policy::reason;

    #[test]
    fn keeps_the_newest_and_counts_drops() {
        let log = AuditLog::new(3);
        for port in 1..=5u16 {
            log.record(
                NetProtocol::Tcp,
                Some("203.0.113.1".parse().unwrap()),
                Some(port),
                Some("example.com"),
                &Decision::allowed(reason::DEFAULT_ALLOW),
            );
        }
        let snap = log.snapshot();
        assert_eq!(snap.dropped, 2);
        let ports: Vec<_> = snap.events.iter().map(|e| e.port.unwrap()).collect();
        assert_eq!(ports, [3, 4, 5]);
        let e = &snap.events[0];
        assert_eq!(e.destination.as_deref(), Some("203.0.113.1"));
        assert_eq!(e.reason, "default_allow");
        assert!(time::OffsetDateTime::parse(&e.at, &time::format_description::well_known::Rfc3339).is_ok());
        assert_eq!(e.at.len(), "2026-01-02T03:04:05.678Z".len());
    }

    #[test]
    fn concurrent_pushes() {
        let log = std::sync::Arc::new(AuditLog::new(100));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let log = log.clone();
                std::thread::spawn(move || {
                    for _ in 0..50 {
                        log.record(
                            NetProtocol::Dns,
                            None,
                            None,
                            Some("x"),
                            &Decision::denied(reason::DEFAULT_DENY),
                        );
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let snap = log.snapshot();
        assert_eq!((snap.events.len(), snap.dropped), (100, 100));
    }
}
