#!/usr/bin/env python3
"""The container image, built and run by a real container engine (docs/operations.md §8).

- `make image IMAGE_FROM=host` (scripts/image.sh) packages the binaries under test (this build
  tree) and the libraries they load into an image in seconds, with nothing from any archive;
- `make image` (the default, IMAGE_FROM=source) builds deploy/docker/Dockerfile with podman,
  within a time budget (DP_IMAGE_BUDGET_S, default 600 s), into a small image (< 32 MB) holding
  the same files with the same runtime settings as the host one; both scripts set podman up
  themselves (scripts/podman-setup.sh: podman, its config, the local debian:bookworm-slim base);
- the demo's topology runs as containers of the host image on the host network (127.0.0.1, free
  ports): two simulated vLLM replicas that sign their own attestations, one from an older
  checkpoint, one attested by a separate `detproxy attest serve` agent container, and detproxy.
  Attestation (the old checkpoint is rejected with its reason, the others admitted) and policy
  (forced temperature and seed reach the replica; a denied parameter is 400) are checked through
  it;
- `podman kube play` runs deploy/k8s/sidecar.yaml's pod with the Dockerfile's image: the simulator
  as the app (and the replica detproxy discovers); its startup, liveness and readiness probes
  answer as the YAML expects.

Needs root and podman (.ci/run installs it; scripts/podman-setup.sh configures it). Without
them this test exits 77, which ctest reports as skipped, never as passed; so it does when the
Debian archive cannot be reached to make the base image the Dockerfile builds on (the host
image's tests have run by then).
"""


import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from harness import (DETPROXY_BIN, SLOW, SOURCE_DIR, free_port, get_json, http, poll_until,
                     post_json, run_tests, start_sim)

SKIP = 77
IMAGE = os.environ.get("DP_TEST_IMAGE", "localhost/detproxy:test")
HOST_IMAGE = IMAGE + "-host"
BASE = "docker.io/library/debian:bookworm-slim"
BUILD_DIR = os.environ.get("DP_BUILD_DIR") or os.path.dirname(os.path.dirname(DETPROXY_BIN))
MODEL = "demo/llama-sim"
TAG = "dp-i%d" % os.getpid()
BUDGET_S = float(os.environ.get("DP_IMAGE_BUDGET_S", "600"))


def skip(why):
    print("SKIP test_image: %s" % why, flush=True)
    sys.exit(SKIP)


def podman(*args, timeout=120, check=True):
    cp = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout * SLOW)
    if check and cp.returncode != 0:
        raise AssertionError("podman %s: rc=%d\n%s" % (" ".join(args), cp.returncode,
                                                       cp.stderr[-3000:]))
    return cp


def preflight():
    if os.environ.get("DP_SANITIZE") in ("1", "ON", "TRUE", "true"):
        skip("the image holds Release binaries; the Release suite runs this")
    if shutil.which("podman") is None:
        skip("podman is not installed (scripts/podman-setup.sh installs and configures it)")
    if os.geteuid() != 0:
        skip("needs root (rootful podman; the containers run as uid 10001 on root-owned files)")


preflight()
WORK = tempfile.mkdtemp(prefix="detproxy-image-")
os.chmod(WORK, 0o755)
CONTAINERS = []
SKIPPED = []  # tests that could not run here, with the reason


def cleanup_containers():
    for name in CONTAINERS:
        podman("rm", "-f", "-t", "2", name, check=False)
    CONTAINERS.clear()


def write(path, text, mode=0o644, owner=True):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
    if owner:
        os.chown(path, 10001, 10001)  # the image's runtime user


def run_container(name, argv, mounts=(), entrypoint=None, image=None):
    name = "%s-%s" % (TAG, name)
    args = ["run", "-d", "--name", name, "--network", "host"]
    for host, inside in mounts:
        args += ["-v", "%s:%s:ro" % (host, inside)]
    if entrypoint:
        args += ["--entrypoint", entrypoint]
    podman(*args, image or HOST_IMAGE, *argv)
    CONTAINERS.append(name)
    return name


def logs(name):
    return podman("logs", name, check=False).stderr


def wait_up(port, path, name, ok=(200,)):
    def up():
        try:
            return http("GET", port, path, timeout=2).status in ok
        except OSError:
            return False
    try:
        poll_until(up, timeout=30, interval=0.1, what="%s on port %d" % (name, port))
    except AssertionError:
        raise AssertionError("%s did not come up:\n%s" % (name, logs("%s-%s" % (TAG, name))))


# ---- the image -------------------------------------------------------------------------------


def make_image(image, budget_s, **env):
    """scripts/image.sh (what `make image` runs) into IMAGE; returns (seconds, bytes)."""
    # No stale image from an earlier run may stand in for this build in the tests below.
    podman("rmi", "-f", image, check=False)
    t0 = time.monotonic()
    cp = subprocess.run([os.path.join(SOURCE_DIR, "scripts", "image.sh")],
                        env=dict(os.environ, IMAGE=image, **env), capture_output=True, text=True,
                        timeout=budget_s * SLOW)
    took = time.monotonic() - t0
    assert cp.returncode == 0, cp.stderr[-4000:]
    # The script set podman up itself (idempotent: nothing to install or write here).
    assert "podman-setup: ok" in cp.stderr, cp.stderr[-2000:]
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout.strip())
    print("image %s: built in %.1f s, %.1f MB" % (image, took, size / 1e6), flush=True)
    assert took < budget_s, "image build took %.0f s, over the %.0f s budget" % (took, budget_s)
    assert size < 32e6, "image is %.1f MB" % (size / 1e6)
    # The commit of this tree is built in (cmake/version.cmake).
    ver = podman("run", "--rm", image, "--version").stdout
    head = subprocess.run(["git", "-C", SOURCE_DIR, "rev-parse", "--short=12", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    assert head and head in ver, (ver, head)
    cfg = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
    assert cfg["User"] == "10001:10001" and cfg["Entrypoint"] == ["detproxy"], cfg
    # No shell in the image: nothing to exec into but the two binaries.
    cp = podman("run", "--rm", "--entrypoint", "/bin/sh", image, "-c", "true", check=False)
    assert cp.returncode != 0
    # The simulator is there too, and runs.
    cp = podman("run", "--rm", "--entrypoint", "detproxy-sim", image, "--help", check=False)
    assert "usage: detproxy-sim" in cp.stdout + cp.stderr, cp
    return took, size


def files_of(image):
    """The image's paths with their modes and owners (a container's exported file system)."""
    name = "%s-ls-%d" % (TAG, len(CONTAINERS))
    podman("create", "--name", name, image)
    CONTAINERS.append(name)
    out = subprocess.run("podman export %s | tar -tv --numeric-owner" % name, shell=True,
                         capture_output=True, text=True, timeout=60 * SLOW)
    assert out.returncode == 0, out.stderr
    files = {}
    for line in out.stdout.splitlines():
        f = line.split()
        files["/" + f[-1].rstrip("/")] = (f[0], f[1])
    return files


def test_host_image_from_the_build_tree_in_seconds():
    # The binaries under test, as built: IMAGE_FROM=host compiles nothing it does not have to.
    took, size = make_image(HOST_IMAGE, 120, IMAGE_FROM="host", BUILD=BUILD_DIR)
    assert size < 16e6, "host image is %.1f MB" % (size / 1e6)
    files = files_of(HOST_IMAGE)
    assert files["/var/log/detproxy"][1] == "10001/10001", files["/var/log/detproxy"]
    assert files["/tmp"][0] == "drwxrwxrwt", files["/tmp"]
    assert "/etc/ssl/certs/ca-certificates.crt" in files
    # A sanitizer build is refused, with the reason.
    fake = os.path.join(WORK, "asan-build")
    os.makedirs(fake)
    with open(os.path.join(fake, "CMakeCache.txt"), "w") as f:
        f.write("DP_SANITIZE:BOOL=ON\n")
    cp = subprocess.run([os.path.join(SOURCE_DIR, "scripts", "image.sh")],
                        env=dict(os.environ, IMAGE=IMAGE + "-never", IMAGE_FROM="host",
                                 BUILD=fake), capture_output=True, text=True, timeout=60)
    assert cp.returncode != 0 and "sanitizer build" in cp.stderr, cp.stderr


def test_source_image_builds_small_within_budget_like_the_host_one():
    podman("rmi", "-f", IMAGE, check=False)  # no stale image for the kube play test below
    if podman("image", "exists", BASE, check=False).returncode:
        # What `make image` does on a fresh machine: scripts/podman-setup.sh makes the base.
        cp = subprocess.run([os.path.join(SOURCE_DIR, "scripts", "podman-setup.sh")],
                            capture_output=True, text=True, timeout=600)
        if cp.returncode != 0:
            SKIPPED.append("no %s and scripts/podman-setup.sh could not make one (the Debian "
                           "archive?): %s" % (BASE, cp.stderr.strip()[-400:]))
            print("SKIP %s" % SKIPPED[-1], flush=True)
            return
    make_image(IMAGE, BUDGET_S)
    # One image, two ways: the same runtime settings and the same files, modes and owners.
    def config(image):
        cfg = json.loads(podman("image", "inspect", image).stdout)[0]["Config"]
        cfg.pop("Labels", None)
        return cfg
    assert config(IMAGE) == config(HOST_IMAGE), (config(IMAGE), config(HOST_IMAGE))
    a, b = files_of(IMAGE), files_of(HOST_IMAGE)
    assert a == b, {"only in the Dockerfile's": sorted(set(a.items()) - set(b.items())),
                    "only in the host's": sorted(set(b.items()) - set(a.items()))}


# ---- the demo topology as containers ---------------------------------------------------------


def demo_files():
    d = os.path.join(WORK, "demo")
    os.makedirs(d, exist_ok=True)
    os.chmod(d, 0o755)
    rc = subprocess.run([DETPROXY_BIN, "attest", "keygen", "--out", os.path.join(d, "pipeline")],
                        capture_output=True).returncode
    assert rc == 0
    for f in ("pipeline.key.pem", "pipeline.pub.pem"):
        os.chown(os.path.join(d, f), 10001, 10001)
    write(os.path.join(d, "model", "config.json"), '{"architectures":["LlamaForCausalLM"]}\n')
    write(os.path.join(d, "model", "weights.bin"), "w" * 4096)
    os.chown(os.path.join(d, "model"), 10001, 10001)
    return d


def test_demo_topology_attestation_and_policy():
    d = demo_files()
    mnt = [(d, "/demo")]
    # The checkpoint hash of the model folder, computed by the image's own detproxy.
    cp = podman("run", "--rm", "-v", "%s:/demo:ro" % d, HOST_IMAGE, "attest", "hash",
                "/demo/model")
    ckpt = cp.stdout.split()[0]
    assert len(ckpt) == 64, cp.stdout
    old = "0" * 64
    ports = {n: free_port() for n in ("r1", "r2", "r3", "r4", "agent", "proxy", "admin")}
    common = ["--flavor", "vllm", "--model", MODEL, "--framework-version", "0.6.3",
              "--quantization", "awq", "--dtype", "float16"]
    for n, c in (("r1", ckpt), ("r2", ckpt), ("r3", old)):
        run_container(n, ["--listen", "127.0.0.1:%d" % ports[n], *common, "--checkpoint-sha256",
                          c, "--attest-key", "/demo/pipeline.key.pem"], mnt,
                      entrypoint="detproxy-sim")
    # r4 has no attestation of its own: a separate agent container vouches for it.
    run_container("r4", ["--listen", "127.0.0.1:%d" % ports["r4"], *common,
                         "--checkpoint-sha256", ckpt], entrypoint="detproxy-sim")
    for n in ("r1", "r2", "r3", "r4"):
        wait_up(ports[n], "/health", n)
    run_container("agent", ["attest", "serve", "--listen", "127.0.0.1:%d" % ports["agent"],
                            "--model-dir", "/demo/model", "--model", MODEL, "--quantization",
                            "awq", "--dtype", "float16", "--framework-url",
                            "http://127.0.0.1:%d" % ports["r4"], "--key",
                            "/demo/pipeline.key.pem"], mnt)
    wait_up(ports["agent"], "/attestation?nonce=abc", "agent")

    def agent(port):
        return {"source": "agent", "url": "http://127.0.0.1:%d/attestation" % port}
    cfg = {
        "listen": "127.0.0.1:%d" % ports["proxy"],
        "admin_listen": "127.0.0.1:%d" % ports["admin"],
        "attestation": {"interval_ms": 500, "timeout_ms": 1000, "require_signature": True,
                        "trusted_keys": ["/demo/pipeline.pub.pem"]},
        "pools": [{"name": "llama", "models": [MODEL],
                   "manifest": {"model": MODEL, "checkpoint_sha256": ckpt, "quantization": "awq",
                                "dtype": "float16",
                                "framework": {"name": "vllm", "version": "0.6.3"}},
                   "replicas": [
                       {"name": n, "url": "http://127.0.0.1:%d" % ports[n],
                        "attest": agent(ports["agent"] if n == "r4" else ports[n])}
                       for n in ("r1", "r2", "r3", "r4")]}],
        "policy": {"tenants": [
            {"name": "bank", "match": {"api_keys_sha256": [
                hashlib.sha256(b"sk-demo-bank-0001").hexdigest()]},
             "sampling": {"temperature": {"force": 0}, "seed": {"force": 1234}},
             "deny_params": ["logit_bias"]},
            {"name": "default", "match": {"any": True},
             "sampling": {"temperature": {"default": 0.7, "max": 1.0}}}]},
        "log": {"level": "info", "audit_path": "/tmp/audit.jsonl"},
    }
    write(os.path.join(d, "detproxy.json"), json.dumps(cfg, indent=1))
    cp = podman("run", "--rm", "--network", "host", "-v", "%s:/demo:ro" % d, HOST_IMAGE,
                "check", "-c", "/demo/detproxy.json")
    run_container("detproxy", ["run", "-c", "/demo/detproxy.json"], mnt)
    wait_up(ports["admin"], "/readyz", "detproxy")

    def states():
        return {r["name"]: r for r in get_json(ports["admin"], "/admin/replicas")["replicas"]}
    # Every replica decided (an agent with --framework-url answers 503 `measuring` until its
    # first read of the engine: r4 may take one more interval).
    poll_until(lambda: all(r["state"] != "pending" for r in states().values()), timeout=20,
               what="every replica attested")
    st = states()
    assert {n: st[n]["state"] for n in st} == {"r1": "admitted", "r2": "admitted",
                                               "r3": "rejected", "r4": "admitted"}, st
    assert any("checkpoint_sha256" in x for x in st["r3"]["reasons"]), st["r3"]
    assert st["r4"]["attestation"]["report"]["signed"] is True, st["r4"]
    # Policy through the containerised proxy, as the replica saw it.
    key = {"Authorization": "Bearer sk-demo-bank-0001"}
    seen = set()
    for i in range(12):
        r = post_json(ports["proxy"], "/v1/chat/completions",
                      {"model": MODEL, "messages": [{"role": "user", "content": "loan %d?" % i}],
                       "temperature": 0.9, "max_tokens": 8}, headers=key)
        assert r.status == 200, r
        assert r.headers["x-detproxy-tenant"] == "bank", r.headers
        assert r.headers.get("x-detproxy-seed") == "1234", r.headers
        rep = r.headers["x-detproxy-replica"]
        seen.add(rep)
        # This request as the replica got it (not the attestation probe or canary beside it).
        rid = r.headers["x-detproxy-request-id"]
        got = [q for q in get_json(ports[rep], "/_sim/requests")["requests"]
               if q["headers"].get("x-detproxy-request-id") == rid]
        assert len(got) == 1, rid
        body = json.loads(got[0]["body"])
        assert body["temperature"] == 0 and body["seed"] == 1234, body
    assert "r3" not in seen and len(seen) >= 2, seen
    r = post_json(ports["proxy"], "/v1/chat/completions",
                  {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                   "logit_bias": {"1": 5}}, headers=key)
    assert r.status == 400 and r.json()["error"]["code"] == "policy_violation", r
    cleanup_containers()


# ---- podman kube play: deploy/k8s/sidecar.yaml ----------------------------------------------


def load_yaml(path):
    import yaml
    with open(path) as f:
        return [x for x in yaml.safe_load_all(f) if x]


def playable_sidecar_pod(ports, d):
    """deploy/k8s/sidecar.yaml's pod template, changed only where this machine differs from a
    cluster (each change says why). Returns (pod, config)."""
    k8s = os.path.join(SOURCE_DIR, "deploy", "k8s")
    dep = [x for x in load_yaml(os.path.join(k8s, "sidecar.yaml")) if x["kind"] == "Deployment"][0]
    cms = {x["metadata"]["name"]: x for x in load_yaml(os.path.join(k8s, "configmaps.yaml"))
           if x.get("kind") == "ConfigMap"}
    spec = copy.deepcopy(dep["spec"]["template"]["spec"])
    # Podman 4.3 runs init containers to completion before the app; a native sidecar
    # (restartPolicy: Always) never completes. sidecar.yaml's own note for older clusters:
    # move it to containers and drop restartPolicy.
    sidecars = spec.pop("initContainers")
    assert [c.get("restartPolicy") for c in sidecars] == ["Always"]
    dp = sidecars[0]
    dp.pop("restartPolicy")
    dp["image"] = IMAGE
    spec["containers"].insert(0, dp)
    # The bridge network is not reachable from this VM's host: share the host's network with
    # free ports instead of the pod's own 8080 / 9901.
    spec["hostNetwork"] = True
    cfg = json.loads(cms["detproxy-config"]["data"]["sidecar.json"])
    admin_port = next(p["containerPort"] for p in dp["ports"] if p["name"] == "admin")
    assert cfg["admin_listen"].endswith(":%d" % admin_port)
    cfg["admin_listen"] = "127.0.0.1:%d" % ports["admin"]
    cfg["listen"] = "127.0.0.1:%d" % ports["proxy"]
    for p in dp["ports"]:
        if p["name"] == "admin":
            p["containerPort"] = ports["admin"]
    # No cluster DNS: the pool discovers the app container (the simulator) by a name that
    # resolves to loopback; the sim serves its own signed /attestation on the same port.
    pool = cfg["pools"][0]
    pool["discovery"].update({"dns": "127.0.0.1", "port": ports["sim"],
                              "attest": {"source": "agent", "port": ports["sim"]}})
    pool["discovery"]["refresh_ms"] = 500
    cfg["attestation"]["interval_ms"] = 1000
    model = pool["models"][0]
    man = json.loads(cms["detproxy-manifests"]["data"]["llama.json"])
    sim_args = ["--flavor", man["framework"]["name"], "--framework-version",
                man["framework"]["version"], "--model", model, "--quantization",
                man.get("quantization", "none"), "--dtype", man.get("dtype", "float16"),
                "--checkpoint-sha256", man["checkpoint_sha256"]]
    if man.get("canary"):
        # The manifest's canary hash is a placeholder to record from a trusted replica: record
        # it from the same simulator, run here, as `detproxy attest canary` would.
        ref = start_sim(*sim_args)
        can = man["canary"]
        r = post_json(ref.port, "/v1/completions",
                      {"model": man.get("model", model), "prompt": can["prompt"],
                       "max_tokens": can["max_tokens"], "temperature": 0, "seed": 0})
        can["expected_sha256"] = hashlib.sha256(
            r.json()["choices"][0]["text"].encode()).hexdigest()
        ref.stop()
    # The app: the simulator, as the replica the manifest pins.
    app = [c for c in spec["containers"] if c["name"] == "app"][0]
    app["image"] = IMAGE
    app["command"] = ["detproxy-sim"]
    app["args"] = ["--listen", "127.0.0.1:%d" % ports["sim"]] + sim_args + [
        "--attest-key", "/etc/sim/pipeline.key.pem"]
    app.pop("lifecycle", None)  # preStop sleep: podman 4.3 does not know the sleep action
    app["ports"] = [{"name": "http", "containerPort": ports["sim"]}]
    app.setdefault("volumeMounts", []).append({"name": "sim-key", "mountPath": "/etc/sim",
                                               "readOnly": True})
    app["securityContext"]["runAsUser"] = 10001
    # Projected ConfigMap and Secret volumes: podman 4.3 cannot project; the same files are
    # written under the same names into host folders.
    root = os.path.join(d, "etc-detproxy")
    write(os.path.join(root, "detproxy.json"), json.dumps(cfg, indent=1))
    write(os.path.join(root, "policy.json"), cms["detproxy-policy"]["data"]["policy.json"])
    write(os.path.join(root, "manifests", "llama.json"), json.dumps(man))
    rc = subprocess.run([DETPROXY_BIN, "attest", "keygen", "--out", os.path.join(d, "pipeline")],
                        capture_output=True).returncode
    assert rc == 0
    os.makedirs(os.path.join(root, "keys"), exist_ok=True)
    shutil.copy(os.path.join(d, "pipeline.pub.pem"), os.path.join(root, "keys"))
    simkey = os.path.join(d, "simkey")
    os.makedirs(simkey)
    shutil.copy(os.path.join(d, "pipeline.key.pem"), simkey)
    os.chown(os.path.join(simkey, "pipeline.key.pem"), 10001, 10001)
    tokdir = os.path.join(d, "admin-token")
    write(os.path.join(tokdir, "admin-token"), "sidecar-admin-token\n", mode=0o400)
    for dirpath, dirs, _ in os.walk(d):
        for x in dirs:
            os.chmod(os.path.join(dirpath, x), 0o755)
    host = {"detproxy-config": root, "detproxy-admin-token": tokdir}
    vols = []
    for v in spec["volumes"]:
        if v["name"] in host:
            vols.append({"name": v["name"], "hostPath": {"path": host[v["name"]],
                                                         "type": "Directory"}})
        else:
            vols.append(v)
    vols.append({"name": "sim-key", "hostPath": {"path": simkey, "type": "Directory"}})
    spec["volumes"] = vols
    # With the host's network there is nothing to map: podman refuses port declarations (the
    # probes below still resolve the named port "admin" from the YAML's own declaration).
    probes = copy.deepcopy(dp)
    for c in spec["containers"]:
        c.pop("ports", None)
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": TAG + "-sidecar", "labels": dep["spec"]["template"]["metadata"]
                        ["labels"]}, "spec": spec}
    return pod, probes


def test_kube_play_sidecar_pod_probes_answer():
    import yaml
    if podman("image", "exists", IMAGE, check=False).returncode:
        SKIPPED.append("kube play: no image from the Dockerfile (above)")
        print("SKIP %s" % SKIPPED[-1], flush=True)
        return
    d = os.path.join(WORK, "kube")
    os.makedirs(d)
    ports = {n: free_port() for n in ("admin", "proxy", "sim")}
    pod, dp = playable_sidecar_pod(ports, d)
    path = os.path.join(d, "pod.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(pod, f)
    podman("kube", "play", path, timeout=180)
    name = pod["metadata"]["name"]
    try:
        def probe(kind):
            pr = dp[kind]["httpGet"]
            port = ports["admin"] if pr["port"] == "admin" else pr["port"]
            try:
                return http("GET", port, pr["path"], timeout=2).status == 200
            except OSError:
                return False
        for kind in ("startupProbe", "livenessProbe"):
            poll_until(lambda: probe(kind), timeout=30, what=kind)
        # Readiness: only once the discovered simulator is attested and admitted.
        poll_until(lambda: probe("readinessProbe"), timeout=30, what="readinessProbe")
        tok = {"Authorization": "Bearer sidecar-admin-token"}
        reps = get_json(ports["admin"], "/admin/replicas", headers=tok)["replicas"]
        assert [r["state"] for r in reps] == ["admitted"], reps
        assert http("GET", ports["admin"], "/admin/replicas").status == 401
        # The app's own path: OPENAI_BASE_URL from the YAML, through detproxy to the replica.
        app = [c for c in pod["spec"]["containers"] if c["name"] == "app"][0]
        base = [e["value"] for e in app["env"] if e["name"] == "OPENAI_BASE_URL"][0]
        assert base.startswith("http://127.0.0.1:")
        model = reps[0]["attestation"]["report"]["model"]
        r = post_json(ports["proxy"], "/v1/chat/completions",
                      {"model": model, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4})
        assert r.status == 200 and r.headers["x-detproxy-replica"], r
    except BaseException:
        ps = podman("ps", "-a", "--pod", "--filter", "pod=" + name, check=False)
        print(ps.stdout, flush=True)
        for c in ("detproxy", "app"):
            out = podman("logs", "%s-%s" % (name, c), check=False)
            print("---- %s:\n%s%s" % (c, out.stdout[-3000:], out.stderr[-3000:]), flush=True)
        raise
    finally:
        podman("kube", "down", path, check=False)


if __name__ == "__main__":
    try:
        run_tests(globals())
    except SystemExit as e:
        # Every test that ran passed but some could not run: skipped, never passed.
        if e.code == 0 and SKIPPED:
            sys.exit(SKIP)
        raise
    finally:
        cleanup_containers()
        shutil.rmtree(WORK, ignore_errors=True)
