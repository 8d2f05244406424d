//! File watching: the request and the events of a `WatchDir` stream.
//!
//! The host sends `WatchDir(WatchRequest)`; the agent answers `Watching` once the watch is in place (or
//! `Error`), then `WatchEvents` data frames whose data section is a JSON array of [`WatchEvent`]s. Events are
//! flow-controlled like any data: a host that stops reading makes the agent queue events up to a bound, then
//! drop them and report one [`WatchEventKind::Overflow`]. The stream lasts until the host sends `Abandon`, or
//! ends with `Ok` when the watched directory itself is removed or moved away.

use serde::{Deserialize, Serialize};

/// What to watch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    /// Absolute path of a directory in the guest.
    pub path: String,
    /// Also watch every subdirectory, including ones created while watching.
    #[serde(default)]
    pub recursive: bool,
}

/// What happened to an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchEventKind {
    /// Created, or moved in from outside the watched tree.
    Create,
    /// Content written (consecutive writes to one file may be reported once).
    Write,
    /// Deleted, or moved out of the watched tree (then `rename` without `new_path` comes instead).
    Remove,
    /// Renamed: `path` is the old name; `new_path` the new one when it is still inside the watched tree.
    Rename,
    /// Permissions, owner or timestamps changed.
    Chmod,
    /// Events were lost (the agent's or the kernel's queue was full); `path` is empty.
    Overflow,
    /// A kind a newer peer knows and this one does not.
    #[serde(other)]
    Unknown,
}

/// One file-system event in a watched directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    pub kind: WatchEventKind,
    /// Path relative to the watched directory (`sub/file.txt`); empty for the directory itself.
    pub path: String,
    /// For `rename`: the new path, relative to the watched directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub new_path: Option<String>,
    /// The entry is a directory.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub is_dir: bool,
}

impl WatchEvent {
    pub fn new(kind: WatchEventKind, path: impl Into<String>, is_dir: bool) -> Self {
        WatchEvent {
            kind,
            path: path.into(),
            new_path: None,
            is_dir,
        }
    }

    /// The event reporting lost events.
    pub fn overflow() -> Self {
        WatchEvent::new(WatchEventKind::Overflow, "", false)
    }
}
