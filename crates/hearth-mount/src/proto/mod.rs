//! The two RPC programs a kernel NFS client speaks to mount and use a file system: MOUNT v3 ([`mount`]) and
//! NFS v3 ([`nfs3`]), both served on one TCP port. Arguments are decoded from the call's record with
//! [`crate::xdr::Reader`] (bounded); results are encoded after the reply header.

pub mod mount;
pub mod nfs3;

use std::sync::Arc;

use crate::fs::{Attr, Export, Kind, Status};
use crate::xdr::{Reader, Writer, XdrError};

/// Length of the file handles this server hands out: export key (8 bytes) + file id (8 bytes).
pub const FH_LEN: usize = 16;
/// Longest file handle NFSv3 allows (longer ones are garbage).
pub const FH_MAX: usize = 64;

/// Finds an export by key (the first half of every file handle).
pub trait Exports: Send + Sync {
    fn by_key(&self, key: u64) -> Option<Arc<Export>>;
    /// Exports by name, for MOUNT.
    fn by_name(&self, name: &str) -> Option<Arc<Export>>;
    fn names(&self) -> Vec<String>;
}

/// The name an export is mounted by: `/` + its key in hex.
pub fn export_name(key: u64) -> String {
    format!("/{key:016x}")
}

pub fn encode_fh(w: &mut Writer, key: u64, id: u64) {
    let mut fh = [0u8; FH_LEN];
    fh[..8].copy_from_slice(&key.to_be_bytes());
    fh[8..].copy_from_slice(&id.to_be_bytes());
    w.opaque(&fh);
}

/// A decoded file handle: its export and file id. Wrong length: BADHANDLE; unknown export: STALE.
pub fn decode_fh(
    r: &mut Reader<'_>,
    exports: &dyn Exports,
) -> Result<Result<(Arc<Export>, u64), Status>, XdrError> {
    let fh = r.opaque(FH_MAX)?;
    if fh.len() != FH_LEN {
        return Ok(Err(Status::BadHandle));
    }
    let key = u64::from_be_bytes(fh[..8].try_into().unwrap_or_default());
    let id = u64::from_be_bytes(fh[8..].try_into().unwrap_or_default());
    Ok(exports.by_key(key).map(|e| (e, id)).ok_or(Status::Stale))
}

fn time(w: &mut Writer, t: std::time::SystemTime) {
    let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    w.u32(u32::try_from(d.as_secs()).unwrap_or(u32::MAX))
        .u32(d.subsec_nanos());
}

/// `fattr3`.
pub fn fattr(w: &mut Writer, a: &Attr, export: &Export) {
    let ro = export.read_only();
    let (ftype, mode, nlink, size) = match a.kind {
        Kind::File => (1, if ro { 0o444 } else { 0o644 }, 1, a.size),
        Kind::Dir => (2, if ro { 0o555 } else { 0o755 }, 2, 4096),
    };
    w.u32(ftype).u32(mode).u32(nlink).u32(0).u32(0);
    w.u64(size).u64(size);
    w.u32(0).u32(0);
    w.u64(export.spec.key).u64(a.fileid);
    time(w, a.mtime);
    time(w, a.mtime);
    time(w, a.mtime);
}

/// `post_op_attr`.
pub fn post_attr(w: &mut Writer, a: Option<&Attr>, export: &Export) {
    match a {
        Some(a) => {
            w.bool(true);
            fattr(w, a, export);
        }
        None => {
            w.bool(false);
        }
    }
}

/// `wcc_data` without pre-operation attributes.
pub fn wcc(w: &mut Writer, after: Option<&Attr>, export: &Export) {
    w.bool(false);
    post_attr(w, after, export);
}
