//! The OpenAPI document, generated from the handlers' `#[utoipa::path]` annotations and hearth-api's schemas.
//! Committed as `docs/openapi.json`; a test fails when that copy is stale (`hearthd --print-openapi` rewrites
//! it).

use utoipa::Modify;
use utoipa::OpenApi;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};

use crate::http::{
    buckets, commands, files, network, ports, pty, sandboxes, storage, system, templates, tenancy, watch,
};

#[derive(OpenApi)]
#[openapi(
    info(title = "hearth", description = "Sandboxes for AI agents: one microVM per sandbox, driven over HTTP.",
        license(name = "Apache-2.0")),
    paths(
        sandboxes::create, sandboxes::list, sandboxes::get, sandboxes::destroy, sandboxes::set_timeout,
        sandboxes::pause, sandboxes::resume, sandboxes::sync, sandboxes::usage, sandboxes::usage_report, sandboxes::boundary,
        sandboxes::fork, sandboxes::snapshot, sandboxes::list_snapshots, sandboxes::delete_snapshot,
        templates::create, templates::list, templates::get, templates::delete,
        commands::run, commands::processes, commands::wait, commands::kill, commands::stdin, pty::pty,
        files::read, files::write, files::remove, files::stat, files::list, files::mkdir, files::rename,
        watch::watch,
        network::get, network::set_policy, network::log, network::create, network::list, network::info,
        network::delete, network::attach, network::detach, ports::token, ports::revoke_tokens, ports::forward,
        system::healthz, system::system, system::metrics, system::openapi,
        buckets::create, buckets::list, buckets::get, buckets::delete, buckets::mounts, buckets::attach,
        buckets::detach,
        tenancy::create_project, tenancy::list_projects, tenancy::usage, tenancy::set_quota, tenancy::create_key,
        tenancy::list_keys, tenancy::revoke_key, tenancy::create_token, tenancy::audit, tenancy::audit_export,
        storage::status, storage::gc,
    ),
    components(schemas(hearth_api::ErrorCode, hearth_api::ErrorDetail, hearth_api::SandboxState,
        hearth_api::FileKind, hearth_api::Check, hearth_api::Capacity, hearth_api::ProcessInfo)),
    modifiers(&BearerKey),
    tags(
        (name = "sandboxes", description = "Create, list and destroy sandboxes"),
        (name = "commands", description = "Run commands and manage processes in a sandbox"),
        (name = "files", description = "Files in a sandbox"),
        (name = "snapshots", description = "Checkpoints of running sandboxes, forks, and sandboxes started from them"),
        (name = "templates", description = "Built-in templates and templates saved from sandboxes"),
        (name = "usage", description = "Metering: running, vCPU, memory and paused seconds per sandbox"),
        (name = "networks", description = "Egress policy, audit log, private networks and exposed ports"),
        (name = "buckets", description = "Buckets as named credentials, mounted in sandboxes as file systems"),
        (name = "system", description = "Health, metrics and host report"),
        (name = "projects", description = "Projects, scoped API keys, quotas and the audit log"),
    )
)]
pub struct ApiDoc;

/// Declares the `Authorization: Bearer <key>` scheme the `/v1` routes require.
struct BearerKey;

impl Modify for BearerKey {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "api_key",
            SecurityScheme::Http(
                HttpBuilder::new()
                    .scheme(HttpAuthScheme::Bearer)
                    .bearer_format("hk_<hex>")
                    .build(),
            ),
        );
    }
}

/// The document as pretty JSON with a trailing newline (the form committed in `docs/openapi.json`).
pub fn document_json() -> String {
    let mut doc = ApiDoc::openapi();
    doc.info.version = env!("CARGO_PKG_VERSION").to_string();
    let mut s = doc
        .to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"));
    s.push('\n');
    s
}
