//! In-process lifecycle tests with a fake VMM whose "VM" is a real child process (`sleep`) and whose agent is a
//! small in-test implementation of the protocol. They check create → running → command, the health watcher
//! (dead VM process, agent channel gone for good), the TTL reaper, and that teardown kills the VM process.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use hearth_api::{CreateSandboxRequest, RunCommandRequest, SandboxState};
use hearth_proto::frame::{FrameDecoder, encode};
use hearth_proto::msg::{ExitStatus, GuestMsg, HostMsg};
use hearth_vmm::{Accel, VmHandle, VmSpec, Vmm, VmmError, VmmKind};
use hearthd::config::Paths;
use hearthd::db::Db;
use hearthd::service::{Sandboxes, Settings, VmmInfo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

/// A VMM whose machines are `sleep` processes and whose agents answer Hello, Ping and Exec.
struct FakeVmm {
    /// Agent connections still allowed (each connect uses one).
    connects_left: AtomicUsize,
    /// Host ends of the open agent connections' peers, so a test can cut them.
    agents: Mutex<Vec<tokio::task::AbortHandle>>,
    children: Mutex<Vec<std::process::Child>>,
}

impl FakeVmm {
    fn cut_agents(&self) {
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
async fn fake_agent(sock: UnixStream) {
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
                HostMsg::Hello { version, nonce } => {
                    let msg = GuestMsg::HelloOk {
                        version,
                        agent_version: "fake".into(),
                        nonce,
                    };
                    send(&mut w, h.stream, &msg, b"").await
                }
                HostMsg::Ping => send(&mut w, h.stream, &GuestMsg::Pong, b"").await,
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
                                code: Some(0),
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
    async fn prepare_disk(&self, _base: &Path, dest_dir: &Path) -> Result<PathBuf, VmmError> {
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
        let task = tokio::spawn(fake_agent(guest));
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
}

struct Fixture {
    _dir: tempfile::TempDir,
    vmm: Arc<FakeVmm>,
    svc: Arc<Sandboxes>,
}

fn fixture(connects: usize) -> Fixture {
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
    });
    let settings = Settings {
        paths,
        default_template: "minimal".into(),
        ready_timeout: Duration::from_secs(5),
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
    Fixture { _dir: dir, vmm, svc }
}

fn create_req(timeout_s: u64) -> CreateSandboxRequest {
    CreateSandboxRequest {
        timeout_s: Some(timeout_s),
        env: [("FOO".to_string(), "bar".to_string())].into(),
        ..Default::default()
    }
}

async fn wait_for(mut f: impl FnMut() -> bool, secs: u64) -> bool {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while tokio::time::Instant::now() < deadline {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test]
async fn create_run_and_destroy_kills_the_vm_process() {
    let f = fixture(10);
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    assert_eq!(sbx.state, SandboxState::Running);
    let row = f.svc.db().get(&sbx.id).expect("get").expect("row");
    let handle = row.handle.expect("handle recorded");
    assert!(f.vmm.is_alive(&handle));
    let req = RunCommandRequest {
        cmd: Some("echo".into()),
        ..Default::default()
    };
    let r = f.svc.run_command(&sbx.id, &req).await.expect("run");
    assert_eq!((r.exit_code, r.stdout.as_str()), (0, "ran echo with FOO=bar\n"));
    f.svc.destroy(&sbx.id, "test").await.expect("destroy");
    assert!(!f.vmm.is_alive(&handle));
    assert!(f.svc.db().get(&sbx.id).expect("get").is_none());
    assert!(!f.svc.settings().paths.sandbox_dir(&sbx.id).exists());
}

#[tokio::test]
async fn watcher_fails_a_sandbox_whose_vm_died() {
    let f = fixture(10);
    tokio::spawn(hearthd::reaper::watcher(f.svc.clone()));
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    let handle = f
        .svc
        .db()
        .get(&sbx.id)
        .expect("get")
        .and_then(|r| r.handle)
        .expect("handle");
    f.vmm
        .stop(&handle)
        .await
        .expect("kill the VM behind the daemon's back");
    let svc = f.svc.clone();
    let id = sbx.id.clone();
    assert!(
        wait_for(
            move || svc.get(&id).is_ok_and(|s| s.state == SandboxState::Failed),
            10
        )
        .await
    );
    let s = f.svc.get(&sbx.id).expect("get");
    assert!(
        s.error
            .as_deref()
            .is_some_and(|e| e.contains("VM process exited")),
        "{:?}",
        s.error
    );
    assert!(
        !f.svc.settings().paths.sandbox_dir(&sbx.id).exists(),
        "files of a failed sandbox are removed"
    );
}

#[tokio::test]
async fn watcher_fails_a_sandbox_whose_agent_channel_is_gone_for_good() {
    // One connection for create, none after: the channel cannot be re-established.
    let f = fixture(1);
    tokio::spawn(hearthd::reaper::watcher(f.svc.clone()));
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    let handle = f
        .svc
        .db()
        .get(&sbx.id)
        .expect("get")
        .and_then(|r| r.handle)
        .expect("handle");
    f.vmm.cut_agents();
    let svc = f.svc.clone();
    let id = sbx.id.clone();
    assert!(
        wait_for(
            move || svc.get(&id).is_ok_and(|s| s.state == SandboxState::Failed),
            15
        )
        .await
    );
    let s = f.svc.get(&sbx.id).expect("get");
    assert!(
        s.error.as_deref().is_some_and(|e| e.contains("agent channel")),
        "{:?}",
        s.error
    );
    assert!(!f.vmm.is_alive(&handle), "the VM of a failed sandbox is stopped");
}

#[tokio::test]
async fn a_dropped_channel_is_re_established_for_the_next_request() {
    let f = fixture(10);
    let sbx = f.svc.create(create_req(60)).await.expect("create");
    f.vmm.cut_agents();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let req = RunCommandRequest {
        argv: Some(vec!["true".into()]),
        ..Default::default()
    };
    let r = f
        .svc
        .run_command(&sbx.id, &req)
        .await
        .expect("run after reconnect");
    assert_eq!(r.stdout, "ran true with FOO=bar\n");
}

#[tokio::test]
async fn reaper_destroys_expired_sandboxes() {
    let f = fixture(10);
    tokio::spawn(hearthd::reaper::reaper(f.svc.clone()));
    let short = f.svc.create(create_req(1)).await.expect("create");
    let long = f.svc.create(create_req(600)).await.expect("create");
    let handle = f
        .svc
        .db()
        .get(&short.id)
        .expect("get")
        .and_then(|r| r.handle)
        .expect("handle");
    let svc = f.svc.clone();
    let id = short.id.clone();
    assert!(
        wait_for(move || svc.db().get(&id).is_ok_and(|r| r.is_none()), 10).await,
        "TTL did not fire"
    );
    assert!(!f.vmm.is_alive(&handle));
    assert_eq!(
        f.svc.get(&long.id).expect("long one stays").state,
        SandboxState::Running
    );
}

#[tokio::test]
async fn a_vm_that_never_answers_fails_the_create_within_the_deadline() {
    let f = fixture(0);
    let started = tokio::time::Instant::now();
    let err = f.svc.create(create_req(60)).await.expect_err("must fail");
    assert_eq!(err.code(), hearth_api::ErrorCode::VmmFailed);
    assert!(
        err.to_string().contains("guest agent not ready after 5 s"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(9));
    assert!(f.svc.db().list().expect("list").is_empty());
    let children_alive = f
        .vmm
        .children
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter_mut()
        .any(|c| matches!(c.try_wait(), Ok(None)));
    assert!(!children_alive, "the VM process of a failed create is stopped");
}
