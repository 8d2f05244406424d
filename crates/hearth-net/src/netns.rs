//! Running code inside a network namespace.
//!
//! A socket belongs to the namespace of the thread that created it, for its whole life. So the daemon creates
//! listening sockets inside a sandbox's namespace (or connecting sockets inside the uplink namespace) on a
//! short-lived thread that has joined that namespace, and then uses them from its async runtime as usual.

use std::fs::File;
use std::path::Path;

use nix::sched::{CloneFlags, setns};

/// Runs `f` on a fresh thread that has joined the network namespace at `ns` (e.g. `/run/netns/hearth-…`, or
/// [`host_netns`] for the daemon's own). The caller's thread is untouched.
pub fn in_netns<F, R>(ns: &Path, f: F) -> std::io::Result<R>
where
    F: FnOnce() -> std::io::Result<R> + Send + 'static,
    R: Send + 'static,
{
    let file = File::open(ns)?;
    std::thread::Builder::new()
        .name("hearth-netns".into())
        .spawn(move || {
            setns(&file, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
            f()
        })?
        .join()
        .map_err(|_| std::io::Error::other("netns thread panicked"))?
}

/// Binds a std TCP listener inside `ns` (non-blocking, ready for `tokio::net::TcpListener::from_std`).
pub fn tcp_listener(ns: &Path, addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    in_netns(ns, move || {
        let l = std::net::TcpListener::bind(addr)?;
        l.set_nonblocking(true)?;
        Ok(l)
    })
}

/// Binds a std UDP socket inside `ns` (non-blocking).
pub fn udp_socket(ns: &Path, addr: std::net::SocketAddr) -> std::io::Result<std::net::UdpSocket> {
    in_netns(ns, move || {
        let s = std::net::UdpSocket::bind(addr)?;
        s.set_nonblocking(true)?;
        Ok(s)
    })
}

/// Creates an unconnected non-blocking TCP socket inside `ns`, for `tokio::net::TcpSocket::from_std_stream`
/// style use: connect it with [`connect_tcp`].
pub async fn connect_tcp(ns: &Path, addr: std::net::SocketAddr) -> std::io::Result<tokio::net::TcpStream> {
    let socket = in_netns(ns, move || {
        let domain = if addr.is_ipv4() {
            nix::sys::socket::AddressFamily::Inet
        } else {
            nix::sys::socket::AddressFamily::Inet6
        };
        let fd = nix::sys::socket::socket(
            domain,
            nix::sys::socket::SockType::Stream,
            nix::sys::socket::SockFlag::SOCK_NONBLOCK | nix::sys::socket::SockFlag::SOCK_CLOEXEC,
            None,
        )
        .map_err(std::io::Error::from)?;
        // An unconnected socket: the stream type only carries the fd until tokio connects it.
        Ok(std::net::TcpStream::from(fd))
    })?;
    let socket = tokio::net::TcpSocket::from_std_stream(socket);
    socket.connect(addr).await
}

/// The path of the daemon's own network namespace.
pub fn host_netns() -> &'static Path {
    // The thread-group leader's namespace: the daemon's own (never changed: only short-lived helper threads
    // join other namespaces). PID 1's may be out of reach in a container.
    Path::new("/proc/self/ns/net")
}
