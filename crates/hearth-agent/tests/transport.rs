//! The raw-descriptor stream used for the virtio-serial port and vsock connections.

use std::os::fd::OwnedFd;
use std::time::Duration;

use hearth_agent::Agent;
use hearth_agent::transport::FdStream;
use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};

#[tokio::test]
async fn agent_serves_over_a_raw_descriptor() {
    let (guest, host) = std::os::unix::net::UnixStream::pair().expect("pair");
    let stream = FdStream::new(OwnedFd::from(guest)).expect("fd stream");
    let agent = Agent::new();
    let served = tokio::spawn({
        let agent = agent.clone();
        async move { agent.serve(stream).await }
    });
    host.set_nonblocking(true).expect("nonblocking");
    let host = tokio::net::UnixStream::from_std(host).expect("tokio stream");
    let c = AgentClient::connect(host, Duration::from_secs(5))
        .await
        .expect("handshake");
    // Enough output to need several reads, writes and credit round trips.
    let mut h = c
        .exec(ExecRequest::shell("head -c 3000000 /dev/zero"))
        .await
        .expect("exec");
    let mut n = 0;
    loop {
        match h.next_event().await.expect("event") {
            ExecEvent::Stdout(d) => n += d.len(),
            ExecEvent::Exited { code, .. } => {
                assert_eq!(code, Some(0));
                break;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(n, 3_000_000);
    // The host going away ends the session cleanly.
    drop(h);
    drop(c);
    let r = tokio::time::timeout(Duration::from_secs(5), served)
        .await
        .expect("session ended")
        .expect("join");
    assert!(r.is_ok(), "{r:?}");
}
