//! `mcp`: the MCP server on stdin/stdout, for agents that spawn their tools (see docs/mcp.md).

use anyhow::Context as _;

use crate::Ctx;

/// Serves until the agent closes stdin. stdout belongs to the protocol: nothing else may be printed there.
pub async fn serve(ctx: &Ctx) -> anyhow::Result<u8> {
    let client = ctx.client()?;
    hearth_mcp::serve_stdio(client)
        .await
        .context("the MCP server stopped")?;
    Ok(0)
}
