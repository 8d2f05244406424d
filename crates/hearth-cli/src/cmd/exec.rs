//! `exec`, `ps`, `wait`, `kill`.

use anyhow::{Context as _, bail};
use futures::StreamExt;
use hearth_api::{CommandEvent, CommandResult, RunCommandRequest};
use hearth_client::decode_output;
use tokio::io::{AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::Ctx;
use crate::args::{CommandSpec, ExecArgs, command_spec};
use crate::output;

/// Exit status when the command's timeout expired (as coreutils `timeout` does).
const TIMED_OUT: u8 = 124;

/// Largest stdin `--stdin` sends: the request carries it as one JSON string.
const MAX_STDIN: u64 = 16 * 1024 * 1024;

/// The request `hearth exec` sends for these arguments (without stdin).
pub fn build_request(a: &ExecArgs) -> RunCommandRequest {
    let (cmd, argv) = match command_spec(&a.command) {
        CommandSpec::Shell(line) => (Some(line), None),
        CommandSpec::Argv(argv) => (None, Some(argv)),
    };
    RunCommandRequest {
        cmd,
        argv,
        env: a.env.iter().cloned().collect(),
        cwd: a.cwd.clone(),
        stdin: None,
        keep_stdin_open: false,
        timeout_s: a.timeout,
        background: a.background,
    }
}

/// The local exit status for a guest command's end: its code, 128+N for signal N.
pub fn exit_status(exit_code: i32, signal: Option<i32>) -> u8 {
    let code = match signal {
        Some(sig) => 128 + sig,
        None => exit_code,
    };
    u8::try_from(code).unwrap_or(255)
}

async fn read_stdin() -> anyhow::Result<String> {
    let mut buf = Vec::new();
    tokio::io::stdin()
        .take(MAX_STDIN + 1)
        .read_to_end(&mut buf)
        .await
        .context("cannot read stdin")?;
    if buf.len() as u64 > MAX_STDIN {
        bail!(
            "stdin is larger than {MAX_STDIN} bytes; upload it with `hearth cp - ID:/path` and redirect it"
        );
    }
    String::from_utf8(buf).map_err(|_| {
        anyhow::anyhow!(
            "stdin is not UTF-8 text; upload binary input with `hearth cp - ID:/path` and redirect it in the command"
        )
    })
}

pub async fn exec(ctx: &Ctx, a: ExecArgs) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let mut req = build_request(&a);
    if a.stdin {
        req.stdin = Some(read_stdin().await?);
    }
    if a.background {
        let pid = client.start_background(&a.id, &req).await?;
        ctx.emit(&serde_json::json!({ "pid": pid }), || format!("{pid}\n"))?;
        return Ok(0);
    }
    if ctx.json {
        let result = client.run_command(&a.id, &req).await?;
        print!("{}", output::json(&result)?);
        return Ok(result_status(&result, a.timeout));
    }
    let mut events = client.run_command_stream(&a.id, &req);
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    while let Some(event) = events.next().await {
        match event? {
            CommandEvent::Start { .. } => {}
            CommandEvent::Stdout { data_b64 } => write_chunk(&mut stdout, &data_b64).await?,
            CommandEvent::Stderr { data_b64 } => write_chunk(&mut stderr, &data_b64).await?,
            CommandEvent::Exit {
                exit_code,
                signal,
                timed_out,
            } => {
                stdout.flush().await?;
                if timed_out {
                    eprintln!("hearth: the command timed out{}", after(a.timeout));
                    return Ok(TIMED_OUT);
                }
                return Ok(exit_status(exit_code, signal));
            }
            CommandEvent::Error { code, message } => {
                stdout.flush().await?;
                return Err(hearth_client::Error::Api {
                    status: code.http_status(),
                    code,
                    message,
                }
                .into());
            }
        }
    }
    bail!("the command's event stream ended without an exit status")
}

fn after(timeout: Option<u64>) -> String {
    match timeout {
        Some(t) => format!(" after {t} s"),
        None => " (the daemon's default limit for commands; pass --timeout SECONDS for more)".to_owned(),
    }
}

async fn write_chunk(out: &mut (impl AsyncWrite + Unpin), data_b64: &str) -> anyhow::Result<()> {
    let bytes = decode_output(data_b64)?;
    out.write_all(&bytes).await?;
    out.flush().await?;
    Ok(())
}

fn result_status(r: &CommandResult, timeout: Option<u64>) -> u8 {
    if r.timed_out {
        eprintln!("hearth: the command timed out{}", after(timeout));
        return TIMED_OUT;
    }
    exit_status(r.exit_code, r.signal)
}

pub async fn ps(ctx: &Ctx, id: &str) -> anyhow::Result<u8> {
    let list = ctx.client()?.list_processes(id).await?;
    let style = ctx.stdout_style();
    ctx.emit(&list, || output::process_table(&list.processes, style))?;
    Ok(0)
}

/// Waits for a process, then prints its output tail as raw text and passes its status on.
pub async fn wait(ctx: &Ctx, id: &str, pid: u32, timeout: Option<u64>) -> anyhow::Result<u8> {
    let result = ctx.client()?.wait_process(id, pid, timeout).await?;
    if ctx.json {
        print!("{}", output::json(&result)?);
    } else {
        let mut stdout = tokio::io::stdout();
        stdout.write_all(result.stdout.as_bytes()).await?;
        stdout.flush().await?;
        let mut stderr = tokio::io::stderr();
        stderr.write_all(result.stderr.as_bytes()).await?;
        if result.truncated {
            stderr
                .write_all(b"hearth: the output was longer than the daemon keeps; this is its tail\n")
                .await?;
        }
        stderr.flush().await?;
    }
    Ok(result_status(&result, None))
}

pub async fn kill(ctx: &Ctx, id: &str, pid: u32, signal: Option<i32>) -> anyhow::Result<u8> {
    ctx.client()?.kill_process(id, pid, signal).await?;
    Ok(0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::args::{Cli, Command};

    fn exec_args(args: &[&str]) -> ExecArgs {
        let cli = Cli::try_parse_from(["hearth", "exec"].iter().chain(args)).unwrap();
        match cli.command {
            Command::Exec(a) => a,
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn requests_choose_shell_or_argv() {
        let req = build_request(&exec_args(&[
            "sbx_1",
            "-e",
            "A=1",
            "--timeout",
            "5",
            "--",
            "echo $A",
        ]));
        assert_eq!(req.cmd.as_deref(), Some("echo $A"));
        assert_eq!(req.argv, None);
        assert_eq!(req.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(req.timeout_s, Some(5));
        assert!(!req.background);

        let req = build_request(&exec_args(&["sbx_1", "--background", "sleep", "60"]));
        assert_eq!(req.cmd, None);
        assert_eq!(req.argv, Some(vec!["sleep".to_owned(), "60".to_owned()]));
        assert!(req.background);
    }

    #[test]
    fn statuses() {
        assert_eq!(exit_status(0, None), 0);
        assert_eq!(exit_status(7, None), 7);
        assert_eq!(exit_status(137, Some(9)), 137);
        assert_eq!(exit_status(-1, Some(15)), 143);
        assert_eq!(exit_status(-1, None), 255);
        assert_eq!(exit_status(300, None), 255);
    }
}
