//! envd's messages (`process/process.proto`, `filesystem/filesystem.proto`) in protobuf's canonical JSON
//! mapping: lowerCamelCase names (the original snake_case names are accepted too), `bytes` as base64, `int64`
//! as a string, enums by name (numbers accepted), absent fields meaning their default. Requests are parsed
//! into the structs below; answers are built as JSON by the helpers at the end.

use std::collections::BTreeMap;

use base64::Engine;
use serde::{Deserialize, Deserializer};

use super::connect::Fault;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct ProcessConfig {
    #[serde(default)]
    pub cmd: String,
    #[serde(default, deserialize_with = "nullable")]
    pub args: Vec<String>,
    #[serde(default, deserialize_with = "nullable")]
    pub envs: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
pub struct PtySize {
    #[serde(default)]
    pub cols: u32,
    #[serde(default)]
    pub rows: u32,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
pub struct Pty {
    #[serde(default)]
    pub size: Option<PtySize>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StartRequest {
    #[serde(default)]
    pub process: Option<ProcessConfig>,
    #[serde(default)]
    pub pty: Option<Pty>,
    #[serde(default)]
    pub tag: Option<String>,
    /// Absent: stdin is open (envd's behaviour before the field existed).
    #[serde(default)]
    pub stdin: Option<bool>,
}

/// `ProcessSelector`: a pid or a tag.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct Selector {
    #[serde(default)]
    pub pid: Option<u32>,
    #[serde(default)]
    pub tag: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct SelectRequest {
    #[serde(default)]
    pub process: Option<Selector>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct ProcessInput {
    #[serde(default)]
    pub stdin: Option<String>,
    #[serde(default)]
    pub pty: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct SendInputRequest {
    #[serde(default)]
    pub process: Option<Selector>,
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct SendSignalRequest {
    #[serde(default)]
    pub process: Option<Selector>,
    #[serde(default)]
    pub signal: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct UpdateRequest {
    #[serde(default)]
    pub process: Option<Selector>,
    #[serde(default)]
    pub pty: Option<Pty>,
}

/// One message of the `StreamInput` client stream (a oneof).
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamInputRequest {
    #[serde(default)]
    pub start: Option<SelectRequest>,
    #[serde(default)]
    pub data: Option<StreamInputData>,
    #[serde(default)]
    pub keepalive: Option<serde_json::Value>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamInputData {
    #[serde(default)]
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct PathRequest {
    #[serde(default)]
    pub path: String,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct ListDirRequest {
    #[serde(default)]
    pub path: String,
    #[serde(default)]
    pub depth: u32,
}

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct MoveRequest {
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub destination: String,
}

/// `WatchDirRequest` and `CreateWatcherRequest`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct WatchRequest {
    #[serde(default)]
    pub path: String,
    #[serde(default)]
    pub recursive: bool,
    #[serde(default, rename = "includeEntry", alias = "include_entry")]
    pub include_entry: bool,
    #[serde(default, rename = "allowNetworkMounts", alias = "allow_network_mounts")]
    pub allow_network_mounts: bool,
}

/// `GetWatcherEventsRequest` and `RemoveWatcherRequest`.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct WatcherRequest {
    #[serde(default, rename = "watcherId", alias = "watcher_id")]
    pub watcher_id: String,
}

/// proto3 JSON allows `null` for a repeated or map field: it means empty.
fn nullable<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A `bytes` field: standard or URL-safe base64, padded or not.
pub fn decode_bytes(s: &str) -> Result<Vec<u8>, Fault> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD]
        .iter()
        .find_map(|e| e.decode(s).ok())
        .ok_or_else(|| Fault::invalid("a bytes field is not base64"))
}

pub fn encode_bytes(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// The signal number of `Signal` (`SIGNAL_SIGKILL`/`SIGNAL_SIGTERM`, by name or number).
pub fn signal(v: Option<&serde_json::Value>) -> Result<i32, Fault> {
    let n = match v {
        Some(serde_json::Value::String(s)) => match s.as_str() {
            "SIGNAL_SIGKILL" => 9,
            "SIGNAL_SIGTERM" => 15,
            other => other.parse::<i64>().unwrap_or(0),
        },
        Some(serde_json::Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    };
    match n {
        9 | 15 => Ok(n as i32),
        _ => Err(Fault::invalid("signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")),
    }
}

/// A process event (`ProcessEvent`) wrapped as a `StartResponse`/`ConnectResponse`.
pub fn event(inner: serde_json::Value) -> serde_json::Value {
    serde_json::json!({ "event": inner })
}

pub fn start_event(pid: u32) -> serde_json::Value {
    event(serde_json::json!({ "start": { "pid": pid } }))
}

pub fn keepalive_event() -> serde_json::Value {
    event(serde_json::json!({ "keepalive": {} }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdk_messages_parse() {
        // The JS SDK's Start for `commands.run('echo hi', {envs: {A: '1'}})`.
        let s: StartRequest = serde_json::from_str(
            r#"{"process":{"cmd":"/bin/bash","args":["-l","-c","echo hi"],"envs":{"A":"1"}},"stdin":false}"#,
        )
        .unwrap_or_default();
        let p = s.process.unwrap_or_default();
        assert_eq!(
            (p.cmd.as_str(), p.args.len(), s.stdin),
            ("/bin/bash", 3, Some(false))
        );
        let w: WatchRequest =
            serde_json::from_str(r#"{"path":"/w","recursive":true,"includeEntry":true}"#).unwrap_or_default();
        assert!(w.recursive && w.include_entry);
        let w: WatcherRequest = serde_json::from_str(r#"{"watcherId":"w1"}"#).unwrap_or_default();
        assert_eq!(w.watcher_id, "w1");
        let n: ProcessConfig =
            serde_json::from_str(r#"{"cmd":"x","args":null,"envs":null}"#).unwrap_or_default();
        assert_eq!(n.cmd, "x");
        assert_eq!(signal(Some(&serde_json::json!("SIGNAL_SIGKILL"))), Ok(9));
        assert_eq!(signal(Some(&serde_json::json!(15))), Ok(15));
        assert!(signal(Some(&serde_json::json!("SIGNAL_UNSPECIFIED"))).is_err());
        assert_eq!(decode_bytes("aGk="), Ok(b"hi".to_vec()));
        assert_eq!(decode_bytes("aGk"), Ok(b"hi".to_vec()));
        assert!(decode_bytes("***").is_err());
    }
}
