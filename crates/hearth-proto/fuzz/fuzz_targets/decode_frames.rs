//! The frame decoder and header parsers on arbitrary bytes, fed in input-chosen chunk sizes.
#![no_main]

use hearth_proto::frame::{FrameDecoder, MAX_FRAME_LEN};
use hearth_proto::{GuestMsg, HostMsg};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&step, rest)) = data.split_first() else {
        return;
    };
    let step = usize::from(step).max(1) * 7;
    let mut dec = FrameDecoder::new();
    for chunk in rest.chunks(step) {
        dec.extend(chunk);
        loop {
            match dec.decode() {
                Ok(Some(frame)) => {
                    let _ = frame.parse::<GuestMsg>();
                    let _ = frame.parse::<HostMsg>();
                }
                Ok(None) => break,
                Err(_) => {}
            }
        }
        assert!(dec.buffered() <= MAX_FRAME_LEN + step);
    }
});
