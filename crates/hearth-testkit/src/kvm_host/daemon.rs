//! hearthd inside a [`KvmHost`]: started through L1's agent with its data on the run disk, its output on the
//! host (`hearthd.log`), its API reached through the host forward.

use std::time::{Duration, Instant};

use super::{KvmHost, L1_API_PORT, payload};

/// The uplink namespace L1's hearthd gets with networking on: made in L1 with nothing but loopback, so
/// sandbox egress has no route anywhere unless a test builds one.
pub const L1_UPLINK_NETNS: &str = "l1-uplink";

/// How to start hearthd in L1.
#[derive(Debug, Clone)]
pub struct L1HearthdOptions {
    vmm: Option<String>,
    network: bool,
    args: Vec<String>,
    env: Vec<(String, String)>,
    ready_timeout_s: u64,
}

impl Default for L1HearthdOptions {
    fn default() -> Self {
        L1HearthdOptions {
            vmm: None,
            network: false,
            args: Vec::new(),
            env: Vec::new(),
            ready_timeout_s: 300,
        }
    }
}

impl L1HearthdOptions {
    /// `--vmm auto`, networking off, `RUST_LOG=info`, templates from the run disk, default template `minimal`,
    /// a 300 s readiness deadline (guests boot slowly two levels down).
    pub fn new() -> Self {
        Self::default()
    }

    /// `--vmm <vmm>` (`firecracker`, `qemu`, `auto`).
    pub fn vmm(mut self, vmm: &str) -> Self {
        self.vmm = Some(vmm.to_owned());
        self
    }

    /// Networking on, egress through [`L1_UPLINK_NETNS`] (made if missing; it has no route anywhere), DNS
    /// upstream an address nothing answers on.
    pub fn network(mut self, on: bool) -> Self {
        self.network = on;
        self
    }

    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_owned());
        self
    }

    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    pub fn ready_timeout_s(mut self, secs: u64) -> Self {
        self.ready_timeout_s = secs;
        self
    }
}

/// hearthd running in L1, as the host reaches it.
#[derive(Debug, Clone)]
pub struct L1Hearthd {
    /// `http://127.0.0.1:<port>` (the host forward).
    pub url: String,
    pub key: String,
    /// hearthd's pid in L1.
    pub pid: u32,
}

/// hearthd's data directory in L1.
pub const L1_DATA_DIR: &str = "/hearth/data";

impl KvmHost {
    /// Starts hearthd in L1 (on [`L1_DATA_DIR`], listening on L1's port 7070) and waits until the host reaches
    /// its `/healthz` through the forward. Panics with its log when it does not come up within a minute.
    pub async fn start_hearthd(&mut self, opts: &L1HearthdOptions) -> L1Hearthd {
        assert!(self.hearthd.is_none(), "hearthd already runs in L1");
        let m = payload::MOUNT;
        let mut cmd = format!(
            "rm -f {L1_DATA_DIR}/listen-addr; exec hearthd --listen 0.0.0.0:{L1_API_PORT} --data-dir {L1_DATA_DIR} \
             --images-dir {m}/images --default-template minimal --ready-timeout-s {}",
            opts.ready_timeout_s
        );
        if let Some(vmm) = &opts.vmm {
            cmd.push_str(&format!(" --vmm {vmm}"));
        }
        if opts.network {
            self.sh(&format!(
                "ip netns list | grep -qw {L1_UPLINK_NETNS} || \
                 {{ ip netns add {L1_UPLINK_NETNS} && ip -n {L1_UPLINK_NETNS} link set lo up; }}"
            ))
            .await;
            cmd.push_str(&format!(
                " --network on --uplink-netns /run/netns/{L1_UPLINK_NETNS} --dns-upstream 192.0.2.53:53"
            ));
        } else {
            cmd.push_str(" --network off");
        }
        for a in &opts.args {
            cmd.push_str(&format!(" '{}'", a.replace('\'', r"'\''")));
        }
        // Its output goes to the host through the `hearth.log` virtio-serial port.
        let script = format!(
            "port=; for d in /sys/class/virtio-ports/*; do \
               [ \"$(cat $d/name 2>/dev/null)\" = hearth.log ] && port=/dev/${{d##*/}}; done; \
             [ -n \"$port\" ] || {{ echo 'no hearth.log port' >&2; exit 1; }}; \
             {cmd} >>$port 2>&1"
        );
        let mut env: Vec<(&str, &str)> = vec![("RUST_LOG", "info"), ("NO_COLOR", "1")];
        env.extend(opts.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        let pid = self.spawn_background(&script, &env).await;
        self.hearthd = Some(pid);
        let deadline = Instant::now() + Duration::from_secs(60);
        let addr = loop {
            let out = self.exec(&format!("cat {L1_DATA_DIR}/listen-addr")).await;
            if out.success() && out.stdout.ends_with('\n') {
                break out.stdout;
            }
            let alive = self.exec(&format!("kill -0 {pid}")).await.success();
            assert!(
                alive && Instant::now() < deadline,
                "hearthd in L1 did not start (alive: {alive}):\n{}",
                self.hearthd_log()
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        let key = self
            .sh(&format!("cat {L1_DATA_DIR}/api-key"))
            .await
            .trim()
            .to_owned();
        let d = L1Hearthd {
            url: format!("http://{}", self.api_addr),
            key,
            pid,
        };
        while !healthz(&self.api_addr).await {
            assert!(
                Instant::now() < deadline,
                "hearthd listens in L1 on {} but the forward {} does not reach it:\n{}",
                addr.trim(),
                self.api_addr,
                self.hearthd_log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        d
    }

    /// Stops L1's hearthd with SIGTERM (its VMs keep running, as on any host) and waits until it is gone.
    pub async fn stop_hearthd(&mut self) {
        let Some(pid) = self.hearthd.take() else { return };
        self.sh(&format!(
            "kill -TERM {pid} 2>/dev/null || exit 0; \
             i=0; while kill -0 {pid} 2>/dev/null; do i=$((i+1)); [ $i -lt 600 ] || exit 1; sleep 0.1; done"
        ))
        .await;
    }

    /// Starts `cmd` in the background in L1 (it outlives the call) and returns its pid.
    pub async fn spawn_background(&self, cmd: &str, env: &[(&str, &str)]) -> u32 {
        let mut req = hearth_proto::msg::ExecRequest::shell(cmd);
        req.env.insert("TMPDIR".into(), format!("{}/tmp", payload::MOUNT));
        for (k, v) in env {
            req.env.insert((*k).to_owned(), (*v).to_owned());
        }
        self.agent
            .spawn_background(req)
            .await
            .unwrap_or_else(|e| panic!("starting in L1 ({cmd}): {e}"))
    }
}

/// `GET /healthz` on `addr` answers 200.
async fn healthz(addr: &str) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut conn = tokio::net::TcpStream::connect(addr).await.ok()?;
        conn.write_all(
            format!("GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
        let mut answer = Vec::new();
        conn.read_to_end(&mut answer).await.ok()?;
        Some(answer.starts_with(b"HTTP/1.1 200"))
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), attempt).await,
        Ok(Some(true))
    )
}
