"""The request-body budget cannot be squatted (docs/configuration.md, "limits"): a body holds
what has arrived of it, not what its Content-Length declares; when the budget is full, bodies
still being read are shed for the others (the bodies of a client address over its fair share
first, then the slowest), each with a `body_shed` log line and a count in
detproxy_overload_rejections_total{reason="body_shed"}.

Before: 32 connections that declared `Content-Length: 8388608` and sent nothing made every
inference request of every tenant 503 `overloaded` for client_body_timeout_ms."""

import select
import threading
import time

from harness import SLOW, connect_from, http, poll_until, run_tests, start_sim
from proxyutil import assert_openai_error, metric, parse_response, pool, read_response, \
    read_until_close, start_proxy

MODEL = "m1"
KiB = 1 << 10
MiB = 1 << 20


def body_of(n):
    head = '{"model":"%s","max_tokens":1,"prompt":"' % MODEL
    return (head + "x" * (n - len(head) - 2) + '"}').encode()


def head(n):
    return ("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "content-length: %d\r\n\r\n" % n).encode()


def connect(port, source="127.0.0.1"):
    """A connection from `source`: distinct client addresses for the fair share."""
    return connect_from(port, source)


def ordinary(port, n):
    """n ordinary 1 KiB completions, one after the other: their statuses."""
    body = body_of(KiB)
    return [http("POST", port, "/v1/completions", body=body,
                 headers={"content-type": "application/json"}).status for _ in range(n)]


def inflight(px):
    return metric(px, "detproxy_inflight_requests")


def test_connections_that_declare_8_mib_and_trickle_lock_no_one_out():
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])])  # the default 8 MiB / 256 MiB
    n = 40  # 40 x 8 MiB declared: more than the whole default budget
    squat = []
    for _ in range(n):
        s = connect(px.port, "127.0.0.2")
        s.sendall(head(8 * MiB) + b'{"model":"m1","prompt":"')
        squat.append(s)
    # (Each once reserved the 8 MiB it declared: the 33rd was refused, and every request after.)
    poll_until(lambda: inflight(px) >= 32, what="the squatting bodies admitted")
    stop = threading.Event()

    def trickle():
        # A byte a connection every 100 ms: never idle, never done.
        while not stop.wait(0.1):
            for s in squat:
                try:
                    s.send(b"x")
                except OSError:
                    pass

    th = threading.Thread(target=trickle, daemon=True)
    th.start()
    try:
        statuses = ordinary(px.port, 30)
        assert statuses == [200] * 30, statuses
        assert inflight(px) == n  # every squatter admitted: none holds more than it sent
        # From the squatters' own address too: they hold no room to refuse it with.
        r = http("POST", px.port, "/v1/completions", body=body_of(KiB),
                 headers={"content-type": "application/json"})
        assert r.status == 200, r
        held = metric(px, "detproxy_overload_rejections_total", reason="body_budget") or 0
        assert held == 0, held
    finally:
        stop.set()
        th.join()
        for s in squat:
            s.close()
    px.stop()


def test_slow_bodies_that_fill_the_budget_are_shed_for_ordinary_clients():
    """Slow clients that do send most of a large body (the budget really is full) and then
    stall: an ordinary request sheds the slowest of them, 408, and is answered."""
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"max_body_bytes": MiB, "max_inflight_body_bytes": 4 * MiB})
    body = body_of(MiB)
    slow = []
    for _ in range(4):
        s = connect(px.port)  # the ordinary clients' own address: only speed tells them apart
        s.sendall(head(MiB) + body[:MiB - KiB])
        slow.append(s)
    poll_until(lambda: inflight(px) == 4, what="four slow bodies admitted")
    time.sleep(1.2)  # they stall: a body that sent nothing for a second is the slowest
    statuses = ordinary(px.port, 10)
    assert statuses == [200] * 10, statuses
    shed = metric(px, "detproxy_overload_rejections_total", reason="body_shed")
    assert shed and shed >= 1, shed
    line = px.wait_log(lambda r: r.get("msg") == "body_shed")
    assert line["reason"] == "slowest" and line["status"] == 408, line
    assert line["received_bytes"] == MiB - KiB and line["content_length"] == MiB, line
    assert line["max_inflight_body_bytes"] == 4 * MiB, line
    # A shed client hears why.
    victims, waiting = 0, list(slow)
    deadline = time.monotonic() + 2 * SLOW  # the 408 is written by the shed body's own thread
    while victims < shed and waiting and time.monotonic() < deadline:
        ready, _, _ = select.select(waiting, [], [], max(0, deadline - time.monotonic()))
        for s in ready:
            waiting.remove(s)
            data = s.recv(65536)
            if data:
                err = assert_openai_error(parse_response(data), 408, "timeout")
                assert "max_inflight_body_bytes" in err["message"], err
                victims += 1
    assert victims == shed, (victims, shed)
    for s in slow:
        s.close()
    px.stop()


def readable(s, timeout=0.5):
    r, _, _ = select.select([s], [], [], timeout)
    return bool(r)


def test_an_address_over_its_fair_share_yields_to_another_even_a_slower_one():
    """One address holds the whole budget with bodies that arrived faster than the other
    address sends its own, and have not stalled: only the fair share (the budget over the
    addresses holding it) makes room, by shedding the hog's slowest body, 503."""
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"max_body_bytes": MiB, "max_inflight_body_bytes": 4 * MiB})
    big = body_of(MiB)
    other = body_of(256 * KiB)
    s = connect(px.port, "127.0.0.3")
    s.sendall(head(len(other)))  # its request starts now: 32 KiB in 0.3 s is ~100 KB/s
    t0 = time.monotonic()
    hog = []
    for _ in range(4):
        h = connect(px.port, "127.0.0.2")
        h.sendall(head(MiB) + big[:MiB - 10])  # ~1 MiB in milliseconds: MB/s
        hog.append(h)
    poll_until(lambda: inflight(px) == 5, what="the hog's four bodies admitted")
    time.sleep(max(0, 0.3 - (time.monotonic() - t0)))
    for i in range(0, len(other), 32 * KiB):
        s.sendall(other[i:i + 32 * KiB])
    r = read_response(s)
    assert r.status == 200, r
    s.close()
    line = px.wait_log(lambda r: r.get("msg") == "body_shed")
    assert line["reason"] == "address_over_share" and line["status"] == 503, line
    assert line["address_share"] == 2 * MiB, line  # two addresses hold the budget
    assert line["remote"].startswith("127.0.0.2:"), line
    shed = [h for h in hog if readable(h)]
    assert len(shed) == 1, len(shed)  # one of the hog's bodies made room for 256 KiB
    data, _ = read_until_close(shed[0], timeout=5)
    err = assert_openai_error(parse_response(data), 503, "overloaded")
    assert "share" in err["message"], err
    assert metric(px, "detproxy_overload_rejections_total", reason="body_shed") == 1
    for h in hog:
        h.close()
    px.stop()


def test_many_bodies_growing_at_once_on_two_workers_all_end_and_give_the_budget_back():
    """Sixty-four 1 MiB bodies from eight addresses sent at once to two workers sharing a
    budget of four: every body ends (answered, shed or refused), at least a budget's worth is
    answered, and the whole budget comes back."""
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])],
                     limits={"max_body_bytes": MiB, "max_inflight_body_bytes": 4 * MiB},
                     workers=2)
    body = body_of(MiB)
    results = []
    lock = threading.Lock()

    def client(k):
        try:
            s = connect(px.port, "127.0.0.%d" % (2 + k % 8))
            s.sendall(head(MiB))
            for i in range(0, MiB, 64 * KiB):
                s.sendall(body[i:i + 64 * KiB])
            st = read_response(s, timeout=20).status
        except OSError:
            st = "reset"  # shed while still sending: the answer may be lost to the reset
        with lock:
            results.append(st)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 64
    assert set(results) <= {200, 408, 503, "reset"}, results
    print("    64 bodies at once:", {k: results.count(k) for k in set(results)})
    assert results.count(200) >= 4, results
    poll_until(lambda: inflight(px) == 0, what="every body ended")
    # The budget is whole again: four 1 MiB bodies at once are admitted.
    held = [connect(px.port) for _ in range(4)]
    for h in held:
        h.sendall(head(MiB) + body[:MiB - 1])
    poll_until(lambda: inflight(px) == 4, what="the whole budget back")
    for h in held:
        h.close()
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
