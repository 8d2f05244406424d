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
