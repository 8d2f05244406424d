//! `/v1/sandboxes/{id}/files`: content (streamed both ways) and metadata.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use hearth_api::{ErrorBody, ErrorCode, FileInfo, FileKind, FileList, MkdirRequest, RenameRequest};
use serde::Deserialize;

use super::AppState;
use super::error::{ApiError, ApiJson, ApiQuery, SandboxId};

/// Largest file accepted by `PUT .../files`.
pub const MAX_UPLOAD: u64 = 1024 * 1024 * 1024;

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct PathQuery {
    /// Absolute path in the guest.
    pub path: String,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct RemoveQuery {
    /// Absolute path in the guest.
    pub path: String,
    /// Remove a directory and everything in it.
    #[serde(default)]
    pub recursive: bool,
}

/// Download a file's content (raw bytes).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses(
        (status = 200, description = "The file's content", content_type = "application/octet-stream",
            body = Vec<u8>),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn read(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Response, ApiError> {
    let (info, reader) = st.sandboxes.read_file(&id, &q.path).await?;
    let mut resp = Body::from_stream(reader).into_response();
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    // Pseudo-files (e.g. under /proc) report size 0 and still have content: only a real size is announced.
    if info.kind == FileKind::File && info.size > 0 {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(info.size));
    }
    Ok(resp)
}

/// Upload a file: the raw request body becomes the file's content (created or truncated; the parent directory
/// must exist). Streams; at most 1 GiB.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", tag = "files",
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses(
        (status = 200, description = "Written", body = FileInfo),
        (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 413, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn write(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<PathQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<FileInfo>, ApiError> {
    let too_large = || {
        ApiError::new(
            ErrorCode::PayloadTooLarge,
            format!("file larger than {MAX_UPLOAD} bytes"),
        )
    };
    let announced = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if announced.is_some_and(|n| n > MAX_UPLOAD) {
        return Err(too_large());
    }
    let over = Arc::new(AtomicBool::new(false));
    let flag = over.clone();
    let mut seen = 0u64;
    let capped = body.into_data_stream().map(move |chunk| {
        let chunk = chunk.map_err(|e| e.to_string())?;
        seen += chunk.len() as u64;
        if seen > MAX_UPLOAD {
            flag.store(true, Ordering::SeqCst);
            return Err(format!("more than {MAX_UPLOAD} bytes"));
        }
        Ok(chunk)
    });
    match st.sandboxes.write_file(&id, &q.path, capped).await {
        Ok(info) => Ok(Json(info)),
        Err(_) if over.load(Ordering::SeqCst) => Err(too_large()),
        Err(e) => Err(e.into()),
    }
}

/// Remove a file, symlink or directory (`recursive=true` for a non-empty one).
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/files", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), RemoveQuery),
    responses((status = 204, description = "Removed"), (status = 404, body = ErrorBody),
        (status = 409, description = "Directory not empty", body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn remove(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<RemoveQuery>,
) -> Result<StatusCode, ApiError> {
    st.sandboxes.remove(&id, &q.path, q.recursive).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Metadata of one path (a final symlink is not followed).
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/stat", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses((status = 200, body = FileInfo), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn stat(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Json<FileInfo>, ApiError> {
    Ok(Json(st.sandboxes.stat(&id, &q.path).await?))
}

/// Entries of a directory, sorted by name.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files/list", tag = "files",
    params(("id" = String, Path, description = "Sandbox id"), PathQuery),
    responses((status = 200, body = FileList), (status = 404, body = ErrorBody),
        (status = 409, description = "Not a directory", body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn list(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiQuery(q): ApiQuery<PathQuery>,
) -> Result<Json<FileList>, ApiError> {
    Ok(Json(FileList {
        entries: st.sandboxes.list_dir(&id, &q.path).await?,
    }))
}

/// Create a directory (with its parents unless `parents: false`).
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/mkdir", tag = "files", request_body = MkdirRequest,
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 204, description = "Created"), (status = 409, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn mkdir(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiJson(req): ApiJson<MkdirRequest>,
) -> Result<StatusCode, ApiError> {
    st.sandboxes.mkdir(&id, &req.path, req.parents).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Rename (move) a path.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/files/rename", tag = "files", request_body = RenameRequest,
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 204, description = "Renamed"), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn rename(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiJson(req): ApiJson<RenameRequest>,
) -> Result<StatusCode, ApiError> {
    st.sandboxes.rename(&id, &req.from, &req.to).await?;
    Ok(StatusCode::NO_CONTENT)
}
