/* Replicas: identity, state (written by the control thread, read by every worker), the
 * slots requests hold on them, the per-worker upstreams (each worker's own, changed by
 * messages that run on that worker), and the last reference's free on the control thread. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "common/list.h"
#include "common/log.h"
#include "common/util.h"
#include "net/resolve.h"
#include "net/tls.h"
#include "policy/policy.h"
#include "probe/probe.h"
#include "proxy/core/affinity.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"

/* The reasons as one line, for workers (px_pool_why_unavailable). */
static void publish_why(px_replica_t *r)
{
    dp_buf_t b = {0};
    for (size_t k = 0; k < r->nreasons; k++) {
        if (k)
            dp_buf_append(&b, "; ", 2);
        dp_buf_appends(&b, r->reasons[k]);
    }
    px_seqstr_set(&r->why, b.base ? b.base : "");
    dp_buf_free(&b);
}

const char *const px_replica_state_names[] = {"pending", "admitted", "rejected", "unreachable",
                                              "quarantined"};

void px_replica_upstream_opts(const cfg_t *cfg, net_upstream_opts_t *o)
{
    probe_replica_upstream_opts(cfg, o); /* the same for diagnose and `attest canary` */
}

/* Everything that defines a replica: if any of it changes on reload, it is a new replica. */
char *px_replica_key(const cfg_pool_t *p, const cfg_replica_t *d)
{
    dp_buf_t k = {0};
    /* determinism.mode is not in the manifest fingerprint (docs/configuration.md "Manifest"), but a
     * replica admitted under another mode has not attested this one (docs/configuration.md
     * "Deterministic pools"). */
    dp_buf_printf(&k, "%s\n%s\n%s://%s:%u%s\n%s\n%d\n%s://%s:%u%s\n%s\n%s\n%d", p->name, d->name,
                  d->url.tls ? "https" : "http", d->url.host, d->url.port, d->url.path,
                  d->server_name ? d->server_name : "", (int)d->attest.source,
                  d->attest.url.tls ? "https" : "http",
                  d->attest.url.host ? d->attest.url.host : "", d->attest.url.port,
                  d->attest.url.path ? d->attest.url.path : "",
                  p->manifest ? p->manifest->fingerprint : "",
                  p->upstream_tls && p->upstream_tls->ca_file ? p->upstream_tls->ca_file : "",
                  (int)cfg_pool_determinism(p));
    return dp_buf_steal(&k);
}

static void url_copy(cfg_url_t *dst, const cfg_url_t *src)
{
    memset(dst, 0, sizeof(*dst));
    dst->tls = src->tls;
    dst->port = src->port;
    dst->host = src->host ? dp_xstrdup(src->host) : NULL;
    dst->path = src->path ? dp_xstrdup(src->path) : NULL;
    dst->hostport = src->hostport ? dp_xstrdup(src->hostport) : NULL;
}

/* Every replica alive, so the last one of a (pool, name) can take its metric series with it:
 * a reload may briefly hold an old and a new replica of one name, sharing their series. */
static px_replica_t *g_live;

static bool name_alive(const px_replica_t *except)
{
    for (const px_replica_t *r = g_live; r; r = r->live_next)
        if (r != except && strcmp(r->name, except->name) == 0 &&
            strcmp(r->pool_name, except->pool_name) == 0)
            return true;
    return false;
}

px_replica_t *px_replica_find_live(const char *key)
{
    PX_ASSERT_CONTROL();
    for (px_replica_t *r = g_live; r; r = r->live_next) {
        /* A reference unless its last one is gone (its free is on its way to this thread). */
        if (strcmp(r->key, key) == 0 && px_replica_try_ref(r))
            return r;
    }
    return NULL;
}

void px_replica_each_live(void (*fn)(px_replica_t *r, void *data), void *data)
{
    PX_ASSERT_CONTROL();
    for (px_replica_t *r = g_live, *next; r; r = next) {
        next = r->live_next;
        fn(r, data);
    }
}

/* Every engine's slots while anything shares them, and the engines they name (control thread
 * only). */
static px_slots_t *g_slots;
static px_engine_t *g_engines;
/* A fleet takes turns on one-at-a-time engines (proxy/control/seqlock.c): each is gated from
 * the moment it becomes one, before any request can reach it. */
static bool g_gate;
/* A graceful stop: nothing new starts on a one-at-a-time engine (px_replica_engines_quiesce). */
static atomic_bool g_quiesce;

/* The engine whose key is the first len bytes of key (the URL part of a slots key: the
 * engine's URL, cfg_url_engine), with a new reference from a slots object; one of a
 * single_sequence pool when `one`. */
static px_engine_t *engine_ref(const char *key, size_t len, bool one, bool drain)
{
    px_engine_t *e = g_engines;
    while (e && !(strlen(e->label) == len && memcmp(e->label, key, len) == 0))
        e = e->next;
    if (e == NULL) {
        static uint64_t serials;
        e = dp_xcalloc(1, sizeof(*e));
        e->serial = ++serials;
        e->label = dp_xstrndup(key, len);
        e->fresh = true;
        e->check_unknown = true; /* nothing known until a check here ends */
        DP_LIST_PUSH(g_engines, e, next, prev);
    }
    e->refs++;
    if (one && e->ones++ == 0) {
        /* Whatever a fleet held for it before it stopped being one-at-a-time is not held now. */
        atomic_store(&e->held, false);
        atomic_store(&e->closing, false);
        atomic_store(&e->gated, g_gate);
        atomic_store(&e->one, true);
    }
    if (drain && e->drains++ == 0)
        atomic_store(&e->drain, true);
    return e;
}

static void engine_unref(px_engine_t *e, bool one, bool drain)
{
    if (one && --e->ones == 0) {
        atomic_store(&e->one, false);
        atomic_store(&e->held, false); /* its key goes (seqlock), and so does holding it */
    }
    if (drain && --e->drains == 0)
        atomic_store(&e->drain, false);
    if (--e->refs > 0)
        return;
    DP_LIST_UNLINK(g_engines, e, next, prev);
    free(e->label);
    free(e);
}

/* A sharer of sl lets go: the last one frees it. */
static void slots_unref(px_slots_t *sl)
{
    PX_ASSERT_CONTROL();
    if (atomic_fetch_sub(&sl->refs, 1) != 1)
        return;
    DP_LIST_UNLINK(g_slots, sl, next, prev);
    engine_unref(sl->eng, sl->one, sl->drain);
    free(sl->key);
    free(sl);
}

/* The slots of the engine at url in pool p: those still shared by a replica object of it, or
 * by a request one of them sent that is still read (an orphaned check), else new ones. The
 * single_sequence pools that name one engine share its count (its one slot); any other pool
 * counts its own requests (max_inflight_per_replica is the pool's). */
static px_slots_t *shared_slots(const cfg_pool_t *p, const cfg_url_t *url)
{
    dp_buf_t key = {0};
    bool one = cfg_pool_determinism(p) == CFG_DETERMINISM_SINGLE_SEQUENCE;
    dp_buf_printf(&key, "%s%c", one ? "" : p->name, 0);
    size_t url_at = key.len; /* the engine's key from here */
    cfg_url_engine(url, &key);
    for (px_slots_t *sl = g_slots; sl; sl = sl->next) {
        if (sl->keylen == key.len && memcmp(sl->key, key.base, key.len) == 0) {
            dp_buf_free(&key);
            atomic_fetch_add(&sl->refs, 1);
            return sl;
        }
    }
    px_slots_t *sl = dp_xcalloc(1, sizeof(*sl));
    atomic_init(&sl->refs, 1);
    sl->key = key.base; /* the buffer's own: freed with sl */
    sl->keylen = key.len;
    sl->one = one;
    sl->drain = one && policy_pool_drains_abandoned(p);
    sl->eng = engine_ref(key.base + url_at, key.len - url_at, one, sl->drain);
    DP_LIST_PUSH(g_slots, sl, next, prev);
    return sl;
}

px_replica_t *px_replica_create(px_t *px, const cfg_t *cfg, const cfg_pool_t *p,
                                const cfg_replica_t *d, char *key)
{
    PX_ASSERT_CONTROL();
    px_replica_t *r = dp_xcalloc(1, sizeof(*r));
    atomic_init(&r->refs, 1);
    uv_mutex_init(&r->ev_lock);
    r->wup = dp_xcalloc(px->nslots ? px->nslots : 1, sizeof(*r->wup));
    r->wtls = dp_xcalloc(px->nslots ? px->nslots : 1, sizeof(*r->wtls));
    r->slots = shared_slots(p, &d->url);
    DP_LIST_PUSH(g_live, r, live_next, live_prev);
    r->px = px;
    r->key = key;
    r->pool_name = dp_xstrdup(p->name);
    r->name = dp_xstrdup(d->name);
    r->aff_id = px_affinity_hash(d->name, strlen(d->name));
    url_copy(&r->url, &d->url);
    r->server_name = d->server_name ? dp_xstrdup(d->server_name) : NULL;
    r->attest.source = d->attest.source;
    url_copy(&r->attest.url, &d->attest.url);
    r->m_admitted =
        px_metrics_get("detproxy_replica_admitted", "pool", p->name, "replica", d->name, NULL);
    r->m_drained =
        px_metrics_get("detproxy_replica_drained", "pool", p->name, "replica", d->name, NULL);
    r->resolved = net_resolve(r->url.host, r->url.port, &r->addr);
    if (r->url.tls || r->attest.url.tls) {
        const cfg_upstream_tls_t *ut = p->upstream_tls;
        dp_buf_t err = {0};
        r->tls_ctx = net_tls_client_ctx(ut ? ut->ca_file : NULL, ut ? ut->client_cert_file : NULL,
                                        ut ? ut->client_key_file : NULL, &err);
        if (r->tls_ctx == NULL) {
            const char *why[] = {err.base, NULL};
            px_replica_set_state(r, PX_REPLICA_UNREACHABLE, why);
            dp_buf_free(&err);
            r->resolved = false; /* nothing can reach it */
            return r;
        }
        dp_buf_free(&err);
    }
    net_upstream_opts_t o;
    px_replica_upstream_opts(cfg, &o);
    if (r->resolved) {
        r->up = net_upstream_new(px->loop, (struct sockaddr *)&r->addr, &o);
        px_replica_upstream_tls(r, r->up, &r->url);
    }
    /* Until attestation has spoken, a replica gets no traffic; pools that pin nothing are
     * admitted by attestation on its first successful probe. */
    r->state = PX_REPLICA_PENDING;
    if (!r->resolved) {
        const char *why[] = {"host name did not resolve", NULL};
        px_replica_set_state(r, PX_REPLICA_UNREACHABLE, why);
    }
    return r;
}

void px_replica_upstream_tls(px_replica_t *r, net_upstream_t *u, const cfg_url_t *url)
{
    if (!url->tls || r->tls_ctx == NULL)
        return;
    /* server_name overrides the name checked for the replica itself, not for its agent. */
    const char *name = url == &r->url && r->server_name ? r->server_name : url->host;
    net_upstream_set_tls(u, r->tls_ctx, name);
}

void px_replica_ref(px_replica_t *r)
{
    atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed);
}

bool px_replica_try_ref(px_replica_t *r)
{
    int n = atomic_load_explicit(&r->refs, memory_order_relaxed);
    while (n > 0)
        if (atomic_compare_exchange_weak_explicit(&r->refs, &n, n + 1, memory_order_acq_rel,
                                                  memory_order_relaxed))
            return true;
    return false;
}

static void replica_free(px_replica_t *r);

/* ---- each worker's upstream of a replica: changed on that worker ------------------------ */

typedef struct {
    net_mb_node_t node;
    px_t *px;
    px_replica_t *r;     /* a reference (flush); NULL once the replica is gone (free) */
    px_replica_t *dying; /* free: the replica's memory, freed by the last worker done with it */
    unsigned slot;
    net_upstream_t *up;
    net_tls_ctx_t *tls; /* a reference */
} slot_msg_t;

static slot_msg_t *slot_msg(px_replica_t *r, unsigned slot, net_upstream_t *up, net_tls_ctx_t *t)
{
    slot_msg_t *m = dp_xcalloc(1, sizeof(*m));
    m->r = r;
    m->slot = slot;
    m->up = up;
    m->tls = t;
    return m;
}

static void flush_here(net_mb_node_t *n)
{
    slot_msg_t *m = (slot_msg_t *)n;
    px_replica_t *r = m->r;
    if (m->tls) {
        /* The TLS files were read again (reload): this worker's context takes the new trust. */
        if (r->wtls[m->slot])
            net_tls_ctx_replace(r->wtls[m->slot], m->tls);
        net_tls_ctx_unref(m->tls);
    }
    if (r->wup[m->slot])
        net_upstream_flush_idle(r->wup[m->slot]);
    px_replica_unref(r);
    free(m);
}

void px_replica_flush_workers(px_replica_t *r, net_tls_ctx_t *fresh)
{
    PX_ASSERT_CONTROL();
    for (unsigned s = 1; r->px && s < r->px->nslots; s++) {
        px_replica_ref(r);
        if (fresh)
            net_tls_ctx_ref(fresh);
        slot_msg_t *m = slot_msg(r, s, NULL, fresh);
        if (!px_thread_post(r->px, s, &m->node, flush_here)) {
            net_tls_ctx_unref(fresh);
            px_replica_unref(r);
            free(m);
        }
    }
}

/* On the worker: its upstream of a replica that is gone. One the worker's shutdown already
 * closed is no longer on its list. */
/* One wait of a replica freed on control is over: the last frees its memory. */
static void free_waited(px_replica_t *r)
{
    if (atomic_fetch_sub_explicit(&r->free_waits, 1, memory_order_acq_rel) == 1)
        free(r);
}

static void free_upstream_here(net_mb_node_t *n)
{
    slot_msg_t *m = (slot_msg_t *)n;
    if (m->up && px_thread_forget_upstream(px_thread_of(m->px, m->slot), m->up))
        net_upstream_free(m->up);
    net_tls_ctx_unref(m->tls);
    free_waited(m->dying);
    free(m);
}

static void replica_free_posted(net_mb_node_t *n)
{
    replica_free((px_replica_t *)((char *)n - offsetof(px_replica_t, free_node)));
}

void px_replica_unref(px_replica_t *r)
{
    if (atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel) > 1)
        return;
    if (!px_thread_on_control()) { /* attestation state, metric series, upstreams: control's */
        px_thread_post_control(r->px, &r->free_node, replica_free_posted);
        return;
    }
    replica_free(r);
}

static void replica_free(px_replica_t *r)
{
    PX_ASSERT_CONTROL();
    DP_LIST_UNLINK(g_live, r, live_next, live_prev);
    /* A replica that left for good (discovery dropped its address, or a reload its name) takes
     * its series along: a gauge left behind would say a replica that is gone still serves
     * (the no-admitted-replica alert could never fire), and every address a Service ever had
     * would stay in /metrics. One that a reload replaced keeps them (its name lives on). */
    if (!name_alive(r))
        px_metrics_drop("pool", r->pool_name, "replica", r->name);
    if (r->px && r->px->replica_hooks.freed)
        r->px->replica_hooks.freed(r);
    if (r->up)
        net_upstream_free(r->up);
    if (r->shadow_up)
        net_upstream_free(r->shadow_up);
    /* A worker's upstream of r watches its idle connections' closes with a pointer to r (no
     * reference: r would never be freed): r's memory waits until every worker has dropped
     * its upstream, and a close seen meanwhile finds no reference to take. */
    atomic_store_explicit(&r->free_waits, 1, memory_order_relaxed); /* this function's own */
    for (unsigned s = 1; r->px && s < r->px->nslots; s++) {
        if (r->wup[s] == NULL && r->wtls[s] == NULL)
            continue;
        slot_msg_t *m = slot_msg(NULL, s, r->wup[s], r->wtls[s]);
        m->px = r->px;
        m->dying = r;
        atomic_fetch_add_explicit(&r->free_waits, 1, memory_order_relaxed);
        /* A worker that never ran made nothing; one that was joined closed its upstreams at
         * its stop: only its TLS context is left to release. */
        if (!px_thread_post(r->px, s, &m->node, free_upstream_here)) {
            net_tls_ctx_unref(m->tls);
            free(m);
            atomic_fetch_sub_explicit(&r->free_waits, 1, memory_order_relaxed);
        }
    }
    free(r->wup);
    free(r->wtls);
    net_tls_ctx_unref(r->tls_ctx);
    for (size_t i = 0; i < r->nreasons; i++)
        free(r->reasons[i]);
    cfg_url_free(&r->url);
    cfg_url_free(&r->attest.url);
    dp_buf_free(&r->evidence);
    uv_mutex_destroy(&r->ev_lock);
    free(r->server_name);
    free(r->key);
    free(r->pool_name);
    free(r->name);
    slots_unref(r->slots);
    free_waited(r);
}

void px_replica_set_state(px_replica_t *r, px_replica_state_t st, const char *const *reasons)
{
    PX_ASSERT_CONTROL();
    bool changed = st != r->state;
    bool reasons_changed = false;
    size_t n = 0;
    while (reasons && reasons[n] && n < PX_MAX_REASONS)
        n++;
    if (n != r->nreasons) {
        reasons_changed = true;
    } else {
        for (size_t i = 0; i < n; i++)
            if (strcmp(reasons[i], r->reasons[i]) != 0)
                reasons_changed = true;
    }
    if (reasons_changed) {
        for (size_t i = 0; i < r->nreasons; i++)
            free(r->reasons[i]);
        for (size_t i = 0; i < n; i++)
            r->reasons[i] = dp_xstrdup(reasons[i]);
        r->nreasons = n;
        publish_why(r);
    }
    if (!changed && !reasons_changed)
        return;
    px_replica_state_t old = r->state;
    r->state = st;
    px_metrics_set(r->m_admitted, st == PX_REPLICA_ADMITTED ? 1 : 0);
    if (r->px && r->px->replica_hooks.changed)
        r->px->replica_hooks.changed(r, old);
    dp_jw_t *w = dp_log_begin(st == PX_REPLICA_ADMITTED || st == PX_REPLICA_PENDING ? DP_LOG_INFO
                                                                                    : DP_LOG_WARN,
                              "replica_state");
    if (w) {
        dp_jw_str(w, "pool", r->pool_name);
        dp_jw_str(w, "replica", r->name);
        dp_jw_str(w, "from", px_replica_state_names[old]);
        dp_jw_str(w, "to", px_replica_state_names[st]);
        dp_jw_arr_begin(w, "reasons");
        for (size_t i = 0; i < r->nreasons; i++)
            dp_jw_str(w, NULL, r->reasons[i]);
        dp_jw_arr_end(w);
        dp_log_end(w);
    }
    if (st != PX_REPLICA_ADMITTED && r->up)
        net_upstream_flush_idle(r->up);
    if (st != PX_REPLICA_ADMITTED)
        px_replica_flush_workers(r, NULL);
}

void px_replica_set_drained(px_replica_t *r, bool drained)
{
    PX_ASSERT_CONTROL();
    px_metrics_set(r->m_drained, drained ? 1 : 0);
    if (r->drained == drained)
        return;
    r->drained = drained;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, drained ? "replica_drained" : "replica_enabled");
    if (w) {
        dp_jw_str(w, "pool", r->pool_name);
        dp_jw_str(w, "replica", r->name);
        dp_jw_str(w, "state", px_replica_state_names[r->state]);
        dp_jw_uint(w, "inflight", atomic_load(&r->slots->inflight));
        dp_log_end(w);
    }
    /* Idle keep-alive connections serve no one while drained; in-flight ones finish. */
    if (drained && r->up)
        net_upstream_flush_idle(r->up);
    if (drained)
        px_replica_flush_workers(r, NULL);
}

/* A replica carried over by a reload keeps its identity and attestation, but its TLS files
 * are read again: certificates are rotated in place (cert-manager, Vault), and a replaced CA
 * file must withdraw trust now, not at the next restart. Every upstream of the replica shares
 * r->tls_ctx, so replacing its contents reaches them all; pooled connections made under the
 * old settings are closed. If the new files do not load, the old settings stay. */
void px_replica_reload_tls(px_replica_t *r, const cfg_pool_t *p)
{
    if (r->tls_ctx == NULL)
        return;
    const cfg_upstream_tls_t *ut = p->upstream_tls;
    dp_buf_t err = {0};
    net_tls_ctx_t *fresh =
        net_tls_client_ctx(ut ? ut->ca_file : NULL, ut ? ut->client_cert_file : NULL,
                           ut ? ut->client_key_file : NULL, &err);
    if (fresh == NULL) {
        dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "tls_load_failed");
        if (w) {
            dp_jw_str(w, "pool", p->name);
            dp_jw_str(w, "replica", r->name);
            dp_jw_str(w, "detail", err.base ? err.base : "");
            dp_log_end(w);
        }
        dp_buf_free(&err);
        return;
    }
    net_tls_ctx_replace(r->tls_ctx, fresh);
    if (r->up)
        net_upstream_flush_idle(r->up);
    if (r->shadow_up)
        net_upstream_flush_idle(r->shadow_up);
    px_replica_flush_workers(r, fresh);
    net_tls_ctx_unref(fresh);
}

px_replica_t *px_replica_new_detached(px_t *px, px_pool_t *p, const cfg_replica_t *def)
{
    return px_replica_create(px, p->gen->cfg, p->cfg, def, px_replica_key(p->cfg, def));
}

/* ---- slots ------------------------------------------------------------------------------ */

bool px_replica_drains_abandoned(const px_replica_t *r)
{
    return atomic_load(&r->slots->eng->drain);
}

unsigned px_replica_engines_quiesce(void)
{
    PX_ASSERT_CONTROL();
    atomic_store(&g_quiesce, true);
    unsigned n = 0;
    for (px_engine_t *e = g_engines; e; e = e->next)
        if (e->ones > 0)
            n += atomic_load(&e->running);
    return n;
}

bool px_replica_engines_quiesced(void)
{
    return atomic_load(&g_quiesce);
}

void px_replica_engines_gate(void)
{
    PX_ASSERT_CONTROL();
    g_gate = true;
    for (px_engine_t *e = g_engines; e; e = e->next)
        atomic_store(&e->gated, true);
}

void px_replica_engines_each(void (*fn)(px_engine_t *e, void *data), void *data)
{
    PX_ASSERT_CONTROL();
    for (px_engine_t *e = g_engines, *next; e; e = next) {
        next = e->next;
        if (e->ones > 0)
            fn(e, data);
    }
}

/* May a request start on e as far as a fleet is concerned: a new one (take), or one whose slot
 * was already passed to it? When not, the engine is asked for. */
static bool may_start(px_engine_t *e, bool take)
{
    if (atomic_load(&g_quiesce))
        return false;
    if (!atomic_load(&e->gated) || (atomic_load(&e->held) && !(take && atomic_load(&e->closing)) &&
                                    dp_now_ms() < atomic_load(&e->held_until)))
        return true;
    atomic_store(&e->want, true);
    return false;
}

/* One request at a time on e: the slot is taken only when nothing runs there, and, across a
 * fleet, while this member holds the engine. Holding it is looked at after the count is taken
 * (both sequentially consistent): the control thread lets go of it only after it has set
 * `closing` and then seen nothing running, so a take either sees `closing` or is seen. */
static bool take_only(px_slots_t *sl, px_engine_t *e)
{
    unsigned none = 0;
    if (!atomic_compare_exchange_strong(&e->running, &none, 1))
        return false;
    if (!may_start(e, true)) {
        atomic_fetch_sub(&e->running, 1);
        return false;
    }
    atomic_fetch_add(&sl->inflight, 1);
    return true;
}

bool px_replica_take_slot(const px_pool_t *p, px_replica_t *r)
{
    px_slots_t *sl = r->slots;
    px_engine_t *e = sl->eng;
    if (sl->one || atomic_load(&e->one))
        return take_only(sl, e);
    uint32_t max = p->cfg->max_inflight_per_replica;
    unsigned cur = atomic_load_explicit(&sl->inflight, memory_order_relaxed);
    if (max == 0) {
        atomic_fetch_add_explicit(&sl->inflight, 1, memory_order_relaxed);
    } else {
        for (;;) {
            if (cur >= max)
                return false;
            if (atomic_compare_exchange_weak_explicit(&sl->inflight, &cur, cur + 1,
                                                      memory_order_acq_rel, memory_order_relaxed))
                break;
        }
    }
    /* Counted on the engine first, then the mode looked at again (both sequentially
     * consistent): a single_sequence slot taken since it was read above either sees this
     * request running or is seen here. Then this one gives way, unless nothing else runs. */
    unsigned before = atomic_fetch_add(&e->running, 1);
    if (before > 0 && atomic_load(&e->one)) {
        atomic_fetch_sub(&e->running, 1);
        atomic_fetch_sub(&sl->inflight, 1);
        return false;
    }
    return true;
}

void px_replica_engine_seen(px_engine_t *e)
{
    PX_ASSERT_CONTROL();
    e->fresh = false;
}

void px_replica_take_first_slot(px_replica_t *r)
{
    PX_ASSERT_CONTROL();
    atomic_fetch_add(&r->slots->eng->running, 1);
    atomic_fetch_add(&r->slots->inflight, 1);
}

bool px_replica_take_spare_slot(const px_pool_t *p, px_replica_t *r)
{
    return atomic_load(&p->waiting) == 0 && px_replica_take_slot(p, r);
}

/* Decrement *c when it is above 0; false when it was 0. */
static bool dec_positive(atomic_uint *c)
{
    unsigned v = atomic_load(c);
    while (v > 0)
        if (atomic_compare_exchange_weak(c, &v, v - 1))
            return true;
    return false;
}

/* The slot goes back to its engine. */
static void slots_free(px_slots_t *sl)
{
    unsigned prev = atomic_fetch_sub(&sl->inflight, 1);
    assert(prev > 0);
    prev = atomic_fetch_sub(&sl->eng->running, 1);
    assert(prev > 0);
    (void)prev;
}

static void slots_put(px_slots_t *sl)
{
    px_engine_t *e = sl->eng;
    /* An operator request waits for it: it is passed on, unless the engine runs one request
     * at a time and either another runs there besides this one (a reload made it so while the
     * pool's earlier mode ran several), or nothing new is to start there (a fleet member
     * letting go of the engine, which a chain of passed slots would never let it do, or a
     * graceful stop): then it is freed, and the operator request takes one as any request
     * does, when one may start. */
    bool keep = atomic_load(&e->one) && (atomic_load(&e->running) > 1 || atomic_load(&g_quiesce) ||
                                         (atomic_load(&e->gated) && atomic_load(&e->closing)));
    if (!keep && dec_positive(&sl->held)) {
        atomic_fetch_add(&sl->granted, 1);
        return;
    }
    slots_free(sl);
}

void px_replica_put_slot(px_replica_t *r)
{
    slots_put(r->slots);
}

px_slots_t *px_replica_slots_ref(px_replica_t *r)
{
    atomic_fetch_add(&r->slots->refs, 1);
    return r->slots;
}

void px_replica_slots_put_unref(px_slots_t *sl)
{
    slots_put(sl);
    slots_unref(sl);
}

void px_replica_hold_slot(px_replica_t *r)
{
    atomic_fetch_add(&r->slots->held, 1);
}

/* The caller's unit of held + granted goes away: one of the two is above 0 (units are
 * fungible between the waiters; put_slot may be moving one from held to granted meanwhile). */
static bool drop_hold(px_replica_t *r)
{
    for (;;) {
        if (dec_positive(&r->slots->held))
            return false;
        if (dec_positive(&r->slots->granted))
            return true; /* it had been passed a slot */
    }
}

bool px_replica_take_held_slot(const px_pool_t *p, px_replica_t *r)
{
    if (dec_positive(&r->slots->granted)) {
        px_engine_t *e = r->slots->eng;
        if (!atomic_load(&e->one) || may_start(e, false))
            return true;
        /* Passed on while this member may not start anything there. In a graceful stop it is
         * freed (nothing may start there any more, and the stop waits for the engine to be
         * idle); else (its fleet key not held, or its lease maybe gone) it is kept, counted as
         * running, for a later look. */
        if (atomic_load(&g_quiesce)) {
            atomic_fetch_add(&r->slots->held, 1); /* still waiting, as any request would be */
            slots_free(r->slots);
            return false;
        }
        atomic_fetch_add(&r->slots->granted, 1);
        return false;
    }
    /* A slot freed before the hold was seen stays free: take it, and the hold goes. */
    if (!px_replica_take_slot(p, r))
        return false;
    if (drop_hold(r))
        px_replica_put_slot(r); /* a second one came meanwhile: passed on or freed */
    return true;
}

void px_replica_unhold_slot(px_replica_t *r)
{
    if (drop_hold(r))
        px_replica_put_slot(r);
}

/* The one eligibility rule: may replica r be sent new requests at all? Every balance, the
 * affinity order and mean, and /readyz go through it. */
bool px_replica_serving(const px_replica_t *r)
{
    return px_replica_state(r) == PX_REPLICA_ADMITTED && r->up &&
           !atomic_load_explicit(&r->drained, memory_order_acquire) &&
           !atomic_load_explicit(&r->suspect, memory_order_acquire);
}

void px_replica_set_evidence(px_replica_t *r, dp_buf_t *ev)
{
    PX_ASSERT_CONTROL();
    char sha[65] = "";
    if (ev && ev->len)
        dp_sha256_hex(ev->base, ev->len, sha);
    uv_mutex_lock(&r->ev_lock);
    dp_buf_free(&r->evidence);
    if (ev && ev->len)
        r->evidence = *ev;
    else if (ev)
        dp_buf_free(ev); /* empty, but perhaps allocated */
    if (ev)
        memset(ev, 0, sizeof(*ev));
    memcpy(r->evidence_sha, sha, sizeof(sha));
    uv_mutex_unlock(&r->ev_lock);
}

void px_replica_get_evidence(px_replica_t *r, char sha[65], dp_buf_t *bytes)
{
    uv_mutex_lock(&r->ev_lock);
    memcpy(sha, r->evidence_sha, 65);
    if (bytes && r->evidence.len)
        dp_buf_append(bytes, r->evidence.base, r->evidence.len);
    uv_mutex_unlock(&r->ev_lock);
}
