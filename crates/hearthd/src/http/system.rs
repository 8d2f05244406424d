//! Open routes (`/healthz`, `/metrics`, `/openapi.json`) and `GET /v1/system`.

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use hearth_api::{SandboxState, SystemInfo};

use super::AppState;
use super::error::ApiError;
use crate::metrics;

/// Liveness: answers `ok` while the daemon serves requests.
#[utoipa::path(get, path = "/healthz", tag = "system",
    responses((status = 200, description = "The daemon is up", body = String, content_type = "text/plain")))]
pub async fn healthz() -> &'static str {
    "ok"
}

/// Which VMM is in use and why, host capacity, templates.
#[utoipa::path(get, path = "/v1/system", tag = "system",
    responses((status = 200, body = SystemInfo)), security(("api_key" = [])))]
pub async fn system(State(st): State<AppState>) -> Result<Json<SystemInfo>, ApiError> {
    Ok(Json(st.sandboxes.system()?))
}

/// Prometheus metrics (text exposition format).
#[utoipa::path(get, path = "/metrics", tag = "system",
    responses((status = 200, description = "Prometheus text format", body = String, content_type = "text/plain")))]
pub async fn metrics(State(st): State<AppState>) -> Response {
    if let Ok(rows) = st.sandboxes.db().list() {
        let states = [
            SandboxState::Creating,
            SandboxState::Running,
            SandboxState::Stopping,
            SandboxState::Failed,
            SandboxState::Pausing,
            SandboxState::Paused,
            SandboxState::Resuming,
        ];
        let counts: Vec<_> = states
            .iter()
            .map(|s| (*s, rows.iter().filter(|r| r.state == *s).count()))
            .collect();
        metrics::set_sandbox_counts(&counts);
    }
    let text = st.metrics.as_ref().map(|h| h.render()).unwrap_or_default();
    let mut resp = text.into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    resp
}

/// This API's OpenAPI 3.1 document.
#[utoipa::path(get, path = "/openapi.json", tag = "system",
    responses((status = 200, description = "OpenAPI document", body = Object)))]
pub async fn openapi() -> Response {
    let mut resp = crate::openapi::document_json().into_response();
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    resp
}
