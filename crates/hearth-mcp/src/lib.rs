//! hearth's MCP (Model Context Protocol) server: the sandbox API as tools an AI agent can call.
//!
//! Two ways in, one tool set ([`HearthMcp`]):
//! - **stdio**: `hearth mcp` runs [`serve_stdio`] with a [`hearth_client::Client`] configured like the CLI
//!   (`HEARTH_URL`, `HEARTH_API_KEY`). The agent spawns the command; the server talks HTTP to the daemon.
//! - **streamable HTTP**: hearthd nests [`http_service`] at `/mcp`, behind the same Bearer-key check as `/v1`.
//!
//! # Design of the daemon-embedded endpoint
//! The tools are written once, against the HTTP API client. Inside the daemon, the MCP service uses that same
//! client pointed at the daemon's own listen address over loopback ([`loopback_url`]), with the key of the MCP
//! request being served: the `Authorization` header the daemon's auth layer has just verified is forwarded
//! (rmcp hands each tool call the HTTP request parts). So the daemon needs no plaintext key in memory (it
//! keeps only the key's hash), every tool call passes the same auth, limits and metrics as a direct API call,
//! and the MCP layer cannot reach anything the API does not expose. The cost is one loopback HTTP hop per
//! call, negligible next to a VM boot or a command.
//!
//! Both protocol revisions in use are served: 2025-11-25 (initialize handshake; over HTTP, `Mcp-Session-Id`
//! sessions) and 2026-07-28 (stateless requests), as negotiated by rmcp. Failures of the API are tool errors
//! (`isError: true`) whose JSON carries the daemon's stable error code, so an agent can act on them; bad
//! arguments (missing `sandbox_id`, unknown field, wrong type) are tool errors as well.
//!
//! # Layout
//! - [`server`]: [`HearthMcp`], the tools and the server info.
//! - [`args`]: the tools' input types (their JSON Schemas are what agents read).
//! - [`format`]: output capping, text-or-base64 file content, API errors as tool errors.
//! - this file: the stdio entry point and the streamable-HTTP service.

pub mod args;
pub mod format;
pub mod server;

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use rmcp::ServiceExt;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

pub use server::HearthMcp;

/// Largest MCP request body the HTTP endpoint accepts (a `write_file` of a few MiB of base64 fits).
pub const MAX_HTTP_BODY: usize = 16 * 1024 * 1024;

/// Errors of the stdio server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The MCP handshake on stdin/stdout failed (e.g. the client closed the pipe or sent garbage first).
    #[error("MCP initialisation failed: {0}")]
    Init(String),
    /// The server task ended abnormally.
    #[error("MCP server task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Serves MCP on this process's stdin and stdout until the client disconnects. Logs must go to stderr.
pub async fn serve_stdio(client: hearth_client::Client) -> Result<(), Error> {
    let running = HearthMcp::new(client)
        .serve(rmcp::transport::stdio())
        .await
        .map_err(|e| Error::Init(e.to_string()))?;
    running.waiting().await?;
    Ok(())
}

/// The streamable-HTTP MCP service for the daemon, to nest at `/mcp` behind the daemon's key check. Tools
/// call the API at `api_base` (see [`loopback_url`]) with each request's own `Authorization` header.
/// Cancelling `shutdown` closes open sessions and streams, so a graceful shutdown is not held up by them.
///
/// `Host` header validation (rmcp's DNS-rebinding guard for unauthenticated local servers) is off: every
/// request must carry the API key, which a rebinding web page cannot know, and the daemon may be reached
/// under any name it listens on.
pub fn http_service(
    api_base: &str,
    shutdown: CancellationToken,
) -> StreamableHttpService<HearthMcp, LocalSessionManager> {
    let server = HearthMcp::forwarding(api_base);
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_max_request_body_bytes(MAX_HTTP_BODY)
        .with_cancellation_token(shutdown);
    StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    )
}

/// The URL at which this host reaches a server listening on `addr`: a wildcard address (`0.0.0.0`, `::`)
/// becomes the loopback address of the same family.
pub fn loopback_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_url_maps_wildcards() {
        let url = |s: &str| loopback_url(s.parse().unwrap_or_else(|_| panic!("{s}")));
        assert_eq!(url("0.0.0.0:7070"), "http://127.0.0.1:7070");
        assert_eq!(url("[::]:7070"), "http://[::1]:7070");
        assert_eq!(url("10.1.2.3:80"), "http://10.1.2.3:80");
        assert_eq!(url("[fe80::1]:80"), "http://[fe80::1]:80");
    }
}
