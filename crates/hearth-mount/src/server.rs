//! The TCP server: accepts connections (at most [`ServerLimits::max_conns`] at once), reads one record at a
//! time, runs up to [`ServerLimits::max_inflight`] calls of a connection concurrently and writes their replies
//! as they finish (RPC matches them by xid). A connection that sends an oversize record is closed. Everything
//! here is bounded: record size, calls in flight, queued replies, connections.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};

use crate::fs::Export;
use crate::proto::{self, Exports, export_name, mount, nfs3};
use crate::rpc::{self, Accept, Parsed};
use crate::xdr::Writer;

/// Bounds of one server.
#[derive(Debug, Clone)]
pub struct ServerLimits {
    pub max_conns: usize,
    pub max_inflight: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            max_conns: 8,
            max_inflight: 16,
        }
    }
}

/// The exports of one server (one sandbox's mounts), changeable while it serves.
#[derive(Default)]
pub struct ExportSet {
    by_key: RwLock<HashMap<u64, Arc<Export>>>,
}

impl ExportSet {
    fn map(&self) -> std::sync::RwLockReadGuard<'_, HashMap<u64, Arc<Export>>> {
        self.by_key.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds (or replaces) an export.
    pub fn add(&self, export: Arc<Export>) {
        self.by_key
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(export.spec.key, export);
    }

    /// Removes an export: its handles turn stale at once.
    pub fn remove(&self, key: u64) -> Option<Arc<Export>> {
        self.by_key
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key)
    }

    pub fn get(&self, key: u64) -> Option<Arc<Export>> {
        self.map().get(&key).cloned()
    }

    pub fn all(&self) -> Vec<Arc<Export>> {
        self.map().values().cloned().collect()
    }
}

impl Exports for ExportSet {
    fn by_key(&self, key: u64) -> Option<Arc<Export>> {
        self.get(key)
    }

    fn by_name(&self, name: &str) -> Option<Arc<Export>> {
        self.map()
            .values()
            .find(|e| export_name(e.spec.key) == name)
            .cloned()
    }

    fn names(&self) -> Vec<String> {
        self.map().keys().map(|k| export_name(*k)).collect()
    }
}

/// Serves `exports` on `listener` until the task is aborted; sweeps idle temporary files every few seconds.
pub async fn serve(listener: TcpListener, exports: Arc<ExportSet>, limits: ServerLimits) {
    let conns = Arc::new(AtomicUsize::new(0));
    let sweeper = {
        let exports = exports.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tick.tick().await;
                for e in exports.all() {
                    e.sweep().await;
                }
            }
        })
    };
    let _sweeper = AbortOnDrop(sweeper);
    // Connections are tasks of this set: when the server's task is aborted (the sandbox is gone), they go
    // with it, whatever state the guest left them in.
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let (stream, _) = match accepted {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "mount server accept");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if conns.load(Ordering::Relaxed) >= limits.max_conns {
            // Over the bound: refused by closing at once.
            continue;
        }
        conns.fetch_add(1, Ordering::Relaxed);
        let (exports, conns, limits) = (exports.clone(), conns.clone(), limits.clone());
        connections.spawn(async move {
            connection(stream, exports, limits).await;
            conns.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

async fn connection(stream: TcpStream, exports: Arc<ExportSet>, limits: ServerLimits) {
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(limits.max_inflight);
    let writer = tokio::spawn(async move {
        while let Some(reply) = rx.recv().await {
            if wr.write_all(&reply).await.is_err() {
                break;
            }
        }
    });
    let _writer = AbortOnDrop(writer);
    let slots = Arc::new(Semaphore::new(limits.max_inflight));
    let mut calls = tokio::task::JoinSet::new();
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        let record = match rpc::read_record(&mut rd).await {
            Ok(Some(r)) => r,
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(error = %e, "mount connection closed");
                break;
            }
        };
        let (exports, tx) = (exports.clone(), tx.clone());
        calls.spawn(async move {
            if let Some(reply) = handle(&record, exports.as_ref()).await {
                let _ = tx.send(rpc::frame(&reply)).await;
            }
            drop(permit);
        });
        while calls.try_join_next().is_some() {}
    }
    // Calls in flight finish (their replies may still reach a half-closed peer); then the writer ends.
    while calls.join_next().await.is_some() {}
    drop(tx);
}

/// One record: the reply body, or `None` to drop it.
pub async fn handle(record: &[u8], exports: &dyn Exports) -> Option<Vec<u8>> {
    match rpc::parse_call(record) {
        Parsed::Garbage => None,
        Parsed::WrongRpcVersion(xid) => Some(rpc::rpc_mismatch(xid).buf),
        Parsed::Call(h, mut args) => {
            let started = std::time::Instant::now();
            let mut body = Writer::new();
            let (prog_vers, result) = match h.prog {
                nfs3::PROGRAM => (nfs3::VERSION, None),
                mount::PROGRAM => (mount::VERSION, None),
                _ => (0, Some(Accept::ProgUnavail)),
            };
            let accept = match result {
                Some(a) => Ok(a),
                None if h.vers != prog_vers => {
                    return Some(rpc::prog_mismatch(h.xid, prog_vers, prog_vers).buf);
                }
                None if h.prog == nfs3::PROGRAM => nfs3::call(h.proc_, &mut args, exports, &mut body).await,
                None => mount::call(h.proc_, &mut args, exports, &mut body),
            };
            let accept = accept.unwrap_or(Accept::GarbageArgs);
            tracing::debug!(
                prog = h.prog,
                proc_ = h.proc_,
                ?accept,
                status = body
                    .buf
                    .get(..4)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]])),
                micros = started.elapsed().as_micros(),
                "mount rpc"
            );
            let mut reply = rpc::accepted(h.xid, accept);
            if accept == Accept::Success {
                reply.buf.extend_from_slice(&body.buf);
            }
            Some(reply.buf)
        }
    }
}

/// Silences an unused-import lint when the proto module is only reached through [`handle`].
#[allow(dead_code)]
fn _proto_used() -> usize {
    proto::FH_LEN
}
