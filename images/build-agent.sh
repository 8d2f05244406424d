#!/usr/bin/env bash
# images/build-agent.sh: build hearth-agent as a fully static binary (glibc, crt-static) and print its path
# on the last line of stdout (everything else goes to stderr).
#
# The agent does no NSS lookups (no getpwnam, getaddrinfo, ...), so a static glibc build is safe.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TARGET=x86_64-unknown-linux-gnu
cd "$ROOT"

RUSTFLAGS="${RUSTFLAGS:-} -C target-feature=+crt-static -C strip=debuginfo" \
    cargo build --release --target "$TARGET" -p hearth-agent >&2

TARGET_DIR=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
BIN="${TARGET_DIR:-$ROOT/target}/$TARGET/release/hearth-agent"
[ -x "$BIN" ] || { echo "build-agent: $BIN was not produced" >&2; exit 1; }

# Refuse a dynamically linked result: the guest has no loader in /run.
if command -v file >/dev/null 2>&1; then
    desc=$(file -b "$BIN")
    case "$desc" in
        *"dynamically linked"*|*"interpreter"*) echo "build-agent: not static: $desc" >&2; exit 1 ;;
    esac
fi
if command -v ldd >/dev/null 2>&1; then
    libs=$(ldd "$BIN" 2>&1 || true)
    case "$libs" in
        *"statically linked"*|*"not a dynamic executable"*) ;;
        *) echo "build-agent: $BIN needs shared libraries:" >&2; echo "$libs" >&2; exit 1 ;;
    esac
fi
echo "$BIN"
