"""A pool's own `attestation.require_signature` (docs/configuration.md, "pools[].attestation"):
the baseline's agents sign and the top level requires signatures, while a candidate pool attested
natively (docs/rollouts.md) is admitted because its pool says so; without the override it never
is. A pool that requires signatures with no trusted keys is a config error at its path."""

import os
import tempfile

from harness import DETPROXY_BIN, get_json, poll_until, run_cmd, run_tests, start_sim
from proxyutil import pool, start_proxy, write_config

TMP = tempfile.mkdtemp(prefix="detproxy-pool-att-")
MODEL = "tiny"


def keys():
    prefix = os.path.join(TMP, "k")
    if not os.path.exists(prefix + ".key.pem"):
        rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", prefix])
        assert rc == 0, err
    return prefix + ".key.pem", prefix + ".pub.pem"


def setup(candidate_override):
    key, pub = keys()
    signed = start_sim("--flavor", "llamacpp", "--model", MODEL, "--attest-key", key)
    native = start_sim("--flavor", "llamacpp", "--model", MODEL)
    base = pool("p", [MODEL], [signed], candidates=[{"pool": "next", "rate": 1.0}])
    base["replicas"][0]["attest"] = {"source": "agent",
                                     "url": "http://127.0.0.1:%d/attestation" % signed.port}
    cand = pool("next", [MODEL], [native])
    cand["replicas"][0]["attest"] = {"source": "llamacpp"}
    if candidate_override is not None:
        cand["attestation"] = {"require_signature": candidate_override}
    return start_proxy(pools=[base, cand], ready=False,
                       attestation={"interval_ms": 200, "require_signature": True,
                                    "trusted_keys": [pub]})


def states(px):
    return {r["pool"]: (r["state"], r["reasons"])
            for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def test_a_native_candidate_pool_is_admitted_beside_a_signing_baseline():
    px = setup(False)
    poll_until(lambda: all(s == "admitted" for s, _ in states(px).values()),
               what="both pools admitted")
    cfg = get_json(px.admin_port, "/admin/config")
    assert [p["attestation"]["require_signature"] for p in cfg["pools"]] == [True, False], cfg
    px.stop()


def test_without_the_override_the_native_pool_stays_rejected():
    px = setup(None)
    poll_until(lambda: states(px)["next"][0] == "rejected", what="candidate rejected")
    assert states(px)["p"][0] == "admitted", states(px)
    assert any("require_signature is true" in r for r in states(px)["next"][1]), states(px)
    px.stop()


def test_a_pool_requiring_signatures_needs_trusted_keys():
    p = pool("p", [MODEL], [])
    p["replicas"] = [{"name": "r1", "url": "http://127.0.0.1:9"}]
    for att, want in (({"require_signature": True}, "pools[0].attestation.require_signature: "
                       "needs attestation.trusted_keys"),
                      ({"interval_ms": 5}, "pools[0].attestation.interval_ms: unknown key")):
        p["attestation"] = att
        path = write_config({"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
                             "pools": [p]}, tempfile.mkdtemp(dir=TMP))
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
        assert rc != 0 and want in out + err, (rc, out, err)


if __name__ == "__main__":
    run_tests(globals())
