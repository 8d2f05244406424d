//! Progress on stderr for long operations.
//!
//! - [`spinner`]: a spinner with the elapsed time while one request runs (create, pause, resume, fork, snapshot,
//!   saving a template). A create or resume that fetches from the storage bucket turns it into a byte bar
//!   ([`Spinner::fetch`], fed by the `fetch` events of the request's event stream).
//! - [`BuildView`]: a template build from a recipe, fed by the daemon's progress events: a bar over the recipe's
//!   steps with the elapsed time and an ETA, the current step or phase as its message, and a log of each step's
//!   start, output lines and end above it.
//!
//! Bars and spinners are drawn only when stderr is a terminal and `--json` is off; without colour when
//! `NO_COLOR` is set. The build log goes to stderr whether or not it is a terminal (CI logs want it), but not with
//! `--json`. stdout never carries any of it.

use std::io::IsTerminal;
use std::time::Duration;

use hearth_api::{BuildPhase, OutputStream, TemplateBuildEvent};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::Ctx;
use crate::output::{self, Style};

/// Longest command shown in a bar's message.
const MESSAGE_CMD: usize = 60;

/// What may appear on stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    /// Draw bars and spinners.
    pub draw: bool,
    /// Paint them.
    pub color: bool,
    /// Write the build log.
    pub log: bool,
}

impl Mode {
    /// The mode for `--json` = `json` with stderr a terminal or not (`NO_COLOR` read from the environment).
    pub fn new(json: bool, stderr_tty: bool) -> Mode {
        Mode {
            draw: stderr_tty && !json,
            color: !json && Style::for_stream(stderr_tty).color,
            log: !json,
        }
    }

    pub fn of(ctx: &Ctx) -> Mode {
        Mode::new(ctx.json, std::io::stderr().is_terminal())
    }
}

/// A spinner on stderr; cleared when dropped.
pub struct Spinner(Option<ProgressBar>);

impl Drop for Spinner {
    fn drop(&mut self) {
        if let Some(bar) = self.0.take() {
            bar.finish_and_clear();
        }
    }
}

impl Spinner {
    /// Whether anything is drawn (callers skip work that only feeds the drawing).
    pub fn draws(&self) -> bool {
        self.0.is_some()
    }

    /// Turns the spinner into a byte bar while the daemon fetches from the storage bucket (`hearth resume` of a
    /// sandbox whose paused state left the local cache, `hearth create` from an evicted snapshot or template).
    pub fn fetch(&self, p: &hearth_api::FetchProgress) {
        let Some(bar) = &self.0 else { return };
        if bar.length() != Some(p.total_bytes) {
            if let Ok(style) = ProgressStyle::with_template(
                "{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} {elapsed}",
            ) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_length(p.total_bytes);
            const FETCHING: &str = " (fetching from the storage bucket)";
            if !bar.message().ends_with(FETCHING) {
                bar.set_message(format!("{}{FETCHING}", bar.message()));
            }
        }
        bar.set_position(p.done_bytes);
    }
}

/// Starts a spinner with `message` and the elapsed time, when the mode draws.
pub fn spinner(ctx: &Ctx, message: String) -> Spinner {
    spinner_in(Mode::of(ctx), message)
}

fn spinner_in(mode: Mode, message: String) -> Spinner {
    if !mode.draw {
        return Spinner(None);
    }
    let template = if mode.color {
        "{spinner:.cyan} {msg} {elapsed:.dim}"
    } else {
        "{spinner} {msg} {elapsed}"
    };
    let bar = new_bar(None, template);
    bar.set_message(output::clean(&message));
    Spinner(Some(bar))
}

fn new_bar(len: Option<u64>, template: &str) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(len, ProgressDrawTarget::stderr());
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// The stderr side of a template build: a bar over its steps and the build log.
pub struct BuildView {
    mode: Mode,
    bar: Option<ProgressBar>,
    steps: u32,
}

impl BuildView {
    pub fn new(ctx: &Ctx, name: &str) -> BuildView {
        BuildView::with_mode(Mode::of(ctx), name)
    }

    fn with_mode(mode: Mode, name: &str) -> BuildView {
        let bar = mode.draw.then(|| {
            let bar = new_bar(None, "{spinner} {msg} {elapsed}");
            bar.set_message(format!("building template {}", output::clean(name)));
            bar
        });
        BuildView { mode, bar, steps: 0 }
    }

    /// Shows one progress event.
    pub fn event(&mut self, ev: &TemplateBuildEvent) {
        if let Some(line) = log_line(ev, self.steps)
            && self.mode.log
        {
            match &self.bar {
                Some(bar) => bar.println(line),
                None => eprintln!("{line}"),
            }
        }
        if let TemplateBuildEvent::Started { steps, .. } = ev {
            self.steps = *steps;
        }
        let Some(bar) = &self.bar else { return };
        match ev {
            TemplateBuildEvent::Started { name, steps } if *steps > 0 => {
                bar.set_length(u64::from(*steps));
                bar.set_position(0);
                if let Ok(style) = ProgressStyle::with_template(self.bar_template()) {
                    bar.set_style(style.progress_chars("=> "));
                }
                bar.set_prefix(output::clean(name));
                bar.reset_eta();
            }
            TemplateBuildEvent::Phase { phase } => bar.set_message(phase_text(*phase)),
            TemplateBuildEvent::StepStarted { step, cmd } => {
                bar.set_message(format!("step {step}: {}", short(cmd, MESSAGE_CMD)));
            }
            TemplateBuildEvent::StepFinished { step, .. } => bar.set_position(u64::from(*step)),
            _ => {}
        }
    }

    fn bar_template(&self) -> &'static str {
        if self.mode.color {
            "{spinner:.cyan} {prefix:.bold} [{bar:24.cyan/blue}] {pos}/{len} steps {elapsed:.dim} \
             (ETA {eta}) {wide_msg}"
        } else {
            "{spinner} {prefix} [{bar:24}] {pos}/{len} steps {elapsed} (ETA {eta}) {wide_msg}"
        }
    }
}

impl Drop for BuildView {
    fn drop(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

fn phase_text(phase: BuildPhase) -> &'static str {
    match phase {
        BuildPhase::CreatingSandbox => "booting the build sandbox",
        BuildPhase::StartCmd => "starting start_cmd",
        BuildPhase::WaitingReady => "waiting for ready_cmd",
        BuildPhase::Saving => "saving the template",
    }
}

/// `text` cleaned of control characters (tabs become spaces) and cut to `max` characters.
fn short(text: &str, max: usize) -> String {
    let one_line = text.replace('\t', "    ");
    let mut cut: String = one_line.chars().take(max).collect();
    if one_line.chars().count() > max {
        cut.push_str("...");
    }
    output::clean(&cut)
}

/// The build log line of an event (`steps`: the build's step count, 0 before `started`), if it has one.
pub fn log_line(ev: &TemplateBuildEvent, steps: u32) -> Option<String> {
    Some(match ev {
        TemplateBuildEvent::Started { .. } => return None,
        TemplateBuildEvent::Phase { phase } => format!("== {}", phase_text(*phase)),
        TemplateBuildEvent::StepStarted { step, cmd } => {
            format!("== step {step}/{steps}: {}", short(cmd, 200))
        }
        TemplateBuildEvent::StepOutput { step, stream, line } => {
            let mark = match stream {
                OutputStream::Stdout => "|",
                OutputStream::Stderr => "!",
            };
            format!("{step}{mark} {}", output::clean(&line.replace('\t', "    ")))
        }
        TemplateBuildEvent::StepFinished {
            step,
            exit_code,
            duration_ms,
        } => {
            let secs = *duration_ms as f64 / 1000.0;
            if *exit_code == 0 {
                format!("== step {step}/{steps} done in {secs:.1} s")
            } else {
                format!("== step {step}/{steps} failed with exit code {exit_code} after {secs:.1} s")
            }
        }
        TemplateBuildEvent::Done { template } => {
            format!("== template {} saved", output::clean(&template.name))
        }
        // The error itself is reported like any other failure.
        TemplateBuildEvent::Failed { .. } => return None,
    })
}

#[cfg(test)]
mod tests {
    use hearth_api::{ErrorCode, Template};

    use super::*;

    #[test]
    fn modes() {
        // SAFETY-free: NO_COLOR is read, never written, by the code under test; this test does not set it.
        let color = std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        assert_eq!(
            Mode::new(false, true),
            Mode {
                draw: true,
                color,
                log: true
            }
        );
        assert_eq!(
            Mode::new(false, false),
            Mode {
                draw: false,
                color: false,
                log: true
            }
        );
        assert_eq!(
            Mode::new(true, true),
            Mode {
                draw: false,
                color: false,
                log: false
            }
        );
        // Nothing drawn: a spinner and a build view hold no bar.
        let quiet = Mode::new(false, false);
        assert!(spinner_in(quiet, "x".into()).0.is_none());
        assert!(BuildView::with_mode(quiet, "t").bar.is_none());
    }

    #[test]
    fn build_log_lines() {
        let events = [
            TemplateBuildEvent::Started {
                name: "web".into(),
                steps: 2,
            },
            TemplateBuildEvent::Phase {
                phase: BuildPhase::CreatingSandbox,
            },
            TemplateBuildEvent::StepStarted {
                step: 1,
                cmd: "apt-get install -y\tnginx".into(),
            },
            TemplateBuildEvent::StepOutput {
                step: 1,
                stream: OutputStream::Stdout,
                line: "Setting up nginx\u{1b}[31m".into(),
            },
            TemplateBuildEvent::StepOutput {
                step: 1,
                stream: OutputStream::Stderr,
                line: "warning: x".into(),
            },
            TemplateBuildEvent::StepFinished {
                step: 1,
                exit_code: 0,
                duration_ms: 1234,
            },
            TemplateBuildEvent::StepStarted {
                step: 2,
                cmd: "false".into(),
            },
            TemplateBuildEvent::StepFinished {
                step: 2,
                exit_code: 1,
                duration_ms: 50,
            },
            TemplateBuildEvent::Phase {
                phase: BuildPhase::Saving,
            },
            TemplateBuildEvent::Done {
                template: Template {
                    name: "web".into(),
                    builtin: false,
                    from_sandbox: None,
                    snapshot_id: None,
                    size_bytes: 1,
                    created_at: None,
                    storage: None,
                },
            },
            TemplateBuildEvent::Failed {
                code: ErrorCode::GuestError,
                message: "m".into(),
            },
        ];
        let log: Vec<String> = events.iter().filter_map(|e| log_line(e, 2)).collect();
        assert_eq!(
            log,
            [
                "== booting the build sandbox",
                "== step 1/2: apt-get install -y    nginx",
                "1| Setting up nginx\\u{1b}[31m",
                "1! warning: x",
                "== step 1/2 done in 1.2 s",
                "== step 2/2: false",
                "== step 2/2 failed with exit code 1 after 0.1 s",
                "== saving the template",
                "== template web saved",
            ]
        );
        assert_eq!(short(&"x".repeat(70), 60).len(), 63);
    }
}
