//! The guest's NIC under QEMU (TCG), end to end: a network namespace made by the test holds `tap0` (the
//! gateway side, as hearth-net lays out every sandbox namespace) and an HTTP test host on the gateway
//! address; the VM gets the tap (`VmSpec::net`), its agent configures eth0 from `hearth.net=`, and a program
//! in the guest fetches a page from the test host. Then the VM is paused (QEMU exits) and resumed in a fresh
//! QEMU on the same tap: the guest reaches the test host again, and a TCP connection from the test host to
//! the guest, opened before the pause, carries on. A checkpoint forked into a second
//! namespace reaches that namespace's test host while the original goes on in its own. A Debian guest's
//! Python reaches the test host too.
//!
//! Needs root (namespaces, taps) and the images from `images/build.sh` (whose initramfs carries the agent
//! of this checkout: rebuild them after changing the agent). Traffic stays inside the test's namespace.

use std::net::{SocketAddr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hearth_proto::ExecRequest;
use hearth_proto::client::{AgentClient, ExecEvent};
use hearth_vmm::qemu::QemuVmm;
use hearth_vmm::{Accel, BootImages, NetAttach, SnapshotMode, VmHandle, VmSpec, Vmm};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

mod netns_common;
use netns_common::{TestNetns, ip_out};

const READY_TIMEOUT: Duration = Duration::from_secs(120);
const HTTP_PORT: u16 = 8080;

fn images_dir() -> PathBuf {
    std::env::var_os("HEARTH_IMAGES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/lib/hearth/images"))
}

fn require(path: PathBuf) -> PathBuf {
    assert!(
        path.exists(),
        "{} is missing: build the guest images with `images/build.sh`",
        path.display()
    );
    path
}

/// Requests the test host answered: (peer, request line).
type Served = Arc<Mutex<Vec<(SocketAddr, String)>>>;

/// An HTTP/1.0 test host on the gateway address inside `ns`: answers every request with `<tag> <path>`.
fn serve_http(ns: &Path, tag: &'static str) -> Served {
    let addr = SocketAddr::V4(SocketAddrV4::new(hearth_net::GATEWAY, HTTP_PORT));
    let std_listener = hearth_net::netns::tcp_listener(ns, addr).expect("listener in the test namespace");
    let listener = tokio::net::TcpListener::from_std(std_listener).expect("tokio listener");
    let served: Served = Arc::default();
    let log = served.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, peer)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 1024];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") && req.len() < 16 * 1024 {
                    match conn.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let text = String::from_utf8_lossy(&req);
                let line = text.lines().next().unwrap_or_default().to_string();
                let path = line.split(' ').nth(1).unwrap_or("?").to_string();
                log.lock().expect("log").push((peer, line));
                let body = format!("{tag} {path}\n");
                let resp = format!(
                    "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = conn.write_all(resp.as_bytes()).await;
                let _ = conn.shutdown().await;
            });
        }
    });
    served
}

/// Kills the VM even when an assertion fails half-way.
struct Guard<'a> {
    vmm: &'a QemuVmm,
    vm: Option<VmHandle>,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if let Some(vm) = self.vm.take()
            && self.vmm.is_alive(&vm)
            && let Ok(pid) = i32::try_from(vm.pid)
        {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
        }
    }
}

fn console(vm: &VmHandle) -> String {
    std::fs::read_to_string(vm.run_dir.join("console.log")).unwrap_or_default()
}

async fn wait_agent(vmm: &QemuVmm, vm: &VmHandle) -> AgentClient {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        let attempt = async {
            let stream = vmm.connect_agent(vm).await.map_err(|e| e.to_string())?;
            AgentClient::connect(stream, Duration::from_secs(10))
                .await
                .map_err(|e| e.to_string())
        };
        match attempt.await {
            Ok(c) => return c,
            Err(e) => {
                assert!(Instant::now() < deadline, "agent not ready: {e}\n{}", console(vm));
                assert!(vmm.is_alive(vm), "qemu died\n{}", console(vm));
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// Runs a shell line in the guest: (exit code, stdout + stderr).
async fn sh(c: &AgentClient, line: &str) -> (Option<i32>, String) {
    let req = ExecRequest::shell(line).timeout(Duration::from_secs(60));
    let mut h = c.exec(req).await.expect("exec");
    let mut out = Vec::new();
    loop {
        match h.next_event().await.expect("event") {
            ExecEvent::Stdout(d) | ExecEvent::Stderr(d) => out.extend_from_slice(&d),
            ExecEvent::Exited { code, .. } => return (code, String::from_utf8_lossy(&out).into_owned()),
            ExecEvent::Error(e) => panic!("{line}: {e}"),
        }
    }
}

async fn out(c: &AgentClient, line: &str) -> String {
    let (code, text) = sh(c, line).await;
    assert_eq!(code, Some(0), "{line}: {text}");
    text.trim().to_owned()
}

/// Fetches `http://<gateway>:8080/<path>` from inside the guest with busybox wget (the minimal image has no
/// `wget` link, and its `-T` crashes busybox 1.35; the exec's timeout bounds it instead).
async fn fetch(c: &AgentClient, path: &str) -> String {
    out(
        c,
        &format!(
            "busybox wget -q -O - http://{}:{HTTP_PORT}/{path}",
            hearth_net::GATEWAY
        ),
    )
    .await
}

fn assert_served_from_guest(served: &Served, path: &str) {
    let log = served.lock().expect("log").clone();
    let hit = log
        .iter()
        .find(|(_, line)| line.starts_with(&format!("GET /{path} ")))
        .unwrap_or_else(|| panic!("the test host never saw /{path}: {log:?}"));
    assert_eq!(
        hit.0.ip(),
        std::net::IpAddr::V4(hearth_net::GUEST_ADDR),
        "{log:?}"
    );
}

/// A VM of 256 MiB on the minimal image with its NIC on `ns`'s tap.
fn spec_in(run: &Path, disk: PathBuf, id: &str, ns: &TestNetns) -> VmSpec {
    let images = images_dir();
    VmSpec {
        id: id.into(),
        vcpus: 1,
        memory_mib: 256,
        images: BootImages {
            vmlinuz: require(images.join("vmlinuz")),
            vmlinux: images.join("vmlinux"),
            initramfs: require(images.join("initramfs.cpio.gz")),
        },
        disk,
        run_dir: run.to_path_buf(),
        hostname: id.replace('_', "-"),
        net: Some(NetAttach {
            netns: ns.path.clone(),
            tap: hearth_net::TAP_NAME.into(),
            guest_mac: hearth_net::GUEST_MAC.into(),
            ipv6: false,
        }),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn guest_reaches_a_test_host_through_its_tap_and_again_after_resume() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let ns = TestNetns::new();
    let served = serve_http(&ns.path, "hello");

    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("disk");
    let spec = spec_in(run.path(), disk.clone(), "sbx_00000000000000ee", &ns);
    let vm = vmm.start(&spec).await.expect("start");
    let mut guard = Guard {
        vmm: &vmm,
        vm: Some(vm.clone()),
    };
    let c = wait_agent(&vmm, &vm).await;

    // The guest's own view, without `ip`: its MAC, address, default route and resolver.
    assert_eq!(
        out(&c, "cat /sys/class/net/eth0/address").await,
        hearth_net::GUEST_MAC
    );
    let route = out(&c, "cat /proc/net/route").await;
    // Destination 0.0.0.0, gateway 172.16.0.1 (little-endian hex), flags UP|GATEWAY.
    assert!(
        route
            .lines()
            .any(|l| l.split_whitespace().take(4).collect::<Vec<_>>()
                == ["eth0", "00000000", "010010AC", "0003"]),
        "no default route via the gateway:\n{route}"
    );
    let addr = out(&c, "cat /proc/net/fib_trie").await;
    assert!(addr.contains("172.16.0.2"), "{addr}");
    let resolv = out(&c, "cat /etc/resolv.conf").await;
    assert!(resolv.lines().any(|l| l == "nameserver 172.16.0.1"), "{resolv}");
    // The agent logs to the kernel log (`quiet` keeps it off the console).
    let dmesg = out(&c, "dmesg").await;
    assert!(
        dmesg.contains("hearth-agent: network: eth0 172.16.0.2/30 via 172.16.0.1, resolver 172.16.0.1"),
        "{dmesg}"
    );

    // A program in the guest reaches the test host; the test host sees the guest's address.
    assert_eq!(fetch(&c, "first").await, "hello /first");
    assert_served_from_guest(&served, "first");
    // The host side learnt the guest's MAC on the tap.
    let neigh = ip_out(&["-n", &ns.name, "neigh", "show", "dev", hearth_net::TAP_NAME]);
    assert!(neigh.contains(hearth_net::GUEST_MAC), "{neigh}");

    // A connection from the test host to a listener in the guest, open across the pause.
    c.spawn_background(ExecRequest::shell("busybox nc -l -p 9000 > /tmp/got"))
        .await
        .expect("listener in the guest");
    let guest_port = SocketAddr::V4(SocketAddrV4::new(hearth_net::GUEST_ADDR, 9000));
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut held = loop {
        match hearth_net::netns::connect_tcp(&ns.path, guest_port).await {
            Ok(conn) => break conn,
            Err(e) => {
                assert!(Instant::now() < deadline, "guest listener: {e}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    held.write_all(b"before\n").await.expect("write before the pause");

    // Pause: QEMU saves the state and exits, letting go of the tap (which stays, with its address).
    let snap = tempfile::tempdir().expect("tempdir");
    let info = vmm
        .snapshot(&vm, &disk, snap.path(), SnapshotMode::Pause)
        .await
        .expect("pause");
    drop(c);
    assert!(!vmm.is_alive(&vm));
    assert!(!ns.tap_attached(), "the tap is still attached: {}", ns.tap_link());

    // Resume in a fresh QEMU on the same tap: the guest's network goes on working, unconfigured again.
    let t = Instant::now();
    let resumed = vmm.restore(&spec, snap.path(), &info).await.expect("resume");
    guard.vm = Some(resumed.clone());
    let c = wait_agent(&vmm, &resumed).await;
    eprintln!("resumed with the NIC in {:?}", t.elapsed());
    assert_eq!(fetch(&c, "second").await, "hello /second");
    assert_served_from_guest(&served, "second");
    // The connection made before the pause carries on (both ends kept their TCP state).
    held.write_all(b"after\n").await.expect("write after the resume");
    held.shutdown().await.expect("close");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let got = out(&c, "cat /tmp/got").await;
        if got == "before\nafter" {
            break;
        }
        assert!(Instant::now() < deadline, "the guest got {got:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ns.tap_attached(), "the tap is not attached: {}", ns.tap_link());

    vmm.stop(&resumed).await.expect("stop");
    // Nothing holds the tap any more: QEMU's descriptor was its only attachment.
    assert!(!ns.tap_attached(), "{}", ns.tap_link());
}

/// Forks (issue 4, item 8): a checkpoint of a VM in one namespace restored into another namespace laid out
/// the same way reaches that namespace's test host, unconfigured, while the original goes on in its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_in_another_namespace_reaches_that_namespace_while_the_original_runs_on() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let ns_a = TestNetns::new();
    let served_a = serve_http(&ns_a.path, "origin");
    let ns_b = TestNetns::new();
    let served_b = serve_http(&ns_b.path, "fork");

    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("disk");
    let vm = vmm
        .start(&spec_in(run.path(), disk.clone(), "sbx_00000000000000f0", &ns_a))
        .await
        .expect("start");
    let _guard = Guard {
        vmm: &vmm,
        vm: Some(vm.clone()),
    };
    let c = wait_agent(&vmm, &vm).await;
    assert_eq!(fetch(&c, "a1").await, "origin /a1");

    c.sync().await.expect("sync");
    let snap = tempfile::tempdir().expect("tempdir");
    let info = vmm
        .snapshot(&vm, &disk, snap.path(), SnapshotMode::Checkpoint)
        .await
        .expect("checkpoint");
    let ck_disk = snap.path().join(info.disk.as_deref().expect("checkpoint disk"));

    let frun = tempfile::tempdir().expect("tempdir");
    let fdisk = vmm
        .prepare_disk(&ck_disk, hearth_vmm::DiskFormat::Qcow2, frun.path())
        .await
        .expect("fork disk");
    let fork = vmm
        .restore(
            &spec_in(frun.path(), fdisk, "sbx_00000000000000f1", &ns_b),
            snap.path(),
            &info,
        )
        .await
        .expect("fork");
    let _fguard = Guard {
        vmm: &vmm,
        vm: Some(fork.clone()),
    };
    let fc = wait_agent(&vmm, &fork).await;
    assert_eq!(fetch(&fc, "b1").await, "fork /b1");
    assert_served_from_guest(&served_b, "b1");
    assert_eq!(fetch(&c, "a2").await, "origin /a2");
    assert_served_from_guest(&served_a, "a2");
    // Neither reached the other's namespace.
    let a: Vec<String> = served_a
        .lock()
        .expect("log")
        .iter()
        .map(|(_, l)| l.clone())
        .collect();
    let b: Vec<String> = served_b
        .lock()
        .expect("log")
        .iter()
        .map(|(_, l)| l.clone())
        .collect();
    assert!(a.iter().all(|l| !l.contains("/b")), "{a:?}");
    assert!(b.iter().all(|l| !l.contains("/a")), "{b:?}");
    assert!(ns_a.tap_attached() && ns_b.tap_attached());

    drop((c, fc));
    vmm.stop(&fork).await.expect("stop fork");
    vmm.stop(&vm).await.expect("stop original");
}

/// A Debian guest: a program of the distribution (Python's urllib) reaches the test host, and the image's own
/// resolver configuration was replaced by a plain file naming the gateway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debian_guest_uses_the_network_from_python() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let ns = TestNetns::new();
    let served = serve_http(&ns.path, "debian");
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/debian.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("disk");
    let vm = vmm
        .start(&spec_in(run.path(), disk, "sbx_00000000000000d3", &ns))
        .await
        .expect("start");
    let _guard = Guard {
        vmm: &vmm,
        vm: Some(vm.clone()),
    };
    let c = wait_agent(&vmm, &vm).await;
    let body = out(
        &c,
        &format!(
            "python3 -c 'import urllib.request; print(urllib.request.urlopen(\"http://{}:{HTTP_PORT}/py\", timeout=30).read().decode(), end=\"\")'",
            hearth_net::GATEWAY
        ),
    )
    .await;
    assert_eq!(body, "debian /py");
    assert_served_from_guest(&served, "py");
    assert_eq!(out(&c, "stat -c %F /etc/resolv.conf").await, "regular file");
    assert_eq!(
        out(&c, "grep nameserver /etc/resolv.conf").await,
        "nameserver 172.16.0.1"
    );
    drop(c);
    vmm.stop(&vm).await.expect("stop");
}

/// A NIC whose tap is missing fails the start cleanly (no QEMU left, no tap created in the namespace).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_tap_fails_the_start() {
    let vmm = QemuVmm::locate(Accel::Tcg).expect("qemu installed");
    let ns = TestNetns::new();
    let run = tempfile::tempdir().expect("tempdir");
    let base = require(images_dir().join("rootfs/minimal.ext4"));
    let disk = vmm
        .prepare_disk(&base, hearth_vmm::DiskFormat::Raw, run.path())
        .await
        .expect("disk");
    let mut spec = spec_in(run.path(), disk, "sbx_00000000000000ef", &ns);
    if let Some(net) = spec.net.as_mut() {
        net.tap = "tap9".into();
    }
    let err = vmm.start(&spec).await.expect_err("no tap9");
    assert!(err.to_string().contains("tap9"), "{err}");
    assert!(!ip_out(&["-n", &ns.name, "link", "show"]).contains("tap9"));
    assert!(!run.path().join("qemu.pid").exists());
}
