use serde::{Deserialize, Serialize};

/// Kind of a file-system entry.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

/// Metadata of a file in the guest.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct FileInfo {
    /// Base name of the entry.
    pub name: String,
    /// Absolute path in the guest.
    pub path: String,
    pub kind: FileKind,
    pub size: u64,
    /// Permission bits (e.g. 420 = 0o644).
    pub mode: u32,
    /// Modification time, seconds since the Unix epoch.
    pub mtime: i64,
    /// Target of a symlink.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link_target: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct FileList {
    pub entries: Vec<FileInfo>,
}

/// Body of `POST .../files/mkdir`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct MkdirRequest {
    pub path: String,
    /// Create missing parents too (like `mkdir -p`). Default true.
    #[serde(default = "default_true")]
    pub parents: bool,
}

/// Body of `POST .../files/rename`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RenameRequest {
    pub from: String,
    pub to: String,
}

fn default_true() -> bool {
    true
}

/// One event of a directory watch (`GET .../files/watch`, server-sent events). The SSE `event:` name is the
/// variant (`ready`, `create`, `write`, `remove`, `rename`, `chmod`, `overflow`, `end`, `error`) and `data:` is
/// this JSON. Paths are relative to the watched directory (`sub/file.txt`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum WatchEvent {
    /// The watch is in place: every change from now on is reported. Always the first event.
    Ready {
        /// The watched directory (absolute).
        path: String,
        recursive: bool,
    },
    /// An entry was created, or moved in from outside the watched directory.
    Create {
        path: String,
        #[serde(default)]
        is_dir: bool,
    },
    /// A file's content was written (a burst of writes may be reported once).
    Write { path: String },
    /// An entry was deleted.
    Remove {
        path: String,
        #[serde(default)]
        is_dir: bool,
    },
    /// An entry was renamed: `path` is the old name, `new_path` the new one (absent when it moved out of the
    /// watched directory).
    Rename {
        path: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        new_path: Option<String>,
        #[serde(default)]
        is_dir: bool,
    },
    /// Permissions, owner or timestamps changed.
    Chmod {
        path: String,
        #[serde(default)]
        is_dir: bool,
    },
    /// Events were lost because the client read too slowly (or the guest kernel's queue was full).
    Overflow,
    /// The watched directory itself was removed or moved away; the stream ends.
    End,
    /// The watch failed (e.g. the sandbox was destroyed); the stream ends.
    Error { code: crate::ErrorCode, message: String },
}

impl WatchEvent {
    /// The SSE event name (the `type`).
    pub fn name(&self) -> &'static str {
        match self {
            WatchEvent::Ready { .. } => "ready",
            WatchEvent::Create { .. } => "create",
            WatchEvent::Write { .. } => "write",
            WatchEvent::Remove { .. } => "remove",
            WatchEvent::Rename { .. } => "rename",
            WatchEvent::Chmod { .. } => "chmod",
            WatchEvent::Overflow => "overflow",
            WatchEvent::End => "end",
            WatchEvent::Error { .. } => "error",
        }
    }

    /// True for the events after which nothing follows.
    pub fn is_terminal(&self) -> bool {
        matches!(self, WatchEvent::End | WatchEvent::Error { .. })
    }
}
