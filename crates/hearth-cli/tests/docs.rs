//! The shell examples of docs/api.md and docs/cli.md run against a real daemon and real VMs.
//!
//! A page's ```` ```sh test ```` blocks run in order in one `bash -euo pipefail` (so a variable set in one block
//! is seen by the next), with `HEARTH_URL` and `HEARTH_API_KEY` set, `hearth` on `PATH` and a scratch working
//! directory. A ```` ```text output ```` block right after a test block lists lines that block must print, in
//! order (other lines may come between them).

#![allow(clippy::unwrap_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

use support::Daemon;

/// One tested example: its script and the lines it must print.
#[derive(Debug)]
struct Example {
    line: usize,
    script: String,
    expect: Vec<String>,
}

/// The ```sh test blocks of a markdown page with their ```text output blocks.
fn examples(markdown: &str) -> Vec<Example> {
    let lines: Vec<&str> = markdown.lines().collect();
    let mut out: Vec<Example> = Vec::new();
    let mut i = 0;
    // Body of the fence opening at `i`, and the index after its closing fence.
    let fence = |i: usize| -> (String, usize) {
        let mut j = i + 1;
        let mut body = String::new();
        while j < lines.len() && lines[j].trim_end() != "```" {
            body.push_str(lines[j]);
            body.push('\n');
            j += 1;
        }
        assert!(j < lines.len(), "unclosed fence at line {}", i + 1);
        (body, j + 1)
    };
    while i < lines.len() {
        let l = lines[i].trim_end();
        if l == "```sh test" {
            let (script, next) = fence(i);
            out.push(Example {
                line: i + 1,
                script,
                expect: Vec::new(),
            });
            i = next;
        } else if l == "```text output" {
            let (body, next) = fence(i);
            let last = out
                .last_mut()
                .unwrap_or_else(|| panic!("output block at line {} follows no test block", i + 1));
            assert!(last.expect.is_empty(), "two output blocks for line {}", last.line);
            last.expect = body
                .lines()
                .filter(|l| !l.is_empty())
                .map(str::to_owned)
                .collect();
            i = next;
        } else {
            i += 1;
        }
    }
    out
}

fn doc(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../docs")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs a page's examples in one shell and checks each one's output.
fn run_page(name: &str) {
    run_page_on(name, &Daemon::start(), &[]);
}

/// [`run_page`] against `daemon`, with `env` added to the shell's environment.
fn run_page_on(name: &str, daemon: &Daemon, env: &[(String, String)]) {
    let page = doc(name);
    let examples = examples(&page);
    assert!(
        examples.len() >= 3,
        "{name} has only {} tested examples",
        examples.len()
    );
    let marker = |i: usize| format!("@@hearth-doc-example {i}@@");
    let mut script = String::new();
    for (i, ex) in examples.iter().enumerate() {
        script.push_str(&format!("echo '{}'\n{}", marker(i), ex.script));
    }
    script.push_str(&format!("echo '{}'\n", marker(examples.len())));

    let work = tempfile::tempdir().unwrap();
    let bin_dir: PathBuf = Path::new(env!("CARGO_BIN_EXE_hearth"))
        .parent()
        .unwrap()
        .to_owned();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .current_dir(work.path())
        .env("PATH", path)
        .env("HEARTH_URL", &daemon.url)
        .env("HEARTH_API_KEY", &daemon.key)
        .env("NO_COLOR", "1")
        .envs(env.iter().map(|(k, v)| (k, v)))
        .env_remove("HEARTH_DATA_DIR")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // Which example was running when the shell stopped.
    let reached = (0..=examples.len())
        .rev()
        .find(|i| stdout.contains(&marker(*i)))
        .unwrap_or(0);
    assert!(
        out.status.success(),
        "{name}: the example at line {} failed ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        examples.get(reached).map_or(0, |e| e.line),
        out.status
    );
    for (i, ex) in examples.iter().enumerate() {
        let start = stdout.find(&marker(i)).unwrap() + marker(i).len();
        let end = stdout.find(&marker(i + 1)).unwrap();
        let printed: Vec<&str> = stdout[start..end].lines().collect();
        let mut at = 0;
        for want in &ex.expect {
            match printed[at..].iter().position(|l| l.trim_end() == want) {
                Some(p) => at += p + 1,
                None => panic!(
                    "{name}: the example at line {} did not print {want:?} (in order); it printed:\n{}\n--- stderr\n{stderr}",
                    ex.line,
                    printed.join("\n")
                ),
            }
        }
    }
}

#[test]
fn examples_are_parsed_with_their_output() {
    let md = "text\n```sh test\necho a\necho b\n```\n\n```text output\na\n\nb\n```\n```sh\nnot tested\n```\n\
              ```sh test\ntrue\n```\n";
    let ex = examples(md);
    assert_eq!(ex.len(), 2);
    assert_eq!(ex[0].script, "echo a\necho b\n");
    assert_eq!(ex[0].expect, ["a", "b"]);
    assert_eq!((ex[1].line, ex[1].expect.len()), (15, 0));
}

#[test]
fn api_page_examples_run() {
    run_page("api.md");
}

#[test]
fn cli_page_examples_run() {
    run_page("cli.md");
}

/// docs/storage.md needs a bucket: a real S3 server on loopback (s3s-fs), and a daemon with networking (mounts
/// are served on the sandbox's gateway) that may reach a loopback endpoint.
#[test]
fn storage_page_examples_run() {
    use hearth_testkit::s3::{ACCESS_KEY_ID, REGION, S3Kind, S3Server, SECRET_ACCESS_KEY};
    let s3 = S3Server::start(S3Kind::S3sFs, "docs-bucket");
    let daemon = Daemon::start_with(|o| {
        o.network(hearth_testkit::Network::OwnUplink {
            prefix: "hdoc".into(),
            range: "10.213.93.0/24".into(),
        })
        .args(["--allow-private-bucket-endpoints"])
    });
    let env = [
        ("S3_ENDPOINT", s3.endpoint()),
        ("S3_BUCKET", s3.bucket().to_owned()),
        ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID.to_owned()),
        ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY.to_owned()),
        ("AWS_REGION", REGION.to_owned()),
    ]
    .map(|(k, v)| (k.to_owned(), v));
    run_page_on("storage.md", &daemon, &env);
}
