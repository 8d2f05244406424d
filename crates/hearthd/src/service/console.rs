//! A VM's console log as error messages quote it: the last lines, made printable (the guest writes it).

use std::path::Path;

use super::clip;

/// The last lines of a VM's console log, made printable (the guest writes it: untrusted).
pub fn console_tail(run_dir: &Path) -> Option<String> {
    let buf = hearth_vmm::log::last_bytes(&run_dir.join("console.log"), 4096).ok()?;
    let text = String::from_utf8_lossy(&buf);
    let lines: Vec<String> = text
        .lines()
        .map(printable)
        .filter(|l| !l.trim().is_empty())
        .collect();
    let tail = lines[lines.len().saturating_sub(6)..].join(" | ");
    (!tail.is_empty()).then(|| clip(&tail, 1500))
}

/// A console line without terminal escape sequences (`ESC [ ... final`) and other control characters.
fn printable(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            if chars.peek() == Some(&'[') {
                chars.next();
                // Parameters and intermediates, up to and including the final byte (@ to ~).
                for p in chars.by_ref() {
                    if ('@'..='~').contains(&p) {
                        break;
                    }
                }
            }
        } else if !c.is_control() {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn console_tail_is_printable() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        assert_eq!(console_tail(dir.path()), None);
        std::fs::write(
            dir.path().join("console.log"),
            b"boot\n\x1b[31mred\x1b[0m\n\nlast line\n",
        )?;
        let tail = console_tail(dir.path()).unwrap_or_default();
        assert_eq!(tail, "boot | red | last line");
        Ok(())
    }
}
