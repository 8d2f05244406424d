//! `hearth shell` through a real terminal: tmux runs it in a detached session against a real `hearthd` and a
//! QEMU guest (the `minimal` template). Typed commands show their output, Ctrl-C interrupts the guest's
//! program, resizing the tmux window changes `stty size` in the guest, the exit code comes back, and the
//! local terminal leaves raw mode afterwards.

#![allow(clippy::unwrap_used)]

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use support::{Daemon, ok};

const WAIT: Duration = Duration::from_secs(60);

/// A tmux server of our own (its own socket name), killed on drop even when the test fails.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn new() -> Tmux {
        Tmux {
            socket: format!("hearth-shell-test-{}", std::process::id()),
        }
    }

    fn cmd(&self, args: &[&str]) -> String {
        let out = Command::new("tmux")
            .arg("-L")
            .arg(&self.socket)
            .args(args)
            .output()
            .expect("tmux runs (apt-get install tmux)");
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.cmd(&["capture-pane", "-p", "-J", "-t", "t", "-S", "-200"])
    }

    /// Waits until the pane shows `want`; panics with the screen otherwise.
    fn wait_for(&self, want: &str) -> String {
        let deadline = Instant::now() + WAIT;
        loop {
            let screen = self.screen();
            if screen.contains(want) {
                return screen;
            }
            assert!(
                Instant::now() < deadline,
                "{want:?} never appeared; the pane shows:\n{screen}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn type_line(&self, line: &str) {
        self.cmd(&["send-keys", "-t", "t", "-l", line]);
        self.cmd(&["send-keys", "-t", "t", "Enter"]);
    }

    /// The pane's size as `stty size` prints it.
    fn pane_size(&self) -> String {
        self.cmd(&["display-message", "-p", "-t", "t", "#{pane_height} #{pane_width}"])
            .trim()
            .to_owned()
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["-L", &self.socket, "kill-server"])
            .output();
    }
}

#[test]
fn shell_in_tmux() {
    let d = Daemon::start();
    let id = ok(d.run(&["create"])).trim().to_owned();
    assert!(id.starts_with("sbx_"), "{id}");

    let tmux = Tmux::new();
    // After `hearth shell` ends, the pane prints its exit status and whether the terminal is back in
    // canonical mode, then stays open for the test to read.
    let script = format!(
        "HEARTH_URL={url} HEARTH_API_KEY={key} NO_COLOR=1 {bin} shell {id}; \
         echo hearth-exit=$?; echo mode=$(stty -a | tr ' ;' '\\n\\n' | grep -x -e icanon -e -icanon); sleep 600",
        url = d.url,
        key = d.key,
        bin = env!("CARGO_BIN_EXE_hearth"),
    );
    tmux.cmd(&[
        "new-session",
        "-d",
        "-s",
        "t",
        "-x",
        "100",
        "-y",
        "30",
        "sh",
        "-c",
        &script,
    ]);
    tmux.cmd(&["set-option", "-t", "t", "status", "off"]);

    // Typing a command shows its output.
    tmux.type_line("echo hello-$((6*7))");
    tmux.wait_for("hello-42");

    // The guest's terminal has the pane's size, and follows a resize.
    let before = tmux.pane_size();
    tmux.type_line("echo size=[$(stty size)]");
    tmux.wait_for(&format!("size=[{before}]"));
    tmux.cmd(&["resize-window", "-t", "t", "-x", "120", "-y", "40"]);
    let after = tmux.pane_size();
    assert_ne!(before, after, "tmux did not resize the pane");
    tmux.type_line("echo size2=[$(stty size)]");
    tmux.wait_for(&format!("size2=[{after}]"));

    // Ctrl-C reaches the guest's foreground program, not `hearth`.
    tmux.type_line("sleep 100");
    std::thread::sleep(Duration::from_secs(1));
    let started = Instant::now();
    tmux.cmd(&["send-keys", "-t", "t", "C-c"]);
    tmux.type_line("echo interrupted=$?");
    tmux.wait_for("interrupted=130");
    assert!(started.elapsed() < Duration::from_secs(30));

    // The guest's exit code is hearth's, and the local terminal is restored.
    tmux.type_line("exit 3");
    tmux.wait_for("hearth-exit=3");
    tmux.wait_for("mode=icanon");
}
