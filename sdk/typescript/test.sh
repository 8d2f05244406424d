#!/usr/bin/env bash
# Installs the locked dependencies, builds the SDK and runs its tests against a real daemon and real VMs.
# Needs target/debug/hearthd (`cargo build -p hearthd`, or HEARTHD_BIN) and the guest images (images/build.sh).
set -euo pipefail
cd "$(dirname "$0")"
npm ci --no-audit --no-fund
npm run build
npm test
