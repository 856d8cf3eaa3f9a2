"""What an operator sees, checks and changes (docs/operations.md §2, §5): refusals in metrics and audit lines, the
access log, token counters, per-tenant rate limits, draining replicas, the effective
configuration, `policy test`, `--version`, `check --strict`, and quiet builds."""

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading

from harness import (DETPROXY_BIN, SANITIZE, SLOW, SOURCE_DIR, get_json, http, poll_until,
                     post_json, run_cmd, run_tests, sse, start_sim)
from proxyutil import (assert_openai_error, exchange, metric, parse_response, pool,
                       read_until_close, serve_replica, serve_until_stream, sim_stats,
                       start_proxy, write_config)

BANK_KEY = "sk-bank-operator-0001"
BANK_SHA = hashlib.sha256(BANK_KEY.encode()).hexdigest()
BANK = {"authorization": "Bearer " + BANK_KEY}

POLICY = {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": [BANK_SHA]},
     "sampling": {"temperature": {"force": 0}, "seed": {"force": 1234}},
     "deny_params": ["logit_bias"], "audit": True},
    {"name": "limited", "match": {"header": {"name": "x-tenant", "value": "limited"}},
     "rate_limit": {"requests_per_second": 0.05, "burst": 2}},  # refills every 20 s
    {"name": "default", "match": {"any": True}},
]}


def completion(**kw):
    b = {"model": "m1", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    b.update(kw)
    return b


def setup(n=1, policy=POLICY, log=None, limits=None, **top):
    sims = [start_sim("--model", "m1") for _ in range(n)]
    d = tempfile.mkdtemp(prefix="detproxy-operator-")
    lg = {"level": "info", "audit_path": os.path.join(d, "audit.jsonl")}
    lg.update(log or {})
    px = start_proxy(pools=[pool("p", ["m1"], sims)], policy=policy, log=lg, limits=limits,
                     directory=d, **top)
    px.audit_path = lg["audit_path"]
    px.dir = d
    return sims, px


def audit_lines(px):
    if not os.path.exists(px.audit_path):
        return []
    return [json.loads(l) for l in open(px.audit_path)]


def access_lines(px, request_id=None):
    return [l for l in px.find_logs("access")
            if request_id is None or l.get("request_id") == request_id]


def wait_access(px, request_id):
    return px.wait_log(lambda l: l.get("msg") == "access" and l.get("request_id") == request_id)


# ---- refusals are counted and audited -------------------------------------------------------

def test_every_refusal_is_counted_with_status_and_code():
    # No catch-all tenant here, so a request without a known credential is a 401.
    policy = {"tenants": [POLICY["tenants"][0],
                          {"name": "team", "match": {"header": {"name": "x-tenant",
                                                                "value": "team"}}}]}
    sims, px = setup(policy=policy, limits={"max_body_bytes": 4096, "max_header_bytes": 2048})
    lim = {"x-tenant": "team"}
    assert post_json(px.port, "/v1/completions", completion(), headers=lim).status == 200
    assert_openai_error(post_json(px.port, "/v1/completions", completion(),
                                  headers={"authorization": "Bearer sk-unknown"}),
                        401, "invalid_api_key")
    assert_openai_error(post_json(px.port, "/v1/completions", completion(logit_bias={"1": 2}),
                                  headers=BANK), 400, "policy_violation")
    assert_openai_error(post_json(px.port, "/v1/completions", completion(model="zzz"),
                                  headers=lim), 404, "model_not_found")
    big = json.dumps(completion(prompt="x" * 8000))
    assert_openai_error(http("POST", px.port, "/v1/completions", body=big,
                             headers=dict(lim, **{"content-type": "application/json"})), 413,
                        "body_too_large")
    huge = parse_response(exchange(px.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " +
                                   b"a" * 4000 + b"\r\n\r\n")[0])
    assert_openai_error(huge, 431, "headers_too_large")
    bad = parse_response(exchange(px.port,
                                  b"GET /v1/models HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n")[0])
    assert_openai_error(bad, 400, "bad_request")

    def count(**labels):
        return metric(px, "detproxy_requests_total", **labels)
    assert count(pool="p", tenant="team", status="200", code="upstream") == 1
    assert count(pool="-", tenant="-", status="401", code="invalid_api_key") == 1
    assert count(pool="-", tenant="bank", status="400", code="policy_violation") == 1
    assert count(pool="-", tenant="team", status="404", code="model_not_found") == 1
    assert count(pool="-", status="413", code="body_too_large") == 1
    assert count(pool="-", tenant="-", status="431", code="headers_too_large") == 1
    assert count(pool="-", tenant="-", status="400", code="bad_request") == 1
    # Nothing counted twice (a refusal is not also a 499).
    assert count(status="499") == 0
    assert count() == 7, http("GET", px.admin_port, "/metrics").text
    px.stop()


def test_refused_audit_lines_carry_the_error_and_no_made_up_hash():
    sims, px = setup()
    r = post_json(px.port, "/v1/completions", completion(logit_bias={"1": 2}), headers=BANK)
    assert r.status == 400
    rid = r.headers["x-detproxy-request-id"]
    assert audit_lines(px)[-1]["request_id"] == rid, "audited before the answer"
    r2 = post_json(px.port, "/v1/completions", completion(), headers=BANK)
    assert r2.status == 200
    lines = {l["request_id"]: l for l in audit_lines(px)}
    a = lines[rid]
    assert a["status"] == 400, a
    assert a["error"] == {"code": "policy_violation", "param": "logit_bias"}, a
    assert a["pool"] is None and a["replica"] is None and a["fingerprint"] is None, a
    assert a["forwarded_body_sha256"] is None, a
    assert a["response_body_sha256"] is None, a  # never received: null, not 64 zeros
    ok = lines[r2.headers["x-detproxy-request-id"]]
    assert "error" not in ok and ok["replica"] == "r1", ok
    assert re.fullmatch(r"[0-9a-f]{64}", ok["response_body_sha256"]), ok
    assert ok["response_body_sha256"] != "0" * 64
    # No replica admitted: the pool is named, the replica is not, no response hash.
    sims[0].stop()
    poll_until(lambda: post_json(px.port, "/v1/completions", completion(), headers=BANK).status
               == 503, what="503 once the replica is gone")
    # The line was written before the answer was sent, refusals included.
    last = audit_lines(px)[-1]
    assert last["status"] == 503 and last["pool"] == "p" and last["replica"] is None, last
    assert last["error"]["code"] == "no_attested_replica" and last["error"]["param"] is None
    assert last["response_body_sha256"] is None, last
    px.stop()


def test_an_audited_tenants_requests_refused_from_the_head_are_audited():
    """An audited tenant's attempt at an engine-native generation route, at a route that is
    not in the passthrough list, or over its rate limit, is refused before any body is read,
    and still gets its audit line: the method and path it tried, the refusal, nothing
    forwarded. While the answer waits for its line the body is dropped as it comes: a body
    over max_body_bytes does not turn the refusal into a 413, and no 100 Continue invites
    one. Another tenant's refusals write none."""
    policy = {"tenants": [
        {"name": "bank", "match": {"api_keys_sha256": [BANK_SHA]},
         "sampling": {"temperature": {"force": 0}}, "audit": True,
         "rate_limit": {"requests_per_second": 0.05, "burst": 3}},
        {"name": "default", "match": {"any": True}, "sampling": {"temperature": {"force": 0}}},
    ]}
    sims, px = setup(policy=policy, limits={"max_body_bytes": 1000})
    big = "x" * 5000
    gen = http("POST", px.port, "/generate", body=big,
               headers=dict(BANK, **{"content-type": "application/json"}))
    assert gen.status == 404 and gen.json()["error"]["code"] == "unpoliced_route", gen
    tok = http("POST", px.port, "/tokenize?x=1", body="{}", headers=BANK)
    assert tok.status == 404 and tok.json()["error"]["code"] == "unpoliced_route", tok
    assert http("POST", px.port, "/generate", body="{}").status == 404  # not audited
    # Expect: 100-continue on a refused route: the refusal, not an invitation to send.
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(b"POST /api/generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
              b"Content-Length: 10\r\nExpect: 100-continue\r\n\r\n" % BANK_KEY.encode())
    s.settimeout(10)
    first = s.recv(4096)
    s.close()
    assert first.startswith(b"HTTP/1.1 404"), first[:100]
    cont_id = re.search(rb"x-detproxy-request-id: ([0-9a-f]+)", first, re.I).group(1).decode()
    over = http("POST", px.port, "/v1/completions", body=big,
                headers=dict(BANK, **{"content-type": "application/json"}))
    assert over.status == 429 and over.headers.get("retry-after"), over
    lines = {l["request_id"]: l for l in audit_lines(px)}
    assert len(lines) == 4, lines
    ids = {r.headers["x-detproxy-request-id"]: r for r in (gen, tok, over)}
    for rid, method, path, status, code in (
            (gen.headers["x-detproxy-request-id"], "POST", "/generate", 404, "unpoliced_route"),
            (tok.headers["x-detproxy-request-id"], "POST", "/tokenize", 404, "unpoliced_route"),
            (cont_id, "POST", "/api/generate", 404, "unpoliced_route"),
            (over.headers["x-detproxy-request-id"], "POST", "/v1/completions", 429,
             "rate_limited")):
        a = lines[rid]
        assert a["tenant"] == "bank" and a["method"] == method and a["route"] == path, a
        assert a["status"] == status and a["error"]["code"] == code, a
        assert a["model"] is None and a["params"] == [] and a["seed"] is None, a
        assert a["pool"] is None and a["replica"] is None, a
        assert a["forwarded_body_sha256"] is None and a["response_body_sha256"] is None, a
    assert len(ids) == 3
    assert metric(px, "detproxy_requests_total", code="body_too_large") == 0
    assert sim_stats(sims[0])["requests"] == 0
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", "--no-signatures", px.audit_path])
    assert rc == 0 and "4 lines" in out and "chain ok" in out, (rc, out, err)
    px.stop()


def test_a_refused_requests_broken_body_does_not_change_the_answer_on_record():
    """A refusal from the head waits for its audit line before it is sent. A body that breaks
    its chunked framing meanwhile (here in the same packet as the head, so before the line is
    written) does not turn the answer into a 400: the client gets the refusal the line
    records, and the connection closes after it. The line's route is the whole path up to
    8 KiB."""
    policy = {"tenants": [
        {"name": "bank", "match": {"api_keys_sha256": [BANK_SHA]},
         "sampling": {"temperature": {"force": 0}}, "audit": True},
    ]}
    sims, px = setup(policy=policy, limits={"max_header_bytes": 131072})
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
              b"Transfer-Encoding: chunked\r\n\r\nzz\r\nnot a chunk\r\n" % BANK_KEY.encode())
    data, closed = read_until_close(s)
    s.close()
    assert closed, data[:300]
    r = parse_response(data)
    assert r.status == 404 and json.loads(r.body)["error"]["code"] == "unpoliced_route", data[:400]
    assert r.headers.get("connection") == "close" and r.complete and r.rest == b"", data[:400]
    rid = r.headers["x-detproxy-request-id"]
    (line,) = [l for l in audit_lines(px) if l["request_id"] == rid]
    assert line["status"] == 404 and line["error"]["code"] == "unpoliced_route", line
    px.wait_log("request_body_dropped")
    assert metric(px, "detproxy_requests_total", code="bad_request") == 0
    # The line's route is the whole path tried, however long.
    long_path = "/" + "r" * 600
    far = http("POST", px.port, long_path + "?q=1", body="{}", headers=BANK)
    assert far.status == 404, far
    (line,) = [l for l in audit_lines(px)
               if l["request_id"] == far.headers["x-detproxy-request-id"]]
    assert line["route"] == long_path, len(line["route"])
    assert "route_bytes" not in line and "route_sha256" not in line, line
    # Past 8 KiB the line keeps the first 8,192 bytes, with the whole path's length and hash,
    # so that every line stays within what audit verify reads.
    huge_path = "/" + "%22" * 20000
    far = http("POST", px.port, huge_path, body="{}", headers=BANK)
    assert far.status == 404, far
    (line,) = [l for l in audit_lines(px)
               if l["request_id"] == far.headers["x-detproxy-request-id"]]
    assert line["route"] == huge_path[:8192], len(line["route"])
    assert line["route_bytes"] == len(huge_path), line["route_bytes"]
    assert line["route_sha256"] == hashlib.sha256(huge_path.encode()).hexdigest(), line
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", "--no-signatures", px.audit_path])
    assert rc == 0 and "chain ok" in out, (rc, out, err)
    assert sim_stats(sims[0])["requests"] == 0
    px.stop()


# ---- the access log --------------------------------------------------------------------------

def test_access_log_line_per_request_with_fields():
    sims, px = setup()
    r = post_json(px.port, "/v1/completions", completion(temperature=0.9), headers=BANK)
    assert r.status == 200
    a = wait_access(px, r.headers["x-detproxy-request-id"])
    assert a["level"] == "info" and a["method"] == "POST" and a["path"] == "/v1/completions"
    assert a["status"] == 200 and a["code"] == "upstream", a
    assert a["tenant"] == "bank" and a["pool"] == "p" and a["replica"] == "r1", a
    assert a["model"] == "m1" and a["seed"] == 1234, a
    assert "temperature:forced" in a["policy"] and "seed:forced" in a["policy"], a
    assert a["prompt_tokens"] > 0 and a["completion_tokens"] == 4, a
    assert 0 < a["ttfb_ms"] <= a["upstream_ms"] <= a["duration_ms"], a
    assert a["remote"].startswith("127.0.0.1"), a
    # A refusal: no pool, replica or upstream times.
    r = post_json(px.port, "/v1/completions", completion(model="zzz"))
    a = wait_access(px, r.headers["x-detproxy-request-id"])
    assert a["status"] == 404 and a["code"] == "model_not_found" and a["tenant"] == "default"
    assert a["pool"] is None and a["replica"] is None and a["upstream_ms"] is None, a
    # A streamed request: tokens from the usage chunk.
    body = completion(stream=True, stream_options={"include_usage": True}, max_tokens=5)
    events = list(sse(px.port, "/v1/completions", body))
    assert events[-1][1] == "[DONE]"
    poll_until(lambda: any(l.get("completion_tokens") == 5 for l in access_lines(px)),
               what="access line of the stream")
    px.stop()


def test_access_log_sampling_fields_and_off():
    sims, px = setup(log={"access": {"sample_rate": 0, "fields": ["tenant", "code"]}})
    ok = post_json(px.port, "/v1/completions", completion())
    bad = post_json(px.port, "/v1/completions", completion(model="zzz"))
    a = wait_access(px, bad.headers["x-detproxy-request-id"])  # refusals are always logged
    assert set(a) == {"ts", "level", "msg", "request_id", "method", "path", "status",
                      "duration_ms", "tenant", "code"}, a
    assert not access_lines(px, ok.headers["x-detproxy-request-id"]), "sampled out"
    px.stop()
    sims, px = setup(log={"access": {"enabled": False}})
    bad = post_json(px.port, "/v1/completions", completion(model="zzz"))
    assert bad.status == 404
    px.wait_log("request_failed")
    px.stop()
    assert not access_lines(px)


# ---- tokens and rate limits -------------------------------------------------------------------

def test_a_replica_a_reload_removes_leaves_metrics():
    """A reload that replaces a pool's only replica with another: the old one's series go (its
    admitted gauge left at 1 said the pool still had a replica serving), the new one's come."""
    old, new = start_sim("--model", "m1"), start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [old])])
    assert post_json(px.port, "/v1/completions", completion()).status == 200
    assert metric(px, "detproxy_replica_admitted", pool="p", replica="r1") == 1
    with open(px.config_path) as f:
        cfg = json.load(f)
    cfg["pools"][0]["replicas"] = [{"name": "r2", "url": "http://127.0.0.1:%d" % new.port}]
    with open(px.config_path, "w") as f:
        json.dump(cfg, f)
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    poll_until(lambda: 'replica="r1"' not in http("GET", px.admin_port, "/metrics").text,
               what="r1's series gone")
    poll_until(lambda: metric(px, "detproxy_replica_admitted", pool="p", replica="r2") == 1,
               what="r2 admitted")
    px.stop()


def test_token_counters_from_usage_json_and_sse():
    sims, px = setup()
    r = post_json(px.port, "/v1/completions", completion(max_tokens=6))
    usage = r.json()["usage"]
    list(sse(px.port, "/v1/completions",
             completion(stream=True, stream_options={"include_usage": True}, max_tokens=3)))
    list(sse(px.port, "/v1/completions", completion(stream=True, max_tokens=3)))  # no usage
    poll_until(lambda: metric(px, "detproxy_tokens_total", kind="completion") == 9,
               what="completion tokens counted")
    assert metric(px, "detproxy_tokens_total", tenant="default", pool="p",
                  kind="prompt") == 2 * usage["prompt_tokens"]
    text = http("GET", px.admin_port, "/metrics").text
    assert "# TYPE detproxy_tokens_total counter" in text
    # another tenant's tokens count in its own series, and the first tenant's stay as they were
    r = post_json(px.port, "/v1/completions", completion(max_tokens=5), headers=BANK)
    assert r.status == 200, r.text
    poll_until(lambda: metric(px, "detproxy_tokens_total", tenant="bank", kind="completion") ==
               r.json()["usage"]["completion_tokens"], what="the bank tenant's tokens counted")
    assert metric(px, "detproxy_tokens_total", tenant="default", kind="completion") == 9
    px.stop()


def streaming_replica(events, end):
    """A replica answering the first inference request with these SSE events, each its own
    chunk, then the stream's last chunk if end; it holds the connection until the proxy closes
    it. (Its listening socket, a proxy in front of it with the default tenant.)"""
    def handle(c):
        with c, contextlib.suppress(OSError):  # the proxy may cut it once the client has gone
            if serve_until_stream(c):
                for e in events:
                    c.sendall(b"%x\r\n%s\r\n" % (len(e), e))
                if end:
                    c.sendall(b"0\r\n\r\n")
                serve_until_stream(c)

    ls, replica_pool = serve_replica(handle)
    return ls, start_proxy(pools=[replica_pool], policy={"tenants": [POLICY["tenants"][-1]]})


def test_a_stream_event_cut_inside_its_usage_does_not_hide_the_next_usage():
    # A replica's stream whose first usage event is cut off mid-object (as one that failed and
    # was restarted behind a router might send): the usage event after it still counts.
    events = [b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":\n\n',
              b'data: {"choices":[{"index":0,"text":"x"}],"usage":null}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":7}}\n\n',
              b"data: [DONE]\n\n"]

    ls, px = streaming_replica(events, end=True)
    try:
        got = list(sse(px.port, "/v1/completions", completion(stream=True)))
        assert got[-1][1] == "[DONE]", got
        poll_until(lambda: metric(px, "detproxy_tokens_total", kind="completion") == 7,
                   what="the complete usage event's tokens counted")
        assert metric(px, "detproxy_tokens_total", kind="prompt") == 11
    finally:
        px.stop()
        ls.close()


def test_tokens_count_when_the_client_leaves_after_the_usage_event():
    # The client reads to [DONE] and leaves before the replica ends its stream: the request is
    # a 499, but the tokens the replica reported were spent and count.
    events = [b'data: {"choices":[{"index":0,"text":"x"}],"usage":null}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":7}}\n\n',
              b"data: [DONE]\n\n"]

    ls, px = streaming_replica(events, end=False)  # no last chunk: the client leaves first
    try:
        got = list(sse(px.port, "/v1/completions", completion(stream=True)))
        assert got[-1][1] == "[DONE]", got
        poll_until(lambda: metric(px, "detproxy_requests_total", status="499",
                                  code="client_closed") == 1, what="the request counted as 499")
        assert metric(px, "detproxy_tokens_total", kind="completion") == 7
        assert metric(px, "detproxy_tokens_total", kind="prompt") == 11
    finally:
        px.stop()
        ls.close()


def test_rate_limit_is_per_tenant_429_with_retry_after():
    sims, px = setup()
    lim = {"x-tenant": "limited"}
    assert post_json(px.port, "/v1/completions", completion(), headers=lim).status == 200
    assert post_json(px.port, "/v1/completions", completion(), headers=lim).status == 200
    r = post_json(px.port, "/v1/completions", completion(), headers=lim)
    err = assert_openai_error(r, 429, "rate_limited")
    assert "limited" in err["message"], err
    assert 15 <= int(r.headers["retry-after"]) <= 20, r.headers
    # Other tenants are not limited by it.
    for _ in range(5):
        assert post_json(px.port, "/v1/completions", completion()).status == 200
    assert metric(px, "detproxy_requests_total", tenant="limited", status="429",
                  code="rate_limited") == 1
    # A reload keeps the bucket (a reload is no way around the limit).
    px.send_signal(signal.SIGHUP)
    px.wait_log("reloaded")
    assert post_json(px.port, "/v1/completions", completion(), headers=lim).status == 429
    px.stop()


def test_rate_limit_with_a_burst_of_one_lets_the_first_request_through():
    # Rounding in (now + interval) - now once made burst 1 refuse even the first request.
    policy = {"tenants": [{"name": "single", "match": {"any": True},
                           "rate_limit": {"requests_per_second": 0.1, "burst": 1}}]}
    sims, px = setup(policy=policy)
    assert post_json(px.port, "/v1/completions", completion()).status == 200
    assert_openai_error(post_json(px.port, "/v1/completions", completion()), 429, "rate_limited")
    px.stop()


def test_rate_limit_with_a_tiny_rate_still_limits():
    # 1e-20 requests per second: the wait (1e20 s) does not fit Retry-After's whole seconds.
    # It is capped, not cast (a cast gave 0 on x86-64: "no wait", and the limit let all through).
    policy = {"tenants": [{"name": "glacial", "match": {"any": True},
                           "rate_limit": {"requests_per_second": 1e-20, "burst": 1}}]}
    sims, px = setup(policy=policy)
    assert post_json(px.port, "/v1/completions", completion()).status == 200
    for _ in range(3):
        r = post_json(px.port, "/v1/completions", completion())
        assert_openai_error(r, 429, "rate_limited")
        assert int(r.headers["retry-after"]) == 4294967295, r.headers
    px.stop()


# ---- drain / enable ---------------------------------------------------------------------------

def replica_view(px, name):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}[name]


def test_drain_and_enable_without_reload():
    # Both slow enough that the first request is seen in flight wherever it lands.
    slow = start_sim("--model", "m1", "--token-delay-ms", "60")
    other = start_sim("--model", "m1", "--token-delay-ms", "60")
    px = start_proxy(pools=[pool("p", ["m1"], [slow, other])])
    # A request in flight on r1 finishes after r1 is drained.
    result = {}
    t = threading.Thread(target=lambda: result.update(
        r=post_json(px.port, "/v1/completions", completion(max_tokens=10))))
    t.start()
    poll_until(lambda: sim_stats(slow)["inflight"] + sim_stats(other)["inflight"] == 1,
               what="one request in flight")
    inflight_on = "r1" if sim_stats(slow)["inflight"] else "r2"
    r = http("POST", px.admin_port, "/admin/replicas/%s/drain" % inflight_on)
    assert r.status == 200, r
    view = r.json()["replicas"][0]
    assert view["drained"] is True and view["serving"] is False, view
    assert view["state"] == "admitted", view  # attestation state is untouched
    t.join()
    assert result["r"].status == 200, result
    for _ in range(6):
        assert post_json(px.port, "/v1/completions",
                         completion()).headers["x-detproxy-replica"] != inflight_on
    assert metric(px, "detproxy_replica_drained", pool="p", replica=inflight_on) == 1
    assert replica_view(px, inflight_on)["drained"] is True
    # A reload that keeps the replica keeps it drained.
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    assert replica_view(px, inflight_on)["drained"] is True
    assert post_json(px.port, "/v1/completions",
                     completion()).headers["x-detproxy-replica"] != inflight_on
    # Unknown names, wrong methods.
    assert_openai_error(http("POST", px.admin_port, "/admin/replicas/nope/drain"), 404,
                        "replica_not_found")
    assert_openai_error(http("POST", px.admin_port, "/admin/replicas/r1/drain?pool=q"), 404,
                        "replica_not_found")
    r = http("GET", px.admin_port, "/admin/replicas/r1/drain")
    assert r.status == 405 and r.headers["allow"] == "POST", r
    # A read-only route asked with another method: 405 naming what it takes, not a 404.
    for path in ("/admin/replicas", "/admin/config", "/metrics", "/readyz", "/admin/rollouts"):
        r = http("POST", px.admin_port, path, body={})
        assert r.status == 405 and r.headers["allow"] == "GET, HEAD", (path, r)
    assert http("DELETE", px.admin_port, "/admin/nothing").status == 404
    # Query values are percent-decoded, as URL libraries encode them; a bad escape is a 400.
    assert_openai_error(http("POST", px.admin_port, "/admin/replicas/r1/drain?pool=%7A"), 404,
                        "replica_not_found")
    assert_openai_error(http("POST", px.admin_port, "/admin/replicas/r1/drain?pool=%zz"), 400)
    assert_openai_error(http("GET", px.admin_port, "/admin/rollouts?pool=q"), 404,
                        "pool_not_found")
    # Both drained: 503 that says so; enable brings it back.
    other_name = "r2" if inflight_on == "r1" else "r1"
    assert http("POST", px.admin_port, "/admin/replicas/%s/drain?pool=%%70" % other_name).status \
        == 200
    r = post_json(px.port, "/v1/completions", completion())
    assert_openai_error(r, 503, "all_replicas_drained")
    assert "drained by an operator" in r.json()["error"]["message"], r.text
    assert http("GET", px.admin_port, "/readyz").status == 503
    assert http("POST", px.admin_port, "/admin/replicas/%s/enable" % inflight_on).status == 200
    assert post_json(px.port, "/v1/completions",
                     completion()).headers["x-detproxy-replica"] == inflight_on
    assert metric(px, "detproxy_replica_drained", pool="p", replica=inflight_on) == 0
    assert px.find_logs("replica_drained") and px.find_logs("replica_enabled")
    px.stop()


# ---- GET /admin/config ------------------------------------------------------------------------

def test_admin_config_shows_the_keys_a_fleet_compares():
    """Every key in force is in the dump (a fleet hashes it to find instances whose config
    differs): OpenTelemetry, affinity, a manifest's accepted identities, allow_params and
    unknown_keys, each with its defaults filled in."""
    sim = start_sim("--model", "m1")
    p = pool("p", ["m1"], [sim], balance="affinity", affinity={"key": "session"},
             manifest={"model": "m1", "quantization": "awq", "framework": {"name": "vllm"},
                       "accept": [{"quantization": "gptq"}]})
    px = start_proxy(pools=[p], ready=False,
                     otel={"endpoint": "http://127.0.0.1:9", "sample_rate": 0.5},
                     policy={"tenants": [{"name": "t", "match": {"any": True,
                                                                   "unknown_keys": True},
                                          "allow_params": ["model", "prompt"]}]})
    c = get_json(px.admin_port, "/admin/config")
    assert c["otel"] == {"endpoint": "http://127.0.0.1:9", "sample_rate": 0.5}, c["otel"]
    got = c["pools"][0]
    assert got["affinity"] == {"key": "session", "prefix_bytes": 4096,
                               "session_header": "x-session-id", "load_factor": 1.25}, got
    accept = got["manifest"]["accept"]
    assert [a["quantization"] for a in accept] == ["gptq"] and accept[0]["model"] == "m1", accept
    assert accept[0]["fingerprint"] != got["manifest"]["fingerprint"], accept
    t = c["policy"]["tenants"][0]
    assert t["match"] == {"any": True, "unknown_keys": True}, t
    assert t["allow_params"] == ["model", "prompt"], t
    px.stop()


def test_admin_config_fills_defaults_and_redacts_secrets():
    d = tempfile.mkdtemp(prefix="detproxy-operator-")
    key_file = os.path.join(d, "vllm-key")
    with open(key_file, "w") as f:
        f.write("sk-replica-secret-4242\n")
    os.chmod(key_file, 0o600)
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim], api_key_file=key_file)], policy=POLICY,
                     directory=d, log={"level": "info", "audit_path": os.path.join(d, "a.jsonl")})
    r = http("GET", px.admin_port, "/admin/config")
    assert r.status == 200 and r.headers["content-type"] == "application/json"
    text = r.text
    c = r.json()
    assert c["limits"]["max_body_bytes"] == 8388608 and c["limits"]["max_headers"] == 100, c
    assert c["attestation"]["interval_ms"] == 10000 and c["shadow"]["max_inflight"] == 4, c
    assert c["log"]["access"] == {"enabled": True, "sample_rate": 1, "fields": [
        "tenant", "pool", "replica", "code", "model", "remote", "upstream_ms", "ttfb_ms",
        "tokens", "seed", "policy"]}, c["log"]
    p = c["pools"][0]
    assert p["balance"] == "least_inflight" and p["api_key_file"] == key_file, p
    assert p["api_key"] == "<redacted>", p
    assert "sk-replica-secret-4242" not in text
    assert BANK_SHA not in text and BANK_SHA[:8] in text
    assert "limited" in text and '"value":"<redacted>"' in text
    assert c["policy"]["tenants"][1]["rate_limit"] == {"requests_per_second": 0.05, "burst": 2}
    assert c["config_path"] == px.config_path
    px.stop()


# ---- detproxy policy test ---------------------------------------------------------------------

def policy_test(cfg_path, body, *headers, path=None):
    d = tempfile.mkdtemp(prefix="detproxy-policytest-")
    bpath = os.path.join(d, "body.json")
    with open(bpath, "w") as f:
        f.write(body if isinstance(body, str) else json.dumps(body))
    argv = [DETPROXY_BIN, "policy", "test", "-c", cfg_path, "--body", bpath]
    for h in headers:
        argv += ["-H", h]
    if path:
        argv += ["--path", path]
    rc, out, err = run_cmd(argv)
    return rc, (json.loads(out) if out.strip() else None), err


def test_policy_test_reads_a_body_from_a_late_non_blocking_stdin():
    """--body - reads standard input as it is handed over, even one a parent left non-blocking
    (libuv and Node do): the body that comes late is waited for, not refused."""
    import fcntl
    import threading
    d = tempfile.mkdtemp(prefix="detproxy-stdin-")
    cfg = write_config({"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
                        "pools": [{"name": "p", "models": ["m1"],
                                   "replicas": [{"name": "r1", "url": "http://127.0.0.1:9"}]}],
                        "policy": {"tenants": [{"name": "all", "match": {"any": True}}]}}, d)
    r, w = os.pipe()
    fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_NONBLOCK)
    p = subprocess.Popen([DETPROXY_BIN, "policy", "test", "-c", cfg, "--body", "-"], stdin=r,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    os.close(r)
    late = threading.Timer(0.3, lambda: (os.write(w, json.dumps(completion()).encode()),
                                         os.close(w)))
    late.start()
    out, err = p.communicate(timeout=30 * SLOW)
    late.join()
    assert p.returncode == 0 and json.loads(out)["tenant"] == "all", (p.returncode, out, err)


def test_the_example_config_serves_sdk_clients_with_a_dummy_key():
    """The OpenAI SDKs always send Authorization: the shipped catch-all takes unknown keys
    (unknown_keys), and a policy without it says how to fix the 401."""
    from harness import SOURCE_DIR
    examples = os.path.join(SOURCE_DIR, "config", "examples", "detproxy.json")
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct",
            "messages": [{"role": "user", "content": "hi"}]}
    rc, out, err = policy_test(examples, body, "Authorization: Bearer sk-dummy",
                               path="/v1/chat/completions")
    assert rc == 0 and out["tenant"] == "default", (rc, out, err)
    d = tempfile.mkdtemp(prefix="detproxy-sdk-")
    cfg = write_config({"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
                        "pools": [{"name": "p", "models": ["*"],
                                   "replicas": [{"name": "r1", "url": "http://127.0.0.1:9"}]}],
                        "policy": {"tenants": [{"name": "all", "match": {"any": True}}]}}, d)
    rc, out, err = policy_test(cfg, body, "Authorization: Bearer sk-dummy",
                               path="/v1/chat/completions")
    assert rc == 1 and "\"unknown_keys\": true" in out["error"]["message"], (rc, out, err)


def test_policy_test_shows_the_decision_and_matches_the_proxy():
    sims, px = setup()
    cfg = px.config_path
    rc, out, err = policy_test(cfg, completion(temperature=0.9),
                               "Authorization: Bearer " + BANK_KEY)
    assert rc == 0, (out, err)
    assert out["tenant"] == "bank" and out["pool"] == "p" and out["seed"] == 1234, out
    assert out["body"]["temperature"] == 0 and out["body"]["seed"] == 1234, out
    assert out["audited"] is True and out["fingerprint"].startswith("fp_"), out
    line = out["audit_line"]
    assert line["tenant"] == "bank" and line["seed"] == 1234 and line["replica"] is None, line
    # What the proxy really forwards is the body shown, and the line hashes those very bytes
    # (the client's own, with the policy's values spliced in).
    r = post_json(px.port, "/v1/completions", completion(temperature=0.9), headers=BANK)
    assert r.status == 200
    raw = get_json(sims[0].port, "/_sim/last_request")["body"]
    assert json.loads(raw) == out["body"], (raw, out["body"])
    assert line["forwarded_body_sha256"] == hashlib.sha256(raw.encode()).hexdigest(), raw
    # Chat is recognised from the body; derive-less default tenant: no seed.
    rc, out, _ = policy_test(cfg, {"model": "m1", "messages": [{"role": "user", "content": "x"}]})
    assert rc == 0 and out["tenant"] == "default" and out["seed"] is None, out
    assert out["route"] == "/v1/chat/completions"
    # The same outcome as the proxy's: tenant, or status and error byte for byte.
    cases = [
        (completion(logit_bias={"1": 1}), ("Authorization: Bearer " + BANK_KEY,), BANK),
        (completion(model="zzz"), (), {}),
        (completion(), ("Authorization: Bearer sk-nobody",),
         {"authorization": "Bearer sk-nobody"}),
        ("{\"model\": \"m1\",", (), {}),
        (completion(n="two"), (), {}),
        (completion(), ("Content-Encoding: gzip",), {"content-encoding": "gzip"}),
    ]
    refusals = 0
    for body, hdrs, live_hdrs in cases:
        rc, out, err = policy_test(cfg, body, *hdrs)
        live = http("POST", px.port, "/v1/completions",
                    body=body if isinstance(body, str) else json.dumps(body),
                    headers=dict(live_hdrs, **{"content-type": "application/json"}))
        assert out["status"] == live.status, (out, live)
        if live.status == 200:
            assert rc == 0 and out["tenant"] == live.headers["x-detproxy-tenant"], (out, live)
            continue
        refusals += 1
        assert rc == 1, (body, out, err)
        assert out["error"] == live.json()["error"], (out, live.json())
    assert refusals >= 3
    # A header the proxy's parser refuses (a control character in its value): the same 400.
    rc, out, err = policy_test(cfg, completion(), "X-A: a\x01b")
    body = json.dumps(completion()).encode()
    data, _ = exchange(px.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-A: a\x01b\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body), timeout=5)
    live = parse_response(data)
    assert rc == 1 and out["status"] == live.status == 400, (out, data[:200])
    assert out["error"] == json.loads(live.body)["error"], (out, live.body)
    # No tenant matches: 401 as the proxy answers it (test_every_refusal... checks the live 401).
    strict = json.load(open(cfg))
    strict["policy"] = {"tenants": POLICY["tenants"][:1]}
    rc, out, _ = policy_test(write_config(strict, tempfile.mkdtemp()), completion())
    assert rc == 1 and out["status"] == 401, out
    assert out["error"]["code"] == "invalid_api_key", out
    assert out["error"]["type"] == "authentication_error", out
    # Usage errors exit 2 with one line.
    rc, _, err = run_cmd([DETPROXY_BIN, "policy", "test", "-c", cfg])
    assert rc == 2 and "--body" in err, err
    rc, _, err = run_cmd([DETPROXY_BIN, "policy", "test", "-c", cfg, "--body", "/dev/null",
                          "-H", "no-colon"])
    assert rc == 2 and "Name: value" in err, err
    rc, out, _ = run_cmd([DETPROXY_BIN, "policy", "test", "--help"])
    assert rc == 0 and "usage: detproxy policy test" in out
    px.stop()


# ---- --version, build_info, check --strict ----------------------------------------------------

def test_version_and_build_info():
    rc, out, _ = run_cmd([DETPROXY_BIN, "--version"])
    assert rc == 0, out
    m = re.fullmatch(r"detproxy (\d+\.\d+\.\d+) \(commit ([0-9a-zA-Z._+-]+)\)\n", out)
    assert m, out
    rc2, out2, _ = run_cmd([DETPROXY_BIN, "version"])
    assert rc2 == 0 and out2 == out
    assert run_cmd([DETPROXY_BIN, "version", "extra"])[0] == 2
    if os.path.exists(os.path.join(SOURCE_DIR, ".git")):
        # Built from this clone: the commit is one of its commits (HEAD when freshly built).
        commit = m.group(2).split("-")[0]
        cp = subprocess.run(["git", "-C", SOURCE_DIR, "cat-file", "-e", commit + "^{commit}"],
                            capture_output=True)
        assert cp.returncode == 0, (commit, cp.stderr)
    sims, px = setup()
    assert metric(px, "detproxy_build_info", version=m.group(1), commit=m.group(2)) == 1
    px.stop()


def test_version_script_without_git():
    """A release tarball has no .git: the commit comes from COMMIT, else "unknown"."""
    d = tempfile.mkdtemp(prefix="detproxy-tarball-")
    out = os.path.join(d, "version.c")
    script = os.path.join(SOURCE_DIR, "cmake", "version.cmake")

    def gen():
        env = dict(os.environ)
        env.pop("DETPROXY_COMMIT", None)
        subprocess.run(["cmake", "-DSRC=" + d, "-DOUT=" + out, "-DVERSION=9.8.7", "-P", script],
                       check=True, env=env, capture_output=True)
        return open(out).read()
    text = gen()
    assert 'dp_version[] = "9.8.7"' in text and 'dp_commit[] = "unknown"' in text, text
    with open(os.path.join(d, "COMMIT"), "w") as f:
        f.write("abc123def456\n")
    assert 'dp_commit[] = "abc123def456"' in gen()
    shutil.rmtree(d)


def test_check_strict_fails_on_warnings():
    d = tempfile.mkdtemp(prefix="detproxy-strict-")
    sim = start_sim("--model", "m1")
    keyprefix = os.path.join(d, "k")
    assert run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", keyprefix])[0] == 0
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "attestation": {"require_signature": True, "trusted_keys": [keyprefix + ".pub.pem"]},
           "pools": [pool("p", ["m1"], [sim], manifest={"model": "m1"})]}
    cfg["pools"][0]["replicas"][0]["attest"] = {"source": "vllm"}
    path = write_config(cfg, d)
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
    assert rc == 0 and "never admitted" in err and out.startswith("ok:"), (rc, out, err)
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "--strict", "-c", path])
    assert rc == 1 and "never admitted" in err and "--strict: 1 warning" in err, (rc, err)
    assert out == "", out
    # Without warnings --strict passes.
    cfg["attestation"] = {}
    del cfg["pools"][0]["replicas"][0]["attest"]
    del cfg["pools"][0]["manifest"]
    path = write_config(cfg, d)
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "--strict", "-c", path])
    assert rc == 0 and err == "", (rc, out, err)


# ---- quiet builds ----------------------------------------------------------------------------

def test_build_output_is_quiet():
    """`make build` on an up-to-date tree prints nothing: no "Entering directory" walls, no
    "Built target" per library (errors stay visible: they go to stderr unfiltered)."""
    if shutil.which("make") is None or shutil.which("cmake") is None:
        return
    build = os.path.relpath(os.path.dirname(os.path.dirname(os.path.realpath(DETPROXY_BIN))),
                            SOURCE_DIR)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    cp = subprocess.run(["make", "build", "BUILD=" + build,
                         "SANITIZE=" + ("1" if SANITIZE else "0")], cwd=SOURCE_DIR,
                        capture_output=True, text=True, env=env, timeout=600)
    assert cp.returncode == 0, cp.stderr
    out = cp.stdout + cp.stderr
    assert "Entering directory" not in out and "Leaving directory" not in out, out
    assert "Built target" not in out, out


if __name__ == "__main__":
    run_tests(globals())
