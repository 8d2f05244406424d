//! NFLOG datagram parsing (netlink messages, nfnetlink_log attributes, the logged IPv4/IPv6 packet).
//! Invariants: no panic; every event carries a reason in the data plane's prefix syntax.
#![no_main]

use hearth_net::nflog::{parse_datagram, parse_ip, parse_prefix};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for ev in parse_datagram(data) {
        assert!(!ev.reason.is_empty() && ev.reason.len() <= 32);
        assert!(
            ev.reason
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        );
    }
    let _ = parse_ip(data);
    if let Some((_, reason)) = parse_prefix(data) {
        assert!(!reason.is_empty() && reason.len() <= 32);
    }
});
