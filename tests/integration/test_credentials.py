"""Tenant credentials and the admin listener's Authorization handling: a Bearer token that matches
no tenant is 401 invalid_api_key, never the {"any": true} tenant (docs/policy.md §1), unless that
tenant opts in with "unknown_keys": true; two Authorization fields are ambiguous on both
listeners."""

import hashlib
import os
import tempfile

from harness import http, raw_request, run_tests, start_sim
from proxyutil import assert_openai_error, client_requests, parse_response, pool, start_proxy

KEY = "sk-bank-7777"
POLICY = {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]},
     "sampling": {"temperature": {"force": 0}}, "audit": True},
    {"name": "default", "match": {"any": True}},
]}
BODY = {"model": "m1", "prompt": "hi", "max_tokens": 3, "temperature": 1.3}


def setup(policy=POLICY, **top):
    sim = start_sim("--model", "m1")
    d = tempfile.mkdtemp(prefix="detproxy-cred-")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=policy, directory=d,
                     log={"level": "info", "audit_path": os.path.join(d, "audit.jsonl")}, **top)
    return sim, px


def post(px, headers):
    return http("POST", px.port, "/v1/completions", body=BODY, headers=headers)


def test_unknown_bearer_token_is_401_not_the_default_tenant():
    sim, px = setup()
    assert post(px, {"authorization": "Bearer " + KEY}).headers["x-detproxy-tenant"] == "bank"
    before = len(client_requests(sim))
    for auth in ("Bearer sk-bank-7778", "Bearer " + KEY + "x", "Basic Zm9vOmJhcg==",
                 "Bearer", "bearer  " + KEY, KEY):
        r = post(px, {"authorization": auth})
        err = assert_openai_error(r, 401, "invalid_api_key")
        assert KEY not in r.text and "x-detproxy-tenant" not in r.headers, (auth, r)
        assert "match no tenant" in err["message"], err
    # Two Authorization fields (one of them right) are ambiguous.
    data = b'{"model":"m1","prompt":"hi"}'
    r = parse_response(raw_request(px.port, (
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n"
        "authorization: Bearer other\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
        % (KEY, len(data))).encode() + data))
    assert_openai_error(r, 401, "invalid_api_key")
    assert len(client_requests(sim)) == before, "a refused request reached the replica"
    # Without credentials the catch-all still serves.
    r = post(px, {})
    assert r.status == 200 and r.headers["x-detproxy-tenant"] == "default", r
    # Pass-through routes are gated the same way.
    r = http("GET", px.port, "/health", headers={"authorization": "Bearer nope"})
    assert_openai_error(r, 401, "invalid_api_key")
    px.stop()


def test_unknown_keys_opt_out_for_gateways():
    pol = {"tenants": [POLICY["tenants"][0],
                       {"name": "default", "match": {"any": True, "unknown_keys": True}}]}
    sim, px = setup(pol)
    r = post(px, {"authorization": "Bearer gateway-own-token"})
    assert r.status == 200 and r.headers["x-detproxy-tenant"] == "default", r
    assert post(px, {"authorization": "Bearer " + KEY}).headers["x-detproxy-tenant"] == "bank"
    px.stop()


def test_without_a_policy_any_credentials_are_served():
    """With no policy there are no keys to mistype: the built-in default tenant takes requests
    with any Authorization. The OpenAI SDKs always send one (`apiKey` is required), so a 401
    here refused every SDK client of a proxy configured without tenants."""
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])])
    for auth in ("Bearer unused", "Bearer sk-whatever", "Basic Zm9vOmJhcg=="):
        r = post(px, {"authorization": auth})
        assert r.status == 200 and r.headers["x-detproxy-tenant"] == "default", (auth, r)
    assert post(px, {}).status == 200
    px.stop()


def test_admin_token_two_fields_are_ambiguous_and_trailing_space_is_trimmed():
    d = tempfile.mkdtemp(prefix="detproxy-cred-")
    tok = "adm-" + os.urandom(8).hex()
    path = os.path.join(d, "admin-token")
    with open(path, "w") as f:
        f.write(tok + "\n")
    os.chmod(path, 0o600)
    sim, px = setup(admin_token_file=path)

    def admin(*auth):
        head = "GET /metrics HTTP/1.1\r\nhost: x\r\n"
        for a in auth:
            head += "authorization: %s\r\n" % a
        return parse_response(raw_request(px.admin_port, (head + "connection: close\r\n\r\n")
                                          .encode()))

    assert admin("Bearer " + tok).status == 200
    assert admin("Bearer " + tok + "  \t").status == 200
    for pair in (("Bearer " + tok, "Bearer wrong"), ("Bearer wrong", "Bearer " + tok),
                 ("Bearer " + tok, "Bearer " + tok)):
        r = admin(*pair)
        assert r.status == 401, (pair, r)
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
