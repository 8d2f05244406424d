//! Per-project quotas, admitted atomically: one lock covers reading what the project holds (its live sandboxes
//! in the database plus creates still in flight) and reserving the new request's share, so parallel creates
//! cannot pass the last slot together. The reservation is released when the request has answered and, on
//! success, its sandboxes were recorded as the project's (briefly counted twice: never under).
//!
//! The API's middleware reserves for the routes that start sandboxes (creates, forks, resumes); a call that
//! wakes a paused sandbox on its own (a command, a file, a port, a mount) reserves in [`Sandboxes::wake`]
//! through [`Sandboxes::reserve_quota`], so auto-resume cannot pass `max_running` either.
//!
//! Two limits are not about what starts but about time: a budget in credits (`budget_credits`: running
//! vCPU-seconds and GiB-seconds at [`CreditPrices`], summed over every sandbox the project owns or owned)
//! refuses starts once spent, and [`Sandboxes::enforce_quotas`] (called every second by the daemon) pauses the
//! project's running sandboxes then; `max_lifetime_s` destroys sandboxes older than it.
//!
//! `max_disk_bytes` counts the blocks the project's sandbox directories (disk, paused state), snapshots and
//! saved templates use on this host (a file with several links once). New sandbox disks start nearly empty
//! and grow as guests write, so it is checked before what adds to the disk (creates, forks, snapshots,
//! template saves: refused at or over the limit) rather than reserved in advance.

use std::collections::{HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hearth_api::Quota;

use hearth_api::ErrorCode;

use super::{Sandboxes, ServiceError, now_ms};
use crate::db::tenancy::Held;
use crate::db::{Db, DbError};

const MINUTE_MS: i64 = 60_000;

/// Credits per running vCPU-second and per running GiB-second (`--credits-per-vcpu-second`,
/// `--credits-per-gib-second`; 1 and 1 by default).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CreditPrices {
    pub per_vcpu_second: f64,
    pub per_gib_second: f64,
}

impl Default for CreditPrices {
    fn default() -> Self {
        CreditPrices {
            per_vcpu_second: 1.0,
            per_gib_second: 1.0,
        }
    }
}

/// What a request would add.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Want {
    pub sandboxes: u64,
    pub vcpus: u64,
    pub memory_mib: u64,
    /// Whether the sandboxes are new (creates and forks count against the per-minute limit; resumes do not).
    pub creates: bool,
    /// Whether the request adds to the project's disk (creates, forks, snapshots, template saves): refused
    /// once the project holds `max_disk_bytes`.
    pub disk: bool,
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

impl Sandboxes {
    /// Credits `project` has spent so far.
    pub fn spent_credits(&self, project: &str) -> Result<f64, ServiceError> {
        let prices = self.settings.credit_prices;
        Ok(self
            .db
            .spent_credits(project, prices.per_vcpu_second, prices.per_gib_second, now_ms())?)
    }

    /// Admits `want` for `project` under its quota (none set: nothing is limited); a refusal is the typed
    /// `quota_exceeded` naming the limit. For a request that writes to disk under a `max_disk_bytes` quota, the
    /// project's directories are walked first on a blocking thread ([`Sandboxes::project_disk_bytes_async`]), not
    /// on the async runtime.
    pub(crate) async fn reserve_quota_async(
        self: &Arc<Self>,
        project: &str,
        want: Want,
    ) -> Result<Reservation, ServiceError> {
        let quota = self.db.project(project)?.map(|row| row.quota).unwrap_or_default();
        let disk_used = match quota.max_disk_bytes {
            Some(_) if want.disk => Some(self.project_disk_bytes_async(project).await?),
            _ => None,
        };
        self.reserve_quota_with(project, &quota, want, disk_used)
    }

    /// [`Sandboxes::reserve_quota_async`] for requests that write nothing to disk (a wake of a paused sandbox),
    /// callable where awaiting is not possible.
    pub(crate) fn reserve_quota(&self, project: &str, want: Want) -> Result<Reservation, ServiceError> {
        let quota = self.db.project(project)?.map(|row| row.quota).unwrap_or_default();
        let disk_used = match quota.max_disk_bytes {
            Some(_) if want.disk => Some(self.project_disk_bytes(project)?),
            _ => None,
        };
        self.reserve_quota_with(project, &quota, want, disk_used)
    }

    fn reserve_quota_with(
        &self,
        project: &str,
        quota: &Quota,
        want: Want,
        disk_used: Option<u64>,
    ) -> Result<Reservation, ServiceError> {
        if let Some(budget) = quota.budget_credits
            && self.spent_credits(project)? >= budget as f64
        {
            return Err(ServiceError::Typed(
                ErrorCode::QuotaExceeded,
                format!(
                    "project budget_credits = {budget} is spent: raise it (PUT /v1/projects/{project}/quota) \
                     to start sandboxes again"
                ),
            ));
        }
        if let (Some(max), Some(used)) = (quota.max_disk_bytes, disk_used)
            && used >= max
        {
            return Err(ServiceError::Typed(
                ErrorCode::QuotaExceeded,
                format!(
                    "project quota max_disk_bytes = {max} would be exceeded: the project's sandboxes, \
                     snapshots and templates hold {used} bytes; delete some or raise it"
                ),
            ));
        }
        self.quotas
            .admit(&self.db, project, quota, want, now_ms())
            .map_err(|e| match e {
                AdmitError::Exceeded(m) => ServiceError::Typed(ErrorCode::QuotaExceeded, m),
                AdmitError::Db(e) => e.into(),
            })
    }

    /// [`Sandboxes::project_disk_bytes`] on a blocking thread (it walks directories).
    pub async fn project_disk_bytes_async(self: &Arc<Self>, project: &str) -> Result<u64, ServiceError> {
        let this = self.clone();
        let project = project.to_string();
        tokio::task::spawn_blocking(move || this.project_disk_bytes(&project))
            .await
            .map_err(|e| ServiceError::Internal(format!("disk use task: {e}")))?
    }

    /// Bytes `project`'s sandboxes (their directories: disk, paused state), snapshots and saved templates use
    /// on this host's disk: allocated blocks, each file once however many links it has.
    pub fn project_disk_bytes(&self, project: &str) -> Result<u64, ServiceError> {
        let paths = &self.settings.paths;
        let mut dirs: Vec<PathBuf> = Vec::new();
        for id in self.db.owned_keys(project, "sandbox")? {
            if hearth_api::is_valid_sandbox_id(&id) {
                dirs.push(paths.sandbox_dir(&id));
            }
        }
        for id in self.db.owned_keys(project, "snapshot")? {
            if hearth_api::is_valid_snapshot_id(&id) {
                dirs.push(paths.snapshot_dir(&id));
            }
        }
        for name in self.db.owned_keys(project, "template")? {
            if hearth_api::is_valid_template_name(&name) {
                dirs.push(paths.user_templates_dir().join(name));
            }
        }
        let mut seen = super::disk_use::Seen::new();
        Ok(dirs
            .iter()
            .map(|d| super::disk_use::allocated_bytes(d, &mut seen))
            .sum())
    }

    /// One pass over the projects with time limits: the running sandboxes of a project whose budget is spent
    /// are paused (returned as `(id, "budget")`), sandboxes older than their project's `max_lifetime_s` are
    /// destroyed (`(id, "lifetime")`). Returns what it must do; the caller runs each in its own task.
    pub fn quota_actions(&self) -> Result<Vec<(String, &'static str)>, ServiceError> {
        let now = now_ms();
        let mut todo = Vec::new();
        for project in self.db.projects()? {
            let q = &project.quota;
            if let Some(budget) = q.budget_credits
                && self.spent_credits(&project.name)? >= budget as f64
            {
                for id in self.db.project_sandboxes(&project.name, &["running"])? {
                    todo.push((id, "budget"));
                }
            }
            if let Some(max) = q.max_lifetime_s {
                let max_ms = i64::try_from(max.saturating_mul(1000)).unwrap_or(i64::MAX);
                let live = ["creating", "running", "pausing", "paused", "resuming", "failed"];
                for id in self.db.project_sandboxes(&project.name, &live)? {
                    let old = self
                        .db
                        .get(&id)?
                        .is_some_and(|row| row.created_at_ms.saturating_add(max_ms) <= now);
                    if old {
                        todo.push((id, "lifetime"));
                    }
                }
            }
        }
        Ok(todo)
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
            disk: true,
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
