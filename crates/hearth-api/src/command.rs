use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Body of `POST /v1/sandboxes/{id}/commands`. Exactly one of `cmd` and `argv` must be set.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RunCommandRequest {
    /// A shell command line, run with `/bin/sh -c`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<String>,
    /// A program and its arguments, run directly (no shell).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub argv: Option<Vec<String>>,
    /// Extra environment variables (added to the sandbox's own).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Working directory in the guest. Default `/root` (or `/` if absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// Bytes (UTF-8 text) written to the command's stdin, which is then closed (unless `keep_stdin_open`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
    /// Keep the command's stdin open (after `stdin`, if given, is written) so that
    /// `POST .../processes/{pid}/stdin` can feed and close it while the output streams. Foreground commands
    /// only: a background command's stdin is always open. Default false (stdin is empty).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub keep_stdin_open: bool,
    /// Kill the command after this many seconds (foreground default 60, max 86400; background: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    /// Start the command and return its pid at once; it outlives the request.
    #[serde(default)]
    pub background: bool,
}

/// How a command ended.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct CommandResult {
    /// Exit code, or `128 + signal` when killed by a signal.
    pub exit_code: i32,
    /// Signal number that killed the command, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// True when the command was killed because its timeout expired.
    #[serde(default)]
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    /// True when stdout or stderr were longer than the buffered limit and cut; stream the command to get all.
    #[serde(default)]
    pub truncated: bool,
}

/// Body of a `background: true` command start (status 202).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct BackgroundStarted {
    pub pid: u32,
}

/// One event of a streamed command (`Accept: text/event-stream`). The SSE `event:` name is the variant
/// (`start`, `stdout`, `stderr`, `exit`, `error`) and `data:` is this JSON.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CommandEvent {
    Start {
        pid: u32,
    },
    /// A chunk of stdout, base64-encoded so any bytes pass intact.
    Stdout {
        data_b64: String,
    },
    /// A chunk of stderr, base64-encoded.
    Stderr {
        data_b64: String,
    },
    Exit {
        exit_code: i32,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        signal: Option<i32>,
        #[serde(default)]
        timed_out: bool,
    },
    Error {
        code: crate::ErrorCode,
        message: String,
    },
}

/// A process started by the agent (background or foreground) as listed by `GET .../processes`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ProcessInfo {
    pub pid: u32,
    /// The command line as started (`cmd`, or `argv` joined by spaces).
    pub cmd: String,
    pub background: bool,
    /// Set once the process has exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ProcessList {
    pub processes: Vec<ProcessInfo>,
}

/// Body of `POST .../processes/{pid}/kill`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct KillProcessRequest {
    /// Signal number; default 9 (SIGKILL).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
}
