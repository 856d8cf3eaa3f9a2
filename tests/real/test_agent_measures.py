"""The agent measures a real llama.cpp server (docs/attestation.md §4, "What the agent
measures"): started with --quantization F16 --framework-url, beside a llama-server on the F16
GGUF, it signs /props model_ftype and the SHA-256 of the file the server has mapped (found
through /proc: the server runs in scripts/real-engine.sh's chroot, so /models exists only in
its root). When the server is restarted on the Q8_0 GGUF on the same port, the agent sees the
new process, measures it again at once, and the proxy (a pool using the agent, no canary) takes
the replica out of rotation naming both quantizations. The time to eject is printed as a
`measured: {...}` line.

This is the case the measurement exists for: an agent that repeats its flags keeps signing F16
and the F16 file's hash while the restarted server runs Q8_0, and the replica is re-admitted.

Uses scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the path); prints SKIPPED and exits
77 when it is missing or the Debian archive cannot be reached."""

import base64
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import realutil  # noqa: E402
from realutil import engine, require_engine, stop_servers  # noqa: E402
from harness import (DETPROXY_BIN, SLOW, free_port, get_json, http, poll_until,  # noqa: E402
                     post_json, run_cmd, run_tests, start_process)
from proxyutil import start_proxy  # noqa: E402

TMP = tempfile.mkdtemp(prefix="detproxy-real-measures-")
MODEL = "tiny"
INTERVAL = 1000  # the proxy's attestation.interval_ms

require_engine()
INFO = dict(l.split("=", 1) for l in engine("info").stdout.splitlines())
SHA = {q: INFO["model_" + q].split()[1] for q in ("f16", "q8_0")}
PATH = {q: INFO["model_" + q].split()[0] for q in ("f16", "q8_0")}


def keygen():
    prefix = os.path.join(TMP, "pipeline")
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", prefix])
    assert rc == 0, err
    return prefix + ".key.pem", prefix + ".pub.pem"


def payload(ag):
    r = http("GET", ag.port, "/attestation?nonce=n")
    return r.status, json.loads(base64.b64decode(r.json()["payload"])) if r.status == 200 \
        else r.json()


def test_a_server_restarted_on_q8_0_is_ejected_naming_both_quantizations():
    name = "measure-%d" % os.getpid()
    port = free_port()
    realutil._started.append(name)
    engine("start", name, str(port), "f16")
    key, pub = keygen()
    ag = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                        "--model", MODEL, "--quantization", "F16", "--framework-url",
                        "http://127.0.0.1:%d" % port, "--key", key], name="agent")
    try:
        poll_until(lambda: payload(ag)[0] == 200, timeout=20, what="the agent measured F16")
        st, p = payload(ag)
        assert p["quantization"] == "F16" and p["model_path"] == PATH["f16"], p
        # The file llama-server mapped, reached through its root: sha256sum's value.
        assert p["checkpoint_sha256"] == SHA["f16"], (p, SHA)
        assert {"quantization", "checkpoint_sha256"} <= set(p["measured"]), p
        assert "contradictions" not in p, p
        loaded = ag.find_logs("engine_loaded")
        assert loaded and loaded[-1]["seen"] == "mapped", loaded

        pool = {"name": "p", "models": [MODEL],
                "manifest": {"model": MODEL, "quantization": "F16",
                             "checkpoint_sha256": SHA["f16"]},
                "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d" % port,
                              "attest": {"source": "agent",
                                         "url": "http://127.0.0.1:%d/attestation" % ag.port}}]}
        px = start_proxy(pools=[pool], directory=TMP, timeout=30,
                         attestation={"interval_ms": INTERVAL, "timeout_ms": 5000,
                                      "require_signature": True, "trusted_keys": [pub]})
        rep = get_json(px.admin_port, "/admin/replicas")["replicas"][0]
        assert rep["state"] == "admitted", rep

        stop = threading.Event()
        served = []

        def traffic():
            while not stop.is_set():
                r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                           "max_tokens": 2})
                served.append((time.monotonic(), r.status, r.headers.get("x-detproxy-replica")))
        t = threading.Thread(target=traffic)
        t.start()
        try:
            time.sleep(0.5)
            t_stop = time.monotonic()
            engine("stop", name)
            engine("start", name, str(port), "q8_0")
            t_up = time.monotonic()  # /health answered: the Q8_0 server is serving

            def state():
                return get_json(px.admin_port, "/admin/replicas")["replicas"][0]["state"]
            poll_until(lambda: state() == "rejected", timeout=20, interval=0.01,
                       what="the Q8_0 replica rejected")
            ejected = time.monotonic() - t_up
        finally:
            stop.set()
            t.join()
        rep = get_json(px.admin_port, "/admin/replicas")["replicas"][0]
        reasons = rep["reasons"]
        assert "agent: --quantization F16 contradicts the engine's Q8_0" in reasons, reasons
        assert "quantization mismatch: got Q8_0 want F16" in reasons, reasons
        assert "checkpoint_sha256 mismatch: got %s.. want %s.." % (
            SHA["q8_0"][:8], SHA["f16"][:8]) in reasons, reasons
        assert rep["attestation"]["report"]["model_path"] == PATH["q8_0"], rep
        # How long it took is measured and printed, not asserted (it is the machine's speed as
        # much as ours: 1.7 s for 1 s intervals idle, 4.5 s under a loaded CI run); the poll's
        # timeout above is the liveness bound. The guarantee is this: nothing the Q8_0 server
        # generated reached a client.
        after = [s for s in served if s[0] > t_up and s[2] == "r1" and s[1] == 200]
        assert not after, after[:5]
        print("measured: " + json.dumps({
            "q8_0_listening_to_rejected_s": round(ejected, 3),
            "f16_stopped_to_rejected_s": round(ejected + (t_up - t_stop), 3),
            "proxy_interval_ms": INTERVAL,
            "client_errors_during_swap": sum(1 for s in served if s[1] != 200),
            "q8_0_answers_served": len(after),
            "agent_engine_changed_logs": len(ag.find_logs("engine_changed"))}), flush=True)
        px.stop()
    finally:
        ag.stop()
        stop_servers()


if __name__ == "__main__":
    run_tests(globals())
