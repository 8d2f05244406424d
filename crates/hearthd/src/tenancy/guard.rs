//! The middleware in front of `/v1` and `/mcp`: `Host`/`Origin` check, key, role, ownership of every object
//! the request names, quota admission, and afterwards the ownership of what it created, the filtering of
//! lists, and one audit entry for every request that changes state or fails authentication.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::connect_info::ConnectInfo;
use axum::extract::{FromRequestParts, MatchedPath, OriginalUri, RawPathParams, Request, State};
use axum::http::{HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hearth_api::{AuditEntry, ErrorCode, Role, TokenPurpose};
use serde_json::Value;

use super::objects::{self, Kind};
use super::{Principal, Tenancy, TokenLimits, new_request_id, token};
use crate::http::AppState;
use crate::http::error::ApiError;
use crate::service::now_ms;
use crate::service::quota::{Reservation, Want};

/// Largest list answer the filter reads (bigger ones are refused rather than shown unfiltered).
const ANSWER_LIMIT: usize = 64 * 1024 * 1024;

/// What the audit entry of a request needs from before the handler ran.
struct Ctx {
    method: Method,
    route: String,
    target: String,
    source: String,
    request_id: String,
}

/// Routes only admins may use at all (the projects list is filtered instead).
fn admin_only(method: &Method, route: &str) -> bool {
    route.starts_with("/v1/keys")
        || route.starts_with("/v1/audit")
        // The storage bucket is the host's: its status lists every project's objects, GC is host-wide.
        || route.starts_with("/v1/storage")
        || (route.starts_with("/v1/projects") && *method != Method::GET)
}

/// Whether a request changes state: every method but GET and HEAD, and interactive terminals.
pub fn mutating(method: &Method, route: &str) -> bool {
    !(*method == Method::GET || *method == Method::HEAD) || route == "/v1/sandboxes/{id}/pty"
}

pub async fn guard(State(st): State<AppState>, req: Request, next: Next) -> Response {
    let t = st.tenancy.clone();
    let (mut parts, body) = req.into_parts();
    let route = parts
        .extensions
        .get::<MatchedPath>()
        .map_or_else(|| parts.uri.path().to_string(), |m| m.as_str().to_string());
    let ctx = Ctx {
        method: parts.method.clone(),
        // The path as sent (nested routers see it without their prefix).
        target: parts
            .extensions
            .get::<OriginalUri>()
            .map_or_else(|| parts.uri.path().to_string(), |u| u.0.path().to_string()),
        source: parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.to_string())
            .unwrap_or_default(),
        request_id: new_request_id(),
        route,
    };
    let params: HashMap<String, String> = RawPathParams::from_request_parts(&mut parts, &())
        .await
        .map(|p| p.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
        .unwrap_or_default();
    let is_mutating = mutating(&ctx.method, &ctx.route);

    let principal = match t.authenticate(&parts.headers) {
        Ok(p) => p,
        Err(refusal) => {
            let resp = ApiError::new(ErrorCode::Unauthorized, refusal.message()).into_response();
            return finish(&t, &ctx, None, resp, true);
        }
    };
    if let Err(why) = t.check_origin(&parts.headers) {
        let resp = ApiError::new(ErrorCode::Forbidden, why).into_response();
        return finish(&t, &ctx, Some(&principal), resp, is_mutating);
    }
    if let Some(rate) = &t.rate
        && principal.key_id != super::BOOTSTRAP_KEY_ID
        && let Err(wait) = rate.take(&principal.key_id, std::time::Instant::now())
    {
        let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
        let mut resp = ApiError::new(
            ErrorCode::RateLimited,
            format!("too many requests; retry in {secs} s"),
        )
        .into_response();
        resp.headers_mut()
            .insert(axum::http::header::RETRY_AFTER, HeaderValue::from(secs.max(1)));
        return finish(&t, &ctx, Some(&principal), resp, is_mutating);
    }
    if let Some(limits) = &principal.token {
        if let Err(e) = token_reaches(limits, &ctx.route, &params) {
            return finish(&t, &ctx, Some(&principal), e.into_response(), is_mutating);
        }
        // MCP's tools call `/v1` with the request's `Authorization`: an API token of the same scope and life.
        if limits.purpose == TokenPurpose::Mcp {
            match api_token_for_mcp(&t, &principal, limits) {
                Ok(v) => {
                    parts.headers.insert(axum::http::header::AUTHORIZATION, v);
                }
                Err(e) => return finish(&t, &ctx, Some(&principal), e.into_response(), is_mutating),
            }
        }
    }
    parts.extensions.insert(principal.clone());
    let req = Request::from_parts(parts, body);
    let resp = match admit(&t, &principal, &ctx, &params, req).await {
        Ok((req, reservation)) => {
            let resp = next.run(req).await;
            after(&t, &principal, &ctx, &params, resp, reservation).await
        }
        Err(e) => e.into_response(),
    };
    finish(&t, &ctx, Some(&principal), resp, is_mutating)
}

/// Whether an access token's purpose and scope reach `route` (403 when not; 404 for another sandbox).
fn token_reaches(
    limits: &TokenLimits,
    route: &str,
    params: &HashMap<String, String>,
) -> Result<(), ApiError> {
    let forbidden = |why: String| Err(ApiError::new(ErrorCode::Forbidden, why));
    let purpose = limits.purpose.as_str();
    let reaches = match limits.purpose {
        TokenPurpose::Mcp => route.starts_with("/mcp"),
        TokenPurpose::Pty => route == "/v1/sandboxes/{id}/pty",
        TokenPurpose::Api => route.starts_with("/v1/"),
    };
    if !reaches {
        return forbidden(format!("a {purpose} token does not reach {route}"));
    }
    // A token must not outlive its minter's rights by minting longer-lived credentials.
    if route == "/v1/tokens" || route.starts_with("/v1/keys") {
        return forbidden("a token cannot mint tokens nor use the keys routes".into());
    }
    // `/mcp` is not about a sandbox; the tools' calls carry the token's scope (api_token_for_mcp).
    if let Some(sandbox) = &limits.sandbox
        && limits.purpose != TokenPurpose::Mcp
    {
        if !route.starts_with("/v1/sandboxes/{id}") {
            return forbidden(format!(
                "this token is for sandbox {sandbox} only; {route} is not about a sandbox"
            ));
        }
        if params.get("id") != Some(sandbox) {
            let asked = params.get("id").map(String::as_str).unwrap_or("");
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("no such sandbox {asked:?}"),
            ));
        }
    }
    Ok(())
}

/// The `Authorization` value MCP's tools forward: the same token with purpose `api`.
fn api_token_for_mcp(t: &Tenancy, p: &Principal, limits: &TokenLimits) -> Result<HeaderValue, ApiError> {
    let claims = token::Claims {
        key_id: p.key_id.clone(),
        project: p.project.clone(),
        role: p.role,
        sandbox: limits.sandbox.clone(),
        purpose: TokenPurpose::Api,
        expires_ms: limits.expires_ms,
    };
    let signed = t.mint(&claims)?;
    HeaderValue::from_str(&format!("Bearer {signed}"))
        .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))
}

/// Role, ownership and quota checks; returns the request (its body re-assembled if it was read).
async fn admit(
    t: &Tenancy,
    p: &Principal,
    ctx: &Ctx,
    params: &HashMap<String, String>,
    req: Request,
) -> Result<(Request, Option<Reservation>), ApiError> {
    let mcp = ctx.route.starts_with("/mcp");
    if admin_only(&ctx.method, &ctx.route) && !p.is_admin() {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "this route needs an admin key",
        ));
    }
    // MCP's tools call `/v1` with the caller's key, where they are checked one by one.
    if !mcp && p.role == Role::Viewer && mutating(&ctx.method, &ctx.route) {
        return Err(ApiError::new(
            ErrorCode::Forbidden,
            "a viewer key cannot change anything",
        ));
    }
    for (kind, key) in objects::path_refs(&ctx.route, params) {
        ensure_owned(t, p, kind, &key)?;
    }
    let (req, body) = if objects::body_may_refer(&ctx.method, &ctx.route) {
        let (parts, body) = req.into_parts();
        let bytes = axum::body::to_bytes(body, crate::http::JSON_LIMIT)
            .await
            .map_err(|_| ApiError::new(ErrorCode::PayloadTooLarge, "request body too large"))?;
        // A body that is not JSON is left to the handler's typed error.
        let value: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        for (kind, key) in objects::body_refs(&value) {
            ensure_owned(t, p, kind, &key)?;
        }
        (Request::from_parts(parts, Body::from(bytes)), value)
    } else {
        (req, Value::Null)
    };
    let reservation = match want(t, ctx, params, &body)? {
        Some(w) => Some(t.sandboxes.reserve_quota_async(&p.project, w).await?),
        None => None,
    };
    Ok((req, reservation))
}

fn ensure_owned(t: &Tenancy, p: &Principal, kind: Kind, key: &str) -> Result<(), ApiError> {
    match objects::owns(t, p, kind, key) {
        Ok(true) => Ok(()),
        Ok(false) => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("no such {} {key:?}", kind.as_str()),
        )),
        Err(e) => Err(ApiError::new(ErrorCode::Internal, e.to_string())),
    }
}

/// What a request would start (creates, forks and resumes) or add to the project's disk (those creates and
/// forks, snapshots, template saves).
fn want(
    t: &Tenancy,
    ctx: &Ctx,
    params: &HashMap<String, String>,
    body: &Value,
) -> Result<Option<Want>, ApiError> {
    if ctx.method != Method::POST {
        return Ok(None);
    }
    let shape_of = |id: &str| -> Result<(u64, u64), ApiError> {
        let row = t
            .db()
            .get(id)
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        Ok(row.map_or((0, 0), |r| (r.vcpus.into(), r.memory_mib.into())))
    };
    let id = params.get("id").map(String::as_str).unwrap_or("");
    let (n, (vcpus, memory), creates) = match ctx.route.as_str() {
        "/v1/sandboxes" => {
            let vcpus = body.get("vcpus").and_then(Value::as_u64);
            let memory = body.get("memory_mib").and_then(Value::as_u64);
            let shape = (
                vcpus.unwrap_or(crate::service::lifecycle::DEFAULT_VCPUS.into()),
                memory.unwrap_or(crate::service::lifecycle::DEFAULT_MEMORY_MIB.into()),
            );
            // A recreate from a synced disk has its source's shape.
            match body.get("from_sync").and_then(Value::as_str) {
                Some(src) => (1, shape_of(src)?, true),
                None => (1, shape, true),
            }
        }
        // Each child has the parent's shape; an absent body or count is one child.
        "/v1/sandboxes/{id}/fork" => {
            let count = body
                .get("count")
                .and_then(Value::as_u64)
                .unwrap_or(1)
                .clamp(1, 64);
            (count, shape_of(id)?, true)
        }
        "/v1/sandboxes/{id}/resume" => (1, shape_of(id)?, false),
        // Nothing starts, but the project's disk grows.
        "/v1/sandboxes/{id}/snapshots" | "/v1/templates" => {
            return Ok(Some(Want {
                disk: true,
                ..Want::default()
            }));
        }
        _ => return Ok(None),
    };
    Ok(Some(Want {
        sandboxes: n,
        vcpus: vcpus * n,
        memory_mib: memory * n,
        creates,
        disk: creates,
    }))
}

/// Records what a create made, forgets what a delete removed, filters lists. The quota reservation is held
/// until the answer is complete (for an event stream, until its last event).
async fn after(
    t: &Arc<Tenancy>,
    p: &Principal,
    ctx: &Ctx,
    params: &HashMap<String, String>,
    resp: Response,
    reservation: Option<Reservation>,
) -> Response {
    if !resp.status().is_success() {
        return resp;
    }
    if ctx.method == Method::DELETE
        && let Some((kind, key)) = objects::deleted(&ctx.route, params)
        && let Err(e) = t.db().remove_owner(kind.as_str(), &key)
    {
        tracing::warn!(error = %e, "forgetting a deleted object's owner");
    }
    let creates = objects::creates(&ctx.method, &ctx.route);
    let filters = ctx.method == Method::GET && !p.is_admin() && objects::list_shape(&ctx.route).is_some();
    if !creates && !filters {
        return resp;
    }
    if creates && is_event_stream(&resp) {
        return record_from_events(t.clone(), p.project.clone(), ctx.route.clone(), resp, reservation);
    }
    let (mut parts, body) = resp.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, ANSWER_LIMIT).await else {
        return ApiError::new(ErrorCode::Internal, "answer too large to check").into_response();
    };
    let Ok(mut value) = serde_json::from_slice::<Value>(&bytes) else {
        return Response::from_parts(parts, Body::from(bytes));
    };
    let result = if creates {
        objects::record_created(t, &ctx.route, &value, &p.project)
    } else {
        objects::filter_list(t, p, &ctx.route, &mut value)
    };
    if let Err(e) = result {
        return ApiError::new(ErrorCode::Internal, e.to_string()).into_response();
    }
    if creates {
        return Response::from_parts(parts, Body::from(bytes));
    }
    parts.headers.remove(axum::http::header::CONTENT_LENGTH);
    Response::from_parts(parts, Body::from(value.to_string()))
}

fn is_event_stream(resp: &Response) -> bool {
    resp.headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"))
}

/// The answer of a create asked for as an event stream (a sandbox's start, a template build): its events pass
/// through as they come, and the object in its `done` event is recorded as the project's before that event is
/// passed on. A task reads the stream to its end even when the caller has gone away (the create goes on, so its
/// object must still be owned); the quota reservation lives as long as the task.
fn record_from_events(
    t: Arc<Tenancy>,
    project: String,
    route: String,
    resp: Response,
    reservation: Option<Reservation>,
) -> Response {
    use futures::StreamExt;
    let (parts, body) = resp.into_parts();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, axum::Error>>(16);
    tokio::spawn(async move {
        let _reservation = reservation;
        let mut body = body.into_data_stream();
        let mut pending = String::new();
        let mut caller = Some(tx);
        while let Some(chunk) = body.next().await {
            if let Ok(bytes) = &chunk {
                pending.push_str(&String::from_utf8_lossy(bytes));
                while let Some(end) = pending.find("\n\n") {
                    let event: String = pending.drain(..end + 2).collect();
                    record_done_event(&t, &route, &event, &project);
                }
            }
            if let Some(tx) = &caller
                && tx.send(chunk).await.is_err()
            {
                caller = None;
            }
        }
    });
    let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
    Response::from_parts(parts, Body::from_stream(stream))
}

/// Records the object of one SSE event if it is a create's `done` (`data:` holds `sandbox` or `template`).
fn record_done_event(t: &Tenancy, route: &str, event: &str, project: &str) {
    let mut name = "";
    let mut data = String::new();
    for line in event.lines() {
        if let Some(v) = line.strip_prefix("event:") {
            name = v.trim();
        } else if let Some(v) = line.strip_prefix("data:") {
            data.push_str(v.strip_prefix(' ').unwrap_or(v));
        }
    }
    if name != "done" {
        return;
    }
    let Ok(value) = serde_json::from_str::<Value>(&data) else {
        return;
    };
    let Some(object) = value.get("sandbox").or_else(|| value.get("template")) else {
        return;
    };
    if let Err(e) = objects::record_created(t, route, object, project) {
        tracing::error!(error = %e, route, "recording a streamed create's object");
    }
}

/// Adds the request id and, for state changes and refused keys, appends the audit entry.
fn finish(t: &Tenancy, ctx: &Ctx, p: Option<&Principal>, mut resp: Response, audit: bool) -> Response {
    if let Ok(v) = HeaderValue::from_str(&ctx.request_id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    if audit {
        let entry = AuditEntry {
            seq: 0,
            at_ms: now_ms(),
            key_id: p.map(|p| p.key_id.clone()).unwrap_or_default(),
            project: p.map(|p| p.project.clone()).unwrap_or_default(),
            role: p.map(|p| p.role.as_str().to_string()).unwrap_or_default(),
            action: format!("{} {}", ctx.method, ctx.route),
            target: ctx.target.clone(),
            status: resp.status().as_u16(),
            source: ctx.source.clone(),
            request_id: ctx.request_id.clone(),
            prev_hash: String::new(),
            hash: String::new(),
        };
        if let Err(e) = t.db().append_audit(entry) {
            tracing::error!(error = %e, request_id = %ctx.request_id, "appending to the audit log");
        }
    }
    resp
}
