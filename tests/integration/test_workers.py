"""`workers`: several data-plane threads (docs/configuration.md, "Top level"). Requests spread over the workers, admission
stays exact across them (max_inflight_per_replica 1 never lets a replica see two requests),
and reload, drain and replica state changes reach every worker."""

import json
import os
import signal
import threading

from harness import *
from proxyutil import *


def complete(px, i=0, max_tokens=4):
    return post_json(px.port, "/v1/completions",
                     {"model": "m1", "prompt": "w%d" % i, "max_tokens": max_tokens,
                      "temperature": 0})


def worker_counts(px, n):
    return [metric(px, "detproxy_worker_requests_total", worker=str(w)) for w in range(n)]


def load(px, n, clients, results, i0=0):
    """n requests from `clients` threads, each request on its own connection (so SO_REUSEPORT
    spreads them); statuses go to results."""
    lock = threading.Lock()

    def one(i):
        r = complete(px, i0 + i)
        with lock:
            results.append(r.status)
    in_parallel(n, one, workers=clients)


def test_requests_land_on_several_workers():
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], workers=2)
    assert px.find_logs("listening")[0]["workers"] == 2
    results = []
    load(px, 60, 6, results)
    assert results == [200] * 60, results
    counts = worker_counts(px, 2)
    assert sum(counts) == 60 and all(c > 0 for c in counts), counts
    # The per-thread cells of one series add up at scrape time, and a request is counted before
    # its response's last byte leaves: a scrape after the answers sees every one.
    assert metric(px, "detproxy_requests_total", pool="p", status="200") == 60
    px.stop()


def test_workers_zero_means_one_per_cpu_in_the_affinity_mask():
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], workers=0)
    want = min(len(os.sched_getaffinity(0)), 64)
    assert px.find_logs("listening")[0]["workers"] == want
    assert get_json(px.admin_port, "/admin/config")["workers"] == 0
    px.stop()


def test_the_thread_pool_has_two_threads_per_worker_unless_sized():
    """Offloaded work takes at most half the libuv thread pool, each worker at least one job:
    the pool gets two threads per worker (four at least) when UV_THREADPOOL_SIZE is not set,
    so those jobs leave audit writes, DNS and shadow comparisons their half."""
    os.environ.pop("UV_THREADPOOL_SIZE", None)
    sim = start_sim("--model", "m1")
    big = {"model": "m1", "prompt": "x" * (600 * 1024), "max_tokens": 1}  # policed on the pool
    threads = {}
    for name, env in (("auto", None), ("four", {"UV_THREADPOOL_SIZE": "4"})):
        px = start_proxy(pools=[pool("p", ["m1"], [sim])], workers=3, env=env)
        assert post_json(px.port, "/v1/completions", big).status == 200
        assert metric(px, "detproxy_policy_offloaded_total") == 1
        threads[name] = rss_kb(px, "Threads")  # the pool's threads start with its first job
        px.stop()
    assert threads["auto"] - threads["four"] == 2, threads


def test_max_inflight_one_is_exact_across_workers():
    # 40 clients at once on 2 workers, one replica with one slot: every request is answered,
    # and the replica never has two at a time (docs/requests.md §2, admission control).
    sim = start_sim("--model", "m1", "--token-delay-ms", "2")
    px = start_proxy(pools=[pool("p", ["m1"], [sim], max_inflight_per_replica=1,
                                 queue_limit=1000, queue_timeout_ms=60000)], workers=2)
    results = []
    load(px, 200, 40, results)
    assert results == [200] * 200, sorted(set(results))
    st = sim_stats(sim)
    assert st["requests"] == 200, st
    assert st["max_inflight_seen"] == 1, st
    counts = worker_counts(px, 2)
    assert all(c > 0 for c in counts), counts  # both workers admitted requests to it
    px.stop()


def test_reload_under_load_on_every_worker():
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], workers=2)
    results, stop = [], threading.Event()

    def run():
        i = 0
        while not stop.is_set():
            results.append(complete(px, i).status)
            i += 1
    ts = [threading.Thread(target=run) for _ in range(4)]
    for t in ts:
        t.start()
    cfg = json.load(open(px.config_path))
    for k in range(5):
        cfg["limits"] = {"max_headers": 90 + k}
        write_config(cfg, os.path.dirname(px.config_path))
        assert http("POST", px.admin_port, "/admin/reload").status == 200
    stop.set()
    for t in ts:
        t.join()
    assert results and set(results) == {200}, sorted(set(results))
    poll_until(lambda: len(px.find_logs("reloaded")) >= 5, what="five reloads logged")
    assert len(px.find_logs("reloaded")) == 5
    # The last limits reached every worker: 95 headers (and http()'s few) pass the default 100
    # but not 94, on whichever worker the connection lands.
    hdrs = {"x-h%d" % i: "v" for i in range(95)}
    for _ in range(8):
        r = http("POST", px.port, "/v1/completions", headers=hdrs,
                 body=json.dumps({"model": "m1", "prompt": "x"}))
        assert r.status == 431, r
    px.stop()


def test_a_workers_change_needs_a_restart_and_says_so():
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], workers=2)
    cfg = json.load(open(px.config_path))
    cfg["workers"] = 1
    write_config(cfg, os.path.dirname(px.config_path))
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    px.wait_log(lambda l: l.get("msg") == "reload_workers_unchanged")
    results = []
    load(px, 20, 4, results)
    assert all(c > 0 for c in worker_counts(px, 2))  # still two
    px.stop()


def test_sigterm_drains_every_worker():
    # Each request takes 4 tokens x 150 ms: all 12 are still in flight when SIGTERM comes.
    sim = start_sim("--model", "m1", "--token-delay-ms", "150")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], workers=2)
    results = []
    t = threading.Thread(target=load, args=(px, 12, 12, results, 0, ))
    t.start()
    # All 12 read (a connection not yet read would be refused or closed as idle by the drain).
    poll_until(lambda: metric(px, "detproxy_inflight_requests") >= 12, what="requests in flight")
    counts = worker_counts(px, 2)
    px.send_signal(signal.SIGTERM)
    t.join()
    assert results == [200] * 12, results
    assert px.wait(20) == 0
    assert all(c > 0 for c in counts), counts  # both had requests in flight to finish
    assert len(px.find_logs("drained")) == 1


def test_a_drained_replica_gets_nothing_more_from_any_worker():
    sims = [start_sim("--model", "m1", "--token-delay-ms", "1") for _ in range(2)]
    px = start_proxy(pools=[pool("p", ["m1"], sims)], workers=2)
    wait_all_admitted(px)
    results, stop = [], threading.Event()

    def run(k):
        i = 0
        while not stop.is_set():
            results.append(complete(px, 1000 * k + i).status)
            i += 1
    ts = [threading.Thread(target=run, args=(k,)) for k in range(6)]
    for t in ts:
        t.start()
    poll_until(lambda: sim_stats(sims[0])["requests"] > 20, what="r1 under load")
    assert http("POST", px.admin_port, "/admin/replicas/r1/drain").status == 200
    # Once drained is logged, a request already sent may still finish; nothing new leaves.
    px.wait_log(lambda l: l.get("msg") == "replica_drained")
    poll_until(lambda: sim_stats(sims[0])["inflight"] == 0, what="r1 idle")
    before = sim_stats(sims[0])["requests"]
    other = sim_stats(sims[1])["requests"]
    poll_until(lambda: sim_stats(sims[1])["requests"] > other + 100, what="load on r2")
    stop.set()
    for t in ts:
        t.join()
    assert sim_stats(sims[0])["requests"] == before
    assert set(results) == {200}, sorted(set(results))
    assert all(c > 0 for c in worker_counts(px, 2))
    px.stop()


def test_workers_out_of_range_is_a_config_error():
    for bad, msg in ((65, "must be between 0 and 64"), ("2", "expected an integer")):
        path = write_config({"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
                             "workers": bad,
                             "pools": [{"name": "p", "models": ["m1"], "replicas": [
                                 {"name": "r1", "url": "http://127.0.0.1:1"}]}]})
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
        assert rc != 0 and "workers: " + msg in out + err, (out, err)
        rc, out, err = run_cmd([DETPROXY_BIN, "run", "-c", path], timeout=10)
        assert rc != 0 and "workers: " + msg in out + err, (out, err)


if __name__ == "__main__":
    run_tests(globals())
