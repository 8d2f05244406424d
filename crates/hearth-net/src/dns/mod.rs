//! The per-sandbox platform resolver (on [`crate::GATEWAY`]:53 inside the sandbox namespace, UDP and TCP) and
//! the upstream client it and the egress proxy use.
//!
//! What the resolver answers:
//! - `*.internal`: from the sandbox's private-network names (A records), NXDOMAIN otherwise; never forwarded.
//! - a name the policy makes resolvable ([`crate::policy::Policy::resolvable`]): A and AAAA looked up upstream,
//!   answered with the addresses that are not always denied (the others are dropped and logged as
//!   `resolves_to_denied`); other record types get an empty answer;
//! - anything else: REFUSED, without any upstream traffic, so that DNS cannot carry data out.
//!
//! Every query lands in the sandbox's audit log. Guest datagrams are hostile: anything that does not decode, or
//! is not a single-question standard query, is ignored or refused; names with bytes outside host name syntax are
//! refused.

mod upstream;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use hearth_api::NetProtocol;
use hickory_proto::op::{Edns, Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{DNSClass, Name, RData, Record, RecordType};
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

pub use upstream::{DEFAULT_TIMEOUT, ResolveError, Upstream, decode_reply};

use crate::ctx::SandboxNetCtx;
use crate::limits::{DNS_TCP_CONNECTION_FDS, RefusalLog};
use crate::policy::{Decision, reason};

/// Queries one resolver handles at once; more are dropped (the guest retries).
const MAX_IN_FLIGHT: usize = 64;
/// Answers carry at most this many addresses.
pub const MAX_ANSWERS: usize = 16;
/// TTL of private-network answers (peers come and go).
const PRIVATE_TTL: u32 = 5;
/// Longest TTL handed to the guest.
const MAX_TTL: u32 = 60;
/// Queries answered on one TCP connection.
pub const MAX_TCP_QUERIES: usize = 64;
/// A TCP connection idle this long is closed.
pub const TCP_IDLE: std::time::Duration = std::time::Duration::from_secs(10);
/// Denied addresses logged per query (a hostile upstream could return hundreds).
const MAX_DENIED_LOGGED: usize = 4;

/// Serves DNS on `socket` (bound in the sandbox namespace) for the sandbox of `ctx`, until the task is aborted.
/// Must be called inside a Tokio runtime.
pub fn spawn_resolver(
    socket: std::net::UdpSocket,
    ctx: Arc<SandboxNetCtx>,
    upstream: Arc<Upstream>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let socket = match socket
            .set_nonblocking(true)
            .and_then(|()| tokio::net::UdpSocket::from_std(socket))
        {
            Ok(s) => Arc::new(s),
            Err(e) => {
                tracing::error!(sandbox = %ctx.id, error = %e, "DNS resolver socket unusable");
                return;
            }
        };
        let in_flight = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let mut buf = vec![0u8; 4096];
        loop {
            let (len, peer) = match socket.recv_from(&mut buf).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!(sandbox = %ctx.id, error = %e, "DNS receive");
                    continue;
                }
            };
            let Some(request) = parse_query(&buf[..len]) else {
                continue;
            };
            let Ok(permit) = in_flight.clone().try_acquire_owned() else {
                continue;
            };
            let (socket, ctx, upstream) = (socket.clone(), ctx.clone(), upstream.clone());
            tokio::spawn(async move {
                let reply = answer(&request, &ctx, &upstream).await;
                if let Some(bytes) = encode(&request, reply, udp_limit(&request)) {
                    let _ = socket.send_to(&bytes, peer).await;
                }
                drop(permit);
            });
        }
    })
}

/// Serves DNS over TCP (RFC 7766 framing) on `listener` (bound in the sandbox namespace), for clients that fall
/// back to TCP. Same answers as over UDP. At most [`crate::limits::NetLimits::dns_tcp_per_sandbox`] connections
/// at once, each taking a descriptor from the shared budget, [`MAX_TCP_QUERIES`] queries each, closed after
/// [`TCP_IDLE`] without a query; connections beyond are reset at once. Must be called inside a Tokio runtime.
pub fn spawn_tcp_resolver(
    listener: std::net::TcpListener,
    ctx: Arc<SandboxNetCtx>,
    upstream: Arc<Upstream>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let listener = match listener
            .set_nonblocking(true)
            .and_then(|()| tokio::net::TcpListener::from_std(listener))
        {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(sandbox = %ctx.id, error = %e, "DNS TCP listener unusable");
                return;
            }
        };
        let connections = Arc::new(Semaphore::new(ctx.limits.dns_tcp_per_sandbox.max(1)));
        let refusals = RefusalLog::default();
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            };
            let Ok(permit) = connections.clone().try_acquire_owned() else {
                refuse(stream, &ctx, &refusals, "sandbox");
                continue;
            };
            let Some(fds) = ctx.limits.budget.try_take(DNS_TCP_CONNECTION_FDS) else {
                refuse(stream, &ctx, &refusals, "global");
                continue;
            };
            let (ctx, upstream) = (ctx.clone(), upstream.clone());
            tokio::spawn(async move {
                serve_tcp(stream, &ctx, &upstream).await;
                drop((permit, fds));
            });
        }
    })
}

/// Resets a DNS-over-TCP connection over a limit at once (no task, no `TIME_WAIT`); logged at most once a
/// second.
fn refuse(stream: tokio::net::TcpStream, ctx: &SandboxNetCtx, refusals: &RefusalLog, limit: &'static str) {
    if refusals.refused("dns_tcp", limit) {
        tracing::warn!(sandbox = %ctx.id, limit, "DNS-over-TCP at its connection limit");
        ctx.audit.record(
            NetProtocol::Dns,
            None,
            None,
            None,
            &Decision::denied(reason::CONNECTION_LIMIT),
        );
    }
    let _ = stream.set_zero_linger();
}

/// Answers length-prefixed queries on one connection until the client closes, sends garbage or idles.
async fn serve_tcp(mut stream: tokio::net::TcpStream, ctx: &SandboxNetCtx, upstream: &Upstream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for _ in 0..MAX_TCP_QUERIES {
        let mut len = [0u8; 2];
        let read = tokio::time::timeout(TCP_IDLE, async {
            stream.read_exact(&mut len).await?;
            let mut buf = vec![0u8; usize::from(u16::from_be_bytes(len))];
            stream.read_exact(&mut buf).await?;
            Ok::<_, std::io::Error>(buf)
        })
        .await;
        let Ok(Ok(buf)) = read else { return };
        let Some(request) = parse_query(&buf) else {
            return;
        };
        let reply = answer(&request, ctx, upstream).await;
        let Some(bytes) = encode(&request, reply, usize::from(u16::MAX)) else {
            return;
        };
        let Ok(n) = u16::try_from(bytes.len()) else { return };
        let mut framed = n.to_be_bytes().to_vec();
        framed.extend_from_slice(&bytes);
        if stream.write_all(&framed).await.is_err() {
            return;
        }
    }
}

/// The largest UDP reply the client accepts: 512 bytes without EDNS, else what it advertises (up to 1232, the
/// size that avoids fragmentation).
pub fn udp_limit(request: &Message) -> usize {
    match &request.edns {
        Some(e) => usize::from(e.max_payload()).clamp(512, 1232),
        None => 512,
    }
}

/// `reply` encoded, with an OPT record if the request had one, and addresses dropped from the end until it fits
/// in `limit` bytes.
pub fn encode(request: &Message, mut reply: Message, limit: usize) -> Option<Vec<u8>> {
    if request.edns.is_some() {
        let mut edns = Edns::new();
        edns.set_max_payload(1232);
        reply.set_edns(edns);
    }
    loop {
        let bytes = reply.to_vec().ok()?;
        if bytes.len() <= limit || reply.answers.is_empty() {
            return Some(bytes);
        }
        reply.answers.pop();
    }
}

/// A guest datagram (or TCP message) decoded, if it is a query; anything else is ignored.
pub fn parse_query(bytes: &[u8]) -> Option<Message> {
    let request = Message::from_vec(bytes).ok()?;
    (request.metadata.message_type == MessageType::Query).then_some(request)
}

/// What the resolver does with a query.
#[derive(Debug)]
pub enum Plan {
    /// Answer at once (refused, not implemented, a private-network name, a type that is not looked up...).
    Reply(Message),
    /// Look `name` up upstream as `rtype` (A or AAAA), which `decision` allows; then [`finish`] the reply.
    Lookup {
        reply: Message,
        name: String,
        rtype: RecordType,
        decision: Decision,
    },
}

/// The reply to `request` (a decoded query).
pub async fn answer(request: &Message, ctx: &SandboxNetCtx, upstream: &Upstream) -> Message {
    match plan(request, ctx) {
        Plan::Reply(reply) => reply,
        Plan::Lookup {
            reply,
            name,
            rtype,
            decision,
        } => {
            let result = upstream.lookup(&name, rtype).await;
            finish(reply, &name, &decision, result, ctx)
        }
    }
}

/// Decides a query without any I/O (every decision but the upstream's answer is taken here); audit entries
/// of the decisions that end here are recorded.
pub fn plan(request: &Message, ctx: &SandboxNetCtx) -> Plan {
    let mut reply = Message::response(request.metadata.id, request.metadata.op_code);
    reply.metadata.recursion_desired = request.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    if request.metadata.op_code != OpCode::Query {
        reply.metadata.response_code = ResponseCode::NotImp;
        return Plan::Reply(reply);
    }
    if request.queries.len() != 1 {
        reply.metadata.response_code = ResponseCode::FormErr;
        return Plan::Reply(reply);
    }
    let query = &request.queries[0];
    reply.add_query(query.clone());
    let qname = query.name();
    let Some(name) = plain_name(qname) else {
        reply.metadata.response_code = ResponseCode::Refused;
        ctx.audit.record(
            NetProtocol::Dns,
            None,
            None,
            None,
            &Decision::denied(reason::DNS_BLOCKED),
        );
        return Plan::Reply(reply);
    };
    if query.query_class() != DNSClass::IN {
        reply.metadata.response_code = ResponseCode::Refused;
        ctx.audit.record(
            NetProtocol::Dns,
            None,
            None,
            Some(&name),
            &Decision::denied(reason::DNS_BLOCKED),
        );
        return Plan::Reply(reply);
    }
    let rtype = query.query_type();

    if name == "internal" || name.ends_with(".internal") {
        return Plan::Reply(private_answer(reply, &name, rtype, ctx));
    }

    let policy = ctx.policy();
    let decision = policy.resolvable(&name);
    if !decision.allowed {
        reply.metadata.response_code = ResponseCode::Refused;
        ctx.audit
            .record(NetProtocol::Dns, None, None, Some(&name), &decision);
        return Plan::Reply(reply);
    }
    if rtype != RecordType::A && rtype != RecordType::AAAA {
        // Allowed name, but only addresses are looked up: nothing else leaves through the resolver.
        ctx.audit
            .record(NetProtocol::Dns, None, None, Some(&name), &decision);
        return Plan::Reply(reply);
    }
    Plan::Lookup {
        reply,
        name,
        rtype,
        decision,
    }
}

/// A `*.internal` name answered from the sandbox's private-network names.
fn private_answer(mut reply: Message, name: &str, rtype: RecordType, ctx: &SandboxNetCtx) -> Message {
    match ctx.private_addr(name) {
        Some(addr) => {
            if rtype == RecordType::A
                && let Some(qname) = reply.queries.first().map(|q| q.name().clone())
            {
                reply.add_answer(Record::from_rdata(qname, PRIVATE_TTL, RData::A(A(addr))));
            }
            ctx.audit.record(
                NetProtocol::Dns,
                Some(IpAddr::V4(addr)),
                None,
                Some(name),
                &Decision::allowed(reason::PRIVATE_PEER),
            );
        }
        None => {
            reply.metadata.response_code = ResponseCode::NXDomain;
            ctx.audit.record(
                NetProtocol::Dns,
                None,
                None,
                Some(name),
                &Decision::denied(reason::UNRESOLVABLE),
            );
        }
    }
    reply
}

/// The reply of a [`Plan::Lookup`] once the upstream answered `result`: the addresses that are not always
/// denied (at most [`MAX_ANSWERS`]), or the upstream's failure.
pub fn finish(
    mut reply: Message,
    name: &str,
    decision: &Decision,
    result: Result<Vec<IpAddr>, ResolveError>,
    ctx: &SandboxNetCtx,
) -> Message {
    let addrs = match result {
        Ok(addrs) => addrs,
        Err(e) => {
            reply.metadata.response_code = match e {
                ResolveError::NxDomain { .. } => ResponseCode::NXDomain,
                _ => ResponseCode::ServFail,
            };
            tracing::debug!(sandbox = %ctx.id, error = %e, "DNS upstream lookup");
            ctx.audit.record(
                NetProtocol::Dns,
                None,
                None,
                Some(name),
                &Decision::denied(reason::UNRESOLVABLE),
            );
            return reply;
        }
    };
    let policy = ctx.policy();
    let (kept, dropped): (Vec<IpAddr>, Vec<IpAddr>) = addrs
        .into_iter()
        .partition(|ip| policy.decide_addr(*ip, &ctx.extra_denied).reason != reason::ALWAYS_DENIED);
    for ip in dropped.iter().take(MAX_DENIED_LOGGED) {
        ctx.audit.record(
            NetProtocol::Dns,
            Some(*ip),
            None,
            Some(name),
            &Decision::denied(reason::RESOLVES_TO_DENIED),
        );
    }
    if !kept.is_empty() || dropped.is_empty() {
        ctx.audit.record(
            NetProtocol::Dns,
            kept.first().copied(),
            None,
            Some(name),
            decision,
        );
    }
    let Some(qname) = reply.queries.first().map(|q| q.name().clone()) else {
        return reply;
    };
    for ip in kept.into_iter().take(MAX_ANSWERS) {
        let data = match ip {
            IpAddr::V4(v4) => RData::A(A(v4)),
            IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
        };
        reply.add_answer(Record::from_rdata(qname.clone(), MAX_TTL, data));
    }
    reply
}

/// The name in host name syntax (labels of letters, digits, `-` and `_`), lower case without the final dot;
/// `None` for the root or a name with any other byte (which could make a label look like two).
fn plain_name(name: &Name) -> Option<String> {
    let mut out = String::new();
    for label in name.iter() {
        if label.is_empty()
            || !label
                .iter()
                .all(|b| b.is_ascii_alphanumeric() || *b == b'-' || *b == b'_')
        {
            return None;
        }
        if !out.is_empty() {
            out.push('.');
        }
        out.extend(label.iter().map(|b| b.to_ascii_lowercase() as char));
    }
    (!out.is_empty()).then_some(out)
}

/// Where the resolver listens in the sandbox namespace: the guest's gateway, port 53.
pub fn listen_addr() -> SocketAddr {
    (crate::GATEWAY, 53).into()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn plain_names() {
        let n = |s: &str| Name::from_ascii(s).unwrap();
        assert_eq!(
            plain_name(&n("WWW.Example.com.")).as_deref(),
            Some("www.example.com")
        );
        assert_eq!(
            plain_name(&n("_dmarc.example.com.")).as_deref(),
            Some("_dmarc.example.com")
        );
        assert_eq!(plain_name(&n(".")), None);
        // A label holding a dot must not pass for two labels (`evil.example` under `com`).
        let tricky = Name::from_labels(vec![&b"evil.example"[..], &b"com"[..]]).unwrap();
        assert_eq!(plain_name(&tricky), None);
        let spaced = Name::from_labels(vec![&b"a b"[..], &b"com"[..]]).unwrap();
        assert_eq!(plain_name(&spaced), None);
    }
}
