//! `/v1/sandboxes`: create, list, get, destroy, TTL, pause, resume, usage; fork and snapshots.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use hearth_api::{
    CreateSandboxRequest, DiskSync, ErrorBody, ForkRequest, ForkResponse, Sandbox, SandboxBoundary,
    SandboxList, SandboxStartEvent, SandboxUsage, SetTimeoutRequest, SnapshotList, SnapshotObject,
    UsageReport,
};

use super::AppState;
use super::commands::wants_event_stream;
use super::error::{ApiError, ApiJson, ApiQuery, SandboxId};
use super::progress;
use crate::tenancy::Principal;

/// Create a sandbox; answers once a command can run in it.
///
/// With `Accept: text/event-stream` the answer is a stream of `SandboxStartEvent`s: `fetch` progress while a
/// snapshot, saved template or synced disk it starts from comes back from the storage bucket, then `done` with
/// the sandbox or `failed` with the error. A request that fails before anything was fetched gets the JSON error
/// answer below instead. The create goes on if the caller goes away.
#[utoipa::path(post, path = "/v1/sandboxes", tag = "sandboxes", request_body = CreateSandboxRequest,
    responses(
        (status = 201, description = "The sandbox runs", body = Sandbox),
        (status = 200, description = "Progress events (`Accept: text/event-stream`; SSE: `event:` is the \
            variant name, `data:` the JSON), ending with `done` or `failed`",
            content((SandboxStartEvent = "text/event-stream"))),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 404, description = "Unknown template, or `from_sync` names a sandbox without a synced disk \
            (`no_disk_sync`)", body = ErrorBody),
        (status = 409, description = "`disk_sync_interval_s` or `from_sync` without a storage bucket \
            (`storage_not_configured`)", body = ErrorBody),
        (status = 502, description = "The VM could not be started or its agent did not answer", body = ErrorBody),
        (status = 503, description = "Not enough memory left on the host", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(st): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateSandboxRequest>,
) -> Result<Response, ApiError> {
    let svc = st.sandboxes.clone();
    if wants_event_stream(&headers) {
        let objects = svc.create_fetch_objects(&req);
        let op = tokio::spawn({
            let svc = svc.clone();
            async move { svc.create(req).await }
        });
        return Ok(progress::start_events(svc, objects, op).await);
    }
    Ok((StatusCode::CREATED, Json(svc.create(req).await?)).into_response())
}

/// List sandboxes, a page at a time in id order. Filters: `state=<state>` and `metadata.<key>=<value>` (all
/// must match); `limit` (1-1000, default 1000) and `cursor` (the `next_cursor` of the previous page).
#[utoipa::path(get, path = "/v1/sandboxes", tag = "sandboxes",
    params(
        ("state" = Option<String>, Query, description = "Only sandboxes in this state"),
        ("metadata.{key}" = Option<String>, Query, description = "Only sandboxes whose metadata key has this value"),
        ("limit" = Option<u32>, Query, description = "Most sandboxes in this page (1-1000, default 1000)"),
        ("cursor" = Option<String>, Query, description = "`next_cursor` of the previous page"),
    ),
    responses(
        (status = 200, body = SandboxList),
        (status = 400, description = "Unknown filter or state", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn list(
    State(st): State<AppState>,
    principal: Option<Extension<Principal>>,
    ApiQuery(filters): ApiQuery<Vec<(String, String)>>,
) -> Result<Json<SandboxList>, ApiError> {
    // Admins see every project's sandboxes; other keys their own project's.
    let project = principal
        .as_ref()
        .filter(|p| !p.is_admin())
        .map(|p| p.project.as_str());
    let (sandboxes, next_cursor) = st.sandboxes.list(&filters, project)?;
    Ok(Json(SandboxList {
        sandboxes,
        next_cursor,
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

/// Pause a running sandbox to zero: memory and device state are saved to disk and the VM process ends.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/pause", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 200, description = "Paused (also when it already was)", body = Sandbox),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Not running", body = ErrorBody),
        (status = 502, description = "The capture failed; the sandbox keeps running if its VM still does", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn pause(State(st): State<AppState>, SandboxId(id): SandboxId) -> Result<Json<Sandbox>, ApiError> {
    Ok(Json(st.sandboxes.pause(&id).await?))
}

/// Sync the running sandbox's disk to the storage bucket: the guest flushes its file systems, its vCPUs stop
/// only while the disk file is copied, and the copy is uploaded in the background (only changed chunks).
/// `POST /v1/sandboxes {"from_sync": ID}` creates a new sandbox from the last synced disk.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/sync", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 200, description = "Captured; `upload` says whether the bucket has it yet", body = DiskSync),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Not running (a paused sandbox's pause holds its disk), or no storage \
            bucket is configured (`storage_not_configured`)", body = ErrorBody),
        (status = 502, description = "The capture failed; the sandbox keeps running", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn sync(State(st): State<AppState>, SandboxId(id): SandboxId) -> Result<Json<DiskSync>, ApiError> {
    Ok(Json(st.sandboxes.sync_disk(&id).await?))
}

/// Resume a paused sandbox into a fresh VM process (processes, memory and files as they were; clock corrected).
///
/// With `Accept: text/event-stream` the answer is a stream of `SandboxStartEvent`s: `fetch` progress while its
/// paused state (or what its disk builds on) comes back from the storage bucket, then `done` or `failed`. A
/// request that fails before anything was fetched gets the JSON error answer below instead.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/resume", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 200, description = "Running (also when it already was); with `Accept: text/event-stream` \
            progress events ending with `done` or `failed`", body = Sandbox,
            content((Sandbox = "application/json"), (SandboxStartEvent = "text/event-stream"))),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Not paused, or its snapshot was written by another VMM", body = ErrorBody),
        (status = 422, description = "The paused state does not match its manifest (snapshot_corrupt)", body = ErrorBody),
        (status = 502, description = "The restore failed; the sandbox stays paused", body = ErrorBody),
        (status = 503, description = "Not enough memory left on the host", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn resume(
    State(st): State<AppState>,
    headers: HeaderMap,
    SandboxId(id): SandboxId,
) -> Result<Response, ApiError> {
    let svc = st.sandboxes.clone();
    if wants_event_stream(&headers) {
        let objects = svc.resume_fetch_objects(&id);
        let op = tokio::spawn({
            let svc = svc.clone();
            async move { svc.resume(&id).await }
        });
        return Ok(progress::start_events(svc, objects, op).await);
    }
    Ok(Json(svc.resume(&id).await?).into_response())
}

/// Usage of one sandbox since its creation.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/usage", tag = "usage",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = SandboxUsage), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn usage(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<SandboxUsage>, ApiError> {
    Ok(Json(st.sandboxes.sandbox_usage(&id)?))
}

/// Window of `GET /v1/usage`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UsageWindow {
    from: Option<String>,
    to: Option<String>,
}

/// Usage of every sandbox (destroyed ones included) within a window; default: the last 24 hours.
#[utoipa::path(get, path = "/v1/usage", tag = "usage",
    params(
        ("from" = Option<String>, Query, description = "Start: RFC 3339 or unix seconds (default: `to` minus 24 h)"),
        ("to" = Option<String>, Query, description = "End: RFC 3339 or unix seconds (default: now)"),
    ),
    responses((status = 200, body = UsageReport), (status = 400, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn usage_report(
    State(st): State<AppState>,
    ApiQuery(w): ApiQuery<UsageWindow>,
) -> Result<Json<UsageReport>, ApiError> {
    Ok(Json(st.sandboxes.usage(w.from.as_deref(), w.to.as_deref())?))
}

/// Fork a running sandbox into `count` children (1-16) that continue its processes, memory and files; the
/// parent keeps running. Each child gets its own disk, hostname, machine-id and fresh entropy.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/fork", tag = "snapshots", request_body = ForkRequest,
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 201, description = "The children run", body = ForkResponse),
        (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Not running", body = ErrorBody),
        (status = 502, body = ErrorBody),
        (status = 503, description = "Not enough memory left on the host", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn fork(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiJson(req): ApiJson<ForkRequest>,
) -> Result<(StatusCode, Json<ForkResponse>), ApiError> {
    let count = req.count.unwrap_or(1);
    Ok((StatusCode::CREATED, Json(st.sandboxes.fork(&id, count).await?)))
}

/// Checkpoint a running sandbox into a snapshot object; the sandbox is stopped only while it is captured.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/snapshots", tag = "snapshots",
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 201, body = SnapshotObject),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Not running", body = ErrorBody),
        (status = 502, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn snapshot(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<(StatusCode, Json<SnapshotObject>), ApiError> {
    Ok((StatusCode::CREATED, Json(st.sandboxes.checkpoint(&id).await?)))
}

/// List snapshots.
#[utoipa::path(get, path = "/v1/snapshots", tag = "snapshots",
    responses((status = 200, body = SnapshotList)),
    security(("api_key" = [])))]
pub async fn list_snapshots(State(st): State<AppState>) -> Result<Json<SnapshotList>, ApiError> {
    Ok(Json(SnapshotList {
        snapshots: st.sandboxes.list_snapshots()?,
    }))
}

/// Delete a snapshot. Refused (409) while a sandbox created from it exists: its disk is layered on the
/// snapshot's disk copy.
#[utoipa::path(delete, path = "/v1/snapshots/{id}", tag = "snapshots",
    params(("id" = String, Path, description = "Snapshot id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Sandboxes use it", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn delete_snapshot(
    State(st): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<StatusCode, ApiError> {
    st.sandboxes.delete_snapshot(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The sandbox's isolation as the host reports it now: the VMM process (uid, chroot, seccomp, capabilities,
/// namespaces, cgroup limits), the guest kernel, the enforced egress policy and the mounts (`hearth inspect`).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/boundary", tag = "sandboxes",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = SandboxBoundary), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn boundary(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<SandboxBoundary>, ApiError> {
    Ok(Json(st.sandboxes.boundary(&id).await?))
}
