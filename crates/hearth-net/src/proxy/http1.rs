//! Framing the HTTP/1 requests a guest sends on a proxied connection, so that every request on a kept-alive
//! connection is judged, not only the first.
//!
//! [`RequestFramer`] reads the guest->upstream byte stream as a sequence of requests (RFC 9112): a head (request
//! line and header fields, up to a size bound) and a body framed by `Content-Length` or by the chunked coding.
//! It hands every head to the caller before any of its bytes may be forwarded, and says how many bytes of body
//! follow. It is strict where a lenient reading could let the proxy and the server disagree about where a
//! request ends (request smuggling) or which host it is for; what it cannot frame with certainty is an error
//! (the proxy answers `400` and closes):
//! - line ends other than CRLF, control bytes, obsolete line folding, white space before a field's colon;
//! - `Content-Length` that is not one decimal number, given twice, or next to `Transfer-Encoding`;
//! - `Transfer-Encoding` whose last coding is not `chunked` (or that names `chunked` twice), or in HTTP/1.0;
//! - more than one `Host`;
//! - a protocol switch (`CONNECT`, `Upgrade`) anywhere but in the first request of a connection, with a body,
//!   or (`Upgrade`) to anything but `websocket` (an `h2c` connection would carry requests for any host);
//! - a head larger than the bound, a chunk-size line or a trailer section larger than theirs;
//! - an HTTP version other than 1.0 and 1.1 ([`FrameError::NotHttp1`]).
//!
//! Everything here is bounds-checked and never panics: the bytes are the guest's.

use super::sniff::{Sniff, http_host};

/// Longest chunk-size line (size, extensions and CRLF).
pub const MAX_CHUNK_LINE: usize = 4096;
/// Largest trailer section of a chunked body.
pub const MAX_TRAILERS: usize = 16 * 1024;

/// How a request's body is delimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// No body.
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// The chunked transfer coding.
    Chunked,
}

/// A request that asks the server to switch the connection to another protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Switch {
    /// `CONNECT`: a tunnel if the server answers 2xx.
    Connect,
    /// `Upgrade: websocket`: WebSocket frames if the server answers 101.
    WebSocket,
}

/// What the proxy needs to know about one request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    /// The host the request is for, read exactly as the sniffer reads a first request ([`http_host`]): `None`
    /// when it names none usable (no `Host`, an address literal, an absolute-form target that disagrees).
    pub host: Option<String>,
    pub body: Body,
    pub switch: Option<Switch>,
}

/// Why a request cannot be framed. Each message is short enough for a `400` body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The request line names a version other than HTTP/1.0 or HTTP/1.1 (e.g. the HTTP/2 preface).
    #[error("not an HTTP/1.0 or HTTP/1.1 request")]
    NotHttp1,
    /// No end of the head within the bound.
    #[error("request head larger than {0} bytes")]
    HeadTooLarge(usize),
    /// The request line is not `method SP target SP version`.
    #[error("malformed request line")]
    RequestLine,
    /// A header line is not `name: value` in the allowed bytes, or a line does not end in CRLF.
    #[error("malformed header field")]
    Header,
    /// Obsolete line folding (a header line starting with white space).
    #[error("obsolete line folding")]
    Folding,
    #[error("more than one Host header")]
    DuplicateHost,
    #[error("invalid Content-Length")]
    ContentLength,
    #[error("both Content-Length and Transfer-Encoding")]
    LengthAndEncoding,
    /// `Transfer-Encoding` without `chunked` last, `chunked` twice, or in an HTTP/1.0 request.
    #[error("unsupported Transfer-Encoding")]
    TransferEncoding,
    #[error("malformed chunk")]
    Chunk,
    #[error("chunked trailer section too large")]
    TrailersTooLarge,
    /// `Upgrade` to something other than `websocket`.
    #[error("protocol upgrade not allowed through the egress proxy")]
    Upgrade,
    /// `CONNECT` or `Upgrade` after the first request of a connection, or with a body.
    #[error("a protocol switch must be the first request of a connection, without a body")]
    Switch,
}

/// The next thing the caller must do with the input it passed to [`RequestFramer::step`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The first `len` bytes are a complete request head: judge `head`, then forward (or refuse) them.
    Head { len: usize, head: RequestHead },
    /// The first `n` (> 0) bytes are body or framing bytes of a judged request (or CRLFs between requests):
    /// forward them.
    Forward(usize),
    /// Nothing can be decided without more bytes: append more input and call again.
    NeedMore,
    /// The stream cannot be framed; the framer stays failed.
    Error(FrameError),
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Head,
    Length(u64),
    ChunkSize,
    ChunkData(u64),
    ChunkEnd,
    Trailers(usize),
    Failed(FrameError),
}

/// The request framer of one connection (see the module doc). Feed it the unforwarded guest bytes; every
/// [`Step`] but `NeedMore` and `Error` consumes the bytes it names from the front of the input.
#[derive(Debug, Clone)]
pub struct RequestFramer {
    state: State,
    max_head: usize,
    requests: u64,
}

impl RequestFramer {
    /// A framer for a new connection whose heads may be at most `max_head` bytes.
    pub fn new(max_head: usize) -> Self {
        RequestFramer {
            state: State::Head,
            max_head: max_head.max(16),
            requests: 0,
        }
    }

    /// Request heads seen so far.
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Whether the framer is between requests (every byte so far belongs to complete requests).
    pub fn at_boundary(&self) -> bool {
        self.state == State::Head
    }

    /// What to do with `input` (the guest bytes not forwarded yet, oldest first).
    pub fn step(&mut self, input: &[u8]) -> Step {
        let step = match &self.state {
            State::Failed(e) => return Step::Error(e.clone()),
            State::Head => self.head(input),
            State::Length(left) => {
                let left = *left;
                self.body_bytes(
                    input,
                    left,
                    |n| if n == 0 { State::Head } else { State::Length(n) },
                )
            }
            State::ChunkSize => self.chunk_size(input),
            State::ChunkData(left) => {
                let left = *left;
                self.body_bytes(input, left, |n| {
                    if n == 0 {
                        State::ChunkEnd
                    } else {
                        State::ChunkData(n)
                    }
                })
            }
            State::ChunkEnd => match input {
                [b'\r', b'\n', ..] => {
                    self.state = State::ChunkSize;
                    Step::Forward(2)
                }
                [] | [b'\r'] => Step::NeedMore,
                _ => Step::Error(FrameError::Chunk),
            },
            State::Trailers(seen) => {
                let seen = *seen;
                self.trailer(input, seen)
            }
        };
        if let Step::Error(e) = &step {
            self.state = State::Failed(e.clone());
        }
        step
    }

    fn body_bytes(&mut self, input: &[u8], left: u64, next: impl Fn(u64) -> State) -> Step {
        if input.is_empty() {
            return Step::NeedMore;
        }
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(input.len());
        self.state = next(left - n as u64);
        Step::Forward(n)
    }

    fn head(&mut self, input: &[u8]) -> Step {
        // Empty lines before a request line are ignored by servers (RFC 9112 2.2): pass them on.
        if input.starts_with(b"\r\n") {
            return Step::Forward(2);
        }
        let window = &input[..input.len().min(self.max_head)];
        let Some(end) = find(window, b"\r\n\r\n") else {
            return if input.len() >= self.max_head {
                Step::Error(FrameError::HeadTooLarge(self.max_head))
            } else {
                Step::NeedMore
            };
        };
        let len = end + 4;
        match parse_head(&input[..len], self.requests == 0) {
            Ok(head) => {
                self.requests += 1;
                self.state = match head.body {
                    Body::Empty | Body::Length(0) => State::Head,
                    Body::Length(n) => State::Length(n),
                    Body::Chunked => State::ChunkSize,
                };
                Step::Head { len, head }
            }
            Err(e) => Step::Error(e),
        }
    }

    fn chunk_size(&mut self, input: &[u8]) -> Step {
        let window = &input[..input.len().min(MAX_CHUNK_LINE)];
        let Some(end) = find(window, b"\r\n") else {
            return if input.len() >= MAX_CHUNK_LINE || window.contains(&b'\n') {
                Step::Error(FrameError::Chunk)
            } else {
                Step::NeedMore
            };
        };
        let line = &input[..end];
        let digits = line.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        if digits == 0 || digits > 16 {
            return Step::Error(FrameError::Chunk);
        }
        // Extensions: `;name[=value]` after optional white space, in visible bytes only.
        let ext = &line[digits..];
        let ext_ok = ext.is_empty()
            || (ext.iter().take_while(|b| matches!(b, b' ' | b'\t')).count() < ext.len()
                && ext.iter().find(|b| !matches!(b, b' ' | b'\t')) == Some(&b';')
                && ext
                    .iter()
                    .all(|b| *b == b'\t' || (0x20..0x7f).contains(b) || *b >= 0x80));
        if !ext_ok {
            return Step::Error(FrameError::Chunk);
        }
        let Some(size) = std::str::from_utf8(&line[..digits])
            .ok()
            .and_then(|s| u64::from_str_radix(s, 16).ok())
        else {
            return Step::Error(FrameError::Chunk);
        };
        self.state = if size == 0 {
            State::Trailers(0)
        } else {
            State::ChunkData(size)
        };
        Step::Forward(end + 2)
    }

    fn trailer(&mut self, input: &[u8], seen: usize) -> Step {
        if input.starts_with(b"\r\n") {
            self.state = State::Head;
            return Step::Forward(2);
        }
        let room = MAX_TRAILERS.saturating_sub(seen);
        let window = &input[..input.len().min(room)];
        // The decision depends only on the bytes up to the first LF, so it does not depend on how the bytes
        // arrive: a bare LF is refused, a line ending in CRLF is judged as a field.
        let Some(lf) = window.iter().position(|b| *b == b'\n') else {
            return if input.len() >= room {
                Step::Error(FrameError::TrailersTooLarge)
            } else {
                Step::NeedMore
            };
        };
        if lf == 0 || window[lf - 1] != b'\r' {
            return Step::Error(FrameError::Header);
        }
        let end = lf - 1;
        if let Err(e) = field(&input[..end]) {
            return Step::Error(e);
        }
        self.state = State::Trailers(seen + end + 2);
        Step::Forward(end + 2)
    }
}

/// Parses one complete head (ending in CRLF CRLF). `first`: whether it is the connection's first request.
pub fn parse_head(head: &[u8], first: bool) -> Result<RequestHead, FrameError> {
    let text = head.strip_suffix(b"\r\n\r\n").ok_or(FrameError::Header)?;
    // Lines end in CRLF: split on LF, then every line but the last (whose CRLF went with the suffix) must end
    // in CR. A CR or LF left anywhere else is refused by the line checks below.
    let lines: Vec<&[u8]> = text.split(|b| *b == b'\n').collect();
    let last = lines.len().saturating_sub(1);
    let mut lines = lines.iter().enumerate().map(|(i, line)| {
        if i == last {
            Ok(*line)
        } else {
            line.strip_suffix(b"\r").ok_or(FrameError::Header)
        }
    });
    let request_line = lines.next().ok_or(FrameError::RequestLine)??;
    let (method, http10) = request_line_parts(request_line)?;
    let mut fields = Fields::default();
    for line in lines {
        fields.add(line?)?;
    }
    let body = fields.body(http10)?;
    let switch = if method == b"CONNECT" {
        Some(Switch::Connect)
    } else {
        match &fields.upgrade {
            None => None,
            Some(v) if v.trim_ascii().eq_ignore_ascii_case(b"websocket") => Some(Switch::WebSocket),
            Some(_) => return Err(FrameError::Upgrade),
        }
    };
    if switch.is_some() && (!first || body != Body::Empty) {
        return Err(FrameError::Switch);
    }
    let host = match http_host(head) {
        Sniff::Http(name) => Some(name),
        _ => None,
    };
    Ok(RequestHead { host, body, switch })
}

/// The method of a `method SP target SP HTTP/1.x` line, and whether the version is 1.0.
fn request_line_parts(line: &[u8]) -> Result<(&[u8], bool), FrameError> {
    let mut parts = line.split(|b| *b == b' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(FrameError::RequestLine);
    };
    if method.is_empty() || !method.iter().all(|b| is_tchar(*b)) {
        return Err(FrameError::RequestLine);
    }
    if target.is_empty() || !target.iter().all(|b| (0x21..0x7f).contains(b)) {
        return Err(FrameError::RequestLine);
    }
    match version {
        b"HTTP/1.1" => Ok((method, false)),
        b"HTTP/1.0" => Ok((method, true)),
        v if v.starts_with(b"HTTP/") && v.iter().all(|b| (0x21..0x7f).contains(b)) => {
            Err(FrameError::NotHttp1)
        }
        _ => Err(FrameError::RequestLine),
    }
}

/// The header fields the framing depends on.
#[derive(Default)]
struct Fields {
    content_length: Option<u64>,
    transfer_encoding: Option<Vec<u8>>,
    hosts: usize,
    upgrade: Option<Vec<u8>>,
}

impl Fields {
    fn add(&mut self, line: &[u8]) -> Result<(), FrameError> {
        let (name, value) = field(line)?;
        if name.eq_ignore_ascii_case(b"content-length") {
            if self.content_length.is_some()
                || value.is_empty()
                || value.len() > 19
                || !value.iter().all(u8::is_ascii_digit)
            {
                return Err(FrameError::ContentLength);
            }
            let n = std::str::from_utf8(value)
                .ok()
                .and_then(|s| s.parse::<u64>().ok())
                .ok_or(FrameError::ContentLength)?;
            self.content_length = Some(n);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            let te = self.transfer_encoding.get_or_insert_with(Vec::new);
            if !te.is_empty() {
                te.push(b',');
            }
            te.extend_from_slice(value);
        } else if name.eq_ignore_ascii_case(b"host") {
            self.hosts += 1;
            if self.hosts > 1 {
                return Err(FrameError::DuplicateHost);
            }
        } else if name.eq_ignore_ascii_case(b"upgrade") {
            if self.upgrade.is_some() {
                return Err(FrameError::Upgrade);
            }
            self.upgrade = Some(value.to_vec());
        }
        Ok(())
    }

    fn body(&self, http10: bool) -> Result<Body, FrameError> {
        match (&self.transfer_encoding, self.content_length) {
            (Some(_), Some(_)) => Err(FrameError::LengthAndEncoding),
            (Some(_), None) if http10 => Err(FrameError::TransferEncoding),
            (Some(te), None) => {
                let codings: Vec<&[u8]> = te
                    .split(|b| *b == b',')
                    .map(<[u8]>::trim_ascii)
                    .filter(|c| !c.is_empty())
                    .collect();
                let chunked = |c: &&[u8]| c.eq_ignore_ascii_case(b"chunked");
                match codings.split_last() {
                    Some((last, rest)) if chunked(last) && !rest.iter().any(chunked) => Ok(Body::Chunked),
                    _ => Err(FrameError::TransferEncoding),
                }
            }
            (None, Some(n)) => Ok(Body::Length(n)),
            (None, None) => Ok(Body::Empty),
        }
    }
}

/// `name: value` (value without surrounding white space) of one field line.
fn field(line: &[u8]) -> Result<(&[u8], &[u8]), FrameError> {
    if line.first().is_some_and(|b| matches!(b, b' ' | b'\t')) {
        return Err(FrameError::Folding);
    }
    let colon = line.iter().position(|b| *b == b':').ok_or(FrameError::Header)?;
    let (name, value) = (&line[..colon], &line[colon + 1..]);
    if name.is_empty() || !name.iter().all(|b| is_tchar(*b)) {
        return Err(FrameError::Header);
    }
    if !value
        .iter()
        .all(|b| *b == b'\t' || (0x20..0x7f).contains(b) || *b >= 0x80)
    {
        return Err(FrameError::Header);
    }
    Ok((name, value.trim_ascii()))
}

/// RFC 9110 `tchar`.
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[derive(Debug, Clone, PartialEq, Eq)]
    enum Ev {
        Head(Option<String>, Body, Option<Switch>, Vec<u8>),
        Bytes(Vec<u8>),
        Error(FrameError),
    }

    /// Feeds `input` in pieces of `piece` bytes, as the proxy does, and returns what the framer said, with
    /// consecutive forwarded bytes merged.
    fn frame(input: &[u8], piece: usize) -> Vec<Ev> {
        let mut framer = RequestFramer::new(256);
        let mut pending: Vec<u8> = Vec::new();
        let mut out: Vec<Ev> = Vec::new();
        let mut rest = input;
        loop {
            match framer.step(&pending) {
                Step::Head { len, head } => {
                    out.push(Ev::Head(
                        head.host,
                        head.body,
                        head.switch,
                        pending[..len].to_vec(),
                    ));
                    pending.drain(..len);
                }
                Step::Forward(n) => {
                    assert!(n > 0 && n <= pending.len());
                    match out.last_mut() {
                        Some(Ev::Bytes(b)) => b.extend_from_slice(&pending[..n]),
                        _ => out.push(Ev::Bytes(pending[..n].to_vec())),
                    }
                    pending.drain(..n);
                }
                Step::NeedMore if rest.is_empty() => return out,
                Step::NeedMore => {
                    let n = piece.min(rest.len());
                    pending.extend_from_slice(&rest[..n]);
                    rest = &rest[n..];
                }
                Step::Error(e) => {
                    out.push(Ev::Error(e));
                    return out;
                }
            }
        }
    }

    /// The same events whatever the piece size.
    fn frame_any(input: &[u8]) -> Vec<Ev> {
        let whole = frame(input, input.len().max(1));
        for piece in [1, 2, 3, 7, 64] {
            assert_eq!(frame(input, piece), whole, "piece {piece} of {input:?}");
        }
        whole
    }

    fn head(host: &str, body: Body, raw: &str) -> Ev {
        Ev::Head(Some(host.into()), body, None, raw.as_bytes().to_vec())
    }

    #[test]
    fn kept_alive_requests_are_each_framed() {
        let r1 = "GET /a HTTP/1.1\r\nHost: a.test\r\n\r\n";
        let r2 = "POST /b HTTP/1.1\r\nHost: A.test:80\r\nContent-Length: 5\r\n\r\n";
        let r3 = "PUT /c HTTP/1.1\r\nhost: b.test\r\ntransfer-encoding: gzip, Chunked\r\n\r\n";
        let chunks = "5;ext=1\r\nhello\r\nA\r\n0123456789\r\n0\r\nX-Sum: 1\r\n\r\n";
        let r4 = "GET / HTTP/1.0\r\n\r\n";
        let input = format!("{r1}{r2}12345\r\n{r3}{chunks}{r4}GET /tail");
        assert_eq!(
            frame_any(input.as_bytes()),
            vec![
                head("a.test", Body::Empty, r1),
                head("a.test", Body::Length(5), r2),
                Ev::Bytes(b"12345\r\n".to_vec()),
                head("b.test", Body::Chunked, r3),
                Ev::Bytes(chunks.as_bytes().to_vec()),
                Ev::Head(None, Body::Empty, None, r4.as_bytes().to_vec()),
            ]
        );
    }

    #[test]
    fn hosts_are_read_like_the_sniffer_reads_them() {
        for (req, host) in [
            (
                "GET http://x.test/ HTTP/1.1\r\nHost: x.test\r\n\r\n",
                Some("x.test"),
            ),
            ("GET http://y.test/ HTTP/1.1\r\nHost: x.test\r\n\r\n", None),
            ("GET / HTTP/1.1\r\nHost: 203.0.113.9\r\n\r\n", None),
            ("GET / HTTP/1.1\r\nHost: X.Test.\r\n\r\n", Some("x.test")),
        ] {
            let got = parse_head(req.as_bytes(), true).unwrap().host;
            assert_eq!(got.as_deref(), host, "{req:?}");
        }
        // Bytes beyond ASCII in another field's value are allowed and do not hide the host.
        let latin1 = b"GET / HTTP/1.1\r\nX-Name: caf\xe9\r\nHost: a.test\r\n\r\n";
        assert_eq!(parse_head(latin1, true).unwrap().host.as_deref(), Some("a.test"));
    }

    #[test]
    fn protocol_switches_only_first_and_only_websocket() {
        let ws = "GET /ws HTTP/1.1\r\nHost: a.test\r\nConnection: Upgrade\r\nUpgrade: WebSocket\r\n\r\n";
        assert_eq!(
            parse_head(ws.as_bytes(), true).unwrap().switch,
            Some(Switch::WebSocket)
        );
        assert_eq!(parse_head(ws.as_bytes(), false), Err(FrameError::Switch));
        let connect = "CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n";
        let h = parse_head(connect.as_bytes(), true).unwrap();
        assert_eq!((h.switch, h.host), (Some(Switch::Connect), None));
        let with_body = "CONNECT a.test:443 HTTP/1.1\r\nContent-Length: 1\r\n\r\n";
        assert_eq!(parse_head(with_body.as_bytes(), true), Err(FrameError::Switch));
        let h2c = "GET / HTTP/1.1\r\nHost: a.test\r\nUpgrade: h2c\r\nHTTP2-Settings: AAA\r\n\r\n";
        assert_eq!(parse_head(h2c.as_bytes(), true), Err(FrameError::Upgrade));
        // The framer counts: a WebSocket upgrade after a first request is refused.
        let input = format!("GET / HTTP/1.1\r\nHost: a.test\r\n\r\n{ws}");
        assert_eq!(
            frame_any(input.as_bytes()).pop(),
            Some(Ev::Error(FrameError::Switch))
        );
    }

    #[test]
    fn what_cannot_be_framed_for_sure_is_an_error() {
        let cases: &[(&str, FrameError)] = &[
            ("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", FrameError::NotHttp1),
            ("GET / HTTP/1.2\r\n\r\n", FrameError::NotHttp1),
            ("GET /  HTTP/1.1\r\n\r\n", FrameError::RequestLine),
            ("GET / HTTP/1.1 x\r\n\r\n", FrameError::RequestLine),
            ("G(T / HTTP/1.1\r\n\r\n", FrameError::RequestLine),
            ("GET /\x01 HTTP/1.1\r\n\r\n", FrameError::RequestLine),
            ("GET / HTTP/1.1\nHost: a.test\r\n\r\n", FrameError::Header),
            ("GET / HTTP/1.1\r\nX: y\nHost: a.test\r\n\r\n", FrameError::Header),
            ("GET / HTTP/1.1\r\nX: y\rHost: a.test\r\n\r\n", FrameError::Header),
            ("GET / HTTP/1.1\r\nHost : a.test\r\n\r\n", FrameError::Header),
            ("GET / HTTP/1.1\r\nHost a.test\r\n\r\n", FrameError::Header),
            ("GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", FrameError::Header),
            ("GET / HTTP/1.1\r\nX: a\r\n folded\r\n\r\n", FrameError::Folding),
            (
                "GET / HTTP/1.1\r\nHost: a.test\r\nHost: b.test\r\n\r\n",
                FrameError::DuplicateHost,
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\n",
                FrameError::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 1, 1\r\n\r\n",
                FrameError::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: +1\r\n\r\n",
                FrameError::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
                FrameError::ContentLength,
            ),
            (
                "POST / HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
                FrameError::LengthAndEncoding,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked, gzip\r\n\r\n",
                FrameError::TransferEncoding,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
                FrameError::TransferEncoding,
            ),
            (
                "POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                FrameError::TransferEncoding,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nx\r\n",
                FrameError::Chunk,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1 x\r\n",
                FrameError::Chunk,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\nab",
                FrameError::Chunk,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\naXY",
                FrameError::Chunk,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n10000000000000000\r\n",
                FrameError::Chunk,
            ),
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nbad trailer\r\n\r\n",
                FrameError::Header,
            ),
            // Found by the fuzzer: a folded trailer line with a bare LF before the next CRLF is the same error
            // whether the bytes arrive at once or in pieces.
            (
                "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nA: b\r\n \n\nC: d\r\n\r\n",
                FrameError::Header,
            ),
        ];
        for (input, want) in cases {
            let got = frame_any(input.as_bytes());
            assert_eq!(got.last(), Some(&Ev::Error(want.clone())), "{input:?}: {got:?}");
        }
        // Bounds: a head, a chunk line and a trailer section that never end.
        let big = format!("GET / HTTP/1.1\r\nX: {}", "a".repeat(300));
        assert_eq!(
            frame_any(big.as_bytes()).pop(),
            Some(Ev::Error(FrameError::HeadTooLarge(256)))
        );
        let line = format!(
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1;{}",
            "e".repeat(MAX_CHUNK_LINE)
        );
        assert_eq!(
            frame(line.as_bytes(), 1000).pop(),
            Some(Ev::Error(FrameError::Chunk))
        );
        let trailers = format!(
            "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n{}",
            "X: y\r\n".repeat(MAX_TRAILERS / 6 + 1)
        );
        assert_eq!(
            frame(trailers.as_bytes(), 1000).pop(),
            Some(Ev::Error(FrameError::TrailersTooLarge))
        );
        // Once failed, always failed.
        let mut f = RequestFramer::new(256);
        assert!(matches!(
            f.step(b"GET / HTTP/1.1\r\nX : y\r\n\r\n"),
            Step::Error(_)
        ));
        assert!(matches!(f.step(b"GET / HTTP/1.1\r\n\r\n"), Step::Error(_)));
    }

    #[test]
    fn empty_lines_between_requests_pass_and_boundaries_are_known() {
        let mut f = RequestFramer::new(256);
        assert!(f.at_boundary());
        assert_eq!(f.step(b"\r\nGET"), Step::Forward(2));
        assert_eq!(f.step(b"GET"), Step::NeedMore);
        let Step::Head { len, .. } = f.step(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nab") else {
            panic!()
        };
        assert_eq!(len, 38);
        assert!(!f.at_boundary());
        assert_eq!(f.step(b"abGET"), Step::Forward(2));
        assert!(f.at_boundary());
        assert_eq!(f.requests(), 1);
    }
}
