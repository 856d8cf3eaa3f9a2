"""Sampling policy end to end (docs/policy.md): what the replica actually received, read back
through detproxy-sim's record of its last request."""

import hashlib
import json
import os
import signal
import tempfile

from harness import SLOW, get_json, http, poll_until, post_json, run_tests, sse, start_sim
from proxyutil import metric, pool, sim_stats, start_proxy

BANK_KEY = "sk-bank-test-key-0001"
BANK_SHA = hashlib.sha256(BANK_KEY.encode()).hexdigest()
AUTH = {"authorization": "Bearer " + BANK_KEY, "content-type": "application/json"}

POLICY = {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": [BANK_SHA]},
     "sampling": {"temperature": {"force": 0}, "top_p": {"force": 1}, "seed": {"force": 1234}},
     "deny_params": ["logit_bias"], "audit": True},
    {"name": "team-x", "match": {"header": {"name": "x-tenant", "value": "team-x"}},
     "sampling": {"temperature": {"default": 0.5, "max": 0.8}, "max_tokens": {"max": 5}}},
    {"name": "default", "match": {"any": True},
     "sampling": {"temperature": {"default": 0.7, "max": 1.0}, "seed": {"derive": True}}},
]}


def setup(flavor="vllm", policy=POLICY, audit_path=None, manifest=None, wrapper=(),
          audit_fail=None):
    sim = start_sim("--model", "m1", "--flavor", flavor)
    d = tempfile.mkdtemp(prefix="detproxy-policy-")
    audit_path = audit_path or os.path.join(d, "audit.jsonl")
    p = pool("p", ["m1"], [sim])
    if manifest:
        p["manifest"] = manifest
    log = {"level": "info", "audit_path": audit_path}
    if audit_fail:
        log["audit_fail"] = audit_fail
    px = start_proxy(pools=[p], policy=policy, log=log, directory=d, wrapper=wrapper)
    px.audit_path = audit_path
    return sim, px


def last_body(sim):
    return json.loads(get_json(sim.port, "/_sim/last_request")["body"])


def chat(content="What is 2+2?", **kw):
    b = {"model": "m1", "messages": [{"role": "user", "content": content}], "max_tokens": 6}
    b.update(kw)
    return b


def test_compliance_tenant_is_forced_and_audited():
    sim, px = setup()
    r = post_json(px.port, "/v1/chat/completions", chat(temperature=0.9, top_p=0.5),
                  headers=AUTH)
    assert r.status == 200, r
    got = last_body(sim)
    assert got["temperature"] == 0 and got["top_p"] == 1 and got["seed"] == 1234, got
    assert r.headers["x-detproxy-tenant"] == "bank"
    assert r.headers["x-detproxy-seed"] == "1234"
    assert r.headers["x-detproxy-fingerprint"].startswith("fp_")
    assert r.json()["system_fingerprint"] == r.headers["x-detproxy-fingerprint"]
    # The tenant's credential never reaches the replica.
    seen = get_json(sim.port, "/_sim/last_request")["headers"]
    assert "authorization" not in seen
    # One audit line, written before the response completed.
    lines = [json.loads(l) for l in open(px.audit_path)]
    assert len(lines) == 1, lines
    a = lines[0]
    assert a["tenant"] == "bank" and a["status"] == 200 and a["seed"] == 1234
    assert a["request_id"] == r.headers["x-detproxy-request-id"]
    temp = [c for c in a["params"] if c["param"] == "temperature"][0]
    assert temp["action"] == "forced" and temp["after"] == 0
    sent = get_json(sim.port, "/_sim/last_request")["body"].encode()
    assert a["forwarded_body_sha256"] == hashlib.sha256(sent).hexdigest()
    assert a["response_body_sha256"] == hashlib.sha256(r.body).hexdigest()
    assert BANK_KEY not in open(px.audit_path).read()
    assert metric(px, "detproxy_policy_overrides_total", tenant="bank", param="temperature",
                  action="forced") == 1
    px.stop()
    assert BANK_KEY not in px.stderr_text()


def test_derived_seed_is_stable_across_key_order_and_whitespace():
    sim, px = setup()
    a = http("POST", px.port, "/v1/completions",
             body=b'{"model":"m1","prompt":"tell me a story","max_tokens":4,"temperature":0.5}')
    b = http("POST", px.port, "/v1/completions",
             body=b'{ "temperature": 5e-1, "max_tokens" : 4 ,\n "prompt": "tell me a story",'
                  b' "model": "m1" }')
    c = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "another", "max_tokens": 4})
    assert a.status == b.status == c.status == 200
    assert a.headers["x-detproxy-seed"] == b.headers["x-detproxy-seed"]
    assert a.headers["x-detproxy-seed"] != c.headers["x-detproxy-seed"]
    seed = int(a.headers["x-detproxy-seed"])
    assert 0 <= seed < 2 ** 31
    # The same seed, and the default temperature, reached the replica; same answer twice.
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    got = last_body(sim)
    assert got["temperature"] == 0.7 and got["seed"] == int(c.headers["x-detproxy-seed"])
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    px.stop()


def test_header_tenant_clamps_and_defaults():
    sim, px = setup()
    h = {"x-tenant": "team-x"}
    r = post_json(px.port, "/v1/completions",
                  {"model": "m1", "prompt": "x", "max_tokens": 50, "temperature": 1.5}, headers=h)
    assert r.status == 200 and r.headers["x-detproxy-tenant"] == "team-x"
    got = last_body(sim)
    assert got["temperature"] == 0.8 and got["max_tokens"] == 5 and "seed" not in got
    assert "x-detproxy-seed" not in r.headers
    post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "x"}, headers=h)
    assert last_body(sim)["temperature"] == 0.5
    px.stop()


def test_denied_parameter_never_reaches_the_replica():
    sim, px = setup()
    r = post_json(px.port, "/v1/chat/completions", chat(logit_bias={"50256": -100}),
                  headers=AUTH)
    assert r.status == 400
    e = r.json()["error"]
    assert e["code"] == "policy_violation" and e["param"] == "logit_bias"
    assert sim_stats(sim)["requests"] == 0
    px.stop()


def test_no_tenant_is_401():
    policy = {"tenants": [{"name": "bank", "match": {"api_keys_sha256": [BANK_SHA]}}]}
    sim, px = setup(policy=policy)
    r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "x"})
    assert r.status == 401 and r.json()["error"]["type"] == "authentication_error"
    r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "x"},
                  headers={"authorization": "Bearer wrong"})
    assert r.status == 401
    assert sim_stats(sim)["requests"] == 0
    r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "x"}, headers=AUTH)
    assert r.status == 200
    px.stop()


BAD_BODIES = [
    (b'[1,2]', "invalid_json"),
    (b'{"model":"m1","prompt":"x","temperature":"hot"}', "temperature"),
    (b'{"model":"m1","prompt":"x","seed":1.5}', "seed"),
    (b'{"model":"m1","prompt":"x","seed":-1}', "seed"),
    (b'{"model":"m1","prompt":"x","seed":9223372036854775808}', "seed"),
    (b'{"model":"m1","prompt":"x","temperature":0,"temperature":1}', "duplicate"),
    (b'{"model":"m1","prompt":"x","x":{"a":1,"a":2}}', "duplicate"),
    (b'{"model":"m1","prompt":"x","x":' + b'[' * 200 + b']' * 200 + b'}', "deep"),
    (b'{"model":"m1","prompt":"\xff\xfe"}', "utf"),
    (b'{"model":"m1","prompt":"\\ud800"}', "utf"),
    (b'{"model":"m1","prompt":{"not":"a prompt"}}', "prompt"),
]


def test_bad_bodies_are_refused_before_the_replica():
    sim, px = setup()
    for body, hint in BAD_BODIES:
        r = http("POST", px.port, "/v1/completions", body=body,
                 headers={"content-type": "application/json"})
        assert r.status == 400, (body[:60], r)
        e = r.json()["error"]
        assert e["type"] == "invalid_request_error" and e["message"], e
    assert sim_stats(sim)["requests"] == 0, sim_stats(sim)
    px.stop()


def test_prompt_shapes_and_content_parts_are_policed():
    sim, px = setup()
    for prompt in ("a string", ["two", "strings"], [1, 2, 3], [[1, 2], [3]]):
        r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": prompt,
                                                   "max_tokens": 3}, headers=AUTH)
        assert r.status == 200, (prompt, r)
        got = last_body(sim)
        assert got["prompt"] == prompt and got["temperature"] == 0 and got["seed"] == 1234
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    r = post_json(px.port, "/v1/chat/completions", chat(content=parts, temperature=2),
                  headers=AUTH)
    assert r.status == 200
    got = last_body(sim)
    assert got["messages"][0]["content"] == parts and got["temperature"] == 0
    px.stop()


def test_stream_gets_pool_fingerprint_in_every_chunk():
    sim, px = setup(flavor="tgi", manifest={"framework": {"name": "tgi", "version": "2.0.4"}})
    fps = set()
    body = {"model": "m1", "prompt": "hi", "max_tokens": 4, "stream": True}
    auth = {"authorization": AUTH["authorization"]}
    for _, data in sse(px.port, "/v1/completions", body, headers=auth):
        if data == "[DONE]":
            break
        fps.add(json.loads(data).get("system_fingerprint"))
    assert len(fps) == 1 and list(fps)[0].startswith("fp_"), fps
    px.stop()


def test_upstream_fingerprint_moves_to_header():
    sim, px = setup(flavor="tgi", manifest={"framework": {"name": "tgi", "version": "2.0.4"}})
    direct = post_json(sim.port, "/v1/chat/completions", chat(temperature=0)).json()
    r = post_json(px.port, "/v1/chat/completions", chat(), headers=AUTH)
    assert r.status == 200, r
    assert r.headers["x-detproxy-upstream-fingerprint"] == direct["system_fingerprint"]
    assert r.json()["system_fingerprint"] == r.headers["x-detproxy-fingerprint"]
    px.stop()


def test_tgi_normalisation_drops_top_p_one():
    sim, px = setup(flavor="tgi", manifest={"framework": {"name": "tgi", "version": "2.0.4"}})
    # TGI refuses top_p == 1.0 with 422; the bank tenant forces exactly that.
    assert post_json(sim.port, "/v1/chat/completions", chat(top_p=1.0)).status == 422
    r = post_json(px.port, "/v1/chat/completions", chat(), headers=AUTH)
    assert r.status == 200, r
    got = last_body(sim)
    assert "top_p" not in got and got["temperature"] == 0 and got["seed"] == 1234, got
    px.stop()


def test_audit_reopens_on_sighup_and_survives_write_failure():
    sim, px = setup()
    assert post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "a"},
                     headers=AUTH).status == 200
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    px.send_signal(signal.SIGHUP)
    poll_until(lambda: os.path.exists(px.audit_path), what="audit file reopened")
    assert post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "b"},
                     headers=AUTH).status == 200
    assert len(open(rotated).readlines()) == 1
    assert len(open(px.audit_path).readlines()) == 1
    px.stop()
    # A disk that refuses writes (a 600-byte file size limit: EFBIG), with log.audit_fail
    # "open": requests are still served, each failure is logged and counted, and the process
    # does not die of SIGXFSZ. With the default ("closed") the answers are withheld.
    sim2, px2 = setup(wrapper=["prlimit", "--fsize=600"], audit_fail="open")
    for i in range(3):
        r = post_json(px2.port, "/v1/completions", {"model": "m1", "prompt": "c%d" % i},
                      headers=AUTH)
        assert r.status == 200, r
    px2.wait_log("audit_write_failed")
    assert metric(px2, "detproxy_audit_write_errors_total") >= 1
    px2.stop()
    sim3, px3 = setup(wrapper=["prlimit", "--fsize=600"])
    codes = [post_json(px3.port, "/v1/completions", {"model": "m1", "prompt": "d%d" % i},
                       headers=AUTH) for i in range(4)]
    assert any(r.status == 503 and r.json()["error"]["code"] == "audit_unavailable"
               for r in codes), [r.status for r in codes]
    # A withheld answer's tokens do not count, though the replica spent them: only what was
    # served does (a client that left after a stream's usage is the one exception).
    served = sum(r.json()["usage"]["completion_tokens"] for r in codes if r.status == 200)
    assert metric(px3, "detproxy_tokens_total", kind="completion") == served
    px3.stop()


def test_long_prompts_are_policed_on_the_loop_and_dense_or_huge_bodies_on_the_pool():
    """What policing a body costs grows with its JSON values and escapes, and the bytes hashed:
    a long prompt (few values) is policed on the event loop, a body with more values than the
    loop's budget, or longer than 512 KiB, on the thread pool. Each is policed in full either
    way: the derived seed reaches the replica, and a body refused on the pool is refused with the
    same error as on the loop."""
    sim, px = setup()
    offloaded = lambda: metric(px, "detproxy_policy_offloaded_total")
    assert offloaded() == 0

    def send(body):
        r = http("POST", px.port, "/v1/chat/completions", body=json.dumps(body).encode(),
                 headers={"content-type": "application/json"}, timeout=60)
        assert r.status == 200, r
        assert last_body(sim)["seed"] == int(r.headers["x-detproxy-seed"])
        return r

    prose = chat("a long retrieved context, line after line of it\n" * 5500)  # ~270 KB
    send(prose)
    assert offloaded() == 0
    # 1,500 short messages: ~7,500 values in ~60 KB
    dense = chat("x")
    dense["messages"] = [{"role": "user", "content": "m%d" % i} for i in range(1500)]
    send(dense)
    assert offloaded() == 1
    send(chat("a long retrieved context, line after line of it\n" * 11000))  # ~540 KB
    assert offloaded() == 2
    # A refusal found on the pool is the loop's: the error at the same byte.
    bad = json.dumps(dense).encode()[:-1] + b",}"
    for body in (bad, json.dumps(prose).encode()[:-1] + b",}"):
        r = http("POST", px.port, "/v1/chat/completions", body=body,
                 headers={"content-type": "application/json"})
        assert r.status == 400 and r.json()["error"]["code"] == "invalid_json", r
        assert ("at byte %d" % (len(body) - 1)) in r.json()["error"]["message"], r.json()
    assert offloaded() == 3
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
