//! Local disk as a cache of the storage bucket (`hearthd --storage ... --cache-size BYTES`).
//!
//! The local copies of paused sandboxes (their `paused` directory and own disk), snapshots, saved templates and
//! synced disk images (`<data>/syncs/<id>`) are counted by the blocks they take. When they take more than the limit, the least recently used ones that
//! are safely in the bucket are removed locally ("evicted"): the next resume, create or fork that needs one
//! finds its directory gone and fetches it back ([`super::remote`]'s fetch path), verified chunk by chunk.
//!
//! Nothing is evicted while the bucket is unavailable (what is evicted could not come back until it answers).
//! Never evicted: an object whose newest version is not `synced` (pending, uploading, deleting); a paused
//! sandbox whose lifecycle lock is held or that is not `paused`; a snapshot or template that a sandbox in any
//! state but `paused` depends on (its disk is an overlay over it: running, creating, resuming, pausing, failed),
//! followed through the chain of snapshots and templates it was made from; anything pinned by a create, fork or
//! resume in flight ([`Sandboxes::cache_pin`]). Pins, the dependency check and the eviction itself happen under
//! one lock, so a create either pins first (nothing it uses goes) or finds the directory gone (and fetches it).
//!
//! Last use (the LRU order) is the commit time of the object's version, moved forward by every resume, create
//! from and fork from; it and the eviction are recorded in the state database ([`crate::db::remote`]). An
//! evicted directory is first renamed into `<data>/cache-evicting` (atomic, under the lock), then removed.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use hearth_api::{CacheStatus, SandboxState};

use super::remote::{Kind, Storage};
use super::{Sandboxes, ServiceError, now_ms};
use crate::db::remote::{RemoteRow, RemoteState};

/// How deep a chain of snapshots and templates is followed (each link is one checkpoint of a restored sandbox).
const MAX_CHAIN: usize = 64;
/// Where evicted directories wait for their removal, under the data directory.
const TRASH: &str = "cache-evicting";

/// The cache's limit and bookkeeping (part of [`Storage`]).
#[derive(Debug, Default)]
pub struct Cache {
    limit: Option<u64>,
    /// Objects in use by a create, fork or resume in flight, by object name, with their number of users.
    pins: Mutex<HashMap<String, usize>>,
    evictions: AtomicU64,
}

impl Cache {
    pub fn new(limit: Option<u64>) -> Cache {
        Cache {
            limit,
            ..Cache::default()
        }
    }

    fn pins(&self) -> std::sync::MutexGuard<'_, HashMap<String, usize>> {
        self.pins.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Objects kept from eviction while a create, fork or resume uses them; released on drop.
pub struct CachePin {
    storage: Arc<Storage>,
    names: Vec<String>,
}

impl Drop for CachePin {
    fn drop(&mut self) {
        let mut pins = self.storage.cache.pins();
        for n in &self.names {
            if let Some(c) = pins.get_mut(n) {
                *c = c.saturating_sub(1);
                if *c == 0 {
                    pins.remove(n);
                }
            }
        }
    }
}

impl Sandboxes {
    /// The snapshots and saved templates that `template` and `snapshot` stand on, each with the ones it was made
    /// from (a snapshot's disk copy is an overlay over its source sandbox's base): what a create or resume
    /// needs locally. Built-in templates are not objects and are left out.
    pub(crate) fn base_chain(&self, template: Option<&str>, snapshot: Option<&str>) -> Vec<(Kind, String)> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        let mut todo: Vec<(Kind, String)> = Vec::new();
        todo.extend(template.map(|t| (Kind::Template, t.to_string())));
        todo.extend(snapshot.map(|s| (Kind::Snapshot, s.to_string())));
        while let Some((kind, owner)) = todo.pop() {
            if out.len() >= MAX_CHAIN || !seen.insert((kind, owner.clone())) {
                continue;
            }
            match kind {
                Kind::Template if hearth_api::is_valid_template_name(&owner) => {
                    let Ok(Some(t)) = self.db.get_template(&owner) else {
                        continue;
                    };
                    todo.extend(t.snapshot_id.map(|s| (Kind::Snapshot, s)));
                }
                Kind::Snapshot if hearth_api::is_valid_snapshot_id(&owner) => {
                    let Ok(Some(s)) = self.db.get_snapshot(&owner) else {
                        continue;
                    };
                    todo.push((Kind::Template, s.template.clone()));
                    if let Ok(Some(src)) = self.db.get(&s.sandbox_id) {
                        todo.push((Kind::Template, src.template));
                        todo.extend(src.snapshot_id.map(|s| (Kind::Snapshot, s)));
                    }
                }
                _ => continue,
            }
            out.push((kind, owner));
        }
        out
    }

    /// Keeps `objects` from eviction until the pin is dropped, and records their use (the LRU order).
    pub(crate) fn cache_pin(&self, objects: &[(Kind, String)]) -> Option<CachePin> {
        let st = self.storage()?.clone();
        let now = now_ms();
        let names: Vec<String> = objects.iter().map(|(k, o)| k.object(o)).collect();
        {
            let mut pins = st.cache.pins();
            for n in &names {
                *pins.entry(n.clone()).or_default() += 1;
            }
        }
        for n in &names {
            if let Err(e) = self.db.remote_touch(n, now) {
                tracing::warn!(object = %n, error = %e, "recording a cache use");
            }
        }
        Some(CachePin { storage: st, names })
    }

    /// The local files of an object (the first is its directory: present means local), or none for kinds the
    /// cache does not hold.
    pub(super) fn local_paths(&self, kind: Kind, owner: &str) -> Vec<PathBuf> {
        let paths = &self.settings.paths;
        match kind {
            Kind::Pause => {
                let Ok(Some(sbx)) = self.db.get(owner) else {
                    return Vec::new();
                };
                let Some(paused) = sbx.paused else {
                    return Vec::new();
                };
                let mut out = vec![paths.sandbox_dir(owner).join(paused.dir)];
                out.extend(sbx.disk);
                out
            }
            Kind::Snapshot if hearth_api::is_valid_snapshot_id(owner) => vec![paths.snapshot_dir(owner)],
            Kind::Template if hearth_api::is_valid_template_name(owner) => {
                vec![paths.user_templates_dir().join(owner)]
            }
            Kind::Sync if hearth_api::is_valid_sandbox_id(owner) => {
                vec![super::sync::image_dir(paths, owner)]
            }
            _ => Vec::new(),
        }
    }

    /// Bytes the local copy of an object takes (0 when it is only in the bucket).
    pub(super) fn local_bytes(&self, kind: Kind, owner: &str) -> u64 {
        let paths = self.local_paths(kind, owner);
        match paths.first() {
            Some(dir) if dir.is_dir() => {
                let mut seen = super::disk_use::Seen::new();
                paths
                    .iter()
                    .map(|p| super::disk_use::allocated_bytes(p, &mut seen))
                    .fold(0, u64::saturating_add)
            }
            _ => 0,
        }
    }

    /// The cache's use and limit (`GET /v1/storage`, `hearth doctor`).
    pub(crate) fn cache_status(&self, st: &Storage, rows: &[RemoteRow]) -> CacheStatus {
        let used = rows
            .iter()
            .filter(|r| r.state != RemoteState::Deleting)
            .filter_map(|r| Some(self.local_bytes(Kind::parse(&r.kind)?, &r.owner)))
            .fold(0, u64::saturating_add);
        CacheStatus {
            used_bytes: used,
            limit_bytes: st.cache.limit,
            evictions: st.cache.evictions.load(Ordering::Relaxed),
        }
    }

    /// Object names that sandboxes not paused depend on (their disks are overlays over them).
    fn cache_needed(&self) -> Result<HashSet<String>, ServiceError> {
        let mut needed = HashSet::new();
        for row in self.db.list()? {
            if row.state == SandboxState::Paused {
                continue;
            }
            for (kind, owner) in self.base_chain(Some(&row.template), row.snapshot_id.as_deref()) {
                needed.insert(kind.object(&owner));
            }
        }
        Ok(needed)
    }

    /// One eviction pass: while the local copies take more than the limit, removes the least recently used
    /// that may go. Returns how many were evicted.
    pub(crate) fn cache_evict(&self) -> Result<usize, ServiceError> {
        let Some(st) = self.storage().cloned() else {
            return Ok(0);
        };
        let Some(limit) = st.cache.limit else { return Ok(0) };
        // During a bucket outage the local copies are the only usable ones: the cache may overflow until the
        // bucket answers again (its copies could not be fetched back meanwhile).
        if super::remote::lock(&st.last_error).is_some() {
            return Ok(0);
        }
        let trash = self.settings.paths.data_dir.join(TRASH);
        let rows = self.db.remote_list()?;
        let mut sized: Vec<(RemoteRow, Kind, u64)> = rows
            .into_iter()
            .filter(|r| r.state != RemoteState::Deleting)
            .filter_map(|r| {
                let kind = Kind::parse(&r.kind)?;
                let bytes = self.local_bytes(kind, &r.owner);
                Some((r, kind, bytes))
            })
            .filter(|(_, _, bytes)| *bytes > 0)
            .collect();
        let mut used: u64 = sized.iter().map(|(_, _, b)| *b).fold(0, u64::saturating_add);
        metrics::gauge!("hearth_storage_cache_bytes").set(used as f64);
        if used <= limit {
            return Ok(0);
        }
        sized.retain(|(r, _, _)| r.state == RemoteState::Synced);
        sized.sort_by_key(|(r, _, _)| r.last_used_ms);
        let mut evicted = 0;
        {
            let pins = st.cache.pins();
            let needed = self.cache_needed()?;
            for (row, kind, bytes) in sized {
                if used <= limit {
                    break;
                }
                if pins.contains_key(&row.name) || needed.contains(&row.name) || st.is_running(&row.name) {
                    continue;
                }
                match self.evict_one(&row, kind, &trash) {
                    Ok(true) => {
                        used = used.saturating_sub(bytes);
                        evicted += 1;
                        st.cache.evictions.fetch_add(1, Ordering::Relaxed);
                        metrics::counter!("hearth_storage_cache_evictions_total").increment(1);
                        tracing::info!(object = %row.name, bytes, used, limit, "evicted from the local cache");
                    }
                    Ok(false) => {}
                    Err(e) => tracing::warn!(object = %row.name, error = %e, "cache eviction"),
                }
            }
        }
        metrics::gauge!("hearth_storage_cache_bytes").set(used as f64);
        if evicted > 0 || trash.exists() {
            let _ = std::fs::remove_dir_all(&trash);
        }
        Ok(evicted)
    }

    /// Moves one object's local files into the trash if it may still go (checked again under its locks).
    fn evict_one(&self, row: &RemoteRow, kind: Kind, trash: &Path) -> std::io::Result<bool> {
        // A paused sandbox's files are its lifecycle's: only while nobody holds its lock, and only if paused. A
        // synced image is replaced by a sync under the same lock.
        let lock = matches!(kind, Kind::Pause | Kind::Sync).then(|| self.op_lock(&row.owner));
        let _guard = match &lock {
            Some(l) => match l.try_lock() {
                Ok(g) => Some(g),
                Err(_) => return Ok(false),
            },
            None => None,
        };
        if kind == Kind::Pause
            && !matches!(self.db.get(&row.owner), Ok(Some(s)) if s.state == SandboxState::Paused)
        {
            return Ok(false);
        }
        // The newest version must still be the synced one.
        let current = self.db.remote_get(&row.name).ok().flatten();
        if !current.is_some_and(|c| c.state == RemoteState::Synced && c.version == row.version) {
            return Ok(false);
        }
        let paths = self.local_paths(kind, &row.owner);
        if !paths.first().is_some_and(|d| d.is_dir()) {
            return Ok(false);
        }
        std::fs::create_dir_all(trash)?;
        // The directory first: once it is gone, a resume or create fetches the whole object again.
        for (i, p) in paths.iter().enumerate() {
            let to = trash.join(format!("{}-{i}", row.name.replace('/', "_")));
            match std::fs::rename(p, &to) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && i > 0 => {}
                Err(e) => return Err(e),
            }
        }
        if let Err(e) = self.db.remote_set_evicted(&row.name, Some(now_ms())) {
            tracing::warn!(object = %row.name, error = %e, "recording an eviction");
        }
        Ok(true)
    }
}
