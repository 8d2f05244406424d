//! The daemon's storage bucket (`hearthd --storage`): status and garbage collection.

use hearth_api::{DiskSync, StorageGcReport, StorageStatus};
use reqwest::Method;

use crate::{Client, Error};

impl Client {
    /// `GET /v1/storage`: the bucket, its health, pending uploads and where each object lives.
    pub async fn storage_status(&self) -> Result<StorageStatus, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "storage"]), None)
            .await
    }

    /// `POST /v1/sandboxes/{id}/sync`: captures the running sandbox's disk (its vCPUs stop only for the copy)
    /// and uploads it to the storage bucket in the background.
    pub async fn sync_sandbox(&self, id: &str) -> Result<DiskSync, Error> {
        self.call::<(), _>(Method::POST, self.url(&["v1", "sandboxes", id, "sync"]), None)
            .await
    }

    /// `POST /v1/storage/gc[?grace_s=N]`: one garbage-collection pass now.
    pub async fn storage_gc(&self, grace_s: Option<u64>) -> Result<StorageGcReport, Error> {
        let mut url = self.url(&["v1", "storage", "gc"]);
        if let Some(g) = grace_s {
            url.query_pairs_mut().append_pair("grace_s", &g.to_string());
        }
        self.call::<(), _>(Method::POST, url, None).await
    }
}
