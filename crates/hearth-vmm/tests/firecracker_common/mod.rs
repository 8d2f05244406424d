//! Shared fixtures for the Firecracker tests: the real binary, boot images, sandbox directories, and a guard
//! that kills a VM a failing test leaves behind.
//!
//! Images: the real ones from `HEARTH_IMAGES` (default `/var/lib/hearth/images`: `vmlinux`,
//! `initramfs.cpio.gz`, `rootfs/minimal.ext4`) when they exist. Otherwise a fallback set is built once in the
//! cargo target's temp dir: the `vmlinux` extracted by `images/extract-vmlinux.sh` from the Debian cloud
//! kernel (downloaded with `apt-get download`), a tiny gzip'd initramfs, and a small raw ext4 made by
//! `mkfs.ext4`. This host cannot run the guest kernel (PVM), so the tests check everything up to the API, the
//! process and the snapshot files, not a running guest.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use hearth_vmm::firecracker::FirecrackerVmm;
use hearth_vmm::{BootImages, VmHandle, VmSpec};

pub const MEM_MIB: u32 = 128;

/// The Firecracker binary (`HEARTH_FIRECRACKER` or the install path). Missing is a test failure: the
/// install script provides it.
pub fn vmm() -> FirecrackerVmm {
    let bin = std::env::var_os("HEARTH_FIRECRACKER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(hearth_vmm::firecracker::DEFAULT_BINARY));
    FirecrackerVmm::new(&bin).unwrap_or_else(|e| panic!("{e} (run scripts/install-deps.sh)"))
}

pub struct Images {
    pub vmlinux: PathBuf,
    pub initramfs: PathBuf,
    pub rootfs: PathBuf,
}

impl Images {
    pub fn boot(&self) -> BootImages {
        BootImages {
            vmlinuz: self.vmlinux.with_file_name("vmlinuz"),
            vmlinux: self.vmlinux.clone(),
            initramfs: self.initramfs.clone(),
        }
    }
}

pub fn images() -> Images {
    let dir = std::env::var_os("HEARTH_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/hearth/images"));
    let real = Images {
        vmlinux: dir.join("vmlinux"),
        initramfs: dir.join("initramfs.cpio.gz"),
        rootfs: dir.join("rootfs/minimal.ext4"),
    };
    if real.vmlinux.is_file() && real.initramfs.is_file() && real.rootfs.is_file() {
        return real;
    }
    fallback_images()
}

fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

fn stdout(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(out.status.success(), "{cmd:?}: {}", out.status);
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Builds (once, under a file lock shared by all test binaries) the fallback images.
fn fallback_images() -> Images {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("firecracker-images");
    std::fs::create_dir_all(&dir).expect("fallback image dir");
    let lock = std::fs::File::create(dir.join(".lock")).expect("lock file");
    lock.lock().expect("lock");
    let images = Images {
        vmlinux: dir.join("vmlinux"),
        initramfs: dir.join("initramfs.cpio.gz"),
        rootfs: dir.join("minimal.ext4"),
    };
    if !images.vmlinux.is_file() {
        let vmlinuz = debian_vmlinuz_locked(&dir);
        run(Command::new("sh")
            .arg(extract_script())
            .arg(&vmlinuz)
            .arg(&images.vmlinux));
    }
    if !images.initramfs.is_file() {
        // Firecracker only loads the initrd into guest memory; its contents matter to the guest alone.
        let tmp = dir.join("initramfs.tmp");
        run(Command::new("sh")
            .arg("-c")
            .arg("printf 'hearth test initramfs\\n' | gzip -n > \"$1\"")
            .arg("sh")
            .arg(&tmp));
        std::fs::rename(&tmp, &images.initramfs).expect("rename initramfs");
    }
    if !images.rootfs.is_file() {
        let tmp = dir.join("rootfs.tmp");
        let _ = std::fs::remove_file(&tmp);
        run(Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", "hearth-test"])
            .arg(&tmp)
            .arg("32M"));
        std::fs::rename(&tmp, &images.rootfs).expect("rename rootfs");
    }
    images
}

/// `images/extract-vmlinux.sh` of this checkout.
pub fn extract_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../images/extract-vmlinux.sh")
}

/// A Debian cloud kernel bzImage: `HEARTH_VMLINUZ`, the images directory's `vmlinuz`, or (once, cached in
/// the cargo target's temp dir) the one from the package `linux-image-cloud-amd64` depends on.
pub fn debian_vmlinuz() -> PathBuf {
    if let Some(path) = std::env::var_os("HEARTH_VMLINUZ") {
        return PathBuf::from(path);
    }
    let dir = std::env::var_os("HEARTH_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/hearth/images"));
    if dir.join("vmlinuz").is_file() {
        return dir.join("vmlinuz");
    }
    let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("firecracker-images");
    std::fs::create_dir_all(&cache).expect("cache dir");
    let lock = std::fs::File::create(cache.join(".lock")).expect("lock file");
    lock.lock().expect("lock");
    debian_vmlinuz_locked(&cache)
}

/// [`debian_vmlinuz`] with the cache lock held by the caller.
fn debian_vmlinuz_locked(dir: &Path) -> PathBuf {
    if let Some(path) = std::env::var_os("HEARTH_VMLINUZ") {
        return PathBuf::from(path);
    }
    let cached = dir.join("vmlinuz");
    if cached.is_file() {
        return cached;
    }
    let deps = stdout(Command::new("apt-cache").args(["depends", "linux-image-cloud-amd64"]));
    let pkg = deps
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Depends: "))
        .find(|p| p.starts_with("linux-image-"))
        .unwrap_or_else(|| panic!("no kernel dependency in: {deps}"))
        .to_string();
    let deb_dir = dir.join("deb");
    let _ = std::fs::remove_dir_all(&deb_dir);
    std::fs::create_dir_all(&deb_dir).expect("deb dir");
    run(Command::new("apt-get")
        .arg("download")
        .arg(&pkg)
        .current_dir(&deb_dir));
    let deb = std::fs::read_dir(&deb_dir)
        .expect("deb dir")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .expect("downloaded .deb");
    let root = deb_dir.join("x");
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root));
    let vmlinuz = std::fs::read_dir(root.join("boot"))
        .expect("boot dir in the package")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-"))
        })
        .expect("vmlinuz in the package");
    std::fs::rename(&vmlinuz, &cached).expect("keep vmlinuz");
    // The rest of the package (modules) is not needed.
    let _ = std::fs::remove_dir_all(&deb_dir);
    cached
}

/// A sandbox directory (disk + run files, as the daemon lays it out) in a temp dir, with an id of its own
/// (tests run in parallel, and a jailed VM's cgroup is named after its id).
pub struct Sandbox {
    pub tmp: tempfile::TempDir,
    pub dir: PathBuf,
    pub id: String,
}

impl Sandbox {
    pub fn new() -> Self {
        use std::sync::atomic::{AtomicU32, Ordering};
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or_default();
        let id = format!(
            "sbx_{:08x}{:04x}{:04x}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed) & 0xffff,
            nanos & 0xffff
        );
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join(&id);
        std::fs::create_dir(&dir).expect("sandbox dir");
        Self { tmp, dir, id }
    }

    /// The id Firecracker and the jailer see.
    pub fn instance_id(&self) -> String {
        FirecrackerVmm::instance_id(&self.id)
    }

    pub fn spec(&self, images: &Images, disk: PathBuf) -> VmSpec {
        VmSpec {
            id: self.id.clone(),
            vcpus: 1,
            memory_mib: MEM_MIB,
            images: images.boot(),
            disk,
            run_dir: self.dir.clone(),
            hostname: "fc-test".into(),
            net: None,
        }
    }

    /// Names in the sandbox directory, sorted.
    pub fn entries(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.dir)
            .expect("read sandbox dir")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

/// Kills the VM on drop if it is still running (a failing assertion must not leak a Firecracker).
pub struct KillOnDrop(pub VmHandle);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if hearth_vmm::process_start_ticks(self.0.pid) == Some(self.0.start_ticks) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.0.pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// True if the process runs: not a zombie, or a zombie thread-group leader whose other threads still run.
pub fn running(pid: u32, start_ticks: u64) -> bool {
    if hearth_vmm::process_start_ticks(pid) != Some(start_ticks) {
        return false;
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let state = stat
        .rfind(')')
        .and_then(|i| stat.get(i + 2..i + 3))
        .unwrap_or("Z");
    let threads = std::fs::read_dir(format!("/proc/{pid}/task")).map_or(0, |d| d.count());
    (state != "Z" && state != "X") || threads > 1
}

/// Live (non-zombie) processes whose command line or chroot mentions `needle`.
pub fn processes_mentioning(needle: &Path) -> Vec<u32> {
    let needle = needle.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").filter_map(|e| e.ok()) {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let cwd = std::fs::read_link(format!("/proc/{pid}/cwd")).unwrap_or_default();
        let mentions = cmdline.contains(&needle) || cwd.to_string_lossy().contains(&needle);
        if mentions
            && pid != std::process::id()
            && hearth_vmm::process_start_ticks(pid).is_some_and(|t| running(pid, t))
        {
            found.push(pid);
        }
    }
    found
}

/// Seccomp mode of every thread of `pid` (2 = filter).
pub fn seccomp_modes(pid: u32) -> Vec<(String, u32)> {
    let mut modes = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("tasks")
        .filter_map(|e| e.ok())
    {
        let status = std::fs::read_to_string(task.path().join("status")).unwrap_or_default();
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let mode = status
            .lines()
            .find_map(|l| l.strip_prefix("Seccomp:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        modes.push((comm.trim().to_string(), mode));
    }
    modes
}
