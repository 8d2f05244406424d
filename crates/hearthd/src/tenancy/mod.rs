//! Many users on one host: who a request is ([`Principal`], from its key), where it may come from (`Host` and
//! `Origin`), what its project may still start
//! ([`crate::service::quota`]), and the middleware that applies all of it and writes
//! the audit log ([`guard`]). Which objects a route touches and who owns them is in [`objects`].
//!
//! Keys: the installer's key file stays the bootstrap key (id `bootstrap`, role admin, project `default`,
//! checked against the hash in `api_key`); every other key is a row of `api_keys` found by the SHA-256 of the
//! presented key. Keys are accepted only in headers: `Authorization: Bearer <key>`, or on WebSocket upgrades the
//! subprotocol entry `hearth.key.<key>` (browsers cannot set headers on WebSockets); never in a URL.
//!
//! Access tokens ([`token`], `POST /v1/tokens`) are presented the same way and become a [`Principal`] of their
//! minting key, narrowed to the token's role, scope (the project or one sandbox) and purpose ([`TokenLimits`],
//! enforced by [`guard`]).

pub mod guard;
pub mod objects;
pub mod ratelimit;
pub mod token;

use std::sync::Arc;

use axum::http::{HeaderMap, header};
use hearth_api::{DEFAULT_PROJECT, ErrorCode, Role, TokenPurpose};

use crate::auth::{KeyCheck, hash_key};
use crate::http::error::ApiError;
use crate::service::{Sandboxes, now_ms};

/// The id of the installer's key.
pub const BOOTSTRAP_KEY_ID: &str = "bootstrap";
/// Subprotocol prefix presenting a key on a WebSocket upgrade.
pub const KEY_PROTOCOL_PREFIX: &str = "hearth.key.";

/// Who is asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    pub key_id: String,
    pub project: String,
    pub role: Role,
    /// Set when the request presented an access token (then `key_id` is the key that minted it).
    pub token: Option<TokenLimits>,
}

/// What an access token narrows its minting key to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenLimits {
    /// `Some(id)`: that sandbox only.
    pub sandbox: Option<String>,
    pub purpose: TokenPurpose,
    pub expires_ms: i64,
}

impl Principal {
    pub fn is_admin(&self) -> bool {
        self.role == Role::Admin
    }
}

/// Why a key was refused (never which part of the key was wrong).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Unknown,
    Revoked,
    Expired,
}

impl Refusal {
    pub fn message(self) -> &'static str {
        match self {
            Refusal::Missing => "missing API key (Authorization: Bearer <key>)",
            Refusal::Unknown => "wrong API key",
            Refusal::Revoked => "this API key was revoked",
            Refusal::Expired => "this API key has expired",
        }
    }
}

/// Settings of [`Tenancy`].
#[derive(Debug, Clone, Default)]
pub struct TenancySettings {
    /// Origins (`scheme://host[:port]`) allowed besides local ones (`--cors-origin`).
    pub cors_origins: Vec<String>,
    /// Host names allowed in `Host` besides local names and IP literals (`--allowed-host`).
    pub allowed_hosts: Vec<String>,
    /// Requests per second per key (burst: twice that); 0: unlimited (`--key-rate-limit`).
    pub key_rate_limit: u32,
}

/// Keys, ownership, quotas: shared by the API's middleware and the routes that authorise themselves.
pub struct Tenancy {
    pub(crate) sandboxes: Arc<Sandboxes>,
    bootstrap: KeyCheck,
    settings: TenancySettings,
    pub(crate) rate: Option<ratelimit::RateLimiter>,
    /// The key access tokens are signed with (read or made on first use).
    token_key: std::sync::OnceLock<[u8; 32]>,
}

impl std::fmt::Debug for Tenancy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tenancy(..)")
    }
}

impl Tenancy {
    pub fn new(sandboxes: Arc<Sandboxes>, bootstrap: KeyCheck, settings: TenancySettings) -> Arc<Tenancy> {
        Arc::new(Tenancy {
            sandboxes,
            bootstrap,
            rate: ratelimit::RateLimiter::new(settings.key_rate_limit),
            settings,
            token_key: std::sync::OnceLock::new(),
        })
    }

    pub(crate) fn db(&self) -> &crate::db::Db {
        self.sandboxes.db()
    }

    /// Resolves the key a request presents.
    pub fn authenticate(&self, headers: &HeaderMap) -> Result<Principal, Refusal> {
        let key = presented_key(headers).ok_or(Refusal::Missing)?;
        if token::is_token(&key) {
            return self.authenticate_token(&key);
        }
        if self.bootstrap.verify(&key) {
            return Ok(Principal {
                key_id: BOOTSTRAP_KEY_ID.into(),
                project: DEFAULT_PROJECT.into(),
                role: Role::Admin,
                token: None,
            });
        }
        let row = match self.db().key_by_hash(&hash_key(&key)) {
            Ok(Some(row)) => row,
            Ok(None) => return Err(Refusal::Unknown),
            Err(e) => {
                tracing::error!(error = %e, "reading api keys");
                return Err(Refusal::Unknown);
            }
        };
        let now = now_ms();
        if row.revoked_at_ms.is_some() {
            return Err(Refusal::Revoked);
        }
        if row.expires_at_ms.is_some_and(|t| t <= now) {
            return Err(Refusal::Expired);
        }
        if let Err(e) = self.db().touch_key(&row.id, now) {
            tracing::warn!(error = %e, "recording a key's last use");
        }
        Ok(Principal {
            key_id: row.id,
            project: row.project,
            role: row.role,
            token: None,
        })
    }

    /// The daemon's token key (`<data-dir>/access-tokens.key`).
    fn token_key(&self) -> Result<[u8; 32], ApiError> {
        if let Some(k) = self.token_key.get() {
            return Ok(*k);
        }
        let path = self.sandboxes.settings().paths.data_dir.join("access-tokens.key");
        let k = crate::service::network::load_key_file(&path)
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("access token key: {e}")))?;
        Ok(*self.token_key.get_or_init(|| k))
    }

    /// Signs an access token for `claims`.
    pub fn mint(&self, claims: &token::Claims) -> Result<String, ApiError> {
        Ok(claims.sign(&self.token_key()?))
    }

    /// A token's principal: its signature and expiry, then its minting key, which must still be valid.
    fn authenticate_token(&self, presented: &str) -> Result<Principal, Refusal> {
        let key = self.token_key().map_err(|e| {
            tracing::error!(error = %e.message, "reading the access token key");
            Refusal::Unknown
        })?;
        let claims = match token::Claims::verify(presented, &key, now_ms()) {
            Ok(c) => c,
            Err(token::Bad::Invalid) => return Err(Refusal::Unknown),
            Err(token::Bad::Expired) => return Err(Refusal::Expired),
        };
        if claims.key_id != BOOTSTRAP_KEY_ID {
            let row = match self.db().key_by_id(&claims.key_id) {
                Ok(Some(row)) => row,
                Ok(None) => return Err(Refusal::Unknown),
                Err(e) => {
                    tracing::error!(error = %e, "reading api keys");
                    return Err(Refusal::Unknown);
                }
            };
            if row.revoked_at_ms.is_some() {
                return Err(Refusal::Revoked);
            }
            if row.expires_at_ms.is_some_and(|t| t <= now_ms()) {
                return Err(Refusal::Expired);
            }
            // Never more than the minting key may do now.
            if row.project != claims.project || row.role.rank() < claims.role.rank() {
                return Err(Refusal::Unknown);
            }
        }
        Ok(Principal {
            key_id: claims.key_id,
            project: claims.project,
            role: claims.role,
            token: Some(TokenLimits {
                sandbox: claims.sandbox,
                purpose: claims.purpose,
                expires_ms: claims.expires_ms,
            }),
        })
    }

    /// Whether the key in `headers` may reach sandbox `id` (exposed ports, which authorise themselves):
    /// false without a valid key, 404 (as if absent) for a key of another project.
    pub fn key_may_use_sandbox(&self, headers: &HeaderMap, id: &str) -> Result<bool, ApiError> {
        let Ok(p) = self.authenticate(headers) else {
            return Ok(false);
        };
        // A token opens ports only for the API purpose, and within its scope.
        if let Some(limits) = &p.token {
            if limits.purpose != TokenPurpose::Api {
                return Err(ApiError::new(
                    ErrorCode::Forbidden,
                    format!("a {} token does not open ports", limits.purpose.as_str()),
                ));
            }
            if limits.sandbox.as_deref().is_some_and(|s| s != id) {
                return Err(ApiError::new(ErrorCode::NotFound, "no such sandbox"));
            }
        }
        match objects::owns(self, &p, objects::Kind::Sandbox, id) {
            Ok(true) => Ok(true),
            Ok(false) => Err(ApiError::new(ErrorCode::NotFound, "no such sandbox")),
            Err(e) => Err(ApiError::new(ErrorCode::Internal, e.to_string())),
        }
    }

    /// Refuses a request whose `Host` or `Origin` is neither local nor allowed (DNS rebinding, cross-site
    /// browsers), whatever key it carries.
    pub fn check_origin(&self, headers: &HeaderMap) -> Result<(), String> {
        if let Some(host) = headers.get(header::HOST) {
            let host = host.to_str().map_err(|_| "unreadable Host header".to_string())?;
            if !self.host_allowed(host) {
                return Err(format!(
                    "Host {host:?} is neither local nor allowed (--allowed-host)"
                ));
            }
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin
                .to_str()
                .map_err(|_| "unreadable Origin header".to_string())?;
            if !self.origin_allowed(origin) {
                return Err(format!(
                    "Origin {origin:?} is neither local nor allowed (--cors-origin)"
                ));
            }
        }
        Ok(())
    }

    fn host_allowed(&self, host: &str) -> bool {
        let name = host_name(host);
        is_local_name(&name)
            || name.parse::<std::net::IpAddr>().is_ok()
            || self
                .settings
                .allowed_hosts
                .iter()
                .any(|h| h.eq_ignore_ascii_case(&name))
            || self
                .settings
                .cors_origins
                .iter()
                .any(|o| origin_host(o).is_some_and(|h| h.eq_ignore_ascii_case(&name)))
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        let origin = origin.trim_end_matches('/');
        if self
            .settings
            .cors_origins
            .iter()
            .any(|o| o.trim_end_matches('/').eq_ignore_ascii_case(origin))
        {
            return true;
        }
        let local_scheme = origin.starts_with("http://") || origin.starts_with("https://");
        local_scheme && origin_host(origin).is_some_and(|h| is_local_name(&h))
    }
}

/// The key in `Authorization: Bearer`, or in a `hearth.key.<key>` subprotocol entry of a WebSocket upgrade.
pub fn presented_key(headers: &HeaderMap) -> Option<String> {
    if let Some(v) = headers.get(header::AUTHORIZATION) {
        let v = v.to_str().ok()?;
        let (scheme, key) = v.split_once(' ')?;
        return scheme
            .eq_ignore_ascii_case("bearer")
            .then(|| key.trim().to_string());
    }
    let upgrade = headers
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"));
    if !upgrade {
        return None;
    }
    headers
        .get_all(header::SEC_WEBSOCKET_PROTOCOL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .find_map(|p| p.trim().strip_prefix(KEY_PROTOCOL_PREFIX).map(str::to_string))
}

impl Tenancy {
    /// CORS for the `--cors-origin` origins (none configured: no CORS answers at all, as before). Preflights
    /// are answered without a key; the actual requests still need one in `Authorization`.
    pub fn cors_layer(&self) -> Option<tower_http::cors::CorsLayer> {
        use axum::http::{HeaderName, HeaderValue, Method};
        let origins: Vec<HeaderValue> = self
            .settings
            .cors_origins
            .iter()
            .filter_map(|o| HeaderValue::from_str(o.trim_end_matches('/')).ok())
            .collect();
        if origins.is_empty() {
            return None;
        }
        let headers = [
            "authorization",
            "content-type",
            "mcp-session-id",
            "mcp-protocol-version",
            "last-event-id",
        ]
        .map(HeaderName::from_static);
        Some(
            tower_http::cors::CorsLayer::new()
                .allow_origin(origins)
                .allow_methods([
                    Method::GET,
                    Method::POST,
                    Method::PUT,
                    Method::PATCH,
                    Method::DELETE,
                ])
                .allow_headers(headers)
                .expose_headers([
                    HeaderName::from_static("x-request-id"),
                    HeaderName::from_static("mcp-session-id"),
                ])
                .max_age(std::time::Duration::from_secs(600)),
        )
    }
}

/// `host[:port]` or `[v6]:port` → the lowercase host name (brackets kept off).
fn host_name(host: &str) -> String {
    let host = host.trim();
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, port)| {
            if port.bytes().all(|b| b.is_ascii_digit()) {
                h
            } else {
                host
            }
        })
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn origin_host(origin: &str) -> Option<String> {
    let rest = origin.split_once("://")?.1;
    let authority = rest.split('/').next()?;
    Some(host_name(authority))
}

fn is_local_name(name: &str) -> bool {
    name == "localhost"
        || name.ends_with(".localhost")
        || name.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A fresh request id (`req_` and 16 hex digits).
pub fn new_request_id() -> String {
    use rand::RngCore;
    let mut b = [0u8; 8];
    rand::rng().fill_bytes(&mut b);
    format!("req_{}", hex::encode(b))
}

/// A fresh key id (`key_` and 16 hex digits).
pub fn new_key_id() -> String {
    use rand::RngCore;
    let mut b = [0u8; 8];
    rand::rng().fill_bytes(&mut b);
    format!("key_{}", hex::encode(b))
}

/// A project name: the same rule as template names (1-63 of `[a-z0-9-]`, starting with a letter or digit).
pub fn is_valid_project_name(name: &str) -> bool {
    hearth_api::is_valid_template_name(name)
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn host_and_origin_names() {
        assert_eq!(host_name("LocalHost:8080"), "localhost");
        assert_eq!(host_name("[::1]:80"), "::1");
        assert_eq!(host_name("evil.example."), "evil.example");
        assert!(is_local_name("127.0.0.1"));
        assert!(is_local_name("a.localhost"));
        assert!(!is_local_name("localhost.evil.example"));
        assert_eq!(origin_host("http://127.0.0.1:9").as_deref(), Some("127.0.0.1"));
        assert!(is_valid_project_name("team-a"));
        assert!(!is_valid_project_name("-a"));
        assert!(!is_valid_project_name("A"));
    }

    #[test]
    fn keys_come_only_from_headers() {
        let mut h = HeaderMap::new();
        assert_eq!(presented_key(&h), None);
        h.insert(
            header::SEC_WEBSOCKET_PROTOCOL,
            HeaderValue::from_static("hearth.pty.v1, hearth.key.hk_a"),
        );
        assert_eq!(
            presented_key(&h),
            None,
            "the subprotocol counts only on WebSocket upgrades"
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        assert_eq!(presented_key(&h).as_deref(), Some("hk_a"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer hk_b"));
        assert_eq!(presented_key(&h).as_deref(), Some("hk_b"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic hk_b"));
        assert_eq!(presented_key(&h), None);
    }
}
