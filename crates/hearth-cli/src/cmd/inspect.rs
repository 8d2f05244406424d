//! `hearth inspect ID`: the boundary around a sandbox as the host reports it (`GET /v1/sandboxes/{id}/boundary`).

use hearth_api::{SandboxBoundary, VmmProcess};

use crate::Ctx;
use crate::output::key_values;

pub async fn inspect(ctx: &Ctx, id: &str) -> anyhow::Result<u8> {
    let b = ctx.client()?.boundary(id).await?;
    ctx.emit(&b, || details(&b))?;
    Ok(0)
}

/// The human form: one line per fact, the VMM's first.
pub fn details(b: &SandboxBoundary) -> String {
    let mut pairs = vec![("sandbox", format!("{} ({})", b.sandbox_id, b.state.as_str()))];
    match &b.vmm {
        Some(v) => pairs.extend(vmm_lines(v)),
        None => pairs.push(("vmm", "no VM process (the sandbox is not running)".to_owned())),
    }
    let g = &b.guest;
    pairs.push((
        "guest",
        format!(
            "kernel {} (reported by the guest), {} vCPUs, {} MiB",
            g.kernel.as_deref().unwrap_or("unknown"),
            g.vcpus,
            g.memory_mib
        ),
    ));
    let n = &b.network;
    let network = if !n.enabled {
        "none (no network device)".to_owned()
    } else {
        let egress = n.egress.as_ref().map_or_else(String::new, |e| {
            let allow = &e.allow;
            if allow.is_empty() {
                "; egress: nothing allowed".to_owned()
            } else {
                format!("; egress allowed to: {}", allow.join(", "))
            }
        });
        let nets = if n.private_networks.is_empty() {
            String::new()
        } else {
            format!("; private networks: {}", n.private_networks.join(", "))
        };
        format!(
            "{}{egress}{nets}; inbound refused",
            n.address.as_deref().unwrap_or("-")
        )
    };
    pairs.push(("network", network));
    let mounts: Vec<String> = b
        .mounts
        .iter()
        .map(|m| {
            format!(
                "{} <- bucket {}{}",
                m.path,
                m.bucket,
                if m.read_only { " (ro)" } else { "" }
            )
        })
        .collect();
    pairs.push((
        "mounts",
        if mounts.is_empty() {
            "none".to_owned()
        } else {
            mounts.join("; ")
        },
    ));
    key_values(&pairs)
}

fn vmm_lines(v: &VmmProcess) -> Vec<(&'static str, String)> {
    let shared: Vec<&str> = v
        .namespaces
        .iter()
        .filter(|n| n.shared_with_daemon)
        .map(|n| n.kind.as_str())
        .collect();
    let own: Vec<&str> = v
        .namespaces
        .iter()
        .filter(|n| !n.shared_with_daemon)
        .map(|n| n.kind.as_str())
        .collect();
    let pivoted = v.root == "/" && own.contains(&"mnt");
    let c = &v.cgroup;
    let cgroup = if c.shared_with_daemon {
        format!(
            "{} {} (the daemon's own: no per-sandbox limits)",
            c.version, c.path
        )
    } else {
        let or_dash = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".to_owned());
        format!(
            "{} {}: cpu.max {}, memory.max {}, pids.max {}",
            c.version,
            c.path,
            or_dash(&c.cpu_max),
            or_dash(&c.memory_max),
            or_dash(&c.pids_max)
        )
    };
    vec![
        (
            "vmm",
            format!("{} {} ({}), pid {}", v.kind, v.version, v.accel, v.pid),
        ),
        ("binary", v.binary.clone()),
        (
            "identity",
            format!(
                "uid {} gid {}, root {}{}",
                v.uids.first().map_or("?".into(), u32::to_string),
                v.gids.first().map_or("?".into(), u32::to_string),
                v.root,
                if pivoted {
                    " of its own mount namespace (pivoted into its jail)"
                } else {
                    ""
                }
            ),
        ),
        (
            "privileges",
            format!(
                "seccomp {} ({} filters), no_new_privs {}, capabilities {}",
                v.seccomp, v.seccomp_filters, v.no_new_privs, v.capabilities
            ),
        ),
        (
            "namespaces",
            format!(
                "own: {}; shared with the daemon: {}",
                if own.is_empty() {
                    "none".into()
                } else {
                    own.join(", ")
                },
                if shared.is_empty() {
                    "none".into()
                } else {
                    shared.join(", ")
                }
            ),
        ),
        ("cgroup", cgroup),
        (
            "resources",
            format!("{} threads, {} MiB resident", v.threads, v.rss_bytes >> 20),
        ),
    ]
}
