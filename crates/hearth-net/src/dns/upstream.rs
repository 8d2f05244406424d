//! The daemon's DNS client: asks the configured upstream server over UDP from a socket created in the uplink
//! namespace. Answers must come from the server, carry the query's id and repeat its question; anything else is
//! ignored (a spoofed or stale datagram cannot inject addresses). Positive answers are cached briefly.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::{DNSClass, Name, RData, RecordType};

/// How long a lookup waits for a valid answer in total.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(4);
/// The query is sent again after this long without a valid answer.
const RETRANSMIT: Duration = Duration::from_millis(1200);
/// How much longer the IPv6 lookup may take once IPv4 addresses are known.
const AAAA_GRACE: Duration = Duration::from_millis(300);
/// Longest time an answer is cached, whatever its TTL.
const MAX_CACHE_TTL: u32 = 60;
/// Cached answers kept at most.
const CACHE_ENTRIES: usize = 2048;
/// CNAME hops followed inside one answer.
const MAX_CNAME_HOPS: usize = 8;

/// A failed lookup.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The upstream server says the name does not exist.
    #[error("{name}: no such name")]
    NxDomain { name: String },
    /// No valid answer before the timeout.
    #[error("{name}: the upstream resolver did not answer")]
    Timeout { name: String },
    /// The upstream server answered with an error code.
    #[error("{name}: the upstream resolver answered {code}")]
    Failed { name: String, code: ResponseCode },
    /// The name cannot be put in a query.
    #[error("{name:?} is not a valid DNS name")]
    InvalidName { name: String },
    /// The upstream socket failed.
    #[error("upstream DNS socket")]
    Io(#[from] std::io::Error),
}

/// Lower-case name and record type.
type CacheKey = (String, RecordType);

/// A DNS client for the sandboxes' resolvers and the egress proxy.
#[derive(Debug)]
pub struct Upstream {
    server: SocketAddr,
    netns: PathBuf,
    timeout: Duration,
    cache: Mutex<HashMap<CacheKey, (Instant, Vec<IpAddr>)>>,
    /// One socket per exchange in flight, at most [`crate::limits::UPSTREAM_SOCKETS`] across every sandbox;
    /// further lookups wait their turn (within their timeout).
    sockets: tokio::sync::Semaphore,
}

impl Upstream {
    /// A client of `server`, whose sockets are created in the network namespace at `netns` (the uplink's; the
    /// host's is [`crate::netns::host_netns`]).
    pub fn new(server: SocketAddr, netns: impl Into<PathBuf>) -> Self {
        Upstream {
            server,
            netns: netns.into(),
            timeout: DEFAULT_TIMEOUT,
            cache: Mutex::new(HashMap::new()),
            sockets: tokio::sync::Semaphore::new(crate::limits::UPSTREAM_SOCKETS),
        }
    }

    /// Sets how long a lookup waits in total.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    pub fn server(&self) -> SocketAddr {
        self.server
    }

    /// The IPv4 and IPv6 addresses of `name` (IPv4 first), looked up in parallel. Once IPv4 addresses are known,
    /// the IPv6 lookup gets only a short grace period (an upstream that drops AAAA queries must not stall every
    /// connection). Fails only if both lookups fail.
    pub async fn resolve(&self, name: &str) -> Result<Vec<IpAddr>, ResolveError> {
        let v4_lookup = self.lookup(name, RecordType::A);
        let v6_lookup = self.lookup(name, RecordType::AAAA);
        tokio::pin!(v4_lookup, v6_lookup);
        let (mut v4, mut v6) = (None, None);
        let (v4, v6) = loop {
            tokio::select! {
                r = &mut v4_lookup, if v4.is_none() => v4 = Some(r),
                r = &mut v6_lookup, if v6.is_none() => v6 = Some(r),
            }
            if v6.is_none() && matches!(&v4, Some(Ok(a)) if !a.is_empty()) {
                v6 = Some(
                    tokio::time::timeout(AAAA_GRACE, &mut v6_lookup)
                        .await
                        .unwrap_or(Ok(Vec::new())),
                );
            }
            match (v4.take(), v6.take()) {
                (Some(a), Some(b)) => break (a, b),
                (a, b) => (v4, v6) = (a, b),
            }
        };
        match (v4, v6) {
            (Ok(mut a), Ok(aaaa)) => {
                a.extend(aaaa);
                Ok(a)
            }
            (Ok(a), Err(_)) => Ok(a),
            (Err(_), Ok(aaaa)) => Ok(aaaa),
            (Err(e), Err(_)) => Err(e),
        }
    }

    /// The addresses of `name` of type `rtype` (A or AAAA; other types give no addresses).
    pub async fn lookup(&self, name: &str, rtype: RecordType) -> Result<Vec<IpAddr>, ResolveError> {
        let key = (crate::policy::normalize_name(name), rtype);
        if let Some(hit) = self.cached(&key) {
            return Ok(hit);
        }
        let qname = Name::from_ascii(format!("{}.", key.0)).map_err(|_| ResolveError::InvalidName {
            name: name.to_owned(),
        })?;
        let (addrs, ttl) = self.exchange(&qname, rtype, &key.0).await?;
        if ttl > 0 {
            self.store(key, addrs.clone(), ttl);
        }
        Ok(addrs)
    }

    async fn exchange(
        &self,
        qname: &Name,
        rtype: RecordType,
        name: &str,
    ) -> Result<(Vec<IpAddr>, u32), ResolveError> {
        let bind: SocketAddr = match self.server {
            SocketAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
            SocketAddr::V6(_) => (Ipv6Addr::UNSPECIFIED, 0).into(),
        };
        let deadline = tokio::time::Instant::now() + self.timeout;
        let timeout = || ResolveError::Timeout {
            name: name.to_owned(),
        };
        let _socket_slot = tokio::time::timeout_at(deadline, self.sockets.acquire())
            .await
            .map_err(|_| timeout())?
            .map_err(|_| timeout())?;
        let ns = self.netns.clone();
        let std_socket = tokio::task::spawn_blocking(move || crate::netns::udp_socket(&ns, bind))
            .await
            .map_err(|_| std::io::Error::other("socket thread failed"))??;
        let socket = tokio::net::UdpSocket::from_std(std_socket)?;
        socket.connect(self.server).await?;

        let id: u16 = rand::random();
        let mut query = Message::new(id, MessageType::Query, OpCode::Query);
        query.metadata.recursion_desired = true;
        query.add_query(Query::query(qname.clone(), rtype));
        let bytes = query.to_vec().map_err(|_| ResolveError::InvalidName {
            name: name.to_owned(),
        })?;

        let mut buf = vec![0u8; 4096];
        loop {
            socket.send(&bytes).await?;
            let resend_at = (tokio::time::Instant::now() + RETRANSMIT).min(deadline);
            loop {
                let received = tokio::time::timeout_at(resend_at, socket.recv(&mut buf)).await;
                let len = match received {
                    Ok(Ok(len)) => len,
                    // ICMP errors (port unreachable) surface here; keep waiting for a real answer.
                    Ok(Err(_)) => continue,
                    Err(_) => break,
                };
                let Some(reply) = decode_reply(&buf[..len], id, qname, rtype) else {
                    continue;
                };
                return match reply {
                    Ok(found) => Ok(found),
                    Err(ResponseCode::NXDomain) => Err(ResolveError::NxDomain {
                        name: name.to_owned(),
                    }),
                    Err(code) => Err(ResolveError::Failed {
                        name: name.to_owned(),
                        code,
                    }),
                };
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(timeout());
            }
        }
    }

    fn cached(&self, key: &CacheKey) -> Option<Vec<IpAddr>> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        match cache.get(key) {
            Some((expires, addrs)) if *expires > Instant::now() => Some(addrs.clone()),
            _ => None,
        }
    }

    fn store(&self, key: CacheKey, addrs: Vec<IpAddr>, ttl: u32) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if cache.len() >= CACHE_ENTRIES {
            cache.retain(|_, (expires, _)| *expires > now);
            if cache.len() >= CACHE_ENTRIES {
                cache.clear();
            }
        }
        cache.insert(
            key,
            (
                now + Duration::from_secs(u64::from(ttl.min(MAX_CACHE_TTL))),
                addrs,
            ),
        );
    }
}

/// An upstream datagram read as the answer to the query `id` for `qname`/`rtype`: `None` if it is not that
/// answer (another id, not a response, another question, undecodable: ignored, so a spoofed or stale datagram
/// cannot inject addresses); otherwise the addresses and their smallest TTL ([`addresses`]), or the error code.
/// The upstream is not the guest, but a name the policy allows can be served by a zone the guest controls.
pub fn decode_reply(
    bytes: &[u8],
    id: u16,
    qname: &Name,
    rtype: RecordType,
) -> Option<Result<(Vec<IpAddr>, u32), ResponseCode>> {
    let reply = matching_reply(bytes, id, qname, rtype)?;
    Some(match reply.metadata.response_code {
        ResponseCode::NoError => Ok(addresses(&reply, qname, rtype)),
        code => Err(code),
    })
}

/// `bytes` decoded, if it is the answer to our query: same id, a response, our question and only it.
fn matching_reply(bytes: &[u8], id: u16, qname: &Name, rtype: RecordType) -> Option<Message> {
    let reply = Message::from_vec(bytes).ok()?;
    let ours = reply.metadata.id == id
        && reply.metadata.message_type == MessageType::Response
        && reply.queries.len() == 1
        && reply.queries[0].name() == qname
        && reply.queries[0].query_type() == rtype
        && reply.queries[0].query_class() == DNSClass::IN;
    ours.then_some(reply)
}

/// The addresses of type `rtype` the answer gives for `qname`, following CNAMEs within the answer, and the
/// smallest TTL on the way (0 if there is no address).
fn addresses(reply: &Message, qname: &Name, rtype: RecordType) -> (Vec<IpAddr>, u32) {
    let mut names = vec![qname.clone()];
    let mut ttl = u32::MAX;
    for _ in 0..MAX_CNAME_HOPS {
        let mut grew = false;
        for r in &reply.answers {
            if let RData::CNAME(target) = &r.data
                && names.contains(&r.name)
                && !names.contains(&target.0)
            {
                names.push(target.0.clone());
                ttl = ttl.min(r.ttl);
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }
    let mut addrs = Vec::new();
    for r in &reply.answers {
        if r.dns_class != DNSClass::IN || !names.contains(&r.name) {
            continue;
        }
        let ip = match (&r.data, rtype) {
            (RData::A(a), RecordType::A) => IpAddr::V4(a.0),
            (RData::AAAA(a), RecordType::AAAA) => IpAddr::V6(a.0),
            _ => continue,
        };
        if !addrs.contains(&ip) {
            addrs.push(ip);
            ttl = ttl.min(r.ttl);
        }
    }
    if addrs.is_empty() {
        ttl = 0;
    }
    (addrs, ttl)
}
