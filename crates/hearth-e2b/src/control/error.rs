//! Control-plane errors in E2B's shape: `{"code": <HTTP status>, "message": "…"}`, with the statuses the SDKs
//! turn into their typed errors (400 invalid argument, 401 authentication, 404 not found, 409 conflict,
//! 429 rate limit, 503 service busy).

use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use hearth_api::ErrorCode;

use super::wire::ErrorBody;

/// A control-plane failure: the status and the message the caller sees.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct RestError {
    pub status: u16,
    pub message: String,
}

impl RestError {
    pub fn new(status: u16, message: impl Into<String>) -> Self {
        RestError {
            status,
            message: message.into(),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    pub fn unauthorized() -> Self {
        Self::new(
            401,
            "missing API key: send your hearth API key as X-API-KEY (E2B_API_KEY)",
        )
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            code: self.status,
            message: self.message.clone(),
        }
    }
}

/// The E2B status for a hearth error code (hearth's own status when E2B has nothing better).
pub fn status_for(code: ErrorCode, hearth_status: u16) -> u16 {
    match code {
        ErrorCode::InvalidJson | ErrorCode::InvalidArgument => 400,
        ErrorCode::Unauthorized => 401,
        ErrorCode::NotFound | ErrorCode::UnknownRoute => 404,
        ErrorCode::Conflict => 409,
        ErrorCode::PayloadTooLarge => 413,
        ErrorCode::CapacityExceeded => 503,
        _ if hearth_status == 429 => 429,
        _ if (400..600).contains(&hearth_status) => hearth_status,
        _ => 500,
    }
}

impl From<hearth_client::Error> for RestError {
    fn from(e: hearth_client::Error) -> Self {
        match &e {
            hearth_client::Error::Api {
                status,
                code,
                message,
            } => RestError::new(status_for(*code, *status), message.clone()),
            hearth_client::Error::InvalidApiKey => {
                RestError::new(401, "the API key must be printable ASCII without spaces")
            }
            other => {
                tracing::warn!(error = %other, "e2b control plane: call to the daemon failed");
                RestError::new(500, "the daemon's API could not be reached")
            }
        }
    }
}

impl IntoResponse for RestError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(self.body())).into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hearth_codes_map_to_the_statuses_the_sdks_type() {
        let e = |code, status| {
            RestError::from(hearth_client::Error::Api {
                status,
                code,
                message: "m".into(),
            })
            .status
        };
        assert_eq!(e(ErrorCode::NotFound, 404), 404);
        assert_eq!(e(ErrorCode::Unauthorized, 401), 401);
        assert_eq!(e(ErrorCode::InvalidJson, 400), 400);
        assert_eq!(e(ErrorCode::Conflict, 409), 409);
        assert_eq!(e(ErrorCode::Unknown, 429), 429);
        assert_eq!(e(ErrorCode::CapacityExceeded, 503), 503);
        assert_eq!(e(ErrorCode::VmmFailed, 502), 502);
        assert_eq!(e(ErrorCode::Unknown, 200), 500);
        let body = serde_json::to_value(RestError::new(404, "no").body()).unwrap_or_default();
        assert_eq!(body, serde_json::json!({"code": 404, "message": "no"}));
    }
}
