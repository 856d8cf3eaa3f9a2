"""Helpers for tests that run `detproxy run` in front of detproxy-sim replicas.

    sims = [start_sim("--model", "m1") for _ in range(2)]
    px = start_proxy(pools=[pool("p", ["m1"], sims)])
    r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "hi"})
    px.admin_port  # the admin listener
    px.stop()      # SIGTERM, expects exit 0 (and a clean ASan report under DP_SANITIZE)
"""

import json
import os
import socket
import tempfile
import time

from harness import SLOW, DETPROXY_BIN, get_json, http, start_process, wait_http


def replica(name, sim, **extra):
    d = {"name": name, "url": "http://127.0.0.1:%d" % sim.port}
    d.update(extra)
    return d


def pool(name, models, sims, **extra):
    d = {"name": name, "models": models,
         "replicas": [replica("r%d" % (i + 1), s) for i, s in enumerate(sims)]}
    d.update(extra)
    return d


def write_config(cfg, directory=None):
    directory = directory or tempfile.mkdtemp(prefix="detproxy-test-")
    path = os.path.join(directory, "detproxy.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    return path


def start_proxy(pools=None, config=None, limits=None, env=None, directory=None, timeout=10,
                extra_args=(), wrapper=(), ready=True, **top):
    """Start detproxy on ephemeral ports with the given pools (or a whole config dict).
    wrapper: argv prefix that execs the binary (e.g. ["prlimit", "--nofile=64:64"]).
    wrapper: argv prefix (e.g. ["prlimit", "--fsize=600"]).
    ready: wait until /readyz says every pool has an admitted replica (attestation done).
    Returns the Proc with .port (proxy), .admin_port and .config_path."""
    cfg = dict(config or {})
    cfg.setdefault("listen", "127.0.0.1:0")
    cfg.setdefault("admin_listen", "127.0.0.1:0")
    if pools is not None:
        cfg["pools"] = pools
    if limits:
        cfg.setdefault("limits", {}).update(limits)
    cfg.update(top)
    path = write_config(cfg, directory)
    p = start_process(list(wrapper) + [DETPROXY_BIN, "run", "-c", path] + list(extra_args),
                      env=env,
                      name="detproxy", ready_count=2, timeout=timeout)
    p.port = p.listener_port(listener="proxy")
    p.admin_port = p.listener_port(listener="admin")
    p.config_path = path
    if ready:
        wait_http(p.admin_port, "/readyz", timeout=timeout)
    return p


def sim_stats(sim):
    return get_json(sim.port, "/_sim/stats")


def sim_config(sim, **changes):
    r = http("POST", sim.port, "/_sim/config", body=json.dumps(changes),
             headers={"content-type": "application/json"})
    assert r.status == 200, r
    return r


def metric(px, name, **labels):
    """Value of one Prometheus series from /metrics (0 when absent)."""
    text = http("GET", px.admin_port, "/metrics").text
    want = ",".join('%s="%s"' % kv for kv in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        base, _, lab = series.partition("{")
        if base != name:
            continue
        got = ",".join(sorted(x for x in lab.rstrip("}").split(",") if x))
        if got == want:
            return float(value)
    return 0.0


# ---- raw-socket helpers for bad-input and fault tests ----------------------------------------


def sim_reset(sim):
    """Zero the sim's counters and forget its recorded requests."""
    r = http("POST", sim.port, "/_sim/reset", body=b"")
    assert r.status == 200, r


def sim_requests(sim):
    """Every request (any route) the sim received completely since the last reset (max 64)."""
    return get_json(sim.port, "/_sim/requests")["requests"]


def rss_kb(proc):
    """Resident set size of a started process, from /proc/PID/status."""
    with open("/proc/%d/status" % proc.popen.pid) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS for pid %d" % proc.popen.pid)


def read_until_close(s, timeout=10):
    """Read from socket s until the peer closes. Returns (bytes, closed): closed is False when
    the timeout passed first. A reset counts as closed."""
    out = b""
    deadline = time.monotonic() + timeout * SLOW
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return out, False
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return out, False
        except (ConnectionResetError, BrokenPipeError):
            return out, True
        if not chunk:
            return out, True
        out += chunk


def exchange(port, data, timeout=10, host="127.0.0.1"):
    """Send raw bytes on a fresh connection (without half-closing) and read until the server
    closes or the timeout passes: (bytes, closed)."""
    with socket.create_connection((host, port), timeout=timeout * SLOW) as s:
        s.sendall(data)
        return read_until_close(s, timeout)


class RawResponse:
    """One HTTP/1.1 response cut out of raw bytes: status, headers (lowercased names, last
    wins), body (de-chunked when chunked and complete), raw (its bytes), complete (framing
    ended), rest (bytes after it)."""

    def __init__(self, status, headers, body, raw, complete, rest):
        self.status, self.headers, self.body = status, headers, body
        self.raw, self.complete, self.rest = raw, complete, rest

    def json(self):
        return json.loads(self.body.decode("utf-8"))

    def __repr__(self):
        return "<RawResponse %s complete=%s %r>" % (self.status, self.complete, self.raw[:300])


def parse_response(data):
    """Parse the first response in data (see RawResponse). Raises AssertionError when data
    does not start with a well-formed status line and head."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, "no complete response head in %r" % data[:300]
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    assert parts[0] == b"HTTP/1.1" and len(parts) >= 2 and parts[1].isdigit(), lines[0]
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(b":")
        headers[k.strip().lower().decode()] = v.strip().decode("latin-1")
    status = int(parts[1])
    if headers.get("transfer-encoding") == "chunked":
        body, pos = b"", 0
        while True:
            eol = rest.find(b"\r\n", pos)
            if eol < 0:
                return RawResponse(status, headers, body, data, False, b"")
            size = int(rest[pos:eol].split(b";")[0], 16)
            if size == 0:
                end = rest.find(b"\r\n\r\n", eol)
                if end < 0:
                    return RawResponse(status, headers, body, data, False, b"")
                n = len(data) - len(rest) + end + 4
                return RawResponse(status, headers, body, data[:n], True, rest[end + 4:])
            if len(rest) < eol + 2 + size + 2:
                body += rest[eol + 2:eol + 2 + size]
                return RawResponse(status, headers, body, data, False, b"")
            body += rest[eol + 2:eol + 2 + size]
            pos = eol + 2 + size + 2
    if "content-length" in headers:
        cl = int(headers["content-length"])
        n = len(data) - len(rest) + min(cl, len(rest))
        return RawResponse(status, headers, rest[:cl], data[:n], len(rest) >= cl, rest[cl:])
    return RawResponse(status, headers, rest, data, False, b"")


def assert_openai_error(resp, status, code=None):
    """resp (RawResponse or harness Response) is `status` with an OpenAI-shaped JSON error."""
    assert resp.status == status, resp
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    if code is not None:
        assert err["code"] == code, err
    return err
