/* Configuration generations: building one from a config (reusing the replicas a reload keeps),
 * references, and the lookups every request makes. Pools: pool.c; replicas: replica.c. */
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "common/util.h"
#include "net/resolve.h"
#include "net/tls.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"

px_gen_t *px_gen_new(px_t *px, cfg_t *cfg, px_gen_t *prev)
{
    PX_ASSERT_CONTROL();
    unsigned nslots = px->nslots ? px->nslots : 1;
    px_gen_t *g = dp_xcalloc(1, sizeof(*g));
    atomic_init(&g->refs, 1);
    g->px = px;
    g->cfg = cfg;
    g->npools = cfg->npools;
    g->pools = dp_xcalloc(cfg->npools, sizeof(*g->pools));
    g->m_overrides = dp_xcalloc(nslots, sizeof(*g->m_overrides));
    g->cfg_refs = dp_xcalloc(1, sizeof(*g->cfg_refs));
    *g->cfg_refs = 1;
    net_upstream_opts_t uo;
    px_replica_upstream_opts(cfg, &uo);
    for (size_t i = 0; i < cfg->npools; i++) {
        px_pool_t *p = &g->pools[i];
        const cfg_pool_t *pc = &cfg->pools[i];
        p->gen = g;
        p->cfg = pc;
        p->name = pc->name;
        cfg_manifest_fingerprint(pc->manifest, p->fingerprint);
        p->m_duration =
            px_metrics_hist("detproxy_request_duration_seconds", px_metrics_latency_bounds,
                            px_metrics_latency_nbounds, "pool", pc->name, NULL);
        for (int k = PX_AFF_HIT; pc->balance == CFG_BALANCE_AFFINITY && k < PX_AFF__COUNT; k++)
            p->m_affinity[k] = px_metrics_get("detproxy_affinity_total", "pool", pc->name, "result",
                                              px_affinity_result_names[k], NULL);
        p->slots = dp_xcalloc(nslots, sizeof(*p->slots));
        /* Queue order goes on across the reload: tickets keep counting from the old pool's. */
        px_pool_t *op = prev ? px_gen_pool_by_name(prev, pc->name) : NULL;
        if (op)
            atomic_store(&p->tickets, atomic_load(&op->tickets));
        for (size_t k = 0; k < pc->nreplicas; k++) {
            char *key = px_replica_key(pc, &pc->replicas[k]);
            /* The same replica whenever its definition is the same, whichever generation
             * still holds it: its attestation, keep-alive pools and in-flight count go on. */
            px_replica_t *r = px_replica_find_live(key);
            if (r) {
                free(key);
                /* An address discovery found and the config now lists is the config's: it
                 * stays whatever DNS says next (discovery lets go of it at its refresh). */
                r->discovered = false;
                if (r->up)
                    net_upstream_set_opts(r->up, &uo);
                px_replica_reload_tls(r, pc);
                px_pool_push_replica(p, r);
            } else {
                px_pool_push_replica(p, px_replica_create(px, cfg, pc, &pc->replicas[k], key));
            }
        }
    }
    return g;
}

void px_gen_ref(px_gen_t *g)
{
    atomic_fetch_add_explicit(&g->refs, 1, memory_order_relaxed);
}

static void gen_free(px_gen_t *g)
{
    PX_ASSERT_CONTROL();
    for (size_t i = 0; i < g->npools; i++) {
        px_pool_t *p = &g->pools[i];
        for (size_t k = 0; k < p->nreplicas; k++)
            px_replica_unref(p->replicas[k]);
        free(p->replicas);
        free(p->slots);
    }
    free(g->pools);
    free(g->m_overrides);
    if (--*g->cfg_refs == 0) {
        cfg_free(g->cfg);
        free(g->cfg_refs);
    }
    free(g);
}

/* The same configuration and replicas, in a generation of its own (not yet published). */
static px_gen_t *gen_clone(const px_gen_t *o)
{
    px_t *px = o->px;
    unsigned nslots = px->nslots ? px->nslots : 1;
    px_gen_t *g = dp_xcalloc(1, sizeof(*g));
    atomic_init(&g->refs, 1);
    g->px = px;
    g->cfg = o->cfg;
    g->cfg_refs = o->cfg_refs;
    ++*g->cfg_refs;
    g->npools = o->npools;
    g->pools = dp_xcalloc(o->npools, sizeof(*g->pools));
    g->m_overrides = dp_xcalloc(nslots, sizeof(*g->m_overrides));
    for (size_t i = 0; i < o->npools; i++) {
        const px_pool_t *op = &o->pools[i];
        px_pool_t *p = &g->pools[i];
        p->gen = g;
        p->cfg = op->cfg;
        p->name = op->name;
        memcpy(p->fingerprint, op->fingerprint, sizeof(p->fingerprint));
        p->m_duration = op->m_duration;
        memcpy(p->m_affinity, op->m_affinity, sizeof(p->m_affinity));
        p->slots = dp_xcalloc(nslots, sizeof(*p->slots));
        for (size_t k = 0; k < op->nreplicas; k++) {
            px_replica_ref(op->replicas[k]);
            px_pool_push_replica(p, op->replicas[k]);
        }
    }
    return g;
}

px_gen_t *px_gen_writable(px_t *px)
{
    PX_ASSERT_CONTROL();
    if (!px->gen->published)
        return px->gen;
    px_gen_t *old = px->gen;
    px->gen = gen_clone(old);
    px_gen_unref(old);
    return px->gen;
}

static void gen_free_posted(net_mb_node_t *n)
{
    gen_free((px_gen_t *)((char *)n - offsetof(px_gen_t, free_node)));
}

void px_gen_unref(px_gen_t *g)
{
    if (atomic_fetch_sub_explicit(&g->refs, 1, memory_order_acq_rel) > 1)
        return;
    if (!px_thread_on_control()) {
        px_thread_post_control(g->px, &g->free_node, gen_free_posted);
        return;
    }
    gen_free(g);
}

px_series_t *px_gen_override_series(px_gen_t *g, const cfg_tenant_t *t, const char *tenant,
                                    const char *param, int action, const char *action_name)
{
    px_override_series_t *ov = g->m_overrides[px_thread_slot()];
    size_t n = DP_ARRAY_SIZE(g->m_overrides[0]);
    for (size_t i = 0; i < n && ov[i].s; i++)
        if (ov[i].tenant == t && ov[i].param == param && ov[i].action == action)
            return ov[i].s;
    px_series_t *s = px_metrics_get("detproxy_policy_overrides_total", "tenant", tenant, "param",
                                    param, "action", action_name, NULL);
    for (size_t i = 0; i < n; i++) {
        if (ov[i].s == NULL) {
            ov[i].tenant = t;
            ov[i].param = param;
            ov[i].action = action;
            ov[i].s = s;
            break;
        }
    }
    return s;
}

px_pool_t *px_gen_pool_by_name(const px_gen_t *g, const char *name)
{
    for (size_t i = 0; i < g->npools; i++)
        if (strcmp(g->pools[i].name, name) == 0)
            return &g->pools[i];
    return NULL;
}

px_pool_t *px_gen_pool_for_model(px_gen_t *g, const char *model, size_t len)
{
    for (size_t i = 0; i < g->npools; i++) {
        const cfg_pool_t *pc = g->pools[i].cfg;
        for (size_t k = 0; k < pc->nmodels; k++) {
            const char *m = pc->models[k];
            if (strcmp(m, "*") == 0 || (strlen(m) == len && memcmp(m, model, len) == 0))
                return &g->pools[i];
        }
    }
    return NULL;
}
