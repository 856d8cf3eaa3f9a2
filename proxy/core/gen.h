/* A configuration generation: one loaded cfg_t and the pools built from it.
 *
 * Immutable once published: the control thread hands each worker a reference, and requests
 * take one on the generation they started under, so a reload swaps it for new requests while
 * in-flight ones finish on the old one. Its last reference may drop on any thread; it is freed
 * on the control thread. */
#ifndef PX_GEN_H
#define PX_GEN_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "config/config.h"
#include "net/mailbox.h"
#include "proxy/core/metrics.h"
#include "proxy/core/pool.h"
#include "proxy/core/types.h"

typedef struct {
    const void *tenant;
    const char *param;
    int action;
    px_series_t *s;
} px_override_series_t;

struct px_gen_s {
    atomic_int refs;
    net_mb_node_t free_node; /* the last reference dropped on a worker: freed on control */
    px_t *px;
    cfg_t *cfg;
    int *cfg_refs;  /* generations sharing cfg (discovery clones one; control thread only) */
    bool published; /* handed to the workers: immutable from then on */
    px_pool_t *pools;
    size_t npools;
    /* detproxy_policy_overrides_total series by (tenant, param, action), per slot, same idea. */
    px_override_series_t (*m_overrides)[64];
};

/* Build a generation from a loaded config. A replica whose definition is that of a replica
 * still alive (in `prev`, or held only by requests in flight) is that replica; pools go on with
 * prev's queue tickets (prev may be NULL). Takes ownership of cfg. */
px_gen_t *px_gen_new(px_t *px, cfg_t *cfg, px_gen_t *prev);
/* The control thread's current generation, to change before publishing: itself while not yet
 * published, else a copy that replaces it (published generations are never mutated). */
px_gen_t *px_gen_writable(px_t *px);
void px_gen_ref(px_gen_t *g);
void px_gen_unref(px_gen_t *g);
px_pool_t *px_gen_pool_by_name(const px_gen_t *g, const char *name);
px_pool_t *px_gen_pool_for_model(px_gen_t *g, const char *model, size_t len);
/* This thread's detproxy_policy_overrides_total series (cached, see m_overrides). */
px_series_t *px_gen_override_series(px_gen_t *g, const cfg_tenant_t *t, const char *tenant,
                                    const char *param, int action, const char *action_name);

#endif
