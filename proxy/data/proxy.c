/* The proxy listener's handler: one px_preq_t per client request.
 *
 * Inference routes (POST /v1/completions, /v1/chat/completions) are read whole, run through
 * policy, routed by model, and sent with a fresh Content-Length; the bytes stay in memory so
 * the retry rule (docs/requests.md §2) can resend them. Everything else streams through to the
 * first pool. Responses stream back as each upstream read completes, with backpressure both ways.
 *
 * A px_preq_t has one owner and one free path (preq_finish). It ends when the client's
 * response ended (or the client went away) and no upstream exchange is left running. A
 * replica slot (replica->slots->inflight) is held exactly while preq->replica is set.
 *
 * Everything here runs on a worker (data/worker.c): a request lives and ends on the worker that
 * accepted its connection, with that worker's upstream pools, queues and caches. */
#include <assert.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/jw.h"
#include "common/log.h"
#include "common/util.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"
#include "proxy/core/self.h"
#include "proxy/data/admission.h"
#include "proxy/data/hooks.h"
#include "proxy/data/proxy.h"
#include "proxy/data/router.h"
#include "proxy/data/worker.h"
#include "proxy/obs/access.h"
#include "policy/policy.h"
#include "policy/routes.h"

typedef enum {
    ROUTE_PASS = 0,
    ROUTE_COMPLETIONS,
    ROUTE_CHAT,
    ROUTE_RESPONSES,
    ROUTE_MODELS,
    ROUTE_UNPOLICED,
} route_t;

/* The canonical path of an inference route, and the policy's name for it. */
static const char *const route_paths[] = {[ROUTE_COMPLETIONS] = "/v1/completions",
                                          [ROUTE_CHAT] = "/v1/chat/completions",
                                          [ROUTE_RESPONSES] = "/v1/responses"};

static bool is_inference(route_t r)
{
    return r == ROUTE_COMPLETIONS || r == ROUTE_CHAT || r == ROUTE_RESPONSES;
}

static policy_route_t policy_route(route_t r)
{
    return r == ROUTE_CHAT        ? POLICY_ROUTE_CHAT
           : r == ROUTE_RESPONSES ? POLICY_ROUTE_RESPONSES
                                  : POLICY_ROUTE_COMPLETIONS;
}

/* A pass-through body of known length up to this is held whole before it is sent, as an
 * inference body is, so the retry rule can resend it; a longer or chunked one streams through
 * and is never retried (docs/requests.md, "Retries"). */
#define PASS_HELD_MAX (64 * 1024)

typedef struct px_preq_s px_preq_t;

struct px_preq_s {
    px_t *px;
    px_gen_t *gen;
    net_req_t *req; /* NULL once the client is gone */
    px_pool_t *pool;
    px_replica_t *replica; /* holds a slot while set */
    px_replica_t *failed;  /* replica of the first attempt, avoided by the retry */
    net_creq_t *up;
    route_t route;
    char id[24]; /* the request id, kept after the client request is gone */
    uint64_t start_ns;
    dp_buf_t head; /* upstream request head */
    /* The body to send whole: inference (post-policy), or pass-through up to PASS_HELD_MAX. It
     * points into the policy result or the client's own body, both alive until finish(): kept
     * for the retry rule, never copied. */
    dp_iovec_t body;
    bool stream_body;
    bool policing;        /* the body is being policed on the thread pool */
    bool rewriting;       /* the held response is being rewritten there (held_rewritten) */
    uint64_t budget_held; /* the body budget kept past its client while policing (on_abort) */
    bool retried;
    bool reconnected; /* affinity: the keep-alive race was retried on the same replica */
    /* A new connection, once established and before anything is sent on it, waits for check
     * `want` of its replica (px_event_connection_checked); meanwhile the request holds its slot
     * and the connection, on this worker's list. */
    uint64_t want;
    bool conn_held;
    struct px_preq_s *cw_next, *cw_prev;
    bool cw_listed;
    uint64_t cw_until_ms;
    /* queue_timeout_ms bounds all of a request's waiting (wait_begin), in dp_now_ms: */
    uint64_t wait_since_ms; /* the wait under way began */
    uint64_t waited_ms;     /* the waits before it took */
    bool paused_upstream;
    bool client_started;
    /* An inference response streamed as SSE: a replica that fails mid-stream gets the client
     * an error event (sse_error_event). sse_tail holds the last bytes sent, to know whether
     * the stream stands between events. */
    bool sse;
    char sse_tail[4];
    size_t sse_sent;
    bool audit_wait;      /* the response's end waits for its audit line (px_hooks_before_end) */
    bool slot_drained;    /* its exchange and slot went to a drain (drain_abandoned) */
    bool finish_deferred; /* finish() came while audit_wait: the audit callback finishes */
    dp_buf_t refusal;     /* a refusal waiting for its audit line: "message\0param\0reason\0" */
    /* A held response (rewritten whole by a hook before it is sent), at most
     * limits.max_response_rewrite_bytes of it; beyond that it is passed through (release_held): */
    int held_status;
    int64_t held_cl; /* the replica's Content-Length, -1 when it did not send one */
    /* A passed-through answer framed by Content-Length: its bytes still to send (-1 when not
     * framed so). The byte that ends it is its end for the client (body_write). */
    int64_t cl_left;
    bool tail_held; /* that last byte waits for the audit line, in tail */
    /* Not a stream, no Content-Length, and its end waits for the audit line: which byte is its
     * last is known only at its end, so each write keeps its last byte back (body_write). For
     * an HTTP/1.0 client the close ends such an answer, and a cut would look whole. */
    bool tail_carried;
    bool withheld; /* cut before its end, its audit line unwritten: its tokens do not count */
    char tail;
    dp_buf_t held_hdrs; /* "name\0value\0" pairs */
    dp_buf_t held_body;
    net_header_t *held_out; /* the head to send, built by held_head */
    size_t held_nout;
    struct held_head_s *held_box; /* held_out's home when it came from the cache */
    px_admission_entry_t adm;     /* waiting for a slot (data/admission.c) */
    px_preq_t *free_next;         /* on this thread's cache of recycled contexts */
    int status;
    int up_status; /* the replica's answer's status, 0 before its head: its tokens count even
                    * when the client left before the end (count_request) */
    /* What answered, for detproxy_requests_total{code} and the access log: "upstream" (the
     * replica's response), "local" (/v1/models), "client_closed", or detproxy's error code.
     * Always a static string: the label set stays bounded. */
    const char *code;
    bool rejected; /* the server answered (413, 408, ...): on_abort must not make it a 499 */
    bool counted;  /* its metrics are in (count_request) */
    uint64_t up_start_ns, up_head_ns, up_end_ns; /* the last replica exchange */
    /* For the access log, which is written after the client request is gone: */
    char method[16];
    dp_buf_t path; /* the first 255 bytes, NUL-terminated; kept with the cached request */
    char remote[48];
    px_hooks_req_t hooks; /* policy / audit / shadow state (hooks.h) */
};

static void dispatch(px_preq_t *q);
static void finish(px_preq_t *q);
static void count_request(px_preq_t *q);
static void client_gone(px_preq_t *q);

/* Request contexts are recycled with their head buffer, so a steady stream of requests does
 * not touch malloc for them. Bounded: a burst does not pin memory forever. */
#define PREQ_CACHE_MAX 256
static _Thread_local px_preq_t *g_preq_free; /* per worker: no lock, no sharing */
static _Thread_local size_t g_npreq_free;

static px_preq_t *preq_get(void)
{
    px_preq_t *q = g_preq_free;
    if (q == NULL)
        return dp_xcalloc(1, sizeof(*q));
    g_preq_free = q->free_next;
    g_npreq_free--;
    /* Keep the buffers' capacity: a steady stream of requests reuses them. */
    dp_buf_t head = q->head, hh = q->held_hdrs, hb = q->held_body, rf = q->refusal, path = q->path;
    memset(q, 0, sizeof(*q));
    dp_buf_reset(&head);
    dp_buf_reset(&hh);
    dp_buf_reset(&hb);
    dp_buf_reset(&rf);
    dp_buf_reset(&path);
    q->head = head;
    q->held_hdrs = hh;
    q->held_body = hb;
    q->refusal = rf;
    q->path = path;
    return q;
}

/* The head of a held response is built in an array from a per-worker cache, not in the
 * request context: only a response being held has one, so a stream carries none. */
#define HELD_HEAD_MAX 32
typedef struct held_head_s {
    struct held_head_s *next;
    net_header_t h[HELD_HEAD_MAX];
} held_head_t;
static _Thread_local held_head_t *g_held_free;
static _Thread_local size_t g_nheld_free;

static void preq_free(px_preq_t *q)
{
    dp_buf_free(&q->head);
    dp_buf_free(&q->held_hdrs);
    dp_buf_free(&q->held_body);
    dp_buf_free(&q->refusal);
    dp_buf_free(&q->path);
    free(q);
}

void px_proxy_free_caches(void)
{
    while (g_held_free) {
        held_head_t *h = g_held_free;
        g_held_free = h->next;
        free(h);
    }
    g_nheld_free = 0;
    while (g_preq_free) {
        px_preq_t *q = g_preq_free;
        g_preq_free = q->free_next;
        preq_free(q);
    }
    g_npreq_free = 0;
}

static void held_out_free(px_preq_t *q);

/* Only an ended request comes back here: no upstream exchange, no slot, no place in a queue,
 * no policy or shadow state left (px_hooks_finish released them). */
static void preq_put(px_preq_t *q)
{
    assert(q->up == NULL && q->replica == NULL && !q->adm.queued);
    assert(q->hooks.policy == NULL && q->hooks.shadow == NULL && q->hooks.span == NULL);
    held_out_free(q);
    if (q->held_body.cap > 64 * 1024)
        dp_buf_free(&q->held_body);
    if (g_npreq_free >= PREQ_CACHE_MAX || q->head.cap > 16384 || q->held_hdrs.cap > 16384 ||
        q->refusal.cap > 16384) {
        preq_free(q);
        return;
    }
    q->free_next = g_preq_free;
    g_preq_free = q;
    g_npreq_free++;
}

/* ---- errors ------------------------------------------------------------------------------- */

#define PX_EXTRA_HEADERS 9 /* room callers leave for extra_headers() */

static void extra_headers(px_preq_t *q, net_header_t *h, size_t *n)
{
    h[(*n)++] = (net_header_t){DP_IOV("x-detproxy-request-id"), {q->req->id, strlen(q->req->id)}};
    if (q->replica)
        h[(*n)++] = (net_header_t){DP_IOV("x-detproxy-replica"),
                                   {q->replica->name, strlen(q->replica->name)}};
    px_hooks_response_headers(&q->hooks, q->pool, h, n);
}

static void retry_after_header(px_preq_t *q, net_header_t *h, size_t *n, char buf[12])
{
    if (q->status != 429 || q->hooks.retry_after_s == 0)
        return;
    snprintf(buf, 12, "%u", q->hooks.retry_after_s);
    h[(*n)++] = (net_header_t){DP_IOV("retry-after"), {buf, strlen(buf)}};
}

/* Send the refusal fail_client prepared: at once, or from the audit callback once its audit
 * line is written (an audited client never holds an answer whose line is not on its way to
 * disk, refusals included). Finishes q only when finish() was deferred to it. */
static void send_refusal(void *data)
{
    px_preq_t *q = data;
    bool waited = q->audit_wait;
    q->audit_wait = false;
    if (q->req) {
        const char *message = q->refusal.base;
        const char *param = message + strlen(message) + 1;
        const char *reason = param + strlen(param) + 1;
        net_header_t h[PX_EXTRA_HEADERS];
        size_t n = 0;
        char ra[12];
        extra_headers(q, h, &n);
        retry_after_header(q, h, &n, ra);
        dp_jw_t *w = dp_log_begin(q->status >= 500 ? DP_LOG_WARN : DP_LOG_INFO, "request_failed");
        if (w) {
            dp_jw_str(w, "request_id", q->req->id);
            dp_jw_int(w, "status", q->status);
            dp_jw_str(w, "code", q->code);
            dp_jw_str(w, "reason", reason);
            if (q->pool)
                dp_jw_str(w, "pool", q->pool->name);
            if (q->replica)
                dp_jw_str(w, "replica", q->replica->name);
            dp_log_end(w);
        }
        count_request(q); /* before the answer: a client that reads it sees it counted */
        net_resp_error(q->req, q->status, NULL, q->code, param[0] ? param : NULL, message, h, n);
        q->req = NULL;
    }
    if (waited && q->finish_deferred)
        finish(q);
}

/* Answer the client with an OpenAI-shaped error (if it is still there and nothing was sent).
 * The caller calls finish(q) next, as always; for an audited tenant the answer (and the
 * finish) may wait for the audit line. The log line gives `reason`, which may say more than
 * the client is told. */
static void fail_client_why(px_preq_t *q, int status, const char *code, const char *param,
                            const char *message, const char *reason)
{
    q->status = status;
    q->code = code;
    px_hooks_refused(&q->hooks, code, param);
    if (q->req == NULL)
        return;
    if (q->client_started) {
        px_hooks_keep_forwarded(&q->hooks); /* the request goes before the audit line */
        net_resp_abort(q->req);
        q->req = NULL;
        return;
    }
    /* message and param may live in buffers reused before the audit line is written. */
    dp_buf_reset(&q->refusal);
    dp_buf_appends(&q->refusal, message ? message : "");
    dp_buf_appendc(&q->refusal, '\0');
    dp_buf_appends(&q->refusal, param ? param : "");
    dp_buf_appendc(&q->refusal, '\0');
    dp_buf_appends(&q->refusal, reason ? reason : "");
    dp_buf_appendc(&q->refusal, '\0');
    /* Set before the call: the audit module may run the callback from inside it. */
    q->audit_wait = true;
    if (px_hooks_before_end(&q->hooks, q->px, q->pool, q->replica, status, q->id, send_refusal, q))
        return;
    q->audit_wait = false;
    send_refusal(q);
}

static void fail_client(px_preq_t *q, int status, const char *code, const char *param,
                        const char *message)
{
    fail_client_why(q, status, code, param, message, message);
}

/* 503 no_attested_replica (all_replicas_drained when operators took every admitted one out).
 * Why each replica is out (`quantization mismatch: got gptq want
 * awq`) describes the fleet to whoever asks: the client is told the pool and its request id
 * only; the reasons go to the log and stay on the admin listener (docs/requests.md §4). */
static void fail_unavailable(px_preq_t *q)
{
    dp_buf_t why = {0}, msg = {0};
    px_pool_why_unavailable(q->pool, &why);
    /* A tenant that requires a determinism mode learns that this is what is missing (the
     * replicas' own reasons stay in the log and on the admin listener, as for everyone). */
    const cfg_tenant_t *t = q->hooks.tenant_cfg;
    const char *code = "no_attested_replica";
    if (px_pool_all_drained(q->pool)) {
        code = "all_replicas_drained";
        dp_buf_printf(&msg,
                      "every attested replica of pool %s is drained by an operator (request id "
                      "%s)",
                      q->pool->name, q->id);
    } else if (t && t->require_determinism != CFG_DETERMINISM_NONE) {
        dp_buf_printf(&msg,
                      "no attested replica is available in pool %s, whose determinism.mode "
                      "\"%s\" this tenant requires (request id %s)",
                      q->pool->name, cfg_determinism_names[t->require_determinism], q->id);
    } else {
        dp_buf_printf(&msg, "no attested replica is available in pool %s (request id %s)",
                      q->pool->name, q->id);
    }
    fail_client_why(q, 503, code, NULL, msg.base, why.base ? why.base : "");
    dp_buf_free(&why);
    dp_buf_free(&msg);
}

/* ---- slots and the admission queue ------------------------------------------------------- */

static void slot_release(px_preq_t *q)
{
    px_replica_t *r = q->replica;
    if (r == NULL)
        return;
    q->replica = NULL;
    px_replica_put_slot(r);
    px_replica_unref(r);
    px_admission_slot_freed(q->pool);
}

static px_preq_t *queued_request(px_admission_entry_t *e)
{
    return (px_preq_t *)((char *)e - offsetof(px_preq_t, adm));
}

/* A wait for a slot or for a check begins: when it must end. queue_timeout_ms bounds the sum
 * of a request's waits, not each one: a request routed again after its replica left service
 * while it waited, or retried, waits only for what is left, so a replica that keeps failing
 * its checks cannot keep a client waiting a multiple of it. */
static uint64_t wait_begin(px_preq_t *q, uint64_t now_ms)
{
    uint64_t t = q->pool->cfg->queue_timeout_ms;
    q->wait_since_ms = now_ms;
    return now_ms + (q->waited_ms < t ? t - q->waited_ms : 0);
}

static void wait_end(px_preq_t *q)
{
    q->waited_ms += dp_now_ms() - q->wait_since_ms;
}

static void queue_granted(px_admission_entry_t *e, px_replica_t *r)
{
    px_preq_t *q = queued_request(e);
    wait_end(q);
    q->replica = r; /* the pick took its slot */
    dispatch(q);
}

static void fail_queue_timeout(px_preq_t *q, const char *message)
{
    fail_client(q, 504, "queue_timeout", NULL, message);
    finish(q);
}

static void queue_expired(px_admission_entry_t *e)
{
    fail_queue_timeout(queued_request(e),
                       "timed out waiting for a replica slot (max_inflight_per_replica)");
}

static void queue_unavailable(px_admission_entry_t *e)
{
    px_preq_t *q = queued_request(e);
    fail_unavailable(q);
    finish(q);
}

static const px_admission_ops_t queue_ops = {queue_granted, queue_expired, queue_unavailable};

/* ---- upstream request --------------------------------------------------------------------- */

/* Build the request head for replica r: origin-form target under the replica's path prefix,
 * its Host, the client's end-to-end headers minus the tenant's credential, our framing. */
static void build_head(px_preq_t *q, px_replica_t *r)
{
    net_req_t *req = q->req;
    dp_buf_t *h = &q->head;
    dp_buf_reset(h);
    dp_buf_reserve(h, 512 + req->target.len);
    dp_buf_append(h, req->method_name.base, req->method_name.len);
    dp_buf_appendc(h, ' ');
    dp_buf_appends(h, r->url.path ? r->url.path : "");
    if (is_inference(q->route)) {
        /* The canonical route (a trailing '/' dropped: a replica would only redirect), then
         * the query as the client sent it. */
        dp_buf_appends(h, route_paths[q->route]);
        dp_buf_append(h, req->path.base + req->path.len, req->target.len - req->path.len);
    } else {
        dp_buf_append(h, req->target.base, req->target.len);
    }
    dp_buf_append(h, " HTTP/1.1\r\nhost: ", 17);
    dp_buf_appends(h, r->url.hostport);
    dp_buf_append(h, "\r\n", 2);
    const net_header_t *conn = net_req_header(req, "connection");
    const dp_iovec_t *connv = conn ? &conn->value : NULL;
    const net_header_t *xff = NULL;
    for (size_t i = 0; i < req->nheaders; i++) {
        const net_header_t *x = &req->headers[i];
        const char *n = x->name.base;
        size_t l = x->name.len;
        if (net_header_is_hop(n, l, connv) || dp_strieq(n, l, "host") ||
            dp_strieq(n, l, "authorization") || dp_strieq(n, l, "expect") ||
            (is_inference(q->route) && dp_strieq(n, l, "accept-encoding")) ||
            (l > 11 && dp_memieq(n, "x-detproxy-", 11)) ||
            (q->hooks.traceparent[0] && dp_strieq(n, l, "traceparent")) ||
            (q->hooks.new_trace && dp_strieq(n, l, "tracestate")))
            continue;
        if (dp_strieq(n, l, "x-forwarded-for")) {
            xff = x;
            continue;
        }
        dp_buf_append(h, n, l);
        dp_buf_append(h, ": ", 2);
        dp_buf_append(h, x->value.base, x->value.len);
        dp_buf_append(h, "\r\n", 2);
    }
    /* The client's Authorization is a tenant credential for detproxy, never the replica's. */
    const cfg_pool_t *pc = q->pool->cfg;
    if (pc->api_key) {
        dp_buf_append(h, "authorization: Bearer ", 22);
        dp_buf_appends(h, pc->api_key);
        dp_buf_append(h, "\r\n", 2);
    }
    dp_buf_append(h, "x-forwarded-for: ", 17);
    if (xff) {
        dp_buf_append(h, xff->value.base, xff->value.len);
        dp_buf_append(h, ", ", 2);
    }
    const char *colon = strrchr(req->remote, ':');
    dp_buf_append(h, req->remote, colon ? (size_t)(colon - req->remote) : strlen(req->remote));
    dp_buf_append(h, "\r\nx-detproxy-request-id: ", 25);
    dp_buf_appends(h, req->id);
    dp_buf_append(h, "\r\n", 2);
    size_t vl;
    const char *via = px_self_via_line(&vl);
    dp_buf_append(h, via, vl);     /* after the client's own Via lines: order is the path */
    if (q->hooks.traceparent[0]) { /* W3C trace context: this request's span is the parent */
        dp_buf_append(h, "traceparent: ", 13);
        dp_buf_appends(h, q->hooks.traceparent);
        dp_buf_append(h, "\r\n", 2);
    }
    if (is_inference(q->route)) {
        /* An answer detproxy rewrites and checks must come uncoded; with no Accept-Encoding at
         * all a server may pick any coding (RFC 9110 §12.5.3). */
        dp_buf_append(h, "accept-encoding: identity\r\ncontent-length: ", 43);
        dp_buf_append_u64(h, q->body.len);
        dp_buf_append(h, "\r\n", 2);
    } else if (req->chunked) {
        dp_buf_append(h, "transfer-encoding: chunked\r\n", 28);
    } else if (req->content_length >= 0) {
        dp_buf_append(h, "content-length: ", 16);
        dp_buf_append_u64(h, (uint64_t)req->content_length);
        dp_buf_append(h, "\r\n", 2);
    }
    dp_buf_append(h, "\r\n", 2);
}

static void up_on_head(net_creq_t *c, int status, const net_header_t *hdrs, size_t n,
                       const net_framing_t *f);
static void up_on_body(net_creq_t *c, const char *p, size_t n);
static void up_on_done(net_creq_t *c, net_up_err_t err, const char *detail);
static void up_done(px_preq_t *q, net_up_err_t err, const char *detail);
static void up_on_timeout(net_creq_t *c, net_up_err_t err, const char *detail);
static bool drain_abandoned(px_preq_t *q);
static void hold_after_close(px_preq_t *q);
static void up_on_drain(net_creq_t *c);

static void up_on_connected(net_creq_t *c);

/* The head (q->head), the body (the server's, until the request is freed) and the policy's
 * parts (px_hooks_finish) all outlive the exchange: finish() and on_abort cancel it first. So a
 * new connection sends them from where they lie. */
static const net_creq_cb_t up_cb = {.on_head = up_on_head,
                                    .on_body = up_on_body,
                                    .on_done = up_on_done,
                                    .on_drain = up_on_drain,
                                    .start_bufs_kept = true,
                                    .on_timeout = up_on_timeout};
/* A new connection to an attested replica: held once established, until its check. */
static const net_creq_cb_t up_cb_held = {.on_head = up_on_head,
                                         .on_body = up_on_body,
                                         .on_done = up_on_done,
                                         .on_drain = up_on_drain,
                                         .on_connected = up_on_connected,
                                         .start_bufs_kept = true,
                                         .on_timeout = up_on_timeout};

/* A retry, or a request routed again after the keep-alive race: it goes over a new connection,
 * as the connections pooled beside the one that failed may be as stale, on this replica or on
 * another that closes its idle connections the same way (docs/requests.md, "Retries"). */
static bool resent(const px_preq_t *q)
{
    return q->retried || q->reconnected;
}

/* Send the request to q->replica, whose slot q holds. */
static void send_upstream(px_preq_t *q)
{
    px_replica_t *r = q->replica;
    q->up_start_ns = dp_now_ns();
    q->up_head_ns = q->up_end_ns = 0;
    atomic_fetch_add_explicit(&r->requests, 1, memory_order_relaxed);
    build_head(q, r);
    uv_buf_t bufs[1 + POLICY_MAX_PARTS];
    unsigned nb = 0;
    bufs[nb++] = uv_buf_init(q->head.base, (unsigned)q->head.len);
    const dp_iovec_t *parts;
    size_t np = px_hooks_body_parts(&q->hooks, &parts);
    /* A policed body goes out as it lies: the client's bytes with the policy's few new ones
     * between them, in one writev with the head. */
    for (size_t i = 0; i < np; i++)
        bufs[nb++] = uv_buf_init((char *)parts[i].base, (unsigned)parts[i].len);
    if (np == 0 && q->body.len)
        bufs[nb++] = uv_buf_init((char *)q->body.base, (unsigned)q->body.len);
    q->up = (resent(q) ? net_creq_start_new : net_creq_start)(
        px_worker_upstream(r, q->gen), bufs, nb, q->stream_body, q->req->method == 2 /* HEAD */,
        q->conn_held ? &up_cb_held : &up_cb, q);
    q->up->length_required = px_replica_drains_abandoned(r);
    if (q->stream_body && !q->conn_held)
        net_req_resume_body(q->req);
}

/* q holds a slot on q->replica (and a reference): send it there (over a held new connection,
 * px_event_pooled_ok false: it is dispatched once its check lets it go). */
static void started(px_preq_t *q)
{
    send_upstream(q);
    if (!q->conn_held)
        px_hooks_dispatched(&q->hooks, q->px, q->pool, q->replica, q->req, q->body.base,
                            q->body.len);
}

/* Its check let a held request go: what waits on its connection is sent. */
static void conn_release(px_preq_t *q)
{
    q->conn_held = false;
    net_creq_release(q->up);
    if (q->stream_body)
        net_req_resume_body(q->req);
    px_hooks_dispatched(&q->hooks, q->px, q->pool, q->replica, q->req, q->body.base, q->body.len);
}

/* A held request that will not be sent where it waited: its connection is closed unused. */
static void conn_drop(px_preq_t *q)
{
    if (q->up) {
        net_creq_cancel(q->up);
        q->up = NULL;
    }
    if (q->conn_held && q->replica)
        atomic_fetch_sub_explicit(&q->replica->requests, 1, memory_order_relaxed);
    q->conn_held = false;
}

/* r's slot is taken (px_router_pick): q holds it from here. */
static void start_on(px_preq_t *q, px_replica_t *r)
{
    px_replica_ref(r);
    q->replica = r;
    started(q);
}

void px_proxy_count_overload(const char *reason)
{
    px_metrics_add(px_metrics_get("detproxy_overload_rejections_total", "reason", reason, NULL), 1);
}

/* ---- requests waiting for the check their new connection needs (core/event.h) ---------- */

static _Thread_local px_preq_t *t_cwait;
/* cwait_look's place in the list: the next waiter it looks at (kept right when that one
 * leaves the list while another is settled). */
static _Thread_local px_preq_t *t_cw_next;

/* Waiting requests look again this often even with no verdict to wake them: an ask a full
 * mailbox dropped is made again, and queue_timeout_ms is kept to within this. */
#define CWAIT_LOOK_MS 50

static void cwait_look(void);

static void cwait_timer_cb(uv_timer_t *t)
{
    (void)t;
    cwait_look();
}

static void cwait_push(px_preq_t *q)
{
    q->cw_prev = NULL;
    q->cw_next = t_cwait;
    uv_timer_t *t = px_worker_cwtimer();
    if (t_cwait)
        t_cwait->cw_prev = q;
    else if (t)
        uv_timer_start(t, cwait_timer_cb, CWAIT_LOOK_MS, CWAIT_LOOK_MS);
    t_cwait = q;
    q->cw_listed = true;
    q->cw_until_ms = wait_begin(q, dp_now_ms());
    atomic_fetch_add(&q->px->conn_waiting, 1);
}

static void cwait_remove(px_preq_t *q)
{
    if (!q->cw_listed)
        return;
    if (t_cw_next == q)
        t_cw_next = q->cw_next;
    if (q->cw_prev)
        q->cw_prev->cw_next = q->cw_next;
    else
        t_cwait = q->cw_next;
    if (q->cw_next)
        q->cw_next->cw_prev = q->cw_prev;
    q->cw_next = q->cw_prev = NULL;
    q->cw_listed = false;
    wait_end(q);
    atomic_fetch_sub(&q->px->conn_waiting, 1);
    uv_timer_t *t = px_worker_cwtimer();
    if (t_cwait == NULL && t)
        uv_timer_stop(t);
}

static void dispatch(px_preq_t *q);

/* One waiting request whose wait is over: its check let it through (sent), its replica left
 * service (routed again) or it waited queue_timeout_ms (504). False: it waits on. */
static bool cwait_settle(px_preq_t *q, uint64_t now_ms)
{
    px_replica_t *r = q->replica;
    bool serving = px_replica_serving(r);
    if (serving && px_event_connection_checked(q->px, r, &q->want)) {
        /* The verdict it waited for may have taken r out of service: the state is written
         * before the check is settled, so it is read again after. */
        serving = px_replica_serving(r);
        if (serving) {
            cwait_remove(q);
            conn_release(q);
            return true;
        }
    }
    if (!serving) {
        cwait_remove(q);
        conn_drop(q);
        slot_release(q);
        dispatch(q);
    } else if (now_ms >= q->cw_until_ms) {
        cwait_remove(q);
        conn_drop(q);
        slot_release(q);
        fail_client(q, 504, "queue_timeout", NULL,
                    "timed out waiting for the replica's check before a new connection to it");
        finish(q);
    } else {
        return false;
    }
    return true;
}

/* A held new connection is up: it waits for a check begun from now on. */
static void up_on_connected(net_creq_t *c)
{
    px_preq_t *q = c->data;
    q->want = 0;
    cwait_push(q);
    /* A verdict that came between the look above and the push woke no one (settle() saw no
     * waiter): the first look is made now that the wait is counted. */
    cwait_settle(q, dp_now_ns() / 1000000u);
}

/* A verdict came (or another wake-up): look at each of this worker's waiting requests once.
 * Settling one may change the list: the settled one leaves it, and what it set off may add
 * waiters at the head (each looked at when it came: up_on_connected) or take others out
 * (cwait_remove moves the place on). So a look is O(n) however many settle, where starting
 * over after each was O(n^2) with many waiters in front of the settled ones. A look never
 * runs inside another: it is called from the worker's timer and from its wake-up, both
 * callbacks of the loop, and verdicts reach a worker through that wake-up. The clock is read
 * again after each settle: one may take a while (a request routed again starts on another
 * replica). */
static void cwait_look(void)
{
    uint64_t now_ms = dp_now_ns() / 1000000u;
    for (px_preq_t *q = t_cwait; q; q = t_cw_next) {
        t_cw_next = q->cw_next;
        if (cwait_settle(q, now_ms))
            now_ms = dp_now_ns() / 1000000u;
    }
}

static void worker_wake(void)
{
    px_admission_dispatch_waiting();
    cwait_look();
}

static void dispatch(px_preq_t *q)
{
    int why = 0;
    /* From the queue, the slot came with the wake-up. */
    px_replica_t *r = q->replica;
    q->replica = NULL;
    if (r == NULL)
        r = px_router_pick(q->pool, q->failed, &q->hooks.affinity, &why);
    /* A new connection to an attested r is opened at once and held: nothing is sent on it
     * until a check of r begun after it was established has its verdict (up_on_connected;
     * requests over r's pooled connections go on meanwhile). The request keeps its slot on r,
     * so that a replica gets its first connection rather than lose every request to replicas
     * already connected. */
    if (r) {
        q->conn_held = !px_event_pooled_ok(r, px_worker_upstream(r, q->gen), !resent(q));
        if (q->conn_held && q->stream_body)
            net_req_pause_body(q->req);
        start_on(q, r);
        return;
    }
    if (why == 0) {
        fail_unavailable(q);
        finish(q);
        return;
    }
    if (atomic_load(&q->pool->waiting) >= q->pool->cfg->queue_limit) {
        px_proxy_count_overload("queue_full");
        fail_client(q, 503, "overloaded", NULL,
                    "every replica is at max_inflight_per_replica or held for a re-check, and "
                    "the queue is full");
        finish(q);
        return;
    }
    uint64_t now_ms = dp_now_ms(), until = wait_begin(q, now_ms);
    if (now_ms >= until) { /* routed again with nothing left of its wait */
        fail_queue_timeout(q, "timed out: its waits for replica slots and for checks of new "
                              "connections took queue_timeout_ms");
        return;
    }
    if (q->stream_body)
        net_req_pause_body(q->req);
    q->adm.wait_ms = until - now_ms;
    q->adm.pool = q->pool;
    q->adm.aff = &q->hooks.affinity;
    q->adm.ops = &queue_ops;
    px_admission_push(&q->adm);
    /* A slot freed on another worker between the pick and the push: hand it out now, to this
     * queue's oldest or (woken) to an older waiter on another worker. q may be gone after. */
    px_admission_serve(q->pool);
}

/* ---- upstream callbacks ------------------------------------------------------------------- */

/* The end-to-end headers of a response: drop hop-by-hop ones, our own names (a replica may not
 * speak for detproxy) and Date (the server adds its own). */
static bool forward_response_header(const net_header_t *h, const dp_iovec_t *connv)
{
    const char *nm = h->name.base;
    size_t l = h->name.len;
    return !(net_header_is_hop(nm, l, connv) || dp_strieq(nm, l, "date") ||
             (l > 11 && dp_memieq(nm, "x-detproxy-", 11)));
}

static const dp_iovec_t *connection_value(const net_header_t *hdrs, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (dp_strieq(hdrs[i].name.base, hdrs[i].name.len, "connection"))
            return &hdrs[i].value;
    return NULL;
}

/* Remember the last bytes of an SSE stream sent to the client. */
static void sse_track(px_preq_t *q, const char *p, size_t n)
{
    if (!q->sse || n == 0)
        return;
    size_t keep = sizeof(q->sse_tail);
    if (n >= keep) {
        memcpy(q->sse_tail, p + n - keep, keep);
    } else {
        memmove(q->sse_tail, q->sse_tail + n, keep - n);
        memcpy(q->sse_tail + keep - n, p, n);
    }
    q->sse_sent += n;
}

/* The stream stands between two events: nothing sent yet, or the last line was empty. */
static bool sse_at_boundary(const px_preq_t *q)
{
    const char *t = q->sse_tail;
    if (q->sse_sent == 0)
        return true;
    if (q->sse_sent >= 2 && ((t[2] == '\n' && t[3] == '\n') || (t[2] == '\r' && t[3] == '\r')))
        return true;
    return q->sse_sent >= 3 && t[1] == '\n' && t[2] == '\r' && t[3] == '\n';
}

/* The replica failed mid-stream: tell the client in the stream itself, as OpenAI's API does
 * (`data: {"error":{...}}`), before the response ends without its last chunk. An event the
 * replica left half-written is ended first, so the error is an event of its own. */
static void sse_error_event(px_preq_t *q, const char *message)
{
    dp_buf_t b = {0};
    if (!sse_at_boundary(q))
        dp_buf_append(&b, "\n\n", 2);
    dp_buf_append(&b, "data: ", 6);
    net_error_body(&b, "server_error", "upstream_error", NULL, message);
    dp_buf_append(&b, "\n\n", 2);
    net_resp_write(q->req, b.base, b.len);
    dp_buf_free(&b);
}

/* The media type of a head's Content-Type, parameters (after ';') aside, in *media ("" when
 * there is none); returns how many there are, a list in one field ("a, b") counting two. */
static int content_media(const net_header_t *hdrs, size_t n, dp_iovec_t *media)
{
    int count = 0;
    *media = (dp_iovec_t){"", 0};
    for (size_t i = 0; i < n; i++) {
        if (!dp_strieq(hdrs[i].name.base, hdrs[i].name.len, "content-type"))
            continue;
        if (count++ > 0)
            continue;
        const dp_iovec_t *v = &hdrs[i].value;
        const char *semi = memchr(v->base, ';', v->len);
        *media = dp_trim_ows((dp_iovec_t){v->base, semi ? (size_t)(semi - v->base) : v->len});
        if (memchr(v->base, ',', v->len))
            count++;
    }
    return count;
}

/* Why a successful answer to an inference request cannot be checked, or NULL. Its fingerprint
 * is rewritten and compared, and its usage read, in a JSON body or in an event stream, the one
 * the request asked for; a coded body (detproxy asks for identity) or the other type would
 * pass all of that by unread (docs/requests.md §2). */
static const char *unverifiable_answer(const px_preq_t *q, const net_header_t *hdrs, size_t n)
{
    if (net_content_coded(hdrs, n))
        return "the answer has a Content-Encoding, which detproxy did not ask for and cannot "
               "check";
    dp_iovec_t media;
    /* A reader takes the first; a client may take another. */
    if (content_media(hdrs, n, &media) > 1)
        return "the answer has more than one Content-Type";
    if (q->hooks.stream)
        return dp_strieq(media.base, media.len, "text/event-stream")
                   ? NULL
                   : "a streamed request was answered without Content-Type text/event-stream";
    return dp_strieq(media.base, media.len, "application/json")
               ? NULL
               : "the answer's Content-Type is not application/json";
}

/* The answer goes to the client as it arrives, content_length bytes of it (-1: unknown, the
 * end comes with the exchange's): what body_write needs to find its last byte. */
static void pass_through(px_preq_t *q, int64_t content_length)
{
    q->cl_left = content_length;
    q->tail_carried = content_length < 0 && !q->sse && px_hooks_end_waits(&q->hooks);
}

static void up_on_head(net_creq_t *c, int status, const net_header_t *hdrs, size_t n,
                       const net_framing_t *f)
{
    px_preq_t *q = c->data;
    if (q->req == NULL)
        return;
    const char *unverifiable = NULL;
    if (is_inference(q->route) && status >= 200 && status < 300 &&
        (unverifiable = unverifiable_answer(q, hdrs, n)) != NULL) {
        /* The client gets a 502. On a pool that keeps its engine's slot while an abandoned
         * answer runs, the answer is read to its end and dropped, so the slot is free when it
         * ends rather than kept blind for a drain's time; else the exchange ends here. */
        if (drain_abandoned(q))
            up_done(q, NET_UP_PROTOCOL, unverifiable);
        else
            c->refuse = unverifiable; /* up_on_done answers the client 502 */
        return;
    }
    q->status = status;
    q->up_status = status;
    q->code = "upstream";
    q->up_head_ns = dp_now_ns();
    q->hooks.upstream_answered = true;
    const dp_iovec_t *connv = connection_value(hdrs, n);
    /* A response announced larger than what may be held is passed through from the start. */
    bool hold = px_hooks_hold_response(&q->hooks, status) &&
                (f->content_length < 0 ||
                 (uint64_t)f->content_length <= q->gen->cfg->limits.max_response_rewrite_bytes);
    /* One whose head alone ends it is complete for its client once the head is sent: the
     * request is counted first, and when its end waits for the audit line (body_write) the
     * head is held with its empty body, as an answer to rewrite is. */
    bool head_only = f->content_length == 0 || net_resp_bodiless(q->req, status);
    if (hold || (head_only && px_hooks_end_waits(&q->hooks))) {
        /* Keep a copy of the head; the response is sent whole once the body is rewritten. */
        q->held_status = status;
        q->held_cl = f->content_length;
        for (size_t i = 0; i < n; i++) {
            if (!forward_response_header(&hdrs[i], connv))
                continue;
            dp_buf_append(&q->held_hdrs, hdrs[i].name.base, hdrs[i].name.len);
            dp_buf_appendc(&q->held_hdrs, '\0');
            dp_buf_append(&q->held_hdrs, hdrs[i].value.base, hdrs[i].value.len);
            dp_buf_appendc(&q->held_hdrs, '\0');
        }
        return;
    }
    net_header_t stackh[64];
    size_t cap = n + PX_EXTRA_HEADERS;
    net_header_t *out = cap <= 64 ? stackh : dp_xmalloc(cap * sizeof(*out));
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (forward_response_header(&hdrs[i], connv))
            out[k++] = hdrs[i];
    extra_headers(q, out, &k);
    q->client_started = true;
    /* A successful streamed answer got here only as text/event-stream (unverifiable_answer). */
    q->sse = is_inference(q->route) && status >= 200 && status < 300 && q->hooks.stream;
    if (q->sse)
        px_hooks_event_stream(&q->hooks);
    /* A stream framed by Content-Length changes length as its fingerprints are rewritten:
     * forwarded without one (chunked, or close-delimited to an HTTP/1.0 client). */
    pass_through(q, px_hooks_rewrites_bytes(&q->hooks) ? -1 : f->content_length);
    if (head_only)
        count_request(q);
    net_resp_start(q->req, status, out, k, q->cl_left);
    if (out != stackh)
        free(out);
    /* An answer of unknown length may stream for minutes. What only the sending needed is let
     * go now rather than held that long: begun, this answer is never resent. The client's body
     * goes too, with its share of the body budget, unless an audit line still needs it. */
    if (f->content_length < 0 && !net_creq_lends(c)) {
        dp_buf_free(&q->head);
        if (q->req && px_hooks_forget_body(&q->hooks)) {
            net_req_drop_body(q->req);
            q->body = (dp_iovec_t){NULL, 0};
        }
    }
}

/* Build the head of a held response into q->held_out: the replica's kept headers, then (when
 * rewrite) the rewritten body's, then ours. */
static void held_head(px_preq_t *q, bool rewrite)
{
    size_t nh = 0;
    for (size_t i = 0; i < q->held_hdrs.len; i++)
        nh += q->held_hdrs.base[i] == '\0';
    nh /= 2;
    size_t need = nh + 2 * PX_EXTRA_HEADERS;
    net_header_t *out;
    if (need <= HELD_HEAD_MAX) {
        held_head_t *box = g_held_free;
        if (box) {
            g_held_free = box->next;
            g_nheld_free--;
        } else {
            box = dp_xmalloc(sizeof(*box));
        }
        q->held_box = box;
        out = box->h;
    } else {
        out = dp_xmalloc(need * sizeof(*out));
    }
    size_t k = 0;
    const char *p = q->held_hdrs.base, *end = p + q->held_hdrs.len;
    while (p < end) {
        size_t nl = strlen(p);
        const char *v = p + nl + 1;
        size_t vl = strlen(v);
        out[k++] = (net_header_t){{p, nl}, {v, vl}};
        p = v + vl + 1;
    }
    if (rewrite)
        px_hooks_held_headers(&q->hooks, out, &k);
    extra_headers(q, out, &k);
    q->held_out = out;
    q->held_nout = k;
}

static void held_out_free(px_preq_t *q)
{
    held_head_t *box = q->held_box;
    if (box && g_nheld_free < PREQ_CACHE_MAX) {
        box->next = g_held_free;
        g_held_free = box;
        g_nheld_free++;
    } else if (box) {
        free(box);
    } else {
        free(q->held_out);
    }
    q->held_box = NULL;
    q->held_out = NULL;
}

static void body_write(px_preq_t *q, const char *b, size_t n);

/* The held response outgrew limits.max_response_rewrite_bytes: send what is held unchanged
 * and stream the rest, as for a response that was never held. The audit hash (teed by
 * px_hooks_response_bytes) still covers every byte; the body keeps the replica's own
 * system_fingerprint (the pool's is in x-detproxy-fingerprint). */
static void release_held(px_preq_t *q)
{
    held_head(q, false);
    q->client_started = true;
    net_resp_start(q->req, q->held_status, q->held_out, q->held_nout, q->held_cl);
    pass_through(q, q->held_cl);
    held_out_free(q);
    q->held_status = 0;
    dp_iovec_t v = px_hooks_response_bytes(&q->hooks, q->held_body.base, q->held_body.len);
    if (q->req)
        body_write(q, v.base, v.len);
    dp_buf_free(&q->held_body);
    dp_buf_free(&q->held_hdrs);
}

/* Pass answer bytes on. With Content-Length, the bytes that complete the body end the answer
 * for its client (who may then read the metrics): the request is counted first; and one whose
 * end waits for its audit line (as a held answer does) keeps its last byte for deliver(). */
static void body_write(px_preq_t *q, const char *b, size_t n)
{
    if (q->cl_left >= 0 && (uint64_t)q->cl_left <= n) {
        if (n > 0 && px_hooks_end_waits(&q->hooks)) {
            q->tail = b[--n];
            q->tail_held = true;
        } else {
            count_request(q);
        }
        q->cl_left = -1;
    } else if (q->cl_left > 0) {
        q->cl_left -= (int64_t)n;
    } else if (q->tail_carried && n > 0) {
        if (q->tail_held)
            net_resp_write(q->req, &q->tail, 1);
        q->tail = b[--n];
        q->tail_held = true;
    }
    net_resp_write(q->req, b, n);
}

static void up_on_body(net_creq_t *c, const char *p, size_t n)
{
    px_preq_t *q = c->data;
    if (q->req == NULL)
        return;
    if (q->held_status) {
        if (q->held_body.len + n <= q->gen->cfg->limits.max_response_rewrite_bytes) {
            dp_buf_append(&q->held_body, p, n);
            return;
        }
        release_held(q);
        if (q->req == NULL)
            return;
    }
    dp_iovec_t v = px_hooks_response_bytes(&q->hooks, p, n);
    sse_track(q, v.base, v.len);
    body_write(q, v.base, v.len);
    /* The client is slower than the replica: stop reading the replica until it drains. */
    if (q->req && net_resp_pending(q->req) > 256 * 1024 && !q->paused_upstream) {
        q->paused_upstream = true;
        net_creq_pause(c);
    }
}

static void up_on_drain(net_creq_t *c)
{
    px_preq_t *q = c->data;
    if (q->req && q->stream_body)
        net_req_resume_body(q->req);
}

/* The last step of a successful exchange: send a held response, or the end of a streamed one. */
static void deliver(void *data)
{
    px_preq_t *q = data;
    q->audit_wait = false;
    if (q->req == NULL) {
        /* Its client left while the answer waited for its audit line: a 499 when something of
         * it was still held back (a held answer, its last byte, a stream's closing event). */
        if (q->held_out || q->tail_held || px_hooks_end_waits(&q->hooks))
            client_gone(q);
        else
            finish(q);
        return;
    }
    if (q->req && px_hooks_audit_refused(&q->hooks)) {
        /* Fail closed: no answer leaves without its audit line (docs/operations.md). */
        if (q->client_started) {
            /* Cut before its end (a stream's closing event, a body's last byte): withheld,
             * under the status its head carried. */
            q->code = "audit_unavailable";
            q->withheld = true;
            net_resp_abort(q->req);
            q->req = NULL;
        } else {
            held_out_free(q);
            fail_client(q, 503, "audit_unavailable", NULL,
                        "the audit trail cannot be written: the answer is withheld "
                        "(log.audit_fail: closed)");
        }
        finish(q);
        return;
    }
    if (q->req && q->held_out) {
        q->client_started = true;
        count_request(q); /* the body's last byte ends the answer for its client */
        net_resp_start(q->req, q->held_status, q->held_out, q->held_nout,
                       (int64_t)q->held_body.len);
        net_resp_write(q->req, q->held_body.base, q->held_body.len);
    }
    dp_iovec_t end = {"", 0}; /* a stream's closing event, held for the audit line */
    if (q->req && !px_hooks_stream_end(&q->hooks, &end)) {
        net_resp_abort(q->req); /* a replica that streamed on and on after it */
        q->req = NULL;
        q->code = "upstream_error";
    }
    if (q->req) {
        count_request(q); /* before its last bytes: a client that read them sees it counted */
        if (q->tail_held) /* it came before the held end, if any */
            net_resp_write(q->req, &q->tail, 1);
        if (end.len)
            net_resp_write(q->req, end.base, end.len);
        net_resp_end(q->req);
        q->req = NULL;
    }
    finish(q);
}

static void count_upstream_error(px_preq_t *q, px_replica_t *r, net_up_err_t err)
{
    px_metrics_add(px_metrics_get("detproxy_upstream_errors_total", "pool", q->pool->name,
                                  "replica", r->name, "kind", net_up_err_name(err), NULL),
                   1);
}

static void up_on_done(net_creq_t *c, net_up_err_t err, const char *detail)
{
    up_done(c->data, err, detail);
}

/* No answer began within upstream_first_byte_timeout_ms, or it fell silent mid-way for
 * upstream_idle_timeout_ms (llama.cpp sends a stream's head at once and its first event after
 * the prefill, which may take longer): the client is told so as before. On a pool whose engine
 * may still be generating it (drain_abandoned), the exchange goes on as a drain holding the
 * slot, which it frees when the answer ends, where a hold would keep it blind for the drain's
 * whole time. */
static void up_on_timeout(net_creq_t *c, net_up_err_t err, const char *detail)
{
    px_preq_t *q = c->data;
    if (drain_abandoned(q))
        up_done(q, err, detail);
}

/* The answer is complete (a held one rewritten): it is sent by deliver(), after its audit line
 * (if any) is written, so an audited client never holds a byte of a response whose audit line
 * is not on its way to disk (docs/policy.md §7). */
static void answered(px_preq_t *q)
{
    /* The flag is set before the call: the callback may run (and free q) inside it. */
    q->audit_wait = q->req != NULL;
    if (q->req &&
        px_hooks_before_end(&q->hooks, q->px, q->pool, q->replica, q->status, q->id, deliver, q))
        return;
    q->audit_wait = false;
    deliver(q);
}

/* A held response rewritten on the thread pool: on with it, unless its client left meanwhile.
 * Then the replica's answer is still checked against what it attested, but none of it was
 * sent: the line hashes nothing of it, as for a client gone while it arrived. */
static void held_rewritten(void *data)
{
    px_preq_t *q = data;
    q->rewriting = false;
    if (q->req == NULL) {
        px_hooks_check_answer(&q->hooks, q->px, q->replica, q->status);
        px_hooks_answer_unsent(&q->hooks);
        client_gone(q);
        return;
    }
    held_head(q, true);
    answered(q);
}

static void up_done(px_preq_t *q, net_up_err_t err, const char *detail)
{
    q->up = NULL;
    q->up_end_ns = dp_now_ns();
    px_replica_t *r = q->replica;
    /* A held connection failed (connect, or closed before anything was sent): the request
     * leaves the wait list and follows the rules for a request that never left. */
    if (q->cw_listed)
        cwait_remove(q);
    q->conn_held = false;
    if (err == NET_UP_OK) {
        if (q->req && q->held_status) {
            /* The held response is rewritten (maybe on the thread pool), then its head built. */
            if (px_hooks_held_response(&q->hooks, q->px, q->pool, r, &q->held_body, held_rewritten,
                                       q)) {
                q->rewriting = true;
                return;
            }
            held_head(q, true);
        } else if (q->req) {
            dp_iovec_t tail = px_hooks_response_tail(&q->hooks);
            body_write(q, tail.base, tail.len);
        }
        answered(q);
        return;
    }
    count_upstream_error(q, r, err);
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "upstream_error");
    if (w) {
        dp_jw_str(w, "request_id", q->req ? q->req->id : "");
        dp_jw_str(w, "pool", q->pool->name);
        dp_jw_str(w, "replica", r->name);
        dp_jw_str(w, "kind", net_up_err_name(err));
        dp_jw_str(w, "detail", detail);
        dp_jw_bool(w, "response_started", q->client_started);
        dp_log_end(w);
    }
    /* docs/requests.md §2: retry once elsewhere only if nothing of the response was seen and the
     * request either never fully left or raced a keep-alive close; and only when we still hold
     * every byte of it. */
    bool can_resend = !q->stream_body;
    /* Affinity: a pooled connection the replica had closed (the keep-alive race) need not say
     * the replica is gone, so the request is routed again by its key, without counting as its
     * retry, rather than moved away for good (and with it perhaps its answer). The close holds
     * the replica until re-checked (it may be another engine now): the request waits in the
     * queue for that, or spills to the key's next replica while it lasts. The other pooled
     * connections, as stale, were dropped with it (net/client.c). Should that fail too, the
     * retry rule below still applies. */
    if (q->req && !q->client_started && can_resend && err == NET_UP_REUSED_CLOSED &&
        !q->reconnected && !q->retried && q->hooks.affinity.has_key &&
        q->pool->cfg->balance == CFG_BALANCE_AFFINITY) {
        q->reconnected = true;
        px_hooks_upstream_failed(&q->hooks, q->px, r, err);
        slot_release(q);
        dispatch(q);
        return;
    }
    if (q->req && !q->client_started && !q->retried && can_resend && net_up_err_retryable(err)) {
        px_t *px = q->px;
        q->retried = true;
        q->failed = r;
        px_replica_ref(r); /* for q->failed */
        px_replica_ref(r); /* for the call below: dispatch may finish (free) q */
        slot_release(q);
        /* A connection the replica closed holds it before the retry is routed: with no other
         * replica the retry waits for the re-check instead of meeting what may be another
         * engine. A failed connect tells attestation after the retry left: with no other
         * replica that goes to the same one (and fails with 502) rather than being refused as
         * unattested. */
        bool hold = px_event_err_holds(err);
        if (hold)
            px_hooks_upstream_failed(NULL, px, r, err);
        dispatch(q);
        if (!hold)
            px_hooks_upstream_failed(NULL, px, r, err);
        px_replica_unref(r);
        return;
    }
    if (net_up_err_may_run(err))
        hold_after_close(q);
    px_hooks_upstream_failed(&q->hooks, q->px, r, err);
    /* A head that has not left yet (it waits for the body's first bytes, and the failure came
     * with them) is taken back: the client is told 502 instead of getting nothing at all. */
    if (q->req && q->client_started && net_resp_unstart(q->req)) {
        q->client_started = false;
        q->sse = false;
    }
    if (q->req) {
        if (q->client_started) {
            /* Mid-response: end without the final chunk so the client sees an error; a
             * stream says so in an event first. */
            if (q->sse) {
                dp_iovec_t held = px_hooks_response_cut(&q->hooks);
                sse_track(q, held.base, held.len);
                net_resp_write(q->req, held.base, held.len);
                char msg[200];
                snprintf(msg, sizeof(msg),
                         "replica %s failed mid-stream (%s): the response is incomplete "
                         "(request id %s)",
                         r->name, net_up_err_name(err), q->id);
                sse_error_event(q, msg);
            }
            /* The request goes now, its audit line in finish(): the forwarded body the line
             * stores points into it. */
            px_hooks_keep_forwarded(&q->hooks);
            net_resp_abort(q->req);
            q->req = NULL;
            q->code = "upstream_error";
            px_hooks_refused(&q->hooks, q->code, NULL); /* the audit line: begun, then cut */
        } else if (err == NET_UP_FIRST_BYTE_TIMEOUT || err == NET_UP_IDLE_TIMEOUT ||
                   err == NET_UP_SEND_TIMEOUT) {
            char msg[160];
            snprintf(msg, sizeof(msg), "replica %s timed out: %s", r->name, detail ? detail : "");
            fail_client(q, 504, "upstream_timeout", NULL, msg);
        } else {
            char msg[200];
            snprintf(msg, sizeof(msg), "replica %s failed (%s): %s", r->name, net_up_err_name(err),
                     detail ? detail : "");
            fail_client(q, 502, "upstream_error", NULL, msg);
        }
    }
    if (q->status == 0) {
        q->status = 502;
        q->code = "upstream_error";
    }
    finish(q);
}

/* ---- lifecycle ---------------------------------------------------------------------------- */

/* detproxy_requests_total, the duration and the tokens, once: just before the response's last
 * byte goes out where there is one (a scrape that follows a response sees it counted, whatever
 * worker answered it), else in finish(). */
static void count_request(px_preq_t *q)
{
    if (q->counted || q->status == 0)
        return;
    q->counted = true;
    px_pool_t *pool = q->pool;
    const char *code = q->code ? q->code : "upstream";
    const char *tenant = px_hooks_tenant(&q->hooks);
    px_metrics_add(px_pool_requests_series(pool, tenant, q->status, code), 1);
    if (pool)
        px_metrics_observe(pool->m_duration, (double)(dp_now_ns() - q->start_ns) / 1e9);
    /* The tokens a replica reported were spent whether or not the client stayed for the
     * answer's last byte: a stream whose client left after its usage event (a 499) counts
     * them. An answer detproxy withheld (audit_unavailable, ...) does not. */
    int64_t pt, ct;
    int answered = q->status == 499 && q->up_status ? q->up_status : q->status;
    if (pool && answered < 300 && !q->withheld && px_hooks_usage(&q->hooks, &pt, &ct)) {
        px_series_t *prompt, *completion;
        px_pool_tokens_series(pool, tenant, &prompt, &completion);
        px_metrics_add(prompt, (double)pt);
        px_metrics_add(completion, (double)ct);
    }
}

/* ---- abandoned answers on single-sequence pools -------------------------------------------
 * A request whose client went away (or that ended otherwise before its answer) has its
 * exchange cancelled: the connection closes. Engines differ in what they do then: vLLM aborts
 * the generation, llama.cpp's server finishes a non-streamed one (it only notices a closed
 * connection when it writes, and a non-streamed answer is written once, at the end). On a pool
 * that promises one sequence at a time per replica, the slot must stay taken while the engine
 * may still be generating: such an exchange is read to its end and dropped instead, and only
 * then is the slot freed. Streamed answers too: llama.cpp stops a stream only once a write has
 * failed, some time after the connection closed, and one in a stream session (its
 * x-conversation-id header) not at all. An exchange on a vLLM pool is cancelled: its server
 * cancels a request whose connection closes, and would generate it to its end for a reader
 * that stays. An exchange that got no
 * answer within the first-byte timeout is drained too, after the client's 504
 * (up_on_timeout). A drain lasts at most policy_abandoned_drain_ms (the longer of
 * that timeout and the idle one) from when it began, less if the answer falls silent for the
 * idle timeout; then the slot is freed. Cancelled, the slot freed, when the worker stops. */

static _Thread_local net_drains_t t_drains;

/* May q's replica be generating a request nobody reads any more, on a pool that lets it run
 * one at a time (docs/configuration.md, "Deterministic pools")? Then its slot is kept. */
static bool keeps_abandoned(const px_preq_t *q)
{
    return q->replica && q->pool &&
           (policy_pool_drains_abandoned(q->pool->cfg) ||
            px_replica_drains_abandoned(q->replica)) &&
           !px_worker_closing();
}

/* Take over q's exchange and slot when its engine may still be generating an answer nobody
 * will read (see above); false when the exchange is to be cancelled. */
static bool drain_abandoned(px_preq_t *q)
{
    if (!keeps_abandoned(q) || !net_creq_sent(q->up))
        return false;
    px_admission_drain(q->gen->px, q->replica, q->up, &t_drains,
                       policy_abandoned_drain_ms(&q->gen->cfg->limits));
    q->up = NULL;
    q->slot_drained = true; /* the drain frees the slot */
    return true;
}

/* The exchange failed once the replica had the whole request, with no whole answer: closed
 * before it (a reset, or a FIN after it took all of it: net/client.c, NET_UP_CLOSED), cut or
 * unreadable mid-answer, or silent (net_up_err_may_run). Its engine may be generating it still
 * (a proxy in front of it that cut only this side), and no exchange is left to say when it
 * stops. The slot is kept as long as a drain would keep it. */
static void hold_after_close(px_preq_t *q)
{
    if (!keeps_abandoned(q) || q->slot_drained)
        return;
    px_admission_hold(q->gen->px, q->replica, policy_abandoned_drain_ms(&q->gen->cfg->limits));
    q->slot_drained = true; /* the hold frees the slot */
}

static void stop_drains(void)
{
    net_drains_stop(&t_drains);
    px_admission_holds_stop();
}

static void finish(px_preq_t *q)
{
    if (q->audit_wait) {
        q->finish_deferred = true; /* send_refusal finishes it once the audit line is out */
        return;
    }
    px_pool_t *pool = q->pool;
    if (q->up && !drain_abandoned(q)) {
        net_creq_cancel(q->up);
        q->up = NULL;
    }
    px_admission_remove(&q->adm);
    if (q->cw_listed) { /* never sent: its slot goes back, and no replica is named */
        cwait_remove(q);
        slot_release(q);
    }
    if (q->status) {
        const char *code = q->code ? q->code : "upstream";
        uint64_t took = dp_now_ns() - q->start_ns;
        count_request(q);
        px_access_t a = {
            .request_id = q->id,
            .method = q->method,
            .path = q->path.base ? q->path.base : "",
            .remote = q->remote[0] ? q->remote : NULL,
            .status = q->status,
            .code = code,
            .pool = pool ? pool->name : NULL,
            .replica = q->replica ? q->replica->name : NULL,
            .duration_ns = took,
            .upstream_ns = q->up_end_ns > q->up_start_ns ? q->up_end_ns - q->up_start_ns : 0,
            .ttfb_ns = q->up_head_ns > q->up_start_ns ? q->up_head_ns - q->up_start_ns : 0,
        };
        px_hooks_describe(&q->hooks, &a);
        px_access_log(&q->gen->cfg->log.access, &a);
    }
    /* The slot is free before the hooks end the request: a copy of it waiting for the
     * replica (docs/drift.md) finds it so, not taken by the request it copies. */
    px_replica_t *r = q->replica;
    bool slot = r && !q->slot_drained;
    if (slot)
        px_replica_put_slot(r);
    px_hooks_finish(&q->hooks, q->px, pool, r, q->status, q->id);
    if (r) {
        q->replica = NULL;
        px_replica_unref(r);
        if (slot)
            px_admission_slot_freed(q->pool);
    }
    if (q->failed)
        px_replica_unref(q->failed);
    px_gen_unref(q->gen);
    preq_put(q);
}

/* req->path is already normalised (net/server.c, docs/requests.md §1): policy/routes.c names
 * the policed routes and the engine generation routes refused for everyone. */
static route_t classify(const net_req_t *req)
{
    switch (policy_routes_classify(req->method_name, req->path)) {
    case POLICY_CLASS_COMPLETIONS:
        return ROUTE_COMPLETIONS;
    case POLICY_CLASS_CHAT:
        return ROUTE_CHAT;
    case POLICY_CLASS_RESPONSES:
        return ROUTE_RESPONSES;
    case POLICY_CLASS_MODELS:
        return ROUTE_MODELS;
    case POLICY_CLASS_GENERATION:
        return ROUTE_UNPOLICED;
    case POLICY_CLASS_PASS:
        break;
    }
    return ROUTE_PASS;
}

/* Whether the caller's inference requests may be routed to pool p at all: a tenant's pinned
 * pool alone; otherwise a pool that is not a candidate, of the tenant's determinism mode. */
static bool pool_routable(const cfg_tenant_t *t, const cfg_pool_t *p)
{
    if (t && t->pool)
        return strcmp(t->pool, p->name) == 0;
    cfg_determinism_t need = t ? t->require_determinism : CFG_DETERMINISM_NONE;
    return !p->is_candidate && (need == CFG_DETERMINISM_NONE || cfg_pool_determinism(p) == need);
}

typedef struct {
    const char *model;
    uint32_t at; /* its place in the config's pools' model lists, in order */
} model_ref_t;

static int model_ref_cmp(const void *a, const void *b)
{
    const model_ref_t *x = a, *y = b;
    int c = strcmp(x->model, y->model);
    return c != 0 ? c : (x->at > y->at) - (x->at < y->at);
}

/* reach[at]: the model at that place is where the caller's requests for it go. Model routing
 * takes the first routable pool listing the model or "*": so a model counts at its first
 * place among routable pools, and nothing after a routable pool's "*" counts. Sorted, not
 * looked up per model, as a pool may list thousands. */
static void models_reached(const cfg_t *cfg, const cfg_tenant_t *t, bool **reach)
{
    size_t n = 0;
    for (size_t i = 0; i < cfg->npools; i++)
        n += cfg->pools[i].nmodels;
    model_ref_t *refs = dp_xcalloc(n + 1, sizeof(*refs));
    *reach = dp_xcalloc(n + 1, sizeof(**reach));
    size_t nrefs = 0, at = 0;
    bool wild = false;
    for (size_t i = 0; i < cfg->npools; i++) {
        const cfg_pool_t *p = &cfg->pools[i];
        bool routable = !wild && pool_routable(t, p);
        for (size_t k = 0; k < p->nmodels; k++, at++) {
            if (routable && strcmp(p->models[k], "*") == 0)
                wild = true;
            else if (routable)
                refs[nrefs++] = (model_ref_t){p->models[k], (uint32_t)at};
        }
    }
    qsort(refs, nrefs, sizeof(*refs), model_ref_cmp);
    for (size_t j = 0; j < nrefs; j++)
        if (j == 0 || strcmp(refs[j].model, refs[j - 1].model) != 0)
            (*reach)[refs[j].at] = true;
    free(refs);
}

/* GET /v1/models: OpenAI's list shape, with each model the caller's requests would reach on a
 * pool with an admitted replica: what a client may ask for and get served. */
static void answer_models(px_preq_t *q)
{
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "object", "list");
    dp_jw_arr_begin(&w, "data");
    uint64_t created = q->px->started_ms / 1000;
    bool *reach;
    models_reached(q->gen->cfg, q->hooks.tenant_cfg, &reach);
    for (size_t i = 0, at = 0; i < q->gen->npools; at += q->gen->pools[i++].cfg->nmodels) {
        px_pool_t *p = &q->gen->pools[i];
        if (!px_pool_has_admitted(p))
            continue;
        for (size_t k = 0; k < p->cfg->nmodels; k++) {
            if (!reach[at + k])
                continue;
            dp_jw_obj_begin(&w, NULL);
            dp_jw_str(&w, "id", p->cfg->models[k]);
            dp_jw_str(&w, "object", "model");
            dp_jw_uint(&w, "created", created);
            dp_jw_str(&w, "owned_by", "detproxy");
            dp_jw_obj_begin(&w, "detproxy");
            dp_jw_str(&w, "pool", p->name);
            dp_jw_str(&w, "fingerprint", p->fingerprint);
            /* Every accepted identity's (a manifest "accept" list: a rollout in progress). */
            dp_jw_arr_begin(&w, "fingerprints");
            const cfg_manifest_t *id;
            for (size_t j = 0; (id = cfg_manifest_identity(p->cfg->manifest, j)) != NULL; j++)
                dp_jw_str(&w, NULL, id->fingerprint);
            if (p->cfg->manifest == NULL)
                dp_jw_str(&w, NULL, p->fingerprint);
            dp_jw_arr_end(&w);
            dp_jw_obj_end(&w);
            dp_jw_obj_end(&w);
        }
    }
    free(reach);
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
    net_header_t h[1] = {{DP_IOV("x-detproxy-request-id"), {q->req->id, strlen(q->req->id)}}};
    q->status = 200;
    q->code = "local";
    count_request(q);
    net_resp_send(q->req, 200, "application/json", b.base, b.len, h, 1);
    q->req = NULL;
    dp_buf_free(&b);
}

static net_body_mode_t on_head(net_req_t *req)
{
    px_t *px = net_server_data(req->server);
    px_preq_t *q = preq_get();
    q->px = px;
    q->gen = px_thread_gen(px);
    px_gen_ref(q->gen);
    px_worker_count_request();
    q->req = req;
    req->data = q;
    memcpy(q->id, req->id, sizeof(q->id));
    dp_copy_str(q->method, sizeof(q->method), req->method_name.base, req->method_name.len);
    dp_buf_append(&q->path, req->path.base, req->path.len < 255 ? req->path.len : 255);
    dp_buf_appendc(&q->path, '\0');
    memcpy(q->remote, req->remote, sizeof(q->remote));
    q->start_ns = req->start_ns;
    q->route = classify(req);
    px_hooks_init(&q->hooks);
    /* Our own Via token: this request left detproxy and came back (a replica URL or a
     * discovered address that leads to us). Forwarding it again would loop. */
    if (px_self_via_seen(req)) {
        fail_client(q, 508, "loop_detected", NULL,
                    "forwarding loop: the request already passed through this detproxy");
        finish(q);
        return NET_BODY_DISCARD;
    }
    /* The tenant is known from the head alone: refuse before reading any body. A refusal
     * from the head returns NET_BODY_DISCARD: while its answer waits for the audit line, the
     * body is dropped as it comes, and no limit of a body it does not want replaces it. */
    char why[PX_HOOKS_WHY_MAX];
    int gate = px_hooks_tenant_gate(&q->hooks, px, q->gen, req, why);
    if (gate != 0) {
        if (gate == -2) {
            px_hooks_audit_head(&q->hooks, q->gen, q->method, req->path.base, req->path.len);
            fail_client(q, 429, "rate_limited", NULL, why);
        } else {
            fail_client(q, 401, "invalid_api_key", NULL, why);
        }
        finish(q);
        return NET_BODY_DISCARD;
    }
    switch (q->route) {
    case ROUTE_MODELS:
        answer_models(q);
        finish(q);
        return NET_BODY_DISCARD;
    case ROUTE_COMPLETIONS:
    case ROUTE_CHAT:
    case ROUTE_RESPONSES:
        return NET_BODY_BUFFER;
    case ROUTE_UNPOLICED:
        px_hooks_audit_head(&q->hooks, q->gen, q->method, req->path.base, req->path.len);
        fail_client(q, 404, "unpoliced_route", NULL,
                    "an engine-native generation route: detproxy polices only POST "
                    "/v1/completions, /v1/chat/completions and /v1/responses");
        finish(q);
        return NET_BODY_DISCARD;
    case ROUTE_PASS:
        break;
    }
    /* Pass-through: the first pool, streamed both ways. */
    if (q->gen->npools == 0) {
        fail_client(q, 404, "not_found", NULL, "no pool configured");
        finish(q);
        return NET_BODY_DISCARD;
    }
    /* Default-deny for a policed tenant: a route nobody listed may generate (docs/policy.md
     * §2, "Routes and pass-through"), so only GET, HEAD and the pool's passthrough list go
     * through. */
    px_pool_t *pass = &q->gen->pools[0];
    if (!policy_routes_passthrough(pass->cfg, q->hooks.tenant_cfg, req->method_name, req->path)) {
        char msg[320];
        snprintf(msg, sizeof(msg),
                 "%.*s on this path is not a policed route and not in pool %s's passthrough "
                 "list: detproxy polices only POST /v1/completions, /v1/chat/completions and "
                 "/v1/responses; an operator can allow a route with pools[].passthrough",
                 (int)req->method_name.len, req->method_name.base, pass->name);
        px_hooks_audit_head(&q->hooks, q->gen, q->method, req->path.base, req->path.len);
        fail_client(q, 404, "unpoliced_route", NULL, msg);
        finish(q);
        return NET_BODY_DISCARD;
    }
    q->pool = pass;
    /* A single_sequence pool's pass-through body is read whole, to be checked for several
     * sequences at once (on_complete), up to the body limit as a policed route's. */
    if (req->has_body && ((req->content_length >= 0 && req->content_length <= PASS_HELD_MAX) ||
                          cfg_pool_determinism(pass->cfg) == CFG_DETERMINISM_SINGLE_SEQUENCE))
        return NET_BODY_BUFFER; /* sent whole from on_complete */
    q->stream_body = req->has_body;
    dispatch(q);
    return NET_BODY_STREAM;
}

static void on_body(net_req_t *req, const char *p, size_t n)
{
    px_preq_t *q = req->data;
    if (q == NULL || q->up == NULL)
        return;
    int r;
    if (req->chunked) {
        char pre[20];
        int pl = snprintf(pre, sizeof(pre), "%zx\r\n", n);
        uv_buf_t b[3] = {uv_buf_init(pre, (unsigned)pl), uv_buf_init((char *)p, (unsigned)n),
                         uv_buf_init("\r\n", 2)};
        r = net_creq_write(q->up, b, 3);
    } else {
        uv_buf_t b = uv_buf_init((char *)p, (unsigned)n);
        r = net_creq_write(q->up, &b, 1);
    }
    /* The replica takes the body slower than the client sends it: stop reading the client. */
    if (r == 0 && q->up && net_creq_over(q->up))
        net_req_pause_body(req);
}

/* The client went away (or the server refused the request, then on_reject said how), or
 * detproxy closed its connection itself at the end of the shutdown drain: 503 drain_closed,
 * as nothing more of the response would have come (docs/configuration.md, "log.access"). */
static void client_gone(px_preq_t *q)
{
    if (!q->rejected) {
        bool cut = px_worker_closing();
        q->status = cut ? 503 : 499; /* 499: nginx's "client closed request" */
        q->code = cut ? "drain_closed" : "client_closed";
    }
    finish(q);
}

static void policed(px_preq_t *q, int rc, px_hooks_result_t *res)
{
    if (rc != 0) {
        fail_client(q, res->status, res->code, res->param, res->message);
        finish(q);
        return;
    }
    q->pool = res->pool;
    dispatch(q);
}

static void policed_later(void *data, int rc, dp_iovec_t body, px_hooks_result_t *res)
{
    px_preq_t *q = data;
    q->policing = false;
    q->body = body;
    if (q->budget_held) /* its listener may be gone (shutdown): the budget is the workers' */
        net_server_shared_return_body_budget(&q->px->listen_shared, q->budget_held);
    q->budget_held = 0;
    if (q->req == NULL) { /* the client left while its body was being policed */
        client_gone(q);
        return;
    }
    policed(q, rc, res);
}

/* Could an engine read this pass-through body as JSON? One that opens with '{' (after JSON
 * whitespace) or a UTF-8 byte order mark (llama.cpp's parser skips one); under a JSON
 * Content-Type (below), also one in UTF-16 or UTF-32 (a BOM, or a NUL among its first four
 * bytes: RFC 4627 §3), which Python servers' json.loads reads. Anything else (a multipart
 * upload) is none an engine reads as a batch. */
static bool pass_json_like(const net_req_t *req)
{
    size_t i = 0, n = req->body.len;
    const unsigned char *b = (const unsigned char *)req->body.base;
    while (i < n && (b[i] == ' ' || b[i] == '\t' || b[i] == '\r' || b[i] == '\n'))
        i++;
    if (i == n)
        return false;
    if (b[i] == '{' || (n - i >= 3 && b[i] == 0xef && b[i + 1] == 0xbb && b[i + 2] == 0xbf))
        return true;
    /* As Starlette reads it: the first Content-Type, an empty one as none, and any
     * application/...+json subtype as JSON. */
    dp_iovec_t media;
    content_media(req->headers, req->nheaders, &media);
    bool json_typed = media.len == 0 || dp_strieq(media.base, media.len, "application/json") ||
                      (media.len >= 17 && dp_memieq(media.base, "application/", 12) &&
                       dp_memieq(media.base + media.len - 5, "+json", 5));
    if (!json_typed)
        return false;
    if (n >= 2 && ((b[0] == 0xfe && b[1] == 0xff) || (b[0] == 0xff && b[1] == 0xfe)))
        return true;
    for (size_t k = 0; k < n && k < 4; k++)
        if (b[k] == 0)
            return true;
    return false;
}

/* A pass-through body that would run several sequences at once on a single_sequence pool's
 * replica (a batch of embeddings inputs, rerank documents, a completions body asking for n) is
 * refused as the admin relay refuses it, and so is one an engine could read as JSON that is
 * not one UTF-8 JSON object without duplicate keys (docs/configuration.md, "Deterministic
 * pools"); a coded one, which detproxy cannot read, is refused as a policed route's is. */
static bool pass_refused(px_preq_t *q, net_req_t *req)
{
    if (cfg_pool_determinism(q->pool->cfg) != CFG_DETERMINISM_SINGLE_SEQUENCE)
        return false;
    int status = 415;
    const char *code = "unsupported_content_encoding", *param = NULL;
    const char *message = NET_CODED_BODY_MESSAGE;
    policy_error_t e;
    if (!net_content_coded(req->headers, req->nheaders)) {
        if (!pass_json_like(req))
            return false;
        policy_req_t *scratch = policy_req_new();
        int rc = policy_one_sequence(scratch, req->body.base, req->body.len, false, &e);
        policy_req_free(scratch);
        if (rc == 0)
            return false;
        status = e.status;
        code = e.code;
        param = e.param[0] ? e.param : NULL;
        message = e.message;
    }
    px_hooks_audit_head(&q->hooks, q->gen, q->method, req->path.base, req->path.len);
    fail_client(q, status, code, param, message);
    finish(q);
    return true;
}

static void on_complete(net_req_t *req)
{
    px_preq_t *q = req->data;
    if (q == NULL)
        return;
    if (q->route == ROUTE_PASS) {
        if (q->stream_body && q->up) {
            if (req->chunked) {
                uv_buf_t b = uv_buf_init("0\r\n\r\n", 5);
                net_creq_write(q->up, &b, 1);
            }
            net_creq_end(q->up);
        } else if (!q->stream_body && req->has_body) { /* held whole (see on_request) */
            q->body = (dp_iovec_t){req->body.base, req->body.len};
            if (pass_refused(q, req))
                return;
            dispatch(q);
        }
        return;
    }
    /* Inference: policy, routing by model, then dispatch with the rewritten body. */
    px_hooks_result_t res = {0};
    int rc = px_hooks_inference(&q->hooks, q->px, q->gen, req, policy_route(q->route), &q->body,
                                &res, policed_later, q);
    if (rc == 1) {
        q->policing = true; /* on the thread pool: policed_later() takes it from here */
        return;
    }
    policed(q, rc, &res);
}

static void on_abort(net_req_t *req)
{
    px_preq_t *q = req->data;
    if (q == NULL)
        return;
    /* The worker still holds the body: so does the budget, until policed_later. */
    if (q->policing)
        q->budget_held = net_req_take_body_budget(req);
    q->req = NULL;
    if (q->up && !drain_abandoned(q)) {
        /* The client is gone: stop the replica's work now (GPU time is expensive). The
         * request's bytes go with the client, and a connection not yet established still
         * points at them (up_cb). An exchange whose bytes have all left may be drained
         * instead, the engine being one that finishes it anyway. */
        net_creq_cancel(q->up);
        q->up = NULL;
    }
    /* The audit line to come stores the forwarded body, which points into the request the
     * server now lets go of. */
    if (q->rewriting)
        px_hooks_keep_forwarded(&q->hooks);
    if (q->audit_wait || q->policing || q->rewriting)
        return; /* deliver(), policed_later() or held_rewritten() finishes it */
    client_gone(q);
}

/* The server refused the request itself (431, 413, 408, 400) and closes the connection. With
 * our request (on_abort follows) the refusal becomes its status; without one (the head never
 * parsed) it is counted here, with no pool and no tenant. */
static void on_reject(net_server_t *s, net_req_t *req, int status, const char *code)
{
    px_preq_t *q = req ? req->data : NULL;
    if (q) {
        q->rejected = true;
        q->status = status;
        q->code = code;
        px_hooks_refused(&q->hooks, code, NULL);
        return;
    }
    px_metrics_add(px_pool_requests_series(NULL, "-", status, code), 1);
    px_t *px = net_server_data(s);
    px_access_t a = {.status = status, .code = code};
    px_access_log(&px_thread_gen(px)->cfg->log.access, &a);
}

static void on_drain(net_req_t *req)
{
    px_preq_t *q = req->data;
    if (q && q->up && q->paused_upstream) {
        q->paused_upstream = false;
        net_creq_resume(q->up);
    }
}

const net_handler_t px_proxy_handler = {on_head,  on_body,  on_complete,
                                        on_abort, on_drain, on_reject};

static void worker_thread_exit(void)
{
    px_proxy_free_caches();
    px_hooks_thread_free();
}

const px_worker_ops_t px_proxy_worker_ops = {
    .handler = &px_proxy_handler,
    .overload = px_proxy_count_overload,
    .wake = worker_wake,
    .thread_exit = worker_thread_exit,
    .stop = stop_drains,
};
