//! Moving bytes between a guest connection and its upstream once the first decision is taken: opaque (TLS,
//! other protocols, a switched HTTP connection) or request by request (HTTP/1), with an idle timeout.
//!
//! In framed mode the guest->upstream direction goes through a [`RequestFramer`]: a request's bytes are
//! forwarded only after its head was judged. When a later request is refused (or cannot be framed), nothing
//! more goes upstream: the upstream side is shut for writing, the responses to the requests already forwarded
//! still reach the guest, and the refusal (`403`/`400`, `Connection: close`) follows them once the upstream
//! closes (within the shorter drain timeout), so the guest reads every answer in order.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::http1::{FrameError, RequestFramer, RequestHead, Step, Switch};

/// Size of each direction's copy buffer.
const BUF: usize = 8 * 1024;
/// Interim (1xx) responses skipped while waiting for the answer to a protocol switch.
const MAX_INTERIM: usize = 8;

/// An HTTP answer the proxy gives instead of forwarding a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Refusal {
    pub status: u16,
    pub message: String,
}

impl Refusal {
    pub fn forbidden(reason: &str) -> Self {
        Refusal {
            status: 403,
            message: format!("hearth egress policy: connection refused ({reason})"),
        }
    }

    pub fn bad_request(e: &FrameError) -> Self {
        Refusal {
            status: 400,
            message: format!("hearth egress proxy: {e}"),
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let title = if self.status == 400 {
            "Bad Request"
        } else {
            "Forbidden"
        };
        let body = format!("{}\n", self.message);
        format!(
            "HTTP/1.1 {} {title}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.status,
            body.len()
        )
        .into_bytes()
    }
}

/// Judges the requests after the first on a framed connection (and records what it refuses).
pub(super) trait Judge: Send + Sync {
    /// `None` to forward the request, or the refusal.
    fn request(&self, head: &RequestHead) -> Option<Refusal>;
    /// The refusal of bytes that cannot be framed.
    fn malformed(&self, e: &FrameError) -> Refusal;
}

/// What goes guest->upstream.
pub(super) enum Up<'a> {
    /// Every byte, as it comes.
    Opaque,
    /// Request by request through `framer`; each later head is judged by `judge`.
    Framed {
        framer: RequestFramer,
        judge: &'a dyn Judge,
    },
}

/// Timeouts of a relay.
#[derive(Debug, Clone, Copy)]
pub(super) struct Timeouts {
    /// No byte in either direction for this long ends the connection.
    pub idle: Duration,
    /// After a refusal, the upstream must finish its answers with no pause this long.
    pub drain: Duration,
}

/// When the connection last moved a byte, and whether it is draining after a refusal.
struct Activity {
    start: Instant,
    last_ms: AtomicU64,
    draining: AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            draining: AtomicBool::new(false),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// Resolves once the connection has been idle for its limit.
    async fn expired(&self, t: Timeouts) {
        loop {
            let limit = if self.draining.load(Ordering::Relaxed) {
                t.drain.min(t.idle)
            } else {
                t.idle
            };
            let last = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let deadline = last + limit;
            if Instant::now() >= deadline {
                return;
            }
            tokio::time::sleep_until(deadline).await;
        }
    }
}

/// Relays until both directions are over, or the connection idles out. `preamble` (already judged) goes
/// upstream first; `pending` are guest bytes read but not judged yet (framed) or not sent yet (opaque).
pub(super) async fn relay(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    preamble: &[u8],
    pending: Vec<u8>,
    up: Up<'_>,
    timeouts: Timeouts,
) {
    let activity = Activity::new();
    let refusal: Mutex<Option<Refusal>> = Mutex::new(None);
    let (mut cr, mut cw) = client.split();
    let (mut ur, mut uw) = upstream.split();
    let up_dir = async {
        if uw.write_all(preamble).await.is_ok() {
            let refused = match up {
                Up::Opaque => {
                    if uw.write_all(&pending).await.is_ok() {
                        copy(&mut cr, &mut uw, &activity).await;
                    }
                    None
                }
                Up::Framed { framer, judge } => {
                    pump(&mut cr, &mut uw, framer, pending, judge, &activity).await
                }
            };
            if let Some(r) = refused {
                *refusal.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
                activity.draining.store(true, Ordering::Relaxed);
                activity.touch();
            }
        }
        let _ = uw.shutdown().await;
    };
    let down_dir = async {
        copy(&mut ur, &mut cw, &activity).await;
        let refused = refusal.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(r) = refused {
            let _ = cw.write_all(&r.to_bytes()).await;
        }
        let _ = cw.shutdown().await;
    };
    tokio::select! {
        _ = async { tokio::join!(up_dir, down_dir) } => {}
        () = activity.expired(timeouts) => {}
    }
}

/// Copies until EOF or an error on either side.
async fn copy<R, W>(r: &mut R, w: &mut W, activity: &Activity)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; BUF];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        activity.touch();
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
        activity.touch();
    }
}

/// Forwards the guest's requests one by one as they are judged; returns the refusal that stopped it, or
/// `None` at the guest's EOF (or an error).
async fn pump<R, W>(
    r: &mut R,
    w: &mut W,
    mut framer: RequestFramer,
    mut pending: Vec<u8>,
    judge: &dyn Judge,
    activity: &Activity,
) -> Option<Refusal>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; BUF];
    loop {
        let n = match framer.step(&pending) {
            Step::Forward(n) => n,
            Step::Head { len, head } => {
                if let Some(refusal) = judge.request(&head) {
                    return Some(refusal);
                }
                len
            }
            Step::Error(e) => return Some(judge.malformed(&e)),
            Step::NeedMore => {
                let n = match r.read(&mut buf).await {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => n,
                };
                activity.touch();
                pending.extend_from_slice(&buf[..n]);
                continue;
            }
        };
        if w.write_all(&pending[..n]).await.is_err() {
            return None;
        }
        activity.touch();
        pending.drain(..n);
    }
}

/// After forwarding a first request that asks for a protocol switch, reads the upstream's answer (passing 1xx
/// interim answers on) and passes it on. `Some(true)`: the switch happened (the connection is opaque from now
/// on); `Some(false)`: the server answered without switching (framing goes on); `None`: the answer was
/// malformed, too large or late (close).
pub(super) async fn await_switch(
    client: &mut TcpStream,
    upstream: &mut TcpStream,
    switch: Switch,
    max_head: usize,
    wait: Duration,
) -> Option<bool> {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; BUF];
    let deadline = Instant::now() + wait;
    for _ in 0..=MAX_INTERIM {
        let end = loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break end + 4;
            }
            if buf.len() >= max_head {
                return None;
            }
            match tokio::time::timeout_at(deadline, upstream.read(&mut chunk)).await {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                _ => return None,
            }
        };
        let status = status_code(&buf[..end])?;
        if (100..200).contains(&status) && status != 101 {
            client.write_all(&buf[..end]).await.ok()?;
            buf.drain(..end);
            continue;
        }
        client.write_all(&buf).await.ok()?;
        let switched = match switch {
            Switch::WebSocket => status == 101,
            Switch::Connect => (200..300).contains(&status),
        };
        return Some(switched);
    }
    None
}

/// The status code of a response head (`HTTP/1.x NNN ...`).
fn status_code(head: &[u8]) -> Option<u16> {
    let rest = head
        .strip_prefix(b"HTTP/1.1 ")
        .or_else(|| head.strip_prefix(b"HTTP/1.0 "))?;
    let digits = rest.get(..3)?;
    if !digits.iter().all(u8::is_ascii_digit) || !matches!(rest.get(3), Some(b' ' | b'\r')) {
        return None;
    }
    std::str::from_utf8(digits).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes() {
        assert_eq!(
            status_code(b"HTTP/1.1 101 Switching Protocols\r\n\r\n"),
            Some(101)
        );
        assert_eq!(status_code(b"HTTP/1.0 200\r\n\r\n"), Some(200));
        for bad in [
            &b"HTTP/1.1 20 OK\r\n"[..],
            b"HTTP/2 200 OK\r\n",
            b"HTTP/1.1 2000\r\n",
            b"",
        ] {
            assert_eq!(status_code(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn refusals_are_complete_responses() {
        let r = Refusal::forbidden("host_changed").to_bytes();
        let text = String::from_utf8(r).unwrap_or_default();
        assert!(text.starts_with("HTTP/1.1 403 Forbidden\r\n"), "{text}");
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or_default();
        assert!(
            head.contains(&format!("Content-Length: {}", body.len())),
            "{text}"
        );
        assert!(head.contains("Connection: close"));
        let r = Refusal::bad_request(&FrameError::LengthAndEncoding).to_bytes();
        assert!(r.starts_with(b"HTTP/1.1 400 Bad Request\r\n"));
    }
}
