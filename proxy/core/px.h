/* The proxy's runtime: one px_t per process, holding the current configuration generation,
 * the listeners, and the replicas.
 *
 * Threads (docs/contributing/architecture.md): `workers` data-plane threads, each with its own
 * loop, listener, connections and upstream keep-alive pools, and the control thread (the
 * process's main thread) that owns generations, attestation, discovery, drift, reload, the
 * admin listener, the audit file and the OpenTelemetry exporter.
 *
 * Ownership:
 * - A generation (px_gen_t) owns one loaded cfg_t and the pools built from it. It is immutable
 *   once published: the control thread hands each worker a reference (px_worker.c), requests
 *   take one on the generation they started under, so a reload swaps it for new requests while
 *   in-flight ones finish on the old one (issue 7). Its last reference may drop on any thread;
 *   it is freed on the control thread.
 * - Replicas (px_replica_t) are refcounted and shared between generations when their
 *   definition is unchanged, so a reload keeps their attestation state and keep-alive pools.
 *   The control thread writes their state; workers read it (atomics, px_seqstr.h for text).
 * - Per worker (indexed by px_slot(): 0 the control thread, 1..workers): pool queues and
 *   metric caches, a replica's keep-alive pool and TLS context. Only that thread touches its
 *   slot. */
#ifndef PX_H
#define PX_H

#include <assert.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/buf.h"
#include "config/config.h"
#include "net/client.h"
#include "net/mailbox.h"
#include "net/resolve.h"
#include "net/server.h"
#include "proxy/core/affinity.h"
#include "proxy/core/metrics.h"
#include "proxy/core/seqstr.h"

typedef struct px_s px_t;
typedef struct px_gen_s px_gen_t;
typedef struct px_pool_s px_pool_t;
typedef struct px_replica_s px_replica_t;
typedef struct px_preq_s px_preq_t;
typedef struct px_worker_s px_worker_t;
typedef struct px_attest_ctx_s px_attest_ctx_t;
typedef struct px_shadow_ctx_s px_shadow_ctx_t;
typedef struct px_audit_s px_audit_t;
typedef struct px_discovery_s px_discovery_t;
typedef struct px_otel_ctx_s px_otel_ctx_t;

typedef enum {
    PX_REPLICA_PENDING = 0,
    PX_REPLICA_ADMITTED,
    PX_REPLICA_REJECTED,
    PX_REPLICA_UNREACHABLE,
    PX_REPLICA_QUARANTINED,
} px_replica_state_t;

extern const char *const px_replica_state_names[];

#define PX_MAX_REASONS 8

/* The reasons text workers log with a 503 (px_pool_why_unavailable). */
#define PX_WHY_BYTES 512

struct px_replica_s {
    atomic_int refs;
    net_mb_node_t free_node; /* the last reference dropped on a worker: freed on control */
    px_t *px;
    char *key; /* identity for reload reuse: everything in its definition */
    char *pool_name;
    char *name;
    cfg_url_t url;
    char *server_name;
    cfg_attest_t attest;
    struct sockaddr_storage addr;
    bool resolved;
    net_upstream_t *up;        /* the control thread's (attestation canary); NULL: unreachable */
    net_upstream_t *shadow_up; /* shadow copies use their own connections (lazily created) */
    struct net_tls_ctx_s *tls_ctx; /* https replica or agent: verification, SNI, sessions */
    /* Each worker's keep-alive pool and TLS client context, made by the worker on first use. */
    net_upstream_t **wup;
    struct net_tls_ctx_s **wtls;
    _Atomic px_replica_state_t state; /* written by the control thread only */
    char *reasons[PX_MAX_REASONS];    /* control thread only; workers read `why` */
    size_t nreasons;
    PX_SEQSTR(PX_WHY_BYTES) why; /* the reasons joined with "; " */
    /* Requests holding a slot, whichever worker sent them: taken with compare-and-swap so
     * max_inflight_per_replica holds across workers (px_router.c). */
    atomic_uint inflight;
    atomic_uint_fast64_t requests; /* lifetime requests sent */
    uint64_t aff_id;               /* identity in the affinity order: px_aff_hash(name) */
    uint64_t last_attested_at;     /* wall ms, 0 = never */
    char fingerprint[20]; /* the accepted identity it was admitted as (manifest "accept"); "" */
    PX_SEQSTR(24) wfingerprint; /* the same, for workers */
    PX_SEQSTR(136) engine_fp;   /* the engine fingerprint it attested ("" none), for workers */
    void *attest_state;         /* px_attest.c's per-replica state */
    px_series_t *m_admitted;    /* detproxy_replica_admitted */
    bool discovered;            /* added by DNS discovery */
    /* POST /admin/replicas/NAME/drain: out of rotation (in-flight requests finish), whatever
     * the attestation state, until /enable. Lives on the replica, so it survives reloads that
     * keep the replica's definition. */
    atomic_bool drained;
    /* Set by a worker that saw the replica fail a connection or answer with another engine
     * fingerprint, until the control thread has handled that (a mailbox hop later): no worker
     * picks it meanwhile, as the single-threaded proxy changed its state in the same call. */
    atomic_bool suspect;
    px_series_t *m_drained;              /* detproxy_replica_drained */
    px_replica_t *live_prev, *live_next; /* every replica alive (px_gen.c) */
};

/* One thread's share of a pool: touched by that thread only. */
typedef struct px_pool_slot_s {
    uint32_t rr;
    /* Admission queue (max_inflight_per_replica): FIFO; the worker's one timer watches the
     * heads' deadlines (px_proxy.c). */
    px_preq_t *q_head, *q_tail;
    uint32_t qlen;
    /* The head's ticket + 1 (0: empty), read by the other workers: a slot goes to the oldest
     * head across them, so one worker's queue cannot keep it while another's waits. */
    _Atomic uint64_t head_ticket;
    struct px_pool_slot_s *active_next; /* on the worker's list of non-empty queues */
    bool active;
    /* detproxy_requests_total series by (tenant, status, code): looked up once, then a
     * pointer compare per request. Tenant names belong to this generation's config and codes
     * are static strings, so pointers are stable for the pool's whole life. */
    struct {
        const char *tenant;
        const char *code;
        int status;
        px_series_t *s;
    } m_requests[16];
} px_pool_slot_t;

struct px_pool_s {
    px_gen_t *gen;
    const cfg_pool_t *cfg;
    const char *name;
    char fingerprint[20];
    px_replica_t **replicas; /* fixed once the generation is published */
    size_t nreplicas;
    size_t cap;
    px_pool_slot_t *slots;    /* px->nslots */
    atomic_uint waiting;      /* requests queued on every worker together */
    _Atomic uint64_t tickets; /* queue order across the workers (px_pool_slot_t.head_ticket) */
    px_series_t *m_duration;
    px_series_t *m_affinity[PX_AFF__COUNT]; /* detproxy_affinity_total by result (affinity) */
};

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

struct px_s {
    uv_loop_t *loop; /* the control thread's */
    px_gen_t *gen;   /* the control thread's current generation (workers: px_worker_gen) */
    net_server_t *admin;
    struct sockaddr_storage listen_bound; /* the client listener's address (every worker's) */
    net_server_shared_t listen_shared;    /* the workers' listeners' limits, counted together */
    net_mailbox_t mb;                     /* work for the control thread, from the workers */
    px_worker_t *workers;
    unsigned nworkers;
    unsigned nslots;   /* 1 + nworkers: per-thread arrays (px_slot()) */
    unsigned ndrained; /* workers whose listener drained (shutdown) */
    /* Requests queued for a slot, every pool of every generation on every worker: a slot a
     * request of one generation frees may be the one a request of another waits for. */
    atomic_uint queued;
    bool workers_joined; /* their loops are the control thread's to finish */
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t drain_timer;
    bool draining;
    int exit_code;
    uint64_t started_ms;
    px_attest_ctx_t *attest;
    px_shadow_ctx_t *shadow;
    px_audit_t *audit;
    px_discovery_t *discovery;
    px_otel_ctx_t *otel;
    struct net_tls_ctx_s *tls; /* client listener's server context (NULL: plaintext) */
};

/* ---- threads (px_worker.c) ---- */

/* This thread's slot: 0 on the control thread, 1..nworkers on the workers. */
static inline unsigned px_slot(void)
{
    return px_metrics_thread;
}
static inline bool px_on_control(void)
{
    return px_metrics_thread == 0;
}
/* The invariant "only the control thread does this", checked in every build (release ones
 * included: these are cold paths, and a violation is a data race waiting to happen). */
_Noreturn void px_thread_violation(const char *func);
#define PX_ASSERT_CONTROL()                                                                        \
    do {                                                                                           \
        if (!px_on_control())                                                                      \
            px_thread_violation(__func__);                                                         \
    } while (0)
/* The generation new requests on this thread start under. */
px_gen_t *px_current_gen(px_t *px);
/* This worker (NULL on the control thread). */
px_worker_t *px_worker_self(void);
uv_loop_t *px_worker_loop(px_worker_t *w);
/* The number of workers `workers: n` means (0: the CPUs in this process's affinity mask). */
unsigned px_workers_resolve(unsigned configured);
/* Start the workers' loops and listeners on a. 0, or the first listen error. */
int px_workers_start(px_t *px, const cfg_addr_t *a);
/* Hand g to every worker (each gets its own reference): reload, discovery. */
void px_workers_publish(px_t *px, px_gen_t *g);
/* The server TLS context of the client listener (NULL: plaintext), to every worker. */
void px_workers_set_tls(px_t *px, struct net_tls_ctx_s *c);
/* Stop accepting and finish in-flight requests; done() runs on the control thread once every
 * worker drained. */
void px_workers_drain(px_t *px, void (*done)(px_t *px));
/* Close every listener at once (the drain timed out). */
void px_workers_close(px_t *px);
/* Stop the loops and join the threads (after drain or close); frees their state. */
void px_workers_join(px_t *px);
/* Idle keep-alive connections of r on every worker are closed (state change, drain; TLS files
 * rotated: `fresh`, else NULL, is the new trust each worker's TLS context takes first). */
void px_workers_flush_replica(px_t *px, px_replica_t *r, struct net_tls_ctx_s *fresh);
/* A worker's upstream of replica r is no longer used: it frees it on its own loop. */
void px_workers_free_upstream(px_t *px, unsigned slot, net_upstream_t *u, struct net_tls_ctx_s *t);
/* A slot of a pool that has waiters elsewhere was freed: the other workers look. */
void px_workers_wake(px_t *px);
/* Sum over workers of open client connections / requests being handled. */
size_t px_workers_connections(px_t *px);
size_t px_workers_inflight(px_t *px);
/* The upstream of r this worker sends on (made on first use). */
net_upstream_t *px_replica_worker_up(px_replica_t *r, const px_gen_t *g);
/* Run fn(node) on the control thread (must-deliver: ownership goes with the node). */
void px_control_post(px_t *px, net_mb_node_t *n, net_mb_fn fn);
/* Same, dropped when the control thread is that far behind: false (caller counts it). */
bool px_control_try_post(px_t *px, net_mb_node_t *n, net_mb_fn fn);

/* ---- generations and replicas (px_gen.c) ---- */

/* Build a generation from a loaded config; reuses replicas of `prev` whose definition is
 * unchanged (prev may be NULL). Takes ownership of cfg. */
px_gen_t *px_gen_new(px_t *px, cfg_t *cfg, px_gen_t *prev);
/* The control thread's current generation, to change before publishing: itself while not yet
 * published, else a copy that replaces it (published generations are never mutated). */
px_gen_t *px_gen_writable(px_t *px);
/* Hand px->gen to the workers (once). */
void px_gen_publish(px_t *px);
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

/* Admitted, undrained and reachable (workers read it as the control thread writes it). */
static inline px_replica_state_t px_replica_state(const px_replica_t *r)
{
    return atomic_load_explicit(&r->state, memory_order_acquire);
}
/* ---- replicas (px_replica.c) ---- */

void px_replica_ref(px_replica_t *r);
/* Any thread; the last reference frees it on the control thread. */
void px_replica_unref(px_replica_t *r);
/* What defines a replica (a reload reuses one whose key is unchanged), and a new one. */
char *px_replica_key(const cfg_pool_t *p, const cfg_replica_t *d);
px_replica_t *px_replica_create(px_t *px, const cfg_t *cfg, const cfg_pool_t *p,
                                const cfg_replica_t *d, char *key);
/* A replica carried over by a reload reads its TLS files again. */
void px_replica_reload_tls(px_replica_t *r, const cfg_pool_t *p);
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

/* Pick an admitted replica with spare capacity and take a slot on it (balance per pool config),
 * skipping `avoid`. An affinity pool follows aff's key when it has one (aff may be NULL) and sets
 * aff->result. NULL when none: *why tells whether none is admitted (0) or all are at their limit
 * (1). */
px_replica_t *px_router_pick(px_pool_t *p, const px_replica_t *avoid, px_affinity_t *aff, int *why);
/* Take a slot on r under the pool's max_inflight_per_replica, atomically across workers: false
 * when r is at its limit. px_router_pick takes the slot of what it returns. */
bool px_replica_take_slot(const px_pool_t *p, px_replica_t *r);
void px_replica_put_slot(px_replica_t *r);
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
/* A slot on replica r was released: dispatch queued requests of its pool (this worker's). */
void px_proxy_slot_freed(px_pool_t *p);
/* The worker's queue timer / a wake from another worker: every non-empty queue of this worker. */
void px_proxy_queue_timer_cb(uv_timer_t *t);
void px_proxy_dispatch_waiting(void);
/* detproxy_overload_rejections_total{reason} (also the client server's 503 callback). */
void px_proxy_count_overload(const char *reason);
/* Release this thread's recycled request contexts (a loop thread that ends). */
void px_proxy_free_caches(void);

/* ---- admin (px_admin.c) ---- */

extern const net_handler_t px_admin_handler;

/* ---- metrics families, listener limits (px_main.c) ---- */

void px_metrics_declare(void);
/* The client listener's limits from cfg (at start and on every reload). */
void px_server_limits_for(const cfg_t *cfg, net_server_limits_t *l);

#endif
