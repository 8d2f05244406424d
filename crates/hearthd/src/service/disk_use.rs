//! What files take on the host's disk: allocated blocks, not lengths (a sparse memory file or copy-on-write disk
//! counts what it holds), each file once however many links reach it. Used by the local cache of the storage
//! bucket ([`super::cache`]) and the project disk quota ([`super::quota`]).

use std::collections::HashSet;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// How deep below the starting directory files are counted (hearth's own directories are a few levels deep).
const MAX_DEPTH: usize = 8;

/// Files already counted, by (device, inode).
pub type Seen = HashSet<(u64, u64)>;

/// Bytes the files under `path` (or `path` itself) use on disk, without following symbolic links, skipping
/// files in `seen` and adding the rest to it. What cannot be read (removed meanwhile) counts nothing.
pub fn allocated_bytes(path: &Path, seen: &mut Seen) -> u64 {
    walk(path, seen, MAX_DEPTH)
}

fn walk(path: &Path, seen: &mut Seen, depth: usize) -> u64 {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if meta.is_file() {
        return if seen.insert((meta.dev(), meta.ino())) {
            meta.blocks().saturating_mul(512)
        } else {
            0
        };
    }
    if !meta.is_dir() || depth == 0 {
        return 0;
    }
    let Ok(entries) = std::fs::read_dir(path) else {
        return 0;
    };
    entries
        .flatten()
        .map(|e| walk(&e.path(), seen, depth - 1))
        .fold(0, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_counted_once_per_file_not_lengths() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let data = dir.path().join("a/b");
        std::fs::create_dir_all(&data)?;
        std::fs::write(data.join("full"), vec![7u8; 1 << 20])?;
        // A sparse file of 1 GiB holds (almost) nothing; a hard link to `full` is the same blocks.
        std::fs::File::create(data.join("sparse"))?.set_len(1 << 30)?;
        std::fs::hard_link(data.join("full"), dir.path().join("link"))?;
        let used = allocated_bytes(dir.path(), &mut Seen::new());
        assert!((1 << 20..(1 << 20) + (64 << 10)).contains(&used), "{used}");
        assert_eq!(allocated_bytes(&dir.path().join("gone"), &mut Seen::new()), 0);
        Ok(())
    }
}
