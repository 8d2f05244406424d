//! The daemon under measurement: a private one on a temporary data dir (default), or an external one.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use hearth_client::Client;

pub struct Daemon {
    pub client: Client,
    child: Option<Child>,
    _data: Option<tempfile::TempDir>,
}

impl Daemon {
    pub fn external() -> Result<Daemon> {
        Ok(Daemon {
            client: Client::from_env()?,
            child: None,
            _data: None,
        })
    }

    /// The private daemon's data directory (None for an external daemon).
    pub fn data_dir(&self) -> Option<&std::path::Path> {
        self._data.as_ref().map(|d| d.path())
    }

    /// Starts `hearthd --listen 127.0.0.1:0 FLAGS...` on a fresh data dir and waits until it answers.
    pub async fn spawn(bin: Option<PathBuf>, flags: &[String]) -> Result<Daemon> {
        Daemon::spawn_env(bin, flags, &[]).await
    }

    /// [`Daemon::spawn`] with extra environment variables (e.g. the storage bucket's `AWS_*`).
    pub async fn spawn_env(
        bin: Option<PathBuf>,
        flags: &[String],
        env: &[(String, String)],
    ) -> Result<Daemon> {
        let bin = match bin {
            Some(b) => b,
            None => std::env::current_exe()?.with_file_name("hearthd"),
        };
        let data = tempfile::Builder::new().prefix("hearth-bench-").tempdir()?;
        // The images of `env` (an A/B of two image sets), else this process's, else the default.
        let images = env
            .iter()
            .find(|(k, _)| k == "HEARTH_IMAGES")
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var("HEARTH_IMAGES").ok())
            .unwrap_or_else(|| "/var/lib/hearth/images".to_owned());
        let log = std::fs::File::create(data.path().join("hearthd.log"))?;
        let child = Command::new(&bin)
            .arg("--data-dir")
            .arg(data.path())
            .arg("--images-dir")
            .arg(&images)
            .arg("--listen")
            .arg("127.0.0.1:0")
            .args(flags)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {}", bin.display()))?;
        let addr_file = data.path().join("listen-addr");
        let deadline = Instant::now() + Duration::from_secs(30);
        let addr = loop {
            if let Ok(a) = std::fs::read_to_string(&addr_file)
                && !a.trim().is_empty()
            {
                break a.trim().to_owned();
            }
            if Instant::now() > deadline {
                bail!("hearthd did not write {} within 30 s", addr_file.display());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let key = std::fs::read_to_string(data.path().join("api-key"))?;
        let client = Client::new(&format!("http://{addr}"), key.trim())?;
        client.health().await?;
        Ok(Daemon {
            client,
            child: Some(child),
            _data: Some(data),
        })
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        // A private daemon leaves VMs running on purpose (adoption); the bench deleted its sandboxes, but kill
        // any VMM whose files live under our temporary data dir in case a delete failed.
        if let Some(data) = &self._data {
            let marker = data.path().to_string_lossy().into_owned();
            for pid in pids_with_cmdline(&marker) {
                let _ = Command::new("kill").arg("-9").arg(pid.to_string()).status();
            }
        }
    }
}

/// Pids whose command line contains `needle`.
fn pids_with_cmdline(needle: &str) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        if pid == std::process::id() {
            continue;
        }
        if let Ok(cmd) = std::fs::read(format!("/proc/{pid}/cmdline"))
            && String::from_utf8_lossy(&cmd).contains(needle)
        {
            out.push(pid);
        }
    }
    out
}

/// Proportional set size (KiB) of the VMM process serving sandbox `id` (its command line names the sandbox's
/// run directory).
pub fn vmm_pss_kib(id: &str) -> Option<u64> {
    let pid = vmm_pid(id)?;
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    rollup
        .lines()
        .find(|l| l.starts_with("Pss:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The VMM process serving sandbox `id` (its command line names the sandbox's run directory).
pub fn vmm_pid(id: &str) -> Option<u32> {
    pids_with_cmdline(id).into_iter().find(|pid| {
        std::fs::read_link(format!("/proc/{pid}/exe"))
            .map(|p| {
                let s = p.to_string_lossy();
                s.contains("qemu") || s.contains("firecracker")
            })
            .unwrap_or(false)
    })
}
