#!/usr/bin/env bash
# Installs the official E2B SDKs that crates/hearth-e2b/tests/sdks.rs drives against a real daemon:
# - npm `e2b` (and a Node.js 22 binary: the SDK needs Node >= 20.18.1) from tests/js/package-lock.json;
# - PyPI `e2b` in a virtual environment, tests/py/.venv, from the pinned tests/py/requirements.txt.
# Idempotent: an install that matches its lock or requirements file is not repeated. Run by scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/../crates/hearth-e2b/tests"

if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
  if [ "$(id -u)" -eq 0 ]; then
    apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  else
    echo "install-e2b-test-deps: python3 cannot make virtual environments: install python3-venv (as root)" >&2
    exit 1
  fi
fi
command -v npm >/dev/null || { echo "install-e2b-test-deps: npm is missing (scripts/install-deps.sh)" >&2; exit 1; }

# JavaScript: the lock file decides.
if ! cmp -s js/package-lock.json js/node_modules/.hearth-installed-from 2>/dev/null; then
  (cd js && npm ci --no-audit --no-fund)
  cp js/package-lock.json js/node_modules/.hearth-installed-from
fi

# Python: the requirements file decides.
if ! cmp -s py/requirements.txt py/.venv/.hearth-installed-from 2>/dev/null; then
  rm -rf py/.venv
  python3 -m venv py/.venv
  py/.venv/bin/pip install -q --disable-pip-version-check --no-input -r py/requirements.txt
  cp py/requirements.txt py/.venv/.hearth-installed-from
fi

js_version=$(js/node_modules/.bin/node -p 'require("./js/node_modules/e2b/package.json").version')
py_version=$(py/.venv/bin/python -c 'import importlib.metadata as m; print(m.version("e2b"))')
echo "install-e2b-test-deps: ok (npm e2b $js_version on node $(js/node_modules/.bin/node --version), PyPI e2b $py_version)"
