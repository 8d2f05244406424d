//! The guest's NIC under Firecracker, against the real binary and jailer up to the API (the guest kernel
//! cannot run on this host, see ENVIRONMENT.md): the process runs in the sandbox's network namespace (its
//! `/proc/<pid>/ns/net` is the namespace file's inode), Firecracker accepted the interface and attached to
//! the tap, the kernel command line carries `hearth.net=`, and a paused VM's snapshot restores in a fresh
//! process in the same namespace on the same tap. Namespaces are made by the test (`netns_common`).

mod firecracker_common;
mod netns_common;

use firecracker_common::{KillOnDrop, Sandbox, images, running, vmm};
use hearth_vmm::firecracker::{CgroupVersion, FirecrackerVmm, JailerConfig};
use hearth_vmm::{NetAttach, SnapshotMode, VmHandle, VmSpec, Vmm, VmmError};
use netns_common::{TestNetns, netns_inode_of};

/// An unprivileged uid/gid no account on the machine uses (not the jailer test's, so both can run at once).
const JAIL_ID: u32 = 47_312;

fn net_of(ns: &TestNetns) -> NetAttach {
    NetAttach {
        netns: ns.path.clone(),
        tap: hearth_net::TAP_NAME.into(),
        guest_mac: hearth_net::GUEST_MAC.into(),
        ipv6: false,
    }
}

fn spec_with_net(sbx: &Sandbox, disk: std::path::PathBuf, ns: &TestNetns) -> VmSpec {
    let mut spec = sbx.spec(&images(), disk);
    spec.net = Some(net_of(ns));
    spec
}

/// What Firecracker reports about the VM's NIC and kernel command line.
async fn assert_configured_with_nic(vmm: &FirecrackerVmm, vm: &VmHandle) {
    let cfg = vmm.api(&vm.run_dir).vm_config().await.expect("GET /vm/config");
    let nics = cfg["network-interfaces"].as_array().expect("network-interfaces");
    assert_eq!(nics.len(), 1, "{cfg}");
    assert_eq!(nics[0]["iface_id"], "eth0");
    assert_eq!(nics[0]["host_dev_name"], hearth_net::TAP_NAME);
    assert_eq!(nics[0]["guest_mac"], hearth_net::GUEST_MAC);
    let boot_args = cfg["boot-source"]["boot_args"].as_str().unwrap_or_default();
    assert!(
        boot_args.contains(" hearth.net=172.16.0.2/30,172.16.0.1,172.16.0.1"),
        "{boot_args}"
    );
}

async fn start_pause_restore(vmm: &FirecrackerVmm, jailed: bool) {
    let ns = TestNetns::new();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images().rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let spec = spec_with_net(&sbx, disk.clone(), &ns);
    assert!(!ns.tap_attached());

    let vm = vmm.start(&spec).await.expect("start with a NIC");
    let _guard = KillOnDrop(vm.clone());
    assert_eq!(
        netns_inode_of(vm.pid),
        ns.inode(),
        "firecracker (jailed: {jailed}) is not in the sandbox's network namespace"
    );
    assert_ne!(ns.inode(), netns_inode_of(std::process::id()));
    assert_configured_with_nic(vmm, &vm).await;
    assert!(
        ns.tap_attached(),
        "firecracker did not attach the tap: {}",
        ns.tap_link()
    );

    // Pause to files: the process exits and lets go of the tap, which stays.
    let snap = sbx.tmp.path().join("snap");
    std::fs::create_dir(&snap).expect("snapshot dir");
    let info = vmm
        .snapshot(&vm, &disk, &snap, SnapshotMode::Pause)
        .await
        .expect("pause");
    assert!(!running(vm.pid, vm.start_ticks));
    for f in &info.files {
        assert!(
            std::fs::metadata(snap.join(f)).expect("snapshot file").len() > 0,
            "{f}"
        );
    }
    assert!(!ns.tap_attached(), "{}", ns.tap_link());

    // Resume: a fresh process in the same namespace reopens the tap by the name the snapshot recorded.
    let resumed = vmm.restore(&spec, &snap, &info).await.expect("resume");
    let _guard2 = KillOnDrop(resumed.clone());
    assert_ne!(resumed.pid, vm.pid);
    assert_eq!(netns_inode_of(resumed.pid), ns.inode());
    assert_eq!(
        vmm.api(&resumed.run_dir)
            .describe()
            .await
            .expect("describe")
            .state,
        "Running"
    );
    assert!(
        ns.tap_attached(),
        "the restored VM did not attach the tap: {}",
        ns.tap_link()
    );
    vmm.stop(&resumed).await.expect("stop");
    assert!(!ns.tap_attached());
}

#[tokio::test]
async fn nic_in_the_sandbox_namespace_survives_pause_and_resume() {
    start_pause_restore(&vmm(), false).await;
}

#[tokio::test]
async fn jailed_nic_in_the_sandbox_namespace_survives_pause_and_resume() {
    let mut cfg = JailerConfig::new(JAIL_ID, JAIL_ID);
    if !std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        cfg.cgroup_version = CgroupVersion::V1;
    }
    start_pause_restore(&vmm().with_jailer(cfg), true).await;
}

/// A VM without a NIC stays in the daemon's namespace and has no interface; a missing tap fails the start
/// without creating one (Firecracker, run as root, would otherwise make a fresh, unconfigured tap).
#[tokio::test]
async fn no_nic_without_net_and_no_tap_made_when_missing() {
    let vmm = vmm();
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images().rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let plain = sbx.spec(&images(), disk.clone());
    let vm = vmm.start(&plain).await.expect("start without a NIC");
    let guard = KillOnDrop(vm.clone());
    assert_eq!(netns_inode_of(vm.pid), netns_inode_of(std::process::id()));
    let cfg = vmm.api(&vm.run_dir).vm_config().await.expect("config");
    assert!(
        cfg["network-interfaces"].as_array().is_none_or(|a| a.is_empty()),
        "{cfg}"
    );
    assert!(
        !cfg["boot-source"]["boot_args"]
            .as_str()
            .unwrap_or_default()
            .contains("hearth.net=")
    );
    vmm.stop(&vm).await.expect("stop");
    drop(guard);

    let ns = TestNetns::new();
    netns_common::ip(&["-n", &ns.name, "link", "del", hearth_net::TAP_NAME]);
    let sbx = Sandbox::new();
    let disk = vmm
        .prepare_disk(&images().rootfs, hearth_vmm::DiskFormat::Raw, &sbx.dir)
        .await
        .expect("disk");
    let err = vmm
        .start(&spec_with_net(&sbx, disk, &ns))
        .await
        .expect_err("no tap");
    assert!(matches!(err, VmmError::StartFailed { .. }), "{err}");
    assert!(err.to_string().contains("no tap tap0"), "{err}");
    assert!(ns.tap_link().is_empty(), "a tap was created");
    assert!(firecracker_common::processes_mentioning(&sbx.dir).is_empty());
}
