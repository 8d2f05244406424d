//! QEMU `microvm` driver.
//!
//! One QEMU process per sandbox, with everything it owns in the sandbox's run directory:
//!
//! ```text
//! <run>/agent.sock    virtio-serial port `hearth.agent` (QEMU is the server; one client at a time)
//! <run>/qmp.sock      QMP control socket (see [`qmp`])
//! <run>/console.sock  the guest's serial console (QEMU is the server)
//! <run>/console.log   the console's last MiB, copied from console.sock by [`console`]
//! <run>/qemu.log      QEMU's own stdout/stderr (start failures, "terminating on signal")
//! <run>/qemu.pid      written by QEMU
//! ```
//!
//! Detaching: QEMU's `-daemonize` forks and calls `setsid()`, which the seccomp filter we want
//! (`-sandbox on,...,spawn=deny`) forbids (QEMU then exits with status 1 and no message; `elevateprivileges=deny`
//! has the same effect). Least privilege wins: we start QEMU without `-daemonize`, in a new session (so a
//! daemon restart or `kill -9` leaves it running), with stdio in `qemu.log`, and a thread reaps it if it exits
//! while the daemon still lives.
//!
//! Privileges: when the daemon runs as root, QEMU drops to a uid/gid of its own ([`vm_uid`], derived from the
//! sandbox id, no passwd entry) and chroots into the run directory once the machine is built
//! (`-run-with user=..,chroot=..`): every file and socket it needs is open by then. QEMU installs its seccomp
//! filter before it changes uid, so the filter must allow set*id (`elevateprivileges=allow`); that grants
//! nothing, because an unprivileged uid without capabilities cannot get root back, QEMU runs with
//! `no_new_privs`, and `spawn=deny` forbids exec. A per-VM uid also keeps one compromised QEMU from signalling
//! or reading another. For that the run directory becomes 0711 and the disk the VM uid's (QEMU reopens it by
//! its name relative to the chroot around migration).
//!
//! Start (`launch.rs`): QEMU starts paused (`-S`); `start` waits for QMP to answer (the machine is built; if
//! QEMU exits first its stderr is the error), attaches the console reader, then sends `cont`, so no console
//! output is lost.
//!
//! Kernel ([`KernelChoice`]): the uncompressed `vmlinux` through its PVH entry when it has one (no bzImage
//! self-decompression, which is slow under TCG), else the bzImage `vmlinuz`.
//!
//! Network (`crate::tap`): with [`VmSpec::net`] the driver opens the sandbox's tap inside its network namespace
//! and QEMU inherits the descriptor (`-netdev tap,fd=N` + `virtio-net-device`); the guest learns its address
//! from `hearth.net=` on the kernel command line. Every launch (boot, resume, fork) attaches a fresh
//! descriptor to the tap, which outlives the QEMU processes.
//!
//! Snapshots (`snapshot.rs`): QEMU cannot open host files once chrooted and unprivileged, so the driver opens
//! the state file and hands it over with [`qmp::Qmp::add_fd`]; `stop`, `migrate` to `file:/dev/fdset/<id>`,
//! wait, then `cont` (checkpoint) or quit (pause). Restore starts QEMU with `-incoming defer` and loads the file
//! the same way.

pub mod cgroups;
pub mod console;
mod launch;
pub mod memory;
pub mod qmp;
mod small_pages;
mod snapshot;
mod tsc;

use launch::Boot;
use memory::Machine;

pub use tsc::host_tsc_khz;

use std::collections::HashSet;
use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::os::fd::RawFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tokio::net::UnixStream;

use crate::{
    Accel, DiskFormat, SnapshotInfo, SnapshotMode, VmHandle, VmSpec, Vmm, VmmError, VmmKind,
    process_start_ticks,
};
use qmp::Qmp;

/// How long QEMU may take to build the machine and answer QMP.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long each stop step (QMP quit, SIGTERM, SIGKILL) waits for the process to go.
const STOP_STEP: Duration = Duration::from_secs(3);
/// Bound on one QMP exchange.
const QMP_TIMEOUT: Duration = Duration::from_secs(2);
/// Longest Unix socket path (sun_path holds 108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// The files of one VM in its run directory.
#[derive(Debug, Clone)]
pub struct RunFiles {
    pub agent_sock: PathBuf,
    pub qmp_sock: PathBuf,
    pub console_sock: PathBuf,
    pub console_log: PathBuf,
    pub qemu_log: PathBuf,
    pub pid_file: PathBuf,
}

impl RunFiles {
    pub fn new(run_dir: &Path) -> Self {
        RunFiles {
            agent_sock: run_dir.join("agent.sock"),
            qmp_sock: run_dir.join("qmp.sock"),
            console_sock: run_dir.join("console.sock"),
            console_log: run_dir.join("console.log"),
            qemu_log: run_dir.join("qemu.log"),
            pid_file: run_dir.join("qemu.pid"),
        }
    }
}

/// The QEMU driver.
#[derive(Debug, Clone)]
pub struct QemuVmm {
    accel: Accel,
    binary: PathBuf,
    version: String,
    /// Run QEMU as a per-VM unprivileged uid, chrooted into the run directory (default: when root).
    drop_privileges: bool,
    /// VMs (run directory, pid) whose console a pump thread copies.
    consoles: Arc<Mutex<HashSet<(PathBuf, u32)>>>,
    /// Which of the two kernel images a VM boots.
    kernel: KernelChoice,
    /// Where each VM's cgroup lives, when QEMU processes get one ([`cgroups`]).
    cgroups: Option<cgroups::QemuCgroups>,
}

/// Which kernel image QEMU is given (`-kernel`).
///
/// The uncompressed ELF (`vmlinux`) starts at its PVH entry point (the `XEN_ELFNOTE_PHYS32_ENTRY` note, present
/// when the kernel is built with `CONFIG_PVH`): QEMU copies it into guest memory and jumps straight into the
/// kernel. The bzImage (`vmlinuz`) first decompresses itself, which under TCG is a large part of a cold boot
/// (docs/benchmarks.md). The choice does not change the machine QEMU builds (the kernel travels through fw_cfg,
/// not a RAM block), so a snapshot taken after either boot restores under either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KernelChoice {
    /// `vmlinux` when it exists and has a PVH entry note, else `vmlinuz`.
    #[default]
    Auto,
    /// Always `vmlinuz`.
    BzImage,
    /// Always `vmlinux`; a start fails when it has no PVH entry note.
    Pvh,
}

impl KernelChoice {
    /// Parses `auto`, `bzimage` or `pvh`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "auto" => Some(KernelChoice::Auto),
            "bzimage" => Some(KernelChoice::BzImage),
            "pvh" => Some(KernelChoice::Pvh),
            _ => None,
        }
    }

    /// The image of `images` to boot, or why there is none.
    pub fn select<'a>(&self, images: &'a crate::BootImages) -> Result<&'a Path, String> {
        match self {
            KernelChoice::BzImage => Ok(&images.vmlinuz),
            KernelChoice::Pvh => match has_pvh_entry(&images.vmlinux) {
                Ok(true) => Ok(&images.vmlinux),
                Ok(false) => Err(format!(
                    "{} has no PVH entry note (kernel built without CONFIG_PVH?)",
                    images.vmlinux.display()
                )),
                Err(e) => Err(format!("{}: {e}", images.vmlinux.display())),
            },
            KernelChoice::Auto => match has_pvh_entry(&images.vmlinux) {
                Ok(true) => Ok(&images.vmlinux),
                _ => Ok(&images.vmlinuz),
            },
        }
    }
}

/// ELF note type of the 32-bit PVH entry point, in notes named "Xen" (Xen's public elfnote.h).
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;
/// Bound on the note segments read from a kernel (the Debian kernel's are under 1 KiB).
const MAX_NOTES: u64 = 1 << 20;

/// Whether `path` is a 64-bit little-endian ELF file with a PVH entry note, which is what QEMU needs to boot
/// it with `-kernel` (it reads the same note). Only the ELF and program headers and the note segments are
/// read.
pub fn has_pvh_entry(path: &Path) -> std::io::Result<bool> {
    let mut f = File::open(path)?;
    let mut eh = [0u8; 64];
    if f.read_exact(&mut eh).is_err() || eh[..4] != *b"\x7fELF" || eh[4] != 2 || eh[5] != 1 {
        return Ok(false);
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let u32_at = |b: &[u8], o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |b: &[u8], o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
    let phoff = u64_at(&eh, 0x20);
    let phentsize = usize::from(u16_at(&eh, 0x36));
    let phnum = usize::from(u16_at(&eh, 0x38));
    if phentsize < 56 {
        return Ok(false);
    }
    let mut ph = vec![0u8; phentsize * phnum];
    f.seek(SeekFrom::Start(phoff))?;
    if f.read_exact(&mut ph).is_err() {
        return Ok(false);
    }
    for entry in ph.chunks_exact(phentsize) {
        const PT_NOTE: u32 = 4;
        if u32_at(entry, 0) != PT_NOTE {
            continue;
        }
        let (offset, size) = (u64_at(entry, 8), u64_at(entry, 32));
        if size > MAX_NOTES {
            continue;
        }
        let mut notes = vec![0u8; usize::try_from(size).unwrap_or(0)];
        f.seek(SeekFrom::Start(offset))?;
        if f.read_exact(&mut notes).is_err() {
            return Ok(false);
        }
        // Each note: namesz, descsz, type, then the name and the descriptor, each padded to 4 bytes.
        let mut at = 0usize;
        while at + 12 <= notes.len() {
            let namesz = u32_at(&notes, at) as usize;
            let descsz = u32_at(&notes, at + 4) as usize;
            let kind = u32_at(&notes, at + 8);
            let name_end = at + 12 + namesz;
            let next = at + 12 + namesz.next_multiple_of(4) + descsz.next_multiple_of(4);
            if name_end > notes.len() || next > notes.len() {
                break;
            }
            if kind == XEN_ELFNOTE_PHYS32_ENTRY && notes[at + 12..name_end] == *b"Xen\0" {
                return Ok(true);
            }
            at = next;
        }
    }
    Ok(false)
}

impl QemuVmm {
    /// A driver for `binary` (whose `--version` said `version`), running guests with `accel`.
    pub fn new(accel: Accel, binary: PathBuf, version: String) -> Self {
        // Compare against the resolved path later: /proc/<pid>/exe is always canonical.
        let binary = std::fs::canonicalize(&binary).unwrap_or(binary);
        QemuVmm {
            accel,
            binary,
            version,
            drop_privileges: nix::unistd::geteuid().is_root(),
            consoles: Arc::default(),
            kernel: KernelChoice::Auto,
            cgroups: None,
        }
    }

    /// Finds QEMU as the host probe does (`HEARTH_QEMU` or `qemu-system-x86_64` on `PATH`).
    pub fn locate(accel: Accel) -> Result<Self, VmmError> {
        let missing = |detail| VmmError::BinaryMissing {
            binary: crate::detect::QEMU_BINARY.to_string(),
            detail,
        };
        let path = crate::detect::find_qemu().map_err(missing)?;
        let info = crate::detect::binary_info(&path).map_err(missing)?;
        Ok(QemuVmm::new(accel, info.path, info.version))
    }

    /// Turns the privilege drop on or off (it needs root; on by default when root).
    pub fn with_drop_privileges(mut self, on: bool) -> Self {
        self.drop_privileges = on;
        self
    }

    /// Chooses the kernel image VMs boot (default [`KernelChoice::Auto`]).
    pub fn with_kernel(mut self, kernel: KernelChoice) -> Self {
        self.kernel = kernel;
        self
    }

    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// QEMU's arguments for a fresh boot of `spec` (without the binary). `tap_fd` is the descriptor QEMU
    /// inherits for the guest's NIC, required when `spec.net` is set (see `tap`).
    pub fn command_line(&self, spec: &VmSpec, tap_fd: Option<RawFd>) -> Result<Vec<OsString>, VmmError> {
        self.command_line_for(spec, tap_fd, &Machine::fresh(&spec.run_dir))
    }

    /// QEMU's arguments for `spec` on `machine` (how RAM is mapped, which optional devices exist).
    pub fn command_line_for(
        &self,
        spec: &VmSpec,
        tap_fd: Option<RawFd>,
        machine: &Machine,
    ) -> Result<Vec<OsString>, VmmError> {
        let bad = |detail: String| VmmError::StartFailed {
            id: spec.id.clone(),
            detail,
        };
        if !valid_hostname(&spec.hostname) {
            return Err(bad(format!("invalid hostname {:?}", spec.hostname)));
        }
        if spec.vcpus == 0 || spec.memory_mib == 0 {
            return Err(bad("vcpus and memory must be positive".to_string()));
        }
        let files = RunFiles::new(&spec.run_dir);
        for sock in [&files.agent_sock, &files.qmp_sock, &files.console_sock] {
            if sock.as_os_str().len() > MAX_SOCKET_PATH {
                return Err(bad(format!(
                    "socket path {} is longer than {MAX_SOCKET_PATH} bytes",
                    sock.display()
                )));
            }
        }
        let opt = |p: &Path| opt_path(p).map_err(bad);
        let net = match (&spec.net, tap_fd) {
            (None, _) => None,
            (Some(net), Some(fd)) => {
                net.validate().map_err(bad)?;
                Some((net, fd))
            }
            (Some(_), None) => return Err(bad("a network interface needs the tap's descriptor".to_string())),
        };

        let mut append = String::from("console=ttyS0 reboot=k panic=-1 pci=off quiet");
        if let Some(khz) = host_tsc_khz() {
            // Without it a microvm guest under load can hang at "Marking TSC unstable" (docs ENVIRONMENT.md).
            append.push_str(&format!(" tsc_early_khz={khz}"));
        }
        append.push_str(&format!(
            " hearth.transport=serial hearth.hostname={}",
            spec.hostname
        ));
        if let Some(extra) = memory::extra_kernel_args() {
            append.push(' ');
            append.push_str(extra);
        }
        if let Some((n, _)) = &net {
            append.push(' ');
            append.push_str(&crate::net_kernel_arg());
            if n.ipv6 {
                append.push(' ');
                append.push_str(&crate::net6_kernel_arg());
            }
        }

        let (accel, cpu) = match self.accel {
            Accel::Kvm => ("kvm".to_owned(), "host"),
            // TCG's translated-code buffer is bounded (QEMU's default is up to 1 GiB, resident once filled), so
            // that what QEMU holds beyond guest RAM is bounded too ([`cgroups::overhead_mib`]).
            Accel::Tcg => (format!("tcg,tb-size={}", cgroups::tcg_tb_mib()), "max"),
        };
        let mut args: Vec<String> = vec![
            "-M".into(),
            // ACPI on: the Debian kernel finds the virtio-mmio devices through it (no cmdline devices).
            // No legacy PIT/PIC; the RTC stays so the guest starts with the right wall-clock time.
            format!("microvm,acpi=on,pit=off,pic=off{}", machine.machine_opt()),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-nographic".into(),
            "-no-reboot".into(),
            // Paused until the console reader is attached (see `start`).
            "-S".into(),
            "-accel".into(),
            accel,
            "-cpu".into(),
            cpu.into(),
            "-smp".into(),
            spec.vcpus.to_string(),
            "-m".into(),
            spec.memory_mib.to_string(),
            // A restore loads no kernel but QEMU still wants one; either image gives the same machine.
            "-kernel".into(),
            path_str(self.kernel.select(&spec.images).map_err(bad)?).map_err(bad)?,
            "-initrd".into(),
            path_str(&spec.images.initramfs).map_err(bad)?,
            "-append".into(),
            append,
            // Root disk: the sandbox's own qcow2 overlay, named relative to the run directory (QEMU's working
            // directory, and its root once chrooted) because QEMU reopens it by name around migration.
            "-drive".into(),
            format!(
                "if=none,id=root,file={},format=qcow2,discard=unmap",
                opt(&disk_arg(spec))?
            ),
            "-device".into(),
            "virtio-blk-device,drive=root".into(),
            // Agent channel: a virtio-serial port, migratable (pause/resume needs that).
            "-device".into(),
            machine.serial_device().into(),
            "-chardev".into(),
            format!(
                "socket,id=agent,path={},server=on,wait=off",
                opt(&files.agent_sock)?
            ),
            "-device".into(),
            "virtserialport,chardev=agent,name=hearth.agent".into(),
            // Entropy from the host, so the guest's RNG is seeded before user code runs.
            "-device".into(),
            "virtio-rng-device".into(),
            "-chardev".into(),
            format!("socket,id=qmp,path={},server=on,wait=off", opt(&files.qmp_sock)?),
            "-mon".into(),
            "chardev=qmp,mode=control".into(),
            "-chardev".into(),
            format!(
                "socket,id=console,path={},server=on,wait=off",
                opt(&files.console_sock)?
            ),
            "-serial".into(),
            "chardev:console".into(),
            "-pidfile".into(),
            path_str(&files.pid_file).map_err(bad)?,
        ];
        if let Some((net, fd)) = net {
            // Last, so that VMs without a NIC keep their device layout (and their snapshots stay loadable).
            // The migration stream carries the device's state; a restored QEMU gets a fresh descriptor on the
            // same tap.
            args.extend([
                "-netdev".into(),
                format!("tap,id=net0,fd={fd}"),
                "-device".into(),
                format!("virtio-net-device,netdev=net0,mac={}", net.guest_mac),
            ]);
        }
        args.extend(machine.backend_args(spec.memory_mib, opt_path).map_err(bad)?);
        args.extend(machine.trailing_devices());
        if self.drop_privileges {
            let uid = vm_uid(&spec.id);
            args.push("-run-with".into());
            args.push(format!("user={uid}:{uid},chroot={}", opt(&spec.run_dir)?));
            args.push("-sandbox".into());
            args.push("on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny".into());
        } else {
            args.push("-sandbox".into());
            args.push("on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into());
        }
        args.shrink_to_fit();
        Ok(args.into_iter().map(OsString::from).collect())
    }

    /// A QMP connection to a running VM, for commands beyond the trait (pause, snapshot).
    pub async fn qmp(&self, vm: &VmHandle) -> Result<Qmp, VmmError> {
        let path = RunFiles::new(&vm.run_dir).qmp_sock;
        match tokio::time::timeout(QMP_TIMEOUT, Qmp::connect(&path)).await {
            Ok(Ok(q)) => Ok(q),
            Ok(Err(e)) => Err(api_err(vm, "connect", e.to_string())),
            Err(_) => Err(api_err(vm, "connect", "timed out".to_string())),
        }
    }

    /// Starts copying `vm`'s console into `console.log` unless that already happens (after a daemon restart
    /// nobody does until this is called; `connect_agent` calls it).
    pub fn attach_console(&self, vm: &VmHandle) -> Result<(), VmmError> {
        let files = RunFiles::new(&vm.run_dir);
        let mut attached = self.consoles.lock().unwrap_or_else(|p| p.into_inner());
        let key = (vm.run_dir.clone(), vm.pid);
        if attached.contains(&key) {
            return Ok(());
        }
        let consoles = self.consoles.clone();
        let done = key.clone();
        console::spawn_pump(&files.console_sock, files.console_log.clone(), move || {
            consoles.lock().unwrap_or_else(|p| p.into_inner()).remove(&done);
        })
        .map_err(|e| VmmError::Io {
            path: files.console_sock.clone(),
            source: e,
        })?;
        attached.insert(key);
        Ok(())
    }

    /// True while `vm`'s process exists (not a zombie) with the recorded start time.
    fn same_process(vm: &VmHandle) -> bool {
        proc_state(vm.pid).is_some_and(|s| s != 'Z' && s != 'X')
            && process_start_ticks(vm.pid) == Some(vm.start_ticks)
    }

    /// Ends the QEMU process of `vm`: QMP quit, then SIGTERM, then SIGKILL.
    async fn stop_process(&self, vm: &VmHandle) -> Result<(), VmmError> {
        if !Self::same_process(vm) {
            return Ok(());
        }
        // Politely first: QMP quit lets QEMU flush the disk image.
        if let Ok(mut q) = self.qmp(vm).await {
            let _ = tokio::time::timeout(QMP_TIMEOUT, q.quit()).await;
            if Self::wait_gone(vm, STOP_STEP).await {
                return Ok(());
            }
        }
        for sig in [Signal::SIGTERM, Signal::SIGKILL] {
            Self::signal(vm, sig).await?;
            if Self::wait_gone(vm, STOP_STEP).await {
                return Ok(());
            }
        }
        Err(api_err(
            vm,
            "stop",
            format!("pid {} still alive after SIGKILL", vm.pid),
        ))
    }

    async fn wait_gone(vm: &VmHandle, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        let mut poll = crate::poll::Backoff::new();
        while Instant::now() < deadline {
            if !Self::same_process(vm) {
                return true;
            }
            poll.sleep().await;
        }
        !Self::same_process(vm)
    }

    async fn signal(vm: &VmHandle, sig: Signal) -> Result<(), VmmError> {
        // Re-check right before signalling: never signal a pid that now belongs to someone else.
        if !Self::same_process(vm) {
            return Ok(());
        }
        let pid = i32::try_from(vm.pid).map_err(|_| api_err(vm, "signal", "pid out of range".into()))?;
        match kill(Pid::from_raw(pid), sig) {
            Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
            Err(e) => Err(api_err(vm, "signal", format!("{sig}: {e}"))),
        }
    }
}

fn api_err(vm: &VmHandle, endpoint: &str, detail: String) -> VmmError {
    VmmError::Api {
        id: vm.run_dir.display().to_string(),
        endpoint: endpoint.to_string(),
        detail,
    }
}

#[async_trait::async_trait]
impl Vmm for QemuVmm {
    fn kind(&self) -> VmmKind {
        VmmKind::Qemu
    }

    fn accel(&self) -> Accel {
        self.accel
    }

    fn version(&self) -> String {
        self.version.clone()
    }

    async fn prepare_disk(
        &self,
        base: &Path,
        format: DiskFormat,
        dest_dir: &Path,
    ) -> Result<PathBuf, VmmError> {
        let disk_err = |path: &Path, detail: String| VmmError::Disk {
            path: path.to_path_buf(),
            detail,
        };
        // Back the overlay with the resolved template file: images/build.sh never rewrites a resolved version,
        // so the overlay keeps seeing the same base even after the template is rebuilt.
        let base = std::fs::canonicalize(base).map_err(|e| disk_err(base, e.to_string()))?;
        let dest = dest_dir.join("disk.qcow2");
        if dest.exists() {
            return Err(disk_err(&dest, "already exists".to_string()));
        }
        let qemu_img = self.qemu_img()?;
        if format == DiskFormat::Qcow2 {
            // A checkpoint's disk copy: hearth wrote its header, but check the chain it names before
            // qemu-img (as root) or QEMU opens it.
            crate::disk::check_qcow2_chain(&qemu_img, &base)
                .await
                .map_err(|e| disk_err(&base, e))?;
        }
        // The base's format is named (-F), never probed: a raw template may begin with any header a guest
        // wrote. The overlay records it, so QEMU opens the backing file with the same format.
        let out = tokio::process::Command::new(&qemu_img)
            .args(["create", "-q", "-f", "qcow2", "-F", format.as_str(), "-b"])
            .arg(&base)
            .arg(&dest)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| disk_err(&dest, format!("{}: {e}", qemu_img.display())))?;
        if !out.status.success() {
            return Err(disk_err(
                &dest,
                format!(
                    "qemu-img create ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
        Ok(dest)
    }

    async fn flatten_disk(&self, src: &Path, format: DiskFormat, dest: &Path) -> Result<(), VmmError> {
        if format == DiskFormat::Raw {
            return crate::disk::copy_raw(src, dest).await;
        }
        let disk_err = |detail: String| VmmError::Disk {
            path: src.to_path_buf(),
            detail,
        };
        let qemu_img = self.qemu_img()?;
        crate::disk::check_qcow2_chain(&qemu_img, src)
            .await
            .map_err(disk_err)?;
        // Source format named (-f): the overlay is read as qcow2 over its recorded backing chain and written
        // out as plain bytes, whatever header the guest put at the start of its disk.
        let out = tokio::process::Command::new(&qemu_img)
            .args(["convert", "-q", "-f", format.as_str(), "-O", "raw", "--"])
            .arg(src)
            .arg(dest)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| disk_err(format!("{}: {e}", qemu_img.display())))?;
        if !out.status.success() {
            let _ = std::fs::remove_file(dest);
            return Err(disk_err(format!(
                "qemu-img convert ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        File::open(dest)
            .and_then(|f| f.sync_all())
            .map_err(|source| VmmError::Io {
                path: dest.to_path_buf(),
                source,
            })
    }

    async fn start(&self, spec: &VmSpec) -> Result<VmHandle, VmmError> {
        self.launch(spec, &Machine::fresh(&spec.run_dir), Boot::Fresh)
            .await
    }

    async fn snapshot(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, VmmError> {
        self.snapshot_to(vm, disk, dest, mode).await
    }

    async fn restore(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        self.restore_from(spec, snapshot, info).await
    }

    async fn restore_as_own(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        self.restore_own_from(spec, snapshot, info).await
    }

    async fn resume(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        self.resume_from(spec, snapshot, info).await
    }

    async fn capture_disk(
        &self,
        vm: &VmHandle,
        disk: &Path,
        dest: &Path,
    ) -> Result<crate::DiskCapture, VmmError> {
        self.capture_disk_to(vm, disk, dest).await
    }

    async fn connect_agent(&self, vm: &VmHandle) -> Result<UnixStream, VmmError> {
        // Adopted VMs get their console reader back here; a failure only loses console output.
        if let Err(e) = self.attach_console(vm) {
            tracing::debug!(run_dir = %vm.run_dir.display(), "console not attached: {e}");
        }
        let path = RunFiles::new(&vm.run_dir).agent_sock;
        let err = |detail: String| VmmError::AgentChannel {
            id: vm.run_dir.display().to_string(),
            detail,
        };
        if !path.exists() {
            return Err(err(format!("{} does not exist", path.display())));
        }
        match tokio::time::timeout(Duration::from_secs(1), UnixStream::connect(&path)).await {
            Ok(Ok(s)) => Ok(s),
            Ok(Err(e)) => Err(err(format!("{}: {e}", path.display()))),
            Err(_) => Err(err(format!("{}: connect timed out", path.display()))),
        }
    }

    async fn stop(&self, vm: &VmHandle) -> Result<(), VmmError> {
        self.stop_process(vm).await?;
        self.remove_cgroup(&vm.run_dir, false, Some(vm.pid)).await;
        Ok(())
    }

    async fn continue_if_stopped(&self, vm: &VmHandle) -> Result<bool, VmmError> {
        let mut q = self.qmp(vm).await?;
        let status = q
            .query_status()
            .await
            .map_err(|e| api_err(vm, "query-status", e.to_string()))?;
        if status == "running" {
            return Ok(false);
        }
        // A checkpoint's migration goes on inside QEMU without the daemon: let it finish (or fail) first.
        let migrate = q
            .execute("query-migrate", None)
            .await
            .map_err(|e| api_err(vm, "query-migrate", e.to_string()))?;
        let migrating = matches!(
            migrate.get("status").and_then(serde_json::Value::as_str),
            Some("setup" | "active" | "pre-switchover" | "device" | "cancelling" | "wait-unplug")
        );
        if migrating {
            let _ = q.wait_migration(snapshot::MIGRATION_TIMEOUT).await;
        }
        q.execute("cont", None)
            .await
            .map_err(|e| api_err(vm, "cont", format!("continuing a VM left {status}: {e}")))?;
        Ok(true)
    }

    async fn sweep(&self, live: &[VmHandle]) {
        let Some(c) = &self.cgroups else { return };
        let keep: Vec<String> = live
            .iter()
            .filter_map(|h| cgroups::cgroup_name(&h.run_dir))
            .collect();
        crate::cgroup::sweep(&c.parent_dirs(), &keep).await;
    }

    fn exit_log(&self, vm: &VmHandle) -> String {
        crate::log::tail(&RunFiles::new(&vm.run_dir).qemu_log)
    }

    fn is_alive(&self, vm: &VmHandle) -> bool {
        if vm.kind != VmmKind::Qemu || !Self::same_process(vm) {
            return false;
        }
        let exe_ok = std::fs::read_link(format!("/proc/{}/exe", vm.pid)).is_ok_and(|exe| {
            // An upgraded binary shows as "<path> (deleted)" in running processes; it is still our VM.
            let exe = exe.to_string_lossy();
            exe.strip_suffix(" (deleted)").unwrap_or(&exe) == self.binary.to_string_lossy()
        });
        // The command line names this VM's QMP socket: the process is this VM, not just any QEMU.
        let qmp = RunFiles::new(&vm.run_dir).qmp_sock;
        let cmdline_ok = std::fs::read(format!("/proc/{}/cmdline", vm.pid)).is_ok_and(|c| {
            let needle = format!("path={}", qmp.display().to_string().replace(',', ",,"));
            c.split(|b| *b == 0)
                .any(|arg| arg.windows(needle.len()).any(|w| w == needle.as_bytes()))
        });
        exe_ok && cmdline_ok
    }
}

impl QemuVmm {
    /// `qemu-img` next to the QEMU binary, else on `PATH`.
    fn qemu_img(&self) -> Result<PathBuf, VmmError> {
        crate::detect::qemu_img_for(&self.binary).ok_or_else(|| VmmError::BinaryMissing {
            binary: "qemu-img".to_string(),
            detail: "not found next to QEMU nor on PATH (install qemu-utils)".to_string(),
        })
    }
}

/// First uid/gid of the range QEMU processes run as (far above any distribution's system and user ids).
pub const VM_UID_BASE: u32 = 0x4000_0000;

/// The unprivileged uid (and gid) QEMU runs as for sandbox `id`: stable, and distinct per sandbox with
/// overwhelming probability (28 bits of an FNV-1a hash).
pub fn vm_uid(id: &str) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    VM_UID_BASE + (h & 0x0fff_ffff) as u32
}

/// The disk as QEMU names it: relative to the run directory when it lives there (QEMU runs in, and chroots
/// into, that directory), else absolute (then a chrooted QEMU cannot reopen it, which migration needs).
fn disk_arg(spec: &VmSpec) -> PathBuf {
    match (spec.disk.parent(), spec.disk.file_name()) {
        (Some(dir), Some(name)) if dir == spec.run_dir => PathBuf::from(name),
        _ => spec.disk.clone(),
    }
}

/// Process state letter (`R`, `S`, `Z`, ...) from `/proc/<pid>/stat`.
fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.get(stat.rfind(')')? + 2..)?.chars().next()
}

/// Hostnames go on the kernel command line: keep them to one plain word.
fn valid_hostname(h: &str) -> bool {
    (1..=64).contains(&h.len())
        && h.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
}

fn path_str(p: &Path) -> Result<String, String> {
    p.to_str()
        .map(str::to_string)
        .ok_or_else(|| format!("path {} is not UTF-8", p.display()))
}

/// A path as a QEMU option value: commas are doubled so they cannot start another option.
fn opt_path(p: &Path) -> Result<String, String> {
    Ok(path_str(p)?.replace(',', ",,"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BootImages;

    fn spec(run: &Path) -> VmSpec {
        VmSpec {
            id: "sbx_0123456789abcdef".into(),
            vcpus: 2,
            memory_mib: 256,
            images: BootImages {
                vmlinuz: "/img/vmlinuz".into(),
                vmlinux: "/img/vmlinux".into(),
                initramfs: "/img/initramfs.cpio.gz".into(),
            },
            disk: run.join("disk.qcow2"),
            run_dir: run.to_path_buf(),
            hostname: "sbx-1".into(),
            net: None,
        }
    }

    fn args_of(vmm: &QemuVmm, s: &VmSpec) -> Vec<String> {
        vmm.command_line(s, None)
            .expect("command line")
            .into_iter()
            .map(|a| a.into_string().expect("utf-8"))
            .collect()
    }

    #[test]
    fn command_line_has_the_devices_and_accel() {
        let vmm = QemuVmm::new(
            Accel::Tcg,
            "/usr/bin/qemu-system-x86_64".into(),
            "QEMU 10.0.2".into(),
        )
        .with_drop_privileges(false);
        let a = args_of(&vmm, &spec(Path::new("/run/h/sbx")));
        let joined = a.join(" ");
        assert!(
            joined.contains("-accel tcg,tb-size=512 -cpu max -smp 2 -m 256"),
            "{joined}"
        );
        assert!(joined.contains("virtserialport,chardev=agent,name=hearth.agent"));
        assert!(joined.contains("socket,id=agent,path=/run/h/sbx/agent.sock,server=on,wait=off"));
        assert!(joined.contains("file=disk.qcow2,format=qcow2"), "{joined}");
        assert!(joined.contains("-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny"));
        assert!(!a.iter().any(|x| x == "-daemonize" || x == "-run-with"));
        let dropped = vmm.clone().with_drop_privileges(true);
        let j = args_of(&dropped, &spec(Path::new("/run/h/sbx"))).join(" ");
        let uid = vm_uid("sbx_0123456789abcdef");
        assert!(
            j.contains(&format!("-run-with user={uid}:{uid},chroot=/run/h/sbx")),
            "{j}"
        );
        assert!(j.contains("elevateprivileges=allow,spawn=deny"), "{j}");
        let append = &a[a.iter().position(|x| x == "-append").expect("append") + 1];
        assert!(
            append.contains("hearth.hostname=sbx-1") && append.contains("panic=-1"),
            "{append}"
        );
        let kvm = QemuVmm::new(
            Accel::Kvm,
            "/usr/bin/qemu-system-x86_64".into(),
            "QEMU 10.0.2".into(),
        );
        assert!(
            args_of(&kvm, &spec(Path::new("/r")))
                .join(" ")
                .contains("-accel kvm -cpu host")
        );
    }

    #[test]
    fn a_nic_is_the_last_device_and_its_config_goes_on_the_command_line() {
        // Without the privilege options, which follow the devices.
        let vmm = QemuVmm::new(Accel::Tcg, "/usr/bin/qemu-system-x86_64".into(), "v".into())
            .with_drop_privileges(false);
        let mut s = spec(Path::new("/r"));
        let plain = args_of(&vmm, &s);
        assert!(!plain.join(" ").contains("hearth.net="));
        assert!(!plain.iter().any(|a| a == "-netdev"));
        s.net = Some(crate::NetAttach::for_sandbox(&s.id));
        assert!(matches!(
            vmm.command_line(&s, None),
            Err(VmmError::StartFailed { .. })
        ));
        let a: Vec<String> = vmm
            .command_line(&s, Some(7))
            .expect("command line")
            .into_iter()
            .map(|a| a.into_string().expect("utf-8"))
            .collect();
        // The NIC follows every other device (after `-pidfile <path>`); the rest is what a VM without one gets,
        // so VMs without a NIC keep their device layout (and their snapshots stay loadable).
        let at = a.iter().position(|x| x == "-pidfile").expect("pidfile") + 2;
        assert_eq!(
            a[at..at + 4],
            [
                "-netdev",
                "tap,id=net0,fd=7",
                "-device",
                "virtio-net-device,netdev=net0,mac=02:68:72:74:68:02"
            ]
        );
        let mut without: Vec<String> = a.clone();
        without.drain(at..at + 4);
        let without: Vec<String> = without
            .iter()
            .map(|x| x.replace(" hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1", ""))
            .collect();
        assert_eq!(without, plain);
        let append = &a[a.iter().position(|x| x == "-append").expect("append") + 1];
        assert!(
            append.ends_with(" hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1"),
            "{append}"
        );
        s.net = Some(crate::NetAttach {
            guest_mac: "02:00:00:00:00:01,romfile=/x".into(),
            ..crate::NetAttach::for_sandbox(&s.id)
        });
        assert!(matches!(
            vmm.command_line(&s, Some(7)),
            Err(VmmError::StartFailed { .. })
        ));
    }

    #[test]
    fn commas_in_paths_cannot_inject_options() {
        let vmm = QemuVmm::new(Accel::Tcg, "/usr/bin/qemu-system-x86_64".into(), "v".into());
        let a = args_of(&vmm, &spec(Path::new("/run/a,b=c")));
        assert!(
            a.iter().any(|x| x.contains("path=/run/a,,b=c/agent.sock,")),
            "{a:?}"
        );
    }

    #[test]
    fn bad_hostnames_and_long_paths_are_refused() {
        let vmm = QemuVmm::new(Accel::Tcg, "/usr/bin/qemu-system-x86_64".into(), "v".into());
        let mut s = spec(Path::new("/r"));
        s.hostname = "a b init=/bin/sh".into();
        assert!(matches!(
            vmm.command_line(&s, None),
            Err(VmmError::StartFailed { .. })
        ));
        let long = PathBuf::from(format!("/{}", "x".repeat(120)));
        assert!(matches!(
            vmm.command_line(&spec(&long), None),
            Err(VmmError::StartFailed { .. })
        ));
    }

    #[test]
    fn vm_uids_are_unprivileged_stable_and_distinct() {
        let a = vm_uid("sbx_0000000000000001");
        assert_eq!(a, vm_uid("sbx_0000000000000001"));
        assert_ne!(a, vm_uid("sbx_0000000000000002"));
        let many: HashSet<u32> = (0..10_000).map(|i| vm_uid(&format!("sbx_{i:016x}"))).collect();
        assert!(many.len() >= 9_990);
        assert!(
            many.iter()
                .all(|u| (VM_UID_BASE..VM_UID_BASE + 0x1000_0000).contains(u))
        );
    }

    #[test]
    fn dead_handles_are_not_alive() {
        let vmm = QemuVmm::new(Accel::Tcg, "/usr/bin/qemu-system-x86_64".into(), "v".into());
        let me = VmHandle {
            kind: VmmKind::Qemu,
            pid: std::process::id(),
            start_ticks: process_start_ticks(std::process::id()).expect("ticks"),
            run_dir: "/nonexistent".into(),
        };
        // This test process is alive but is not QEMU.
        assert!(!vmm.is_alive(&me));
        let reused = VmHandle {
            start_ticks: me.start_ticks + 1,
            ..me.clone()
        };
        assert!(!QemuVmm::same_process(&reused));
    }

    /// A minimal ELF64 file with one PT_NOTE segment holding `notes` (name, type) entries.
    fn elf_with_notes(notes: &[(&[u8], u32)]) -> Vec<u8> {
        let mut seg = Vec::new();
        for (name, kind) in notes {
            seg.extend((name.len() as u32).to_le_bytes());
            seg.extend(8u32.to_le_bytes());
            seg.extend(kind.to_le_bytes());
            seg.extend(*name);
            seg.resize(seg.len().next_multiple_of(4), 0);
            seg.extend(0x0100_0850u64.to_le_bytes());
        }
        let mut f = vec![0u8; 64];
        f[..6].copy_from_slice(b"\x7fELF\x02\x01");
        f[0x20..0x28].copy_from_slice(&64u64.to_le_bytes());
        f[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        f[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        let mut ph = vec![0u8; 56];
        ph[..4].copy_from_slice(&4u32.to_le_bytes());
        ph[8..16].copy_from_slice(&120u64.to_le_bytes());
        ph[32..40].copy_from_slice(&(seg.len() as u64).to_le_bytes());
        f.extend(ph);
        f.extend(seg);
        f
    }

    #[test]
    fn the_pvh_kernel_is_booted_only_when_it_has_the_entry_note() {
        let dir = tempfile::tempdir().expect("tempdir");
        let pvh = dir.path().join("pvh");
        std::fs::write(&pvh, elf_with_notes(&[(b"GNU\0", 3), (b"Xen\0", 18)])).expect("write");
        let plain = dir.path().join("plain");
        // Right type, wrong owner; right owner, another type.
        std::fs::write(&plain, elf_with_notes(&[(b"Lin\0", 18), (b"Xen\0", 17)])).expect("write");
        let bzimage = dir.path().join("bz");
        std::fs::write(
            &bzimage,
            b"MZ not an ELF file, longer than an ELF header.................................",
        )
        .expect("write");
        assert!(has_pvh_entry(&pvh).expect("read"));
        assert!(!has_pvh_entry(&plain).expect("read"));
        assert!(!has_pvh_entry(&bzimage).expect("read"));

        let mut s = spec(Path::new("/run/h/sbx"));
        s.images.vmlinuz = bzimage.clone();
        let kernel_of = |vmm: &QemuVmm, s: &VmSpec| {
            let a = args_of(vmm, s);
            a[a.iter().position(|x| x == "-kernel").expect("-kernel") + 1].clone()
        };
        let auto = QemuVmm::new(Accel::Tcg, "/usr/bin/qemu-system-x86_64".into(), "v".into());
        let forced_bz = auto.clone().with_kernel(KernelChoice::BzImage);
        let forced_pvh = auto.clone().with_kernel(KernelChoice::Pvh);
        s.images.vmlinux = pvh.clone();
        assert_eq!(kernel_of(&auto, &s), pvh.display().to_string());
        assert_eq!(kernel_of(&forced_pvh, &s), pvh.display().to_string());
        assert_eq!(kernel_of(&forced_bz, &s), bzimage.display().to_string());
        for fallback in [plain, dir.path().join("missing")] {
            s.images.vmlinux = fallback;
            assert_eq!(kernel_of(&auto, &s), bzimage.display().to_string());
            let err = forced_pvh.command_line(&s, None).expect_err("no PVH kernel");
            assert!(
                err.to_string().contains(&s.images.vmlinux.display().to_string()),
                "{err}"
            );
        }
        assert_eq!(KernelChoice::parse("pvh"), Some(KernelChoice::Pvh));
        assert_eq!(KernelChoice::parse("bzimage"), Some(KernelChoice::BzImage));
        assert_eq!(KernelChoice::parse("auto"), Some(KernelChoice::Auto));
        assert_eq!(KernelChoice::parse("elf"), None);
    }

    #[test]
    fn the_built_kernel_has_a_pvh_entry_when_present() {
        // The Debian cloud kernel is built with CONFIG_PVH; images/build.sh extracts it next to the bzImage.
        let vmlinux = Path::new("/var/lib/hearth/images/vmlinux");
        if vmlinux.exists() {
            assert!(has_pvh_entry(vmlinux).expect("read vmlinux"));
            assert!(!has_pvh_entry(&vmlinux.with_file_name("vmlinuz")).expect("read vmlinuz"));
        }
    }
}
