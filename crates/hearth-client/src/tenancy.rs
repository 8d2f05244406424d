//! Projects, scoped API keys, quotas and the audit log (admin keys, except listing one's own project).

use hearth_api::{
    AUDIT_GENESIS, AuditEntry, AuditPage, CreateKeyRequest, CreateProjectRequest, CreatedKey, KeyList,
    Project, ProjectList, ProjectUsage, Quota,
};
use reqwest::Method;

use crate::{Client, Error};

impl Client {
    /// `POST /v1/projects`.
    pub async fn create_project(&self, req: &CreateProjectRequest) -> Result<Project, Error> {
        self.call(Method::POST, self.url(&["v1", "projects"]), Some(req))
            .await
    }

    /// `GET /v1/projects`.
    pub async fn list_projects(&self) -> Result<ProjectList, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "projects"]), None)
            .await
    }

    /// `GET /v1/projects/{name}/usage`.
    pub async fn project_usage(&self, project: &str) -> Result<ProjectUsage, Error> {
        let url = self.url(&["v1", "projects", project, "usage"]);
        self.call::<(), _>(Method::GET, url, None).await
    }

    /// `PUT /v1/projects/{name}/quota`.
    pub async fn set_quota(&self, project: &str, quota: &Quota) -> Result<Project, Error> {
        let url = self.url(&["v1", "projects", project, "quota"]);
        self.call(Method::PUT, url, Some(quota)).await
    }

    /// `POST /v1/keys`: the answer carries the key, shown only this once.
    pub async fn create_key(&self, req: &CreateKeyRequest) -> Result<CreatedKey, Error> {
        self.call(Method::POST, self.url(&["v1", "keys"]), Some(req))
            .await
    }

    /// `POST /v1/tokens`: a short-lived access token for a browser or WebSocket client.
    pub async fn create_token(
        &self,
        req: &hearth_api::CreateTokenRequest,
    ) -> Result<hearth_api::CreatedToken, Error> {
        self.call(Method::POST, self.url(&["v1", "tokens"]), Some(req))
            .await
    }

    /// `GET /v1/keys`.
    pub async fn list_keys(&self) -> Result<KeyList, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "keys"]), None)
            .await
    }

    /// `DELETE /v1/keys/{id}`.
    pub async fn revoke_key(&self, id: &str) -> Result<(), Error> {
        self.call_no_content::<()>(Method::DELETE, self.url(&["v1", "keys", id]), None)
            .await
    }

    /// `GET /v1/audit`: one page of entries after `after`.
    pub async fn audit_page(&self, after: u64, limit: u32) -> Result<AuditPage, Error> {
        let mut url = self.url(&["v1", "audit"]);
        url.query_pairs_mut()
            .append_pair("after", &after.to_string())
            .append_pair("limit", &limit.to_string());
        self.call::<(), _>(Method::GET, url, None).await
    }

    /// `GET /v1/audit/export`: the audit log as JSON Lines (one entry per line), streamed into `writer`.
    /// `filters` are query pairs (`after`, `project`, `key_id`, `since_ms`). Returns the bytes written.
    pub async fn audit_export<W>(&self, filters: &[(&str, String)], writer: &mut W) -> Result<u64, Error>
    where
        W: tokio::io::AsyncWrite + Unpin + ?Sized,
    {
        use futures::StreamExt;
        use tokio::io::AsyncWriteExt;
        let mut url = self.url(&["v1", "audit", "export"]);
        for (k, v) in filters {
            url.query_pairs_mut().append_pair(k, v);
        }
        let resp = self.send(self.request(Method::GET, &url), &url).await?;
        let mut body = resp.bytes_stream();
        let mut total = 0u64;
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| Error::transport(&url, e))?;
            writer.write_all(&chunk).await?;
            total += chunk.len() as u64;
        }
        writer.flush().await?;
        Ok(total)
    }

    /// The whole audit log, page by page.
    pub async fn audit_all(&self) -> Result<Vec<AuditEntry>, Error> {
        let mut all = Vec::new();
        let mut after = 0;
        loop {
            let page = self.audit_page(after, 1000).await?;
            all.extend(page.entries);
            match page.next_after {
                Some(n) => after = n,
                None => return Ok(all),
            }
        }
    }
}

/// Checks the whole log as fetched: it must start at entry 1 from the genesis hash and chain without a break.
pub fn verify_audit_log(entries: &[AuditEntry]) -> Result<String, hearth_api::AuditBreak> {
    if let Some(first) = entries.first()
        && first.seq != 1
    {
        return Err(hearth_api::AuditBreak {
            seq: first.seq,
            reason: "the log does not start at entry 1".into(),
        });
    }
    hearth_api::verify_audit_chain(AUDIT_GENESIS, entries)
}
