#!/usr/bin/env bash
# A profile-guided (PGO) release build of the gateway, for production and for the benches.
#
#     scripts/pgo-build.sh      # about 15 minutes on 2 cores; prints the binary's path
#
# Builds the gateway instrumented, runs it under a training load (new jobs, replays and
# streams, at 32 clients and at one, on the memory, embedded and Redis stores, against
# examples/mock_provider.rs), then builds it again with the profile it wrote: the compiler
# lays out hot code together and inlines along the paths requests take; code the training
# never ran (the PostgreSQL store, failover) is compiled as cold, correct but not tuned.
# The binary lands in `$CARGO_TARGET_DIR/pgo/release/idemgate` (`target/` by default).
# Needs wrk and redis-server (installed from Debian's packages when missing; the Redis
# training uses a server of its own on a free port) and the toolchain's own llvm-profdata
# (`rustup component add llvm-tools`, done here when missing: a distribution's
# llvm-profdata is usually of another LLVM version than rustc's, whose profile format rustc
# refuses).
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh

need wrk wrk
need redis-server redis-server
host="$(rustc -vV | sed -n 's/^host: //p')"
profdata="$(rustc --print sysroot)/lib/rustlib/$host/bin/llvm-profdata"
if [[ ! -x "$profdata" ]]; then
  rustup component add llvm-tools
fi

target_dir="${CARGO_TARGET_DIR:-target}"
# A fixed path, so that the instrumented build is reused by the next run. The merged profile
# is not: a new path each run changes the flags of the final build, so it is always rebuilt
# with the profile just written.
profiles="$(realpath -m "$target_dir")/pgo-generate/profiles"
merged="$work/idemgate.profdata"

echo "building the load's far end and the instrumented gateway" >&2
cargo build -q --release --example mock_provider
RUSTFLAGS="-Cprofile-generate=$profiles" \
  cargo build -q --release --bin idemgate --target-dir "$target_dir/pgo-generate"
# Build scripts compiled with the flag wrote profiles of their own while the build ran.
rm -rf "$profiles"

provider_port="$(free_port)"
"$target_dir/release/examples/mock_provider" "127.0.0.1:$provider_port" >/dev/null &
pids+=($!)
wait_port "$provider_port"

chat="$PWD/tests/fixtures/openai-chat-request.json"
stream="$work/chat-stream.json"
python3 - "$chat" "$stream" <<'PY'
import json, sys
body = json.load(open(sys.argv[1]))
body["stream"] = True
json.dump(body, open(sys.argv[2], "w"))
PY

# load URL BODY KEY_MODE CONNECTIONS SECONDS: fails unless every request was answered with
# a success, so that a profile is never trained on a gateway that was refusing requests.
load() {
  local result
  result="$(BODY_FILE="$2" KEY_MODE="$3" KEY_PREFIX="$RANDOM$RANDOM" \
    wrk -t1 -c"$4" -d"$5s" -s benches/wrk.lua "$1" | grep '^RESULT')"
  echo "$result" >&2
  if [[ "$result" != *" errors=0 "* ]]; then
    echo "the training load met errors (failed connections or answers other than 2xx)" >&2
    return 1
  fi
}

redis_port="$(free_port)"
redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
  --daemonize no --logfile "$work/redis.log" &
pids+=($!)
wait_port "$redis_port"

for store in memory embedded redis; do
  case "$store" in
    memory) table='kind = "memory"' ;;
    embedded) table="$(printf 'kind = "embedded"\npath = "%s"' "$work/train.db")" ;;
    redis) table="$(printf 'kind = "redis"\nurl = "redis://127.0.0.1:%s"' "$redis_port")" ;;
  esac
  port="$(free_port)"
  gateway_config "$port" "$provider_port" "$table" >"$work/$store.toml"
  echo "training on the $store store" >&2
  RUST_LOG=warn "$target_dir/pgo-generate/release/idemgate" --config "$work/$store.toml" \
    >"$work/$store.log" 2>&1 &
  gw=$!
  wait_port "$port"
  url="http://127.0.0.1:$port/v1/chat/completions"
  load "$url" "$chat" fresh 32 4
  load "$url" "$chat" fixed 32 3
  load "$url" "$chat" fresh 1 2
  load "$url" "$stream" fresh 32 2
  load "$url" "$stream" fixed 32 1
  # The profile is written when the process exits, so it must end by itself: SIGTERM is a
  # graceful shutdown.
  kill -TERM "$gw"
  wait "$gw" || true
done

"$profdata" merge -o "$merged" "$profiles"
echo "building the gateway with the profile" >&2
RUSTFLAGS="-Cprofile-use=$merged" \
  cargo build -q --release --bin idemgate --target-dir "$target_dir/pgo"
echo "$target_dir/pgo/release/idemgate"
