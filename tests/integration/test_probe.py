"""One attestation check (probe/): the proxy's admission and `detproxy diagnose` run the same
check, so for the same replicas they give the same verdict with the same reasons (docs/diagnose.md
§1). In particular an agent's 503 framework_unreachable reads "framework at URL: connection
refused" in both, and both send the engine-fingerprint probe, so a manifest pinning
engine_fingerprint is "admitted" in both, never "unattested" in diagnose alone."""

import hashlib
import json
import os
import socket
import tempfile
import threading
import time

from harness import (DETPROXY_BIN, free_port, get_json, http, poll_until, post_json, run_cmd,
                     run_tests, start_process, start_sim)
from proxyutil import metric, pool, start_proxy

MODEL = "org/model-a"
CKPT = hashlib.sha256(b"checkpoint-a").hexdigest()
TMP = tempfile.mkdtemp(prefix="detproxy-probe-")


def keygen(name):
    prefix = os.path.join(TMP, name)
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", prefix])
    assert rc == 0, err
    return prefix + ".key.pem", prefix + ".pub.pem"


def sim(quant, key):
    return start_sim("--model", MODEL, "--flavor", "vllm", "--framework-version", "0.6.3",
                     "--quantization", quant, "--dtype", "float16", "--checkpoint-sha256", CKPT,
                     "--attest-key", key)


def proxy_reasons(px):
    """{replica: (state, reasons)} once every replica is judged (pending with a reason: its
    canary did not match)."""
    def reps():
        return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}
    poll_until(lambda: all(r["state"] != "pending" or r["reasons"] for r in reps().values()),
               what="every replica judged")
    return {n: (r["state"], r["reasons"]) for n, r in reps().items()}


def diagnose_reasons(path):
    rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "-c", path, "--repeat", "2",
                            "--concurrency", "2", "--json"], timeout=120)
    assert rc in (0, 1) and "Sanitizer" not in err, (rc, err)
    doc = json.loads(out)
    return {r["name"]: r for r in doc["steps"]["metadata"]["replicas"]}


# The proxy's replica state for each verdict of the check.
STATE = {"admitted": "admitted", "mismatch": "rejected", "invalid": "rejected",
         "unreachable": "unreachable"}


def test_proxy_and_diagnose_give_the_same_reasons():
    """An honest replica, one reporting another quantization, an agent nobody listens on, and a
    live agent before a dead engine: the proxy's /admin/replicas and diagnose's metadata step
    say the same thing about each, word for word."""
    key, pub = keygen("pipeline")
    honest, liar = sim("awq", key), sim("gptq", key)
    nobody = free_port()
    dead_engine = free_port()
    d = os.path.join(TMP, "model-dir")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"arch": "toy"}')
    agent = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                           "--model-dir", d, "--model", MODEL, "--quantization", "awq",
                           "--dtype", "float16", "--key", key,
                           "--framework-url", "http://127.0.0.1:%d" % dead_engine],
                          name="agent")
    # Hashed, and its first framework read failed: from now on it answers framework_unreachable.
    poll_until(lambda: "framework_unreachable" in http("GET", agent.port,
                                                       "/attestation?nonce=n").text,
               what="the agent reports the dead engine")
    man = {"model": MODEL, "checkpoint_sha256": CKPT, "quantization": "awq", "dtype": "float16",
           "framework": {"name": "vllm", "version": "0.6.3"}}
    p = pool("p", [MODEL], [honest, liar], manifest=man)
    p["replicas"] += [{"name": "r3", "url": "http://127.0.0.1:%d" % nobody},
                      {"name": "r4", "url": "http://127.0.0.1:%d" % dead_engine}]
    agents = [honest.port, liar.port, nobody, agent.port]
    for r, port in zip(p["replicas"], agents):
        r["attest"] = {"source": "agent", "url": "http://127.0.0.1:%d/attestation" % port}
    px = start_proxy(pools=[p], attestation={"interval_ms": 300, "timeout_ms": 1000,
                                             "require_signature": True, "trusted_keys": [pub]})
    seen = proxy_reasons(px)
    dg = diagnose_reasons(px.config_path)
    print("    proxy:    %s" % seen)
    assert seen["r1"] == ("admitted", []), seen
    assert seen["r2"] == ("rejected", ["quantization mismatch: got gptq want awq"]), seen
    assert seen["r3"][0] == "unreachable", seen
    assert seen["r3"][1][0].startswith("attestation fetch failed (connect): "), seen
    assert seen["r4"] == ("unreachable", ["framework at http://127.0.0.1:%d: connection refused"
                                          % dead_engine]), seen
    for name, (state, reasons) in seen.items():
        r = dg[name]
        print("    diagnose: %s %s %s" % (name, r["attestation"], r["reasons"]))
        assert STATE[r["attestation"]] == state, (name, r, state)
        assert r["reasons"] == reasons, (name, r["reasons"], reasons)
        assert r["admitted"] is (True if state == "admitted" else
                                 None if r["report"] is None else False), r
    px.stop()
    agent.stop()
    honest.stop()
    liar.stop()


def test_a_pinned_engine_fingerprint_is_attested_by_both():
    """A native check sends the 1-token probe completion in both: a llama.cpp replica whose
    manifest pins its engine fingerprint is admitted by the proxy and by diagnose alike."""
    s = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version", "b11669")
    fp = post_json(s.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1,
                                                "temperature": 0}).json()["system_fingerprint"]
    p = pool("p", [MODEL], [s], manifest={"engine_fingerprint": fp})
    p["replicas"][0]["attest"] = {"source": "llamacpp"}
    px = start_proxy(pools=[p], attestation={"interval_ms": 300, "timeout_ms": 1000,
                                             "require_signature": False})
    assert proxy_reasons(px)["r1"] == ("admitted", [])
    r = diagnose_reasons(px.config_path)["r1"]
    assert r["attestation"] == "admitted" and r["admitted"] is True and r["reasons"] == [], r
    assert r["report"]["engine_fingerprint"] == fp, r["report"]
    px.stop()
    s.stop()


def test_a_canary_that_does_not_match_reads_the_same_in_both():
    """Metadata matches, the canary does not: the proxy keeps the replica pending and diagnose
    does not admit it, with the same reason (diagnose had its own, shorter wording)."""
    key, pub = keygen("canary")
    s = sim("awq", key)
    for expected, start in (("0" * 64, "canary mismatch: output sha256 "),
                            (None, "canary not recorded: the manifest has no ")):
        can = {"prompt": "Count: one, two,", "max_tokens": 8}
        if expected:
            can["expected_sha256"] = expected
        p = pool("p", [MODEL], [s], manifest={"model": MODEL, "quantization": "awq",
                                              "canary": can})
        p["replicas"][0]["attest"] = {"source": "agent",
                                      "url": "http://127.0.0.1:%d/attestation" % s.port}
        # One check only (the next is a minute away): the first canary's verdict stays put.
        px = start_proxy(pools=[p], ready=False,
                         attestation={"interval_ms": 60000, "timeout_ms": 2000,
                                      "require_signature": True, "trusted_keys": [pub]})
        proxy_reasons(px)
        # What the engine itself says follows the canary's reason (its metadata is read after
        # the mismatch): here it agrees with the signed identity.
        poll_until(lambda: len(proxy_reasons(px)["r1"][1]) == 2, what="the engine's own report")
        seen = proxy_reasons(px)
        assert seen["r1"][0] == "pending" and seen["r1"][1][0].startswith(start), seen
        assert seen["r1"][1][1].startswith("the engine itself (vllm metadata) agrees with the "
                                           "attested identity (framework.version 0.6.3"), seen
        # The check matched the metadata, but the replica is not admitted: not counted so.
        assert metric(px, "detproxy_attestations_total", replica="r1", result="admitted") == 0
        assert metric(px, "detproxy_attestations_total", replica="r1", result="pending") >= 1
        r = diagnose_reasons(px.config_path)["r1"]
        assert r["attestation"] == "admitted" and r["admitted"] is False, r
        assert r["reasons"] == seen["r1"][1], (r["reasons"], seen)
        px.stop()
    s.stop()


def test_an_engine_that_accepts_but_never_answers_is_unreachable_for_the_agent():
    """The agent reads its framework through the same check: an exchange that fails below HTTP
    (here the first byte never comes) is framework_unreachable, as for the proxy. Before, only a
    refused connect was; a hung engine cost each of the five adapter paths its 5 s timeout in
    turn and then was reported as 'not recognised', with a signed envelope vouching for the
    model."""
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(16)
    port = lsn.getsockname()[1]
    held = []
    stop = threading.Event()

    def hold():
        lsn.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(lsn.accept()[0])
            except OSError:
                pass
    t = threading.Thread(target=hold, daemon=True)
    t.start()
    d = os.path.join(TMP, "hung-model-dir")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"arch": "toy"}')
    agent = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                           "--model-dir", d, "--model", MODEL, "--framework-url",
                           "http://127.0.0.1:%d" % port], name="agent")
    t0 = time.monotonic()
    poll_until(lambda: "framework_unreachable" in http("GET", agent.port,
                                                       "/attestation?nonce=n").text,
               timeout=15, what="the agent reports the hung engine")
    took = time.monotonic() - t0
    err = http("GET", agent.port, "/attestation?nonce=n").json()["error"]
    print("    hung engine -> framework_unreachable in %.1f s: %s" % (took, err["message"]))
    assert err["message"].startswith("framework at http://127.0.0.1:%d: " % port), err
    assert held, "the agent connected"
    agent.stop()
    stop.set()
    t.join()
    for c in held:
        c.close()
    lsn.close()


if __name__ == "__main__":
    run_tests(globals())
