//! Templates saved from sandboxes, next to the built-in images.
//!
//! `POST /v1/templates {name, from_sandbox, include_memory}` checkpoints the sandbox (it continues), flattens
//! the checkpoint's disk copy into a standalone raw image with `qemu-img convert` (written to a temporary
//! directory, fsynced, renamed to `<data>/templates/<name>/`), and records the template. Without memory the
//! checkpoint is dropped again; with memory it is kept, and sandboxes created from the template restore it
//! (processes running) instead of booting. Built-in templates (`<images>/rootfs/*.ext4`) are listed too but
//! cannot be deleted here; a saved template is refused deletion while sandboxes use it.
//!
//! A recipe (`{name, recipe: {base, steps, env, start_cmd, ready_cmd}}`) runs in a build sandbox of `base`:
//! the steps in order (the first failing one fails the build with its output), then `start_cmd` in the
//! background until `ready_cmd` succeeds, then the sandbox is saved as above (with memory when there is a
//! `start_cmd`) and destroyed.

use std::os::unix::fs::DirBuilderExt;

use std::time::Duration;

use hearth_api::{CreateSandboxRequest, CreateTemplateRequest, Recipe, RunCommandRequest, Template};
use rand::RngCore;

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

fn file_size(p: &std::path::Path) -> u64 {
    std::fs::metadata(p).map(|m| m.len()).unwrap_or(0)
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

    /// Saves a sandbox's root filesystem (and with `include_memory` its running state) as a template, or builds
    /// one from a recipe.
    pub async fn create_template(&self, req: CreateTemplateRequest) -> Result<Template, ServiceError> {
        let (from, recipe) = match (req.from_sandbox, req.recipe) {
            (Some(from), None) => (from, None),
            (None, Some(recipe)) => (String::new(), Some(recipe)),
            _ => {
                return Err(ServiceError::InvalidArgument(
                    "give exactly one of from_sandbox and recipe".into(),
                ));
            }
        };
        let name = req.name;
        if !hearth_api::is_valid_template_name(&name) {
            return Err(ServiceError::InvalidArgument(format!(
                "invalid template name {:?} (expected [a-z0-9-], 1-63 characters)",
                clip(&name, 64)
            )));
        }
        if self.settings.paths.template_base(&name).is_some() || self.db.get_template(&name)?.is_some() {
            return Err(ServiceError::Conflict(format!("template {name} already exists")));
        }
        if let Some(recipe) = recipe {
            return self.build_template(name, recipe).await;
        }
        self.save_template(name, from, req.include_memory).await
    }

    async fn save_template(
        &self,
        name: String,
        from: String,
        include_memory: bool,
    ) -> Result<Template, ServiceError> {
        self.row(&from)?;
        let snap = self.checkpoint(&from).await?;
        let result = self.flatten(&name, &snap.id).await;
        let keep_snapshot = include_memory && result.is_ok();
        if !keep_snapshot && let Err(e) = self.delete_snapshot(&snap.id) {
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
                let _ = self.delete_snapshot(&snap.id);
            }
            return Err(e.into());
        }
        tracing::info!(template = %name, from = %from, memory = keep_snapshot, "template saved");
        Ok(self.template_api(&row))
    }

    /// Builds a template from a recipe in a build sandbox, which is destroyed afterwards whatever happens.
    async fn build_template(&self, name: String, recipe: Recipe) -> Result<Template, ServiceError> {
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
        let this = self.arc()?;
        let req = CreateSandboxRequest {
            template: Some(recipe.base.clone()),
            env: recipe.env.clone(),
            timeout_s: Some(BUILD_TIMEOUT.as_secs()),
            metadata: [("hearth.template-build".to_string(), name.clone())].into(),
            ..Default::default()
        };
        let build = this.create(req).await?;
        let result = self.build_in(&build.id, &name, &recipe).await;
        if let Err(e) = this.destroy(&build.id, "template-build").await {
            tracing::warn!(sandbox = %build.id, error = %e, "removing the build sandbox");
        }
        result
    }

    async fn build_in(&self, id: &str, name: &str, recipe: &Recipe) -> Result<Template, ServiceError> {
        for (i, step) in recipe.steps.iter().enumerate() {
            let req = RunCommandRequest {
                cmd: Some(step.clone()),
                timeout_s: Some(STEP_TIMEOUT.as_secs()),
                ..Default::default()
            };
            let r = self.run_command(id, &req).await?;
            tracing::info!(template = %name, step = i + 1, exit = r.exit_code, "template build step");
            if r.exit_code != 0 {
                return Err(ServiceError::Guest(format!(
                    "step {} ({}) failed with exit code {}: {}{}",
                    i + 1,
                    clip(step, 200),
                    r.exit_code,
                    clip(&r.stdout, 4096),
                    clip(&r.stderr, 4096)
                )));
            }
        }
        if let Some(start) = &recipe.start_cmd {
            let req = RunCommandRequest {
                cmd: Some(start.clone()),
                background: true,
                ..Default::default()
            };
            self.start_background(id, &req).await?;
            if let Some(ready) = &recipe.ready_cmd {
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
        self.save_template(name.to_string(), id.to_string(), recipe.start_cmd.is_some())
            .await
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
            let out = tokio::process::Command::new("qemu-img")
                .args(["convert", "-O", "raw"])
                .arg(&disk)
                .arg(&image)
                .output()
                .await
                .map_err(|e| ServiceError::Internal(format!("running qemu-img: {e}")))?;
            if !out.status.success() {
                return Err(ServiceError::VmmFailed(format!(
                    "qemu-img convert failed: {}",
                    clip(String::from_utf8_lossy(&out.stderr).trim(), 1024)
                )));
            }
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
    pub fn delete_template(&self, name: &str) -> Result<(), ServiceError> {
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
        if let Some(snap) = &t.snapshot_id
            && let Err(e) = self.delete_snapshot(snap)
        {
            tracing::warn!(template = %name, snapshot = %snap, error = %e, "removing the template's snapshot");
        }
        let dir = self.settings.paths.user_templates_dir().join(name);
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(template = %name, error = %e, "removing the template directory failed");
        }
        Ok(())
    }
}
