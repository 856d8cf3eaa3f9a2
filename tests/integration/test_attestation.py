"""Attestation end to end (docs/attestation.md, docs/configuration.md "Manifest"): only replicas whose attested identity equals the
pool manifest get traffic; changes eject; the canary catches a replica that lies."""

import hashlib
import json
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from harness import (DETPROXY_BIN, SIM_BIN, SLOW, get_json, http, poll_until, post_json,
                     run_cmd, run_tests, sse, start_process, start_sim)
from proxyutil import metric, pool, sim_config, sim_stats, start_proxy

MODEL = "org/model-a"
CKPT = hashlib.sha256(b"checkpoint-a").hexdigest()
OTHER = hashlib.sha256(b"checkpoint-b").hexdigest()
TMP = tempfile.mkdtemp(prefix="detproxy-attest-")


def keygen(name):
    prefix = os.path.join(TMP, name)
    if not os.path.exists(prefix + ".key.pem"):
        rc, out, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", prefix])
        assert rc == 0, err
    return prefix + ".key.pem", prefix + ".pub.pem"


def sim(ckpt=CKPT, quant="awq", key=None, *extra):
    flags = ["--model", MODEL, "--flavor", "vllm", "--framework-version", "0.6.3",
             "--quantization", quant, "--dtype", "float16", "--checkpoint-sha256", ckpt]
    if key:
        flags += ["--attest-key", key]
    return start_sim(*(flags + list(extra)))


def manifest(**extra):
    m = {"model": MODEL, "checkpoint_sha256": CKPT, "quantization": "awq", "dtype": "float16",
         "framework": {"name": "vllm", "version": "0.6.3"}}
    m.update(extra)
    return m


def agent_pool(sims, man=None, **kw):
    p = pool("p", [MODEL], sims, manifest=man or manifest(), **kw)
    for r, s in zip(p["replicas"], sims):
        r["attest"] = {"source": "agent", "url": "http://127.0.0.1:%d/attestation" % s.port}
    return p


def attestation(interval=300, timeout=500, keys=(), require=True):
    return {"interval_ms": interval, "timeout_ms": timeout, "require_signature": require,
            "trusted_keys": list(keys)}


def replicas(px):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def state(px, name):
    return replicas(px)[name]["state"]


def test_a_replica_from_another_checkpoint_never_gets_a_request():
    key, pub = keygen("pipeline")
    sims = [sim(key=key), sim(key=key), sim(ckpt=OTHER, key=key)]
    px = start_proxy(pools=[agent_pool(sims)], attestation=attestation(keys=[pub]))
    poll_until(lambda: state(px, "r3") == "rejected", what="r3 rejected")
    for _ in range(30):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status == 200, r
        assert r.headers["x-detproxy-replica"] in ("r1", "r2")
    assert sim_stats(sims[2])["requests"] == 0
    rep = replicas(px)["r3"]
    assert any(x.startswith("checkpoint_sha256 mismatch: got " + OTHER[:8])
               for x in rep["reasons"]), rep
    assert rep["attestation"]["report"]["checkpoint_sha256"] == OTHER
    assert replicas(px)["r1"]["state"] == "admitted"
    assert metric(px, "detproxy_replica_admitted", pool="p", replica="r3") == 0
    assert metric(px, "detproxy_replica_admitted", pool="p", replica="r1") == 1
    assert metric(px, "detproxy_attestations_total", pool="p", replica="r3",
                  result="rejected") >= 1
    px.wait_log(lambda l: l.get("msg") == "replica_state" and l.get("replica") == "r3"
                and l.get("to") == "rejected")
    px.stop()


def test_model_change_ejects_within_interval_plus_timeout():
    key, pub = keygen("pipeline")
    sims = [sim(key=key), sim(key=key)]
    interval, timeout = 400, 300
    px = start_proxy(pools=[agent_pool(sims)],
                     attestation=attestation(interval=interval, timeout=timeout, keys=[pub]))
    assert state(px, "r1") == "admitted"
    t0 = time.monotonic()
    sim_config(sims[0], checkpoint_sha256=OTHER)
    poll_until(lambda: state(px, "r1") == "rejected", interval=0.01, what="r1 ejected")
    took = time.monotonic() - t0
    assert took <= (interval + timeout) / 1000.0 * SLOW + 0.2, took
    print("    ejected %.0f ms after the change" % (took * 1000))
    for _ in range(10):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.headers["x-detproxy-replica"] == "r2"
    # Put it back: re-admitted on a later check.
    sim_config(sims[0], checkpoint_sha256=CKPT)
    poll_until(lambda: state(px, "r1") == "admitted", what="r1 re-admitted")
    px.stop()


def test_bad_agents_are_rejected_with_reasons():
    key, pub = keygen("pipeline")
    other_key, _ = keygen("rogue")
    cases = {"garbage": "r1", "huge": "r2", "wrong_nonce": "r3", "bad_signature": "r4",
             "unsigned": "r5"}
    sims = [sim(key=key) for _ in cases]
    sims.append(sim(key=other_key))   # r6: signed by a key nobody trusts
    sims.append(sim(key=key))         # r7: hangs -> unreachable (timeout)
    sims.append(sim(key=key))         # r8: healthy
    for s, fault in zip(sims, list(cases) + [None, "hang", None]):
        if fault:
            sim_config(s, attest_fault=fault)
    # 1.5 s: the huge answer must be read to its cap (4 MiB) before it, on a loaded machine too
    px = start_proxy(pools=[agent_pool(sims)], attestation=attestation(keys=[pub], timeout=1500))
    want = {"r1": "rejected", "r2": "unreachable", "r3": "rejected", "r4": "rejected",
            "r5": "rejected", "r6": "rejected", "r7": "unreachable", "r8": "admitted"}
    poll_until(lambda: {n: state(px, n) for n in want} == want, timeout=10,
               what="every bad agent judged")
    reps = replicas(px)
    text = {n: " ".join(reps[n]["reasons"]).lower() for n in want}
    assert "nonce" in text["r3"], text["r3"]
    assert "signature" in text["r4"], text["r4"]
    assert "unsigned" in text["r5"] or "signature" in text["r5"], text["r5"]
    assert "trusted" in text["r6"], text["r6"]
    assert "larger than" in text["r2"], text["r2"]
    assert "timeout" in text["r7"] or "timed out" in text["r7"], text["r7"]
    for _ in range(5):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r8"
    px.stop()


def test_a_replica_that_trickles_its_metadata_is_unreachable_within_the_timeout():
    """Once admitted, the replica answers its metadata a byte every 200 ms, never ending: well
    within every idle timeout, so only a bound on the whole answer ends the check. Without one
    the check never ended, and the replica stayed admitted on its last answer for good (one
    slot of the proxy's concurrent checks taken with it)."""
    s = sim()
    p = pool("p", [MODEL], [s], manifest={"model": MODEL,
                                          "framework": {"name": "vllm", "version": "0.6.3"}})
    p["replicas"][0]["attest"] = {"source": "vllm"}
    px = start_proxy(pools=[p], attestation=attestation(interval=200, timeout=600, require=False))
    assert state(px, "r1") == "admitted"
    sim_config(s, fault="trickle", fault_scope="all")
    t0 = time.monotonic()
    poll_until(lambda: state(px, "r1") == "unreachable", timeout=10 * SLOW,
               what="the trickling replica out of service")
    took = time.monotonic() - t0
    reasons = " ".join(replicas(px)["r1"]["reasons"])
    assert "answer not whole within 600 ms" in reasons, reasons
    assert took <= (0.2 + 0.6) * SLOW + 0.5, took
    assert metric(px, "detproxy_replica_admitted", pool="p", replica="r1") == 0
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status == 503, r.status
    sim_config(s, fault="none")
    poll_until(lambda: state(px, "r1") == "admitted", what="r1 back once it answers whole")
    px.stop()


def test_no_admitted_replica_is_503_with_the_reasons_kept_off_the_client():
    key, pub = keygen("pipeline")
    sims = [sim(ckpt=OTHER, key=key), sim(quant="gptq", key=key)]
    px = start_proxy(pools=[agent_pool(sims)], attestation=attestation(keys=[pub]), ready=False)
    poll_until(lambda: state(px, "r1") == "rejected" and state(px, "r2") == "rejected",
               what="both rejected")
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert r.status == 503
    e = r.json()["error"]
    rid = r.headers["x-detproxy-request-id"]
    assert e["code"] == "no_attested_replica"
    # The client learns the pool and its request id, nothing about the fleet (docs/requests.md §4).
    assert e["message"] == "no attested replica is available in pool p (request id %s)" % rid, e
    # The reasons are on the admin listener and in the log line for that request id.
    ready = http("GET", px.admin_port, "/readyz")
    assert ready.status == 503 and ready.json()["unready_pools"][0]["pool"] == "p"
    assert "quantization mismatch" in ready.text, ready.text
    line = px.wait_log(lambda l: l.get("msg") == "request_failed" and l.get("request_id") == rid)
    assert "checkpoint_sha256 mismatch" in line["reason"] and \
        "quantization mismatch" in line["reason"], line
    assert sum(sim_stats(s)["requests"] for s in sims) == 0
    assert get_json(px.port, "/v1/models")["data"] == []
    px.stop()


def test_native_adapter_fails_closed_on_unattested_fields():
    s = sim()
    p = pool("p", [MODEL], [s], manifest=manifest())
    p["replicas"][0]["attest"] = {"source": "vllm"}
    px = start_proxy(pools=[p], attestation=attestation(require=False), ready=False)
    poll_until(lambda: state(px, "r1") == "rejected", what="rejected")
    reasons = " ".join(replicas(px)["r1"]["reasons"])
    assert "checkpoint_sha256 unattested" in reasons and "quantization unattested" in reasons
    px.stop()
    # The same adapter with a manifest pinning only what vLLM exposes: admitted.
    p["manifest"] = {"model": MODEL, "framework": {"name": "vllm", "version": "0.6.3"}}
    px = start_proxy(pools=[p], attestation=attestation(require=False))
    assert state(px, "r1") == "admitted"
    # require_signature refuses any unsigned source.
    px.stop()
    px = start_proxy(pools=[p], attestation=attestation(require=True, keys=[keygen("k")[1]]),
                     ready=False)
    poll_until(lambda: state(px, "r1") == "rejected", what="unsigned rejected")
    assert "unsigned" in " ".join(replicas(px)["r1"]["reasons"]).lower()
    px.stop()


def canary_for(prompt, n):
    honest = sim()
    r = post_json(honest.port, "/v1/completions",
                  {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0,
                   "seed": 0}).json()
    honest.stop()
    text = r["choices"][0]["text"]
    return {"prompt": prompt, "max_tokens": n,
            "expected_sha256": hashlib.sha256(text.encode()).hexdigest()}


def test_canary_catches_a_lying_replica():
    key, pub = keygen("pipeline")
    can = canary_for("Count: one, two,", 16)
    honest = sim(key=key)
    liar = sim(CKPT, "gptq", key, "--report-quantization", "awq")
    px = start_proxy(pools=[agent_pool([honest, liar], man=manifest(canary=can))],
                     attestation=attestation(interval=200, keys=[pub]))
    poll_until(lambda: state(px, "r2") == "rejected", what="liar rejected by the canary")
    reasons = " ".join(replicas(px)["r2"]["reasons"])
    assert "canary mismatch" in reasons, reasons
    assert replicas(px)["r2"]["attestation"]["report"]["quantization"] == "awq"  # it lied
    assert state(px, "r1") == "admitted"
    assert metric(px, "detproxy_attestations_total", pool="p", replica="r2",
                  result="canary_mismatch") >= 2
    # Fail closed: it was never admitted, so all it ever saw were canary probes.
    for _ in range(10):
        assert post_json(px.port, "/v1/completions",
                         {"model": MODEL, "prompt": "x", "max_tokens": 1}).status == 200
    seen = get_json(liar.port, "/_sim/requests")["requests"]
    prompts = {json.loads(r["body"]).get("prompt") for r in seen if r["inference"]}
    assert prompts == {can["prompt"]}, prompts
    px.stop()


def test_a_recovering_canary_says_the_latest_matched_not_equal_hashes():
    """Rejected by two mismatching canaries, then fixed: the first match leaves 2 of the last
    3 failing, and the reason says so, naming the mismatching output, not the matching one
    against itself."""
    key, pub = keygen("pipeline")
    can = canary_for("Count: one, two,", 16)
    s = sim(key=key)
    px = start_proxy(pools=[agent_pool([s], man=manifest(canary=can))],
                     attestation=attestation(interval=150, keys=[pub]))
    poll_until(lambda: state(px, "r1") == "admitted", what="admitted")
    sim_config(s, quantization="gptq", report_quantization="awq")
    poll_until(lambda: state(px, "r1") == "rejected", what="rejected by the canary")
    sim_config(s, quantization="awq", report_quantization="")
    poll_until(lambda: state(px, "r1") == "admitted", what="admitted again")
    reasons = [r for line in px.find_logs("replica_state") for r in line["reasons"]
               if r.startswith("canary mismatch")]
    recovering = [r for r in reasons if "the latest check matched" in r]
    assert recovering, reasons
    got, want = recovering[0].split("output sha256 ")[1].split(".. want ")
    assert got != want[:8] and want.startswith(can["expected_sha256"][:8]), recovering[0]
    px.stop()


def test_replica_restarting_as_another_model_is_caught():
    key, pub = keygen("pipeline")
    a, b = sim(key=key), sim(key=key)
    px = start_proxy(pools=[agent_pool([a, b])],
                     attestation=attestation(interval=60000, keys=[pub]))  # no periodic check
    port = a.port
    a.stop()
    # Traffic while it is down: connections to r1 fail, the retry rule sends them to r2, and
    # the failure re-attests r1 at once (long before the 60 s interval).
    for _ in range(4):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r2", r
    poll_until(lambda: state(px, "r1") == "unreachable", what="r1 unreachable")
    # The same address comes back serving another checkpoint.
    a2 = start_process([SIM_BIN, "--listen", "127.0.0.1:%d" % port, "--model", MODEL,
                        "--flavor", "vllm", "--framework-version", "0.6.3", "--quantization",
                        "awq", "--dtype", "float16", "--checkpoint-sha256", OTHER,
                        "--attest-key", key])
    # Unreachable replicas are re-checked within a second: it is caught as another model.
    poll_until(lambda: state(px, "r1") == "rejected", what="r1 re-attested and rejected")
    assert sim_stats(a2)["requests"] == 0
    px.stop()


def restart_on(s, key, ckpt):
    """Stop sim s and start another on its port at once, serving checkpoint ckpt."""
    port = s.port
    s.stop()
    return start_process([SIM_BIN, "--listen", "127.0.0.1:%d" % port, "--model", MODEL,
                          "--flavor", "vllm", "--framework-version", "0.6.3", "--quantization",
                          "awq", "--dtype", "float16", "--checkpoint-sha256", ckpt,
                          "--attest-key", key])


def test_a_fast_restart_as_another_model_never_serves_a_request():
    """A replica that comes back as another model before any request fails to connect to it:
    the connections it closed on its way down hold it until a check made after the close, so
    nothing the new process generates is served (the periodic check is a minute away)."""
    key, pub = keygen("pipeline")
    a, b = sim(key=key), sim(key=key)
    px = start_proxy(pools=[agent_pool([a, b])],
                     attestation=attestation(interval=60000, keys=[pub]))
    for _ in range(8):  # pooled connections to both replicas
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status == 200, r
    assert sim_stats(a)["requests"] > 0
    a2 = restart_on(a, key, OTHER)
    for _ in range(20):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r2", r
    poll_until(lambda: state(px, "r1") == "rejected", what="r1 re-checked and rejected")
    assert sim_stats(a2)["requests"] == 0
    assert any(x.startswith("checkpoint_sha256 mismatch: got " + OTHER[:8])
               for x in replicas(px)["r1"]["reasons"])
    px.stop()


def test_a_restart_while_no_connection_is_open_is_checked_before_the_first_request():
    """No client connection to r1 is open when it restarts as another model (nothing closes
    under detproxy, nothing fails to connect): the first connection a worker opens to it waits
    for a check made from then on, which rejects it; the requests go to r2."""
    key, pub = keygen("pipeline")
    a, b = sim(key=key), sim(key=key)
    px = start_proxy(pools=[agent_pool([a, b])],
                     attestation=attestation(interval=60000, keys=[pub]))
    a2 = restart_on(a, key, OTHER)
    for _ in range(10):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r2", r
    poll_until(lambda: state(px, "r1") == "rejected", what="r1 checked and rejected")
    assert sim_stats(a2)["requests"] == 0
    px.stop()


def accept_each(ls, handler):
    """Accept on ls until it is closed: handler(conn), called as each is accepted, returns what
    serves it on a thread of its own."""
    while True:
        try:
            c, _ = ls.accept()
        except OSError:
            return
        threading.Thread(target=handler(c), daemon=True).start()


class NatFront:
    """A TCP front standing in for an engine restart behind NAT (a container runtime's or an L4
    balancer's): after switch(port), the connections opened before it get no FIN; the next
    bytes sent on one are answered with a reset. New connections go to the new backend."""

    def __init__(self, port, keep_old=False):
        self.keep_old = keep_old  # a blue/green switch: old connections stay on the old engine
        self.backends = [port]
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(64)
        self.port = self.ls.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def switch(self, port):
        self.backends.append(port)

    def close(self):
        self.ls.close()

    def _accept(self):
        def handler(c):
            gen = len(self.backends) - 1  # the backend in force when it connected
            return lambda: self._pipe(c, gen)
        accept_each(self.ls, handler)

    def _pipe(self, c, gen):
        try:
            b = socket.create_connection(("127.0.0.1", self.backends[gen]), timeout=5)
        except OSError as e:
            print("    front: no connection to the backend on %d: %r" % (self.backends[gen], e),
                  flush=True)
            c.close()
            return
        try:
            while True:
                ready, _, _ = select.select([c, b], [], [], 30)
                if not ready:
                    break
                if c in ready:
                    if gen != len(self.backends) - 1 and not self.keep_old:  # NAT entry gone
                        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        break
                    d = c.recv(65536)
                    if not d:
                        break
                    b.sendall(d)
                if b in ready:
                    d = b.recv(65536)
                    if not d:
                        break
                    c.sendall(d)
        except OSError:
            pass
        finally:
            c.close()
            b.close()


def test_a_restart_behind_nat_holds_the_retry_of_a_lone_replica():
    """Behind NAT a restarted engine's old connections are not closed: the next request on one
    is reset (the keep-alive race, which is retried). The reset holds the replica before the
    retry is routed, so with no other replica the retry waits for the re-check, which meets the
    new engine (another checkpoint) and rejects it: it never serves a request."""
    key, pub = keygen("pipeline")
    a, b = sim(key=key), sim(OTHER, "awq", key)
    front = NatFront(a.port)
    p = pool("p", [MODEL], [a], manifest=manifest())
    p["replicas"][0]["url"] = "http://127.0.0.1:%d" % front.port
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % front.port}
    px = start_proxy(pools=[p], attestation=attestation(interval=60000, keys=[pub]))
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status == 200, r
    front.switch(b.port)
    for _ in range(5):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status != 200, r
    poll_until(lambda: state(px, "r1") == "rejected", what="r1 rejected as the new engine")
    assert sim_stats(b)["requests"] == 0
    px.stop()
    front.close()


def test_a_blue_green_switch_never_serves_from_the_new_engine():
    """A balancer in front of the replica switches to another engine (another checkpoint) but
    keeps the open connections on the old one: nothing closes. A burst then needs new
    connections, which reach the new engine: each waits for a check made over a new connection
    of its own, which rejects the replica. Requests on the old connections may still be
    answered by the old, attested engine; none reaches the new one."""
    key, pub = keygen("pipeline")
    a, b = sim(key=key), sim(OTHER, "awq", key)
    front = NatFront(a.port, keep_old=True)
    p = pool("p", [MODEL], [a], manifest=manifest())
    p["replicas"][0]["url"] = "http://127.0.0.1:%d" % front.port
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % front.port}
    px = start_proxy(pools=[p], attestation=attestation(interval=60000, keys=[pub]), workers=2)
    for _ in range(4):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status == 200, r
    front.switch(b.port)
    codes = []

    # Requests at once, more than there are pooled connections: some open new connections,
    # which reach the new engine. (One burst may be served over the pooled ones alone.)
    def rejected():
        with ThreadPoolExecutor(24) as ex:
            codes.extend(ex.map(lambda i: post_json(
                px.port, "/v1/completions", {"model": MODEL, "prompt": "b%d" % i,
                                             "max_tokens": 1}).status, range(24)))
        return state(px, "r1") == "rejected"
    poll_until(rejected, what="r1 rejected as the new engine")
    assert sim_stats(b)["requests"] == 0, codes
    px.stop()
    front.close()


class GatedAgent:
    """The replica's agent behind a gate: GET /attestation is passed to the sim's own once the
    gate is open (fetch_first: at once, and only its answer waits for the gate), and `asked`
    counts the reads that arrived."""

    def __init__(self, sim_port, fetch_first=False):
        self.sim_port = sim_port
        self.fetch_first = fetch_first
        self.gate = threading.Event()
        self.gate.set()
        self.asked = 0
        self.ls = socket.socket()
        self.ls.bind(("127.0.0.1", 0))
        self.ls.listen(16)
        self.port = self.ls.getsockname()[1]
        threading.Thread(target=accept_each, args=(self.ls, lambda c: lambda: self._serve(c)),
                         daemon=True).start()

    def _serve(self, c):
        with c:
            head = b""
            while b"\r\n\r\n" not in head:
                d = c.recv(4096)
                if not d:
                    return
                head += d
            target = head.split(b" ")[1].decode()
            r = self._fetch(target) if self.fetch_first else None
            self.asked += 1
            self.gate.wait(30)
            r = r or self._fetch(target)
            body = r.body
            try:
                c.sendall(b"HTTP/1.1 %d OK\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\nConnection: close\r\n\r\n"
                          % (r.status, len(body)) + body)
            except OSError:
                pass  # the proxy no longer waits for this check (its connection has gone)

    def _fetch(self, target):
        """The sim's answer, read again when the read fails: a front that resets one connection
        under the burst would otherwise leave the check without an answer until the next
        interval, and the test would wait on it for nothing. Each failure is printed, so a
        run that still gives up says why."""
        deadline = time.monotonic() + 5 * SLOW
        while True:
            try:
                return http("GET", self.sim_port, target)
            except OSError as e:
                print("    agent: reading %s failed: %r" % (target, e), flush=True)
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def close(self):
        self.gate.set()
        self.ls.close()


def test_a_check_for_a_new_connection_holds_back_only_the_request_that_needs_it():
    """A request that needs a new connection waits for its check; the replica is not held for
    it: with that check stuck at the agent, a request that finds the pooled connection free is
    answered at once, and the waiting one is sent once the check has its verdict."""
    key, pub = keygen("pipeline")
    a = sim(CKPT, "awq", key, "--token-delay-ms", "40")
    agent = GatedAgent(a.port)
    p = agent_pool([a])
    p["replicas"][0]["attest"]["url"] = "http://127.0.0.1:%d/attestation" % agent.port
    px = start_proxy(pools=[p], attestation=attestation(interval=60000, timeout=20000,
                                                         keys=[pub]), workers=1)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert post_json(px.port, "/v1/completions", body).status == 200  # one pooled connection
    agent.gate.clear()
    asked = agent.asked
    with ThreadPoolExecutor(2) as ex:
        # The first takes the pooled connection for 1 s (greedy, "x" runs to 42 tokens); the
        # second needs a new one and asks for a check, which the agent holds.
        slow = ex.submit(post_json, px.port, "/v1/completions",
                         dict(body, max_tokens=25, temperature=0))
        poll_until(lambda: sim_stats(a)["inflight"] == 1, what="the first request at the sim")
        waiting = ex.submit(post_json, px.port, "/v1/completions", body)
        poll_until(lambda: agent.asked > asked, what="the new connection's check at the agent")
        assert slow.result().status == 200
        # The pooled connection is free again: the next request goes over it at once.
        t0 = time.monotonic()
        r = post_json(px.port, "/v1/completions", body)
        took = time.monotonic() - t0
        assert r.status == 200, r
        print("    a request over the pooled connection beside a stuck check: %.0f ms"
              % (took * 1000))
        assert replicas(px)["r1"]["unverified"] is False
        agent.gate.set()
        assert waiting.result().status == 200
    assert took < 2.0 * SLOW, took
    assert sim_stats(a)["requests"] == 4
    px.stop()
    agent.close()


def test_a_switch_while_the_check_runs_never_serves_from_the_new_engine():
    """A balancer switches to another engine while a new connection's check waits for the
    agent, which has already read the old engine. Connections opened before the switch reach
    the old engine, which that check attested; connections opened after it reach the new one
    and wait for a check begun after them, which rejects the replica. Nothing is sent to the
    new engine (the check comes after the connection, not before it)."""
    key, pub = keygen("pipeline")
    a, b = sim(key=key), sim(OTHER, "awq", key)
    front = NatFront(a.port, keep_old=True)
    agent = GatedAgent(front.port, fetch_first=True)
    p = pool("p", [MODEL], [a], manifest=manifest(), queue_timeout_ms=5000)
    p["replicas"][0]["url"] = "http://127.0.0.1:%d" % front.port
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % agent.port}
    px = start_proxy(pools=[p], attestation=attestation(interval=60000, timeout=10000,
                                                         keys=[pub]), workers=2)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert post_json(px.port, "/v1/completions", body).status == 200
    agent.gate.clear()
    asked = agent.asked
    with ThreadPoolExecutor(8) as ex:
        burst = [ex.submit(post_json, px.port, "/v1/completions", dict(body, prompt="b%d" % i))
                 for i in range(8)]
        poll_until(lambda: agent.asked > asked, what="a new connection's check at the agent")
        front.switch(b.port)  # the agent has read the old engine already
        time.sleep(0.05)
        after = [ex.submit(post_json, px.port, "/v1/completions", dict(body, prompt="c%d" % i))
                 for i in range(8)]
        agent.gate.set()
        codes = [f.result().status for f in burst + after]
    # Under load every connection may have opened before the switch: more requests at once than
    # there are pooled connections then open new ones, which reach the new engine.
    def rejected():
        with ThreadPoolExecutor(24) as ex:
            got = list(ex.map(lambda i: post_json(px.port, "/v1/completions",
                                                  dict(body, prompt="d%d" % i)).status,
                              range(24)))
        return any(c != 200 for c in got) and state(px, "r1") == "rejected"
    try:
        poll_until(rejected, what="r1 rejected as the new engine")
    except AssertionError:
        for name, p in (("old engine", a), ("new engine", b)):  # why the agent could not read
            print("    %s on %d: %s; last lines: %s" % (
                name, p.port, "running" if p.alive() else "exited %r" % p.popen.poll(),
                "\n".join(p.lines[-5:])), flush=True)
        raise
    print("    answers: %s; old engine %d, new engine %d requests"
          % (sorted(codes), sim_stats(a)["requests"], sim_stats(b)["requests"]))
    assert sim_stats(b)["requests"] == 0, codes
    px.stop()
    front.close()
    agent.close()


def test_a_request_waiting_for_its_check_times_out_on_time_without_a_verdict():
    """The wait for a new connection's check is bounded by queue_timeout_ms even while no
    verdict comes to wake the request (the check is stuck at the agent)."""
    key, pub = keygen("pipeline")
    a = sim(key=key)
    agent = GatedAgent(a.port)
    p = agent_pool([a], queue_timeout_ms=300)
    p["replicas"][0]["attest"]["url"] = "http://127.0.0.1:%d/attestation" % agent.port
    px = start_proxy(pools=[p], attestation=attestation(interval=60000, timeout=20000,
                                                         keys=[pub]))
    agent.gate.clear()
    t0 = time.monotonic()
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    took = time.monotonic() - t0
    assert r.status == 504 and r.json()["error"]["code"] == "queue_timeout", r
    print("    queue_timeout_ms 300 while the check is stuck: answered after %.0f ms"
          % (took * 1000))
    assert took < 1.0 * SLOW, took
    agent.gate.set()
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status == 200, r
    assert sim_stats(a)["requests"] == 1
    px.stop()
    agent.close()


def test_a_request_routed_again_waits_only_for_what_is_left_of_queue_timeout():
    """queue_timeout_ms bounds all of a request's waiting, not each wait. W waits with its new
    connection for r1's check; meanwhile X queues for r2, busy with a long answer; the check
    finds another engine behind r1 and takes it out of service; W is routed again and queues
    too, ahead of X (it began to wait first), with what is left of its wait. Each is refused
    504 when queue_timeout_ms has passed since it began to wait: W not a whole wait after it
    queued again, nor when X's wait ends; X not sooner for W's."""
    key, pub = keygen("pipeline")
    a, b, c = sim(key=key), sim(OTHER, "awq", key), sim(CKPT, "awq", key)
    front = NatFront(a.port)
    agent = GatedAgent(front.port)
    wait_s = 3.0
    p = agent_pool([a, c], queue_timeout_ms=int(wait_s * 1000), max_inflight_per_replica=1)
    p["replicas"][0]["url"] = "http://127.0.0.1:%d" % front.port
    p["replicas"][0]["attest"]["url"] = "http://127.0.0.1:%d/attestation" % agent.port
    agent.gate.clear()  # r1 is not admitted yet: the long answer goes to r2
    # One worker: W and X in one queue, watched by one timer.
    px = start_proxy(pools=[p], attestation=attestation(interval=60000, timeout=20000,
                                                         keys=[pub]), workers=1)
    poll_until(lambda: state(px, "r2") == "admitted", what="r2 admitted")
    sim_config(c, token_delay_ms=10000)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    with ThreadPoolExecutor(3) as ex:
        busy = ex.submit(post_json, px.port, "/v1/completions", body, timeout=60)
        poll_until(lambda: sim_stats(c)["inflight"] == 1, what="r2 busy")
        agent.gate.set()
        poll_until(lambda: state(px, "r1") == "admitted", what="r1 admitted")
        agent.gate.clear()
        front.switch(b.port)  # new connections to r1 reach another engine
        asked = agent.asked
        t_w = time.monotonic()
        w = ex.submit(post_json, px.port, "/v1/completions", dict(body, prompt="w"), timeout=60)
        poll_until(lambda: agent.asked > asked, what="the check W's new connection waits for")
        time.sleep(0.3 * wait_s)
        t_x = time.monotonic()
        x = ex.submit(post_json, px.port, "/v1/completions", dict(body, prompt="x"), timeout=60)
        time.sleep(0.4 * wait_s)  # most of W's wait goes by before the verdict
        agent.gate.set()
        rw = w.result()
        took_w = time.monotonic() - t_w
        rx = x.result()
        took_x = time.monotonic() - t_x
        print("    queue_timeout_ms %d: W (70%% of it waiting for r1's check, then queued) "
              "answered %d after %.0f ms; X (queued) %d after %.0f ms"
              % (wait_s * 1000, rw.status, took_w * 1000, rx.status, took_x * 1000))
        for r in (rw, rx):
            assert r.status == 504 and r.json()["error"]["code"] == "queue_timeout", r
        # The verdict's round trip is all the slack allowed (a quarter of the wait, for a loaded
        # machine): a whole wait again from the
        # queue would be 1.7x, waiting for X's deadline 1.3x.
        assert took_w < 1.25 * wait_s, took_w
        assert 0.95 * wait_s <= took_x < 1.25 * wait_s, took_x
        assert state(px, "r1") == "rejected"
        assert sim_stats(b)["requests"] == 0
        assert busy.result().status == 200
    px.stop()
    front.close()
    agent.close()


def test_a_held_replicas_check_does_not_queue_behind_other_pools_checks():
    """Checks run at most 16 at a time, but one that clients wait for (a hold) goes first: with
    20 replicas of another pool whose agents never answer filling every place, a request to a
    healthy pool's replica that asks for a check on its first connection is served long
    before those checks time out."""
    key, pub = keygen("pipeline")
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(256)  # accepts (the kernel does), never answers
    hp = hang.getsockname()[1]
    stuck = {"name": "stuck", "models": ["other"],
             "replicas": [{"name": "s%d" % i, "url": "http://127.0.0.1:%d/s%d" % (hp, i),
                           "attest": {"source": "agent",
                                      "url": "http://127.0.0.1:%d/attestation" % hp}}
                          for i in range(20)]}
    a = sim(key=key)
    px = start_proxy(pools=[agent_pool([a]), stuck], ready=False,
                     attestation=attestation(interval=60000, timeout=4000, keys=[pub]))
    poll_until(lambda: state(px, "r1") == "admitted", timeout=15, what="r1 admitted")
    t0 = time.monotonic()
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    took = time.monotonic() - t0
    assert r.status == 200, r
    print("    first request (its check beside 16 hung ones): %.0f ms" % (took * 1000))
    assert took < 1.0 * SLOW, took
    px.stop()
    hang.close()


def test_a_lone_replica_restarting_as_itself_is_back_in_service_at_once():
    """The hold after a close costs a lone replica no more than its downtime: the check it asks
    for finds the engine gone, and an engine that went away under a hold is looked for every
    100 ms at first, so it is admitted again within a few of those of answering; requests then
    reach the new process (none is refused by a stale state)."""
    key, pub = keygen("pipeline")
    a = sim(key=key)
    px = start_proxy(pools=[agent_pool([a])], attestation=attestation(interval=60000, keys=[pub]))
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert r.status == 200, r
    t_down = time.monotonic()
    a2 = restart_on(a, key, CKPT)
    t0 = time.monotonic()
    poll_until(lambda: state(px, "r1") == "admitted" and not replicas(px)["r1"]["unverified"],
               interval=0.01, what="r1 admitted again")
    back = time.monotonic() - t0
    print("    lone replica restarted as itself -> serving again: %.0f ms" % (back * 1000))
    # The looks double from 100 ms to 1 s apart, so the one after the engine is back comes at
    # most as long after as the restart took (a busy box's restart may take a second).
    assert back < min(t0 - t_down, 1.0) + 0.6 * SLOW, (back, t0 - t_down)
    for _ in range(10):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r1", r
    assert sim_stats(a2)["requests"] == 10
    px.stop()


def test_agent_ejects_when_a_model_file_changes():
    key, pub = keygen("pipeline")
    d = os.path.join(TMP, "model-dir")
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "sub"))
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"arch": "toy"}')
    with open(os.path.join(d, "sub", "weights.bin"), "wb") as f:
        f.write(os.urandom(1 << 20))
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "hash", d])
    assert rc == 0, err
    ckpt = out.strip().split()[0]
    replica = start_sim("--model", MODEL, "--quantization", "awq", "--checkpoint-sha256", ckpt)
    agent = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                           "--model-dir", d, "--model", MODEL, "--quantization", "awq",
                           "--dtype", "float16", "--framework", "vllm",
                           "--framework-version", "0.6.3", "--key", key,
                           "--watch-interval-ms", "100"], name="agent")
    p = pool("p", [MODEL], [replica], manifest=manifest(checkpoint_sha256=ckpt))
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % agent.port}
    interval, timeout = 300, 500
    px = start_proxy(pools=[p], attestation=attestation(interval=interval, timeout=timeout,
                                                        keys=[pub]))
    assert state(px, "r1") == "admitted"
    t0 = time.monotonic()
    with open(os.path.join(d, "sub", "weights.bin"), "r+b") as f:
        f.write(b"tampered")
    poll_until(lambda: state(px, "r1") != "admitted", interval=0.01, what="ejected")
    took = time.monotonic() - t0
    print("    file change -> ejection: %.0f ms (interval %d ms + timeout %d ms + agent watch "
          "100 ms)" % (took * 1000, interval, timeout))
    assert took <= (interval + timeout + 100) / 1000.0 * SLOW + 0.5, took
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x"})
    assert r.status == 503
    px.stop()
    agent.stop()


class StrippingAgent:
    """An attacker on the path to a signed agent: relays each attestation request to the real
    agent and hands back its envelope with the signatures removed (`[]`, or the key gone)."""

    def __init__(self, upstream_port, drop_key=False):
        import http.server
        import threading
        import urllib.request
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                with urllib.request.urlopen("http://127.0.0.1:%d%s" % (upstream_port, self.path),
                                            timeout=5) as up:
                    env = json.loads(up.read())
                outer.signed_seen += len(env.get("signatures", []))
                if drop_key:
                    env.pop("signatures", None)
                else:
                    env["signatures"] = []
                body = json.dumps(env).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        self.signed_seen = 0
        self.srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()


def test_stripping_the_signatures_is_refused_when_keys_are_trusted():
    """With trusted_keys set and require_signature omitted, an envelope whose signatures
    were removed on the way (`[]` or no key at all) is rejected, and `check` warns when
    require_signature is turned off explicitly."""
    key, pub = keygen("pipeline")
    sims = [sim(key=key), sim(key=key), sim(key=key)]
    mitm = [StrippingAgent(sims[0].port), StrippingAgent(sims[1].port, drop_key=True)]
    p = agent_pool(sims)
    for r, m in zip(p["replicas"], mitm):
        r["attest"]["url"] = "http://127.0.0.1:%d/attestation" % m.port
    att = {"interval_ms": 300, "timeout_ms": 1000, "trusted_keys": [pub]}  # no require_signature
    px = start_proxy(pools=[p], attestation=att)
    want = {"r1": "rejected", "r2": "rejected", "r3": "admitted"}
    poll_until(lambda: {n: state(px, n) for n in want} == want, what="stripped envelopes judged")
    assert all(m.signed_seen > 0 for m in mitm)  # the real agent did sign; the path removed it
    reps = replicas(px)
    for n in ("r1", "r2"):
        assert "signature" in " ".join(reps[n]["reasons"]).lower(), reps[n]
    for _ in range(5):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r3"
    px.stop()
    # `check`: silent with the default, a warning when explicitly off.
    cfg = json.load(open(px.config_path))
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
    assert rc == 0 and "unsigned" not in err, (rc, out, err)
    cfg["attestation"]["require_signature"] = False
    path = os.path.join(os.path.dirname(px.config_path), "off.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
    assert rc == 0 and "stripped of its signatures" in err, (rc, out, err)
    assert "pools[0].replicas[0].attest" in err, err
    for m in mitm:
        m.close()


def test_dead_engine_behind_a_live_agent_is_unreachable_and_recovers_fast():
    """The agent reads the framework from --framework-url; killing that engine
    must read as `unreachable: framework at URL: connection refused`, not as an identity
    mismatch, and a restarted engine is re-admitted within about a second (not ~10 s)."""
    key, pub = keygen("pipeline")
    d = os.path.join(TMP, "fw-model-dir")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"arch": "toy"}')
    engine_flags = ["--model", MODEL, "--flavor", "vllm", "--framework-version", "0.6.3",
                    "--quantization", "awq", "--dtype", "float16", "--checkpoint-sha256", CKPT]
    engine = start_sim(*engine_flags)
    port = engine.port
    fw_url = "http://127.0.0.1:%d" % port
    agent = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                           "--model-dir", d, "--model", MODEL, "--quantization", "awq",
                           "--dtype", "float16", "--framework-url", fw_url, "--key", key],
                          name="agent")
    p = pool("p", [MODEL], [engine],
             manifest={"model": MODEL, "framework": {"name": "vllm", "version": "0.6.3"}})
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % agent.port}
    px = start_proxy(pools=[p], attestation=attestation(interval=500, keys=[pub]))
    assert state(px, "r1") == "admitted"

    engine.stop()
    t0 = time.monotonic()
    poll_until(lambda: state(px, "r1") != "admitted", interval=0.01, what="r1 leaves admitted")
    took = time.monotonic() - t0
    print("    engine killed -> unreachable: %.0f ms (proxy interval 500 ms; each attestation "
          "starts a fresh framework read)" % (took * 1000))
    assert took <= 3.0 * SLOW  # the path is ~1.5 s; staying stale is ~10, took
    rep = replicas(px)["r1"]
    assert rep["state"] == "unreachable", rep
    assert rep["reasons"] == ["framework at %s: connection refused" % fw_url], rep["reasons"]
    # The agent says so itself, on the endpoint the proxy reads.
    r = http("GET", agent.port, "/attestation?nonce=n")
    assert r.status == 503 and r.json()["error"]["code"] == "framework_unreachable", r.text
    # Down for a while (the agent's retry delay has grown to its cap), then back.
    time.sleep(1.5)
    engine = start_process([SIM_BIN, "--listen", "127.0.0.1:%d" % port] + engine_flags)
    t0 = time.monotonic()
    poll_until(lambda: state(px, "r1") == "admitted", interval=0.01, what="r1 re-admitted")
    took = time.monotonic() - t0
    print("    engine restart -> re-admitted: %.0f ms (agent retry cap 1000 ms + proxy "
          "unreachable re-check 500 ms)" % (took * 1000))
    assert took <= 3.0 * SLOW  # the path is ~1.5 s; staying stale is ~10, took
    px.stop()
    agent.stop()
    engine.stop()


def canary_config(p):
    """A config of pool p alone, written to a file: (config, path)."""
    d = tempfile.mkdtemp(prefix="detproxy-canary-", dir=TMP)
    path = os.path.join(d, "detproxy.json")
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "pools": [p],
           "attestation": attestation(interval=200, require=False)}
    with open(path, "w") as f:
        json.dump(cfg, f)
    return cfg, path


def test_a_llamacpp_canary_turns_the_prompt_cache_off():
    """llama-server's prompt cache can change a temperature-0 answer (a cached prefix is
    evaluated in other batches than a fresh one), so the same canary could answer otherwise for
    having run before: to an identity whose framework is llamacpp, `attest canary` and the
    proxy's check both send it with "cache_prompt": false, the same bytes."""
    eng = start_sim("--flavor", "llamacpp", "--model", MODEL)
    can = {"prompt": "Count: one, two,", "max_tokens": 4}
    p = pool("p", [MODEL], [eng], manifest={"model": MODEL, "framework": {"name": "llamacpp"},
                                            "canary": dict(can)})
    p["replicas"][0]["attest"] = {"source": "llamacpp"}
    cfg, path = canary_config(p)
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "canary", "-c", path, "--pool", "p",
                            "--replica", "r1", "--json"])
    assert rc == 0, (rc, out, err)
    want = {"model": MODEL, "prompt": can["prompt"], "max_tokens": 4, "temperature": 0,
            "seed": 0, "cache_prompt": False}
    assert json.loads(out)["request"] == want, out

    def canaries():
        return [json.loads(r["body"]) for r in get_json(eng.port, "/_sim/requests")["requests"]
                if r["inference"] and json.loads(r["body"]).get("prompt") == can["prompt"]]
    seen = len(canaries())
    px = start_proxy(config=cfg, ready=False)
    poll_until(lambda: len(canaries()) > seen, what="the proxy's canary")
    px.stop()
    assert all(b == want for b in canaries()), canaries()


def test_attest_canary_prints_the_hash_the_proxy_admits():
    """`detproxy attest canary` sends the canary exactly as the proxy does; the
    hash it prints, pinned, admits the replica; unpinned, the proxy admits nothing and says why."""
    honest = sim()
    liar = sim(CKPT, "gptq", None, "--report-quantization", "awq")
    can = {"prompt": "Count: one, two,", "max_tokens": 12}
    # The vllm adapter reports model and framework only: the canary is what tells the two apart.
    p = pool("p", [MODEL], [honest, liar], manifest={
        "model": MODEL, "framework": {"name": "vllm", "version": "0.6.3"}, "canary": dict(can)})
    for r in p["replicas"]:
        r["attest"] = {"source": "vllm"}
    cfg, path = canary_config(p)
    # `check` warns that the hash is not recorded yet (the config is still valid).
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
    assert rc == 0 and "canary.expected_sha256: not recorded" in out + err, (rc, out, err)

    canary = [DETPROXY_BIN, "attest", "canary", "-c", path, "--pool", "p"]
    rc, out, err = run_cmd(canary + ["--replica", "r1"])
    assert rc == 0, (rc, out, err)
    line = [l for l in out.splitlines() if l.startswith("expected_sha256: ")]
    assert len(line) == 1, out
    want = line[0].split()[1]
    assert "not pinned yet" in out, out
    rc, out, err = run_cmd(canary + ["--url", "http://127.0.0.1:%d" % honest.port, "--json"])
    assert rc == 0, err
    j = json.loads(out)
    assert j["expected_sha256"] == want and j["matches_pinned"] is None, j
    assert j["request"] == {"model": MODEL, "prompt": can["prompt"], "max_tokens": 12,
                            "temperature": 0, "seed": 0}, j
    assert hashlib.sha256(j["text"].encode()).hexdigest() == want, j
    # The sim saw exactly the body the proxy sends (compared below with the proxy's own probe).
    def canaries():  # the engine-fingerprint probes go to the same endpoint
        return [b for b in (json.loads(r["body"]) for r in
                            get_json(honest.port, "/_sim/requests")["requests"] if r["inference"])
                if b.get("prompt") == can["prompt"]]
    sent = canaries()

    # Unpinned: the proxy runs the canary but admits nobody, and says what to pin.
    px = start_proxy(config=cfg, ready=False)
    poll_until(lambda: "canary not recorded" in " ".join(replicas(px)["r1"]["reasons"]),
               what="r1 pending: canary not recorded")
    assert state(px, "r1") == "pending"
    assert want in " ".join(replicas(px)["r1"]["reasons"])
    px.stop()
    probes = canaries()[len(sent):]
    assert probes and all(b == sent[0] for b in probes + sent), (sent, probes)

    # Pinned: the honest replica is admitted, the liar is not.
    p["manifest"]["canary"]["expected_sha256"] = want
    px = start_proxy(config=cfg)
    poll_until(lambda: state(px, "r1") == "admitted", what="r1 admitted on the pinned hash")
    poll_until(lambda: "canary mismatch" in " ".join(replicas(px)["r2"]["reasons"]),
               what="r2 held back by the canary")
    assert state(px, "r2") != "admitted"
    px.stop()
    with open(path, "w") as f:
        json.dump(cfg, f)
    rc, out, err = run_cmd(canary + ["--replica", "r1"])
    assert rc == 0 and "matches the pinned expected_sha256" in out, out
    rc, out, err = run_cmd(canary + ["--replica", "r2"])
    assert rc == 0 and "DIFFERS from the pinned" in out, out

    # Errors name what is wrong.
    rc, _, err = run_cmd(canary[:-2] + ["--pool", "nope", "--replica", "r1"])
    assert rc == 2 and "no pool named 'nope' (pools: p)" in err, err
    rc, _, err = run_cmd(canary + ["--replica", "r9"])
    assert rc == 2 and "no replica named 'r9' (replicas: r1, r2)" in err, err
    rc, _, err = run_cmd(canary + ["--replica", "r1", "--url", "http://127.0.0.1:1"])
    assert rc == 2 and "one of --replica R and --url URL" in err, err
    rc, out, err = run_cmd(canary + ["--url", "http://127.0.0.1:9", "--json"])
    assert rc == 3 and "connection refused" in err, err
    assert json.loads(out)["answered"] is False, out
    del p["manifest"]["canary"]
    with open(path, "w") as f:
        json.dump(cfg, f)
    rc, _, err = run_cmd(canary + ["--replica", "r1"])
    assert rc == 2 and "its manifest has no canary prompt" in err, err


def fingerprint(m):
    """docs/configuration.md "Manifest": fp_ + 16 hex of SHA-256 over the six identity fields (absent = empty)."""
    fw = m.get("framework", {})
    fields = [m.get("model"), m.get("checkpoint_sha256"), m.get("quantization"), m.get("dtype"),
              fw.get("name"), fw.get("version")]
    return "fp_" + hashlib.sha256("\n".join(f or "" for f in fields).encode()).hexdigest()[:16]


def test_accept_lets_old_and_new_identities_serve_side_by_side():
    """Manifest "accept": a rollout without blue/green. Old and new replicas are both admitted;
    each answer (JSON, stream, audit line) carries its own identity's fingerprint."""
    key, pub = keygen("pipeline")

    def tgi(ckpt, version):  # TGI puts system_fingerprint on stream chunks too
        return start_sim("--model", MODEL, "--flavor", "tgi", "--framework-version", version,
                         "--quantization", "awq", "--dtype", "float16", "--checkpoint-sha256",
                         ckpt, "--attest-key", key)
    old, new = tgi(CKPT, "2.0.4"), tgi(OTHER, "2.1.0")
    third = tgi(OTHER, "2.0.4")  # the new checkpoint on the old framework: neither identity
    man = manifest(framework={"name": "tgi", "version": "2.0.4"},
                   accept=[{"checkpoint_sha256": OTHER, "framework": {"version": "2.1.0"}}])
    fp_old = fingerprint(man)
    fp_new = fingerprint(dict(man, checkpoint_sha256=OTHER,
                              framework={"name": "tgi", "version": "2.1.0"}))
    want = {"r1": fp_old, "r2": fp_new}
    d = tempfile.mkdtemp(prefix="detproxy-accept-", dir=TMP)
    audit = os.path.join(d, "audit.jsonl")
    policy = {"tenants": [{"name": "t", "match": {"any": True}, "audit": True}]}
    px = start_proxy(pools=[agent_pool([old, new, third], man=man)], policy=policy,
                     log={"level": "info", "audit_path": audit},
                     attestation=attestation(keys=[pub]))
    poll_until(lambda: state(px, "r2") == "admitted" and state(px, "r3") == "rejected",
               what="r2 admitted as the new identity, r3 rejected")
    reps = replicas(px)
    assert state(px, "r1") == "admitted"
    assert reps["r1"]["fingerprint"] == fp_old and reps["r2"]["fingerprint"] == fp_new, reps
    assert reps["r3"]["fingerprint"] is None
    assert "checkpoint_sha256 mismatch" in reps["r3"]["reasons"][0], reps["r3"]
    assert reps["r3"]["reasons"][1] == (
        "nor accept[0] (%s): framework.version mismatch: got 2.0.4 want 2.1.0" % fp_new), reps
    models = get_json(px.port, "/v1/models")["data"][0]["detproxy"]
    assert models["fingerprints"] == [fp_old, fp_new] and models["fingerprint"] == fp_old, models

    seen = set()
    for i in range(16):
        r = post_json(px.port, "/v1/completions",
                      {"model": MODEL, "prompt": "x%d" % i, "max_tokens": 2})
        assert r.status == 200, r
        rep = r.headers["x-detproxy-replica"]
        seen.add(rep)
        assert r.headers["x-detproxy-fingerprint"] == want[rep], (rep, r.headers)
        assert r.json()["system_fingerprint"] == want[rep], r.json()
        got, chunks = {}, 0
        for _, data in sse(px.port, "/v1/completions",
                           {"model": MODEL, "prompt": "s%d" % i, "max_tokens": 2, "stream": True},
                           on_open=lambda resp: got.update(resp.headers)):
            if data != "[DONE]":
                assert json.loads(data)["system_fingerprint"] == want[got["x-detproxy-replica"]]
                chunks += 1
        assert chunks >= 1
        assert got["x-detproxy-fingerprint"] == want[got["x-detproxy-replica"]], got
    assert seen == {"r1", "r2"}, seen
    px.stop()
    lines = [json.loads(l) for l in open(audit) if '"request_id"' in l]
    assert len(lines) == 32, len(lines)
    for l in lines:
        assert l["fingerprint"] == want[l["replica"]], l


if __name__ == "__main__":
    run_tests(globals())
