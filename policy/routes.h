/* Route classification (docs/policy.md §2, "Routes and pass-through"): which requests
 * detproxy polices, which engine-native generation routes it refuses for every tenant, and
 * which pass through to the replica unpoliced. Pure: no libuv, no allocation.
 *
 * Paths are the request's normalised path without its query (net/server.c, docs/requests.md
 * §1); methods the token as the client sent it (methods are case-sensitive). */
#ifndef DP_POLICY_ROUTES_H
#define DP_POLICY_ROUTES_H

#include <stdbool.h>
#include <stddef.h>

#include "common/buf.h"
#include "config/config.h"

typedef enum {
    POLICY_CLASS_PASS = 0,    /* not detproxy's: pass through (policy_routes_passthrough) */
    POLICY_CLASS_COMPLETIONS, /* POST /v1/completions */
    POLICY_CLASS_CHAT,        /* POST /v1/chat/completions */
    POLICY_CLASS_RESPONSES,   /* POST /v1/responses */
    POLICY_CLASS_MODELS,      /* GET /v1/models, answered by detproxy */
    POLICY_CLASS_GENERATION,  /* an engine's own generation route: refused (404) */
} policy_class_t;

/* The class of a request. A trailing '/' names the same route (an ASGI replica redirects it). */
policy_class_t policy_routes_classify(dp_iovec_t method, dp_iovec_t path);

/* Whether a tenant's requests are constrained by its policy: any sampling rule, deny_params,
 * allow_params, audit or require_determinism. Such a tenant's pass-through is default-deny. */
bool policy_routes_tenant_policed(const cfg_tenant_t *t);

/* One passthrough entry against a request. */
bool policy_routes_entry_matches(const cfg_passthrough_t *e, dp_iovec_t method, dp_iovec_t path);

/* May a POLICY_CLASS_PASS request of tenant t go to pool p unpoliced? Always for a tenant
 * without a policy (t NULL counts as one) and for GET and HEAD; otherwise only when an entry of
 * p's `passthrough` list matches. */
bool policy_routes_passthrough(const cfg_pool_t *p, const cfg_tenant_t *t, dp_iovec_t method,
                               dp_iovec_t path);

#endif
