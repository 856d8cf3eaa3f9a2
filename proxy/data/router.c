/* Replica selection: admitted replicas only, with spare capacity, by the pool's balance.
 *
 * Any worker may pick any replica: state and drained are atomics the control thread writes,
 * and a replica's in-flight count is shared by every worker. A pick reads the counts, then
 * takes its slot with compare-and-swap (px_replica_take_slot); if another worker took the last
 * one in between, it picks again, so max_inflight_per_replica holds exactly whichever workers
 * the requests arrive on. */
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"
#include "proxy/data/router.h"

/* seq_cst (a plain load on x86): the re-pick after queueing relies on it (data/admission.c). */
static uint32_t inflight(const px_replica_t *r)
{
    return atomic_load(&r->slots->inflight);
}

/* An unverified replica (it closed a connection; core/replica.h) counts as full until it is
 * re-checked: requests queue for it rather than reach what may be another engine process. */
static bool has_capacity(const px_pool_t *p, const px_replica_t *r)
{
    uint32_t max = p->cfg->max_inflight_per_replica;
    return (max == 0 || inflight(r) < max) && !atomic_load(&r->unverified);
}

/* balance: affinity. The candidates live on the stack for the pools people run (a handful of
 * replicas, 64 discovered at most by default). */
static px_replica_t *pick_affinity(px_pool_t *p, const px_replica_t *avoid, px_affinity_t *aff)
{
    size_t n = p->nreplicas;
    px_affinity_cand_t stack[64] = {{0}}; /* zeroed: gcc cannot see that n >= 1 here */
    px_affinity_cand_t *c = n <= DP_ARRAY_SIZE(stack) ? stack : dp_xmalloc(n * sizeof(*c));
    for (size_t i = 0; i < n; i++) {
        const px_replica_t *r = p->replicas[i];
        bool member = px_replica_serving(r);
        c[i] = (px_affinity_cand_t){r->aff_id, inflight(r), member,
                                    member && r != avoid && has_capacity(p, r)};
    }
    px_affinity_result_t res;
    size_t k = px_affinity_choose(aff->key, c, n, p->cfg->affinity.load_factor, &res);
    /* A key whose home is held for a re-check waits for it (queued) rather than spill: the
     * check is short, and a spilled request may get another answer (another prefix cache). */
    if (res == PX_AFF_SPILL) {
        size_t home = px_affinity_home(aff->key, c, n);
        if (home != n && p->replicas[home] != avoid && atomic_load(&p->replicas[home]->unverified))
            k = n;
    }
    if (c != stack)
        free(c);
    if (k == n) {
        aff->result = PX_AFF_NONE;
        return NULL;
    }
    aff->result = aff->fallback ? PX_AFF_FALLBACK : res;
    return p->replicas[k];
}

/* least_inflight scans from a rotating start so ties spread across replicas instead of
 * always landing on the first one; round_robin takes the next eligible one. O(replicas),
 * which is a handful per pool. */
static px_replica_t *pick_spread(px_pool_t *p, const px_replica_t *avoid)
{
    size_t n = p->nreplicas;
    px_replica_t *best = NULL;
    uint32_t start = p->slots[px_thread_slot()].rr++;
    for (size_t k = 0; k < n; k++) {
        px_replica_t *r = p->replicas[(start + k) % n];
        if (!px_replica_serving(r) || r == avoid || !has_capacity(p, r))
            continue;
        if (p->cfg->balance == CFG_BALANCE_ROUND_ROBIN) {
            best = r;
            break;
        }
        if (best == NULL || inflight(r) < inflight(best))
            best = r;
    }
    return best;
}

static px_replica_t *pick_once(px_pool_t *p, const px_replica_t *avoid, px_affinity_t *aff,
                               bool keyed)
{
    /* Without a key (pass-through requests on an affinity pool) the pool spreads by load. */
    px_replica_t *best = keyed ? pick_affinity(p, avoid, aff) : pick_spread(p, avoid);
    if (best == NULL && avoid && px_replica_serving(avoid) && has_capacity(p, avoid)) {
        best = (px_replica_t *)avoid; /* the only candidate left: better than failing */
        if (keyed)
            aff->result = aff->fallback ? PX_AFF_FALLBACK : PX_AFF_SPILL;
    }
    return best;
}

px_replica_t *px_router_pick(px_pool_t *p, const px_replica_t *avoid, px_affinity_t *aff, int *why)
{
    bool keyed = p->cfg->balance == CFG_BALANCE_AFFINITY && aff && aff->has_key;
    if (p->nreplicas == 0) {
        *why = 0;
        return NULL;
    }
    /* A lost race for a slot means another worker filled it: that replica now shows as full,
     * so each retry sees one fewer candidate. */
    for (size_t tries = 0; tries <= p->nreplicas; tries++) {
        px_replica_t *best = pick_once(p, avoid, aff, keyed);
        if (best == NULL)
            break;
        if (px_replica_take_slot(p, best))
            return best;
    }
    *why = px_pool_has_admitted(p) ? 1 : 0;
    return NULL;
}
