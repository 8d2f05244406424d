//! [`HearthMcp`]: the MCP server handler. Every tool is one or two calls of [`hearth_client::Client`]; the
//! answer is JSON (as text content and as `structuredContent`), a failure is a tool error (`isError: true`)
//! whose JSON names the daemon's error code.

use std::path::Path;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use futures::StreamExt;
use hearth_api::{
    CommandEvent, CreateSandboxRequest, EgressPolicy, ErrorCode, FileKind, NetworkPolicy, RunCommandRequest,
    SandboxState,
};
use hearth_client::{Client, ListFilter};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, Implementation, ServerCapabilities, ServerConfig};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, tool, tool_handler, tool_router};
use serde_json::{Value, json};

use crate::args::{
    CreateSandboxArgs, CreateTemplateArgs, Encoding, ExecArgs, ForkArgs, ListFilesArgs, ListSandboxesArgs,
    MAX_LOG, MAX_READ, MembershipArgs, MountAddArgs, MountArg, MountRemoveArgs, NetworkArgs, NetworkLogArgs,
    NetworkNameArgs, PortExposeArgs, ProjectUsageArgs, ReadFileArgs, SandboxArgs, SetPolicyArgs,
    SetTimeoutArgs, TemplateArgs, WriteFileArgs,
};
use crate::format::{self, Capped};

/// What the server tells the agent about itself at initialisation.
const INSTRUCTIONS: &str = "hearth runs sandboxes: small Linux virtual machines, each with its own kernel. \
Create one with create_sandbox, then run shell commands in it with exec and move files with write_file, \
read_file and list_files, always passing the sandbox_id that create_sandbox returned. A sandbox is destroyed \
when its timeout expires (extend it with set_timeout) or by kill_sandbox; kill sandboxes you no longer need. \
pause_sandbox keeps a sandbox on disk without using CPU or memory until resume_sandbox. create_template saves a \
prepared sandbox as a template that new sandboxes start from. Egress from a sandbox follows its policy \
(network_policy_get, network_policy_set, and allow/deny/deny_all at create_sandbox; network_log shows what it \
tried to reach); sandboxes on the same private network (network_create, network_attach) reach each other; \
port_expose gives a URL that opens a server port inside a sandbox.";

/// Where tool calls get their API client.
#[derive(Clone)]
enum Backend {
    /// One client for every call (stdio: the user's `HEARTH_URL` and key).
    Fixed(Client),
    /// Embedded in the daemon: call the daemon at `base` with the `Authorization` key of the MCP request being
    /// served (already checked by the daemon's auth layer). The last client is kept for the next call.
    Forward {
        base: String,
        last: Arc<Mutex<Option<(String, Client)>>>,
    },
}

/// The hearth MCP server. Cheap to clone.
#[derive(Clone)]
pub struct HearthMcp {
    backend: Backend,
    tool_router: ToolRouter<HearthMcp>,
}

impl std::fmt::Debug for HearthMcp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mode = match &self.backend {
            Backend::Fixed(c) => format!("fixed {}", c.base_url()),
            Backend::Forward { base, .. } => format!("forward to {base}"),
        };
        f.debug_struct("HearthMcp").field("backend", &mode).finish()
    }
}

type ToolResult = Result<CallToolResult, ErrorData>;

fn ok_json(v: Value) -> ToolResult {
    Ok(CallToolResult::structured(v))
}

fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

impl HearthMcp {
    /// A server whose tools all use `client` (the stdio server of `hearth mcp`).
    pub fn new(client: Client) -> Self {
        HearthMcp {
            backend: Backend::Fixed(client),
            tool_router: Self::tool_router(),
        }
    }

    /// A server for the daemon's `/mcp` endpoint: tools call the daemon at `base_url` with the API key of the
    /// HTTP request that carried the tool call. Without such a request (not over HTTP) every call fails with
    /// `unauthorized`.
    pub fn forwarding(base_url: impl Into<String>) -> Self {
        HearthMcp {
            backend: Backend::Forward {
                base: base_url.into(),
                last: Arc::new(Mutex::new(None)),
            },
            tool_router: Self::tool_router(),
        }
    }

    /// The client for the call being served, or the tool error saying why there is none.
    fn client(&self, ctx: &RequestContext<RoleServer>) -> Result<Client, CallToolResult> {
        let (base, last) = match &self.backend {
            Backend::Fixed(c) => return Ok(c.clone()),
            Backend::Forward { base, last } => (base, last),
        };
        let unauthorized = || {
            CallToolResult::structured_error(json!({ "error": {
                "code": ErrorCode::Unauthorized.as_str(),
                "message": "the MCP request carried no API key (Authorization: Bearer <key>)",
            }}))
        };
        let key = ctx
            .extensions
            .get::<http::request::Parts>()
            .and_then(|p| p.headers.get(http::header::AUTHORIZATION))
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, key)| key.trim().to_owned())
            .ok_or_else(unauthorized)?;
        let mut last = last.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((k, c)) = last.as_ref()
            && *k == key
        {
            return Ok(c.clone());
        }
        let client = Client::new(base, key.clone()).map_err(|e| format::api_error(&e))?;
        *last = Some((key, client.clone()));
        Ok(client)
    }
}

/// Unwraps a `Result<_, CallToolResult>`: the error is the tool's answer.
macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(r) => return Ok(r),
        }
    };
}

/// Unwraps an API call's result: the error becomes a tool error.
macro_rules! api {
    ($e:expr) => {
        match $e.await {
            Ok(v) => v,
            Err(e) => return Ok(format::api_error(&e)),
        }
    };
}

#[tool_router]
impl HearthMcp {
    #[tool(
        annotations(destructive_hint = false),
        description = "Create a sandbox (a Linux microVM) and wait until it runs; returns it, with the `id` \
                          to pass as sandbox_id to the other tools. Booting takes a few seconds. Optionally \
                          restrict its egress (deny_all, allow, deny: see network_policy_set for the rule \
                          syntax), attach it to private networks, name it, and mount registered buckets as \
                          directories (mounts; see bucket_list)."
    )]
    async fn create_sandbox(
        &self,
        Parameters(a): Parameters<CreateSandboxArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let network = (a.deny_all || !a.allow.is_empty() || !a.deny.is_empty()).then_some(NetworkPolicy {
            egress: EgressPolicy {
                default: if a.deny_all {
                    hearth_api::EgressDefault::Deny
                } else {
                    hearth_api::EgressDefault::Allow
                },
                allow: a.allow,
                deny: a.deny,
            },
        });
        let req = CreateSandboxRequest {
            template: a.template,
            vcpus: a.vcpus,
            memory_mib: a.memory_mib,
            timeout_s: a.timeout_s,
            env: a.env,
            metadata: a.metadata,
            network,
            networks: a.networks,
            name: a.name,
            mounts: a.mounts.into_iter().map(MountArg::spec).collect(),
            ..Default::default()
        };
        let sbx = api!(client.create_sandbox(&req));
        ok_json(to_json(&sbx))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "List the templates create_sandbox can start from (pass `name` as its `template`) and which \
                       one is the default. Each has: name, builtin (images that came with the host; cannot be \
                       deleted), from_sandbox (the sandbox it was saved from), has_memory (its sandboxes start \
                       with the saved processes running), size_bytes, created_at."
    )]
    async fn list_templates(&self, ctx: RequestContext<RoleServer>) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let info = api!(client.system());
        let list = api!(client.list_templates());
        let templates: Vec<Value> = list.templates.iter().map(template_json).collect();
        ok_json(json!({ "templates": templates, "default_template": info.default_template }))
    }

    #[tool(
        annotations(destructive_hint = false),
        description = "Save a running sandbox as a new template: its files (flattened into a standalone image) \
                       and, with include_memory, its running memory. The sandbox keeps running. Sandboxes \
                       created from the template (create_sandbox with template = name) start with those files, \
                       and with include_memory with the saved processes already running. Takes a few seconds \
                       per GiB of disk. Returns the template."
    )]
    async fn create_template(
        &self,
        Parameters(a): Parameters<CreateTemplateArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        if !hearth_api::is_valid_template_name(&a.name) {
            return Ok(format::invalid_argument(format!(
                "template name {:?} must be 1-63 characters of a-z, 0-9 and '-', not starting with '-'",
                a.name
            )));
        }
        let req = hearth_api::CreateTemplateRequest {
            name: a.name,
            from_sandbox: Some(a.sandbox_id),
            include_memory: a.include_memory,
            recipe: None,
        };
        let tpl = api!(client.create_template(&req));
        ok_json(template_json(&tpl))
    }

    #[tool(
        annotations(destructive_hint = true, idempotent_hint = true),
        description = "Delete a template saved with create_template. Refused (conflict) for built-in templates \
                       and while sandboxes created from it exist."
    )]
    async fn delete_template(
        &self,
        Parameters(a): Parameters<TemplateArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        api!(client.delete_template(&a.name));
        ok_json(json!({ "deleted": a.name }))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "List sandboxes (id, state, template, shape, timestamps, metadata), optionally \
                          filtered by state and metadata."
    )]
    async fn list_sandboxes(
        &self,
        Parameters(a): Parameters<ListSandboxesArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let state = match a.state.as_deref() {
            None => None,
            Some(s) => Some(tri!(SandboxState::parse(s).ok_or_else(|| {
                format::invalid_argument(format!(
                    "unknown state {s:?} (states: creating, running, stopping, failed, ...)"
                ))
            }))),
        };
        let filter = ListFilter {
            state,
            metadata: a.metadata,
        };
        let list = api!(client.list_sandboxes(&filter));
        ok_json(to_json(&list))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "Show one sandbox: state, template, vCPUs, memory, creation time, when it will be \
                          destroyed (end_at), metadata and, if it failed, why."
    )]
    async fn sandbox_info(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let sbx = api!(client.get_sandbox(&a.sandbox_id));
        ok_json(to_json(&sbx))
    }

    #[tool(
        description = "Run a shell command (`/bin/sh -c`) in a sandbox and wait for it; returns exit_code, \
                          stdout and stderr. Each stream is cut after 64 KiB (with a note on how to get the \
                          rest: redirect to a file and use read_file). Default timeout 60 s."
    )]
    async fn exec(&self, Parameters(a): Parameters<ExecArgs>, ctx: RequestContext<RoleServer>) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let req = RunCommandRequest {
            cmd: Some(a.command),
            env: a.env,
            cwd: a.cwd,
            timeout_s: a.timeout_s,
            ..Default::default()
        };
        let mut events = client.run_command_stream(&a.sandbox_id, &req);
        let (mut out, mut err) = (Capped::default(), Capped::default());
        while let Some(event) = events.next().await {
            let event = match event {
                Ok(ev) => ev,
                Err(e) => return Ok(format::api_error(&e)),
            };
            match event {
                CommandEvent::Start { .. } => {}
                CommandEvent::Stdout { data_b64 } | CommandEvent::Stderr { data_b64 }
                    if data_b64.is_empty() => {}
                CommandEvent::Stdout { data_b64 } => out.push(&tri!(decode(&data_b64))),
                CommandEvent::Stderr { data_b64 } => err.push(&tri!(decode(&data_b64))),
                CommandEvent::Exit {
                    exit_code,
                    signal,
                    timed_out,
                } => return ok_json(format::exec_result(exit_code, signal, timed_out, &out, &err)),
                CommandEvent::Error { code, message } => {
                    return Ok(CallToolResult::structured_error(json!({
                        "error": { "code": code.as_str(), "message": message },
                        "stdout": out.text(),
                        "stderr": err.text(),
                    })));
                }
            }
        }
        Ok(CallToolResult::structured_error(json!({ "error": {
            "code": ErrorCode::AgentUnavailable.as_str(),
            "message": "the command's output ended without an exit status (the sandbox may have stopped)",
        }})))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "Read a file from a sandbox. UTF-8 text comes back as text; other content as base64 \
                          (with a note). Reads at most 256 KiB per call: use offset/length (the result gives \
                          next_offset) for larger files."
    )]
    async fn read_file(
        &self,
        Parameters(a): Parameters<ReadFileArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let offset = a.offset.unwrap_or(0);
        let length = a.length.unwrap_or(MAX_READ);
        if length > MAX_READ {
            return Ok(format::invalid_argument(format!(
                "length {length} is over the limit of {MAX_READ} bytes per call; read in pieces with offset"
            )));
        }
        let info = api!(client.stat(&a.sandbox_id, &a.path));
        if info.kind == FileKind::Dir {
            return Ok(format::invalid_argument(format!(
                "{} is a directory: use list_files",
                a.path
            )));
        }
        let mut data = Vec::new();
        // Files of /proc and /sys report size 0 but have content: read those anyway.
        let past_end = info.size > 0 && offset >= info.size;
        if length > 0 && !past_end {
            let mut stream = api!(client.download_stream(&a.sandbox_id, &a.path));
            let (mut skip, want) = (offset, length as usize);
            while let Some(chunk) = stream.next().await {
                let chunk = match chunk {
                    Ok(c) => c,
                    Err(e) => return Ok(format::api_error(&e)),
                };
                let mut chunk = &chunk[..];
                let drop = skip.min(chunk.len() as u64) as usize;
                chunk = &chunk[drop..];
                skip -= drop as u64;
                let take = (want - data.len()).min(chunk.len());
                data.extend_from_slice(&chunk[..take]);
                if data.len() == want {
                    break;
                }
            }
        }
        ok_json(format::file_content(&a.path, offset, &data, info.size))
    }

    #[tool(
        annotations(destructive_hint = true, idempotent_hint = true),
        description = "Write a file in a sandbox (created or replaced; missing parent directories are \
                          created). content is text, or base64 with encoding \"base64\"."
    )]
    async fn write_file(
        &self,
        Parameters(a): Parameters<WriteFileArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let data = match a.encoding {
            Encoding::Text => a.content.into_bytes(),
            Encoding::Base64 => tri!(
                base64::engine::general_purpose::STANDARD
                    .decode(a.content.trim())
                    .map_err(|e| format::invalid_argument(format!("content is not valid base64: {e}")))
            ),
        };
        let first = client.write_file(&a.sandbox_id, &a.path, data.clone()).await;
        let info = match first {
            Err(e) if e.code() == Some(ErrorCode::NotFound) => {
                // Either the sandbox or the parent directory is missing; creating the parent tells which.
                let parent = Path::new(&a.path)
                    .parent()
                    .and_then(|p| p.to_str())
                    .unwrap_or("/");
                api!(client.mkdir(&a.sandbox_id, parent, true));
                api!(client.write_file(&a.sandbox_id, &a.path, data))
            }
            other => api!(async { other }),
        };
        ok_json(to_json(&info))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "List a directory in a sandbox: name, kind (file, dir, symlink, other), size, mode \
                          and mtime of each entry."
    )]
    async fn list_files(
        &self,
        Parameters(a): Parameters<ListFilesArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let path = a.path.unwrap_or_else(|| "/root".to_owned());
        let list = api!(client.list_dir(&a.sandbox_id, &path));
        ok_json(json!({ "path": path, "entries": to_json(&list.entries) }))
    }

    #[tool(
        annotations(destructive_hint = false, idempotent_hint = true),
        description = "Pause a running sandbox to zero: its memory and state are saved to disk and its VM stops \
                       (no CPU or RAM used; a paused sandbox does not expire). Processes, memory and files are \
                       kept. Resume with resume_sandbox; exec and file tools also resume it by themselves unless \
                       it was created with auto_resume off."
    )]
    async fn pause_sandbox(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let sbx = api!(client.pause_sandbox(&a.sandbox_id));
        ok_json(to_json(&sbx))
    }

    #[tool(
        annotations(destructive_hint = false, idempotent_hint = true),
        description = "Resume a paused sandbox: its processes, memory and files are as they were when paused. \
                       Returns the running sandbox."
    )]
    async fn resume_sandbox(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let sbx = api!(client.resume_sandbox(&a.sandbox_id));
        ok_json(to_json(&sbx))
    }

    #[tool(
        annotations(destructive_hint = false),
        description = "Fork a running sandbox into `count` children (default 1, at most 16) that continue from \
                       this moment: same processes, memory and files, each with its own disk and hostname. The \
                       parent keeps running. Returns the children (their ids are new sandbox_ids); kill them \
                       when done."
    )]
    async fn fork_sandbox(
        &self,
        Parameters(a): Parameters<ForkArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let forked = api!(client.fork_sandbox(&a.sandbox_id, a.count.unwrap_or(1)));
        ok_json(to_json(&forked))
    }

    #[tool(
        annotations(destructive_hint = true, idempotent_hint = true),
        description = "Destroy a sandbox now: its VM is stopped and everything in it is lost."
    )]
    async fn kill_sandbox(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        api!(client.delete_sandbox(&a.sandbox_id));
        ok_json(json!({ "killed": a.sandbox_id }))
    }

    #[tool(
        annotations(destructive_hint = false),
        description = "Set a sandbox's timeout: it will be destroyed timeout_s seconds from now. Returns the \
                          sandbox with its new end_at."
    )]
    async fn set_timeout(
        &self,
        Parameters(a): Parameters<SetTimeoutArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let sbx = api!(client.set_timeout(&a.sandbox_id, a.timeout_s));
        ok_json(to_json(&sbx))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "Show a sandbox's network: its address (as private-network peers reach it), the address the \
                       guest sees on eth0, its egress policy (default allow|deny, allow and deny rules) and the \
                       private networks it is attached to."
    )]
    async fn network_policy_get(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let net = api!(client.sandbox_network(&a.sandbox_id));
        ok_json(network_json(&a.sandbox_id, &net))
    }

    #[tool(
        annotations(destructive_hint = false, idempotent_hint = true),
        description = "Replace a sandbox's egress policy; it applies at once to new connections and DNS \
                       lookups. default \"allow\" reaches everything except deny rules, default \"deny\" only \
                       what allow rules name; deny rules win over allow rules. A rule is an IP address or CIDR \
                       (\"203.0.113.7\", \"203.0.113.0/24\", \"2001:db8::/32\"), a domain name \
                       (\"example.com\": that name only) or a wildcard (\"*.example.com\": every name below \
                       example.com, not example.com itself). Private, link-local, loopback and host addresses \
                       are always denied. An invalid rule is refused (invalid_argument, naming the rule) and the \
                       old policy stays. Returns the sandbox's network as network_policy_get does."
    )]
    async fn network_policy_set(
        &self,
        Parameters(a): Parameters<SetPolicyArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let policy = NetworkPolicy {
            egress: EgressPolicy {
                default: a.default.into(),
                allow: a.allow,
                deny: a.deny,
            },
        };
        let net = api!(client.set_network_policy(&a.sandbox_id, &policy));
        ok_json(network_json(&a.sandbox_id, &net))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "A sandbox's egress audit log, oldest first: every connection and DNS lookup it attempted \
                       with destination, port, name (DNS, TLS SNI or HTTP Host), protocol, allowed, reason \
                       (allow_rule, deny_rule, default_allow, default_deny, always_denied, dns_blocked, ...) and \
                       the rule that decided. Returns the newest `limit` entries (default 50, at most 1000) \
                       with a note when older ones were left out."
    )]
    async fn network_log(
        &self,
        Parameters(a): Parameters<NetworkLogArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let limit = a.limit.unwrap_or(DEFAULT_LOG);
        if !(1..=MAX_LOG).contains(&limit) {
            return Ok(format::invalid_argument(format!(
                "limit {limit} must be between 1 and {MAX_LOG}"
            )));
        }
        let log = api!(client.network_log(&a.sandbox_id));
        ok_json(format::egress_log(&log, limit))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "What your project holds against its quota: running sandboxes, vcpus, memory_mib, \
                       disk_bytes and spent_credits, beside `quota` (each limit; absent: none). Over a limit, \
                       creates, forks and resumes are refused with quota_exceeded naming it."
    )]
    async fn project_usage(
        &self,
        Parameters(a): Parameters<ProjectUsageArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let project = match a.project {
            Some(p) => p,
            None => tri!(format::own_project(&api!(client.list_projects()))),
        };
        let usage = api!(client.project_usage(&project));
        ok_json(to_json(&usage))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "List the buckets (S3, MinIO, R2) the operator registered, which create_sandbox and \
                       mount_add can mount as directories: name, url (s3://bucket/prefix), endpoint, region, \
                       mounted_by (sandbox ids). Their credentials stay on the host and are never shown."
    )]
    async fn bucket_list(&self, ctx: RequestContext<RoleServer>) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let list = api!(client.list_buckets());
        ok_json(to_json(&list))
    }

    #[tool(
        annotations(destructive_hint = false),
        description = "Mount a registered bucket (bucket_list) as a directory of a running sandbox. Files are \
                       objects: reads fetch ranges, a file written is uploaded whole when it is closed, \
                       renames copy; with read_only every write fails with EROFS. Returns the mount."
    )]
    async fn mount_add(
        &self,
        Parameters(a): Parameters<MountAddArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let m = api!(client.mount(&a.sandbox_id, &a.mount.spec()));
        ok_json(to_json(&m))
    }

    #[tool(
        annotations(destructive_hint = false, idempotent_hint = true),
        description = "Unmount a bucket directory of a sandbox (written files reach the bucket first). The \
                       bucket's objects stay."
    )]
    async fn mount_remove(
        &self,
        Parameters(a): Parameters<MountRemoveArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        api!(client.unmount(&a.sandbox_id, &a.path));
        ok_json(json!({ "unmounted": a.path }))
    }

    #[tool(
        annotations(destructive_hint = false),
        description = "Create a private network. Sandboxes attached to the same network (network_attach, or \
                       create_sandbox with networks) reach each other by address and as \
                       <sandbox id or name>.<network>.internal; sandboxes sharing no network cannot exchange a \
                       packet. Returns the network (id, name, members)."
    )]
    async fn network_create(
        &self,
        Parameters(a): Parameters<NetworkNameArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let net = api!(client.create_network(&a.name));
        ok_json(to_json(&net))
    }

    #[tool(
        annotations(read_only_hint = true),
        description = "List the private networks: id, name, created_at and members (sandbox ids)."
    )]
    async fn network_list(&self, ctx: RequestContext<RoleServer>) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let list = api!(client.list_networks());
        ok_json(to_json(&list))
    }

    #[tool(
        annotations(destructive_hint = true, idempotent_hint = true),
        description = "Delete a private network. Refused (conflict) while sandboxes are attached: detach them \
                       (network_detach) or kill them first."
    )]
    async fn network_delete(
        &self,
        Parameters(a): Parameters<NetworkArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        api!(client.delete_network(&a.network));
        ok_json(json!({ "deleted": a.network }))
    }

    #[tool(
        annotations(destructive_hint = false, idempotent_hint = true),
        description = "Attach a sandbox to a private network: from now on it and the other members reach each \
                       other (by address and as <sandbox id or name>.<network>.internal). Returns the network \
                       with its members."
    )]
    async fn network_attach(
        &self,
        Parameters(a): Parameters<MembershipArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let net = api!(client.attach_network(&a.network, &a.sandbox_id));
        ok_json(to_json(&net))
    }

    #[tool(
        annotations(destructive_hint = false, idempotent_hint = true),
        description = "Detach a sandbox from a private network; its connections to the other members are cut \
                       at once. Returns the network with its remaining members."
    )]
    async fn network_detach(
        &self,
        Parameters(a): Parameters<MembershipArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let net = api!(client.detach_network(&a.network, &a.sandbox_id));
        ok_json(to_json(&net))
    }

    #[tool(
        annotations(destructive_hint = false),
        description = "Expose a TCP port of a sandbox over HTTP: returns a URL on the hearth daemon, carrying a \
                       signed token, that forwards HTTP and WebSocket requests to the server listening on that \
                       port inside the sandbox (start the server first, e.g. with exec in the background). \
                       Anyone with the URL can use it until expires_at (ttl_s, default 3600, at most 86400); \
                       append a path before the `?`, e.g. .../ports/8000/index.html?hearth_token=..."
    )]
    async fn port_expose(
        &self,
        Parameters(a): Parameters<PortExposeArgs>,
        ctx: RequestContext<RoleServer>,
    ) -> ToolResult {
        let client = tri!(self.client(&ctx));
        let t = api!(client.port_token(&a.sandbox_id, a.port, a.ttl_s));
        // The daemon answers with a path: make it a URL that works as is.
        let base = client.base_url().as_str().trim_end_matches('/').to_owned();
        ok_json(json!({
            "url": format!("{base}{}", t.url),
            "token": t.token,
            "expires_at": t.expires_at,
            "port": a.port,
            "sandbox_id": a.sandbox_id,
        }))
    }
}

/// Default `limit` of `network_log`.
const DEFAULT_LOG: usize = 50;

/// A sandbox's network as the tools show it: every field present (empty rule lists too).
fn network_json(id: &str, n: &hearth_api::SandboxNetwork) -> Value {
    json!({
        "sandbox_id": id,
        "address": n.address,
        "guest_address": n.guest_address,
        "egress": {
            "default": n.egress.default.as_str(),
            "allow": n.egress.allow,
            "deny": n.egress.deny,
        },
        "networks": n.networks,
    })
}

/// A template as the tools show it (`has_memory` instead of the internal snapshot id).
fn template_json(t: &hearth_api::Template) -> Value {
    json!({
        "name": t.name,
        "builtin": t.builtin,
        "from_sandbox": t.from_sandbox,
        "has_memory": t.snapshot_id.is_some(),
        "size_bytes": t.size_bytes,
        "created_at": t.created_at,
    })
}

fn decode(data_b64: &str) -> Result<Vec<u8>, CallToolResult> {
    hearth_client::decode_output(data_b64).map_err(|e| format::api_error(&e))
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for HearthMcp {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("hearth", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }
}
