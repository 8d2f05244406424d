//! ONC RPC v2 (RFC 5531) over TCP: record marking, call headers, reply headers.
//!
//! Everything here reads bytes a guest wrote. A record (one call) is at most [`MAX_RECORD`] bytes whatever its
//! fragment headers claim, and credentials and verifiers are bounded by the protocol's 400 bytes.

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::xdr::{Reader, Writer, XdrError};

/// Largest call accepted: a WRITE of [`crate::MAX_IO`] bytes plus its header, with room to spare.
pub const MAX_RECORD: usize = crate::MAX_IO as usize + 64 * 1024;
/// Largest credential or verifier body (RFC 5531).
const MAX_AUTH: usize = 400;

pub const MSG_CALL: u32 = 0;
pub const MSG_REPLY: u32 = 1;
const MSG_ACCEPTED: u32 = 0;
const MSG_DENIED: u32 = 1;
const RPC_MISMATCH: u32 = 0;
const AUTH_NONE: u32 = 0;

/// How an accepted call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accept {
    Success = 0,
    ProgUnavail = 1,
    /// Carries the supported version range.
    ProgMismatch = 2,
    ProcUnavail = 3,
    GarbageArgs = 4,
    SystemErr = 5,
}

/// A failure reading a record.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("record larger than {MAX_RECORD} bytes")]
    TooLarge,
}

/// Reads one whole record (all its fragments); `Ok(None)` on a clean end of stream between records.
pub async fn read_record<R: AsyncRead + Unpin>(rd: &mut R) -> Result<Option<Vec<u8>>, RecordError> {
    let mut record = Vec::new();
    loop {
        let mut head = [0u8; 4];
        match rd.read_exact(&mut head).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && record.is_empty() => return Ok(None),
            Err(e) => return Err(e.into()),
        }
        let word = u32::from_be_bytes(head);
        let last = word & 0x8000_0000 != 0;
        let len = (word & 0x7fff_ffff) as usize;
        if record.len() + len > MAX_RECORD {
            return Err(RecordError::TooLarge);
        }
        let start = record.len();
        record.resize(start + len, 0);
        rd.read_exact(&mut record[start..]).await?;
        if last {
            return Ok(Some(record));
        }
    }
}

/// Frames `body` as one record (a single last fragment).
pub fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 4);
    let len = u32::try_from(body.len()).unwrap_or(0x7fff_ffff) & 0x7fff_ffff;
    out.extend_from_slice(&(len | 0x8000_0000).to_be_bytes());
    out.extend_from_slice(body);
    out
}

/// The header of a call; the procedure's arguments follow in the reader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallHeader {
    pub xid: u32,
    pub prog: u32,
    pub vers: u32,
    pub proc_: u32,
}

/// What a record turned out to be.
#[derive(Debug)]
pub enum Parsed<'a> {
    /// A call with RPC version 2: dispatch it.
    Call(CallHeader, Reader<'a>),
    /// A call of another RPC version: answer `RPC_MISMATCH`.
    WrongRpcVersion(u32),
    /// Not a call, or unreadable before the xid: drop it.
    Garbage,
}

/// Parses a call header. Credentials are read and ignored: the server serves one sandbox and decides nothing
/// by uid (its exports carry their own read-only flag).
pub fn parse_call(record: &[u8]) -> Parsed<'_> {
    let mut r = Reader::new(record);
    let Ok(xid) = r.u32() else {
        return Parsed::Garbage;
    };
    let header = (|| -> Result<Option<CallHeader>, XdrError> {
        if r.u32()? != MSG_CALL {
            return Ok(None);
        }
        let rpcvers = r.u32()?;
        if rpcvers != 2 {
            return Err(XdrError::BadValue);
        }
        let prog = r.u32()?;
        let vers = r.u32()?;
        let proc_ = r.u32()?;
        for _ in 0..2 {
            let _flavor = r.u32()?;
            r.opaque(MAX_AUTH)?;
        }
        Ok(Some(CallHeader {
            xid,
            prog,
            vers,
            proc_,
        }))
    })();
    match header {
        Ok(Some(h)) => Parsed::Call(h, r),
        Ok(None) => Parsed::Garbage,
        Err(XdrError::BadValue) => Parsed::WrongRpcVersion(xid),
        Err(_) => Parsed::Garbage,
    }
}

/// The start of an accepted reply (`Success` bodies follow it).
pub fn accepted(xid: u32, stat: Accept) -> Writer {
    let mut w = Writer::new();
    w.u32(xid).u32(MSG_REPLY).u32(MSG_ACCEPTED).u32(AUTH_NONE).u32(0);
    w.u32(stat as u32);
    w
}

/// `PROG_MISMATCH` with the versions supported.
pub fn prog_mismatch(xid: u32, low: u32, high: u32) -> Writer {
    let mut w = accepted(xid, Accept::ProgMismatch);
    w.u32(low).u32(high);
    w
}

/// `MSG_DENIED` / `RPC_MISMATCH` (only RPC version 2 is spoken).
pub fn rpc_mismatch(xid: u32) -> Writer {
    let mut w = Writer::new();
    w.u32(xid)
        .u32(MSG_REPLY)
        .u32(MSG_DENIED)
        .u32(RPC_MISMATCH)
        .u32(2)
        .u32(2);
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(prog: u32, proc_: u32) -> Vec<u8> {
        let mut w = Writer::new();
        w.u32(42).u32(MSG_CALL).u32(2).u32(prog).u32(3).u32(proc_);
        w.u32(1).opaque(&[0u8; 20]).u32(0).opaque(&[]);
        w.u32(99);
        w.buf
    }

    #[test]
    fn calls_parse_and_bad_ones_do_not() {
        let rec = call(100003, 1);
        match parse_call(&rec) {
            Parsed::Call(h, mut args) => {
                assert_eq!(
                    h,
                    CallHeader {
                        xid: 42,
                        prog: 100003,
                        vers: 3,
                        proc_: 1
                    }
                );
                assert_eq!(args.u32(), Ok(99));
            }
            other => panic!("{other:?}"),
        }
        let mut v3 = rec.clone();
        v3[11] = 3;
        assert!(matches!(parse_call(&v3), Parsed::WrongRpcVersion(42)));
        assert!(matches!(parse_call(&rec[..2]), Parsed::Garbage));
        assert!(matches!(parse_call(&rec[..20]), Parsed::Garbage));
        // A credential longer than 400 bytes.
        let mut w = Writer::new();
        w.u32(1)
            .u32(MSG_CALL)
            .u32(2)
            .u32(1)
            .u32(1)
            .u32(1)
            .u32(1)
            .u32(100_000);
        assert!(matches!(parse_call(&w.buf), Parsed::Garbage));
    }

    #[tokio::test]
    async fn records_are_bounded() {
        // Two fragments make one record.
        let mut wire = Vec::new();
        wire.extend_from_slice(&3u32.to_be_bytes());
        wire.extend_from_slice(b"abc");
        wire.extend_from_slice(&(0x8000_0002u32).to_be_bytes());
        wire.extend_from_slice(b"de");
        let mut rd = &wire[..];
        assert_eq!(read_record(&mut rd).await.ok().flatten(), Some(b"abcde".to_vec()));
        assert!(read_record(&mut rd).await.ok().is_some_and(|r| r.is_none()));
        // A fragment claiming 2 GiB is refused without reading (or allocating) it.
        let wire = 0xffff_ffffu32.to_be_bytes();
        let mut rd = &wire[..];
        assert!(matches!(read_record(&mut rd).await, Err(RecordError::TooLarge)));
        // Many small fragments cannot add up past the limit either.
        let mut wire = Vec::new();
        for _ in 0..(MAX_RECORD / 65536 + 2) {
            wire.extend_from_slice(&65536u32.to_be_bytes());
            wire.extend_from_slice(&[0u8; 65536]);
        }
        let mut rd = &wire[..];
        assert!(matches!(read_record(&mut rd).await, Err(RecordError::TooLarge)));
        assert_eq!(&frame(b"xy")[..4], &0x8000_0002u32.to_be_bytes());
    }
}
