//! The fake VMM shared by the in-process tests: its "VM" is a real `sleep` child process, its agent a small
//! in-test implementation of the protocol (Hello, Ping, Exec), its snapshots small files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hearth_api::CreateSandboxRequest;
use hearth_proto::frame::{FrameDecoder, encode};
use hearth_proto::msg::{ExitStatus, GuestMsg, HostMsg};
use hearth_vmm::{Accel, SnapshotInfo, SnapshotMode, VmHandle, VmSpec, Vmm, VmmError, VmmKind};
use hearthd::config::Paths;
use hearthd::db::Db;
use hearthd::service::{Sandboxes, Settings, VmmInfo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// A VMM whose machines are `sleep` processes and whose agents answer Hello, Ping and Exec.
pub struct FakeVmm {
    /// Agent connections still allowed (each connect uses one).
    pub connects_left: AtomicUsize,
    /// Host ends of the open agent connections' peers, so a test can cut them.
    pub agents: Mutex<Vec<tokio::task::AbortHandle>>,
    pub children: Mutex<Vec<std::process::Child>>,
    /// When set, `snapshot` fails without touching the VM.
    pub fail_snapshot: AtomicBool,
    /// Restores done so far.
    pub restores: AtomicUsize,
    /// When set, the agents stop answering pings (a hung guest whose channel stays open).
    pub mute_pings: Arc<AtomicBool>,
}

impl FakeVmm {
    pub fn cut_agents(&self) {
        for a in self.agents.lock().unwrap_or_else(|p| p.into_inner()).drain(..) {
            a.abort();
        }
    }
}

impl Drop for FakeVmm {
    fn drop(&mut self) {
        for c in self.children.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

async fn send(w: &mut tokio::net::unix::OwnedWriteHalf, stream: u32, msg: &GuestMsg, data: &[u8]) -> bool {
    let Ok(frame) = encode(stream, msg, Bytes::copy_from_slice(data)) else {
        return false;
    };
    w.write_all(&frame.to_vec()).await.is_ok()
}

/// The in-test agent: enough of the protocol for create and one command.
async fn fake_agent(sock: UnixStream, mute_pings: Arc<AtomicBool>) {
    let (mut r, mut w) = sock.into_split();
    let mut dec = FrameDecoder::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        dec.extend(&buf[..n]);
        while let Ok(Some(frame)) = dec.decode() {
            let Ok(h) = frame.parse::<HostMsg>() else { continue };
            let ok = match h.msg {
                HostMsg::Hello { version, nonce, .. } => {
                    let msg = GuestMsg::HelloOk {
                        version,
                        agent_version: "fake".into(),
                        nonce,
                        post_restore: None,
                    };
                    send(&mut w, h.stream, &msg, b"").await
                }
                HostMsg::Ping if mute_pings.load(Ordering::SeqCst) => true,
                HostMsg::Ping => send(&mut w, h.stream, &GuestMsg::Pong, b"").await,
                HostMsg::Sync => send(&mut w, h.stream, &GuestMsg::Ok, b"").await,
                HostMsg::PostRestore(_) => {
                    let report = hearth_proto::msg::PostRestoreReport {
                        clock_set: true,
                        ..Default::default()
                    };
                    send(&mut w, h.stream, &GuestMsg::PostRestored(report), b"").await
                }
                HostMsg::Exec(req) => {
                    let out = format!(
                        "ran {} with FOO={}\n",
                        req.command.display(),
                        req.env.get("FOO").map_or("", |v| v)
                    );
                    send(&mut w, h.stream, &GuestMsg::Started { pid: 42 }, b"").await
                        && send(&mut w, h.stream, &GuestMsg::Stdout, out.as_bytes()).await
                        && send(
                            &mut w,
                            h.stream,
                            &GuestMsg::Exited(ExitStatus {
                                code: Some(i32::from(req.command.display().to_string().starts_with("false"))),
                                signal: None,
                                timed_out: false,
                            }),
                            b"",
                        )
                        .await
                }
                _ => true,
            };
            if !ok {
                return;
            }
        }
    }
}

#[async_trait::async_trait]
impl Vmm for FakeVmm {
    fn kind(&self) -> VmmKind {
        VmmKind::Qemu
    }
    fn accel(&self) -> Accel {
        Accel::Tcg
    }
    fn version(&self) -> String {
        "fake 1".into()
    }
    async fn prepare_disk(
        &self,
        _base: &Path,
        _format: hearth_vmm::DiskFormat,
        dest_dir: &Path,
    ) -> Result<PathBuf, VmmError> {
        let disk = dest_dir.join("disk.qcow2");
        std::fs::write(&disk, b"").map_err(|source| VmmError::Io {
            path: disk.clone(),
            source,
        })?;
        Ok(disk)
    }
    async fn start(&self, spec: &VmSpec) -> Result<VmHandle, VmmError> {
        let child = std::process::Command::new("sleep")
            .arg("600")
            .spawn()
            .map_err(|source| VmmError::Io {
                path: spec.run_dir.clone(),
                source,
            })?;
        let pid = child.id();
        self.children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(child);
        let start_ticks = hearth_vmm::process_start_ticks(pid).unwrap_or(0);
        Ok(VmHandle {
            kind: VmmKind::Qemu,
            pid,
            start_ticks,
            run_dir: spec.run_dir.clone(),
        })
    }
    async fn connect_agent(&self, vm: &VmHandle) -> Result<UnixStream, VmmError> {
        let refused = || VmmError::AgentChannel {
            id: vm.run_dir.display().to_string(),
            detail: "refused".into(),
        };
        self.connects_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map_err(|_| refused())?;
        let (host, guest) = UnixStream::pair().map_err(|source| VmmError::Io {
            path: vm.run_dir.clone(),
            source,
        })?;
        let task = tokio::spawn(fake_agent(guest, self.mute_pings.clone()));
        self.agents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(task.abort_handle());
        Ok(host)
    }
    async fn stop(&self, vm: &VmHandle) -> Result<(), VmmError> {
        // Like a real driver: terminate the process and wait for it.
        for c in self.children.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
            if c.id() == vm.pid {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
        Ok(())
    }
    fn is_alive(&self, vm: &VmHandle) -> bool {
        let mut children = self.children.lock().unwrap_or_else(|p| p.into_inner());
        children
            .iter_mut()
            .any(|c| c.id() == vm.pid && matches!(c.try_wait(), Ok(None)))
    }
    async fn snapshot(
        &self,
        vm: &VmHandle,
        _disk: &Path,
        dest: &Path,
        mode: SnapshotMode,
    ) -> Result<SnapshotInfo, VmmError> {
        if self.fail_snapshot.load(Ordering::SeqCst) {
            return Err(VmmError::Snapshot {
                path: dest.to_path_buf(),
                detail: "No space left on device (fake)".into(),
            });
        }
        let io = |source| VmmError::Io {
            path: dest.to_path_buf(),
            source,
        };
        std::fs::write(dest.join("memory"), vec![0x5a; 256 * 1024]).map_err(io)?;
        std::fs::write(dest.join("state"), format!("pid {}", vm.pid)).map_err(io)?;
        let mut files = vec!["memory".to_string(), "state".to_string()];
        let mut disk = None;
        if mode == SnapshotMode::Pause {
            self.stop(vm).await?;
        } else {
            std::fs::write(dest.join("disk"), b"disk copy").map_err(io)?;
            files.push("disk".into());
            disk = Some("disk".to_string());
        }
        Ok(SnapshotInfo {
            kind: VmmKind::Qemu,
            vmm_version: "fake 1".into(),
            files,
            // Its disk copy holds plain bytes (the real QEMU driver writes qcow2).
            disk_format: disk.as_ref().map(|_| hearth_vmm::DiskFormat::Raw),
            disk,
            memory_mib: 512,
            vcpus: 1,
            memory_file: None,
            features: Vec::new(),
        })
    }
    async fn restore(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        info: &SnapshotInfo,
    ) -> Result<VmHandle, VmmError> {
        for f in &info.files {
            if !snapshot.join(f).is_file() {
                return Err(VmmError::Snapshot {
                    path: snapshot.to_path_buf(),
                    detail: format!("{f} missing"),
                });
            }
        }
        self.restores.fetch_add(1, Ordering::SeqCst);
        self.start(spec).await
    }
}

impl Fixture {
    /// A second service on the same data directory and VMM, as after a daemon restart.
    pub fn restart(&self) -> Arc<Sandboxes> {
        let old = self.svc.settings().clone();
        let db = Db::open(&old.paths.db()).expect("db");
        Sandboxes::new(
            db,
            self.vmm.clone(),
            VmmInfo {
                reason: "test".into(),
                checks: vec![],
            },
            old,
        )
    }
}

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub vmm: Arc<FakeVmm>,
    pub svc: Arc<Sandboxes>,
}

pub fn fixture(connects: usize) -> Fixture {
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = Paths::new(dir.path().join("data"), Some(dir.path().join("images")));
    std::fs::create_dir_all(paths.images_dir.join("rootfs")).expect("images");
    std::fs::write(paths.template_image("minimal"), b"").expect("template");
    std::fs::create_dir_all(paths.sandboxes_dir()).expect("sandboxes");
    let db = Db::open(&paths.db()).expect("db");
    let vmm = Arc::new(FakeVmm {
        connects_left: AtomicUsize::new(connects),
        agents: Mutex::default(),
        children: Mutex::default(),
        fail_snapshot: AtomicBool::new(false),
        restores: AtomicUsize::new(0),
        mute_pings: Arc::default(),
    });
    let settings = Settings {
        paths,
        default_template: "minimal".into(),
        ready_timeout: Duration::from_secs(5),
        agent_unresponsive: Duration::from_secs(3),
        max_snapshots_per_sandbox: 64,
        warm_creates: false,
        boot_snapshots_max: 8,
        credit_prices: Default::default(),
    };
    let svc = Sandboxes::new(
        db,
        vmm.clone(),
        VmmInfo {
            reason: "test".into(),
            checks: vec![],
        },
        settings,
    );
    Fixture { dir, vmm, svc }
}

pub fn create_req(timeout_s: u64) -> CreateSandboxRequest {
    CreateSandboxRequest {
        timeout_s: Some(timeout_s),
        env: [("FOO".to_string(), "bar".to_string())].into(),
        ..Default::default()
    }
}

pub async fn wait_for(mut f: impl FnMut() -> bool, secs: u64) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}
