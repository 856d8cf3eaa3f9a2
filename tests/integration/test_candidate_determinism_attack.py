"""A candidate pool whose manifest is single_sequence. Candidate copies are sent by the control
thread outside the pool's admission, so they must still obey the single_sequence rules
(docs/configuration.md, "Deterministic pools") on the candidate's replicas: one sequence in flight
per replica, and `cache_prompt: false` on a llama.cpp pool (the copy's body was shaped by the
baseline's policy, not the candidate's)."""

import json
import threading
import time

from harness import get_json, poll_until, post_json, run_tests, start_sim
from proxyutil import (FrontCutter, client_requests, metric, pool, sim_config, sim_stats,
                       slots_answer, start_proxy)

MODEL = "m1"


def concurrent(px, n, **extra):
    out = []

    def one(i):
        body = {"model": MODEL, "prompt": "attack %d" % i, "max_tokens": 5, "temperature": 0}
        body.update(extra)
        out.append(post_json(px.port, "/v1/completions", body))
    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def proxy(base, cand, framework=None, policy=None, limits=None):
    man = {"determinism": {"mode": "single_sequence"}}
    if framework:
        man.update(model=MODEL, framework={"name": framework})
    return start_proxy(
        pools=[pool("p", [MODEL], base, candidates=[{"pool": "next", "rate": 1.0}]),
               pool("next", [MODEL], cand, manifest=man)],
        shadow={"rate": 0.0, "self_rate": 0.0, "max_inflight": 8, "max_output_bytes": 65536},
        **({"policy": policy} if policy else {}),
        **({"limits": limits} if limits else {}),
        attestation={"interval_ms": 600000, "timeout_ms": 2000, "require_signature": False})


def test_single_sequence_candidate_never_has_two_copies_at_a_replica():
    base = [start_sim("--model", MODEL) for _ in range(2)]
    cand = start_sim("--model", MODEL, "--token-delay-ms", "30")
    px = proxy(base, [cand])
    res = concurrent(px, 8)
    assert all(r.status == 200 for r in res), [r.status for r in res]
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next") >= 8,
               what="8 candidate copies ended")
    assert sim_stats(cand)["max_inflight_seen"] == 1, sim_stats(cand)
    px.stop()


def test_single_sequence_llamacpp_candidate_gets_cache_prompt_false():
    base = [start_sim("--model", MODEL)]
    cand = start_sim("--model", MODEL, "--flavor", "llamacpp")
    px = proxy(base, [cand], framework="llamacpp")
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3,
                                               "temperature": 0, "cache_prompt": True})
    assert r.status == 200, r
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next") >= 1,
               what="the candidate copy ended")
    body = json.loads(get_json(cand.port, "/_sim/last_request")["body"])
    assert body.get("cache_prompt") is False, body
    px.stop()


def test_several_sequences_at_once_are_refused_by_and_never_copied_to_a_single_sequence_pool():
    """n above 1 (llama.cpp's n_cmpl too), best_of above 1, beam search or a batch of prompts
    run that many sequences at once on the engine: the candidate pool gets no copy of such a request, and a
    request sent to it directly is refused, naming the key."""
    base = [start_sim("--model", MODEL)]
    cand = start_sim("--model", MODEL)
    px = proxy(base, [cand])
    for extra in ({"n": 3}, {"n_cmpl": 2}, {"best_of": 2}, {"use_beam_search": True},
                  {"prompt": ["x", "y"]}):
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0}
        body.update(extra)
        assert post_json(px.port, "/v1/completions", body).status == 200
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next",
                              result="skipped") >= 5, what="five copies skipped")
    assert sim_stats(cand)["requests"] == 0, sim_stats(cand)
    rollouts = get_json(px.admin_port, "/admin/rollouts")
    assert "runs one sequence at a time" in json.dumps(rollouts), rollouts
    # One sequence is copied as before.
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3,
                                               "temperature": 0, "n": 1})
    assert r.status == 200, r
    poll_until(lambda: sim_stats(cand)["requests"] == 1, what="the copy of one sequence")
    px.stop()
    px = start_proxy(pools=[pool("seq", [MODEL], [cand],
                                 manifest={"determinism": {"mode": "single_sequence"}})])
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "n": 2})
    assert r.status == 400, r
    err = r.json()["error"]
    assert err["code"] == "policy_violation" and err["param"] == "n", err
    assert "one sequence at a time" in err["message"], err
    px.stop()


def test_pinned_client_waits_for_the_copy_slot_and_is_then_served():
    """The candidate pool is also a tenant's pinned pool: a copy holding the replica's one slot
    makes the tenant's request queue, and the copy's end hands the slot on (no queue timeout)."""
    base = [start_sim("--model", MODEL)]
    cand = start_sim("--model", MODEL, "--token-delay-ms", "100")
    policy = {"tenants": [{"name": "pin", "match": {"header": {"name": "x-tenant",
                                                               "value": "pin"}},
                           "pool": "next"},
                          {"name": "default", "match": {"any": True}}]}
    px = proxy(base, [cand], policy=policy)
    done = []
    t = threading.Thread(target=lambda: done.append(concurrent(px, 4)))
    t.start()
    hdr = {"x-tenant": "pin", "content-type": "application/json"}
    for i in range(4):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "pin %d" % i,
                                                    "max_tokens": 5, "temperature": 0},
                      headers=hdr)
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r1", r
    t.join()
    assert all(r.status == 200 for r in done[0]), [r.status for r in done[0]]
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next") >= 4,
               what="4 candidate copies ended")
    assert sim_stats(cand)["max_inflight_seen"] == 1, sim_stats(cand)
    px.stop()


def test_single_sequence_candidate_copy_past_a_first_byte_timeout_keeps_the_slot():
    """A copy that gets no answer within upstream_first_byte_timeout_ms fails then, but a
    llama.cpp engine (the sim's --finish-abandoned) goes on generating it: the replica's slot
    stays taken until that answer has come, so the next copy does not run beside it; and a
    shutdown while it is read waits for it before the process goes (docs/operations.md,
    "Draining")."""
    base = [start_sim("--model", MODEL)]
    cand = start_sim("--model", MODEL, "--flavor", "llamacpp", "--token-delay-ms", "100",
                     "--finish-abandoned")
    px = proxy(base, [cand], framework="llamacpp",
               limits={"upstream_first_byte_timeout_ms": 300})
    # Each copy runs 10 tokens, 1 s: it times out at 300 ms; a client every 350 ms.
    for i in range(6):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "slow %d" % i,
                                                    "max_tokens": 10, "temperature": 0})
        assert r.status == 200, r
        time.sleep(0.35)
    poll_until(lambda: sim_stats(cand)["inflight"] == 0, timeout=10, what="the copies done")
    st = sim_stats(cand)
    assert st["max_inflight_seen"] == 1, st
    assert st["requests"] >= 2, st
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next") >= 6,
               what="every copy counted")
    # A copy read on past its timeout when the proxy stops: the stop does not wait for it.
    def failed():
        return metric(px, "detproxy_candidate_total", pool="p", candidate="next", result="error")
    before = failed()
    # Its copy runs 2 s ("last" runs to 63 tokens greedy), past its timeout and into the stop.
    assert post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "last",
                                                  "max_tokens": 20, "temperature": 0}).status == 200
    poll_until(lambda: sim_stats(cand)["inflight"] == 1, what="a copy generating")
    poll_until(lambda: failed() > before, what="the copy past its timeout, read on")
    assert sim_stats(cand)["inflight"] == 1, sim_stats(cand)
    px.stop()
    assert [l["single_sequence_running"] for l in px.find_logs("drained")] == [1]
    st = sim_stats(cand)
    assert st["inflight"] == 0 and st["completed"] == st["requests"], st


def test_single_sequence_candidate_copy_the_replica_closes_on_keeps_the_slot():
    """The candidate replica reads a copy whole and closes without an answer (a gateway in
    front of the engine cut detproxy's side; the engine behind it may be generating still, and
    its GET /slots lists a slot processing): the copy fails `closed`, and the replica's one
    slot stays kept for as long as a drain would, so the next copy is skipped instead of
    running beside it (docs/configuration.md, "Deterministic pools")."""
    base = [start_sim("--model", MODEL)]
    cand = start_sim("--model", MODEL, "--flavor", "llamacpp", "--finish-abandoned")
    front = FrontCutter(cand.port)
    front.slots = lambda head: (200, slots_answer(True))
    px = proxy(base, [front], framework="llamacpp",
               limits={"upstream_first_byte_timeout_ms": 3000, "upstream_idle_timeout_ms": 3000})
    sim_config(cand, fault="close_before_response", fault_count=1)

    def copies(result):
        return metric(px, "detproxy_candidate_total", pool="p", candidate="next", result=result)
    body = {"model": MODEL, "prompt": "cut", "max_tokens": 5, "temperature": 0}
    assert post_json(px.port, "/v1/completions", body).status == 200
    poll_until(lambda: copies("error") >= 1, what="the copy the replica closed on")
    assert post_json(px.port, "/v1/completions", dict(body, prompt="next")).status == 200
    poll_until(lambda: copies("skipped") >= 1, what="the next copy skipped: the slot is kept")
    assert len(client_requests(cand)) == 1, client_requests(cand)  # the copy, not the next
    assert front.slot_looks > 0
    px.stop()
    front.stop()


def test_single_sequence_candidate_copy_silent_past_the_idle_timeout_frees_the_slot_when_it_ends():
    """A streamed copy whose answer begins at once and then falls silent past
    upstream_idle_timeout_ms (llama.cpp's head comes before a long prefill): the copy fails then,
    but its answer is read on and dropped, so the replica's one slot is free the moment that
    answer ends. Not before it (no second sequence beside it), and not the drain's whole time
    later (a slot kept blind): the next copy goes to the replica instead of being skipped."""
    base = [start_sim("--model", MODEL)]
    cand = start_sim("--model", MODEL, "--flavor", "llamacpp", "--token-delay-ms", "400",
                     "--finish-abandoned")
    # A drain may last the longer of the two timeouts, 20 s: far past the copy's 2 s answer.
    px = proxy(base, [cand], framework="llamacpp",
               limits={"upstream_first_byte_timeout_ms": 20000, "upstream_idle_timeout_ms": 200})

    def copies(result):
        return metric(px, "detproxy_candidate_total", pool="p", candidate="next", result=result)
    body = {"model": MODEL, "prompt": "quiet", "max_tokens": 5, "temperature": 0, "stream": True}
    assert post_json(px.port, "/v1/completions", body).status == 200
    poll_until(lambda: copies("error") >= 1, what="the copy past its idle timeout")
    assert sim_stats(cand)["inflight"] == 1, sim_stats(cand)  # read on, not cut
    poll_until(lambda: sim_stats(cand)["inflight"] == 0, timeout=10, what="the copy's answer over")
    assert post_json(px.port, "/v1/completions",
                     dict(body, prompt="next", stream=False, max_tokens=1)).status == 200
    poll_until(lambda: metric(px, "detproxy_candidate_total", pool="p", candidate="next") >= 2,
               what="the next copy ended")
    assert copies("skipped") == 0, copies("skipped")
    assert len(client_requests(cand)) == 2, client_requests(cand)
    assert sim_stats(cand)["max_inflight_seen"] == 1, sim_stats(cand)
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
