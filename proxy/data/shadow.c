/* Shadow sampling and drift (docs/drift.md).
 *
 * For a comparable request (post-policy temperature 0 or a seed), with probability shadow.rate
 * (or the tenant's shadow_rate) the same post-policy body also goes to another replica
 * ("cross"), or with probability shadow.self_rate to the primary's own replica again ("self",
 * the noise baseline). The client never waits for a shadow: it runs on the replica's separate
 * shadow connection pool, at most shadow.max_inflight at a time, and its result is only
 * compared once both sides ended. Comparison (word-level Levenshtein) runs in libuv's thread
 * pool; the drift statistics, verdicts and quarantine decisions stay on the loop.
 *
 * Candidate pools (docs/rollouts.md) ride the same machinery: with probability `rate` per
 * candidate, a comparable request is also copied to an admitted replica of the candidate pool, and
 * the comparison feeds that candidate's rollout statistics (drift/rollout.h) instead of the pool's
 * drift statistics. Copies are not client requests: no tokens, rate limit, usage, access log line
 * or detproxy_requests_total; detproxy_candidate_total counts them.
 *
 * The primary's output is captured once per request in a tap (tap_t), the handle px_hooks
 * holds, whatever the number of copies (a drift shadow and any candidates). A copy (shadow_t)
 * is freed on exactly one path: whichever of the primary's end (px_shadow_primary_done) and the
 * copy's own exchange comes second runs maybe_compare, which either drops the sample or hands
 * it to the thread pool and frees it in compare_done. Each copy holds a reference on its tap,
 * and the request holds one until the primary ends; the tap goes with the last.
 *
 * Threads: the worker that has the request draws the copies and captures the primary's output
 * into the tap (px_shadow_maybe, px_shadow_primary_bytes); everything else runs on the control
 * thread: choosing targets, the in-flight caps, sending, comparing and the statistics. Two
 * messages cross, in this order: the plan (what was drawn, with a copy of the body; dropped and
 * counted when the control thread's mailbox is full) and the primary's end (always delivered).
 * Until the second, the tap's capture fields are the worker's; after it, the control thread's.
 * The tap's immutable fields (stream, max_out) are read by both. */
#include "proxy/data/shadow.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "drift/drift.h"
#include "drift/rollout.h"
#include "policy/policy.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"
#include "proxy/data/admission.h"
#include "proxy/data/worker.h"
#include "proxy/core/self.h"

typedef struct shadow_s shadow_t;
typedef struct tap_s tap_t;

/* One candidate of one pool: its statistics, and its copies in flight (each candidate has
 * shadow.max_inflight of its own, so a slow one does not starve the others). Never moves. */
typedef struct rentry_s {
    drift_rollout_t *stats;
    uint32_t inflight;
} rentry_t;

typedef struct {
    char *name;
    drift_pool_t *dp;
    /* The verdict last logged ("drift_verdict" lines, one per change, like replica_state). */
    drift_verdict_kind_t logged;
    char logged_suspect[DRIFT_NAME_MAX];
} dpool_t;

/* The control thread's, but `stopped`, which workers read. */
struct px_shadow_ctx_s {
    dpool_t *pools;
    size_t npools;
    struct rentry_s **rollouts; /* per (baseline, candidate) pair of names */
    size_t nrollouts;
    uint32_t inflight;   /* drift shadows in flight */
    shadow_t *active;    /* exchanges in flight, for shutdown */
    net_drains_t drains; /* copies read on past their first-byte timeout (copy_timed_out) */
    /* Copies still waiting for a free slot after their primary ended: tried every
     * COPY_RETRY_MS, never while clients wait, for at most COPY_WAIT_MS. */
    struct plan_s *waiting;
    uint32_t nwaiting;
    uint32_t nactive;      /* exchanges on `active` */
    px_series_t *m_copies; /* detproxy_shadow_copies: nwaiting + nactive */
    uv_timer_t retry;
    bool retry_armed, retry_init;
    atomic_bool stopped;
};
typedef struct px_shadow_ctx_s shadow_ctx_t;

/* The primary's output, captured once for every copy of the request. */
struct tap_s {
    px_t *px;
    net_mb_node_t done_node; /* the primary's end, to the control thread */
    int refs;
    bool stream;
    size_t max_out;
    drift_sse_t sse;
    dp_buf_t body;
    int status;
    bool done;      /* the primary ended ... */
    bool ok;        /* ... with a complete answer, extracted into out */
    int extract_rc; /* drift_extract_json / drift_sse_finish of the primary */
    drift_output_t out;
    shadow_t *copies; /* waiting for the primary, linked by tap_next */
    /* Copies that found no free slot on their replica while the primary ran: tried again
     * once it ended (at N = 1 the primary held the slot a copy to its replica needs). */
    struct plan_s *later;
};

struct shadow_s {
    px_t *px;
    px_replica_t *target_r; /* a reference, until the copy is freed */
    tap_t *tap;
    shadow_t *tap_next;
    shadow_t *prev, *next; /* on ctx->active while the exchange runs */
    char *pool;
    char *primary;
    char *target;
    char *candidate;  /* the candidate pool; NULL for a drift shadow */
    rentry_t *rentry; /* the candidate's entry (its in-flight count) */
    char *tenant;     /* candidates: the request's tenant (per-tenant rollout statistics) */
    drift_kind_t kind;
    bool holds_slot; /* a slot of target_r, until the exchange ends */
    /* Its pool's engine finishes an answer whose connection closed (policy_pool_drains_abandoned
     * when it was sent: a reload that renames the pool meanwhile changes no engine). */
    bool drains;
    char request_id[24];
    /* shadow capture */
    net_creq_t *c;
    drift_sse_t ssse;
    dp_buf_t sbody;
    int sstatus;
    bool sfailed;
    char sdetail[120];
    bool shadow_done;
    bool compared; /* maybe_compare ran: the copy is leaving */
    /* comparison (thread pool) */
    uv_work_t work;
    drift_output_t b;
    drift_result_t result;
    drift_divlog_t divlog;
};

/* How long a copy may wait for its replica to have a slot no client wants, and how often it
 * looks: long enough to find the gap between a replica's requests at N = 1, short enough that
 * the copy still says something about the replica as it is now. */
#define COPY_WAIT_MS 2000
#define COPY_RETRY_MS 5

static shadow_ctx_t *ctx(px_t *px)
{
    if (px->shadow == NULL) {
        PX_ASSERT_CONTROL(); /* made at start (px_shadow_init), before any worker runs */
        px->shadow = dp_xcalloc(1, sizeof(shadow_ctx_t));
        px->shadow->m_copies = px_metrics_get("detproxy_shadow_copies", NULL);
    }
    return px->shadow;
}

/* Copies waiting for a slot or running: 0 once every copy drawn has ended (counted). */
static void copies_changed(shadow_ctx_t *c)
{
    px_metrics_set(c->m_copies, (double)(c->nwaiting + c->nactive));
}

void px_shadow_init(px_t *px)
{
    ctx(px);
}

/* The pool's drift entry, or NULL when it has none yet. */
static dpool_t *dpool_find(shadow_ctx_t *c, const char *name)
{
    for (size_t i = 0; i < c->npools; i++)
        if (strcmp(c->pools[i].name, name) == 0)
            return &c->pools[i];
    return NULL;
}

static dpool_t *dpool_entry(px_t *px, const char *name)
{
    shadow_ctx_t *c = ctx(px);
    dpool_t *found = dpool_find(c, name);
    if (found)
        return found;
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
    px_metrics_add(px_metrics_get("detproxy_shadow_total", "pool", pool, "kind",
                                  drift_kind_name(kind), "result", result, NULL),
                   1);
}

/* The rollout statistics of candidate `cand` of pool `pool` (created empty on first use). */
static rentry_t *rollout(px_t *px, const char *pool, const char *cand)
{
    shadow_ctx_t *c = ctx(px);
    for (size_t i = 0; i < c->nrollouts; i++)
        if (strcmp(drift_rollout_pool(c->rollouts[i]->stats), pool) == 0 &&
            strcmp(drift_rollout_candidate(c->rollouts[i]->stats), cand) == 0)
            return c->rollouts[i];
    c->rollouts = dp_xrealloc(c->rollouts, (c->nrollouts + 1) * sizeof(*c->rollouts));
    rentry_t *e = dp_xcalloc(1, sizeof(*e));
    e->stats = drift_rollout_new(pool, cand);
    return c->rollouts[c->nrollouts++] = e;
}

static void count_candidate(const char *pool, const char *cand, const char *result)
{
    px_metrics_add(px_metrics_get("detproxy_candidate_total", "pool", pool, "candidate", cand,
                                  "result", result, NULL),
                   1);
}

/* A candidate copy that will give no sample: counted, and remembered with its reason for an
 * insufficient_data verdict. */
static void candidate_miss(px_t *px, const char *pool, const char *cand, drift_rollout_outcome_t o,
                           const char *why)
{
    static const char *const names[] = {"skipped", "error", "not_comparable"};
    count_candidate(pool, cand, names[o]);
    if (!atomic_load(&ctx(px)->stopped))
        drift_rollout_miss(rollout(px, pool, cand)->stats, o, why);
}

/* A copy that produced no comparison: its own counter says why. */
static void count_error(shadow_t *s, const char *why)
{
    if (s->candidate)
        candidate_miss(s->px, s->pool, s->candidate, ROLLOUT_ERROR, why);
    else
        count(s->pool, s->kind, "error");
}

static void tap_unref(tap_t *t)
{
    if (--t->refs > 0)
        return;
    assert(t->copies == NULL && t->later == NULL);
    drift_sse_free(&t->sse);
    dp_buf_free(&t->body);
    drift_output_free(&t->out);
    free(t);
}

/* The exchange ended: a client request queued for the replica's slot may go now (every
 * queue lives on a worker). */
static void release_slot(shadow_t *s)
{
    if (!s->holds_slot)
        return;
    s->holds_slot = false;
    px_admission_own_slot_done(s->px, s->target_r);
}

static void shadow_free(shadow_t *s)
{
    release_slot(s);
    drift_sse_free(&s->ssse);
    dp_buf_free(&s->sbody);
    drift_output_free(&s->b);
    free(s->pool);
    free(s->primary);
    free(s->target);
    free(s->candidate);
    free(s->tenant);
    if (s->target_r)
        px_replica_unref(s->target_r);
    tap_unref(s->tap);
    free(s);
}

/* ---- comparison and the verdict loop ----------------------------------------------------- */

/* The tap's output is read-only once extracted: several copies may compare with it at once. */
static void compare_work(uv_work_t *w)
{
    shadow_t *s = w->data;
    const drift_output_t *a = &s->tap->out;
    drift_compare(a, &s->b, &s->result);
    if (!s->result.match)
        drift_divlog_fill(&s->divlog, s->request_id, s->pool, s->primary, s->target, &s->result,
                          a->text.base, a->text.len, s->b.text.base, s->b.text.len);
    if (s->candidate) { /* two pools: equal replica names are still no self pair */
        s->divlog.kind = DRIFT_CROSS;
        s->divlog.candidate = true;
    }
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
        n += px_replica_state(p->replicas[i]) == PX_REPLICA_ADMITTED;
    return n;
}

/* What attestation published about r that shadow samples cannot tell (for naming one of two
 * replicas, drift.h): its last canary result, the identity it was admitted as (pool p's own or
 * one of a rollout's accept list), when its identity last changed. */
static void replica_hint(const px_pool_t *p, const px_replica_t *r, drift_hint_t *h)
{
    memset(h, 0, sizeof(*h));
    snprintf(h->fingerprint, sizeof(h->fingerprint), "%s", r->fingerprint);
    h->accept_identity = r->fingerprint[0] && strcmp(r->fingerprint, p->fingerprint) != 0;
    if (r->canary != PX_CANARY_UNKNOWN)
        h->canary = r->canary == PX_CANARY_FAIL ? DRIFT_CANARY_FAIL : DRIFT_CANARY_PASS;
    h->identity_changed_ms = r->identity_changed_ms;
}

/* The hints of every replica of the pool, from what attestation published now. A hint that
 * shows a new identity starts that replica's windows again (drift_pool_set_hint): the verdict
 * may change here, and is logged when it does. */
static void refresh_hints(px_t *px, const char *pool_name, drift_pool_t *dp)
{
    px_pool_t *p = live_pool(px, pool_name);
    bool changed = false;
    for (size_t i = 0; p && i < p->nreplicas; i++) {
        drift_hint_t h;
        replica_hint(p, p->replicas[i], &h);
        changed |= drift_pool_set_hint(dp, p->replicas[i]->name, &h);
    }
    dpool_t *e = changed ? dpool_find(ctx(px), pool_name) : NULL;
    if (e)
        log_verdict_change(e);
}

/* Verdicts follow the present (docs/drift.md §5, "History"): a replica back in service after
 * being out (a restart shows as pending or unreachable, then admitted; also rejected or
 * quarantined, then admitted) starts every window it is in again, and the change is remembered
 * for naming one of two replicas. A replica whose pool has no drift statistics yet has nothing
 * to restart. */
void px_shadow_replica_changed(const px_replica_t *r, px_replica_state_t from)
{
    PX_ASSERT_CONTROL();
    shadow_ctx_t *c = r->px ? r->px->shadow : NULL;
    if (c == NULL || from == PX_REPLICA_ADMITTED || px_replica_state(r) != PX_REPLICA_ADMITTED)
        return;
    dpool_t *e = dpool_find(c, r->pool_name);
    if (e == NULL)
        return;
    char what[DRIFT_CHANGE_MAX];
    snprintf(what, sizeof(what), "re-admitted from %s", px_replica_state_names[from]);
    drift_pool_replica_changed(e->dp, r->name, what, dp_wall_ms());
    log_verdict_change(e);
}

/* Quarantine (docs/drift.md §6): the suspect of a cross_replica_drift verdict stops getting client
 * traffic (but keeps getting shadows), never the pool's last admitted replica; it comes back once
 * its divergence falls to the self baseline. */
static void quarantine_loop(px_t *px, const char *pool_name, drift_pool_t *dp)
{
    px_pool_t *p = live_pool(px, pool_name);
    if (p == NULL || !px->gen->cfg->shadow.quarantine)
        return;
    for (size_t i = 0; i < p->nreplicas; i++) {
        px_replica_t *r = p->replicas[i];
        if (px_replica_state(r) == PX_REPLICA_QUARANTINED &&
            drift_pool_replica_recovered(dp, r->name)) {
            /* Re-admitted: its windows start again (px_shadow_replica_changed), or the old
             * evidence would convict it at once. */
            const char *why[] = {"divergence back at the self baseline", NULL};
            px_replica_set_state(r, PX_REPLICA_ADMITTED, why);
        }
    }
    drift_verdict_t v;
    drift_pool_verdict(dp, &v);
    if (v.kind != DRIFT_CROSS_REPLICA_DRIFT || !v.has_suspect || !v.suspect[0])
        return;
    px_replica_t *r = replica_named(p, v.suspect);
    if (r == NULL || px_replica_state(r) != PX_REPLICA_ADMITTED || admitted_count(p) <= 1)
        return;
    char why[DRIFT_REASON_MAX + 64];
    snprintf(why, sizeof(why), "quarantined: cross_replica_drift suspect (%s)",
             v.nreasons ? v.reasons[0] : "diverges from the other replicas");
    const char *list[] = {why, NULL};
    px_replica_set_state(r, PX_REPLICA_QUARANTINED, list);
}

/* A candidate sample: the rollout's statistics, its counter, and a divergence line of the same
 * shape as a drift shadow's (kind cross; pair: the baseline's replica, the candidate's) naming
 * the candidate pool and the tenant. */
static void candidate_done(shadow_t *s)
{
    drift_rollout_add(s->rentry->stats, s->tenant, s->request_id, &s->result);
    count_candidate(s->pool, s->candidate, s->result.match ? "match" : "diverged");
    if (!s->result.match) {
        dp_jw_t *j = dp_log_begin(DP_LOG_INFO, "candidate_divergence");
        if (j) {
            dp_jw_str(j, "candidate", s->candidate);
            dp_jw_str(j, "tenant", s->tenant);
            drift_divlog_write(&s->divlog, j);
            dp_log_end(j);
        }
    }
}

static void compare_done(uv_work_t *w, int status)
{
    shadow_t *s = w->data;
    px_t *px = s->px;
    (void)status;
    bool stopped = atomic_load(&ctx(px)->stopped);
    if (!stopped && s->candidate) {
        candidate_done(s);
    } else if (!stopped) {
        dpool_t *e = dpool_entry(px, s->pool);
        drift_pool_t *dp = e->dp;
        drift_pool_add(dp, s->primary, s->target, &s->result);
        log_verdict_change(e);
        count(s->pool, s->kind, s->result.match ? "match" : "diverged");
        px_metrics_observe(px_metrics_hist("detproxy_shadow_similarity",
                                           px_shadow_similarity_bounds,
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
    shadow_free(s);
}

/* Both sides ended: extract the copy's output, then compare off the loop. Runs once per copy
 * (the second of the two ends) and takes the copy away. */
static void maybe_compare(shadow_t *s)
{
    tap_t *t = s->tap;
    if (!t->done || !s->shadow_done || s->compared)
        return;
    s->compared = true;
    if (!t->ok || s->sfailed || s->sstatus != 200) {
        char why[160];
        if (!t->ok)
            snprintf(why, sizeof(why), "the baseline's answer was not a complete 200 (%d)",
                     t->status);
        else if (s->sfailed)
            snprintf(why, sizeof(why), "%s", s->sdetail);
        else
            snprintf(why, sizeof(why), "%s answered HTTP %d", s->target, s->sstatus);
        count_error(s, why);
        dp_jw_t *j = dp_log_begin(DP_LOG_INFO, s->candidate ? "candidate_error" : "shadow_error");
        if (j) {
            dp_jw_str(j, "request_id", s->request_id);
            dp_jw_str(j, "candidate", s->candidate);
            dp_jw_int(j, "primary_status", t->status);
            dp_jw_int(j, "shadow_status", s->sstatus);
            dp_jw_str(j, "detail", s->sdetail);
            dp_log_end(j);
        }
        shadow_free(s);
        return;
    }
    int rb = t->stream ? drift_sse_finish(&s->ssse, &s->b)
                       : drift_extract_json(s->sbody.base ? s->sbody.base : "", s->sbody.len,
                                            t->max_out, &s->b);
    if (t->extract_rc != 0 || rb != 0) {
        count_error(s, "an answer was unreadable");
        dp_jw_t *j = dp_log_begin(DP_LOG_WARN, "shadow_unreadable");
        if (j) {
            dp_jw_str(j, "request_id", s->request_id);
            dp_jw_str(j, "candidate", s->candidate);
            dp_jw_str(j, "side", t->extract_rc != 0 ? "primary" : "shadow");
            dp_jw_bool(j, "stream", t->stream);
            dp_jw_uint(j, "primary_bytes", t->stream ? t->out.text.len : t->body.len);
            dp_jw_uint(j, "shadow_bytes", t->stream ? s->b.text.len : s->sbody.len);
            dp_log_end(j);
        }
        shadow_free(s);
        return;
    }
    s->work.data = s;
    if (uv_queue_work(s->px->loop, &s->work, compare_work, compare_done) != 0) {
        count_error(s, "the thread pool refused the comparison");
        shadow_free(s);
    }
}

/* ---- capture -------------------------------------------------------------------------------- */

static void capture(const tap_t *t, drift_sse_t *sse, dp_buf_t *body, const char *p, size_t n)
{
    if (t->stream) {
        drift_sse_feed(sse, p, n);
        return;
    }
    /* A JSON body is captured up to the cap plus room for its envelope; beyond that the
     * extractor sees a truncated document and the sample counts as an error. */
    if (body->len + n <= t->max_out + DRIFT_SSE_EVENT_SLACK)
        dp_buf_append(body, p, n);
}

void px_shadow_primary_bytes(void *v, const char *p, size_t n)
{
    tap_t *t = v;
    capture(t, &t->sse, &t->body, p, n);
}

static void carry_out_later(px_t *px, tap_t *t);

/* On the control thread: the primary is over; every copy may now compare. */
static void primary_done_posted(net_mb_node_t *n)
{
    tap_t *t = (tap_t *)((char *)n - offsetof(tap_t, done_node));
    int status = t->status;
    t->done = true;
    /* Clients commonly close right after `data: [DONE]`, before the chunked terminator: the
     * primary then ends as 499, but its output was complete. */
    t->ok = status == 200 || (t->stream && status == 499 && t->sse.done);
    if (t->ok)
        t->extract_rc = t->stream ? drift_sse_finish(&t->sse, &t->out)
                                  : drift_extract_json(t->body.base ? t->body.base : "",
                                                       t->body.len, t->max_out, &t->out);
    dp_buf_free(&t->body);
    shadow_t *s = t->copies;
    t->copies = NULL; /* each copy now finishes on its own (maybe_compare) */
    while (s) {
        shadow_t *next = s->tap_next;
        s->tap_next = NULL;
        maybe_compare(s);
        s = next;
    }
    if (t->later)
        carry_out_later(t->px, t);
    tap_unref(t);
}

void px_shadow_primary_done(void *v, int status)
{
    tap_t *t = v;
    t->status = status;
    /* From here the capture is the control thread's (the plan went first). */
    px_thread_post_control(t->px, &t->done_node, primary_done_posted);
}

static void active_remove(shadow_t *s)
{
    shadow_ctx_t *c = ctx(s->px);
    uint32_t *inflight = s->rentry ? &s->rentry->inflight : &c->inflight;
    if (s->prev)
        s->prev->next = s->next;
    else if (c->active == s)
        c->active = s->next;
    if (s->next)
        s->next->prev = s->prev;
    s->prev = s->next = NULL;
    (*inflight)--;
    c->nactive--;
    copies_changed(c);
    release_slot(s);
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
    capture(s->tap, &s->ssse, &s->sbody, p, n);
}

/* May s's slot outlive its exchange (a drain, a hold)? s holds one on a pool whose engine
 * finishes an answer whose connection closed (llama.cpp on a single_sequence pool:
 * policy_pool_drains_abandoned), and the copies have not stopped. */
static bool slot_may_outlive(shadow_t *s)
{
    return s->holds_slot && (s->drains || px_replica_drains_abandoned(s->target_r)) &&
           !atomic_load(&ctx(s->px)->stopped);
}

static void copy_ended(shadow_t *s, net_up_err_t err, const char *detail)
{
    s->c = NULL;
    /* Failed once the engine had it whole (closed, cut mid-answer): it may be generating it
     * still, and its slot stays kept for as long as a drain would have lasted. Decided before
     * active_remove, which frees a slot the copy still holds. */
    if (net_up_err_may_run(err) && slot_may_outlive(s)) {
        px_admission_hold(s->px, s->target_r, policy_abandoned_drain_ms(&s->px->gen->cfg->limits));
        s->holds_slot = false; /* the hold frees it */
    }
    active_remove(s);
    if (err != NET_UP_OK) {
        s->sfailed = true;
        snprintf(s->sdetail, sizeof(s->sdetail), "%s: %s", net_up_err_name(err),
                 detail ? detail : "");
    }
    /* A copy's failed connection says what a client's would (a quarantined replica gets only
     * copies): the replica may have restarted as something else. */
    px_event_upstream_failed(s->px, s->target_r, err);
    s->shadow_done = true;
    maybe_compare(s);
}

static void sh_done(net_creq_t *c, net_up_err_t err, const char *detail)
{
    copy_ended(c->data, err, detail);
}

/* A copy to a pool whose engine finishes an answer whose connection closed (llama.cpp on a
 * single_sequence pool: policy_pool_drains_abandoned) that got no answer within its first-byte
 * timeout, or whose answer fell silent mid-way for the idle timeout (a long prefill behind an
 * early head): the copy fails then, as before, but its exchange is read on and dropped, and its
 * slot freed only once the answer has come (or policy_abandoned_drain_ms passed), as for a
 * client's request (data/proxy.c, drain_abandoned): otherwise the next copy or request would
 * run beside the generation still going on, or the slot would be kept blind for the drain's
 * whole time. Cancelled at px_shadow_stop. */
static void copy_timed_out(net_creq_t *c, net_up_err_t err, const char *detail)
{
    shadow_t *s = c->data;
    shadow_ctx_t *sc = ctx(s->px);
    if (!slot_may_outlive(s) || !net_creq_sent(c))
        return;
    px_admission_drain(s->px, s->target_r, c, &sc->drains,
                       policy_abandoned_drain_ms(&s->px->gen->cfg->limits));
    s->holds_slot = false;      /* the drain frees it */
    copy_ended(s, err, detail); /* frees s */
}

static const net_creq_cb_t shadow_cb = {
    .on_head = sh_head, .on_body = sh_body, .on_done = sh_done, .on_timeout = copy_timed_out};

/* ---- dispatch ------------------------------------------------------------------------------ */

const double px_shadow_similarity_bounds[] = {0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0};
const size_t px_shadow_similarity_nbounds =
    sizeof(px_shadow_similarity_bounds) / sizeof(px_shadow_similarity_bounds[0]);

/* A slot on r for a copy: not while r is held (unverified, core/replica.h); a copy never waits,
 * so it is skipped meanwhile, counted as busy. A copy's first connection asks for no check of
 * its own: a copy that meets a replaced engine moves drift statistics, never a client's
 * answer, and the close that replaced it held the replica already. Control thread. */
static net_upstream_t *copy_upstream(px_t *px, px_replica_t *r)
{
    if (r->shadow_up == NULL) {
        net_upstream_opts_t o;
        px_replica_upstream_opts(px->gen->cfg, &o);
        r->shadow_up = net_upstream_new(px->loop, (struct sockaddr *)&r->addr, &o);
        px_replica_upstream_tls(r, r->shadow_up, &r->url);
        px_event_watch_closes(r, r->shadow_up);
    }
    return r->shadow_up;
}

static bool copy_slot(px_pool_t *p, px_replica_t *r)
{
    return !atomic_load(&r->unverified) && px_replica_take_spare_slot(p, r);
}

/* A replica to send a copy to, rotating for coverage: for a drift shadow another replica of the
 * pool, admitted or quarantined (a quarantined replica must keep getting shadows to show it
 * recovered), never the primary; for a candidate copy any serving replica of the candidate.
 *
 * A copy is a request like any other at the replica: it holds one of the replica's slots under
 * the pool's max_inflight_per_replica while it runs, so with N = 1 a replica never has a copy
 * beside another request (docs/drift.md, "Which requests are copied, and where"). It never goes
 * ahead of a client: none is taken while requests of the pool wait for a slot. NULL when there
 * is no replica to send it to; *busy then says whether one could take it but had no free slot. */
static px_replica_t *copy_target(px_pool_t *p, const px_replica_t *primary, bool quarantined,
                                 bool *busy)
{
    static uint32_t rr; /* control thread only */
    size_t n = p->nreplicas;
    *busy = false;
    for (size_t k = 0; k < n; k++) {
        px_replica_t *r = p->replicas[(rr + k) % n];
        if (r == primary || r->up == NULL || atomic_load(&r->drained))
            continue;
        px_replica_state_t st = px_replica_state(r);
        if (st != PX_REPLICA_ADMITTED && !(quarantined && st == PX_REPLICA_QUARANTINED))
            continue;
        if (!copy_slot(p, r)) {
            *busy = true;
            continue;
        }
        rr += (uint32_t)k + 1;
        return r;
    }
    return NULL;
}

/* The same replica again (a self copy): its slot, under the same rules. */
static px_replica_t *self_target(px_pool_t *p, px_replica_t *primary, bool *busy)
{
    *busy = false;
    if (primary == NULL || primary->up == NULL)
        return NULL;
    if (!copy_slot(p, primary)) {
        *busy = true;
        return NULL;
    }
    return primary;
}

/* What the worker drew for one request, for the control thread to carry out. */
typedef struct plan_s {
    net_mb_node_t node;
    px_t *px;
    tap_t *tap; /* NULL when the request is not comparable: nothing will be compared */
    char *pool, *primary, *tenant;
    bool comparable;
    bool several_sequences; /* policy_result_t's: no copy to a single_sequence pool */
    bool drift;             /* a drift shadow of `kind` was drawn */
    drift_kind_t kind;
    char **cands; /* candidate pools drawn (NULL once carried out: see tap_t.later) */
    size_t ncands;
    dp_buf_t model; /* the request's model (a candidate may serve another name) */
    dp_buf_t path;
    dp_buf_t body; /* the post-policy body: the request's own bytes are gone before the copy */
    char request_id[24];
    struct plan_s *wnext; /* on the context's list of plans waiting for a slot */
    uint64_t deadline_ns; /* ... until then (dp_now_ns) */
} plan_t;

/* What one copy is: where it goes and what it carries. */
typedef struct {
    px_pool_t *pool;    /* the pool of the request (the baseline of a candidate) */
    px_pool_t *to_pool; /* the pool whose replica answers it (its api_key is sent) */
    const char *primary;
    px_replica_t *target;
    drift_kind_t kind;
    const char *candidate; /* NULL: a drift shadow */
    const char *tenant;
    const char *body;
    size_t len;
    rentry_t *rentry; /* candidates only */
} copy_spec_t;

/* What became of a copy the control thread was asked for. */
typedef enum { COPY_STARTED, COPY_SKIPPED, COPY_BUSY } copy_rc_t;

/* On the control thread. */
static void start_copy(px_t *px, tap_t *t, const copy_spec_t *cs, const plan_t *pl)
{
    PX_ASSERT_CONTROL();
    shadow_ctx_t *c = ctx(px);
    px_replica_t *target = cs->target;
    copy_upstream(px, target);
    shadow_t *s = dp_xcalloc(1, sizeof(*s));
    s->px = px;
    px_replica_ref(target);
    s->target_r = target;
    s->tap = t;
    t->refs++;
    if (!t->done) { /* else it compares on its own end (maybe_compare) */
        s->tap_next = t->copies;
        t->copies = s;
    }
    s->pool = dp_xstrdup(cs->pool->name);
    s->primary = dp_xstrdup(cs->primary);
    s->target = dp_xstrdup(target->name);
    s->candidate = cs->candidate ? dp_xstrdup(cs->candidate) : NULL;
    s->rentry = cs->rentry;
    s->tenant = cs->tenant ? dp_xstrdup(cs->tenant) : NULL;
    s->kind = cs->kind;
    s->holds_slot = true; /* copy_target or self_target took it */
    s->drains = policy_pool_drains_abandoned(cs->to_pool->cfg);
    memcpy(s->request_id, pl->request_id, sizeof(s->request_id));
    s->ssse.max_output_bytes = t->max_out;
    dp_buf_t head = {0};
    dp_buf_printf(&head,
                  "POST %s%.*s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                  "accept-encoding: identity\r\ncontent-length: %zu\r\nx-detproxy-request-id: "
                  "%s\r\nx-detproxy-shadow: %s\r\n",
                  target->url.path ? target->url.path : "", (int)pl->path.len,
                  pl->path.base ? pl->path.base : "", target->url.hostport, cs->len, pl->request_id,
                  cs->candidate ? "candidate" : drift_kind_name(cs->kind));
    if (cs->to_pool->cfg->api_key)
        dp_buf_printf(&head, "authorization: Bearer %s\r\n", cs->to_pool->cfg->api_key);
    size_t vl;
    const char *via = px_self_via_line(&vl);
    dp_buf_append(&head, via, vl);
    dp_buf_append(&head, "\r\n", 2);
    uv_buf_t bufs[2] = {uv_buf_init(head.base, (unsigned)head.len),
                        uv_buf_init((char *)(cs->body ? cs->body : ""), (unsigned)cs->len)};
    s->c = net_creq_start(target->shadow_up, bufs, 2, false, false, &shadow_cb, s);
    s->c->length_required = px_replica_drains_abandoned(target);
    dp_buf_free(&head);
    if (s->rentry)
        s->rentry->inflight++;
    else
        c->inflight++;
    s->next = c->active;
    if (c->active)
        c->active->prev = s;
    c->active = s;
    c->nactive++;
    copies_changed(c);
}

static double uniform(void)
{
    uint64_t x;
    if (dp_random_bytes(&x, sizeof(x)) != 0)
        x = dp_now_ns() * 0x9E3779B97F4A7C15ULL;
    return (double)(x >> 11) / 9007199254740992.0;
}

static void plan_free(plan_t *pl)
{
    free(pl->pool);
    free(pl->primary);
    free(pl->tenant);
    for (size_t i = 0; i < pl->ncands; i++)
        free(pl->cands[i]);
    free(pl->cands);
    dp_buf_free(&pl->model);
    dp_buf_free(&pl->path);
    dp_buf_free(&pl->body);
    free(pl);
}

/* docs/drift.md: at most one drift shadow per request, cross or self (drawn on the worker).
 * COPY_BUSY (not counted) when its replica has no free slot and this is not the last try. */
static copy_rc_t start_drift(px_t *px, px_pool_t *pool, const plan_t *pl, bool last_try)
{
    const cfg_shadow_t *sc = &px->gen->cfg->shadow;
    shadow_ctx_t *c = ctx(px);
    if (c->inflight >= sc->max_inflight) {
        count(pool->name, pl->kind, "skipped");
        return COPY_SKIPPED;
    }
    px_replica_t *primary = replica_named(pool, pl->primary);
    bool busy;
    px_replica_t *target = pl->kind == DRIFT_SELF ? self_target(pool, primary, &busy)
                                                  : copy_target(pool, primary, true, &busy);
    if (target == NULL) {
        if (busy && !last_try)
            return COPY_BUSY;
        count(pool->name, pl->kind, "skipped");
        return COPY_SKIPPED;
    }
    copy_spec_t cs = {pool, pool, pl->primary,   target,       pl->kind,
                      NULL, NULL, pl->body.base, pl->body.len, NULL};
    start_copy(px, pl->tap, &cs, pl);
    return COPY_STARTED;
}

static bool serves_model(const cfg_pool_t *p, const dp_buf_t *m)
{
    for (size_t i = 0; i < p->nmodels; i++)
        if (strcmp(p->models[i], "*") == 0 ||
            (strlen(p->models[i]) == m->len && memcmp(p->models[i], m->base, m->len) == 0))
            return true;
    return false;
}

/* docs/rollouts.md §2: a candidate drawn for the request. It gets the baseline's post-policy body;
 * when its pool does not list the request's model it gets its own first model name instead (a vLLM
 * server answers 404 for a name it does not serve). */
static copy_rc_t start_candidate(px_t *px, px_pool_t *pool, const plan_t *pl, const char *cand,
                                 bool last_try)
{
    const cfg_shadow_t *sc = &px->gen->cfg->shadow;
    if (!pl->comparable) {
        candidate_miss(px, pool->name, cand, ROLLOUT_NOT_COMPARABLE,
                       "neither temperature 0 nor a seed after policy");
        return COPY_SKIPPED;
    }
    rentry_t *e = rollout(px, pool->name, cand);
    if (e->inflight >= sc->max_inflight) {
        candidate_miss(px, pool->name, cand, ROLLOUT_SKIPPED,
                       "shadow.max_inflight candidate copies already in flight");
        return COPY_SKIPPED;
    }
    px_pool_t *cp = live_pool(px, cand);
    /* Several sequences at once would break the candidate's promise of one (docs/configuration.md
     * "Deterministic pools"), as the request itself would be refused there. */
    if (cp && pl->several_sequences &&
        cfg_pool_determinism(cp->cfg) == CFG_DETERMINISM_SINGLE_SEQUENCE) {
        char why[200];
        snprintf(why, sizeof(why),
                 "pool %s runs one sequence at a time (single_sequence) and the request several "
                 "(n, n_cmpl, best_of, beam search or a batch of prompts)",
                 cand);
        candidate_miss(px, pool->name, cand, ROLLOUT_SKIPPED, why);
        return COPY_SKIPPED;
    }
    bool busy = false;
    px_replica_t *target = cp ? copy_target(cp, NULL, false, &busy) : NULL;
    if (target == NULL) {
        if (busy && !last_try)
            return COPY_BUSY;
        char why[160];
        snprintf(why, sizeof(why),
                 busy ? "pool %s has no admitted replica with a free slot (clients first)"
                      : "pool %s has no admitted replica",
                 cand);
        candidate_miss(px, pool->name, cand, ROLLOUT_SKIPPED, why);
        return COPY_SKIPPED;
    }
    dp_buf_t renamed = {0}, nocache = {0};
    copy_spec_t cs = {pool, cp,         pl->primary,   target,       DRIFT_CROSS,
                      cand, pl->tenant, pl->body.base, pl->body.len, e};
    if (cp->cfg->nmodels && !serves_model(cp->cfg, &pl->model) &&
        policy_replace_model(cs.body ? cs.body : "", cs.len, cp->cfg->models[0], &renamed) == 0) {
        cs.body = renamed.base;
        cs.len = renamed.len;
    }
    /* The body was shaped by the baseline's policy: the candidate's own N8 rule still holds. */
    if (policy_pool_no_cache_prompt(cp->cfg) &&
        policy_force_cache_prompt_off(cs.body ? cs.body : "", cs.len, &nocache) == 0) {
        cs.body = nocache.base;
        cs.len = nocache.len;
    }
    start_copy(px, pl->tap, &cs, pl);
    dp_buf_free(&renamed); /* the request bytes were copied into the exchange */
    dp_buf_free(&nocache);
    return COPY_STARTED;
}

/* Carry out the copies of pl still to do; with last_try false, those whose replica has no free
 * slot stay in pl (true when any did). */
static bool carry_out(px_t *px, px_pool_t *pool, plan_t *pl, bool last_try)
{
    bool busy = false;
    if (pl->drift) {
        pl->drift = start_drift(px, pool, pl, last_try) == COPY_BUSY;
        busy |= pl->drift;
    }
    for (size_t i = 0; i < pl->ncands; i++) {
        if (pl->cands[i] == NULL)
            continue;
        if (start_candidate(px, pool, pl, pl->cands[i], last_try) == COPY_BUSY) {
            busy = true;
            continue;
        }
        free(pl->cands[i]);
        pl->cands[i] = NULL;
    }
    return busy;
}

/* On the control thread: carry out what the worker drew. Copies that find their replica busy
 * wait for the primary's end (its own slot frees then) and are tried once more. */
static void plan_posted(net_mb_node_t *n)
{
    plan_t *pl = (plan_t *)((char *)n - offsetof(plan_t, node));
    px_t *px = pl->px;
    px_pool_t *pool = atomic_load(&ctx(px)->stopped) ? NULL : live_pool(px, pl->pool);
    /* NULL: shutting down, or a reload took the pool away meanwhile */
    if (pool && carry_out(px, pool, pl, false)) {
        assert(pl->tap != NULL && !pl->tap->done && pl->tap->later == NULL);
        pl->tap->later = pl;
        return;
    }
    plan_free(pl);
}

/* The primary ended: the copies that waited for a slot get their last try. Pointless when
 * the primary has no complete answer to compare with: those count as errors, as a copy would. */
static void retry_cb(uv_timer_t *timer);

/* Keep pl (and its tap) until a slot frees or COPY_WAIT_MS passed; false when as many copies
 * wait already as shadow.max_inflight allows in flight. */
static bool wait_for_slot(px_t *px, plan_t *pl)
{
    shadow_ctx_t *c = ctx(px);
    if (c->nwaiting >= px->gen->cfg->shadow.max_inflight)
        return false;
    if (!c->retry_init) {
        uv_timer_init(px->loop, &c->retry);
        c->retry.data = px;
        c->retry_init = true;
    }
    pl->tap->refs++;
    pl->deadline_ns = dp_now_ns() + (uint64_t)COPY_WAIT_MS * 1000000u;
    pl->wnext = c->waiting;
    c->waiting = pl;
    c->nwaiting++;
    copies_changed(c);
    if (!c->retry_armed) {
        uv_timer_start(&c->retry, retry_cb, COPY_RETRY_MS, COPY_RETRY_MS);
        c->retry_armed = true;
    }
    return true;
}

static void unwait(shadow_ctx_t *c, plan_t **pp)
{
    plan_t *pl = *pp;
    *pp = pl->wnext;
    c->nwaiting--;
    copies_changed(c);
    tap_unref(pl->tap);
    plan_free(pl);
}

/* Every COPY_RETRY_MS while copies wait: those that find a free slot (and no client waiting
 * for it) start; those past COPY_WAIT_MS are counted as skipped. */
static void retry_cb(uv_timer_t *timer)
{
    px_t *px = timer->data;
    shadow_ctx_t *c = ctx(px);
    uint64_t now = dp_now_ns();
    for (plan_t **pp = &c->waiting; *pp;) {
        plan_t *pl = *pp;
        px_pool_t *pool = atomic_load(&c->stopped) ? NULL : live_pool(px, pl->pool);
        if (pool && carry_out(px, pool, pl, now >= pl->deadline_ns) && now < pl->deadline_ns) {
            pp = &pl->wnext;
            continue;
        }
        unwait(c, pp);
    }
    if (c->waiting == NULL) {
        uv_timer_stop(&c->retry);
        c->retry_armed = false;
    }
}

static void carry_out_later(px_t *px, tap_t *t)
{
    plan_t *pl = t->later;
    t->later = NULL;
    px_pool_t *pool = atomic_load(&ctx(px)->stopped) ? NULL : live_pool(px, pl->pool);
    if (pool && t->ok) {
        if (carry_out(px, pool, pl, false) && wait_for_slot(px, pl))
            return;
        carry_out(px, pool, pl, true); /* the list is full: counted as skipped */
    } else if (pool) {
        static const char why[] = "the baseline's answer was not a complete 200";
        if (pl->drift)
            count(pool->name, pl->kind, "error");
        for (size_t i = 0; i < pl->ncands; i++)
            if (pl->cands[i])
                candidate_miss(px, pool->name, pl->cands[i], ROLLOUT_ERROR, why);
    }
    plan_free(pl);
}

/* On the worker: the draws (a drift shadow, docs/drift.md; candidates, docs/rollouts.md), then one
 * message. */
void *px_shadow_maybe(px_t *px, px_pool_t *pool, px_replica_t *primary, const cfg_tenant_t *t,
                      const policy_result_t *res, const net_req_t *req, const char *body,
                      size_t len)
{
    shadow_ctx_t *c = px->shadow;
    if (c == NULL || atomic_load(&c->stopped))
        return NULL;
    const cfg_shadow_t *sc = &pool->gen->cfg->shadow;
    double cross = t && t->shadow_rate >= 0 ? t->shadow_rate : sc->rate;
    double self = sc->self_rate;
    bool drift = false;
    drift_kind_t kind = DRIFT_CROSS;
    if (cross > 0 || self > 0) {
        /* One draw picks at most one kind: cross with probability `cross`, self with `self`
         * (scaled down together if they sum past 1). */
        double u = uniform() * (cross + self > 1 ? cross + self : 1);
        if (u < cross)
            drift = true;
        else if (u < cross + self)
            drift = true, kind = DRIFT_SELF;
    }
    if (drift && !res->comparable) {
        count(pool->name, kind, "not_comparable");
        drift = false;
    }
    /* single_sequence (docs/configuration.md "Deterministic pools"): a copy would be a second
     * sequence in flight on a replica of the pool (the primary's own, or one a client request may
     * be sent to next). */
    if (drift && cfg_pool_determinism(pool->cfg) == CFG_DETERMINISM_SINGLE_SEQUENCE) {
        count(pool->name, kind, "skipped");
        drift = false;
    }
    char **cands = NULL;
    size_t ncands = 0;
    for (size_t i = 0; i < pool->cfg->ncandidates; i++) {
        const cfg_candidate_t *cand = &pool->cfg->candidates[i];
        if (cand->rate <= 0 || uniform() >= cand->rate)
            continue;
        cands = dp_xrealloc(cands, (ncands + 1) * sizeof(*cands));
        cands[ncands++] = dp_xstrdup(cand->pool);
    }
    if (!drift && ncands == 0)
        return NULL;
    plan_t *pl = dp_xcalloc(1, sizeof(*pl));
    pl->px = px;
    pl->pool = dp_xstrdup(pool->name);
    pl->primary = dp_xstrdup(primary->name);
    pl->tenant = t && t->name ? dp_xstrdup(t->name) : NULL;
    pl->comparable = res->comparable;
    pl->several_sequences = res->several_sequences;
    pl->drift = drift;
    pl->kind = kind;
    pl->cands = cands;
    pl->ncands = ncands;
    memcpy(pl->request_id, req->id, sizeof(pl->request_id));
    if (res->comparable) {
        dp_buf_append(&pl->model, res->model.base ? res->model.base : "", res->model.len);
        dp_buf_append(&pl->path, req->path.base, req->path.len);
        dp_buf_append(&pl->body, body, len);
        tap_t *tp = dp_xcalloc(1, sizeof(*tp));
        tp->px = px;
        tp->refs = 1; /* the request's, until px_shadow_primary_done */
        tp->stream = res->stream;
        tp->max_out = sc->max_output_bytes;
        tp->sse.max_output_bytes = sc->max_output_bytes;
        pl->tap = tp;
    }
    tap_t *tap = pl->tap;
    if (!px_thread_try_post_control(px, &pl->node, plan_posted)) {
        /* The control thread is behind (counted as a dropped hand-off): no copy this time. */
        if (drift)
            count(pool->name, kind, "skipped");
        for (size_t i = 0; i < ncands; i++)
            count_candidate(pool->name, cands[i], "skipped");
        if (tap)
            tap_unref(tap);
        plan_free(pl);
        return NULL;
    }
    return tap;
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

void px_shadow_rollouts_json(px_t *px, const char *only, size_t only_len, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_uint(&w, "window", DRIFT_WINDOW);
    dp_jw_arr_begin(&w, "rollouts");
    for (size_t i = 0; i < px->gen->npools; i++) {
        const px_pool_t *p = &px->gen->pools[i];
        if (only && !(strlen(p->name) == only_len && memcmp(p->name, only, only_len) == 0))
            continue;
        drift_summary_t cross, self;
        const drift_pool_t *dp = dpool(px, p->name);
        drift_pool_summary(dp, DRIFT_CROSS, &cross);
        drift_pool_summary(dp, DRIFT_SELF, &self);
        for (size_t k = 0; k < p->cfg->ncandidates; k++) {
            const cfg_candidate_t *c = &p->cfg->candidates[k];
            drift_rollout_render(&w, NULL, rollout(px, p->name, c->pool)->stats, c->rate, &cross,
                                 &self);
        }
    }
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
}

void px_shadow_rollout_verdict(px_t *px, const char *pool, const char *cand,
                               drift_rollout_verdict_t *v)
{
    drift_summary_t cross, self;
    const drift_pool_t *dp = dpool(px, pool);
    drift_pool_summary(dp, DRIFT_CROSS, &cross);
    drift_pool_summary(dp, DRIFT_SELF, &self);
    drift_rollout_verdict(rollout(px, pool, cand)->stats, NULL, &cross, &self, v);
}

const drift_rollout_t *px_shadow_rollout_stats(px_t *px, const char *pool, const char *cand)
{
    return rollout(px, pool, cand)->stats;
}

const drift_pool_t *px_shadow_drift_pool(px_t *px, const char *pool)
{
    drift_pool_t *dp = dpool(px, pool);
    refresh_hints(px, pool, dp); /* the page and the gauges judge what attestation knows now */
    return dp;
}

int px_shadow_drift_reset(px_t *px, const char *only, size_t only_len, dp_buf_t *out)
{
    PX_ASSERT_CONTROL();
    const px_gen_t *g = px->gen;
    bool found = false;
    for (size_t i = 0; only && i < g->npools; i++)
        found |=
            strlen(g->pools[i].name) == only_len && memcmp(g->pools[i].name, only, only_len) == 0;
    if (only && !found)
        return -ENOENT;
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_arr_begin(&w, "reset");
    for (size_t i = 0; i < g->npools; i++) {
        const char *name = g->pools[i].name;
        if (only && !(strlen(name) == only_len && memcmp(name, only, only_len) == 0))
            continue;
        dpool_t *e = dpool_entry(px, name);
        drift_pool_clear(e->dp);
        dp_jw_t *l = dp_log_begin(DP_LOG_INFO, "drift_reset");
        if (l) {
            dp_jw_str(l, "pool", name);
            dp_log_end(l);
        }
        log_verdict_change(e);
        dp_jw_str(&w, NULL, name);
    }
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
    return 0;
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
    while (c->waiting) {
        plan_t *pl = c->waiting;
        if (pl->drift)
            count(pl->pool, pl->kind, "skipped");
        for (size_t i = 0; i < pl->ncands; i++)
            if (pl->cands[i])
                count_candidate(pl->pool, pl->cands[i], "skipped");
        unwait(c, &c->waiting);
    }
    if (c->retry_init && !uv_is_closing((uv_handle_t *)&c->retry))
        uv_close((uv_handle_t *)&c->retry, NULL);
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
    net_drains_stop(&c->drains);
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
    for (size_t i = 0; i < c->nrollouts; i++) {
        drift_rollout_free(c->rollouts[i]->stats);
        free(c->rollouts[i]);
    }
    free(c->rollouts);
    free(c);
    px->shadow = NULL;
}
