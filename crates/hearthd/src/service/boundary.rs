//! `GET /v1/sandboxes/{id}/boundary` (`hearth inspect`): the isolation around a sandbox read from the system at
//! the moment of the request (the VMM's `/proc` entry and cgroup via [`hearth_vmm::inspect`], the egress policy
//! the proxy enforces, the mounts the daemon serves), not from what was asked for at create time.

use hearth_api::{
    CgroupBoundary, GuestBoundary, NamespaceInfo, NetworkBoundary, SandboxBoundary, SandboxState, VmmProcess,
};

use futures::StreamExt;

use super::{Sandboxes, ServiceError};

/// The guest's answer about its kernel is guest-written: at most this many bytes are kept.
const MAX_KERNEL_RELEASE: usize = 128;

impl Sandboxes {
    /// The boundary of sandbox `id` as it is now.
    pub async fn boundary(&self, id: &str) -> Result<SandboxBoundary, ServiceError> {
        let row = self.row(id)?;
        let vmm = row
            .handle
            .as_ref()
            .filter(|_| row.state == SandboxState::Running)
            .filter(|h| self.vmm.is_alive(h))
            .and_then(|h| hearth_vmm::inspect::process_boundary(h.pid))
            .map(|p| self.vmm_process(p));
        let kernel = if vmm.is_some() {
            self.guest_kernel(id).await
        } else {
            None
        };
        Ok(SandboxBoundary {
            sandbox_id: row.id.clone(),
            state: row.state,
            vmm,
            guest: GuestBoundary {
                kernel,
                vcpus: row.vcpus,
                memory_mib: row.memory_mib,
            },
            network: self.network_boundary(id)?,
            mounts: self.list_mounts(id)?.mounts,
        })
    }

    fn vmm_process(&self, p: hearth_vmm::inspect::ProcessBoundary) -> VmmProcess {
        let c = p.cgroup;
        VmmProcess {
            kind: self.vmm.kind().as_str().to_owned(),
            version: self.vmm.version(),
            accel: self.vmm.accel().as_str().to_owned(),
            pid: p.pid,
            binary: p.binary,
            uids: p.uids,
            gids: p.gids,
            root: p.root,
            seccomp: p.seccomp,
            seccomp_filters: p.seccomp_filters,
            no_new_privs: p.no_new_privs,
            capabilities: p.capabilities,
            threads: p.threads,
            rss_bytes: p.rss_bytes,
            namespaces: p
                .namespaces
                .into_iter()
                .map(|(kind, id, shared_with_daemon)| NamespaceInfo {
                    kind,
                    id,
                    shared_with_daemon,
                })
                .collect(),
            cgroup: CgroupBoundary {
                version: c.version,
                path: c.path,
                shared_with_daemon: c.shared_with_caller,
                cpu_max: c.cpu_max,
                memory_max: c.memory_max,
                memory_current_bytes: c.memory_current,
                pids_max: c.pids_max,
                pids_current: c.pids_current,
            },
        }
    }

    /// The guest kernel's release as the guest reports it; `None` when the agent does not answer quickly.
    async fn guest_kernel(&self, id: &str) -> Option<String> {
        let (_live, client) = self.agent(id).await.ok()?;
        let read = async {
            let (_info, mut reader) = client.read_file("/proc/sys/kernel/osrelease").await.ok()?;
            let mut text = Vec::new();
            while let Some(chunk) = reader.next().await {
                text.extend_from_slice(&chunk.ok()?);
                if text.len() > MAX_KERNEL_RELEASE {
                    break;
                }
            }
            text.truncate(MAX_KERNEL_RELEASE);
            Some(String::from_utf8_lossy(&text).trim().to_owned())
        };
        tokio::time::timeout(std::time::Duration::from_secs(5), read)
            .await
            .ok()
            .flatten()
    }

    fn network_boundary(&self, id: &str) -> Result<NetworkBoundary, ServiceError> {
        let Some(net) = self.db.get_sandbox_net(id)? else {
            return Ok(NetworkBoundary {
                enabled: false,
                address: None,
                egress: None,
                private_networks: Vec::new(),
            });
        };
        Ok(NetworkBoundary {
            enabled: true,
            address: Some(net.address.to_string()),
            egress: Some(net.policy),
            private_networks: self.networks_of(id)?,
        })
    }
}
