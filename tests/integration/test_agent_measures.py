"""The agent measures; it does not repeat (docs/attestation.md §4, "What the agent measures").

With --framework-url the agent signs what the engine reports (llama.cpp /props model_ftype and
model_path) and the SHA-256 of the model file the engine loaded, not its own flags: a flag the
engine contradicts is listed, and the proxy rejects the replica with a reason naming both values.
Against detproxy-sim's llamacpp flavor (a quantization swapped at runtime through /_sim/config)
and against a small fake llama-server written here that really opens and maps a GGUF file, so
that the path, the hash, the process check and a restart on the same port are exercised.

Also: `detproxy attest hash FILE` is `sha256sum FILE`, and `detproxy check` warns about a pool
whose agents may only repeat their flags and that has no canary."""

import base64
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from harness import (DETPROXY_BIN, SLOW, free_port, get_json, http, poll_until, run_cmd,
                     run_tests, start_process, start_sim)
from proxyutil import pool, sim_config, sim_requests, start_proxy, write_config

TMP = tempfile.mkdtemp(prefix="detproxy-measures-")
MODEL = "tiny"
INTERVAL = 500  # the proxy's attestation.interval_ms


def keygen(name):
    prefix = os.path.join(TMP, name)
    if not os.path.exists(prefix + ".key.pem"):
        rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", prefix])
        assert rc == 0, err
    return prefix + ".key.pem", prefix + ".pub.pem"


def agent(fw_port, *flags, wrap=()):
    key, _ = keygen("pipeline")
    return start_process(list(wrap) + [DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                          "--model", MODEL, "--framework-url", "http://127.0.0.1:%d" % fw_port,
                          "--key", key, "--watch-interval-ms", "200"] + list(flags),
                         name="agent")


def agent_proxy(ag, engine_port, manifest):
    _, pub = keygen("pipeline")
    p = {"name": "p", "models": [MODEL], "manifest": manifest,
         "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d" % engine_port,
                       "attest": {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % ag.port}}]}
    return start_proxy(pools=[p], directory=tempfile.mkdtemp(dir=TMP), ready=False,
                       attestation={"interval_ms": INTERVAL, "timeout_ms": 2000,
                                    "require_signature": True, "trusted_keys": [pub]})


def replica(px):
    return get_json(px.admin_port, "/admin/replicas")["replicas"][0]


def payload(ag, nonce="n"):
    r = http("GET", ag.port, "/attestation?nonce=" + nonce)
    if r.status != 200:
        return r.status, r.json()
    return 200, json.loads(base64.b64decode(r.json()["payload"]))


def vouched(ag):
    """The checkpoint the agent signs now, from one answer: its hash, None when it vouches for
    none, or False while it answers no payload (503)."""
    st, p = payload(ag)
    return p["checkpoint_sha256"] if st == 200 else False


def sha256_file(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# ---- detproxy-sim: a quantization swapped under the same process ---------------------------


def test_a_quantization_swap_is_caught_within_two_intervals_naming_both():
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                    "b11669-Debian")  # unquantized float16: model_ftype F16
    ag = agent(sim.port, "--quantization", "F16")
    px = agent_proxy(ag, sim.port, {"model": MODEL, "quantization": "F16"})
    poll_until(lambda: replica(px)["state"] == "admitted", what="admitted")
    rep = replica(px)["attestation"]["report"]
    assert rep["quantization"] == "F16" and "quantization" in rep["measured"], rep
    assert rep["model_path"] == "/models/%s.gguf" % MODEL, rep
    # The sim's /models is nowhere: the agent says so rather than hash anything else.
    assert rep["checkpoint_sha256"] is None, rep
    assert "cannot see" in rep["unattested"]["checkpoint_sha256"] or \
        "not there" in rep["unattested"]["checkpoint_sha256"], rep
    sim_config(sim, quantization="Q8_0")
    t0 = time.monotonic()
    poll_until(lambda: replica(px)["state"] == "rejected", interval=0.01, what="rejected")
    took = time.monotonic() - t0
    reasons = replica(px)["reasons"]
    print("    Q8_0 swapped in -> rejected in %.0f ms (proxy interval %d ms): %s" % (
        took * 1000, INTERVAL, reasons))
    assert "agent: --quantization F16 contradicts the engine's Q8_0" in reasons, reasons
    assert "quantization mismatch: got Q8_0 want F16" in reasons, reasons
    # The signed payload itself says it.
    st, p = payload(ag)
    assert st == 200 and p["quantization"] == "Q8_0", p
    assert p["contradictions"] == [{"field": "quantization", "flag": "F16", "engine": "Q8_0"}], p
    # `attest verify` judges it as the proxy does.
    env = os.path.join(TMP, "contradicted.json")
    with open(env, "w") as f:
        f.write(http("GET", ag.port, "/attestation?nonce=v").text)
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "verify", "--envelope", env, "--pubkey",
                            keygen("pipeline")[1], "--nonce", "v"])
    assert rc == 1 and "CONTRADICTION      --quantization F16, the engine Q8_0" in out, (rc, out)
    # Back to F16: the same replica is admitted again, the contradiction gone.
    sim_config(sim, quantization="none")
    poll_until(lambda: replica(px)["state"] == "admitted", what="re-admitted")
    assert "contradictions" not in replica(px)["attestation"]["report"]
    px.stop()
    ag.stop()
    sim.stop()


def test_the_agent_reads_llamacpp_s_fingerprint_without_a_completion():
    """The agent's own requests to its engine are outside the proxy's admission slots: against
    llama.cpp, whose /props build_info is every response's system_fingerprint, it sends no
    probe completion at all, however often it refreshes."""
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                    "b11669-Debian")
    ag = agent(sim.port, "--framework-refresh-ms", "50")
    poll_until(lambda: len([q for q in sim_requests(sim) if q["path"] == "/props"]) >= 5,
               what="five framework refreshes")
    st, p = payload(ag)
    assert st == 200 and p["engine_fingerprint"] == "b11669-Debian", p
    assert [q for q in sim_requests(sim) if q["inference"]] == [], sim_requests(sim)
    ag.stop()
    sim.stop()


def test_an_engine_that_trickles_its_answer_is_not_vouched_for():
    """The engine swaps its quantization and then answers its metadata a byte every 200 ms,
    never ending: within every idle timeout. The agent's read is bounded as a whole (2 s), so
    it answers framework_unreachable instead of signing the last read's F16 for good, and the
    proxy takes the replica out of service."""
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--framework-version",
                    "b11669-Debian")
    ag = agent(sim.port, "--quantization", "F16", "--framework-refresh-ms", "300")
    px = agent_proxy(ag, sim.port, {"model": MODEL, "quantization": "F16"})
    poll_until(lambda: replica(px)["state"] == "admitted", what="admitted")
    sim_config(sim, quantization="Q8_0", fault="trickle", fault_scope="all")
    t0 = time.monotonic()
    poll_until(lambda: payload(ag)[0] == 503, timeout=15, what="the agent refusing to vouch")
    took = time.monotonic() - t0
    st, err = payload(ag)
    assert err["error"]["code"] == "framework_unreachable", err
    assert "answer not whole within 2000 ms" in err["error"]["message"], err
    print("    trickling engine -> framework_unreachable after %.0f ms" % (took * 1000))
    poll_until(lambda: replica(px)["state"] in ("unreachable", "rejected"),
               what="the replica out of service")
    px.stop()
    ag.stop()
    sim.stop()


def test_without_framework_url_the_agent_repeats_its_flags():
    """Flags only: an agent told F16 signs F16 whatever the engine runs (what --framework-url
    exists to prevent; docs/attestation.md §4)."""
    sim = start_sim("--flavor", "llamacpp", "--model", MODEL, "--quantization", "Q8_0")
    d = os.path.join(TMP, "flags-only")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tiny.gguf"), "wb") as f:
        f.write(b"GGUF")
    key, _ = keygen("pipeline")
    ag = start_process([DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                        "--model", MODEL, "--model-dir", d, "--quantization", "F16",
                        "--framework", "llamacpp", "--framework-version", "b11669", "--key",
                        key], name="agent")
    poll_until(lambda: payload(ag)[0] == 200, what="hashed")
    p = payload(ag)[1]
    assert p["quantization"] == "F16" and "measured" not in p, p
    assert "contradictions" not in p, p
    # Only a canary catches it; the rejection then says what the engine itself reports beside
    # the signed identity (its /props model_ftype), not only that the output differs.
    f16 = start_sim("--flavor", "llamacpp", "--model", MODEL, "--quantization", "F16")
    text = http("POST", f16.port, "/v1/completions", body=json.dumps(
        {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 8, "temperature": 0,
         "seed": 0}), headers={"content-type": "application/json"}).json()["choices"][0]["text"]
    f16.stop()
    can = {"prompt": "Count: one, two,", "max_tokens": 8,
           "expected_sha256": hashlib.sha256(text.encode()).hexdigest()}
    px = agent_proxy(ag, sim.port, {"model": MODEL, "quantization": "F16", "canary": can})
    poll_until(lambda: any(r.startswith("the engine itself") for r in replica(px)["reasons"]),
               what="the engine's own report among the reasons")
    rep = replica(px)
    assert rep["state"] == "pending", rep
    assert rep["reasons"][0].startswith("canary mismatch: output sha256 "), rep["reasons"]
    assert ("the engine itself (llamacpp metadata) reports quantization Q8_0 (attested F16)"
            in rep["reasons"][1]), rep["reasons"]
    px.stop()
    ag.stop()
    sim.stop()


# ---- a fake llama-server that really loads a GGUF file ------------------------------------

FAKE = r'''
import json, mmap, os, signal, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
port, path, ftype, mapped = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
f = open(mapped, "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)  # llama.cpp maps its GGUF the same way
f.close()
BUILD = "b11669-Debian"

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def send(self, obj):
        b = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def do_GET(self):
        named = path
        if os.environ.get("FAKE_MODEL_PATH_FILE"):  # a model swapped under the process ...
            with open(os.environ["FAKE_MODEL_PATH_FILE"]) as f:
                named = f.read()
        if os.environ.get("FAKE_UNRECOGNISED") or named == "-":  # ... or no engine it knows
            self.send_error(404)
        elif self.path == "/props":
            self.send({"build_info": BUILD, "model_ftype": ftype, "model_path": named,
                       "total_slots": 4, "model_alias": "tiny"})
        elif self.path == "/v1/models":
            self.send({"object": "list", "data": [{"id": "tiny", "owned_by": "llamacpp"}]})
        else:
            self.send_error(404)
    def do_POST(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(n)
        self.send({"choices": [{"index": 0, "text": " x", "finish_reason": "length"}],
                   "system_fingerprint": BUILD, "object": "text_completion"})

signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
if os.environ.get("FAKE_LISTEN_FD"):  # a socket bound by a parent (forking_engine)
    import socket
    srv = ThreadingHTTPServer(("127.0.0.1", port), H, bind_and_activate=False)
    srv.socket = socket.socket(fileno=int(os.environ["FAKE_LISTEN_FD"]))
else:
    srv = ThreadingHTTPServer(("127.0.0.1", port), H)
sys.stderr.write(json.dumps({"msg": "listening", "port": srv.server_address[1]}) + "\n")
sys.stderr.flush()
# SIGUSR1: stop listening and stay (an engine shutting down while another takes its port).
signal.signal(signal.SIGUSR1, lambda *_: __import__("threading").Thread(
    target=lambda: (srv.shutdown(), srv.server_close())).start())
srv.serve_forever()
signal.pause()
'''


def fake_engine(port, path, ftype, mapped=None, user=None, home=TMP, path_file=None,
                unrecognised=False):
    """The fake llama-server; as uid `user` (setpriv, Debian's python3), its script then in
    `home`, a folder that user can read. With `path_file`, the model path it reports is that
    file's contents at each read (one process that swaps its model)."""
    script = os.path.join(home, "fake_llama_server.py")
    if not os.path.exists(script):
        with open(script, "w") as f:
            f.write(FAKE)
        os.chmod(script, 0o644)
    argv = [sys.executable, script, str(port), path, ftype, mapped or path]
    if user is not None:
        argv = ["setpriv", "--reuid=%d" % user, "--regid=%d" % user, "--clear-groups",
                "/usr/bin/python3"] + argv[1:]
    env = {}
    if path_file:
        env["FAKE_MODEL_PATH_FILE"] = path_file
    if unrecognised:
        env["FAKE_UNRECOGNISED"] = "1"
    return start_process(argv, env=env or None, name="fake-llama-server")


def gguf(name, content):
    d = os.path.join(TMP, "models")
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, name)
    with open(path, "wb") as f:
        f.write(b"GGUF" + content * 4096)
    return path


def test_the_loaded_gguf_file_is_hashed_and_a_restart_is_measured_at_once():
    f16 = gguf("tiny-f16.gguf", b"f16 weights ")
    q8 = gguf("tiny-q8_0.gguf", b"q8_0 weights")
    port = free_port()
    eng = fake_engine(port, f16, "F16")
    models = os.path.dirname(f16)
    ag = agent(port, "--quantization", "F16", "--model-dir", models)
    poll_until(lambda: payload(ag)[0] == 200, what="the agent measured the engine")
    p = payload(ag)[1]
    assert p["checkpoint_sha256"] == sha256_file(f16), p
    assert set(p["measured"]) >= {"quantization", "checkpoint_sha256"}, p
    assert p["model_path"] == f16 and "contradictions" not in p, p
    assert any(r.get("seen") == "mapped" for r in ag.find_logs("engine_loaded")), ag.find_logs(
        "engine_loaded")
    # `detproxy attest hash FILE` prints the value to pin: sha256sum's.
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "hash", f16])
    assert rc == 0 and out.strip() == sha256_file(f16), (rc, out, err)
    rc, out, _ = run_cmd([DETPROXY_BIN, "attest", "hash", "--list", f16])
    if shutil.which("sha256sum"):
        assert out == subprocess.run(["sha256sum", f16], capture_output=True,
                                     text=True).stdout, out

    px = agent_proxy(ag, port, {"model": MODEL, "quantization": "F16",
                                "checkpoint_sha256": sha256_file(f16)})
    poll_until(lambda: replica(px)["state"] == "admitted", what="admitted")
    # The engine restarts on the same port with the Q8_0 file: another process, another file.
    eng.stop()
    eng = fake_engine(port, q8, "Q8_0")
    t0 = time.monotonic()
    poll_until(lambda: payload(ag, "x")[0] == 200 and
               payload(ag, "x")[1]["checkpoint_sha256"] == sha256_file(q8), interval=0.01,
               what="the new file measured")
    measured = time.monotonic() - t0
    poll_until(lambda: replica(px)["state"] == "rejected", interval=0.01, what="rejected")
    ejected = time.monotonic() - t0
    reasons = replica(px)["reasons"]
    print("    engine restarted on Q8_0: agent signs the new file's hash after %.0f ms, proxy "
          "rejects after %.0f ms (interval %d ms): %s" % (measured * 1000, ejected * 1000,
                                                          INTERVAL, reasons))
    assert "agent: --quantization F16 contradicts the engine's Q8_0" in reasons, reasons
    assert any(r.startswith("checkpoint_sha256 mismatch: got %s" % sha256_file(q8)[:8])
               for r in reasons), reasons
    # The new process was found by its listening socket.
    procs = ag.find_logs("engine_process")
    assert procs and procs[-1]["pid"] == eng.popen.pid, (procs, eng.popen.pid)
    px.stop()
    ag.stop()
    eng.stop()


def test_a_model_dir_the_engine_did_not_load_is_a_contradiction():
    f16 = gguf("tiny-f16.gguf", b"f16 weights ")
    elsewhere = os.path.join(TMP, "elsewhere")
    os.makedirs(elsewhere, exist_ok=True)
    port = free_port()
    eng = fake_engine(port, f16, "F16")
    ag = agent(port, "--model-dir", elsewhere)
    px = agent_proxy(ag, port, {"model": MODEL})
    poll_until(lambda: replica(px)["state"] == "rejected", what="rejected")
    reasons = replica(px)["reasons"]
    assert reasons == ["agent: --model-dir %s contradicts the engine's %s" % (elsewhere, f16)], \
        reasons
    # What is signed is still the file the engine loaded, not the folder the flag names.
    assert replica(px)["attestation"]["report"]["checkpoint_sha256"] == sha256_file(f16)
    px.stop()
    ag.stop()
    eng.stop()


def test_a_path_the_engine_names_is_hashed_only_when_it_is_a_model():
    """Whatever path the engine names, the agent hashes and signs for anyone who asks: an
    engine naming a file that is not a model (a secret of the host's) or "/" (a walk of the
    whole file system) gets nothing read, and the checkpoint is not vouched for, with why."""
    secret = os.path.join(TMP, "secret.txt")
    with open(secret, "w") as f:
        f.write("root:$6$not-a-model\n")
    weights = gguf("tiny-f16.gguf", b"f16 weights ")
    for named, mapped, why in ((secret, secret, "not a GGUF file"),
                               ("/", weights, "without a config.json")):
        port = free_port()
        eng = fake_engine(port, named, "F16", mapped=mapped)
        ag = agent(port, "--quantization", "F16")
        poll_until(lambda: payload(ag)[0] == 200, what="the agent read the engine")
        p = payload(ag)[1]
        assert p["checkpoint_sha256"] is None, p
        assert why in p["unattested"]["checkpoint_sha256"], p
        assert sha256_file(secret) not in json.dumps(p), p
        ag.stop()
        eng.stop()


def test_a_model_folder_must_still_be_one_when_hashed():
    """The engine names a link to a model folder, and once it is hashed the link is swapped to
    a folder of secrets (no config.json): the re-hash that follows the change looks again, and
    what it would read is neither vouched for nor logged. A Hugging Face cache snapshot, whose
    files link into the repository's blobs/, is hashed as `attest hash` hashes it."""
    repo = os.path.join(TMP, "hub", "models--org--tiny")
    snap = os.path.join(repo, "snapshots", "0123abcd")
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(snap, exist_ok=True)
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"w" * 4096)):
        blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
        with open(blob, "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", os.path.basename(blob)),
                   os.path.join(snap, name))
    secrets = os.path.join(TMP, "secrets")
    os.makedirs(secrets, exist_ok=True)
    with open(os.path.join(secrets, "id_ed25519"), "w") as f:
        f.write("not a model\n")
    named = os.path.join(TMP, "named_model")
    os.symlink(snap, named)
    weights = os.path.join(snap, "model.safetensors")
    port = free_port()
    eng = fake_engine(port, named, "F16", mapped=weights)
    ag = agent(port, "--quantization", "F16")
    poll_until(lambda: payload(ag)[0] == 200, what="the snapshot hashed")
    rc, hashed, _ = run_cmd([DETPROXY_BIN, "attest", "hash", snap])
    assert payload(ag)[1]["checkpoint_sha256"] == hashed.strip(), payload(ag)
    rc, secret_hash, _ = run_cmd([DETPROXY_BIN, "attest", "hash", secrets])
    os.symlink(secrets, named + ".new")
    os.replace(named + ".new", named)
    # 503 while the agent looks again, then no checkpoint vouched for, with why.
    poll_until(lambda: vouched(ag) is None, what="the agent vouching for no checkpoint")
    st, p = payload(ag)
    assert "without a config.json" in p["unattested"]["checkpoint_sha256"], p
    assert secret_hash.strip() not in json.dumps(p), p
    assert not any(secret_hash.strip() in json.dumps(l) for l in ag.logs), ag.logs
    ag.stop()
    eng.stop()


def can_run_an_engine_as_nobody(*tools):
    """Root, setpriv (and tools) and Debian's python3: the fake engine then runs as nobody."""
    if os.getuid() != 0 or not os.path.exists("/usr/bin/python3") or not all(
            shutil.which(t) for t in ("setpriv",) + tools):
        print("    skipped: needs root, %s and /usr/bin/python3 to run the engine as another uid"
              % ", ".join(("setpriv",) + tools))
        return False
    return True


def engine_home():
    """A folder nobody may read (for the engine's script) and a GGUF file in it to map."""
    home = tempfile.mkdtemp(prefix="detproxy-engine-user-", dir="/tmp")
    os.chmod(home, 0o755)
    weights = os.path.join(home, "w.gguf")
    with open(weights, "wb") as f:
        f.write(b"GGUF" + b"x" * 64)
    return home, weights


def test_a_model_folder_is_read_as_the_engine_s_user():
    """A root agent reads an engine-named folder with the engine's file-system identity: a
    link in it to a file only root may read (a secret, whose hash would confirm a guess at it)
    stops the hash, and nothing of the secret is signed or logged. The folder itself, which
    the engine can read, is hashed as `attest hash` hashes it."""
    if not can_run_an_engine_as_nobody():
        return
    home = tempfile.mkdtemp(prefix="detproxy-engine-user-", dir="/tmp")
    try:
        os.chmod(home, 0o755)
        model = os.path.join(home, "model")
        os.mkdir(model, 0o755)
        for name, data in (("config.json", b"{}"), ("model.safetensors", b"w" * 4096)):
            with open(os.path.join(model, name), "wb") as f:
                f.write(data)
            os.chmod(os.path.join(model, name), 0o644)
        secret = os.path.join(TMP, "root-only", "shadow")
        os.makedirs(os.path.dirname(secret), mode=0o700, exist_ok=True)
        with open(secret, "w") as f:
            f.write("root:$6$only-root-reads-this\n")
        os.chmod(secret, 0o600)
        port = free_port()
        eng = fake_engine(port, model, "F16", mapped=os.path.join(model, "model.safetensors"),
                          user=65534, home=home)
        ag = agent(port, "--quantization", "F16")
        def checkpoint():
            return vouched(ag) or None  # none while it answers 503 or vouches for none

        signed = poll_until(checkpoint, what="the folder hashed")
        _, hashed, _ = run_cmd([DETPROXY_BIN, "attest", "hash", model])
        assert signed == hashed.strip(), (signed, hashed)

        os.symlink(secret, os.path.join(model, "tokenizer.json"))
        _, with_secret, _ = run_cmd([DETPROXY_BIN, "attest", "hash", model])  # as root
        poll_until(lambda: checkpoint() is None, what="the agent no longer vouching for it")
        st, p = payload(ag)
        assert "Permission denied" in json.dumps(p), (st, p)
        # Its retries are refused too (the first after 1 s).
        poll_until(lambda: sum("Permission denied" in json.dumps(l) for l in ag.logs) >= 2,
                   what="a retry refused as well")
        assert with_secret.strip() not in json.dumps(payload(ag)[1]), payload(ag)
        assert not any(with_secret.strip() in json.dumps(l) for l in ag.logs), ag.logs

        # A file anyone may read in a folder only root may enter, reached through a root
        # process's /proc/PID/cwd: the engine cannot follow that link, and neither may the
        # agent (it keeps no CAP_SYS_PTRACE while it reads as the engine).
        os.unlink(os.path.join(model, "tokenizer.json"))
        poll_until(checkpoint, what="the folder vouched for again")
        closed = os.path.join(TMP, "root-only", "app")
        os.makedirs(closed, exist_ok=True)
        with open(os.path.join(closed, "settings"), "w") as f:
            f.write("api_key=only-root-can-reach-this\n")
        os.chmod(os.path.join(closed, "settings"), 0o644)
        holder = subprocess.Popen(["sleep", "600"], cwd=closed)
        try:
            os.symlink("/proc/%d/cwd/settings" % holder.pid, os.path.join(model, "vocab.json"))
            _, with_settings, _ = run_cmd([DETPROXY_BIN, "attest", "hash", model])
            poll_until(lambda: checkpoint() is None, what="the agent no longer vouching for it")
            poll_until(lambda: sum("vocab.json" in json.dumps(l) and "Permission denied"
                                   in json.dumps(l) for l in ag.logs) >= 2,
                       what="the link through /proc refused, a retry too")
            assert with_settings.strip() not in json.dumps(payload(ag)[1]), payload(ag)
            assert not any(with_settings.strip() in json.dumps(l) for l in ag.logs)
        finally:
            holder.kill()
            holder.wait()
        ag.stop()
        eng.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_an_engine_whose_root_the_agent_cannot_open_has_nothing_read():
    """An agent that is not root, told which process the engine is (--engine-pid), cannot open
    the root of an engine that runs as another uid (/proc/PID/root needs the engine's uid or
    CAP_SYS_PTRACE): nothing the engine names is read, and the reason says why. The same path
    in the agent's own root, which it could read, is never read instead."""
    if not can_run_an_engine_as_nobody():
        return
    home, weights = engine_home()
    try:
        os.chmod(weights, 0o644)  # the agent's uid could read it in its own root
        port = free_port()
        eng = fake_engine(port, weights, "F16", user=65534, home=home)
        key, _ = keygen("pipeline")
        agent_key = os.path.join(home, "agent.key.pem")
        shutil.copyfile(key, agent_key)
        os.chown(agent_key, 65533, 65533)
        os.chmod(agent_key, 0o600)
        ag = start_process(["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups",
                            DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0",
                            "--model", MODEL, "--framework-url", "http://127.0.0.1:%d" % port,
                            "--key", agent_key, "--watch-interval-ms", "200",
                            "--engine-pid", str(eng.popen.pid), "--quantization", "F16"],
                           name="agent")
        st, p = poll_until(lambda: (lambda r: r if r[0] == 200 else None)(payload(ag)),
                           what="the agent answering with the engine read")
        assert p.get("checkpoint_sha256") is None, p
        note = json.dumps(p)
        assert "opening the engine's root /proc/%d/root" % eng.popen.pid in note, p
        assert "CAP_SYS_PTRACE" in note, p
        assert not ag.find_logs("hashed"), ag.find_logs("hashed")
        ag.stop()
        eng.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def can_give_an_engine_a_root():
    if os.getuid() != 0 or not all(shutil.which(t) for t in ("unshare", "chroot", "mount")):
        print("    skipped: needs root, unshare, chroot and mount to give the engine a root")
        return False
    return True


def engine_root():
    """A root for a chrooted engine: Debian's /usr (bind-mounted at start) and its links."""
    root = tempfile.mkdtemp(prefix="detproxy-engine-root-", dir="/tmp")
    for name in ("usr", "srv"):
        os.makedirs(os.path.join(root, name), exist_ok=True)
    for name in ("bin", "lib", "lib64", "sbin"):
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), os.path.join(root, name))
    with open(os.path.join(root, "srv", "fake_llama_server.py"), "w") as f:
        f.write(FAKE)
    return root


def chrooted_engine(root, port, path, mapped, wrap=""):
    """The fake llama-server chrooted in root, in a mount namespace of its own (as root there),
    naming `path` (in its root) as its model and mapping `mapped`; `wrap`: a command (in the
    root) that runs it, such as setpriv."""
    return start_process(
        ["unshare", "--mount", "sh", "-c",
         'mount --bind /usr "$1/usr" && exec chroot "$1" %s /usr/bin/python3 '
         '/srv/fake_llama_server.py "$2" "$3" F16 "$4"' % wrap, "sh", root, str(port), path,
         mapped], name="chrooted-llama-server")


def hf_folder(path):
    os.makedirs(path, exist_ok=True)
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"w" * 4096)):
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)


def remove_engine_root(root):
    # The bind mount is the engine's namespace's alone: here usr is an empty folder.
    if not os.path.ismount(os.path.join(root, "usr")):
        shutil.rmtree(root, ignore_errors=True)


def test_an_engine_in_its_own_root_has_its_links_read_there():
    """An engine in a root of its own (a chroot in its own mount namespace, as root there)
    names a model folder whose links are the engine's: `tokenizer.json -> /host/secret` points
    at nothing in the engine's root, and `../../../secret` cannot climb out of it. The agent
    reads the folder as the engine does (the links dangle and are left out, as `find -L`
    leaves them), not through its own root, where both would reach the host's secret."""
    if not can_give_an_engine_a_root():
        return
    root = engine_root()
    secret = os.path.join(TMP, "host-secret")
    with open(secret, "w") as f:
        f.write("root:$6$only-the-host-has-this\n")
    try:
        model = os.path.join(root, "models", "m")
        hf_folder(model)
        port = free_port()
        eng = chrooted_engine(root, port, "/models/m", "/models/m/model.safetensors")
        ag = agent(port, "--quantization", "F16")
        def checkpoint():
            return vouched(ag) or None

        _, before, _ = run_cmd([DETPROXY_BIN, "attest", "hash", model])
        poll_until(lambda: checkpoint() == before.strip(), what="the folder hashed")
        # The engine's view of the folder once the links are in: a new file, links to nothing.
        view = os.path.join(TMP, "engine-view")
        shutil.copytree(model, view)
        with open(os.path.join(view, "generation_config.json"), "w") as f:
            f.write("{}")
        _, expected, _ = run_cmd([DETPROXY_BIN, "attest", "hash", view])
        os.symlink(secret, os.path.join(model, "tokenizer.json"))
        os.symlink(os.path.relpath(secret, model), os.path.join(model, "vocab.json"))
        shutil.copy(os.path.join(view, "generation_config.json"), model)
        _, with_secret, _ = run_cmd([DETPROXY_BIN, "attest", "hash", model])  # the host's view
        assert with_secret.strip() != expected.strip()
        got = poll_until(lambda: checkpoint() not in (None, before.strip()) and checkpoint(),
                         what="the folder hashed again")
        assert got == expected.strip(), (got, expected, with_secret)
        assert not any(with_secret.strip() in json.dumps(l) for l in ag.logs), ag.logs
        ag.stop()
        eng.stop()
    finally:
        remove_engine_root(root)


def test_a_model_dir_is_compared_in_the_engine_s_root():
    """The path the engine names may itself go through its links (`/models -> /srv/weights`,
    absolute, in its root): the model is found and hashed there, and a --model-dir naming the
    folder the link leads to in the engine's root is the loaded model's, no contradiction."""
    if not can_give_an_engine_a_root():
        return
    root = engine_root()
    try:
        hf_folder(os.path.join(root, "srv", "weights", "m"))
        os.symlink("/srv/weights", os.path.join(root, "models"))
        port = free_port()
        eng = chrooted_engine(root, port, "/models/m", "/models/m/model.safetensors")
        ag = agent(port, "--quantization", "F16", "--model-dir",
                   os.path.join(root, "srv", "weights"))
        _, hashed, _ = run_cmd([DETPROXY_BIN, "attest", "hash",
                                os.path.join(root, "srv", "weights", "m")])
        poll_until(lambda: vouched(ag) == hashed.strip(), what="the model found and hashed")
        st, p = payload(ag)
        assert "contradictions" not in p, p
        assert p["model_path"] == "/models/m", p
        ag.stop()
        eng.stop()
    finally:
        remove_engine_root(root)


def test_whether_an_oms_bundle_applies_is_asked_in_the_engine_s_root():
    """An OMS bundle covers a folder, not a one-file model, and which one the engine names is
    asked in the engine's root: its `/models -> ...` link leads to a folder there, while the
    same absolute path in the agent's root is a file. Asked in the agent's root, the bundle
    would not be checked at all (and whether it was would tell the engine what the host has
    at that path)."""
    if not can_give_an_engine_a_root():
        return
    import omsutil as oms
    root = engine_root()
    weights = os.path.join(TMP, "oms-weights")
    try:
        os.makedirs(weights, exist_ok=True)
        host_file = os.path.join(weights, "m")
        with open(host_file, "wb") as f:  # the agent's root: a file at the same path
            f.write(b"GGUF" + b"host" * 64)
        folder = root + host_file
        hf_folder(folder)
        os.symlink(weights, os.path.join(root, "models"))
        publisher = oms.ec_key(TMP, "oms-publisher")
        bundle = oms.write_bundle(os.path.join(TMP, "oms-m.sig"), oms.statement(folder),
                                  publisher)
        port = free_port()
        eng = chrooted_engine(root, port, "/models/m", "/models/m/model.safetensors")
        ag = agent(port, "--quantization", "F16", "--oms-bundle", bundle, "--oms-pubkey",
                   publisher.pub)
        _, folder_hash, _ = run_cmd([DETPROXY_BIN, "attest", "hash", folder])
        poll_until(lambda: vouched(ag) == folder_hash.strip(), what="the folder hashed")
        st, p = payload(ag)
        assert p["oms"]["verified"] is True, p
        assert ag.find_logs("oms_verified"), ag.logs
        ag.stop()
        eng.stop()
    finally:
        remove_engine_root(root)
        shutil.rmtree(weights, ignore_errors=True)


def test_an_engine_root_without_capabilities_lends_none_and_its_links_are_not_the_hosts():
    """An engine running as uid 0 in a root of its own, with every capability dropped (docker
    --cap-drop ALL): the agent reads with no more than the engine has, so a file there that
    only uid 1000 may read stops the hash. And a link in that root to the agent's --model-dir
    is the engine's folder of that name, not the agent's: --model-dir is then a contradiction,
    whatever the agent's own folder of that name holds."""
    if not can_give_an_engine_a_root() or shutil.which("setpriv") is None:
        return
    root = engine_root()
    os.chmod(root, 0o755)
    host_model = os.path.join(TMP, "host-model-dir")
    try:
        for d, data in ((host_model, b"host"), (root + host_model, b"engine")):
            hf_folder(d)
            with open(os.path.join(d, "model.safetensors"), "wb") as f:
                f.write(data * 1024)
        os.makedirs(os.path.join(root, "models"))
        os.symlink(host_model, os.path.join(root, "models", "L"))
        port = free_port()
        eng = chrooted_engine(root, port, "/models/L", "/models/L/model.safetensors",
                              wrap="setpriv --bounding-set=-all --inh-caps=-all")
        ag = agent(port, "--quantization", "F16", "--model-dir", host_model)
        _, engines, _ = run_cmd([DETPROXY_BIN, "attest", "hash", root + host_model])
        poll_until(lambda: vouched(ag) == engines.strip(), what="the engine's folder hashed")
        st, p = payload(ag)
        assert p["contradictions"] == [{"field": "model_dir", "flag": host_model,
                                        "engine": "/models/L"}], p
        # A file of the engine's root that its root user, without capabilities, cannot read.
        secret = os.path.join(root + host_model, "tokenizer.json")
        with open(secret, "w") as f:
            f.write("uid 1000's")
        os.chown(secret, 1000, 1000)
        os.chmod(secret, 0o600)
        poll_until(lambda: any("tokenizer.json: Permission denied" in json.dumps(l)
                               for l in ag.logs), what="the unreadable file refused")
        assert vouched(ag) in (None, False), payload(ag)
        ag.stop()
        eng.stop()
    finally:
        remove_engine_root(root)


def test_an_engine_out_of_sight_lends_only_its_socket_s_uid():
    """A root agent in a PID namespace of its own (a sidecar without a shared process
    namespace) cannot see the engine's process, its groups or its root. It reads what the
    engine names with the rights of the uid owning the engine's listening socket and no group:
    a folder only root may read, named by an engine running as nobody, is not vouched for."""
    if not can_run_an_engine_as_nobody("unshare"):
        return
    home, weights = engine_home()
    try:
        closed = os.path.join(TMP, "root-only-model")  # TMP: a folder only root may enter
        hf_folder(closed)
        _, hashed, _ = run_cmd([DETPROXY_BIN, "attest", "hash", closed])
        port = free_port()
        eng = fake_engine(port, closed, "F16", mapped=weights, user=65534, home=home)
        ag = agent(port, "--quantization", "F16",
                   wrap=("unshare", "--pid", "--fork", "--kill-child", "--mount-proc"))
        poll_until(lambda: vouched(ag) is None, what="no checkpoint vouched for")
        st, p = payload(ag)
        assert "which the agent cannot see" in p["unattested"]["checkpoint_sha256"], p
        assert not any(hashed.strip() in json.dumps(l) for l in ag.logs), ag.logs
        # A folder that user can read is measured as before.
        eng.stop()
        readable = os.path.join(home, "model")
        hf_folder(readable)
        _, hashed, _ = run_cmd([DETPROXY_BIN, "attest", "hash", readable])
        eng = fake_engine(port, readable, "F16", mapped=weights, user=65534, home=home)
        poll_until(lambda: vouched(ag) == hashed.strip(), what="the readable folder vouched for")
        ag.stop(signal.SIGKILL, expect_rc=None)  # unshare --fork waits out a SIGTERM
        eng.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


FORKING = r'''
import ctypes, os, signal, socket, sys
mode, port, script = sys.argv[1], int(sys.argv[2]), sys.argv[3]
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen(64)
s.set_inheritable(True)
child = os.fork()
if child == 0:
    if mode == "drop":  # a root parent that bound the port, a worker that serves as nobody
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
    # The worker dies with its parent, even one killed with SIGKILL (set after the ids
    # change, which clears it).
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)
    os.environ["FAKE_LISTEN_FD"] = str(s.fileno())
    os.execv("/usr/bin/python3", ["/usr/bin/python3", script, str(port)] + sys.argv[4:])
signal.signal(signal.SIGTERM, lambda *_: (os.kill(child, signal.SIGKILL), os._exit(0)))
os.waitpid(child, 0)
'''


def forking_engine(mode, port, path, mapped, home):
    """The fake llama-server on a socket its parent bound; "drop": a root parent keeping the
    socket while its child serves as nobody."""
    for name, text in (("fake_llama_server.py", FAKE), ("forking.py", FORKING)):
        with open(os.path.join(home, name), "w") as f:
            f.write(text)
        os.chmod(os.path.join(home, name), 0o644)
    return start_process([sys.executable, os.path.join(home, "forking.py"), mode, str(port),
                          os.path.join(home, "fake_llama_server.py"), path, "F16", mapped],
                         name="forking-llama-server")


def test_a_socket_a_root_parent_holds_for_its_worker_lends_no_root():
    """A root parent binds the port and keeps the socket while its child serves as nobody
    (a master and its workers, socket activation): the processes holding the socket read
    with different rights, so neither is taken for the engine, and what it names is read as
    the socket's owner would be, never root: a folder only root may read is not vouched for."""
    if not can_run_an_engine_as_nobody():
        return
    home, weights = engine_home()
    try:
        closed = os.path.join(TMP, "root-only-worker-model")  # TMP: only root may enter
        hf_folder(closed)
        port = free_port()
        eng = forking_engine("drop", port, closed, weights, home)
        ag = agent(port, "--quantization", "F16")
        poll_until(lambda: vouched(ag) is None, what="no checkpoint vouched for")
        line = ag.wait_log(lambda l: l.get("msg") == "engine_process")
        assert line["pid"] is None and "different rights" in line["detail"], line
        st, p = payload(ag)
        assert "which the agent cannot see" in p["unattested"]["checkpoint_sha256"], p
        ag.stop()
        eng.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


HIDING = r'''
import json, os, select, signal, socket, sys
port, path = int(sys.argv[1]), sys.argv[2]
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
BUILD = "b11669-Debian"
# The listening socket lives in flight in a Unix socket's queue (SCM_RIGHTS), in no process's
# fd table, except while a connection is accepted from it; an epoll set, which keeps the file
# and not a descriptor, says when one waits. Whoever looks for its holder finds none.
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
ep = select.epoll()
def stash(s):
    socket.send_fds(a, [b"l"], [s.fileno()])
    s.close()
def fetch():
    _, fds, _, _ = socket.recv_fds(b, 1, 1)
    return socket.socket(fileno=fds[0])
lst = socket.socket()
lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
lst.bind(("127.0.0.1", port))
lst.listen(64)
ep.register(lst.fileno(), select.EPOLLIN)
sys.stderr.write(json.dumps({"msg": "listening", "port": port}) + "\n")
sys.stderr.flush()
stash(lst)
while True:
    ep.poll()
    lst = fetch()
    conn, _ = lst.accept()
    stash(lst)
    req = b""
    while b"\r\n\r\n" not in req:
        chunk = conn.recv(4096)
        if not chunk:
            break
        req += chunk
    target = req.split(b" ")[1] if req.count(b" ") >= 2 else b"/"
    if target == b"/props":
        body = {"build_info": BUILD, "model_ftype": "F16", "model_path": path,
                "total_slots": 4, "model_alias": "tiny"}
    elif target == b"/v1/models":
        body = {"object": "list", "data": [{"id": "tiny", "owned_by": "llamacpp"}]}
    else:
        body = None
    data = json.dumps(body).encode() if body is not None else b""
    head = "HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n" \
           "Connection: close\r\n\r\n" % ("200 OK" if body is not None else "404 Not Found",
                                             len(data))
    conn.sendall(head.encode() + data)
    conn.close()
'''


def test_an_engine_that_hides_its_socket_s_holder_has_nothing_read():
    """An agent that sees every process (root, in the machine's first PID and user namespaces)
    knows that a listening socket no process holds is one kept out of sight on purpose (here:
    passed through a Unix socket between accepts): nothing the engine names is read, rather
    than reading it as an engine out of sight, with its socket owner's rights in the agent's
    root. A model anyone could read there is still not vouched for."""
    st = os.stat("/proc/self/ns/pid")
    if os.getuid() != 0 or st.st_ino != 0xEFFFFFFC:
        print("    skipped: needs root in the machine's first PID namespace")
        return
    home, weights = engine_home()
    try:
        os.chmod(weights, 0o644)
        script = os.path.join(home, "hiding_engine.py")
        with open(script, "w") as f:
            f.write(HIDING)
        port = free_port()
        eng = start_process([sys.executable, script, str(port), weights],
                            name="hiding-llama-server")
        ag = agent(port, "--quantization", "F16")
        st, p = poll_until(lambda: (lambda r: r if r[0] == 200 else None)(payload(ag)),
                           what="the agent answering with the engine read")
        assert p.get("checkpoint_sha256") is None, (p, ag.find_logs("engine_process"))
        assert "no process holds the engine's listening socket" in json.dumps(p), p
        procs = ag.find_logs("engine_process")
        assert procs and procs[-1]["pid"] is None and "sees every process" in \
            procs[-1]["detail"], procs
        assert not ag.find_logs("hashed"), ag.find_logs("hashed")
        ag.stop()
        eng.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_a_link_through_proc_self_is_not_followed():
    """/proc/self is whoever reads it: in a folder the engine names, a link through it would
    reach the agent's own files (its working directory, its open files) with the agent's
    rights. No link through /proc is followed in what the engine names."""
    model = os.path.join(TMP, "proc-self-model")
    os.makedirs(model, exist_ok=True)
    for name, data in (("config.json", b"{}"), ("model.safetensors", b"w" * 4096)):
        with open(os.path.join(model, name), "wb") as f:
            f.write(data)
    agents_own = os.path.join(os.getcwd(), "agents-own-file")
    with open(agents_own, "w") as f:
        f.write("only the agent's working directory has this\n")
    os.symlink("/proc/self/cwd/agents-own-file", os.path.join(model, "tokenizer.json"))
    try:
        port = free_port()
        eng = fake_engine(port, model, "F16", mapped=os.path.join(model, "model.safetensors"))
        ag = agent(port, "--quantization", "F16")
        poll_until(lambda: any("a link through /proc" in json.dumps(l) for l in ag.logs),
                   what="the link refused")
        assert vouched(ag) in (None, False), payload(ag)
        ag.stop()
        eng.stop()
    finally:
        os.unlink(agents_own)


def stalled_mount():
    """A FUSE mount whose server never answers: /dev/fuse is opened and mounted, and nothing
    ever reads it, so every look under the mount waits in the kernel (fuse_get_req) until the
    connection ends. Returns (mount point, the descriptor whose close ends it), or None (with a
    SKIP line) where FUSE cannot be mounted: no /dev/fuse, not root. The mount point is not
    under TMP, so nothing that walks TMP waits on it."""
    import ctypes
    where = tempfile.mkdtemp(prefix="detproxy-stalled-")
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError:
        fd = None
    opts = "fd=%d,rootmode=40000,user_id=0,group_id=0" % (fd or 0)
    if fd is None or libc.mount(b"detproxy-stalled", where.encode(), b"fuse", 0,
                                opts.encode()) != 0:
        if fd is not None:
            os.close(fd)
        os.rmdir(where)
        print("    SKIP: cannot mount FUSE here (needs /dev/fuse and root)")
        return None
    return where, fd


def end_stalled_mount(m):
    """Closing the server's descriptor aborts the connection (every wait under it ends with
    ENOTCONN); the mount is then detached and its point removed."""
    import ctypes
    where, fd = m
    os.close(fd)
    ctypes.CDLL(None, use_errno=True).umount2(where.encode(), 2)  # MNT_DETACH
    os.rmdir(where)


def test_a_model_on_storage_that_does_not_answer_stops_neither_answers_nor_exit():
    """The look for the model the engine names (a stat and a 4-byte read) runs off the agent's
    loop: when the storage under it never answers (an NFS server gone, a FUSE daemon hung), the
    agent keeps answering, stops vouching for the checkpoint once the look outlasts 5 s, and
    still exits on SIGTERM."""
    m = stalled_mount()
    if m is None:
        return
    try:
        real = gguf("stalled-mapped.gguf", b"the file the engine maps ")
        port = free_port()
        eng = fake_engine(port, os.path.join(m[0], "model.gguf"), "F16", mapped=real)
        ag = agent(port, "--quantization", "F16")
        # The agent answers all along (503 while the engine's model is being looked for), and
        # once the look has outlasted 5 s, signs what the engine says without a checkpoint.
        t0 = time.monotonic()
        while True:
            st, p = payload(ag, "w")
            if st == 200 or time.monotonic() - t0 > 30:
                break
            time.sleep(0.1)
        assert st == 200, (st, p)
        stalled = ag.wait_log("model_look_stalled", timeout=1)
        assert "does not answer" in stalled["detail"], stalled
        # Every answer comes at once, and vouches for no checkpoint.
        for i in range(5):
            t0 = time.monotonic()
            st, p = payload(ag, "s%d" % i)
            took = time.monotonic() - t0
            assert took < 1.0 * SLOW, took
            assert st == 200 and p.get("checkpoint_sha256") is None, (st, p)
            assert p.get("quantization") == "F16", p  # what the engine says is still signed
        note = json.dumps(p)
        assert "has not ended in 5 s" in note, p
        # Reads of the engine go on while the look waits; none starts a second look.
        reads = len(ag.find_logs("model_look_stalled"))
        t0 = time.monotonic()
        ag.send_signal(signal.SIGTERM)
        rc = ag.wait(10)
        took = time.monotonic() - t0
        print("    a look stuck on a FUSE mount: answers went on, SIGTERM to exit %.2f s" % took)
        assert rc == 0 and took < 5, (rc, took)
        assert reads == 1, ag.find_logs("model_look_stalled")
        assert any("did not end" in l.get("detail", "") for l in ag.find_logs("stopped")), \
            ag.find_logs("stopped")
        eng.stop()
    finally:
        end_stalled_mount(m)


def set_model_path(path_file, path):
    with open(path_file + ".tmp", "w") as f:
        f.write(path)
    os.rename(path_file + ".tmp", path_file)


def swapping_engine(name):
    """A fake engine (one process) whose model can be swapped, and its agent, with model A
    vouched for: (engine, agent, A, C: another local model, the file naming its model). It
    maps no GGUF file: which model it runs is what it reports (a GGUF file mapped and not
    reported withdraws the hash, a check of its own)."""
    a = gguf(name + "-a.gguf", b"model A weights ")
    c = gguf(name + "-c.gguf", b"model C weights ")
    path_file = os.path.join(TMP, name + "-model-path")
    set_model_path(path_file, a)
    port = free_port()
    eng = fake_engine(port, a, "F16", mapped="/etc/passwd", path_file=path_file)
    ag = agent(port, "--quantization", "F16")
    poll_until(lambda: vouched(ag) == sha256_file(a), what="A vouched for")
    return eng, ag, a, c, path_file


def test_a_model_swapped_onto_storage_that_does_not_answer_is_never_vouched_for_by_the_old_hash():
    """The engine (one process) swaps its model from A, hashed and vouched for, to B on storage
    that does not answer: from the first read that names B, no answer carries A's hash, and
    after 5 s the reason says the storage does not answer. When it then swaps to C, a local
    model, C is looked for and vouched for at once, while the look for B still waits."""
    m = stalled_mount()
    if m is None:
        return
    try:
        eng, ag, a, c, path_file = swapping_engine("swap")
        b = os.path.join(m[0], "b.gguf")
        set_model_path(path_file, b)
        seen_b, t0 = 0, time.monotonic()
        while time.monotonic() - t0 < 7:
            st, p = payload(ag, "swap")
            if st == 200 and p.get("model_path") == b:
                seen_b += 1
                assert p.get("checkpoint_sha256") is None, p  # never A's for B
                if "has not ended in 5 s" in json.dumps(p):
                    break
            time.sleep(0.05)
        assert seen_b and "has not ended in 5 s" in json.dumps(p), (seen_b, p)
        set_model_path(path_file, c)
        t1 = time.monotonic()
        poll_until(lambda: vouched(ag) == sha256_file(c), interval=0.05,
                   what="C vouched for while B's look waits")
        print("    %d answers naming B, none with A's hash; C vouched for %.0f ms after the "
              "swap, beside the stalled look" % (seen_b, (time.monotonic() - t1) * 1000))
        assert not ag.find_logs("model_look_ended"), "the look for B cannot have ended"
        ag.stop()
        eng.stop()
    finally:
        end_stalled_mount(m)


def test_a_look_that_ends_after_another_process_took_the_port_is_dropped():
    """A look for the model engine P1 reports waits on its storage; P1 stops listening (alive,
    as an engine shutting down) and P2, which the agent does not recognise, takes the port.
    When the storage answers, what the look found is about P1: it is dropped, and P1's hash is
    never vouched for on P2's behalf."""
    import fuseserve
    try:
        fz = fuseserve.FuseFile(b"GGUF" + b"the model on fuse " * 4096)
    except OSError as e:
        print("    SKIP: cannot mount FUSE here (%s)" % e)
        return
    p1 = p2 = None
    try:
        a = fz.path()
        ha = sha256_file(a)
        port = free_port()
        p1 = fake_engine(port, a, "F16", mapped="/etc/passwd")
        ag = agent(port, "--quantization", "F16")
        poll_until(lambda: vouched(ag) == ha, what="P1's model vouched for")
        fz.hold()
        poll_until(lambda: payload(ag) and ag.find_logs("model_look_stalled"), timeout=20,
                   what="a look waiting on the storage")
        p1.send_signal(signal.SIGUSR1)
        poll_until(lambda: http_refused(port), what="P1 no longer listening")
        p2 = fake_engine(port, a, "F16", mapped="/etc/passwd", unrecognised=True)
        poll_until(lambda: payload(ag) and ag.find_logs("framework_unknown"),
                   what="P2 not recognised")
        assert fz.answer() > 0
        ag.wait_log("model_look_ended", timeout=10)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2:
            st, p = payload(ag, "after")
            assert not (st == 200 and p.get("checkpoint_sha256") == ha), p
            time.sleep(0.02)
        ag.stop()
    finally:
        for e in (p2, p1):
            if e:
                e.stop()
        fz.close()


def test_a_hash_stuck_on_storage_does_not_keep_the_next_model_from_being_measured():
    """A hash of model F waits on storage that stopped answering mid-file (its head is in the
    page cache, so the look for it ended). The engine moves to C, a local model: the stuck hash
    is told to stop, and 5 s later it is left to end by itself (hash_abandoned), so C is hashed
    and vouched for while F's read still waits."""
    import fuseserve
    try:
        fz = fuseserve.FuseFile(b"GGUF" + b"f" * (8 << 20))
    except OSError as e:
        print("    SKIP: cannot mount FUSE here (%s)" % e)
        return
    eng = None
    try:
        f = fz.path()
        with open(f, "rb") as h:
            h.read(4)  # its head in the page cache: the look for it ends
        fz.hold(only=(fuseserve.READ,))
        eng, ag, a, c, path_file = swapping_engine("stuck")
        set_model_path(path_file, f)
        poll_until(lambda: payload(ag) and [l for l in ag.find_logs("hashing")
                                            if l.get("model_path") == f], what="F's hash begun")
        set_model_path(path_file, c)
        t0 = time.monotonic()
        poll_until(lambda: vouched(ag) == sha256_file(c), timeout=20, interval=0.1,
                   what="C vouched for beside F's stuck hash")
        took = time.monotonic() - t0
        print("    C vouched for %.1f s after the move, F's hash left waiting" % took)
        assert ag.find_logs("hash_abandoned"), ag.logs[-10:]
        assert fz.answer() > 0, "F's hash was not waiting on the storage"
        ag.wait_log("hash_abandoned_ended", timeout=10)
        ag.stop()
    finally:
        if eng:
            eng.stop()
        fz.close()


def test_a_report_waiting_for_a_look_is_dropped_when_the_engine_stops_being_recognised():
    """The engine reports F, whose look waits on its storage, then A again (a report that waits
    for that look), then stops being recognised. When the storage answers, neither look may
    put A's hash back: what the engine runs now is unknown."""
    import fuseserve
    try:
        fz = fuseserve.FuseFile(b"GGUF" + b"model F " * 4096)
    except OSError as e:
        print("    SKIP: cannot mount FUSE here (%s)" % e)
        return
    eng = None
    try:
        eng, ag, a, _, path_file = swapping_engine("unrec")
        fz.hold()
        set_model_path(path_file, fz.path())
        poll_until(lambda: payload(ag, "f")[1].get("model_path") == fz.path(), interval=0.05,
                   what="F reported")
        set_model_path(path_file, a)
        poll_until(lambda: payload(ag, "a")[1].get("model_path") == a, interval=0.05,
                   what="A reported again while F's look waits")
        set_model_path(path_file, "-")
        poll_until(lambda: payload(ag, "u") and ag.find_logs("framework_unknown"),
                   interval=0.05, what="the engine no longer recognised")
        assert not ag.find_logs("model_look_stalled"), "the look was to end within 5 s"
        assert fz.answer() > 0, "F's look was not waiting on the storage"
        t0 = time.monotonic()
        while time.monotonic() - t0 < 2:
            st, p = payload(ag, "after")
            assert st != 200 or p.get("checkpoint_sha256") is None, p
            time.sleep(0.02)
        ag.stop()
    finally:
        if eng:
            eng.stop()
        fz.close()


def http_refused(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return False
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False  # reset as its listener closes: refused at the next try


def test_a_look_that_ends_late_measures_as_usual():
    """A look that outlasts 5 s and then ends (the storage answers again) measures as usual:
    the hash is vouched for again, with nothing to restart."""
    m = stalled_mount()
    if m is None:
        return
    try:
        f16 = gguf("late-f16.gguf", b"late weights ")
        port = free_port()
        # The engine names a path through a link it swaps: first into the stalled mount, then,
        # once the agent waits there, to the real file (the storage "answering again" is the
        # aborted connection, after which the link leads elsewhere).
        link = os.path.join(TMP, "late-model.gguf")
        if os.path.lexists(link):
            os.unlink(link)
        os.symlink(os.path.join(m[0], "model.gguf"), link)
        eng = fake_engine(port, link, "F16", mapped=f16)
        ag = agent(port, "--quantization", "F16")
        ag.wait_log("model_look_stalled", timeout=30)
        os.unlink(link)
        os.symlink(f16, link)
        end_stalled_mount(m)
        m = None
        ended = ag.wait_log("model_look_ended", timeout=10)
        assert ended["after_ms"] >= 5000, ended
        poll_until(lambda: vouched(ag) == sha256_file(f16), what="the model measured after all")
        ag.stop()
        eng.stop()
    finally:
        if m is not None:
            end_stalled_mount(m)


def test_what_the_engine_cannot_see_is_not_looked_at_for_it():
    """The agent looks for the model the engine names as the engine's user too: an engine
    naming a path inside a folder it cannot enter learns nothing of what is there (whether a
    file exists, is a GGUF file, or a folder holds a config.json) from the agent's answer."""
    if not can_run_an_engine_as_nobody():
        return
    home = tempfile.mkdtemp(prefix="detproxy-engine-user-", dir="/tmp")
    closed = os.path.join(TMP, "closed")
    os.makedirs(closed, mode=0o700, exist_ok=True)
    with open(os.path.join(closed, "present.gguf"), "wb") as f:
        f.write(b"GGUF" + b"w" * 64)
    os.makedirs(os.path.join(closed, "hf"), exist_ok=True)
    with open(os.path.join(closed, "hf", "config.json"), "w") as f:
        f.write("{}")
    try:
        os.chmod(home, 0o755)
        weights = os.path.join(home, "w.gguf")
        with open(weights, "wb") as f:
            f.write(b"GGUF" + b"x" * 64)
        os.chmod(weights, 0o644)
        said = {}
        for name in ("present.gguf", "absent.gguf", "hf", "absent-folder"):
            named = os.path.join(closed, name)
            port = free_port()
            eng = fake_engine(port, named, "F16", mapped=weights, user=65534, home=home)
            ag = agent(port, "--quantization", "F16")

            def settled():
                """What the agent says once it has read the engine: the payload's reason, or
                a hash's failure (what a look as root let it start)."""
                st, p = payload(ag)
                if st == 200:
                    return p["unattested"].get("checkpoint_sha256") or p["checkpoint_sha256"]
                return st == 503 and p["error"]["code"] == "hash_failed" and p["error"]["message"]

            said[name] = re.sub(r"/proc/\d+/", "/proc/PID/",
                                poll_until(settled, what="the agent's answer").replace(named, "PATH"))
            ag.stop()
            eng.stop()
        assert len(set(said.values())) == 1, said
    finally:
        shutil.rmtree(home, ignore_errors=True)


def test_an_engine_that_maps_another_file_than_it_reports_is_not_vouched_for():
    reported = gguf("tiny-f16.gguf", b"f16 weights ")
    really = gguf("tiny-q4_0.gguf", b"q4_0 weights")
    port = free_port()
    eng = fake_engine(port, reported, "F16", mapped=really)
    ag = agent(port)

    def withdrawn():
        st, p = payload(ag)
        return (st == 200 and p["checkpoint_sha256"] is None and
                p.get("unattested", {}).get("checkpoint_sha256"))

    note = poll_until(withdrawn, what="checkpoint withdrawn")
    assert note == ("the engine reports %s, but its process has %s open or mapped instead" % (
        reported, really)), note
    ag.stop()
    eng.stop()


# ---- detproxy check ----------------------------------------------------------------------


def test_check_warns_about_a_pool_nothing_measures():
    sim = start_sim("--model", MODEL)
    _, pub = keygen("pipeline")
    d = tempfile.mkdtemp(dir=TMP)

    def check(manifest, attest):
        p = pool("p", [MODEL], [sim], manifest=manifest)
        p["replicas"][0]["attest"] = attest
        cfg = {"attestation": {"require_signature": attest["source"] == "agent",
                               "trusted_keys": [pub]} if attest["source"] == "agent" else {},
               "pools": [p]}
        return run_cmd([DETPROXY_BIN, "check", "--strict", "-c", write_config(cfg, d)])
    agent_src = {"source": "agent", "url": "http://127.0.0.1:9101/attestation"}
    rc, out, err = check({"model": MODEL, "quantization": "awq"}, agent_src)
    assert rc == 1 and "pools[0].replicas[0].attest: an agent measures its engine only when " \
        "started with --framework-url" in err and "--strict: 1 warning" in err, (rc, err)
    # A canary checks what the engine runs: no warning.
    rc, out, err = check({"model": MODEL, "quantization": "awq",
                          "canary": {"prompt": "Count: one, two,", "max_tokens": 8,
                                     "expected_sha256": "0" * 64}}, agent_src)
    assert rc == 0 and err == "", (rc, err)
    # A native adapter reads the engine's own report: no warning.
    rc, out, err = check({"model": MODEL, "framework": {"name": "vllm"}}, {"source": "vllm"})
    assert rc == 0 and err == "", (rc, err)
    sim.stop()


if __name__ == "__main__":
    try:
        run_tests(globals())
    finally:
        shutil.rmtree(TMP, ignore_errors=True)
