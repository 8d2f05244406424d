#!/usr/bin/env bash
# Runs hearth's whole test suite on a fresh Debian 12 machine (as root): installs what it needs, builds the guest
# images (cached), checks formatting and lints, then runs every test, real-VM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s (%s)\n' "$*" "$(date +%T)" >&2; }

log "host dependencies"
bash scripts/install-deps.sh

log "guest images (and the KVM test host's root filesystem)"
bash images/build.sh --kvm-host

log "format"
cargo fmt --all -- --check

log "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "build tests"
cargo nextest run --workspace --locked --no-run

log "tests"
# Real-VM tests boot QEMU guests under TCG; nextest's config (.config/nextest.toml) bounds how many run at once.
# The KVM test host's tests (Firecracker and QEMU+KVM inside a nested VM) run afterwards, one at a time: each
# wants the whole machine. Both runs go to the end; the script fails if either failed.
kvm_host='binary_id(hearthd::kvm_host) | binary_id(hearth-testkit::kvm_host)'
status=0
cargo nextest run --workspace --locked --no-fail-fast -E "not ($kvm_host)" || status=$?
log "tests on the KVM test host (Firecracker jailed, QEMU+KVM)"
cargo nextest run --workspace --locked --no-fail-fast --test-threads 1 -E "$kvm_host" || status=$?
[ "$status" -eq 0 ] || exit "$status"
cargo test --workspace --locked --doc -q
log "TypeScript SDK"; cargo build -p hearthd --locked -q; bash sdk/typescript/test.sh
