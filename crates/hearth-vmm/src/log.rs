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
    let read_tail = || -> std::io::Result<Vec<u8>> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(TAIL)))?;
        let mut bytes = Vec::with_capacity(TAIL as usize);
        file.take(TAIL).read_to_end(&mut bytes)?;
        Ok(bytes)
    };
    let Ok(bytes) = read_tail() else {
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
}
