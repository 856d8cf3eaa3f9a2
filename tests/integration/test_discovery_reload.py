"""DNS discovery and live reload (docs/configuration.md, "discovery"; docs/operations.md §4).

Discovery: detproxy runs in a private mount namespace whose /etc/hosts is a file this test
controls (glibc re-reads it on every lookup), so a name can resolve to several loopback
addresses and records can appear and vanish, with no network beyond 127.0.0.0/8."""

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading

from harness import (DETPROXY_BIN, SIM_BIN, get_json, http, poll_until, post_json, run_tests,
                     start_process, start_sim)
from proxyutil import pool, serve_connections, sim_config, sim_stats, start_proxy, write_config

NAME = "vllm.detproxy-test.svc"


def namespaces_work():
    if shutil.which("unshare") is None:
        return False
    r = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    return r.returncode == 0


def sims_on(addresses, port):
    out = []
    for a in addresses:
        p = start_process([SIM_BIN, "--listen", "%s:%d" % (a, port), "--model", "m1"])
        p.host = a
        out.append(p)
    return out


def requests_seen(sim):
    return get_json(sim.port, "/_sim/stats", host=sim.host)["requests"]


def write_hosts(path, addresses):
    # Same inode: the bind mount keeps pointing at this file.
    with open(path, "w") as f:
        f.write("127.0.0.1 localhost\n")
        for a in addresses:
            f.write("%s %s\n" % (a, NAME))


def hosts_file(addresses):
    """A hosts file this test controls, naming NAME at addresses."""
    path = os.path.join(tempfile.mkdtemp(prefix="detproxy-disc-"), "hosts")
    write_hosts(path, addresses)
    return path


def start_discovering(cfg, hosts, **kw):
    """detproxy in a private mount namespace whose /etc/hosts is the file at hosts."""
    wrapper = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', hosts]
    return start_proxy(config=cfg, wrapper=wrapper, **kw)


def discovering_127_0_0_2(port, refresh_ms, serving=("127.0.0.2",)):
    """Sims on `serving`, and detproxy discovering NAME at port with 127.0.0.2 in its hosts
    file, once it admitted 127.0.0.2:port: (px, the hosts file, the sims, cfg, that name)."""
    hosts = hosts_file(["127.0.0.2"])
    sims = sims_on(list(serving), port)
    name = "127.0.0.2:%d" % port
    cfg = {"pools": [{"name": "p", "models": ["m1"],
                      "discovery": {"dns": NAME, "port": port, "refresh_ms": refresh_ms}}]}
    px = start_discovering(cfg, hosts)
    poll_until(lambda: replicas(px).get(name, {}).get("state") == "admitted",
               what="the discovered replica admitted")
    return px, hosts, sims, cfg, name


def replicas(px):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def test_discovery_adds_and_drains_replicas():
    if not namespaces_work():
        print("    note: unshare -m is not permitted here; discovery test not run")
        return
    port = 18600 + os.getpid() % 200
    hosts = hosts_file(["127.0.0.2", "127.0.0.3"])
    sims = sims_on(["127.0.0.2", "127.0.0.3", "127.0.0.4"], port)
    cfg = {"pools": [{"name": "p", "models": ["m1"],
                      "discovery": {"dns": NAME, "port": port, "refresh_ms": 200}}]}
    px = start_discovering(cfg, hosts)
    names = lambda: sorted(replicas(px))
    poll_until(lambda: names() == ["127.0.0.2:%d" % port, "127.0.0.3:%d" % port],
               what="two discovered replicas")
    assert all(r["discovered"] and r["state"] == "admitted" for r in replicas(px).values())
    for _ in range(10):
        assert post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "x",
                                                       "max_tokens": 2}).status == 200
    assert requests_seen(sims[0]) > 0 and requests_seen(sims[1]) > 0
    # A record appears: it is attested, then used.
    write_hosts(hosts, ["127.0.0.2", "127.0.0.3", "127.0.0.4"])
    poll_until(lambda: replicas(px).get("127.0.0.4:%d" % port, {}).get("state") == "admitted",
               what="third replica admitted")
    # A record vanishes: the replica is drained and gets nothing new.
    write_hosts(hosts, ["127.0.0.2", "127.0.0.4"])
    poll_until(lambda: "127.0.0.3:%d" % port not in replicas(px), what="replica removed")
    before = requests_seen(sims[1])
    for _ in range(10):
        r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "y", "max_tokens": 2})
        assert r.status == 200 and r.headers["x-detproxy-replica"] != "127.0.0.3:%d" % port
    assert requests_seen(sims[1]) == before
    # A failed lookup keeps the last good set.
    write_hosts(hosts, [])
    px.wait_log("discovery_failed")
    assert len(replicas(px)) == 2
    assert post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "z"}).status == 200
    # A reload keeps discovered replicas and their attestation state.
    px.send_signal(signal.SIGHUP)
    px.wait_log("reloaded")
    assert len(replicas(px)) == 2 and all(r["state"] == "admitted"
                                          for r in replicas(px).values())
    px.stop()


def test_an_address_named_like_a_configured_replica_is_not_a_second_one():
    """A static replica named "127.0.0.1:P" and discovery of localhost port P: the address is
    that replica, not a second replica of the same name (which would share its metrics, its
    drain and a fleet's etcd keys)."""
    sim = start_sim("--model", "m1")
    name = "127.0.0.1:%d" % sim.port
    px = start_proxy(pools=[{"name": "p", "models": ["m1"],
                             "replicas": [{"name": name, "url": "http://" + name}],
                             "discovery": {"dns": "localhost", "port": sim.port,
                                           "refresh_ms": 100}}])
    line = px.wait_log("discovery_name_taken")
    assert line["pool"] == "p" and line["ignored"] == 1, line
    names = [r["name"] for r in get_json(px.admin_port, "/admin/replicas")["replicas"]]
    assert names.count(name) == 1, names
    px.stop()


def test_a_reload_that_configures_a_discovered_address_keeps_it_serving():
    """Discovery found 127.0.0.2:P; a reload lists it as a configured replica too (same name and
    URL, so the same replica): from then on it is configured. Later refreshes keep it, once,
    it goes on serving, and DNS dropping the address does not take it out."""
    if not namespaces_work():
        print("    note: unshare -m is not permitted here; discovery test not run")
        return
    port = 18800 + os.getpid() % 200
    px, hosts, sims, cfg, name = discovering_127_0_0_2(port, 100, ("127.0.0.2", "127.0.0.3"))
    with open(px.config_path) as f:
        cfg = json.load(f)
    cfg["pools"][0]["replicas"] = [{"name": name, "url": "http://" + name}]
    with open(px.config_path, "w") as f:
        json.dump(cfg, f)
    px.send_signal(signal.SIGHUP)
    px.wait_log("reloaded")
    # A new record: once it is in, discovery has refreshed since the reload.
    write_hosts(hosts, ["127.0.0.2", "127.0.0.3"])
    poll_until(lambda: replicas(px).get("127.0.0.3:%d" % port, {}).get("state") == "admitted",
               what="a refresh after the reload")
    names = [r["name"] for r in get_json(px.admin_port, "/admin/replicas")["replicas"]]
    assert names.count(name) == 1 and replicas(px)[name]["state"] == "admitted", names

    def serves_it(tag):
        before = requests_seen(sims[0])
        for i in range(10):
            r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "%s%d" % (tag, i),
                                                       "max_tokens": 2})
            assert r.status == 200, r
        assert requests_seen(sims[0]) > before, tag

    serves_it("r")
    assert not any(l.get("msg") == "discovery_removed" for l in list(px.logs)), px.logs
    # It is the config's now: DNS no longer naming it changes nothing (a restart would give
    # the same). Once 127.0.0.4 is in, discovery has refreshed since the record went.
    write_hosts(hosts, ["127.0.0.3", "127.0.0.4"])
    poll_until(lambda: "127.0.0.4:%d" % port in replicas(px), what="a refresh without .2")
    r2 = replicas(px)[name]
    assert r2["state"] == "admitted" and r2["discovered"] is False, r2
    serves_it("s")
    px.stop()


def test_a_found_address_listed_and_then_unlisted_is_not_left_behind():
    """A reload lists the discovered 127.0.0.2:P (the config takes the replica over) and the
    next reload drops it again, before discovery refreshes: it leaves the pool with the config
    entry, not carried back in by discovery as an unlisted replica."""
    if not namespaces_work():
        print("    note: unshare -m is not permitted here; discovery test not run")
        return
    px, _, _, cfg, name = discovering_127_0_0_2(19400 + os.getpid() % 200, 600000)
    for listed in (True, False):
        cfg["pools"][0]["replicas"] = [{"name": name, "url": "http://" + name}] if listed else []
        with open(px.config_path, "w") as f:
            json.dump(cfg, f)
        mark = len(px.logs)
        px.send_signal(signal.SIGHUP)
        px.wait_log("reloaded", start=mark)
        assert list(replicas(px)) == ([name] if listed else []), replicas(px)
    px.stop()


def test_reload_applies_policy_and_keeps_old_on_error():
    sim = start_sim("--model", "m1")
    cfg = {"pools": [pool("p", ["m1"], [sim])],
           "policy": {"tenants": [{"name": "t1", "match": {"any": True},
                                   "sampling": {"temperature": {"force": 0.1}}}]}}
    px = start_proxy(config=cfg)
    post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "a"})
    assert json.loads(get_json(sim.port, "/_sim/last_request")["body"])["temperature"] == 0.1
    # A valid change takes effect for new requests.
    cfg["policy"]["tenants"][0]["sampling"]["temperature"]["force"] = 0.2
    cfg.update({"listen": "127.0.0.1:0", "admin_listen": "127.0.0.1:0"})
    with open(px.config_path) as f:
        live = json.load(f)
    live["policy"] = cfg["policy"]
    with open(px.config_path, "w") as f:
        json.dump(live, f)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 200, r
    r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "b"})
    assert r.headers["x-detproxy-tenant"] == "t1"
    assert json.loads(get_json(sim.port, "/_sim/last_request")["body"])["temperature"] == 0.2
    # An invalid config is refused with its JSON path; the old one keeps serving.
    live["policy"]["tenants"][0]["sampling"]["temperature"]["force"] = "hot"
    with open(px.config_path, "w") as f:
        json.dump(live, f)
    r = http("POST", px.admin_port, "/admin/reload")
    assert r.status == 400 and "temperature" in r.json()["error"]["message"], r
    px.send_signal(signal.SIGHUP)
    px.wait_log("reload_failed")
    post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "c"})
    assert json.loads(get_json(sim.port, "/_sim/last_request")["body"])["temperature"] == 0.2
    # The replica kept its attestation state across reloads.
    assert get_json(px.admin_port, "/admin/replicas")["replicas"][0]["state"] == "admitted"
    px.stop()


def test_reload_while_an_attestation_check_is_in_flight():
    """A check that outlives the configuration it started under must not touch it: the old
    generation is freed by the reload (no request holds it) while the fetch still runs."""
    import hashlib
    from harness import run_cmd
    d = tempfile.mkdtemp(prefix="detproxy-reload-att-")
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", os.path.join(d, "k")])
    assert rc == 0, err
    sim = start_sim("--model", "m1", "--attest-key", os.path.join(d, "k.key.pem"))
    p = pool("p", ["m1"], [sim], manifest={"model": "m1"})
    p["replicas"][0]["attest"] = {"source": "agent",
                                  "url": "http://127.0.0.1:%d/attestation" % sim.port}
    att = {"interval_ms": 200, "timeout_ms": 1500, "require_signature": True,
           "trusted_keys": [os.path.join(d, "k.pub.pem")]}
    px = start_proxy(pools=[p], attestation=att, directory=d)
    # The agent stops answering: the next check hangs until timeout_ms.
    sim_config(sim, attest_fault="hang")
    poll_until(lambda: sim_stats(sim).get("hung", 0) > 0, what="a check in flight")
    for _ in range(3):
        assert http("POST", px.admin_port, "/admin/reload").status == 200
    # The hung check now times out and is judged under the current configuration.
    poll_until(lambda: get_json(px.admin_port, "/admin/replicas")["replicas"][0]["state"]
               == "unreachable", what="the timed-out check judged")
    sim_config(sim, attest_fault="none")
    poll_until(lambda: get_json(px.admin_port, "/admin/replicas")["replicas"][0]["state"]
               == "admitted", what="re-admitted")
    px.stop()  # under ASan: a use-after-free of the old configuration fails here


def test_no_request_dropped_during_reloads_under_load():
    sims = [start_sim("--model", "m1", "--token-delay-ms", "2") for _ in range(2)]
    px = start_proxy(pools=[pool("p", ["m1"], sims)])
    failures, done = [], []
    stop = threading.Event()

    def client():
        while not stop.is_set():
            try:
                r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "load",
                                                           "max_tokens": 4})
                (done if r.status == 200 else failures).append(r.status)
            except Exception as e:  # a dropped connection is a failure too
                failures.append(repr(e))

    ts = [threading.Thread(target=client) for _ in range(4)]
    for t in ts:
        t.start()
    for i in range(10):
        # Interleave: every reload starts after a request completed since the last one, so the
        # check below does not depend on how fast this machine is.
        seen = len(done)
        poll_until(lambda: len(done) > seen or failures, what="a request before reload %d" % i)
        px.send_signal(signal.SIGHUP)
        poll_until(lambda: len(px.find_logs("reloaded")) > i, what="reload %d" % i)
        r = http("POST", px.admin_port, "/admin/reload")
        assert r.status == 200
    stop.set()
    for t in ts:
        t.join()
    assert failures == [], failures[:5]
    assert len(done) >= 10, len(done)
    px.stop()


class HangingReplicas:
    """Accepts on 0.0.0.0:port (every loopback address) and never answers: counts how many
    attestation connections are open at once. One thread with a selector sees a close as soon
    as it is scheduled (a thread per connection saw them late on a loaded machine)."""

    def __init__(self, port):
        import selectors
        import socket
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("0.0.0.0", port))
        self.lsock.listen(512)
        self.lsock.setblocking(False)
        self.open = self.peak = self.total = 0
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.lsock, selectors.EVENT_READ)
        self.closed = False
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        import selectors
        while not self.closed:
            try:
                events = self.sel.select(0.2)
            except (OSError, ValueError):
                return
            for key, _ in events:
                if key.fileobj is self.lsock:
                    try:
                        c, _ = self.lsock.accept()
                    except OSError:
                        continue
                    c.setblocking(False)
                    self.sel.register(c, selectors.EVENT_READ)
                    self.open += 1
                    self.total += 1
                    self.peak = max(self.peak, self.open)
                    continue
                try:
                    data = key.fileobj.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data:
                    self.sel.unregister(key.fileobj)
                    key.fileobj.close()
                    self.open -= 1

    def close(self):
        self.closed = True
        self.lsock.close()


def replica_labels(px):
    import re
    text = http("GET", px.admin_port, "/metrics").text
    return set(re.findall(r'replica="([^"]+)"', text))


def test_discovery_is_capped_paced_and_forgets_departed_replicas():
    """max_replicas caps a large answer, attestation runs at most 16 checks
    at once, and the series of addresses that left are dropped once they stay away."""
    if not namespaces_work():
        print("    note: unshare -m is not permitted here; discovery test not run")
        return
    port = 19000 + os.getpid() % 400
    many = ["127.0.1.%d" % i for i in range(1, 201)]
    hosts = hosts_file(many)
    hang = HangingReplicas(port)
    cfg = {"pools": [{"name": "p", "models": ["m1"],
                      "discovery": {"dns": NAME, "port": port, "refresh_ms": 200,
                                    "max_replicas": 64}}],
           "attestation": {"interval_ms": 10000, "timeout_ms": 1000}}
    px = start_discovering(cfg, hosts, ready=False)
    poll_until(lambda: len(replicas(px)) == 64, what="64 discovered replicas")
    line = px.wait_log("discovery_capped")
    assert line["ignored"] == 200 - 64 and line["max_replicas"] == 64, line
    poll_until(lambda: hang.total >= 64, timeout=20, what="every replica attested once")
    print("    200 records: %d replicas, at most %d attestation connections at once"
          % (len(replicas(px)), hang.peak))
    # 16 checks at a time; a timed-out connection is seen closed here a moment after the
    # proxy has already started the next check, hence a little slack.
    assert hang.peak <= 20, hang.peak
    # The answer shrinks to 4: the others leave the pool at once, their series a while later
    # (10 refreshes), so /metrics does not keep every address the Service ever had.
    write_hosts(hosts, many[:4])
    poll_until(lambda: sorted(replicas(px)) == sorted("%s:%d" % (a, port) for a in many[:4]),
               what="down to four replicas")
    poll_until(lambda: replica_labels(px) <= {"%s:%d" % (a, port) for a in many[:4]},
               timeout=15, what="series of departed replicas dropped")
    hang.close()
    px.stop()


def test_a_returning_address_keeps_its_history_and_is_attested_again():
    if not namespaces_work():
        print("    note: unshare -m is not permitted here; discovery test not run")
        return
    port = 18200 + os.getpid() % 300
    hosts = hosts_file(["127.0.0.2", "127.0.0.3"])
    sims = sims_on(["127.0.0.2", "127.0.0.3"], port)
    cfg = {"pools": [{"name": "p", "models": ["m1"],
                      "discovery": {"dns": NAME, "port": port, "refresh_ms": 300}}],
           "attestation": {"interval_ms": 200, "timeout_ms": 1000}}
    px = start_discovering(cfg, hosts)
    name = "127.0.0.3:%d" % port
    from proxyutil import metric
    poll_until(lambda: metric(px, "detproxy_attestations_total", pool="p", replica=name,
                              result="admitted") >= 3, what="a few attestations of r")
    write_hosts(hosts, ["127.0.0.2"])
    poll_until(lambda: name not in replicas(px), what="gone from the pool")
    before = metric(px, "detproxy_attestations_total", pool="p", replica=name, result="admitted")
    assert before >= 3  # kept while it is away
    write_hosts(hosts, ["127.0.0.2", "127.0.0.3"])
    px.wait_log(lambda l: l.get("msg") == "discovery_returned" and l.get("replica") == name)
    px.wait_log(lambda l: l.get("msg") == "replica_state" and l.get("replica") == name
                and l.get("to") == "pending" and "back in DNS" in " ".join(l["reasons"]))
    poll_until(lambda: replicas(px).get(name, {}).get("state") == "admitted",
               what="attested again")
    after = metric(px, "detproxy_attestations_total", pool="p", replica=name, result="admitted")
    assert after > before, (before, after)  # one history, not a new series from zero
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
