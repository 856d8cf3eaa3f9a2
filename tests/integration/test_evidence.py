"""Evidence (docs/operations.md, "Evidence"): stored bodies, the chained and signed audit trail, `audit verify` and
`replay`, end to end against detproxy-sim."""

import hashlib
import json
import os
import signal
import tempfile

from harness import (DETPROXY_BIN, poll_until, post_json, run_cmd, run_tests, sse, start_sim,
                     http)
from proxyutil import metric, pool, sim_config, sim_stats, start_proxy

KEY = "sk-bank-evidence-0001"
AUTH = {"authorization": "Bearer " + KEY, "content-type": "application/json"}
POLICY = {"tenants": [
    {"name": "bank", "match": {"api_keys_sha256": [hashlib.sha256(KEY.encode()).hexdigest()]},
     "sampling": {"temperature": {"force": 0}, "seed": {"force": 7}}, "audit": True},
    {"name": "casual", "match": {"any": True}, "audit": True},
]}


def setup(checkpoint_lines=3, key=True, flavor="vllm", limits=None, audit_fail="closed"):
    d = tempfile.mkdtemp(prefix="detproxy-evidence-")
    sim = start_sim("--model", "m1", "--flavor", flavor)
    log = {"level": "info", "audit_path": "audit.jsonl", "audit_store": "store",
           "audit_checkpoint_lines": checkpoint_lines, "audit_fail": audit_fail}
    os.mkdir(os.path.join(d, "store"))
    if key:
        rc, out, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out",
                                os.path.join(d, "audit")])
        assert rc == 0, err
        log["audit_signing_key"] = "audit.key.pem"
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=POLICY, log=log, directory=d,
                     limits=limits)
    px.dir = d
    px.audit_path = os.path.join(d, "audit.jsonl")
    px.store = os.path.join(d, "store")
    px.pub = os.path.join(d, "audit.pub.pem")
    return sim, px


def complete(px, prompt, auth=True, stream=False):
    body = {"model": "m1", "prompt": prompt, "max_tokens": 8}
    if stream:
        body["stream"] = True
        return list(sse(px.port, "/v1/completions", body, headers=AUTH))
    r = post_json(px.port, "/v1/completions", body, headers=AUTH if auth else None)
    assert r.status == 200, r
    return r


def verify(px, path=None, *extra):
    return run_cmd([DETPROXY_BIN, "audit", "verify", path or px.audit_path, "--pubkey", px.pub,
                    "--store", px.store] + list(extra))


def lines(path):
    return [json.loads(l) for l in open(path)]


def test_chain_checkpoints_and_store_verify():
    sim, px = setup()
    ids = [complete(px, "p%d" % i).headers["x-detproxy-request-id"] for i in range(4)]
    px.stop()
    got = lines(px.audit_path)
    kinds = ["cp" if "checkpoint" in l else "req" for l in got]
    # every 3 lines a checkpoint, and one at shutdown
    assert kinds == ["req", "req", "req", "cp", "req", "cp"], kinds
    assert got[3]["checkpoint"]["reason"] == "interval"
    assert got[5]["checkpoint"] == dict(got[5]["checkpoint"], reason="shutdown", lines=1)
    raw = open(px.audit_path, "rb").read().split(b"\n")
    for i in range(1, len(got)):
        assert got[i]["prev_sha256"] == hashlib.sha256(raw[i - 1]).hexdigest()
    assert got[0]["prev_sha256"] == "0" * 64
    # bodies are in the store under their hashes, byte for byte
    for l in got:
        if "request_id" in l:
            for k in ("forwarded_body_sha256", "response_body_sha256"):
                data = open(os.path.join(px.store, l[k]), "rb").read()
                assert hashlib.sha256(data).hexdigest() == l[k]
    assert [l["request_id"] for l in got if "request_id" in l] == ids
    rc, out, err = verify(px)
    assert rc == 0, out + err
    assert "6 lines, 2 checkpoints (seq 1..2), 2 signatures verified, 8 stored bodies checked" in out, out


def test_each_line_names_the_attestation_it_was_served_under():
    """attestation_sha256: the SHA-256 of the evidence that admitted the replica (here the
    native adapter's answers), kept in the store; verify --store checks it is there."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "one")
    complete(px, "two")
    audited = [l for l in lines(px.audit_path) if "request_id" in l]
    shas = {l["attestation_sha256"] for l in audited}
    assert len(shas) == 1 and None not in shas, audited
    sha = shas.pop()
    with open(os.path.join(px.store, sha), "rb") as f:
        ev = f.read()
    assert hashlib.sha256(ev).hexdigest() == sha
    # What the adapter answered, framed per request: an auditor can judge it again.
    assert ev.startswith(b"GET /"), ev[:80]
    rc, out, err = verify(px)
    # 4, not 0: no checkpoint signs these two lines yet (the proxy is still running).
    assert rc == 4 and "2 lines' attestation evidence found" in out, out + err
    os.unlink(os.path.join(px.store, sha))
    rc, out, err = verify(px)
    assert rc == 1 and "attestation_sha256 %s..: stored body missing" % sha[:12] in out + err, \
        out + err
    px.stop()


def test_streamed_response_is_stored_as_forwarded():
    sim, px = setup()
    events = complete(px, "stream me", stream=True)
    assert events
    px.stop()
    l = lines(px.audit_path)[0]
    data = open(os.path.join(px.store, l["response_body_sha256"]), "rb").read()
    assert b"data: [DONE]" in data
    assert verify(px)[0] == 0


def test_a_response_over_the_bound_is_hashed_not_stored():
    sim, px = setup(limits={"max_response_rewrite_bytes": 16})
    r = complete(px, "too long to keep")
    poll_until(lambda: os.path.getsize(px.audit_path) > 0, what="the audit line")
    l = lines(px.audit_path)[0]
    rc, out, _ = replay(px, "--request-id", l["request_id"])
    assert rc == 0 and "no stored response body" in out, out
    px.stop()
    assert l["response_body_sha256"] == hashlib.sha256(r.body).hexdigest()
    assert l["response_body_stored"] is False, l
    assert not os.path.exists(os.path.join(px.store, l["response_body_sha256"]))
    assert os.path.exists(os.path.join(px.store, l["forwarded_body_sha256"]))
    rc, out, _ = verify(px)
    assert rc == 0 and "1 stored bodies checked" in out, out


def test_an_answer_checked_on_the_thread_pool_is_audited_as_forwarded():
    """An answer longer than 64 KiB is checked and given the pool's fingerprint on the thread
    pool: its audit hash, stored body and token counts are those of the bytes the client got."""
    sim, px = setup(checkpoint_lines=100)
    offloaded = lambda: metric(px, "detproxy_response_offloaded_total")
    assert offloaded() == 0
    complete(px, "short")
    assert offloaded() == 0
    before = metric(px, "detproxy_tokens_total", kind="completion")
    # The casual tenant: eight choices sampled at the sim's default temperature. The seed makes
    # their lengths fixed (about 124 KiB in all); unseeded, they come out as short as 35 KiB.
    r = post_json(px.port, "/v1/chat/completions",
                  {"model": "m1", "messages": [{"role": "user", "content": "long"}],
                   "max_tokens": 4000, "n": 8, "seed": 3})
    assert r.status == 200 and len(r.body) > 64 * 1024, (r.status, len(r.body))
    assert offloaded() == 1
    got = r.json()
    assert got["system_fingerprint"] == r.headers["x-detproxy-fingerprint"], got.get(
        "system_fingerprint")
    assert metric(px, "detproxy_tokens_total", kind="completion") - before == \
        got["usage"]["completion_tokens"]
    px.stop()
    l = [l for l in lines(px.audit_path) if "request_id" in l][-1]
    assert l["request_id"] == r.headers["x-detproxy-request-id"]
    assert l["response_body_sha256"] == hashlib.sha256(r.body).hexdigest()
    with open(os.path.join(px.store, l["response_body_sha256"]), "rb") as f:
        assert f.read() == r.body
    assert verify(px)[0] == 0


def rewrite(path, fn):
    raw = open(path, "rb").read().split(b"\n")[:-1]
    raw = fn(raw)
    open(path, "wb").write(b"\n".join(raw) + b"\n")


def test_verify_names_the_first_break():
    sim, px = setup(checkpoint_lines=100)
    for i in range(3):
        complete(px, "t%d" % i)
    px.stop()
    good = open(px.audit_path, "rb").read()

    # A tampered line: the next line's prev_sha256 no longer matches.
    rewrite(px.audit_path, lambda r: [r[0].replace(b'"status":200', b'"status":201')] + r[1:])
    rc, out, _ = verify(px)
    assert rc == 1 and "line 2: chain broken" in out, out

    # A deleted line.
    open(px.audit_path, "wb").write(good)
    rewrite(px.audit_path, lambda r: [r[0]] + r[2:])
    rc, out, _ = verify(px)
    assert rc == 1 and "line 2: chain broken" in out, out

    # The chain recomputed after an edit still fails: the checkpoint's signature.
    open(px.audit_path, "wb").write(good)

    def forge(r):
        out, prev = [], "0" * 64
        for b in r:
            o = json.loads(b)
            if "status" in o:
                o["status"] = 500
            o["prev_sha256"] = prev
            s = json.dumps(o, separators=(",", ":")).encode()
            if "checkpoint" in o:  # keep the original bytes order, only the chain changed
                head = b.rsplit(b',"prev_sha256"', 1)[0]
                tail = b',"keyid"' + b.split(b',"keyid"', 1)[1]
                s = head + b',"prev_sha256":"' + prev.encode() + b'"' + tail
            out.append(s)
            prev = hashlib.sha256(s).hexdigest()
        return out
    rewrite(px.audit_path, forge)
    rc, out, _ = verify(px)
    assert rc == 1 and "line 4: checkpoint: bad signature" in out, out

    # An edited stored body.
    open(px.audit_path, "wb").write(good)
    sha = lines(px.audit_path)[1]["response_body_sha256"]
    with open(os.path.join(px.store, sha), "ab") as f:
        f.write(b" ")
    rc, out, _ = verify(px)
    assert rc == 1 and "line 2: response_body_sha256" in out and "altered" in out, out
    os.unlink(os.path.join(px.store, sha))
    rc, out, _ = verify(px)
    assert rc == 1 and "line 2: response_body_sha256" in out and "missing" in out, out

    # The wrong key.
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out",
                          os.path.join(px.dir, "other")])
    assert rc == 0, err
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--pubkey",
                          os.path.join(px.dir, "other.pub.pem")])
    assert rc == 1 and "line 4: checkpoint: signed by key" in out, out


def test_reopen_keeps_the_chain_across_files():
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    px.send_signal(signal.SIGHUP)
    poll_until(lambda: os.path.exists(px.audit_path), what="audit file reopened")
    complete(px, "b")
    px.stop()
    old, new = lines(rotated), lines(px.audit_path)
    assert old[-1]["checkpoint"]["reason"] == "reopen", old
    last = open(rotated, "rb").read().split(b"\n")[-2]
    assert new[0]["prev_sha256"] == hashlib.sha256(last).hexdigest()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, px.audit_path, "--pubkey",
                          px.pub, "--store", px.store])
    assert rc == 0, out
    # out of order, the second file's first line does not follow on
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, rotated])
    assert rc == 1 and "line 1: chain broken" in out, out


def test_restart_resumes_the_chain():
    sim, px = setup(checkpoint_lines=100)
    complete(px, "a")
    px.stop()
    px2 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
    complete(px2, "b")
    px2.stop()
    assert verify(px)[0] == 0


def test_a_restart_after_logrotate_continues_the_chain_in_the_new_file():
    """logrotate moves the file away while detproxy is stopped (or between a stop and a start):
    the new file's first line names the old file's last, from the head the lock file kept, so
    the two verify as one chain; without it the new file starts at genesis (a break)."""
    sim, px = setup(checkpoint_lines=2)
    for p in ("a", "b", "c"):
        complete(px, p)
    px.stop()
    rotated = px.audit_path + ".1"
    os.rename(px.audit_path, rotated)
    px2 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
    complete(px2, "d")
    px2.stop()
    assert px2.find_logs("audit_chain_continued"), "no audit_chain_continued line"
    last = open(rotated, "rb").read().split(b"\n")[-2]
    assert lines(px.audit_path)[0]["prev_sha256"] == hashlib.sha256(last).hexdigest()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", rotated, px.audit_path, "--pubkey",
                          px.pub, "--store", px.store])
    assert rc == 0, out
    # the checkpoint numbering goes on too: seq 1..2 in the old file, 3.. in the new one
    seqs = [l["checkpoint"]["seq"] for f in (rotated, px.audit_path) for l in lines(f)
            if "checkpoint" in l]
    assert seqs == list(range(1, len(seqs) + 1)), seqs
    # A second line in the lock file that is not a head (garbage, a negative seq) is said at
    # start, and the chain starts at genesis rather than from made-up numbers.
    lock = os.path.realpath(px.audit_path) + ".lock"
    pid = open(lock).read().split("\n")[0]
    for bad in ("garbage", "chain %s -0000000000000000001 %s 00000000000000000000"
                % ("a" * 64, "0" * 64)):
        os.rename(px.audit_path, rotated)
        with open(lock, "w") as f:
            f.write(pid + "\n" + bad + "\n")
        px3 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
        complete(px3, "e")
        px3.stop()
        assert px3.find_logs("audit_chain_head_unreadable"), bad
        assert lines(px.audit_path)[0]["prev_sha256"] == "0" * 64


def test_crash_then_restart_keeps_the_chain_and_the_checkpoint_count():
    sim, px = setup(checkpoint_lines=3)
    complete(px, "a")
    complete(px, "b")
    poll_until(lambda: len(open(px.audit_path).readlines()) == 2, what="two audit lines")
    px.kill()  # no shutdown checkpoint
    px2 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
    complete(px2, "c")  # the third line since the last checkpoint: one is due now
    px2.stop()
    got = lines(px.audit_path)
    assert got[3]["checkpoint"]["lines"] == 3, got[3]
    rc, out, _ = verify(px)
    assert rc == 0, out


def test_with_a_pubkey_a_trail_no_checkpoint_signs_does_not_pass():
    """A chain anyone can recompute: rewritten from genesis without its checkpoints it still
    holds, so with --pubkey verify exits 4 (nothing signed), not 0. An honest trail that
    crashed before its first checkpoint looks the same until a clean stop signs it."""
    sim, px = setup(checkpoint_lines=100)
    for i in range(3):
        complete(px, "q%d" % i)
    poll_until(lambda: len(open(px.audit_path).readlines()) == 3, what="three audit lines")
    px.kill()  # no shutdown checkpoint: nothing signed yet
    rc, out, _ = verify(px)
    assert rc == 4 and "NO signature verified" in out and "3 lines" in out, out
    px2 = start_proxy(config=json.load(open(px.config_path)), directory=px.dir)
    complete(px2, "q3")
    px2.stop()
    rc, out, _ = verify(px)
    assert rc == 0 and "1 signatures verified" in out, out

    def forge(r):
        out, prev = [], "0" * 64
        for b in r:
            o = json.loads(b)
            if "checkpoint" in o:
                continue
            o["status"] = 500
            o["prev_sha256"] = prev
            s = json.dumps(o, separators=(",", ":")).encode()
            out.append(s)
            prev = hashlib.sha256(s).hexdigest()
        return out
    rewrite(px.audit_path, forge)
    rc, out, _ = verify(px)
    assert rc == 4 and "0 checkpoints" in out and "NO signature verified" in out, out
    # Knowingly without signatures, the chain alone is what is asked for.
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--no-signatures"])
    assert rc == 0, out


def test_an_answer_cut_mid_stream_keeps_its_forwarded_body_in_the_store():
    """The replica dies mid-stream: the client's request is let go at once, its audit line is
    written after. The forwarded body the line stores must be the bytes that were sent (the
    policy's parts point into the client's request buffer), so the honest trail verifies."""
    sim, px = setup(checkpoint_lines=100)
    sim_config(sim, fault="die_mid_stream", fault_count=1)
    try:
        complete(px, "cut short", stream=True)
    except Exception:  # noqa: BLE001 (the client's stream is cut: that is the point)
        pass
    line = poll_until(lambda: [l for l in lines(px.audit_path) if "request_id" in l],
                      what="the audit line")[0]
    assert line["status"] == 200 and line["error"]["code"] == "upstream_error", line
    stored = open(os.path.join(px.store, line["forwarded_body_sha256"]), "rb").read()
    assert hashlib.sha256(stored).hexdigest() == line["forwarded_body_sha256"], stored[:80]
    assert b'"prompt": "cut short"' in stored, stored[:80]
    px.stop()
    rc, out, err = verify(px)
    assert rc == 0, out + err
    # replay: a part of an answer is not one a whole new answer "differs" from
    rc, out, err = replay(px, "--request-id", line["request_id"], "--json")
    res = json.loads(out)["results"][0]
    assert rc == 0 and res["result"] == "not_replayable", out + err
    assert "the answer was cut" in res["why"], res


def test_max_unsigned_bounds_the_lines_after_the_last_checkpoint():
    """Lines appended after a genuine checkpoint chain on from it with no key: verify reports
    them as not signed yet, and --max-unsigned (the writer's audit_checkpoint_lines) turns more
    of them than an honest writer leaves into exit 4."""
    sim, px = setup(checkpoint_lines=2)
    for i in range(3):
        complete(px, "m%d" % i)
    px.stop()  # a shutdown checkpoint signs the third line
    rc, out, _ = verify(px, None, "--max-unsigned", "0")
    assert rc == 0 and "after the last checkpoint" not in out, out

    def forge(r):
        prev = hashlib.sha256(r[-1]).hexdigest()
        model = next(json.loads(b) for b in reversed(r) if b'"request_id"' in b)
        for i in range(3):
            o = dict(model, request_id="forged-%d" % i, prev_sha256=prev)
            s = json.dumps(o, separators=(",", ":")).encode()
            r.append(s)
            prev = hashlib.sha256(s).hexdigest()
        return r
    rewrite(px.audit_path, forge)
    rc, out, _ = verify(px)
    assert rc == 0 and "3 lines after the last checkpoint (not signed yet)" in out, out
    rc, out, _ = verify(px, None, "--max-unsigned", "2")
    assert rc == 4 and "the last 3 lines are NOT signed: more than --max-unsigned 2" in out, out
    rc, out, _ = verify(px, None, "--max-unsigned", "3")
    assert rc == 0, out
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--no-signatures",
                            "--max-unsigned", "2"])
    assert rc == 2 and "--max-unsigned needs --pubkey" in err, out + err


def test_an_empty_rotated_file_passes_the_chain_through():
    """Two rotations with no line between leave an empty file (no key: no reopen checkpoint
    fills it); verified in rotation order, the chain goes through it to the next file."""
    sim, px = setup(checkpoint_lines=100, key=False)
    complete(px, "a")
    poll_until(lambda: os.path.getsize(px.audit_path) > 0, what="the audit line")
    for n in (2, 1):
        os.rename(px.audit_path, "%s.%d" % (px.audit_path, n))
        px.send_signal(signal.SIGHUP)
        poll_until(lambda: os.path.exists(px.audit_path), what="audit file reopened")
    complete(px, "b")
    px.stop()
    files = [px.audit_path + ".2", px.audit_path + ".1", px.audit_path]
    assert os.path.getsize(files[1]) == 0
    head = hashlib.sha256(open(files[0], "rb").read().split(b"\n")[-2]).hexdigest()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify"] + files + ["--no-signatures"])
    assert rc == 0, out
    assert "audit.jsonl.1: empty: the chain passes through it (the next file continues from %s..)" \
        % head[:12] in out, out
    # The empty file does not hide a break: out of order, the chain still fails.
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", files[2], files[1], files[0],
                          "--no-signatures"])
    assert rc == 1 and "line 1: chain broken" in out, out
    # An empty first file: the chain starts with the next one.
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", files[1], files[0],
                          "--no-signatures"])
    assert rc == 0 and "empty: the chain starts with the next file" in out, out


def replay(px, *args):
    return run_cmd([DETPROXY_BIN, "replay", "-c", px.config_path, "--audit", px.audit_path]
                   + list(args))


def test_replay_reproduces_then_differs_after_the_replica_changes():
    # tgi: its responses carry a system_fingerprint, so replay can say whether it still matches
    sim, px = setup(checkpoint_lines=100, flavor="tgi")
    rid = complete(px, "the same question").headers["x-detproxy-request-id"]
    unseeded = complete(px, "casual", auth=False).headers["x-detproxy-request-id"]
    rc, out, err = replay(px, "--request-id", rid)
    assert rc == 0 and "reproduced" in out, out + err
    rc, out, err = replay(px, "--request-id", unseeded, "--json")
    res = json.loads(out)["results"][0]
    assert rc == 0 and res["result"] == "not_replayable", out
    assert "unseeded sampling" in res["why"], res
    # The replica now generates differently while reporting the same identity.
    sim_config(sim, quantization="int8", report_quantization="none")
    rc, out, err = replay(px, "--all", "--json")
    doc = json.loads(out)
    assert rc == 1, out + err
    first = doc["results"][0]
    assert first["result"] == "differs" and first["divergence_offset"] >= 0, first
    assert 0 <= first["similarity"] < 1 and first["fingerprint_matches"] is True, first
    assert doc["summary"] == {"replayed": 2, "reproduced": 0, "differs": 1,
                              "not_replayable": 1, "deadline_passed": False}, doc
    # A new engine build: still differs, and the engine's fingerprint no longer matches.
    sim_config(sim, framework_version="9.9.9")
    rc, out, err = replay(px, "--request-id", rid)
    assert rc == 1 and "differs" in out and "fingerprint_matches=no" in out, out + err
    # No stored body: not replayable, saying so.
    sha = lines(px.audit_path)[0]["forwarded_body_sha256"]
    os.unlink(os.path.join(px.store, sha))
    rc, out, _ = replay(px, "--request-id", rid)
    assert rc == 0 and "not_replayable" in out and "no stored body" in out, out
    # --since after everything selects nothing.
    rc, out, _ = replay(px, "--all", "--since", "2999-01-01T00:00:00Z")
    assert rc == 0 and out.startswith("0 replayed"), out
    # --since is compared as a time: the first line's own second (written with milliseconds)
    # selects it, in UTC or in another offset; a value that is not a time is a usage error.
    first = lines(px.audit_path)[0]["time"]  # "2026-12-04T03:20:01.234Z"
    for since in (first[:19] + "Z", first[:19] + "+00:00", first[:10]):
        rc, out, err = replay(px, "--all", "--since", since)
        assert "\n2 replayed: " in out, (since, out + err)
    rc, out, err = replay(px, "--all", "--since", "yesterday")
    assert rc == 2 and "--since" in err and out == "", (out, err)
    px.stop()


def test_replay_through_the_proxy_takes_its_slots():
    """replay --admin sends each replay through the running proxy's admin relay: on a limit-1
    pool with clients running the replica never has two requests at once."""
    import threading
    d = tempfile.mkdtemp(prefix="detproxy-evidence-")
    sim = start_sim("--model", "m1", "--flavor", "tgi", "--token-delay-ms", "3")
    p = pool("p", ["m1"], [sim], max_inflight_per_replica=1, queue_timeout_ms=60000)
    os.mkdir(os.path.join(d, "store"))
    px = start_proxy(pools=[p], policy=POLICY, directory=d,
                     log={"level": "info", "audit_path": "audit.jsonl", "audit_store": "store"})
    px.audit_path = os.path.join(d, "audit.jsonl")
    for i in range(6):
        complete(px, "replayed question %d" % i)
    # The six lines, before the clients below add theirs (audited too).
    replayed = os.path.join(d, "replayed.jsonl")
    with open(px.audit_path) as f, open(replayed, "w") as out:
        out.write(f.read())
    http("POST", sim.port, "/_sim/reset")
    stop = threading.Event()

    def clients():
        while not stop.is_set():
            complete(px, "client beside the replay")
    ts = [threading.Thread(target=clients) for _ in range(2)]
    for t in ts:
        t.start()
    rc, out, err = run_cmd([DETPROXY_BIN, "replay", "-c", px.config_path, "--audit", replayed,
                            "--all", "--admin", "127.0.0.1:%d" % px.admin_port, "--json"],
                           timeout=120)
    stop.set()
    for t in ts:
        t.join()
    doc = json.loads(out)
    assert rc == 0 and doc["summary"]["reproduced"] >= 6, out + err
    assert sim_stats(sim)["max_inflight_seen"] == 1, sim_stats(sim)
    relayed = px.find_logs("admin_relay")
    assert len(relayed) >= 6 and all(l["status"] == 200 for l in relayed), relayed[:2]
    px.stop()


def test_replay_without_a_replica_of_that_fingerprint():
    sim, px = setup(checkpoint_lines=100)
    rid = complete(px, "q").headers["x-detproxy-request-id"]
    px.stop()
    cfg = json.load(open(px.config_path))
    cfg["pools"][0]["manifest"] = {"model": "m1"}
    cfg["pools"][0]["replicas"][0]["attest"] = {"source": "vllm"}
    px2 = start_proxy(config=cfg, directory=px.dir)
    px2.audit_path = px.audit_path
    rc, out, _ = replay(px2, "--request-id", rid)
    assert rc == 0 and "no replica of the config attests identity" in out, out
    px2.stop()


def test_replay_of_a_file_that_is_no_audit_file_is_an_error():
    """A directory, a device, an empty file or a file of garbage given as --audit: exit 2 with
    the reason, not "0 replayed" and exit 0 (which a CI gate reads as "nothing differs"); a
    pipe is read as a file is; a torn last line beside real ones is a warning only."""
    sim, px = setup(checkpoint_lines=100)
    complete(px, "q")
    px.stop()
    d = px.dir
    garbage = os.path.join(d, "garbage.jsonl")
    with open(garbage, "wb") as f:
        f.write(b"\x00\xffnot json\n[1,2]\n")
    fifo = os.path.join(d, "fifo.jsonl")
    os.mkfifo(fifo)
    empty = os.path.join(d, "empty.jsonl")
    open(empty, "w").close()
    for path, why in ((d, "not a regular file or a pipe"), ("/dev/zero", "not a regular file"),
                      (garbage, "no audit line (2 lines, 2 of them not JSON objects)"),
                      (empty, "no audit line (0 lines"),
                      (fifo, "no audit line (0 lines")):  # a pipe no one writes: read to its end
        rc, out, err = run_cmd([DETPROXY_BIN, "replay", "-c", px.config_path, "--audit", path,
                                "--all"], timeout=20)
        assert rc == 2 and why in err, (path, rc, out, err)
    # A pipe with a writer (a shell's process substitution) is read as the file would be.
    rc, out, err = run_cmd(["bash", "-c", '"$0" replay -c "$1" --audit <(cat "$2") --all',
                            DETPROXY_BIN, px.config_path, px.audit_path], timeout=60)
    assert rc == 0 and "1 replayed" in out, (rc, out, err)
    torn = os.path.join(d, "torn.jsonl")
    with open(px.audit_path, "rb") as f, open(torn, "wb") as g:
        g.write(f.read() + b'{"request_id":"cut')
    rc, out, err = run_cmd([DETPROXY_BIN, "replay", "-c", px.config_path, "--audit", torn,
                            "--all"], timeout=60)
    assert rc == 0 and "warning: 1 of" in err and "1 replayed" in out, (rc, out, err)


def test_config_errors():
    d = tempfile.mkdtemp(prefix="detproxy-evidence-")
    cfg = {"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
           "pools": [{"name": "p", "models": ["*"], "replicas": [{"name": "r",
                                                                   "url": "http://127.0.0.1:1"}]}],
           "log": {"audit_path": "a.jsonl", "audit_store": "nope", "audit_signing_key": "k.pem",
                   "audit_checkpoint_lines": 0}}
    path = os.path.join(d, "c.json")
    json.dump(cfg, open(path, "w"))
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
    assert rc == 1, out + err
    text = out + err
    assert "log.audit_store" in text and "log.audit_signing_key" in text, text
    assert "log.audit_checkpoint_lines" in text, text


if __name__ == "__main__":
    run_tests(globals())
