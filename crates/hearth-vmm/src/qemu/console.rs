//! The guest's serial console, kept in a bounded log file.
//!
//! The guest writes whatever it wants to its serial port, as fast as it can. QEMU's `file` chardev would
//! grow `console.log` without limit on the host, so QEMU serves the console on a Unix socket instead and a
//! pump thread copies it into `console.log`, keeping only the last [`CONSOLE_MAX`] bytes. While nobody is
//! connected (for example while the daemon restarts) QEMU discards console output, so a flood cannot fill
//! the host disk either way.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};

/// Most bytes `console.log` holds; beyond that the older half is dropped.
pub const CONSOLE_MAX: u64 = 1024 * 1024;

const TRUNCATED: &[u8] = b"\n[hearth: older console output dropped]\n";

/// An append-only file that keeps its newest bytes under a size cap.
pub struct BoundedLog {
    file: File,
    size: u64,
    max: u64,
}

impl BoundedLog {
    /// Opens (creating it if needed) `path` for appending.
    pub fn open(path: &Path, max: u64) -> std::io::Result<Self> {
        let file = File::options().create(true).append(true).read(true).open(path)?;
        let size = file.metadata()?.len();
        let mut log = BoundedLog { file, size, max };
        if log.size > log.max {
            log.compact()?;
        }
        Ok(log)
    }

    pub fn write(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.file.write_all(data)?;
        self.size += data.len() as u64;
        if self.size > self.max {
            self.compact()?;
        }
        Ok(())
    }

    /// Keeps the newest half of the cap, behind a marker line.
    fn compact(&mut self) -> std::io::Result<()> {
        let keep = self.max / 2;
        self.file.seek(SeekFrom::Start(self.size.saturating_sub(keep)))?;
        let mut tail = Vec::with_capacity(keep as usize);
        (&mut self.file).take(keep).read_to_end(&mut tail)?;
        self.file.set_len(0)?;
        // O_APPEND: writes land at the (new) end whatever the cursor.
        self.file.write_all(TRUNCATED)?;
        self.file.write_all(&tail)?;
        self.size = (TRUNCATED.len() + tail.len()) as u64;
        Ok(())
    }
}

/// Connects to QEMU's console socket now (so no output is lost after the caller resumes the guest) and copies
/// it into `log` on a thread until QEMU closes the socket. `on_exit` runs when the thread ends.
pub fn spawn_pump(sock: &Path, log: PathBuf, on_exit: impl FnOnce() + Send + 'static) -> std::io::Result<()> {
    let mut stream = UnixStream::connect(sock)?;
    let mut out = BoundedLog::open(&log, CONSOLE_MAX)?;
    let name = format!(
        "console-{}",
        sock.parent()
            .and_then(|p| p.file_name())
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    );
    std::thread::Builder::new().name(name).spawn(move || {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    if let Err(e) = out.write(&buf[..n]) {
                        tracing::warn!(log = %log.display(), "console log: {e}");
                        break;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        on_exit();
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_keeps_the_newest_bytes_under_the_cap() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        let mut log = BoundedLog::open(&path, 1000).expect("open");
        for i in 0..500u32 {
            log.write(format!("line {i:05}\n").as_bytes()).expect("write");
        }
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.len() as u64 <= 1000, "{} bytes", text.len());
        assert!(
            text.starts_with("\n[hearth: older console output dropped]"),
            "{text}"
        );
        assert!(text.ends_with("line 00499\n"), "{text}");
        assert!(!text.contains("line 00000"));
    }

    #[test]
    fn reopening_an_oversized_log_compacts_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("console.log");
        std::fs::write(&path, vec![b'x'; 5000]).expect("write");
        let mut log = BoundedLog::open(&path, 1000).expect("open");
        log.write(b"end").expect("write");
        let len = std::fs::metadata(&path).expect("stat").len();
        assert!(len <= 1000, "{len}");
    }

    #[test]
    fn pump_copies_until_the_peer_closes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("console.sock");
        let log = dir.path().join("console.log");
        let listener = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        spawn_pump(&sock, log.clone(), move || {
            let _ = done_tx.send(());
        })
        .expect("pump");
        let (mut peer, _) = listener.accept().expect("accept");
        peer.write_all(b"hearth-init: started\n").expect("write");
        drop(peer);
        done_rx
            .recv_timeout(std::time::Duration::from_secs(5))
            .expect("pump ended");
        assert_eq!(
            std::fs::read_to_string(&log).expect("log"),
            "hearth-init: started\n"
        );
    }
}
