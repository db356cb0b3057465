-- wrk script for benches/overhead.sh: POSTs the chat fixture; a fresh Idempotency-Key per
-- request unless KEY_MODE is "fixed" (a replay) or "none" (no key: nginx, the provider).
-- "fresh" keys count up from a prefix; "uuid" keys are random UUIDs, as SDKs send them,
-- which land all over a store's key index where counted ones stay together.
local body_file = os.getenv("BODY_FILE")
local f = assert(io.open(body_file, "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer sk-bench"

local mode = os.getenv("KEY_MODE") or "fresh"
local prefix = os.getenv("KEY_PREFIX") or tostring(os.time())
local counter = 0
math.randomseed(tonumber(tostring(prefix):match("%d+") or "0") + os.time())

if mode == "fixed" then
  wrk.headers["Idempotency-Key"] = prefix .. "-replay"
end

local function uuid()
  return string.format("%08x-%04x-4%03x-%04x-%012x", math.random(0, 0xffffffff),
    math.random(0, 0xffff), math.random(0, 0xfff), math.random(0x8000, 0xbfff),
    math.random(0, 0xffffffff) * 0x10000 + math.random(0, 0xffff))
end

request = function()
  if mode == "uuid" then
    wrk.headers["Idempotency-Key"] = uuid()
  elseif mode == "fresh" then
    counter = counter + 1
    wrk.headers["Idempotency-Key"] = prefix .. "-" .. counter
  end
  return wrk.format()
end

done = function(summary, latency, requests)
  local errors = summary.errors
  local bad = errors.connect + errors.read + errors.write + errors.timeout + errors.status
  io.write(string.format("RESULT requests=%d errors=%d rps=%.1f p50=%d p99=%d\n",
    summary.requests, bad, summary.requests / (summary.duration / 1e6),
    latency:percentile(50), latency:percentile(99)))
end
