/* The proxy's loop threads as every plane sees them: the control thread (slot 0, the
 * process's main thread) and the workers (slots 1..workers, data/worker.c), each with its own
 * loop and mailbox. Work for another thread goes through its mailbox (net/mailbox.h) and runs
 * there: state that belongs to one thread is only ever touched on it.
 *
 * Slots index every per-thread array (a pool's queues, a replica's keep-alive pools, metric
 * caches): only the thread of a slot touches that slot. */
#ifndef PX_THREAD_H
#define PX_THREAD_H

#include <stdbool.h>
#include <stddef.h>

#include <uv.h>

#include "net/client.h"
#include "net/mailbox.h"
#include "proxy/core/metrics.h"
#include "proxy/core/types.h"

struct px_thread_s {
    unsigned slot;
    uv_loop_t *loop;
    net_mailbox_t *mb; /* work for this thread */
    /* The generation new requests on this thread start under: a worker's own reference (it
     * adopts each published one); the control thread's is px->gen. */
    px_gen_t *gen;
    bool running; /* its loop runs: posts are delivered there (else px_thread_post says no) */
    /* Every upstream made on this loop (replicas' per-worker keep-alive pools), so its
     * shutdown can close them. */
    net_upstream_t **ups;
    size_t nups, capups;
};

/* This thread's slot: 0 on the control thread, 1..nworkers on the workers. */
static inline unsigned px_thread_slot(void)
{
    return px_metrics_thread;
}
static inline bool px_thread_on_control(void)
{
    return px_metrics_thread == 0;
}
/* The invariant "only the control thread does this", checked in every build (release ones
 * included: these are cold paths, and a violation is a data race waiting to happen). */
_Noreturn void px_thread_violation(const char *func);
#define PX_ASSERT_CONTROL()                                                                        \
    do {                                                                                           \
        if (!px_thread_on_control())                                                               \
            px_thread_violation(__func__);                                                         \
    } while (0)

/* Set up px's thread table for nworkers workers, slot 0 being the calling (control) thread
 * on px->loop: before any generation or replica is made. */
void px_thread_init(px_t *px, unsigned nworkers);
/* The thread of slot (NULL: no such worker yet). */
px_thread_t *px_thread_of(px_t *px, unsigned slot);
/* The calling thread. */
px_thread_t *px_thread_self(px_t *px);
/* The generation new requests on this thread start under. */
px_gen_t *px_thread_gen(px_t *px);
/* Run fn(n) on the thread of slot. False, with nothing posted (n is still the caller's),
 * when that thread's loop does not run: a worker never started, or stopped and joined. */
bool px_thread_post(px_t *px, unsigned slot, net_mb_node_t *n, net_mb_fn fn);
/* Run fn(n) on the control thread (must-deliver: ownership goes with the node). */
void px_thread_post_control(px_t *px, net_mb_node_t *n, net_mb_fn fn);
/* Same, dropped when the control thread is that far behind: false (the caller counts it). */
bool px_thread_try_post_control(px_t *px, net_mb_node_t *n, net_mb_fn fn);
/* An upstream made on thread t's loop, for its shutdown to close; forgotten again when it is
 * freed before that (false: not t's, or already closed by the shutdown). */
void px_thread_add_upstream(px_thread_t *t, net_upstream_t *u);
bool px_thread_forget_upstream(px_thread_t *t, net_upstream_t *u);

#endif
