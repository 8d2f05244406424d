//! Reading the name a connection is for from its first bytes: the SNI of a TLS ClientHello or the Host header
//! of an HTTP/1 request. The input is the guest's and hostile: every length is checked, nothing panics, and
//! anything ambiguous yields no name (then the connection's address decides, never the name).

use crate::policy::guest_hostname;

/// What the first bytes of a connection tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sniff {
    /// More bytes are needed to tell.
    Incomplete,
    /// A TLS ClientHello naming this server.
    Tls(String),
    /// An HTTP/1 request for this host.
    Http(String),
    /// The bytes name no host (another protocol, no SNI, malformed or ambiguous input).
    NoName { http: bool },
}

impl Sniff {
    /// The host name, if any.
    pub fn name(&self) -> Option<&str> {
        match self {
            Sniff::Tls(n) | Sniff::Http(n) => Some(n),
            _ => None,
        }
    }

    /// Whether the bytes are an HTTP request (so a refusal can be answered in HTTP).
    pub fn is_http(&self) -> bool {
        matches!(self, Sniff::Http(_) | Sniff::NoName { http: true })
    }
}

/// Looks at the first bytes of a connection.
pub fn sniff(buf: &[u8]) -> Sniff {
    match buf.first() {
        None => Sniff::Incomplete,
        Some(0x16) => tls_sni(buf),
        Some(b) if b.is_ascii_uppercase() => http_host(buf),
        Some(_) => Sniff::NoName { http: false },
    }
}

/// A bounds-checked reader over a byte slice.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Reader { buf }
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Some(head)
    }

    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }

    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| usize::from(u16::from_be_bytes([b[0], b[1]])))
    }

    fn u24(&mut self) -> Option<usize> {
        self.take(3)
            .map(|b| (usize::from(b[0]) << 16) | (usize::from(b[1]) << 8) | usize::from(b[2]))
    }

    /// A sub-reader over a `u8`/`u16`-length-prefixed vector.
    fn vec8(&mut self) -> Option<Reader<'a>> {
        let n = usize::from(self.u8()?);
        self.take(n).map(Reader::new)
    }

    fn vec16(&mut self) -> Option<Reader<'a>> {
        let n = self.u16()?;
        self.take(n).map(Reader::new)
    }

    fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

const TLS_HANDSHAKE: u8 = 0x16;
const CLIENT_HELLO: u8 = 1;
const EXT_SERVER_NAME: usize = 0;
/// Largest TLS record payload (2^14) plus the expansion a TLSPlaintext may not exceed anyway.
const MAX_RECORD: usize = 16384 + 2048;

/// The SNI of a ClientHello at the start of `buf`, which may span several TLS records.
pub fn tls_sni(buf: &[u8]) -> Sniff {
    let no = Sniff::NoName { http: false };
    // Gather the handshake bytes from consecutive handshake records.
    let mut handshake = Vec::new();
    let mut rest = Reader::new(buf);
    loop {
        if rest.buf.len() < 5 {
            break;
        }
        let Some(header) = rest.take(5) else { return no };
        if header[0] != TLS_HANDSHAKE || header[1] != 3 {
            return no;
        }
        let len = usize::from(u16::from_be_bytes([header[3], header[4]]));
        if len == 0 || len > MAX_RECORD {
            return no;
        }
        match rest.take(len) {
            Some(fragment) => handshake.extend_from_slice(fragment),
            None => {
                handshake.extend_from_slice(rest.buf);
                break;
            }
        }
        if handshake_complete(&handshake) {
            break;
        }
    }
    let mut hs = Reader::new(&handshake);
    match hs.u8() {
        None => return Sniff::Incomplete,
        Some(CLIENT_HELLO) => {}
        Some(_) => return no,
    }
    let Some(len) = hs.u24() else {
        return Sniff::Incomplete;
    };
    let Some(body) = hs.take(len) else {
        return Sniff::Incomplete;
    };
    match client_hello_sni(body) {
        Some(Some(name)) => Sniff::Tls(name),
        _ => no,
    }
}

fn handshake_complete(handshake: &[u8]) -> bool {
    let mut r = Reader::new(handshake);
    r.u8().is_some() && r.u24().is_some_and(|len| r.buf.len() >= len)
}

/// `None` if malformed; `Some(None)` if well formed without a usable host name.
fn client_hello_sni(body: &[u8]) -> Option<Option<String>> {
    let mut r = Reader::new(body);
    r.take(2)?; // legacy_version
    r.take(32)?; // random
    let session_id = r.vec8()?;
    if session_id.buf.len() > 32 {
        return None;
    }
    let suites = r.vec16()?;
    if suites.buf.is_empty() || suites.buf.len() % 2 != 0 {
        return None;
    }
    r.vec8()?; // compression methods
    if r.is_empty() {
        return Some(None); // no extensions at all
    }
    let mut exts = r.vec16()?;
    if !r.is_empty() {
        return None;
    }
    let mut found: Option<Option<String>> = None;
    while !exts.is_empty() {
        let kind = exts.u16()?;
        let mut data = exts.vec16()?;
        if kind != EXT_SERVER_NAME {
            continue;
        }
        if found.is_some() {
            return None; // a second server_name extension: ambiguous
        }
        let mut list = data.vec16()?;
        if !data.is_empty() {
            return None;
        }
        let mut host = None;
        while !list.is_empty() {
            let name_type = list.u8()?;
            let name = list.vec16()?;
            if name_type == 0 {
                if host.is_some() {
                    return None; // two host names: ambiguous
                }
                host = Some(std::str::from_utf8(name.buf).ok().and_then(guest_hostname));
            }
        }
        found = Some(host.flatten());
    }
    Some(found.flatten())
}

/// The Host of an HTTP/1 request at the start of `buf`.
pub fn http_host(buf: &[u8]) -> Sniff {
    let no = Sniff::NoName { http: true };
    // The method: 1-20 upper-case letters and a space.
    let method_len = buf.iter().take(21).take_while(|b| b.is_ascii_uppercase()).count();
    if method_len == buf.len() && method_len <= 20 {
        return Sniff::Incomplete;
    }
    if method_len == 0 || method_len > 20 || buf[method_len] != b' ' {
        return Sniff::NoName { http: false };
    }
    let Some(end) = find(buf, b"\r\n\r\n") else {
        return if buf.iter().all(|b| *b != 0) {
            Sniff::Incomplete
        } else {
            no
        };
    };
    // Header values other than Host may hold any byte a server accepts (obs-text): only the request line and
    // the Host value must be text.
    let mut lines = split_crlf(&buf[..end]);
    let Ok(request_line) = std::str::from_utf8(lines.next().unwrap_or_default()) else {
        return no;
    };
    let mut parts = request_line.split(' ');
    let (Some(_method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return no;
    };
    if !version.starts_with("HTTP/1.") {
        return no;
    }
    let mut host = None;
    for line in lines {
        if line.starts_with(b" ") || line.starts_with(b"\t") {
            return no; // obsolete line folding: refuse to guess
        }
        let Some(colon) = line.iter().position(|b| *b == b':') else {
            return no;
        };
        if line[..colon].eq_ignore_ascii_case(b"host") {
            if host.is_some() {
                return no; // two Host headers: ambiguous
            }
            let Ok(value) = std::str::from_utf8(&line[colon + 1..]) else {
                return no;
            };
            host = Some(value.trim_matches([' ', '\t']));
        }
    }
    let Some(host) = host.and_then(host_of_authority) else {
        return no;
    };
    // An absolute-form target names the host a server will use; it must agree with Host.
    if let Some(rest) = target
        .strip_prefix("http://")
        .or_else(|| target.strip_prefix("https://"))
    {
        let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
        if host_of_authority(authority).as_deref() != Some(host.as_str()) {
            return no;
        }
    } else if !target.starts_with('/') && target != "*" {
        return no;
    }
    Sniff::Http(host)
}

/// The host name of `host[:port]` (no user info, no IP literal).
fn host_of_authority(authority: &str) -> Option<String> {
    if authority.contains('@') || authority.starts_with('[') {
        return None;
    }
    let host = match authority.rsplit_once(':') {
        Some((h, port))
            if !port.is_empty() && port.len() <= 5 && port.bytes().all(|b| b.is_ascii_digit()) =>
        {
            h
        }
        Some(_) => return None,
        None => authority,
    };
    guest_hostname(host)
}

/// The CRLF-separated lines of `head`.
fn split_crlf(head: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut rest = Some(head);
    std::iter::from_fn(move || {
        let r = rest?;
        match find(r, b"\r\n") {
            Some(i) => {
                rest = r.get(i + 2..);
                r.get(..i)
            }
            None => {
                rest = None;
                Some(r)
            }
        }
    })
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A ClientHello with the given extensions, split into records of at most `record` bytes.
    fn client_hello(extensions: &[(u16, Vec<u8>)], record: usize) -> Vec<u8> {
        let mut body = vec![3, 3];
        body.extend([7u8; 32]);
        body.push(32);
        body.extend([9u8; 32]);
        body.extend([0, 4, 0x13, 0x01, 0x13, 0x02]);
        body.extend([1, 0]);
        let mut exts = Vec::new();
        for (kind, data) in extensions {
            exts.extend(kind.to_be_bytes());
            exts.extend((data.len() as u16).to_be_bytes());
            exts.extend(data);
        }
        body.extend((exts.len() as u16).to_be_bytes());
        body.extend(exts);
        let mut hs = vec![CLIENT_HELLO];
        hs.extend(&(body.len() as u32).to_be_bytes()[1..]);
        hs.extend(body);
        let mut out = Vec::new();
        for chunk in hs.chunks(record) {
            out.extend([0x16, 3, 1]);
            out.extend((chunk.len() as u16).to_be_bytes());
            out.extend(chunk);
        }
        out
    }

    fn sni_ext(names: &[(u8, &str)]) -> (u16, Vec<u8>) {
        let mut list = Vec::new();
        for (t, n) in names {
            list.push(*t);
            list.extend((n.len() as u16).to_be_bytes());
            list.extend(n.as_bytes());
        }
        let mut data = (list.len() as u16).to_be_bytes().to_vec();
        data.extend(list);
        (0, data)
    }

    #[test]
    fn tls_client_hellos() {
        let alpn = (16u16, vec![0, 3, 2, b'h', b'2']);
        let hello = client_hello(&[alpn.clone(), sni_ext(&[(0, "Api.Example.COM")])], 1 << 14);
        assert_eq!(sniff(&hello), Sniff::Tls("api.example.com".into()));
        // Split over several records.
        let split = client_hello(&[sni_ext(&[(0, "api.example.com")]), (21, vec![0; 600])], 100);
        assert_eq!(sniff(&split), Sniff::Tls("api.example.com".into()));
        // Every strict prefix is incomplete, never a wrong answer.
        for cut in 0..split.len() {
            assert_eq!(sniff(&split[..cut]), Sniff::Incomplete, "prefix {cut}");
        }
        // No SNI, an IP literal, two names, two extensions: no name.
        for bad in [
            client_hello(std::slice::from_ref(&alpn), 1 << 14),
            client_hello(&[sni_ext(&[(0, "203.0.113.9")])], 1 << 14),
            client_hello(&[sni_ext(&[(0, "a.example.com"), (0, "b.example.com")])], 1 << 14),
            client_hello(
                &[sni_ext(&[(0, "a.example.com")]), sni_ext(&[(0, "b.example.com")])],
                1 << 14,
            ),
            client_hello(&[sni_ext(&[(0, "bad name.com")])], 1 << 14),
        ] {
            assert_eq!(sniff(&bad), Sniff::NoName { http: false });
        }
        // A ServerHello or an alert is not a ClientHello.
        let mut server_hello = hello.clone();
        server_hello[5] = 2;
        assert_eq!(sniff(&server_hello), Sniff::NoName { http: false });
        assert_eq!(sniff(&[0x15, 3, 3, 0, 2, 2, 40]), Sniff::NoName { http: false });
    }

    #[test]
    fn http_requests() {
        let ok: &[(&str, &str)] = &[
            ("GET / HTTP/1.1\r\nHost: Example.com\r\n\r\n", "example.com"),
            (
                "GET /x?y HTTP/1.1\r\nUser-Agent: t\r\nhost:example.com:8080\r\n\r\nbody",
                "example.com",
            ),
            (
                "POST /upload HTTP/1.0\r\nHOST: \t a.b.c \r\nContent-Length: 3\r\n\r\nabc",
                "a.b.c",
            ),
            (
                "GET http://example.com/x HTTP/1.1\r\nHost: example.com\r\n\r\n",
                "example.com",
            ),
            ("OPTIONS * HTTP/1.1\r\nHost: example.com.\r\n\r\n", "example.com"),
        ];
        for (req, host) in ok {
            assert_eq!(sniff(req.as_bytes()), Sniff::Http(host.to_string()), "{req:?}");
            let cut = req.find("\r\n\r\n").unwrap();
            for i in 1..cut + 3 {
                assert_eq!(
                    sniff(&req.as_bytes()[..i]),
                    Sniff::Incomplete,
                    "{req:?} cut at {i}"
                );
            }
        }
        let no_name = [
            "GET / HTTP/1.1\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a.com\r\nHost: b.com\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: 203.0.113.5\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: [2001:db8::1]:80\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: user@a.com\r\n\r\n",
            "GET / HTTP/1.1\r\nHost: a.com:http\r\n\r\n",
            "GET / HTTP/1.1\r\nX: y\r\n folded\r\nHost: a.com\r\n\r\n",
            "GET http://b.com/ HTTP/1.1\r\nHost: a.com\r\n\r\n",
            "GET / HTTP/2.0\r\nHost: a.com\r\n\r\n",
            "GET /  HTTP/1.1\r\nHost: a.com\r\n\r\n",
            "GET / HTTP/1.1\r\nHost a.com\r\n\r\n",
        ];
        for req in no_name {
            assert_eq!(sniff(req.as_bytes()), Sniff::NoName { http: true }, "{req:?}");
        }
        // Latin-1 in another header's value (obs-text) does not hide the Host; in the Host it is no name.
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nX-Name: caf\xe9\r\nHost: example.com\r\n\r\n"),
            Sniff::Http("example.com".into())
        );
        assert_eq!(
            sniff(b"GET / HTTP/1.1\r\nHost: caf\xe9.com\r\n\r\n"),
            Sniff::NoName { http: true }
        );
        assert_eq!(sniff(b"SSH-2.0-OpenSSH_9.2\r\n"), Sniff::NoName { http: false });
        assert_eq!(sniff(b"\x00\x01binary"), Sniff::NoName { http: false });
        assert_eq!(
            sniff(b"ABCDEFGHIJKLMNOPQRSTUVWXYZ"),
            Sniff::NoName { http: false }
        );
    }

    /// Random and mutated input never panics, and a name only ever comes out in host name syntax.
    #[test]
    fn fuzz_never_panics() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0x4845_4152_5448);
        let seeds: Vec<Vec<u8>> = vec![
            client_hello(
                &[
                    sni_ext(&[(0, "api.example.com")]),
                    (16, vec![0, 3, 2, b'h', b'2']),
                ],
                1 << 14,
            ),
            client_hello(&[sni_ext(&[(0, "x.io")])], 37),
            b"GET http://example.com/ HTTP/1.1\r\nHost: example.com:80\r\nAccept: */*\r\n\r\n".to_vec(),
        ];
        for i in 0..30_000 {
            let mut input = if i % 4 == 0 {
                let len = rng.random_range(0..300);
                (0..len).map(|_| rng.random()).collect::<Vec<u8>>()
            } else {
                seeds[i % seeds.len()].clone()
            };
            for _ in 0..rng.random_range(0..6) {
                if input.is_empty() {
                    break;
                }
                let at = rng.random_range(0..input.len());
                match rng.random_range(0..4) {
                    0 => input[at] = rng.random(),
                    1 => input.truncate(at),
                    2 => input.insert(at, rng.random()),
                    _ => {
                        input.remove(at);
                    }
                }
            }
            if let Some(name) = sniff(&input).name() {
                assert!(
                    guest_hostname(name).as_deref() == Some(name),
                    "{name:?} from {input:?}"
                );
            }
        }
    }
}
