//! Snapshot support in the guest: `Sync` before the host pauses or checkpoints the VM, `PostRestore` right
//! after a resume or fork (wall clock, kernel RNG, hostname, machine-id).
//!
//! Why `PostRestore` matters: a restored guest's clock still says "moment of the snapshot", and every VM
//! restored from one snapshot starts with the same CRNG state, so without a reseed they hand out the same
//! "random" bytes (keys, UUIDs, TLS nonces). The host's entropy is added to the input pool and credited
//! (`RNDADDENTROPY`), then `RNDRESEEDCRNG` makes the CRNG take a new key from the pool at once (otherwise the
//! kernel would only reseed on its own schedule, up to a minute later on 6.1).
//!
//! Measured on the 6.1 cloud kernel under QEMU microvm (no vmgenid device, so the kernel is not told about
//! the fork): two VMs restored from a checkpoint taken at 130 s of uptime read the *same* 32 bytes from
//! `/dev/urandom` before `PostRestore`. A checkpoint taken in the first two minutes after boot happens to
//! differ anyway, because 6.1 reseeds at shorter intervals early on (half the uptime) and the first read
//! after the restore triggers a reseed that mixes in per-fork interrupt timings and RDSEED. After
//! `PostRestore` they always differ (`tests/vm.rs`).

use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use hearth_proto::{ErrorKind, PostRestore, PostRestoreReport};

use crate::{AgentError, fail};

/// `_IOW('R', 0x03, int[2])`: add bytes to the input pool and credit `entropy_count` bits.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `_IO('R', 0x07)`: reseed the CRNG from the input pool now (Linux >= 4.17, needs CAP_SYS_ADMIN).
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// What `PostRestore` may touch. The default is the real system; tests on a host use a scratch root and leave
/// the host's clock and hostname alone.
#[derive(Debug, Clone)]
pub struct SystemConfig {
    /// Directory holding `etc/hostname` and `etc/machine-id` (`/` in the guest).
    pub root: PathBuf,
    /// Call `clock_settime(CLOCK_REALTIME)`.
    pub set_clock: bool,
    /// Call `sethostname`.
    pub set_hostname: bool,
}

impl Default for SystemConfig {
    fn default() -> Self {
        SystemConfig {
            root: PathBuf::from("/"),
            set_clock: true,
            set_hostname: true,
        }
    }
}

fn os_err(what: &str, e: std::io::Error) -> AgentError {
    let kind = crate::files::errno_kind(&e);
    fail(kind, format!("{what}: {e}"))
}

/// `sync(2)`, then `syncfs` on every mounted file system (so an error on one of them is reported).
pub async fn sync_all() -> Result<(), AgentError> {
    tokio::task::spawn_blocking(sync_blocking)
        .await
        .map_err(|e| fail(ErrorKind::Other, format!("sync task: {e}")))?
}

fn sync_blocking() -> Result<(), AgentError> {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    for line in mounts.lines() {
        let mut fields = line.split(' ');
        let (Some(_dev), Some(dir), Some(fstype)) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if PSEUDO_FS.contains(&fstype) {
            continue;
        }
        let dir = unescape_mount_path(dir);
        // A mount point we cannot open (hidden under another mount, or gone) has nothing sync(2) missed.
        let Ok(f) = File::open(&dir) else { continue };
        // SAFETY: the descriptor is open for the duration of the call.
        if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
            return Err(os_err(&format!("syncfs {dir}"), std::io::Error::last_os_error()));
        }
    }
    Ok(())
}

/// File systems without backing storage: nothing to flush.
const PSEUDO_FS: &[&str] = &[
    "proc",
    "sysfs",
    "devtmpfs",
    "devpts",
    "tmpfs",
    "cgroup",
    "cgroup2",
    "mqueue",
    "debugfs",
    "tracefs",
    "securityfs",
    "pstore",
    "bpf",
    "configfs",
    "fusectl",
    "hugetlbfs",
    "autofs",
    "binfmt_misc",
    "ramfs",
    "nsfs",
    "efivarfs",
];

/// `/proc/mounts` writes space, tab, newline and backslash as `\ooo` octal escapes.
pub(crate) fn unescape_mount_path(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && b.get(i + 1..i + 4)
                .is_some_and(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
        {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Validate everything, then apply it in order: clock, RNG, hostname, machine-id.
pub async fn post_restore(sys: &SystemConfig, req: PostRestore) -> Result<PostRestoreReport, AgentError> {
    req.validate().map_err(|m| fail(ErrorKind::InvalidRequest, m))?;
    let sys = sys.clone();
    tokio::task::spawn_blocking(move || apply(&sys, &req))
        .await
        .map_err(|e| fail(ErrorKind::Other, format!("post-restore task: {e}")))?
}

fn apply(sys: &SystemConfig, req: &PostRestore) -> Result<PostRestoreReport, AgentError> {
    let mut report = PostRestoreReport::default();
    if sys.set_clock {
        set_realtime(req.unix_time_ns)?;
        report.clock_set = true;
    }
    report.entropy_bits_credited = add_entropy(&req.entropy)?;
    reseed_crng()?;
    report.crng_reseeded = true;
    if let Some(name) = &req.hostname {
        if sys.set_hostname {
            nix::unistd::sethostname(name).map_err(|e| os_err("sethostname", std::io::Error::from(e)))?;
            report.hostname_set = true;
        }
        // Best effort: a read-only or missing /etc just keeps its file.
        let _ = write_synced(&sys.root.join("etc/hostname"), format!("{name}\n").as_bytes());
    }
    if let Some(id) = &req.machine_id {
        write_synced(&sys.root.join("etc/machine-id"), format!("{id}\n").as_bytes())
            .map_err(|e| os_err("writing /etc/machine-id", e))?;
        report.machine_id_written = true;
    }
    Ok(report)
}

fn set_realtime(ns: i64) -> Result<(), AgentError> {
    let ts = libc::timespec {
        tv_sec: ns.div_euclid(1_000_000_000) as libc::time_t,
        tv_nsec: ns.rem_euclid(1_000_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec that outlives the call.
    if unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) } != 0 {
        return Err(os_err("clock_settime", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// `RNDADDENTROPY` on `/dev/urandom` with full credit (8 bits per byte); returns the bits credited.
fn add_entropy(bytes: &[u8]) -> Result<u32, AgentError> {
    let f = File::options()
        .write(true)
        .open("/dev/urandom")
        .map_err(|e| os_err("opening /dev/urandom", e))?;
    let bits = u32::try_from(bytes.len() * 8).unwrap_or(u32::MAX);
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }, built in u32 words so the
    // buffer is suitably aligned.
    let words = bytes.len().div_ceil(4);
    let mut info = vec![0u32; 2 + words];
    info[0] = bits;
    info[1] = bytes.len() as u32;
    for (i, chunk) in bytes.chunks(4).enumerate() {
        let mut w = [0u8; 4];
        w[..chunk.len()].copy_from_slice(chunk);
        info[2 + i] = u32::from_ne_bytes(w);
    }
    // SAFETY: `info` is a rand_pool_info header followed by `buf_size` bytes, alive for the call; the kernel
    // only reads it.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) } != 0 {
        return Err(os_err("RNDADDENTROPY", std::io::Error::last_os_error()));
    }
    Ok(bits)
}

fn reseed_crng() -> Result<(), AgentError> {
    let f = File::open("/dev/urandom").map_err(|e| os_err("opening /dev/urandom", e))?;
    // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(f.as_raw_fd(), RNDRESEEDCRNG as _) } != 0 {
        return Err(os_err("RNDRESEEDCRNG", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Replace the content of `path` (in place, so a bind-mounted file keeps working) and fsync it.
fn write_synced(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut f = File::options()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.write_all(data)?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::unescape_mount_path;

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path("/mnt/a\\040b"), "/mnt/a b");
        assert_eq!(unescape_mount_path("/x\\134y"), "/x\\y");
        assert_eq!(unescape_mount_path("/plain"), "/plain");
        assert_eq!(unescape_mount_path("/end\\04"), "/end\\04");
    }
}
