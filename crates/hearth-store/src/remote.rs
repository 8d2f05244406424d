//! The bucket: an `object_store` S3 client, the key layout under the prefix, and the translation of its errors
//! into [`RemoteError`]s (classified, secret-free).
//!
//! Retries are object_store's: connection errors, timeouts of idempotent requests and 5xx answers are retried
//! up to `max_retries` times within `retry_timeout`, waiting an exponentially growing, randomly jittered delay
//! (100 ms doubling up to 10 s) between tries.

use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientOptions, ObjectMeta, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload,
    RetryConfig,
};

use crate::config::StoreConfig;
use crate::crypto::ChunkId;
use crate::error::{RemoteError, RemoteErrorKind};
use crate::name::ObjectName;

/// The marker object that says "a hearth store lives under this prefix" and holds the key check.
pub(crate) const MARKER: &str = "hearth-store.json";
/// The file name every manifest key ends with; uppercase so no object name segment can equal it.
const MANIFEST_LEAF: &str = "MANIFEST";

pub(crate) struct Remote {
    store: Arc<AmazonS3>,
    config: Arc<StoreConfig>,
}

/// A listed chunk: id, stored size and the server's last-modified time.
pub(crate) struct ListedChunk {
    pub id: ChunkId,
    pub size: u64,
    pub last_modified: std::time::SystemTime,
}

impl Remote {
    pub(crate) fn new(config: Arc<StoreConfig>) -> Result<Remote, RemoteError> {
        let c = &config;
        let mut builder = AmazonS3Builder::new()
            .with_bucket_name(&c.bucket)
            .with_region(&c.region)
            .with_access_key_id(&c.credentials.access_key_id)
            .with_secret_access_key(c.credentials.secret_access_key.expose())
            .with_virtual_hosted_style_request(!c.path_style)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: std::time::Duration::from_millis(100),
                    max_backoff: std::time::Duration::from_secs(10),
                    base: 2.0,
                },
                max_retries: c.max_retries,
                retry_timeout: c.retry_timeout,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_allow_http(c.allow_http)
                    .with_timeout(c.request_timeout)
                    .with_connect_timeout(std::time::Duration::from_secs(5)),
            );
        if let Some(token) = &c.credentials.session_token {
            builder = builder.with_token(token.expose());
        }
        if let Some(endpoint) = &c.endpoint {
            builder = builder.with_endpoint(bucket_endpoint(endpoint, &c.bucket, c.path_style));
        }
        let store = builder.build().map_err(|e| RemoteError {
            kind: RemoteErrorKind::Other,
            op: "CONFIGURE",
            key: c.url(),
            message: c.scrub(&e.to_string()),
        })?;
        Ok(Remote {
            store: Arc::new(store),
            config,
        })
    }

    // ---- the layout ----

    fn key(&self, rest: &str) -> Path {
        let full = if self.config.prefix.is_empty() {
            rest.to_owned()
        } else {
            format!("{}/{rest}", self.config.prefix)
        };
        // Every part is validated (prefix and names) or made here from hex and constants.
        Path::parse(full).expect("keys are built from validated parts")
    }

    pub(crate) fn marker_key(&self) -> Path {
        self.key(MARKER)
    }

    pub(crate) fn chunk_key(&self, id: &ChunkId) -> Path {
        let hex = id.to_hex();
        self.key(&format!("chunks/{}/{hex}", &hex[..2]))
    }

    pub(crate) fn manifest_key(&self, name: &ObjectName) -> Path {
        self.key(&format!("manifests/{name}/{MANIFEST_LEAF}"))
    }

    pub(crate) fn probe_key(&self, token: &str) -> Path {
        self.key(&format!("probe/{token}"))
    }

    pub(crate) fn prefix_path(&self, rest: &str) -> Path {
        self.key(rest)
    }

    /// The object name a manifest key stands for, if it is one.
    pub(crate) fn name_of_manifest(&self, key: &Path) -> Option<ObjectName> {
        let manifests = self.key("manifests");
        let rest = key.as_ref().strip_prefix(manifests.as_ref())?.strip_prefix('/')?;
        let name = rest.strip_suffix(MANIFEST_LEAF)?.strip_suffix('/')?;
        ObjectName::new(name).ok()
    }

    // ---- requests ----

    pub(crate) async fn put(&self, key: &Path, body: Bytes) -> Result<(), RemoteError> {
        let r = self.store.put(key, PutPayload::from_bytes(body)).await;
        r.map(drop).map_err(|e| self.error("PUT", key, &e))
    }

    /// Create-only PUT: `Ok(false)` when the key already exists.
    pub(crate) async fn put_new(&self, key: &Path, body: Bytes) -> Result<bool, RemoteError> {
        let opts = PutOptions::from(PutMode::Create);
        match self.store.put_opts(key, PutPayload::from_bytes(body), opts).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. } | object_store::Error::Precondition { .. }) => {
                Ok(false)
            }
            Err(e) => Err(self.error("PUT", key, &e)),
        }
    }

    /// GET; `Ok(None)` when the key does not exist.
    pub(crate) async fn get(&self, key: &Path) -> Result<Option<Bytes>, RemoteError> {
        let result = match self.store.get(key).await {
            Ok(r) => r,
            Err(e) if is_not_found(&e) => return Ok(None),
            Err(e) => return Err(self.error("GET", key, &e)),
        };
        result
            .bytes()
            .await
            .map(Some)
            .map_err(|e| self.error("GET", key, &e))
    }

    /// HEAD; `Ok(None)` when the key does not exist.
    pub(crate) async fn head(&self, key: &Path) -> Result<Option<ObjectMeta>, RemoteError> {
        match self.store.head(key).await {
            Ok(meta) => Ok(Some(meta)),
            Err(e) if is_not_found(&e) => Ok(None),
            Err(e) => Err(self.error("HEAD", key, &e)),
        }
    }

    /// DELETE (deleting a missing key succeeds, as in S3).
    pub(crate) async fn delete(&self, key: &Path) -> Result<(), RemoteError> {
        match self.store.delete(key).await {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(self.error("DELETE", key, &e)),
        }
    }

    /// Every key under `prefix` (recursively).
    pub(crate) async fn list(&self, prefix: &Path) -> Result<Vec<ObjectMeta>, RemoteError> {
        let stream = self.store.list(Some(prefix));
        stream
            .try_collect()
            .await
            .map_err(|e| self.error("LIST", prefix, &e))
    }

    /// Every chunk in the bucket.
    pub(crate) async fn list_chunks(&self) -> Result<Vec<ListedChunk>, RemoteError> {
        let listed = self.list(&self.key("chunks")).await?;
        Ok(listed
            .into_iter()
            .filter_map(|m| {
                let id = ChunkId::parse(m.location.filename()?)?;
                (m.location == self.chunk_key(&id)).then(|| ListedChunk {
                    id,
                    size: m.size,
                    last_modified: m.last_modified.into(),
                })
            })
            .collect())
    }

    /// Every committed object's name under `within` (a name prefix matched by whole segments; `None` for all).
    pub(crate) async fn list_manifests(
        &self,
        within: Option<&ObjectName>,
    ) -> Result<Vec<ObjectMeta>, RemoteError> {
        let prefix = match within {
            Some(p) => self.key(&format!("manifests/{p}")),
            None => self.key("manifests"),
        };
        let listed = self.list(&prefix).await?;
        Ok(listed
            .into_iter()
            .filter(|m| self.name_of_manifest(&m.location).is_some())
            .collect())
    }

    fn error(&self, op: &'static str, key: &Path, e: &object_store::Error) -> RemoteError {
        let (kind, message) = classify(e);
        RemoteError {
            kind,
            op,
            key: key.to_string(),
            message: self.config.scrub(&message),
        }
    }
}

/// The endpoint object_store expects: with the bucket in the host for virtual-hosted style.
fn bucket_endpoint(endpoint: &str, bucket: &str, path_style: bool) -> String {
    let endpoint = endpoint.trim_end_matches('/');
    if path_style {
        return endpoint.to_owned();
    }
    match endpoint.split_once("://") {
        Some((scheme, host)) => format!("{scheme}://{bucket}.{host}"),
        None => endpoint.to_owned(),
    }
}

fn is_not_found(e: &object_store::Error) -> bool {
    // A missing bucket also answers 404; only a missing key counts as "not found".
    matches!(e, object_store::Error::NotFound { .. }) && !e.to_string().contains("NoSuchBucket")
}

/// Classifies an object_store error by the S3 error code in the server's answer, the HTTP status and the
/// transport error kind; the message is the server's `<Code>: <Message>` when it sent one.
pub(crate) fn classify(e: &object_store::Error) -> (RemoteErrorKind, String) {
    let text = e.to_string();
    let code = xml_field(&text, "Code");
    let server_message = xml_field(&text, "Message");
    let message = match (&code, &server_message) {
        (Some(c), Some(m)) => format!("{c}: {m}"),
        (Some(c), None) => c.clone(),
        _ => transport_summary(e).unwrap_or_else(|| text.chars().take(500).collect()),
    };
    let by_code = code.as_deref().and_then(|c| match c {
        "NoSuchBucket" => Some(RemoteErrorKind::NoSuchBucket),
        "AccessDenied"
        | "InvalidAccessKeyId"
        | "SignatureDoesNotMatch"
        | "InvalidToken"
        | "ExpiredToken"
        | "AllAccessDisabled"
        | "AccountProblem"
        | "InvalidSecurity"
        | "NotSignedUp"
        | "InvalidClientTokenId" => Some(RemoteErrorKind::AccessDenied),
        "RequestTimeTooSkewed" => Some(RemoteErrorKind::ClockSkew),
        "SlowDown" | "InternalError" | "ServiceUnavailable" | "RequestTimeout" => {
            Some(RemoteErrorKind::Unavailable)
        }
        _ => None,
    });
    if let Some(kind) = by_code {
        return (kind, message);
    }
    let kind = match e {
        object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
            RemoteErrorKind::AccessDenied
        }
        _ if http_error(e).is_some() => RemoteErrorKind::Unreachable,
        _ if text.contains("Server returned non-2xx status code: 5")
            || text.contains("error response: 5") =>
        {
            RemoteErrorKind::Unavailable
        }
        _ => RemoteErrorKind::Other,
    };
    (kind, message)
}

/// The transport error (connection refused, timeout...) in the error's source chain, if any.
fn http_error(e: &object_store::Error) -> Option<&object_store::client::HttpError> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(h) = s.downcast_ref::<object_store::client::HttpError>() {
            return Some(h);
        }
        source = s.source();
    }
    None
}

fn transport_summary(e: &object_store::Error) -> Option<String> {
    let h = http_error(e)?;
    let mut out = format!("{:?}", h.kind());
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(h);
    // The innermost cause says what happened ("Connection refused", "operation timed out").
    while let Some(s) = source {
        out = format!("{:?}: {s}", h.kind());
        source = s.source();
    }
    Some(out)
}

/// The text of `<field>...</field>` in an S3 XML error body.
fn xml_field(text: &str, field: &str) -> Option<String> {
    let open = format!("<{field}>");
    let close = format!("</{field}>");
    let start = text.find(&open)? + open.len();
    let len = text[start..].find(&close)?;
    Some(text[start..start + len].chars().take(300).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn generic(body: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: format!("Server returned error response: {body}").into(),
        }
    }

    #[test]
    fn classification_by_s3_code() {
        let skew = generic(
            "<Error><Code>RequestTimeTooSkewed</Code><Message>The difference between the request time and the \
             current time is too large.</Message></Error>",
        );
        let (kind, message) = classify(&skew);
        assert_eq!(kind, RemoteErrorKind::ClockSkew);
        assert!(
            message.starts_with("RequestTimeTooSkewed: The difference"),
            "{message}"
        );
        let cases = [
            ("NoSuchBucket", RemoteErrorKind::NoSuchBucket),
            ("InvalidAccessKeyId", RemoteErrorKind::AccessDenied),
            ("SignatureDoesNotMatch", RemoteErrorKind::AccessDenied),
            ("SlowDown", RemoteErrorKind::Unavailable),
            ("EntityTooLarge", RemoteErrorKind::Other),
        ];
        for (code, kind) in cases {
            assert_eq!(
                classify(&generic(&format!("<Code>{code}</Code>"))).0,
                kind,
                "{code}"
            );
        }
    }

    #[test]
    fn endpoints() {
        assert_eq!(
            bucket_endpoint("http://127.0.0.1:9000/", "b", true),
            "http://127.0.0.1:9000"
        );
        assert_eq!(
            bucket_endpoint("https://acc.r2.example", "b", false),
            "https://b.acc.r2.example"
        );
    }
}
