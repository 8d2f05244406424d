//! hearth's sandbox records and policies in E2B's shapes, and back.

use hearth_api::{
    CreateSandboxRequest, EgressDefault, EgressPolicy, NetworkPolicy, OnTimeout, SandboxState,
    is_valid_snapshot_id,
};

use super::error::RestError;
use super::wire::{
    Lifecycle, ListedSandbox, NetworkConfig, NewSandbox, Sandbox, SandboxDetail, SnapshotRequest, State,
};
use crate::ENVD_VERSION;

/// `clientID` of every answer: E2B names the node a sandbox runs on; here it is always this daemon.
pub const CLIENT_ID: &str = "hearth";
/// E2B's "all traffic" sentinel in `allowOut`/`denyOut`.
const ALL_TRAFFIC: [&str; 2] = ["0.0.0.0/0", "::/0"];
/// Longest timeout hearth accepts (seconds).
pub const MAX_TIMEOUT_S: u64 = 86_400;

/// E2B's state for a hearth state; `None` for a failed sandbox, which E2B would no longer know.
pub fn state(s: SandboxState) -> Option<State> {
    match s {
        SandboxState::Pausing | SandboxState::Paused => Some(State::Paused),
        SandboxState::Creating | SandboxState::Running | SandboxState::Resuming | SandboxState::Stopping => {
            Some(State::Running)
        }
        SandboxState::Failed => None,
    }
}

/// The create/connect answer for `sbx`; `key` is the caller's key, which becomes the envd access token.
pub fn sandbox(sbx: &hearth_api::Sandbox, key: &str, domain: &str) -> Sandbox {
    Sandbox {
        template_id: sbx.template.clone(),
        sandbox_id: crate::e2b_sandbox_id(&sbx.id),
        client_id: CLIENT_ID.to_owned(),
        envd_version: ENVD_VERSION.to_owned(),
        envd_access_token: key.to_owned(),
        domain: Some(domain.to_owned()),
        traffic_access_token: None,
    }
}

pub fn detail(sbx: &hearth_api::Sandbox, key: &str, domain: &str) -> Option<SandboxDetail> {
    let state = state(sbx.state)?;
    Some(SandboxDetail {
        template_id: sbx.template.clone(),
        sandbox_id: crate::e2b_sandbox_id(&sbx.id),
        client_id: CLIENT_ID.to_owned(),
        started_at: sbx.created_at.clone(),
        end_at: sbx.end_at.clone(),
        envd_version: ENVD_VERSION.to_owned(),
        envd_access_token: key.to_owned(),
        cpu_count: sbx.vcpus,
        memory_mb: sbx.memory_mib,
        disk_size_mb: 0,
        state,
        metadata: sbx.metadata.clone(),
        domain: Some(domain.to_owned()),
        lifecycle: Lifecycle {
            auto_resume: sbx.auto_resume,
            on_timeout: sbx.on_timeout.as_str(),
        },
        network: None,
        // A hearth pause always keeps the memory.
        pause_mode: (state == State::Paused && sbx.state == SandboxState::Paused).then_some("full"),
        volume_mounts: Vec::new(),
    })
}

pub fn listed(sbx: &hearth_api::Sandbox) -> Option<ListedSandbox> {
    Some(ListedSandbox {
        template_id: sbx.template.clone(),
        sandbox_id: crate::e2b_sandbox_id(&sbx.id),
        client_id: CLIENT_ID.to_owned(),
        started_at: sbx.created_at.clone(),
        end_at: sbx.end_at.clone(),
        cpu_count: sbx.vcpus,
        memory_mb: sbx.memory_mib,
        disk_size_mb: 0,
        state: state(sbx.state)?,
        envd_version: ENVD_VERSION.to_owned(),
        metadata: sbx.metadata.clone(),
        volume_mounts: Vec::new(),
    })
}

/// Checks a timeout in seconds against hearth's range.
pub fn timeout(t: u64) -> Result<u64, RestError> {
    if t == 0 || t > MAX_TIMEOUT_S {
        return Err(RestError::bad_request(format!(
            "timeout must be between 1 and {MAX_TIMEOUT_S} seconds"
        )));
    }
    Ok(t)
}

/// hearth's create request for E2B's. A `templateID` that is a snapshot id (`snp_…`, as `createSnapshot`
/// returns) starts from that snapshot.
pub fn create_request(n: NewSandbox) -> Result<CreateSandboxRequest, RestError> {
    refuse_unsupported(&n)?;
    let (template, snapshot) = if is_valid_snapshot_id(&n.template_id) {
        (None, Some(n.template_id.clone()))
    } else if n.template_id.is_empty() {
        return Err(RestError::bad_request("templateID must not be empty"));
    } else {
        (Some(n.template_id.clone()), None)
    };
    let auto_resume = n.auto_resume.map(|a| a.enabled);
    Ok(CreateSandboxRequest {
        template,
        snapshot,
        timeout_s: n.timeout.map(timeout).transpose()?,
        env: n.env_vars.unwrap_or_default(),
        metadata: n.metadata.unwrap_or_default(),
        on_timeout: n
            .auto_pause
            .map(|p| if p { OnTimeout::Pause } else { OnTimeout::Kill }),
        auto_resume,
        network: policy(n.allow_internet_access, n.network.as_ref())?,
        ..CreateSandboxRequest::default()
    })
}

fn refuse_unsupported(n: &NewSandbox) -> Result<(), RestError> {
    let set = |v: &Option<serde_json::Value>| {
        v.as_ref().is_some_and(|v| {
            !(v.is_null()
                || v.as_object().is_some_and(|o| o.is_empty())
                || v.as_array().is_some_and(|a| a.is_empty()))
        })
    };
    if set(&n.mcp) {
        return Err(RestError::bad_request(
            "mcp (the MCP gateway) is not supported by hearth",
        ));
    }
    if set(&n.iam) {
        return Err(RestError::bad_request(
            "iam (workload identity tokens) is not supported by hearth",
        ));
    }
    if n.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(RestError::bad_request(
            "volume mounts are not supported by hearth",
        ));
    }
    if n.auto_pause_memory == Some(false) {
        return Err(RestError::bad_request(
            "autoPauseMemory false (filesystem-only pause) is not supported: a hearth pause keeps the memory",
        ));
    }
    Ok(())
}

/// hearth's egress policy for E2B's `allow_internet_access` and network config (`None`: hearth's default,
/// everything allowed except what hearth always denies). E2B lets `allowOut` punch holes in a deny-all; in
/// hearth a deny rule wins over an allow rule, so a deny-all becomes the policy's default instead.
pub fn policy(
    allow_internet_access: Option<bool>,
    net: Option<&NetworkConfig>,
) -> Result<Option<NetworkPolicy>, RestError> {
    let empty = NetworkConfig::default();
    let net = net.unwrap_or(&empty);
    let nonempty = |v: &Option<serde_json::Value>| {
        v.as_ref()
            .is_some_and(|v| !(v.is_null() || v.as_object().is_some_and(|o| o.is_empty())))
    };
    if nonempty(&net.egress_proxy) {
        return Err(RestError::bad_request(
            "network.egressProxy is not supported by hearth",
        ));
    }
    if nonempty(&net.rules) {
        return Err(RestError::bad_request(
            "network.rules (request transforms) are not supported by hearth",
        ));
    }
    if net.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
        return Err(RestError::bad_request(
            "network.dnsServers is not supported: hearth's resolver answers every sandbox",
        ));
    }
    let allow = net.allow_out.clone().unwrap_or_default();
    let mut deny = net.deny_out.clone().unwrap_or_default();
    let internet = allow_internet_access.or(net.allow_internet_access);
    let deny_all = internet == Some(false) || deny.iter().any(|d| ALL_TRAFFIC.contains(&d.trim()));
    deny.retain(|d| !ALL_TRAFFIC.contains(&d.trim()));
    if !deny_all && allow.is_empty() && deny.is_empty() {
        return Ok(None);
    }
    Ok(Some(NetworkPolicy {
        egress: EgressPolicy {
            default: if deny_all {
                EgressDefault::Deny
            } else {
                EgressDefault::Allow
            },
            allow: if deny_all { allow } else { Vec::new() },
            deny,
        },
    }))
}

/// The policy `PUT /sandboxes/{id}/network` sets: E2B's update replaces everything, so an empty body means
/// hearth's default policy.
pub fn update_policy(net: &NetworkConfig) -> Result<NetworkPolicy, RestError> {
    Ok(policy(None, Some(net))?.unwrap_or_default())
}

/// Refuses what a hearth snapshot cannot be.
pub fn check_snapshot(req: &SnapshotRequest) -> Result<(), RestError> {
    if req.memory == Some(false) {
        return Err(RestError::bad_request(
            "memory false (filesystem-only snapshot) is not supported: hearth snapshots keep the memory",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(allow: &[&str], deny: &[&str]) -> NetworkConfig {
        NetworkConfig {
            allow_out: Some(allow.iter().map(|s| s.to_string()).collect()),
            deny_out: Some(deny.iter().map(|s| s.to_string()).collect()),
            ..NetworkConfig::default()
        }
    }

    #[test]
    fn network_options_map_to_egress_policies() {
        assert_eq!(policy(None, None), Ok(None));
        assert_eq!(policy(Some(true), None), Ok(None));
        let p = policy(Some(false), None).ok().flatten().unwrap_or_default();
        assert_eq!(p.egress.default, EgressDefault::Deny);
        let p = policy(
            None,
            Some(&net(&["1.1.1.1", "pypi.org"], &["0.0.0.0/0", "8.8.8.8"])),
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        assert_eq!(
            (p.egress.default, p.egress.allow, p.egress.deny),
            (
                EgressDefault::Deny,
                vec!["1.1.1.1".to_string(), "pypi.org".to_string()],
                vec!["8.8.8.8".to_string()]
            )
        );
        let p = policy(None, Some(&net(&[], &["10.0.0.0/8"])))
            .ok()
            .flatten()
            .unwrap_or_default();
        assert_eq!(p.egress.default, EgressDefault::Allow);
        assert_eq!(p.egress.deny, vec!["10.0.0.0/8".to_string()]);
        let proxy = NetworkConfig {
            egress_proxy: Some(serde_json::json!({"address": "p:1080"})),
            ..NetworkConfig::default()
        };
        assert_eq!(policy(None, Some(&proxy)).map_err(|e| e.status), Err(400));
        assert_eq!(
            update_policy(&NetworkConfig::default()),
            Ok(NetworkPolicy::default())
        );
    }

    #[test]
    fn create_requests_map_and_refuse_what_hearth_lacks() {
        let n = NewSandbox {
            template_id: "minimal".into(),
            timeout: Some(120),
            auto_pause: Some(true),
            auto_resume: Some(super::super::wire::AutoResume { enabled: false }),
            ..NewSandbox::default()
        };
        let r = create_request(n).unwrap_or_default();
        assert_eq!(r.template.as_deref(), Some("minimal"));
        assert_eq!(r.timeout_s, Some(120));
        assert_eq!(r.on_timeout, Some(OnTimeout::Pause));
        assert_eq!(r.auto_resume, Some(false));
        let from_snapshot = NewSandbox {
            template_id: "snp_0123456789abcdef".into(),
            ..NewSandbox::default()
        };
        let r = create_request(from_snapshot).unwrap_or_default();
        assert_eq!(
            (r.template, r.snapshot.as_deref()),
            (None, Some("snp_0123456789abcdef"))
        );
        for bad in [
            NewSandbox {
                template_id: "x".into(),
                timeout: Some(0),
                ..NewSandbox::default()
            },
            NewSandbox {
                template_id: "x".into(),
                mcp: Some(serde_json::json!({"github/x": {}})),
                ..NewSandbox::default()
            },
            NewSandbox {
                template_id: "x".into(),
                auto_pause_memory: Some(false),
                ..NewSandbox::default()
            },
            NewSandbox::default(),
        ] {
            assert_eq!(create_request(bad).map_err(|e| e.status).err(), Some(400));
        }
    }
}
