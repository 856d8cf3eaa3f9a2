"""Candidate pools in front of real llama.cpp servers (docs/rollouts.md): a baseline pool of two
F16 replicas with shadow sampling for its own noise, and two candidate pools getting a copy of
every comparable request: the same F16 file (a redeploy: `equivalent`) and its Q8_0 quantization (a
new build of the model: `diverges`). `detproxy rollout report` gates on it.

Uses scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the path); prints SKIPPED and exits
77 when it is missing or the Debian archive cannot be reached. Measured numbers are printed as
`measured: {...}` lines (docs/rollouts.md quotes them)."""

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))

from harness import (DETPROXY_BIN, get_json, poll_until,  # noqa: E402
                     post_json, run_cmd, run_tests)
from proxyutil import metric, start_proxy  # noqa: E402
from realutil import require_engine, servers, stop_servers  # noqa: E402

TMP = tempfile.mkdtemp(prefix="detproxy-real-rollout-")
MODEL = "tiny"
N = 40          # comparable requests: each gets one drift shadow and a copy per candidate
TOKENS = 32     # F16 and Q8_0 part within 16 tokens on every prompt measured

require_engine()


def server(model):
    """One llama-server of `model` (f16, q8_0); its port."""
    return int(servers("roll", [[]], model=model)[0].rsplit(":", 1)[1])


def replica(name, port):
    return {"name": name, "url": "http://127.0.0.1:%d" % port, "attest": {"source": "llamacpp"}}


def test_same_file_is_equivalent_and_q8_0_diverges():
    t0 = time.monotonic()
    b1, b2, same, q8 = server("f16"), server("f16"), server("f16"), server("q8_0")
    pools = [
        {"name": "p", "models": [MODEL], "replicas": [replica("b1", b1), replica("b2", b2)],
         "candidates": [{"pool": "same-f16", "rate": 1.0}, {"pool": "q8", "rate": 1.0}]},
        {"name": "same-f16", "models": [MODEL], "replicas": [replica("s1", same)]},
        {"name": "q8", "models": [MODEL], "replicas": [replica("q1", q8)]},
    ]
    px = start_proxy(pools=pools, directory=TMP, timeout=30,
                     shadow={"rate": 0.5, "self_rate": 0.5, "max_inflight": 64})
    try:
        poll_until(lambda: all(r["state"] == "admitted" for r in
                               get_json(px.admin_port, "/admin/replicas")["replicas"]),
                   timeout=30, what="every replica admitted")
        t1 = time.monotonic()
        for i in range(N):
            r = post_json(px.port, "/v1/completions",
                          {"model": MODEL, "prompt": "Rollout check %d: the shop opens at" % i,
                           "max_tokens": TOKENS, "temperature": 0}, timeout=120)
            assert r.status == 200, (r.status, r.body[:300])
            assert r.headers["x-detproxy-replica"] in ("b1", "b2"), r.headers
            # One request at a time, its drift copy included: the replicas run one sequence
            # each and copies yield to clients (docs/rollouts.md), so a client sending back to
            # back can keep a copy's replica busy past its wait and the baseline's noise
            # samples would depend on timing. Waiting here makes every copy a sample.
            poll_until(lambda: metric(px, "detproxy_shadow_total", pool="p") >= i + 1,
                       timeout=120, what="the drift shadow of request %d ended" % i)
        for cand in ("same-f16", "q8"):
            poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p",
                                      candidate=cand) >= N,
                       timeout=120, what="every %s copy ended" % cand)
        poll_until(lambda: metric(px, "detproxy_shadow_total", pool="p") >= N, timeout=120,
                   what="every drift shadow ended")
        took = time.monotonic() - t1  # until the last copy was compared
        got = {r["candidate"]: r for r in get_json(px.admin_port, "/admin/rollouts")["rollouts"]}
        same_r, q8_r = got["same-f16"], got["q8"]
        print("measured: " + json.dumps({
            "requests": N, "max_tokens": TOKENS, "load_s": round(took, 1),
            "baseline_noise": same_r["baseline_noise"],
            "same_f16": {k: same_r[k] for k in ("verdict", "samples", "diverged",
                                                 "exact_match_rate", "mean_similarity")},
            "q8_0": {k: q8_r[k] for k in ("verdict", "samples", "diverged", "exact_match_rate",
                                           "mean_similarity", "median_divergence_offset",
                                           "excess_divergence")},
            "q8_0_reasons": q8_r["reasons"]}), flush=True)
        assert same_r["baseline_noise"]["samples"] == N, same_r["baseline_noise"]
        assert same_r["verdict"] == "equivalent", json.dumps(same_r)[:1000]
        assert same_r["samples"] >= 30 and same_r["exact_match_rate"] == 1.0, same_r
        assert q8_r["verdict"] == "diverges", json.dumps(q8_r)[:1000]
        assert q8_r["example_request_ids"] and q8_r["median_divergence_offset"] is not None
        # The clients were billed for their own requests only.
        assert metric(px, "detproxy_requests_total") == N
        rc, out, err = run_cmd([DETPROXY_BIN, "rollout", "report", "-c", px.config_path,
                                "--admin", "127.0.0.1:%d" % px.admin_port])
        assert rc == 1 and "q8" in out and "diverges" in out, (rc, out, err)
        print(out, flush=True)
        print("measured: " + json.dumps({"total_s": round(time.monotonic() - t0, 1)}),
              flush=True)
    finally:
        px.stop()
        stop_servers()


if __name__ == "__main__":
    try:
        run_tests(globals())
    finally:
        stop_servers()
