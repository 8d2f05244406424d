//! The bucket as the file system sees it: object_store's S3 client for objects, plus the two requests it cannot
//! make (a directory marker is a key ending in `/`, which object_store's paths cannot name), signed here with
//! object_store's own SigV4 signer. Every request has an outer deadline, so a bucket that stops answering
//! turns into an error (EIO in the guest) within [`BucketOptions::op_timeout`], never a hang.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::StreamExt;
use hearth_store::{RemoteError, RemoteErrorKind, StoreConfig};
use object_store::aws::{AmazonS3, AwsAuthorizer, AwsCredential};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};

/// Metadata of one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjMeta {
    pub size: u64,
    pub modified: SystemTime,
    pub etag: Option<String>,
}

/// The children of a directory prefix, each name once.
#[derive(Debug, Clone, Default)]
pub struct Listing {
    /// Objects directly under the prefix (a marker for the prefix itself excluded).
    pub files: Vec<(String, ObjMeta)>,
    /// Names of the sub-prefixes (directories).
    pub dirs: Vec<String>,
    /// Whether the prefix has its own marker object (`dir/`).
    pub marker: bool,
}

/// A failed request, classified.
#[derive(Debug, Clone, thiserror::Error)]
pub enum S3Error {
    #[error("not found")]
    NotFound,
    #[error("already exists")]
    Exists,
    #[error("{0}")]
    Remote(RemoteError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
}

impl S3Error {
    /// Access refused by the bucket (credentials revoked, policy).
    pub fn is_denied(&self) -> bool {
        matches!(self, S3Error::Remote(r) if r.kind == RemoteErrorKind::AccessDenied)
    }
}

/// Timeouts and retries of the client.
#[derive(Debug, Clone)]
pub struct BucketOptions {
    /// Outer deadline of one request, retries included.
    pub op_timeout: Duration,
    /// Deadline of one HTTP attempt.
    pub request_timeout: Duration,
    /// Retries of one request (connection errors, 5xx).
    pub max_retries: usize,
}

impl Default for BucketOptions {
    fn default() -> Self {
        BucketOptions {
            op_timeout: Duration::from_secs(20),
            request_timeout: Duration::from_secs(15),
            max_retries: 2,
        }
    }
}

/// One bucket, with credentials. Cheap to clone.
#[derive(Clone)]
pub struct Bucket {
    inner: Arc<Inner>,
}

struct Inner {
    store: AmazonS3,
    config: StoreConfig,
    http: reqwest::Client,
    opts: BucketOptions,
    /// Until when requests fail at once: set when one found the bucket unreachable, so that a client's
    /// retries (the kernel retries a failed read) do not each wait out the deadline.
    down_until: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How long a bucket that did not answer is taken as down.
const DOWN_FOR: Duration = Duration::from_secs(5);

impl std::fmt::Debug for Bucket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bucket({})", self.inner.config.url())
    }
}

impl Bucket {
    /// A client for `config`'s bucket (its prefix is ignored: exports carry their own).
    pub fn new(mut config: StoreConfig, opts: BucketOptions) -> Result<Bucket, RemoteError> {
        config.prefix = String::new();
        config.max_retries = opts.max_retries;
        config.request_timeout = opts.request_timeout;
        config.retry_timeout = opts.op_timeout;
        let store = hearth_store::s3_client(&config)?;
        let http = reqwest::Client::builder()
            .timeout(opts.request_timeout)
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| RemoteError {
                kind: RemoteErrorKind::Other,
                op: "CONFIGURE",
                key: config.url(),
                message: e.to_string(),
            })?;
        Ok(Bucket {
            inner: Arc::new(Inner {
                store,
                config,
                http,
                opts,
                down_until: std::sync::Mutex::new(None),
            }),
        })
    }

    /// `s3://BUCKET`, for messages.
    pub fn url(&self) -> String {
        self.inner.config.url()
    }

    async fn run<T>(
        &self,
        op: &'static str,
        key: &str,
        fut: impl std::future::Future<Output = object_store::Result<T>>,
    ) -> Result<T, S3Error> {
        let limit = self.inner.opts.op_timeout;
        if self.is_down() {
            return Err(S3Error::Timeout(limit));
        }
        let started = std::time::Instant::now();
        let r = match tokio::time::timeout(limit, fut).await {
            Err(_) => Err(S3Error::Timeout(limit)),
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.classify(op, key, &e)),
        };
        // No key (a user's file name) and no message: the kind of failure is what timing questions need.
        let failed = match &r {
            Ok(_) => None,
            Err(S3Error::Remote(e)) => Some(format!("{:?}", e.kind)),
            Err(e) => Some(format!("{e}")),
        };
        tracing::debug!(
            op,
            micros = started.elapsed().as_micros(),
            failed,
            "bucket request"
        );
        let unreachable = match &r {
            Err(S3Error::Timeout(_)) => true,
            Err(S3Error::Remote(e)) => e.kind == RemoteErrorKind::Unreachable,
            _ => false,
        };
        let mut down = self.inner.down_until.lock().unwrap_or_else(|p| p.into_inner());
        *down = unreachable.then(|| std::time::Instant::now() + DOWN_FOR);
        r
    }

    fn is_down(&self) -> bool {
        let down = self.inner.down_until.lock().unwrap_or_else(|p| p.into_inner());
        down.is_some_and(|t| std::time::Instant::now() < t)
    }

    fn classify(&self, op: &'static str, key: &str, e: &object_store::Error) -> S3Error {
        match e {
            object_store::Error::NotFound { .. } if !e.to_string().contains("NoSuchBucket") => {
                S3Error::NotFound
            }
            object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. } => {
                S3Error::Exists
            }
            _ => S3Error::Remote(hearth_store::remote_error(&self.inner.config, op, key, e)),
        }
    }

    pub async fn head(&self, key: &str) -> Result<Option<ObjMeta>, S3Error> {
        let path = path(key)?;
        match self.run("HEAD", key, self.inner.store.head(&path)).await {
            Ok(m) => Ok(Some(meta(&m))),
            Err(S3Error::NotFound) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The bytes of `range` (clipped to the object) and the object's current metadata.
    pub async fn get_range(&self, key: &str, range: Range<u64>) -> Result<(Bytes, ObjMeta), S3Error> {
        let path = path(key)?;
        let opts = GetOptions {
            range: Some(GetRange::Bounded(range)),
            ..GetOptions::default()
        };
        let store = &self.inner.store;
        self.run("GET", key, async move {
            let r = store.get_opts(&path, opts).await?;
            let m = meta(&r.meta);
            Ok((r.bytes().await?, m))
        })
        .await
    }

    /// Streams the whole object into `file` (from its start); returns its size.
    pub async fn get_into(&self, key: &str, file: &std::fs::File, max: u64) -> Result<u64, S3Error> {
        use std::os::unix::fs::FileExt;
        let path = path(key)?;
        let store = &self.inner.store;
        let limit = self.inner.opts.op_timeout;
        let r = self.run("GET", key, store.get(&path)).await?;
        if r.meta.size > max {
            return Err(S3Error::Remote(RemoteError {
                kind: RemoteErrorKind::Other,
                op: "GET",
                key: key.to_owned(),
                message: "object too large to modify in place".into(),
            }));
        }
        let mut stream = r.into_stream();
        let mut at = 0u64;
        loop {
            // Each chunk has its own deadline: a stalled transfer ends instead of hanging.
            let next = tokio::time::timeout(limit, stream.next()).await;
            match next {
                Err(_) => return Err(S3Error::Timeout(limit)),
                Ok(None) => return Ok(at),
                Ok(Some(Err(e))) => return Err(self.classify("GET", key, &e)),
                Ok(Some(Ok(chunk))) => {
                    file.write_all_at(&chunk, at).map_err(|e| local_error(key, &e))?;
                    at += chunk.len() as u64;
                }
            }
        }
    }

    pub async fn put(&self, key: &str, body: Bytes) -> Result<(), S3Error> {
        let path = path(key)?;
        self.run(
            "PUT",
            key,
            self.inner.store.put(&path, PutPayload::from_bytes(body)),
        )
        .await
        .map(drop)
    }

    /// Create-only PUT: `S3Error::Exists` when the key exists already.
    pub async fn put_new(&self, key: &str, body: Bytes) -> Result<(), S3Error> {
        let path = path(key)?;
        let opts = PutOptions::from(PutMode::Create);
        self.run(
            "PUT",
            key,
            self.inner
                .store
                .put_opts(&path, PutPayload::from_bytes(body), opts),
        )
        .await
        .map(drop)
    }

    /// Uploads `size` bytes of `file`: one PUT up to `part`, else a multipart upload with `part`-sized parts,
    /// a few in flight at once.
    pub async fn put_file(
        &self,
        key: &str,
        file: &std::fs::File,
        size: u64,
        part: usize,
    ) -> Result<(), S3Error> {
        use std::os::unix::fs::FileExt;
        let read = |at: u64, len: usize| -> Result<Bytes, S3Error> {
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, at)
                .map_err(|e| local_error(key, &e))?;
            Ok(Bytes::from(buf))
        };
        if size <= part as u64 {
            return self.put(key, read(0, size as usize)?).await;
        }
        let path = path(key)?;
        let store = &self.inner.store;
        let upload = self.run("PUT", key, store.put_multipart(&path)).await?;
        let mut writer = object_store::WriteMultipart::new_with_chunk_size(upload, part);
        let mut at = 0u64;
        while at < size {
            let len = (size - at).min(part as u64) as usize;
            self.run("PUT", key, writer.wait_for_capacity(4)).await?;
            writer.put(read(at, len)?);
            at += len as u64;
        }
        match self.run("PUT", key, writer.finish()).await {
            Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub async fn delete(&self, key: &str) -> Result<(), S3Error> {
        let path = path(key)?;
        match self.run("DELETE", key, self.inner.store.delete(&path)).await {
            Ok(()) | Err(S3Error::NotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Server-side copy.
    pub async fn copy(&self, from: &str, to: &str) -> Result<(), S3Error> {
        let (f, t) = (path(from)?, path(to)?);
        self.run("COPY", from, self.inner.store.copy(&f, &t)).await
    }

    /// The children of directory `prefix` (`""` for the bucket root, else without a trailing `/`).
    pub async fn list_dir(&self, prefix: &str) -> Result<Listing, S3Error> {
        let p = if prefix.is_empty() {
            None
        } else {
            Some(path(prefix)?)
        };
        let result = self
            .run("LIST", prefix, self.inner.store.list_with_delimiter(p.as_ref()))
            .await?;
        let mut out = Listing::default();
        let strip = |loc: &Path| -> Option<String> {
            let s = loc.as_ref();
            let rest = if prefix.is_empty() {
                s
            } else {
                s.strip_prefix(prefix)?.strip_prefix('/')?
            };
            (!rest.is_empty() && !rest.contains('/')).then(|| rest.to_owned())
        };
        for o in &result.objects {
            if o.location.as_ref() == prefix {
                // `prefix/` itself: the directory's marker.
                out.marker = true;
                continue;
            }
            if let Some(name) = strip(&o.location) {
                out.files.push((name, meta(o)));
            }
        }
        for d in &result.common_prefixes {
            if let Some(name) = strip(d) {
                out.dirs.push(name);
            }
        }
        Ok(out)
    }

    /// Whether any key lies under `prefix/` (a directory exists, by marker or by content).
    pub async fn dir_exists(&self, prefix: &str) -> Result<bool, S3Error> {
        let p = path(prefix)?;
        let mut stream = self.inner.store.list(Some(&p));
        match self
            .run("LIST", prefix, async { stream.next().await.transpose() })
            .await
        {
            Ok(first) => Ok(first.is_some()),
            Err(S3Error::NotFound) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Creates the directory marker `dir/` (an empty object), as S3 consoles do.
    pub async fn put_marker(&self, dir: &str) -> Result<(), S3Error> {
        self.raw(http::Method::PUT, dir).await
    }

    /// Deletes the directory marker `dir/`.
    pub async fn delete_marker(&self, dir: &str) -> Result<(), S3Error> {
        match self.raw(http::Method::DELETE, dir).await {
            Ok(()) | Err(S3Error::NotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// A signed request for the key `dir/` with an empty body.
    async fn raw(&self, method: http::Method, dir: &str) -> Result<(), S3Error> {
        let c = &self.inner.config;
        let key = format!("{dir}/");
        let url = marker_url(c, &key);
        let mut req = http::Request::builder()
            .method(method.clone())
            .uri(&url)
            .body(object_store::client::HttpRequestBody::empty())
            .map_err(|e| raw_error(&key, e.to_string()))?;
        if method == http::Method::PUT {
            req.headers_mut()
                .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from_static("0"));
        }
        let cred = AwsCredential {
            key_id: c.credentials.access_key_id.clone(),
            secret_key: c.credentials.secret_access_key.expose().to_owned(),
            token: c
                .credentials
                .session_token
                .as_ref()
                .map(|t| t.expose().to_owned()),
        };
        AwsAuthorizer::new(&cred, "s3", &c.region)
            .try_authorize(&mut req, None)
            .map_err(|e| raw_error(&key, c.scrub(&e.to_string())))?;
        let mut builder = self.inner.http.request(method, &url);
        for (name, value) in req.headers() {
            builder = builder.header(name, value);
        }
        let limit = self.inner.opts.op_timeout;
        let answer = tokio::time::timeout(limit, builder.send())
            .await
            .map_err(|_| S3Error::Timeout(limit))?
            .map_err(|e| {
                S3Error::Remote(RemoteError {
                    kind: RemoteErrorKind::Unreachable,
                    op: "MARKER",
                    key: key.clone(),
                    message: c.scrub(&e.without_url().to_string()),
                })
            })?;
        let status = answer.status();
        if status.is_success() {
            return Ok(());
        }
        if status == reqwest::StatusCode::NOT_FOUND {
            return Err(S3Error::NotFound);
        }
        let body = tokio::time::timeout(limit, answer.text())
            .await
            .ok()
            .and_then(Result::ok);
        let kind = if status == reqwest::StatusCode::FORBIDDEN || status == reqwest::StatusCode::UNAUTHORIZED
        {
            RemoteErrorKind::AccessDenied
        } else if status.is_server_error() {
            RemoteErrorKind::Unavailable
        } else {
            RemoteErrorKind::Other
        };
        Err(S3Error::Remote(RemoteError {
            kind,
            op: "MARKER",
            key,
            message: c.scrub(&format!(
                "{status}: {}",
                body.unwrap_or_default().chars().take(300).collect::<String>()
            )),
        }))
    }
}

/// The URL of `key` in the configured bucket (path style, or virtual-hosted on AWS and custom endpoints).
fn marker_url(c: &StoreConfig, key: &str) -> String {
    let encoded: Vec<String> = key.split('/').map(encode_segment).collect();
    let key = encoded.join("/");
    match &c.endpoint {
        Some(e) if c.path_style => format!("{}/{}/{key}", e.trim_end_matches('/'), c.bucket),
        Some(e) => match e.trim_end_matches('/').split_once("://") {
            Some((scheme, host)) => format!("{scheme}://{}.{host}/{key}", c.bucket),
            None => format!("{e}/{key}"),
        },
        None => format!("https://{}.s3.{}.amazonaws.com/{key}", c.bucket, c.region),
    }
}

/// Percent-encodes one key segment as SigV4 expects (unreserved characters kept).
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn raw_error(key: &str, message: String) -> S3Error {
    S3Error::Remote(RemoteError {
        kind: RemoteErrorKind::Other,
        op: "MARKER",
        key: key.to_owned(),
        message,
    })
}

fn local_error(key: &str, e: &std::io::Error) -> S3Error {
    S3Error::Remote(RemoteError {
        kind: RemoteErrorKind::Other,
        op: "LOCAL",
        key: key.to_owned(),
        message: format!("local temporary file: {e}"),
    })
}

/// An object_store path for a key built from validated names (see [`crate::fs::valid_name`]).
fn path(key: &str) -> Result<Path, S3Error> {
    Path::parse(key).map_err(|e| raw_error(key, e.to_string()))
}

fn meta(m: &object_store::ObjectMeta) -> ObjMeta {
    ObjMeta {
        size: m.size,
        modified: m.last_modified.into(),
        etag: m.e_tag.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marker_urls() {
        let mut c = StoreConfig::from_url_with_env("s3://bkt/x", |k| match k {
            "AWS_ACCESS_KEY_ID" => Some("a".into()),
            "AWS_SECRET_ACCESS_KEY" => Some("b".into()),
            "AWS_ENDPOINT_URL" => Some("http://127.0.0.1:9000/".into()),
            _ => None,
        })
        .expect("config");
        assert_eq!(marker_url(&c, "a b/c/"), "http://127.0.0.1:9000/bkt/a%20b/c/");
        c.path_style = false;
        assert_eq!(marker_url(&c, "d/"), "http://bkt.127.0.0.1:9000/d/");
        c.endpoint = None;
        assert_eq!(marker_url(&c, "d/"), "https://bkt.s3.us-east-1.amazonaws.com/d/");
    }
}
