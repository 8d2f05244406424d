#!/usr/bin/env bash
# Installs hearth on a fresh Debian 12 machine and starts the daemon with its embedded defaults:
# state in /var/lib/hearth (SQLite), sandbox disks on local storage, the best VMM this machine supports.
# Run as root from a clone of the repository. Idempotent: re-running upgrades and restarts the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '== %s\n' "$*" >&2; }

log "installing host packages (QEMU, image tools, Firecracker)"
bash scripts/install-deps.sh

log "building hearth (release)"
cargo build --release --locked -p hearthd -p hearth-cli
install -m 0755 target/release/hearthd target/release/hearth /usr/local/bin/

log "building guest images (cached)"
bash images/build.sh

data_dir=${HEARTH_DATA_DIR:-/var/lib/hearth}
mkdir -p "$data_dir" /var/log/hearth

if [ -d /run/systemd/system ]; then
  log "starting hearthd as a systemd service"
  cat >/etc/systemd/system/hearthd.service <<UNIT
[Unit]
Description=hearth sandbox daemon
After=network.target

[Service]
ExecStart=/usr/local/bin/hearthd --data-dir $data_dir
Restart=on-failure
# VMs are separate processes that outlive a daemon restart; the daemon adopts them when it comes back.
KillMode=process

[Install]
WantedBy=multi-user.target
UNIT
  systemctl daemon-reload
  systemctl enable hearthd >/dev/null
  systemctl restart hearthd
else
  log "starting hearthd in the background (no systemd); log: /var/log/hearth/hearthd.log"
  if [ -f /run/hearthd.pid ] && kill -0 "$(cat /run/hearthd.pid)" 2>/dev/null; then
    kill "$(cat /run/hearthd.pid)" || true
    sleep 1
  fi
  setsid /usr/local/bin/hearthd --data-dir "$data_dir" >>/var/log/hearth/hearthd.log 2>&1 < /dev/null &
  echo $! >/run/hearthd.pid
fi

for _ in $(seq 1 50); do
  if curl -fsS http://127.0.0.1:7070/healthz >/dev/null 2>&1; then
    log "hearthd is up on http://127.0.0.1:7070 (API key in $data_dir/api-key)"
    hearth doctor || true
    echo "try: id=\$(hearth create) && hearth exec \$id -- uname -a && hearth rm \$id" >&2
    exit 0
  fi
  sleep 0.2
done
echo "hearthd did not come up; see /var/log/hearth/hearthd.log or 'journalctl -u hearthd'" >&2
exit 1
