//! A small NFSv3 client that speaks raw RPC over TCP (the tests' stand-in for a guest that bypasses its kernel
//! client), and a fixture: a real S3 server, a bucket client, a running mount server.
#![allow(dead_code, clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hearth_mount::xdr::{Reader, Writer};
use hearth_mount::{Bucket, BucketOptions, Export, ExportSet, ExportSpec, Limits, MemoryTable, ServerLimits};
use hearth_testkit::s3::{ACCESS_KEY_ID, REGION, S3Kind, S3Server, SECRET_ACCESS_KEY};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub const NFS: u32 = 100003;
pub const MOUNT: u32 = 100005;

pub struct Client {
    stream: TcpStream,
    xid: u32,
}

impl Client {
    pub async fn connect(addr: std::net::SocketAddr) -> Client {
        Client {
            stream: TcpStream::connect(addr).await.unwrap(),
            xid: 1,
        }
    }

    pub fn stream_mut(&mut self) -> &mut TcpStream {
        &mut self.stream
    }

    /// Sends a raw record and reads the reply record.
    pub async fn raw(&mut self, record: &[u8]) -> std::io::Result<Vec<u8>> {
        let mut framed = ((record.len() as u32) | 0x8000_0000).to_be_bytes().to_vec();
        framed.extend_from_slice(record);
        self.stream.write_all(&framed).await?;
        self.read_reply().await
    }

    pub async fn read_reply(&mut self) -> std::io::Result<Vec<u8>> {
        let mut head = [0u8; 4];
        tokio::time::timeout(Duration::from_secs(30), self.stream.read_exact(&mut head))
            .await
            .map_err(|_| std::io::Error::other("no reply in 30 s"))??;
        let len = (u32::from_be_bytes(head) & 0x7fff_ffff) as usize;
        let mut body = vec![0u8; len];
        self.stream.read_exact(&mut body).await?;
        Ok(body)
    }

    /// A call; returns (accept_stat, result body).
    pub async fn call(&mut self, prog: u32, proc_: u32, args: &[u8]) -> (u32, Vec<u8>) {
        self.xid += 1;
        let mut w = Writer::new();
        let vers = 3;
        w.u32(self.xid).u32(0).u32(2).u32(prog).u32(vers).u32(proc_);
        // AUTH_UNIX as a kernel sends it (uid 0).
        let mut cred = Writer::new();
        cred.u32(0).opaque(b"guest").u32(0).u32(0).u32(0);
        w.u32(1).opaque(&cred.buf).u32(0).opaque(&[]);
        w.buf.extend_from_slice(args);
        let reply = self.raw(&w.buf).await.unwrap();
        let mut r = Reader::new(&reply);
        assert_eq!(r.u32().unwrap(), self.xid);
        assert_eq!(r.u32().unwrap(), 1, "a reply");
        assert_eq!(r.u32().unwrap(), 0, "accepted");
        r.u32().unwrap();
        r.opaque(400).unwrap();
        let stat = r.u32().unwrap();
        let rest = reply[reply.len() - r.remaining()..].to_vec();
        (stat, rest)
    }

    /// NFS call that must be accepted; returns (nfsstat3, rest).
    pub async fn nfs(&mut self, proc_: u32, args: &[u8]) -> (u32, Vec<u8>) {
        let (accept, body) = self.call(NFS, proc_, args).await;
        assert_eq!(accept, 0, "NFS proc {proc_} accepted");
        let mut r = Reader::new(&body);
        let st = r.u32().unwrap();
        (st, body[4..].to_vec())
    }

    pub async fn mnt(&mut self, path: &str) -> Result<Vec<u8>, u32> {
        let mut w = Writer::new();
        w.opaque(path.as_bytes());
        let (accept, body) = self.call(MOUNT, 1, &w.buf).await;
        assert_eq!(accept, 0);
        let mut r = Reader::new(&body);
        match r.u32().unwrap() {
            0 => Ok(r.opaque(64).unwrap().to_vec()),
            e => Err(e),
        }
    }

    /// LOOKUP → (status, handle).
    pub async fn lookup(&mut self, dir: &[u8], name: &[u8]) -> (u32, Vec<u8>) {
        let mut w = Writer::new();
        w.opaque(dir).opaque(name);
        let (st, body) = self.nfs(3, &w.buf).await;
        if st != 0 {
            return (st, Vec::new());
        }
        (st, Reader::new(&body).opaque(64).unwrap().to_vec())
    }

    pub async fn getattr(&mut self, fh: &[u8]) -> (u32, Option<(u32, u64)>) {
        let mut w = Writer::new();
        w.opaque(fh);
        let (st, body) = self.nfs(1, &w.buf).await;
        if st != 0 {
            return (st, None);
        }
        let mut r = Reader::new(&body);
        let ftype = r.u32().unwrap();
        for _ in 0..4 {
            r.u32().unwrap();
        }
        (st, Some((ftype, r.u64().unwrap())))
    }

    pub async fn read(&mut self, fh: &[u8], offset: u64, count: u32) -> (u32, Vec<u8>) {
        let mut w = Writer::new();
        w.opaque(fh).u64(offset).u32(count);
        let (st, body) = self.nfs(6, &w.buf).await;
        if st != 0 {
            return (st, Vec::new());
        }
        let mut r = Reader::new(&body);
        if r.bool().unwrap() {
            for _ in 0..21 {
                r.u32().unwrap();
            }
        }
        let _count = r.u32().unwrap();
        let _eof = r.bool().unwrap();
        (st, r.opaque(1 << 20).unwrap().to_vec())
    }

    pub async fn write(&mut self, fh: &[u8], offset: u64, data: &[u8], stable: u32) -> u32 {
        let mut w = Writer::new();
        w.opaque(fh)
            .u64(offset)
            .u32(data.len() as u32)
            .u32(stable)
            .opaque(data);
        self.nfs(7, &w.buf).await.0
    }

    pub async fn commit(&mut self, fh: &[u8]) -> u32 {
        let mut w = Writer::new();
        w.opaque(fh).u64(0).u32(0);
        self.nfs(21, &w.buf).await.0
    }

    /// CREATE UNCHECKED with no attributes → (status, handle).
    pub async fn create(&mut self, dir: &[u8], name: &[u8]) -> (u32, Vec<u8>) {
        let mut w = Writer::new();
        w.opaque(dir).opaque(name).u32(0);
        sattr_none(&mut w);
        let (st, body) = self.nfs(8, &w.buf).await;
        if st != 0 {
            return (st, Vec::new());
        }
        let mut r = Reader::new(&body);
        assert!(r.bool().unwrap());
        (st, r.opaque(64).unwrap().to_vec())
    }

    pub async fn mkdir(&mut self, dir: &[u8], name: &[u8]) -> u32 {
        let mut w = Writer::new();
        w.opaque(dir).opaque(name);
        sattr_none(&mut w);
        self.nfs(9, &w.buf).await.0
    }

    pub async fn symlink(&mut self, dir: &[u8], name: &[u8], target: &[u8]) -> u32 {
        let mut w = Writer::new();
        w.opaque(dir).opaque(name);
        sattr_none(&mut w);
        w.opaque(target);
        self.nfs(10, &w.buf).await.0
    }

    pub async fn remove(&mut self, dir: &[u8], name: &[u8]) -> u32 {
        let mut w = Writer::new();
        w.opaque(dir).opaque(name);
        self.nfs(12, &w.buf).await.0
    }

    pub async fn rmdir(&mut self, dir: &[u8], name: &[u8]) -> u32 {
        let mut w = Writer::new();
        w.opaque(dir).opaque(name);
        self.nfs(13, &w.buf).await.0
    }

    pub async fn rename(&mut self, dir: &[u8], from: &[u8], to_dir: &[u8], to: &[u8]) -> u32 {
        let mut w = Writer::new();
        w.opaque(dir).opaque(from).opaque(to_dir).opaque(to);
        self.nfs(14, &w.buf).await.0
    }

    pub async fn truncate(&mut self, fh: &[u8], size: u64) -> u32 {
        let mut w = Writer::new();
        w.opaque(fh)
            .bool(false)
            .bool(false)
            .bool(false)
            .bool(true)
            .u64(size)
            .u32(0)
            .u32(0)
            .bool(false);
        self.nfs(2, &w.buf).await.0
    }

    /// READDIRPLUS until the end → names.
    pub async fn readdir(&mut self, dir: &[u8]) -> (u32, Vec<String>) {
        let mut names = Vec::new();
        let mut cookie = 0u64;
        loop {
            let mut w = Writer::new();
            w.opaque(dir).u64(cookie).fixed(&[0; 8]).u32(8192).u32(32768);
            let (st, body) = self.nfs(17, &w.buf).await;
            if st != 0 {
                return (st, names);
            }
            let mut r = Reader::new(&body);
            if r.bool().unwrap() {
                for _ in 0..21 {
                    r.u32().unwrap();
                }
            }
            r.fixed::<8>().unwrap();
            while r.bool().unwrap() {
                r.u64().unwrap();
                names.push(String::from_utf8(r.opaque(1024).unwrap().to_vec()).unwrap());
                cookie = r.u64().unwrap();
                if r.bool().unwrap() {
                    for _ in 0..21 {
                        r.u32().unwrap();
                    }
                }
                if r.bool().unwrap() {
                    r.opaque(64).unwrap();
                }
            }
            if r.bool().unwrap() {
                return (0, names);
            }
        }
    }
}

fn sattr_none(w: &mut Writer) {
    w.bool(false).bool(false).bool(false).bool(false).u32(0).u32(0);
}

/// A handle of export `key` for file id `id` (forged).
pub fn handle(key: u64, id: u64) -> Vec<u8> {
    let mut fh = key.to_be_bytes().to_vec();
    fh.extend_from_slice(&id.to_be_bytes());
    fh
}

/// Status values.
pub const OK: u32 = 0;
pub const PERM: u32 = 1;
pub const NOENT: u32 = 2;
pub const IO: u32 = 5;
pub const EXIST: u32 = 17;
pub const XDEV: u32 = 18;
pub const ISDIR: u32 = 21;
pub const INVAL: u32 = 22;
pub const ROFS: u32 = 30;
pub const NOTEMPTY: u32 = 66;
pub const STALE: u32 = 70;
pub const BADHANDLE: u32 = 10001;

pub struct Fixture {
    pub s3: S3Server,
    pub bucket: Bucket,
    pub exports: Arc<ExportSet>,
    pub addr: std::net::SocketAddr,
    pub tmp: tempfile::TempDir,
    pub server: tokio::task::JoinHandle<()>,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.server.abort();
    }
}

pub fn config(s3: &S3Server) -> hearth_store::StoreConfig {
    let env = s3.env();
    hearth_store::StoreConfig::from_url_with_env(&s3.url(""), |k| {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
    })
    .unwrap()
}

impl Fixture {
    pub async fn start(kind: S3Kind, opts: BucketOptions) -> Fixture {
        let _ = (ACCESS_KEY_ID, SECRET_ACCESS_KEY, REGION);
        let s3 = tokio::task::spawn_blocking(move || S3Server::start(kind, "bkt"))
            .await
            .unwrap();
        let bucket = Bucket::new(config(&s3), opts).unwrap();
        let exports = Arc::new(ExportSet::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(hearth_mount::serve(
            listener,
            exports.clone(),
            ServerLimits::default(),
        ));
        Fixture {
            s3,
            bucket,
            exports,
            addr,
            tmp: tempfile::tempdir().unwrap(),
            server,
        }
    }

    pub fn export(&self, key: u64, prefix: &str, read_only: bool) -> Arc<Export> {
        let e = Arc::new(Export::new(
            ExportSpec {
                key,
                prefix: prefix.into(),
                read_only,
            },
            self.bucket.clone(),
            Arc::new(MemoryTable::default()),
            Limits::new(self.tmp.path().to_owned()),
        ));
        self.exports.add(e.clone());
        e
    }

    pub async fn put(&self, key: &str, body: &[u8]) {
        self.bucket.put(key, Bytes::copy_from_slice(body)).await.unwrap();
    }

    pub async fn get(&self, key: &str) -> Option<Vec<u8>> {
        let meta = self.bucket.head(key).await.unwrap()?;
        if meta.size == 0 {
            return Some(Vec::new());
        }
        Some(self.bucket.get_range(key, 0..meta.size).await.unwrap().0.to_vec())
    }

    /// Every key in the bucket, sorted.
    pub async fn keys(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut stack = vec![String::new()];
        while let Some(p) = stack.pop() {
            let l = self.bucket.list_dir(&p).await.unwrap();
            let join = |n: &str| {
                if p.is_empty() {
                    n.to_string()
                } else {
                    format!("{p}/{n}")
                }
            };
            if l.marker {
                out.push(format!("{p}/"));
            }
            for (n, _) in &l.files {
                out.push(join(n));
            }
            for d in &l.dirs {
                stack.push(join(d));
            }
        }
        out.sort();
        out
    }
}
