//! The proxy's sniffer (TLS ClientHello SNI, HTTP/1 Host) on arbitrary first bytes of a guest connection.
//! Invariants: a name is a normalised host name of at most 253 bytes; a name sniffed from a prefix is what the
//! whole input gives too (the proxy decides on the prefix and forwards the rest).
#![no_main]

use hearth_net::policy::guest_hostname;
use hearth_net::proxy::{Sniff, http_host, sniff, tls_sni};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let whole = sniff(data);
    for s in [&whole, &tls_sni(data), &http_host(data)] {
        if let Some(name) = s.name() {
            assert!(name.len() <= 253, "{name:?}");
            assert_eq!(guest_hostname(name).as_deref(), Some(name));
        }
    }
    if let Some(&cut) = data.first() {
        let prefix = &data[..(usize::from(cut) * 7).min(data.len())];
        let early = sniff(prefix);
        if matches!(early, Sniff::Tls(_) | Sniff::Http(_)) {
            assert_eq!(early, whole, "a longer input changed the sniffed name");
        }
    }
});
