//! Buckets as named credentials, and mounts of them in sandboxes.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use hearth_api::{
    AttachMountRequest, Bucket, BucketList, CreateBucketRequest, ErrorBody, Mount, MountList, MountPathQuery,
};

use super::AppState;
use super::error::{ApiError, ApiQuery, SandboxId, SecretJson};

/// Register a bucket (S3, MinIO, R2) under a name. It is probed (one listing of its prefix) before it is
/// accepted; the secret is stored encrypted on the host and never returned.
#[utoipa::path(post, path = "/v1/buckets", tag = "buckets", request_body = CreateBucketRequest,
    responses(
        (status = 201, body = Bucket),
        (status = 400, description = "Invalid name, url, endpoint, region or key format", body = ErrorBody),
        (status = 409, description = "The name is taken", body = ErrorBody),
        (status = 422, description = "The probe failed: `bucket_not_found`, `bucket_access_denied` or `bucket_unreachable`", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(st): State<AppState>,
    SecretJson(req): SecretJson<CreateBucketRequest>,
) -> Result<(StatusCode, Json<Bucket>), ApiError> {
    Ok((StatusCode::CREATED, Json(st.sandboxes.create_bucket(req).await?)))
}

/// Registered buckets (never their secrets).
#[utoipa::path(get, path = "/v1/buckets", tag = "buckets",
    responses((status = 200, body = BucketList)),
    security(("api_key" = [])))]
pub async fn list(State(st): State<AppState>) -> Result<Json<BucketList>, ApiError> {
    Ok(Json(st.sandboxes.list_buckets()?))
}

/// One registered bucket and the sandboxes that mount it.
#[utoipa::path(get, path = "/v1/buckets/{name}", tag = "buckets",
    params(("name" = String, Path, description = "Bucket name")),
    responses((status = 200, body = Bucket), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn get(State(st): State<AppState>, Path(name): Path<String>) -> Result<Json<Bucket>, ApiError> {
    Ok(Json(st.sandboxes.get_bucket(&name)?))
}

/// Forget a bucket; refused while a sandbox mounts it (or a snapshot would mount it again).
#[utoipa::path(delete, path = "/v1/buckets/{name}", tag = "buckets",
    params(("name" = String, Path, description = "Bucket name")),
    responses(
        (status = 204),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Still mounted", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn delete(
    State(st): State<AppState>,
    Path(name): Path<String>,
) -> Result<impl IntoResponse, ApiError> {
    st.sandboxes.delete_bucket(&name)?;
    Ok(StatusCode::NO_CONTENT)
}

/// The buckets mounted in a sandbox, with the bytes moved through each.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/mounts", tag = "buckets",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = MountList), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn mounts(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<MountList>, ApiError> {
    Ok(Json(st.sandboxes.list_mounts(&id)?))
}

/// Mount a registered bucket at `path` in a running sandbox (a paused one is resumed first).
#[utoipa::path(put, path = "/v1/sandboxes/{id}/mounts", tag = "buckets", request_body = AttachMountRequest,
    params(("id" = String, Path, description = "Sandbox id"), MountPathQuery),
    responses(
        (status = 200, body = Mount),
        (status = 400, description = "Bad path or prefix; `network_required` when networking is off", body = ErrorBody),
        (status = 404, description = "No such sandbox or bucket", body = ErrorBody),
        (status = 409, description = "Path taken, not running, or `agent_too_old`", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn attach(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<MountPathQuery>,
    super::error::ApiJson(req): super::error::ApiJson<AttachMountRequest>,
) -> Result<Json<Mount>, ApiError> {
    Ok(Json(st.sandboxes.attach_mount(&id, &q.path, req).await?))
}

/// Unmount `path` in a sandbox (written data reaches the bucket first).
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/mounts", tag = "buckets",
    params(("id" = String, Path, description = "Sandbox id"), MountPathQuery),
    responses((status = 204), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn detach(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<MountPathQuery>,
) -> Result<impl IntoResponse, ApiError> {
    st.sandboxes.detach_mount(&id, &q.path).await?;
    Ok(StatusCode::NO_CONTENT)
}
