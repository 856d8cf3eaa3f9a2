#!/usr/bin/env python3
"""The fleet's cost (docs/fleet.md), measured against a real 3-member etcd cluster on loopback:

- the data plane's p50/p99 and rps through one detproxy without a fleet and through a member of
  a 3-instance fleet, in the same run (rounds interleaved, order alternated), while the fleet is
  busy: attestation verdicts every 500 ms, and a drain/enable on another member every 100 ms
  that the measured member's watch applies;
- etcd requests per second per instance at steady state (no operator changes), and with those
  drains.

    bench/fleet.py [--build build/release] [--rounds 5] [--seconds 3] [--results bench/RESULTS.md]

Writes section "### 14." of --results ("-": only print). Needs wrk and etcd (Debian's
etcd-server), and a release build (make build).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))
import etcdutil  # noqa: E402
from harness import free_port  # noqa: E402


def get(port, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
        return json.loads(r.read())


def post(port, path):
    req = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path), data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.status


def wait(cond, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if cond():
                return
        except OSError:
            pass
        time.sleep(0.05)
    sys.exit("bench/fleet.py: timed out waiting for " + what)


class Proxy:
    def __init__(self, detproxy, workdir, name, upstreams, cluster=None):
        self.port, self.admin = free_port(), free_port()
        cfg = {
            "listen": "127.0.0.1:%d" % self.port, "admin_listen": "127.0.0.1:%d" % self.admin,
            "limits": {"max_connections": 30000, "client_idle_timeout_ms": 300000},
            "attestation": {"interval_ms": 500, "timeout_ms": 2000, "require_signature": False,
                            "trusted_keys": []},
            "pools": [{"name": "bench", "models": ["bench-model"],
                       "manifest": {"model": "bench-model",
                                    "framework": {"name": "vllm", "version": "0.6.3"}},
                       "replicas": [{"name": "u%d" % (i + 1), "url": "http://127.0.0.1:%d" % p,
                                     "attest": {"source": "vllm"}}
                                    for i, p in enumerate(upstreams)]}],
            "policy": {"tenants": [{"name": "default", "match": {"any": True},
                                    "sampling": {"temperature": {"force": 0},
                                                 "seed": {"derive": True}}}]},
            "log": {"level": "warn"}}
        if cluster:
            cfg["fleet"] = {"name": "bench", "instance": name, "lease_ttl_ms": 3000,
                            "etcd": {"endpoints": cluster.endpoints()}}
        path = os.path.join(workdir, name + ".json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        self.log = open(os.path.join(workdir, name + ".log"), "w")
        self.p = subprocess.Popen([detproxy, "run", "-c", path], stdout=self.log,
                                  stderr=subprocess.STDOUT)
        wait(lambda: get(self.admin, "/readyz") is not None, 10, name + " ready")
        wait(lambda: all(r["state"] == "admitted"
                         for r in get(self.admin, "/admin/replicas")["replicas"]), 10,
             name + " replicas admitted")

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=10)
        self.log.close()


def wrk(port, seconds, conns):
    out = subprocess.run(
        ["wrk", "-t1", "-c%d" % conns, "-d%ds" % seconds, "-s", os.path.join(HERE, "post.lua"),
         "http://127.0.0.1:%d/v1/chat/completions" % port],
        env=dict(os.environ, BENCH_BODY=os.path.join(HERE, "chat_1k.json")),
        capture_output=True, text=True, check=True).stdout
    m = re.search(r"WRKJSON (\{.*\})", out)
    return json.loads(m.group(1))


def etcd_rate(proxies, seconds):
    before = [get(p.admin, "/admin/fleet")["etcd_requests"] for p in proxies]
    time.sleep(seconds)  # the measured window
    after = [get(p.admin, "/admin/fleet")["etcd_requests"] for p in proxies]
    return [(a - b) / seconds for a, b in zip(after, before)]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build", "release"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=3)
    ap.add_argument("--connections", type=int, default=32)
    ap.add_argument("--results", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    if etcdutil.ETCD is None:
        sys.exit("bench/fleet.py: etcd is not installed (scripts/deps.sh installs etcd-server)")
    detproxy = os.path.join(args.build, "proxy", "detproxy")
    up = subprocess.run(["bash", "-c", 'source "%s/lib.sh" && bench_tools "%s" && echo "$UP"'
                         % (HERE, args.build)], capture_output=True, text=True, check=True)
    upstream = up.stdout.strip().splitlines()[-1]
    work = tempfile.mkdtemp(prefix="detproxy-bench-fleet-")
    ports = [free_port(), free_port()]
    upp = subprocess.Popen([upstream] + sum([["--listen", "127.0.0.1:%d" % p] for p in ports], [])
                           + ["--model", "bench-model", "--framework-version", "0.6.3"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cluster = etcdutil.EtcdCluster(3)
    t0 = time.time()
    load0 = os.getloadavg()
    off = Proxy(detproxy, work, "off", ports)
    members = [Proxy(detproxy, work, "gw-%d" % i, ports, cluster) for i in range(3)]
    wait(lambda: all(len(get(p.admin, "/admin/fleet")["members"]) == 3 and
                     get(p.admin, "/admin/fleet")["attestation"]["mode"] == "shared"
                     for p in members), 15, "3 fleet members sharing attestation")
    steady = etcd_rate(members, 10)
    # Fleet activity during the data-plane runs: a drain and an enable of u2 on gw-1 every
    # 100 ms (applied by gw-0's watch); u1 always serves.
    stop = threading.Event()
    changes = [0]

    def churn():
        k = 0
        while not stop.is_set():
            post(members[1].admin, "/admin/replicas/u2/%s" % ("drain" if k % 2 == 0 else "enable"))
            k += 1
            changes[0] = k
            stop.wait(0.1)
    th = threading.Thread(target=churn, daemon=True)
    th.start()
    busy = etcd_rate(members, 5)
    rows = []
    for r in range(args.rounds):
        order = [("off", off), ("fleet", members[0])]
        if r % 2:
            order.reverse()
        for label, p in order:
            res = wrk(p.port, args.seconds, args.connections)
            res.update(target=label, round=r)
            rows.append(res)
            print("round %d %-5s rps %8.0f p50 %5d us p99 %6d us non2xx %d" % (
                r, label, res["rps"], res["p50_us"], res["p99_us"], res["non2xx"]), flush=True)
    stop.set()
    th.join()
    for p in [off] + members:
        p.stop()
    cluster.stop()
    upp.terminate()
    took = time.time() - t0

    def col(label, key):
        return [x[key] for x in rows if x["target"] == label]
    text = ["### 14. Fleet on vs off: the data plane's latency, and etcd's load per instance", ""]
    text.append("Same run, rounds interleaved (order alternated), %d rounds x %d s, wrk -t1 -c%d, "
                "1 KB chat POST, pool of two bench upstreams, attestation every 500 ms. `fleet`: "
                "gw-0 of 3 members on a 3-member etcd cluster (loopback), while gw-1 drained and "
                "enabled u2 every 100 ms (%d changes, each applied by gw-0's watch) and verdicts "
                "were published." % (
                    args.rounds, args.seconds, args.connections, changes[0]))
    text.append("")
    text.append("Load average at start %.2f, at end %.2f (the box is shared: other work ran "
                "during the run; both targets saw it alike, round by round)." % (
                    load0[0], os.getloadavg()[0]))
    text.append("")
    text.append("| target | rps (med) | p50 µs (med) | p99 µs best | p99 µs (med) | non-2xx |")
    text.append("|---|---:|---:|---:|---:|---:|")
    for label in ("off", "fleet"):
        text.append("| %s | %s | %d | %d | %d | %d |" % (
            label, "{:,.0f}".format(median(col(label, "rps"))), median(col(label, "p50_us")),
            min(col(label, "p99_us")), median(col(label, "p99_us")), sum(col(label, "non2xx"))))
    ratio = median([a["p99_us"] / b["p99_us"] for a, b in zip(
        [x for x in rows if x["target"] == "fleet"], [x for x in rows if x["target"] == "off"])])
    text.append("")
    text.append("**p99 fleet/off** (median of same-round ratios): %.2fx" % ratio)
    text.append("")
    text.append("etcd requests per second per instance (HTTP requests to etcd, /admin/fleet "
                "`etcd_requests`): steady state over 10 s, one pool of two replicas at a 500 ms "
                "attestation interval, no operator changes: %s; with a drain or enable every "
                "100 ms on gw-1, over 5 s: %s." % (
                    ", ".join("%.1f" % x for x in steady), ", ".join("%.1f" % x for x in busy)))
    text.append("")
    section = "\n".join(text) + "\n"
    print(section)
    if args.results != "-":
        sys.path.insert(0, HERE)
        from report import splice
        splice(args.results, section, rows,
               {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)),
                "took_s": round(took)})


if __name__ == "__main__":
    main()
