//! A minimal HTTP/1.1 client for Firecracker's API socket.
//!
//! Firecracker's API server (`micro_http`) speaks plain HTTP/1.1 over a Unix socket, always answers with a
//! `Content-Length` when there is a body, keeps connections alive whatever the client asks, and sends status
//! lines with an empty reason phrase (`HTTP/1.1 204 `). So this client opens one connection per request, sends
//! the body with a `Content-Length`, reads the head up to the blank line, then exactly `Content-Length` bytes,
//! and never waits for EOF. Sizes are bounded: a broken or hostile peer cannot make it allocate without limit.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::sock::SocketAddr;

/// Largest response head accepted.
const MAX_HEAD: usize = 16 * 1024;
/// Largest response body accepted (Firecracker's biggest answer, `GET /vm/config`, is a few KiB).
const MAX_BODY: usize = 1024 * 1024;

/// HTTP methods Firecracker's API uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    Get,
    Put,
    Patch,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Put => "PUT",
            Method::Patch => "PATCH",
        }
    }
}

/// A complete response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub body: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Could not connect to the API socket.
    #[error("connect {path}: {source}")]
    Connect { path: String, source: std::io::Error },
    /// Reading or writing the socket failed.
    #[error("socket i/o: {0}")]
    Io(#[from] std::io::Error),
    /// No complete answer within the deadline.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The answer is not the HTTP/1.1 we expect.
    #[error("malformed response: {0}")]
    Malformed(String),
}

/// Sends one request on a fresh connection to `socket` and reads the whole response, all within `timeout`.
pub async fn request(
    socket: &SocketAddr,
    method: Method,
    path: &str,
    body: Option<&[u8]>,
    timeout: Duration,
) -> Result<Response, HttpError> {
    tokio::time::timeout(timeout, exchange(socket, method, path, body))
        .await
        .map_err(|_| HttpError::Timeout(timeout))?
}

async fn exchange(
    socket: &SocketAddr,
    method: Method,
    path: &str,
    body: Option<&[u8]>,
) -> Result<Response, HttpError> {
    let mut stream = socket.connect().await.map_err(|source| HttpError::Connect {
        path: socket.display(),
        source,
    })?;
    stream.write_all(&encode_request(method, path, body)).await?;
    stream.flush().await?;

    let mut buf = Vec::with_capacity(1024);
    let head_end = loop {
        if let Some(end) = find_head_end(&buf) {
            break end;
        }
        if buf.len() > MAX_HEAD {
            return Err(HttpError::Malformed(format!("head longer than {MAX_HEAD} bytes")));
        }
        let mut chunk = [0u8; 4096];
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Err(HttpError::Malformed(
                "connection closed before the end of the head".into(),
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = parse_head(&buf[..head_end])?;
    let mut body = buf.split_off(head_end);
    match head.content_length {
        Some(len) => {
            if len > MAX_BODY {
                return Err(HttpError::Malformed(format!(
                    "body of {len} bytes exceeds {MAX_BODY}"
                )));
            }
            if body.len() > len {
                return Err(HttpError::Malformed("more bytes than Content-Length".into()));
            }
            let already = body.len();
            body.resize(len, 0);
            stream.read_exact(&mut body[already..]).await?;
        }
        // Firecracker always sends a Content-Length with a body; without one there is none to wait for.
        None => body.clear(),
    }
    Ok(Response {
        status: head.status,
        body,
    })
}

/// Serialises a request with the headers Firecracker needs.
pub fn encode_request(method: Method, path: &str, body: Option<&[u8]>) -> Vec<u8> {
    let mut out = format!(
        "{} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n",
        method.as_str()
    )
    .into_bytes();
    if let Some(body) = body {
        out.extend_from_slice(
            format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                body.len()
            )
            .as_bytes(),
        );
    }
    out.extend_from_slice(b"\r\n");
    if let Some(body) = body {
        out.extend_from_slice(body);
    }
    out
}

/// Index just past the `\r\n\r\n` that ends the head, if it has arrived.
fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4)
}

/// What the client needs from a response head.
#[derive(Debug, PartialEq, Eq)]
pub struct Head {
    pub status: u16,
    pub content_length: Option<usize>,
}

/// Parses the status line and headers (everything up to and including the blank line).
pub fn parse_head(head: &[u8]) -> Result<Head, HttpError> {
    let text = std::str::from_utf8(head).map_err(|_| HttpError::Malformed("head is not UTF-8".into()))?;
    let mut lines = text.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if version != "HTTP/1.1" && version != "HTTP/1.0" {
        return Err(HttpError::Malformed(format!("status line {status_line:?}")));
    }
    let status = parts
        .next()
        .filter(|code| code.len() == 3 && code.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|code| code.parse::<u16>().ok())
        .ok_or_else(|| HttpError::Malformed(format!("status line {status_line:?}")))?;

    let mut content_length = None;
    for line in lines.filter(|l| !l.is_empty()) {
        let (name, value) = line
            .split_once(':')
            .ok_or_else(|| HttpError::Malformed(format!("header line {line:?}")))?;
        let name = name.trim();
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            let len = value
                .parse::<usize>()
                .map_err(|_| HttpError::Malformed(format!("Content-Length {value:?}")))?;
            if content_length.is_some_and(|prev| prev != len) {
                return Err(HttpError::Malformed("conflicting Content-Length".into()));
            }
            content_length = Some(len);
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::Malformed(format!(
                "unsupported Transfer-Encoding {value:?}"
            )));
        }
    }
    Ok(Head {
        status,
        content_length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_carries_length_and_body() {
        let req = encode_request(Method::Put, "/vm", Some(br#"{"state":"Paused"}"#));
        let text = String::from_utf8(req).expect("ascii");
        assert!(text.starts_with("PUT /vm HTTP/1.1\r\n"));
        assert!(text.contains("Content-Length: 18\r\n"));
        assert!(text.ends_with("\r\n\r\n{\"state\":\"Paused\"}"));
        let get = String::from_utf8(encode_request(Method::Get, "/", None)).expect("ascii");
        assert!(!get.contains("Content-Length"));
        assert!(get.ends_with("\r\n\r\n"));
    }

    #[test]
    fn parses_firecracker_heads() {
        // Firecracker sends an empty reason phrase.
        let head = b"HTTP/1.1 400 \r\nServer: Firecracker API\r\nContent-Length: 89\r\n\r\n";
        assert_eq!(
            parse_head(head).expect("valid"),
            Head {
                status: 400,
                content_length: Some(89)
            }
        );
        let head = b"HTTP/1.1 204 No Content\r\ncontent-length:0\r\n\r\n";
        assert_eq!(parse_head(head).expect("valid").content_length, Some(0));
        let head = b"HTTP/1.1 204 \r\n\r\n";
        assert_eq!(parse_head(head).expect("valid").content_length, None);
    }

    #[test]
    fn refuses_bad_heads() {
        for bad in [
            &b"SSH-2.0-OpenSSH\r\n\r\n"[..],
            b"HTTP/1.1 20 \r\n\r\n",
            b"HTTP/1.1 2000 \r\n\r\n",
            b"HTTP/1.1 +20 \r\n\r\n",
            b"HTTP/1.1 200 \r\nContent-Length: -1\r\n\r\n",
            b"HTTP/1.1 200 \r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            b"HTTP/1.1 200 \r\nTransfer-Encoding: chunked\r\n\r\n",
            b"HTTP/1.1 200 \r\nno colon here\r\n\r\n",
            b"HTTP/1.1 200 \xff\r\n\r\n",
        ] {
            assert!(parse_head(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn head_end_needs_the_blank_line() {
        assert_eq!(find_head_end(b"HTTP/1.1 200 \r\n"), None);
        assert_eq!(find_head_end(b"HTTP/1.1 200 \r\n\r\nxy"), Some(17));
    }
}
