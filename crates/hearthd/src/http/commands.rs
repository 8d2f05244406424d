//! `/v1/sandboxes/{id}/commands` and `/v1/sandboxes/{id}/processes`.

use std::time::Duration;

use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hearth_api::{
    BackgroundStarted, CommandEvent, CommandResult, ErrorBody, ErrorCode, KillProcessRequest, ProcessList,
    RunCommandRequest,
};
use serde::Deserialize;

use super::AppState;
use super::error::{ApiError, ApiJson, ApiQuery, OptionalJson, ProcessPath, RawBody, SandboxId};
use super::sse;

pub(super) fn wants_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.split(',').any(|t| t.trim().starts_with("text/event-stream")))
}

/// Run a command. Buffered by default; `Accept: text/event-stream` streams [`CommandEvent`]s as they happen;
/// `background: true` starts it and returns its pid at once.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/commands", tag = "commands", request_body = RunCommandRequest,
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 200, description = "The command ended (buffered), or its event stream (SSE: `event:` is the \
            variant name, `data:` the JSON)",
            content((CommandResult = "application/json"), (CommandEvent = "text/event-stream"))),
        (status = 202, description = "Background command started", body = BackgroundStarted),
        (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The sandbox is not running", body = ErrorBody),
        (status = 502, description = "The agent is unreachable", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn run(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    headers: HeaderMap,
    ApiJson(req): ApiJson<RunCommandRequest>,
) -> Result<Response, ApiError> {
    if req.background {
        let pid = st.sandboxes.start_background(&id, &req).await?;
        return Ok((StatusCode::ACCEPTED, Json(BackgroundStarted { pid })).into_response());
    }
    if wants_event_stream(&headers) {
        let cmd = st.sandboxes.start_command(&id, &req).await?;
        return Ok(sse::command_events(st.sandboxes.clone(), id, cmd).into_response());
    }
    Ok(Json(st.sandboxes.run_command(&id, &req).await?).into_response())
}

/// The guest agent's process table.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/processes", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = ProcessList), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn processes(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<ProcessList>, ApiError> {
    Ok(Json(ProcessList {
        processes: st.sandboxes.processes(&id).await?,
    }))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct WaitQuery {
    /// Give up after this many seconds (409 conflict if the process still runs). Default: wait until it exits.
    pub timeout_s: Option<u64>,
}

/// Wait for a process to exit; returns its status and the tails of its output.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/wait", tag = "commands",
    params(("id" = String, Path, description = "Sandbox id"), ("pid" = u32, Path, description = "Process id"),
        WaitQuery),
    responses(
        (status = 200, body = CommandResult),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Still running after timeout_s", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn wait(
    State(st): State<AppState>,
    p: ProcessPath,
    ApiQuery(q): ApiQuery<WaitQuery>,
) -> Result<Json<CommandResult>, ApiError> {
    if q.timeout_s.is_some_and(|t| t > 86_400) {
        return Err(ApiError::new(
            ErrorCode::InvalidArgument,
            "timeout_s must be at most 86400",
        ));
    }
    let timeout = q.timeout_s.map(Duration::from_secs);
    Ok(Json(st.sandboxes.wait_process(&p.id, p.pid, timeout).await?))
}

/// Send a signal to a process (and its process group). Default SIGKILL; the body may be omitted.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/kill", tag = "commands",
    request_body = KillProcessRequest,
    params(("id" = String, Path, description = "Sandbox id"), ("pid" = u32, Path, description = "Process id")),
    responses((status = 204, description = "Signal sent"), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn kill(
    State(st): State<AppState>,
    p: ProcessPath,
    OptionalJson(req): OptionalJson<KillProcessRequest>,
) -> Result<StatusCode, ApiError> {
    st.sandboxes.kill_process(&p.id, p.pid, req.signal).await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct StdinQuery {
    /// Close the process' stdin after writing the body.
    #[serde(default)]
    pub eof: bool,
}

/// Write the raw request body to a background process' stdin.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/processes/{pid}/stdin", tag = "commands",
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    params(("id" = String, Path, description = "Sandbox id"), ("pid" = u32, Path, description = "Process id"),
        StdinQuery),
    responses(
        (status = 204, description = "Written"),
        (status = 404, body = ErrorBody),
        (status = 409, description = "The process' stdin is closed", body = ErrorBody),
        (status = 413, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn stdin(
    State(st): State<AppState>,
    p: ProcessPath,
    ApiQuery(q): ApiQuery<StdinQuery>,
    RawBody(data): RawBody,
) -> Result<StatusCode, ApiError> {
    st.sandboxes.process_stdin(&p.id, p.pid, data, q.eof).await?;
    Ok(StatusCode::NO_CONTENT)
}
