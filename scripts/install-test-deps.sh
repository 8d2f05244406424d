#!/usr/bin/env bash
# Installs the S3-compatible servers that hearth's object-storage tests start on 127.0.0.1 (idempotent; as root;
# a few milliseconds when already installed):
# - s3s-fs 0.14.1 (crates.io; checks SigV4 signatures, keeps objects as plain files), built with cargo into
#   /opt/hearth/test-tools/bin (about 6 minutes the first time);
# - moto[server] (PyPI; AWS semantics, in memory) in the virtualenv /opt/hearth/test-tools/venv.
# - chromium-headless-shell (Debian) for the browser test of tokens and CORS (crates/hearthd/tests/browser.rs).
# crates/hearth-testkit/src/s3.rs finds them there (or through HEARTH_S3S_FS / HEARTH_MOTO_SERVER).
set -euo pipefail

[ "$(id -u)" -eq 0 ] || { echo "install-test-deps: run as root" >&2; exit 1; }

root=/opt/hearth/test-tools
s3s_version=0.14.1
moto_version=5.2.1
mkdir -p "$root"

if ! "$root/bin/s3s-fs" --version 2>/dev/null | grep -q "$s3s_version"; then
  echo "install-test-deps: building s3s-fs $s3s_version (a few minutes)" >&2
  nice cargo install -q --locked --root "$root" s3s-fs --version "$s3s_version" --features binary
fi

if ! command -v chromium-headless-shell >/dev/null 2>&1; then
  apt-get install -y -qq --no-install-recommends chromium-headless-shell >/dev/null
fi

venv="$root/venv"
if ! "$venv/bin/python" -c "import moto, sys; sys.exit(moto.__version__ != '$moto_version')" 2>/dev/null; then
  # Debian's own python3 (pyenv or other shims may be earlier on PATH); its venv module is a separate package.
  py=/usr/bin/python3
  [ -x "$py" ] || py=$(command -v python3)
  if ! "$py" -c 'import ensurepip, venv' 2>/dev/null; then
    apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check "moto[server]==$moto_version"
fi
echo "install-test-deps: ok (s3s-fs $("$root/bin/s3s-fs" --version 2>/dev/null | awk '{print $NF}'), moto $("$venv/bin/python" -c 'import moto; print(moto.__version__)'))"
