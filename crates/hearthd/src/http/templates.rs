//! `/v1/templates`: save a sandbox as a template, list, get, delete.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use hearth_api::{CreateTemplateRequest, ErrorBody, Template, TemplateList};

use super::AppState;
use super::error::{ApiError, ApiJson};

/// Save a sandbox's root filesystem (flattened) as a template; with `include_memory` also its running state,
/// so that sandboxes of the template start by restore with its processes running. The sandbox continues.
#[utoipa::path(post, path = "/v1/templates", tag = "templates", request_body = CreateTemplateRequest,
    responses(
        (status = 201, body = Template),
        (status = 400, body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The name is taken, or the sandbox is not running", body = ErrorBody),
        (status = 502, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<CreateTemplateRequest>,
) -> Result<(StatusCode, Json<Template>), ApiError> {
    Ok((
        StatusCode::CREATED,
        Json(st.sandboxes.create_template(req).await?),
    ))
}

/// Built-in and saved templates.
#[utoipa::path(get, path = "/v1/templates", tag = "templates",
    responses((status = 200, body = TemplateList)),
    security(("api_key" = [])))]
pub async fn list(State(st): State<AppState>) -> Result<Json<TemplateList>, ApiError> {
    Ok(Json(TemplateList {
        templates: st.sandboxes.list_templates()?,
    }))
}

/// One template.
#[utoipa::path(get, path = "/v1/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "Template name")),
    responses((status = 200, body = Template), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn get(State(st): State<AppState>, Path(name): Path<String>) -> Result<Json<Template>, ApiError> {
    Ok(Json(st.sandboxes.get_template(&name)?))
}

/// Delete a saved template (refused for built-in ones and while sandboxes use it).
#[utoipa::path(delete, path = "/v1/templates/{name}", tag = "templates",
    params(("name" = String, Path, description = "Template name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Built in, or used by sandboxes", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn delete(State(st): State<AppState>, Path(name): Path<String>) -> Result<StatusCode, ApiError> {
    st.sandboxes.delete_template(&name)?;
    Ok(StatusCode::NO_CONTENT)
}
