//! `create`, `ls`, `info`, `rm`, `timeout`.

use std::collections::BTreeMap;

use futures::StreamExt;
use hearth_api::CreateSandboxRequest;
use hearth_client::ListFilter;
use time::OffsetDateTime;

use crate::Ctx;
use crate::args::{CreateArgs, LsArgs};
use crate::output;
use crate::progress::{self, BuildView};

fn to_map(pairs: Vec<(String, String)>) -> BTreeMap<String, String> {
    pairs.into_iter().collect()
}

pub async fn create(ctx: &Ctx, a: CreateArgs) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let req = CreateSandboxRequest {
        template: a.template,
        vcpus: a.vcpus,
        memory_mib: a.memory,
        timeout_s: a.timeout,
        env: to_map(a.env),
        metadata: to_map(a.meta),
        auto_resume: a.no_auto_resume.then_some(false),
        on_timeout: a.pause_on_timeout.then_some(hearth_api::OnTimeout::Pause),
        snapshot: a.snapshot,
        network: a.egress.policy(),
        networks: a.networks,
        name: a.name,
        mounts: a.mounts,
        disk_sync_interval_s: a.disk_sync_interval,
        from_sync: a.from_sync,
    };
    let what = match &req.template {
        Some(t) => format!("creating a sandbox from {}", output::clean(t)),
        None => "creating a sandbox".to_owned(),
    };
    let spinner = progress::spinner(ctx, what);
    let sandbox = if spinner.draws() {
        // A snapshot or template fetched from the storage bucket shows as a byte bar.
        start_with_progress(&spinner, client.create_sandbox_stream(&req)).await
    } else {
        client.create_sandbox(&req).await.map_err(Into::into)
    };
    drop(spinner);
    let sandbox = sandbox?;
    ctx.emit(&sandbox, || format!("{}\n", sandbox.id))?;
    Ok(0)
}

pub async fn list(ctx: &Ctx, a: LsArgs) -> anyhow::Result<u8> {
    let filter = ListFilter {
        state: a.state,
        metadata: to_map(a.meta),
    };
    let list = ctx.client()?.list_sandboxes(&filter).await?;
    let style = ctx.stdout_style();
    ctx.emit(&list, || {
        output::sandbox_table(&list.sandboxes, OffsetDateTime::now_utc(), style)
    })?;
    Ok(0)
}

pub async fn info(ctx: &Ctx, id: &str) -> anyhow::Result<u8> {
    let sandbox = ctx.client()?.get_sandbox(id).await?;
    ctx.emit(&sandbox, || {
        output::sandbox_details(&sandbox, OffsetDateTime::now_utc())
    })?;
    Ok(0)
}

/// Removes every id given, going on past failures; each removed id is printed; status 1 if any failed.
pub async fn remove(ctx: &Ctx, ids: &[String]) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let mut removed = Vec::new();
    let mut failed = false;
    for id in ids {
        match client.delete_sandbox(id).await {
            Ok(()) => {
                removed.push(id.clone());
                if !ctx.json {
                    println!("{id}");
                }
            }
            Err(e) => {
                failed = true;
                crate::report::print(
                    &anyhow::Error::new(e).context(format!("cannot remove {id}")),
                    &ctx.url,
                );
            }
        }
    }
    if ctx.json {
        print!("{}", output::json(&serde_json::json!({ "removed": removed }))?);
    }
    Ok(u8::from(failed))
}

pub async fn timeout(ctx: &Ctx, id: &str, seconds: u64) -> anyhow::Result<u8> {
    let sandbox = ctx.client()?.set_timeout(id, seconds).await?;
    ctx.emit(&sandbox, || {
        format!("{} ends at {}\n", sandbox.id, output::clean(&sandbox.end_at))
    })?;
    Ok(0)
}

pub async fn pause(ctx: &Ctx, id: &str) -> anyhow::Result<u8> {
    let spinner = progress::spinner(ctx, format!("pausing {}", output::clean(id)));
    let sandbox = ctx.client()?.pause_sandbox(id).await;
    drop(spinner);
    let sandbox = sandbox?;
    ctx.emit(&sandbox, || format!("{} paused\n", sandbox.id))?;
    Ok(0)
}

pub async fn resume(ctx: &Ctx, id: &str) -> anyhow::Result<u8> {
    let spinner = progress::spinner(ctx, format!("resuming {}", output::clean(id)));
    let client = ctx.client()?;
    let sandbox = if spinner.draws() {
        // A paused state fetched from the storage bucket shows as a byte bar.
        start_with_progress(&spinner, client.resume_sandbox_stream(id)).await
    } else {
        client.resume_sandbox(id).await.map_err(Into::into)
    };
    drop(spinner);
    let sandbox = sandbox?;
    ctx.emit(&sandbox, || format!("{} running\n", sandbox.id))?;
    Ok(0)
}

/// Follows a create's or resume's event stream: fetches from the storage bucket move the spinner's byte bar; the
/// result is the sandbox, or the API error it failed with.
async fn start_with_progress(
    spinner: &progress::Spinner,
    mut events: hearth_client::SandboxStartStream,
) -> anyhow::Result<hearth_api::Sandbox> {
    use hearth_api::SandboxStartEvent;
    while let Some(ev) = events.next().await {
        match ev? {
            SandboxStartEvent::Fetch {
                done_bytes,
                total_bytes,
                ..
            } => spinner.fetch(&hearth_api::FetchProgress {
                done_bytes,
                total_bytes,
            }),
            SandboxStartEvent::Done { sandbox } => return Ok(*sandbox),
            SandboxStartEvent::Failed { code, message } => {
                return Err(hearth_client::Error::Api {
                    status: code.http_status(),
                    code,
                    message,
                }
                .into());
            }
        }
    }
    anyhow::bail!("the event stream ended without a result")
}

pub async fn usage(ctx: &Ctx, id: Option<&str>, from: Option<&str>, to: Option<&str>) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let rows = match id {
        Some(id) => {
            let u = client.sandbox_usage(id).await?;
            ctx.emit(&u, || output::usage_table(std::slice::from_ref(&u)))?;
            return Ok(0);
        }
        None => client.usage(from, to).await?,
    };
    ctx.emit(&rows, || output::usage_table(&rows.sandboxes))?;
    Ok(0)
}

pub async fn fork(ctx: &Ctx, id: &str, count: u32) -> anyhow::Result<u8> {
    let spinner = progress::spinner(ctx, format!("forking {} into {count}", output::clean(id)));
    let forked = ctx.client()?.fork_sandbox(id, count).await;
    drop(spinner);
    let forked = forked?;
    ctx.emit(&forked, || {
        forked.sandboxes.iter().map(|s| format!("{}\n", s.id)).collect()
    })?;
    Ok(0)
}

pub async fn snapshot(ctx: &Ctx, id: &str) -> anyhow::Result<u8> {
    let spinner = progress::spinner(ctx, format!("snapshotting {}", output::clean(id)));
    let snap = ctx.client()?.snapshot_sandbox(id).await;
    drop(spinner);
    let snap = snap?;
    ctx.emit(&snap, || format!("{}\n", snap.id))?;
    Ok(0)
}

pub async fn snapshots(ctx: &Ctx) -> anyhow::Result<u8> {
    let list = ctx.client()?.list_snapshots().await?;
    ctx.emit(&list, || {
        let rows: Vec<Vec<String>> = list
            .snapshots
            .iter()
            .map(|s| {
                vec![
                    s.id.clone(),
                    s.sandbox_id.clone(),
                    s.template.clone(),
                    s.size_bytes.to_string(),
                    s.created_at.clone(),
                    output::storage_cell(s.storage.as_ref()),
                ]
            })
            .collect();
        output::table(
            &["ID", "SANDBOX", "TEMPLATE", "BYTES", "CREATED", "STORAGE"],
            &rows,
            output::Style::PLAIN,
        )
    })?;
    Ok(0)
}

pub async fn snapshot_rm(ctx: &Ctx, ids: &[String]) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let mut failed = false;
    for id in ids {
        match client.delete_snapshot(id).await {
            Ok(()) => println!("{}", output::clean(id)),
            Err(e) => {
                eprintln!("hearth: {}: {e}", output::clean(id));
                failed = true;
            }
        }
    }
    Ok(u8::from(failed))
}

pub async fn template(ctx: &Ctx, cmd: crate::args::TemplateCommand) -> anyhow::Result<u8> {
    use crate::args::TemplateCommand;
    let client = ctx.client()?;
    match cmd {
        TemplateCommand::Create { name, from, memory } => {
            let req = hearth_api::CreateTemplateRequest {
                name,
                from_sandbox: Some(from),
                include_memory: memory,
                recipe: None,
            };
            let spinner = progress::spinner(ctx, format!("saving template {}", output::clean(&req.name)));
            let t = client.create_template(&req).await;
            drop(spinner);
            let t = t?;
            ctx.emit(&t, || format!("{}\n", t.name))?;
            Ok(0)
        }
        TemplateCommand::Build { name, recipe } => {
            let text = std::fs::read_to_string(&recipe)
                .map_err(|e| anyhow::anyhow!("reading {}: {e}", recipe.display()))?;
            let recipe: hearth_api::Recipe =
                serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", recipe.display()))?;
            let req = hearth_api::CreateTemplateRequest {
                name,
                recipe: Some(recipe),
                ..Default::default()
            };
            let t = build_template(ctx, &client, &req).await?;
            ctx.emit(&t, || format!("{}\n", t.name))?;
            Ok(0)
        }
        TemplateCommand::Ls => {
            let list = client.list_templates().await?;
            ctx.emit(&list, || {
                let rows: Vec<Vec<String>> = list
                    .templates
                    .iter()
                    .map(|t| {
                        vec![
                            t.name.clone(),
                            if t.builtin { "built-in" } else { "saved" }.to_owned(),
                            if t.snapshot_id.is_some() { "yes" } else { "no" }.to_owned(),
                            t.size_bytes.to_string(),
                            t.from_sandbox.clone().unwrap_or_default(),
                            output::storage_cell(t.storage.as_ref()),
                        ]
                    })
                    .collect();
                output::table(
                    &["NAME", "KIND", "MEMORY", "BYTES", "FROM", "STORAGE"],
                    &rows,
                    output::Style::PLAIN,
                )
            })?;
            Ok(0)
        }
        TemplateCommand::Rm { names } => {
            let mut failed = false;
            for name in &names {
                match client.delete_template(name).await {
                    Ok(()) => println!("{}", output::clean(name)),
                    Err(e) => {
                        eprintln!("hearth: {}: {e}", output::clean(name));
                        failed = true;
                    }
                }
            }
            Ok(u8::from(failed))
        }
    }
}

/// Builds a template from a recipe, showing the daemon's progress events as they come (a bar over the steps and
/// the build log on stderr, see [`progress`]); a failed build is an API error carrying the step's output.
async fn build_template(
    ctx: &Ctx,
    client: &hearth_client::Client,
    req: &hearth_api::CreateTemplateRequest,
) -> anyhow::Result<hearth_api::Template> {
    use hearth_api::TemplateBuildEvent;
    let mut view = BuildView::new(ctx, &req.name);
    let mut events = client.build_template_stream(req);
    while let Some(ev) = events.next().await {
        let ev = ev?;
        view.event(&ev);
        match ev {
            TemplateBuildEvent::Done { template } => return Ok(template),
            TemplateBuildEvent::Failed { code, message } => {
                return Err(hearth_client::Error::Api {
                    status: code.http_status(),
                    code,
                    message,
                }
                .into());
            }
            _ => {}
        }
    }
    anyhow::bail!("the build's event stream ended without a result")
}
