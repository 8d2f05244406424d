//! Typed errors. Messages name the object, chunk, key or path concerned and never contain a credential: bucket
//! errors are reduced to a kind plus the server's own message, with every configured secret scrubbed from it.

use std::fmt;
use std::path::PathBuf;

/// What went wrong talking to the bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteErrorKind {
    /// The bucket does not exist (`NoSuchBucket`).
    NoSuchBucket,
    /// Credentials refused or missing permission (`AccessDenied`, `InvalidAccessKeyId`,
    /// `SignatureDoesNotMatch`, expired tokens, 401/403).
    AccessDenied,
    /// The endpoint could not be reached (connection refused, DNS, timeout).
    Unreachable,
    /// The server refused the request's time (`RequestTimeTooSkewed`): this host's clock is off.
    ClockSkew,
    /// The server answered with a 5xx or asked to slow down, after the configured retries.
    Unavailable,
    /// Anything else; the message carries the server's words.
    Other,
}

impl RemoteErrorKind {
    fn describe(self) -> &'static str {
        match self {
            Self::NoSuchBucket => "no such bucket",
            Self::AccessDenied => "access denied (check the credentials and the bucket's permissions)",
            Self::Unreachable => "endpoint unreachable",
            Self::ClockSkew => "request time refused as too skewed: this host's clock is off",
            Self::Unavailable => "server unavailable",
            Self::Other => "request failed",
        }
    }
}

/// A failed bucket request: the operation, the key (never a credential) and the server's message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteError {
    /// The classification.
    pub kind: RemoteErrorKind,
    /// `PUT`, `GET`, `HEAD`, `LIST` or `DELETE`.
    pub op: &'static str,
    /// The key (or prefix) the request was for.
    pub key: String,
    /// The server's error code and message, or the transport error, scrubbed of secrets.
    pub message: String,
}

impl RemoteError {
    /// Whether trying again later may succeed (outage, 5xx, timeouts).
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind,
            RemoteErrorKind::Unreachable | RemoteErrorKind::Unavailable
        )
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}: {}", self.op, self.key, self.kind.describe())?;
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

impl std::error::Error for RemoteError {}

/// Errors of the store's operations.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An object name was refused; see [`crate::ObjectName`].
    #[error("invalid object name \"{name}\": {reason}")]
    InvalidName { name: String, reason: &'static str },
    /// A file name inside an object was refused (on upload, or read from a manifest).
    #[error("object {object}: invalid file name \"{name}\"")]
    InvalidFileName { object: String, name: String },
    /// Two files of one upload have the same name.
    #[error("object {object}: file name {name} given twice")]
    DuplicateFileName { object: String, name: String },
    /// No manifest for this object: it was never committed, or deleted.
    #[error("object {0} not found")]
    NotFound(String),
    /// A chunk the manifest names is missing from the bucket.
    #[error("object {object}: chunk {chunk} is missing from the bucket")]
    ChunkMissing { object: String, chunk: String },
    /// A chunk's bytes do not match its digest or fail authentication.
    #[error("object {object}: chunk {chunk} is corrupted ({reason})")]
    ChunkCorrupt {
        object: String,
        chunk: String,
        reason: &'static str,
    },
    /// The manifest cannot be parsed or authenticated.
    #[error("object {object}: manifest is corrupted ({reason})")]
    ManifestCorrupt { object: String, reason: String },
    /// The store under this prefix is encrypted and no key was configured.
    #[error("the store is encrypted: configure its key")]
    KeyRequired,
    /// The store under this prefix is not encrypted, but a key was configured.
    #[error("the store is not encrypted: remove the key from the configuration (or use another prefix)")]
    NotEncrypted,
    /// The configured key is not the one this store was created with.
    #[error("wrong encryption key for this store")]
    WrongKey,
    /// The store's format marker is unreadable or of an unknown version.
    #[error("unsupported or damaged store marker: {0}")]
    BadMarker(String),
    /// `get_object` refuses to write over an existing path.
    #[error("destination {0} already exists")]
    DestinationExists(PathBuf),
    /// A local file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A bucket request failed (after the configured retries when retryable).
    #[error(transparent)]
    Remote(#[from] RemoteError),
}

impl StoreError {
    /// Whether the same call may succeed later (bucket outage): the caller keeps the work pending and retries;
    /// a retried upload sends only the chunks still missing.
    pub fn is_retryable(&self) -> bool {
        matches!(self, StoreError::Remote(e) if e.is_retryable())
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> StoreError {
        StoreError::Io {
            path: path.into(),
            source,
        }
    }
}

/// Configuration errors (`StoreConfig::from_url` and key files).
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The storage URL is not `s3://BUCKET[/PREFIX]` or names an invalid bucket or prefix.
    #[error("invalid storage URL \"{url}\": {reason}")]
    BadUrl { url: String, reason: &'static str },
    /// No credentials in the environment or the shared credentials file.
    #[error(
        "no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile in the shared credentials file"
    )]
    NoCredentials,
    /// The named profile is not in the shared credentials file.
    #[error("profile {profile} not found in {path} (or it lacks aws_access_key_id / aws_secret_access_key)")]
    NoProfile { profile: String, path: PathBuf },
    /// The endpoint is not an http(s) URL.
    #[error("invalid endpoint \"{0}\": expected http://HOST[:PORT] or https://HOST[:PORT]")]
    BadEndpoint(String),
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The key file holds neither 64 hex characters nor 32 raw bytes.
    #[error("{0}: a key file holds 64 hex characters (one line) or exactly 32 raw bytes")]
    BadKeyFile(PathBuf),
}

/// The step of [`crate::probe`] that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeStep {
    /// Listing the probe prefix before writing: the bucket exists and can be listed (some servers create a
    /// missing bucket on the first write instead of refusing it).
    Bucket,
    /// Writing the probe object.
    Write,
    /// Reading it back (and comparing).
    Read,
    /// Listing the prefix.
    List,
    /// Deleting it.
    Delete,
}

/// Why the bucket probe failed.
#[derive(Debug, thiserror::Error)]
#[error("storage probe failed at {step:?}: {source}")]
pub struct ProbeError {
    /// Which step failed.
    pub step: ProbeStep,
    /// The classified bucket error.
    #[source]
    pub source: RemoteError,
}

impl ProbeError {
    /// The classification of the failure (no such bucket, access denied, unreachable, clock skew, other).
    pub fn kind(&self) -> RemoteErrorKind {
        self.source.kind
    }
}
