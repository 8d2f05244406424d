//! An NFSv3 server over a prefix of an S3 bucket. It knows nothing of sandboxes: the caller gives it a TCP
//! listener, the bucket (endpoint and credentials) and the exports (prefix, read-only flag, a key), and a
//! kernel NFS client mounts them. The credentials stay in this process; the client only ever sees file
//! handles, names and bytes.
//!
//! Enforcement is here, not in the client: every name is checked and every key is built as the export's
//! prefix plus checked names (a handle the server did not hand out is stale), and a read-only export refuses
//! every change with ROFS whatever the client sends.
//!
//! # Layout
//! - [`xdr`]: bounded XDR decoding, encoding.
//! - [`rpc`]: ONC RPC record marking (bounded records), call and reply headers.
//! - [`proto`]: MOUNT v3 ([`proto::mount`]) and NFS v3 ([`proto::nfs3`]): arguments, results, file handles.
//! - [`fs`]: the file system of one export ([`fs::Export`]): lookups, attributes, listings ([`fs`]), reads
//!   through a block cache ([`fs::read`]), whole-object writes through temporary files ([`fs::write`]), file
//!   ids and their table ([`fs::handles`]).
//! - [`s3`]: the bucket client ([`s3::Bucket`]): object_store plus signed directory-marker requests, every
//!   request under a deadline.
//! - [`server`]: the TCP server ([`server::serve`]) and the changeable set of exports ([`server::ExportSet`]).

pub mod fs;
pub mod proto;
pub mod rpc;
pub mod s3;
pub mod server;
pub mod xdr;

pub use fs::handles::{HandleTable, LogTable, MemoryTable};
pub use fs::{Counters, Export, ExportSpec, Limits, Status};
pub use proto::export_name;
pub use s3::{Bucket, BucketOptions};
pub use server::{ExportSet, ServerLimits, serve};

/// Largest READ or WRITE (and `rsize`/`wsize` for the client): 1 MiB.
pub const MAX_IO: u32 = 1 << 20;
