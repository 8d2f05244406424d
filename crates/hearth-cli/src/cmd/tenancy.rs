//! `project create|ls|quota`, `key create|ls|revoke`, `token create`, `audit verify|export`.

use clap::Subcommand;
use hearth_api::{
    CreateKeyRequest, CreateProjectRequest, CreateTokenRequest, ProjectUsage, Quota, Role, TokenPurpose,
    TokenScope,
};

use crate::Ctx;
use crate::output;

#[derive(Debug, Clone, clap::Args)]
pub struct QuotaArgs {
    /// Most sandboxes creating, running or resuming at once.
    #[arg(long)]
    pub max_running: Option<u32>,
    /// Most vCPUs of those sandboxes together.
    #[arg(long)]
    pub max_vcpus: Option<u32>,
    /// Most memory (MiB) of those sandboxes together.
    #[arg(long)]
    pub max_memory_mib: Option<u64>,
    /// Most sandboxes created or forked per rolling minute.
    #[arg(long)]
    pub max_creates_per_minute: Option<u32>,
    /// Seconds a sandbox may exist from its create; older ones are destroyed.
    #[arg(long)]
    pub max_lifetime_s: Option<u64>,
    /// Credits the project may spend (running vCPU-seconds and GiB-seconds at the daemon's prices); once
    /// spent its running sandboxes are paused until it is raised.
    #[arg(long)]
    pub budget_credits: Option<u64>,
    /// Most bytes of disk the project's sandboxes, snapshots and templates may use (suffixes K, M, G, T:
    /// `20G`); at or over it, creates, forks, snapshots and template saves are refused.
    #[arg(long, value_parser = hearth_api::parse_byte_size)]
    pub max_disk_bytes: Option<u64>,
}

impl QuotaArgs {
    fn quota(&self) -> Quota {
        Quota {
            max_running: self.max_running,
            max_vcpus: self.max_vcpus,
            max_memory_mib: self.max_memory_mib,
            max_creates_per_minute: self.max_creates_per_minute,
            max_lifetime_s: self.max_lifetime_s,
            budget_credits: self.budget_credits,
            max_disk_bytes: self.max_disk_bytes,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum ProjectCommand {
    /// Create a project.
    Create {
        name: String,
        #[command(flatten)]
        quota: QuotaArgs,
    },
    /// List projects.
    #[command(alias = "list")]
    Ls,
    /// What a project holds against its quota (running sandboxes, vCPUs, memory, disk, credits).
    Usage { name: String },
    /// Replace a project's quota (limits not given are lifted).
    Quota {
        name: String,
        #[command(flatten)]
        quota: QuotaArgs,
    },
}

#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Create a key; it is printed once (with --json as field `key`, beside `id`).
    Create {
        #[arg(long)]
        project: String,
        /// admin (every project), member (its project's objects) or viewer (read only).
        #[arg(long, value_parser = parse_role)]
        role: Role,
        /// Lifetime: seconds, or a number with s, m, h or d (`30d`).
        #[arg(long, value_parser = parse_duration)]
        expires: Option<u64>,
        /// A label for people.
        #[arg(long)]
        name: Option<String>,
    },
    /// List keys (never the keys themselves).
    #[command(alias = "list")]
    Ls,
    /// Revoke a key, effective at once.
    Revoke { id: String },
}

#[derive(Debug, Subcommand)]
pub enum TokenCommand {
    /// Mint a short-lived token of this key (printed; with --json `{token, expires_at}`). Present it like a key:
    /// `Authorization: Bearer <token>` or the WebSocket subprotocol `hearth.key.<token>`.
    Create {
        /// Only this sandbox (default: the key's whole project).
        #[arg(long)]
        sandbox: Option<String>,
        /// api (the /v1 routes), mcp (/mcp only) or pty (the terminal route only).
        #[arg(long, default_value = "api", value_parser = parse_purpose)]
        purpose: TokenPurpose,
        /// Lifetime: seconds, or a number with s, m or h (default 300 s, at most 1 h).
        #[arg(long, value_parser = parse_duration)]
        ttl: Option<u64>,
        /// At most the key's own role (the default).
        #[arg(long, value_parser = parse_role)]
        role: Option<Role>,
    },
}

fn parse_purpose(s: &str) -> Result<TokenPurpose, String> {
    TokenPurpose::parse(s).ok_or_else(|| format!("unknown purpose {s:?} (api, mcp or pty)"))
}

pub async fn token(ctx: &Ctx, cmd: TokenCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let TokenCommand::Create {
        sandbox,
        purpose,
        ttl,
        role,
    } = cmd;
    let req = CreateTokenRequest {
        scope: sandbox.map_or(TokenScope::Project, TokenScope::Sandbox),
        purpose,
        ttl_s: ttl,
        role,
    };
    let t = client.create_token(&req).await?;
    ctx.emit(&t, || {
        eprintln!("hearth: token valid until {}", t.expires_at);
        format!("{}\n", t.token)
    })?;
    Ok(0)
}

#[derive(Debug, Subcommand)]
pub enum AuditCommand {
    /// Check the audit log's hash chain (fetched whole, or an unfiltered `audit export` file); exits 1 at the
    /// first broken entry.
    Verify {
        /// A JSON Lines export to check instead of the daemon's log.
        #[arg(long, value_name = "PATH")]
        file: Option<std::path::PathBuf>,
    },
    /// Write the audit log as JSON Lines (one entry per line) to stdout, streamed.
    Export {
        /// Entries after this sequence number.
        #[arg(long)]
        after: Option<u64>,
        #[arg(long)]
        project: Option<String>,
        #[arg(long)]
        key_id: Option<String>,
        /// Only entries at or after this unix millisecond.
        #[arg(long)]
        since_ms: Option<i64>,
    },
}

fn parse_role(s: &str) -> Result<Role, String> {
    Role::parse(s).ok_or_else(|| format!("{s:?}: one of admin, member, viewer"))
}

/// `3600`, `90s`, `15m`, `12h`, `30d` → seconds.
pub fn parse_duration(s: &str) -> Result<u64, String> {
    let (num, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?}: a number with s, m, h or d"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => return Err(format!("{s:?}: unit s, m, h or d")),
    };
    n.checked_mul(mult).ok_or_else(|| format!("{s:?}: too long"))
}

/// `used / limit` lines of a project's usage (`-` where there is no limit).
fn usage_text(u: &ProjectUsage) -> String {
    let q = &u.quota;
    let of = |used: String, max: Option<u64>| match max {
        Some(max) => format!("{used} / {max}"),
        None => format!("{used} / -"),
    };
    output::key_values(&[
        ("project", output::clean(&u.project)),
        ("running", of(u.running.to_string(), q.max_running.map(u64::from))),
        ("vcpus", of(u.vcpus.to_string(), q.max_vcpus.map(u64::from))),
        ("memory_mib", of(u.memory_mib.to_string(), q.max_memory_mib)),
        ("disk_bytes", of(u.disk_bytes.to_string(), q.max_disk_bytes)),
        (
            "spent_credits",
            of(format!("{:.1}", u.spent_credits), q.budget_credits),
        ),
        (
            "max_lifetime_s",
            q.max_lifetime_s.map_or("-".into(), |s| s.to_string()),
        ),
        (
            "max_creates_per_minute",
            q.max_creates_per_minute.map_or("-".into(), |n| n.to_string()),
        ),
    ])
}

pub async fn project(ctx: &Ctx, cmd: ProjectCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    match cmd {
        ProjectCommand::Create { name, quota } => {
            let req = CreateProjectRequest {
                name,
                quota: quota.quota(),
            };
            let p = client.create_project(&req).await?;
            ctx.emit(&p, || format!("{}\n", p.name))?;
        }
        ProjectCommand::Ls => {
            let list = client.list_projects().await?;
            ctx.emit(&list, || {
                let rows: Vec<Vec<String>> = list
                    .projects
                    .iter()
                    .map(|p| {
                        let q = &p.quota;
                        let opt = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
                        vec![
                            output::clean(&p.name),
                            opt(q.max_running.map(u64::from)),
                            opt(q.max_vcpus.map(u64::from)),
                            opt(q.max_memory_mib),
                            opt(q.max_creates_per_minute.map(u64::from)),
                            p.created_at.clone(),
                        ]
                    })
                    .collect();
                let headers = ["NAME", "RUNNING", "VCPUS", "MEMORY_MIB", "CREATES/MIN", "CREATED"];
                output::table(&headers, &rows, ctx.stdout_style())
            })?;
        }
        ProjectCommand::Usage { name } => {
            let u = client.project_usage(&name).await?;
            ctx.emit(&u, || usage_text(&u))?;
        }
        ProjectCommand::Quota { name, quota } => {
            let p = client.set_quota(&name, &quota.quota()).await?;
            ctx.emit(&p, || format!("{}\n", p.name))?;
        }
    }
    Ok(0)
}

pub async fn key(ctx: &Ctx, cmd: KeyCommand) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    match cmd {
        KeyCommand::Create {
            project,
            role,
            expires,
            name,
        } => {
            let req = CreateKeyRequest {
                project,
                role,
                expires_in_s: expires,
                name,
            };
            let k = client.create_key(&req).await?;
            ctx.emit(&k, || {
                eprintln!("hearth: key {} (shown only now; keep it)", k.id);
                format!("{}\n", k.key)
            })?;
        }
        KeyCommand::Ls => {
            let list = client.list_keys().await?;
            ctx.emit(&list, || {
                let rows: Vec<Vec<String>> = list
                    .keys
                    .iter()
                    .map(|k| {
                        let state = if k.revoked_at.is_some() {
                            "revoked"
                        } else {
                            "active"
                        };
                        vec![
                            k.id.clone(),
                            output::clean(&k.project),
                            k.role.as_str().to_string(),
                            state.to_string(),
                            k.expires_at.clone().unwrap_or_else(|| "-".into()),
                            k.last_used_at.clone().unwrap_or_else(|| "-".into()),
                        ]
                    })
                    .collect();
                let headers = ["ID", "PROJECT", "ROLE", "STATE", "EXPIRES", "LAST USED"];
                output::table(&headers, &rows, ctx.stdout_style())
            })?;
        }
        KeyCommand::Revoke { id } => {
            client.revoke_key(&id).await?;
            println!("{}", output::clean(&id));
        }
    }
    Ok(0)
}

pub async fn audit(ctx: &Ctx, cmd: AuditCommand) -> anyhow::Result<u8> {
    match cmd {
        AuditCommand::Export {
            after,
            project,
            key_id,
            since_ms,
        } => {
            let mut filters = Vec::new();
            filters.extend(after.map(|v| ("after", v.to_string())));
            filters.extend(project.map(|v| ("project", v)));
            filters.extend(key_id.map(|v| ("key_id", v)));
            filters.extend(since_ms.map(|v| ("since_ms", v.to_string())));
            let mut out = tokio::io::stdout();
            ctx.client()?.audit_export(&filters, &mut out).await?;
            Ok(0)
        }
        AuditCommand::Verify { file } => {
            let entries = match file {
                Some(path) => read_export(&path)?,
                None => ctx.client()?.audit_all().await?,
            };
            match hearth_client::tenancy::verify_audit_log(&entries) {
                Ok(last) => {
                    println!("ok: {} entries, last hash {last}", entries.len());
                    Ok(0)
                }
                Err(e) => {
                    eprintln!("hearth: {e}");
                    Ok(1)
                }
            }
        }
    }
}

/// The entries of a JSON Lines export, in file order.
fn read_export(path: &std::path::Path) -> anyhow::Result<Vec<hearth_api::AuditEntry>> {
    use anyhow::Context;
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            serde_json::from_str(line).with_context(|| format!("{} line {}", path.display(), i + 1))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("3600"), Ok(3600));
        assert_eq!(parse_duration("30d"), Ok(30 * 86_400));
        assert_eq!(parse_duration("15m"), Ok(900));
        assert!(parse_duration("1w").is_err());
        assert!(parse_duration("h").is_err());
    }
}
