//! Buckets as named credentials, and mounts of them in sandboxes.

use hearth_api::{AttachMountRequest, Bucket, BucketList, CreateBucketRequest, Mount, MountList, MountSpec};
use reqwest::Method;

use crate::{Client, Error};

impl Client {
    /// `POST /v1/buckets`: registers a bucket (probed by the daemon; the secret is never returned).
    pub async fn create_bucket(&self, req: &CreateBucketRequest) -> Result<Bucket, Error> {
        self.call(Method::POST, self.url(&["v1", "buckets"]), Some(req))
            .await
    }

    /// `GET /v1/buckets`.
    pub async fn list_buckets(&self) -> Result<BucketList, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "buckets"]), None)
            .await
    }

    /// `GET /v1/buckets/{name}`.
    pub async fn get_bucket(&self, name: &str) -> Result<Bucket, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "buckets", name]), None)
            .await
    }

    /// `DELETE /v1/buckets/{name}` (refused with `conflict` while mounted).
    pub async fn delete_bucket(&self, name: &str) -> Result<(), Error> {
        self.call_no_content::<()>(Method::DELETE, self.url(&["v1", "buckets", name]), None)
            .await
    }

    /// `GET /v1/sandboxes/{id}/mounts`.
    pub async fn list_mounts(&self, id: &str) -> Result<MountList, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "sandboxes", id, "mounts"]), None)
            .await
    }

    /// `PUT /v1/sandboxes/{id}/mounts?path=`: mounts a bucket in a running sandbox.
    pub async fn mount(&self, id: &str, spec: &MountSpec) -> Result<Mount, Error> {
        let mut url = self.url(&["v1", "sandboxes", id, "mounts"]);
        url.query_pairs_mut().append_pair("path", &spec.path);
        let req = AttachMountRequest {
            bucket: spec.bucket.clone(),
            prefix: spec.prefix.clone(),
            read_only: spec.read_only,
        };
        self.call(Method::PUT, url, Some(&req)).await
    }

    /// `DELETE /v1/sandboxes/{id}/mounts?path=`.
    pub async fn unmount(&self, id: &str, path: &str) -> Result<(), Error> {
        let mut url = self.url(&["v1", "sandboxes", id, "mounts"]);
        url.query_pairs_mut().append_pair("path", path);
        self.call_no_content::<()>(Method::DELETE, url, None).await
    }
}

/// Parses the CLI's mount form `NAME[:PREFIX]:PATH[:ro|:rw]` (the path is the part starting with `/`).
pub fn parse_mount(s: &str) -> Result<MountSpec, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let bad = || format!("{s:?}: expected BUCKET[:PREFIX]:PATH[:ro]");
    let (rest, read_only) = match parts.last() {
        Some(&"ro") => (&parts[..parts.len() - 1], Some(true)),
        Some(&"rw") => (&parts[..parts.len() - 1], Some(false)),
        _ => (&parts[..], None),
    };
    let (bucket, prefix, path) = match rest {
        [b, p] if p.starts_with('/') => (*b, None, *p),
        [b, pre, p] if p.starts_with('/') => (*b, Some(pre.to_string()), *p),
        _ => return Err(bad()),
    };
    if bucket.is_empty() {
        return Err(bad());
    }
    Ok(MountSpec {
        path: path.to_string(),
        bucket: bucket.to_string(),
        prefix: prefix.filter(|p| !p.is_empty()),
        read_only,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_forms() {
        let m = parse_mount("data:/mnt/data").unwrap_or_default();
        assert_eq!(
            (m.bucket.as_str(), m.prefix, m.path.as_str(), m.read_only),
            ("data", None, "/mnt/data", None)
        );
        let m = parse_mount("data:runs/42/:/mnt/in:ro").unwrap_or_default();
        assert_eq!(
            (m.prefix.as_deref(), m.path.as_str(), m.read_only),
            (Some("runs/42/"), "/mnt/in", Some(true))
        );
        let m = parse_mount("data:/mnt/x:rw").unwrap_or_default();
        assert_eq!(m.read_only, Some(false));
        for bad in ["data", "data:mnt", ":/x", "a:b:c:d:e", "data:pre:rel"] {
            assert!(parse_mount(bad).is_err(), "{bad}");
        }
    }
}
