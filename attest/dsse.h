/* Signed attestations: Ed25519 keys and DSSE envelopes (docs/attestation.md §2, §3).
 *
 * Envelope: {"payloadType":"application/vnd.detproxy.attestation+json","payload":"<base64>",
 *            "signatures":[{"keyid":"<hex sha256 of pubkey DER>","sig":"<base64>"}]}
 * The signature is Ed25519 over the DSSE pre-authentication encoding of (payloadType, payload
 * bytes): "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body, lengths in ASCII decimal.
 * keyid is the lowercase hex SHA-256 of the signer's SubjectPublicKeyInfo DER.
 *
 * All functions are synchronous and thread-safe on distinct objects; an attest_key_t may be used
 * from several threads for signing and verifying at once (OpenSSL EVP_PKEY is read-only here). */
#ifndef ATTEST_DSSE_H
#define ATTEST_DSSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attest/report.h"
#include "common/buf.h"

#define ATTEST_PAYLOAD_TYPE "application/vnd.detproxy.attestation+json"
/* An agent's answer is a few hundred bytes; anything this large is garbage or an attack. */
#define ATTEST_ENVELOPE_MAX_BYTES 65536
/* DSSE allows several signatures; more than this is not a real signer set. */
#define ATTEST_MAX_SIGNATURES 16

typedef struct attest_key_s attest_key_t;

/* Load an Ed25519 key from PEM text or a PEM file. Private keys: PKCS#8 ("BEGIN PRIVATE KEY");
 * public keys: SubjectPublicKeyInfo ("BEGIN PUBLIC KEY"). Any other key type is refused.
 * Returns 0, or a negative errno with a one-line reason appended to *err (never key bytes). */
int attest_key_from_pem(const char *pem, size_t len, bool is_private, attest_key_t **out,
                        dp_buf_t *err);
int attest_key_load(const char *path, bool is_private, attest_key_t **out, dp_buf_t *err);
void attest_key_free(attest_key_t *k);
/* 64 lowercase hex, NUL-terminated; owned by the key. */
const char *attest_key_id(const attest_key_t *k);
bool attest_key_is_private(const attest_key_t *k);
/* PEM of the public half (SubjectPublicKeyInfo), appended to out. */
void attest_key_public_pem(const attest_key_t *k, dp_buf_t *out);

#define ATTEST_SIG_LEN 64
/* Raw Ed25519 over msg (no DSSE framing): the audit checkpoints use it. Sign needs a private
 * key (-1 otherwise or on an OpenSSL failure); verify is false on any mismatch. */
int attest_key_sign(const attest_key_t *k, const void *msg, size_t n,
                    unsigned char sig[ATTEST_SIG_LEN]);
bool attest_key_verify(const attest_key_t *k, const void *msg, size_t n, const void *sig,
                       size_t siglen);

/* Generate a key pair: PREFIX.key.pem (PKCS#8, created 0600, never overwritten) and
 * PREFIX.pub.pem (SPKI, 0644). The key id is written to keyid_out (65 bytes) if non-NULL.
 * Returns 0 or a negative errno with a reason in *err; on failure no file is left behind. */
int attest_keygen(const char *prefix, char keyid_out[65], dp_buf_t *err);

/* A set of trusted public keys. Zero-initialise; attest_keyset_free releases the keys. */
typedef struct {
    attest_key_t **keys;
    size_t count;
} attest_keyset_t;

/* Takes ownership of k. A key already in the set (same keyid) is freed and not added twice. */
void attest_keyset_add(attest_keyset_t *ks, attest_key_t *k);
int attest_keyset_add_file(attest_keyset_t *ks, const char *path, dp_buf_t *err);
const attest_key_t *attest_keyset_find(const attest_keyset_t *ks, const char *keyid);
void attest_keyset_free(attest_keyset_t *ks);

/* DSSE lets signers use standard or URL-safe base64, padded or not: decode all four, strictly
 * (no whitespace, no stray characters). 0, or -1 on bad input. */
int attest_b64_decode_any(const char *s, size_t n, dp_buf_t *out);

/* DSSE PAE of (type, body), appended to out. */
void attest_dsse_pae(const char *type, const void *body, size_t n, dp_buf_t *out);

/* Sign payload bytes into a complete envelope JSON (appended to out). 0 or -1 with reason. */
int attest_envelope_sign(const attest_key_t *key, const char *payload, size_t n, dp_buf_t *out,
                         dp_buf_t *err);

typedef struct {
    const attest_keyset_t *trusted; /* may be NULL or empty: then only unsigned envelopes pass */
    bool require_signature;
    const char *expected_nonce; /* NULL: not checked (offline `attest verify` without --nonce) */
} attest_verify_opts_t;

/* Verify an envelope and parse its payload into *out (source "agent"; is_signed and keyid set
 * when a trusted signature verified). out must be zero-initialised or a report used before (it
 * is cleared first, and left empty on failure). opts NULL: require a signature, trust nothing.
 *
 * Signature rules (fail closed, never a silent downgrade):
 *   - no signatures (absent or empty array): rejected with require_signature, else accepted
 *     unsigned;
 *   - any signatures: each must be well-formed; every one whose keyid is trusted must verify;
 *     at least one must be by a trusted key; otherwise rejected, whatever require_signature says
 *     (a signed envelope that does not verify means tampering or a key mix-up: say so).
 * Then the payload must parse (attest_payload_parse) and, when expected_nonce is set, carry it.
 *
 * Returns 0, or -1 with one precise reason appended to *why, e.g.
 *   "envelope: not valid JSON", "envelope.payloadType: expected \"application/...\"",
 *   "envelope.payload: bad base64", "signature: missing (require_signature is set)",
 *   "signature: key 3fa2b1c4.. not trusted", "signature: bad signature by key 3fa2b1c4..",
 *   "signature: malformed (sig is 12 bytes, want 64)", "payload.dtype: expected a string",
 *   "nonce mismatch (replay?): got 5d1e.. want 9c0a..". */
int attest_envelope_verify(const char *json, size_t len, const attest_verify_opts_t *opts,
                           attest_report_t *out, dp_buf_t *why);

/* The agent/simulator side in one call: payload from r's identity fields plus nonce and
 * issued_at (wall-clock now when issued_at_ms is 0), signed with key (NULL: an unsigned envelope
 * with "signatures":[]). Appends the envelope JSON to out. Returns 0 or -1 with a reason. */
int attest_envelope_for(const attest_key_t *key, const attest_report_t *r, const char *nonce,
                        uint64_t issued_at_ms, dp_buf_t *out, dp_buf_t *err);
/* Same, loading the private key from key_path first (convenience for one-off callers; a server
 * should load the key once with attest_key_load and call attest_envelope_for). */
int attest_envelope_for_keyfile(const char *key_path, const attest_report_t *r, const char *nonce,
                                dp_buf_t *out, dp_buf_t *err);

/* Is this an acceptable nonce for an agent to echo? 1..ATTEST_NONCE_MAX chars of
 * [A-Za-z0-9._~-]: what a query string can carry without escaping, so no decoding ambiguity
 * between proxy and agent. */
#define ATTEST_NONCE_MAX 128
bool attest_nonce_valid(const char *s, size_t n);
/* What a server answers a nonce attest_nonce_valid refuses (400 bad_nonce). */
#define ATTEST_NONCE_RULE "nonce must be 1..128 characters of [A-Za-z0-9._~-]"
/* A nonce as the query gave it (n bytes, decoded), copied NUL-terminated into out when
 * attest_nonce_valid takes it: false otherwise. */
bool attest_nonce_copy(const char *s, size_t n, char out[ATTEST_NONCE_MAX + 1]);

#endif
