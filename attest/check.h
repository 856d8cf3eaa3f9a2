/* One attestation check, its pure part (docs/attestation.md §2, §4-§6): which requests a check of a
 * replica makes for its attest.source, what their answers mean, and the verdict with its reasons.
 * No I/O: the requests are sent by probe/probe.h, and the proxy's admission
 * (proxy/control/attest.c), `detproxy diagnose` and the agent's read of its co-located framework
 * (agent/agent.c) all go through both, so the same answers give every caller the same verdict and
 * the same reasons.
 *
 *   attest_check_plan         the GETs:  agent   <attest.url path, or /attestation>?nonce=N
 *                                        native  every adapter path under the replica's base URL
 *                                        none    <base>/v1/models (reachability only)
 *   attest_check_read         their answers -> UNREACHABLE, INVALID, or a report (REPORTED)
 *   attest_check_wants_probe  native sources then send the 1-token completion
 *   attest_check_probe_read   (ATTEST_PROBE_PROMPT) whose system_fingerprint is attested
 *   attest_check_judge        the report against the manifest (and its accept list) and the
 *                             signature policy -> ADMITTED or MISMATCH
 * The judging is separate so a caller can use the manifest in force when the answers arrive
 * (a reload may have replaced the one in force when the check started). */
#ifndef ATTEST_CHECK_H
#define ATTEST_CHECK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attest/adapters.h"
#include "attest/dsse.h"
#include "attest/report.h"
#include "common/buf.h"
#include "config/config.h"

typedef enum {
    ATTEST_V_ADMITTED = 0, /* the report matches the manifest or an accepted identity */
    ATTEST_V_MISMATCH,     /* a valid report that the manifest or require_signature rejects */
    ATTEST_V_INVALID,      /* an answer that is no valid attestation (envelope, metadata) */
    ATTEST_V_UNREACHABLE,  /* no answer to judge: a request failed, or a required one not 200 */
    ATTEST_V_REPORTED,     /* a report not judged yet (between read and judge) */
    ATTEST_V__COUNT
} attest_verdict_t;

/* "admitted", "mismatch", "invalid", "unreachable", "reported" */
extern const char *const attest_verdict_names[ATTEST_V__COUNT];

#define ATTEST_CHECK_MAX_REQUESTS ATTEST_ADAPTER_MAX_PATHS
#define ATTEST_PROBE_MAX_BYTES ((size_t)64 << 10) /* the fingerprint probe's answer */

typedef struct {
    char target[768]; /* origin-form path and query */
    size_t max_bytes; /* response body cap */
    bool required;    /* a non-200 answer makes the replica unreachable */
} attest_request_t;

typedef struct {
    cfg_attest_source_t source;
    char nonce[33]; /* agent: the nonce asked for (32 hex), "" otherwise */
    size_t nrequests;
    attest_request_t requests[ATTEST_CHECK_MAX_REQUESTS];
} attest_check_t;

/* One request's answer. */
typedef struct {
    int status;       /* HTTP status; 0 when the exchange failed below HTTP */
    const char *body; /* the body, whatever the status (may be NULL when len is 0) */
    size_t len;
    const char *error;  /* status 0: what failed ("connect", "first_byte_timeout", ...) */
    const char *detail; /* status 0: more about it ("connection refused"), or NULL */
} attest_answer_t;

/* Zero-initialise; release with attest_outcome_clear. */
typedef struct {
    attest_verdict_t verdict;
    attest_report_t report;   /* REPORTED, ADMITTED, MISMATCH: what the replica attested */
    attest_reasons_t reasons; /* why not ADMITTED: one for UNREACHABLE and INVALID, one per
                               * mismatch (attest_admit) */
    int status;               /* UNREACHABLE: the failing answer's status (0: below HTTP) */
    char detail[256];         /* UNREACHABLE below HTTP: the answer's detail (or error) alone */
    /* REPORTED and after: the bytes the verdict rests on, as an auditor can judge them again
     * (docs/operations.md, "Evidence"): an agent's signed envelope verbatim; for a native
     * source each answer as "GET <target> <status> <length>\n<body>\n", then the probe
     * completion's as "POST /v1/completions <status> <length>\n<body>\n" when one was sent. */
    dp_buf_t evidence;
} attest_outcome_t;

/* The requests for a replica with this source. base: the replica's URL path prefix ("" or
 * "/prefix"; native and none); agent_path: attest.url's path (agent; NULL or "" means
 * "/attestation"). An agent check draws a fresh nonce. */
void attest_check_plan(attest_check_t *c, cfg_attest_source_t source, const char *base,
                       const char *agent_path);

/* Read the answers (answers[i] for c->requests[i]) into *out (cleared first). In request order,
 * the first answer that failed below HTTP, or that is not 200 on a required request, makes the
 * verdict UNREACHABLE:
 *   "attestation fetch failed (connect): connection refused"
 *   "attestation endpoint answered 503: <the error message of an OpenAI-shaped body>"
 *   "framework at http://127.0.0.1:8000: connection refused"   (an agent's 503
 *                                     framework_unreachable: its own message, as it is the
 *                                     engine, not the agent, that is unreachable)
 * Otherwise: agent, the envelope verified with keys, require_signature and c->nonce (INVALID
 * with the reason when it does not); native, the adapter's parse (INVALID when it fails);
 * none, a report with source "none" and the model /v1/models names first. Then REPORTED. */
void attest_check_read(const attest_check_t *c, const attest_answer_t *answers,
                       const attest_keyset_t *keys, bool require_signature, attest_outcome_t *out);

/* A REPORTED outcome of a native source: send the engine-fingerprint probe now. */
bool attest_check_wants_probe(const attest_check_t *c, const attest_outcome_t *out);
/* The engine fingerprint the metadata itself names, or NULL: llama.cpp's /props build_info,
 * which llama-server sends as system_fingerprint on every response. A caller that cannot put
 * its probe under the proxy's admission slots (the agent) uses it instead of the probe. */
const char *attest_check_metadata_fingerprint(const attest_check_t *c, const attest_outcome_t *out);
/* The model the probe asks for: the one the engine reported (a vLLM answers 404 to any other
 * name), else fallback. */
const char *attest_check_probe_model(const attest_outcome_t *out, const char *fallback);
/* The probe's answer into out->report: engine_fingerprint, or a note why it is unattested. */
void attest_check_probe_read(attest_outcome_t *out, const attest_answer_t *a);

/* A REPORTED outcome becomes ADMITTED, or MISMATCH with one reason per mismatch (attest_admit:
 * require_signature, then the manifest and its accept list). Others are left as they are. */
void attest_check_judge(attest_outcome_t *out, const cfg_manifest_t *m, bool require_signature);

/* The first reason, or fallback when there is none. */
const char *attest_outcome_reason(const attest_outcome_t *out, const char *fallback);
void attest_outcome_clear(attest_outcome_t *out);

/* A temperature-0 completion body {"model","prompt","max_tokens","temperature":0[,"seed":0]
 * [,"cache_prompt":false]} (appended to out): the engine-fingerprint probe's (no seed) and the
 * canary's (seed 0; no prompt cache on llama.cpp). */
void attest_check_completion_body(const char *model, const char *prompt, uint32_t max_tokens,
                                  bool seed0, bool no_cache_prompt, dp_buf_t *out);

#endif
