-- wrk script: POST the JSON file named by $BENCH_BODY (a ~1 KB chat request) on every request,
-- and print one machine-readable summary line ("WRKJSON {...}") for bench/run.sh.
-- Non-2xx answers are counted as errors: a proxy answering 503 fast must not look fast.
local path = os.getenv("BENCH_BODY") or "bench/chat_1k.json"
local f = assert(io.open(path, "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
wrk.headers["Content-Type"] = "application/json"

function done(summary, latency, requests)
   local e = summary.errors
   local sec = summary.duration / 1e6
   io.write(string.format(
      'WRKJSON {"requests":%d,"seconds":%.3f,"rps":%.1f,"p50_us":%d,"p90_us":%d,' ..
      '"p99_us":%d,"max_us":%d,"connect_errors":%d,"read_errors":%d,"write_errors":%d,' ..
      '"timeouts":%d,"non2xx":%d}\n',
      summary.requests, sec, summary.requests / sec,
      latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
      e.connect, e.read, e.write, e.timeout, e.status))
end
