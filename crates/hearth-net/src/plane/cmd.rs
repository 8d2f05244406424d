//! Running `ip`, `nft` and sysctl writes inside a given network namespace.
//!
//! A child process inherits the network namespace of the thread that spawns it, so every command is spawned
//! from a short-lived thread that joined the namespace ([`crate::netns::in_netns`]); that works for any
//! namespace path (`/proc/self/ns/net`, `/run/netns/…`), named or not.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::NetError;

/// The `ip` binary (iproute2).
pub(crate) const IP: &str = "ip";
/// The `nft` binary (nftables).
pub(crate) const NFT: &str = "nft";

/// Finds a tool in the usual sbin directories first: a test runner's PATH often lacks them.
fn tool(name: &str) -> PathBuf {
    for dir in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        let p = Path::new(dir).join(name);
        if p.is_file() {
            return p;
        }
    }
    PathBuf::from(name)
}

/// Runs `program args…` in `ns` (the caller's namespace when `None`), feeding `input` on stdin. Returns
/// stdout; a non-zero exit becomes [`NetError::Command`] with the command line and its stderr.
pub(crate) fn run(
    ns: Option<&Path>,
    program: &str,
    args: &[&str],
    input: Option<&str>,
) -> Result<String, NetError> {
    let path = tool(program);
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let input = input.map(str::to_owned);
    let command_line = format!("{program} {}", args.join(" "));
    let spawn = move || -> std::io::Result<std::process::Output> {
        let mut child = Command::new(&path)
            .args(&args)
            .stdin(if input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        if let (Some(text), Some(mut stdin)) = (input, child.stdin.take()) {
            stdin.write_all(text.as_bytes())?;
        }
        child.wait_with_output()
    };
    let output = match ns {
        Some(ns) => crate::netns::in_netns(ns, spawn),
        None => spawn(),
    }
    .map_err(|source| NetError::Io {
        context: format!("running `{command_line}`"),
        source,
    })?;
    if output.status.success() {
        Ok(String::from_utf8_lossy(&output.stdout).into_owned())
    } else {
        Err(NetError::Command {
            command: command_line,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}

/// Runs an `ip -batch -` script in `ns` (stops at the first failing line).
pub(crate) fn ip_batch(ns: Option<&Path>, script: &str) -> Result<(), NetError> {
    run(ns, IP, &["-batch", "-"], Some(script)).map(drop)
}

/// Runs `ip -json args…` in `ns` and parses the output.
pub(crate) fn ip_json(ns: Option<&Path>, args: &[&str]) -> Result<serde_json::Value, NetError> {
    let mut all = vec!["-json"];
    all.extend_from_slice(args);
    let out = run(ns, IP, &all, None)?;
    if out.trim().is_empty() {
        return Ok(serde_json::Value::Array(Vec::new()));
    }
    serde_json::from_str(&out).map_err(|e| NetError::Parse {
        command: format!("ip {}", all.join(" ")),
        detail: e.to_string(),
    })
}

/// Applies an nftables script in `ns` as one transaction.
pub(crate) fn nft(ns: Option<&Path>, script: &str) -> Result<(), NetError> {
    run(ns, NFT, &["-f", "-"], Some(script)).map(drop)
}

/// Whether an error only says the object to delete is already gone.
pub(crate) fn is_missing(e: &NetError) -> bool {
    match e {
        NetError::Command { stderr, .. } => {
            stderr.contains("Cannot find device")
                || stderr.contains("does not exist")
                || stderr.contains("No such file or directory")
                || stderr.contains("Cannot open network namespace")
        }
        _ => false,
    }
}

/// Writes sysctl values (`(path under /proc/sys/net, value)`) inside `ns` and reads each back, since a write
/// in the wrong namespace would otherwise go unnoticed. Paths that do not exist (IPv6 disabled in the kernel)
/// are skipped when `optional` is set for them.
pub(crate) fn sysctls(ns: &Path, values: &[(&str, &str, bool)]) -> Result<(), NetError> {
    let values: Vec<(String, String, bool)> = values
        .iter()
        .map(|(p, v, o)| (format!("/proc/sys/net/{p}"), v.to_string(), *o))
        .collect();
    let ns_owned = ns.to_path_buf();
    crate::netns::in_netns(ns, move || {
        for (path, value, optional) in &values {
            match std::fs::write(path, value) {
                Ok(()) => {}
                Err(e) if *optional && e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(std::io::Error::new(e.kind(), format!("{path}: {e}"))),
            }
            let back = std::fs::read_to_string(path)?;
            if back.trim() != value {
                return Err(std::io::Error::other(format!(
                    "{path} reads {:?} after writing {value:?}",
                    back.trim()
                )));
            }
        }
        Ok(())
    })
    .map_err(|source| NetError::Io {
        context: format!("sysctl in {}", ns_owned.display()),
        source,
    })
}
