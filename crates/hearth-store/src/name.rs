//! Validated names: object names (which become bucket keys) and the file names inside an object (which become
//! paths under a restore directory). No key or path is ever built from a string that did not pass through here.

use std::fmt;

use crate::error::StoreError;

/// Longest object name accepted (S3 keys may be 1024 bytes; the prefix and the layout need some of that).
pub const MAX_NAME_LEN: usize = 512;
/// Longest file name accepted inside an object.
pub const MAX_FILE_NAME_LEN: usize = 128;

/// An object's name: `[a-z0-9_-/.]`, 1..=512 bytes, `/`-separated segments that are neither empty, `.` nor
/// `..` (so no leading, trailing or doubled `/`), and no `..` anywhere.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ObjectName(String);

impl ObjectName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<ObjectName, StoreError> {
        let bad = |reason: &'static str| StoreError::InvalidName {
            name: printable(name),
            reason,
        };
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(bad("must be 1 to 512 bytes long"));
        }
        if !name
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'/' | b'.'))
        {
            return Err(bad("only a-z, 0-9, '_', '-', '.' and '/' are allowed"));
        }
        if name.contains("..") {
            return Err(bad("'..' is not allowed"));
        }
        if name.split('/').any(|s| s.is_empty() || s == ".") {
            return Err(bad("segments between '/' must be non-empty and not '.'"));
        }
        Ok(ObjectName(name.to_owned()))
    }

    /// The name as given.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ObjectName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Validates the name of a file inside an object: one segment of `[a-z0-9_-.]`, 1..=128 bytes, not `.` or `..`
/// and without `..`. Used on upload and again on download (a manifest from the bucket is not trusted to name
/// paths).
pub fn check_file_name(object: &str, name: &str) -> Result<(), StoreError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_FILE_NAME_LEN
        && name
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.'))
        && !name.contains("..")
        && name != ".";
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidFileName {
            object: object.to_owned(),
            name: printable(name),
        })
    }
}

/// A bounded, escaped rendering of untrusted input for error messages.
fn printable(s: &str) -> String {
    let mut out: String = s.chars().take(80).flat_map(char::escape_debug).collect();
    if s.chars().count() > 80 {
        out.push_str("...");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_names() {
        for ok in ["a", "templates/base", "sandboxes/sb-1/pause.3", "x_y-z/0.1/w"] {
            assert!(ObjectName::new(ok).is_ok(), "{ok}");
        }
        let long = "a".repeat(513);
        for bad in [
            "", "/a", "a/", "a//b", "../a", "a/../b", "a/./b", ".", "a..b", "A", "a b", "a\0b", "é", "a\\b",
            &long,
        ] {
            assert!(ObjectName::new(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn file_names() {
        for ok in ["memory", "state.bin", "disk.ext4", "a-b_c"] {
            assert!(check_file_name("o", ok).is_ok(), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "A", "..x", "a\0", &"f".repeat(129)] {
            assert!(check_file_name("o", bad).is_err(), "{bad:?}");
        }
    }
}
