//! Projects, scoped API keys, per-project quotas and the tamper-evident audit log.
//!
//! Every object (sandbox, snapshot, template, network, bucket, and the ports a sandbox exposes) belongs to one
//! project. A key belongs to a project and carries a [`Role`]. The audit log is a hash chain: each entry's
//! `hash` covers its fields and the previous entry's hash ([`audit_hash`]); [`verify_audit_chain`] checks it.

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The project of the installer's bootstrap key and of every object that existed before projects.
pub const DEFAULT_PROJECT: &str = "default";

/// What a key may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Everything, in every project: projects, keys, quotas, the audit log.
    Admin,
    /// Create and manage the objects of its own project.
    Member,
    /// Read its own project's objects; change nothing.
    Viewer,
}

impl Role {
    /// How much a role may do (viewer 0, member 1, admin 2): a token's role is at most its minter's.
    pub fn rank(self) -> u8 {
        match self {
            Role::Viewer => 0,
            Role::Member => 1,
            Role::Admin => 2,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Member => "member",
            Role::Viewer => "viewer",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "member" => Some(Role::Member),
            "viewer" => Some(Role::Viewer),
            _ => None,
        }
    }
}

/// Limits of one project; an absent field is unlimited.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Quota {
    /// Sandboxes not paused or stopped (creating, running, resuming) at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_running: Option<u32>,
    /// Total vCPUs of those sandboxes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_vcpus: Option<u32>,
    /// Total memory of those sandboxes, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_memory_mib: Option<u64>,
    /// Sandboxes created (or forked) per rolling minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_creates_per_minute: Option<u32>,
    /// Seconds a sandbox may exist (running or paused) from its create; an older one is destroyed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lifetime_s: Option<u64>,
    /// Credits the project may spend in all (running vCPU-seconds and GiB-seconds at the daemon's prices,
    /// `--credits-per-vcpu-second`, `--credits-per-gib-second`). Once spent, the project's running sandboxes
    /// are paused (nothing is lost) and creates, forks and resumes are refused until it is raised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_credits: Option<u64>,
    /// Bytes on the host's disk of the project's sandbox disks, paused states, snapshots and saved templates
    /// (blocks actually used, shared ones once). At or over it, creates, forks, snapshots and template saves
    /// are refused; what exists keeps working (a running sandbox's disk may still grow, up to its own size).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_disk_bytes: Option<u64>,
}

/// Body of `POST /v1/projects`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateProjectRequest {
    /// 1-63 characters of `[a-z0-9-]`, starting with a letter or digit.
    pub name: String,
    #[serde(default)]
    pub quota: Quota,
}

/// A project.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct Project {
    pub name: String,
    /// RFC 3339.
    pub created_at: String,
    pub quota: Quota,
}

/// Answer of `GET /v1/projects/{name}/usage`: what the project holds against its quota.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ProjectUsage {
    pub project: String,
    pub quota: Quota,
    /// Sandboxes creating, running, pausing or resuming.
    pub running: u64,
    pub vcpus: u64,
    pub memory_mib: u64,
    /// Credits spent by the project's sandboxes so far (compare `quota.budget_credits`).
    pub spent_credits: f64,
    /// Bytes on the host's disk of the project's sandboxes, snapshots and saved templates (compare
    /// `quota.max_disk_bytes`).
    #[serde(default)]
    pub disk_bytes: u64,
}

/// Answer of `GET /v1/projects`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ProjectList {
    pub projects: Vec<Project>,
}

/// Body of `POST /v1/keys`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateKeyRequest {
    pub project: String,
    pub role: Role,
    /// Seconds from now until the key stops working; none: it does not expire.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_in_s: Option<u64>,
    /// A label for people (1-100 printable characters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// An API key as listed: never the key itself.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct ApiKeyInfo {
    /// `key_` and 16 hex digits; `bootstrap` for the installer's key.
    pub id: String,
    pub project: String,
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub created_at: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_used_at: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revoked_at: Option<String>,
}

/// Answer of `POST /v1/keys`: the only time the key is shown.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct CreatedKey {
    pub id: String,
    /// The secret (`hk_` and 64 hex digits). Stored only as a hash: keep it now.
    pub key: String,
    pub project: String,
    pub role: Role,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

/// What an access token reaches: the minting key's whole project, or one of its sandboxes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TokenScope {
    /// Every object of the project (as the minting key).
    Project,
    /// One sandbox (by id): other sandboxes answer 404, routes about no sandbox 403.
    Sandbox(String),
}

/// Which routes an access token reaches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum TokenPurpose {
    /// The `/v1` routes (and exposed ports).
    Api,
    /// `/mcp` only.
    Mcp,
    /// The terminal route `/v1/sandboxes/{id}/pty` only.
    Pty,
}

impl TokenPurpose {
    pub fn as_str(self) -> &'static str {
        match self {
            TokenPurpose::Api => "api",
            TokenPurpose::Mcp => "mcp",
            TokenPurpose::Pty => "pty",
        }
    }

    pub fn parse(s: &str) -> Option<TokenPurpose> {
        match s {
            "api" => Some(TokenPurpose::Api),
            "mcp" => Some(TokenPurpose::Mcp),
            "pty" => Some(TokenPurpose::Pty),
            _ => None,
        }
    }
}

/// Body of `POST /v1/tokens`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateTokenRequest {
    pub scope: TokenScope,
    pub purpose: TokenPurpose,
    /// Seconds the token stays valid (1-3600). Default 300.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_s: Option<u64>,
    /// At most the minting key's role (the default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
}

/// Answer of `POST /v1/tokens`: a short-lived token signed by the daemon, presented like a key (header or
/// WebSocket subprotocol, never in a URL).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct CreatedToken {
    pub token: String,
    pub expires_at: String,
}

/// Answer of `GET /v1/keys`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct KeyList {
    pub keys: Vec<ApiKeyInfo>,
}

/// One audit log entry. `hash` = SHA-256 over the fields and `prev_hash` ([`audit_hash`]).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct AuditEntry {
    /// Position in the log, from 1, without gaps.
    pub seq: u64,
    /// Unix milliseconds.
    pub at_ms: i64,
    /// The key's id; empty when authentication was refused.
    pub key_id: String,
    pub project: String,
    /// `admin`, `member`, `viewer`, or empty when authentication was refused.
    pub role: String,
    /// Method and route pattern, e.g. `DELETE /v1/sandboxes/{id}`.
    pub action: String,
    /// The path as requested.
    pub target: String,
    /// The HTTP status of the answer.
    pub status: u16,
    /// The client's address.
    pub source: String,
    /// The `x-request-id` of the answer.
    pub request_id: String,
    /// The hash of the entry before (64 zeros for the first).
    pub prev_hash: String,
    pub hash: String,
}

/// Answer of `GET /v1/audit`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "schema", derive(utoipa::ToSchema))]
pub struct AuditPage {
    pub entries: Vec<AuditEntry>,
    /// Pass as `after` for the next page; absent on the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_after: Option<u64>,
}

/// The `prev_hash` of the first entry.
pub const AUDIT_GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";

/// The hash an entry must carry: SHA-256 (hex) over `prev_hash` and every field but `hash`, each
/// length-prefixed so that no two different entries hash the same input.
pub fn audit_hash(e: &AuditEntry) -> String {
    let mut h = Sha256::new();
    let status = e.status.to_string();
    let seq = e.seq.to_string();
    let at = e.at_ms.to_string();
    let fields: [&str; 11] = [
        &e.prev_hash,
        &seq,
        &at,
        &e.key_id,
        &e.project,
        &e.role,
        &e.action,
        &e.target,
        &status,
        &e.source,
        &e.request_id,
    ];
    for f in fields {
        h.update((f.len() as u64).to_be_bytes());
        h.update(f.as_bytes());
    }
    hex::encode(h.finalize())
}

/// Where a chain breaks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditBreak {
    pub seq: u64,
    pub reason: String,
}

impl std::fmt::Display for AuditBreak {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "audit log broken at entry {}: {}", self.seq, self.reason)
    }
}

impl std::error::Error for AuditBreak {}

/// Checks a run of consecutive entries: sequence without gaps, each `prev_hash` the hash before (`prev` for
/// the first: [`AUDIT_GENESIS`] when the run starts the log), each `hash` recomputed. Returns the last hash.
pub fn verify_audit_chain<'a>(
    prev: &str,
    entries: impl IntoIterator<Item = &'a AuditEntry>,
) -> Result<String, AuditBreak> {
    let mut prev = prev.to_string();
    let mut expected_seq: Option<u64> = None;
    for e in entries {
        let fail = |reason: String| AuditBreak { seq: e.seq, reason };
        if let Some(s) = expected_seq
            && e.seq != s
        {
            return Err(fail(format!("expected entry {s}")));
        }
        if e.prev_hash != prev {
            return Err(fail("prev_hash does not match the entry before".into()));
        }
        if audit_hash(e) != e.hash {
            return Err(fail("hash does not match the entry's contents".into()));
        }
        prev = e.hash.clone();
        expected_seq = Some(e.seq + 1);
    }
    Ok(prev)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(seq: u64, prev: &str) -> AuditEntry {
        let mut e = AuditEntry {
            seq,
            at_ms: 1,
            key_id: "bootstrap".into(),
            project: DEFAULT_PROJECT.into(),
            role: "admin".into(),
            action: "POST /v1/sandboxes".into(),
            target: "/v1/sandboxes".into(),
            status: 201,
            source: "127.0.0.1:5".into(),
            request_id: "req_1".into(),
            prev_hash: prev.into(),
            hash: String::new(),
        };
        e.hash = audit_hash(&e);
        e
    }

    #[test]
    fn a_chain_verifies_and_any_change_breaks_it() {
        let a = entry(1, AUDIT_GENESIS);
        let b = entry(2, &a.hash);
        let c = entry(3, &b.hash);
        assert_eq!(
            verify_audit_chain(AUDIT_GENESIS, [&a, &b, &c]),
            Ok(c.hash.clone())
        );
        let mut b2 = b.clone();
        b2.status = 200;
        assert_eq!(
            verify_audit_chain(AUDIT_GENESIS, [&a, &b2, &c]).map_err(|e| e.seq),
            Err(2)
        );
        assert_eq!(
            verify_audit_chain(AUDIT_GENESIS, [&a, &c]).map_err(|e| e.seq),
            Err(3)
        );
        let mut a2 = a.clone();
        a2.target.push('x');
        assert_eq!(
            verify_audit_chain(AUDIT_GENESIS, [&a2]).map_err(|e| e.seq),
            Err(1)
        );
    }
}
