/* The data plane's threads: `workers` event loops, each with its own client listener
 * (SO_REUSEPORT), connections, admission queues and upstream keep-alive pools. A worker knows
 * nothing of what it serves: it is started with an ops table (the request handler and the
 * thread's hooks) and runs what its mailbox brings. */
#ifndef PX_WORKER_H
#define PX_WORKER_H

#include <stdbool.h>
#include <stddef.h>

#include <uv.h>

#include "config/config.h"
#include "net/client.h"
#include "net/server.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"

/* What a worker runs; every member is required. */
typedef struct {
    const net_handler_t *handler;         /* client requests on its listener */
    void (*overload)(const char *reason); /* its listener refused a request 503 overloaded */
    void (*wake)(void);                   /* another worker freed a slot this one may want */
    void (*thread_exit)(void);            /* its loop ended: release the thread's caches */
    void (*stop)(void); /* the loop is to end: cancel what would keep it running */
} px_worker_ops_t;

/* This worker (NULL on the control thread). */
px_worker_t *px_worker_self(void);
/* The number of workers `workers: n` means (0: the CPUs in this process's affinity mask). */
unsigned px_workers_resolve(unsigned configured);
/* Start the workers' loops and listeners on a. 0, or the first listen error. */
int px_workers_start(px_t *px, const cfg_addr_t *a, const px_worker_ops_t *ops);
/* Hand px->gen to every worker (each gets its own reference), once: the generation is
 * published, immutable from then on (reload, discovery). */
void px_workers_publish(px_t *px);
/* The server TLS context of the client listener (NULL: plaintext), to every worker. */
void px_workers_set_tls(px_t *px, struct net_tls_ctx_s *c);
/* Stop accepting and finish in-flight requests; done() runs on the control thread once every
 * worker drained. */
void px_workers_drain(px_t *px, void (*done)(px_t *px));
/* Close every listener at once (the drain timed out). */
void px_workers_close(px_t *px);
/* This worker is closing its connections itself (the drain timed out, or the loop stops): a
 * request that ends now was cut by detproxy, not by its client. */
bool px_worker_closing(void);
/* Stop the loops and join the threads (after drain or close); frees their state. */
void px_workers_join(px_t *px);
/* A slot of a pool that has waiters elsewhere was freed: the other workers look. */
void px_workers_wake(px_t *px);
/* Sum over workers of open client connections / requests being handled. */
size_t px_workers_connections(px_t *px);
size_t px_workers_inflight(px_t *px);
/* The client listener's limits from cfg, as one listener counts them (at start and on every
 * reload). */
void px_worker_limits(const cfg_t *cfg, net_server_limits_t *l);
/* The upstream of r this worker sends on (made on first use). */
net_upstream_t *px_worker_upstream(px_replica_t *r, const px_gen_t *g);
/* This worker's TLS client context for https replica r (made on first use; NULL for a plain
 * one, or one whose context could not be made). */
struct net_tls_ctx_s *px_worker_tls(px_replica_t *r, const px_gen_t *g);
/* This worker's admission state (data/admission.c): its non-empty queues and their timer. */
px_pool_slot_t **px_worker_qactive(void);
uv_timer_t *px_worker_qtimer(void);
/* The timer of this worker's requests waiting for a check before a new connection (NULL off
 * the workers). */
uv_timer_t *px_worker_cwtimer(void);
/* detproxy_worker_requests_total of this worker. */
void px_worker_count_request(void);

#endif
