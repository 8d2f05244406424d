//! The control plane's JSON shapes, as E2B's OpenAPI document names them. Requests tolerate fields this
//! adapter does not know (newer SDKs add some); the ones it knows but cannot honour are refused by the
//! handlers with a 400 that says so.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /sandboxes` (`NewSandbox`) and `POST /v2/sandboxes` (`NewSandboxV2`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    /// Seconds to live.
    pub timeout: Option<u64>,
    pub auto_pause: Option<bool>,
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<AutoResume>,
    /// Accepted and ignored: envd access is always secured (by the caller's key).
    pub secure: Option<bool>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub network: Option<NetworkConfig>,
    pub metadata: Option<BTreeMap<String, String>>,
    pub env_vars: Option<BTreeMap<String, String>>,
    pub mcp: Option<serde_json::Value>,
    pub iam: Option<serde_json::Value>,
    pub volume_mounts: Option<Vec<serde_json::Value>>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
pub struct AutoResume {
    pub enabled: bool,
}

/// `SandboxNetworkConfig` (create) and `SandboxNetworkUpdateConfig` (`PUT /sandboxes/{id}/network`).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkConfig {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub allow_public_traffic: Option<bool>,
    pub mask_request_host: Option<String>,
    pub https_ports: Option<Vec<u16>>,
    pub dns_servers: Option<Vec<String>>,
    pub egress_proxy: Option<serde_json::Value>,
    pub rules: Option<serde_json::Value>,
    /// Only in the update body (snake case there, as in E2B's document).
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
}

/// The answer of create, connect and resume (`Sandbox`), and the `sandbox` of a fork result.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: String,
    /// The caller's own key: the SDK sends it back as `X-Access-Token` on envd requests.
    pub envd_access_token: String,
    /// Where the sandbox's hosts are (`{port}-{id}.DOMAIN`); `E2B_SANDBOX_URL` takes precedence in the SDKs.
    pub domain: Option<String>,
    pub traffic_access_token: Option<String>,
}

/// `GET /sandboxes/{id}` (`SandboxDetail`).
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    /// RFC 3339.
    pub started_at: String,
    pub end_at: String,
    pub envd_version: String,
    pub envd_access_token: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: State,
    pub metadata: BTreeMap<String, String>,
    pub domain: Option<String>,
    pub lifecycle: Lifecycle,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pause_mode: Option<&'static str>,
    pub volume_mounts: Vec<serde_json::Value>,
}

/// One entry of `GET /v2/sandboxes` (`ListedSandbox`).
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ListedSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub started_at: String,
    pub end_at: String,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: State,
    pub envd_version: String,
    pub metadata: BTreeMap<String, String>,
    pub volume_mounts: Vec<serde_json::Value>,
}

/// E2B knows two states; hearth's transitional ones map onto the nearer of them.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum State {
    Running,
    Paused,
}

impl State {
    pub fn parse(s: &str) -> Option<State> {
        match s {
            "running" => Some(State::Running),
            "paused" => Some(State::Paused),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Lifecycle {
    pub auto_resume: bool,
    /// `kill` or `pause`.
    pub on_timeout: &'static str,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct NetworkInfo {
    pub allow_out: Vec<String>,
    pub deny_out: Vec<String>,
    pub allow_public_traffic: bool,
}

/// `POST /sandboxes/{id}/timeout`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TimeoutRequest {
    pub timeout: u64,
}

/// `POST /sandboxes/{id}/refreshes` (older SDKs' keep-alive).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RefreshRequest {
    pub duration: Option<u64>,
}

/// `POST /sandboxes/{id}/pause`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct PauseRequest {
    pub memory: Option<bool>,
}

/// `POST /sandboxes/{id}/connect`, `/v2/sandboxes/{id}/connect` and `/sandboxes/{id}/resume`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectRequest {
    pub timeout: Option<u64>,
    pub memory: Option<bool>,
    /// Only in the old resume body; a hearth sandbox keeps its own timeout action.
    pub auto_pause: Option<bool>,
}

/// `POST /sandboxes/{id}/fork`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ForkRequest {
    pub timeout: Option<u64>,
    pub count: Option<u32>,
}

/// One entry of the fork answer: exactly one of `sandbox` and `error`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ForkResult {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox: Option<Sandbox>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<ErrorBody>,
}

/// `POST /sandboxes/{id}/snapshots`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SnapshotRequest {
    pub name: Option<String>,
    pub memory: Option<bool>,
}

/// `SnapshotInfo`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SnapshotInfo {
    #[serde(rename = "snapshotID")]
    pub snapshot_id: String,
    pub names: Vec<String>,
}

/// `SandboxMetric`.
#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Metric {
    pub timestamp: String,
    pub timestamp_unix: i64,
    pub cpu_count: u32,
    pub cpu_used_pct: f64,
    pub mem_used: u64,
    pub mem_total: u64,
    pub mem_cache: u64,
    pub disk_used: u64,
    pub disk_total: u64,
}

/// E2B's error body: the HTTP status again as `code`, and a message.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ErrorBody {
    pub code: u16,
    pub message: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sdks_create_bodies_parse() {
        // As the JS SDK 2.51 sends it (network and lifecycle included); unknown fields are tolerated.
        let body = r#"{"templateID":"minimal","metadata":{"a":"b"},"envVars":{"X":"1"},"timeout":300,
            "allow_internet_access":false,"network":{"allowOut":["1.1.1.1"],"denyOut":["0.0.0.0/0"]},
            "autoPause":true,"autoResume":{"enabled":true},"secure":true,"somethingNew":1}"#;
        let n: NewSandbox = serde_json::from_str(body).unwrap_or_default();
        assert_eq!(n.template_id, "minimal");
        assert_eq!(n.allow_internet_access, Some(false));
        assert_eq!(n.auto_resume, Some(AutoResume { enabled: true }));
        assert_eq!(
            n.network.and_then(|n| n.deny_out),
            Some(vec!["0.0.0.0/0".to_string()])
        );
        assert!(serde_json::from_str::<NewSandbox>(r#"{"timeout":1}"#).is_err());
        assert!(serde_json::from_str::<NewSandbox>(r#"{"templateID":"x","timeout":"1"}"#).is_err());
    }

    #[test]
    fn answers_use_e2b_field_names() {
        let s = Sandbox {
            template_id: "t".into(),
            sandbox_id: "sbx_0123456789abcdef".into(),
            client_id: "hearth".into(),
            envd_version: "0.6.4".into(),
            envd_access_token: "k".into(),
            domain: None,
            traffic_access_token: None,
        };
        let v = serde_json::to_value(&s).unwrap_or_default();
        for key in [
            "templateID",
            "sandboxID",
            "clientID",
            "envdVersion",
            "envdAccessToken",
            "domain",
        ] {
            assert!(v.get(key).is_some(), "{key} in {v}");
        }
        assert_eq!(serde_json::to_value(State::Paused).unwrap_or_default(), "paused");
    }
}
