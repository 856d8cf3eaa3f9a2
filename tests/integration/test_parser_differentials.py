"""Every place where detproxy and a replica could read the same bytes differently has one rule
(docs/security.md, "Parser differentials"), each checked here by what the replica actually
received. Also the allow_params allowlist (docs/policy.md §2)."""

import json
import tempfile

from harness import get_json, http, raw_request, run_tests, start_sim
from proxyutil import assert_openai_error, client_requests, parse_response, pool, start_proxy

POLICY = {"tenants": [
    {"name": "strict", "match": {"header": {"name": "x-tenant", "value": "strict"}},
     "sampling": {"temperature": {"force": 0}},
     "allow_params": ["model", "prompt", "messages", "max_tokens", "temperature", "stream"]},
    {"name": "default", "match": {"any": True},
     "sampling": {"temperature": {"force": 0}, "max_tokens": {"max": 5}}},
]}


def setup():
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=POLICY,
                     directory=tempfile.mkdtemp(prefix="detproxy-diff-"))
    return sim, px


def raw_post(px, body, headers=(), target="/v1/completions"):
    if isinstance(body, str):
        body = body.encode()
    head = "POST %s HTTP/1.1\r\nhost: x\r\n" % target
    for h in headers:
        head += h + "\r\n"
    if not any(h.lower().startswith("transfer-encoding") for h in headers):
        head += "content-length: %d\r\n" % len(body)
    return parse_response(raw_request(px.port, (head + "connection: close\r\n\r\n").encode() +
                                      body))


def received(sim):
    """The body the replica got, parsed the way a Python replica (vLLM, SGLang) parses it."""
    return json.loads(get_json(sim.port, "/_sim/last_request")["body"])


def test_unicode_escaped_keys_are_the_same_key():
    sim, px = setup()
    r = raw_post(px, '{"model":"m1","prompt":"x","\\u0074emperature":1.9,"max_\\u0074okens":50}')
    assert r.status == 200, r
    got = received(sim)
    assert got["temperature"] == 0 and got["max_tokens"] == 5, got
    px.stop()


def test_duplicate_keys_are_refused_in_any_spelling():
    sim, px = setup()
    before = len(client_requests(sim))
    for body in ('{"model":"m1","prompt":"x","temperature":0,"temperature":2}',
                 '{"model":"m1","prompt":"x","temperature":0,"\\u0074emperature":2}',
                 '{"model":"m1","prompt":"x","extra":{"a":1,"\\u0061":2}}'):
        err = assert_openai_error(raw_post(px, body), 400, "duplicate_key")
        assert "duplicate key" in err["message"], err
    assert len(client_requests(sim)) == before
    px.stop()


def test_numbers_a_python_replica_would_read_differently_are_refused():
    sim, px = setup()
    before = len(client_requests(sim))
    # Python's json takes NaN, Infinity and 1e400 (inf); an integer parameter given as 1e2 or
    # 6.0, or beyond 64 bits, has no single reading across engines.
    for body in ('{"model":"m1","prompt":"x","temperature":NaN}',
                 '{"model":"m1","prompt":"x","temperature":Infinity}',
                 '{"model":"m1","prompt":"x","temperature":1e400}',
                 '{"model":"m1","prompt":"x","max_tokens":1e2}',
                 '{"model":"m1","prompt":"x","max_tokens":6.0}',
                 '{"model":"m1","prompt":"x","max_tokens":100000000000000000000}'):
        assert_openai_error(raw_post(px, body), 400)
    assert len(client_requests(sim)) == before
    # What is accepted reads back as the same double it was policed as.
    r = raw_post(px, '{"model":"m1","prompt":"x","temperature":0.70000000000000001}')
    assert r.status == 200 and received(sim)["temperature"] == 0, r
    px.stop()


def test_strings_only_one_reading():
    sim, px = setup()
    before = len(client_requests(sim))
    for body in (b'{"model":"m1","prompt":"\\ud800"}',        # lone surrogate
                 b'{"model":"m1","prompt":"\xff"}',           # invalid UTF-8
                 b'\xef\xbb\xbf{"model":"m1","prompt":"x"}',  # BOM
                 b'{"model":"m1","prompt":"x"}{"temperature":2}'):  # a second value
        assert_openai_error(raw_post(px, body), 400, "invalid_json")
    assert len(client_requests(sim)) == before
    px.stop()


def test_content_type_and_framing_do_not_change_policing():
    sim, px = setup()
    body = '{"model":"m1","prompt":"x","temperature":1.9}'
    for headers in (("content-type: text/plain",), (),
                    ("content-type: application/json; charset=utf-8",)):
        r = raw_post(px, body, headers)
        assert r.status == 200 and received(sim)["temperature"] == 0, (headers, r)
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in
                       (body[:10].encode(), body[10:].encode())) + b"0\r\n\r\n"
    r = raw_post(px, chunked, ("transfer-encoding: chunked",))
    assert r.status == 200 and received(sim)["temperature"] == 0, r
    px.stop()


def test_header_folding_and_duplicated_tenant_headers_are_refused():
    sim, px = setup()
    before = len(client_requests(sim))
    body = '{"model":"m1","prompt":"x","min_p":0.3}'
    # obs-fold: one reading joins the lines, another drops the continuation
    r = raw_post(px, body, ("x-tenant: strict", " more"))
    assert_openai_error(r, 400)
    # two x-tenant fields: the tenant matcher refuses the header match, so the request is not
    # the strict tenant; it is the credential-less default, whose rules still apply
    r = raw_post(px, '{"model":"m1","prompt":"x","temperature":1.5}',
                 ("x-tenant: strict", "x-tenant: strict"))
    assert r.status == 200 and r.headers["x-detproxy-tenant"] == "default", r
    assert received(sim)["temperature"] == 0
    assert len(client_requests(sim)) == before + 1
    px.stop()


def test_query_strings_are_forwarded_and_never_policed():
    sim, px = setup()
    r = raw_post(px, '{"model":"m1","prompt":"x","temperature":1.9}',
                 target="/v1/completions?temperature=2&stream=true")
    assert r.status == 200, r
    seen = get_json(sim.port, "/_sim/last_request")
    assert seen["target"] == "/v1/completions?temperature=2&stream=true", seen
    assert json.loads(seen["body"])["temperature"] == 0
    px.stop()


def test_allow_params_refuses_every_other_top_level_key():
    sim, px = setup()
    h = ("x-tenant: strict", "content-type: application/json")
    r = raw_post(px, '{"model":"m1","prompt":"x","temperature":1.2,"max_tokens":3}', h)
    assert r.status == 200 and received(sim)["temperature"] == 0, r
    before = len(client_requests(sim))
    for key, value in (("min_p", 0.5), ("best_of", 3), ("repetition_penalty", 1.3),
                       ("sampling_params", {"temperature": 2}), ("max_new_tokens", 9),
                       ("seed", 1), ("\\u006din_p", 0.5)):
        body = '{"model":"m1","prompt":"x","%s":%s}' % (key, json.dumps(value))
        err = assert_openai_error(raw_post(px, body, h), 400, "policy_violation")
        name = key.replace("\\u006d", "m")
        assert err["param"] == name and name in err["message"], err
        assert "allow_params" in err["message"], err
    assert len(client_requests(sim)) == before
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
