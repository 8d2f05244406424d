#!/usr/bin/env bash
# Runs hearth's whole test suite on a fresh Debian 12 machine (as root): installs what it needs, builds the guest
# images (cached), checks formatting and lints, then runs every test, real-VM tests included.
set -euo pipefail
cd "$(dirname "$0")/.."

# A whole-suite run builds the workspace from scratch more often than it rebuilds it: incremental compilation's
# bookkeeping only slows such a build (cargo's advice for CI). Set CARGO_INCREMENTAL=1 to keep it.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}

log() { printf '\n== %s (%s)\n' "$*" "$(date +%T)" >&2; }

log "host dependencies"
bash scripts/install-deps.sh
bash scripts/install-test-deps.sh

# Two builds run in the background from here on, beside the downloads of the E2B SDKs and the workspace's own
# builds: the guest images (the microVM kernel's compile, ~10 minutes on 2 cores on a machine that has not built
# it yet, and the root filesystems, mostly downloads; nothing before the tests needs them) and the fuzz targets
# (release, AddressSanitizer, aws-lc's C code). The fuzz build is needed last of all, so it runs at the lowest
# priority: on 2 cores it would otherwise take a third of the CPU from the images and the test build, which are
# on the way to the tests (measured: 30 minutes to the tests with the kernel's compile and all three at equal
# priority, against 27 when the images were built first). The fuzz phase finds its targets built.
mkdir -p target
# A failed step ends the script: the background builds end with it.
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
FUZZ_BUILD_ONLY=1 nice -n 19 bash scripts/fuzz.sh >target/fuzz-build.log 2>&1 &
fuzz_build=$!
log "guest images (and the KVM test host's), in the background: target/images-build.log"
bash images/build.sh --kvm-host >target/images-build.log 2>&1 &
images_build=$!

log "E2B SDKs (crates/hearth-e2b/tests)"
bash scripts/install-e2b-test-deps.sh

log "format"
cargo fmt --all -- --check

log "clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings

log "build tests"
cargo nextest run --workspace --locked --no-run

log "waiting for the guest images"
if ! wait "$images_build"; then
    cat target/images-build.log >&2
    echo "images/build.sh --kvm-host failed (above, and in target/images-build.log)" >&2
    exit 1
fi
cat target/images-build.log >&2

# From here on every phase runs to its end even when an earlier one failed; the script fails if any did.
failed=()
phase() {
    local name=$1
    shift
    log "$name"
    "$@" || failed+=("$name")
}

# Real-VM tests boot QEMU guests under TCG; nextest's config (.config/nextest.toml) bounds how many run at once.
# The KVM test host's tests (Firecracker and QEMU+KVM inside a nested VM) run afterwards, one at a time: each
# wants the whole machine.
kvm_host='binary_id(hearthd::kvm_host) | binary_id(hearth-testkit::kvm_host)'
phase "tests" cargo nextest run --workspace --locked --no-fail-fast -E "not ($kvm_host)"
phase "tests on the KVM test host (Firecracker jailed, QEMU+KVM)" \
    cargo nextest run --workspace --locked --no-fail-fast --test-threads 1 -E "$kvm_host"
# Every cargo-fuzz target (decoders of guest bytes) on a fixed number of inputs from a fixed seed, so CI is
# deterministic; longer exploratory runs: FUZZ_SECONDS=600 bash scripts/fuzz.sh.
# (A failed background build shows again here: fuzz.sh builds what is missing and reports its errors.)
wait "$fuzz_build" || echo "the background fuzz build failed (target/fuzz-build.log); building again" >&2
phase "fuzz" env FUZZ_RUNS="${FUZZ_RUNS:-50000}" bash scripts/fuzz.sh
phase "doc tests" cargo test --workspace --locked --doc -q
phase "TypeScript SDK" bash -c 'cargo build -p hearthd --locked -q && bash sdk/typescript/test.sh'

if [ "${#failed[@]}" -gt 0 ]; then
    log "failed: ${failed[*]}"
    exit 1
fi
log "all passed"
