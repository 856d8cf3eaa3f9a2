"""Deterministic pools (docs/configuration.md, "Deterministic pools"): manifest determinism.mode batch_invariant is admitted
only when the replica attests it (SGLang's enable_deterministic_inference, llama.cpp's
total_slots 1, vLLM's VLLM_BATCH_INVARIANT through the agent); single_sequence is enforced by
detproxy (one request in flight per replica, cache_prompt false for llama.cpp); a tenant's
require_determinism routes only to pools with that mode."""

import atexit
import gzip
import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

from harness import (DETPROXY_BIN, get_json, http, poll_until, post_json, run_cmd, run_tests,
                     start_process, start_sim)
import proxyutil
from proxyutil import (client_requests, generating, metric, pool, sim_config, sim_reset, sim_stats,
                       slots_answer, start_proxy, write_config)

MODEL = "det-model"
TMP = tempfile.mkdtemp(prefix="detproxy-det-")


def replicas(px):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def state(px, name):
    return replicas(px)[name]["state"]


def reasons(px, name):
    return replicas(px)[name]["reasons"]


def fast_attestation(interval=200):
    return {"interval_ms": interval, "timeout_ms": 1000, "require_signature": False}


def native_sims(flavor, settings):
    sims = [start_sim("--model", MODEL, "--flavor", flavor) for _ in settings]
    for s, kv in zip(sims, settings):
        sim_config(s, **kv)
    return sims


def det_manifest(framework, mode="batch_invariant"):
    return {"model": MODEL, "framework": {"name": framework}, "determinism": {"mode": mode}}


def complete(px, headers=None, **body):
    b = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    b.update(body)
    return post_json(px.port, "/v1/completions", b, headers=headers)


# ---- batch_invariant, attested natively -----------------------------------------------------

def test_sglang_admitted_only_with_deterministic_inference_and_ejected_when_it_goes():
    on, off = native_sims("sglang", [{"deterministic_inference": True},
                                     {"deterministic_inference": False}])
    px = start_proxy(pools=[pool("p", [MODEL], [on, off], manifest=det_manifest("sglang"))],
                     attestation=fast_attestation())
    poll_until(lambda: state(px, "r2") == "rejected", what="r2 rejected")
    assert state(px, "r1") == "admitted"
    assert reasons(px, "r2") == [
        "determinism.mode unattested (sglang enable_deterministic_inference is false)"], \
        reasons(px, "r2")
    rep = replicas(px)["r1"]["attestation"]["report"]
    assert rep["determinism"] == {"mode": "batch_invariant"}, rep
    for _ in range(10):
        r = complete(px)
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r1", r
    assert client_requests(off) == []
    # The normal re-attestation cadence sees the flag go (a restart without it) and ejects.
    sim_config(on, deterministic_inference=False)
    sim_config(off, deterministic_inference=True)
    poll_until(lambda: state(px, "r1") == "rejected" and state(px, "r2") == "admitted",
               what="r1 ejected, r2 admitted")
    assert complete(px).headers["x-detproxy-replica"] == "r2"
    px.stop()


def test_llamacpp_batch_invariant_needs_one_slot():
    one, four = native_sims("llamacpp", [{"total_slots": 1}, {"total_slots": 4}])
    px = start_proxy(pools=[pool("p", [MODEL], [one, four], manifest=det_manifest("llamacpp"))],
                     attestation=fast_attestation())
    poll_until(lambda: state(px, "r2") == "rejected", what="r2 rejected")
    assert state(px, "r1") == "admitted"
    assert reasons(px, "r2") == [
        "determinism.mode unattested (llamacpp total_slots is 4, batch_invariant needs 1)"], \
        reasons(px, "r2")
    px.stop()


def test_vllm_adapter_cannot_attest_it_and_check_says_so():
    sim = start_sim("--model", MODEL)
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "pools": [pool("p", [MODEL], [sim], manifest=det_manifest("vllm"))]}
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg)])
    assert rc == 0, err
    assert "pools[0].replicas[0].attest: the vllm adapter cannot attest determinism.mode " \
        "\"batch_invariant\"" in out + err, out + err
    px = start_proxy(pools=cfg["pools"], attestation=fast_attestation(), ready=False)
    poll_until(lambda: state(px, "r1") == "rejected", what="rejected")
    assert reasons(px, "r1") == [
        "determinism.mode unattested (vllm adapter cannot: run the agent with --determinism)"]
    px.stop()


# ---- batch_invariant through the agent ------------------------------------------------------

def model_dir():
    d = os.path.join(TMP, "model")
    if not os.path.isdir(d):
        os.makedirs(d)
        with open(os.path.join(d, "config.json"), "w") as f:
            f.write('{"arch": "toy"}')
        os.chmod(TMP, 0o755)
        os.chmod(d, 0o755)
        os.chmod(os.path.join(d, "config.json"), 0o644)
    return d


def fake_vllm(value, name=None):
    """A process standing in for the vLLM server: sleeps with VLLM_BATCH_INVARIANT=value (None:
    unset) in its environment. With a name, it runs as TMP/name (a symlink to python), so its
    argv[0] is that name, as "vllm serve ..." would be."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_BATCH_INVARIANT"}
    if value is not None:
        env["VLLM_BATCH_INVARIANT"] = value
    exe = sys.executable
    if name:
        exe = os.path.join(TMP, name)
        if not os.path.exists(exe):
            os.symlink(sys.executable, exe)
    p = subprocess.Popen([exe, "-c", "import time; time.sleep(600)"], env=env)
    _fakes.append(p)
    return p


_fakes = []  # killed at exit: a failed test must not leave one holding ctest's output open


@atexit.register
def _kill_fakes():
    for p in _fakes:
        if p.poll() is None:
            p.kill()


def agent(*det_flags, user=None):
    argv = [DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0", "--model-dir",
            model_dir(), "--model", MODEL, "--framework", "vllm", "--framework-version", "0.11.0",
            "--watch-interval-ms", "100"] + list(det_flags)
    if user is None:
        return start_process(argv, name="agent")
    # Another uid than the server's: reading its environ is refused by the kernel.
    return start_process(["setpriv", "--reuid=%d" % user, "--regid=%d" % user, "--clear-groups",
                          "--"] + argv, name="agent")


def agent_proxy(ag, sim):
    p = pool("p", [MODEL], [sim], manifest={"model": MODEL, "determinism":
                                            {"mode": "batch_invariant"}})
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % ag.port}
    return start_proxy(pools=[p], attestation=fast_attestation(), ready=False)


def test_agent_attests_vllm_batch_invariant_from_the_server_environment():
    sim = start_sim("--model", MODEL)
    srv = fake_vllm("1")
    ag = agent("--determinism", "batch_invariant", "--determinism-pid", str(srv.pid))
    px = agent_proxy(ag, sim)
    poll_until(lambda: state(px, "r1") == "admitted", what="admitted")
    assert replicas(px)["r1"]["attestation"]["report"]["determinism"]["mode"] == "batch_invariant"
    assert complete(px).status == 200
    # The server goes away (a restart is a new process): the agent cannot tell any more, and the
    # next attestation ejects the replica with that reason.
    srv.kill()
    srv.wait()
    poll_until(lambda: state(px, "r1") == "rejected", what="ejected")
    why = reasons(px, "r1")
    assert why and why[0].startswith("determinism.mode unattested (cannot tell: /proc/%d/environ"
                                     % srv.pid), why
    assert ag.find_logs("determinism"), ag.stderr_text()
    px.stop()
    ag.stop()


def test_agent_off_or_unset_variable_is_rejected_naming_it():
    for value, want in (("0", "VLLM_BATCH_INVARIANT=0 in pid %d"),
                        (None, "VLLM_BATCH_INVARIANT is not set in pid %d"),
                        ("true", "VLLM_BATCH_INVARIANT=true in pid %d")):
        sim = start_sim("--model", MODEL)
        srv = fake_vllm(value)
        ag = agent("--determinism", "batch_invariant", "--determinism-pid", str(srv.pid))
        px = agent_proxy(ag, sim)
        poll_until(lambda: state(px, "r1") == "rejected", what="rejected")
        assert reasons(px, "r1") == ["determinism.mode unattested (%s)" % (want % srv.pid)], \
            reasons(px, "r1")
        assert complete(px).status == 503
        px.stop()
        ag.stop()
        srv.kill()
        srv.wait()


def test_agent_finds_the_server_by_name_and_every_match_must_have_it():
    name = "vllm-d14-%d" % os.getpid()  # unique: no other process on the box is named so
    sim = start_sim("--model", MODEL)
    srv = fake_vllm("1", name=name)
    ag = agent("--determinism", "batch_invariant", "--determinism-process", name)
    px = agent_proxy(ag, sim)
    poll_until(lambda: state(px, "r1") == "admitted", what="admitted")
    other = fake_vllm("0", name=name)  # a second server process without it
    poll_until(lambda: state(px, "r1") == "rejected", what="rejected")
    assert reasons(px, "r1") == ["determinism.mode unattested (VLLM_BATCH_INVARIANT=0 in pid %d)"
                                 % other.pid], reasons(px, "r1")
    other.kill()
    other.wait()
    poll_until(lambda: state(px, "r1") == "admitted", what="admitted again")
    srv.kill()
    srv.wait()
    poll_until(lambda: state(px, "r1") == "rejected", what="no server")
    assert reasons(px, "r1")[0].startswith(
        "determinism.mode unattested (cannot tell: no %s process in /proc" % name), \
        reasons(px, "r1")
    px.stop()
    ag.stop()


def test_agent_that_may_not_read_the_server_environment_says_it_cannot_tell():
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        print("    skipped: needs root and setpriv to run the agent as another uid")
        return
    sim = start_sim("--model", MODEL)
    srv = fake_vllm("1")  # runs as root
    ag = agent("--determinism", "batch_invariant", "--determinism-pid", str(srv.pid), user=65534)
    px = agent_proxy(ag, sim)
    poll_until(lambda: state(px, "r1") == "rejected", what="rejected")
    why = reasons(px, "r1")
    assert why == ["determinism.mode unattested (cannot tell: /proc/%d/environ: Permission "
                   "denied (the agent needs the server's uid or CAP_SYS_PTRACE))" % srv.pid], why
    report = replicas(px)["r1"]["attestation"]["report"]
    assert report["unattested"]["determinism.mode"].endswith(
        "(the agent needs the server's uid or CAP_SYS_PTRACE)"), report
    px.stop()
    ag.stop()
    srv.kill()
    srv.wait()


def test_agent_reading_sglang_takes_its_own_answer():
    sim = start_sim("--model", MODEL, "--flavor", "sglang")
    sim_config(sim, deterministic_inference=True)
    ag = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                        "--model-dir", model_dir(), "--model", MODEL, "--framework-url",
                        "http://127.0.0.1:%d" % sim.port, "--framework-refresh-ms", "100",
                        "--watch-interval-ms", "100", "--determinism", "batch_invariant"],
                       name="agent")
    px = agent_proxy(ag, sim)
    poll_until(lambda: state(px, "r1") == "admitted", what="admitted")
    sim_config(sim, deterministic_inference=False)
    poll_until(lambda: state(px, "r1") == "rejected", what="ejected")
    assert reasons(px, "r1") == [
        "determinism.mode unattested (sglang enable_deterministic_inference is false)"], \
        reasons(px, "r1")
    px.stop()
    ag.stop()


def test_agent_determinism_flags_are_checked():
    base = [DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0", "--model-dir", TMP,
            "--model", "m", "--framework", "vllm", "--framework-version", "1"]
    for flags, want in ((["--determinism", "single_sequence"], "expected batch_invariant"),
                        (["--determinism-pid", "1"], "need --determinism batch_invariant"),
                        (["--determinism", "batch_invariant", "--determinism-pid", "x"],
                         "expected a process id"),
                        (["--determinism", "batch_invariant", "--determinism-pid", "1",
                          "--determinism-process", "vllm"], "exclude each other")):
        rc, out, err = run_cmd(base + flags)
        assert rc == 2 and want in err, (flags, rc, err)


# ---- single_sequence ------------------------------------------------------------------------

def concurrent(px, n, **body):
    out = []

    def one():
        out.append(complete(px, **body))
    ts = [threading.Thread(target=one) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def last_body(sim):
    return json.loads(get_json(sim.port, "/_sim/last_request")["body"])


def single_sequence_pool(sims, framework=None, **extra):
    man = {"determinism": {"mode": "single_sequence"}}
    if framework:
        man.update(model=MODEL, framework={"name": framework})
    return pool("p", [MODEL], sims, manifest=man, **extra)


def reset(a):
    """A client gone mid-generation."""
    a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    a.close()


def abandon(port, target, body, sim, headers=b""):
    reset(generating(port, target, body, sim, headers))


def test_single_sequence_never_has_two_requests_at_a_replica():
    sims = [start_sim("--model", MODEL, "--token-delay-ms", "20") for _ in range(2)]
    # Without it, the same load overlaps at the replicas: the measurement can see concurrency.
    px = start_proxy(pools=[pool("p", [MODEL], sims, max_inflight_per_replica=4)])
    assert all(r.status == 200 for r in concurrent(px, 8, max_tokens=5))
    assert max(sim_stats(s)["max_inflight_seen"] for s in sims) > 1
    px.stop()
    for s in sims:
        sim_reset(s)
    cfg_pools = [single_sequence_pool(sims, max_inflight_per_replica=4)]
    px = start_proxy(pools=cfg_pools, shadow={"rate": 1.0, "self_rate": 0.0})
    res = concurrent(px, 8, max_tokens=5)
    assert all(r.status == 200 for r in res), [r.status for r in res]
    assert [sim_stats(s)["max_inflight_seen"] for s in sims] == [1, 1]
    # Shadow copies would be a second sequence in flight: none is sent.
    assert sum(sim_stats(s)["requests"] for s in sims) == 8
    assert metric(px, "detproxy_shadow_total", pool="p", result="skipped") >= 8
    cfg = get_json(px.admin_port, "/admin/config")
    assert cfg["pools"][0]["max_inflight_per_replica"] == 1
    assert cfg["pools"][0]["manifest"]["determinism"] == {"mode": "single_sequence"}
    px.stop()
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", px.config_path])
    assert rc == 0, err
    assert ("pools[0].max_inflight_per_replica: 4 is overridden: the manifest's "
            "determinism.mode \"single_sequence\" allows one request in flight per replica "
            "(effective value 1)") in out + err, out + err


def test_single_sequence_holds_the_slot_while_an_abandoned_answer_is_generated():
    """llama.cpp's server finishes a non-streamed generation whose client went away (it finds
    the connection closed only when it writes the answer, at the end): the sim's
    --finish-abandoned does the same. The replica's slot stays taken until that answer has come
    and been dropped, so the next request does not run beside it."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "20", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])])
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 60,
                       "temperature": 0}).encode()
    abandon(px.port, b"/v1/completions", body, sim)
    poll_until(lambda: metric(px, "detproxy_connections") == 0, what="the client gone")
    r = complete(px, max_tokens=3)
    assert r.status == 200, r
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert st["inflight"] == 0, st
    # The slot came back once the abandoned answer was read: the pool serves on.
    assert complete(px, max_tokens=3).status == 200
    assert metric(px, "detproxy_inflight_requests") == 0
    assert metric(px, "detproxy_slot_drains_total", end="whole") == 1
    assert metric(px, "detproxy_slot_drains_total") == 1
    px.stop()


def stream_in_front(px, sim, front, max_tokens):
    """A streamed completion through px to the engine behind front: (the client's socket, the
    front's connection number) once its answer has begun."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": max_tokens,
                       "temperature": 0, "stream": True}).encode()
    c = socket.create_connection(("127.0.0.1", px.port))
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the generation running")
    n = front.conn_of("POST /v1/completions")
    poll_until(lambda: front.answered[n] > 0, what="its answer begun")
    return c, n


def cut_in_front(px, sim, front, max_tokens, token_delay_ms=20):
    """A streamed completion through px; once its answer has begun, the front cuts detproxy's
    side while the engine generates on behind it. Returns when the client's stream has been
    cut too. The engine (at token_delay_ms a token) goes at 200 ms a token until the cut is
    seen, so a short answer is still running then however slow the box."""
    sim_config(sim, token_delay_ms=200)
    c, n = stream_in_front(px, sim, front, max_tokens)
    front.cut(n)  # the front reads the engine's answer on, to its end
    assert sim_stats(sim)["inflight"] == 1  # cut mid-answer
    sim_config(sim, token_delay_ms=token_delay_ms)
    c.settimeout(10)
    while c.recv(65536):
        pass  # detproxy cuts the client's stream, as the replica's was
    c.close()


def llamacpp_behind_a_front(hold_s, framework="llamacpp", directory=None, **extra):
    sim = start_sim("--model", MODEL, "--flavor", "llamacpp", "--token-delay-ms", "20")
    front = proxyutil.FrontCutter(sim.port)
    quiet = {"interval_ms": 600000, "timeout_ms": 2000, "require_signature": False}
    ms = int(hold_s * 1000)
    px = start_proxy(pools=[single_sequence_pool([front], framework=framework, **extra)],
                     attestation=quiet, directory=directory,
                     limits={"upstream_first_byte_timeout_ms": ms,
                             "upstream_idle_timeout_ms": ms})
    return sim, front, px


def test_single_sequence_llamacpp_frees_a_held_slot_once_the_engine_lists_none_processing():
    """A gateway in front of llama.cpp cuts detproxy's side of a streamed answer while the
    engine generates on behind it: nothing is left to read that says when it stops, so the slot
    is held, for as long as a drain would (60 s here). llama.cpp's GET /slots says it: the hold
    asks, and frees the slot once the generation has ended, not a minute later. Until then the
    next request waits: the engine never runs two."""
    sim, front, px = llamacpp_behind_a_front(60.0)
    cut_in_front(px, sim, front, max_tokens=100)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", complete(px, max_tokens=3)))
    t.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 0, timeout=10, what="the generation over")
    t_end = time.monotonic()
    t.join(30)
    assert out["r"].status == 200, out
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    # Freed within a few looks of the end (250 ms apart), not at the hold's 60 s.
    assert time.monotonic() - t_end < 5, time.monotonic() - t_end
    assert front.slot_looks >= 2, front.slot_looks
    assert metric(px, "detproxy_slot_holds_total", end="engine_idle") == 1
    assert metric(px, "detproxy_upstream_errors_total", kind="truncated") == 1
    px.stop()
    front.stop()


def test_single_sequence_keeps_a_held_slot_its_time_when_the_engine_says_nothing():
    """What does not say that the engine runs nothing keeps the hold for its whole time:
    llama.cpp started with --no-slots (501), answers of another shape, a slot listed busy. A
    pool that does not name llama.cpp does not ask at all."""
    hold_s = 2.0
    cases = [("llamacpp", (501, b'{"error":{"code":501,"message":"This server does not '
                                b'support slots endpoint.","type":"not_supported_error"}}')),
             ("llamacpp", (200, b"[]")),
             ("llamacpp", (200, b'[{"id":0,"n_ctx":512}]')),
             ("llamacpp", (200, b'{"is_processing":false}')),
             ("llamacpp", (200, slots_answer(False, True))),
             (None, (200, slots_answer(False)))]
    for framework, answer in cases:
        sim, front, px = llamacpp_behind_a_front(hold_s, framework)
        front.slots = lambda head, answer=answer: answer
        cut_in_front(px, sim, front, max_tokens=10)
        t_cut = time.monotonic()
        r = complete(px, max_tokens=3)
        assert r.status == 200, r
        assert time.monotonic() - t_cut >= 0.8 * hold_s, (answer, time.monotonic() - t_cut)
        assert metric(px, "detproxy_slot_holds_total", end="time") == 1, answer
        assert metric(px, "detproxy_slot_holds_total", end="engine_idle") == 0, answer
        assert (front.slot_looks > 0) == (framework is not None), (framework, front.slot_looks)
        assert sim_stats(sim)["max_inflight_seen"] == 1
        px.stop()
        front.stop()


def test_single_sequence_a_look_that_drips_in_is_given_up_and_asked_again():
    """An answer to the hold's look that comes a byte at a time, each within the idle timeout,
    is given up 2 s after it was asked, and the engine asked again: the hold does not wait on
    it for its whole time."""
    sim, front, px = llamacpp_behind_a_front(15.0)
    asked = []

    def slots(head):
        asked.append(time.monotonic())
        if len(asked) == 1:
            return 200, slots_answer(False), 0.5  # ~50 s for the whole answer
        return 200, slots_answer(False)
    front.slots = slots
    cut_in_front(px, sim, front, max_tokens=10)
    t_cut = time.monotonic()
    assert complete(px).status == 200
    assert time.monotonic() - t_cut < 8, time.monotonic() - t_cut
    assert metric(px, "detproxy_slot_holds_total", end="engine_idle") == 1
    assert asked[1] - asked[0] >= 1.9, asked
    px.stop()
    front.stop()


def tls_llamacpp_sim():
    """A llama.cpp-flavoured sim serving https with the test PKI's server certificate: (sim,
    pki, ask) where ask(path) reads one of its test endpoints (/_sim/stats, /_sim/requests)
    over TLS, and ask(path, body) posts body to one (/_sim/config) as JSON."""
    import http.client
    from certs import client_context, shared_pki
    pki = shared_pki()
    sim = start_sim("--model", MODEL, "--flavor", "llamacpp", "--token-delay-ms", "20",
                    "--tls-cert", pki.server.crt, "--tls-key", pki.server.key)
    tls = client_context(pki.ca)

    def ask(path, body=None):
        c = http.client.HTTPSConnection("127.0.0.1", sim.port, context=tls, timeout=10)
        if body is None:
            c.request("GET", path)
        else:
            c.request("POST", path, body=json.dumps(body),
                      headers={"content-type": "application/json"})
        r = c.getresponse()
        out = json.loads(r.read())
        c.close()
        assert r.status == 200, (path, r.status, out)
        return out
    return sim, pki, ask


def test_single_sequence_llamacpp_asks_an_https_engine_over_tls():
    """A held slot of an https llama.cpp replica asks its /slots over TLS, trusting what the
    pool's exchanges trust (its upstream_tls CA): freed once the engine runs nothing, not at the
    hold's 60 s. The gateway in front passes TLS through as bytes and cuts detproxy's side.
    Both a worker's hold (a client's stream) and the control thread's (the admin relay's), each
    with its own TLS context."""
    sim, pki, ask = tls_llamacpp_sim()
    front = proxyutil.FrontCutter(sim.port)
    p = single_sequence_pool([front], framework="llamacpp", upstream_tls={"ca_file": pki.ca.crt})
    p["replicas"][0]["url"] = "https://127.0.0.1:%d" % front.port
    px = start_proxy(pools=[p], attestation={"interval_ms": 600000, "timeout_ms": 2000,
                                             "require_signature": False},
                     limits={"upstream_first_byte_timeout_ms": 60000,
                             "upstream_idle_timeout_ms": 60000})
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100, "temperature": 0,
                       "stream": True}).encode()
    for held, (port, target, headers) in enumerate([
            (px.port, b"/v1/completions", b""),
            (px.admin_port, b"/admin/relay/v1/completions", RELAY_R1)], 1):
        c = socket.create_connection(("127.0.0.1", port))
        c.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s"
                  b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                  % (target, headers, len(body)) + body)
        poll_until(lambda: ask("/_sim/stats")["inflight"] == 1, what="the generation running")
        for n in list(front.answered):  # every connection through it: the stream's among them
            front.cut(n)
        assert ask("/_sim/stats")["inflight"] == 1  # cut mid-generation
        c.settimeout(10)
        while c.recv(65536):
            pass
        c.close()
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", complete(px, max_tokens=3)))
        t.start()
        poll_until(lambda: ask("/_sim/stats")["inflight"] == 0, timeout=10,
                   what="the generation over")
        t_end = time.monotonic()
        t.join(30)
        assert out["r"].status == 200, (held, out)
        assert time.monotonic() - t_end < 5, (held, time.monotonic() - t_end)
        assert ask("/_sim/stats")["max_inflight_seen"] == 1
        assert metric(px, "detproxy_slot_holds_total", end="engine_idle") == held
    px.stop()
    front.stop()


def test_a_start_check_cut_short_by_a_stop_says_so():
    """SIGTERM while a start check waits for a generation a killed process left: the check ends
    with the stop, logged with result `stopped` and why; nothing ran beside that generation."""
    sim = start_sim("--model", MODEL, "--flavor", "llamacpp", "--token-delay-ms", "20",
                    "--finish-abandoned")
    front = proxyutil.FrontCutter(sim.port)
    pools = [single_sequence_pool([front], framework="llamacpp")]
    first = start_proxy(pools=pools)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 250, "temperature": 1,
                       "seed": 1}).encode()  # 5 s
    a = generating(first.port, b"/v1/completions", body, sim)
    first.popen.kill()
    first.popen.wait(10)
    a.close()
    second = start_proxy(pools=pools, ready=False)
    poll_until(lambda: front.slot_looks >= 2, what="the start check asking the engine")
    second.stop()
    line = second.find_logs("engine_start_check")[-1]
    assert line["result"] == "stopped" and "stops" in line["reason"], line
    assert sim_stats(sim)["max_inflight_seen"] == 1


def test_single_sequence_llamacpp_a_restarted_proxy_waits_for_what_a_killed_one_left():
    """detproxy killed mid-answer (SIGKILL, out of memory) and started again at once, as a
    supervisor does: llama.cpp finishes the non-streamed generation whose connection closed,
    and the new process knows nothing of it. Before anything starts on an engine it has just
    begun to count, it asks the engine's /slots: its probe and its first request wait for
    that generation's end, and the engine never runs two. The check ends on an engine that
    says nothing, not on one that answers late."""
    sim = start_sim("--model", MODEL, "--flavor", "llamacpp", "--token-delay-ms", "20",
                    "--finish-abandoned")
    pools = [single_sequence_pool([sim], framework="llamacpp")]
    limits = {"upstream_first_byte_timeout_ms": 60000, "upstream_idle_timeout_ms": 60000}
    first = start_proxy(pools=pools, limits=limits)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100, "temperature": 1,
                       "seed": 1}).encode()  # 2 s: sampled with a seed, it runs all 100 tokens
    a = generating(first.port, b"/v1/completions", body, sim)
    first.popen.kill()
    first.popen.wait(10)
    a.close()
    second = start_proxy(pools=pools, limits=limits, ready=False)
    r = complete(second, max_tokens=3)
    while r.status == 503:  # not admitted yet: its probe waits for the engine too
        r = complete(second, max_tokens=3)
    assert r.status == 200, (r, second.stderr_text()[-3000:])
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert st["inflight"] == 0 and st["tokens_generated"] >= 100, st  # the first ran out
    assert metric(second, "detproxy_engine_start_checks_total", result="idle") == 1
    second.stop()
    # An engine that says nothing (llama-server --no-slots: 501) is not waited on for long:
    # the check gives up after three silent answers, and says so.
    front = proxyutil.FrontCutter(sim.port)
    front.slots = lambda head: (501, b'{"error":{"code":501,"message":"This server does not '
                                     b'support slots endpoint."}}')
    px = start_proxy(pools=[single_sequence_pool([front], framework="llamacpp")])
    assert complete(px).status == 200
    assert metric(px, "detproxy_engine_start_checks_total", result="unanswered") == 1
    assert front.slot_looks == 3, front.slot_looks
    assert px.find_logs("engine_start_check")[0]["level"] == "warn"
    px.stop()
    # An engine that takes the connection but answers late (stalled, paused) is not silent: it
    # may run what it holds once it goes on. Three answers that drip past the look's 2 s, then
    # an idle one: the check waits for that.
    asked = []

    def slots(head):
        asked.append(time.monotonic())
        return (200, slots_answer(False), 0.5) if len(asked) <= 3 else (200, slots_answer(False))
    front.slots = slots
    px = start_proxy(pools=[single_sequence_pool([front], framework="llamacpp")],
                     timeout=30)  # ~11 s: three looks given up at 2 s each, backing off
    assert complete(px).status == 200
    assert metric(px, "detproxy_engine_start_checks_total", result="idle") == 1
    assert metric(px, "detproxy_engine_start_checks_total", result="unanswered") == 0
    assert len(asked) >= 5, asked
    px.stop()
    front.stop()


def test_single_sequence_llamacpp_a_tls_look_trusts_only_what_the_pool_trusts_now():
    """A reload that withdraws trust in the engine (its CA file replaced in place) applies to
    the hold's looks at once: each is a new handshake, so the hold keeps its time rather than
    believe an engine it can no longer verify. Its looks had begun before the reload, on a
    connection verified under the old CA and kept alive between them (a look every 250 ms
    while the engine is busy, within the look's 2 s keep-alive), and the engine ran on past
    the reload: a look that went over that connection again would find the engine idle and
    free the slot early. And a start check on an https engine that takes connections but does
    not complete the handshake (paused) waits: an engine not seen is not an engine that says
    nothing."""
    sim, pki, ask = tls_llamacpp_sim()
    d = tempfile.mkdtemp(prefix="detproxy-tlslook-", dir=TMP)
    ca = os.path.join(d, "ca.pem")
    shutil.copy(pki.ca.crt, ca)
    front = proxyutil.FrontCutter(sim.port)
    p = single_sequence_pool([front], framework="llamacpp", upstream_tls={"ca_file": ca})
    p["replicas"][0]["url"] = "https://127.0.0.1:%d" % front.port
    px = start_proxy(pools=[p], directory=d, limits={"upstream_first_byte_timeout_ms": 12000,
                                                     "upstream_idle_timeout_ms": 12000})

    def looks():
        """GET /slots the engine was asked (its request log): the front sees TLS bytes only,
        and attestation's fetches (/props, /v1/models, again at once after the cut) open
        connections through it too."""
        return sum(r["method"] == "GET" and r["path"] == "/slots"
                   for r in ask("/_sim/requests")["requests"])
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 300, "temperature": 1,
                       "seed": 1, "stream": True}).encode()  # sampled: it runs all 300 tokens
    c = socket.create_connection(("127.0.0.1", px.port))
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
              + body)
    poll_until(lambda: ask("/_sim/stats")["inflight"] == 1, what="the generation running")
    # It outlasts the hold's first look and the reload however slow the build: 200 ms a token
    # until the reload is done, then quick.
    ask("/_sim/config", {"token_delay_ms": 200})
    before = looks()  # the start check's
    for n in list(front.answered):
        front.cut(n)
    c.settimeout(10)
    while c.recv(65536):
        pass
    c.close()
    # The hold's looks have begun (one answered, 1 s after the cut) on a connection verified
    # under the old CA, with the engine still busy.
    poll_until(lambda: looks() > before, what="a look answered")
    assert ask("/_sim/stats")["inflight"] == 1
    shutil.copy(pki.ca2.crt, ca)  # trust withdrawn, in place
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    shutil.copy(pki.ca.crt, ca)  # for the next process (this one has read the file)
    ask("/_sim/config", {"token_delay_ms": 5})
    poll_until(lambda: ask("/_sim/stats")["inflight"] == 0, timeout=10,
               what="the generation over")
    seen, asked = len(front.answered), looks()
    # Looked at after the engine went idle, and held its 12 s all the same: no look after the
    # reload got through to the engine.
    poll_until(lambda: metric(px, "detproxy_slot_holds_total") == 1, timeout=20,
               what="the hold's end")
    assert metric(px, "detproxy_slot_holds_total", end="time") == 1, (
        "a look believed the engine after the reload: %d reached it once idle, %d connections "
        "opened meanwhile" % (looks() - asked, len(front.answered) - seen),
        px.find_logs("slot_hold_released"))
    assert len(front.answered) > seen  # new handshakes, each refused its certificate
    assert looks() == asked
    px.stop()
    # A paused engine: the kernel takes the connection, the handshake never completes.
    sim.send_signal(signal.SIGSTOP)
    try:
        px = start_proxy(pools=[p], directory=d, ready=False)
        # Three looks given up (the first at 1 s, each at 2 s, backing off) end by ~8.5 s a
        # check that took them for silence; this one is still asking at 11 s.
        end = time.monotonic() + 11
        while time.monotonic() < end:
            assert metric(px, "detproxy_engine_start_checks_total") == 0, px.find_logs(
                "engine_start_check")
            time.sleep(0.5)
    finally:
        sim.send_signal(signal.SIGCONT)
    poll_until(lambda: metric(px, "detproxy_engine_start_checks_total", result="idle") == 1,
               timeout=30, what="the check ended once the engine answered")
    px.stop()
    front.stop()


def test_single_sequence_a_held_slot_asks_as_the_configuration_in_force_says():
    """The look carries the pool's API key and follows its manifest as the last reload left
    them: a rotated key is the one sent (an engine that refuses the old one would leave every
    hold its whole time), and a pool whose manifest no longer names llama.cpp does not ask."""
    d = tempfile.mkdtemp(prefix="detproxy-det-key-", dir=TMP)
    keyf = os.path.join(d, "engine-key")
    with open(keyf, "w") as f:
        f.write("old-key\n")
    refused = b'{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}'
    sim, front, px = llamacpp_behind_a_front(6.0, directory=d, api_key_file="engine-key")
    busy = {"now": True}
    front.slots = lambda head: ((200, slots_answer(busy["now"])) if b"Bearer new-key" in head
                                else (401, refused))
    # The stream runs and its client leaves, so the slot is kept from then on (its answer
    # drained); the key is rotated; only then does the front cut the drain.
    c, n = stream_in_front(px, sim, front, max_tokens=100)
    c.close()
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 0,
               what="the client gone, its answer drained")
    with open(keyf, "w") as f:
        f.write("new-key\n")
    reload_with(px, lambda cfg: None)
    front.cut(n)
    busy["now"] = False
    poll_until(lambda: metric(px, "detproxy_slot_holds_total", end="engine_idle") == 1,
               timeout=10, what="the hold freed on the answer to the new key")
    assert complete(px).status == 200
    reload_with(px, lambda cfg: cfg["pools"][0].update(
        manifest={"determinism": {"mode": "single_sequence"}}))
    proxyutil.wait_all_admitted(px)  # a new manifest: the replica is checked again
    looks = front.slot_looks
    cut_in_front(px, sim, front, max_tokens=10)
    t_cut = time.monotonic()
    assert complete(px).status == 200
    assert time.monotonic() - t_cut >= 2.4, time.monotonic() - t_cut
    assert metric(px, "detproxy_slot_holds_total", end="time") == 1
    assert front.slot_looks == looks, (looks, front.slot_looks)
    assert sim_stats(sim)["max_inflight_seen"] == 1
    px.stop()
    front.stop()


def test_single_sequence_a_held_slot_does_not_ask_with_the_key_of_a_pool_that_took_its_name():
    """A reload gives the held request's pool name to a pool of another engine, with its own
    key, while the request runs; the request's engine goes on under another name. When the
    request is cut, the hold never asks the engine with the other engine's key: it asks
    through the pool that sends there now, with that pool's key (here the engine says busy
    throughout, so the hold runs its time)."""
    d = tempfile.mkdtemp(prefix="detproxy-det-rename-", dir=TMP)
    for name, key in (("key-a", "engine-a-key"), ("key-b", "engine-b-key")):
        with open(os.path.join(d, name), "w") as f:
            f.write(key + "\n")
    sim, front, px = llamacpp_behind_a_front(3.0, directory=d, api_key_file="key-a")
    heads = []
    front.slots = lambda head: heads.append(head) or (200, slots_answer(True))
    other = start_sim("--model", "other", "--flavor", "llamacpp")
    c, n = stream_in_front(px, sim, front, max_tokens=100)

    def rename(cfg):
        cfg["pools"][0]["name"] = "a"
        cfg["pools"].append(single_sequence_pool([other], framework="llamacpp",
                                                 api_key_file="key-b"))
        cfg["pools"][1]["models"] = ["other"]
        cfg["pools"][1]["manifest"]["model"] = "other"
    reload_with(px, rename)
    front.cut(n)
    c.settimeout(10)
    while c.recv(65536):
        pass
    c.close()
    t_cut = time.monotonic()
    proxyutil.wait_all_admitted(px)
    assert complete(px).status == 200
    assert time.monotonic() - t_cut >= 2.4, time.monotonic() - t_cut
    assert heads and all(b"Bearer engine-a-key" in h for h in heads), heads
    assert metric(px, "detproxy_slot_holds_total", end="time") == 1
    px.stop()
    front.stop()


def test_single_sequence_a_held_slot_asks_again_once_a_reload_brings_llamacpp_back():
    """A reload that takes llama.cpp from the pool stops the looks (no pool would say the
    engine is llama.cpp); one that brings it back, a bad edit reverted, starts them again, so
    the slot is freed when the engine is idle and not at the hold's 15 s."""
    sim, front, px = llamacpp_behind_a_front(15.0)
    busy = {"now": True}
    front.slots = lambda head: (200, slots_answer(busy["now"]))
    cut_in_front(px, sim, front, max_tokens=10)
    t_cut = time.monotonic()
    poll_until(lambda: front.slot_looks >= 1, what="the hold asking")
    manifest = {}

    def plain(cfg):
        manifest.update(cfg["pools"][0]["manifest"])
        cfg["pools"][0]["manifest"] = {"determinism": {"mode": "single_sequence"}}
    reload_with(px, plain)
    looks = front.slot_looks
    time.sleep(1.5)  # what is measured: no look while no pool names llama.cpp
    assert front.slot_looks <= looks + 1, (looks, front.slot_looks)  # one already due
    looks = front.slot_looks
    reload_with(px, lambda cfg: cfg["pools"][0].update(manifest=manifest))
    busy["now"] = False
    poll_until(lambda: metric(px, "detproxy_slot_holds_total", end="engine_idle") == 1,
               timeout=10, what="the hold freed once asked again")
    assert front.slot_looks >= looks + 2, (looks, front.slot_looks)
    assert time.monotonic() - t_cut < 12, time.monotonic() - t_cut
    px.stop()
    front.stop()


def test_single_sequence_holds_the_slot_of_an_abandoned_stream_in_a_session():
    """llama.cpp generates a stream in a session (its x-conversation-id header) on after the
    client leaves, for a later GET /v1/stream: the slot stays taken until its end, and a
    plain stream is kept the same way (llama.cpp stops one only once a write has failed)."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])])
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 60, "temperature": 0,
                       "stream": True}).encode()
    abandon(px.port, b"/v1/completions", body, sim, b"x-conversation-id: c1\r\n")
    r = complete(px, max_tokens=3)
    assert r.status == 200, r
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["requests"] == 2, st
    px.stop()


def test_single_sequence_gives_the_slot_back_from_an_abandoned_stream_that_never_ends():
    """A drained stream is read on, so an engine that streams on and on (llama.cpp with
    n_predict -1 stops only at the end of its context, and notices a closed connection only
    when a write fails, which a drain never lets happen) would keep the pool's one slot for
    good: a drain ends at its deadline, the longer of the upstream first-byte and idle
    timeouts after it began, though the stream never falls silent."""
    stop = threading.Event()

    def handle(c):
        if not proxyutil.serve_until_stream(c):
            return
        try:
            i = 0
            while not stop.is_set():
                ev = b'data: {"choices":[{"index":0,"text":"t%d"}]}\n\n' % i
                c.sendall(b"%x\r\n" % len(ev) + ev + b"\r\n")
                i += 1
                stop.wait(0.05)  # the replica's token rate, not a synchronisation
        except OSError:
            pass

    ls, p = proxyutil.serve_replica(handle)
    p["manifest"] = {"determinism": {"mode": "single_sequence"}}
    p["queue_timeout_ms"] = 15000
    px = start_proxy(pools=[p], limits={"upstream_idle_timeout_ms": 1000,
                                        "upstream_first_byte_timeout_ms": 1000})
    body = json.dumps({"model": "m1", "prompt": "x", "stream": True}).encode()
    a = socket.create_connection(("127.0.0.1", px.port))
    a.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    a.settimeout(10)
    assert a.recv(4096).startswith(b"HTTP/1.1 200"), "the stream began"
    reset(a)
    try:
        t0 = time.monotonic()
        r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "y"}, timeout=60)
        waited = time.monotonic() - t0
        assert r.status != 504, r
        assert 0.5 < waited < 10, waited  # the drain's second, not the queue's 15
    finally:
        stop.set()
        ls.close()
        px.stop()


def test_the_relay_refuses_what_a_single_sequence_pool_refuses():
    """The relay's one slot must not hold several sequences: a body asking for them (or that
    an engine could read so: duplicate keys) is refused as a client's would be; a body-less
    POST (llama.cpp's slot actions) is relayed."""
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[single_sequence_pool([sim])])
    hdrs = {"x-detproxy-relay-pool": "p", "x-detproxy-relay-replica": "r1",
            "content-type": "application/json"}
    for rest, param in (('"prompt":"x","n":3', "n"), ('"prompt":"x","n":-4294967293', "n"),
                        ('"prompt":["x","y"]', "prompt"), ('"prompt":"x","n":1,"n":3', None)):
        body = ('{"model":"%s",%s}' % (MODEL, rest)).encode()
        r = http("POST", px.admin_port, "/admin/relay/v1/completions", body=body, headers=hdrs)
        assert r.status == 400, (body, r)
        err = r.json()["error"]
        want = "policy_violation" if param else "duplicate_key"
        assert err["code"] == want and err["param"] == param, (body, err)
    assert sim_stats(sim)["requests"] == 0
    r = http("POST", px.admin_port, "/admin/relay/v1/completions",
             body={"model": MODEL, "prompt": "x", "max_tokens": 2, "n": 1}, headers=hdrs)
    assert r.status == 200, r
    # /v1/responses' input items are one conversation, not a batch of inputs
    items = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    r = http("POST", px.admin_port, "/admin/relay/v1/responses",
             body={"model": MODEL, "input": items, "max_output_tokens": 2}, headers=hdrs)
    assert r.status == 200, r
    r = http("POST", px.admin_port, "/admin/relay/slots/0?action=erase", body=b"",
             headers=hdrs)
    assert r.status != 400, r
    assert sim_stats(sim)["requests"] >= 1
    px.stop()


def test_pass_through_bodies_on_a_single_sequence_pool_hold_one_sequence():
    """A pass-through path (embeddings, rerank) is not policed, but its body may batch inputs
    that an engine runs as a sequence each, together: on a single_sequence pool such a batch is
    refused as the relay refuses it, whatever the body's size (read whole, not streamed past
    the check), and so is one an engine could read as such a batch that detproxy cannot read
    (a byte order mark, UTF-16, a Content-Encoding); one input is sent on, and so is a body no
    engine reads as JSON (an upload)."""
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[single_sequence_pool(
        [sim], passthrough=["POST /v1/embeddings", "POST /embedding", "POST /v1/rerank",
                            "POST /upload"])])
    json_type = {"content-type": "application/json"}
    before = len(client_requests(sim))
    long_text = "word " * 20000  # two of them: a body past the 64 KiB streamed through before
    batch = json.dumps({"model": MODEL, "input": ["a", "b"]})
    for target, body, hdrs, status, code, param in (
            ("/v1/embeddings", batch, json_type, 400, "policy_violation", "input"),
            ("/v1/embeddings", {"model": MODEL, "input": [long_text, long_text]}, json_type,
             400, "policy_violation", "input"),
            ("/embedding", {"content": [{"prompt_string": "a"}, {"prompt_string": "b"}]},
             json_type, 400, "policy_violation", "content"),
            ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a", "b", "c"]},
             json_type, 400, "policy_violation", "documents"),
            ("/v1/embeddings", b'{"input":"a","input":["a","b"]}', json_type, 400,
             "duplicate_key", None),
            # llama.cpp skips a UTF-8 BOM whatever the Content-Type; Python's json.loads
            # reads UTF-16 and UTF-32 under a JSON one
            ("/v1/embeddings", b"\xef\xbb\xbf" + batch.encode(), {"content-type": "text/plain"},
             400, "invalid_json", None),
            ("/v1/embeddings", batch.encode("utf-16-le"), json_type, 400, "invalid_json", None),
            ("/v1/embeddings", batch.encode("utf-16-be"), {"content-type": ""}, 400,
             "invalid_json", None),
            ("/v1/embeddings", batch.encode("utf-32-be"), {"content-type": "application/+json"},
             400, "invalid_json", None),
            ("/v1/embeddings", gzip.compress(batch.encode()),
             dict(json_type, **{"content-encoding": "gzip"}), 415,
             "unsupported_content_encoding", None)):
        r = http("POST", px.port, target, body=body, headers=hdrs)
        assert r.status == status, (target, body[:40], r)
        err = r.json()["error"]
        assert err["code"] == code and err["param"] == param, (target, err)
        if param:
            assert "single_sequence" in err["message"], err
    assert len(client_requests(sim)) == before, client_requests(sim)[before:]
    sent = [("/v1/embeddings", {"model": MODEL, "input": ["a"]}, json_type),
            ("/v1/embeddings", {"model": MODEL, "input": [1, 2, 3]}, json_type),
            ("/v1/rerank", {"model": MODEL, "query": "q", "documents": ["a"]}, json_type),
            ("/upload", b"--b\r\ncontent-disposition: form-data; name=\"f\"\r\n\r\nx\r\n--b--",
             {"content-type": "multipart/form-data; boundary=b"}),
            ("/upload", b"\x00\x00\x01\x00 raw samples", {"content-type": "audio/L16"})]
    for target, body, hdrs in sent:
        r = http("POST", px.port, target, body=body, headers=hdrs)
        assert r.status not in (400, 415), (target, r)
    got = [q["target"] for q in client_requests(sim)[before:]]
    assert got == [t for t, _, _ in sent], got
    px.stop()


def test_single_sequence_on_vllm_closes_an_abandoned_exchange():
    """vLLM cancels a request whose connection closes (the sim without --finish-abandoned does
    too): reading its answer to the end would make it generate for no one while the pool's one
    slot waits. The exchange is closed, the engine stops, the next request goes at once."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50")
    px = start_proxy(pools=[single_sequence_pool([sim], framework="vllm")])
    body = json.dumps({"model": MODEL, "prompt": "long running request", "max_tokens": 200,
                       "temperature": 0}).encode()
    abandon(px.port, b"/v1/completions", body, sim)
    poll_until(lambda: sim_stats(sim)["aborted"] == 1, timeout=3, what="the engine stopped")
    assert replicas(px)["r1"]["inflight"] == 0
    assert complete(px, max_tokens=3).status == 200
    assert sim_stats(sim)["max_inflight_seen"] == 1
    px.stop()


def test_single_sequence_holds_the_slot_while_an_abandoned_relayed_answer_is_generated():
    """The admin relay (replay, diagnose) takes the replica's slot like a client: when its
    caller goes away mid-generation, the slot stays taken until the replica's answer has come,
    and a shutdown meanwhile waits for that answer before the process goes (docs/operations.md,
    "Draining"): once gone it counts nothing on the engine."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "20", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])])
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 60,
                       "temperature": 0}).encode()
    def relay_and_leave(body):
        abandon(px.admin_port, b"/admin/relay/v1/completions", body, sim, RELAY_R1)
    relay_and_leave(body)
    # Sent at once: whether the admin listener has seen the reset yet or not, the slot is the
    # relayed generation's until its answer has come.
    r = complete(px, max_tokens=3)
    assert r.status == 200, r
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert replicas(px)["r1"]["inflight"] == 0
    # A shutdown while an abandoned relayed answer is still generated: the process stays until
    # the engine has finished it (2 s: sampled with a seed, it runs all 100 tokens).
    relay_and_leave(json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 100,
                                "temperature": 1, "seed": 1}).encode())
    px.stop()
    assert [l["single_sequence_running"] for l in px.find_logs("drained")] == [1]
    st = sim_stats(sim)
    assert st["inflight"] == 0 and st["completed"] == st["requests"], st


RELAY_R1 = b"x-detproxy-relay-pool: p\r\nx-detproxy-relay-replica: r1\r\n"
# "x" runs 42 tokens before the toy model's end of text.
LONG = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 60, "temperature": 0}).encode()


def rename_pool(c):
    c["pools"][0]["name"] = "p2"


def test_single_sequence_keeps_the_slot_of_a_relay_whose_pool_a_reload_renamed():
    """A reload renames the pool (the same engine) while a relayed request generates, then its
    caller leaves: the engine still finishes it, and the renamed pool's requests wait for that,
    as the pool the request was sent under said."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])])
    a = generating(px.admin_port, b"/admin/relay/v1/completions", LONG, sim, RELAY_R1)
    reload_with(px, rename_pool)
    poll_until(lambda: state(px, "r1") == "admitted", what="the renamed pool's r1 admitted")
    reset(a)
    r = complete(px, max_tokens=3)
    assert r.status == 200, r
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    px.stop()


def test_single_sequence_keeps_the_slot_of_a_relay_abandoned_during_a_graceful_shutdown():
    """SIGTERM: requests in flight and queued are still served while the proxy drains. A relayed
    request whose caller leaves then is drained like any other: the queued client request is
    sent once the engine has finished it."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])])
    a = generating(px.admin_port, b"/admin/relay/v1/completions", LONG, sim, RELAY_R1)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=complete(px, max_tokens=3)))
    t.start()
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 1,
               what="a client request queued behind the relay")
    px.send_signal(signal.SIGTERM)
    px.wait_log("draining")
    reset(a)
    t.join(30)
    assert px.wait(timeout=30) == 0
    px.check_sanitizer()
    assert out["r"].status == 200, out
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st


def test_a_graceful_stop_waits_for_a_relay_on_the_engine_and_not_for_one_that_waits():
    """SIGTERM while a relay generates and another relay waits for the slot it claimed: the stop
    waits for the one generating (the engine would go on after the process), not for the
    waiting one, which is not started once the first is done."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "50", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])])
    relay_body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 40,
                             "temperature": 0}).encode()
    out = {}

    def relay(key):
        try:
            out[key] = http("POST", px.admin_port, "/admin/relay/v1/completions", body=relay_body,
                            headers={"content-type": "application/json",
                                     "x-detproxy-relay-pool": "p",
                                     "x-detproxy-relay-replica": "r1"}, timeout=40).status
        except OSError:
            out[key] = "closed"
    first = threading.Thread(target=relay, args=("first",))
    first.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the first relay generating")
    second = threading.Thread(target=relay, args=("second",))
    second.start()
    poll_until(lambda: replicas(px)["r1"]["relays_holding"] == 1,
               what="the second relay claiming the next slot")
    t0 = time.monotonic()
    px.send_signal(signal.SIGTERM)
    assert px.wait(timeout=40) == 0
    took = time.monotonic() - t0
    first.join(10)
    second.join(10)
    px.check_sanitizer()
    st = sim_stats(sim)
    assert out["first"] == 200 and st["inflight"] == 0 and st["requests"] == 1, (out, st)
    assert took < 15, took  # the first relay's 2 s, not the drain's 30 s limit
    print("stopped %.1f s after SIGTERM, once the generating relay was done" % took)


def test_single_sequence_holds_the_slot_past_a_first_byte_timeout():
    """A request that times out upstream gets its 504 at upstream_first_byte_timeout_ms, but
    the engine may still be generating it (llama.cpp's server finishes it): the slot stays
    taken, the answer read and dropped, for up to the longer of another first-byte timeout and
    the idle timeout (60 s here: a first-byte timeout shorter than a generation does not cut
    that wait short too)."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])],
                     limits={"upstream_first_byte_timeout_ms": 500})
    # "x" runs 42 tokens before the toy model's end of text: 2.5 s, five timeouts.
    first = complete(px, prompt="x", max_tokens=60)
    assert first.status == 504, first
    assert sim_stats(sim)["inflight"] == 1, sim_stats(sim)  # still generating
    r = complete(px, max_tokens=3)
    assert r.status == 200, r
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert metric(px, "detproxy_inflight_requests") == 0
    px.stop()


def test_single_sequence_holds_the_slot_of_a_request_abandoned_before_its_first_byte():
    """A client that leaves before any answer began: its exchange is drained from then on, and
    the first-byte timeout that comes later keeps the drain (and the slot) for longer still,
    as for a request that was still the client's when it passed."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])],
                     limits={"upstream_first_byte_timeout_ms": 500})
    # "x" runs 42 tokens before the toy model's end of text: 2.5 s, five timeouts.
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 60,
                       "temperature": 0}).encode()
    abandon(px.port, b"/v1/completions", body, sim)
    # Sent at once, it waits for the slot until the abandoned answer has come.
    r = complete(px, max_tokens=3)
    assert r.status == 200, r
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert st["requests"] == 2, st
    px.stop()


def test_single_sequence_holds_the_slot_of_a_relayed_request_past_a_first_byte_timeout():
    """The admin relay's request that times out upstream: its caller gets the error at once,
    the slot stays taken until the engine's answer has come."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60", "--finish-abandoned")
    px = start_proxy(pools=[single_sequence_pool([sim])],
                     limits={"upstream_first_byte_timeout_ms": 500})
    # "x" runs 42 tokens before the toy model's end of text: 2.5 s, five timeouts.
    r = http("POST", px.admin_port, "/admin/relay/v1/completions",
             body=json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 60,
                              "temperature": 0}),
             headers={"content-type": "application/json", "x-detproxy-relay-pool": "p",
                      "x-detproxy-relay-replica": "r1"})
    assert r.status == 502 and "first_byte_timeout" in r.text, r
    assert sim_stats(sim)["inflight"] == 1, sim_stats(sim)  # still generating
    assert complete(px, max_tokens=3).status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert replicas(px)["r1"]["inflight"] == 0
    px.stop()


def test_single_sequence_holds_across_a_reload_that_changes_the_manifest():
    """A reload that changes a pool's manifest makes new replica objects (they must attest
    the new manifest), while the old ones' requests still run on the same engines. The slots
    are the engine's: a request or check of the new object waits for the old one's request."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60")
    px = start_proxy(pools=[single_sequence_pool([sim], framework="vllm")],
                     attestation=fast_attestation(100))
    first = {}
    # "x" runs 42 tokens before the toy model's end of text: 2.5 s.
    t = threading.Thread(target=lambda: first.update(r=complete(px, prompt="x", max_tokens=60)))
    t.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the first generation running")
    with open(px.config_path) as f:
        live = json.load(f)
    live["pools"][0]["manifest"]["framework"]["version"] = "0.6.3"  # the sim's: admitted
    with open(px.config_path, "w") as f:
        json.dump(live, f)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 200, r.body
    # The new object's check (a probe completion) and then a client request, while the old
    # object's generation may still run.
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 re-admitted")
    second = complete(px, max_tokens=3)
    t.join(10)
    assert first["r"].status == 200 and second.status == 200, (first, second)
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    assert st["requests"] >= 2, st
    px.stop()


def test_single_sequence_waits_for_what_the_pools_earlier_mode_still_runs():
    """A reload that makes a pool single_sequence: the request the pool's earlier mode still
    runs on the engine, and the one its earlier generation still queues, count, so the new
    mode's requests never run beside them."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60")
    px = start_proxy(pools=[pool("p", [MODEL], [sim], max_inflight_per_replica=1,
                                 manifest={"model": MODEL, "framework": {"name": "vllm"}})],
                     attestation=fast_attestation(100))
    out = {}

    def send(key, **body):
        out[key] = complete(px, **body)
    # "x" runs 42 tokens before the toy model's end of text: 2.5 s; "y" queues behind it.
    first = threading.Thread(target=send, args=("first",), kwargs={"prompt": "x", "max_tokens": 60})
    first.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the first generation running")
    queued = threading.Thread(target=send, args=("queued",), kwargs={"max_tokens": 3})
    queued.start()
    poll_until(lambda: metric(px, "detproxy_inflight_requests") == 2, what="one request queued")
    reload_with(px, lambda c: c["pools"][0]["manifest"].update(
        determinism={"mode": "single_sequence"}))
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 admitted again")
    out["third"] = complete(px, max_tokens=3)
    first.join(10)
    queued.join(10)
    assert [out[k].status for k in ("first", "queued", "third")] == [200] * 3, out
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    px.stop()


def to_single_sequence(live):
    live["pools"][0].setdefault("manifest", {})["determinism"] = {"mode": "single_sequence"}


def test_single_sequence_drains_what_the_earlier_mode_sent_when_its_client_leaves():
    """A request the pool's earlier mode sent is drained, not cut, when its client leaves after
    a reload made the pool single_sequence: an engine that finishes an abandoned answer
    (llama.cpp) is generating it still, and the next request waits for it."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60", "--finish-abandoned")
    px = start_proxy(pools=[pool("p", [MODEL], [sim])], attestation=fast_attestation(100))
    a = generating(px.port, b"/v1/completions", LONG, sim)
    reload_with(px, to_single_sequence)
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 admitted again")
    reset(a)
    r = complete(px, max_tokens=3)
    assert r.status == 200, r
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["completed"] == 2, st
    px.stop()


def test_single_sequence_passes_no_held_slot_to_a_relay_while_the_earlier_mode_runs_another():
    """A relayed POST holding the next slot freed on a replica (it waited for a spare one) gets
    it only when nothing else runs on the engine, once a reload made the pool single_sequence
    while its earlier mode ran two requests there."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "60")
    px = start_proxy(pools=[pool("p", [MODEL], [sim], max_inflight_per_replica=2)],
                     attestation=fast_attestation(100))
    out = {}

    def send(key, **body):
        out[key] = complete(px, **body)
    # "x" runs 42 tokens (2.5 s) before the toy model's end of text, 15 of them ~0.9 s.
    long = threading.Thread(target=send, args=("long",), kwargs={"prompt": "x", "max_tokens": 60})
    long.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the long request running")
    short = threading.Thread(target=send, args=("short",),
                             kwargs={"prompt": "x", "max_tokens": 15})
    short.start()
    poll_until(lambda: sim_stats(sim)["inflight"] == 2, what="the short request running")
    # Both run on past the relay and the reload however slow the box: 300 ms a token until
    # then, as before after.
    sim_config(sim, token_delay_ms=300)

    def relay():
        out["relay"] = http("POST", px.admin_port, "/admin/relay/v1/completions",
                            body=json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 3,
                                             "temperature": 0}),
                            headers={"content-type": "application/json",
                                     "x-detproxy-relay-pool": "p",
                                     "x-detproxy-relay-replica": "r1"})
    relayed = threading.Thread(target=relay)
    relayed.start()
    poll_until(lambda: replicas(px)["r1"]["relays_holding"] == 1, what="the relay holding a slot")
    reload_with(px, to_single_sequence)
    assert sim_stats(sim)["completed"] == 0, "the reload came too late to test anything"
    sim_config(sim, token_delay_ms=60)
    short.join(10)
    assert out["short"].status == 200, out
    sim_reset(sim)  # from here on only "long" runs until it ends
    relayed.join(10)
    long.join(10)
    assert out["relay"].status == 200 and out["long"].status == 200, out
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["completed"] == 2, st
    px.stop()


def test_single_sequence_drains_the_canary_of_a_replica_object_the_mode_change_replaced():
    """A reload that makes a pool single_sequence replaces its replica objects (the mode is part
    of what they attested). A canary the old object's check was running is drained, holding
    the engine, as llama.cpp generates it on after its connection closes."""
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                    "b11669-Debian", "--token-delay-ms", "80", "--finish-abandoned")
    r = post_json(sim.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 60,
                                                "temperature": 0, "seed": 0})
    can = {"prompt": "x", "max_tokens": 60,
           "expected_sha256": hashlib.sha256(r.json()["choices"][0]["text"].encode()).hexdigest()}
    sim_reset(sim)
    p = pool("p", [MODEL], [sim], manifest={"model": MODEL, "framework": {"name": "llamacpp"},
                                            "canary": can})
    p["replicas"][0]["attest"] = {"source": "llamacpp"}
    px = start_proxy(pools=[p], attestation=fast_attestation(100), timeout=20)
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 admitted")
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, timeout=10, what="a canary running")
    done = sim_stats(sim)["completed"]
    reload_with(px, to_single_sequence)
    poll_until(lambda: sim_stats(sim)["completed"] >= done + 2, timeout=15,
               what="the old object's canary and a check of the new one done")
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    px.stop()


def rename_replica(c):
    c["pools"][0]["replicas"][0]["name"] = "r9"


def test_a_graceful_stop_ends_the_checks_of_a_replica_a_reload_replaced():
    """A relay waits for the engine's slot (a drained answer holds it) on a replica a reload
    then replaced: the old object lives on for the relay and is still checked, its check asking
    for the slot every 10 ms. SIGTERM ends its checks with every other replica's; before, a
    check whose timer fired after the stop read the freed attestation context (SIGSEGV in 1
    stop of 3 to 10): six stops here."""
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                    "b11669-Debian", "--token-delay-ms", "30", "--finish-abandoned")
    for _ in range(6):
        p = single_sequence_pool([sim], framework="llamacpp")
        p["replicas"][0]["attest"] = {"source": "llamacpp"}
        att = dict(fast_attestation(100), timeout_ms=60000)
        px = start_proxy(pools=[p], attestation=att, timeout=20)
        abandon(px.port, b"/v1/completions", LONG, sim)  # drained: llama.cpp finishes it
        rel = socket.create_connection(("127.0.0.1", px.admin_port))
        rel.sendall(b"POST /admin/relay/v1/completions HTTP/1.1\r\nHost: x\r\n%s"
                    b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                    % (RELAY_R1, len(LONG)) + LONG)
        poll_until(lambda: replicas(px)["r1"]["relays_holding"] == 1,
                   what="the relay holding the next slot")
        reload_with(px, rename_replica)
        px.send_signal(signal.SIGTERM)
        assert px.wait(timeout=30) == 0, px.lines[-5:]
        px.check_sanitizer()
        rel.close()
        poll_until(lambda: sim_stats(sim)["inflight"] == 0, timeout=20, what="the engine idle")
    assert sim_stats(sim)["max_inflight_seen"] == 1


def canary_running(token_delay_ms):
    """A single_sequence llama.cpp pool with a long canary (42 tokens), once its canary runs:
    the only traffic, no client sends anything. Returns (sim, proxy)."""
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                    "b11669-Debian", "--token-delay-ms", token_delay_ms, "--finish-abandoned")
    r = post_json(sim.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 60,
                                                "temperature": 0, "seed": 0})
    can = {"prompt": "x", "max_tokens": 60,
           "expected_sha256": hashlib.sha256(r.json()["choices"][0]["text"].encode()).hexdigest()}
    sim_reset(sim)
    p = single_sequence_pool([sim], framework="llamacpp")
    p["manifest"]["canary"] = can
    p["replicas"][0]["attest"] = {"source": "llamacpp"}
    px = start_proxy(pools=[p], attestation=fast_attestation(100), timeout=20)
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 admitted")
    # The long canary itself, not a one-token request of the checks: in flight across two
    # polls, the same request (none completed between), at least two tokens further on.
    last = {}

    def long_one_running():
        st = sim_stats(sim)
        prev, last["st"] = last.get("st"), st
        return (prev is not None and st["inflight"] == 1 and prev["inflight"] == 1 and
                st["completed"] == prev["completed"] and
                st["tokens_generated"] >= prev["tokens_generated"] + 2)

    poll_until(long_one_running, timeout=15, interval=2.5 * int(token_delay_ms) / 1000,
               what="a canary running")
    return sim, px


def reload_with(px, change):
    with open(px.config_path) as f:
        live = json.load(f)
    change(live)
    with open(px.config_path, "w") as f:
        json.dump(live, f)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 200, r.body


def test_single_sequence_keeps_the_slot_of_a_canary_whose_replica_left_and_came_back():
    """A reload that points the replica elsewhere orphans its running canary; a second one
    that brings the engine back makes a new replica object while that canary still generates.
    The engine's slots outlive every replica object that shared them while a request of theirs
    is read: the new object's checks wait for the orphaned canary."""
    # 42 tokens of 150 ms: 6.3 s for the two reloads to happen in, even on a loaded machine
    # under ASan (3.4 s was once too short).
    sim, px = canary_running("150")
    other = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                      "b11669-Debian")
    url = "http://127.0.0.1:%d" % sim.port
    done = sim_stats(sim)["completed"]
    reload_with(px, lambda c: c["pools"][0]["replicas"][0].update(
        url="http://127.0.0.1:%d" % other.port))
    reload_with(px, lambda c: c["pools"][0]["replicas"][0].update(url=url))
    assert sim_stats(sim)["completed"] == done, "the canary ended before the reloads"
    # The new object's check waits out the orphaned canary (up to 6.3 s) and then runs its own.
    poll_until(lambda: state(px, "r1") == "admitted", timeout=30, what="r1 back and admitted")
    poll_until(lambda: sim_stats(sim)["completed"] >= done + 2, timeout=30,
               what="the orphaned canary and a new check done")
    assert complete(px, max_tokens=3).status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["aborted"] == 0, st
    px.stop()


def test_single_sequence_keeps_the_slot_of_a_canary_whose_pool_a_reload_renamed():
    """A reload that renames the pool (the same engine, the same manifest) replaces the replica
    object while its canary generates: the canary is read to its end before the engine's slot,
    which the renamed pool's replica shares, is free again."""
    sim, px = canary_running("80")
    done = sim_stats(sim)["completed"]
    reload_with(px, rename_pool)
    poll_until(lambda: sim_stats(sim)["completed"] >= done + 2, timeout=15,
               what="the old canary and a check of the renamed pool's replica done")
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["aborted"] == 0, st
    px.stop()


def test_single_sequence_keeps_the_slot_of_a_canary_whose_replica_a_reload_replaced():
    """A reload that changes the manifest's identity replaces the replica object while its
    canary may be generating. The engine (llama.cpp, the sim's --finish-abandoned) finishes that
    non-streamed answer whatever happens to the connection: the slot stays taken until it has
    come, so the new object's probe and canary do not run beside it."""
    sim, px = canary_running("20")
    done = sim_stats(sim)["completed"]
    reload_with(px, new_identity)
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 re-admitted")
    # The old canary's answer and one of the new object's checks have come.
    poll_until(lambda: sim_stats(sim)["completed"] >= done + 2, timeout=10,
               what="the old canary and a new check done")
    assert sim_stats(sim)["max_inflight_seen"] == 1, sim_stats(sim)
    # The slot came back: a client is served (after the canary running now, if any).
    assert complete(px, max_tokens=3).status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["aborted"] == 0, st
    px.stop()


def own_checks_time_out(canary):
    """A single_sequence llama.cpp pool whose engine turns slow once admitted: every check's
    request to it (the 1-token probe completion, or the canary) outlasts its first-byte timeout
    while the engine goes on generating it (the sim's --finish-abandoned, as llama.cpp's
    server). A few such checks run, then the engine is fast again and a client is served: one
    sequence at a time throughout."""
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                    "b11669-Debian", "--finish-abandoned")
    p = single_sequence_pool([sim], framework="llamacpp")
    p["replicas"][0]["attest"] = {"source": "llamacpp"}
    limits = None
    if canary:
        r = post_json(sim.port, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                    "max_tokens": 4, "temperature": 0, "seed": 0})
        p["manifest"]["canary"] = {"prompt": "x", "max_tokens": 4, "expected_sha256": hashlib.sha256(
            r.json()["choices"][0]["text"].encode()).hexdigest()}
        # The canary takes the replica's own upstream: the client timeouts.
        limits = {"upstream_first_byte_timeout_ms": 300}
    att = {"interval_ms": 100, "timeout_ms": 300, "require_signature": False}
    px = start_proxy(pools=[p], attestation=att, limits=limits)
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 admitted")
    sim_reset(sim)
    # Now the probe completion (1 token) takes 700 ms against a 300 ms timeout; or the probe
    # is in time (200 ms) and the canary (4 tokens) is not (800 ms).
    sim_config(sim, token_delay_ms=200 if canary else 700)
    poll_until(lambda: sim_stats(sim)["requests"] >= 3, timeout=15, what="three slow checks")
    # The engine is fast again: the slots came back, the replica is admitted and serves.
    sim_config(sim, token_delay_ms=0)
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 admitted again")
    assert complete(px, max_tokens=3).status == 200
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    px.stop()


def test_single_sequence_holds_the_slot_of_a_probe_completion_that_timed_out():
    """The check's 1-token probe completion that gets no answer within attestation.timeout_ms
    fails the check at once, but the engine may still be generating it: its slot stays taken
    until the answer has come, so the next check's probe does not run beside it."""
    own_checks_time_out(canary=False)


def test_single_sequence_holds_the_slot_of_a_canary_that_timed_out():
    """The same for a canary that outlasts the replica's first-byte timeout."""
    own_checks_time_out(canary=True)


def test_single_sequence_pools_sharing_an_engine_share_its_slot():
    """Two single_sequence pools may name the same engine: they share its one slot, so a
    request through one never runs beside a request through the other. Also when they spell
    it two ways (localhost and 127.0.0.1 reach one engine)."""
    sim = start_sim("--model", MODEL, "--token-delay-ms", "20")
    pools = [single_sequence_pool([sim]), single_sequence_pool([sim])]
    pools[1]["name"] = "q"
    pools[1]["replicas"][0]["name"] = "q1"
    pools[1]["replicas"][0]["url"] = "http://LocalHost:%d" % sim.port
    policy = {"tenants": [
        {"name": "other", "match": {"header": {"name": "x-tenant", "value": "other"}},
         "pool": "q"},
        {"name": "default", "match": {"any": True}, "pool": "p"}]}
    px = start_proxy(pools=pools, policy=policy)
    out = []

    def send(headers):
        out.append(complete(px, headers=headers, max_tokens=5))
    ts = [threading.Thread(target=send, args=(h,))
          for h in ({"x-tenant": "other"}, None) * 4]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sorted(r.headers["x-detproxy-replica"] for r in out) == ["q1"] * 4 + ["r1"] * 4, out
    assert all(r.status == 200 for r in out), out
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1 and st["requests"] >= 8, st
    px.stop()


def slow_canary(timeout_ms, limits, token_delay_ms):
    """A single_sequence llama.cpp pool (attestation.timeout_ms timeout_ms, limits as given)
    whose engine, once admitted, takes token_delay_ms a token: returned (sim, proxy) once a
    check's 40-token canary generates, the sim's counts reset before it."""
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                    "b11669-Debian", "--finish-abandoned")
    r = post_json(sim.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 40,
                                                "temperature": 0, "seed": 0})
    p = single_sequence_pool([sim], framework="llamacpp")
    p["manifest"]["canary"] = {"prompt": "x", "max_tokens": 40, "expected_sha256": hashlib.sha256(
        r.json()["choices"][0]["text"].encode()).hexdigest()}
    p["replicas"][0]["attest"] = {"source": "llamacpp"}
    att = {"interval_ms": 100, "timeout_ms": timeout_ms, "require_signature": False}
    px = start_proxy(pools=[p], attestation=att, limits=limits)
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 admitted")
    sim_config(sim, token_delay_ms=token_delay_ms)
    sim_reset(sim)
    px.mark = len(px.logs)
    poll_until(lambda: sim_stats(sim)["inflight"] == 1 and last_body(sim)["max_tokens"] == 40,
               timeout=10, what="a canary generating")
    return sim, px


def test_single_sequence_keeps_the_slot_of_a_timed_out_canary_across_a_removal_and_return():
    """A canary past its first-byte timeout holds the engine's slot while its answer is read on;
    a reload that removes the replica and another that brings it back (its object freed, a new
    one made) meanwhile must find that slot still taken: the new object's checks wait for it."""
    # The canary (40 tokens) takes 2 s against a 300 ms first-byte timeout.
    sim, px = slow_canary(300, {"upstream_first_byte_timeout_ms": 300}, 50)
    # Past its first-byte timeout: the check has failed, the answer is read on holding the slot.
    px.wait_log(lambda l: l.get("msg") == "canary_failed" and "first_byte_timeout" in
                l.get("detail", ""), start=px.mark)
    kept = {}

    def remove(c):
        kept.update(c["pools"][0]["replicas"][0])
        c["pools"][0]["replicas"] = [{"name": "r9", "url": "http://127.0.0.1:9"}]
    reload_with(px, remove)
    reload_with(px, lambda c: c["pools"][0].update(replicas=[kept]))
    # The new r1's probe and canary come after the old canary's answer.
    poll_until(lambda: sim_stats(sim)["completed"] >= 2, timeout=10, what="a check after it")
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    px.stop()


def new_identity(c):
    c["pools"][0]["manifest"]["framework"]["version"] = "b11669-Debian"


def test_single_sequence_keeps_the_slot_of_a_replaced_replica_canary_past_its_timeout():
    """A canary whose replica object a reload replaced is read on, holding the slot; when it
    then outlasts its first-byte timeout the engine may still be generating it: the slot stays
    taken until the answer has come, as for any request of ours that times out."""
    sim, px = slow_canary(300, {"upstream_first_byte_timeout_ms": 800}, 50)
    reload_with(px, new_identity)
    # The old canary times out at 800 ms and ends at 2 s; the new object's checks wait for it.
    poll_until(lambda: sim_stats(sim)["completed"] >= 2, timeout=10, what="a check after it")
    st = sim_stats(sim)
    assert st["max_inflight_seen"] == 1, st
    px.stop()


def test_single_sequence_gives_back_the_slot_of_a_replaced_replica_canary_never_answered():
    """The same canary when the engine never answers: the slot comes back once the drain's
    bound (the longer of the first-byte and idle timeouts) has passed too; the pool never
    sticks."""
    # The probe (1 token) is in time; the canary (40 tokens, 10 s) is never answered here.
    sim, px = slow_canary(400, {"upstream_first_byte_timeout_ms": 500,
                                "upstream_idle_timeout_ms": 300}, 250)
    sent = sim_stats(sim)["requests"]
    reload_with(px, new_identity)
    assert replicas(px)["r1"]["inflight"] == 1  # the old canary's, read on
    # Past its first-byte timeout and the 500 ms drain after it, the slot is back: the new
    # object's check reaches the engine while it still generates the old canary (the bound an
    # engine that never answers gets, docs/configuration.md).
    poll_until(lambda: sim_stats(sim)["requests"] > sent, timeout=10,
               what="a check sent after the drain's bound")
    assert sim_stats(sim)["max_inflight_seen"] == 2, sim_stats(sim)
    sim_config(sim, token_delay_ms=0)
    poll_until(lambda: state(px, "r1") == "admitted", timeout=10, what="r1 re-admitted")
    assert complete(px, max_tokens=3).status == 200
    px.stop()


def test_single_sequence_llamacpp_forwards_cache_prompt_false():
    sim = start_sim("--model", MODEL, "--flavor", "llamacpp")
    # A long re-attestation interval: the 1-token probe must not become the last request.
    quiet = {"interval_ms": 600000, "timeout_ms": 2000, "require_signature": False}
    px = start_proxy(pools=[single_sequence_pool([sim], framework="llamacpp")], attestation=quiet)
    for body in ({"cache_prompt": True}, {}, {"cache_prompt": False}, {"cache_prompt": "yes"}):
        r = complete(px, **body)
        assert r.status == 200, r
        assert last_body(sim)["cache_prompt"] is False, last_body(sim)
    assert metric(px, "detproxy_policy_overrides_total", param="cache_prompt",
                  action="normalized") == 3
    px.stop()
    # Other frameworks never get the llama.cpp key; nor does llama.cpp outside single_sequence.
    vsim = start_sim("--model", MODEL)
    px = start_proxy(pools=[single_sequence_pool([vsim], framework="vllm")], attestation=quiet)
    assert complete(px).status == 200
    assert "cache_prompt" not in last_body(vsim)
    px.stop()
    lsim = start_sim("--model", MODEL, "--flavor", "llamacpp")
    px = start_proxy(pools=[pool("p", [MODEL], [lsim],
                                 manifest={"model": MODEL, "framework": {"name": "llamacpp"}})],
                     attestation=quiet)
    assert complete(px, cache_prompt=True).status == 200
    assert last_body(lsim)["cache_prompt"] is True
    px.stop()


# ---- require_determinism --------------------------------------------------------------------

STRICT = {"x-tenant": "strict", "content-type": "application/json"}


def routing_setup():
    fast = start_sim("--model", MODEL)
    det = start_sim("--model", MODEL, "--flavor", "sglang")
    sim_config(det, deterministic_inference=True)
    other = start_sim("--model", "other")
    pools = [pool("fast", [MODEL], [fast]),
             pool("det", [MODEL], [det], manifest=det_manifest("sglang")),
             pool("misc", ["other"], [other])]
    pools[1]["replicas"][0]["name"] = "d1"
    pools[2]["replicas"][0]["name"] = "o1"
    policy = {"tenants": [
        {"name": "strict", "match": {"header": {"name": "x-tenant", "value": "strict"}},
         "require_determinism": "batch_invariant"},
        {"name": "default", "match": {"any": True}}]}
    px = start_proxy(pools=pools, policy=policy, attestation=fast_attestation())
    return fast, det, px


def test_require_determinism_routes_only_to_pools_with_that_mode():
    fast, det, px = routing_setup()
    for _ in range(5):
        r = complete(px, headers=STRICT)
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "d1", r
        r = complete(px)
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "r1", r
    # A model no batch_invariant pool serves: 404, naming the requirement.
    r = post_json(px.port, "/v1/completions", {"model": "other", "prompt": "x"}, headers=STRICT)
    assert r.status == 404, r
    err = r.json()["error"]
    assert err["code"] == "determinism_unavailable" and err["param"] == "model", err
    assert "requires determinism batch_invariant" in err["message"], err
    assert post_json(px.port, "/v1/completions", {"model": "other", "prompt": "x"}).status == 200
    # The deterministic pool loses its replica: 503 naming why; other tenants keep being served.
    sim_config(det, deterministic_inference=False)
    poll_until(lambda: state(px, "d1") == "rejected", what="d1 rejected")
    r = complete(px, headers=STRICT)
    assert r.status == 503, r
    err = r.json()["error"]
    assert err["code"] == "no_attested_replica", err
    assert ("no attested replica is available in pool det, whose determinism.mode "
            "\"batch_invariant\" this tenant requires") in err["message"], err
    assert complete(px).status == 200
    px.stop()


def test_config_errors_name_their_json_path():
    sim = start_sim("--model", MODEL)

    def check(pools, policy=None):
        cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0", "pools": pools}
        if policy:
            cfg["policy"] = policy
        return run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg)])

    for det, want in (({"mode": "fast"}, "pools[0].manifest.determinism.mode: must be one of "
                                         "batch_invariant, single_sequence"),
                      ({}, "pools[0].manifest.determinism.mode: required"),
                      ({"mode": "single_sequence", "x": 1}, "pools[0].manifest.determinism.x"),
                      ("single_sequence", "pools[0].manifest.determinism: expected an object")):
        rc, out, err = check([pool("p", [MODEL], [sim], manifest={"determinism": det})])
        assert rc == 1 and want in err, (det, rc, err)
    plain = [pool("p", [MODEL], [sim])]
    rc, out, err = check(plain, {"tenants": [{"name": "t", "match": {"any": True},
                                              "require_determinism": "batch_invariant"}]})
    assert rc == 1 and ("policy.tenants[0].require_determinism: \"batch_invariant\", but no "
                        "pool's manifest has determinism.mode \"batch_invariant\"") in err, err
    rc, out, err = check(plain, {"tenants": [{"name": "t", "match": {"any": True}, "pool": "p",
                                              "require_determinism": "single_sequence"}]})
    assert rc == 1 and ("policy.tenants[0].require_determinism: \"single_sequence\", but its "
                        "pool \"p\" has determinism.mode \"none\"") in err, err
    rc, out, err = check(plain, {"tenants": [{"name": "t", "match": {"any": True},
                                              "require_determinism": "always"}]})
    assert rc == 1 and "policy.tenants[0].require_determinism: must be one of" in err, err
    # An engine of a single_sequence pool that a pool of another mode sends to as well.
    shared = [pool("fast", [MODEL], [sim]), single_sequence_pool([sim])]
    rc, out, err = check(shared)
    assert rc == 1 and ("pools[1].replicas[0].url: same engine as pools[0].replicas[0]: pool \"p\" "
                        "is single_sequence (one request at a time per engine) and pool \"fast\" "
                        "is not") in err, err
    rc, out, err = check(shared[::-1])
    assert rc == 1 and "pools[1].replicas[0].url: same engine as pools[0].replicas[0]" in err, err
    shared[0]["replicas"][0]["url"] = "http://localhost:%d/" % sim.port  # one engine all the same
    rc, out, err = check(shared)
    assert rc == 1 and "pools[1].replicas[0].url: same engine as pools[0].replicas[0]" in err, err


if __name__ == "__main__":
    run_tests(globals())
