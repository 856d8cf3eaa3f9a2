"""`workers` under attack: admission across workers with keep-alive clients (a connection stays
on the worker that accepted it), queued requests while a reload swaps the generation, and the
fairness of one replica slot shared by several workers."""

import json
import os
import socket
import tempfile
import threading
import time
from http.client import HTTPConnection

from harness import *
from proxyutil import *

WORKERS = {} if os.environ.get("ATTACK_NO_WORKERS") else {"workers": 2}


def worker_counts(px):
    return [metric(px, "detproxy_worker_requests_total", worker=str(w)) for w in range(2)]


def connections_on_each_worker(px, per_worker, timeout=60):
    """Keep-alive connections, `per_worker` on each of the two workers. The kernel spreads
    connections over the workers' listeners by a hash of the client's address and port, so a
    handful may all land on one worker; each connection here answers one `GET /v1/models`
    first, and the worker whose request counter moved is the one that holds it. Connections
    beyond a worker's share are closed."""
    held, spare, before = {0: [], 1: []}, [], worker_counts(px)
    for _ in range(40 * per_worker):
        if all(len(v) == per_worker for v in held.values()):
            break
        c = HTTPConnection("127.0.0.1", px.port, timeout=timeout)
        c.request("GET", "/v1/models")
        r = c.getresponse()
        r.read()
        assert r.status == 200, r.status
        after = worker_counts(px)
        moved = [w for w in range(2) if after[w] > before[w]]
        assert len(moved) == 1, (before, after)
        before = after
        (held[moved[0]] if len(held[moved[0]]) < per_worker else spare).append(c)
    for c in spare:
        c.close()
    assert all(len(v) == per_worker for v in held.values()), \
        "the kernel put %d and %d connections on the two workers" % (len(held[0]), len(held[1]))
    return held[0] + held[1]


def keepalive_clients(conns, per_client, max_tokens=4):
    """One thread per connection in `conns`, each sending `per_client` completions one after
    another on it. Returns the statuses and the codes of the failures."""
    statuses, codes, lock = [], [], threading.Lock()

    def run(k, c):
        for i in range(per_client):
            body = json.dumps({"model": "m1", "prompt": "ka%d-%d" % (k, i),
                               "max_tokens": max_tokens, "temperature": 0})
            c.request("POST", "/v1/completions", body=body,
                      headers={"content-type": "application/json"})
            r = c.getresponse()
            data = r.read()
            with lock:
                statuses.append(r.status)
                if r.status != 200:
                    try:
                        codes.append(json.loads(data)["error"]["code"])
                    except Exception:
                        codes.append(data[:80])
        c.close()
    ts = [threading.Thread(target=run, args=(k, c)) for k, c in enumerate(conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return statuses, codes


def test_one_slot_is_shared_fairly_by_keepalive_clients_on_two_workers():
    # One replica with one slot, 12 keep-alive clients, 6 on each of 2 workers, each request
    # ~30 ms. The worker that holds the slot must not keep handing it to its own queue while
    # the other worker's queued requests wait until queue_timeout (504): the whole run takes
    # ~12*12*30 ms = 4.3 s of replica time, more than the 2.5 s queue timeout, so a worker
    # whose queue is never served fails requests.
    sim = start_sim("--model", "m1", "--token-delay-ms", "7")
    px = start_proxy(pools=[pool("p", ["m1"], [sim], max_inflight_per_replica=1,
                                 queue_limit=1000, queue_timeout_ms=2500)], **WORKERS)
    if WORKERS:
        conns = connections_on_each_worker(px, 6)
    else:
        conns = [HTTPConnection("127.0.0.1", px.port, timeout=60) for _ in range(12)]
    statuses, codes = keepalive_clients(conns, 12)
    counts = worker_counts(px)
    st = sim_stats(sim)
    px.stop()
    assert st["max_inflight_seen"] == 1, st
    assert statuses == [200] * len(statuses), (sorted(set(statuses)), codes[:5], counts)


def test_requests_queued_across_a_reload_are_not_stranded():
    # N = 1. A long request holds the slot; requests queue behind it; a reload publishes a new
    # generation; more requests arrive (and queue in the new generation's pool). When the
    # long request ends, every queued request, old generation or new, must go on at once, not
    # wait for queue_timeout.
    sim = start_sim("--model", "m1", "--token-delay-ms", "100")
    px = start_proxy(pools=[pool("p", ["m1"], [sim], max_inflight_per_replica=1,
                                 queue_limit=100, queue_timeout_ms=8000)],
                     **WORKERS)
    out, lock = [], threading.Lock()

    def one(i, max_tokens):
        t0 = time.monotonic()
        r = post_json(px.port, "/v1/completions",
                      {"model": "m1", "prompt": "g%d" % i, "max_tokens": max_tokens,
                       "temperature": 0}, timeout=30)
        with lock:
            out.append((i, r.status, time.monotonic() - t0))
    # 2 s (greedy, g0 runs to 39 tokens): the queueing, the reload and more queueing all
    # happen while it holds the slot.
    long_t = threading.Thread(target=one, args=(0, 20))
    long_t.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the long request in flight")
    old = [threading.Thread(target=one, args=(i, 1)) for i in range(1, 3)]
    for t in old:
        t.start()
    poll_until(lambda: metric(px, "detproxy_inflight_requests") >= 3, what="2 queued")
    cfg = json.load(open(px.config_path))
    cfg["limits"] = {"max_headers": 99}
    write_config(cfg, os.path.dirname(px.config_path))
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    new = [threading.Thread(target=one, args=(i, 1)) for i in range(3, 7)]
    for t in new:
        t.start()
    poll_until(lambda: metric(px, "detproxy_inflight_requests") >= 7, what="6 queued")
    for t in [long_t] + old + new:
        t.join()
    st = sim_stats(sim)
    px.stop()
    assert sorted(s for _, s, _ in out) == [200] * 7, out
    # 2 s for the long one, then 6 x ~0.1 s one after another: far below the 8 s timeout.
    slow = [(i, round(d, 2)) for i, _, d in out if d > 5]
    assert slow == [], (slow, out)
    assert st["max_inflight_seen"] == 1, st


def test_a_tenant_rate_limit_is_one_bucket_across_workers():
    # burst 3, refilling every 20 s: of 24 requests spread over 2 workers (one connection
    # each), exactly 3 pass, not 3 per worker.
    sim = start_sim("--model", "m1")
    policy = {"tenants": [{"name": "lim", "match": {"any": True},
                           "rate_limit": {"requests_per_second": 0.05, "burst": 3}}]}
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=policy, **WORKERS)
    out, lock = [], threading.Lock()

    def one(i):
        r = post_json(px.port, "/v1/completions",
                      {"model": "m1", "prompt": "rl%d" % i, "max_tokens": 1})
        with lock:
            out.append(r.status)
    in_parallel(24, one, workers=8)
    counts = worker_counts(px)
    px.stop()
    assert not WORKERS or all(c > 0 for c in counts), counts
    assert sorted(out) == [200] * 3 + [429] * 21, sorted(out)


def test_clients_that_leave_while_queued_free_nothing_twice():
    # N = 1: a long request holds the slot; 10 more queue (on both workers) and their clients
    # hang up. The slot comes back once; later requests are served at once, one at a time.
    sim = start_sim("--model", "m1", "--token-delay-ms", "60")
    px = start_proxy(pools=[pool("p", ["m1"], [sim], max_inflight_per_replica=1,
                                 queue_limit=100, queue_timeout_ms=10000)], **WORKERS)
    # 1.8 s (greedy, "hold" runs to 50 tokens): ten clients connect, queue and hang up in it.
    long_t = threading.Thread(target=lambda: post_json(
        px.port, "/v1/completions", {"model": "m1", "prompt": "hold", "max_tokens": 30,
                                     "temperature": 0}))
    long_t.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the long request in flight")
    body = json.dumps({"model": "m1", "prompt": "gone", "max_tokens": 1}).encode()
    socks = []
    for i in range(10):
        s = socket.create_connection(("127.0.0.1", px.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                  b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        socks.append(s)
    poll_until(lambda: metric(px, "detproxy_inflight_requests") >= 11, what="10 queued")
    for s in socks:
        s.close()
    poll_until(lambda: metric(px, "detproxy_inflight_requests") <= 1, what="the queued gone")
    long_t.join()
    out = []
    t0 = time.monotonic()
    in_parallel(8, lambda i: out.append(post_json(
        px.port, "/v1/completions", {"model": "m1", "prompt": "after%d" % i,
                                     "max_tokens": 1}).status), workers=8)
    took = time.monotonic() - t0
    st = sim_stats(sim)
    px.stop()
    assert out == [200] * 8, out
    assert took < 5, took
    assert st["max_inflight_seen"] == 1, st
    assert st["requests"] == 9, st  # the hung-up ones never reached the replica


def test_an_audited_response_ends_after_its_line_on_every_worker():
    # Audited tenant, 40 requests from 8 threads over 2 workers: when a client has its whole
    # response, the audit line with its request id is already in the file.
    sim = start_sim("--model", "m1")
    d = tempfile.mkdtemp(prefix="detproxy-wattack-")
    audit = os.path.join(d, "audit.jsonl")
    policy = {"tenants": [{"name": "a", "match": {"any": True}, "audit": True}]}
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=policy,
                     log={"level": "info", "audit_path": audit}, directory=d, **WORKERS)
    missing, lock = [], threading.Lock()

    def one(i):
        r = post_json(px.port, "/v1/completions",
                      {"model": "m1", "prompt": "au%d" % i, "max_tokens": 2})
        rid = r.headers.get("x-detproxy-request-id")
        with open(audit) as f:
            ids = set(json.loads(l).get("request_id") for l in f if l.strip())
        with lock:
            if r.status != 200 or rid not in ids:
                missing.append((i, r.status, rid))
    in_parallel(40, one, workers=8)
    counts = worker_counts(px)
    px.stop()
    assert not WORKERS or all(c > 0 for c in counts), counts
    assert missing == [], missing




def test_a_swapped_replica_gets_no_request_after_its_first_mismatching_response():
    # Two pinned llama.cpp replicas with one slot each, a queue in front, load from 8 threads
    # on both workers. r1 is swapped for another build: the worker that sees the first
    # mismatching response must stop sending to r1 at once (single-threaded detproxy took it
    # out of service in the same call); waiting for the control thread lets the next queued
    # request go to the swapped engine.
    fp = "b11669-Debian"
    sims = [start_sim("--flavor", "llamacpp", "--model", "tiny", "--framework-version", fp,
                      "--quantization", "F16", "--token-delay-ms", "3") for _ in range(2)]
    p = pool("p", ["tiny"], sims, manifest={"model": "tiny", "engine_fingerprint": fp},
             balance="round_robin", max_inflight_per_replica=1, queue_limit=1000,
             queue_timeout_ms=20000)
    for r in p["replicas"]:
        r["attest"] = {"source": "llamacpp"}
    px = start_proxy(pools=[p], attestation={"interval_ms": 60000, "timeout_ms": 2000},
                     **WORKERS)
    poll_until(lambda: all(r["state"] == "admitted" for r in
                           get_json(px.admin_port, "/admin/replicas")["replicas"]),
               what="both admitted")
    stop = threading.Event()

    def run(k):
        i = 0
        while not stop.is_set():
            post_json(px.port, "/v1/completions", {"model": "tiny", "prompt": "s%d-%d" % (k, i),
                                                   "max_tokens": 2, "temperature": 0})
            i += 1
    ts = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in ts:
        t.start()
    poll_until(lambda: sim_stats(sims[0])["requests"] > 30, what="r1 under load")
    sim_config(sims[0], framework_version="b12000-Debian")
    poll_until(lambda: metric(px, "detproxy_fingerprint_mismatch_total", replica="r1") >= 1,
               what="the first mismatch")
    after = sim_stats(sims[1])["requests"]
    poll_until(lambda: sim_stats(sims[1])["requests"] > after + 100, timeout=20,
               what="load goes on on r2")
    stop.set()
    for t in ts:
        t.join()
    n = metric(px, "detproxy_fingerprint_mismatch_total", replica="r1")
    px.stop()
    # r1 had one slot: the one request in flight at the swap is the only mismatching answer.
    assert n == 1, n


def test_idle_connections_closed_while_a_reload_frees_their_replica_are_safe():
    """A reload that redefines a replica frees the old one on the control thread while each
    worker still has a pooled connection to it; the engine closing those connections then
    (its keep-alive timeout) is seen on the workers. Rounds of both at once, on two workers:
    no worker may read the freed replica (ASan's build would stop the process), and the pool
    serves on."""
    sim = start_sim("--model", "m1")
    front = FrontCutter(sim.port)
    spell = ["http://127.0.0.1:%d" % front.port, "http://localhost:%d" % front.port]
    px = start_proxy(pools=[pool("p", ["m1"], [front])], **WORKERS)
    cfg = json.load(open(px.config_path))
    def served(k, i):
        try:
            return post_json(px.port, "/v1/completions",
                             {"model": "m1", "prompt": "r%d-%d" % (k, i), "max_tokens": 1}
                             ).status == 200
        except OSError:  # the process is gone: say what it said last (the sanitizer's report)
            px.popen.wait(10)
            raise AssertionError("round %d: detproxy exited\n%s" % (k, "\n".join(px.lines[-40:])))
    for k in range(150):
        # Several connections: some on each worker, each leaving a pooled one to the replica.
        # (The redefined replica is attested first: 503 until then.)
        for i in range(6):
            poll_until(lambda: served(k, i), what="round %d served" % k)
        cfg["pools"][0]["replicas"][0]["url"] = spell[k % 2]
        write_config(cfg, os.path.dirname(px.config_path))
        cut = threading.Thread(target=lambda: [front.cut(n) for n in list(front.answered)])
        cut.start()
        assert http("POST", px.admin_port, "/admin/reload").status == 200
        cut.join()
    poll_until(lambda: post_json(px.port, "/v1/completions",
                                 {"model": "m1", "prompt": "after", "max_tokens": 1}).status == 200,
               what="the pool serving after the rounds")
    px.stop()
    front.stop()

if __name__ == "__main__":
    run_tests(globals())
