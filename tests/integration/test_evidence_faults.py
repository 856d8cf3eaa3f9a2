"""Evidence that survives faults (docs/operations.md, "Evidence"): one writer per audit trail, a
torn tail repaired at restart, anchors that catch a file cut back, `audit verify`'s exit codes,
and `replay` from the config, the audit file and the store alone."""

import fcntl
import hashlib
import json
import os
import re
import select
import shutil
import signal
import tempfile
import time
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from harness import (DETPROXY_BIN, SLOW, free_port, get_json, http, poll_until, post_json,
                     run_cmd, run_tests, start_process, start_sim)
from proxyutil import metric, pool, start_proxy, write_config
from test_evidence import AUTH, POLICY, complete, lines, setup, verify


def test_a_second_instance_refuses_to_start_and_writes_nothing():
    sim, px = setup(checkpoint_lines=100)
    complete(px, "one")
    poll_until(lambda: os.path.getsize(px.audit_path) > 0, what="the audit line")
    before = open(px.audit_path, "rb").read()
    rc, out, err = run_cmd([DETPROXY_BIN, "run", "-c", px.config_path], timeout=10)
    assert rc == 3, out + err
    assert "audit_locked" in err and "pid %d" % px.popen.pid in err, err
    assert open(px.audit_path, "rb").read() == before
    complete(px, "two")  # the first one still serves, alone
    px.stop()
    assert verify(px)[0] == 0


def test_a_second_instance_on_the_client_port_refuses_to_start():
    # No audit trail, admin on port 0: only the client port says the config is in use.
    sim = start_sim("--model", "m1")
    port = free_port()
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], listen="127.0.0.1:%d" % port)
    rc, out, err = run_cmd([DETPROXY_BIN, "run", "-c", px.config_path], timeout=10)
    assert rc == 3 and "address already in use" in err, out + err
    px.stop()


def test_kill_mid_load_then_a_torn_tail_is_repaired_at_restart():
    sim, px = setup(checkpoint_lines=5)
    stop = threading.Event()

    def load():
        i = 0
        while not stop.is_set():
            try:
                post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "l%d" % i,
                                                       "max_tokens": 4}, headers=AUTH, timeout=5)
            except Exception:
                return
            i += 1
    ts = [threading.Thread(target=load) for _ in range(4)]
    for t in ts:
        t.start()
    poll_until(lambda: len(open(px.audit_path).readlines()) >= 20, what="lines under load")
    px.kill()
    stop.set()
    for t in ts:
        t.join()
    # What a kill inside write(2) leaves: part of a line, no newline. The kill itself may have
    # left one already (Linux stops a write to a file between pages when SIGKILL arrives): the
    # torn tail is everything after the last complete line.
    frag = b'{"time":"2026-01-01T00:00:00.000Z","request_id":"torn'
    with open(px.audit_path, "ab") as f:
        f.write(frag)
    raw = open(px.audit_path, "rb").read()
    tail_at = raw.rfind(b"\n") + 1
    tail = raw[tail_at:]
    rc, out, _ = verify(px)
    assert rc == 1 and "incomplete last line" in out, out
    px2 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
    complete(px2, "after the crash")
    px2.stop()
    torn = [f for f in os.listdir(px.dir) if f.startswith("audit.jsonl.torn-")]
    assert len(torn) == 1, os.listdir(px.dir)
    assert open(os.path.join(px.dir, torn[0]), "rb").read() == raw
    rep = lines(px.audit_path)[0]["repair"]
    assert rep["torn_offset"] == tail_at and rep["torn_bytes"] == len(tail), rep
    assert rep["torn_sha256"] == hashlib.sha256(tail).hexdigest(), rep
    assert any(l.get("msg") == "audit_torn_tail" for l in px2.logs)
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", os.path.join(px.dir, torn[0]),
                          px.audit_path, "--pubkey", px.pub, "--store", px.store])
    assert rc == 0, out
    assert "repair: starts after the torn last line" in out and "checked" in out, out
    # the repair line must match the fragment: another fragment is a break
    with open(os.path.join(px.dir, torn[0]), "ab") as f:
        f.write(b"x")
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", os.path.join(px.dir, torn[0]),
                          px.audit_path, "--pubkey", px.pub])
    assert rc == 1 and "repair: names" in out, out


def test_anchor_catches_a_file_cut_back_to_an_earlier_checkpoint():
    sim, px = setup(checkpoint_lines=2)
    for i in range(6):
        complete(px, "a%d" % i)
    poll_until(lambda: get_json(px.admin_port, "/admin/audit")["anchor"] is not None,
               what="an anchor")
    poll_until(lambda: get_json(px.admin_port, "/admin/audit")["anchor"]["seq"] == 3,
               what="checkpoint 3")
    st = get_json(px.admin_port, "/admin/audit")
    assert st["writable"] is True and st["audit_fail"] == "closed", st
    anchor = st["anchor"]
    metrics = http("GET", px.admin_port, "/metrics").body.decode()
    assert "detproxy_audit_checkpoint_seq 3" in metrics, metrics
    assert 'sha256="%s"' % anchor["sha256"] in metrics
    logged = [l for l in px.logs if l.get("msg") == "audit_checkpoint"]
    assert logged and logged[-1]["seq"] == 3 and logged[-1]["sha256"] == anchor["sha256"], logged
    px.stop()
    got = lines(px.audit_path)
    cps = [l["checkpoint"]["seq"] for l in got if "checkpoint" in l]
    assert cps == [1, 2, 3, 4], cps  # the last one at shutdown
    raw = open(px.audit_path, "rb").read().split(b"\n")
    assert hashlib.sha256(raw[8]).hexdigest() == anchor["sha256"]
    a = "%d:%s" % (anchor["seq"], anchor["sha256"])
    rc, out, _ = verify(px, None, "--anchor", a)
    assert rc == 0 and "anchor seq 3: ok" in out, out
    # Cut back to checkpoint 2: the chain still verifies, the anchor does not.
    open(px.audit_path, "wb").write(b"\n".join(raw[:6]) + b"\n")
    rc, out, _ = verify(px)
    assert rc == 0, out
    rc, out, _ = verify(px, None, "--anchor", a)
    assert rc == 1 and "anchor seq 3: not in the chain: it ends at checkpoint seq 2" in out, out
    # The oldest lines removed (a file starting after checkpoint 1): reported, and caught by an
    # older anchor.
    first = "1:" + hashlib.sha256(raw[2]).hexdigest()
    open(px.audit_path, "wb").write(b"\n".join(raw[3:-1]) + b"\n")
    rc, out, _ = verify(px)
    assert rc == 0 and "the chain does not start here" in out, out
    rc, out, _ = verify(px, None, "--anchor", first)
    assert rc == 1 and "older files were removed" in out, out
    # A rewritten history under the anchor: its hash no longer matches.
    rc, out, _ = verify(px, None, "--anchor", "3:" + "0" * 64)
    assert rc == 1 and "history up to it was rewritten" in out, out


def checkpoint_info(px):
    """(seq, sha256) of every detproxy_audit_checkpoint_info series on /metrics."""
    out = []
    for line in http("GET", px.admin_port, "/metrics").text.splitlines():
        if line.startswith("detproxy_audit_checkpoint_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
            assert line.endswith("} 1") and sorted(labels) == ["seq", "sha256"], line
            out.append((labels.get("seq"), labels.get("sha256")))
    return out


def latest_checkpoint(path):
    """(seq, SHA-256 of the line) of the last complete checkpoint line in an audit file, or
    None before the first."""
    with open(path, "rb") as f:
        raw = [l for l in f.read().split(b"\n")[:-1] if b'"checkpoint"' in l]
    if not raw:
        return None
    return str(json.loads(raw[-1])["checkpoint"]["seq"]), hashlib.sha256(raw[-1]).hexdigest()


def test_the_checkpoint_info_metric_names_the_latest_checkpoint_line():
    """docs/operations.md, "Anchors": detproxy_audit_checkpoint_info{seq,sha256} is one series,
    the seq and SHA-256 of the latest checkpoint line in the audit file, moved to each new one."""
    sim, px = setup(checkpoint_lines=2)
    assert checkpoint_info(px) == []  # no checkpoint yet
    for seq in (1, 2, 3):
        complete(px, "c%d" % (2 * seq))
        complete(px, "c%d" % (2 * seq + 1))
        poll_until(lambda: (latest_checkpoint(px.audit_path) or ("0",))[0] == str(seq),
                   what="checkpoint %d in the file" % seq)
        want = latest_checkpoint(px.audit_path)
        poll_until(lambda: checkpoint_info(px) == [want],
                   what="the info metric at checkpoint %d" % seq)
    assert want == (str(get_json(px.admin_port, "/admin/audit")["anchor"]["seq"]),
                    get_json(px.admin_port, "/admin/audit")["anchor"]["sha256"])
    px.stop()


def test_verify_without_pubkey_says_signatures_not_checked():
    sim, px = setup(checkpoint_lines=100)
    complete(px, "x")
    px.stop()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path])
    assert rc == 4 and "chain ok, signatures NOT checked" in out, out
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--no-signatures"])
    assert rc == 0, out
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--no-signatures",
                            "--pubkey", px.pub])
    assert rc == 2, out + err
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--anchor", "x"])
    assert rc == 2, out + err


def test_replay_standalone_from_a_copied_config():
    sim1 = start_sim("--model", "m1")
    sim2 = start_sim("--model", "m1")
    _, first = setup(checkpoint_lines=100)
    first.stop()
    cfg = json.load(open(first.config_path))
    cfg["pools"] = [pool("p", ["m1"], [sim1, sim2])]
    px = start_proxy(config=cfg, directory=first.dir)
    px.dir = first.dir
    ids = [complete(px, "q%d" % i) for i in range(6)]
    px.stop()
    got = [l for l in lines(os.path.join(px.dir, "audit.jsonl")) if "request_id" in l]
    answered = {l["request_id"]: l["replica"] for l in got}
    assert set(answered.values()) == {"r1", "r2"}, answered
    # The auditor's sandbox: no running proxy, the production paths do not exist there.
    box = os.path.join(px.dir, "sandbox")
    os.mkdir(box)
    shutil.copy(os.path.join(px.dir, "audit.jsonl"), box)
    shutil.copytree(os.path.join(px.dir, "store"), os.path.join(box, "store"))
    cfg["log"] = dict(cfg["log"], audit_path="/nonexistent/detproxy/audit.jsonl",
                      audit_store="/nonexistent/detproxy/store",
                      audit_signing_key="/nonexistent/audit.key.pem")
    path = write_config(cfg, box)
    rc, out, err = run_cmd([DETPROXY_BIN, "replay", "-c", path, "--audit",
                            os.path.join(box, "audit.jsonl"), "--store",
                            os.path.join(box, "store"), "--all", "--json"])
    assert rc == 0, out + err
    doc = json.loads(out)
    assert doc["summary"]["reproduced"] == 6, doc
    for r in doc["results"]:
        assert r["replica"] == answered[r["request_id"]], (r, answered)


class _Fake(BaseHTTPRequestHandler):
    body = b""
    ctype = "text/html"

    def _answer(self):
        self.send_response(200)
        self.send_header("content-type", self.ctype)
        self.send_header("content-length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_GET = do_POST = _answer

    def log_message(self, *a):
        pass


def _fake_admin(body, ctype="application/json"):
    h = type("H", (_Fake,), {"body": body, "ctype": ctype})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), h)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_garbage_admin_answers_exit_3_and_remote_text_is_escaped():
    sim, px = setup(checkpoint_lines=100)
    complete(px, "x")
    px.stop()
    html = _fake_admin(b"<html>not an admin api</html>", "text/html")
    rc, out, err = run_cmd([DETPROXY_BIN, "replay", "-c", px.config_path, "--audit",
                            px.audit_path, "--all", "--admin",
                            "127.0.0.1:%d" % html.server_address[1]])
    assert rc == 3 and "not the admin API's" in err, out + err
    rc, out, err = run_cmd([DETPROXY_BIN, "rollout", "report", "-c", px.config_path, "--admin",
                            "127.0.0.1:%d" % html.server_address[1]])
    assert rc == 3, out + err
    for doc in ({"rollouts": "x"}, {"nope": []}):
        srv = _fake_admin(json.dumps(doc).encode())
        rc, out, err = run_cmd([DETPROXY_BIN, "rollout", "report", "-c", px.config_path,
                                "--admin", "127.0.0.1:%d" % srv.server_address[1]])
        assert rc == 3 and "rollouts array" in err, out + err
    # A hostile answer: a rollout of pools the config does not have, and ESC sequences.
    forged = {"rollouts": [{"pool": "p", "candidate": "evil\u001b[2J", "verdict": "diverges"},
                           {"pool": "ghost", "candidate": "c", "verdict": "diverges"}]}
    srv = _fake_admin(json.dumps(forged).encode())
    rc, out, err = run_cmd([DETPROXY_BIN, "rollout", "report", "-c", px.config_path, "--admin",
                            "127.0.0.1:%d" % srv.server_address[1]])
    assert rc == 0 and "\x1b" not in out and "ghost" not in out, out + err
    bad = _fake_admin(b"\x1b[31mFAKE: all candidates equivalent\x1b[0m", "text/plain")
    bad.RequestHandlerClass.do_GET = lambda self: (self.send_response(500), self.send_header(
        "content-length", str(len(self.body))), self.end_headers(), self.wfile.write(self.body))
    rc, out, err = run_cmd([DETPROXY_BIN, "rollout", "report", "-c", px.config_path, "--admin",
                            "127.0.0.1:%d" % bad.server_address[1]])
    assert rc == 3 and "\x1b" not in err and "\\x1b[31mFAKE" in err, err



def test_rollout_report_gates_one_candidate():
    sims = [start_sim("--model", "m1") for _ in range(3)]
    cfg = {"pools": [pool("p", ["m1"], [sims[0]], candidates=[{"pool": "c1", "rate": 0.5},
                                                            {"pool": "c2", "rate": 0.5}]),
                     pool("c1", ["m1"], [sims[1]]), pool("c2", ["m1"], [sims[2]])]}
    path = write_config(dict(cfg, listen="127.0.0.1:0", admin_listen="127.0.0.1:0"))
    srv = _fake_admin(json.dumps({"rollouts": [
        {"pool": "p", "candidate": "c1", "verdict": "diverges", "samples": 30},
        {"pool": "p", "candidate": "c2", "verdict": "equivalent", "samples": 30}]}).encode())
    admin = "127.0.0.1:%d" % srv.server_address[1]

    def report(*a):
        return run_cmd([DETPROXY_BIN, "rollout", "report", "-c", path, "--admin", admin] + list(a))
    rc, out, err = report()
    assert rc == 1 and "c1" in out and "c2" in out, out + err
    rc, out, err = report("--candidate", "c2")
    assert rc == 0 and "c2" in out and "c1" not in out, out + err
    rc, out, err = report("--candidate", "c1", "--json")
    assert rc == 1 and [r["candidate"] for r in json.loads(out)["rollouts"]] == ["c1"], out
    rc, out, err = report("--candidate", "nope")
    assert rc == 2, out + err


class _Drip(BaseHTTPRequestHandler):
    """A replica that answers /v1/models at once and completions one byte a second."""
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        b = json.dumps({"object": "list", "data": [{"id": "m1", "object": "model"}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(b)))
        self.end_headers()
        self.wfile.write(b)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", "1000")
        self.end_headers()
        try:
            for _ in range(1000):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(1)
        except OSError:
            pass

    def log_message(self, *a):
        pass


def test_replay_has_an_overall_deadline():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    d = tempfile.mkdtemp(prefix="detproxy-drip-")
    os.mkdir(os.path.join(d, "store"))
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "pools": [{"name": "p", "models": ["m1"], "replicas": [
               {"name": "r1", "url": "http://127.0.0.1:%d" % srv.server_address[1]}]}],
           "log": {"audit_path": os.path.join(d, "audit.jsonl"),
                   "audit_store": os.path.join(d, "store")}}
    px = start_proxy(config=cfg, directory=d)
    fp = get_json(px.admin_port, "/admin/replicas")["replicas"][0]["fingerprint"]
    px.stop()
    body, old = b'{"model":"m1","prompt":"x","temperature":0}', b'{"choices":[{"text":"a"}]}'
    for b in (body, old):
        open(os.path.join(d, "store", hashlib.sha256(b).hexdigest()), "wb").write(b)
    line = {"request_id": "drip1", "route": "/v1/completions", "fingerprint": fp, "pool": "p",
            "replica": "r1", "temperature": 0,
            "forwarded_body_sha256": hashlib.sha256(body).hexdigest(),
            "response_body_sha256": hashlib.sha256(old).hexdigest()}
    open(os.path.join(d, "audit.jsonl"), "w").write(json.dumps(line) + "\n")
    t0 = time.monotonic()
    rc, out, err = run_cmd([DETPROXY_BIN, "replay", "-c", px.config_path, "--audit",
                            os.path.join(d, "audit.jsonl"), "--all", "--timeout", "3"],
                           timeout=30)
    took = time.monotonic() - t0
    assert rc == 3 and "--timeout passed" in out, out + err
    assert took < 10, took
    srv.shutdown()


def test_a_second_instance_through_a_symlink_or_a_hard_link_is_refused():
    """One writer per audit trail, whatever the name: a second instance whose audit_path is a
    symlink to the live file (its store another folder) refuses to start, and the chain stays
    whole."""
    d = tempfile.mkdtemp(prefix="detproxy-lock-")
    os.mkdir(os.path.join(d, "store"))
    os.mkdir(os.path.join(d, "store2"))
    sim = start_sim("--model", "m1")
    policy = {"tenants": [{"name": "t", "match": {"any": True}, "audit": True}]}
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=policy, directory=d,
                     log={"level": "info", "audit_path": "audit.jsonl", "audit_store": "store"})
    for i in range(2):
        assert post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "a%d" % i}).status == 200
    os.symlink(os.path.join(d, "audit.jsonl"), os.path.join(d, "link.jsonl"))
    other = tempfile.mkdtemp(prefix="detproxy-lock-")
    os.link(os.path.join(d, "audit.jsonl"), os.path.join(other, "hard.jsonl"))
    os.mkdir(os.path.join(other, "store3"))
    second = None
    for path, store in ((os.path.join(d, "link.jsonl"), os.path.join(d, "store2")),
                        (os.path.join(other, "hard.jsonl"), os.path.join(other, "store3"))):
        cfg = json.load(open(px.config_path))
        cfg["log"]["audit_path"] = path
        cfg["log"]["audit_store"] = store
        try:
            second = start_proxy(config=cfg, directory=tempfile.mkdtemp(prefix="detproxy-lock-"),
                                 timeout=5)
        except Exception as e:  # noqa: BLE001 (refusing to start is the expected behaviour)
            assert "in use by another detproxy" in str(e), e
        if second is not None:
            break
    if second is not None:
        for i in range(2):
            post_json(second.port, "/v1/completions", {"model": "m1", "prompt": "b%d" % i})
        post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "c"})
        second.stop()
    px.stop()
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", os.path.join(d, "audit.jsonl"),
                            "--no-signatures"])
    assert second is None, "a second instance ran on the live audit file: verify says " + out
    assert rc == 0, out + err



def crash_with_a_torn_tail(px, frag):
    """SIGKILL px, then append what a kill inside write(2) leaves: part of a line."""
    px.kill()
    with open(px.audit_path, "ab") as f:
        f.write(frag)


def test_a_torn_tail_set_aside_never_replaces_another():
    """Two repairs in one second (a crash loop under Restart=) must not share a set-aside name:
    every PATH.torn-TIME name the repairs could draw already exists (as it would after an
    earlier repair that second), and each repair picks a free name, PATH.torn-TIME.N, leaves
    the others as they were, and names the file it used in its repair line and its log."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "before the crashes")
    poll_until(lambda: os.path.getsize(px.audit_path) > 0, what="the audit line")
    now = int(time.time())
    taken = {}
    for t in range(now - 2, now + 120):
        name = "audit.jsonl.torn-" + time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))
        taken[name] = b"an earlier set-aside file %d\n" % t
        with open(os.path.join(px.dir, name), "wb") as f:
            f.write(taken[name])
    frag = b'{"time":"2026-01-01T00:00:00.000Z","request_id":"torn'
    d, path, set_aside = px.dir, px.audit_path, []
    for i in range(2):
        crash_with_a_torn_tail(px, frag)
        raw = open(path, "rb").read()
        px = start_proxy(config=json.load(open(px.config_path)), directory=d)
        px.audit_path = path
        complete(px, "after crash %d" % i)
        poll_until(lambda: len(open(path).readlines()) >= 2, what="the new line")
        logged = px.wait_log("audit_torn_tail")["set_aside"]
        name = os.path.basename(logged)
        assert os.path.realpath(logged) == os.path.realpath(os.path.join(d, name)), logged
        assert name not in taken and name not in set_aside, (name, set_aside)
        assert re.fullmatch(r"audit\.jsonl\.torn-\d{8}T\d{6}Z\.\d+", name), name
        assert open(logged, "rb").read() == raw, name
        assert lines(path)[0]["repair"]["file"] == name
        set_aside.append(name)
    px.stop()
    for name, body in taken.items():
        assert open(os.path.join(d, name), "rb").read() == body, name
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify"] +
                         [os.path.join(d, n) for n in set_aside] +
                         [path, "--pubkey", os.path.join(d, "audit.pub.pem"),
                          "--store", os.path.join(d, "store")])
    assert rc == 0, out


def test_a_torn_first_write_into_a_rotated_file_continues_the_chain_of_the_old_one():
    """A crash during the first write into a file logrotate left empty: the file holds only a
    fragment. Its repair line chains from the head the lock file names (the rotated file's last
    line), as a line into an empty file would, not from genesis."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "before the rotation")
    px.stop()
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    with open(px.audit_path, "wb") as f:
        f.write(b'{"time":"2026-01-01T00:00:00.000Z","request_id":"torn')
    px2 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
    complete(px2, "after the crash")
    px2.stop()
    torn = [f for f in os.listdir(px.dir) if f.startswith("audit.jsonl.torn-")]
    assert len(torn) == 1, os.listdir(px.dir)
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, os.path.join(px.dir, torn[0]),
                          px.audit_path, "--pubkey", px.pub, "--store", px.store])
    assert rc == 0, out


def test_a_crash_before_a_rotated_files_first_checkpoint_keeps_the_seq_going():
    """A rotation (its reopen checkpoint closes the old file), a line into the new file, then a
    crash before the new file has a checkpoint of its own: the restart resumes the new file's
    chain and takes the trail's checkpoint seq from the lock file's head, so the next
    checkpoint follows the old file's last instead of starting at 1 again."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "before the rotation")
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    hup(px)
    complete(px, "into the new file")
    poll_until(lambda: os.path.getsize(px.audit_path) > 0, what="the line in the new file")
    px.kill()
    last = [l["checkpoint"] for l in lines(rotated) if "checkpoint" in l][-1]
    assert last["reason"] == "reopen", last
    px2 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
    complete(px2, "after the crash")
    px2.stop()
    seqs = [l["checkpoint"]["seq"] for f in (rotated, px.audit_path) for l in lines(f)
            if "checkpoint" in l]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, px.audit_path, "--pubkey",
                          px.pub, "--store", px.store])
    assert rc == 0, out


def test_unsigned_lines_are_counted_across_a_rotation_while_stopped():
    """Lines after the last checkpoint (a crash), the file rotated while stopped, a few lines
    into the new file, another crash, a restart: the count of unsigned lines goes on from the
    head across both files, so detproxy still signs every audit_checkpoint_lines lines and an
    honest trail passes --max-unsigned with that number (and the checkpoints' line counts
    hold)."""
    sim, px = setup(checkpoint_lines=5)
    for i in range(7):  # a checkpoint after 5, then 2 lines unsigned
        complete(px, "first %d" % i)
    poll_until(lambda: len(open(px.audit_path).readlines()) == 8, what="seven lines, one checkpoint")
    px.kill()
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    cfg = json.load(open(px.config_path))
    for run in range(2):
        p = start_proxy(config=cfg, directory=px.dir)
        for i in range(2):
            complete(p, "run %d, %d" % (run, i))
        poll_until(lambda: len(open(px.audit_path).readlines()) >= 2 * (run + 1),
                   what="the run's lines")
        if run == 0:
            p.kill()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, px.audit_path, "--pubkey",
                          px.pub, "--store", px.store, "--max-unsigned", "5"])
    assert rc == 0, out
    p.stop()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, px.audit_path, "--pubkey",
                          px.pub, "--store", px.store, "--max-unsigned", "5"])
    assert rc == 0, out


def read_the_moment_it_exists(path, limit=10.0):
    """The contents of path read the first moment it is there, spinning on open (a few
    microseconds a turn: a file created and written an instant apart is caught between)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            return os.read(fd, 4096).decode()
        finally:
            os.close(fd)
    raise AssertionError("%s never appeared" % path)


def test_a_reload_onto_another_audit_path_creates_its_lock_file_with_the_head_in_it():
    """A reload that moves the trail to a new file creates that file's lock file already naming
    the chain's head: a crash at any moment after it exists restarts the new file from the old
    file's last line, not from genesis. Read the instant each new lock file appears, over
    several moves; then a crash right after the last move, a restart, and one chain across
    every file."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "before the moves")
    poll_until(lambda: os.path.getsize(px.audit_path) > 0, what="the audit line")
    cfg = json.load(open(px.config_path))
    files = [px.audit_path]
    for k in range(12):
        path = os.path.join(px.dir, "moved-%d.jsonl" % k)
        cfg["log"]["audit_path"] = path
        write_config(cfg, px.dir)
        start = len(px.logs)
        px.send_signal(signal.SIGHUP)
        seen = read_the_moment_it_exists(path + ".lock")
        rows = seen.split("\n")
        assert len(rows) >= 2 and rows[1].startswith("chain "), (k, seen)
        px.wait_log("reloaded", start=start)
        files.append(path)
        if k < 11:
            complete(px, "after move %d" % k)
    px.kill()
    px2 = start_proxy(config=cfg, directory=px.dir)
    complete(px2, "after the crash")
    px2.stop()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify"] + files +
                         ["--pubkey", px.pub, "--store", px.store])
    assert rc == 0, out


def test_a_torn_tail_that_cannot_be_set_aside_is_not_appended_to():
    """Every name the repair could move the torn file to is taken (or its folder is read-only):
    lines appended after the fragment would break the trail for good, so detproxy refuses to
    start and says why, and the file stays as the crash left it."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "before the crash")
    poll_until(lambda: os.path.getsize(px.audit_path) > 0, what="the audit line")
    crash_with_a_torn_tail(px, b'{"time":"2026-01-01T00:00:00.000Z","request_id":"torn')
    raw = open(px.audit_path, "rb").read()
    now = int(time.time())
    for t in range(now - 1, now + 8):
        stamp = os.path.join(px.dir, "audit.jsonl.torn-" +
                             time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t)))
        for i in range(1000):
            open(stamp + ("" if i == 0 else ".%d" % i), "wb").close()
    try:
        start_proxy(config=json.load(open(px.config_path)), directory=px.dir, timeout=5)
        assert False, "detproxy started over a torn tail it could not set aside"
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 (refusing to start is the expected behaviour)
        assert "cannot be set aside" in str(e), e
    assert open(px.audit_path, "rb").read() == raw


def second_instance_on(px, audit_path):
    """Start another detproxy whose audit_path is audit_path (its store its own): the Proc when
    it started, None when it refused because the trail is in use."""
    cfg = json.load(open(px.config_path))
    other = os.path.dirname(audit_path)
    os.makedirs(os.path.join(other, "store"), exist_ok=True)
    cfg["log"]["audit_path"] = audit_path
    cfg["log"]["audit_store"] = os.path.join(other, "store")
    if cfg["log"].get("audit_signing_key"):
        cfg["log"]["audit_signing_key"] = os.path.join(os.path.dirname(px.config_path),
                                                       cfg["log"]["audit_signing_key"])
    try:
        return start_proxy(config=cfg, directory=tempfile.mkdtemp(prefix="detproxy-lock-"),
                           timeout=5)
    except Exception as e:  # noqa: BLE001 (refusing to start is the expected behaviour)
        assert "in use by another detproxy" in str(e), e
        return None


def test_an_instance_refused_for_a_store_in_use_leaves_its_audit_file_empty():
    """A second instance with an audit file of its own but the first one's store is refused
    (exit 3, the store in use) before it serves anything: nothing to sign, so no shutdown
    checkpoint goes into its audit file."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    cfg = json.load(open(px.config_path))
    other = tempfile.mkdtemp(prefix="detproxy-store-")
    cfg["log"]["audit_path"] = os.path.join(other, "own.jsonl")
    cfg["log"]["audit_store"] = px.store
    cfg["log"]["audit_signing_key"] = os.path.join(px.dir, cfg["log"]["audit_signing_key"])
    try:
        start_proxy(config=cfg, directory=other, timeout=5)
        assert False, "a second instance started on a store in use"
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 (refusing to start is the expected behaviour)
        assert "in use by another detproxy" in str(e), e
    own = cfg["log"]["audit_path"]
    assert not os.path.exists(own) or os.path.getsize(own) == 0, open(own).read()
    complete(px, "b")
    px.stop()


def hup(px):
    """SIGHUP, and wait until it is handled: the reopen is queued ahead of every audit line
    submitted after the `reloaded` log line."""
    start = len(px.logs)
    px.send_signal(signal.SIGHUP)
    px.wait_log("reloaded", start=start)


def test_the_live_file_stays_locked_after_a_rotation_and_a_torn_repair():
    """The flock that stops a second instance on a hard link to the live file moves with the
    live file: to the new file after `mv` + SIGHUP, and to the file a torn-tail repair starts
    at restart. A SIGHUP that rotated nothing keeps the lock it has (no conflict with itself)."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    hup(px)  # nothing rotated: the same file, the same lock
    complete(px, "b")
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    hup(px)
    complete(px, "c")  # answered once its line is in the new file, which is locked by then
    assert not px.find_logs("audit_locked"), px.find_logs("audit_locked")
    other = tempfile.mkdtemp(prefix="detproxy-lock-")
    hard = os.path.join(other, "hard.jsonl")
    os.link(px.audit_path, hard)
    second = second_instance_on(px, hard)
    if second is not None:
        complete(second, "second")
        second.stop()
    complete(px, "d")
    px.stop()
    assert second is None, "a second instance started on a hard link to the rotated-to file"
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, px.audit_path, "--pubkey",
                          px.pub, "--store", px.store])
    assert rc == 0, out

    # A torn tail at restart: the repair moves the file away and starts a new one.
    crash_with_a_torn_tail(px, b'{"request_id":"torn')
    px2 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
    complete(px2, "e")
    assert px2.find_logs("audit_torn_tail")
    hard2 = os.path.join(tempfile.mkdtemp(prefix="detproxy-lock-"), "hard.jsonl")
    os.link(px.audit_path, hard2)
    second = second_instance_on(px, hard2)
    if second is not None:
        complete(second, "second")
        second.stop()
    px2.stop()
    assert second is None, "a second instance started on a hard link to the repaired file"


def test_a_reopen_onto_a_file_another_process_locks_stays_on_the_old_file():
    """After a rotation the new file at PATH is one another writer holds the flock of (a hard
    link to its live file): the reopen says audit_locked and the lines stay in the file open
    before, never interleaved with the other writer's; the next SIGHUP after the lock is
    released moves to the new file, and the files verify as one chain."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    theirs = open(px.audit_path, "ab")
    fcntl.flock(theirs, fcntl.LOCK_EX | fcntl.LOCK_NB)
    px.send_signal(signal.SIGHUP)
    px.wait_log("audit_locked")
    complete(px, "b")
    assert os.path.getsize(px.audit_path) == 0
    assert len(lines(rotated)) == 3, lines(rotated)  # a, the reopen checkpoint, b
    theirs.close()
    hup(px)
    complete(px, "c")
    poll_until(lambda: os.path.getsize(px.audit_path) > 0, what="the line in the new file")
    assert len(px.find_logs("audit_locked")) == 1, px.find_logs("audit_locked")
    px.stop()
    got = lines(px.audit_path)
    assert [l.get("checkpoint", {}).get("reason") for l in lines(rotated)][-1] == "reopen"
    assert "request_id" in got[0], got
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, px.audit_path, "--pubkey",
                          px.pub, "--store", px.store])
    assert rc == 0, out


def test_a_fifo_put_in_place_of_the_audit_file_is_refused_at_the_reopen():
    """A FIFO at PATH when SIGHUP reopens it: with no reader the open would block a pool thread
    for good (every audited request hanging, the stop waiting on it); with one, the lines would
    go into the pipe and no file. Either way the reopen fails at once and the lines stay in the
    file open before, as when another writer holds the new file: a request is answered (503
    while the failed write is the last word, else 200 with its line in the old file), none
    goes into the pipe, and once a regular file is there the chain goes on in it."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    os.mkfifo(px.audit_path)
    for reader in (False, True):
        rfd = os.open(px.audit_path, os.O_RDONLY | os.O_NONBLOCK) if reader else None
        start = len(px.logs)
        px.send_signal(signal.SIGHUP)
        failed = px.wait_log("audit_write_failed", start=start)
        assert failed["op"] == "open", failed
        r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "b", "max_tokens": 8},
                      headers=AUTH, timeout=10)
        if r.status == 200:
            rid = r.headers["x-detproxy-request-id"]
            poll_until(lambda: rid in [l.get("request_id") for l in lines(rotated)],
                       what="its line in the file open before")
        else:
            assert r.status == 503 and r.json()["error"]["code"] == "audit_unavailable", r
        if rfd is not None:
            assert os.read(rfd, 65536) == b"", "a line went into the pipe"
            os.close(rfd)
    os.unlink(px.audit_path)
    hup(px)
    complete(px, "c")
    px.stop()
    assert [l["request_id"] for l in lines(px.audit_path) if "request_id" in l] != []
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, px.audit_path, "--pubkey",
                          px.pub, "--store", px.store])
    assert rc == 0, out


def test_a_reload_back_onto_the_old_audit_path_takes_its_own_locks_back():
    """A reload onto an audit_path whose file cannot be opened keeps the lines (and the locks)
    in the old file; the reload back onto the old path must not find those locks "in use by
    another detproxy" (they are its own): it goes back, and audited requests are served."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    bad = os.path.join(px.dir, "b.jsonl")
    os.symlink("/nonexistent-detproxy-dir/b.jsonl", bad)  # its folder resolves, its file does not open
    cfg = json.load(open(px.config_path))
    cfg["log"]["audit_path"] = bad
    write_config(cfg, px.dir)
    start = len(px.logs)
    px.send_signal(signal.SIGHUP)
    px.wait_log("audit_write_failed", start=start)
    cfg["log"]["audit_path"] = "audit.jsonl"
    write_config(cfg, px.dir)
    hup(px)
    assert not px.find_logs("audit_locked"), px.find_logs("audit_locked")
    assert get_json(px.admin_port, "/admin/audit")["path"] == px.audit_path
    poll_until(lambda: get_json(px.admin_port, "/admin/audit")["writable"],
               what="the reopen back onto the old file written")
    complete(px, "b")
    px.stop()
    assert [l["request_id"] is not None for l in lines(px.audit_path) if "request_id" in l] == \
        [True, True]
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--pubkey", px.pub,
                          "--store", px.store])
    assert rc == 0, out



def reload_onto_held(px, b, key, value):
    """Set px's log.KEY to value, which the running detproxy b holds, and reload by POST and by
    SIGHUP: each fails whole, the answer and reload_failed naming the key and b's pid, and is
    counted. The config written (with value) is returned."""
    cfg = json.load(open(px.config_path))
    cfg["log"][key] = value
    write_config(cfg, px.dir)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 409 and r.json()["error"]["code"] == "unavailable", r.text
    message = r.json()["error"]["message"]
    assert "log.%s: " % key in message and "in use by another detproxy" in message, r.text
    assert "pid %d" % b.popen.pid in message, r.text
    start = len(px.logs)
    px.send_signal(signal.SIGHUP)
    failed = px.wait_log("reload_failed", start=start)
    assert any(e.startswith("log.%s: " % key) and "in use by another detproxy" in e
               for e in failed["errors"]), failed
    assert failed["cause"] == "unavailable", failed  # not an invalid configuration
    assert "configuration invalid" not in failed["detail"], failed
    assert metric(px, "detproxy_config_reloads_total", result="failed") == 2
    assert metric(px, "detproxy_config_reloads_total", result="reloaded") == 0
    assert not px.find_logs("reloaded")
    return cfg


def test_a_reload_onto_an_audit_path_another_instance_holds_fails_whole():
    """A reload whose audit_path is another running detproxy's trail cannot take that file's
    locks, so it fails as a whole, as a certificate the TLS library refuses does: the old
    configuration and the old audit file stay in force, the answer and reload_failed say why,
    the failure is counted, and audited requests are served with their lines in the old file.
    Once the other instance is gone the same reload moves the trail."""
    sim_b, b = setup(checkpoint_lines=100)
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    reload_onto_held(px, b, "audit_path", b.audit_path)
    assert http("GET", px.admin_port, "/readyz").status == 200
    assert get_json(px.admin_port, "/admin/audit")["path"] == px.audit_path
    assert get_json(px.admin_port, "/admin/config")["log"]["audit_path"] == px.audit_path
    rid = complete(px, "b").headers["x-detproxy-request-id"]
    poll_until(lambda: rid in [l.get("request_id") for l in lines(px.audit_path)],
               what="its line in the old file")
    complete(b, "theirs")
    b.stop()
    assert verify(b)[0] == 0  # nothing of the other instance's in it
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    assert get_json(px.admin_port, "/admin/audit")["path"] == b.audit_path
    px.stop()
    assert verify(px)[0] == 0


def test_a_reload_that_adds_an_audit_path_another_instance_holds_fails_whole():
    """The same when the running configuration has no audit trail at all: the reload that
    would open one on another instance's file, for tenants it makes audited, fails, and
    requests go on as before (they were refused 503 audit_unavailable, the process unready,
    under a configuration requiring lines no writer could append)."""
    sim_b, b = setup(checkpoint_lines=100)
    sim = start_sim("--model", "m1")
    px = start_proxy(pools=[pool("p", ["m1"], [sim])])
    cfg = json.load(open(px.config_path))
    cfg["log"] = {"level": "info", "audit_path": b.audit_path}
    cfg["policy"] = POLICY
    write_config(cfg, os.path.dirname(px.config_path))
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 409 and "in use by another detproxy" in r.json()["error"]["message"], r.text
    assert metric(px, "detproxy_config_reloads_total", result="failed") == 1
    assert http("GET", px.admin_port, "/readyz").status == 200
    assert http("GET", px.admin_port, "/admin/audit").status == 404
    r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "x", "max_tokens": 4},
                  headers=AUTH)
    assert r.status == 200, r
    px.stop()
    complete(b, "theirs")
    b.stop()
    assert verify(b)[0] == 0


def test_a_reload_naming_the_audit_file_another_way_keeps_writing_it():
    """The file being written, named another way (a/./x, a link to its folder, a hard link),
    is the same trail: the reload applies, and the writer stays on its file."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    folder, name = os.path.split(px.audit_path)
    link = os.path.join(os.path.dirname(folder), "trail-link")
    os.symlink(folder, link)
    hard = os.path.join(folder, "same-" + name)
    os.link(px.audit_path, hard)
    for n, spelling in enumerate((os.path.join(folder, ".", name), os.path.join(link, name),
                                  hard)):
        cfg = json.load(open(px.config_path))
        cfg["log"]["audit_path"] = spelling
        cfg["limits"] = {"max_connections": 1000 + n}
        write_config(cfg, px.dir)
        r = http("POST", px.admin_port, "/admin/reload")
        assert r.status == 200, (spelling, r.text)
        assert get_json(px.admin_port, "/admin/config")["limits"]["max_connections"] == 1000 + n
        rid = complete(px, "b%d" % n).headers["x-detproxy-request-id"]
        poll_until(lambda: rid in [l.get("request_id") for l in lines(px.audit_path)],
                   what="its line in the same file")
        # What runs is shown: the file under the name it is written.
        assert get_json(px.admin_port, "/admin/config")["log"]["audit_path"] == px.audit_path
    assert metric(px, "detproxy_config_reloads_total", result="failed") == 0
    # The link retargeted at another folder: the next reload sees another file and moves.
    other = os.path.join(os.path.dirname(folder), "other-trail")
    os.mkdir(other)
    os.unlink(link)
    os.symlink(other, link)
    cfg = json.load(open(px.config_path))
    cfg["log"]["audit_path"] = os.path.join(link, name)
    write_config(cfg, px.dir)
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    rid = complete(px, "moved").headers["x-detproxy-request-id"]
    poll_until(lambda: rid in [l.get("request_id") for l in lines(os.path.join(other, name))],
               what="its line in the file the link now names")
    px.stop()
    assert verify(px)[0] == 0


def test_a_reload_onto_an_audit_store_another_instance_holds_fails_whole():
    """A reload whose audit_store is another running detproxy's store cannot take its lock, so
    it fails as a whole, as an audit_path in use does: the old store stays in force (bodies go
    on being stored, no line says bodies_stored false), the answer and reload_failed name
    log.audit_store and the holder, and the failure is counted. The same folder spelled another
    way is the writer's own lock, not a conflict. Once the other instance is gone the reload
    moves the store, and its lock with it."""
    sim_b, b = setup(checkpoint_lines=100)
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    cfg = reload_onto_held(px, b, "audit_store", b.store)
    assert get_json(px.admin_port, "/admin/audit")["store"] == px.store
    assert get_json(px.admin_port, "/admin/config")["log"]["audit_store"] == px.store
    rid = complete(px, "b").headers["x-detproxy-request-id"]
    poll_until(lambda: rid in [l.get("request_id") for l in lines(px.audit_path)],
               what="its line")
    assert not [l for l in lines(px.audit_path) if l.get("bodies_stored") is False]
    assert open(os.path.join(b.store, ".lock")).readline().strip() == str(b.popen.pid)

    cfg["log"]["audit_store"] = px.store + "/"  # the folder it holds, spelled another way
    write_config(cfg, px.dir)
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    with open(os.path.join(px.store, ".lock")) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            assert False, "the store's lock went with the reload"
        except BlockingIOError:
            pass
    complete(px, "c")

    complete(b, "theirs")
    b.stop()
    assert verify(b)[0] == 0  # its bodies all in its store, nothing of ours in its trail
    cfg["log"]["audit_store"] = b.store
    write_config(cfg, px.dir)
    assert http("POST", px.admin_port, "/admin/reload").status == 200
    assert get_json(px.admin_port, "/admin/audit")["store"] == b.store
    assert open(os.path.join(b.store, ".lock")).readline().strip() == str(px.popen.pid)
    before = set(os.listdir(b.store))
    complete(px, "d")
    assert set(os.listdir(b.store)) - before, "the new store got no body"
    px.stop()


def test_a_reload_that_cannot_have_what_it_names_answers_409_unavailable():
    """POST /admin/reload tells the two failures apart as reload_failed's cause does: a valid
    configuration naming what cannot be had now (here another instance's audit file) is 409
    `unavailable`, nothing to fix in the file; an invalid one is 400 `invalid_config`."""
    sim_b, b = setup(checkpoint_lines=100)
    sim, px = setup(checkpoint_lines=100)
    cfg = json.load(open(px.config_path))
    cfg["log"]["audit_path"] = b.audit_path
    write_config(cfg, px.dir)
    start = len(px.logs)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 409 and r.json()["error"]["code"] == "unavailable", r.text
    assert "log.audit_path: " in r.json()["error"]["message"], r.text
    assert px.wait_log("reload_failed", start=start)["cause"] == "unavailable"
    cfg["log"]["audit_path"] = 17
    write_config(cfg, px.dir)
    start = len(px.logs)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 400 and r.json()["error"]["code"] == "invalid_config", r.text
    assert px.wait_log("reload_failed", start=start)["cause"] == "config_invalid"
    assert metric(px, "detproxy_config_reloads_total", result="failed") == 2
    px.stop()
    b.stop()


def held(path):
    """Whether a lock is held on path: a flock through a fresh open file description here
    conflicts with the holder's as a second detproxy's would."""
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False


class StoreWriteHeld:
    """A store write held mid-body. The forwarded body of a request answered once is removed
    from the store, and a FIFO with a one-page pipe put under the name the writer stores it
    under (STORE/.tmp.SHA.PID): the same request again has its batch block on the thread pool
    writing that body into the pipe, which is seen (the pipe readable) before this returns,
    until release() reads it empty and puts the first request's body back. The store write then
    fails (a pipe cannot be fsynced), so under audit_fail open the line is written saying its
    bodies are not stored."""

    def __init__(self, px, prompt, store):
        body = {"model": "m1", "prompt": prompt, "max_tokens": 8}
        first = post_json(px.port, "/v1/completions", body, headers=AUTH)
        assert first.status == 200, first
        rid = first.headers["x-detproxy-request-id"]
        line = poll_until(lambda: [l for l in lines(px.audit_path) if l.get("request_id") == rid],
                          what="the first request's line")[0]
        self.body = os.path.join(store, line["forwarded_body_sha256"])
        with open(self.body, "rb") as f:
            self.bytes = f.read()
        os.unlink(self.body)
        fifo = os.path.join(store, ".tmp.%s.%d" % (os.path.basename(self.body), px.popen.pid))
        os.mkfifo(fifo)
        self.rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        fcntl.fcntl(self.rfd, fcntl.F_SETPIPE_SZ, 4096)  # the body is larger: its write blocks
        self.answer = []
        self.thread = threading.Thread(target=lambda: self.answer.append(
            post_json(px.port, "/v1/completions", body, headers=AUTH, timeout=60)))
        self.thread.start()
        ready, _, _ = select.select([self.rfd], [], [], 20 * SLOW)
        assert ready, "the store write never began"

    def release(self):
        """Let the write finish; the second request's answer."""
        while True:
            select.select([self.rfd], [], [], 20 * SLOW)
            try:
                if not os.read(self.rfd, 65536):
                    break  # the writer closed it
            except BlockingIOError:
                continue
        os.close(self.rfd)
        self.thread.join(60)
        with open(self.body, "wb") as f:  # the first line's body, for `audit verify`
            f.write(self.bytes)
        assert self.answer, "the held request was never answered"
        return self.answer[0]


HELD_PROMPT = "a prompt larger than one page of pipe " * 300


def test_a_reload_that_removes_the_audit_path_lets_go_of_the_trail_once_its_lines_are_written():
    """A reload whose configuration has no audit_path any more (so no tenant audited) turns the
    trail off as a move onto another path does: the lines queued before it still go into the
    file (here one whose store write is held), a shutdown checkpoint signs them, then the file
    is closed and the locks of the path, the file and the store are released (audit_closed),
    so a second detproxy can take the trail on. Until then they are all held."""
    sim, px = setup(checkpoint_lines=100, audit_fail="open")
    hold = StoreWriteHeld(px, HELD_PROMPT, px.store)
    cfg = json.load(open(px.config_path))
    audited = json.load(open(px.config_path))
    cfg["log"] = {"level": "info"}
    cfg["policy"] = {"tenants": [dict(t, audit=False) for t in POLICY["tenants"]]}
    write_config(cfg, px.dir)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 200, r.text
    locks = (px.audit_path + ".lock", px.audit_path, os.path.join(px.store, ".lock"))
    for path in locks:
        assert held(path), "%s released with a line still to be written" % path
    assert not px.find_logs("audit_closed")
    # Turning the trail on again while the old writer holds it: this detproxy itself is named,
    # with what to wait for, not as "another detproxy".
    write_config(audited, px.dir)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 409, r.text
    msg = r.json()["error"]["message"]
    assert "still held by this detproxy's previous audit writer" in msg, msg
    assert "another detproxy" not in msg, msg
    write_config(cfg, px.dir)
    r = hold.release()
    assert r.status == 200, r  # audit_fail open: served, its line says the body is not stored
    closed = px.wait_log("audit_closed")
    assert closed["path"] == px.audit_path, closed
    for path in locks:
        assert not held(path), "%s still held after the trail was turned off" % path
    got = lines(px.audit_path)
    assert got[-2]["request_id"] == r.headers["x-detproxy-request-id"], got[-2:]
    assert got[-2]["bodies_stored"] is False, got[-2]
    assert got[-1]["checkpoint"]["reason"] == "shutdown", got[-1]
    rc, out, err = verify(px)
    assert rc == 0, out + err
    assert http("GET", px.admin_port, "/admin/audit").status == 404
    complete(px, "after the reload")  # answered, and no line anywhere
    assert lines(px.audit_path) == got
    second = second_instance_on(px, px.audit_path)
    assert second is not None, "a second instance could not take the trail on"
    complete(second, "theirs")
    second.stop()
    px.stop()


def test_a_reload_moving_or_removing_the_audit_store_keeps_its_lock_until_its_write_is_done():
    """A reload onto another audit_store, or one without any, while a body is being written
    into the store used before: that store's lock is held until the write is done (as a moved
    audit file's are until its lines are written), so no second writer takes the folder while
    one of our bodies may still land in it; then it is released, and the new store's lock is
    held."""
    sim, px = setup(checkpoint_lines=100, audit_fail="open")
    cfg = json.load(open(px.config_path))
    store2 = os.path.join(px.dir, "store2")
    os.mkdir(store2)
    for n, (store, to) in enumerate(((px.store, store2), (store2, None))):
        hold = StoreWriteHeld(px, HELD_PROMPT + str(n), store)
        if to:
            cfg["log"]["audit_store"] = to
        else:
            del cfg["log"]["audit_store"]
        write_config(cfg, px.dir)
        r = http("POST", px.admin_port, "/admin/reload")
        assert r.status == 200, r.text
        lock = os.path.join(store, ".lock")
        assert held(lock), "%s released while a body was being written into it" % lock
        if to:
            assert held(os.path.join(to, ".lock"))
        assert hold.release().status == 200
        poll_until(lambda: not held(lock), what="%s released once its write was done" % lock)
        if to:
            assert held(os.path.join(to, ".lock")), "the new store's lock went"
    assert get_json(px.admin_port, "/admin/audit")["store"] is None
    complete(px, "without a store")
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
