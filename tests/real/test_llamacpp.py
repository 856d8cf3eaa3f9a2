"""detproxy in front of real llama.cpp servers (docs/attestation.md §5, llama.cpp): Debian sid's
llama-server in a chroot, serving a tiny generated GGUF model (scripts/real-engine.sh). Everything
the simulator stands in for elsewhere is checked here against the real thing:

  seeds (forced and derived) make sampled output repeatable; streamed equals whole; every
  chunk's fingerprint is rewritten; a Q8_0 replica in an F16 pool is rejected by native
  attestation, and caught when it replaces an F16 one in place; the `-fa off` replica (same
  metadata, other outputs) is named by /admin/drift and quarantined; `--kv-unified` replicas
  under concurrent load show batching noise, and neither is named or leaves service (the
  verdict itself may read drift there: docs/drift.md, "Known limits"); `detproxy diagnose` names each cause;
  the official `openai` npm client streams through detproxy.

When the Debian archive cannot be reached, the suite prints SKIPPED and exits 77 (ctest's
SKIP_RETURN_CODE): it never passes or fails silently. Measured numbers are printed as
`measured: {...}` lines (docs/real-engines.md quotes them)."""

import json
import fcntl
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "integration"))

from harness import (DETPROXY_BIN, SANITIZE, SLOW, SOURCE_DIR, free_port, get_json, http, poll_until,  # noqa: E402
                     post_json, run_cmd, run_tests, sse)
from proxyutil import metric, start_proxy, write_config  # noqa: E402

SCRIPT = os.path.join(SOURCE_DIR, "scripts", "real-engine.sh")
MODEL = "tiny"
TMP = tempfile.mkdtemp(prefix="detproxy-real-")
# Prompts found on this model (and pinned by the guard test below): under `-fa off` the first
# one's 32-token greedy output differs; under --kv-unified 8 concurrent copies of the second
# differ (seen on 3 of 3 fresh servers, 2-3 distinct outputs).
# A prompt whose 32 tokens differ under -fa off: which one depends on the CPU's kernels, so it
# is measured on this machine (fa_prompt) rather than pinned.
FA_CANDIDATES = ["prompt number %d about things" % i for i in range(60)]
KVU_PROMPT = "prompt number 12 about things"  # batch-dependent under --kv-unified on fresh servers (tried first)
LONG = 256  # tokens: long enough for -fa off to show on most prompts (65% at 256, 10% at 32)


def engine(*args, check=True):
    r = subprocess.run([SCRIPT] + list(args), capture_output=True, text=True, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError("real-engine.sh %s: rc %d\n%s" % (" ".join(args), r.returncode,
                                                              r.stderr[-2000:]))
    return r


def setup_or_skip():
    t0 = time.monotonic()
    r = engine("setup", check=False)
    sys.stderr.write(r.stderr)
    if r.returncode == 77:
        print("SKIPPED: tests/real needs the Debian archive to build the llama.cpp chroot, and "
              "it cannot be reached\n" + r.stderr.strip(), flush=True)
        sys.exit(77)
    assert r.returncode == 0, r.stderr
    info = dict(l.split("=", 1) for l in engine("info").stdout.splitlines())
    print("measured: " + json.dumps({"setup_s": round(time.monotonic() - t0, 1),
                                     "llama_cpp_tools": info["llama_cpp_tools"]}), flush=True)
    return info


REAL_DIR = os.environ.get("DETPROXY_REAL_DIR", "/var/cache/detproxy/real")


def lock_suite():
    """One run of this suite at a time per state directory (every worktree on the machine
    shares it): runs use the same server names and stop the ones an interrupted run left,
    which would kill a concurrent run's servers; and the measurements need the cores."""
    os.makedirs(REAL_DIR, exist_ok=True)
    path = os.path.join(REAL_DIR, "suite.lock")
    f = open(path, "w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print("waiting for another tests/real run to finish (%s)" % path, flush=True)
        fcntl.flock(f, fcntl.LOCK_EX)
    return f


SUITE_LOCK = lock_suite()
INFO = setup_or_skip()
_servers = {}
_started = set()  # every name ever started, stopped at exit even when its start failed


# Server names carry this run's pid: the script's run/ directory is shared by every checkout on
# the machine, and a fixed name let one run's start stop another run's server.
PREFIX = "t-%d-" % os.getpid()


def stop_orphans():
    """Stop servers left by interrupted runs (named t-PID-..., that PID gone)."""
    run = os.path.join(os.environ.get("DETPROXY_REAL_DIR", "/var/cache/detproxy/real"), "run")
    names = [f[:-4] for f in (os.listdir(run) if os.path.isdir(run) else ())
             if f.startswith("t-") and f.endswith(".pid")]
    orphans = [n for n in names if n.split("-")[1].isdigit() and
               not os.path.exists("/proc/" + n.split("-")[1])]
    if orphans:
        engine("stop", *orphans, check=False)


def server(name, model="f16", *flags):
    """A llama-server started once for the whole suite (stopped at exit)."""
    if name not in _servers:
        port = free_port()
        if not _started:
            stop_orphans()
        _started.add(name)
        engine("start", PREFIX + name, str(port), model, "--", *flags)
        _servers[name] = port
    return _servers[name]


def stop_all():
    if _started:
        engine("stop", *[PREFIX + n for n in sorted(_started)], check=False)


def measured(**kv):
    print("measured: " + json.dumps(kv), flush=True)


def replica(name, port, source="llamacpp"):
    return {"name": name, "url": "http://127.0.0.1:%d" % port, "attest": {"source": source}}


def proxy(ports, manifest=None, policy=None, shadow=None, interval=5000, ready=True, slots=0,
          **top):
    p = {"name": "p", "models": [MODEL], "balance": "round_robin",
         "replicas": [replica("r%d" % (i + 1), port) for i, port in enumerate(ports)]}
    if slots:
        p["max_inflight_per_replica"] = slots
    if manifest is not None:
        p["manifest"] = manifest
    cfg = {"attestation": {"interval_ms": interval, "timeout_ms": 3000}}
    if policy:
        cfg["policy"] = policy
    if shadow:
        cfg["shadow"] = shadow
    cfg.update(top)
    return start_proxy(pools=[p], config=cfg, ready=ready, timeout=20)


def replicas(px):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def completion(port, prompt, max_tokens=16, headers=None, **kw):
    b = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    b.update(kw)
    r = post_json(port, "/v1/completions", b, headers=headers)
    assert r.status == 200, (r.status, r.body[:300])
    return r


def text(r):
    return r.json()["choices"][0]["text"]


def direct(port, prompt, max_tokens=32, **kw):
    """Straight to a llama-server, not through detproxy."""
    b = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    b.update(kw)
    return text(post_json(port, "/v1/completions", b))


_fa_prompt = []


def fa_prompt():
    """The first candidate whose 32 tokens at temperature 0 differ between a default server and
    a -fa off one (diagnose asks for 32); measured once per run."""
    if not _fa_prompt:
        a, fa = server("a"), server("fa", "f16", "-fa", "off")
        found = next((p for p in FA_CANDIDATES if direct(a, p) != direct(fa, p)), None)
        assert found, "no candidate prompt differs under -fa off at 32 tokens on this machine"
        measured(fa_prompt_index=FA_CANDIDATES.index(found))
        _fa_prompt.append(found)
    return _fa_prompt[0]


def load(px, n, parallel=1, max_tokens=LONG, first=0):
    """n completions of prompts numbered first.., `parallel` at a time."""
    errors = []

    def worker(k):
        for i in range(first + k, first + n, parallel):
            r = post_json(px.port, "/v1/completions",
                          {"model": MODEL, "prompt": "prompt number %d about things" % i,
                           "max_tokens": max_tokens, "temperature": 0}, timeout=120)
            if r.status != 200:
                errors.append((r.status, r.body[:200]))
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(parallel)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:3]


def drift(px):
    return get_json(px.admin_port, "/admin/drift")["pools"]["p"]


def divergence(summary):
    """A drift summary's divergence rate, rounded; None when it has no samples (a window that
    restarted, or copies that found no free slot while clients kept the pool busy)."""
    rate = summary["exact_match_rate"]
    return None if rate is None else round(1 - rate, 3)


def diagnose(path, *args):
    rc, out, err = run_cmd([DETPROXY_BIN, "diagnose", "-c", path, "--json"] + list(args),
                           timeout=300)
    assert rc in (0, 1) and "Sanitizer" not in err, (rc, err[-2000:])
    doc = json.loads(out)
    return rc, {f["cause"]: f for f in doc["findings"]}, doc


def config_file(ports, manifest=None, policy=None):
    p = {"name": "p", "models": [MODEL],
         "replicas": [replica("r%d" % (i + 1), port) for i, port in enumerate(ports)]}
    if manifest:
        p["manifest"] = manifest
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "pools": [p]}
    if policy:
        cfg["policy"] = policy
    return write_config(cfg, tempfile.mkdtemp(dir=TMP))


# ---- the tests --------------------------------------------------------------------------------


def test_concurrent_runs_and_setups_wait_for_each_other():
    held = subprocess.run(["flock", "-n", os.path.join(REAL_DIR, "suite.lock"), "true"])
    assert held.returncode == 1, "this run does not hold the suite lock"
    # A second setup waits while one is under way (both would build the same root.tmp).
    with open(os.path.join(REAL_DIR, "setup.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        p = subprocess.Popen([SCRIPT, "setup"], stderr=subprocess.PIPE, text=True)
        try:
            p.wait(timeout=3)
            raise AssertionError("setup ran while another held the lock: " + p.stderr.read())
        except subprocess.TimeoutExpired:
            pass
    assert p.wait(timeout=120) == 0
    assert "waiting for another setup" in p.stderr.read()


def test_the_real_behaviours_the_suite_relies_on():
    """Guard: the measured facts below are what the other tests depend on."""
    a, fa, kvu = server("a"), server("fa", "f16", "-fa", "off"), server("kvu", "f16", "--kv-unified")
    props = get_json(a, "/props")
    assert props["model_ftype"] == "F16" and props["build_info"], props.get("model_ftype")
    assert http("GET", a, "/version").status == 404
    assert direct(a, fa_prompt()) != direct(fa, fa_prompt())
    prompts = ["prompt number %d about things" % i for i in range(20)]
    fa_diff = sum(direct(a, p, 64) != direct(fa, p, 64) for p in prompts)
    same = sum(direct(a, p, 64) == direct(a, p, 64) for p in prompts)
    assert same == 20
    # 16 different prompts, 8 in flight, against their sequential outputs: --kv-unified makes
    # them depend on the batch; the default (-np 4, per-slot KV cache) does not.
    def concurrent_differ(port):
        seq = {p: direct(port, p, 64) for p in prompts[:16]}
        with ThreadPoolExecutor(8) as ex:
            return sum(sum(o != seq[p] for p, o in ex.map(lambda p: (p, direct(port, p, 64)),
                                                           prompts[:16])) for _ in range(3))
    # How requests meet in the engine's batches varies from run to run (a busy box makes them
    # meet less often): up to four more tries before the noise is said to be missing.
    kvu_diff, kvu_tries = 0, 0
    while kvu_diff == 0 and kvu_tries < 5:
        kvu_diff += concurrent_differ(kvu)
        kvu_tries += 1
    a_diff = concurrent_differ(a)
    assert kvu_diff > 0, "no batching noise on --kv-unified in %d requests" % (48 * kvu_tries)
    assert a_diff == 0, "batching noise without --kv-unified"
    measured(fa_off_differs_at_64_tokens="%d/20" % fa_diff,
             kv_unified_concurrent_differ="%d/%d" % (kvu_diff, 48 * kvu_tries),
             default_concurrent_differ="%d/48" % a_diff)


def test_forced_and_derived_seeds_make_sampling_repeatable():
    policy = {"tenants": [
        {"name": "forced", "match": {"header": {"name": "x-tenant", "value": "forced"}},
         "sampling": {"seed": {"force": 1234}}},
        {"name": "derived", "match": {"header": {"name": "x-tenant", "value": "derived"}},
         "sampling": {"seed": {"derive": True}}},
        {"name": "free", "match": {"any": True}},
    ]}
    px = proxy([server("a"), server("a2")], manifest={"quantization": "F16"}, policy=policy)
    body = dict(prompt="Once upon a time", max_tokens=24, temperature=0.8)
    for tenant in ("forced", "derived"):
        outs = set()
        for _ in range(4):  # alternating r1 and r2: repeatable across replicas too
            r = completion(px.port, headers={"x-tenant": tenant}, **body)
            assert r.headers.get("x-detproxy-seed"), r.headers
            outs.add(text(r))
        assert len(outs) == 1, (tenant, outs)
    free = {text(completion(px.port, **body)) for _ in range(4)}
    assert len(free) > 1, "llama.cpp sampled the same text 4 times without a seed"
    px.stop()


def test_streamed_equals_whole_and_every_chunk_carries_the_pool_fingerprint():
    px = proxy([server("a")], manifest={"quantization": "F16"})
    build = get_json(server("a"), "/props")["build_info"]
    whole = completion(px.port, "Hello there", max_tokens=40, temperature=0)
    fp = whole.headers["x-detproxy-fingerprint"]
    assert whole.json()["system_fingerprint"] == fp
    assert whole.headers["x-detproxy-upstream-fingerprint"] == build
    chunks = [json.loads(d) for _, d in sse(px.port, "/v1/completions",
                                            {"model": MODEL, "prompt": "Hello there",
                                             "max_tokens": 40, "temperature": 0, "stream": True})
              if d != "[DONE]"]
    assert chunks and all(c["system_fingerprint"] == fp for c in chunks), chunks[:2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text(whole)
    # Chat: llama.cpp opens with a role delta whose content is null, and sends no usage.
    msgs = [{"role": "user", "content": "Hello there"}]
    cw = post_json(px.port, "/v1/chat/completions",
                   {"model": MODEL, "messages": msgs, "max_tokens": 40, "temperature": 0}).json()
    cs = [json.loads(d) for _, d in sse(px.port, "/v1/chat/completions",
                                        {"model": MODEL, "messages": msgs, "max_tokens": 40,
                                         "temperature": 0, "stream": True}) if d != "[DONE]"]
    assert cs[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}, cs[0]
    assert all(c["system_fingerprint"] == fp for c in cs) and cw["system_fingerprint"] == fp
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in cs) == \
        cw["choices"][0]["message"]["content"]
    assert all("usage" not in c for c in cs)
    px.stop()


def test_a_request_queued_behind_a_stream_never_meets_the_close_that_ends_it():
    """llama-server closes every connection it streamed an answer on, right after the last
    chunk, though its head said keep-alive; a request sent on that connection meanwhile is read
    and dropped without an answer, and its close looks like an engine that took the request (a
    502, never sent again). On a single-sequence pool the request queued behind a stream is
    dispatched the moment the stream ends: it must go over a new connection, never the one the
    engine is closing (docs/requests.md, "Connection reuse"). One worker, so that it meets the
    stream's connection; before this was handled, every run met it."""
    px = proxy([server("a")], manifest={"quantization": "F16",
                                        "determinism": {"mode": "single_sequence"}}, workers=1)
    runs = 6
    for i in range(runs):
        opened, out = threading.Event(), {}

        def stream():
            out["events"] = [d for _, d in sse(
                px.port, "/v1/completions",
                {"model": MODEL, "prompt": "Once upon a time %d" % i, "max_tokens": 200,
                 "temperature": 0, "stream": True}, on_open=lambda r: opened.set())]

        t = threading.Thread(target=stream)
        t.start()
        assert opened.wait(30 * SLOW)
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "Another %d" % i,
                                                   "max_tokens": 8, "temperature": 0})
        t.join(60 * SLOW)
        assert r.status == 200, (i, r.status, r.body[:300])
        assert out.get("events", [None])[-1] == "[DONE]", out
    errors = {k: metric(px, "detproxy_upstream_errors_total", pool="p", replica="r1", kind=k)
              for k in ("closed", "reused_closed")}
    assert errors == {"closed": 0, "reused_closed": 0}, errors
    px.stop()


def test_q8_0_replica_in_an_f16_pool_is_rejected_natively():
    t0 = time.monotonic()
    px = proxy([server("a"), server("q8", "q8_0")], manifest={"quantization": "F16"}, ready=False)
    poll_until(lambda: replicas(px)["r2"]["state"] == "rejected" and
               replicas(px)["r1"]["state"] == "admitted", timeout=10 * SLOW, interval=0.01,
               what="r1 admitted, r2 rejected")
    decided = time.monotonic() - t0
    rep = replicas(px)
    assert "quantization mismatch: got Q8_0 want F16" in rep["r2"]["reasons"], rep["r2"]
    report = rep["r1"]["attestation"]["report"]
    build = get_json(server("a"), "/props")["build_info"]
    assert report["framework"] == {"name": "llamacpp", "version": build}, report
    # The engine fingerprint is the build: the same for every quantization of the file.
    assert report["engine_fingerprint"] == build
    assert rep["r2"]["attestation"]["report"]["engine_fingerprint"] == build
    for _ in range(6):
        assert completion(px.port, "hi", max_tokens=2).headers["x-detproxy-replica"] == "r1"
    measured(attestation_decided_s_from_proxy_start=round(decided, 3))
    px.stop()


def test_a_q8_0_server_swapped_in_for_an_f16_one_is_ejected():
    a = server("a")
    port = free_port()
    _started.add("swap")
    engine("start", PREFIX + "swap", str(port), "f16")
    px = proxy([a, port], manifest={"quantization": "F16"}, interval=30000)
    poll_until(lambda: replicas(px)["r2"]["state"] == "admitted", what="r2 admitted")
    stop = threading.Event()
    served = []

    def traffic():
        while not stop.is_set():
            r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                       "max_tokens": 2})
            served.append((time.monotonic(), r.status, r.headers.get("x-detproxy-replica")))
    t = threading.Thread(target=traffic)
    t.start()
    try:
        time.sleep(0.3)
        engine("stop", PREFIX + "swap")
        engine("start", PREFIX + "swap", str(port), "q8_0")
        t_up = time.monotonic()
        poll_until(lambda: replicas(px)["r2"]["state"] == "rejected", timeout=20 * SLOW,
                   interval=0.01, what="swapped r2 rejected: %s" % replicas(px)["r2"])
        ejected = time.monotonic() - t_up
    finally:
        stop.set()
        t.join()
    assert "quantization mismatch: got Q8_0 want F16" in replicas(px)["r2"]["reasons"]
    # Nothing the Q8_0 server generated reached a client.
    assert not [s for s in served if s[0] > t_up and s[2] == "r2"], served[-5:]
    measured(swap_ejected_s_after_q8_0_listening=round(ejected, 3),
             client_errors_during_swap=sum(1 for s in served if s[1] != 200))
    px.stop()


def test_the_fa_off_replica_is_named_by_drift_and_quarantined():
    px = proxy([server("a"), server("a2"), server("fa", "f16", "-fa", "off")],
               manifest={"quantization": "F16"},
               shadow={"rate": 0.7, "self_rate": 0.3, "max_inflight": 4,
                       "max_output_bytes": 65536, "quarantine": True})
    rep = replicas(px)
    # Native attestation cannot tell: same file, same metadata.
    assert all(r["state"] == "admitted" for r in rep.values()), rep
    t0 = time.monotonic()
    n = 0
    while n < 400:
        load(px, 40, parallel=2)
        n += 40
        d = drift(px)
        if d["verdict"] == "cross_replica_drift" and d["suspect"] == "r3":
            break
    assert d["verdict"] == "cross_replica_drift" and d["suspect"] == "r3", json.dumps(d)[:900]
    poll_until(lambda: replicas(px)["r3"]["state"] == "quarantined", what="r3 quarantined")
    named = time.monotonic() - t0
    for i in range(6):
        r = completion(px.port, "q%d" % i, max_tokens=4, temperature=0)
        assert r.headers["x-detproxy-replica"] != "r3"
    measured(fa_off_cross_rate=divergence(d["cross"]),
             fa_off_self_rate=divergence(d["self"]),
             fa_off_samples=d["cross"]["samples"] + d["self"]["samples"],
             fa_off_requests_until_named=n, fa_off_named_and_quarantined_s=round(named, 1))
    px.stop()


def test_kv_unified_replicas_under_load_show_batching_noise_and_nobody_is_ejected():
    # As many requests per replica as the engine has slots (-np 4), and more HTTP threads than
    # connections detproxy may hold open to it, as docs/drift.md ("Known limits") tells an
    # operator: llama-server serves each connection, idle keep-alive ones too, on one of its
    # -np + 2 threads, so with more open a check's new connection waits past timeout_ms, the
    # replica is unreachable for a moment, and its return restarts the drift windows.
    flags = ("--kv-unified", "--threads-http", "16")
    px = proxy([server("kvh", "f16", *flags), server("kvh2", "f16", *flags)],
               manifest={"quantization": "F16"}, slots=4,
               shadow={"rate": 0.5, "self_rate": 0.5, "max_inflight": 8,
                       "max_output_bytes": 65536, "quarantine": True})
    # Every request its own prompt, as in real traffic: a prompt sent again tends to flip (or
    # not) again, so repeats would make the samples anything but independent, which the
    # verdict's test assumes. Read once each kind has 100 samples.
    n = 0
    while n < 800:
        load(px, 40, parallel=4, max_tokens=128, first=n)
        n += 40
        d = drift(px)
        if d["cross"]["samples"] >= 100 and d["self"]["samples"] >= 100:
            break
    measured(kv_unified_self_rate=divergence(d["self"]),
             kv_unified_cross_rate=divergence(d["cross"]),
             kv_unified_cross_samples=d["cross"]["samples"],
             kv_unified_self_samples=d["self"]["samples"],
             kv_unified_verdict=d["verdict"], kv_unified_requests=n)
    assert d["cross"]["samples"] >= 100 and d["self"]["samples"] >= 100, json.dumps(d)[:900]
    # The batching noise is seen: a replica does not agree with itself.
    self_diverged = d["self"]["samples"] - round(d["self"]["exact_match_rate"] *
                                                 d["self"]["samples"])
    assert self_diverged >= 3 and divergence(d["self"]) >= 0.02, d["self"]
    if d["verdict"] == "cross_replica_drift":
        # Known limit (docs/drift.md): on this engine a cross pair diverges up to 3x as often
        # as a self pair, so the verdict can read drift. Two replicas: no suspect, nobody out.
        print("NOTE: --kv-unified read as cross_replica_drift: %s" % d["reasons"], flush=True)
    else:
        assert d["verdict"] == "batching_nondeterminism", json.dumps(d)[:900]
    assert d["suspect"] is None, d
    states = {n: (r["state"], r["reasons"]) for n, r in replicas(px).items()}
    assert all(s == "admitted" for s, _ in states.values()), states
    # Never out of service meanwhile (a return would have restarted the windows).
    left = [(r["replica"], r["to"], r["reasons"]) for r in px.find_logs("replica_state")
            if r["from"] == "admitted"]
    assert not left, left
    px.stop()


def test_diagnose_names_each_cause():
    pin = {"tenants": [{"name": "d", "match": {"any": True}, "sampling": {"seed": {"derive": True}}}]}
    # Step 1: the Q8_0 replica by its metadata.
    rc, causes, doc = diagnose(config_file([server("a"), server("a2"), server("q8", "q8_0")],
                                           policy=pin))
    f = causes.get("cross_replica_drift")
    assert rc == 1 and f and f["replicas"] == ["r3"], doc["verdict"]
    assert "quantization (Q8_0 vs F16" in f["detail"], f
    # Step 4: the -fa off replica by its outputs (its metadata is identical).
    rc, causes, doc = diagnose(config_file([server("a"), server("a2"),
                                            server("fa", "f16", "-fa", "off")], policy=pin),
                               "--prompt", fa_prompt())
    f = causes.get("cross_replica_drift")
    assert rc == 1 and f and f["replicas"] == ["r3"], doc["verdict"]
    assert doc["steps"]["metadata"]["differences"] == []
    # Step 3: --kv-unified under concurrency, on fresh servers: where a near-tie flips depends
    # on the KV cells earlier requests left behind and on the CPU's kernels, so a prompt that
    # shows it is looked for here, each candidate on a fresh pair. A pair whose outputs never
    # moved is "consistent" (the noise did not show on that prompt); any other finding fails.
    seen = []
    for i, prompt in enumerate([KVU_PROMPT] + FA_CANDIDATES[:11]):
        rc, causes, doc = diagnose(
            config_file([server("dkvu%d" % i, "f16", "--kv-unified"),
                         server("dkvu%db" % i, "f16", "--kv-unified")], policy=pin),
            "--prompt", prompt, "--repeat", "16", "--concurrency", "8")
        seen.append(doc["verdict"])
        if rc == 1 and set(causes) == {"batching_nondeterminism"}:
            measured(kv_unified_diagnose_prompts_tried=i + 1)
            break
        assert rc == 0, (doc["verdict"], doc["steps"]["single_replica"])
    else:
        raise AssertionError("no prompt showed --kv-unified batching noise to diagnose: %s" % seen)


def test_the_openai_npm_client_streams_through_detproxy():
    # The client must send a key: a gateway tenant takes any (a key matching no tenant is 401).
    gateway = {"tenants": [{"name": "gw", "match": {"any": True, "unknown_keys": True}}]}
    px = proxy([server("a")], manifest={"quantization": "F16"}, policy=gateway)
    js = os.path.join(TMP, "client.js")
    with open(js, "w") as f:
        f.write("""
const OpenAI = require('openai');
(async () => {
  const c = new OpenAI({baseURL: process.argv[2], apiKey: 'unused'});
  const s = await c.chat.completions.create({model: 'tiny', stream: true, max_tokens: 24,
    temperature: 0, messages: [{role: 'user', content: 'Hello there'}]});
  let text = '', fps = new Set(), n = 0;
  for await (const chunk of s) {
    n++; fps.add(chunk.system_fingerprint);
    text += chunk.choices[0]?.delta?.content || '';
  }
  console.log(JSON.stringify({text, chunks: n, fingerprints: [...fps]}));
})().catch(e => { console.error(e); process.exit(1); });
""")
    env = dict(os.environ, NODE_PATH=INFO["node_modules"])
    r = subprocess.run(["node", js, "http://127.0.0.1:%d/v1" % px.port], capture_output=True,
                       text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout)
    whole = post_json(px.port, "/v1/chat/completions",
                      {"model": MODEL, "max_tokens": 24, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hello there"}]})
    assert got["text"] == whole.json()["choices"][0]["message"]["content"], got
    assert got["chunks"] > 2 and got["fingerprints"] == [whole.headers["x-detproxy-fingerprint"]]
    px.stop()


if __name__ == "__main__":
    try:
        run_tests(globals())
    finally:
        stop_all()
