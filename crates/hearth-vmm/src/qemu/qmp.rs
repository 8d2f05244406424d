//! A small client for QEMU's machine protocol (QMP) on a Unix socket.
//!
//! QMP is line-delimited JSON: on connect QEMU sends a greeting, the client must send `qmp_capabilities`, then
//! each `{"execute": ..}` is answered by one `{"return": ..}` or `{"error": ..}`; asynchronous `{"event": ..}`
//! lines may come in between and are skipped here. QEMU serves one QMP client at a time, so callers keep a
//! connection only for the few commands they need, and bound every call with a timeout.
//!
//! QEMU runs next to a hostile guest, so its answers are read with a line-length bound.

use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::Path;

use nix::sys::socket::{ControlMessage, MsgFlags, sendmsg};

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader, Interest};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

fn request_line(command: &str, arguments: Option<Value>) -> String {
    let mut request = json!({ "execute": command });
    if let Some(args) = arguments {
        request["arguments"] = args;
    }
    let mut line = request.to_string();
    line.push('\n');
    line
}

/// Longest QMP line accepted (QEMU's answers to our commands are far smaller).
const MAX_LINE: u64 = 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("qmp socket: {0}")]
    Io(#[from] std::io::Error),
    /// QEMU closed the connection (it does so right after answering `quit`).
    #[error("qmp connection closed")]
    Closed,
    /// QEMU sent something that is not QMP.
    #[error("qmp protocol: {0}")]
    Protocol(String),
    /// QEMU refused the command.
    #[error("qmp {command}: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
}

/// One QMP connection, past the capabilities negotiation.
pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Qmp {
    /// Connects, reads the greeting and leaves capabilities negotiation mode.
    pub async fn connect(path: &Path) -> Result<Self, QmpError> {
        let (read, writer) = UnixStream::connect(path).await?.into_split();
        let mut qmp = Qmp {
            reader: BufReader::new(read),
            writer,
        };
        let greeting = qmp.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!("expected a greeting, got {greeting}")));
        }
        qmp.execute("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    /// Runs one command and returns its `return` value.
    pub async fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let line = request_line(command, arguments);
        self.writer.write_all(line.as_bytes()).await?;
        self.read_reply(command).await
    }

    /// Hands QEMU an open file descriptor under `name` (`getfd`); commands then name it `fd:<name>`.
    pub async fn send_fd(&mut self, name: &str, fd: BorrowedFd<'_>) -> Result<(), QmpError> {
        self.execute_with_fd("getfd", json!({ "fdname": name }), fd)
            .await
            .map(drop)
    }

    /// Adds an open file descriptor to a new fd set (`add-fd`) and returns the set's id; QEMU then opens it
    /// as `/dev/fdset/<id>` (e.g. `migrate` to `file:/dev/fdset/<id>`). QEMU may be chrooted and
    /// unprivileged, so files it must write later (a snapshot) are opened by the daemon and passed this way.
    /// Release the set with `remove-fd` when done.
    pub async fn add_fd(&mut self, fd: BorrowedFd<'_>) -> Result<u64, QmpError> {
        let ret = self.execute_with_fd("add-fd", json!({}), fd).await?;
        ret.get("fdset-id")
            .and_then(Value::as_u64)
            .ok_or_else(|| QmpError::Protocol(format!("add-fd without an fdset-id: {ret}")))
    }

    /// Runs `command` with `fd` attached as SCM_RIGHTS to the request line.
    async fn execute_with_fd(
        &mut self,
        command: &str,
        arguments: Value,
        fd: BorrowedFd<'_>,
    ) -> Result<Value, QmpError> {
        let line = request_line(command, Some(arguments));
        let stream: &UnixStream = self.writer.as_ref();
        let sent = loop {
            stream.writable().await?;
            let attempt = stream.try_io(Interest::WRITABLE, || {
                let fds = [fd.as_raw_fd()];
                let cmsg = [ControlMessage::ScmRights(&fds)];
                let iov = [IoSlice::new(line.as_bytes())];
                sendmsg::<()>(stream.as_raw_fd(), &iov, &cmsg, MsgFlags::MSG_NOSIGNAL, None)
                    .map_err(std::io::Error::from)
            });
            match attempt {
                Ok(n) => break n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
        };
        // The descriptor went with the first byte; the rest of the line (rarely any) follows normally.
        self.writer.write_all(&line.as_bytes()[sent..]).await?;
        self.read_reply(command).await
    }

    /// Polls `query-migrate` until the migration completes; fails on `failed`/`cancelled` or after `within`.
    pub async fn wait_migration(&mut self, within: std::time::Duration) -> Result<(), QmpError> {
        let deadline = tokio::time::Instant::now() + within;
        let mut poll = crate::poll::Backoff::new();
        loop {
            let info = self.execute("query-migrate", None).await?;
            match info.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(()),
                Some(s @ ("failed" | "cancelled")) => {
                    let why = info
                        .get("error-desc")
                        .and_then(Value::as_str)
                        .unwrap_or("no reason given");
                    return Err(QmpError::Command {
                        command: "migrate".to_string(),
                        class: s.to_string(),
                        desc: why.to_string(),
                    });
                }
                _ if tokio::time::Instant::now() >= deadline => {
                    return Err(QmpError::Protocol(format!(
                        "migration not done after {within:?}: {info}"
                    )));
                }
                _ => poll.sleep().await,
            }
        }
    }

    async fn read_reply(&mut self, command: &str) -> Result<Value, QmpError> {
        loop {
            let msg = self.read_message().await?;
            if msg.get("event").is_some() {
                continue;
            }
            if let Some(ret) = msg.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = msg.get("error") {
                let field = |k: &str| err.get(k).and_then(Value::as_str).unwrap_or("?").to_string();
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: field("class"),
                    desc: field("desc"),
                });
            }
            return Err(QmpError::Protocol(format!("unexpected message {msg}")));
        }
    }

    /// The run state (`running`, `paused`, `shutdown`, `inmigrate`, ...).
    pub async fn query_status(&mut self) -> Result<String, QmpError> {
        let ret = self.execute("query-status", None).await?;
        ret.get("status")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| QmpError::Protocol(format!("query-status without a status: {ret}")))
    }

    /// Asks QEMU to exit. QEMU may close the connection before or after answering; both count as success.
    pub async fn quit(&mut self) -> Result<(), QmpError> {
        match self.execute("quit", None).await {
            Ok(_) | Err(QmpError::Closed) => Ok(()),
            Err(QmpError::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
            Err(QmpError::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut buf = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE)
            .read_until(b'\n', &mut buf)
            .await?;
        if n == 0 {
            return Err(QmpError::Closed);
        }
        if buf.last() != Some(&b'\n') {
            return Err(QmpError::Protocol(format!(
                "line longer than {MAX_LINE} bytes or cut short"
            )));
        }
        serde_json::from_slice(&buf).map_err(|e| QmpError::Protocol(format!("bad json: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    /// A fake QEMU that greets, accepts capabilities, emits an event, then answers with `reply`.
    async fn fake_qemu(path: &Path, reply: &'static str) -> tokio::task::JoinHandle<Vec<String>> {
        let listener = UnixListener::bind(path).expect("bind");
        tokio::spawn(async move {
            let (sock, _) = listener.accept().await.expect("accept");
            let (r, mut w) = sock.into_split();
            let mut lines = BufReader::new(r).lines();
            let mut seen = Vec::new();
            w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
                .await
                .expect("greet");
            seen.push(lines.next_line().await.expect("read").expect("caps"));
            w.write_all(b"{\"return\": {}}\n").await.expect("caps reply");
            seen.push(lines.next_line().await.expect("read").expect("cmd"));
            w.write_all(b"{\"event\": \"RESUME\", \"timestamp\": {}}\n")
                .await
                .expect("event");
            w.write_all(reply.as_bytes()).await.expect("reply");
            seen
        })
    }

    #[tokio::test]
    async fn query_status_skips_events() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let server = fake_qemu(
            &path,
            "{\"return\": {\"status\": \"running\", \"running\": true}}\n",
        )
        .await;
        let mut qmp = Qmp::connect(&path).await.expect("connect");
        assert_eq!(qmp.query_status().await.expect("status"), "running");
        let seen = server.await.expect("server");
        assert!(seen[0].contains("qmp_capabilities"), "{seen:?}");
        assert!(seen[1].contains("query-status"), "{seen:?}");
    }

    #[tokio::test]
    async fn errors_carry_class_and_description() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let _server = fake_qemu(
            &path,
            "{\"error\": {\"class\": \"GenericError\", \"desc\": \"nope\"}}\n",
        )
        .await;
        let mut qmp = Qmp::connect(&path).await.expect("connect");
        let err = qmp.execute("stop", None).await.expect_err("error");
        assert_eq!(err.to_string(), "qmp stop: GenericError: nope");
    }

    #[tokio::test]
    async fn garbage_is_a_protocol_error() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let _server = fake_qemu(&path, "not json\n").await;
        let mut qmp = Qmp::connect(&path).await.expect("connect");
        assert!(matches!(qmp.query_status().await, Err(QmpError::Protocol(_))));
    }

    #[tokio::test]
    async fn quit_accepts_a_closed_connection() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("qmp.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        let server = tokio::spawn(async move {
            let (sock, _) = listener.accept().await.expect("accept");
            let (r, mut w) = sock.into_split();
            let mut lines = BufReader::new(r).lines();
            w.write_all(b"{\"QMP\": {}}\n").await.expect("greet");
            lines.next_line().await.expect("read");
            w.write_all(b"{\"return\": {}}\n").await.expect("caps reply");
            lines.next_line().await.expect("read quit");
            // Exit without answering, as QEMU sometimes does.
        });
        let mut qmp = Qmp::connect(&path).await.expect("connect");
        qmp.quit().await.expect("quit");
        server.await.expect("server");
    }
}
