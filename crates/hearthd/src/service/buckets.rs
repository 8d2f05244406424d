//! Buckets as named credentials: registration (validated, probed), listing, deletion, and the S3 client of a
//! registered bucket for the mount servers.
//!
//! The access key id and secret are sealed with XChaCha20-Poly1305 under the daemon's own key
//! (`<data-dir>/bucket-secrets.key`, 32 random bytes, mode 0600, made on first use) with the bucket's name as
//! associated data, and stored in the state database; both files are readable by the daemon alone, and a copy
//! of the database without the key file holds no usable secret. A secret is opened only to build the S3
//! client in this process: it is never logged, never in an API answer, metric or error message, and never
//! sent to a guest.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{XChaCha20Poly1305, XNonce};
use hearth_api::{Bucket, BucketList, CreateBucketRequest, ErrorCode};
use rand::RngCore;

use super::{Sandboxes, ServiceError, clip, now_ms};
use crate::db::mounts::BucketRow;

/// Settings of bucket access.
#[derive(Debug, Clone, Default)]
pub struct BucketSettings {
    /// Allow endpoints on loopback, private, link-local and other always-denied addresses (tests, a MinIO on
    /// the host). Off by default: a registered endpoint is reached from the daemon, and must not become a way
    /// into the host's own services or a cloud metadata address.
    pub allow_private_endpoints: bool,
}

/// The sealing key and the S3 clients of registered buckets.
pub struct BucketKeys {
    aead: XChaCha20Poly1305,
    settings: BucketSettings,
    clients: Mutex<HashMap<String, hearth_mount::Bucket>>,
}

/// The credentials as sealed.
#[derive(serde::Serialize, serde::Deserialize)]
struct Sealed {
    access_key_id: String,
    secret_access_key: String,
}

impl BucketKeys {
    /// Loads (or makes) the key file.
    pub fn open(key_file: &Path, settings: BucketSettings) -> std::io::Result<BucketKeys> {
        let key = super::network::load_key_file(key_file)?;
        Ok(BucketKeys {
            aead: XChaCha20Poly1305::new(&key.into()),
            settings,
            clients: Mutex::new(HashMap::new()),
        })
    }

    fn seal(&self, name: &str, creds: &Sealed) -> Vec<u8> {
        let mut nonce = [0u8; 24];
        rand::rng().fill_bytes(&mut nonce);
        let plain = serde_json::to_vec(creds).unwrap_or_default();
        let sealed = self
            .aead
            .encrypt(
                XNonce::from_slice(&nonce),
                Payload {
                    msg: &plain,
                    aad: name.as_bytes(),
                },
            )
            .unwrap_or_default();
        [nonce.as_slice(), &sealed].concat()
    }

    fn open_sealed(&self, name: &str, sealed: &[u8]) -> Option<Sealed> {
        if sealed.len() < 24 {
            return None;
        }
        let (nonce, body) = sealed.split_at(24);
        let plain = self
            .aead
            .decrypt(
                XNonce::from_slice(nonce),
                Payload {
                    msg: body,
                    aad: name.as_bytes(),
                },
            )
            .ok()?;
        serde_json::from_slice(&plain).ok()
    }

    fn clients(&self) -> std::sync::MutexGuard<'_, HashMap<String, hearth_mount::Bucket>> {
        self.clients.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn typed(code: ErrorCode, message: String) -> ServiceError {
    ServiceError::Typed(code, message)
}

/// The client configuration of a bucket row with its credentials.
fn store_config(row: &BucketRow, creds: Sealed) -> hearth_store::StoreConfig {
    hearth_store::StoreConfig {
        bucket: row.bucket.clone(),
        prefix: String::new(),
        endpoint: row.endpoint.clone(),
        region: row.region.clone(),
        credentials: hearth_store::Credentials {
            access_key_id: creds.access_key_id,
            secret_access_key: hearth_store::Secret::new(creds.secret_access_key),
            session_token: None,
        },
        path_style: row.path_style,
        allow_http: row.endpoint.as_deref().is_some_and(|e| e.starts_with("http://")),
        key: None,
        chunk_size: hearth_store::config::DEFAULT_CHUNK_SIZE,
        concurrency: 8,
        max_retries: 2,
        retry_timeout: Duration::from_secs(20),
        request_timeout: Duration::from_secs(10),
    }
}

/// Parses `s3://BUCKET[/PREFIX]` (S3 bucket naming; the prefix made of valid path segments).
fn parse_url(url: &str) -> Result<(String, String), ServiceError> {
    let bad = |why: &str| ServiceError::InvalidArgument(format!("url {:?}: {why}", clip(url, 128)));
    let rest = url
        .strip_prefix("s3://")
        .ok_or_else(|| bad("expected s3://BUCKET[/PREFIX]"))?;
    let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
    if !hearth_store::config::is_valid_bucket_name(bucket) {
        return Err(bad("bucket names are 3-63 characters of a-z, 0-9, '-' and '.'"));
    }
    let prefix = normalize_prefix(prefix)
        .ok_or_else(|| bad("the prefix must be path segments without '.', '..' or empty ones"))?;
    Ok((bucket.to_owned(), prefix))
}

/// `a/b/` → `a/b`; refuses empty, `.` and `..` segments and control characters.
pub(crate) fn normalize_prefix(prefix: &str) -> Option<String> {
    let p = prefix.trim_end_matches('/');
    hearth_mount::fs::valid_prefix(p).then(|| p.to_owned())
}

fn check_text(what: &str, v: &str, max: usize) -> Result<(), ServiceError> {
    if v.is_empty() || v.len() > max || !v.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(ServiceError::InvalidArgument(format!(
            "{what} must be 1-{max} printable ASCII characters without spaces"
        )));
    }
    Ok(())
}

impl Sandboxes {
    /// The bucket keys (made from the data directory on first use).
    pub(crate) fn bucket_keys(&self) -> Result<&BucketKeys, ServiceError> {
        if let Some(k) = self.buckets.get() {
            return Ok(k);
        }
        let keys = BucketKeys::open(
            &self.settings.paths.data_dir.join("bucket-secrets.key"),
            BucketSettings::default(),
        )
        .map_err(|e| ServiceError::Internal(format!("bucket secret key: {e}")))?;
        let _ = self.buckets.set(keys);
        self.buckets
            .get()
            .ok_or_else(|| ServiceError::Internal("bucket keys".into()))
    }

    /// Sets bucket access up at start-up (before any request).
    pub fn enable_buckets(&self, settings: BucketSettings) -> std::io::Result<()> {
        let keys = BucketKeys::open(&self.settings.paths.data_dir.join("bucket-secrets.key"), settings)?;
        let _ = self.buckets.set(keys);
        Ok(())
    }

    /// Refuses an endpoint whose host resolves to an address the daemon must not reach for a user.
    async fn check_endpoint(&self, endpoint: &str) -> Result<(), ServiceError> {
        let bad = |why: String| {
            typed(
                ErrorCode::BucketUnreachable,
                format!("endpoint {}: {why}", clip(endpoint, 128)),
            )
        };
        let rest = endpoint
            .strip_prefix("https://")
            .map(|r| (r, 443))
            .or_else(|| endpoint.strip_prefix("http://").map(|r| (r, 80)));
        let Some((rest, default_port)) = rest else {
            return Err(ServiceError::InvalidArgument(
                "endpoint must start with http:// or https://".into(),
            ));
        };
        let authority = rest.split('/').next().unwrap_or_default();
        if authority.is_empty() || authority.contains('@') || !authority.is_ascii() || endpoint.len() > 512 {
            return Err(ServiceError::InvalidArgument(
                "endpoint must be a plain http(s)://HOST[:PORT][/]".into(),
            ));
        }
        if self.bucket_keys()?.settings.allow_private_endpoints {
            return Ok(());
        }
        let target = if authority
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
            && !authority.ends_with(']')
        {
            authority.to_owned()
        } else {
            format!("{authority}:{default_port}")
        };
        let addrs: Vec<IpAddr> =
            tokio::time::timeout(Duration::from_secs(10), tokio::net::lookup_host(target))
                .await
                .map_err(|_| bad("its name did not resolve in time".into()))?
                .map_err(|e| bad(format!("cannot resolve: {e}")))?
                .map(|a| a.ip())
                .collect();
        let denied = hearth_net::always_denied();
        if addrs.is_empty() || addrs.iter().any(|a| denied.iter().any(|n| n.contains(a))) {
            return Err(bad(
                "it resolves to a private, loopback or link-local address (hearthd --allow-private-bucket-endpoints allows that)".into(),
            ));
        }
        Ok(())
    }

    /// `POST /v1/buckets`.
    pub async fn create_bucket(&self, req: CreateBucketRequest) -> Result<Bucket, ServiceError> {
        if !hearth_api::is_valid_bucket_name(&req.name) {
            return Err(ServiceError::InvalidArgument(format!(
                "invalid bucket name {:?} (1-63 of a-z, 0-9 and -)",
                clip(&req.name, 64)
            )));
        }
        let (bucket, prefix) = parse_url(&req.url)?;
        let region = req.region.clone().unwrap_or_else(|| "us-east-1".into());
        if region.is_empty()
            || region.len() > 32
            || !region.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        {
            return Err(ServiceError::InvalidArgument(
                "region must be 1-32 of a-z, 0-9 and -".into(),
            ));
        }
        check_text("access_key_id", &req.access_key_id, 128)?;
        check_text("secret_access_key", &req.secret_access_key, 256)?;
        if let Some(e) = &req.endpoint {
            self.check_endpoint(e).await?;
        }
        if self.db.get_bucket(&req.name)?.is_some() {
            return Err(ServiceError::Conflict(format!(
                "a bucket called {} exists already",
                req.name
            )));
        }
        let keys = self.bucket_keys()?;
        let custom_endpoint = req.endpoint.is_some();
        let creds = Sealed {
            access_key_id: req.access_key_id,
            secret_access_key: req.secret_access_key,
        };
        let row = BucketRow {
            name: req.name.clone(),
            bucket,
            prefix,
            endpoint: req.endpoint.map(|e| e.trim_end_matches('/').to_owned()),
            region,
            path_style: req.path_style.unwrap_or(custom_endpoint),
            key_hint: creds
                .access_key_id
                .chars()
                .rev()
                .take(4)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect(),
            sealed: keys.seal(&req.name, &creds),
            created_at_ms: now_ms(),
        };
        let client = hearth_mount::Bucket::new(store_config(&row, creds), probe_options())
            .map_err(|e| ServiceError::InvalidArgument(format!("bucket configuration: {}", e.message)))?;
        probe(&client, &row.prefix).await?;
        if !self.db.insert_bucket(&row)? {
            return Err(ServiceError::Conflict(format!(
                "a bucket called {} exists already",
                row.name
            )));
        }
        tracing::info!(bucket = %row.name, url = %url_of(&row), "bucket registered");
        self.to_api_bucket(&row)
    }

    fn to_api_bucket(&self, row: &BucketRow) -> Result<Bucket, ServiceError> {
        let mut mounted_by: Vec<String> = self
            .db
            .list_mounts(None)?
            .into_iter()
            .filter(|m| m.bucket == row.name)
            .map(|m| m.owner)
            .collect();
        mounted_by.dedup();
        Ok(Bucket {
            name: row.name.clone(),
            url: url_of(row),
            endpoint: row.endpoint.clone(),
            region: row.region.clone(),
            path_style: row.path_style,
            access_key_hint: row.key_hint.clone(),
            created_at: super::lifecycle::rfc3339(row.created_at_ms),
            mounted_by,
        })
    }

    fn bucket_row(&self, name: &str) -> Result<BucketRow, ServiceError> {
        let not_found = || ServiceError::NotFound(format!("bucket {} not found", clip(name, 64)));
        if !hearth_api::is_valid_bucket_name(name) {
            return Err(not_found());
        }
        self.db.get_bucket(name)?.ok_or_else(not_found)
    }

    /// `GET /v1/buckets`.
    pub fn list_buckets(&self) -> Result<BucketList, ServiceError> {
        let buckets = self
            .db
            .list_buckets()?
            .iter()
            .map(|r| self.to_api_bucket(r))
            .collect::<Result<_, _>>()?;
        Ok(BucketList { buckets })
    }

    /// `GET /v1/buckets/{name}`.
    pub fn get_bucket(&self, name: &str) -> Result<Bucket, ServiceError> {
        self.to_api_bucket(&self.bucket_row(name)?)
    }

    /// `DELETE /v1/buckets/{name}`: refused while a sandbox mounts it or a snapshot would mount it again.
    pub fn delete_bucket(&self, name: &str) -> Result<(), ServiceError> {
        self.bucket_row(name)?;
        self.db.prune_snapshot_mounts()?;
        let users = self.db.delete_bucket_if_unused(name)?;
        if !users.is_empty() {
            return Err(ServiceError::Conflict(format!(
                "bucket {name} is mounted by {}: unmount it (or delete those snapshots) first",
                users.join(", ")
            )));
        }
        if let Ok(keys) = self.bucket_keys() {
            keys.clients().remove(name);
        }
        tracing::info!(bucket = %name, "bucket deleted");
        Ok(())
    }

    /// The S3 client of a registered bucket (made once, shared by every mount of it) and its row.
    pub(crate) async fn bucket_client(
        &self,
        name: &str,
    ) -> Result<(hearth_mount::Bucket, BucketRow), ServiceError> {
        let row = self.bucket_row(name)?;
        let keys = self.bucket_keys()?;
        if let Some(c) = keys.clients().get(name) {
            return Ok((c.clone(), row));
        }
        if let Some(e) = &row.endpoint {
            self.check_endpoint(e).await?;
        }
        let creds = keys.open_sealed(&row.name, &row.sealed).ok_or_else(|| {
            ServiceError::Internal(format!(
                "the credentials of bucket {name} cannot be opened (key file changed?)"
            ))
        })?;
        let client =
            hearth_mount::Bucket::new(store_config(&row, creds), hearth_mount::BucketOptions::default())
                .map_err(|e| ServiceError::Internal(format!("bucket {name}: {}", e.message)))?;
        keys.clients().insert(name.to_owned(), client.clone());
        Ok((client, row))
    }
}

/// Short deadlines: a wrong endpoint is reported in seconds.
fn probe_options() -> hearth_mount::BucketOptions {
    hearth_mount::BucketOptions {
        op_timeout: Duration::from_secs(10),
        request_timeout: Duration::from_secs(5),
        max_retries: 1,
    }
}

/// Lists the bucket's prefix once: proves the bucket exists, the credentials sign and the endpoint answers.
/// (Write permission is not required: read-only credentials make read-only mounts.)
async fn probe(client: &hearth_mount::Bucket, prefix: &str) -> Result<(), ServiceError> {
    use hearth_mount::s3::S3Error;
    use hearth_store::RemoteErrorKind as K;
    match client.list_dir(prefix).await {
        Ok(_) => Ok(()),
        Err(S3Error::Timeout(t)) => Err(typed(
            ErrorCode::BucketUnreachable,
            format!("the endpoint did not answer within {t:?}"),
        )),
        Err(S3Error::Remote(r)) => {
            let (code, what) = match r.kind {
                K::NoSuchBucket => (ErrorCode::BucketNotFound, "no such bucket"),
                K::AccessDenied => (ErrorCode::BucketAccessDenied, "access denied"),
                K::Unreachable => (ErrorCode::BucketUnreachable, "endpoint unreachable"),
                K::ClockSkew => (
                    ErrorCode::BucketAccessDenied,
                    "request time refused (this host's clock is off)",
                ),
                K::Unavailable | K::Other => {
                    (ErrorCode::BucketUnreachable, "the endpoint failed the request")
                }
            };
            Err(typed(code, format!("{what}: {}", clip(&r.message, 300))))
        }
        Err(e) => Err(typed(ErrorCode::BucketUnreachable, format!("probe failed: {e}"))),
    }
}

fn url_of(row: &BucketRow) -> String {
    if row.prefix.is_empty() {
        format!("s3://{}", row.bucket)
    } else {
        format!("s3://{}/{}", row.bucket, row.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_prefixes() {
        assert_eq!(
            parse_url("s3://my-bucket").ok(),
            Some(("my-bucket".into(), String::new()))
        );
        assert_eq!(
            parse_url("s3://my-bucket/runs/42/").ok(),
            Some(("my-bucket".into(), "runs/42".into()))
        );
        for bad in [
            "http://b/x",
            "s3://AB",
            "s3://b",
            "s3://bucket/../x",
            "s3://bucket/a//b",
            "s3://bucket/a/./b",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn secrets_are_sealed_and_bound_to_the_name() -> std::io::Result<()> {
        let dir = tempfile::tempdir()?;
        let keys = BucketKeys::open(&dir.path().join("k"), BucketSettings::default())?;
        let sealed = keys.seal(
            "a",
            &Sealed {
                access_key_id: "AKID".into(),
                secret_access_key: "very-secret-value".into(),
            },
        );
        assert!(
            !sealed.windows(17).any(|w| w == b"very-secret-value"),
            "not in the clear"
        );
        assert_eq!(
            keys.open_sealed("a", &sealed)
                .map(|s| s.secret_access_key)
                .as_deref(),
            Some("very-secret-value")
        );
        assert!(
            keys.open_sealed("b", &sealed).is_none(),
            "bound to its bucket's name"
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(dir.path().join("k"))?.permissions().mode() & 0o777,
            0o600
        );
        Ok(())
    }
}
