//! `WatchDir`: inotify on a directory (and, recursively, its subdirectories), streamed as batches of
//! [`WatchEvent`]s.
//!
//! One task per watch owns its inotify descriptor and a bounded queue. It reads the kernel's events as they
//! come, turns them into events with paths relative to the watched directory, and sends them in JSON batches
//! as the host's credit allows. A host that does not read leaves events in the queue; past [`MAX_QUEUED`]
//! events (or [`MAX_QUEUED_BYTES`]) new ones are dropped and a single `overflow` event says so, so a busy
//! directory never costs unbounded memory. The kernel's own queue overflowing is reported the same way.
//!
//! Recursive watches add a watch for every directory created or moved in, and report what such a directory
//! already holds as `create` events (entries made between its creation and its watch would otherwise be
//! missed). Renames inside the tree come as one `rename` event with both paths.

use std::collections::{HashMap, VecDeque};
use std::ffi::OsStr;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::path::PathBuf;
use std::time::Duration;

use bytes::Bytes;
use hearth_proto::watch::{WatchEvent, WatchEventKind, WatchRequest};
use hearth_proto::{ErrorKind, GuestMsg};
use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

use crate::conn::{After, Ctx};
use crate::files::{check_path, errno_kind};
use crate::{AgentError, fail};

/// Most events held for a host that does not read fast enough.
pub(crate) const MAX_QUEUED: usize = 4096;
/// Most bytes of event paths held in the queue.
pub(crate) const MAX_QUEUED_BYTES: usize = 1024 * 1024;
/// Most directories one watch covers (each is one inotify watch, a kernel resource).
const MAX_WATCHES: usize = 8192;
/// Target size of one batch's JSON.
const BATCH_BYTES: usize = 64 * 1024;
/// How long a `MOVED_FROM` waits for its `MOVED_TO` before it counts as a move out of the tree (the kernel
/// queues the two back to back, but a reader may run in between).
const MOVE_PAIR_WAIT: Duration = Duration::from_millis(50);

/// The kernel events a watch subscribes to.
fn mask() -> AddWatchFlags {
    AddWatchFlags::IN_CREATE
        | AddWatchFlags::IN_MODIFY
        | AddWatchFlags::IN_ATTRIB
        | AddWatchFlags::IN_DELETE
        | AddWatchFlags::IN_MOVED_FROM
        | AddWatchFlags::IN_MOVED_TO
        | AddWatchFlags::IN_DELETE_SELF
        | AddWatchFlags::IN_MOVE_SELF
        | AddWatchFlags::IN_ONLYDIR
        | AddWatchFlags::IN_DONT_FOLLOW
}

/// `AsyncFd` wants `AsRawFd`; nix's `Inotify` offers `AsFd`.
struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// Events waiting for the host's credit; bounded in count and bytes.
#[derive(Default)]
pub(crate) struct Queue {
    events: VecDeque<WatchEvent>,
    bytes: usize,
    /// Set after an overflow: events are dropped until the host has taken half the queue.
    dropping: bool,
}

fn event_bytes(ev: &WatchEvent) -> usize {
    ev.path.len() + ev.new_path.as_ref().map_or(0, String::len) + 32
}

impl Queue {
    pub(crate) fn push(&mut self, ev: WatchEvent) {
        if self.dropping {
            if self.events.len() > MAX_QUEUED / 2 || self.bytes > MAX_QUEUED_BYTES / 2 {
                return;
            }
            self.dropping = false;
        }
        // A write is often many `IN_MODIFY`s in a row: one event is enough.
        if ev.kind == WatchEventKind::Write && self.events.back() == Some(&ev) {
            return;
        }
        if ev.kind == WatchEventKind::Overflow
            || self.events.len() >= MAX_QUEUED
            || self.bytes + event_bytes(&ev) > MAX_QUEUED_BYTES
        {
            if self.events.back().map(|e| e.kind) != Some(WatchEventKind::Overflow) {
                let overflow = WatchEvent::overflow();
                self.bytes += event_bytes(&overflow);
                self.events.push_back(overflow);
            }
            self.dropping = ev.kind != WatchEventKind::Overflow;
            return;
        }
        self.bytes += event_bytes(&ev);
        self.events.push_back(ev);
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.events.len()
    }

    /// Takes events from the front as one JSON array of about [`BATCH_BYTES`].
    pub(crate) fn take_batch(&mut self) -> Bytes {
        let mut out = Vec::with_capacity(1024);
        out.push(b'[');
        while let Some(ev) = self.events.pop_front() {
            self.bytes -= event_bytes(&ev);
            if out.len() > 1 {
                out.push(b',');
            }
            // Serializing strings and enums does not fail.
            let _ = serde_json::to_writer(&mut out, &ev);
            if out.len() >= BATCH_BYTES {
                break;
            }
        }
        out.push(b']');
        Bytes::from(out)
    }
}

/// A `MOVED_FROM` waiting for its `MOVED_TO`.
struct PendingMove {
    cookie: u32,
    /// When it stops waiting for its pair.
    deadline: tokio::time::Instant,
    path: String,
    is_dir: bool,
}

/// The watched tree: the inotify instance and the directory of each of its watches.
struct Tree {
    fd: AsyncFd<InotifyFd>,
    root: PathBuf,
    root_wd: WatchDescriptor,
    recursive: bool,
    dirs: HashMap<WatchDescriptor, String>,
    pending_move: Option<PendingMove>,
    /// The watched directory itself is gone: send what is queued and end the stream.
    root_gone: bool,
}

fn join(dir: &str, name: &OsStr) -> String {
    let name = name.to_string_lossy();
    if dir.is_empty() {
        name.into_owned()
    } else {
        format!("{dir}/{name}")
    }
}

fn under(path: &str, dir: &str) -> bool {
    path == dir || path.strip_prefix(dir).is_some_and(|rest| rest.starts_with('/'))
}

impl Tree {
    fn abs(&self, rel: &str) -> PathBuf {
        if rel.is_empty() {
            self.root.clone()
        } else {
            self.root.join(rel)
        }
    }

    /// Watch directory `rel` (and, recursively, what it holds). With `report`, entries already there are
    /// queued as `create` events.
    fn add_dir(&mut self, rel: &str, report: Option<&mut Queue>) {
        let mut queue = report;
        let mut todo = vec![rel.to_owned()];
        while let Some(dir) = todo.pop() {
            if self.dirs.len() >= MAX_WATCHES {
                if let Some(q) = queue.as_deref_mut() {
                    q.push(WatchEvent::overflow());
                }
                return;
            }
            let Ok(wd) = self.fd.get_ref().0.add_watch(&self.abs(&dir), mask()) else {
                // Gone already, or not a directory any more: its parent reports that.
                continue;
            };
            self.dirs.insert(wd, dir.clone());
            let Ok(entries) = std::fs::read_dir(self.abs(&dir)) else {
                continue;
            };
            for entry in entries.flatten() {
                let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
                let path = join(&dir, &entry.file_name());
                if let Some(q) = queue.as_deref_mut() {
                    q.push(WatchEvent::new(WatchEventKind::Create, path.clone(), is_dir));
                }
                if is_dir && self.recursive {
                    todo.push(path);
                }
            }
        }
    }

    /// Stop watching directory `rel` and everything under it (moved out of the tree).
    fn drop_dir(&mut self, rel: &str) {
        let gone: Vec<WatchDescriptor> = self
            .dirs
            .iter()
            .filter(|(_, d)| under(d, rel))
            .map(|(wd, _)| *wd)
            .collect();
        for wd in gone {
            self.dirs.remove(&wd);
            let _ = self.fd.get_ref().0.rm_watch(wd);
        }
    }

    /// Directory `from` is now `to`: rewrite the paths of the watches under it.
    fn move_dir(&mut self, from: &str, to: &str) {
        for d in self.dirs.values_mut() {
            if under(d, from) {
                *d = format!("{to}{}", &d[from.len()..]);
            }
        }
    }

    /// An unpaired `MOVED_FROM`: the entry left the tree.
    fn flush_move(&mut self, q: &mut Queue) {
        if let Some(m) = self.pending_move.take() {
            if m.is_dir {
                self.drop_dir(&m.path);
            }
            q.push(WatchEvent::new(WatchEventKind::Rename, m.path, m.is_dir));
        }
    }

    fn on_event(&mut self, ev: InotifyEvent, q: &mut Queue) {
        let m = ev.mask;
        if m.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            self.flush_move(q);
            q.push(WatchEvent::overflow());
            return;
        }
        if m.contains(AddWatchFlags::IN_IGNORED) {
            self.dirs.remove(&ev.wd);
            if ev.wd == self.root_wd {
                self.root_gone = true;
            }
            return;
        }
        if m.intersects(AddWatchFlags::IN_DELETE_SELF | AddWatchFlags::IN_MOVE_SELF) {
            // Subdirectories are reported by their parent; only the root matters here.
            if ev.wd == self.root_wd {
                self.flush_move(q);
                self.root_gone = true;
            }
            return;
        }
        let (Some(dir), Some(name)) = (self.dirs.get(&ev.wd), ev.name.as_deref()) else {
            return;
        };
        let path = join(dir, name);
        let is_dir = m.contains(AddWatchFlags::IN_ISDIR);
        if m.contains(AddWatchFlags::IN_MOVED_TO)
            && let Some(from) = self.pending_move.take_if(|p| p.cookie == ev.cookie)
        {
            let mut e = WatchEvent::new(WatchEventKind::Rename, from.path.clone(), is_dir);
            e.new_path = Some(path.clone());
            q.push(e);
            if is_dir && self.recursive {
                self.move_dir(&from.path, &path);
                // Renamed before its watch was added (it was created and moved in one go): watch it now.
                if !self.dirs.values().any(|d| *d == path) {
                    self.add_dir(&path, Some(q));
                }
            }
            return;
        }
        self.flush_move(q);
        if m.contains(AddWatchFlags::IN_MOVED_FROM) {
            self.pending_move = Some(PendingMove {
                cookie: ev.cookie,
                deadline: tokio::time::Instant::now() + MOVE_PAIR_WAIT,
                path,
                is_dir,
            });
        } else if m.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
            q.push(WatchEvent::new(WatchEventKind::Create, path.clone(), is_dir));
            if is_dir && self.recursive {
                self.add_dir(&path, Some(q));
            }
        } else if m.contains(AddWatchFlags::IN_DELETE) {
            q.push(WatchEvent::new(WatchEventKind::Remove, path, is_dir));
        } else if m.contains(AddWatchFlags::IN_MODIFY) {
            if !is_dir {
                q.push(WatchEvent::new(WatchEventKind::Write, path, false));
            }
        } else if m.contains(AddWatchFlags::IN_ATTRIB) {
            q.push(WatchEvent::new(WatchEventKind::Chmod, path, is_dir));
        }
    }

    /// Reads every event the kernel has ready.
    fn read_ready(&mut self, q: &mut Queue) -> Result<(), Errno> {
        loop {
            match self.fd.get_ref().0.read_events() {
                Ok(events) => {
                    for ev in events {
                        self.on_event(ev, q);
                    }
                }
                Err(Errno::EAGAIN) => return Ok(()),
                Err(Errno::EINTR) => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// Set up the watch (off the async thread: a recursive tree may be large).
fn open_tree(req: WatchRequest) -> Result<Tree, AgentError> {
    let root = check_path(&req.path)?.to_owned();
    let meta = std::fs::metadata(&root)
        .map_err(|e| fail(errno_kind(&e), format!("watch {}: {e}", root.to_string_lossy())))?;
    if !meta.is_dir() {
        return Err(fail(
            ErrorKind::NotADirectory,
            format!("watch {}: not a directory", root.to_string_lossy()),
        ));
    }
    let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
        .map_err(|e| fail(ErrorKind::Other, format!("inotify_init: {e}")))?;
    let root_wd = inotify.add_watch(&root, mask()).map_err(|e| {
        let e = std::io::Error::from(e);
        fail(errno_kind(&e), format!("watch {}: {e}", root.to_string_lossy()))
    })?;
    // SAFETY: `InotifyFd` owns the descriptor (nix's `Inotify` holds an `OwnedFd`) and always returns that
    // same descriptor; it is closed only when the `AsyncFd` is dropped.
    let fd = unsafe { AsyncFd::register_with_interest(InotifyFd(inotify), Interest::READABLE) }
        .map_err(|e| fail(ErrorKind::Other, format!("inotify descriptor: {e}")))?;
    let mut tree = Tree {
        fd,
        root,
        root_wd,
        recursive: req.recursive,
        dirs: HashMap::from([(root_wd, String::new())]),
        pending_move: None,
        root_gone: false,
    };
    if req.recursive {
        let subdirs: Vec<String> = std::fs::read_dir(&tree.root)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        for d in subdirs {
            tree.add_dir(&d, None);
        }
        if tree.dirs.len() >= MAX_WATCHES {
            return Err(fail(
                ErrorKind::InvalidRequest,
                format!("more than {MAX_WATCHES} directories to watch; watch a smaller tree"),
            ));
        }
    }
    Ok(tree)
}

/// Serve one `WatchDir` stream until the host abandons it or the directory goes away.
pub(crate) async fn run(ctx: &Ctx, req: WatchRequest) -> Result<After, AgentError> {
    // A recursive tree may be large: walk it off the (single) async thread.
    let mut tree = tokio::task::spawn_blocking(move || open_tree(req))
        .await
        .map_err(|e| fail(ErrorKind::Other, format!("worker failed: {e}")))??;
    ctx.reply(GuestMsg::Watching);
    let mut queue = Queue::default();
    let mut batch: Option<Bytes> = None;
    loop {
        if batch.is_none() && !queue.is_empty() {
            batch = Some(queue.take_batch());
        }
        if batch.is_none() && tree.root_gone {
            ctx.reply(GuestMsg::Ok);
            return Ok(After::Done);
        }
        let cost = batch.as_ref().map_or(0, |b| hearth_proto::data_cost(b.len()));
        let pair_deadline = tree.pending_move.as_ref().map(|m| m.deadline);
        let readable = tokio::select! {
            _ = tokio::time::sleep_until(pair_deadline.unwrap_or_else(tokio::time::Instant::now)),
                if pair_deadline.is_some() => {
                tree.flush_move(&mut queue);
                false
            }
            ready = tree.fd.readable(), if !tree.root_gone => {
                // Cleared before reading: `read_ready` reads until the kernel has nothing more.
                ready.map(|mut guard| guard.clear_ready())
                    .map_err(|e| fail(ErrorKind::Other, format!("inotify: {e}")))?;
                true
            }
            credit = ctx.window.acquire(cost), if batch.is_some() => {
                if credit.is_err() {
                    return Ok(After::Done);
                }
                if let Some(b) = batch.take()
                    && ctx.out.send(ctx.stream, &GuestMsg::WatchEvents, b).is_err()
                {
                    return Ok(After::Done);
                }
                false
            }
        };
        if readable && let Err(e) = tree.read_ready(&mut queue) {
            return Err(fail(ErrorKind::Other, format!("inotify read: {e}")));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: WatchEventKind, path: &str) -> WatchEvent {
        WatchEvent::new(kind, path, false)
    }

    #[test]
    fn queue_is_bounded_and_reports_one_overflow() {
        let mut q = Queue::default();
        for i in 0..MAX_QUEUED * 3 {
            q.push(ev(WatchEventKind::Create, &format!("f{i}")));
        }
        assert_eq!(q.len(), MAX_QUEUED + 1);
        assert_eq!(q.events.back().map(|e| e.kind), Some(WatchEventKind::Overflow));
        // Still dropping until the host took half.
        q.push(ev(WatchEventKind::Create, "late"));
        assert_eq!(q.len(), MAX_QUEUED + 1);
        while q.len() > MAX_QUEUED / 2 {
            q.take_batch();
        }
        q.push(ev(WatchEventKind::Create, "after"));
        assert_eq!(q.events.back().map(|e| e.path.as_str()), Some("after"));
    }

    #[test]
    fn queue_bounds_bytes_too() {
        let mut q = Queue::default();
        let long = "x".repeat(4000);
        for _ in 0..1000 {
            q.push(ev(WatchEventKind::Create, &long));
        }
        assert!(q.bytes <= MAX_QUEUED_BYTES);
        assert_eq!(q.events.back().map(|e| e.kind), Some(WatchEventKind::Overflow));
    }

    #[test]
    fn repeated_writes_are_coalesced_and_batches_are_json_arrays() {
        let mut q = Queue::default();
        q.push(ev(WatchEventKind::Write, "a"));
        q.push(ev(WatchEventKind::Write, "a"));
        q.push(ev(WatchEventKind::Write, "b"));
        q.push(ev(WatchEventKind::Write, "a"));
        let batch: Vec<WatchEvent> = serde_json::from_slice(&q.take_batch()).expect("json array");
        let paths: Vec<&str> = batch.iter().map(|e| e.path.as_str()).collect();
        assert_eq!(paths, ["a", "b", "a"]);
        assert!(q.is_empty());
        assert_eq!(q.bytes, 0);
    }

    #[test]
    fn paths_under_a_directory() {
        assert!(under("a/b", "a"));
        assert!(under("a", "a"));
        assert!(!under("ab", "a"));
    }
}
