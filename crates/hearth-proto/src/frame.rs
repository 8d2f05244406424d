//! Frame encoding and an incremental, allocation-bounded decoder.
//!
//! Wire layout: `b"HRTH"` | `u32 LE header_len` | `u32 LE data_len` | header (JSON) | data (raw bytes).

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::msg::Header;

/// The four bytes that start every frame.
pub const MAGIC: [u8; 4] = *b"HRTH";
/// Length of the fixed prefix: magic and the two lengths.
pub const PREFIX_LEN: usize = 12;
/// Largest accepted JSON header.
pub const MAX_HEADER_LEN: usize = 64 * 1024;
/// Largest accepted data section.
pub const MAX_DATA_LEN: usize = 256 * 1024;
/// Largest possible frame on the wire.
pub const MAX_FRAME_LEN: usize = PREFIX_LEN + MAX_HEADER_LEN + MAX_DATA_LEN;

/// Why a frame could not be encoded.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// The JSON header would exceed [`MAX_HEADER_LEN`].
    #[error("frame header of {0} bytes exceeds the 64 KiB limit")]
    HeaderTooLarge(usize),
    /// The data section would exceed [`MAX_DATA_LEN`].
    #[error("frame data of {0} bytes exceeds the 256 KiB limit")]
    DataTooLarge(usize),
    #[error("header serialisation: {0}")]
    Json(#[from] serde_json::Error),
}

/// A frame ready to be written: the prefix with the header, and the data (kept apart to avoid a copy).
#[derive(Debug, Clone)]
pub struct EncodedFrame {
    pub head: Bytes,
    pub data: Bytes,
}

impl EncodedFrame {
    /// Total length on the wire.
    pub fn wire_len(&self) -> usize {
        self.head.len() + self.data.len()
    }

    /// The frame as one contiguous buffer.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.wire_len());
        v.extend_from_slice(&self.head);
        v.extend_from_slice(&self.data);
        v
    }
}

/// Encode a message on `stream` with `data` as its data section.
pub fn encode<M: Serialize>(stream: u32, msg: &M, data: Bytes) -> Result<EncodedFrame, EncodeError> {
    let header = serde_json::to_vec(&Header { stream, msg })?;
    if header.len() > MAX_HEADER_LEN {
        return Err(EncodeError::HeaderTooLarge(header.len()));
    }
    if data.len() > MAX_DATA_LEN {
        return Err(EncodeError::DataTooLarge(data.len()));
    }
    let mut head = BytesMut::with_capacity(PREFIX_LEN + header.len());
    head.put_slice(&MAGIC);
    // Both lengths are bounded by the checks above, far below u32::MAX.
    head.put_u32_le(header.len() as u32);
    head.put_u32_le(data.len() as u32);
    head.put_slice(&header);
    Ok(EncodedFrame {
        head: head.freeze(),
        data,
    })
}

/// A frame as read from the wire: header bytes not yet parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    pub header: Bytes,
    pub data: Bytes,
}

impl RawFrame {
    /// Parse the header as a typed message.
    pub fn parse<M: DeserializeOwned>(&self) -> Result<Header<M>, serde_json::Error> {
        serde_json::from_slice(&self.header)
    }
}

/// A problem found while decoding. The decoder has already moved past the offending bytes, so decoding can
/// go on (the caller decides whether the problem is fatal).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Bytes that do not start a frame were skipped while looking for the next magic.
    #[error("skipped {0} bytes of garbage before a frame magic")]
    Garbage(usize),
    /// A frame announced a header longer than [`MAX_HEADER_LEN`]; its magic was skipped.
    #[error("frame header length {0} exceeds the 64 KiB limit")]
    HeaderTooLarge(u32),
    /// A frame announced a data section longer than [`MAX_DATA_LEN`]; its magic was skipped.
    #[error("frame data length {0} exceeds the 256 KiB limit")]
    DataTooLarge(u32),
}

/// Incremental decoder. Feed bytes with [`FrameDecoder::extend`] (or read into [`FrameDecoder::buf_mut`]),
/// then call [`FrameDecoder::decode`] until it returns `Ok(None)`.
///
/// Memory is bounded: nothing is allocated from announced lengths, and the caller only needs to read while
/// [`FrameDecoder::wants`] is positive, which never asks for more than one maximal frame.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: BytesMut,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append bytes received from the peer.
    pub fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The internal buffer, to read into directly.
    pub fn buf_mut(&mut self) -> &mut BytesMut {
        &mut self.buf
    }

    /// Bytes buffered and not yet decoded.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// How many more bytes the decoder can use before it must be drained with `decode` (0 = call decode).
    pub fn wants(&self) -> usize {
        MAX_FRAME_LEN.saturating_sub(self.buf.len())
    }

    /// Decode the next complete frame, if any.
    pub fn decode(&mut self) -> Result<Option<RawFrame>, FrameError> {
        // Resynchronise: find the magic (or a prefix of it at the very end of the buffer).
        let start = find_magic(&self.buf);
        if start > 0 {
            self.buf.advance(start);
            return Err(FrameError::Garbage(start));
        }
        if self.buf.len() < PREFIX_LEN {
            return Ok(None);
        }
        let header_len = u32::from_le_bytes([self.buf[4], self.buf[5], self.buf[6], self.buf[7]]);
        let data_len = u32::from_le_bytes([self.buf[8], self.buf[9], self.buf[10], self.buf[11]]);
        if header_len as usize > MAX_HEADER_LEN {
            self.buf.advance(1);
            return Err(FrameError::HeaderTooLarge(header_len));
        }
        if data_len as usize > MAX_DATA_LEN {
            self.buf.advance(1);
            return Err(FrameError::DataTooLarge(data_len));
        }
        let total = PREFIX_LEN + header_len as usize + data_len as usize;
        if self.buf.len() < total {
            return Ok(None);
        }
        let mut frame = self.buf.split_to(total);
        frame.advance(PREFIX_LEN);
        let header = frame.split_to(header_len as usize).freeze();
        let data = frame.freeze();
        Ok(Some(RawFrame { header, data }))
    }
}

/// Offset of the first possible frame start: a full magic, or a magic prefix that ends the buffer.
fn find_magic(buf: &[u8]) -> usize {
    let mut i = 0;
    while i < buf.len() {
        let rest = &buf[i..];
        let n = rest.len().min(MAGIC.len());
        if rest[..n] == MAGIC[..n] {
            return i;
        }
        i += 1;
    }
    buf.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{GuestMsg, HostMsg};

    fn decode_all(dec: &mut FrameDecoder) -> (Vec<RawFrame>, Vec<FrameError>) {
        let mut frames = Vec::new();
        let mut errors = Vec::new();
        loop {
            match dec.decode() {
                Ok(Some(f)) => frames.push(f),
                Ok(None) => return (frames, errors),
                Err(e) => errors.push(e),
            }
        }
    }

    #[test]
    fn round_trip_with_data() {
        let f = encode(7, &GuestMsg::Stdout, Bytes::from_static(b"hello\0world")).expect("encode");
        let mut dec = FrameDecoder::new();
        dec.extend(&f.to_vec());
        let raw = dec.decode().expect("decode").expect("frame");
        assert_eq!(&raw.data[..], b"hello\0world");
        let h = raw.parse::<GuestMsg>().expect("parse");
        assert_eq!(h.stream, 7);
        assert_eq!(h.msg, GuestMsg::Stdout);
        assert_eq!(dec.decode(), Ok(None));
        assert_eq!(dec.buffered(), 0);
    }

    #[test]
    fn byte_by_byte_feeding() {
        let msgs = [
            HostMsg::Hello {
                version: 1,
                nonce: 42,
                post_restore: None,
            },
            HostMsg::Mkdir {
                path: "/a/b".into(),
                parents: true,
            },
            HostMsg::Credit { bytes: 1 << 20 },
        ];
        let mut wire = Vec::new();
        for (i, m) in msgs.iter().enumerate() {
            wire.extend(encode(i as u32, m, Bytes::new()).expect("encode").to_vec());
        }
        let mut dec = FrameDecoder::new();
        let mut got = Vec::new();
        for b in wire {
            dec.extend(&[b]);
            while let Some(f) = dec.decode().expect("no error") {
                got.push(f.parse::<HostMsg>().expect("parse").msg);
            }
        }
        assert_eq!(got, msgs);
    }

    #[test]
    fn oversize_lengths_refused_without_allocating() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&MAGIC);
        wire.extend_from_slice(&u32::MAX.to_le_bytes());
        wire.extend_from_slice(&0u32.to_le_bytes());
        let mut dec = FrameDecoder::new();
        dec.extend(&wire);
        let cap_before = dec.buf_mut().capacity();
        assert_eq!(dec.decode(), Err(FrameError::HeaderTooLarge(u32::MAX)));
        assert!(dec.buf_mut().capacity() <= cap_before);

        let mut wire = Vec::new();
        wire.extend_from_slice(&MAGIC);
        wire.extend_from_slice(&2u32.to_le_bytes());
        wire.extend_from_slice(&(MAX_DATA_LEN as u32 + 1).to_le_bytes());
        let mut dec = FrameDecoder::new();
        dec.extend(&wire);
        assert_eq!(
            dec.decode(),
            Err(FrameError::DataTooLarge(MAX_DATA_LEN as u32 + 1))
        );
        assert!(dec.buf_mut().capacity() < 1024);
    }

    #[test]
    fn encode_refuses_oversize() {
        let big = Bytes::from(vec![0u8; MAX_DATA_LEN + 1]);
        assert!(matches!(
            encode(1, &GuestMsg::Stdout, big),
            Err(EncodeError::DataTooLarge(_))
        ));
        let path = "/".repeat(MAX_HEADER_LEN);
        assert!(matches!(
            encode(1, &HostMsg::Stat { path }, Bytes::new()),
            Err(EncodeError::HeaderTooLarge(_))
        ));
        // Exactly at the data limit is fine.
        assert!(encode(1, &GuestMsg::Stdout, Bytes::from(vec![1u8; MAX_DATA_LEN])).is_ok());
    }

    #[test]
    fn garbage_then_resync() {
        let good = encode(3, &GuestMsg::Pong, Bytes::new()).expect("encode").to_vec();
        let mut wire = b"xxHRTjunkHRjunk".to_vec();
        // A truncated frame whose magic is found and skipped because its lengths are absurd.
        wire.extend_from_slice(&MAGIC);
        wire.extend_from_slice(&[0xff; 8]);
        wire.extend_from_slice(&good);
        let mut dec = FrameDecoder::new();
        dec.extend(&wire);
        let (frames, errors) = decode_all(&mut dec);
        assert_eq!(frames.len(), 1);
        assert_eq!(frames[0].parse::<GuestMsg>().expect("parse").msg, GuestMsg::Pong);
        assert!(errors.iter().any(|e| matches!(e, FrameError::Garbage(_))));
        assert!(errors.iter().any(|e| matches!(e, FrameError::HeaderTooLarge(_))));
    }

    #[test]
    fn partial_magic_at_end_is_kept() {
        let good = encode(5, &GuestMsg::Ok, Bytes::new()).expect("encode").to_vec();
        let mut dec = FrameDecoder::new();
        dec.extend(b"garbageHR");
        assert_eq!(dec.decode(), Err(FrameError::Garbage(7)));
        assert_eq!(dec.decode(), Ok(None));
        // Complete the bogus "HR" prefix with something else, then a real frame.
        dec.extend(b"X");
        dec.extend(&good);
        let (frames, _) = decode_all(&mut dec);
        assert_eq!(frames.len(), 1);
    }

    #[test]
    fn unknown_message_type_is_a_parse_error_not_a_panic() {
        let raw = RawFrame {
            header: Bytes::from_static(br#"{"stream":1,"msg":{"type":"nope"}}"#),
            data: Bytes::new(),
        };
        assert!(raw.parse::<GuestMsg>().is_err());
        let raw = RawFrame {
            header: Bytes::from_static(b"\xff\xfe"),
            data: Bytes::new(),
        };
        assert!(raw.parse::<HostMsg>().is_err());
    }

    #[test]
    fn unknown_error_kind_maps_to_other() {
        let raw = RawFrame {
            header: Bytes::from_static(
                br#"{"stream":1,"msg":{"type":"error","kind":"quota","message":"m"}}"#,
            ),
            data: Bytes::new(),
        };
        let h = raw.parse::<GuestMsg>().expect("parse");
        assert_eq!(h.msg, GuestMsg::error(crate::ErrorKind::Other, "m"));
    }
}
