//! Admission: whether a VM fits next to the ones this host already runs, decided atomically.
//!
//! Memory is not overcommitted: the sum of the guest memory of every sandbox holding a VM (creating, running,
//! pausing, resuming) stays within the host's memory less a reserve for the host and the VMM processes. vCPUs
//! are overcommitted up to [`VCPU_OVERCOMMIT`] per host CPU (agents mostly wait; each VMM's CPU use is bounded
//! by its own cgroup). A decision and the reservation it makes happen under one lock, and the reservation is
//! held until the sandbox's row holds the VM in the database, so parallel creates and resumes cannot pass the
//! last slot together.

use std::sync::Mutex;

use super::ServiceError;
use super::lifecycle::holds_vm;

/// vCPUs of running sandboxes per host CPU.
pub const VCPU_OVERCOMMIT: u64 = 8;

/// What admitted requests reserved and have not recorded in the database yet.
#[derive(Debug, Default)]
pub struct Pending {
    memory_mib: u64,
    vcpus: u64,
}

/// A reservation; released when dropped (after the row that holds the VM is written).
pub struct Admission<'a> {
    pending: &'a Mutex<Pending>,
    memory_mib: u64,
    vcpus: u64,
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        p.memory_mib = p.memory_mib.saturating_sub(self.memory_mib);
        p.vcpus = p.vcpus.saturating_sub(self.vcpus);
    }
}

/// The host's capacity.
#[derive(Debug, Clone, Copy)]
pub struct Host {
    pub memory_mib: u64,
    pub cpus: u64,
}

impl Host {
    pub fn probe() -> Host {
        Host {
            memory_mib: host_memory_mib(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        }
    }

    /// Memory VMs may use: the host less a tenth of it (at least 512 MiB) for the host and the VMMs.
    pub fn usable_memory_mib(&self) -> u64 {
        self.memory_mib - (self.memory_mib / 10).max(512).min(self.memory_mib)
    }
}

impl super::Sandboxes {
    /// Admits a VM of `vcpus` and `memory_mib`, or refuses it with `capacity_exceeded` naming what is short.
    pub(crate) fn admit(&self, vcpus: u32, memory_mib: u32) -> Result<Admission<'_>, ServiceError> {
        let host = self.host;
        let (memory_mib, vcpus) = (u64::from(memory_mib), u64::from(vcpus));
        let mut pending = self.admission.lock().unwrap_or_else(|e| e.into_inner());
        let rows = self.db.list()?;
        let held = rows.iter().filter(|r| holds_vm(r.state));
        let (mem_used, cpu_used) = held.fold((pending.memory_mib, pending.vcpus), |(m, c), r| {
            (m + u64::from(r.memory_mib), c + u64::from(r.vcpus))
        });
        if host.memory_mib > 0 {
            let usable = host.usable_memory_mib();
            if mem_used + memory_mib > usable {
                return Err(ServiceError::CapacityExceeded(format!(
                    "{memory_mib} MiB requested, {mem_used} of {usable} MiB already allocated"
                )));
            }
        }
        let max_vcpus = host.cpus * VCPU_OVERCOMMIT;
        if cpu_used + vcpus > max_vcpus {
            return Err(ServiceError::CapacityExceeded(format!(
                "{vcpus} vCPUs requested, {cpu_used} of {max_vcpus} allocated ({} host CPUs x {VCPU_OVERCOMMIT})",
                host.cpus
            )));
        }
        pending.memory_mib += memory_mib;
        pending.vcpus += vcpus;
        Ok(Admission {
            pending: &self.admission,
            memory_mib,
            vcpus,
        })
    }
}

fn host_memory_mib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map(|kib| kib / 1024)
        .unwrap_or(0)
}
