//! PID 1 duties: mounts, hostname, loopback, network (see [`crate::net`]), signals, kernel command line,
//! console logging.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::sync::{Mutex, OnceLock};

use nix::mount::{MsFlags, mount};

/// True when this process is the guest's init.
pub fn is_pid1() -> bool {
    std::process::id() == 1
}

static CONSOLE: OnceLock<Option<Mutex<File>>> = OnceLock::new();

/// Log one line: to the kernel log (`/dev/kmsg`, falling back to `/dev/console`) as PID 1, else to stderr.
pub fn log(msg: &str) {
    let console = CONSOLE.get_or_init(|| {
        if !is_pid1() {
            return None;
        }
        let open = |p: &str| OpenOptions::new().write(true).open(p).ok();
        open("/dev/kmsg").or_else(|| open("/dev/console")).map(Mutex::new)
    });
    match console {
        Some(f) => {
            let mut f = f.lock().unwrap_or_else(|p| p.into_inner());
            // One write per record: /dev/kmsg turns each write into one log line.
            let _ = f.write_all(format!("<6>hearth-agent: {msg}\n").as_bytes());
        }
        None => eprintln!("hearth-agent: {msg}"),
    }
}

/// The `hearth.*` keys of the kernel command line.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cmdline {
    pub hostname: Option<String>,
    /// `serial` or `vsock`; `None` = detect.
    pub transport: Option<String>,
    pub vsock_port: Option<u32>,
    /// `hearth.contain=0|1`: programs in cgroups (see [`crate::contain`]); `None` = the default.
    pub contain: Option<bool>,
    /// `hearth.pids_max=N`: most processes all programs together may have.
    pub pids_max: Option<u64>,
}

impl Cmdline {
    /// Parse a kernel command line.
    pub fn parse(line: &str) -> Self {
        let keys: HashMap<&str, &str> = line
            .split_whitespace()
            .filter_map(|w| w.split_once('='))
            .collect();
        Cmdline {
            hostname: keys.get("hearth.hostname").map(|s| (*s).to_owned()),
            transport: keys.get("hearth.transport").map(|s| (*s).to_owned()),
            vsock_port: keys.get("hearth.vsock_port").and_then(|s| s.parse().ok()),
            contain: keys.get("hearth.contain").map(|s| *s != "0"),
            pids_max: keys.get("hearth.pids_max").and_then(|s| s.parse().ok()),
        }
    }

    /// Read `/proc/cmdline` (empty when unreadable). `HEARTH_AGENT_CMDLINE`, when set, replaces it (tests run
    /// the agent as PID 1 of a namespace, where the real command line belongs to the host); then containment
    /// is off unless the line asks for it, so a test never touches the host's cgroups.
    pub fn read() -> Self {
        match std::env::var("HEARTH_AGENT_CMDLINE") {
            Ok(line) => {
                let mut c = Self::parse(&line);
                c.contain = Some(c.contain == Some(true));
                c
            }
            Err(_) => Self::parse(&std::fs::read_to_string("/proc/cmdline").unwrap_or_default()),
        }
    }
}

/// Everything PID 1 sets up before serving. Failures are logged, never fatal.
pub fn setup() {
    ignore_signals();
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(0o022) };
    let _ = std::env::set_current_dir("/");
    mount_filesystems();
    let cmdline = Cmdline::read();
    if let Some(name) = cmdline.hostname.as_deref().filter(|n| valid_hostname(n))
        && let Err(e) = nix::unistd::sethostname(name)
    {
        log(&format!("sethostname {name}: {e}"));
    }
    if let Err(e) = loopback_up() {
        log(&format!("bringing up lo: {e}"));
    }
    // The NIC, when the host gave the VM one (`hearth.net=`); failures are logged, never fatal.
    crate::net::setup();
    if cmdline.contain != Some(false) {
        crate::contain::setup(cmdline.pids_max);
    }
}

fn valid_hostname(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
}

extern "C" fn ignore_signal(_: libc::c_int) {}

/// PID 1 must not die of SIGTERM/SIGINT (e.g. ctrl-alt-del or a stray `kill -TERM 1`). A no-op handler
/// rather than SIG_IGN, because handlers (unlike SIG_IGN) are reset for the programs we exec.
fn ignore_signals() {
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: a zeroed sigaction is valid; the handler is an async-signal-safe no-op.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = ignore_signal as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
}

fn mounted() -> Vec<String> {
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1).map(str::to_owned))
        .collect()
}

fn mount_filesystems() {
    let nosuid = MsFlags::MS_NOSUID;
    let strict = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    let table: [(&str, &str, &str, MsFlags, Option<&str>); 6] = [
        ("proc", "/proc", "proc", strict, None),
        ("sysfs", "/sys", "sysfs", strict, None),
        ("devtmpfs", "/dev", "devtmpfs", nosuid, Some("mode=0755")),
        (
            "devpts",
            "/dev/pts",
            "devpts",
            MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
            Some("gid=5,mode=0620,ptmxmode=0666"),
        ),
        (
            "tmpfs",
            "/dev/shm",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=1777"),
        ),
        (
            "tmpfs",
            "/tmp",
            "tmpfs",
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("mode=1777"),
        ),
    ];
    for (src, target, fstype, flags, data) in table {
        // /proc is mounted first, so later checks see what the initramfs may have moved over already.
        if mounted().iter().any(|m| m == target) {
            continue;
        }
        let _ = std::fs::create_dir_all(target);
        if let Err(e) = mount(Some(src), target, Some(fstype), flags, data) {
            log(&format!("mount {target}: {e}"));
        }
    }
    for (link, to) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        let _ = std::os::unix::fs::symlink(to, link);
    }
}

/// `ip link set lo up` (the kernel then assigns 127.0.0.1/8 and ::1 itself).
fn loopback_up() -> std::io::Result<()> {
    // SAFETY: plain socket(2) call; the fd is owned below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor we own.
    let sock = unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let raw = std::os::fd::AsRawFd::as_raw_fd(&sock);
    // SAFETY: ifreq is plain data; zeroed is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // SAFETY: SIOCGIFFLAGS reads the name and writes the flags into `req`, which outlives the call.
    if unsafe { libc::ioctl(raw, libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: after SIOCGIFFLAGS the flags member of the union is the initialised one.
    unsafe { req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short };
    // SAFETY: SIOCSIFFLAGS reads `req`.
    if unsafe { libc::ioctl(raw, libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hearth_keys() {
        let c = Cmdline::parse(
            "console=ttyS0 hearth.hostname=sbx-1 quiet hearth.transport=vsock hearth.vsock_port=2000 init=/x",
        );
        assert_eq!(c.hostname.as_deref(), Some("sbx-1"));
        assert_eq!(c.transport.as_deref(), Some("vsock"));
        assert_eq!(c.vsock_port, Some(2000));
        assert_eq!(Cmdline::parse(""), Cmdline::default());
        assert_eq!(Cmdline::parse("hearth.vsock_port=x").vsock_port, None);
        assert_eq!(c.contain, None);
        let c = Cmdline::parse("hearth.contain=0 hearth.pids_max=128");
        assert_eq!((c.contain, c.pids_max), (Some(false), Some(128)));
        assert_eq!(Cmdline::parse("hearth.contain=1").contain, Some(true));
    }

    #[test]
    fn hostname_validation() {
        assert!(valid_hostname("sbx-0123abcd"));
        assert!(!valid_hostname("a b"));
        assert!(!valid_hostname(""));
        assert!(!valid_hostname(&"a".repeat(65)));
    }
}
