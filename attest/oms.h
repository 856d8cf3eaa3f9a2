/* OpenSSF Model Signing (OMS) v1.0 bundles: parse, verify the signature, verify a model
 * directory against the signed manifest (docs/attestation.md §9; the OMS spec,
 * ossf/model-signing-spec spec/v1.0.md, is the reference for every rule cited as "OMS §n" below).
 *
 * A bundle is a Sigstore bundle v0.3 holding a DSSE envelope (payloadType
 * application/vnd.in-toto+json) whose payload is an in-toto Statement v1 with predicateType
 * https://model_signing/signature/v1.0: predicate.resources[] {name, digest, algorithm} sorted by
 * name, predicate.serialization {method files|shards, hash_type, shard_size, allow_symlinks,
 * ignore_paths}; subject[0].digest.sha256 is SHA-256 over the concatenated raw resource digests.
 *
 * Signing methods verified here: "key" (ECDSA P-256/P-384/P-521 with SHA-256/384/512 over the
 * DSSE PAE, against a public key given by the operator) and "certificate" (the leaf of
 * verificationMaterial.x509CertificateChain validated against a CA file, then the same ECDSA
 * check with the leaf's key) and "sigstore" (keyless: a Fulcio certificate and its Rekor entry,
 * verified offline against a trusted root, attest/sigstore.h). Hash types: sha256, blake2b
 * (BLAKE2b-512); blake3 is refused.
 *
 * Blocking file I/O, no libuv, no logging: the agent runs it on a worker thread. Every reason
 * buffer (why, err) must be non-NULL. */
#ifndef ATTEST_OMS_H
#define ATTEST_OMS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attest/hash.h"
#include "attest/report.h"
#include "attest/sigstore.h"
#include "common/buf.h"

#define OMS_PREDICATE_TYPE "https://model_signing/signature/v1.0"
#define OMS_STATEMENT_TYPE "https://in-toto.io/Statement/v1"
#define OMS_PAYLOAD_TYPE "application/vnd.in-toto+json"
/* Bundles are a few hundred bytes per file; a 100k-file model stays well below this. */
#define OMS_BUNDLE_MAX_BYTES ((size_t)64 << 20)

typedef enum { OMS_METHOD_KEY = 0, OMS_METHOD_CERTIFICATE, OMS_METHOD_SIGSTORE } oms_method_t;

/* "key", "certificate", "sigstore" */
extern const char *const oms_method_names[3];

typedef struct oms_bundle_s oms_bundle_t;

/* Parse a bundle and validate it the way the spec's schemas and validator do (OMS §3.1, §8.1,
 * §8.3), plus the predicate rules of OMS §5-§6 a schema cannot express: at least one resource,
 * names sorted and unique, canonical relative names (no leading '/', no '.' or '..' component,
 * no empty component, valid UTF-8), every algorithm equal to hash_type, digests of the length
 * the hash type gives, shard names "<path>:<start>:<end>" on shard_size boundaries, shard_size
 * present exactly for "shards", ignore paths without globs, and subject[0].digest.sha256 equal
 * to the root digest recomputed from the resources. No signature is checked here.
 * Returns 0, or -1 with one reason appended to *why ("dsseEnvelope: missing",
 * "statement.predicateType: expected \"https://model_signing/signature/v1.0\", got ..."). */
int oms_bundle_parse(const char *json, size_t len, oms_bundle_t **out, dp_buf_t *why);
void oms_bundle_free(oms_bundle_t *b);
oms_method_t oms_bundle_method(const oms_bundle_t *b);
/* 64 lowercase hex: subject[0].digest.sha256 (checked against the resources at parse). */
const char *oms_bundle_root_digest(const oms_bundle_t *b);
size_t oms_bundle_resource_count(const oms_bundle_t *b);

/* What the operator trusts and expects: a public key (method "key"), a CA file (method
 * "certificate"), a Sigstore trusted root with the identity and issuer the certificate must
 * name (method "sigstore"), and paths to leave out of the model besides those the bundle
 * records. Zero-initialise; release with oms_trust_free. */
typedef struct {
    void *pubkey;                   /* EVP_PKEY */
    void *ca_store;                 /* X509_STORE */
    sigstore_root_t *sigstore_root; /* with identity and issuer */
    char *identity, *issuer;
    char **ignore; /* model-relative, sorted */
    size_t nignore;
} oms_trust_t;

/* Load an EC public key (P-256, P-384 or P-521; PEM SubjectPublicKeyInfo). 0 or -1 + reason. */
int oms_trust_load_pubkey(oms_trust_t *t, const char *path, dp_buf_t *err);
/* Load PEM CA certificates (the trust anchors for method "certificate"). 0 or -1 + reason. */
int oms_trust_load_ca(oms_trust_t *t, const char *path, dp_buf_t *err);
/* Method "sigstore": load the trusted root (trusted_root.json) and keep the identity (a SAN:
 * email, URI or username) and OIDC issuer URL the signing certificate must carry. 0 or -1 +
 * reason (which of the three is wrong). */
int oms_trust_load_sigstore(oms_trust_t *t, const char *root_path, const char *identity,
                            const char *issuer, dp_buf_t *err);
/* Leave path out of the model directory dir, as `model_signing verify --ignore-paths` does:
 * path is absolute or relative to the working directory and must lie inside dir (a file or a
 * directory, which need not exist). 0, or -1 with the reason. */
int oms_trust_add_ignore(oms_trust_t *t, const char *dir, const char *path, dp_buf_t *err);
void oms_trust_free(oms_trust_t *t);
/* Hex SHA-256 of the SubjectPublicKeyInfo DER of the loaded --pubkey (the manifest's oms.signer,
 * docs/attestation.md §9); "" when no key is loaded. */
void oms_trust_pubkey_fingerprint(const oms_trust_t *t, char out[65]);

/* Verify the DSSE signature with the bundle's method (for "sigstore" every step of
 * sigstore_verify). On success writes the signer fingerprint (hex SHA-256 of the verifying
 * key's SubjectPublicKeyInfo DER: the --pubkey, or the leaf certificate's key) and, for
 * "sigstore", the verified signing time to *signed_at (else 0; signed_at may be NULL), and
 * returns 0; else -1 with a reason. */
int oms_verify_signature(const oms_bundle_t *b, const oms_trust_t *t, char signer[65],
                         int64_t *signed_at, dp_buf_t *why);

/* Verify DIR against the manifest (OMS §8.4): enumerate with the recorded rules (default
 * exclusions .git, .gitignore, .gitattributes, .github at the top level; the recorded
 * ignore_paths and t's ignore paths as exact relative paths; the bundle file itself when it lies
 * inside DIR; allow_symlinks as recorded), hash with hash_type (whole files, or shard_size ranges),
 * and append one finding per problem: "changed file: P (...)", "extra file (not in the bundle): P",
 * "missing file: P", "symlink not allowed (allow_symlinks is false): P", ...
 * bundle_path may be NULL. snap_out (may be NULL) receives the listing that was verified.
 * Returns 0 when every file matches, 1 with findings, or a negative errno when DIR cannot be
 * read (reason appended to *err). */
int oms_verify_dir(const oms_bundle_t *b, const char *dir, const char *bundle_path,
                   const oms_trust_t *t, const attest_hash_opts_t *opts, attest_reasons_t *findings,
                   attest_snapshot_t *snap_out, dp_buf_t *err);

/* Everything for one bundle file and one directory. */
typedef struct {
    bool verified;        /* parse, signature and directory all good */
    const char *method;   /* oms_method_names[...], NULL when the bundle did not parse */
    char signer[65];      /* "" unless the signature verified */
    char root_digest[65]; /* "" unless the bundle parsed */
    int64_t signed_at;    /* method sigstore: the verified signing time (Unix s), else 0 */
    attest_reasons_t findings;
    attest_snapshot_t snap;          /* the OMS listing (empty unless the directory was walked) */
    oms_bundle_t *bundle;            /* NULL unless it parsed */
    uint64_t bundle_dev, bundle_ino; /* the bundle file as read */
} oms_result_t;

/* Read and parse bundle_path, verify its signature against t, then DIR. Every problem is a
 * finding in out->findings (a bundle that cannot be read or parsed, a bad signature, each
 * file). Returns 0 verified, 1 findings, or a negative errno when a file could not be read
 * (the reason is a finding too). out must be zero-initialised; release with oms_result_clear. */
int oms_verify(const char *bundle_path, const char *dir, const oms_trust_t *t,
               const attest_hash_opts_t *opts, oms_result_t *out);
void oms_result_clear(oms_result_t *r);

/* The checkpoint hash (docs/attestation.md §1) and the OMS manifest must describe the same files:
 * every file of the checkpoint listing ckpt (with the per-file lines attest_hash_snapshot wrote, in
 * the same order) must be one the OMS verification covered, the same inode, size and mtime, and,
 * when the bundle hashes whole files with sha256, with the same digest. The bundle file itself
 * is exempt (it lies in the model directory by convention; its signature vouches for it).
 * Appends one finding per file that is not; returns how many. */
int oms_cross_check(const oms_result_t *r, const attest_snapshot_t *ckpt, const char *lines,
                    size_t lines_len, attest_reasons_t *findings);

/* For the agent: oms_verify, then oms_cross_check against the checkpoint it just computed
 * (ckpt and lines from attest_hash_dir); verified only when both pass. */
int oms_verify_checkpoint(const char *bundle_path, const char *dir, const oms_trust_t *t,
                          const attest_hash_opts_t *opts, const attest_snapshot_t *ckpt,
                          const dp_buf_t *lines, oms_result_t *out);

/* What the agent watches besides the checkpoint listing: the OMS manifest covers dot-names the
 * checkpoint skips, and the bundle file may change on its own. Zero-initialise. */
typedef struct {
    attest_snapshot_t files; /* every file under DIR, dot-names included */
    uint64_t bundle_dev, bundle_ino, bundle_size;
    int64_t bundle_mtime_ns; /* all 0 when the bundle could not be stat'ed */
} oms_watch_t;

/* List DIR and stat the bundle. 0, or a negative errno with the reason in *err. */
int oms_watch_take(const char *bundle_path, const char *dir, oms_watch_t *out, dp_buf_t *err);
/* True (with what changed appended to *why) when the two differ. */
bool oms_watch_differs(const oms_watch_t *a, const oms_watch_t *b, dp_buf_t *why);
void oms_watch_free(oms_watch_t *w);

#endif
