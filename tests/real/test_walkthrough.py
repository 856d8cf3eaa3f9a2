"""The operator walk-through, docs/walkthrough-llamacpp.md, run as written against real
llama.cpp: every fenced block marked `sh walkthrough=NAME` is read from the page and run by bash
(-e, -u, pipefail) in one fresh working folder, in the page's order, with only the ports
replaced by free ones. The page's commands are the test's commands, so the page cannot drift
from the program. After each block the test checks what that step promises (admitted replicas,
forced sampling, the Q8_0 replica out of rotation with both quantizations named and no wrong
answer served, the rollout verdicts, the relayed diagnosis, all_replicas_drained, a verified
anchored audit trail that replays).

`detproxy` and `llama-server` are found on PATH through two small wrappers that note the pid of
every process a block starts in the background (llama-server runs from scripts/real-engine.sh's
sid chroot), so that the test stops exactly those at the end. `models/` links the chroot's
generated GGUF files.

Each block's output is written to $DP_WALK_OUT/NAME.txt when that is set (the page's output
blocks are trimmed copies of it). Measured numbers are printed as `measured: {...}` lines.

Uses scripts/real-engine.sh (DETPROXY_REAL_ENGINE overrides the path); prints SKIPPED and exits
77 when it is missing or the Debian archive cannot be reached."""

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from realutil import engine, require_engine, skip  # noqa: E402
from harness import DETPROXY_BIN, SLOW, SOURCE_DIR, free_port, run_tests  # noqa: E402

DOC = os.path.join(SOURCE_DIR, "docs", "walkthrough-llamacpp.md")
# The ports the page uses, each replaced by a free one.
DOC_PORTS = (8080, 9901, 8081, 8082, 8083, 8084, 9101, 9102)
# The blocks, in the page's order: a missing, renamed or reordered one fails the test.
STEPS = ("config", "servers", "canary", "run", "requests", "swap", "swap-back", "rollout",
         "diagnose", "reload", "audit", "stop")
BLOCK = re.compile(r"^```sh walkthrough=([a-z0-9-]+)\n(.*?)^```$", re.S | re.M)

if not shutil.which("jq"):
    skip("jq is not installed (the walk-through's commands use it)")
require_engine()
INFO = dict(l.split("=", 1) for l in engine("info").stdout.splitlines())
ROOT = INFO["root"]
SHA = {q: INFO["model_" + q].split()[1] for q in ("f16", "q8_0")}

WORK = tempfile.mkdtemp(prefix="detproxy-real-walk-")
PIDS = os.path.join(WORK, ".pids")
OUT = os.environ.get("DP_WALK_OUT")
PORT = {p: free_port() for p in DOC_PORTS}


def blocks():
    """(name, script) of each walkthrough block; each is followed by the output it printed."""
    with open(DOC) as f:
        text = f.read()
    found = []
    for m in BLOCK.finditer(text):
        assert text[m.end():].startswith("\n\n```text\n"), \
            "walk-through block %s is not followed by its output (a text block)" % m.group(1)
        found.append((m.group(1), m.group(2)))
    return found


def substitute(text):
    """The page's ports -> this run's, only where a port stands (after ':' or '--port ')."""
    return re.sub(r"(:|--port )(%s)\b" % "|".join(str(p) for p in DOC_PORTS),
                  lambda m: m.group(1) + str(PORT[int(m.group(2))]), text)


def wrappers():
    """bin/detproxy and bin/llama-server: note the pid, then become the real program."""
    bindir = os.path.join(WORK, ".bin")
    os.makedirs(bindir)
    for name, target in (("detproxy", DETPROXY_BIN),
                         ("llama-server", "chroot %s llama-server" % ROOT)):
        path = os.path.join(bindir, name)
        with open(path, "w") as f:
            f.write('#!/bin/sh\necho "$$ %s" >> %s\nexec %s "$@"\n' % (name, PIDS, target))
        os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    os.symlink(os.path.join(ROOT, "models"), os.path.join(WORK, "models"))
    return bindir


def stop_started():
    """Stop every process a block started, by pid, while it is still that program."""
    if not os.path.exists(PIDS):
        return
    with open(PIDS) as f:
        started = [l.split() for l in f if l.strip()]
    for pid, name in started:
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if name in cmd:
            try:
                os.kill(int(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass


def run_block(name, script, env):
    t0 = time.monotonic()
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=WORK, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=180 * SLOW)
    took = time.monotonic() - t0
    print("---- %s (%.1f s, rc %d)\n%s" % (name, took, r.returncode, r.stdout), flush=True)
    if OUT:
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, name + ".txt"), "w") as f:
            f.write(r.stdout)
    assert r.returncode == 0, "walk-through step %s failed (rc %d):\n%s" % (
        name, r.returncode, r.stdout[-3000:])
    return r.stdout


def replicas():
    r = subprocess.run(["curl", "-s", "http://127.0.0.1:%d/admin/replicas" % PORT[9901]],
                       capture_output=True, text=True, timeout=10)
    return {x["name"]: x for x in json.loads(r.stdout)["replicas"]}


def test_the_walkthrough_runs_as_written():
    t_start = time.monotonic()
    found = blocks()
    assert tuple(n for n, _ in found) == STEPS, [n for n, _ in found]
    env = dict(os.environ, PATH=wrappers() + os.pathsep + os.environ["PATH"])
    measured = {}
    try:
        for name, script in found:
            o = run_block(name, substitute(script), env)
            check = CHECKS.get(name)
            if check:
                check(o, measured)
        measured["total_s"] = round(time.monotonic() - t_start, 1)
        print("measured: " + json.dumps(measured), flush=True)
    finally:
        stop_started()


def check_config(o, m):
    assert "canary.expected_sha256: not recorded" in o, o


def check_servers(o, m):
    assert '"model_ftype": "F16"' in o, o
    assert '"checkpoint_sha256": "%s"' % SHA["f16"] in o, o
    assert o.rstrip().endswith(SHA["f16"]), o


def check_canary(o, m):
    assert "expected_sha256: " in o, o
    assert "matches the pinned" in o.splitlines()[-1], o


def check_run(o, m):
    reps = replicas()
    assert all(reps[r]["state"] == "admitted" for r in ("r1", "r2")), reps


def check_requests(o, m):
    lines = o.splitlines()
    sdk = json.loads(lines[0])  # the dummy-key client, served by the catch-all
    assert isinstance(sdk["text"], str) and sdk["model"], sdk
    assert "x-detproxy-tenant: compliance" in o and "x-detproxy-seed: 1234" in o, o
    audit = json.loads(lines[-1])
    assert audit["tenant"] == "compliance" and audit["seed"] == 1234, audit
    forced = {p["param"]: p for p in audit["params"]}
    assert forced["temperature"]["before"] == 1.5 and forced["temperature"]["after"] == 0, audit
    assert forced["seed"]["before"] == 99 and forced["seed"]["after"] == 1234, audit


def check_swap(o, m):
    rep = replicas()["r2"]
    reasons = rep["reasons"]
    assert rep["state"] == "rejected", rep
    assert "agent: --quantization F16 contradicts the engine's Q8_0" in reasons, reasons
    assert "quantization mismatch: got Q8_0 want F16" in reasons, reasons
    assert "checkpoint_sha256 mismatch: got %s.. want %s.." % (
        SHA["q8_0"][:8], SHA["f16"][:8]) in reasons, reasons
    ejected = float(re.search(r"out of rotation ([0-9.]+) s", o).group(1))
    # One interval for the agent to see the new process and measure it, one for the proxy's
    # next check: three leave room on a loaded machine.
    assert ejected <= 3.0 * SLOW, ejected
    with open(os.path.join(WORK, "swap-traffic.txt")) as f:
        rows = [l.rstrip("\n").split(" ", 2) for l in f if l.strip()]
    ok = [r for r in rows if r[0] == "200"]
    texts = {r[2] for r in ok}
    # Every 200 is the F16 answer: the one text served before the swap, by both replicas.
    first = ok[0][2]
    wrong = [r for r in ok if r[2] != first]
    m["q8_0_listening_to_rejected_s"] = ejected
    m["swap_requests"] = len(rows)
    m["swap_answers_200"] = len(ok)
    m["swap_answers_wrong"] = len(wrong)
    m["swap_client_errors"] = len(rows) - len(ok)
    assert len(ok) >= 10, rows[:10]
    assert not wrong and len(texts) == 1, (texts, wrong[:5])


def check_swap_back(o, m):
    assert replicas()["r2"]["state"] == "admitted"


def check_rollout(o, m):
    r = subprocess.run(["curl", "-s", "http://127.0.0.1:%d/admin/rollouts" % PORT[9901]],
                       capture_output=True, text=True, timeout=10)
    got = {x["candidate"]: x for x in json.loads(r.stdout)["rollouts"]}
    m["rollout"] = {c: {k: got[c][k] for k in ("verdict", "samples", "exact_match_rate")}
                    for c in got}
    assert got["same-f16"]["verdict"] == "equivalent", got["same-f16"]
    assert got["q8"]["verdict"] == "diverges", got["q8"]
    assert "     40 200" in o, o
    assert "exit 1" in o and "\nexit 0" in o and "--candidate q8: exit 1" in o, o


def check_diagnose(o, m):
    with open(os.path.join(WORK, "diagnose.err")) as f:
        err = f.read()
    assert "directly to the replicas" not in err, err
    relayed = int(o.strip().splitlines()[-1])
    m["diagnose_relayed_requests"] = relayed
    assert relayed > 0, o
    assert "verdict:" in o, o


def check_reload(o, m):
    assert "all_replicas_drained" in o and "HTTP 503" in o, o
    assert "readyz 503" in o and "after enable: HTTP 200" in o, o


def check_audit(o, m):
    assert ": ok:" in o and "signatures verified" in o and "stored bodies checked" in o, o
    assert re.search(r"anchor seq \d+: ok", o), o
    assert "\nexit 0" in o, o
    summary = re.search(r"(\d+) reproduced", o)
    m["replay_reproduced"] = int(summary.group(1)) if summary else None
    assert summary and int(summary.group(1)) >= 41, o


def check_stop(o, m):
    assert '"reason":"shutdown"' in o, o


CHECKS = {"config": check_config, "servers": check_servers, "canary": check_canary,
          "run": check_run, "requests": check_requests, "swap": check_swap,
          "swap-back": check_swap_back, "rollout": check_rollout, "diagnose": check_diagnose,
          "reload": check_reload, "audit": check_audit, "stop": check_stop}


if __name__ == "__main__":
    try:
        run_tests(globals())
    finally:
        stop_started()
