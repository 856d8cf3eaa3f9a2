"""Memory bounds against hostile clients and replicas (docs/configuration.md, "limits";
docs/security.md §7).

- limits.max_inflight_body_bytes: request bodies buffered across all connections. Clients that
  stall with large bodies once took the proxy to max_connections x max_body_bytes; now a new
  inference request over the budget is 503 `overloaded`, admitted ones finish.
- limits.client_body_timeout_ms: the whole body read, so a trickle cannot hold its share.
- limits.max_response_rewrite_bytes: what is held of one non-streamed response for the
  fingerprint rewrite; a bigger answer is passed through as it arrives."""

import json
import os
import resource
import selectors
import signal
import socket
import threading
import time

from harness import (SANITIZE, SLOW, TSAN, connect_from, get_json, http, poll_until, run_tests,
                     start_sim)
from proxyutil import (assert_openai_error, metric, parse_response, pool, read_request,
                       read_response, read_until_close, rss_kb, serve_connections, start_proxy)

MODEL = "m1"
MiB = 1 << 20


def body_of(n):
    """A completion request of exactly n bytes."""
    head = '{"model":"%s","max_tokens":1,"prompt":"' % MODEL
    return (head + "x" * (n - len(head) - 2) + '"}').encode()


def stalled(port, body, keep, chunked=False):
    """Open a connection, send the head and all but `keep` bytes of the body, and stall.
    Returns (socket, the bytes that would complete the request)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10 * SLOW)
    if chunked:
        head = ("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                "transfer-encoding: chunked\r\n\r\n").encode()
        sent = body[:len(body) - keep]
        s.sendall(head + b"%x\r\n" % len(sent) + sent + b"\r\n")
        rest = b"%x\r\n" % (len(body) - len(sent)) + body[len(sent):] + b"\r\n0\r\n\r\n"
    else:
        head = ("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                "content-length: %d\r\n\r\n" % len(body)).encode()
        s.sendall(head + body[:len(body) - keep])
        rest = body[len(body) - keep:]
    return s, rest


class KeepArriving:
    """Send one more byte of each held body every 0.2 s until end(). A body that has sent
    nothing for a second is the slowest there is and may be shed for any newcomer; on a loaded
    machine the steps of a test can take that long. Stops short of any body's end."""

    def __init__(self, held):
        self.held = [list(h) for h in held]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop.wait(0.2):
            for h in self.held:
                if len(h[1]) > 1:
                    h[0].sendall(h[1][:1])
                    h[1] = h[1][1:]

    def end(self):
        """Stop; the held (socket, rest) pairs, rest now what is still unsent."""
        self.stop.set()
        self.thread.join()
        return [tuple(h) for h in self.held]


def inflight(px):
    return metric(px, "detproxy_inflight_requests")


def test_bodies_over_the_inflight_budget_are_503_and_admitted_ones_finish():
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"max_body_bytes": MiB, "max_inflight_body_bytes": 4 * MiB})
    body = body_of(MiB)
    held = [stalled(px.port, body, 4096) for _ in range(4)]
    arriving = KeepArriving(held)
    poll_until(lambda: inflight(px) == 4, what="four bodies admitted")
    # The budget is spent by bodies that are arriving (none has stalled for a second): a
    # fifth body (Content-Length or chunked) that arrives more slowly than they did may shed
    # none of them, and is refused at its first bytes.
    for chunked in (False, True):
        s = socket.create_connection(("127.0.0.1", px.port), timeout=10 * SLOW)
        s.sendall(("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                   "\r\n%s\r\n\r\n" % ("transfer-encoding: chunked" if chunked else
                                       "content-length: %d" % len(body))).encode())
        time.sleep(0.1)
        s.sendall(b"%x\r\n%s\r\n" % (64, body[:64]) if chunked else body[:64])
        data, closed = read_until_close(s, timeout=5)
        r = parse_response(data)
        err = assert_openai_error(r, 503, "overloaded")
        assert "max_inflight_body_bytes" in err["message"], err
        s.close()
    assert metric(px, "detproxy_overload_rejections_total", reason="body_budget") == 2
    held = arriving.end()
    # Requests without a body are untouched by the budget.
    assert get_json(px.port, "/v1/models")["object"] == "list"
    # The admitted ones finish normally.
    s, rest = held.pop()
    s.sendall(rest)
    r = read_response(s)
    assert r.status == 200 and r.complete, r
    s.close()
    # Its share is back: the next body is admitted and answered.
    r = http("POST", px.port, "/v1/completions", body=body,
             headers={"content-type": "application/json"})
    assert r.status == 200, r
    for s, _ in held:
        s.close()
    px.stop()


def test_a_trickled_body_is_cut_at_client_body_timeout_ms():
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"client_body_timeout_ms": 600, "client_idle_timeout_ms": 60000})
    body = body_of(4096)
    s, rest = stalled(px.port, body, 4000)
    stop = threading.Event()
    t0 = time.monotonic()

    def trickle():
        # One byte every 50 ms: never idle, so only the whole-body bound can stop it.
        for b in rest:
            if stop.wait(0.05):
                return
            try:
                s.send(bytes([b]))
            except OSError:
                return

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    data, closed = read_until_close(s, timeout=10)
    took = time.monotonic() - t0
    stop.set()
    err = assert_openai_error(parse_response(data), 408)
    assert "client_body_timeout_ms" in err["message"], err
    assert 0.5 <= took < 3 * SLOW, took
    s.close()
    px.stop()


class HugeReplica:
    """A replica answering every completion with one non-streamed JSON body of `size` bytes,
    generated as it is sent (Content-Length or chunked), so the test itself holds none of it.
    GET /v1/models (the proxy's reachability check) is answered 200."""

    MODELS = b'{"object":"list","data":[{"id":"m1","object":"model"}]}'

    def __init__(self):
        self.size = 0
        self.chunked = False
        self.dense = False  # the body an array of as many numbers as fit, not one long string
        self.number = b"0"  # what that array is made of
        self.fp = b"fp_replica"  # the answers' system_fingerprint
        self.build = None  # a str: GET /props answers as llama.cpp's server, this its build_info,
        # and a 1-token completion (the engine fingerprint probe) gets a short answer
        self.sent = threading.Event()  # set once a whole answer is written
        self.hold = None  # an Event: completions are answered once it is set
        self.hold_for = None  # or a function of a completion's body: the Event it waits for
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        serve_connections(self.lsock, self._serve)

    def body_pieces(self):
        head = b'{"id":"cmpl-1","object":"text_completion","system_fingerprint":"%s",' \
               b'"choices":[{"index":0,"text":"' % self.fp
        tail = b'"}]}'
        piece = b"a" * MiB
        if self.dense:
            each = self.number + b","
            head, tail = head[:-1] + b'[', self.number + b']}]}'
            piece = each * (MiB // len(each))
        yield head
        left = self.size - len(head) - len(tail)
        if self.dense and left % len(each):  # every number whole: spaces make up the length
            yield b" " * (left % len(each))
            left -= left % len(each)
        while left > 0:
            yield piece[:left]
            left -= min(left, len(piece))
        yield tail

    def _serve(self, c):
        buf = b""
        try:
            while True:
                got = read_request(c, buf)
                if got is None:
                    return
                head, body, buf = got
                if self.build and head.startswith(b"GET /props "):
                    got = json.dumps({"build_info": self.build, "model_ftype": "F16"}).encode()
                elif self.build and head.startswith(b"POST ") and \
                        json.loads(body).get("max_tokens") == 1:  # the engine fingerprint probe
                    got = b'{"id":"p","choices":[],"system_fingerprint":"%s"}' % self.fp
                elif head.startswith(b"GET /v1/models "):
                    got = self.MODELS
                else:
                    got = None
                if got is not None:
                    c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n" % len(got) + got)
                    continue
                hold = self.hold_for(body) if self.hold_for else self.hold
                if hold:
                    hold.wait(60)
                frame = b"transfer-encoding: chunked" if self.chunked else \
                    b"content-length: %d" % self.size
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + frame +
                          b"\r\n\r\n")
                for p in self.body_pieces():
                    c.sendall(b"%x\r\n%s\r\n" % (len(p), p) if self.chunked else p)
                if self.chunked:
                    c.sendall(b"0\r\n\r\n")
                self.sent.set()
        except OSError:
            return


def fetch_digest(port, body, timeout=120, headers=None):
    """POST body, read the whole response with a small buffer: (status, headers, size, sha256
    hex, first 200 bytes of the body)."""
    import hashlib
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout * SLOW)
    conn.request("POST", "/v1/completions", body=body,
                 headers=dict({"content-type": "application/json"}, **(headers or {})))
    r = conn.getresponse()
    h, n, first = hashlib.sha256(), 0, b""
    while True:
        piece = r.read(MiB)
        if not piece:
            break
        if len(first) < 200:
            first += piece[:200 - len(first)]
        h.update(piece)
        n += len(piece)
    conn.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, n, h.hexdigest(), first


def test_a_huge_replica_answer_is_passed_through_not_held():
    """A replica answering 256 MiB of JSON is not held whole (that took RSS to ~3x the body):
    beyond max_response_rewrite_bytes it streams through, audited over every byte."""
    import hashlib
    import os
    import tempfile
    up = HugeReplica()
    d = tempfile.mkdtemp(prefix="detproxy-huge-")
    audit = os.path.join(d, "audit.jsonl")
    px = start_proxy(pools=[{"name": "p", "models": [MODEL],
                             "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}],
                     limits={"max_response_rewrite_bytes": 4 * MiB},
                     policy={"tenants": [{"name": "t", "match": {"any": True}, "audit": True}]},
                     log={"level": "info", "audit_path": audit}, directory=d)
    req = body_of(200)
    # Below the bound: held and rewritten, as before.
    up.size = MiB
    st, hdrs, n, digest, first = fetch_digest(px.port, req)
    assert st == 200 and b'"system_fingerprint":"fp_' in first, first
    assert b"fp_replica" not in first and hdrs.get("x-detproxy-upstream-fingerprint") == \
        "fp_replica", (first, hdrs)
    base = rss_kb(px)
    for chunked in (False, True):
        up.chunked = chunked
        up.size = 256 * MiB
        st, hdrs, n, digest, first = fetch_digest(px.port, req)
        grew = rss_kb(px) - base
        print("    256 MiB answer (%s): proxy RSS grew %d kB" %
              ("chunked" if chunked else "content-length", grew))
        assert st == 200 and n == up.size, (st, n)
        assert b'"system_fingerprint":"fp_replica"' in first  # passed through unchanged
        assert hdrs["x-detproxy-fingerprint"].startswith("fp_"), hdrs
        assert grew < 48 * 1024, grew
        want = hashlib.sha256(b"".join(up.body_pieces())).hexdigest()
        assert digest == want
        lines = [json.loads(l) for l in open(audit)]
        assert lines[-1]["response_body_sha256"] == want, lines[-1]
    px.stop()


def test_a_dense_answer_is_rewritten_without_a_tape_of_it():
    """A non-streamed answer just under max_response_rewrite_bytes made of 4 million small
    numbers is rewritten (the pool's fingerprint in it) holding the body and its rewrite only:
    a tape of its values took 24 bytes each, 12 times the body."""
    up = HugeReplica()
    px = start_proxy(pools=[{"name": "p", "models": [MODEL],
                             "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}],
                     limits={"max_response_rewrite_bytes": 8 * MiB})
    req = body_of(200)
    up.size = MiB  # the first answer takes the proxy's buffers to their working size
    assert fetch_digest(px.port, req)[0] == 200
    up.dense = True
    up.size = 8 * MiB - 64
    before = rss_kb(px, "VmHWM")
    st, hdrs, n, digest, first = fetch_digest(px.port, req)
    grew = rss_kb(px, "VmHWM") - before
    print("    8 MiB of numbers: the proxy's peak RSS grew %d kB" % grew)
    fp = hdrs["x-detproxy-fingerprint"]
    assert st == 200 and n == up.size - len("fp_replica") + len(fp), (st, n)
    assert b'"system_fingerprint":"fp_' in first and b"fp_replica" not in first, first
    assert hdrs.get("x-detproxy-upstream-fingerprint") == "fp_replica", hdrs
    if not (SANITIZE or TSAN):  # their allocators keep freed memory aside
        assert grew < 5 * 8 * 1024, grew
    px.stop()


def test_a_long_answer_is_checked_off_the_loop_and_its_client_may_leave():
    """An answer longer than 64 KiB is checked and rewritten on the thread pool (8 MiB of
    numbers like 1e301 take ~100 ms of strtod), while the worker serves its other connections;
    a client that leaves meanwhile is counted 499 once the work is over, and the worker goes on."""
    up = HugeReplica()
    sim = start_sim("--model", "m2")
    px = start_proxy(pools=[{"name": "p", "models": [MODEL],
                             "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]},
                            pool("q", ["m2"], [sim])],
                     limits={"max_response_rewrite_bytes": 8 * MiB}, workers=1)
    offloaded = lambda: metric(px, "detproxy_response_offloaded_total")
    small = json.dumps({"model": "m2", "prompt": "x", "max_tokens": 1}).encode()
    up.size = 60 * 1024  # held and checked on the loop
    assert fetch_digest(px.port, body_of(200))[0] == 200
    assert offloaded() == 0
    up.dense, up.number, up.size = True, b"1e301", 8 * MiB - 64
    up.sent.clear()
    got = []
    t = threading.Thread(target=lambda: got.append(fetch_digest(px.port, body_of(200))))
    t.start()
    assert up.sent.wait(30 * SLOW)
    t0 = time.monotonic()
    r = http("POST", px.port, "/v1/completions", body=small,
             headers={"content-type": "application/json"})
    took = time.monotonic() - t0
    t.join()
    st, hdrs, n, digest, first = got[0]
    assert r.status == 200 and st == 200, (r, st)
    assert offloaded() == 1
    print("    a small request while 8 MiB of 1e301 numbers were checked: %.1f ms" % (took * 1e3))
    fp = hdrs["x-detproxy-fingerprint"]
    assert n == up.size - len("fp_replica") + len(fp) and b'"system_fingerprint":"%s"' % \
        fp.encode() in first, (n, first)
    # The client leaves once the answer's check has begun (the counter moves as it is queued):
    # the check goes on without it, and the request is counted 499, not 200.
    c = socket.create_connection(("127.0.0.1", px.port))
    req = body_of(200)
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(req), req))
    poll_until(lambda: offloaded() == 2, interval=0.002, what="the second answer's check")
    c.close()
    poll_until(lambda: metric(px, "detproxy_requests_total", pool="p", status="499") == 1,
               what="the request whose client left counted 499")
    assert http("POST", px.port, "/v1/completions", body=small,
                headers={"content-type": "application/json"}).status == 200
    px.stop()


def upstream(name, up):
    """A pool's replicas: one, up (a HugeReplica), named name."""
    return [{"name": name, "url": "http://127.0.0.1:%d" % up.port}]


def assert_took_turns(done, dense, other, n, started, what):
    """done: (name, status) in the order the clients had their answers; n of dense, then one
    of other, queued for the thread pool once `started` of dense had begun. The other owner's
    job waited only for those and for dense's turn (it was waiting first); in arrival order it
    would have waited for all n (one may still be on its way to its client)."""
    assert sorted(done) == sorted([(dense, 200)] * n + [(other, 200)]), done
    ahead = [name for name, _ in done].index(other)
    print("    %s before %s's: %d of %d (%d begun when it came)"
          % (what, other, ahead, n, started))
    assert started + 1 < n - 1, ("the %s outran the test: nothing to tell" % what, started)
    assert ahead <= started + 1, done


def test_a_replica_of_slow_answers_waits_behind_its_own_checks_not_in_front_of_others():
    """Checks that wait for the thread pool take turns by owner: with the pool full of one
    replica's dense answers (8 MiB of 1e301 each), another replica's long answer waits for the
    one being checked and the turn of the replica that was waiting first, not for all of
    them."""
    bad, good = HugeReplica(), HugeReplica()
    bad.dense, bad.number, bad.size = True, b"1e301", 8 * MiB - 64
    good.size = 256 * 1024
    px = start_proxy(pools=[{"name": "p", "models": [MODEL], "replicas": upstream("bad", bad)},
                            {"name": "q", "models": ["m2"], "replicas": upstream("good", good)}],
                     limits={"max_response_rewrite_bytes": 8 * MiB}, workers=1,
                     env={"UV_THREADPOOL_SIZE": "2"})  # one job at a time
    offloaded = lambda: metric(px, "detproxy_response_offloaded_total")
    waiting = lambda: metric(px, "detproxy_offload_waiting")
    done, lock = [], threading.Lock()

    def one(name, body):
        st = fetch_digest(px.port, body)[0]
        with lock:
            done.append((name, st))
    # The dense answers all come at once; the good replica answers once they wait for their
    # checks.
    bad.hold, good.hold = threading.Event(), threading.Event()
    g = threading.Thread(target=one, args=("good", body_of(200).replace(b'"m1"', b'"m2"')))
    g.start()
    n = 10
    ts = [threading.Thread(target=one, args=("bad", body_of(200))) for _ in range(n)]
    for t in ts:
        t.start()
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == n + 1, what="all sent")
    bad.hold.set()
    poll_until(lambda: offloaded() == n, what="every dense answer queued for its check")
    good.hold.set()
    poll_until(lambda: offloaded() == n + 1, what="the other answer queued for its check")
    started = n + 1 - waiting()  # checked or being checked, of the dense ones, once it queued
    for t in ts + [g]:
        t.join()
    assert waiting() == 0
    px.stop()
    assert_took_turns(done, "bad", "good", n, started, "dense answers checked")


def test_a_tenant_of_slow_answers_waits_behind_its_own_checks_not_in_front_of_another_on_its_replica():
    """Within a replica's turn its tenants take turns: with the pool full of one tenant's dense
    answers (8 MiB of 1e301 each), another tenant's answer from the same replica waits for the
    one being checked and the first tenant's turn, not for all of them."""
    import hashlib
    key = "sk-dense-answers"
    policy = {"tenants": [
        {"name": "dense", "match": {"api_keys_sha256": [hashlib.sha256(key.encode()).hexdigest()]}},
        {"name": "other", "match": {"any": True}}]}
    up = HugeReplica()
    up.dense, up.number, up.size = True, b"1e301", 8 * MiB - 64
    px = start_proxy(pools=[{"name": "p", "models": [MODEL], "replicas": upstream("r1", up)}],
                     policy=policy, limits={"max_response_rewrite_bytes": 8 * MiB}, workers=1,
                     env={"UV_THREADPOOL_SIZE": "2"})  # one job at a time
    offloaded = lambda: metric(px, "detproxy_response_offloaded_total")
    waiting = lambda: metric(px, "detproxy_offload_waiting")
    done, lock = [], threading.Lock()

    def one(name, body, headers):
        st = fetch_digest(px.port, body, headers=headers)[0]
        with lock:
            done.append((name, st))
    # The replica tells the tenants' requests apart by their prompts (it never sees the key).
    mine, theirs = threading.Event(), threading.Event()
    up.hold_for = lambda body: mine if b'"prompt":"d' in body else theirs
    g = threading.Thread(target=one, args=("other", body_of(200), {}))
    g.start()
    n = 10
    dense = body_of(200).replace(b'"prompt":"x', b'"prompt":"d')
    ts = [threading.Thread(target=one, args=("dense", dense, {"authorization": "Bearer " + key}))
          for _ in range(n)]
    for t in ts:
        t.start()
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == n + 1, what="all sent")
    mine.set()
    poll_until(lambda: offloaded() == n, what="every dense answer queued for its check")
    theirs.set()
    poll_until(lambda: offloaded() == n + 1, what="the other tenant's answer queued for its check")
    started = n + 1 - waiting()
    for t in ts + [g]:
        t.join()
    assert waiting() == 0
    px.stop()
    assert_took_turns(done, "dense", "other", n, started, "one tenant's dense answers checked")


def test_a_tenant_of_slow_bodies_waits_behind_its_own_policing_not_in_front_of_others():
    """Policing that waits for the thread pool takes turns by tenant: with the pool full of
    one tenant's dense bodies (4 MiB of 17-digit numbers, canonicalised for a derived seed),
    another tenant's long prompt waits for the one being policed and the first tenant's turn,
    not for all of them."""
    import hashlib
    key = "sk-dense-bodies"
    derive = {"seed": {"derive": True}}
    policy = {"tenants": [
        {"name": "dense", "match": {"api_keys_sha256": [hashlib.sha256(key.encode()).hexdigest()]},
         "sampling": derive},
        {"name": "other", "match": {"any": True}, "sampling": derive}]}
    up = HugeReplica()  # answers at once, a thread per connection
    up.size = 400
    px = start_proxy(pools=[{"name": "p", "models": [MODEL], "replicas": upstream("r1", up)}],
                     policy=policy, workers=1, env={"UV_THREADPOOL_SIZE": "2"})  # one job at a time
    offloaded = lambda: metric(px, "detproxy_policy_offloaded_total")
    waiting = lambda: metric(px, "detproxy_offload_waiting")
    done, lock = [], threading.Lock()
    # The other tenant's prompt (over 512 KiB: policed on the pool) waits one byte short.
    long_prompt = body_of(600 * 1024)
    s, rest = stalled(px.port, long_prompt, 1)

    def finish():
        s.sendall(rest)
        r = read_response(s)
        with lock:
            done.append(("other", r.status))
    numbers = b",".join([b"0.1234567890123456"] * (4 * MiB // 19))
    dense = b'{"model":"m1","prompt":"x","max_tokens":1,"x":[%s]}' % numbers
    dense_req = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n"
                 % (key.encode(), len(dense)) + dense)

    def one(c):
        c.sendall(dense_req[-1:])  # all of them complete at once
        r = read_response(c, timeout=60)
        with lock:
            done.append(("dense", r.status))
    n = 12
    conns = [socket.create_connection(("127.0.0.1", px.port)) for _ in range(n)]
    for c in conns:
        c.sendall(dense_req[:-1])
    ts = [threading.Thread(target=one, args=(c,)) for c in conns]
    for t in ts:
        t.start()
    poll_until(lambda: offloaded() == n, what="every dense body queued for its policing")
    g = threading.Thread(target=finish)
    g.start()
    poll_until(lambda: offloaded() == n + 1, what="the other body queued for its policing")
    started = n + 1 - waiting()  # policed or being policed, of the dense ones, once it queued
    for t in ts + [g]:
        t.join()
    for c in conns + [s]:
        c.close()
    assert waiting() == 0
    px.stop()
    assert_took_turns(done, "dense", "other", n, started, "dense bodies policed")


def test_a_stop_lets_a_slow_reader_take_the_whole_answer_it_was_sent():
    """An answer complete on detproxy's side but not yet taken by its client (8 MiB to a reader
    with a 16 KiB receive buffer: most of it still queued in detproxy) when SIGTERM comes: the
    drain sends the rest before it closes that connection, as it lets requests in flight
    finish; a request pipelined behind it is not read. Before, the connection was closed at
    once (alone) or once the queue fell to its low-water mark (with a request behind, which
    was then parsed), and the client got a clean end short of the answer."""
    import signal
    for pipelined in (False, True):
        up = HugeReplica()
        up.size = 8 * MiB - 64
        px = start_proxy(pools=[{"name": "p", "models": [MODEL], "replicas": upstream("r1", up)}],
                         limits={"max_response_rewrite_bytes": 8 * MiB}, workers=1)
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        c.connect(("127.0.0.1", px.port))
        c.settimeout(30 * SLOW)
        body = body_of(300)
        req = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))
        c.sendall(req * (2 if pipelined else 1))
        got = b""
        while b"\r\n\r\n" not in got:
            got += c.recv(4096)
        head, _, first = got.partition(b"\r\n\r\n")
        length = int([ln.split(b":")[1] for ln in head.split(b"\r\n")
                      if ln.lower().startswith(b"content-length:")][0])
        # The answer is all handed to the client's connection once its access line is written.
        px.wait_log(lambda r: r.get("msg") == "access" and r.get("status") == 200)
        px.send_signal(signal.SIGTERM)
        draining = px.wait_log("draining")
        assert draining["inflight"] == 0 and draining["connections"] == 1, draining
        got = len(first)
        while True:
            piece = c.recv(MiB)
            if not piece:
                break
            got += len(piece)
        c.close()
        assert got == length > up.size - 1024, (pipelined, got, length)  # its fingerprint set
        assert px.wait(30) == 0
        px.check_sanitizer()
        assert px.find_logs("drained"), px.lines[-10:]
        assert len([r for r in px.find_logs("access")]) == 1, pipelined


def test_a_client_gone_while_its_answer_is_checked_gets_a_line_of_what_it_got():
    """An audited client that leaves while its answer is checked on the thread pool: its line
    (499) hashes what it got, nothing, and stores none of the answer; the forwarded body it
    names is stored as it was sent, though the request's own buffer was let go with the client
    and reused by the next request of the same size (a 200 KiB body is policed where it lies)."""
    import hashlib
    import os
    import tempfile
    from harness import DETPROXY_BIN, run_cmd
    up = HugeReplica()
    up.dense, up.number, up.size = True, b"1e301", 8 * MiB - 64
    d = tempfile.mkdtemp(prefix="detproxy-gone-")
    os.mkdir(os.path.join(d, "store"))
    audit = os.path.join(d, "audit.jsonl")
    px = start_proxy(pools=[{"name": "p", "models": [MODEL],
                             "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}],
                     policy={"tenants": [{"name": "t", "match": {"any": True}, "audit": True}]},
                     log={"audit_path": audit, "audit_store": os.path.join(d, "store")},
                     limits={"max_response_rewrite_bytes": 8 * MiB}, directory=d, workers=1)
    offloaded = lambda: metric(px, "detproxy_response_offloaded_total")
    mine = body_of(200 * 1024)
    c = socket.create_connection(("127.0.0.1", px.port))
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(mine), mine))
    poll_until(lambda: offloaded() == 1, interval=0.002, what="the answer's check")
    c.close()
    poll_until(lambda: metric(px, "detproxy_requests_total", status="499") == 1,
               what="the request whose client left counted 499")
    other = mine.replace(b"x" * 64, b"y" * 64)
    assert len(other) == len(mine) and fetch_digest(px.port, other)[0] == 200
    px.stop()
    lines = [json.loads(l) for l in open(audit) if "request_id" in l]
    gone = [l for l in lines if l["status"] == 499]
    assert len(gone) == 1, lines
    assert gone[0]["response_body_sha256"] == hashlib.sha256(b"").hexdigest(), gone[0]
    with open(os.path.join(d, "store", gone[0]["forwarded_body_sha256"]), "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == gone[0]["forwarded_body_sha256"]
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", audit, "--store",
                            os.path.join(d, "store"), "--no-signatures"])
    assert rc == 0, out + err


def audit_behind_a_busy_pool(audit_fail):
    """An audited proxy (log.audit_fail as given) with a pool of one thread, busy checking
    pool p's 15 MiB answer (fetched on a thread, returned), so that audit lines wait; pool q is a
    sim serving model m2. (px, sim, the fetching thread, its result list)."""
    import tempfile
    up = HugeReplica()
    up.dense, up.number, up.size = True, b"1e301", 15 * MiB
    sim = start_sim("--model", "m2")
    px = start_proxy(pools=[{"name": "p", "models": [MODEL],
                             "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]},
                            pool("q", ["m2"], [sim])],
                     policy={"tenants": [{"name": "t", "match": {"any": True}, "audit": True}]},
                     log={"audit_path": "audit.jsonl", "audit_fail": audit_fail},
                     directory=tempfile.mkdtemp(prefix="detproxy-wait-"), workers=1,
                     limits={"max_response_rewrite_bytes": 16 * MiB},
                     env={"UV_THREADPOOL_SIZE": "1"})
    got = []
    t = threading.Thread(target=lambda: got.append(fetch_digest(px.port, body_of(200))))
    t.start()
    poll_until(lambda: metric(px, "detproxy_response_offloaded_total") == 1, interval=0.002,
               what="the long answer's check on the pool's one thread")
    return px, sim, t, got


def send_m2(px, **body):
    """A completion for pool q sent on a fresh connection (returned)."""
    data = json.dumps(dict({"model": "m2", "prompt": "x"}, **body)).encode()
    c = socket.create_connection(("127.0.0.1", px.port))
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
              b"content-length: %d\r\n\r\n%s" % (len(data), data))
    return c


def test_a_client_gone_while_its_answer_waits_for_the_audit_line_is_a_499():
    """An audited answer is sent once its audit line is written. A client that leaves while it
    waits got nothing: it is counted 499, not under the replica's status. The wait is made
    long here by a pool of one thread, busy checking another pool's 15 MiB answer."""
    px, sim, t, got = audit_behind_a_busy_pool("closed")
    c = send_m2(px, max_tokens=1)
    poll_until(lambda: get_json(sim.port, "/_sim/stats")["completed"] == 1, interval=0.002,
               what="the small answer back from its replica")
    c.close()
    t.join()
    assert got[0][0] == 200
    poll_until(lambda: metric(px, "detproxy_requests_total", pool="q") == 1,
               what="the small request counted")
    assert metric(px, "detproxy_requests_total", pool="q", status="499") == 1
    px.stop()


def test_a_client_gone_after_its_whole_answer_is_not_a_499_under_fail_open():
    """Under log.audit_fail: open nothing of an answer passed through waits for its audit line:
    a client that read it all and left while the line was still on its way is not a 499 (the
    access line gives the replica's status, as the metrics do)."""
    px, sim, t, got = audit_behind_a_busy_pool("open")
    # The replica refuses this one 400 with a Content-Length: passed through as it comes.
    c = send_m2(px, max_tokens=30000)
    r = read_response(c)
    c.close()
    assert r.status == 400 and r.complete, r.raw
    rid = r.headers["x-detproxy-request-id"]
    t.join()
    line = px.wait_log(lambda l: l.get("msg") == "access" and l.get("request_id") == rid)
    assert line["status"] == 400, line
    px.stop()


def test_memory_kept_for_large_bodies_falls_back_after_a_burst():
    """Body buffers of 64 KiB to 1.5 MiB are kept per worker for the next large body (a fresh
    mapping per body is dear; detproxy_body_stash_bytes shows them); after a burst they are
    freed within two 2 s windows, without any further request (docs/configuration.md, "Memory
    beside the budget")."""
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], workers=1)
    base = rss_kb(px)
    body = body_of(1 * MiB)
    out = []

    def send():
        out.append(http("POST", px.port, "/v1/completions", body=body,
                        headers={"content-type": "application/json"}, timeout=60).status)

    ts = [threading.Thread(target=send) for _ in range(32)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == [200] * 32, out
    held = rss_kb(px) - base
    # 32 bodies of 1 MiB read at once: their buffers stay stashed for the next large body
    poll_until(lambda: metric(px, "detproxy_body_stash_bytes") > 16 * MiB, timeout=10 * SLOW,
               interval=0.2, what="the stash shown holding the burst's buffers")
    poll_until(lambda: metric(px, "detproxy_body_stash_bytes") == 0, timeout=10 * SLOW,
               interval=0.2, what="the stashed buffers freed")
    if not SANITIZE:  # ASan's allocator keeps freed memory in its quarantine
        assert held > 16 * 1024, "%d KiB held after the burst" % held
        poll_until(lambda: rss_kb(px) - base < held - 16 * 1024, timeout=10 * SLOW,
                   interval=0.2, what="RSS back (%d KiB held after the burst)" % held)
    px.stop()


def test_open_streams_hold_little_memory_each():
    """Streamed answers run for minutes, thousands at once: each holds what streaming needs (its
    two connections, the fingerprint rewriter, the usage scan, what its access line reports),
    not what sending its request needed. The head built for the replica, the client's body and
    the policy's rewrite of it, the replica's response head and the answer's head buffer go
    once the answer begins (docs/configuration.md, "Streams"). With them a stream held 12.5 KiB
    of this proxy's memory; without them about 8."""
    n0, n = 100, 1000
    if SANITIZE or TSAN:
        n = 300  # the bound is not checked: their allocators hold memory of their own
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 3 * n + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 3 * n + 200), hard))
    sim = start_sim("--model", MODEL, "--token-delay-ms", 1000)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], workers=1,
                     limits={"max_connections": 2 * n},
                     policy={"tenants": [{"name": "t", "match": {"any": True},
                                          "sampling": {"temperature": {"force": 0},
                                                       "seed": {"derive": True}}}]})
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 200,
                       "messages": [{"role": "system", "content": "You are careful. " * 20},
                                    {"role": "user", "content": "Summarise the note. " * 20}]})
    req = ("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
           "content-length: %d\r\n\r\n%s" % (len(body), body)).encode()
    sel = selectors.DefaultSelector()
    streams = []

    def open_streams(k):
        """k more streams, each read until its first event: its answer has begun."""
        waiting = {}
        for _ in range(k):
            s = socket.create_connection(("127.0.0.1", px.port), timeout=10 * SLOW)
            s.sendall(req)
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
            waiting[s] = b""
            streams.append(s)
        deadline = time.monotonic() + 30 * SLOW
        while waiting:
            assert time.monotonic() < deadline, "%d streams without an event" % len(waiting)
            for key, _ in sel.select(timeout=1):
                s = key.fileobj
                got = waiting.get(s, b"") + s.recv(65536)
                if s not in waiting:
                    continue
                assert got, "a stream closed before its first event"
                if b"data:" in got:
                    assert got.startswith(b"HTTP/1.1 200 "), got[:300]
                    del waiting[s]
                else:
                    waiting[s] = got

    open_streams(n0)
    base = rss_kb(px)
    open_streams(n - n0)
    per = (rss_kb(px) - base) * 1024 / (n - n0)
    print("%d bytes of RSS per open stream" % per)
    if not (SANITIZE or TSAN):
        assert per < 10 * 1024, "%d bytes of RSS per open stream" % per
    for s in streams:
        s.close()
    px.stop()


def test_a_burst_refused_for_one_address_refuses_no_one_else():
    """Connections one address has over its bound are closed at accept, and give their place
    of max_connections back at once: another address's connection in the same accept burst
    (the process stopped while they queue, then let go) is served."""
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], workers=1,
                     limits={"max_connections": 8, "max_connections_per_client": 1})
    held = connect_from(px.port)
    held.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    assert held.recv(65536).startswith(b"HTTP/1.1 200 ")
    os.kill(px.popen.pid, signal.SIGSTOP)
    try:
        burst = [connect_from(px.port) for _ in range(20)]  # completed by the kernel, queued
        other = connect_from(px.port, "127.0.0.2")
    finally:
        os.kill(px.popen.pid, signal.SIGCONT)
    other.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
    try:
        data = other.recv(65536)
    except ConnectionResetError:
        data = b""
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    px.wait_log(lambda l: l.get("msg") == "client_connection_limit")
    for s in burst + [other, held]:
        s.close()
    px.stop()


def test_one_client_address_cannot_take_every_connection():
    """limits.max_connections_per_client, counted over both workers: an address at its bound
    has its new connections closed unanswered; another address is served, and the first again
    once it lets one go. A reload changes the bound for new connections."""
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], workers=2,
                     limits={"max_connections_per_client": 4})

    def conn(source="127.0.0.1"):
        return connect_from(px.port, source)

    def answered(s):
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            data = s.recv(65536)  # the head and the short model list, or the close
        except (ConnectionResetError, BrokenPipeError):
            return False
        if not data:
            return False
        assert data.startswith(b"HTTP/1.1 200 "), data[:300]
        return True

    def take(source="127.0.0.1"):
        """A connection once the proxy has room for it (a closed one counts until read)."""
        def attempt():
            s = conn(source)
            if answered(s):
                return s
            s.close()
            return None
        return poll_until(attempt, what="room for a connection from " + source)

    held = [take() for _ in range(4)]  # SO_REUSEPORT spreads them over the two workers
    for _ in range(3):
        over = conn()
        assert not answered(over), "a fifth connection from one address, on either worker"
        over.close()
    other = take("127.0.0.2")
    held.pop().close()
    held.append(take())
    for s in held:
        assert answered(s), "the connections within the bound stay served"
    line = px.wait_log(lambda l: l.get("msg") == "client_connection_limit")
    assert line["remote"].startswith("127.0.0.1:"), line
    assert line["max_connections_per_client"] == 4, line
    assert get_json(px.admin_port, "/admin/config")["limits"]["max_connections_per_client"] == 4

    with open(px.config_path) as f:
        live = json.load(f)
    live["limits"]["max_connections_per_client"] = 6
    with open(px.config_path, "w") as f:
        json.dump(live, f)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 200, r.body
    held += [take(), take()]
    over = conn()
    assert not answered(over), "the reloaded bound holds"
    over.close()
    for s in held + [other]:
        s.close()
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
