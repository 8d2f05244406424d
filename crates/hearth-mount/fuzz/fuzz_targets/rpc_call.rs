//! One RPC record as a guest may send it, through the whole call path (RPC header, MOUNT and NFS v3 argument
//! decoding of every procedure) against a server with no exports (every handle is stale, so nothing reaches a
//! bucket). Invariants: no panic; the reply is a well-formed RPC reply to the record's xid, or nothing.
#![no_main]

use std::sync::OnceLock;

use hearth_mount::ExportSet;
use libfuzzer_sys::fuzz_target;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("a runtime"))
}

fuzz_target!(|data: &[u8]| {
    let exports = ExportSet::default();
    let reply = runtime().block_on(hearth_mount::server::handle(data, &exports));
    if let Some(reply) = reply {
        assert!(reply.len() >= 12 && data.len() >= 4, "a reply needs the call's xid");
        assert_eq!(&reply[..4], &data[..4], "the reply carries the call's xid");
        assert_eq!(&reply[4..8], &1u32.to_be_bytes(), "a REPLY");
        assert!(reply.len() <= hearth_mount::rpc::MAX_RECORD, "bounded reply");
    }
});
