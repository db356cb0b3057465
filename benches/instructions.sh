#!/usr/bin/env bash
# Instructions per request, counted by valgrind's callgrind: the same binary and load give
# the same count whatever else the machine is doing, so a change of a few percent shows even
# where wall-clock CPU time moves by ±20 % between runs (benches/overhead.sh).
#
#     benches/instructions.sh               # new job and replay, memory store, ~1 minute
#     STORE=embedded benches/instructions.sh
#     STORE=embedded CONNS=32 benches/instructions.sh   # group commits of many operations
#     STORE=redis benches/instructions.sh      # a redis-server of its own, on a free port
#     STORE=floor benches/instructions.sh      # examples/floor_proxy.rs's bare idempotent path
#     GATEWAY_BIN=target/pgo/release/idemgate benches/instructions.sh   # another build
#     ANSWER_HEADERS=openai benches/instructions.sh   # answers with OpenAI's twenty headers
#
# Each mode runs the gateway twice under callgrind, with a short and a long wrk load (one
# thread, 4 connections, or CONNS); the difference of the two totals over the difference of their
# request counts leaves out start-up and shutdown. Under valgrind SHA-256 runs its portable
# code (valgrind hides the CPU's SHA extensions), so hashing weighs more here than natively.
# For a per-function breakdown, build with line tables and keep the output files:
#
#     CARGO_PROFILE_RELEASE_DEBUG=line-tables-only KEEP=/tmp/ir benches/instructions.sh
#     callgrind_annotate --inclusive=yes /tmp/ir/fresh-long.out | less
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh

STORE="${STORE:-memory}"
case "$STORE" in
  memory|embedded|redis|floor) ;;
  *) echo "STORE is memory, embedded, redis or floor" >&2; exit 2 ;;
esac
SHORT="${SHORT:-2}"
LONG="${LONG:-8}"

need wrk wrk
need valgrind valgrind

cargo build -q --release --bin idemgate --example mock_provider --example floor_proxy
target_dir="${CARGO_TARGET_DIR:-target}"
gateway_bin="${GATEWAY_BIN:-$target_dir/release/idemgate}"
provider_bin="$target_dir/release/examples/mock_provider"
floor_bin="$target_dir/release/examples/floor_proxy"

keep="${KEEP:-$work}"
mkdir -p "$keep"

# BODY_FILE=<file> sends another request body (benches/overhead.sh makes a 16 KiB one).
export BODY_FILE="${BODY_FILE:-$PWD/tests/fixtures/openai-chat-request.json}"
if [[ "$STORE" == redis ]]; then
  need redis-server redis-server
  redis_port="$(free_port)"
  redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
    --daemonize no --logfile "$work/redis.log" &
  pids+=($!)
  wait_port "$redis_port"
fi

start_provider "$provider_bin"

# run MODE SECONDS OUT: one gateway under callgrind, one load; prints "requests instructions".
run() {
  local mode="$1" seconds="$2" out="$3" port gw requests
  port="$(free_port)"
  local command=("$floor_bin" "127.0.0.1:$port" "127.0.0.1:$provider_port" idempotent)
  if [[ "$STORE" != floor ]]; then
    gateway_config "$port" "$provider_port" "$(store_table "$STORE")" >"$work/gw.toml"
    command=("$gateway_bin" --config "$work/gw.toml")
  fi
  # On one core, as benches/overhead.sh pins it: the gateway then runs tokio's one-thread
  # scheduler (src/main.rs), whose instructions differ from the work-stealing one's.
  RUST_LOG=warn taskset -c "${GATEWAY_CORE:-1}" valgrind --tool=callgrind --callgrind-out-file="$out" \
    "${command[@]}" >"$work/gw.log" 2>&1 &
  gw=$!
  wait_port "$port"
  requests="$(counted_load "$mode" "$seconds" "$port")" || requests=""
  kill "$gw"
  wait "$gw" 2>/dev/null || true
  [[ -n "$requests" ]] || exit 1
  echo "$requests $(awk '/^(summary|totals):/{print $2; exit}' "$out")"
}

printf "%-22s %14s %10s\n" "$STORE store" "instr/request" "requests"
for mode in fresh fixed; do
  read -r n1 i1 < <(run "$mode" "$SHORT" "$keep/$mode-short.out")
  read -r n2 i2 < <(run "$mode" "$LONG" "$keep/$mode-long.out")
  name="new job"
  [[ "$mode" == fixed ]] && name="replay"
  awk -v name="$name" -v n="$((n2 - n1))" -v i="$((i2 - i1))" \
    'BEGIN { printf "%-22s %14.0f %10d\n", name, i / n, n }'
done
