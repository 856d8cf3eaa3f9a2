"""determinism.mode is not part of the manifest fingerprint, so a reload that
adds `determinism: {mode: batch_invariant}` keeps the pool's replicas (same key) with their
attestation state. A replica admitted before, which has never attested the mode (SGLang with
enable_deterministic_inference false), must not keep serving as batch_invariant until the next
scheduled attestation: it is re-judged against the manifest in force now."""

import json

from harness import get_json, http, poll_until, post_json, run_tests, start_sim
from proxyutil import pool, sim_config, start_proxy

MODEL = "det-model"


def state(px, name):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}[name]


def test_reload_adding_batch_invariant_rejudges_carried_replicas():
    sim = start_sim("--model", MODEL, "--flavor", "sglang")
    sim_config(sim, deterministic_inference=False)
    man = {"model": MODEL, "framework": {"name": "sglang"}}
    # A long interval: only the reload can make the replica be looked at again.
    px = start_proxy(pools=[pool("p", [MODEL], [sim], manifest=man)],
                     attestation={"interval_ms": 600000, "timeout_ms": 2000,
                                  "require_signature": False})
    assert state(px, "r1")["state"] == "admitted"
    with open(px.config_path) as f:
        live = json.load(f)
    live["pools"][0]["manifest"]["determinism"] = {"mode": "batch_invariant"}
    with open(px.config_path, "w") as f:
        json.dump(live, f)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 200, r
    poll_until(lambda: state(px, "r1")["state"] == "rejected", timeout=5,
               what="r1 re-judged under batch_invariant")
    assert state(px, "r1")["reasons"] == [
        "determinism.mode unattested (sglang enable_deterministic_inference is false)"], \
        state(px, "r1")
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2,
                                               "temperature": 0})
    assert r.status == 503, r
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
