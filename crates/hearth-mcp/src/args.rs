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
