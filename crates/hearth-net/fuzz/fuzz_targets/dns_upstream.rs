//! The daemon's DNS client reading an upstream answer (hickory-proto decoding, CNAME chains within the answer,
//! TTLs). The upstream is not the guest, but a name the policy allows may be served by a zone the guest
//! controls. Invariants: only the answer to our query is taken (its id and question); addresses are distinct
//! and of the asked type; no address means a TTL of 0 (nothing cached).
#![no_main]

use std::net::IpAddr;

use hearth_net::dns::decode_reply;
use hickory_proto::op::Message;
use hickory_proto::rr::{Name, RecordType};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(qname) = Name::from_ascii("www.example.test.") else {
        return;
    };
    // The query's id is the datagram's own, so that inputs get past the id check.
    let id = data.get(..2).map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    for rtype in [RecordType::A, RecordType::AAAA] {
        let Some(reply) = decode_reply(data, id, &qname, rtype) else {
            continue;
        };
        let decoded = Message::from_vec(data).expect("an accepted answer decodes");
        assert_eq!(decoded.metadata.id, id);
        assert_eq!(decoded.queries.len(), 1);
        if let Ok((addrs, ttl)) = reply {
            for (i, ip) in addrs.iter().enumerate() {
                assert!(!addrs[..i].contains(ip), "duplicate {ip}");
                assert_eq!(matches!(ip, IpAddr::V4(_)), rtype == RecordType::A);
            }
            assert!(addrs.len() <= decoded.answers.len());
            if addrs.is_empty() {
                assert_eq!(ttl, 0);
            }
        }
        assert!(decode_reply(data, id.wrapping_add(1), &qname, rtype).is_none());
    }
});
