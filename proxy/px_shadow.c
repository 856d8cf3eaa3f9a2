/* Shadow sampling and drift (SPEC §9, issue 5).
 *
 * For a comparable request (post-policy temperature 0 or a seed), with probability shadow.rate
 * (or the tenant's shadow_rate) the same post-policy body also goes to another replica
 * ("cross"), or with probability shadow.self_rate to the primary's own replica again ("self",
 * the noise baseline). The client never waits for a shadow: it runs on the replica's separate
 * shadow connection pool, at most shadow.max_inflight at a time, and its result is only
 * compared once both sides ended. Comparison (word-level Levenshtein) runs in libuv's thread
 * pool; the drift statistics, verdicts and quarantine decisions stay on the loop.
 *
 * A shadow (shadow_t) is freed on exactly one path: whichever of the primary's end
 * (px_shadow_primary_done) and the shadow exchange's end comes second runs maybe_compare, which
 * either drops the sample or hands it to the thread pool and frees it in compare_done.
 *
 * Threads: the decision and the primary's capture happen on the worker that has the request
 * (px_shadow_maybe, px_shadow_primary_bytes); the copy is sent, compared and counted on the
 * control thread. Two messages cross (start, primary done), each always delivered; until the
 * second, the primary's capture fields are the worker's and everything else the control's. */
#include "proxy/px_shadow.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "proxy/drift/drift.h"
#include "proxy/px_attest.h"
#include "proxy/px_self.h"

typedef struct shadow_s shadow_t;

typedef struct {
    char *name;
    drift_pool_t *dp;
    /* The verdict last logged ("drift_verdict" lines, one per change, like replica_state). */
    drift_verdict_kind_t logged;
    char logged_suspect[DRIFT_NAME_MAX];
} dpool_t;

struct px_shadow_ctx_s {
    dpool_t *pools;
    size_t npools;
    atomic_uint inflight; /* taken on the workers, given back on the control thread */
    shadow_t *active;     /* exchanges in flight, for shutdown */
    atomic_bool stopped;
};
typedef struct px_shadow_ctx_s shadow_ctx_t;

struct shadow_s {
    int refs;
    px_t *px;
    net_mb_node_t start_node, done_node;
    px_replica_t *target_r; /* a reference, until the exchange ended */
    dp_buf_t head, body;    /* the copy to send (made on the worker) */
    shadow_t *prev, *next; /* on ctx->active while the exchange runs */
    char *pool;
    char *primary;
    char *target;
    drift_kind_t kind;
    char request_id[24];
    bool stream;
    size_t max_out;
    /* primary capture */
    drift_sse_t psse;
    dp_buf_t pbody;
    int pstatus;
    /* shadow capture */
    net_creq_t *c;
    drift_sse_t ssse;
    dp_buf_t sbody;
    int sstatus;
    bool sfailed;
    char sdetail[120];
    bool primary_done, shadow_done;
    /* comparison (thread pool) */
    uv_work_t work;
    drift_output_t a, b;
    bool a_ok, b_ok;
    drift_result_t result;
    drift_divlog_t divlog;
};

static shadow_ctx_t *ctx(px_t *px)
{
    if (px->shadow == NULL) {
        PX_ASSERT_CONTROL(); /* made at start (px_shadow_init), before any worker runs */
        px->shadow = dp_xcalloc(1, sizeof(shadow_ctx_t));
    }
    return px->shadow;
}

void px_shadow_init(px_t *px)
{
    ctx(px);
}

static dpool_t *dpool_entry(px_t *px, const char *name)
{
    shadow_ctx_t *c = ctx(px);
    for (size_t i = 0; i < c->npools; i++)
        if (strcmp(c->pools[i].name, name) == 0)
            return &c->pools[i];
    c->pools = dp_xrealloc(c->pools, (c->npools + 1) * sizeof(*c->pools));
    dpool_t *e = &c->pools[c->npools++];
    memset(e, 0, sizeof(*e));
    e->name = dp_xstrdup(name);
    e->dp = drift_pool_new(name);
    e->logged = DRIFT_INSUFFICIENT_DATA;
    return e;
}

static drift_pool_t *dpool(px_t *px, const char *name)
{
    return dpool_entry(px, name)->dp;
}

static void summary_json(dp_jw_t *w, const char *key, const drift_pool_t *dp, drift_kind_t k)
{
    drift_summary_t s;
    drift_pool_summary(dp, k, &s);
    dp_jw_obj_begin(w, key);
    dp_jw_uint(w, "samples", s.samples);
    dp_jw_double(w, "exact_match_rate", s.exact_match_rate);
    dp_jw_double(w, "mean_similarity", s.mean_similarity);
    dp_jw_obj_end(w);
}

/* One "drift_verdict" line when a pool's verdict (or its suspect) changes, with the numbers
 * behind it: an operator greps one line instead of polling /admin/drift. */
static void log_verdict_change(dpool_t *e)
{
    drift_verdict_t v;
    drift_pool_verdict(e->dp, &v);
    const char *suspect = v.has_suspect ? v.suspect : "";
    if (v.kind == e->logged && strcmp(suspect, e->logged_suspect) == 0)
        return;
    dp_jw_t *w = dp_log_begin(v.kind == DRIFT_CROSS_REPLICA_DRIFT ? DP_LOG_WARN : DP_LOG_INFO,
                              "drift_verdict");
    if (w) {
        dp_jw_str(w, "pool", e->name);
        dp_jw_str(w, "from", drift_verdict_name(e->logged));
        dp_jw_str(w, "to", drift_verdict_name(v.kind));
        dp_jw_str(w, "suspect", suspect[0] ? suspect : NULL);
        summary_json(w, "cross", e->dp, DRIFT_CROSS);
        summary_json(w, "self", e->dp, DRIFT_SELF);
        dp_jw_arr_begin(w, "reasons");
        for (int i = 0; i < v.nreasons; i++)
            dp_jw_str(w, NULL, v.reasons[i]);
        dp_jw_arr_end(w);
        dp_log_end(w);
    }
    e->logged = v.kind;
    snprintf(e->logged_suspect, sizeof(e->logged_suspect), "%s", suspect);
}

static void count(const char *pool, drift_kind_t kind, const char *result)
{
    px_metric_add(px_metrics_get("detproxy_shadow_total", "pool", pool, "kind",
                                 drift_kind_name(kind), "result", result, NULL),
                  1);
}

static void shadow_unref(shadow_t *s)
{
    if (--s->refs > 0)
        return;
    drift_sse_free(&s->psse);
    drift_sse_free(&s->ssse);
    dp_buf_free(&s->pbody);
    dp_buf_free(&s->sbody);
    dp_buf_free(&s->head);
    dp_buf_free(&s->body);
    if (s->target_r)
        px_replica_unref(s->target_r);
    drift_output_free(&s->a);
    drift_output_free(&s->b);
    free(s->pool);
    free(s->primary);
    free(s->target);
    free(s);
}

/* ---- comparison and the verdict loop ----------------------------------------------------- */

static void compare_work(uv_work_t *w)
{
    shadow_t *s = w->data;
    drift_compare(&s->a, &s->b, &s->result);
    if (!s->result.match)
        drift_divlog_fill(&s->divlog, s->request_id, s->pool, s->primary, s->target, &s->result,
                          s->a.text.base, s->a.text.len, s->b.text.base, s->b.text.len);
}

static px_pool_t *live_pool(px_t *px, const char *name)
{
    return px->gen ? px_gen_pool_by_name(px->gen, name) : NULL;
}

static px_replica_t *replica_named(px_pool_t *p, const char *name)
{
    for (size_t i = 0; p && i < p->nreplicas; i++)
        if (strcmp(p->replicas[i]->name, name) == 0)
            return p->replicas[i];
    return NULL;
}

static size_t admitted_count(const px_pool_t *p)
{
    size_t n = 0;
    for (size_t i = 0; i < p->nreplicas; i++)
        n += p->replicas[i]->state == PX_REPLICA_ADMITTED;
    return n;
}

/* What attestation knows beyond the samples, for naming one of two replicas (drift.h). */
static void refresh_hints(px_t *px, const char *pool_name, drift_pool_t *dp)
{
    px_pool_t *p = live_pool(px, pool_name);
    for (size_t i = 0; p && i < p->nreplicas; i++) {
        drift_hint_t h;
        px_attest_drift_hint(p->replicas[i], &h);
        drift_pool_set_hint(dp, p->replicas[i]->name, &h);
    }
}

/* SPEC §9 quarantine: the suspect of a cross_replica_drift verdict stops getting client traffic
 * (but keeps getting shadows), never the pool's last admitted replica; it comes back once its
 * divergence falls to the self baseline. */
static void quarantine_loop(px_t *px, const char *pool_name, drift_pool_t *dp)
{
    px_pool_t *p = live_pool(px, pool_name);
    if (p == NULL || !px->gen->cfg->shadow.quarantine)
        return;
    for (size_t i = 0; i < p->nreplicas; i++) {
        px_replica_t *r = p->replicas[i];
        if (r->state == PX_REPLICA_QUARANTINED && drift_pool_replica_recovered(dp, r->name)) {
            drift_pool_reset_replica(dp, r->name);
            const char *why[] = {"divergence back at the self baseline", NULL};
            px_replica_set_state(r, PX_REPLICA_ADMITTED, why);
        }
    }
    drift_verdict_t v;
    drift_pool_verdict(dp, &v);
    if (v.kind != DRIFT_CROSS_REPLICA_DRIFT || !v.has_suspect || !v.suspect[0])
        return;
    px_replica_t *r = replica_named(p, v.suspect);
    if (r == NULL || r->state != PX_REPLICA_ADMITTED || admitted_count(p) <= 1)
        return;
    char why[DRIFT_REASON_MAX + 64];
    snprintf(why, sizeof(why), "quarantined: cross_replica_drift suspect (%s)",
             v.nreasons ? v.reasons[0] : "diverges from the other replicas");
    const char *list[] = {why, NULL};
    px_replica_set_state(r, PX_REPLICA_QUARANTINED, list);
}

static void compare_done(uv_work_t *w, int status)
{
    shadow_t *s = w->data;
    px_t *px = s->px;
    (void)status;
    if (!atomic_load(&ctx(px)->stopped)) {
        dpool_t *e = dpool_entry(px, s->pool);
        drift_pool_t *dp = e->dp;
        drift_pool_add(dp, s->primary, s->target, &s->result);
        log_verdict_change(e);
        count(s->pool, s->kind, s->result.match ? "match" : "diverged");
        px_hist_observe(px_metrics_hist("detproxy_shadow_similarity", px_shadow_similarity_bounds,
                                        px_shadow_similarity_nbounds, "pool", s->pool, "kind",
                                        drift_kind_name(s->kind), NULL),
                        drift_sample_similarity(&s->result));
        if (!s->result.match) {
            dp_jw_t *j = dp_log_begin(DP_LOG_INFO, "shadow_divergence");
            if (j) {
                drift_divlog_write(&s->divlog, j); /* names the kind itself */
                dp_log_end(j);
            }
        }
        refresh_hints(px, s->pool, dp); /* kept in dp: every later verdict sees them */
        quarantine_loop(px, s->pool, dp);
    }
    shadow_unref(s);
}

/* Both sides ended: extract, then compare off the loop. */
static void maybe_compare(shadow_t *s)
{
    if (!s->primary_done || !s->shadow_done)
        return;
    /* Clients commonly close right after `data: [DONE]`, before the chunked terminator: the
     * primary then ends as 499, but its output was complete. */
    bool primary_ok = s->pstatus == 200 || (s->stream && s->pstatus == 499 && s->psse.done);
    if (!primary_ok || s->sfailed || s->sstatus != 200) {
        count(s->pool, s->kind, "error");
        dp_jw_t *j = dp_log_begin(DP_LOG_INFO, "shadow_error");
        if (j) {
            dp_jw_str(j, "request_id", s->request_id);
            dp_jw_int(j, "primary_status", s->pstatus);
            dp_jw_int(j, "shadow_status", s->sstatus);
            dp_jw_str(j, "detail", s->sdetail);
            dp_log_end(j);
        }
        shadow_unref(s);
        return;
    }
    int ra, rb;
    if (s->stream) {
        ra = drift_sse_finish(&s->psse, &s->a);
        rb = drift_sse_finish(&s->ssse, &s->b);
    } else {
        ra =
            drift_extract_json(s->pbody.base ? s->pbody.base : "", s->pbody.len, s->max_out, &s->a);
        rb =
            drift_extract_json(s->sbody.base ? s->sbody.base : "", s->sbody.len, s->max_out, &s->b);
    }
    if (ra != 0 || rb != 0) {
        count(s->pool, s->kind, "error");
        dp_jw_t *j = dp_log_begin(DP_LOG_WARN, "shadow_unreadable");
        if (j) {
            dp_jw_str(j, "request_id", s->request_id);
            dp_jw_str(j, "side", ra != 0 ? "primary" : "shadow");
            dp_jw_bool(j, "stream", s->stream);
            dp_jw_uint(j, "primary_bytes", s->stream ? s->a.text.len : s->pbody.len);
            dp_jw_uint(j, "shadow_bytes", s->stream ? s->b.text.len : s->sbody.len);
            dp_log_end(j);
        }
        shadow_unref(s);
        return;
    }
    s->work.data = s;
    if (uv_queue_work(s->px->loop, &s->work, compare_work, compare_done) != 0) {
        count(s->pool, s->kind, "error");
        shadow_unref(s);
    }
}

/* ---- capture -------------------------------------------------------------------------------- */

static void capture(shadow_t *s, drift_sse_t *sse, dp_buf_t *body, const char *p, size_t n)
{
    if (s->stream) {
        drift_sse_feed(sse, p, n);
        return;
    }
    /* A JSON body is captured up to the cap plus room for its envelope; beyond that the
     * extractor sees a truncated document and the sample counts as an error. */
    if (body->len + n <= s->max_out + DRIFT_SSE_EVENT_SLACK)
        dp_buf_append(body, p, n);
}

void px_shadow_primary_bytes(void *v, const char *p, size_t n)
{
    shadow_t *s = v;
    capture(s, &s->psse, &s->pbody, p, n);
}

static void primary_done_posted(net_mb_node_t *n)
{
    shadow_t *s = (shadow_t *)((char *)n - offsetof(shadow_t, done_node));
    s->primary_done = true;
    maybe_compare(s);
}

void px_shadow_primary_done(void *v, int status)
{
    shadow_t *s = v;
    s->pstatus = status;
    /* From here the capture is the control thread's (the start message went first). */
    px_control_post(s->px, &s->done_node, primary_done_posted);
}

static void active_remove(shadow_t *s)
{
    shadow_ctx_t *c = ctx(s->px);
    if (s->prev)
        s->prev->next = s->next;
    else if (c->active == s)
        c->active = s->next;
    if (s->next)
        s->next->prev = s->prev;
    s->prev = s->next = NULL;
    atomic_fetch_sub(&c->inflight, 1);
}

static void sh_head(net_creq_t *c, int status, const net_header_t *h, size_t n,
                    const net_framing_t *f)
{
    shadow_t *s = c->data;
    (void)h;
    (void)n;
    (void)f;
    s->sstatus = status;
}

static void sh_body(net_creq_t *c, const char *p, size_t n)
{
    shadow_t *s = c->data;
    capture(s, &s->ssse, &s->sbody, p, n);
}

static void sh_done(net_creq_t *c, net_up_err_t err, const char *detail)
{
    shadow_t *s = c->data;
    s->c = NULL;
    active_remove(s);
    if (err != NET_UP_OK) {
        s->sfailed = true;
        snprintf(s->sdetail, sizeof(s->sdetail), "%s: %s", net_up_err_name(err),
                 detail ? detail : "");
    }
    s->shadow_done = true;
    maybe_compare(s);
}

static const net_creq_cb_t shadow_cb = {sh_head, sh_body, sh_done, NULL};

/* ---- dispatch ------------------------------------------------------------------------------ */

const double px_shadow_similarity_bounds[] = {0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0};
const size_t px_shadow_similarity_nbounds =
    sizeof(px_shadow_similarity_bounds) / sizeof(px_shadow_similarity_bounds[0]);

static double uniform(void)
{
    uint64_t x;
    if (dp_random_bytes(&x, sizeof(x)) != 0)
        x = dp_now_ns() * 0x9E3779B97F4A7C15ULL;
    return (double)(x >> 11) / 9007199254740992.0;
}

/* Another replica to compare with: admitted or quarantined (a quarantined replica must keep
 * getting shadows to show it recovered), never the primary. Rotates for coverage. */
static px_replica_t *cross_target(px_pool_t *p, const px_replica_t *primary)
{
    static _Thread_local uint32_t rr;
    size_t n = p->nreplicas;
    for (size_t k = 0; k < n; k++) {
        px_replica_t *r = p->replicas[(rr + k) % n];
        if (r == primary || r->up == NULL || atomic_load(&r->drained))
            continue;
        px_replica_state_t st = px_replica_state(r);
        if (st == PX_REPLICA_ADMITTED || st == PX_REPLICA_QUARANTINED) {
            rr += (uint32_t)k + 1;
            return r;
        }
    }
    return NULL;
}

/* On the control thread: send the copy the worker prepared. */
static void start_posted(net_mb_node_t *n)
{
    shadow_t *s = (shadow_t *)((char *)n - offsetof(shadow_t, start_node));
    px_t *px = s->px;
    shadow_ctx_t *c = ctx(px);
    px_replica_t *target = s->target_r;
    if (atomic_load(&c->stopped)) {
        atomic_fetch_sub(&c->inflight, 1);
        s->sfailed = true;
        snprintf(s->sdetail, sizeof(s->sdetail), "shutting down");
        s->shadow_done = true;
        maybe_compare(s);
        return;
    }
    if (target->shadow_up == NULL) {
        net_upstream_opts_t o;
        px_replica_upstream_opts(px->gen->cfg, &o);
        target->shadow_up = net_upstream_new(px->loop, (struct sockaddr *)&target->addr, &o);
        px_replica_upstream_tls(target, target->shadow_up, &target->url);
    }
    uv_buf_t bufs[2] = {uv_buf_init(s->head.base, (unsigned)s->head.len),
                        uv_buf_init(s->body.base ? s->body.base : "", (unsigned)s->body.len)};
    s->next = c->active;
    if (c->active)
        c->active->prev = s;
    c->active = s;
    s->c = net_creq_start(target->shadow_up, bufs, 2, false, false, &shadow_cb, s);
}

/* A shadow slot under shadow.max_inflight, across workers. */
static bool take_inflight(shadow_ctx_t *c, uint32_t max)
{
    unsigned cur = atomic_load(&c->inflight);
    while (cur < max)
        if (atomic_compare_exchange_weak(&c->inflight, &cur, cur + 1))
            return true;
    return false;
}

void *px_shadow_maybe(px_t *px, px_pool_t *pool, px_replica_t *primary, const cfg_tenant_t *t,
                      const policy_result_t *res, const net_req_t *req, const char *body,
                      size_t len)
{
    const cfg_shadow_t *sc = &pool->gen->cfg->shadow;
    shadow_ctx_t *c = px->shadow;
    double cross = t && t->shadow_rate >= 0 ? t->shadow_rate : sc->rate;
    double self = sc->self_rate;
    if ((cross <= 0 && self <= 0) || c == NULL || atomic_load(&c->stopped))
        return NULL;
    /* One draw picks at most one kind: cross with probability `cross`, self with `self`
     * (scaled down together if they sum past 1). */
    double u = uniform() * (cross + self > 1 ? cross + self : 1);
    drift_kind_t kind;
    if (u < cross)
        kind = DRIFT_CROSS;
    else if (u < cross + self)
        kind = DRIFT_SELF;
    else
        return NULL;
    if (!res->comparable) {
        count(pool->name, kind, "not_comparable");
        return NULL;
    }
    /* single_sequence (SPEC §16): a copy would be a second sequence in flight on a replica of
     * the pool (the primary's own, or one a client request may be sent to next). */
    if (cfg_pool_determinism(pool->cfg) == CFG_DETERMINISM_SINGLE_SEQUENCE) {
        count(pool->name, kind, "skipped");
        return NULL;
    }
    px_replica_t *target = kind == DRIFT_SELF ? primary : cross_target(pool, primary);
    if (target == NULL || target->up == NULL || !take_inflight(c, sc->max_inflight)) {
        count(pool->name, kind, "skipped");
        return NULL;
    }
    shadow_t *s = dp_xcalloc(1, sizeof(*s));
    px_replica_ref(target);
    s->target_r = target;
    s->refs = 1; /* released once both sides have ended (maybe_compare) */
    s->px = px;
    s->pool = dp_xstrdup(pool->name);
    s->primary = dp_xstrdup(primary->name);
    s->target = dp_xstrdup(target->name);
    s->kind = kind;
    memcpy(s->request_id, req->id, sizeof(s->request_id));
    s->stream = res->stream;
    s->max_out = sc->max_output_bytes;
    s->psse.max_output_bytes = s->ssse.max_output_bytes = sc->max_output_bytes;
    dp_buf_t head = {0};
    dp_buf_printf(&head,
                  "POST %s%.*s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                  "content-length: %zu\r\nx-detproxy-request-id: %s\r\nx-detproxy-shadow: %s\r\n",
                  target->url.path ? target->url.path : "", (int)req->path.len, req->path.base,
                  target->url.hostport, len, req->id, drift_kind_name(kind));
    if (pool->cfg->api_key)
        dp_buf_printf(&head, "authorization: Bearer %s\r\n", pool->cfg->api_key);
    size_t vl;
    const char *via = px_self_via_line(&vl);
    dp_buf_append(&head, via, vl);
    dp_buf_append(&head, "\r\n", 2);
    s->head = head;
    dp_buf_append(&s->body, body, len); /* the request's own bytes are gone before the copy */
    px_control_post(px, &s->start_node, start_posted);
    return s;
}

/* ---- admin and shutdown -------------------------------------------------------------------- */

void px_shadow_drift_json(px_t *px, dp_buf_t *out)
{
    /* Every pool of the current configuration, including those never sampled yet. */
    size_t n = px->gen->npools;
    const drift_pool_t **v = dp_xcalloc(n ? n : 1, sizeof(*v));
    for (size_t i = 0; i < n; i++) {
        drift_pool_t *dp = dpool(px, px->gen->pools[i].name);
        refresh_hints(px, px->gen->pools[i].name, dp);
        v[i] = dp;
    }
    drift_render(out, v, n);
    free(v);
}

const drift_pool_t *px_shadow_drift_pool(px_t *px, const char *pool)
{
    return dpool(px, pool);
}

void px_shadow_forget_replica(px_t *px, const char *pool, const char *replica)
{
    drift_pool_forget_replica(dpool(px, pool), replica);
}

void px_shadow_stop(px_t *px)
{
    shadow_ctx_t *c = px->shadow;
    if (c == NULL)
        return;
    atomic_store(&c->stopped, true);
    while (c->active) {
        shadow_t *s = c->active;
        active_remove(s);
        if (s->c) {
            net_creq_cancel(s->c);
            s->c = NULL;
        }
        s->sfailed = true;
        s->shadow_done = true;
        maybe_compare(s);
    }
}

void px_shadow_free(px_t *px)
{
    shadow_ctx_t *c = px->shadow;
    if (c == NULL)
        return;
    for (size_t i = 0; i < c->npools; i++) {
        free(c->pools[i].name);
        drift_pool_free(c->pools[i].dp);
    }
    free(c->pools);
    free(c);
    px->shadow = NULL;
}
