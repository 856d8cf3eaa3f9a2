/* Admission decisions (docs/attestation.md §6): does a report match the pool's pinned manifest, and
 * has a replica failed its behavioural canary. Pure functions, no I/O. */
#ifndef ATTEST_MATCH_H
#define ATTEST_MATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attest/report.h"
#include "config/config.h"

/* Compare every field the manifest pins with the report, exactly (byte-equal strings). Appends
 * one reason per mismatch and returns how many there were (0: the report matches):
 *   "checkpoint_sha256 mismatch: got ab12cd34.. want cd34ef56.."
 *   "quantization unattested (vllm adapter does not report it)"   (pinned but not reported)
 * A NULL manifest pins nothing and always matches. The canary is not looked at here. */
int attest_manifest_match(const cfg_manifest_t *m, const attest_report_t *r, attest_reasons_t *out);

/* With a manifest "accept" list (a rollout), a report matching the manifest or any accepted
 * identity is a match; otherwise the manifest's reasons come first, then one per accepted
 * identity: "nor accept[0] (fp_1a2b..): checkpoint_sha256 mismatch: got .. want ..". */

/* The accepted identity a report matches: m itself, one of m->accept[], or NULL when none
 * does (or m is NULL). Its fingerprint is the one put on that replica's responses. */
const cfg_manifest_t *attest_manifest_identity(const cfg_manifest_t *m, const attest_report_t *r);

/* Whether report r's value for field f equals v as admission compares them: byte-equal, but
 * a quantization in any case where llama.cpp names it ("Q8_0" for a manifest's "q8_0"). */
bool attest_value_matches(const attest_report_t *r, attest_field_t f, const char *v);

/* The value a manifest pins for field f, or NULL when it pins nothing there (or m is NULL). */
const char *attest_manifest_get(const cfg_manifest_t *m, attest_field_t f);

/* The whole admission check for one attestation: the signature policy, the agent's
 * contradictions, then the manifest. With require_signature an unsigned report is rejected
 * ("unsigned attestation (vllm adapter) but attestation.require_signature is true"); a report
 * carrying contradictions is rejected whatever the manifest pins, one reason each ("agent:
 * --quantization F16 contradicts the engine's Q8_0"). Returns 0 when admitted, else the number
 * of reasons appended. */
int attest_admit(const cfg_manifest_t *m, const attest_report_t *r, bool require_signature,
                 attest_reasons_t *out);

/* ---- canary (docs/attestation.md §6) ---------------------------------------------------------
 * The last three completed canary checks of one replica, newest in bit 0. Zero-initialise.
 * Only completed checks are recorded: a canary request that failed or timed out says nothing
 * about the model and is the reachability logic's business. */
typedef struct {
    uint8_t bits;  /* 1 = mismatch */
    uint8_t count; /* checks recorded, saturates at 3 */
} attest_canary_t;

/* Record one check; returns attest_canary_rejected() afterwards. */
bool attest_canary_record(attest_canary_t *c, bool matched);
/* True while 2 or more of the last (up to) 3 checks mismatched. A rejected replica that keeps
 * being probed recovers only after two matching checks in a row. */
bool attest_canary_rejected(const attest_canary_t *c);
void attest_canary_reset(attest_canary_t *c);
/* Hex SHA-256 of the output text, as compared with canary.expected_sha256. */
void attest_canary_sha256(const char *text, size_t n, char out[65]);
/* Does this output text match the manifest's canary? */
bool attest_canary_matches(const cfg_canary_t *canary, const char *text, size_t n);
/* Why an answered canary keeps a replica from being admitted (its metadata matched), in the
 * words the proxy's /admin/replicas and `detproxy diagnose` both show: sha256 is the output's,
 * expected the pinned expected_sha256 ("" when none is recorded yet):
 *   "canary mismatch: output sha256 14801932.. want 8de3f2ff.. (not admitted until the canary
 *    matches)"
 *   "canary not recorded: the manifest has no canary.expected_sha256 (this replica's output
 *    hashes to <64 hex>; 'detproxy attest canary' prints it)" */
void attest_canary_reason(const char *sha256, const char *expected, attest_reasons_t *out);
/* After a canary mismatch of a replica attested by its agent (a signed identity): the native
 * adapter that reads the engine the identity names ("llamacpp": CFG_ATTEST_LLAMACPP), or
 * CFG_ATTEST_NONE when there is none. */
cfg_attest_source_t attest_engine_source(const attest_report_t *attested);
/* The reason that says what the engine itself (report `engine`, read with that adapter) says
 * beside the attested identity: the fields that differ, or that none of them does. */
void attest_engine_reason(const attest_report_t *attested, const attest_report_t *engine,
                          attest_reasons_t *out);

#endif
