//! Projects, API keys and the audit log. Keys and the audit log are for admin keys only (the middleware in
//! `tenancy::guard` refuses others with 403); `GET /v1/projects` shows a non-admin only its own project.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::{Extension, Json};
use hearth_api::{
    ApiKeyInfo, AuditPage, CreateKeyRequest, CreateProjectRequest, CreateTokenRequest, CreatedKey,
    CreatedToken, ErrorBody, ErrorCode, KeyList, Project, ProjectList, ProjectUsage, Quota, TokenScope,
};
use serde::Deserialize;

use super::AppState;
use super::error::{ApiError, ApiJson, ApiQuery};
use crate::db::tenancy::{AuditFilter, KeyRow, ProjectRow};
use crate::service::lifecycle::rfc3339;
use crate::service::now_ms;
use crate::tenancy::{BOOTSTRAP_KEY_ID, Principal, is_valid_project_name, new_key_id};

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorCode::Internal, e.to_string())
}

fn project(row: ProjectRow) -> Project {
    Project {
        name: row.name,
        created_at: rfc3339(row.created_at_ms),
        quota: row.quota,
    }
}

fn key_info(row: KeyRow) -> ApiKeyInfo {
    ApiKeyInfo {
        id: row.id,
        project: row.project,
        role: row.role,
        name: row.name,
        created_at: rfc3339(row.created_at_ms),
        expires_at: row.expires_at_ms.map(rfc3339),
        last_used_at: row.last_used_at_ms.map(rfc3339),
        revoked_at: row.revoked_at_ms.map(rfc3339),
    }
}

/// Create a project (admin).
#[utoipa::path(post, path = "/v1/projects", tag = "projects", request_body = CreateProjectRequest,
    responses(
        (status = 201, body = Project),
        (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 409, description = "A project of that name exists", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create_project(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<CreateProjectRequest>,
) -> Result<(StatusCode, Json<Project>), ApiError> {
    if !is_valid_project_name(&req.name) {
        return Err(ApiError::new(
            ErrorCode::InvalidArgument,
            "project name: 1-63 characters of [a-z0-9-], not starting with '-'",
        ));
    }
    let db = st.tenancy.db();
    if !db
        .create_project(&req.name, &req.quota, now_ms())
        .map_err(internal)?
    {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            "a project of that name exists",
        ));
    }
    let row = db
        .project(&req.name)
        .map_err(internal)?
        .ok_or_else(|| internal("project vanished"))?;
    Ok((StatusCode::CREATED, Json(project(row))))
}

/// List projects: all for an admin key, else the key's own.
#[utoipa::path(get, path = "/v1/projects", tag = "projects",
    responses((status = 200, body = ProjectList)),
    security(("api_key" = [])))]
pub async fn list_projects(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
) -> Result<Json<ProjectList>, ApiError> {
    let rows = st.tenancy.db().projects().map_err(internal)?;
    let projects = rows
        .into_iter()
        .filter(|r| p.is_admin() || r.name == p.project)
        .map(project)
        .collect();
    Ok(Json(ProjectList { projects }))
}

/// What a project holds against its quota (admins: any project; others: their own, else 404).
#[utoipa::path(get, path = "/v1/projects/{name}/usage", tag = "projects",
    params(("name" = String, Path, description = "Project name")),
    responses((status = 200, body = ProjectUsage), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn usage(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    Path(name): Path<String>,
) -> Result<Json<ProjectUsage>, ApiError> {
    let not_found = || ApiError::new(ErrorCode::NotFound, "no such project");
    if !p.is_admin() && p.project != name {
        return Err(not_found());
    }
    let db = st.tenancy.db();
    let row = db.project(&name).map_err(internal)?.ok_or_else(not_found)?;
    let held = db.held(&name).map_err(internal)?;
    let spent_credits = st.sandboxes.spent_credits(&name)?;
    let disk_bytes = st.sandboxes.project_disk_bytes_async(&name).await?;
    Ok(Json(ProjectUsage {
        project: row.name,
        quota: row.quota,
        running: held.running,
        vcpus: held.vcpus,
        memory_mib: held.memory_mib,
        spent_credits,
        disk_bytes,
    }))
}

/// Replace a project's quota (admin). Running sandboxes are not stopped (except by a spent budget or a passed
/// lifetime, as always); new ones are admitted under it.
#[utoipa::path(put, path = "/v1/projects/{name}/quota", tag = "projects", request_body = Quota,
    params(("name" = String, Path, description = "Project name")),
    responses((status = 200, body = Project), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn set_quota(
    State(st): State<AppState>,
    Path(name): Path<String>,
    ApiJson(quota): ApiJson<Quota>,
) -> Result<Json<Project>, ApiError> {
    let db = st.tenancy.db();
    if !db.set_quota(&name, &quota).map_err(internal)? {
        return Err(ApiError::new(ErrorCode::NotFound, "no such project"));
    }
    let row = db
        .project(&name)
        .map_err(internal)?
        .ok_or_else(|| internal("project vanished"))?;
    Ok(Json(project(row)))
}

/// Mint a short-lived access token for browsers and WebSocket clients (any non-viewer key, for its own
/// project; never more than the key may do). Present it like a key: `Authorization: Bearer <token>` or the
/// WebSocket subprotocol `hearth.key.<token>`, never in a URL. A token cannot mint tokens or keys.
#[utoipa::path(post, path = "/v1/tokens", tag = "projects", request_body = CreateTokenRequest,
    responses(
        (status = 201, body = CreatedToken),
        (status = 400, body = ErrorBody),
        (status = 403, description = "A viewer key, a token, or a role above the key's", body = ErrorBody),
        (status = 404, description = "No such sandbox in the key's project", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create_token(
    State(st): State<AppState>,
    Extension(p): Extension<Principal>,
    ApiJson(req): ApiJson<CreateTokenRequest>,
) -> Result<(StatusCode, Json<CreatedToken>), ApiError> {
    use crate::tenancy::token;
    let ttl = req.ttl_s.unwrap_or(token::DEFAULT_TTL_S);
    if !(1..=token::MAX_TTL_S).contains(&ttl) {
        return Err(ApiError::new(
            ErrorCode::InvalidArgument,
            format!("ttl_s must be between 1 and {}", token::MAX_TTL_S),
        ));
    }
    let role = req.role.unwrap_or(p.role);
    if role.rank() > p.role.rank() {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            format!(
                "a token's role is at most the minting key's ({})",
                p.role.as_str()
            ),
        ));
    }
    let sandbox = match req.scope {
        TokenScope::Project => None,
        TokenScope::Sandbox(id) => {
            let not_found = || ApiError::new(ErrorCode::NotFound, format!("no such sandbox {id:?}"));
            let exists =
                hearth_api::is_valid_sandbox_id(&id) && st.tenancy.db().get(&id).map_err(internal)?.is_some();
            let owned =
                crate::tenancy::objects::owns(&st.tenancy, &p, crate::tenancy::objects::Kind::Sandbox, &id)
                    .map_err(internal)?;
            if !exists || !owned {
                return Err(not_found());
            }
            Some(id)
        }
    };
    let expires_ms = now_ms().saturating_add((ttl * 1000) as i64);
    let claims = token::Claims {
        key_id: p.key_id,
        project: p.project,
        role,
        sandbox,
        purpose: req.purpose,
        expires_ms,
    };
    let token = st.tenancy.mint(&claims)?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedToken {
            token,
            expires_at: rfc3339(expires_ms),
        }),
    ))
}

/// Create an API key for a project (admin). The answer is the only time the key is shown.
#[utoipa::path(post, path = "/v1/keys", tag = "projects", request_body = CreateKeyRequest,
    responses(
        (status = 201, body = CreatedKey),
        (status = 400, body = ErrorBody),
        (status = 403, body = ErrorBody),
        (status = 404, description = "No such project", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create_key(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<CreateKeyRequest>,
) -> Result<(StatusCode, Json<CreatedKey>), ApiError> {
    let db = st.tenancy.db();
    if db.project(&req.project).map_err(internal)?.is_none() {
        return Err(ApiError::new(ErrorCode::NotFound, "no such project"));
    }
    if let Some(n) = &req.name
        && (n.is_empty() || n.chars().count() > 100 || n.chars().any(char::is_control))
    {
        return Err(ApiError::new(
            ErrorCode::InvalidArgument,
            "name: 1-100 printable characters",
        ));
    }
    let now = now_ms();
    let expires_at_ms = match req.expires_in_s {
        Some(s) if s == 0 || s > 10 * 365 * 86_400 => {
            return Err(ApiError::new(
                ErrorCode::InvalidArgument,
                "expires_in_s: 1 s to 10 years",
            ));
        }
        Some(s) => Some(now + (s as i64) * 1000),
        None => None,
    };
    let key = crate::auth::generate_key();
    let row = KeyRow {
        id: new_key_id(),
        project: req.project,
        role: req.role,
        name: req.name,
        created_at_ms: now,
        expires_at_ms,
        last_used_at_ms: None,
        revoked_at_ms: None,
    };
    db.insert_key(&row, &crate::auth::hash_key(&key))
        .map_err(internal)?;
    Ok((
        StatusCode::CREATED,
        Json(CreatedKey {
            id: row.id,
            key,
            project: row.project,
            role: row.role,
            expires_at: row.expires_at_ms.map(rfc3339),
        }),
    ))
}

/// List API keys (admin); never the keys themselves.
#[utoipa::path(get, path = "/v1/keys", tag = "projects",
    responses((status = 200, body = KeyList), (status = 403, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn list_keys(State(st): State<AppState>) -> Result<Json<KeyList>, ApiError> {
    let keys = st.tenancy.db().keys().map_err(internal)?;
    Ok(Json(KeyList {
        keys: keys.into_iter().map(key_info).collect(),
    }))
}

/// Revoke an API key (admin); effective for the next request. The bootstrap key is rotated by removing the
/// key file and restarting hearthd instead.
#[utoipa::path(delete, path = "/v1/keys/{id}", tag = "projects",
    params(("id" = String, Path, description = "Key id")),
    responses((status = 204), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, description = "The bootstrap key cannot be revoked here", body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn revoke_key(State(st): State<AppState>, Path(id): Path<String>) -> Result<StatusCode, ApiError> {
    if id == BOOTSTRAP_KEY_ID {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            "the bootstrap key is rotated by deleting the key file and restarting hearthd",
        ));
    }
    if !st.tenancy.db().revoke_key(&id, now_ms()).map_err(internal)? {
        return Err(ApiError::new(
            ErrorCode::NotFound,
            "no such key, or already revoked",
        ));
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Filters and paging of `GET /v1/audit`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Entries after this sequence number (default 0: from the start).
    pub after: Option<u64>,
    /// At most this many (1-1000, default 100).
    pub limit: Option<u32>,
    pub project: Option<String>,
    pub key_id: Option<String>,
    /// Only entries at or after this unix millisecond.
    pub since_ms: Option<i64>,
}

/// The audit log (admin): every state change and every refused authentication, as a hash chain.
#[utoipa::path(get, path = "/v1/audit", tag = "projects", params(AuditQuery),
    responses((status = 200, body = AuditPage), (status = 403, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn audit(
    State(st): State<AppState>,
    ApiQuery(q): ApiQuery<AuditQuery>,
) -> Result<Json<AuditPage>, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::new(ErrorCode::InvalidArgument, "limit: 1-1000"));
    }
    let filter = AuditFilter {
        after: q.after.unwrap_or(0),
        limit,
        project: q.project,
        key_id: q.key_id,
        since_ms: q.since_ms,
    };
    let entries = st.tenancy.db().audit_page(&filter).map_err(internal)?;
    let next_after = (entries.len() == limit as usize)
        .then(|| entries.last().map(|e| e.seq))
        .flatten();
    Ok(Json(AuditPage { entries, next_after }))
}

/// Filters of `GET /v1/audit/export`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct AuditExportQuery {
    /// Entries after this sequence number (default 0: from the start).
    pub after: Option<u64>,
    pub project: Option<String>,
    pub key_id: Option<String>,
    /// Only entries at or after this unix millisecond.
    pub since_ms: Option<i64>,
}

/// Entries read from the database per chunk of an export.
const EXPORT_PAGE: u32 = 1000;

/// The audit log as JSON Lines (admin): one entry per line in sequence order, streamed a page at a time, so a
/// log of any length exports in bounded memory (`hearth audit export`; `hearth audit verify --file` checks an
/// unfiltered export offline).
#[utoipa::path(get, path = "/v1/audit/export", tag = "projects", params(AuditExportQuery),
    responses(
        (status = 200, description = "One AuditEntry as JSON per line", content_type = "application/x-ndjson", body = String),
        (status = 403, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn audit_export(
    State(st): State<AppState>,
    ApiQuery(q): ApiQuery<AuditExportQuery>,
) -> axum::response::Response {
    let first = AuditFilter {
        after: q.after.unwrap_or(0),
        limit: EXPORT_PAGE,
        project: q.project,
        key_id: q.key_id,
        since_ms: q.since_ms,
    };
    let svc = st.sandboxes.clone();
    let pages = futures::stream::try_unfold(Some(first), move |next| {
        let svc = svc.clone();
        async move {
            let Some(mut filter) = next else {
                return Ok(None);
            };
            let entries = svc.db().audit_page(&filter).map_err(|e| {
                tracing::error!(error = %e, "exporting the audit log");
                std::io::Error::other(e.to_string())
            })?;
            let mut lines = Vec::with_capacity(entries.len() * 256);
            for e in &entries {
                serde_json::to_writer(&mut lines, e).map_err(std::io::Error::other)?;
                lines.push(b'\n');
            }
            let more = entries.len() == EXPORT_PAGE as usize;
            let next = match entries.last() {
                Some(last) if more => {
                    filter.after = last.seq;
                    Some(filter)
                }
                _ => None,
            };
            Ok::<_, std::io::Error>(Some((bytes::Bytes::from(lines), next)))
        }
    });
    (
        [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
        axum::body::Body::from_stream(pages),
    )
        .into_response()
}
