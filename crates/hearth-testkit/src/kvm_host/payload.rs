//! The run disk of one KVM test host: an ext4 image made fresh for every boot (`mkfs.ext4 -d`) holding this
//! build's binaries, the guest images and the test's own files, with room for hearthd's data beside them.
//!
//! ```text
//! /hearth/bin/          hearthd, hearth, hearth-agent (this build)
//! /hearth/firecracker/  firecracker, jailer (+ their LICENSE), when the host is to have them
//! /hearth/images/       vmlinux, vmlinuz, initramfs.cpio.gz, manifest.json, rootfs/<template>.ext4
//! /hearth/files/        what the test added (e.g. test binaries)
//! /hearth/tmp/          TMPDIR of commands run in L1 (same file system as the images: hard links work)
//! /hearth/data/         hearthd's data directory
//! ```
//! Files are hard-linked into the staging directory when they can be (no copy on the host); `mkfs.ext4 -d`
//! then copies them into the image, keeping holes (a 256 MiB sparse template costs what it holds). Debug
//! builds of hearth's binaries and tests are mostly DWARF (75 MB a test binary, 9 MB without): they are staged
//! stripped of it (`objcopy --strip-debug`, symbols kept for backtraces), which keeps a boot's disk seconds
//! to make.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The file system label L1 mounts the run disk by.
pub const LABEL: &str = "hearth-run";
/// Where L1 mounts the run disk.
pub const MOUNT: &str = "/hearth";

/// What goes onto the run disk.
#[derive(Debug, Default)]
pub struct Payload {
    /// `(host file, path below the disk's root, strip its debug info)`.
    files: Vec<(PathBuf, String, bool)>,
}

impl Payload {
    pub fn add(&mut self, host: impl Into<PathBuf>, dest: impl Into<String>) {
        self.files.push((host.into(), dest.into(), false));
    }

    /// A program of this build, staged without its debug info.
    pub fn add_program(&mut self, host: impl Into<PathBuf>, dest: impl Into<String>) {
        self.files.push((host.into(), dest.into(), true));
    }

    /// Stages the files under `stage` and writes the image `disk` of `size_gib` (sparse).
    pub fn write(&self, stage: &Path, disk: &Path, size_gib: u64) {
        for dir in ["bin", "images/rootfs", "files", "tmp", "data"] {
            std::fs::create_dir_all(stage.join(dir)).expect("staging directory");
        }
        for (host, dest, strip) in &self.files {
            let target = stage.join(dest.trim_start_matches('/'));
            if let Some(parent) = target.parent() {
                std::fs::create_dir_all(parent).expect("staging directory");
            }
            // The resolved file: rootfs/<name>.ext4 are symlinks to versioned images.
            let real = std::fs::canonicalize(host)
                .unwrap_or_else(|e| panic!("{} (for the KVM test host): {e}", host.display()));
            if *strip && strip_debug(&real, &target) {
                continue;
            }
            if std::fs::hard_link(&real, &target).is_err() {
                std::fs::copy(&real, &target)
                    .unwrap_or_else(|e| panic!("copying {} into the run disk: {e}", real.display()));
            }
        }
        let tmp = stage.join("tmp");
        std::fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
            .expect("chmod tmp");
        let file = std::fs::File::create(disk).expect("the run disk");
        file.set_len(size_gib << 30).expect("sizing the run disk");
        drop(file);
        let out = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-L", LABEL, "-E", "root_owner=0:0", "-d"])
            .arg(stage)
            .arg(disk)
            .output()
            .expect("mkfs.ext4 runs (apt-get install e2fsprogs)");
        assert!(
            out.status.success(),
            "mkfs.ext4 -d {}: {}",
            stage.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// `objcopy --strip-debug src dest`; false (nothing staged) when objcopy is missing or fails.
fn strip_debug(src: &Path, dest: &Path) -> bool {
    let ok = Command::new("objcopy")
        .arg("--strip-debug")
        .arg(src)
        .arg(dest)
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let _ = std::fs::remove_file(dest);
    }
    ok
}
