//! Processes started through envd, kept by the adapter while they run.
//!
//! envd's processes outlive the stream that started them: a client may disconnect and `Connect` again later,
//! and several clients may follow one process. hearth streams a command's output to the one request that
//! started it, so the adapter holds that request (a *pump* task per process) and fans each chunk out to the
//! E2B streams currently attached ([`Tracked::subscribe`]). Output nobody is attached to is dropped, as
//! envd drops it; an attached stream that reads slowly slows the process (no unbounded buffering). Entries
//! leave when the process ends, when its sandbox is killed, or when the daemon stops. When hearth's stream
//! breaks while the process lives on (the sandbox was paused: a resumed guest continues it), the entry stays,
//! *detached*, so that `List` still shows the process as it was started and `Connect` can wait for it.
//!
//! Bounds: [`MAX_PER_SANDBOX`] tracked processes per sandbox, [`MAX_TOTAL`] in all, [`MAX_SUBSCRIBERS`]
//! attached streams per process.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use tokio::sync::mpsc;

use super::connect::{Code, Fault};
use super::proto::ProcessConfig;

pub const MAX_PER_SANDBOX: usize = 256;
pub const MAX_TOTAL: usize = 4096;
pub const MAX_SUBSCRIBERS: usize = 16;
/// Events buffered per attached stream before the process waits for it.
const CHANNEL: usize = 32;
/// PTY sessions have no guest pid hearth reports: they get numbers above any Linux pid (`pid_max` is at
/// most 2^22).
const PTY_PID_BASE: u32 = 1 << 30;

/// How a process ended, in envd's terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct End {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    pub error: Option<String>,
    /// The call's deadline killed it: the stream ends with `deadline_exceeded` after the end event.
    pub timed_out: bool,
}

impl End {
    /// From hearth's exit report (`exit_code` is `128 + signal` when a signal killed it).
    pub fn from_exit(exit_code: i32, signal: Option<i32>, timed_out: bool) -> End {
        match signal {
            Some(sig) => {
                let status = format!("signal: {}", signal_name(sig));
                End {
                    exit_code: -1,
                    exited: false,
                    error: Some(status.clone()),
                    status,
                    timed_out,
                }
            }
            None => {
                let status = format!("exit status {exit_code}");
                End {
                    exit_code,
                    exited: true,
                    error: (exit_code != 0).then(|| status.clone()),
                    status,
                    timed_out,
                }
            }
        }
    }

    pub fn json(&self) -> serde_json::Value {
        let mut end = serde_json::json!({
            "exitCode": self.exit_code,
            "exited": self.exited,
            "status": self.status,
        });
        if let Some(e) = &self.error {
            end["error"] = serde_json::Value::String(e.clone());
        }
        super::proto::event(serde_json::json!({ "end": end }))
    }
}

/// Go's names, which envd's status strings use.
fn signal_name(sig: i32) -> String {
    match sig {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        3 => "quit".into(),
        6 => "aborted".into(),
        9 => "killed".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

/// What an attached stream receives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    Stdout(Bytes),
    Stderr(Bytes),
    Pty(Bytes),
    End(End),
    /// The process' stream broke (e.g. the sandbox was paused or destroyed): the attached streams end with it.
    Fault(Fault),
}

impl Event {
    pub fn is_last(&self) -> bool {
        matches!(self, Event::End(_) | Event::Fault(_))
    }
}

/// Input and control of a PTY session (held by the adapter: hearth's terminals are WebSocket sessions).
pub type PtyControl = tokio::sync::Mutex<hearth_client::pty::PtyWriter>;

/// One process the adapter started.
pub struct Tracked {
    pub pid: u32,
    pub config: ProcessConfig,
    pub tag: Option<String>,
    pub pty: Option<PtyControl>,
    state: Mutex<Fanout>,
}

#[derive(Default)]
struct Fanout {
    subscribers: Vec<mpsc::Sender<Event>>,
    done: bool,
}

impl Tracked {
    fn fanout(&self) -> MutexGuard<'_, Fanout> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A stream of this process' events from now on; `None` once it has ended.
    pub fn subscribe(&self) -> Result<mpsc::Receiver<Event>, Fault> {
        let mut f = self.fanout();
        if f.done {
            return Err(Fault::new(
                Code::NotFound,
                format!("process {} has ended", self.pid),
            ));
        }
        f.subscribers.retain(|s| !s.is_closed());
        if f.subscribers.len() >= MAX_SUBSCRIBERS {
            return Err(Fault::new(
                Code::ResourceExhausted,
                format!(
                    "process {} already has {MAX_SUBSCRIBERS} streams attached",
                    self.pid
                ),
            ));
        }
        let (tx, rx) = mpsc::channel(CHANNEL);
        f.subscribers.push(tx);
        Ok(rx)
    }

    /// Hands `ev` to every attached stream, waiting for slow ones; forgets the ones that went away. After the
    /// last event nobody can attach any more.
    pub async fn publish(&self, ev: Event) {
        let last = ev.is_last();
        let subscribers = {
            let mut f = self.fanout();
            f.done |= last;
            if last {
                std::mem::take(&mut f.subscribers)
            } else {
                f.subscribers.clone()
            }
        };
        let mut gone = false;
        for s in &subscribers {
            gone |= s.send(ev.clone()).await.is_err();
        }
        if gone {
            self.fanout().subscribers.retain(|s| !s.is_closed());
        }
    }

    pub fn is_done(&self) -> bool {
        self.fanout().done
    }
}

/// Every tracked process, by sandbox and pid.
#[derive(Default)]
pub struct Registry {
    sandboxes: Mutex<HashMap<String, HashMap<u32, Arc<Tracked>>>>,
    next_pty_pid: AtomicU32,
}

impl Registry {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, HashMap<u32, Arc<Tracked>>>> {
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A pid for a PTY session.
    pub fn pty_pid(&self) -> u32 {
        PTY_PID_BASE + (self.next_pty_pid.fetch_add(1, Ordering::Relaxed) % PTY_PID_BASE)
    }

    /// Starts tracking `pid` in `sandbox`; the caller's stream is attached first, so it misses nothing.
    pub fn track(
        &self,
        sandbox: &str,
        pid: u32,
        config: ProcessConfig,
        tag: Option<String>,
        pty: Option<PtyControl>,
    ) -> Result<(Arc<Tracked>, mpsc::Receiver<Event>), Fault> {
        let tracked = Arc::new(Tracked {
            pid,
            config,
            tag,
            pty,
            state: Mutex::new(Fanout::default()),
        });
        let rx = tracked.subscribe()?;
        let mut all = self.lock();
        let total: usize = all.values().map(HashMap::len).sum();
        let procs = all.entry(sandbox.to_owned()).or_default();
        // Detached entries (kept only to describe their processes) make room first.
        if procs.len() >= MAX_PER_SANDBOX {
            procs.retain(|_, p| !p.is_done());
        }
        if procs.len() >= MAX_PER_SANDBOX || total >= MAX_TOTAL {
            return Err(Fault::new(
                Code::ResourceExhausted,
                format!("too many processes followed through envd (at most {MAX_PER_SANDBOX} per sandbox)"),
            ));
        }
        if let Some(tag) = &tracked.tag
            && procs.values().any(|p| p.tag.as_ref() == Some(tag))
        {
            return Err(Fault::new(
                Code::AlreadyExists,
                format!("a running process already has tag {tag}"),
            ));
        }
        procs.insert(pid, tracked.clone());
        Ok((tracked, rx))
    }

    pub fn get(&self, sandbox: &str, pid: u32) -> Option<Arc<Tracked>> {
        self.lock().get(sandbox)?.get(&pid).cloned()
    }

    pub fn by_tag(&self, sandbox: &str, tag: &str) -> Option<Arc<Tracked>> {
        self.lock()
            .get(sandbox)?
            .values()
            .find(|p| p.tag.as_deref() == Some(tag))
            .cloned()
    }

    /// The tracked processes of `sandbox` whose streams still run.
    pub fn running(&self, sandbox: &str) -> Vec<Arc<Tracked>> {
        self.all(sandbox).into_iter().filter(|p| !p.is_done()).collect()
    }

    /// Every entry of `sandbox`, detached ones included.
    pub fn all(&self, sandbox: &str) -> Vec<Arc<Tracked>> {
        self.lock()
            .get(sandbox)
            .map(|m| m.values().cloned().collect())
            .unwrap_or_default()
    }

    /// Drops the detached entries of `sandbox` whose pid `alive` says is gone.
    pub fn prune(&self, sandbox: &str, alive: impl Fn(u32) -> bool) {
        let mut all = self.lock();
        if let Some(m) = all.get_mut(sandbox) {
            m.retain(|pid, t| !t.is_done() || alive(*pid));
            if m.is_empty() {
                all.remove(sandbox);
            }
        }
    }

    /// Stops tracking `t` (its pump ended); a newer process that reused the pid stays.
    pub fn remove(&self, sandbox: &str, t: &Arc<Tracked>) {
        let mut all = self.lock();
        if let Some(m) = all.get_mut(sandbox) {
            if m.get(&t.pid).is_some_and(|cur| Arc::ptr_eq(cur, t)) {
                m.remove(&t.pid);
            }
            if m.is_empty() {
                all.remove(sandbox);
            }
        }
    }

    /// Forgets a destroyed sandbox's processes (their pumps end on their own as the streams break).
    pub fn forget_sandbox(&self, sandbox: &str) {
        self.lock().remove(sandbox);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ProcessConfig {
        ProcessConfig {
            cmd: "sleep".into(),
            ..ProcessConfig::default()
        }
    }

    #[test]
    fn ends_map_to_envd_statuses() {
        let ok = End::from_exit(0, None, false);
        assert_eq!((ok.exit_code, ok.exited, ok.error.as_deref()), (0, true, None));
        let failed = End::from_exit(3, None, false);
        assert_eq!(failed.error.as_deref(), Some("exit status 3"));
        let killed = End::from_exit(137, Some(9), false);
        assert_eq!(
            (killed.exit_code, killed.exited, killed.status.as_str()),
            (-1, false, "signal: killed")
        );
        assert_eq!(killed.json()["event"]["end"]["exitCode"], -1);
        assert!(ok.json()["event"]["end"].get("error").is_none());
    }

    #[tokio::test]
    async fn output_fans_out_and_stops_at_the_end() {
        let reg = Registry::default();
        let (t, mut first) = reg
            .track("sbx_a", 7, cfg(), Some("t".into()), None)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut second = t.subscribe().unwrap_or_else(|e| panic!("{e}"));
        assert!(reg.by_tag("sbx_a", "t").is_some());
        assert!(
            reg.track("sbx_a", 8, cfg(), Some("t".into()), None).is_err(),
            "tags are unique"
        );
        t.publish(Event::Stdout(Bytes::from_static(b"hi"))).await;
        t.publish(Event::End(End::from_exit(0, None, false))).await;
        for rx in [&mut first, &mut second] {
            assert_eq!(rx.recv().await, Some(Event::Stdout(Bytes::from_static(b"hi"))));
            assert!(matches!(rx.recv().await, Some(Event::End(_))));
            assert_eq!(rx.recv().await, None);
        }
        assert!(t.subscribe().is_err(), "no attaching after the end");
        assert!(reg.running("sbx_a").is_empty());
        reg.remove("sbx_a", &t);
        assert!(reg.get("sbx_a", 7).is_none());
    }

    #[tokio::test]
    async fn a_stream_that_went_away_does_not_block_the_others() {
        let reg = Registry::default();
        let (t, gone) = reg
            .track("sbx_b", 1, cfg(), None, None)
            .unwrap_or_else(|e| panic!("{e}"));
        drop(gone);
        let mut rx = t.subscribe().unwrap_or_else(|e| panic!("{e}"));
        for _ in 0..(CHANNEL * 2) {
            t.publish(Event::Stderr(Bytes::from_static(b"x"))).await;
            assert!(rx.recv().await.is_some());
        }
        assert_eq!(t.fanout().subscribers.len(), 1);
    }

    #[test]
    fn bounds_hold() {
        let reg = Registry::default();
        let mut rxs = Vec::new();
        for pid in 0..MAX_PER_SANDBOX as u32 {
            rxs.push(reg.track("sbx_c", pid, cfg(), None, None).map(|(_, rx)| rx));
        }
        assert!(rxs.iter().all(Result::is_ok));
        assert_eq!(
            reg.track("sbx_c", 99_999, cfg(), None, None)
                .err()
                .map(|f| f.code),
            Some(Code::ResourceExhausted)
        );
        assert!(reg.pty_pid() >= PTY_PID_BASE);
        reg.forget_sandbox("sbx_c");
        assert!(reg.running("sbx_c").is_empty());
    }
}
