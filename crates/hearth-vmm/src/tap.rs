//! The guest's tap, as the drivers see it: checking it exists, and opening it for QEMU.
//!
//! QEMU runs chrooted, unprivileged and under seccomp, so it cannot open `/dev/net/tun` itself, let alone in
//! another network namespace. The driver (root) does it on a thread that joined the sandbox's namespace (a
//! tun descriptor belongs to the namespace it was opened in), attaches it to the existing tap, and QEMU
//! inherits the descriptor (`-netdev tap,fd=N`). The tap must already exist: attaching never creates one,
//! so a missing tap is an error rather than a fresh, unconfigured device.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;

/// Whether an interface `name` exists in the namespace `netns`. Firecracker opens its tap by name and, run
/// with privileges, would create a missing one: the driver checks first, so a missing tap is an error under
/// both drivers.
pub fn tap_exists(netns: &Path, name: &str) -> std::io::Result<bool> {
    let name = std::ffi::CString::new(name).map_err(|_| std::io::Error::other("NUL in the tap name"))?;
    // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
    hearth_net::netns::in_netns(netns, move || {
        Ok(unsafe { libc::if_nametoindex(name.as_ptr()) } != 0)
    })
}

/// Opens `/dev/net/tun` inside the namespace `netns` and attaches it to the existing tap `name` (no packet
/// info header, no virtio-net header). Only one descriptor can be attached at a time: `EBUSY` means another
/// process (an old QEMU) still holds the tap.
pub fn open_tap(netns: &Path, name: &str) -> std::io::Result<OwnedFd> {
    let name = name.to_string();
    hearth_net::netns::in_netns(netns, move || attach(&name))
}

fn attach(name: &str) -> std::io::Result<OwnedFd> {
    let cname = std::ffi::CString::new(name).map_err(|_| std::io::Error::other("NUL in the tap name"))?;
    // SAFETY: `cname` is a valid NUL-terminated string for the duration of the call.
    if unsafe { libc::if_nametoindex(cname.as_ptr()) } == 0 {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("no interface {name} in the network namespace"),
        ));
    }
    let tun = File::options().read(true).write(true).open("/dev/net/tun")?;
    // SAFETY: ifreq is plain data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    if name.len() >= req.ifr_name.len() {
        return Err(std::io::Error::other(format!("tap name {name:?} is too long")));
    }
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: TUNSETIFF reads an ifreq from the pointer, which is valid for the call.
    if unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        let e = std::io::Error::last_os_error();
        return Err(std::io::Error::new(e.kind(), format!("attaching to {name}: {e}")));
    }
    Ok(OwnedFd::from(tun))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_tap_is_not_created() {
        assert!(tap_exists(Path::new("/proc/self/ns/net"), "lo").expect("lo"));
        assert!(!tap_exists(Path::new("/proc/self/ns/net"), "hxt-none0").expect("none"));
        // The host's own namespace has no interface by that name; nothing may be created either.
        let err = open_tap(Path::new("/proc/self/ns/net"), "hxt-none0").expect_err("no such tap");
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound, "{err}");
        assert!(!Path::new("/sys/class/net/hxt-none0").exists());
    }
}
