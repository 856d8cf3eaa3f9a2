#!/usr/bin/env python3
"""deploy/prometheus/ with Debian's Prometheus (docs/operations.md §6):

- `promtool check rules` on the alert and recording rules;
- `promtool test rules deploy/prometheus/detproxy.test.yml`: input series for every alert, each
  firing where it should and silent on its near miss;
- the Grafana dashboard is valid JSON whose queries name only detproxy metrics and recording
  rules that exist;
- a real Prometheus server scrapes a running detproxy on loopback, evaluates the shipped rules,
  and fires DetproxyCrossReplicaDrift for the pool with a drifted simulated replica (and for no
  other pool).

Without Debian's `prometheus` package (promtool and the server) this exits 77: ctest shows it
skipped, never passed."""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request

from harness import (SLOW, SOURCE_DIR, free_port, get_json, poll_until, post_json, run_cmd,
                     run_tests, start_sim)
from proxyutil import in_parallel, pool, start_proxy

PROM_DIR = os.path.join(SOURCE_DIR, "deploy", "prometheus")
RULES = [os.path.join(PROM_DIR, f) for f in ("alerts.yml", "recording.yml")]
MODEL = "m1"

PROMTOOL = shutil.which("promtool")
PROMETHEUS = shutil.which("prometheus")
if PROMTOOL is None or PROMETHEUS is None:
    print("SKIP test_prometheus: Debian's prometheus package (promtool, prometheus) is not "
          "installed: apt-get install prometheus", flush=True)
    sys.exit(77)


def test_promtool_check_rules():
    rc, out, err = run_cmd([PROMTOOL, "check", "rules", *RULES])
    assert rc == 0, out + err
    assert "SUCCESS" in out, out


def rule_docs():
    import yaml
    docs = []
    for f in RULES:
        with open(f) as fh:
            docs.append(yaml.safe_load(fh))
    return docs


def test_every_alert_has_a_unit_test():
    import yaml
    alerts = {r["alert"] for d in rule_docs() for g in d["groups"] for r in g["rules"]
              if "alert" in r}
    with open(os.path.join(PROM_DIR, "detproxy.test.yml")) as fh:
        t = yaml.safe_load(fh)
    tested = {a["alertname"] for case in t["tests"] for a in case.get("alert_rule_test", [])
              if a.get("exp_alerts")}
    assert alerts <= tested, "alerts without a firing test: %s" % sorted(alerts - tested)
    need = {"DetproxyReplicaNotAdmitted", "DetproxyAttestationFailures",
            "DetproxyFingerprintMismatch", "DetproxyCrossReplicaDrift",
            "DetproxyReplicaQuarantined", "DetproxyShadowErrors", "DetproxyOverloaded"}
    assert need <= alerts, sorted(need - alerts)


def test_promtool_test_rules():
    # promtool resolves rule_files against the test file's folder.
    cp = subprocess.run([PROMTOOL, "test", "rules", "detproxy.test.yml"], cwd=PROM_DIR,
                        capture_output=True, text=True, timeout=60 * SLOW)
    assert cp.returncode == 0, cp.stdout[-4000:] + cp.stderr[-2000:]
    assert "SUCCESS" in cp.stdout, cp.stdout


# Metric names docs/operations.md §6 lists, plus the gauges the status-page module adds.
DOCUMENTED_METRICS = {
    "detproxy_requests_total", "detproxy_request_duration_seconds",
    "detproxy_upstream_errors_total", "detproxy_replica_admitted",
    "detproxy_attestations_total", "detproxy_policy_overrides_total", "detproxy_shadow_total",
    "detproxy_shadow_similarity", "detproxy_fingerprint_mismatch_total",
    "detproxy_candidate_total", "detproxy_overload_rejections_total",
    "detproxy_drift_verdict", "detproxy_replica_quarantined", "detproxy_connections",
    "detproxy_inflight_requests",
}


def test_grafana_dashboard_queries_known_series():
    with open(os.path.join(PROM_DIR, "grafana-dashboard.json")) as fh:
        dash = json.load(fh)
    records = {r["record"] for d in rule_docs() for g in d["groups"] for r in g["rules"]
               if "record" in r}
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8, exprs
    for e in exprs:
        names = set(re.findall(r"\b((?:detproxy_|pool:|pool_kind:|tenant_param:)[\w:]+)", e))
        assert names, e
        for n in names:
            base = re.sub(r"_(bucket|sum|count)$", "", n)
            assert n in records or base in DOCUMENTED_METRICS, "%s: unknown series %s" % (e, n)
    # Templated on the datasource and the pool, so it imports into any Grafana.
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "pool"} <= names, names


# ---- a real Prometheus against a running detproxy --------------------------------------------


def prom_get(port, path):
    with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
        return json.loads(r.read())


def test_real_prometheus_fires_the_drift_alert():
    sims = [start_sim("--model", MODEL, "--quantization", "awq") for _ in range(2)]
    sims.append(start_sim("--model", MODEL, "--quantization", "gptq", "--report-quantization",
                          "awq"))
    good = [start_sim("--model", "m2") for _ in range(2)]
    px = start_proxy(pools=[pool("p", [MODEL], sims), pool("good", ["m2"], good)],
                     shadow={"rate": 0.7, "self_rate": 0.3, "max_inflight": 8})
    tmp = tempfile.mkdtemp(prefix="detproxy-prom-")
    cfg = os.path.join(tmp, "prometheus.yml")
    with open(cfg, "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "rule_files:\n%s"
                "scrape_configs:\n  - job_name: detproxy\n    static_configs:\n"
                "      - targets: ['127.0.0.1:%d']\n" % (
                    "".join("  - %s\n" % r for r in RULES), px.admin_port))
    port = free_port()
    log = open(os.path.join(tmp, "prometheus.log"), "w+")
    prom = subprocess.Popen([PROMETHEUS, "--config.file=" + cfg,
                             "--storage.tsdb.path=" + os.path.join(tmp, "data"),
                             "--web.listen-address=127.0.0.1:%d" % port],
                            stdout=log, stderr=subprocess.STDOUT)

    def ready():
        assert prom.poll() is None, "prometheus exited: %s" % open(log.name).read()[-3000:]
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d/-/ready" % port, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False
    poll_until(ready, timeout=30, interval=0.1, what="prometheus /-/ready")
    try:
        poll_until(lambda: any(t["health"] == "up" for t in
                               prom_get(port, "/api/v1/targets")["data"]["activeTargets"]),
                   timeout=30, what="prometheus scraped detproxy")
        # Rules loaded: every group of both files.
        groups = prom_get(port, "/api/v1/rules")["data"]["groups"]
        assert {g["name"] for g in groups} == {"detproxy.alerts", "detproxy.recording"}, groups

        def load(model, n):
            def one(i):
                r = post_json(px.port, "/v1/completions",
                              {"model": model, "prompt": "prom %s %d" % (model, i),
                               "max_tokens": 16, "temperature": 0})
                assert r.status == 200, r
            in_parallel(n, one)
        load(MODEL, 160)
        load("m2", 60)
        poll_until(lambda: get_json(px.admin_port, "/admin/drift")["pools"]["p"]["verdict"]
                   == "cross_replica_drift", timeout=20, what="drift verdict")

        def firing():
            alerts = prom_get(port, "/api/v1/alerts")["data"]["alerts"]
            return [a for a in alerts if a["labels"]["alertname"] == "DetproxyCrossReplicaDrift"
                    and a["state"] == "firing"]
        got = poll_until(firing, timeout=30, interval=0.5, what="DetproxyCrossReplicaDrift firing")
        assert [a["labels"]["pool"] for a in got] == ["p"], got
        assert got[0]["labels"]["severity"] == "page"
        assert "GET /admin/drift" in got[0]["annotations"]["description"]
        # The recording rules evaluate on real data too.
        q = prom_get(port, "/api/v1/query?query=pool:detproxy_replicas_admitted:sum")
        vals = {r["metric"]["pool"]: float(r["value"][1]) for r in q["data"]["result"]}
        assert vals == {"p": 3.0, "good": 2.0}, vals
        print("DetproxyCrossReplicaDrift fired for pool p", flush=True)
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        log.close()
        px.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    run_tests(globals())
