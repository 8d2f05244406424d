//! `cp` and `files ls|stat|mkdir|rm|mv`.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, anyhow, bail};
use futures::StreamExt;
use tokio::io::AsyncWriteExt;

use crate::Ctx;
use crate::args::{FilesCommand, Location};
use crate::output;

/// Mode of a file `cp` creates locally (the guest's mode is not carried over).
const NEW_FILE_MODE: u32 = 0o644;

/// Last component of a guest path (`/a/b` -> `b`), if it has one.
fn remote_basename(path: &str) -> Option<&str> {
    path.rsplit('/').find(|s| !s.is_empty())
}

/// A remote destination ending in `/` is a directory: the file keeps the source's name.
fn remote_target(dst: &str, src_name: Option<&str>) -> anyhow::Result<String> {
    if !dst.ends_with('/') {
        return Ok(dst.to_owned());
    }
    match src_name {
        Some(name) => Ok(format!("{dst}{name}")),
        None => bail!("{dst} is a directory: name the destination file (reading from stdin)"),
    }
}

pub async fn cp(ctx: &Ctx, src: &str, dst: &str) -> anyhow::Result<u8> {
    let src = Location::parse(src).map_err(|e| anyhow!(e))?;
    let dst = Location::parse(dst).map_err(|e| anyhow!(e))?;
    let client = ctx.client()?;
    match (src, dst) {
        (Location::Remote { id, path }, Location::Remote { id: to_id, path: to }) => {
            let to = remote_target(&to, remote_basename(&path))?;
            let body = client
                .download_stream(&id, &path)
                .await
                .with_context(|| format!("cannot read {id}:{path}"))?;
            client
                .upload_stream(&to_id, &to, body)
                .await
                .with_context(|| format!("cannot write {to_id}:{to}"))?;
        }
        (Location::Remote { id, path }, Location::Stdio) => {
            let mut stdout = tokio::io::stdout();
            client
                .download(&id, &path, &mut stdout)
                .await
                .with_context(|| format!("cannot read {id}:{path}"))?;
        }
        (Location::Remote { id, path }, Location::Local(local)) => {
            download_to_file(&client, &id, &path, &local).await?;
        }
        (Location::Local(local), Location::Remote { id, path }) => {
            let name = local.file_name().and_then(|n| n.to_str());
            let to = remote_target(&path, name)?;
            let file = tokio::fs::File::open(&local)
                .await
                .with_context(|| format!("cannot open {}", local.display()))?;
            if file.metadata().await?.is_dir() {
                bail!("{} is a directory; cp copies single files", local.display());
            }
            client
                .upload(&id, &to, file)
                .await
                .with_context(|| format!("cannot write {id}:{to}"))?;
        }
        (Location::Stdio, Location::Remote { id, path }) => {
            let to = remote_target(&path, None)?;
            client
                .upload(&id, &to, tokio::io::stdin())
                .await
                .with_context(|| format!("cannot write {id}:{to}"))?;
        }
        (_, _) => bail!("one side of `hearth cp` must be in a sandbox (ID:/path)"),
    }
    Ok(0)
}

/// Downloads into a temporary file next to the target and renames it into place, so a failed copy never
/// leaves a truncated file or destroys an existing one.
async fn download_to_file(
    client: &hearth_client::Client,
    id: &str,
    path: &str,
    local: &Path,
) -> anyhow::Result<()> {
    let target: PathBuf = if local.is_dir() {
        let name = remote_basename(path).ok_or_else(|| anyhow!("{path} has no file name"))?;
        local.join(name)
    } else {
        local.to_owned()
    };
    // Ask first: a missing remote file must fail before anything is created locally.
    let mut body = std::pin::pin!(
        client
            .download_stream(id, path)
            .await
            .with_context(|| format!("cannot read {id}:{path}"))?
    );
    let dir = match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".hearth-cp-")
        .tempfile_in(&dir)
        .with_context(|| format!("cannot create a file in {}", dir.display()))?;
    let mut file = tokio::fs::File::from_std(tmp.reopen()?);
    while let Some(chunk) = body.next().await {
        let chunk = chunk.with_context(|| format!("cannot read {id}:{path}"))?;
        file.write_all(&chunk).await?;
    }
    file.flush().await?;
    file.sync_all().await?;
    drop(file);
    let mode = std::fs::metadata(&target)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.permissions().mode())
        .unwrap_or(NEW_FILE_MODE);
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(mode))?;
    tmp.persist(&target)
        .with_context(|| format!("cannot write {}", target.display()))?;
    Ok(())
}

pub async fn files(ctx: &Ctx, command: FilesCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    match command {
        FilesCommand::Ls { id, path } => {
            let list = client.list_dir(&id, &path).await?;
            let style = ctx.stdout_style();
            ctx.emit(&list, || output::file_table(&list.entries, style))?;
        }
        FilesCommand::Stat { id, path } => {
            let info = client.stat(&id, &path).await?;
            ctx.emit(&info, || output::file_details(&info))?;
        }
        FilesCommand::Mkdir { id, path } => client.mkdir(&id, &path, true).await?,
        FilesCommand::Rm { id, path, recursive } => client.delete_file(&id, &path, recursive).await?,
        FilesCommand::Mv { id, from, to } => client.rename(&id, &from, &to).await?,
        FilesCommand::Watch { id, path, recursive } => {
            return watch(ctx, &client, &id, &path, recursive).await;
        }
    }
    Ok(0)
}

/// `files watch`: one line per event on stdout (`create  sub/file`), the start and end on stderr.
async fn watch(
    ctx: &Ctx,
    client: &hearth_client::Client,
    id: &str,
    path: &str,
    recursive: bool,
) -> anyhow::Result<u8> {
    use hearth_api::WatchEvent;
    let mut events = client
        .watch_dir(id, path, recursive)
        .await
        .with_context(|| format!("cannot watch {id}:{path}"))?;
    while let Some(ev) = events.next().await {
        let ev = ev?;
        if ctx.json {
            println!("{}", serde_json::to_string(&ev)?);
        }
        let line = match &ev {
            WatchEvent::Ready { path, .. } => {
                eprintln!("watching {id}:{path} (Ctrl-C to stop)");
                continue;
            }
            WatchEvent::Create { path, is_dir }
            | WatchEvent::Remove { path, is_dir }
            | WatchEvent::Chmod { path, is_dir } => format!("{path}{}", if *is_dir { "/" } else { "" }),
            WatchEvent::Write { path } => path.clone(),
            WatchEvent::Rename { path, new_path, .. } => match new_path {
                Some(to) => format!("{path} -> {to}"),
                None => format!("{path} -> (outside)"),
            },
            WatchEvent::Overflow => "(events were lost: the reader was too slow)".to_owned(),
            WatchEvent::End => {
                eprintln!("{id}:{path} is gone; stopped watching");
                return Ok(0);
            }
            WatchEvent::Error { code, message } => {
                anyhow::bail!("the watch failed: {message} ({})", code.as_str())
            }
        };
        if !ctx.json {
            println!("{:<8} {line}", ev.name());
        }
    }
    Ok(0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn remote_names() {
        assert_eq!(remote_basename("/a/b"), Some("b"));
        assert_eq!(remote_basename("/a/b/"), Some("b"));
        assert_eq!(remote_basename("/"), None);
        assert_eq!(remote_target("/tmp/x", Some("y")).unwrap(), "/tmp/x");
        assert_eq!(remote_target("/tmp/", Some("y")).unwrap(), "/tmp/y");
        assert!(remote_target("/tmp/", None).is_err());
    }
}
