//! Command-line flags (with environment fallbacks) and the resolved daemon configuration.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

/// Which VMM to drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VmmChoice {
    /// Firecracker on hardware KVM, else QEMU with KVM, else QEMU under TCG.
    Auto,
    Qemu,
    Firecracker,
}

/// Whether Firecracker runs under its jailer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum JailerChoice {
    /// Jailed when the daemon runs as root and the jailer is installed (next to Firecracker, or
    /// `HEARTH_JAILER_BIN`); otherwise unjailed, with a warning and a `hearth doctor` finding.
    Auto,
    /// Always jailed: the daemon refuses to start when it cannot.
    On,
    /// Never jailed (development only: one VMM's compromise is then the daemon's uid).
    Off,
}

/// Whether sandboxes get a network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum NetworkChoice {
    Auto,
    On,
    Off,
}

/// Whether creates from a template restore a snapshot of it booted at the same shape (service/warm.rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WarmChoice {
    /// On (both VMMs; the value is kept for configurations that name it).
    Auto,
    On,
    Off,
}

/// `hearthd`: the hearth daemon.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "hearthd",
    version,
    about = "hearth daemon: microVM sandboxes behind an HTTP API"
)]
pub struct Args {
    /// Address to listen on. Port 0 picks a free port; the real address is written to `<data-dir>/listen-addr`.
    #[arg(long, env = "HEARTH_LISTEN", default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// State directory: database, API key, per-sandbox files.
    #[arg(long, env = "HEARTH_DATA_DIR", default_value = "/var/lib/hearth")]
    pub data_dir: PathBuf,
    /// Guest images (kernel, initramfs, `rootfs/<template>.ext4`). Default `<data-dir>/images`.
    #[arg(long, env = "HEARTH_IMAGES")]
    pub images_dir: Option<PathBuf>,
    /// VMM backend.
    #[arg(long, env = "HEARTH_VMM", value_enum, default_value_t = VmmChoice::Auto)]
    pub vmm: VmmChoice,
    /// Firecracker under its jailer: a chroot, a uid/gid per sandbox, PID and mount namespaces of its own and
    /// cgroup limits from the sandbox's shape (vCPUs, memory, tasks).
    #[arg(long, env = "HEARTH_JAILER", value_enum, default_value_t = JailerChoice::Auto)]
    pub jailer: JailerChoice,
    /// Template used when a create request names none: `base` (Python, Node.js, Bun, Go, Rust, the Pi agent;
    /// built by images/build.sh). Tests that need a small, fast image name `minimal` or `debian` explicitly.
    #[arg(long, env = "HEARTH_DEFAULT_TEMPLATE", default_value = "base")]
    pub default_template: String,
    /// Seconds a new sandbox's guest agent has to answer. Default 120 under TCG, 20 under KVM.
    #[arg(long, env = "HEARTH_READY_TIMEOUT_S")]
    pub ready_timeout_s: Option<u64>,
    /// Seconds a running sandbox's guest agent may fail to answer the health watcher's pings before the
    /// sandbox is marked failed. Default 30 under TCG, 10 under KVM.
    #[arg(long, env = "HEARTH_AGENT_UNRESPONSIVE_S")]
    pub agent_unresponsive_s: Option<u64>,
    /// Snapshots (checkpoints and fork bases) one sandbox may have at once: each holds a copy of its memory and
    /// disk, so this bounds the host disk one sandbox's snapshots can take.
    #[arg(long, env = "HEARTH_MAX_SNAPSHOTS_PER_SANDBOX", default_value_t = 64)]
    pub max_snapshots_per_sandbox: usize,
    /// Warm creates: the first create of a template at a shape (vCPUs, memory) also saves the booted guest as a
    /// boot snapshot, and later creates of that template and shape restore it instead of booting a kernel (each
    /// gets its own hostname, machine-id and fresh entropy, as forks do). A create with bucket mounts never
    /// saves one and mounts after its restore. On by default with both VMMs (`auto` is the same as `on`).
    #[arg(long, env = "HEARTH_WARM_CREATES", value_enum, default_value_t = WarmChoice::On)]
    pub warm_creates: WarmChoice,
    /// Boot snapshots of warm creates kept at once (one per template and shape; each holds a booted guest's
    /// memory file and a disk copy): when a new one would make more, the least recently restored is retired,
    /// and deleted once no sandbox's disk builds on it.
    #[arg(long, env = "HEARTH_BOOT_SNAPSHOTS_MAX", default_value_t = 8)]
    pub boot_snapshots_max: usize,
    /// Credits one running vCPU-second costs against a project's `budget_credits`.
    #[arg(long, env = "HEARTH_CREDITS_PER_VCPU_SECOND", default_value_t = 1.0)]
    pub credits_per_vcpu_second: f64,
    /// Credits one running GiB-second of guest memory costs against a project's `budget_credits`.
    #[arg(long, env = "HEARTH_CREDITS_PER_GIB_SECOND", default_value_t = 1.0)]
    pub credits_per_gib_second: f64,
    /// Sandbox networking: `auto` turns it on when the daemon can (root, /dev/net/tun, the `nft` tool), `on`
    /// requires it, `off` gives sandboxes no network device.
    #[arg(long, env = "HEARTH_NETWORK", value_enum, default_value_t = NetworkChoice::Auto)]
    pub network: NetworkChoice,
    /// Network namespace sandbox egress leaves through (a path such as `/run/netns/uplink`). Default: the
    /// daemon's own.
    #[arg(long, env = "HEARTH_UPLINK_NETNS", default_value = "/proc/self/ns/net")]
    pub uplink_netns: PathBuf,
    /// Address range of sandboxes (their addresses as private-network peers see them). Two daemons on one host
    /// need distinct ranges.
    #[arg(long, env = "HEARTH_SANDBOX_NET", default_value = "10.213.0.0/16")]
    pub sandbox_net: ipnet::Ipv4Net,
    /// IPv6 range of sandboxes (a /64 or larger; each sandbox's IPv6 address embeds its IPv4 one). Without it
    /// sandboxes have no IPv6 path and IPv6 egress is always denied.
    #[arg(long, env = "HEARTH_SANDBOX_NET6")]
    pub sandbox_net6: Option<ipnet::Ipv6Net>,
    /// Resolver the platform DNS resolver and the egress proxy ask, reached from the uplink namespace.
    /// Default: the first nameserver of /etc/resolv.conf.
    #[arg(long, env = "HEARTH_DNS_UPSTREAM")]
    pub dns_upstream: Option<SocketAddr>,
    /// Allow bucket endpoints on loopback, private and link-local addresses (a MinIO on this host, tests).
    /// Off by default: the daemon reaches registered endpoints itself, so one must not lead into the host.
    #[arg(long, env = "HEARTH_ALLOW_PRIVATE_BUCKET_ENDPOINTS")]
    pub allow_private_bucket_endpoints: bool,
    /// Durable storage for paused sandboxes, snapshots and templates: `s3://BUCKET[/PREFIX]` (endpoint, region
    /// and credentials from the AWS environment or shared credentials file; see docs/storage.md). Local disk
    /// stays the working copy; without this flag everything stays on local disk only.
    #[arg(long, env = "HEARTH_STORAGE")]
    pub storage: Option<String>,
    /// Key file for client-side encryption of everything stored in the bucket (64 hex characters or 32 bytes).
    #[arg(long, env = "HEARTH_STORAGE_KEY", requires = "storage")]
    pub storage_key: Option<PathBuf>,
    /// Local disk as a cache of the bucket: when the local copies of paused sandboxes, snapshots and templates
    /// take more than this (bytes, or with a suffix: `500M`, `20G`, `1T`; powers of 1024), the least recently
    /// used ones that the bucket holds are removed locally and fetched again when next used. Default: unbounded.
    #[arg(long, env = "HEARTH_CACHE_SIZE", requires = "storage", value_parser = hearth_api::parse_byte_size)]
    pub cache_size: Option<u64>,
    /// Seconds between garbage-collection passes over the storage bucket.
    #[arg(long, env = "HEARTH_STORAGE_GC_INTERVAL_S", default_value_t = 3600)]
    pub storage_gc_interval_s: u64,
    /// Unreferenced chunks younger than this many seconds survive a GC pass (they may belong to an upload
    /// whose manifest is not written yet).
    #[arg(long, env = "HEARTH_STORAGE_GC_GRACE_S", default_value_t = 86400)]
    pub storage_gc_grace_s: u64,
    /// Print the OpenAPI document to stdout and exit.
    #[arg(long)]
    pub print_openapi: bool,
    /// An origin (`https://app.example`) whose browser pages may call the API and `/mcp` (repeatable; none by
    /// default). Requests from other non-local origins are refused with 403 whatever key they carry.
    #[arg(long = "cors-origin", value_name = "ORIGIN")]
    pub cors_origins: Vec<String>,
    /// A host name clients use to reach this daemon (`Host` header) besides local names and IP addresses
    /// (repeatable). Other names are refused with 403 (DNS rebinding).
    #[arg(long = "allowed-host", value_name = "HOST")]
    pub allowed_hosts: Vec<String>,
    /// Requests per second each API key may send (bursts of twice that); over it: 429 with Retry-After. The
    /// bootstrap key is not limited. 0: no limit.
    #[arg(long, value_name = "RPS", default_value_t = 0, env = "HEARTH_KEY_RATE_LIMIT")]
    pub key_rate_limit: u32,
}

/// Paths derived from the flags.
#[derive(Debug, Clone)]
pub struct Paths {
    pub data_dir: PathBuf,
    pub images_dir: PathBuf,
}

impl Paths {
    pub fn new(data_dir: PathBuf, images_dir: Option<PathBuf>) -> Self {
        let images_dir = images_dir.unwrap_or_else(|| data_dir.join("images"));
        Paths { data_dir, images_dir }
    }

    pub fn db(&self) -> PathBuf {
        self.data_dir.join("state.db")
    }

    pub fn api_key(&self) -> PathBuf {
        self.data_dir.join("api-key")
    }

    pub fn listen_addr(&self) -> PathBuf {
        self.data_dir.join("listen-addr")
    }

    pub fn sandboxes_dir(&self) -> PathBuf {
        self.data_dir.join("sandboxes")
    }

    /// Directory of one sandbox. `id` must already be validated with `hearth_api::is_valid_sandbox_id`.
    pub fn sandbox_dir(&self, id: &str) -> PathBuf {
        debug_assert!(hearth_api::is_valid_sandbox_id(id));
        self.sandboxes_dir().join(id)
    }

    pub fn snapshots_dir(&self) -> PathBuf {
        self.data_dir.join("snapshots")
    }

    /// Directory of one snapshot. `id` must already be validated with `hearth_api::is_valid_snapshot_id`.
    pub fn snapshot_dir(&self, id: &str) -> PathBuf {
        debug_assert!(hearth_api::is_valid_snapshot_id(id));
        self.snapshots_dir().join(id)
    }

    pub fn user_templates_dir(&self) -> PathBuf {
        self.data_dir.join("templates")
    }

    /// Root filesystem of a template saved from a sandbox. `name` must already be validated.
    pub fn user_template_image(&self, name: &str) -> PathBuf {
        debug_assert!(hearth_api::is_valid_template_name(name));
        self.user_templates_dir().join(name).join("rootfs.ext4")
    }

    /// The root filesystem a template's sandboxes start from: a saved template first, else a built-in image.
    pub fn template_base(&self, name: &str) -> Option<PathBuf> {
        [self.user_template_image(name), self.template_image(name)]
            .into_iter()
            .find(|p| p.is_file())
    }

    /// Root filesystem image of a template. `name` must already be validated.
    pub fn template_image(&self, name: &str) -> PathBuf {
        debug_assert!(hearth_api::is_valid_template_name(name));
        self.images_dir.join("rootfs").join(format!("{name}.ext4"))
    }

    pub fn boot_images(&self) -> hearth_vmm::BootImages {
        hearth_vmm::BootImages {
            vmlinuz: self.images_dir.join("vmlinuz"),
            vmlinux: self.images_dir.join("vmlinux"),
            initramfs: self.images_dir.join("initramfs.cpio.gz"),
        }
    }

    /// Names of the templates present in the images directory, sorted.
    pub fn templates(&self) -> Vec<String> {
        let mut names = Vec::new();
        if let Ok(dir) = std::fs::read_dir(self.images_dir.join("rootfs")) {
            for entry in dir.flatten() {
                let file = entry.file_name();
                let Some(file) = file.to_str() else { continue };
                if let Some(name) = file.strip_suffix(".ext4")
                    && hearth_api::is_valid_template_name(name)
                {
                    names.push(name.to_string());
                }
            }
        }
        names.sort();
        names
    }
}

/// Readiness deadline: the flag if given, else a default that fits the acceleration in use.
pub fn ready_timeout(flag: Option<u64>, accel: hearth_vmm::Accel) -> Duration {
    let secs = flag.unwrap_or(match accel {
        hearth_vmm::Accel::Tcg => 120,
        hearth_vmm::Accel::Kvm => 20,
    });
    Duration::from_secs(secs.max(1))
}

/// How long an agent may stay silent: the flag if given, else a default that fits the acceleration in use.
pub fn agent_unresponsive(flag: Option<u64>, accel: hearth_vmm::Accel) -> Duration {
    let secs = flag.unwrap_or(match accel {
        hearth_vmm::Accel::Tcg => 30,
        hearth_vmm::Accel::Kvm => 10,
    });
    Duration::from_secs(secs.max(2))
}

/// The first `nameserver` of a resolv.conf text, as a socket address on port 53.
pub fn resolv_conf_nameserver(text: &str) -> Option<SocketAddr> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|rest| rest.trim().split('%').next()?.parse::<std::net::IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .next()
}

impl Args {
    /// What `crate::tenancy` takes from the command line.
    pub fn tenancy_settings(&self) -> crate::tenancy::TenancySettings {
        crate::tenancy::TenancySettings {
            cors_origins: self.cors_origins.clone(),
            allowed_hosts: self.allowed_hosts.clone(),
            key_rate_limit: self.key_rate_limit,
        }
    }
}

#[cfg(test)]
mod net_tests {
    #[test]
    fn nameserver_comes_from_resolv_conf() {
        let text = "# generated\nsearch example\nnameserver 192.0.2.53\nnameserver 192.0.2.54\n";
        assert_eq!(
            super::resolv_conf_nameserver(text),
            Some("192.0.2.53:53".parse().expect("addr"))
        );
        assert_eq!(
            super::resolv_conf_nameserver("nameserver fe80::1%eth0"),
            Some("[fe80::1]:53".parse().expect("addr"))
        );
        assert_eq!(super::resolv_conf_nameserver("search x\n"), None);
    }
}
