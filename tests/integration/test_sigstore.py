"""Keyless OMS bundles (docs/attestation.md §9, "Keyless bundles"): the bundles sigstore/model-
transparency publishes as test vectors verify offline against the public-good trusted root
(tests/fixtures/sigstore, see its README), with the identity and issuer its own test scripts
pass; tampered copies fail at the step that catches them; --ignore-path does what
`model_signing verify --ignore-paths` does.
"""
import base64
import copy
import json
import os
import shutil
import tempfile

import omsutil as oms
from harness import (DETPROXY_BIN, SOURCE_DIR, get_json, http, poll_until, run_cmd, run_tests,
                     start_process, start_sim)
from proxyutil import pool, start_proxy

FIX = os.path.join(SOURCE_DIR, "tests", "fixtures", "sigstore")
ROOT = os.path.join(FIX, "trusted_root.json")
IDENTITY = "stefanb@us.ibm.com"
ISSUER = "https://sigstore.verify.ibm.com/oauth2"
TMP = tempfile.mkdtemp(prefix="detproxy-sigstore-")
KEYLESS = ["v1.0.0-sigstore", "v1.0.1-sigstore", "v1.1.0-sigstore"]


def verify(d, bundle=None, root=ROOT, identity=IDENTITY, issuer=ISSUER, ignore=(), extra=(),
           cwd=None):
    argv = [DETPROXY_BIN, "attest", "oms", "verify", "--model-dir", d, "--bundle",
            bundle or os.path.join(d, "model.sig")]
    if root:
        argv += ["--trusted-root", root, "--identity", identity, "--issuer", issuer]
    for p in ignore:
        argv += ["--ignore-path", p]
    argv += list(extra)
    if cwd:
        old = os.getcwd()
        os.chdir(cwd)
    try:
        rc, out, err = run_cmd(argv)
    finally:
        if cwd:
            os.chdir(old)
    return rc, out.splitlines(), err


def copy_vector(name, tag):
    d = os.path.join(TMP, "%s-%s" % (name, tag))
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(os.path.join(FIX, name), d)
    return d


def load(d):
    with open(os.path.join(d, "model.sig")) as f:
        return json.load(f)


def store(d, bundle):
    with open(os.path.join(d, "model.sig"), "w") as f:
        json.dump(bundle, f)


def flip_b64(s, at=10):
    """s with one byte of its decoded value changed, re-encoded."""
    raw = bytearray(base64.b64decode(s))
    raw[at % len(raw)] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


def root_copy(edit):
    with open(ROOT) as f:
        r = json.load(f)
    edit(r)
    p = os.path.join(TMP, "root-%d.json" % len(os.listdir(TMP)))
    with open(p, "w") as f:
        json.dump(r, f)
    return p


def tampered(name, edit):
    """A copy of the vector whose bundle edit(bundle) changed; its verification lines."""
    d = copy_vector(name, "t%d" % len(os.listdir(TMP)))
    b = load(d)
    edit(b)
    store(d, b)
    rc, lines, err = verify(d, ignore=[os.path.join(d, "ignore-me")])
    assert rc == 1, (rc, lines, err)
    assert len(lines) == 1, lines
    return lines[0]


def entry(b):
    return b["verificationMaterial"]["tlogEntries"][0]


# ---- the published vectors ---------------------------------------------------------------------

def test_every_published_keyless_bundle_verifies_offline():
    for name in KEYLESS:
        d = os.path.join(FIX, name)
        ignore = [os.path.join(d, "ignore-me")] if os.path.exists(os.path.join(d,
                                                                                "ignore-me")) else []
        rc, lines, err = verify(d, ignore=ignore)
        assert rc == 0, (name, lines, err)
        assert lines[0].startswith("verified: method sigstore, identity %s, issuer %s, signed 20"
                                   % (IDENTITY, ISSUER)), lines
        rc, out, err = verify(d, ignore=ignore, extra=["--json"])
        j = json.loads("\n".join(out))
        assert j["verified"] and j["method"] == "sigstore" and j["signed_at"] > 1700000000, j
        assert j["identity"] == IDENTITY and j["issuer"] == ISSUER, j


def test_the_signing_time_is_the_logs_and_the_timestamp_authoritys():
    # v1.1.0 carries an RFC 3161 timestamp besides the SET: both are checked, the log's shown.
    rc, out, _ = verify(os.path.join(FIX, "v1.1.0-sigstore"), extra=["--json"],
                        ignore=[os.path.join(FIX, "v1.1.0-sigstore", "ignore-me")])
    assert rc == 0 and json.loads("\n".join(out))["signed_at"] == 1760062340, out


def test_ignored_paths_model_signing_1_0_did_not_record():
    # 1.0.x bundles signed with --ignore-paths do not list ignore-me: it is an extra file unless
    # the verifier is told to ignore it, as the vector's test script does (both ways it does).
    d = os.path.join(FIX, "v1.0.1-sigstore")
    rc, lines, _ = verify(d)
    assert rc == 1 and lines == ["extra file (not in the bundle): ignore-me"], lines
    rc, lines, err = verify(".", bundle="model.sig", ignore=["ignore-me"], cwd=d)
    assert rc == 0, (lines, err)
    rc, lines, err = verify("v1.0.1-sigstore/", bundle="v1.0.1-sigstore/model.sig",
                            ignore=["./v1.0.1-sigstore/ignore-me"], cwd=FIX)
    assert rc == 0, (lines, err)
    # v1.1.0 records it: no flag needed.
    rc, lines, err = verify(os.path.join(FIX, "v1.1.0-sigstore"))
    assert rc == 0, (lines, err)


def test_the_certificate_vectors_with_their_ignore_path():
    ca = os.path.join(FIX, "certificate-ca", "ca-cert.pem")
    for name in ["v1.0.1-certificate", "v1.1.0-certificate"]:
        d = os.path.join(FIX, name)
        rc, lines, err = verify(d, root=None, ignore=[os.path.join(d, "ignore-me")],
                                extra=["--ca-file", ca])
        assert rc == 0 and lines[0].startswith("verified: method certificate, "), (name, lines,
                                                                                   err)
    rc, lines, _ = verify(os.path.join(FIX, "v1.0.1-certificate"), root=None,
                          extra=["--ca-file", ca])
    assert rc == 1 and lines == ["extra file (not in the bundle): ignore-me"], lines


def test_ignore_path_must_lie_in_the_model_directory():
    d = os.path.join(FIX, "v1.0.1-sigstore")
    for p in [os.path.join(FIX, "trusted_root.json"), "/etc/passwd", d, d + "/..", "../x"]:
        rc, lines, err = verify(d, ignore=[p])
        assert rc == 2 and "--ignore-path" in err and "not inside the model directory" in err, (
            p, rc, err)


# ---- what the verifier must be given -----------------------------------------------------------

def test_flags():
    d = os.path.join(FIX, "v1.0.1-sigstore")
    rc, _, err = verify(d, identity="x" * 513)
    assert rc == 2 and "--trusted-root identity: expected 1 to 512 bytes" in err, err
    rc, _, err = verify(d, issuer="https://a\x1b[2Jb")
    assert rc == 2 and "--trusted-root issuer: a control character" in err, err
    argv = [DETPROXY_BIN, "attest", "oms", "verify", "--model-dir", d, "--bundle",
            os.path.join(d, "model.sig"), "--trusted-root", ROOT, "--identity", IDENTITY]
    rc, _, err = run_cmd(argv)
    assert rc == 2 and "--trusted-root, --identity and --issuer go together" in err, err
    rc, _, err = verify(d, root=os.path.join(d, "model.sig"))
    assert rc == 2 and "mediaType: expected application/vnd.dev.sigstore.trustedroot" in err, err
    # A keyless bundle with a key-method flag says what is missing.
    ca = os.path.join(FIX, "certificate-ca", "ca-cert.pem")
    rc, lines, _ = verify(d, root=None, extra=["--ca-file", ca])
    assert rc == 1 and lines == ["signature: the bundle is keyless (method sigstore): give "
                                 "--trusted-root, --identity and --issuer"], lines


# ---- tampering: each fails at the step that catches it -----------------------------------------

def test_a_changed_model_file():
    d = copy_vector("v1.0.1-sigstore", "file")
    with open(os.path.join(d, "signme-1"), "ab") as f:
        f.write(b"!")
    rc, lines, _ = verify(d, ignore=[os.path.join(d, "ignore-me")])
    assert rc == 1 and len(lines) == 1 and lines[0].startswith("changed file: signme-1 ("), lines


def test_identity_and_issuer_flags():
    d = os.path.join(FIX, "v1.0.1-sigstore")
    ig = [os.path.join(d, "ignore-me")]
    rc, lines, _ = verify(d, identity="mallory@example.com", ignore=ig)
    assert rc == 1 and lines == ["sigstore identity: the certificate is for stefanb@us.ibm.com, "
                                 "not mallory@example.com"], lines
    # A prefix or a longer string is not the identity.
    rc, lines, _ = verify(d, identity="stefanb@us.ibm.co", ignore=ig)
    assert rc == 1 and lines[0].startswith("sigstore identity: "), lines
    rc, lines, _ = verify(d, issuer="https://accounts.google.com", ignore=ig)
    assert rc == 1 and lines == ["sigstore issuer: the certificate's OIDC issuer is "
                                 "https://sigstore.verify.ibm.com/oauth2, not "
                                 "https://accounts.google.com"], lines


def test_the_dsse_signature():
    def edit(b):
        s = b["dsseEnvelope"]["signatures"][0]
        s["sig"] = flip_b64(s["sig"], at=40)
    assert tampered("v1.0.1-sigstore", edit) == (
        "signature: does not verify with the signing certificate's key (payload or signature "
        "altered, or another signer)")
    # v1.1.0's RFC 3161 timestamp is over the signature: it catches it first.
    assert tampered("v1.1.0-sigstore", edit) == (
        "sigstore timestamp: does not verify with a timestamp authority of the trusted root "
        "(altered, or not over this signature)")


def test_the_certificate():
    def edit(b):
        c = b["verificationMaterial"]["certificate"]
        c["rawBytes"] = flip_b64(c["rawBytes"], at=-20)  # inside its signature
    line = tampered("v1.0.1-sigstore", edit)
    assert line.startswith("sigstore certificate chain: the certificate does not chain to a "
                           "Fulcio CA of the trusted root at 2025-10-07T15:33:48Z ("), line

    # Another genuine Fulcio certificate (v1.0.0's) was not valid when this entry was logged.
    other = load(os.path.join(FIX, "v1.0.0-sigstore"))["verificationMaterial"]["certificate"]

    def swap(b):
        b["verificationMaterial"]["certificate"] = copy.deepcopy(other)
    line = tampered("v1.0.1-sigstore", swap)
    assert line == ("sigstore certificate chain: the certificate does not chain to a Fulcio CA "
                    "of the trusted root at 2025-10-07T15:33:48Z (certificate has expired)"), line


def test_the_inclusion_proof_and_checkpoint():
    def edit_hash(b):
        p = entry(b)["inclusionProof"]
        p["hashes"][3] = flip_b64(p["hashes"][3])
    assert tampered("v1.0.1-sigstore", edit_hash) == (
        "sigstore inclusion proof: the entry's path does not lead to rootHash (the entry or the "
        "proof was altered)")

    def drop_hash(b):
        entry(b)["inclusionProof"]["hashes"].pop()
    assert tampered("v1.0.1-sigstore", drop_hash).startswith(
        "sigstore inclusion proof: 20 hashes, a leaf at 467035550 of 467035599 needs 21")

    def edit_note(b):
        cp = entry(b)["inclusionProof"]["checkpoint"]
        cp["envelope"] = cp["envelope"].replace("rekor.sigstore.dev - ", "rekor.sigstore.dev + ",
                                                1)
    assert tampered("v1.0.1-sigstore", edit_note) == (
        "sigstore checkpoint: the signature by the Rekor key does not verify (the checkpoint was "
        "altered)")

    def other_root(b):
        # A checkpoint that does not name the proof's root.
        p = entry(b)["inclusionProof"]
        other = entry(load(os.path.join(FIX, "v1.1.0-sigstore")))["inclusionProof"]
        p["checkpoint"] = copy.deepcopy(other["checkpoint"])
    assert tampered("v1.0.1-sigstore", other_root).startswith(
        "sigstore checkpoint: it is for tree size 476246825 and another root"), None


def test_the_signed_entry_timestamp():
    def edit(b):
        ip = entry(b)["inclusionPromise"]
        ip["signedEntryTimestamp"] = flip_b64(ip["signedEntryTimestamp"], at=20)
    assert tampered("v1.0.1-sigstore", edit) == (
        "sigstore signed entry timestamp: does not verify with the Rekor key (the entry, its "
        "time or its index was altered)")

    def move_time(b):
        # An earlier integratedTime would put the signature inside another certificate's life.
        entry(b)["integratedTime"] = str(int(entry(b)["integratedTime"]) - 60)
    assert tampered("v1.0.1-sigstore", move_time).startswith(
        "sigstore signed entry timestamp: does not verify")

    def drop(b):
        del entry(b)["inclusionPromise"]
    assert tampered("v1.0.1-sigstore", drop) == (
        "sigstore signing time: neither a signed entry timestamp nor an RFC 3161 timestamp")


def test_the_log_entry_body():
    def edit(b):
        e = entry(b)
        body = json.loads(base64.b64decode(e["canonicalizedBody"]))
        body["spec"]["payloadHash"]["value"] = "0" * 64
        e["canonicalizedBody"] = base64.b64encode(json.dumps(body).encode()).decode()
    # The SET covers the body: altering it fails there first.
    assert tampered("v1.0.1-sigstore", edit).startswith(
        "sigstore signed entry timestamp: does not verify")


def test_a_trusted_root_without_the_ca_or_the_logs():
    d = os.path.join(FIX, "v1.0.1-sigstore")
    ig = [os.path.join(d, "ignore-me")]

    def no_ca(r):
        r["certificateAuthorities"] = r["certificateAuthorities"][:1]  # the 2021-2022 CA only
    rc, lines, _ = verify(d, root=root_copy(no_ca), ignore=ig)
    assert rc == 1 and lines == ["sigstore certificate chain: no Fulcio CA of the trusted root is "
                                 "valid at the signing time 2025-10-07T15:33:48Z"], lines

    def other_ca(r):
        # The current CA's validity shortened to before the signature.
        r["certificateAuthorities"][1]["validFor"]["end"] = "2025-01-01T00:00:00Z"
    rc, lines, _ = verify(d, root=root_copy(other_ca), ignore=ig)
    assert rc == 1 and lines[0].startswith("sigstore certificate chain: no Fulcio CA"), lines

    def no_rekor(r):
        r["tlogs"] = r["tlogs"][1:]
    rc, lines, _ = verify(d, root=root_copy(no_rekor), ignore=ig)
    assert rc == 1 and lines == ["sigstore tlog entry: logId is not a Rekor log of the trusted "
                                 "root"], lines

    def no_ctlog(r):
        r["ctlogs"] = r["ctlogs"][:1]
    rc, lines, _ = verify(d, root=root_copy(no_ctlog), ignore=ig)
    assert rc == 1 and lines == ["sigstore SCT: no SCT is from a CT log of the trusted root"], lines

    def wrong_ct_key(r):
        # The 2022 log's id with the test log's key: the SCT cannot verify.
        r["ctlogs"][1]["publicKey"]["rawBytes"] = r["ctlogs"][0]["publicKey"]["rawBytes"]
    rc, lines, _ = verify(d, root=root_copy(wrong_ct_key), ignore=ig)
    assert rc == 1 and lines == ["sigstore SCT: the SCT's signature does not verify (the "
                                 "certificate was altered, or the SCT is not for it)"], lines

    def wrong_rekor_key(r):
        # The Rekor log's id with another key (the 2022 CT log's, also P-256).
        r["tlogs"][0]["publicKey"]["rawBytes"] = r["ctlogs"][1]["publicKey"]["rawBytes"]
    rc, lines, _ = verify(d, root=root_copy(wrong_rekor_key), ignore=ig)
    assert rc == 1 and lines[0].startswith("sigstore signed entry timestamp: does not verify"), \
        lines

    def no_tsa(r):
        r["timestampAuthorities"] = []
    d11 = os.path.join(FIX, "v1.1.0-sigstore")
    rc, lines, _ = verify(d11, root=root_copy(no_tsa))
    assert rc == 1 and lines == ["sigstore timestamp: no timestamp authority of the trusted root "
                                 "is valid at its time"], lines


# ---- the agent and the manifest pin a keyless signer -------------------------------------------

MODEL = "org/keyless-model"


def agent(d, bundle, keyless=True, ignore=(), pubkey=None, pipeline=None):
    argv = [DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0", "--model-dir", d,
            "--model", MODEL, "--framework", "vllm", "--framework-version", "0.6.3",
            "--watch-interval-ms", "100", "--oms-bundle", bundle]
    if keyless:
        argv += ["--oms-trusted-root", ROOT, "--oms-identity", IDENTITY, "--oms-issuer", ISSUER]
    else:
        argv += ["--oms-pubkey", pubkey]
    for p in ignore:
        argv += ["--oms-ignore-path", p]
    if pipeline:
        argv += ["--key", pipeline]
    a = start_process(argv, name="agent")
    line = a.wait_log(lambda l: l.get("msg") in ("oms_verified", "oms_not_verified"))
    return a, line


def keyless_model(tag):
    """The v1.0.1 vector as a served model: without ignore-me (the checkpoint hash would cover
    it, the publisher did not sign it) and with a cache directory the checkpoint skips (a
    dot-name) but OMS would count."""
    d = copy_vector("v1.0.1-sigstore", tag)
    os.unlink(os.path.join(d, "ignore-me"))
    os.makedirs(os.path.join(d, ".cache", "huggingface"))
    with open(os.path.join(d, ".cache", "huggingface", "meta"), "w") as f:
        f.write("etag")
    return d


def test_agent_verifies_a_keyless_bundle_and_reports_who_signed():
    d = keyless_model("agent")
    b = os.path.join(d, "model.sig")
    a, line = agent(d, b)
    assert line["msg"] == "oms_not_verified" and line["findings"] == [
        "extra file (not in the bundle): .cache/huggingface/meta"], line
    a.stop()
    a, line = agent(d, b, ignore=[os.path.join(d, ".cache")])
    assert line["msg"] == "oms_verified", line
    assert line["method"] == "sigstore" and line["identity"] == IDENTITY, line
    assert line["signed_at"] == 1759851228, line
    r = http("GET", a.port, "/attestation?nonce=n1")
    p = json.loads(base64.b64decode(json.loads(r.text)["payload"]))
    assert p["oms"]["verified"] is True and p["oms"]["identity"] == IDENTITY and \
        p["oms"]["issuer"] == ISSUER, p["oms"]
    a.stop()
    # The flags go together, and an ignore path outside the model is refused at start.
    argv = [DETPROXY_BIN, "attest", "serve", "--listen", "127.0.0.1:0", "--model-dir", d,
            "--model", MODEL, "--framework", "vllm", "--framework-version", "0.6.3",
            "--oms-bundle", b, "--oms-trusted-root", ROOT, "--oms-identity", IDENTITY]
    rc, _, err = run_cmd(argv)
    assert rc == 2 and "--oms-trusted-root, --oms-identity and --oms-issuer go together" in err, \
        err
    rc, _, err = run_cmd(argv + ["--oms-issuer", ISSUER, "--oms-ignore-path", "/etc"])
    assert rc == 2 and "--oms-ignore-path /etc: not inside the model directory" in err, err


def test_proxy_admits_only_the_pinned_keyless_signer():
    pipeline_key = os.path.join(TMP, "pipeline")
    rc, _, err = run_cmd([DETPROXY_BIN, "attest", "keygen", "--out", pipeline_key])
    assert rc == 0, err
    d = keyless_model("px")
    ig = [os.path.join(d, ".cache")]
    # r2: the same files signed with a key: verified, but not by the pinned identity.
    d2 = keyless_model("px-key")
    os.unlink(os.path.join(d2, "model.sig"))
    k = oms.ec_key(TMP, "publisher")
    b2 = os.path.join(TMP, "px-key.sig")
    oms.write_bundle(b2, oms.statement(d2, ignore=[".cache"]), k)
    agents = [agent(d, os.path.join(d, "model.sig"), ignore=ig,
                    pipeline=pipeline_key + ".key.pem")[0],
              agent(d2, b2, keyless=False, pubkey=k.pub, ignore=[os.path.join(d2, ".cache")],
                    pipeline=pipeline_key + ".key.pem")[0]]
    sims = [start_sim("--model", MODEL) for _ in agents]
    man = {"model": MODEL, "oms": {"identity": IDENTITY, "issuer": ISSUER}}
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
    assert r["r1"]["attestation"]["report"]["oms"]["identity"] == IDENTITY, r["r1"]
    assert r["r2"]["state"] == "rejected" and r["r2"]["reasons"] == [
        "oms.identity mismatch: got (none: not a keyless bundle) want " + IDENTITY,
        "oms.issuer mismatch: got (none: not a keyless bundle) want " + ISSUER], r["r2"]
    px.stop()
    for a in agents:
        a.stop()


def test_manifest_oms_pins():
    from proxyutil import write_config

    def check(oms_value):
        cfg = {"listen": "127.0.0.1:0", "pools": [{"name": "p", "models": [MODEL], "replicas": [
            {"name": "r1", "url": "http://127.0.0.1:1",
             "attest": {"source": "agent", "url": "http://127.0.0.1:2/attestation"}}],
            "manifest": {"oms": oms_value}}]}
        rc, out, err = run_cmd([DETPROXY_BIN, "check", "-c", write_config(cfg)])
        return rc, out + err
    rc, text = check({"identity": IDENTITY})
    assert rc != 0 and "pools[0].manifest.oms.issuer: required with identity" in text, text
    rc, text = check({})
    assert rc != 0 and "pools[0].manifest.oms: needs signer (a key or certificate) or identity " \
        "and issuer (keyless)" in text, text
    rc, text = check({"identity": IDENTITY, "issuer": ISSUER})
    assert rc == 0, text


if __name__ == "__main__":
    run_tests(globals())
