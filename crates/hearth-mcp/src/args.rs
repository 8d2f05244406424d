//! The tools' input types. Their doc comments become the JSON Schema descriptions an agent reads, so they say
//! what a value means and what happens when it is left out. Unknown fields are refused so a misspelt argument
//! comes back as a tool error instead of being ignored.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::Deserialize;

/// Largest `length` of one `read_file` call.
pub const MAX_READ: u64 = 256 * 1024;

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSandboxArgs {
    /// Template (guest image) to boot, e.g. "minimal" or "debian". Default: the daemon's default template.
    #[serde(default)]
    pub template: Option<String>,
    /// Virtual CPUs. Default: the daemon's default (usually 1).
    #[serde(default)]
    pub vcpus: Option<u32>,
    /// Memory in MiB. Default: the daemon's default.
    #[serde(default)]
    pub memory_mib: Option<u32>,
    /// Seconds until the sandbox is destroyed automatically. Default: the daemon's default (e.g. 300). Extend it
    /// later with set_timeout.
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// Environment variables every command in the sandbox sees.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Free-form labels kept with the sandbox (filter list_sandboxes by them).
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
    /// Egress: destinations the sandbox may reach. Rules are IP addresses or CIDRs ("203.0.113.0/24"), domain
    /// names ("example.com", that name only) and wildcards ("*.example.com", every name below it). Only
    /// meaningful with deny_all (otherwise everything not denied is reachable anyway).
    #[serde(default)]
    pub allow: Vec<String>,
    /// Egress: destinations the sandbox may not reach (same rule syntax as allow; deny wins over allow).
    #[serde(default)]
    pub deny: Vec<String>,
    /// Deny all egress that no allow rule names. Default false: the internet is reachable except deny rules and
    /// the always-denied private, link-local and host addresses.
    #[serde(default)]
    pub deny_all: bool,
    /// Private networks (names from network_list, or net_ ids) to attach the sandbox to.
    #[serde(default)]
    pub networks: Vec<String>,
    /// A name, unique among live sandboxes: private-network peers reach it as <name>.<network>.internal.
    /// 1-32 characters of a-z, 0-9 and '-', starting with a letter.
    #[serde(default)]
    pub name: Option<String>,
    /// Buckets to mount as directories (registered by the operator; bucket_list names them). The bucket's
    /// credentials stay on the host.
    #[serde(default)]
    pub mounts: Vec<MountArg>,
}

/// One bucket mount.
#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MountArg {
    /// Absolute directory in the sandbox, e.g. "/mnt/data" (not "/" nor a system directory).
    pub path: String,
    /// The registered bucket's name (see bucket_list).
    pub bucket: String,
    /// Only this sub-prefix of the bucket, e.g. "runs/42/".
    #[serde(default)]
    pub prefix: Option<String>,
    /// Refuse every change (writes fail with EROFS). Default false.
    #[serde(default)]
    pub read_only: Option<bool>,
}

impl MountArg {
    pub fn spec(self) -> hearth_api::MountSpec {
        hearth_api::MountSpec {
            path: self.path,
            bucket: self.bucket,
            prefix: self.prefix,
            read_only: self.read_only,
        }
    }
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MountAddArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    #[serde(flatten)]
    pub mount: MountArg,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MountRemoveArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The mount's directory in the sandbox.
    pub path: String,
}

#[derive(Debug, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListSandboxesArgs {
    /// Only sandboxes in this state, e.g. "running" or "failed".
    #[serde(default)]
    pub state: Option<String>,
    /// Only sandboxes whose metadata contains all of these pairs.
    #[serde(default)]
    pub metadata: BTreeMap<String, String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SandboxArgs {
    /// The sandbox's id, as returned by create_sandbox or list_sandboxes.
    pub sandbox_id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ExecArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// A shell command line, run with `/bin/sh -c` (pipes, redirections and `&&` work).
    pub command: String,
    /// Working directory. Default: /root.
    #[serde(default)]
    pub cwd: Option<String>,
    /// Extra environment variables for this command.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Kill the command after this many seconds. Default: 60.
    #[serde(default)]
    pub timeout_s: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReadFileArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Absolute path of the file in the sandbox.
    pub path: String,
    /// Byte offset to start reading at. Default: 0.
    #[serde(default)]
    pub offset: Option<u64>,
    /// Number of bytes to read, at most 262144 (256 KiB, also the default). Read a larger file in pieces.
    #[serde(default)]
    pub length: Option<u64>,
}

/// How `write_file`'s `content` is encoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Plain text, written as UTF-8.
    #[default]
    Text,
    /// Standard base64 of arbitrary bytes.
    Base64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WriteFileArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Absolute path of the file in the sandbox; created or replaced, missing parent directories are created.
    pub path: String,
    /// The new content of the file.
    pub content: String,
    /// "text" (default) or "base64" for binary content.
    #[serde(default)]
    pub encoding: Encoding,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ListFilesArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Directory to list. Default: /root.
    #[serde(default)]
    pub path: Option<String>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SetTimeoutArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// Seconds from now until the sandbox is destroyed automatically.
    pub timeout_s: u64,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ForkArgs {
    /// The sandbox to fork; it keeps running.
    pub sandbox_id: String,
    /// How many children, 1 to 16. Default: 1.
    #[serde(default)]
    pub count: Option<u32>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTemplateArgs {
    /// The running sandbox to save (it keeps running).
    pub sandbox_id: String,
    /// Name of the new template: 1-63 characters of lowercase letters, digits and `-`, not starting with `-`.
    /// Pass it as `template` to create_sandbox.
    pub name: String,
    /// Also save the sandbox's running memory, so sandboxes created from the template start with its processes
    /// already running (e.g. a started server) instead of booting. Default false (files only).
    #[serde(default)]
    pub include_memory: bool,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TemplateArgs {
    /// The template's name, as list_templates shows it.
    pub name: String,
}

/// What egress no rule names gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum EgressDefault {
    /// Everything not denied may be reached (the always-denied addresses stay denied).
    Allow,
    /// Only what an allow rule names may be reached.
    Deny,
}

impl From<EgressDefault> for hearth_api::EgressDefault {
    fn from(d: EgressDefault) -> Self {
        match d {
            EgressDefault::Allow => hearth_api::EgressDefault::Allow,
            EgressDefault::Deny => hearth_api::EgressDefault::Deny,
        }
    }
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SetPolicyArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// "allow": everything not denied is reachable; "deny": only what `allow` names is reachable.
    pub default: EgressDefault,
    /// Rules for destinations that may be reached: IP addresses or CIDRs ("203.0.113.7", "203.0.113.0/24",
    /// "2001:db8::/32"), domain names ("example.com", that name only) and wildcards ("*.example.com", every
    /// name below example.com but not example.com itself).
    #[serde(default)]
    pub allow: Vec<String>,
    /// Rules for destinations that may not be reached, same syntax as allow. Deny wins over allow.
    #[serde(default)]
    pub deny: Vec<String>,
}

/// Largest `limit` of `network_log`: the daemon keeps this many entries per sandbox.
pub const MAX_LOG: usize = 1000;

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkLogArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// How many of the newest entries to return, 1-1000. Default 50.
    #[serde(default)]
    pub limit: Option<usize>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkNameArgs {
    /// Name of the new private network: 1-32 characters of a-z, 0-9 and '-', starting with a letter (it becomes
    /// a DNS label: members reach each other as <sandbox>.<network>.internal).
    pub name: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NetworkArgs {
    /// The private network's name (or net_ id), as network_list shows it.
    pub network: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct MembershipArgs {
    /// The private network's name (or net_ id).
    pub network: String,
    /// The sandbox's id.
    pub sandbox_id: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PortExposeArgs {
    /// The sandbox's id.
    pub sandbox_id: String,
    /// The TCP port a server in the sandbox listens on (1-65535), e.g. 8000.
    pub port: u16,
    /// Seconds the returned URL keeps working, 1-86400. Default 3600.
    #[serde(default)]
    pub ttl_s: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ProjectUsageArgs {
    /// The project; default: the key's own (needed only by an admin key, which sees every project).
    #[serde(default)]
    pub project: Option<String>,
}
