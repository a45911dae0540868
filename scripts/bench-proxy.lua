-- wrk script for scripts/bench-proxy: a POST of a small chat request with a bearer token, an
-- optional per-connection pause (wrk's delay() hook) that paces the load at a fixed rate, and one
-- JSON line of results at the end. Settings come from the environment:
--   BENCH_TOKEN     bearer token (the engine token directly, an API key through the gateway)
--   BENCH_STREAM    "1": ask for a streamed answer
--   BENCH_DELAY_MS  mean pause after each response on a connection (unset: closed loop, no
--                   pause); each pause is drawn from an exponential distribution, so the
--                   connections' requests arrive like a Poisson process instead of in lock-step
--                   bursts (wrk's timers tick in whole milliseconds)
--   BENCH_LABEL     the run's name in the output
local stream = os.getenv("BENCH_STREAM") == "1"
wrk.method = "POST"
wrk.path = "/v1/chat/completions"
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer " .. (os.getenv("BENCH_TOKEN") or "")
wrk.body = '{"model":"smollm2-135m-instruct","messages":['
  .. '{"role":"system","content":"You are a helpful assistant. Answer briefly."},'
  .. '{"role":"user","content":"Say hello to the benchmark."}],'
  .. '"max_tokens":16' .. (stream and ',"stream":true' or '') .. '}'

local pause = tonumber(os.getenv("BENCH_DELAY_MS") or "")
if pause then
  function init(args)
    math.randomseed(os.time() + math.floor(os.clock() * 1e6))
  end
  function delay()
    return math.floor(-math.log(1 - math.random()) * pause + 0.5)
  end
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"label":"%s","requests":%d,"duration_us":%d,"rps":%.1f,"non2xx":%d,"socket_errors":%d,'
      .. '"p50_us":%d,"p90_us":%d,"p99_us":%d,"p999_us":%d,"max_us":%d,"mean_us":%.1f}\n',
    os.getenv("BENCH_LABEL") or "", summary.requests, summary.duration,
    summary.requests / (summary.duration / 1e6), e.status,
    e.connect + e.read + e.write + e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max, latency.mean))
end
