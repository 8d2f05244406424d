#!/usr/bin/env bash
# Builds every cargo-fuzz target of the workspace (each crates/*/fuzz folder, a workspace of its own) and runs
# each for a bounded time, failing loudly on the first crash, with the reproducer's path and the command that
# replays it.
#
# Only the stable toolchain is needed: RUSTC_BOOTSTRAP=1 lets cargo-fuzz pass its -Z flags to the stable
# compiler, whose x86_64 Linux build ships the AddressSanitizer runtime. cargo-fuzz itself is installed from
# crates.io when missing. Targets are built in release mode with debug assertions (integer overflow panics).
#
# Environment:
#   FUZZ_SECONDS    seconds each target runs (default 60)
#   FUZZ_RUNS       instead of a time, this many inputs per target from a fixed seed (FUZZ_SEED, default 1):
#                   the same commit always explores the same inputs, so a CI run cannot fail by chance on a
#                   commit that passed before (a longer exploratory run is FUZZ_SECONDS without FUZZ_RUNS)
#   FUZZ_TARGETS    only these targets (space separated names, e.g. "sniff http_framer")
#   FUZZ_SANITIZER  address (default) or none
#   FUZZ_CODEGEN_UNITS codegen units of the fuzz builds (default 16; cargo-fuzz's own default is 1)
#   FUZZ_CORPUS     folder that keeps the corpora between runs (default: a temporary one, removed afterwards)
#   FUZZ_BUILD_ONLY 1: build every target and stop (scripts/test.sh builds them in the background while the
#                   guest images are made, and the fuzz phase then finds them built)
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${FUZZ_SECONDS:-60}
runs=${FUZZ_RUNS:-}
seed=${FUZZ_SEED:-1}
if [ -n "$runs" ]; then
  bound=(-runs="$runs" -seed="$seed")
  what="$runs inputs from seed $seed"
else
  bound=(-max_total_time="$seconds")
  what="${seconds}s"
fi
sanitizer=${FUZZ_SANITIZER:-address}
# cargo-fuzz compiles release builds as one codegen unit by default, so each crate's code generation runs on
# one core (hearth-mount's target alone took 8 of the 12 minutes of the fuzz build in a CI run); 16 units let it
# use both and optimise less across units, at a small cost in inputs per second that CI's fixed input count
# does not feel (cargo-fuzz's own advice for faster builds).
codegen_units=${FUZZ_CODEGEN_UNITS:-16}
only=${FUZZ_TARGETS:-}
export RUSTC_BOOTSTRAP=1
export CARGO_TERM_COLOR=never

log() { printf '\n== fuzz: %s (%s)\n' "$*" "$(date +%T)" >&2; }

if ! cargo fuzz --version >/dev/null 2>&1; then
  log "installing cargo-fuzz"
  cargo install cargo-fuzz --locked --version 0.13.2
fi

corpus_root=${FUZZ_CORPUS:-}
if [ -z "$corpus_root" ]; then
  corpus_root=$(mktemp -d)
  trap 'rm -rf "$corpus_root"' EXIT
fi

# One target folder for every fuzz workspace: they share their dependencies' builds (libFuzzer itself above all).
target_dir="$(pwd)/target/fuzz"
# The same flags for build and run: cargo fuzz run rebuilds a target built with other ones.
flags=(-O -a --sanitizer "$sanitizer" --codegen-units "$codegen_units" --target-dir "$target_dir")

summary=()
for dir in crates/*/fuzz; do
  [ -f "$dir/Cargo.toml" ] || continue
  crate=$(basename "$(dirname "$dir")")
  log "build $crate"
  (cd "$dir" && cargo fuzz build "${flags[@]}")
  [ "${FUZZ_BUILD_ONLY:-}" = 1 ] && continue
  for target in $(cd "$dir" && cargo fuzz list); do
    if [ -n "$only" ] && ! [[ " $only " == *" $target "* ]]; then continue; fi
    corpus="$corpus_root/$crate/$target"
    mkdir -p "$corpus"
    seeds=()
    [ -d "$dir/seeds/$target" ] && seeds+=("$(pwd)/$dir/seeds/$target")
    out=$(mktemp)
    log "run $crate/$target for $what"
    if (cd "$dir" && cargo fuzz run "${flags[@]}" "$target" "$corpus" "${seeds[@]}" -- \
          "${bound[@]}" -timeout=10 -print_final_stats=1) >"$out" 2>&1; then
      runs=$(grep -Eo 'stat::number_of_executed_units: *[0-9]+' "$out" | grep -Eo '[0-9]+$' || echo '?')
      summary+=("$crate/$target: ok, $runs runs")
      rm -f "$out"
    else
      echo "FUZZ FAILURE: $crate/$target" >&2
      grep -E -A4 "panicked at|ERROR: (AddressSanitizer|LeakSanitizer|libFuzzer)" "$out" | head -n 30 >&2 || true
      echo "--- last lines of the fuzzer's output ---" >&2
      tail -n 30 "$out" >&2
      artifact=$(grep -Eo 'Test unit written to [^ ]+' "$out" | tail -n 1 | sed 's/^Test unit written to //' || true)
      if [ -n "$artifact" ]; then
        case "$artifact" in /*) ;; *) artifact="$(pwd)/$dir/$artifact" ;; esac
        echo "reproducer: $artifact" >&2
        echo "replay:     (cd $dir && RUSTC_BOOTSTRAP=1 cargo fuzz run ${flags[*]} $target $artifact)" >&2
      else
        echo "no reproducer was written; full output: $out" >&2
      fi
      exit 1
    fi
  done
done
log "done"
printf '%s\n' "${summary[@]}" >&2
