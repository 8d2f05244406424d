//! Turning API answers into tool results: capped command output, text-or-base64 file content, and API errors as
//! tool errors (`isError: true`) carrying the daemon's stable error code.

use base64::Engine as _;
use rmcp::model::CallToolResult;
use serde_json::{Value, json};

/// Bytes of stdout (and, separately, of stderr) an `exec` result carries; the rest is counted, not kept.
pub const MAX_STREAM: usize = 64 * 1024;

/// One output stream of a command, kept up to [`MAX_STREAM`] bytes.
#[derive(Debug, Default)]
pub struct Capped {
    kept: Vec<u8>,
    total: u64,
}

impl Capped {
    pub fn push(&mut self, chunk: &[u8]) {
        self.total += chunk.len() as u64;
        let room = MAX_STREAM.saturating_sub(self.kept.len());
        self.kept.extend_from_slice(&chunk[..room.min(chunk.len())]);
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn truncated(&self) -> bool {
        self.total > self.kept.len() as u64
    }

    /// The kept bytes as text (invalid UTF-8 replaced), never ending in a cut character.
    pub fn text(&self) -> String {
        let end = if self.truncated() {
            utf8_prefix_len(&self.kept)
        } else {
            self.kept.len()
        };
        String::from_utf8_lossy(&self.kept[..end]).into_owned()
    }
}

/// Length of `bytes` without a trailing incomplete UTF-8 sequence (a character cut by a byte limit).
pub fn utf8_prefix_len(bytes: &[u8]) -> usize {
    match std::str::from_utf8(bytes) {
        Ok(_) => bytes.len(),
        // `error_len() == None`: the input ends in the middle of a character.
        Err(e) if e.error_len().is_none() => e.valid_up_to(),
        Err(_) => bytes.len(),
    }
}

/// The `exec` result: exit status, both streams, and a note per truncated stream saying how to get all of it.
pub fn exec_result(
    exit_code: i32,
    signal: Option<i32>,
    timed_out: bool,
    out: &Capped,
    err: &Capped,
) -> Value {
    let mut v = json!({
        "exit_code": exit_code,
        "stdout": out.text(),
        "stderr": err.text(),
    });
    if let Some(sig) = signal {
        v["signal"] = json!(sig);
    }
    if timed_out {
        v["timed_out"] = json!(true);
        v["note"] = json!("the command was killed when its timeout expired; pass a larger timeout_s");
    }
    let mut notes = Vec::new();
    for (name, s) in [("stdout", out), ("stderr", err)] {
        if s.truncated() {
            notes.push(format!(
                "{name} was {} bytes; only the first {} are shown. To see all of it, rerun the command with \
                 {name} redirected to a file (e.g. `cmd > /tmp/out.txt 2>&1`) and read that file with read_file \
                 (offset/length), or filter it (grep, tail).",
                s.total(),
                utf8_prefix_len(&s.kept),
            ));
        }
    }
    if !notes.is_empty() {
        v["truncated"] = json!(notes.join(" "));
    }
    v
}

/// The `read_file` result for `data` read at `offset` from a file of `size` bytes.
pub fn file_content(path: &str, offset: u64, data: &[u8], size: u64) -> Value {
    let mut used = data.len();
    let mut v = match std::str::from_utf8(data) {
        Ok(text) if !text.contains('\0') => json!({ "encoding": "text", "content": text }),
        _ => {
            // A text file read in pieces may end in the middle of a character: keep it text, stop before it.
            let prefix = utf8_prefix_len(data);
            let text = std::str::from_utf8(&data[..prefix])
                .ok()
                .filter(|t| !t.contains('\0'));
            match text {
                Some(text) if prefix > 0 && data.len() - prefix < 4 => {
                    used = prefix;
                    json!({ "encoding": "text", "content": text })
                }
                _ => json!({
                    "encoding": "base64",
                    "content": base64::engine::general_purpose::STANDARD.encode(data),
                    "note": "the file is not UTF-8 text, so its bytes are given as standard base64",
                }),
            }
        }
    };
    let next = offset + used as u64;
    v["path"] = json!(path);
    v["offset"] = json!(offset);
    v["bytes"] = json!(used);
    v["size"] = json!(size);
    if next < size {
        v["next_offset"] = json!(next);
        v["more"] = json!(format!(
            "{} more bytes: call read_file again with offset {next}",
            size - next
        ));
    }
    v
}

/// The `network_log` result: the newest `limit` entries of `log` (oldest first), and a note when older entries
/// were left out or the daemon's log had already dropped some.
pub fn egress_log(log: &hearth_api::EgressLog, limit: usize) -> Value {
    let total = log.events.len();
    let shown = &log.events[total.saturating_sub(limit)..];
    let mut v = json!({
        "events": serde_json::to_value(shown).unwrap_or(Value::Null),
        "shown": shown.len(),
        "total": total,
    });
    let mut notes = Vec::new();
    if shown.len() < total {
        notes.push(format!(
            "only the newest {} of {total} entries are shown; pass a larger limit (at most {}) to see older ones.",
            shown.len(),
            crate::args::MAX_LOG,
        ));
    }
    if log.dropped > 0 {
        v["dropped"] = json!(log.dropped);
        notes.push(format!(
            "{} older entries were dropped by the daemon (it keeps the newest {} per sandbox).",
            log.dropped,
            crate::args::MAX_LOG,
        ));
    }
    if !notes.is_empty() {
        v["truncated"] = json!(notes.join(" "));
    }
    v
}

/// A failed API call as a tool error an agent can act on: the stable code, the HTTP status and the message.
pub fn api_error(err: &hearth_client::Error) -> CallToolResult {
    let body = match err {
        hearth_client::Error::Api {
            status,
            code,
            message,
        } => json!({
            "error": { "code": code.as_str(), "status": status, "message": message },
        }),
        other => {
            let mut message = other.to_string();
            let mut source = std::error::Error::source(other);
            while let Some(s) = source {
                message.push_str(": ");
                message.push_str(&s.to_string());
                source = s.source();
            }
            json!({ "error": { "code": "unavailable", "message": message } })
        }
    };
    CallToolResult::structured_error(body)
}

/// A tool error found before any API call (an argument that cannot be right).
pub fn invalid_argument(message: impl Into<String>) -> CallToolResult {
    CallToolResult::structured_error(json!({
        "error": { "code": "invalid_argument", "message": message.into() },
    }))
}

/// The one project a key sees (`GET /v1/projects` of a member or viewer key), or an error asking for one.
pub fn own_project(list: &hearth_api::ProjectList) -> Result<String, CallToolResult> {
    match list.projects.as_slice() {
        [one] => Ok(one.name.clone()),
        many => {
            let names: Vec<&str> = many.iter().map(|p| p.name.as_str()).collect();
            Err(invalid_argument(format!(
                "this key sees {} projects ({}): pass project",
                names.len(),
                names.join(", ")
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use hearth_api::ErrorCode;

    #[test]
    fn capped_keeps_the_head_and_counts_the_rest() {
        let mut c = Capped::default();
        c.push(&vec![b'a'; MAX_STREAM - 1]);
        c.push("é and more".as_bytes());
        assert!(c.truncated());
        assert_eq!(c.total(), (MAX_STREAM - 1 + "é and more".len()) as u64);
        // The cut fell inside 'é': the text stops before it instead of showing a replacement character.
        assert_eq!(c.text(), "a".repeat(MAX_STREAM - 1));
        let v = exec_result(0, None, false, &c, &Capped::default());
        let note = v["truncated"].as_str().unwrap();
        assert!(
            note.contains("stdout was 65546 bytes; only the first 65535 are shown"),
            "{note}"
        );
        assert!(note.contains("read_file"), "{note}");
        assert!(v.get("signal").is_none());
    }

    #[test]
    fn short_output_is_whole_and_has_no_note() {
        let mut c = Capped::default();
        c.push(b"hi\n");
        let v = exec_result(3, Some(9), true, &c, &Capped::default());
        assert_eq!(v["stdout"], "hi\n");
        assert_eq!(v["exit_code"], 3);
        assert_eq!(v["signal"], 9);
        assert_eq!(v["timed_out"], true);
        assert!(v.get("truncated").is_none());
    }

    #[test]
    fn file_content_text_binary_and_pieces() {
        let v = file_content("/a", 0, b"hello", 5);
        assert_eq!(v["encoding"], "text");
        assert_eq!(v["content"], "hello");
        assert!(v.get("next_offset").is_none());

        let v = file_content("/b", 0, &[0, 159, 146, 150], 4);
        assert_eq!(v["encoding"], "base64");
        assert_eq!(v["content"], "AJ+Slg==");
        assert!(v["note"].as_str().unwrap().contains("base64"));

        // A piece ending inside a multi-byte character: text up to it, and the next offset points at it.
        let data = "ab€".as_bytes();
        let v = file_content("/c", 10, &data[..4], 100);
        assert_eq!(v["encoding"], "text");
        assert_eq!(v["content"], "ab");
        assert_eq!(v["next_offset"], 12);
        assert!(v["more"].as_str().unwrap().contains("offset 12"));
    }

    #[test]
    fn egress_log_keeps_the_newest_and_says_so() {
        let event = |port: u16| hearth_api::EgressEvent {
            at: "2026-01-01T00:00:00.000Z".into(),
            protocol: hearth_api::NetProtocol::Tcp,
            destination: Some("203.0.113.7".into()),
            port: Some(port),
            name: None,
            allowed: false,
            reason: "default_deny".into(),
            rule: None,
        };
        let log = hearth_api::EgressLog {
            events: (1..=5).map(event).collect(),
            dropped: 0,
        };
        let v = egress_log(&log, 2);
        let ports: Vec<u64> = v["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["port"].as_u64().unwrap())
            .collect();
        assert_eq!(ports, [4, 5]);
        assert_eq!(v["total"], 5);
        let note = v["truncated"].as_str().unwrap();
        assert!(note.contains("newest 2 of 5"), "{note}");
        assert!(v.get("dropped").is_none());

        let v = egress_log(&log, 50);
        assert_eq!(v["shown"], 5);
        assert!(v.get("truncated").is_none());

        let full = hearth_api::EgressLog {
            events: vec![event(1)],
            dropped: 7,
        };
        let v = egress_log(&full, 50);
        assert_eq!(v["dropped"], 7);
        assert!(
            v["truncated"]
                .as_str()
                .unwrap()
                .contains("7 older entries were dropped")
        );
    }

    #[test]
    fn api_errors_keep_the_code() {
        let err = hearth_client::Error::Api {
            status: 404,
            code: ErrorCode::NotFound,
            message: "no sandbox sb_x".into(),
        };
        let r = api_error(&err);
        assert_eq!(r.is_error, Some(true));
        let v = r.structured_content.unwrap();
        assert_eq!(v["error"]["code"], "not_found");
        assert_eq!(v["error"]["status"], 404);
        assert_eq!(v["error"]["message"], "no sandbox sb_x");
    }
}
