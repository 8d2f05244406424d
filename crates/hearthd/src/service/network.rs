//! Sandbox networking in the daemon: each sandbox's network namespace, egress policy, resolver and proxy
//! (crate hearth-net does the work), private networks, the egress audit log.
//!
//! Addresses come from the sandbox range (default 10.213.0.0/16) and are recorded in the state database with
//! the policy and an optional name; memberships of private networks too. The kernel side (namespaces, links,
//! nftables) outlives the daemon; the services (resolver, proxy, NFLOG reader) are tasks of the daemon and are
//! started again for every sandbox found at start-up ([`Sandboxes::restore_networking`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use hearth_api::{
    CreateNetworkRequest, EgressLog, EgressPolicy, NetworkInfo, NetworkPolicy, SandboxNetwork, SandboxState,
};
use hearth_net::ctx::SandboxNetCtx;
use hearth_net::dns::Upstream;
use hearth_net::plane::{GuestLink, Plane, PlaneConfig, SandboxNet};
use hearth_net::policy::Policy;
use hearth_vmm::NetAttach;
use rand::RngCore;
use tokio::task::JoinHandle;

use super::{Sandboxes, ServiceError, clip, now_ms};
use crate::db::network::{NetworkRow, SandboxNetRow};

/// Longest network name (a DNS label).
const MAX_NETWORK_NAME: usize = 32;
/// NFLOG group the sandbox tables log to.
const NFLOG_GROUP: u16 = hearth_net::ruleset::NFLOG_GROUP;

/// Where sandbox traffic leaves and how names are resolved upstream.
#[derive(Debug, Clone)]
pub struct NetSettings {
    /// Network namespace of the uplink (the host's own by default).
    pub uplink_netns: PathBuf,
    /// The sandbox range; its first address is the hub's.
    pub sandbox_net: ipnet::Ipv4Net,
    /// The sandboxes' IPv6 range (a /64 or larger); `None`: sandboxes have no IPv6 path.
    pub sandbox_net6: Option<ipnet::Ipv6Net>,
    /// The resolver the platform resolver and the proxy ask (reached from the uplink namespace).
    pub dns_upstream: SocketAddr,
    /// File holding the key that signs port tokens (created with 32 random bytes when missing).
    pub port_key_file: PathBuf,
}

/// The daemon's networking: the data plane, the upstream resolver and each sandbox's running services.
pub struct Networking {
    plane: Arc<Plane>,
    upstream: Arc<Upstream>,
    settings: NetSettings,
    /// Addresses of the uplink namespace (the host's own, when it is the host's): always denied.
    uplink_addrs: Vec<IpAddr>,
    runtime: Mutex<HashMap<String, Runtime>>,
    /// Held while an address is picked and recorded: creates (forks above all) run concurrently.
    allocating: Mutex<()>,
    /// Signs port tokens.
    port_key: [u8; 32],
}

/// A sandbox's services; dropping it stops them.
struct Runtime {
    ctx: Arc<SandboxNetCtx>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl std::fmt::Debug for Networking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Networking")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl Networking {
    /// Sets up the uplink side (idempotent) and the upstream resolver client.
    pub fn new(settings: NetSettings) -> Result<Networking, String> {
        let plane = Arc::new(
            Plane::new(PlaneConfig {
                uplink_netns: settings.uplink_netns.clone(),
                sandbox_net: settings.sandbox_net,
                sandbox_net6: settings.sandbox_net6,
            })
            .map_err(|e| format!("network data plane: {e}"))?,
        );
        let uplink_addrs = plane
            .uplink_addresses()
            .map_err(|e| format!("uplink addresses: {e}"))?;
        let upstream = Upstream::new(settings.dns_upstream, settings.uplink_netns.clone());
        let port_key = load_key_file(&settings.port_key_file)
            .map_err(|e| format!("port token key {}: {e}", settings.port_key_file.display()))?;
        Ok(Networking {
            port_key,
            plane,
            upstream: Arc::new(upstream),
            settings,
            uplink_addrs,
            runtime: Mutex::new(HashMap::new()),
            allocating: Mutex::new(()),
        })
    }

    pub fn settings(&self) -> &NetSettings {
        &self.settings
    }

    fn runtime(&self) -> std::sync::MutexGuard<'_, HashMap<String, Runtime>> {
        self.runtime.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ctx(&self, id: &str) -> Option<Arc<SandboxNetCtx>> {
        self.runtime().get(id).map(|r| r.ctx.clone())
    }

    /// The first free address of the sandbox range (after the hub's).
    fn allocate(&self, used: &HashSet<Ipv4Addr>) -> Option<Ipv4Addr> {
        let hub = hearth_net::ruleset::hub_address(self.settings.sandbox_net);
        self.settings
            .sandbox_net
            .hosts()
            .find(|a| *a != hub && !used.contains(a))
    }

    fn plane_spec(&self, row: &SandboxNetRow, policy: &Policy, peers: Vec<Ipv4Addr>) -> SandboxNet {
        SandboxNet {
            id: row.sandbox_id.clone(),
            address: row.address,
            default_allow: policy.default_action() == hearth_api::EgressDefault::Allow,
            allow: policy.allow_cidrs(),
            deny: policy.deny_cidrs(),
            proxy_tcp: policy.has_domain_rules(),
            peers,
            extra_denied: self.uplink_addrs.clone(),
            guest_link: GuestLink::Tap,
        }
    }

    /// Creates the sandbox's namespace and rules and starts its services. On error nothing is left. A
    /// namespace that exists already (a running sandbox found at start-up: its VM's tap lives there) is kept
    /// and only its rules are applied again.
    async fn bring_up(&self, row: &SandboxNetRow, peers: Vec<Ipv4Addr>) -> Result<(), String> {
        let policy = Policy::parse(&row.policy).map_err(|e| e.to_string())?;
        let spec = self.plane_spec(row, &policy, peers);
        let plane = self.plane.clone();
        let id = row.sandbox_id.clone();
        let keep = hearth_net::netns_path(&id).exists();
        tokio::task::spawn_blocking(move || {
            if keep {
                plane.apply_rules(&spec)
            } else {
                plane.create_sandbox(&spec)
            }
        })
        .await
        .map_err(|e| format!("network task: {e}"))?
        .map_err(|e| format!("network of {id}: {e}"))?;
        // Services of an earlier life of this daemon are replaced.
        self.runtime().remove(&id);
        match self.start_services(&id, policy) {
            Ok(rt) => {
                self.runtime().insert(id, rt);
                Ok(())
            }
            Err(e) => {
                if !keep {
                    let _ = self.plane.destroy_sandbox(&id);
                }
                Err(format!("network services of {id}: {e}"))
            }
        }
    }

    fn start_services(&self, id: &str, policy: Policy) -> std::io::Result<Runtime> {
        let ns = hearth_net::netns_path(id);
        let ctx = Arc::new(SandboxNetCtx::new(id, policy, self.uplink_addrs.clone()));
        let gw = IpAddr::V4(hearth_net::GATEWAY);
        let dns_socket = hearth_net::netns::udp_socket(&ns, SocketAddr::new(gw, 53))?;
        let dns_listener = hearth_net::netns::tcp_listener(&ns, SocketAddr::new(gw, 53))?;
        let proxy_listener =
            hearth_net::netns::tcp_listener(&ns, SocketAddr::new(gw, hearth_net::PROXY_PORT))?;
        let mut tasks = vec![
            hearth_net::dns::spawn_resolver(dns_socket, ctx.clone(), self.upstream.clone()),
            hearth_net::dns::spawn_tcp_resolver(dns_listener, ctx.clone(), self.upstream.clone()),
            hearth_net::proxy::spawn_proxy(
                proxy_listener,
                ctx.clone(),
                self.upstream.clone(),
                self.settings.uplink_netns.clone(),
            ),
        ];
        // Kernel-path decisions (CIDR rules, UDP, DNS elsewhere) arrive as NFLOG records.
        let (tx, mut rx) = tokio::sync::mpsc::channel::<hearth_net::nflog::KernelEvent>(256);
        tasks.push(hearth_net::nflog::spawn_nflog(&ns, NFLOG_GROUP, tx)?);
        let audit_ctx = ctx.clone();
        tasks.push(tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                audit_ctx.audit.push(hearth_api::EgressEvent {
                    at: hearth_net::audit::now_rfc3339(),
                    protocol: ev.protocol,
                    destination: Some(ev.destination.to_string()),
                    port: ev.port,
                    name: None,
                    allowed: ev.allowed,
                    reason: ev.reason,
                    rule: None,
                });
            }
        }));
        Ok(Runtime { ctx, tasks })
    }

    /// Stops a sandbox's services and removes its namespace and rules (idempotent).
    async fn tear_down(&self, id: &str) {
        self.runtime().remove(id);
        let plane = self.plane.clone();
        let id = id.to_string();
        let result = tokio::task::spawn_blocking(move || plane.destroy_sandbox(&id)).await;
        if let Ok(Err(e)) = result {
            tracing::warn!(error = %e, "removing a sandbox network failed");
        }
    }
}

/// Reads a 32-byte key file (the port-token key, the bucket-secret key), creating it (mode 0600, random) on
/// first use.
pub(crate) fn load_key_file(path: &std::path::Path) -> std::io::Result<[u8; 32]> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    if let Ok(bytes) = std::fs::read(path)
        && let Ok(key) = <[u8; 32]>::try_from(bytes.as_slice())
    {
        return Ok(key);
    }
    let mut key = [0u8; 32];
    rand::rng().fill_bytes(&mut key);
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&key)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    Ok(key)
}

/// HMAC-SHA256 of a token's claims under a daemon key, hex (port tokens; access tokens, crate::tenancy::token).
pub(crate) fn sign_claims(key: &[u8; 32], claims: &str) -> String {
    use hmac::Mac;
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(key).expect("HMAC takes any key length");
    mac.update(claims.as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// What a port token signs: the sandbox, the port, the expiry and, once tokens were revoked, the generation
/// (generation 0 keeps the claims of tokens issued before revocation existed).
fn port_claims(id: &str, port: u16, generation: u64, expires_ms: i64) -> String {
    if generation == 0 {
        format!("{id}:{port}:{expires_ms}")
    } else {
        format!("{id}:{port}:{expires_ms}:g{generation}")
    }
}

/// Checks a network name: 1-32 of `[a-z0-9-]`, starting with a letter, not ending with `-`.
fn validate_network_name(name: &str) -> Result<(), ServiceError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NETWORK_NAME
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(ServiceError::InvalidArgument(format!(
            "invalid network name {:?} (1-{MAX_NETWORK_NAME} characters of a-z, 0-9 and -, starting with a letter)",
            clip(name, 64)
        )))
    }
}

/// Checks a sandbox name (the same rules as a network name: it becomes a DNS label).
pub fn validate_sandbox_name(name: &str) -> Result<(), ServiceError> {
    validate_network_name(name).map_err(|_| {
        ServiceError::InvalidArgument(format!(
            "invalid sandbox name {:?} (1-{MAX_NETWORK_NAME} characters of a-z, 0-9 and -, starting with a letter)",
            clip(name, 64)
        ))
    })
}

/// Parses a policy, turning its error into a 400.
pub fn parse_policy(policy: &EgressPolicy) -> Result<Policy, ServiceError> {
    Policy::parse(policy).map_err(|e| ServiceError::InvalidArgument(format!("network policy: {e}")))
}

fn new_network_id() -> String {
    let mut bytes = [0u8; 8];
    rand::rng().fill_bytes(&mut bytes);
    format!("net_{}", hex::encode(bytes))
}

/// What a create request asks of the network, validated.
#[derive(Debug, Clone, Default)]
pub(crate) struct NetPlan {
    pub policy: EgressPolicy,
    pub network_ids: Vec<String>,
    pub name: Option<String>,
    /// Buckets to mount, served on the sandbox's gateway ([`Sandboxes::plan_mounts`]).
    pub mounts: Vec<crate::db::mounts::MountRow>,
}

impl Sandboxes {
    /// The daemon's networking, when enabled.
    /// Whether sandboxes get a network device, and whether it has an IPv6 path: what a boot snapshot's
    /// devices depend on ([`super::warm`]).
    pub(crate) fn nic_shape(&self) -> (bool, bool) {
        self.networking()
            .map_or((false, false), |n| (true, n.settings.sandbox_net6.is_some()))
    }

    pub fn networking(&self) -> Option<&Arc<Networking>> {
        self.net.get()
    }

    /// Turns networking on (once, at start-up, before any sandbox is created).
    pub fn enable_networking(&self, net: Networking) {
        let _ = self.net.set(Arc::new(net));
    }

    fn require_net(&self) -> Result<&Arc<Networking>, ServiceError> {
        self.networking().ok_or_else(|| {
            ServiceError::InvalidArgument(
                "networking is disabled on this daemon (hearthd --network off, or not root / no nftables: see GET /v1/system)"
                    .into(),
            )
        })
    }

    /// Validates the network part of a create request.
    pub(crate) fn plan_network(
        &self,
        policy: Option<&NetworkPolicy>,
        networks: &[String],
        name: Option<&str>,
    ) -> Result<NetPlan, ServiceError> {
        if self.networking().is_none() {
            if policy.is_some() || !networks.is_empty() || name.is_some() {
                self.require_net()?;
            }
            return Ok(NetPlan::default());
        }
        let policy = policy.map(|p| p.egress.clone()).unwrap_or_default();
        parse_policy(&policy)?;
        let mut network_ids = Vec::new();
        for n in networks {
            let row = self
                .db
                .find_network(n)?
                .ok_or_else(|| ServiceError::NotFound(format!("network {} not found", clip(n, 64))))?;
            if !network_ids.contains(&row.id) {
                network_ids.push(row.id);
            }
        }
        if let Some(name) = name {
            validate_sandbox_name(name)?;
            if self.db.sandbox_name_taken(name)? {
                return Err(ServiceError::Conflict(format!(
                    "a sandbox called {name} exists already"
                )));
            }
        }
        Ok(NetPlan {
            policy,
            network_ids,
            name: name.map(str::to_string),
            mounts: Vec::new(),
        })
    }

    /// Gives a `creating` sandbox its network: address, rows, namespace, rules, services. Returns what the VM
    /// spec needs, or `None` when networking is off. On error the caller's teardown removes what was made.
    pub(crate) async fn attach_network(&self, id: &str, plan: &NetPlan) -> Result<Option<NetAttach>, String> {
        let Some(net) = self.networking() else {
            return Ok(None);
        };
        let row = {
            // Pick and record under one lock, so concurrent creates never pick the same free address.
            let _allocating = net.allocating.lock().unwrap_or_else(|e| e.into_inner());
            let used: HashSet<Ipv4Addr> = self
                .db
                .list_sandbox_nets()
                .map_err(|e| e.to_string())?
                .into_iter()
                .map(|r| r.address)
                .collect();
            let address = net
                .allocate(&used)
                .ok_or("the sandbox address range is exhausted")?;
            let row = SandboxNetRow {
                sandbox_id: id.to_string(),
                address,
                name: plan.name.clone(),
                policy: plan.policy.clone(),
            };
            self.db.insert_sandbox_net(&row).map_err(|e| e.to_string())?;
            for n in &plan.network_ids {
                self.db.add_member(n, id).map_err(|e| e.to_string())?;
            }
            row
        };
        let peers = self.peers_of(id).map_err(|e| e.to_string())?;
        net.bring_up(&row, peers).await?;
        // Only its peers need to learn about it (every other sandbox's rules stay as they are).
        if !plan.network_ids.is_empty() {
            self.refresh_peers().await.map_err(|e| e.to_string())?;
        }
        // Its buckets are served on its gateway (crate hearth-mount; see service::mounts).
        self.attach_mounts(id, &plan.mounts)
            .await
            .map_err(|e| format!("mounts: {e}"))?;
        Ok(Some(
            NetAttach::for_sandbox(id).with_ipv6(net.settings.sandbox_net6.is_some()),
        ))
    }

    /// Removes a sandbox's network (its rows go with the sandbox row) and its mount server. Never fails.
    pub(crate) async fn detach_network(&self, id: &str) {
        self.stop_mounts(id).await;
        if let Some(net) = self.networking() {
            net.tear_down(id).await;
        }
    }

    /// After a sandbox on private networks left: its peers forget it.
    pub(crate) async fn network_gone(&self) {
        if self.networking().is_some()
            && let Err(e) = self.refresh_peers().await
        {
            tracing::warn!(error = %e, "updating private-network peers failed");
        }
    }

    /// The attachment for a resume: the namespace kept while paused, or made again if it is gone (host
    /// reboot).
    pub(crate) async fn network_for_resume(&self, id: &str) -> Result<Option<NetAttach>, String> {
        let Some(net) = self.networking() else {
            return Ok(None);
        };
        let Some(row) = self.db.get_sandbox_net(id).map_err(|e| e.to_string())? else {
            return Ok(None);
        };
        if net.ctx(id).is_none() || !hearth_net::netns_path(id).exists() {
            let peers = self.peers_of(id).map_err(|e| e.to_string())?;
            let on_networks = !self.network_ids_of(id).map_err(|e| e.to_string())?.is_empty();
            net.bring_up(&row, peers).await?;
            if on_networks {
                self.refresh_peers().await.map_err(|e| e.to_string())?;
            }
        }
        self.ensure_mounts(id).await.map_err(|e| format!("mounts: {e}"))?;
        Ok(Some(
            NetAttach::for_sandbox(id).with_ipv6(net.settings.sandbox_net6.is_some()),
        ))
    }

    /// At start-up: services for every sandbox that has a network, and removal of whatever network state
    /// belongs to no sandbox of this daemon.
    pub async fn restore_networking(&self) {
        let Some(net) = self.networking() else { return };
        let rows = match self.db.list_sandbox_nets() {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(error = %e, "listing sandbox networks");
                return;
            }
        };
        let live: HashSet<String> = self
            .db
            .list()
            .map(|l| l.into_iter().map(|r| r.id).collect())
            .unwrap_or_default();
        for row in rows.iter().filter(|r| live.contains(&r.sandbox_id)) {
            let peers = self.peers_of(&row.sandbox_id).unwrap_or_default();
            if let Err(e) = net.bring_up(row, peers).await {
                tracing::warn!(sandbox = %row.sandbox_id, error = %e, "restoring a sandbox network failed");
            }
        }
        let plane = net.plane.clone();
        let keep = live.clone();
        match tokio::task::spawn_blocking(move || plane.sweep(&keep)).await {
            Ok(Ok(removed)) if !removed.is_empty() => {
                tracing::info!(?removed, "removed network state of no live sandbox");
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "sweeping network state failed"),
            _ => {}
        }
        if let Err(e) = self.refresh_peers().await {
            tracing::warn!(error = %e, "restoring private-network peers failed");
        }
        self.restore_mounts().await;
    }

    /// Addresses of the sandboxes sharing at least one private network with `id`.
    fn peers_of(&self, id: &str) -> Result<Vec<Ipv4Addr>, ServiceError> {
        let (_, peers, _) = self.peer_map()?;
        Ok(peers
            .get(id)
            .map(|p| p.iter().copied().collect())
            .unwrap_or_default())
    }

    /// Memberships resolved: per sandbox its peers' addresses and its private names; all peer pairs.
    #[allow(clippy::type_complexity)]
    fn peer_map(
        &self,
    ) -> Result<
        (
            Vec<(Ipv4Addr, Ipv4Addr)>,
            HashMap<String, BTreeSet<Ipv4Addr>>,
            HashMap<String, HashMap<String, Ipv4Addr>>,
        ),
        ServiceError,
    > {
        let nets: HashMap<String, SandboxNetRow> = self
            .db
            .list_sandbox_nets()?
            .into_iter()
            .map(|r| (r.sandbox_id.clone(), r))
            .collect();
        let names: HashMap<String, String> = self
            .db
            .list_networks()?
            .into_iter()
            .map(|n| (n.id, n.name))
            .collect();
        let mut by_network: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (network, sandbox) in self.db.members()? {
            by_network.entry(network).or_default().push(sandbox);
        }
        let mut pairs = BTreeSet::new();
        let mut peers: HashMap<String, BTreeSet<Ipv4Addr>> = HashMap::new();
        let mut private: HashMap<String, HashMap<String, Ipv4Addr>> = HashMap::new();
        for (network, members) in &by_network {
            let Some(net_name) = names.get(network) else {
                continue;
            };
            for a in members {
                let Some(ra) = nets.get(a) else { continue };
                for b in members {
                    let Some(rb) = nets.get(b) else { continue };
                    let entry = private.entry(a.clone()).or_default();
                    entry.insert(format!("{}.{net_name}.internal", rb.sandbox_id), rb.address);
                    if let Some(n) = &rb.name {
                        entry.insert(format!("{n}.{net_name}.internal"), rb.address);
                    }
                    if a != b {
                        pairs.insert((ra.address, rb.address));
                        peers.entry(a.clone()).or_default().insert(rb.address);
                    }
                }
            }
        }
        Ok((pairs.into_iter().collect(), peers, private))
    }

    /// Pushes the current memberships to the data plane (hub pairs, every sandbox's rules) and the resolvers.
    async fn refresh_peers(&self) -> Result<(), ServiceError> {
        let Some(net) = self.networking() else {
            return Ok(());
        };
        let (pairs, peers, private) = self.peer_map()?;
        let mut specs = Vec::new();
        for row in self.db.list_sandbox_nets()? {
            let Some(ctx) = net.ctx(&row.sandbox_id) else {
                continue;
            };
            ctx.set_private_names(private.get(&row.sandbox_id).cloned().unwrap_or_default());
            let p: Vec<Ipv4Addr> = peers
                .get(&row.sandbox_id)
                .map(|s| s.iter().copied().collect())
                .unwrap_or_default();
            specs.push(net.plane_spec(&row, &ctx.policy(), p));
        }
        let plane = net.plane.clone();
        tokio::task::spawn_blocking(move || {
            plane.set_peer_pairs(&pairs)?;
            for s in &specs {
                plane.apply_rules(s)?;
            }
            Ok::<_, hearth_net::plane::NetError>(())
        })
        .await
        .map_err(|e| ServiceError::Internal(format!("network task: {e}")))?
        .map_err(|e| ServiceError::Internal(format!("updating network rules: {e}")))
    }

    fn sandbox_net_row(&self, id: &str) -> Result<SandboxNetRow, ServiceError> {
        let row = self.row(id)?;
        if row.state == SandboxState::Creating {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is still being created"
            )));
        }
        self.require_net()?;
        self.db
            .get_sandbox_net(id)?
            .ok_or_else(|| ServiceError::Conflict(format!("sandbox {id} has no network")))
    }

    /// Ids of the private networks sandbox `id` is attached to.
    pub(crate) fn network_ids_of(&self, id: &str) -> Result<Vec<String>, ServiceError> {
        Ok(self
            .db
            .members()?
            .into_iter()
            .filter(|(_, s)| s == id)
            .map(|(n, _)| n)
            .collect())
    }

    pub(crate) fn networks_of(&self, id: &str) -> Result<Vec<String>, ServiceError> {
        let names: HashMap<String, String> = self
            .db
            .list_networks()?
            .into_iter()
            .map(|n| (n.id, n.name))
            .collect();
        Ok(self
            .db
            .members()?
            .into_iter()
            .filter(|(_, s)| s == id)
            .filter_map(|(n, _)| names.get(&n).cloned())
            .collect())
    }

    /// `GET /v1/sandboxes/{id}/network`.
    pub fn get_network(&self, id: &str) -> Result<SandboxNetwork, ServiceError> {
        let row = self.sandbox_net_row(id)?;
        Ok(SandboxNetwork {
            address: row.address.to_string(),
            guest_address: hearth_net::GUEST_ADDR.to_string(),
            egress: row.policy,
            networks: self.networks_of(id)?,
        })
    }

    /// `PATCH /v1/sandboxes/{id}/network`: a new egress policy, effective for new connections at once.
    pub async fn set_network_policy(
        &self,
        id: &str,
        policy: NetworkPolicy,
    ) -> Result<SandboxNetwork, ServiceError> {
        let lock = self.op_lock(id);
        let _guard = lock.lock().await;
        let row = self.sandbox_net_row(id)?;
        let parsed = parse_policy(&policy.egress)?;
        let net = self.require_net()?;
        self.db.set_sandbox_policy(id, &policy.egress)?;
        if let Some(ctx) = net.ctx(id) {
            let peers = self.peers_of(id)?;
            let spec = net.plane_spec(&row, &parsed, peers);
            let plane = net.plane.clone();
            tokio::task::spawn_blocking(move || plane.apply_rules(&spec))
                .await
                .map_err(|e| ServiceError::Internal(format!("network task: {e}")))?
                .map_err(|e| ServiceError::Internal(format!("applying the policy: {e}")))?;
            ctx.set_policy(parsed);
        }
        self.get_network(id)
    }

    /// `GET /v1/sandboxes/{id}/network/log`.
    pub fn network_log(&self, id: &str) -> Result<EgressLog, ServiceError> {
        self.sandbox_net_row(id)?;
        let net = self.require_net()?;
        Ok(net.ctx(id).map(|c| c.audit.snapshot()).unwrap_or(EgressLog {
            events: Vec::new(),
            dropped: 0,
        }))
    }

    fn network_info(&self, row: NetworkRow, members: &[(String, String)]) -> NetworkInfo {
        NetworkInfo {
            members: members
                .iter()
                .filter(|(n, _)| *n == row.id)
                .map(|(_, s)| s.clone())
                .collect(),
            id: row.id,
            name: row.name,
            created_at: super::lifecycle::rfc3339(row.created_at_ms),
        }
    }

    /// A token for port `port` of sandbox `id`, valid `ttl_s` seconds: `<expiry ms>.<hmac>`, the HMAC over
    /// the sandbox, the port, the expiry and the port's token generation ([`Sandboxes::revoke_port_tokens`]). Returns it with the expiry.
    pub fn port_token(&self, id: &str, port: u16, ttl_s: u64) -> Result<(String, i64), ServiceError> {
        self.sandbox_net_row(id)?;
        let net = self.require_net()?;
        let expires = now_ms().saturating_add(i64::try_from(ttl_s * 1000).unwrap_or(i64::MAX));
        let generation = self.db.port_token_generation(id, port)?;
        let mac = sign_claims(&net.port_key, &port_claims(id, port, generation, expires));
        Ok((format!("{expires}.{mac}"), expires))
    }

    /// Revokes every token issued so far for port `port` of sandbox `id` (the generation they are signed with
    /// moves on; persisted, so a restart does not bring them back).
    pub fn revoke_port_tokens(&self, id: &str, port: u16) -> Result<(), ServiceError> {
        self.sandbox_net_row(id)?;
        self.require_net()?;
        self.db.bump_port_token_generation(id, port)?;
        Ok(())
    }

    /// Whether `token` opens port `port` of sandbox `id` now (constant-time comparison of the signature).
    pub fn verify_port_token(&self, token: &str, id: &str, port: u16) -> bool {
        use subtle::ConstantTimeEq;
        let Some(net) = self.networking() else {
            return false;
        };
        let Some((expires, mac)) = token.split_once('.') else {
            return false;
        };
        let Ok(expires_ms) = expires.parse::<i64>() else {
            return false;
        };
        if expires_ms <= now_ms() {
            return false;
        }
        let generation = match self.db.port_token_generation(id, port) {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "reading a port's token generation");
                return false;
            }
        };
        let want = sign_claims(&net.port_key, &port_claims(id, port, generation, expires_ms));
        want.as_bytes().ct_eq(mac.as_bytes()).into()
    }

    /// The namespace to reach a guest port through; a paused sandbox is resumed first (if it allows it).
    pub async fn port_target(&self, id: &str) -> Result<PathBuf, ServiceError> {
        let row = self.row(id)?;
        self.sandbox_net_row(id)?;
        if matches!(row.state, SandboxState::Paused | SandboxState::Pausing) {
            self.wake(&row).await?;
        } else if row.state != SandboxState::Running {
            return Err(ServiceError::Conflict(format!(
                "sandbox {id} is {}",
                row.state.as_str()
            )));
        }
        Ok(hearth_net::netns_path(id))
    }

    /// `POST /v1/networks`.
    pub fn create_network(&self, req: CreateNetworkRequest) -> Result<NetworkInfo, ServiceError> {
        self.require_net()?;
        validate_network_name(&req.name)?;
        if self.db.find_network(&req.name)?.is_some() {
            return Err(ServiceError::Conflict(format!(
                "a network called {} exists already",
                req.name
            )));
        }
        let row = NetworkRow {
            id: new_network_id(),
            name: req.name,
            created_at_ms: now_ms(),
        };
        self.db.insert_network(&row)?;
        Ok(self.network_info(row, &[]))
    }

    /// `GET /v1/networks`.
    pub fn list_networks(&self) -> Result<Vec<NetworkInfo>, ServiceError> {
        let members = self.db.members()?;
        Ok(self
            .db
            .list_networks()?
            .into_iter()
            .map(|r| self.network_info(r, &members))
            .collect())
    }

    fn find_network(&self, id_or_name: &str) -> Result<NetworkRow, ServiceError> {
        self.db
            .find_network(id_or_name)?
            .ok_or_else(|| ServiceError::NotFound(format!("network {} not found", clip(id_or_name, 64))))
    }

    /// `GET /v1/networks/{id}` (id or name).
    pub fn get_network_info(&self, id_or_name: &str) -> Result<NetworkInfo, ServiceError> {
        let row = self.find_network(id_or_name)?;
        Ok(self.network_info(row, &self.db.members()?))
    }

    /// `DELETE /v1/networks/{id}`: refused while sandboxes are attached.
    pub fn delete_network(&self, id_or_name: &str) -> Result<(), ServiceError> {
        let row = self.find_network(id_or_name)?;
        if !self.db.delete_network_if_unused(&row.id)? {
            return Err(ServiceError::Conflict(format!(
                "network {} has sandboxes attached: detach them first",
                row.name
            )));
        }
        Ok(())
    }

    /// `POST /v1/networks/{id}/members/{sandbox}`: attaches a sandbox; peers reach it at once.
    pub async fn attach_to_network(&self, network: &str, id: &str) -> Result<NetworkInfo, ServiceError> {
        let row = self.find_network(network)?;
        self.sandbox_net_row(id)?;
        self.db.add_member(&row.id, id)?;
        self.refresh_peers().await?;
        self.get_network_info(&row.id)
    }

    /// `DELETE /v1/networks/{id}/members/{sandbox}`: detaches; the link is cut at once.
    pub async fn detach_from_network(&self, network: &str, id: &str) -> Result<NetworkInfo, ServiceError> {
        let row = self.find_network(network)?;
        self.sandbox_net_row(id)?;
        if !self.db.remove_member(&row.id, id)? {
            return Err(ServiceError::NotFound(format!(
                "sandbox {id} is not attached to network {}",
                row.name
            )));
        }
        self.refresh_peers().await?;
        self.get_network_info(&row.id)
    }
}
