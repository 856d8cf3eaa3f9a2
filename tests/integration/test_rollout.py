"""Candidate pools (docs/rollouts.md): copies of comparable requests to a candidate pool,
judged against the baseline's own noise on /admin/rollouts and by `detproxy rollout report`."""

import json
import time

from harness import (DETPROXY_BIN, SLOW, free_port, get_json, http, poll_until, post_json, run_cmd,
                     run_tests, sse, start_sim)
from proxyutil import (client_requests, metric, pool, replica, sim_requests, start_proxy,
                       wait_all_admitted, write_config)

MODEL = "m1"
N = 40  # requests per test: each gets a candidate copy (rate 1) and one drift shadow


def baseline_sims():
    return [start_sim("--model", MODEL, "--quantization", "awq") for _ in range(2)]


def rollout_proxy(base, cand_replicas, cand_models=(MODEL,), shadow_rate=0.5, self_rate=0.5,
                  cand_extra=None, ready=True):
    cand = {"name": "next", "models": list(cand_models), "replicas": cand_replicas}
    cand.update(cand_extra or {})
    px = start_proxy(pools=[pool("p", [MODEL], base,
                                 candidates=[{"pool": "next", "rate": 1.0}]), cand],
                     # Room for every copy of a test's load: under a loaded box the candidate
                     # answers slower than the baseline, and a copy over the bound is skipped.
                     shadow={"rate": shadow_rate, "self_rate": self_rate, "max_inflight": 64,
                             "max_output_bytes": 65536},
                     ready=ready)
    return px


def load(px, n, stream_every=0):
    """n comparable requests, one at a time; returns the usage the clients were told."""
    prompt_tokens = completion_tokens = 0
    for i in range(n):
        body = {"model": MODEL, "prompt": "rollout prompt %d about things" % i,
                "max_tokens": 16, "temperature": 0}
        if stream_every and i % stream_every == 0:
            body["stream"] = True
            got = [d for _, d in sse(px.port, "/v1/completions", body)]
            assert got[-1] == "[DONE]", got[-3:]
            continue
        r = post_json(px.port, "/v1/completions", body)
        assert r.status == 200, r
        u = r.json()["usage"]
        prompt_tokens += u["prompt_tokens"]
        completion_tokens += u["completion_tokens"]
    return prompt_tokens, completion_tokens


def copies_ended(px, n):
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next") >= n,
               what="%d candidate copies ended" % n)
    poll_until(lambda: metric(px, "detproxy_shadow_total", pool="p") >= n,
               what="%d drift shadows ended" % n)


def rollout(px, query=""):
    doc = get_json(px.admin_port, "/admin/rollouts" + query)
    assert doc["window"] == 1000, doc
    return doc["rollouts"]


def report(px, *args):
    return run_cmd([DETPROXY_BIN, "rollout", "report", "-c", px.config_path,
                    "--admin", "127.0.0.1:%d" % px.admin_port] + list(args))


def test_equivalent_candidate_and_its_copies_are_not_billed():
    base = baseline_sims()
    cand = start_sim("--model", MODEL, "--quantization", "awq")
    px = rollout_proxy(base, [replica("n1", cand)])
    wait_all_admitted(px)
    prompt, completion = load(px, N, stream_every=4)
    copies_ended(px, N)
    (r,) = rollout(px)
    assert r["pool"] == "p" and r["candidate"] == "next" and r["rate"] == 1, r
    assert r["verdict"] == "equivalent", json.dumps(r)[:800]
    assert r["samples"] == N and r["exact_match_rate"] == 1.0 and r["mean_similarity"] == 1.0, r
    assert r["median_divergence_offset"] is None and r["example_request_ids"] == [], r
    assert r["baseline_noise"]["samples"] >= 30, r["baseline_noise"]
    assert r["tenants"]["default"]["verdict"] == "equivalent", r["tenants"]
    assert metric(px, "detproxy_candidate_total", pool="p", candidate="next",
                  result="match") == N
    # The candidate's replica got every copy, marked as such, with the baseline's request ids.
    copies = [q for q in sim_requests(cand) if q["headers"].get("x-detproxy-shadow")]
    assert copies and all(q["headers"]["x-detproxy-shadow"] == "candidate" for q in copies)
    ids = {q["headers"]["x-detproxy-request-id"] for q in client_requests(base[0]) +
           client_requests(base[1]) if not q["headers"].get("x-detproxy-shadow")}
    assert {q["headers"]["x-detproxy-request-id"] for q in copies} <= ids
    # Never billed to the tenant: requests, tokens and access lines count the clients only.
    assert metric(px, "detproxy_requests_total") == N
    assert metric(px, "detproxy_requests_total", pool="next") == 0
    assert metric(px, "detproxy_tokens_total", pool="next") == 0
    # (streams without stream_options.include_usage report no usage: nothing to count)
    assert metric(px, "detproxy_tokens_total", kind="prompt") == prompt
    assert metric(px, "detproxy_tokens_total", kind="completion") == completion
    assert len([a for a in px.find_logs("access") if a.get("pool") == "next"]) == 0
    poll_until(lambda: len(px.find_logs("access")) >= N, what="the access lines")
    assert len(px.find_logs("access")) == N
    # The status page shows it beside the pool's drift.
    page = http("GET", px.admin_port, "/").text
    assert '<tr data-candidate="next" data-verdict="equivalent">' in page, page[-2000:]
    # The report: a table, exit 0; --json is the admin API's document.
    rc, out, err = report(px)
    assert rc == 0, (rc, out, err)
    assert "equivalent" in out and "next" in out and "within the noise" in out, out
    rc, out, err = report(px, "--json", "--pool", "p")
    assert rc == 0, (rc, out, err)
    assert json.loads(out)["rollouts"][0]["verdict"] == "equivalent"
    assert report(px, "--candidate", "next", "--pool", "p")[0] == 0
    # --candidate of a --pool that does not try it: a usage error, not a pass.
    rc, out, err = report(px, "--candidate", "next", "--pool", "next")
    assert rc == 2 and "not a candidate of pool next" in err, (rc, err)
    px.stop()


def test_diverging_candidate_serving_another_model_name():
    base = baseline_sims()
    # A new checkpoint under its own served name, generating differently.
    cand = start_sim("--model", "m1-next", "--quantization", "gptq")
    px = rollout_proxy(base, [replica("n1", cand)], cand_models=["m1-next"])
    wait_all_admitted(px)
    load(px, N)
    copies_ended(px, N)
    (r,) = rollout(px, "?pool=p")
    assert r["verdict"] == "diverges", json.dumps(r)[:800]
    assert r["samples"] == N and r["exact_match_rate"] < 0.5, r
    assert r["excess_divergence"] > 0.5 and r["median_divergence_offset"] is not None, r
    assert 1 <= len(r["example_request_ids"]) <= 5, r
    assert any("beyond the noise" in x for x in r["reasons"]), r["reasons"]
    assert metric(px, "detproxy_candidate_total", pool="p", candidate="next",
                  result="diverged") > N / 2
    # The copies asked for the candidate's own model name (the sim answers 404 for another).
    copies = [json.loads(q["body"]) for q in sim_requests(cand)
              if q["headers"].get("x-detproxy-shadow") == "candidate"]
    assert copies and all(c["model"] == "m1-next" for c in copies), copies[:2]
    ids = set(r["example_request_ids"])
    lines = px.find_logs("candidate_divergence")
    assert lines and ids <= {l["request_id"] for l in lines}, (ids, lines[:2])
    assert all(l["candidate"] == "next" and l["tenant"] == "default" and l["kind"] == "candidate"
               for l in lines), lines[:2]
    # The clients were answered by the baseline all along.
    r2 = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 4,
                                                "temperature": 0})
    assert r2.status == 200 and r2.json()["model"] == MODEL, r2
    assert 'data-candidate="next" data-verdict="diverges"' in http("GET", px.admin_port, "/").text
    rc, out, err = report(px)
    assert rc == 1, (rc, out, err)
    assert "diverges" in out and "example request ids:" in out, out
    rc, out, _ = report(px, "--json")
    assert rc == 1 and json.loads(out)["rollouts"][0]["verdict"] == "diverges"
    px.stop()


def test_candidate_without_admitted_replica_leaves_baseline_ready():
    base = baseline_sims()
    dead = {"name": "n1", "url": "http://127.0.0.1:%d" % free_port()}
    # start_proxy waits for /readyz 200: it is reached with the candidate never admitted.
    px = rollout_proxy(base, [dead], shadow_rate=0, self_rate=0)
    ready = get_json(px.admin_port, "/readyz")
    assert ready["status"] == "ready" and ready["unready_pools"] == [], ready
    assert ready["unready_candidate_pools"] == ["next"], ready
    load(px, 5)
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next",
                              result="skipped") == 5, what="5 copies skipped")
    (r,) = rollout(px)
    assert r["verdict"] == "insufficient_data", r
    text = " ".join(r["reasons"])
    assert "0 candidate samples in the window, need 30" in text, text
    assert "5 candidate copies skipped (last: pool next has no admitted replica)" in text, text
    assert "baseline noise unknown" in text and "shadow.self_rate" in text, text
    assert r["copies_without_sample"]["skipped"] == 5, r
    # Not comparable: counted apart, never copied.
    r2 = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "warm",
                                                "max_tokens": 4, "temperature": 0.9})
    assert r2.status == 200, r2
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next",
                              result="not_comparable") == 1, what="not_comparable counted")
    # Clients cannot reach a candidate pool by its models: the baseline answers.
    assert metric(px, "detproxy_requests_total", pool="p") == 6
    rc, out, err = report(px)
    assert rc == 0 and "insufficient_data" in out, (rc, out, err)
    px.stop()


def test_slow_or_failing_candidates_never_touch_the_answer():
    base = baseline_sims()
    slow = start_sim("--model", MODEL, "--quantization", "awq", "--token-delay-ms", "500")
    wrong = start_sim("--model", "other")  # answers 404 for m1, which its pool claims to serve
    px = start_proxy(pools=[pool("p", [MODEL], base,
                                 candidates=[{"pool": "slow", "rate": 1.0},
                                             {"pool": "wrong", "rate": 1.0}]),
                            {"name": "slow", "models": [MODEL],
                             "replicas": [replica("s1", slow)]},
                            {"name": "wrong", "models": [MODEL],
                             "replicas": [replica("w1", wrong)]}],
                     shadow={"rate": 0, "self_rate": 0, "max_inflight": 2})
    wait_all_admitted(px)
    t0 = time.monotonic()
    for i in range(6):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "q %d" % i,
                                                    "max_tokens": 16, "temperature": 0})
        assert r.status == 200 and r.headers["x-detproxy-replica"] in ("r1", "r2"), r
    took = time.monotonic() - t0
    # The slow candidate takes 8 s per copy; six answers did not wait for one.
    assert took < 4 * SLOW, took
    assert metric(px, "detproxy_candidate_total", candidate="slow", result="skipped") == 4
    # Each wrong copy fails at once, but the control thread may still hold two of them when
    # the next request's copy is drawn (a loaded machine): that one is skipped, not lost.
    def wrong(result):
        return metric(px, "detproxy_candidate_total", candidate="wrong", result=result)
    poll_until(lambda: wrong("error") + wrong("skipped") == 6,
               what="6 copies of the wrong candidate ended")
    errors = wrong("error")
    assert errors >= 1, errors
    (slow_r, wrong_r) = rollout(px)
    assert "shadow.max_inflight candidate copies already in flight" in " ".join(
        slow_r["reasons"]), slow_r["reasons"]
    assert "%d candidate copies error (last: w1 answered HTTP 404)" % errors in \
        wrong_r["reasons"], wrong_r["reasons"]
    assert slow_r["samples"] == 0 and wrong_r["samples"] == 0
    px.stop()  # two slow copies still in flight: cancelled, a clean exit


def test_report_errors():
    base = baseline_sims()
    px = start_proxy(pools=[pool("p", [MODEL], base)])
    rc, out, err = report(px)
    assert rc == 0 and "no pool has candidates" in out, (rc, out, err)
    rc, out, err = report(px, "--pool", "nope")
    assert rc == 2 and "no pool of that name" in err, (rc, err)
    # A pool that is no pool's candidate: a gate on it would judge nothing and pass.
    rc, out, err = report(px, "--candidate", "p")
    assert rc == 2 and "no pool names it in its candidates" in err, (rc, err)
    port = px.admin_port
    path = px.config_path
    px.stop()
    rc, out, err = run_cmd([DETPROXY_BIN, "rollout", "report", "-c", path,
                            "--admin", "127.0.0.1:%d" % port])
    assert rc == 3 and "is the proxy running?" in err, (rc, err)
    rc, _, err = run_cmd([DETPROXY_BIN, "rollout", "report", "-c", path])
    assert rc == 2 and "--admin" in err, err  # admin_listen has port 0
    # An admin port that takes the connection and never answers: the gate gives up at its
    # --timeout (default 30 s), not at the config's 600 s first-byte timeout.
    import socket
    wedged = socket.socket()
    wedged.bind(("127.0.0.1", 0))
    wedged.listen(4)
    t0 = time.monotonic()
    rc, _, err = run_cmd([DETPROXY_BIN, "rollout", "report", "-c", path, "--timeout", "1",
                          "--admin", "127.0.0.1:%d" % wedged.getsockname()[1]], timeout=30)
    assert rc == 3 and "--timeout passed" in err and time.monotonic() - t0 < 10 * SLOW, (rc, err)
    wedged.close()
    rc, _, err = run_cmd([DETPROXY_BIN, "rollout", "report", "--bogus"])
    assert rc == 2, err
    # A missing or unknown subcommand is one line naming it, as for audit.
    for argv, want in ((["rollout", "lookup"], "detproxy rollout: unknown subcommand 'lookup'"),
                       (["rollout"], "detproxy rollout: missing subcommand (expected report"),
                       (["audit", "bogus"], "detproxy audit: unknown subcommand 'bogus'"),
                       (["audit"], "detproxy audit: missing subcommand (expected verify")):
        rc, out, err = run_cmd([DETPROXY_BIN] + argv)
        assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith(want), \
            (argv, rc, out, err)
    rc, out, _ = run_cmd([DETPROXY_BIN, "rollout", "--help"])
    assert rc == 0 and "--pool" in out and "--json" in out


def test_check_and_run_reject_bad_candidates():
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "pools": [{"name": "p", "models": ["m"], "replicas": [
               {"name": "r1", "url": "http://127.0.0.1:1"}],
               "candidates": [{"pool": "ghost", "rate": 0.1}, {"pool": "p", "rate": 2}]}]}
    path = write_config(cfg)
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
    text = out + err
    assert rc == 1, text
    assert 'pools[0].candidates[0].pool: no pool is named "ghost"' in text, text
    assert "pools[0].candidates[1].pool: a pool cannot be its own candidate" in text, text
    assert "pools[0].candidates[1].rate" in text, text
    rc, out, err = run_cmd([DETPROXY_BIN, "run", "-c", path], timeout=10)
    details = [json.loads(l)["detail"] for l in (out + err).splitlines() if l.startswith("{")]
    assert rc != 0 and 'pools[0].candidates[0].pool: no pool is named "ghost"' in details, \
        (rc, out, err)


def test_check_warns_when_the_baseline_has_no_noise_figure():
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "pools": [{"name": "p", "models": ["m"],
                      "replicas": [{"name": "r1", "url": "http://127.0.0.1:1"}],
                      "candidates": [{"pool": "next", "rate": 0.1}]},
                     {"name": "next", "models": ["m"],
                      "replicas": [{"name": "r1", "url": "http://127.0.0.1:2"}]}]}
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "--strict", "-c", write_config(cfg)])
    assert rc == 1 and "pools[0].candidates: no shadow.self_rate" in out + err, (rc, out, err)
    # Any shadow pairs the pool's clients can get (a self rate, or the cross rate of a tenant
    # that reaches it) give the baseline its noise.
    def tenants(*ts):
        return {"policy": {"tenants": [dict(t, match={"header": {"name": "x-t", "value": t["name"]}})
                                       for t in ts]}}
    for extra in ({"shadow": {"self_rate": 0.01}},
                  tenants({"name": "t", "shadow_rate": 0.05}),
                  dict(shadow={"rate": 0.5}, **tenants({"name": "t"},
                                                        {"name": "u", "shadow_rate": 0})),
                  tenants({"name": "t", "pool": "p", "shadow_rate": 0.05})):
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "--strict", "-c",
                                write_config(dict(cfg, **extra))])
        assert rc == 0 and "shadow" not in out + err, (extra, rc, out, err)
    # None: the global rate overridden to 0, the only rate on a tenant pinned elsewhere, or a
    # single_sequence pool (no copies at all).
    manifest = {"model": "m", "framework": {"name": "llamacpp"},
                "determinism": {"mode": "single_sequence"}}
    exact = {"name": "exact", "models": ["m"], "manifest": manifest,
             "replicas": [{"name": "r1", "url": "http://127.0.0.1:3"}]}
    single = dict(cfg, shadow={"rate": 0.5, "self_rate": 0.5})
    single["pools"] = [dict(cfg["pools"][0], manifest=manifest), cfg["pools"][1]]
    for bad in (dict(cfg, shadow={"rate": 0.5}, **tenants({"name": "t", "shadow_rate": 0})),
                dict(cfg, **tenants({"name": "t", "pool": "next", "shadow_rate": 1},
                                    {"name": "u"})),
                dict(cfg, pools=cfg["pools"] + [exact],
                     **tenants({"name": "t", "require_determinism": "single_sequence",
                                "shadow_rate": 1}, {"name": "u"})),
                single):
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "--strict", "-c", write_config(bad)])
        assert rc == 1 and "pools[0].candidates: " in out + err and "error: pools" not in err \
            and "--strict: 1 warning" in err, (bad, rc, out, err)
    assert "single_sequence pool gets no shadow copies" in out + err, out + err


if __name__ == "__main__":
    run_tests(globals())
