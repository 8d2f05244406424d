//! Templates saved from sandboxes, next to the built-in images.
//!
//! `POST /v1/templates {name, from_sandbox, include_memory}` checkpoints the sandbox (it continues), flattens
//! the checkpoint's disk copy into a standalone raw image (`Vmm::flatten_disk`, format from the manifest; written to a temporary
//! directory, fsynced, renamed to `<data>/templates/<name>/`), and records the template. Without memory the
//! checkpoint is dropped again; with memory it is kept, and sandboxes created from the template restore it
//! (processes running) instead of booting. Built-in templates (`<images>/rootfs/*.ext4`) are listed too but
//! cannot be deleted here; a saved template is refused deletion while sandboxes use it.
//!
//! A recipe (`{name, recipe: {base, steps, env, start_cmd, ready_cmd}}`) runs in a build sandbox of `base`:
//! the steps in order (the first failing one fails the build with its output), then `start_cmd` in the
//! background until `ready_cmd` succeeds, then the sandbox is saved as above (with memory when there is a
//! `start_cmd`) and destroyed.
//!
//! Progress: [`Sandboxes::create_template_reporting`] sends [`TemplateBuildEvent`]s (phases, each step's start,
//! output lines and end, then `done` or `failed`) into a bounded channel that the SSE route drains. A slow reader
//! slows the build (the agent's flow control holds the step's output back), but one that stops reading is given up
//! on after [`READER_PATIENCE`]; a reader that goes away does not stop it: the build finishes, the build sandbox is
//! destroyed, and the template is saved or not as usual.

use std::os::unix::fs::DirBuilderExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hearth_api::{
    BuildPhase, CreateSandboxRequest, CreateTemplateRequest, OutputStream, Recipe, RunCommandRequest,
    Template, TemplateBuildEvent,
};
use hearth_proto::client::ExecEvent;
use rand::RngCore;
use tokio::sync::mpsc;

use super::exec::exit_code;
use super::lifecycle::rfc3339;
use super::{Sandboxes, ServiceError, clip, now_ms, snapshot};
use crate::db::snapshots::TemplateRow;

/// Most steps in one recipe.
const MAX_STEPS: usize = 256;
/// Longest one build step may run.
const STEP_TIMEOUT: Duration = Duration::from_secs(3600);
/// How long `ready_cmd` may take to succeed.
const READY_TIMEOUT: Duration = Duration::from_secs(300);
/// TTL of a build sandbox (it is destroyed when the build ends).
const BUILD_TIMEOUT: Duration = Duration::from_secs(86400);

/// Longest output line sent in one `step_output` event; longer lines arrive in pieces.
const MAX_LINE: usize = 4096;
/// Bytes of the end of each output stream of a failing step quoted in the build's error.
const FAILURE_TAIL: usize = 4096;

fn file_size(p: &std::path::Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
}

/// Where a build reports its progress; [`BuildProgress::none`] reports nothing (the plain JSON answer).
///
/// A reader that stops reading holds the build back for at most [`READER_PATIENCE`] per event; after that the
/// build stops reporting and goes on, so a stalled client cannot keep a build sandbox alive.
#[derive(Clone, Default)]
pub struct BuildProgress(Option<Reporter>);

#[derive(Clone)]
struct Reporter {
    tx: mpsc::Sender<TemplateBuildEvent>,
    patience: Duration,
    gave_up: Arc<AtomicBool>,
}

/// How long one progress event may wait for a reader that does not read.
pub const READER_PATIENCE: Duration = Duration::from_secs(60);

impl BuildProgress {
    pub fn none() -> Self {
        BuildProgress(None)
    }

    /// A reporter and the receiving end of its events (at most `capacity` waiting).
    pub fn channel(capacity: usize) -> (Self, mpsc::Receiver<TemplateBuildEvent>) {
        Self::channel_with_patience(capacity, READER_PATIENCE)
    }

    /// [`BuildProgress::channel`] giving up on a stalled reader after `patience` instead.
    pub fn channel_with_patience(
        capacity: usize,
        patience: Duration,
    ) -> (Self, mpsc::Receiver<TemplateBuildEvent>) {
        let (tx, rx) = mpsc::channel(capacity);
        let reporter = Reporter {
            tx,
            patience,
            gave_up: Arc::default(),
        };
        (BuildProgress(Some(reporter)), rx)
    }

    fn active(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|r| !r.tx.is_closed() && !r.gave_up.load(Ordering::Relaxed))
    }

    async fn send(&self, ev: TemplateBuildEvent) {
        let Some(r) = &self.0 else { return };
        if r.gave_up.load(Ordering::Relaxed) {
            return;
        }
        // A reader that went away does not stop the build; one that stalls is given up on.
        if let Err(mpsc::error::SendTimeoutError::Timeout(_)) = r.tx.send_timeout(ev, r.patience).await {
            tracing::warn!("template build: the progress reader stopped reading; reporting no more");
            r.gave_up.store(true, Ordering::Relaxed);
        }
    }
}

/// One output stream of a running step: cut into lines for progress events, with its tail kept for the error
/// message of a failing step.
struct StepStream {
    kind: OutputStream,
    partial: Vec<u8>,
    tail: Vec<u8>,
}

impl StepStream {
    fn new(kind: OutputStream) -> Self {
        StepStream {
            kind,
            partial: Vec::new(),
            tail: Vec::new(),
        }
    }

    /// Takes a chunk; returns the lines it completed (and pieces of overlong lines) when `lines` is set.
    fn push(&mut self, data: &[u8], lines: bool) -> Vec<String> {
        self.tail.extend_from_slice(data);
        if self.tail.len() > FAILURE_TAIL {
            self.tail.drain(..self.tail.len() - FAILURE_TAIL);
        }
        if !lines {
            return Vec::new();
        }
        let mut out = Vec::new();
        for &b in data {
            if b == b'\n' {
                out.push(line_text(&std::mem::take(&mut self.partial)));
            } else {
                self.partial.push(b);
                if self.partial.len() >= MAX_LINE {
                    out.push(line_text(&std::mem::take(&mut self.partial)));
                }
            }
        }
        out
    }

    /// The unterminated last line, if any.
    fn finish(&mut self) -> Option<String> {
        (!self.partial.is_empty()).then(|| line_text(&std::mem::take(&mut self.partial)))
    }

    fn tail_text(&self) -> String {
        String::from_utf8_lossy(&self.tail).into_owned()
    }
}

fn line_text(bytes: &[u8]) -> String {
    let bytes = bytes.strip_suffix(b"\r").unwrap_or(bytes);
    String::from_utf8_lossy(bytes).into_owned()
}

/// How one build step ended.
struct StepOutcome {
    exit_code: i32,
    stdout_tail: String,
    stderr_tail: String,
}

impl Sandboxes {
    fn template_api(&self, t: &TemplateRow) -> Template {
        Template {
            name: t.name.clone(),
            builtin: false,
            from_sandbox: Some(t.from_sandbox.clone()),
            snapshot_id: t.snapshot_id.clone(),
            size_bytes: t.size_bytes,
            created_at: Some(rfc3339(t.created_at_ms)),
            storage: self.object_storage(super::remote::Kind::Template, &t.name),
        }
    }

    /// Built-in and saved templates, by name.
    pub fn list_templates(&self) -> Result<Vec<Template>, ServiceError> {
        let mut out: Vec<Template> = self
            .db
            .list_templates()?
            .iter()
            .map(|t| self.template_api(t))
            .collect();
        for name in self.settings.paths.templates() {
            if out.iter().any(|t| t.name == name) {
                continue;
            }
            out.push(Template {
                size_bytes: file_size(&self.settings.paths.template_image(&name)),
                name,
                builtin: true,
                from_sandbox: None,
                snapshot_id: None,
                created_at: None,
                storage: None,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    pub fn get_template(&self, name: &str) -> Result<Template, ServiceError> {
        self.list_templates()?
            .into_iter()
            .find(|t| t.name == name)
            .ok_or_else(|| ServiceError::NotFound(format!("template {} not found", clip(name, 64))))
    }

    /// Checks a create-template request without doing anything: exactly one source, a valid and free name, a
    /// recipe within its limits. The HTTP route calls it before it commits to an event stream.
    pub fn check_template_request(&self, req: &CreateTemplateRequest) -> Result<(), ServiceError> {
        if req.from_sandbox.is_some() == req.recipe.is_some() {
            return Err(ServiceError::InvalidArgument(
                "give exactly one of from_sandbox and recipe".into(),
            ));
        }
        let name = &req.name;
        if !hearth_api::is_valid_template_name(name) {
            return Err(ServiceError::InvalidArgument(format!(
                "invalid template name {:?} (expected [a-z0-9-], 1-63 characters)",
                clip(name, 64)
            )));
        }
        if self.settings.paths.template_base(name).is_some() || self.db.get_template(name)?.is_some() {
            return Err(ServiceError::Conflict(format!("template {name} already exists")));
        }
        if let Some(recipe) = &req.recipe {
            if recipe.steps.len() > MAX_STEPS {
                return Err(ServiceError::InvalidArgument(format!(
                    "more than {MAX_STEPS} steps"
                )));
            }
            if recipe.ready_cmd.is_some() && recipe.start_cmd.is_none() {
                return Err(ServiceError::InvalidArgument(
                    "ready_cmd needs a start_cmd".into(),
                ));
            }
        }
        Ok(())
    }

    /// Saves a sandbox's root filesystem (and with `include_memory` its running state) as a template, or builds
    /// one from a recipe.
    pub async fn create_template(&self, req: CreateTemplateRequest) -> Result<Template, ServiceError> {
        self.create_template_reporting(req, &BuildProgress::none()).await
    }

    /// [`Sandboxes::create_template`] that reports its progress, ending with `done` or `failed`.
    pub async fn create_template_reporting(
        &self,
        req: CreateTemplateRequest,
        progress: &BuildProgress,
    ) -> Result<Template, ServiceError> {
        let result = self.create_template_inner(req, progress).await;
        let last = match &result {
            Ok(t) => TemplateBuildEvent::Done { template: t.clone() },
            Err(e) => TemplateBuildEvent::Failed {
                code: e.code(),
                message: e.to_string(),
            },
        };
        progress.send(last).await;
        result
    }

    async fn create_template_inner(
        &self,
        req: CreateTemplateRequest,
        progress: &BuildProgress,
    ) -> Result<Template, ServiceError> {
        self.check_template_request(&req)?;
        let steps = req.recipe.as_ref().map_or(0, |r| r.steps.len());
        progress
            .send(TemplateBuildEvent::Started {
                name: req.name.clone(),
                steps: u32::try_from(steps).unwrap_or(u32::MAX),
            })
            .await;
        match (req.from_sandbox, req.recipe) {
            (_, Some(recipe)) => self.build_template(req.name, recipe, progress).await,
            (Some(from), None) => {
                progress
                    .send(TemplateBuildEvent::Phase {
                        phase: BuildPhase::Saving,
                    })
                    .await;
                self.save_template(req.name, from, req.include_memory).await
            }
            (None, None) => Err(ServiceError::InvalidArgument(
                "give exactly one of from_sandbox and recipe".into(),
            )),
        }
    }

    async fn save_template(
        &self,
        name: String,
        from: String,
        include_memory: bool,
    ) -> Result<Template, ServiceError> {
        self.row(&from)?;
        if include_memory {
            self.refuse_memory_with_mounts(&from)?;
        }
        let snap = self.checkpoint(&from).await?;
        // Kept in the local cache while the template is made from it.
        let _pin = self.cache_pin(&[(super::remote::Kind::Snapshot, snap.id.clone())]);
        let result = self.flatten(&name, &snap.id).await;
        let keep_snapshot = include_memory && result.is_ok();
        if !keep_snapshot && let Err(e) = self.delete_snapshot(&snap.id).await {
            tracing::warn!(snapshot = %snap.id, error = %e, "dropping the template's checkpoint");
        }
        let size_bytes = result?;
        let row = TemplateRow {
            name: name.clone(),
            from_sandbox: from.clone(),
            snapshot_id: keep_snapshot.then(|| snap.id.clone()),
            created_at_ms: now_ms(),
            size_bytes,
        };
        if let Err(e) = self.db.insert_template(&row) {
            let _ = std::fs::remove_dir_all(self.settings.paths.user_templates_dir().join(&name));
            if keep_snapshot {
                let _ = self.delete_snapshot(&snap.id).await;
            }
            return Err(e.into());
        }
        self.storage_committed(
            super::remote::Kind::Template,
            &name,
            row.created_at_ms,
            size_bytes,
        );
        tracing::info!(template = %name, from = %from, memory = keep_snapshot, "template saved");
        Ok(self.template_api(&row))
    }

    /// Builds a template from a recipe in a build sandbox, which is destroyed afterwards whatever happens.
    async fn build_template(
        &self,
        name: String,
        recipe: Recipe,
        progress: &BuildProgress,
    ) -> Result<Template, ServiceError> {
        let this = self.arc()?;
        let req = CreateSandboxRequest {
            template: Some(recipe.base.clone()),
            env: recipe.env.clone(),
            timeout_s: Some(BUILD_TIMEOUT.as_secs()),
            metadata: [("hearth.template-build".to_string(), name.clone())].into(),
            ..Default::default()
        };
        progress
            .send(TemplateBuildEvent::Phase {
                phase: BuildPhase::CreatingSandbox,
            })
            .await;
        let build = this.create(req).await?;
        let result = self.build_in(&build.id, &name, &recipe, progress).await;
        if let Err(e) = this.destroy(&build.id, "template-build").await {
            tracing::warn!(sandbox = %build.id, error = %e, "removing the build sandbox");
        }
        result
    }

    async fn build_in(
        &self,
        id: &str,
        name: &str,
        recipe: &Recipe,
        progress: &BuildProgress,
    ) -> Result<Template, ServiceError> {
        for (i, step) in recipe.steps.iter().enumerate() {
            let n = u32::try_from(i + 1).unwrap_or(u32::MAX);
            progress
                .send(TemplateBuildEvent::StepStarted {
                    step: n,
                    cmd: clip(step, 4096),
                })
                .await;
            let started = tokio::time::Instant::now();
            let r = self.run_step(id, n, step, progress).await?;
            let duration_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
            progress
                .send(TemplateBuildEvent::StepFinished {
                    step: n,
                    exit_code: r.exit_code,
                    duration_ms,
                })
                .await;
            tracing::info!(template = %name, step = n, exit = r.exit_code, duration_ms, "template build step");
            if r.exit_code != 0 {
                return Err(ServiceError::Guest(format!(
                    "step {n} ({}) failed with exit code {}: {}{}",
                    clip(step, 200),
                    r.exit_code,
                    r.stdout_tail,
                    r.stderr_tail
                )));
            }
        }
        if let Some(start) = &recipe.start_cmd {
            progress
                .send(TemplateBuildEvent::Phase {
                    phase: BuildPhase::StartCmd,
                })
                .await;
            let req = RunCommandRequest {
                cmd: Some(start.clone()),
                background: true,
                ..Default::default()
            };
            self.start_background(id, &req).await?;
            if let Some(ready) = &recipe.ready_cmd {
                progress
                    .send(TemplateBuildEvent::Phase {
                        phase: BuildPhase::WaitingReady,
                    })
                    .await;
                let deadline = tokio::time::Instant::now() + READY_TIMEOUT;
                loop {
                    let req = RunCommandRequest {
                        cmd: Some(ready.clone()),
                        timeout_s: Some(30),
                        ..Default::default()
                    };
                    let r = self.run_command(id, &req).await?;
                    if r.exit_code == 0 {
                        break;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        return Err(ServiceError::Guest(format!(
                            "ready_cmd did not succeed within {} s: {}{}",
                            READY_TIMEOUT.as_secs(),
                            clip(&r.stdout, 2048),
                            clip(&r.stderr, 2048)
                        )));
                    }
                    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
                }
            }
        }
        progress
            .send(TemplateBuildEvent::Phase {
                phase: BuildPhase::Saving,
            })
            .await;
        self.save_template(name.to_string(), id.to_string(), recipe.start_cmd.is_some())
            .await
    }

    /// Runs one build step, reporting its output line by line; keeps the tails of its output for the error.
    async fn run_step(
        &self,
        id: &str,
        step: u32,
        cmd: &str,
        progress: &BuildProgress,
    ) -> Result<StepOutcome, ServiceError> {
        let req = RunCommandRequest {
            cmd: Some(cmd.to_string()),
            timeout_s: Some(STEP_TIMEOUT.as_secs()),
            ..Default::default()
        };
        let mut running = self.start_command(id, &req).await?;
        let mut out = StepStream::new(OutputStream::Stdout);
        let mut err = StepStream::new(OutputStream::Stderr);
        loop {
            let ev = match tokio::time::timeout_at(running.deadline, running.handle.next_event()).await {
                Ok(Some(ev)) => ev,
                Ok(None) => {
                    return Err(ServiceError::AgentUnavailable(
                        "command stream ended without exit".into(),
                    ));
                }
                Err(_) => {
                    self.kill_after_host_timeout(id, running.pid).await;
                    return Err(ServiceError::AgentUnavailable(format!(
                        "agent did not report the end of step {step} in time"
                    )));
                }
            };
            let (stream, data) = match ev {
                ExecEvent::Stdout(b) => (&mut out, b),
                ExecEvent::Stderr(b) => (&mut err, b),
                ExecEvent::Exited { code, signal, .. } => {
                    for s in [&mut out, &mut err] {
                        if let Some(line) = s.finish() {
                            let stream = s.kind;
                            progress
                                .send(TemplateBuildEvent::StepOutput { step, stream, line })
                                .await;
                        }
                    }
                    return Ok(StepOutcome {
                        exit_code: exit_code(code, signal),
                        stdout_tail: out.tail_text(),
                        stderr_tail: err.tail_text(),
                    });
                }
                ExecEvent::Error(e) => return Err(e.into()),
            };
            let kind = stream.kind;
            for line in stream.push(&data, progress.active()) {
                progress
                    .send(TemplateBuildEvent::StepOutput {
                        step,
                        stream: kind,
                        line,
                    })
                    .await;
            }
        }
    }

    /// Flattens the disk copy of snapshot `snap` into `<data>/templates/<name>/rootfs.ext4`; returns its size.
    async fn flatten(&self, name: &str, snap: &str) -> Result<u64, ServiceError> {
        let snap_dir = self.settings.paths.snapshot_dir(snap);
        let kind = self.vmm.kind();
        let d = snap_dir.clone();
        let manifest = tokio::task::spawn_blocking(move || snapshot::verify(&d, kind))
            .await
            .map_err(|e| ServiceError::Internal(format!("verify task: {e}")))??;
        let disk = manifest
            .info
            .disk
            .as_deref()
            .map(|d| snap_dir.join(d))
            .ok_or_else(|| ServiceError::VmmFailed("the checkpoint has no disk copy".into()))?;
        let parent = self.settings.paths.user_templates_dir();
        std::fs::create_dir_all(&parent)
            .map_err(|e| ServiceError::Internal(format!("creating {}: {e}", parent.display())))?;
        let mut rnd = [0u8; 6];
        rand::rng().fill_bytes(&mut rnd);
        let tmp = parent.join(format!(".tmp-{name}-{}", hex::encode(rnd)));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .map_err(|e| ServiceError::Internal(format!("creating {}: {e}", tmp.display())))?;
        let result = async {
            let image = tmp.join("rootfs.ext4");
            // The disk copy's format is the manifest's record, never sniffed from its bytes (the guest wrote
            // them, and may have written a disk header naming a host file).
            self.vmm
                .flatten_disk(&disk, manifest.info.disk_format(), &image)
                .await
                .map_err(|e| ServiceError::VmmFailed(format!("flattening the disk: {e}")))?;
            let sync = |p: &std::path::Path| std::fs::File::open(p).and_then(|f| f.sync_all());
            sync(&image)
                .and_then(|_| sync(&tmp))
                .and_then(|_| std::fs::rename(&tmp, parent.join(name)))
                .and_then(|_| sync(&parent))
                .map_err(|e| ServiceError::Internal(format!("saving the template image: {e}")))?;
            Ok(file_size(&parent.join(name).join("rootfs.ext4")))
        }
        .await;
        if result.is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        result
    }

    /// Deletes a saved template nobody uses.
    pub async fn delete_template(&self, name: &str) -> Result<(), ServiceError> {
        let t = self.get_template(name)?;
        if t.builtin {
            return Err(ServiceError::Conflict(format!(
                "template {name} is built in (images/rootfs) and cannot be deleted through the API"
            )));
        }
        let users = self.db.delete_template_unless_used(name)?;
        if !users.is_empty() {
            return Err(ServiceError::Conflict(format!(
                "template {name} is used by {}: destroy them first",
                users.join(", ")
            )));
        }
        self.storage_deleted(super::remote::Kind::Template, name);
        // The files go in a task of their own (a caller that goes away does not stop it halfway); the answer
        // waits for them. Then its boot snapshots are retired and deleted once no sandbox builds on them, in the
        // background: the answer does not wait for other snapshots' directories.
        let this = self.arc()?;
        let name = name.to_string();
        let cleanup = tokio::spawn(async move {
            if let Some(snap) = &t.snapshot_id
                && let Err(e) = this.delete_snapshot(snap).await
            {
                tracing::warn!(template = %name, snapshot = %snap, error = %e, "removing the template's snapshot");
            }
            let dir = this.settings.paths.user_templates_dir().join(&name);
            super::remove_dir_off_runtime(dir, &format!("template directory {name}")).await;
            tokio::spawn(async move { this.sweep_boot_snapshots().await });
        });
        cleanup
            .await
            .map_err(|e| ServiceError::Internal(format!("template cleanup task: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_is_cut_into_lines_across_chunks() {
        let mut s = StepStream::new(OutputStream::Stdout);
        assert_eq!(s.push(b"one\ntw", true), vec!["one"]);
        assert_eq!(s.push(b"o\r\n\nthr", true), vec!["two", ""]);
        assert_eq!(s.finish().as_deref(), Some("thr"));
        assert_eq!(s.finish(), None);
        assert_eq!(s.tail_text(), "one\ntwo\r\n\nthr");
    }

    #[test]
    fn long_lines_arrive_in_pieces_and_the_tail_is_bounded() {
        let mut s = StepStream::new(OutputStream::Stderr);
        let long = vec![b'x'; MAX_LINE * 2 + 10];
        let lines = s.push(&long, true);
        assert_eq!(lines.len(), 2);
        assert!(lines.iter().all(|l| l.len() == MAX_LINE));
        assert_eq!(s.finish().map(|l| l.len()), Some(10));
        assert_eq!(s.tail.len(), FAILURE_TAIL);
        // Without a reader nothing is split, but the tail is still kept.
        let mut quiet = StepStream::new(OutputStream::Stdout);
        assert!(quiet.push(b"a\nb\n", false).is_empty());
        assert_eq!(quiet.tail_text(), "a\nb\n");
    }

    #[tokio::test]
    async fn a_stalled_reader_is_given_up_on() {
        let (progress, mut rx) = BuildProgress::channel_with_patience(1, Duration::from_millis(50));
        let phase = || TemplateBuildEvent::Phase {
            phase: BuildPhase::Saving,
        };
        progress.send(phase()).await;
        assert!(progress.active());
        let t = std::time::Instant::now();
        progress.send(phase()).await;
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert!(!progress.active(), "given up after the patience");
        let t = std::time::Instant::now();
        progress.send(phase()).await;
        assert!(t.elapsed() < Duration::from_millis(50), "no more waiting");
        assert_eq!(rx.recv().await, Some(phase()));
        drop(progress);
        assert_eq!(rx.recv().await, None);
    }

    #[test]
    fn invalid_utf8_is_replaced() {
        let mut s = StepStream::new(OutputStream::Stdout);
        assert_eq!(s.push(b"\xff\xfeok\n", true), vec!["\u{fffd}\u{fffd}ok"]);
    }
}
