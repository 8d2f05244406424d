//! Rendering: aligned tables, key/value blocks, times, colour. Pure functions of their input (the clock is a
//! parameter) so snapshot tests pin the exact output.

use std::fmt::Write as _;

use hearth_api::{FileInfo, FileKind, ProcessInfo, Sandbox, SandboxState, SandboxUsage, SystemInfo};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use unicode_width::UnicodeWidthStr;

/// Whether to colour output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    pub color: bool,
}

impl Style {
    pub const PLAIN: Style = Style { color: false };

    /// Colour only on a terminal, and never when `NO_COLOR` is set to anything non-empty.
    pub fn for_stream(is_tty: bool) -> Style {
        let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
        Style {
            color: is_tty && !no_color,
        }
    }

    fn paint(self, code: &str, text: &str) -> String {
        if self.color {
            format!("\x1b[{code}m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    pub fn bold(self, text: &str) -> String {
        self.paint("1", text)
    }
    pub fn green(self, text: &str) -> String {
        self.paint("32", text)
    }
    pub fn yellow(self, text: &str) -> String {
        self.paint("33", text)
    }
    pub fn red(self, text: &str) -> String {
        self.paint("31", text)
    }
}

/// Makes text from the daemon or the guest safe to print: control characters (escape sequences, carriage
/// returns) become visible escapes.
pub fn clean(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_owned();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// Left-aligned columns separated by two spaces; widths in terminal cells; no trailing spaces. Cells are
/// cleaned of control characters; the header is bold when colour is on.
pub fn table(headers: &[&str], rows: &[Vec<String>], style: Style) -> String {
    table_painted(headers, rows, style, |_, _, text| text.to_owned())
}

/// [`table`], with `paint(row, column, text)` decorating each body cell after alignment was computed.
pub fn table_painted(
    headers: &[&str],
    rows: &[Vec<String>],
    style: Style,
    paint: impl Fn(usize, usize, &str) -> String,
) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| clean(c)).collect())
        .collect();
    let mut widths: Vec<usize> = headers.iter().map(|h| h.width()).collect();
    for row in &rows {
        for (i, cell) in row.iter().enumerate().take(widths.len()) {
            widths[i] = widths[i].max(cell.width());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| h.to_string()).collect();
    push_row(&mut out, &header, &widths, |_, s| style.bold(s));
    for (r, row) in rows.iter().enumerate() {
        push_row(&mut out, row, &widths, |c, s| paint(r, c, s));
    }
    out
}

fn push_row(out: &mut String, cells: &[String], widths: &[usize], paint: impl Fn(usize, &str) -> String) {
    let last = cells.len().min(widths.len()).saturating_sub(1);
    for (i, cell) in cells.iter().enumerate().take(widths.len()) {
        out.push_str(&paint(i, cell));
        if i < last {
            out.push_str(&" ".repeat(widths[i] - cell.width() + 2));
        }
    }
    out.push('\n');
}

/// `key  value` lines with the keys aligned.
pub fn key_values(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(k, _)| k.width()).max().unwrap_or(0);
    let mut out = String::new();
    for (k, v) in pairs {
        let _ = writeln!(out, "{k:<width$}  {}", clean(v));
    }
    out
}

/// A compact duration: `42s`, `5m`, `3h`, `2d`.
pub fn short_duration(secs: i64) -> String {
    let secs = secs.max(0);
    match secs {
        0..60 => format!("{secs}s"),
        60..3600 => format!("{}m", secs / 60),
        3600..86400 => format!("{}h", secs / 3600),
        _ => format!("{}d", secs / 86400),
    }
}

fn parse_time(s: &str) -> Option<OffsetDateTime> {
    OffsetDateTime::parse(s, &Rfc3339).ok()
}

/// `5m ago` (or the raw text when it is not RFC 3339).
pub fn ago(at: &str, now: OffsetDateTime) -> String {
    match parse_time(at) {
        Some(t) => format!("{} ago", short_duration((now - t).whole_seconds())),
        None => at.to_owned(),
    }
}

/// `in 4m`, or `expired`.
pub fn until(at: &str, now: OffsetDateTime) -> String {
    match parse_time(at) {
        Some(t) if t > now => format!("in {}", short_duration((t - now).whole_seconds())),
        Some(_) => "expired".to_owned(),
        None => at.to_owned(),
    }
}

/// `2026-11-29 20:10:48 UTC` from seconds since the epoch.
pub fn utc_time(epoch_secs: i64) -> String {
    match OffsetDateTime::from_unix_timestamp(epoch_secs) {
        Ok(t) => format!(
            "{:04}-{:02}-{:02} {:02}:{:02}:{:02} UTC",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        ),
        Err(_) => epoch_secs.to_string(),
    }
}

fn state_cell(state: SandboxState, style: Style) -> String {
    let s = state.as_str();
    match state {
        SandboxState::Running => style.green(s),
        SandboxState::Creating
        | SandboxState::Stopping
        | SandboxState::Pausing
        | SandboxState::Paused
        | SandboxState::Resuming => style.yellow(s),
        SandboxState::Failed => style.red(s),
    }
}

/// Where an object lives with `hearthd --storage` (`both, synced`), or `-`.
pub fn storage_cell(s: Option<&hearth_api::ObjectStorage>) -> String {
    match s {
        Some(s) => format!("{}, {}", clean(&s.location), clean(&s.sync)),
        None => "-".to_owned(),
    }
}

/// The `hearth ls` table.
pub fn sandbox_table(sandboxes: &[Sandbox], now: OffsetDateTime, style: Style) -> String {
    let rows: Vec<Vec<String>> = sandboxes
        .iter()
        .map(|s| {
            // A paused sandbox whose state is only in the storage bucket is fetched on resume: say so.
            let state = match &s.storage {
                Some(st) if st.location == "remote" => format!("{} (remote)", s.state.as_str()),
                _ => s.state.as_str().to_owned(),
            };
            vec![
                s.id.clone(),
                state,
                s.template.clone(),
                s.vcpus.to_string(),
                format!("{} MiB", s.memory_mib),
                ago(&s.created_at, now),
                until(&s.end_at, now),
            ]
        })
        .collect();
    table_painted(
        &["ID", "STATE", "TEMPLATE", "VCPUS", "MEM", "CREATED", "ENDS"],
        &rows,
        style,
        |r, c, text| match (c, sandboxes.get(r)) {
            (1, Some(s)) if s.storage.is_none() => state_cell(s.state, style),
            _ => text.to_owned(),
        },
    )
}

/// `hearth info`.
pub fn sandbox_details(s: &Sandbox, now: OffsetDateTime) -> String {
    let mut pairs = vec![
        ("id", s.id.clone()),
        ("state", s.state.as_str().to_owned()),
        ("template", s.template.clone()),
        ("vcpus", s.vcpus.to_string()),
        ("memory", format!("{} MiB", s.memory_mib)),
        ("vmm", s.vmm.clone()),
        (
            "created",
            format!("{} ({})", s.created_at, ago(&s.created_at, now)),
        ),
        ("ends", format!("{} ({})", s.end_at, until(&s.end_at, now))),
    ];
    for (k, v) in &s.metadata {
        pairs.push(("metadata", format!("{k}={v}")));
    }
    if let Some(p) = &s.parent_id {
        pairs.push(("parent", p.clone()));
    }
    if let Some(snap) = &s.snapshot_id {
        pairs.push(("snapshot", snap.clone()));
    }
    if let Some(st) = &s.storage {
        pairs.push((
            "storage",
            format!(
                "{} ({} MiB), {}{}",
                clean(&st.location),
                st.bytes / (1024 * 1024),
                clean(&st.sync),
                st.synced_at
                    .as_deref()
                    .map(|t| format!(" at {}", clean(t)))
                    .unwrap_or_default()
            ),
        ));
    }
    if !s.auto_resume {
        pairs.push(("auto-resume", "off".to_owned()));
    }
    pairs.push(("on timeout", s.on_timeout.as_str().to_owned()));
    if let Some(err) = &s.error {
        pairs.push(("error", err.clone()));
    }
    key_values(&pairs)
}

/// `hearth usage`: one row per sandbox.
pub fn usage_table(rows: &[SandboxUsage]) -> String {
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|u| {
            vec![
                u.sandbox_id.clone(),
                format!("{:.1}", u.running_seconds),
                format!("{:.1}", u.vcpu_seconds),
                format!("{:.0}", u.mib_seconds),
                format!("{:.1}", u.paused_seconds),
                u.snapshot_bytes.to_string(),
            ]
        })
        .collect();
    table(
        &["ID", "RUNNING S", "VCPU S", "MIB S", "PAUSED S", "SNAPSHOT BYTES"],
        &body,
        Style::PLAIN,
    )
}

/// `hearth ps`.
pub fn process_table(procs: &[ProcessInfo], style: Style) -> String {
    let rows: Vec<Vec<String>> = procs
        .iter()
        .map(|p| {
            vec![
                p.pid.to_string(),
                match p.exit_code {
                    Some(code) => format!("exited {code}"),
                    None => "running".to_owned(),
                },
                if p.background { "background" } else { "foreground" }.to_owned(),
                p.cmd.clone(),
            ]
        })
        .collect();
    table(&["PID", "STATUS", "KIND", "COMMAND"], &rows, style)
}

/// `drwxr-xr-x` from a kind and permission bits.
pub fn mode_string(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        FileKind::File => '-',
        FileKind::Other => '?',
    });
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

fn display_name(f: &FileInfo) -> String {
    match (&f.kind, &f.link_target) {
        (FileKind::Symlink, Some(target)) => format!("{} -> {}", f.name, target),
        (FileKind::Dir, _) => format!("{}/", f.name),
        _ => f.name.clone(),
    }
}

/// `hearth files ls`.
pub fn file_table(entries: &[FileInfo], style: Style) -> String {
    let rows: Vec<Vec<String>> = entries
        .iter()
        .map(|f| {
            vec![
                mode_string(f.kind, f.mode),
                f.size.to_string(),
                utc_time(f.mtime),
                display_name(f),
            ]
        })
        .collect();
    table(&["MODE", "SIZE", "MODIFIED", "NAME"], &rows, style)
}

/// `hearth files stat`.
pub fn file_details(f: &FileInfo) -> String {
    let kind = match f.kind {
        FileKind::File => "file",
        FileKind::Dir => "directory",
        FileKind::Symlink => "symlink",
        FileKind::Other => "other",
    };
    let mut pairs = vec![
        ("path", f.path.clone()),
        ("kind", kind.to_owned()),
        ("size", f.size.to_string()),
        (
            "mode",
            format!("{:04o} ({})", f.mode & 0o7777, mode_string(f.kind, f.mode)),
        ),
        ("modified", utc_time(f.mtime)),
    ];
    if let Some(target) = &f.link_target {
        pairs.push(("target", target.clone()));
    }
    key_values(&pairs)
}

/// A check status word, padded and coloured: `ok  `, `warn`, `fail`.
pub fn status_word(status: &str, style: Style) -> String {
    let padded = format!("{:<4}", clean(status));
    match status {
        "ok" => style.green(&padded),
        "warn" => style.yellow(&padded),
        "fail" => style.red(&padded),
        _ => padded,
    }
}

/// One line per check: `ok    name  detail`, names aligned.
pub fn check_lines<'a>(
    checks: impl IntoIterator<Item = (&'a str, &'a str, &'a str)>,
    style: Style,
) -> String {
    let checks: Vec<_> = checks.into_iter().collect();
    let width = checks.iter().map(|(_, n, _)| n.width()).max().unwrap_or(0);
    let mut out = String::new();
    for (status, name, detail) in checks {
        let name = clean(name);
        let pad = " ".repeat(width.saturating_sub(name.width()));
        let _ = writeln!(
            out,
            "{}  {name}{pad}  {}",
            status_word(status, style),
            clean(detail)
        );
    }
    out
}

/// `hearth system`.
pub fn system_details(info: &SystemInfo, style: Style) -> String {
    let c = &info.capacity;
    let templates = if info.templates.is_empty() {
        "(none)".to_owned()
    } else {
        info.templates.join(", ")
    };
    let mut out = key_values(&[
        ("version", info.version.clone()),
        ("vmm", format!("{} ({})", info.vmm, info.accel)),
        ("why", info.vmm_reason.clone()),
        (
            "templates",
            format!("{templates} (default: {})", info.default_template),
        ),
        (
            "capacity",
            format!(
                "{} running; {} vCPUs on {} host CPUs; {} of {} MiB allocated",
                c.sandboxes_running,
                c.vcpus_allocated,
                c.host_cpus,
                c.memory_mib_allocated,
                c.host_memory_mib
            ),
        ),
    ]);
    if !info.checks.is_empty() {
        out.push_str("checks:\n");
        let lines = check_lines(
            info.checks
                .iter()
                .map(|ch| (ch.status.as_str(), ch.name.as_str(), ch.detail.as_str())),
            style,
        );
        for line in lines.lines() {
            let _ = writeln!(out, "  {line}");
        }
    }
    out
}

/// Pretty JSON plus a newline.
pub fn json<T: serde::Serialize>(value: &T) -> anyhow::Result<String> {
    let mut s = serde_json::to_string_pretty(value)?;
    s.push('\n');
    Ok(s)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
#[path = "output_tests.rs"]
mod tests;
