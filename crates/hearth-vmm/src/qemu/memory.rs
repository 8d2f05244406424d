//! Guest RAM in a file, and the machine features a snapshot must be restored with.
//!
//! A VM booted now keeps its RAM in `<run>/memory` (`memory-backend-file`, `share=on`): the guest's writes go
//! to that file's page cache, so a pause saves only device state (`x-ignore-shared`: the migration stream
//! names the RAM block but carries none of its pages, ~100 KB) and the file itself is the memory snapshot. A
//! resume maps the same file again and the guest faults pages in as it touches them: neither pause nor resume
//! reads or writes memory the guest does not use.
//!
//! Snapshots that must not change (checkpoints: fork bases, memory templates) get their own copy of the file,
//! taken while the source is stopped (a reflink where the file system has them, else the allocated extents).
//! VMs restored from one map it copy-on-write (`share=off`, opened read-only): pages they change become their
//! own anonymous memory, the file stays as it was, and any number of VMs share its page cache. Such a VM's RAM
//! is not in a file of its own, so its first pause writes the RAM into the migration stream (what it touched,
//! zero pages skipped) and its resume loads that into a fresh memory file; from then on it is like any other.
//!
//! Free page reporting (`virtio-balloon-device,free-page-reporting=on`) lets an idle guest hand memory it does
//! not use back: QEMU punches those pages out of the memory file, so neither host memory nor the snapshot keeps
//! them.
//!
//! A snapshot records the machine's features ([`SnapshotInfo::features`]); a restore rebuilds exactly that
//! machine, so snapshots from before a feature existed keep loading.

use std::path::{Path, PathBuf};

use crate::SnapshotInfo;

/// File name of a VM's own memory in its run directory and in a snapshot directory.
pub const MEMORY_FILE: &str = "memory";
/// Feature: RAM from a `memory-backend-file` (id `mem`).
pub const FEATURE_MEMFILE: &str = "memfile";
/// Feature: a virtio balloon with free page reporting.
pub const FEATURE_BALLOON: &str = "balloon";
/// The features of machines this driver builds for fresh boots.
pub fn current_features() -> Vec<String> {
    Machine::fresh(Path::new("")).features()
}

/// How a launch maps guest RAM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ram {
    /// Anonymous memory (machines from before `memfile`).
    Anonymous,
    /// The VM's own memory file, written by the guest (`share=on`).
    Own(PathBuf),
    /// A snapshot's memory file, mapped copy-on-write and never written (`share=off`, read-only open).
    Base(PathBuf),
}

/// The parts of a machine that differ between features and boots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    pub ram: Ram,
    pub balloon: bool,
}

impl Machine {
    /// A fresh boot: every current feature, RAM in `<run>/memory`.
    pub fn fresh(run_dir: &Path) -> Machine {
        Machine {
            ram: Ram::Own(run_dir.join(MEMORY_FILE)),
            balloon: true,
        }
    }

    /// The machine a snapshot was taken from, with RAM mapped as `ram` (when it had a memory file at all).
    pub fn of(info: &SnapshotInfo, ram: Ram) -> Machine {
        let has = |f: &str| info.features.iter().any(|x| x == f);
        Machine {
            ram: if has(FEATURE_MEMFILE) { ram } else { Ram::Anonymous },
            balloon: has(FEATURE_BALLOON),
        }
    }

    /// The feature names a snapshot of this machine records.
    pub fn features(&self) -> Vec<String> {
        let mut f = Vec::new();
        if self.ram != Ram::Anonymous {
            f.push(FEATURE_MEMFILE.to_string());
        }
        if self.balloon {
            f.push(FEATURE_BALLOON.to_string());
        }
        f
    }

    /// Whether migrations of this machine leave RAM out of the stream (it lives in a shared file).
    pub fn ram_in_file(&self) -> bool {
        matches!(self.ram, Ram::Own(_))
    }

    /// The `-M` suffix naming the memory backend, if any.
    pub fn machine_opt(&self) -> &'static str {
        if self.ram == Ram::Anonymous {
            ""
        } else {
            ",memory-backend=mem"
        }
    }

    /// `-object` arguments for the memory backend. `opt` escapes a path for a QEMU option value.
    pub fn backend_args(
        &self,
        memory_mib: u32,
        opt: impl Fn(&Path) -> Result<String, String>,
    ) -> Result<Vec<String>, String> {
        let (path, share) = match &self.ram {
            Ram::Anonymous => return Ok(Vec::new()),
            Ram::Own(p) => (p, "share=on"),
            // `readonly=on` opens the file read-only; `rom=off` keeps the guest's RAM writable (its writes go
            // to private copies of the pages).
            Ram::Base(p) => (p, "share=off,readonly=on,rom=off"),
        };
        Ok(vec![
            "-object".into(),
            format!(
                "memory-backend-file,id=mem,size={memory_mib}M,mem-path={},{share}",
                opt(path)?
            ),
        ])
    }

    /// Device arguments that go after every other device (so machines without them keep their layout).
    pub fn trailing_devices(&self) -> Vec<String> {
        if self.balloon {
            vec![
                "-device".into(),
                "virtio-balloon-device,free-page-reporting=on".into(),
            ]
        } else {
            Vec::new()
        }
    }
}
