/* The admin relay (docs/operations.md §2, "Relay"): `/admin/relay/PATH` sends one
 * request to a named replica as the proxy sends its own: under the pool's
 * max_inflight_per_replica, with the pool's credentials and TLS, to the address the proxy
 * resolved. A POST waits for a slot no client of the pool is waiting for; after RELAY_SPARE_MS
 * it holds the next slot freed on its replica (one request ahead of the pool's queue, once), so
 * a pool that is never idle cannot starve an operator. `detproxy diagnose` and
 * `detproxy replay` go through it when the configuration's proxy is running, so an operator's
 * isolation run never puts a second sequence on a one-sequence replica.
 *
 * Which replica is said in two headers, x-detproxy-relay-pool and x-detproxy-relay-replica (names
 * may hold '/', which a path segment cannot carry); the path after /admin/relay, with its query,
 * is the replica's own (after the replica URL's path prefix).
 *
 * The answer is the replica's status and body, marked `x-detproxy-relay: replica`; the relay's
 * own refusals are OpenAI-shaped errors without that header. */
#include "proxy/control/relay.h"

#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "net/fetch.h"
#include "policy/policy.h"
#include "policy/routes.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/self.h"
#include "proxy/data/admission.h"
#include "proxy/data/worker.h"

#define RELAY_PREFIX "/admin/relay"
#define RELAY_WAIT_MS 30000 /* the longest a relayed POST waits for a slot */
/* How long it waits for a spare slot (one no client of the pool waits for) before it holds the
 * next one freed on its replica: a pool that is never idle must not starve an operator. */
#define RELAY_SPARE_MS 200
#define RELAY_RETRY_MS 10                  /* how often it looks for one meanwhile */
#define RELAY_MAX_BYTES ((size_t)16 << 20) /* response body cap */

typedef struct relay_s {
    px_t *px;
    net_req_t *req; /* NULL once the client went away */
    px_replica_t *r;
    net_fetch_t *fetch;
    uv_timer_t timer;
    char *target;
    const char *method;
    bool needs_slot, holds_slot;
    /* The pool it was sent under lets the engine finish an answer whose connection closed
     * (policy_pool_drains_abandoned): set then, for a reload may rename the pool meanwhile. */
    bool drains;
    bool holding; /* px_replica_hold_slot: the next slot freed on r is ours */
    uint64_t start_ms, sent_ms;
} relay_t;

/* Relayed requests whose answer nobody will read, kept while the replica may be generating
 * them (drain_slot), until px_relay_stop. Control thread; one proxy per process. */
static net_drains_t g_drains;
static bool g_stopped;
static policy_req_t *g_scratch; /* policy_one_sequence's */

static void relay_closed(uv_handle_t *h)
{
    relay_t *rl = h->data;
    px_replica_unref(rl->r);
    free(rl->target);
    free(rl);
}

/* The request is over (answered, or its client gone): the slot goes back, the rest is freed. */
static void relay_end(relay_t *rl)
{
    if (rl->holding) {
        rl->holding = false;
        px_replica_unhold_slot(rl->r); /* a slot passed on meanwhile is freed: clients look */
        if (atomic_load(&rl->px->queued) > 0)
            px_workers_wake(rl->px);
    }
    if (rl->holds_slot) {
        rl->holds_slot = false;
        px_admission_own_slot_done(rl->px, rl->r);
    }
    if (rl->fetch) {
        net_fetch_cancel(rl->fetch);
        rl->fetch = NULL;
    }
    if (rl->req)
        rl->req->data = NULL;
    rl->req = NULL;
    uv_close((uv_handle_t *)&rl->timer, relay_closed);
}

static void relay_log(const relay_t *rl, int status, const char *error)
{
    dp_jw_t *w =
        dp_log_begin(status >= 200 && status < 500 ? DP_LOG_INFO : DP_LOG_WARN, "admin_relay");
    if (w == NULL)
        return;
    uint64_t now = uv_now(rl->px->loop);
    dp_jw_str(w, "pool", rl->r->pool_name);
    dp_jw_str(w, "replica", rl->r->name);
    dp_jw_str(w, "method", rl->method);
    dp_jw_str(w, "target", rl->target);
    dp_jw_int(w, "status", status);
    dp_jw_uint(w, "slot_wait_ms", (rl->sent_ms ? rl->sent_ms : now) - rl->start_ms);
    dp_jw_uint(w, "ms", now - rl->start_ms);
    if (error)
        dp_jw_str(w, "error", error);
    dp_log_end(w);
}

static void relay_fail(relay_t *rl, int status, const char *code, const char *msg)
{
    relay_log(rl, status, msg);
    if (rl->req)
        net_resp_error(rl->req, status, NULL, code, NULL, msg, NULL, 0);
    relay_end(rl);
}

/* May rl's slot outlive its exchange? Not when rl holds none, its pool (when rl was sent)
 * does not drain abandoned answers, or the relays have stopped (the final close: a graceful
 * shutdown's drain still drains). */
static bool slot_may_outlive(const relay_t *rl)
{
    return rl->holds_slot && (rl->drains || px_replica_drains_abandoned(rl->r)) && !g_stopped;
}

/* On a single_sequence pool whose engine finishes an answer whose connection closed (llama.cpp),
 * the slot stays taken until that answer has come, as for a client's request (data/proxy.c,
 * drain_abandoned): f, rl's request, becomes a drain holding it. False when the slot is not to
 * be kept (slot_may_outlive). */
static bool drain_slot(relay_t *rl, net_fetch_t *f)
{
    px_t *px = rl->px;
    if (!slot_may_outlive(rl))
        return false;
    px_admission_drain_fetch(px, rl->r, f, &g_drains,
                             policy_abandoned_drain_ms(&px->gen->cfg->limits));
    rl->holds_slot = false;
    return true;
}

/* The same when rl's exchange failed with the engine perhaps at work on it (closed after it
 * took the request, cut mid-answer: net_up_err_may_run): no exchange is left to read, so the
 * slot is kept for as long as the drain would have lasted. */
static void hold_slot(relay_t *rl)
{
    px_t *px = rl->px;
    if (!slot_may_outlive(rl))
        return;
    px_admission_hold(px, rl->r, policy_abandoned_drain_ms(&px->gen->cfg->limits));
    rl->holds_slot = false;
}

static void fetched(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                    const char *detail, void *data)
{
    relay_t *rl = data;
    rl->fetch = NULL;
    if (status == 0) {
        dp_buf_t m = {0};
        dp_buf_printf(&m, "replica %s: %s%s%s", rl->r->name, net_up_err_name(err),
                      detail && *detail ? ": " : "", detail ? detail : "");
        /* The replica may still be generating it (llama.cpp does): its caller is told now, and
         * the slot may stay taken until the answer has come; read on while the exchange is
         * open (no answer yet, one fallen silent, or one over the size cap), else kept blind
         * for the drain's time. */
        if (net_fetch_open(f))
            drain_slot(rl, f);
        else if (net_fetch_failed_running(f, status, err))
            hold_slot(rl);
        relay_fail(rl, 502, "replica_error", m.base);
        dp_buf_free(&m);
        return;
    }
    static const net_header_t mark = {DP_IOV("x-detproxy-relay"), DP_IOV("replica")};
    relay_log(rl, status, NULL);
    if (rl->req) /* else its client left: the answer is dropped, the slot freed now */
        net_resp_send(rl->req, status, "application/json", body->base ? body->base : "", body->len,
                      &mark, 1);
    relay_end(rl);
}

static void try_send(relay_t *rl);

static void retry_cb(uv_timer_t *t)
{
    try_send(t->data);
}

static void try_send(relay_t *rl)
{
    px_t *px = rl->px;
    px_replica_t *r = rl->r;
    px_pool_t *p = px_gen_pool_by_name(px->gen, r->pool_name);
    if (p == NULL || r->up == NULL) {
        relay_fail(rl, 503, "replica_unavailable",
                   p == NULL ? "the replica's pool is gone (a reload removed it)"
                             : "the replica's address does not resolve");
        return;
    }
    uint64_t waited = uv_now(px->loop) - rl->start_ms;
    bool got = !rl->needs_slot ||
               (rl->holding ? px_replica_take_held_slot(p, r) : px_replica_take_spare_slot(p, r));
    if (got && rl->holding)
        rl->holding = false;
    if (!got) {
        if (waited < RELAY_WAIT_MS) {
            if (!rl->holding && waited >= RELAY_SPARE_MS) {
                rl->holding = true;
                px_replica_hold_slot(r);
            }
            uv_timer_start(&rl->timer, retry_cb, RELAY_RETRY_MS, 0);
            return;
        }
        dp_buf_t m = {0};
        dp_buf_printf(&m,
                      "replica %s had no free slot for %d ms (max_inflight_per_replica %u, "
                      "every one busy)",
                      r->name, RELAY_WAIT_MS, p->cfg->max_inflight_per_replica);
        relay_fail(rl, 503, "replica_busy", m.base);
        dp_buf_free(&m);
        return;
    }
    rl->holds_slot = rl->needs_slot;
    rl->drains = policy_pool_drains_abandoned(p->cfg);
    rl->sent_ms = uv_now(px->loop);
    net_req_t *req = rl->req;
    net_fetch_opts_t o = {.method = rl->method,
                          .hostport = r->url.hostport,
                          .target = rl->target,
                          .bearer = p->cfg->api_key,
                          .body = req->body.base,
                          .body_len = req->body.len,
                          .max_bytes = RELAY_MAX_BYTES,
                          .via = px_self_via_line(NULL),
                          .length_required = rl->needs_slot && px_replica_drains_abandoned(r)};
    rl->fetch = net_fetch(r->up, &o, fetched, rl);
}

/* The value of the one header `name` of req; false when absent, empty or repeated. */
static bool one_header(const net_req_t *req, const char *name, char *out, size_t cap)
{
    const net_header_t *h = NULL;
    for (size_t i = 0; i < req->nheaders; i++) {
        if (!dp_strieq(req->headers[i].name.base, req->headers[i].name.len, name))
            continue;
        if (h)
            return false;
        h = &req->headers[i];
    }
    if (h == NULL || h->value.len == 0 || h->value.len >= cap)
        return false;
    memcpy(out, h->value.base, h->value.len);
    out[h->value.len] = '\0';
    return true;
}

bool px_relay_route(px_t *px, net_req_t *req)
{
    const size_t pl = sizeof(RELAY_PREFIX) - 1;
    const dp_iovec_t path = req->path;
    if (path.len < pl || memcmp(path.base, RELAY_PREFIX, pl) != 0 ||
        (path.len > pl && path.base[pl] != '/'))
        return false;
    char pool_name[256], name[256]; /* names are at most 128 bytes (config/) */
    if (path.len <= pl + 1 ||
        !one_header(req, "x-detproxy-relay-pool", pool_name, sizeof(pool_name)) ||
        !one_header(req, "x-detproxy-relay-replica", name, sizeof(name))) {
        net_resp_error(req, 400, NULL, "invalid_relay", NULL,
                       "use /admin/relay/PATH (PATH as the replica serves it, e.g. "
                       "/v1/completions) with one x-detproxy-relay-pool and one "
                       "x-detproxy-relay-replica header",
                       NULL, 0);
        return true;
    }
    const char *p = path.base + pl, *end = path.base + path.len;
    /* No HEAD: an answer without the body its Content-Length announces is nothing the relay
     * could pass on whole. */
    const char *method = req->method == 1 ? "GET" : req->method == 3 ? "POST" : NULL;
    if (method == NULL) {
        net_resp_method_not_allowed(req, "GET, POST");
        return true;
    }
    px_pool_t *pool = px_gen_pool_by_name(px->gen, pool_name);
    px_replica_t *r = NULL;
    for (size_t k = 0; pool && k < pool->nreplicas && r == NULL; k++)
        if (strcmp(pool->replicas[k]->name, name) == 0)
            r = pool->replicas[k];
    if (r == NULL) {
        dp_buf_t m = {0};
        if (pool == NULL)
            dp_buf_printf(&m, "no pool is named %s", pool_name);
        else
            dp_buf_printf(&m, "pool %s has no replica named %s", pool_name, name);
        net_resp_error(req, 404, NULL, pool ? "replica_not_found" : "pool_not_found", NULL, m.base,
                       NULL, 0);
        dp_buf_free(&m);
        return true;
    }
    /* What a single_sequence pool's clients may not send (docs/configuration.md, "Deterministic
     * pools") the relay may not either: its one slot would hold several sequences. An empty
     * body (llama.cpp's slot actions) generates nothing. */
    if (req->method == 3 && req->body.len > 0 &&
        cfg_pool_determinism(pool->cfg) == CFG_DETERMINISM_SINGLE_SEQUENCE) {
        if (g_scratch == NULL)
            g_scratch = policy_req_new();
        policy_error_t e;
        bool items = policy_routes_classify(req->method_name, (dp_iovec_t){p, (size_t)(end - p)}) ==
                     POLICY_CLASS_RESPONSES;
        if (policy_one_sequence(g_scratch, req->body.base ? req->body.base : "", req->body.len,
                                items, &e) < 0) {
            net_resp_error(req, 400, NULL, e.code, e.param[0] ? e.param : NULL, e.message, NULL, 0);
            return true;
        }
    }
    relay_t *rl = dp_xcalloc(1, sizeof(*rl));
    rl->px = px;
    rl->req = req;
    rl->r = r;
    px_replica_ref(r);
    rl->method = method;
    /* Metadata reads occupy no sequence; everything else is a request like a client's. */
    rl->needs_slot = req->method == 3;
    rl->start_ms = uv_now(px->loop);
    dp_buf_t t = {0};
    dp_buf_printf(&t, "%s%.*s%s%.*s", r->url.path ? r->url.path : "", (int)(end - p), p,
                  req->query.len ? "?" : "", (int)req->query.len, req->query.base);
    rl->target = dp_buf_steal(&t);
    uv_timer_init(px->loop, &rl->timer);
    rl->timer.data = rl;
    req->data = rl;
    try_send(rl);
    return true;
}

void px_relay_abort(net_req_t *req)
{
    relay_t *rl = req->data;
    if (rl == NULL)
        return;
    rl->req = NULL;
    req->data = NULL;
    /* The replica may go on generating what it was sent (llama.cpp finishes a non-streamed
     * answer whose client left); a request that has not all left yet is cancelled instead. */
    if (rl->fetch && net_fetch_sent(rl->fetch) && drain_slot(rl, rl->fetch))
        rl->fetch = NULL;
    relay_end(rl);
}

void px_relay_stop(px_t *px)
{
    (void)px;
    g_stopped = true;
    net_drains_stop(&g_drains);
    policy_req_free(g_scratch);
    g_scratch = NULL;
}
