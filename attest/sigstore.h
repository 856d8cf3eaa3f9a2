/* Keyless Sigstore verification, offline (docs/attestation.md §9, "Keyless bundles").
 *
 * A keyless bundle (what `model_signing sign` writes by default) carries a short-lived Fulcio
 * certificate for an OIDC identity, the DSSE envelope signed with that certificate's key, and
 * the envelope's Rekor (transparency log) entry: its canonicalized body, an inclusion proof
 * with a signed checkpoint, and usually a signed entry timestamp (SET). Verifying it needs only
 * a trusted root (Sigstore's trusted_root.json: Fulcio CAs, Rekor and CT log keys, each with the
 * period it is valid for). The rules follow sigstore-python and sigstore-go:
 *
 *   1. signing time: the entry's integratedTime, trusted only through a SET that verifies with a
 *      Rekor key of the root valid at that time, and every RFC 3161 timestamp (over the DSSE
 *      signature, by a timestamp authority of the root valid at its time); at least one;
 *   2. certificate chain: the leaf chains to a Fulcio CA of the root valid at each signing
 *      time, and the chain is checked at that time;
 *   3. certificate usage: keyUsage digitalSignature and extendedKeyUsage codeSigning;
 *   4. SCT: an embedded SCT from a CT log of the root verifies over the precertificate (the TBS
 *      without the SCT extension, RFC 6962 §3.2);
 *   5. identity and issuer: a SAN (email, URI or Fulcio username) equals the expected identity,
 *      and the OIDC issuer extension (1.3.6.1.4.1.57264.1.8, or the legacy .1.1) the issuer;
 *   6. inclusion proof: the body's Merkle path (RFC 6962 §2.1.1) gives rootHash, and the
 *      checkpoint for that root and tree size is signed by the same Rekor key;
 *   7. each signing time lies inside the certificate's validity (10 minutes for Fulcio);
 *   8. signature: the DSSE signature verifies with the certificate's key;
 *   9. log entry body: the entry is a dsse v0.0.1 record of this envelope (payload hash,
 *      signatures and the certificate as verifier).
 * Each failure is one reason that starts with the step's name ("sigstore SCT: ...").
 *
 * Not verified: Rekor v2 (hashedrekord v0.0.2) entries are refused as such. */
#ifndef ATTEST_SIGSTORE_H
#define ATTEST_SIGSTORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

/* trusted_root.json is a few kilobytes; a private deployment's a few more. */
#define SIGSTORE_ROOT_MAX_BYTES ((size_t)1 << 20)
/* Identities and issuers are emails and URLs; GitHub workflow URIs are the longest seen. */
#define SIGSTORE_NAME_MAX 512

typedef struct sigstore_root_s sigstore_root_t;

/* Parse a trusted root (media type application/vnd.dev.sigstore.trustedroot+json, version
 * 0.1 or v0.2). 0, or -1 with the reason appended to *err. */
int sigstore_root_parse(const char *json, size_t len, sigstore_root_t **out, dp_buf_t *err);
int sigstore_root_load(const char *path, sigstore_root_t **out, dp_buf_t *err);
void sigstore_root_free(sigstore_root_t *r);

/* What the bundle carries, as oms_bundle_parse decoded it. */
typedef struct {
    const dp_buf_t *cert; /* verificationMaterial.certificate.rawBytes (DER) */
    const void *material; /* the verificationMaterial cJSON object */
    const char *payload_type;
    const dp_buf_t *payload; /* the DSSE payload bytes */
    const dp_buf_t *sigs;    /* the DSSE signatures, decoded */
    size_t nsigs;
} sigstore_bundle_t;

typedef struct {
    int64_t signed_at; /* the verified signing time (the log's when it has a SET), Unix s */
    char signer[65];   /* hex SHA-256 of the certificate's SubjectPublicKeyInfo DER */
} sigstore_result_t;

/* Steps 1-9 above. 0, or -1 with one reason (the first step that failed) appended to *why. */
int sigstore_verify(const sigstore_root_t *root, const char *identity, const char *issuer,
                    const sigstore_bundle_t *b, sigstore_result_t *out, dp_buf_t *why);

/* RFC 5280 §4.2.1.3 and §4.2.1.12 for a certificate that signs a model: keyUsage present with
 * digitalSignature, and, when extendedKeyUsage is present, codeSigning in it (as Fulcio
 * certificates have). NULL when it may sign, else what is wrong. cert is an X509. */
const char *sigstore_signing_usage_problem(const void *cert);

#endif
