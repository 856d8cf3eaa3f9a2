"""Memory bounds against hostile clients and replicas (issue 11 holes 3 and 4, SPEC §3).

- limits.max_inflight_body_bytes: request bodies buffered across all connections. Clients that
  stall with large bodies once took the proxy to max_connections x max_body_bytes; now a new
  inference request over the budget is 503 `overloaded`, admitted ones finish.
- limits.client_body_timeout_ms: the whole body read, so a trickle cannot hold its share.
- limits.max_response_rewrite_bytes: what is held of one non-streamed response for the
  fingerprint rewrite; a bigger answer is passed through as it arrives."""

import socket
import threading
import time

from harness import SLOW, get_json, http, poll_until, run_tests, start_sim
from proxyutil import (assert_openai_error, metric, parse_response, pool, read_until_close,
                       rss_kb, start_proxy)

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


def read_response(s, timeout=10):
    """Read one whole response from s (keep-alive: the connection stays open)."""
    data = b""
    deadline = time.monotonic() + timeout * SLOW
    while time.monotonic() < deadline:
        if b"\r\n\r\n" in data and parse_response(data).complete:
            return parse_response(data)
        s.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return parse_response(data)


def inflight(px):
    return metric(px, "detproxy_inflight_requests")


def test_bodies_over_the_inflight_budget_are_503_and_admitted_ones_finish():
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"max_body_bytes": MiB, "max_inflight_body_bytes": 4 * MiB})
    body = body_of(MiB)
    held = [stalled(px.port, body, 10) for _ in range(4)]
    poll_until(lambda: inflight(px) == 4, what="four bodies admitted")
    # The budget is spent: a fifth body (Content-Length or chunked) is refused at once.
    for chunked in (False, True):
        s, _ = stalled(px.port, body, 10, chunked=chunked)
        data, closed = read_until_close(s, timeout=5)
        r = parse_response(data)
        err = assert_openai_error(r, 503, "overloaded")
        assert "max_inflight_body_bytes" in err["message"], err
        s.close()
    assert metric(px, "detproxy_overload_rejections_total", reason="body_budget") == 2
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


if __name__ == "__main__":
    run_tests(globals())
