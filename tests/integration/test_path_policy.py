"""An inference route spelled differently (percent-encoded letters, dot segments, doubled slashes,
a trailing slash, a query string) is policed exactly like the canonical spelling, because an ASGI
replica (vLLM, SGLang) percent-decodes before routing. Spellings with no safe reading (%2F, a path
above the root) are a 400 and never reach the replica (docs/requests.md §1)."""

import hashlib
import json
import os
import tempfile

from harness import get_json, raw_request, run_tests, start_sim
from proxyutil import assert_openai_error, parse_response, pool, sim_requests, start_proxy

KEY = "sk-compliance-0001"
AUTH = "Bearer " + KEY
POLICY = {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]},
     "sampling": {"temperature": {"force": 0}, "seed": {"derive": True}},
     "deny_params": ["logit_bias"], "audit": True},
    {"name": "default", "match": {"any": True}},
]}

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": 1.7}
COMPLETION = {"model": "m1", "prompt": "hi", "max_tokens": 4, "temperature": 1.7}

# (the client's request-target, what the replica must be asked for, body)
SPELLINGS = [
    ("/v1/%63ompletions", "/v1/completions", COMPLETION),
    ("/v1/chat/%63ompletions", "/v1/chat/completions", CHAT),
    ("/%76%31/chat/completions", "/v1/chat/completions", CHAT),
    ("/v1/%2e/completions", "/v1/completions", COMPLETION),
    ("/v1/x/../completions", "/v1/completions", COMPLETION),
    ("/v1/x/%2E%2E/chat/completions", "/v1/chat/completions", CHAT),
    ("//v1//completions", "/v1/completions", COMPLETION),
    ("/v1/completions/", "/v1/completions", COMPLETION),
    ("/v1/chat/completions/.", "/v1/chat/completions", CHAT),
    ("/v1/completions?api-version=2024-01-01", "/v1/completions?api-version=2024-01-01",
     COMPLETION),
    ("/v1/chat/%63ompletions/?x=%2F", "/v1/chat/completions?x=%2F", CHAT),
]


def post(port, target, body, auth=AUTH):
    data = json.dumps(body).encode()
    head = ("POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-length: %d\r\n%sconnection: close\r\n\r\n"
            % (target, len(data), "authorization: %s\r\n" % auth if auth else ""))
    return parse_response(raw_request(port, head.encode() + data))


def setup():
    sim = start_sim("--model", "m1")
    d = tempfile.mkdtemp(prefix="detproxy-path-")
    audit = os.path.join(d, "audit.jsonl")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=POLICY,
                     log={"level": "info", "audit_path": audit}, directory=d)
    return sim, px, audit


def test_every_spelling_of_an_inference_route_is_policed():
    sim, px, audit = setup()
    canonical = {}
    for route, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = post(px.port, route, body)
        assert r.status == 200, r
        canonical[route] = r.headers["x-detproxy-seed"]
    for n, (target, want, body) in enumerate(SPELLINGS, start=1):
        r = post(px.port, target, body)
        assert r.status == 200, (target, r)
        seen = get_json(sim.port, "/_sim/last_request")
        assert seen["target"] == want, (target, seen["target"])
        got = json.loads(seen["body"])
        # forced temperature, derived seed (the same as the canonical spelling's), fingerprint
        assert got["temperature"] == 0, (target, got)
        route = want.split("?")[0]
        assert got["seed"] == int(canonical[route]), (target, got)
        assert r.headers["x-detproxy-seed"] == canonical[route], target
        assert r.headers["x-detproxy-tenant"] == "bank", target
        fp = r.headers["x-detproxy-fingerprint"]
        assert fp.startswith("fp_") and r.json()["system_fingerprint"] == fp, target
        lines = [json.loads(l) for l in open(audit)]
        assert len(lines) == 2 + n, (target, len(lines))
        assert lines[-1]["request_id"] == r.headers["x-detproxy-request-id"], target
    px.stop()


def test_denied_parameters_hold_under_any_spelling():
    sim, px, _ = setup()
    before = len(sim_requests(sim))
    for target, _, body in SPELLINGS:
        b = dict(body, logit_bias={"1": 5})
        r = post(px.port, target, b)
        assert_openai_error(r, 400, "policy_violation")
    assert len(sim_requests(sim)) == before
    px.stop()


def test_responses_is_policed_under_any_spelling():
    """/v1/responses in this pool (no vLLM framework) cannot carry the bank tenant's derived
    seed: every spelling gets the same 400 and none reaches the replica."""
    sim, px, _ = setup()
    before = len(sim_requests(sim))
    for target in ("/v1/responses", "/v1/%72esponses", "//v1/./responses/", "/%76%31/responses",
                   "/v1/x/../responses?api-version=1", "/v1/respons%65s/."):
        r = post(px.port, target, {"model": "m1", "input": "hi"})
        assert_openai_error(r, 400, "policy_violation")
        assert r.json()["error"]["param"] == "seed", (target, r.json())
    assert len(sim_requests(sim)) == before
    px.stop()


def test_unsafe_spellings_are_refused_before_the_replica():
    sim, px, _ = setup()
    before = len(sim_requests(sim))
    for target in ("/v1%2Fcompletions", "/v1%2fchat%2fcompletions", "/../v1/completions",
                   "/v1/../../v1/completions", "/%2e%2e/v1/completions", "/v1/completions%",
                   "/v1/completions%zz", "/v1/completions#frag"):
        r = post(px.port, target, COMPLETION)
        assert_openai_error(r, 400)
        assert r.json()["error"]["message"], target
    assert len(sim_requests(sim)) == before
    # The canonical route still works on a fresh connection afterwards.
    assert post(px.port, "/v1/completions", COMPLETION).status == 200
    px.stop()


def test_pass_through_forwards_the_normalised_path():
    sim, px, _ = setup()
    r = post(px.port, "/%76%31/x/../embeddings?q=%41", {"model": "m1", "input": "x"},
             auth=None)
    reqs = sim_requests(sim)
    assert reqs and reqs[-1]["target"] == "/v1/embeddings?q=%41", (r, reqs[-1])
    px.stop()


# Generation routes the engines serve besides the two detproxy polices (llama.cpp server:
# /completion, /completions, /chat/completions, /api/chat, /infill, /v1/messages; vLLM and
# SGLang: /invocations, /v1/messages, SGLang's and TGI's /generate, which SGLang also takes as
# PUT). Passed through, each would be a completion with no forced value, no deny_params, no
# seed, no audit line.
NATIVE = [("POST", "/chat/completions", CHAT), ("POST", "/completions", COMPLETION),
          ("POST", "/completion", COMPLETION), ("POST", "/api/chat", CHAT),
          ("POST", "/infill", COMPLETION), ("POST", "/v1/messages", CHAT),
          ("POST", "/generate", COMPLETION), ("PUT", "/generate", COMPLETION),
          ("POST", "/generate_stream", COMPLETION), ("POST", "/invocations", CHAT),
          ("POST", "/inference/v1/generate", COMPLETION), ("POST", "/api/generate", COMPLETION),
          ("POST", "/%63hat/completions/", CHAT), ("POST", "/v1/../completion?x=1", COMPLETION),
          ("POST", "/vertex_generate",
           {"instances": [{"text": "hi"}], "parameters": {"sampling_params": {"temperature": 1.7}}}),
          ("POST", "/v1/batches", {"input_file_id": "f1", "endpoint": "/v1/chat/completions",
                                   "completion_window": "24h"})]


def test_engine_native_generation_routes_are_refused():
    sim, px, _ = setup()
    before = len(sim_requests(sim))
    for method, target, body in NATIVE:
        data = json.dumps(body).encode()
        head = ("%s %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                "content-length: %d\r\nauthorization: %s\r\nconnection: close\r\n\r\n"
                % (method, target, len(data), AUTH))
        r = parse_response(raw_request(px.port, head.encode() + data))
        err = assert_openai_error(r, 404, "unpoliced_route")
        assert "/v1/completions" in err["message"], (target, err)
        assert len(sim_requests(sim)) == before, (method, target)
    # Other pass-through routes still reach the replica for a tenant without a policy (a
    # policed one's are default-deny: test_policy_bypass.py).
    r = post(px.port, "/v1/embeddings", {"model": "m1", "input": "x"}, auth=None)
    assert len(sim_requests(sim)) == before + 1, r
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
