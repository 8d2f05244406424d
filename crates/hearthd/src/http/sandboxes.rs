//! `/v1/sandboxes`: create, list, get, destroy, TTL.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use hearth_api::{CreateSandboxRequest, ErrorBody, Sandbox, SandboxList, SetTimeoutRequest};

use super::AppState;
use super::error::{ApiError, ApiJson, ApiQuery, SandboxId};

/// Create a sandbox; answers once a command can run in it.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    responses(
        (status = 201, description = "The sandbox runs", body = Sandbox),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "Unknown template", body = ErrorBody),
        (status = 502, description = "The VM could not be started or its agent did not answer", body = ErrorBody),
        (status = 503, description = "Not enough memory left on the host", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> Result<(StatusCode, Json<Sandbox>), ApiError> {
    Ok((StatusCode::CREATED, Json(st.sandboxes.create(req).await?)))
}

/// List sandboxes. Filters: `state=<state>` and `metadata.<key>=<value>` (all must match).
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    params(
        ("state" = Option<String>, Query, description = "Only sandboxes in this state"),
        ("metadata.{key}" = Option<String>, Query, description = "Only sandboxes whose metadata key has this value"),
    ),
    responses(
        (status = 200, body = SandboxList),
        (status = 400, description = "Unknown filter or state", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn list(
    State(st): State<AppState>,
    ApiQuery(filters): ApiQuery<Vec<(String, String)>>,
) -> Result<Json<SandboxList>, ApiError> {
    Ok(Json(SandboxList {
        sandboxes: st.sandboxes.list(&filters)?,
    }))
}

/// One sandbox.
#[utoipa::path(get, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = Sandbox), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn get(State(st): State<AppState>, SandboxId(id): SandboxId) -> Result<Json<Sandbox>, ApiError> {
    Ok(Json(st.sandboxes.get(&id)?))
}

/// Destroy a sandbox: its VM is stopped and its files removed.
#[utoipa::path(delete, path = "/v1/sandboxes/{id}", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 204, description = "Destroyed"),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Still being created", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn destroy(State(st): State<AppState>, SandboxId(id): SandboxId) -> Result<StatusCode, ApiError> {
    st.sandboxes.destroy(&id, "api").await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Reset the sandbox's TTL to `timeout_s` seconds from now.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/timeout", tag = "sandboxes", request_body = SetTimeoutRequest,
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = Sandbox), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn set_timeout(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiJson(req): ApiJson<SetTimeoutRequest>,
) -> Result<Json<Sandbox>, ApiError> {
    Ok(Json(st.sandboxes.set_timeout(&id, req.timeout_s)?))
}
