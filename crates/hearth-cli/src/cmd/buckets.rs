//! `bucket add|ls|show|rm`, `mount`, `unmount`, `mounts`.

use hearth_api::{Bucket, CreateBucketRequest, MountSpec};

use crate::Ctx;
use crate::args::BucketCommand;
use crate::output;

fn bucket_text(b: &Bucket) -> String {
    output::key_values(&[
        ("name", output::clean(&b.name)),
        ("url", output::clean(&b.url)),
        (
            "endpoint",
            output::clean(b.endpoint.as_deref().unwrap_or("(AWS)")),
        ),
        ("region", output::clean(&b.region)),
        ("path style", b.path_style.to_string()),
        ("access key", format!("...{}", output::clean(&b.access_key_hint))),
        ("created", b.created_at.clone()),
        ("mounted by", b.mounted_by.join(", ")),
    ])
}

pub async fn bucket(ctx: &Ctx, cmd: BucketCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    match cmd {
        BucketCommand::Add {
            name,
            bucket_url,
            endpoint,
            region,
            path_style,
            access_key_id,
            secret_access_key,
        } => {
            let req = CreateBucketRequest {
                name,
                url: bucket_url,
                endpoint,
                region,
                path_style,
                access_key_id,
                secret_access_key,
            };
            let b = client.create_bucket(&req).await?;
            ctx.emit(&b, || format!("{}\n", output::clean(&b.name)))?;
        }
        BucketCommand::Ls => {
            let list = client.list_buckets().await?;
            ctx.emit(&list, || {
                let rows: Vec<Vec<String>> = list
                    .buckets
                    .iter()
                    .map(|b| {
                        vec![
                            output::clean(&b.name),
                            output::clean(&b.url),
                            output::clean(b.endpoint.as_deref().unwrap_or("-")),
                            b.mounted_by.len().to_string(),
                        ]
                    })
                    .collect();
                output::table(&["NAME", "URL", "ENDPOINT", "MOUNTS"], &rows, ctx.stdout_style())
            })?;
        }
        BucketCommand::Show { name } => {
            let b = client.get_bucket(&name).await?;
            ctx.emit(&b, || bucket_text(&b))?;
        }
        BucketCommand::Rm { names } => {
            let mut failed = false;
            for name in &names {
                match client.delete_bucket(name).await {
                    Ok(()) => println!("{}", output::clean(name)),
                    Err(e) => {
                        eprintln!("hearth: {}: {e}", output::clean(name));
                        failed = true;
                    }
                }
            }
            return Ok(u8::from(failed));
        }
    }
    Ok(0)
}

pub async fn mount(ctx: &Ctx, id: &str, spec: &MountSpec) -> anyhow::Result<u8> {
    let m = ctx.client()?.mount(id, spec).await?;
    ctx.emit(&m, || format!("{}\n", output::clean(&m.path)))?;
    Ok(0)
}

pub async fn unmount(ctx: &Ctx, id: &str, path: &str) -> anyhow::Result<u8> {
    ctx.client()?.unmount(id, path).await?;
    let done = serde_json::json!({ "unmounted": path });
    ctx.emit(&done, || format!("{}\n", output::clean(path)))?;
    Ok(0)
}

pub async fn mounts(ctx: &Ctx, id: &str) -> anyhow::Result<u8> {
    let list = ctx.client()?.list_mounts(id).await?;
    ctx.emit(&list, || {
        let rows: Vec<Vec<String>> = list
            .mounts
            .iter()
            .map(|m| {
                vec![
                    output::clean(&m.path),
                    output::clean(&m.bucket),
                    output::clean(if m.prefix.is_empty() { "-" } else { &m.prefix }),
                    if m.read_only { "ro" } else { "rw" }.to_string(),
                    m.bytes_read.to_string(),
                    m.bytes_written.to_string(),
                ]
            })
            .collect();
        output::table(
            &["PATH", "BUCKET", "PREFIX", "MODE", "READ", "WRITTEN"],
            &rows,
            ctx.stdout_style(),
        )
    })?;
    Ok(0)
}
