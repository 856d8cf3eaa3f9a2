"""The fleet (docs/fleet.md, "Who may write the prefix") against forged keys written straight
into a real etcd cluster on loopback: a verdict from someone not the replica's attester, member
keys without a lease, our own member key overwritten, junk that makes the state read large.
None of them changes what an instance serves or keeps the instances apart."""

import base64
import json
import os
import sys
import tempfile
import time

from harness import DETPROXY_BIN, SLOW, get_json, poll_until, post_json, run_cmd, run_tests, start_sim
from proxyutil import pool, start_proxy
import etcdutil
from etcdutil import b64

if etcdutil.ETCD is None:
    print("etcd is not installed (scripts/deps.sh installs etcd-server): skipped")
    sys.exit(77)

from test_fleet import MODEL, fleet, fleet_cfg, start_fleet, wait_members  # noqa: E402

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
