"""Failing replicas: dying mid-stream, smuggling framing and garbage, hanging, stalling,
refusing connections, the keep-alive race, 500s.

Most cases use detproxy-sim's fault injection (POST /_sim/config {"fault": ...}). Where the
sim cannot produce the exact bytes (a bad response on a connection it keeps open, a response
cut inside its status line), proxyutil.ScriptedUpstream plays the replica. Each case checks
what the client and the replica observe, the upstream error metric, and that the proxy serves
the next request (after re-attesting the replica where a failed connection made it pending).
"""

import json
import socket
import struct
import threading
import time

from harness import SLOW, get_json, http, poll_until, post_json, run_tests, start_sim, wait_http
from proxyutil import (ScriptedUpstream, assert_openai_error, client_requests, exchange,
                       keepalive_race, metric,
                       parse_response, pool, read_until_close, recv_queue, send_queue,
                       serve_replica, serve_until_stream, sim_config, sim_stats, start_proxy,
                       wait_all_admitted)

COMPLETION = {"model": "m1", "prompt": "hello there", "max_tokens": 4, "temperature": 0}


def request_bytes(obj, path="/v1/completions"):
    body = json.dumps(obj).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (path.encode(), len(body))) + body


# No periodic re-attestation during a test (a failed connection still triggers one at once):
# the sim's counters and connections then only move for the traffic a test makes.
QUIET = {"interval_ms": 600000}


# These tests follow one data plane's upstream keep-alive pool and round-robin order, which are
# per worker (docs/configuration.md `workers`): with several, the request that "reuses the pooled connection"
# may land on a worker that has none. So they run one worker; test_workers.py covers several.
ONE_WORKER = 1


def setup(*sim_flags, limits=None, n=1, **poolkw):
    sims = [start_sim("--model", "m1", *sim_flags) for _ in range(n)]
    px = start_proxy(pools=[pool("p", ["m1"], sims, **poolkw)], limits=limits, attestation=QUIET,
                     workers=ONE_WORKER)
    wait_all_admitted(px)  # round robin order and retries on "the other" need every replica
    return sims, px


def upstream_errors(px, replica_name, kind):
    return metric(px, "detproxy_upstream_errors_total", pool="p", replica=replica_name,
                  kind=kind)


def assert_serves_next(px, model="m1"):
    # A failed connection sends the replica back to pending until re-attested (docs/attestation.md, "Replica states").
    wait_http(px.admin_port, "/readyz", timeout=5)
    r = post_json(px.port, "/v1/completions", dict(COMPLETION, model=model))
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4, r
    poll_until(lambda: metric(px, "detproxy_connections") == 0 and
               metric(px, "detproxy_inflight_requests") == 0, timeout=5,
               what="proxy connection and in-flight gauges back to 0")
    return r


# ---- a scripted replica ----------------------------------------------------------------------

OK_BODY = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m1",
                      "choices": [{"index": 0, "text": " a b c d", "logprobs": None,
                                   "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 2, "completion_tokens": 4,
                                "total_tokens": 6}}).encode()
OK_RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
               % len(OK_BODY)) + OK_BODY


def start_scripted(script, limits=None):
    up = ScriptedUpstream(script)
    px = start_proxy(pools=[{"name": "p", "models": ["m1"],
                             "replicas": [{"name": "r1",
                                           "url": "http://127.0.0.1:%d" % up.port}]}],
                     limits=limits, attestation=QUIET, workers=ONE_WORKER)
    return up, px


# ---- a replica that dies mid-response ------------------------------------------------------


def test_replica_dies_mid_stream_client_sees_no_final_chunk():
    """die_mid_stream: head and three tokens, then the replica hangs up. The client's chunked
    response ends without its terminating 0-chunk, on a closed connection: an error, never a
    clean truncated success."""
    sims, px = setup()
    sim_config(sims[0], fault="die_mid_stream", fault_count=1)
    out, closed = exchange(px.port, request_bytes(dict(COMPLETION, max_tokens=50, stream=True)),
                           timeout=10)
    assert closed, "connection left open"
    r = parse_response(out)
    assert r.status == 200 and r.headers.get("transfer-encoding") == "chunked", r
    assert b"data: {" in r.body, r.body[:300]
    assert not r.complete, "the truncated stream ended cleanly: %r" % out[-200:]
    assert not out.endswith(b"0\r\n\r\n"), out[-100:]
    assert b"[DONE]" not in r.body
    assert upstream_errors(px, "r1", "truncated") == 1
    assert len(client_requests(sims[0])) == 1  # never retried once bytes reached the client
    assert_serves_next(px)
    px.stop()


def test_an_event_cut_inside_its_fingerprint_goes_out_as_it_came_before_the_error_event():
    """The replica's stream breaks off (FIN without the last chunk, or a reset) inside the
    system_fingerprint key or value of an event, which the rewriter holds: the held bytes go to
    the client as they came, then the error event, as at a clean end (docs/policy.md, "SSE").
    They were dropped, and the client's last event lost its start."""
    first = b'data: {"a":1}\n\n'
    state = {}

    def serve(c):
        if not serve_until_stream(c):
            return
        data = first + state["tail"]
        c.sendall(b"%x\r\n%s\r\n" % (len(data), data))
        state["seen"].wait(10 * SLOW)  # the client has the first event: the tail was read too
        if state["cut"] == "reset":
            c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        else:
            c.shutdown(socket.SHUT_WR)
        c.close()
    ls, p = serve_replica(serve)
    px = start_proxy(pools=[p], attestation=QUIET, workers=ONE_WORKER)
    body = json.dumps({"model": "m1", "prompt": "x", "stream": True}).encode()
    for tail in (b'data: {"system_finger', b'data: {"system_fingerprint":"fp_rep'):
        for cut in ("fin", "reset"):
            state.update(tail=tail, cut=cut, seen=threading.Event())
            with socket.create_connection(("127.0.0.1", px.port), timeout=10 * SLOW) as c:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                          % (len(body), body))
                out = b""
                while first not in out:
                    piece = c.recv(65536)
                    assert piece, out
                    out += piece
                state["seen"].set()
                rest, closed = read_until_close(c, 10)
            r = parse_response(out + rest)
            assert closed and not r.complete, (tail, cut, r.raw[-200:])
            after = r.body.split(first, 1)[1]
            assert after.startswith(tail + b'\n\ndata: {"error":'), (tail, cut, after[:200])
    ls.close()
    px.stop()


def test_a_client_not_reading_an_aborted_stream_is_still_cut_off():
    """The replica streams to a client that reads nothing, until the kernel holds all it will
    of the answer and detproxy starts queueing the rest itself; then the replica resets. The
    cut answer's queued bytes still go out, but a client that never takes them must not hold
    the connection: client_idle_timeout_ms (3 s here) ends it as it ends any answer."""
    ev = b'data: {"choices":[{"index":0,"text":"' + b"a" * 200 + b'"}]}\n\n'
    chunk = b"%x\r\n" % len(ev) + ev + b"\r\n"
    piece = chunk * (8192 // len(chunk))
    more, taken, last = threading.Semaphore(0), threading.Semaphore(0), threading.Event()
    up = {}

    def handle(c):
        if not serve_until_stream(c):
            return
        up["detproxy"], up["replica"] = c.getpeername()[1], c.getsockname()[1]
        while True:  # one piece per turn of the test's loop, so detproxy never queues many
            more.acquire()
            c.sendall(piece)
            taken.release()
            if last.is_set():
                break
        # The last piece is in detproxy's own queue, under its high-water mark: detproxy still
        # reads the replica and sees the reset.
        poll_until(lambda: not recv_queue(up["detproxy"], up["replica"]), timeout=10,
                   interval=0.005, what="detproxy reading the last piece")
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c.close()

    ls, replica_pool = serve_replica(handle)
    px = start_proxy(pools=[replica_pool], limits={"client_idle_timeout_ms": 3000},
                     attestation=QUIET, workers=ONE_WORKER)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", px.port))
    s.sendall(request_bytes(dict(COMPLETION, max_tokens=50, stream=True)))
    s.settimeout(10)
    assert s.recv(100).startswith(b"HTTP/1.1 200")  # and nothing read from here on
    me = s.getsockname()[1]
    # Piece by piece: once detproxy has read one, it either grows the kernel's send queue to
    # the client or, the queue being full, stays in detproxy's own.
    for _ in range(1000):
        before = send_queue(px.port, me)
        more.release()
        assert taken.acquire(timeout=10 * SLOW)
        poll_until(lambda: not recv_queue(up["detproxy"], up["replica"]), timeout=10,
                   interval=0.005, what="detproxy reading the piece")
        moved = time.monotonic() + 1.0 * SLOW
        while time.monotonic() < moved and send_queue(px.port, me) == before:
            time.sleep(0.005)
        if send_queue(px.port, me) == before:
            break
    else:
        raise AssertionError("the client's send queue never filled")
    last.set()
    more.release()
    px.wait_log("upstream_error", timeout=5)
    poll_until(lambda: metric(px, "detproxy_connections") == 0, timeout=15 * SLOW,
               what="the connection of a client not reading a cut answer closed")
    s.close()
    ls.close()
    px.stop()


def test_replica_dies_mid_non_streamed_response():
    """Non-streamed: the replica announces the whole Content-Length and sends half. The
    client gets either a 502 (nothing sent yet) or a response shorter than its own
    Content-Length on a closed connection: never a complete 200."""
    sims, px = setup()
    sim_config(sims[0], fault="die_mid_stream", fault_count=1)
    data = request_bytes(dict(COMPLETION, max_tokens=50))
    data = data.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    out, closed = exchange(px.port, data, timeout=10)
    assert closed
    r = parse_response(out)
    if r.status == 502:
        assert_openai_error(r, 502, "upstream_error")
    else:
        assert r.status == 200 and "content-length" in r.headers and not r.complete, r
    assert upstream_errors(px, "r1", "truncated") == 1
    assert len(client_requests(sims[0])) == 1
    assert_serves_next(px)
    px.stop()


# ---- smuggling framing and garbage from the replica ----------------------------------------


def _bad_response_case(fault):
    sims, px = setup()
    assert_serves_next(px)  # leaves a pooled upstream connection
    sim_config(sims[0], fault=fault, fault_count=1)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    err = assert_openai_error(r, 502, "upstream_error")
    assert "protocol" in err["message"], err
    assert upstream_errors(px, "r1", "protocol") == 1
    st = sim_stats(sims[0])
    assert len(client_requests(sims[0])) == 2  # not retried
    assert_serves_next(px)
    # The next request came on a new upstream connection: +1 for it, +1 for the
    # client_requests look-up, +1 for this one.
    st2 = sim_stats(sims[0])
    assert st2["connections_total"] == st["connections_total"] + 3, (st, st2)
    px.stop()


def test_replica_bad_framing_is_502():
    """Content-Length and Transfer-Encoding together in a response: 502, not forwarded."""
    _bad_response_case("bad_framing")


def test_replica_garbage_is_502():
    _bad_response_case("garbage")


def test_bad_framing_on_kept_open_connection_is_not_reused():
    """A replica that answers with smuggling framing and keeps the connection open: 502, and
    the next request goes on a new connection (never after the bad bytes)."""
    smuggle = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
               b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n")

    def script(k, conn_no, req_no):
        return (smuggle if k == 0 else OK_RESPONSE), True

    up, px = start_scripted(script)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert_openai_error(r, 502, "upstream_error")
    r = assert_serves_next(px)
    assert r.json()["choices"][0]["text"] == " a b c d"
    (c0, _, _), (c1, q1, _) = up.requests
    assert c1 != c0 and q1 == 0, up.requests  # a new connection, not the one after bad bytes
    assert upstream_errors(px, "r1", "protocol") == 1
    px.stop()
    up.stop()


SMUGGLING_RESPONSES = [
    # obs-fold hiding a Transfer-Encoding
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Pad: a\r\n Transfer-Encoding: "
    b"chunked\r\nContent-Length: 2\r\n\r\n{}",
    # a bare CR ending a header line
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-A: a\rContent-Length: 2\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    # "\r\n\rX" ending the head
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\rX{}",
    # chunk data not followed by CRLF
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"2\r\n{}XX0\r\n\r\n",
]


def test_replica_smuggling_responses_are_rejected():
    """The four llhttp 8.1 smuggling inputs, from the replica's side: each response is
    refused (a 502, or for the chunk case a response cut off without its end if its head was
    already forwarded), its connection is never reused, and the client never sees the bytes
    after the bad framing."""

    def script(k, conn_no, req_no):
        if k < len(SMUGGLING_RESPONSES):
            return SMUGGLING_RESPONSES[k], True
        return OK_RESPONSE, True

    up, px = start_scripted(script)
    data = request_bytes(COMPLETION).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
    for i in range(len(SMUGGLING_RESPONSES)):
        out, closed = exchange(px.port, data, timeout=10)
        assert closed
        r = parse_response(out)
        if r.status == 502:
            assert_openai_error(r, 502, "upstream_error")
        else:
            assert i == 3 and r.status == 200 and not r.complete, (i, r)
        assert b"XX" not in out and b"X{}" not in out, out
    assert upstream_errors(px, "r1", "protocol") == len(SMUGGLING_RESPONSES)
    conns = [c for c, _, _ in up.requests]
    assert len(set(conns)) == len(conns), up.requests  # every bad connection dropped
    r = assert_serves_next(px)
    assert up.requests[-1][0] not in conns
    px.stop()
    up.stop()


def test_bytes_after_response_make_connection_unusable():
    """A response followed by a smuggled second response on the same connection: the client
    gets the first, the next request never sees the smuggled one (new connection)."""
    fake = b'{"smuggled":true}'
    extra = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
             % len(fake)) + fake

    def script(k, conn_no, req_no):
        return (OK_RESPONSE + extra if k == 0 else OK_RESPONSE), True

    up, px = start_scripted(script)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 4, r
    for _ in range(3):
        r = assert_serves_next(px)
        assert b"smuggled" not in r.body
    first = up.requests[0][0]
    assert all(c != first for c, _, _ in up.requests[1:]), up.requests  # never that conn again
    px.stop()
    up.stop()


# ---- a replica that never answers or stalls ------------------------------------------------


def test_replica_hang_is_504_within_first_byte_timeout():
    sims, px = setup(limits={"upstream_first_byte_timeout_ms": 800})
    sim_config(sims[0], fault="hang", fault_count=1)
    open_before = sim_stats(sims[0])["connections"]
    t0 = time.monotonic()
    r = post_json(px.port, "/v1/completions", COMPLETION)
    took = time.monotonic() - t0
    assert_openai_error(r, 504, "upstream_timeout")
    assert 0.75 <= took <= 0.8 + 0.7 * SLOW, took
    st = sim_stats(sims[0])
    assert st["hung"] == 1 and len(client_requests(sims[0])) == 1, st  # not retried
    assert upstream_errors(px, "r1", "first_byte_timeout") == 1
    # The hung upstream connection was closed by the proxy (the sim saw its client leave).
    poll_until(lambda: sim_stats(sims[0])["connections"] <= open_before, timeout=2,
               what="hung connection closed")
    assert_serves_next(px)
    px.stop()


def test_replica_that_stops_reading_the_upload_is_504_within_idle_timeout():
    """A replica that stops taking a request's bytes before it answers (hung, or its reader
    stuck) is given up on after upstream_idle_timeout_ms, as nginx's proxy_send_timeout does:
    the first-byte timeout (10 minutes by default) is for generations, not for uploads nobody
    reads. The 24 MB prompt is more than the kernel's buffers on both sides hold."""
    up = ScriptedUpstream(lambda k, c, q: (OK_RESPONSE, True), read_bodies=False)
    px = start_proxy(pools=[{"name": "p", "models": ["m1"],
                             "replicas": [{"name": "r1",
                                           "url": "http://127.0.0.1:%d" % up.port}]}],
                     attestation=QUIET, workers=ONE_WORKER,
                     limits={"upstream_idle_timeout_ms": 800,
                             "upstream_first_byte_timeout_ms": 60000,
                             "max_body_bytes": 32 << 20})
    t0 = time.monotonic()
    r = post_json(px.port, "/v1/completions", dict(COMPLETION, prompt="x" * (24 << 20)),
                  timeout=30)
    took = time.monotonic() - t0
    assert_openai_error(r, 504, "upstream_timeout")
    assert b"took none of the request" in r.body, r.body
    assert 0.75 <= took <= 2 * 0.8 + 2 * SLOW, took
    assert upstream_errors(px, "r1", "send_timeout") == 1
    assert upstream_errors(px, "r1", "first_byte_timeout") == 0
    poll_until(lambda: up.peer_closed(0), timeout=5, what="the stalled connection closed")
    px.stop()
    up.stop()


def test_replica_stalls_mid_stream_is_cut_after_idle_timeout():
    """A stream that starts and then goes silent (first token 5 s away) is cut after
    upstream_idle_timeout_ms: no final chunk for the client, the generation is cancelled."""
    sims, px = setup("--token-delay-ms", "5000", limits={"upstream_idle_timeout_ms": 600})
    t0 = time.monotonic()
    out, closed = exchange(px.port, request_bytes(dict(COMPLETION, stream=True)), timeout=10)
    took = time.monotonic() - t0
    assert closed
    r = parse_response(out)
    assert r.status == 200 and not r.complete, r
    assert 0.55 <= took <= 0.6 + 0.7 * SLOW, took
    assert upstream_errors(px, "r1", "idle_timeout") == 1
    st = poll_until(lambda: (lambda st: st if st["inflight"] == 0 else None)(
        sim_stats(sims[0])), timeout=2, what="generation cancelled")
    assert st["aborted"] == 1, st
    sim_config(sims[0], token_delay_ms=0)
    assert_serves_next(px)
    px.stop()


# ---- refused connections -------------------------------------------------------------------


def test_refused_replica_is_retried_on_the_other():
    """An admitted replica goes away (its port now refuses connections): the request sent
    there is retried on the other replica (nothing was sent), every client gets a 200, and the
    dead one is taken out of rotation until it attests again."""
    sims, px = setup(n=2, balance="round_robin")
    sims[0].stop()
    for _ in range(4):
        r = post_json(px.port, "/v1/completions", COMPLETION)
        assert r.status == 200, r
        assert r.headers["x-detproxy-replica"] == "r2"
    # Then r1 is no longer picked: the worker that saw the failed connect marks it suspect at
    # once (px.h), before the control thread has taken it out of rotation.
    assert upstream_errors(px, "r1", "connect") == 1
    assert len(client_requests(sims[1])) == 4
    px.stop()


def test_only_replica_refusing_connections():
    """The pool's only replica goes away: the connect failure leaves nothing to retry on, the
    client gets an OpenAI-shaped error at once (502 for the failed replica, or 503 naming it
    now that it is being re-attested). When the replica is back on its port, it is re-admitted
    and serves again."""
    sims, px = setup()
    port = sims[0].port
    sims[0].stop()
    t0 = time.monotonic()
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert time.monotonic() - t0 < 2 * SLOW
    if r.status == 503:
        err = assert_openai_error(r, 503, "no_attested_replica")
        assert r.headers["x-detproxy-request-id"] in err["message"], err
    else:
        assert_openai_error(r, 502, "upstream_error")
    assert upstream_errors(px, "r1", "connect") >= 1
    back = start_sim("--model", "m1", listen="127.0.0.1:%d" % port)
    assert_serves_next(px)
    assert len(client_requests(back)) == 1
    px.stop()


# ---- the keep-alive race -------------------------------------------------------------------


def test_a_reused_connection_the_replica_took_the_request_on_then_closed_is_not_retried():
    """A pooled connection the replica closes after it took the request (its TCP acknowledged
    every byte), before any response byte: the replica may be running it still (an engine
    behind a proxy that cut only this side), so a copy sent elsewhere or again would be a
    second generation. 502, and each replica saw the request at most once."""
    sims, px = setup(n=2, balance="round_robin")
    for _ in range(2):  # r1 then r2: each has a pooled connection; the next pick is r1
        assert post_json(px.port, "/v1/completions", COMPLETION).status == 200
    sim_config(sims[0], fault="close_before_response", fault_count=1)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert_openai_error(r, 502, "upstream_error")
    assert sim_stats(sims[0])["faults_injected"] == 1
    assert len(client_requests(sims[0])) == 2 and len(client_requests(sims[1])) == 1
    assert upstream_errors(px, "r1", "closed") == 1
    assert upstream_errors(px, "r1", "reused_closed") == 0
    assert_serves_next(px)
    px.stop()


SSE_PART = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" +
            b"%x\r\n" % len(b'data: {"choices":[{"text":" a"}]}\n\n') +
            b'data: {"choices":[{"text":" a"}]}\n\n\r\n')


def open_stream(px):
    """A streamed completion sent on a socket of its own, for a client that leaves early."""
    c = socket.create_connection(("127.0.0.1", px.port), timeout=10 * SLOW)
    c.sendall(request_bytes(dict(COMPLETION, stream=True)))
    return c


def noting(times, nth, answer):
    """A script answering request nth with `answer` ((bytes, keep_open)) and the others with
    OK_RESPONSE, noting in times when each arrived."""
    def script(k, conn_no, req_no):
        times[k] = time.monotonic()
        return answer if k == nth else (OK_RESPONSE, True)
    return script


def single_sequence_scripted(script, hold_s, idle_ms=None):
    up = ScriptedUpstream(script)
    idle_ms = int(hold_s * 1000) if idle_ms is None else idle_ms
    px = start_proxy(pools=[{"name": "p", "models": ["m1"],
                             "manifest": {"determinism": {"mode": "single_sequence"}},
                             "replicas": [{"name": "r1",
                                           "url": "http://127.0.0.1:%d" % up.port}]}],
                     attestation=QUIET, workers=ONE_WORKER,
                     limits={"upstream_first_byte_timeout_ms": int(hold_s * 1000),
                             "upstream_idle_timeout_ms": idle_ms})
    wait_all_admitted(px)
    return up, px


def test_on_a_single_sequence_pool_the_slot_stays_held_after_the_replica_closed_on_a_request():
    """The replica took a whole request and closed without a byte of answer: its engine may be
    generating it still, and no exchange is left to say when it stops. On a single-sequence pool
    the slot is kept as long as a drain would keep it (the longer of the first-byte and idle
    timeouts), so the next request does not run beside it; then it goes on."""
    hold_s = 1.0
    times = {}
    up, px = single_sequence_scripted(noting(times, 1, (b"", False)), hold_s)
    assert post_json(px.port, "/v1/completions", COMPLETION).status == 200
    r = post_json(px.port, "/v1/completions", COMPLETION)  # taken, then the close
    assert_openai_error(r, 502, "upstream_error")
    assert upstream_errors(px, "r1", "closed") == 1
    r = post_json(px.port, "/v1/completions", COMPLETION, timeout=10 * SLOW)
    assert r.status == 200, r
    assert len(up.requests) == 3, up.requests
    assert times[2] - times[1] >= 0.9 * hold_s, times  # not beside the one that may still run
    px.stop()
    up.stop()


def test_on_a_single_sequence_pool_an_answer_cut_short_keeps_the_slot():
    """The replica starts an answer and cuts it (a FIN mid-stream): its engine may be
    generating on, as after a close before any answer, so the slot is kept as long as a drain
    would keep it and the next request does not run beside it."""
    hold_s = 1.0
    times = {}
    up, px = single_sequence_scripted(noting(times, 0, (SSE_PART, False)), hold_s)
    c = open_stream(px)
    got, closed = read_until_close(c)
    c.close()
    assert closed and got.startswith(b"HTTP/1.1 200") and not got.endswith(b"0\r\n\r\n"), got
    assert upstream_errors(px, "r1", "truncated") == 1
    r = post_json(px.port, "/v1/completions", COMPLETION, timeout=10 * SLOW)
    assert r.status == 200, r
    assert times[1] - times[0] >= 0.9 * hold_s, times
    px.stop()
    up.stop()


def test_on_a_single_sequence_pool_a_drain_the_replica_cuts_keeps_the_slot():
    """The client leaves a stream; detproxy drains the answer to keep the engine's one slot
    until it ends. The replica (a proxy in front of the engine) then cuts the connection: that
    says nothing of the engine, so the slot stays kept for the rest of the drain's time, and
    the next request reaches the replica only after it."""
    hold_s = 1.5
    times = {}
    up, px = single_sequence_scripted(noting(times, 0, (SSE_PART, True)), hold_s)
    c = open_stream(px)
    assert c.recv(4096).startswith(b"HTTP/1.1 200")
    t_left = time.monotonic()
    c.close()  # the client leaves: the answer is drained
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 0, timeout=5 * SLOW,
               what="the request over, its answer drained")
    up.close_conn(up.requests[0][0])  # the replica cuts the drained answer
    r = post_json(px.port, "/v1/completions", COMPLETION, timeout=10 * SLOW)
    assert r.status == 200, r
    assert times[1] - t_left >= 0.9 * hold_s, (times[1] - t_left)
    assert metric(px, "detproxy_slot_drains_total", end="cut") == 1
    px.stop()
    up.stop()


def test_on_a_single_sequence_pool_an_answer_silent_past_the_idle_timeout_is_drained():
    """A stream's head at once and its next event only after a long prefill (llama.cpp does
    that): past upstream_idle_timeout_ms the client's stream is cut, as before, but the answer
    is drained instead of the connection closed, so the engine's one slot is free the moment
    the answer ends: not before (no second sequence beside it) and not a whole drain's time
    later (a slot held blind)."""
    hold_s = 6.0
    times = {}
    up, px = single_sequence_scripted(noting(times, 0, (SSE_PART, True)), hold_s, idle_ms=300)
    c = open_stream(px)
    got, closed = read_until_close(c)  # cut at the idle timeout
    c.close()
    assert closed and got.startswith(b"HTTP/1.1 200"), got
    assert upstream_errors(px, "r1", "idle_timeout") == 1
    out = {}
    t = threading.Thread(target=lambda: out.setdefault(
        "r", post_json(px.port, "/v1/completions", COMPLETION, timeout=20 * SLOW)))
    t.start()
    time.sleep(0.5)  # what is measured: the next request waits while the answer goes on
    rest = b'data: [DONE]\n\n'
    with up.lock:
        s0 = up.socks[up.requests[0][0]]
    t_end = time.monotonic()
    s0.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest), rest))
    t.join(20 * SLOW)
    assert out["r"].status == 200, out
    assert t_end <= times[1] < t_end + hold_s / 3, (times[1] - t_end)
    px.stop()
    up.stop()


def test_on_a_single_sequence_pool_an_answer_ended_only_by_its_close_is_refused_and_keeps_the_slot():
    """An answer with neither Content-Length nor chunked framing ends where its connection
    closes, so a proxy in front of the engine that cuts it leaves what looks like a whole
    answer while the engine generates on. On a single-sequence pool such an answer is refused
    (502, not passed on as if whole) and the slot is kept as long as a drain would keep it."""
    hold_s = 1.0
    times = {}
    cut = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
           b'{"id":"cmpl-1","choices":[{')
    up, px = single_sequence_scripted(noting(times, 0, (cut, False)), hold_s)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert_openai_error(r, 502, "upstream_error")
    assert upstream_errors(px, "r1", "protocol") == 1
    r = post_json(px.port, "/v1/completions", COMPLETION, timeout=10 * SLOW)
    assert r.status == 200, r
    assert times[1] - times[0] >= 0.9 * hold_s, times
    px.stop()
    up.stop()


def test_on_a_single_sequence_pool_an_answer_refused_on_its_head_is_drained_not_held_blind():
    """A whole answer detproxy will not pass on (its Content-Type is not application/json):
    the client gets 502, and the answer is read to its end, so the engine's one slot is free
    the moment it ends, not kept blind for a drain's whole time."""
    hold_s = 6.0
    times = {}
    html = b"<html>not json</html>"
    refused = (b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: %d\r\n\r\n%s"
               % (len(html), html))
    up, px = single_sequence_scripted(noting(times, 0, (refused, True)), hold_s)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert_openai_error(r, 502, "upstream_error")
    assert "not application/json" in r.json()["error"]["message"], r.json()
    r = post_json(px.port, "/v1/completions", COMPLETION, timeout=10 * SLOW)
    assert r.status == 200, r
    assert times[1] - times[0] < hold_s / 3, times
    px.stop()
    up.stop()


def test_on_a_single_sequence_pool_a_relayed_answer_over_its_cap_is_drained_not_held_blind():
    """An admin relay whose answer is larger than the relay's 16 MiB cap: its caller gets 502
    at once, and the rest of the answer is read to its end and dropped, so the engine's one
    slot is free the moment it ends, not kept blind for a drain's whole time."""
    hold_s = 6.0
    times = {}
    big = b"x" * ((16 << 20) + 1)
    over = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(big)) + big
    up, px = single_sequence_scripted(noting(times, 0, (over, True)), hold_s)
    r = http("POST", px.admin_port, "/admin/relay/v1/completions", body=json.dumps(COMPLETION),
             headers={"x-detproxy-relay-pool": "p", "x-detproxy-relay-replica": "r1",
                      "content-type": "application/json"}, timeout=10 * SLOW)
    assert r.status == 502 and r.json()["error"]["code"] == "replica_error", r
    assert "larger than 16777216 bytes" in r.json()["error"]["message"], r.json()
    r = post_json(px.port, "/v1/completions", COMPLETION, timeout=10 * SLOW)
    assert r.status == 200, r
    assert times[1] - times[0] < hold_s / 3, times
    assert ("closed" not in [w for _, w in up.events]), up.events  # read whole, not cut
    px.stop()
    up.stop()


def answer(k, conn_no, req_no):
    return OK_RESPONSE, True


def test_the_keepalive_race_is_retried_on_a_new_connection():
    """The replica's idle timeout closes the pooled connection as a request goes out on it:
    its TCP took none of the request, so it cannot have begun it. Retried once, over a new
    connection (the pool's others may be as stale), and the client gets a 200."""
    up, px = start_scripted(answer)
    # When the proxy sees the close only once the request is written (a slow wake-up, as under
    # ASan), the replica may have begun it: a 502 (`closed`), rightly not retried. The race
    # is then made again on a new pooled connection.
    for _ in range(5):
        assert post_json(px.port, "/v1/completions", COMPLETION).status == 200
        pooled = up.requests[-1][0]
        sent = len(up.requests)
        status, hdrs, body = keepalive_race(px, lambda: up.close_conn(pooled), "POST",
                                            "/v1/completions", COMPLETION)
        if status != 502 or upstream_errors(px, "r1", "reused_closed") != 0:
            break
    assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4, (status, body)
    assert len(up.requests) == sent + 1 and up.requests[-1][0] != pooled and \
        up.requests[-1][1] == 0, up.requests
    assert upstream_errors(px, "r1", "reused_closed") == 1
    px.stop()
    up.stop()


def test_a_pooled_connection_idle_past_its_keepalive_is_closed_not_reused():
    """detproxy closes a pooled connection once it has idled upstream_keepalive_timeout_ms,
    before an engine's own keep-alive timeout would: so no request is ever sent on one the
    engine may be closing (the race above). Its own close holds nothing (the replica stays
    admitted); the next request goes over a new connection."""
    keepalive_ms = int(1000 * SLOW)  # the second request comes within it however slow the box
    up, px = start_scripted(answer, limits={"upstream_keepalive_timeout_ms": keepalive_ms})
    assert post_json(px.port, "/v1/completions", COMPLETION).status == 200
    assert post_json(px.port, "/v1/completions", COMPLETION).status == 200
    t_idle = time.monotonic()
    pooled = up.requests[-1][0]
    assert [q[0] for q in up.requests] == [pooled, pooled], up.requests  # reused within it
    poll_until(lambda: (pooled, "closed") in up.events, timeout=10,
               what="detproxy closing its pooled connection at its keep-alive timeout")
    assert time.monotonic() - t_idle >= 0.9 * keepalive_ms / 1000.0
    replicas = {x["name"]: x for x in get_json(px.admin_port, "/admin/replicas")["replicas"]}
    assert replicas["r1"]["state"] == "admitted", replicas["r1"]
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert r.status == 200, r
    assert len(up.requests) == 3 and up.requests[2][0] != pooled, up.requests
    assert upstream_errors(px, "r1", "reused_closed") == 0
    assert upstream_errors(px, "r1", "closed") == 0
    px.stop()
    up.stop()


def test_a_retry_to_another_replica_goes_over_a_new_connection_too():
    """The retry of a request that met the keep-alive race on r1 goes to r2 over a new
    connection rather than r2's pooled one, which may be as stale (a fleet of replicas with
    the same idle timeout)."""
    ups = [ScriptedUpstream(answer) for _ in range(2)]
    px = start_proxy(pools=[{"name": "p", "models": ["m1"], "balance": "round_robin",
                             "replicas": [{"name": "r%d" % (i + 1),
                                           "url": "http://127.0.0.1:%d" % u.port}
                                          for i, u in enumerate(ups)]}],
                     attestation=QUIET, workers=ONE_WORKER)
    wait_all_admitted(px)
    for _ in range(2):  # r1 then r2, each over a new connection, then pooled
        assert post_json(px.port, "/v1/completions", COMPLETION).status == 200
    assert [len(u.requests) for u in ups] == [1, 1]
    status, hdrs, body = keepalive_race(px, lambda: ups[0].close_conn(ups[0].requests[0][0]),
                                        "POST", "/v1/completions", COMPLETION)
    assert status == 200 and hdrs["x-detproxy-replica"] == "r2", (status, hdrs)
    assert len(ups[0].requests) == 1, ups[0].requests
    (c0, _, _), (c1, q1, _) = ups[1].requests
    assert q1 == 0 and c1 != c0, ups[1].requests  # a new connection, not the pooled one
    assert upstream_errors(px, "r1", "reused_closed") == 1
    assert upstream_errors(px, "r2", "reused_closed") == 0
    px.stop()
    for u in ups:
        u.stop()


def test_a_pass_through_body_held_whole_is_retried_a_streamed_one_is_not():
    """A pass-through POST whose body is up to 64 KiB long is held whole before it leaves, so
    the keep-alive race under it is retried over a new connection. A longer body streams
    through: its bytes that left are gone, and the same race is a 502."""
    up, px = start_scripted(answer)
    assert_serves_next(px)  # a connection in the pool
    pooled = up.requests[-1][0]
    small = json.dumps({"content": "hello"}).encode()
    big = json.dumps({"content": "x" * (64 * 1024)}).encode()
    status, _, _ = keepalive_race(px, lambda: up.close_conn(pooled), "POST", "/tokenize", small)
    assert status == 200
    assert len(up.requests) == 2 and up.requests[1][0] != pooled and up.requests[1][1] == 0, \
        up.requests
    assert upstream_errors(px, "r1", "reused_closed") == 1
    # The long body: when the proxy happens to see the replica's close before it starts to
    # forward (the body's read and the close in one wake-up), there is no race to lose, and a
    # new connection serves it; the race is then made again on that connection.
    for _ in range(5):
        fresh = up.requests[-1][0]
        sent = len(up.requests)
        errors = sum(upstream_errors(px, "r1", k) for k in ("reused_closed", "send", "closed"))
        status, _, body = keepalive_race(px, lambda: up.close_conn(fresh), "POST", "/tokenize",
                                         big)
        if status != 200:
            break
        now = sum(upstream_errors(px, "r1", k) for k in ("reused_closed", "send", "closed"))
        assert now == errors, "a 200 after the race: the streamed body was sent again"
    assert status == 502 and b"upstream_error" in body, (status, body)
    # met as the race (reused_closed), as a write that failed midway (send), or, when the whole
    # body had reached the kernel before the replica's reset was seen, as `closed`: not sent
    # again, whichever
    assert len(up.requests) == sent, up.requests
    kinds = {k: upstream_errors(px, "r1", k) for k in ("reused_closed", "send", "closed")}
    assert sum(kinds.values()) == errors + 1 and kinds["reused_closed"] >= 1, kinds
    px.stop()
    up.stop()


def test_fresh_connection_closed_before_response_is_502_not_retried():
    """The same close on a fresh connection is not the keep-alive race: the replica may have
    started the work, so no retry (the request is not idempotent): 502."""
    sims, px = setup()
    sim_config(sims[0], fault="close_before_response", fault_count=1)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert_openai_error(r, 502, "upstream_error")
    assert len(client_requests(sims[0])) == 1
    assert upstream_errors(px, "r1", "closed") == 1
    assert_serves_next(px)
    px.stop()


def test_reused_connection_closed_after_a_response_byte_is_not_retried():
    """A pooled connection that dies after the first bytes of a status line: a response byte
    was seen, so no retry: 502, and the replica saw the request exactly once."""

    def script(k, conn_no, req_no):
        if k == 1:
            return b"HTTP/1.1 200 OK\r\nConte", False
        return OK_RESPONSE, True

    up, px = start_scripted(script)
    assert_serves_next(px)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert_openai_error(r, 502, "upstream_error")
    (c0, q0, _), (c1, q1, _) = up.requests
    assert c1 == c0 and q1 == 1, up.requests  # it was the reused connection
    assert upstream_errors(px, "r1", "truncated") == 1
    assert_serves_next(px)
    assert len(up.requests) == 3 and up.requests[2][0] != c0, up.requests  # no retry before
    px.stop()
    up.stop()


def test_replica_restart_drops_pooled_connections():
    """The replica restarts on the same port: its pooled connections are gone. The next
    request still succeeds, at worst after a keep-alive-race retry, never a 502."""
    sims, px = setup()
    port = sims[0].port
    assert_serves_next(px)
    sims[0].stop()
    sim2 = start_sim("--model", "m1", listen="127.0.0.1:%d" % port)
    for _ in range(3):
        assert_serves_next(px)
    assert len(client_requests(sim2)) == 3
    assert upstream_errors(px, "r1", "connect") == 0
    assert upstream_errors(px, "r1", "reused_closed") <= 1
    px.stop()


# ---- a replica answering 500 ---------------------------------------------------------------


def test_replica_500_is_passed_on_not_retried():
    sims, px = setup()
    sim_config(sims[0], fault="error_500", fault_count=1)
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert r.status == 500, r
    assert r.json()["error"]["message"] == "simulated replica failure"
    assert r.headers["x-detproxy-replica"] == "r1"
    assert len(client_requests(sims[0])) == 1
    total = sum(metric(px, "detproxy_requests_total", pool="p", tenant=t, status="500")
                for t in ("-", "default"))
    assert total == 1
    assert_serves_next(px)
    px.stop()


def test_a_head_and_a_broken_body_in_one_read_get_a_502_not_nothing():
    """The replica's head and a malformed body arrive together: detproxy had the head ready
    for the client but had not written it when the body failed. The client gets a 502 in
    OpenAI's shape, not a closed connection with no answer at all; a non-2xx answer (passed
    through unread) the same."""
    heads = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
             b"transfer-encoding: chunked\r\n\r\nzz\r\n",
             b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\n"
             b"transfer-encoding: chunked\r\n\r\n5;a=1\x01\r\n")
    up, px = start_scripted(lambda k, conn, req: (heads[k % 2], False))
    for stream in (True, False):
        r = post_json(px.port, "/v1/completions", dict(COMPLETION, stream=stream))
        assert_openai_error(r, 502, "upstream_error")
    assert upstream_errors(px, "r1", "protocol") == 2
    px.stop()


# ---- an answer detproxy cannot read ----------------------------------------------------------


def test_an_answer_detproxy_cannot_read_is_refused_502():
    """An inference answer is rewritten and checked in JSON or in an event stream, the one the
    request asked for: a coded body, or another type, would carry its own system_fingerprint to
    the client unchecked. It is refused 502 before a byte reaches the client, and detproxy asks
    for uncoded answers whatever the client accepts."""
    sims, px = setup()
    for fault, why in (("coded", "Content-Encoding"), ("wrong_type", "Content-Type")):
        for stream in (False, True):
            sim_config(sims[0], fault=fault, fault_count=1)
            r = post_json(px.port, "/v1/completions", dict(COMPLETION, stream=stream))
            err = assert_openai_error(r, 502, "upstream_error")
            assert why in err["message"] and "fp_unchecked" not in r.body.decode(), (fault, err)
    assert upstream_errors(px, "r1", "protocol") == 4
    r = post_json(px.port, "/v1/completions", COMPLETION, headers={"accept-encoding": "gzip, br"})
    assert r.status == 200, r
    assert client_requests(sims[0])[-1]["headers"]["accept-encoding"] == "identity"
    px.stop()


def test_an_answer_with_two_content_types_is_refused_502():
    """detproxy reads the first Content-Type; a client may read the other. Either way the answer
    would pass unchecked by one of them: it is refused."""
    for stream, types in ((False, (b"text/plain", b"application/json")),
                          (True, (b"text/plain", b"text/event-stream")),
                          (False, (b"application/json", b"text/plain")),
                          (False, (b"application/json, text/html",)),
                          (True, (b"text/event-stream, application/json",))):
        resp = (b"HTTP/1.1 200 OK\r\n" + b"".join(b"Content-Type: %s\r\n" % t for t in types) +
                b"Content-Length: %d\r\n\r\n" % len(OK_BODY) + OK_BODY)
        up, px = start_scripted(lambda k, c, q, resp=resp: (resp, False))
        err = assert_openai_error(post_json(px.port, "/v1/completions",
                                            dict(COMPLETION, stream=stream)), 502, "upstream_error")
        assert "more than one Content-Type" in err["message"], err
        px.stop()


def test_only_the_media_types_themselves_are_read_as_json_or_an_event_stream():
    """`application/jsonx` or `text/event-streamy` are other types, not JSON or a stream with a
    longer name; parameters and case do not matter."""
    for stream, ctype, ok in ((False, b"application/jsonx", False),
                              (False, b"application/json-seq", False),
                              (True, b"text/event-streamy", False),
                              (False, b"Application/JSON; charset=utf-8", True),
                              (True, b"text/event-stream;charset=UTF-8", True)):
        body = OK_BODY if not stream else b'data: {"choices":[]}\n\ndata: [DONE]\n\n'
        resp = (b"HTTP/1.1 200 OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n"
                % (ctype, len(body)) + body)
        up, px = start_scripted(lambda k, c, q, resp=resp: (resp, False))
        r = post_json(px.port, "/v1/completions", dict(COMPLETION, stream=stream))
        if ok:
            assert r.status == 200, (ctype, r)
        else:
            assert_openai_error(r, 502, "upstream_error")
        px.stop()

if __name__ == "__main__":
    run_tests(globals())
