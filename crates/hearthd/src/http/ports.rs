//! Exposed ports: `/v1/sandboxes/{id}/ports/{port}/…` forwards HTTP (and WebSocket upgrades) to a guest port
//! through the sandbox's own network namespace. Nothing reaches a sandbox from outside any other way.
//!
//! A request needs the API key, or a token from `POST /v1/sandboxes/{id}/ports/{port}/token`: signed by the
//! daemon (HMAC-SHA256), bound to one sandbox and one port, expiring, revoked all at once by
//! `DELETE /v1/sandboxes/{id}/ports/{port}/token`. The key and the token are removed before the request reaches
//! the guest.
//!
//! Cookies: every sandbox's ports are served from the API's own origin, where a browser would send one
//! sandbox's cookies to every other sandbox (and to the API). So the proxy strips `Cookie` from requests and
//! `Set-Cookie` from answers: a guest's web app cannot keep cookie sessions through hearth, and cannot read or
//! plant another sandbox's.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Json;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use hearth_api::{ErrorBody, ErrorCode, PortToken, PortTokenRequest};
use hyper_util::rt::TokioIo;

use super::AppState;
use super::error::{ApiError, OptionalJson, SandboxId};

/// Query parameter that carries a port token.
pub const TOKEN_PARAM: &str = "hearth_token";
const DEFAULT_TOKEN_TTL_S: u64 = 3600;
const MAX_TOKEN_TTL_S: u64 = 86400;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

fn parse_port(s: &str) -> Result<u16, ApiError> {
    s.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ApiError::new(ErrorCode::InvalidArgument, "port must be 1-65535"))
}

/// Splits `/v1/sandboxes/{id}/ports/{port}/rest…` into id, port and the rest (with a leading `/`).
fn split_path(path: &str) -> Option<(String, &str, String)> {
    // Nested under `/v1`, the router sees the path without that prefix.
    let path = path.strip_prefix("/v1").unwrap_or(path);
    let rest = path.strip_prefix("/sandboxes/")?;
    let (id, rest) = rest.split_once('/')?;
    let rest = rest.strip_prefix("ports/")?;
    let (port, tail) = match rest.split_once('/') {
        Some((p, t)) => (p, format!("/{t}")),
        None => (rest, "/".to_string()),
    };
    Some((id.to_string(), port, tail))
}

/// `{id}` and `{port}` of the token route.
#[derive(serde::Deserialize)]
pub struct PortPath {
    #[allow(dead_code)]
    id: String,
    port: String,
}

/// Hand out a signed, expiring token that opens one port of one sandbox without the API key.
#[utoipa::path(post, path = "/v1/sandboxes/{id}/ports/{port}/token", tag = "networks",
    request_body(content = Option<PortTokenRequest>),
    params(("id" = String, Path, description = "Sandbox id"), ("port" = u16, Path, description = "Guest port")),
    responses(
        (status = 201, body = PortToken),
        (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn token(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    axum::extract::Path(path): axum::extract::Path<PortPath>,
    OptionalJson(req): OptionalJson<PortTokenRequest>,
) -> Result<(StatusCode, Json<PortToken>), ApiError> {
    let port = parse_port(&path.port)?;
    let ttl = req.ttl_s.unwrap_or(DEFAULT_TOKEN_TTL_S);
    if !(1..=MAX_TOKEN_TTL_S).contains(&ttl) {
        return Err(ApiError::new(
            ErrorCode::InvalidArgument,
            format!("ttl_s must be between 1 and {MAX_TOKEN_TTL_S}"),
        ));
    }
    let (token, expires_ms) = st.sandboxes.port_token(&id, port, ttl)?;
    Ok((
        StatusCode::CREATED,
        Json(PortToken {
            url: format!("/v1/sandboxes/{id}/ports/{port}/?{TOKEN_PARAM}={token}"),
            token,
            expires_at: crate::service::lifecycle::rfc3339(expires_ms),
        }),
    ))
}

/// Revoke every token issued so far for one port of a sandbox (tokens issued afterwards work).
#[utoipa::path(delete, path = "/v1/sandboxes/{id}/ports/{port}/token", tag = "networks",
    params(("id" = String, Path, description = "Sandbox id"), ("port" = u16, Path, description = "Guest port")),
    responses(
        (status = 204, description = "The port's tokens no longer open it"),
        (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn revoke_tokens(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    axum::extract::Path(path): axum::extract::Path<PortPath>,
) -> Result<StatusCode, ApiError> {
    let port = parse_port(&path.port)?;
    st.sandboxes.revoke_port_tokens(&id, port)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Forward a request to a port of the guest (HTTP and WebSocket). Authorised by the API key or a port token
/// (`?hearth_token=`); neither reaches the guest.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/ports/{port}/{path}", tag = "networks",
    params(("id" = String, Path, description = "Sandbox id"), ("port" = u16, Path, description = "Guest port"),
        ("path" = String, Path, description = "Path on the guest's server"),
        ("hearth_token" = Option<String>, Query, description = "Port token instead of the API key")),
    responses(
        (status = 200, description = "Whatever the guest's server answers (any method is forwarded)"),
        (status = 401, body = ErrorBody),
        (status = 404, body = ErrorBody),
        (status = 502, description = "Nothing listens on the port", body = ErrorBody),
    ),
    security(("api_key" = []), ()))]
pub async fn forward(State(st): State<AppState>, mut req: Request) -> Response {
    match forward_inner(&st, &mut req).await {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn forward_inner(st: &AppState, req: &mut Request) -> Result<Response, ApiError> {
    let not_found = || ApiError::new(ErrorCode::NotFound, "sandbox not found");
    let (id, port, tail) = split_path(req.uri().path()).ok_or_else(not_found)?;
    if !hearth_api::is_valid_sandbox_id(&id) {
        return Err(not_found());
    }
    let port = parse_port(port)?;
    // Query without the token.
    let mut token = None;
    let query: Vec<&str> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty())
        .filter(
            |kv| match kv.strip_prefix(TOKEN_PARAM).and_then(|r| r.strip_prefix('=')) {
                Some(t) => {
                    token = Some(t.to_string());
                    false
                }
                None => true,
            },
        )
        .collect();
    let by_token = token
        .as_deref()
        .is_some_and(|t| st.sandboxes.verify_port_token(t, &id, port));
    // The key must be one whose project owns the sandbox (crate::tenancy).
    let by_key = !by_token
        && req.headers().contains_key(header::AUTHORIZATION)
        && st.tenancy.key_may_use_sandbox(req.headers(), &id)?;
    if !by_key && !by_token {
        return Err(ApiError::new(
            ErrorCode::Unauthorized,
            "missing or wrong API key, or an invalid or expired port token",
        ));
    }
    let ns = st.sandboxes.port_target(&id).await?;
    let target = SocketAddr::new(hearth_net::GUEST_ADDR.into(), port);
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, hearth_net::netns::connect_tcp(&ns, target))
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorCode::AgentUnavailable,
                format!("port {port}: connect timed out"),
            )
        })?
        .map_err(|e| ApiError::new(ErrorCode::AgentUnavailable, format!("port {port}: {e}")))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| ApiError::new(ErrorCode::AgentUnavailable, format!("port {port}: {e}")))?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });

    let path_and_query = if query.is_empty() {
        tail
    } else {
        format!("{tail}?{}", query.join("&"))
    };
    let upgrade = req.headers().contains_key(header::UPGRADE);
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut *req));
    let mut out = axum::http::Request::builder()
        .method(req.method().clone())
        .uri(&path_and_query)
        .body(std::mem::replace(req.body_mut(), Body::empty()))
        .map_err(|e| ApiError::new(ErrorCode::InvalidArgument, format!("request: {e}")))?;
    for (name, value) in req.headers() {
        if name == header::AUTHORIZATION || name == header::HOST || name == header::COOKIE {
            continue;
        }
        // A key or token offered as a WebSocket subprotocol stays here too.
        if name == header::SEC_WEBSOCKET_PROTOCOL {
            if let Some(kept) = without_key_protocols(value) {
                out.headers_mut().append(name.clone(), kept);
            }
            continue;
        }
        out.headers_mut().append(name.clone(), value.clone());
    }
    if let Ok(host) = HeaderValue::from_str(&format!("localhost:{port}")) {
        out.headers_mut().insert(header::HOST, host);
    }
    let mut resp = sender
        .send_request(out)
        .await
        .map_err(|e| ApiError::new(ErrorCode::AgentUnavailable, format!("port {port}: {e}")))?;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS
        && let Some(client_upgrade) = client_upgrade
    {
        let guest_upgrade = hyper::upgrade::on(&mut resp);
        tokio::spawn(async move {
            if let (Ok(client), Ok(guest)) = tokio::join!(client_upgrade, guest_upgrade) {
                let _ =
                    tokio::io::copy_bidirectional(&mut TokioIo::new(client), &mut TokioIo::new(guest)).await;
            }
        });
    }
    let (mut parts, body) = resp.into_parts();
    // One origin for every sandbox: no guest may set cookies there (see the module's comment).
    parts.headers.remove(header::SET_COOKIE);
    Ok(Response::from_parts(parts, Body::new(body)))
}

/// A `Sec-WebSocket-Protocol` value without its `hearth.key.` entries (`None` when nothing is left).
fn without_key_protocols(value: &HeaderValue) -> Option<HeaderValue> {
    let text = value.to_str().ok()?;
    let kept: Vec<&str> = text
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty() && !p.starts_with(crate::tenancy::KEY_PROTOCOL_PREFIX))
        .collect();
    if kept.is_empty() {
        return None;
    }
    HeaderValue::from_str(&kept.join(", ")).ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_offered_as_subprotocols_do_not_reach_the_guest() {
        use axum::http::HeaderValue;
        let v = HeaderValue::from_static("chat, hearth.key.hk_secret,v2");
        assert_eq!(
            super::without_key_protocols(&v),
            Some(HeaderValue::from_static("chat, v2"))
        );
        let v = HeaderValue::from_static("hearth.key.ht1.x");
        assert_eq!(super::without_key_protocols(&v), None);
    }

    #[test]
    fn port_paths_split() {
        assert_eq!(
            super::split_path("/v1/sandboxes/sbx_1/ports/8080/a/b"),
            Some(("sbx_1".to_string(), "8080", "/a/b".to_string()))
        );
        assert_eq!(
            super::split_path("/v1/sandboxes/sbx_1/ports/8080"),
            Some(("sbx_1".to_string(), "8080", "/".to_string()))
        );
        assert_eq!(super::split_path("/v1/sandboxes/sbx_1/files"), None);
    }
}
