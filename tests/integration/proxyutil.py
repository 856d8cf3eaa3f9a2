"""Helpers for tests that run `detproxy run` in front of detproxy-sim replicas.

    sims = [start_sim("--model", "m1") for _ in range(2)]
    px = start_proxy(pools=[pool("p", ["m1"], sims)])
    r = post_json(px.port, "/v1/completions", {"model": "m1", "prompt": "hi"})
    px.admin_port  # the admin listener
    px.stop()      # SIGTERM, expects exit 0 (and a clean ASan report under DP_SANITIZE)
"""

import json
import os
import tempfile

from harness import DETPROXY_BIN, get_json, http, start_process


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
                extra_args=(), **top):
    """Start detproxy on ephemeral ports with the given pools (or a whole config dict).
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
    p = start_process([DETPROXY_BIN, "run", "-c", path] + list(extra_args), env=env,
                      name="detproxy", ready_count=2, timeout=timeout)
    p.port = p.listener_port(listener="proxy")
    p.admin_port = p.listener_port(listener="admin")
    p.config_path = path
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
