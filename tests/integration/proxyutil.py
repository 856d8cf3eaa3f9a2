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
import threading
import time

from harness import SLOW, DETPROXY_BIN, get_json, http, poll_until, start_process, wait_http


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
        settle_attestation(p, timeout)
    return p


def settle_attestation(p, timeout):
    """/readyz is 200 once every pool has one admitted replica; on a loaded box the others may
    still be pending. Wait (best effort: tests of slow attestation go on regardless) until no
    replica is pending, so tests that spread load over every replica see them all."""
    def settled():
        r = http("GET", p.admin_port, "/admin/replicas")
        return r.status != 200 or all(x["state"] != "pending" for x in r.json()["replicas"])
    try:
        poll_until(settled, timeout=min(timeout, 5), what="every replica attested")
    except AssertionError:
        pass


def in_parallel(n, fn, workers=2, until=None):
    """Call fn(i) for i in range(n), spread over `workers` threads; each thread stops early once
    until() is true."""
    def worker(k):
        for i in range(k, n, workers):
            if until and until():
                return
            fn(i)
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(workers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def wait_all_admitted(p, timeout=10):
    """Wait until every replica is admitted, for tests whose assertions need each one in
    rotation (load spread, pick order, shadow targets): settle_attestation gives up after a few
    seconds, and a loaded box may take longer (or fail one attestation and retry it)."""
    poll_until(lambda: all(x["state"] == "admitted" for x in
                           get_json(p.admin_port, "/admin/replicas")["replicas"]),
               timeout=timeout, what="every replica admitted")


def sim_stats(sim):
    return get_json(sim.port, "/_sim/stats")


def generating(port, target, body, sim, headers=b""):
    """POST body to target on a connection of its own; the connection, once the sim generates
    the request."""
    c = socket.create_connection(("127.0.0.1", port))
    c.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % (target, headers, len(body)) + body)
    poll_until(lambda: sim_stats(sim)["inflight"] == 1, what="the generation running")
    return c


def sim_config(sim, **changes):
    r = http("POST", sim.port, "/_sim/config", body=json.dumps(changes),
             headers={"content-type": "application/json"})
    assert r.status == 200, r
    return r


def metric(px, name, **labels):
    """Sum of the Prometheus series of `name` from /metrics whose labels include `labels` (0
    when none): metric(px, "detproxy_requests_total", pool="p", status="200") adds up every
    tenant and code."""
    text = http("GET", px.admin_port, "/metrics").text
    want = set('%s="%s"' % kv for kv in labels.items())
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        base, _, lab = series.partition("{")
        if base != name:
            continue
        got = set(x for x in lab.rstrip("}").split(",") if x)
        if want <= got:
            total += float(value)
    return total


# ---- raw-socket helpers for bad-input and fault tests ----------------------------------------


def sim_reset(sim):
    """Zero the sim's counters and forget its recorded requests."""
    r = http("POST", sim.port, "/_sim/reset", body=b"")
    assert r.status == 200, r


def sim_requests(sim):
    """Every request (any route) the sim received completely since the last reset (max 64)."""
    return get_json(sim.port, "/_sim/requests")["requests"]


def client_requests(sim):
    """The requests the sim received on behalf of clients (they carry the request id the proxy
    adds), leaving out the proxy's own attestation and canary traffic."""
    return [q for q in sim_requests(sim) if "x-detproxy-request-id" in q["headers"]]


def rss_kb(proc, field="VmRSS"):
    """Resident set size of a started process (field="VmHWM": its peak), from /proc/PID/status."""
    with open("/proc/%d/status" % proc.popen.pid) as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise AssertionError("no %s for pid %d" % (field, proc.popen.pid))


def _tcp_queue(local_port, remote_port, which):
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if (int(fields[1].split(":")[1], 16) == local_port and
                    int(fields[2].split(":")[1], 16) == remote_port):
                return int(fields[4].split(":")[which], 16)
    return None


def send_queue(local_port, remote_port):
    """Bytes the kernel holds unsent or unacknowledged on a loopback TCP socket, from
    /proc/net/tcp (its tx_queue), or None when there is no such socket."""
    return _tcp_queue(local_port, remote_port, 0)


def recv_queue(local_port, remote_port):
    """Bytes received on a loopback TCP socket that its owner has not read yet (rx_queue), or
    None when there is no such socket."""
    return _tcp_queue(local_port, remote_port, 1)


def wait_send_queue_full(local_port, remote_port, quiet=0.3, timeout=30):
    """Until the kernel's send queue to a peer that stopped reading holds still for `quiet`
    seconds, scaled by SLOW as a slower build fills it in longer pauses (it holds all it will):
    that size. An empty queue does not count as still: the sender may not have written yet."""
    last, since = None, time.monotonic()
    deadline = since + timeout * SLOW
    quiet *= SLOW
    while not last or time.monotonic() - since < quiet:
        assert time.monotonic() < deadline, "the kernel's send queue never filled and held still"
        q = send_queue(local_port, remote_port)
        if q != last:
            last, since = q, time.monotonic()
        time.sleep(0.02)
    return last


def read_response(s, timeout=10):
    """Read one whole response from s (keep-alive: the connection stays open)."""
    data = b""
    deadline = time.monotonic() + timeout * SLOW
    while time.monotonic() < deadline:
        if b"\r\n\r\n" in data and parse_response(data).complete:
            return parse_response(data)
        s.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    return parse_response(data)


def read_until_close(s, timeout=10):
    """Read from socket s until the peer closes. Returns (bytes, closed): closed is False when
    the timeout passed first. A reset counts as closed."""
    out = bytearray()
    deadline = time.monotonic() + timeout * SLOW
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return bytes(out), False
        s.settimeout(left)
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return bytes(out), False
        except (ConnectionResetError, BrokenPipeError):
            return bytes(out), True
        if not chunk:
            return bytes(out), True
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
        body, pos = bytearray(), 0
        while True:
            eol = rest.find(b"\r\n", pos)
            if eol < 0:
                return RawResponse(status, headers, bytes(body), data, False, b"")
            size = int(rest[pos:eol].split(b";")[0], 16)
            if size == 0:
                end = rest.find(b"\r\n\r\n", eol)
                if end < 0:
                    return RawResponse(status, headers, bytes(body), data, False, b"")
                n = len(data) - len(rest) + end + 4
                return RawResponse(status, headers, bytes(body), data[:n], True, rest[end + 4:])
            body += rest[eol + 2:eol + 2 + size]
            if len(rest) < eol + 2 + size + 2:
                return RawResponse(status, headers, bytes(body), data, False, b"")
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


# ---- a scripted replica ----------------------------------------------------------------------


def read_request(s, buf=b""):
    """Read one request (head, then a Content-Length body) from socket s, starting with the
    bytes already in buf: (head, body, rest), or None when the peer closed first."""
    buf = bytearray(buf)  # appended to in place: a body of megabytes is not copied per read
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\r\n\r\n")
    head, buf = bytes(buf[:end]), buf[end + 4:]
    cl = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            cl = int(v)
    while len(buf) < cl:
        chunk = s.recv(65536)
        if not chunk:
            return None
        buf += chunk
    return head, bytes(buf[:cl]), bytes(buf[cl:])


def serve_connections(lsock, handle):
    """Accept on lsock until it is closed; handle(conn) runs on a thread per connection."""
    def loop():
        while True:
            try:
                c, _ = lsock.accept()
            except OSError:
                return
            threading.Thread(target=handle, args=(c,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()


def serve_until_stream(c):
    """A replica's side of connection c for a test that writes a stream itself: GETs (the
    proxy's reachability attestation) are answered with ScriptedUpstream.MODELS, and the first
    other request with a chunked text/event-stream head. True then (the caller writes the
    chunks), False when the proxy closed first."""
    buf = b""
    while True:
        r = read_request(c, buf)
        if r is None:
            return False
        head, _, buf = r
        if not head.startswith(b"GET"):
            c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                      b"Transfer-Encoding: chunked\r\n\r\n")
            return True
        models = ScriptedUpstream.MODELS
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(models) + models)


def serve_replica(handle, model="m1"):
    """A replica played by handle(conn), on a thread per connection: (its listening socket,
    pool "p" of it serving model). Close the socket to stop it."""
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 0))
    ls.listen(16)
    serve_connections(ls, handle)
    url = "http://127.0.0.1:%d" % ls.getsockname()[1]
    return ls, {"name": "p", "models": [model], "replicas": [{"name": "r1", "url": url}]}


def keepalive_race(px, close, method, path, body, headers=None):
    """The keep-alive race, made to happen: the replica closes a pooled connection (close(),
    a FIN) just as a request for it arrives, before the proxy has seen the close. The proxy is
    stopped (SIGSTOP) while the request arrives on a keep-alive client connection opened here
    and then the replica's close, so it sees the request first when it runs again. Returns the
    answer (status, headers, body) to that request."""
    import http.client
    import signal
    c = http.client.HTTPConnection("127.0.0.1", px.port, timeout=30 * SLOW)
    c.request("GET", "/v1/models")  # answered by the proxy: the client connection is open
    c.getresponse().read()
    px.send_signal(signal.SIGSTOP)
    try:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        c.request(method, path, body=data,
                  headers=dict({"Content-Type": "application/json"}, **(headers or {})))
        close()
    finally:
        px.send_signal(signal.SIGCONT)
    r = c.getresponse()
    out = (r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
    c.close()
    return out


class ScriptedUpstream:
    """A replica played by a few lines of Python on a socket (as HAProxy's reg-tests do), for
    bytes detproxy-sim cannot produce. GET /v1/models (the proxy's reachability attestation)
    is answered 200 and not recorded. Every other request is answered by
    script(k, conn_no, req_no) -> (bytes to send, keep_open), k counting those requests.

    .requests: (conn_no, req_no, head bytes) per scripted request; .events: (conn_no, what)
    with what "head:<target>" as soon as a head arrives (before its body) and "closed" when
    the peer closes; .connections: accepted so far. With read_bodies=False it reads nothing
    after a scripted request's head (a replica that stopped reading the upload)."""

    MODELS = (b'{"object":"list","data":[{"id":"m1","object":"model","created":1,'
              b'"owned_by":"scripted"}]}')

    def __init__(self, script, read_bodies=True):
        self.script = script
        self.read_bodies = read_bodies  # False: after a scripted head, stop reading (stall)
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.connections = 0
        self.requests = []
        self.events = []
        self.peers = {}  # conn_no -> the proxy's port
        self.lock = threading.Lock()
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                s, peer = self.lsock.accept()
            except OSError:
                return
            with self.lock:
                n = self.connections
                self.connections += 1
                self.socks.append(s)
                # accept()'s own peer address: the connection may already be reset (the proxy
                # aborts cancelled exchanges with RST), and getpeername() would then fail.
                self.peers[n] = peer[1]
            threading.Thread(target=self._serve, args=(s, n), daemon=True).start()

    def _event(self, conn_no, what):
        with self.lock:
            self.events.append((conn_no, what))

    def _serve(self, s, conn_no):
        buf = b""
        req_no = 0
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    chunk = s.recv(65536)
                    if not chunk:
                        self._event(conn_no, "closed")
                        return
                    buf += chunk
                head, _, buf = buf.partition(b"\r\n\r\n")
                target = head.split(b" ")[1].decode("latin-1")
                self._event(conn_no, "head:" + target)
                if not self.read_bodies and not head.startswith(b"GET /v1/models "):
                    return  # the socket stays open in self.socks, never read again
                cl = 0
                for line in head.split(b"\r\n")[1:]:
                    k, _, v = line.partition(b":")
                    if k.strip().lower() == b"content-length":
                        cl = int(v)
                while len(buf) < cl:
                    chunk = s.recv(65536)
                    if not chunk:
                        self._event(conn_no, "closed")
                        return
                    buf += chunk
                buf = buf[cl:]
                if head.startswith(b"GET /v1/models "):
                    s.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n" % len(self.MODELS) + self.MODELS)
                    continue
                with self.lock:
                    k = len(self.requests)
                    self.requests.append((conn_no, req_no, head))
                out, keep = self.script(k, conn_no, req_no)
                s.sendall(out)
                req_no += 1
                if not keep:
                    s.close()
                    self._event(conn_no, "closed")
                    return
        except OSError:
            self._event(conn_no, "closed")

    def close_conn(self, conn_no):
        """Close connection conn_no now, as a server's idle timeout does (a FIN; nothing unread
        is left to turn it into a reset)."""
        with self.lock:
            s = self.socks[conn_no]
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()

    def peer_closed(self, conn_no):
        """True once the proxy closed connection conn_no, even if this side reads nothing:
        the socket is in CLOSE_WAIT (FIN received) or gone (reset), per /proc/net/tcp."""
        local = "0100007F:%04X" % self.port
        remote = "0100007F:%04X" % self.peers[conn_no]
        with open("/proc/net/tcp") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1] == local and fields[2] == remote:
                    return fields[3] in ("07", "08")  # CLOSE, CLOSE_WAIT
        return True

    def conn_events(self, conn_no):
        with self.lock:
            return [w for c, w in self.events if c == conn_no]

    def stop(self):
        self.lsock.close()
        with self.lock:
            for s in self.socks:
                try:
                    s.close()
                except OSError:
                    pass




def slots_answer(*processing):
    """llama.cpp's GET /slots: one object per slot (b11669's fields, params left out)."""
    return json.dumps([{"id": i, "n_ctx": 512, "speculative": False, "is_processing": p}
                       for i, p in enumerate(processing)]).encode()

class FrontCutter:
    """A proxy in front of an engine that can cut only detproxy's side of a connection, as a
    gateway that restarts or times out does: cut(conn_no) closes the connection toward detproxy
    and keeps reading the engine's answer to its end (dropping it), so the engine generates on
    as it would behind such a gateway. .targets[conn_no]: the request lines forwarded on it;
    .answered[conn_no]: bytes of answer it carried toward detproxy; .slot_looks: GET /slots
    requests (llama.cpp's list of what its slots do) seen. With .slots set to a function
    (request head bytes) -> (status, body bytes[, seconds per byte]), a connection that opens
    with GET /slots is answered by it instead of the engine (its body a byte at a time with
    the third). With .cut_when set to (target prefix, n), a connection that
    carried such a request is cut as soon as n bytes of answer have gone through it."""

    def __init__(self, port):
        self.to = port
        self.lsock = socket.socket()
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.port = self.lsock.getsockname()[1]
        self.lock = threading.Lock()
        self.conns = []  # (socket toward detproxy, socket toward the engine)
        self.targets = {}
        self.answered = {}
        self.cut_conns = set()
        self.slots = None
        self.slot_looks = 0
        self.cut_when = None
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                down, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(down,), daemon=True).start()

    def _note(self, n, data):
        for line in data.split(b"\r\n"):
            if line.split(b" ")[0] in (b"GET", b"POST"):
                with self.lock:
                    self.targets[n].append(line.decode("latin-1"))
                    self.slot_looks += line.startswith(b"GET /slots ")

    def _serve(self, down):
        try:
            first = down.recv(65536)
        except OSError:
            first = b""
        if not first:
            down.close()
            return
        if self.slots is not None and first.startswith(b"GET /slots "):
            self._answer_slots(down, first)
            return
        try:
            up = socket.create_connection(("127.0.0.1", self.to))
        except OSError:  # the engine is gone: so is the connection
            down.close()
            return
        with self.lock:
            n = len(self.conns)
            self.conns.append((down, up))
            self.targets[n] = []
            self.answered[n] = 0
        self._note(n, first)
        up.sendall(first)
        threading.Thread(target=self._answers, args=(n, down, up), daemon=True).start()
        try:
            while True:
                data = down.recv(65536)
                if not data:
                    break
                self._note(n, data)
                up.sendall(data)
        except OSError:
            pass
        with self.lock:
            if n in self.cut_conns:
                return  # the engine's side stays open: its answer is read on
        try:
            up.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _answer_slots(self, down, buf):
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = down.recv(65536)
                    if not data:
                        down.close()
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                status, body, *drip = self.slots(head)
                with self.lock:
                    self.slot_looks += 1
                down.sendall(b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % (status, len(body)))
                if not drip:
                    down.sendall(body)
                for i in range(len(body) if drip else 0):
                    down.sendall(body[i:i + 1])
                    time.sleep(drip[0])
        except OSError:
            pass

    def _answers(self, n, down, up):
        try:
            while True:
                data = up.recv(65536)
                if not data:
                    break
                with self.lock:
                    cut = n in self.cut_conns
                    if not cut:
                        self.answered[n] += len(data)
                if not cut:
                    down.sendall(data)
                    when = self.cut_when
                    if when and self.answered[n] >= when[1] and any(
                            t.startswith(when[0]) for t in self.targets[n]):
                        self.cut_when = None
                        self.cut(n)
        except OSError:
            pass
        with self.lock:
            cut = n in self.cut_conns
        up.close()
        if not cut:  # the engine closed: so does the front (a shutdown: _serve still reads it)
            try:
                down.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            down.close()

    def conn_of(self, target_prefix):
        """The last connection that carried a request line starting with target_prefix."""
        with self.lock:
            found = [n for n, ts in self.targets.items()
                     if any(t.startswith(target_prefix) for t in ts)]
        return found[-1] if found else None

    def cut(self, conn_no):
        with self.lock:
            self.cut_conns.add(conn_no)
            down = self.conns[conn_no][0]
        try:
            down.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        down.close()

    def stop(self):
        self.lsock.close()
