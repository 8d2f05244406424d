//! Keeps QEMU from asking for transparent huge pages.
//!
//! QEMU advises `MADV_HUGEPAGE` on every RAM block and on TCG's code buffer, unconditionally. hearth keeps guest
//! RAM in a file (`<run>/memory`, [`super::memory`]), and on a file system whose page cache uses large folios
//! (ext4 since Linux 6.16) that advice makes the kernel fill the file's page cache with 2 MiB folios: one 4 KiB
//! write by the guest then dirties 2 MiB, and the next pause writes all of it back; a page the guest reads after
//! a resume brings in 2 MiB as well. Measured with cachestat(2) on an idle 256 MiB guest: 30 MiB of its memory
//! file dirty right after a resume, in whole 2 MiB runs (docs/benchmarks.md). The advice buys nothing in return:
//! the kernel maps a writable shared file with small pages anyway (`FilePmdMapped: 0`).
//!
//! [`SmallPages::install`] runs in the forked child before QEMU is executed and loads a seccomp filter that
//! fails `madvise(.., MADV_HUGEPAGE)` with `EINVAL` (QEMU ignores the result of that advice) and allows every
//! other call; QEMU's own `-sandbox` filter stacks on top of it. `HEARTH_QEMU_FEATURES_OFF=small-pages` leaves
//! it out, for A/B measurements.

use libc::{sock_filter, sock_fprog};

/// The name `HEARTH_QEMU_FEATURES_OFF` knows this by.
pub(super) const FEATURE: &str = "small-pages";

/// `AUDIT_ARCH_X86_64` (linux/audit.h): the filter only judges calls made with the x86-64 ABI.
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
/// Offsets into `struct seccomp_data`: the call's number, the architecture, the low word of the third argument.
const NR: u32 = 0;
const ARCH: u32 = 4;
const ARG2_LOW: u32 = 16 + 2 * 8;

const fn stmt(code: u32, k: u32) -> sock_filter {
    sock_filter {
        code: code as u16,
        jt: 0,
        jf: 0,
        k,
    }
}

/// A conditional jump: `jt`/`jf` instructions forward when the accumulator equals / differs from `k`.
const fn jeq(k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    }
}

const LOAD: u32 = libc::BPF_LD | libc::BPF_W | libc::BPF_ABS;
const RET: u32 = libc::BPF_RET | libc::BPF_K;

/// The filter, ready to be installed in a child that must not allocate.
pub(super) struct SmallPages {
    program: [sock_filter; 8],
}

impl SmallPages {
    pub(super) fn new() -> SmallPages {
        SmallPages {
            program: [
                stmt(LOAD, ARCH),
                jeq(AUDIT_ARCH_X86_64, 0, 5),
                stmt(LOAD, NR),
                jeq(libc::SYS_madvise as u32, 0, 3),
                stmt(LOAD, ARG2_LOW),
                jeq(libc::MADV_HUGEPAGE as u32, 0, 1),
                stmt(RET, libc::SECCOMP_RET_ERRNO | libc::EINVAL as u32),
                stmt(RET, libc::SECCOMP_RET_ALLOW),
            ],
        }
    }

    /// Loads the filter into the calling thread (and what it executes). Async-signal-safe: two prctl(2) calls,
    /// nothing allocated, so it can run between fork and exec.
    pub(super) fn install(&self) -> std::io::Result<()> {
        let program = sock_fprog {
            len: self.program.len() as u16,
            // The kernel copies the program and never writes through this pointer.
            filter: self.program.as_ptr().cast_mut(),
        };
        // SAFETY: prctl(2) with integer arguments; no_new_privs only keeps the exec'd QEMU from gaining
        // privileges through set-user-ID bits or file capabilities (it has none, and QEMU's own -sandbox sets
        // the same bit).
        if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `program` points at `self.program`, eight valid instructions that outlive the call; the kernel
        // validates the program and copies it.
        let rc = unsafe {
            libc::prctl(
                libc::PR_SET_SECCOMP,
                libc::SECCOMP_MODE_FILTER,
                &program as *const sock_fprog,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a forked child: with the filter installed `MADV_HUGEPAGE` fails with EINVAL while other advice still
    /// works. A child, because a seccomp filter cannot be removed. (That QEMU's guest RAM ends up without the
    /// `hg` flag is asserted on a real VM in tests/qemu.rs.)
    #[test]
    fn huge_page_advice_fails_and_other_advice_works() {
        let filter = SmallPages::new();
        // SAFETY: the child only makes raw system calls and leaves with _exit; nothing in it allocates or
        // takes a lock another thread of the test harness could hold.
        match unsafe { libc::fork() } {
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                let code = unsafe { child(&filter) };
                unsafe { libc::_exit(code) };
            }
            pid => {
                let mut status = 0;
                // SAFETY: waits for the child forked above.
                assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
                assert!(libc::WIFEXITED(status), "child status {status:#x}");
                assert_eq!(
                    libc::WEXITSTATUS(status),
                    0,
                    "1: install, 2: hugepage advice passed, 3: other advice failed"
                );
            }
        }
    }

    /// # Safety
    /// Only in a freshly forked child.
    unsafe fn child(filter: &SmallPages) -> i32 {
        if filter.install().is_err() {
            return 1;
        }
        let len = 4 << 20;
        // SAFETY: a fresh anonymous mapping, only advised and unmapped.
        unsafe {
            let addr = libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            if addr == libc::MAP_FAILED {
                return 1;
            }
            if libc::madvise(addr, len, libc::MADV_HUGEPAGE) == 0 || *libc::__errno_location() != libc::EINVAL
            {
                return 2;
            }
            if libc::madvise(addr, len, libc::MADV_NOHUGEPAGE) != 0
                || libc::madvise(addr, len, libc::MADV_DONTNEED) != 0
            {
                return 3;
            }
            libc::munmap(addr, len);
        }
        0
    }
}
