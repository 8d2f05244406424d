//! E2B compatibility: the official E2B SDKs (JavaScript `e2b`, Python `e2b`) drive hearth unchanged, with
//! `E2B_API_URL` and `E2B_SANDBOX_URL` pointed at the daemon.
//!
//! E2B has two APIs, and this crate speaks both on one side and hearth's HTTP API (through
//! [`hearth_client`], with the caller's own key) on the other:
//! - the **control plane** (E2B's public OpenAPI document: `POST /v2/sandboxes`, `GET /v2/sandboxes`,
//!   `/sandboxes/{id}/…`, `/snapshots`, `/templates/{id}`): [`control`];
//! - **envd**, the in-sandbox daemon: Connect RPC (JSON codec) for the `process.Process` and
//!   `filesystem.Filesystem` services, plus plain HTTP `GET/POST /files` and `/health`: [`envd`]. The SDKs
//!   send these to `E2B_SANDBOX_URL` with the headers `E2b-Sandbox-Id` and `E2b-Sandbox-Port`, or to the host
//!   name `{port}-{sandboxID}.{domain}`; only envd's own paths on such a request are taken for envd
//!   ([`envd_request`]), so a control-plane call is never mistaken for one.
//!
//! # Design
//! The daemon embeds the adapter ([`Adapter::router`] wraps the daemon's own router), and every call the
//! adapter makes goes over loopback to the daemon's public API with the key the E2B request carried
//! (`X-API-KEY` on the control plane; `X-Access-Token` on envd requests, which is the `envdAccessToken` the
//! control plane handed out: the caller's own key). So hearth's authentication, scoping and limits apply to
//! E2B callers exactly as to direct API callers, and the adapter can reach nothing the API does not expose.
//!
//! Two things E2B keeps in envd that hearth's API has no notion of live here, bounded and in memory:
//! processes started through envd ([`envd::procs`]: their output is fanned out to every E2B stream attached
//! to them, and they outlive those streams, as envd's do) and polled directory watchers
//! ([`envd::watchers`]). Both are lost when the daemon restarts.
//!
//! # Layout
//! - [`auth`]: which header carries the key, and the envd user.
//! - [`control`]: the control-plane routes, its wire types and error bodies.
//! - [`envd`]: Connect protocol framing, the process and filesystem services, `/files`, `/health`.

pub mod auth;
pub mod control;
pub mod envd;

use std::convert::Infallible;
use std::sync::Arc;

use axum::Router;
use axum::extract::Request;
use axum::http::HeaderMap;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

/// The port envd listens on in an E2B sandbox; the SDKs send it as `E2b-Sandbox-Port`.
pub const ENVD_PORT: u16 = 49983;

/// The envd version the adapter reports. The SDKs gate features on it (stdin control 0.3.0, no implicit user
/// 0.4.0, `closeStdin` 0.5.2, octet-stream uploads 0.5.7, file metadata 0.6.2 (refused here with a clear
/// error), watch events with entry info 0.6.3, network-mount watches 0.6.4): every one of those the adapter
/// either implements or refuses explicitly.
pub const ENVD_VERSION: &str = "0.6.4";

/// Header naming the sandbox of an envd request.
pub const SANDBOX_ID_HEADER: &str = "e2b-sandbox-id";
/// Header naming the port of an envd request.
pub const SANDBOX_PORT_HEADER: &str = "e2b-sandbox-port";

/// The id E2B callers see for a hearth sandbox: `sbx_0123…` becomes `sbx-0123…`. The SDKs put the id in host
/// names (`49983-{id}.DOMAIN`), and OpenSSL-based clients (the Python SDK) refuse a wildcard certificate for a
/// host label with an underscore. Ids of other shapes pass unchanged.
pub fn e2b_sandbox_id(hearth_id: &str) -> String {
    match hearth_id.strip_prefix("sbx_") {
        Some(hex) if hearth_api::is_valid_sandbox_id(hearth_id) => format!("sbx-{hex}"),
        _ => hearth_id.to_owned(),
    }
}

/// The hearth id for a sandbox id an E2B caller sent: `sbx-…` (as the adapter hands them out) or hearth's own
/// `sbx_…`. Anything else passes unchanged (and the daemon answers that it does not exist).
pub fn hearth_sandbox_id(id: &str) -> String {
    match id.strip_prefix("sbx-") {
        Some(hex) => {
            let hearth = format!("sbx_{hex}");
            if hearth_api::is_valid_sandbox_id(&hearth) {
                hearth
            } else {
                id.to_owned()
            }
        }
        None => id.to_owned(),
    }
}

/// The sandbox (and port) an envd request is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvdTarget {
    /// hearth's id ([`hearth_sandbox_id`] of what was sent); not validated here (an unknown or malformed id
    /// answers like a sandbox that does not exist).
    pub sandbox_id: String,
    pub port: u16,
}

/// Whether a request is for a sandbox's envd, and which: one of envd's paths ([`is_envd_path`]) on a request
/// that names a sandbox ([`envd_target`]). Some SDK releases send the sandbox headers on control-plane calls
/// too, so the headers alone never make a request envd's.
pub fn envd_request(path: &str, headers: &HeaderMap) -> Option<EnvdTarget> {
    if !is_envd_path(path) {
        return None;
    }
    envd_target(headers)
}

/// envd's routes: `/health`, `/files`, and the Connect services `/process.Process/*` and
/// `/filesystem.Filesystem/*`. None of them is a control-plane or hearth path.
pub fn is_envd_path(path: &str) -> bool {
    matches!(path, "/health" | "/files")
        || path.starts_with("/process.Process/")
        || path.starts_with("/filesystem.Filesystem/")
}

/// The sandbox a request names: the `E2b-Sandbox-Id` header (with `E2b-Sandbox-Port`, default
/// [`ENVD_PORT`]), else a host name whose first label is `{port}-{sandbox id}`
/// (`49983-sbx_0123456789abcdef.e2b.example.com`).
pub fn envd_target(headers: &HeaderMap) -> Option<EnvdTarget> {
    if let Some(id) = headers.get(SANDBOX_ID_HEADER) {
        let sandbox_id = hearth_sandbox_id(String::from_utf8_lossy(id.as_bytes()).trim());
        let port = headers
            .get(SANDBOX_PORT_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u16>().ok())
            .unwrap_or(ENVD_PORT);
        return Some(EnvdTarget { sandbox_id, port });
    }
    let host = headers.get(http::header::HOST)?.to_str().ok()?;
    host_target(host)
}

/// `{port}-{sbx_…}.anything[:port]` → the target; any other host name is not an envd host.
fn host_target(host: &str) -> Option<EnvdTarget> {
    let (label, rest) = host.split_once('.')?;
    if rest.is_empty() {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port = port.parse::<u16>().ok().filter(|p| *p > 0)?;
    let id = hearth_sandbox_id(&id.to_ascii_lowercase());
    hearth_api::is_valid_sandbox_id(&id).then_some(EnvdTarget { sandbox_id: id, port })
}

/// What every handler of the adapter reaches (opaque outside the crate).
pub struct Shared {
    /// The daemon's API without a key; each request gets a copy with the caller's key.
    hearth: hearth_client::Client,
    pub(crate) procs: envd::procs::Registry,
    pub(crate) watchers: envd::watchers::Registry,
    /// Cancelled when the daemon shuts down: long streams end, background tasks stop.
    pub(crate) stop: CancellationToken,
}

impl Shared {
    /// A client of the daemon that authenticates as `key`.
    pub(crate) fn client(&self, key: &str) -> Result<hearth_client::Client, hearth_client::Error> {
        self.hearth.with_api_key(key)
    }
}

/// The E2B adapter of one daemon.
#[derive(Clone)]
pub struct Adapter {
    shared: Arc<Shared>,
}

impl Adapter {
    /// An adapter that calls the daemon's API at `api_base` (its own loopback address). Cancelling `stop`
    /// ends its open streams and background tasks (so a graceful shutdown is not held up by them).
    pub fn new(api_base: &str, stop: CancellationToken) -> Result<Adapter, hearth_client::Error> {
        let hearth = hearth_client::Client::without_key(api_base)?;
        Ok(Adapter {
            shared: Arc::new(Shared {
                hearth,
                procs: envd::procs::Registry::default(),
                watchers: envd::watchers::Registry::default(),
                stop,
            }),
        })
    }

    /// `hearth` (the daemon's router) with E2B's control-plane routes merged in, behind a dispatcher that sends
    /// envd requests ([`envd_request`]) to the envd adapter.
    pub fn router(&self, hearth: Router) -> Router {
        let app = hearth.merge(control::routes(self.shared.clone()));
        let envd = envd::routes(self.shared.clone());
        Router::new().fallback_service(tower::service_fn(move |req: Request| {
            let (app, envd) = (app.clone(), envd.clone());
            async move {
                let resp = match envd_request(req.uri().path(), req.headers()) {
                    Some(target) => envd.oneshot(envd::with_target(req, target)).await,
                    None => app.oneshot(req).await,
                };
                Ok::<_, Infallible>(resp.unwrap_or_else(|never| match never {}))
            }
        }))
    }

    /// The control-plane routes alone (tests).
    pub fn control_plane(&self) -> Router {
        control::routes(self.shared.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                *k,
                HeaderValue::from_str(v).unwrap_or(HeaderValue::from_static("x")),
            );
        }
        h
    }

    #[test]
    fn envd_requests_are_recognised_by_header_or_host_only() {
        let id = "sbx_0123456789abcdef";
        assert_eq!(
            envd_target(&headers(&[("e2b-sandbox-id", id), ("e2b-sandbox-port", "49983")])),
            Some(EnvdTarget {
                sandbox_id: id.into(),
                port: 49983
            })
        );
        assert_eq!(
            envd_target(&headers(&[("e2b-sandbox-id", id)])).map(|t| t.port),
            Some(ENVD_PORT)
        );
        assert_eq!(
            envd_target(&headers(&[("e2b-sandbox-id", "sbx-0123456789abcdef")])).map(|t| t.sandbox_id),
            Some(id.to_owned()),
            "the E2B form of the id"
        );
        assert_eq!(
            envd_target(&headers(&[(
                "host",
                "49983-sbx-0123456789abcdef.e2b.example.com"
            )]))
            .map(|t| t.sandbox_id),
            Some(id.to_owned())
        );
        assert_eq!(
            envd_target(&headers(&[(
                "host",
                "3000-sbx_0123456789ABCDEF.e2b.example.com:443"
            )])),
            Some(EnvdTarget {
                sandbox_id: id.into(),
                port: 3000
            })
        );
        for host in [
            "127.0.0.1:7070",
            "api.e2b.example.com",
            "localhost",
            "49983-sbx_0123456789abcdef",
            "49983-sbx_xyz.example.com",
            "0-sbx_0123456789abcdef.example.com",
            "999999-sbx_0123456789abcdef.example.com",
            "-sbx_0123456789abcdef.example.com",
            "49983-sbx_0123456789abcdef.",
        ] {
            assert_eq!(envd_target(&headers(&[("host", host)])), None, "{host}");
        }
        assert_eq!(envd_target(&HeaderMap::new()), None);
    }

    #[test]
    fn e2b_ids_have_no_underscore_and_map_back() {
        assert_eq!(e2b_sandbox_id("sbx_0123456789abcdef"), "sbx-0123456789abcdef");
        assert_eq!(hearth_sandbox_id("sbx-0123456789abcdef"), "sbx_0123456789abcdef");
        assert_eq!(hearth_sandbox_id("sbx_0123456789abcdef"), "sbx_0123456789abcdef");
        for odd in ["sbx-../etc", "sbx-", "xyz", "sbx_zz", ""] {
            assert_eq!(hearth_sandbox_id(odd), odd);
            assert_eq!(e2b_sandbox_id(odd), odd);
        }
    }

    #[test]
    fn only_envd_paths_go_to_envd_even_with_the_headers() {
        let h = headers(&[("e2b-sandbox-id", "sbx_0123456789abcdef")]);
        for path in [
            "/health",
            "/files",
            "/process.Process/Start",
            "/filesystem.Filesystem/Stat",
        ] {
            assert!(envd_request(path, &h).is_some(), "{path}");
            assert!(
                envd_request(path, &HeaderMap::new()).is_none(),
                "{path} without a sandbox"
            );
        }
        for path in [
            "/sandboxes/sbx_0123456789abcdef/connect",
            "/v2/sandboxes",
            "/v1/sandboxes",
            "/metrics",
            "/healthz",
            "/files/x",
            "/process.Process",
        ] {
            assert!(envd_request(path, &h).is_none(), "{path}");
        }
    }
}
