//! envd, E2B's in-sandbox API, served from the host: every request names its sandbox ([`crate::EnvdTarget`])
//! and is carried out through the daemon's API with the caller's key.
//!
//! - [`connect`]: Connect protocol framing and error codes.
//! - [`proto`]: the JSON messages.
//! - [`process`]: `process.Process` (start, connect, list, input, signals); [`procs`] keeps the processes
//!   started here and fans their output out; [`pty`] holds terminals.
//! - [`filesystem`]: `filesystem.Filesystem` (stat, list, mkdir, move, remove); [`watchers`]: its watches.
//! - [`files`]: `GET/POST /files`; `/health` is here.

pub mod connect;
pub mod files;
pub mod filesystem;
pub mod process;
pub mod procs;
pub mod proto;
pub mod pty;
pub mod watchers;

use std::sync::Arc;

use axum::Router;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hearth_api::{ErrorCode, SandboxState};

use crate::{ENVD_PORT, EnvdTarget, Shared};
use connect::{Code, Fault};
pub use pty::{pty_size, start as pty_start};

/// The envd routes. Requests arrive here only when [`crate::envd_target`] recognised them.
pub fn routes(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/health", get(health))
        .route(
            "/files",
            get(files::download)
                .post(files::upload)
                .layer(DefaultBodyLimit::disable()),
        )
        .route("/process.Process/{method}", post(process::dispatch))
        .route("/filesystem.Filesystem/{method}", post(filesystem::dispatch))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(connect::MAX_MESSAGE))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_| {
            Fault::new(Code::Internal, "internal error").unary_response()
        }))
        .with_state(shared)
}

/// Attaches the target [`crate::Adapter::router`] found, for the extractors.
pub fn with_target(mut req: Request, target: EnvdTarget) -> Request {
    req.extensions_mut().insert(target);
    req
}

async fn not_found(req: Request) -> Response {
    let what = match req.extensions().get::<EnvdTarget>() {
        Some(t) if t.port != ENVD_PORT => format!(
            "port {} of sandbox {} is not reachable through the E2B adapter: use hearth's exposed ports \
             (POST /v1/sandboxes/{{id}}/ports/{{port}}/token)",
            t.port, t.sandbox_id
        ),
        _ => format!("no envd route {}", req.uri().path()),
    };
    http_error(&Fault::new(Code::NotFound, what))
}

/// An envd request: its sandbox, the caller's key and a daemon client with that key, the user it asks for.
#[derive(Clone)]
pub struct Envd {
    pub sandbox: String,
    pub key: String,
    pub api: hearth_client::Client,
    pub user: Option<String>,
    pub shared: Arc<Shared>,
}

impl FromRequestParts<Arc<Shared>> for Envd {
    type Rejection = Fault;

    async fn from_request_parts(parts: &mut Parts, st: &Arc<Shared>) -> Result<Self, Self::Rejection> {
        let target = parts
            .extensions
            .get::<EnvdTarget>()
            .cloned()
            .ok_or_else(|| Fault::new(Code::Internal, "envd request without a target"))?;
        if target.port != ENVD_PORT {
            return Err(Fault::new(
                Code::Unavailable,
                format!(
                    "port {} of sandbox {} is not open to the E2B adapter (only envd, port {ENVD_PORT}); use \
                     hearth's exposed ports instead",
                    target.port, target.sandbox_id
                ),
            ));
        }
        let key = crate::auth::envd_key(&parts.headers).ok_or_else(|| {
            Fault::new(
                Code::Unauthenticated,
                "missing access token: send your hearth API key as X-Access-Token",
            )
        })?;
        let api = st
            .client(key)
            .map_err(|_| Fault::new(Code::Unauthenticated, "the access token must be printable ASCII"))?;
        Ok(Envd {
            sandbox: target.sandbox_id,
            key: key.to_owned(),
            api,
            user: crate::auth::envd_user(&parts.headers),
            shared: st.clone(),
        })
    }
}

impl IntoResponse for Fault {
    fn into_response(self) -> Response {
        self.unary_response()
    }
}

/// The message of E2B's proxy for a sandbox that is not there (the SDKs look for "was not found").
pub fn sandbox_gone(id: &str) -> Fault {
    Fault::new(Code::Unavailable, format!("The sandbox {id} was not found"))
}

/// The Connect code for a hearth error code.
pub fn code_for(code: ErrorCode, status: u16) -> Code {
    match code {
        ErrorCode::NotFound => Code::NotFound,
        ErrorCode::Unauthorized => Code::Unauthenticated,
        ErrorCode::InvalidJson | ErrorCode::InvalidArgument | ErrorCode::PayloadTooLarge => {
            Code::InvalidArgument
        }
        ErrorCode::Conflict => Code::FailedPrecondition,
        ErrorCode::CapacityExceeded | ErrorCode::VmmFailed | ErrorCode::AgentUnavailable => Code::Unavailable,
        ErrorCode::GuestError | ErrorCode::SnapshotCorrupt | ErrorCode::Internal => Code::Internal,
        _ if status == 429 => Code::ResourceExhausted,
        _ => Code::Unknown,
    }
}

impl Envd {
    /// Turns a daemon error into a fault. A `not_found` may mean the sandbox itself is gone, which E2B reports
    /// as its proxy does (unavailable, "was not found"), not as a missing file: the sandbox is checked.
    pub async fn fault(&self, e: hearth_client::Error) -> Fault {
        match &e {
            hearth_client::Error::Api {
                status,
                code,
                message,
            } => {
                if *code == ErrorCode::NotFound && !self.sandbox_exists().await {
                    return sandbox_gone(&self.sandbox);
                }
                Fault::new(code_for(*code, *status), message.clone())
            }
            hearth_client::Error::Transport { .. } => Fault::new(Code::Unavailable, e.to_string()),
            other => Fault::new(Code::Internal, other.to_string()),
        }
    }

    async fn sandbox_exists(&self) -> bool {
        match self.api.get_sandbox(&self.sandbox).await {
            Ok(s) => s.state != SandboxState::Failed,
            Err(e) => e.code() != Some(ErrorCode::NotFound),
        }
    }

    /// Checks the caller may use the sandbox (for state kept by the adapter rather than the daemon).
    pub async fn authorize(&self) -> Result<hearth_api::Sandbox, Fault> {
        match self.api.get_sandbox(&self.sandbox).await {
            Ok(s) if s.state == SandboxState::Failed => Err(sandbox_gone(&self.sandbox)),
            Ok(s) => Ok(s),
            Err(e) if e.code() == Some(ErrorCode::NotFound) => Err(sandbox_gone(&self.sandbox)),
            Err(e) => Err(self.fault(e).await),
        }
    }

    /// An absolute, normalised guest path for `path` (relative paths and `~` are under the home directory).
    pub fn resolve(&self, path: &str) -> Result<String, Fault> {
        resolve(path)
    }
}

/// An absolute, normalised path: relative paths and `~` resolve under [`crate::auth::HOME`], `.` and `..`
/// are folded (`..` never climbs above `/`), empty components dropped.
pub fn resolve(path: &str) -> Result<String, Fault> {
    if path.contains('\0') {
        return Err(Fault::invalid("path contains NUL"));
    }
    if path.len() > 4096 {
        return Err(Fault::invalid("path is longer than 4096 bytes"));
    }
    let full = if path.is_empty() || path == "~" {
        crate::auth::HOME.to_owned()
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{}/{rest}", crate::auth::HOME)
    } else if path.starts_with('/') {
        path.to_owned()
    } else {
        format!("{}/{path}", crate::auth::HOME)
    };
    let mut parts: Vec<&str> = Vec::new();
    for part in full.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    Ok(format!("/{}", parts.join("/")))
}

/// An error of the plain HTTP routes (`/files`, `/health`) in envd's shape: `{"code": <status>, "message"}`.
/// A missing sandbox is E2B's proxy answer: 502 with "was not found".
pub fn http_error(f: &Fault) -> Response {
    let status = match f.code {
        Code::InvalidArgument | Code::FailedPrecondition => 400,
        Code::Unauthenticated => 401,
        Code::PermissionDenied => 403,
        Code::NotFound => 404,
        Code::AlreadyExists => 409,
        Code::ResourceExhausted => 429,
        Code::Unavailable => 502,
        Code::DeadlineExceeded => 504,
        Code::Unimplemented => 501,
        _ => 500,
    };
    let body = serde_json::json!({ "code": status, "message": f.message });
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body.to_string(),
    )
        .into_response()
}

/// `GET /health`: 204 while the sandbox runs; 502 "was not found" when it is gone or paused (what E2B's
/// proxy answers, and what `isRunning()` reads as not running). Never resumes a paused sandbox.
async fn health(_: State<Arc<Shared>>, envd: Result<Envd, Fault>) -> Response {
    let envd = match envd {
        Ok(e) => e,
        Err(f) => return http_error(&f),
    };
    match envd.authorize().await {
        Ok(s) if matches!(s.state, SandboxState::Paused | SandboxState::Pausing) => http_error(&Fault::new(
            Code::Unavailable,
            format!("The sandbox {} was not found: it is paused", envd.sandbox),
        )),
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(f) => http_error(&f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_resolve_like_envd() {
        let r = |p: &str| resolve(p).unwrap_or_default();
        assert_eq!(r("notes.txt"), "/root/notes.txt");
        assert_eq!(r(""), "/root");
        assert_eq!(r("~/a/./b/../c"), "/root/a/c");
        assert_eq!(r("/tmp//x/"), "/tmp/x");
        assert_eq!(r("/../../etc"), "/etc");
        assert_eq!(r("/"), "/");
        assert!(resolve("a\0b").is_err());
        assert!(resolve(&"a".repeat(5000)).is_err());
    }

    #[test]
    fn hearth_codes_map_to_connect_codes() {
        assert_eq!(code_for(ErrorCode::NotFound, 404), Code::NotFound);
        assert_eq!(code_for(ErrorCode::Unauthorized, 401), Code::Unauthenticated);
        assert_eq!(code_for(ErrorCode::AgentUnavailable, 502), Code::Unavailable);
        assert_eq!(code_for(ErrorCode::Unknown, 429), Code::ResourceExhausted);
        assert_eq!(code_for(ErrorCode::Conflict, 409), Code::FailedPrecondition);
    }
}
