//! The KVM test host itself: L1 boots, `/dev/kvm` works in it, commands run with their output and exit code,
//! hearthd starts there and the host reaches its API through the forward, and nothing is left on the host
//! after the drop.

use std::time::Instant;

use hearth_testkit::kvm_host::{KvmHost, KvmHostOptions, L1HearthdOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l1_has_kvm_runs_commands_and_serves_hearthd() {
    let t0 = Instant::now();
    let mut host = KvmHost::boot(KvmHostOptions::new()).await;
    eprintln!(
        "run disk: {:?}, L1 boot: {:?} (host clock)",
        host.disk_time, host.boot_time
    );
    let out = host.exec("echo out; echo err >&2; exit 3").await;
    assert_eq!(
        (out.code, out.stdout.as_str(), out.stderr.as_str()),
        (Some(3), "out\n", "err\n")
    );
    let kvm = host
        .sh("ls -l /dev/kvm; cat /sys/module/kvm_amd/parameters/npt; uname -r")
        .await;
    assert!(kvm.contains("/dev/kvm"), "{kvm}");
    assert!(
        kvm.lines().nth(1) == Some("Y") || kvm.lines().nth(1) == Some("1"),
        "{kvm}"
    );
    // The forward reaches hearthd in L1; auto picks Firecracker there.
    let d = host.start_hearthd(&L1HearthdOptions::new()).await;
    assert!(!d.key.is_empty());
    let log = host.hearthd_log();
    assert!(log.contains("VMM chosen"), "{log}");
    assert!(
        log.contains("vmm=\"firecracker\"") || log.contains("vmm=firecracker"),
        "{log}"
    );
    let dir = host.dir().to_path_buf();
    drop(host);
    assert!(!dir.exists(), "the boot's files are removed");
    eprintln!("whole test: {:?}", t0.elapsed());
}
