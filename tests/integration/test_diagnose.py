"""`detproxy diagnose` (docs/diagnose.md): on crafted detproxy-sim pools it must name the right
cause, and only that cause: a replica with another quantization (cross_replica_drift), batching
noise (batching_nondeterminism, not drift), unseeded sampling (unseeded_sampling unless the policy
pins sampling), and a consistent pool (exit 0). Plus the JSON shape, usage errors (exit 2) and a
pool nobody answers for (exit 3). Two scripted replicas (a tiny Python server) cover what the
simulator cannot do: ignore seeds, and vary at temperature 0 even one request at a time."""

import hashlib
import http.server
import json
import os
import random
import tempfile
import threading

from harness import DETPROXY_BIN, free_port, run_cmd, run_tests, start_sim
from proxyutil import pool, sim_config, sim_stats, write_config

MODEL = "org/model-a"
CKPT = hashlib.sha256(b"checkpoint-a").hexdigest()
TMP = tempfile.mkdtemp(prefix="detproxy-diagnose-")
# Batching noise only shows where a greedy path has near-tied tokens, and where they fall is a
# pure function of (checkpoint, quantization, dtype, prompt) in the simulator: this prompt's
# 32-token path under CKPT/awq/float16 has several, so each concurrent request flips with
# probability well above 1/2 at --noise 0.5 (checked: 8 of 8 concurrent outputs differ). With a
# prompt without near ties the noise tests could not pass, and the tests would be checking the
# prompt rather than diagnose: test_noise_prompt_has_near_ties pins this one.
NOISE_PROMPT = "Count: one, two,"
# Generations must overlap for --noise to act: a few ms per token keeps 4 requests in flight.
DELAY = ["--token-delay-ms", "3"]
PIN_SEEDS = {"tenants": [{"name": "default", "match": {"any": True},
                          "sampling": {"seed": {"derive": True}}}]}


def keygen(name):
    prefix = os.path.join(TMP, name)
    if not os.path.exists(prefix + ".key.pem"):
        rc, out, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", prefix])
        assert rc == 0, err
    return prefix + ".key.pem", prefix + ".pub.pem"


def sim(quant="awq", *extra, key=None):
    flags = ["--model", MODEL, "--flavor", "vllm", "--framework-version", "0.6.3",
             "--quantization", quant, "--dtype", "float16", "--checkpoint-sha256", CKPT]
    if key:
        flags += ["--attest-key", key]
    return start_sim(*(flags + list(extra)))


def config(sims=(), policy=None, agents=False, manifest=None, extra_replicas=(), **top):
    p = pool("p", [MODEL], list(sims))
    if manifest:
        p["manifest"] = manifest
    if agents:
        for r, s in zip(p["replicas"], sims):
            r["attest"] = {"source": "agent", "url": "http://127.0.0.1:%d/attestation" % s.port}
    p["replicas"] += list(extra_replicas)
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "pools": [p]}
    if policy is not None:
        cfg["policy"] = policy
    cfg.update(top)
    return write_config(cfg, tempfile.mkdtemp(dir=TMP))


def diagnose(path, *args, as_json=True, timeout=120):
    """Run diagnose; returns (rc, parsed JSON or stdout text, stderr)."""
    argv = [DETPROXY_BIN, "diagnose", "-c", path] + list(args) + (["--json"] if as_json else [])
    rc, out, err = run_cmd(argv, timeout=timeout)
    assert "Sanitizer" not in err and "runtime error" not in err, err
    if as_json and rc in (0, 1):
        assert out.count("\n") == 1 and out.endswith("\n"), out[:500]
        return rc, json.loads(out), err
    return rc, out, err


def causes(doc):
    return {f["cause"]: f for f in doc["findings"]}


def check_shape(doc):
    """The --json contract every caller may rely on."""
    assert set(doc) >= {"pool", "model", "prompt", "repeat", "concurrency", "steps", "findings",
                        "consistent", "verdict", "exit_code"}, sorted(doc)
    assert set(doc["steps"]) == {"metadata", "sampling", "single_replica", "across_replicas"}
    for f in doc["findings"]:
        assert set(f) == {"cause", "replicas", "detail"}, f
        assert isinstance(f["replicas"], list) and f["detail"], f
    assert doc["consistent"] == (not doc["findings"])
    if doc["findings"]:
        assert [v.split(":")[0] for v in doc["verdict"]] == [f["cause"] for f in doc["findings"]]
    else:
        assert doc["verdict"] == ["consistent"]


# ---- a scripted replica for what the simulator does not do --------------------------------------


def fake_replica(mode):
    """An OpenAI-shaped /v1/completions in a thread. mode "seed_ignored": greedy at temperature
    0, random otherwise whatever the seed. mode "nondeterministic": random always."""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def send(self, obj):
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.send({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            rnd = mode == "nondeterministic" or body.get("temperature", 1) > 0
            text = " ".join(random.choice(words) if rnd else words[i % 10] for i in range(12))
            self.send({"object": "text_completion", "model": MODEL,
                       "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


# ---- the four crafted pools ------------------------------------------------------------------


def test_other_quantization_is_cross_replica_drift_naming_it():
    key, pub = keygen("pipeline")
    sims = [sim(key=key), sim(key=key), sim("gptq", key=key)]
    man = {"model": MODEL, "checkpoint_sha256": CKPT, "quantization": "awq", "dtype": "float16",
           "framework": {"name": "vllm", "version": "0.6.3"}}
    path = config(sims, policy=PIN_SEEDS, agents=True, manifest=man,
                  attestation={"require_signature": True, "trusted_keys": [pub]})
    rc, doc, err = diagnose(path)
    check_shape(doc)
    assert rc == 1 and doc["exit_code"] == 1, (rc, doc["verdict"])
    assert set(causes(doc)) == {"cross_replica_drift"}, doc["verdict"]
    f = causes(doc)["cross_replica_drift"]
    assert f["replicas"] == ["r3"], f
    assert "r3 differs in quantization (gptq vs awq" in f["detail"], f
    meta = doc["steps"]["metadata"]
    assert [d["field"] for d in meta["differences"]] == ["quantization"], meta["differences"]
    assert meta["differences"][0]["odd"] == ["r3"]
    reps = {r["name"]: r for r in meta["replicas"]}
    assert reps["r1"]["report"]["signed"] is True and reps["r1"]["admitted"] is True, reps["r1"]
    assert reps["r3"]["admitted"] is False
    assert any("quantization mismatch" in x for x in reps["r3"]["reasons"]), reps["r3"]
    across = {r["name"]: r for r in doc["steps"]["across_replicas"]["replicas"]}
    assert across["r3"]["agrees"] is False and across["r3"]["divergence_offset"] >= 0, across
    assert across["r1"]["agrees"] and across["r2"]["agrees"], across
    # The human form says the same, with one verdict line per cause.
    rc, out, err = diagnose(path, as_json=False)
    assert rc == 1, err
    verdicts = [l for l in out.splitlines() if l.startswith("verdict: ")]
    assert len(verdicts) == 1 and verdicts[0].startswith(
        "verdict: cross_replica_drift: r3 differs in quantization (gptq vs awq"), out
    for step in ("step 1/4", "step 2/4", "step 3/4", "step 4/4"):
        assert step in out, out
    assert "[3/4]" in err and "diagnose:" in err, err  # progress goes to stderr


def test_a_llamacpp_quantization_is_compared_in_any_case_as_admission_does():
    """llama.cpp names file types in capitals: a manifest's "q8_0" admits "Q8_0", and step 1
    names only the replica with another quantization, not those that match it."""
    sims = [start_sim("--model", MODEL, "--flavor", "llamacpp", "--quantization", q)
            for q in ("Q8_0", "Q8_0", "Q4_K_M")]
    man = {"model": MODEL, "quantization": "q8_0", "framework": {"name": "llamacpp"}}
    rc, doc, err = diagnose(config(sims, policy=PIN_SEEDS, manifest=man))
    meta = doc["steps"]["metadata"]
    diffs = {d["field"]: d for d in meta["differences"]}
    assert diffs["quantization"]["odd"] == ["r3"], meta["differences"]
    reps = {r["name"]: r for r in meta["replicas"]}
    assert reps["r1"]["admitted"] and reps["r2"]["admitted"] and not reps["r3"]["admitted"], reps
    assert causes(doc)["cross_replica_drift"]["replicas"] == ["r3"], doc["findings"]
    # The case rule is the engine's: an agent that only declares "q8_0" (no measurement) is
    # held to the pin byte for byte, as admission holds it, and named.
    key, pub = keygen("caseless")
    sims = [start_sim("--model", MODEL, "--flavor", "llamacpp", "--quantization", "Q8_0"),
            start_sim("--model", MODEL, "--flavor", "llamacpp", "--quantization", "Q8_0",
                      "--report-quantization", "q8_0", "--attest-key", key)]
    path = config(sims, policy=PIN_SEEDS, manifest=dict(man, quantization="Q8_0"),
                  attestation={"require_signature": False, "trusted_keys": [pub]})
    with open(path) as f:
        cfg = json.load(f)
    cfg["pools"][0]["replicas"][1]["attest"] = {
        "source": "agent", "url": "http://127.0.0.1:%d/attestation" % sims[1].port}
    with open(path, "w") as f:
        json.dump(cfg, f)
    rc, doc, err = diagnose(path)
    meta = doc["steps"]["metadata"]
    reps = {r["name"]: r for r in meta["replicas"]}
    assert reps["r1"]["admitted"] and not reps["r2"]["admitted"], reps
    diffs = {d["field"]: d for d in meta["differences"]}
    assert diffs["quantization"]["odd"] == ["r2"], meta["differences"]
    assert "r2 differs in quantization (q8_0 vs Q8_0 pinned" in \
        causes(doc)["cross_replica_drift"]["detail"], doc["findings"]
    # Two llama.cpp replicas whose names differ only in case are both admitted: no difference.
    sims = [start_sim("--model", MODEL, "--flavor", "llamacpp", "--quantization", "Q8_0"),
            start_sim("--model", MODEL, "--flavor", "llamacpp", "--quantization", "Q8_0",
                      "--report-quantization", "q8_0")]
    rc, doc, err = diagnose(config(sims, policy=PIN_SEEDS, manifest=dict(man, quantization="Q8_0")))
    meta = doc["steps"]["metadata"]
    assert all(r["admitted"] for r in meta["replicas"]), meta["replicas"]
    assert "quantization" not in [d["field"] for d in meta["differences"]], meta["differences"]
    assert "quantization" not in json.dumps(doc["findings"]), doc["findings"]


def test_replica_with_the_same_metadata_but_other_outputs_is_named_by_its_outputs():
    # r3 reports awq (its metadata is in line) but generates as gptq: only step 4 can see it.
    sims = [sim(), sim(), sim("gptq", "--report-quantization", "awq")]
    rc, doc, err = diagnose(config(sims, policy=PIN_SEEDS))
    check_shape(doc)
    assert rc == 1, doc["verdict"]
    assert set(causes(doc)) == {"cross_replica_drift"}, doc["verdict"]
    f = causes(doc)["cross_replica_drift"]
    assert f["replicas"] == ["r3"], f
    assert "r3's temperature-0 output differs from the majority (r1, r2)" in f["detail"], f
    assert doc["steps"]["metadata"]["differences"] == []
    assert doc["steps"]["across_replicas"]["reference"] == ["r1", "r2"]


def canary_of(replica, prompt="Count: one, two,", n=12):
    """The canary a trusted replica answers, recorded with `detproxy attest canary`."""
    path = config([replica], manifest={"canary": {"prompt": prompt, "max_tokens": n}})
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "canary", "-c", path, "--pool", "p",
                            "--replica", "r1", "--json"])
    assert rc == 0, err
    return {"prompt": prompt, "max_tokens": n, "expected_sha256": json.loads(out)["expected_sha256"]}


def test_two_replicas_are_told_apart_by_the_canary():
    # 1 vs 1 has no majority; the manifest's canary says which one is odd, and
    # the admission column says what the proxy decides (it rejects the liar on the canary).
    honest, liar = sim(), sim("gptq", "--report-quantization", "awq")
    can = canary_of(honest)
    rc, doc, err = diagnose(config([honest, liar], policy=PIN_SEEDS, manifest={"canary": can}))
    check_shape(doc)
    assert rc == 1, doc["verdict"]
    f = causes(doc)["cross_replica_drift"]
    assert f["replicas"] == ["r2"], f
    assert "r2's canary output differs from the manifest's" in f["detail"], f
    assert "r2's temperature-0 output differs from the replica(s) that pass (r1)" in f["detail"], f
    reps = {r["name"]: r for r in doc["steps"]["metadata"]["replicas"]}
    assert reps["r1"]["admitted"] is True and reps["r1"]["canary"]["matched"] is True, reps
    assert reps["r2"]["admitted"] is False and reps["r2"]["canary"]["matched"] is False, reps
    assert reps["r2"]["canary"]["expected_sha256"] == can["expected_sha256"]
    assert any(x.startswith("canary mismatch: output sha256 ") for x in reps["r2"]["reasons"])
    rc, out, err = diagnose(config([honest, liar], policy=PIN_SEEDS, manifest={"canary": can}),
                            as_json=False)
    row = [l for l in out.splitlines() if l.split()[:1] == ["r2"]][0]
    assert "MISMATCH" in row and "rejected: canary mismatch" in row, out


def test_two_replicas_without_a_canary_say_why_no_suspect():
    sims = [sim(), sim("gptq", "--report-quantization", "awq")]
    rc, doc, err = diagnose(config(sims, policy=PIN_SEEDS))
    assert rc == 1, doc["verdict"]
    f = causes(doc)["cross_replica_drift"]
    assert f["replicas"] == ["r1", "r2"], f
    assert ("cannot tell which is odd; no canary in the manifest, step 1 found no identity "
            "difference") in f["detail"], f
    assert "add a canary to the manifest ('detproxy attest canary' records one) or a third " \
        "replica" in f["detail"], f


def test_noise_prompt_has_near_ties():
    # Guard for the two noise tests: on this pool the prompt must flip under concurrency.
    sims = [sim("awq", "--noise", "1", *DELAY)]
    rc, doc, err = diagnose(config(sims, policy=PIN_SEEDS), "--prompt", NOISE_PROMPT)
    rep = doc["steps"]["single_replica"]["replicas"][0]
    assert rep["concurrent_differ_from_sequential"] > 0, rep


def test_batching_noise_on_one_replica_is_not_drift():
    sims = [sim("awq", *DELAY), sim("awq", "--noise", "0.5", *DELAY), sim("awq", *DELAY)]
    rc, doc, err = diagnose(config(sims, policy=PIN_SEEDS), "--prompt", NOISE_PROMPT,
                            "--repeat", "10")
    check_shape(doc)
    assert rc == 1, doc["verdict"]
    assert set(causes(doc)) == {"batching_nondeterminism"}, doc["verdict"]
    assert causes(doc)["batching_nondeterminism"]["replicas"] == ["r2"]
    reps = {r["name"]: r for r in doc["steps"]["single_replica"]["replicas"]}
    assert reps["r2"]["sequential"]["distinct"] == 1 and reps["r2"]["stable"], reps["r2"]
    assert reps["r2"]["concurrent_differ_from_sequential"] > 0, reps["r2"]
    assert reps["r1"]["concurrent"]["distinct"] == 1, reps["r1"]
    assert doc["steps"]["across_replicas"]["agree"] is True


def test_batching_noise_on_every_replica_is_not_drift():
    sims = [sim("awq", "--noise", "0.5", *DELAY) for _ in range(3)]
    rc, doc, err = diagnose(config(sims, policy=PIN_SEEDS), "--prompt", NOISE_PROMPT,
                            "--repeat", "10")
    assert rc == 1, doc["verdict"]
    assert set(causes(doc)) == {"batching_nondeterminism"}, doc["verdict"]
    assert causes(doc)["batching_nondeterminism"]["replicas"] == ["r1", "r2", "r3"]
    assert doc["steps"]["across_replicas"]["agree"] is True


def test_unseeded_sampling_is_a_cause_only_when_the_policy_does_not_pin_it():
    sims = [sim(), sim()]
    # No policy: every client may sample without a seed, and the replicas vary when they do.
    rc, doc, err = diagnose(config(sims))
    check_shape(doc)
    assert rc == 1, doc["verdict"]
    assert set(causes(doc)) == {"unseeded_sampling"}, doc["verdict"]
    assert causes(doc)["unseeded_sampling"]["replicas"] == ["r1", "r2"]
    s = doc["steps"]["sampling"]
    assert s["unseeded_varies"] and s["seeds_honoured"] and not s["policy_pins_sampling"], s
    assert [r["unseeded"] for r in s["replicas"]] == ["differ", "differ"]
    assert [r["seeded"] for r in s["replicas"]] == ["equal", "equal"]
    # A tenant that pins seeds does not help while a later catch-all tenant leaves them free.
    partial = {"tenants": [
        {"name": "bank", "match": {"header": {"name": "x-tenant", "value": "bank"}},
         "sampling": {"seed": {"force": 7}}},
        {"name": "free", "match": {"any": True}, "sampling": {"temperature": {"max": 1.0}}}]}
    rc, doc, err = diagnose(config(sims, policy=partial))
    assert rc == 1 and set(causes(doc)) == {"unseeded_sampling"}, doc["verdict"]
    assert 'tenant "free"' in causes(doc)["unseeded_sampling"]["detail"], doc["verdict"]
    # Forced temperature 0 pins it too; a tenant bound to another pool does not count.
    other = {"tenants": [
        {"name": "elsewhere", "match": {"header": {"name": "x-t", "value": "x"}},
         "pool": "q"},
        {"name": "greedy", "match": {"any": True}, "sampling": {"temperature": {"force": 0}}}]}
    q = pool("q", ["other-model"], sims[:1])
    path = config(sims, policy=other)
    cfg = json.load(open(path))
    cfg["pools"].append(q)
    path = write_config(cfg, tempfile.mkdtemp(dir=TMP))
    rc, doc, err = diagnose(path)
    assert rc == 0 and doc["findings"] == [], doc["verdict"]
    assert doc["steps"]["sampling"]["policy_pins_sampling"] is True


def test_consistent_pool_with_seeds_pinned_is_consistent():
    key, pub = keygen("pipeline")
    sims = [sim(key=key), sim(key=key), sim(key=key)]
    path = config(sims, policy=PIN_SEEDS, agents=True,
                  attestation={"require_signature": True, "trusted_keys": [pub]})
    rc, doc, err = diagnose(path, "--repeat", "4", "--concurrency", "3")
    check_shape(doc)
    assert rc == 0 and doc["exit_code"] == 0, doc["verdict"]
    assert doc["findings"] == [] and doc["verdict"] == ["consistent"] and doc["consistent"]
    assert doc["repeat"] == 4 and doc["concurrency"] == 3
    assert doc["steps"]["sampling"]["unseeded_varies"] is True  # informational only
    assert doc["steps"]["across_replicas"]["agree"] is True
    for r in doc["steps"]["single_replica"]["replicas"]:
        assert r["sequential"] == {"requests": 4, "ok": 4, "distinct": 1, "first_error": None}, r
        assert r["concurrent"]["ok"] == 4 and r["concurrent"]["distinct"] == 1, r
    rc, out, err = diagnose(path, "--repeat", "4", as_json=False)
    assert rc == 0 and out.rstrip().splitlines()[-1] == "verdict: consistent", out


def test_discovery_pool_replicas_are_named_by_address():
    s = sim()
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "pools": [{"name": "d", "models": [MODEL],
                      "discovery": {"dns": "127.0.0.1", "port": s.port}}],
           "policy": {"tenants": [{"name": "t", "match": {"any": True},
                                   "sampling": {"temperature": {"force": 0}}}]}}
    rc, doc, err = diagnose(write_config(cfg, tempfile.mkdtemp(dir=TMP)), "--repeat", "2")
    assert rc == 0, doc["verdict"]
    names = [r["name"] for r in doc["steps"]["metadata"]["replicas"]]
    assert names == ["127.0.0.1:%d" % s.port], names
    assert 'pins sampling ("t": temperature forced to 0)' in doc["steps"]["sampling"]["policy"]


# ---- the scripted replicas: seeds ignored, nondeterministic alone ---------------------------------


def test_seed_ignored_and_nondeterministic_replica():
    seedless = fake_replica("seed_ignored")
    wild = fake_replica("nondeterministic")
    extra = [{"name": "r2", "url": "http://127.0.0.1:%d" % seedless.server_port},
             {"name": "r3", "url": "http://127.0.0.1:%d" % wild.server_port}]
    try:
        rc, doc, err = diagnose(config([sim()], policy=PIN_SEEDS, extra_replicas=extra),
                                "--repeat", "4")
    finally:
        seedless.shutdown()
        wild.shutdown()
    check_shape(doc)
    assert rc == 1, doc["verdict"]
    c = causes(doc)
    # r2 is greedy-stable but ignores seeds; r3 varies even alone. r1 (the sim) and r2 give
    # different greedy texts: two replicas and no majority, so drift names both.
    assert c["seed_ignored"]["replicas"] == ["r2"], doc["verdict"]
    assert c["nondeterministic_replica"]["replicas"] == ["r3"], doc["verdict"]
    assert "batching_nondeterminism" not in c, doc["verdict"]
    assert c["cross_replica_drift"]["replicas"] == ["r1", "r2"], doc["verdict"]
    assert "no majority" in c["cross_replica_drift"]["detail"]
    across = {r["name"]: r for r in doc["steps"]["across_replicas"]["replicas"]}
    assert across["r3"]["excluded"] == "unstable at temperature 0", across


# ---- failures -----------------------------------------------------------------------------------


def test_usage_errors_exit_2_with_one_line():
    path = config([], extra_replicas=[{"name": "r1", "url": "http://127.0.0.1:9"}])
    cases = [[], ["-c"], ["-c", path, "--bogus"], ["-c", path, "extra"],
             ["-c", path, "--repeat", "0"], ["-c", path, "--repeat", "abc"],
             ["-c", path, "--repeat=1001"], ["-c", path, "--concurrency", "1"],
             ["-c", path, "--prompt", ""], ["-c", path, "--pool", "nope"],
             ["-c", path, "-c", path]]
    for args in cases:
        rc, out, err = run_cmd([DETPROXY_BIN, "diagnose"] + args)
        assert rc == 2, (args, rc, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith("detproxy diagnose: "), \
            (args, err)
        assert out == "", (args, out)
    rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "-c", path, "--pool", "nope"])
    assert "no pool named 'nope' (pools: p)" in err, err
    rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "--help"])
    assert rc == 0 and out.startswith("usage: detproxy diagnose") and "--concurrency" in out


def test_invalid_config_exits_1_like_check():
    path = os.path.join(tempfile.mkdtemp(dir=TMP), "bad.json")
    with open(path, "w") as f:
        json.dump({"pools": [{"name": "p", "models": ["m"], "replicas": [], "bogus": 1}]}, f)
    rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "-c", path])
    assert rc == 1, (rc, err)
    assert "error: pools[0].bogus" in err, err


def test_every_replica_down_exits_3():
    down = [{"name": "a", "url": "http://127.0.0.1:%d" % free_port()},
            {"name": "b", "url": "http://127.0.0.1:%d" % free_port()}]
    path = config([], extra_replicas=down)
    rc, out, err = diagnose(path, as_json=False, timeout=30)
    assert rc == 3, (rc, out, err)
    assert 'no replica of pool "p" answered a completion request: a: unreachable' in err, err
    assert "connect" in err, err
    rc, out, err = diagnose(path, timeout=30)
    assert rc == 3 and json.loads(out)["exit_code"] == 3, out


def test_one_replica_down_and_one_unattested():
    key, pub = keygen("pipeline")
    rogue, _ = keygen("rogue")
    sims = [sim(key=key), sim(key=rogue), sim(key=key)]
    down = {"name": "r4", "url": "http://127.0.0.1:%d" % free_port()}
    path = config(sims, policy=PIN_SEEDS, agents=True, extra_replicas=[down],
                  attestation={"require_signature": True, "trusted_keys": [pub]})
    cfg = json.load(open(path))
    cfg["pools"][0]["replicas"][3]["attest"] = {"source": "agent",
                                                "url": down["url"] + "/attestation"}
    path = write_config(cfg, tempfile.mkdtemp(dir=TMP))
    rc, doc, err = diagnose(path, "--repeat", "3", timeout=60)
    check_shape(doc)
    assert rc == 1, doc["verdict"]
    c = causes(doc)
    assert set(c) == {"unattested_replica", "replica_error"}, doc["verdict"]
    assert c["unattested_replica"]["replicas"] == ["r2"]
    assert "not trusted" in c["unattested_replica"]["detail"], c
    assert c["replica_error"]["replicas"] == ["r4"]
    assert "unreachable" in c["replica_error"]["detail"], c
    assert "skipping its remaining requests" in err, err  # given up, not timed out 20 times


def test_a_hanging_replica_is_given_up_after_two_timeouts():
    sims = [sim(), sim()]
    sim_config(sims[1], fault="hang")
    path = config(sims, policy=PIN_SEEDS, limits={"upstream_first_byte_timeout_ms": 300})
    rc, doc, err = diagnose(path, "--repeat", "8", timeout=60)
    assert rc == 1 and set(causes(doc)) == {"replica_error"}, doc["verdict"]
    f = causes(doc)["replica_error"]
    assert f["replicas"] == ["r2"] and "not answering" in f["detail"], f
    assert "first_byte_timeout" in f["detail"], f
    # Two requests waited out, the other 18 skipped rather than each timing out.
    assert sim_stats(sims[1])["hung"] == 2, sim_stats(sims[1])



def test_a_replica_that_mostly_fails_is_a_finding():
    """Most of a replica's answers are errors, a few are fine: what it did answer says little
    about it, and a pool that is otherwise consistent is not called consistent."""
    sims = [sim(), sim()]
    # 4 sampling + 3 sequential + 3 concurrent: the first 6 fail (HTTP 500s, answers all).
    sim_config(sims[1], fault="error_500", fault_count=6)
    path = config(sims, policy=PIN_SEEDS)
    rc, doc, err = diagnose(path, "--repeat", "3", "--concurrency", "2")
    assert rc == 1 and set(causes(doc)) == {"replica_error"}, doc["verdict"]
    f = causes(doc)["replica_error"]
    assert f["replicas"] == ["r2"] and "failed 6 of its 10 completion requests" in f["detail"], f
    # A few failures (at most half) are still not a finding.
    sim_config(sims[1], fault="error_500", fault_count=5)
    rc, doc, err = diagnose(path, "--repeat", "3", "--concurrency", "2")
    assert rc == 0 and doc["verdict"] == ["consistent"], doc["verdict"]


if __name__ == "__main__":
    run_tests(globals())
