//! Sandbox networks: a sandbox's network and egress policy, its egress audit log, private networks and their
//! members.

use axum::Json;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use hearth_api::{
    CreateNetworkRequest, EgressLog, ErrorBody, NetworkInfo, NetworkList, NetworkPolicy, SandboxNetwork,
};

use super::AppState;
use super::error::{ApiError, ApiJson, SandboxId};

/// A sandbox's network: its address, egress policy and private networks.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network", tag = "networks",
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 200, body = SandboxNetwork),
        (status = 400, description = "Networking is off on this daemon", body = ErrorBody),
        (status = 404, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn get(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
) -> Result<Json<SandboxNetwork>, ApiError> {
    Ok(Json(st.sandboxes.get_network(&id)?))
}

/// Replace a sandbox's egress policy; effective at once for new connections and DNS queries.
#[utoipa::path(patch, path = "/v1/sandboxes/{id}/network", tag = "networks", request_body = NetworkPolicy,
    params(("id" = String, Path, description = "Sandbox id")),
    responses(
        (status = 200, body = SandboxNetwork),
        (status = 400, description = "Invalid policy (the message names the rule)", body = ErrorBody),
        (status = 404, body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn set_policy(
    State(st): State<AppState>,
    SandboxId(id): SandboxId,
    ApiJson(req): ApiJson<NetworkPolicy>,
) -> Result<Json<SandboxNetwork>, ApiError> {
    Ok(Json(st.sandboxes.set_network_policy(&id, req).await?))
}

/// The sandbox's egress audit log: every connection attempt and DNS query, allowed or denied, and why.
#[utoipa::path(get, path = "/v1/sandboxes/{id}/network/log", tag = "networks",
    params(("id" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = EgressLog), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn log(State(st): State<AppState>, SandboxId(id): SandboxId) -> Result<Json<EgressLog>, ApiError> {
    Ok(Json(st.sandboxes.network_log(&id)?))
}

/// Create a private network.
#[utoipa::path(post, path = "/v1/networks", tag = "networks", request_body = CreateNetworkRequest,
    responses(
        (status = 201, body = NetworkInfo),
        (status = 400, body = ErrorBody),
        (status = 409, description = "The name is taken", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn create(
    State(st): State<AppState>,
    ApiJson(req): ApiJson<CreateNetworkRequest>,
) -> Result<(StatusCode, Json<NetworkInfo>), ApiError> {
    Ok((StatusCode::CREATED, Json(st.sandboxes.create_network(req)?)))
}

/// Private networks and their members.
#[utoipa::path(get, path = "/v1/networks", tag = "networks",
    responses((status = 200, body = NetworkList)),
    security(("api_key" = [])))]
pub async fn list(State(st): State<AppState>) -> Result<Json<NetworkList>, ApiError> {
    Ok(Json(NetworkList {
        networks: st.sandboxes.list_networks()?,
    }))
}

/// One private network (by id or name).
#[utoipa::path(get, path = "/v1/networks/{network}", tag = "networks",
    params(("network" = String, Path, description = "Network id or name")),
    responses((status = 200, body = NetworkInfo), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn info(
    State(st): State<AppState>,
    Path(network): Path<String>,
) -> Result<Json<NetworkInfo>, ApiError> {
    Ok(Json(st.sandboxes.get_network_info(&network)?))
}

/// Delete a private network (refused while sandboxes are attached).
#[utoipa::path(delete, path = "/v1/networks/{network}", tag = "networks",
    params(("network" = String, Path, description = "Network id or name")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, body = ErrorBody),
        (status = 409, description = "Sandboxes are attached", body = ErrorBody),
    ),
    security(("api_key" = [])))]
pub async fn delete(State(st): State<AppState>, Path(network): Path<String>) -> Result<StatusCode, ApiError> {
    st.sandboxes.delete_network(&network)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Path of a membership route: the network and the sandbox.
#[derive(serde::Deserialize)]
pub struct MemberPath {
    network: String,
    sandbox: String,
}

fn member_sandbox(p: &MemberPath) -> Result<&str, ApiError> {
    if hearth_api::is_valid_sandbox_id(&p.sandbox) {
        Ok(&p.sandbox)
    } else {
        Err(ApiError::new(
            hearth_api::ErrorCode::NotFound,
            "sandbox not found",
        ))
    }
}

/// Attach a sandbox to a private network: members reach each other by address and by
/// `<sandbox-id>.<network>.internal` (and `<name>.<network>.internal`) at once.
#[utoipa::path(put, path = "/v1/networks/{network}/members/{sandbox}", tag = "networks",
    params(("network" = String, Path, description = "Network id or name"),
        ("sandbox" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = NetworkInfo), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn attach(
    State(st): State<AppState>,
    Path(p): Path<MemberPath>,
) -> Result<Json<NetworkInfo>, ApiError> {
    let sandbox = member_sandbox(&p)?;
    Ok(Json(st.sandboxes.attach_to_network(&p.network, sandbox).await?))
}

/// Detach a sandbox from a private network; the link to its peers is cut at once.
#[utoipa::path(delete, path = "/v1/networks/{network}/members/{sandbox}", tag = "networks",
    params(("network" = String, Path, description = "Network id or name"),
        ("sandbox" = String, Path, description = "Sandbox id")),
    responses((status = 200, body = NetworkInfo), (status = 404, body = ErrorBody)),
    security(("api_key" = [])))]
pub async fn detach(
    State(st): State<AppState>,
    Path(p): Path<MemberPath>,
) -> Result<Json<NetworkInfo>, ApiError> {
    let sandbox = member_sandbox(&p)?;
    Ok(Json(st.sandboxes.detach_from_network(&p.network, sandbox).await?))
}
