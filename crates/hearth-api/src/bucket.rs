//! Buckets registered as named credentials, and mounts of them in sandboxes.

use serde::{Deserialize, Serialize};

/// Body of `POST /v1/buckets`: registers an S3-compatible bucket (Amazon S3, MinIO, Cloudflare R2) under a
/// name. The daemon probes it (list, write, read, delete one small object) before it accepts it. The secret
/// is stored encrypted on the host and returned by no API answer.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateBucketRequest {
    /// 1-63 characters of `[a-z0-9-]`, starting with a letter or digit.
    pub name: String,
    /// `s3://BUCKET` or `s3://BUCKET/PREFIX`: mounts see only what is under the prefix.
    pub url: String,
    /// Endpoint of a non-AWS service, e.g. `https://ACCOUNT.r2.cloudflarestorage.com` or a MinIO URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Region (default `us-east-1`; R2 uses `auto`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<String>,
    /// Path-style addressing (`ENDPOINT/BUCKET/KEY`). Default: true with a custom endpoint, false on AWS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path_style: Option<bool>,
    pub access_key_id: String,
    pub secret_access_key: String,
}

/// A registered bucket (`GET /v1/buckets/{name}`); never its secret.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Bucket {
    pub name: String,
    /// `s3://BUCKET[/PREFIX]` as registered.
    pub url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    pub region: String,
    pub path_style: bool,
    /// The last four characters of the access key id (enough to tell keys apart, not to use one).
    pub access_key_hint: String,
    /// RFC 3339 registration time.
    pub created_at: String,
    /// Sandboxes that mount it now (deleting the bucket is refused while any does).
    #[serde(default)]
    pub mounted_by: Vec<String>,
}

/// Body of `GET /v1/buckets`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct BucketList {
    pub buckets: Vec<Bucket>,
}

/// A mount asked for at create time (`mounts` of `POST /v1/sandboxes`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct MountSpec {
    /// Absolute path in the guest, e.g. `/mnt/data` (not `/` nor a system directory such as `/proc`).
    pub path: String,
    /// A registered bucket's name.
    pub bucket: String,
    /// A sub-prefix under the bucket's own prefix, e.g. `runs/42/` (the mount sees only what is under it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Refuse every change (enforced on the host: writes fail with EROFS). Default false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
}

/// Body of `PUT /v1/sandboxes/{id}/mounts?path=...`: mounts a bucket in a running sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct AttachMountRequest {
    pub bucket: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
}

/// `?path=` of `PUT` and `DELETE /v1/sandboxes/{id}/mounts`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::IntoParams))]
#[serde(deny_unknown_fields)]
pub struct MountPathQuery {
    /// The mount's absolute path in the guest.
    pub path: String,
}

/// A bucket mounted in a sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Mount {
    pub path: String,
    pub bucket: String,
    /// The sub-prefix under the bucket's prefix (`""` for all of it).
    pub prefix: String,
    pub read_only: bool,
    /// Bytes read from the bucket through this mount since it was made.
    pub bytes_read: u64,
    /// Bytes written to it through this mount since it was made.
    pub bytes_written: u64,
}

/// Body of `GET /v1/sandboxes/{id}/mounts`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct MountList {
    pub mounts: Vec<Mount>,
}

/// Checks a bucket name: 1-63 of `[a-z0-9-]`, starting with a letter or digit.
pub fn is_valid_bucket_name(name: &str) -> bool {
    crate::is_valid_template_name(name)
}
