//! The transparent egress proxy for guest TCP that nftables redirected to [`crate::GATEWAY`]:[`crate::PROXY_PORT`].
//!
//! For each connection: recover the destination the guest dialed (`SO_ORIGINAL_DST`), read the first bytes
//! (bounded in size and time) for a TLS SNI or an HTTP Host, and decide:
//! - a name a domain rule allows: resolve it with the daemon's own [`Upstream`] (the guest's DNS is never
//!   trusted) and connect to a resolved address that is neither always denied nor named by a deny CIDR, on the
//!   port the guest dialed; if every address is denied, refuse (`resolves_to_denied`). The address the guest
//!   dialed does not matter, so naming an allowed host while dialing another one reaches the allowed host.
//! - a name a domain rule denies: refuse.
//! - otherwise (no name, or a name no domain rule mentions): the dialed address decides, as for any other
//!   traffic ([`crate::policy::Policy::decide_addr`]).
//!
//! Outbound sockets are created in the uplink namespace. The bytes read are replayed upstream, then both
//! directions are spliced. Every attempt lands in the sandbox's audit log.

mod sniff;

use std::net::{IpAddr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hearth_api::NetProtocol;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

pub use sniff::{Sniff, http_host, sniff, tls_sni};

use crate::ctx::SandboxNetCtx;
use crate::dns::Upstream;
use crate::policy::{Decision, reason};

/// Bounds on the work the proxy does for one sandbox.
#[derive(Debug, Clone)]
pub struct ProxyLimits {
    /// Most bytes read from the guest before deciding.
    pub peek_bytes: usize,
    /// Longest wait for those bytes (then the connection is decided without a name).
    pub peek_timeout: Duration,
    /// Longest wait for each outbound connect.
    pub connect_timeout: Duration,
    /// Resolved addresses tried at most.
    pub connect_attempts: usize,
    /// Connections handled at once; more are closed at once.
    pub max_connections: usize,
}

impl Default for ProxyLimits {
    fn default() -> Self {
        ProxyLimits {
            peek_bytes: 16 * 1024,
            peek_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            connect_attempts: 3,
            max_connections: 512,
        }
    }
}

/// The egress proxy of one sandbox.
#[derive(Debug)]
pub struct Proxy {
    ctx: Arc<SandboxNetCtx>,
    upstream: Arc<Upstream>,
    uplink_ns: PathBuf,
    limits: ProxyLimits,
    connections: Arc<Semaphore>,
}

/// Serves the proxy on `listener` (bound in the sandbox namespace) until the task is aborted. Must be called
/// inside a Tokio runtime.
pub fn spawn_proxy(
    listener: std::net::TcpListener,
    ctx: Arc<SandboxNetCtx>,
    upstream: Arc<Upstream>,
    uplink_ns: PathBuf,
) -> JoinHandle<()> {
    let proxy = Arc::new(Proxy::new(ctx, upstream, uplink_ns, ProxyLimits::default()));
    tokio::spawn(proxy.serve(listener))
}

impl Proxy {
    pub fn new(
        ctx: Arc<SandboxNetCtx>,
        upstream: Arc<Upstream>,
        uplink_ns: PathBuf,
        limits: ProxyLimits,
    ) -> Self {
        let connections = Arc::new(Semaphore::new(limits.max_connections.max(1)));
        Proxy {
            ctx,
            upstream,
            uplink_ns,
            limits,
            connections,
        }
    }

    /// The sandbox state the proxy decides with.
    pub fn ctx(&self) -> &Arc<SandboxNetCtx> {
        &self.ctx
    }

    /// Accepts redirected connections on `listener` and handles each on its own task.
    pub async fn serve(self: Arc<Self>, listener: std::net::TcpListener) {
        let listener = match listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpListener::from_std(listener))
        {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(sandbox = %self.ctx.id, error = %e, "egress proxy listener unusable");
                return;
            }
        };
        let local = listener.local_addr().ok();
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of descriptors or a connection reset before accept: wait a little, keep serving.
                    tracing::debug!(sandbox = %self.ctx.id, error = %e, "egress proxy accept");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Ok(permit) = self.connections.clone().try_acquire_owned() else {
                tracing::debug!(sandbox = %self.ctx.id, "egress proxy at its connection limit");
                continue;
            };
            let orig_dst = match original_dst(&stream) {
                // A connection to the proxy's own address was not redirected: nowhere to go.
                Ok(dst) if Some(dst) != local => dst,
                _ => continue,
            };
            let proxy = self.clone();
            tokio::spawn(async move {
                proxy.handle(stream, orig_dst).await;
                drop(permit);
            });
        }
    }

    /// Handles one guest connection whose original destination is `orig_dst`: decides, connects, splices.
    /// Returns when the connection is over.
    pub async fn handle(&self, mut client: TcpStream, orig_dst: SocketAddr) {
        let Some((peeked, sniffed)) = self.peek(&mut client).await else {
            // Opened and closed at once (a port scan, a probe): decided by address, but never connected.
            let decision = self
                .ctx
                .policy()
                .decide_addr(orig_dst.ip(), &self.ctx.extra_denied);
            self.ctx.audit.record(
                NetProtocol::Tcp,
                Some(orig_dst.ip()),
                Some(orig_dst.port()),
                None,
                &decision,
            );
            return;
        };
        let name = sniffed.name().map(str::to_owned);
        let port = orig_dst.port();
        let targets = match self.decide(orig_dst, name.as_deref()).await {
            Ok(targets) => targets,
            Err((decision, destination)) => {
                self.ctx.audit.record(
                    NetProtocol::Tcp,
                    Some(destination),
                    Some(port),
                    name.as_deref(),
                    &decision,
                );
                if sniffed.is_http() {
                    let _ = client.write_all(forbidden(decision.reason).as_bytes()).await;
                }
                return;
            }
        };
        let mut upstream = None;
        for (ip, decision) in targets.iter().take(self.limits.connect_attempts.max(1)) {
            let addr = SocketAddr::new(*ip, port);
            match tokio::time::timeout(
                self.limits.connect_timeout,
                crate::netns::connect_tcp(&self.uplink_ns, addr),
            )
            .await
            {
                Ok(Ok(stream)) => {
                    self.ctx
                        .audit
                        .record(NetProtocol::Tcp, Some(*ip), Some(port), name.as_deref(), decision);
                    upstream = Some(stream);
                    break;
                }
                Ok(Err(e)) => tracing::debug!(sandbox = %self.ctx.id, %addr, error = %e, "egress connect"),
                Err(_) => tracing::debug!(sandbox = %self.ctx.id, %addr, "egress connect timed out"),
            }
        }
        let Some(mut upstream) = upstream else {
            // Allowed, but unreachable: still an attempt.
            if let Some((ip, decision)) = targets.first() {
                self.ctx
                    .audit
                    .record(NetProtocol::Tcp, Some(*ip), Some(port), name.as_deref(), decision);
            }
            return;
        };
        if upstream.write_all(&peeked).await.is_err() {
            return;
        }
        let _ = upstream.set_nodelay(true);
        let _ = client.set_nodelay(true);
        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
    }

    /// Reads the first bytes of the connection until they name a host (or cannot), the size bound is reached,
    /// the guest stops sending or the time bound passes. `None` if the guest closed without sending anything.
    async fn peek(&self, client: &mut TcpStream) -> Option<(Vec<u8>, Sniff)> {
        let mut buf = Vec::with_capacity(2048);
        let deadline = tokio::time::Instant::now() + self.limits.peek_timeout;
        loop {
            let mut chunk = [0u8; 4096];
            let room = (self.limits.peek_bytes - buf.len()).min(chunk.len());
            let read = tokio::time::timeout_at(deadline, client.read(&mut chunk[..room])).await;
            match read {
                Ok(Ok(n)) if n > 0 => buf.extend_from_slice(&chunk[..n]),
                // Closed (or failed) before sending anything: nothing to forward.
                Ok(_) if buf.is_empty() => return None,
                // EOF, error or timeout: decide on what there is.
                _ => {
                    let sniffed = match sniff(&buf) {
                        Sniff::Incomplete => Sniff::NoName { http: false },
                        s => s,
                    };
                    return Some((buf, sniffed));
                }
            }
            match sniff(&buf) {
                Sniff::Incomplete if buf.len() < self.limits.peek_bytes => continue,
                Sniff::Incomplete => return Some((buf, Sniff::NoName { http: false })),
                s => return Some((buf, s)),
            }
        }
    }

    /// Where the connection may go, in order of preference, each with the decision that allows it; or the
    /// denial and the address it concerns.
    async fn decide(
        &self,
        orig_dst: SocketAddr,
        name: Option<&str>,
    ) -> Result<Vec<(IpAddr, Decision)>, (Decision, IpAddr)> {
        let policy = self.ctx.policy();
        let dialed = orig_dst.ip();
        let by_name = name.and_then(|n| policy.decide_name(n).map(|d| (n, d)));
        let Some((name, decision)) = by_name else {
            let decision = policy.decide_addr(dialed, &self.ctx.extra_denied);
            return if decision.allowed {
                Ok(vec![(dialed, decision)])
            } else {
                Err((decision, dialed))
            };
        };
        if !decision.allowed {
            return Err((decision, dialed));
        }
        let resolved = match self.upstream.resolve(name).await {
            Ok(addrs) if !addrs.is_empty() => addrs,
            Ok(_) | Err(_) => return Err((Decision::denied(reason::UNRESOLVABLE), dialed)),
        };
        let mut usable: Vec<IpAddr> = resolved
            .iter()
            .copied()
            .filter(|ip| {
                let d = policy.decide_addr(*ip, &self.ctx.extra_denied);
                d.reason != reason::ALWAYS_DENIED && d.reason != reason::DENY_RULE
            })
            .collect();
        if usable.is_empty() {
            return Err((Decision::denied(reason::RESOLVES_TO_DENIED), resolved[0]));
        }
        // The address the guest dialed first if the name has it, then IPv4 before IPv6.
        usable.sort_by_key(|ip| (*ip != dialed, ip.is_ipv6()));
        Ok(usable.into_iter().map(|ip| (ip, decision.clone())).collect())
    }
}

/// The destination a redirected (DNAT/REDIRECT) connection was originally sent to.
pub fn original_dst(stream: &TcpStream) -> std::io::Result<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    let fd = stream.as_fd();
    match stream.local_addr()? {
        SocketAddr::V4(_) => {
            let sa = getsockopt(&fd, sockopt::OriginalDst).map_err(std::io::Error::from)?;
            let ip = std::net::Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr));
            Ok(SocketAddr::V4(SocketAddrV4::new(ip, u16::from_be(sa.sin_port))))
        }
        SocketAddr::V6(_) => {
            let sa = getsockopt(&fd, sockopt::Ip6tOriginalDst).map_err(std::io::Error::from)?;
            let ip = std::net::Ipv6Addr::from(sa.sin6_addr.s6_addr);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sa.sin6_port),
                0,
                0,
            )))
        }
    }
}

fn forbidden(reason: &str) -> String {
    let body = format!("hearth egress policy: connection refused ({reason})\n");
    format!(
        "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}
