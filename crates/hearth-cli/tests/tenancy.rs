//! `hearth project`, `hearth key`, `hearth audit verify` and `hearth audit export` against the real daemon (no VM).

#![allow(clippy::unwrap_used)]

mod support;

use hearth_api::{CreatedKey, KeyList, ProjectList};
use support::{Daemon, ok, stderr};

#[test]
fn projects_keys_and_the_audit_chain_from_the_command_line() {
    let d = Daemon::start();
    assert_eq!(
        ok(d.run(&["project", "create", "team-a", "--max-running", "2"])),
        "team-a\n"
    );
    let projects: ProjectList = serde_json::from_str(&ok(d.run(&["project", "ls", "--json"]))).unwrap();
    let a = projects.projects.iter().find(|p| p.name == "team-a").unwrap();
    assert_eq!(a.quota.max_running, Some(2));
    assert!(projects.projects.iter().any(|p| p.name == "default"));
    // A disk limit takes sizes with units; usage shows each figure against its limit.
    ok(d.run(&[
        "project",
        "quota",
        "team-a",
        "--max-running",
        "2",
        "--max-disk-bytes",
        "20G",
    ]));
    let usage = ok(d.run(&["project", "usage", "team-a"]));
    assert!(
        usage.contains("disk_bytes") && usage.contains(&format!("0 / {}", 20u64 << 30)),
        "{usage}"
    );
    assert!(usage.contains("running") && usage.contains("0 / 2"), "{usage}");
    let bad = d.run(&["project", "quota", "team-a", "--max-disk-bytes", "20X"]);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr(&bad));

    let out = ok(d.run(&[
        "key",
        "create",
        "--project",
        "team-a",
        "--role",
        "viewer",
        "--expires",
        "30d",
        "--json",
    ]));
    let created: CreatedKey = serde_json::from_str(&out).unwrap();
    assert!(
        created.key.starts_with("hk_") && created.id.starts_with("key_"),
        "{out}"
    );
    assert!(created.expires_at.is_some());
    // Without --json: the key alone on stdout.
    let plain = ok(d.run(&["key", "create", "--project", "team-a", "--role", "member"]));
    assert!(
        plain.trim().starts_with("hk_") && plain.lines().count() == 1,
        "{plain}"
    );

    // The new key works through the CLI, and its role holds.
    let as_viewer = |args: &[&str]| {
        d.hearth()
            .args(["--api-key", &created.key])
            .args(args)
            .output()
            .unwrap()
    };
    assert_eq!(as_viewer(&["ls"]).status.code(), Some(0));
    let out = as_viewer(&["project", "create", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("forbidden"), "{}", stderr(&out));

    let list = ok(d.run(&["key", "ls", "--json"]));
    assert!(!list.contains(&created.key), "keys are never listed");
    let keys: KeyList = serde_json::from_str(&list).unwrap();
    assert!(
        keys.keys
            .iter()
            .any(|k| k.id == created.id && k.last_used_at.is_some())
    );

    assert_eq!(
        ok(d.run(&["key", "revoke", &created.id])),
        format!("{}\n", created.id)
    );
    let out = as_viewer(&["ls"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("unauthorized"), "{}", stderr(&out));

    let verified = ok(d.run(&["audit", "verify"]));
    assert!(verified.starts_with("ok: "), "{verified}");

    // The JSON Lines export: one entry per line, the same chain, verifiable offline; filters apply.
    let export = ok(d.run(&["audit", "export"]));
    let lines: Vec<hearth_api::AuditEntry> =
        export.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(lines.len() >= 4, "{export}");
    assert!(lines.windows(2).all(|w| w[1].seq == w[0].seq + 1));
    assert!(lines.iter().any(|e| e.action == "POST /v1/projects"));
    assert!(
        lines
            .iter()
            .any(|e| e.action == "DELETE /v1/keys/{id}" && e.target.contains(&created.id))
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("audit.jsonl");
    std::fs::write(&file, &export).unwrap();
    let file_arg = file.to_str().unwrap();
    let verified = ok(d.run(&["audit", "verify", "--file", file_arg]));
    assert_eq!(
        verified,
        format!(
            "ok: {} entries, last hash {}\n",
            lines.len(),
            lines[lines.len() - 1].hash
        )
    );
    // One changed byte (a status code) breaks the chain.
    let tampered = export.replacen("\"status\":201", "\"status\":200", 1);
    assert_ne!(tampered, export);
    std::fs::write(&file, tampered).unwrap();
    let out = d.run(&["audit", "verify", "--file", file_arg]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let after = lines[1].seq.to_string();
    let tail = ok(d.run(&["audit", "export", "--after", &after]));
    assert_eq!(tail.lines().count(), lines.len() - 2, "{tail}");
}
