"""The fleet (docs/fleet.md, "Who may write the prefix") against forged keys written straight
into a real etcd cluster on loopback: a verdict from someone not the replica's attester, member
keys without a lease, our own member key overwritten, junk that makes the state read large.
None of them changes what an instance serves or keeps the instances apart."""

import base64
import json
import os
import signal
import socket
import sys
import tempfile
import time

from harness import (DETPROXY_BIN, SLOW, get_json, http, poll_until, post_json, run_cmd,
                     run_tests, start_sim)
from proxyutil import pool, start_proxy, write_config
import etcdutil
from etcdutil import b64

if etcdutil.ETCD is None:
    print("etcd is not installed (scripts/deps.sh installs etcd-server): skipped")
    sys.exit(77)

from test_fleet import MODEL, drained, fleet, fleet_cfg, start_fleet, wait_members  # noqa: E402

CKPT = "a" * 64


def put(cluster, key, value):
    """A put with no lease, as any client with write access to the prefix can make."""
    cluster.call("/v3/kv/put", {"key": b64(key), "value": b64(json.dumps(value))})


def get(cluster, key):
    kvs = cluster.call("/v3/kv/range", {"key": b64(key)}).get("kvs", [])
    return kvs[0] if kvs else None


def replicas(px):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def test_a_verdict_from_a_non_attester_is_not_applied():
    """A verdict whose origin is no live member (nor the replica's attester) is not applied: a
    replica this instance itself rejected for its quantization stays out."""
    prefix = os.path.join(tempfile.mkdtemp(prefix="detproxy-fleet-attacks-"), "pipeline")
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", prefix])
    assert rc == 0, err
    key, pub = prefix + ".key.pem", prefix + ".pub.pem"

    def sim(quant):
        return start_sim("--model", MODEL, "--flavor", "vllm", "--framework-version", "0.6.3",
                         "--quantization", quant, "--dtype", "float16", "--checkpoint-sha256",
                         CKPT, "--attest-key", key)

    cluster = etcdutil.EtcdCluster(1)
    honest, liar = sim("awq"), sim("gptq")
    man = {"model": MODEL, "checkpoint_sha256": CKPT, "quantization": "awq", "dtype": "float16",
           "framework": {"name": "vllm", "version": "0.6.3"}}
    p = pool("p", [MODEL], [honest, liar], manifest=man)
    for r, s in zip(p["replicas"], (honest, liar)):
        r["attest"] = {"source": "agent", "url": "http://127.0.0.1:%d/attestation" % s.port}
    px = start_proxy(pools=[p], fleet=fleet_cfg(cluster, "gw-0"),
                     attestation={"interval_ms": 60000, "timeout_ms": 2000,
                                  "require_signature": True, "trusted_keys": [pub]})
    wait_members([px], 1)
    poll_until(lambda: replicas(px)["r2"]["state"] == "rejected", timeout=10 * SLOW,
               what="r2 rejected here")
    put(cluster, "/detproxy/t/verdicts/p/r2",
        {"origin": "ghost", "state": "admitted", "reasons": [], "canary": "pass",
         "at_ms": int(time.time() * 1000), "interval_ms": 60000})
    time.sleep(1.0)  # the watch delivers within milliseconds (docs/fleet.md: p99 < 100 ms)
    seen = set()
    for i in range(20):
        r = post_json(px.port, "/v1/completions",
                      {"model": MODEL, "prompt": "f%d" % i, "max_tokens": 2})
        assert r.status == 200, r.status
        seen.add(r.headers["x-detproxy-replica"])
    state = replicas(px)["r2"]["state"]
    px.stop()
    cluster.stop()
    assert state == "rejected" and seen == {"r1"}, (state, seen)


def forged_verdict_is_not_applied(with_member_key):
    """A good replica r1, admitted by two members; a writer with access to the prefix puts,
    on a lease of its own, a verdict rejecting r1 in the name of r1's real attester, and with
    with_member_key a copy of that attester's member key beside it in one transaction. The
    other member sees the verdict and does not apply it: r1 keeps serving."""
    prefix = os.path.join(tempfile.mkdtemp(prefix="detproxy-fleet-attacks-"), "pipeline")
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", prefix])
    assert rc == 0, err
    key, pub = prefix + ".key.pem", prefix + ".pub.pem"
    cluster = etcdutil.EtcdCluster(1)
    honest = start_sim("--model", MODEL, "--flavor", "vllm", "--framework-version", "0.6.3",
                       "--quantization", "awq", "--dtype", "float16", "--checkpoint-sha256",
                       CKPT, "--attest-key", key)
    man = {"model": MODEL, "checkpoint_sha256": CKPT, "quantization": "awq", "dtype": "float16",
           "framework": {"name": "vllm", "version": "0.6.3"}}
    pxs = []
    for i in range(2):
        p = pool("p", [MODEL], [honest], manifest=man)
        p["replicas"][0]["attest"] = {"source": "agent",
                                      "url": "http://127.0.0.1:%d/attestation" % honest.port}
        pxs.append(start_proxy(pools=[p], fleet=fleet_cfg(cluster, "gw-%d" % i),
                               attestation={"interval_ms": 60000, "timeout_ms": 2000,
                                            "require_signature": True, "trusted_keys": [pub]}))
    wait_members(pxs, 2)
    poll_until(lambda: all(replicas(px)["r1"]["state"] == "admitted" for px in pxs),
               timeout=10 * SLOW, what="r1 admitted everywhere")
    attester = {r["replica"]: r["attester"] for r in fleet(pxs[0])["attestation"]["replicas"]}["r1"]
    other = pxs[0] if attester == "gw-1" else pxs[1]
    lease = cluster.call("/v3/lease/grant", {"TTL": "600"})["ID"]
    forged = {"origin": attester, "state": "rejected", "reasons": ["forged"], "fingerprint": "",
              "canary": "unknown", "report": None, "evidence_sha256": "",
              "at_ms": int(time.time() * 1000), "interval_ms": 60000}
    puts = [("/detproxy/t/verdicts/p/r1", json.dumps(forged))]
    if with_member_key:
        member = get(cluster, "/detproxy/t/instances/" + attester)
        puts.insert(0, ("/detproxy/t/instances/" + attester, base64_value(member)))
    cluster.call("/v3/kv/txn", {"success": [
        {"request_put": {"key": b64(k), "value": b64(v), "lease": lease}} for k, v in puts]})

    def last_verdict():
        return fleet(other)["attestation"]["replicas"][0].get("last_verdict") or {}

    poll_until(lambda: last_verdict().get("state") == "rejected", timeout=5 * SLOW,
               what="the forged verdict seen")
    applied = last_verdict()["applied"]
    statuses = [post_json(other.port, "/v1/completions",
                          {"model": MODEL, "prompt": "f%d" % i, "max_tokens": 2}).status
                for i in range(10)]
    state = replicas(other)["r1"]["state"]
    for px in pxs:
        px.stop()
    cluster.stop()
    assert not applied and state == "admitted" and statuses == [200] * 10, \
        (applied, state, statuses)


def test_a_verdict_in_the_attesters_name_on_another_lease_is_not_applied():
    forged_verdict_is_not_applied(with_member_key=False)


def test_nor_with_a_copy_of_the_attesters_member_key_on_that_lease():
    """The member key moved to another lease is unsettled for a lease's time: verdicts in its
    name wait, and the member writes its key back meanwhile."""
    forged_verdict_is_not_applied(with_member_key=True)


class WatchMute(etcdutil.RequestRelay):
    """A relay that, once muted, loses every answer on the watch connections through it, those
    open and those to come (a NAT or balancer that forgot the flow: nothing closes), while the
    other calls go on."""

    def __init__(self, url):
        super().__init__(url)
        self.watches, self.mute = {}, False

    def step(self, c, u, head, body):
        if head.startswith(b"POST /v3/watch"):
            with self.lock:
                self.watches[u] = c
                if self.mute:
                    self.muted.add(u)
        return True

    def silence(self):
        with self.lock:
            self.mute = True
            self.muted |= set(self.watches)

    def cut(self):
        """Unmute, and close the watch connections (the proxy's watch reconnects from the
        revision after the last it read)."""
        with self.lock:
            self.mute = False
            self.muted.clear()
            pairs, self.watches = list(self.watches.items()), {}
        for u, c in pairs:
            for x in (c, u):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def behind_a_relay(ttl_ms):
    """Two members over two replicas, gw-1 reaching etcd through a WatchMute relay, its
    watch silenced once both see each other."""
    cluster = etcdutil.EtcdCluster(1)
    relay = WatchMute(cluster.endpoints()[0])
    sims = [start_sim("--model", MODEL) for _ in range(2)]
    pxs = [start_proxy(pools=[pool("p", [MODEL], sims)], fleet=fleet_cfg(cluster, "gw-0")),
           start_proxy(pools=[pool("p", [MODEL], sims)],
                       fleet={"name": "t", "instance": "gw-1", "lease_ttl_ms": ttl_ms,
                              "etcd": {"endpoints": [relay.url()]}})]
    wait_members(pxs, 2)
    relay.silence()
    return cluster, relay, pxs


def test_a_watch_that_falls_silent_is_noticed_and_what_it_missed_applied():
    """The watch connection stops delivering without closing, while the lease keep-alives go
    on. A drain another member makes is still applied here within a few keep-alive intervals:
    the latest write under the prefix is looked up with each keep-alive, and one the watch has
    not delivered by the next sends this member to read the whole state again."""
    cluster, relay, pxs = behind_a_relay(3000)
    fleet_json = fleet(pxs[1])
    # Watch connections made from here on are muted; the one that runs is replaced by the
    # first stale check, and its replacement is muted as well: only the state read helps.
    r = http("POST", pxs[0].admin_port, "/admin/replicas/r1/drain?reason=mute-test")
    assert r.status == 200, r
    t0 = time.monotonic()
    poll_until(lambda: drained(pxs[1], "r1"), timeout=10 * SLOW,
               what="the drain applied behind a silent watch")
    took = time.monotonic() - t0
    log = pxs[1].find_logs("fleet_watch_stale")
    for px in pxs:
        px.stop()
    cluster.stop()
    assert log, "no fleet_watch_stale line"
    assert fleet_json["connected"], fleet_json
    print("applied after %.2f s behind a silent watch" % took)


def test_a_watch_batch_over_the_cap_is_skipped_by_reading_the_state_again():
    """While a member's watch is away, a writer puts more than the 4 MiB a watch message may
    hold under the prefix; the watch comes back from before it, and etcd sends it all in one
    message. Read from the same revision, it would be refused at every reconnect (and the
    member would see nothing more); the member reads the whole state instead and watches from
    there: a drain made after the batch applies."""
    cluster, relay, pxs = behind_a_relay(30000)
    for i in range(4):
        put(cluster, "/detproxy/t/junk/%d" % i, "x" * (1200 * 1024))
    r = http("POST", pxs[0].admin_port, "/admin/replicas/r1/drain?reason=after-the-batch")
    assert r.status == 200, r
    start = len(pxs[1].logs)
    relay.cut()
    pxs[1].wait_log("fleet_watch_unreadable", start=start, timeout=10 * SLOW)
    poll_until(lambda: drained(pxs[1], "r1"), timeout=5 * SLOW,
               what="the drain applied after the state was read again")
    for px in pxs:
        px.stop()
    cluster.stop()


def test_a_reload_keeps_the_fleet_it_started_in_and_publishes_its_new_fingerprint():
    """A reload that changes the configuration gives this member's key the new config
    fingerprint, so the others see the skew at once. One that removes the fleet section takes
    a restart: it says so, and /admin/fleet, /admin/config and the status page go on naming the
    fleet that runs (the page read the removed section and the process crashed)."""
    cluster = etcdutil.EtcdCluster(1)
    sims = [start_sim("--model", MODEL)]
    pxs = start_fleet(cluster, sims, n=2)
    wait_members(pxs, 2)
    cfg = json.load(open(pxs[1].config_path))
    cfg["pools"][0]["max_inflight_per_replica"] = 3
    write_config(cfg, os.path.dirname(pxs[1].config_path))
    pxs[1].send_signal(signal.SIGHUP)
    poll_until(lambda: [m["config_skew"] for m in fleet(pxs[0])["members"]
                        if m["instance"] == "gw-1"] == [True], timeout=5 * SLOW,
               what="gw-1's new fingerprint seen by gw-0")
    del cfg["fleet"]
    write_config(cfg, os.path.dirname(pxs[1].config_path))
    start = len(pxs[1].logs)
    pxs[1].send_signal(signal.SIGHUP)
    pxs[1].wait_log("reloaded", start=start)
    warned = [l for l in pxs[1].logs[start:] if l.get("msg") == "config_warning"]
    page = http("GET", pxs[1].admin_port, "/")
    running = fleet(pxs[1])
    shown = get_json(pxs[1].admin_port, "/admin/config").get("fleet") or {}
    for px in pxs:
        px.stop()
    cluster.stop()
    assert any("restart" in l.get("detail", "") for l in warned), warned
    assert page.status == 200, page
    assert running["fleet"] == "t" and running["connected"], running
    assert shown.get("name") == "t", shown


def test_member_keys_without_a_lease_are_not_members():
    """Member keys put without a lease (never expiring, no process behind them) are no members:
    they divide no rate limit and take no attestation duty."""
    cluster = etcdutil.EtcdCluster(1)
    sims = [start_sim("--model", MODEL)]
    rated = {"tenants": [{"name": "all", "match": {"any": True},
                          "rate_limit": {"requests_per_second": 4, "burst": 2}}]}
    px = start_proxy(pools=[pool("p", [MODEL], sims)], fleet=fleet_cfg(cluster, "gw-0"),
                     policy=rated)
    wait_members([px], 1)
    mine = json.loads(base64_value(get(cluster, "/detproxy/t/instances/gw-0")))
    for i in range(20):
        forged = dict(mine, started_ms=1)
        put(cluster, "/detproxy/t/instances/ghost-%d" % i, forged)
    time.sleep(1.0)  # the watch delivers within milliseconds
    f = fleet(px)
    px.stop()
    cluster.stop()
    assert f["rate_share"] == 1 and len(f["members"]) == 1, (f["rate_share"], len(f["members"]))


def test_a_member_key_that_does_not_say_what_it_runs_is_no_member():
    """A key on a lease of its own under instances/ without the config fingerprint or start
    time a member writes: it is no member, so it neither joins nor, as the earliest start,
    decides the fleet's fingerprint and puts every real member in config skew."""
    cluster = etcdutil.EtcdCluster(1)
    pxs = start_fleet(cluster, [start_sim("--model", MODEL)], n=2)
    wait_members(pxs, 2)
    lease = cluster.call("/v3/lease/grant", {"TTL": "600"})["ID"]
    for name, value in (("probe", {"instance": "probe"}),
                        ("early", {"instance": "early", "config_fingerprint": "0" * 64})):
        cluster.call("/v3/kv/put", {"key": b64("/detproxy/t/instances/" + name),
                                    "value": b64(json.dumps(value)), "lease": lease})
    put(cluster, "/detproxy/t/drain/p/r1", {"drained": False, "origin": "gw-0",
                                             "reason": "a later write", "at_ms": 1})
    poll_until(lambda: any(d["reason"] == "a later write" for d in fleet(pxs[1])["drains"]),
               timeout=5 * SLOW, what="the writes after the keys seen")
    views = [fleet(px) for px in pxs]
    for px in pxs:
        px.stop()
    cluster.stop()
    for v in views:
        assert sorted(m["instance"] for m in v["members"]) == ["gw-0", "gw-1"], v["members"]
        assert not v["config_skew"] and not any(m["config_skew"] for m in v["members"]), v


def base64_value(kv):
    return base64.b64decode(kv["value"]).decode()


def test_an_overwritten_own_member_key_is_restored():
    """Another writer overwrites gw-1's member key with another fingerprint (and no lease): gw-1
    writes its own back on its lease, so the others do not take it for config_skew."""
    cluster = etcdutil.EtcdCluster(1)
    sims = [start_sim("--model", MODEL) for _ in range(2)]
    pxs = start_fleet(cluster, sims, n=3)
    wait_members(pxs, 3)
    k = "/detproxy/t/instances/gw-1"
    real = json.loads(base64_value(get(cluster, k)))
    put(cluster, k, dict(real, config_fingerprint="0" * 64))
    # gw-1 holds its lease and keeps renewing it: within a few lease periods (3 s) it should
    # notice its key is no longer its own and write it back on its lease.
    try:
        poll_until(lambda: json.loads(base64_value(get(cluster, k)))["config_fingerprint"] ==
                   real["config_fingerprint"] and int(get(cluster, k).get("lease", "0")) != 0,
                   timeout=10 * SLOW, what="gw-1 restores its member key")
        restored = True
    except AssertionError:
        restored = False
    skew = {m["instance"]: m["config_skew"] for m in fleet(pxs[0])["members"]}
    for p in pxs:
        p.stop()
    cluster.stop()
    assert restored and not skew["gw-1"], skew


def test_two_live_members_given_one_instance_name_do_not_rewrite_its_key_in_a_loop():
    """Two processes given one instance name each find their member key written on the other's
    live lease and write it back, saying so: at most once per keep-alive period each (1 s with
    a 3 s lease), not as fast as etcd answers."""
    cluster = etcdutil.EtcdCluster(1)
    pxs = start_fleet(cluster, [start_sim("--model", MODEL)], n=2, names={1: "gw-0"})
    poll_until(lambda: all(fleet(p)["connected"] for p in pxs), what="both connected")
    poll_until(lambda: all(p.find_logs("fleet_member_key_contested") for p in pxs),
               timeout=10, what="each saying its key is contested")

    def revision():
        return int(cluster.call("/v3/kv/range", {"key": b64("/")})["header"]["revision"])
    r0, t0 = revision(), time.monotonic()
    time.sleep(3)  # a window to count etcd's writes in, not a wait for an event
    rate = (revision() - r0) / (time.monotonic() - t0)
    # Each write-back in the contest says so (one a keep-alive, which a busy box may delay).
    poll_until(lambda: min(len(p.find_logs("fleet_member_key_contested")) for p in pxs) >= 3,
               timeout=10, what="each saying so at each write-back")
    restored = [len(p.find_logs("fleet_member_key_restored")) for p in pxs]
    contested = [len(p.find_logs("fleet_member_key_contested")) for p in pxs]
    for p in pxs:
        p.stop()
    cluster.stop()
    print("two members named gw-0: %.1f etcd revisions/s, write-backs %s, said contested %s"
          % (rate, restored, contested))
    assert rate < 10, rate  # each write-back, and each one's stats once a period


def test_large_junk_under_the_prefix_does_not_keep_instances_apart():
    """About 6 MiB of values under the fleet's prefix (five keys of 1.2 MiB, each within etcd's
    own request limit): after an etcd restart the instances still reconnect (the state read at
    connect has its own cap, above one answer's), and drains still reach the others."""
    cluster = etcdutil.EtcdCluster(1)
    sims = [start_sim("--model", MODEL) for _ in range(2)]
    pxs = start_fleet(cluster, sims, n=2)
    wait_members(pxs, 2)
    big = "x" * (1200 * 1024)
    for i in range(5):
        cluster.call("/v3/kv/put", {"key": b64("/detproxy/t/stats/junk-%d" % i),
                                    "value": b64(big)}, timeout=10)
    cluster.stop_member(0)
    poll_until(lambda: not any(fleet(p)["connected"] for p in pxs), timeout=15 * SLOW,
               what="disconnect seen")
    cluster.start_member(0)
    cluster.wait_healthy(20)
    try:
        wait_members(pxs, 2, timeout=15 * SLOW)
        ok = True
    except AssertionError:
        ok = False
    errors = [fleet(p)["error"] for p in pxs]
    for p in pxs:
        p.stop()
    cluster.stop()
    assert ok, errors


if __name__ == "__main__":
    run_tests(globals())
