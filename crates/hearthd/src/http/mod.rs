//! The HTTP API: routes, middleware and [`run`].
//!
//! Handlers are thin: extract (through the extractors of [`error`], which turn every bad input into a typed
//! error), call one [`Sandboxes`] method, map its error. Route modules: [`sandboxes`], [`commands`], [`files`],
//! [`system`]; streamed command output lives in [`sse`].
//!
//! Timeouts: routes that answer promptly get a request timeout (a stuck client or guest cannot pin a request
//! forever); creating waits for the VM; streaming routes (commands, file content, wait) are bounded by their own
//! deadlines and by the client reading.

pub mod buckets;
pub mod commands;
pub mod error;
pub mod files;
pub mod network;
pub mod ports;
pub mod progress;
pub mod pty;
pub mod sandboxes;
pub mod serve;
pub mod sse;
pub mod storage;
pub mod system;
pub mod templates;
pub mod tenancy;
pub mod watch;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request};
use axum::handler::Handler;
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hearth_api::ErrorCode;
use metrics_exporter_prometheus::PrometheusHandle;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::timeout::TimeoutLayer;

use crate::auth::KeyCheck;

use crate::service::Sandboxes;
use error::ApiError;

/// Body limit of JSON (and other buffered) routes.
pub const JSON_LIMIT: usize = 1024 * 1024;
/// Request timeout of the routes that answer promptly.
pub const QUICK_TIMEOUT: Duration = Duration::from_secs(30);

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    pub sandboxes: Arc<Sandboxes>,
    pub keys: KeyCheck,
    pub metrics: Option<PrometheusHandle>,
    /// Projects, scoped keys, quotas, the audit log (crate::tenancy).
    pub tenancy: Arc<crate::tenancy::Tenancy>,
}

fn quick() -> TimeoutLayer {
    TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, QUICK_TIMEOUT)
}

/// The whole API as a router (tests call it without a socket).
pub fn app(state: AppState) -> Router {
    let create_timeout = state.sandboxes.settings().ready_timeout + Duration::from_secs(90);
    let create = TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, create_timeout);
    // Pause and resume copy and check the guest's memory: minutes on a slow disk. They run in their own tasks,
    // so a timeout only stops the waiting.
    let long = TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, Duration::from_secs(600));
    let v1 = Router::new()
        .route(
            "/sandboxes",
            post(sandboxes::create.layer(create)).get(sandboxes::list.layer(quick())),
        )
        .route(
            "/sandboxes/{id}",
            get(sandboxes::get.layer(quick())).delete(sandboxes::destroy.layer(quick())),
        )
        .route(
            "/sandboxes/{id}/timeout",
            post(sandboxes::set_timeout.layer(quick())),
        )
        .route("/sandboxes/{id}/pause", post(sandboxes::pause.layer(long)))
        .route("/sandboxes/{id}/resume", post(sandboxes::resume.layer(long)))
        .route("/sandboxes/{id}/sync", post(sandboxes::sync.layer(long)))
        .route("/sandboxes/{id}/usage", get(sandboxes::usage.layer(quick())))
        .route(
            "/sandboxes/{id}/boundary",
            get(sandboxes::boundary.layer(quick())),
        )
        .route("/sandboxes/{id}/fork", post(sandboxes::fork.layer(long)))
        .route("/sandboxes/{id}/snapshots", post(sandboxes::snapshot.layer(long)))
        .route("/snapshots", get(sandboxes::list_snapshots.layer(quick())))
        .route(
            "/templates",
            post(templates::create.layer(long)).get(templates::list.layer(quick())),
        )
        .route(
            "/templates/{name}",
            get(templates::get.layer(quick())).delete(templates::delete.layer(quick())),
        )
        .route(
            "/snapshots/{id}",
            axum::routing::delete(sandboxes::delete_snapshot.layer(quick())),
        )
        .route("/usage", get(sandboxes::usage_report.layer(quick())))
        .route("/sandboxes/{id}/commands", post(commands::run))
        .route(
            "/sandboxes/{id}/processes",
            get(commands::processes.layer(quick())),
        )
        .route("/sandboxes/{id}/processes/{pid}/wait", post(commands::wait))
        .route(
            "/sandboxes/{id}/processes/{pid}/kill",
            post(commands::kill.layer(quick())),
        )
        .route(
            "/sandboxes/{id}/processes/{pid}/stdin",
            post(commands::stdin.layer(quick())),
        )
        .route(
            "/sandboxes/{id}/files",
            get(files::read)
                // The upload streams with its own cap (files::MAX_UPLOAD) instead of the JSON limit.
                .put(files::write.layer(DefaultBodyLimit::disable()))
                .delete(files::remove.layer(quick())),
        )
        .route("/sandboxes/{id}/pty", get(pty::pty))
        .route("/sandboxes/{id}/files/stat", get(files::stat.layer(quick())))
        .route("/sandboxes/{id}/files/list", get(files::list.layer(quick())))
        .route("/sandboxes/{id}/files/mkdir", post(files::mkdir.layer(quick())))
        .route("/sandboxes/{id}/files/rename", post(files::rename.layer(quick())))
        // Lasts as long as the client listens.
        .route("/sandboxes/{id}/files/watch", get(watch::watch))
        .route("/system", get(system::system.layer(quick())))
        .route("/storage", get(storage::status.layer(quick())))
        .route("/storage/gc", post(storage::gc.layer(long)))
        .route(
            "/buckets",
            post(buckets::create.layer(quick())).get(buckets::list.layer(quick())),
        )
        .route(
            "/buckets/{name}",
            get(buckets::get.layer(quick())).delete(buckets::delete.layer(quick())),
        )
        .route(
            "/sandboxes/{id}/mounts",
            get(buckets::mounts.layer(quick()))
                .put(buckets::attach.layer(long))
                .delete(buckets::detach.layer(long)),
        )
        .route(
            "/sandboxes/{id}/network",
            get(network::get.layer(quick())).patch(network::set_policy.layer(quick())),
        )
        .route("/sandboxes/{id}/network/log", get(network::log.layer(quick())))
        .route(
            "/sandboxes/{id}/ports/{port}/token",
            post(ports::token.layer(quick())).delete(ports::revoke_tokens.layer(quick())),
        )
        .route(
            "/networks",
            post(network::create.layer(quick())).get(network::list.layer(quick())),
        )
        .route(
            "/networks/{network}",
            get(network::info.layer(quick())).delete(network::delete.layer(quick())),
        )
        .route(
            "/networks/{network}/members/{sandbox}",
            axum::routing::put(network::attach.layer(quick())).delete(network::detach.layer(quick())),
        )
        // Projects, keys and the audit log (http/tenancy.rs).
        .route(
            "/projects",
            post(tenancy::create_project.layer(quick())).get(tenancy::list_projects.layer(quick())),
        )
        .route(
            "/projects/{name}/quota",
            axum::routing::put(tenancy::set_quota.layer(quick())),
        )
        .route("/projects/{name}/usage", get(tenancy::usage.layer(quick())))
        .route(
            "/keys",
            post(tenancy::create_key.layer(quick())).get(tenancy::list_keys.layer(quick())),
        )
        .route(
            "/keys/{id}",
            axum::routing::delete(tenancy::revoke_key.layer(quick())),
        )
        .route("/tokens", post(tenancy::create_token.layer(quick())))
        .route("/audit", get(tenancy::audit.layer(quick())))
        .route("/audit/export", get(tenancy::audit_export))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            crate::tenancy::guard::guard,
        ))
        .route_layer(middleware::from_fn(count_requests));
    // Exposed ports authorise themselves (API key or port token) and stream both ways without a timeout.
    let ports = Router::new()
        .route("/sandboxes/{id}/ports/{port}", axum::routing::any(ports::forward))
        .route(
            "/sandboxes/{id}/ports/{port}/",
            axum::routing::any(ports::forward),
        )
        .route(
            "/sandboxes/{id}/ports/{port}/{*path}",
            axum::routing::any(ports::forward),
        )
        .route_layer(middleware::from_fn(count_requests));
    Router::new()
        .route("/healthz", get(system::healthz))
        .route("/metrics", get(system::metrics))
        .route("/openapi.json", get(system::openapi))
        .route_layer(middleware::from_fn(count_requests))
        .nest("/v1", v1.merge(ports))
        .fallback(unknown_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(JSON_LIMIT))
        .layer(CatchPanicLayer::custom(panic_response))
        .with_state(state)
}

/// Serves `app` on `listener` until `shutdown` resolves, then finishes the requests in flight.
pub async fn run(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    run_with(listener, state, serve::ServeLimits::default(), shutdown).await
}

/// [`run`] with the server's bounds given.
pub async fn run_with(
    listener: tokio::net::TcpListener,
    state: AppState,
    limits: serve::ServeLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let mcp_stop = tokio_util::sync::CancellationToken::new();
    let addr = listener.local_addr()?;
    let mut router = app(state.clone()).merge(mcp(state.clone(), addr, mcp_stop.clone()));
    // Browsers of the `--cors-origin` origins (crate::tenancy).
    if let Some(cors) = state.tenancy.cors_layer() {
        router = router.layer(cors);
    }
    // E2B's control plane beside `/v1`, and envd's paths on requests naming a sandbox (`E2b-Sandbox-Id` header
    // or `{port}-{id}.` host name) to the envd adapter (crate hearth-e2b, calling this API over loopback).
    let e2b = hearth_e2b::Adapter::new(&hearth_mcp::loopback_url(addr), mcp_stop.clone())
        .map_err(std::io::Error::other)?;
    let router = e2b.router(router);
    let shutdown = async move {
        shutdown.await;
        // Open MCP sessions, E2B streams and watches would otherwise hold the graceful shutdown up.
        mcp_stop.cancel();
    };
    serve::serve(listener, router, limits, shutdown).await
}

/// `/mcp`: the MCP server over streamable HTTP (crate hearth-mcp), behind the same key check as `/v1`. Its
/// tools call this daemon's API at `addr` over loopback, forwarding the caller's key.
fn mcp(state: AppState, addr: std::net::SocketAddr, stop: tokio_util::sync::CancellationToken) -> Router {
    let service = hearth_mcp::http_service(&hearth_mcp::loopback_url(addr), stop);
    Router::new()
        .nest_service("/mcp", service)
        .route_layer(middleware::from_fn_with_state(
            state,
            crate::tenancy::guard::guard,
        ))
        .route_layer(middleware::from_fn(count_requests))
}

/// Counts requests by route pattern (never the raw path: ids would explode the label set) and status.
/// Installed as a route layer, where the matched pattern is known; fallbacks count themselves.
async fn count_requests(req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched", |m| m.as_str())
        .to_string();
    let method = req.method().clone();
    let resp = next.run(req).await;
    crate::metrics::http_request(route, method.as_str(), resp.status().as_u16());
    resp
}

async fn unknown_route(method: axum::http::Method) -> ApiError {
    crate::metrics::http_request("unmatched".into(), method.as_str(), 404);
    ApiError::new(ErrorCode::UnknownRoute, "no such route")
}

async fn method_not_allowed(method: axum::http::Method) -> ApiError {
    crate::metrics::http_request("unmatched".into(), method.as_str(), 405);
    ApiError::new(ErrorCode::MethodNotAllowed, "method not allowed on this route")
}

fn panic_response(panic: Box<dyn std::any::Any + Send + 'static>) -> Response {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_default();
    tracing::error!(panic = %what, "handler panicked");
    ApiError::new(ErrorCode::Internal, "internal error").into_response()
}
