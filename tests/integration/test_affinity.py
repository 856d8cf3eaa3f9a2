"""Affinity routing end to end (docs/configuration.md, "Affinity routing"): one key, one replica; bounded loads spill;
a replica leaving moves only its keys and they come back; session and seed keys; the
x-detproxy-affinity header and detproxy_affinity_total."""

import threading

from harness import SLOW, get_json, http, poll_until, post_json, run_tests, start_sim
from proxyutil import (ScriptedUpstream, keepalive_race, metric, pool, sim_config, sim_stats,
                       start_proxy, wait_all_admitted)
from test_proxy_faults import OK_RESPONSE

MODEL = "m1"
ANY = {"tenants": [{"name": "t", "match": {"any": True}}]}
MANIFEST = {"model": MODEL, "framework": {"name": "vllm", "version": "0.6.3"}}


def setup(n=3, affinity=None, sim_flags=(), workers=0, **kw):
    sims = [start_sim("--model", MODEL, *sim_flags) for _ in range(n)]
    p = pool("p", [MODEL], sims, balance="affinity", **kw)
    if affinity is not None:
        p["affinity"] = affinity
    px = start_proxy(pools=[p], policy=ANY, attestation={"interval_ms": 200,
                                                        "timeout_ms": int(500 * SLOW)},
                     workers=workers)
    return sims, px


def conversation(i, turns):
    """Turn `turns` of conversation i: a shared system prompt, i's first question, history."""
    msgs = [{"role": "system", "content": "You are a helpful assistant. " * 20},
            {"role": "user", "content": "Conversation %d: tell me about topic %d." % (i, i)}]
    for t in range(1, turns):
        msgs.append({"role": "assistant", "content": "Answer %d to conversation %d." % (t, i)})
        msgs.append({"role": "user", "content": "Follow-up %d." % t})
    return {"model": MODEL, "messages": msgs, "max_tokens": 2, "temperature": 0}


def chat(px, body, headers=None):
    r = post_json(px.port, "/v1/chat/completions", body, headers=headers)
    assert r.status == 200, r
    return r.headers["x-detproxy-replica"], r.headers.get("x-detproxy-affinity")


def complete(px, prompt, headers=None, **extra):
    body = dict({"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}, **extra)
    r = post_json(px.port, "/v1/completions", body, headers=headers)
    assert r.status == 200, r
    return r.headers["x-detproxy-replica"], r.headers.get("x-detproxy-affinity")


def state(px, name):
    reps = get_json(px.admin_port, "/admin/replicas")["replicas"]
    return {r["name"]: r["state"] for r in reps}[name]


def test_every_turn_of_a_conversation_meets_one_replica():
    sims, px = setup()
    homes = {}
    for i in range(12):
        for turns in range(1, 5):
            rep, aff = chat(px, conversation(i, turns))
            assert aff == "hit", (i, turns, aff)
            assert homes.setdefault(i, rep) == rep, (i, turns, rep, homes[i])
    # The conversations share a system prompt but not their opening: they spread.
    assert len(set(homes.values())) >= 2, homes
    # A completion prompt is its own key: the same prompt, the same replica, every time.
    first = complete(px, "The same prompt, again and again.")[0]
    for _ in range(5):
        assert complete(px, "The same prompt, again and again.") == (first, "hit")
    assert metric(px, "detproxy_affinity_total", pool="p", result="hit") == 12 * 4 + 6
    assert metric(px, "detproxy_affinity_total", pool="p", result="spill") == 0
    px.stop()


def test_a_busy_replica_spills_to_the_next_and_only_while_busy():
    # Generations take a while, so in-flight counts hold still while the test looks.
    sims, px = setup(sim_flags=("--token-delay-ms", "150"))
    prompt = "one prompt that every request here shares"
    home = complete(px, prompt)[0]
    home_sim = sims[int(home[1:]) - 1]
    results = []

    def send():
        results.append(complete(px, prompt, max_tokens=8))

    # Mean in flight over 3 replicas with 1 running is 1/3: bound 1.25 * 1/3 + 1 = 1.42, so a
    # second request still goes home; with 2 running the bound is 1.83 and the third spills.
    threads = []
    for want in (1, 2):
        t = threading.Thread(target=send)
        t.start()
        threads.append(t)
        poll_until(lambda: sim_stats(home_sim)["inflight"] == want, what="%d in flight" % want)
    rep, aff = complete(px, prompt)
    assert rep != home and aff == "spill", (rep, aff, home)
    for t in threads:
        t.join()
    assert results == [(home, "hit"), (home, "hit")], results
    # Idle again: home again.
    assert complete(px, prompt) == (home, "hit")
    assert metric(px, "detproxy_affinity_total", pool="p", result="spill") == 1
    assert metric(px, "detproxy_affinity_total", pool="p", result="hit") == 4
    px.stop()


def test_max_inflight_still_holds_and_queued_requests_keep_their_key():
    # One slot per replica: a second request for a busy home spills rather than queueing.
    sims, px = setup(n=2, sim_flags=("--token-delay-ms", "150"), max_inflight_per_replica=1)
    prompt = "capacity"
    home = complete(px, prompt)[0]
    home_sim = sims[int(home[1:]) - 1]
    t = threading.Thread(target=complete, args=(px, prompt), kwargs={"max_tokens": 8})
    t.start()
    poll_until(lambda: sim_stats(home_sim)["inflight"] == 1, what="home busy")
    rep, aff = complete(px, prompt)
    # Either the retry rule moved it on ("spill"), or the 200 ms re-attestation had already
    # taken home out of the order before the request came (a loaded machine): then it is the
    # key's first choice ("hit"; the next check may have admitted it again since). Both must
    # land on another replica.
    assert rep != home and aff in ("spill", "hit"), (rep, aff)
    t.join()
    assert max(sim_stats(s)["max_inflight_seen"] for s in sims) == 1
    px.stop()


def test_a_leaving_replica_moves_only_its_keys_and_they_come_back():
    sims, px = setup(manifest=MANIFEST)
    prompts = ["prompt number %d" % i for i in range(30)]
    homes = {p: complete(px, p)[0] for p in prompts}
    assert len(set(homes.values())) == 3, homes
    gone = homes[prompts[0]]
    gone_sim = sims[int(gone[1:]) - 1]
    sim_config(gone_sim, model="another-model")  # attestation now rejects it
    poll_until(lambda: state(px, gone) == "rejected", what="%s rejected" % gone)
    for p in prompts:
        rep, aff = complete(px, p)
        assert rep != gone, (p, rep)
        # Keys of the replicas that stayed did not move; the others found their next one.
        assert aff == "hit" and (homes[p] == gone or rep == homes[p]), (p, rep, homes[p])
    sim_config(gone_sim, model=MODEL)
    poll_until(lambda: state(px, gone) == "admitted", what="%s back" % gone)
    for p in prompts:
        assert complete(px, p) == (homes[p], "hit"), p
    px.stop()


def test_a_retry_goes_to_the_next_replica_in_the_keys_order():
    sims, px = setup()
    prompt = "retry me"
    home = complete(px, prompt)[0]
    home_sim = sims[int(home[1:]) - 1]
    home_sim.stop()  # connection refused: the retry rule sends it on
    rep, aff = complete(px, prompt)
    # Either the retry rule moved it on ("spill"), or the 200 ms re-attestation had already
    # taken home out of the order before the request came (a loaded machine): then it is the
    # key's first choice ("hit"; the next check may have admitted it again since). Both must
    # land on another replica.
    assert rep != home and aff in ("spill", "hit"), (rep, aff)
    # Once the proxy has marked it gone, the key's order starts at that same next replica.
    poll_until(lambda: state(px, home) != "admitted", what="%s out" % home)
    assert complete(px, prompt) == (rep, "hit")
    px.stop()


def test_the_keepalive_race_stays_with_the_keys_replica():
    # A pooled connection the replica closed need not say the replica is gone: the request is
    # routed by its key again, and waits for the re-check the close asked for (the replica may
    # be another engine now) rather than go to another replica (which might answer otherwise).
    # Keep-alive pools are per worker: one worker, so each request finds the last one's.
    ups = [ScriptedUpstream(lambda k, conn_no, req_no: (OK_RESPONSE, True)) for _ in range(3)]
    px = start_proxy(pools=[{"name": "p", "models": [MODEL], "balance": "affinity",
                             "replicas": [{"name": "r%d" % (i + 1),
                                           "url": "http://127.0.0.1:%d" % u.port}
                                          for i, u in enumerate(ups)]}],
                     policy=ANY, attestation={"interval_ms": 600000}, workers=1)
    wait_all_admitted(px)
    prompt = "keep-alive race"
    home = complete(px, prompt)[0]  # leaves a pooled connection to home
    up = ups[int(home[1:]) - 1]
    pooled = up.requests[-1][0]
    status, hdrs, _ = keepalive_race(px, lambda: up.close_conn(pooled), "POST",
                                     "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                         "max_tokens": 2, "temperature": 0})
    assert status == 200 and (hdrs["x-detproxy-replica"], hdrs.get("x-detproxy-affinity")) == \
        (home, "hit"), (status, hdrs)
    assert metric(px, "detproxy_upstream_errors_total", pool="p", replica=home,
                  kind="reused_closed") == 1
    assert len(up.requests) == 2 and up.requests[1][0] != pooled, up.requests  # a new one
    # one placement each, and the second's again after the race
    assert metric(px, "detproxy_affinity_total", pool="p", result="hit") == 3
    px.stop()
    for u in ups:
        u.stop()


def test_session_key_header_then_user_then_prefix():
    sims, px = setup(affinity={"key": "session", "session_header": "X-Conversation"})
    hdr = {"x-conversation": "sess-42"}
    home = complete(px, "first prompt", headers=hdr)
    assert home[1] == "hit"
    homes = set()
    for i in range(10):
        assert complete(px, "prompt %d" % i, headers=hdr) == home  # the session, not the prompt
    # Without the header, the body's `user` decides.
    for u in ("alice", "bob", "carol", "dave"):
        base = complete(px, "a", user=u)
        assert base[1] == "hit"
        homes.add(base[0])
        for i in range(4):
            assert complete(px, "b%d" % i, user=u) == base
    assert len(homes) >= 2, homes
    # Neither: the prompt prefix stands in, and the header says so.
    rep, aff = complete(px, "no session at all")
    assert aff == "fallback"
    assert complete(px, "no session at all") == (rep, "fallback")
    assert metric(px, "detproxy_affinity_total", pool="p", result="fallback") == 2
    px.stop()


def test_seed_key():
    sims, px = setup(affinity={"key": "seed"})
    home = complete(px, "x", seed=7)
    for i in range(8):
        assert complete(px, "different prompt %d" % i, seed=7) == home
    homes = {complete(px, "x", seed=s)[0] for s in range(20)}
    assert len(homes) == 3, homes
    assert complete(px, "unseeded")[1] == "fallback"
    px.stop()


def test_other_balances_and_pass_through_carry_no_affinity_header():
    sims = [start_sim("--model", MODEL) for _ in range(2)]
    px = start_proxy(pools=[pool("p", [MODEL], sims)], policy=ANY)
    assert complete(px, "x")[1] is None
    px.stop()
    # A pass-through request has no key: an affinity pool spreads it by load.
    sims, px = setup(n=2)
    r = http("GET", px.port, "/health")
    assert r.status == 200 and "x-detproxy-affinity" not in r.headers, r
    px.stop()


def test_responses_requests_key_on_their_input():
    # /v1/responses once keyed every request on the empty prompt: all met one replica.
    sims, px = setup()
    homes = {}
    for i in range(12):
        body = {"model": MODEL, "input": "responses question %d" % i, "max_output_tokens": 2,
                "temperature": 0}
        for _ in range(2):
            r = post_json(px.port, "/v1/responses", body)
            assert r.status == 200, r
            homes.setdefault(i, set()).add(r.headers["x-detproxy-replica"])
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set().union(*homes.values())) > 1, homes  # 12 keys, 3 replicas
    px.stop()


def test_hostile_keys_are_answered():
    # Shapes the key extraction must survive: empty and array prompts, content parts, a system
    # prompt cut inside a UTF-8 sequence and inside an escape, 10k messages, odd Responses items,
    # a session header that is long or empty, and a `user` that is not a string.
    sims, px = setup(affinity={"key": "session", "prefix_bytes": 7})
    big = "\u00e9" * 5 + "\u00e9"
    bodies = [
        ("/v1/completions", {"model": MODEL, "prompt": "", "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 1}),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 1}),
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "system", "content": "\u00e9\u00e9\u00e9\u00e9" + "\"x" * 3000},
            {"role": "user", "content": [{"type": "text", "text": "hi"},
                                         {"type": "image_url", "image_url": {"url": "x"}}]}]}),
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "user": 5,
                                  "messages": [{"role": "assistant", "content": "a"}] * 10000}),
        ("/v1/responses", {"model": MODEL, "max_output_tokens": 1, "instructions": big,
                           "input": [{"role": "user", "content": "q"}]}),
    ]
    for path, body in bodies:
        for hdr in ({}, {"x-session-id": ""}, {"x-session-id": "s" * 6000}):
            r = post_json(px.port, path, body, headers=hdr)
            # the replica (not detproxy) refuses a `user` that is not a string
            assert r.status == (400 if "user" in body else 200), (path, r)
            assert r.headers["x-detproxy-affinity"] in ("hit", "spill", "fallback"), r
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
