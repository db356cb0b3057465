#!/usr/bin/env bash
# Heap blocks allocated per request, counted by valgrind's DHAT, and where the gateway's own
# code asks for them. Like instructions.sh it counts rather than times: the same build and
# load give the same count on any host, however noisy, and an allocation costs beyond its
# instructions (a block of a size class touched for the first time, a free on another task).
#
#     benches/allocations.sh                # new job and replay, memory store, ~8 minutes
#     TOP=40 benches/allocations.sh         # more sites
#     STORE=embedded benches/allocations.sh
#
# DHAT sees only malloc and free, so the gateway is built with the `system-allocator`
# feature (glibc's malloc instead of mimalloc: the same requests allocate the same blocks)
# in a target directory of its own, without LTO and with line tables, so that its call
# stacks name files and lines. Each mode runs the gateway twice under DHAT, with a short and
# a long wrk load; the difference of the two totals over the difference of their request
# counts leaves out start-up and shutdown. The sites are the long run's, per request of it:
# for each, the innermost named frame and the project's own frame that led to it.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh

STORE="${STORE:-memory}"
case "$STORE" in
  memory|embedded) ;;
  *) echo "STORE is memory or embedded" >&2; exit 2 ;;
esac
SHORT="${SHORT:-2}"
LONG="${LONG:-6}"
TOP="${TOP:-25}"

need wrk wrk
need valgrind valgrind

target_dir="${ALLOC_TARGET_DIR:-target/allocations}"
CARGO_TARGET_DIR="$target_dir" CARGO_PROFILE_RELEASE_LTO=false \
  CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
  cargo build -q --release --features system-allocator --bin idemgate --example mock_provider
gateway_bin="$target_dir/release/idemgate"
provider_bin="$target_dir/release/examples/mock_provider"

export BODY_FILE="${BODY_FILE:-$PWD/tests/fixtures/openai-chat-request.json}"

start_provider "$provider_bin"

# run MODE SECONDS OUT: one gateway under DHAT, one load; prints "requests blocks".
run() {
  local mode="$1" seconds="$2" out="$3" port gw requests
  port="$(free_port)"
  gateway_config "$port" "$provider_port" "$(store_table "$STORE")" >"$work/gw.toml"
  RUST_LOG=warn taskset -c "${GATEWAY_CORE:-1}" valgrind --tool=dhat --dhat-out-file="$out" \
    "$gateway_bin" --config "$work/gw.toml" >"$work/gw.log" 2>&1 &
  gw=$!
  wait_port "$port"
  requests="$(counted_load "$mode" "$seconds" "$port")" || requests=""
  # SIGINT: the gateway stops as it does on Ctrl-C, and DHAT writes its file at exit.
  kill -INT "$gw"
  wait "$gw" 2>/dev/null || true
  [[ -n "$requests" ]] || exit 1
  echo "$requests $(sed -n 's/.*Total: .* in \([0-9,]*\) blocks.*/\1/p' "$work/gw.log" | tr -d ,)"
}

for mode in fresh fixed; do
  name="new job"
  [[ "$mode" == fixed ]] && name="replay"
  read -r n1 b1 < <(run "$mode" "$SHORT" "$work/$mode-short.json")
  read -r n2 b2 < <(run "$mode" "$LONG" "$work/$mode-long.json")
  awk -v name="$name" -v n="$((n2 - n1))" -v b="$((b2 - b1))" -v store="$STORE" \
    'BEGIN { printf "%s, %s store: %.1f blocks allocated per request (%d requests)\n", name, store, b / n, n }'
  python3 - "$work/$mode-long.json" "$n2" "$TOP" <<'PY'
import json, re, sys
from collections import Counter

data = json.load(open(sys.argv[1]))
requests, top = int(sys.argv[2]), int(sys.argv[3])
frames = data["ftbl"]
# "0x4A3B2C: function (file:line)"; frames of the allocator, of std and of valgrind's
# preload say nothing about who asked.
pattern = re.compile(r"0x[0-9A-F]+: (.*) \((.*)\)$")
generic = re.compile(r"^[A-Za-z_]+(<.*>)?$")

def named(index):
    match = pattern.match(frames[index])
    if not match:
        return None
    function, place = match.groups()
    if place.startswith(("library/", "in /")) or generic.match(function):
        return None
    return f"{function[:70]} ({place})"

sites = Counter()
for point in data["pps"]:
    inner = next(filter(None, map(named, point["fs"])), "?")
    own = next((f for f in map(named, point["fs"]) if f and "idemgate::" in f), "")
    sites[inner if inner == own or not own else f"{inner}\n        from {own}"] += point["tbk"]
print(f"  where (the long run's blocks per request, start-up included; sites of {top}):")
for site, blocks in sites.most_common(top):
    print(f"  {blocks / requests:6.2f}  {site}")
PY
done
