/* The canary request (SPEC §6), in one place: the proxy's admission check (px_attest.c),
 * `detproxy diagnose` and `detproxy attest canary` all send it through here, so a hash recorded
 * with one is the hash the others compare (same body bytes, same client code, same rule for
 * which text is hashed).
 *
 * The request: POST {base}/v1/completions {"model","prompt","max_tokens","temperature":0,
 * "seed":0} on the replica's own upstream (the path client traffic takes), with the pool's
 * api_key as bearer. The text hashed: choices[0].text of a 200 answer, as sent (no trimming). */
#ifndef PROBE_CANARY_H
#define PROBE_CANARY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "config/config.h"
#include "net/client.h"

#define PROBE_CANARY_MAX_BYTES (1 << 20) /* response body cap */

typedef struct {
    bool answered;    /* HTTP 200 with a string choices[0].text */
    int status;       /* HTTP status; 0 when the exchange failed below HTTP */
    const char *text; /* the output text hashed (valid during the callback), when answered */
    size_t len;
    char sha256[65];   /* hex SHA-256 of text, when answered */
    char expected[65]; /* the expected_sha256 in force when the request was sent */
    bool matched;      /* answered and sha256 == expected */
    const char *error; /* why not answered (valid during the callback) */
} probe_canary_result_t;

typedef void (*probe_canary_cb)(const probe_canary_result_t *res, void *data);
typedef struct probe_canary_s probe_canary_t;

/* The model a canary asks for: the identity's (or manifest's) model, else the pool's first. */
const char *probe_canary_model(const cfg_pool_t *pc, const cfg_manifest_t *id);
/* A temperature-0 completion body {"model","prompt","max_tokens","temperature":0[,"seed":0]}
 * (appended to out): the canary's, and the engine-fingerprint probe's (px_attest.c, no seed). */
void probe_canary_completion_body(const char *model, const char *prompt, uint32_t max_tokens,
                                  bool seed0, dp_buf_t *out);
/* The request body, exactly as sent (appended to out). */
void probe_canary_body(const char *model, const cfg_canary_t *can, dp_buf_t *out);
/* Send the canary of accepted identity id (pc's manifest itself, or one of its "accept"
 * entries, which may carry their own; NULL means the manifest; it must have a canary) over u to
 * the replica at hostport with URL path prefix base ("" or "/prefix"). cb runs once from the
 * loop, unless cancelled. Nothing of pc or id is kept: a reload may free them meanwhile. */
probe_canary_t *probe_canary_start(net_upstream_t *u, const cfg_pool_t *pc,
                                   const cfg_manifest_t *id, const char *hostport, const char *base,
                                   probe_canary_cb cb, void *data);
void probe_canary_cancel(probe_canary_t *c);

#endif
