//! The API error response and the extractors that turn every kind of bad input into one.
//!
//! Handlers never see axum's own rejections: JSON problems become `invalid_json`, bodies over the limit
//! `payload_too_large`, bad query strings `invalid_argument`, and malformed ids `not_found` (an id that cannot
//! exist is indistinguishable from one that does not).

use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, FromRequestParts, Query, RawPathParams, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use hearth_api::{ErrorBody, ErrorCode, ErrorDetail};
use serde::de::DeserializeOwned;

use crate::service::ServiceError;

/// An error as the API serves it: a status derived from the code, and an [`ErrorBody`].
#[derive(Debug)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = ErrorBody {
            error: ErrorDetail {
                code: self.code,
                message: self.message,
            },
        };
        (status, axum::Json(body)).into_response()
    }
}

impl From<ServiceError> for ApiError {
    fn from(e: ServiceError) -> Self {
        ApiError::new(e.code(), e.to_string())
    }
}

fn too_large(limit_hint: &str) -> ApiError {
    ApiError::new(
        ErrorCode::PayloadTooLarge,
        format!("request body is larger than {limit_hint}"),
    )
}

/// A JSON object body (`Content-Type: application/json`, at most the route's limit, no unknown fields).
pub struct ApiJson<T>(pub T);

fn invalid_json(message: impl Into<String>) -> ApiError {
    ApiError::new(ErrorCode::InvalidJson, message)
}

fn is_json(headers: &axum::http::HeaderMap) -> bool {
    let Some(ct) = headers
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let mime = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    mime == "application/json" || (mime.starts_with("application/") && mime.ends_with("+json"))
}

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(req.headers()) {
            return Err(invalid_json("expected Content-Type: application/json"));
        }
        let bytes = match Bytes::from_request(req, state).await {
            Ok(b) => b,
            Err(rej) if rej.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                return Err(too_large("the limit of this route (1 MiB)"));
            }
            Err(rej) => return Err(invalid_json(rej.body_text())),
        };
        // serde would also accept a struct written as an array: only objects are requests.
        if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
            return Err(invalid_json("expected a JSON object"));
        }
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| invalid_json(format!("invalid request body: {e}")))
    }
}

/// [`ApiJson`] for bodies that carry a secret: a decoding error never quotes a value (serde quotes the value of
/// a wrong type or variant), only where and what kind of problem it is.
pub struct SecretJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for SecretJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match ApiJson::<serde_json::Value>::from_request(req, state).await {
            Ok(ApiJson(v)) => serde_json::from_value(v).map(SecretJson).map_err(|e| {
                let text = e.to_string();
                if text.contains("invalid type") || text.contains("invalid value") {
                    invalid_json("invalid request body: a field has the wrong type or value (see the schema)")
                } else {
                    invalid_json(format!("invalid request body: {text}"))
                }
            }),
            Err(e) if e.code == ErrorCode::InvalidJson => {
                Err(invalid_json("invalid request body: not a JSON object"))
            }
            Err(e) => Err(e),
        }
    }
}

/// Like [`ApiJson`], but an empty body (with or without a content type) means `T::default()`.
pub struct OptionalJson<T>(pub T);

impl<T: DeserializeOwned + Default, S: Send + Sync> FromRequest<S> for OptionalJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        // Exact only when the length is known (Content-Length, or a body built in memory).
        if axum::body::HttpBody::size_hint(req.body()).exact() == Some(0) {
            return Ok(OptionalJson(T::default()));
        }
        ApiJson::<T>::from_request(req, state)
            .await
            .map(|ApiJson(v)| OptionalJson(v))
    }
}

/// A raw body of at most the route's limit.
pub struct RawBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for RawBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Bytes::from_request(req, state).await {
            Ok(b) => Ok(RawBody(b)),
            Err(rej) => Err(bytes_rejection(rej)),
        }
    }
}

fn bytes_rejection(rej: BytesRejection) -> ApiError {
    if rej.status() == StatusCode::PAYLOAD_TOO_LARGE {
        too_large("the limit of this route (1 MiB)")
    } else {
        ApiError::new(ErrorCode::InvalidArgument, rej.body_text())
    }
}

/// Query parameters; anything that does not parse is `invalid_argument`.
pub struct ApiQuery<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<T>::from_request_parts(parts, state).await {
            Ok(Query(v)) => Ok(ApiQuery(v)),
            Err(rej) => Err(ApiError::new(ErrorCode::InvalidArgument, rej.body_text())),
        }
    }
}

/// Looks up a path parameter by name (percent-decoded, UTF-8).
fn path_param(params: &RawPathParams, name: &str) -> Option<String> {
    params
        .iter()
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

fn no_sandbox() -> ApiError {
    ApiError::new(ErrorCode::NotFound, "sandbox not found")
}

/// The `{id}` of a sandbox route, checked with [`hearth_api::is_valid_sandbox_id`] before anything else.
pub struct SandboxId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for SandboxId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let params = RawPathParams::from_request_parts(parts, state)
            .await
            .map_err(|_| no_sandbox())?;
        match path_param(&params, "id") {
            Some(id) if hearth_api::is_valid_sandbox_id(&id) => Ok(SandboxId(id)),
            _ => Err(no_sandbox()),
        }
    }
}

/// The `{id}` and `{pid}` of a process route.
pub struct ProcessPath {
    pub id: String,
    pub pid: u32,
}

impl<S: Send + Sync> FromRequestParts<S> for ProcessPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let SandboxId(id) = SandboxId::from_request_parts(parts, state).await?;
        let params = RawPathParams::from_request_parts(parts, state)
            .await
            .map_err(|_| no_sandbox())?;
        let pid = path_param(&params, "pid")
            .and_then(|p| p.parse::<u32>().ok())
            .filter(|p| *p > 0)
            .ok_or_else(|| ApiError::new(ErrorCode::NotFound, "process not found"))?;
        Ok(ProcessPath { id, pid })
    }
}
