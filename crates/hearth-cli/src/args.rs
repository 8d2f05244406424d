//! The command line: clap definitions and the small parsers behind them (`K=V`, `ID:PATH`, signals, cmd vs
//! argv).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use hearth_api::SandboxState;

/// hearth: sandboxes for AI agents, each a microVM with its own kernel.
///
/// stdout carries data (ids, tables, JSON with --json, command output); messages go to stderr.
#[derive(Debug, Parser)]
#[command(name = "hearth", version, propagate_version = true)]
pub struct Cli {
    /// hearthd's URL.
    #[arg(long, global = true, env = "HEARTH_URL", default_value = hearth_client::DEFAULT_URL)]
    pub url: String,
    /// API key; when unset, the key file `$HEARTH_DATA_DIR/api-key` (default /var/lib/hearth/api-key) is
    /// used if this user can read it.
    #[arg(long, global = true, env = "HEARTH_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a sandbox and print its id.
    Create(CreateArgs),
    /// List sandboxes.
    #[command(alias = "list")]
    Ls(LsArgs),
    /// Show one sandbox.
    Info { id: String },
    /// Destroy sandboxes.
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Set a sandbox's remaining lifetime, counted from now.
    Timeout { id: String, seconds: u64 },
    /// Pause a sandbox to zero: its memory and processes are saved to disk and its VM process ends.
    Pause { id: String },
    /// Resume a paused sandbox where it was (commands and file operations also resume it by themselves
    /// unless it was created with `--no-auto-resume`).
    Resume { id: String },
    /// Sync a running sandbox's disk to the storage bucket (it keeps running; its vCPUs stop only while the
    /// disk is copied). `hearth create --from-sync ID` starts a new sandbox from the last synced disk.
    Sync {
        id: String,
        /// Wait until the bucket holds the image (default: return once it is captured; it uploads in the
        /// background).
        #[arg(long)]
        wait: bool,
    },
    /// Fork a running sandbox into N children that continue its processes, memory and files.
    Fork {
        id: String,
        /// Number of children (1-16).
        #[arg(long, short = 'n', default_value_t = 1)]
        count: u32,
    },
    /// Checkpoint a running sandbox into a snapshot (it continues); `hearth create --snapshot` starts from it.
    Snapshot { id: String },
    /// List snapshots.
    Snapshots,
    /// Delete snapshots (refused while sandboxes created from them exist).
    SnapshotRm {
        #[arg(required = true)]
        ids: Vec<String>,
    },
    /// Templates: save a sandbox as one, list, delete.
    #[command(subcommand)]
    Template(TemplateCommand),
    /// Show the boundary around a sandbox as the host reports it now: its VMM process (uid, chroot, seccomp,
    /// capabilities, namespaces, cgroup limits), the guest kernel, the enforced egress policy and its mounts.
    Inspect { id: String },
    /// Show usage: one sandbox's since its creation, or every sandbox's within a window.
    Usage {
        /// One sandbox; all when omitted.
        id: Option<String>,
        /// Window start (RFC 3339 or unix seconds; default 24 hours before `--to`).
        #[arg(long)]
        from: Option<String>,
        /// Window end (RFC 3339 or unix seconds; default now).
        #[arg(long)]
        to: Option<String>,
    },
    /// Run a command in a sandbox, streaming its output; exits with the command's exit code.
    ///
    /// One argument containing spaces or shell syntax runs through `/bin/sh -c`; several arguments run as
    /// a program and its arguments. Exit status: the command's; 128+N when killed by signal N; 124 when its
    /// timeout expired; 125 when hearth itself failed.
    Exec(ExecArgs),
    /// Open an interactive terminal in a sandbox: its shell, or CMD; exits with the program's exit code.
    ///
    /// The local terminal is in raw mode: every key goes to the guest (Ctrl-C interrupts the guest's
    /// program). The guest's terminal follows this window's size. A paused sandbox is resumed.
    Shell(ShellArgs),
    /// List the processes started in a sandbox.
    Ps { id: String },
    /// Wait for a background process and print its output tail; exits with its exit code.
    Wait {
        id: String,
        pid: u32,
        /// Give up after this many seconds (error `conflict` if it still runs).
        #[arg(long)]
        timeout: Option<u64>,
    },
    /// Send a signal to a process (default KILL).
    Kill {
        id: String,
        pid: u32,
        /// Signal number or name (TERM, SIGINT, 15, ...).
        #[arg(long, short, value_parser = parse_signal)]
        signal: Option<i32>,
    },
    /// Copy a file into, out of, or between sandboxes: `hearth cp ./a ID:/root/a`, `hearth cp ID:/etc/os-release -`.
    ///
    /// `ID:PATH` names a file in a sandbox (the remote path must be absolute); `-` is stdin or stdout;
    /// anything else is a local path (write `./a:b` for a local name containing a colon).
    Cp { src: String, dst: String },
    /// Files in a sandbox.
    #[command(subcommand)]
    Files(FilesCommand),
    /// Show the daemon's VMM, host checks and capacity.
    System,
    /// Check this host can run sandboxes (works without a daemon).
    Doctor,
    /// Print a shell completion script.
    Completions { shell: clap_complete::Shell },
    /// Networks: egress policy, audit log, private networks.
    #[command(subcommand)]
    Net(NetCommand),
    /// Open a guest port through the daemon: prints a URL carrying a signed, expiring token.
    Expose {
        id: String,
        port: u16,
        /// Seconds the URL stays valid (default 3600).
        #[arg(long)]
        ttl: Option<u64>,
        /// Revoke every token issued so far for the port instead (their URLs stop working at once).
        #[arg(long, conflicts_with = "ttl")]
        revoke: bool,
    },
    /// Serve hearth's tools to an AI agent over MCP on stdin/stdout (uses --url and the API key like every
    /// command; see docs/mcp.md).
    Mcp,
    /// Buckets (S3, MinIO, R2) registered as named credentials: add, ls, show, rm.
    #[command(subcommand)]
    Bucket(BucketCommand),
    /// Mount a registered bucket in a running sandbox: `hearth mount ID BUCKET[:PREFIX]:PATH[:ro]`.
    Mount {
        id: String,
        #[arg(value_name = "BUCKET[:PREFIX]:PATH[:ro]", value_parser = hearth_client::buckets::parse_mount)]
        mount: hearth_api::MountSpec,
    },
    /// Unmount PATH in a sandbox (written data reaches the bucket first).
    Unmount { id: String, path: String },
    /// List the buckets mounted in a sandbox, with the bytes moved through each.
    Mounts { id: String },
    /// Projects (admin): create, ls, quota.
    #[command(subcommand)]
    Project(crate::cmd::tenancy::ProjectCommand),
    /// API keys scoped to a project and role (admin): create, ls, revoke.
    #[command(subcommand)]
    Key(crate::cmd::tenancy::KeyCommand),
    /// Short-lived access tokens for browsers and WebSocket clients: create.
    #[command(subcommand)]
    Token(crate::cmd::tenancy::TokenCommand),
    /// The audit log (admin): verify its hash chain.
    #[command(subcommand)]
    Audit(crate::cmd::tenancy::AuditCommand),
    /// The daemon's storage bucket (`hearthd --storage`): status (health, pending uploads, where each paused
    /// sandbox, snapshot and template lives) and garbage collection.
    #[command(subcommand)]
    Storage(StorageCommand),
}

#[derive(Debug, Subcommand)]
pub enum StorageCommand {
    /// Bucket, health, pending uploads and deletes, and each stored object's sync state and location.
    Status,
    /// Run one garbage-collection pass now (chunks no manifest references are deleted).
    Gc {
        /// Keep unreferenced chunks younger than this many seconds (default: the daemon's setting).
        #[arg(long)]
        grace_s: Option<u64>,
    },
}

#[derive(Debug, Subcommand)]
pub enum BucketCommand {
    /// Register a bucket under NAME (the daemon probes it; the secret is stored encrypted, never shown).
    ///
    /// The keys come from --access-key-id/--secret-access-key or, better (they do not show in `ps`), from
    /// AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY.
    Add {
        name: String,
        /// `s3://BUCKET[/PREFIX]`.
        #[arg(value_name = "URL")]
        bucket_url: String,
        /// Endpoint of a non-AWS service (MinIO, R2: `https://ACCOUNT.r2.cloudflarestorage.com`).
        #[arg(long)]
        endpoint: Option<String>,
        /// Region (default us-east-1; R2: auto).
        #[arg(long)]
        region: Option<String>,
        /// Path-style addressing (default: on with --endpoint).
        #[arg(long)]
        path_style: Option<bool>,
        #[arg(long, env = "AWS_ACCESS_KEY_ID", hide_env_values = true)]
        access_key_id: String,
        #[arg(long, env = "AWS_SECRET_ACCESS_KEY", hide_env_values = true)]
        secret_access_key: String,
    },
    /// List registered buckets.
    #[command(alias = "list")]
    Ls,
    /// Show one bucket and who mounts it.
    Show { name: String },
    /// Forget buckets (refused while mounted).
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum TemplateCommand {
    /// Save a sandbox's root filesystem as a template (with `--memory` also its running processes).
    Create {
        name: String,
        /// The sandbox to save.
        #[arg(long = "from")]
        from: String,
        /// Keep its memory too: sandboxes of the template start by restore with its processes running.
        #[arg(long)]
        memory: bool,
    },
    /// Build a template from a recipe file (JSON: `{"base", "steps": [...], "env"?, "start_cmd"?, "ready_cmd"?}`).
    Build {
        name: String,
        #[arg(long)]
        recipe: std::path::PathBuf,
    },
    /// List built-in and saved templates.
    Ls,
    /// Delete saved templates.
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum NetCommand {
    /// Create a private network.
    Create { name: String },
    /// List private networks and their members.
    Ls,
    /// Delete private networks (refused while sandboxes are attached).
    Rm {
        #[arg(required = true)]
        names: Vec<String>,
    },
    /// Attach a sandbox to a private network.
    Attach { network: String, id: String },
    /// Detach a sandbox from a private network.
    Detach { network: String, id: String },
    /// Show a sandbox's address, egress policy and networks.
    Show { id: String },
    /// Replace a sandbox's egress policy (effective at once). Give at least one of --allow, --deny, --deny-all,
    /// or --reset to go back to the default (everything allowed but the always-denied destinations).
    Policy {
        id: String,
        #[command(flatten)]
        egress: EgressArgs,
        /// Back to the default policy: allow all, no rules.
        #[arg(long, conflicts_with_all = ["allow", "deny", "deny_all"])]
        reset: bool,
    },
    /// Show a sandbox's egress audit log.
    Log { id: String },
}

/// Egress policy flags.
#[derive(Debug, Args, Default)]
pub struct EgressArgs {
    /// Allow a destination: CIDR, address, domain or `*.domain` (repeatable).
    #[arg(long = "allow", value_name = "RULE")]
    pub allow: Vec<String>,
    /// Deny a destination (repeatable; wins over --allow).
    #[arg(long = "deny", value_name = "RULE")]
    pub deny: Vec<String>,
    /// Deny everything --allow does not name (default: allow everything --deny does not name).
    #[arg(long)]
    pub deny_all: bool,
}

impl EgressArgs {
    /// The policy, or `None` when no flag was given.
    pub fn policy(&self) -> Option<hearth_api::NetworkPolicy> {
        if self.allow.is_empty() && self.deny.is_empty() && !self.deny_all {
            return None;
        }
        Some(hearth_api::NetworkPolicy {
            egress: hearth_api::EgressPolicy {
                default: if self.deny_all {
                    hearth_api::EgressDefault::Deny
                } else {
                    hearth_api::EgressDefault::Allow
                },
                allow: self.allow.clone(),
                deny: self.deny.clone(),
            },
        })
    }
}

#[derive(Debug, Args)]
pub struct CreateArgs {
    /// Template (root filesystem); the daemon's default when omitted.
    #[arg(long, short)]
    pub template: Option<String>,
    /// Virtual CPUs.
    #[arg(long)]
    pub vcpus: Option<u32>,
    /// Guest memory in MiB.
    #[arg(long)]
    pub memory: Option<u32>,
    /// Seconds until the sandbox is destroyed.
    #[arg(long)]
    pub timeout: Option<u64>,
    /// Environment variable for every command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Metadata label (repeatable), usable as a filter with `ls --meta`.
    #[arg(long = "meta", short = 'm', value_name = "K=V", value_parser = parse_kv)]
    pub meta: Vec<(String, String)>,
    /// Commands and file operations on the paused sandbox fail instead of resuming it.
    #[arg(long)]
    pub no_auto_resume: bool,
    /// When the timeout passes, pause the sandbox instead of destroying it.
    #[arg(long)]
    pub pause_on_timeout: bool,
    /// Start from this snapshot (`snp_...`, see `hearth snapshot`) instead of booting a template.
    #[arg(long)]
    pub snapshot: Option<String>,
    #[command(flatten)]
    pub egress: EgressArgs,
    /// Attach to this private network (repeatable).
    #[arg(long = "network", value_name = "NETWORK")]
    pub networks: Vec<String>,
    /// A name peers on its private networks resolve (`<name>.<network>.internal`).
    #[arg(long)]
    pub name: Option<String>,
    /// Mount a registered bucket (repeatable): `BUCKET[:PREFIX]:PATH[:ro]`, e.g. `data:runs/42/:/mnt/in:ro`.
    #[arg(long = "mount", value_name = "BUCKET[:PREFIX]:PATH[:ro]", value_parser = hearth_client::buckets::parse_mount)]
    pub mounts: Vec<hearth_api::MountSpec>,
    /// Sync the sandbox's disk to the storage bucket every SECONDS while it runs (at least 60; needs
    /// `hearthd --storage`).
    #[arg(long, value_name = "SECONDS")]
    pub disk_sync_interval: Option<u64>,
    /// Create a new sandbox (cold boot, same template and shape) from the last synced disk of this sandbox.
    #[arg(long, value_name = "ID")]
    pub from_sync: Option<String>,
}

#[derive(Debug, Args)]
pub struct LsArgs {
    /// Only sandboxes in this state (creating, running, stopping, failed, pausing, paused, resuming).
    #[arg(long, value_parser = parse_state)]
    pub state: Option<SandboxState>,
    /// Only sandboxes with this metadata pair (repeatable; all must match).
    #[arg(long = "meta", short = 'm', value_name = "K=V", value_parser = parse_kv)]
    pub meta: Vec<(String, String)>,
}

#[derive(Debug, Args)]
pub struct ExecArgs {
    pub id: String,
    /// Working directory in the guest.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Environment variable (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Kill the command after this many seconds.
    #[arg(long)]
    pub timeout: Option<u64>,
    /// Send this process's stdin (UTF-8 text) to the command.
    #[arg(long, short = 'i')]
    pub stdin: bool,
    /// Start the command in the background and print its pid.
    #[arg(long, short = 'b', conflicts_with = "stdin")]
    pub background: bool,
    /// The command: one shell command line, or a program and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<String>,
}

#[derive(Debug, Subcommand)]
pub enum FilesCommand {
    /// List a directory.
    Ls {
        id: String,
        #[arg(default_value = "/")]
        path: String,
    },
    /// Show a file's metadata.
    Stat { id: String, path: String },
    /// Create a directory and its missing parents.
    Mkdir { id: String, path: String },
    /// Remove a file, or a directory with -r.
    Rm {
        id: String,
        path: String,
        /// Remove a directory and everything in it.
        #[arg(long, short)]
        recursive: bool,
    },
    /// Rename or move a path.
    Mv { id: String, from: String, to: String },
    /// Print a directory's changes as they happen, one line each (`--json`: one JSON object per line), until
    /// interrupted or the directory is removed.
    Watch {
        id: String,
        path: String,
        /// Watch subdirectories too, including new ones.
        #[arg(long, short)]
        recursive: bool,
    },
}

/// `KEY=VALUE`, split at the first `=`; the key may not be empty.
pub fn parse_kv(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
        _ => Err(format!("expected KEY=VALUE, got {s:?}")),
    }
}

fn parse_state(s: &str) -> Result<SandboxState, String> {
    SandboxState::parse(s).ok_or_else(|| {
        format!("unknown state {s:?} (creating, running, stopping, failed, pausing, paused, resuming)")
    })
}

/// Signal numbers by name, the ones worth sending to a guest process.
const SIGNALS: [(&str, i32); 12] = [
    ("HUP", 1),
    ("INT", 2),
    ("QUIT", 3),
    ("ABRT", 6),
    ("KILL", 9),
    ("USR1", 10),
    ("USR2", 12),
    ("PIPE", 13),
    ("ALRM", 14),
    ("TERM", 15),
    ("CONT", 18),
    ("STOP", 19),
];

/// A signal as a number (1-64) or a name, with or without `SIG`, any case.
pub fn parse_signal(s: &str) -> Result<i32, String> {
    if let Ok(n) = s.parse::<i32>() {
        return if (1..=64).contains(&n) {
            Ok(n)
        } else {
            Err(format!("signal number {n} is out of range 1-64"))
        };
    }
    let upper = s.to_ascii_uppercase();
    let name = upper.strip_prefix("SIG").unwrap_or(&upper);
    SIGNALS
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, num)| *num)
        .ok_or_else(|| format!("unknown signal {s:?}"))
}

/// How a command is sent to the guest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommandSpec {
    /// A shell command line (`/bin/sh -c`).
    Shell(String),
    /// A program and its arguments, no shell.
    Argv(Vec<String>),
}

/// One argument with whitespace or shell syntax is a shell command line; anything else is argv.
#[derive(Debug, Args)]
pub struct ShellArgs {
    pub id: String,
    /// Working directory in the guest.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Environment variable (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// The program to run instead of the shell: one shell command line, or a program and its arguments.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, value_name = "CMD")]
    pub command: Vec<String>,
}

pub fn command_spec(args: &[String]) -> CommandSpec {
    match args {
        [one] if needs_shell(one) => CommandSpec::Shell(one.clone()),
        _ => CommandSpec::Argv(args.to_vec()),
    }
}

fn needs_shell(s: &str) -> bool {
    s.chars()
        .any(|c| c.is_whitespace() || "|&;<>()$`\\\"'*?[]{}~#".contains(c))
}

/// One side of `hearth cp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// `-`: stdin as a source, stdout as a destination.
    Stdio,
    Local(PathBuf),
    Remote {
        id: String,
        path: String,
    },
}

impl Location {
    /// `ID:PATH` when a colon comes before any slash (as scp does), `-`, else a local path.
    pub fn parse(s: &str) -> Result<Location, String> {
        if s == "-" {
            return Ok(Location::Stdio);
        }
        if let Some((id, path)) = s.split_once(':')
            && !id.contains('/')
        {
            if id.is_empty() {
                return Err(format!("{s:?}: missing sandbox id before ':'"));
            }
            if !path.starts_with('/') {
                return Err(format!(
                    "{s:?}: the path in a sandbox must be absolute (e.g. {id}:/root/{path})"
                ));
            }
            return Ok(Location::Remote {
                id: id.to_owned(),
                path: path.to_owned(),
            });
        }
        if s.is_empty() {
            return Err("empty path".into());
        }
        Ok(Location::Local(PathBuf::from(s)))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("hearth").chain(args.iter().copied()))
    }

    #[test]
    fn clap_definitions_are_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn key_values() {
        assert_eq!(parse_kv("A=b=c").unwrap(), ("A".into(), "b=c".into()));
        assert_eq!(parse_kv("A=").unwrap(), ("A".into(), String::new()));
        assert!(parse_kv("=x").is_err());
        assert!(parse_kv("novalue").is_err());
        let cli = parse(&["create", "-e", "X=1", "--env", "Y=2", "--meta", "owner=me"]).unwrap();
        let Command::Create(c) = cli.command else {
            panic!("not create")
        };
        assert_eq!(c.env, vec![("X".into(), "1".into()), ("Y".into(), "2".into())]);
        assert_eq!(c.meta, vec![("owner".into(), "me".into())]);
        assert!(parse(&["create", "--env", "oops"]).is_err());
    }

    #[test]
    fn cmd_or_argv() {
        let s = |v: &[&str]| command_spec(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        assert_eq!(s(&["uname -r"]), CommandSpec::Shell("uname -r".into()));
        assert_eq!(s(&["echo $HOME"]), CommandSpec::Shell("echo $HOME".into()));
        assert_eq!(s(&["ls|wc"]), CommandSpec::Shell("ls|wc".into()));
        assert_eq!(s(&["ls"]), CommandSpec::Argv(vec!["ls".into()]));
        assert_eq!(
            s(&["sh", "-c", "exit 7"]),
            CommandSpec::Argv(vec!["sh".into(), "-c".into(), "exit 7".into()])
        );
    }

    #[test]
    fn exec_takes_everything_after_the_id_as_the_command() {
        let cli = parse(&["exec", "sbx_1", "--cwd", "/tmp", "--", "ls", "-la", "--json"]).unwrap();
        let Command::Exec(e) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(e.cwd.as_deref(), Some("/tmp"));
        assert_eq!(e.command, vec!["ls", "-la", "--json"]);
        assert!(!cli.json, "--json after the command belongs to the command");

        let cli = parse(&["--json", "exec", "sbx_1", "ls", "-l"]).unwrap();
        let Command::Exec(e) = cli.command else {
            panic!("not exec")
        };
        assert_eq!(e.command, vec!["ls", "-l"]);
        assert!(cli.json);
        assert!(parse(&["exec", "sbx_1"]).is_err(), "a command is required");
    }

    #[test]
    fn locations() {
        assert_eq!(Location::parse("-").unwrap(), Location::Stdio);
        assert_eq!(
            Location::parse("sbx_0123456789abcdef:/root/a:b").unwrap(),
            Location::Remote {
                id: "sbx_0123456789abcdef".into(),
                path: "/root/a:b".into()
            }
        );
        assert_eq!(
            Location::parse("./a:b").unwrap(),
            Location::Local(PathBuf::from("./a:b"))
        );
        assert_eq!(
            Location::parse("/tmp/x").unwrap(),
            Location::Local(PathBuf::from("/tmp/x"))
        );
        assert!(
            Location::parse("sbx_1:relative")
                .unwrap_err()
                .contains("absolute")
        );
        assert!(Location::parse(":/x").is_err());
        assert!(Location::parse("").is_err());
    }

    #[test]
    fn signals() {
        assert_eq!(parse_signal("15").unwrap(), 15);
        assert_eq!(parse_signal("term").unwrap(), 15);
        assert_eq!(parse_signal("SIGKILL").unwrap(), 9);
        assert!(parse_signal("0").is_err());
        assert!(parse_signal("SIGFOO").is_err());
        let cli = parse(&["kill", "sbx_1", "12", "--signal", "INT"]).unwrap();
        assert!(matches!(
            cli.command,
            Command::Kill {
                pid: 12,
                signal: Some(2),
                ..
            }
        ));
    }

    #[test]
    fn ls_filters() {
        let cli = parse(&["ls", "--state", "running", "--meta", "a=b"]).unwrap();
        let Command::Ls(l) = cli.command else {
            panic!("not ls")
        };
        assert_eq!(l.state, Some(SandboxState::Running));
        assert!(parse(&["ls", "--state", "sleeping"]).is_err());
    }
}
