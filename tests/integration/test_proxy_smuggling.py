"""Bad requests at the client listener: request smuggling, framing and header abuse, limits.

Every case sends raw bytes to a real detproxy in front of a real detproxy-sim and checks the
observables a client and the replica see:
  - the status (400, 413 or 431) with an OpenAI-shaped JSON error and `connection: close`,
  - the connection closed by the proxy right after that one response (nothing else sent),
  - nothing forwarded: the sim received no request at all (and, for head-level rejections, not
    even a connection),
  - the proxy still serves the next request, its connection and in-flight gauges return to 0,
    and (under DP_SANITIZE) it stops cleanly.

Debian's llhttp 8.1 accepts the first four inputs (llhttp 9 and nginx reject them); detproxy
validates heads and chunk framing itself (net/validate.c). Each smuggling payload hides
a second request for /smuggled, which must never reach the replica.
"""

import json
import random
import socket
import threading
import time

from harness import SLOW, poll_until, post_json, run_tests, start_sim
from proxyutil import (ScriptedUpstream, assert_openai_error, client_requests, exchange, metric,
                       parse_response, pool, read_until_close, sim_stats, start_proxy)

COMPLETION = {"model": "m1", "prompt": "hello there", "max_tokens": 4, "temperature": 0}
BODY = json.dumps(COMPLETION).encode()
SMUGGLED = b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n"


def post(headers, body=BODY, version=b"1.1", target=b"/v1/completions", method=b"POST"):
    return (method + b" " + target + b" HTTP/" + version + b"\r\n" + headers + b"\r\n" + body)


def cl(body=BODY):
    return b"Content-Length: %d\r\n" % len(body)


def setup(limits=None):
    """A sim and a proxy with it admitted. No periodic re-attestation during the test, so every
    connection the sim sees after this is client traffic (or our own look-ups). Returns (sim,
    proxy, connections_total now, counting this look-up)."""
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], limits=limits,
                     attestation={"interval_ms": 600000})
    return sim, px, sim_stats(sim)["connections_total"]


def assert_serves_next(px, sim, seen_before=0):
    """The proxy answers a good request, the sim saw exactly that one more request (so nothing
    smuggled arrived with it), and the proxy's connection and request gauges drain to 0."""
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert r.status == 200, r
    assert r.json()["usage"]["completion_tokens"] == 4
    seen = client_requests(sim)
    assert len(seen) == seen_before + 1, seen
    assert seen[-1]["path"] == "/v1/completions" and seen[-1]["method"] == "POST", seen[-1]
    assert not any("smuggled" in q["target"] for q in seen), seen
    poll_until(lambda: metric(px, "detproxy_connections") == 0 and
               metric(px, "detproxy_inflight_requests") == 0, timeout=5,
               what="proxy connection and in-flight gauges back to 0")


def assert_nothing_forwarded(sim, conns_before, may_connect=False):
    """No client request reached the sim; unless may_connect, not even a connection: the only
    one since conns_before is this look-up."""
    st = sim_stats(sim)
    assert st["requests"] == 0, st
    if not may_connect:
        assert st["connections_total"] == conns_before + 1, (conns_before, st)
    assert client_requests(sim) == [], client_requests(sim)


def reject(data, status, code, limits=None, may_connect=False, reason=None):
    """Send data on a fresh connection; check the single error response, the close, that
    nothing reached the replica, and that the proxy serves the next request."""
    sim, px, conns = setup(limits)
    out, closed = exchange(px.port, data, timeout=5)
    assert closed, "connection left open after %r" % out[:200]
    r = parse_response(out)
    err = assert_openai_error(r, status, code)
    if reason:
        assert reason in err["message"], err
    assert r.headers.get("connection") == "close", r
    assert r.complete and r.rest == b"", "bytes after the error response: %r" % r.rest[:200]
    assert_nothing_forwarded(sim, conns, may_connect)
    assert_serves_next(px, sim)
    px.stop()
    return err


# ---- the four inputs llhttp 8.1 accepts ----------------------------------------------------

OBS_FOLD = post(b"Host: x\r\nX-Pad: a\r\n Content-Length: %d\r\n" % len(SMUGGLED), SMUGGLED,
                target=b"/health", method=b"GET")
BARE_CR = post(b"Host: x\r\nX-A: a\rContent-Length: 0\r\n" + cl(), BODY)
CR_X_END = b"GET /health HTTP/1.1\r\nHost: x\r\n\rX" + SMUGGLED
CHUNK_NO_CRLF = post(b"Host: x\r\nTransfer-Encoding: chunked\r\n",
                     b"2\r\n{}XX0\r\n\r\n" + SMUGGLED)


def test_smuggling_obs_fold_is_400():
    # CVE-2024-27982: " Content-Length" on a continuation line.
    reject(OBS_FOLD, 400, "bad_request", reason="folding")


def test_smuggling_bare_cr_in_header_value_is_400():
    # CVE-2023-30589: a CR not followed by LF ends a header line in llhttp 8.
    reject(BARE_CR, 400, "bad_request", reason="CR")


def test_smuggling_cr_x_ending_head_is_400():
    # CVE-2025-23167: "\r\n\rX" taken as the end of the head.
    reject(CR_X_END, 400, "bad_request", reason="CR")


def test_smuggling_chunk_data_without_crlf_is_400():
    reject(CHUNK_NO_CRLF, 400, "bad_request", reason="CRLF")


def test_smuggling_chunk_data_without_crlf_pass_through_is_400():
    """A pass-through route streams the body: the head (and the chunk before the bad framing)
    may already be on its way, but the replica never gets a complete request and the upstream
    exchange is cancelled at once."""
    up = ScriptedUpstream(lambda k, c, q: (b"HTTP/1.1 200 OK\r\nContent-Type: application/json"
                                           b"\r\nContent-Length: 2\r\n\r\n{}", True))
    px = start_proxy(pools=[{"name": "p", "models": ["m1"], "replicas": [
        {"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}])
    data = post(b"Host: x\r\nTransfer-Encoding: chunked\r\n", b"2\r\n{}XX0\r\n\r\n" + SMUGGLED,
                target=b"/v1/embeddings")
    out, closed = exchange(px.port, data, timeout=5)
    assert closed
    r = parse_response(out)
    assert_openai_error(r, 400, "bad_request")
    assert r.complete and r.rest == b""
    assert post_json(px.port, "/v1/completions", COMPLETION).status == 200
    # The streamed head may or may not have reached the replica before the bad framing was
    # seen; if it did, that upstream connection is closed at once. The request never
    # completed there, and nothing of /smuggled arrived: the only complete request is the
    # good one.
    conns = [c for c, w in up.events if w == "head:/v1/embeddings"]
    assert len(conns) <= 1, up.events
    for c in conns:
        poll_until(lambda: "closed" in up.conn_events(c), timeout=2,
                   what="upstream connection cancelled")
    assert [h.split(b" ")[1] for _, _, h in up.requests] == [b"/v1/completions"], up.requests
    assert not any("smuggled" in w for _, w in up.events), up.events
    px.stop()
    up.stop()


def test_smuggling_inputs_split_byte_by_byte():
    """The same four inputs, one byte per segment: the scanners keep their state across reads
    (a CR at the end of one read, the byte after it in the next)."""
    sim, px, conns = setup()
    for data in (OBS_FOLD, BARE_CR, CR_X_END, CHUNK_NO_CRLF):
        with socket.create_connection(("127.0.0.1", px.port), timeout=5 * SLOW) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for i in range(len(data)):
                try:
                    s.sendall(data[i:i + 1])
                except (BrokenPipeError, ConnectionResetError):
                    break  # rejected before the end: the rest is moot
                if i % 4 == 3:
                    time.sleep(0.001)  # pacing so the bytes arrive in separate reads
            out, closed = read_until_close(s, timeout=5)
        assert closed
        r = parse_response(out)
        assert_openai_error(r, 400, "bad_request")
        assert r.rest == b"", r
    assert_nothing_forwarded(sim, conns)
    assert_serves_next(px, sim)
    px.stop()


# ---- Content-Length and Transfer-Encoding --------------------------------------------------


def test_content_length_with_transfer_encoding_is_400():
    reject(post(b"Host: x\r\n" + cl() + b"Transfer-Encoding: chunked\r\n",
                b"0\r\n\r\n" + SMUGGLED), 400, "bad_request")


def test_transfer_encoding_then_content_length_is_400():
    reject(post(b"Host: x\r\nTransfer-Encoding: chunked\r\n" + cl(),
                b"0\r\n\r\n" + SMUGGLED), 400, "bad_request")


def test_two_equal_content_lengths_are_400():
    reject(post(b"Host: x\r\n" + cl() + cl()), 400, "bad_request")


def test_two_different_content_lengths_are_400():
    reject(post(b"Host: x\r\n" + cl() + b"Content-Length: 5\r\n"), 400, "bad_request")


def test_content_length_list_is_400():
    reject(post(b"Host: x\r\nContent-Length: %d, %d\r\n" % (len(BODY), len(BODY))), 400,
           "bad_request")


def test_content_length_plus_sign_is_400():
    reject(post(b"Host: x\r\nContent-Length: +5\r\n", b"hello"), 400, "bad_request")


def test_content_length_hex_is_400():
    reject(post(b"Host: x\r\nContent-Length: 0x5\r\n", b"hello"), 400, "bad_request")


def test_content_length_negative_is_400():
    reject(post(b"Host: x\r\nContent-Length: -1\r\n", b""), 400, "bad_request")


def test_content_length_overflow_is_400():
    # 2^64 + 1 wraps to 1 in a careless 64-bit parser.
    reject(post(b"Host: x\r\nContent-Length: 18446744073709551617\r\n", b"x" + SMUGGLED), 400,
           "bad_request")
    reject(post(b"Host: x\r\nContent-Length: 99999999999999999999999999999\r\n", b"x"), 400,
           "bad_request")


def test_chunk_size_overflow_is_400():
    # 2^64 + 0x10 wraps to 16 in a careless parser.
    reject(post(b"Host: x\r\nTransfer-Encoding: chunked\r\n",
                b"10000000000000010\r\n" + b"x" * 16 + b"\r\n0\r\n\r\n"), 400, "bad_request")


def test_chunk_size_plus_sign_and_hex_prefix_are_400():
    reject(post(b"Host: x\r\nTransfer-Encoding: chunked\r\n", b"+2\r\n{}\r\n0\r\n\r\n"), 400,
           "bad_request")
    reject(post(b"Host: x\r\nTransfer-Encoding: chunked\r\n", b"0x2\r\n{}\r\n0\r\n\r\n"), 400,
           "bad_request")


def test_unknown_transfer_encoding_is_400():
    reject(post(b"Host: x\r\nTransfer-Encoding: gzip\r\n", b"0\r\n\r\n"), 400, "bad_request")
    reject(post(b"Host: x\r\nTransfer-Encoding: xchunked\r\n", b"0\r\n\r\n"), 400, "bad_request")


def test_non_final_chunked_transfer_encoding_is_400():
    reject(post(b"Host: x\r\nTransfer-Encoding: chunked, gzip\r\n", b"0\r\n\r\n"), 400,
           "bad_request")
    reject(post(b"Host: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: gzip\r\n",
                b"0\r\n\r\n"), 400, "bad_request")


def test_transfer_encoding_on_http10_is_400():
    reject(post(b"Host: x\r\nTransfer-Encoding: chunked\r\n", b"0\r\n\r\n" + SMUGGLED,
                version=b"1.0"), 400, "bad_request")


# ---- Host, control bytes, upgrades ---------------------------------------------------------


def test_missing_host_is_400():
    reject(post(cl()), 400, "bad_request", reason="Host")


def test_duplicate_host_is_400():
    reject(post(b"Host: a\r\nHost: b\r\n" + cl()), 400, "bad_request", reason="Host")


def test_nul_in_header_name_is_400():
    reject(post(b"Host: x\r\nX-A\x00b: c\r\n" + cl()), 400, "bad_request")


def test_nul_in_header_value_is_400():
    reject(post(b"Host: x\r\nX-A: b\x00c\r\n" + cl()), 400, "bad_request")


def test_ctl_bytes_in_header_name_and_value_are_400():
    reject(post(b"Host: x\r\nX-\x7fA: c\r\n" + cl()), 400, "bad_request")
    reject(post(b"Host: x\r\nX-A: b\x01c\r\n" + cl()), 400, "bad_request")
    reject(post(b"Host: x\r\nX-A: b\x1bc\r\n" + cl()), 400, "bad_request")


def test_whitespace_before_colon_is_400():
    reject(post(b"Host: x\r\nContent-Length : 5\r\n" + cl()), 400, "bad_request")


def test_upgrade_h2c_is_400():
    reject(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
           b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n" + SMUGGLED,
           400, "bad_request", reason="upgrade")


def test_upgrade_websocket_is_400():
    reject(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
           400, "bad_request")


def test_connect_is_400():
    reject(b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: 127.0.0.1:22\r\n\r\n" + SMUGGLED, 400,
           "bad_request", reason="CONNECT")


def test_h2_prior_knowledge_preface_is_400():
    reject(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 400, "bad_request")


# ---- limits --------------------------------------------------------------------------------

SMALL = {"max_headers": 10, "max_header_bytes": 1024, "max_body_bytes": 1000}


def test_more_than_max_headers_is_431():
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(10))  # + Host = 11 > 10
    reject(b"GET /health HTTP/1.1\r\nHost: x\r\n" + many + b"\r\n", 431, "headers_too_large",
           limits=SMALL)


def test_exactly_max_headers_is_accepted():
    """The limit is inclusive: 10 header lines pass (and reach the replica)."""
    sim, px, _ = setup(SMALL)
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(7))  # + Host, Connection, C-L = 10
    out, closed = exchange(px.port, post(b"Host: x\r\n" + many + b"Connection: close\r\n" +
                                         cl()), timeout=5)
    r = parse_response(out)
    assert r.status == 200 and closed, r
    assert sim_stats(sim)["requests"] == 1
    px.stop()


def test_head_over_max_header_bytes_is_431():
    reject(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 1100 + b"\r\n\r\n", 431,
           "headers_too_large", limits=SMALL)


def test_head_over_max_header_bytes_without_end_is_431():
    """A head that never ends is cut off at the limit, not buffered until a timeout."""
    reject(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4000, 431,
           "headers_too_large", limits=SMALL)


def test_a_large_head_answered_from_itself_keeps_the_proxy_sound():
    """max_header_bytes above 64 KiB, and heads that large answered at once from the head
    (the model list; a refused key is the same): such a request is freed with its answer,
    not kept for reuse, and the proxy once wrote into it after (a crash under ASan). Each answer
    comes, the connection serves its next request, and the proxy serves the next client."""
    sim, px, _ = setup({"max_header_bytes": 131072})
    pad = b"X-Pad: " + b"a" * 70000 + b"\r\n"
    heads = [b"GET /v1/models HTTP/1.1\r\nHost: x\r\n" + pad + b"\r\n"] * 3
    with socket.create_connection(("127.0.0.1", px.port), timeout=5 * SLOW) as c:
        for h in heads:
            c.sendall(h)
            out = b""
            while not (b"\r\n\r\n" in out and parse_response(out).complete):
                got = c.recv(65536)
                assert got, "closed after %r" % out[:200]
                out += got
            assert parse_response(out).status == 200, out[:200]
    assert_serves_next(px, sim)
    px.stop()


def test_body_over_max_body_bytes_is_413():
    reject(post(b"Host: x\r\nContent-Length: 2000\r\n", b"x" * 2000), 413, "body_too_large",
           limits=SMALL)


def test_chunked_body_over_max_body_bytes_is_413():
    body = b"".join(b"190\r\n" + b"x" * 400 + b"\r\n" for _ in range(5)) + b"0\r\n\r\n"
    reject(post(b"Host: x\r\nTransfer-Encoding: chunked\r\n", body), 413, "body_too_large",
           limits=SMALL)


def test_expect_continue_over_max_body_bytes_is_413_without_100():
    """With Expect: 100-continue the client waits: the 413 comes at once, never a 100."""
    sim, px, conns = setup(SMALL)
    with socket.create_connection(("127.0.0.1", px.port), timeout=5 * SLOW) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  b"Content-Length: 5000\r\n\r\n")
        out, closed = read_until_close(s, timeout=5)
    assert closed
    assert not out.startswith(b"HTTP/1.1 100"), out[:200]
    r = parse_response(out)
    assert_openai_error(r, 413, "body_too_large")
    assert_nothing_forwarded(sim, conns)
    assert_serves_next(px, sim)
    px.stop()


# ---- a rejected request behind a good one on the same connection ---------------------------


def test_request_trailers_are_dropped_and_never_corrupt_the_head():
    """A chunked inference request with trailers (a few bytes, then near the 8 KiB bound): the
    body is policed and forwarded with the client's own headers intact (the trailers arrive
    after the head was handed out and must not move its bytes), the trailers themselves are not
    forwarded, and the proxy serves the next request."""
    sim, px, _ = setup()
    for size in (10, 500, 8000):
        body = json.dumps(COMPLETION).encode()
        data = post(b"Host: x\r\nX-Client-Tag: keep-me\r\nTransfer-Encoding: chunked\r\n"
                    b"Connection: close\r\n",
                    b"%x\r\n%s\r\n0\r\nX-Trailer: %s\r\n\r\n" % (len(body), body, b"T" * size))
        out, closed = exchange(px.port, data, timeout=5)
        r = parse_response(out)
        assert r.status == 200, (size, out[:300])
        got = client_requests(sim)[-1]
        assert got["headers"].get("x-client-tag") == "keep-me", (size, got["headers"])
        assert "x-trailer" not in got["headers"], (size, got["headers"])
        assert all(k.isascii() and k.replace("-", "").isalnum() for k in got["headers"]), got
    assert_serves_next(px, sim, seen_before=3)
    px.stop()


def test_pipelined_bad_request_after_good_one():
    """A good request answered in full, then the 400 for the smuggling attempt behind it, then
    the close: nothing after it is parsed."""
    sim, px, _ = setup()
    data = post(b"Host: x\r\n" + cl()) + CR_X_END
    out, closed = exchange(px.port, data, timeout=5)
    assert closed
    first = parse_response(out)
    assert first.status == 200 and first.complete, first
    second = parse_response(first.rest)
    assert_openai_error(second, 400, "bad_request")
    assert second.rest == b""
    seen = client_requests(sim)
    assert [q["path"] for q in seen] == ["/v1/completions"], seen
    assert_serves_next(px, sim, seen_before=1)
    px.stop()


# ---- garbage soak --------------------------------------------------------------------------

GOOD = post(b"Host: x\r\nContent-Type: application/json\r\n" + cl())
GOOD_CHUNKED = post(b"Host: x\r\nTransfer-Encoding: chunked\r\n",
                    b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n")
NASTY = [b"\r", b"\n", b"\x00", b" ", b"\t", b":", b"\x7f", b"\xff", b"\r\n", b"\r\n\r\n",
         b"\r\n ", b";", b"0", b"f", b"-", b"+"]
HEADERS = [b"Content-Length: 5", b"Content-Length: 0", b"Content-Length: -1",
           b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip", b"Host: x", b"Host:",
           b"Connection: close", b"Connection: keep-alive, Upgrade", b"Upgrade: h2c",
           b"Expect: 100-continue", b"Expect: 200-ok", b"X-A: \x01", b" folded",
           b"Content-Length: 99999999999999999999"]


def garbage(rng):
    kind = rng.randrange(4)
    if kind == 0:  # random bytes
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
    if kind == 1:  # a valid request with a few mutations
        b = bytearray(rng.choice((GOOD, GOOD_CHUNKED)))
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(b))
            op = rng.randrange(4)
            if op == 0:
                b[i] = rng.randrange(256)
            elif op == 1:
                b[i:i] = rng.choice(NASTY)
            elif op == 2:
                del b[i]
            else:
                b = b[:i]
                break
        return bytes(b)
    if kind == 2:  # plausible heads from abusive pieces
        method = rng.choice([b"GET", b"POST", b"PUT", b"HEAD", b"CONNECT", b"PRI", b"G\x00T",
                             b"OPTIONS"])
        target = rng.choice([b"/v1/completions", b"/health", b"*", b"http://x/", b"/a b",
                             b"", b"/%00", b"/" + b"a" * 2000])
        version = rng.choice([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 ", b"HTTP/9",
                              b"http/1.1"])
        hdrs = b"".join(rng.choice(HEADERS) + rng.choice([b"\r\n", b"\r\n", b"\n", b"\r"])
                        for _ in range(rng.randrange(6)))
        return method + b" " + target + b" " + version + b"\r\n" + hdrs + b"\r\n" + \
            bytes(rng.randrange(256) for _ in range(rng.randrange(20)))
    # pipelines: a good request followed by anything
    return GOOD + garbage(rng) if rng.random() < 0.5 else GOOD_CHUNKED + \
        rng.choice(NASTY) * rng.randrange(1, 50)


def test_garbage_soak_200_inputs():
    """200 seeded random / garbled inputs on fresh connections (eight at a time, each
    half-closed after sending). Every byte the proxy sends back must be well-formed HTTP/1.1
    responses; afterwards it is up, serves a valid request, and its gauges drain to 0."""
    sim, px, _ = setup({"client_header_timeout_ms": 2000})
    rng = random.Random(20240527)
    inputs = [garbage(rng) for _ in range(200)]
    problems = []
    lock = threading.Lock()

    def one(data):
        try:
            with socket.create_connection(("127.0.0.1", px.port), timeout=10 * SLOW) as s:
                try:
                    s.sendall(data)
                    s.shutdown(socket.SHUT_WR)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                out, closed = read_until_close(s, timeout=10)
            if not closed:
                raise AssertionError("connection not closed")
            rest = out
            while rest:
                r = parse_response(rest)
                if r.status < 200 or r.status > 599:
                    raise AssertionError("status %d" % r.status)
                if not r.complete:
                    break
                rest = r.rest
        except Exception as e:  # collected: one failure report with the input
            with lock:
                problems.append((data[:120], repr(e)))

    todo = list(inputs)
    while todo:
        batch, todo = todo[:8], todo[8:]
        ts = [threading.Thread(target=one, args=(d,)) for d in batch]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert px.alive() and sim.alive()
    assert not problems, problems[:5]
    r = post_json(px.port, "/v1/completions", COMPLETION)
    assert r.status == 200, r
    poll_until(lambda: metric(px, "detproxy_connections") == 0 and
               metric(px, "detproxy_inflight_requests") == 0, timeout=10,
               what="gauges back to 0 after the soak")
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
