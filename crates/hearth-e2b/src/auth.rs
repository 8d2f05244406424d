//! Which header carries the caller's hearth key, and who an envd request runs as.
//!
//! - Control plane: the SDKs send `X-API-KEY: <key>` (`E2B_API_KEY`); `Authorization: Bearer <key>` (E2B's
//!   access tokens, and hearth's own header) is accepted too.
//! - envd: the SDKs send `X-Access-Token: <envdAccessToken>`, which the control plane answered with the
//!   caller's own key, so it is that key; `X-API-KEY` and a Bearer `Authorization` are accepted as well for
//!   other clients. `Authorization: Basic base64(user:)` is not a credential there but the user the SDK asks to
//!   run as ([`envd_user`]).
//!
//! The adapter never checks a key itself: it forwards it, and the daemon's API decides.

use axum::http::HeaderMap;
use base64::Engine;

const API_KEY: &str = "x-api-key";
const ACCESS_TOKEN: &str = "x-access-token";

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let (scheme, token) = header(headers, "authorization")?.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The key of a control-plane request.
pub fn control_key(headers: &HeaderMap) -> Option<&str> {
    header(headers, API_KEY).or_else(|| bearer(headers))
}

/// The key of an envd request.
pub fn envd_key(headers: &HeaderMap) -> Option<&str> {
    header(headers, ACCESS_TOKEN)
        .or_else(|| header(headers, API_KEY))
        .or_else(|| bearer(headers))
}

/// The user an envd request asks for (`Authorization: Basic base64("user:")`), if any.
pub fn envd_user(headers: &HeaderMap) -> Option<String> {
    let (scheme, value) = header(headers, "authorization")?.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(value.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let user = text.split(':').next().unwrap_or("");
    (!user.is_empty()).then(|| user.to_owned())
}

/// The home directory relative paths resolve against (envd resolves them against the user's home). hearth
/// runs every command and file operation as root, whatever user the SDK names, so that is root's home.
pub const HOME: &str = "/root";

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn h(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut m = HeaderMap::new();
        for (k, v) in pairs {
            m.insert(*k, HeaderValue::from_static(v));
        }
        m
    }

    #[test]
    fn keys_come_from_the_e2b_headers_then_bearer() {
        assert_eq!(control_key(&h(&[("x-api-key", "hk_1")])), Some("hk_1"));
        assert_eq!(control_key(&h(&[("authorization", "Bearer hk_2")])), Some("hk_2"));
        assert_eq!(control_key(&h(&[("authorization", "Basic dXNlcjo=")])), None);
        assert_eq!(control_key(&h(&[("x-api-key", "  ")])), None);
        assert_eq!(
            envd_key(&h(&[
                ("x-access-token", "hk_3"),
                ("authorization", "Basic dXNlcjo=")
            ])),
            Some("hk_3")
        );
        assert_eq!(envd_key(&h(&[("x-api-key", "hk_4")])), Some("hk_4"));
        assert_eq!(envd_key(&HeaderMap::new()), None);
    }

    #[test]
    fn basic_auth_names_the_user() {
        // base64("user:") and base64("root:")
        assert_eq!(
            envd_user(&h(&[("authorization", "Basic dXNlcjo=")])).as_deref(),
            Some("user")
        );
        assert_eq!(
            envd_user(&h(&[("authorization", "Basic cm9vdDo=")])).as_deref(),
            Some("root")
        );
        assert_eq!(envd_user(&h(&[("authorization", "Basic !!!")])), None);
        assert_eq!(envd_user(&h(&[("authorization", "Bearer x")])), None);
    }
}
