-- wrk script for benches/overhead.sh: POSTs the chat fixture; a fresh Idempotency-Key per
-- request unless KEY_MODE is "fixed" (a replay) or "none" (no key: nginx, the provider).
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

if mode == "fixed" then
  wrk.headers["Idempotency-Key"] = prefix .. "-replay"
end

request = function()
  if mode == "fresh" then
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
