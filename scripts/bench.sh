#!/usr/bin/env bash
# Builds hearth in release mode and runs the benchmark against a private daemon (temporary data dir).
# Extra arguments go to hearth-bench (e.g. --creates 10 --template debian). Prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p hearthd -p hearth-cli -p hearth-bench >&2
exec target/release/hearth-bench "$@"
