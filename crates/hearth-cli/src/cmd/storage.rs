//! `storage status` and `storage gc`: the daemon's storage bucket (`hearthd --storage`).

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
                    mib(o.sent_bytes),
                    o.synced_at.clone().unwrap_or_else(|| "-".into()),
                ]
            })
            .collect();
        out.push('\n');
        out.push_str(&output::table(
            &["OBJECT", "SYNC", "LOCATION", "SIZE", "SENT", "SYNCED AT"],
            &rows,
            style,
        ));
    }
    out
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
