//! The storage bucket (`hearthd --storage`): `GET /v1/storage` (bucket, health, pending uploads, where each paused
//! sandbox, snapshot and template lives) and `POST /v1/storage/gc` (one garbage-collection pass now).

use axum::Json;
use axum::extract::{Query, State};
use hearth_api::{ErrorBody, StorageGcReport, StorageStatus};
use serde::Deserialize;

use super::AppState;
use super::error::ApiError;

/// The storage bucket, its health, pending uploads and the objects it holds.
#[utoipa::path(get, path = "/v1/storage", tag = "system",
    responses((status = 200, body = StorageStatus),
        (status = 409, description = "No storage bucket is configured", body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn status(State(st): State<AppState>) -> Result<Json<StorageStatus>, ApiError> {
    Ok(Json(st.sandboxes.storage_status()?))
}

/// Query of `POST /v1/storage/gc`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
pub struct GcQuery {
    /// Keep unreferenced chunks younger than this many seconds (default: `--storage-gc-grace-s`).
    pub grace_s: Option<u64>,
}

/// Runs one garbage-collection pass over the bucket: chunks no manifest references (and older than the grace
/// period) are deleted.
#[utoipa::path(post, path = "/v1/storage/gc", tag = "system", params(GcQuery),
    responses((status = 200, body = StorageGcReport),
        (status = 409, description = "No storage bucket is configured", body = ErrorBody),
        (status = 503, description = "`storage_unavailable`", body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn gc(
    State(st): State<AppState>,
    Query(q): Query<GcQuery>,
) -> Result<Json<StorageGcReport>, ApiError> {
    let grace = q.grace_s.map(std::time::Duration::from_secs);
    Ok(Json(st.sandboxes.storage_gc(grace).await?))
}
