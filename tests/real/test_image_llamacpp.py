"""The container image in front of real llama.cpp servers (docs/operations.md §8): what an
operator does after `make image IMAGE_FROM=host`. The image is made from this build tree, then
`detproxy check` and `detproxy run` run as containers of it (host network, 127.0.0.1, free
ports) in front of two llama-server replicas attested natively (llama.cpp's own /props): both
admitted as F16 llamacpp, /readyz 200, the tenant's forced temperature and seed reach the engine
(the same sampled answer twice, `x-detproxy-seed`), an unknown model is 404 `model_not_found`.

Needs root and podman (the image) and scripts/real-engine.sh (the engine): without the engine
(the Debian archive unreachable) it prints SKIPPED and exits 77, as without podman or root."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from realutil import require_engine, servers, skip, stop_servers  # noqa: E402
from harness import (DETPROXY_BIN, SANITIZE, SOURCE_DIR, free_port, get_json, http,  # noqa: E402
                     poll_until, post_json, run_tests)

if SANITIZE:
    skip("the image holds a Release build; the Release suite runs this")
if shutil.which("podman") is None or os.geteuid() != 0:
    skip("needs root and podman (scripts/podman-setup.sh)")
require_engine()

IMAGE = "localhost/detproxy:real-%d" % os.getpid()
NAME = "dp-real-%d" % os.getpid()
BUILD_DIR = os.path.dirname(os.path.dirname(DETPROXY_BIN))
TMP = tempfile.mkdtemp(prefix="detproxy-real-image-")
os.chmod(TMP, 0o755)


def podman(*args, check=True, timeout=120):
    cp = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)
    assert not check or cp.returncode == 0, (args, cp.stderr[-2000:])
    return cp


def test_the_host_image_serves_real_llamacpp_replicas():
    t0 = time.monotonic()
    cp = subprocess.run([os.path.join(SOURCE_DIR, "scripts", "image.sh")],
                        env=dict(os.environ, IMAGE=IMAGE, IMAGE_FROM="host", BUILD=BUILD_DIR),
                        capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr[-3000:]
    built_s = time.monotonic() - t0
    urls = servers("img", [[], []])
    ports = {"proxy": free_port(), "admin": free_port()}
    cfg = {
        "listen": "127.0.0.1:%d" % ports["proxy"],
        "admin_listen": "127.0.0.1:%d" % ports["admin"],
        "attestation": {"interval_ms": 5000, "timeout_ms": 3000},
        "pools": [{"name": "p", "models": ["tiny"], "manifest": {"quantization": "F16"},
                   "replicas": [{"name": "r%d" % (i + 1), "url": u,
                                 "attest": {"source": "llamacpp"}}
                                for i, u in enumerate(urls)]}],
        "policy": {"tenants": [{"name": "t", "match": {"any": True},
                                "sampling": {"temperature": {"force": 0.8},
                                             "seed": {"force": 4242}}}]},
    }
    path = os.path.join(TMP, "detproxy.json")
    with open(path, "w") as f:
        json.dump(cfg, f, indent=1)
    os.chmod(path, 0o644)
    mount = "%s:/etc/detproxy:ro" % TMP
    # The image's own `check`, then the image's default command (run -c /etc/detproxy/...).
    cp = podman("run", "--rm", "--network", "host", "-v", mount, IMAGE, "check", "-c",
                "/etc/detproxy/detproxy.json", check=False)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    podman("run", "-d", "--name", NAME, "--network", "host", "-v", mount, IMAGE)
    try:
        def ready():
            try:
                return http("GET", ports["admin"], "/readyz", timeout=2).status == 200
            except OSError:
                return False
        poll_until(ready, timeout=60, interval=0.2, what="detproxy container ready")
        ready_s = time.monotonic() - t0
        # /readyz turns 200 with the first admitted replica; the other's first attestation may
        # still be in flight, so wait for both to settle before judging them.
        def settled():
            reps = get_json(ports["admin"], "/admin/replicas")["replicas"]
            return all(r["state"] != "pending" for r in reps) and reps
        reps = poll_until(settled, timeout=30, interval=0.2, what="both replicas attested")
        assert [r["state"] for r in reps] == ["admitted", "admitted"], reps
        for r in reps:
            rep = r["attestation"]["report"]
            assert rep["quantization"] == "F16" and rep["framework"]["name"] == "llamacpp", rep
        texts, seen = set(), set()
        for _ in range(4):  # round robin: both replicas answer
            r = post_json(ports["proxy"], "/v1/completions",
                          {"model": "tiny", "prompt": "The image says", "max_tokens": 16,
                           "temperature": 0.1})
            assert r.status == 200, r
            assert r.headers["x-detproxy-seed"] == "4242", r.headers
            texts.add(r.json()["choices"][0]["text"])
            seen.add(r.headers["x-detproxy-replica"])
        assert len(texts) == 1 and seen == {"r1", "r2"}, (texts, seen)
        r = post_json(ports["proxy"], "/v1/completions", {"model": "nope", "prompt": "x"})
        assert r.status == 404 and r.json()["error"]["code"] == "model_not_found", r
        print("measured: " + json.dumps({"image_built_s": round(built_s, 1),
                                         "built_to_ready_s": round(ready_s, 1)}), flush=True)
    except BaseException:
        print(podman("logs", NAME, check=False).stderr[-3000:], flush=True)
        raise
    finally:
        podman("rm", "-f", "-t", "2", NAME, check=False)
        stop_servers()


if __name__ == "__main__":
    try:
        run_tests(globals())
    finally:
        stop_servers()
        podman("rm", "-f", "-t", "2", NAME, check=False)
        podman("rmi", "-f", IMAGE, check=False)
        shutil.rmtree(TMP, ignore_errors=True)
