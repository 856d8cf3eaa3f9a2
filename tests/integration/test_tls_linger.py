"""TLS clients that speak TLS while detproxy lingers on their connection after its last answer
(the answer's rest still queued, the write side shut once it has gone): what the client says
then must not cost it the rest of the answer.

The client is tests/tlsclient/poke_client.c (tls-poke-client): Python's ssl module can send
neither a TLS 1.2 renegotiation request nor a TLS 1.3 KeyUpdate. Which of them make OpenSSL 3
write on its own while it reads decides the cases:
  - a renegotiation ClientHello (TLS 1.2) is answered at once with a no_renegotiation alert,
    unless close_notify was already sent: after an answer cut without close_notify (the
    replica failed mid-stream) that alert is written after the shutdown;
  - a KeyUpdate with update_requested (TLS 1.3) is never answered while reading: OpenSSL sends
    its own with its next write, and not at all once close_notify was sent. That case checks
    the ordinary lingering close (close_notify, then FIN) with a client doing it.
The answers are larger than the kernel's send buffers, and the client stops reading until
/proc/net/tcp shows the kernel holding all it will, so detproxy still has bytes of its own
queued when the client speaks.
"""

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

from certs import shared_pki
from harness import DETPROXY_BIN, SLOW, poll_until, run_tests, start_sim
from proxyutil import (metric, parse_response, pool, recv_queue, send_queue, serve_replica,
                       serve_until_stream, start_proxy, wait_send_queue_full)

SKIP = 77
BUILD_DIR = os.environ.get("DP_BUILD_DIR") or os.path.dirname(os.path.dirname(DETPROXY_BIN))
POKE_BIN = os.path.join(BUILD_DIR, "tests", "tlsclient", "tls-poke-client")
PKI = shared_pki()
QUIET = {"interval_ms": 600000}  # no re-attestation during a test


def tls_listener():
    return {"cert_file": PKI.server.crt, "key_file": PKI.server.key}


class Poke:
    """tls-poke-client on its way: connected, its request sent, reading its first bytes."""

    def __init__(self, port, request, first, mode):
        fd, self.out = tempfile.mkstemp(prefix="poke-")
        os.close(fd)
        self.p = subprocess.Popen([POKE_BIN, "-m", mode, "-o", self.out, str(port),
                                   request.decode(), str(first)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        assert line.startswith("port "), line
        self.port = int(line.split()[1])

    def poke(self):
        """Once it has read its first bytes: send the message and read to the end. (summary
        fields, plaintext received)."""
        line = self.p.stdout.readline()
        assert line.startswith("read "), line
        self.p.stdin.write("go\n")
        self.p.stdin.flush()
        try:
            rest, _ = self.p.communicate(timeout=60 * SLOW)
        finally:
            self.p.kill()
        assert self.p.returncode == 0, (self.p.returncode, rest)
        last = rest.strip().splitlines()[-1]
        assert last.startswith("received "), rest
        fields = dict(f.split("=", 1) for f in last.split()[2:])
        fields["received"] = int(last.split()[1])
        with open(self.out, "rb") as f:
            data = f.read()
        assert len(data) == fields["received"], (len(data), last)
        return fields, data


# ---- an answer cut without close_notify ---------------------------------------------------

EVENT = b'data: {"choices":[{"index":0,"text":"' + b"a" * 200 + b'"}]}\n\n'
CHUNK = b"%x\r\n" % len(EVENT) + EVENT + b"\r\n"
PIECE = CHUNK * (65536 // len(CHUNK))
EVENTS_PER_PIECE = 65536 // len(CHUNK)


def test_a_renegotiation_request_while_a_cut_answer_lingers_loses_none_of_it():
    """The replica streams to a TLS 1.2 client that stopped reading until the kernel holds all
    it will and detproxy queues the rest itself, then hangs up mid-stream: detproxy cuts the
    answer (an error event, no final chunk, no close_notify) and lingers while its queue goes
    out. The client then asks to renegotiate; detproxy's OpenSSL refuses with an alert it
    writes on its own, after the write side was shut. That alert used to fail the write, which
    closed the connection and dropped the queued rest of the answer; now the client gets every
    event the replica sent, then the error event, then the end without close_notify."""
    streams = queue.Queue()
    done = threading.Event()

    def handle(c):
        if serve_until_stream(c):
            streams.put(c)  # the test writes the stream and hangs up
            done.wait(60)

    ls, replica_pool = serve_replica(handle)
    px = start_proxy(pools=[replica_pool], attestation=QUIET, workers=1, tls=tls_listener())
    body = json.dumps({"model": "m1", "prompt": "hello", "max_tokens": 50,
                       "stream": True}).encode()
    req = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % len(body)) + body
    client = Poke(px.port, req, 1, "renegotiate")
    up = streams.get(timeout=10 * SLOW)
    # 64 KB at a time while the kernel's send queue to the client grows; the first piece it
    # does not take stays in detproxy's own queue (under the 256 KB mark at which detproxy
    # stops reading the replica, so it still sees the hang-up).
    pieces, full = 0, None
    deadline = time.monotonic() + 60 * SLOW
    while True:
        assert time.monotonic() < deadline, "the kernel's send queue never filled"
        before = send_queue(px.port, client.port)
        up.sendall(PIECE)
        pieces += 1
        # Once detproxy has read the piece, give it time to pass it on: a slower build (under
        # a sanitizer) would otherwise be sent more than its queue holds, stop reading the
        # replica as it should, and never see the hang-up.
        me, peer = up.getsockname()[1], up.getpeername()[1]
        while recv_queue(peer, me) and time.monotonic() < deadline:
            time.sleep(0.005)
        moved = time.monotonic() + 1.0 * SLOW
        while time.monotonic() < moved and send_queue(px.port, client.port) == before:
            time.sleep(0.005)
        if send_queue(px.port, client.port) == before:
            full = before
            break
    up.close()  # mid-stream: no final chunk
    done.set()
    px.wait_log("upstream_error", timeout=5 * SLOW)
    # Lingering on a cut answer, with the kernel still full: the last piece and the error event
    # wait in detproxy's queue.
    assert send_queue(px.port, client.port) == full
    fields, data = client.poke()
    r = parse_response(data)  # de-chunked (detproxy forwards bytes, not whole chunks)
    sent = pieces * EVENTS_PER_PIECE
    assert r.status == 200 and not r.complete, r
    assert r.body.startswith(EVENT * sent), ("events lost", r.body.count(EVENT), sent, fields)
    tail = r.body[len(EVENT) * sent:]
    assert tail.startswith(b'data: {"error"') and b"failed mid-stream" in tail, tail[:300]
    assert fields["end"] == "eof", fields  # a cut answer ends without close_notify
    assert fields["poked"] == "1", fields
    poll_until(lambda: metric(px, "detproxy_connections") == 0, timeout=10 * SLOW,
               what="the lingering connection closed")
    ls.close()
    px.stop()


# ---- a whole answer, close_notify then FIN --------------------------------------------------


def test_a_key_update_while_a_large_answer_lingers_loses_none_of_it():
    """Connection: close and a 4.4 MB model list to a TLS 1.3 client that reads 16 KB, stops
    until the kernel holds all it will, then sends a KeyUpdate asking for one back: the whole
    answer arrives, then close_notify (OpenSSL sends no KeyUpdate after its close_notify, so
    nothing is written after the shutdown here; the lingering close must still deliver the
    rest)."""
    sim = start_sim("--model", "m1")
    models = ["m1"] + ["model-%05d-%s" % (i, "x" * 40) for i in range(20000)]
    px = start_proxy(pools=[pool("p", models, [sim])], attestation=QUIET, tls=tls_listener())
    client = Poke(px.port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                  16384, "key_update")
    assert wait_send_queue_full(px.port, client.port) > 0
    fields, data = client.poke()
    r = parse_response(data)
    assert r.status == 200 and r.complete, (fields, data[:200])
    assert len(r.json()["data"]) == len(models)
    assert fields["poked"] == "1", fields
    assert fields["end"] == "close_notify", fields
    px.stop()


if __name__ == "__main__":
    if not os.access(POKE_BIN, os.X_OK):
        # Built with the unit tests (DP_TESTS); `make valgrind` builds without them.
        print("skip: %s not built" % POKE_BIN)
        sys.exit(SKIP)
    run_tests(globals())
