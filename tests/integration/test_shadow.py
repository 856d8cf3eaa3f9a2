"""Shadow sampling and drift verdicts end to end (docs/drift.md)."""

import hashlib
import json
import threading

from harness import get_json, poll_until, post_json, run_tests, sse, start_sim
from proxyutil import metric, pool, sim_config, sim_stats, start_proxy, wait_all_admitted

MODEL = "m1"


def sims(n, *flags_per):
    out = []
    for i in range(n):
        extra = flags_per[i] if i < len(flags_per) else ()
        out.append(start_sim("--model", MODEL, "--quantization", "awq", *extra))
    return out


def proxy(replicas, rate=0.7, self_rate=0.3, quarantine=False, max_inflight=8):
    px = start_proxy(pools=[pool("p", [MODEL], replicas)],
                     shadow={"rate": rate, "self_rate": self_rate, "max_inflight": max_inflight,
                             "max_output_bytes": 65536, "quarantine": quarantine})
    wait_all_admitted(px)  # a pending replica is no cross target: its shadows are skipped
    return px


def load(px, n, parallel=1, stream=False, temperature=0, first=0):
    def worker(k):
        for i in range(first + k, first + n, parallel):
            body = {"model": MODEL, "prompt": "prompt number %d about things" % i,
                    "max_tokens": 24, "temperature": temperature}
            if stream:
                body["stream"] = True
                for _, d in sse(px.port, "/v1/completions", body):
                    if d == "[DONE]":
                        break
            else:
                r = post_json(px.port, "/v1/completions", body)
                assert r.status == 200, r
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(parallel)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def drift(px):
    return get_json(px.admin_port, "/admin/drift")["pools"]["p"]


def samples(px):
    d = drift(px)
    return d["cross"]["samples"] + d["self"]["samples"]


def load_until(px, want, batch, **kw):
    """Send load in batches until `want` shadow samples were compared. With rate + self_rate
    = 1 every request draws a shadow, but one drawn while shadow.max_inflight run is skipped,
    and on a loaded machine shadows lag the primaries: so how much load gives `want` samples
    is not fixed. Each batch's shadows all end (counted once each) before samples are read."""
    sent = 0
    while samples(px) < want:
        assert sent < 4 * want, "%d requests gave %d samples" % (sent, samples(px))
        load(px, batch, first=sent, **kw)
        sent += batch
        poll_until(lambda: metric(px, "detproxy_shadow_total", pool="p") >= sent,
                   what="every shadow of %d requests ended" % sent)


def test_consistent_pool_stays_consistent():
    rs = sims(3)
    px = proxy(rs)
    load_until(px, 110, 40)
    d = drift(px)
    assert d["verdict"] == "consistent", json.dumps(d)[:600]
    assert d["cross"]["exact_match_rate"] == 1.0
    assert metric(px, "detproxy_shadow_total", pool="p", kind="cross", result="match") > 0
    assert metric(px, "detproxy_shadow_total", pool="p", kind="self", result="match") > 0
    assert metric(px, "detproxy_shadow_total", pool="p", kind="cross", result="diverged") == 0
    px.stop()


def test_drifted_replica_is_named_and_quarantined():
    # r3 reports the same identity but generates differently (a different quantization).
    rs = sims(3, (), (), ("--quantization", "gptq", "--report-quantization", "awq"))
    px = proxy(rs, quarantine=True)
    load_until(px, 150, 40)
    d = drift(px)
    assert d["verdict"] == "cross_replica_drift", json.dumps(d)[:800]
    assert d["suspect"] == "r3", d
    # One "drift_verdict" line per change of verdict or suspect, with the numbers (docs/operations.md §2, log).
    v = px.wait_log(lambda l: l.get("msg") == "drift_verdict" and
                    l.get("to") == "cross_replica_drift" and l.get("suspect") == "r3")
    assert v["level"] == "warn" and v["pool"] == "p", v
    assert v["cross"]["samples"] > 0 and v["cross"]["exact_match_rate"] < 1, v
    assert "samples" in v["self"] and v["reasons"], v
    changes = px.find_logs("drift_verdict")
    assert changes[0]["from"] == "insufficient_data", changes
    for a, b in zip(changes, changes[1:]):
        assert b["from"] == a["to"], changes
        assert (b["to"], b["suspect"]) != (a["to"], a["suspect"]), changes  # changes only
    # One JSON log line per divergence, with hashes of the outputs, never the texts.
    line = px.wait_log("shadow_divergence")
    assert "r3" in (line.get("replica_a"), line.get("replica_b")) or "r3" in json.dumps(line)
    assert any(len(str(v)) == 64 for k, v in line.items() if "sha256" in k), line
    # No log line repeats a key (`kind` was written twice): readers differ on which one wins.
    def unique(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), keys
        return dict(pairs)
    for raw in list(px.lines):
        if raw.startswith("{"):
            json.loads(raw, object_pairs_hook=unique)
    text = json.dumps(px.logs)
    # Quarantined: no more client traffic, but it keeps receiving shadows.
    poll_until(lambda: {r["name"]: r["state"] for r in
                        get_json(px.admin_port, "/admin/replicas")["replicas"]}["r3"]
               == "quarantined", what="r3 quarantined")
    before = sim_stats(rs[2])["requests"]
    for i in range(20):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "q%d" % i,
                                                   "max_tokens": 4, "temperature": 0})
        assert r.headers["x-detproxy-replica"] != "r3"
    poll_until(lambda: sim_stats(rs[2])["requests"] > before, what="shadows still reach r3")
    assert "prompt number" not in text  # texts never logged
    px.stop()


def two_replica_pool(canary=None, interval=4000):
    rs = sims(2)
    p = pool("p", [MODEL], rs)
    if canary:
        # The manifest's canary, recorded from r1 as the proxy sends it (temperature 0, seed 0).
        body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 12,
                "temperature": 0, "seed": 0}
        text = post_json(rs[0].port, "/v1/completions", body).json()["choices"][0]["text"]
        p["manifest"] = {"model": MODEL, "canary": {
            "prompt": body["prompt"], "max_tokens": 12,
            "expected_sha256": hashlib.sha256(text.encode()).hexdigest()}}
        for r in p["replicas"]:
            r["attest"] = {"source": "vllm"}
    px = start_proxy(pools=[p], attestation={"interval_ms": interval},
                     shadow={"rate": 0.7, "self_rate": 0.3, "max_inflight": 8,
                             "max_output_bytes": 65536, "quarantine": False})
    wait_all_admitted(px)
    # r2 starts generating as another quantization while still reporting the pinned one.
    sim_config(rs[1], quantization="gptq", report_quantization="awq")
    load_until(px, 150, 40)
    return rs, px


def test_two_replicas_the_canary_names_the_suspect():
    # With two replicas every cross pair involves both; the canary (ground
    # truth pinned in the manifest) says which one drifted.
    rs, px = two_replica_pool(canary=True)
    poll_until(lambda: drift(px)["suspect"] == "r2", timeout=15,
               what="r2 named by its next canary check")
    d = drift(px)
    assert d["verdict"] == "cross_replica_drift", d
    assert "r2 fails the manifest's canary and r1 passes it" in d["reasons"], d["reasons"]
    px.stop()


def test_two_replicas_without_a_canary_say_exactly_why_no_suspect():
    rs, px = two_replica_pool()
    d = drift(px)
    assert d["verdict"] == "cross_replica_drift" and d["suspect"] is None, d
    # The pair is named in the order its first sample had it.
    why = [x for x in d["reasons"] if x.startswith("suspect undetermined: two replicas (r1, r2)")
           or x.startswith("suspect undetermined: two replicas (r2, r1)")]
    assert why and "no canary result" in why[0] and "add a canary to the manifest or a third " \
        "replica" in why[0], d["reasons"]
    px.stop()


def test_batching_noise_is_not_called_drift():
    rs = sims(3, ("--noise", "0.5"), ("--noise", "0.5"), ("--noise", "0.5"))
    px = proxy(rs, rate=0.5, self_rate=0.5)
    load_until(px, 150, 40, parallel=4)
    d = drift(px)
    assert d["self"]["exact_match_rate"] < 1.0, d["self"]
    assert d["verdict"] == "batching_nondeterminism", json.dumps(d)[:800]
    px.stop()


def test_streamed_primaries_are_teed_and_compared():
    rs = sims(2)
    px = proxy(rs, rate=1.0, self_rate=0.0)
    load_until(px, 20, 20, stream=True)
    d = drift(px)
    assert d["cross"]["samples"] >= 20 and d["cross"]["exact_match_rate"] == 1.0, d["cross"]
    px.stop()


def test_not_comparable_and_skipped_are_counted():
    rs = sims(1)
    px = proxy(rs, rate=1.0, self_rate=0.0)
    load(px, 5, temperature=0.7)  # no seed, temperature > 0: not comparable
    assert metric(px, "detproxy_shadow_total", pool="p", kind="cross",
                  result="not_comparable") == 5
    load(px, 3)  # comparable, but a one-replica pool has no second replica for "cross"
    assert metric(px, "detproxy_shadow_total", pool="p", kind="cross", result="skipped") == 3
    assert sim_stats(rs[0])["requests"] == 8  # no shadow copy was sent
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
