//! `storage status`, `storage gc` and `sync`: the daemon's storage bucket (`hearthd --storage`).

use hearth_api::StorageStatus;

use crate::Ctx;
use crate::args::StorageCommand;
use crate::output::{self, Style};

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn status_text(s: &StorageStatus, style: Style) -> String {
    let mut out = output::key_values(&[
        ("bucket", output::clean(&s.url)),
        (
            "endpoint",
            output::clean(s.endpoint.as_deref().unwrap_or("(AWS)")),
        ),
        ("encrypted", s.encrypted.to_string()),
        ("health", output::clean(&s.health)),
        (
            "last error",
            output::clean(s.last_error.as_deref().unwrap_or("-")),
        ),
        ("pending uploads", s.pending_uploads.to_string()),
        ("pending deletes", s.pending_deletes.to_string()),
        ("uploaded", mib(s.bytes_uploaded)),
        ("downloaded", mib(s.bytes_downloaded)),
        (
            "local cache",
            format!(
                "{} of {}, {} evicted",
                mib(s.cache.used_bytes),
                s.cache.limit_bytes.map_or_else(|| "unbounded".to_owned(), mib),
                s.cache.evictions
            ),
        ),
    ]);
    if !s.objects.is_empty() {
        let rows: Vec<Vec<String>> = s
            .objects
            .iter()
            .map(|o| {
                vec![
                    output::clean(&o.name),
                    output::clean(&o.sync),
                    output::clean(&o.location),
                    mib(o.size_bytes),
                    mib(o.local_bytes),
                    mib(o.sent_bytes),
                    o.synced_at.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        out.push('\n');
        out.push_str(&output::table(
            &["OBJECT", "SYNC", "LOCATION", "SIZE", "LOCAL", "SENT", "SYNCED AT"],
            &rows,
            style,
        ));
    }
    out
}

/// `hearth sync ID [--wait]`: captures the disk; with `--wait`, polls until the bucket holds it.
pub async fn sync(ctx: &Ctx, id: &str, wait: bool) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let spinner = crate::progress::spinner(ctx, format!("syncing the disk of {}", output::clean(id)));
    let mut s = client.sync_sandbox(id).await;
    if wait && let Ok(s) = &mut s {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3600);
        while s.upload != "synced" {
            let st = client.storage_status().await?;
            let o = st.objects.iter().find(|o| o.name == s.object);
            if o.is_some_and(|o| o.sync == "synced") {
                s.upload = "synced".into();
                break;
            }
            if std::time::Instant::now() > deadline {
                anyhow::bail!("{} is still not in the bucket after an hour", s.object);
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        }
    }
    drop(spinner);
    let s = s?;
    ctx.emit(&s, || {
        output::key_values(&[
            ("object", output::clean(&s.object)),
            ("version", s.version.to_string()),
            ("captured at", s.captured_at.clone()),
            ("size", mib(s.size_bytes)),
            (
                "guest stopped",
                format!("{:.1} ms ({} copy)", s.stopped_ms, output::clean(&s.copy)),
            ),
            ("upload", output::clean(&s.upload)),
        ])
    })?;
    Ok(0)
}

pub async fn storage(ctx: &Ctx, cmd: StorageCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    match cmd {
        StorageCommand::Status => {
            let s = client.storage_status().await?;
            let style = ctx.stdout_style();
            ctx.emit(&s, || status_text(&s, style))?;
        }
        StorageCommand::Gc { grace_s } => {
            let r = client.storage_gc(grace_s).await?;
            ctx.emit(&r, || {
                output::key_values(&[
                    ("chunks deleted", r.deleted.to_string()),
                    ("bytes freed", mib(r.deleted_bytes)),
                    ("kept (young)", r.kept_young.to_string()),
                    ("chunks left", r.chunks_after.to_string()),
                    ("bytes left", mib(r.chunk_bytes_after)),
                ])
            })?;
        }
    }
    Ok(0)
}
