//! Start-up and shutdown of the daemon: directories, database, API key, VMM choice, recovery, background tasks,
//! listener.

use std::os::unix::fs::DirBuilderExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use hearth_vmm::detect::{self, VmmPreference};
use hearth_vmm::{Vmm, VmmKind};
use tokio::net::TcpListener;

use crate::config::{self, Args, JailerChoice, Paths, VmmChoice};
use crate::db::Db;
use crate::http::{self, AppState};
use crate::service::{Sandboxes, Settings, VmmInfo, now_ms};
use crate::{adopt, auth, metrics, reaper};

/// How long in-flight requests (e.g. a streamed command) may delay exit after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Picks and builds the VMM driver, logging the choice and its reason.
pub fn build_vmm(
    choice: VmmChoice,
    jailer: JailerChoice,
    paths: &Paths,
) -> anyhow::Result<(Arc<dyn Vmm>, VmmInfo)> {
    let probe = detect::probe();
    let pref = match choice {
        VmmChoice::Auto => VmmPreference::Auto,
        VmmChoice::Qemu => VmmPreference::Qemu,
        VmmChoice::Firecracker => VmmPreference::Firecracker,
    };
    let mut checks: Vec<hearth_api::Check> = detect::checks(&probe, &paths.images_dir)
        .into_iter()
        .map(|c| hearth_api::Check {
            name: c.name,
            status: c.status.as_str().to_string(),
            detail: c.detail,
        })
        .collect();
    let chosen = detect::choose(pref, &probe).context("choosing a VMM")?;
    let vmm: Arc<dyn Vmm> = match chosen.kind {
        VmmKind::Qemu => {
            let bin = probe.qemu.as_ref().map_err(|e| anyhow::anyhow!("qemu: {e}"))?;
            Arc::new(
                hearth_vmm::qemu::QemuVmm::new(chosen.accel, bin.path.clone(), bin.version.clone())
                    .with_cgroups(&vm_cgroup_parent(paths)),
            )
        }
        VmmKind::Firecracker => {
            let bin = probe
                .firecracker
                .as_ref()
                .map_err(|e| anyhow::anyhow!("firecracker: {e}"))?;
            let fc = hearth_vmm::firecracker::FirecrackerVmm::new(bin.path.clone())?;
            match jail_config(jailer, &probe, paths)? {
                Some(cfg) => {
                    tracing::info!(jailer = %cfg.jailer.display(), parent_cgroup = ?cfg.parent_cgroup,
                        cgroup_version = ?cfg.cgroup_version, "Firecracker runs jailed");
                    Arc::new(fc.with_jailer(cfg))
                }
                None => {
                    checks.push(hearth_api::Check {
                        name: "jailer".into(),
                        status: "warn".into(),
                        detail: "Firecracker runs without its jailer (--jailer off or not available)".into(),
                    });
                    Arc::new(fc)
                }
            }
        }
    };
    tracing::info!(vmm = chosen.kind.as_str(), accel = chosen.accel.as_str(), version = %vmm.version(),
        reason = %chosen.reason, "VMM chosen");
    Ok((
        vmm,
        VmmInfo {
            reason: chosen.reason,
            checks,
        },
    ))
}

/// The jailer configuration `--jailer` asks for, or `None` to run Firecracker unjailed. VMs' cgroups live below
/// [`vm_cgroup_parent`].
fn jail_config(
    choice: JailerChoice,
    probe: &detect::HostProbe,
    paths: &Paths,
) -> anyhow::Result<Option<hearth_vmm::firecracker::JailerConfig>> {
    let why_not = match (&probe.jailer, probe.root) {
        (Ok(_), true) => None,
        (Ok(_), false) => Some("the jailer needs the daemon to run as root".to_owned()),
        (Err(e), _) => Some(e.clone()),
    };
    match (choice, why_not, &probe.jailer) {
        (JailerChoice::Off, _, _) => {
            tracing::warn!("Firecracker runs unjailed (--jailer off)");
            Ok(None)
        }
        (JailerChoice::On, Some(why), _) => anyhow::bail!("--jailer on, but {why}"),
        (JailerChoice::Auto, Some(why), _) => {
            tracing::warn!(reason = %why, "Firecracker runs unjailed");
            Ok(None)
        }
        (_, None, Ok(jailer)) => Ok(Some(hearth_vmm::firecracker::JailerConfig::for_daemon(
            jailer.clone(),
            vm_cgroup_parent(paths),
        ))),
        (_, None, Err(e)) => anyhow::bail!("jailer: {e}"),
    }
}

/// The parent cgroup of every VM's cgroup (both drivers): named after the data directory, so two daemons on one
/// host never sweep each other's.
fn vm_cgroup_parent(paths: &Paths) -> String {
    format!(
        "hearth-{:08x}",
        fnv32(paths.data_dir.as_os_str().as_encoded_bytes())
    )
}

/// 32-bit FNV-1a: a short, stable name from a path.
fn fnv32(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}

/// Why networking cannot be turned on here, if it cannot.
fn network_unavailable() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("hearthd does not run as root".into());
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("/dev/net/tun is missing".into());
    }
    let nft = ["/usr/sbin/nft", "/sbin/nft", "/usr/bin/nft"];
    if !nft.iter().any(|p| Path::new(p).is_file()) {
        return Some("the nft tool is not installed (apt-get install nftables)".into());
    }
    None
}

/// Sets up sandbox networking as `--network` asks, recording the outcome as a system check.
fn build_networking(
    args: &Args,
    checks: &mut Vec<hearth_api::Check>,
) -> anyhow::Result<Option<crate::service::network::Networking>> {
    let mut check = |status: &str, detail: String| {
        checks.push(hearth_api::Check {
            name: "network".into(),
            status: status.into(),
            detail,
        })
    };
    if args.network == config::NetworkChoice::Off {
        check("warn", "sandbox networking is off (--network off)".into());
        return Ok(None);
    }
    if let Some(why) = network_unavailable() {
        anyhow::ensure!(
            args.network != config::NetworkChoice::On,
            "--network on, but {why}"
        );
        tracing::warn!(reason = %why, "sandbox networking is off");
        check("warn", format!("sandbox networking is off: {why}"));
        return Ok(None);
    }
    let dns_upstream = match args.dns_upstream {
        Some(a) => a,
        None => std::fs::read_to_string("/etc/resolv.conf")
            .ok()
            .and_then(|t| config::resolv_conf_nameserver(&t))
            .context("no nameserver in /etc/resolv.conf: pass --dns-upstream")?,
    };
    let settings = crate::service::network::NetSettings {
        uplink_netns: args.uplink_netns.clone(),
        sandbox_net: args.sandbox_net,
        sandbox_net6: args.sandbox_net6,
        dns_upstream,
        port_key_file: args.data_dir.join("port-token.key"),
    };
    let net = crate::service::network::Networking::new(settings)
        .map_err(|e| anyhow::anyhow!("sandbox networking: {e}"))?;
    tracing::info!(range = %args.sandbox_net, uplink = %args.uplink_netns.display(), %dns_upstream,
        "sandbox networking on");
    check(
        "ok",
        format!(
            "sandboxes get addresses in {}, egress via {}, DNS upstream {dns_upstream}",
            args.sandbox_net,
            args.uplink_netns.display()
        ),
    );
    Ok(Some(net))
}

fn private_dir(path: &Path) -> anyhow::Result<()> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(path)
        .with_context(|| format!("creating {}", path.display()))
}

/// Raises the soft limit on open descriptors to the hard limit: every sandbox holds a few (agent channel,
/// sockets of its network services), and the default soft limit of 1024 would cap the host at a few hundred
/// sandboxes or let one busy guest run the daemon out. Returns the limit in force.
pub fn raise_fd_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed in.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return 1024;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim = raised;
            }
        }
    }
    lim.rlim_cur
}

/// Runs the daemon until SIGTERM or SIGINT. VMs are left running for the next start to adopt.
pub async fn serve(args: Args) -> anyhow::Result<()> {
    let fd_limit = raise_fd_limit();
    tracing::info!(limit = fd_limit, "open file limit");
    // Absolute paths: the VMMs run in other working directories (QEMU chroots), and the paths are stored.
    let mut args = args;
    args.data_dir = std::path::absolute(&args.data_dir).context("resolving --data-dir")?;
    if let Some(p) = &args.images_dir {
        args.images_dir = Some(std::path::absolute(p).context("resolving --images-dir")?);
    }
    let paths = Paths::new(args.data_dir.clone(), args.images_dir.clone());
    private_dir(&paths.data_dir)?;
    private_dir(&paths.sandboxes_dir())?;
    // A stale address would send clients of this start to a dead port.
    let _ = std::fs::remove_file(paths.listen_addr());
    let db = Db::open(&paths.db())?;
    let keys = auth::ensure_key(&db, &paths.api_key(), now_ms())?;
    let (vmm, info) = build_vmm(args.vmm, args.jailer, &paths)?;
    let ready_timeout = config::ready_timeout(args.ready_timeout_s, vmm.accel());
    tracing::info!(secs = ready_timeout.as_secs(), "agent readiness deadline");
    if !paths.template_image(&args.default_template).is_file() {
        tracing::warn!(template = %args.default_template, images = %paths.images_dir.display(),
            "default template image not found");
    }
    anyhow::ensure!(
        hearth_api::is_valid_template_name(&args.default_template),
        "invalid --default-template {:?}",
        args.default_template
    );
    let settings = Settings {
        paths: paths.clone(),
        default_template: args.default_template.clone(),
        ready_timeout,
        agent_unresponsive: config::agent_unresponsive(args.agent_unresponsive_s, vmm.accel()),
        max_snapshots_per_sandbox: args.max_snapshots_per_sandbox.max(1),
        warm_creates: match args.warm_creates {
            config::WarmChoice::On | config::WarmChoice::Auto => true,
            config::WarmChoice::Off => false,
        },
        boot_snapshots_max: args.boot_snapshots_max.max(1),
        credit_prices: crate::service::quota::CreditPrices {
            per_vcpu_second: args.credits_per_vcpu_second,
            per_gib_second: args.credits_per_gib_second,
        },
    };
    anyhow::ensure!(
        [args.credits_per_vcpu_second, args.credits_per_gib_second]
            .iter()
            .all(|p| p.is_finite() && *p >= 0.0),
        "credit prices must be finite and not negative"
    );
    let mut info = info;
    let networking = build_networking(&args, &mut info.checks)?;
    let svc = Sandboxes::new(db, vmm, info, settings);
    if let Some(net) = networking {
        svc.enable_networking(net);
    }
    svc.enable_buckets(crate::service::buckets::BucketSettings {
        allow_private_endpoints: args.allow_private_bucket_endpoints,
    })
    .context("bucket secret key")?;
    // The storage bucket: probed before anything else runs, and a bad one stops the start with the reason.
    if let Some(url) = &args.storage {
        let storage = crate::service::remote::open(crate::service::remote::StorageSettings {
            url: url.clone(),
            key_file: args.storage_key.clone(),
            gc_interval: Duration::from_secs(args.storage_gc_interval_s),
            gc_grace: Duration::from_secs(args.storage_gc_grace_s),
            cache_size: args.cache_size,
        })
        .await?;
        svc.enable_storage(storage);
    }
    // Installed before recovery so that what recovery does is counted.
    let metrics = metrics::install();
    adopt::recover(&svc).await.context("recovering sandboxes")?;
    adopt::sweep_vmm(&svc).await;
    svc.restore_networking().await;
    svc.sweep_boot_snapshots().await;
    tokio::spawn(reaper::reaper(svc.clone()));
    tokio::spawn(reaper::watcher(svc.clone()));
    tokio::spawn(reaper::quotas(svc.clone()));
    tokio::spawn(crate::service::remote::worker(svc.clone()));
    tokio::spawn(crate::service::remote::gc_loop(svc.clone()));
    tokio::spawn(crate::service::sync::sync_loop(svc.clone()));

    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding {}", args.listen))?;
    let addr = listener.local_addr()?;
    write_atomic(&paths.listen_addr(), format!("{addr}\n").as_bytes())?;
    tracing::info!(%addr, "listening");

    let tenancy = crate::tenancy::Tenancy::new(svc.clone(), keys.clone(), args.tenancy_settings());
    let state = AppState {
        sandboxes: svc,
        keys,
        metrics,
        tenancy,
    };
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut stopped = stop_rx.clone();
    let server = http::run(listener, state, async move {
        shutdown_signal().await;
        tracing::info!("shutting down (VMs keep running for the next start to adopt)");
        let _ = stop_tx.send(true);
    });
    tokio::select! {
        r = server => r.context("http server")?,
        _ = async move {
            let _ = stopped.wait_for(|s| *s).await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => tracing::warn!("requests still in flight after the grace period; exiting anyway"),
    }
    drop(stop_rx);
    Ok(())
}

fn write_atomic(path: &Path, data: &[u8]) -> anyhow::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
