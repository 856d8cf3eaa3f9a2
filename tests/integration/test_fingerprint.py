"""The engine fingerprint (SPEC §4, §5, issue 12): native adapters learn each replica's
system_fingerprint from a 1-token probe, a manifest may pin it, and every response's fingerprint
is checked against what its replica attested, so a replica swapped under detproxy's feet is
caught on its next response."""

import json
import os
import tempfile

from harness import get_json, poll_until, post_json, run_tests, sse, start_sim
from proxyutil import metric, pool, sim_config, sim_requests, start_proxy

MODEL = "tiny"
BUILD = "b11669-Debian"
AUDIT_POLICY = {"tenants": [{"name": "all", "match": {"any": True}, "audit": True}]}


def llama(version=BUILD, quant="F16"):
    return start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version", version,
                     "--quantization", quant)


def setup(sims, manifest=None, interval=60000):
    d = tempfile.mkdtemp(prefix="detproxy-fp-")
    p = pool("p", [MODEL], sims, manifest=manifest or {"model": MODEL},
             balance="round_robin")
    for r in p["replicas"]:
        r["attest"] = {"source": "llamacpp"}
    px = start_proxy(pools=[p], directory=d, policy=AUDIT_POLICY,
                     attestation={"interval_ms": interval, "timeout_ms": 2000},
                     log={"level": "info", "audit_path": os.path.join(d, "audit.jsonl")})
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


if __name__ == "__main__":
    run_tests(globals())
