/* probe/: the attestation check's I/O, and the canary request (docs/attestation.md §4-§6).
 *
 * One check of one replica: the requests attest_check_plan() names (attest/check.h), sent at
 * once over the caller's upstream through net_fetch; their answers read by attest_check_read();
 * for a native source then the 1-token engine-fingerprint probe completion. The callback gets
 * the outcome (UNREACHABLE, INVALID or REPORTED); the caller judges a REPORTED one with
 * attest_check_judge() against the manifest in force then. The proxy's admission
 * (proxy/control/attest.c), `detproxy diagnose` (diagnose/) and the agent's read of its co-located
 * framework (agent/agent.c) all check through here, so they agree on what an answer means.
 *
 * This is the layer between the pure attest/ (no libuv) and the programs above it; it knows
 * nothing of pools' runtime state, listeners or metrics. */
#ifndef PROBE_PROBE_H
#define PROBE_PROBE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "attest/check.h"
#include "config/config.h"
#include "net/client.h"
#include "net/fetch.h"

typedef struct probe_s probe_t;

/* Where one replica's requests go (directly, or through the admin relay: probe/relay.h): Host, the
 * path prefix before the replica's own paths, the Authorization bearer, the sender's Via line and
 * extra header lines (each NULL when unused). */
typedef struct {
    const char *hostport;
    const char *base;
    const char *bearer;
    const char *via;
    const char *extra_headers;
    bool length_required; /* for requests that take a slot: net_creq_t.length_required */
    uint32_t deadline_ms; /* the whole answer within this (net_creq_set_deadline); 0: none */
} probe_route_t;

typedef struct {
    net_upstream_t *up; /* to the agent (source agent) or to the replica; kept by the caller */
    cfg_attest_source_t source;
    const char *hostport;      /* Host header (the agent's or the replica's host:port) */
    const char *base;          /* the replica's URL path prefix ("" or "/prefix") */
    const char *agent_path;    /* source agent: attest.url's path (NULL or "": /attestation) */
    const char *bearer;        /* Authorization: Bearer, or NULL */
    const char *via;           /* the sender's Via line, or NULL */
    const char *extra_headers; /* raw "name: value\r\n" lines, or NULL */
    /* source agent: the trusted keys, read when the envelope arrives (they must outlive the
     * check; a caller reloading them in place is fine) */
    const attest_keyset_t *keys;
    bool require_signature;
    const char *model; /* native: the probe completion's model when the engine names none */
    /* native: the engine fingerprint is already known (client responses carried it since the
     * last check, or the caller could not get the replica a free slot for the completion):
     * no probe completion is sent and this value is the outcome's ("": unattested, the
     * caller found no slot and knows none). NULL: probe. */
    const char *known_fingerprint;
    /* native: take the engine fingerprint from the metadata where it names one
     * (attest_check_metadata_fingerprint) and send no probe completion then. */
    bool metadata_fingerprint;
    bool length_required; /* for the probe completion: net_creq_t.length_required */
    /* Each of the check's requests must have its whole answer within this, however it trickles
     * (net_creq_set_deadline): a replica that sends a byte now and then must not hold a check
     * open, and the identity it vouched for last, for good. 0: no bound but the timeouts. */
    uint32_t deadline_ms;
} probe_opts_t;

/* out is the probe's: the callback may move out->report or out->reasons away (zeroing what it
 * took); the rest is released after it returns. */
typedef void (*probe_cb)(attest_outcome_t *out, void *data);

/* Start a check. Strings in o are copied. cb runs once from the loop, unless cancelled. */
probe_t *probe_start(const probe_opts_t *o, probe_cb cb, void *data);
/* Cancel a running check (its callback will not run). NULL is fine. */
void probe_cancel(probe_t *p);
/* The probe completion it is waiting for (NULL: none sent, or answered), taken out of p: a
 * later probe_cancel leaves it running, and the caller owns it (net_fetch_drain it). During
 * the callback, the completion if it failed with its exchange still open (a timeout, or an
 * answer over the size cap: net_fetch_open; NULL otherwise): made a drain then, it is read on
 * to its end; else it ends when the callback returns. */
net_fetch_t *probe_take_completion(probe_t *p);
/* During the callback: the probe completion failed with no exchange left to read once the
 * engine had the whole request (closed, cut mid-answer: net_up_err_may_run), so the engine may
 * still be generating it. */
bool probe_completion_may_run(const probe_t *p);

/* The upstream options for requests to a replica (the config's upstream timeouts). */
void probe_replica_upstream_opts(const cfg_t *cfg, net_upstream_opts_t *o);
/* The upstream options for attestation requests: timeout_ms for every phase, 2 idle. */
void probe_attest_upstream_opts(const cfg_t *cfg, net_upstream_opts_t *o);
/* The most a completion sent to a replica outside client traffic (a canary, diagnose's
 * requests) may take for its whole answer: the first-byte timeout and then the idle one. */
uint32_t probe_answer_deadline_ms(const cfg_t *cfg);

/* ---- the canary (docs/attestation.md §6) ------------------------------------------------------
 * In one place: the proxy's admission check, `detproxy diagnose` and `detproxy attest canary`
 * all send it through here, so a hash recorded with one is the hash the others compare (same
 * body bytes, same client code, same rule for which text is hashed).
 *
 * The request: POST {base}/v1/completions {"model","prompt","max_tokens","temperature":0,
 * "seed":0} on the replica's own upstream (the path client traffic takes), with the pool's
 * api_key as bearer. The text hashed: choices[0].text of a 200 answer, as sent (no trimming). */

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
    /* The request, when it failed with its exchange still open (no answer within the
     * first-byte timeout, one silent mid-way, or one over the size cap: net_fetch_open): made a
     * drain during the callback (net_fetch_drain), it is read on to its end, else it ends when
     * the callback returns; NULL otherwise. */
    net_fetch_t *open;
    /* Failed otherwise once the engine had the whole request, with no whole answer (closed,
     * cut mid-answer: net_up_err_may_run): it may be generating it still. */
    bool may_run;
} probe_canary_result_t;

typedef void (*probe_canary_cb)(const probe_canary_result_t *res, void *data);
typedef struct probe_canary_s probe_canary_t;

/* The model a canary asks for: the identity's (or manifest's) model, else the pool's first. */
const char *probe_canary_model(const cfg_pool_t *pc, const cfg_manifest_t *id);
/* The request body of identity id's canary (NULL: the manifest's), exactly as sent (appended
 * to out). */
void probe_canary_body(const cfg_pool_t *pc, const cfg_manifest_t *id, dp_buf_t *out);
/* Send the canary of accepted identity id (pc's manifest itself, or one of its "accept"
 * entries, which may carry their own; NULL means the manifest; it must have a canary) over u to
 * the replica as route `to` says (strings used only during the call). cb runs once from the loop,
 * unless cancelled. Nothing of pc or id is kept: a reload may free them meanwhile. */
probe_canary_t *probe_canary_start(net_upstream_t *u, const cfg_pool_t *pc,
                                   const cfg_manifest_t *id, const probe_route_t *to,
                                   probe_canary_cb cb, void *data);
void probe_canary_cancel(probe_canary_t *c);
/* Free c but leave its request running: its fetch, which the caller owns now (it must make it
 * a drain, net_fetch_drain, or cancel it before the loop runs again). */
net_fetch_t *probe_canary_detach(probe_canary_t *c);

#endif
