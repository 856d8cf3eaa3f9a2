#!/usr/bin/env python3
"""/v1/responses end to end (docs/requests.md §1, docs/policy.md "/v1/responses"): policed like chat completions (temperature,
top_p, max_output_tokens under max_tokens' rule), a forced or derived seed passed to vLLM (which
takes it as an extra sampling field) and refused with a clear 400 where the pool's framework
cannot honour it, fingerprint handling as for chat, streams relayed per read, usage
(input_tokens, output_tokens) counted in detproxy_tokens_total, and shadows
comparing response.output_text.delta streams like chat deltas."""

import hashlib
import json
import time

from harness import get_json, poll_until, post_json, run_tests, sse, start_sim
from proxyutil import metric, pool, sim_stats, start_proxy

KEY = "sk-responses-bank-1"
AUTH = {"authorization": "Bearer " + KEY}
VLLM = {"framework": {"name": "vllm", "version": "0.6.3"}}
POLICY = {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]},
     "sampling": {"temperature": {"force": 0}, "top_p": {"force": 1}, "seed": {"force": 1234},
                  "max_tokens": {"max": 12}},
     "deny_params": ["tools"]},
    {"name": "default", "match": {"any": True},
     "sampling": {"temperature": {"default": 0.7, "max": 1.0}, "max_tokens": {"default": 7},
                  "seed": {"derive": True}}},
]}


def proxy(sims, manifest=VLLM, **top):
    return start_proxy(pools=[pool("p", ["m1"], sims, manifest=manifest)], policy=POLICY, **top)


def last_body(sim):
    return json.loads(get_json(sim.port, "/_sim/last_request")["body"])


def output_text(resp):
    return "".join(p["text"] for it in resp["output"] if it["type"] == "message"
                   for p in it["content"] if p["type"] == "output_text")


def test_sampling_is_policed_and_the_seed_reaches_vllm():
    sim = start_sim("--model", "m1")
    px = proxy([sim])
    r = post_json(px.port, "/v1/responses",
                  {"model": "m1", "input": "Approve the loan?", "temperature": 0.9,
                   "top_p": 0.3, "max_output_tokens": 500}, headers=AUTH)
    assert r.status == 200, r
    got = last_body(sim)
    assert got["temperature"] == 0 and got["top_p"] == 1 and got["seed"] == 1234, got
    assert got["max_output_tokens"] == 12 and "max_tokens" not in got, got
    assert r.headers["x-detproxy-seed"] == "1234" and r.headers["x-detproxy-tenant"] == "bank"
    body = r.json()
    # Fingerprint handling as for chat: the pool's fingerprint in the body and the header.
    assert body["system_fingerprint"] == r.headers["x-detproxy-fingerprint"], body
    assert body["object"] == "response" and len(output_text(body).split()) == 12, body
    # The default tenant: max_tokens' default becomes max_output_tokens, the seed is derived.
    r = post_json(px.port, "/v1/responses", {"model": "m1", "input": "hello"})
    assert r.status == 200, r
    got = last_body(sim)
    assert got["max_output_tokens"] == 7 and "max_tokens" not in got and "n" not in got, got
    assert got["temperature"] == 0.7 and got["seed"] == int(r.headers["x-detproxy-seed"]), got
    px.stop()


def test_refusals_name_the_parameter():
    sim = start_sim("--model", "m1")
    px = proxy([sim])
    cases = [
        ({"model": "m1", "input": "x", "tools": []}, AUTH, "policy_violation", "tools"),
        ({"model": "m1"}, {}, "invalid_value", "input"),
        ({"model": "m1", "input": 5}, {}, "invalid_value", "input"),
        ({"model": "m1", "input": [1]}, {}, "invalid_value", "input[0]"),
        ({"model": "m1", "input": "x", "max_output_tokens": "9"}, {}, "invalid_value",
         "max_output_tokens"),
        ({"model": "m1", "input": "x", "temperature": "hot"}, {}, "invalid_value", "temperature"),
    ]
    before = sim_stats(sim)["requests"]
    for body, hdrs, code, param in cases:
        r = post_json(px.port, "/v1/responses", body, headers=hdrs)
        assert r.status == 400, (body, r)
        e = r.json()["error"]
        assert e["code"] == code and e["param"] == param, (body, e)
    assert sim_stats(sim)["requests"] == before  # none reached the replica
    px.stop()


def test_a_seed_the_framework_cannot_take_is_refused_not_dropped():
    # A TGI pool: its Responses support (if any) has no seed. The policy derives one for the
    # default tenant and forces one for bank: both are refused with a clear 400.
    sim = start_sim("--model", "m1", "--flavor", "tgi")
    px = proxy([sim], manifest={"framework": {"name": "tgi", "version": "2.0.4"}})
    before = sim_stats(sim)["requests"]
    for hdrs, why in ((AUTH, "set by this tenant's policy"), ({}, "set by this tenant's policy")):
        r = post_json(px.port, "/v1/responses", {"model": "m1", "input": "x"}, headers=hdrs)
        assert r.status == 400, r
        e = r.json()["error"]
        assert e["code"] == "policy_violation" and e["param"] == "seed", e
        assert "/v1/responses cannot carry" in e["message"] and "tgi" in e["message"], e
        assert why in e["message"], e
    assert sim_stats(sim)["requests"] == before
    # Chat completions on the same pool carry the seed as usual.
    r = post_json(px.port, "/v1/chat/completions",
                  {"model": "m1", "messages": [{"role": "user", "content": "x"}]}, headers=AUTH)
    assert r.status == 200 and r.headers["x-detproxy-seed"] == "1234", r
    px.stop()


def test_policy_test_decides_responses_as_the_proxy_does():
    import os
    import tempfile
    from harness import DETPROXY_BIN, run_cmd
    sim = start_sim("--model", "m1", "--flavor", "tgi")
    for fw, ok in (("vllm", True), ("tgi", False)):
        px = proxy([sim], manifest={"framework": {"name": fw, "version": "1"}}, ready=False)
        d = tempfile.mkdtemp(prefix="detproxy-resp-")
        body = os.path.join(d, "b.json")
        with open(body, "w") as f:
            json.dump({"model": "m1", "input": "x", "max_output_tokens": 99}, f)
        rc, out, err = run_cmd([DETPROXY_BIN, "policy", "test", "-c", px.config_path, "--body",
                                body, "-H", "Authorization: Bearer " + KEY])
        o = json.loads(out)
        if ok:
            assert rc == 0 and o["route"] == "/v1/responses", (out, err)
            assert o["body"]["seed"] == 1234 and o["body"]["max_output_tokens"] == 12, o
        else:
            assert rc == 1 and o["status"] == 400 and o["error"]["param"] == "seed", (out, err)
        px.stop()


def test_stream_is_relayed_per_read():
    sim = start_sim("--model", "m1", "--token-delay-ms", "60")
    px = proxy([sim])
    heads = {}
    events = []
    for t, data in sse(px.port, "/v1/responses",
                       {"model": "m1", "input": "stream please", "stream": True,
                        "max_output_tokens": 6}, headers=AUTH,
                       on_open=lambda r: heads.update(r.getheaders())):
        events.append((t, json.loads(data)))
    assert heads["x-detproxy-seed"] == "1234", heads
    types = [e["type"] for _, e in events]
    assert types[0] == "response.created" and types[-1] == "response.incomplete", types
    deltas = [(t, e["delta"]) for t, e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) == 6, types
    # Spread over the generation, not all at the end.
    assert deltas[-1][0] - deltas[0][0] > 0.2, deltas
    final = events[-1][1]["response"]
    assert "".join(d for _, d in deltas) == output_text(final)
    # Its usage (input_tokens, output_tokens) counts in detproxy_tokens_total.
    usage = final["usage"]
    poll_until(lambda: tokens(px) == (usage["input_tokens"], usage["output_tokens"]),
               what="the stream's usage counted: %s, %s" % (usage, tokens(px)))
    # The streamed text equals the unstreamed one (same seed, temperature 0).
    r = post_json(px.port, "/v1/responses",
                  {"model": "m1", "input": "stream please", "max_output_tokens": 6},
                  headers=AUTH)
    assert output_text(r.json()) == output_text(final)
    u = r.json()["usage"]
    poll_until(lambda: tokens(px) == (usage["input_tokens"] + u["input_tokens"],
                                      usage["output_tokens"] + u["output_tokens"]),
               what="the answer's usage counted: %s, %s" % (u, tokens(px)))
    px.stop()


def tokens(px):
    return (metric(px, "detproxy_tokens_total", kind="prompt"),
            metric(px, "detproxy_tokens_total", kind="completion"))


def drift(px):
    return get_json(px.admin_port, "/admin/drift")["pools"]["p"]


def test_shadows_compare_responses_streams_and_bodies():
    sims = [start_sim("--model", "m1", "--quantization", "awq") for _ in range(2)]
    sims.append(start_sim("--model", "m1", "--quantization", "gptq", "--report-quantization",
                          "awq"))
    # Room for every copy: workers run ahead of the control thread that sends the copies, so
    # on a loaded box more than a few are in flight at once (shadow.max_inflight skips them).
    px = proxy(sims, shadow={"rate": 1.0, "self_rate": 0.0, "max_inflight": 64})
    n = 60
    for i in range(n):
        body = {"model": "m1", "input": "compare %d" % i, "max_output_tokens": 10,
                "temperature": 0}
        if i % 2:
            body["stream"] = True
            for _ in sse(px.port, "/v1/responses", body, headers=AUTH):
                pass
        else:
            assert post_json(px.port, "/v1/responses", body, headers=AUTH).status == 200
    poll_until(lambda: drift(px)["cross"]["samples"] >= n - 2, timeout=20, what="samples")
    d = drift(px)
    pairs = {tuple(p["replicas"]): p for p in d["pairs"]}
    good = pairs.get(("r1", "r2")) or pairs.get(("r2", "r1"))
    assert good and good["exact_match_rate"] == 1.0, d["pairs"]
    bad = [p for k, p in pairs.items() if "r3" in k]
    assert bad and all(p["exact_match_rate"] < 0.5 for p in bad), d["pairs"]
    assert d["verdict"] == "cross_replica_drift" and d["suspect"] == "r3", json.dumps(d)[:600]
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
