"""The fleet (docs/fleet.md): several detproxy instances sharing verdicts through a real etcd
cluster (Debian's etcd-server) on loopback: membership, drains and quarantines reaching every
instance, config skew, a member killed, etcd faults under load, TLS with client certificates
and authentication, and hostile etcd answers."""

import json
import os
import signal
import socket
import sys
import threading
import time

from harness import (SANITIZE, SLOW, get_json, http, poll_until, post_json, run_cmd, run_tests,
                     start_sim, DETPROXY_BIN)
from proxyutil import pool, rss_kb, sim_stats, start_proxy, wait_all_admitted, write_config
import certs
import etcdutil

if etcdutil.ETCD is None:
    print("etcd is not installed (scripts/deps.sh installs etcd-server): skipped")
    sys.exit(77)

MODEL = "m1"


def fleet_cfg(cluster, instance, ttl=3000, **etcd):
    e = {"endpoints": cluster.endpoints()}
    e.update(etcd)
    return {"name": "t", "instance": instance, "etcd": e, "lease_ttl_ms": ttl}


def start_fleet(cluster, sims, n=3, ttl=3000, shadow=None, etcd=None, names=None):
    pxs = []
    for i in range(n):
        top = {"fleet": fleet_cfg(cluster, (names or {}).get(i, "gw-%d" % i), ttl,
                                  **(etcd or {}))}
        if shadow:
            top["shadow"] = shadow
        pxs.append(start_proxy(pools=[pool("p", [MODEL], sims)], **top))
    return pxs


def fleet(px):
    return get_json(px.admin_port, "/admin/fleet")


def wait_members(pxs, n, timeout=10):
    poll_until(lambda: all(fleet(p)["connected"] and len(fleet(p)["members"]) == n for p in pxs),
               timeout=timeout, what="%d fleet members everywhere" % n)


def drained(px, name):
    return any(r["name"] == name and r["drained"]
               for r in get_json(px.admin_port, "/admin/replicas")["replicas"])


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Load:
    """Client requests through every proxy on a thread each until stop(); counts non-200s."""

    def __init__(self, pxs):
        self.ok = self.errors = 0
        self.bad = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in pxs]
        for t in self._threads:
            t.start()

    def _run(self, px):
        i = 0
        while not self._stop.is_set():
            i += 1
            try:
                r = post_json(px.port, "/v1/completions",
                              {"model": MODEL, "prompt": "load %d" % i, "max_tokens": 4,
                               "temperature": 0}, timeout=10)
                if r.status == 200:
                    self.ok += 1
                else:
                    self.errors += 1
                    self.bad.append((r.status, r.body[:200]))
            except Exception as e:  # a refused or reset connection is an error too
                self.errors += 1
                self.bad.append(repr(e))

    def stop(self):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=15)
        return self.ok, self.errors


def test_check_names_fleet_errors():
    path = write_config({
        "listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
        "pools": [{"name": "p", "models": [MODEL],
                   "replicas": [{"name": "r1", "url": "http://127.0.0.1:1"}]}],
        "fleet": {"name": "bad name", "instance": "gw 0", "lease_ttl_ms": 10, "x": 1,
                  "etcd": {"endpoints": ["ftp://e:1", "http://e:2379/v3"],
                           "tls": {"cert": "nope.pem"}, "username": "u"}}})
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
    text = out + err
    assert rc != 0, text
    for want in ("fleet.x", "fleet.name", "fleet.instance", "fleet.lease_ttl_ms",
                 "fleet.etcd.endpoints[0]", "fleet.etcd.endpoints[1]", "fleet.etcd.tls",
                 "fleet.etcd.password_file"):
        assert want in text, (want, text)
    # The fleet's name and the pool and replica names are segments of its etcd keys: a '/'
    # would let fleet "x/instances" write into fleet "x"'s member list.
    path = write_config({
        "listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0",
        "pools": [{"name": "a/b", "models": [MODEL],
                   "replicas": [{"name": "r/1", "url": "http://127.0.0.1:1"}]}],
        "fleet": {"name": "x/instances", "etcd": {"endpoints": ["http://127.0.0.1:2379"]}}})
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
    text = out + err
    assert rc != 0, text
    for want in ("fleet.name", "pools[0].name", "pools[0].replicas[0].name"):
        assert want in text, (want, text)


def test_an_instance_without_a_name_is_the_host_name_and_its_admin_port():
    """docs/fleet.md, "Configuration": with no `instance`, an instance is named `host:admin
    port`, so two on one host are two members; with admin_listen port 0 (as here), the port it
    bound."""
    cluster = etcdutil.EtcdCluster(1)
    sims = [start_sim("--model", MODEL)]
    f = fleet_cfg(cluster, None)
    del f["instance"]
    pxs = [start_proxy(pools=[pool("p", [MODEL], sims)], fleet=f) for _ in range(2)]
    ports = [p.admin_port for p in pxs]
    names = ["%s:%d" % (socket.gethostname(), port) for port in ports]
    got = [fleet(p)["instance"] for p in pxs]
    assert got == names, (got, names)
    wait_members(pxs, 2)
    for p in pxs:
        got = fleet(p)
        assert sorted(m["instance"] for m in got["members"]) == sorted(names), got
    kv = cluster.get_prefix("/detproxy/t/instances/")
    assert sorted(kv) == sorted("/detproxy/t/instances/" + n for n in names), kv
    for n, port in zip(names, ports):
        assert json.loads(kv["/detproxy/t/instances/" + n])["admin_listen"] == \
            "127.0.0.1:%d" % port, kv
    for p in pxs:
        p.stop()
    cluster.stop()


def test_drain_reaches_every_instance_within_a_second():
    cluster = etcdutil.EtcdCluster(3)
    sims = [start_sim("--model", MODEL) for _ in range(2)]
    pxs = start_fleet(cluster, sims)
    wait_members(pxs, 3)
    a, others = pxs[0], pxs[1:]
    # Propagation: drain and enable on one instance, time until both others show it. 100
    # changes, so the p99 is not the one slowest (an fsync that three etcd members on a busy
    # disk wait for); that one is held to 5 s.
    lat = []
    for k in range(100):
        want = k % 2 == 0
        t0 = time.monotonic()
        http("POST", a.admin_port, "/admin/replicas/r1/%s?reason=t%d" % (
            "drain" if want else "enable", k))
        poll_until(lambda: all(drained(p, "r1") == want for p in others), timeout=5,
                   interval=0.002, what="change %d everywhere" % k)
        lat.append(time.monotonic() - t0)
    print("drain/enable propagation over 100 changes: p50 %.1f ms, p99 %.1f ms, max %.1f ms" % (
        pct(lat, 0.5) * 1000, pct(lat, 0.99) * 1000, max(lat) * 1000))
    assert pct(lat, 0.99) < 1.0 * SLOW, lat
    # Drained on A: once B and C show it, no request through them reaches r1.
    http("POST", a.admin_port, "/admin/replicas/r1/drain?reason=maintenance")
    poll_until(lambda: all(drained(p, "r1") for p in others), timeout=5, interval=0.002,
               what="the drain everywhere")
    before = sim_stats(sims[0])["requests"]
    for p in others:
        for i in range(20):
            r = post_json(p.port, "/v1/completions",
                          {"model": MODEL, "prompt": "d%d" % i, "max_tokens": 2})
            assert r.status == 200 and r.headers["x-detproxy-replica"] == "r2", r.headers
    assert sim_stats(sims[0])["requests"] == before
    f = fleet(others[0])
    d = [x for x in f["drains"] if x["replica"] == "r1"][0]
    assert d["drained"] and d["origin"] == "gw-0" and d["reason"] == "maintenance", d
    text = http("GET", others[0].admin_port, "/metrics").body.decode()
    assert "detproxy_fleet_connected 1" in text, text[-2000:]
    assert "detproxy_fleet_members 3" in text
    assert 'detproxy_fleet_events_total{kind="drain"}' in text
    # The status page names the fleet.
    page = http("GET", others[0].admin_port, "/").body.decode()
    assert "gw-0" in page and "fleet" in page.lower()
    for p in pxs:
        p.stop()
    cluster.stop()


def test_config_skew_is_named_and_its_verdicts_ignored():
    cluster = etcdutil.EtcdCluster(1)
    sims = [start_sim("--model", MODEL) for _ in range(2)]
    pxs = start_fleet(cluster, sims, n=2)
    odd = start_proxy(pools=[pool("p", [MODEL], sims)], fleet=fleet_cfg(cluster, "odd"),
                      limits={"max_body_bytes": 1000000})
    pxs.append(odd)
    wait_members(pxs, 3)
    for p in pxs:
        f = fleet(p)
        skew = {m["instance"]: m["config_skew"] for m in f["members"]}
        assert skew == {"gw-0": False, "gw-1": False, "odd": True}, f
    assert fleet(odd)["config_skew"] is True
    http("POST", odd.admin_port, "/admin/replicas/r1/drain")
    assert drained(odd, "r1")
    pxs[0].wait_log(lambda l: l.get("msg") == "fleet_drain_ignored" and l.get("origin") == "odd")
    assert not drained(pxs[0], "r1") and not drained(pxs[1], "r1")
    for p in pxs:
        p.stop()
    cluster.stop()


def test_killed_member_leaves_within_its_lease():
    cluster = etcdutil.EtcdCluster(1)
    sims = [start_sim("--model", MODEL)]
    pxs = start_fleet(cluster, sims, ttl=2000)
    wait_members(pxs, 3)
    t0 = time.monotonic()
    pxs[2].popen.send_signal(signal.SIGKILL)
    pxs[2].wait()
    poll_until(lambda: all(len(fleet(p)["members"]) == 2 for p in pxs[:2]), timeout=6,
               interval=0.05, what="the killed member gone")
    took = time.monotonic() - t0
    print("SIGKILLed member gone from the others after %.2f s (lease 2 s)" % took)
    assert took < 2.0 * SLOW + 1.0, took
    # A clean stop revokes nothing it need not: the member key goes with the process's lease.
    for p in pxs[:2]:
        p.stop()
    cluster.stop()


def test_etcd_faults_cost_clients_nothing():
    cluster = etcdutil.EtcdCluster(3)
    sims = [start_sim("--model", MODEL) for _ in range(2)]
    pxs = start_fleet(cluster, sims, ttl=3000)
    wait_members(pxs, 3)
    load = Load(pxs)
    report = []

    def reconnect_time(what):
        t0 = time.monotonic()
        poll_until(lambda: all(fleet(p)["connected"] for p in pxs), timeout=20,
                   what="reconnected after " + what)
        report.append("%s: reconnected in %.2f s" % (what, time.monotonic() - t0))

    # The leader killed: the others elect one, calls move on.
    k = cluster.kill_leader()
    time.sleep(1.0)
    cluster.start_member(k)
    reconnect_time("leader killed")
    # A majority stopped: no quorum.
    cluster.stop_member(0)
    cluster.stop_member(1)
    poll_until(lambda: not fleet(pxs[0])["connected"], timeout=15, what="disconnect seen")
    f = fleet(pxs[0])
    assert f["mode"] == "local" and f["error"], f
    pxs[0].wait_log("fleet_disconnected")
    cluster.start_member(0)
    cluster.start_member(1)
    reconnect_time("majority back")
    # All stopped, then back.
    for i in range(3):
        cluster.stop_member(i)
    poll_until(lambda: all(not fleet(p)["connected"] for p in pxs), timeout=15,
               what="everyone disconnected")
    # A drain while etcd is gone applies here at once and reaches the others on return.
    http("POST", pxs[0].admin_port, "/admin/replicas/r2/drain")
    for i in range(3):
        cluster.start_member(i)
    reconnect_time("all back")
    poll_until(lambda: all(drained(p, "r2") for p in pxs), timeout=10,
               what="the drain made offline reached everyone")
    http("POST", pxs[0].admin_port, "/admin/replicas/r2/enable")
    ok, errors = load.stop()
    print("etcd faults under load: %d client requests, %d errors; %s" % (ok, errors,
                                                                         "; ".join(report)))
    assert errors == 0, load.bad[:5]
    assert ok > 50, ok
    text = http("GET", pxs[0].admin_port, "/metrics").body.decode()
    assert 'detproxy_fleet_events_total{kind="disconnected"}' in text
    for p in pxs:
        p.stop()
    cluster.stop()


def test_tls_client_certificates():
    pki = certs.shared_pki()
    cluster = etcdutil.EtcdCluster(1, tls=pki)
    sims = [start_sim("--model", MODEL) for _ in range(2)]
    tls = {"ca": pki.ca.crt, "cert": pki.client.crt, "key": pki.client.key}
    pxs = start_fleet(cluster, sims, n=2, etcd={"tls": tls})
    wait_members(pxs, 2)
    assert "/detproxy/t/instances/gw-0" in cluster.get_prefix("/detproxy/t/")
    # Without a client certificate etcd refuses the handshake: the instance says so, serves.
    bad = start_proxy(pools=[pool("p", [MODEL], sims)],
                      fleet=fleet_cfg(cluster, "nocert", tls={"ca": pki.ca.crt}))
    poll_until(lambda: fleet(bad)["error"] not in (None, "connecting"), timeout=10,
               what="the refused handshake reported")
    f = fleet(bad)
    assert not f["connected"], f
    r = post_json(bad.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert r.status == 200
    for p in pxs + [bad]:
        p.stop()
    cluster.stop()


def test_username_and_password_file():
    cluster = etcdutil.EtcdCluster(1, auth=True)
    sims = [start_sim("--model", MODEL)]
    pxs = start_fleet(cluster, sims, n=2, etcd={"username": "root",
                                                "password_file": cluster.password_file})
    wait_members(pxs, 2)
    http("POST", pxs[0].admin_port, "/admin/replicas/r1/drain")
    poll_until(lambda: drained(pxs[1], "r1"), timeout=5, what="drain through an authenticated watch")
    # A wrong password: refused, said so, still serving.
    wrong = os.path.join(cluster.dir, "wrong.pass")
    with open(wrong, "w") as f:
        f.write("nope\n")
    os.chmod(wrong, 0o600)
    bad = start_proxy(pools=[pool("p", [MODEL], sims)],
                      fleet=fleet_cfg(cluster, "wrong", username="root", password_file=wrong))
    poll_until(lambda: fleet(bad)["error"] not in (None, "connecting"), timeout=10,
               what="the refused password reported")
    assert not fleet(bad)["connected"] and "authenticat" in fleet(bad)["error"], fleet(bad)
    for p in pxs + [bad]:
        p.stop()
    cluster.stop()


class AuthPipe(etcdutil.RequestRelay):
    """In front of one etcd member: armed, it refuses the next lease keep-alive as etcd refuses
    an expired token (401), which makes the member authenticate again; it holds that
    authentication, passes the next one (another call's) on, and once a call with that token
    comes, answers the held authentication 503, so the member sends it to the next endpoint.
    `keepalives` counts the keep-alives it passed on."""

    def __init__(self, url):
        super().__init__(url)
        self.armed = False
        self.state = "idle"  # refused, held, passed, failed over
        self.held = None     # the client socket whose authentication is held
        self.keepalives = 0

    @staticmethod
    def _answer(c, status, body):
        c.sendall(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                  b"\r\n%s" % (status, len(body), body))

    def step(self, c, u, head, body):
        with self.lock:
            return self._step(c, head)

    def _step(self, c, head):
        keepalive = head.startswith(b"POST /v3/lease/keepalive ")
        auth = head.startswith(b"POST /v3/auth/authenticate ")
        if self.armed and keepalive:
            self.armed = False
            self.state = "refused"
            self._answer(c, 401, b'{"error":"etcdserver: invalid auth token","code":16}')
            return False
        if auth and self.state == "refused":
            self.state, self.held = "held", c
            return False
        if auth and self.state == "held":
            self.state = "passed"
        elif self.state == "passed" and b"\r\nauthorization:" in head.lower() and \
                not head.startswith(b"POST /v3/watch "):
            self.state = "failed over"
            self._answer(self.held, 503, b'{"error":"etcdserver: unavailable"}')
        self.keepalives += keepalive
        return True


def test_a_call_sent_elsewhere_after_another_got_the_token_is_not_read_as_authentication():
    """A keep-alive refused for an expired token authenticates again; that authentication
    fails on its endpoint after another call has fetched a token. Sent to the next endpoint, the
    keep-alive goes with that token, and its answer is read as the keep-alive's: the member
    stays connected (read as an authentication, it said "no token in the answer" and lost the
    lease's keep-alive)."""
    cluster = etcdutil.EtcdCluster(2, auth=True)
    first, second = AuthPipe(cluster.endpoints()[0]), AuthPipe(cluster.endpoints()[1])
    sims = [start_sim("--model", MODEL)]
    px, = start_fleet(cluster, sims, n=1, etcd={"endpoints": [first.url(), second.url()],
                                                  "username": "root",
                                                  "password_file": cluster.password_file})
    wait_members([px], 1)
    first.armed = True
    poll_until(lambda: first.state == "held", what="the keep-alive's authentication held")
    # Another call while the token is gone: it authenticates (passed on) and sends with it.
    http("POST", px.admin_port, "/admin/replicas/r1/drain")
    poll_until(lambda: first.state == "failed over", what="the held authentication failed")
    base = second.keepalives
    poll_until(lambda: second.keepalives >= base + 2 or not fleet(px)["connected"],
               what="the keep-alive sent elsewhere, and the next one")
    assert "no token in the answer" not in px.stderr_text()
    assert fleet(px)["connected"], fleet(px)
    assert drained(px, "r1")
    px.stop()
    cluster.stop()


class HostileEtcd:
    """Answers every request with `mode`: a 1 GiB announced body, an endless chunked stream,
    or garbage."""

    def __init__(self, mode):
        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.sent = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        try:
            c.recv(65536)
            if self.mode == "huge":
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                          b"content-length: 1073741824\r\n\r\n{\"header\":{")
                chunk = b" " * 65536
                for _ in range(16384):
                    c.sendall(chunk)
                    self.sent += len(chunk)
            elif self.mode == "endless":
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                          b"transfer-encoding: chunked\r\n\r\n")
                piece = b"{\"result\":{\"events\":[" + b"1," * 30000
                while True:
                    c.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.sent += len(piece)
            else:
                c.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nnot json!")
                time.sleep(1)
        except OSError:
            pass
        finally:
            c.close()

    def close(self):
        self.sock.close()


def test_hostile_etcd_answers_cost_bounded_memory():
    sims = [start_sim("--model", MODEL)]
    for mode in ("huge", "endless", "garbage"):
        h = HostileEtcd(mode)
        px = start_proxy(pools=[pool("p", [MODEL], sims)],
                         fleet={"name": "t", "instance": "h", "lease_ttl_ms": 2000,
                                "etcd": {"endpoints": ["http://127.0.0.1:%d" % h.port]}})
        base = rss_kb(px)
        time.sleep(1.5 * SLOW)  # let it read (and refuse) the answers for a while
        f = fleet(px)
        assert not f["connected"] and f["error"], (mode, f)
        for i in range(10):
            r = post_json(px.port, "/v1/completions",
                          {"model": MODEL, "prompt": "h%d" % i, "max_tokens": 2})
            assert r.status == 200, (mode, r.status)
        grew = rss_kb(px) - base
        print("hostile etcd (%s): %d MiB sent, RSS grew %d KiB, error: %s" % (
            mode, h.sent >> 20, grew, f["error"][:100]))
        # Each refused answer is freed at once; ASan keeps freed memory in its quarantine (up to
        # 256 MiB by default), so a sanitized build shows that too.
        assert grew < (320 if SANITIZE else 64) * 1024, (mode, grew)
        px.stop()
        h.close()


if __name__ == "__main__":
    run_tests(globals())
