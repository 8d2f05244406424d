//! The KVM test host itself: L1 boots, `/dev/kvm` works in it, commands run with their output and exit code,
//! L1 reaches nothing on the host (QEMU's user network is restricted), hearthd starts there and the host
//! reaches its API through the forward, and nothing is left on the host after the drop.

use std::time::{Duration, Instant};

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
    let slow = host
        .exec_with("sleep 30", &[], Some(Duration::from_secs(1)), false)
        .await;
    assert!(slow.timed_out && !slow.success(), "{slow:?}");
    let kvm = host
        .sh("ls -l /dev/kvm; cat /sys/module/kvm_amd/parameters/npt")
        .await;
    assert!(kvm.starts_with("crw"), "{kvm}");
    assert!(
        matches!(kvm.lines().nth(1), Some("Y" | "1")),
        "nested paging: {kvm}"
    );

    // L1's network is restricted: a port listening on the host's loopback (10.0.2.2 from L1) is not reached.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let reach = host
        .exec(&format!("timeout 5 bash -c 'echo hi > /dev/tcp/10.0.2.2/{port}'"))
        .await;
    assert!(!reach.success(), "L1 reached the host: {reach:?}");
    assert!(listener.accept().is_err(), "a connection from L1 arrived");

    // The forward reaches hearthd in L1; auto picks Firecracker there.
    let d = host.start_hearthd(&L1HearthdOptions::new()).await;
    assert!(!d.key.is_empty() && d.url.starts_with("http://127.0.0.1:"));
    let log = host.hearthd_log();
    assert!(
        log.contains("VMM chosen vmm=\"firecracker\" accel=\"kvm\""),
        "{log}"
    );

    let (dir, qemu) = (host.dir().to_path_buf(), host.qemu_pid());
    drop(host);
    assert!(!dir.exists(), "the boot's files are removed");
    assert!(
        !std::path::Path::new(&format!("/proc/{qemu}")).exists(),
        "L1's QEMU is gone"
    );
    eprintln!("whole test: {:?}", t0.elapsed());
}
