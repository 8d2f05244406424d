//! The Connect protocol (connectrpc.com/docs/protocol) with the JSON codec, as far as envd's clients use it:
//! - unary: `POST /pkg.Service/Method`, `Content-Type: application/json`, the message as the body; the answer
//!   is the message, or an error status with `{"code": "not_found", "message": "…"}`;
//! - server streaming: `Content-Type: application/connect+json`, the request is one enveloped message
//!   (1 flag byte, 4-byte big-endian length, JSON); the answer is `200` with enveloped messages and a final
//!   end-of-stream envelope (flag `0x02`) carrying `{}` or `{"error": {...}}`;
//! - client streaming (`StreamInput`): enveloped messages in the request body, one message in the answer.
//!
//! Compressed envelopes are refused (the SDKs never compress). `Connect-Timeout-Ms` is honoured.

use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::{Buf, Bytes, BytesMut};
use futures::{Stream, StreamExt};
use serde::de::DeserializeOwned;

/// Content type of unary JSON messages.
pub const UNARY_JSON: &str = "application/json";
/// Content type of streamed JSON messages.
pub const STREAM_JSON: &str = "application/connect+json";
/// Largest request message accepted (stdin chunks and paths are small; file content goes over `/files`).
pub const MAX_MESSAGE: usize = 4 * 1024 * 1024;
/// Envelope flag of the end-of-stream message.
const END_STREAM: u8 = 0x02;
/// Envelope flag of a compressed message.
const COMPRESSED: u8 = 0x01;

/// Connect's error codes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Unimplemented,
    Internal,
    Unavailable,
    Unauthenticated,
}

impl Code {
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// The HTTP status of a unary error with this code (the protocol's table).
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal => 500,
            Code::InvalidArgument | Code::FailedPrecondition => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }
}

/// A failed call: the code and the message the SDK shows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}: {message}", code.as_str())]
pub struct Fault {
    pub code: Code,
    pub message: String,
}

impl Fault {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Fault {
            code,
            message: message.into(),
        }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(Code::InvalidArgument, message)
    }

    /// The Connect error object.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({ "code": self.code.as_str(), "message": self.message })
    }

    /// A unary error answer (also what a streaming call gets when it fails before its stream starts).
    pub fn unary_response(&self) -> Response {
        let status =
            StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            [(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON))],
            self.json().to_string(),
        )
            .into_response()
    }
}

/// A unary answer: the message as JSON.
pub fn unary_ok(msg: serde_json::Value) -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static(UNARY_JSON))],
        msg.to_string(),
    )
        .into_response()
}

/// A unary call's outcome as a response.
pub fn unary(result: Result<serde_json::Value, Fault>) -> Response {
    match result {
        Ok(msg) => unary_ok(msg),
        Err(f) => f.unary_response(),
    }
}

/// Whether `content_type` is `want` (ignoring parameters and case).
fn is_content_type(headers: &HeaderMap, want: &str) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim())
        .is_some_and(|v| v.eq_ignore_ascii_case(want))
}

/// Decodes a unary request's message.
pub fn decode_unary<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, Fault> {
    if !is_content_type(headers, UNARY_JSON) {
        return Err(Fault::new(
            Code::Unimplemented,
            "only the JSON codec (application/json) is supported",
        ));
    }
    parse_json(body)
}

fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, Fault> {
    let body = if body.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        body
    };
    serde_json::from_slice(body).map_err(|e| Fault::invalid(format!("invalid request message: {e}")))
}

/// Splits the first complete envelope off `buf`: `Ok(None)` while it is incomplete.
pub fn split_envelope(buf: &mut BytesMut) -> Result<Option<(u8, Bytes)>, Fault> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let flags = buf[0];
    let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
    if len > MAX_MESSAGE {
        return Err(Fault::new(
            Code::ResourceExhausted,
            format!("message larger than {MAX_MESSAGE} bytes"),
        ));
    }
    if flags & COMPRESSED != 0 {
        return Err(Fault::new(
            Code::Unimplemented,
            "compressed messages are not supported",
        ));
    }
    if buf.len() < 5 + len {
        return Ok(None);
    }
    buf.advance(5);
    Ok(Some((flags, buf.split_to(len).freeze())))
}

/// Decodes the single enveloped request message of a server-streaming call.
pub fn decode_stream_request<T: DeserializeOwned>(headers: &HeaderMap, body: &[u8]) -> Result<T, Fault> {
    if !is_content_type(headers, STREAM_JSON) {
        return Err(Fault::new(
            Code::Unimplemented,
            "only the JSON codec (application/connect+json) is supported",
        ));
    }
    let mut buf = BytesMut::from(body);
    match split_envelope(&mut buf)? {
        Some((_, msg)) if buf.is_empty() => parse_json(&msg),
        Some(_) => Err(Fault::invalid(
            "a server-streaming call takes exactly one message",
        )),
        None => Err(Fault::invalid("truncated request envelope")),
    }
}

/// Decodes one message of a client stream.
pub fn decode_message<T: DeserializeOwned>(msg: &[u8]) -> Result<T, Fault> {
    parse_json(msg)
}

/// `flags` + length + `payload`.
pub fn envelope(flags: u8, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + payload.len());
    out.extend_from_slice(&[flags]);
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
    out.freeze()
}

/// One streamed message.
pub fn message(msg: &serde_json::Value) -> Bytes {
    envelope(0, msg.to_string().as_bytes())
}

/// The end-of-stream envelope: success, or the error.
pub fn end_stream(fault: Option<&Fault>) -> Bytes {
    let body = match fault {
        None => serde_json::json!({}),
        Some(f) => serde_json::json!({ "error": f.json() }),
    };
    envelope(END_STREAM, body.to_string().as_bytes())
}

/// A streaming answer whose body is `frames` (already enveloped, ending with [`end_stream`]).
pub fn stream_response(frames: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    let body = Body::from_stream(frames.map(Ok::<Bytes, std::convert::Infallible>));
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, HeaderValue::from_static(STREAM_JSON))],
        body,
    )
        .into_response()
}

/// A streaming call that failed before its stream began: `200` with only the end-of-stream error.
pub fn stream_error(fault: &Fault) -> Response {
    let frame = end_stream(Some(fault));
    stream_response(futures::stream::once(async move { frame }))
}

/// The call's deadline from `Connect-Timeout-Ms` (at most 10 digits, as the protocol says).
pub fn timeout(headers: &HeaderMap) -> Result<Option<Duration>, Fault> {
    let Some(v) = headers.get("connect-timeout-ms") else {
        return Ok(None);
    };
    let v = v.to_str().unwrap_or("").trim();
    if v.is_empty() || v.len() > 10 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Fault::invalid("invalid Connect-Timeout-Ms"));
    }
    let ms: u64 = v
        .parse()
        .map_err(|_| Fault::invalid("invalid Connect-Timeout-Ms"))?;
    Ok(Some(Duration::from_millis(ms)))
}

/// How often a long stream sends a keep-alive message: E2B's `Keepalive-Ping-Interval` (seconds), 50 s when
/// absent, within 1..=300 s.
pub fn keepalive(headers: &HeaderMap) -> Duration {
    let secs = headers
        .get("keepalive-ping-interval")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(50)
        .clamp(1, 300);
    Duration::from_secs(secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json_headers(ct: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
        h
    }

    #[test]
    fn envelopes_round_trip_and_split_at_any_point() {
        let a = envelope(0, br#"{"a":1}"#);
        let b = end_stream(Some(&Fault::new(Code::NotFound, "gone")));
        let mut whole = Vec::new();
        whole.extend_from_slice(&a);
        whole.extend_from_slice(&b);
        for cut in 0..whole.len() {
            let mut buf = BytesMut::from(&whole[..cut]);
            let mut got = Vec::new();
            while let Ok(Some(m)) = split_envelope(&mut buf) {
                got.push(m);
            }
            buf.extend_from_slice(&whole[cut..]);
            while let Ok(Some(m)) = split_envelope(&mut buf) {
                got.push(m);
            }
            assert_eq!(got.len(), 2, "cut at {cut}");
            assert_eq!(got[0], (0, Bytes::from_static(br#"{"a":1}"#)));
            assert_eq!(got[1].0, END_STREAM);
            let end: serde_json::Value = serde_json::from_slice(&got[1].1).unwrap_or_default();
            assert_eq!(end["error"]["code"], "not_found");
        }
    }

    #[test]
    fn hostile_envelopes_are_refused() {
        let mut huge = BytesMut::from(&[0u8, 0xff, 0xff, 0xff, 0xff][..]);
        assert_eq!(
            split_envelope(&mut huge).map_err(|f| f.code),
            Err(Code::ResourceExhausted)
        );
        let mut gz = BytesMut::from(&envelope(COMPRESSED, b"x")[..]);
        assert_eq!(
            split_envelope(&mut gz).map_err(|f| f.code),
            Err(Code::Unimplemented)
        );
        let h = json_headers(STREAM_JSON);
        let two = [envelope(0, b"{}"), envelope(0, b"{}")].concat();
        assert!(decode_stream_request::<serde_json::Value>(&h, &two).is_err());
        assert!(decode_stream_request::<serde_json::Value>(&h, &[0, 0]).is_err());
        assert!(decode_stream_request::<serde_json::Value>(&h, &envelope(0, b"{not json")).is_err());
        let v: Result<serde_json::Value, _> = decode_stream_request(&h, &envelope(0, br#"{"x":2}"#));
        assert_eq!(v.map(|v| v["x"].clone()), Ok(serde_json::json!(2)));
        assert_eq!(
            decode_unary::<serde_json::Value>(&json_headers("application/proto"), b"").map_err(|f| f.code),
            Err(Code::Unimplemented)
        );
        assert_eq!(
            decode_unary::<serde_json::Value>(&json_headers("application/json; charset=utf-8"), b""),
            Ok(serde_json::json!({}))
        );
    }

    #[test]
    fn deadlines_and_keepalives_come_from_headers() {
        let mut h = HeaderMap::new();
        assert_eq!(timeout(&h), Ok(None));
        assert_eq!(keepalive(&h), Duration::from_secs(50));
        h.insert("connect-timeout-ms", HeaderValue::from_static("1500"));
        h.insert("keepalive-ping-interval", HeaderValue::from_static("0"));
        assert_eq!(timeout(&h), Ok(Some(Duration::from_millis(1500))));
        assert_eq!(keepalive(&h), Duration::from_secs(1));
        h.insert("connect-timeout-ms", HeaderValue::from_static("12345678901"));
        assert!(timeout(&h).is_err());
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::Unauthenticated.as_str(), "unauthenticated");
    }
}
