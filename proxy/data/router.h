/* Replica selection: admitted replicas only, with spare capacity, by the pool's balance. */
#ifndef PX_ROUTER_H
#define PX_ROUTER_H

#include "proxy/core/affinity.h"
#include "proxy/core/pool.h"
#include "proxy/core/replica.h"

/* Pick a replica that may serve (px_replica_serving) with spare capacity and take a slot on it
 * (balance per pool config), skipping `avoid`. An affinity pool follows aff's key when it has
 * one (aff may be NULL) and sets aff->result. NULL when none: *why tells whether none is
 * admitted (0) or all are at their limit (1). */
px_replica_t *px_router_pick(px_pool_t *p, const px_replica_t *avoid, px_affinity_t *aff, int *why);

#endif
