#!/usr/bin/env bash
# What the embedded store costs as its file grows: one gateway filled at 32 clients, step by
# step, each step's new jobs a second and CPU per job (the whole process, the checkpointer
# thread, the writer thread), the file's size and the process's RSS.
#
#     benches/grow.sh                      # UUID keys, 5 steps of 40 s: ~1.5-2 million jobs
#     KEY_MODE=fresh STEPS=3 benches/grow.sh   # counted keys
#     GATEWAY_BIN=/tmp/idemgate-old benches/grow.sh   # another build, for a before-and-after
#     DB=/var/tmp/grown.db benches/grow.sh     # keep the file (a few KB a job), to time an open
#
# As in benches/overhead.sh, the gateway runs on core 1, wrk and the provider on core 0.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh

KEY_MODE="${KEY_MODE:-uuid}"
STEPS="${STEPS:-5}"
STEP_SECONDS="${STEP_SECONDS:-40}"

need wrk wrk
cargo build -q --release --bin idemgate --example mock_provider
target_dir="${CARGO_TARGET_DIR:-target}"
gateway_bin="${GATEWAY_BIN:-$target_dir/release/idemgate}"
db="${DB:-$work/grow.db}"

provider_port="$(free_port)"
taskset -c 0 "$target_dir/release/examples/mock_provider" "127.0.0.1:$provider_port" >/dev/null &
pids+=($!)
wait_port "$provider_port"
port="$(free_port)"
gateway_config "$port" "$provider_port" "$(printf 'kind = "embedded"\npath = "%s"\n' "$db")" \
  >"$work/grow.toml"
taskset -c 1 "$gateway_bin" --config "$work/grow.toml" >/dev/null 2>"$work/grow.err" &
gw=$!
pids+=($gw)
wait_port "$port"

export BODY_FILE="$PWD/tests/fixtures/openai-chat-request.json"
hz="$(getconf CLK_TCK)"
# ticks NAME: user + system clock ticks of the gateway's threads called NAME.
ticks() {
  local task total=0
  for task in /proc/"$gw"/task/*; do
    if [[ "$(cat "$task/comm" 2>/dev/null)" == "$1" ]]; then
      total=$((total + $(awk '{print $14 + $15}' "$task/stat")))
    fi
  done
  echo "$total"
}

echo "step  jobs in file  new jobs/s  CPU µs/job  checkpointer  writer  file MB  RSS MB"
jobs=0
for step in $(seq 1 "$STEPS"); do
  cpu0=$(awk '{print $14 + $15}' "/proc/$gw/stat") ckpt0=$(ticks idemgate-ckpt) writer0=$(ticks idemgate-store)
  result="$(KEY_MODE="$KEY_MODE" KEY_PREFIX="$RANDOM$RANDOM-$step" taskset -c 0 \
    wrk -t1 -c32 -d"${STEP_SECONDS}s" -s benches/wrk.lua "http://127.0.0.1:$port/v1/chat/completions" |
    grep '^RESULT')"
  cpu1=$(awk '{print $14 + $15}' "/proc/$gw/stat") ckpt1=$(ticks idemgate-ckpt) writer1=$(ticks idemgate-store)
  n="$(sed -n 's/.* requests=\([0-9]*\).*/\1/p' <<<"$result")"
  jobs=$((jobs + n))
  awk -v step="$step" -v jobs="$jobs" -v n="$n" -v hz="$hz" \
    -v rps="$(sed -n 's/.* rps=\([0-9.]*\).*/\1/p' <<<"$result")" \
    -v cpu=$((cpu1 - cpu0)) -v ckpt=$((ckpt1 - ckpt0)) -v writer=$((writer1 - writer0)) \
    -v mb="$(du -sm "$db" | cut -f1)" -v rss="$(awk '/VmRSS/{print $2}' "/proc/$gw/status")" \
    'BEGIN { us = 1e6 / hz / n
      printf "%4d  %12d  %10.0f  %10.1f  %12.1f  %6.1f  %7d  %6d\n",
        step, jobs, rps, cpu * us, ckpt * us, writer * us, mb, rss / 1024 }'
done
