//! What a hostile guest writes at the start of its own disk to make the host open a host file, and a canary
//! host file that tells whether anything opened it.
//!
//! A guest is root on its disk. ext4 leaves the first 1 KiB of the device unused (the superblock starts at
//! 1024), so a guest can put a disk-image header there and keep a working file system. If the host ever guessed
//! the disk's format from those bytes (`qemu-img` or QEMU without `-f`/`format=`), it would read the image as
//! qcow2 or VMDK and open the host file the header names. Every header here fits in the first 1 KiB.

use std::path::{Path, PathBuf};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

/// The header kinds a test tries, each naming `target` as the file to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Header {
    /// qcow2 whose backing file is `target`.
    Qcow2Backing,
    /// qcow2 whose backing file is a `json:{...}` filename opening `target` through the `file` driver.
    Qcow2Json,
    /// A VMDK text descriptor with one flat extent: `target`.
    VmdkDescriptor,
    /// A VHDX file identifier (no host file, but a format other than raw).
    Vhdx,
}

impl Header {
    pub const ALL: [Header; 4] = [
        Header::Qcow2Backing,
        Header::Qcow2Json,
        Header::VmdkDescriptor,
        Header::Vhdx,
    ];

    /// The bytes to write at offset 0 of the disk (at most 1024).
    pub fn bytes(self, target: &Path) -> Vec<u8> {
        let target = target.to_str().expect("a UTF-8 canary path");
        let out = match self {
            Header::Qcow2Backing => qcow2_with_backing(target),
            Header::Qcow2Json => qcow2_with_backing(&format!(
                "json:{{\"driver\":\"raw\",\"file\":{{\"driver\":\"file\",\"filename\":\"{target}\"}}}}"
            )),
            Header::VmdkDescriptor => format!(
                "# Disk DescriptorFile\nversion=1\nCID=12345678\nparentCID=ffffffff\n\
                 createType=\"monolithicFlat\"\n\n# Extent description\nRW 2048 FLAT \"{target}\" 0\n\n\
                 ddb.virtualHWVersion = \"4\"\n"
            )
            .into_bytes(),
            Header::Vhdx => {
                let mut b = b"vhdxfile".to_vec();
                b.extend("hearth hostile guest".encode_utf16().flat_map(u16::to_le_bytes));
                b
            }
        };
        assert!(out.len() <= 1024, "{self:?} header is {} bytes", out.len());
        out
    }

    /// Whether probing this header makes QEMU's tools open `target` (the VHDX one names no file).
    pub fn names_a_host_file(self) -> bool {
        self != Header::Vhdx
    }
}

/// A minimal qcow2 v2 header: 64 MiB, 64 KiB clusters, the backing file name at offset 512.
fn qcow2_with_backing(backing: &str) -> Vec<u8> {
    const NAME_AT: usize = 512;
    assert!(NAME_AT + backing.len() <= 1024, "backing name too long");
    let mut h = vec![0u8; NAME_AT];
    let put = |h: &mut Vec<u8>, at: usize, bytes: &[u8]| h[at..at + bytes.len()].copy_from_slice(bytes);
    put(&mut h, 0, b"QFI\xfb");
    put(&mut h, 4, &2u32.to_be_bytes()); // version
    put(&mut h, 8, &(NAME_AT as u64).to_be_bytes()); // backing_file_offset
    put(&mut h, 16, &(backing.len() as u32).to_be_bytes()); // backing_file_size
    put(&mut h, 20, &16u32.to_be_bytes()); // cluster_bits
    put(&mut h, 24, &(64u64 << 20).to_be_bytes()); // size
    put(&mut h, 36, &1u32.to_be_bytes()); // l1_size
    put(&mut h, 40, &(128u64 << 10).to_be_bytes()); // l1_table_offset
    put(&mut h, 48, &(64u64 << 10).to_be_bytes()); // refcount_table_offset
    put(&mut h, 56, &1u32.to_be_bytes()); // refcount_table_clusters
    h.extend_from_slice(backing.as_bytes());
    h
}

/// A host file no guest may ever read, watched with inotify for any open or read.
pub struct Canary {
    pub path: PathBuf,
    /// The file's content: a marker that must never appear in a guest.
    pub marker: String,
    inotify: Inotify,
}

impl Canary {
    /// Creates `dir/canary` holding a unique marker (repeated to 64 KiB) and starts watching it.
    pub fn new(dir: &Path) -> Canary {
        let marker = format!("HEARTH-CANARY-{:016x}", rand_u64());
        let path = dir.join("canary");
        std::fs::write(&path, marker.repeat(65536 / marker.len())).expect("writing the canary");
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).expect("inotify");
        inotify
            .add_watch(
                &path,
                AddWatchFlags::IN_OPEN | AddWatchFlags::IN_ACCESS | AddWatchFlags::IN_CLOSE,
            )
            .expect("watching the canary");
        Canary {
            path,
            marker,
            inotify,
        }
    }

    /// The events since the last call (empty when nothing touched the file).
    pub fn events(&self) -> Vec<String> {
        match self.inotify.read_events() {
            Ok(events) => events.iter().map(|e| format!("{:?}", e.mask)).collect(),
            Err(nix::errno::Errno::EAGAIN) => Vec::new(),
            Err(e) => panic!("reading inotify events: {e}"),
        }
    }

    /// Panics when anything opened or read the canary since the last check.
    pub fn assert_untouched(&self, after: &str) {
        let events = self.events();
        assert!(
            events.is_empty(),
            "the canary {} was opened or read after {after}: {events:?}",
            self.path.display()
        );
    }
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .expect("reading /dev/urandom");
    u64::from_le_bytes(b)
}
