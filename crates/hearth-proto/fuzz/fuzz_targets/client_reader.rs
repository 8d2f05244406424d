//! The host client after a valid handshake, with requests in flight, reading arbitrary guest bytes.
//! The runtime's clock is paused: it jumps ahead whenever every task waits, so the bounded wait for the
//! requests costs no wall-clock time (about 100 inputs a second with a real 5 ms wait, thousands without).
#![no_main]

use std::time::Duration;

use bytes::Bytes;
use hearth_proto::client::AgentClient;
use hearth_proto::frame::encode;
use hearth_proto::io::FrameReader;
use hearth_proto::{GuestMsg, HostMsg};
use libfuzzer_sys::fuzz_target;
use tokio::io::AsyncWriteExt;

fuzz_target!(|data: &[u8]| {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
    else {
        return;
    };
    rt.block_on(async {
        let (host, guest) = tokio::io::duplex(1 << 20);
        let (rd, mut wr) = tokio::io::split(guest);
        let mut reader = FrameReader::new(rd);
        let connect = tokio::spawn(AgentClient::connect(host, Duration::from_secs(5)));
        let Ok(Some(Ok(f))) = reader.next().await else {
            return;
        };
        let Ok(h) = f.parse::<HostMsg>() else { return };
        let HostMsg::Hello { nonce, .. } = h.msg else {
            return;
        };
        let ok = GuestMsg::HelloOk {
            version: hearth_proto::PROTOCOL_VERSION,
            agent_version: "f".into(),
            nonce,
            post_restore: None,
        };
        let Ok(frame) = encode(0, &ok, Bytes::new()) else {
            return;
        };
        if wr.write_all(&frame.to_vec()).await.is_err() {
            return;
        }
        let Ok(Ok(c)) = connect.await else { return };
        let reqs = tokio::spawn({
            let c = c.clone();
            async move {
                let _ = tokio::join!(c.ping(), c.list_processes(), c.stat("/"), c.list_dir("/"));
            }
        });
        let _ = wr.write_all(data).await;
        let _ = tokio::time::timeout(Duration::from_millis(5), reqs).await;
    });
});
