//! Host memory of idle sandboxes: what one VMM holds at points in time after its first command, what that is
//! made of, and how many idle sandboxes fit in a GiB of host memory.
//!
//! QEMU keeps guest RAM in `<run>/memory`, a shared file mapping. Its PSS counts only the pages QEMU has mapped
//! since it started, so a resumed VM looks small while the file's page cache still holds what the guest
//! touched before. "Host memory" here is therefore the VMM's PSS without that mapping plus the pages of the
//! memory file resident in the page cache (`mincore`): guest memory, QEMU's own anonymous memory (under TCG
//! mostly its translated-code buffer) and its share of file pages every VMM maps (kernel image, QEMU and its
//! libraries), which PSS divides among the processes mapping them.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hearth_api::{CreateSandboxRequest, RunCommandRequest};
use hearth_client::Client;

use crate::daemon;
use crate::stats::Row;

/// The memory one VMM process holds, KiB.
#[derive(Debug, Clone, Copy, Default)]
pub struct VmmMemory {
    /// PSS of the whole process, as `smaps_rollup` reports it.
    pub pss: u64,
    /// PSS of the guest memory file's mapping.
    pub memfile_mapped: u64,
    /// Pages of the guest memory file in the page cache, mapped or not.
    pub memfile_resident: u64,
    /// Anonymous memory outside guest RAM (QEMU's heap, stacks, TCG code buffer).
    pub anon: u64,
    /// PSS of file mappings other than guest RAM (kernel image, binaries, libraries: shared by every VMM).
    pub shared_files: u64,
}

impl VmmMemory {
    /// What the sandbox costs the host: PSS with guest RAM counted as its resident page cache.
    pub fn host(&self) -> u64 {
        self.pss - self.memfile_mapped + self.memfile_resident
    }
}

/// Reads the memory of the VMM serving sandbox `id`; `None` when there is no such process.
pub fn vmm_memory(id: &str) -> Option<VmmMemory> {
    let pid = daemon::vmm_pid(id)?;
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let mut m = VmmMemory::default();
    let mut memfile: Option<String> = None;
    // What the current mapping is: guest RAM, another file, or anonymous.
    let mut kind = Kind::Anon;
    for line in smaps.lines() {
        if let Some(name) = mapping_name(line) {
            kind = match name {
                Some(n) if is_memory_file(n, id) => {
                    memfile = Some(n.to_owned());
                    Kind::Memfile
                }
                Some(n) if n.starts_with('/') => Kind::File,
                _ => Kind::Anon,
            };
            continue;
        }
        let kib = |key: &str| {
            line.strip_prefix(key)
                .and_then(|v| v.split_whitespace().next())
                .and_then(|v| v.parse::<u64>().ok())
        };
        if let Some(v) = kib("Pss:") {
            m.pss += v;
            match kind {
                Kind::Memfile => m.memfile_mapped += v,
                Kind::File => m.shared_files += v,
                Kind::Anon => {}
            }
        } else if let Some(v) = kib("Anonymous:")
            && kind != Kind::Memfile
        {
            m.anon += v;
        }
    }
    if let Some(path) = memfile {
        m.memfile_resident = resident_kib(Path::new(&path)).unwrap_or(m.memfile_mapped);
    }
    Some(m)
}

/// The guest memory file the VMM serving sandbox `id` maps (`<run>/memory`), from its `/proc/PID/maps`.
pub fn memory_file(id: &str) -> Option<String> {
    let pid = daemon::vmm_pid(id)?;
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines()
        .filter_map(|l| mapping_name(l).flatten())
        .find(|n| is_memory_file(n, id))
        .map(str::to_owned)
}

/// Whether a mapping's file name is the guest memory file of sandbox `id` (`<run>/memory`).
fn is_memory_file(name: &str, id: &str) -> bool {
    name.ends_with("/memory") && name.contains(id)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Memfile,
    File,
    Anon,
}

/// For a mapping's header line of `smaps` (`start-end perms offset dev inode [name]`), its name (`None` for an
/// anonymous mapping); `None` for the other lines.
fn mapping_name(line: &str) -> Option<Option<&str>> {
    let mut parts = line.splitn(6, ' ');
    let range = parts.next()?;
    let (a, b) = range.split_once('-')?;
    if a.is_empty() || !a.bytes().chain(b.bytes()).all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    let name = parts.nth(4).map(str::trim).filter(|n| !n.is_empty());
    Some(name)
}

/// KiB of `path` resident in the page cache.
fn resident_kib(path: &Path) -> Option<u64> {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).ok()?;
    let len = usize::try_from(file.metadata().ok()?.len()).ok()?;
    if len == 0 {
        return Some(0);
    }
    // SAFETY: a read-only shared mapping of a file we hold open; it is only passed to mincore (never read) and
    // unmapped below.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if addr == libc::MAP_FAILED {
        return None;
    }
    let page = 4096usize;
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `addr..addr+len` is the mapping made above; `vec` has one byte per page of it.
    let rc = unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) };
    // SAFETY: unmaps exactly the mapping made above, which nothing else refers to.
    unsafe { libc::munmap(addr, len) };
    (rc == 0).then(|| vec.iter().filter(|b| *b & 1 == 1).count() as u64 * (page as u64 / 1024))
}

/// Samples [`vmm_memory`] of sandbox `id` at each of `at` after `since`.
pub async fn samples_at(id: &str, since: Instant, at: &[Duration]) -> Vec<Option<VmmMemory>> {
    let mut out = Vec::new();
    for t in at {
        if let Some(wait) = t.checked_sub(since.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        out.push(vmm_memory(id));
    }
    out
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Rows for the samples of one sandbox taken at `at` after its first command (`label` names the setup).
pub fn time_rows(label: &str, at: &[Duration], samples: &[Option<VmmMemory>], guest_mib: u32) -> Vec<Row> {
    let mut rows = Vec::new();
    for (t, s) in at.iter().zip(samples) {
        rows.push(Row::value(
            &format!(
                "{label}host memory of an idle sandbox, {} s after its last command (VMM PSS; host)",
                t.as_secs()
            ),
            match s {
                Some(m) => format!(
                    "{:.1} MiB; {:.1} MiB (guest {guest_mib} MiB)",
                    mib(m.pss),
                    mib(m.host())
                ),
                None => "n/a (VMM process not found)".to_owned(),
            },
        ));
    }
    if let Some(Some(m)) = samples.last() {
        rows.push(Row::value(
            &format!("{label}  of which guest RAM resident / QEMU anonymous / shared files (PSS)"),
            format!(
                "{:.1} / {:.1} / {:.1} MiB",
                mib(m.memfile_resident),
                mib(m.anon),
                mib(m.shared_files)
            ),
        ));
    }
    rows
}

/// `--only-idle` options.
pub struct IdleArgs {
    pub template: String,
    pub memory_mib: u32,
    /// Idle sandboxes kept at once for the density rows.
    pub sandboxes: usize,
    /// Points in time after the first command at which the first sandbox is sampled.
    pub at: Vec<Duration>,
}

/// Creates `args.sandboxes` sandboxes one after another, runs `true` in each, samples the first at `args.at`,
/// then, `args.at`'s last point after the last one's first command, sums the host memory of all of them.
/// Deletes them afterwards.
pub async fn rows(client: &Client, args: &IdleArgs, label: &str) -> Result<Vec<Row>> {
    let req = CreateSandboxRequest {
        template: Some(args.template.clone()),
        vcpus: Some(1),
        memory_mib: Some(args.memory_mib),
        timeout_s: Some(900),
        metadata: [("bench".to_owned(), "hearth-bench".to_owned())].into(),
        ..Default::default()
    };
    let mut ids = Vec::new();
    let result = async {
        let mut last_cmd = Instant::now();
        let mut samples = Vec::new();
        for i in 0..args.sandboxes.max(1) {
            let sbx = client.create_sandbox(&req).await.context("create sandbox")?;
            ids.push(sbx.id.clone());
            let res = client
                .run_command(
                    &sbx.id,
                    &RunCommandRequest {
                        argv: Some(vec!["true".to_owned()]),
                        ..Default::default()
                    },
                )
                .await
                .context("first command")?;
            anyhow::ensure!(res.exit_code == 0, "first command exited {}", res.exit_code);
            last_cmd = Instant::now();
            if i == 0 {
                samples = samples_at(&sbx.id, last_cmd, &args.at).await;
            }
        }
        let settle = args.at.last().copied().unwrap_or_default();
        if let Some(wait) = settle.checked_sub(last_cmd.elapsed()) {
            tokio::time::sleep(wait).await;
        }
        let all: Vec<VmmMemory> = ids.iter().filter_map(|id| vmm_memory(id)).collect();
        anyhow::ensure!(
            all.len() == ids.len(),
            "a VMM process of the idle sandboxes is missing"
        );
        anyhow::Ok((samples, all))
    }
    .await;
    for id in &ids {
        let _ = client.delete_sandbox(id).await;
    }
    let (samples, all) = result?;
    let mut rows = time_rows(label, &args.at, &samples, args.memory_mib);
    let n = all.len() as f64;
    let host = all.iter().map(VmmMemory::host).sum::<u64>() as f64 / n;
    let pss = all.iter().map(|m| m.pss).sum::<u64>() as f64 / n;
    rows.push(Row::value(
        &format!(
            "{label}{} idle sandboxes at once: host memory per sandbox (VMM PSS; host)",
            all.len()
        ),
        format!("{:.1} MiB; {:.1} MiB", pss / 1024.0, host / 1024.0),
    ));
    rows.push(Row::value(
        &format!(
            "{label}idle sandboxes per GiB of host memory ({} at once)",
            all.len()
        ),
        format!("{:.1}", 1024.0 * 1024.0 / host.max(1.0)),
    ));
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smaps_headers_name_their_mapping() {
        let memfile = "7fe5e7fff000-7fe5f7fff000 rw-s 00000000 fe:00 2179089                    /d/sandboxes/sbx_1/memory";
        assert_eq!(mapping_name(memfile), Some(Some("/d/sandboxes/sbx_1/memory")));
        assert_eq!(
            mapping_name("7f0000000000-7f0040000000 rwxp 00000000 00:00 0 "),
            Some(None)
        );
        assert_eq!(
            mapping_name("55d0c0000000-55d0c0a00000 rw-p 00000000 00:00 0                          [heap]"),
            Some(Some("[heap]"))
        );
        // Field lines of a mapping are not headers.
        assert_eq!(mapping_name("Pss:              100448 kB"), None);
        assert_eq!(mapping_name("VmFlags: rd wr sh mr mw me ms dc hg"), None);
    }

    #[test]
    fn host_memory_counts_guest_ram_as_resident_page_cache() {
        let m = VmmMemory {
            pss: 240 * 1024,
            memfile_mapped: 100 * 1024,
            memfile_resident: 108 * 1024,
            anon: 83 * 1024,
            shared_files: 57 * 1024,
        };
        assert_eq!(m.host(), 248 * 1024);
    }

    #[test]
    fn resident_pages_of_a_file_are_counted() {
        use std::io::Write;
        let mut f = tempfile::NamedTempFile::new().expect("temp file");
        f.write_all(&vec![1u8; 64 * 1024]).expect("write");
        f.flush().expect("flush");
        // Just written: in the page cache.
        assert_eq!(resident_kib(f.path()), Some(64));
        let empty = tempfile::NamedTempFile::new().expect("temp file");
        assert_eq!(resident_kib(empty.path()), Some(0));
    }
}
