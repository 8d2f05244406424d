//! Transports of the agent channel in the guest: a virtio-serial port or a vsock listener.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::{Agent, log};

/// Name of the virtio-serial port the host exposes.
pub const PORT_NAME: &str = "hearth.agent";
/// Default vsock port.
pub const DEFAULT_VSOCK_PORT: u32 = 1024;

/// A non-blocking file descriptor (character device or socket) as a tokio byte stream. Clones share the
/// descriptor, which is closed when the last clone is dropped.
#[derive(Clone)]
pub struct FdStream {
    fd: Arc<AsyncFd<OwnedFd>>,
}

impl FdStream {
    /// Wrap `fd`, switching it to non-blocking mode.
    pub fn new(fd: OwnedFd) -> io::Result<Self> {
        set_nonblocking(&fd)?;
        Ok(FdStream {
            fd: Arc::new(register(fd)?),
        })
    }

    /// A stream over a duplicate of `fd` (same open port, so nothing buffered is lost), registered with the
    /// reactor anew: a fresh readiness state, without the sticky hang-up of an earlier session.
    pub fn over_dup(fd: &OwnedFd) -> io::Result<Self> {
        Self::new(fd.try_clone()?)
    }
}

/// Register an owned descriptor with the reactor.
fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: an OwnedFd is a valid open descriptor, owned by the AsyncFd until it is dropped, and its
    // `as_raw_fd` always returns that same descriptor.
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

fn set_nonblocking(fd: &OwnedFd) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own, with integer arguments only.
    let flags = unsafe { libc::fcntl(raw, libc::F_GETFL) };
    // SAFETY: as above.
    if flags < 0 || unsafe { libc::fcntl(raw, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl AsyncRead for FdStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        loop {
            let mut guard = ready!(self.fd.poll_read_ready(cx))?;
            // tokio never clears a "read closed" readiness (a virtio port that saw its host go away reports
            // HUP once): from then on every poll is ready, and retrying a read that would block would spin
            // forever. End the stream instead; the next session registers the port afresh.
            let closed = guard.ready().is_read_closed();
            // SAFETY: read(2) only writes initialised bytes into the unfilled part, within its length; exactly
            // the bytes it reports are marked initialised below. (No zeroing first: buffers are 64 KiB+.)
            let unfilled = unsafe { buf.unfilled_mut() };
            let res = guard.try_io(|fd| {
                // SAFETY: as above.
                let n = unsafe { libc::read(fd.as_raw_fd(), unfilled.as_mut_ptr().cast(), unfilled.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(Ok(n)) => {
                    // SAFETY: read(2) initialised the first `n` bytes of the unfilled part.
                    unsafe { buf.assume_init(n) };
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                // A hung-up virtio port reports EIO/ENOTCONN on some kernels: the same as end of stream.
                Ok(Err(e)) if matches!(e.raw_os_error(), Some(libc::EIO | libc::ENOTCONN)) => {
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) if closed => return Poll::Ready(Ok(())),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for FdStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        loop {
            let mut guard = ready!(self.fd.poll_write_ready(cx))?;
            // As for reads: a sticky "write closed" must not turn a would-block into a busy loop.
            let closed = guard.ready().is_write_closed();
            let res = guard.try_io(|fd| {
                // SAFETY: writing from a valid slice, within its length.
                let n = unsafe { libc::write(fd.as_raw_fd(), data.as_ptr().cast(), data.len()) };
                if n < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    Ok(n as usize)
                }
            });
            match res {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) if closed => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "the host side hung up",
                    )));
                }
                Err(_would_block) => continue,
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// The `/dev/vportNpM` device of the virtio-serial port called `name`, found through sysfs (no udev).
pub fn find_virtio_port(name: &str) -> Option<PathBuf> {
    let dir = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for ent in dir.flatten() {
        let port_name = std::fs::read_to_string(ent.path().join("name")).unwrap_or_default();
        if port_name.trim() == name {
            return Some(Path::new("/dev").join(ent.file_name()));
        }
    }
    None
}

fn open_rdwr(path: &Path) -> io::Result<OwnedFd> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    Ok(OwnedFd::from(f))
}

/// Serve the serial port forever: one session per host connection; processes survive between sessions.
///
/// The port stays open across sessions: closing a virtio port discards the data it has buffered, which
/// could be the next host's `Hello`. While no host is connected the port reads as end-of-file, so the loop
/// polls every 100 ms.
pub async fn serve_serial(agent: &Agent, path: &Path) -> ! {
    let mut last_error = String::new();
    let mut note = |msg: String| {
        if msg != last_error {
            log(&msg);
            last_error = msg;
        }
    };
    loop {
        // Held open for as long as it works; each session reads a duplicate registered afresh.
        let port = match open_rdwr(path) {
            Ok(p) => p,
            Err(e) => {
                note(format!("opening {}: {e}", path.display()));
                tokio::time::sleep(Duration::from_millis(500)).await;
                continue;
            }
        };
        loop {
            let session = match FdStream::over_dup(&port) {
                Ok(s) => agent.serve(s).await,
                Err(e) => Err(e),
            };
            if let Err(e) = session {
                note(format!("serial session on {}: {e}", path.display()));
                // An I/O error (unlike end-of-file) may mean the descriptor is broken: reopen it.
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Listen on vsock `port` (any CID) and serve each connection concurrently.
pub async fn serve_vsock(agent: &Agent, port: u32) -> io::Result<()> {
    let listener = vsock_listen(port)?;
    log(&format!("listening on vsock port {port}"));
    loop {
        let conn = {
            let mut guard = listener.readable().await?;
            match guard.try_io(|l| {
                // SAFETY: accept4 with null address pointers is allowed; the new fd is owned below.
                let fd = unsafe {
                    libc::accept4(
                        l.as_raw_fd(),
                        std::ptr::null_mut(),
                        std::ptr::null_mut(),
                        libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                    )
                };
                if fd < 0 {
                    Err(io::Error::last_os_error())
                } else {
                    // SAFETY: accept4 returned a fresh descriptor that nothing else owns.
                    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
                }
            }) {
                Ok(Ok(fd)) => fd,
                Ok(Err(e)) => {
                    log(&format!("vsock accept: {e}"));
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Err(_would_block) => continue,
            }
        };
        let agent = agent.clone();
        tokio::spawn(async move {
            match FdStream::new(conn) {
                Ok(s) => {
                    if let Err(e) = agent.serve(s).await {
                        log(&format!("vsock session: {e}"));
                    }
                }
                Err(e) => log(&format!("vsock connection: {e}")),
            }
        });
    }
}

fn vsock_listen(port: u32) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: plain socket(2) call.
    let fd = unsafe {
        libc::socket(
            libc::AF_VSOCK,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_vm is plain data; zeroed is valid before the fields are set.
    let mut addr: libc::sockaddr_vm = unsafe { std::mem::zeroed() };
    addr.svm_family = libc::AF_VSOCK as libc::sa_family_t;
    addr.svm_cid = libc::VMADDR_CID_ANY;
    addr.svm_port = port;
    let len = std::mem::size_of::<libc::sockaddr_vm>() as libc::socklen_t;
    // SAFETY: `addr` is a valid sockaddr_vm of `len` bytes.
    if unsafe { libc::bind(sock.as_raw_fd(), (&addr as *const libc::sockaddr_vm).cast(), len) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: listen on a bound socket we own.
    if unsafe { libc::listen(sock.as_raw_fd(), 16) } < 0 {
        return Err(io::Error::last_os_error());
    }
    register(sock)
}
