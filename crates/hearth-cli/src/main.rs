//! `hearth`: the command-line client for hearthd.
//!
//! # Layout
//! - [`args`]: the clap command line and its small parsers (`K=V`, `ID:PATH`, signals, cmd vs argv).
//! - `cmd/`: one module per group of commands: [`cmd::sandbox`] (create/ls/info/rm/timeout), [`cmd::exec`]
//!   (exec/ps/wait/kill), [`cmd::shell`] (interactive terminal), [`cmd::files`] (cp and `files ...`),
//!   [`cmd::system`] (system, doctor).
//! - [`output`]: tables, key/value blocks, times and colour; pure functions, snapshot-tested.
//! - [`progress`]: spinners and the template build bar on stderr (terminal only, not with `--json`).
//! - [`report`]: how errors are printed (message, stable code, hint).
//!
//! Output rules: stdout carries data only (ids, tables, JSON with `--json`, command output as raw bytes);
//! spinners, warnings and errors go to stderr. Exit status 0 on success, 1 on failure; `exec`, `wait` and
//! `shell` pass the guest command's status through and use 125 for their own failures.

mod args;
mod cmd;
mod output;
mod progress;
mod report;

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{CommandFactory, Parser};

use args::{Cli, Command};

/// Exit status when `exec`/`wait` fail on hearth's side (as `docker run` and `timeout` do), so it cannot be
/// mistaken for the guest command's own status.
const EXEC_FAILURE: u8 = 125;

/// What every command gets: the global flags and a way to make a client.
pub struct Ctx {
    pub url: String,
    api_key: Option<String>,
    pub json: bool,
}

impl Ctx {
    /// A client for `--url`, with `--api-key` or else the key file, when this user can read it.
    pub fn client(&self) -> anyhow::Result<hearth_client::Client> {
        let key = self
            .api_key
            .clone()
            .filter(|k| !k.trim().is_empty())
            .or_else(|| hearth_client::read_key_file(&hearth_client::default_key_path()));
        let client = match key {
            Some(key) => hearth_client::Client::new(&self.url, key.trim())?,
            None => hearth_client::Client::without_key(&self.url)?,
        };
        Ok(client)
    }

    /// Style for text written to stdout.
    pub fn stdout_style(&self) -> output::Style {
        output::Style::for_stream(std::io::stdout().is_terminal())
    }

    /// Prints `text` on stdout, or `value` as JSON with `--json`.
    pub fn emit<T: serde::Serialize>(&self, value: &T, text: impl FnOnce() -> String) -> anyhow::Result<()> {
        let out = if self.json { output::json(value)? } else { text() };
        print!("{out}");
        Ok(())
    }
}

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = Cli::parse();
    let ctx = Ctx {
        url: cli.url.clone(),
        api_key: cli.api_key.clone(),
        json: cli.json,
    };
    let failure = match cli.command {
        Command::Exec(_) | Command::Wait { .. } | Command::Shell(_) => EXEC_FAILURE,
        _ => 1,
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::from(failure);
        }
    };
    match runtime.block_on(run(&ctx, cli.command)) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            report::print(&err, &ctx.url);
            ExitCode::from(failure)
        }
    }
}

async fn run(ctx: &Ctx, command: Command) -> anyhow::Result<u8> {
    match command {
        Command::Create(a) => cmd::sandbox::create(ctx, a).await,
        Command::Ls(a) => cmd::sandbox::list(ctx, a).await,
        Command::Info { id } => cmd::sandbox::info(ctx, &id).await,
        Command::Rm { ids } => cmd::sandbox::remove(ctx, &ids).await,
        Command::Timeout { id, seconds } => cmd::sandbox::timeout(ctx, &id, seconds).await,
        Command::Pause { id } => cmd::sandbox::pause(ctx, &id).await,
        Command::Sync { id, wait } => cmd::storage::sync(ctx, &id, wait).await,
        Command::Template(t) => cmd::sandbox::template(ctx, t).await,
        Command::Fork { id, count } => cmd::sandbox::fork(ctx, &id, count).await,
        Command::Snapshot { id } => cmd::sandbox::snapshot(ctx, &id).await,
        Command::Snapshots => cmd::sandbox::snapshots(ctx).await,
        Command::SnapshotRm { ids } => cmd::sandbox::snapshot_rm(ctx, &ids).await,
        Command::Resume { id } => cmd::sandbox::resume(ctx, &id).await,
        Command::Inspect { id } => cmd::inspect::inspect(ctx, &id).await,
        Command::Usage { id, from, to } => {
            cmd::sandbox::usage(ctx, id.as_deref(), from.as_deref(), to.as_deref()).await
        }
        Command::Exec(a) => cmd::exec::exec(ctx, a).await,
        Command::Shell(a) => cmd::shell::shell(ctx, a).await,
        Command::Ps { id } => cmd::exec::ps(ctx, &id).await,
        Command::Wait { id, pid, timeout } => cmd::exec::wait(ctx, &id, pid, timeout).await,
        Command::Kill { id, pid, signal } => cmd::exec::kill(ctx, &id, pid, signal).await,
        Command::Cp { src, dst } => cmd::files::cp(ctx, &src, &dst).await,
        Command::Files(f) => cmd::files::files(ctx, f).await,
        Command::System => cmd::system::system(ctx).await,
        Command::Doctor => cmd::system::doctor(ctx).await,
        Command::Mcp => cmd::mcp::serve(ctx).await,
        Command::Net(n) => cmd::net::net(ctx, n).await,
        Command::Bucket(b) => cmd::buckets::bucket(ctx, b).await,
        Command::Storage(s) => cmd::storage::storage(ctx, s).await,
        Command::Mount { id, mount } => cmd::buckets::mount(ctx, &id, &mount).await,
        Command::Unmount { id, path } => cmd::buckets::unmount(ctx, &id, &path).await,
        Command::Mounts { id } => cmd::buckets::mounts(ctx, &id).await,
        Command::Project(c) => cmd::tenancy::project(ctx, c).await,
        Command::Key(c) => cmd::tenancy::key(ctx, c).await,
        Command::Token(c) => cmd::tenancy::token(ctx, c).await,
        Command::Audit(c) => cmd::tenancy::audit(ctx, c).await,
        Command::Expose {
            id,
            port,
            revoke: true,
            ..
        } => cmd::net::revoke_port_tokens(ctx, &id, port).await,
        Command::Expose { id, port, ttl, .. } => cmd::net::expose(ctx, &id, port, ttl).await,
        Command::Completions { shell } => {
            let mut command = Cli::command();
            let mut stdout = std::io::stdout();
            clap_complete::generate(shell, &mut command, "hearth", &mut stdout);
            use std::io::Write;
            stdout.flush().context("cannot write the completion script")?;
            Ok(0)
        }
    }
}

/// Rust ignores SIGPIPE, which turns `hearth exec ID cat big | head` into an EPIPE error message. A CLI that
/// writes to pipes should die quietly like other Unix tools instead.
fn restore_sigpipe() {
    // SAFETY: called first thing in main, before any other thread exists; SIG_DFL is a valid disposition
    // for SIGPIPE and no Rust code relies on it being ignored after this point.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
