//! `Mount` and `Unmount`: NFS mounts of the host's mount service, made with mount(2) and the kernel's own NFS
//! client (text options, no mount.nfs helper). The guest learns the server's address, port and export name;
//! the bucket and its credentials never come here.

use hearth_proto::{ErrorKind, MountRequest};
use nix::mount::{MntFlags, MsFlags, mount, umount2};

use crate::{AgentError, fail};

/// Mount options of every export: NFSv3 over TCP on one port (no portmapper, no lock manager), 1 MiB
/// transfers, attributes cached for at most a second (writes of other sandboxes show up that fast), and
/// `soft` so that a server that is gone for good fails calls with EIO instead of hanging them.
fn options(req: &MountRequest) -> String {
    let (addr, port) = (req.server, req.port);
    format!(
        "vers=3,proto=tcp,addr={addr},port={port},mountaddr={addr},mountport={port},mountproto=tcp,\
         nolock,noresvport,soft,timeo=600,retrans=2,actimeo=1,lookupcache=positive,rsize=1048576,wsize=1048576"
    )
}

/// Whether something is mounted exactly at `path` (from /proc/self/mountinfo).
fn is_mountpoint(path: &str) -> bool {
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|target| crate::restore::unescape_mount_path(target) == path)
}

pub(crate) async fn mount_nfs(req: MountRequest) -> Result<(), AgentError> {
    req.validate().map_err(|m| fail(ErrorKind::InvalidRequest, m))?;
    tokio::task::spawn_blocking(move || {
        if is_mountpoint(&req.path) {
            return Err(fail(
                ErrorKind::AlreadyExists,
                format!("something is mounted at {} already", req.path),
            ));
        }
        std::fs::create_dir_all(&req.path).map_err(|e| {
            let kind = match e.kind() {
                std::io::ErrorKind::AlreadyExists | std::io::ErrorKind::NotADirectory => {
                    ErrorKind::NotADirectory
                }
                std::io::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
                _ => ErrorKind::Other,
            };
            fail(kind, format!("making {}: {e}", req.path))
        })?;
        let source = format!("{}:{}", req.server, req.export);
        let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
        if req.read_only {
            flags |= MsFlags::MS_RDONLY;
        }
        mount(
            Some(source.as_str()),
            req.path.as_str(),
            Some("nfs"),
            flags,
            Some(options(&req).as_str()),
        )
        .map_err(|e| fail(ErrorKind::Other, format!("mount {} on {}: {e}", source, req.path)))
    })
    .await
    .map_err(|e| fail(ErrorKind::Other, format!("mount task: {e}")))?
}

pub(crate) async fn unmount(path: String) -> Result<(), AgentError> {
    if !hearth_proto::msg::valid_guest_path(&path) || path == "/" {
        return Err(fail(
            ErrorKind::InvalidPath,
            "mount path must be absolute and normalised",
        ));
    }
    tokio::task::spawn_blocking(move || {
        if !is_mountpoint(&path) {
            return Err(fail(ErrorKind::NotFound, format!("nothing is mounted at {path}")));
        }
        // Written data goes to the server first (a lazy unmount would drop what is still dirty).
        if let Ok(f) = std::fs::File::open(&path) {
            let _ = nix::unistd::syncfs(&f);
        }
        match umount2(path.as_str(), MntFlags::empty()) {
            Ok(()) => Ok(()),
            Err(nix::errno::Errno::EBUSY) => umount2(path.as_str(), MntFlags::MNT_DETACH)
                .map_err(|e| fail(ErrorKind::Other, format!("unmount {path}: {e}"))),
            Err(e) => Err(fail(ErrorKind::Other, format!("unmount {path}: {e}"))),
        }
    })
    .await
    .map_err(|e| fail(ErrorKind::Other, format!("unmount task: {e}")))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_and_mountinfo_escapes() {
        let req = MountRequest {
            path: "/mnt/data".into(),
            server: std::net::Ipv4Addr::new(172, 16, 0, 1),
            port: 2049,
            export: "/0123456789abcdef".into(),
            read_only: true,
        };
        let o = options(&req);
        assert!(
            o.contains("addr=172.16.0.1") && o.contains("port=2049,") && o.contains("nolock"),
            "{o}"
        );
    }
}
