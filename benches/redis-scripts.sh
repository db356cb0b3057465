#!/usr/bin/env bash
# Redis's own time in the Redis store's two scripts of a new job (the claim and the settle),
# and what each command inside the claim adds: the time a new job's added p50 spends inside
# Redis, which the bound of two round trips leaves out (README, Benchmarks).
#
#     benches/redis-scripts.sh            # about 20 seconds
#     CALLS=50000 benches/redis-scripts.sh
#
# A redis-server of its own on a free port and one client, calling one script at a time,
# as a gateway at one client does. The times are Redis's `usec_per_call` from INFO
# commandstats: the script's run inside the server, without the round trip. The scripts
# are read from src/store/redis/scripts.rs and called with the key and argument layout the
# store uses, on a standalone server (the store-wide indexes kept in the script), with
# records and an answer of the sizes the chat fixture makes.
set -euo pipefail
cd "$(dirname "$0")/.."
source benches/common.sh

need redis-server redis-server

port="$(free_port)"
taskset -c "${REDIS_CORE:-0}" redis-server --port "$port" --bind 127.0.0.1 --save "" \
  --appendonly no --daemonize no --logfile "$work/redis.log" &
pids+=($!)
wait_port "$port"

CALLS="${CALLS:-20000}" python3 - "$port" src/store/redis/scripts.rs <<'PY'
import os, re, socket, sys

port, source = int(sys.argv[1]), open(sys.argv[2]).read()
calls = int(os.environ["CALLS"])
scripts = dict(re.findall(r'pub\(super\) const (\w+): &str = r#"(.*?)"#;', source, re.S))

conn = socket.create_connection(("127.0.0.1", port))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
reader = conn.makefile("rb")

def command(*args):
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        arg = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    conn.sendall(b"".join(out))
    return reply()

def reply():
    line = reader.readline()
    kind, rest = line[:1], line[1:-2]
    if kind in (b"+", b":"):
        return rest
    if kind == b"-":
        raise RuntimeError(rest.decode())
    if kind == b"$":
        n = int(rest)
        return None if n < 0 else reader.read(n + 2)[:-2]
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [reply() for _ in range(n)]
    raise RuntimeError(f"unexpected reply {line!r}")

def per_call(run):
    command("CONFIG", "RESETSTAT")
    for i in range(calls):
        run(i)
    stats = command("INFO", "commandstats").decode()
    return float(re.search(r"cmdstat_evalsha:.*usec_per_call=([\d.]+)", stats).group(1))

# Sizes as the chat fixture makes them: a new job's record, the settled record (with its
# attempt) and the stored answer (status, the provider's headers, the body).
base = "idemgate:{a7}:"
record, settled, answer = b"r" * 420, b"s" * 520, b"a" * 1150
ttl, lease = 86_400_000, 1_700_000_000_000

# The lease index holds the jobs in flight: at one client one job, and its last member's
# removal deletes the key, so each claim's ZADD creates it again. A key of its own per call
# keeps that so; one index for all calls would grow to CALLS members.
def index(i, prefix):
    return f"{base}in_progress:{prefix}{i}"

def job_id(i):
    return "a7-0190f5c2-7c1e-7d3a-9b1e-%012d" % i

def claim_args(i, prefix):
    return (3, f"{base}claim:{prefix}{i:058d}", f"{base}job:{prefix}{job_id(i)}", index(i, prefix),
            job_id(i), record, ttl, base + "job:" + prefix, base + "resp:" + prefix, lease)

def script(body):
    return command("SCRIPT", "LOAD", body).decode()

claim = script(scripts["CLAIM"])
apply = script(scripts["APPLY"])
rows = []
rows.append(("claim, a new job", per_call(lambda i: command("EVALSHA", claim, *claim_args(i, "n")))))
rows.append(("settle, the job's first transition", per_call(lambda i: command(
    "EVALSHA", apply, 6, f"{base}job:n{job_id(i)}", f"{base}resp:n{job_id(i)}",
    f"{base}claim:n{i:058d}", f"{base}watch:n{job_id(i)}", base + "unknown", index(i, "n"),
    1, settled, ttl, answer, f"{base}chan:n{job_id(i)}", job_id(i), "s"))))
rows.append(("claim of a key already claimed (a duplicate)", per_call(
    lambda i: command("EVALSHA", claim, *claim_args(i, "n")))))

# The claim taken apart: each command alone, with the claim's keys and arguments.
parts = [
    ("  a script that only returns", "return {1}"),
    ("  GET of the claim", "redis.call('GET', KEYS[1]) return {1}"),
    ("  SET of the claim, with PX", "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3]) return {1}"),
    ("  HSET of the record's rev and blob",
     "redis.call('HSET', KEYS[2], 'rev', 1, 'blob', ARGV[2]) return {1}"),
    ("  PEXPIRE of the record", "redis.call('PEXPIRE', KEYS[2], ARGV[3]) return {1}"),
    ("  ZADD to the lease index", "redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1]) return {1}"),
]
for n, (name, body) in enumerate(parts):
    sha = script(body)
    rows.append((name, per_call(lambda i: command("EVALSHA", sha, *claim_args(i, f"p{n}")))))
    command("FLUSHALL")

print(f"{'Redis own time per call, one client':44} {'µs':>7}")
for name, micros in rows:
    print(f"{name:44} {micros:7.2f}")
print(f"({calls} calls each; the claim's commands alone, each in a script of its own, "
      "include the script's own cost once each)")
PY
