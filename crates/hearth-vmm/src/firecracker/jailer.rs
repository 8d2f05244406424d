//! Running Firecracker under its jailer (SECURITY.md promise 1): a chroot holding only what the VM needs, its
//! own uid/gid (one per sandbox with [`JailerConfig::per_sandbox_ids`]), a new mount namespace (pivot_root), a
//! new PID namespace ([`JailerConfig::new_pid_ns`]), cgroup limits from the VM's shape ([`super::cgroups`]),
//! the VM's network namespace, and Firecracker's default seccomp filters (never disabled here).
//! [`JailerConfig::for_daemon`] is what hearthd runs with.
//!
//! The jail lives inside the sandbox's run directory, `<run>/jail/<exec name>/<instance id>/root`, so removing
//! the run directory removes it. Before the jailer runs, the driver puts into the chroot:
//! - the kernel and initramfs, hard-linked (or copied when on another filesystem or not world-readable);
//! - the sandbox disk, hard-linked (it must be the same inode so the guest writes the sandbox's own disk) and
//!   handed to the jail's uid/gid;
//! - a `run/` directory owned by the jail's uid for the API and vsock sockets.
//!
//! The chroot belongs to the jailed uid, so the driver never follows a path into it blindly: sockets are
//! opened without symlinks ([`Jail::socket`]), snapshot files are taken out by descriptor after checking them.

use std::ffi::OsString;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::sock::SocketAddr;

/// Which cgroup hierarchy the jailer writes `cgroups` settings to.
pub use crate::cgroup::CgroupVersion;

/// How to jail each Firecracker process.
#[derive(Debug, Clone)]
pub struct JailerConfig {
    /// The jailer binary (same version as Firecracker).
    pub jailer: PathBuf,
    /// Unprivileged uid/gid Firecracker runs as. Give each tenant its own for full separation.
    pub uid: u32,
    pub gid: u32,
    pub cgroup_version: CgroupVersion,
    /// Parent cgroup of the VM's cgroup (relative to the hierarchy root); the jailer's default when `None`.
    pub parent_cgroup: Option<String>,
    /// `file=value` settings for the VM's cgroup, e.g. `cpu.weight=100` (v2) or `cpu.shares=512` (v1).
    pub cgroups: Vec<String>,
    /// Network namespace (e.g. `/run/netns/<name>`) Firecracker joins, where the VM's tap lives.
    pub netns: Option<PathBuf>,
    /// Each sandbox's Firecracker runs as a uid/gid of its own ([`crate::qemu::vm_uid`] of the sandbox id, the
    /// same range as QEMU's), so one compromised VMM cannot signal or read another; `uid`/`gid` are unused.
    pub per_sandbox_ids: bool,
    /// Limit each VM's cgroup to its shape: CPU time of its vCPUs, its memory plus the VMM's overhead, a few
    /// tasks ([`super::cgroups::shape_settings`]).
    pub shape_limits: bool,
    /// `--new-pid-ns`: Firecracker is PID 1 of a namespace of its own (it sees no other process). The
    /// jailer then exits and leaves Firecracker's pid in the chroot (see [`Jail::read_pid_file`]).
    pub new_pid_ns: bool,
}

impl JailerConfig {
    /// Jailer at the default install path, cgroup v2, no cgroup settings.
    pub fn new(uid: u32, gid: u32) -> Self {
        Self {
            jailer: PathBuf::from(super::DEFAULT_JAILER),
            uid,
            gid,
            cgroup_version: CgroupVersion::V2,
            parent_cgroup: None,
            cgroups: Vec::new(),
            netns: None,
            per_sandbox_ids: false,
            shape_limits: false,
            new_pid_ns: false,
        }
    }

    /// What the daemon jails every VM with: the jailer at `jailer`, a uid/gid per sandbox, the VM's shape as
    /// cgroup limits below `parent_cgroup` on this host's hierarchy, a new PID namespace.
    pub fn for_daemon(jailer: PathBuf, parent_cgroup: String) -> Self {
        Self {
            jailer,
            uid: crate::qemu::VM_UID_BASE,
            gid: crate::qemu::VM_UID_BASE,
            cgroup_version: CgroupVersion::detect(),
            parent_cgroup: Some(parent_cgroup),
            cgroups: Vec::new(),
            netns: None,
            per_sandbox_ids: true,
            shape_limits: true,
            new_pid_ns: true,
        }
    }

    /// The uid and gid the VM of sandbox `id` runs as.
    pub fn ids_for(&self, id: &str) -> (u32, u32) {
        if self.per_sandbox_ids {
            let uid = crate::qemu::vm_uid(id);
            (uid, uid)
        } else {
            (self.uid, self.gid)
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// The disk cannot be hard-linked into the jail (another filesystem).
    #[error("disk {disk} must be on the same filesystem as the jail {jail}: {source}")]
    DiskLink {
        disk: PathBuf,
        jail: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid cgroup setting {0:?} (expected file=value)")]
    BadCgroup(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> JailError + '_ {
    move |source| JailError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Paths of one VM's jail.
#[derive(Debug, Clone)]
pub struct Jail {
    /// `--chroot-base-dir`.
    pub base: PathBuf,
    /// The chroot: `<base>/<exec name>/<instance id>/root`.
    pub root: PathBuf,
}

/// File names inside the chroot (as Firecracker sees them).
pub const KERNEL: &str = "/vmlinux";
pub const INITRAMFS: &str = "/initramfs.cpio.gz";
pub const DISK: &str = "/disk.ext4";
pub const API_SOCKET: &str = "/run/fc.sock";
pub const VSOCK_SOCKET: &str = "/run/vsock.sock";

impl Jail {
    pub fn new(run_dir: &Path, firecracker: &Path, instance_id: &str) -> Self {
        let base = run_dir.join("jail");
        let exec_name = firecracker
            .file_name()
            .map(OsString::from)
            .unwrap_or_else(|| OsString::from("firecracker"));
        let root = base.join(exec_name).join(instance_id).join("root");
        Self { base, root }
    }

    /// Host path of a path inside the chroot.
    pub fn host_path(&self, inner: &str) -> PathBuf {
        self.root.join(inner.trim_start_matches('/'))
    }

    /// Builds the chroot contents before the jailer runs (see the module doc).
    pub fn populate(
        &self,
        ids: (u32, u32),
        kernel: &Path,
        initramfs: &Path,
        disk: &Path,
    ) -> Result<(), JailError> {
        // A leftover jail from an earlier attempt would hold stale sockets and links.
        if self.base.exists() {
            std::fs::remove_dir_all(&self.base).map_err(io_err(&self.base))?;
        }
        let run = self.host_path("/run");
        std::fs::create_dir_all(&run).map_err(io_err(&run))?;
        chown(&run, ids)?;
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).map_err(io_err(&run))?;

        link_readable(kernel, &self.host_path(KERNEL))?;
        link_readable(initramfs, &self.host_path(INITRAMFS))?;

        let jailed_disk = self.host_path(DISK);
        std::fs::hard_link(disk, &jailed_disk).map_err(|source| JailError::DiskLink {
            disk: disk.to_path_buf(),
            jail: self.root.clone(),
            source,
        })?;
        chown(&jailed_disk, ids)?;
        std::fs::set_permissions(&jailed_disk, std::fs::Permissions::from_mode(0o600))
            .map_err(io_err(&jailed_disk))?;
        Ok(())
    }

    /// Jailer arguments; `firecracker_args` go after `--` to Firecracker. `netns` (the VM's own namespace,
    /// from [`crate::NetAttach`]) takes precedence over [`JailerConfig::netns`]; `limits` are cgroup settings
    /// of this VM added to the configured ones.
    pub fn args(
        &self,
        cfg: &JailerConfig,
        launch: &JailLaunch<'_>,
        firecracker_args: &[&str],
    ) -> Result<Vec<OsString>, JailError> {
        let JailLaunch {
            firecracker,
            instance_id,
            ids: (uid, gid),
            netns,
            limits,
        } = *launch;
        let mut args: Vec<OsString> = vec![
            "--id".into(),
            instance_id.into(),
            "--exec-file".into(),
            firecracker.into(),
            "--uid".into(),
            uid.to_string().into(),
            "--gid".into(),
            gid.to_string().into(),
            "--chroot-base-dir".into(),
            self.base.clone().into(),
            "--cgroup-version".into(),
            match cfg.cgroup_version {
                CgroupVersion::V1 => "1",
                CgroupVersion::V2 => "2",
            }
            .into(),
        ];
        if let Some(parent) = &cfg.parent_cgroup {
            args.extend(["--parent-cgroup".into(), parent.into()]);
        }
        if let Some(netns) = netns.or(cfg.netns.as_deref()) {
            args.extend(["--netns".into(), netns.into()]);
        }
        if cfg.new_pid_ns {
            args.push("--new-pid-ns".into());
        }
        for setting in cfg.cgroups.iter().chain(limits) {
            let valid = setting.split_once('=').is_some_and(|(file, value)| {
                !file.is_empty()
                    && !value.is_empty()
                    && file
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_')
            });
            if !valid {
                return Err(JailError::BadCgroup(setting.clone()));
            }
            args.extend(["--cgroup".into(), setting.into()]);
        }
        args.push("--".into());
        args.extend(firecracker_args.iter().map(OsString::from));
        Ok(args)
    }

    /// Address of a socket Firecracker made inside the jail (`inner` as Firecracker sees it), reached
    /// without following symlinks (see [`SocketAddr::Beneath`]).
    pub fn socket(&self, run_dir: &Path, inner: &str) -> SocketAddr {
        let rel = self.host_path(inner);
        let rel = rel.strip_prefix(run_dir).map(Path::to_path_buf).unwrap_or(rel);
        SocketAddr::Beneath {
            dir: run_dir.to_path_buf(),
            rel,
        }
    }

    /// Host path of the pid file the jailer writes with `--new-pid-ns` (`/<exec name>.pid` in the chroot).
    pub fn pid_file_name(firecracker: &Path) -> String {
        let exec_name = firecracker
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "firecracker".into());
        format!("{exec_name}.pid")
    }

    /// Reads the pid the jailer wrote into the chroot with `--new-pid-ns`, or `None` while it is not there
    /// (or not complete). The chroot belongs to the jailed uid, so the file is opened without following
    /// symlinks and must be a regular file owned by root (the jailer writes it before dropping privileges).
    pub fn read_pid_file(&self, firecracker: &Path) -> Option<u32> {
        use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
        use std::io::Read;
        let dirfd = std::fs::File::open(&self.root).ok()?;
        let how = OpenHow::new()
            .flags(OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_SYMLINKS);
        let mut file =
            std::fs::File::from(openat2(&dirfd, Self::pid_file_name(firecracker).as_str(), how).ok()?);
        let meta = file.metadata().ok()?;
        if !meta.is_file() || meta.uid() != 0 || meta.len() > 32 {
            return None;
        }
        let mut text = String::new();
        file.read_to_string(&mut text).ok()?;
        text.trim().parse().ok().filter(|pid| *pid > 1)
    }
}

/// What one jailed launch needs beyond the [`JailerConfig`].
#[derive(Debug, Clone, Copy)]
pub struct JailLaunch<'a> {
    pub firecracker: &'a Path,
    pub instance_id: &'a str,
    /// uid and gid ([`JailerConfig::ids_for`]).
    pub ids: (u32, u32),
    /// The VM's own network namespace.
    pub netns: Option<&'a Path>,
    /// The VM's cgroup limits ([`super::cgroups::shape_settings`]), empty without.
    pub limits: &'a [String],
}

fn chown(path: &Path, (uid, gid): (u32, u32)) -> Result<(), JailError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io_err(path))
}

/// Puts a read-only boot file into the jail: a hard link when the file is world-readable and on the same
/// filesystem, otherwise a world-readable copy (the shared image itself is never chowned or chmodded).
pub fn link_readable(src: &Path, dest: &Path) -> Result<(), JailError> {
    let meta = std::fs::metadata(src).map_err(io_err(src))?;
    if meta.mode() & 0o004 != 0 && std::fs::hard_link(src, dest).is_ok() {
        return Ok(());
    }
    std::fs::copy(src, dest).map_err(io_err(dest))?;
    std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o444)).map_err(io_err(dest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_carry_ids_and_validated_cgroups() {
        let jail = Jail::new(Path::new("/r"), Path::new("/opt/fc/firecracker"), "sbx-1");
        assert_eq!(jail.root, Path::new("/r/jail/firecracker/sbx-1/root"));
        assert_eq!(
            jail.host_path(API_SOCKET),
            Path::new("/r/jail/firecracker/sbx-1/root/run/fc.sock")
        );
        let mut cfg = JailerConfig::new(1000, 1001);
        cfg.cgroups = vec!["cpu.weight=100".into()];
        let fc = Path::new("/opt/fc/firecracker");
        let fixed = cfg.ids_for("sbx_1");
        let launch = |netns: Option<&'static Path>, limits: &'static [String]| JailLaunch {
            firecracker: fc,
            instance_id: "sbx-1",
            ids: fixed,
            netns,
            limits,
        };
        let joined = |cfg: &JailerConfig, l: JailLaunch<'_>| {
            jail.args(cfg, &l, &["--api-sock", API_SOCKET])
                .expect("valid")
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        };
        let plain = joined(&cfg, launch(None, &[]));
        assert!(plain.contains("--uid 1000 --gid 1001"));
        assert!(plain.contains("--chroot-base-dir /r/jail"));
        assert!(plain.contains("--cgroup cpu.weight=100"));
        assert!(plain.ends_with("-- --api-sock /run/fc.sock"));
        assert!(!plain.contains("--netns") && !plain.contains("--new-pid-ns"));
        // The VM's own namespace wins over the configured one.
        cfg.netns = Some("/run/netns/shared".into());
        assert!(joined(&cfg, launch(None, &[])).contains("--netns /run/netns/shared --"));
        assert!(
            joined(&cfg, launch(Some(Path::new("/run/netns/hearth-x")), &[]))
                .contains("--netns /run/netns/hearth-x --")
        );
        // The daemon's configuration: a uid per sandbox, a new PID namespace, the shape's limits.
        let daemon = JailerConfig::for_daemon("/j".into(), "hearth-fc-1".into());
        let limits = super::super::cgroups::shape_settings(daemon.cgroup_version, 2, 256);
        let ids = daemon.ids_for("sbx_1");
        assert_eq!(ids, (crate::qemu::vm_uid("sbx_1"), crate::qemu::vm_uid("sbx_1")));
        assert_ne!(daemon.ids_for("sbx_2"), ids);
        let l = JailLaunch {
            ids,
            limits: &limits,
            ..launch(None, &[])
        };
        let d = joined(&daemon, l);
        assert!(d.contains(&format!("--uid {} --gid {}", ids.0, ids.1)), "{d}");
        assert!(d.contains("--parent-cgroup hearth-fc-1"), "{d}");
        assert!(d.contains("--new-pid-ns --cgroup "), "{d}");
        assert!(d.contains(&format!("--cgroup {}", limits[0])), "{d}");
        for bad in ["cpu.weight", "=1", "../x=1", "cpu.weight="] {
            cfg.cgroups = vec![bad.into()];
            assert!(jail.args(&cfg, &launch(None, &[]), &[]).is_err(), "{bad}");
        }
    }

    #[test]
    fn unreadable_boot_files_are_copied_not_changed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let src = dir.path().join("vmlinux");
        std::fs::write(&src, b"\x7fELF").expect("write");
        std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let dest = dir.path().join("copy");
        link_readable(&src, &dest).expect("copy");
        let (s, d) = (
            std::fs::metadata(&src).expect("src"),
            std::fs::metadata(&dest).expect("dest"),
        );
        assert_ne!(s.ino(), d.ino());
        assert_eq!(s.mode() & 0o777, 0o600);
        assert_eq!(d.mode() & 0o777, 0o444);

        std::fs::set_permissions(&src, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let linked = dir.path().join("link");
        link_readable(&src, &linked).expect("link");
        assert_eq!(std::fs::metadata(&linked).expect("link").ino(), s.ino());
    }
}
