#!/usr/bin/env python3
"""Black-box tests of `detproxy attest hash|keygen|verify|serve` against the real binary.

The checkpoint hash is checked against the coreutils pipeline of docs/attestation.md §1 on a generated tree;
signatures are checked independently with the openssl CLI; the agent is started for real and
watched while its model directory changes under it. Python stdlib only.
Env: DETPROXY_BIN (required), DETPROXY_SIM_BIN (optional: --framework-url tests).
"""
import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

from harness import SLOW, connect_from  # timeouts are multiplied by it (4 under the sanitizers)

BIN = os.environ.get("DETPROXY_BIN", "")
SIM = os.environ.get("DETPROXY_SIM_BIN", "")
PAYLOAD_TYPE = "application/vnd.detproxy.attestation+json"


def run(*args, stdin=None, timeout=60):
    p = subprocess.run([BIN, "attest", *args], input=stdin, capture_output=True,
                       timeout=timeout * SLOW)
    return p.returncode, p.stdout.decode(), p.stderr.decode()


def coreutils_hash(d):
    cmd = ("cd \"$1\" && find -L . -type f ! -path '*/.*' -printf '%P\\n' | LC_ALL=C sort"
           " | xargs -d '\\n' sha256sum | sha256sum")
    out = subprocess.run(["sh", "-c", cmd, "sh", d], capture_output=True, check=True,
                         env={**os.environ, "LC_ALL": "C"}).stdout.decode()
    return out.split()[0]


def write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def make_tree(d):
    """Nested dirs, dotfiles at several levels, a symlinked file and directory, a dangling
    symlink, names with spaces and non-ASCII bytes, an empty file, a multi-MiB file."""
    write(f"{d}/config.json", '{"architectures": ["LlamaForCausalLM"]}\n')
    write(f"{d}/model-00001-of-00002.safetensors", os.urandom(3 << 20))
    write(f"{d}/model-00002-of-00002.safetensors", os.urandom(1 << 20) + b"tail")
    write(f"{d}/tokenizer/tokenizer.json", "{}")
    write(f"{d}/tokenizer/.cache/ignored", "x")
    write(f"{d}/.git/HEAD", "ref: refs/heads/main\n")
    write(f"{d}/.hidden-file", "secret")
    write(f"{d}/with space/file name.txt", "spaces\n")
    write(f"{d}/caf\u00e9/\u00fcber.txt", "unicode\n")
    write(f"{d}/a-b", "dash")
    write(f"{d}/a/b", "slash")
    write(f"{d}/empty", b"")
    os.symlink("config.json", f"{d}/config-link.json")
    os.symlink("tokenizer", f"{d}/tokenizer-link")
    os.symlink("does-not-exist", f"{d}/dangling")


class Tmp(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="dp-attest-it-")

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


class HashTest(Tmp):
    def test_matches_coreutils_pipeline(self):
        d = f"{self.tmp}/model"
        make_tree(d)
        rc, out, err = run("hash", d)
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.strip(), coreutils_hash(d))

    def test_a_single_gguf_file_is_its_sha256(self):
        # llama.cpp models are one file: its hash is what sha256sum and Hugging Face show.
        import hashlib
        f = f"{self.tmp}/tiny-Q8_0.gguf"
        data = os.urandom(300000)
        with open(f, "wb") as fh:
            fh.write(data)
        rc, out, err = run("hash", f)
        self.assertEqual(rc, 0, err)
        self.assertEqual(out.strip(), hashlib.sha256(data).hexdigest())

    def test_list_piped_to_sha256sum_is_the_hash(self):
        d = f"{self.tmp}/model"
        make_tree(d)
        rc, listing, _ = run("hash", "--list", d)
        self.assertEqual(rc, 0)
        self.assertIn("  tokenizer-link/tokenizer.json\n", listing)
        self.assertNotIn(".cache", listing)
        self.assertNotIn("dangling", listing)
        import hashlib
        self.assertEqual(hashlib.sha256(listing.encode()).hexdigest(), run("hash", d)[1].strip())

    def test_symlinked_model_dir(self):
        d = f"{self.tmp}/model"
        make_tree(d)
        os.symlink(d, f"{self.tmp}/current")
        self.assertEqual(run("hash", f"{self.tmp}/current")[1].strip(), coreutils_hash(d))

    def test_progress_only_when_asked_or_big(self):
        d = f"{self.tmp}/model"
        make_tree(d)
        rc, out, err = run("hash", d)
        self.assertEqual(err, "", "small trees print no progress")
        rc, out, err = run("hash", "--progress", d)
        self.assertEqual(rc, 0)
        self.assertRegex(err, r"hashed \d+/\d+ files, [0-9.]+/[0-9.]+ GiB \(100%\)")
        self.assertNotIn("\r", err, "not a tty: plain lines")

    def test_errors(self):
        d = f"{self.tmp}/model"
        make_tree(d)
        os.symlink("..", f"{d}/tokenizer/up")
        rc, out, err = run("hash", d)
        self.assertEqual(rc, 3)
        self.assertEqual(out, "")
        self.assertIn("symlink loop", err)
        self.assertEqual(err.count("\n"), 1, "one line")
        rc, _, err = run("hash", f"{self.tmp}/nope")
        self.assertEqual(rc, 3)
        self.assertIn("No such file or directory", err)

    def test_usage(self):
        self.assertEqual(run("hash")[0], 2)
        self.assertEqual(run("hash", "a", "b")[0], 2)
        rc, _, err = run("hash", "--frobnicate", self.tmp)
        self.assertEqual(rc, 2)
        self.assertIn("unknown option '--frobnicate'", err)
        rc, _, err = run("hash", "--progress", "--no-progress", self.tmp)
        self.assertEqual((rc, "contradict" in err), (2, True), err)
        rc, out, _ = run("hash", "--help")
        self.assertEqual(rc, 0)
        self.assertIn("usage: detproxy attest hash", out)
        self.assertEqual(run("frobnicate")[0], 2)
        self.assertEqual(run("--help")[0], 0)


class KeysAndVerifyTest(Tmp):
    def setUp(self):
        super().setUp()
        self.prefix = f"{self.tmp}/pipeline"
        rc, out, err = run("keygen", "--out", self.prefix)
        self.assertEqual(rc, 0, err)
        self.keyid = out.split("keyid ")[1].strip()
        self.priv = self.prefix + ".key.pem"
        self.pub = self.prefix + ".pub.pem"

    def envelope_from_agent(self, nonce="n-123", extra=()):
        """Start the agent briefly and fetch one envelope."""
        d = f"{self.tmp}/m"
        if not os.path.isdir(d):
            make_tree(d)
        with Agent(d, key=self.priv, extra=extra) as a:
            return a.get(f"/attestation?nonce={nonce}")[1], d

    def test_keygen_files(self):
        self.assertEqual(os.stat(self.priv).st_mode & 0o777, 0o600)
        self.assertEqual(os.stat(self.pub).st_mode & 0o777, 0o644)
        with open(self.priv) as f:
            self.assertIn("BEGIN PRIVATE KEY", f.read())
        der = subprocess.run(["openssl", "pkey", "-pubin", "-in", self.pub, "-outform", "DER"],
                             capture_output=True, check=True).stdout
        import hashlib
        self.assertEqual(self.keyid, hashlib.sha256(der).hexdigest())
        rc, _, err = run("keygen", "--out", self.prefix)
        self.assertEqual(rc, 3)
        self.assertIn("already exists", err)
        self.assertEqual(run("keygen")[0], 2)

    def test_signature_verifies_with_openssl(self):
        body, _ = self.envelope_from_agent()
        env = json.loads(body)
        payload = base64.b64decode(env["payload"])
        t = env["payloadType"].encode()
        pae = b"DSSEv1 %d %s %d %s" % (len(t), t, len(payload), payload)
        write(f"{self.tmp}/pae.bin", pae)
        write(f"{self.tmp}/sig.bin", base64.b64decode(env["signatures"][0]["sig"]))
        p = subprocess.run(["openssl", "pkeyutl", "-verify", "-rawin", "-pubin", "-inkey",
                            self.pub, "-in", f"{self.tmp}/pae.bin", "-sigfile",
                            f"{self.tmp}/sig.bin"], capture_output=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertEqual(env["signatures"][0]["keyid"], self.keyid)

    def test_verify_and_manifest(self):
        body, d = self.envelope_from_agent(nonce="fresh-1")
        write(f"{self.tmp}/env.json", body)
        h = coreutils_hash(d)
        rc, out, err = run("verify", "--envelope", f"{self.tmp}/env.json", "--pubkey", self.pub,
                           "--nonce", "fresh-1")
        self.assertEqual(rc, 0, out + err)
        self.assertIn(f"checkpoint_sha256  {h}", out)

        good = {"model": "m", "checkpoint_sha256": h, "quantization": "awq", "dtype": "float16",
                "framework": {"name": "vllm", "version": "0.6.3"}}
        write(f"{self.tmp}/good.json", json.dumps(good))
        rc, out, _ = run("verify", "--envelope", f"{self.tmp}/env.json", "--pubkey", self.pub,
                         "--manifest", f"{self.tmp}/good.json")
        self.assertEqual(rc, 0, out)
        self.assertIn("manifest: match", out)

        bad = dict(good, checkpoint_sha256="cd34ef56" * 8, dtype="bfloat16")
        write(f"{self.tmp}/bad.json", json.dumps(bad))
        rc, out, _ = run("verify", "--envelope", f"{self.tmp}/env.json", "--pubkey", self.pub,
                         "--manifest", f"{self.tmp}/bad.json", "--json")
        self.assertEqual(rc, 1)
        res = json.loads(out)
        self.assertTrue(res["verified"])
        self.assertFalse(res["manifest"]["match"])
        self.assertEqual(res["manifest"]["reasons"],
                         [f"checkpoint_sha256 mismatch: got {h[:8]}.. want cd34ef56..",
                          "dtype mismatch: got float16 want bfloat16"])

    def test_verify_rejections(self):
        body, _ = self.envelope_from_agent(nonce="n-1")
        write(f"{self.tmp}/env.json", body)
        env = f"{self.tmp}/env.json"
        # replay: the envelope answers another nonce
        rc, out, _ = run("verify", "--envelope", env, "--pubkey", self.pub, "--nonce", "n-2")
        self.assertEqual(rc, 1)
        self.assertIn("nonce mismatch (replay?)", out)
        # untrusted key
        run("keygen", "--out", f"{self.tmp}/other")
        rc, out, _ = run("verify", "--envelope", env, "--pubkey", f"{self.tmp}/other.pub.pem")
        self.assertEqual(rc, 1)
        self.assertIn(f"signature: key {self.keyid[:8]}.. not trusted", out)
        # tampered payload
        e = json.loads(body)
        p = json.loads(base64.b64decode(e["payload"]))
        p["quantization"] = "fp8"
        e["payload"] = base64.b64encode(json.dumps(p).encode()).decode()
        write(f"{self.tmp}/tampered.json", json.dumps(e))
        rc, out, _ = run("verify", "--envelope", f"{self.tmp}/tampered.json", "--pubkey", self.pub)
        self.assertEqual(rc, 1)
        self.assertIn("bad signature", out)
        # garbage, from stdin
        rc, out, _ = run("verify", "--envelope", "-", "--pubkey", self.pub, stdin=b"\x00garbage")
        self.assertEqual(rc, 1)
        self.assertIn("envelope: not valid JSON", out)
        # a 10 MB body
        rc, out, _ = run("verify", "--envelope", "-", "--pubkey", self.pub,
                         stdin=b"{" + b" " * (10 << 20) + b"}")
        self.assertEqual(rc, 1)
        self.assertIn("too large", out)
        # files that cannot be read are runtime failures, missing flags usage errors
        self.assertEqual(run("verify", "--envelope", f"{self.tmp}/nope", "--pubkey", self.pub)[0], 3)
        self.assertEqual(run("verify", "--envelope", env, "--pubkey", self.priv)[0], 3)
        self.assertEqual(run("verify", "--envelope", env)[0], 2)
        # a device or a directory is no envelope; a FIFO no one writes to reads as empty
        # (opening it used to wait for a writer for ever)
        fifo = f"{self.tmp}/fifo"
        os.mkfifo(fifo)
        for path in ("/dev/zero", self.tmp):
            rc, _, err = run("verify", "--envelope", path, "--pubkey", self.pub)
            self.assertEqual((rc, "not a regular file or a pipe" in err), (3, True), err)
        rc, out, _ = run("verify", "--envelope", fifo, "--pubkey", self.pub, timeout=10)
        self.assertEqual((rc, "envelope: not valid JSON" in out), (1, True), out)
        rc, _, err = run("verify", "--envelope", env, "--pubkey", fifo, timeout=10)
        self.assertEqual(rc, 3, err)


class Agent:
    """`detproxy attest serve` on a free port; stderr (JSON lines) collected in the background."""

    def __init__(self, model_dir, key=None, extra=(), framework=("vllm", "0.6.3"), ready=True):
        args = [BIN, "attest", "serve", "--listen", "127.0.0.1:0", "--model-dir", model_dir,
                "--model", "m", "--quantization", "awq", "--dtype", "float16",
                "--watch-interval-ms", "100"]
        if framework:
            args += ["--framework", framework[0], "--framework-version", framework[1]]
        if key:
            args += ["--key", key]
        self.args = args + list(extra)
        self.lines = []
        self.ready = ready

    def __enter__(self):
        self.p = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        first = self.p.stderr.readline().decode()
        self.lines.append(first)
        while '"listening"' not in first:
            if not first:
                raise RuntimeError("agent exited: " + "".join(self.lines))
            first = self.p.stderr.readline().decode()
            self.lines.append(first)
        self.port = json.loads(first)["port"]
        threading.Thread(target=self._drain, daemon=True).start()
        if self.ready:
            self.wait_ready()
        return self

    def _drain(self):
        for line in self.p.stderr:
            self.lines.append(line.decode())

    def get(self, path):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}",
                                        timeout=10 * SLOW) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def wait_ready(self, timeout=30):
        deadline = time.time() + timeout * SLOW
        while time.time() < deadline:
            st, body = self.get("/attestation?nonce=probe")
            if st == 200:
                return body
            time.sleep(0.05)
        raise AssertionError("agent never ready: " + "".join(self.lines))

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        return self.p.wait(timeout=30 * SLOW)

    def __exit__(self, *exc):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        self.p.stderr.close()


def payload_of(body):
    return json.loads(base64.b64decode(json.loads(body)["payload"]))


class ServeTest(Tmp):
    def test_answers_and_stops_cleanly(self):
        d = f"{self.tmp}/m"
        make_tree(d)
        with Agent(d) as a:
            st, body = a.get("/attestation?nonce=abc-123")
            self.assertEqual(st, 200)
            env = json.loads(body)
            self.assertEqual(env["payloadType"], PAYLOAD_TYPE)
            self.assertEqual(env["signatures"], [], "no --key: unsigned")
            p = payload_of(body)
            self.assertEqual(p["nonce"], "abc-123")
            self.assertEqual(p["checkpoint_sha256"], coreutils_hash(d))
            self.assertEqual(p["framework"], {"name": "vllm", "version": "0.6.3"})
            self.assertEqual(a.get("/attestation")[0], 400)
            self.assertEqual(a.get("/attestation?nonce=a%20b")[0], 400)
            self.assertEqual(a.get("/attestation?nonce=" + "x" * 129)[0], 400)
            self.assertEqual(a.get("/nope")[0], 404)
            self.assertEqual(a.get("/healthz")[0], 200)
            self.assertEqual(a.stop(), 0)

    def test_model_change_is_seen_and_rehashed(self):
        d = f"{self.tmp}/m"
        make_tree(d)
        with Agent(d) as a:
            before = payload_of(a.get("/attestation?nonce=n1")[1])["checkpoint_sha256"]
            t0 = time.time()
            with open(f"{d}/model-00002-of-00002.safetensors", "ab") as f:
                f.write(b"swapped weights")
            after = before
            while time.time() - t0 < 20 * SLOW and after == before:
                st, body = a.get("/attestation?nonce=n2")
                if st == 503:  # caught between the change and the new hash
                    self.assertIn("re-hashing", json.loads(body)["error"]["message"])
                elif st == 200:
                    after = payload_of(body)["checkpoint_sha256"]
                time.sleep(0.01)
            self.assertNotEqual(after, before, "".join(a.lines))
            self.assertEqual(after, coreutils_hash(d))
            self.assertTrue(any('"model_changed"' in l for l in a.lines), "".join(a.lines))
            self.assertLess(time.time() - t0, 10 * SLOW, "the new hash must not be late")

    def test_in_place_rewrite_with_mtime_restored_is_seen(self):
        """Same size, mtime put back: only the ctime tells (docs/attestation.md §4, lifecycle)."""
        d = f"{self.tmp}/m"
        make_tree(d)
        victim = f"{d}/model-00002-of-00002.safetensors"
        with Agent(d) as a:
            before = payload_of(a.get("/attestation?nonce=n1")[1])["checkpoint_sha256"]
            st = os.stat(victim)
            with open(victim, "r+b") as f:
                f.write(b"X" * 4096)
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
            self.assertEqual(os.stat(victim).st_mtime_ns, st.st_mtime_ns)
            want = coreutils_hash(d)
            self.assertNotEqual(want, before)
            deadline, got = time.time() + 10 * SLOW, before
            while time.time() < deadline and got != want:
                code, body = a.get("/attestation?nonce=n2")
                if code == 200:
                    got = payload_of(body)["checkpoint_sha256"]
                    self.assertIn(got, (before, want))
                time.sleep(0.02)
            self.assertEqual(got, want, "".join(a.lines))

    def test_continuous_in_place_writes_are_never_signed_half_written(self):
        """A writer rewrites a file in place, chunk by chunk, putting the mtime back after every
        chunk. Every hash the agent signs must be of a whole state (all 'a' or all 'b'); once the
        writer stops, the settled directory is served again within seconds."""
        import hashlib
        d = f"{self.tmp}/w"
        size, chunk = 8 << 20, 256 << 10
        write(f"{d}/config.json", "{}")
        write(f"{d}/w.bin", b"a" * size)

        def tree_hash(fill):
            lines = ""
            for name, data in sorted([("config.json", b"{}"), ("w.bin", fill * size)]):
                lines += hashlib.sha256(data).hexdigest() + "  " + name + "\n"
            return hashlib.sha256(lines.encode()).hexdigest()

        whole = {tree_hash(b"a"), tree_hash(b"b")}
        self.assertEqual(coreutils_hash(d), tree_hash(b"a"))
        mtime = os.stat(f"{d}/w.bin").st_mtime_ns
        stop = threading.Event()

        def writer():
            fill = b"b"
            with open(f"{d}/w.bin", "r+b", buffering=0) as f:
                while True:
                    f.seek(0)
                    for off in range(0, size, chunk):
                        f.write(fill * chunk)
                        os.utime(f"{d}/w.bin", ns=(mtime, mtime))
                        time.sleep(0.002)
                    if stop.is_set() and fill == b"b":
                        return  # ends on a whole 'b' pass
                    fill = b"a" if fill == b"b" else b"b"

        with Agent(d) as a:
            th = threading.Thread(target=writer, daemon=True)
            th.start()
            signed, bad = 0, []
            t0 = time.time()
            while time.time() - t0 < 3:
                code, body = a.get("/attestation?nonce=n")
                if code == 200:
                    signed += 1
                    h = payload_of(body)["checkpoint_sha256"]
                    if h not in whole:
                        bad.append(h)
                time.sleep(0.005)
            stop.set()
            th.join(30)
            settled = time.time()
            want = tree_hash(b"b")
            got = None
            while time.time() - settled < 10 * SLOW and got != want:
                code, body = a.get("/attestation?nonce=m")
                if code == 200:
                    got = payload_of(body)["checkpoint_sha256"]
                    if got not in whole:
                        bad.append(got)
                time.sleep(0.02)
            took = time.time() - settled
            print(f"\n    {signed} answers signed during the writes, {len(bad)} of a "
                  f"half-written state; settled served after {took:.1f}s", file=sys.stderr)
            self.assertEqual(bad, [])
            self.assertEqual(got, want, "".join(a.lines[-20:]))
            self.assertLess(took, 5 * SLOW)

    def test_unhashable_dir_answers_503_with_reason(self):
        d = f"{self.tmp}/m"
        make_tree(d)
        os.symlink("..", f"{d}/tokenizer/up")
        with Agent(d, ready=False) as a:
            deadline = time.time() + 10 * SLOW
            while time.time() < deadline:
                st, body = a.get("/attestation?nonce=n")
                if st == 503 and "symlink loop" in body:
                    break
                time.sleep(0.05)
            self.assertEqual(st, 503, body)
            self.assertEqual(json.loads(body)["error"]["code"], "hash_failed")
            # fixed on disk: the retry (1 s, then backing off) picks it up
            os.unlink(f"{d}/tokenizer/up")
            a.wait_ready()

    def test_one_client_address_cannot_take_every_connection(self):
        """--max-connections-per-client: a host that opens more connections than any proxy
        keeps gets its new ones closed; another address, and the first once it lets one go,
        are answered."""
        d = f"{self.tmp}/m"
        make_tree(d)

        def conn(source="127.0.0.1"):
            return connect_from(a.port, source)

        def answered(s):
            """Ask /healthz on s, keep-alive: True if answered, False if closed unanswered."""
            try:
                s.sendall(b"GET /healthz HTTP/1.1\r\nhost: a\r\n\r\n")
                got = s.recv(4096)
            except (ConnectionResetError, BrokenPipeError):
                return False
            if not got:
                return False
            self.assertTrue(got.startswith(b"HTTP/1.1 200 "), got)
            return True

        def take():
            """A connection from 127.0.0.1 once the agent has room for it: it counts a
            connection closed until it reads the close (wait_ready's, a slot let go)."""
            deadline = time.time() + 10 * SLOW
            while True:
                s = conn()
                if answered(s):
                    return s
                s.close()
                self.assertLess(time.time(), deadline, "no room for a connection")
                time.sleep(0.02)

        with Agent(d, extra=("--max-connections-per-client", "3")) as a:
            held = [take() for _ in range(3)]
            over = conn()
            self.assertFalse(answered(over), "a fourth connection from one address")
            over.close()
            other = conn("127.0.0.2")
            self.assertTrue(answered(other), "another address has its own count")
            held.pop().close()
            held.append(take())
            for s in held:
                self.assertTrue(answered(s), "the connections within the bound stay served")
                s.close()
            other.close()
            deadline = time.time() + 10 * SLOW
            while not any('"client_connection_limit"' in l and '"127.0.0.1:' in l
                          for l in a.lines):
                self.assertLess(time.time(), deadline, "".join(a.lines[-5:]))
                time.sleep(0.02)
            self.assertEqual(a.stop(), 0)

    def test_usage_errors(self):
        base = ["serve", "--listen", "127.0.0.1:0", "--model-dir", self.tmp, "--model", "m"]
        self.assertEqual(run(*base)[0], 2, "framework missing")
        self.assertEqual(run(*base, "--framework", "vllm", "--framework-version", "1",
                             "--listen", "nonsense")[0], 2)
        self.assertEqual(run(*base, "--framework", "vllm", "--framework-version", "1",
                             "--watch-interval-ms", "abc")[0], 2)
        self.assertEqual(run(*base, "--framework-url", "http://127.0.0.1:1",
                             "--framework", "ollama")[0], 2)
        self.assertEqual(run(*base, "--framework", "vllm", "--framework-version", "1",
                             "--max-connections-per-client", "0")[0], 2)
        rc, _, err = run(*base, "--framework", "vllm", "--framework-version", "1",
                         "--key", f"{self.tmp}/nope.pem")
        self.assertEqual(rc, 3, err)
        self.assertEqual(run("serve", "--help")[0], 0)

    @unittest.skipUnless(SIM and os.path.exists(SIM), "DETPROXY_SIM_BIN not built")
    def test_framework_url_reads_the_colocated_server(self):
        d = f"{self.tmp}/m"
        make_tree(d)
        for flavor, want in (("vllm", "vllm"), ("tgi", "tgi"), ("sglang", "sglang"),
                             ("llamacpp", "llamacpp")):
            sim = subprocess.Popen([SIM, "--listen", "127.0.0.1:0", "--flavor", flavor,
                                    "--framework-version", "9.9.9"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                port = json.loads(sim.stderr.readline().decode())["port"]
                # A read that fails on a loaded box is retried at the next refresh: soon.
                with Agent(d, framework=None,
                           extra=["--framework-url", f"http://127.0.0.1:{port}",
                                  "--framework-refresh-ms", "200"]) as a:
                    deadline = time.time() + 10 * SLOW
                    fw = None
                    while time.time() < deadline:
                        p = payload_of(a.get("/attestation?nonce=n")[1])
                        fw = p["framework"]
                        # The engine fingerprint follows from the probe completion, when the
                        # engine puts one on responses (llama.cpp: its build; TGI: version-label).
                        if fw["name"] and (flavor in ("vllm", "sglang") or
                                           p.get("engine_fingerprint")):
                            break
                        time.sleep(0.05)
                    self.assertEqual(fw["name"], want, flavor)
                    self.assertTrue(fw["version"].startswith("9.9.9"), fw)
                    if flavor == "llamacpp":
                        self.assertEqual(p["engine_fingerprint"], fw["version"], p)
                    elif flavor == "tgi":
                        self.assertTrue(p["engine_fingerprint"].startswith("9.9.9-"), p)
                    else:
                        self.assertNotIn("engine_fingerprint", p)
            finally:
                sim.kill()
                sim.wait()
                sim.stderr.close()

    def test_framework_url_unreachable_is_503_naming_it(self):
        # A dead engine is not an identity: the agent vouches for nothing and says why.
        d = f"{self.tmp}/m"
        make_tree(d)
        with Agent(d, framework=None, extra=["--framework-url", "http://127.0.0.1:9"],
                   ready=False) as a:
            deadline = time.time() + 10 * SLOW
            while time.time() < deadline:
                st, body = a.get("/attestation?nonce=n")
                if st == 503 and "framework_unreachable" in body:
                    break
                time.sleep(0.05)
            self.assertEqual(st, 503, body)
            err = json.loads(body)["error"]
            self.assertEqual(err["code"], "framework_unreachable")
            self.assertEqual(err["message"], "framework at http://127.0.0.1:9: connection refused")


if __name__ == "__main__":
    if not BIN:
        print("DETPROXY_BIN not set", file=sys.stderr)
        sys.exit(2)
    unittest.main(verbosity=2)
