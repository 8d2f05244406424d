//! hearth's public wire types.
//!
//! # Layout
//! - [`sandbox`]: create/list/info requests and the sandbox record.
//! - [`bucket`]: buckets registered as named credentials, and mounts of them in sandboxes.
//! - [`command`]: command execution, streamed events and background processes.
//! - [`file`]: file metadata and file-operation requests.
//! - [`network`]: egress policy, private networks, the egress audit log, exposed-port tokens.
//! - [`system`]: host/VMM report served by `GET /v1/system`.
//! - [`tenancy`]: projects, scoped API keys, quotas and the tamper-evident audit log.
//! - [`error`]: the error body and its stable machine-readable [`ErrorCode`]s.
//!
//! Everything here is plain data (serde), shared by the daemon, the Rust client, the CLI and (through the
//! generated OpenAPI document) the TypeScript SDK. Requests reject unknown fields so typos fail loudly.

pub mod boundary;
pub mod bucket;
pub mod command;
pub mod error;
pub mod file;
pub mod network;
pub mod sandbox;
pub mod storage;
pub mod system;
pub mod tenancy;

pub use boundary::*;
pub use bucket::*;
pub use command::*;
pub use error::*;
pub use file::*;
pub use network::*;
pub use sandbox::*;
pub use storage::*;
pub use system::*;
pub use tenancy::*;

/// Validates a sandbox id: `sbx_` followed by 16 lowercase hex digits. Ids are used to build host paths, so
/// nothing else may pass.
pub fn is_valid_sandbox_id(id: &str) -> bool {
    id.len() == 20
        && id.starts_with("sbx_")
        && id[4..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Validates a snapshot id: `snp_` followed by 16 lowercase hex digits (used to build host paths).
pub fn is_valid_snapshot_id(id: &str) -> bool {
    id.len() == 20
        && id.starts_with("snp_")
        && id[4..]
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Validates a template name: 1-63 chars of `[a-z0-9-]`, starting with a letter or digit.
pub fn is_valid_template_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
}

/// Parses a byte count: digits, then optionally a suffix K, M, G or T (powers of 1024; any case, with or
/// without `i` and `B`, after optional spaces: `20G`, `512MiB`, `1tb`, `3 K`, `4096`).
pub fn parse_byte_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{text:?} is not a size (digits, then K, M, G or T)"))?;
    let unit = unit.trim().to_ascii_uppercase();
    let shift = match unit.trim_end_matches("IB").trim_end_matches('B') {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(format!("{text:?}: unknown size suffix (K, M, G or T)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes() {
        assert_eq!(parse_byte_size("4096"), Ok(4096));
        assert_eq!(parse_byte_size("20G"), Ok(20 << 30));
        assert_eq!(parse_byte_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_byte_size("1tb"), Ok(1 << 40));
        assert_eq!(parse_byte_size("3 K"), Ok(3 << 10));
        assert!(parse_byte_size("").is_err());
        assert!(parse_byte_size("G").is_err());
        assert!(parse_byte_size("1X").is_err());
        assert!(parse_byte_size("-1").is_err());
        assert!(parse_byte_size("99999999999T").is_err());
    }

    #[test]
    fn sandbox_ids() {
        assert!(is_valid_sandbox_id("sbx_0123456789abcdef"));
        assert!(!is_valid_sandbox_id("sbx_0123456789ABCDEF"));
        assert!(!is_valid_sandbox_id("sbx_../../etc/passwd"));
        assert!(!is_valid_sandbox_id("sbx_0123456789abcde\0"));
        assert!(!is_valid_sandbox_id(""));
    }

    #[test]
    fn template_names() {
        assert!(is_valid_template_name("debian"));
        assert!(is_valid_template_name("my-tpl-2"));
        assert!(!is_valid_template_name("../x"));
        assert!(!is_valid_template_name("-x"));
        assert!(!is_valid_template_name("Debian"));
    }
}
