//! `hearth template build` against a real `hearthd` (recipes on the `minimal` template, real QEMU guests): the
//! build log on stderr and only the name on stdout when stderr is not a terminal, nothing but JSON with
//! `--json`, a bar over the steps with an ETA on a terminal (through `script`, which gives the command a pty),
//! painted only without `NO_COLOR`, and a failing step reported with its output.

#![allow(clippy::unwrap_used)]

mod support;

use std::process::{Command, Output};

use support::{Daemon, ok, stderr, stdout};

const RECIPE: &str =
    r#"{"base": "minimal", "steps": ["echo step-one-output", "sleep 1; echo step-two-output >&2"]}"#;

/// True when `text` holds an SGR (colour) escape sequence.
fn has_colour(text: &str) -> bool {
    text.match_indices("\u{1b}[").any(|(i, _)| {
        let rest = &text[i + 2..];
        let params = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b';')
            .count();
        params > 0 && rest.as_bytes().get(params) == Some(&b'm')
    })
}

/// Runs `hearth ARGS...` on a pseudo-terminal (stdout and stderr both go to it); returns what it printed.
fn on_a_terminal(d: &Daemon, args: &[&str], no_color: bool) -> Output {
    let template = d.hearth();
    let mut line = shell_quote(env!("CARGO_BIN_EXE_hearth"));
    for a in args {
        line.push(' ');
        line.push_str(&shell_quote(a));
    }
    let mut cmd = Command::new("script");
    cmd.args(["-q", "-e", "-c", &line, "/dev/null"]);
    for (k, v) in template.get_envs() {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    cmd.env("TERM", "xterm-256color").env_remove("NO_COLOR");
    if no_color {
        cmd.env("NO_COLOR", "1");
    }
    cmd.output().unwrap()
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[test]
fn template_build_progress_on_pipes_and_terminals() {
    let d = Daemon::start();
    let dir = tempfile::tempdir().unwrap();
    let recipe = dir.path().join("recipe.json");
    std::fs::write(&recipe, RECIPE).unwrap();
    let recipe = recipe.to_str().unwrap();

    // Not a terminal: the build log on stderr, only the name on stdout, no bar.
    let out = d.run(&["template", "build", "tpl-pipe", "--recipe", recipe]);
    let err = stderr(&out);
    assert_eq!(ok(out), "tpl-pipe\n");
    for want in [
        "== booting the build sandbox",
        "== step 1/2: echo step-one-output",
        "1| step-one-output",
        "== step 1/2 done in ",
        "2! step-two-output",
        "== step 2/2 done in ",
        "== saving the template",
        "== template tpl-pipe saved",
    ] {
        assert!(err.contains(want), "{want:?} missing from:\n{err}");
    }
    assert!(
        !err.contains('\u{1b}') && !err.contains('\r'),
        "no drawing on a pipe: {err:?}"
    );

    // --json: the template as JSON, nothing on stderr.
    let out = d.run(&["--json", "template", "build", "tpl-json", "--recipe", recipe]);
    assert_eq!(stderr(&out), "");
    let t: hearth_api::Template = serde_json::from_str(&ok(out)).unwrap();
    assert_eq!(t.name, "tpl-json");

    // A terminal: the bar with steps and ETA; colour unless NO_COLOR.
    let out = on_a_terminal(&d, &["template", "build", "tpl-tty", "--recipe", recipe], false);
    let screen = stdout(&out);
    assert!(out.status.success(), "{screen}");
    assert!(screen.contains("steps") && screen.contains("ETA"), "{screen:?}");
    assert!(screen.contains("1| step-one-output"), "{screen:?}");
    assert!(has_colour(&screen), "colour on a terminal: {screen:?}");
    let out = on_a_terminal(
        &d,
        &["template", "build", "tpl-tty-plain", "--recipe", recipe],
        true,
    );
    let screen = stdout(&out);
    assert!(out.status.success(), "{screen}");
    assert!(screen.contains("ETA"), "{screen:?}");
    assert!(!has_colour(&screen), "NO_COLOR: {screen:?}");
    assert!(screen.contains("tpl-tty-plain"), "{screen:?}");

    // A failing step: exit status 1, the error with the step's output, nothing on stdout.
    std::fs::write(
        dir.path().join("broken.json"),
        r#"{"base": "minimal", "steps": ["echo about-to-fail; exit 5"]}"#,
    )
    .unwrap();
    let broken = dir.path().join("broken.json");
    let out = d.run(&[
        "template",
        "build",
        "tpl-broken",
        "--recipe",
        broken.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(stdout(&out), "");
    let err = stderr(&out);
    assert!(err.contains("1| about-to-fail"), "{err}");
    assert!(
        err.contains("error: step 1") && err.contains("exit code 5") && err.contains("(code: guest_error)"),
        "{err}"
    );

    let list = ok(d.run(&["template", "ls"]));
    for name in ["tpl-pipe", "tpl-json", "tpl-tty", "tpl-tty-plain"] {
        assert!(list.contains(name), "{list}");
    }
    assert!(!list.contains("tpl-broken"), "{list}");
}

#[test]
fn colour_detection() {
    assert!(has_colour("a\u{1b}[36mb"));
    assert!(has_colour("\u{1b}[1;2m"));
    assert!(!has_colour("\u{1b}[2K\r\u{1b}[1A plain"));
    assert!(!has_colour("no escapes"));
}
