"""Verdicts follow the present (docs/drift.md §5 "History", §7): with two simulated replicas, the
one restarted as something else (seen as leaving service and being re-admitted) is named from
its history and quarantined; restarted as it should be, its verdict clears without restarting
detproxy; POST /admin/drift/reset clears the statistics, and detproxy_drift_verdict follows.

A restart is a fault on every route (the proxy's requests and attestation checks fail: the
replica leaves `admitted`), then none (re-attested, re-admitted). Times and sample counts are
printed as a `measured: {...}` line."""

import json
import os
import tempfile
import threading
import time

from harness import get_json, http, poll_until, post_json, run_tests, start_sim
from proxyutil import metric, pool, sim_config, start_proxy, wait_all_admitted

MODEL = "m1"
FAULT_ALL = {"fault": "close_before_response", "fault_scope": "all"}


def sims(n):
    return [start_sim("--model", MODEL, "--quantization", "awq") for _ in range(n)]


def proxy(rs, **top):
    # rate 1.0 + self_rate 0.5 (scaled to 2/3 and 1/3): every request draws a shadow, and a
    # third of them build the self baseline two replicas need for a cross verdict.
    px = start_proxy(pools=[pool("p", [MODEL], rs)], attestation={"interval_ms": 300},
                     shadow={"rate": 1.0, "self_rate": 0.5, "max_inflight": 8,
                             "max_output_bytes": 65536, "quarantine": True}, **top)
    wait_all_admitted(px)
    return px


def load(px, n, first, parallel=2):
    def worker(k):
        for i in range(first + k, first + n, parallel):
            r = post_json(px.port, "/v1/completions",
                          {"model": MODEL, "prompt": "prompt number %d about things" % i,
                           "max_tokens": 24, "temperature": 0})
            assert r.status == 200, r
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(parallel)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


class Load:
    """Requests in batches, numbered on from one batch to the next (new prompts each time)."""

    def __init__(self, px):
        self.px, self.sent = px, 0

    def until(self, cond, what, batch=20, limit=600):
        start = self.sent
        while True:
            got = cond()
            if got:
                return got
            assert self.sent - start < limit, "%s: not after %d requests: %s" % (
                what, self.sent - start, json.dumps(drift(self.px))[:900])
            # Every shadow of the batch ended (counted once each) before the verdict is read;
            # counted from here, as other requests of the test draw shadows too.
            ended = metric(self.px, "detproxy_shadow_total", pool="p")
            load(self.px, batch, self.sent)
            self.sent += batch
            poll_until(lambda: metric(self.px, "detproxy_shadow_total", pool="p") >= ended + batch,
                       what="every shadow of %d requests ended" % self.sent)


def drift(px):
    return get_json(px.admin_port, "/admin/drift")["pools"]["p"]


def states(px):
    return {r["name"]: r["state"] for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def verdict_gauge(px):
    """The verdict detproxy_drift_verdict{pool="p"} says is current."""
    on = [v for v in ("consistent", "insufficient_data", "batching_nondeterminism",
                      "cross_replica_drift")
          if metric(px, "detproxy_drift_verdict", pool="p", verdict=v) == 1]
    assert len(on) == 1, on
    return on[0]


def restart(px, sim, **changes):
    """The sim goes away (every route fails) and comes back with `changes`; returns once the
    proxy saw it leave service and re-admitted it."""
    before = states(px)["r2"]
    sim_config(sim, **FAULT_ALL)
    poll_until(lambda: states(px)["r2"] in ("pending", "unreachable", "rejected"),
               what="r2 out of service (was %s)" % before)
    sim_config(sim, fault="none", **changes)
    poll_until(lambda: states(px)["r2"] == "admitted", what="r2 re-admitted")


def test_a_restarted_replica_is_named_quarantined_and_cleared_when_fixed():
    rs = sims(2)
    px = proxy(rs)
    gen = Load(px)
    gen.until(lambda: drift(px)["verdict"] == "consistent", "consistent at first")
    assert verdict_gauge(px) == "consistent"

    # r2 restarts generating as another quantization while reporting the pinned one:
    # attestation cannot tell, its history can.
    restart(px, rs[1], quantization="gptq", report_quantization="awq")
    t0 = time.monotonic()
    d = drift(px)
    assert d["replicas"]["r2"]["last_change"]["what"] in (
        "re-admitted from unreachable", "re-admitted from pending"), d["replicas"]["r2"]
    assert d["replicas"]["r1"]["last_change"] is None, d["replicas"]["r1"]
    assert d["cross"]["samples"] == 0, d["cross"]  # a new window for r2's pairs
    sent0 = gen.sent
    gen.until(lambda: drift(px)["suspect"] == "r2", "r2 named")
    named_s, named_req = time.monotonic() - t0, gen.sent - sent0
    d = drift(px)
    assert d["verdict"] == "cross_replica_drift", d
    why = [r for r in d["reasons"] if r.startswith("r2 changed just before its pair with r1 began "
                                                   "to diverge: re-admitted from ")]
    assert why and "the pair agreed before" in why[0], d["reasons"]
    poll_until(lambda: states(px)["r2"] == "quarantined", what="r2 quarantined")
    quarantined_s = time.monotonic() - t0
    assert verdict_gauge(px) == "cross_replica_drift"
    assert metric(px, "detproxy_replica_quarantined", pool="p", replica="r2") == 1
    for i in range(10):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "q%d" % i,
                                                   "max_tokens": 4, "temperature": 0})
        assert r.headers["x-detproxy-replica"] == "r1"
    line = px.wait_log(lambda l: l.get("msg") == "drift_verdict" and l.get("suspect") == "r2")
    assert line["to"] == "cross_replica_drift", line

    # Fixed: restarted as it should be. Its verdict clears at once, without restarting detproxy.
    restart(px, rs[1], quantization="awq", report_quantization="")
    t1 = time.monotonic()
    d = drift(px)
    assert d["verdict"] != "cross_replica_drift" and d["suspect"] is None, d
    assert verdict_gauge(px) != "cross_replica_drift"
    px.wait_log(lambda l: l.get("msg") == "drift_verdict" and
                l.get("from") == "cross_replica_drift")
    sent1 = gen.sent
    gen.until(lambda: drift(px)["verdict"] == "consistent", "consistent after the fix")
    consistent_s, consistent_req = time.monotonic() - t1, gen.sent - sent1
    assert states(px) == {"r1": "admitted", "r2": "admitted"}, states(px)
    assert verdict_gauge(px) == "consistent"
    assert metric(px, "detproxy_replica_quarantined", pool="p", replica="r2") == 0

    # A drift with no change of either just before it names no one: nothing to quarantine.
    sim_config(rs[1], quantization="gptq", report_quantization="awq")
    gen.until(lambda: drift(px)["verdict"] == "cross_replica_drift", "silent drift seen")
    d = drift(px)
    assert d["suspect"] is None, d
    assert states(px) == {"r1": "admitted", "r2": "admitted"}, states(px)
    print("measured: " + json.dumps({
        "requests_to_name": named_req, "s_to_name": round(named_s, 2),
        "s_to_quarantine": round(quarantined_s, 2),
        "verdict_cleared_at_readmission": True,
        "requests_to_consistent_after_fix": consistent_req,
        "s_to_consistent_after_fix": round(consistent_s, 2)}), flush=True)

    # The operator starts the statistics over: the gauge follows. (The ten requests above drew
    # shadows too: every copy has ended first.)
    poll_until(lambda: metric(px, "detproxy_shadow_copies") == 0, what="every copy ended")
    r = http("POST", px.admin_port, "/admin/drift/reset")
    assert r.status == 200 and r.json() == {"reset": ["p"]}, r
    d = drift(px)
    assert d["verdict"] == "insufficient_data" and d["cross"]["samples"] == 0, d
    assert d["cross"]["samples_total"] == 0 and d["pairs"] == [], d
    assert verdict_gauge(px) == "insufficient_data"
    px.wait_log("drift_reset")
    px.stop()


def test_reset_one_pool_unknown_pools_methods_and_the_admin_token():
    rs = sims(2)
    d = tempfile.mkdtemp(prefix="detproxy-drift-")
    tok = "adm-" + os.urandom(8).hex()
    path = os.path.join(d, "admin-token")
    with open(path, "w") as f:
        f.write(tok + "\n")
    os.chmod(path, 0o600)
    px = start_proxy(pools=[pool("p", [MODEL], rs), pool("q", ["m2"], rs[:1])],
                     shadow={"rate": 1.0, "self_rate": 0.5, "max_inflight": 8,
                             "max_output_bytes": 65536}, admin_token_file=path, directory=d)
    auth = {"authorization": "Bearer " + tok}
    poll_until(lambda: all(x["state"] == "admitted" for x in
                           get_json(px.admin_port, "/admin/replicas", headers=auth)["replicas"]),
               what="every replica admitted")
    load(px, 20, 0)
    poll_until(lambda: metric_auth(px, auth) >= 20, what="the shadows of 20 requests ended")

    def samples(p):
        doc = get_json(px.admin_port, "/admin/drift", headers=auth)["pools"][p]
        return doc["cross"]["samples_total"] + doc["self"]["samples_total"]
    # Every request drew a copy; a copy meeting a replica held for its first connection's
    # re-check is skipped (docs/attestation.md), so some, not all, were compared (0-4 of 20
    # skipped here, 11 in one CI run under ASan): what matters below is that there are samples
    # for a reset to clear.
    n = samples("p")
    assert n > 0, n
    # The admin token, as on every admin route.
    assert http("POST", px.admin_port, "/admin/drift/reset").status == 401
    assert http("POST", px.admin_port, "/admin/drift/reset",
                headers={"authorization": "Bearer wrong"}).status == 401
    assert samples("p") == n
    r = http("GET", px.admin_port, "/admin/drift/reset", headers=auth)
    assert r.status == 405, r
    r = http("POST", px.admin_port, "/admin/drift/reset?pool=nope", headers=auth)
    assert r.status == 404 and "no pool is named nope" in r.text, r
    assert samples("p") == n
    # "?pool" names the pool "", not every pool: nothing is reset.
    r = http("POST", px.admin_port, "/admin/drift/reset?pool", headers=auth)
    assert r.status == 404, r
    assert samples("p") == n
    r = http("POST", px.admin_port, "/admin/drift/reset?pool=q", headers=auth)
    assert r.status == 200 and r.json() == {"reset": ["q"]}, r
    assert samples("p") == n  # only the pool named
    r = http("POST", px.admin_port, "/admin/drift/reset?pool=p", headers=auth)
    assert r.status == 200 and r.json() == {"reset": ["p"]}, r
    assert samples("p") == 0
    r = http("POST", px.admin_port, "/admin/drift/reset", headers=auth)
    assert r.status == 200 and r.json() == {"reset": ["p", "q"]}, r
    px.stop()


def metric_auth(px, auth):
    text = http("GET", px.admin_port, "/metrics", headers=auth).text
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
               if l.startswith("detproxy_shadow_total{") and 'pool="p"' in l)


if __name__ == "__main__":
    run_tests(globals())
