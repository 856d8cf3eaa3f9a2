"""Credentials and secret hygiene (docs/security.md §4, §5): the pool's api_key_file on every request
to a replica (client traffic, metadata, attestation, canary, shadow) and the tenant's own
credential on none; admin_token_file on the admin listener; and no secret — tenant keys, tokens,
key files — in logs, audit lines, metrics, admin output or error bodies, after a run that used
every one of them and provoked the errors around them. Secret files readable by group or others
are a warning that names the file, never its contents."""

import base64
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import tempfile
import threading

import http.client as hc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from certs import client_context, shared_pki
from harness import (DETPROXY_BIN, SLOW, get_json, http, poll_until, post_json, run_cmd,
                     run_tests, start_process, start_sim, wait_http)
from proxyutil import pool, read_response, sim_requests, start_proxy, write_config

PKI = shared_pki()
MODEL = "m1"
FW = {"name": "vllm", "version": "0.6.3"}


def token(prefix):
    return prefix + secrets.token_hex(16)


def write_secret(d, name, value, mode=0o600):
    p = os.path.join(d, name)
    with open(p, "w") as f:
        f.write(value + "\n")
    os.chmod(p, mode)
    return p


def sha(s):
    return hashlib.sha256(s.encode()).hexdigest()


def pem_body_lines(path):
    """The base64 lines of a PEM file: what a leaked key would look like in any output."""
    return [l.strip() for l in open(path) if l.strip() and not l.startswith("-----")]


def forms(value):
    """The ways a secret string could leak: as is, hex of its bytes, base64, JSON-escaped."""
    b = value.encode()
    return [value, b.hex(), base64.b64encode(b).decode().rstrip("="),
            json.dumps(value)[1:-1]]


class KeyGate:
    """A vLLM started with --api-key, played by a small gate in front of a detproxy-sim: every
    /v1/* request needs `Authorization: Bearer <key>` (401 otherwise, in vLLM's shape); the rest
    (/version, /health) is open, as in vLLM. Allowed requests are forwarded to the sim with
    their headers (so /_sim/requests shows what the proxy sent); .seen lists (method, path,
    Authorization) of every request, .refused counts the 401s."""

    def __init__(self, sim, key):
        gate = self
        self.sim, self.key, self.seen, self.refused = sim, key, [], 0

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def handle_one(self, method):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else None
                auth = self.headers.get("authorization")
                gate.seen.append((method, self.path, auth))
                if self.path.startswith("/v1/") and auth != "Bearer " + gate.key:
                    gate.refused += 1
                    out = b'{"error":"Unauthorized"}'
                    self.send_response(401)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)
                    return
                c = hc.HTTPConnection("127.0.0.1", gate.sim.port, timeout=30)
                hdrs = {k: v for k, v in self.headers.items()
                        if k.lower() not in ("connection", "keep-alive", "content-length",
                                             "transfer-encoding", "host")}
                c.request(method, self.path, body=body, headers=hdrs)
                r = c.getresponse()
                out = r.read()
                self.send_response(r.status)
                self.send_header("content-type", r.getheader("content-type") or "text/plain")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                c.close()

            def do_GET(self):
                self.handle_one("GET")

            def do_POST(self):
                self.handle_one("POST")

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.srv.daemon_threads = True
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def stop(self):
        self.srv.shutdown()
        self.srv.server_close()


def canary_for(prompt, n=8):
    s = start_sim("--model", MODEL)
    r = post_json(s.port, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": n,
                                              "temperature": 0, "seed": 0}).json()
    s.stop()
    return {"prompt": prompt, "max_tokens": n,
            "expected_sha256": sha(r["choices"][0]["text"])}


def admin(px, method, path, tok=None, body=None):
    h = {"authorization": "Bearer " + tok} if tok else {}
    return http(method, px.admin_port, path, body=body, headers=h)


# ---- api_key_file ------------------------------------------------------------------------------


def test_the_pool_key_goes_to_replicas_and_the_tenant_key_never_does():
    d = tempfile.mkdtemp(prefix="detproxy-keys-")
    tenant_key, pool_key = token("sk-tenant-"), token("pk-pool-")
    keyf = write_secret(d, "vllm-api-key", pool_key)
    sim = start_sim("--model", MODEL, "--flavor", "vllm", "--framework-version", "0.6.3")
    gate = KeyGate(sim, pool_key)  # refuses anything else on /v1/*
    p = pool("p", [MODEL], [sim], api_key_file=keyf,
             manifest={"model": MODEL, "framework": FW, "canary": canary_for("Count: one,")})
    p["replicas"][0] = {"name": "r1", "url": "http://127.0.0.1:%d" % gate.port,
                        "attest": {"source": "vllm"}}
    policy = {"tenants": [{"name": "bank", "match": {"api_keys_sha256": [sha(tenant_key)]},
                           "sampling": {"temperature": {"force": 0}, "seed": {"force": 7}}}]}
    px = start_proxy(pools=[p], policy=policy, directory=d,
                     attestation={"interval_ms": 300, "timeout_ms": 2000,
                                  "require_signature": False},
                     shadow={"rate": 0.0, "self_rate": 1.0, "max_inflight": 4})
    poll_until(lambda: any(q["method"] == "POST" and "Count: one," in q["body"]
                           for q in sim_requests(sim)), what="a canary request")
    auth = {"authorization": "Bearer " + tenant_key,
            "proxy-authorization": "Basic " + base64.b64encode(tenant_key.encode()).decode()}
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3},
                  headers=auth)
    assert r.status == 200 and r.headers["x-detproxy-tenant"] == "bank", r
    r = post_json(px.port, "/v1/chat/completions",
                  {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                   "max_tokens": 3, "stream": True},
                  headers={"AUTHORIZATION": "bearer " + tenant_key})
    assert r.status == 200, r
    # A passthrough route (forwarded unbuffered): the credential is replaced there too.
    r = http("GET", px.port, "/v1/models/" + MODEL, headers=auth)
    poll_until(lambda: any("x-detproxy-shadow" in q["headers"] for q in sim_requests(sim)),
               what="a shadow copy")
    assert gate.refused == 0, gate.seen  # nothing reached the replica without the pool's key
    reqs = sim_requests(sim)
    kinds = {"client": 0, "shadow": 0, "canary": 0, "metadata": 0}
    for q in reqs:
        text = json.dumps(q)
        assert tenant_key not in text, q  # in no header, no body
        if q["path"].startswith("/v1/"):
            assert q["headers"].get("authorization") == "Bearer " + pool_key, q
        assert "proxy-authorization" not in q["headers"], q
        if "x-detproxy-shadow" in q["headers"]:
            kinds["shadow"] += 1
        elif "x-detproxy-request-id" in q["headers"]:
            kinds["client"] += 1
        elif q["method"] == "POST":
            kinds["canary"] += 1
        else:
            kinds["metadata"] += 1
    assert all(kinds.values()), kinds
    passthrough = [q for q in reqs if q["path"] == "/v1/models/" + MODEL]
    assert passthrough and passthrough[0]["headers"]["authorization"] == "Bearer " + pool_key
    # The vLLM adapter's metadata GETs all carried the key (as a vLLM with --api-key needs).
    assert any(path.startswith("/version") for _, path, _ in gate.seen), gate.seen
    assert all(a == "Bearer " + pool_key for _, _, a in gate.seen), gate.seen
    px.stop()
    gate.stop()


def test_agent_attestation_requests_carry_the_pool_key():
    d = tempfile.mkdtemp(prefix="detproxy-keys-")
    pool_key = token("pk-pool-")
    keyf = write_secret(d, "api-key", pool_key)
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", os.path.join(d, "sign")])
    assert rc == 0, err
    ckpt = sha("ckpt")
    sim = start_sim("--model", MODEL, "--checkpoint-sha256", ckpt, "--quantization", "awq",
                    "--dtype", "float16", "--framework-version", "0.6.3",
                    "--attest-key", os.path.join(d, "sign.key.pem"))
    p = pool("p", [MODEL], [sim], api_key_file=keyf,
             manifest={"model": MODEL, "checkpoint_sha256": ckpt, "quantization": "awq",
                       "dtype": "float16", "framework": FW})
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % sim.port}
    px = start_proxy(pools=[p], directory=d,
                     attestation={"interval_ms": 300, "timeout_ms": 2000,
                                  "require_signature": True,
                                  "trusted_keys": [os.path.join(d, "sign.pub.pem")]})
    att = [q for q in sim_requests(sim) if q["path"] == "/attestation"]
    assert att and all(q["headers"].get("authorization") == "Bearer " + pool_key for q in att)
    px.stop()


def test_a_replica_refusing_the_key_is_not_admitted_and_the_key_is_not_echoed():
    d = tempfile.mkdtemp(prefix="detproxy-keys-")
    right, wrong = token("pk-right-"), token("pk-wrong-")
    sim = start_sim("--model", MODEL, "--flavor", "vllm", "--framework-version", "0.6.3")
    gate = KeyGate(sim, right)
    p = pool("p", [MODEL], [sim], api_key_file=write_secret(d, "key", wrong),
             manifest={"model": MODEL, "framework": FW})
    p["replicas"][0] = {"name": "r1", "url": "http://127.0.0.1:%d" % gate.port,
                        "attest": {"source": "vllm"}}
    px = start_proxy(pools=[p], directory=d, ready=False,
                     attestation={"interval_ms": 300, "timeout_ms": 2000,
                                  "require_signature": False})
    poll_until(lambda: gate.refused > 0, what="the replica refusing the key")
    rep = poll_until(lambda: [x for x in get_json(px.admin_port, "/admin/replicas")["replicas"]
                              if x["state"] in ("rejected", "unreachable")], what="not admitted")
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert r.status == 503, r
    outs = [json.dumps(rep), r.text, px.stderr_text(),
            http("GET", px.admin_port, "/metrics").text]
    print("    reasons: %s" % rep[0]["reasons"])
    assert "401" in json.dumps(rep), rep
    for o in outs:
        for s in (right, wrong):
            assert s not in o
    px.stop()
    gate.stop()


# ---- admin_token_file ---------------------------------------------------------------------------


def test_admin_endpoints_need_the_token_except_health():
    d = tempfile.mkdtemp(prefix="detproxy-admin-")
    tok = token("adm-")
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], directory=d,
                     admin_token_file=write_secret(d, "admin-token", tok))
    protected = [("GET", "/metrics"), ("GET", "/admin/replicas"), ("GET", "/admin/drift"),
                 ("POST", "/admin/reload"), ("GET", "/admin/nonexistent")]
    wrong = [None, token("adm-"), tok + "x", tok[:-1], ""]
    for method, path in protected:
        for w in wrong:
            r = admin(px, method, path, w)
            assert r.status == 401, (method, path, w, r)
            assert r.headers.get("www-authenticate", "").lower().startswith("bearer"), r
            assert tok not in r.text
        for h in ({"authorization": "Basic " + base64.b64encode(("x:" + tok).encode()).decode()},
                  {"authorization": tok}, {"authorization": "Bearer  " + tok},
                  {"x-admin-token": tok}):
            r = http(method, px.admin_port, path, headers=h)
            assert r.status == 401, (method, path, h, r)
    for method, path in protected[:4]:
        r = admin(px, method, path, tok)
        assert r.status == 200, (method, path, r)
        # The scheme is case-insensitive (RFC 9110 §11.1).
        r = http(method, px.admin_port, path, headers={"authorization": "bearer " + tok})
        assert r.status == 200, (method, path, r)
    assert admin(px, "GET", "/admin/nonexistent", tok).status == 404
    for path in ("/healthz", "/readyz"):
        assert http("GET", px.admin_port, path).status == 200, path
        assert admin(px, "GET", path, "wrong").status == 200, path
    # The client listener never serves admin endpoints, with or without the token.
    for path in ("/metrics", "/admin/replicas", "/admin/reload"):
        r = http("GET", px.port, path, headers={"authorization": "Bearer " + tok})
        assert "detproxy_requests_total" not in r.text and '"replicas"' not in r.text, r
    assert tok not in px.stderr_text()
    px.stop()


def test_an_admin_request_without_the_token_is_refused_before_its_body():
    """The token is checked on the head: a client without it is answered 401 at once and holds
    no body in the proxy (it used to be read whole first, up to max_body_bytes each)."""
    d = tempfile.mkdtemp(prefix="detproxy-admin-")
    tok = token("adm-")
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], directory=d,
                     admin_token_file=write_secret(d, "admin-token", tok))
    for path in ("/admin/reload", "/healthz", "/admin/relay/p/v1/completions"):
        with socket.create_connection(("127.0.0.1", px.admin_port), timeout=10) as c:
            c.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"content-length: 8000000\r\n\r\n{" % path.encode())
            r = read_response(c, timeout=5)
            assert r.status == 401, (path, r)
    # With the token the body is read and the request served.
    r = admin(px, "POST", "/admin/reload", tok, body={})
    assert r.status == 200, r
    px.stop()


def test_check_refuses_an_admin_token_no_header_can_carry():
    """A token with a space in it or before it could never match Authorization: Bearer (its
    parser refuses such a token): check refuses it instead of letting it lock every admin
    request out (control bytes were refused already)."""
    d = tempfile.mkdtemp(prefix="detproxy-admin-")
    base = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "pools": [
        {"name": "p", "models": ["*"], "replicas": [{"name": "r1",
                                                     "url": "http://127.0.0.1:9"}]}]}
    for bad in ("correct horse battery", "  leadingblanks"):
        cfg = dict(base, admin_token_file=write_secret(d, "tok", bad))
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg, d)])
        assert rc == 1 and "admin_token_file" in err and "Bearer" in err, (bad, rc, err)
        assert bad.strip() not in err, err  # the error names the byte, not the secret
    cfg = dict(base, admin_token_file=write_secret(d, "tok", "ok-token\n"))
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg, d)])
    assert rc == 0, (rc, err)


def test_check_refuses_a_non_loopback_admin_listener_without_a_token():
    d = tempfile.mkdtemp(prefix="detproxy-admin-")
    base = {"listen": "127.0.0.1:0", "pools": [
        {"name": "p", "models": ["*"], "replicas": [{"name": "r1",
                                                     "url": "http://127.0.0.1:9"}]}]}
    for addr in ("0.0.0.0:9901", "[::]:9901", "10.1.2.3:9901", "192.168.0.1:9901"):
        cfg = dict(base, admin_listen=addr)
        path = write_config(cfg, d)
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
        assert rc == 1, (addr, rc, out, err)
        assert "admin_listen" in err and "admin_token_file" in err, (addr, err)
        # `run` refuses the same config.
        rc, out, err = run_cmd([DETPROXY_BIN, "run", "-c", path], timeout=10)
        assert rc == 1 and "admin_listen" in err, (addr, rc, err)
        cfg["admin_token_file"] = write_secret(d, "tok", token("adm-"))
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg, d)])
        assert rc == 0, (addr, rc, out, err)
    for addr in ("127.0.0.1:9901", "127.0.0.2:9901", "[::1]:9901"):
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c",
                                write_config(dict(base, admin_listen=addr), d)])
        assert rc == 0, (addr, rc, out, err)


def test_a_reload_cannot_remove_the_token_of_a_listener_bound_beyond_loopback():
    """The admin listener keeps its address until a restart: a reload whose file moves it to
    loopback and drops the token is refused (the bound listener would answer anyone), and the
    token still guards every admin endpoint."""
    d = tempfile.mkdtemp(prefix="detproxy-admin-")
    tok = token("adm-")
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], directory=d, admin_listen="0.0.0.0:0",
                     admin_token_file=write_secret(d, "admin-token", tok))
    with open(px.config_path) as f:
        cfg = json.load(f)
    # First a reload that only moves the address (accepted, the listener stays where it is),
    # then one that drops the token: the rule is the bound address's, not the last file's.
    cfg["admin_listen"] = "127.0.0.1:%d" % px.admin_port
    with open(px.config_path, "w") as f:
        json.dump(cfg, f)
    assert admin(px, "POST", "/admin/reload", tok).status == 200
    assert admin(px, "GET", "/admin/config", tok).json()["admin_listen"].startswith("0.0.0.0:")
    del cfg["admin_token_file"]
    with open(px.config_path, "w") as f:
        json.dump(cfg, f)
    r = admin(px, "POST", "/admin/reload", tok)
    assert r.status == 400 and "admin_token_file" in r.text and "0.0.0.0" in r.text, r
    assert admin(px, "GET", "/admin/config").status == 401
    assert admin(px, "GET", "/admin/config", tok).status == 200
    px.send_signal(signal.SIGHUP)
    poll_until(lambda: px.stderr_text().count("a reload cannot remove its token") >= 2,
               what="the SIGHUP reload refused too")
    assert admin(px, "GET", "/admin/replicas").status == 401
    px.stop()


# ---- secret hygiene ---------------------------------------------------------------------------


def test_no_secret_appears_in_any_output_after_a_run_that_used_them_all():
    d = tempfile.mkdtemp(prefix="detproxy-secrets-")
    tenant_key, wrong_tenant = token("sk-tenant-"), token("sk-guess-")
    pool_key, pool2_key, gate_key = token("pk-pool-"), token("pk-pool2-"), token("pk-gate-")
    admin_tok, wrong_admin = token("adm-"), token("adm-guess-")
    fw_key = token("fw-")
    # Key files: the listener's TLS key, the client key for upstream mTLS, the signing key.
    shutil.copyfile(PKI.server.key, os.path.join(d, "tls.key"))
    shutil.copyfile(PKI.server.crt, os.path.join(d, "tls.crt"))
    shutil.copyfile(PKI.client.key, os.path.join(d, "client.key"))
    shutil.copyfile(PKI.client.crt, os.path.join(d, "client.crt"))
    for f in ("tls.key", "client.key"):
        os.chmod(os.path.join(d, f), 0o600)
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", os.path.join(d, "sign")])
    assert rc == 0, err
    key_files = [os.path.join(d, "tls.key"), os.path.join(d, "client.key"),
                 os.path.join(d, "sign.key.pem")]
    write_secret(d, "pool-key", pool_key)
    write_secret(d, "pool2-key", pool2_key)
    write_secret(d, "admin-token", admin_tok)
    write_secret(d, "fw-key", fw_key)

    model_dir = os.path.join(d, "model")
    os.makedirs(model_dir)
    with open(os.path.join(model_dir, "w.bin"), "wb") as f:
        f.write(b"w" * 100)
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "hash", model_dir])
    ckpt = out.split()[0]
    # r1: a TLS replica signing its own attestations (sim --attest-key).
    sim1 = start_sim("--model", MODEL, "--checkpoint-sha256", ckpt, "--quantization", "awq",
                     "--dtype", "float16", "--framework-version", "0.6.3",
                     "--attest-key", os.path.join(d, "sign.key.pem"),
                     "--tls-cert", PKI.server.crt, "--tls-key", PKI.server.key)
    # r2: a plaintext replica with the attestation agent beside it over TLS, reading the
    # framework's version with its own key.
    sim2 = start_sim("--model", MODEL, "--checkpoint-sha256", ckpt, "--quantization", "awq",
                     "--dtype", "float16", "--framework-version", "0.6.3")
    agent = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                           "--model-dir", model_dir, "--model", MODEL, "--quantization", "awq",
                           "--dtype", "float16", "--framework-url",
                           "http://127.0.0.1:%d" % sim2.port,
                           "--framework-api-key-file", os.path.join(d, "fw-key"),
                           "--key", os.path.join(d, "sign.key.pem"),
                           "--tls-cert", os.path.join(d, "tls.crt"),
                           "--tls-key", os.path.join(d, "tls.key")], name="agent")
    # A second pool whose replica refuses its key.
    sim3 = start_sim("--model", "m-refusing", "--flavor", "vllm")
    gate = KeyGate(sim3, gate_key)
    man = {"model": MODEL, "checkpoint_sha256": ckpt, "quantization": "awq", "dtype": "float16",
           "framework": FW}
    cfg = {
        "tls": {"cert_file": "tls.crt", "key_file": "tls.key"},
        "admin_token_file": "admin-token",
        "attestation": {"interval_ms": 300, "timeout_ms": 2000, "require_signature": True,
                        "trusted_keys": ["sign.pub.pem"]},
        "pools": [
            {"name": "p", "models": [MODEL], "manifest": man, "api_key_file": "pool-key",
             "upstream_tls": {"ca_file": PKI.ca.crt, "client_cert_file": "client.crt",
                              "client_key_file": "client.key"},
             "replicas": [
                 {"name": "r1", "url": "https://localhost:%d" % sim1.port,
                  "attest": {"source": "agent",
                             "url": "https://localhost:%d/attestation" % sim1.port}},
                 {"name": "r2", "url": "http://127.0.0.1:%d" % sim2.port,
                  "attest": {"source": "agent",
                             "url": "https://localhost:%d/attestation" % agent.port}}]},
            {"name": "refusing", "models": ["m-refusing"], "api_key_file": "pool2-key",
             "replicas": [{"name": "g1", "url": "http://127.0.0.1:%d" % gate.port}]}],
        "policy": {"tenants": [
            {"name": "bank", "match": {"api_keys_sha256": [sha(tenant_key)]}, "audit": True,
             "sampling": {"temperature": {"force": 0}, "seed": {"force": 1}}},
            {"name": "team", "match": {"header": {"name": "x-team", "value": "t"}}}]},
        "shadow": {"rate": 1.0, "self_rate": 0.0, "max_inflight": 4},
        "log": {"level": "debug", "audit_path": "audit.jsonl"},
    }
    px = start_proxy(config=cfg, directory=d, ready=False)
    try:
        tok = {"authorization": "Bearer " + admin_tok}
        poll_until(lambda: all(r["state"] == "admitted" for r in get_json(
            px.admin_port, "/admin/replicas", headers=tok)["replicas"] if r["pool"] == "p"),
            timeout=20, what="pool p admitted")
        outputs = {}  # name -> text, everything a secret must not appear in

        def keep(name, text):
            outputs["%s #%d" % (name, len(outputs))] = text

        ctx = client_context(PKI.ca)

        def req(method, path, body=None, headers=None):
            c = hc.HTTPSConnection("127.0.0.1", px.port, context=ctx, timeout=30 * SLOW)
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            h = {"content-type": "application/json"} if data else {}
            h.update(headers or {})
            c.request(method, path, body=data, headers=h)
            r = c.getresponse()
            text = r.read().decode("utf-8", "replace")
            hdrs = "\n".join("%s: %s" % kv for kv in r.getheaders())
            c.close()
            keep("%s %s -> %d" % (method, path, r.status), hdrs + "\n" + text)
            return r.status

        good = {"authorization": "Bearer " + tenant_key}
        for i in range(6):
            assert req("POST", "/v1/completions", {"model": MODEL, "prompt": "p%d" % i,
                                                   "max_tokens": 3}, good) == 200
        assert req("POST", "/v1/completions", {"model": MODEL, "prompt": "s", "max_tokens": 3,
                                               "stream": True}, good) == 200
        # Errors around the secrets.
        assert req("POST", "/v1/completions", {"model": MODEL, "prompt": "x"},
                   {"authorization": "Bearer " + wrong_tenant}) == 401
        assert req("POST", "/v1/completions", {"model": MODEL, "prompt": "x"},
                   {"authorization": "Basic " + base64.b64encode(
                       (tenant_key + ":x").encode()).decode()}) == 401
        assert req("POST", "/v1/completions", {"model": MODEL, "prompt": "x"},
                   dict(good, **{"x-team": "t"})) == 200
        assert req("POST", "/v1/completions", {"model": "m-refusing", "prompt": "x"},
                   {"x-team": "t"}) == 503
        assert req("POST", "/v1/completions", {"model": "nope", "prompt": "x"}, good) == 404
        assert req("POST", "/v1/completions", b'{"model": "m1", "prompt": ' + tenant_key.encode(),
                   good) == 400  # the key inside a body that fails to parse
        poll_until(lambda: gate.refused > 0, what="the refusing replica")
        for path in ("/metrics", "/admin/replicas", "/admin/drift"):
            r = http("GET", px.admin_port, path, headers={"authorization": "Bearer " + wrong_admin})
            assert r.status == 401
            keep("admin %s wrong token" % path, r.text)
            r = http("GET", px.admin_port, path, headers=tok)
            assert r.status == 200, r
            keep("admin " + path, r.text)
        for path in ("/healthz", "/readyz"):
            keep("admin " + path, http("GET", px.admin_port, path).text)
        # Bad reloads whose files hold secrets: JSON and PEM parsers must not quote them.
        bad = json.loads(json.dumps(cfg))
        bad["policy"] = "pool-key"                               # a secret where JSON is expected
        bad["pools"][0]["manifest"] = "admin-token"
        bad["tls"]["cert_file"] = "tls.key"                      # a key where a certificate is
        bad["attestation"]["trusted_keys"] = ["sign.key.pem"]    # a private key as a public one
        bad["pools"][0]["upstream_tls"]["ca_file"] = "client.key"
        bad["pools"][1]["api_key_file"] = "tls.key"              # a PEM file as an API key
        bad["admin_token_file"] = "admin-token"
        write_config(bad, d)
        r = http("POST", px.admin_port, "/admin/reload", headers=tok)
        assert r.status == 400, r
        keep("reload body", r.text)
        px.send_signal(signal.SIGHUP)
        px.wait_log("reload_failed", start=0)
        poll_until(lambda: len(px.find_logs("reload_failed")) >= 2, what="SIGHUP reload failed")
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
        assert rc == 1
        keep("check bad", out + err)
        # A secret file with a newline in the middle (it would split a header): refused by name.
        with open(os.path.join(d, "pool2-key"), "w") as f:
            f.write(pool2_key[:10] + "\n" + pool2_key[10:] + "\n")
        os.chmod(os.path.join(d, "pool2-key"), 0o600)
        write_config(cfg, d)
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
        assert rc == 1 and "pool2-key" in err, err
        keep("check control chars", out + err)
        r = http("POST", px.admin_port, "/admin/reload", headers=tok)
        assert r.status == 400
        keep("reload control chars", r.text)
        write_secret(d, "pool2-key", pool2_key)
        r = http("POST", px.admin_port, "/admin/reload", headers=tok)
        assert r.status == 200, r
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
        assert rc == 0, err
        keep("check ok", out + err)
        rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "-c", px.config_path, "--pool", "p",
                                "--repeat", "2", "--concurrency", "2", "--json"], timeout=60)
        keep("diagnose", out + err)
        assert req("POST", "/v1/completions",
                   {"model": MODEL, "prompt": "after", "max_tokens": 3}, good) == 200
    except Exception as e:
        # Keep the evidence: which process died, and what it said last.
        raise AssertionError("%r\nproxy alive=%s, log tail:\n%s\nagent log tail:\n%s" % (
            e, px.alive(), "\n".join(px.lines[-30:]), "\n".join(agent.lines[-10:]))) from e
    px.stop()
    agent.stop()
    keep("proxy stderr", px.stderr_text())
    keep("agent stderr", agent.stderr_text())
    audit = open(os.path.join(d, "audit.jsonl")).read()
    assert audit.count("\n") >= 6, audit
    keep("audit", audit)
    for s in (sim1, sim2, sim3):
        s.stop()
        keep("sim stderr", s.stderr_text())
    for name, text in outputs.items():
        for marker in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"):
            assert marker not in text, (name, text[-3000:])
    gate.stop()

    needles = {}
    for name, v in (("tenant key", tenant_key), ("wrong tenant key", wrong_tenant),
                    ("pool key", pool_key), ("pool2 key", pool2_key), ("gate key", gate_key),
                    ("admin token", admin_tok), ("wrong admin token", wrong_admin),
                    ("framework key", fw_key)):
        for f in forms(v):
            needles["%s (%s)" % (name, f[:12])] = f
    for kf in key_files:
        for i, line in enumerate(pem_body_lines(kf)):
            if len(line) >= 16:
                needles["%s line %d" % (os.path.basename(kf), i)] = line
    if os.environ.get("DP_SHOW_OUTPUTS"):
        for k, v in outputs.items():
            print("=== %s\n%s" % (k, v[:1500]))
    leaks = ["%s in %s" % (n, where) for where, text in outputs.items()
             for n, v in needles.items() if v in text]
    assert not leaks, "\n".join(leaks[:20])
    print("    %d outputs checked for %d secret forms" % (len(outputs), len(needles)))


def test_secret_files_readable_by_others_are_a_warning_naming_the_file():
    d = tempfile.mkdtemp(prefix="detproxy-perms-")
    pool_key, admin_tok = token("pk-"), token("adm-")
    keyf = write_secret(d, "api-key", pool_key, 0o644)
    tokf = write_secret(d, "admin-token", admin_tok, 0o640)
    shutil.copyfile(PKI.server.key, os.path.join(d, "tls.key"))
    os.chmod(os.path.join(d, "tls.key"), 0o604)
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim], api_key_file=keyf)], directory=d,
                     admin_token_file=tokf,
                     tls={"cert_file": PKI.server.crt, "key_file": os.path.join(d, "tls.key")},
                     ready=False)
    # Signal handlers are installed after the "listening" lines: wait for the loop to run.
    wait_http(px.admin_port, "/healthz")
    warns = px.find_logs("config_warning")
    text = json.dumps(warns)
    for path in (keyf, tokf, os.path.join(d, "tls.key")):
        assert any(path in json.dumps(w) for w in warns), (path, warns)
    assert pool_key not in text and admin_tok not in text
    assert not any(l in px.stderr_text() for l in pem_body_lines(os.path.join(d, "tls.key")))
    px.stop()
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
    assert rc == 0, err
    assert sum("warning:" in l for l in err.splitlines()) == 3, err
    assert keyf in err and pool_key not in err + out
    # chmod 600: no warning.
    for f in (keyf, tokf, os.path.join(d, "tls.key")):
        os.chmod(f, 0o600)
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
    assert rc == 0 and "warning" not in err, err
    # The audit chain's signing key is a secret too.
    rc, _, e = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", os.path.join(d, "sign")])
    assert rc == 0, e
    os.chmod(os.path.join(d, "sign.key.pem"), 0o644)
    with open(px.config_path) as f:
        cfg = json.load(f)
    cfg["log"] = {"audit_path": os.path.join(d, "audit.jsonl"),
                  "audit_signing_key": os.path.join(d, "sign.key.pem")}
    with open(px.config_path, "w") as f:
        json.dump(cfg, f)
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
    assert rc == 0 and "log.audit_signing_key" in err and "sign.key.pem" in err, err
    assert not any(l in err for l in pem_body_lines(os.path.join(d, "sign.key.pem")))
    # The agent warns for its secrets as well: the signing key and the TLS key.
    os.chmod(os.path.join(d, "tls.key"), 0o644)
    model_dir = os.path.join(d, "model")
    os.makedirs(model_dir)
    open(os.path.join(model_dir, "w"), "w").write("w")
    agent = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                           "--model-dir", model_dir, "--model", MODEL, "--quantization", "awq",
                           "--dtype", "float16", "--framework", "vllm", "--framework-version",
                           "0.6.3", "--key", os.path.join(d, "sign.key.pem"),
                           "--tls-cert", PKI.server.crt, "--tls-key",
                           os.path.join(d, "tls.key")], name="agent")
    agent.stop()
    text = agent.stderr_text()
    assert os.path.join(d, "sign.key.pem") in text, text
    assert os.path.join(d, "tls.key") in text, "agent: no warning for a world-readable --tls-key"


if __name__ == "__main__":
    run_tests(globals())
