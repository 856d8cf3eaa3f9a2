"""A streamed (pass-through) upload that waits in a pool's queue keeps every byte of its body.

With max_inflight_per_replica 1 and the replica busy, a POST the proxy does not police
(/v1/embeddings) is queued with its body reads paused. The body bytes that arrive in the same
read as the head must wait too: passed to the proxy's body callback with no upstream to take
them they would be dropped, and the replica would wait for a body short of its Content-Length.
(tests/unit/test_net_server.c paused_body_is_not_read_until_resumed is the net/ half.)
"""

import json
import socket
import threading

from harness import poll_until, run_tests
from proxyutil import ScriptedUpstream, exchange, metric, parse_response, start_proxy

EMBED = json.dumps({"model": "m1", "input": "x" * 200}).encode()
ANSWER = b'{"object":"list","data":[]}'
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(ANSWER)) + ANSWER


def embed_request(extra=b""):
    return (b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"%sContent-Length: %d\r\n\r\n" % (extra, len(EMBED))) + EMBED


def test_queued_pass_through_upload_keeps_its_body():
    release = threading.Event()

    def script(k, conn_no, req_no):
        if k == 0:
            release.wait(10)  # the first request holds the replica's only slot
        return RESPONSE, True

    up = ScriptedUpstream(script)
    px = start_proxy(pools=[{"name": "p", "models": ["m1"], "max_inflight_per_replica": 1,
                             "replicas": [{"name": "r1",
                                           "url": "http://127.0.0.1:%d" % up.port}]}],
                     limits={"upstream_first_byte_timeout_ms": 3000}, attestation={"interval_ms": 600000})
    first = {}
    t = threading.Thread(target=lambda: first.update(r=exchange(px.port, embed_request(b"Connection: close\r\n"))))
    t.start()
    poll_until(lambda: len(up.requests) == 1, timeout=5, what="the first upload at the replica")
    # The second upload: head and body in one write, so in one read at the proxy.
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(embed_request())
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 2, timeout=5,
               what="the second upload queued")
    release.set()
    t.join(10)
    s.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + len(ANSWER):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    s.close()
    r = parse_response(data)
    assert parse_response(first["r"][0]).status == 200
    assert r.status == 200, r
    assert len(up.requests) == 2, "the queued upload never reached the replica whole"
    px.stop()
    up.stop()


if __name__ == "__main__":
    run_tests(globals())
