//! Usage intervals: one row per stretch of time a sandbox spent running or paused, with the shape it had.
//! The open interval of a sandbox (`end_at` NULL) is closed and the next one opened in one transaction, so
//! the totals survive restarts; start-up recovery reconciles the open interval with the sandbox's state.

use rusqlite::params;

use super::{Db, DbError};

/// What a sandbox was doing during an interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UsageKind {
    /// A VM process existed (booting, running, pausing, resuming): compute accrues.
    Running,
    /// Only files: no compute.
    Paused,
}

impl UsageKind {
    pub fn as_str(self) -> &'static str {
        match self {
            UsageKind::Running => "running",
            UsageKind::Paused => "paused",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "running" => Some(UsageKind::Running),
            "paused" => Some(UsageKind::Paused),
            _ => None,
        }
    }
}

/// One interval as stored (`end_ms` None while open).
#[derive(Debug, Clone, PartialEq)]
pub struct Interval {
    pub sandbox_id: String,
    pub kind: UsageKind,
    pub start_ms: i64,
    pub end_ms: Option<i64>,
    pub vcpus: u32,
    pub memory_mib: u32,
}

impl Db {
    /// Closes the open interval of `id` at `now_ms` and, with `next`, opens one of that kind. Nothing changes
    /// when the open interval already has kind `next`.
    pub fn usage_switch(
        &self,
        id: &str,
        next: Option<UsageKind>,
        now_ms: i64,
        vcpus: u32,
        memory_mib: u32,
    ) -> Result<(), DbError> {
        let mut conn = self.lock();
        let tx = conn.transaction()?;
        let open: Option<String> = tx
            .query_row(
                "SELECT kind FROM usage WHERE sandbox_id = ?1 AND end_at IS NULL ORDER BY id DESC LIMIT 1",
                params![id],
                |r| r.get(0),
            )
            .ok();
        if let (Some(open), Some(next)) = (&open, next)
            && open == next.as_str()
        {
            return Ok(());
        }
        tx.execute(
            "UPDATE usage SET end_at = MAX(start_at, ?2) WHERE sandbox_id = ?1 AND end_at IS NULL",
            params![id, now_ms],
        )?;
        if let Some(kind) = next {
            tx.execute(
                "INSERT INTO usage (sandbox_id, kind, start_at, end_at, vcpus, memory_mib)
                 VALUES (?1, ?2, ?3, NULL, ?4, ?5)",
                params![id, kind.as_str(), now_ms, vcpus, memory_mib],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Ids of sandboxes with an open interval.
    pub fn usage_open_ids(&self) -> Result<Vec<String>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached("SELECT DISTINCT sandbox_id FROM usage WHERE end_at IS NULL")?;
        let ids = stmt
            .query_map([], |r| r.get(0))?
            .collect::<Result<Vec<String>, _>>()?;
        Ok(ids)
    }

    /// The intervals that overlap `[from_ms, to_ms)`, of one sandbox or of all.
    pub fn usage_intervals(
        &self,
        sandbox: Option<&str>,
        from_ms: i64,
        to_ms: i64,
    ) -> Result<Vec<Interval>, DbError> {
        let conn = self.lock();
        let mut stmt = conn.prepare_cached(
            "SELECT sandbox_id, kind, start_at, end_at, vcpus, memory_mib FROM usage
             WHERE (?1 IS NULL OR sandbox_id = ?1) AND start_at < ?3 AND (end_at IS NULL OR end_at > ?2)
             ORDER BY sandbox_id, start_at",
        )?;
        let rows = stmt
            .query_map(params![sandbox, from_ms, to_ms], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, i64>(2)?,
                    r.get::<_, Option<i64>>(3)?,
                    r.get::<_, u32>(4)?,
                    r.get::<_, u32>(5)?,
                ))
            })?
            .collect::<Result<Vec<_>, _>>()?;
        rows.into_iter()
            .map(|(sandbox_id, kind, start_ms, end_ms, vcpus, memory_mib)| {
                let kind = UsageKind::parse(&kind).ok_or_else(|| DbError::Corrupt {
                    id: sandbox_id.clone(),
                    column: "usage.kind",
                    detail: kind.clone(),
                })?;
                Ok(Interval {
                    sandbox_id,
                    kind,
                    start_ms,
                    end_ms,
                    vcpus,
                    memory_mib,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switching_closes_and_opens_intervals() -> Result<(), Box<dyn std::error::Error>> {
        let db = Db::open_in_memory()?;
        let id = "sbx_00000000000000aa";
        db.usage_switch(id, Some(UsageKind::Running), 1_000, 2, 256)?;
        db.usage_switch(id, Some(UsageKind::Running), 1_500, 2, 256)?;
        db.usage_switch(id, Some(UsageKind::Paused), 3_000, 2, 256)?;
        assert_eq!(db.usage_open_ids()?, vec![id.to_string()]);
        db.usage_switch(id, None, 7_000, 2, 256)?;
        assert!(db.usage_open_ids()?.is_empty());
        let all = db.usage_intervals(None, 0, 10_000)?;
        assert_eq!(all.len(), 2);
        assert_eq!(
            (all[0].kind, all[0].start_ms, all[0].end_ms),
            (UsageKind::Running, 1_000, Some(3_000))
        );
        assert_eq!(
            (all[1].kind, all[1].start_ms, all[1].end_ms),
            (UsageKind::Paused, 3_000, Some(7_000))
        );
        assert_eq!(db.usage_intervals(Some(id), 3_500, 4_000)?.len(), 1);
        assert!(
            db.usage_intervals(Some("sbx_00000000000000bb"), 0, 10_000)?
                .is_empty()
        );
        Ok(())
    }
}
