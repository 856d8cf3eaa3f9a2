/* Hooks on the proxy path: tenant policy (docs/policy.md), response fingerprints (docs/requests.md
 * §3) and the audit trail. Shadow sampling joins through shadow.h. */
#include "proxy/data/hooks.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/turns.h"
#include "common/util.h"
#include "policy/policy.h"
#include "proxy/core/event.h"
#include "proxy/core/gen.h"
#include "proxy/core/px.h"
#include "proxy/data/shadow.h"
#include "proxy/obs/access.h"
#include "proxy/obs/audit.h"
#include "proxy/obs/otel.h"

/* What only an audited tenant's request holds: its line's hashes and stored bodies, and a
 * stream's closing event held for the line. Allocated with the request (pol_aud), so that the
 * others, thousands of long streams among them, carry none of it. */
typedef struct {
    /* The forwarded body's SHA-256; its bytes, copied before the client's request (which the
     * policy's parts point into) is let go ahead of the line: an answer begun and then cut
     * (px_hooks_keep_forwarded). */
    char fwd_sha[65];
    dp_buf_t fwd_keep;
    /* The replica's attestation evidence when the request left (its SHA-256, and with a store
     * its bytes, unless this worker stored them already). */
    char att_sha[65];
    dp_buf_t att_ev;
    dp_buf_t resp_body; /* with log.audit_store: the response's bytes, up to resp_cap */
    /* Refused from its head: the path tried (route points here), cut at POLICY_AUDIT_ROUTE_MAX
     * bytes, with the whole one's length and hash, and the method (no body was read). */
    char *route_copy;
    uint64_t route_bytes;
    char route_sha[65];
    const char *method;
    /* A stream under log.audit_fail: closed (gate): its closing event, held for the line. */
    policy_sse_end_t end;
    dp_buf_t gate_out, end_held;
} pol_aud_t;

/* Per inference request: kept apart from px_hooks_req_t so pass-through requests stay small.
 * Objects are recycled through a free list; policy_req_t keeps its buffers across requests,
 * which makes steady-state parsing allocation-free. */
typedef struct pol_s {
    struct pol_s *next_free; /* the free list */
    policy_req_t *preq;
    policy_result_t res;
    bool applied;
    bool audit;
    pol_aud_t *aud; /* with audit */
    bool audited;
    bool audit_fail_open; /* log.audit_fail of the request's generation */
    bool audit_failed;    /* its line (or bodies) could not be written */
    bool sse_rewrite;
    policy_sse_fp_t sse;
    /* A stream of an audited tenant under log.audit_fail: closed: its closing event waits
     * for the audit line (px_hooks_stream_end). */
    bool gate, end_over; /* end_over: more followed the closing event than resp_cap */
    /* A refusal's (police): message/param outlive px_hooks_inference until the error is sent.
     * Allocated then: the requests that go on, streams among them, do not carry its bytes. */
    policy_error_t *err;
    dp_buf_t out;
    dp_buf_t in; /* offloaded requests: the client's body, moved here for the worker */
    /* Policy work on a large body runs on the libuv thread pool (see police()). */
    uv_work_t work;
    uv_loop_t *loop;
    px_hooks_req_t *h;
    px_gen_t *gen;
    const px_pool_t *pool;
    int rc;
    policy_route_t proute;
    px_hooks_policed_cb done;
    void *done_data;
    /* Work on the thread pool (job_submit): its step there and its end back on the loop. */
    void (*job)(struct pol_s *p);
    void (*job_done)(struct pol_s *p);
    dp_turn_t turn; /* while it waits for the pool (job_submit) */
    dp_buf_t *held; /* a held response rewritten there (px_hooks_held_response) */
    void (*held_cb)(void *data);
    void *held_data;
    dp_sha256_ctx_t *resp_sha; /* audit tenants: hash of the response body as forwarded */
    size_t resp_cap;
    bool store, resp_over;
    bool fwd_kept;        /* aud->fwd_keep holds the forwarded body */
    policy_usage_t usage; /* token counts from the response (detproxy_tokens_total) */
    const char *route;
    uint64_t wall_ms;
    void (*then)(void *);
    void *then_data;
} pol_t;

/* Per-tenant token buckets, keyed by tenant name so a reload that keeps a tenant keeps its
 * bucket (a reload must not be a way around the limit). Only tenants with a rate_limit get one;
 * a linear scan over them is fine at the tens of tenants a policy has.
 *
 * Every worker takes from the same bucket, lock-free: the bucket is GCRA's one number, the
 * theoretical arrival time (seconds on the monotonic clock), advanced by compare-and-swap.
 * A request is allowed when, after it, the bucket would be at most `burst` requests ahead of
 * now: exactly a token bucket of that burst refilled at rate_rps. The list only grows at its
 * head (a new tenant, under a mutex: cold) and lives until shutdown. */
typedef struct bucket_s {
    struct bucket_s *next;
    _Atomic double tat;
    char name[];
} bucket_t;

static _Atomic(bucket_t *) g_buckets;
/* A fleet's live members (docs/fleet.md): each instance refills at rate_rps / this. */
static _Atomic uint32_t g_rate_share = 1;

void px_hooks_set_rate_share(uint32_t members)
{
    atomic_store_explicit(&g_rate_share, members ? members : 1, memory_order_relaxed);
}
static pthread_mutex_t g_buckets_mu = PTHREAD_MUTEX_INITIALIZER;

static _Thread_local pol_t *g_free; /* per worker */
static _Thread_local size_t g_nfree;

/* Working space for affinity key bytes: one event loop per thread, and nothing in them outlives
 * a call. A huge escaped prompt may grow them; they are let go past 256 KiB. */
static _Thread_local dp_buf_t g_key, g_scratch;

/* A stream's rewritten bytes, for this thread's streams in turn: each caller writes or copies
 * them before it returns to the loop, so thousands of open streams hold no output buffer of
 * their own. */
static _Thread_local dp_buf_t g_sse_out;

static dp_iovec_t sse_out_view(void)
{
    return (dp_iovec_t){g_sse_out.base ? g_sse_out.base : "", g_sse_out.len};
}

static void sse_out_trim(void)
{
    if (g_sse_out.cap > 256 * 1024)
        dp_buf_free(&g_sse_out);
}

static pol_t *pol_get(void)
{
    pol_t *p = g_free;
    if (p) {
        g_free = p->next_free;
        g_nfree--;
        policy_req_t *keep = p->preq;
        dp_buf_t out = p->out, in = p->in;
        memset(p, 0, sizeof(*p));
        p->preq = keep;
        dp_buf_reset(&out);
        dp_buf_reset(&in);
        p->out = out;
        p->in = in;
        return p;
    }
    p = dp_xcalloc(1, sizeof(*p));
    p->preq = policy_req_new();
    return p;
}

/* The request is an audited tenant's. */
static void pol_aud(pol_t *p)
{
    p->audit = true;
    if (p->aud == NULL)
        p->aud = dp_xcalloc(1, sizeof(*p->aud));
}

static void pol_aud_free(pol_t *p)
{
    pol_aud_t *a = p->aud;
    if (a == NULL)
        return;
    free(a->route_copy);
    dp_buf_free(&a->resp_body);
    dp_buf_free(&a->att_ev);
    dp_buf_free(&a->fwd_keep);
    dp_buf_free(&a->gate_out);
    dp_buf_free(&a->end_held);
    policy_sse_end_free(&a->end);
    free(a);
    p->aud = NULL;
}

static void pol_free(pol_t *p)
{
    policy_req_free(p->preq);
    dp_buf_free(&p->out);
    dp_buf_free(&p->in);
    free(p);
}

static void pol_put(pol_t *p)
{
    free(p->err);
    p->err = NULL;
    policy_usage_free(&p->usage);
    pol_aud_free(p);
    /* A large body is not kept with a cached pol_t (256 of them would hold 64 MiB outside the
     * body budget): it goes to the thread's bounded stash, for the next large body. */
    if (p->in.cap >= DP_BUF_STASH_MIN)
        dp_buf_release(&p->in);
    if (g_nfree >= 256 || p->out.cap > 256 * 1024) {
        pol_free(p);
        return;
    }
    policy_req_reset(p->preq);
    p->next_free = g_free;
    g_free = p;
    g_nfree++;
}

void px_hooks_free_caches(void)
{
    bucket_t *b = atomic_exchange(&g_buckets, NULL);
    while (b) {
        bucket_t *next = b->next;
        free(b);
        b = next;
    }
    px_hooks_thread_free();
}

void px_hooks_thread_free(void)
{
    while (g_free) {
        pol_t *p = g_free;
        g_free = p->next_free;
        pol_free(p);
    }
    g_nfree = 0;
    dp_buf_free(&g_key);
    dp_buf_free(&g_scratch);
    dp_buf_free(&g_sse_out);
}

void px_hooks_init(px_hooks_req_t *h)
{
    memset(h, 0, sizeof(*h));
    h->tenant = "-";
}

const char *px_hooks_tenant(const px_hooks_req_t *h)
{
    return h->tenant;
}

/* ---- tenants -------------------------------------------------------------------------------- */

static size_t header_lookup(void *ud, const char *lname, dp_iovec_t *value)
{
    const net_req_t *req = ud;
    size_t n = 0;
    for (size_t i = 0; i < req->nheaders; i++) {
        if (dp_strieq(req->headers[i].name.base, req->headers[i].name.len, lname)) {
            if (n++ == 0)
                *value = req->headers[i].value;
        }
    }
    return n;
}

static bucket_t *bucket_find(const char *name)
{
    for (bucket_t *b = atomic_load_explicit(&g_buckets, memory_order_acquire); b; b = b->next)
        if (strcmp(b->name, name) == 0)
            return b;
    return NULL;
}

static bucket_t *bucket_for(const cfg_tenant_t *t)
{
    bucket_t *b = bucket_find(t->name);
    if (b)
        return b;
    pthread_mutex_lock(&g_buckets_mu);
    if ((b = bucket_find(t->name)) == NULL) {
        size_t n = strlen(t->name) + 1;
        b = dp_xcalloc(1, sizeof(*b) + n);
        memcpy(b->name, t->name, n);
        atomic_init(&b->tat, 0); /* in the past: the whole burst is available */
        b->next = atomic_load_explicit(&g_buckets, memory_order_relaxed);
        atomic_store_explicit(&g_buckets, b, memory_order_release);
    }
    pthread_mutex_unlock(&g_buckets_mu);
    return b;
}

/* Take one request from t's bucket: 0, or the whole seconds until one is available. */
static uint32_t rate_take(const cfg_tenant_t *t)
{
    bucket_t *b = bucket_for(t);
    double now = (double)dp_now_ns() / 1e9;
    double share = atomic_load_explicit(&g_rate_share, memory_order_relaxed);
    double interval = share / t->rate_rps, ahead = (double)t->rate_burst * interval;
    double tat = atomic_load_explicit(&b->tat, memory_order_relaxed);
    for (;;) {
        double base = tat > now ? tat : now;
        double next = base + interval;
        /* How far ahead the bucket would be, summed without (now + x) - now, whose rounding
         * made a burst of 1 refuse even the first request. */
        if ((base - now) + interval > ahead) {
            /* A tiny rate (1e-20/s) waits longer than Retry-After's 32 bits: cap it, never
             * cast it. */
            double wait = ceil(next - ahead - now);
            return wait < 1 ? 1 : wait >= UINT32_MAX ? UINT32_MAX : (uint32_t)wait;
        }
        if (atomic_compare_exchange_weak_explicit(&b->tat, &tat, next, memory_order_relaxed,
                                                  memory_order_relaxed))
            return 0;
    }
}

int px_hooks_tenant_gate(px_hooks_req_t *h, px_t *px, px_gen_t *g, net_req_t *req,
                         char why[PX_HOOKS_WHY_MAX])
{
    (void)px;
    policy_error_t err;
    const cfg_tenant_t *t = policy_match_tenant(g->cfg->policy, header_lookup, req, &err);
    if (t == NULL) {
        snprintf(why, PX_HOOKS_WHY_MAX, "%s", err.message);
        return -1;
    }
    h->tenant_cfg = t;
    h->tenant = t->name;
    if (t->rate_rps > 0 && (h->retry_after_s = rate_take(t)) != 0) {
        snprintf(why, PX_HOOKS_WHY_MAX,
                 "tenant %s is over its rate limit (%g requests per second, burst %u): retry "
                 "after %u s",
                 t->name, t->rate_rps, t->rate_burst, h->retry_after_s);
        return -2;
    }
    return 0;
}

void px_hooks_audit_head(px_hooks_req_t *h, px_gen_t *g, const char *method, const char *path,
                         size_t path_len)
{
    if (h->policy || h->tenant_cfg == NULL || !h->tenant_cfg->audit)
        return;
    pol_t *p = pol_get();
    h->policy = p;
    pol_aud(p);
    pol_aud_t *a = p->aud;
    if (path_len > POLICY_AUDIT_ROUTE_MAX) {
        a->route_bytes = path_len;
        dp_sha256_hex(path, path_len, a->route_sha);
        path_len = POLICY_AUDIT_ROUTE_MAX;
    }
    a->route_copy = dp_xstrndup(path, path_len);
    p->route = a->route_copy;
    a->method = method;
    p->wall_ms = dp_wall_ms();
    p->audit_fail_open = g->cfg->log.audit_fail_open;
}

void px_hooks_refused(px_hooks_req_t *h, const char *code, const char *param)
{
    h->err_code = code;
    dp_copy_str(h->err_param, sizeof(h->err_param), param ? param : "", param ? strlen(param) : 0);
}

void px_hooks_keep_forwarded(px_hooks_req_t *h)
{
    pol_t *p = h->policy;
    if (p == NULL || !p->audit || p->audited || !p->store || !p->applied || p->fwd_kept ||
        p->in.len)
        return; /* no line to come with this body stored, or its bytes are the policy's own */
    dp_iovec_t fb = policy_body(p->preq, &p->res);
    dp_buf_reset(&p->aud->fwd_keep);
    dp_buf_append(&p->aud->fwd_keep, fb.base, fb.len);
    p->fwd_kept = true;
}

bool px_hooks_forget_body(px_hooks_req_t *h)
{
    pol_t *p = h->policy;
    if (p == NULL)
        return true;
    if (p->audit)
        return false;
    if (p->applied)
        policy_req_forget_body(p->preq, &p->res);
    dp_buf_release(&p->in); /* a body policed on the thread pool was moved here */
    return true;
}

bool px_hooks_usage(const px_hooks_req_t *h, int64_t *prompt, int64_t *completion)
{
    const pol_t *p = h->policy;
    if (p == NULL || !p->usage.found)
        return false;
    *prompt = p->usage.prompt_tokens;
    *completion = p->usage.completion_tokens;
    return true;
}

void px_hooks_describe(const px_hooks_req_t *h, px_access_t *a)
{
    const pol_t *p = h->policy;
    a->tenant = h->tenant_cfg ? h->tenant : NULL;
    a->seed = h->seed[0] ? h->seed : NULL;
    a->has_usage = px_hooks_usage(h, &a->prompt_tokens, &a->completion_tokens);
    a->policy = p && p->applied ? &p->res : NULL;
    dp_iovec_t m = p ? policy_model(p->preq) : (dp_iovec_t){0};
    a->model = m.base && m.len ? m.base : NULL;
    a->model_len = m.len;
}

/* ---- inference ------------------------------------------------------------------------------ */

static void count_overrides(px_gen_t *g, const cfg_tenant_t *t, const char *tenant,
                            const policy_result_t *res)
{
    /* Param names are static strings in the policy module: pointer-stable cache keys. */
    for (size_t i = 0; i < res->nchanges; i++) {
        const policy_change_t *c = &res->changes[i];
        px_metrics_add(px_gen_override_series(g, t, tenant, c->param, (int)c->action,
                                              policy_action_names[c->action]),
                       1);
    }
}

/* ---- affinity keys (docs/configuration.md "Affinity routing")
 * ------------------------------------------------------------ */

/* On the loop, while the client's request is alive (policing may move to a worker and the
 * client may leave meanwhile): the session header of the first session-keyed affinity pool
 * that the request carries, kept as its digest. */
static void affinity_session_header(px_hooks_req_t *h, const px_gen_t *g, const net_req_t *req)
{
    for (size_t i = 0; i < g->cfg->npools; i++) {
        const cfg_pool_t *pc = &g->cfg->pools[i];
        dp_iovec_t v = {NULL, 0};
        if (pc->balance != CFG_BALANCE_AFFINITY || pc->affinity.key != CFG_AFFINITY_SESSION)
            continue;
        if (header_lookup((void *)req, pc->affinity.session_header, &v) > 0 && v.len > 0) {
            h->affinity_header = pc->affinity.session_header;
            h->affinity_header_key = px_affinity_hash(v.base, v.len);
            return;
        }
    }
}

static void affinity_key(px_hooks_req_t *h, const pol_t *p, const cfg_affinity_t *a)
{
    dp_iovec_t v = {NULL, 0};
    bool have = false;
    if (a->key == CFG_AFFINITY_SEED && p->res.has_seed) {
        v = (dp_iovec_t){h->seed, strlen(h->seed)};
        have = true;
    } else if (a->key == CFG_AFFINITY_SESSION) {
        if (h->affinity_header && strcmp(h->affinity_header, a->session_header) == 0) {
            h->affinity.key = h->affinity_header_key;
            h->affinity.fallback = false;
            h->affinity.has_key = true;
            return;
        }
        if (policy_affinity_user(p->preq, &g_key)) {
            v = (dp_iovec_t){g_key.base, g_key.len};
            have = true;
        }
    }
    h->affinity.fallback = !have && a->key != CFG_AFFINITY_PREFIX;
    if (!have) {
        policy_affinity_prefix(p->preq, a->prefix_bytes, &g_key, &g_scratch);
        v = (dp_iovec_t){g_key.base ? g_key.base : "", g_key.len};
    }
    h->affinity.key = px_affinity_hash(v.base, v.len);
    h->affinity.has_key = true;
    if (g_key.cap > 256 * 1024)
        dp_buf_free(&g_key);
    if (g_scratch.cap > 256 * 1024)
        dp_buf_free(&g_scratch);
}

/* Parse and police the body, pick the pool, hash what will be forwarded. Touches only the
 * request's own pol_t and immutable configuration (the generation is referenced by the request),
 * so it may run on a thread-pool worker. 0, or -1 with p->err. */
static int police(pol_t *p, px_gen_t *g, const cfg_tenant_t *t, policy_route_t route,
                  const char *body, size_t len)
{
    const cfg_pool_t *pc;
    policy_error_t err;
    if (policy_decide(g->cfg, t, p->preq, route, body, len, &pc, &p->res, &err) != 0) {
        if (p->err == NULL)
            p->err = dp_xmalloc(sizeof(*p->err));
        *p->err = err;
        return -1;
    }
    /* Pools are built in the config's order. */
    p->pool = &g->pools[pc - g->cfg->pools];
    p->applied = true;
    if (p->audit)
        policy_body_sha256_hex(&p->res, p->aud->fwd_sha);
    return 0;
}

/* An audited tenant under log.audit_fail: closed: no answer's end leaves before its line. */
static bool end_waits(const pol_t *p)
{
    return p->audit && !p->audit_fail_open;
}

/* Back on the loop: metrics, headers, response rewriting state; the refusal otherwise. */
static int policed(px_hooks_req_t *h, px_gen_t *g, pol_t *p, dp_iovec_t *body,
                   px_hooks_result_t *res)
{
    if (p->rc != 0) {
        *res = (px_hooks_result_t){p->err->status, p->err->code,
                                   p->err->param[0] ? p->err->param : NULL, p->err->message, NULL};
        px_otel_refused(h->span, p->err->code);
        return -1;
    }
    px_pool_t *pool = (px_pool_t *)p->pool;
    count_overrides(g, h->tenant_cfg, h->tenant, &p->res);
    px_otel_request(h->span, h->tenant, pool, &p->res);
    h->stream = p->res.stream;
    if (p->res.has_seed)
        dp_u64_dec(p->res.seed, h->seed);
    /* The bytes are the policed body's parts (px_hooks_body_parts): only the length here. */
    *body = (dp_iovec_t){NULL, p->res.body_len};
    if (pool->cfg->balance == CFG_BALANCE_AFFINITY)
        affinity_key(h, p, &pool->cfg->affinity);
    if (p->audit)
        p->resp_sha = dp_sha256_begin();
    dp_copy_str(h->fingerprint, sizeof(h->fingerprint), pool->fingerprint,
                strlen(pool->fingerprint));
    if (h->stream) {
        p->sse_rewrite = true;
        p->gate = end_waits(p);
        policy_sse_fp_init(&p->sse, h->fingerprint); /* set per replica at dispatch */
        /* Nothing reads the parse again, and the rewritten events go through g_sse_out: a
         * stream lives long. */
        policy_req_trim(p->preq);
        dp_buf_free(&p->out);
    }
    res->pool = pool;
    return 0;
}

/* Work on the thread pool (a large or dense body's policing, a large held response's rewrite)
 * takes at most half the libuv thread pool; the rest of the jobs wait here. Audit writes, DNS
 * and shadow comparisons share that pool: queued behind a few dozen large bodies, every
 * audited request (any tenant, any pool) waited seconds. The thread pool is the process's,
 * shared by every worker: each takes its share of the half.
 *
 * Waiting jobs take turns (common/turns.h). A body's owner is the tenant it is policed for
 * (tenantless requests are one), with one sub; an answer's owner is the replica it came from,
 * and its sub the tenant it is for. So a tenant or a replica that sends many large, slow bodies
 * waits behind its own jobs, not in front of everyone else's; and a tenant that draws many slow
 * answers from a replica others use waits behind its own checks, not in front of theirs. */
static _Thread_local dp_turns_t g_turns;
static _Thread_local unsigned g_jobs, g_jobs_max;

static unsigned jobs_max(px_t *px)
{
    if (g_jobs_max == 0) {
        /* The pool's size as libuv reads it: atoi, 4 when unset, 0 (an empty or garbled
         * value) is 1, at most 1024. */
        const char *e = getenv("UV_THREADPOOL_SIZE");
        unsigned n = e ? (unsigned)atoi(e) : 4;
        n = n == 0 ? 1 : n > 1024 ? 1024 : n;
        n = n >= 2 ? n / 2 : 1;
        n /= px->nworkers ? px->nworkers : 1;
        g_jobs_max = n >= 1 ? n : 1;
    }
    return g_jobs_max;
}

static void job_work(uv_work_t *w)
{
    pol_t *p = w->data;
    p->job(p);
}

static void job_after(uv_work_t *w, int status);

static int job_start(pol_t *p)
{
    int rc = uv_queue_work(p->loop, &p->work, job_work, job_after);
    if (rc == 0)
        g_jobs++;
    return rc;
}

static void count_waiting(double n)
{
    px_metrics_add(px_metrics_get("detproxy_offload_waiting", NULL), n);
}

/* The job whose turn it is, taken out of those waiting (NULL: none waits). */
static pol_t *job_next(void)
{
    dp_turn_t *t = dp_turns_next(&g_turns);
    if (t == NULL)
        return NULL;
    count_waiting(-1);
    return dp_container_of(t, pol_t, turn);
}

static void job_after(uv_work_t *w, int status)
{
    pol_t *p = w->data;
    (void)status; /* work is never cancelled: the request waits for it even if its client left */
    g_jobs--;
    pol_t *next;
    while ((next = job_next()) != NULL && job_start(next) != 0) {
        next->job(next); /* the pool refused it: done here, as late as queued */
        next->job_done(next);
    }
    p->job_done(p);
}

/* Queue job(p), its turn that of owner and sub (common/turns.h): 0 when it will run,
 * job_done(p) following on this loop (never from inside this call); else libuv's error, and
 * the caller does the work itself. */
static int job_submit(px_t *px, pol_t *p, const void *owner, const void *sub, void (*job)(pol_t *),
                      void (*job_done)(pol_t *))
{
    p->job = job;
    p->job_done = job_done;
    p->work.data = p;
    p->loop = px_thread_self(px)->loop;
    if (dp_turns_empty(&g_turns) && g_jobs < jobs_max(px))
        return job_start(p);
    count_waiting(1);
    dp_turns_wait(&g_turns, &p->turn, owner, sub);
    return 0;
}

static void police_job(pol_t *p)
{
    p->rc = police(p, p->gen, p->h->tenant_cfg, p->proute, p->in.base ? p->in.base : "", p->in.len);
}

static void police_job_done(pol_t *p)
{
    px_hooks_result_t res = {0};
    dp_iovec_t body = {0};
    int rc = policed(p->h, p->gen, p, &body, &res);
    p->done(p->done_data, rc, body, &res);
}

/* Fail closed (log.audit_fail, docs/operations.md "Evidence"): while the writer's last write
 * failed (a full disk), an audited request is refused before it reaches a replica; its refusal's
 * own line is the probe that finds the disk writable again. */
static bool audit_refuses(px_t *px, const pol_t *p)
{
    return !p->audit_fail_open && !px_audit_writable(px->audit);
}

int px_hooks_inference(px_hooks_req_t *h, px_t *px, px_gen_t *g, net_req_t *req,
                       policy_route_t route, dp_iovec_t *body, px_hooks_result_t *res,
                       px_hooks_policed_cb done, void *done_data)
{
    h->inference = true;
    pol_t *p = pol_get();
    h->policy = p;
    static const char *const route_paths[] = {"/v1/completions", "/v1/chat/completions",
                                              "/v1/responses"};
    p->route = route_paths[route];
    h->span = px_otel_start(px, req, p->route, h->traceparent, &h->new_trace);
    p->wall_ms = dp_wall_ms();
    if (h->tenant_cfg && h->tenant_cfg->audit)
        pol_aud(p);
    affinity_session_header(h, g, req);
    p->store = p->audit && px->audit && g->cfg->log.audit_store; /* px_audit_configure's */
    p->resp_cap = g->cfg->limits.max_response_rewrite_bytes;     /* the store keeps this much */
    p->audit_fail_open = g->cfg->log.audit_fail_open;
    if (p->audit && audit_refuses(px, p)) {
        *res = (px_hooks_result_t){503, "audit_unavailable", NULL,
                                   "the audit trail cannot be written: this tenant's requests "
                                   "are refused until it can (log.audit_fail: closed)",
                                   NULL};
        px_otel_refused(h->span, res->code);
        return -1;
    }
    /* A coded body cannot be read, and so not policed: a replica or a gateway behind us that
     * decodes it would otherwise see what no rule looked at. */
    if (net_content_coded(req->headers, req->nheaders)) {
        *res = (px_hooks_result_t){.status = 415,
                                   .code = "unsupported_content_encoding",
                                   .message = NET_CODED_BODY_MESSAGE};
        px_otel_refused(h->span, res->code);
        return -1;
    }
    if (req->body.len <= PX_POLICY_LOOP_BYTES) {
        /* The parse stops at the budget: a body found too dense is parsed again on the pool. */
        policy_req_set_budget(p->preq, PX_POLICY_LOOP_VALUES);
        p->rc =
            police(p, g, h->tenant_cfg, route, req->body.base ? req->body.base : "", req->body.len);
        policy_req_set_budget(p->preq, 0);
        if (p->rc == 0 || !policy_over_budget(p->err))
            return policed(h, g, p, body, res);
    }
    /* A large or dense body: parsing, canonical JSON and hashing would take milliseconds on
     * the loop, and stall every other connection and the admin listener. The body moves to
     * the pol_t, so the worker never reads memory the client's connection owns. */
    px_metrics_add(px_metrics_get("detproxy_policy_offloaded_total", NULL), 1);
    dp_buf_t mine = p->in;
    p->in = req->body;
    req->body = mine;
    p->h = h;
    p->gen = g;
    p->proute = route;
    p->done = done;
    p->done_data = done_data;
    if (job_submit(px, p, h->tenant_cfg, NULL, police_job, police_job_done) != 0) {
        police_job(p);
        return policed(h, g, p, body, res);
    }
    return 1;
}

/* Our fingerprint for this answer: the admitted identity's, else the pool's. */
static const char *fp_of(const px_hooks_req_t *h, const px_pool_t *pool)
{
    return h->fingerprint[0] ? h->fingerprint : pool->fingerprint;
}

void px_hooks_response_headers(px_hooks_req_t *h, const px_pool_t *pool, net_header_t *out,
                               size_t *n)
{
    if (!h->inference)
        return;
    if (h->tenant_cfg)
        out[(*n)++] = (net_header_t){DP_IOV("x-detproxy-tenant"), {h->tenant, strlen(h->tenant)}};
    if (pool) {
        const char *fp = fp_of(h, pool);
        out[(*n)++] = (net_header_t){DP_IOV("x-detproxy-fingerprint"), {fp, strlen(fp)}};
    }
    if (h->seed[0])
        out[(*n)++] = (net_header_t){DP_IOV("x-detproxy-seed"), {h->seed, strlen(h->seed)}};
    if (h->affinity.result != PX_AFF_NONE) {
        const char *v = px_affinity_result_names[h->affinity.result];
        out[(*n)++] = (net_header_t){DP_IOV("x-detproxy-affinity"), {v, strlen(v)}};
    }
}

/* ---- responses ------------------------------------------------------------------------------ */

bool px_hooks_hold_response(const px_hooks_req_t *h, int status)
{
    /* A non-streamed successful answer got here only as application/json (up_on_head refuses
     * any other): it is held and its fingerprint rewritten. */
    return h->inference && !h->stream && status >= 200 && status < 300;
}

/* Set the answer's system_fingerprint to ours (the replica's own kept in h->upstream_fp). */
static void rewrite_held(px_hooks_req_t *h, pol_t *p, dp_buf_t *body)
{
    dp_buf_reset(&p->out);
    if (policy_fp_rewrite_json(body->base ? body->base : "", body->len, fp_of(h, p->pool), &p->out,
                               h->upstream_fp, &p->usage) != 1)
        return; /* not a JSON object: forward it as it is */
    dp_buf_t t = *body;
    *body = p->out;
    p->out = t;
}

static void tee_own(pol_t *p, const char *b, size_t n);
static void tee_shared(px_hooks_req_t *h, const char *b, size_t n);

static void held_job(pol_t *p)
{
    rewrite_held(p->h, p, p->held);
    tee_own(p, p->held->base, p->held->len);
}

static void held_job_done(pol_t *p)
{
    tee_shared(p->h, p->held->base, p->held->len);
    p->held = NULL;
    p->held_cb(p->held_data);
}

int px_hooks_held_response(px_hooks_req_t *h, px_t *px, const px_pool_t *pool,
                           const px_replica_t *replica, dp_buf_t *body, void (*done)(void *data),
                           void *data)
{
    pol_t *p = h->policy;
    if (p == NULL) {
        tee_shared(h, body->base, body->len);
        return 0;
    }
    p->pool = pool;
    if (body->len > PX_REWRITE_LOOP_BYTES) {
        p->h = h;
        p->held = body;
        p->held_cb = done;
        p->held_data = data;
        if (job_submit(px, p, replica, h->tenant_cfg, held_job, held_job_done) == 0) {
            px_metrics_add(px_metrics_get("detproxy_response_offloaded_total", NULL), 1);
            return 1;
        }
        p->held = NULL;
    }
    rewrite_held(h, p, body);
    tee_own(p, body->base, body->len);
    tee_shared(h, body->base, body->len);
    return 0;
}

void px_hooks_held_headers(const px_hooks_req_t *h, net_header_t *extra, size_t *nextra)
{
    if (h->upstream_fp[0])
        extra[(*nextra)++] = (net_header_t){DP_IOV("x-detproxy-upstream-fingerprint"),
                                            {h->upstream_fp, strlen(h->upstream_fp)}};
}

void px_hooks_event_stream(px_hooks_req_t *h)
{
    pol_t *p = h->policy;
    if (p)
        p->usage.sse = true;
}

/* The response's bytes, as the client gets them, feed the request's own counts and evidence
 * (usage, the audit hash and store): only its pol_t, so a held response's may be fed on the
 * thread pool (px_hooks_held_response). */
static void tee_own(pol_t *p, const char *b, size_t n)
{
    policy_usage_feed(&p->usage, b, n);
    if (p->resp_sha)
        dp_sha256_update(p->resp_sha, b, n);
    if (p->store && !p->resp_over) {
        if (p->aud->resp_body.len + n > p->resp_cap) {
            p->resp_over = true; /* hashed, not stored: the line says so */
            dp_buf_free(&p->aud->resp_body);
        } else {
            dp_buf_append(&p->aud->resp_body, b, n);
        }
    }
}

/* ... and what the loop's other state keeps of them (a shadow's capture, the trace's span). */
static void tee_shared(px_hooks_req_t *h, const char *b, size_t n)
{
    if (h->shadow)
        px_shadow_primary_bytes(h->shadow, b, n);
    px_otel_bytes(h->span, b, n);
}

static void tee(px_hooks_req_t *h, pol_t *p, const char *b, size_t n)
{
    if (p)
        tee_own(p, b, n);
    tee_shared(h, b, n);
}

/* What of v goes to the client now, when the stream's end is gated (else v itself). */
static dp_iovec_t gated(pol_t *p, dp_iovec_t v, bool last)
{
    if (p == NULL || !p->gate)
        return v;
    pol_aud_t *a = p->aud;
    dp_buf_reset(&a->gate_out);
    if (a->end.holding && a->end_held.len + v.len > p->resp_cap) {
        /* A stream goes on long after its closing event: not held without bound. */
        p->end_over = true;
        dp_buf_free(&a->end_held);
        return (dp_iovec_t){"", 0};
    }
    policy_sse_end_feed(&a->end, v.base, v.len, &a->gate_out, &a->end_held);
    if (last)
        policy_sse_end_finish(&a->end, &a->gate_out, &a->end_held);
    return (dp_iovec_t){a->gate_out.base ? a->gate_out.base : "", a->gate_out.len};
}

bool px_hooks_stream_end(px_hooks_req_t *h, dp_iovec_t *end)
{
    const pol_t *p = h->policy;
    *end = (dp_iovec_t){"", 0};
    if (p == NULL || !p->gate)
        return true;
    if (p->end_over)
        return false;
    const dp_buf_t *held = &p->aud->end_held;
    *end = (dp_iovec_t){held->base ? held->base : "", held->len};
    return true;
}

dp_iovec_t px_hooks_response_bytes(px_hooks_req_t *h, const char *b, size_t n)
{
    pol_t *p = h->policy;
    dp_iovec_t v = {b, n};
    if (p && p->sse_rewrite) {
        sse_out_trim();
        dp_buf_reset(&g_sse_out);
        policy_sse_fp_feed(&p->sse, b, n, &g_sse_out);
        v = sse_out_view();
    }
    v = gated(p, v, false);
    tee(h, p, v.base, v.len); /* what the client gets, in its order (a held end: at the tail) */
    return v;
}

bool px_hooks_rewrites_bytes(const px_hooks_req_t *h)
{
    const pol_t *p = h->policy;
    return p && p->sse_rewrite;
}

/* The stream's end, clean (`last`: the gate may let its closing event go) or cut: what the
 * fingerprint rewriter holds of an event the replica left half-written goes out as it came
 * (docs/policy.md, "SSE"). */
static dp_iovec_t sse_rest(px_hooks_req_t *h, pol_t *p, bool last)
{
    dp_buf_reset(&g_sse_out);
    policy_sse_fp_finish(&p->sse, &g_sse_out);
    if (p->sse.prev[0] && !h->upstream_fp[0])
        snprintf(h->upstream_fp, sizeof(h->upstream_fp), "%s", p->sse.prev);
    dp_iovec_t v = gated(p, sse_out_view(), last);
    tee(h, p, v.base, v.len);
    return v;
}

dp_iovec_t px_hooks_response_tail(px_hooks_req_t *h)
{
    pol_t *p = h->policy;
    if (p == NULL || !p->sse_rewrite)
        return (dp_iovec_t){"", 0};
    dp_iovec_t v = sse_rest(h, p, true);
    /* The held end goes out after the audit line, which must already cover it. */
    dp_iovec_t end;
    if (px_hooks_stream_end(h, &end) && end.len)
        tee(h, p, end.base, end.len);
    return v;
}

dp_iovec_t px_hooks_response_cut(px_hooks_req_t *h)
{
    pol_t *p = h->policy;
    if (p == NULL || !p->sse_rewrite)
        return (dp_iovec_t){"", 0};
    return sse_rest(h, p, false);
}

/* ---- audit ---------------------------------------------------------------------------------- */

static void audit_done(void *data, int status)
{
    pol_t *p = data;
    /* The writer logs and counts the failed write; this counts what became of the answer. */
    if (status != 0) {
        p->audit_failed = true;
        px_metrics_add(px_metrics_get("detproxy_audit_write_failures_total", "action",
                                      p->audit_fail_open ? "served" : "refused", NULL),
                       1);
    }
    void (*then)(void *) = p->then;
    p->then = NULL;
    if (then)
        then(p->then_data);
}

/* The evidence the replica was admitted on, as this request leaves for it (a retry's replica
 * replaces the first's); with a store, its bytes go there with the line (content-addressed:
 * the writer skips a file that is there already, so each evidence is one file). */
static void audit_evidence(pol_t *p, px_replica_t *r)
{
    dp_buf_reset(&p->aud->att_ev);
    px_replica_get_evidence(r, p->aud->att_sha, p->store ? &p->aud->att_ev : NULL);
}

/* Build and queue the audit line; with `then`, it runs once the line is written. */
static bool write_audit(px_hooks_req_t *h, px_t *px, const px_pool_t *pool, const px_replica_t *r,
                        int status, const char *request_id, void (*then)(void *), void *data)
{
    pol_t *p = h->policy;
    if (p == NULL || !p->audit || p->audited)
        return false;
    p->audited = true;
    pol_aud_t *au = p->aud;
    char resp_sha[65];
    dp_sha256_end_hex(p->resp_sha, resp_sha);
    p->resp_sha = NULL;
    /* No made-up hash: a body no replica sent has none (null), not the hash of nothing. */
    const char *resp_hex = h->upstream_answered ? resp_sha : NULL;
    dp_iovec_t model = policy_model(p->preq);
    policy_audit_t a = {
        .wall_ms = p->wall_ms,
        .request_id = request_id,
        .tenant = h->tenant,
        .pool = pool ? pool->name : NULL,
        .replica = r ? r->name : NULL,
        .fingerprint = pool ? fp_of(h, pool) : NULL,
        .upstream_fingerprint = h->upstream_fp[0] ? h->upstream_fp : NULL,
        .fingerprint_mismatch = h->fp_mismatch,
        .route = p->route,
        .method = au->method,
        .route_bytes = au->route_bytes,
        .route_sha256 = au->route_sha[0] ? au->route_sha : NULL,
        .model = au->method ? NULL : model.base,
        .model_len = model.len,
        .result = p->applied ? &p->res : NULL,
        .forwarded_sha256 = p->applied ? au->fwd_sha : NULL,
        .response_sha256 = resp_hex,
        .attestation_sha256 = r && au->att_sha[0] ? au->att_sha : NULL,
        .status = status,
        /* An answer begun and then cut: the status its head carried, and that it broke. */
        .error_code = h->err_code   ? h->err_code
                      : p->end_over ? "upstream_error"
                                    : NULL,
        .error_param = h->err_code && h->err_param[0] ? h->err_param : NULL,
    };
    dp_buf_t line = {0};
    policy_audit_line(&a, &line);
    px_audit_body_t bodies[3];
    size_t nb = 0;
    if (p->store && a.attestation_sha256 && au->att_ev.len)
        bodies[nb++] = (px_audit_body_t){au->att_sha, NULL, 0, &au->att_ev};
    if (p->store && a.forwarded_sha256 && p->fwd_kept) {
        bodies[nb++] = (px_audit_body_t){au->fwd_sha, NULL, 0, &au->fwd_keep};
    } else if (p->store && a.forwarded_sha256) {
        dp_iovec_t fb = policy_body(p->preq, &p->res);
        bodies[nb++] = (px_audit_body_t){au->fwd_sha, fb.base, fb.len, NULL};
    }
    if (p->store && resp_hex && !p->resp_over)
        bodies[nb++] = (px_audit_body_t){resp_sha, NULL, 0, &au->resp_body};
    if (p->store && resp_hex && p->resp_over && line.len > 2) {
        line.len -= 2; /* "}\n": one more member, read by `audit verify` */
        dp_buf_appends(&line, ",\"response_body_stored\":false}\n");
    }
    p->then = then;
    p->then_data = data;
    px_audit_submit(px, line.base, line.len, bodies, nb, then ? audit_done : NULL, p);
    dp_buf_free(&line);
    return then != NULL;
}

/* A response of r carried engine fingerprint `seen`: true when it differs from the one r
 * attested (counted in detproxy_fingerprint_mismatch_total and told to the control plane,
 * which takes r out of service and re-attests it: docs/attestation.md §5). A response without
 * a fingerprint is not checked. */
static bool fingerprint_differs(px_t *px, px_replica_t *r, const char *seen)
{
    if (seen == NULL || seen[0] == '\0')
        return false;
    char attested[sizeof(r->engine_fp.w)];
    px_seqstr_get(&r->engine_fp, attested); /* published by attestation */
    if (attested[0] == '\0')
        return false;
    if (strcmp(seen, attested) == 0) {
        /* Written at most once a millisecond: a store per response would move this cache line
         * between the workers' cores on every answer, and attestation reads it against an
         * interval of seconds. */
        uint64_t now = dp_now_ns();
        if (now - atomic_load_explicit(&r->fp_seen_ns, memory_order_relaxed) >= 1000000u)
            atomic_store_explicit(&r->fp_seen_ns, now, memory_order_relaxed);
        return false;
    }
    px_metrics_add(px_metrics_get("detproxy_fingerprint_mismatch_total", "pool", r->pool_name,
                                  "replica", r->name, NULL),
                   1);
    px_event_post(px, &(px_event_t){.kind = PX_EVENT_FINGERPRINT, .r = r, .seen = seen});
    return true;
}

bool px_hooks_audit_refused(const px_hooks_req_t *h)
{
    const pol_t *p = h->policy;
    return p && p->audit_failed && !p->audit_fail_open;
}

bool px_hooks_end_waits(const px_hooks_req_t *h)
{
    const pol_t *p = h->policy;
    return p && end_waits(p);
}

void px_hooks_check_answer(px_hooks_req_t *h, px_t *px, px_replica_t *r, int status)
{
    /* Continuous verification (docs/attestation.md §5): on a difference the replica takes no
     * new requests until it is re-attested. */
    if (h->inference && r && status >= 200 && status < 300) {
        h->fp_mismatch = fingerprint_differs(px, r, h->upstream_fp);
        /* A stream whose fingerprint changed part-way: its later one is checked too, and it
         * is the one audited when it is the one that differs. */
        const pol_t *p = h->policy;
        if (!h->fp_mismatch && p && p->sse_rewrite && p->sse.alt[0] &&
            fingerprint_differs(px, r, p->sse.alt)) {
            h->fp_mismatch = true;
            snprintf(h->upstream_fp, sizeof(h->upstream_fp), "%s", p->sse.alt);
        }
    }
}

void px_hooks_answer_unsent(px_hooks_req_t *h)
{
    pol_t *p = h->policy;
    if (p == NULL)
        return;
    if (p->resp_sha) {
        char gone[65];
        dp_sha256_end_hex(p->resp_sha, gone);
        p->resp_sha = dp_sha256_begin();
    }
    if (p->aud)
        dp_buf_free(&p->aud->resp_body);
    p->resp_over = false;
}

bool px_hooks_before_end(px_hooks_req_t *h, px_t *px, const px_pool_t *pool, px_replica_t *r,
                         int status, const char *request_id, void (*then)(void *data), void *data)
{
    px_hooks_check_answer(h, px, r, status); /* this response is delivered */
    return write_audit(h, px, pool, r, status, request_id, then, data);
}

/* ---- dispatch and the end ----------------------------------------------------------------- */

/* Could px_shadow_maybe draw a copy of this request (a cross or self rate, or a candidate
 * pool)? Only then is a rewritten body joined into one piece for it. */
static bool may_shadow(const px_t *px, const px_pool_t *pool, const cfg_tenant_t *t)
{
    if (px->shadow == NULL)
        return false;
    const cfg_shadow_t *sc = &pool->gen->cfg->shadow;
    double cross = t && t->shadow_rate >= 0 ? t->shadow_rate : sc->rate;
    return cross > 0 || sc->self_rate > 0 || pool->cfg->ncandidates > 0;
}

size_t px_hooks_body_parts(const px_hooks_req_t *h, const dp_iovec_t **parts)
{
    const pol_t *p = h->policy;
    if (p == NULL || !p->applied)
        return 0;
    *parts = p->res.parts;
    return p->res.nparts;
}

void px_hooks_dispatched(px_hooks_req_t *h, px_t *px, px_pool_t *pool, px_replica_t *r,
                         const net_req_t *req, const char *body, size_t len)
{
    pol_t *p = h->policy;
    /* Each accepted identity has its own fingerprint (docs/configuration.md "Manifest", "accept"):
     * the answer carries the one of the replica it came from. */
    char fp[24];
    px_seqstr_get(&r->wfingerprint, fp); /* written by attestation, on the control thread */
    if (fp[0])
        memcpy(h->fingerprint, fp, sizeof(h->fingerprint));
    if (h->affinity.result != PX_AFF_NONE && pool->m_affinity[h->affinity.result])
        px_metrics_add(pool->m_affinity[h->affinity.result], 1); /* each attempt: a retry too */
    if (p == NULL)
        return;
    if (p->audit)
        audit_evidence(p, r);
    if (h->shadow == NULL && may_shadow(px, pool, h->tenant_cfg)) {
        dp_iovec_t b = p->applied ? policy_body(p->preq, &p->res) : (dp_iovec_t){body, len};
        h->shadow = px_shadow_maybe(px, pool, r, h->tenant_cfg, &p->res, req, b.base, b.len);
    }
    px_otel_replica(h->span, r->name, h->shadow != NULL);
}

void px_hooks_upstream_failed(px_hooks_req_t *h, px_t *px, px_replica_t *r, net_up_err_t err)
{
    (void)h;
    px_event_upstream_failed(px, r, err);
}

void px_hooks_finish(px_hooks_req_t *h, px_t *px, px_pool_t *pool, px_replica_t *r, int status,
                     const char *request_id)
{
    write_audit(h, px, pool, r, status, request_id, NULL, NULL);
    px_otel_end(px, h->span, status, request_id, h->upstream_fp[0] ? h->upstream_fp : NULL);
    h->span = NULL;
    if (h->shadow) {
        px_shadow_primary_done(h->shadow, status);
        h->shadow = NULL;
    }
    pol_t *p = h->policy;
    if (p) {
        h->policy = NULL;
        if (p->resp_sha)
            dp_sha256_end_hex(p->resp_sha, (char[65]){0});
        pol_put(p);
    }
}
