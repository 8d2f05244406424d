//! `hearth shell ID [-- CMD...]`: an interactive terminal in a sandbox.
//!
//! The local terminal is put in raw mode (every key, Ctrl-C included, goes to the guest), restored on every
//! way out: normal exit, error, panic (the guard's `Drop` runs while unwinding), SIGTERM/SIGHUP/SIGINT to
//! this process. The guest's terminal follows the local window size (SIGWINCH). When stdin is not a
//! terminal its bytes are forwarded as they are, and its end is sent as Ctrl-D.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsRawFd;

use anyhow::Context as _;
use hearth_client::pty::{PtyEvent, PtyOptions};
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;

use crate::Ctx;
use crate::args::{CommandSpec, ShellArgs, command_spec};
use crate::cmd::exec::exit_status;

/// Ctrl-D: what a terminal sends for end of input.
const EOT: u8 = 0x04;

pub async fn shell(ctx: &Ctx, a: ShellArgs) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    let (rows, cols) = window_size().unwrap_or((24, 80));
    let opts = PtyOptions {
        cmd: shell_line(&a.command),
        rows,
        cols,
        cwd: a.cwd.clone(),
        env: a.env.iter().cloned().collect(),
    };
    let session = client
        .open_pty(&a.id, &opts)
        .await
        .with_context(|| format!("cannot open a terminal in {}", a.id))?;
    let (mut writer, mut reader) = session.split();

    let raw = if std::io::stdin().is_terminal() {
        Some(RawMode::enable().context("cannot put the terminal in raw mode")?)
    } else {
        None
    };
    let input = spawn_stdin_reader();
    let result = pump(&mut writer, &mut reader, input).await;
    drop(raw);
    let (code, signal) = result?;
    Ok(exit_status(code, signal))
}

/// Moves bytes both ways until the guest program exits; returns its exit code and signal.
async fn pump(
    writer: &mut hearth_client::pty::PtyWriter,
    reader: &mut hearth_client::pty::PtyReader,
    mut input: mpsc::Receiver<Option<Vec<u8>>>,
) -> anyhow::Result<(i32, Option<i32>)> {
    let mut winch = signal(SignalKind::window_change()).context("SIGWINCH")?;
    let mut term = signal(SignalKind::terminate()).context("SIGTERM")?;
    let mut hup = signal(SignalKind::hangup()).context("SIGHUP")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT")?;
    let mut stdin_open = true;
    let mut stdout = std::io::stdout();
    loop {
        tokio::select! {
            ev = reader.next() => match ev {
                Some(Ok(PtyEvent::Output(data))) => {
                    stdout.write_all(&data).context("cannot write to stdout")?;
                    stdout.flush().context("cannot write to stdout")?;
                }
                Some(Ok(PtyEvent::Exit { exit_code, signal })) => return Ok((exit_code, signal)),
                Some(Err(e)) => return Err(e).context("terminal session failed"),
                None => anyhow::bail!("the terminal closed without reporting an exit"),
            },
            chunk = input.recv(), if stdin_open => match chunk {
                Some(Some(bytes)) => writer.send(&bytes).await.context("cannot send input")?,
                // End of stdin: what a terminal user does with Ctrl-D.
                Some(None) | None => {
                    stdin_open = false;
                    writer.send(&[EOT]).await.context("cannot send input")?;
                }
            },
            _ = winch.recv() => {
                if let Some((rows, cols)) = window_size() {
                    writer.resize(rows, cols).await.context("cannot resize the terminal")?;
                }
            },
            _ = term.recv() => anyhow::bail!("terminated"),
            _ = hup.recv() => anyhow::bail!("hung up"),
            // Only reaches us when stdin is not a terminal in raw mode (then Ctrl-C is a byte for the guest).
            _ = int.recv() => anyhow::bail!("interrupted"),
        }
    }
}

/// The guest command line for `CMD...`: none for the guest's shell, one argument as a shell line, several
/// as a quoted argv.
fn shell_line(command: &[String]) -> Option<String> {
    if command.is_empty() {
        return None;
    }
    Some(match command_spec(command) {
        CommandSpec::Shell(line) => line,
        CommandSpec::Argv(argv) => argv.iter().map(|a| quote(a)).collect::<Vec<_>>().join(" "),
    })
}

/// Single-quotes `s` for `/bin/sh` unless it only has characters that need none.
fn quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_./=:,+@%".contains(&b));
    if plain {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Reads stdin on its own thread (a blocking read must not hold the runtime up at exit); `None` at its end.
fn spawn_stdin_reader() -> mpsc::Receiver<Option<Vec<u8>>> {
    let (tx, rx) = mpsc::channel(16);
    std::thread::spawn(move || {
        let mut stdin = std::io::stdin();
        let mut buf = vec![0u8; 8192];
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => {
                    let _ = tx.blocking_send(None);
                    return;
                }
                Ok(n) => {
                    if tx.blocking_send(Some(buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}

/// The local window size (rows, cols), from whichever of stdout, stdin, stderr is a terminal.
fn window_size() -> Option<(u16, u16)> {
    for fd in [
        std::io::stdout().as_raw_fd(),
        std::io::stdin().as_raw_fd(),
        std::io::stderr().as_raw_fd(),
    ] {
        // SAFETY: an all-zero winsize is valid; TIOCGWINSZ only writes into it.
        let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
        // SAFETY: `ws` lives for the duration of the call.
        if unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) } == 0 && ws.ws_row > 0 && ws.ws_col > 0 {
            return Some((ws.ws_row, ws.ws_col));
        }
    }
    None
}

/// Raw mode on stdin's terminal for as long as it lives.
struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    fn enable() -> std::io::Result<RawMode> {
        let fd = std::io::stdin().as_raw_fd();
        // SAFETY: an all-zero termios is valid storage; tcgetattr fills it in.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: `saved` lives for the duration of the call.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw only edits the struct it is given.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: `raw` lives for the duration of the call.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(RawMode { saved })
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the settings read in `enable`; `saved` lives for the duration of the call.
        unsafe { libc::tcsetattr(std::io::stdin().as_raw_fd(), libc::TCSANOW, &self.saved) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_lines() {
        assert_eq!(shell_line(&[]), None);
        assert_eq!(shell_line(&["top -b".into()]).as_deref(), Some("top -b"));
        assert_eq!(
            shell_line(&["echo".into(), "it's".into(), "a b".into(), "x=1".into()]).as_deref(),
            Some("echo 'it'\\''s' 'a b' x=1")
        );
    }
}
