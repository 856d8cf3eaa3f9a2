"""A full disk under the audit trail (docs/operations.md, "Evidence"): with log.audit_fail
"closed" no answer leaves without its audit line, /readyz says so, and the file stays a
verifiable chain; with "open" answers are served and counted. Needs a 300 KB tmpfs (root, mount
permitted): skipped (77) with the reason otherwise."""

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile

from harness import (DETPROXY_BIN, get_json, http, poll_until, post_json, run_cmd, run_tests,
                     start_sim)
from proxyutil import ScriptedUpstream, metric, pool, read_until_close, start_proxy
from test_evidence import AUTH, POLICY

MNT = None


def mount():
    global MNT
    MNT = tempfile.mkdtemp(prefix="detproxy-full-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300k", "tmpfs", MNT],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print("SKIP: cannot mount a 300k tmpfs here (%s): the full-disk tests need root and "
              "mount permission" % (r.stderr.strip() or r.returncode), flush=True)
        sys.exit(77)


def umount():
    subprocess.run(["umount", MNT], capture_output=True)


def proxy(mode):
    d = tempfile.mkdtemp(prefix="detproxy-disk-", dir=MNT)
    os.mkdir(os.path.join(d, "store"))
    sim = start_sim("--model", "m1")
    log = {"level": "info", "audit_path": os.path.join(d, "audit.jsonl"),
           "audit_store": os.path.join(d, "store"), "audit_fail": mode}
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=POLICY, log=log,
                     directory=tempfile.mkdtemp(prefix="detproxy-disk-cfg-"))
    px.audit_path = log["audit_path"]
    return px


def fill():
    """Leave the filesystem without a free byte."""
    with open(os.path.join(MNT, "filler"), "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
        try:
            while True:
                f.write(b"x")
        except OSError:
            pass


def refused_start(cfg, directory):
    """Start detproxy on cfg, which must refuse to start (a repair line it cannot write): what
    it said."""
    try:
        start_proxy(config=cfg, directory=directory, timeout=5)
    except Exception as e:  # noqa: BLE001 (refusing to start is the expected behaviour)
        return str(e)
    raise AssertionError("detproxy started with a repair line it could not write")


def send(px, n, size=200):
    out = []
    for i in range(n):
        r = post_json(px.port, "/v1/completions",
                      {"model": "m1", "prompt": "disk %d %s" % (i, "y" * size), "max_tokens": 8},
                      headers=AUTH)
        out.append(r)
    return out


def test_fail_closed_refuses_what_cannot_be_audited():
    px = proxy("closed")
    first = send(px, 5)
    assert all(r.status == 200 for r in first)
    poll_until(lambda: len(open(px.audit_path).readlines()) == 5, what="five lines")
    # Each request stores ~3 KB of bodies: the disk fills part-way through, to the last byte.
    rs = send(px, 140, size=3000)
    ok = [r.headers["x-detproxy-request-id"] for r in rs if r.status == 200]
    refused = [r for r in rs if r.status == 503]
    assert refused, [r.status for r in rs]
    for r in refused:
        assert r.json()["error"]["code"] == "audit_unavailable", r.body
    ready = http("GET", px.admin_port, "/readyz")
    assert ready.status == 503 and ready.json()["audit"]["writable"] is False, ready.body
    audited = {json.loads(l)["request_id"] for l in open(px.audit_path) if "request_id" in l}
    # No answer without its line.
    missing = [i for i in ok + [r.headers["x-detproxy-request-id"] for r in first]
               if i not in audited]
    assert not missing, (len(missing), len(ok), len(refused))
    metrics = http("GET", px.admin_port, "/metrics").body.decode()
    assert 'detproxy_audit_write_failures_total{action="refused"}' in metrics
    assert "detproxy_audit_writable 0" in metrics
    # Space again: the next audited request is served and the trail is whole.
    for f in [n for n in os.listdir(os.path.join(os.path.dirname(px.audit_path), "store")) if len(n) == 64]:
        os.unlink(os.path.join(os.path.dirname(px.audit_path), "store", f))
    poll_until(lambda: post_json(px.port, "/v1/completions",
                                 {"model": "m1", "prompt": "again", "max_tokens": 8},
                                 headers=AUTH).status == 200, what="served again")
    assert http("GET", px.admin_port, "/readyz").status == 200
    px.stop()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--no-signatures"])
    assert rc == 0, out
    assert ok, "the disk filled before any request of the run was served"
    print("closed: %d served with a line, %d refused 503 audit_unavailable" % (len(ok), len(refused)))


def stream_raw(px, prompt, on_first_event=None):
    """A streamed completion read off the socket: (every byte the client got, closed cleanly
    with the chunked terminator?). on_first_event runs once the first event has arrived."""
    body = json.dumps({"model": "m1", "prompt": prompt, "max_tokens": 6, "stream": True}).encode()
    head = ("POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            "authorization: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (AUTH["authorization"], len(body))).encode()
    s = socket.create_connection(("127.0.0.1", px.port))
    s.settimeout(30)
    s.sendall(head + body)
    got = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        if on_first_event and b"data: {" in got + chunk and b"data: {" not in got:
            on_first_event()
        got += chunk
    s.close()
    return got, got.endswith(b"\r\n0\r\n\r\n")


def test_fail_closed_withholds_a_streams_end_when_its_line_cannot_be_written():
    """A stream cannot be withheld whole once its tokens flow; its closing event can. When the
    disk fills during the stream, the client never gets `data: [DONE]` (or a clean end), so no
    client reads a finished answer that has no audit line."""
    d = tempfile.mkdtemp(prefix="detproxy-disk-", dir=MNT)
    sim = start_sim("--model", "m1", "--token-delay-ms", "100")
    os.mkdir(os.path.join(d, "store"))
    # The store: a new file per body, which a full disk refuses (a line may still fit the slack
    # of the trail's last page).
    log = {"level": "info", "audit_path": os.path.join(d, "audit.jsonl"),
           "audit_store": os.path.join(d, "store"), "audit_fail": "closed"}
    px = start_proxy(pools=[pool("p", ["m1"], [sim])], policy=POLICY, log=log,
                     directory=tempfile.mkdtemp(prefix="detproxy-disk-cfg-"))
    got, clean = stream_raw(px, "room on the disk")
    assert clean and b"data: [DONE]" in got, got[-200:]
    got, clean = stream_raw(px, "the disk fills", on_first_event=fill)
    assert b"data: {" in got, got[:300]
    assert b"[DONE]" not in got and not clean, got[-300:]
    lines = [json.loads(l) for l in open(log["audit_path"]) if "request_id" in l]
    assert len(lines) == 1, lines
    metrics = http("GET", px.admin_port, "/metrics").body.decode()
    assert 'detproxy_audit_write_failures_total{action="refused"} 1' in metrics, metrics
    os.unlink(os.path.join(MNT, "filler"))
    px.stop()


def post_raw(px, body, version=b"1.1"):
    """A completion POSTed and read off the socket until the proxy closes: (status, the body's
    declared length or None, the body bytes that came)."""
    body = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(b"POST /v1/completions HTTP/%s\r\nhost: x\r\ncontent-type: application/json\r\n"
              b"authorization: %s\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
              % (version, AUTH["authorization"].encode(), len(body), body))
    got, closed = read_until_close(s, timeout=30)
    s.close()
    assert closed, got[-200:]
    head, _, rest = got.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return int(head.split(b" ")[1]), length and int(length.group(1)), rest


def test_fail_closed_withholds_the_end_of_an_answer_passed_through():
    """An answer passed through as it arrives (a replica's error, or one longer than
    max_response_rewrite_bytes) is complete for its client at its last byte: that byte waits
    for the audit line, so when the disk fills before the line is written the client is cut
    one byte short and never holds a whole answer without its line. With Content-Length the
    last byte is known; without it (an HTTP/1.0 client, whose answer the close ends) each write
    keeps its last byte back; an answer its head alone ends waits whole, and is refused."""
    d = tempfile.mkdtemp(prefix="detproxy-disk-", dir=MNT)
    os.mkdir(os.path.join(d, "store"))
    # Each answer its own bytes: the store keeps one file per body, and a full disk refuses a
    # new one (the line alone may still fit the trail's last page).
    answer = {400: lambda k: b'{"error":{"message":"max_tokens is too large (%d)"}}' % k,
              200: lambda k: b'{"id":"cmpl-%d","choices":[{"text":"%s"}]}' % (k, b"a" * 8000),
              500: lambda k: b"", 304: lambda k: b""}
    sent = []
    state = {"status": 400, "framing": "length", "fill": False}

    def script(k, c, q):
        if state["fill"]:  # the disk fills as the replica answers
            fill()
        body = answer[state["status"]](k)
        sent.append(body)
        head = b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\n" % state["status"]
        if state["framing"] == "chunked":
            return head + b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
                len(body), body), True
        if state["framing"] == "none":  # a 304: no body, no length
            return head + b"\r\n", True
        return head + b"content-length: %d\r\n\r\n" % len(body) + body, True
    up = ScriptedUpstream(script)
    log = {"level": "info", "audit_path": os.path.join(d, "audit.jsonl"),
           "audit_store": os.path.join(d, "store"), "audit_fail": "closed"}
    px = start_proxy(pools=[{"name": "p", "models": ["m1"], "replicas": [
        {"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}], policy=POLICY, log=log,
        limits={"max_response_rewrite_bytes": 4096},
        directory=tempfile.mkdtemp(prefix="detproxy-disk-cfg-"))
    prompts = iter("p%d" % i for i in range(1000))
    # (status, the replica's framing, the client's HTTP version, a streamed request): a
    # replica's error to a streamed request is no stream, and is passed through as it comes.
    cases = [(400, "length", b"1.1", False), (200, "length", b"1.1", False),
             (500, "length", b"1.1", False), (304, "none", b"1.1", False),
             (400, "chunked", b"1.0", False), (400, "length", b"1.0", True)]
    cut = {}
    for status, framing, version, stream in cases:
        state["status"], state["framing"] = status, framing
        send = lambda: post_raw(px, {"model": "m1", "prompt": next(prompts), "max_tokens": 4,
                                     "stream": stream}, version)
        st, length, got = send()  # room on the disk: whole
        assert (st, got) == (status, sent[-1]), (status, framing, st, got[-80:])
        assert length == (len(sent[-1]) if framing == "length" and not stream else None), (
            status, length)
        state["fill"] = True
        st, length, got = send()
        if not sent[-1]:  # no byte to hold back: the head waits, and the answer is refused
            assert st == 503 and b"audit_unavailable" in got, (status, st, got)
        else:
            assert (st, got) == (status, sent[-1][:-1]), (status, framing, st, got[-80:])
            cut[status] = cut.get(status, 0) + 1
            # Counted under the status its head carried, as withheld.
            assert metric(px, "detproxy_requests_total", status=str(status),
                          code="audit_unavailable") == cut[status]
        state["fill"] = False
        os.unlink(os.path.join(MNT, "filler"))
        # The next request's refusal line finds the disk writable again.
        poll_until(lambda: send()[0] == status, what="served again")
    metrics = http("GET", px.admin_port, "/metrics").body.decode()
    assert 'detproxy_audit_write_failures_total{action="refused"} 6' in metrics, metrics
    px.stop()


def test_a_stream_going_on_after_its_closing_event_is_not_held_without_bound():
    """What follows a held closing event is held too, up to max_response_rewrite_bytes: a
    replica that streams on and on after `data: [DONE]` gets its answer ended as broken, not
    kept in memory."""
    events = b'data: {"choices":[{"text":"a"}]}\n\ndata: [DONE]\n\n' + b"data: more\n\n" * 2000
    resp = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))
    up = ScriptedUpstream(lambda k, c, q: (resp, False))
    d = tempfile.mkdtemp(prefix="detproxy-disk-")
    px = start_proxy(pools=[{"name": "p", "models": ["m1"], "replicas": [
        {"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}], policy=POLICY,
        log={"level": "info", "audit_path": os.path.join(d, "audit.jsonl"),
             "audit_fail": "closed"},
        limits={"max_response_rewrite_bytes": 4096}, directory=d)
    got, clean = stream_raw(px, "on and on")
    assert b'"text":"a"' in got and b"[DONE]" not in got and not clean, got[-200:]
    # The line says the client's answer broke, under the status its head carried.
    line = poll_until(lambda: [json.loads(l) for l in open(os.path.join(d, "audit.jsonl"))
                               if "request_id" in l], what="the audit line")[0]
    assert line["status"] == 200 and line["error"]["code"] == "upstream_error", line
    px.stop()


def test_a_gated_stream_cut_mid_event_is_audited_as_the_client_got_it():
    """The gate reads events whole. When the replica fails inside one, that unfinished event is
    not sent (a client could not have used it), and the audit line's response hash covers what
    the client did get, not the bytes it never saw."""
    ev = b'data: {"choices":[{"text":"a"}]}\n\n'
    part = b'data: {"choices":[{"text":"PARTIAL'
    resp = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n"
            % (len(ev), ev, len(part), part))
    up = ScriptedUpstream(lambda k, c, q: (resp, False))
    d = tempfile.mkdtemp(prefix="detproxy-disk-")
    audit = os.path.join(d, "audit.jsonl")
    px = start_proxy(pools=[{"name": "p", "models": ["m1"], "replicas": [
        {"name": "r1", "url": "http://127.0.0.1:%d" % up.port}]}], policy=POLICY,
        log={"level": "info", "audit_path": audit, "audit_fail": "closed"}, directory=d)
    got, clean = stream_raw(px, "cut")
    assert not clean and b"PARTIAL" not in got and b"upstream_error" in got, got[-400:]
    line = poll_until(lambda: [json.loads(l) for l in open(audit) if "request_id" in l],
                      what="the audit line")[0]
    assert line["response_body_sha256"] == hashlib.sha256(ev).hexdigest(), line
    assert line["status"] == 200 and line["error"]["code"] == "upstream_error", line
    px.stop()


def test_a_torn_tail_with_no_room_for_its_repair_line_stops_the_start_and_stays():
    """A crash left a torn tail and the disk is full at the restart: the file is set aside, but
    the new file's repair line cannot be written. Lines chained past a line in no file would
    break the trail (and a stop would lose it for good), so the repair is undone, the torn file
    back at PATH, and detproxy refuses to start (exit 3, saying why). Once there is room, the
    next start repairs it and the trail verifies across the set-aside file and the new one."""
    px = proxy("closed")
    send(px, 2)
    poll_until(lambda: len(open(px.audit_path).readlines()) == 2, what="two lines")
    px.kill()
    with open(px.audit_path, "ab") as f:
        f.write(b'{"time":"2026-01-01T00:00:00.000Z","request_id":"torn')
    raw = open(px.audit_path, "rb").read()
    fill()
    cfg, path = json.load(open(px.config_path)), px.audit_path
    d = os.path.dirname(path)
    why = refused_start(cfg, os.path.dirname(px.config_path))
    assert "could not be written" in why and "back as it was" in why, why
    assert open(path, "rb").read() == raw
    assert not [f for f in os.listdir(d) if f.startswith("audit.jsonl.torn-")], os.listdir(d)
    os.unlink(os.path.join(MNT, "filler"))
    px = start_proxy(config=cfg, directory=os.path.dirname(px.config_path))
    send(px, 1)
    px.stop()
    assert "repair" in json.loads(open(path).readline())
    torn = [os.path.join(d, f) for f in os.listdir(d) if f.startswith("audit.jsonl.torn-")]
    assert len(torn) == 1, os.listdir(d)
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", torn[0], path, "--no-signatures"])
    assert rc == 0, out


def test_a_refused_start_does_not_say_it_continued_the_chain():
    """A rotated file that holds only a torn first write, and no room for its repair line: the
    start is refused (exit 3), and its log does not claim the chain was continued (the head is
    taken, and said, only once the start holds)."""
    px = proxy("closed")
    send(px, 1)
    poll_until(lambda: len(open(px.audit_path).readlines()) == 1, what="the line")
    px.kill()
    path = px.audit_path
    os.rename(path, path + ".1")
    with open(path, "wb") as f:
        f.write(b'{"time":"2026-01-01T00:00:00.000Z","request_id":"torn')
    fill()
    cfg = json.load(open(px.config_path))
    try:
        why = refused_start(cfg, os.path.dirname(px.config_path))
        assert "could not be written" in why and "audit_chain_continued" not in why, why
    finally:
        os.unlink(os.path.join(MNT, "filler"))
    px = start_proxy(config=cfg, directory=os.path.dirname(px.config_path))
    assert px.find_logs("audit_chain_continued"), "the start that holds says it"
    send(px, 1)
    px.stop()
    shutil.rmtree(os.path.dirname(path))  # the 300 KB are the next tests' too


def test_fail_open_serves_and_counts():
    px = proxy("open")
    send(px, 2)
    fill()
    rs = send(px, 40)
    assert all(r.status == 200 for r in rs), [r.status for r in rs]
    metrics = http("GET", px.admin_port, "/metrics").body.decode()
    assert 'detproxy_audit_write_failures_total{action="served"}' in metrics, metrics
    assert http("GET", px.admin_port, "/readyz").status == 200
    os.unlink(os.path.join(MNT, "filler"))
    px.stop()
    rc, out, _ = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--no-signatures"])
    assert rc == 0, out


def test_fail_open_lines_without_stored_bodies_say_so_and_verify():
    """On a full disk a line may still fit the slack of the trail's last page while no body file
    can be made: under "open" that line is written, says "bodies_stored":false, and the trail
    verifies against the store. The counters match the file: lines_written is the lines in it,
    lines_failed and detproxy_audit_write_errors_total the audited requests without one, and the
    store's failures are counted apart."""
    px = proxy("open")
    send(px, 2)
    poll_until(lambda: len(open(px.audit_path).readlines()) == 2, what="two lines")
    fill()
    rs = send(px, 10)
    assert all(r.status == 200 for r in rs), [r.status for r in rs]
    poll_until(lambda: sum(get_json(px.admin_port, "/admin/audit")[k]
                           for k in ("lines_written", "lines_failed")) == 12,
               what="every line written or failed")
    st = get_json(px.admin_port, "/admin/audit")
    lines = [json.loads(l) for l in open(px.audit_path)]
    ids = {l["request_id"] for l in lines}
    served = [r.headers["x-detproxy-request-id"] for r in rs]
    unstored = lines[2:]
    assert unstored, "no line fit the disk after it filled"
    # No body of these could be stored (each needs a new file): each line says so.
    assert all(l.get("bodies_stored") is False for l in unstored), unstored
    assert all(l["request_id"] in served for l in unstored), unstored
    assert all("bodies_stored" not in l for l in lines[:2]), lines[:2]
    assert st["lines_written"] == len(lines), (st, len(lines))
    assert st["lines_failed"] == 12 - len(lines), (st, len(lines))
    assert metric(px, "detproxy_audit_write_errors_total") == 12 - len(lines)
    # Every request on the full disk met a failure: its line, or its bodies, or both.
    assert st["lines_store_failed"] == 10, st
    assert metric(px, "detproxy_audit_store_errors_total") == 10
    assert metric(px, "detproxy_audit_write_failures_total", action="served") == 10
    assert len(set(served) & ids) == len(unstored)
    os.unlink(os.path.join(MNT, "filler"))
    px.stop()
    store = os.path.join(os.path.dirname(px.audit_path), "store")
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--no-signatures",
                            "--store", store])
    assert rc == 0, out + err
    assert "%d lines say their bodies were not stored" % len(unstored) in out, out
    # The marker excuses a missing body, not an altered one.
    h = unstored[0]["forwarded_body_sha256"]
    with open(os.path.join(store, h), "w") as f:
        f.write("not the body")
    rc, out, err = run_cmd([DETPROXY_BIN, "audit", "verify", px.audit_path, "--no-signatures",
                            "--store", store])
    assert rc == 1 and "was altered" in out, (rc, out, err)
    print("open, full disk: %d of 10 served requests have a line, each saying its bodies were "
          "not stored" % len(unstored))


if __name__ == "__main__":
    mount()
    try:
        run_tests(globals())
    finally:
        umount()
