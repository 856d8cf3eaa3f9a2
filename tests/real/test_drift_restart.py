"""Verdicts follow the present, in front of real llama.cpp servers (docs/drift.md §5 "History"):
two F16 replicas agree; one is restarted with `-fa off` (the same file and metadata, other
temperature-0 outputs: native attestation cannot tell), and detproxy names it from its history
(it left service and was re-admitted just before their pair began to diverge) and quarantines
it; restarted without the flag, its verdict clears without restarting detproxy.

Uses scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the path); prints SKIPPED and exits
77 when it is missing or the Debian archive cannot be reached. Measured numbers (time and
requests to name, to quarantine, to clear) are printed as a `measured: {...}` line."""

import fcntl
import json
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from realutil import engine, require_engine  # noqa: E402
from harness import free_port, get_json, poll_until, post_json, run_tests  # noqa: E402
from proxyutil import metric, start_proxy  # noqa: E402

TMP = tempfile.mkdtemp(prefix="detproxy-real-drift-")
MODEL = "tiny"
TOKENS = 256  # -fa off shows on 25-30% of these prompts at 128 tokens, 50-60% at 256
FA_OFF = ["-fa", "off"]
REAL_DIR = os.environ.get("DETPROXY_REAL_DIR", "/var/cache/detproxy/real")


def lock_suite():
    """One tests/real run at a time on the machine (the state directory is shared by every
    checkout, and the measurements need the cores): the lock tests/real/test_llamacpp.py takes."""
    os.makedirs(REAL_DIR, exist_ok=True)
    f = open(os.path.join(REAL_DIR, "suite.lock"), "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("waiting for another tests/real run to finish", flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
    return f


require_engine()
SUITE_LOCK = lock_suite()
_names = []


def start(name, port, flags):
    """llama-server `name` on `port` with the f16 model and `flags`, (re)started."""
    if name not in _names:
        _names.append(name)
    for _ in range(3):  # start may misreport a live server as exited: try again
        engine("stop", name)
        if engine("start", name, str(port), "f16", "--", *flags, check=False).returncode == 0:
            return
    raise AssertionError("cannot start llama-server %s" % name)


def replica(name, port):
    return {"name": name, "url": "http://127.0.0.1:%d" % port, "attest": {"source": "llamacpp"}}


def states(px):
    return {r["name"]: r["state"] for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def drift(px):
    return get_json(px.admin_port, "/admin/drift")["pools"]["p"]


class Load:
    """Temperature-0 completions in batches, new prompts each time; after each batch, every
    shadow it drew has ended before the verdict is read."""

    def __init__(self, px):
        self.px, self.sent = px, 0

    def batch(self, n=20, parallel=2):
        errors = []

        def worker(k):
            for i in range(self.sent + k, self.sent + n, parallel):
                r = post_json(self.px.port, "/v1/completions",
                              {"model": MODEL, "prompt": "prompt number %d about things" % i,
                               "max_tokens": TOKENS, "temperature": 0}, timeout=120)
                if r.status != 200:
                    errors.append((r.status, r.body[:200]))
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(parallel)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors[:3]
        self.sent += n
        poll_until(lambda: metric(self.px, "detproxy_shadow_total", pool="p") >= self.sent,
                   timeout=120, what="every shadow of %d requests ended" % self.sent)

    def until(self, cond, what, limit=400):
        start = self.sent
        while not cond():
            assert self.sent - start < limit, "%s: not after %d requests: %s" % (
                what, self.sent - start, json.dumps(drift(self.px))[:1200])
            self.batch()
        return self.sent - start


def restart(px, name, port, flags):
    """Stop the server, wait until detproxy sees r2 out of service, start it with `flags`, wait
    until r2 is admitted again. Returns when it was re-admitted (monotonic)."""
    engine("stop", name)
    poll_until(lambda: states(px)["r2"] in ("pending", "unreachable"), timeout=30,
               what="r2 out of service")
    start(name, port, flags)
    poll_until(lambda: states(px)["r2"] == "admitted", timeout=60, what="r2 re-admitted")
    return time.monotonic()


def test_a_replica_restarted_with_fa_off_is_named_quarantined_and_cleared_when_fixed():
    pid = os.getpid()
    n1, n2 = "drift-%d-1" % pid, "drift-%d-2" % pid
    p1, p2 = free_port(), free_port()
    start(n1, p1, [])
    start(n2, p2, [])
    # Each request draws one shadow, cross or self; attestation every second sees a stopped
    # server within about a second (a quarantined replica gets no client request to fail).
    px = start_proxy(pools=[{"name": "p", "models": [MODEL], "manifest": {"quantization": "F16"},
                             "replicas": [replica("r1", p1), replica("r2", p2)]}],
                     directory=TMP, timeout=30,
                     attestation={"interval_ms": 1000, "timeout_ms": 3000},
                     shadow={"rate": 0.5, "self_rate": 0.5, "max_inflight": 4,
                             "max_output_bytes": 65536, "quarantine": True})
    try:
        poll_until(lambda: states(px) == {"r1": "admitted", "r2": "admitted"}, timeout=30,
                   what="both admitted")
        gen = Load(px)
        first = gen.until(lambda: drift(px)["verdict"] == "consistent", "consistent at first")

        t0 = restart(px, n2, p2, FA_OFF)
        d = drift(px)
        assert d["replicas"]["r2"]["last_change"] is not None, d["replicas"]
        assert states(px) == {"r1": "admitted", "r2": "admitted"}
        to_name = gen.until(lambda: drift(px)["suspect"] == "r2", "r2 named")
        named_s = time.monotonic() - t0
        d = drift(px)
        assert d["verdict"] == "cross_replica_drift", json.dumps(d)[:1200]
        assert any(r.startswith("r2 changed just before its pair with r1 began to diverge")
                   for r in d["reasons"]), d["reasons"]
        named = {"cross_rate": round(1 - d["cross"]["exact_match_rate"], 3),
                 "cross_samples": d["cross"]["samples"], "self_samples": d["self"]["samples"],
                 "reasons": d["reasons"]}
        poll_until(lambda: states(px)["r2"] == "quarantined", timeout=30, what="r2 quarantined")
        quarantined_s = time.monotonic() - t0
        for i in range(4):
            r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "q%d" % i,
                                                       "max_tokens": 4, "temperature": 0})
            assert r.status == 200 and r.headers["x-detproxy-replica"] == "r1", r.headers

        # Fixed: restarted without the flag. The verdict clears at its re-admission.
        t1 = restart(px, n2, p2, [])
        d = drift(px)
        assert d["verdict"] != "cross_replica_drift" and d["suspect"] is None, \
            json.dumps(d)[:1200]
        assert metric(px, "detproxy_drift_verdict", pool="p", verdict="cross_replica_drift") == 0
        to_clear = gen.until(lambda: drift(px)["verdict"] == "consistent", "consistent again")
        cleared_s = time.monotonic() - t1
        assert states(px) == {"r1": "admitted", "r2": "admitted"}, states(px)
        assert metric(px, "detproxy_drift_verdict", pool="p", verdict="consistent") == 1
        print("measured: " + json.dumps({
            "max_tokens": TOKENS, "requests_to_first_consistent": first,
            "requests_to_name": to_name, "s_from_readmission_to_name": round(named_s, 1),
            "s_from_readmission_to_quarantine": round(quarantined_s, 1),
            "named": named, "verdict_at_fixed_readmission": "not cross_replica_drift",
            "requests_to_consistent_after_fix": to_clear,
            "s_from_fixed_readmission_to_consistent": round(cleared_s, 1)}), flush=True)
    finally:
        px.stop()


if __name__ == "__main__":
    try:
        run_tests(globals())
    finally:
        if _names:
            engine("stop", *_names, check=False)
