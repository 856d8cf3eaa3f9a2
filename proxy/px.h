/* The proxy's runtime: one px_t per process, holding the current configuration generation,
 * the listeners, and the replicas.
 *
 * Ownership:
 * - A generation (px_gen_t) owns one loaded cfg_t and the pools built from it. Requests take
 *   a reference on the generation they started under, so a reload swaps px->gen for new
 *   requests while in-flight ones finish on the old one (issue 7).
 * - Replicas (px_replica_t) are refcounted and shared between generations when their
 *   definition is unchanged, so a reload keeps their attestation state and keep-alive pool.
 * - Everything here is touched only from the event loop thread. */
#ifndef PX_H
#define PX_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/buf.h"
#include "config/config.h"
#include "net/client.h"
#include "net/resolve.h"
#include "net/server.h"
#include "proxy/px_affinity.h"
#include "proxy/px_metrics.h"

typedef struct px_s px_t;
typedef struct px_gen_s px_gen_t;
typedef struct px_pool_s px_pool_t;
typedef struct px_replica_s px_replica_t;
typedef struct px_preq_s px_preq_t;

typedef enum {
    PX_REPLICA_PENDING = 0,
    PX_REPLICA_ADMITTED,
    PX_REPLICA_REJECTED,
    PX_REPLICA_UNREACHABLE,
    PX_REPLICA_QUARANTINED,
} px_replica_state_t;

extern const char *const px_replica_state_names[];

#define PX_MAX_REASONS 8

struct px_replica_s {
    int refs;
    px_t *px;
    char *key; /* identity for reload reuse: everything in its definition */
    char *pool_name;
    char *name;
    cfg_url_t url;
    char *server_name;
    cfg_attest_t attest;
    struct sockaddr_storage addr;
    bool resolved;
    net_upstream_t *up;
    net_upstream_t *shadow_up;     /* shadow copies use their own connections (lazily created) */
    struct net_tls_ctx_s *tls_ctx; /* https replica or agent: verification, SNI, sessions */
    px_replica_state_t state;
    char *reasons[PX_MAX_REASONS];
    size_t nreasons;
    uint32_t inflight;
    uint64_t requests;         /* lifetime requests sent */
    uint64_t aff_id;           /* identity in the affinity order: px_aff_hash(name) */
    uint64_t last_attested_at; /* wall ms, 0 = never */
    char fingerprint[20];    /* the accepted identity it was admitted as (manifest "accept"); "" */
    void *attest_state;      /* px_attest.c's per-replica state */
    px_series_t *m_admitted; /* detproxy_replica_admitted */
    bool discovered;         /* added by DNS discovery */
    /* POST /admin/replicas/NAME/drain: out of rotation (in-flight requests finish), whatever
     * the attestation state, until /enable. Lives on the replica, so it survives reloads that
     * keep the replica's definition. */
    bool drained;
    px_series_t *m_drained;              /* detproxy_replica_drained */
    px_replica_t *live_prev, *live_next; /* every replica alive (px_gen.c) */
};

struct px_pool_s {
    px_gen_t *gen;
    const cfg_pool_t *cfg;
    const char *name;
    char fingerprint[20];
    px_replica_t **replicas;
    size_t nreplicas;
    size_t cap;
    uint32_t rr;
    /* Admission queue (max_inflight_per_replica): FIFO, one timer for the head's deadline. */
    px_preq_t *q_head, *q_tail;
    uint32_t qlen;
    uv_timer_t qtimer;
    px_series_t *m_duration;
    px_series_t *m_affinity[PX_AFF__COUNT]; /* detproxy_affinity_total by result (affinity) */
    /* detproxy_requests_total series by (tenant, status, code): looked up once, then a
     * pointer compare per request. Tenant names belong to this generation's config and codes
     * are static strings, so pointers are stable for the pool's whole life. */
    struct {
        const char *tenant;
        const char *code;
        int status;
        px_series_t *s;
    } m_requests[16];
};

struct px_gen_s {
    int refs;
    px_t *px;
    cfg_t *cfg;
    px_pool_t *pools;
    size_t npools;
    int handles_open; /* pool timers still closing */
    /* detproxy_policy_overrides_total series by (tenant, param, action), same idea. */
    struct {
        const void *tenant;
        const char *param;
        int action;
        px_series_t *s;
    } m_overrides[64];
};

struct px_s {
    uv_loop_t *loop;
    px_gen_t *gen;
    net_server_t *proxy;
    net_server_t *admin;
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t drain_timer;
    bool draining;
    int exit_code;
    uint64_t started_ms;
    void *attest; /* px_attest.c */
    void *shadow; /* px_shadow.c */
    void *audit;  /* px_audit.c */
    void *discovery;
    void *otel;                /* px_otel.c */
    struct net_tls_ctx_s *tls; /* client listener's server context (NULL: plaintext) */
};

/* ---- generations and replicas (px_gen.c) ---- */

/* Build a generation from a loaded config; reuses replicas of `prev` whose definition is
 * unchanged (prev may be NULL). Takes ownership of cfg. */
px_gen_t *px_gen_new(px_t *px, cfg_t *cfg, px_gen_t *prev);
void px_gen_ref(px_gen_t *g);
void px_gen_unref(px_gen_t *g);
px_pool_t *px_gen_pool_by_name(px_gen_t *g, const char *name);
px_pool_t *px_gen_pool_for_model(px_gen_t *g, const char *model, size_t len);
/* Cached metric series (see the caches above). */
/* p NULL: a request refused before any pool was chosen (label pool="-"). code is static. */
px_series_t *px_pool_requests_series(px_pool_t *p, const char *tenant, int status,
                                     const char *code);
px_series_t *px_gen_override_series(px_gen_t *g, const cfg_tenant_t *t, const char *tenant,
                                    const char *param, int action, const char *action_name);

void px_replica_ref(px_replica_t *r);
void px_replica_unref(px_replica_t *r);
/* Change state with reasons (a NULL-terminated list of strings, copied); logs the transition
 * and updates detproxy_replica_admitted. */
void px_replica_set_state(px_replica_t *r, px_replica_state_t st, const char *const *reasons);
void px_replica_upstream_opts(const cfg_t *cfg, net_upstream_opts_t *o);
/* A new replica for pool p's definition, not yet in any pool (DNS discovery); one reference. */
px_replica_t *px_replica_new_detached(px_t *px, px_pool_t *p, const cfg_replica_t *def);
/* TLS for an upstream of replica r (its own URL, or its agent's): no-op for http://. */
void px_replica_upstream_tls(px_replica_t *r, net_upstream_t *u, const cfg_url_t *url);
/* Add (taking the caller's reference) / remove (dropping the pool's reference). */
void px_pool_push_replica(px_pool_t *p, px_replica_t *r);
void px_pool_remove_replica(px_pool_t *p, px_replica_t *r);

/* ---- routing (px_router.c) ---- */

/* Pick an admitted replica with spare capacity (balance per pool config), skipping `avoid`.
 * An affinity pool follows aff's key when it has one (aff may be NULL) and sets aff->result.
 * NULL when none: *why tells whether none is admitted (0) or all are at their limit (1). */
px_replica_t *px_router_pick(px_pool_t *p, const px_replica_t *avoid, px_affinity_t *aff, int *why);
/* Admitted and not drained: may get client requests (and takes part in affinity orders). */
bool px_replica_serving(const px_replica_t *r);
/* Drain (true) or enable (false) a replica; logs "replica_drain" and sets the gauge. */
void px_replica_set_drained(px_replica_t *r, bool drained);
/* Any admitted, undrained replica in the pool? */
bool px_pool_has_admitted(const px_pool_t *p);
/* Human-readable reasons why a pool has no admitted replica (for 503 and /readyz). */
void px_pool_why_unavailable(const px_pool_t *p, dp_buf_t *out);

/* ---- the proxy handler (px_proxy.c) ---- */

extern const net_handler_t px_proxy_handler;
/* A slot on replica r was released: dispatch queued requests of its pool. */
void px_proxy_slot_freed(px_pool_t *p);
void px_proxy_queue_timer_cb(uv_timer_t *t);
/* detproxy_overload_rejections_total{reason} (also the client server's 503 callback). */
void px_proxy_count_overload(const char *reason);
/* Release recycled request contexts (shutdown). */
void px_proxy_free_caches(void);

/* ---- admin (px_admin.c) ---- */

extern const net_handler_t px_admin_handler;

/* ---- metrics families, listener limits (px_main.c) ---- */

void px_metrics_declare(void);
/* The client listener's limits from cfg (at start and on every reload). */
void px_server_limits_for(const cfg_t *cfg, net_server_limits_t *l);

#endif
