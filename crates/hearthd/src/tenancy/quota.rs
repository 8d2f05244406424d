//! Per-project quotas, admitted atomically: one lock covers reading what the project holds (its live sandboxes
//! in the database plus creates still in flight) and reserving the new request's share, so parallel creates
//! cannot pass the last slot together. The reservation is released when the request has answered and, on
//! success, its sandboxes were recorded as the project's (briefly counted twice: never under).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use hearth_api::Quota;

use crate::db::tenancy::Held;
use crate::db::{Db, DbError};

const MINUTE_MS: i64 = 60_000;

/// What a request would add.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Want {
    pub sandboxes: u64,
    pub vcpus: u64,
    pub memory_mib: u64,
    /// Whether the sandboxes are new (creates and forks count against the per-minute limit; resumes do not).
    pub creates: bool,
}

/// Why admission failed: the limit's name and value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exceeded {
    pub limit: &'static str,
    pub value: u64,
}

impl std::fmt::Display for Exceeded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "project quota {} = {} would be exceeded",
            self.limit, self.value
        )
    }
}

#[derive(Debug, Default)]
struct Load {
    reserved: Held,
    recent_creates: VecDeque<i64>,
}

/// In-flight reservations and recent creates per project.
#[derive(Debug, Default)]
pub struct Admission {
    projects: Arc<Mutex<HashMap<String, Load>>>,
}

/// Holds a reservation until dropped.
#[derive(Debug)]
pub struct Reservation {
    projects: Arc<Mutex<HashMap<String, Load>>>,
    project: String,
    want: Want,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut map = self.projects.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(load) = map.get_mut(&self.project) {
            load.reserved.running = load.reserved.running.saturating_sub(self.want.sandboxes);
            load.reserved.vcpus = load.reserved.vcpus.saturating_sub(self.want.vcpus);
            load.reserved.memory_mib = load.reserved.memory_mib.saturating_sub(self.want.memory_mib);
        }
    }
}

/// Admission's failure.
#[derive(Debug, thiserror::Error)]
pub enum AdmitError {
    #[error("{0}")]
    Exceeded(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

impl Admission {
    /// Admits `want` for `project` under `quota` at `now_ms`, or names the limit it would pass.
    pub fn admit(
        &self,
        db: &Db,
        project: &str,
        quota: &Quota,
        want: Want,
        now_ms: i64,
    ) -> Result<Reservation, AdmitError> {
        let mut map = self.projects.lock().unwrap_or_else(|p| p.into_inner());
        let load = map.entry(project.to_string()).or_default();
        while load
            .recent_creates
            .front()
            .is_some_and(|t| *t <= now_ms - MINUTE_MS)
        {
            load.recent_creates.pop_front();
        }
        let held = db.held(project)?;
        let check = |limit: &'static str, max: Option<u64>, used: u64, add: u64| match max {
            Some(max) if used + add > max => {
                Err(AdmitError::Exceeded(Exceeded { limit, value: max }.to_string()))
            }
            _ => Ok(()),
        };
        let running = held.running + load.reserved.running;
        check(
            "max_running",
            quota.max_running.map(u64::from),
            running,
            want.sandboxes,
        )?;
        let vcpus = held.vcpus + load.reserved.vcpus;
        check("max_vcpus", quota.max_vcpus.map(u64::from), vcpus, want.vcpus)?;
        let memory = held.memory_mib + load.reserved.memory_mib;
        check("max_memory_mib", quota.max_memory_mib, memory, want.memory_mib)?;
        if want.creates {
            let recent = load.recent_creates.len() as u64;
            let max = quota.max_creates_per_minute.map(u64::from);
            check("max_creates_per_minute", max, recent, want.sandboxes)?;
            for _ in 0..want.sandboxes {
                load.recent_creates.push_back(now_ms);
            }
        }
        load.reserved.running += want.sandboxes;
        load.reserved.vcpus += want.vcpus;
        load.reserved.memory_mib += want.memory_mib;
        Ok(Reservation {
            projects: self.projects.clone(),
            project: project.to_string(),
            want,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_count_until_dropped_and_limits_are_named() -> Result<(), Box<dyn std::error::Error>> {
        let db = Db::open_in_memory()?;
        let a = Admission::default();
        let quota = Quota {
            max_running: Some(2),
            max_creates_per_minute: Some(3),
            ..Default::default()
        };
        let one = Want {
            sandboxes: 1,
            vcpus: 1,
            memory_mib: 128,
            creates: true,
        };
        let r1 = a.admit(&db, "p", &quota, one, 0)?;
        let _r2 = a.admit(&db, "p", &quota, one, 1)?;
        let err = a.admit(&db, "p", &quota, one, 2).err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("project quota max_running = 2 would be exceeded")
        );
        drop(r1);
        let _r3 = a.admit(&db, "p", &quota, one, 3)?;
        drop(_r3);
        let err = a.admit(&db, "p", &quota, one, 4).err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("project quota max_creates_per_minute = 3 would be exceeded")
        );
        // A minute later the window has room again.
        let _r4 = a.admit(&db, "p", &quota, one, 60_001)?;
        Ok(())
    }
}
