//! MOUNT v3 (RFC 1813 appendix I): MNT hands out an export's root handle; the rest is bookkeeping the server
//! does not need (UMNT and UMNTALL succeed, DUMP lists nothing).

use super::{Exports, encode_fh};
use crate::rpc::Accept;
use crate::xdr::{Reader, Writer, XdrError};

pub const PROGRAM: u32 = 100005;
pub const VERSION: u32 = 3;
const MNT3ERR_NOENT: u32 = 2;
const AUTH_UNIX: u32 = 1;
/// Longest export path (`dirpath`).
const MNTPATHLEN: usize = 1024;

/// Runs procedure `proc_`; the body is written after an accepted-reply header.
pub fn call(
    proc_: u32,
    args: &mut Reader<'_>,
    exports: &dyn Exports,
    w: &mut Writer,
) -> Result<Accept, XdrError> {
    match proc_ {
        // NULL, UMNTALL
        0 | 4 => {}
        // MNT
        1 => {
            let path = args.opaque(MNTPATHLEN)?;
            let found = std::str::from_utf8(path)
                .ok()
                .and_then(|p| exports.by_name(p.trim_end_matches('/')));
            match found {
                Some(e) => {
                    w.u32(0);
                    encode_fh(w, e.spec.key, e.root());
                    w.u32(1).u32(AUTH_UNIX);
                }
                None => {
                    w.u32(MNT3ERR_NOENT);
                }
            }
        }
        // DUMP: no mount list kept.
        2 => {
            w.bool(false);
        }
        // UMNT
        3 => {
            args.opaque(MNTPATHLEN)?;
        }
        // EXPORT
        5 => {
            for name in exports.names() {
                w.bool(true).opaque(name.as_bytes()).bool(false);
            }
            w.bool(false);
        }
        _ => return Ok(Accept::ProcUnavail),
    }
    Ok(Accept::Success)
}
