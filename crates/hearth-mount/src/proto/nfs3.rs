//! NFS v3 (RFC 1813): each procedure's arguments decoded, the export asked, the result encoded. Failures carry
//! the attributes the RFC allows to be absent as absent.

use std::sync::Arc;

use super::{Exports, FH_LEN, decode_fh, encode_fh, fattr, post_attr, wcc};
use crate::fs::write::CreateMode;
use crate::fs::{Attr, Export, FsResult, Kind, Status};
use crate::rpc::Accept;
use crate::xdr::{Reader, Writer, XdrError};

pub const PROGRAM: u32 = 100003;
pub const VERSION: u32 = 3;
/// Longest file name in a call (`filename3`); longer ones are refused as NAMETOOLONG by the export.
const MAX_NAME: usize = 1024;
/// Longest symlink target or path accepted in a call.
const MAX_PATH: usize = 4096;

const ACCESS_READ: u32 = 0x01;
const ACCESS_LOOKUP: u32 = 0x02;
const ACCESS_MODIFY: u32 = 0x04;
const ACCESS_EXTEND: u32 = 0x08;
const ACCESS_DELETE: u32 = 0x10;
const ACCESS_EXECUTE: u32 = 0x20;
const UNSTABLE: u32 = 0;
const FILE_SYNC: u32 = 2;

/// What SETATTR/CREATE/MKDIR attributes ask: the size, and whether anything was set at all.
struct Sattr {
    size: Option<u64>,
    anything: bool,
}

fn sattr(r: &mut Reader<'_>) -> Result<Sattr, XdrError> {
    let mut anything = false;
    for _ in 0..3 {
        if r.bool()? {
            r.u32()?;
            anything = true;
        }
    }
    let size = if r.bool()? { Some(r.u64()?) } else { None };
    for _ in 0..2 {
        match r.u32()? {
            0 => {}
            1 => anything = true,
            2 => {
                r.u32()?;
                r.u32()?;
                anything = true;
            }
            _ => return Err(XdrError::BadValue),
        }
    }
    Ok(Sattr { size, anything })
}

/// A decoded handle, or the status to answer with.
type Target = Result<(Arc<Export>, u64), Status>;

fn status(w: &mut Writer, s: Status) {
    w.u32(s as u32);
}

fn fh_attr(w: &mut Writer, e: &Export, a: &Attr) {
    w.bool(true);
    encode_fh(w, e.spec.key, a.fileid);
    post_attr(w, Some(a), e);
}

/// Runs procedure `proc_` with the arguments in `r`, writing the result into `w`.
pub async fn call(
    proc_: u32,
    r: &mut Reader<'_>,
    exports: &dyn Exports,
    w: &mut Writer,
) -> Result<Accept, XdrError> {
    match proc_ {
        0 => {}
        1 => getattr(decode_fh(r, exports)?, w).await,
        2 => {
            let t = decode_fh(r, exports)?;
            let s = sattr(r)?;
            if r.bool()? {
                r.u32()?;
                r.u32()?;
            }
            setattr(t, s, w).await;
        }
        3 => {
            let t = decode_fh(r, exports)?;
            let name = r.opaque(MAX_NAME)?;
            lookup(t, name, w).await;
        }
        4 => {
            let t = decode_fh(r, exports)?;
            let mask = r.u32()?;
            access(t, mask, w).await;
        }
        // READLINK: there are no symlinks.
        5 => {
            let s = decode_fh(r, exports)?.err().unwrap_or(Status::Inval);
            status(w, s);
            w.bool(false);
        }
        6 => {
            let t = decode_fh(r, exports)?;
            let (offset, count) = (r.u64()?, r.u32()?);
            read(t, offset, count.min(crate::MAX_IO), w).await;
        }
        7 => {
            let t = decode_fh(r, exports)?;
            let offset = r.u64()?;
            let _count = r.u32()?;
            let stable = r.u32()?;
            let data = r.opaque(crate::MAX_IO as usize)?;
            write(t, offset, stable, data, w).await;
        }
        8 => {
            let t = decode_fh(r, exports)?;
            let name = r.opaque(MAX_NAME)?;
            let mode = match r.u32()? {
                0 => CreateMode::Unchecked {
                    truncate: sattr(r)?.size == Some(0),
                },
                1 => {
                    sattr(r)?;
                    CreateMode::Guarded
                }
                2 => {
                    r.fixed::<8>()?;
                    CreateMode::Exclusive
                }
                _ => return Err(XdrError::BadValue),
            };
            create(t, name, w, |e, d| async move { e.create(d, name, mode).await }).await;
        }
        9 => {
            let t = decode_fh(r, exports)?;
            let name = r.opaque(MAX_NAME)?;
            sattr(r)?;
            create(t, name, w, |e, d| async move { e.mkdir(d, name).await }).await;
        }
        // SYMLINK, MKNOD: objects cannot be either.
        10 | 11 => {
            let t = decode_fh(r, exports)?;
            r.opaque(MAX_NAME)?;
            if proc_ == 10 {
                sattr(r)?;
                r.opaque(MAX_PATH)?;
            }
            refuse(t, w);
            w.bool(false);
            w.bool(false);
        }
        12 | 13 => {
            let t = decode_fh(r, exports)?;
            let name = r.opaque(MAX_NAME)?;
            remove(t, name, proc_ == 13, w).await;
        }
        14 => {
            let from = decode_fh(r, exports)?;
            let from_name = r.opaque(MAX_NAME)?;
            let to = decode_fh(r, exports)?;
            let to_name = r.opaque(MAX_NAME)?;
            rename(from, from_name, to, to_name, w).await;
        }
        // LINK: no hard links in a bucket.
        15 => {
            let t = decode_fh(r, exports)?;
            let _dir = decode_fh(r, exports)?;
            r.opaque(MAX_NAME)?;
            refuse(t, w);
            w.bool(false);
            w.bool(false);
            w.bool(false);
        }
        16 | 17 => {
            let t = decode_fh(r, exports)?;
            let cookie = r.u64()?;
            r.fixed::<8>()?;
            let plus = proc_ == 17;
            let dircount = r.u32()?;
            let maxcount = if plus { r.u32()? } else { dircount };
            readdir(t, cookie, dircount, maxcount, plus, w).await;
        }
        18..=20 => {
            let t = decode_fh(r, exports)?;
            info(proc_, t, w).await;
        }
        21 => {
            let t = decode_fh(r, exports)?;
            r.u64()?;
            r.u32()?;
            commit(t, w).await;
        }
        _ => return Ok(Accept::ProcUnavail),
    }
    Ok(Accept::Success)
}

/// The answer to an operation no export supports: ROFS on a read-only export, else PERM.
fn refuse(t: Target, w: &mut Writer) {
    let s = match t {
        Err(s) => s,
        Ok((e, _)) if e.read_only() => Status::RoFs,
        Ok(_) => Status::Perm,
    };
    status(w, s);
}

async fn getattr(t: Target, w: &mut Writer) {
    let r = match &t {
        Ok((e, id)) => e.getattr(*id).await,
        Err(s) => Err(*s),
    };
    match (r, &t) {
        (Ok(a), Ok((e, _))) => {
            status(w, Status::Ok);
            fattr(w, &a, e);
        }
        (Err(s), _) => status(w, s),
        (Ok(_), Err(s)) => status(w, *s),
    }
}

async fn setattr(t: Target, s: Sattr, w: &mut Writer) {
    let (e, id) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false).bool(false);
            return;
        }
    };
    match e.setattr(id, s.size, s.anything).await {
        Ok(a) => {
            status(w, Status::Ok);
            wcc(w, Some(&a), &e);
        }
        Err(s) => {
            status(w, s);
            w.bool(false).bool(false);
        }
    }
}

async fn lookup(t: Target, name: &[u8], w: &mut Writer) {
    let (e, dir) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false);
            return;
        }
    };
    let r = match e.dir_path(dir).await {
        Ok(_) => e.lookup(dir, name).await,
        Err(s) => Err(s),
    };
    match r {
        Ok(a) => {
            status(w, Status::Ok);
            encode_fh(w, e.spec.key, a.fileid);
            post_attr(w, Some(&a), &e);
            w.bool(false);
        }
        Err(s) => {
            status(w, s);
            w.bool(false);
        }
    }
}

async fn access(t: Target, mask: u32, w: &mut Writer) {
    let (e, id) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false);
            return;
        }
    };
    match e.getattr(id).await {
        Ok(a) => {
            let mut allowed = ACCESS_READ;
            if a.kind == Kind::Dir {
                allowed |= ACCESS_LOOKUP | ACCESS_EXECUTE;
            }
            if !e.read_only() {
                allowed |= ACCESS_MODIFY | ACCESS_EXTEND | ACCESS_DELETE;
            }
            status(w, Status::Ok);
            post_attr(w, Some(&a), &e);
            w.u32(mask & allowed);
        }
        Err(s) => {
            status(w, s);
            w.bool(false);
        }
    }
}

async fn read(t: Target, offset: u64, count: u32, w: &mut Writer) {
    let (e, id) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false);
            return;
        }
    };
    match e.read(id, offset, count).await {
        Ok((data, eof)) => {
            let a = e.getattr(id).await.ok();
            status(w, Status::Ok);
            post_attr(w, a.as_ref(), &e);
            w.u32(u32::try_from(data.len()).unwrap_or(0))
                .bool(eof)
                .opaque(&data);
        }
        Err(s) => {
            status(w, s);
            w.bool(false);
        }
    }
}

async fn write(t: Target, offset: u64, stable: u32, data: &[u8], w: &mut Writer) {
    let (e, id) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false).bool(false);
            return;
        }
    };
    let mut r = e.write(id, offset, data).await;
    // A stable write must be in the bucket before the answer (a client writing a small file on close asks
    // for FILE_SYNC and sends no COMMIT).
    if stable != UNSTABLE && r.is_ok() {
        r = match e.commit(id).await {
            Ok(()) => r,
            Err(s) => Err(s),
        };
    }
    match r {
        Ok(a) => {
            status(w, Status::Ok);
            wcc(w, Some(&a), &e);
            let committed = if stable == UNSTABLE { UNSTABLE } else { FILE_SYNC };
            w.u32(u32::try_from(data.len()).unwrap_or(0))
                .u32(committed)
                .fixed(&e.verifier);
        }
        Err(s) => {
            status(w, s);
            w.bool(false).bool(false);
        }
    }
}

async fn create<'a, F, Fut>(t: Target, _name: &'a [u8], w: &mut Writer, op: F)
where
    F: FnOnce(Arc<Export>, u64) -> Fut,
    Fut: std::future::Future<Output = FsResult<Attr>> + 'a,
{
    let (e, dir) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false).bool(false);
            return;
        }
    };
    match op(e.clone(), dir).await {
        Ok(a) => {
            status(w, Status::Ok);
            fh_attr(w, &e, &a);
            let d = e.getattr(dir).await.ok();
            wcc(w, d.as_ref(), &e);
        }
        Err(s) => {
            status(w, s);
            w.bool(false).bool(false);
        }
    }
}

async fn remove(t: Target, name: &[u8], dir_op: bool, w: &mut Writer) {
    let r = match &t {
        Ok((e, dir)) if dir_op => e.rmdir(*dir, name).await,
        Ok((e, dir)) => e.remove(*dir, name).await,
        Err(s) => Err(*s),
    };
    match r {
        Ok(()) => status(w, Status::Ok),
        Err(s) => status(w, s),
    }
    w.bool(false).bool(false);
}

async fn rename(from: Target, from_name: &[u8], to: Target, to_name: &[u8], w: &mut Writer) {
    let r = match (&from, &to) {
        (Ok((e, fd)), Ok((e2, td))) if Arc::ptr_eq(e, e2) => e.rename(*fd, from_name, *td, to_name).await,
        // Between two exports: a different file system.
        (Ok(_), Ok(_)) => Err(Status::XDev),
        (Err(s), _) | (_, Err(s)) => Err(*s),
    };
    match r {
        Ok(()) => status(w, Status::Ok),
        Err(s) => status(w, s),
    }
    w.bool(false).bool(false).bool(false).bool(false);
}

/// READDIR and READDIRPLUS. Entries are added while the reply stays within the client's limits.
async fn readdir(t: Target, cookie: u64, dircount: u32, maxcount: u32, plus: bool, w: &mut Writer) {
    let (e, dir) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false);
            return;
        }
    };
    // Room for the header, the directory's attributes, the verifier and the list's end.
    let overhead = 160usize;
    let max = (maxcount.min(crate::MAX_IO) as usize).saturating_sub(overhead);
    let dmax = if plus { dircount as usize } else { max };
    let (mut total, mut dtotal) = (0usize, 0usize);
    let result = e
        .readdir(dir, cookie, |name| {
            let base = 24 + name.len().div_ceil(4) * 4;
            let full = if plus {
                base + 4 + 84 + 4 + 4 + FH_LEN
            } else {
                base
            };
            if total + full > max || dtotal + base > dmax.max(base) && dtotal > 0 {
                return false;
            }
            total += full;
            dtotal += base;
            true
        })
        .await;
    match result {
        Ok((entries, _)) if entries.is_empty() && total == 0 && cookie_mid(&e, dir, cookie).await => {
            status(w, Status::TooSmall);
            w.bool(false);
        }
        Ok((entries, eof)) => {
            let d = e.getattr(dir).await.ok();
            status(w, Status::Ok);
            post_attr(w, d.as_ref(), &e);
            w.fixed(&[0u8; 8]);
            for (entry, a) in &entries {
                w.bool(true)
                    .u64(a.fileid)
                    .opaque(entry.name.as_bytes())
                    .u64(a.fileid);
                if plus {
                    post_attr(w, Some(a), &e);
                    w.bool(true);
                    encode_fh(w, e.spec.key, a.fileid);
                }
            }
            w.bool(false).bool(eof);
        }
        Err(s) => {
            status(w, s);
            w.bool(false);
        }
    }
}

/// Whether entries remain after `cookie` (an empty page that is not the end means the limit is too small).
async fn cookie_mid(e: &Export, dir: u64, cookie: u64) -> bool {
    e.readdir(dir, cookie, |_| true)
        .await
        .is_ok_and(|(v, _)| !v.is_empty())
}

async fn info(proc_: u32, t: Target, w: &mut Writer) {
    let (e, id) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false);
            return;
        }
    };
    let a = match e.getattr(id).await {
        Ok(a) => a,
        Err(s) => {
            status(w, s);
            w.bool(false);
            return;
        }
    };
    status(w, Status::Ok);
    post_attr(w, Some(&a), &e);
    match proc_ {
        // FSSTAT: a bucket has no size limit to speak of.
        18 => {
            let big = 1u64 << 50;
            let free = if e.read_only() { 0 } else { big };
            w.u64(big)
                .u64(free)
                .u64(free)
                .u64(1 << 32)
                .u64(1 << 32)
                .u64(1 << 32)
                .u32(0);
        }
        // FSINFO
        19 => {
            let io = crate::MAX_IO;
            w.u32(io)
                .u32(io)
                .u32(4096)
                .u32(io)
                .u32(io)
                .u32(4096)
                .u32(64 * 1024);
            w.u64(1 << 42).u32(0).u32(1_000_000);
            // FSF3_HOMOGENEOUS only: no links, no symlinks, times are the bucket's.
            w.u32(0x0008);
        }
        // PATHCONF
        _ => {
            w.u32(1).u32(255).bool(true).bool(true).bool(false).bool(true);
        }
    }
}

async fn commit(t: Target, w: &mut Writer) {
    let (e, id) = match t {
        Ok(t) => t,
        Err(s) => {
            status(w, s);
            w.bool(false).bool(false);
            return;
        }
    };
    match e.commit(id).await {
        Ok(()) => {
            let a = e.getattr(id).await.ok();
            status(w, Status::Ok);
            wcc(w, a.as_ref(), &e);
            w.fixed(&e.verifier);
        }
        Err(s) => {
            status(w, s);
            w.bool(false).bool(false);
        }
    }
}
