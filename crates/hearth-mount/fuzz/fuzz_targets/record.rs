//! The record-marking reader on an arbitrary byte stream. Invariants: no panic; every record returned is at most
//! MAX_RECORD bytes and is made of bytes of the input.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().build().expect("a runtime"))
}

fuzz_target!(|data: &[u8]| {
    runtime().block_on(async {
        let mut rd = data;
        let mut total = 0usize;
        while let Ok(Some(record)) = hearth_mount::rpc::read_record(&mut rd).await {
            assert!(record.len() <= hearth_mount::rpc::MAX_RECORD);
            total += record.len();
            assert!(total <= data.len());
        }
    });
});
