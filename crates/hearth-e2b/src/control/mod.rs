//! E2B's control plane: sandbox lifecycle, snapshots, list. Each handler reads the caller's key
//! ([`Caller`]), calls the daemon's API with it and answers in E2B's shapes ([`wire`]) and statuses
//! ([`error`]).

pub mod convert;
pub mod error;
pub mod list;
pub mod wire;

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::Router;
use axum::extract::{FromRequest, FromRequestParts, Path, RawQuery, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use hearth_api::{SandboxState, is_valid_snapshot_id};
use serde::de::DeserializeOwned;
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::Shared;
use error::RestError;
use wire::{
    ConnectRequest, ForkRequest, ForkResult, NetworkConfig, NewSandbox, PauseRequest, RefreshRequest,
    SnapshotInfo, SnapshotRequest, TimeoutRequest,
};

type St = State<Arc<Shared>>;
type RestResult<T> = Result<T, RestError>;

/// Largest control-plane request body.
const BODY_LIMIT: usize = 1024 * 1024;

/// The control-plane routes (none of them collides with hearth's `/v1/...`).
pub fn routes(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/sandboxes", post(create).get(list_v1))
        .route("/v2/sandboxes", post(create).get(list_v2))
        .route("/sandboxes/{id}", get(get_info).delete(kill))
        .route("/sandboxes/{id}/timeout", post(set_timeout))
        .route("/sandboxes/{id}/refreshes", post(refresh))
        .route("/sandboxes/{id}/pause", post(pause))
        .route("/sandboxes/{id}/resume", post(resume))
        .route("/sandboxes/{id}/connect", post(connect))
        .route("/v2/sandboxes/{id}/connect", post(connect))
        .route("/sandboxes/{id}/fork", post(fork))
        .route("/sandboxes/{id}/snapshots", post(snapshot))
        .route("/sandboxes/{id}/metrics", get(metrics))
        .route("/sandboxes/{id}/network", put(update_network))
        .route("/snapshots", get(list_snapshots))
        .route("/templates/{id}", delete(delete_template))
        .route("/templates/aliases/{alias}", get(template_alias))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(|_| {
            RestError::new(500, "internal error").into_response()
        }))
        .with_state(shared)
}

/// The caller's key, a daemon client that authenticates with it, and the domain to answer with.
pub struct Caller {
    pub key: String,
    pub api: hearth_client::Client,
    /// `domain` of the answers: the host name the caller reached the control plane by, without a leading
    /// `api.` (E2B's layout: `api.DOMAIN` for the control plane, `{port}-{id}.DOMAIN` for sandboxes). Never
    /// `null`: an SDK given no domain would send envd requests, and the key with them, to E2B's own cloud.
    pub domain: String,
}

/// The sandbox domain for a control-plane request's `Host`.
pub fn domain_of(host: Option<&str>) -> String {
    let host = host
        .map(str::trim)
        .filter(|h| !h.is_empty() && h.len() <= 253 && h.bytes().all(|b| b.is_ascii_graphic()))
        .unwrap_or("localhost");
    host.strip_prefix("api.").unwrap_or(host).to_owned()
}

impl FromRequestParts<Arc<Shared>> for Caller {
    type Rejection = RestError;

    async fn from_request_parts(parts: &mut Parts, st: &Arc<Shared>) -> Result<Self, Self::Rejection> {
        let key = crate::auth::control_key(&parts.headers).ok_or_else(RestError::unauthorized)?;
        let api = st.client(key)?;
        let host = parts
            .headers
            .get(axum::http::header::HOST)
            .and_then(|v| v.to_str().ok());
        Ok(Caller {
            key: key.to_owned(),
            api,
            domain: domain_of(host),
        })
    }
}

/// A sandbox id from the path, as hearth's id ([`crate::hearth_sandbox_id`]).
pub struct Sid(pub String);

impl FromRequestParts<Arc<Shared>> for Sid {
    type Rejection = RestError;

    async fn from_request_parts(parts: &mut Parts, st: &Arc<Shared>) -> Result<Self, Self::Rejection> {
        let Path(id) = Path::<String>::from_request_parts(parts, st)
            .await
            .map_err(|e| RestError::bad_request(e.to_string()))?;
        Ok(Sid(crate::hearth_sandbox_id(&id)))
    }
}

/// A JSON body; an empty body is `T::default()` (E2B's bodies are optional where it has defaults).
pub struct Body<T>(pub T);

impl<T: DeserializeOwned + Default> FromRequest<Arc<Shared>> for Body<T> {
    type Rejection = RestError;

    async fn from_request(req: Request, _: &Arc<Shared>) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::to_bytes(req.into_body(), BODY_LIMIT)
            .await
            .map_err(|_| RestError::new(413, format!("the body is larger than {BODY_LIMIT} bytes")))?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Body(T::default()));
        }
        serde_json::from_slice(&bytes)
            .map(Body)
            .map_err(|e| RestError::bad_request(format!("invalid JSON body: {e}")))
    }
}

/// A sandbox E2B can see: a failed one is gone as far as E2B is concerned.
async fn live(c: &Caller, id: &str) -> RestResult<hearth_api::Sandbox> {
    let sbx = c.api.get_sandbox(id).await?;
    if sbx.state == SandboxState::Failed {
        return Err(RestError::new(
            404,
            format!(
                "sandbox {} failed: {}",
                crate::e2b_sandbox_id(id),
                sbx.error.unwrap_or_default()
            ),
        ));
    }
    Ok(sbx)
}

async fn create(_: St, c: Caller, Body(n): Body<NewSandbox>) -> RestResult<Response> {
    let req = convert::create_request(n)?;
    let sbx = c.api.create_sandbox(&req).await?;
    Ok((
        StatusCode::CREATED,
        Json(convert::sandbox(&sbx, &c.key, &c.domain)),
    )
        .into_response())
}

async fn get_info(_: St, c: Caller, Sid(id): Sid) -> RestResult<Response> {
    let sbx = live(&c, &id).await?;
    let detail =
        convert::detail(&sbx, &c.key, &c.domain).ok_or_else(|| RestError::new(404, "sandbox not found"))?;
    Ok(Json(detail).into_response())
}

async fn list_all(c: &Caller, q: &list::ListQuery) -> RestResult<Vec<list::Item<hearth_api::Sandbox>>> {
    let filter = hearth_client::ListFilter {
        state: None,
        metadata: q.metadata.clone(),
    };
    let all = c.api.list_sandboxes(&filter).await?;
    Ok(all
        .sandboxes
        .into_iter()
        .filter_map(|s| {
            Some(list::Item {
                created_at: s.created_at.clone(),
                id: s.id.clone(),
                state: convert::state(s.state)?,
                template: s.template.clone(),
                value: s,
            })
        })
        .collect())
}

async fn list_v2(_: St, c: Caller, RawQuery(query): RawQuery) -> RestResult<Response> {
    let q = list::parse(query.as_deref())?;
    let (page, next) = list::page(&q, list_all(&c, &q).await?);
    let body: Vec<wire::ListedSandbox> = page.iter().filter_map(convert::listed).collect();
    Ok(with_next_token(Json(body).into_response(), next))
}

/// The first list route: running sandboxes only, one page.
async fn list_v1(_: St, c: Caller, RawQuery(query): RawQuery) -> RestResult<Response> {
    let mut q = list::parse(query.as_deref())?;
    q.states = vec![wire::State::Running];
    q.limit = list::MAX_LIMIT;
    let (page, _) = list::page(&q, list_all(&c, &q).await?);
    let body: Vec<wire::ListedSandbox> = page.iter().filter_map(convert::listed).collect();
    Ok(Json(body).into_response())
}

fn with_next_token(mut resp: Response, next: Option<String>) -> Response {
    if let Some(token) = next.and_then(|t| HeaderValue::from_str(&t).ok()) {
        resp.headers_mut().insert("x-next-token", token);
    }
    resp
}

async fn kill(State(st): St, c: Caller, Sid(id): Sid) -> RestResult<StatusCode> {
    c.api.delete_sandbox(&id).await?;
    // What the envd adapter kept for it goes with it.
    st.procs.forget_sandbox(&id);
    st.watchers.forget_sandbox(&id);
    Ok(StatusCode::NO_CONTENT)
}

async fn set_timeout(
    _: St,
    c: Caller,
    Sid(id): Sid,
    Body(t): Body<TimeoutRequest>,
) -> RestResult<StatusCode> {
    c.api.set_timeout(&id, convert::timeout(t.timeout)?).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn refresh(_: St, c: Caller, Sid(id): Sid, Body(r): Body<RefreshRequest>) -> RestResult<StatusCode> {
    c.api
        .set_timeout(&id, convert::timeout(r.duration.unwrap_or(60))?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn pause(_: St, c: Caller, Sid(id): Sid, Body(p): Body<PauseRequest>) -> RestResult<StatusCode> {
    if p.memory == Some(false) {
        return Err(RestError::bad_request(
            "memory false (filesystem-only pause) is not supported: a hearth pause keeps the memory",
        ));
    }
    let sbx = live(&c, &id).await?;
    if matches!(sbx.state, SandboxState::Paused | SandboxState::Pausing) {
        return Err(RestError::new(
            409,
            format!("sandbox {} is already paused", crate::e2b_sandbox_id(&id)),
        ));
    }
    c.api.pause_sandbox(&id).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Resumes `id` if it is paused; returns whether it was, and the sandbox afterwards.
async fn ensure_running(c: &Caller, id: &str, r: &ConnectRequest) -> RestResult<(bool, hearth_api::Sandbox)> {
    if r.memory == Some(false) {
        return Err(RestError::bad_request(
            "memory false (resume by reboot) is not supported: hearth resumes the saved memory",
        ));
    }
    let timeout = r.timeout.map(convert::timeout).transpose()?;
    let sbx = live(c, id).await?;
    let (resumed, sbx) = match sbx.state {
        SandboxState::Paused | SandboxState::Pausing => (true, c.api.resume_sandbox(id).await?),
        _ => (false, sbx),
    };
    let sbx = match timeout {
        Some(t) if extends(&sbx.end_at, t) => c.api.set_timeout(id, t).await?,
        _ => sbx,
    };
    Ok((resumed, sbx))
}

/// Whether `now + secs` is later than `end_at` (a connect only ever extends a sandbox's life).
fn extends(end_at: &str, secs: u64) -> bool {
    let new_end = OffsetDateTime::now_utc() + Duration::from_secs(secs);
    OffsetDateTime::parse(end_at, &Rfc3339).map_or(true, |end| new_end > end)
}

/// `POST /v2/sandboxes/{id}/connect`: 200 when it was running, 201 when it was resumed.
async fn connect(_: St, c: Caller, Sid(id): Sid, Body(r): Body<ConnectRequest>) -> RestResult<Response> {
    let (resumed, sbx) = ensure_running(&c, &id, &r).await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(convert::sandbox(&sbx, &c.key, &c.domain))).into_response())
}

/// The older `POST /sandboxes/{id}/resume`: 201 when resumed, 409 when it was not paused.
async fn resume(_: St, c: Caller, Sid(id): Sid, Body(r): Body<ConnectRequest>) -> RestResult<Response> {
    let sbx = live(&c, &id).await?;
    if !matches!(sbx.state, SandboxState::Paused | SandboxState::Pausing) {
        return Err(RestError::new(
            409,
            format!("sandbox {} is not paused", crate::e2b_sandbox_id(&id)),
        ));
    }
    let (_, sbx) = ensure_running(&c, &id, &r).await?;
    Ok((
        StatusCode::CREATED,
        Json(convert::sandbox(&sbx, &c.key, &c.domain)),
    )
        .into_response())
}

async fn fork(_: St, c: Caller, Sid(id): Sid, Body(f): Body<ForkRequest>) -> RestResult<Response> {
    let count = f.count.unwrap_or(1);
    let timeout = f.timeout.map(convert::timeout).transpose()?;
    let forked = c.api.fork_sandbox(&id, count).await?;
    let mut results = Vec::with_capacity(forked.sandboxes.len());
    for child in forked.sandboxes {
        let child = match timeout {
            Some(t) => match c.api.set_timeout(&child.id, t).await {
                Ok(s) => s,
                Err(e) => {
                    let e = RestError::from(e);
                    results.push(ForkResult {
                        sandbox: None,
                        error: Some(e.body()),
                    });
                    continue;
                }
            },
            None => child,
        };
        results.push(ForkResult {
            sandbox: Some(convert::sandbox(&child, &c.key, &c.domain)),
            error: None,
        });
    }
    Ok((StatusCode::CREATED, Json(results)).into_response())
}

/// `POST /sandboxes/{id}/snapshots`: a hearth snapshot; `Sandbox.create(snapshotID)` starts from it. hearth
/// snapshots have no names, so `names` is empty.
async fn snapshot(_: St, c: Caller, Sid(id): Sid, Body(r): Body<SnapshotRequest>) -> RestResult<Response> {
    convert::check_snapshot(&r)?;
    let snp = c.api.snapshot_sandbox(&id).await?;
    let info = SnapshotInfo {
        snapshot_id: snp.id,
        names: Vec::new(),
    };
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

async fn list_snapshots(_: St, c: Caller, RawQuery(query): RawQuery) -> RestResult<Response> {
    let q = list::parse(query.as_deref())?;
    let all = c.api.list_snapshots().await?;
    let items = all
        .snapshots
        .into_iter()
        .filter(|s| q.sandbox_id.as_ref().is_none_or(|id| *id == s.sandbox_id))
        .map(|s| list::Item {
            created_at: s.created_at.clone(),
            id: s.id.clone(),
            state: wire::State::Running,
            template: s.template.clone(),
            value: SnapshotInfo {
                snapshot_id: s.id,
                names: Vec::new(),
            },
        })
        .collect();
    let q = list::ListQuery {
        template: None,
        states: Vec::new(),
        ..q
    };
    let (page, next) = list::page(&q, items);
    Ok(with_next_token(Json(page).into_response(), next))
}

/// `DELETE /templates/{id}`: a snapshot (how the SDKs delete one) or a saved hearth template.
async fn delete_template(_: St, c: Caller, Sid(id): Sid) -> RestResult<StatusCode> {
    if is_valid_snapshot_id(&id) {
        c.api.delete_snapshot(&id).await?;
    } else {
        c.api.delete_template(&id).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /templates/aliases/{alias}` (`Template.exists`): a hearth template of that name.
async fn template_alias(_: St, c: Caller, Path(alias): Path<String>) -> RestResult<Response> {
    let all = c.api.list_templates().await?;
    if !all.templates.iter().any(|t| t.name == alias) {
        return Err(RestError::new(404, format!("template {alias} not found")));
    }
    Ok(Json(serde_json::json!({ "templateID": alias, "public": false })).into_response())
}

/// hearth does not sample CPU and memory: the list is empty (the sandbox must exist). Usage accounting is
/// `GET /v1/sandboxes/{id}/usage`.
async fn metrics(_: St, c: Caller, Sid(id): Sid) -> RestResult<Response> {
    live(&c, &id).await?;
    Ok(Json(Vec::<wire::Metric>::new()).into_response())
}

async fn update_network(
    _: St,
    c: Caller,
    Sid(id): Sid,
    Body(net): Body<NetworkConfig>,
) -> RestResult<StatusCode> {
    c.api
        .set_network_policy(&id, &convert::update_policy(&net)?)
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_domain_comes_from_the_host_the_caller_used() {
        assert_eq!(domain_of(Some("api.e2b.example.com")), "e2b.example.com");
        assert_eq!(
            domain_of(Some("api.e2b.example.com:8443")),
            "e2b.example.com:8443"
        );
        assert_eq!(domain_of(Some("127.0.0.1:7070")), "127.0.0.1:7070");
        assert_eq!(domain_of(None), "localhost");
        assert_eq!(domain_of(Some("a b")), "localhost");
    }
}
