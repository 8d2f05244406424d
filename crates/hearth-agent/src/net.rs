//! The guest's network interface, configured at boot from the kernel command line.
//!
//! The host passes `hearth.net=<address>/<prefix>,<gateway>,<resolver>` (e.g.
//! `hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1`) when the sandbox has a NIC. PID 1 then gives the first
//! Ethernet interface (`eth0` when present) that address, brings it up, adds a default route via the gateway
//! and writes `/etc/resolv.conf` (replacing a symlink, e.g. systemd-resolved's, with a plain file). Everything
//! is done with ioctls on an `AF_INET` socket: the root filesystem may have no `ip`.
//!
//! IPv6, when the host's sandbox namespace has an IPv6 path: `hearth.net6=<address>/<prefix>,<gateway>` (e.g.
//! `hearth.net6=fd68:6872:7468::2/64,fd68:6872:7468::1`) next to `hearth.net=`. The same interface then also
//! gets that address (duplicate address detection and router advertisements off, so it is usable at once and
//! nothing on the link can change it) and a default IPv6 route via the gateway, with ioctls on an `AF_INET6`
//! socket. Without it the guest has no IPv6 route (so programs fall back to IPv4 at once). It is ignored
//! without `hearth.net=`; a malformed value is logged and leaves IPv4 as it is.
//!
//! Without `hearth.net=` nothing changes. A malformed value or a failed step is logged to the console and
//! never stops the agent: a sandbox without a working network is still reachable over the agent channel.
//!
//! The settings are made once at boot: a snapshot restored into another sandbox namespace finds the same
//! addresses there (every sandbox namespace looks the same from inside), so nothing is redone after a restore.

use std::ffi::CString;
use std::fmt;
use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::time::{Duration, Instant};

/// The kernel command line key.
pub const CMDLINE_KEY: &str = "hearth.net";
/// The kernel command line key of the IPv6 part.
pub const CMDLINE_KEY6: &str = "hearth.net6";
/// How long to wait for the NIC to show up (virtio-net is loaded by the initramfs, so normally it is there).
const IFACE_WAIT: Duration = Duration::from_secs(3);
/// `ARPHRD_ETHER`: the hardware type of an Ethernet (and virtio-net) interface.
const ARPHRD_ETHER: libc::sa_family_t = 1;

/// A parsed `hearth.net=` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetConfig {
    pub address: Ipv4Addr,
    pub prefix: u8,
    pub gateway: Ipv4Addr,
    pub dns: Ipv4Addr,
}

impl NetConfig {
    /// The netmask of [`NetConfig::prefix`].
    pub fn netmask(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0))
    }
}

impl fmt::Display for NetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{} via {}, resolver {}",
            self.address, self.prefix, self.gateway, self.dns
        )
    }
}

/// A parsed `hearth.net6=` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Net6Config {
    pub address: Ipv6Addr,
    pub prefix: u8,
    pub gateway: Ipv6Addr,
}

impl fmt::Display for Net6Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{} via {}", self.address, self.prefix, self.gateway)
    }
}

/// The last value of `key=` on `line`, if any.
fn cmdline_value<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let prefix = format!("{key}=");
    line.split_whitespace()
        .filter_map(|w| w.strip_prefix(&prefix))
        .next_back()
}

/// Finds `hearth.net6=` in a kernel command line (the last one wins) and parses it. `Ok(None)`: no such key.
pub fn from_cmdline6(line: &str) -> Result<Option<Net6Config>, String> {
    cmdline_value(line, CMDLINE_KEY6).map(parse6).transpose()
}

/// Parses `<address>/<prefix>,<gateway>`: distinct unicast addresses (not loopback, not link-local) on one
/// subnet, prefix 1..=126.
pub fn parse6(value: &str) -> Result<Net6Config, String> {
    let (Some((cidr, gateway)), false) = (value.split_once(','), value.matches(',').count() > 1) else {
        return Err(format!("{value:?}: expected <address>/<prefix>,<gateway>"));
    };
    let (address, prefix) = cidr
        .split_once('/')
        .ok_or_else(|| format!("{cidr:?}: expected <address>/<prefix>"))?;
    let addr = |what: &str, s: &str| -> Result<Ipv6Addr, String> {
        let ip: Ipv6Addr = s
            .parse()
            .map_err(|_| format!("{what} {s:?} is not an IPv6 address"))?;
        if ip.is_unspecified()
            || ip.is_loopback()
            || ip.is_multicast()
            || ip.is_unicast_link_local()
            || ip.to_ipv4_mapped().is_some()
        {
            return Err(format!("{what} {ip} is not a routable unicast address"));
        }
        Ok(ip)
    };
    let address = addr("address", address)?;
    let gateway = addr("gateway", gateway)?;
    let prefix = match prefix.parse::<u8>() {
        Ok(p) if prefix.bytes().all(|b| b.is_ascii_digit()) && (1..=126).contains(&p) => p,
        _ => return Err(format!("prefix {prefix:?} is not a number from 1 to 126")),
    };
    if address == gateway {
        return Err(format!("address and gateway are both {address}"));
    }
    let mask = u128::MAX << (128 - u32::from(prefix));
    if u128::from(address) & mask != u128::from(gateway) & mask {
        return Err(format!("gateway {gateway} is not on {address}/{prefix}"));
    }
    Ok(Net6Config {
        address,
        prefix,
        gateway,
    })
}

/// Finds `hearth.net=` in a kernel command line (the last one wins, as for kernel parameters) and parses it.
/// `Ok(None)`: no such key.
pub fn from_cmdline(line: &str) -> Result<Option<NetConfig>, String> {
    match cmdline_value(line, CMDLINE_KEY) {
        None => Ok(None),
        Some(value) => parse(value).map(Some),
    }
}

/// Parses `<address>/<prefix>,<gateway>,<resolver>`. The address and gateway must be distinct unicast
/// addresses on one subnet (prefix 1..=30), the resolver a unicast address.
pub fn parse(value: &str) -> Result<NetConfig, String> {
    let mut parts = value.split(',');
    let (Some(cidr), Some(gateway), Some(dns), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(format!(
            "{value:?}: expected <address>/<prefix>,<gateway>,<resolver>"
        ));
    };
    let (address, prefix) = cidr
        .split_once('/')
        .ok_or_else(|| format!("{cidr:?}: expected <address>/<prefix>"))?;
    let addr = |what: &str, s: &str| -> Result<Ipv4Addr, String> {
        let ip: Ipv4Addr = s
            .parse()
            .map_err(|_| format!("{what} {s:?} is not an IPv4 address"))?;
        if ip.is_unspecified() || ip.is_broadcast() || ip.is_multicast() || ip.is_loopback() {
            return Err(format!("{what} {ip} is not a unicast address"));
        }
        Ok(ip)
    };
    let address = addr("address", address)?;
    let gateway = addr("gateway", gateway)?;
    let dns = addr("resolver", dns)?;
    // Digits only: `u8::from_str` would also take a leading `+`.
    let prefix = match prefix.parse::<u8>() {
        Ok(p) if prefix.bytes().all(|b| b.is_ascii_digit()) && (1..=30).contains(&p) => p,
        _ => return Err(format!("prefix {prefix:?} is not a number from 1 to 30")),
    };
    let cfg = NetConfig {
        address,
        prefix,
        gateway,
        dns,
    };
    let mask = u32::from(cfg.netmask());
    let (a, g) = (u32::from(address), u32::from(gateway));
    if a == g {
        return Err(format!("address and gateway are both {address}"));
    }
    if a & mask != g & mask {
        return Err(format!("gateway {gateway} is not on {address}/{prefix}"));
    }
    for (what, host) in [("address", a), ("gateway", g)] {
        if host & !mask == 0 || host & !mask == !mask {
            return Err(format!(
                "{what} {} is the network or broadcast address of /{prefix}",
                Ipv4Addr::from(host)
            ));
        }
    }
    Ok(cfg)
}

/// PID 1's step: reads the command line (`HEARTH_AGENT_CMDLINE` replaces it, as for [`crate::init`]) and
/// configures the network if it names one. Logs and carries on when anything fails.
pub fn setup() {
    let line = match std::env::var("HEARTH_AGENT_CMDLINE") {
        Ok(line) => line,
        Err(_) => std::fs::read_to_string("/proc/cmdline").unwrap_or_default(),
    };
    let cfg = match from_cmdline(&line) {
        Ok(Some(cfg)) => cfg,
        Ok(None) => return,
        Err(e) => {
            crate::log(&format!("network: ignoring {CMDLINE_KEY}=: {e}"));
            return;
        }
    };
    // The IPv6 part, parsed first: duplicate address detection must be off before the NIC comes up, or its
    // link-local address stays tentative for a second, and connections opened meanwhile never complete.
    let cfg6 = match from_cmdline6(&line) {
        Ok(cfg6) => cfg6,
        Err(e) => {
            crate::log(&format!("network: ignoring {CMDLINE_KEY6}=: {e}"));
            None
        }
    };
    if cfg6.is_some()
        && let Err(e) = prepare6()
    {
        crate::log(&format!("network: IPv6 options: {e}"));
    }
    let iface = match configure(&cfg, Path::new("/etc")) {
        Ok(iface) => {
            crate::log(&format!("network: {iface} {cfg}"));
            iface
        }
        Err(e) => {
            crate::log(&format!("network: {e}"));
            return;
        }
    };
    if let Some(cfg6) = cfg6 {
        match configure6(&cfg6, &iface) {
            Ok(()) => crate::log(&format!("network: {iface} {cfg6}")),
            Err(e) => crate::log(&format!("network: {e}")),
        }
    }
}

/// The IPv6 options of the guest: no duplicate address detection, no router advertisements, no
/// autoconfiguration, for every interface there is (`all`, `default` and each one present). Call before the
/// NIC is brought up ([`configure`]): an interface that comes up with detection on keeps its link-local
/// address tentative for a while, and connections opened meanwhile do not complete. Writes this thread's
/// namespace's `/proc/sys`.
pub fn prepare6() -> std::io::Result<()> {
    let mut confs = vec!["all".to_owned(), "default".to_owned()];
    confs.extend(
        interfaces()
            .into_iter()
            .map(|(_, name)| name)
            .filter(|n| n != "lo"),
    );
    for conf in confs {
        set_ipv6_options(&conf)?;
    }
    Ok(())
}

fn set_ipv6_options(conf: &str) -> std::io::Result<()> {
    for (knob, value) in [
        ("disable_ipv6", "0"),
        ("accept_dad", "0"),
        ("accept_ra", "0"),
        ("autoconf", "0"),
    ] {
        let path = format!("/proc/sys/net/ipv6/conf/{conf}/{knob}");
        std::fs::write(&path, value).map_err(|e| std::io::Error::new(e.kind(), format!("{path}: {e}")))?;
    }
    Ok(())
}

/// Gives `iface` (already up, see [`configure`]) the IPv6 address of `cfg` and a default IPv6 route via its
/// gateway, in the calling thread's network namespace. Duplicate address detection and router advertisements
/// are turned off on `iface` first (through `/proc/sys`, which must be this namespace's; call [`prepare6`]
/// before bringing the interface up as well). Running it again (an agent restarted) is no error.
pub fn configure6(cfg: &Net6Config, iface: &str) -> Result<(), NetError> {
    fn step6<T>(iface: &str, what: &'static str, r: std::io::Result<T>) -> Result<T, NetError> {
        r.map_err(|source| NetError::Ioctl {
            iface: iface.to_owned(),
            what,
            source,
        })
    }
    let step = |what, r| step6(iface, what, r);
    step("checking the interface name", ifreq(iface).map(drop))?;
    step("setting IPv6 options", set_ipv6_options(iface))?;
    let sock = step6(iface, "IPv6 socket", inet6_socket())?;
    let index = step6(iface, "looking up the index", if_index(iface))?;
    let mut req = In6Ifreq {
        ifr6_addr: in6_addr(cfg.address),
        ifr6_prefixlen: u32::from(cfg.prefix),
        ifr6_ifindex: index,
    };
    match ioctl(&sock, libc::SIOCSIFADDR, (&raw mut req).cast()) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
        other => step("setting the IPv6 address", other)?,
    }
    // Even without duplicate address detection a new address is tentative until the kernel's address work
    // has run; a connection opened before that would pick another source address.
    step(
        "waiting for the IPv6 address",
        wait_not_tentative(cfg.address, IFACE_WAIT),
    )?;
    let mut rt = In6Rtmsg {
        rtmsg_dst: in6_addr(Ipv6Addr::UNSPECIFIED),
        rtmsg_src: in6_addr(Ipv6Addr::UNSPECIFIED),
        rtmsg_gateway: in6_addr(cfg.gateway),
        rtmsg_type: 0,
        rtmsg_dst_len: 0,
        rtmsg_src_len: 0,
        rtmsg_metric: 1,
        rtmsg_info: 0,
        rtmsg_flags: u32::from(libc::RTF_UP | libc::RTF_GATEWAY),
        rtmsg_ifindex: index,
    };
    match ioctl(&sock, libc::SIOCADDRT, (&raw mut rt).cast()) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => step("adding the default IPv6 route", other),
    }
}

/// `IFA_F_TENTATIVE` of `<linux/if_addr.h>`.
const IFA_F_TENTATIVE: u32 = 0x40;

/// Waits until `address` is listed in this thread's namespace (`/proc/thread-self/net/if_inet6`) and not
/// tentative.
fn wait_not_tentative(address: Ipv6Addr, timeout: Duration) -> std::io::Result<()> {
    let hex: String = address.octets().iter().map(|b| format!("{b:02x}")).collect();
    let deadline = Instant::now() + timeout;
    loop {
        let table = std::fs::read_to_string("/proc/thread-self/net/if_inet6")?;
        let ready = table.lines().any(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            f.len() >= 6
                && f[0] == hex
                && u32::from_str_radix(f[4], 16).is_ok_and(|flags| flags & IFA_F_TENTATIVE == 0)
        });
        if ready {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(std::io::Error::other(format!(
                "{address} still tentative or missing after {timeout:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `struct in6_ifreq` of `<linux/ipv6.h>`.
#[repr(C)]
struct In6Ifreq {
    ifr6_addr: libc::in6_addr,
    ifr6_prefixlen: u32,
    ifr6_ifindex: libc::c_int,
}

/// `struct in6_rtmsg` of `<linux/ipv6_route.h>`.
#[repr(C)]
struct In6Rtmsg {
    rtmsg_dst: libc::in6_addr,
    rtmsg_src: libc::in6_addr,
    rtmsg_gateway: libc::in6_addr,
    rtmsg_type: u32,
    rtmsg_dst_len: u16,
    rtmsg_src_len: u16,
    rtmsg_metric: u32,
    rtmsg_info: libc::c_ulong,
    rtmsg_flags: u32,
    rtmsg_ifindex: libc::c_int,
}

fn in6_addr(ip: Ipv6Addr) -> libc::in6_addr {
    libc::in6_addr { s6_addr: ip.octets() }
}

fn if_index(iface: &str) -> std::io::Result<libc::c_int> {
    let name = CString::new(iface).map_err(|_| std::io::Error::other("NUL in the interface name"))?;
    // SAFETY: `name` is a NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(std::io::Error::last_os_error());
    }
    libc::c_int::try_from(index).map_err(|_| std::io::Error::other("interface index out of range"))
}

fn inet6_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_INET6, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A failed configuration step.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// No Ethernet interface appeared.
    #[error("no network interface besides lo after {0:?}")]
    NoInterface(Duration),
    /// An ioctl (or the socket for it) failed.
    #[error("{iface}: {what}: {source}")]
    Ioctl {
        iface: String,
        what: &'static str,
        source: std::io::Error,
    },
    /// Writing the resolver configuration failed.
    #[error("{iface} configured, but writing {path}: {source}")]
    Resolver {
        iface: String,
        path: String,
        source: std::io::Error,
    },
}

/// Configures the first Ethernet interface of the calling thread's network namespace (`eth0` when it
/// exists) with `cfg`, brings `lo` and it up, adds the default route, and writes `<etc>/resolv.conf`.
/// Returns the interface's name.
pub fn configure(cfg: &NetConfig, etc: &Path) -> Result<String, NetError> {
    let sock = inet_socket().map_err(|source| NetError::Ioctl {
        iface: String::new(),
        what: "socket",
        source,
    })?;
    let deadline = Instant::now() + IFACE_WAIT;
    let iface = loop {
        if let Some(name) = find_ethernet(&sock) {
            break name;
        }
        if Instant::now() >= deadline {
            return Err(NetError::NoInterface(IFACE_WAIT));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let step = |what: &'static str, r: std::io::Result<()>| {
        r.map_err(|source| NetError::Ioctl {
            iface: iface.clone(),
            what,
            source,
        })
    };
    step("bringing up lo", set_up(&sock, "lo"))?;
    step(
        "setting the address",
        set_addr(&sock, &iface, libc::SIOCSIFADDR, cfg.address),
    )?;
    step(
        "setting the netmask",
        set_addr(&sock, &iface, libc::SIOCSIFNETMASK, cfg.netmask()),
    )?;
    step("bringing it up", set_up(&sock, &iface))?;
    step(
        "adding the default route",
        add_default_route(&sock, &iface, cfg.gateway),
    )?;
    write_resolv_conf(etc, cfg.dns).map_err(|source| NetError::Resolver {
        iface: iface.clone(),
        path: etc.join("resolv.conf").display().to_string(),
        source,
    })?;
    Ok(iface)
}

/// Writes `<etc>/resolv.conf` atomically (a temporary file renamed over it, which also replaces a symlink
/// rather than writing through it).
pub fn write_resolv_conf(etc: &Path, dns: Ipv4Addr) -> std::io::Result<()> {
    std::fs::create_dir_all(etc)?;
    let tmp = etc.join(".resolv.conf.hearth");
    let _ = std::fs::remove_file(&tmp);
    let written = (|| {
        let mut f = std::fs::File::options().write(true).create_new(true).open(&tmp)?;
        f.write_all(format!("# written by hearth-agent at boot\nnameserver {dns}\n").as_bytes())?;
        f.sync_all()?;
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        std::fs::rename(&tmp, etc.join("resolv.conf"))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn inet_socket() -> std::io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the result is checked and owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An `ifreq` naming `iface` (the caller checked the name fits).
fn ifreq(iface: &str) -> std::io::Result<libc::ifreq> {
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if iface.is_empty() || iface.len() >= req.ifr_name.len() || iface.contains('\0') {
        return Err(std::io::Error::other(format!("bad interface name {iface:?}")));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(iface.bytes()) {
        *dst = src as libc::c_char;
    }
    Ok(req)
}

fn ioctl(sock: &OwnedFd, request: libc::c_ulong, arg: *mut libc::c_void) -> std::io::Result<()> {
    // SAFETY: every caller passes a pointer to a live struct of the type `request` expects.
    if unsafe { libc::ioctl(sock.as_raw_fd(), request, arg) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Interfaces of this thread's network namespace, in index order.
fn interfaces() -> Vec<(u32, String)> {
    // SAFETY: if_nameindex returns a heap array terminated by a zero entry (or null), freed below.
    let list = unsafe { libc::if_nameindex() };
    if list.is_null() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut i = 0;
    loop {
        // SAFETY: `list` is valid up to and including its zero-index terminator.
        let entry = unsafe { &*list.add(i) };
        if entry.if_index == 0 || entry.if_name.is_null() {
            break;
        }
        // SAFETY: if_name is a NUL-terminated string owned by the list.
        let name = unsafe { std::ffi::CStr::from_ptr(entry.if_name) };
        out.push((entry.if_index, name.to_string_lossy().into_owned()));
        i += 1;
    }
    // SAFETY: `list` came from if_nameindex and is freed once.
    unsafe { libc::if_freenameindex(list) };
    out.sort();
    out
}

/// `eth0` when it exists, else the first interface (by index) whose hardware type is Ethernet.
fn find_ethernet(sock: &OwnedFd) -> Option<String> {
    let ethernet: Vec<String> = interfaces()
        .into_iter()
        .map(|(_, name)| name)
        .filter(|name| name != "lo" && hw_type(sock, name) == Some(ARPHRD_ETHER))
        .collect();
    ethernet
        .iter()
        .find(|n| *n == "eth0")
        .or_else(|| ethernet.first())
        .cloned()
}

fn hw_type(sock: &OwnedFd, iface: &str) -> Option<libc::sa_family_t> {
    let mut req = ifreq(iface).ok()?;
    ioctl(sock, libc::SIOCGIFHWADDR, (&raw mut req).cast()).ok()?;
    // SAFETY: SIOCGIFHWADDR filled in the hwaddr member.
    Some(unsafe { req.ifr_ifru.ifru_hwaddr.sa_family })
}

fn sockaddr_in(ip: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) and sockaddr is plain data.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

fn set_addr(sock: &OwnedFd, iface: &str, request: libc::c_ulong, ip: Ipv4Addr) -> std::io::Result<()> {
    let mut req = ifreq(iface)?;
    req.ifr_ifru.ifru_addr = sockaddr_in(ip);
    ioctl(sock, request, (&raw mut req).cast())
}

fn set_up(sock: &OwnedFd, iface: &str) -> std::io::Result<()> {
    let mut req = ifreq(iface)?;
    ioctl(sock, libc::SIOCGIFFLAGS, (&raw mut req).cast())?;
    // SAFETY: SIOCGIFFLAGS filled in the flags member.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    ioctl(sock, libc::SIOCSIFFLAGS, (&raw mut req).cast())
}

/// `struct rtentry` of `<net/route.h>` (not in the libc crate for glibc targets).
#[repr(C)]
struct RtEntry {
    rt_pad1: libc::c_ulong,
    rt_dst: libc::sockaddr,
    rt_gateway: libc::sockaddr,
    rt_genmask: libc::sockaddr,
    rt_flags: libc::c_ushort,
    rt_pad2: libc::c_short,
    rt_pad3: libc::c_ulong,
    rt_pad4: *mut libc::c_void,
    rt_metric: libc::c_short,
    rt_dev: *mut libc::c_char,
    rt_mtu: libc::c_ulong,
    rt_window: libc::c_ulong,
    rt_irtt: libc::c_ushort,
}

/// `SIOCADDRT` of `0.0.0.0/0` via `gateway` on `iface`. A default route that is already there (the agent
/// restarted) is fine.
fn add_default_route(sock: &OwnedFd, iface: &str, gateway: Ipv4Addr) -> std::io::Result<()> {
    let dev = CString::new(iface).map_err(|_| std::io::Error::other("NUL in the interface name"))?;
    let mut rt = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        rt_gateway: sockaddr_in(gateway),
        rt_genmask: sockaddr_in(Ipv4Addr::UNSPECIFIED),
        rt_flags: libc::RTF_UP | libc::RTF_GATEWAY,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        // The kernel only reads the name.
        rt_dev: dev.as_ptr().cast_mut(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    match ioctl(sock, libc::SIOCADDRT, (&raw mut rt).cast()) {
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_hearth_value() {
        let cfg = parse("172.16.0.2/30,172.16.0.1,172.16.0.1").expect("valid");
        assert_eq!(
            cfg,
            NetConfig {
                address: Ipv4Addr::new(172, 16, 0, 2),
                prefix: 30,
                gateway: Ipv4Addr::new(172, 16, 0, 1),
                dns: Ipv4Addr::new(172, 16, 0, 1),
            }
        );
        assert_eq!(cfg.netmask(), Ipv4Addr::new(255, 255, 255, 252));
        let wide = parse("10.1.2.3/8,10.0.0.1,9.9.9.9").expect("valid");
        assert_eq!(wide.netmask(), Ipv4Addr::new(255, 0, 0, 0));
        assert_eq!(wide.dns, Ipv4Addr::new(9, 9, 9, 9));
    }

    #[test]
    fn refuses_malformed_values() {
        for bad in [
            "",
            ",,",
            "172.16.0.2/30",
            "172.16.0.2/30,172.16.0.1",
            "172.16.0.2/30,172.16.0.1,172.16.0.1,extra",
            "172.16.0.2,172.16.0.1,172.16.0.1",
            "172.16.0.2/,172.16.0.1,172.16.0.1",
            "172.16.0.2/+30,172.16.0.1,172.16.0.1",
            "172.16.0.2/31,172.16.0.1,172.16.0.1",
            "172.16.0.2/0,172.16.0.1,172.16.0.1",
            "172.16.0.2/300,172.16.0.1,172.16.0.1",
            "172.16.0.2/30,172.16.0.2,172.16.0.1",
            "172.16.0.2/30,172.16.0.5,172.16.0.1",
            "172.16.0.3/30,172.16.0.1,172.16.0.1",
            "172.16.0.2/30,172.16.0.0,172.16.0.1",
            "0.0.0.0/30,172.16.0.1,172.16.0.1",
            "172.16.0.2/30,172.16.0.1,0.0.0.0",
            "172.16.0.2/30,172.16.0.1,224.0.0.1",
            "127.0.0.2/8,127.0.0.1,127.0.0.1",
            "fd00::2/64,fd00::1,fd00::1",
            "172.16.0.2/30,172.16.0.1,dns.example",
            "172.16.0.256/30,172.16.0.1,172.16.0.1",
            " 172.16.0.2/30,172.16.0.1,172.16.0.1",
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn finds_the_key_on_the_command_line() {
        assert_eq!(from_cmdline("console=ttyS0 quiet"), Ok(None));
        assert_eq!(from_cmdline(""), Ok(None));
        // A key that merely starts the same way is another key.
        assert_eq!(from_cmdline("hearth.network=1 hearth.net_x=2"), Ok(None));
        let line = "console=ttyS0 hearth.hostname=a hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1 quiet";
        assert_eq!(
            from_cmdline(line).expect("valid").map(|c| c.gateway),
            Some(Ipv4Addr::new(172, 16, 0, 1))
        );
        // The last occurrence wins; a bad one is an error, not "no network".
        let twice = "hearth.net=10.0.0.2/24,10.0.0.1,10.0.0.1 hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1";
        assert_eq!(
            from_cmdline(twice).expect("valid").map(|c| c.address),
            Some(Ipv4Addr::new(172, 16, 0, 2))
        );
        assert!(from_cmdline("hearth.net=").is_err());
        assert!(from_cmdline("hearth.net=garbage").is_err());
    }

    #[test]
    fn parses_the_ipv6_value_and_keeps_old_command_lines() {
        let cfg = parse6("fd68:6872:7468::2/64,fd68:6872:7468::1").expect("valid");
        assert_eq!(
            cfg,
            Net6Config {
                address: "fd68:6872:7468::2".parse().expect("address"),
                prefix: 64,
                gateway: "fd68:6872:7468::1".parse().expect("gateway"),
            }
        );
        for bad in [
            "",
            "fd68::2/64",
            "fd68::2/64,fd68::1,fd68::1",
            "fd68::2,fd68::1",
            "fd68::2/0,fd68::1",
            "fd68::2/127,fd68::1",
            "fd68::2/+64,fd68::1",
            "fd68::2/64,fd68::2",
            "fd68::2/64,fd69::1",
            "fe80::2/64,fe80::1",
            "::1/64,::2",
            "::ffff:172.16.0.2/96,::ffff:172.16.0.1",
            "ff02::2/64,ff02::1",
            "172.16.0.2/30,172.16.0.1",
        ] {
            assert!(parse6(bad).is_err(), "{bad:?} was accepted");
        }
        // An old command line has no IPv6 part; `hearth.net=` alone still parses the same.
        let old = "console=ttyS0 hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1";
        assert_eq!(from_cmdline6(old), Ok(None));
        assert!(from_cmdline(old).expect("valid").is_some());
        let new = format!("{old} hearth.net6=fd68:6872:7468::2/64,fd68:6872:7468::1");
        assert_eq!(from_cmdline6(&new), Ok(Some(cfg)));
        assert_eq!(from_cmdline(&new), from_cmdline(old));
        assert!(from_cmdline6("hearth.net6=junk").is_err());
    }

    #[test]
    fn resolv_conf_replaces_a_symlink_and_leaves_its_target_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let etc = dir.path().join("etc");
        std::fs::create_dir(&etc).expect("etc");
        let target = dir.path().join("stub-resolv.conf");
        std::fs::write(&target, "nameserver 127.0.0.53\n").expect("target");
        std::os::unix::fs::symlink(&target, etc.join("resolv.conf")).expect("symlink");
        write_resolv_conf(&etc, Ipv4Addr::new(172, 16, 0, 1)).expect("write");
        let meta = std::fs::symlink_metadata(etc.join("resolv.conf")).expect("stat");
        assert!(meta.file_type().is_file());
        let text = std::fs::read_to_string(etc.join("resolv.conf")).expect("read");
        assert!(text.ends_with("\nnameserver 172.16.0.1\n"), "{text:?}");
        assert_eq!(
            std::fs::read_to_string(&target).expect("target"),
            "nameserver 127.0.0.53\n"
        );
        assert!(!etc.join(".resolv.conf.hearth").exists());
        // A dangling symlink too, and a missing /etc.
        std::fs::remove_file(etc.join("resolv.conf")).expect("rm");
        std::os::unix::fs::symlink("/nonexistent/x", etc.join("resolv.conf")).expect("dangling");
        write_resolv_conf(&etc, Ipv4Addr::new(9, 9, 9, 9)).expect("write over dangling");
        assert!(
            std::fs::read_to_string(etc.join("resolv.conf"))
                .expect("read")
                .contains("nameserver 9.9.9.9\n")
        );
        let fresh = dir.path().join("new/etc");
        write_resolv_conf(&fresh, Ipv4Addr::new(9, 9, 9, 9)).expect("write into a new dir");
        assert!(fresh.join("resolv.conf").is_file());
    }
}
