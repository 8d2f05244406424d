use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use hearth_api::{
    CreateSandboxRequest, CreateTemplateRequest, ForkRequest, ForkResponse, Sandbox, SandboxBoundary,
    SandboxList, SandboxState, SandboxUsage, SetTimeoutRequest, SnapshotList, SnapshotObject, SystemInfo,
    Template, TemplateList, UsageReport,
};
use reqwest::{Method, RequestBuilder, Response, Url};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::Error;

/// Where a local daemon listens unless `HEARTH_URL` says otherwise.
pub const DEFAULT_URL: &str = "http://127.0.0.1:7070";
/// The daemon's data directory unless `HEARTH_DATA_DIR` says otherwise; it holds the `api-key` file.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/hearth";

/// Largest error body read from a failed response; the rest is dropped.
const MAX_ERROR_BODY: usize = 64 * 1024;
/// Largest JSON response body accepted (sandbox and file lists included).
const MAX_JSON_BODY: usize = 64 * 1024 * 1024;
/// Longest an API key file may be; a key is a short token.
const MAX_KEY_FILE: u64 = 4096;

/// A handle on one hearthd. Cheap to clone: clones share the connection pool.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    api_key: Option<String>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the key.
        f.debug_struct("Client")
            .field("base", &self.base.as_str())
            .field("api_key", &self.api_key.as_ref().map(|_| "<set>"))
            .finish()
    }
}

/// Filters of `GET /v1/sandboxes`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ListFilter {
    pub state: Option<SandboxState>,
    /// Only sandboxes whose metadata has all of these pairs.
    pub metadata: BTreeMap<String, String>,
}

impl Client {
    /// A client for the daemon at `base_url` (e.g. `http://127.0.0.1:7070`) using `api_key`.
    pub fn new(base_url: &str, api_key: impl Into<String>) -> Result<Self, Error> {
        Self::build(base_url, Some(api_key.into()))
    }

    /// A client that sends no key: only `/healthz` and friends will answer.
    pub fn without_key(base_url: &str) -> Result<Self, Error> {
        Self::build(base_url, None)
    }

    /// A client configured like the CLI: `HEARTH_URL` (default [`DEFAULT_URL`]) and `HEARTH_API_KEY`, else the
    /// key in `$HEARTH_DATA_DIR/api-key` when this user can read it.
    pub fn from_env() -> Result<Self, Error> {
        let url = non_empty_env("HEARTH_URL").unwrap_or_else(|| DEFAULT_URL.to_owned());
        let key = non_empty_env("HEARTH_API_KEY").or_else(|| read_key_file(&default_key_path()));
        Self::build(&url, key)
    }

    fn build(base_url: &str, api_key: Option<String>) -> Result<Self, Error> {
        let invalid = |reason: &str| Error::InvalidUrl {
            url: base_url.to_owned(),
            reason: reason.to_owned(),
        };
        let base = Url::parse(base_url).map_err(|e| invalid(&e.to_string()))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(invalid("the scheme must be http or https"));
        }
        if base.cannot_be_a_base() || base.host().is_none() {
            return Err(invalid("no host"));
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(invalid("a base URL takes no query or fragment"));
        }
        if let Some(key) = &api_key
            && !key.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(Error::InvalidApiKey);
        }
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            // The daemon is local or reached directly; an environment proxy would only get in the way.
            .no_proxy()
            // Idle pooled connections are dropped after 30 s, before a server or proxy in between is likely
            // to close them, so a pooled request does not race such a close.
            .pool_idle_timeout(Duration::from_secs(30))
            .user_agent(concat!("hearth-client/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| invalid(&e.to_string()))?;
        Ok(Client { http, base, api_key })
    }

    /// A client for the same daemon, sharing this one's connection pool, that sends `api_key` instead (a
    /// server forwarding each caller's own key builds one per request this way).
    pub fn with_api_key(&self, api_key: impl Into<String>) -> Result<Self, Error> {
        let key = api_key.into();
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(Error::InvalidApiKey);
        }
        Ok(Client {
            http: self.http.clone(),
            base: self.base.clone(),
            api_key: Some(key),
        })
    }

    /// The daemon's base URL.
    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// The key sent with every request (for the WebSocket handshake).
    pub(crate) fn api_key(&self) -> Option<&str> {
        self.api_key.as_deref()
    }

    /// Whether a key will be sent.
    pub fn has_api_key(&self) -> bool {
        self.api_key.is_some()
    }

    /// The URL of `segments` under the base; each segment is percent-encoded, so ids cannot inject paths.
    pub(crate) fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    pub(crate) fn request(&self, method: Method, url: &Url) -> RequestBuilder {
        let builder = self.http.request(method, url.clone());
        match &self.api_key {
            Some(key) => builder.bearer_auth(key),
            None => builder,
        }
    }

    /// Sends a request and turns a non-2xx answer into [`Error::Api`].
    pub(crate) async fn send(&self, builder: RequestBuilder, url: &Url) -> Result<Response, Error> {
        let resp = builder.send().await.map_err(|e| Error::transport(url, e))?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body = read_limited(resp, MAX_ERROR_BODY, url).await?;
        Err(Error::from_response_body(status.as_u16(), &body))
    }

    /// Sends a request with a JSON body (or none) and decodes a JSON answer.
    pub(crate) async fn call<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: Method,
        url: Url,
        body: Option<&B>,
    ) -> Result<T, Error> {
        let resp = self.send(self.with_json(method, &url, body), &url).await?;
        decode_json(resp, &url).await
    }

    /// Like [`Client::call`] for routes whose answer body does not matter (204, or a body we ignore).
    pub(crate) async fn call_no_content<B: Serialize + ?Sized>(
        &self,
        method: Method,
        url: Url,
        body: Option<&B>,
    ) -> Result<(), Error> {
        let resp = self.send(self.with_json(method, &url, body), &url).await?;
        // Drain (bounded) so the connection can be reused.
        read_limited(resp, MAX_JSON_BODY, &url).await?;
        Ok(())
    }

    fn with_json<B: Serialize + ?Sized>(
        &self,
        method: Method,
        url: &Url,
        body: Option<&B>,
    ) -> RequestBuilder {
        let builder = self.request(method, url);
        match body {
            Some(b) => builder.json(b),
            None => builder,
        }
    }

    /// `GET /healthz`: Ok when the daemon answers.
    pub async fn health(&self) -> Result<(), Error> {
        self.call_no_content::<()>(Method::GET, self.url(&["healthz"]), None)
            .await
    }

    /// `GET /v1/system`.
    pub async fn system(&self) -> Result<SystemInfo, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "system"]), None)
            .await
    }

    /// `GET /metrics` (Prometheus text).
    pub async fn metrics(&self) -> Result<String, Error> {
        let url = self.url(&["metrics"]);
        let resp = self.send(self.request(Method::GET, &url), &url).await?;
        let body = read_limited(resp, MAX_JSON_BODY, &url).await?;
        String::from_utf8(body).map_err(|_| Error::Decode("metrics are not UTF-8".into()))
    }

    /// `GET /openapi.json`.
    pub async fn openapi(&self) -> Result<serde_json::Value, Error> {
        self.call::<(), _>(Method::GET, self.url(&["openapi.json"]), None)
            .await
    }

    /// `POST /v1/sandboxes`: boots a sandbox and returns it once it runs.
    pub async fn create_sandbox(&self, req: &CreateSandboxRequest) -> Result<Sandbox, Error> {
        self.call(Method::POST, self.url(&["v1", "sandboxes"]), Some(req))
            .await
    }

    /// `GET /v1/sandboxes`, every page: all sandboxes that match `filter`.
    pub async fn list_sandboxes(&self, filter: &ListFilter) -> Result<SandboxList, Error> {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut url = self.url(&["v1", "sandboxes"]);
            {
                let mut q = url.query_pairs_mut();
                if let Some(state) = filter.state {
                    q.append_pair("state", state.as_str());
                }
                for (k, v) in &filter.metadata {
                    q.append_pair(&format!("metadata.{k}"), v);
                }
                if let Some(c) = &cursor {
                    q.append_pair("cursor", c);
                }
            }
            if url.query() == Some("") {
                url.set_query(None);
            }
            let page: SandboxList = self.call::<(), _>(Method::GET, url, None).await?;
            all.extend(page.sandboxes);
            match page.next_cursor {
                // A cursor that does not move on would loop forever: stop at what we have.
                Some(c) if cursor.as_ref() != Some(&c) => cursor = Some(c),
                _ => break,
            }
        }
        Ok(SandboxList {
            sandboxes: all,
            next_cursor: None,
        })
    }

    /// `GET /v1/sandboxes/{id}`.
    pub async fn get_sandbox(&self, id: &str) -> Result<Sandbox, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "sandboxes", id]), None)
            .await
    }

    /// `DELETE /v1/sandboxes/{id}`: stops the VM and removes its files.
    pub async fn delete_sandbox(&self, id: &str) -> Result<(), Error> {
        self.call_no_content::<()>(Method::DELETE, self.url(&["v1", "sandboxes", id]), None)
            .await
    }

    /// `POST /v1/sandboxes/{id}/timeout`: the sandbox now ends `timeout_s` seconds from now. Returns the
    /// sandbox with its new `end_at`.
    pub async fn set_timeout(&self, id: &str, timeout_s: u64) -> Result<Sandbox, Error> {
        let url = self.url(&["v1", "sandboxes", id, "timeout"]);
        self.call(Method::POST, url, Some(&SetTimeoutRequest { timeout_s }))
            .await
    }

    /// `POST /v1/sandboxes/{id}/pause`: saves the running state to disk and ends the VM process.
    pub async fn pause_sandbox(&self, id: &str) -> Result<Sandbox, Error> {
        self.call::<(), _>(Method::POST, self.url(&["v1", "sandboxes", id, "pause"]), None)
            .await
    }

    /// `POST /v1/sandboxes/{id}/resume`: restores a paused sandbox into a fresh VM process.
    pub async fn resume_sandbox(&self, id: &str) -> Result<Sandbox, Error> {
        self.call::<(), _>(Method::POST, self.url(&["v1", "sandboxes", id, "resume"]), None)
            .await
    }

    /// `POST /v1/sandboxes/{id}/fork`: `count` children continuing the sandbox's state; it keeps running.
    pub async fn fork_sandbox(&self, id: &str, count: u32) -> Result<ForkResponse, Error> {
        let url = self.url(&["v1", "sandboxes", id, "fork"]);
        self.call(Method::POST, url, Some(&ForkRequest { count: Some(count) }))
            .await
    }

    /// `POST /v1/sandboxes/{id}/snapshots`: checkpoints the sandbox (it continues) into a snapshot object.
    pub async fn snapshot_sandbox(&self, id: &str) -> Result<SnapshotObject, Error> {
        self.call::<(), _>(
            Method::POST,
            self.url(&["v1", "sandboxes", id, "snapshots"]),
            None,
        )
        .await
    }

    /// `GET /v1/snapshots`.
    pub async fn list_snapshots(&self) -> Result<SnapshotList, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "snapshots"]), None)
            .await
    }

    /// `DELETE /v1/snapshots/{id}` (refused with `conflict` while sandboxes created from it exist).
    pub async fn delete_snapshot(&self, id: &str) -> Result<(), Error> {
        self.call_no_content::<()>(Method::DELETE, self.url(&["v1", "snapshots", id]), None)
            .await
    }

    /// `POST /v1/templates`: saves a sandbox (and with `include_memory` its running state) as a template.
    pub async fn create_template(&self, req: &CreateTemplateRequest) -> Result<Template, Error> {
        self.call(Method::POST, self.url(&["v1", "templates"]), Some(req))
            .await
    }

    /// `GET /v1/templates`: built-in and saved templates.
    pub async fn list_templates(&self) -> Result<TemplateList, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "templates"]), None)
            .await
    }

    /// `DELETE /v1/templates/{name}` (refused while sandboxes use it, and for built-in templates).
    pub async fn delete_template(&self, name: &str) -> Result<(), Error> {
        self.call_no_content::<()>(Method::DELETE, self.url(&["v1", "templates", name]), None)
            .await
    }

    /// `GET /v1/sandboxes/{id}/usage`: usage of one sandbox since its creation.
    pub async fn sandbox_usage(&self, id: &str) -> Result<SandboxUsage, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "sandboxes", id, "usage"]), None)
            .await
    }

    /// `GET /v1/sandboxes/{id}/boundary`: the sandbox's isolation as the host reports it now.
    pub async fn boundary(&self, id: &str) -> Result<SandboxBoundary, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "sandboxes", id, "boundary"]), None)
            .await
    }

    /// `GET /v1/usage?from=&to=`: usage of every sandbox within a window (RFC 3339 or unix seconds; the
    /// daemon defaults to the last 24 hours).
    pub async fn usage(&self, from: Option<&str>, to: Option<&str>) -> Result<UsageReport, Error> {
        let mut url = self.url(&["v1", "usage"]);
        if from.is_some() || to.is_some() {
            let mut q = url.query_pairs_mut();
            if let Some(f) = from {
                q.append_pair("from", f);
            }
            if let Some(t) = to {
                q.append_pair("to", t);
            }
        }
        self.call::<(), _>(Method::GET, url, None).await
    }
}

/// Reads a JSON answer (bounded) and decodes it.
pub(crate) async fn decode_json<T: DeserializeOwned>(resp: Response, url: &Url) -> Result<T, Error> {
    let bytes = read_limited(resp, MAX_JSON_BODY, url).await?;
    serde_json::from_slice(&bytes).map_err(|e| Error::Decode(format!("{}: {e}", url.path())))
}

/// Reads at most `limit` bytes of a body; more is an error rather than unbounded memory.
pub(crate) async fn read_limited(resp: Response, limit: usize, url: &Url) -> Result<Vec<u8>, Error> {
    let mut out = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk: Bytes = chunk.map_err(|e| Error::transport(url, e))?;
        if out.len() + chunk.len() > limit {
            return Err(Error::Decode(format!(
                "{}: response body larger than {limit} bytes",
                url.path()
            )));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

fn non_empty_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// `$HEARTH_DATA_DIR/api-key`, default `/var/lib/hearth/api-key`.
pub fn default_key_path() -> PathBuf {
    let dir = std::env::var_os("HEARTH_DATA_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR));
    dir.join("api-key")
}

/// The key in `path`, trimmed, or None when the file is missing, unreadable, empty or not a plausible key.
pub fn read_key_file(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)
        .ok()?
        .take(MAX_KEY_FILE)
        .read_to_string(&mut text)
        .ok()?;
    let key = text.trim();
    (!key.is_empty() && key.bytes().all(|b| b.is_ascii_graphic())).then(|| key.to_owned())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn urls_encode_segments_and_keep_a_base_path() {
        let c = Client::new("http://127.0.0.1:7070", "k").unwrap();
        assert_eq!(
            c.url(&["v1", "sandboxes", "../x?y"]).as_str(),
            "http://127.0.0.1:7070/v1/sandboxes/..%2Fx%3Fy"
        );
        let c = Client::new("http://h:1/prefix/", "k").unwrap();
        assert_eq!(c.url(&["healthz"]).as_str(), "http://h:1/prefix/healthz");
    }

    #[test]
    fn bad_urls_and_keys_are_refused() {
        assert!(matches!(
            Client::new("ftp://x", "k"),
            Err(Error::InvalidUrl { .. })
        ));
        assert!(matches!(
            Client::new("not a url", "k"),
            Err(Error::InvalidUrl { .. })
        ));
        assert!(matches!(
            Client::new("http://h?x=1", "k"),
            Err(Error::InvalidUrl { .. })
        ));
        assert!(matches!(
            Client::new("http://h", "a\nb"),
            Err(Error::InvalidApiKey)
        ));
        assert!(format!("{:?}", Client::new("http://h", "secret").unwrap()).contains("<set>"));
        assert!(!format!("{:?}", Client::new("http://h", "secret").unwrap()).contains("secret"));
    }

    #[test]
    fn with_api_key_swaps_the_key_and_refuses_bad_ones() {
        let c = Client::without_key("http://127.0.0.1:7070").unwrap();
        assert!(!c.has_api_key());
        let k = c.with_api_key("hk_abc").unwrap();
        assert_eq!(k.api_key(), Some("hk_abc"));
        assert_eq!(k.base_url(), c.base_url());
        assert!(matches!(c.with_api_key(""), Err(Error::InvalidApiKey)));
        assert!(matches!(c.with_api_key("a b"), Err(Error::InvalidApiKey)));
    }

    #[test]
    fn key_file_is_trimmed_and_junk_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("api-key");
        std::fs::write(&path, "hk_abc123\n").unwrap();
        assert_eq!(read_key_file(&path).as_deref(), Some("hk_abc123"));
        std::fs::write(&path, "two words\n").unwrap();
        assert_eq!(read_key_file(&path), None);
        std::fs::write(&path, "").unwrap();
        assert_eq!(read_key_file(&path), None);
        assert_eq!(read_key_file(&dir.path().join("missing")), None);
    }
}
