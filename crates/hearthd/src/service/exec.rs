//! Commands in a sandbox: buffered runs, streamed runs, background processes and the process table.

use std::time::Duration;

use bytes::Bytes;
use hearth_api::{CommandResult, ProcessInfo, RunCommandRequest};
use hearth_proto::client::{ExecEvent, ExecHandle};
use hearth_proto::msg::{Command, ExecRequest};

use super::lifecycle::{TIMEOUT_S, validate_env};
use super::{Live, Sandboxes, ServiceError, clip};
use crate::metrics;

/// Foreground commands without a timeout are killed after this long.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);
/// Buffered stdout and stderr are each cut after this many bytes (`truncated: true`).
pub const MAX_BUFFERED: usize = 4 * 1024 * 1024;
/// Extra time the daemon gives the agent to report a timed-out command before giving up on it.
const AGENT_GRACE: Duration = Duration::from_secs(30);
/// Longest path accepted for `cwd`.
const MAX_PATH: usize = 4096;

/// A started foreground command whose events the caller consumes (the SSE route).
pub struct RunningCommand {
    pub pid: u32,
    pub handle: ExecHandle,
    /// Ends when the host stops waiting for the command.
    pub deadline: tokio::time::Instant,
}

/// Exit code of a status: the code, or `128 + signal`, or -1 when neither is known.
pub fn exit_code(code: Option<i32>, signal: Option<i32>) -> i32 {
    code.unwrap_or_else(|| signal.map_or(-1, |s| 128 + s))
}

/// Builds the agent request from an API request, merging the sandbox's env under the command's.
fn build(
    live: &Live,
    req: &RunCommandRequest,
    background: bool,
) -> Result<(ExecRequest, Duration), ServiceError> {
    let command = match (&req.cmd, &req.argv) {
        (Some(cmd), None) => {
            if cmd.contains('\0') {
                return Err(ServiceError::InvalidArgument("cmd contains NUL".into()));
            }
            Command::Shell(cmd.clone())
        }
        (None, Some(argv)) => {
            if argv.is_empty() || argv[0].is_empty() {
                return Err(ServiceError::InvalidArgument("argv must name a program".into()));
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return Err(ServiceError::InvalidArgument("argv contains NUL".into()));
            }
            Command::Argv(argv.clone())
        }
        _ => {
            return Err(ServiceError::InvalidArgument(
                "exactly one of cmd and argv must be given".into(),
            ));
        }
    };
    validate_env(&req.env)?;
    if let Some(cwd) = &req.cwd {
        validate_path(cwd, "cwd")?;
    }
    let timeout = match req.timeout_s {
        Some(t) if !TIMEOUT_S.contains(&t) => {
            return Err(ServiceError::InvalidArgument(format!(
                "timeout_s must be between {} and {}",
                TIMEOUT_S.start(),
                TIMEOUT_S.end()
            )));
        }
        Some(t) => Duration::from_secs(t),
        None => DEFAULT_TIMEOUT,
    };
    let mut env = live.env.clone();
    env.extend(req.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    let exec = ExecRequest {
        command,
        env,
        cwd: req.cwd.clone(),
        // Background processes always get a pipe so that `.../stdin` can feed them later.
        stdin: background || req.stdin.is_some() || req.keep_stdin_open,
        timeout_ms: (!background || req.timeout_s.is_some())
            .then(|| u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX)),
        background,
    };
    Ok((exec, timeout))
}

/// Checks a guest path: absolute, no NUL, bounded length.
pub fn validate_path(path: &str, what: &str) -> Result<(), ServiceError> {
    if !path.starts_with('/') {
        return Err(ServiceError::InvalidArgument(format!(
            "{what} must be an absolute path"
        )));
    }
    if path.contains('\0') {
        return Err(ServiceError::InvalidArgument(format!("{what} contains NUL")));
    }
    if path.len() > MAX_PATH {
        return Err(ServiceError::InvalidArgument(format!(
            "{what} is longer than {MAX_PATH} bytes"
        )));
    }
    Ok(())
}

/// Appends `data` to `buf` up to [`MAX_BUFFERED`]; returns true when something was cut.
fn push_capped(buf: &mut Vec<u8>, data: &[u8]) -> bool {
    let room = MAX_BUFFERED.saturating_sub(buf.len());
    buf.extend_from_slice(&data[..data.len().min(room)]);
    data.len() > room
}

impl Sandboxes {
    /// Starts a foreground command and feeds its stdin (in its own task, so that output keeps flowing).
    pub async fn start_command(
        &self,
        id: &str,
        req: &RunCommandRequest,
    ) -> Result<RunningCommand, ServiceError> {
        let (live, client) = self.agent(id).await?;
        let (exec, timeout) = build(&live, req, false)?;
        let handle = client.exec(exec).await?;
        metrics::command_run("foreground");
        if let Some(data) = &req.stdin {
            let writer = handle.stdin();
            let data = Bytes::copy_from_slice(data.as_bytes());
            let close = !req.keep_stdin_open;
            tokio::spawn(async move {
                // The process may exit without reading its input: that is not an error of the command.
                if writer.send(data).await.is_ok() && close {
                    let _ = writer.close().await;
                }
            });
        }
        let deadline = tokio::time::Instant::now() + timeout + AGENT_GRACE;
        Ok(RunningCommand {
            pid: handle.pid,
            handle,
            deadline,
        })
    }

    /// Runs a command to its end and returns its buffered output.
    pub async fn run_command(
        &self,
        id: &str,
        req: &RunCommandRequest,
    ) -> Result<CommandResult, ServiceError> {
        let mut cmd = self.start_command(id, req).await?;
        let (mut out, mut err, mut truncated) = (Vec::new(), Vec::new(), false);
        loop {
            let ev = match tokio::time::timeout_at(cmd.deadline, cmd.handle.next_event()).await {
                Ok(Some(ev)) => ev,
                Ok(None) => {
                    return Err(ServiceError::AgentUnavailable(
                        "command stream ended without exit".into(),
                    ));
                }
                Err(_) => {
                    self.kill_after_host_timeout(id, cmd.pid).await;
                    return Err(ServiceError::AgentUnavailable(format!(
                        "agent did not report the end of process {} in time",
                        cmd.pid
                    )));
                }
            };
            match ev {
                ExecEvent::Stdout(b) => truncated |= push_capped(&mut out, &b),
                ExecEvent::Stderr(b) => truncated |= push_capped(&mut err, &b),
                ExecEvent::Exited {
                    code,
                    signal,
                    timed_out,
                } => {
                    return Ok(CommandResult {
                        exit_code: exit_code(code, signal),
                        signal,
                        timed_out,
                        stdout: String::from_utf8_lossy(&out).into_owned(),
                        stderr: String::from_utf8_lossy(&err).into_owned(),
                        truncated,
                    });
                }
                ExecEvent::Error(e) => return Err(e.into()),
            }
        }
    }

    /// Best effort: kill a process whose end the agent did not report.
    pub(crate) async fn kill_after_host_timeout(&self, id: &str, pid: u32) {
        if let Some(live) = self.live(id)
            && let Some(client) = live.current()
        {
            let _ = client.kill_process(pid, libc::SIGKILL).await;
        }
    }

    /// Starts a background command; returns its pid.
    pub async fn start_background(&self, id: &str, req: &RunCommandRequest) -> Result<u32, ServiceError> {
        let (live, client) = self.agent(id).await?;
        let (exec, _) = build(&live, req, true)?;
        let pid = client.spawn_background(exec).await?;
        metrics::command_run("background");
        if let Some(data) = &req.stdin {
            client
                .write_stdin(pid, Bytes::copy_from_slice(data.as_bytes()), true)
                .await?;
        }
        Ok(pid)
    }

    pub async fn processes(&self, id: &str) -> Result<Vec<ProcessInfo>, ServiceError> {
        let (_, client) = self.agent(id).await?;
        let procs = client.list_processes().await?;
        Ok(procs
            .into_iter()
            .map(|p| ProcessInfo {
                pid: p.pid,
                cmd: clip(&p.cmd, 4096),
                background: p.background,
                exit_code: p.exit.map(|e| exit_code(e.code, e.signal)),
            })
            .collect())
    }

    /// Waits for process `pid` to exit (at most `timeout`, if given) and returns its status and output tails.
    pub async fn wait_process(
        &self,
        id: &str,
        pid: u32,
        timeout: Option<Duration>,
    ) -> Result<CommandResult, ServiceError> {
        let (_, client) = self.agent(id).await?;
        let exit = match timeout {
            None => client.wait_process(pid).await?,
            Some(t) => client.wait_process_timeout(pid, t).await?.ok_or_else(|| {
                ServiceError::Conflict(format!("process {pid} still running after {} s", t.as_secs()))
            })?,
        };
        let truncated = exit.stdout_tail.len() >= hearth_proto::TAIL_MAX
            || exit.stderr_tail.len() >= hearth_proto::TAIL_MAX;
        Ok(CommandResult {
            exit_code: exit_code(exit.code, exit.signal),
            signal: exit.signal,
            timed_out: exit.timed_out,
            stdout: String::from_utf8_lossy(&exit.stdout_tail).into_owned(),
            stderr: String::from_utf8_lossy(&exit.stderr_tail).into_owned(),
            truncated,
        })
    }

    pub async fn kill_process(&self, id: &str, pid: u32, signal: Option<i32>) -> Result<(), ServiceError> {
        let signal = signal.unwrap_or(libc::SIGKILL);
        if !(1..=64).contains(&signal) {
            return Err(ServiceError::InvalidArgument(
                "signal must be between 1 and 64".into(),
            ));
        }
        let (_, client) = self.agent(id).await?;
        client.kill_process(pid, signal).await?;
        Ok(())
    }

    pub async fn process_stdin(
        &self,
        id: &str,
        pid: u32,
        data: Bytes,
        eof: bool,
    ) -> Result<(), ServiceError> {
        let (_, client) = self.agent(id).await?;
        client.write_stdin(pid, data, eof).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes() {
        assert_eq!(exit_code(Some(3), None), 3);
        assert_eq!(exit_code(None, Some(9)), 137);
        assert_eq!(exit_code(None, None), -1);
    }

    #[test]
    fn capped_buffers() {
        let mut b = Vec::new();
        assert!(!push_capped(&mut b, &vec![1u8; MAX_BUFFERED - 1]));
        assert!(push_capped(&mut b, &[1, 2]));
        assert_eq!(b.len(), MAX_BUFFERED);
        assert!(push_capped(&mut b, &[1]));
    }

    #[test]
    fn paths() {
        assert!(validate_path("/a/b", "path").is_ok());
        assert!(validate_path("a/b", "path").is_err());
        assert!(validate_path("/a\0b", "path").is_err());
        assert!(validate_path(&format!("/{}", "a".repeat(5000)), "path").is_err());
    }
}
