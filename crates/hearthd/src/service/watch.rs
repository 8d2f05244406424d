//! Directory watches in the guest: the agent's `WatchDir` stream, its (untrusted) events turned into API
//! events.

use hearth_api::WatchEvent;
use hearth_proto::client::DirWatcher;
use hearth_proto::watch::{WatchEvent as GuestEvent, WatchEventKind};

use super::exec::validate_path;
use super::{Sandboxes, ServiceError, clip};

/// Longest path copied from a guest event into an API event.
const MAX_EVENT_PATH: usize = 4096;

impl Sandboxes {
    /// Starts watching directory `path` in sandbox `id` (and its subdirectories with `recursive`); returns
    /// once the watch is in place. Dropping the watcher stops it in the guest.
    pub async fn watch_dir(&self, id: &str, path: &str, recursive: bool) -> Result<DirWatcher, ServiceError> {
        validate_path(path, "path")?;
        let (_, client) = self.agent(id).await?;
        Ok(client.watch_dir(path, recursive).await?)
    }
}

/// The API event of one guest event (`None` for kinds this daemon does not know).
pub fn to_api(ev: GuestEvent) -> Option<WatchEvent> {
    let path = clip(&ev.path, MAX_EVENT_PATH);
    let is_dir = ev.is_dir;
    Some(match ev.kind {
        WatchEventKind::Create => WatchEvent::Create { path, is_dir },
        WatchEventKind::Write => WatchEvent::Write { path },
        WatchEventKind::Remove => WatchEvent::Remove { path, is_dir },
        WatchEventKind::Rename => WatchEvent::Rename {
            path,
            new_path: ev.new_path.map(|p| clip(&p, MAX_EVENT_PATH)),
            is_dir,
        },
        WatchEventKind::Chmod => WatchEvent::Chmod { path, is_dir },
        WatchEventKind::Overflow => WatchEvent::Overflow,
        WatchEventKind::Unknown => return None,
    })
}
