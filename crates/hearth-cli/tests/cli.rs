//! The `hearth` binary against a real `hearthd`. `sandbox_lifecycle` boots one QEMU guest (the `minimal`
//! template from images/build.sh) and drives everything through it; the other tests boot nothing.

#![allow(clippy::unwrap_used)]

mod support;

use std::process::Command;

use hearth_api::{CommandResult, Sandbox, SandboxList};
use support::{Daemon, ok, stderr, stdout};

const MISSING_ID: &str = "sbx_0123456789abcdef";

#[test]
fn errors_are_explained() {
    // Nothing listens on port 1: the hint says to start the daemon.
    let out = Command::new(env!("CARGO_BIN_EXE_hearth"))
        .args(["--url", "http://127.0.0.1:1", "--api-key", "x", "ls"])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "no data on stdout");
    let err = stderr(&out);
    assert!(
        err.starts_with("error: cannot reach hearthd at http://127.0.0.1:1"),
        "{err}"
    );
    assert!(err.contains("is hearthd running?"), "{err}");

    let d = Daemon::start();

    let out = d.run(&["info", MISSING_ID]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("not_found"), "{}", stderr(&out));

    // exec reports its own failures as 125 so they are not mistaken for the guest's status.
    let out = d.run(&["exec", MISSING_ID, "--", "true"]);
    assert_eq!(out.status.code(), Some(125));
    assert!(stderr(&out).contains("not_found"), "{}", stderr(&out));

    let out = d.hearth().args(["--api-key", "wrong", "ls"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("unauthorized") && err.contains("HEARTH_API_KEY"),
        "{err}"
    );

    let out = d.run(&["cp", "./a", "./b"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("must be in a sandbox"), "{}", stderr(&out));

    // With the daemon up and no sandboxes: an empty table, an empty JSON list, and the system report.
    assert_eq!(
        ok(d.run(&["ls"])),
        "ID  STATE  TEMPLATE  VCPUS  MEM  CREATED  ENDS\n"
    );
    let list: SandboxList = serde_json::from_str(&ok(d.run(&["ls", "--json"]))).unwrap();
    assert!(list.sandboxes.is_empty());
    let system: hearth_api::SystemInfo = serde_json::from_str(&ok(d.run(&["system", "--json"]))).unwrap();
    assert!(system.templates.iter().any(|t| t == "minimal"), "{system:?}");
    let doctor = ok(d.run(&["doctor"]));
    assert!(doctor.contains("daemon report (GET /v1/system)"), "{doctor}");
}

fn kernel_release() -> String {
    let manifest = std::fs::read_to_string(support::images_dir().join("manifest.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&manifest).unwrap();
    v["kernel_release"].as_str().unwrap().to_owned()
}

#[test]
fn sandbox_lifecycle() {
    let d = Daemon::start();
    let id = ok(d.run(&[
        "create",
        "--template",
        "minimal",
        "--memory",
        "256",
        "--meta",
        "suite=cli",
        "--env",
        "GREETING=hello",
    ]))
    .trim()
    .to_owned();
    assert!(hearth_api::is_valid_sandbox_id(&id), "{id:?}");

    // ls: the table and JSON both show it; metadata filters select it or not.
    let table = ok(d.run(&["ls"]));
    assert!(
        table
            .lines()
            .nth(1)
            .unwrap()
            .starts_with(&format!("{id}  running  minimal")),
        "{table}"
    );
    let list: SandboxList =
        serde_json::from_str(&ok(d.run(&["--json", "ls", "--meta", "suite=cli"]))).unwrap();
    assert_eq!(list.sandboxes.len(), 1);
    assert_eq!(list.sandboxes[0].id, id);
    assert_eq!(list.sandboxes[0].memory_mib, 256);
    let list: SandboxList =
        serde_json::from_str(&ok(d.run(&["--json", "ls", "--meta", "suite=other"]))).unwrap();
    assert!(list.sandboxes.is_empty());
    let info: Sandbox = serde_json::from_str(&ok(d.run(&["info", &id, "--json"]))).unwrap();
    assert_eq!(info.metadata.get("suite").map(String::as_str), Some("cli"));

    exec_paths(&d, &id);
    file_paths(&d, &id);
    process_paths(&d, &id);

    let out = ok(d.run(&["timeout", &id, "600"]));
    assert!(out.starts_with(&format!("{id} ends at ")), "{out}");

    assert_eq!(ok(d.run(&["rm", &id])).trim(), id);
    let list: SandboxList = serde_json::from_str(&ok(d.run(&["ls", "--json"]))).unwrap();
    assert!(list.sandboxes.is_empty(), "{list:?}");
    let out = d.run(&["info", &id]);
    assert!(stderr(&out).contains("not_found"), "{}", stderr(&out));
}

fn exec_paths(d: &Daemon, id: &str) {
    // argv form; output is the guest kernel's release, which the images manifest names.
    assert_eq!(
        ok(d.run(&["exec", id, "--", "uname", "-r"])).trim(),
        kernel_release()
    );

    // Exit codes pass through, from argv and from a single shell line.
    let out = d.run(&["exec", id, "--", "sh", "-c", "exit 7"]);
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    let out = d.run(&["exec", id, "--", "echo out; echo err >&2; exit 3"]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(stdout(&out), "out\n");
    assert_eq!(stderr(&out), "err\n");

    // Sandbox env, per-command env and cwd.
    let out = ok(d.run(&[
        "exec",
        id,
        "-e",
        "WHO=world",
        "--cwd",
        "/tmp",
        "--",
        "echo $GREETING $WHO; pwd",
    ]));
    assert_eq!(out, "hello world\n/tmp\n");

    // A signal becomes 128+N.
    let out = d.run(&["exec", id, "--", "kill -TERM $$"]);
    assert_eq!(out.status.code(), Some(143), "{}", stderr(&out));

    // The command's timeout: 124 and a message.
    let out = d.run(&["exec", id, "--timeout", "1", "--", "sleep", "30"]);
    assert_eq!(out.status.code(), Some(124));
    assert!(stderr(&out).contains("timed out"), "{}", stderr(&out));

    // --stdin sends local stdin.
    let out = d.run_with_stdin(&["exec", id, "--stdin", "--", "tr", "a-z", "A-Z"], b"shout\n");
    assert_eq!(ok(out), "SHOUT\n");

    // --json gives the buffered result and still passes the status on.
    let out = d.run(&["--json", "exec", id, "--", "echo hi; exit 2"]);
    assert_eq!(out.status.code(), Some(2));
    let result: CommandResult = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(result.stdout, "hi\n");
    assert_eq!(result.exit_code, 2);

    // Binary output arrives byte for byte.
    let out = ok_bytes(d.run(&["exec", id, "--", "printf '\\000\\377\\001'"]));
    assert_eq!(out, vec![0u8, 0xff, 1]);
}

fn ok_bytes(out: std::process::Output) -> Vec<u8> {
    assert!(out.status.success(), "{}", stderr(&out));
    out.stdout
}

fn file_paths(d: &Daemon, id: &str) {
    let dir = tempfile::tempdir().unwrap();
    // 300 KiB of every byte value: more than one protocol frame, and not text.
    let data: Vec<u8> = (0..300 * 1024).map(|i| (i * 7 % 256) as u8).collect();
    let local = dir.path().join("blob.bin");
    std::fs::write(&local, &data).unwrap();

    ok(d.run(&["files", "mkdir", id, "/root/up/nested"]));
    ok(d.run(&["cp", local.to_str().unwrap(), &format!("{id}:/root/up/nested/")]));
    let back = dir.path().join("back.bin");
    ok(d.run(&[
        "cp",
        &format!("{id}:/root/up/nested/blob.bin"),
        back.to_str().unwrap(),
    ]));
    assert!(
        std::fs::read(&back).unwrap() == data,
        "the round trip changed the bytes"
    );

    // Into a local directory: the remote name is kept.
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    ok(d.run(&[
        "cp",
        &format!("{id}:/root/up/nested/blob.bin"),
        sub.to_str().unwrap(),
    ]));
    assert!(std::fs::read(sub.join("blob.bin")).unwrap() == data);

    // stdin and stdout.
    ok(d.run_with_stdin(&["cp", "-", &format!("{id}:/root/from-stdin")], b"piped\n"));
    assert_eq!(
        ok(d.run(&["cp", &format!("{id}:/root/from-stdin"), "-"])),
        "piped\n"
    );

    // A missing remote file fails before anything is created locally.
    let nothing = dir.path().join("nothing");
    let out = d.run(&["cp", &format!("{id}:/root/missing"), nothing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("not_found"), "{}", stderr(&out));
    assert!(!nothing.exists());

    let stat: hearth_api::FileInfo = serde_json::from_str(&ok(d.run(&[
        "--json",
        "files",
        "stat",
        id,
        "/root/up/nested/blob.bin",
    ])))
    .unwrap();
    assert_eq!(stat.size, data.len() as u64);
    assert_eq!(stat.kind, hearth_api::FileKind::File);
    let text = ok(d.run(&["files", "stat", id, "/root/up/nested/blob.bin"]));
    assert!(text.contains(&format!("size      {}", data.len())), "{text}");

    ok(d.run(&[
        "files",
        "mv",
        id,
        "/root/up/nested/blob.bin",
        "/root/up/moved.bin",
    ]));
    let listing = ok(d.run(&["files", "ls", id, "/root/up"]));
    assert!(listing.starts_with("MODE"), "{listing}");
    assert!(
        listing.contains("moved.bin") && listing.contains("nested/"),
        "{listing}"
    );

    let out = d.run(&["files", "rm", id, "/root/up"]);
    assert_eq!(out.status.code(), Some(1), "a non-empty directory needs -r");
    ok(d.run(&["files", "rm", id, "/root/up", "-r"]));
    let out = d.run(&["files", "stat", id, "/root/up"]);
    assert!(stderr(&out).contains("not_found"), "{}", stderr(&out));
}

fn process_paths(d: &Daemon, id: &str) {
    let pid = ok(d.run(&["exec", id, "--background", "--", "echo started; sleep 300"]));
    let pid = pid.trim().to_owned();
    assert!(pid.parse::<u32>().is_ok(), "{pid:?}");
    let ps = ok(d.run(&["ps", id]));
    assert!(
        ps.lines()
            .any(|l| l.starts_with(&format!("{pid} ")) && l.contains("running")),
        "{ps}"
    );
    ok(d.run(&["kill", id, &pid, "--signal", "TERM"]));
    let out = d.run(&["wait", id, &pid]);
    assert_eq!(out.status.code(), Some(143), "{}", stderr(&out));
    assert_eq!(stdout(&out), "started\n");
}
