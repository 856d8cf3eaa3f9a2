/* Native attestation adapters (`attest.source`): read what a serving framework says about
 * itself through its own metadata endpoints, and report only what it truly exposes. Everything
 * else stays unattested, so a manifest pinning it fails closed (docs/attestation.md §5 has the
 * capability table and the response shapes these parsers rely on, with sources).
 *
 * Use: GET every path in adapter->paths from the replica's base URL (with the pool's
 * Authorization header), then call adapter->parse with the bodies in the same order. These are
 * pure parsers: no I/O, no libuv. A native report is never signed (is_signed false). */
#ifndef ATTEST_ADAPTERS_H
#define ATTEST_ADAPTERS_H

#include <stdbool.h>
#include <stddef.h>

#include "attest/report.h"
#include "common/buf.h"
#include "config/config.h"

/* Bodies larger than this are refused by the parsers; fetchers should stop reading there too.
 * SGLang's /get_server_info carries every server argument plus per-DP internal state and
 * llama.cpp's /props the whole chat template: tens of KiB in practice. */
#define ATTEST_ADAPTER_MAX_BODY ((size_t)4 << 20)
#define ATTEST_ADAPTER_MAX_PATHS 2

typedef struct {
    cfg_attest_source_t source;
    const char *name; /* "vllm", "tgi", "sglang", "llamacpp": also the framework.name reported */
    size_t npaths;
    const char *paths[ATTEST_ADAPTER_MAX_PATHS];
    /* Which paths must answer 200 for an attestation to be possible at all. */
    bool required[ATTEST_ADAPTER_MAX_PATHS];
    /* bodies[i] is the 200 response body of paths[i], or {NULL, 0} when that GET answered
     * something else (the parser then leaves the fields it would give unattested, or fails if
     * the path is required). Fills *out (cleared first, source = name) and returns 0, or returns
     * -1 with a reason like "vllm GET /v1/models: not valid JSON" appended to *why. */
    int (*parse)(const dp_iovec_t *bodies, size_t nbodies, attest_report_t *out, dp_buf_t *why);
} attest_adapter_t;

/* The engine fingerprint (docs/attestation.md §5, "The engine fingerprint"): every native
 * check also sends a 1-token completion,
 * {"model":M,"prompt":"detproxy probe","max_tokens":1,"temperature":0}, and the engine's own
 * `system_fingerprint` on the answer is attested as engine_fingerprint. */
#define ATTEST_PROBE_PROMPT "detproxy probe"
#define ATTEST_FINGERPRINT_MAX 127 /* longer values are not believed (and not carried) */

/* Set engine_fingerprint from fp (NULL clears it); a vLLM-form value
 * ("vllm-0.11.0-H100-tp8-bf16-a3b21f94") also gives framework name and version and dtype
 * when those are not already reported, plus engine_hardware and engine_tp. */
void attest_engine_fingerprint_set(attest_report_t *out, const char *fp);
/* The probe's 200 body (NULL base: the probe failed): attests system_fingerprint, or notes
 * why engine_fingerprint is unattested. */
void attest_adapter_probe_parse(const dp_iovec_t *body, attest_report_t *out);

/* llama.cpp's `GET /slots` answer: 1 when it lists slots and none `is_processing` (the engine
 * runs nothing), 0 when one is, -1 when it is not that shape (so says nothing). */
int attest_llamacpp_slots_idle(const char *body, size_t len);

/* NULL for CFG_ATTEST_NONE / CFG_ATTEST_AGENT. */
const attest_adapter_t *attest_adapter_for(cfg_attest_source_t source);
const attest_adapter_t *attest_adapter_by_name(const char *name);

#endif
