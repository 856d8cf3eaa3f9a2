"""detproxy's own requests in front of real llama.cpp servers whose outputs depend on the batch
(`--kv-unified -np 4`): with max_inflight_per_replica 1, drift shadows (cross and self), a
candidate pool's copies, the canary, native attestation every 100 ms and a `detproxy diagnose`
run beside the proxy (through its admin relay) all hold the replica's one slot (docs/drift.md, "Which requests are copied, and where"; docs/attestation.md, "Our own
requests take a slot"). A recording relay in front of each server counts generation requests in
flight: never two, and every answer at temperature 0 equals the same prompt sent alone. Prints a
`measured:` line (answers compared, overlaps, copies skipped). Copies themselves may still
differ where they meet llama.cpp's prompt cache, another numerical path: the clients here send
`cache_prompt: false` (their copies carry the same body; a `single_sequence` pool forces it),
since with the cache a prompt's answer depends on what the slot served before, one at a time
or not.

Uses scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the path); prints SKIPPED and exits
77 when it is missing or the Debian archive cannot be reached."""

import hashlib
import json
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from realutil import require_engine, servers, stop_servers  # noqa: E402
from harness import (DETPROXY_BIN, free_port, get_json, poll_until, post_json, run_cmd,  # noqa: E402
                     run_tests)
from proxyutil import metric, start_proxy  # noqa: E402

TMP = tempfile.mkdtemp(prefix="detproxy-real-own-")
FLAGS = ["--kv-unified", "-np", "4", "-t", "1"]
PROMPTS = ["Line %d of the tally: the farm counted %d sheep and" % (i, 5 * i + 2)
           for i in range(20)]
MAX_TOKENS = 24
ROUNDS = 10
CLIENTS = 8

require_engine()


class Relay:
    """A TCP relay in front of one server that counts generation requests (POST .../completions)
    between their first byte and the end of their response, per connection (detproxy never
    pipelines): `max_seen` is the most that were ever in flight at once."""

    def __init__(self, port):
        self.target = port
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.inflight = self.max_seen = self.generations = 0
        threading.Thread(target=self.accept, daemon=True).start()

    def url(self):
        return "http://127.0.0.1:%d" % self.port

    def accept(self):
        while True:
            c, _ = self.lsock.accept()
            u = socket.create_connection(("127.0.0.1", self.target))
            state = {"gen": False, "at_start": True}
            threading.Thread(target=self.up, args=(c, u, state), daemon=True).start()
            threading.Thread(target=self.down, args=(u, c, state), daemon=True).start()

    def up(self, c, u, state):
        while True:
            try:
                data = c.recv(65536)
            except OSError:  # closed by down(): the server closed the connection
                data = b""
            if not data:
                u.close()
                return
            with self.lock:
                if state["at_start"] and not state.get("closed"):
                    state["at_start"] = False
                    line = data.split(b"\r\n", 1)[0]
                    if line.startswith(b"POST ") and b"completions" in line:
                        state["gen"] = True
                        self.generations += 1
                        self.inflight += 1
                        self.max_seen = max(self.max_seen, self.inflight)
            try:
                u.sendall(data)
            except OSError:
                # The server had closed the connection (its keep-alive ran out as detproxy
                # reused it): this request gets no response and generates nothing.
                self.end(state)
                return

    def down(self, u, c, state):
        """Forward the responses; at the end of each (found before its last bytes go out, so
        the next request cannot arrive first) the connection's request is over."""
        buf = b""
        while True:
            try:
                data = u.recv(65536)
            except OSError:  # closed by up(): detproxy closed the connection
                data = b""
            if not data:
                self.end(state)
                with self.lock:
                    state["closed"] = True  # what up() still reads here is never answered
                c.close()
                return
            buf += data
            while True:
                head_end = buf.find(b"\r\n\r\n")
                if head_end < 0:
                    break
                head = buf[:head_end].decode("latin-1").lower()
                body_start = head_end + 4
                length = None
                for h in head.split("\r\n")[1:]:
                    if h.startswith("content-length:"):
                        length = int(h.split(":", 1)[1])
                if length is not None:
                    if len(buf) < body_start + length:
                        break
                    buf = buf[body_start + length:]
                elif "chunked" in head:
                    end = buf.find(b"\r\n0\r\n\r\n", body_start - 2)
                    if end < 0:
                        break
                    buf = buf[end + 7:]
                else:
                    break
                self.end(state)
            c.sendall(data)

    def end(self, state):
        with self.lock:
            if state.get("gen"):
                state["gen"] = False
                self.inflight -= 1
            state["at_start"] = True


def alone(url, prompt, **extra):
    """The server's answer to prompt sent directly, nothing else on it."""
    port = int(url.rsplit(":", 1)[1])
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "cache_prompt": False}
    body.update(extra)
    r = post_json(port, "/v1/completions", body, timeout=60)
    assert r.status == 200, r
    return r.json()["choices"][0]["text"]


def test_one_slot_holds_for_every_request_we_send():
    urls = servers("own", [FLAGS, FLAGS, FLAGS])
    try:
        reference = [alone(urls[0], p) for p in PROMPTS]
        can_text = alone(urls[0], "Count: one, two,", seed=0, max_tokens=8)
        canary = {"prompt": "Count: one, two,", "max_tokens": 8,
                  "expected_sha256": hashlib.sha256(can_text.encode()).hexdigest()}
        relays = [Relay(int(u.rsplit(":", 1)[1])) for u in urls]
        man = {"framework": {"name": "llamacpp"}, "canary": canary}

        def pool(name, rs, **extra):
            p = {"name": name, "models": ["*"], "manifest": man, "max_inflight_per_replica": 1,
                 "queue_limit": 1000, "queue_timeout_ms": 60000,
                 "replicas": [{"name": "%s%d" % (name, i + 1), "url": r.url(),
                               "attest": {"source": "llamacpp"}} for i, r in enumerate(rs)]}
            p.update(extra)
            return p
        px = start_proxy(pools=[pool("p", relays[:2], candidates=[{"pool": "next", "rate": 1.0}]),
                                pool("next", relays[2:])],
                         directory=TMP, timeout=30, workers=2,
                         admin_listen="127.0.0.1:%d" % free_port(),
                         shadow={"rate": 0.5, "self_rate": 0.5, "max_inflight": 8,
                                 "max_output_bytes": 65536},
                         attestation={"interval_ms": 100, "timeout_ms": 5000},
                         policy={"tenants": [{"name": "t", "match": {"any": True}}]})
        try:
            poll_until(lambda: all(r["state"] == "admitted" for r in
                                   get_json(px.admin_port, "/admin/replicas")["replicas"]),
                       timeout=30, what="every replica admitted")
            todo = [i for _ in range(ROUNDS) for i in range(len(PROMPTS))]
            wrong, lock, errors = [], threading.Lock(), []
            t0 = time.monotonic()

            def client():
                while True:
                    with lock:
                        if not todo:
                            return
                        i = todo.pop()
                    try:
                        r = post_json(px.port, "/v1/completions",
                                      {"model": "tiny", "prompt": PROMPTS[i],
                                       "max_tokens": MAX_TOKENS, "temperature": 0,
                                       "cache_prompt": False}, timeout=120)
                        assert r.status == 200, r
                        if r.json()["choices"][0]["text"] != reference[i]:
                            with lock:
                                wrong.append(i)
                    except Exception as e:  # noqa: BLE001 (reported below)
                        errors.append(repr(e))
            diag = {}
            ts = [threading.Thread(target=client) for _ in range(CLIENTS)]
            ts.append(threading.Thread(target=lambda: diag.update(zip(
                ("rc", "out", "err"),
                run_cmd([DETPROXY_BIN, "diagnose", "-c", px.config_path, "--pool", "p", "--json",
                         "--repeat", "4", "--concurrency", "4"], timeout=600)))))
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert diag["rc"] in (0, 1) and json.loads(diag["out"])["through_proxy"], diag
            took = time.monotonic() - t0
            assert not errors, errors[:3]
            poll_until(lambda: metric(px, "detproxy_shadow_copies") == 0, timeout=30,
                       what="every copy ended")
            shadow = {k: metric(px, "detproxy_shadow_total", pool="p", result=k)
                      for k in ("match", "diverged", "skipped", "error")}
            cand = {k: metric(px, "detproxy_candidate_total", pool="p", result=k)
                    for k in ("match", "diverged", "skipped", "error")}
            canaries = sum(metric(px, "detproxy_attestations_total", result=k)
                           for k in ("canary_ok", "canary_mismatch"))
            n = ROUNDS * len(PROMPTS)
            print("measured: " + json.dumps({
                "flags": " ".join(FLAGS), "client_requests": n, "clients": CLIENTS,
                "seconds": round(took, 1), "answers_differing_from_alone": len(wrong),
                "max_generations_in_flight_per_server": [r.max_seen for r in relays],
                "generations_at_servers": sum(r.generations for r in relays),
                "drift_shadows": shadow, "candidate_copies": cand, "canaries": canaries,
                "diagnose_verdicts": [f["cause"] for f in json.loads(diag["out"])["findings"]],
                "shadows_skipped_per_100_requests": round(100.0 * shadow["skipped"] / n, 1)}),
                flush=True)
            assert [r.max_seen for r in relays] == [1, 1, 1], [r.max_seen for r in relays]
            assert not wrong, sorted(set(wrong))
            assert sum(r.generations for r in relays) > n + canaries, "no copies or probes sent"
            assert canaries > 0 and cand["match"] + cand["diverged"] > 0, (canaries, cand)
        finally:
            px.stop()
    finally:
        stop_servers()


if __name__ == "__main__":
    run_tests(globals())
