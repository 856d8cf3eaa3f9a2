"""OpenSSF Model Signing (OMS v1.0) bundles made in the tests, independent of the C code.

Digests with hashlib, the statement and the Sigstore bundle with json, the DSSE PAE by hand
and its ECDSA signature with the `openssl` command line (`openssl dgst` hashes the PAE,
`openssl pkeyutl -sign` signs that digest). Python stdlib only.

    key = ec_key(tmpdir, "publisher")                # .key, .pub (PEM), P-256 by default
    stmt = statement(model_dir)                      # files serialization, sha256
    stmt = statement(model_dir, shard_size=4096)     # shards
    write_bundle(path, stmt, key)                    # method "key"
    write_bundle(path, stmt, leaf, chain=[leaf_crt, ca_crt])   # method "certificate"
"""
import base64
import hashlib
import json
import os
import subprocess

PREDICATE = "https://model_signing/signature/v1.0"
DEFAULT_IGNORES = [".git", ".gitignore", ".gitattributes", ".github"]


def _run(argv, input=None):
    cp = subprocess.run(argv, input=input, capture_output=True, timeout=60)
    if cp.returncode != 0:
        raise RuntimeError("%s failed: %s" % (" ".join(argv), cp.stderr.decode()))
    return cp.stdout


class Key:
    def __init__(self, key, pub):
        self.key, self.pub = key, pub

    def pem(self):
        with open(self.pub, "rb") as f:
            return f.read()

    def der(self):
        return _run(["openssl", "pkey", "-pubin", "-in", self.pub, "-outform", "DER"])

    def fingerprint(self):
        """The signer (docs/attestation.md §9): hex SHA-256 of the SubjectPublicKeyInfo DER."""
        return hashlib.sha256(self.der()).hexdigest()

    def hint(self):
        """What model_signing writes as publicKey.hint: SHA-256 of the PEM text."""
        return hashlib.sha256(self.pem()).hexdigest()


def ec_key(d, name, curve="prime256v1"):
    key, pub = os.path.join(d, name + ".key"), os.path.join(d, name + ".pub")
    _run(["openssl", "ecparam", "-name", curve, "-genkey", "-noout", "-out", key])
    _run(["openssl", "pkey", "-in", key, "-pubout", "-out", pub])
    return Key(key, pub)


def walk(model_dir, ignore=(), exclude=()):
    """Relative paths of the regular files OMS signs (OMS §6.1-§6.2), sorted."""
    out = []
    for root, dirs, files in os.walk(model_dir):
        rel_root = os.path.relpath(root, model_dir)
        rel_root = "" if rel_root == "." else rel_root + "/"
        for n in list(dirs):
            rel = rel_root + n
            if (not rel_root and n in DEFAULT_IGNORES) or rel in ignore:
                dirs.remove(n)
        for n in files:
            rel = rel_root + n
            if (not rel_root and n in DEFAULT_IGNORES) or rel in ignore or rel in exclude:
                continue
            if os.path.islink(os.path.join(root, n)):
                continue
            out.append(rel)
    return sorted(out, key=lambda s: s.encode())


def _hash(data, hash_type):
    return (hashlib.sha256(data) if hash_type == "sha256" else hashlib.blake2b(data)).hexdigest()


def statement(model_dir, shard_size=None, ignore=(), exclude=(), hash_type="sha256",
              allow_symlinks=False, name="model"):
    resources = []
    for rel in walk(model_dir, ignore, exclude):
        with open(os.path.join(model_dir, rel), "rb") as f:
            data = f.read()
        if shard_size is None:
            resources.append({"name": rel, "digest": _hash(data, hash_type),
                              "algorithm": hash_type})
            continue
        for start in range(0, len(data), shard_size):
            end = min(start + shard_size, len(data))
            resources.append({"name": "%s:%d:%d" % (rel, start, end),
                              "digest": _hash(data[start:end], hash_type),
                              "algorithm": hash_type})
    resources.sort(key=lambda r: r["name"].encode())
    return finish(resources, shard_size, list(ignore), hash_type, allow_symlinks, name)


def root_digest(resources):
    return hashlib.sha256(b"".join(bytes.fromhex(r["digest"]) for r in resources)).hexdigest()


def finish(resources, shard_size=None, ignore=(), hash_type="sha256", allow_symlinks=False,
           name="model"):
    ser = {"method": "files" if shard_size is None else "shards", "hash_type": hash_type,
           "allow_symlinks": allow_symlinks, "ignore_paths": DEFAULT_IGNORES + list(ignore)}
    if shard_size is not None:
        ser["shard_size"] = shard_size
    return {"_type": "https://in-toto.io/Statement/v1",
            "subject": [{"name": name, "digest": {"sha256": root_digest(resources)}}],
            "predicateType": PREDICATE,
            "predicate": {"resources": resources, "serialization": ser}}


def pae(payload_type, body):
    t = payload_type.encode()
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def sign(key_path, data, md="sha256"):
    """DER ECDSA signature over data: openssl dgst for the digest, openssl pkeyutl to sign it."""
    digest = _run(["openssl", "dgst", "-" + md, "-binary"], input=data)
    return _run(["openssl", "pkeyutl", "-sign", "-inkey", key_path], input=digest)


def bundle(stmt, signer, chain=None, payload=None, md="sha256", hint=None):
    """A Sigstore bundle v0.3. signer: a Key (method "key") or a private-key path with chain
    (list of PEM certificate paths, leaf first: method "certificate")."""
    body = payload if payload is not None else json.dumps(stmt, indent=2).encode()
    key_path = signer.key if isinstance(signer, Key) else signer
    sig = sign(key_path, pae("application/vnd.in-toto+json", body), md)
    if chain is None:
        vm = {"publicKey": {"hint": hint if hint is not None else signer.hint()},
              "tlogEntries": []}
    else:
        certs = [base64.b64encode(_run(["openssl", "x509", "-in", c, "-outform", "DER"]))
                 .decode() for c in chain]
        vm = {"x509CertificateChain": {"certificates": [{"rawBytes": c} for c in certs]},
              "tlogEntries": []}
    return {"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
            "verificationMaterial": vm,
            "dsseEnvelope": {"payload": base64.b64encode(body).decode(),
                             "payloadType": "application/vnd.in-toto+json",
                             "signatures": [{"sig": base64.b64encode(sig).decode(),
                                             "keyid": ""}]}}


def write_bundle(path, stmt, signer, **kw):
    with open(path, "w") as f:
        json.dump(bundle(stmt, signer, **kw), f, indent=2)
    return path
