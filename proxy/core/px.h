/* The proxy's runtime: one px_t per process, holding the current configuration generation,
 * the listeners, the threads, and what each plane keeps for the process.
 *
 * Threads (docs/contributing/architecture.md): `workers` data-plane threads, each with its own
 * loop, listener, connections and upstream keep-alive pools, and the control thread (the
 * process's main thread) that owns generations, attestation, discovery, drift, reload, the
 * admin listener, the audit file and the OpenTelemetry exporter. The planes meet here: the data
 * plane tells the control plane what it saw through px_event_post (event.h), and reads what the
 * control plane publishes (generations, replica state). */
#ifndef PX_H
#define PX_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include <uv.h>

#include "net/mailbox.h"
#include "net/server.h"
#include "proxy/core/event.h"
#include "proxy/core/replica.h"
#include "proxy/core/thread.h"
#include "proxy/core/types.h"

struct px_s {
    uv_loop_t *loop; /* the control thread's */
    px_gen_t *gen;   /* the control thread's current generation (workers: px_thread_gen) */
    net_server_t *admin;
    struct sockaddr_storage listen_bound; /* the client listener's address (every worker's) */
    net_server_shared_t listen_shared;    /* the workers' listeners' limits, counted together */
    net_mailbox_t mb;                     /* work for the control thread, from the workers */
    px_thread_t control;                  /* slot 0 */
    px_thread_t **threads;                /* by slot (nslots); workers' from their start */
    px_worker_t *workers;
    unsigned nworkers;
    unsigned nslots;   /* 1 + nworkers: per-thread arrays (px_thread_slot()) */
    unsigned ndrained; /* workers whose listener drained (shutdown) */
    /* Requests queued for a slot, every pool of every generation on every worker: a slot a
     * request of one generation frees may be the one a request of another waits for. */
    atomic_uint queued;
    /* Requests holding a replica's slot while they wait for the check their new connection
     * needs (data/proxy.c): the check's verdict wakes the workers for them too. */
    atomic_uint conn_waiting;
    bool workers_joined; /* their loops are the control thread's to finish */
    uv_signal_t sig_term, sig_int, sig_hup;
    uv_timer_t drain_timer;
    uv_timer_t engines_timer; /* a graceful stop waits for one-at-a-time engines to go idle */
    bool draining, finished;
    int exit_code;
    uint64_t started_ms;
    /* Set by the control plane at start: */
    px_replica_hooks_t replica_hooks;
    px_event_cb on_event;
    px_attest_ctx_t *attest;
    px_shadow_ctx_t *shadow;
    px_audit_t *audit;
    /* Writers a reload turned off (px_audit_retire), holding nothing once their lines are
     * written; freed at exit, since a worker may still read the writable flag of the one it
     * last saw as `audit` (data/hooks.c). */
    px_audit_t **audit_retired;
    size_t naudit_retired;
    px_discovery_t *discovery;
    px_otel_ctx_t *otel;
    px_fleet_t *fleet;         /* NULL without a fleet section */
    struct net_tls_ctx_s *tls; /* client listener's server context (NULL: plaintext) */
};

#endif
