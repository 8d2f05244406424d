//! The proxy's HTTP/1 request framer on an arbitrary guest->upstream byte stream, fed in input-chosen pieces.
//! Invariants: progress and bounds (every step consumes 1..=available bytes, a head fits the bound), hosts are
//! normalised host names, protocol switches only as a first request without a body, and the framing (heads,
//! forwarded bytes, errors, all at their offsets) does not depend on how the bytes arrive.
#![no_main]

use hearth_net::policy::guest_hostname;
use hearth_net::proxy::{Body, FrameError, RequestFramer, RequestHead, Step, parse_head};
use libfuzzer_sys::fuzz_target;

const MAX_HEAD: usize = 1024;

#[derive(Debug, PartialEq, Eq)]
enum Ev {
    Head(usize, usize, RequestHead),
    Forward(usize, usize),
    Error(usize, FrameError),
}

fn frame(input: &[u8], piece: usize) -> Vec<Ev> {
    let mut framer = RequestFramer::new(MAX_HEAD);
    let mut pending: Vec<u8> = Vec::new();
    let mut rest = input;
    let mut at = 0usize;
    let mut out: Vec<Ev> = Vec::new();
    loop {
        match framer.step(&pending) {
            Step::Head { len, head } => {
                assert!(len > 0 && len <= pending.len() && len <= MAX_HEAD);
                if let Some(host) = &head.host {
                    assert_eq!(guest_hostname(host).as_deref(), Some(host.as_str()));
                }
                if head.switch.is_some() {
                    assert_eq!((framer.requests(), head.body), (1, Body::Empty));
                }
                out.push(Ev::Head(at, len, head));
                pending.drain(..len);
                at += len;
            }
            Step::Forward(n) => {
                assert!(n > 0 && n <= pending.len());
                match out.last_mut() {
                    Some(Ev::Forward(start, len)) if *start + *len == at => *len += n,
                    _ => out.push(Ev::Forward(at, n)),
                }
                pending.drain(..n);
                at += n;
            }
            Step::NeedMore => {
                if rest.is_empty() {
                    return out;
                }
                assert!(pending.len() < MAX_HEAD + piece + 4096 + 16 * 1024);
                let n = piece.min(rest.len());
                pending.extend_from_slice(&rest[..n]);
                rest = &rest[n..];
            }
            Step::Error(e) => {
                out.push(Ev::Error(at, e));
                return out;
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&piece, input)) = data.split_first() else {
        return;
    };
    let piece = usize::from(piece % 97) + 1;
    let whole = frame(input, input.len().max(1));
    assert_eq!(frame(input, piece), whole);
    if let Ok(head) = parse_head(input, true)
        && let Some(host) = &head.host
    {
        assert_eq!(guest_hostname(host).as_deref(), Some(host.as_str()));
    }
});
