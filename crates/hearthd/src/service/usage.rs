//! Usage reports from the recorded intervals ([`crate::db::usage`]): running seconds (and their vCPU and MiB
//! products) and paused seconds within a window, plus the snapshot bytes a sandbox holds now.

use std::collections::BTreeMap;

use hearth_api::{SandboxUsage, UsageReport};

use super::lifecycle::rfc3339;
use super::{Sandboxes, ServiceError, now_ms};
use crate::db::usage::{Interval, UsageKind};

/// Sums `intervals` clipped to `[from_ms, to_ms)` (open intervals end at `now_ms`).
pub fn sum(intervals: &[Interval], from_ms: i64, to_ms: i64, now_ms: i64) -> BTreeMap<String, SandboxUsage> {
    let mut out: BTreeMap<String, SandboxUsage> = BTreeMap::new();
    for iv in intervals {
        let start = iv.start_ms.max(from_ms);
        let end = iv.end_ms.unwrap_or(now_ms).min(to_ms);
        let secs = if end > start {
            (end - start) as f64 / 1000.0
        } else {
            0.0
        };
        let u = out.entry(iv.sandbox_id.clone()).or_insert_with(|| SandboxUsage {
            sandbox_id: iv.sandbox_id.clone(),
            ..Default::default()
        });
        match iv.kind {
            UsageKind::Running => {
                u.running_seconds += secs;
                u.vcpu_seconds += secs * f64::from(iv.vcpus);
                u.mib_seconds += secs * f64::from(iv.memory_mib);
            }
            UsageKind::Paused => u.paused_seconds += secs,
        }
    }
    out
}

/// Parses an RFC 3339 time or unix seconds.
fn parse_time(what: &str, s: &str) -> Result<i64, ServiceError> {
    if let Ok(secs) = s.parse::<i64>() {
        return Ok(secs.saturating_mul(1000));
    }
    time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map(|t| i64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(i64::MAX))
        .map_err(|_| {
            ServiceError::InvalidArgument(format!(
                "{what} must be an RFC 3339 time or unix seconds, not {:?}",
                super::clip(s, 64)
            ))
        })
}

impl Sandboxes {
    /// Bytes of snapshot state sandbox `id` holds on disk now: its paused state and the snapshots taken from it.
    fn snapshot_bytes(&self, id: &str) -> u64 {
        let paused = self
            .db
            .get(id)
            .ok()
            .flatten()
            .and_then(|r| r.paused)
            .map_or(0, |p| p.size_bytes);
        let objects: u64 = self
            .db
            .list_snapshots()
            .unwrap_or_default()
            .iter()
            .filter(|s| s.sandbox_id == id)
            .map(|s| s.size_bytes)
            .sum();
        paused + objects
    }

    /// Usage of one sandbox since it was created.
    pub fn sandbox_usage(&self, id: &str) -> Result<SandboxUsage, ServiceError> {
        let row = self.row(id)?;
        let now = now_ms();
        let intervals = self
            .db
            .usage_intervals(Some(id), row.created_at_ms, now.saturating_add(1))?;
        let mut u = sum(&intervals, row.created_at_ms, now, now)
            .remove(id)
            .unwrap_or_else(|| SandboxUsage {
                sandbox_id: id.to_string(),
                ..Default::default()
            });
        u.snapshot_bytes = self.snapshot_bytes(id);
        (u.bytes_read, u.bytes_written) = self.mount_bytes(id);
        Ok(u)
    }

    /// Usage of every sandbox (including destroyed ones) within `[from, to)`; defaults: the last 24 hours.
    pub fn usage(&self, from: Option<&str>, to: Option<&str>) -> Result<UsageReport, ServiceError> {
        let now = now_ms();
        let to_ms = to.map(|s| parse_time("to", s)).transpose()?.unwrap_or(now);
        let from_ms = from
            .map(|s| parse_time("from", s))
            .transpose()?
            .unwrap_or(to_ms.saturating_sub(86_400_000));
        if from_ms > to_ms {
            return Err(ServiceError::InvalidArgument("from is after to".into()));
        }
        let intervals = self.db.usage_intervals(None, from_ms, to_ms)?;
        let sandboxes = sum(&intervals, from_ms, to_ms, now)
            .into_values()
            .map(|mut u| {
                u.snapshot_bytes = self.snapshot_bytes(&u.sandbox_id);
                (u.bytes_read, u.bytes_written) = self.mount_bytes(&u.sandbox_id);
                u
            })
            .collect();
        Ok(UsageReport {
            from: rfc3339(from_ms),
            to: rfc3339(to_ms),
            sandboxes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iv(kind: UsageKind, start: i64, end: Option<i64>) -> Interval {
        Interval {
            sandbox_id: "sbx_00000000000000aa".into(),
            kind,
            start_ms: start,
            end_ms: end,
            vcpus: 2,
            memory_mib: 512,
        }
    }

    #[test]
    fn sums_are_clipped_to_the_window() {
        let ivs = [
            iv(UsageKind::Running, 0, Some(10_000)),
            iv(UsageKind::Paused, 10_000, Some(20_000)),
            iv(UsageKind::Running, 20_000, None),
        ];
        let u = sum(&ivs, 5_000, 25_000, 30_000);
        let u = &u["sbx_00000000000000aa"];
        assert_eq!(u.running_seconds, 10.0);
        assert_eq!(u.vcpu_seconds, 20.0);
        assert_eq!(u.mib_seconds, 5120.0);
        assert_eq!(u.paused_seconds, 10.0);
        let u = sum(&ivs, 0, 100_000, 30_000);
        assert_eq!(
            u["sbx_00000000000000aa"].running_seconds, 20.0,
            "open interval ends now"
        );
    }

    #[test]
    fn times_parse() {
        assert_eq!(parse_time("from", "10").ok(), Some(10_000));
        assert_eq!(parse_time("from", "1970-01-01T00:00:01.5Z").ok(), Some(1_500));
        assert!(parse_time("from", "yesterday").is_err());
    }
}
