/* Replica selection: admitted replicas only, with spare capacity, by the pool's balance. */
#include <string.h>

#include "proxy/px.h"

static bool has_capacity(const px_pool_t *p, const px_replica_t *r)
{
    uint32_t max = p->cfg->max_inflight_per_replica;
    return max == 0 || r->inflight < max;
}

bool px_replica_serving(const px_replica_t *r)
{
    return r->state == PX_REPLICA_ADMITTED && r->up && !r->drained;
}

bool px_pool_has_admitted(const px_pool_t *p)
{
    for (size_t i = 0; i < p->nreplicas; i++)
        if (px_replica_serving(p->replicas[i]))
            return true;
    return false;
}

/* least_inflight scans from a rotating start so ties spread across replicas instead of
 * always landing on the first one; round_robin takes the next eligible one. O(replicas),
 * which is a handful per pool. */
px_replica_t *px_router_pick(px_pool_t *p, const px_replica_t *avoid, int *why)
{
    size_t n = p->nreplicas;
    px_replica_t *best = NULL;
    bool any_admitted = false;
    if (n == 0) {
        *why = 0;
        return NULL;
    }
    uint32_t start = p->rr++;
    for (size_t k = 0; k < n; k++) {
        px_replica_t *r = p->replicas[(start + k) % n];
        if (!px_replica_serving(r))
            continue;
        any_admitted = true;
        if (r == avoid || !has_capacity(p, r))
            continue;
        if (p->cfg->balance == CFG_BALANCE_ROUND_ROBIN) {
            best = r;
            break;
        }
        if (best == NULL || r->inflight < best->inflight)
            best = r;
    }
    if (best == NULL && avoid && px_replica_serving(avoid) && has_capacity(p, avoid))
        best = (px_replica_t *)avoid; /* the only candidate left: better than failing */
    if (best == NULL)
        *why = any_admitted ? 1 : 0;
    return best;
}

void px_pool_why_unavailable(const px_pool_t *p, dp_buf_t *out)
{
    if (p->nreplicas == 0) {
        dp_buf_printf(out, "pool %s has no replicas", p->name);
        return;
    }
    dp_buf_printf(out, "pool %s has no admitted replica:", p->name);
    for (size_t i = 0; i < p->nreplicas; i++) {
        const px_replica_t *r = p->replicas[i];
        dp_buf_printf(out, " %s %s%s", r->name, px_replica_state_names[r->state],
                      r->drained ? " drained" : "");
        if (r->nreasons) {
            dp_buf_append(out, " (", 2);
            for (size_t k = 0; k < r->nreasons; k++) {
                if (k)
                    dp_buf_append(out, "; ", 2);
                dp_buf_appends(out, r->reasons[k]);
            }
            dp_buf_appendc(out, ')');
        }
        dp_buf_appendc(out, i + 1 < p->nreplicas ? ';' : '.');
    }
}
