//! Short-lived access tokens for browsers and WebSocket clients (`POST /v1/tokens`).
//!
//! A token is `ht1.<key id>.<project>.<role>.<scope>.<purpose>.<expiry ms>.<hmac>`: the claims in the clear,
//! then their HMAC-SHA256 (the helper that signs port tokens) under the daemon's own 32-byte key
//! (`<data-dir>/access-tokens.key`, mode 0600, made on first use). Every field is made of letters, digits, `_`
//! and `-`, so a token fits a `Sec-WebSocket-Protocol` entry. The scope is `project` or a sandbox id. A token is
//! presented exactly like a key (header or WebSocket subprotocol, never in a URL); on each use the minting key
//! is looked up again, so revoking it ends its tokens at once.

use hearth_api::{Role, TokenPurpose};

use crate::service::network::sign_claims;

/// What every token starts with (and no key does).
pub const TOKEN_PREFIX: &str = "ht1.";
/// Default and largest lifetime of a token.
pub const DEFAULT_TTL_S: u64 = 300;
pub const MAX_TTL_S: u64 = 3600;

/// The claims of an access token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claims {
    /// The key that minted it (the audit log names it).
    pub key_id: String,
    pub project: String,
    pub role: Role,
    /// `None`: the whole project; `Some(id)`: that sandbox only.
    pub sandbox: Option<String>,
    pub purpose: TokenPurpose,
    pub expires_ms: i64,
}

/// Why a presented token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bad {
    /// Not a token of this daemon (malformed, or a signature that does not match).
    Invalid,
    Expired,
}

const PROJECT_SCOPE: &str = "project";

impl Claims {
    fn body(&self) -> String {
        format!(
            "{TOKEN_PREFIX}{}.{}.{}.{}.{}.{}",
            self.key_id,
            self.project,
            self.role.as_str(),
            self.sandbox.as_deref().unwrap_or(PROJECT_SCOPE),
            self.purpose.as_str(),
            self.expires_ms
        )
    }

    /// The signed token.
    pub fn sign(&self, key: &[u8; 32]) -> String {
        let body = self.body();
        let mac = sign_claims(key, &body);
        format!("{body}.{mac}")
    }

    /// Checks the signature (constant time) and the expiry at `now_ms`.
    pub fn verify(token: &str, key: &[u8; 32], now_ms: i64) -> Result<Claims, Bad> {
        use subtle::ConstantTimeEq;
        let (body, mac) = token.rsplit_once('.').ok_or(Bad::Invalid)?;
        let want = sign_claims(key, body);
        if !bool::from(want.as_bytes().ct_eq(mac.as_bytes())) {
            return Err(Bad::Invalid);
        }
        let claims = Claims::parse(body).ok_or(Bad::Invalid)?;
        if claims.expires_ms <= now_ms {
            return Err(Bad::Expired);
        }
        Ok(claims)
    }

    fn parse(body: &str) -> Option<Claims> {
        let rest = body.strip_prefix(TOKEN_PREFIX)?;
        let f: Vec<&str> = rest.split('.').collect();
        let [key_id, project, role, scope, purpose, expires] = f.as_slice() else {
            return None;
        };
        Some(Claims {
            key_id: key_id.to_string(),
            project: project.to_string(),
            role: Role::parse(role)?,
            sandbox: (*scope != PROJECT_SCOPE).then(|| scope.to_string()),
            purpose: TokenPurpose::parse(purpose)?,
            expires_ms: expires.parse().ok()?,
        })
    }
}

/// Whether a presented credential is a token (else it is a key).
pub fn is_token(presented: &str) -> bool {
    presented.starts_with(TOKEN_PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims() -> Claims {
        Claims {
            key_id: "key_0123456789abcdef".into(),
            project: "team-a".into(),
            role: Role::Member,
            sandbox: Some("sbx_0123456789abcdef".into()),
            purpose: TokenPurpose::Mcp,
            expires_ms: 2_000,
        }
    }

    #[test]
    fn tokens_round_trip_and_refuse_tampering() {
        let key = [7u8; 32];
        let t = claims().sign(&key);
        assert!(is_token(&t));
        assert_eq!(Claims::verify(&t, &key, 1_000), Ok(claims()));
        assert_eq!(Claims::verify(&t, &key, 2_000), Err(Bad::Expired));
        assert_eq!(Claims::verify(&t, &[8u8; 32], 1_000), Err(Bad::Invalid));
        let wider = t.replace(".sbx_0123456789abcdef.", ".project.");
        assert_eq!(Claims::verify(&wider, &key, 1_000), Err(Bad::Invalid));
        let admin = t.replace(".member.", ".admin.");
        assert_eq!(Claims::verify(&admin, &key, 1_000), Err(Bad::Invalid));
        let mut project = claims();
        project.sandbox = None;
        let t = project.sign(&key);
        assert!(t.contains(".project.mcp."));
        assert_eq!(Claims::verify(&t, &key, 0), Ok(project));
        assert!(
            t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)),
            "a token fits a WebSocket subprotocol entry"
        );
    }
}
