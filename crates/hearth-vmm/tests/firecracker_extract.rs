//! `images/extract-vmlinux.sh`: bzImage -> the ELF vmlinux Firecracker boots. Checked on synthetic bzImages
//! for every compression the kernel build uses (built here with the real compressors, laid out like the
//! kernel's boot header), on damaged ones, and on the real Debian cloud kernel.

mod firecracker_common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use firecracker_common::{debian_vmlinuz, extract_script};

/// Compresses `data` with a CLI tool reading stdin.
fn compress(tool: &str, args: &[&str], data: &[u8]) -> Vec<u8> {
    let mut child = Command::new(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    let mut stdin = child.stdin.take().expect("stdin");
    let input = data.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&input).expect("feed compressor"));
    let out = child.wait_with_output().expect("compressor output");
    writer.join().expect("writer");
    assert!(out.status.success(), "{tool} failed");
    out.stdout
}

/// An "ELF" whose bytes are easy to compare: magic + a deterministic pattern.
fn fake_elf(len: usize) -> Vec<u8> {
    let mut v = b"\x7fELF\x02\x01\x01".to_vec();
    let mut x: u32 = 0x1234_5678;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        // Half pattern, half noise: compressible but not trivially.
        v.push(if v.len().is_multiple_of(2) {
            (x & 0xff) as u8
        } else {
            (v.len() / 7) as u8
        });
    }
    v
}

/// A bzImage: `setup_sects` sectors of setup after the boot sector, then the protected-mode kernel with the
/// payload at `payload_offset`. `append_size` adds the u32 LE uncompressed size, as the kernel build does.
fn bzimage(setup_sects: u8, payload: &[u8], raw_len: usize, append_size: bool) -> Vec<u8> {
    let sects = if setup_sects == 0 {
        4
    } else {
        usize::from(setup_sects)
    };
    let pm_start = (sects + 1) * 512;
    let payload_offset = 0x1c0usize;
    let mut full = payload.to_vec();
    if append_size {
        full.extend_from_slice(&(raw_len as u32).to_le_bytes());
    }
    let mut img = vec![0u8; pm_start + payload_offset];
    img[0x1f1] = setup_sects;
    img[0x202..0x206].copy_from_slice(b"HdrS");
    img[0x248..0x24c].copy_from_slice(&(payload_offset as u32).to_le_bytes());
    img[0x24c..0x250].copy_from_slice(&(full.len() as u32).to_le_bytes());
    img.extend_from_slice(&full);
    // Trailing bytes after the payload (the real image has more code there).
    img.extend_from_slice(&[0xcc; 333]);
    img
}

fn extract(dir: &Path, img: &[u8]) -> (bool, Vec<u8>, String) {
    let input = dir.join("vmlinuz");
    let output = dir.join("vmlinux");
    let _ = std::fs::remove_file(&output);
    std::fs::write(&input, img).expect("write bzImage");
    let out = Command::new("sh")
        .arg(extract_script())
        .arg(&input)
        .arg(&output)
        .output()
        .expect("run script");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let produced = std::fs::read(&output).unwrap_or_default();
    // Nothing but the input and (on success) the output: no temp files left.
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let expected: &[&str] = if out.status.success() {
        &["vmlinux", "vmlinuz"]
    } else {
        &["vmlinuz"]
    };
    assert_eq!(names, expected, "{stderr}");
    (out.status.success(), produced, stderr)
}

#[test]
fn every_kernel_compression_round_trips() {
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = fake_elf(300_000);
    let cases: [(&str, &str, &[&str], bool); 6] = [
        ("gzip", "gzip", &["-9", "-n", "-c"], false),
        ("xz", "xz", &["--check=crc32", "-c"], true),
        ("lz4", "lz4", &["-l", "-9", "-c"], true),
        ("zstd", "zstd", &["-19", "-q", "-c"], true),
        ("bzip2", "bzip2", &["-9", "-c"], true),
        ("lzma", "lzma", &["-9", "-c"], true),
    ];
    for (name, tool, args, append) in cases {
        for setup_sects in [0u8, 27] {
            let img = bzimage(setup_sects, &compress(tool, args, &elf), elf.len(), append);
            let (ok, out, stderr) = extract(dir.path(), &img);
            assert!(ok, "{name} setup_sects={setup_sects}: {stderr}");
            assert!(out == elf, "{name}: output differs from the original");
            assert!(stderr.contains(&format!("({name},")), "{stderr}");
        }
    }
}

#[test]
fn damaged_images_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let elf = fake_elf(50_000);
    let zst = compress("zstd", &["-q", "-c"], &elf);

    // Not a bzImage at all.
    let (ok, _, err) = extract(dir.path(), &vec![0u8; 4096]);
    assert!(!ok && err.contains("HdrS"), "{err}");
    // Unknown compression magic.
    let mut img = bzimage(4, &zst, elf.len(), true);
    let start = 5 * 512 + 0x1c0;
    img[start] ^= 0xff;
    let (ok, _, err) = extract(dir.path(), &img);
    assert!(!ok && err.contains("unknown payload compression"), "{err}");
    // Payload length running past the end of the file.
    let mut img = bzimage(4, &zst, elf.len(), true);
    img[0x24c..0x250].copy_from_slice(&u32::MAX.to_le_bytes());
    let (ok, _, err) = extract(dir.path(), &img);
    assert!(!ok && err.contains("runs past the end"), "{err}");
    // Recorded size disagrees with what decompresses.
    let (ok, _, err) = extract(dir.path(), &bzimage(4, &zst, elf.len() + 1, true));
    assert!(!ok && err.contains("differs from the recorded size"), "{err}");
    // A payload that decompresses to something other than an ELF.
    let not_elf = vec![b'A'; 10_000];
    let img = bzimage(4, &compress("zstd", &["-q", "-c"], &not_elf), not_elf.len(), true);
    let (ok, _, err) = extract(dir.path(), &img);
    assert!(!ok && err.contains("not an ELF"), "{err}");
    // Truncated compressed stream.
    let (ok, _, err) = extract(dir.path(), &bzimage(4, &zst[..zst.len() / 2], elf.len(), true));
    assert!(!ok, "truncated payload accepted: {err}");
}

#[test]
fn debian_cloud_kernel_becomes_an_elf_vmlinux() {
    let vmlinuz = debian_vmlinuz();
    let dir = tempfile::tempdir().expect("tempdir");
    let out = dir.path().join("vmlinux");
    let status = Command::new("sh")
        .arg(extract_script())
        .arg(&vmlinuz)
        .arg(&out)
        .status()
        .expect("run script");
    assert!(status.success());
    let elf = std::fs::read(&out).expect("vmlinux");
    assert_eq!(&elf[..4], b"\x7fELF");
    assert_eq!(elf[4], 2, "64-bit ELF");
    assert_eq!(u16::from_le_bytes([elf[18], elf[19]]), 62, "x86-64 machine");
    // Firecracker itself accepts it: covered by the start tests, which boot-configure this kind of file.
    assert!(elf.len() > 3 * std::fs::metadata(&vmlinuz).expect("vmlinuz").len() as usize / 2);
}
