"""Every request detproxy sends to a replica holds one of its admission slots, whatever its kind
(docs/drift.md, "Which requests are copied, and where"; docs/attestation.md §5): client
requests, drift shadows (cross and self), candidate copies, the attestation probe completion and
the canary, and `detproxy diagnose` run beside the proxy (through its admin relay). With
max_inflight_per_replica 1 a replica therefore never runs two sequences at once,
and at temperature 0 every answer equals the same prompt sent alone (the simulator's `--noise`
flips near-tied tokens whenever requests overlap, as batching does). A replica's in-flight count
survives a reload that removes it and adds it back while its request still runs."""

import hashlib
import json
import os
import tempfile
import threading
import time

from harness import (DETPROXY_BIN, free_port, get_json, http, poll_until, post_json, run_cmd,
                     run_tests, start_sim)
from proxyutil import (FrontCutter, metric, pool, sim_config, sim_reset, sim_stats, slots_answer,
                       start_proxy)

MODEL = "tiny"
FP = "b11669-Debian"


def llama_sim(*extra):
    return start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version", FP,
                     "--quantization", "F16", *extra)


def canary(prompt, n):
    alone = llama_sim()
    r = post_json(alone.port, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                  "max_tokens": n, "temperature": 0, "seed": 0})
    alone.stop()
    return {"prompt": prompt, "max_tokens": n,
            "expected_sha256": hashlib.sha256(r.json()["choices"][0]["text"].encode()).hexdigest()}


def native_pool(name, sims, man, slots, **extra):
    p = pool(name, [MODEL], sims, manifest=man, max_inflight_per_replica=slots, queue_limit=1000,
             queue_timeout_ms=30000, **extra)
    for r in p["replicas"]:
        r["attest"] = {"source": "llamacpp"}
    return p


def load(px, clients, per_client, max_tokens=8):
    """clients threads, each sending per_client distinct prompts at temperature 0. Returns
    {prompt: text}."""
    out, errors, lock = {}, [], threading.Lock()

    def run(k):
        try:
            send(k)
        except Exception as e:  # noqa: BLE001 (reported after the join)
            errors.append(repr(e))

    def send(k):
        for i in range(per_client):
            prompt = "own traffic %d %d: the next words are" % (k, i)
            r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                       "max_tokens": max_tokens,
                                                       "temperature": 0}, timeout=60)
            assert r.status == 200, r
            with lock:
                out[prompt] = r.json()["choices"][0]["text"]
    ts = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:3]
    return out


def own_traffic_mix(slots, noise="0.5", clients=3, per_client=40):
    """Two baseline replicas and a candidate, `slots` each (max_inflight_per_replica), with
    drift shadows (cross and self), candidate copies at rate 1, a canary and native attestation
    every 100 ms, two workers; `clients` clients at temperature 0. Returns (proxy, sims, answers,
    counts) once the clients are done and the copies settled. With noise, overlapping requests
    flip tokens (and a canary beside a client request would fail)."""
    can = canary("Count: one, two,", 6)
    man = {"model": MODEL, "engine_fingerprint": FP, "canary": can}
    base = [llama_sim("--noise", noise, "--token-delay-ms", "2") for _ in range(2)]
    cand = [llama_sim("--noise", noise, "--token-delay-ms", "2")]
    px = start_proxy(
        pools=[native_pool("p", base, man, slots, candidates=[{"pool": "next", "rate": 1.0}]),
               native_pool("next", cand, man, slots)],
        shadow={"rate": 0.5, "self_rate": 0.5, "max_inflight": 8, "max_output_bytes": 65536},
        attestation={"interval_ms": 100, "timeout_ms": 1000, "require_signature": False},
        workers=2)
    poll_until(lambda: all(r["state"] == "admitted" for r in
                           get_json(px.admin_port, "/admin/replicas")["replicas"]),
               what="every replica admitted")
    for s in base + cand:
        http("POST", s.port, "/_sim/reset")
    answers = load(px, clients=clients, per_client=per_client)

    def shadow(result=None):
        return metric(px, "detproxy_shadow_total", pool="p",
                      **({"result": result} if result else {}))
    poll_until(lambda: metric(px, "detproxy_shadow_copies") == 0, timeout=15,
               what="every copy ended (a copy waits 2 s at most for a slot)")
    counts = {k: shadow(k) for k in ("match", "diverged", "skipped", "error")}
    counts["candidate"] = {k: metric(px, "detproxy_candidate_total", pool="p", result=k)
                           for k in ("match", "diverged", "skipped", "error")}
    counts["canaries"] = sum(metric(px, "detproxy_attestations_total", result=k)
                             for k in ("canary_ok", "canary_mismatch"))
    counts["at_replicas"] = sum(sim_stats(s)["requests"] for s in base + cand)
    return px, base + cand, answers, counts


def coverage_line(slots, answers, c):
    n = len(answers)
    drift = c["match"] + c["diverged"] + c["skipped"] + c["error"]
    cand = sum(c["candidate"].values())
    return ("N = %d: %d client requests; drift shadows drawn %d, compared %d, skipped %d "
            "(%.0f per 100 requests); candidate copies %d, compared %d, skipped %d (%.0f per 100); "
            "%d canaries; %d requests at the replicas"
            % (slots, n, drift, c["match"] + c["diverged"], c["skipped"],
               100.0 * c["skipped"] / n, cand, c["candidate"]["match"] + c["candidate"]["diverged"],
               c["candidate"]["skipped"], 100.0 * c["candidate"]["skipped"] / n, c["canaries"],
               c["at_replicas"]))


def test_with_one_slot_no_replica_ever_runs_two_requests_of_any_kind():
    px, sims, answers, c = own_traffic_mix(1)
    # Every kind of our own traffic ran meanwhile...
    assert c["match"] + c["diverged"] > 0 and c["canaries"] > 0, c
    assert c["candidate"]["match"] + c["candidate"]["diverged"] > 0, c
    assert c["at_replicas"] > len(answers) + c["canaries"], c
    # ... and no replica ever had two requests at once,
    for s in sims:
        assert sim_stats(s)["max_inflight_seen"] == 1, sim_stats(s)
    # so every answer is the one the prompt gets alone, and no copy diverged.
    alone = llama_sim("--noise", "0.5")
    for prompt, text in answers.items():
        r = post_json(alone.port, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                      "max_tokens": 8, "temperature": 0})
        assert r.json()["choices"][0]["text"] == text, prompt
    assert c["diverged"] == 0 and c["candidate"]["diverged"] == 0, c
    print("    measured: " + coverage_line(1, answers, c))
    px.stop()


def test_with_four_slots_a_replica_has_at_most_four_requests_of_any_kind():
    px, sims, answers, c = own_traffic_mix(4, noise="0")
    for s in sims:
        assert sim_stats(s)["max_inflight_seen"] <= 4, sim_stats(s)
    assert c["match"] + c["diverged"] > 0, c
    print("    measured: " + coverage_line(4, answers, c))
    px.stop()


def test_a_replica_removed_and_added_back_keeps_its_in_flight_count():
    slow = start_sim("--model", MODEL, "--token-delay-ms", "100")
    other = start_sim("--model", MODEL)
    p = pool("p", [MODEL], [slow], max_inflight_per_replica=1)
    px = start_proxy(pools=[p], attestation={"interval_ms": 600000})
    first = []
    t = threading.Thread(target=lambda: first.append(post_json(
        px.port, "/v1/completions", {"model": MODEL, "prompt": "long", "max_tokens": 20,
                                     "temperature": 0}, timeout=60)))
    t.start()
    poll_until(lambda: sim_stats(slow)["inflight"] == 1, what="the long request running")

    def reload_with(sims):
        with open(px.config_path) as f:
            cfg = json.load(f)
        cfg["pools"][0]["replicas"] = [{"name": "r%d" % (i + 1),
                                        "url": "http://127.0.0.1:%d" % s.port}
                                       for i, s in enumerate(sims)]
        with open(px.config_path, "w") as f:
            json.dump(cfg, f)
        r = http("POST", px.admin_port, "/admin/reload")
        assert r.status == 200, r.text
    reload_with([other])  # r1 is now `other`: the slow replica left the pool...
    reload_with([slow])   # ... and came back, its first request still running
    poll_until(lambda: any(r["state"] == "admitted" for r in
                           get_json(px.admin_port, "/admin/replicas")["replicas"]),
               what="r1 admitted again")
    second = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "next",
                                                    "max_tokens": 2, "temperature": 0},
                       timeout=60)
    t.join()
    assert first[0].status == 200 and second.status == 200, (first, second)
    # The second waited for the first: the replica kept its count across both reloads.
    assert sim_stats(slow)["max_inflight_seen"] == 1, sim_stats(slow)
    px.stop()


def test_diagnose_beside_the_proxy_goes_through_its_slots():
    """diagnose on the running proxy's own config sends every request (the native probe
    completion, the canary, its sequential and concurrent phases) through the admin relay: on
    a limit-1 pool with clients running the replica still never sees two at once. The same
    command with the proxy stopped says it talks to the replicas directly."""
    can = canary("Count: one, two,", 6)
    man = {"model": MODEL, "engine_fingerprint": FP, "canary": can}
    sims = [llama_sim("--noise", "0.5", "--token-delay-ms", "2") for _ in range(2)]
    px = start_proxy(pools=[native_pool("p", sims, man, 1)],
                     admin_listen="127.0.0.1:%d" % free_port(),
                     attestation={"interval_ms": 600000, "require_signature": False})
    for s in sims:
        http("POST", s.port, "/_sim/reset")
    result = {}
    t = threading.Thread(target=lambda: result.update(zip(
        ("rc", "out", "err"), run_cmd([DETPROXY_BIN, "diagnose", "-c", px.config_path, "--json",
                                       "--repeat", "6", "--concurrency", "4"], timeout=120))))
    t.start()
    answers = load(px, clients=3, per_client=10)
    t.join()
    assert result["rc"] in (0, 1), result
    assert "through the running detproxy" in result["err"], result["err"]
    doc = json.loads(result["out"])
    assert doc["through_proxy"] is True, doc
    # 4 sampling + 6 sequential + 6 concurrent completions and the canary, per replica
    for s in sims:
        st = sim_stats(s)
        assert st["max_inflight_seen"] == 1, st
    assert sum(sim_stats(s)["requests"] for s in sims) >= len(answers) + 2 * 17
    # Nothing overlapped, so batching noise never acted: diagnose found none either.
    assert "batching_nondeterminism" not in {f["cause"] for f in doc["findings"]}, doc
    # The relay's answers are counted per replica in the log, and the admin relay refuses what
    # it cannot place.
    r = http("POST", px.admin_port, "/admin/relay/v1/completions", body="{}",
             headers={"x-detproxy-relay-pool": "p", "x-detproxy-relay-replica": "nope"})
    assert r.status == 404 and r.json()["error"]["code"] == "replica_not_found", r
    r = http("POST", px.admin_port, "/admin/relay/v1/completions", body="{}")
    assert r.status == 400 and r.json()["error"]["code"] == "invalid_relay", r
    px.stop()
    rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "-c", px.config_path, "--json",
                            "--repeat", "2", "--concurrency", "2"], timeout=120)
    assert "directly to the replicas: no detproxy answers on admin" in err, err
    assert json.loads(out)["through_proxy"] is False


KEY = "sk-own-traffic-0001"
AUTH = {"authorization": "Bearer " + KEY, "content-type": "application/json"}
POLICY = {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]},
     "sampling": {"temperature": {"force": 0}, "seed": {"force": 7},
                  "max_tokens": {"max": 100}}, "audit": True},
]}


def canary_m1(model, prompt, n, *flags):
    """A manifest canary whose expected output is what a fresh sim with these flags answers."""
    alone = start_sim("--model", model, *flags)
    r = post_json(alone.port, "/v1/completions", {"model": model, "prompt": prompt,
                                                  "max_tokens": n, "temperature": 0, "seed": 0})
    alone.stop()
    return {"prompt": prompt, "max_tokens": n,
            "expected_sha256": hashlib.sha256(r.json()["choices"][0]["text"].encode()).hexdigest()}


def long_request(px, out, prompt="long running client request", n=30, headers=AUTH):
    t = threading.Thread(target=lambda: out.append(post_json(
        px.port, "/v1/completions", {"model": "m1", "prompt": prompt, "max_tokens": n},
        headers=headers, timeout=120)))
    t.start()
    return t


def test_replay_through_the_proxy_sends_its_canary_under_the_slot_too():
    """replay --admin: its own attestation of a replica the proxy serves (the canary, a native
    probe) goes through the relay as well, so on a limit-1 pool with a client request running
    the replica never has two at once."""
    d = tempfile.mkdtemp(prefix="detproxy-own-")
    os.mkdir(os.path.join(d, "store"))
    can = canary_m1("m1", "Count: one, two,", 4)
    sim = start_sim("--model", "m1", "--token-delay-ms", "60")
    p = pool("p", ["m1"], [sim], max_inflight_per_replica=1, queue_timeout_ms=60000,
             manifest={"model": "m1", "canary": can})
    p["replicas"][0]["attest"] = {"source": "vllm"}
    px = start_proxy(pools=[p], policy=POLICY, directory=d,
                     attestation={"interval_ms": 600000},
                     log={"level": "info", "audit_path": "audit.jsonl", "audit_store": "store"})
    r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "audited", "max_tokens": 2},
                  headers=AUTH)
    assert r.status == 200, r
    audit = os.path.join(d, "audit.jsonl")
    sim_reset(sim)
    first = []
    t = long_request(px, first)
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the client request running")
    rc, out, err = run_cmd([DETPROXY_BIN, "replay", "-c", px.config_path, "--audit", audit,
                            "--all", "--admin", "127.0.0.1:%d" % px.admin_port, "--json"],
                           timeout=120)
    t.join()
    st = sim_stats(sim)
    px.stop()
    assert st["max_inflight_seen"] == 1, (st, out, err)


def test_diagnose_beside_a_proxy_with_an_edited_config_still_takes_its_slots():
    """The running proxy is found by its replicas (URLs), not by byte-equal configs: with the
    config file edited and not reloaded (only log.level), diagnose still goes through the relay
    and the limit-1 replica never has two requests at once."""
    sim = start_sim("--model", "m1", "--token-delay-ms", "20")
    p = pool("p", ["m1"], [sim], max_inflight_per_replica=1, queue_timeout_ms=60000)
    px = start_proxy(pools=[p], admin_listen="127.0.0.1:%d" % free_port(),
                     attestation={"interval_ms": 600000})
    cfg = json.load(open(px.config_path))
    cfg.setdefault("log", {})["level"] = "warn"
    with open(px.config_path, "w") as f:
        json.dump(cfg, f)
    sim_reset(sim)
    first = []
    t = long_request(px, first, n=60, headers=None)
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the client request running")
    rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "-c", px.config_path, "--json",
                            "--repeat", "2", "--concurrency", "2"], timeout=120)
    t.join()
    st = sim_stats(sim)
    px.stop()
    assert st["max_inflight_seen"] == 1, (st, err)


def test_the_relay_refuses_head_at_once():
    """HEAD is no relay method (an answer without the body its length announces cannot be passed
    on whole): 405 at once, not a wait for the replica's idle timeout."""
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], limits={"upstream_idle_timeout_ms": 3000})
    assert http("HEAD", sim.port, "/v1/models").status == 200
    # The replica's idle timeout is 3 s: a relay that waited for a body would not answer within
    # this request's own 2 s timeout.
    r = http("HEAD", px.admin_port, "/admin/relay/v1/models",
             headers={"x-detproxy-relay-pool": "p", "x-detproxy-relay-replica": "r1"}, timeout=2)
    px.stop()
    assert r.status == 405, r.status


def single_sequence_llama(sim, drain_ms=20000, **attestation):
    """A single_sequence pool on one llama.cpp replica (whose engine finishes an answer whose
    connection closed), drains lasting drain_ms, an idle timeout of 200 ms."""
    man = {"model": MODEL, "framework": {"name": "llamacpp"},
           "determinism": {"mode": "single_sequence"}}
    return start_proxy(pools=[native_pool("p", [sim], man, 1)],
                       attestation=dict({"interval_ms": 600000, "require_signature": False},
                                        **attestation),
                       limits={"upstream_first_byte_timeout_ms": drain_ms,
                               "upstream_idle_timeout_ms": 200})


def test_a_relay_answer_silent_past_the_idle_timeout_keeps_the_slot_until_it_ends():
    """A relayed stream whose answer begins at once and then falls silent past the idle timeout
    (a long prefill behind an early head): the relay's caller gets its 502 then, and the
    answer is read on and dropped, so the single_sequence replica's slot is free the moment it
    ends: the next request runs after it, not beside it and not a drain's 20 s later."""
    sim = llama_sim("--token-delay-ms", "400", "--finish-abandoned")
    px = single_sequence_llama(sim)
    http("POST", sim.port, "/_sim/reset")
    r = http("POST", px.admin_port, "/admin/relay/v1/completions",
             body=json.dumps({"model": MODEL, "prompt": "quiet", "max_tokens": 5,
                              "temperature": 0, "stream": True}),
             headers={"x-detproxy-relay-pool": "p", "x-detproxy-relay-replica": "r1",
                      "content-type": "application/json"}, timeout=10)
    assert r.status == 502 and r.json()["error"]["code"] == "replica_error", r
    assert "idle_timeout" in r.json()["error"]["message"], r.json()
    assert sim_stats(sim)["inflight"] == 1, sim_stats(sim)  # read on, not cut
    t0 = time.monotonic()
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "next",
                                               "max_tokens": 1, "temperature": 0}, timeout=30)
    assert r.status == 200, r
    assert time.monotonic() - t0 < 5, time.monotonic() - t0
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["requests"] == 2, st
    px.stop()


def test_a_probe_completion_the_replica_closes_on_keeps_the_slot():
    """The attestation's 1-token probe completion is taken whole by the replica, which then
    closes without an answer (a gateway in front of the engine cut detproxy's side): the
    engine may be generating it still, and its GET /slots lists a slot processing, so the
    single_sequence slot is kept for as long as a drain would be, and the next request waits
    rather than running beside it."""
    sim = llama_sim("--finish-abandoned")
    front = FrontCutter(sim.port)
    front.slots = lambda head: (200, slots_answer(True))
    px = single_sequence_llama(front, drain_ms=5000, interval_ms=300, timeout_ms=2000)
    sim_config(sim, fault="close_before_response", fault_count=1)
    poll_until(lambda: sim_stats(sim)["faults_injected"] == 1, timeout=10,
               what="a probe completion closed on")
    t0 = time.monotonic()
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "next",
                                               "max_tokens": 1, "temperature": 0}, timeout=60)
    assert r.status == 200, r
    assert time.monotonic() - t0 >= 3.5, time.monotonic() - t0  # the hold: 5 s from the close
    assert front.slot_looks > 0, front.slot_looks
    assert metric(px, "detproxy_slot_holds_total", end="time") == 1, metric(px, "detproxy_slot_holds_total")
    px.stop()
    front.stop()


if __name__ == "__main__":
    run_tests(globals())
