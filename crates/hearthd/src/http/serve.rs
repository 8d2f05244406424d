//! The HTTP server loop: HTTP/1 with upgrades (terminals), a bounded number of open connections and a deadline
//! for request heads, so that neither many idle connections nor clients that send their headers a byte at a
//! time can use up what every other client needs.
//!
//! When every connection slot is taken, accepting pauses (the kernel's backlog holds newcomers) until one
//! closes; a client that has not sent its first whole request head within the deadline (60 s) is disconnected
//! before hyper sees it. (hyper's own `header_read_timeout` is not used: hyper arms it whenever it could read a
//! next head, which on a server includes the whole time a response streams, so it would cut every exec
//! stream, watch or download that lasts longer than the deadline.) Graceful shutdown stops accepting and lets
//! requests in flight finish.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tower::ServiceExt;

/// Bounds of the server.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// Most connections open at once.
    pub max_connections: usize,
    /// Time a new connection has to send its first complete request head.
    pub header_read_timeout: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            // Well below the daemon's raised open-file limit, leaving room for VMs, proxies and the database.
            max_connections: 2048,
            header_read_timeout: Duration::from_secs(60),
        }
    }
}

/// Serves `router` on `listener` within `limits` until `shutdown` resolves, then waits for open connections
/// to finish their requests.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let max = limits
        .max_connections
        .clamp(1, tokio::sync::Semaphore::MAX_PERMITS);
    let slots = Arc::new(tokio::sync::Semaphore::new(max));
    // Tells open connections to finish their request in flight and close.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors or a connection reset before it was accepted: try again shortly.
                    tracing::debug!(error = %e, "accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let svc = router
            .clone()
            // The peer's address, for the audit log (crate::tenancy).
            .map_request(move |req: hyper::Request<Incoming>| {
                let mut req = req.map(Body::new);
                req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                req
            });
        let mut stop = stop_rx.clone();
        let deadline = limits.header_read_timeout;
        tokio::spawn(async move {
            let arrived = tokio::select! {
                ok = first_head_arrives(&stream, deadline) => ok,
                () = async { let _ = stop.wait_for(|s| *s).await; } => false,
            };
            if !arrived {
                tracing::debug!("a connection sent no complete request head in time");
                drop(permit);
                return;
            }
            // No timer: hyper's header-read timeout (30 s by default once a timer is set) would also run while
            // responses stream.
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc))
                .with_upgrades();
            let mut conn = std::pin::pin!(conn);
            let result = tokio::select! {
                r = conn.as_mut() => r,
                () = async { let _ = stop.wait_for(|s| *s).await; } => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::trace!(error = %e, "connection");
            }
            drop(permit);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    // Every connection gives its slot back when it is done.
    let _ = slots.acquire_many(u32::try_from(max).unwrap_or(u32::MAX)).await;
    Ok(())
}

/// Whether `stream`'s first request head (up to its blank line, or 16 KiB of it: hyper judges the rest)
/// arrives within `deadline`. Only peeks: hyper reads the bytes afterwards.
async fn first_head_arrives(stream: &tokio::net::TcpStream, deadline: Duration) -> bool {
    let end = tokio::time::Instant::now() + deadline;
    let mut buf = vec![0u8; 16 * 1024];
    let mut seen = 0;
    loop {
        let n = match tokio::time::timeout_at(end, stream.peek(&mut buf)).await {
            Ok(Ok(n)) => n,
            Ok(Err(_)) | Err(_) => return false,
        };
        if n == 0 {
            return false;
        }
        if n == buf.len() || buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
            return true;
        }
        if n == seen {
            // peek returns the same bytes again at once: wait a little for more.
            if tokio::time::Instant::now() + Duration::from_millis(20) > end {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        seen = n;
    }
}
