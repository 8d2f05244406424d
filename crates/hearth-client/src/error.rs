use hearth_api::{ErrorBody, ErrorCode};

/// Everything a client call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The daemon answered with a non-2xx status and (usually) an [`ErrorBody`].
    #[error("{message}")]
    Api {
        status: u16,
        code: ErrorCode,
        message: String,
    },
    /// The request never got an answer: connection refused, reset, DNS, timeout.
    #[error("cannot reach hearthd at {url}")]
    Transport {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// The daemon answered, but the body is not what the API promises.
    #[error("unexpected response from hearthd: {0}")]
    Decode(String),
    /// Reading or writing a local file or stream failed.
    #[error("local I/O failed")]
    Io(#[from] std::io::Error),
    /// The API key contains characters an HTTP header cannot carry (whitespace, control or non-ASCII).
    #[error("the API key must be printable ASCII without spaces")]
    InvalidApiKey,
    /// An interactive terminal's connection failed or closed before the program's exit.
    #[error("terminal connection: {0}")]
    Terminal(String),
    /// The base URL given to the client is not a usable http(s) URL.
    #[error("invalid hearthd URL {url:?}: {reason}")]
    InvalidUrl { url: String, reason: String },
}

impl Error {
    /// The API error code, if the daemon sent one.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Error::Api { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// The HTTP status, if the daemon answered at all.
    pub fn status(&self) -> Option<u16> {
        match self {
            Error::Api { status, .. } => Some(*status),
            _ => None,
        }
    }

    /// True when nothing listens at the daemon's address (connection refused or no route).
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Transport { source, .. } if source.is_connect())
    }

    /// True when the request timed out before an answer.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Transport { source, .. } if source.is_timeout())
    }

    pub(crate) fn transport(url: &reqwest::Url, source: reqwest::Error) -> Self {
        Error::Transport {
            url: origin(url),
            source,
        }
    }

    /// Builds the error for a non-2xx answer from its status and (possibly non-JSON) body.
    pub(crate) fn from_response_body(status: u16, body: &[u8]) -> Self {
        if let Ok(parsed) = serde_json::from_slice::<ErrorBody>(body) {
            return Error::Api {
                status,
                code: parsed.error.code,
                message: parsed.error.message,
            };
        }
        // Not our error body (a proxy, an old daemon, a panic page): keep a short, printable excerpt.
        let text = String::from_utf8_lossy(&body[..body.len().min(MAX_EXCERPT)]);
        let text = text.trim();
        let message = if text.is_empty() {
            format!("HTTP {status}")
        } else {
            format!("HTTP {status}: {}", text.escape_debug())
        };
        Error::Api {
            status,
            code: code_for_status(status),
            message,
        }
    }
}

/// Longest part of a foreign (non-[`ErrorBody`]) error body kept in a message.
const MAX_EXCERPT: usize = 200;

/// Best guess of a code for a status when the body does not say.
fn code_for_status(status: u16) -> ErrorCode {
    match status {
        400 => ErrorCode::InvalidArgument,
        401 | 403 => ErrorCode::Unauthorized,
        404 => ErrorCode::NotFound,
        405 => ErrorCode::MethodNotAllowed,
        409 => ErrorCode::Conflict,
        413 => ErrorCode::PayloadTooLarge,
        _ => ErrorCode::Unknown,
    }
}

/// `scheme://host:port` of a URL: enough to say where we tried, without paths or queries.
fn origin(url: &reqwest::Url) -> String {
    url.origin().ascii_serialization()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn api_error_body_is_parsed() {
        let body = br#"{"error":{"code":"not_found","message":"no sandbox sbx_0123456789abcdef"}}"#;
        let err = Error::from_response_body(404, body);
        assert_eq!(err.code(), Some(ErrorCode::NotFound));
        assert_eq!(err.status(), Some(404));
        assert_eq!(err.to_string(), "no sandbox sbx_0123456789abcdef");
    }

    #[test]
    fn foreign_body_keeps_a_short_excerpt_and_guesses_the_code() {
        let body = vec![b'x'; 10_000];
        let err = Error::from_response_body(401, &body);
        assert_eq!(err.code(), Some(ErrorCode::Unauthorized));
        assert!(err.to_string().len() < 300, "{}", err);

        let err = Error::from_response_body(502, b"");
        assert_eq!(err.code(), Some(ErrorCode::Unknown));
        assert_eq!(err.to_string(), "HTTP 502");

        let err = Error::from_response_body(500, b"bad\x1b[31m\n");
        assert!(!err.to_string().contains('\x1b'), "control bytes are escaped");
    }
}
