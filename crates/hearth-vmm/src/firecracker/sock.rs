//! Where the driver connects: a Unix socket path, or a socket inside a jail reached without following any
//! symlink.
//!
//! Everything under a jail's chroot belongs to the jailed uid, so a compromised Firecracker could replace its
//! `run/vsock.sock` with a symlink to a host socket (the daemon's, another VM's). Connecting by path would
//! follow it in the host's namespace. [`SocketAddr::Beneath`] therefore opens the socket inode with
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` from the (root-owned) run directory, checks that it is a
//! socket, and connects through `/proc/self/fd/<n>`, which names exactly that inode.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;

use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use tokio::net::UnixStream;

/// A socket the driver connects to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SocketAddr {
    /// A plain path (sockets Firecracker creates directly in the run directory).
    Path(PathBuf),
    /// `rel` below the trusted directory `dir`, resolved without symlinks and without leaving `dir`.
    Beneath { dir: PathBuf, rel: PathBuf },
}

impl SocketAddr {
    /// For messages.
    pub fn display(&self) -> String {
        match self {
            SocketAddr::Path(p) => p.display().to_string(),
            SocketAddr::Beneath { dir, rel } => dir.join(rel).display().to_string(),
        }
    }

    pub async fn connect(&self) -> std::io::Result<UnixStream> {
        match self {
            SocketAddr::Path(p) => UnixStream::connect(p).await,
            SocketAddr::Beneath { dir, rel } => {
                let fd = open_socket_beneath(dir, rel)?;
                let magic = format!("/proc/self/fd/{}", fd.as_raw_fd());
                let stream = UnixStream::connect(&magic).await;
                drop(fd);
                stream
            }
        }
    }

    /// Blocking probe: does something accept connections there?
    pub fn accepts(&self) -> bool {
        match self {
            SocketAddr::Path(p) => std::os::unix::net::UnixStream::connect(p).is_ok(),
            SocketAddr::Beneath { dir, rel } => open_socket_beneath(dir, rel).is_ok_and(|fd| {
                std::os::unix::net::UnixStream::connect(format!("/proc/self/fd/{}", fd.as_raw_fd())).is_ok()
            }),
        }
    }
}

/// An `O_PATH` descriptor of the socket at `dir/rel`, refusing symlinks anywhere below `dir`.
fn open_socket_beneath(dir: &std::path::Path, rel: &std::path::Path) -> std::io::Result<OwnedFd> {
    let dirfd = std::fs::File::open(dir)?;
    let how = OpenHow::new()
        .flags(OFlag::O_PATH | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
    let fd = openat2(&dirfd, rel, how).map_err(std::io::Error::from)?;
    let file = std::fs::File::from(fd);
    if !file.metadata()?.file_type().is_socket() {
        return Err(std::io::Error::other(format!(
            "{} is not a socket",
            dir.join(rel).display()
        )));
    }
    Ok(OwnedFd::from(file))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[tokio::test]
    async fn beneath_connects_to_real_sockets_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let inner = dir.path().join("jail/run");
        std::fs::create_dir_all(&inner).expect("dirs");
        let _listener = UnixListener::bind(inner.join("vsock.sock")).expect("bind");
        let addr = SocketAddr::Beneath {
            dir: dir.path().to_path_buf(),
            rel: "jail/run/vsock.sock".into(),
        };
        addr.connect().await.expect("a real socket connects");
        assert!(addr.accepts());

        // A socket elsewhere ("the host's"), reached by a planted symlink: refused.
        let outside = tempfile::tempdir().expect("outside");
        let _host = UnixListener::bind(outside.path().join("host.sock")).expect("bind host");
        std::os::unix::fs::symlink(outside.path().join("host.sock"), inner.join("evil.sock")).expect("link");
        let evil = SocketAddr::Beneath {
            dir: dir.path().to_path_buf(),
            rel: "jail/run/evil.sock".into(),
        };
        assert!(evil.connect().await.is_err());
        assert!(!evil.accepts());
        // The same through a symlinked directory.
        std::os::unix::fs::symlink(outside.path(), dir.path().join("jail/dirlink")).expect("dir link");
        let via_dir = SocketAddr::Beneath {
            dir: dir.path().to_path_buf(),
            rel: "jail/dirlink/host.sock".into(),
        };
        assert!(via_dir.connect().await.is_err());
        // Escaping with "..": refused.
        let up = SocketAddr::Beneath {
            dir: inner.clone(),
            rel: "../../../host.sock".into(),
        };
        assert!(up.connect().await.is_err());
        // A regular file is not a socket.
        std::fs::write(inner.join("file"), b"x").expect("file");
        let file = SocketAddr::Beneath {
            dir: dir.path().to_path_buf(),
            rel: "jail/run/file".into(),
        };
        assert!(file.connect().await.is_err());
    }
}
