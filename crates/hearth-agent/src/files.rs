//! File requests, resolved inside the guest: read, write, stat, list, mkdir, remove, rename.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use hearth_proto::{DATA_CHUNK, ErrorKind, FileInfo, FileKind, GuestMsg, HostMsg};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::conn::{After, Ctx, Inbound};
use crate::{AgentError, fail};

/// Longest path accepted (Linux `PATH_MAX`).
const MAX_PATH: usize = 4096;

/// Check that `path` is absolute, non-empty, NUL-free and not too long.
pub fn check_path(path: &str) -> Result<&Path, AgentError> {
    if !path.starts_with('/') {
        return Err(fail(
            ErrorKind::InvalidPath,
            format!("path must be absolute: {:?}", clip(path)),
        ));
    }
    if path.contains('\0') {
        return Err(fail(ErrorKind::InvalidPath, "path contains NUL"));
    }
    if path.len() > MAX_PATH {
        return Err(fail(ErrorKind::InvalidPath, "path too long"));
    }
    Ok(Path::new(path))
}

fn clip(s: &str) -> &str {
    clip_to(s, 200)
}

fn clip_to(s: &str, max: usize) -> &str {
    &s[..s.floor_char_boundary(max)]
}

/// The protocol error kind of an I/O error.
pub fn errno_kind(e: &io::Error) -> ErrorKind {
    match e.raw_os_error() {
        Some(libc::ENOENT) => ErrorKind::NotFound,
        Some(libc::EACCES | libc::EPERM | libc::EROFS) => ErrorKind::PermissionDenied,
        Some(libc::EEXIST) => ErrorKind::AlreadyExists,
        Some(libc::ENOTDIR) => ErrorKind::NotADirectory,
        Some(libc::EISDIR) => ErrorKind::IsADirectory,
        Some(libc::ENOTEMPTY) => ErrorKind::DirectoryNotEmpty,
        Some(libc::ENAMETOOLONG | libc::ELOOP | libc::EINVAL) => ErrorKind::InvalidPath,
        _ => match e.kind() {
            io::ErrorKind::NotFound => ErrorKind::NotFound,
            io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            io::ErrorKind::AlreadyExists => ErrorKind::AlreadyExists,
            _ => ErrorKind::Other,
        },
    }
}

fn io_fail(what: &str, path: &Path, e: io::Error) -> AgentError {
    fail(
        errno_kind(&e),
        format!("{what} {}: {e}", clip(&path.to_string_lossy())),
    )
}

/// Build a [`FileInfo`] from metadata (not following a final symlink unless `meta` did).
fn file_info(path: &Path, meta: &fs::Metadata) -> FileInfo {
    let ft = meta.file_type();
    let kind = if ft.is_file() {
        FileKind::File
    } else if ft.is_dir() {
        FileKind::Dir
    } else if ft.is_symlink() {
        FileKind::Symlink
    } else {
        FileKind::Other
    };
    let link_target = if ft.is_symlink() {
        fs::read_link(path).ok().map(|t| t.to_string_lossy().into_owned())
    } else {
        None
    };
    FileInfo {
        name: path
            .file_name()
            .map_or_else(|| "/".to_owned(), |n| n.to_string_lossy().into_owned()),
        path: path.to_string_lossy().into_owned(),
        kind,
        size: meta.len(),
        mode: meta.mode() & 0o7777,
        mtime: meta.mtime(),
        link_target,
    }
}

/// Run blocking file-system work off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, AgentError> + Send + 'static,
) -> Result<T, AgentError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| fail(ErrorKind::Other, format!("worker failed: {e}")))?
}

pub(crate) async fn handle(
    ctx: &Ctx,
    req: HostMsg,
    inbound: mpsc::UnboundedReceiver<Inbound>,
) -> Result<After, AgentError> {
    match req {
        HostMsg::ReadFile { path } => read_file(ctx, &path).await?,
        HostMsg::WriteFile { path, mode } => write_file(ctx, &path, mode, inbound).await?,
        HostMsg::Stat { path } => {
            let p = check_path(&path)?.to_owned();
            let info = blocking(move || {
                let meta = fs::symlink_metadata(&p).map_err(|e| io_fail("stat", &p, e))?;
                Ok(file_info(&p, &meta))
            })
            .await?;
            ctx.reply(GuestMsg::Stat { info });
        }
        HostMsg::ListDir { path } => {
            let p = check_path(&path)?.to_owned();
            let entries = blocking(move || list_dir(&p)).await?;
            ctx.reply_batches(entries, |entries| GuestMsg::Entries { entries });
        }
        HostMsg::Mkdir { path, parents } => {
            let p = check_path(&path)?.to_owned();
            blocking(move || {
                let r = if parents {
                    fs::create_dir_all(&p)
                } else {
                    fs::create_dir(&p)
                };
                r.map_err(|e| io_fail("mkdir", &p, e))
            })
            .await?;
            ctx.reply(GuestMsg::Ok);
        }
        HostMsg::Remove { path, recursive } => {
            let p = check_path(&path)?.to_owned();
            blocking(move || remove(&p, recursive)).await?;
            ctx.reply(GuestMsg::Ok);
        }
        HostMsg::Rename { from, to } => {
            let from = check_path(&from)?.to_owned();
            let to = check_path(&to)?.to_owned();
            blocking(move || fs::rename(&from, &to).map_err(|e| io_fail("rename", &from, e))).await?;
            ctx.reply(GuestMsg::Ok);
        }
        other => {
            return Err(fail(
                ErrorKind::InvalidRequest,
                format!("{other:?} does not start a request"),
            ));
        }
    }
    Ok(After::Done)
}

fn list_dir(dir: &Path) -> Result<Vec<FileInfo>, AgentError> {
    let rd = fs::read_dir(dir).map_err(|e| io_fail("list", dir, e))?;
    let mut entries = Vec::new();
    for ent in rd {
        let ent = ent.map_err(|e| io_fail("list", dir, e))?;
        let path = ent.path();
        // An entry removed while listing is simply skipped.
        if let Ok(meta) = fs::symlink_metadata(&path) {
            entries.push(file_info(&path, &meta));
        }
    }
    entries.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(entries)
}

fn remove(p: &Path, recursive: bool) -> Result<(), AgentError> {
    let meta = fs::symlink_metadata(p).map_err(|e| io_fail("remove", p, e))?;
    let r = if !meta.is_dir() {
        fs::remove_file(p)
    } else if recursive {
        fs::remove_dir_all(p)
    } else {
        fs::remove_dir(p)
    };
    r.map_err(|e| io_fail("remove", p, e))
}

async fn read_file(ctx: &Ctx, path: &str) -> Result<(), AgentError> {
    let p = check_path(path)?;
    let mut file = tokio::fs::File::open(p)
        .await
        .map_err(|e| io_fail("open", p, e))?;
    let meta = file.metadata().await.map_err(|e| io_fail("stat", p, e))?;
    if meta.is_dir() {
        return Err(fail(
            ErrorKind::IsADirectory,
            format!("{} is a directory", clip(path)),
        ));
    }
    let mut info = file_info(p, &meta);
    // `meta` follows symlinks; say what was opened, not how it was reached.
    info.link_target = None;
    ctx.reply(GuestMsg::ReadStart { info });
    let mut total = 0u64;
    let mut buf = vec![0u8; DATA_CHUNK];
    loop {
        let n = file.read(&mut buf).await.map_err(|e| io_fail("read", p, e))?;
        if n == 0 {
            break;
        }
        total += n as u64;
        if ctx
            .send_data(&GuestMsg::FileData, Bytes::copy_from_slice(&buf[..n]))
            .await
            .is_err()
        {
            return Ok(());
        }
    }
    ctx.reply(GuestMsg::ReadDone { bytes: total });
    Ok(())
}

/// Removes a temporary file unless it was renamed into place (also when the request is abandoned).
struct TempGuard(Option<PathBuf>);

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = fs::remove_file(p);
        }
    }
}

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

async fn write_file(
    ctx: &Ctx,
    path: &str,
    mode: Option<u32>,
    mut inbound: mpsc::UnboundedReceiver<Inbound>,
) -> Result<(), AgentError> {
    let target = check_path(path)?.to_owned();
    let (Some(parent), Some(name)) = (target.parent(), target.file_name()) else {
        return Err(fail(ErrorKind::IsADirectory, "cannot write to /"));
    };
    let pmeta = fs::metadata(parent).map_err(|e| io_fail("parent", parent, e))?;
    if !pmeta.is_dir() {
        return Err(fail(
            ErrorKind::NotADirectory,
            format!("{} is not a directory", clip(&parent.to_string_lossy())),
        ));
    }
    let existing = fs::symlink_metadata(&target).ok();
    if existing.as_ref().is_some_and(|m| m.is_dir()) {
        return Err(fail(
            ErrorKind::IsADirectory,
            format!("{} is a directory", clip(path)),
        ));
    }
    let through_link = existing.as_ref().is_some_and(|m| m.file_type().is_symlink());
    let mode = mode
        .map(|m| m & 0o7777)
        .or(existing.as_ref().map(|m| m.mode() & 0o7777))
        .unwrap_or(0o644);

    // Write to a temporary file next to the target and rename it into place, so readers never see a half
    // file. A symlink is written through instead (renaming would replace the link itself).
    let (write_path, mut guard) = if through_link {
        (target.clone(), TempGuard(None))
    } else {
        let seq = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
        let name = name.to_string_lossy();
        let tmp = parent.join(format!(
            ".{}.hearth-{}-{seq}.tmp",
            clip_to(&name, 100),
            std::process::id()
        ));
        (tmp.clone(), TempGuard(Some(tmp)))
    };
    let mut opts = tokio::fs::OpenOptions::new();
    opts.write(true).mode(mode);
    if through_link {
        opts.create(true).truncate(true);
    } else {
        opts.create_new(true);
    }
    let mut file = opts
        .open(&write_path)
        .await
        .map_err(|e| io_fail("create", &target, e))?;
    let mut total = 0u64;
    let mut ended = false;
    while let Some(item) = inbound.recv().await {
        match item {
            Inbound::Data(d) => {
                file.write_all(&d)
                    .await
                    .map_err(|e| io_fail("write", &target, e))?;
                total += d.len() as u64;
                ctx.credit(d.len());
            }
            Inbound::End => {
                ended = true;
                break;
            }
            Inbound::Control(_) => {}
        }
    }
    if !ended {
        // The stream went away: the guard removes the temporary file.
        return Ok(());
    }
    file.flush().await.map_err(|e| io_fail("write", &target, e))?;
    let std_file = file.into_std().await;
    // Explicit mode (the umask applied at creation); keep the owner of a file we replace.
    std_file
        .set_permissions(fs::Permissions::from_mode(mode))
        .map_err(|e| io_fail("chmod", &target, e))?;
    if let Some(m) = existing.as_ref().filter(|_| !through_link) {
        let _ = std::os::unix::fs::fchown(&std_file, Some(m.uid()), Some(m.gid()));
    }
    drop(std_file);
    if let Some(tmp) = guard.0.take()
        && let Err(e) = fs::rename(&tmp, &target)
    {
        guard.0 = Some(tmp);
        return Err(io_fail("rename", &target, e));
    }
    ctx.reply(GuestMsg::Written { bytes: total });
    Ok(())
}
