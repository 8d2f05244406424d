//! The HTTP server loop: HTTP/1 with upgrades (terminals), a bounded number of open connections and deadlines
//! for request heads, so that neither many idle connections nor clients that send their headers a byte at a
//! time can use up what every other client needs.
//!
//! When every connection slot is taken, accepting pauses (the kernel's backlog holds newcomers) until one
//! closes; a client that has not sent its first whole request head within the deadline (60 s) is disconnected
//! before hyper sees it. A kept-alive connection has [`ServeLimits::keep_alive_idle`] after its last response
//! ended to complete its next request head, else it is closed: time spent while a request is in flight (its
//! body arriving, its response streaming, however long) does not count. (hyper's own `header_read_timeout` is
//! not used: hyper arms it whenever it could read a next head, which on a server includes the whole time a
//! response streams, so it would cut every exec stream, watch or download that lasts longer than the
//! deadline.) Graceful shutdown stops accepting and lets requests in flight finish.

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
    /// Time a kept-alive connection has, after its last response ended, to send its next complete head.
    pub keep_alive_idle: Duration,
}

impl Default for ServeLimits {
    fn default() -> Self {
        ServeLimits {
            // Well below the daemon's raised open-file limit, leaving room for VMs, proxies and the database.
            max_connections: 2048,
            header_read_timeout: Duration::from_secs(60),
            // Longer than clients' own idle pools keep connections (hearth-client: 30 s).
            keep_alive_idle: Duration::from_secs(90),
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
        let activity = Arc::new(Activity::new());
        let (begin, end) = (activity.clone(), activity.clone());
        let svc = router
            .clone()
            // The peer's address, for the audit log (crate::tenancy); the request counts as in flight.
            .map_request(move |req: hyper::Request<Incoming>| {
                begin.begin();
                let mut req = req.map(Body::new);
                req.extensions_mut().insert(axum::extract::ConnectInfo(peer));
                req
            })
            .map_response(move |resp: axum::response::Response| {
                let guard = InFlight(end.clone());
                resp.map(|inner| Body::new(Tracked { inner, _guard: guard }))
            });
        let mut stop = stop_rx.clone();
        let deadline = limits.header_read_timeout;
        let idle_limit = limits.keep_alive_idle;
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
                () = activity.idle_past(idle_limit) => {
                    tracing::debug!("a kept-alive connection sent no complete request head in time");
                    // Closes at once: no request is in flight. Bounded anyway.
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(Duration::from_secs(5), conn).await.unwrap_or(Ok(()))
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

/// Requests in flight on one connection and when the last one ended.
struct Activity {
    in_flight: std::sync::atomic::AtomicUsize,
    idle_since: std::sync::Mutex<tokio::time::Instant>,
}

impl Activity {
    fn new() -> Self {
        Activity {
            in_flight: std::sync::atomic::AtomicUsize::new(0),
            idle_since: std::sync::Mutex::new(tokio::time::Instant::now()),
        }
    }

    /// A request head arrived complete.
    fn begin(&self) {
        self.in_flight.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Resolves once no request has been in flight for `limit`.
    async fn idle_past(&self, limit: Duration) {
        let step = (limit / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
        loop {
            tokio::time::sleep(step).await;
            if self.in_flight.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                continue;
            }
            let since = *self.idle_since.lock().unwrap_or_else(|p| p.into_inner());
            if since.elapsed() >= limit {
                return;
            }
        }
    }
}

/// Held by a response body: the request counts as in flight until its body has been sent (or dropped).
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        *self.0.idle_since.lock().unwrap_or_else(|p| p.into_inner()) = tokio::time::Instant::now();
        self.0.in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A response body that releases its [`InFlight`] when it ends or is dropped.
struct Tracked {
    inner: Body,
    _guard: InFlight,
}

impl hyper::body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}
