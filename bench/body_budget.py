#!/usr/bin/env python3
"""The request-body budget against slow-body clients (docs/configuration.md, "limits"): do
ordinary clients keep being answered while 200 slow clients hold request bodies open?

    bench/body_budget.py [--results bench/RESULTS.md] [--baseline PATH] [--seconds 10]

detproxy with its default limits (max_body_bytes 8 MiB, max_inflight_body_bytes 256 MiB,
client_body_timeout_ms 60 s) in front of one detproxy-sim replica. Ordinary clients: 8
keep-alive connections from 127.0.0.1 sending 1 KiB completions back to back. Slow clients: 200
connections from 127.0.0.2, each declaring `Content-Length: 8388608`, in one of two ways:

- declare: send the head and a few bytes, then one byte a second each (the body budget used to
  reserve the declared length: 32 such connections refused every other body);
- fill: send 2 MiB of the body at once (200 x 2 MiB is more than the whole budget), then one
  byte a second each.

A slow client that is closed (shed, or timed out) connects again at once and starts over, as an
attacker would. Per variant: ordinary requests, success ratio (200s), p50/p99 latency at the
client, and detproxy_overload_rejections_total by reason. --baseline runs the same against
another detproxy binary (an older build) beside this one. Writes section "### 13." of
--results (replacing an older one; "-": only print). Needs a release build (make build).
"""
import argparse
import http.client
import json
import os
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
sys.path.insert(0, HERE)

import proxyutil  # noqa: E402
from harness import poll_until, start_sim  # noqa: E402
from proxyutil import metric, pool, rss_kb, start_proxy  # noqa: E402

MODEL = "m1"
MiB = 1 << 20
DECLARED = 8 * MiB
ORDINARY_BODY = json.dumps({"model": MODEL, "max_tokens": 1,
                            "prompt": "x" * (1024 - 40)}).encode()


def slow_head(port):
    return ("POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json"
            "\r\ncontent-length: %d\r\n\r\n" % (port, DECLARED)).encode()


class SlowClients:
    """n connections from `source`, each sending `burst` body bytes after its head, then one byte
    a second; a closed one connects again. One thread, non-blocking sockets."""

    def __init__(self, port, n, burst, source="127.0.0.2"):
        self.port, self.n, self.burst, self.source = port, n, burst, source
        self.sel = selectors.DefaultSelector()
        self.stop = threading.Event()
        self.connects = 0
        self.closed_by_proxy = 0
        self.payload = slow_head(port) + b'{"model":"m1","prompt":"' + b"x" * burst
        self.th = threading.Thread(target=self.run, daemon=True)

    def open_one(self):
        s = socket.socket()
        s.setblocking(False)
        s.bind((self.source, 0))
        try:
            s.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        self.connects += 1
        # state: bytes of the payload still to send, when the next trickled byte is due
        self.sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE,
                          {"left": memoryview(self.payload), "next": 0.0})

    def close_one(self, s):
        self.sel.unregister(s)
        s.close()

    def run(self):
        for _ in range(self.n):
            self.open_one()
        while not self.stop.is_set():
            now = time.monotonic()
            for key, ev in self.sel.select(timeout=0.05):
                s, st = key.fileobj, key.data
                if ev & selectors.EVENT_READ:
                    # An answer (408, 503) or a close: either way, start over.
                    try:
                        s.recv(65536)
                    except OSError:
                        pass
                    self.closed_by_proxy += 1
                    self.close_one(s)
                    self.open_one()
                    continue
                if ev & selectors.EVENT_WRITE and len(st["left"]):
                    try:
                        k = s.send(st["left"][:256 * 1024])
                        st["left"] = st["left"][k:]
                    except BlockingIOError:
                        pass
                    except OSError:
                        self.closed_by_proxy += 1
                        self.close_one(s)
                        self.open_one()
                        continue
                    if not len(st["left"]):
                        self.sel.modify(s, selectors.EVENT_READ, st)
                        st["next"] = now + 1.0
            # the trickle: one byte a second each, on a blocking-free best effort
            for key in list(self.sel.get_map().values()):
                st = key.data
                if not len(st["left"]) and now >= st["next"]:
                    try:
                        key.fileobj.send(b"x")
                    except OSError:
                        pass
                    st["next"] = now + 1.0
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()

    def start(self):
        self.th.start()

    def join(self):
        self.stop.set()
        self.th.join()


def slow_worker(port, n, burst):
    """The slow clients in a process of their own (their loop must not take the ordinary
    clients' interpreter lock): they run until stdin closes, then print their counts."""
    slow = SlowClients(port, n, burst)
    slow.start()
    sys.stdin.read()
    slow.join()
    print(json.dumps({"connects": slow.connects, "closed_by_proxy": slow.closed_by_proxy}),
          flush=True)


class SlowProcess:
    def __init__(self, port, n, burst):
        self.p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--slow-worker",
                                   str(port), str(n), str(burst)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.connects = 0

    def join(self):
        out, _ = self.p.communicate("", timeout=60)
        self.connects = json.loads(out.strip().splitlines()[-1])["connects"]


def ordinary_load(port, conns, seconds):
    """conns keep-alive clients sending ORDINARY_BODY back to back for `seconds`: a list of
    (status or error name, latency s)."""
    out, lock = [], threading.Lock()
    end = time.monotonic() + seconds

    def client():
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        mine = []
        while time.monotonic() < end:
            t0 = time.monotonic()
            try:
                c.request("POST", "/v1/completions", body=ORDINARY_BODY,
                          headers={"content-type": "application/json"})
                r = c.getresponse()
                r.read()
                st = r.status
                if r.getheader("connection", "").lower() == "close":
                    c.close()
            except (OSError, http.client.HTTPException) as e:
                st = type(e).__name__
                c.close()
            mine.append((st, time.monotonic() - t0))
        c.close()
        with lock:
            out.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    return xs[min(len(xs) - 1, int(round(p / 100.0 * (len(xs) - 1))))]


def run_variant(binary, label, variant, args):
    proxyutil.DETPROXY_BIN = binary
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[pool("p", [MODEL], [sim])])
    slow = None
    try:
        if variant != "none":
            slow = SlowProcess(px.port, args.slow, 16 if variant == "declare" else 2 * MiB)
            # Every slow client connected and its burst sent (the budget full, for "fill"), and
            # past the stall bound, before the ordinary clients start.
            poll_until(lambda: metric(px, "detproxy_connections") >= args.slow, timeout=60,
                       what="the slow clients connected")
            time.sleep(2.0)
        rss0 = rss_kb(px)
        res = ordinary_load(px.port, args.conns, args.seconds)
        rss1 = rss_kb(px)
        if slow:
            slow.join()
        lat = [t for st, t in res if st == 200]
        reasons = {r: metric(px, "detproxy_overload_rejections_total", reason=r) or 0
                   for r in ("body_budget", "body_shed")}
        statuses = {}
        for st, _ in res:
            statuses[str(st)] = statuses.get(str(st), 0) + 1
        row = {"scenario": 13, "target": label, "slow": variant,
               "slow_clients": args.slow if slow else 0, "ordinary_conns": args.conns,
               "seconds": args.seconds, "requests": len(res), "ok": len(lat),
               "success": len(lat) / max(1, len(res)),
               "p50_ms": 1000 * pct(lat, 50) if lat else None,
               "p99_ms": 1000 * pct(lat, 99) if lat else None,
               "statuses": statuses, "overload": reasons,
               "slow_connects": slow.connects if slow else 0,
               "rss_kb": max(rss0, rss1)}
    finally:
        if slow and slow.p.poll() is None:
            slow.p.kill()
        px.stop()
        sim.stop()
    return row


def markdown(rows, meta):
    out = ["### 13. Body budget: ordinary clients while 200 slow-body clients run",
           "",
           "- %s; detproxy %s%s; load average at start %s" % (
               meta["date"], meta["version"],
               ", baseline %s" % meta["baseline"] if meta["baseline"] else "", meta["load"]),
           "- command: `%s`" % meta["command"], "",
           "Default limits (8 MiB bodies, 256 MiB budget, 60 s body timeout), one worker, one "
           "detproxy-sim replica. Ordinary: %d keep-alive connections from 127.0.0.1, 1 KiB "
           "completions back to back for %d s. Slow: %d connections from 127.0.0.2 declaring "
           "`Content-Length: 8388608`, sending 16 bytes (*declare*) or 2 MiB (*fill*: 400 MiB "
           "in all, more than the budget) and then one byte a second each, reconnecting when "
           "closed. Latency at the client (Python), of the 200s." % (
               meta["conns"], meta["seconds"], meta["slow"]), "",
           "| detproxy | slow clients | ordinary requests | success | p50 ms | p99 ms | "
           "refused `body_budget` | shed `body_shed` | slow reconnects | RSS MB |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        f = (lambda v: "%.1f" % v if v is not None else "-")
        out.append("| %s | %s | %d | %.2f%% | %s | %s | %d | %d | %d | %d |" % (
            r["target"], "none" if r["slow"] == "none" else "%d %s" % (r["slow_clients"],
                                                                         r["slow"]),
            r["requests"], 100 * r["success"], f(r["p50_ms"]), f(r["p99_ms"]),
            r["overload"]["body_budget"], r["overload"]["body_shed"],
            max(0, r["slow_connects"] - r["slow_clients"]), r["rss_kb"] // 1024))
    out.append("")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--slow", type=int, default=200)
    ap.add_argument("--conns", type=int, default=8)
    ap.add_argument("--variants", default="none,declare,fill")
    ap.add_argument("--baseline", default=os.environ.get("BENCH_BASELINE", ""),
                    help="another detproxy binary to run the same against")
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"),
                    help='RESULTS.md to put section 13 in ("-": only print)')
    ap.add_argument("--slow-worker", nargs=3, type=int, metavar=("PORT", "N", "BURST"),
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.slow_worker:
        slow_worker(*args.slow_worker)
        return
    version = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"],
                             capture_output=True, text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "version": version,
            "baseline": args.baseline, "load": " ".join(open("/proc/loadavg").read().split()[:3]),
            "command": " ".join(["bench/body_budget.py"] + sys.argv[1:]),
            "conns": args.conns, "seconds": args.seconds, "slow": args.slow}
    targets = [("detproxy", proxyutil.DETPROXY_BIN)]
    if args.baseline:
        targets.append(("baseline", args.baseline))
    rows = []
    for variant in args.variants.split(","):
        for label, binary in targets:
            r = run_variant(binary, label, variant, args)
            print(json.dumps(r), flush=True)
            rows.append(r)
    text = markdown(rows, meta)
    print(text)
    if args.results != "-":
        from report import splice
        splice(args.results, text, rows, meta)
    bad = [r for r in rows if r["target"] == "detproxy" and r["success"] < 0.99]
    if bad:
        sys.exit("ordinary clients under 99%% success: %s" % ", ".join(r["slow"] for r in bad))


if __name__ == "__main__":
    main()
