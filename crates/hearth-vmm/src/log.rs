//! The tail of a VMM's log file for error messages: the VMM's own last words when it failed to start or exited
//! under a running sandbox.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// How much of the end of a log an error message carries.
const TAIL: u64 = 2048;

/// The last ~2 KiB of the log at `path`. Only the tail is read (the log may be huge), and control characters
/// are replaced (a guest's serial output can be in there).
pub fn tail(path: &Path) -> String {
    let Ok(bytes) = last_bytes(path, TAIL) else {
        return "(no log)".into();
    };
    let text: String = String::from_utf8_lossy(&bytes)
        .chars()
        .filter(|c| *c != '\r')
        .map(|c| {
            if c.is_control() && c != '\n' && c != '\t' {
                '?'
            } else {
                c
            }
        })
        .collect();
    let text = text.trim();
    if text.is_empty() {
        "(empty log)".into()
    } else {
        text.to_string()
    }
}

/// At most the last `max` bytes of the file at `path`, whatever its size (a file another party writes, such as a
/// guest's console, can grow while it is read: what was there at the `stat` bounds the read).
pub fn last_bytes(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    let start = len.saturating_sub(max);
    file.seek(SeekFrom::Start(start))?;
    let mut bytes = Vec::with_capacity((len - start) as usize);
    file.take(max).read_to_end(&mut bytes)?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_is_bounded_and_printable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let log = dir.path().join("log");
        let mut content = vec![b'x'; 100_000];
        content.extend_from_slice(b"\x1b[2Jlast line\r\n");
        std::fs::write(&log, &content).expect("write");
        let tail = tail(&log);
        assert!(tail.len() <= 2048);
        assert!(tail.ends_with("?[2Jlast line"), "{tail:?}");
        assert_eq!(super::tail(&dir.path().join("absent")), "(no log)");
        std::fs::write(&log, "\n \n").expect("write");
        assert_eq!(super::tail(&log), "(empty log)");
    }

    #[test]
    fn last_bytes_reads_only_the_end() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        std::fs::write(&file, b"0123456789").expect("write");
        assert_eq!(last_bytes(&file, 4).expect("read"), b"6789");
        assert_eq!(last_bytes(&file, 100).expect("read"), b"0123456789");
        assert!(last_bytes(&dir.path().join("absent"), 4).is_err());
    }
}
