/* The features layered on the proxy path (tenant policy, audit, shadow sampling, the checks of
 * what replicas answer) behind one small interface, so the request handler (proxy.c) stays
 * about moving bytes. Every function is called from the event loop for one request. */
#ifndef PX_HOOKS_H
#define PX_HOOKS_H

#include <stdbool.h>
#include <stddef.h>

#include "common/jw.h"
#include "policy/policy.h"
#include "proxy/core/affinity.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"
#include "proxy/obs/access.h"

typedef struct {
    const char *tenant;    /* tenant name for labels and headers; "-" before matching */
    void *policy;          /* policy state (hooks.c) */
    void *shadow;          /* shadow capture (shadow.c) */
    void *span;            /* OpenTelemetry span (obs/otel.c), NULL when not sampled */
    char traceparent[56];  /* sent to the replica instead of the client's; "" = pass through */
    bool new_trace;        /* traceparent starts a new trace: the client's tracestate is dropped */
    char seed[24];         /* decimal seed sent upstream, "" when none */
    char upstream_fp[128]; /* the replica's own system_fingerprint, if it sent one */
    char fingerprint[20];  /* ours: the pool's, then that of the identity the replica was
                              admitted as (a manifest "accept" list gives several) */
    bool inference;
    bool stream;
    bool upstream_answered; /* a replica's response head arrived (its body is what is hashed) */
    bool fp_mismatch; /* upstream_fp differed from the replica's attested engine fingerprint */
    const cfg_tenant_t *tenant_cfg;
    /* detproxy's own refusal, for the audit line: static code, copied param ("" none). */
    const char *err_code;
    char err_param[64];
    uint32_t retry_after_s;       /* 429 rate_limited: the Retry-After value */
    px_affinity_t affinity;       /* routing key of an affinity pool, and where it led */
    const char *affinity_header;  /* session header seen (config string), NULL when none */
    uint64_t affinity_header_key; /* its value's digest */
} px_hooks_req_t;

typedef struct {
    int status; /* error to answer when px_hooks_inference fails */
    const char *code;
    const char *param;
    const char *message;
    px_pool_t *pool; /* on success: where to send it */
} px_hooks_result_t;

void px_hooks_init(px_hooks_req_t *h);
/* Release recycled per-request objects: this thread's (a loop thread that ends), and with
 * free_caches the shared rate buckets too (shutdown, on the control thread). */
void px_hooks_thread_free(void);
void px_hooks_free_caches(void);
const char *px_hooks_tenant(const px_hooks_req_t *h);

/* The fleet's share of every tenant's rate_limit: refills run at rate_rps / members (1: alone).
 * Any thread; the control plane sets it when the fleet's live members change. */
void px_hooks_set_rate_share(uint32_t members);

/* Every request: match a tenant, then take a token from its rate limit. 0; -1 with why set
 * when no tenant matched (401 invalid_api_key); -2 when the tenant is over its rate
 * (429 rate_limited, why and h->retry_after_s set). why is the caller's, PX_HOOKS_WHY_MAX
 * bytes: the refusal copies it. */
#define PX_HOOKS_WHY_MAX 256
int px_hooks_tenant_gate(px_hooks_req_t *h, px_t *px, px_gen_t *g, net_req_t *req,
                         char why[PX_HOOKS_WHY_MAX]);
/* An audited tenant's request about to be refused from its head alone (a route that is not
 * policed, the rate limit): it gets an audit line too, written by the refusal as any other's.
 * method must live until the request finishes; the path is copied (its first
 * POLICY_AUDIT_ROUTE_MAX bytes when longer, with its length and SHA-256). No-op for other
 * tenants. */
void px_hooks_audit_head(px_hooks_req_t *h, px_gen_t *g, const char *method, const char *path,
                         size_t path_len);
/* detproxy refused the request, or cut an answer it had begun, with code/param (param may be
 * NULL): for the audit line's "error". */
void px_hooks_refused(px_hooks_req_t *h, const char *code, const char *param);
/* The client's request is about to be let go before the audit line is written (an answer
 * begun and then cut): the forwarded body the line's store entry needs is copied now, as the
 * policy's parts point into the request's buffer. */
void px_hooks_keep_forwarded(px_hooks_req_t *h);
/* The answer began streaming, and nothing will resend the request: true when nothing of the
 * hooks' needs the forwarded body any more (the policy's parts and new bytes are let go here),
 * so the caller may let the client's body go too. false for an audited tenant, whose line
 * hashes or stores that body when the answer ends. */
bool px_hooks_forget_body(px_hooks_req_t *h);
/* Token usage seen in the response so far (prompt, completion): false when none. */
bool px_hooks_usage(const px_hooks_req_t *h, int64_t *prompt, int64_t *completion);
/* What the access log shows of the request's policy state: tenant, model, seed, usage and the
 * policy's changes (borrowed: valid until px_hooks_finish). */
void px_hooks_describe(const px_hooks_req_t *h, px_access_t *a);

/* A body is policed on the event loop when it is at most PX_POLICY_LOOP_BYTES long and its
 * parse meets at most PX_POLICY_LOOP_VALUES JSON values' worth of work (an escape an eighth of
 * one: policy_req_set_budget): what parsing, canonicalising and policing cost grows with those
 * and with the bytes hashed, so such a body holds the loop about a millisecond at most
 * (docs/policy.md, "Known limits"). Any other goes to the libuv thread pool. */
#define PX_POLICY_LOOP_BYTES (512 * 1024)
#define PX_POLICY_LOOP_VALUES 4096

typedef void (*px_hooks_policed_cb)(void *data, int rc, dp_iovec_t body, px_hooks_result_t *res);

/* Inference requests: validate and police the body, pick the pool, and set body->len to the
 * length of the body to send (body->base NULL: its bytes are px_hooks_body_parts, valid until
 * px_hooks_finish). 0, or -1 with res->status/code/param/message
 * describing the refusal; or, for a body too large or too dense for the loop, 1: the work runs
 * on the thread pool (req->body is taken over) and done(data, rc, body, res) is called on the
 * loop with the same results. px_hooks_finish must not run before it. */
int px_hooks_inference(px_hooks_req_t *h, px_t *px, px_gen_t *g, net_req_t *req,
                       policy_route_t route, dp_iovec_t *body, px_hooks_result_t *res,
                       px_hooks_policed_cb done, void *done_data);

/* The policed body to send, as pieces in order (the client's bytes and the policy's new ones,
 * written with one writev): their count, 0 before policing succeeded. */
size_t px_hooks_body_parts(const px_hooks_req_t *h, const dp_iovec_t **parts);

/* Headers every inference response carries (tenant, fingerprint, seed, affinity); out has
 * room. */
void px_hooks_response_headers(px_hooks_req_t *h, const px_pool_t *pool, net_header_t *out,
                               size_t *n);

/* Should this response be held whole and rewritten (non-streamed JSON fingerprint)? Only for
 * an answer whose type up_on_head has checked. */
bool px_hooks_hold_response(const px_hooks_req_t *h, int status);
/* A held answer longer than this is rewritten on the libuv thread pool: checking a body
 * strictly and splicing its fingerprint runs at 60 MB/s to 1 GB/s by its shape, so on the loop
 * it is held under about a millisecond, as for request bodies (docs/configuration.md,
 * max_response_rewrite_bytes). */
#define PX_REWRITE_LOOP_BYTES (64 * 1024)

/* A held answer from replica is complete: set its system_fingerprint to ours, in place, and
 * feed its bytes to what reads the response (usage, audit hash and store, shadow, trace). 0:
 * done. 1: the body is longer than PX_REWRITE_LOOP_BYTES and the work runs on the thread pool
 * (waiting, if it must, in turn with other replicas' and tenants' work); done(data) follows on
 * this loop, and until then nothing may touch h or body. */
int px_hooks_held_response(px_hooks_req_t *h, px_t *px, const px_pool_t *pool,
                           const px_replica_t *replica, dp_buf_t *body, void (*done)(void *data),
                           void *data);
/* The replica's whole answer has come: compare the fingerprint it carried with the one r
 * attested (px_hooks_before_end does this for an answer that is delivered). */
void px_hooks_check_answer(px_hooks_req_t *h, px_t *px, px_replica_t *r, int status);
/* A held answer none of which reached its client: forget what px_hooks_held_response fed of
 * it to the audit hash and store, so the line says nothing was sent. Its usage stays: the
 * replica spent those tokens (a 499 after the usage came counts them). */
void px_hooks_answer_unsent(px_hooks_req_t *h);
/* The headers the rewrite adds (the replica's own fingerprint, when it sent one). */
void px_hooks_held_headers(const px_hooks_req_t *h, net_header_t *extra, size_t *nextra);

/* The request left for replica r (the first attempt or the retry). */
void px_hooks_dispatched(px_hooks_req_t *h, px_t *px, px_pool_t *pool, px_replica_t *r,
                         const net_req_t *req, const char *body, size_t len);
/* The response is an event stream: called once, before its first body byte, so the token
 * usage scan reads it event by event (a cut event does not hide the next one's usage). */
void px_hooks_event_stream(px_hooks_req_t *h);
/* Response body bytes from the replica: returns the bytes to forward (the input itself, or a
 * rewritten copy valid until the next call of these three on this thread, for any request:
 * write or copy it first), after teeing them for shadow capture and audit hashing.
 * px_hooks_response_tail gives whatever a rewriter still holds at the end. */
dp_iovec_t px_hooks_response_bytes(px_hooks_req_t *h, const char *p, size_t n);
/* Whether px_hooks_response_bytes may change the body's length (a stream's fingerprints are
 * rewritten): the replica's Content-Length then does not hold for what is forwarded. */
bool px_hooks_rewrites_bytes(const px_hooks_req_t *h);
dp_iovec_t px_hooks_response_tail(px_hooks_req_t *h);
/* The replica's stream broke off: what a rewriter holds of the event it left half-written,
 * to forward as it came before the stream's error event. */
dp_iovec_t px_hooks_response_cut(px_hooks_req_t *h);
/* A stream of an audited tenant under log.audit_fail: closed keeps its closing event (and what
 * follows it) out of what px_hooks_response_bytes/_tail return: those bytes into *end, to send
 * once the audit line is written (empty for any other response). false when more than
 * limits.max_response_rewrite_bytes followed that event: the answer is broken, end it so. */
bool px_hooks_stream_end(px_hooks_req_t *h, dp_iovec_t *end);

/* The response is about to end with `status`. Returns true when an audit line is being written
 * and then(data) will run once it is on its way to disk (end the response there); false when
 * nothing needs waiting for. */
bool px_hooks_before_end(px_hooks_req_t *h, px_t *px, const px_pool_t *pool, px_replica_t *r,
                         int status, const char *request_id, void (*then)(void *data), void *data);
/* After px_hooks_before_end's then(): the audit line (or its stored bodies) could not be written
 * and log.audit_fail is closed, so the answer must not be delivered (503 audit_unavailable, or a
 * cut stream when its bytes were already sent). */
bool px_hooks_audit_refused(const px_hooks_req_t *h);
/* Must the answer's end wait for its audit line (an audited tenant under log.audit_fail:
 * closed)? A stream's closing event does (px_hooks_stream_end), the last byte of an answer
 * passed through does, and an answer its head alone ends is held whole. */
bool px_hooks_end_waits(const px_hooks_req_t *h);
/* An exchange with replica r failed with err. */
void px_hooks_upstream_failed(px_hooks_req_t *h, px_t *px, px_replica_t *r, net_up_err_t err);
/* The request is over (status 499 when the client went away). Releases hook state. */
void px_hooks_finish(px_hooks_req_t *h, px_t *px, px_pool_t *pool, px_replica_t *r, int status,
                     const char *request_id);

#endif
