"""Misbehaving clients: slowloris, clients that stop reading or vanish mid-request, pipelining
with slow and fast requests, file-descriptor exhaustion, SIGPIPE.

Each test runs the real detproxy in front of detproxy-sim and checks what the behaviour
produces (the 408's timing, the sim's token counter and abort counter, the proxy's RSS, the
order of bytes on the wire, log lines), then that the proxy still serves the next request;
stop() checks the exit code and, under DP_SANITIZE, a clean sanitizer report.
"""

import json
import signal
import socket
import threading
import time

from harness import SLOW, SANITIZE, VALGRIND, poll_until, post_json, run_tests, start_sim
from proxyutil import (ScriptedUpstream, assert_openai_error, client_requests, exchange, metric,
                       parse_response, pool, read_until_close, rss_kb, sim_stats, start_proxy)

COMPLETION = {"model": "m1", "prompt": "hello there", "max_tokens": 4, "temperature": 0}


def request_bytes(obj, path="/v1/completions"):
    body = json.dumps(obj).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body))) + body


def read_response(sock, timeout=10):
    """Read exactly one complete response from a keep-alive connection."""
    sock.settimeout(timeout * SLOW)
    buf = b""
    while True:
        chunk = sock.recv(65536)
        assert chunk, "connection closed after %r" % buf[:200]
        buf += chunk
        try:
            r = parse_response(buf)
        except AssertionError:
            continue  # head not complete yet
        if r.complete:
            return r


def assert_serves_next(px):
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4, r
    poll_until(lambda: metric(px, "detproxy_connections") == 0 and
               metric(px, "detproxy_inflight_requests") == 0, timeout=5,
               what="proxy connection and in-flight gauges back to 0")


def setup(*sim_flags, limits=None, **kw):
    """A sim and a proxy with it admitted; no periodic re-attestation during the test, so the
    sim's counters only move for client traffic and our own look-ups."""
    sim = start_sim("--model", "m1", *sim_flags)
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], limits=limits,
                     attestation={"interval_ms": 600000}, **kw)
    return sim, px


# ---- slowloris -----------------------------------------------------------------------------

HEADER_TIMEOUT_MS = 1500


def dribble(sock, data, interval, stop):
    """Send data one byte every `interval` seconds until done, stopped, or the peer is gone."""
    for i in range(len(data)):
        if stop.is_set():
            return
        try:
            sock.send(data[i:i + 1])
        except OSError:
            return
        stop.wait(interval)


def slowloris(px, prefix=b""):
    """Open a connection (sending prefix at once), then dribble a head at one byte a second.
    Returns (seconds from the first dribbled byte to the close, raw bytes received after the
    prefix's response)."""
    t0 = time.monotonic()  # before the accept, where the first head's timer starts
    s = socket.create_connection(("127.0.0.1", px.port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if prefix:
        s.sendall(prefix)
        assert read_response(s).status == 200  # whole, before dribbling the next head
        t0 = time.monotonic()  # the next head's timer starts at its first byte, sent below
    stop = threading.Event()
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    th = threading.Thread(target=dribble, args=(s, head, 1.0, stop), daemon=True)
    th.start()
    out, closed = read_until_close(s, timeout=10)
    elapsed = time.monotonic() - t0
    stop.set()
    th.join()
    s.close()
    assert closed, "slowloris connection still open after %.1fs" % elapsed
    return elapsed, out


def test_slowloris_gets_408_within_header_timeout():
    """One byte a second never lets the whole head arrive: 408 once client_header_timeout_ms
    has passed since the connection opened, although bytes keep arriving (the timer bounds
    the whole head, not each read)."""
    sim, px = setup(limits={"client_header_timeout_ms": HEADER_TIMEOUT_MS})
    conns = sim_stats(sim)["connections_total"]
    elapsed, out = slowloris(px)
    r = parse_response(out)
    assert_openai_error(r, 408, "timeout")
    assert r.headers.get("connection") == "close"
    t = HEADER_TIMEOUT_MS / 1000.0
    # Never closing is the failure; the upper bound leaves room for a busy box.
    assert t - 0.1 <= elapsed <= t + 2.0 * SLOW, "408 after %.2fs, want ~%.1fs" % (elapsed, t)
    # Nothing forwarded: the only new connection to the sim is this look-up.
    assert sim_stats(sim)["connections_total"] == conns + 1
    assert_serves_next(px)
    px.stop()


def test_slowloris_on_keep_alive_connection_gets_408():
    """After a complete request on the connection, the next head gets the same bound, counted
    from its first byte (the idle time before it is a separate, longer timeout)."""
    sim, px = setup(limits={"client_header_timeout_ms": HEADER_TIMEOUT_MS,
                            "client_idle_timeout_ms": 30000})
    elapsed, out = slowloris(px, prefix=request_bytes(COMPLETION))
    r = parse_response(out)
    assert_openai_error(r, 408, "timeout")
    t = HEADER_TIMEOUT_MS / 1000.0
    # Never closing is the failure; the upper bound leaves room for a busy box.
    assert t - 0.1 <= elapsed <= t + 2.0 * SLOW, "408 after %.2fs, want ~%.1fs" % (elapsed, t)
    assert len(client_requests(sim)) == 1
    assert_serves_next(px)
    px.stop()


# ---- a client that stops reading an SSE stream ---------------------------------------------

# 64 choices of up to 4096 tokens: about 250k SSE events, 50 MB. (A high temperature keeps
# the toy model's end-of-sequence token from ending choices early.)
BIG_STREAM = {"model": "m1", "prompt": "tell me everything", "max_tokens": 4096, "n": 64,
              "temperature": 50, "stream": True}
TOTAL_TOKENS = 4096 * 64
RSS_BOUND_KB = (60 if SANITIZE or VALGRIND else 20) * 1024


def wait_stalled(sim, above, quiet=1.0, timeout=20):
    """Poll tokens_generated until it is past `above` (the stream has begun) and has not moved
    for `quiet` seconds; return the stats."""
    last, since = None, time.monotonic()
    deadline = time.monotonic() + timeout * SLOW
    while time.monotonic() < deadline:
        st = sim_stats(sim)
        if st["tokens_generated"] != last:
            last, since = st["tokens_generated"], time.monotonic()
        elif last > above and time.monotonic() - since >= quiet * SLOW:
            return st
        time.sleep(0.1)
    raise AssertionError("generation never stalled: %r" % sim_stats(sim))


def open_unread_stream(px, body):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    s.connect(("127.0.0.1", px.port))
    s.sendall(request_bytes(body))
    return s


def test_client_stops_reading_sse_stream():
    """A client that stops reading a 50 MB stream: the proxy stops reading the replica (so the
    sim's generation stalls on TCP backpressure) and its memory stays flat. When the client
    reads again, the upstream resumes; when it then leaves, the paused request is aborted."""
    sim, px = setup("--token-delay-ms", "0")
    assert_serves_next(px)
    base = rss_kb(px)
    before = sim_stats(sim)["tokens_generated"]
    s = open_unread_stream(px, BIG_STREAM)
    st = wait_stalled(sim, before)
    assert st["inflight"] == 1 and st["completed"] == 1, st  # 1: assert_serves_next's
    stalled_at = st["tokens_generated"]
    assert 0 < stalled_at < TOTAL_TOKENS // 2, st
    rss1 = rss_kb(px)
    time.sleep(2.0)  # time is the input here: nothing may move while the client sleeps
    st2 = sim_stats(sim)
    assert st2["tokens_generated"] == stalled_at, (st, st2)
    rss2 = rss_kb(px)
    assert rss1 - base < RSS_BOUND_KB and rss2 - base < RSS_BOUND_KB, (base, rss1, rss2)
    assert rss2 - rss1 < 2048, (rss1, rss2)
    # Read 8 MB: the proxy resumes reading the replica, generation moves on.
    s.settimeout(30 * SLOW)
    got, head = 0, b""
    while got < 8 << 20:
        chunk = s.recv(1 << 20)
        assert chunk, "stream ended early after %d bytes" % got
        if len(head) < 4096:
            head += chunk[:4096]
        got += len(chunk)
    r = parse_response(head)
    assert r.status == 200 and r.headers["transfer-encoding"] == "chunked", r
    assert r.body.startswith(b"data: {"), r.body[:100]
    poll_until(lambda: sim_stats(sim)["tokens_generated"] > stalled_at + 20000, timeout=20,
               what="generation resumed after the client read again")
    # Stop reading again and leave (RST: unread data is pending): the request is aborted.
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()
    st3 = poll_until(lambda: (lambda st: st if st["inflight"] == 0 else None)(sim_stats(sim)),
                     timeout=2, what="sim request aborted")
    assert st3["aborted"] == 1 and st3["completed"] == 1, st3
    assert rss_kb(px) - base < RSS_BOUND_KB, (base, rss_kb(px))
    assert_serves_next(px)
    px.stop()


# ---- clients that disconnect mid-request ---------------------------------------------------


def test_client_disconnects_mid_body_inference():
    """Head and part of an inference body, then gone: nothing reaches the replica, the request
    is dropped (log line), the gauges return to 0."""
    sim, px = setup()
    conns = sim_stats(sim)["connections_total"]
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" +
              b"{" + b" " * 5000)
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 1, what="request in flight")
    s.close()
    px.wait_log(lambda r: r.get("msg") == "client_disconnected" and
                r.get("during") == "request body", timeout=5)
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 0, timeout=2,
               what="request dropped")
    st = sim_stats(sim)
    assert st["requests"] == 0 and st["connections_total"] == conns + 1, st
    assert_serves_next(px)
    px.stop()


def test_client_disconnects_mid_body_pass_through():
    """A pass-through body streams to the replica as it arrives; when the client goes away
    mid-body the upstream connection is closed at once (the replica would otherwise wait for
    the rest of the body until its own timeout)."""
    up = ScriptedUpstream(lambda k, c, q: (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
                                           True))
    px = start_proxy(pools=[{"name": "p", "models": ["m1"], "replicas": [
        {"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}])
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n\r\n" +
              b"x" * 200000)
    conn = poll_until(lambda: [c for c, w in up.events if w == "head:/v1/embeddings"],
                      what="the streamed head at the replica")[0]
    s.close()
    t0 = time.monotonic()
    poll_until(lambda: "closed" in up.conn_events(conn), timeout=1,
               what="upstream connection closed after the client left")
    assert time.monotonic() - t0 < 1.0 * SLOW
    assert up.requests == []
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 0, timeout=2,
               what="request dropped")
    px.stop()
    up.stop()


def test_client_half_closes_while_response_completes():
    """Clients that send a request and at once half-close: the proxy takes the EOF as the
    client leaving, while the replica's answer may complete in the same loop turn. (The race
    frees the proxy's request state twice unless net_resp_end disowns a closing request.) 200
    rounds, eight at a time: each gets nothing or one whole response, never a partial one; the
    proxy stays up, and ASan stays quiet."""
    sim, px = setup()
    data = request_bytes(dict(COMPLETION, max_tokens=1))
    bad = []

    def one():
        try:
            with socket.create_connection(("127.0.0.1", px.port), timeout=10 * SLOW) as s:
                s.sendall(data)
                s.shutdown(socket.SHUT_WR)
                out, closed = read_until_close(s, timeout=10)
            if not closed or (out and not parse_response(out).complete):
                bad.append(out[:200])
        except OSError as e:
            bad.append(repr(e))

    for _ in range(25):
        ts = [threading.Thread(target=one) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert px.alive()
    assert not bad, bad[:3]
    assert_serves_next(px)
    px.stop()


def test_upload_to_a_replica_that_stops_reading_is_bounded():
    """A pass-through upload streams to the replica; when the replica stops reading, the proxy
    stops reading the client (its queue toward the replica stays bounded): the client's
    sends stall after a few MB of buffers, the proxy's memory stays flat, and when the client
    gives up the upstream connection is closed."""
    up = ScriptedUpstream(lambda k, c, q: (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
                                           True), read_bodies=False)
    px = start_proxy(pools=[{"name": "p", "models": ["m1"], "replicas": [
        {"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}])
    base = rss_kb(px)
    total = 200 << 20
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % total)
    sent = [0]
    stop = threading.Event()

    def upload():
        # Short timeouts, so no send is blocked in the kernel when the main thread closes the
        # socket (a blocked send would keep it open and the reset would never go out).
        s.settimeout(0.1)
        block = b"u" * (1 << 20)
        while sent[0] < total and not stop.is_set():
            try:
                sent[0] += s.send(block)
            except socket.timeout:
                continue
            except OSError:
                return

    t = threading.Thread(target=upload, daemon=True)
    t.start()
    conn = poll_until(lambda: [c for c, w in up.events if w == "head:/v1/files"],
                      what="the upload's head at the replica")[0]
    # Wait for the upload to begin and then stall: no progress for a second.
    last, since = -1, time.monotonic()
    deadline = since + 30 * SLOW
    while sent[0] == 0 or time.monotonic() - since < 1.0 * SLOW:
        if sent[0] != last:
            last, since = sent[0], time.monotonic()
        assert time.monotonic() < deadline, "the upload never stalled: %d bytes" % sent[0]
        time.sleep(0.1)
    assert 0 < sent[0] < 64 << 20, "the proxy kept reading: %d bytes taken" % sent[0]
    grown = rss_kb(px) - base
    assert grown < (60 if SANITIZE or VALGRIND else 20) * 1024, "proxy RSS grew by %d KiB" % grown
    stop.set()
    t.join()
    assert not up.peer_closed(conn)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    s.close()  # a reset: the client is gone
    poll_until(lambda: up.peer_closed(conn), timeout=2,
               what="upstream connection closed after the client left")
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 0, timeout=2,
               what="request dropped")
    px.stop()
    up.stop()


def _abort_check(sim, t0, budget):
    st = poll_until(lambda: (lambda st: st if st["inflight"] == 0 else None)(sim_stats(sim)),
                    timeout=budget, what="sim generation aborted")
    took = time.monotonic() - t0
    assert st["aborted"] == 1 and st["completed"] == 0, st
    return took


def test_client_disconnects_mid_stream():
    """A client that reads a few SSE chunks and leaves: the replica's generation (8 s long) is
    aborted at once."""
    sim, px = setup("--token-delay-ms", "20")
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(request_bytes(dict(COMPLETION, max_tokens=400, stream=True)))
    buf = b""
    while buf.count(b"data: ") < 4:
        chunk = s.recv(65536)
        assert chunk
        buf += chunk
    assert buf.startswith(b"HTTP/1.1 200")
    s.close()
    took = _abort_check(sim, time.monotonic(), budget=2)
    assert took < 1.0 * SLOW, took
    assert sim_stats(sim)["tokens_generated"] < 100
    assert_serves_next(px)
    px.stop()


def test_client_disconnects_while_waiting_for_non_streamed_response():
    """Same for a non-streamed request: nothing was sent back yet; the close is seen while the
    proxy waits and the generation is cancelled."""
    sim, px = setup("--token-delay-ms", "20")
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(request_bytes(dict(COMPLETION, max_tokens=400)))
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="generation running")
    s.close()
    took = _abort_check(sim, time.monotonic(), budget=2)
    assert took < 1.0 * SLOW, took
    assert_serves_next(px)
    px.stop()


# ---- pipelining ----------------------------------------------------------------------------


def test_pipelined_slow_stream_then_fast_requests_in_order():
    """A slow streamed request, then fast ones, in one write: answered strictly in order, the
    fast ones after the slow stream's last chunk, each framed correctly."""
    sim, px = setup("--token-delay-ms", "30")
    data = (request_bytes(dict(COMPLETION, prompt="slow", max_tokens=12, stream=True)) +
            request_bytes(dict(COMPLETION, prompt="fast", max_tokens=1)) +
            b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" +
            request_bytes(dict(COMPLETION, prompt="fast2", max_tokens=3)) +
            b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out, closed = exchange(px.port, data, timeout=10)
    assert closed
    a = parse_response(out)
    assert a.status == 200 and a.complete and a.headers["transfer-encoding"] == "chunked", a
    events = [e for e in a.body.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]" and len(events) == 13, events[-3:]
    b = parse_response(a.rest)
    assert b.status == 200 and b.json()["usage"]["completion_tokens"] == 1, b
    c = parse_response(b.rest)
    assert c.status == 200 and c.json()["object"] == "list", c
    d = parse_response(c.rest)
    assert d.status == 200 and d.json()["usage"]["completion_tokens"] == 3, d
    e = parse_response(d.rest)
    assert e.status == 200 and e.complete and e.rest == b"", e
    prompts = [json.loads(q["body"])["prompt"] for q in client_requests(sim) if q["inference"]]
    assert prompts == ["slow", "fast", "fast2"], prompts
    assert_serves_next(px)
    px.stop()


def pipeline_models(px, n):
    """n pipelined GET /v1/models (36 bytes in, ~450 out, answered by the proxy itself), the
    last with Connection: close, sent from a thread; the client socket and that thread."""
    req = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"
    data = req * (n - 1) + b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    s.connect(("127.0.0.1", px.port))
    sender = threading.Thread(target=s.sendall, args=(data,), daemon=True)
    sender.start()
    return s, sender


def read_answers(s, slow_for=0.0):
    """Read to the close: (answers counted, bytes). For the first slow_for seconds, 8 KB every
    50 ms (~160 KB/s); then as fast as they come."""
    s.settimeout(30 * SLOW)
    count, tail, total = 0, b"", 0
    marker = b"HTTP/1.1 200 OK\r\n"
    slow_until = time.monotonic() + slow_for
    while True:
        slow = time.monotonic() < slow_until
        chunk = s.recv(8192 if slow else 1 << 20)
        if not chunk:
            break
        total += len(chunk)
        window = tail + chunk
        count += window.count(marker)
        tail = window[-(len(marker) - 1):]  # too short to hold a whole marker: none counted twice
        if slow:
            time.sleep(0.05)  # time is the input: the client's reading rate
    return count, total


def test_pipelining_client_that_does_not_read_is_bounded():
    """100k pipelined requests from a client that does not read: the proxy must not queue
    45 MB of answers. It stops taking requests while the answers are unread, and answers all
    of them, in order, once the client reads."""
    sim, px = setup()
    assert_serves_next(px)
    base = rss_kb(px)
    n = 100000
    s, sender = pipeline_models(px, n)
    time.sleep(2.0)  # time is the input: a client that does not read for two seconds
    grown = rss_kb(px) - base
    # ASan keeps freed memory in quarantine, so it grows with what the proxy allocates while it
    # answers until the client's buffers fill (~12 MB here); unparsed pipelined bytes copied
    # again at every turn put 40-130 MB there, and unbounded queueing would be 45 MB more.
    bound = (80 if VALGRIND else 32 if SANITIZE else 10) * 1024
    assert grown < bound, "proxy RSS grew by %d KiB for unread answers" % grown
    # Now read everything: n answers, in order, then the close.
    count, total = read_answers(s)
    sender.join(timeout=10)
    s.close()
    assert count == n, (count, total)
    assert total > n * 300, total
    assert_serves_next(px)
    px.stop()


def test_a_pipelining_client_that_reads_slowly_but_steadily_is_not_cut_off():
    """A client that pipelines 20k requests and then reads its answers at ~160 KB/s, far
    slower than they are made: the kernel's send buffer fills (megabytes, autotuned) and it
    makes room for more only once a third of it is free, so for seconds no write completes.
    The client still takes bytes all along, so client_idle_timeout_ms (1 s here) must not cut
    it off: progress is the peer taking bytes, not a write completing."""
    sim, px = setup(limits={"client_idle_timeout_ms": 1000})
    n = 20000
    s, sender = pipeline_models(px, n)
    count, total = read_answers(s, slow_for=5.0)  # five idle timeouts of slow reading
    sender.join(timeout=10)
    s.close()
    assert count == n, (count, total)
    assert_serves_next(px)
    px.stop()


def flood_pipelines(px, nconns, stop, counts):
    """nconns connections that keep their pipelines full of GET /v1/models (20 more sent
    whenever the last 20 are gone, whatever is still unanswered) and read every answer, until
    `stop` is set: counts["answers"], counts["closed"] (connections the proxy ended)."""
    import selectors
    batch = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" * 20
    sel = selectors.DefaultSelector()
    out = {}
    for _ in range(nconns):
        c = socket.create_connection(("127.0.0.1", px.port))
        c.setblocking(False)
        out[c] = batch
        sel.register(c, selectors.EVENT_READ | selectors.EVENT_WRITE)
    while out and not stop.is_set():
        for key, ev in sel.select(0.2):
            c = key.fileobj
            if ev & selectors.EVENT_READ:
                try:
                    data = c.recv(1 << 20)
                except BlockingIOError:
                    data = None
                except OSError:
                    data = b""
                if data == b"":
                    sel.unregister(c)
                    del out[c]
                    c.close()
                    counts["closed"] += 1
                    continue
                if data:
                    counts["answers"] += data.count(b"HTTP/1.1 200 OK")
            if ev & selectors.EVENT_WRITE:
                try:
                    out[c] = out[c][c.send(out[c]):] or batch
                except BlockingIOError:
                    pass
    for c in out:
        c.close()


def test_clients_that_keep_their_pipelines_full_do_not_hold_the_loop():
    """Sixteen clients keep their pipelines full of requests the proxy answers itself (the model
    list; a refusal that keeps the connection is the same, and needs no key) and read every
    answer. Each connection starts at most PIPELINE_BURST requests a turn of the loop, so a new
    connection, and a keep-alive client's next request, are answered while the flood goes on:
    they once waited for the flood to end (seconds), and a keep-alive client's idle timeout
    fired before its request was read."""
    sim, px = setup(limits={"client_idle_timeout_ms": 3000})
    idle = socket.create_connection(("127.0.0.1", px.port))
    idle.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_response(idle).status == 200
    stop, counts = threading.Event(), {"answers": 0, "closed": 0}
    flood = threading.Thread(target=flood_pipelines, args=(px, 16, stop, counts), daemon=True)
    flood.start()
    try:
        poll_until(lambda: counts["answers"] > 20000, timeout=30 * SLOW, what="the flood served")
        for _ in range(5):
            fresh = socket.create_connection(("127.0.0.1", px.port))
            fresh.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            try:
                r = read_response(fresh, timeout=5)
            except TimeoutError:
                raise AssertionError("a new connection unanswered for 5 s while 16 clients kept "
                                     "their pipelines full (%d answers so far)" % counts["answers"])
            fresh.close()
            assert r.status == 200, r
        idle.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(idle, timeout=5).status == 200
        during = counts["answers"]
        poll_until(lambda: counts["answers"] > during, what="the flood still being served")
        assert flood.is_alive() and counts["closed"] == 0, counts
    finally:
        stop.set()
        flood.join(10)
    idle.close()
    assert_serves_next(px)
    px.stop()


def test_a_client_leaving_after_a_full_turn_of_pipelined_requests_is_noticed():
    """Pipelined requests the proxy answers itself fill a connection's turn (PIPELINE_BURST,
    4); a generation after them starts at a later turn. The client then leaves: the proxy must
    see it go and cut the generation (499), not keep the replica busy until it ends."""
    sim, px = setup("--token-delay-ms", "100")
    body = json.dumps({"model": "m1", "prompt": "leave", "max_tokens": 200}).encode()
    for n, k in enumerate((3, 4, 8), 1):  # in the first turn, then after one and two full ones
        s = socket.create_connection(("127.0.0.1", px.port))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n" * k +
                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the generation running")
        s.close()
        # 200 tokens at 100 ms: 20 s if nobody notices the client is gone.
        poll_until(lambda: sim_stats(sim)["inflight"] == 0, timeout=5 * SLOW,
                   what="the generation cut once its client left (k=%d)" % k)
        poll_until(lambda: metric(px, "detproxy_requests_total", pool="p", status="499") == n,
                   what="the generation counted 499 (k=%d)" % k)
    assert_serves_next(px)
    px.stop()


def test_a_slow_reader_gets_all_of_the_last_answer_before_the_close():
    """Connection: close and an answer of 4.4 MB (the model list of a pool with 20,000 models),
    read at ~640 KB/s: after the answer the connection lingers, and the linger must not end
    while the client is still taking the answer's bytes (it once ended 2 s after the answer
    was queued, dropping what detproxy still held of it), nor when the client, done sending,
    half-closes its side."""
    sim = start_sim("--model", "m1")
    models = ["m1"] + ["model-%05d-%s" % (i, "x" * 40) for i in range(20000)]
    px = start_proxy(pools=[pool("p", models, [sim])], attestation={"interval_ms": 600000})
    for half_close in (False, True):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        s.connect(("127.0.0.1", px.port))
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        s.settimeout(30 * SLOW)
        data = b""
        if half_close:
            # Once its first bytes are here the answer is queued: a half-close before that is a
            # disconnect.
            data = s.recv(32768)
            s.shutdown(socket.SHUT_WR)
        while True:
            chunk = s.recv(32768)
            if not chunk:
                break
            data += chunk
            time.sleep(0.05)  # time is the input: the client's reading rate
        s.close()
        r = parse_response(data)
        assert r.status == 200 and r.complete, (half_close, len(data), data[:200])
        assert len(r.json()["data"]) == len(models)
    px.stop()


# ---- file descriptors ----------------------------------------------------------------------


def test_fd_exhaustion_on_accept():
    """Under RLIMIT_NOFILE 64 (soft and hard, so detproxy cannot raise it), a flood of
    connections exhausts the descriptors: accept fails (logged, rate-limited), connections
    beyond are shed, established ones keep working, and once the flood closes the proxy
    serves new connections again."""
    sim, px = setup(wrapper=["prlimit", "--nofile=64:64"])
    assert_serves_next(px)  # leaves one pooled upstream connection
    keep = socket.create_connection(("127.0.0.1", px.port))
    keep.sendall(request_bytes(COMPLETION))
    assert read_response(keep).status == 200
    flood = []
    for _ in range(100):
        try:
            flood.append(socket.create_connection(("127.0.0.1", px.port), timeout=2))
        except OSError:
            break
    px.wait_log(lambda r: r.get("msg") == "accept_failed" and r.get("error") in
                ("EMFILE", "ENFILE"), timeout=5)
    assert px.alive()
    # An established keep-alive connection is still served while the listener is starved.
    keep.sendall(request_bytes(COMPLETION))
    r = read_response(keep)
    assert r.status in (200, 502), r  # 502 only if a new upstream socket was needed
    for s in flood:
        s.close()
    keep.close()
    poll_until(lambda: _try_completion(px), timeout=10, what="proxy serving again")
    assert_serves_next(px)
    px.stop()


def _try_completion(px):
    try:
        return post_json(px.port, "/v1/completions", COMPLETION, timeout=2).status == 200
    except OSError:
        return False


# ---- SIGPIPE -------------------------------------------------------------------------------


def sigign(pid):
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            if line.startswith("SigIgn:"):
                return int(line.split()[1], 16)
    return 0


def test_sigpipe_client_closes_during_large_response():
    """Clients that reset the connection while large responses are being written (a 50 MB
    stream, a 200 KB JSON body): writes fail with EPIPE/ECONNRESET, the proxy must not die of
    SIGPIPE (it ignores it: checked in /proc), and it serves the next request."""
    sim, px = setup("--token-delay-ms", "0")
    assert sigign(px.popen.pid) & (1 << (signal.SIGPIPE - 1)), "SIGPIPE is not ignored"
    bodies = [BIG_STREAM, dict(BIG_STREAM, stream=False, max_tokens=400)]
    for round_ in range(6):
        body = bodies[round_ % 2]
        s = socket.create_connection(("127.0.0.1", px.port))
        s.sendall(request_bytes(body))
        got = b""
        while len(got) < 1024:
            chunk = s.recv(1024)
            if not chunk:
                break
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
        if round_ % 3 == 0:
            # RST now, with the proxy mid-write.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        elif round_ % 3 == 1:
            s.shutdown(socket.SHUT_RD)  # unread data: the kernel answers with RST
        s.close()
        poll_until(lambda: sim_stats(sim)["inflight"] == 0, timeout=20,
                   what="upstream request ended")
        assert px.alive(), "detproxy died (rc %s)" % px.popen.poll()
    assert_serves_next(px)
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
