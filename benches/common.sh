# Shell helpers of the process benches (overhead.sh, instructions.sh), sourced by them.
# Sets $work (a temporary directory, removed on exit) and kills every pid put in $pids.

# need COMMAND PACKAGE: installs Debian's PACKAGE when COMMAND is missing.
need() {
  command -v "$1" >/dev/null && return
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$2" >/dev/null
}

work="$(mktemp -d)"
pids=()
halt_poll=/sys/module/haltpoll/parameters/guest_halt_poll_ns
halt_poll_before=""
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [[ -n "$halt_poll_before" ]]; then echo "$halt_poll_before" >"$halt_poll"; fi
  rm -rf "$work"
}
trap cleanup EXIT

# A KVM guest's idle loop (cpuidle-haltpoll): with guest_halt_poll_ns at 0 an idle core halts
# at once, and waking it takes the host's interrupt, which at one client is most of a
# request's cost for any proxy (README, Benchmarks). HALT_POLL_NS=<ns> sets it for the run
# and puts the old value back at the end; either way the run says what it was. The setting
# acts only while haltpoll is the cpuidle driver: a guest whose driver is `none` (seen on
# guests that load the module but whose kernel idles with `hlt` itself) halts at once
# whatever the parameter says.
cpuidle_driver="$(cat /sys/devices/system/cpu/cpuidle/current_driver 2>/dev/null || echo none)"
halt_poll_setting() {
  if [[ "$cpuidle_driver" != haltpoll ]]; then
    echo "none: cpuidle driver $cpuidle_driver, idle cores halt at once"
  elif [[ -r "$halt_poll" ]]; then
    echo "$(cat "$halt_poll") ns (cpuidle driver haltpoll)"
  else
    echo "none (no cpuidle-haltpoll)"
  fi
}
if [[ -n "${HALT_POLL_NS:-}" ]]; then
  if [[ "$cpuidle_driver" != haltpoll || ! -w "$halt_poll" ]]; then
    echo "HALT_POLL_NS needs the cpuidle-haltpoll driver (here: $cpuidle_driver) and root to write $halt_poll" >&2
    exit 2
  fi
  halt_poll_before="$(cat "$halt_poll")"
  echo "$HALT_POLL_NS" >"$halt_poll"
fi

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# wait_port PORT: until something listens there (20 s at most; valgrind starts slowly).
wait_port() {
  for _ in $(seq 1 400); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "nothing listens on $1" >&2
  return 1
}

# gateway_config PORT PROVIDER_PORT STORE_TABLE: a gateway on PORT in front of the provider,
# with the [store] table's lines given, one keyed route for /v1.
gateway_config() {
  cat <<CONF
[server]
listen = "127.0.0.1:$1"
[store]
$3
[[providers]]
name = "p"
base_url = "http://127.0.0.1:$2"
[[routes]]
name = "chat"
path_prefix = "/v1"
providers = ["p"]
CONF
}

# start_provider BIN: the mock provider (examples/mock_provider.rs) on a free port, left in
# $provider_port.
start_provider() {
  provider_port="$(free_port)"
  "$1" "127.0.0.1:$provider_port" >/dev/null &
  pids+=($!)
  wait_port "$provider_port"
}

# store_table STORE: the [store] table's lines of a gateway on STORE: memory, embedded (a
# file in $work) or redis (the redis-server at $redis_port, a key prefix of its own).
store_table() {
  case "$1" in
    memory) echo 'kind = "memory"' ;;
    embedded) printf 'kind = "embedded"\npath = "%s"\n' "$work/store-$RANDOM.db" ;;
    redis) printf 'kind = "redis"\nurl = "redis://127.0.0.1:%s"\nkey_prefix = "s%s"\n' \
      "$redis_port" "$RANDOM" ;;
    *) echo "no store $1" >&2; return 2 ;;
  esac
}

# counted_load MODE SECONDS PORT: the load of the counting benches (instructions.sh,
# allocations.sh) on the chat route at PORT, one wrk thread and CONNS (4) connections, fresh
# or fixed keys; prints how many requests it made, or fails when any of them failed.
counted_load() {
  local result errors
  result="$(KEY_MODE="$1" KEY_PREFIX="c$RANDOM$RANDOM" wrk -t1 -c"${CONNS:-4}" -d"$2s" \
    -s benches/wrk.lua "http://127.0.0.1:$3/v1/chat/completions" | grep '^RESULT')"
  errors="$(sed -n 's/.* errors=\([0-9]*\).*/\1/p' <<<"$result")"
  if [[ "$errors" != 0 ]]; then
    echo "$errors requests failed: $result" >&2
    return 1
  fi
  sed -n 's/.* requests=\([0-9]*\).*/\1/p' <<<"$result"
}
