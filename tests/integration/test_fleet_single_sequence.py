"""One sequence per engine across a fleet (docs/fleet.md): detproxy instances in front of one
engine of a single_sequence pool take turns on it through a real etcd (Debian's etcd-server), so
the engine runs one request at a time whichever member sends it: under concurrent load, when a
member holding the engine is killed or paused past its lease, across etcd outages and lost
answers, and across reloads that add, remove or change the pool."""

import base64
import json
import signal
import socket
import sys
import threading
import time

from harness import SLOW, get_json, http, poll_until, post_json, run_tests, start_sim
from proxyutil import generating, metric, pool, sim_config, sim_reset, sim_stats, start_proxy
import etcdutil

if etcdutil.ETCD is None:
    print("etcd is not installed (scripts/deps.sh installs etcd-server): skipped")
    sys.exit(77)

MODEL = "m1"
SS = {"determinism": {"mode": "single_sequence"}}


def fleet_cfg(cluster, instance, ttl=3000, endpoints=None):
    return {"name": "t", "instance": instance, "lease_ttl_ms": ttl,
            "etcd": {"endpoints": endpoints or cluster.endpoints()}}


def fleet(px):
    return get_json(px.admin_port, "/admin/fleet")


def wait_members(pxs, n, timeout=10):
    poll_until(lambda: all(fleet(p)["connected"] and len(fleet(p)["members"]) == n for p in pxs),
               timeout=timeout, what="%d fleet members everywhere" % n)


def engine_keys(cluster):
    return cluster.get_prefix("/detproxy/t/engines/")


def reload_pools(px, pools):
    with open(px.config_path) as f:
        cfg = json.load(f)
    cfg["pools"] = pools
    with open(px.config_path, "w") as f:
        json.dump(cfg, f)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 200, r.body


# Every request here is greedy (temperature 0): the sim then gives each prompt a fixed length
# (x 42 tokens, y 45, z 38, w 35, r 10), which the timings below are built on. Sampled, an
# answer's length and end would be the sim's random draw.
def complete(px, prompt, n, **kw):
    return post_json(px.port, "/v1/completions",
                     {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}, **kw)


def in_background(fn):
    out = {}
    t = threading.Thread(target=lambda: out.update(r=fn()), daemon=True)
    t.start()
    return t, out


def stop_all(cluster, *members):
    """Stop the members (each checked for a clean exit), then etcd."""
    for p in members:
        p.stop()
    cluster.stop()


def single_sequence_member(cluster, sims, name, ttl=3000, endpoints=None, attestation=None,
                           **pool_extra):
    return start_proxy(pools=[pool("p", [MODEL], sims, manifest=SS, **pool_extra)],
                       fleet=fleet_cfg(cluster, name, ttl, endpoints),
                       **({"attestation": attestation} if attestation else {}))


def test_single_sequence_engine_runs_one_request_across_the_fleet():
    """Three members in front of one engine of a single_sequence pool run one request at a time
    on it together: each takes the engine's key in etcd before it sends, and they take turns."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "20")
    pxs = [single_sequence_member(cluster, [sim], "gw-%d" % i) for i in range(3)]
    wait_members(pxs, 3)
    out = []

    def send(p, i):
        out.append(complete(p, "s%d" % i, 5).status)
    ts = [threading.Thread(target=send, args=(p, i)) for i in range(4) for p in pxs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    assert out == [200] * 12, out
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["requests"] >= 12, st
    for p in pxs:
        eng = fleet(p)["engines"]
        assert len(eng) == 1 and eng[0]["engine"] == "http://127.0.0.1:%d" % sim.port, eng
        assert eng[0]["taken"] >= 1 and eng[0]["taken"] == eng[0]["given"] + eng[0]["held"], eng
    stop_all(cluster, *pxs)


def test_single_sequence_engine_waits_for_a_killed_holder_and_for_etcd():
    """A member killed while it holds an engine keeps it until its lease expires; without etcd
    no member can know who runs a sequence there, so none starts one until etcd is back."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60")
    a, b = (single_sequence_member(cluster, [sim], "gw-%d" % i, ttl=2000) for i in range(2))
    wait_members([a, b], 2)
    # a holds the engine while "x" generates (42 tokens, 2.5 s), then is killed.
    def doomed():
        try:
            complete(a, "x", 60)
        except OSError:
            pass  # a is killed under it
    threading.Thread(target=doomed, daemon=True).start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="a's request generating")
    assert [e["held"] for e in fleet(a)["engines"]] == [True]
    a.popen.send_signal(signal.SIGKILL)
    a.wait()
    t0 = time.monotonic()
    r = complete(b, "y", 2)
    waited = time.monotonic() - t0
    assert r.status == 200, r.text
    assert waited > 1.0, waited  # the key went with a's lease (2 s), not before
    print("a request through b waited %.2f s for the killed holder's lease (2 s)" % waited)
    # etcd gone: b's key is lost with it, and nothing starts on the engine.
    cluster.stop_member(0)
    poll_until(lambda: not fleet(b)["connected"], timeout=10, what="b disconnected")
    assert [e["starting"] for e in fleet(b)["engines"]] == [False]
    before = sim_stats(sim)["requests"]
    out = {}
    t = threading.Thread(target=lambda: out.update(r=complete(b, "z", 2)))
    t.start()
    poll_until(lambda: fleet(b)["engines"][0]["wanted"], what="the request refused the engine")
    assert sim_stats(sim)["requests"] == before
    cluster.start_member(0)
    t.join(20)
    assert out["r"].status == 200, out
    assert sim_stats(sim)["max_inflight_seen"] == 1
    stop_all(cluster, b)


# ---- what a holder left on llama.cpp: the clean mark and the start check -------------------

LLAMA = dict(SS, model=MODEL, framework={"name": "llamacpp"})
LONG_ANSWERS = {"upstream_first_byte_timeout_ms": 60000, "upstream_idle_timeout_ms": 60000}


def llamacpp_sim():
    """A llama.cpp-like sim that finishes a non-streamed answer whose connection closed."""
    return start_sim("--model", MODEL, "--flavor", "llamacpp", "--token-delay-ms", "20",
                     "--finish-abandoned")


def llamacpp_member(cluster, sim, name, endpoints=None, limits=LONG_ANSWERS, ttl=2000):
    return start_proxy(pools=[pool("p", [MODEL], [sim], manifest=LLAMA)], limits=limits,
                       fleet=fleet_cfg(cluster, name, ttl=ttl, endpoints=endpoints))


def checks(px, **labels):
    return metric(px, "detproxy_engine_start_checks_total", **labels)


def checked_at_start(*pxs):
    for p in pxs:
        poll_until(lambda: checks(p, result="idle") >= 1, what="the check at the member's start")


def let_go(*pxs):
    poll_until(lambda: not any(e["held"] for p in pxs for e in fleet(p)["engines"]),
               what="the key let go of")


def sampled(tokens):
    """A completion of `tokens` tokens sampled with a seed (every one of them generated)."""
    return json.dumps({"model": MODEL, "prompt": "x", "max_tokens": tokens, "temperature": 1,
                       "seed": 1}).encode()


def killed_while_generating(px, sim):
    """A 150-token answer through px (3 s, sampled with a seed: all of them); px SIGKILLed once
    the engine generates it, which finishes it (its connection closed)."""
    c = generating(px.port, b"/v1/completions", sampled(150), sim)
    px.popen.send_signal(signal.SIGKILL)
    px.wait()
    c.close()


def engine_key_gone(cluster):
    poll_until(lambda: not engine_keys(cluster), timeout=10, what="the key gone with its lease")


CAUSE = "its fleet holder did not let it go clean"


def three_members(cluster, sim, b_endpoints=None):
    """Members a, b and c of one fleet in front of sim, each checked at its start, that have
    each run a request there and let go of the key (clean, marked)."""
    a, c = (llamacpp_member(cluster, sim, n) for n in ("gw-a", "gw-c"))
    b = llamacpp_member(cluster, sim, "gw-b", endpoints=b_endpoints)
    wait_members([a, b, c], 3)
    checked_at_start(a, b, c)
    for px in (b, c, a):
        assert complete(px, "w", 3).status == 200
    let_go(a, b, c)
    return a, b, c


def test_the_next_holder_waits_for_what_a_killed_member_left_on_llamacpp():
    """llama.cpp finishes a non-streamed generation whose connection closed. A member killed
    while one ran holds the engine's key until its lease expires; the member that takes the key
    next finds no clean mark beside it and asks the engine's /slots first (a start check),
    starting nothing until that generation has ended. A key let go of clean needs no check, even
    once the member that let go of it has died."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    a, b, c = (llamacpp_member(cluster, sim, "gw-%d" % i) for i in range(3))
    wait_members([a, b, c], 3)
    checked_at_start(a, b, c)
    assert complete(a, "w", 3).status == 200  # the fleet's first take: nobody marked it
    let_go(a)
    assert cluster.get_prefix("/detproxy/t/idle/"), "no clean mark"
    before = [checks(p) for p in (a, b, c)]
    for px in (b, a, c, b):  # handed on clean: no check
        assert complete(px, "w", 3).status == 200
    let_go(a, b, c)
    c.popen.send_signal(signal.SIGKILL)  # idle, after letting go clean: its lease expires
    c.wait()
    poll_until(lambda: len(fleet(b)["members"]) == 2, timeout=10, what="c gone")
    assert complete(b, "w", 3).status == 200
    assert [checks(p) for p in (a, b)] == before[:2], ([checks(p) for p in (a, b)], before)
    # a is killed while the engine generates for it; its lease goes 2 s later, before the
    # generation's end.
    killed_while_generating(a, sim)
    t0 = time.monotonic()
    r = complete(b, "y", 2)
    waited = time.monotonic() - t0
    assert r.status == 200, r.text
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert st["inflight"] == 0, st
    assert checks(b, result="idle") == before[1] + 1, checks(b)
    assert b.find_logs("engine_start_check")[-1]["cause"] == CAUSE
    print("a request through b waited %.2f s: the killed member's lease, then its generation's end"
          % waited)
    stop_all(cluster, b)


def is_engine_take(head, body):
    """Is this etcd request a member's take of an engine key (a transaction putting it)?"""
    if b"/v3/kv/txn" not in head or b"request_put" not in body:
        return False
    return any(base64.b64decode(op["request_put"]["key"]).startswith(b"/detproxy/t/engines/")
               for op in json.loads(body).get("success", []) if "request_put" in op)


class LoseATake(etcdutil.RequestRelay):
    """Passes an engine key's take on to etcd once armed, and loses etcd's answer with the
    connection: the take is applied, and its member does not know."""

    def __init__(self, url):
        super().__init__(url)
        self.armed = False
        self.lost = threading.Event()

    def step(self, c, u, head, body):
        if not self.armed or not is_engine_take(head, body):
            return True
        self.armed = False
        with self.lock:
            self.muted.add(u)
        u.sendall(head + b"\r\n\r\n" + body)
        time.sleep(0.05)
        for x in (c, u):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.lost.set()
        return False


def test_a_take_with_its_answer_lost_leaves_the_check_to_whoever_takes_the_key_next():
    """b's take of a key a killed member left is applied, its answer lost: b does not know the
    key is its own nor what the take found, so it lets go of it without the clean mark, and c,
    which takes it next, checks (the mark's absence, not who held it last, says so)."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    relay = LoseATake(cluster.endpoints()[0])
    a, b, c = three_members(cluster, sim, b_endpoints=[relay.url()])
    killed_while_generating(a, sim)
    engine_key_gone(cluster)
    relay.armed = True
    tb, ob = in_background(lambda: complete(b, "y", 2))
    assert relay.lost.wait(10), "b's take was not seen"
    tc, oc = in_background(lambda: complete(c, "z", 2))
    for t in (tb, tc):
        t.join(60)
    assert ob["r"].status == 200 and oc["r"].status == 200, (ob, oc)
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert any(l["cause"] == CAUSE for p in (b, c) for l in p.find_logs("engine_start_check"))
    stop_all(cluster, b, c)


def test_a_take_sent_again_to_another_endpoint_after_its_answer_was_lost_still_checks():
    """b reaches etcd through two endpoints. Its take of the key a killed member left is applied
    through the first, the answer lost, and sent again to the second, which finds the key already
    b's: what the first take found is not known, so b checks before its request starts."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    relay = LoseATake(cluster.endpoints()[0])
    a, b, c = three_members(cluster, sim, b_endpoints=[relay.url(), cluster.endpoints()[0]])
    killed_while_generating(a, sim)
    engine_key_gone(cluster)
    relay.armed = True
    assert complete(b, "y", 2).status == 200
    assert relay.lost.is_set()
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert b.find_logs("engine_start_check")[-1]["cause"] == CAUSE
    stop_all(cluster, b, c)


def short_drain_members(cluster, sim):
    """Members a and b in front of sim, each checked at its start, that have each run a request
    there and let go of the key; a client that leaves mid-answer is drained for 3 s at most."""
    short = {"upstream_first_byte_timeout_ms": 3000, "upstream_idle_timeout_ms": 3000}
    a, b = (llamacpp_member(cluster, sim, n, limits=short) for n in ("gw-a", "gw-b"))
    wait_members([a, b], 2)
    checked_at_start(a, b)
    for px in (b, a):
        assert complete(px, "w", 3).status == 200
    let_go(a, b)
    return a, b


def fleet_checks(px, cause=CAUSE):
    """The start checks px ended for `cause` (by default: a key taken without the clean mark)."""
    return len([ln for ln in px.find_logs("engine_start_check") if ln.get("cause") == cause])


def served_after_a_check(b, sim, members, before):
    """A request through b answered once one of `members` (b, or the member that held the key)
    had checked the engine for a key not known clean: one check more between them than
    `before`; nothing ran beside what was left there."""
    assert complete(b, "y", 2).status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    poll_until(lambda: sum(fleet_checks(p) for p in members) == before + 1, timeout=5,
               what="the check (%d before)" % before)


def test_a_drain_that_ran_out_its_time_hands_the_key_on_unmarked():
    """a's client leaves mid-answer; a reads the answer on (a drain) for its 3 s and frees the
    slot then, while llama.cpp still generates it. a lets go of the key without the clean mark,
    so b checks and waits for that generation's end."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    a, b = short_drain_members(cluster, sim)
    before = fleet_checks(b)
    generating(a.port, b"/v1/completions", sampled(250), sim).close()  # 5 s
    served_after_a_check(b, sim, [b], before)
    assert metric(a, "detproxy_slot_drains_total", end="time") == 1
    assert a.find_logs("slot_drain_timeout")
    stop_all(cluster, a, b)


def test_a_reload_that_takes_the_pool_away_during_a_drain_hands_the_key_on_unmarked():
    """As above, with a reload taking a's single_sequence pool away while its drain runs: the
    engine object goes with the drain's end, and with it what said the drain ran out its time.
    a lets go of the key unmarked all the same, so b checks before it starts."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    a, b = short_drain_members(cluster, sim)
    before = fleet_checks(b)
    generating(a.port, b"/v1/completions", sampled(250), sim).close()  # 5 s
    reload_pools(a, [pool("q", ["m2"], [start_sim("--model", "m2")])])
    engine_key_gone(cluster)  # once a's drain has run out its 3 s
    served_after_a_check(b, sim, [b], before)
    stop_all(cluster, a, b)


def test_a_pool_taken_away_and_brought_back_unseen_hands_the_key_on_unmarked():
    """a holds the key clean; its client leaves mid-answer and a drains the answer for 3 s. Cut
    off from etcd (its 20 s lease lives on), a is reloaded without the pool; the drain runs out
    its time, and the engine object goes with it; a reload brings the pool back before a sees
    the key's engine gone. The engine object made anew knows nothing of the drain, and the key
    is not known clean: back on etcd, a lets go of it unmarked, and b checks before it
    starts (or a checks first, if it runs something there again)."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    relay = etcdutil.CutRelay(cluster.endpoints()[0])
    short = {"upstream_first_byte_timeout_ms": 3000, "upstream_idle_timeout_ms": 3000}
    p = pool("p", [MODEL], [sim], manifest=LLAMA)
    a = start_proxy(pools=[p], limits=short,
                    fleet=fleet_cfg(cluster, "gw-a", ttl=20000, endpoints=[relay.url()]))
    b = llamacpp_member(cluster, sim, "gw-b")
    wait_members([a, b], 2)
    checked_at_start(a, b)
    for px in (b, a):
        assert complete(px, "w", 3).status == 200
    let_go(a, b)
    before = fleet_checks(a) + fleet_checks(b)
    c = generating(a.port, b"/v1/completions", sampled(600), sim)
    # The generation outlasts what follows, however slow the build: 200 ms a token until a is
    # back on etcd, then quick.
    sim_config(sim, token_delay_ms=200)
    relay.cut()
    poll_until(lambda: not fleet(a)["connected"], timeout=15, what="a cut off")
    c.close()
    reload_pools(a, [pool("q", ["m2"], [start_sim("--model", "m2")])])
    poll_until(lambda: metric(a, "detproxy_slot_drains_total", end="time") == 1, timeout=10,
               what="a's drain run out")
    reload_pools(a, [p])
    relay.restore()
    poll_until(lambda: fleet(a)["connected"], timeout=15, what="a back")
    assert sim_stats(sim)["inflight"] == 1  # what a left still runs
    sim_config(sim, token_delay_ms=5)
    served_after_a_check(b, sim, [a, b], before)
    # The pool came back as an engine object made anew: it had its own start check.
    poll_until(lambda: fleet_checks(a, "new to this process") == 2, timeout=5,
               what="a's start check on the engine object made anew")
    stop_all(cluster, a, b)


def test_a_check_with_no_pool_left_to_ask_through_hands_the_key_on_unmarked():
    """b takes the key a killed member left and begins its check; a reload then takes the pool
    away from b, so the check can ask nobody. b starts nothing there (not even its own request
    queued under the earlier configuration) and lets the key go without the clean mark: c, next,
    checks, and nothing runs beside the generation the killed member left."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    other = start_sim("--model", MODEL)
    a, b, c = three_members(cluster, sim)
    killed_while_generating(a, sim)
    tb, ob = in_background(lambda: complete(b, "y", 2))
    poll_until(lambda: b.find_logs("fleet_engine_checking"), timeout=15, what="b checking")
    reload_pools(b, [pool("q", [MODEL], [other])])
    tc, oc = in_background(lambda: complete(c, "z", 2))
    for t in (tb, tc):
        t.join(60)
    assert oc["r"].status == 200 and ob["r"].status == 200, (ob, oc)  # b's once c marked it
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert b.find_logs("engine_start_check")[-1]["result"] == "unanswered"
    assert c.find_logs("engine_start_check")[-1]["cause"] == CAUSE
    stop_all(cluster, b, c)


def test_a_member_cut_off_from_etcd_while_a_holder_died_checks_when_it_is_back():
    """b is cut off from etcd while a takes the key, is killed mid-answer and its lease expires:
    b never saw a's key. Back, b finds no clean mark where the key was and checks before its
    request starts."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    relay = etcdutil.CutRelay(cluster.endpoints()[0])
    a, b, c = three_members(cluster, sim, b_endpoints=[relay.url()])
    assert complete(c, "w", 3).status == 200  # the last holder b sees is c, alive
    let_go(c)
    before = fleet_checks(b)
    relay.cut()
    poll_until(lambda: not fleet(b)["connected"], timeout=15, what="b cut off")
    killed_while_generating(a, sim)
    # What a left outlasts the lease's expiry and b's reconnect however slow the box: 200 ms a
    # token until b is back, then as before.
    sim_config(sim, token_delay_ms=200)
    engine_key_gone(cluster)
    relay.restore()
    poll_until(lambda: fleet(b)["connected"], timeout=15, what="b back")
    assert sim_stats(sim)["inflight"] == 1  # what a left still runs
    sim_config(sim, token_delay_ms=20)
    served_after_a_check(b, sim, [b], before)
    stop_all(cluster, b, c)


def test_single_sequence_engine_key_survives_an_etcd_restart_and_is_let_go():
    """etcd restarts while a member holds an engine's key: its lease lives on across the restart,
    and so does the key. The member, connected again on that lease, still knows the key is its
    own and lets go of it once its request has ended, so the other member can run there."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50")
    a, b = (single_sequence_member(cluster, [sim], "gw-%d" % i) for i in range(2))
    wait_members([a, b], 2)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=complete(a, "x", 40)))
    t.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="a's request generating")
    assert [e["held"] for e in fleet(a)["engines"]] == [True]
    cluster.stop_member(0)
    poll_until(lambda: not fleet(a)["connected"], timeout=10, what="a disconnected")
    cluster.start_member(0)
    cluster.wait_healthy()
    t.join(20)
    assert out["r"].status == 200, out
    poll_until(lambda: fleet(a)["connected"] and fleet(b)["connected"], timeout=10,
               what="both connected again")
    poll_until(lambda: not cluster.get_prefix("/detproxy/t/engines/"), timeout=5,
               what="a letting go of the key")
    r = complete(b, "y", 2)
    assert r.status == 200, r.text
    assert sim_stats(sim)["max_inflight_seen"] == 1
    stop_all(cluster, a, b)


def test_single_sequence_member_paused_past_its_lease_starts_nothing_when_it_wakes():
    """A member paused (SIGSTOP) past its lease while it held an engine: another member takes
    the engine once the lease is gone; the paused one, when it runs again, does not start a
    request there on the strength of a key it no longer holds."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60")
    a, b = (single_sequence_member(cluster, [sim], "gw-%d" % i, ttl=2000) for i in range(2))
    wait_members([a, b], 2)
    r = complete(a, "w", 2)
    assert r.status == 200, r.text
    # a takes the engine for "x" (42 tokens, 2.5 s) and is paused while holding it.
    ax = {}
    t = threading.Thread(target=lambda: ax.update(r=complete(a, "x", 60)))
    t.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="x generating")
    a.popen.send_signal(signal.SIGSTOP)
    try:
        # b waits for a's lease (2 s), then runs "y" (40 tokens) once x has ended.
        by = {}
        u = threading.Thread(target=lambda: by.update(r=complete(b, "y", 40)))
        u.start()
        poll_until(lambda: fleet(b)["engines"][0]["held"] and sim_stats(sim)["inflight"] == 1 and
                   sim_stats(sim)["completed"] >= 2, timeout=15, what="y running through b")
        sim_reset(sim)
        # A request reaches a while it sleeps; then a wakes, holding a key that is b's now.
        az = {}
        v = threading.Thread(target=lambda: az.update(r=complete(a, "z", 2)))
        v.start()
    finally:
        a.popen.send_signal(signal.SIGCONT)
    for th in (t, u, v):
        th.join(30)
    assert ax["r"].status == 200 and by["r"].status == 200 and az["r"].status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    stop_all(cluster, a, b)


def test_a_pool_that_stops_and_starts_being_single_sequence_takes_the_key_again():
    """A reload makes the holder's pool ordinary (its key goes), another member takes the engine,
    and a reload makes the pool single_sequence again: the first member's requests wait for the
    key; what it held before does not count."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50")
    a, b = (single_sequence_member(cluster, [sim], "gw-%d" % i, ttl=10000,
                                   attestation={"interval_ms": 100}) for i in range(2))
    wait_members([a, b], 2)
    assert complete(a, "w", 1).status == 200  # a has held the engine
    reload_pools(a, [pool("p", [MODEL], [sim])])
    poll_until(lambda: not engine_keys(cluster), what="a letting go of the engine")
    t, x = in_background(lambda: complete(b, "x", 40))  # 2 s through b, holding the engine
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="x generating")
    reload_pools(a, [pool("p", [MODEL], [sim], manifest=SS)])
    beside = 0
    while t.is_alive():
        r = complete(a, "z", 1)
        beside += r.status == 200 and t.is_alive()
    t.join()
    assert x["r"].status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, (beside, st, fleet(a)["engines"])
    stop_all(cluster, a, b)


def test_a_single_sequence_pool_added_by_a_reload_waits_for_the_key_from_its_first_request():
    """A reload adds a single_sequence pool for an engine another member runs a request on, while
    requests for it keep arriving: none of them starts before this member holds the engine."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50")
    sim2 = start_sim("--model", "m2")
    b = single_sequence_member(cluster, [sim], "gw-1")
    a = start_proxy(pools=[pool("q", ["m2"], [sim2])], fleet=fleet_cfg(cluster, "gw-0"))
    wait_members([a, b], 2)
    t, x = in_background(lambda: complete(b, "x", 40))
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="x generating")
    stop = []

    def hammer():
        while not stop:
            complete(a, "h", 1, timeout=5)
    hs = [threading.Thread(target=hammer, daemon=True) for _ in range(4)]
    for h in hs:
        h.start()
    reload_pools(a, [pool("q", ["m2"], [sim2]), pool("p", [MODEL], [sim], manifest=SS)])
    t.join(20)
    stop.append(1)
    for h in hs:
        h.join(10)
    assert x["r"].status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    stop_all(cluster, a, b)


def relay(px, prompt, n):
    return http("POST", px.admin_port, "/admin/relay/v1/completions",
                body=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": n,
                                 "temperature": 0}),
                headers={"content-type": "application/json", "x-detproxy-relay-pool": "p",
                         "x-detproxy-relay-replica": "r1"}, timeout=40)


def test_a_relay_passed_a_slot_on_a_member_woken_past_its_lease_waits_for_the_key():
    """A relay through a waits for a slot and claims the next one freed; a is paused while its
    request runs, that request ends, a's lease goes and b takes the engine. When a wakes, the
    slot passes to the relay, which waits for the engine as any request would."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50")
    a, b = (single_sequence_member(cluster, [sim], "gw-%d" % i, ttl=2000) for i in range(2))
    wait_members([a, b], 2)
    # x runs 1.2 s: the relay has to be seen holding the next slot, which it is counted as only
    # once it has waited 200 ms, before x ends.
    t, x = in_background(lambda: complete(a, "x", 24))
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="x generating")
    rt, rr = in_background(lambda: relay(a, "r", 4))
    poll_until(lambda: get_json(a.admin_port, "/admin/replicas")["replicas"][0]
               ["relays_holding"] == 1, what="the relay holding the next slot")
    a.popen.send_signal(signal.SIGSTOP)
    try:
        poll_until(lambda: sim_stats(sim)["inflight"] == 0, what="x done at the engine")
        u, y = in_background(lambda: complete(b, "y", 60))  # 45 tokens, 2.25 s
        poll_until(lambda: sim_stats(sim)["inflight"] == 1, timeout=10, what="y through b")
        sim_reset(sim)
    finally:
        a.popen.send_signal(signal.SIGCONT)
    for th in (t, rt, u):
        th.join(30)
    assert x["r"].status == 200 and rr["r"].status == 200 and y["r"].status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    stop_all(cluster, a, b)


def test_a_graceful_stop_waits_for_what_runs_on_the_engine():
    """SIGTERM while a relay runs on the engine (llama.cpp-like: it generates on after its
    connection closes): the member stops only once the relay's answer is in, so the next
    member's request does not start beside it."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50", "--finish-abandoned")
    a, b = (single_sequence_member(cluster, [sim], "gw-%d" % i, ttl=2000) for i in range(2))
    wait_members([a, b], 2)
    t, x = in_background(lambda: relay(a, "x", 60))  # 42 tokens, 2.1 s
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the relay generating")
    a.popen.send_signal(signal.SIGTERM)
    a.wait_log(lambda l: l.get("msg") == "drained")
    r = complete(b, "y", 2)
    t.join(30)
    assert a.popen.wait(30) == 0
    assert r.status == 200 and x["r"].status == 200, (r.text, x)
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["aborted"] == 0, st
    stop_all(cluster, b)


class HoldATake(etcdutil.RequestRelay):
    """Holds an engine key's take, once armed, until `go` is set, then passes it on: the take
    is applied and answered as usual, only late."""

    def __init__(self, url):
        super().__init__(url)
        self.armed = False
        self.held = threading.Event()
        self.go = threading.Event()

    def step(self, c, u, head, body):
        if not self.armed or not is_engine_take(head, body):
            return True
        self.armed = False
        self.held.set()
        self.go.wait(10)
        return True


def two_engine_member(cluster, name, endpoints=None, sims=None):
    """Member `name` in front of two llama.cpp-like engines (`sims`, or two made here), pools p
    (MODEL) and p2 (m2), that reaches etcd through `endpoints`, checked at its start on both.
    The member and the sims."""
    sim, other = sims or (llamacpp_sim(), start_sim("--model", "m2", "--flavor", "llamacpp",
                                                    "--token-delay-ms", "20",
                                                    "--finish-abandoned"))
    px = start_proxy(pools=[pool("p", [MODEL], [sim], manifest=LLAMA),
                            pool("p2", ["m2"], [other], manifest=dict(LLAMA, model="m2"))],
                     limits=LONG_ANSWERS, fleet=fleet_cfg(cluster, name, ttl=3000,
                                                          endpoints=endpoints))
    poll_until(lambda: checks(px, result="idle") >= 2, what="the checks at the member's start")
    return px, sim, other


def relay_running(px, other):
    """An admin relay through px on the second engine, generating (about 3 s, longer on slow
    builds): its thread and result."""
    t, x = in_background(lambda: http(
        "POST", px.admin_port, "/admin/relay/v1/completions",
        body=json.dumps({"model": "m2", "prompt": "x", "max_tokens": int(150 * SLOW),
                         "temperature": 1, "seed": 1}),
        headers={"content-type": "application/json", "x-detproxy-relay-pool": "p2",
                 "x-detproxy-relay-replica": "r1"}, timeout=40 * SLOW))
    poll_until(lambda: sim_stats(other)["inflight"] == 1, what="the relay generating")
    return t, x


def asked_and_left(px, sent):
    """A client request for the first engine through px, which leaves (499) once `sent` (an
    Event set when px asked etcd for the engine's key) is set."""
    c = socket.create_connection(("127.0.0.1", px.port))
    body = json.dumps({"model": MODEL, "prompt": "y", "max_tokens": 2, "temperature": 0}).encode()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    assert sent.wait(10), "no take of the engine's key"
    c.close()  # the client leaves: nothing waits for the engine any more
    px.wait_log(lambda l: l.get("msg") == "access" and l.get("status") == 499)


def test_a_take_answered_once_a_stop_has_its_clients_answered_starts_no_check():
    """A member stopping gracefully waits for what it runs itself on one engine (a relay) after
    its clients are answered. A take of another engine it sent before then, with no clean mark
    there (the fleet's first take), is answered only now: the member starts no check there (it
    would only hold the exit up, as nothing of its own starts any more) and lets the key go on
    unmarked."""
    cluster = etcdutil.EtcdCluster(1)
    hold = HoldATake(cluster.endpoints()[0])
    a, sim, other = two_engine_member(cluster, "gw-a", [hold.url()])
    t, x = relay_running(a, other)
    # The engine's key let go of, its clean mark gone as a holder that died would leave it.
    poll_until(lambda: not [e for e in fleet(a)["engines"] if e["held"] and "%d" % sim.port in
                            e["engine"]], what="the engine's key let go of")
    cluster.call("/v3/kv/deleterange", {"key": etcdutil.b64("/detproxy/t/idle/"),
                                        "range_end": etcdutil.b64("/detproxy/t/idle0")})
    assert not cluster.get_prefix("/detproxy/t/idle/")
    hold.armed = True
    asked_and_left(a, hold.held)
    before = (fleet_checks(a), len(a.find_logs("fleet_engine_checking")))  # the first takes'
    a.popen.send_signal(signal.SIGTERM)
    drained = a.wait_log(lambda l: l.get("msg") == "drained")
    assert drained["single_sequence_running"] == 1, drained  # the relay
    hold.go.set()
    a.wait_log("fleet_engine_unchecked_at_stop")
    assert a.wait(60 * SLOW) == 0
    t.join(30)
    assert x["r"].status == 200, x
    a.check_sanitizer()
    assert (fleet_checks(a), len(a.find_logs("fleet_engine_checking"))) == before, \
        a.find_logs("engine_start_check")
    assert sim_stats(sim)["requests"] == 0, sim_stats(sim)  # nothing ran on the engine taken
    cluster.stop()


class CountTakes(etcdutil.RequestRelay):
    """Passes every request on, and notes when each engine key's take came."""

    def __init__(self, url):
        super().__init__(url)
        self.takes = []
        self.sent = threading.Event()

    def step(self, c, u, head, body):
        if is_engine_take(head, body):
            with self.lock:
                self.takes.append(time.monotonic())
            self.sent.set()
        return True


def test_a_member_stopping_takes_no_key_its_clients_no_longer_want():
    """A request through a waits for the engine's key, which b holds, and leaves; a is stopped
    while it runs a relay on another engine. From its `drained` on, a sends no take of the
    engine's key, though it still wanted it: nothing of its own starts there any more (before,
    it tried every 100 ms, and took the key once b let go of it)."""
    cluster = etcdutil.EtcdCluster(1)
    count = CountTakes(cluster.endpoints()[0])
    a, sim, other = two_engine_member(cluster, "gw-a", [count.url()])
    b, _, _ = two_engine_member(cluster, "gw-b", sims=(sim, other))
    wait_members([a, b], 2)
    tb, xb = in_background(lambda: post_json(b.port, "/v1/completions",
                                             json.loads(sampled(int(75 * SLOW)))))  # 1.5 s
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="b's request generating")
    t, x = relay_running(a, other)
    count.sent.clear()
    asked_and_left(a, count.sent)
    a.popen.send_signal(signal.SIGTERM)
    a.wait_log(lambda l: l.get("msg") == "drained")
    drained = time.monotonic()
    tb.join(30 * SLOW)
    assert xb["r"].status == 200, xb
    assert a.wait(60 * SLOW) == 0
    t.join(30)
    assert x["r"].status == 200, x
    a.check_sanitizer()
    # A take sent just before `drained` may reach the relay a little after it; one sent after
    # comes a retry period (100 ms) or more later.
    late = [w - drained for w in count.takes if w > drained + 0.1]
    assert not late, "takes %s s after drained" % ["%.2f" % d for d in late]
    assert sim_stats(sim)["max_inflight_seen"] == 1
    stop_all(cluster, b)


def test_a_member_back_on_its_lease_after_a_long_etcd_outage_starts_at_once():
    """etcd is away for longer than the member's lease had left (etcd renews its leases when
    it comes back): the member renews the lease as it connects again, so it knows how long the
    lease surely lives and its first request starts at once, not a keep-alive later."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL)
    a = single_sequence_member(cluster, [sim], "gw-0", ttl=6000)
    wait_members([a], 1)
    assert complete(a, "x", 1).status == 200
    cluster.stop_member(0)
    t0 = time.monotonic()
    poll_until(lambda: not fleet(a)["connected"], timeout=10, what="a disconnected")
    time.sleep(max(0.0, 6.5 - (time.monotonic() - t0)))  # the outage outlasts the lease's 6 s
    cluster.start_member(0)
    cluster.wait_healthy()
    poll_until(lambda: fleet(a)["connected"], timeout=10, interval=0.01, what="a connected")
    assert fleet(a)["lease_left_ms"] > 2000, fleet(a)  # before, 0 until the next keep-alive
    t1 = time.monotonic()
    assert complete(a, "y", 1).status == 200
    # Before, it waited for the next keep-alive: lease_ttl_ms / 3 = 2 s. The request's own
    # etcd write (an fsync on a busy disk) is all the rest.
    assert time.monotonic() - t1 < 1.0 * SLOW, time.monotonic() - t1
    stop_all(cluster, a)


def stopped_while_the_other_waits(sim, a, b, tokens):
    """a stopped (SIGTERM) while a request of `tokens` tokens generates through it and one
    through b waits for the engine's key; a exits 0 once its request is answered. The threads
    and results of a's request and of b's."""
    tx, x = in_background(lambda: complete(a, "x", tokens))
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="a's request generating")
    ty, y = in_background(lambda: complete(b, "y", 2))
    poll_until(lambda: [e["wanted"] for e in fleet(b)["engines"]] == [True],
               what="b waiting for the key")
    a.popen.send_signal(signal.SIGTERM)
    assert a.wait(15) == 0
    a.check_sanitizer()
    return tx, x, ty, y


def test_a_clean_stop_revokes_the_lease_and_hands_the_engine_on_at_once():
    """A member stopped while it runs on the engine finishes that request, then revokes its
    lease: its engine key and member key go at once, so the other member's queued request runs
    then, not lease_ttl_ms (10 s here) after the last keep-alive."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50")
    a, b = (single_sequence_member(cluster, [sim], "gw-%d" % i, ttl=10000) for i in range(2))
    wait_members([a, b], 2)
    tx, x, ty, y = stopped_while_the_other_waits(sim, a, b, 20)  # 1 s
    gone = time.monotonic()
    a.wait_log("fleet_lease_revoked")
    assert not cluster.get_prefix("/detproxy/t/instances/gw-0"), "a's member key"
    ty.join(15)
    assert time.monotonic() - gone < 5, "b's request waited for a's lease to expire"
    tx.join(5)
    assert x["r"].status == 200 and y["r"].status == 200, (x["r"].text, y["r"].text)
    assert sim_stats(sim)["max_inflight_seen"] == 1
    poll_until(lambda: len(fleet(b)["members"]) == 1, timeout=3, what="b seeing a gone")
    stop_all(cluster, b)


def test_a_clean_stop_lets_go_of_a_key_it_holds_clean_marked():
    """A member stopped while it runs on a llama.cpp engine finishes that request, then lets go
    of the engine's key with the clean mark before it revokes its lease: the member that takes
    the key next starts at once, with no check (the revoke alone would have left the key
    unmarked, and cost that member a check)."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    a, b = (llamacpp_member(cluster, sim, "gw-%d" % i) for i in range(2))
    wait_members([a, b], 2)
    checked_at_start(a, b)
    assert complete(a, "w", 3).status == 200  # the fleet's first take: nobody marked it
    let_go(a)
    before = checks(b)
    tx, x, ty, y = stopped_while_the_other_waits(sim, a, b, 30)  # 0.6 s
    a.wait_log("fleet_lease_revoked")
    for t in (tx, ty):
        t.join(15)
    assert x["r"].status == 200 and y["r"].status == 200, (x["r"].text, y["r"].text)
    assert a.find_logs("fleet_engine_let_go_at_stop"), "the key went with the revoke"
    assert checks(b) == before, (checks(b), before)
    assert fleet_checks(b) == 0
    assert sim_stats(sim)["max_inflight_seen"] == 1
    stop_all(cluster, b)


def test_a_stop_with_etcd_unanswering_does_not_wait_for_it():
    """etcd stops answering (SIGSTOP) while a member runs a request on a llama.cpp engine whose
    key it holds clean. SIGTERM: once the request is answered the member sends its marked
    release and waits for it at most 0.5 s, then sends the revoke (the release still in flight
    ends with the client) and waits for it at most 1 s, then exits 0; a second SIGTERM or a
    SIGHUP meanwhile is ignored as during the drain; the keys go with the lease."""
    cluster = etcdutil.EtcdCluster(1)
    sim = llamacpp_sim()
    a = llamacpp_member(cluster, sim, "gw-0", ttl=10000)
    wait_members([a], 1)
    checked_at_start(a)
    assert complete(a, "w", 3).status == 200  # the fleet's first take: a check, then clean
    let_go(a)
    t, x = in_background(lambda: complete(a, "x", 20))  # 0.4 s
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="a's request generating")
    cluster.procs[0].send_signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        a.popen.send_signal(signal.SIGTERM)
        a.wait_log("drained")
        a.popen.send_signal(signal.SIGTERM)
        a.popen.send_signal(signal.SIGHUP)
        assert a.wait(15) == 0
        a.check_sanitizer()
        assert time.monotonic() - t0 < 4 * SLOW, time.monotonic() - t0
        t.join(5)
        assert x["r"].status == 200, x["r"].text
        assert a.find_logs("fleet_engine_let_go_at_stop"), "no marked release at the stop"
        line = a.wait_log("fleet_lease_revoke_unconfirmed")
        assert "canceled" in line["error"], line
    finally:
        cluster.procs[0].send_signal(signal.SIGCONT)
    cluster.stop()


def test_a_stop_revokes_through_another_endpoint_when_its_own_stops_answering():
    """The etcd member a member's calls go to stops answering just before it stops: the revoke
    goes to every endpoint at once, so another member of the etcd cluster revokes it."""
    cluster = etcdutil.EtcdCluster(3)
    cluster.wait_healthy()
    # a calls a follower first: stopping it leaves the cluster its leader, so the others can
    # answer at once (a stopped leader would need an election first).
    i = next(k for k in range(3) if k != cluster.leader())
    eps = cluster.endpoints()
    sim = start_sim("--model", MODEL)
    a = single_sequence_member(cluster, [sim], "gw-0", ttl=10000,
                               endpoints=[eps[i]] + eps[:i] + eps[i + 1:])
    wait_members([a], 1)
    assert fleet(a)["endpoint"] == eps[i].split("//")[1], fleet(a)
    cluster.procs[i].send_signal(signal.SIGSTOP)
    try:
        a.popen.send_signal(signal.SIGTERM)
        assert a.wait(15) == 0
        a.check_sanitizer()
        a.wait_log("fleet_lease_revoked")
    finally:
        cluster.procs[i].send_signal(signal.SIGCONT)
    cluster.wait_healthy()
    assert not cluster.get_prefix("/detproxy/t/instances/gw-0"), "a's member key"
    cluster.stop()


def test_a_member_relaying_without_pause_still_lets_the_other_member_take_its_turn():
    """Relays through a that each wait long enough to claim the next slot freed would pass the
    slot from one to the next for ever: once a has held the engine its second, the slot is
    freed instead, a lets go, and b's request runs."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "20")
    a = single_sequence_member(cluster, [sim], "gw-0")
    b = single_sequence_member(cluster, [sim], "gw-1", queue_timeout_ms=5000)
    wait_members([a, b], 2)
    stop = []

    def relays():
        while not stop:
            relay(a, "r", 20)  # 0.4 s each, three at a time: each waits past 200 ms
    ts = [threading.Thread(target=relays, daemon=True) for _ in range(3)]
    for t in ts:
        t.start()
    poll_until(lambda: get_json(a.admin_port, "/admin/replicas")["replicas"][0]
               ["relays_holding"] >= 1, what="a relay claiming the next slot")
    try:
        r = complete(b, "y", 3)
    finally:
        stop.append(1)
        for t in ts:
            t.join(30)
    assert r.status == 200, r.text
    assert sim_stats(sim)["max_inflight_seen"] == 1
    stop_all(cluster, a, b)


def test_a_relay_passed_a_slot_while_etcd_was_away_runs_once_it_is_back():
    """A relay through the holder claims the next slot; etcd goes away (nothing new may start)
    and the request running ends, passing its slot to the relay; etcd comes back on the same
    lease, with the key still the holder's: the relay runs then, and the key is let go of
    after it, rather than both waiting for the relay to give up."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50")
    a, b = (single_sequence_member(cluster, [sim], "gw-%d" % i) for i in range(2))
    wait_members([a, b], 2)
    t, x = in_background(lambda: complete(a, "x", 30))  # 1.5 s
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="x generating")
    rt, rr = in_background(lambda: relay(a, "r", 2))
    poll_until(lambda: get_json(a.admin_port, "/admin/replicas")["replicas"][0]
               ["relays_holding"] == 1, what="the relay claiming the next slot")
    cluster.stop_member(0)
    poll_until(lambda: not fleet(a)["connected"], timeout=10, what="a disconnected")
    t.join(20)
    assert x["r"].status == 200
    cluster.start_member(0)
    cluster.wait_healthy()
    rt.join(20)  # the relay's own wait for a slot is 30 s
    assert rr["r"].status == 200, rr
    poll_until(lambda: not engine_keys(cluster), what="a letting go of the engine")
    assert complete(b, "y", 2).status == 200
    assert sim_stats(sim)["max_inflight_seen"] == 1
    stop_all(cluster, a, b)


class EtcdPipe(etcdutil.RequestRelay):
    """In front of one etcd member, it loses the answer of the next take (a txn with a put)
    once `lose_take` is set: the txn reaches etcd, its answer is dropped and the connection
    closed, and on_take runs then."""

    def __init__(self, upstream_port):
        super().__init__("http://127.0.0.1:%d" % upstream_port)
        self.lose_take = False
        self.on_take = None

    def step(self, c, u, head, body):
        with self.lock:
            lose = self.lose_take and b"request_put" in body  # a take's body
            if lose:
                self.lose_take = False
        if not lose:
            return True
        self.muted.add(u)
        u.sendall(head + b"\r\n\r\n" + body)
        poll_until(lambda: engine_keys_of(self.up), what="the take written")
        if self.on_take:
            self.on_take()
        for x in (c, u):
            x.shutdown(socket.SHUT_RDWR)
        return False


def engine_keys_of(port):
    """The engine keys in the etcd at port (for EtcdPipe, which knows no cluster object)."""
    import base64
    import urllib.request
    b64 = base64.b64encode
    body = json.dumps({"key": b64(b"/detproxy/t/engines/").decode(),
                       "range_end": b64(b"/detproxy/t/engines0").decode()}).encode()
    with urllib.request.urlopen("http://127.0.0.1:%d/v3/kv/range" % port, body, timeout=3) as r:
        return json.loads(r.read()).get("kvs", [])


def test_a_take_whose_answer_was_lost_is_let_go_when_its_pool_goes():
    """A take reaches etcd but its answer is lost, the request waiting for it gives up, and a
    reload removes the pool before the take is tried again: the member still lets go of the
    key, which is on its lease, so the other member can run on the engine."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL, "--token-delay-ms", "20")
    sim2 = start_sim("--model", "m2")
    pipe = EtcdPipe(int(cluster.endpoints()[0].rsplit(":", 1)[1]))
    a = single_sequence_member(cluster, [sim], "gw-0", endpoints=[pipe.url()],
                               queue_timeout_ms=40)
    b = single_sequence_member(cluster, [sim], "gw-1", queue_timeout_ms=3000)
    wait_members([a, b], 2)
    pipe.on_take = lambda: reload_pools(a, [pool("q", ["m2"], [sim2])])
    poll_until(lambda: not engine_keys(cluster), what="the engine free (the checks done)")
    pipe.lose_take = True
    # 504 after 40 ms waiting for the take, or 200 when the etcd client's retry of the call on
    # a new connection found the key on a's lease (it is a's then).
    r = complete(a, "w", 2)
    assert r.status in (200, 504), r.text
    poll_until(lambda: not engine_keys(cluster), what="a letting go of the key")
    r = complete(b, "y", 2)
    assert r.status == 200, r.text
    stop_all(cluster, a, b)


class HoldingPipe(etcdutil.RequestRelay):
    """In front of one etcd member, it can hold two requests: once armed, the next lease
    keep-alive is kept back, and so is the next release of an engine key (a txn with a delete).
    When the release arrives, the held keep-alive's lease is revoked in etcd and the keep-alive
    passed on, so the member finds its lease gone while its release is in flight; the release is
    passed on when `release` is set."""

    def __init__(self, cluster):
        super().__init__(cluster.endpoints()[0])
        self.cluster = cluster
        self.armed = False
        self.keepalive = None  # (upstream socket, request bytes, lease ID) while held
        self.held_release = threading.Event()
        self.release = threading.Event()

    def step(self, c, u, head, body):
        with self.lock:
            if not self.armed:
                return True
            if self.keepalive is None and head.startswith(b"POST /v3/lease/keepalive "):
                self.keepalive = (u, head + b"\r\n\r\n" + body, json.loads(body)["ID"])
                return False
            if not (self.keepalive and head.startswith(b"POST /v3/kv/txn ") and
                    b'"target":"LEASE"' in body):  # a release (a take deletes the clean mark)
                return True
            self.armed = False
            ku, kreq, lease = self.keepalive
        self.cluster.call("/v3/lease/revoke", {"ID": lease})
        ku.sendall(kreq)
        self.held_release.set()
        self.release.wait(10)
        return True


def test_a_lease_lost_while_the_key_is_let_go_of_counts_it_given_once():
    """The member lets go of the engine's key while its lease is revoked: the keep-alive that
    finds the lease gone counts the key given, and the release's answer, which comes after it,
    does not count it again (taken and given stay equal once the engine is let go of)."""
    cluster = etcdutil.EtcdCluster(1)
    sim = start_sim("--model", MODEL)
    pipe = HoldingPipe(cluster)
    a = single_sequence_member(cluster, [sim], "gw-0", ttl=10000, endpoints=[pipe.url()])
    wait_members([a], 1)
    pipe.armed = True
    poll_until(lambda: pipe.keepalive is not None, timeout=10, what="a keep-alive held")
    assert complete(a, "x", 1).status == 200
    poll_until(pipe.held_release.is_set, what="the release held, the lease revoked")
    poll_until(lambda: not fleet(a)["engines"][0]["held"], what="the key lost with the lease")
    eng = fleet(a)["engines"][0]
    assert (eng["taken"], eng["given"]) == (1, 1), eng
    pipe.release.set()
    # The release's answer has come once the next take is made (the key is busy until then).
    poll_until(lambda: fleet(a)["connected"], what="a connected on its new lease")
    assert complete(a, "y", 1).status == 200
    poll_until(lambda: not engine_keys(cluster) and not fleet(a)["engines"][0]["held"],
               what="the key let go of again")
    eng = fleet(a)["engines"][0]
    assert (eng["taken"], eng["given"]) == (2, 2), eng
    assert sim_stats(sim)["max_inflight_seen"] == 1
    stop_all(cluster, a)


if __name__ == "__main__":
    run_tests(globals())
