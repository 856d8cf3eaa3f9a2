"""Black-box test harness for detproxy's integration tests (python3 stdlib only).

Starts the real binaries on loopback, waits for their JSON "listening" log line, talks HTTP to
them, and cleans up. Reused by every tests/integration/test_*.py.

    from harness import *

    sim = start_sim("--flavor", "tgi", "--token-delay-ms", "5")  # port 0, waits for readiness
    r = http("GET", sim.port, "/info")                            # -> Response
    assert r.status == 200 and r.json()["model_dtype"] == "torch.float16"
    for t, data in sse(sim.port, "/v1/completions", {"prompt": "x", "stream": True}):
        ...
    sim.stop()                                                    # SIGTERM, expects exit 0

    if __name__ == "__main__":
        run_tests(globals())   # runs every test_* function, prints "N passed, N failed"

Processes: `start_process(argv)` spawns with stderr piped into a reader thread that parses JSON
log lines (`proc.logs`, `proc.wait_log(...)`); readiness is the first line whose "msg" is
"listening" (its "port" becomes `proc.port`; with ready_count=N it waits for N such lines, all in
`proc.listeners`, and `proc.listener_port(field=value)` picks one). Every process is killed at exit (atexit), so a
failing test never leaves a server behind. Under the sanitizer build (DP_SANITIZE=1) timeouts
are scaled by SLOW and `stop()` fails on any AddressSanitizer/LeakSanitizer report; under
ThreadSanitizer (DP_TSAN=1) on any data race it reports.
"""

import atexit
import http.client as _hc
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

SOURCE_DIR = os.environ.get(
    "DP_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
SANITIZE = os.environ.get("DP_SANITIZE", "0").lower() in ("1", "true", "on", "yes")
# DP_TSAN=1 (make test SANITIZE=thread): a ThreadSanitizer warning fails the test at stop().
TSAN = os.environ.get("DP_TSAN", "0").lower() in ("1", "true", "on", "yes")
# DP_VALGRIND=1 (make valgrind): every `detproxy run` starts under memcheck; a process whose
# log reports an error or a definite leak fails its test at stop(), like a sanitizer report.
VALGRIND = os.environ.get("DP_VALGRIND", "0").lower() in ("1", "true", "on", "yes")
SLOW = 10.0 if VALGRIND else 4.0 if SANITIZE or TSAN else 1.0  # multiply timeouts by this
_VG_DIR = os.path.join(os.environ.get("DP_ARTIFACT_DIR") or "/tmp", "valgrind")
_vg_seq = itertools.count()  # names each memcheck log: one file per detproxy process


def _default_bin(name):
    for build in ("build/release", "build/debug", "build/asan", "build"):
        for sub in ("tests/sim", "proxy", ""):
            p = os.path.join(SOURCE_DIR, build, sub, name)
            if os.access(p, os.X_OK):
                return p
    return name


SIM_BIN = os.environ.get("DETPROXY_SIM_BIN") or _default_bin("detproxy-sim")
DETPROXY_BIN = os.environ.get("DETPROXY_BIN") or _default_bin("detproxy")

# Every temporary file and directory a test process makes through tempfile's defaults lands in
# one directory of its own, removed when that process exits, so a run leaves nothing behind in
# /tmp. Only this module's process removes it (a child forked from it runs no cleanup of its
# own). DP_KEEP_TMP=1 keeps it and prints where it is, to look at after a failure.
_TMP_OWNER = os.getpid()
_TMP_ROOT = tempfile.mkdtemp(prefix="dp-run-")
os.chmod(_TMP_ROOT, 0o711)  # traversable, as /tmp is, by the other uids some tests run as
tempfile.tempdir = _TMP_ROOT


@atexit.register
def _remove_tmp():
    if os.getpid() != _TMP_OWNER:
        return
    if os.environ.get("DP_KEEP_TMP", "0").lower() in ("1", "true", "on", "yes"):
        print("DP_KEEP_TMP: kept %s" % _TMP_ROOT, file=sys.stderr)
        return
    shutil.rmtree(_TMP_ROOT, ignore_errors=True)


_live = []  # every Proc not yet reaped
_given = set()  # ports free_port returned in this process


def free_port(host="127.0.0.1"):
    """A port that was free a moment ago. Prefer port 0 + the "listening" line where the binary
    supports it: this one can race with other processes. It is drawn at random below the
    kernel's ephemeral range (ip_local_port_range starts at 32768), where no bind to port 0 or
    outgoing connection of another test can take it before its user listens."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        if port in _given:  # given out already, maybe not listened on yet
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            _given.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ProcError(Exception):
    pass


class Proc:
    """A started binary. Attributes: argv, popen, port (from the "listening" line), logs (list
    of parsed JSON log lines), lines (every raw stderr line), returncode (after stop/kill)."""

    def __init__(self, argv, env=None, name=None, ready_msg="listening", ready_count=1,
                 stdin=None):
        self.argv = [str(a) for a in argv]
        self.name = name or os.path.basename(self.argv[0])
        self.vg_log = None
        if VALGRIND and os.path.basename(self.argv[0]) == "detproxy" and "run" in self.argv[1:2]:
            os.makedirs(_VG_DIR, exist_ok=True)
            self.vg_log = os.path.join(_VG_DIR, "%s.%d.%d.log" % (  # one per process started
                os.path.basename(sys.argv[0]).replace(".py", ""), os.getpid(), next(_vg_seq)))
            self.argv = ["valgrind", "-q", "--leak-check=full", "--show-leak-kinds=definite",
                         "--errors-for-leak-kinds=definite", "--error-exitcode=97",
                         "--fair-sched=yes", "--log-file=" + self.vg_log] + self.argv
        self.ready_msg = ready_msg
        self.ready_count = ready_count
        self.logs = []
        self.lines = []
        self.listeners = []  # every ready line with a "port", in order
        self.port = None     # the first one's port
        self.addr = None
        self.returncode = None
        self._cond = threading.Condition()
        self._eof = False
        full_env = dict(os.environ)
        if env:
            full_env.update(env)
        self.popen = subprocess.Popen(
            self.argv, stdin=stdin if stdin is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env)
        _live.append(self)
        # Drain both pipes always: a full pipe would block the child's logging.
        self._t_err = threading.Thread(target=self._read_stderr, daemon=True)
        self._t_out = threading.Thread(target=self._read_stdout, daemon=True)
        self.stdout = bytearray()
        self._t_err.start()
        self._t_out.start()

    def _read_stdout(self):
        for chunk in iter(lambda: self.popen.stdout.read1(65536), b""):
            with self._cond:
                self.stdout += chunk

    def _read_stderr(self):
        for raw in iter(self.popen.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            rec = None
            if line.startswith("{"):
                try:
                    rec = json.loads(line)
                except ValueError:
                    rec = None
            with self._cond:
                self.lines.append(line)
                if isinstance(rec, dict):
                    self.logs.append(rec)
                    if rec.get("msg") == self.ready_msg and "port" in rec:
                        self.listeners.append(rec)
                        if self.port is None:
                            self.port = int(rec["port"])
                            self.addr = rec.get("addr")
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def stderr_text(self):
        with self._cond:
            return "\n".join(self.lines)

    def wait_ready(self, timeout=10):
        """Block until ready_count ready lines arrived; raise if the process died first."""
        deadline = time.monotonic() + timeout * SLOW
        with self._cond:
            while len(self.listeners) < self.ready_count:
                if self._eof or self.popen.poll() is not None:
                    # Gone: what it said last may still be in the pipe until the reader's EOF.
                    eof_by = time.monotonic() + 5
                    while not self._eof and time.monotonic() < eof_by:
                        self._cond.wait(0.2)
                    raise ProcError("%s exited (rc=%s) before it was ready:\n%s" % (
                        self.name, self.popen.poll(), "\n".join(self.lines[-20:])))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProcError("%s not ready after %.0fs:\n%s" % (
                        self.name, timeout * SLOW, "\n".join(self.lines[-20:])))
                self._cond.wait(min(left, 0.2))
        return self

    def wait_log(self, match, timeout=10, start=0):
        """Wait for a JSON log line: match is a msg string or a predicate(dict). Searches
        logs[start:]; returns the line."""
        pred = match if callable(match) else (lambda r: r.get("msg") == match)
        deadline = time.monotonic() + timeout * SLOW
        with self._cond:
            while True:
                for rec in self.logs[start:]:
                    if pred(rec):
                        return rec
                if self._eof:
                    raise ProcError("%s ended without log %r" % (self.name, match))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProcError("no log %r from %s within %.0fs" % (match, self.name,
                                                                       timeout * SLOW))
                self._cond.wait(min(left, 0.2))

    def listener_port(self, **fields):
        """Port of the first ready line whose fields match, e.g. listener_port(name="admin")."""
        with self._cond:
            for rec in self.listeners:
                if all(rec.get(k) == v for k, v in fields.items()):
                    return int(rec["port"])
        raise ProcError("%s: no listening line with %r among %r" % (self.name, fields,
                                                                    self.listeners))

    def find_logs(self, msg):
        with self._cond:
            return [r for r in self.logs if r.get("msg") == msg]

    def alive(self):
        return self.popen.poll() is None

    def send_signal(self, sig):
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout=10):
        try:
            self.returncode = self.popen.wait(timeout=timeout * SLOW)
        except subprocess.TimeoutExpired:
            raise ProcError("%s did not exit within %.0fs" % (self.name, timeout * SLOW))
        self._t_err.join(timeout=5)
        self._t_out.join(timeout=5)
        if self in _live:
            _live.remove(self)
        return self.returncode

    def stop(self, sig=signal.SIGTERM, timeout=10, expect_rc=0):
        """Signal and wait; check the exit code (None skips the check) and, under sanitizers,
        that no sanitizer report was printed. Returns the exit code."""
        if self.returncode is not None:
            return self.returncode
        self.send_signal(sig)
        try:
            rc = self.wait(timeout)
        except ProcError:
            self.kill()
            raise
        self.check_sanitizer()
        if expect_rc is not None and rc != expect_rc:
            raise ProcError("%s exited %s, want %s:\n%s" % (
                self.name, rc, expect_rc, "\n".join(self.lines[-30:])))
        return rc

    def check_sanitizer(self):
        if self.vg_log and os.path.exists(self.vg_log):
            with open(self.vg_log, errors="replace") as f:
                report = f.read()
            if report.strip():
                raise ProcError("%s: valgrind report (%s):\n%s" % (self.name, self.vg_log,
                                                                     report[-6000:]))
        text = self.stderr_text()
        for marker in ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:",
                       "WARNING: ThreadSanitizer"):
            at = text.find(marker)
            if at >= 0:  # the report from its first line (log lines may follow it)
                raise ProcError("%s: sanitizer report:\n%s" % (self.name,
                                                                 text[max(0, at - 200):at + 8000]))

    def kill(self):
        if self.alive():
            self.popen.kill()
        try:
            self.returncode = self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self in _live:
            _live.remove(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.stop()
        else:
            self.kill()


def start_process(argv, env=None, name=None, ready_msg="listening", ready_count=1, timeout=10):
    """Spawn argv and wait for ready_count {"msg": ready_msg, "port": N} log lines (a proxy with
    an admin listener logs two: ready_count=2, then proc.listener_port(...))."""
    p = Proc(argv, env=env, name=name, ready_msg=ready_msg, ready_count=ready_count)
    try:
        p.wait_ready(timeout)
    except Exception:
        p.kill()
        raise
    return p


def start_sim(*flags, listen="127.0.0.1:0", name="detproxy-sim", env=None, timeout=10):
    """Start detproxy-sim on a free port (flags as separate strings)."""
    argv = [SIM_BIN, "--listen", listen] + [str(f) for f in flags]
    return start_process(argv, env=env, name=name, timeout=timeout)


def run_cmd(argv, timeout=30, input=None, env=None):
    """Run a command to completion: (returncode, stdout str, stderr str)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    cp = subprocess.run([str(a) for a in argv], input=input, capture_output=True,
                        timeout=timeout * SLOW, env=full_env)
    return cp.returncode, cp.stdout.decode("utf-8", "replace"), cp.stderr.decode("utf-8",
                                                                                  "replace")


@atexit.register
def _cleanup():
    for p in list(_live):
        try:
            p.kill()
        except Exception:
            pass


# ---- HTTP ------------------------------------------------------------------------------------


class Response:
    def __init__(self, status, reason, headers, body):
        self.status = status
        self.reason = reason
        self.header_list = headers  # [(name lowercased, value)] in order, repeats kept
        self.headers = {}
        for k, v in headers:
            self.headers[k] = v if k not in self.headers else self.headers[k] + ", " + v
        self.body = body

    def json(self):
        return json.loads(self.body.decode("utf-8"))

    @property
    def text(self):
        return self.body.decode("utf-8", "replace")

    def __repr__(self):
        return "<Response %d %r>" % (self.status, self.body[:200])


def _body_bytes(body):
    if body is None:
        return None, None
    if isinstance(body, (bytes, bytearray)):
        return bytes(body), None
    if isinstance(body, str):
        return body.encode(), None
    return json.dumps(body).encode(), "application/json"


def http(method, port, path, body=None, headers=None, host="127.0.0.1", timeout=30):
    """One request on a fresh connection. body: bytes, str, or a JSON-serialisable object."""
    data, ctype = _body_bytes(body)
    hdrs = dict(headers or {})
    if ctype and not any(k.lower() == "content-type" for k in hdrs):
        hdrs["Content-Type"] = ctype
    conn = _hc.HTTPConnection(host, port, timeout=timeout * SLOW)
    try:
        conn.request(method, path, body=data, headers=hdrs)
        r = conn.getresponse()
        body_bytes = r.read()
        return Response(r.status, r.reason, [(k.lower(), v) for k, v in r.getheaders()],
                        body_bytes)
    finally:
        conn.close()


def get_json(port, path, **kw):
    r = http("GET", port, path, **kw)
    if r.status != 200:
        raise AssertionError("GET %s -> %d %s" % (path, r.status, r.text[:300]))
    return r.json()


def post_json(port, path, obj, **kw):
    return http("POST", port, path, body=obj, **kw)


def sse(port, path, body, headers=None, host="127.0.0.1", timeout=30, on_open=None):
    """POST body and yield (monotonic time, data string) per SSE event as it arrives, ending
    after "[DONE]" or at the end of the stream. on_open(response) is called once the head is
    read (check status and headers there)."""
    data, ctype = _body_bytes(body)
    hdrs = dict(headers or {})
    if ctype:
        hdrs.setdefault("Content-Type", ctype)
    conn = _hc.HTTPConnection(host, port, timeout=timeout * SLOW)
    try:
        conn.request("POST", path, body=data, headers=hdrs)
        r = conn.getresponse()
        if on_open:
            on_open(r)
        buf = b""
        while True:
            chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
            if not chunk:
                break
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                for line in ev.split(b"\n"):
                    if line.startswith(b"data: "):
                        d = line[6:].decode("utf-8")
                        yield time.monotonic(), d
                        if d == "[DONE]":
                            return
    finally:
        conn.close()


def wait_http(port, path="/health", timeout=10, host="127.0.0.1", ok=(200,)):
    """Poll until GET path answers with a status in ok (for binaries without a log line)."""
    deadline = time.monotonic() + timeout * SLOW
    last = None
    while time.monotonic() < deadline:
        try:
            r = http("GET", port, path, host=host, timeout=2)
            if r.status in ok:
                return r
            last = r.status
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise ProcError("GET %s:%d%s not ready: %r" % (host, port, path, last))


def connect_from(port, source="127.0.0.1"):
    """A connection to 127.0.0.1:port from `source`: any 127.0.0.0/8 address is loopback on
    Linux, so tests get distinct client addresses without leaving the machine."""
    s = socket.socket()
    s.settimeout(10 * SLOW)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def raw_request(port, data, host="127.0.0.1", timeout=10, read=True, shutdown_write=False):
    """Send raw bytes on a fresh TCP connection; return everything read until the peer closes
    or the timeout passes (b"" if read is False). For malformed-HTTP tests."""
    with socket.create_connection((host, port), timeout=timeout * SLOW) as s:
        s.sendall(data)
        if shutdown_write:
            s.shutdown(socket.SHUT_WR)
        if not read:
            return b""
        out = b""
        s.settimeout(timeout * SLOW)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except socket.timeout:
            pass
        except ConnectionResetError:
            pass
        return out


def poll_until(fn, timeout=10, interval=0.05, what="condition"):
    """Call fn until it returns a truthy value; return it, or raise after timeout."""
    deadline = time.monotonic() + timeout * SLOW
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise AssertionError("timed out waiting for %s" % what)
        time.sleep(interval)


# ---- a tiny test runner ------------------------------------------------------------------------


def run_tests(namespace, argv=None):
    """Run every callable named test_* in namespace (in definition order), or only those named
    on the command line. Prints one line per test and "N passed, N failed"; exits 1 on any
    failure."""
    argv = sys.argv[1:] if argv is None else argv
    tests = [(n, f) for n, f in namespace.items() if n.startswith("test_") and callable(f)]
    if argv:
        tests = [(n, f) for n, f in tests if n in argv or any(a in n for a in argv)]
    passed = failed = 0
    for name, fn in tests:
        t0 = time.monotonic()
        try:
            fn()
        except Exception:
            failed += 1
            print("FAIL %s (%.2fs)" % (name, time.monotonic() - t0), flush=True)
            traceback.print_exc()
        else:
            passed += 1
            print("ok   %s (%.2fs)" % (name, time.monotonic() - t0), flush=True)
        finally:
            _cleanup()
    print("%d passed, %d failed" % (passed, failed), flush=True)
    sys.exit(1 if failed else 0)
