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
//! A warm create's VM, restored from a boot snapshot to live on as a booted one would (`Vmm::restore_as_own`),
//! gets a copy of the snapshot's memory file as its own instead (a reflink, else the file's data extents): the
//! restore pays for the copy, and its first pause is a flush like a booted VM's.
//!
//! Free page reporting (`virtio-balloon-device,free-page-reporting=on`) lets an idle guest hand memory it does
//! not use back: QEMU punches those pages out of the memory file, so neither host memory nor the snapshot keeps
//! them. The guest reports free blocks of 2 MiB and more (pageblock order 9), two seconds after they were
//! freed; by the agent's handshake a booted `minimal` guest of 256 MiB has reported all of those and keeps
//! ~104 MiB of the file: its kernel image, slab, module code and free blocks smaller than 2 MiB (the Debian 6.1
//! kernel reports no smaller blocks even with `page_reporting.page_reporting_order` lowered). docs/benchmarks.md
//! ("Idle host memory") has the measurements.
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
/// Feature: the virtio-serial device has 2 ports (`max_ports=2`, id `serial`) instead of QEMU's 31. The guest
/// sets up a 1024-entry ring pair for every possible port (virtio-mmio offers 1024 entries): with 2 ports an
/// idle guest keeps 4 MiB less of its RAM (docs/benchmarks.md, "Idle host memory"). Port 0 stays reserved for
/// a console, the agent's port is 1.
pub const FEATURE_SERIAL2: &str = "serial2";
/// Stream format (not a machine feature): the snapshot's `vmstate` was written with QEMU's `mapped-ram`
/// migration capability, every RAM page at its fixed offset in the file (zero pages left as holes), so a restore
/// must read it with the same capability. Used for VMs whose RAM is a copy-on-write mapping of a base (restored
/// from a snapshot or a memory template): their pause carries the RAM, and at fixed offsets the pages they share
/// with the base land in the same places as in the base's memory file (QEMU aligns a RAM block's pages to
/// 1 MiB in the file), so the storage bucket's content-addressed chunks deduplicate them against the base and
/// against each other.
pub const FEATURE_MAPPED_RAM: &str = "mapped-ram";
/// The features of machines this driver builds for fresh boots.
pub fn current_features() -> Vec<String> {
    Machine::fresh(Path::new("")).features()
}

/// Whether `HEARTH_QEMU_FEATURES_OFF` (comma-separated feature names) turns `feature` off, so that a benchmark
/// can compare with and without it side by side. `balloon` and `serial2` change the machine of fresh boots
/// (snapshots record what their machine had, so restores are not affected); `small-pages`
/// ([`super::small_pages`]) applies to every QEMU launched.
pub(super) fn feature_off(feature: &str) -> bool {
    crate::feature_off("HEARTH_QEMU_FEATURES_OFF", feature)
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
    /// [`FEATURE_SERIAL2`].
    pub serial2: bool,
}

impl Machine {
    /// A fresh boot: every current feature, RAM in `<run>/memory`.
    pub fn fresh(run_dir: &Path) -> Machine {
        Machine {
            ram: Ram::Own(run_dir.join(MEMORY_FILE)),
            balloon: !feature_off(FEATURE_BALLOON),
            serial2: !feature_off(FEATURE_SERIAL2),
        }
    }

    /// The machine a snapshot was taken from, with RAM mapped as `ram` (when it had a memory file at all).
    pub fn of(info: &SnapshotInfo, ram: Ram) -> Machine {
        let has = |f: &str| info.features.iter().any(|x| x == f);
        Machine {
            ram: if has(FEATURE_MEMFILE) { ram } else { Ram::Anonymous },
            balloon: has(FEATURE_BALLOON),
            serial2: has(FEATURE_SERIAL2),
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
        if self.serial2 {
            f.push(FEATURE_SERIAL2.to_string());
        }
        f
    }

    /// The `-device` value of the agent's virtio-serial bus.
    pub fn serial_device(&self) -> &'static str {
        if self.serial2 {
            "virtio-serial-device,id=serial,max_ports=2"
        } else {
            "virtio-serial-device"
        }
    }

    /// Whether migrations of this machine leave RAM out of the stream (it lives in a shared file).
    pub fn ram_in_file(&self) -> bool {
        matches!(self.ram, Ram::Own(_))
    }

    /// Whether snapshots of this machine write RAM with `mapped-ram` ([`FEATURE_MAPPED_RAM`]).
    pub fn maps_ram_in_stream(&self) -> bool {
        matches!(self.ram, Ram::Base(_))
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

/// Extra guest kernel arguments from `HEARTH_GUEST_KERNEL_ARGS`, for operators and benchmarks that try guest
/// memory settings (e.g. `slub_max_order=0`) without a new build. Only plain `key=value` words are taken
/// (letters, digits and `_ . , = : / -`, at most 512 bytes in all); anything else is ignored with a warning.
pub fn extra_kernel_args() -> Option<&'static str> {
    static ARGS: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    ARGS.get_or_init(|| {
        let v = std::env::var("HEARTH_GUEST_KERNEL_ARGS").ok()?;
        let v = v.trim();
        if v.is_empty() {
            return None;
        }
        if !plain_kernel_args(v) {
            tracing::warn!(
                value = v,
                "HEARTH_GUEST_KERNEL_ARGS ignored: only plain key=value words are allowed"
            );
            return None;
        }
        Some(v.to_owned())
    })
    .as_deref()
}

/// Whether `v` is a short list of plain kernel command-line words.
fn plain_kernel_args(v: &str) -> bool {
    v.len() <= 512
        && v.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b" _.,=:/-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_kernel_words_pass() {
        assert!(plain_kernel_args("slub_max_order=0 init_on_alloc=0"));
        assert!(plain_kernel_args(
            "page_reporting.page_reporting_order=5 slub_debug=U,kmalloc-4k"
        ));
        // Quoting, new lines, shell or QEMU metacharacters, and very long values are refused.
        for bad in ["a=\"b c\"", "x=1\ny=2", "x=$(id)", "a;b", "init=/bin/sh\0"] {
            assert!(!plain_kernel_args(bad), "{bad:?}");
        }
        assert!(!plain_kernel_args(&"a".repeat(513)));
    }

    fn info(features: &[&str]) -> SnapshotInfo {
        SnapshotInfo {
            kind: crate::VmmKind::Qemu,
            vmm_version: "QEMU 10.0.2".into(),
            files: Vec::new(),
            disk: None,
            disk_format: None,
            memory_mib: 256,
            vcpus: 1,
            memory_file: None,
            features: features.iter().map(|f| f.to_string()).collect(),
        }
    }

    #[test]
    fn a_restore_builds_the_serial_bus_its_snapshot_had() {
        let ram = || Ram::Own(PathBuf::from("/r/memory"));
        // Snapshots from before `serial2` get QEMU's default bus of 31 ports back (the migration stream has it).
        let old = Machine::of(&info(&[FEATURE_MEMFILE, FEATURE_BALLOON]), ram());
        assert_eq!(old.serial_device(), "virtio-serial-device");
        assert_eq!(old.features(), [FEATURE_MEMFILE, FEATURE_BALLOON]);
        let new = Machine::of(&info(&[FEATURE_MEMFILE, FEATURE_BALLOON, FEATURE_SERIAL2]), ram());
        assert_eq!(new.serial_device(), "virtio-serial-device,id=serial,max_ports=2");
        assert_eq!(
            new.features(),
            [FEATURE_MEMFILE, FEATURE_BALLOON, FEATURE_SERIAL2]
        );
    }
}
