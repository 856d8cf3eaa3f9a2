"""Policy bypasses on the wire: routes nobody listed, counts that void a cap, and what the
client and the access log are told when a stream ends early.

- A policed tenant's pass-through is default-deny for every method but GET and HEAD: TGI's
  `POST /` (its generate) with temperature 1.7 never reaches the replica; a route on the pool's
  `passthrough` list does (docs/policy.md §2, "Routes and pass-through").
- Every count a rule governs is >= 1 after policy: -1, 0 and INT64_MIN are refused before the
  replica (docs/policy.md §3, "Counts").
- The access log's model is the whole value, NUL included; a stream the shutdown drain cut is
  503 `drain_closed`, not a client's 499; a replica that dies mid-stream leaves the client an
  OpenAI-style error event (docs/requests.md, docs/configuration.md "log.access").
"""

import gzip
import hashlib
import json
import os
import signal
import socket
import tempfile
import time

from harness import DETPROXY_BIN, SLOW, raw_request, run_cmd, run_tests, start_sim
from proxyutil import (assert_openai_error, client_requests, exchange, parse_response, pool,
                       sim_config, start_proxy, write_config)

KEY = "sk-bank-0001"
AUTH = "Bearer " + KEY
POLICY = {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]},
     "sampling": {"temperature": {"force": 0}, "max_tokens": {"max": 100},
                  "n": {"max": 2}},
     "audit": True},
    {"name": "open", "match": {"any": True}},
]}

TGI_ROOT = {"inputs": "hi", "parameters": {"temperature": 1.7, "do_sample": True,
                                            "max_new_tokens": 100000}}
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def send(port, method, target, body, auth=AUTH):
    data = json.dumps(body).encode() if body is not None else b""
    head = ("%s %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-length: %d\r\n%sconnection: close\r\n\r\n"
            % (method, target, len(data), "authorization: %s\r\n" % auth if auth else ""))
    return parse_response(raw_request(port, head.encode() + data))


def setup(**poolkw):
    sim = start_sim("--model", "m1")
    d = tempfile.mkdtemp(prefix="detproxy-bypass-")
    px = start_proxy(pools=[pool("p", ["m1"], [sim], **poolkw)], policy=POLICY,
                     log={"level": "info", "audit_path": os.path.join(d, "audit.jsonl")},
                     directory=d)
    return sim, px


# ---- default-deny pass-through --------------------------------------------------------------

def test_tgi_root_generate_is_refused_and_never_reaches_the_replica():
    sim, px = setup()
    before = len(client_requests(sim))
    r = send(px.port, "POST", "/", TGI_ROOT)
    assert_openai_error(r, 404, "unpoliced_route")
    for method, target in (("POST", "/vertex"), ("POST", "/v2/models/m1/infer"),
                           ("POST", "/v2/models/m1/versions/1/infer"), ("PUT", "/")):
        assert_openai_error(send(px.port, method, target, TGI_ROOT), 404, "unpoliced_route")
    # Even a tenant without policy: these are named generation routes.
    assert_openai_error(send(px.port, "POST", "/", TGI_ROOT, auth=None), 404, "unpoliced_route")
    assert len(client_requests(sim)) == before, client_requests(sim)[before:]
    px.stop()


def test_unlisted_routes_are_default_deny_for_a_policed_tenant():
    sim, px = setup(passthrough=["POST /tokenize", "/v1/embeddings*"])
    before = len(client_requests(sim))
    for method, target in (("POST", "/detokenize"), ("DELETE", "/v1/models/m1"),
                           ("POST", "/update_weights_from_disk"), ("PUT", "/tokenize"),
                           ("POST", "/lora-adapters"), ("OPTIONS", "/anything")):
        r = send(px.port, method, target, {"model": "m1"})
        err = assert_openai_error(r, 404, "unpoliced_route")
        assert "passthrough" in err["message"] and "pool p" in err["message"], err
    assert len(client_requests(sim)) == before
    # The list, GET and HEAD pass; so does everything for a tenant without a policy.
    allowed = [("POST", "/tokenize", AUTH), ("POST", "/v1/embeddings", AUTH),
               ("POST", "/v1/embeddings/x", AUTH), ("GET", "/health", AUTH),
               ("HEAD", "/health", AUTH), ("POST", "/detokenize", None)]
    for method, target, auth in allowed:
        r = send(px.port, method, target, {"model": "m1", "input": "x"}, auth=auth)
        assert r.status != 404 or "unpoliced_route" not in r.body.decode(), (method, target, r)
    got = [(q["method"], q["target"]) for q in client_requests(sim)[before:]]
    assert got == [(m, t) for m, t, _ in allowed], got
    px.stop()


def test_passthrough_entries_are_validated_with_their_path():
    sim = start_sim("--model", "m1")
    cfg = {"listen": "127.0.0.1:0", "pools": [pool("p", ["m1"], [sim],
                                                   passthrough=["/ok", "tokenize", "/a*b"])]}
    rc, out, errs = run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg)])
    assert rc == 1, (rc, out, errs)
    assert "pools[0].passthrough[1]" in errs and "must start with '/'" in errs, errs
    assert "pools[0].passthrough[2]" in errs and "only at the end" in errs, errs
    sim.stop()


# ---- content coding -------------------------------------------------------------------------

def send_coded(port, data, coding, auth=AUTH):
    head = ("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-encoding: %s\r\ncontent-length: %d\r\n%sconnection: close\r\n\r\n"
            % (coding, len(data), "authorization: %s\r\n" % auth if auth else ""))
    return parse_response(raw_request(port, head.encode() + data))


def test_a_coded_body_is_refused_415_before_the_replica():
    """A body detproxy cannot read cannot be policed: gzip is refused with its reason, for every
    tenant, and a plain body that claims a coding is refused too (a decoding hop behind us would
    not see the JSON the rules looked at). `identity` is no coding."""
    sim, px = setup()
    before = len(client_requests(sim))
    plain = json.dumps(dict(CHAT, temperature=1.7)).encode()
    for data, coding, auth in ((gzip.compress(plain), "gzip", AUTH), (plain, "gzip", AUTH),
                               (plain, "br", None), (plain, " GZIP ", AUTH)):
        err = assert_openai_error(send_coded(px.port, data, coding, auth), 415,
                                  "unsupported_content_encoding")
        assert "Content-Encoding" in err["message"], err
    assert len(client_requests(sim)) == before, client_requests(sim)[before:]
    r = send_coded(px.port, plain, "Identity")
    assert r.status == 200, r
    got = client_requests(sim)[before:]
    assert len(got) == 1 and json.loads(got[0]["body"])["temperature"] == 0, got
    px.stop()


# ---- counts ---------------------------------------------------------------------------------

def test_counts_below_one_are_refused_before_the_replica():
    sim, px = setup()
    before = len(client_requests(sim))
    for key, value in (("max_tokens", -1), ("max_tokens", -2), ("max_tokens", 0),
                       ("max_tokens", -9223372036854775808), ("max_completion_tokens", -1),
                       ("n_predict", -1), ("max_new_tokens", 0), ("n", 0)):
        body = dict(CHAT)
        body.pop("max_tokens")
        body[key] = value
        r = send(px.port, "POST", "/v1/chat/completions", body)
        err = assert_openai_error(r, 400, "invalid_value")
        assert err["param"] == key and err["type"] == "invalid_request_error", (key, value, err)
    assert len(client_requests(sim)) == before
    # A valid one above the cap is clamped, as before.
    r = send(px.port, "POST", "/v1/chat/completions", dict(CHAT, max_tokens=100000))
    assert r.status == 200, r
    assert json.loads(client_requests(sim)[-1]["body"])["max_tokens"] == 100
    px.stop()


# ---- the access log, the drain, a replica dying mid-stream ----------------------------------

def access_line(px, request_id):
    return px.wait_log(lambda l: l.get("msg") == "access" and l.get("request_id") == request_id)


def test_access_log_keeps_the_whole_model():
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["*"], [sim])], log={"level": "info"})
    model = "m1\u0000hidden\"x"
    r = send(px.port, "POST", "/v1/chat/completions", dict(CHAT, model=model), auth=None)
    line = access_line(px, r.headers["x-detproxy-request-id"])
    assert line["model"] == model, line
    px.stop()


def test_a_replica_dying_mid_stream_leaves_an_error_event():
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], log={"level": "info"},
                     attestation={"interval_ms": 600000})
    sim_config(sim, fault="die_mid_stream", fault_count=1)
    body = json.dumps(dict(CHAT, max_tokens=50, stream=True)).encode()
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\n\r\n" % len(body))
    out, closed = exchange(px.port, head + body, timeout=10)
    assert closed
    r = parse_response(out)
    assert r.status == 200 and not r.complete, r
    events = [e for e in r.body.decode().split("\n\n") if e.strip()]
    assert len(events) >= 2, events
    last = events[-1]
    assert last.startswith("data: "), last
    err = json.loads(last[6:])["error"]
    assert err["code"] == "upstream_error" and err["type"] == "server_error", err
    assert "r1" in err["message"] and r.headers["x-detproxy-request-id"] in err["message"], err
    # Every event before it is one the replica sent whole.
    for e in events[:-1]:
        json.loads(e[6:])
    line = access_line(px, r.headers["x-detproxy-request-id"])
    assert line["code"] == "upstream_error", line
    px.stop()


def test_a_stream_cut_by_the_drain_is_logged_drain_closed():
    """SIGTERM with a stream that outlives the drain (limits.shutdown_timeout_ms, here 2 s):
    detproxy cuts it when that time is up, not at the 30 s default, and says so."""
    sim = start_sim("--model", "m1", "--token-delay-ms", "1000")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], log={"level": "info"},
                     limits={"shutdown_timeout_ms": 2000})
    body = json.dumps(dict(CHAT, max_tokens=90, stream=True)).encode()
    s = socket.create_connection(("127.0.0.1", px.port), timeout=60 * SLOW)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    first = s.recv(65536)  # the head and the first event: the stream runs
    assert first.startswith(b"HTTP/1.1 200"), first
    rid = parse_response(first).headers["x-detproxy-request-id"]
    t0 = time.monotonic()
    px.send_signal(signal.SIGTERM)
    px.wait_log(lambda l: l.get("msg") == "drain_timeout", timeout=25 * SLOW)
    took = time.monotonic() - t0
    assert 1.9 <= took < 20, took  # the configured 2 s, far from the default's 30
    draining = px.find_logs("draining")
    assert draining and draining[0]["timeout_ms"] == 2000, draining
    line = access_line(px, rid)
    assert line["status"] == 503 and line["code"] == "drain_closed", line
    s.close()
    assert px.wait(timeout=15) == 0
    px.check_sanitizer()
    assert not [l for l in px.find_logs("access") if l.get("code") == "client_closed"]


if __name__ == "__main__":
    run_tests(globals())
