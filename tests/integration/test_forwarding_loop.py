"""detproxy must never be its own replica (docs/requests.md §2, §4 `loop_detected`).

A replica URL, or a discovered address, that leads back to detproxy's own listener would be
attested through detproxy itself and admitted, and a client request would then bounce through
the proxy until max_connections stopped it. So every forwarded request carries a Via entry with
this instance's token (a request that comes back with it is 508, never forwarded), and an
address that is one of detproxy's own listeners is never admitted."""

import json
import re
import os
import tempfile

from harness import (SLOW, free_port, get_json, http, poll_until, post_json, run_tests,
                     start_sim)
from proxyutil import assert_openai_error, client_requests, sim_reset, start_proxy
from test_discovery_reload import namespaces_work, write_hosts, NAME

MODEL = "m1"


def replicas(px):
    return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}


def handled(px):
    """Requests the proxy listener answered (every hop of a loop is one)."""
    text = http("GET", px.admin_port, "/metrics").text
    return sum(float(l.rpartition(" ")[2]) for l in text.splitlines()
               if l.startswith("detproxy_requests_total{"))


def self_pool(sim, port):
    return {"name": "p", "models": [MODEL], "balance": "round_robin",
            "replicas": [{"name": "real", "url": "http://127.0.0.1:%d" % sim.port},
                         {"name": "self", "url": "http://127.0.0.1:%d" % port}]}


def test_a_replica_url_naming_the_proxy_itself_is_never_admitted():
    sim = start_sim("--model", MODEL)
    port = free_port()
    px = start_proxy(pools=[self_pool(sim, port)], listen="127.0.0.1:%d" % port,
                     attestation={"interval_ms": 300, "timeout_ms": int(500 * SLOW)})
    poll_until(lambda: replicas(px)["self"]["state"] == "rejected", what="self rejected")
    assert "own proxy listener" in " ".join(replicas(px)["self"]["reasons"]), replicas(px)
    sim_reset(sim)
    before = handled(px)
    n = 10
    for _ in range(n):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                    "max_tokens": 1})
        assert r.status == 200 and r.headers["x-detproxy-replica"] == "real", r
    hops = handled(px) - before
    seen = len(client_requests(sim))
    print("    %d client requests: %d handled by the proxy, %d seen by the real replica"
          % (n, hops, seen))
    assert hops == n and seen == n, (hops, seen)
    # The real replica dies: the pool has nothing to offer, and says so at once.
    sim.kill()
    poll_until(lambda: replicas(px)["real"]["state"] == "unreachable", what="real unreachable")
    before = handled(px)
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert_openai_error(r, 503, "no_attested_replica")
    assert handled(px) - before == 1
    px.stop()


def test_the_unspecified_address_is_the_proxy_itself_too():
    """Connecting to 0.0.0.0 (or [::]) reaches this host's loopback: a replica URL naming it
    with the proxy's port is the proxy, whether it listens on 127.0.0.1 or a wildcard."""
    sim = start_sim("--model", MODEL)
    for listen in ("127.0.0.1", "0.0.0.0"):
        port = free_port()
        pl = self_pool(sim, port)
        pl["replicas"][1]["url"] = "http://0.0.0.0:%d" % port
        px = start_proxy(pools=[pl], listen="%s:%d" % (listen, port),
                         attestation={"interval_ms": 300, "timeout_ms": int(500 * SLOW)})
        poll_until(lambda: replicas(px)["self"]["state"] == "rejected",
                   what="0.0.0.0 rejected with the listener on %s" % listen)
        assert "own proxy listener" in " ".join(replicas(px)["self"]["reasons"]), replicas(px)
        px.stop()


def test_a_request_carrying_our_own_via_token_is_508_and_never_forwarded():
    sim = start_sim("--model", MODEL)
    px = start_proxy(pools=[{"name": "p", "models": [MODEL],
                             "replicas": [{"name": "r1", "url": "http://127.0.0.1:%d"
                                           % sim.port}]}])
    sim_reset(sim)
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                  headers={"via": "1.0 upstream-gw"})
    assert r.status == 200, r
    via = client_requests(sim)[0]["headers"]["via"]
    ours = re.findall(r"1\.1 detproxy-[0-9a-f]{16}", via)
    assert ours and via.startswith("1.0 upstream-gw, "), via  # the client's Via is kept, first
    # The same token coming back, on an inference route and on a pass-through one.
    for method, path in (("POST", "/v1/completions"), ("GET", "/anything")):
        sim_reset(sim)
        body = json.dumps({"model": MODEL, "prompt": "x"}) if method == "POST" else None
        r = http(method, px.port, path, body=body,
                 headers={"content-type": "application/json", "via": "1.1 a, " + ours[0]})
        assert_openai_error(r, 508, "loop_detected")
        assert sim_requests_total(sim) == 0
    # Someone else's detproxy token is not ours.
    r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1},
                  headers={"via": "1.1 detproxy-0123456789abcdef"})
    assert r.status == 200, r
    px.stop()


def sim_requests_total(sim):
    return len(client_requests(sim))


def test_a_discovered_address_that_is_the_proxy_itself_is_never_admitted():
    if not namespaces_work():
        print("    note: unshare -m is not permitted here; discovery case not run")
        return
    port = free_port()
    d = tempfile.mkdtemp(prefix="detproxy-self-")
    hosts = os.path.join(d, "hosts")
    sim = start_sim("--model", MODEL, listen="127.0.0.2:%d" % port)
    sim.host = "127.0.0.2"
    write_hosts(hosts, ["127.0.0.1", "127.0.0.2"])
    cfg = {"listen": "127.0.0.1:%d" % port,
           "attestation": {"interval_ms": 300, "timeout_ms": int(500 * SLOW)},
           "pools": [{"name": "p", "models": [MODEL], "balance": "round_robin",
                      "discovery": {"dns": NAME, "port": port, "refresh_ms": 200}}]}
    wrapper = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', hosts]
    px = start_proxy(config=cfg, wrapper=wrapper, ready=False)
    me, real = "127.0.0.1:%d" % port, "127.0.0.2:%d" % port
    poll_until(lambda: replicas(px).get(me, {}).get("state") == "rejected"
               and replicas(px).get(real, {}).get("state") == "admitted",
               what="self rejected, real admitted")
    assert "own proxy listener" in " ".join(replicas(px)[me]["reasons"])
    before = handled(px)
    for _ in range(6):
        r = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                    "max_tokens": 1})
        assert r.status == 200 and r.headers["x-detproxy-replica"] == real, r
    assert handled(px) - before == 6
    px.stop()


if __name__ == "__main__":
    run_tests(globals())
