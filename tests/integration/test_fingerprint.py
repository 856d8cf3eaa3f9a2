"""The engine fingerprint (docs/attestation.md, "The engine fingerprint"): native adapters learn each replica's
system_fingerprint from a 1-token probe, a manifest may pin it, and every response's fingerprint
is checked against what its replica attested, so a replica swapped under detproxy's feet is
caught on its next response. A client response that carried the attested fingerprint during the
interval stands in for the periodic check's probe."""

import json
import os
import socket
import tempfile
import threading
import time

from harness import SLOW, get_json, poll_until, post_json, run_tests, sse, start_sim
from proxyutil import (ScriptedUpstream, exchange, metric, pool, sim_config, sim_requests,
                       sim_stats, start_proxy)

MODEL = "tiny"
BUILD = "b11669-Debian"
AUDIT_POLICY = {"tenants": [{"name": "all", "match": {"any": True}, "audit": True}]}


def llama(version=BUILD, quant="F16"):
    return start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version", version,
                     "--quantization", quant)


def setup(sims, manifest=None, interval=60000, model=MODEL, **kw):
    d = tempfile.mkdtemp(prefix="detproxy-fp-")
    p = pool("p", [model], sims, manifest=manifest or {"model": MODEL},
             balance="round_robin")
    for r in p["replicas"]:
        r["attest"] = {"source": "llamacpp"}
    px = start_proxy(pools=[p], directory=d, policy=AUDIT_POLICY,
                     attestation={"interval_ms": interval, "timeout_ms": 2000},
                     log={"level": "info", "audit_path": os.path.join(d, "audit.jsonl")}, **kw)
    px.audit_path = os.path.join(d, "audit.jsonl")
    return px


def replicas(px):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def complete(px, **kw):
    b = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 4, "temperature": 0}
    b.update(kw)
    return post_json(px.port, "/v1/completions", b)


def test_probe_attests_the_engine_fingerprint_and_a_pin_admits_only_it():
    good, other = llama(), llama(version="b12000-Debian")
    px = setup([good, other], manifest={"model": MODEL, "quantization": "f16",
                                        "engine_fingerprint": BUILD})
    poll_until(lambda: replicas(px)["r2"]["state"] == "rejected", what="r2 rejected")
    rep = replicas(px)
    assert rep["r1"]["state"] == "admitted", rep["r1"]
    pools = get_json(px.admin_port, "/admin/config")["pools"]
    assert pools[0]["manifest"]["engine_fingerprint"] == BUILD, pools[0]["manifest"]
    assert rep["r1"]["attestation"]["report"]["engine_fingerprint"] == BUILD
    # The manifest's "f16" matched llama.cpp's "F16": case-blind for this adapter.
    assert rep["r1"]["attestation"]["report"]["quantization"] == "F16"
    assert ("engine_fingerprint mismatch: got b12000-Debian want " + BUILD
            in rep["r2"]["reasons"]), rep["r2"]
    # The probe is one token at temperature 0 with the model the engine reported.
    probes = [json.loads(q["body"]) for q in sim_requests(good) if q["inference"]]
    assert probes and probes[0]["max_tokens"] == 1 and probes[0]["model"] == MODEL, probes


def test_a_swapped_replica_is_caught_on_its_next_response():
    a, b = llama(), llama()
    px = setup([a, b], manifest={"model": MODEL, "engine_fingerprint": BUILD})
    poll_until(lambda: all(r["state"] == "admitted" for r in replicas(px).values()),
               what="both admitted")
    # r1 is replaced in place by another build: metadata and responses change together.
    sim_config(a, framework_version="b12000-Debian")
    seen = {}
    for _ in range(6):
        r = complete(px)
        assert r.status == 200, r
        seen.setdefault(r.headers["x-detproxy-replica"], []).append(
            r.headers.get("x-detproxy-upstream-fingerprint"))
    # r1 answered exactly once more (delivered, with its new fingerprint), then got nothing.
    assert seen.get("r1") == ["b12000-Debian"], seen
    assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r1") == 1
    assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r2") == 0
    # Re-attested at once (not at the 60 s interval): the pin rejects it.
    poll_until(lambda: replicas(px)["r1"]["state"] == "rejected", timeout=5, what="r1 rejected")
    assert any("engine_fingerprint mismatch: got b12000-Debian" in x
               for x in replicas(px)["r1"]["reasons"])
    lines = [json.loads(x) for x in open(px.audit_path)]
    flagged = [x for x in lines if x.get("fingerprint_mismatch")]
    assert len(flagged) == 1 and flagged[0]["replica"] == "r1", lines
    assert flagged[0]["upstream_fingerprint"] == "b12000-Debian"
    assert all("fingerprint_mismatch" not in x for x in lines if x is not flagged[0])


def test_a_swapped_replica_is_caught_when_its_client_left_during_the_check():
    """An answer longer than 64 KiB is checked on the thread pool, and its client may leave
    meanwhile. The replica's whole answer has come all the same, and its fingerprint is
    compared: a swapped replica is caught though nothing was delivered."""
    from test_resource_bounds import HugeReplica
    up = HugeReplica()  # llama.cpp's /props; answers of 8 MiB of numbers like 1e301
    up.build, up.fp = BUILD, BUILD.encode()
    up.dense, up.number, up.size = True, b"1e301", 8 * 1024 * 1024
    d = tempfile.mkdtemp(prefix="detproxy-fp-")
    p = {"name": "p", "models": ["m1"], "manifest": {"model": "m1", "engine_fingerprint": BUILD},
         "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d" % up.port,
                       "attest": {"source": "llamacpp"}}]}
    px = start_proxy(pools=[p], directory=d, workers=1,
                     attestation={"interval_ms": 60000, "timeout_ms": 2000},
                     limits={"max_response_rewrite_bytes": 9 * 1024 * 1024})
    poll_until(lambda: replicas(px)["r1"]["state"] == "admitted", what="r1 admitted")
    up.build, up.fp = "b12000-Debian", b"b12000-Debian"  # swapped: metadata and answers change together
    body = json.dumps({"model": "m1", "prompt": "x", "max_tokens": 2}).encode()
    c = socket.create_connection(("127.0.0.1", px.port))
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
              b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
              % (len(body), body))
    poll_until(lambda: metric(px, "detproxy_response_offloaded_total") == 1, interval=0.002,
               what="the answer's check")
    c.close()
    poll_until(lambda: metric(px, "detproxy_requests_total", pool="p", status="499") == 1,
               what="the request counted 499")
    assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r1") == 1
    # Re-attested at once: the pin rejects the new build.
    poll_until(lambda: replicas(px)["r1"]["state"] == "rejected", timeout=5, what="r1 rejected")
    px.stop()


def test_without_a_pin_the_new_engine_is_re_attested_and_readmitted():
    a = llama()
    px = setup([a])
    assert replicas(px)["r1"]["attestation"]["report"]["engine_fingerprint"] == BUILD
    sim_config(a, framework_version="b12000-Debian")
    # A stream is checked too: the fingerprint from its chunks.
    events = list(sse(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 3,
                                              "stream": True}))
    assert events and events[-1][1] == "[DONE]", events
    assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r1") == 1
    poll_until(lambda: replicas(px)["r1"]["attestation"]["report"]["engine_fingerprint"]
               == "b12000-Debian", timeout=5, what="re-attested with the new fingerprint")
    poll_until(lambda: replicas(px)["r1"]["state"] == "admitted", timeout=5, what="readmitted")
    assert complete(px).status == 200
    assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r1") == 1


def test_a_client_response_with_the_fingerprint_stands_in_for_the_periodic_probe():
    """docs/attestation.md, "Our own requests take a slot": while client responses carry the
    replica's attested fingerprint, its periodic checks send no probe completion (counted at the
    replica: every completion it gets is a client's); once the traffic stops they probe again."""
    interval = 0.5 * SLOW  # a slower build's responses still come many per interval
    s = llama()
    px = setup([s], interval=int(interval * 1000))
    poll_until(lambda: replicas(px)["r1"]["state"] == "admitted", what="r1 admitted")
    sent = 0

    def checks():
        return metric(px, "detproxy_attestations_total", pool="p", replica="r1",
                      result="admitted")

    def probes():  # completions the replica got that no client sent
        return sim_stats(s)["requests"] - sent

    def client_traffic(until):
        nonlocal sent
        while not until():
            assert complete(px, prompt="steady %d" % sent).status == 200
            sent += 1
            time.sleep(0.02)  # pacing: steady, tens of responses per interval

    # Traffic first, until two checks ended after it began (the first may have begun before
    # it, and probed): from here on every regular check finds a response within its interval.
    c0 = checks()
    client_traffic(lambda: sent > 0 and checks() >= c0 + 2)
    c1, p1, t1 = checks(), probes(), time.monotonic()
    client_traffic(lambda: time.monotonic() - t1 >= 5 * interval and checks() >= c1 + 4)
    c2, p2 = checks(), probes()
    assert p2 == p1, "%d probes over %d checks with steady client traffic" % (p2 - p1, c2 - c1)
    # No client traffic: the checks probe again, each interval.
    poll_until(lambda: probes() >= p2 + 2, timeout=10 * interval, what="two probes while idle")
    last = [q for q in sim_requests(s) if q["inference"]][-1]
    assert "x-detproxy-request-id" not in last["headers"], last
    body = json.loads(last["body"])
    assert body["prompt"] == "detproxy probe" and body["max_tokens"] == 1, body


def reply(obj):
    b = json.dumps(obj).encode()
    return (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % len(b) + b, True)


class HeldProbes:
    """A llama.cpp played by a script: its probes (POST /v1/completions) answer "fp-A", the
    first at once and every later one only when released; chat completions answer "fp-B", once
    `chats` of them have arrived, after the first `warm` ones, which answer at once and carry no
    fingerprint (they leave a pooled connection behind)."""

    def __init__(self, chats=1, warm=0):
        self.chats = threading.Barrier(chats)
        self.warm = warm
        self.arrived = threading.Semaphore(0)
        self.gate = threading.Semaphore(0)
        self.probes = 0
        self.stream = None  # a list of chunk fingerprints: chat answers stream them instead
        self.up = ScriptedUpstream(self.script)
        self.port = self.up.port

    def script(self, k, conn_no, req_no):
        target = self.up.requests[k][2].split(b" ")[1]
        if target == b"/props":
            return reply({"build_info": "b1", "model_ftype": "F16"})
        if target == b"/v1/completions":
            self.probes += 1
            if self.probes > 1:
                self.arrived.release()
                self.gate.acquire(timeout=20)
            return reply({"object": "text_completion", "system_fingerprint": "fp-A",
                          "choices": [{"index": 0, "text": "x", "finish_reason": "length"}]})
        if self.warm > 0:
            self.warm -= 1
            return reply({"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "y"},
                 "finish_reason": "stop"}]})
        self.chats.wait(timeout=20)
        if self.stream is not None:
            b = b"".join(b"data: %s\n\n" % json.dumps(
                {"object": "chat.completion.chunk", "system_fingerprint": fp, "choices": []}
                ).encode() for fp in self.stream) + b"data: [DONE]\n\n"
            return (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(b) + b, True)
        return reply({"object": "chat.completion", "system_fingerprint": "fp-B",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "y"},
                                   "finish_reason": "stop"}]})


def test_a_check_already_under_way_when_a_mismatch_arrives_does_not_readmit():
    rep = HeldProbes(warm=1)
    px = setup([rep], manifest={"model": "m1"}, interval=1000, model="m1", workers=1)
    assert replicas(px)["r1"]["attestation"]["report"]["engine_fingerprint"] == "fp-A"
    try:
        # A first request opens a connection (after its own check) that stays pooled in the one
        # worker: the response below comes over it, not after a check of its own.
        chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        assert post_json(px.port, "/v1/chat/completions", chat).status == 200
        # The periodic check is under way, its probe held: then a response shows fp-B.
        assert rep.arrived.acquire(timeout=10), "no periodic probe"
        r = post_json(px.port, "/v1/chat/completions", chat)
        assert r.status == 200 and r.headers["x-detproxy-upstream-fingerprint"] == "fp-B", r
        assert replicas(px)["r1"]["state"] == "pending", replicas(px)["r1"]
        # The check that began before the mismatch ends with the old answer: stale, not an
        # admission. The replica stays out until a check that began after it passes.
        rep.gate.release()
        assert rep.arrived.acquire(timeout=10), "no re-check after the mismatch"
        assert replicas(px)["r1"]["state"] == "pending", replicas(px)["r1"]
        assert post_json(px.port, "/v1/chat/completions", chat).status == 503
        assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r1") == 1
    finally:
        for _ in range(8):
            rep.gate.release()


CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def test_concurrent_mismatching_responses_are_all_flagged_and_re_attest_once():
    rep = HeldProbes(chats=3)
    px = setup([rep], manifest={"model": "m1"}, model="m1")
    try:
        out = []
        ts = [threading.Thread(target=lambda: out.append(post_json(px.port, "/v1/chat/completions",
                                                                  CHAT)))
              for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(20)
        assert [r.status for r in out] == [200] * 3, out
        # Every one of them differed from what r1 attested: counted and flagged, each of them.
        assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r1") == 3
        lines = [json.loads(x) for x in open(px.audit_path)]
        assert sum(1 for x in lines if x.get("fingerprint_mismatch")) == 3, lines
        # One re-attestation, not one per response.
        assert rep.arrived.acquire(timeout=10), "no re-attestation"
        rep.gate.release()
        poll_until(lambda: replicas(px)["r1"]["state"] == "admitted", timeout=5, what="readmitted")
        assert rep.probes == 2, rep.probes
    finally:
        for _ in range(8):
            rep.gate.release()


def test_a_replica_that_flaps_its_fingerprint_does_not_storm_attestation():
    rep = HeldProbes()  # probes say fp-A, every response fp-B: a mismatch on each of them
    for _ in range(1000):
        rep.gate.release()  # no probe is held here
    px = setup([rep], manifest={"model": "m1"}, model="m1")
    t0 = time.monotonic()
    served = 0
    while time.monotonic() - t0 < 1.0:
        served += post_json(px.port, "/v1/chat/completions", CHAT).status == 200
    # Each mismatch re-attests, but a replica is checked at most every 100 ms: not one check
    # per response it manages to answer.
    checks = rep.probes - 1
    assert served >= 1 and checks <= 12, (served, checks)
    assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r1") == served


def test_a_stream_framed_by_content_length_arrives_whole_after_rewriting():
    rep = HeldProbes()
    rep.stream = ["fp-A", "fp-A"]  # the script frames it with Content-Length
    px = setup([rep], manifest={"model": "m1"}, model="m1")
    body = json.dumps(dict(CHAT, stream=True)).encode()
    for version in (b"1.1", b"1.0"):
        head, _, rest = exchange(px.port, b"POST /v1/chat/completions HTTP/%s\r\nHost: x\r\n"
                                 b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                                 b"Connection: close\r\n\r\n" % (version, len(body)) + body
                                 )[0].partition(b"\r\n\r\n")
        assert b"content-length" not in head.lower(), head
        if version == b"1.1":
            assert b"transfer-encoding: chunked" in head.lower(), head
        assert rest.count(b'"system_fingerprint": "fp_') == 2 and b"data: [DONE]" in rest, rest


def test_a_stream_is_checked_on_every_chunk_not_only_its_last():
    rep = HeldProbes()
    for _ in range(8):
        rep.gate.release()
    px = setup([rep], manifest={"model": "m1"}, model="m1")
    n = 0
    for chunks in (["fp-B", None], ["fp-B", "fp-A"], ["fp-A", "fp-B", "fp-A"], ["fp-A", None]):
        rep.stream = chunks
        poll_until(lambda: replicas(px)["r1"]["state"] == "admitted", timeout=5, what="admitted")
        events = list(sse(px.port, "/v1/chat/completions", dict(CHAT, stream=True)))
        assert events and events[-1][1] == "[DONE]", events
        n += "fp-B" in chunks
        assert metric(px, "detproxy_fingerprint_mismatch_total", pool="p", replica="r1") == n, \
            chunks
    # A stream's audit line follows its last byte to the client: wait for all four.
    def audited():
        return [json.loads(x) for x in open(px.audit_path) if x.endswith("\n")]
    poll_until(lambda: len(audited()) >= 4, timeout=5, what="four audit lines")
    lines = audited()
    flagged = [x["upstream_fingerprint"] for x in lines if x.get("fingerprint_mismatch")]
    assert flagged == ["fp-B"] * 3, lines


if __name__ == "__main__":
    run_tests(globals())
