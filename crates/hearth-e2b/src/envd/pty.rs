//! Terminals: envd's `Start` with a `pty` is a hearth terminal session (`GET /v1/sandboxes/{id}/pty`,
//! WebSocket) the adapter holds: its output becomes `pty` data events, `SendInput` types into it, `Update`
//! resizes it, `SendSignal` signals its process group. hearth does not report a terminal's guest pid, so
//! the session gets a pid of its own above any Linux pid ([`super::procs::Registry::pty_pid`]).

use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use hearth_client::pty::{PtyEvent, PtyOptions, PtyReader};

use super::Envd;
use super::connect::{self, Code, Fault};
use super::procs::{End, Event, Tracked};
use super::proto::{self, ProcessConfig, Pty, PtySize};
use crate::Shared;

/// Rows and columns within what a terminal takes (0 means the usual 24x80).
pub fn pty_size(size: PtySize) -> (u16, u16) {
    let clamp = |v: u32, default: u16| {
        if v == 0 {
            default
        } else {
            v.min(u32::from(u16::MAX)) as u16
        }
    };
    (clamp(size.rows, 24), clamp(size.cols, 80))
}

/// POSIX shell quoting.
pub fn quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"@%+=:,./-_".contains(&b))
    {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\'', r#"'"'"'"#))
}

/// The shell line hearth's terminal runs for envd's command (bash falls back to sh, as for commands).
pub fn shell_line(config: &ProcessConfig) -> String {
    let args: Vec<String> = config.args.iter().map(|a| quote(a)).collect();
    let args = args.join(" ");
    if config.cmd == "/bin/bash" || config.cmd == "bash" {
        format!("if [ -x /bin/bash ]; then exec /bin/bash {args}; fi; exec /bin/sh {args}")
    } else {
        format!("exec {} {args}", quote(&config.cmd))
    }
}

pub async fn start(
    envd: &Envd,
    config: ProcessConfig,
    tag: Option<String>,
    pty: Pty,
    timeout: Option<Duration>,
    keepalive: Duration,
) -> Result<Response, Fault> {
    if config.cmd.is_empty() {
        return Err(Fault::invalid("process.cmd must not be empty"));
    }
    let (rows, cols) = pty_size(pty.size.unwrap_or_default());
    let cwd = match config.cwd.as_deref() {
        None | Some("") => None,
        Some(c) => Some(super::resolve(c)?),
    };
    let opts = PtyOptions {
        cmd: Some(shell_line(&config)),
        rows,
        cols,
        cwd,
        env: config.envs.clone(),
    };
    let session = match envd.api.open_pty(&envd.sandbox, &opts).await {
        Ok(s) => s,
        Err(e) => return Err(envd.fault(e).await),
    };
    let (writer, reader) = session.split();
    let shared = envd.shared.clone();
    let pid = shared.procs.pty_pid();
    let (tracked, rx) = shared.procs.track(
        &envd.sandbox,
        pid,
        config,
        tag,
        Some(tokio::sync::Mutex::new(writer)),
    )?;
    tokio::spawn(pump(
        shared.clone(),
        envd.sandbox.clone(),
        tracked,
        reader,
        timeout,
    ));
    Ok(connect::stream_response(super::process::follow(
        proto::start_event(pid),
        rx,
        keepalive,
        None,
        shared,
    )))
}

/// Moves the terminal's output to the attached streams; kills the session at its deadline.
async fn pump(
    shared: Arc<Shared>,
    sandbox: String,
    t: Arc<Tracked>,
    mut reader: PtyReader,
    timeout: Option<Duration>,
) {
    let far = tokio::time::Instant::now() + Duration::from_secs(365 * 86_400);
    let deadline = timeout.map_or(far, |d| tokio::time::Instant::now() + d);
    let mut timed_out = false;
    loop {
        let next = tokio::select! {
            n = reader.next() => n,
            _ = tokio::time::sleep_until(deadline), if !timed_out => {
                timed_out = true;
                if let Some(pty) = &t.pty {
                    let _ = pty.lock().await.signal(9).await;
                }
                continue;
            }
            _ = shared.stop.cancelled() => {
                t.publish(Event::Fault(Fault::new(Code::Unavailable, "the daemon is shutting down"))).await;
                break;
            }
        };
        let ev = match next {
            Some(Ok(PtyEvent::Output(b))) => Event::Pty(b),
            Some(Ok(PtyEvent::Exit { exit_code, signal })) => {
                Event::End(End::from_exit(exit_code, signal, timed_out))
            }
            Some(Err(e)) => Event::Fault(Fault::new(Code::Unavailable, e.to_string())),
            None => Event::Fault(Fault::new(Code::Unavailable, "the terminal closed")),
        };
        let last = ev.is_last();
        t.publish(ev).await;
        if last {
            break;
        }
    }
    if let Some(pty) = &t.pty {
        let _ = pty.lock().await.close().await;
    }
    shared.procs.remove(&sandbox, &t);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn terminal_commands_are_quoted_shell_lines() {
        assert_eq!(quote("-l"), "-l");
        assert_eq!(quote("it's"), r#"'it'"'"'s'"#);
        assert_eq!(quote(""), "''");
        let bash = ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-i".into(), "-l".into()],
            ..ProcessConfig::default()
        };
        assert_eq!(
            shell_line(&bash),
            "if [ -x /bin/bash ]; then exec /bin/bash -i -l; fi; exec /bin/sh -i -l"
        );
        let other = ProcessConfig {
            cmd: "/usr/bin/top".into(),
            args: vec!["-d 1".into()],
            ..ProcessConfig::default()
        };
        assert_eq!(shell_line(&other), "exec /usr/bin/top '-d 1'");
        assert_eq!(pty_size(PtySize { cols: 0, rows: 0 }), (24, 80));
        assert_eq!(pty_size(PtySize { cols: 120, rows: 40 }), (40, 120));
    }
}
