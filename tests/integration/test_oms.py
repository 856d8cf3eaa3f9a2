"""OpenSSF Model Signing (docs/attestation.md §9): `detproxy attest oms verify` against bundles made here with
the openssl CLI (omsutil.py, independent of the C code), and the publisher -> agent -> proxy
chain: the proxy admits a replica only when its agent verified a bundle from the pinned signer.
"""
import base64
import json
import os
import shutil
import subprocess
import tempfile

import omsutil as oms
from harness import (DETPROXY_BIN, SOURCE_DIR, get_json, http, poll_until, post_json,
                     run_cmd, run_tests, start_process, start_sim)
from proxyutil import pool, start_proxy

TMP = tempfile.mkdtemp(prefix="detproxy-oms-")
MODEL = "org/signed-model"
KEYS = {}


def key(name, curve="prime256v1"):
    if name not in KEYS:
        KEYS[name] = oms.ec_key(TMP, name, curve)
    return KEYS[name]


def model_dir(name, extra=None):
    """A small model: config, two weight files (one in a subdirectory), a dotfile (signed: OMS
    includes dot-names), and a .git directory and .gitignore (never model files)."""
    d = os.path.join(TMP, name)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(os.path.join(d, "shards"))
    os.makedirs(os.path.join(d, ".git", "objects"))
    files = {"config.json": b'{"arch": "toy"}', "tokenizer.json": b'{"v": 1}',
             "shards/model-00001.safetensors": bytes(range(256)) * 40,  # 10240 bytes
             ".hf-metadata": b"revision=abc", ".git/HEAD": b"ref: main",
             ".gitignore": b"*.tmp"}
    files.update(extra or {})
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "wb") as f:
            f.write(data)
    return d


def verify(d, bundle, pubkey=None, ca=None, json_out=False):
    argv = [DETPROXY_BIN, "attest", "oms", "verify", "--model-dir", d, "--bundle", bundle]
    if pubkey:
        argv += ["--pubkey", pubkey]
    if ca:
        argv += ["--ca-file", ca]
    if json_out:
        argv.append("--json")
    rc, out, err = run_cmd(argv)
    return rc, out.splitlines(), err


def signed(d, name="model.sig", signer=None, inside=True, **kw):
    """Sign d; the bundle goes inside d (and is then excluded) or next to it."""
    path = os.path.join(d if inside else TMP, name)
    exclude = [name] if inside else []
    chain = kw.pop("chain", None)
    stmt = oms.statement(d, exclude=exclude, **kw)
    oms.write_bundle(path, stmt, signer or key("publisher"), chain=chain)
    return path


def assert_verified(d, bundle, pub=None, **kw):
    rc, lines, err = verify(d, bundle, pub or key("publisher").pub, **kw)
    assert rc == 0, (lines, err)
    assert lines[0].startswith("verified: method "), lines
    return lines[0]


def assert_findings(d, bundle, want, pub=None, **kw):
    rc, lines, err = verify(d, bundle, pub or key("publisher").pub, **kw)
    assert rc == 1, (rc, lines, err)
    assert lines == want, "got %r want %r" % (lines, want)


# ---- oms verify: the happy paths ---------------------------------------------------------------

def test_files_bundle_verifies_and_names_the_signer():
    d = model_dir("files")
    b = signed(d)
    pub = key("publisher")
    line = assert_verified(d, b)
    stmt = oms.statement(d, exclude=["model.sig"])
    assert line == ("verified: method key, signer %s, root_digest %s, 4 resources"
                    % (pub.fingerprint(), stmt["subject"][0]["digest"]["sha256"])), line
    rc, lines, _ = verify(d, b, pub.pub, json_out=True)
    doc = json.loads(lines[0])
    assert rc == 0 and doc == {"verified": True, "method": "key", "signer": pub.fingerprint(),
                               "root_digest": stmt["subject"][0]["digest"]["sha256"],
                               "resources": 4, "findings": []}, doc


def test_p384_and_p521_keys():
    for curve, md in (("secp384r1", "sha384"), ("secp521r1", "sha512")):
        d = model_dir("curve-" + curve)
        k = key("pub-" + curve, curve)
        path = os.path.join(TMP, curve + ".sig")
        oms.write_bundle(path, oms.statement(d), k, md=md)
        assert_verified(d, path, k.pub)


def test_blake2b_hash_type():
    d = model_dir("blake2b")
    assert_verified(d, signed(d, hash_type="blake2b"))


def test_shards_with_a_short_last_shard():
    d = model_dir("shards")
    b = signed(d, shard_size=4096)  # 10240 = 4096 + 4096 + 2048
    assert_verified(d, b)
    with open(os.path.join(d, "shards/model-00001.safetensors"), "r+b") as f:
        f.seek(10000)
        f.write(b"\xff")
    rc, lines, _ = verify(d, b, key("publisher").pub)
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("changed file: shards/model-00001.safetensors (bytes 8192..10240:"
                               " sha256 "), lines
    with open(os.path.join(d, "shards/model-00001.safetensors"), "r+b") as f:
        f.truncate(9000)
    assert_findings(d, b, ["changed file: shards/model-00001.safetensors (size 9000, signed "
                           "10240)"])


def test_certificate_method_against_a_ca_file():
    ca_key, ca_crt = os.path.join(TMP, "ca.key"), os.path.join(TMP, "ca.crt")
    leaf_key, leaf_csr = os.path.join(TMP, "leaf.key"), os.path.join(TMP, "leaf.csr")
    leaf_crt = os.path.join(TMP, "leaf.crt")
    run = lambda *a: subprocess.run(a, check=True, capture_output=True)
    run("openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", ca_key)
    run("openssl", "req", "-x509", "-new", "-key", ca_key, "-subj", "/CN=publisher-ca",
        "-days", "30", "-out", ca_crt, "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign")
    run("openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", leaf_key)
    run("openssl", "req", "-new", "-key", leaf_key, "-subj", "/CN=publisher", "-out", leaf_csr)
    ext = os.path.join(TMP, "leaf.ext")
    with open(ext, "w") as f:
        f.write("keyUsage=critical,digitalSignature\nextendedKeyUsage=codeSigning\n")
    run("openssl", "x509", "-req", "-in", leaf_csr, "-CA", ca_crt, "-CAkey", ca_key,
        "-CAcreateserial", "-days", "10", "-extfile", ext, "-out", leaf_crt)
    d = model_dir("cert")
    b = os.path.join(TMP, "cert.sig")
    oms.write_bundle(b, oms.statement(d), leaf_key, chain=[leaf_crt, ca_crt])
    rc, lines, err = verify(d, b, ca=ca_crt)
    assert rc == 0, (lines, err)
    leaf_fp = oms.Key(None, os.path.join(TMP, "leaf.pub"))
    run("openssl", "x509", "-in", leaf_crt, "-pubkey", "-noout", "-out", leaf_fp.pub)
    assert "method certificate, signer %s," % leaf_fp.fingerprint() in lines[0], lines
    # Another CA: the chain does not validate.
    other = os.path.join(TMP, "other-ca.crt")
    run("openssl", "req", "-x509", "-new", "-key", leaf_key, "-subj", "/CN=other", "-days", "3",
        "-out", other)
    rc, lines, _ = verify(d, b, ca=other)
    assert rc == 1 and lines[0].startswith("certificate: the signing certificate does not chain "
                                           "to --ca-file ("), lines
    # A key-method flag for a certificate bundle says what is missing.
    assert_findings(d, b, ["signature: the bundle is signed with a certificate (method "
                           "certificate): give --ca-file"])
    # RFC 5280: keyUsage must allow digitalSignature and, when an extendedKeyUsage is present,
    # it must include codeSigning. A TLS server or client certificate the same CA issued, a CA
    # certificate, or a code-signing EKU without the key usage cannot sign a model.
    refused = {
        "tls-server": ("keyUsage=critical,digitalSignature,keyEncipherment\n"
                       "extendedKeyUsage=serverAuth\n",
                       "extendedKeyUsage has no codeSigning (a TLS or other certificate cannot "
                       "sign)"),
        "tls-client": ("keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n",
                       "extendedKeyUsage has no codeSigning (a TLS or other certificate cannot "
                       "sign)"),
        "certsign": ("keyUsage=critical,keyCertSign\nextendedKeyUsage=codeSigning\n",
                     "keyUsage has no digitalSignature"),
        "subca": ("basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign\n",
                  "keyUsage has no digitalSignature"),
        "eku-only": ("extendedKeyUsage=codeSigning\n",
                     "no keyUsage extension (a signing certificate needs digitalSignature)"),
        "bare": ("subjectAltName=DNS:publisher\n",
                 "no keyUsage extension (a signing certificate needs digitalSignature)"),
    }
    accepted = {"ku-only": "keyUsage=critical,digitalSignature\n",
                "ku-and-eku": "keyUsage=digitalSignature\nextendedKeyUsage=codeSigning,"
                              "emailProtection\n"}
    cases = [(n, e, why) for n, (e, why) in refused.items()] + \
        [(n, e, None) for n, e in accepted.items()]
    for name, exts, why in cases:
        crt = os.path.join(TMP, "leaf-%s.crt" % name)
        with open(ext, "w") as f:
            f.write(exts)
        run("openssl", "x509", "-req", "-in", leaf_csr, "-CA", ca_crt, "-CAkey", ca_key,
            "-CAcreateserial", "-days", "10", "-extfile", ext, "-out", crt)
        bb = os.path.join(TMP, "cert-%s.sig" % name)
        oms.write_bundle(bb, oms.statement(d), leaf_key, chain=[crt, ca_crt])
        rc, lines, err = verify(d, bb, ca=ca_crt)
        if why is None:
            assert rc == 0, (name, lines, err)
        else:
            assert rc == 1 and lines == ["certificate: the signing certificate is not for "
                                         "signing: " + why], (name, lines)


# ---- oms verify: tampering -------------------------------------------------------------------

def test_one_byte_of_one_file():
    d = model_dir("byte")
    b = signed(d)
    with open(os.path.join(d, "tokenizer.json"), "r+b") as f:
        f.write(b"[")
    rc, lines, _ = verify(d, b, key("publisher").pub)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith(
        "changed file: tokenizer.json (sha256 "), lines


def test_renamed_extra_and_missing_files_are_each_named():
    d = model_dir("renamed")
    b = signed(d)
    os.rename(os.path.join(d, "config.json"), os.path.join(d, "config.json.bak"))
    with open(os.path.join(d, "shards", "evil.py"), "w") as f:
        f.write("import os")
    assert_findings(d, b, ["extra file (not in the bundle): config.json.bak",
                           "extra file (not in the bundle): shards/evil.py",
                           "missing file: config.json"])


def test_ignored_paths_are_accepted():
    d = model_dir("ignored", {"cache/x.bin": b"scratch"})
    b = signed(d, ignore=["cache"])
    # New files under the recorded ignore path and under the default exclusions: still verified.
    for rel in ("cache/y.bin", ".git/objects/ab", ".github/workflows/ci.yml", ".gitattributes"):
        os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
        with open(os.path.join(d, rel), "w") as f:
            f.write("new")
    assert_verified(d, b)
    # Exact relative paths only: "cache" does not cover shards/cache.
    os.makedirs(os.path.join(d, "shards", "cache"))
    with open(os.path.join(d, "shards", "cache", "z"), "w") as f:
        f.write("z")
    assert_findings(d, b, ["extra file (not in the bundle): shards/cache/z"])


def test_bundle_signed_by_another_key():
    d = model_dir("otherkey")
    b = signed(d, signer=key("mallory"))
    pub = key("publisher")
    assert_findings(d, b, ["signature: the bundle names key %s.. (publicKey.hint), --pubkey is "
                           "%s.." % (key("mallory").hint()[:8], pub.fingerprint()[:8])])
    # The right hint, the wrong signer.
    stmt = oms.statement(d, exclude=["model.sig"])
    oms.write_bundle(b, stmt, key("mallory"), hint=pub.hint())
    assert_findings(d, b, ["signature: does not verify with the --pubkey key (payload or "
                           "signature altered, or another signer)"])


def test_payload_edited_after_signing():
    d = model_dir("edited")
    b = signed(d)
    with open(os.path.join(d, "config.json"), "wb") as f:
        f.write(b'{"arch": "evil"}')
    doc = json.load(open(b))
    stmt = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
    for r in stmt["predicate"]["resources"]:
        if r["name"] == "config.json":
            r["digest"] = __import__("hashlib").sha256(b'{"arch": "evil"}').hexdigest()
    stmt["subject"][0]["digest"]["sha256"] = oms.root_digest(stmt["predicate"]["resources"])
    doc["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(stmt).encode()).decode()
    with open(b, "w") as f:
        json.dump(doc, f)
    assert_findings(d, b, ["signature: does not verify with the --pubkey key (payload or "
                           "signature altered, or another signer)"])


def test_special_files_are_not_part_of_a_verified_model():
    # A FIFO (or device) an engine would read is nothing the bundle can vouch for.
    d = model_dir("fifo")
    b = signed(d)
    assert_verified(d, b)
    os.mkfifo(os.path.join(d, "shards", "adapter_model.safetensors"))
    assert_findings(d, b, ["not a regular file (a FIFO, socket or device cannot be signed): "
                           "shards/adapter_model.safetensors"])


def test_symlinks_follow_the_recorded_policy():
    d = model_dir("links")
    os.symlink("config.json", os.path.join(d, "config-link.json"))
    b = signed(d)  # allow_symlinks false: the signer skipped the link
    assert_findings(d, b, ["symlink not allowed (the bundle records allow_symlinks false): "
                           "config-link.json"])
    # allow_symlinks true: the link is signed under its own name with the target's content.
    stmt = oms.statement(d, exclude=["model.sig"], allow_symlinks=True)
    res = stmt["predicate"]["resources"]
    res.append(dict(next(r for r in res if r["name"] == "config.json"), name="config-link.json"))
    res.sort(key=lambda r: r["name"].encode())
    stmt = oms.finish(res, allow_symlinks=True)
    oms.write_bundle(b, stmt, key("publisher"))
    assert_verified(d, b)


def test_schema_errors_are_clear():
    d = model_dir("schema")
    b = os.path.join(TMP, "schema.sig")
    cases = [
        (lambda s: s.update(predicateType="https://example.com/other/v1"),
         'statement.predicateType: expected "https://model_signing/signature/v1.0", got '
         '"https://example.com/other/v1"'),
        (lambda s: s["predicate"].update(resources=[]),
         "predicate.resources: empty (a model has at least one file)"),
        (lambda s: s["predicate"]["resources"].reverse(),
         'predicate.resources[1].name "shards/model-00001.safetensors": resources are not '
         'sorted by name (or repeat one): it follows "tokenizer.json"'),
        (lambda s: s["predicate"]["resources"][0].update(name="../etc/passwd"),
         'predicate.resources[0].name "../etc/passwd": has a ".." component (parent '
         'traversal)'),
        (lambda s: s["predicate"]["resources"][0].update(digest="abcd"),
         "predicate.resources[0].digest: 4 hex digits, sha256 gives 64"),
    ]
    for edit, want in cases:
        stmt = oms.statement(d)
        edit(stmt)
        oms.write_bundle(b, stmt, key("publisher"))
        assert_findings(d, b, [want])


def test_published_vectors_through_the_command_line():
    """The spec's vectors (tests/unit/data/oms): the sigstore one needs a trusted root (then its
    signature verifies and the files are what differs); the invalid ones name what is wrong."""
    v = os.path.join(SOURCE_DIR, "tests", "unit", "data", "oms", "v1.0")
    d = model_dir("vectors", {"signme-1": b"a", "signme-2": b"b"})
    sig = os.path.join(v, "valid", "sigstore.bundle.json")
    rc, lines, _ = verify(d, sig, key("publisher").pub)
    assert rc == 1 and lines == ["signature: the bundle is keyless (method sigstore): give "
                                 "--trusted-root, --identity and --issuer"], lines
    root = os.path.join(SOURCE_DIR, "tests", "fixtures", "sigstore", "trusted_root.json")
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "oms", "verify", "--model-dir", d, "--bundle",
                            sig, "--trusted-root", root, "--identity", "stefanb@us.ibm.com",
                            "--issuer", "https://sigstore.verify.ibm.com/oauth2"])
    lines = out.splitlines()
    assert rc == 1 and "changed file: signme-1 (sha256 ca978112ca1bbdca.. signed " \
        "f6310066c7320497..)" in lines and not any(l.startswith("signature") for l in lines), (
        lines, err)
    rc, lines, _ = verify(d, os.path.join(v, "invalid", "missing-envelope.bundle.json"),
                          key("publisher").pub)
    assert rc == 1 and lines == ["bundle.dsseEnvelope: missing"], lines


def test_usage_and_unreadable_files():
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "oms", "verify", "--model-dir", TMP])
    assert rc == 2 and "are required" in err, err
    # Two trusts at once: which would judge the bundle? Refused, not one of them picked.
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "oms", "verify", "--model-dir", TMP,
                          "--bundle", "x", "--pubkey", "k.pem", "--ca-file", "ca.pem"])
    assert rc == 2 and "one: each is a trust of its own" in err, err
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "oms", "verify", "--model-dir", TMP,
                          "--bundle", "x", "--pubkey", os.path.join(TMP, "nope.pem")])
    assert rc == 2 and "--pubkey cannot read" in err, err
    rc, lines, _ = verify(TMP, os.path.join(TMP, "missing.sig"), key("publisher").pub)
    assert rc == 3 and lines[0].startswith("bundle: cannot read "), lines
    # A FIFO in the bundle's place must not hang the verifier.
    fifo = os.path.join(TMP, "fifo.sig")
    os.mkfifo(fifo)
    rc, lines, _ = verify(TMP, fifo, key("publisher").pub)
    assert rc == 3 and lines == ["bundle: cannot read %s: not a regular file" % fifo], lines


# ---- agent + proxy ---------------------------------------------------------------------------

def agent(d, bundle=None, pubkey=None, pipeline=None):
    argv = [DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0", "--model-dir", d,
            "--model", MODEL, "--framework", "vllm", "--framework-version", "0.6.3",
            "--watch-interval-ms", "100"]
    if pipeline:
        argv += ["--key", pipeline]
    if bundle:
        argv += ["--oms-bundle", bundle, "--oms-pubkey", pubkey or key("publisher").pub]
    a = start_process(argv, name="agent")
    if bundle:
        a.wait_log(lambda l: l.get("msg") in ("oms_verified", "oms_not_verified"))
    return a


def payload(a):
    r = http("GET", a.port, "/attestation?nonce=n1")
    assert r.status == 200, r
    env = json.loads(r.text)
    return json.loads(base64.b64decode(env["payload"]))


def oms_verified(a):
    """The agent's oms.verified, or None while it is re-hashing (503)."""
    r = http("GET", a.port, "/attestation?nonce=n2")
    if r.status != 200:
        return None
    return json.loads(base64.b64decode(json.loads(r.text)["payload"]))["oms"]["verified"]


def checkpoint(d):
    rc, out, err = run_cmd([DETPROXY_BIN, "attest", "hash", d])
    assert rc == 0, err
    return out.split()[0]


def test_agent_reports_what_it_verified():
    d = model_dir("agent-ok")
    b = signed(d)  # model.sig inside the directory: in the checkpoint, not in its own manifest
    a = agent(d, b)
    p = payload(a)
    root = json.load(open(b))
    stmt = json.loads(base64.b64decode(root["dsseEnvelope"]["payload"]))
    assert p["oms"] == {"verified": True, "signer": key("publisher").fingerprint(),
                        "root_digest": stmt["subject"][0]["digest"]["sha256"]}, p
    # A dot-name the checkpoint ignores but OMS covers: the agent re-verifies and says no.
    ckpt = p["checkpoint_sha256"]
    with open(os.path.join(d, ".hf-metadata"), "w") as f:
        f.write("revision=evil")
    poll_until(lambda: oms_verified(a) is False, what="oms re-verified")
    p = payload(a)
    assert p["checkpoint_sha256"] == ckpt and p["oms"] == {"verified": False, "signer": None,
                                                           "root_digest": None}, p
    line = a.wait_log("oms_not_verified")
    assert any(x.startswith("changed file: .hf-metadata") for x in line["findings"]), line
    a.stop()


def test_a_special_file_appearing_is_re_verified():
    d = model_dir("agent-fifo")
    b = signed(d, inside=False, name="agent-fifo.sig")
    a = agent(d, b)
    assert payload(a)["oms"]["verified"] is True
    start = len(a.logs)
    os.mkfifo(os.path.join(d, "adapter_model.safetensors"))
    poll_until(lambda: oms_verified(a) is False, what="fifo noticed")
    line = a.wait_log("oms_not_verified", start=start)
    assert line["findings"] == ["not a regular file (a FIFO, socket or device cannot be "
                                "signed): adapter_model.safetensors"], line
    # A FIFO in the bundle's place: reported, not a worker blocked for ever.
    os.unlink(os.path.join(d, "adapter_model.safetensors"))
    poll_until(lambda: oms_verified(a) is True, what="fifo gone")
    start = len(a.logs)
    os.mkfifo(b + ".fifo")
    os.rename(b + ".fifo", b)
    line = a.wait_log("oms_not_verified", start=start)
    assert line["findings"] == ["bundle: cannot read %s: not a regular file" % b], line
    a.stop()


def test_a_replaced_bundle_is_re_verified():
    d = model_dir("agent-rebundle")
    b = signed(d, inside=False, name="agent-rebundle.sig")
    a = agent(d, b)
    assert payload(a)["oms"]["verified"] is True
    start = len(a.logs)
    tmp = b + ".new"
    oms.write_bundle(tmp, oms.statement(d), key("mallory"))
    os.rename(tmp, b)  # the directory is untouched; only the bundle (outside it) changed
    poll_until(lambda: oms_verified(a) is False, what="bundle re-verified")
    line = a.wait_log("oms_not_verified", start=start)
    assert line["findings"][0].startswith("signature: the bundle names key "), line
    a.stop()


def test_checkpoint_and_bundle_must_describe_the_same_files():
    # notes.txt is in the checkpoint but under an OMS ignore path: the publisher did not sign it.
    d = model_dir("agent-cross", {"notes.txt": b"unsigned"})
    b = signed(d, inside=False, name="agent-cross.sig", ignore=["notes.txt"])
    assert_verified(d, b)  # OMS alone is satisfied
    a = agent(d, b)
    assert payload(a)["oms"]["verified"] is False
    line = a.wait_log("oms_not_verified")
    assert line["findings"] == ["checkpoint file notes.txt is not covered by the OMS bundle "
                                "(ignored or excluded there)"], line
    a.stop()


def test_proxy_admits_only_replicas_vouched_for_by_the_publisher():
    pipeline_key = os.path.join(TMP, "pipeline")
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", pipeline_key])
    assert rc == 0, err
    good = model_dir("px-good")
    ckpt = checkpoint(good)
    tampered = model_dir("px-tampered")
    b_good = signed(good, inside=False, name="px-good.sig")
    b_tampered = signed(tampered, inside=False, name="px-tampered.sig")
    with open(os.path.join(tampered, ".hf-metadata"), "w") as f:  # checkpoint unchanged
        f.write("revision=evil")
    assert checkpoint(tampered) == ckpt
    b_other = signed(good, inside=False, name="px-other.sig", signer=key("mallory"))
    agents = [agent(good, b_good, pipeline=pipeline_key + ".key.pem"),           # r1 admitted
              agent(good, b_other, key("mallory").pub, pipeline_key + ".key.pem"),  # r2 signer
              agent(tampered, b_tampered, pipeline=pipeline_key + ".key.pem"),    # r3 not verified
              agent(good, pipeline=pipeline_key + ".key.pem")]                    # r4 no bundle
    sims = [start_sim("--model", MODEL) for _ in agents]
    man = {"model": MODEL, "checkpoint_sha256": ckpt,
           "framework": {"name": "vllm", "version": "0.6.3"},
           "oms": {"signer": key("publisher").fingerprint()}}
    p = pool("p", [MODEL], sims, manifest=man)
    for r, a in zip(p["replicas"], agents):
        r["attest"] = {"source": "agent", "url": "http://127.0.0.1:%d/attestation" % a.port}
    px = start_proxy(pools=[p], attestation={"interval_ms": 300, "timeout_ms": 1000,
                                             "require_signature": True,
                                             "trusted_keys": [pipeline_key + ".pub.pem"]})

    def reps():
        return {r["name"]: r for r in get_json(px.admin_port, "/admin/replicas")["replicas"]}
    poll_until(lambda: all(r["state"] in ("admitted", "rejected") for r in reps().values()),
               what="every replica decided")
    r = reps()
    assert r["r1"]["state"] == "admitted", r["r1"]
    assert r["r1"]["attestation"]["report"]["oms"]["signer"] == key("publisher").fingerprint()
    assert r["r2"]["state"] == "rejected" and r["r2"]["reasons"] == [
        "oms.signer mismatch: got %s.. want %s.." % (key("mallory").fingerprint()[:8],
                                                   key("publisher").fingerprint()[:8])], r["r2"]
    assert r["r3"]["state"] == "rejected" and r["r3"]["reasons"] == [
        "oms bundle not verified by the agent (see its log)"], r["r3"]
    assert r["r4"]["state"] == "rejected" and r["r4"]["reasons"] == [
        "oms unattested (agent did not report it: start it with --oms-bundle)"], r["r4"]
    for _ in range(10):
        resp = post_json(px.port, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                      "max_tokens": 1})
        assert resp.status == 200 and resp.headers["x-detproxy-replica"] == "r1", resp
    # The admitted replica's weights change: its agent no longer vouches, the proxy ejects it.
    with open(os.path.join(good, "shards", "model-00001.safetensors"), "r+b") as f:
        f.write(b"tampered")
    poll_until(lambda: reps()["r1"]["state"] != "admitted", what="r1 ejected")
    px.stop()
    for a in agents:
        a.stop()


def test_manifest_oms_key_is_checked():
    from proxyutil import write_config
    cfg = {"listen": "127.0.0.1:0", "pools": [{"name": "p", "models": [MODEL], "replicas": [
        {"name": "r1", "url": "http://127.0.0.1:1",
         "attest": {"source": "agent", "url": "http://127.0.0.1:2/attestation"}}],
        "manifest": {"oms": {"signer": "ABC", "extra": 1}}}]}
    rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg)])
    text = out + err
    assert rc != 0, text
    assert "pools[0].manifest.oms.signer: must be 64 lowercase hex digits" in text, text
    assert "pools[0].manifest.oms.extra" in text, text


if __name__ == "__main__":
    run_tests(globals())
