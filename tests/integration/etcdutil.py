"""A real etcd cluster on loopback for the fleet tests (Debian's etcd-server, /usr/bin/etcd).

    c = EtcdCluster(3)          # starts 3 members, waits for a leader
    c.endpoints()               # ["http://127.0.0.1:P", ...] for the fleet config
    c.stop_member(i) / c.start_member(i) / c.kill_leader()
    c.stop()                    # every member, data directories removed

tls=pki (certs.PKI) serves https with client certificates required; auth=True makes user
root (password in c.password_file) and turns authentication on. Missing etcd: ETCD is None and
tests exit 77 (skipped).
"""

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
import ssl

from harness import SLOW, free_port
from proxyutil import read_request

ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)


def b64(s):
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


class EtcdCluster:
    def __init__(self, n=3, tls=None, auth=False, timeout=20):
        assert ETCD, "etcd is not installed"
        self.n = n
        self.tls = tls
        self.dir = tempfile.mkdtemp(prefix="detproxy-etcd-")
        self.client_ports = [free_port() for _ in range(n)]
        self.peer_ports = [free_port() for _ in range(n)]
        self.procs = [None] * n
        if tls:
            self.server = tls.factory.leaf(tls.ca, "etcd-" + os.path.basename(self.dir), "etcd",
                                           ("localhost",), ("127.0.0.1",), client="both")
        self.token = None
        scheme = "https" if tls else "http"
        self.urls = ["%s://127.0.0.1:%d" % (scheme, p) for p in self.client_ports]
        self.cluster = ",".join("e%d=http://127.0.0.1:%d" % (i, self.peer_ports[i])
                                for i in range(n))
        for i in range(n):
            self.start_member(i, new=True)
        self.wait_healthy(timeout)
        self.password_file = None
        if auth:
            self.password = "s3cret-etcd"
            self.password_file = os.path.join(self.dir, "etcd.pass")
            with open(self.password_file, "w") as f:
                f.write(self.password + "\n")
            os.chmod(self.password_file, 0o600)
            self.call("/v3/auth/user/add", {"name": "root", "password": self.password})
            self.call("/v3/auth/user/grant", {"user": "root", "role": "root"})
            self.call("/v3/auth/enable", {})
            self.token = self.call("/v3/auth/authenticate",
                                   {"name": "root", "password": self.password})["token"]

    def endpoints(self):
        return list(self.urls)

    def start_member(self, i, new=False):
        argv = [ETCD, "--name", "e%d" % i, "--data-dir", os.path.join(self.dir, "e%d" % i),
                "--listen-client-urls", self.urls[i], "--advertise-client-urls", self.urls[i],
                "--listen-peer-urls", "http://127.0.0.1:%d" % self.peer_ports[i],
                "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % self.peer_ports[i],
                "--initial-cluster", self.cluster, "--initial-cluster-state", "new",
                "--initial-cluster-token", os.path.basename(self.dir),
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--logger", "zap", "--log-outputs", os.path.join(self.dir, "e%d.log" % i)]
        if self.tls:
            argv += ["--cert-file", self.server.crt, "--key-file", self.server.key,
                     "--trusted-ca-file", self.tls.ca.crt, "--client-cert-auth"]
        self.procs[i] = subprocess.Popen(argv, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)

    def stop_member(self, i, sig=signal.SIGTERM):
        p = self.procs[i]
        if p is None:
            return
        p.send_signal(sig)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        self.procs[i] = None

    def running(self):
        return [i for i in range(self.n) if self.procs[i] is not None]

    def _ctx(self):
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.tls.ca.crt)
        ctx.load_cert_chain(self.tls.client.crt, self.tls.client.key)
        return ctx

    def call(self, path, body, member=None, timeout=3):
        """POST body to one member's gateway (the first running one by default)."""
        i = self.running()[0] if member is None else member
        req = urllib.request.Request(self.urls[i] + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        if self.token:
            req.add_header("authorization", self.token)
        with urllib.request.urlopen(req, timeout=timeout, context=self._ctx()) as r:
            text = r.read().decode()
        return json.loads(text.splitlines()[0]) if text else {}

    def status(self, i):
        return self.call("/v3/maintenance/status", {}, member=i, timeout=1)

    def leader_now(self):
        """The index of the member that says it leads, or None."""
        for i in self.running():
            try:
                s = self.status(i)
            except Exception:
                continue
            if s.get("leader") and s["leader"] == s["header"]["member_id"]:
                return i
        return None

    def leader(self, timeout=10):
        """The index of the member that leads, asked again until one says it does (a member
        slow to answer on a busy box, or an election under way)."""
        deadline = time.monotonic() + timeout * SLOW
        while True:
            i = self.leader_now()
            if i is not None:
                return i
            assert time.monotonic() < deadline, "no etcd member says it leads"
            time.sleep(0.05)

    def wait_healthy(self, timeout=20):
        deadline = time.monotonic() + timeout * SLOW
        while time.monotonic() < deadline:
            if self.leader_now() is not None:
                try:
                    self.call("/v3/kv/range", {"key": b64("/health-probe")})
                    return
                except Exception:
                    pass
            time.sleep(0.05)
        raise AssertionError("etcd cluster without a leader after %ss" % timeout)

    def kill_leader(self):
        i = self.leader()
        self.stop_member(i, sig=signal.SIGKILL)
        return i

    def get_prefix(self, prefix):
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        r = self.call("/v3/kv/range", {"key": b64(prefix), "range_end": b64(end)})
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
                for kv in r.get("kvs", [])}

    def stop(self):
        for i in range(self.n):
            self.stop_member(i)
        shutil.rmtree(self.dir, ignore_errors=True)


class RequestRelay:
    """A relay in front of one etcd member that reads each request whole before passing it on,
    so a test can answer, hold or count one: a subclass's step(client, upstream, head, body)
    returns True to pass the request on (it runs on each connection's own thread and may wait;
    `lock` is there for its state). Answers go back unread, except on an upstream socket put
    in `muted`, whose answers are lost."""

    def __init__(self, url):
        self.up = int(url.rsplit(":", 1)[1])
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.muted = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self):
        return "http://127.0.0.1:%d" % self.port

    def step(self, c, u, head, body):
        return True

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
                u = socket.create_connection(("127.0.0.1", self.up))
            except OSError:
                return
            threading.Thread(target=self._requests, args=(c, u), daemon=True).start()
            threading.Thread(target=self._answers, args=(u, c), daemon=True).start()

    def _requests(self, c, u):
        buf = b""
        try:
            while True:
                got = read_request(c, buf)
                if got is None:
                    break
                head, body, buf = got
                if self.step(c, u, head, body):
                    u.sendall(head + b"\r\n\r\n" + body)
        except OSError:
            pass
        for x in (c, u):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _answers(self, u, c):
        try:
            while True:
                d = u.recv(65536)
                if not d:
                    break
                if u not in self.muted:
                    c.sendall(d)
        except OSError:
            pass


def _shut(*socks):
    for x in socks:
        try:
            x.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


class CutRelay(RequestRelay):
    """A member cut off from etcd and back: cut() closes every connection through the relay, and
    each request that comes until restore() has its connection closed unanswered."""

    def __init__(self, url):
        super().__init__(url)
        self.socks = set()
        self.is_cut = False

    def step(self, c, u, head, body):
        with self.lock:
            if not self.is_cut:
                self.socks |= {c, u}
                return True
        _shut(c, u)
        return False

    def cut(self):
        with self.lock:
            self.is_cut = True
            socks, self.socks = self.socks, set()
        _shut(*socks)

    def restore(self):
        with self.lock:
            self.is_cut = False
