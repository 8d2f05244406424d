//! XDR (RFC 4506) encoding and a bounded decoder.
//!
//! The decoder reads from one RPC record that is already in memory (its size bounded by [`crate::rpc`]), so a
//! length field can never make it allocate more than the record holds: every variable-length item is checked
//! against what is left *and* against the item's own maximum before anything is copied.

/// A decoding failure: the call's arguments are malformed (the RPC answer is `GARBAGE_ARGS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum XdrError {
    #[error("truncated")]
    Truncated,
    #[error("a length exceeds its maximum")]
    TooLong,
    #[error("a value is out of range")]
    BadValue,
}

/// Reads XDR items from a byte slice.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl std::fmt::Debug for Reader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reader({} bytes left)", self.remaining())
    }
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], XdrError> {
        if n > self.remaining() {
            return Err(XdrError::Truncated);
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn u32(&mut self) -> Result<u32, XdrError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn u64(&mut self) -> Result<u64, XdrError> {
        let hi = u64::from(self.u32()?);
        let lo = u64::from(self.u32()?);
        Ok(hi << 32 | lo)
    }

    pub fn bool(&mut self) -> Result<bool, XdrError> {
        match self.u32()? {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(XdrError::BadValue),
        }
    }

    /// Fixed-length opaque data (`opaque x[N]`), padded to a multiple of 4.
    pub fn fixed<const N: usize>(&mut self) -> Result<[u8; N], XdrError> {
        let b = self.take(N)?;
        self.take(pad(N))?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    /// Variable-length opaque data (`opaque x<max>`), borrowed from the record.
    pub fn opaque(&mut self, max: usize) -> Result<&'a [u8], XdrError> {
        let len = self.u32()? as usize;
        if len > max {
            return Err(XdrError::TooLong);
        }
        let b = self.take(len)?;
        self.take(pad(len))?;
        Ok(b)
    }
}

/// Padding after `len` bytes of opaque data.
fn pad(len: usize) -> usize {
    (4 - len % 4) % 4
}

/// Appends XDR items to a buffer.
#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Writer {
        Writer::default()
    }

    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u32(u32::from(v))
    }

    /// Fixed-length opaque data.
    pub fn fixed(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self.buf.extend_from_slice(&[0u8; 3][..pad(b.len())]);
        self
    }

    /// Variable-length opaque data (callers keep `b` under 4 GiB: every producer here is bounded far below).
    pub fn opaque(&mut self, b: &[u8]) -> &mut Self {
        self.u32(u32::try_from(b.len()).unwrap_or(u32::MAX));
        self.fixed(b)
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_bounds() {
        let mut w = Writer::new();
        w.u32(7)
            .u64(1 << 40)
            .bool(true)
            .opaque(b"abcde")
            .fixed(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(w.len() % 4, 0);
        let mut r = Reader::new(&w.buf);
        assert_eq!(r.u32(), Ok(7));
        assert_eq!(r.u64(), Ok(1 << 40));
        assert_eq!(r.bool(), Ok(true));
        assert_eq!(r.opaque(5), Ok(&b"abcde"[..]));
        assert_eq!(r.fixed::<8>(), Ok([1, 2, 3, 4, 5, 6, 7, 8]));
        assert_eq!(r.remaining(), 0);
        assert_eq!(r.u32(), Err(XdrError::Truncated));

        // A huge length is refused before anything is read, whatever the record holds.
        let mut w = Writer::new();
        w.u32(u32::MAX);
        assert_eq!(Reader::new(&w.buf).opaque(1 << 20), Err(XdrError::TooLong));
        let mut w = Writer::new();
        w.u32(100).u32(1);
        assert_eq!(Reader::new(&w.buf).opaque(1 << 20), Err(XdrError::Truncated));
        assert_eq!(Reader::new(&[0, 0, 0, 2]).bool(), Err(XdrError::BadValue));
    }
}
