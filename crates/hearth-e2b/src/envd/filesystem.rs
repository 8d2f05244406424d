//! `filesystem.Filesystem`: Stat, ListDir (with depth), MakeDir, Move, Remove on hearth's file routes, and
//! the watch methods ([`super::watchers`]). Paths resolve as envd resolves them ([`super::resolve`]).

use std::collections::VecDeque;
use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::response::Response;
use hearth_api::{FileInfo, FileKind};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use super::connect::{self, Code, Fault};
use super::proto;
use super::{Envd, watchers};
use crate::Shared;

/// Most entries one ListDir returns, and most directories it descends into.
const MAX_ENTRIES: usize = 100_000;
const MAX_DIRS: usize = 10_000;

pub async fn dispatch(
    State(_): State<Arc<Shared>>,
    Path(method): Path<String>,
    envd: Result<Envd, Fault>,
    req: Request,
) -> Response {
    let envd = match envd {
        Ok(e) => e,
        Err(f) => return f.unary_response(),
    };
    let headers = req.headers().clone();
    let body = match axum::body::to_bytes(req.into_body(), connect::MAX_MESSAGE + 5).await {
        Ok(b) => b,
        Err(_) => return Fault::invalid("request message too large").unary_response(),
    };
    if method == "WatchDir" {
        return watchers::watch_dir(&envd, &headers, &body).await;
    }
    connect::unary(unary(&envd, &method, &headers, &body).await)
}

async fn unary(
    envd: &Envd,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<serde_json::Value, Fault> {
    let work = async {
        match method {
            "Stat" => stat(envd, connect::decode_unary(headers, body)?).await,
            "ListDir" => list_dir(envd, connect::decode_unary(headers, body)?).await,
            "MakeDir" => make_dir(envd, connect::decode_unary(headers, body)?).await,
            "Move" => move_entry(envd, connect::decode_unary(headers, body)?).await,
            "Remove" => remove(envd, connect::decode_unary(headers, body)?).await,
            "CreateWatcher" => watchers::create(envd, connect::decode_unary(headers, body)?).await,
            "GetWatcherEvents" => watchers::events(envd, connect::decode_unary(headers, body)?).await,
            "RemoveWatcher" => watchers::remove(envd, connect::decode_unary(headers, body)?).await,
            other => Err(Fault::new(
                Code::Unimplemented,
                format!("filesystem.Filesystem/{other} is not implemented"),
            )),
        }
    };
    match connect::timeout(headers)? {
        Some(d) => tokio::time::timeout(d, work)
            .await
            .unwrap_or_else(|_| Err(Fault::new(Code::DeadlineExceeded, "the call's deadline passed"))),
        None => work.await,
    }
}

/// `FileType` by name.
fn file_type(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "FILE_TYPE_FILE",
        FileKind::Dir => "FILE_TYPE_DIRECTORY",
        FileKind::Symlink => "FILE_TYPE_SYMLINK",
        FileKind::Other => "FILE_TYPE_UNSPECIFIED",
    }
}

/// Go's `FileMode.String()` for a kind and permission bits (`drwxr-xr-x`), as envd reports it.
pub fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        FileKind::File | FileKind::Other => '-',
    });
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// `EntryInfo` for hearth's file metadata (owner and group are not reported by hearth).
pub fn entry(info: &FileInfo) -> serde_json::Value {
    let modified = OffsetDateTime::from_unix_timestamp(info.mtime)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".to_owned());
    let mut v = serde_json::json!({
        "name": info.name,
        "type": file_type(info.kind),
        "path": info.path,
        "size": info.size.to_string(),
        "mode": info.mode & 0o777,
        "permissions": permissions(info.kind, info.mode),
        "modifiedTime": modified,
    });
    if let Some(t) = &info.link_target {
        v["symlinkTarget"] = serde_json::Value::String(t.clone());
    }
    v
}

/// The metadata of `path`, as a fault envd would answer when it is missing.
pub async fn stat_path(envd: &Envd, path: &str) -> Result<FileInfo, Fault> {
    match envd.api.stat(&envd.sandbox, path).await {
        Ok(i) => Ok(i),
        Err(e) => Err(envd.fault(e).await),
    }
}

async fn stat(envd: &Envd, req: proto::PathRequest) -> Result<serde_json::Value, Fault> {
    let path = envd.resolve(&req.path)?;
    let info = stat_path(envd, &path).await?;
    Ok(serde_json::json!({ "entry": entry(&info) }))
}

async fn list_dir(envd: &Envd, req: proto::ListDirRequest) -> Result<serde_json::Value, Fault> {
    let root = envd.resolve(&req.path)?;
    let depth = req.depth.max(1);
    let mut entries = Vec::new();
    let mut queue = VecDeque::from([(root, 1u32)]);
    let mut dirs = 0usize;
    while let Some((dir, level)) = queue.pop_front() {
        dirs += 1;
        if dirs > MAX_DIRS {
            return Err(Fault::new(
                Code::ResourceExhausted,
                format!("more than {MAX_DIRS} directories to list: use a smaller depth"),
            ));
        }
        let list = match envd.api.list_dir(&envd.sandbox, &dir).await {
            Ok(l) => l,
            Err(e) => {
                let f = envd.fault(e).await;
                // A subdirectory that vanished while walking is skipped; the root must exist.
                if level > 1 && f.code == Code::NotFound {
                    continue;
                }
                return Err(match f.code {
                    Code::FailedPrecondition => Fault::invalid(format!("path is not a directory: {dir}")),
                    _ => f,
                });
            }
        };
        for info in list.entries {
            if entries.len() >= MAX_ENTRIES {
                return Err(Fault::new(
                    Code::ResourceExhausted,
                    format!("more than {MAX_ENTRIES} entries: use a smaller depth"),
                ));
            }
            if info.kind == FileKind::Dir && level < depth {
                queue.push_back((info.path.clone(), level + 1));
            }
            entries.push(entry(&info));
        }
    }
    Ok(serde_json::json!({ "entries": entries }))
}

async fn make_dir(envd: &Envd, req: proto::PathRequest) -> Result<serde_json::Value, Fault> {
    let path = envd.resolve(&req.path)?;
    match stat_path(envd, &path).await {
        Ok(i) if i.kind == FileKind::Dir => {
            return Err(Fault::new(
                Code::AlreadyExists,
                format!("directory already exists: {path}"),
            ));
        }
        Ok(_) => {
            return Err(Fault::invalid(format!(
                "path already exists but it is not a directory: {path}"
            )));
        }
        Err(f) if f.code == Code::NotFound => {}
        Err(f) => return Err(f),
    }
    if let Err(e) = envd.api.mkdir(&envd.sandbox, &path, true).await {
        return Err(envd.fault(e).await);
    }
    let name = path.rsplit('/').next().unwrap_or("").to_owned();
    Ok(serde_json::json!({ "entry": { "name": name, "type": "FILE_TYPE_DIRECTORY", "path": path } }))
}

/// Creates the parent directory of `path` (envd does, for moves and uploads).
pub async fn ensure_parent(envd: &Envd, path: &str) -> Result<(), Fault> {
    let parent = match path.rsplit_once('/') {
        Some((p, _)) if !p.is_empty() => p,
        _ => return Ok(()),
    };
    match envd.api.mkdir(&envd.sandbox, parent, true).await {
        Ok(()) => Ok(()),
        Err(e) => Err(envd.fault(e).await),
    }
}

async fn move_entry(envd: &Envd, req: proto::MoveRequest) -> Result<serde_json::Value, Fault> {
    let from = envd.resolve(&req.source)?;
    let to = envd.resolve(&req.destination)?;
    ensure_parent(envd, &to).await?;
    if let Err(e) = envd.api.rename(&envd.sandbox, &from, &to).await {
        let f = envd.fault(e).await;
        return Err(match f.code {
            Code::NotFound => Fault::new(Code::NotFound, format!("source file not found: {from}")),
            _ => f,
        });
    }
    let info = stat_path(envd, &to).await?;
    Ok(serde_json::json!({ "entry": entry(&info) }))
}

/// Removes a file or a whole tree; a path that does not exist is not an error (envd's `RemoveAll`).
async fn remove(envd: &Envd, req: proto::PathRequest) -> Result<serde_json::Value, Fault> {
    let path = envd.resolve(&req.path)?;
    if path == "/" {
        return Err(Fault::invalid("refusing to remove /"));
    }
    match envd.api.delete_file(&envd.sandbox, &path, true).await {
        Ok(()) => Ok(serde_json::json!({})),
        Err(e) => match envd.fault(e).await {
            f if f.code == Code::NotFound => Ok(serde_json::json!({})),
            f => Err(f),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_look_like_envd_entries() {
        let info = FileInfo {
            name: "notes.txt".into(),
            path: "/root/notes.txt".into(),
            kind: FileKind::File,
            size: 11,
            mode: 0o644,
            mtime: 0,
            link_target: None,
        };
        let e = entry(&info);
        assert_eq!(e["type"], "FILE_TYPE_FILE");
        assert_eq!(e["size"], "11");
        assert_eq!(e["mode"], 0o644);
        assert_eq!(e["permissions"], "-rw-r--r--");
        assert_eq!(e["modifiedTime"], "1970-01-01T00:00:00Z");
        assert_eq!(permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(permissions(FileKind::Symlink, 0o777), "Lrwxrwxrwx");
    }
}
