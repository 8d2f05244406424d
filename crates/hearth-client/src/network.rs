//! Sandbox networks: egress policy, the egress audit log, private networks and exposed-port tokens.

use hearth_api::{
    CreateNetworkRequest, EgressLog, NetworkInfo, NetworkList, NetworkPolicy, PortToken, PortTokenRequest,
    SandboxNetwork,
};
use reqwest::Method;

use crate::{Client, Error};

impl Client {
    /// `GET /v1/sandboxes/{id}/network`: address, egress policy and private networks of a sandbox.
    pub async fn sandbox_network(&self, id: &str) -> Result<SandboxNetwork, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "sandboxes", id, "network"]), None)
            .await
    }

    /// `PATCH /v1/sandboxes/{id}/network`: replaces the egress policy (effective at once).
    pub async fn set_network_policy(
        &self,
        id: &str,
        policy: &NetworkPolicy,
    ) -> Result<SandboxNetwork, Error> {
        self.call(
            Method::PATCH,
            self.url(&["v1", "sandboxes", id, "network"]),
            Some(policy),
        )
        .await
    }

    /// `GET /v1/sandboxes/{id}/network/log`: the egress audit log.
    pub async fn network_log(&self, id: &str) -> Result<EgressLog, Error> {
        self.call::<(), _>(
            Method::GET,
            self.url(&["v1", "sandboxes", id, "network", "log"]),
            None,
        )
        .await
    }

    /// `POST /v1/networks`.
    pub async fn create_network(&self, name: &str) -> Result<NetworkInfo, Error> {
        let req = CreateNetworkRequest {
            name: name.to_string(),
        };
        self.call(Method::POST, self.url(&["v1", "networks"]), Some(&req))
            .await
    }

    /// `GET /v1/networks`.
    pub async fn list_networks(&self) -> Result<NetworkList, Error> {
        self.call::<(), _>(Method::GET, self.url(&["v1", "networks"]), None)
            .await
    }

    /// `DELETE /v1/networks/{network}` (id or name; refused while sandboxes are attached).
    pub async fn delete_network(&self, network: &str) -> Result<(), Error> {
        self.call_no_content::<()>(Method::DELETE, self.url(&["v1", "networks", network]), None)
            .await
    }

    /// `PUT /v1/networks/{network}/members/{id}`: attaches a sandbox.
    pub async fn attach_network(&self, network: &str, id: &str) -> Result<NetworkInfo, Error> {
        let url = self.url(&["v1", "networks", network, "members", id]);
        self.call::<(), _>(Method::PUT, url, None).await
    }

    /// `DELETE /v1/networks/{network}/members/{id}`: detaches a sandbox.
    pub async fn detach_network(&self, network: &str, id: &str) -> Result<NetworkInfo, Error> {
        let url = self.url(&["v1", "networks", network, "members", id]);
        self.call::<(), _>(Method::DELETE, url, None).await
    }

    /// `POST /v1/sandboxes/{id}/ports/{port}/token`: a signed, expiring token for one guest port. The
    /// returned `url` is relative to the daemon's base URL.
    pub async fn port_token(&self, id: &str, port: u16, ttl_s: Option<u64>) -> Result<PortToken, Error> {
        let port = port.to_string();
        let url = self.url(&["v1", "sandboxes", id, "ports", &port, "token"]);
        self.call(Method::POST, url, Some(&PortTokenRequest { ttl_s }))
            .await
    }

    /// `DELETE /v1/sandboxes/{id}/ports/{port}/token`: every token issued so far for the port stops working.
    pub async fn revoke_port_tokens(&self, id: &str, port: u16) -> Result<(), Error> {
        let port = port.to_string();
        let url = self.url(&["v1", "sandboxes", id, "ports", &port, "token"]);
        self.call_no_content::<()>(Method::DELETE, url, None).await
    }
}
