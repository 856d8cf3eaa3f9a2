"""A `single_sequence` pool (docs/configuration.md, "Deterministic pools") in front of a real
llama.cpp server that would run four sequences at once (`-np 4 --kv-unified`): a thread polls
the engine's GET /slots every ~2 ms and counts the entries with `is_processing` true, and no
sample may show two. The requests are the ones the engine itself runs as several, or goes on
with after detproxy has left them:

- `n` / `n_cmpl` of 3 - 2^32 (llama.cpp keeps the low 32 bits of a count: 3);
- a streamed request in a stream session (`x-conversation-id`), whose client leaves: llama.cpp
  generates it on for a later reader;
- `n: 3` sent through the admin relay, which holds one slot;
- an embeddings batch on a pass-through path (the engine's log is the judge there: an input
  is done in milliseconds, too fast for /slots);
- a stream whose connection a gateway in front of the engine cuts while the engine generates
  on: the slot is held until the engine's /slots lists nothing processing, not for the
  drain's whole time; and one whose engine is killed mid-answer: served again as soon as the
  engine is back;
- plain requests through two detproxy instances of one fleet (a real etcd), which take turns on
  the engine (docs/fleet.md, "One sequence per engine across the fleet").

Uses scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the path); prints SKIPPED and exits
77 when it is missing or the Debian archive cannot be reached."""

import http.client
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import realutil  # noqa: E402
from realutil import engine, require_engine, server_log, servers, stop_servers  # noqa: E402
from harness import get_json, http as dp_http, poll_until, post_json, run_tests  # noqa: E402
from proxyutil import FrontCutter, metric, start_proxy  # noqa: E402
import etcdutil  # noqa: E402
from certs import shared_pki  # noqa: E402

TMP = tempfile.mkdtemp(prefix="detproxy-real-holes-")
FLAGS = ["--kv-unified", "-np", "4", "-t", "1"]
MANIFEST = {"framework": {"name": "llamacpp"}, "determinism": {"mode": "single_sequence"}}

require_engine()


class Slots:
    """Polls GET /slots; `peak` is the most entries ever seen processing at once."""

    def __init__(self, url):
        self.port = int(url.rsplit(":", 1)[1])
        self.peak = self.polls = 0
        self.stopped = False
        self.t = threading.Thread(target=self.run, daemon=True)
        self.t.start()

    def run(self):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        while not self.stopped:
            try:
                c.request("GET", "/slots")
                slots = json.loads(c.getresponse().read())
            except (OSError, http.client.HTTPException, ValueError):
                c.close()
                c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                time.sleep(0.01)
                continue
            self.polls += 1
            self.peak = max(self.peak, sum(1 for s in slots if s.get("is_processing")))
            time.sleep(0.002)

    def settle(self):
        """Wait for two polls taken after now: the engine as it is now has been seen."""
        seen = self.polls
        poll_until(lambda: self.polls >= seen + 2, what="two more /slots polls")

    def stop(self):
        self.stopped = True
        self.t.join(5)


def proxy_for(url, limits=None, upstream_tls=None):
    """detproxy with the single_sequence pool p on the engine at url."""
    pool = {"name": "p", "models": ["*"], "manifest": MANIFEST,
            "replicas": [{"name": "r1", "url": url}]}
    if upstream_tls:
        pool["upstream_tls"] = upstream_tls
    return start_proxy(pools=[pool], directory=TMP, timeout=30, limits=limits,
                       attestation={"interval_ms": 600000, "timeout_ms": 5000})


def setup():
    url = servers("holes", [FLAGS])[0]
    return url, proxy_for(url)


# Drains (and so holds) of 120 s: what a request would wait for were the engine not asked.
DRAIN_120S = {"upstream_first_byte_timeout_ms": 120000, "upstream_idle_timeout_ms": 120000}


def long_stream(px):
    """A streamed 2,000-token completion through px, on a socket of its own (returned)."""
    body = json.dumps({"model": "tiny", "prompt": "Once upon", "max_tokens": 2000,
                       "temperature": 0, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", px.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % len(body) + body)
    return s


def idle(url):
    port = int(url.rsplit(":", 1)[1])
    poll_until(lambda: not any(s["is_processing"] for s in get_json(port, "/slots")),
               timeout=60, what="the engine idle")


def test_a_count_that_wraps_to_three_in_llamacpp_is_refused_or_runs_one_sequence():
    url, px = setup()
    slots = Slots(url)
    try:
        seen = {}
        for key in ("n", "n_cmpl"):
            slots.peak = 0
            r = post_json(px.port, "/v1/completions",
                          {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 300,
                           "temperature": 0, key: 3 - 2 ** 32}, timeout=60)
            slots.settle()
            seen[key] = (r.status, slots.peak)
        assert all(peak <= 1 for _, peak in seen.values()), seen
    finally:
        slots.stop()
        px.stop()
        stop_servers()


def test_a_stream_the_engine_keeps_after_its_client_left_keeps_the_slot():
    url, px = setup()
    slots = Slots(url)
    try:
        body = json.dumps({"model": "tiny", "prompt": "Once upon", "max_tokens": 400,
                           "temperature": 0, "stream": True}).encode()
        s = socket.create_connection(("127.0.0.1", px.port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"x-conversation-id: holes-1\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.close()  # the client leaves; llama.cpp keeps generating for the stream session
        r = post_json(px.port, "/v1/completions", {"model": "tiny", "prompt": "Another",
                                                   "max_tokens": 200, "temperature": 0},
                      timeout=60)
        assert r.status == 200, r
        slots.settle()
        assert slots.peak <= 1, {"peak": slots.peak, "polls": slots.polls}
    finally:
        slots.stop()
        px.stop()
        idle(url)
        stop_servers()


def test_a_relayed_request_for_several_sequences_is_refused_or_runs_one():
    url, px = setup()
    slots = Slots(url)
    try:
        r = dp_http("POST", px.admin_port, "/admin/relay/v1/completions",
                    json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 300,
                                "temperature": 0, "n": 3}),
                    headers={"Content-Type": "application/json",
                             "x-detproxy-relay-pool": "p", "x-detproxy-relay-replica": "r1"},
                    timeout=60)
        slots.settle()
        assert slots.peak <= 1, {"status": r.status, "peak": slots.peak, "polls": slots.polls}
    finally:
        slots.stop()
        px.stop()
        stop_servers()


def launched_at_once(log, since=0):
    """The most slots the engine's log shows processing at once (launched, not yet released)
    at any line from offset `since` on; what was launched before it counts while it runs."""
    busy, peak, at = set(), 0, 0
    for line in log.splitlines(keepends=True):
        m = re.search(r"slot +(launch_slot_|release): id +(\d+) ", line)
        if m:
            (busy.add if m.group(1) == "launch_slot_" else busy.discard)(int(m.group(2)))
            if at >= since:
                peak = max(peak, len(busy))
        at += len(line)
    return peak


def test_an_embeddings_batch_on_a_pass_through_path_is_refused_one_input_runs_alone():
    """llama.cpp runs each input of an embeddings batch in a slot of its own, together: sent to
    the engine directly, its log shows the three slots launched before any is released.
    Through a single_sequence pool's pass-through path the batch is refused, and one input
    runs alone."""
    url = servers("emb", [FLAGS + ["--embeddings", "--pooling", "mean"]])[0]
    batch = {"input": ["alpha beta gamma delta", "one two three four", "x y z w"]}
    r = post_json(int(url.rsplit(":", 1)[1]), "/v1/embeddings", batch, timeout=60)
    assert r.status == 200 and len(r.json()["data"]) == 3, r
    assert launched_at_once(server_log()) == 3, server_log()[-2000:]
    mark = len(server_log())  # detproxy's own requests (its attestation probe) count from here
    pool = {"name": "p", "models": ["*"], "manifest": MANIFEST,
            "replicas": [{"name": "r1", "url": url}], "passthrough": ["POST /v1/embeddings"]}
    px = start_proxy(pools=[pool], directory=TMP, timeout=30,
                     attestation={"interval_ms": 600000, "timeout_ms": 5000})
    try:
        r = post_json(px.port, "/v1/embeddings", batch, timeout=60)
        assert r.status == 400 and r.json()["error"]["param"] == "input", r
        r = post_json(px.port, "/v1/embeddings", {"input": ["alpha beta gamma delta"]},
                      timeout=60)
        assert r.status == 200 and len(r.json()["data"]) == 1, r
        assert launched_at_once(server_log(), mark) == 1, server_log()[mark:]
    finally:
        px.stop()
        stop_servers()


def test_a_slot_held_after_a_gateway_cut_is_freed_once_the_engine_runs_nothing():
    """A gateway in front of llama.cpp cuts detproxy's side of a streamed answer and reads the
    engine's answer on, so the engine generates on. detproxy keeps the slot, with nothing left
    to read, and asks the engine's GET /slots: the next request starts once the engine lists
    nothing processing, not at the drain's limit (120 s here), and never beside the first."""
    # Two slots (so the engine could run two), each with room for a long answer: ~1-4 s of
    # generation here, mostly past the hold's first look (1 s); the engine's log is the judge
    # of "never beside", the time of "not the drain's".
    url = servers("holes", [["--kv-unified", "-np", "2", "-c", "4096", "-t", "1"]])[0]
    front = FrontCutter(int(url.rsplit(":", 1)[1]))
    px = proxy_for("http://127.0.0.1:%d" % front.port, DRAIN_120S)
    slots = Slots(url)
    try:
        mark = len(server_log())
        front.cut_when = ("POST /v1/completions", 1)  # at the answer's first bytes
        s = long_stream(px)
        while s.recv(65536):
            pass  # cut at its first bytes, the client's stream is cut too
        s.close()
        t_cut = time.monotonic()
        r = post_json(px.port, "/v1/completions", {"model": "tiny", "prompt": "Another",
                                                   "max_tokens": 50, "temperature": 0},
                      timeout=60)
        waited = time.monotonic() - t_cut
        print("after a gateway's cut: the next answer %.2f s later (drain limit 120 s), "
              "%d looks at /slots" % (waited, front.slot_looks))
        assert r.status == 200, r
        slots.settle()
        assert slots.peak <= 1, {"peak": slots.peak, "polls": slots.polls}
        assert launched_at_once(server_log(), mark) <= 1, server_log()[mark:]
        assert waited < 30, waited  # the engine's own end, not the 120 s drain
        assert metric(px, "detproxy_slot_holds_total", end="engine_idle") == 1
        assert front.slot_looks >= 2, front.slot_looks
    finally:
        slots.stop()
        px.stop()
        front.stop()
        idle(url)
        stop_servers()


def killed_mid_answer(tls_flags=(), upstream_tls=None):
    """llama.cpp killed mid-answer and started again on its port: the answer was cut with
    nothing left to read, so the slot is held, and the restarted engine's /slots lists nothing
    processing: requests are served again within seconds of the restart, not at the drain's
    limit (120 s here)."""
    flags = ["-np", "2", "-t", "1"] + list(tls_flags)
    url = servers("crash", [flags])[0]
    port = int(url.rsplit(":", 1)[1])
    name = realutil._started[-1]
    if upstream_tls:
        url = url.replace("http://", "https://")
    px = proxy_for(url, DRAIN_120S, upstream_tls=upstream_tls)
    try:
        s = long_stream(px)
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        engine("stop", name)  # mid-answer
        while s.recv(65536):
            pass  # the client's stream is cut
        s.close()
        engine("start", name, str(port), "f16", "--", *flags)
        t_back = time.monotonic()
        answers = []  # until one is served: 503 while the restarted engine is checked again

        def served():
            answers.append(post_json(px.port, "/v1/completions",
                                     {"model": "tiny", "prompt": "Again", "max_tokens": 20,
                                      "temperature": 0}, timeout=60).status)
            return answers[-1] == 200
        poll_until(served, timeout=60, interval=0.2, what="a request served again")
        waited = time.monotonic() - t_back
        print("after the engine's restart (%s): served again %.2f s later (drain limit 120 s), "
              "answers %s" % (url.split(":")[0], waited, answers))
        assert waited < 30, waited
        assert set(answers) <= {200, 503}, answers
        assert metric(px, "detproxy_slot_holds_total", end="engine_idle") == 1
    finally:
        px.stop()
        stop_servers()


def test_an_engine_killed_mid_answer_is_served_again_once_it_is_back():
    killed_mid_answer()


def test_an_https_engine_killed_mid_answer_is_asked_over_tls_once_it_is_back():
    """The same with llama-server serving https (--ssl-cert-file): the hold asks its /slots
    over TLS, trusting the pool's upstream_tls CA."""
    pki = shared_pki()
    d = os.path.join(realutil.REAL_DIR, "root", "tmp", "detproxy-tls-%d" % os.getpid())
    os.makedirs(d, exist_ok=True)
    for src, dst in ((pki.server.crt, "server.crt"), (pki.server.key, "server.key")):
        shutil.copy(src, os.path.join(d, dst))
    inside = "/tmp/" + os.path.basename(d)
    try:
        killed_mid_answer(["--ssl-cert-file", inside + "/server.crt",
                           "--ssl-key-file", inside + "/server.key"],
                          upstream_tls={"ca_file": pki.ca.crt})
    finally:
        shutil.rmtree(d, ignore_errors=True)


def killed_while_generating(px, url, tokens):
    """A non-streamed completion of `tokens` through px; px SIGKILLed once the engine at url
    generates it (which llama.cpp then finishes, its connection closed)."""
    body = json.dumps({"model": "tiny", "prompt": "Once upon", "max_tokens": tokens,
                       "temperature": 0}).encode()
    s = socket.create_connection(("127.0.0.1", px.port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
              % len(body) + body)
    port = int(url.rsplit(":", 1)[1])
    poll_until(lambda: any(x["is_processing"] for x in get_json(port, "/slots")),
               timeout=30, what="the generation running")
    px.popen.kill()
    px.popen.wait(10)
    s.close()


def served_alone(px, slots, mark, t0, what):
    """One request through px, answered, with /slots never listing two sequences processing and
    llama.cpp's log (from line `mark`) never launching two at once; the start checks px made
    that found the engine idle."""
    r = post_json(px.port, "/v1/completions", {"model": "tiny", "prompt": "Another",
                                               "max_tokens": 50, "temperature": 0}, timeout=120)
    waited = time.monotonic() - t0
    assert r.status == 200, r
    slots.settle()
    print("%s: served %.2f s after the kill; /slots peak %d over %d polls"
          % (what, waited, slots.peak, slots.polls))
    assert slots.peak <= 1, {"peak": slots.peak, "polls": slots.polls}
    assert launched_at_once(server_log(), mark) <= 1, server_log()[mark:]
    return metric(px, "detproxy_engine_start_checks_total", result="idle")


def test_a_proxy_killed_mid_answer_and_started_again_waits_for_what_it_left():
    """detproxy SIGKILLed while llama.cpp generates a non-streamed answer for it, and started
    again at once on the same config, as a supervisor does: llama.cpp finishes that answer
    (its connection closed), and the new process asks the engine's /slots before anything of
    its own starts there (its probe, then a client's request): never two at once."""
    url = servers("restart", [["--kv-unified", "-np", "2", "-c", "8192", "-t", "1"]])[0]
    slots = Slots(url)
    second = None
    try:
        first = proxy_for(url)
        mark = len(server_log())
        killed_while_generating(first, url, 2000)
        t0 = time.monotonic()
        second = proxy_for(url)  # ready: admitted once its probe ran
        checks = served_alone(second, slots, mark, t0,
                              "a restart beside an answer the killed process left")
        assert checks == 1, checks
    finally:
        slots.stop()
        if second:
            second.stop()
        idle(url)
        stop_servers()


def fleet_members(cluster, url, name, n, limits=None, lease_ttl_ms=2000):
    """n members of fleet `name` (instances gw-0, gw-1, ...), each with one single_sequence
    pool in front of the engine at url."""
    pool = {"name": "p", "models": ["*"], "manifest": MANIFEST,
            "replicas": [{"name": "r1", "url": url}]}
    fleet = {"name": name, "etcd": {"endpoints": cluster.endpoints()}}
    if lease_ttl_ms:
        fleet["lease_ttl_ms"] = lease_ttl_ms
    return [start_proxy(pools=[pool], directory=tempfile.mkdtemp(prefix="detproxy-real-fleet-"),
                        timeout=30, attestation={"interval_ms": 600000, "timeout_ms": 5000},
                        limits=limits, fleet=dict(fleet, instance="gw-%d" % i))
            for i in range(n)]


def two_members_on_one_engine(tag):
    """etcd, a llama.cpp engine and two members of fleet `tag` in front of it (2 s leases,
    answers waited for up to 120 s)."""
    cluster = etcdutil.EtcdCluster(1)
    url = servers(tag, [["--kv-unified", "-np", "2", "-c", "8192", "-t", "1"]])[0]
    return cluster, url, fleet_members(cluster, url, tag, 2, limits=DRAIN_120S)


def stop_fleet(slots, px, url, cluster):
    slots.stop()
    px.stop()
    idle(url)
    stop_servers()
    cluster.stop()


def test_a_fleet_member_killed_mid_answer_is_waited_for_by_the_next_holder():
    """Two fleet members in front of one engine; the one holding the engine's key is SIGKILLed
    while llama.cpp generates a non-streamed answer for it. llama.cpp finishes that answer (its
    connection closed) while the key waits out the killed member's 2 s lease. The member that
    takes the key then asks the engine's /slots before anything of its own starts there: never
    two sequences at once."""
    if etcdutil.ETCD is None:
        print("etcd is not installed (scripts/deps.sh installs etcd-server): skipped")
        return
    cluster, url, (a, b) = two_members_on_one_engine("fleetkill")
    slots = Slots(url)
    try:
        mark = len(server_log())
        killed_while_generating(a, url, 4000)
        checks = served_alone(b, slots, mark, time.monotonic(),
                              "a member killed mid-answer: the next holder")
        assert checks == 2, checks  # at its start, and when it took the key
    finally:
        stop_fleet(slots, b, url, cluster)


def test_a_fleet_member_stopped_mid_answer_hands_the_engine_on_clean():
    """A fleet member stopped (SIGTERM) while llama.cpp generates for it finishes that answer,
    then lets go of the engine's key with the clean mark before it revokes its lease: the other
    member's request, which waited for the key, starts with no /slots check of its own."""
    if etcdutil.ETCD is None:
        print("etcd is not installed (scripts/deps.sh installs etcd-server): skipped")
        return
    cluster, url, (a, b) = two_members_on_one_engine("fleetstop")
    port = int(url.rsplit(":", 1)[1])
    slots = Slots(url)
    try:
        out = {}

        def send(px, tokens):
            out[px.port] = post_json(px.port, "/v1/completions", {
                "model": "tiny", "prompt": "Once upon", "max_tokens": tokens,
                "temperature": 0}, timeout=120).status
        ta = threading.Thread(target=send, args=(a, 2000))
        ta.start()
        poll_until(lambda: any(x["is_processing"] for x in get_json(port, "/slots")),
                   timeout=30, what="a's answer generating")
        tb = threading.Thread(target=send, args=(b, 50))
        tb.start()
        poll_until(lambda: [e["wanted"] for e in get_json(b.admin_port,
                                                          "/admin/fleet")["engines"]] == [True],
                   what="b waiting for the key")
        t0 = time.monotonic()
        a.stop(timeout=60)
        stopped = time.monotonic() - t0
        for t in (ta, tb):
            t.join(120)
        slots.settle()
        checks = metric(b, "detproxy_engine_start_checks_total", result="idle")
        print("a member stopped mid-answer: exited %.2f s after SIGTERM; the other member's "
              "start checks %d; /slots peak %d over %d polls"
              % (stopped, checks, slots.peak, slots.polls))
        assert out == {a.port: 200, b.port: 200}, out
        assert slots.peak == 1, {"peak": slots.peak, "polls": slots.polls}
        assert checks == 1, checks  # at its start only: the key came marked clean
    finally:
        stop_fleet(slots, b, url, cluster)


def test_two_fleet_members_run_one_sequence_on_the_engine():
    if etcdutil.ETCD is None:
        print("etcd is not installed (scripts/deps.sh installs etcd-server): skipped")
        return
    cluster = etcdutil.EtcdCluster(1)
    urls = servers("holes", [FLAGS])
    pxs = fleet_members(cluster, urls[0], "t", 2, lease_ttl_ms=None)
    slots = Slots(urls[0])
    try:
        out = []

        def send(px, i):
            out.append(post_json(px.port, "/v1/completions", {
                "model": "tiny", "prompt": "Story %d: once upon a time" % i, "max_tokens": 200,
                "temperature": 0}, timeout=120).status)
        ts = [threading.Thread(target=send, args=(px, i)) for i in range(2) for px in pxs]
        for t in ts:
            t.start()
        for t in ts:
            t.join(180)
        slots.settle()
        print("4 requests through 2 fleet members: /slots peak %d over %d polls" % (
            slots.peak, slots.polls))
        assert out == [200] * 4, out
        assert slots.peak == 1, {"peak": slots.peak, "polls": slots.polls}
    finally:
        slots.stop()
        for px in pxs:
            px.stop()
        stop_servers()
        cluster.stop()


if __name__ == "__main__":
    run_tests(globals())
