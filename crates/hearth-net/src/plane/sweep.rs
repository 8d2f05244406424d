//! Removing what belongs to this plane but to no live sandbox: after a daemon restart, or a crash half-way.

use std::collections::HashSet;
use std::net::Ipv4Addr;

use super::cmd::{IP, NFT, ip_json, run};
use super::{NetError, Plane, link_name, lock};
use crate::ruleset::{self, HUB_TABLE, PEER_SET};

const NETNS_DIR: &str = "/run/netns";

pub(super) fn sweep(plane: &Plane, live: &HashSet<String>) -> Result<Vec<String>, NetError> {
    let mut removed = Vec::new();

    // Namespaces: scanned under the creation lock, so a namespace between `netns add` and its tag is never
    // mistaken for a dead one.
    {
        let _lock = lock()?;
        for name in hearth_namespaces()? {
            let Some(id) = name.strip_prefix("hearth-") else {
                continue;
            };
            if live.contains(id) || super::validate_id(id).is_err() {
                continue;
            }
            // Ours, untagged (a creation that died half-way), or without its uplink link (its uplink namespace
            // is gone, so it is dead whoever made it). Creation holds the lock, so none of these is in progress.
            let (alias, has_uplink) = inspect(&name);
            let foreign = alias.as_deref().is_some_and(|a| !a.is_empty() && a != plane.tag);
            if foreign && has_uplink {
                continue;
            }
            match plane.teardown(id) {
                Ok(pairs) => {
                    removed.push(format!("netns {name}"));
                    removed.extend(pairs.iter().map(|(a, b)| format!("peer {a} . {b}")));
                }
                // One namespace that cannot be removed must not keep the others.
                Err(e) => tracing::warn!(netns = %name, error = %e, "sweep"),
            }
        }
    }

    // Uplink links carrying our tag whose sandbox is not live (normally gone with their namespace).
    let expected: HashSet<String> = live.iter().map(|id| link_name(id)).collect();
    let uplink = Some(plane.cfg.uplink_netns.as_path());
    let links = ip_json(uplink, &["link", "show"])?;
    let mut ours = HashSet::new();
    for link in links.as_array().into_iter().flatten() {
        let Some(name) = link["ifname"].as_str() else {
            continue;
        };
        if !name.starts_with("hrth") || link["ifalias"].as_str() != Some(plane.tag.as_str()) {
            continue;
        }
        if expected.contains(name) {
            ours.insert(name.to_owned());
        } else {
            match run(uplink, IP, &["link", "del", name], None) {
                Ok(_) => removed.push(format!("link {name}")),
                Err(e) if super::is_missing(&e) => {}
                Err(e) => return Err(e),
            }
        }
    }

    // Hub pairs naming an address that no live link routes to.
    let routes = ip_json(uplink, &["-4", "route", "show"])?;
    let live_addrs: HashSet<Ipv4Addr> = routes
        .as_array()
        .into_iter()
        .flatten()
        .filter(|r| r["dev"].as_str().is_some_and(|d| ours.contains(d)))
        .filter_map(|r| r["dst"].as_str().and_then(|d| d.parse().ok()))
        .collect();
    let stale: Vec<(Ipv4Addr, Ipv4Addr)> = peer_pairs(plane)?
        .into_iter()
        .filter(|(a, b)| !live_addrs.contains(a) || !live_addrs.contains(b))
        .collect();
    if !stale.is_empty() {
        super::cmd::nft(uplink, &ruleset::remove_peer_pairs(&stale))?;
        removed.extend(stale.iter().map(|(a, b)| format!("peer {a} . {b}")));
    }
    Ok(removed)
}

/// The (directed) pairs currently in the hub's set.
pub(super) fn peer_pairs(plane: &Plane) -> Result<Vec<(Ipv4Addr, Ipv4Addr)>, NetError> {
    let command = format!("nft -j list set inet {HUB_TABLE} {PEER_SET}");
    let out = run(
        Some(&plane.cfg.uplink_netns),
        NFT,
        &["-j", "list", "set", "inet", HUB_TABLE, PEER_SET],
        None,
    )?;
    let v: serde_json::Value = serde_json::from_str(&out).map_err(|e| NetError::Parse {
        command: command.clone(),
        detail: e.to_string(),
    })?;
    let mut pairs = Vec::new();
    for item in v["nftables"].as_array().into_iter().flatten() {
        for elem in item["set"]["elem"].as_array().into_iter().flatten() {
            let concat = elem["concat"]
                .as_array()
                .or_else(|| elem["elem"]["val"]["concat"].as_array());
            let parsed = concat.and_then(|c| match c.as_slice() {
                [a, b] => Some((a.as_str()?.parse().ok()?, b.as_str()?.parse().ok()?)),
                _ => None,
            });
            match parsed {
                Some(p) => pairs.push(p),
                None => {
                    return Err(NetError::Parse {
                        command,
                        detail: format!("set element {elem}"),
                    });
                }
            }
        }
    }
    Ok(pairs)
}

fn hearth_namespaces() -> Result<Vec<String>, NetError> {
    let entries = match std::fs::read_dir(NETNS_DIR) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(NetError::Io {
                context: format!("listing {NETNS_DIR}"),
                source,
            });
        }
    };
    Ok(entries
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with("hearth-"))
        .collect())
}

/// The alias of `lo` in a namespace (`Some("")` when untagged, `None` when the namespace cannot be read:
/// a namespace file that is no namespace any more, which sweeping removes as well) and whether its uplink
/// link `up0` is there.
fn inspect(name: &str) -> (Option<String>, bool) {
    let Ok(v) = ip_json(None, &["-n", name, "link", "show"]) else {
        return (None, false);
    };
    let links = v.as_array().cloned().unwrap_or_default();
    let alias = links
        .iter()
        .find(|l| l["ifname"].as_str() == Some("lo"))
        .map(|l| l["ifalias"].as_str().unwrap_or("").to_owned());
    let has_uplink = links
        .iter()
        .any(|l| l["ifname"].as_str() == Some(crate::ruleset::UPLINK_IF));
    (alias, has_uplink)
}
