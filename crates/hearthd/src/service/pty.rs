//! Interactive terminals: a program on a pseudo-terminal in the guest (the WebSocket route drives it).

use std::collections::BTreeMap;

use hearth_proto::ErrorKind;
use hearth_proto::PtyRequest;
use hearth_proto::client::{ClientError, PtyHandle};
use hearth_proto::msg::{Command, MAX_PTY_DIM, valid_pty_size};

use super::exec::validate_path;
use super::lifecycle::validate_env;
use super::{Sandboxes, ServiceError};
use crate::metrics;

/// The shell started when no command is given: bash as a login shell where the guest has it, else sh.
pub const DEFAULT_SHELL: &str = "if [ -x /bin/bash ]; then exec /bin/bash -l; else exec /bin/sh; fi";

/// The agent's answer to a request type it does not know.
const UNKNOWN_REQUEST: &str = "unknown or malformed request";

/// What to start on the terminal.
#[derive(Debug, Clone, Default)]
pub struct PtyOptions {
    /// A shell command line (`/bin/sh -c`); default [`DEFAULT_SHELL`].
    pub cmd: Option<String>,
    pub rows: u16,
    pub cols: u16,
    pub cwd: Option<String>,
    /// Added over the sandbox's environment.
    pub env: BTreeMap<String, String>,
}

impl Sandboxes {
    /// Starts a program on a new terminal in the guest (resuming a paused sandbox first). The session lasts
    /// as long as the returned handle: dropping it hangs the terminal up.
    pub async fn open_pty(&self, id: &str, opts: PtyOptions) -> Result<PtyHandle, ServiceError> {
        if !valid_pty_size(opts.rows, opts.cols) {
            return Err(ServiceError::InvalidArgument(format!(
                "rows and cols must be between 1 and {MAX_PTY_DIM}"
            )));
        }
        let cmd = match opts.cmd {
            Some(c) if c.contains('\0') => {
                return Err(ServiceError::InvalidArgument("cmd contains NUL".into()));
            }
            Some(c) if c.trim().is_empty() => {
                return Err(ServiceError::InvalidArgument("cmd is empty".into()));
            }
            Some(c) => c,
            None => DEFAULT_SHELL.to_owned(),
        };
        validate_env(&opts.env)?;
        if let Some(cwd) = &opts.cwd {
            validate_path(cwd, "cwd")?;
        }
        let (live, client) = self.agent(id).await?;
        let mut env = live.env.clone();
        env.extend(opts.env);
        let handle = client
            .pty(PtyRequest {
                command: Command::Shell(cmd),
                env,
                cwd: opts.cwd,
                rows: opts.rows,
                cols: opts.cols,
            })
            .await
            .map_err(|e| match e {
                // What an agent that predates terminals answers (a sandbox from an old snapshot or template).
                ClientError::Guest {
                    kind: ErrorKind::InvalidRequest,
                    message,
                } if message == UNKNOWN_REQUEST => ServiceError::Conflict(format!(
                    "the agent in sandbox {id} is too old for terminals (its template or snapshot predates them)"
                )),
                other => other.into(),
            })?;
        metrics::command_run("pty");
        Ok(handle)
    }
}
