//! Chunk ids and the optional client-side encryption.
//!
//! Without a key a chunk's id is SHA-256 of its plaintext and the chunk is stored as is. With a key, two subkeys
//! are derived from it (HMAC-SHA256 of the key over fixed labels): one keys the chunk ids (HMAC-SHA256 of the
//! plaintext, so the bucket's operator cannot confirm a guessed plaintext, yet equal plaintexts still share one
//! chunk under one key), the other seals every chunk and manifest with XChaCha20-Poly1305 under a random
//! 192-bit nonce: `"HSE1" || nonce (24 bytes) || ciphertext || tag (16 bytes)`. The associated data binds a
//! sealed blob to where it belongs (`chunk:<id>`, `manifest:<name>`), so blobs cannot be swapped.

use std::fmt;

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::config::StoreKey;

const MAGIC: &[u8; 4] = b"HSE1";
const NONCE_LEN: usize = 24;
const TAG_LEN: usize = 16;
const KEY_CHECK_AAD: &[u8] = b"hearth-store key check";
const KEY_CHECK_PLAINTEXT: &[u8] = b"hearth-store key check v1";

/// A chunk's id: SHA-256 of the plaintext, or its keyed HMAC-SHA256 in an encrypted store.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub(crate) [u8; 32]);

impl ChunkId {
    /// Parses 64 lowercase hex characters.
    pub fn parse(hex_id: &str) -> Option<ChunkId> {
        if hex_id.len() != 64 || hex_id.bytes().any(|b| b.is_ascii_uppercase()) {
            return None;
        }
        let mut id = [0u8; 32];
        hex::decode_to_slice(hex_id, &mut id).ok()?;
        Some(ChunkId(id))
    }

    /// 64 lowercase hex characters.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", &self.to_hex()[..16])
    }
}

/// Hashing and sealing for one store: plaintext, or keyed and encrypted.
pub(crate) enum Codec {
    Plain,
    Sealed {
        id_key: [u8; 32],
        aead: Box<XChaCha20Poly1305>,
    },
}

impl Codec {
    pub(crate) fn new(key: Option<&StoreKey>) -> Codec {
        match key {
            None => Codec::Plain,
            Some(k) => {
                let id_key = derive(&k.0, b"hearth-store v1 chunk id");
                let aead_key = derive(&k.0, b"hearth-store v1 aead");
                Codec::Sealed {
                    id_key,
                    aead: Box::new(XChaCha20Poly1305::new(&aead_key.into())),
                }
            }
        }
    }

    pub(crate) fn encrypted(&self) -> bool {
        matches!(self, Codec::Sealed { .. })
    }

    /// The id of a chunk with these plaintext bytes.
    pub(crate) fn chunk_id(&self, data: &[u8]) -> ChunkId {
        match self {
            Codec::Plain => ChunkId(Sha256::digest(data).into()),
            Codec::Sealed { id_key, .. } => {
                let mut mac =
                    <Hmac<Sha256> as Mac>::new_from_slice(id_key).expect("HMAC takes any key length");
                mac.update(data);
                ChunkId(mac.finalize().into_bytes().into())
            }
        }
    }

    /// The bytes stored for a chunk.
    pub(crate) fn encode_chunk(&self, id: &ChunkId, data: bytes::Bytes) -> bytes::Bytes {
        match self {
            Codec::Plain => data,
            Codec::Sealed { aead, .. } => seal(aead, &chunk_aad(id), &data).into(),
        }
    }

    /// The size of the stored form of a chunk of `len` plaintext bytes.
    pub(crate) fn stored_len(&self, len: usize) -> u64 {
        match self {
            Codec::Plain => len as u64,
            Codec::Sealed { .. } => (MAGIC.len() + NONCE_LEN + len + TAG_LEN) as u64,
        }
    }

    /// Checks and opens a stored chunk: authentication (when sealed), length and digest.
    pub(crate) fn decode_chunk(
        &self,
        id: &ChunkId,
        stored: bytes::Bytes,
        expected_len: usize,
    ) -> Result<bytes::Bytes, &'static str> {
        let plain = match self {
            Codec::Plain => stored,
            Codec::Sealed { aead, .. } => open(aead, &chunk_aad(id), &stored)
                .ok_or("authentication failed")?
                .into(),
        };
        if plain.len() != expected_len {
            return Err("wrong length");
        }
        if self.chunk_id(&plain) != *id {
            return Err("digest mismatch");
        }
        Ok(plain)
    }

    /// The bytes stored for a manifest (plaintext JSON, or sealed and bound to the object's name).
    pub(crate) fn encode_manifest(&self, name: &str, json: Vec<u8>) -> Vec<u8> {
        match self {
            Codec::Plain => json,
            Codec::Sealed { aead, .. } => seal(aead, &manifest_aad(name), &json),
        }
    }

    pub(crate) fn decode_manifest(&self, name: &str, stored: &[u8]) -> Result<Vec<u8>, &'static str> {
        match self {
            Codec::Plain if stored.starts_with(MAGIC) => Err("encrypted, but the store has no key"),
            Codec::Plain => Ok(stored.to_vec()),
            Codec::Sealed { aead, .. } => {
                open(aead, &manifest_aad(name), stored).ok_or("authentication failed")
            }
        }
    }

    /// A sealed known plaintext kept in the store's marker, to refuse a wrong key at open.
    pub(crate) fn key_check(&self) -> Option<Vec<u8>> {
        match self {
            Codec::Plain => None,
            Codec::Sealed { aead, .. } => Some(seal(aead, KEY_CHECK_AAD, KEY_CHECK_PLAINTEXT)),
        }
    }

    pub(crate) fn verify_key_check(&self, sealed: &[u8]) -> bool {
        match self {
            Codec::Plain => false,
            Codec::Sealed { aead, .. } => {
                open(aead, KEY_CHECK_AAD, sealed).is_some_and(|p| p == KEY_CHECK_PLAINTEXT)
            }
        }
    }
}

fn derive(master: &[u8; 32], label: &[u8]) -> [u8; 32] {
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(master).expect("HMAC takes any key length");
    mac.update(label);
    mac.finalize().into_bytes().into()
}

fn chunk_aad(id: &ChunkId) -> Vec<u8> {
    [b"chunk:".as_slice(), &id.0].concat()
}

fn manifest_aad(name: &str) -> Vec<u8> {
    [b"manifest:".as_slice(), name.as_bytes()].concat()
}

fn seal(aead: &XChaCha20Poly1305, aad: &[u8], plaintext: &[u8]) -> Vec<u8> {
    let nonce: [u8; NONCE_LEN] = rand::random();
    let ciphertext = aead
        .encrypt(XNonce::from_slice(&nonce), Payload { msg: plaintext, aad })
        .expect("XChaCha20-Poly1305 encryption of an in-memory buffer cannot fail");
    let mut out = Vec::with_capacity(MAGIC.len() + NONCE_LEN + ciphertext.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&ciphertext);
    out
}

fn open(aead: &XChaCha20Poly1305, aad: &[u8], sealed: &[u8]) -> Option<Vec<u8>> {
    if sealed.len() < MAGIC.len() + NONCE_LEN + TAG_LEN || !sealed.starts_with(MAGIC) {
        return None;
    }
    let (nonce, ciphertext) = sealed[MAGIC.len()..].split_at(NONCE_LEN);
    aead.decrypt(XNonce::from_slice(nonce), Payload { msg: ciphertext, aad })
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_ids_are_sha256() {
        let c = Codec::new(None);
        let id = c.chunk_id(b"abc");
        assert_eq!(
            id.to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(ChunkId::parse(&id.to_hex()), Some(id));
        assert_eq!(ChunkId::parse(&id.to_hex().to_uppercase()), None);
        let data = bytes::Bytes::from_static(b"abc");
        assert!(c.decode_chunk(&id, data.clone(), 3).is_ok());
        assert_eq!(
            c.decode_chunk(&id, bytes::Bytes::from_static(b"abd"), 3),
            Err("digest mismatch")
        );
        assert_eq!(c.decode_chunk(&id, data, 4), Err("wrong length"));
    }

    #[test]
    fn sealed_chunks_and_manifests() {
        let a = Codec::new(Some(&StoreKey([1; 32])));
        let b = Codec::new(Some(&StoreKey([2; 32])));
        let data = bytes::Bytes::from(vec![7u8; 4096]);
        let id = a.chunk_id(&data);
        assert_ne!(
            id,
            Codec::new(None).chunk_id(&data),
            "keyed ids differ from plain SHA-256"
        );
        assert_ne!(id, b.chunk_id(&data), "ids depend on the key");
        let sealed = a.encode_chunk(&id, data.clone());
        assert_eq!(sealed.len() as u64, a.stored_len(4096));
        assert_ne!(
            a.encode_chunk(&id, data.clone()),
            sealed,
            "a fresh nonce each time"
        );
        assert!(
            !sealed.windows(64).any(|w| w == &data[..64]),
            "no plaintext in the sealed chunk"
        );
        assert_eq!(
            a.decode_chunk(&id, sealed.clone(), 4096).as_deref(),
            Ok(&data[..])
        );
        assert_eq!(
            b.decode_chunk(&id, sealed.clone(), 4096),
            Err("authentication failed")
        );
        let mut flipped = sealed.to_vec();
        flipped[100] ^= 1;
        assert_eq!(
            a.decode_chunk(&id, flipped.into(), 4096),
            Err("authentication failed")
        );
        let other = a.chunk_id(b"x");
        assert_eq!(
            a.decode_chunk(&other, sealed, 4096),
            Err("authentication failed"),
            "bound to its id"
        );

        let m = a.encode_manifest("obj", b"{}".to_vec());
        assert_eq!(a.decode_manifest("obj", &m), Ok(b"{}".to_vec()));
        assert!(a.decode_manifest("other", &m).is_err(), "bound to its name");
        assert!(Codec::new(None).decode_manifest("obj", &m).is_err());

        let check = a.key_check().expect("sealed");
        assert!(a.verify_key_check(&check) && !b.verify_key_check(&check));
    }
}
