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
//! Outbound sockets are created in the uplink namespace. Every attempt lands in the sandbox's audit log.
//!
//! # Every request of a kept-alive HTTP connection
//! When the first bytes are an HTTP/1 request, the connection stays framed ([`http1`]): every later request's
//! head is read before any of its bytes go upstream and must name **the same host as the first** (compared as
//! the sniffer reads it: lower case, port and trailing dot dropped; "no usable name" counts as a value of its
//! own), and that host must still be allowed by the policy in force now (on the connection's upstream address
//! when no domain rule names it). A request for another host is refused with `403` and reason `host_changed`
//! (HTTP/1 clients never reuse a connection across hosts, so only a guest that tries to reach a second site
//! through a server that hosts several is refused); one the current policy denies gets its reason. A request
//! that cannot be framed with certainty gets `400` (`malformed_http`). Refused requests are logged; allowed
//! later requests are not (the connection is, once). Pipelined requests are judged one by one; only one head is
//! buffered at a time. A protocol switch is only accepted as a connection's first request: `Upgrade: websocket`
//! (opaque after `101`) and `CONNECT` (opaque after `2xx`); any other upgrade (`h2c`) is refused, since the
//! switched connection could carry requests for any host. An HTTP/2 preface or another non-HTTP/1 first
//! request is treated like any other protocol: the dialed address decides and the bytes are not framed.
//!
//! # TLS
//! The SNI of the ClientHello decides once per connection. Everything after it is encrypted and relayed as
//! is: the proxy cannot see the HTTP requests inside, so a client that reuses a connection for another name
//! (HTTP/2 connection coalescing across names of one certificate) or a server that serves several names
//! behind one address (domain fronting) can reach a name the SNI did not carry. TLS 1.2 renegotiation happens
//! inside the encrypted channel and cannot be seen either (TLS 1.3 has none); what the proxy enforces is that
//! the connection goes to an address of an allowed name, chosen by the proxy.
//!
//! # Bounds
//! A sandbox's proxy holds at most [`crate::limits::NetLimits::proxy_per_sandbox`] connections, each taking
//! two descriptors from the budget all sandboxes share; a connection beyond either is reset at once. A
//! connection with no byte in either direction for [`ProxyLimits::idle_timeout`] is closed.

mod http1;
mod relay;
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

pub use http1::{Body, FrameError, RequestFramer, RequestHead, Step, Switch, parse_head};
pub use sniff::{Sniff, http_host, sniff, tls_sni};

use crate::ctx::SandboxNetCtx;
use crate::dns::Upstream;
use crate::limits::{PROXY_CONNECTION_FDS, RefusalLog};
use crate::policy::{Decision, reason};
use relay::{Judge, Refusal, Timeouts, Up};

/// Bounds on the time and memory the proxy spends on one connection (how many connections a sandbox may
/// hold is [`crate::limits::NetLimits`], in the sandbox's context).
#[derive(Debug, Clone)]
pub struct ProxyLimits {
    /// Most bytes read from the guest before deciding; also the largest HTTP request head.
    pub peek_bytes: usize,
    /// Longest wait for those bytes (then the connection is decided without a name).
    pub peek_timeout: Duration,
    /// Longest wait for each outbound connect.
    pub connect_timeout: Duration,
    /// Resolved addresses tried at most.
    pub connect_attempts: usize,
    /// A connection with no byte in either direction for this long is closed.
    pub idle_timeout: Duration,
    /// After a later request was refused, how long the upstream may pause while finishing its answers to the
    /// requests before it (then the connection is closed without the refusal).
    pub drain_timeout: Duration,
}

impl Default for ProxyLimits {
    fn default() -> Self {
        ProxyLimits {
            peek_bytes: 16 * 1024,
            peek_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(10),
            connect_attempts: 3,
            idle_timeout: Duration::from_secs(300),
            drain_timeout: Duration::from_secs(10),
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
    refusals: RefusalLog,
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

/// How the first bytes of a connection are followed.
enum Framing {
    /// Not HTTP/1: relayed as they come.
    Opaque,
    /// HTTP/1: the first head is `first_len` bytes and asks for `switch`; `framer` has read it.
    Http {
        framer: RequestFramer,
        first_len: usize,
        switch: Option<Switch>,
    },
}

impl Proxy {
    pub fn new(
        ctx: Arc<SandboxNetCtx>,
        upstream: Arc<Upstream>,
        uplink_ns: PathBuf,
        limits: ProxyLimits,
    ) -> Self {
        let connections = Arc::new(Semaphore::new(ctx.limits.proxy_per_sandbox.max(1)));
        Proxy {
            ctx,
            upstream,
            uplink_ns,
            limits,
            connections,
            refusals: RefusalLog::default(),
        }
    }

    /// The sandbox state the proxy decides with.
    pub fn ctx(&self) -> &Arc<SandboxNetCtx> {
        &self.ctx
    }

    /// Accepts redirected connections on `listener` and handles each on its own task, within the sandbox's
    /// connection limit and the shared budget.
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
                self.refuse(stream, "sandbox");
                continue;
            };
            let Some(fds) = self.ctx.limits.budget.try_take(PROXY_CONNECTION_FDS) else {
                self.refuse(stream, "global");
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
                drop((permit, fds));
            });
        }
    }

    /// Resets a connection over a limit at once: no task, no `TIME_WAIT`; counted, and logged at most once a
    /// second.
    fn refuse(&self, stream: TcpStream, limit: &'static str) {
        if self.refusals.refused("proxy", limit) {
            let dst = original_dst(&stream).ok();
            tracing::warn!(sandbox = %self.ctx.id, limit, "egress proxy at its connection limit");
            self.ctx.audit.record(
                NetProtocol::Tcp,
                dst.map(|d| d.ip()),
                dst.map(|d| d.port()),
                None,
                &Decision::denied(reason::CONNECTION_LIMIT),
            );
        }
        let _ = stream.set_zero_linger();
    }

    /// Handles one guest connection whose original destination is `orig_dst`: decides, connects, relays.
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
        let framing = match self.framing(&peeked, &sniffed) {
            Ok(f) => f,
            Err(e) => {
                let decision = Decision::denied(reason::MALFORMED_HTTP);
                self.ctx.audit.record(
                    NetProtocol::Tcp,
                    Some(orig_dst.ip()),
                    Some(port),
                    name.as_deref(),
                    &decision,
                );
                let _ = client.write_all(&Refusal::bad_request(&e).to_bytes()).await;
                return;
            }
        };
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
                    let refusal = Refusal::forbidden(decision.reason);
                    let _ = client.write_all(&refusal.to_bytes()).await;
                }
                return;
            }
        };
        let Some((upstream, ip)) = self.connect(&targets, port, name.as_deref()).await else {
            return;
        };
        let _ = upstream.set_nodelay(true);
        let _ = client.set_nodelay(true);
        self.relay(client, upstream, peeked, framing, name, SocketAddr::new(ip, port))
            .await;
    }

    /// How to follow the connection: framed if its first bytes are an HTTP/1 request (required when they named
    /// a host, which then decides), opaque otherwise. An error: an HTTP request that cannot be framed.
    fn framing(&self, peeked: &[u8], sniffed: &Sniff) -> Result<Framing, FrameError> {
        let required = match sniffed {
            Sniff::Http(_) => true,
            Sniff::NoName { http: true } => false,
            _ => return Ok(Framing::Opaque),
        };
        let mut framer = RequestFramer::new(self.limits.peek_bytes);
        match framer.step(peeked) {
            Step::Head { len, head } => Ok(Framing::Http {
                framer,
                first_len: len,
                switch: head.switch,
            }),
            Step::Error(FrameError::NotHttp1) if !required => Ok(Framing::Opaque),
            Step::Error(e) => Err(e),
            Step::NeedMore | Step::Forward(_) if !required => Ok(Framing::Opaque),
            Step::NeedMore | Step::Forward(_) => Err(FrameError::HeadTooLarge(self.limits.peek_bytes)),
        }
    }

    /// Connects to the first reachable target (in the uplink namespace), recording the attempt.
    async fn connect(
        &self,
        targets: &[(IpAddr, Decision)],
        port: u16,
        name: Option<&str>,
    ) -> Option<(TcpStream, IpAddr)> {
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
                        .record(NetProtocol::Tcp, Some(*ip), Some(port), name, decision);
                    return Some((stream, *ip));
                }
                Ok(Err(e)) => tracing::debug!(sandbox = %self.ctx.id, %addr, error = %e, "egress connect"),
                Err(_) => tracing::debug!(sandbox = %self.ctx.id, %addr, "egress connect timed out"),
            }
        }
        // Allowed, but unreachable: still an attempt.
        if let Some((ip, decision)) = targets.first() {
            self.ctx
                .audit
                .record(NetProtocol::Tcp, Some(*ip), Some(port), name, decision);
        }
        None
    }

    /// Relays an established connection to `to` as `framing` says.
    async fn relay(
        &self,
        mut client: TcpStream,
        mut upstream: TcpStream,
        mut peeked: Vec<u8>,
        framing: Framing,
        name: Option<String>,
        to: SocketAddr,
    ) {
        let timeouts = Timeouts {
            idle: self.limits.idle_timeout,
            drain: self.limits.drain_timeout,
        };
        let Framing::Http {
            framer,
            first_len,
            switch,
        } = framing
        else {
            relay::relay(
                &mut client,
                &mut upstream,
                &peeked,
                Vec::new(),
                Up::Opaque,
                timeouts,
            )
            .await;
            return;
        };
        let rest = peeked.split_off(first_len.min(peeked.len()));
        let judge = LaterRequests {
            proxy: self,
            first_host: name,
            to,
        };
        if let Some(switch) = switch {
            if upstream.write_all(&peeked).await.is_err() {
                return;
            }
            let answer = relay::await_switch(
                &mut client,
                &mut upstream,
                switch,
                self.limits.peek_bytes,
                self.limits.idle_timeout,
            )
            .await;
            match answer {
                Some(true) => relay::relay(&mut client, &mut upstream, &[], rest, Up::Opaque, timeouts).await,
                Some(false) => {
                    let up = Up::Framed {
                        framer,
                        judge: &judge,
                    };
                    relay::relay(&mut client, &mut upstream, &[], rest, up, timeouts).await
                }
                None => {}
            }
            return;
        }
        let up = Up::Framed {
            framer,
            judge: &judge,
        };
        relay::relay(&mut client, &mut upstream, &peeked, rest, up, timeouts).await;
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

/// Judges the requests after the first of a framed connection to `to` whose first request named `first_host`.
struct LaterRequests<'a> {
    proxy: &'a Proxy,
    first_host: Option<String>,
    to: SocketAddr,
}

impl LaterRequests<'_> {
    /// The same host as the first request, still allowed by the policy in force now.
    fn decide(&self, head: &RequestHead) -> Result<(), Decision> {
        if head.host != self.first_host {
            return Err(Decision::denied(reason::HOST_CHANGED));
        }
        let ctx = &self.proxy.ctx;
        let policy = ctx.policy();
        let by_addr = policy.decide_addr(self.to.ip(), &ctx.extra_denied);
        match self.first_host.as_deref().and_then(|n| policy.decide_name(n)) {
            Some(d) if !d.allowed => Err(d),
            Some(_) if by_addr.reason == reason::ALWAYS_DENIED || by_addr.reason == reason::DENY_RULE => {
                Err(by_addr)
            }
            Some(_) => Ok(()),
            None if by_addr.allowed => Ok(()),
            None => Err(by_addr),
        }
    }

    fn record(&self, name: Option<&str>, decision: &Decision) {
        self.proxy.ctx.audit.record(
            NetProtocol::Tcp,
            Some(self.to.ip()),
            Some(self.to.port()),
            name,
            decision,
        );
    }
}

impl Judge for LaterRequests<'_> {
    fn request(&self, head: &RequestHead) -> Option<Refusal> {
        let decision = self.decide(head).err()?;
        self.record(head.host.as_deref(), &decision);
        Some(Refusal::forbidden(decision.reason))
    }

    fn malformed(&self, e: &FrameError) -> Refusal {
        self.record(None, &Decision::denied(reason::MALFORMED_HTTP));
        Refusal::bad_request(e)
    }
}
