//! `process.Process`: Start (streamed), Connect (streamed), List, SendInput, StreamInput, SendSignal,
//! CloseStdin, Update.
//!
//! A started command is a hearth foreground command streamed over SSE (`keep_stdin_open` when the caller
//! wants stdin) whose stream a pump task holds ([`super::procs`]), so the process outlives the E2B stream that
//! started it, as in envd; `Connect-Timeout-Ms` becomes the command's timeout (envd kills at that deadline
//! too), and without one the command may run for hearth's maximum, 24 hours. stdin, signals and the process
//! list go to hearth's process routes; PTY sessions ([`super::pty`]) are held by the adapter.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, Request, State};
use axum::http::HeaderMap;
use axum::response::Response;
use bytes::{Bytes, BytesMut};
use futures::{Stream, StreamExt};
use hearth_api::{CommandEvent, RunCommandRequest};
use hearth_client::CommandStream;
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::connect::{self, Code, Fault};
use super::procs::{End, Event, Tracked};
use super::proto::{self, ProcessConfig, Selector};
use super::{Envd, code_for};
use crate::Shared;

/// hearth's longest command timeout (seconds): what a command without a deadline gets.
const MAX_COMMAND_S: u64 = 86_400;

/// The SDKs run every command as `/bin/bash -l -c CMD`. Images without bash (busybox ones) run `/bin/sh`
/// with the same arguments instead.
const BASH_OR_SH: &str = r#"if [ -x /bin/bash ]; then exec /bin/bash "$@"; fi; exec /bin/sh "$@""#;

pub async fn dispatch(
    State(_): State<Arc<Shared>>,
    Path(method): Path<String>,
    envd: Result<Envd, Fault>,
    req: Request,
) -> Response {
    let envd = match envd {
        Ok(e) => e,
        Err(f) => return f.unary_response(),
    };
    let headers = req.headers().clone();
    if method == "StreamInput" {
        return stream_input(&envd, &headers, req.into_body()).await;
    }
    let body = match axum::body::to_bytes(req.into_body(), connect::MAX_MESSAGE + 5).await {
        Ok(b) => b,
        Err(_) => return Fault::invalid("request message too large").unary_response(),
    };
    match method.as_str() {
        "Start" => start(&envd, &headers, &body).await,
        "Connect" => attach(&envd, &headers, &body).await,
        _ => connect::unary(unary(&envd, &method, &headers, &body).await),
    }
}

/// The unary methods, bounded by the call's deadline.
async fn unary(
    envd: &Envd,
    method: &str,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<serde_json::Value, Fault> {
    let work = async {
        match method {
            "List" => list(envd).await,
            "SendInput" => send_input(envd, connect::decode_unary(headers, body)?).await,
            "SendSignal" => send_signal(envd, connect::decode_unary(headers, body)?).await,
            "CloseStdin" => close_stdin(envd, connect::decode_unary(headers, body)?).await,
            "Update" => update(envd, connect::decode_unary(headers, body)?).await,
            other => Err(Fault::new(
                Code::Unimplemented,
                format!("process.Process/{other} is not implemented"),
            )),
        }
    };
    match connect::timeout(headers)? {
        Some(d) => tokio::time::timeout(d, work)
            .await
            .unwrap_or_else(|_| Err(Fault::new(Code::DeadlineExceeded, "the call's deadline passed"))),
        None => work.await,
    }
}

/// hearth's command for envd's process config.
pub fn command_request(
    config: &ProcessConfig,
    stdin: Option<bool>,
    timeout: Option<Duration>,
) -> Result<RunCommandRequest, Fault> {
    if config.cmd.is_empty() {
        return Err(Fault::invalid("process.cmd must not be empty"));
    }
    let mut env = config.envs.clone();
    for var in ["USER", "LOGNAME"] {
        env.entry(var.to_owned()).or_insert_with(|| "root".to_owned());
    }
    let cwd = match config.cwd.as_deref() {
        None | Some("") => None,
        Some(c) => Some(super::resolve(c)?),
    };
    Ok(RunCommandRequest {
        argv: Some(argv(&config.cmd, &config.args)),
        env,
        cwd,
        timeout_s: Some(timeout_secs(timeout)),
        // envd keeps stdin open unless the caller says `stdin: false`.
        keep_stdin_open: stdin != Some(false),
        ..RunCommandRequest::default()
    })
}

/// A deadline as whole seconds within hearth's range (no deadline: the longest).
pub fn timeout_secs(timeout: Option<Duration>) -> u64 {
    match timeout {
        Some(d) if !d.is_zero() => d.as_millis().div_ceil(1000).clamp(1, MAX_COMMAND_S as u128) as u64,
        _ => MAX_COMMAND_S,
    }
}

fn argv(cmd: &str, args: &[String]) -> Vec<String> {
    let mut v: Vec<String> = if cmd == "/bin/bash" || cmd == "bash" {
        vec![
            "/bin/sh".into(),
            "-c".into(),
            BASH_OR_SH.into(),
            "e2b-shell".into(),
        ]
    } else {
        vec![cmd.to_owned()]
    };
    v.extend(args.iter().cloned());
    v
}

/// A start failure: a missing program or working directory is the caller's argument, not a missing resource.
async fn start_fault(envd: &Envd, e: hearth_client::Error) -> Fault {
    let f = envd.fault(e).await;
    match f.code {
        Code::NotFound => Fault::invalid(f.message),
        _ => f,
    }
}

async fn start(envd: &Envd, headers: &HeaderMap, body: &[u8]) -> Response {
    match start_inner(envd, headers, body).await {
        Ok(r) => r,
        Err(f) => connect::stream_error(&f),
    }
}

async fn start_inner(envd: &Envd, headers: &HeaderMap, body: &[u8]) -> Result<Response, Fault> {
    let req: proto::StartRequest = connect::decode_stream_request(headers, body)?;
    let timeout = connect::timeout(headers)?;
    let keepalive = connect::keepalive(headers);
    if let Some(pty) = req.pty {
        return super::pty_start(
            envd,
            req.process.unwrap_or_default(),
            req.tag,
            pty,
            timeout,
            keepalive,
        )
        .await;
    }
    let config = req.process.unwrap_or_default();
    let hreq = command_request(&config, req.stdin, timeout)?;
    let mut stream = envd.api.run_command_stream(&envd.sandbox, &hreq);
    let pid = match stream.next().await {
        Some(Ok(CommandEvent::Start { pid })) => pid,
        Some(Ok(CommandEvent::Error { code, message })) => {
            return Err(Fault::new(code_for(code, 0), message));
        }
        Some(Err(e)) => return Err(start_fault(envd, e).await),
        _ => return Err(Fault::new(Code::Unknown, "the command stream did not start")),
    };
    let shared = envd.shared.clone();
    let (tracked, rx) = shared.procs.track(&envd.sandbox, pid, config, req.tag, None)?;
    tokio::spawn(pump(shared.clone(), envd.sandbox.clone(), tracked, stream));
    Ok(connect::stream_response(follow(
        proto::start_event(pid),
        rx,
        keepalive,
        None,
        shared,
    )))
}

/// Moves one command's events from hearth's stream to the attached E2B streams until it ends.
async fn pump(shared: Arc<Shared>, sandbox: String, t: Arc<Tracked>, mut stream: CommandStream) {
    loop {
        let next = tokio::select! {
            n = stream.next() => n,
            _ = shared.stop.cancelled() => {
                t.publish(Event::Fault(Fault::new(Code::Unavailable, "the daemon is shutting down"))).await;
                break;
            }
        };
        let ev = match next {
            Some(Ok(CommandEvent::Stdout { data_b64 })) => match hearth_client::decode_output(&data_b64) {
                Ok(b) => Event::Stdout(Bytes::from(b)),
                Err(e) => Event::Fault(Fault::new(Code::Internal, e.to_string())),
            },
            Some(Ok(CommandEvent::Stderr { data_b64 })) => match hearth_client::decode_output(&data_b64) {
                Ok(b) => Event::Stderr(Bytes::from(b)),
                Err(e) => Event::Fault(Fault::new(Code::Internal, e.to_string())),
            },
            Some(Ok(CommandEvent::Exit {
                exit_code,
                signal,
                timed_out,
            })) => Event::End(End::from_exit(exit_code, signal, timed_out)),
            Some(Ok(CommandEvent::Error { code, message })) => {
                Event::Fault(Fault::new(code_for(code, 0), message))
            }
            Some(Ok(CommandEvent::Start { .. })) => continue,
            Some(Err(e)) => Event::Fault(Fault::new(Code::Unavailable, e.to_string())),
            None => Event::Fault(Fault::new(Code::Unavailable, "the command stream ended")),
        };
        let ended = matches!(ev, Event::End(_));
        let last = ev.is_last();
        t.publish(ev).await;
        if ended {
            shared.procs.remove(&sandbox, &t);
        }
        if last {
            // A broken stream leaves the entry detached (see procs).
            return;
        }
    }
}

/// The frames of one attached stream: `first`, then the process' events, keep-alives while it is quiet, and
/// the end of stream (also at `deadline`, or when the daemon stops).
pub fn follow(
    first: serde_json::Value,
    rx: mpsc::Receiver<Event>,
    keepalive: Duration,
    deadline: Option<Instant>,
    shared: Arc<Shared>,
) -> impl Stream<Item = Bytes> + Send + 'static {
    struct S {
        pending: std::collections::VecDeque<Bytes>,
        rx: mpsc::Receiver<Event>,
        ticker: tokio::time::Interval,
        deadline: Option<Instant>,
        shared: Arc<Shared>,
        finished: bool,
    }
    let mut ticker = tokio::time::interval_at(Instant::now() + keepalive, keepalive);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let state = S {
        pending: [connect::message(&first)].into(),
        rx,
        ticker,
        deadline,
        shared,
        finished: false,
    };
    futures::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(frame) = s.pending.pop_front() {
                return Some((frame, s));
            }
            if s.finished {
                return None;
            }
            let far = Instant::now() + Duration::from_secs(365 * 86_400);
            tokio::select! {
                ev = s.rx.recv() => {
                    for frame in frames(ev) {
                        s.pending.push_back(frame);
                    }
                    s.finished = s.pending.back().is_some_and(|f| f.first() == Some(&0x02));
                }
                _ = s.ticker.tick() => s.pending.push_back(connect::message(&proto::keepalive_event())),
                _ = tokio::time::sleep_until(s.deadline.unwrap_or(far)) => {
                    let f = Fault::new(Code::DeadlineExceeded, "the stream's deadline passed");
                    s.pending.push_back(connect::end_stream(Some(&f)));
                    s.finished = true;
                }
                _ = s.shared.stop.cancelled() => {
                    let f = Fault::new(Code::Unavailable, "the daemon is shutting down");
                    s.pending.push_back(connect::end_stream(Some(&f)));
                    s.finished = true;
                }
            }
        }
    })
}

/// The frames for one event (the last ones end the stream).
fn frames(ev: Option<Event>) -> Vec<Bytes> {
    let data = |kind: &str, b: &[u8]| {
        connect::message(&proto::event(
            serde_json::json!({ "data": { kind: proto::encode_bytes(b) } }),
        ))
    };
    match ev {
        Some(Event::Stdout(b)) => vec![data("stdout", &b)],
        Some(Event::Stderr(b)) => vec![data("stderr", &b)],
        Some(Event::Pty(b)) => vec![data("pty", &b)],
        Some(Event::End(end)) => {
            let fault = end.timed_out.then(|| {
                Fault::new(
                    Code::DeadlineExceeded,
                    "the process' deadline passed and it was killed",
                )
            });
            vec![connect::message(&end.json()), connect::end_stream(fault.as_ref())]
        }
        Some(Event::Fault(f)) => vec![connect::end_stream(Some(&f))],
        None => vec![connect::end_stream(Some(&Fault::new(
            Code::Unavailable,
            "the process is no longer followed",
        )))],
    }
}

/// The pid a selector names (a tag names a process the adapter started with that tag).
fn select(envd: &Envd, sel: Option<Selector>) -> Result<u32, Fault> {
    let sel = sel.ok_or_else(|| Fault::invalid("process selector missing"))?;
    match (sel.pid, sel.tag) {
        (Some(pid), _) => Ok(pid),
        (None, Some(tag)) => envd
            .shared
            .procs
            .by_tag(&envd.sandbox, &tag)
            .map(|t| t.pid)
            .ok_or_else(|| Fault::new(Code::NotFound, format!("no process with tag {tag}"))),
        (None, None) => Err(Fault::invalid("process selector names neither pid nor tag")),
    }
}

/// A PTY session the adapter holds for `pid`, after checking the caller may use the sandbox.
async fn pty_of(envd: &Envd, pid: u32) -> Result<Option<Arc<Tracked>>, Fault> {
    match envd.shared.procs.get(&envd.sandbox, pid) {
        Some(t) if t.pty.is_some() => {
            envd.authorize().await?;
            Ok(Some(t))
        }
        _ => Ok(None),
    }
}

/// `Connect`: attach to a running process. One the adapter started streams live; any other hearth process
/// is waited for, and its output tails arrive with its end.
async fn attach(envd: &Envd, headers: &HeaderMap, body: &[u8]) -> Response {
    let result = async {
        let req: proto::SelectRequest = connect::decode_stream_request(headers, body)?;
        let deadline = connect::timeout(headers)?.map(|d| Instant::now() + d);
        let pid = select(envd, req.process)?;
        envd.authorize().await?;
        let rx = match envd.shared.procs.get(&envd.sandbox, pid) {
            Some(t) if !t.is_done() => t.subscribe()?,
            _ => wait_for(envd, pid).await?,
        };
        Ok::<_, Fault>(connect::stream_response(follow(
            proto::start_event(pid),
            rx,
            connect::keepalive(headers),
            deadline,
            envd.shared.clone(),
        )))
    };
    result.await.unwrap_or_else(|f| connect::stream_error(&f))
}

/// Events of a process the adapter does not follow: nothing until it exits, then its output tails and end.
async fn wait_for(envd: &Envd, pid: u32) -> Result<mpsc::Receiver<Event>, Fault> {
    let procs = match envd.api.list_processes(&envd.sandbox).await {
        Ok(p) => p,
        Err(e) => return Err(envd.fault(e).await),
    };
    if !procs
        .processes
        .iter()
        .any(|p| p.pid == pid && p.exit_code.is_none())
    {
        return Err(Fault::new(
            Code::NotFound,
            format!("process with pid {pid} not found"),
        ));
    }
    let (tx, rx) = mpsc::channel(4);
    let (api, sandbox) = (envd.api.clone(), envd.sandbox.clone());
    tokio::spawn(async move {
        // Stop waiting when the attached stream goes away.
        let waited = tokio::select! {
            r = api.wait_process(&sandbox, pid, None) => r,
            _ = tx.closed() => return,
        };
        let events = match waited {
            Ok(r) => vec![
                Event::Stdout(Bytes::from(r.stdout)),
                Event::Stderr(Bytes::from(r.stderr)),
                Event::End(End::from_exit(r.exit_code, r.signal, r.timed_out)),
            ],
            Err(e) => vec![Event::Fault(Fault::new(Code::Unavailable, e.to_string()))],
        };
        for ev in events {
            let empty = matches!(&ev, Event::Stdout(b) | Event::Stderr(b) if b.is_empty());
            if !empty && tx.send(ev).await.is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

async fn list(envd: &Envd) -> Result<serde_json::Value, Fault> {
    let procs = match envd.api.list_processes(&envd.sandbox).await {
        Ok(p) => p,
        Err(e) => return Err(envd.fault(e).await),
    };
    let alive = |pid: u32| {
        procs
            .processes
            .iter()
            .any(|p| p.pid == pid && p.exit_code.is_none())
    };
    envd.shared.procs.prune(&envd.sandbox, alive);
    let tracked = envd.shared.procs.all(&envd.sandbox);
    let info = |pid: u32, config: &ProcessConfig, tag: Option<&String>| {
        let mut v = serde_json::json!({
            "pid": pid,
            "config": { "cmd": config.cmd, "args": config.args, "envs": config.envs },
        });
        if let Some(cwd) = &config.cwd {
            v["config"]["cwd"] = serde_json::Value::String(cwd.clone());
        }
        if let Some(tag) = tag {
            v["tag"] = serde_json::Value::String(tag.clone());
        }
        v
    };
    let mut out: Vec<serde_json::Value> = procs
        .processes
        .iter()
        .filter(|p| p.exit_code.is_none())
        .map(|p| match tracked.iter().find(|t| t.pid == p.pid) {
            Some(t) => info(p.pid, &t.config, t.tag.as_ref()),
            None => {
                let config = ProcessConfig {
                    cmd: "/bin/sh".into(),
                    args: vec!["-c".into(), p.cmd.clone()],
                    envs: BTreeMap::new(),
                    cwd: None,
                };
                info(p.pid, &config, None)
            }
        })
        .collect();
    // PTY sessions are not in hearth's process table.
    out.extend(
        tracked
            .iter()
            .filter(|t| t.pty.is_some() && !t.is_done())
            .map(|t| info(t.pid, &t.config, t.tag.as_ref())),
    );
    Ok(serde_json::json!({ "processes": out }))
}

async fn send_input(envd: &Envd, req: proto::SendInputRequest) -> Result<serde_json::Value, Fault> {
    let pid = select(envd, req.process)?;
    write_input(envd, pid, req.input.unwrap_or_default()).await?;
    Ok(serde_json::json!({}))
}

async fn write_input(envd: &Envd, pid: u32, input: proto::ProcessInput) -> Result<(), Fault> {
    if let Some(t) = pty_of(envd, pid).await? {
        let data = proto::decode_bytes(input.pty.or(input.stdin).as_deref().unwrap_or(""))?;
        let Some(pty) = &t.pty else { return Ok(()) };
        return pty
            .lock()
            .await
            .send(&data)
            .await
            .map_err(|e| Fault::new(Code::Unavailable, e.to_string()));
    }
    let Some(b64) = input.stdin else {
        return Err(Fault::invalid(
            "input for a process without a terminal must be stdin",
        ));
    };
    let data = proto::decode_bytes(&b64)?;
    match envd.api.write_stdin(&envd.sandbox, pid, data, false).await {
        Ok(()) => Ok(()),
        Err(e) => Err(envd.fault(e).await),
    }
}

async fn send_signal(envd: &Envd, req: proto::SendSignalRequest) -> Result<serde_json::Value, Fault> {
    let pid = select(envd, req.process)?;
    let signal = proto::signal(req.signal.as_ref())?;
    if let Some(t) = pty_of(envd, pid).await? {
        if let Some(pty) = &t.pty {
            pty.lock()
                .await
                .signal(signal)
                .await
                .map_err(|e| Fault::new(Code::Unavailable, e.to_string()))?;
        }
        return Ok(serde_json::json!({}));
    }
    match envd.api.kill_process(&envd.sandbox, pid, Some(signal)).await {
        Ok(()) => Ok(serde_json::json!({})),
        Err(e) => Err(envd.fault(e).await),
    }
}

async fn close_stdin(envd: &Envd, req: proto::SelectRequest) -> Result<serde_json::Value, Fault> {
    let pid = select(envd, req.process)?;
    if pty_of(envd, pid).await?.is_some() {
        return Err(Fault::new(
            Code::FailedPrecondition,
            "a terminal has no stdin to close: send Ctrl-D (0x04) instead",
        ));
    }
    match envd.api.write_stdin(&envd.sandbox, pid, Vec::new(), true).await {
        Ok(()) => Ok(serde_json::json!({})),
        Err(e) => Err(envd.fault(e).await),
    }
}

async fn update(envd: &Envd, req: proto::UpdateRequest) -> Result<serde_json::Value, Fault> {
    let pid = select(envd, req.process)?;
    let Some(t) = pty_of(envd, pid).await? else {
        return Err(Fault::invalid(format!("process {pid} has no terminal to resize")));
    };
    if let (Some(size), Some(pty)) = (req.pty.and_then(|p| p.size), &t.pty) {
        let (rows, cols) = super::pty_size(size);
        pty.lock()
            .await
            .resize(rows, cols)
            .await
            .map_err(|e| Fault::new(Code::Unavailable, e.to_string()))?;
    }
    Ok(serde_json::json!({}))
}

/// `StreamInput`: a client stream of stdin chunks for one process; answered once the stream ends.
async fn stream_input(envd: &Envd, headers: &HeaderMap, body: axum::body::Body) -> Response {
    let result = async {
        let ct = headers
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if !ct.starts_with(connect::STREAM_JSON) {
            return Err(Fault::new(
                Code::Unimplemented,
                "only the JSON codec is supported",
            ));
        }
        let mut body = body.into_data_stream();
        let mut buf = BytesMut::new();
        let mut pid = None;
        loop {
            while let Some((_, msg)) = connect::split_envelope(&mut buf)? {
                let m: proto::StreamInputRequest = connect::decode_message(&msg)?;
                if let Some(start) = m.start {
                    pid = Some(select(envd, start.process)?);
                } else if let Some(data) = m.data {
                    let pid = pid.ok_or_else(|| Fault::invalid("data before the start message"))?;
                    write_input(envd, pid, data.input.unwrap_or_default()).await?;
                }
            }
            match body.next().await {
                Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                Some(Err(e)) => return Err(Fault::new(Code::Canceled, e.to_string())),
                None => break,
            }
        }
        if !buf.is_empty() {
            return Err(Fault::invalid("truncated message at the end of the stream"));
        }
        Ok(())
    };
    match result.await {
        Ok(()) => {
            let frames = [
                connect::message(&serde_json::json!({})),
                connect::end_stream(None),
            ];
            connect::stream_response(futures::stream::iter(frames))
        }
        Err(f) => connect::stream_error(&f),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdk_commands_become_hearth_commands() {
        let config = ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), "echo $X".into()],
            envs: [("X".to_string(), "1".to_string())].into(),
            cwd: Some("work".into()),
        };
        let r = command_request(&config, Some(false), Some(Duration::from_millis(1500))).unwrap_or_default();
        let argv = r.argv.unwrap_or_default();
        assert_eq!(&argv[..2], &["/bin/sh".to_string(), "-c".to_string()]);
        assert_eq!(&argv[3..], &["e2b-shell", "-l", "-c", "echo $X"]);
        assert_eq!(r.cwd.as_deref(), Some("/root/work"));
        assert_eq!(r.timeout_s, Some(2));
        assert!(!r.keep_stdin_open);
        assert_eq!(r.env.get("USER").map(String::as_str), Some("root"));
        let r = command_request(
            &ProcessConfig {
                cmd: "/usr/bin/env".into(),
                ..config
            },
            None,
            None,
        )
        .unwrap_or_default();
        assert_eq!(r.argv.map(|a| a[0].clone()).as_deref(), Some("/usr/bin/env"));
        assert!(r.keep_stdin_open);
        assert_eq!(r.timeout_s, Some(MAX_COMMAND_S));
        assert!(command_request(&ProcessConfig::default(), None, None).is_err());
    }

    #[test]
    fn frames_end_the_stream_after_the_last_event() {
        let f = frames(Some(Event::End(End::from_exit(0, None, true))));
        assert_eq!(f.len(), 2);
        assert_eq!(f[1][0], 0x02);
        let end: serde_json::Value = serde_json::from_slice(&f[1][5..]).unwrap_or_default();
        assert_eq!(end["error"]["code"], "deadline_exceeded");
        let f = frames(Some(Event::Stdout(Bytes::from_static(b"hi"))));
        let msg: serde_json::Value = serde_json::from_slice(&f[0][5..]).unwrap_or_default();
        assert_eq!(msg["event"]["data"]["stdout"], "aGk=");
    }
}
