#!/usr/bin/env bash
# Runs hearth's whole test suite on a fresh Debian 12 machine (as root): installs what it needs, builds the guest
# images (cached), checks formatting and lints, then runs every test, real-VM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s (%s)\n' "$*" "$(date +%T)" >&2; }

log "host dependencies"
bash scripts/install-deps.sh
bash scripts/install-test-deps.sh

log "E2B SDKs (crates/hearth-e2b/tests)"
bash scripts/install-e2b-test-deps.sh

log "guest images"
bash images/build.sh

log "format"
cargo fmt --all -- --check

log "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "build tests"
cargo nextest run --workspace --locked --no-run

log "tests"
# Real-VM tests boot QEMU guests under TCG; nextest's config (.config/nextest.toml) bounds how many run at once.
cargo nextest run --workspace --locked --no-fail-fast
log "fuzz"
# Every cargo-fuzz target (decoders of guest bytes) on a fixed number of inputs from a fixed seed, so CI is
# deterministic; longer exploratory runs: FUZZ_SECONDS=600 bash scripts/fuzz.sh.
FUZZ_RUNS=${FUZZ_RUNS:-300000} bash scripts/fuzz.sh
cargo test --workspace --locked --doc -q
log "TypeScript SDK"; cargo build -p hearthd --locked -q; bash sdk/typescript/test.sh
