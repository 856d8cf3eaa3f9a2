#!/usr/bin/env python3
"""The deployment artifacts under deploy/ name only images, ports, paths and flags that exist.

There is no Kubernetes API server or container engine on the machines this runs on, so every
artifact is checked statically and, where a binary of this repo can run it, by running it:

- deploy/**/*.yaml parse (multi-document); Kubernetes objects hang together (selectors match pod
  labels, Services reach named container ports, mounts name volumes, ConfigMap/Secret items
  exist in the YAML or are created by the commands in deploy/k8s/README.md), images are only
  detproxy:* (deploy/docker/Dockerfile), vllm/vllm-openai:vX.Y.Z or quay.io/coreos/etcd:v3.5.Z,
  the namespace's Pod Security
  "restricted" rules hold, and drain timing fits detproxy's 30 s drain;
- every detproxy command line (Kubernetes command/args on top of the Dockerfile's ENTRYPOINT and
  CMD, the Dockerfile itself, the systemd units) uses subcommands and flags that
  `detproxy <cmd> --help` lists, and none that the help marks "not built yet";
- container and probe ports equal the listen/admin_listen of the config the container runs
  (or the agent's --listen), on an address the kubelet can reach;
- each embedded config, written with its mounts into a temporary root (placeholder keys from
  `detproxy attest keygen`), passes `detproxy check`; every path it names is provided by a mount
  of its container; it runs, and its probe paths answer as the probes expect;
- the etcd StatefulSet (etcd.yaml): 3 members with peer and client TLS from a Secret, stable
  names, one volume each, anti-affinity, probes on the plain metrics port, every flag one that
  `etcd --help` lists; the fleet gateway's endpoints are its members; three members started
  with its exact flags (names resolved through a private /etc/hosts) are joined over TLS by
  three gateways running the shipped fleet config;
- the vLLM pod's agent, started with the StatefulSet's exact flags against a simulated vLLM of the
  same model, quantization, dtype and version, is admitted by the gateway config's manifest,
  trusted key and policy;
- the Dockerfile's stages, packages (against scripts/deps.sh, CMake's pkg-config modules and the
  binaries' shared libraries), COPY sources and built paths (CMake configure is replayed on
  exactly what it copies; DP_DEPLOY_DOCKER_BUILD=1 also builds);
- the systemd units (`systemd-analyze verify` when installed), the nginx and HAProxy snippets
  (`nginx -t`, `haproxy -c` when installed) and their timeouts against the gateway config;
- test_checks_catch_mistakes feeds each checker a broken copy (a typo'd flag, a wrong probe port,
  an unmounted path, ...) and requires it to fail.

Needs python3-yaml (Debian package; scripts/deps.sh). Tools that are optional here (nginx,
haproxy, systemd-analyze) are skipped with a printed note when absent.
"""

import copy
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import *  # noqa: E402,F401,F403
from harness import SOURCE_DIR, DETPROXY_BIN, SIM_BIN  # noqa: E402
from certs import Factory  # noqa: E402

try:
    import yaml
except ImportError:
    print("test_deploy: FAIL: the Python YAML module is missing. Install Debian's python3-yaml "
          "(scripts/deps.sh lists it): apt-get install python3-yaml", file=sys.stderr)
    sys.exit(1)

DEPLOY = os.path.join(SOURCE_DIR, "deploy")
K8S = os.path.join(DEPLOY, "k8s")
DOCKERFILE = os.path.join(DEPLOY, "docker", "Dockerfile")
SYSTEMD = os.path.join(DEPLOY, "systemd")
LB = os.path.join(DEPLOY, "lb")

DETPROXY_IMAGE = re.compile(r"^detproxy(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?$")
VLLM_IMAGE = re.compile(r"^vllm/vllm-openai:v(\d+\.\d+\.\d+)$")
# The fleet's store: the etcd project's own release image, pinned to a 3.5 patch release (the
# maintained line, whose JSON gateway detproxy speaks; etcd.yaml's header says why this one).
ETCD_IMAGE = re.compile(r"^quay\.io/coreos/etcd:v(3\.5\.\d+)$")
ETCD = shutil.which("etcd") or ("/usr/bin/etcd" if os.access("/usr/bin/etcd", os.X_OK) else None)
# The one image that is not ours: the application in sidecar.yaml, in a domain that cannot
# resolve (RFC 2606), so it can never pull something real by accident.
APP_PLACEHOLDER_IMAGE = "registry.example/your-app:latest"

# detproxy run: SIGTERM drains in-flight requests for up to limits.shutdown_timeout_ms, 30 s by
# default (docs/requests.md §5).
DRAIN_S = 30


def drain_s(cfg):
    """The drain of a detproxy config, in seconds (rounded up)."""
    return -(-cfg.get("limits", {}).get("shutdown_timeout_ms", DRAIN_S * 1000) // 1000)
BOOL_FLAGS = {"-h", "--help", "--json", "--list", "--progress", "--no-progress"}
# Keys of a detproxy config whose values are file paths (docs/configuration.md).
LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|\[::1\]|\[::ffff:127\.\d+\.\d+\.\d+\])$")


def note(msg):
    print("     note: " + msg, flush=True)


class Bad(AssertionError):
    pass


def need(cond, msg):
    if not cond:
        raise Bad(msg)


# ---- loading ---------------------------------------------------------------------------------


def yaml_files():
    out = []
    for ext in ("yaml", "yml"):
        out += glob.glob(os.path.join(DEPLOY, "**", "*." + ext), recursive=True)
    return sorted(out)


def load_yaml(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


class Model:
    """Everything the checks look at, loaded once; negative controls mutate a deep copy."""

    def __init__(self):
        self.objs = []  # (file, doc)
        for p in sorted(glob.glob(os.path.join(K8S, "*.y*ml"))):
            for d in load_yaml(p):
                self.objs.append((os.path.basename(p), d))
        with open(os.path.join(K8S, "README.md"), encoding="utf-8") as f:
            self.readme = f.read()
        with open(DOCKERFILE, encoding="utf-8") as f:
            self.dockerfile = f.read()
        self.units = {}
        for p in sorted(glob.glob(os.path.join(SYSTEMD, "*.service"))):
            with open(p, encoding="utf-8") as f:
                self.units[os.path.basename(p)] = f.read()
        with open(os.path.join(LB, "nginx-detproxy.conf"), encoding="utf-8") as f:
            self.nginx = f.read()
        with open(os.path.join(LB, "haproxy-detproxy.cfg"), encoding="utf-8") as f:
            self.haproxy = f.read()

    # -- Kubernetes helpers
    def kind(self, kind):
        return [(f, d) for f, d in self.objs if d.get("kind") == kind]

    def find(self, kind, ns, name):
        for _, d in self.objs:
            md = d.get("metadata", {})
            if d.get("kind") == kind and md.get("name") == name and md.get("namespace") == ns:
                return d
        return None

    def workloads(self):
        """(file, obj, namespace, pod template) for every pod-owning object."""
        out = []
        for f, d in self.objs:
            if d.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
                out.append((f, d, d["metadata"].get("namespace"), d["spec"]["template"]))
        return out


def all_containers(pod_spec):
    """(container, is_init, is_native_sidecar)."""
    out = []
    for c in pod_spec.get("initContainers", []) or []:
        out.append((c, True, c.get("restartPolicy") == "Always"))
    for c in pod_spec.get("containers", []) or []:
        out.append((c, False, False))
    return out


def ident(f, d, c=None):
    s = "%s %s/%s" % (f, d.get("kind"), d.get("metadata", {}).get("name"))
    return s + (" container %s" % c["name"] if c else "")


# ---- the Dockerfile ----------------------------------------------------------------------------


def dockerfile_instructions(text):
    """[(INSTRUCTION, arguments)] with continuations joined and comments dropped."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not cur and (not s or s.startswith("#")):
            continue
        if cur and s.startswith("#"):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        word, _, rest = cur.partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def dockerfile_stages(text):
    """[{"from", "name", "ins": [(INSTR, args)]}]."""
    stages = []
    for ins, args in dockerfile_instructions(text):
        if ins == "FROM":
            parts = args.split()
            name = parts[2] if len(parts) >= 3 and parts[1].lower() == "as" else None
            stages.append({"from": parts[0], "name": name, "ins": []})
        elif stages:
            stages[-1]["ins"].append((ins, args))
        else:
            need(ins == "ARG", "Dockerfile: %s before the first FROM" % ins)
    return stages


def exec_form(args, what):
    try:
        v = json.loads(args)
    except ValueError:
        raise Bad("Dockerfile %s must use the exec (JSON array) form: %s" % (what, args))
    need(isinstance(v, list) and all(isinstance(x, str) for x in v),
         "Dockerfile %s: expected a JSON array of strings" % what)
    return v


def image_entrypoint_cmd(m):
    final = dockerfile_stages(m.dockerfile)[-1]
    ep = cmd = None
    for ins, args in final["ins"]:
        if ins == "ENTRYPOINT":
            ep = exec_form(args, "ENTRYPOINT")
        elif ins == "CMD":
            cmd = exec_form(args, "CMD")
    return ep or [], cmd or []


def image_user(m):
    final = dockerfile_stages(m.dockerfile)[-1]
    users = [a for i, a in final["ins"] if i == "USER"]
    need(users, "Dockerfile: the runtime stage has no USER (it would run as root)")
    u = users[-1].split(":")
    need(all(x.isdigit() for x in u), "Dockerfile: USER %s must be numeric (uid:gid) so that "
         "Kubernetes runAsNonRoot can verify it" % users[-1])
    need(int(u[0]) != 0, "Dockerfile: USER is root")
    return int(u[0])


def apt_packages(run_args):
    """Packages of every `apt-get install` in a RUN line."""
    pkgs = []
    for m in re.finditer(r"apt-get\s+install\s+([^&;|]*)", run_args):
        for w in m.group(1).split():
            if not w.startswith("-"):
                pkgs.append(w)
    return pkgs


def deps_sh_packages():
    with open(os.path.join(SOURCE_DIR, "scripts", "deps.sh"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"pkgs=\(([^)]*)\)", text, re.S)
    need(m, "scripts/deps.sh: cannot find its pkgs=(...) list")
    return {w for w in m.group(1).split() if not w.startswith('"$')}


# pkg-config module (CMakeLists.txt pkg_check_modules) -> Debian -dev package.
PKGCONFIG_DEV = {"libuv": "libuv1-dev", "libcjson": "libcjson-dev", "openssl": "libssl-dev"}


# ---- detproxy command lines against --help ---------------------------------------------------

_help_cache = {}


def help_text(*cmd):
    if cmd not in _help_cache:
        rc, out, err = run_cmd([DETPROXY_BIN] + list(cmd) + ["--help"])
        need(rc == 0, "`detproxy %s --help` exits %d (%s): that subcommand cannot be used in a "
             "deployment yet" % (" ".join(cmd), rc, (out + err).strip()[:200]))
        _help_cache[cmd] = out + err
    return _help_cache[cmd]


def help_subcommands(text):
    subs, on = set(), False
    for line in text.splitlines():
        if line.strip().lower() == "commands:":
            on = True
            continue
        if on:
            if not line.strip():
                break
            subs.add(line.split()[0])
    return subs


def help_flags(text):
    """(usable flags, flags the help marks as not built)."""
    flags, unbuilt = set(), set()
    in_usage = False
    for line in text.splitlines():
        if line.startswith("usage:"):
            in_usage = True
        elif not line.strip():
            in_usage = False
        if in_usage:
            scope = line
        elif line.startswith(" ") and line.lstrip().startswith("-"):
            # An option line: the flags are in its first column; the description after two or
            # more spaces may mention other programs' flags ("vLLM --api-key").
            scope = re.split(r"\s{2,}", line.strip())[0]
        else:
            continue
        found = re.findall(r"(?<![\w-])(--?[A-Za-z][A-Za-z0-9-]*)", scope)
        if "not built yet" in line:
            unbuilt.update(found)
        else:
            flags.update(found)
    return flags - unbuilt, unbuilt


def check_detproxy_argv(argv, where):
    """argv starts with the detproxy binary. Returns (subcommand tuple, {flag: value})."""
    need(len(argv) >= 2, "%s: `%s`: no subcommand" % (where, " ".join(argv)))
    top = help_subcommands(help_text())
    sub = argv[1]
    need(sub in top, "%s: `detproxy %s`: no such subcommand (detproxy --help lists %s)" % (
        where, sub, ", ".join(sorted(top))))
    cmd, rest = (sub,), argv[2:]
    if sub == "attest":
        need(len(argv) >= 3, "%s: `detproxy attest` without a subcommand" % where)
        subs = help_subcommands(help_text("attest"))
        need(argv[2] in subs, "%s: `detproxy attest %s`: no such subcommand (%s)" % (
            where, argv[2], ", ".join(sorted(subs))))
        cmd, rest = ("attest", argv[2]), argv[3:]
    ok, unbuilt = help_flags(help_text(*cmd))
    opts, i = {}, 0
    while i < len(rest):
        tok = rest[i]
        if not tok.startswith("-") and cmd == ("attest", "hash") and "DIR" not in opts:
            opts["DIR"] = tok  # its one positional argument
            i += 1
            continue
        need(tok.startswith("-"), "%s: `detproxy %s`: unexpected argument %r" % (
            where, " ".join(cmd), tok))
        name, eq, val = tok.partition("=")
        need(name not in unbuilt, "%s: `detproxy %s %s`: the help says this flag is not built "
             "yet" % (where, " ".join(cmd), name))
        need(name in ok, "%s: `detproxy %s`: unknown flag %s (the help lists %s)" % (
            where, " ".join(cmd), name, ", ".join(sorted(ok))))
        if name in BOOL_FLAGS:
            opts[name] = True
        elif eq:
            opts[name] = val
        else:
            need(i + 1 < len(rest), "%s: %s needs a value" % (where, name))
            opts[name] = rest[i + 1]
            i += 1
        i += 1
    if "-c" in opts:
        opts["--config"] = opts.pop("-c")
    return cmd, opts


def container_argv(m, c):
    """The argv a container runs: command (or the image ENTRYPOINT) + args (or CMD)."""
    ep, cmd = image_entrypoint_cmd(m) if DETPROXY_IMAGE.match(c.get("image", "")) else ([], [])
    if c.get("command"):
        return list(c["command"]) + list(c.get("args") or [])
    return ep + (list(c["args"]) if "args" in c else cmd)


def detproxy_containers(m):
    """(file, obj, ns, pod_spec, container, cmd tuple, opts) for containers running detproxy."""
    out = []
    for f, d, ns, tpl in m.workloads():
        pod = tpl["spec"]
        for c, _, _ in all_containers(pod):
            if not DETPROXY_IMAGE.match(c.get("image", "")):
                continue
            argv = container_argv(m, c)
            need(argv and os.path.basename(argv[0]) == "detproxy",
                 "%s: runs %r, not detproxy" % (ident(f, d, c), argv[:1]))
            cmd, opts = check_detproxy_argv(argv, ident(f, d, c))
            out.append((f, d, ns, pod, c, cmd, opts))
    return out


def parse_addr(s, where):
    m = re.match(r"^(\[[0-9A-Fa-f:.]+\]|\d+\.\d+\.\d+\.\d+):(\d+)$", s or "")
    need(m, "%s: %r is not a numeric HOST:PORT" % (where, s))
    return m.group(1), int(m.group(2))


def probes(c):
    return [(k, c[k]) for k in ("startupProbe", "livenessProbe", "readinessProbe") if c.get(k)]


def port_number(c, port, where):
    if isinstance(port, int):
        return port
    for p in c.get("ports", []) or []:
        if p.get("name") == port:
            return p["containerPort"]
    raise Bad("%s: probe/target port %r names no port of the container" % (where, port))


# ---- materialising a container's mounts --------------------------------------------------------


class Keys:
    """One Ed25519 pair per name prefix (pipeline.key.pem and pipeline.pub.pem are a pair), and a
    random admin token: placeholders for what README.md creates with kubectl."""

    def __init__(self, tmp):
        self.dir = os.path.join(tmp, "keys")
        os.makedirs(self.dir, exist_ok=True)
        self.pairs = {}
        self.token = hashlib.sha256(os.urandom(16)).hexdigest()
        self.tls = None

    def cert_files(self, secret):
        """ca.crt, tls.crt, tls.key of a cert-manager-style Secret: etcd-tls holds the member
        certificate (every member's name, server and client use), any other one a client
        certificate from the same CA (README.md's openssl commands make the same)."""
        if self.tls is None:
            f = Factory(os.path.join(self.dir, "etcd-pki"))
            ca = f.ca("etcd-ca", "etcd CA")
            names = [u.split("//")[1].split(":")[0] for d, ns in etcd_sets(MODEL or model())
                     for u in etcd_member_urls(d, ns, "https", 2379)]
            member = f.leaf(ca, "etcd-member", "etcd", names + ["localhost"], ["127.0.0.1"],
                            client="both")
            client = f.leaf(ca, "etcd-client", "detproxy", client=True)
            self.tls = (ca, member, client)
        ca, member, client = self.tls
        leaf = member if secret == "etcd-tls" else client
        return {"ca.crt": ca.crt, "tls.crt": leaf.crt, "tls.key": leaf.key}

    def content(self, key, where, secret=None):
        if key in ("ca.crt", "tls.crt", "tls.key"):
            with open(self.cert_files(secret)[key], "rb") as f:
                return f.read()
        for suffix in (".key.pem", ".pub.pem"):
            if key.endswith(suffix):
                prefix = key[:-len(suffix)]
                if prefix not in self.pairs:
                    out = os.path.join(self.dir, prefix)
                    rc, o, e = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", out])
                    need(rc == 0, "detproxy attest keygen failed: %s" % (o + e))
                    self.pairs[prefix] = out
                with open(self.pairs[prefix] + suffix, "rb") as f:
                    return f.read()
        if "token" in key:
            return (self.token + "\n").encode()
        raise Bad("%s: no placeholder for a secret item named %r (expected *.key.pem, *.pub.pem "
                  "or *token*)" % (where, key))


def readme_created(m, what):
    """{name: set(keys)} of `kubectl create secret generic|configmap NAME --from-file=KEY=...`."""
    out = {}
    pat = r"create\s+secret\s+generic" if what == "secret" else r"create\s+configmap"
    for mm in re.finditer(pat + r"\s+(\S+)((?:\s+--from-file=\S+)+)", m.readme):
        # --from-file=KEY=PATH, or --from-file=PATH (the key is the file's name).
        keys = {kv.split("=", 1)[0] if "=" in kv else os.path.basename(kv)
                for kv in re.findall(r"--from-file=(\S+)", mm.group(2))}
        out.setdefault(mm.group(1), set()).update(keys)
    return out


def source_files(m, ns, src_kind, src, where, keys):
    """{relative path: (bytes, mode or None)} a configMap/secret volume source provides."""
    name = src.get("name") if src_kind == "configMap" else src.get("secretName", src.get("name"))
    obj = m.find("ConfigMap" if src_kind == "configMap" else "Secret", ns, name)
    items = src.get("items")
    if obj is not None:
        data = dict(obj.get("data") or {})
        for k, v in (obj.get("stringData") or {}).items():
            data[k] = v
        if items is None:
            items = [{"key": k, "path": k} for k in data]
        out = {}
        for it in items:
            need(it["key"] in data, "%s: %s %s has no key %r" % (where, src_kind, name,
                                                                 it["key"]))
            out[it["path"]] = (data[it["key"]].encode(), it.get("mode"))
        return out
    created = readme_created(m, "secret" if src_kind == "secret" else "configmap")
    need(name in created, "%s: %s %s is neither in deploy/k8s/*.yaml nor created by a kubectl "
         "command in deploy/k8s/README.md" % (where, src_kind, name))
    need(items, "%s: %s %s is created outside the YAML: list its items so the files are "
         "known" % (where, src_kind, name))
    out = {}
    for it in items:
        need(it["key"] in created[name], "%s: README.md creates %s %s without the key %r" % (
            where, src_kind, name, it["key"]))
        out[it["path"]] = (keys.content(it["key"], where, name), it.get("mode"))
    return out


def materialize(m, ns, pod, c, root, keys, where, claims=()):
    """Write what container c sees under root (root + mountPath); claims: the names of a
    StatefulSet's volumeClaimTemplates. Returns [(mountPath, kind, writable)]."""
    vols = {v["name"]: v for v in pod.get("volumes", []) or []}
    vols.update({n: {"name": n, "persistentVolumeClaim": {"claimName": n}} for n in claims})
    fs_group = (pod.get("securityContext") or {}).get("fsGroup")
    mounts = []
    for vm in c.get("volumeMounts", []) or []:
        need(vm["name"] in vols, "%s: volumeMount %s names no volume" % (where, vm["name"]))
        v = vols[vm["name"]]
        dest = os.path.join(root, vm["mountPath"].lstrip("/"))
        os.makedirs(dest, exist_ok=True)
        files, kind = {}, None
        for src_kind in ("configMap", "secret"):
            if src_kind in v:
                kind = src_kind
                dm = v[src_kind].get("defaultMode", 0o644)
                for p, (data, mode) in source_files(m, ns, src_kind, v[src_kind], where,
                                                    keys).items():
                    files[p] = (data, mode if mode is not None else dm)
        if "projected" in v:
            kind = "projected"
            dm = v["projected"].get("defaultMode", 0o644)
            for s in v["projected"].get("sources", []):
                for src_kind in ("configMap", "secret"):
                    if src_kind in s:
                        for p, (data, mode) in source_files(m, ns, src_kind, s[src_kind], where,
                                                            keys).items():
                            need(p not in files, "%s: projected volume %s has %s twice" % (
                                where, vm["name"], p))
                            files[p] = (data, mode if mode is not None else dm)
        if "emptyDir" in v:
            kind = "emptyDir"
        if "persistentVolumeClaim" in v:
            kind = "persistentVolumeClaim"
        need(kind, "%s: volume %s: unsupported type for this test" % (where, vm["name"]))
        for p, (data, mode) in files.items():
            path = os.path.join(dest, p)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
            if fs_group is not None:
                mode |= 0o440  # the kubelet adds group read for fsGroup (kubernetes#57923)
            os.chmod(path, mode)
        writable = kind in ("emptyDir", "persistentVolumeClaim") and not vm.get("readOnly")
        mounts.append((vm["mountPath"].rstrip("/") or "/", kind, writable))
    return mounts


def mount_of(mounts, path):
    best = None
    for mp, kind, w in mounts:
        if path == mp or path.startswith(mp + "/"):
            if best is None or len(mp) > len(best[0]):
                best = (mp, kind, w)
    return best


def config_path_refs(cfg):
    """(JSON path, value) of every file path in a detproxy config (docs/configuration.md)."""
    out = []
    if isinstance(cfg.get("policy"), str):
        out.append(("policy", cfg["policy"]))
    for k in ("admin_token_file",):
        if isinstance(cfg.get(k), str):
            out.append((k, cfg[k]))
    for k in ("cert_file", "key_file", "client_ca_file"):
        if isinstance((cfg.get("tls") or {}).get(k), str):
            out.append(("tls." + k, cfg["tls"][k]))
    for i, k in enumerate((cfg.get("attestation") or {}).get("trusted_keys") or []):
        out.append(("attestation.trusted_keys[%d]" % i, k))
    if isinstance((cfg.get("log") or {}).get("audit_path"), str):
        out.append(("log.audit_path", cfg["log"]["audit_path"]))
    etcd = (cfg.get("fleet") or {}).get("etcd") or {}
    for k in ("ca", "cert", "key"):
        if isinstance((etcd.get("tls") or {}).get(k), str):
            out.append(("fleet.etcd.tls." + k, etcd["tls"][k]))
    if isinstance(etcd.get("password_file"), str):
        out.append(("fleet.etcd.password_file", etcd["password_file"]))
    for i, p in enumerate(cfg.get("pools") or []):
        if isinstance(p.get("manifest"), str):
            out.append(("pools[%d].manifest" % i, p["manifest"]))
        if isinstance(p.get("api_key_file"), str):
            out.append(("pools[%d].api_key_file" % i, p["api_key_file"]))
        for k in ("ca_file", "client_cert_file", "client_key_file"):
            if isinstance((p.get("upstream_tls") or {}).get(k), str):
                out.append(("pools[%d].upstream_tls.%s" % (i, k), p["upstream_tls"][k]))
    return out


def set_json_path(obj, jpath, value):
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", jpath)
    for p in parts[:-1]:
        obj = obj[int(p[1:-1])] if p.startswith("[") else obj[p]
    last = parts[-1]
    if last.startswith("["):
        obj[int(last[1:-1])] = value
    else:
        obj[last] = value


class RunConfig:
    """A `detproxy run` container's config, materialised under a temporary root."""

    def __init__(self, m, entry, tmp, keys):
        f, d, ns, pod, c, cmd, opts = entry
        self.where = ident(f, d, c)
        self.pod, self.c, self.ns, self.obj = pod, c, ns, d
        self.root = tempfile.mkdtemp(prefix="root-", dir=tmp)
        self.mounts = materialize(m, ns, pod, c, self.root, keys, self.where)
        self.keys = keys
        cpath = opts.get("--config")
        need(cpath and cpath.startswith("/"), "%s: -c needs an absolute path, got %r" % (
            self.where, cpath))
        need(mount_of(self.mounts, cpath), "%s: the config %s is on no volume mount" % (
            self.where, cpath))
        self.cpath = cpath
        host_cfg = self.host(cpath)
        need(os.path.isfile(host_cfg), "%s: no file %s in its mounts" % (self.where, cpath))
        with open(host_cfg, encoding="utf-8") as fh:
            try:
                self.cfg = json.load(fh)
            except ValueError as e:
                raise Bad("%s: %s is not valid JSON: %s" % (self.where, cpath, e))
        self.refs = []  # (json path, path in the container)
        for jp, val in config_path_refs(self.cfg):
            inside = val if val.startswith("/") else os.path.normpath(
                os.path.join(os.path.dirname(cpath), val))
            self.refs.append((jp, inside))

    def host(self, inside):
        return os.path.join(self.root, inside.lstrip("/"))

    def check_refs(self):
        for jp, inside in self.refs:
            if jp == "log.audit_path":
                mnt = mount_of(self.mounts, os.path.dirname(inside))
                need(mnt and mnt[2], "%s: %s %s: its folder is not on a writable volume "
                     "(emptyDir/PVC) of the container (the root filesystem is read-only)" % (
                         self.where, jp, inside))
                continue
            mnt = mount_of(self.mounts, inside)
            need(mnt, "%s: %s = %s is provided by no volume mount of the container" % (
                self.where, jp, inside))
            need(os.path.isfile(self.host(inside)), "%s: %s = %s: the %s mounted at %s has no "
                 "such file" % (self.where, jp, inside, mnt[1], mnt[0]))

    def write(self, mutate=None):
        """Write the config with absolute paths moved under the root; returns its host path."""
        cfg = copy.deepcopy(self.cfg)
        for jp, val in config_path_refs(cfg):
            if val.startswith("/"):
                set_json_path(cfg, jp, self.host(val))
        if mutate:
            mutate(cfg)
        path = self.host(self.cpath)
        if os.path.islink(path) or os.path.exists(path):
            os.remove(path)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(cfg, fh, indent=2)
        return path

    def token(self):
        p = self.cfg.get("admin_token_file")
        if not p:
            return None
        inside = p if p.startswith("/") else os.path.join(os.path.dirname(self.cpath), p)
        with open(self.host(inside), encoding="utf-8") as fh:
            return fh.read().strip()


# ---- the checks (each takes a Model, so a broken copy can be fed to it) ------------------------


def check_k8s_structure(m):
    namespaces = {d["metadata"]["name"] for _, d in m.kind("Namespace")}
    for f, d in m.objs:
        need(d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name"),
             "%s: a document without apiVersion/kind/metadata.name" % f)
        if d["kind"] != "Namespace":
            ns = d["metadata"].get("namespace")
            need(ns in namespaces, "%s: namespace %r is not created by any manifest" % (
                ident(f, d), ns))
    pods = []  # (ns, labels, pod spec, owner)
    for f, d, ns, tpl in m.workloads():
        sel = d["spec"].get("selector", {}).get("matchLabels", {})
        labels = tpl.get("metadata", {}).get("labels", {})
        need(sel and all(labels.get(k) == v for k, v in sel.items()),
             "%s: selector %r does not match the pod template labels %r" % (ident(f, d), sel,
                                                                            labels))
        pods.append((ns, labels, tpl["spec"], (f, d)))
        spec = tpl["spec"]
        vols = [v["name"] for v in spec.get("volumes", []) or []] + [
            v["metadata"]["name"] for v in d["spec"].get("volumeClaimTemplates", []) or []]
        need(len(vols) == len(set(vols)), "%s: duplicate volume names" % ident(f, d))
        names = [c["name"] for c, _, _ in all_containers(spec)]
        need(len(names) == len(set(names)), "%s: duplicate container names" % ident(f, d))
        used = set()
        for c, is_init, sidecar in all_containers(spec):
            for vm in c.get("volumeMounts", []) or []:
                need(vm["name"] in vols, "%s: volumeMount %r names no volume" % (
                    ident(f, d, c), vm["name"]))
                used.add(vm["name"])
            if is_init and not sidecar:
                need(not probes(c), "%s: an init container cannot have probes unless it is a "
                     "native sidecar (restartPolicy: Always)" % ident(f, d, c))
            for kind, pr in probes(c):
                if "httpGet" in pr:
                    port_number(c, pr["httpGet"]["port"], ident(f, d, c) + " " + kind)
        for v in vols:
            need(v in used, "%s: volume %s is mounted by no container" % (ident(f, d), v))
        if d["kind"] == "StatefulSet":
            svc = m.find("Service", ns, d["spec"].get("serviceName"))
            need(svc is not None and svc["spec"].get("clusterIP") == "None",
                 "%s: serviceName %r is not a headless Service in %s" % (
                     ident(f, d), d["spec"].get("serviceName"), ns))

    def matching(ns, sel):
        return [p for p in pods if p[0] == ns and sel and all(
            p[1].get(k) == v for k, v in sel.items())]

    for f, d in m.kind("Service"):
        ns, sel = d["metadata"]["namespace"], d["spec"].get("selector", {})
        targets = matching(ns, sel)
        need(targets, "%s: selector %r matches no pod template" % (ident(f, d), sel))
        for p in d["spec"].get("ports", []):
            tp = p.get("targetPort", p["port"])
            for _, _, spec, owner in targets:
                ports = [(cp.get("name"), cp["containerPort"]) for c, _, _ in
                         all_containers(spec) for cp in c.get("ports", []) or []]
                ok = any(tp == n for n, _ in ports) if isinstance(tp, str) else any(
                    tp == n for _, n in ports)
                need(ok, "%s: targetPort %r is no container port of %s" % (
                    ident(f, d), tp, ident(*owner)))
    for f, d in m.kind("PodDisruptionBudget"):
        sel = d["spec"].get("selector", {}).get("matchLabels", {})
        need(matching(d["metadata"]["namespace"], sel), "%s: selector %r matches no pod "
             "template" % (ident(f, d), sel))
    for f, d in m.kind("NetworkPolicy"):
        ns = d["metadata"]["namespace"]
        sel = d["spec"].get("podSelector", {}).get("matchLabels", {})
        targets = matching(ns, sel)
        need(targets, "%s: podSelector matches no pod template" % ident(f, d))
        for rule in d["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                need(any(p["port"] == cp["containerPort"] or p["port"] == cp.get("name")
                         for _, _, spec, _ in targets for c, _, _ in all_containers(spec)
                         for cp in c.get("ports", []) or []),
                     "%s: port %r is no container port of the selected pods" % (ident(f, d),
                                                                                p["port"]))
    # Every pod running `detproxy run` that discovers a Service must be let in by the policies
    # guarding that Service's pods.
    for f, d, ns, pod, c, cmd, opts in detproxy_containers(m):
        if cmd != ("run",):
            continue
        owner_labels = next(p[1] for p in pods if p[2] is pod)
        for dns in discovery_names(m, ns, pod, c, opts):
            svc_name, svc_ns = dns
            svc = m.find("Service", svc_ns, svc_name)
            for pf, pd in m.kind("NetworkPolicy"):
                if pd["metadata"]["namespace"] != svc_ns:
                    continue
                psel = pd["spec"].get("podSelector", {}).get("matchLabels", {})
                if not all(svc["spec"]["selector"].get(k) == v for k, v in psel.items()):
                    continue
                allowed = False
                for rule in pd["spec"].get("ingress", []):
                    for fr in rule.get("from", []):
                        ps = fr.get("podSelector", {}).get("matchLabels", {})
                        same_ns = "namespaceSelector" in fr or svc_ns == ns
                        if same_ns and all(owner_labels.get(k) == v for k, v in ps.items()):
                            allowed = True
                need(allowed, "%s: discovers %s.%s but %s does not let its pods in (labels "
                     "%r)" % (ident(f, d, c), svc_name, svc_ns, ident(pf, pd), owner_labels))


def discovery_names(m, ns, pod, c, opts):
    """(service, namespace) of every discovery.dns in the config a run container uses."""
    cfg = embedded_config(m, ns, pod, c, opts)
    out = []
    for p in cfg.get("pools", []):
        dns = (p.get("discovery") or {}).get("dns")
        if dns:
            mm = re.match(r"^([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local\.?$", dns)
            need(mm, "discovery.dns %r is not <service>.<namespace>.svc.cluster.local" % dns)
            out.append((mm.group(1), mm.group(2)))
    return out


def embedded_config(m, ns, pod, c, opts):
    """The config JSON a run container reads, straight from its ConfigMap (no files written)."""
    cpath = opts.get("--config")
    vols = {v["name"]: v for v in pod.get("volumes", []) or []}
    for vm in c.get("volumeMounts", []) or []:
        mp = vm["mountPath"].rstrip("/")
        if not (cpath or "").startswith(mp + "/"):
            continue
        rel = cpath[len(mp) + 1:]
        v = vols.get(vm["name"], {})
        srcs = [s for s in (v.get("projected") or {}).get("sources", [])] + (
            [{"configMap": v["configMap"]}] if "configMap" in v else [])
        for s in srcs:
            cm = s.get("configMap")
            if not cm:
                continue
            obj = m.find("ConfigMap", ns, cm["name"])
            for it in cm.get("items") or [{"key": k, "path": k} for k in (obj or {}).get(
                    "data", {})]:
                if it["path"] == rel and obj is not None and it["key"] in obj.get("data", {}):
                    return json.loads(obj["data"][it["key"]])
    raise Bad("%s: the config %s comes from no ConfigMap in the YAML" % (c["name"], cpath))


def check_k8s_images(m):
    for f, d, ns, tpl in m.workloads():
        for c, _, _ in all_containers(tpl["spec"]):
            img = c.get("image", "")
            ok = DETPROXY_IMAGE.match(img) or VLLM_IMAGE.match(img) or ETCD_IMAGE.match(img) or (
                img == APP_PLACEHOLDER_IMAGE and f == "sidecar.yaml")
            need(ok, "%s: image %r is neither detproxy:* (deploy/docker/Dockerfile), "
                 "vllm/vllm-openai:vX.Y.Z nor quay.io/coreos/etcd:v3.5.Z" % (ident(f, d, c), img))


def effective(pod, c, key):
    v = (c.get("securityContext") or {}).get(key)
    return v if v is not None else (pod.get("securityContext") or {}).get(key)


def check_k8s_security(m):
    restricted = {d["metadata"]["name"] for _, d in m.kind("Namespace") if d["metadata"].get(
        "labels", {}).get("pod-security.kubernetes.io/enforce") == "restricted"}
    uid = image_user(m)
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                       "persistentVolumeClaim", "projected", "secret"}
    for f, d, ns, tpl in m.workloads():
        pod = tpl["spec"]
        for k in ("hostNetwork", "hostPID", "hostIPC"):
            need(not pod.get(k), "%s: %s" % (ident(f, d), k))
        need(pod.get("automountServiceAccountToken") is False,
             "%s: automountServiceAccountToken should be false (detproxy and vLLM do not use "
             "the Kubernetes API)" % ident(f, d))
        for v in pod.get("volumes", []) or []:
            types = set(v) - {"name"}
            need(types <= allowed_volumes, "%s: volume %s of type %s is not allowed by the "
                 "restricted Pod Security profile" % (ident(f, d), v["name"], types))
        for c, _, _ in all_containers(pod):
            w = ident(f, d, c)
            sc = c.get("securityContext") or {}
            need(effective(pod, c, "runAsNonRoot") is True, "%s: runAsNonRoot is not set" % w)
            need(effective(pod, c, "runAsUser") not in (0, None) or not DETPROXY_IMAGE.match(
                c["image"]), "%s: runAsUser" % w)
            need(sc.get("allowPrivilegeEscalation") is False,
                 "%s: allowPrivilegeEscalation must be false" % w)
            need(not sc.get("privileged"), "%s: privileged" % w)
            need(sc.get("readOnlyRootFilesystem") is True, "%s: readOnlyRootFilesystem must be "
                 "true" % w)
            caps = sc.get("capabilities") or {}
            need("ALL" in (caps.get("drop") or []), "%s: capabilities must drop ALL" % w)
            need(set(caps.get("add") or []) <= {"NET_BIND_SERVICE"}, "%s: adds capabilities" % w)
            if ns in restricted:
                need((effective(pod, c, "seccompProfile") or {}).get("type") in (
                    "RuntimeDefault", "Localhost"), "%s: restricted needs a seccompProfile" % w)
            if DETPROXY_IMAGE.match(c["image"]):
                need(effective(pod, c, "runAsUser") == uid, "%s: runAsUser %r is not the "
                     "image's USER %d (files in the image are owned by it)" % (
                         w, effective(pod, c, "runAsUser"), uid))
            if DETPROXY_IMAGE.match(c["image"]) or ETCD_IMAGE.match(c["image"]):
                res = c.get("resources") or {}
                need((res.get("requests") or {}).get("cpu") and (res.get("requests") or {}).get(
                    "memory"), "%s: needs cpu and memory requests" % w)
                need((res.get("limits") or {}).get("cpu") and (res.get("limits") or {}).get(
                    "memory"), "%s: needs cpu and memory limits" % w)


def prestop_seconds(c):
    ps = (c.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in ps:
        return int(ps["sleep"]["seconds"])
    cmd = (ps.get("exec") or {}).get("command") or []
    if cmd and os.path.basename(cmd[0]) == "sleep" and len(cmd) == 2:
        return float(cmd[1])
    need(not ps, "%s: preStop %r: only a sleep is expected" % (c["name"], ps))
    return 0


def check_k8s_run_containers(m):
    """Ports, probes and drain timing of every `detproxy run` container, against its config."""
    for f, d, ns, pod, c, cmd, opts in detproxy_containers(m):
        w = ident(f, d, c)
        if cmd == ("run",):
            cfg = embedded_config(m, ns, pod, c, opts)
            lh, lp = parse_addr(cfg.get("listen", "127.0.0.1:8080"), w + " listen")
            ah, ap = parse_addr(cfg.get("admin_listen", "127.0.0.1:9901"), w + " admin_listen")
            reachable = {p for h, p in ((lh, lp), (ah, ap)) if not LOOPBACK.match(h)}
            for cp in c.get("ports", []) or []:
                need(cp["containerPort"] in reachable, "%s: containerPort %d is not a port "
                     "detproxy listens on outside loopback (config: listen %s:%d, admin_listen "
                     "%s:%d)" % (w, cp["containerPort"], lh, lp, ah, ap))
            need(not LOOPBACK.match(ah), "%s: admin_listen %s is loopback: the kubelet probes "
                 "the pod IP" % (w, ah))
            want = {"livenessProbe": {"/healthz"}, "readinessProbe": {"/readyz"},
                    "startupProbe": {"/healthz", "/readyz"}}
            need(c.get("livenessProbe") and c.get("readinessProbe"), "%s: needs liveness and "
                 "readiness probes" % w)
            for kind, pr in probes(c):
                hg = pr.get("httpGet")
                need(hg, "%s: %s must be an httpGet (the image has no HTTP client)" % (w, kind))
                port = port_number(c, hg["port"], w)
                need(port == ap, "%s: %s probes port %d, but admin_listen is port %d" % (
                    w, kind, port, ap))
                need(hg["path"] in want[kind], "%s: %s path %s, expected %s" % (
                    w, kind, hg["path"], " or ".join(sorted(want[kind]))))
            grace = pod.get("terminationGracePeriodSeconds", 30)
            drain = drain_s(cfg)
            need(grace > drain, "%s: terminationGracePeriodSeconds %d does not cover "
                 "detproxy's %d s drain" % (w, grace, drain))
            pre = prestop_seconds(c)
            if not LOOPBACK.match(lh):
                need(pre >= 1, "%s: serves clients through a Service: needs a preStop sleep so "
                     "that the endpoint removal propagates before SIGTERM" % w)
            need(pre + drain < grace, "%s: preStop %ss + %d s drain does not fit in "
                 "terminationGracePeriodSeconds %d" % (w, pre, drain, grace))
            # Discovery names a headless Service that reaches the replica and agent ports.
            for p in cfg.get("pools", []):
                disc = p.get("discovery")
                if not disc:
                    continue
                svc_name, svc_ns = discovery_names(m, ns, pod, c, opts)[0]
                svc = m.find("Service", svc_ns, svc_name)
                need(svc is not None, "%s: discovery.dns names Service %s.%s, which no manifest "
                     "creates" % (w, svc_name, svc_ns))
                need(svc["spec"].get("clusterIP") == "None", "%s: discovery needs a headless "
                     "Service (clusterIP: None): %s returns one virtual IP" % (w, svc_name))
                sports = {sp["port"] for sp in svc["spec"]["ports"]}
                need(disc["port"] in sports, "%s: discovery.port %d is not a port of Service %s "
                     "(%s)" % (w, disc["port"], svc_name, sorted(sports)))
                ap_ = (disc.get("attest") or {}).get("port")
                if ap_ is not None:
                    need(ap_ in sports, "%s: discovery.attest.port %d is not a port of Service "
                         "%s" % (w, ap_, svc_name))
        elif cmd == ("attest", "serve"):
            h, p = parse_addr(opts.get("--listen"), w + " --listen")
            need(not LOOPBACK.match(h), "%s: the agent listens on loopback: detproxy reaches it "
                 "on the pod IP" % w)
            for cp in c.get("ports", []) or []:
                need(cp["containerPort"] == p, "%s: containerPort %d is not the agent's --listen "
                     "port %d" % (w, cp["containerPort"], p))
            for kind, pr in probes(c):
                hg = pr.get("httpGet") or {}
                need(port_number(c, hg.get("port"), w) == p and hg.get("path") == "/healthz",
                     "%s: %s must GET /healthz on the agent port %d" % (w, kind, p))
        else:
            raise Bad("%s: runs `detproxy %s`, which no deployment needs" % (w, " ".join(cmd)))


def vllm_args(c):
    a, out, i = c.get("args") or [], {}, 0
    while i < len(a):
        need(a[i].startswith("--"), "vllm args: unexpected %r" % a[i])
        if "=" in a[i]:
            k, v = a[i].split("=", 1)
            out[k] = v
        elif i + 1 < len(a) and not a[i + 1].startswith("--"):
            out[a[i]] = a[i + 1]
            i += 1
        else:
            out[a[i]] = True
        i += 1
    return out


def manifest_for_service(m, svc_ns, svc_name):
    """The manifest JSON of every run config whose pool discovers this Service."""
    out = []
    for f, d, ns, pod, c, cmd, opts in detproxy_containers(m):
        if cmd != ("run",):
            continue
        cfg = embedded_config(m, ns, pod, c, opts)
        for p in cfg["pools"]:
            dns = (p.get("discovery") or {}).get("dns", "")
            if dns.rstrip(".") != "%s.%s.svc.cluster.local" % (svc_name, svc_ns):
                continue
            man = p.get("manifest")
            if isinstance(man, str):
                rel = man
                vols = {v["name"]: v for v in pod.get("volumes", [])}
                found = None
                for vm in c.get("volumeMounts", []):
                    mp = vm["mountPath"].rstrip("/")
                    full = rel if rel.startswith("/") else os.path.normpath(
                        os.path.join(os.path.dirname(opts["--config"]), rel))
                    if not full.startswith(mp + "/"):
                        continue
                    r = full[len(mp) + 1:]
                    for s in (vols[vm["name"]].get("projected") or {}).get("sources", []):
                        cm = s.get("configMap")
                        obj = cm and m.find("ConfigMap", ns, cm["name"])
                        for it in (cm or {}).get("items", []):
                            if obj and it["path"] == r:
                                found = json.loads(obj["data"][it["key"]])
                need(found, "%s: manifest %s comes from no ConfigMap in the YAML" % (
                    ident(f, d, c), rel))
                man = found
            out.append((ident(f, d, c), man, p, cfg))
    return out


def check_vllm_agent(m):
    """The vLLM container and its agent declare the same identity, equal to the manifest."""
    seen = 0
    for f, d, ns, tpl in m.workloads():
        pod = tpl["spec"]
        cs = {c["name"]: c for c, _, _ in all_containers(pod)}
        vllm = [c for c in cs.values() if VLLM_IMAGE.match(c.get("image", ""))]
        if not vllm:
            continue
        seen += 1
        v = vllm[0]
        w = ident(f, d, v)
        va = vllm_args(v)
        version = VLLM_IMAGE.match(v["image"]).group(1)
        agents = [(c, opts) for ff, dd, _, p, c, cmd, opts in detproxy_containers(m)
                  if dd is d and cmd == ("attest", "serve")]
        need(len(agents) == 1, "%s: expected one attestation agent container beside vLLM" % w)
        ag, ao = agents[0]
        aw = ident(f, d, ag)
        model_dir = va.get("--model")
        need(model_dir and ao.get("--model-dir") == model_dir, "%s: agent --model-dir %r is not "
             "vLLM's --model %r" % (aw, ao.get("--model-dir"), model_dir))
        mounts = {}
        for c in (v, ag):
            mm = [vm for vm in c.get("volumeMounts", []) if vm["mountPath"].rstrip("/") ==
                  model_dir.rstrip("/")]
            need(mm, "%s: mounts nothing at the model directory %s" % (ident(f, d, c),
                                                                     model_dir))
            need(mm[0].get("readOnly") is True, "%s: the model volume must be mounted "
                 "read-only" % ident(f, d, c))
            mounts[c["name"]] = mm[0]["name"]
        need(len(set(mounts.values())) == 1, "%s: vLLM and the agent mount different volumes at "
             "%s: the agent would hash other files than vLLM loads" % (w, model_dir))
        served = va.get("--served-model-name", model_dir)
        need(ao.get("--model") == served, "%s: agent --model %r != vLLM --served-model-name %r" % (
            aw, ao.get("--model"), served))
        for k in ("--quantization", "--dtype"):
            need(ao.get(k) == va.get(k), "%s: agent %s %r != vLLM %s %r" % (
                aw, k, ao.get(k), k, va.get(k)))
        fu = ao.get("--framework-url")
        vport = int(va.get("--port", 8000))
        if fu:
            mm = re.match(r"^http://(127\.0\.0\.1|localhost|\[::1\]):(\d+)(/.*)?$", fu)
            need(mm and int(mm.group(2)) == vport, "%s: --framework-url %s is not vLLM's port "
                 "%d in the same pod" % (aw, fu, vport))
        need(any(cp["containerPort"] == vport for cp in v.get("ports", [])),
             "%s: --port %d is not a containerPort" % (w, vport))
        # Against the manifests of the proxies that discover this pod's headless Service.
        svcs = [s for _, s in m.kind("Service") if s["metadata"]["namespace"] == ns and
                all(tpl["metadata"]["labels"].get(k) == val for k, val in
                    s["spec"].get("selector", {}).items()) and s["spec"].get("clusterIP") ==
                "None"]
        need(svcs, "%s: no headless Service selects these pods" % w)
        users = manifest_for_service(m, ns, svcs[0]["metadata"]["name"])
        need(users, "%s: no detproxy config discovers Service %s" % (w, svcs[0]["metadata"][
            "name"]))
        for who, man, pool, cfg in users:
            for mk, val in (("model", served), ("quantization", ao.get("--quantization")),
                            ("dtype", ao.get("--dtype"))):
                if mk in man:
                    need(man[mk] == val, "%s: manifest %s %r, but %s serves %r" % (
                        who, mk, man[mk], w, val))
            fw = man.get("framework") or {}
            if "version" in fw:
                need(fw["version"] == version, "%s: manifest framework.version %r, but the "
                     "vLLM image is %s" % (who, fw["version"], v["image"]))
            if "name" in fw:
                need(fw["name"] == "vllm" and ao.get("--framework", "vllm") == "vllm",
                     "%s: manifest framework.name %r vs agent --framework %r" % (
                         who, fw["name"], ao.get("--framework")))
            da = (pool.get("discovery") or {}).get("attest") or {}
            if da.get("source") == "agent":
                ah, ap = parse_addr(ao["--listen"], aw)
                need(da.get("port") == ap, "%s: discovery.attest.port %r is not the agent's "
                     "port %d" % (who, da.get("port"), ap))
                need(ao.get("--key"), "%s: the agent signs nothing without --key, and %s "
                     "requires signatures" % (aw, who))
            need((pool.get("discovery") or {}).get("port") == vport, "%s: discovery.port is "
                 "not vLLM's --port %d" % (who, vport))
    need(seen, "no vLLM workload found")

# ---- etcd and the fleet gateways ---------------------------------------------------------------


def etcd_sets(m):
    """(StatefulSet, namespace) of every workload running the etcd image."""
    return [(d, ns) for f, d, ns, tpl in m.workloads() if any(
        ETCD_IMAGE.match(c.get("image", "")) for c, _, _ in all_containers(tpl["spec"]))]


def etcd_member_urls(d, ns, scheme, port):
    """The stable URL of each member: <set>-<i>.<service>.<namespace>.svc.cluster.local."""
    return ["%s://%s-%d.%s.%s.svc.cluster.local:%d" % (
        scheme, d["metadata"]["name"], i, d["spec"].get("serviceName"), ns, port)
        for i in range(d["spec"].get("replicas", 1))]


def etcd_flags(argv, where):
    """{flag: value} of an etcd command line (--flag=value, or a bare --flag: "true")."""
    out = {}
    for a in argv:
        mm = re.match(r"^--([a-z0-9-]+)(?:=(.*))?$", a)
        need(mm, "%s: etcd argument %r is not --flag or --flag=value" % (where, a))
        need(mm.group(1) not in out, "%s: --%s twice" % (where, mm.group(1)))
        out[mm.group(1)] = mm.group(2) if mm.group(2) is not None else "true"
    return out


_etcd_help = None


def etcd_help():
    global _etcd_help
    if _etcd_help is None and ETCD:
        rc, o, e = run_cmd([ETCD, "--help"])
        _etcd_help = o + e
    return _etcd_help


def etcd_container(pod):
    return next(c for c, _, _ in all_containers(pod) if ETCD_IMAGE.match(c.get("image", "")))


def fleet_configs(m):
    """(entry, fleet section) of every `detproxy run` container whose config has one."""
    out = []
    for entry in detproxy_containers(m):
        f, d, ns, pod, c, cmd, opts = entry
        if cmd == ("run",):
            fl = embedded_config(m, ns, pod, c, opts).get("fleet")
            if fl:
                out.append((entry, fl))
    return out


def check_etcd(m):
    sets = etcd_sets(m)
    need(sets, "no etcd StatefulSet (etcd.yaml): the fleet gateways have no store")
    for d, ns in sets:
        tpl = d["spec"]["template"]
        pod, labels = tpl["spec"], tpl["metadata"].get("labels", {})
        c = etcd_container(pod)
        w = ident("etcd.yaml", d, c)
        need(d["kind"] == "StatefulSet", "%s: etcd runs in a StatefulSet (stable names, a volume "
             "each)" % w)
        n = d["spec"].get("replicas", 1)
        need(n >= 3 and n % 2 == 1, "%s: replicas %r: an odd number, at least 3 (a majority "
             "survives the loss of one)" % (w, n))
        need(d["spec"].get("podManagementPolicy") == "Parallel", "%s: podManagementPolicy must "
             "be Parallel: with OrderedReady the first member waits for a quorum from members "
             "not created yet" % w)
        svc = m.find("Service", ns, d["spec"]["serviceName"])
        need(svc["spec"].get("publishNotReadyAddresses") is True, "%s: Service %s needs "
             "publishNotReadyAddresses: true (members resolve each other before any is "
             "Ready)" % (w, svc["metadata"]["name"]))
        need({2379, 2380} <= {p["port"] for p in svc["spec"]["ports"]}, "%s: Service %s must "
             "have the client (2379) and peer (2380) ports" % (w, svc["metadata"]["name"]))
        aa = ((pod.get("affinity") or {}).get("podAntiAffinity") or {}).get(
            "requiredDuringSchedulingIgnoredDuringExecution") or []
        need(any(t.get("topologyKey") == "kubernetes.io/hostname" and all(
            labels.get(k) == v for k, v in ((t.get("labelSelector") or {}).get(
                "matchLabels") or {}).items()) for t in aa),
             "%s: needs a required podAntiAffinity on kubernetes.io/hostname selecting its own "
             "pods (one member per node)" % w)
        env = {e["name"]: e for e in c.get("env", []) or []}
        need(((env.get("POD_NAME") or {}).get("valueFrom") or {}).get("fieldRef", {}).get(
            "fieldPath") == "metadata.name", "%s: POD_NAME must come from the downward API "
             "(metadata.name)" % w)
        argv = (c.get("command") or []) + (c.get("args") or [])
        need(argv[:1] == ["/usr/local/bin/etcd"], "%s: runs %r, not /usr/local/bin/etcd (the "
             "image's binary)" % (w, argv[:1]))
        flags = etcd_flags(argv[1:], w)
        helptext = etcd_help()
        if helptext:
            for k in flags:
                need(re.search(r"--%s\b" % re.escape(k), helptext), "%s: --%s is not a flag "
                     "of etcd (`etcd --help`)" % (w, k))
        else:
            note("etcd is not installed: its flags are not checked against `etcd --help`")
        sts, svc_name = d["metadata"]["name"], d["spec"]["serviceName"]
        peers = etcd_member_urls(d, ns, "https", 2380)
        want = {
            "name": "$(POD_NAME)",
            "initial-cluster": ",".join("%s-%d=%s" % (sts, i, u) for i, u in enumerate(peers)),
            "initial-cluster-state": "new",
            "listen-client-urls": "https://0.0.0.0:2379",
            "listen-peer-urls": "https://0.0.0.0:2380",
            "advertise-client-urls": "https://$(POD_NAME).%s.%s.svc.cluster.local:2379" % (
                svc_name, ns),
            "initial-advertise-peer-urls": "https://$(POD_NAME).%s.%s.svc.cluster.local:2380" % (
                svc_name, ns),
            "client-cert-auth": "true",
            "peer-client-cert-auth": "true",
        }
        for k, v in want.items():
            need(flags.get(k) == v, "%s: --%s is %r, expected %r" % (w, k, flags.get(k), v))
        # TLS files from a Secret volume, each an item of it; the data on a claim template.
        vols = {v["name"]: v for v in pod.get("volumes", []) or []}
        claims = {v["metadata"]["name"] for v in d["spec"].get("volumeClaimTemplates", []) or []}
        mounts = {vm["mountPath"].rstrip("/"): vm["name"] for vm in c.get("volumeMounts", [])}

        def mount(path):
            for mp, name in sorted(mounts.items(), key=lambda x: -len(x[0])):
                if path.startswith(mp + "/"):
                    return mp, name
            raise Bad("%s: %s is on no volume mount" % (w, path))

        for k in ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file",
                  "peer-trusted-ca-file"):
            need(flags.get(k), "%s: --%s is missing (peer and client TLS)" % (w, k))
            mp, name = mount(flags[k])
            sec = (vols.get(name) or {}).get("secret")
            need(sec, "%s: --%s %s is not on a Secret volume" % (w, k, flags[k]))
            need(flags[k][len(mp) + 1:] in [it["path"] for it in sec.get("items") or []],
                 "%s: --%s %s is no item of Secret %s" % (w, k, flags[k], sec["secretName"]))
        mp, name = mount(flags.get("data-dir", "/default.etcd"))
        need(name in claims, "%s: --data-dir is not on a volumeClaimTemplate (a member's data "
             "must outlive its pod)" % w)
        # The kubelet has no client certificate: it probes the plain metrics listener.
        mm = re.match(r"^http://0\.0\.0\.0:(\d+)$", flags.get("listen-metrics-urls", ""))
        need(mm, "%s: --listen-metrics-urls must be http://0.0.0.0:PORT (what the kubelet "
             "probes)" % w)
        need(c.get("startupProbe") and c.get("livenessProbe") and c.get("readinessProbe"),
             "%s: needs startup, liveness and readiness probes" % w)
        for kind, pr in probes(c):
            hg = pr.get("httpGet") or {}
            need(port_number(c, hg.get("port"), w) == int(mm.group(1)) and
                 hg.get("path", "").startswith("/health"), "%s: %s must GET /health on the "
                 "metrics port %s" % (w, kind, mm.group(1)))
        cports = {p["containerPort"] for p in c.get("ports", [])}
        need({2379, 2380, int(mm.group(1))} <= cports, "%s: container ports %s" % (w, cports))
    # The fleet gateways: every member, over https, with a client certificate; let in.
    found = fleet_configs(m)
    need(found, "no gateway config has a fleet section (gateway-fleet.json)")
    members = {u for d, ns in sets for u in etcd_member_urls(d, ns, "https", 2379)}
    for (f, d, ns, pod, c, cmd, opts), fl in found:
        w = ident(f, d, c)
        eps = (fl.get("etcd") or {}).get("endpoints") or []
        need(set(eps) == members and len(eps) == len(members), "%s: fleet.etcd.endpoints %s "
             "are not the etcd members %s" % (w, eps, sorted(members)))
        tls = (fl.get("etcd") or {}).get("tls") or {}
        need(tls.get("ca") and tls.get("cert") and tls.get("key"), "%s: fleet.etcd.tls needs "
             "ca, cert and key: the members require a client certificate" % w)
        need(d["spec"].get("replicas", 1) >= 3, "%s: a fleet gateway of %r pods" % (
            w, d["spec"].get("replicas", 1)))
        glabels = d["spec"]["template"]["metadata"].get("labels", {})
        ok = False
        for pf, pd in m.kind("NetworkPolicy"):
            psel = pd["spec"].get("podSelector", {}).get("matchLabels", {})
            if not any(all(s_["spec"]["template"]["metadata"]["labels"].get(k) == v
                           for k, v in psel.items()) for s_, _ in sets):
                continue
            for rule in pd["spec"].get("ingress", []):
                if any(p["port"] == 2379 for p in rule.get("ports", [])) and any(all(
                        glabels.get(k) == v for k, v in fr.get("podSelector", {}).get(
                            "matchLabels", {}).items()) for fr in rule.get("from", [])):
                    ok = True
        need(ok, "%s: no NetworkPolicy lets its pods (labels %r) reach etcd's port 2379" % (
            w, glabels))



def rootfs_collects_libs():
    """deploy/docker/rootfs.sh, which the build stage runs, collects the binaries' libraries."""
    with open(os.path.join(DEPLOY, "docker", "rootfs.sh")) as f:
        return "ldd" in f.read()


def check_dockerfile(m):
    stages = dockerfile_stages(m.dockerfile)
    need(len(stages) >= 2, "Dockerfile: expected a build stage and a runtime stage")
    build, final = stages[0], stages[-1]
    # Every stage is Debian 12; the runtime stage may instead be `scratch` holding only what the
    # build stage collected from Debian 12 (a distroless root file system).
    for s in stages:
        debian = s["from"] in ("debian:bookworm-slim", "docker.io/library/debian:bookworm-slim")
        need(debian or (s is final and s["from"] == "scratch"),
             "Dockerfile: FROM %s, expected debian:bookworm-slim (Debian 12, what the project "
             "builds and tests on)" % s["from"])
    if final["from"] == "scratch":
        need(any(i == "RUN" and ("ldd" in a or ("rootfs.sh" in a and rootfs_collects_libs()))
                 for i, a in build["ins"]),
             "Dockerfile: a scratch runtime stage needs the build stage to collect the binaries' "
             "shared libraries (ldd)")
        need(any(i == "COPY" and a.split()[:1] == ["--from=" + str(build["name"])] and
                 a.split()[-1] == "/" for i, a in final["ins"]),
             "Dockerfile: the scratch runtime stage copies no root file system from the build "
             "stage")
    need(build["name"], "Dockerfile: the build stage needs a name (FROM ... AS build)")
    deps = deps_sh_packages()
    bpk = [p for i, a in build["ins"] if i == "RUN" for p in apt_packages(a)]
    for p in bpk:
        need(p in deps, "Dockerfile: build stage installs %s, which scripts/deps.sh does not "
             "list" % p)
    with open(os.path.join(SOURCE_DIR, "CMakeLists.txt"), encoding="utf-8") as f:
        cm = f.read()
    required = {"cmake", "pkg-config", "node-llhttp", "build-essential", "python3"}
    for mod in re.findall(r"pkg_check_modules\(\s*\w+\s+REQUIRED\s+(?:IMPORTED_TARGET\s+)?"
                          r"([\w.+-]+)", cm):
        need(mod in PKGCONFIG_DEV, "CMakeLists.txt needs pkg-config module %s: add its Debian "
             "-dev package to the Dockerfile and to PKGCONFIG_DEV in this test" % mod)
        required.add(PKGCONFIG_DEV[mod])
    for p in sorted(required):
        need(p in bpk, "Dockerfile: the build stage does not install %s" % p)
    rpk = [p for i, a in final["ins"] if i == "RUN" for p in apt_packages(a)]
    need(set(rpk) <= {"libuv1", "libcjson1", "libssl3", "ca-certificates"},
         "Dockerfile: the runtime stage installs more than runtime libraries: %s" % rpk)
    # COPY sources exist; COPY --from paths are where CMake puts the binaries.
    workdir, cmake_b = "/", None
    for ins, args in build["ins"]:
        if ins == "WORKDIR":
            workdir = args
        if ins == "RUN" and "cmake -S" in args:
            mm = re.search(r"-B\s*(\S+)", args)
            if mm:
                cmake_b = mm.group(1)
            need("-DCMAKE_BUILD_TYPE=Release" in args or "--build" in args,
                 "Dockerfile: the build is not Release")
        if ins == "COPY" and "--from" not in args:
            srcs = args.split()[:-1]
            for s in srcs:
                need(os.path.exists(os.path.join(SOURCE_DIR, s)), "Dockerfile: COPY %s: no such "
                     "path in the repository" % s)
    need(cmake_b, "Dockerfile: no `cmake -B DIR` in the build stage")
    copied = {}
    for ins, args in final["ins"]:
        if ins == "COPY" and args.startswith("--from="):
            parts = args.split()
            need(parts[0] == "--from=" + build["name"], "Dockerfile: %s copies from an unknown "
                 "stage" % args)
            copied[os.path.basename(parts[-1])] = (parts[1], parts[-1])
    # deploy/docker/rootfs.sh OUT DETPROXY DETPROXY_SIM puts both binaries under
    # OUT/rootfs/usr/local/bin, and the runtime stage copies OUT/rootfs/ whole.
    for ins, args in build["ins"]:
        words = args.split()
        tool = [k for k, w in enumerate(words) if w.endswith("rootfs.sh")]
        if ins != "RUN" or not tool or len(words) < tool[0] + 4:
            continue
        out, det, sim = words[tool[0] + 1:tool[0] + 4]
        need(any(i == "COPY" and a.startswith("--from=") and out + "/rootfs" in a
                 for i, a in final["ins"]),
             "Dockerfile: the runtime stage does not copy %s/rootfs" % out)
        copied["detproxy"] = (os.path.normpath(os.path.join(workdir, det)),
                              "/usr/local/bin/detproxy")
        copied["detproxy-sim"] = (os.path.normpath(os.path.join(workdir, sim)),
                                  "/usr/local/bin/detproxy-sim")
    for binpath, name in ((DETPROXY_BIN, "detproxy"), (SIM_BIN, "detproxy-sim")):
        need(name in copied, "Dockerfile: the runtime stage does not copy %s" % name)
        bdir = os.path.dirname(os.path.abspath(binpath))
        while bdir != "/" and not os.path.exists(os.path.join(bdir, "CMakeCache.txt")):
            bdir = os.path.dirname(bdir)
        need(bdir != "/", "cannot find the CMake build folder of %s" % binpath)
        rel = os.path.relpath(os.path.abspath(binpath), bdir)
        want = os.path.normpath(os.path.join(workdir, cmake_b, rel))
        need(copied[name][0] == want, "Dockerfile: copies %s from %s, but CMake builds it at "
             "%s" % (name, copied[name][0], want))
        need(os.path.dirname(copied[name][1]) in ("/usr/local/bin", "/usr/bin"),
             "Dockerfile: %s is not installed on the default PATH" % name)
    image_user(m)
    exposed = set()
    for ins, args in final["ins"]:
        if ins == "EXPOSE":
            exposed.update(int(p.split("/")[0]) for p in args.split())
        if ins == "HEALTHCHECK":
            need(not re.search(r"\b(curl|wget)\b", args), "Dockerfile: HEALTHCHECK uses an HTTP "
                 "client that debian:bookworm-slim does not have")
    gw = gateway_config(m)
    want = {parse_addr(gw["listen"], "gateway listen")[1],
            parse_addr(gw["admin_listen"], "gateway admin_listen")[1]}
    need(exposed == want, "Dockerfile: EXPOSE %s, but the gateway config listens on %s" % (
        sorted(exposed), sorted(want)))
    ep, cmd = image_entrypoint_cmd(m)
    need(ep == ["detproxy"], "Dockerfile: ENTRYPOINT %r, expected [\"detproxy\"]" % ep)
    check_detproxy_argv(ep + cmd, "Dockerfile ENTRYPOINT+CMD")


def gateway_config(m):
    cm = m.find("ConfigMap", "llm", "detproxy-config")
    need(cm is not None and "gateway.json" in cm.get("data", {}), "configmaps.yaml: no "
         "detproxy-config gateway.json")
    return json.loads(cm["data"]["gateway.json"])


def unit_settings(text):
    """[(key, value)] of a unit file, continuations joined."""
    out, cur = [], ""
    for line in text.splitlines():
        s = line.strip()
        if not cur and (not s or s[0] in "#;["):
            continue
        if s.endswith("\\"):
            cur += s[:-1] + " "
            continue
        cur += s
        k, _, v = cur.partition("=")
        out.append((k.strip(), v.strip()))
        cur = ""
    return out


def check_systemd(m):
    need("detproxy.service" in m.units, "deploy/systemd/detproxy.service is missing")
    for name, text in m.units.items():
        st = unit_settings(text)
        for k, v in st:
            if k in ("ExecStart", "ExecStartPre", "ExecStartPost", "ExecReload", "ExecStop"):
                argv = shlex.split(v.lstrip("-@:+!"))
                if os.path.basename(argv[0]) == "detproxy":
                    need(argv[0].startswith("/"), "%s: %s needs an absolute path" % (name, k))
                    check_detproxy_argv(argv, "%s %s" % (name, k))
    st = dict(unit_settings(m.units["detproxy.service"]))
    multi = unit_settings(m.units["detproxy.service"])
    want = {"DynamicUser": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
            "PrivateTmp": "yes", "NoNewPrivileges": "yes", "CapabilityBoundingSet": "",
            "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX",
            "MemoryDenyWriteExecute": "yes", "LockPersonality": "yes",
            "RestrictNamespaces": "yes", "KillSignal": "SIGTERM", "LimitNOFILE": "65536",
            "LogsDirectory": "detproxy"}
    for k, v in want.items():
        need(st.get(k) == v, "detproxy.service: %s=%s expected, found %r" % (k, v, st.get(k)))
    need(("SystemCallFilter", "@system-service") in multi,
         "detproxy.service: SystemCallFilter=@system-service expected")
    need(int(re.sub(r"s$", "", st.get("TimeoutStopSec", "0"))) > DRAIN_S,
         "detproxy.service: TimeoutStopSec must exceed detproxy's %d s drain" % DRAIN_S)
    reloads = [v for k, v in multi if k == "ExecReload"]
    need(reloads and reloads[-1] == "/bin/kill -HUP $MAINPID",
         "detproxy.service: ExecReload must end with /bin/kill -HUP $MAINPID")
    runs = [v for k, v in multi if k == "ExecStart"]
    need(len(runs) == 1 and shlex.split(runs[0])[1] == "run", "detproxy.service: ExecStart "
         "must be `detproxy run`")


def nginx_directives(text):
    return [(mm.group(1), mm.group(2).strip()) for mm in re.finditer(
        r"^\s*([a-z_]+)\s+([^;{]*?)\s*[;{]", re.sub(r"#.*", "", text), re.M)]


def seconds(v):
    mm = re.match(r"^(\d+)(ms|s|m|h)?$", v)
    need(mm, "cannot read the duration %r" % v)
    return int(mm.group(1)) * {"ms": 0.001, "s": 1, None: 1, "m": 60, "h": 3600}[mm.group(2)]


def size_bytes(v):
    mm = re.match(r"^(\d+)([kKmMgG])?$", v)
    need(mm, "cannot read the size %r" % v)
    return int(mm.group(1)) * {None: 1, "k": 1024, "m": 1 << 20, "g": 1 << 30}[
        (mm.group(2) or "").lower() or None]


def check_lb_static(m):
    gw = gateway_config(m)
    lp = parse_addr(gw["listen"], "gateway listen")[1]
    ap = parse_addr(gw["admin_listen"], "gateway admin_listen")[1]
    lim = gw.get("limits", {})
    first_byte = lim.get("upstream_first_byte_timeout_ms", 600000) / 1000
    idle = lim.get("client_idle_timeout_ms", 60000) / 1000
    body = lim.get("max_body_bytes", 8388608)
    nd = nginx_directives(m.nginx)
    d = {}
    for k, v in nd:
        d.setdefault(k, []).append(v)
    servers = [v for k, v in nd if k == "server" and re.match(r"^\S+:\d+", v)]
    need(servers, "nginx: no upstream servers")
    for s in servers:
        need(int(s.split()[0].rsplit(":", 1)[1]) == lp, "nginx: upstream server %s is not "
             "detproxy's listen port %d" % (s, lp))
    need(d.get("proxy_buffering") == ["off"], "nginx: proxy_buffering off is needed for SSE")
    need(d.get("proxy_http_version") == ["1.1"] and d.get("keepalive"),
         "nginx: keep-alive upstream needs keepalive N and proxy_http_version 1.1")
    need(d.get("proxy_set_header") and any(v.startswith("Connection") for v in
                                           d["proxy_set_header"]),
         "nginx: keep-alive upstream needs proxy_set_header Connection \"\"")
    need(seconds(d["proxy_read_timeout"][0]) >= first_byte, "nginx: proxy_read_timeout %s < "
         "upstream_first_byte_timeout_ms (%d s)" % (d["proxy_read_timeout"][0], first_byte))
    need(seconds(d["keepalive_timeout"][0]) < idle, "nginx: upstream keepalive_timeout must be "
         "shorter than detproxy's client_idle_timeout_ms (%d s)" % idle)
    need(size_bytes(d["client_max_body_size"][0]) == body, "nginx: client_max_body_size %s != "
         "max_body_bytes %d" % (d["client_max_body_size"][0], body))
    need("health_check" not in d, "nginx: health_check is NGINX Plus only; keep it in a comment")
    # HAProxy
    hl = [ln.split("#")[0].strip() for ln in m.haproxy.splitlines()]
    hl = [ln for ln in hl if ln]
    hs = [ln.split()[2] for ln in hl if ln.startswith("server ")]
    need(hs, "haproxy: no servers")
    for s in hs:
        need(int(s.rsplit(":", 1)[1]) == lp, "haproxy: server %s is not detproxy's listen port "
             "%d" % (s, lp))
    ds = [ln for ln in hl if ln.startswith("default-server")]
    need(ds and re.search(r"\bcheck\b", ds[0]) and re.search(r"\bport %d\b" % ap, ds[0]),
         "haproxy: servers must be checked on the admin port %d" % ap)
    need(any(re.search(r"http-check send .*uri /readyz\b", ln) for ln in hl),
         "haproxy: the health check must GET /readyz")
    ts = {ln.split()[1]: ln.split()[2] for ln in hl if ln.startswith("timeout ")}
    need(seconds(ts.get("server", "0")) >= first_byte, "haproxy: timeout server < "
         "upstream_first_byte_timeout_ms")
    need(seconds(ts.get("http-keep-alive", "999")) < idle, "haproxy: timeout http-keep-alive "
         "must be shorter than client_idle_timeout_ms")


# ---- the tests ---------------------------------------------------------------------------------

MODEL = None


def model():
    global MODEL
    if MODEL is None:
        MODEL = Model()
    return MODEL


def test_yaml_parses():
    files = yaml_files()
    need(files, "no YAML under deploy/")
    for p in files:
        try:
            docs = load_yaml(p)
        except yaml.YAMLError as e:
            raise Bad("%s: %s" % (os.path.relpath(p, SOURCE_DIR), e))
        need(docs, "%s: no documents" % p)
        for i, d in enumerate(docs):
            need(isinstance(d, dict), "%s: document %d is not a mapping" % (p, i))
    print("     %d files, %d Kubernetes objects" % (len(files), len(model().objs)))


def test_k8s_structure():
    check_k8s_structure(model())


def test_k8s_images():
    check_k8s_images(model())


def test_k8s_security_and_resources():
    check_k8s_security(model())


def test_k8s_detproxy_command_lines():
    found = detproxy_containers(model())
    cmds = sorted({" ".join(x[5]) for x in found})
    need("run" in cmds and "attest serve" in cmds, "expected `run` and `attest serve` "
         "containers, found %s" % cmds)
    print("     %d detproxy containers: %s" % (len(found), ", ".join(cmds)))


def test_k8s_ports_probes_and_drain():
    check_k8s_run_containers(model())


def test_k8s_vllm_agent_and_manifest_agree():
    check_vllm_agent(model())


def test_k8s_configs_pass_detproxy_check():
    m = model()
    tmp = tempfile.mkdtemp(prefix="dp-deploy-")
    try:
        keys = Keys(tmp)
        n = 0
        for entry in detproxy_containers(m):
            if entry[5] != ("run",):
                continue
            rc_ = RunConfig(m, entry, tmp, keys)
            rc_.check_refs()
            path = rc_.write()
            rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", path])
            need(rc == 0 and out.startswith("ok:"), "%s: detproxy check exits %d:\n%s%s" % (
                rc_.where, rc, out, err))
            for line in err.splitlines():
                # The kubelet makes Secret files group-readable for fsGroup (0440): expected.
                need(line.startswith("warning:") and "accessible by group or others" in line,
                     "%s: unexpected output from detproxy check: %s" % (rc_.where, line))
            print("     %s: %s%s" % (rc_.where, out.strip(),
                                     " (%d group-readable secret warning(s))" % len(
                                         err.splitlines()) if err.strip() else ""))
            n += 1
        need(n >= 2, "expected a gateway and a sidecar config")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_k8s_configs_run_and_answer_probes():
    """Each run config starts (listen addresses moved to loopback port 0), its probe paths
    answer as the probes expect, admin endpoints need the token, and SIGTERM exits 0."""
    m = model()
    tmp = tempfile.mkdtemp(prefix="dp-deploy-")
    try:
        keys = Keys(tmp)
        for entry in detproxy_containers(m):
            if entry[5] != ("run",):
                continue
            rc_ = RunConfig(m, entry, tmp, keys)

            def loopback(cfg):
                cfg["listen"] = "127.0.0.1:0"
                cfg["admin_listen"] = "127.0.0.1:0"

            path = rc_.write(loopback)
            px = start_process([DETPROXY_BIN, "run", "-c", path], ready_count=2,
                               name="detproxy " + entry[1]["metadata"]["name"])
            admin = px.listener_port(listener="admin")
            for kind, pr in probes(rc_.c):
                r = http("GET", admin, pr["httpGet"]["path"])
                if kind == "livenessProbe":
                    need(r.status == 200, "%s: liveness %s -> %d" % (
                        rc_.where, pr["httpGet"]["path"], r.status))
                else:
                    # No replica resolves here, so readiness is 503 with the reason.
                    need(r.status in (200, 503) and r.json().get("status"),
                         "%s: %s %s -> %d %s" % (rc_.where, kind, pr["httpGet"]["path"],
                                                 r.status, r.text[:200]))
            tok = rc_.token()
            if tok:
                need(http("GET", admin, "/metrics").status == 401,
                     "%s: /metrics answers without the admin token" % rc_.where)
                r = http("GET", admin, "/metrics", headers={"Authorization": "Bearer " + tok})
                need(r.status == 200 and "# TYPE detproxy_connections gauge" in r.text,
                     "%s: /metrics with the token -> %d" % (rc_.where, r.status))
            px.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _namespaces_work():
    if shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


def test_k8s_agent_admitted_by_gateway():
    """The vLLM pods as shipped (agent flags, key Secret) and the gateway as shipped (discovery,
    manifest, trusted key, policy) fit together. Two simulated vLLM pods with the StatefulSet's
    model, version, quantization and dtype, each attested by an agent started with the
    StatefulSet's flags, are found through the gateway's own discovery block (the Service name
    resolves to two loopback addresses through a private /etc/hosts, the ports are the shipped
    ones), rejected while the manifest holds the placeholder digest, and admitted after the
    documented fix (paste `detproxy attest hash` into the manifest, reload). Where a private
    mount namespace or the fixed ports are not available, the discovered replica is written
    out as a static one instead."""
    m = model()
    tmp = tempfile.mkdtemp(prefix="dp-deploy-")
    try:
        keys = Keys(tmp)
        # The vLLM pod.
        (f, sts, ns, tpl), = [w for w in m.workloads() if w[1]["kind"] == "StatefulSet" and any(
        VLLM_IMAGE.match(c.get("image", "")) for c, _, _ in all_containers(w[3]["spec"]))]
        pod = tpl["spec"]
        vllm = next(c for c, _, _ in all_containers(pod) if VLLM_IMAGE.match(c["image"]))
        va = vllm_args(vllm)
        version = VLLM_IMAGE.match(vllm["image"]).group(1)
        (_, _, _, _, agent, _, ao), = [e for e in detproxy_containers(m)
                                       if e[1] is sts and e[5] == ("attest", "serve")]
        aroot = tempfile.mkdtemp(prefix="agent-", dir=tmp)
        materialize(m, ns, pod, agent, aroot, keys, ident(f, sts, agent))
        model_dir = os.path.join(tmp, "model")
        os.makedirs(model_dir)
        for name, data in (("config.json", b'{"architectures":["LlamaForCausalLM"]}\n'),
                           ("model.safetensors", os.urandom(4096))):
            with open(os.path.join(model_dir, name), "wb") as fh:
                fh.write(data)
        rc, digest, err = run_cmd([DETPROXY_BIN, "attest", "hash", model_dir])
        need(rc == 0, "attest hash: %s" % err)
        digest = digest.strip()
        # The gateway as configured.
        gw = [e for e in detproxy_containers(m) if e[5] == ("run",) and
              e[1]["kind"] == "Deployment" and e[1]["metadata"]["name"] == "detproxy"]
        need(gw, "no gateway Deployment named detproxy")
        rc_ = RunConfig(m, gw[0], tmp, keys)
        (disc,) = [p["discovery"] for p in rc_.cfg["pools"] if p.get("discovery")]
        agent_port = parse_addr(ao["--listen"], "agent --listen")[1]

        def start_pod(addr, sim_port, a_port):
            """A vLLM pod: the simulated server and the agent with the StatefulSet's flags,
            changed only in where things are on this host."""
            sim = start_sim("--flavor", "vllm", "--model", va.get("--served-model-name"),
                            "--framework-version", version,
                            "--quantization", va["--quantization"], "--dtype", va["--dtype"],
                            "--checkpoint-sha256", digest, listen="%s:%d" % (addr, sim_port))
            argv = container_argv(m, agent)
            argv[0] = DETPROXY_BIN
            subst = {"--listen": "%s:%d" % (addr, a_port), "--model-dir": model_dir,
                     "--framework-url": re.sub(r"^http://[^/]+", "http://%s:%d" % (
                         addr, sim.port), ao.get("--framework-url", ""))}
            for i in range(len(argv) - 1):
                if argv[i] in subst:
                    argv[i + 1] = subst[argv[i]]
                elif argv[i] == "--key":
                    argv[i + 1] = os.path.join(aroot, argv[i + 1].lstrip("/"))
            ag = start_process(argv, name="agent@" + addr)
            for kind, pr in probes(agent):
                need(http("GET", ag.port, pr["httpGet"]["path"], host=addr).status == 200,
                     "agent %s %s is not 200" % (kind, pr["httpGet"]["path"]))
            poll_until(lambda: http("GET", ag.port, "/attestation?nonce=t1",
                                    host=addr).status == 200,
                       timeout=20, what="the agent's first hash")
            return sim, ag

        wrapper, expect = [], 1
        if _namespaces_work():
            base = "127.%d.%d." % (os.getpid() % 200 + 20, os.getpid() // 200 % 250 + 1)
            addrs = [base + "2", base + "3"]
            try:
                for a in addrs:
                    start_pod(a, disc["port"], agent_port)
            except ProcError as e:
                note("cannot bind the shipped ports %d/%d on %s* (%s): static replica "
                     "instead" % (disc["port"], agent_port, base, str(e).splitlines()[0]))
                from harness import _cleanup
                _cleanup()
            else:
                hosts = os.path.join(tmp, "hosts")
                with open(hosts, "w", encoding="utf-8") as fh:
                    fh.write("127.0.0.1 localhost\n")
                    for a in addrs:
                        fh.write("%s %s\n" % (a, disc["dns"]))
                wrapper = ["unshare", "-m", "sh", "-c",
                           'mount --bind "$0" /etc/hosts && exec "$@"', hosts]
                expect = len(addrs)
        else:
            note("unshare -m is not permitted: the discovered replica is written out statically")

        def patch(cfg):
            cfg["listen"] = "127.0.0.1:0"
            cfg["admin_listen"] = "127.0.0.1:0"
            cfg["attestation"]["interval_ms"] = 500
            if wrapper:
                return  # the discovery block as shipped
            sim, ag = start_pod("127.0.0.1", 0, 0)
            for p in cfg["pools"]:
                d = p.pop("discovery")
                att = {"source": d["attest"]["source"]}
                if att["source"] == "agent":
                    att["url"] = "http://127.0.0.1:%d/attestation" % ag.port
                p["replicas"] = [{"name": "vllm-0", "url": "http://127.0.0.1:%d" % sim.port,
                                  "attest": att}]

        path = rc_.write(patch)
        auth = {"Authorization": "Bearer " + rc_.token()}
        px = start_process(wrapper + [DETPROXY_BIN, "run", "-c", path], ready_count=2,
                           name="gateway")
        admin = px.listener_port(listener="admin")
        proxy = px.listener_port(listener="proxy")

        def reps():
            return get_json(admin, "/admin/replicas", headers=auth)["replicas"]

        rs = poll_until(lambda: len(reps()) == expect and all(
            r["state"] != "pending" for r in reps()) and reps(), timeout=30,
            what="a verdict on every replica under the placeholder manifest")
        for r in rs:
            need(r["state"] == "rejected" and any("checkpoint_sha256 mismatch" in x
                                                  for x in r["reasons"]),
                 "with the placeholder digest %s should be rejected for its checkpoint, got %s "
                 "%s" % (r["name"], r["state"], r["reasons"]))
        need(http("GET", admin, "/readyz").status == 503, "readyz should be 503 while nothing "
             "is admitted")
        # The fix the manifest's comment prescribes: paste the digest, reload.
        man_inside = next(p for jp, p in rc_.refs if jp.endswith(".manifest"))
        host_man = rc_.host(man_inside)
        with open(host_man, encoding="utf-8") as fh:
            man = json.load(fh)
        man["checkpoint_sha256"] = digest
        if man.get("canary"):
            # ... and the canary's hash, as `detproxy attest canary` records it from a replica
            # one trusts: the same server, its greedy answer to the canary prompt.
            ref = start_sim("--flavor", "vllm", "--model", va.get("--served-model-name"),
                            "--framework-version", version, "--quantization", va["--quantization"],
                            "--dtype", va["--dtype"], "--checkpoint-sha256", digest)
            can = man["canary"]
            r = post_json(ref.port, "/v1/completions",
                          {"model": man["model"], "prompt": can["prompt"],
                           "max_tokens": can["max_tokens"], "temperature": 0, "seed": 0})
            can["expected_sha256"] = hashlib.sha256(
                r.json()["choices"][0]["text"].encode()).hexdigest()
            ref.stop()
        os.remove(host_man)
        with open(host_man, "w", encoding="utf-8") as fh:
            json.dump(man, fh)
        px.send_signal(signal.SIGHUP)
        # The changed manifest starts discovery over: until the name is resolved again the pool
        # has no replica at all, and all() of nothing is True. Count them.
        poll_until(lambda: [r["state"] for r in reps()] == ["admitted"] * expect, timeout=30,
                   what="every replica admitted after the manifest fix and SIGHUP")
        need(http("GET", admin, "/readyz").status == 200, "readyz is not 200")
        fields = "\n".join([man.get("model", ""), man.get("checkpoint_sha256", ""),
                            man.get("quantization", ""), man.get("dtype", ""),
                            (man.get("framework") or {}).get("name", ""),
                            (man.get("framework") or {}).get("version", "")])
        fp = "fp_" + hashlib.sha256(fields.encode()).hexdigest()[:16]
        served = set()
        for i in range(6 * expect):
            resp = post_json(proxy, "/v1/chat/completions", {
                "model": man["model"], "messages": [{"role": "user", "content": "hi %d" % i}],
                "max_tokens": 4})
            need(resp.status == 200, "a request through the gateway -> %d %s" % (
                resp.status, resp.text[:300]))
            need(resp.headers.get("x-detproxy-fingerprint") == fp, "fingerprint %r, want %r" % (
                resp.headers.get("x-detproxy-fingerprint"), fp))
            served.add(resp.headers.get("x-detproxy-replica"))
        need(len(served) == expect, "requests went to %s" % sorted(served))
        print("     %d replica(s) %s, admitted by the gateway config; served with %s" % (
            expect, "discovered through %s:%d" % (disc["dns"], disc["port"]) if wrapper
            else "(static)", fp))
        px.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

def test_k8s_etcd_statefulset_and_fleet_gateways():
    check_etcd(model())


def test_k8s_etcd_members_joined_by_fleet_gateways():
    """The etcd StatefulSet as shipped and the fleet gateway as shipped fit together: three
    members started with the StatefulSet's exact flags (changed only in where things are on this
    host: $(POD_NAME) expanded, 0.0.0.0 the member's own loopback address as its pod IP, files
    under a temporary root), peer and client TLS from certificates made as README.md says, their
    stable names resolved through a private /etc/hosts; then three gateways running
    gateway-fleet.json (listeners on loopback port 0, so each is given the instance name its pod
    name would give it) reach them by those names over https and form one fleet."""
    if ETCD is None:
        note("etcd is not installed (scripts/deps.sh installs etcd-server): not run")
        return
    if not _namespaces_work():
        note("unshare -m is not permitted: the members' names cannot be resolved here: not run")
        return
    m = model()
    (d, ns), = etcd_sets(m)
    pod = d["spec"]["template"]["spec"]
    c = etcd_container(pod)
    claims = [v["metadata"]["name"] for v in d["spec"].get("volumeClaimTemplates", [])]
    tmp = tempfile.mkdtemp(prefix="dp-deploy-")
    procs = []
    try:
        keys = Keys(tmp)
        base = "127.%d.%d." % (os.getpid() % 200 + 20, os.getpid() // 200 % 250 + 1)
        names = [u.split("//")[1].split(":")[0] for u in etcd_member_urls(d, ns, "https", 2379)]
        addrs = [base + str(10 + i) for i in range(len(names))]
        hosts = os.path.join(tmp, "hosts")
        with open(hosts, "w", encoding="utf-8") as fh:
            fh.write("127.0.0.1 localhost\n")
            for a, n in zip(addrs, names):
                fh.write("%s %s\n" % (a, n))
        wrapper = ["unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"',
                   hosts]
        argv = (c.get("command") or []) + (c.get("args") or [])
        metrics_port = int(etcd_flags(argv[1:], "etcd")["listen-metrics-urls"].rsplit(":", 1)[1])
        for i, addr in enumerate(addrs):
            root = tempfile.mkdtemp(prefix="etcd-%d-" % i, dir=tmp)
            materialize(m, ns, pod, c, root, keys, "etcd-%d" % i, claims=claims)
            env = {"POD_NAME": "%s-%d" % (d["metadata"]["name"], i)}
            out = [ETCD]
            for a in argv[1:]:
                a = re.sub(r"\$\(([A-Za-z_]\w*)\)", lambda mm: env[mm.group(1)], a)
                a = a.replace("0.0.0.0", addr)
                k, eq, v = a.partition("=")
                if eq and v.startswith("/"):
                    a = "%s=%s" % (k, os.path.join(root, v.lstrip("/")))
                out.append(a)
            log = open(os.path.join(tmp, "etcd-%d.log" % i), "wb")
            procs.append(subprocess.Popen(wrapper + out, stdout=log, stderr=log))
            log.close()

        def healthy(addr, path):
            try:
                with urllib.request.urlopen("http://%s:%d%s" % (addr, metrics_port, path),
                                            timeout=2) as r:
                    return r.status == 200 and json.loads(r.read()).get("health") == "true"
            except (OSError, ValueError):
                return False

        for i, addr in enumerate(addrs):
            for p in procs:
                need(p.poll() is None, "an etcd member exited: %s" % open(os.path.join(
                    tmp, "etcd-%d.log" % procs.index(p)), errors="replace").read()[-2000:])
            for kind, pr in probes(c):
                path = pr["httpGet"]["path"]
                poll_until(lambda: healthy(addr, path), timeout=30 * SLOW,
                           what="etcd-%d %s %s" % (i, kind, path))
        (entry, fl), = fleet_configs(m)
        gws = []
        for i in range(3):
            rc_ = RunConfig(m, entry, tmp, keys)

            def patch(cfg, i=i):
                cfg["listen"] = "127.0.0.1:0"
                cfg["admin_listen"] = "127.0.0.1:0"
                cfg["fleet"]["instance"] = "detproxy-fleet-%d" % i

            path = rc_.write(patch)
            px = start_process(wrapper + [DETPROXY_BIN, "run", "-c", path], ready_count=2,
                               name="fleet gateway %d" % i)
            gws.append((px, rc_.token()))

        def fleet_view(px, tok):
            r = http("GET", px.listener_port(listener="admin"), "/admin/fleet",
                     headers={"Authorization": "Bearer " + tok})
            return r.json() if r.status == 200 else {}

        def formed():
            views = [fleet_view(px, tok) for px, tok in gws]
            return all(v.get("connected") and len(v.get("members", [])) == 3 for v in views)

        poll_until(formed, timeout=30 * SLOW, interval=0.2,
                   what="three fleet gateways connected to etcd, each seeing 3 members")
        v = fleet_view(*gws[0])
        need(v["fleet"] == fl["name"] and v["endpoint"].rsplit(":", 1)[0] in names,
             "fleet %r through %r" % (v["fleet"], v["endpoint"]))
        print("     3 etcd members (TLS, the StatefulSet's flags) joined by 3 gateways as "
              "fleet %s; gateway 0 through %s" % (v["fleet"], v["endpoint"]))
        for px, _ in gws:
            px.stop()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def test_dockerfile_static():
    check_dockerfile(model())
    if dockerfile_stages(model().dockerfile)[-1]["from"] == "scratch":
        note("scratch runtime stage: its libraries are what ldd finds in the build stage; "
             "test_image runs the binaries inside the built image")
        return
    # The runtime stage's libraries are the ones the binaries link.
    if not shutil.which("dpkg") or not shutil.which("ldd"):
        note("dpkg/ldd not found: skipping the shared-library check")
        return
    rpk = {p for i, a in dockerfile_stages(model().dockerfile)[-1]["ins"] if i == "RUN"
           for p in apt_packages(a)}
    ignore = re.compile(r"^(libc6|libgcc-s1|libstdc\+\+6|libasan\d*|libubsan\d*|liblsan\d*)$")
    libs = {}  # real path -> (binary, path as linked)
    for b in (DETPROXY_BIN, SIM_BIN):
        rc, out, _ = run_cmd(["ldd", b])
        need(rc == 0, "ldd %s failed" % b)
        for lib in re.findall(r"=>\s+(/\S+)", out):
            libs.setdefault(os.path.realpath(lib), (b, lib))
    # One dpkg -S for all of them (by real path; Debian 12 lists /lib/... paths for usrmerge).
    rc, out, _ = run_cmd(["dpkg", "-S"] + sorted(libs) + sorted(l for _, l in libs.values()))
    owners = {}
    for line in out.splitlines():
        pkgs, _, path = line.partition(": ")
        for pk in pkgs.split(", "):
            owners.setdefault(path.strip(), pk.split(":")[0])
    for real, (b, lib) in sorted(libs.items()):
        pkg = owners.get(real) or owners.get(lib)
        need(pkg, "no Debian package owns %s (linked by %s)" % (lib, b))
        if not ignore.match(pkg):
            need(pkg in rpk, "Dockerfile: %s links %s from %s, which the runtime stage does "
                 "not install" % (os.path.basename(b), lib, pkg))


def test_dockerfile_build_context_configures():
    """Replay the build stage on exactly what it COPYs: CMake must configure (and, with
    DP_DEPLOY_DOCKER_BUILD=1, build the binaries at the paths the runtime stage copies)."""
    if not shutil.which("cmake"):
        note("cmake not found: skipping")
        return
    build = dockerfile_stages(model().dockerfile)[0]
    tmp = tempfile.mkdtemp(prefix="dp-docker-")
    try:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        cmake_args = None
        workdir = "/"
        for ins, args in build["ins"]:
            if ins == "WORKDIR":
                workdir = args
            if ins == "COPY" and "--from" not in args:
                parts = args.split()
                dest = os.path.join(src, os.path.relpath(os.path.join(workdir, parts[-1]),
                                                         "/src"))
                for s in parts[:-1]:
                    full = os.path.join(SOURCE_DIR, s)
                    if os.path.isdir(full):
                        shutil.copytree(full, dest, dirs_exist_ok=True,
                                        ignore=shutil.ignore_patterns("*.o"))
                    else:
                        os.makedirs(dest if parts[-1].endswith("/") else os.path.dirname(dest),
                                    exist_ok=True)
                        shutil.copy(full, dest)
            if ins == "RUN" and "cmake -S" in args:
                cmake_args = args
        need(cmake_args, "Dockerfile: no cmake -S ... RUN line")
        steps = [s.strip() for s in cmake_args.split("&&")]
        configure = shlex.split(steps[0])
        cp = subprocess.run(configure, cwd=src, capture_output=True, text=True, timeout=180)
        need(cp.returncode == 0, "CMake does not configure from what the Dockerfile copies:\n%s"
             % (cp.stdout[-2000:] + cp.stderr[-3000:]))
        if os.environ.get("DP_DEPLOY_DOCKER_BUILD") == "1":
            for s in steps[1:]:
                s = s.replace('"$(nproc)"', str(os.cpu_count() or 2))
                cp = subprocess.run(shlex.split(s), cwd=src, capture_output=True, text=True,
                                    timeout=1800)
                need(cp.returncode == 0, "Dockerfile step `%s` failed:\n%s" % (
                    s, cp.stderr[-3000:]))
            final = dockerfile_stages(model().dockerfile)[-1]
            for ins, args in final["ins"]:
                if ins == "COPY" and args.startswith("--from="):
                    p = args.split()[1]
                    need(os.access(os.path.join(src, os.path.relpath(p, "/src")), os.X_OK),
                         "the build did not produce %s" % p)
            print("     full build replayed")
        else:
            note("configure only; DP_DEPLOY_DOCKER_BUILD=1 replays the whole build stage")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_systemd_units():
    m = model()
    check_systemd(m)
    sa = shutil.which("systemd-analyze")
    if not sa:
        note("systemd-analyze not installed: skipping `systemd-analyze verify`")
        return
    tmp = tempfile.mkdtemp(prefix="dp-systemd-")
    try:
        paths = []
        for name, text in m.units.items():
            # verify checks that ExecStart binaries exist: point them at the build.
            p = os.path.join(tmp, name)
            with open(p, "w", encoding="utf-8") as fh:
                fh.write(text.replace("/usr/local/bin/detproxy", os.path.abspath(DETPROXY_BIN)))
            paths.append(p)
        cp = subprocess.run([sa, "verify", "--man=no"] + paths, capture_output=True, text=True,
                            timeout=60)
        msgs = [ln for ln in (cp.stdout + cp.stderr).splitlines() if ln.strip()]
        need(cp.returncode == 0 and not msgs, "systemd-analyze verify:\n" + "\n".join(msgs))
        for p in paths:
            cp = subprocess.run([sa, "security", "--offline=yes", p], capture_output=True,
                                text=True, timeout=60)
            mm = re.search(r"Overall exposure level for \S+: ([\d.]+)", cp.stdout + cp.stderr)
            if not mm:
                note("systemd-analyze security --offline unsupported here: skipped")
                break
            need(float(mm.group(1)) <= 2.0, "%s: systemd exposure level %s (want <= 2.0)" % (
                os.path.basename(p), mm.group(1)))
            print("     %s: verify ok, exposure %s" % (os.path.basename(p), mm.group(1)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_lb_snippets():
    m = model()
    check_lb_static(m)
    tmp = tempfile.mkdtemp(prefix="dp-lb-")
    try:
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if os.access(
            "/usr/sbin/nginx", os.X_OK) else None)
        if nginx:
            conf = os.path.join(tmp, "nginx.conf")
            with open(conf, "w", encoding="utf-8") as fh:
                fh.write("pid %s/nginx.pid;\nerror_log stderr;\nevents {}\nhttp {\n"
                         "  access_log off;\n"
                         "  client_body_temp_path %s/cb; proxy_temp_path %s/pt;\n"
                         "  fastcgi_temp_path %s/ft; uwsgi_temp_path %s/ut; scgi_temp_path %s/st;\n"
                         "  include %s;\n}\n" % ((tmp,) * 6 + (os.path.join(
                             LB, "nginx-detproxy.conf"),)))
            cp = subprocess.run([nginx, "-t", "-q", "-p", tmp, "-c", conf], capture_output=True,
                                text=True, timeout=30)
            bad = [ln for ln in cp.stderr.splitlines() if "[emerg]" in ln or "[warn]" in ln
                   or "[alert]" in ln]
            need(cp.returncode == 0 and not bad, "nginx -t:\n" + cp.stderr)
            print("     nginx -t: ok")
        else:
            note("nginx not installed: skipping `nginx -t`")
        haproxy = shutil.which("haproxy") or ("/usr/sbin/haproxy" if os.access(
            "/usr/sbin/haproxy", os.X_OK) else None)
        if haproxy:
            wrap = os.path.join(tmp, "global.cfg")
            with open(wrap, "w", encoding="utf-8") as fh:
                fh.write("global\n    log stdout format raw local0\ndefaults\n    mode http\n"
                         "    timeout connect 5s\n    timeout client 30s\n"
                         "    timeout server 30s\n")
            cp = subprocess.run([haproxy, "-c", "-f", wrap, "-f", os.path.join(
                LB, "haproxy-detproxy.cfg")], capture_output=True, text=True, timeout=30)
            out = cp.stdout + cp.stderr
            need(cp.returncode == 0 and "[WARNING]" not in out and "[ALERT]" not in out,
                 "haproxy -c:\n" + out)
            print("     haproxy -c: ok")
        else:
            note("haproxy not installed: skipping `haproxy -c`")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def doc_commands(text):
    """detproxy command lines in a Markdown file's code (fenced blocks and inline spans)."""
    code = re.findall(r"```.*?```", text, re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    code += re.findall(r"`([^`\n]+)`", rest)
    out = []
    for block in code:
        block = block.replace("\\\n", " ")
        for mm in re.finditer(r"(?<![\w/.-])detproxy ((?:run|check|attest|diagnose)\b[^`|;&\n]*)",
                              block):
            out.append(["detproxy"] + shlex.split(mm.group(1)))
    return out


def declared_metrics():
    names = set()
    for p in glob.glob(os.path.join(SOURCE_DIR, "proxy", "**", "*.c"), recursive=True):
        with open(p, encoding="utf-8") as f:
            names.update(re.findall(r'px_metrics_family\(\s*"(detproxy_\w+)"', f.read()))
    return names


def check_docs(texts):
    """texts: {name: markdown}. Commands use real flags; metric names are ones detproxy has."""
    metrics = declared_metrics()
    need(metrics, "found no px_metrics_family declarations under proxy/")
    n = 0
    for name, text in texts.items():
        for argv in doc_commands(text):
            check_detproxy_argv(argv, "%s: `%s`" % (name, " ".join(argv)))
            n += 1
        for mname in set(re.findall(r"\bdetproxy_[a-z_]+", text)):
            base = re.sub(r"_(bucket|sum|count)$", "", mname)
            need(base in metrics, "%s: mentions metric %s, which detproxy does not export (it "
                 "has %s)" % (name, mname, ", ".join(sorted(metrics))))
    return n


def _doc_texts():
    out = {}
    for rel in ("docs/operations.md", "deploy/k8s/README.md"):
        with open(os.path.join(SOURCE_DIR, rel), encoding="utf-8") as f:
            out[rel] = f.read()
    return out


def test_docs_commands_and_metrics():
    n = check_docs(_doc_texts())
    print("     %d detproxy command lines in the runbook and README checked" % n)


# ---- negative controls: every checker must notice a plausible mistake ------------------------


def _containers_named(m, name):
    for f, d, ns, tpl in m.workloads():
        for c, _, _ in all_containers(tpl["spec"]):
            if c["name"] == name:
                yield f, d, tpl["spec"], c


def _cm_json(m, name, key, fn):
    cm = m.find("ConfigMap", "llm", name)
    v = json.loads(cm["data"][key])
    fn(v)
    cm["data"][key] = json.dumps(v)


def _must_fail(label, check, mutate, expect):
    m = copy.deepcopy(model())
    mutate(m)
    try:
        check(m)
    except Bad as e:
        need(re.search(expect, str(e)), "%s: failed, but with an unexpected reason: %s" % (
            label, e))
        return str(e)
    raise AssertionError("%s: the check passed on a broken copy" % label)


def _materialize_all(m):
    tmp = tempfile.mkdtemp(prefix="dp-neg-")
    try:
        keys = Keys(tmp)
        for e in detproxy_containers(m):
            if e[5] == ("run",):
                RunConfig(m, e, tmp, keys).check_refs()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _with_unbuilt_flag(m):
    """detproxy_containers(m) while `attest serve --help` also lists a flag marked "not built
    yet" (as the help did for --tls-cert before TLS existed)."""
    key = ("attest", "serve")
    real = help_text(*key)
    _help_cache[key] = real + "  --frobnicate F              frobnicate (not built yet)\n"
    try:
        return detproxy_containers(m)
    finally:
        _help_cache[key] = real


def _etcd_set(m):
    return etcd_sets(m)[0][0]


def test_checks_catch_mistakes():
    def agent_args(m, fn):
        for f, d, pod, c in _containers_named(m, "attest"):
            c["args"] = fn(list(c["args"]))

    def first(m, name):
        return next(_containers_named(m, name))[3]

    cases = [
        ("typo'd agent flag", lambda m: detproxy_containers(m),
         lambda m: agent_args(m, lambda a: [x if x != "--model-dir" else "--modle-dir"
                                            for x in a]), r"unknown flag --modle-dir"),
        ("flag the help marks unbuilt", _with_unbuilt_flag,
         lambda m: agent_args(m, lambda a: a + ["--frobnicate", "/x"]), r"not built yet"),
        ("unknown subcommand", lambda m: detproxy_containers(m),
         lambda m: first(m, "detproxy").__setitem__("args", ["serve", "-c", "/x"]),
         r"no such subcommand"),
        ("readiness probe on the wrong port", check_k8s_run_containers,
         lambda m: first(m, "detproxy")["readinessProbe"]["httpGet"].__setitem__("port", 8080),
         r"probes port 8080"),
        ("readiness probe path", check_k8s_run_containers,
         lambda m: first(m, "detproxy")["readinessProbe"]["httpGet"].__setitem__("path",
                                                                                "/ready"),
         r"path /ready"),
        ("admin on loopback", check_k8s_run_containers,
         lambda m: _cm_json(m, "detproxy-config", "gateway.json",
                            lambda c: c.__setitem__("admin_listen", "127.0.0.1:9901")),
         r"loopback"),
        ("grace period shorter than the drain", check_k8s_run_containers,
         lambda m: next(_containers_named(m, "detproxy"))[2].__setitem__(
             "terminationGracePeriodSeconds", 30), r"terminationGracePeriodSeconds"),
        ("a drain longer than the grace period", check_k8s_run_containers,
         lambda m: _cm_json(m, "detproxy-config", "gateway.json",
                            lambda c: c.setdefault("limits", {}).__setitem__(
                                "shutdown_timeout_ms", 60000)),
         r"60 s drain"),
        ("discovery port not on the Service", check_k8s_run_containers,
         lambda m: _cm_json(m, "detproxy-config", "gateway.json",
                            lambda c: c["pools"][0]["discovery"].__setitem__("port", 8001)),
         r"discovery.port 8001"),
        ("image from elsewhere", check_k8s_images,
         lambda m: first(m, "detproxy").__setitem__("image", "docker.io/library/nginx:1.25"),
         r"image"),
        ("unpinned etcd image", check_k8s_images,
         lambda m: first(m, "etcd").__setitem__("image", "quay.io/coreos/etcd:latest"), r"image"),
        ("etcd flag typo", check_etcd,
         lambda m: first(m, "etcd")["args"].append("--client-cert-atuh"),
         r"--client-cert-atuh is not a flag" if etcd_help() else r"--client-cert-auth"),
        ("etcd started one by one", check_etcd,
         lambda m: _etcd_set(m)["spec"].__setitem__("podManagementPolicy", "OrderedReady"),
         r"podManagementPolicy"),
        ("etcd member missing from --initial-cluster", check_etcd,
         lambda m: first(m, "etcd").__setitem__("args", [
             a.rsplit(",", 1)[0] if a.startswith("--initial-cluster=") else a
             for a in first(m, "etcd")["args"]]), r"--initial-cluster is"),
        ("etcd without client certificates", check_etcd,
         lambda m: first(m, "etcd")["args"].remove("--client-cert-auth"), r"--client-cert-auth"),
        ("etcd data on no claim", check_etcd,
         lambda m: _etcd_set(m)["spec"].pop("volumeClaimTemplates"), r"volumeClaimTemplate"),
        ("etcd without anti-affinity", check_etcd,
         lambda m: _etcd_set(m)["spec"]["template"]["spec"].pop("affinity"), r"podAntiAffinity"),
        ("etcd probe on the TLS port", check_etcd,
         lambda m: first(m, "etcd")["readinessProbe"]["httpGet"].__setitem__("port", "client"),
         r"metrics port"),
        ("fleet endpoint naming no member", check_etcd,
         lambda m: _cm_json(m, "detproxy-config", "gateway-fleet.json", lambda c: c["fleet"][
             "etcd"]["endpoints"].__setitem__(2, "https://etcd-3.etcd.llm.svc.cluster.local:2379")),
         r"are not the etcd members"),
        ("fleet without a client certificate", check_etcd,
         lambda m: _cm_json(m, "detproxy-config", "gateway-fleet.json",
                            lambda c: c["fleet"]["etcd"].pop("tls")), r"client certificate"),
        ("unpinned vLLM image", check_k8s_images,
         lambda m: first(m, "vllm").__setitem__("image", "vllm/vllm-openai:latest"), r"image"),
        ("agent quantization differs from vLLM", check_vllm_agent,
         lambda m: agent_args(m, lambda a: [x if x != "awq" else "gptq" for x in a]),
         r"--quantization"),
        ("manifest version differs from the image", check_vllm_agent,
         lambda m: _cm_json(m, "detproxy-manifests", "llama.json",
                            lambda v: v["framework"].__setitem__("version", "0.6.4")),
         r"framework.version"),
        ("Service selector typo", check_k8s_structure,
         lambda m: m.find("Service", "llm", "vllm")["spec"]["selector"].__setitem__(
             "app.kubernetes.io/name", "vlm"), r"matches no pod"),
        ("gateway pods not let through the NetworkPolicy", check_k8s_structure,
         lambda m: next(_containers_named(m, "detproxy"))[1]["spec"]["template"]["metadata"][
             "labels"].pop("detproxy.io/proxy"), r"does not let its pods in"),
        ("model volume writable in vLLM", check_vllm_agent,
         lambda m: first(m, "vllm")["volumeMounts"][0].__setitem__("readOnly", False),
         r"read-only"),
        ("writable root filesystem", check_k8s_security,
         lambda m: first(m, "detproxy")["securityContext"].__setitem__(
             "readOnlyRootFilesystem", False), r"readOnlyRootFilesystem"),
        ("config path on no mount", _materialize_all,
         lambda m: _cm_json(m, "detproxy-config", "gateway.json",
                            lambda c: c.__setitem__("policy", "/etc/detproxy-policy/p.json")),
         r"provided by no volume mount"),
        ("audit log on the read-only root", _materialize_all,
         lambda m: _cm_json(m, "detproxy-config", "gateway.json",
                            lambda c: c["log"].__setitem__("audit_path", "/var/audit.jsonl")),
         r"writable volume"),
        ("secret not created anywhere", _materialize_all,
         lambda m: setattr(m, "readme", m.readme.replace("detproxy-admin-token", "x-token")),
         r"neither in deploy/k8s"),
        ("Dockerfile COPY of a missing folder", check_dockerfile,
         lambda m: setattr(m, "dockerfile", m.dockerfile.replace("COPY proxy/ proxy/",
                                                                 "COPY proxyy/ proxy/")),
         r"no such path"),
        ("Dockerfile binary path", check_dockerfile,
         lambda m: setattr(m, "dockerfile", m.dockerfile.replace(
             "rootfs.sh /out build/release/proxy/detproxy", "rootfs.sh /out build/proxy/detproxy")),
         r"CMake builds it"),
        ("Dockerfile runs as root", check_dockerfile,
         lambda m: setattr(m, "dockerfile", m.dockerfile.replace("USER 10001:10001",
                                                                 "USER 0")), r"USER"),
        ("systemd flag typo", check_systemd,
         lambda m: m.units.__setitem__("detproxy.service", m.units["detproxy.service"].replace(
             "run -c", "run --conf")), r"unknown flag --conf"),
        ("systemd stop timeout", check_systemd,
         lambda m: m.units.__setitem__("detproxy.service", m.units["detproxy.service"].replace(
             "TimeoutStopSec=35", "TimeoutStopSec=20")), r"TimeoutStopSec"),
        ("LB read timeout below generation time", check_lb_static,
         lambda m: setattr(m, "nginx", m.nginx.replace("proxy_read_timeout 600s",
                                                       "proxy_read_timeout 60s")),
         r"proxy_read_timeout"),
        ("LB health check port", check_lb_static,
         lambda m: setattr(m, "haproxy", m.haproxy.replace("check port 9901",
                                                           "check port 8080")), r"admin port"),
    ]
    for label, check, mutate, expect in cases:
        _must_fail(label, check, mutate, expect)
    docs = _doc_texts()
    for label, bad, expect in (
            ("runbook flag typo", docs["docs/operations.md"].replace("--pool llama",
                                                                     "--pol llama"),
             r"unknown flag --pol"),
            ("runbook metric typo", docs["docs/operations.md"].replace(
                "detproxy_replica_admitted)", "detproxy_replicas_admitted)"),
             r"detproxy_replicas_admitted")):
        try:
            check_docs({"docs/operations.md": bad})
        except Bad as e:
            need(re.search(expect, str(e)), "%s: unexpected reason %s" % (label, e))
        else:
            raise AssertionError("%s: the check passed on a broken copy" % label)
        cases.append(label)
    print("     %d broken copies, each rejected" % len(cases))


if __name__ == "__main__":
    run_tests(globals())
