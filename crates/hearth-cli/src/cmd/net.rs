//! `net create|ls|rm|attach|detach|show|policy|log` and `expose`.

use crate::Ctx;
use crate::args::NetCommand;
use crate::output;

pub async fn net(ctx: &Ctx, cmd: NetCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    match cmd {
        NetCommand::Create { name } => {
            let n = client.create_network(&name).await?;
            ctx.emit(&n, || format!("{}\n", n.id))?;
        }
        NetCommand::Ls => {
            let list = client.list_networks().await?;
            ctx.emit(&list, || {
                let rows: Vec<Vec<String>> = list
                    .networks
                    .iter()
                    .map(|n| {
                        vec![
                            n.id.clone(),
                            output::clean(&n.name),
                            n.members.len().to_string(),
                            n.created_at.clone(),
                        ]
                    })
                    .collect();
                output::table(&["ID", "NAME", "MEMBERS", "CREATED"], &rows, ctx.stdout_style())
            })?;
        }
        NetCommand::Rm { names } => {
            let mut failed = false;
            for name in &names {
                match client.delete_network(name).await {
                    Ok(()) => println!("{}", output::clean(name)),
                    Err(e) => {
                        eprintln!("hearth: {}: {e}", output::clean(name));
                        failed = true;
                    }
                }
            }
            return Ok(u8::from(failed));
        }
        NetCommand::Attach { network, id } => {
            let n = client.attach_network(&network, &id).await?;
            ctx.emit(&n, || format!("{} attached to {}\n", output::clean(&id), n.name))?;
        }
        NetCommand::Detach { network, id } => {
            let n = client.detach_network(&network, &id).await?;
            ctx.emit(&n, || {
                format!("{} detached from {}\n", output::clean(&id), n.name)
            })?;
        }
        NetCommand::Show { id } => {
            let n = client.sandbox_network(&id).await?;
            ctx.emit(&n, || {
                output::key_values(&[
                    ("address", n.address.clone()),
                    ("guest address", n.guest_address.clone()),
                    ("egress default", n.egress.default.as_str().to_string()),
                    ("allow", output::clean(&n.egress.allow.join(", "))),
                    ("deny", output::clean(&n.egress.deny.join(", "))),
                    ("networks", output::clean(&n.networks.join(", "))),
                ])
            })?;
        }
        NetCommand::Policy { id, egress, reset } => {
            // No flags must not silently open everything: the default policy needs --reset.
            let policy = match (egress.policy(), reset) {
                (Some(p), _) => p,
                (None, true) => hearth_api::NetworkPolicy::default(),
                (None, false) => anyhow::bail!(
                    "give --allow, --deny or --deny-all (or --reset for the default policy); `hearth net show {}` prints the current one",
                    output::clean(&id)
                ),
            };
            let n = client.set_network_policy(&id, &policy).await?;
            ctx.emit(&n, || format!("{}\n", output::clean(&id)))?;
        }
        NetCommand::Log { id } => {
            let log = client.network_log(&id).await?;
            ctx.emit(&log, || {
                let rows: Vec<Vec<String>> = log
                    .events
                    .iter()
                    .map(|e| {
                        vec![
                            e.at.clone(),
                            e.protocol.as_str().to_string(),
                            output::clean(e.destination.as_deref().unwrap_or("-")),
                            e.port.map_or("-".into(), |p| p.to_string()),
                            output::clean(e.name.as_deref().unwrap_or("-")),
                            if e.allowed { "allow" } else { "deny" }.to_string(),
                            output::clean(&e.reason),
                        ]
                    })
                    .collect();
                output::table(
                    &["AT", "PROTO", "DESTINATION", "PORT", "NAME", "VERDICT", "REASON"],
                    &rows,
                    ctx.stdout_style(),
                )
            })?;
        }
    }
    Ok(0)
}

pub async fn expose(ctx: &Ctx, id: &str, port: u16, ttl: Option<u64>) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let mut t = client.port_token(id, port, ttl).await?;
    // The route is relative to the daemon: print a URL that works as is.
    let base = client.base_url().as_str().trim_end_matches('/').to_string();
    t.url = format!("{base}{}", t.url);
    ctx.emit(&t, || format!("{}\n", t.url))?;
    Ok(0)
}

/// `hearth expose ID PORT --revoke`: the port's tokens issued so far stop working.
pub async fn revoke_port_tokens(ctx: &Ctx, id: &str, port: u16) -> anyhow::Result<u8> {
    ctx.client()?.revoke_port_tokens(id, port).await?;
    eprintln!("hearth: tokens of port {port} revoked");
    Ok(0)
}
