"""The request-body budget (limits.max_inflight_body_bytes) comes back on every way a request
can end: a client closing or resetting mid-body, a Content-Length lie, 413 mid-chunked, 408,
pipelined requests, bodies policed on the loop and on the thread pool. Each abort spends
the whole budget, so a leaked reservation makes the next full body a 503."""

import os
import socket
import struct
import tempfile
import time

from harness import SLOW, http, poll_until, run_tests, start_sim
from proxyutil import metric, pool, read_until_close, start_proxy

MODEL = "m1"
KiB = 1 << 10
LIMIT = 256 * KiB


def body_of(n, fields='"max_tokens":1'):
    head = '{"model":"%s",%s,"prompt":"' % (MODEL, fields)
    return (head + "x" * (n - len(head) - 2) + '"}').encode()


def head(n=None, chunked=False):
    h = "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    h += "transfer-encoding: chunked\r\n" if chunked else "content-length: %d\r\n" % n
    return (h + "\r\n").encode()


def connect(port):
    return socket.create_connection(("127.0.0.1", port), timeout=10 * SLOW)


def reset(s):
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def admitted(px, n):
    # Looked at often: on a loaded machine the first of several may be answered soon.
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == n, interval=0.005,
               what="%d admitted" % n)


def abort_close(px):
    s = connect(px.port)
    s.sendall(head(LIMIT) + body_of(LIMIT)[:LIMIT // 2])
    admitted(px, 1)
    s.close()


def abort_reset(px):
    s = connect(px.port)
    s.sendall(head(LIMIT) + body_of(LIMIT)[:LIMIT // 2])
    admitted(px, 1)
    reset(s)


def abort_cl_lie_fin(px):
    # Declares more than it sends, then half-closes: the body can never complete.
    s = connect(px.port)
    s.sendall(head(LIMIT) + body_of(LIMIT // 2))
    admitted(px, 1)
    s.shutdown(socket.SHUT_WR)
    read_until_close(s, timeout=5)
    s.close()


def abort_chunked_close(px):
    s = connect(px.port)
    b = body_of(LIMIT)
    s.sendall(head(chunked=True) + b"%x\r\n" % (LIMIT - 10) + b[:LIMIT - 10] + b"\r\n")
    admitted(px, 1)
    s.close()


def abort_chunked_413(px):
    s = connect(px.port)
    b = body_of(LIMIT)
    s.sendall(head(chunked=True) + b"%x\r\n" % (LIMIT - 10) + b[:LIMIT - 10] + b"\r\n" +
              b"100\r\n" + b"y" * 256 + b"\r\n")
    data, _ = read_until_close(s, timeout=5)
    assert b" 413 " in data.split(b"\r\n")[0], data[:200]
    s.close()


def abort_408(px):
    s = connect(px.port)
    s.sendall(head(LIMIT) + body_of(LIMIT)[:LIMIT - 1])
    data, _ = read_until_close(s, timeout=10)
    assert b" 408 " in data.split(b"\r\n")[0], data[:200]
    s.close()


def abort_pipelined(px):
    # A whole small request followed by a partial big one, then a close.
    s = connect(px.port)
    small = body_of(200)
    s.sendall(head(len(small)) + small + head(LIMIT) + body_of(LIMIT)[:LIMIT // 2])
    time.sleep(0.2 * SLOW)
    s.close()


def abort_whole_then_close(px):
    # A whole body, then gone before the answer.
    s = connect(px.port)
    s.sendall(head(LIMIT) + body_of(LIMIT))
    reset(s)


def abort_dense_then_close(px):
    # A whole body dense enough to be policed on the thread pool, then gone before the answer.
    b = ('{"model":"%s","max_tokens":1,"prompt":"x","extra":[' % MODEL).encode()
    b += b"1," * ((LIMIT - len(b) - 2) // 2)
    b = b[:-1] + b"]}"
    s = connect(px.port)
    s.sendall(head(len(b)) + b)
    reset(s)


def abort_whole_pipelined_then_close(px):
    s = connect(px.port)
    b = body_of(LIMIT // 2)
    s.sendall((head(len(b)) + b) * 3)
    s.close()


ABORTS = [abort_close, abort_reset, abort_cl_lie_fin, abort_chunked_close, abort_chunked_413,
          abort_408, abort_pipelined, abort_whole_then_close, abort_dense_then_close,
          abort_whole_pipelined_then_close]


def test_the_body_budget_is_returned_however_the_request_ends():
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"max_body_bytes": LIMIT, "max_inflight_body_bytes": LIMIT,
                             "client_body_timeout_ms": int(1000 * SLOW)})
    full = body_of(LIMIT)
    for abort in ABORTS:
        abort(px)
        poll_until(lambda: metric(px, "detproxy_inflight_requests") == 0,
                   what="%s: nothing in flight" % abort.__name__)
        # A body still being policed on the thread pool after its client left keeps its
        # budget until policing ends (the next test), so "nothing in flight" may come first:
        # the budget must come back, soon; a leaked reservation never does. Until it does,
        # the full body is refused for the budget: 503 when nothing can be shed, or 408 when
        # it is itself the slowest body being read (a loaded machine reads the pipelined
        # bodies' tail beside it).
        def full_body_served():
            r = http("POST", px.port, "/v1/completions", body=full,
                     headers={"content-type": "application/json"})
            full_budget = r.status in (503, 408) and b"max_inflight_body_bytes" in r.body
            assert r.status == 200 or full_budget, (abort.__name__, r.status, r.body[:300])
            return r.status == 200
        poll_until(full_body_served, what="%s: a full body served again" % abort.__name__)
    px.stop()


def test_a_body_left_on_the_thread_pool_keeps_its_budget_until_policed():
    """A client that sends a whole large body and leaves at once keeps its budget held while the
    body is still queued for policing on the thread pool: handed back earlier, such clients could
    pile bodies up in the work queue with the budget showing none of them."""
    sim = start_sim("--model", MODEL)
    size, n = 8 << 20, 4
    # A tenant deriving seeds: each body's RFC 8785 canonicalisation prints every one of its
    # ~360k 17-digit numbers (~0.5 s a body in Release, several times that under ASan). With one
    # worker thread the four bodies queue: the last is policed well over a second after the
    # clients leave, while the next head below arrives within milliseconds.
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"max_body_bytes": size, "max_inflight_body_bytes": n * size},
                     policy={"tenants": [{"name": "t", "match": {"any": True},
                                          "sampling": {"seed": {"derive": True}}}]},
                     env={"UV_THREADPOOL_SIZE": "1"})
    b = ('{"model":"%s","max_tokens":1,"prompt":"x","extra":[' % MODEL).encode()
    b += b"1.7976931348623157e308," * ((size - len(b) - 2) // 23)
    b = b[:-1] + b"]}"
    # Every body but its last byte first, so that none is complete (and policed) before all
    # are in: then the four last bytes, and each client leaves at once. The four bodies reach
    # the work queue within milliseconds of each other and of the clients leaving.
    conns = [connect(px.port) for _ in range(n)]
    for s in conns:
        s.sendall(head(len(b)) + b[:-1])
    admitted(px, n)
    for s in conns:
        s.sendall(b[-1:])
        s.close()  # a FIN after the whole body (a reset would discard its unread end)
    # The proxy saw each client leave (their connections are closed) ...
    poll_until(lambda: metric(px, "detproxy_connections") == 0, interval=0.002,
               what="the clients gone")
    # Their bodies are still in the work queue: so is their budget (and, their reads done,
    # none of it can be shed), so the first bytes of a new body find no room.
    s = connect(px.port)
    s.sendall(head(len(b)) + b[:64 * KiB])
    data, _ = read_until_close(s, timeout=10)
    s.close()
    assert b" 503 " in data.split(b"\r\n")[0], data[:300]
    # Once they are policed, every share is back.
    poll_until(lambda: http("POST", px.port, "/v1/completions", body=body_of(size // 2),
                            headers={"content-type": "application/json"}).status == 200,
               timeout=30, what="the budget back after policing")
    px.stop()


def open_stream(port, n, tenant=None):
    """A streamed completion whose body is n bytes, read until its first event: the answer has
    begun, and runs on (the replica is slow) while the socket stays open."""
    b = body_of(n, '"max_tokens":2000,"stream":true')
    s = connect(port)
    h = head(len(b))
    if tenant:
        h = h[:-2] + b"x-tenant: " + tenant.encode() + b"\r\n\r\n"
    s.sendall(h + b)
    got = b""
    while b"data:" not in got:
        chunk = s.recv(65536)
        assert chunk, got[:300]
        got += chunk
    assert got.startswith(b"HTTP/1.1 200 "), got[:300]
    return s


def test_a_streamed_answer_gives_its_body_budget_back_as_it_begins():
    """A streamed answer may run for minutes after its request was read. Its body's share of the
    budget comes back once the answer begins, so long generations do not turn away the uploads
    behind them: with the whole budget's body streaming, another whole body is served. An
    audited tenant's stream keeps its share to the end, as its audit line hashes and stores the
    forwarded body then."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", 20)
    d = tempfile.mkdtemp(prefix="detproxy-budget-")
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"max_body_bytes": LIMIT, "max_inflight_body_bytes": LIMIT},
                     policy={"tenants": [
                         {"name": "audited", "audit": True,
                          "match": {"header": {"name": "x-tenant", "value": "audited"}}},
                         {"name": "plain", "match": {"any": True}}]},
                     log={"audit_path": os.path.join(d, "audit.jsonl")})
    full = body_of(LIMIT)
    post = lambda: http("POST", px.port, "/v1/completions", body=full,
                        headers={"content-type": "application/json"})

    s = open_stream(px.port, LIMIT)
    r = post()
    assert r.status == 200, (r.status, r.body[:300])
    s.close()

    s = open_stream(px.port, LIMIT, tenant="audited")
    r = post()
    assert r.status == 503 and b"max_inflight_body_bytes" in r.body, (r.status, r.body[:300])
    s.close()
    poll_until(lambda: post().status == 200, what="the audited stream's share back at its end")
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
