//! How failures reach the user: `error: <message> (code: <code>)` and, where we know what to do about it, a
//! `hint:` line. Everything here goes to stderr.

use hearth_api::ErrorCode;
use hearth_client::Error as ClientError;

use crate::output::clean;

/// The message and hint lines for an error.
pub fn describe(err: &anyhow::Error, url: &str) -> (String, Option<String>) {
    let Some(client_err) = err.chain().find_map(|e| e.downcast_ref::<ClientError>()) else {
        return (clean(&format!("{err:#}")), None);
    };
    // Contexts added on the way up (e.g. "cannot copy X"), then the client error itself.
    let mut prefix = String::new();
    for e in err.chain() {
        if e.downcast_ref::<ClientError>().is_some() {
            break;
        }
        prefix.push_str(&e.to_string());
        prefix.push_str(": ");
    }
    let (message, hint) = describe_client(client_err, url);
    (clean(&format!("{prefix}{message}")), hint)
}

fn describe_client(err: &ClientError, url: &str) -> (String, Option<String>) {
    match err {
        ClientError::Api { code, message, .. } => {
            (format!("{message} (code: {})", code.as_str()), hint_for(*code))
        }
        ClientError::Transport { url: origin, source } => {
            // The innermost cause says what happened ("Connection refused"); the outer ones repeat the URL.
            let root = root_cause(source);
            let msg = format!("cannot reach hearthd at {origin}: {root}");
            let hint = if err.is_connect() {
                Some(format!(
                    "is hearthd running? start it as root with `hearthd` (it listens on 127.0.0.1:7070 by \
                     default), or point --url / HEARTH_URL at it (now {url})"
                ))
            } else if err.is_timeout() {
                Some("the daemon did not answer in time; `hearth doctor` checks the host".into())
            } else {
                None
            };
            (msg, hint)
        }
        other => {
            let mut msg = other.to_string();
            let mut source = std::error::Error::source(other);
            while let Some(s) = source {
                msg.push_str(": ");
                msg.push_str(&s.to_string());
                source = s.source();
            }
            (msg, None)
        }
    }
}

fn root_cause(err: &(dyn std::error::Error + 'static)) -> String {
    let mut last = err;
    while let Some(next) = last.source() {
        last = next;
    }
    last.to_string()
}

fn hint_for(code: ErrorCode) -> Option<String> {
    let key_path = hearth_client::default_key_path();
    Some(match code {
        ErrorCode::Unauthorized => format!(
            "unauthorized: set HEARTH_API_KEY (or --api-key) or run as a user who can read {}",
            key_path.display()
        ),
        ErrorCode::CapacityExceeded => {
            "remove sandboxes you no longer need (`hearth ls`, `hearth rm ID`) or ask for fewer vCPUs or less \
             memory"
                .into()
        }
        ErrorCode::VmmFailed | ErrorCode::AgentUnavailable => {
            "`hearth doctor` checks the host; hearthd's log has the VMM's output".into()
        }
        ErrorCode::UnknownRoute | ErrorCode::MethodNotAllowed => {
            "the daemon does not know this request: are hearth and hearthd the same version?".into()
        }
        _ => return None,
    })
}

/// Prints the error to stderr.
pub fn print(err: &anyhow::Error, url: &str) {
    let (message, hint) = describe(err, url);
    eprintln!("error: {message}");
    if let Some(hint) = hint {
        eprintln!("hint: {hint}");
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn api_errors_show_the_code_and_context() {
        let err = anyhow::Error::new(ClientError::Api {
            status: 404,
            code: ErrorCode::NotFound,
            message: "no sandbox sbx_0123456789abcdef".into(),
        })
        .context("cannot download /x");
        let (msg, hint) = describe(&err, "http://127.0.0.1:7070");
        assert_eq!(
            msg,
            "cannot download /x: no sandbox sbx_0123456789abcdef (code: not_found)"
        );
        assert_eq!(hint, None);
    }

    #[test]
    fn unauthorized_says_where_the_key_comes_from() {
        let err = anyhow::Error::new(ClientError::Api {
            status: 401,
            code: ErrorCode::Unauthorized,
            message: "missing or wrong API key".into(),
        });
        let (msg, hint) = describe(&err, "u");
        assert!(msg.contains("unauthorized"));
        assert!(hint.unwrap().contains("HEARTH_API_KEY"));
    }

    #[test]
    fn messages_cannot_carry_terminal_escapes() {
        let err = anyhow::Error::new(ClientError::Api {
            status: 422,
            code: ErrorCode::GuestError,
            message: "bad\x1b]0;owned\x07".into(),
        });
        let (msg, _) = describe(&err, "u");
        assert!(!msg.contains('\x1b') && !msg.contains('\x07'), "{msg}");
    }

    #[test]
    fn plain_errors_pass_through() {
        let err = anyhow::anyhow!("local file missing").context("cannot copy");
        assert_eq!(describe(&err, "u").0, "cannot copy: local file missing");
    }
}
