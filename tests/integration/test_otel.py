#!/usr/bin/env python3
"""OpenTelemetry export (docs/operations.md §7) against a small OTLP/HTTP JSON receiver written for
this test: one span per inference request with the GenAI semantic conventions and detproxy's
own attributes, W3C traceparent propagated to the replica (the client's trace id kept), parent-
based and ratio sampling, and a collector that hangs costing requests nothing: spans are dropped
and counted instead."""

import http.client
import http.server
import json
import threading
import time

from harness import get_json, poll_until, post_json, run_tests, sse, start_sim
from proxyutil import metric, pool, start_proxy

POLICY = {"tenants": [{"name": "t1", "match": {"any": True},
                       "sampling": {"temperature": {"force": 0}, "seed": {"force": 42},
                                    "max_tokens": {"max": 9}}}]}


class Receiver:
    """POST /v1/traces: keeps every span (with its resource) it receives. hang=True: accept and
    never answer (a stuck collector)."""

    def __init__(self, hang=False):
        self.spans, self.posts, self.hang = [], 0, hang
        self.lock = threading.Lock()
        self.release = threading.Event()
        rec = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("content-length", 0))
                try:
                    body = json.loads(self.rfile.read(n))
                except ConnectionError:
                    return  # detproxy gave up on a stuck export (hang=True)
                assert self.path == "/v1/traces", self.path
                assert self.headers["content-type"] == "application/json"
                with rec.lock:
                    rec.posts += 1
                    for rs in body["resourceSpans"]:
                        res = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
                        for ss in rs["scopeSpans"]:
                            for sp in ss["spans"]:
                                sp["_resource"] = res
                                rec.spans.append(sp)
                if rec.hang:
                    rec.release.wait(30)
                    return
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def stop(self):
        self.release.set()
        self.srv.shutdown()


def attrs(span):
    out = {}
    for a in span["attributes"]:
        v = a["value"]
        if "arrayValue" in v:
            out[a["key"]] = [x["stringValue"] for x in v["arrayValue"].get("values", [])]
        else:
            (k, x), = v.items()
            out[a["key"]] = int(x) if k == "intValue" else x
    return out


def setup(sample_rate=1.0, hang=False, **kw):
    rec = Receiver(hang=hang)
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim],
                                 manifest={"framework": {"name": "vllm", "version": "0.6.3"}})],
                     policy=POLICY, otel={"endpoint": "http://127.0.0.1:%d" % rec.port,
                                          "sample_rate": sample_rate}, **kw)
    return rec, sim, px


def span_for(rec, request_id):
    def find():
        with rec.lock:
            for s in rec.spans:
                if attrs(s).get("detproxy.request_id") == request_id:
                    return s
        return None
    return poll_until(find, timeout=10, what="span of request %s" % request_id)


def last_headers(sim):
    return {k.lower(): v for k, v in get_json(sim.port, "/_sim/last_request")["headers"].items()}


def test_chat_span_has_genai_attributes_and_a_new_trace():
    rec, sim, px = setup()
    r = post_json(px.port, "/v1/chat/completions",
                  {"model": "m1", "messages": [{"role": "user", "content": "hi"}],
                   "temperature": 0.8, "top_p": 0.5, "max_tokens": 50})
    assert r.status == 200, r
    rid = r.headers["x-detproxy-request-id"]
    s = span_for(rec, rid)
    a = attrs(s)
    body = r.json()
    assert s["name"] == "chat m1" and s["kind"] == 2, s
    assert s["_resource"]["service.name"] == {"stringValue": "detproxy"}
    assert int(s["endTimeUnixNano"]) >= int(s["startTimeUnixNano"]) > 0
    want = {"gen_ai.operation.name": "chat", "gen_ai.system": "vllm",
            "gen_ai.request.model": "m1", "gen_ai.request.temperature": 0,
            "gen_ai.request.seed": 42, "gen_ai.request.top_p": 0.5,
            "gen_ai.request.max_tokens": 9, "gen_ai.response.model": "m1",
            "gen_ai.response.id": body["id"], "gen_ai.response.finish_reasons": ["length"],
            "openai.response.system_fingerprint": r.headers["x-detproxy-fingerprint"],
            "gen_ai.usage.input_tokens": body["usage"]["prompt_tokens"],
            "gen_ai.usage.output_tokens": 9, "http.response.status_code": 200,
            "http.route": "/v1/chat/completions", "detproxy.tenant": "t1",
            "detproxy.pool": "p", "detproxy.replica": "r1", "detproxy.shadow": "none"}
    for k, v in want.items():
        assert a.get(k) == v, (k, a.get(k), v)
    assert {"temperature=forced", "seed=forced", "max_tokens=clamped"} <= set(
        a["detproxy.policy.overrides"]), a["detproxy.policy.overrides"]
    # Propagated: the replica's parent is this span, in this span's trace.
    tp = last_headers(sim)["traceparent"]
    assert tp == "00-%s-%s-01" % (s["traceId"], s["spanId"]), (tp, s)
    assert "parentSpanId" not in s
    # Counted when the collector's answer is back at the proxy, a moment after it has the span.
    poll_until(lambda: (metric(px, "detproxy_otel_spans_total", result="exported") or 0) >= 1,
               what="the export counted")
    px.stop()
    rec.stop()


def test_client_trace_is_kept_and_unsampled_passes_through():
    rec, sim, px = setup(sample_rate=0.0)
    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {"model": "m1", "prompt": "x", "max_tokens": 3}
    # sample_rate 0 and no traceparent: no span, nothing propagated.
    r = post_json(px.port, "/v1/completions", body)
    assert r.status == 200 and "traceparent" not in last_headers(sim)
    # The caller's unsampled trace: passed through unchanged, no span.
    unsampled = "00-%s-%s-00" % (trace, parent)
    r = post_json(px.port, "/v1/completions", body, headers={"traceparent": unsampled})
    assert last_headers(sim)["traceparent"] == unsampled
    # The caller's sampled trace: exported whatever the rate, same trace id, caller as parent.
    r = post_json(px.port, "/v1/completions", body,
                  headers={"traceparent": "00-%s-%s-01" % (trace, parent),
                           "tracestate": "vendor=1"})
    s = span_for(rec, r.headers["x-detproxy-request-id"])
    assert s["traceId"] == trace and s["parentSpanId"] == parent and s["spanId"] != parent, s
    assert s["name"] == "text_completion m1"
    h = last_headers(sim)
    assert h["traceparent"] == "00-%s-%s-01" % (trace, s["spanId"]) and h["tracestate"] == "vendor=1"
    # An invalid header is ignored (treated as absent: rate 0, so no span, passed unchanged).
    for bad in ("00-%s-%s-01" % ("0" * 32, parent), "00-%s-%s-01x" % (trace, parent),
                "00-%s-%s-01" % (trace.upper(), parent), "ff-%s-%s-01" % (trace, parent)):
        post_json(px.port, "/v1/completions", body, headers={"traceparent": bad})
        assert last_headers(sim)["traceparent"] == bad
    time.sleep(1.5)  # one flush interval: nothing else may have been exported
    with rec.lock:
        assert len(rec.spans) == 1, [attrs(x).get("detproxy.request_id") for x in rec.spans]
    px.stop()
    rec.stop()


def test_a_new_trace_drops_the_callers_context():
    """W3C trace context: an invalid traceparent, or two of them, starts a new trace, and the
    caller's tracestate (which belongs to the trace not continued) is not sent with it."""
    rec, sim, px = setup()
    trace, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = json.dumps({"model": "m1", "prompt": "x", "max_tokens": 3})
    cases = [[("traceparent", "00-%s-%s-01" % ("0" * 32, parent)), ("tracestate", "v=1")],
             [("traceparent", "00-%s-%s-0A" % (trace, parent)), ("tracestate", "v=1")],
             [("tracestate", "v=1")],
             [("traceparent", "00-%s-%s-01" % (trace, parent)),
              ("traceparent", "00-%s-%s-01" % (trace[::-1], parent))]]
    for hdrs in cases:
        conn = http.client.HTTPConnection("127.0.0.1", px.port, timeout=10)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(len(body)))
        for k, v in hdrs:
            conn.putheader(k, v)
        conn.endheaders(body.encode())
        r = conn.getresponse()
        r.read()
        conn.close()
        assert r.status == 200, (hdrs, r.status)
        s = span_for(rec, r.getheader("x-detproxy-request-id"))
        assert "parentSpanId" not in s and s["traceId"] not in (trace, trace[::-1]), (hdrs, s)
        h = last_headers(sim)
        assert h["traceparent"] == "00-%s-%s-01" % (s["traceId"], s["spanId"]), (hdrs, h)
        assert "tracestate" not in h, (hdrs, h)
    px.stop()
    rec.stop()


def test_stream_and_responses_spans():
    rec, sim, px = setup()
    heads = {}
    for _ in sse(px.port, "/v1/chat/completions",
                 {"model": "m1", "messages": [{"role": "user", "content": "s"}], "stream": True,
                  "stream_options": {"include_usage": True}},
                 on_open=lambda r: heads.update(r.getheaders())):
        pass
    a = attrs(span_for(rec, heads["x-detproxy-request-id"]))
    assert a["gen_ai.response.finish_reasons"] == ["length"], a
    assert a["gen_ai.usage.output_tokens"] == 9 and a["gen_ai.response.id"].startswith("chat-")
    # This replica's chunks carry no system_fingerprint, so the client saw none: no attribute.
    assert "openai.response.system_fingerprint" not in a, a
    r = post_json(px.port, "/v1/responses", {"model": "m1", "input": "r", "max_output_tokens": 4})
    a = attrs(span_for(rec, r.headers["x-detproxy-request-id"]))
    assert a["http.route"] == "/v1/responses" and a["gen_ai.request.max_tokens"] == 4, a
    assert a["gen_ai.usage.output_tokens"] == 4 and a["gen_ai.response.id"].startswith("resp_")
    assert a["gen_ai.response.finish_reasons"] == ["incomplete"], a
    # A refused request has a span too, with the reason.
    r = post_json(px.port, "/v1/chat/completions", {"model": "m1", "messages": 5})
    a = attrs(span_for(rec, r.headers["x-detproxy-request-id"]))
    assert a["http.response.status_code"] == 400 and a["error.type"] == "invalid_value", a
    px.stop()
    rec.stop()


def test_stuck_collector_costs_requests_nothing():
    rec, sim, px = setup(hang=True)
    conn = http.client.HTTPConnection("127.0.0.1", px.port, timeout=10)
    body = json.dumps({"model": "m1", "prompt": "x", "max_tokens": 1})
    worst = 0.0
    n = 2600  # more than the 2048 spans the queue holds while one export hangs (10 s)
    t0 = time.monotonic()
    for i in range(n):
        t = time.monotonic()
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        worst = max(worst, time.monotonic() - t)
    took = time.monotonic() - t0
    conn.close()
    print("%d requests in %.2f s with a stuck collector, slowest %.1f ms" % (n, took,
                                                                             worst * 1000))
    # A request that waited on the hung export would take its whole 10 s timeout; the bound is
    # that mechanism's, not a speed target (this runs under ASan on a loaded machine too).
    assert worst < 9.0, worst
    dropped = metric(px, "detproxy_otel_spans_total", result="dropped")
    assert dropped >= n - 2048 - 256, dropped
    # The hung export times out (10 s) and is counted as failed; nothing waits for it.
    poll_until(lambda: metric(px, "detproxy_otel_spans_total", result="failed") > 0,
               timeout=25, interval=0.5, what="failed export counted")
    px.stop()
    rec.stop()


def test_config_errors_name_the_key():
    import os
    import tempfile
    from harness import DETPROXY_BIN, run_cmd
    from proxyutil import write_config
    sim = start_sim("--model", "m1")
    base = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
            "pools": [pool("p", ["m1"], [sim])]}
    cases = [({"endpoint": "http://127.0.0.1:4318", "rate": 1}, "otel.rate: unknown key"),
             ({"sample_rate": 0.5}, "otel.endpoint"),
             ({"endpoint": "https://collector:4318"}, "otel.endpoint: https is not supported"),
             ({"endpoint": "http://127.0.0.1:4318", "sample_rate": 2}, "otel.sample_rate"),
             ("on", "otel")]
    for otel, want in cases:
        path = write_config(dict(base, otel=otel), tempfile.mkdtemp(prefix="detproxy-otel-"))
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
        assert rc != 0 and want in out + err, (otel, rc, out, err)
    path = write_config(dict(base, otel={"endpoint": "http://127.0.0.1:4318"}),
                        tempfile.mkdtemp(prefix="detproxy-otel-"))
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
    assert rc == 0, out + err


if __name__ == "__main__":
    run_tests(globals())
