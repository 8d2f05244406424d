//! Host side of Firecracker's vsock: a Unix socket on which `CONNECT <port>\n` opens a connection to a guest
//! port and Firecracker answers `OK <host-side port>\n` once the guest accepted it.
//!
//! The answer is read one byte at a time so that nothing after the handshake line is consumed: the stream is
//! handed over positioned on the first byte the guest sent.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::sock::SocketAddr;

/// Longest acceptable answer line (`OK 4294967295\n` is 14 bytes).
const MAX_LINE: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum VsockError {
    #[error("connect {path}: {source}")]
    Connect { path: String, source: std::io::Error },
    #[error("handshake i/o: {0}")]
    Io(#[from] std::io::Error),
    /// Firecracker closed the connection: nothing listens on the guest port (yet).
    #[error("connection closed during the handshake (nothing listening on guest port {port})")]
    Closed { port: u32 },
    #[error("no handshake answer within {0:?} (guest not up or not listening)")]
    Timeout(Duration),
    #[error("unexpected handshake answer {0:?}")]
    BadAnswer(String),
}

/// A guest port nobody listens on (the agent listens on [`super::AGENT_VSOCK_PORT`]), for [`poke`].
pub const POKE_PORT: u32 = 1023;

/// Makes the guest's vsock driver act on a transport reset Firecracker left pending in a snapshot.
///
/// Firecracker resets the vsock connections of every VM it snapshots (`VIRTIO_VSOCK_EVENT_TRANSPORT_RESET` in
/// the event queue), but on Firecracker 1.12 the guest only processes that event at the device's next
/// interrupt: in a restored VM, or in the source of a checkpoint, the connections from before the snapshot
/// linger, and the next connection made may be reset moments after it was established. A connection request
/// to a port nobody listens on raises that interrupt and waits for the guest's refusal, by which time the
/// reset has been handled. Returns whether the guest answered within `timeout`.
pub async fn poke(uds: &SocketAddr, timeout: Duration) -> bool {
    match connect(uds, POKE_PORT, timeout).await {
        // Refused (the usual answer), or something listens there after all: either way the guest answered.
        Err(VsockError::Closed { .. }) | Ok(_) => true,
        Err(_) => false,
    }
}

/// Connects to guest `port` through the vsock Unix socket `uds`, all within `timeout`.
pub async fn connect(uds: &SocketAddr, port: u32, timeout: Duration) -> Result<UnixStream, VsockError> {
    tokio::time::timeout(timeout, handshake(uds, port))
        .await
        .map_err(|_| VsockError::Timeout(timeout))?
}

async fn handshake(uds: &SocketAddr, port: u32) -> Result<UnixStream, VsockError> {
    let mut stream = uds.connect().await.map_err(|source| VsockError::Connect {
        path: uds.display(),
        source,
    })?;
    stream.write_all(format!("CONNECT {port}\n").as_bytes()).await?;
    let mut line = Vec::with_capacity(16);
    loop {
        let mut byte = [0u8; 1];
        if stream.read(&mut byte).await? == 0 {
            return Err(VsockError::Closed { port });
        }
        if byte[0] == b'\n' {
            break;
        }
        line.push(byte[0]);
        if line.len() >= MAX_LINE {
            return Err(VsockError::BadAnswer(String::from_utf8_lossy(&line).into_owned()));
        }
    }
    parse_ok(&line).ok_or_else(|| VsockError::BadAnswer(String::from_utf8_lossy(&line).into_owned()))?;
    Ok(stream)
}

/// Parses `OK <port>` (without the newline) into the host-side port number.
fn parse_ok(line: &[u8]) -> Option<u32> {
    let rest = line.strip_prefix(b"OK ")?;
    if rest.is_empty() || !rest.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(rest).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixListener;

    #[test]
    fn parses_only_ok_lines() {
        assert_eq!(parse_ok(b"OK 1073741824"), Some(1_073_741_824));
        assert_eq!(parse_ok(b"OK 0"), Some(0));
        for bad in [
            &b"OK"[..],
            b"OK ",
            b"OK -1",
            b"OK 1 2",
            b"ok 5",
            b"ERR 5",
            b"OK 99999999999",
        ] {
            assert_eq!(parse_ok(bad), None, "{}", String::from_utf8_lossy(bad));
        }
    }

    /// A fake vsock muxer: checks the CONNECT line, answers `answer`, then sends `after`.
    async fn fake_muxer(answer: &'static [u8], after: &'static [u8]) -> (tempfile::TempDir, SocketAddr) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v.sock");
        let listener = UnixListener::bind(&path).expect("bind");
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 13];
            s.read_exact(&mut buf).await.expect("connect line");
            assert_eq!(&buf, b"CONNECT 1024\n");
            s.write_all(answer).await.expect("answer");
            s.write_all(after).await.expect("after");
            // Hold the connection open for the reader.
            tokio::time::sleep(Duration::from_secs(5)).await;
        });
        (dir, SocketAddr::Path(path))
    }

    #[tokio::test]
    async fn stream_starts_right_after_the_ok_line() {
        let (_dir, path) = fake_muxer(b"OK 1073741824\n", b"HRTHpayload").await;
        let mut s = connect(&path, 1024, Duration::from_secs(2))
            .await
            .expect("handshake");
        let mut buf = [0u8; 11];
        s.read_exact(&mut buf).await.expect("payload");
        assert_eq!(&buf, b"HRTHpayload");
    }

    #[tokio::test]
    async fn bad_or_missing_answers_fail() {
        let (_d1, p1) = fake_muxer(b"NOPE\n", b"").await;
        assert!(matches!(
            connect(&p1, 1024, Duration::from_secs(2)).await,
            Err(VsockError::BadAnswer(_))
        ));
        let (_d2, p2) = fake_muxer(&[b'O'; 64], b"").await;
        assert!(matches!(
            connect(&p2, 1024, Duration::from_secs(2)).await,
            Err(VsockError::BadAnswer(_))
        ));
        let (_d3, p3) = fake_muxer(b"", b"").await;
        let started = std::time::Instant::now();
        assert!(matches!(
            connect(&p3, 1024, Duration::from_millis(300)).await,
            Err(VsockError::Timeout(_))
        ));
        assert!(started.elapsed() < Duration::from_secs(2));
        let missing = SocketAddr::Path(_d3.path().join("absent.sock"));
        assert!(matches!(
            connect(&missing, 1024, Duration::from_secs(1)).await,
            Err(VsockError::Connect { .. })
        ));
    }
}
