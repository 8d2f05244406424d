//! Reading the kernel's NFLOG records of a sandbox's nftables rules (see [`crate::ruleset`]) into audit
//! events, so that attempts decided in the kernel (not by the proxy or the resolver) reach the audit log.
//!
//! A `NETLINK_NETFILTER` socket created inside the sandbox namespace (NFLOG groups are per namespace) binds
//! the group, asks for the first [`COPY_RANGE`] bytes of each packet and turns each `NFULNL_MSG_PACKET` into a
//! [`KernelEvent`]: the rule's prefix (`allow:<reason>` / `deny:<reason>`) and the packet's protocol,
//! destination and destination port. The kernel is trusted, but the bytes are still read with bounds checks
//! everywhere: nothing here can panic on any input.
//!
//! The socket holds a reference on the namespace: abort the task (or drop the receiver) when the sandbox goes.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

use hearth_api::network::NetProtocol;
use nix::sys::socket::{
    self, AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, sockopt,
};
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc::Sender;
use tokio::task::JoinHandle;

/// One connection attempt decided by the sandbox's nftables rules.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KernelEvent {
    pub allowed: bool,
    /// The reason of the prefix, e.g. `allow_rule`, `deny_rule`, `always_denied`, `dns_blocked`.
    pub reason: String,
    pub protocol: NetProtocol,
    pub destination: IpAddr,
    /// Destination port (TCP and UDP; `None` for other protocols and non-first fragments).
    pub port: Option<u16>,
}

/// How many bytes of each packet the kernel copies: enough for the IP header(s) and the ports.
pub const COPY_RANGE: u32 = 128;
/// A packet logged again within this time with the same ports is a retransmission of the same attempt (a
/// dropped SYN is retried after 1, 3, 7… s, and each retry is logged) and is not reported again.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(60);
/// Attempts remembered for [`REPEAT_WINDOW`] at most.
const REPEAT_MEMORY: usize = 4096;

// Netlink and nfnetlink_log constants (linux/netlink.h, linux/netfilter/nfnetlink*.h).
const NLMSG_HDRLEN: usize = 16;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NFGENMSG_LEN: usize = 4;
const NFNL_SUBSYS_ULOG: u16 = 4;
const NFULNL_MSG_PACKET: u16 = 0;
const NFULNL_MSG_CONFIG: u16 = 1;
const NFULA_CFG_CMD: u16 = 1;
const NFULA_CFG_MODE: u16 = 2;
const NFULA_CFG_TIMEOUT: u16 = 4;
const NFULA_CFG_QTHRESH: u16 = 5;
const NFULNL_CFG_CMD_BIND: u8 = 1;
const NFULNL_CFG_CMD_PF_BIND: u8 = 3;
const NFULNL_COPY_PACKET: u8 = 2;
const NFULA_PAYLOAD: u16 = 9;
const NFULA_PREFIX: u16 = 10;
const NLA_TYPE_MASK: u16 = 0x3fff;
const AF_UNSPEC: u8 = 0;
const AF_INET: u8 = 2;
const AF_INET6: u8 = 10;

/// Binds NFLOG `group` in the namespace at `ns` and spawns a task (on the current tokio runtime) that sends
/// a [`KernelEvent`] to `tx` for every logged packet whose prefix is one of the data plane's. The task ends
/// when `tx`'s receiver is dropped or the socket fails. Fails if the group is already bound in that namespace.
pub fn spawn_nflog(ns: &Path, group: u16, tx: Sender<KernelEvent>) -> std::io::Result<JoinHandle<()>> {
    let runtime = tokio::runtime::Handle::try_current().map_err(std::io::Error::other)?;
    let fd = crate::netns::in_netns(ns, move || open_bound(group))?;
    let _guard = runtime.enter();
    // SAFETY: an `OwnedFd` is a valid open descriptor that stays open, unchanged, until the `AsyncFd` that
    // owns it is dropped.
    let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
        .map_err(std::io::Error::from)?;
    Ok(runtime.spawn(read_loop(fd, tx)))
}

/// The socket, bound to `group` with packet copy mode; blocking calls time out so setup cannot hang.
fn open_bound(group: u16) -> std::io::Result<OwnedFd> {
    let fd = socket::socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkNetFilter,
    )?;
    socket::bind(fd.as_raw_fd(), &NetlinkAddr::new(0, 0))?;
    socket::setsockopt(&fd, sockopt::ReceiveTimeout, &nix::sys::time::TimeVal::new(2, 0))?;
    // Room for bursts: when the buffer overflows the kernel drops log records (never packets).
    let _ = socket::setsockopt(&fd, sockopt::RcvBuf, &(1 << 20));

    // Make nfnetlink_log the namespace's logger for both families (a no-op where it already is).
    for (seq, pf) in [(1, AF_INET), (2, AF_INET6)] {
        let msg = config_msg(seq, pf, 0, &[(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_PF_BIND])]);
        let _ = request(&fd, seq, &msg);
    }
    let bind = config_msg(3, AF_UNSPEC, group, &[(NFULA_CFG_CMD, &[NFULNL_CFG_CMD_BIND])]);
    request(&fd, 3, &bind)?;
    let mut mode = COPY_RANGE.to_be_bytes().to_vec();
    mode.extend_from_slice(&[NFULNL_COPY_PACKET, 0]);
    let cfg = config_msg(
        4,
        AF_UNSPEC,
        group,
        &[
            (NFULA_CFG_MODE, &mode),
            (NFULA_CFG_QTHRESH, &1u32.to_be_bytes()),
            (NFULA_CFG_TIMEOUT, &0u32.to_be_bytes()),
        ],
    );
    request(&fd, 4, &cfg)?;
    nix::fcntl::fcntl(&fd, nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::O_NONBLOCK))?;
    Ok(fd)
}

/// Sends a request and waits for its acknowledgement (a netlink error message with code 0).
fn request(fd: &OwnedFd, seq: u32, msg: &[u8]) -> std::io::Result<()> {
    socket::send(fd.as_raw_fd(), msg, MsgFlags::empty())?;
    let mut buf = vec![0u8; 8192];
    loop {
        let n = socket::recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
        for m in messages(buf.get(..n).unwrap_or(&[])) {
            if m.ty == NLMSG_ERROR && m.seq == seq {
                let code = m
                    .payload
                    .get(..4)
                    .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
                    .unwrap_or(-1);
                return if code == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::from_raw_os_error(code.saturating_neg()))
                };
            }
        }
    }
}

async fn read_loop(fd: AsyncFd<OwnedFd>, tx: Sender<KernelEvent>) {
    let mut buf = vec![0u8; 65536];
    let mut repeats = Repeats::default();
    loop {
        let mut guard = tokio::select! {
            _ = tx.closed() => return,
            r = fd.readable() => match r {
                Ok(g) => g,
                Err(e) => {
                    tracing::warn!(error = %e, "nflog socket");
                    return;
                }
            },
        };
        match socket::recv(fd.get_ref().as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
            Ok(n) => {
                for (ev, sport) in records(buf.get(..n).unwrap_or(&[])) {
                    if repeats.is_repeat(&ev, sport, Instant::now()) {
                        continue;
                    }
                    if tx.send(ev).await.is_err() {
                        return;
                    }
                }
            }
            Err(nix::errno::Errno::EAGAIN) => guard.clear_ready(),
            Err(nix::errno::Errno::ENOBUFS) => {
                tracing::warn!("nflog: the kernel dropped log records (buffer full)")
            }
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                tracing::warn!(error = %e, "nflog socket");
                return;
            }
        }
    }
}

fn config_msg(seq: u32, family: u8, group: u16, attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut m = vec![0u8; NLMSG_HDRLEN];
    m.extend_from_slice(&[family, 0]);
    m.extend_from_slice(&group.to_be_bytes());
    for (ty, data) in attrs {
        let len = 4 + data.len();
        m.extend_from_slice(&(len as u16).to_ne_bytes());
        m.extend_from_slice(&ty.to_ne_bytes());
        m.extend_from_slice(data);
        m.resize(align4(m.len()), 0);
    }
    let total = m.len() as u32;
    m[0..4].copy_from_slice(&total.to_ne_bytes());
    m[4..6].copy_from_slice(&((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG).to_ne_bytes());
    m[6..8].copy_from_slice(&(NLM_F_REQUEST | NLM_F_ACK).to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    m
}

struct NlMsg<'a> {
    ty: u16,
    seq: u32,
    payload: &'a [u8],
}

fn align4(n: usize) -> usize {
    n.saturating_add(3) & !3
}

fn u16_ne(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_ne_bytes([s[0], s[1]]))
}

fn u32_ne(b: &[u8], at: usize) -> Option<u32> {
    let s = b.get(at..at.checked_add(4)?)?;
    Some(u32::from_ne_bytes([s[0], s[1], s[2], s[3]]))
}

fn u16_be(b: &[u8], at: usize) -> Option<u16> {
    let s = b.get(at..at.checked_add(2)?)?;
    Some(u16::from_be_bytes([s[0], s[1]]))
}

/// The netlink messages of one datagram; stops at the first malformed header.
fn messages(buf: &[u8]) -> Vec<NlMsg<'_>> {
    let mut out = Vec::new();
    let mut off = 0usize;
    while let (Some(len), Some(ty), Some(seq)) =
        (u32_ne(buf, off), u16_ne(buf, off + 4), u32_ne(buf, off + 8))
    {
        let len = len as usize;
        if len < NLMSG_HDRLEN {
            break;
        }
        let Some(payload) = off
            .checked_add(len)
            .and_then(|end| buf.get(off + NLMSG_HDRLEN..end))
        else {
            break;
        };
        if ty == NLMSG_DONE {
            break;
        }
        out.push(NlMsg { ty, seq, payload });
        off = align4(off + len);
    }
    out
}

/// Every [`KernelEvent`] in one datagram from the NFLOG socket. Messages that are not packets, or whose
/// prefix is not the data plane's, are skipped.
pub fn parse_datagram(buf: &[u8]) -> Vec<KernelEvent> {
    records(buf).into_iter().map(|(ev, _)| ev).collect()
}

/// The events of a datagram with their packets' source ports.
fn records(buf: &[u8]) -> Vec<(KernelEvent, Option<u16>)> {
    messages(buf)
        .into_iter()
        .filter(|m| m.ty == ((NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET))
        .filter_map(|m| parse_packet_msg(m.payload))
        .collect()
}

/// Recently reported attempts, to drop the kernel's records of their retransmissions.
#[derive(Default)]
struct Repeats {
    seen: HashMap<(KernelEvent, Option<u16>), Instant>,
}

impl Repeats {
    /// Whether this record repeats one reported less than [`REPEAT_WINDOW`] ago (same verdict, destination
    /// and both ports); otherwise remembers it.
    fn is_repeat(&mut self, ev: &KernelEvent, sport: Option<u16>, now: Instant) -> bool {
        let key = (ev.clone(), sport);
        if let Some(at) = self.seen.get(&key)
            && now.saturating_duration_since(*at) < REPEAT_WINDOW
        {
            return true;
        }
        if self.seen.len() >= REPEAT_MEMORY {
            self.seen
                .retain(|_, at| now.saturating_duration_since(*at) < REPEAT_WINDOW);
            if self.seen.len() >= REPEAT_MEMORY {
                self.seen.clear();
            }
        }
        self.seen.insert(key, now);
        false
    }
}

/// One `NFULNL_MSG_PACKET` body (after the netlink header): nfgenmsg, then attributes.
fn parse_packet_msg(body: &[u8]) -> Option<(KernelEvent, Option<u16>)> {
    let mut prefix = None;
    let mut payload = None;
    let mut off = NFGENMSG_LEN;
    while let (Some(len), Some(ty)) = (u16_ne(body, off), u16_ne(body, off + 2)) {
        let len = usize::from(len);
        if len < 4 {
            break;
        }
        let data = body.get(off + 4..off.checked_add(len)?)?;
        match ty & NLA_TYPE_MASK {
            NFULA_PREFIX => prefix = Some(data),
            NFULA_PAYLOAD => payload = Some(data),
            _ => {}
        }
        off = align4(off + len);
    }
    let (allowed, reason) = parse_prefix(prefix?)?;
    let p = parse_packet(payload?)?;
    let ev = KernelEvent {
        allowed,
        reason,
        protocol: p.protocol,
        destination: p.destination,
        port: p.dport,
    };
    Some((ev, p.sport))
}

/// `allow:<reason>` or `deny:<reason>` (NUL-terminated), the reason made of `a-z`, `0-9` and `_`.
pub fn parse_prefix(raw: &[u8]) -> Option<(bool, String)> {
    let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
    let s = std::str::from_utf8(raw.get(..end)?).ok()?;
    let (verdict, reason) = s.split_once(':')?;
    let allowed = match verdict {
        "allow" => true,
        "deny" => false,
        _ => return None,
    };
    let valid = !reason.is_empty()
        && reason.len() <= 32
        && reason
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
    valid.then(|| (allowed, reason.to_owned()))
}

/// Protocol, destination and destination port of an IPv4 or IPv6 packet (possibly truncated to
/// [`COPY_RANGE`]).
pub fn parse_ip(p: &[u8]) -> Option<(NetProtocol, IpAddr, Option<u16>)> {
    parse_packet(p).map(|p| (p.protocol, p.destination, p.dport))
}

struct Packet {
    protocol: NetProtocol,
    destination: IpAddr,
    sport: Option<u16>,
    dport: Option<u16>,
}

fn parse_packet(p: &[u8]) -> Option<Packet> {
    match p.first()? >> 4 {
        4 => {
            let ihl = usize::from(p.first()? & 0x0f) * 4;
            if ihl < 20 {
                return None;
            }
            let dst: [u8; 4] = p.get(16..20)?.try_into().ok()?;
            let proto = *p.get(9)?;
            let first_fragment = u16_be(p, 6)? & 0x1fff == 0;
            let (sport, dport) = if first_fragment {
                l4_ports(proto, p, ihl)
            } else {
                (None, None)
            };
            let destination = IpAddr::V4(Ipv4Addr::from(dst));
            Some(Packet {
                protocol: protocol(proto),
                destination,
                sport,
                dport,
            })
        }
        6 => {
            let dst: [u8; 16] = p.get(24..40)?.try_into().ok()?;
            let mut next = *p.get(6)?;
            let mut off = 40usize;
            let mut first_fragment = true;
            // Skip a bounded number of extension headers.
            for _ in 0..8 {
                match next {
                    0 | 43 | 60 => {
                        let len = (usize::from(*p.get(off + 1)?) + 1) * 8;
                        next = *p.get(off)?;
                        off += len;
                    }
                    51 => {
                        let len = (usize::from(*p.get(off + 1)?) + 2) * 4;
                        next = *p.get(off)?;
                        off += len;
                    }
                    44 => {
                        first_fragment = u16_be(p, off + 2)? >> 3 == 0;
                        next = *p.get(off)?;
                        off += 8;
                    }
                    _ => break,
                }
            }
            let (sport, dport) = if first_fragment {
                l4_ports(next, p, off)
            } else {
                (None, None)
            };
            let destination = IpAddr::V6(Ipv6Addr::from(dst));
            Some(Packet {
                protocol: protocol(next),
                destination,
                sport,
                dport,
            })
        }
        _ => None,
    }
}

fn protocol(proto: u8) -> NetProtocol {
    match proto {
        6 => NetProtocol::Tcp,
        17 => NetProtocol::Udp,
        1 | 58 => NetProtocol::Icmp,
        _ => NetProtocol::Other,
    }
}

/// Source and destination ports of TCP and UDP.
fn l4_ports(proto: u8, p: &[u8], l4: usize) -> (Option<u16>, Option<u16>) {
    match proto {
        6 | 17 => (u16_be(p, l4), l4.checked_add(2).and_then(|at| u16_be(p, at))),
        _ => (None, None),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn ipv4_tcp(dst: [u8; 4], dport: u16) -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0, 172, 16, 0, 2];
        p.extend_from_slice(&dst);
        p.extend_from_slice(&40000u16.to_be_bytes());
        p.extend_from_slice(&dport.to_be_bytes());
        p.extend_from_slice(&[0; 16]);
        p
    }

    fn attr(ty: u16, data: &[u8]) -> Vec<u8> {
        let mut a = ((4 + data.len()) as u16).to_ne_bytes().to_vec();
        a.extend_from_slice(&ty.to_ne_bytes());
        a.extend_from_slice(data);
        a.resize(align4(a.len()), 0);
        a
    }

    fn packet_msg(prefix: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut body = vec![AF_INET, 0, 0, 4];
        body.extend(attr(1, &[0x08, 0x00, 1, 0]));
        body.extend(attr(NFULA_PREFIX, prefix));
        body.extend(attr(NFULA_PAYLOAD, payload));
        let mut m = ((NLMSG_HDRLEN + body.len()) as u32).to_ne_bytes().to_vec();
        m.extend_from_slice(&(NFNL_SUBSYS_ULOG << 8).to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend(body);
        m
    }

    #[test]
    fn parses_a_packet_message() {
        let mut dgram = packet_msg(b"deny:deny_rule\0", &ipv4_tcp([203, 0, 113, 7], 443));
        dgram.extend(packet_msg(
            b"allow:default_allow\0",
            &ipv4_tcp([198, 51, 100, 20], 80),
        ));
        let evs = parse_datagram(&dgram);
        assert_eq!(
            evs,
            vec![
                KernelEvent {
                    allowed: false,
                    reason: "deny_rule".into(),
                    protocol: NetProtocol::Tcp,
                    destination: "203.0.113.7".parse().unwrap(),
                    port: Some(443),
                },
                KernelEvent {
                    allowed: true,
                    reason: "default_allow".into(),
                    protocol: NetProtocol::Tcp,
                    destination: "198.51.100.20".parse().unwrap(),
                    port: Some(80),
                },
            ]
        );
    }

    #[test]
    fn foreign_prefixes_are_skipped() {
        for prefix in [
            &b"hello\0"[..],
            b"allow:\0",
            b"maybe:x\0",
            b"deny:Bad Reason\0",
            b"\xff\xfe",
        ] {
            assert!(parse_datagram(&packet_msg(prefix, &ipv4_tcp([1, 2, 3, 4], 1))).is_empty());
        }
    }

    #[test]
    fn ipv6_udp_after_an_extension_header() {
        let mut p = vec![0x60, 0, 0, 0, 0, 16, 0, 64];
        p.extend_from_slice(&[0; 16]);
        p.extend_from_slice(&Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 1).octets());
        p.extend_from_slice(&[17, 0, 0, 0, 0, 0, 0, 0]); // hop-by-hop, next = UDP
        p.extend_from_slice(&[0x12, 0x34, 0x00, 0x35, 0, 8, 0, 0]);
        assert_eq!(
            parse_ip(&p),
            Some((NetProtocol::Udp, "2001:db8::1".parse().unwrap(), Some(53)))
        );
    }

    #[test]
    fn icmp_and_fragments_have_no_port() {
        let mut p = ipv4_tcp([8, 8, 8, 8], 53);
        p[9] = 1;
        assert_eq!(parse_ip(&p).unwrap().2, None);
        let mut f = ipv4_tcp([8, 8, 8, 8], 53);
        f[7] = 8; // fragment offset 8
        assert_eq!(parse_ip(&f).unwrap().2, None);
    }

    #[test]
    fn retransmissions_are_reported_once_per_window() {
        let ev = parse_datagram(&packet_msg(b"deny:deny_rule\0", &ipv4_tcp([203, 0, 113, 7], 443))).remove(0);
        let mut r = Repeats::default();
        let t0 = Instant::now();
        assert!(!r.is_repeat(&ev, Some(40000), t0));
        assert!(r.is_repeat(&ev, Some(40000), t0 + Duration::from_secs(1)));
        assert!(r.is_repeat(&ev, Some(40000), t0 + Duration::from_secs(7)));
        // Another attempt (new source port), or the same after the window, is reported.
        assert!(!r.is_repeat(&ev, Some(40001), t0 + Duration::from_secs(7)));
        assert!(!r.is_repeat(&ev, Some(40000), t0 + REPEAT_WINDOW + Duration::from_secs(1)));
        // Memory stays bounded.
        for port in 0..(REPEAT_MEMORY as u16 + 10) {
            r.is_repeat(&ev, Some(port), t0);
        }
        assert!(r.seen.len() <= REPEAT_MEMORY);
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // Every prefix of valid messages, and pseudo-random garbage, must parse to something or nothing.
        let msg = packet_msg(b"deny:spoofed\0", &ipv4_tcp([10, 0, 0, 1], 22));
        for n in 0..msg.len() {
            let _ = parse_datagram(&msg[..n]);
            let _ = parse_ip(&msg[..n]);
        }
        let mut x: u32 = 0x1234_5678;
        for len in 0..400 {
            let bytes: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 17;
                    x ^= x << 5;
                    x as u8
                })
                .collect();
            let _ = parse_datagram(&bytes);
            let _ = parse_ip(&bytes);
            let mut framed = msg.clone();
            framed.extend_from_slice(&bytes);
            let _ = parse_datagram(&framed);
        }
    }
}
