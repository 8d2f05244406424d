//! Test harness: an in-process agent served over a Unix socket pair, driven through `AgentClient`.

#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use hearth_agent::Agent;
use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};

pub const T: Duration = Duration::from_secs(10);

/// Serve a new connection of `agent` and connect a client to it.
pub async fn connect(agent: &Agent) -> AgentClient {
    let (a, b) = tokio::net::UnixStream::pair().expect("socketpair");
    let ag = agent.clone();
    tokio::spawn(async move { ag.serve(a).await });
    AgentClient::connect(b, T).await.expect("handshake")
}

pub async fn setup() -> (Agent, AgentClient) {
    let agent = Agent::new();
    let client = connect(&agent).await;
    (agent, client)
}

#[derive(Debug, Default)]
pub struct Outcome {
    pub code: Option<i32>,
    pub signal: Option<i32>,
    pub timed_out: bool,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
}

impl Outcome {
    pub fn out(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub fn err(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
}

/// Run a foreground exec to completion, optionally feeding stdin.
pub async fn run_with(client: &AgentClient, req: ExecRequest, stdin: Option<Bytes>) -> Outcome {
    let req = if stdin.is_some() { req.with_stdin() } else { req };
    let mut h = client.exec(req).await.expect("exec");
    if let Some(data) = stdin {
        let w = h.stdin();
        tokio::spawn(async move {
            w.send(data).await.expect("stdin send");
            w.close().await.expect("stdin close");
        });
    }
    let mut o = Outcome::default();
    let fut = async {
        while let Some(ev) = h.next_event().await {
            match ev {
                ExecEvent::Stdout(d) => o.stdout.extend_from_slice(&d),
                ExecEvent::Stderr(d) => o.stderr.extend_from_slice(&d),
                ExecEvent::Exited {
                    code,
                    signal,
                    timed_out,
                } => {
                    o.code = code;
                    o.signal = signal;
                    o.timed_out = timed_out;
                    return;
                }
                ExecEvent::Error(e) => panic!("exec failed: {e}"),
            }
        }
        panic!("exec stream ended without Exited");
    };
    tokio::time::timeout(Duration::from_secs(60), fut)
        .await
        .expect("exec finished in time");
    o
}

pub async fn sh(client: &AgentClient, line: &str) -> Outcome {
    run_with(client, ExecRequest::shell(line), None).await
}

/// Deterministic pseudo-random bytes (xorshift), so large payloads are not trivially compressible patterns.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// A fresh directory under /tmp for one test.
pub fn scratch() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("hearth-agent-test")
        .tempdir()
        .expect("tempdir")
}

/// Poll `f` until it returns true or `timeout` passes.
pub async fn wait_until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + timeout;
    while tokio::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f()
}
