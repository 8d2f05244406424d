//! `/v1/templates`: save a sandbox as a template or build one from a recipe (JSON answer, or progress events
//! over SSE), list, get, delete.

use std::convert::Infallible;

use axum::Json;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use hearth_api::{CreateTemplateRequest, ErrorBody, ErrorCode, Template, TemplateBuildEvent, TemplateList};
use tokio::sync::mpsc;

use super::AppState;
use super::commands::wants_event_stream;
use super::error::{ApiError, ApiJson};
use crate::service::templates::BuildProgress;

/// Progress events that may wait for a slow reader before the build itself waits.
const EVENT_BACKLOG: usize = 256;

/// Save a sandbox as a template, or build one from a recipe.
///
/// `from_sandbox` saves the sandbox's root filesystem (flattened); with `include_memory` also its running state,
/// so that sandboxes of the template start by restore with its processes running. The sandbox continues.
/// `recipe` runs its steps in a build sandbox and saves that. With `Accept: text/event-stream` the answer is a
/// stream of `TemplateBuildEvent`s: phases, each step's start, output lines and exit code with its duration, then
/// `done` with the template or `failed` with the error. A request that is wrong from the start still gets a JSON
/// error. The build goes on if the caller goes away.
#[utoipa::path(post, path = "/v1/templates", tag = "templates", request_body = CreateTemplateRequest,
    responses(
        (status = 201, description = "Saved or built (JSON answer)", body = Template),
        (status = 200, description = "Progress events (`Accept: text/event-stream`; SSE: `event:` is the \
            variant name, `data:` the JSON), ending with `done` or `failed`",
            content((TemplateBuildEvent = "text/event-stream"))),
        (status = 400, body = ErrorBody),
        (status = 404, description = "No such sandbox", body = ErrorBody),
        (status = 409, description = "The name is taken, or the sandbox is not running", body = ErrorBody),
        (status = 422, description = "A recipe step failed (the message carries its output)", body = ErrorBody),
        (status = 502, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(st): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CreateTemplateRequest>,
) -> Result<Response, ApiError> {
    st.sandboxes.check_template_request(&req)?;
    let svc = st.sandboxes.clone();
    if wants_event_stream(&headers) {
        let (progress, events) = BuildProgress::channel(EVENT_BACKLOG);
        tokio::spawn(async move {
            let _ = svc.create_template_reporting(req, &progress).await;
        });
        return Ok(build_events(events).into_response());
    }
    // In its own task: a caller that hangs up must not cancel a build half-way (its build sandbox would stay).
    let build = tokio::spawn(async move { svc.create_template(req).await });
    let template = build
        .await
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("template task: {e}")))??;
    Ok((StatusCode::CREATED, Json(template)).into_response())
}

/// The SSE answer of a build: its events as they come, ending after `done` or `failed`.
fn build_events(
    events: mpsc::Receiver<TemplateBuildEvent>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let stream = futures::stream::unfold(Some(events), |events| async move {
        let mut events = events?;
        let ev = match events.recv().await {
            Some(ev) => ev,
            // The build task ended without a last event: it panicked.
            None => TemplateBuildEvent::Failed {
                code: ErrorCode::Internal,
                message: "the build ended without a result".into(),
            },
        };
        // A derived Serialize of strings, integers and enums does not fail.
        let data = serde_json::to_string(&ev).unwrap_or_else(|_| "{}".to_string());
        let next = (!ev.is_terminal()).then_some(events);
        Some((Ok(Event::default().event(ev.name()).data(data)), next))
    });
    Sse::new(stream).keep_alive(KeepAlive::default())
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
    st.sandboxes.delete_template(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}
