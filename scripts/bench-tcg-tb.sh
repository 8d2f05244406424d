#!/bin/bash
# TCG code buffer A/B (docs/benchmarks.md, "TCG code buffer"): two private daemons, one per `HEARTH_TCG_TB_MIB`
# (TA, default 512 = hearth's bound; TB, default 1024 = QEMU's default), run the same code-heavy workload in a
# fresh `base` sandbox (1 GiB, 2 vCPUs) alternately, twice per sandbox (first run translates, second reuses).
# Usage: cargo build -p hearthd -p hearth-cli && [TA=256] [TB=1024] [ROUNDS=3] bash scripts/bench-tcg-tb.sh
set -u
BIN=${BIN:-$(dirname "$0")/../target/debug}
WORK=${WORK:-/var/tmp/hearth-tcg-tb}
IMAGES=${HEARTH_IMAGES:-/var/lib/hearth/images}
start() { # name tb
  local d=$WORK/$1; rm -rf "$d"; mkdir -p "$d"
  HEARTH_TCG_TB_MIB=$2 nohup "$BIN/hearthd" --listen 127.0.0.1:0 --data-dir "$d" --images-dir "$IMAGES" \
    --network off --vmm qemu >"$d/log" 2>&1 &
  for _ in $(seq 100); do [ -s "$d/listen-addr" ] && break; sleep 0.3; done
}
start A "${TA:-512}"; start B "${TB:-1024}"
trap 'pkill -f "data-dir $WORK/"' EXIT
WL='python3 -c "import json,asyncio,email,http.server,xml.dom.minidom,sqlite3,decimal,unittest,argparse"; node -e "require(\"http\");require(\"crypto\").createHash(\"sha256\").update(\"x\").digest(\"hex\")"; cd /tmp && printf "fn main(){println!(\"hi\");}" > h.rs && rustc -O h.rs && ./h'
printf '%-6s %-4s %-7s %10s %10s %14s\n' round vm tb_mib first_s second_s qemu_rss_mib
for round in $(seq "${ROUNDS:-3}"); do
  for n in A B; do
    d=$WORK/$n; tb=$([ $n = A ] && echo "${TA:-512}" || echo "${TB:-1024}")
    export HEARTH_URL=http://$(cat "$d/listen-addr") HEARTH_API_KEY=$(cat "$d/api-key")
    id=$("$BIN/hearth" create --template base --memory 1024 --vcpus 2 2>/dev/null)
    t0=$(date +%s.%N); "$BIN/hearth" exec "$id" "$WL" >/dev/null 2>&1 || echo "workload failed in $n" >&2
    t1=$(date +%s.%N); "$BIN/hearth" exec "$id" "$WL" >/dev/null 2>&1; t2=$(date +%s.%N)
    pid=$(pgrep -f "qemu.*$id" | head -1)
    rss=$(awk '/^Rss/{s+=$2} END{printf "%.0f", s/1024}' "/proc/$pid/smaps_rollup" 2>/dev/null)
    printf '%-6s %-4s %-7s %10.1f %10.1f %14s\n' "$round" "$n" "$tb" "$(echo "$t1-$t0" | bc)" "$(echo "$t2-$t1" | bc)" "$rss"
    "$BIN/hearth" rm "$id" >/dev/null 2>&1
  done
done
