//! In-test fuzz loops: random and mutated input for the decoder and for the host client's reader. Nothing
//! may panic; memory stays bounded by construction (checked on the decoder's buffer).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hearth_proto::client::AgentClient;
use hearth_proto::frame::{FrameDecoder, MAGIC, MAX_FRAME_LEN, encode};
use hearth_proto::io::FrameReader;
use hearth_proto::{ExitStatus, GuestMsg, HostMsg};
use tokio::io::AsyncWriteExt;

/// Small deterministic PRNG (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next() as u8).collect()
    }
}

fn sample_frames() -> Vec<Vec<u8>> {
    let msgs = [
        GuestMsg::Pong,
        GuestMsg::Started { pid: 3 },
        GuestMsg::Exited(ExitStatus {
            code: Some(1),
            signal: None,
            timed_out: false,
        }),
        GuestMsg::Credit { bytes: 4096 },
        GuestMsg::Ok,
        GuestMsg::error(hearth_proto::ErrorKind::NotFound, "x"),
        GuestMsg::Procs { procs: vec![] },
        GuestMsg::ReadDone { bytes: 9 },
    ];
    let mut v: Vec<Vec<u8>> = msgs
        .iter()
        .enumerate()
        .map(|(i, m)| {
            encode(i as u32 * 2 + 1, m, Bytes::new())
                .expect("encode")
                .to_vec()
        })
        .collect();
    v.push(
        encode(1, &GuestMsg::Stdout, Bytes::from_static(b"data!"))
            .expect("encode")
            .to_vec(),
    );
    v.push(
        encode(
            0,
            &HostMsg::Hello {
                version: hearth_proto::PROTOCOL_VERSION,
                nonce: 5,
                post_restore: None,
            },
            Bytes::new(),
        )
        .expect("encode")
        .to_vec(),
    );
    v
}

/// A random input: pure noise, valid frames, or valid frames with random bytes flipped, cut or spliced.
fn random_input(rng: &mut Rng, frames: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..rng.below(8) + 1 {
        match rng.below(5) {
            0 => {
                let n = rng.below(2048);
                out.extend(rng.bytes(n));
            }
            1 => out.extend_from_slice(&frames[rng.below(frames.len())]),
            2 => {
                let mut f = frames[rng.below(frames.len())].clone();
                for _ in 0..rng.below(4) + 1 {
                    let i = rng.below(f.len());
                    f[i] = rng.next() as u8;
                }
                out.extend(f);
            }
            3 => {
                let f = &frames[rng.below(frames.len())];
                out.extend_from_slice(&f[..rng.below(f.len())]);
            }
            _ => {
                out.extend_from_slice(&MAGIC);
                out.extend_from_slice(&(rng.next() as u32 % 70_000).to_le_bytes());
                out.extend_from_slice(&(rng.next() as u32 % 300_000).to_le_bytes());
                let n = rng.below(512);
                out.extend(rng.bytes(n));
            }
        }
    }
    out
}

#[test]
fn decoder_survives_random_input() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let frames = sample_frames();
    let mut decoded = 0usize;
    for _ in 0..5000 {
        let input = random_input(&mut rng, &frames);
        let mut dec = FrameDecoder::new();
        let mut pos = 0;
        while pos < input.len() {
            let n = (rng.below(300) + 1).min(input.len() - pos);
            dec.extend(&input[pos..pos + n]);
            pos += n;
            loop {
                match dec.decode() {
                    Ok(Some(f)) => {
                        decoded += 1;
                        let _ = f.parse::<GuestMsg>();
                        let _ = f.parse::<HostMsg>();
                    }
                    Ok(None) => break,
                    Err(_) => {}
                }
            }
            assert!(
                dec.buffered() <= MAX_FRAME_LEN + 300,
                "decoder buffered {} bytes",
                dec.buffered()
            );
        }
    }
    assert!(
        decoded > 1000,
        "the fuzz inputs should contain many valid frames, got {decoded}"
    );
}

static PANICS: AtomicUsize = AtomicUsize::new(0);

#[tokio::test]
async fn client_survives_random_guest_output() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        prev(info);
    }));
    let mut rng = Rng(0x1234_5678_9abc_def1);
    let frames = sample_frames();
    for _ in 0..300 {
        let (host, guest) = tokio::io::duplex(1 << 20);
        let (rd, mut wr) = tokio::io::split(guest);
        let mut reader = FrameReader::new(rd);
        let connect = tokio::spawn(AgentClient::connect(host, Duration::from_secs(5)));
        let f = reader.next().await.expect("io").expect("open").expect("frame");
        let HostMsg::Hello { nonce, .. } = f.parse::<HostMsg>().expect("hello").msg else {
            panic!("no hello")
        };
        let ok = GuestMsg::HelloOk {
            version: hearth_proto::PROTOCOL_VERSION,
            agent_version: "fuzz".into(),
            nonce,
            post_restore: None,
        };
        wr.write_all(&encode(0, &ok, Bytes::new()).expect("encode").to_vec())
            .await
            .expect("write");
        let c = connect.await.expect("join").expect("connect");
        // Requests in flight on streams 1, 3, 5 so that random frames hit live routes too.
        let reqs = tokio::spawn({
            let c = c.clone();
            async move {
                let _ = tokio::join!(c.ping(), c.list_processes(), c.stat("/"));
            }
        });
        let input = random_input(&mut rng, &frames);
        let _ = wr.write_all(&input).await;
        let _ = tokio::time::timeout(Duration::from_millis(20), reqs).await;
        drop(wr);
        drop(c);
    }
    assert_eq!(
        PANICS.load(Ordering::SeqCst),
        0,
        "the client panicked on guest input"
    );
}
