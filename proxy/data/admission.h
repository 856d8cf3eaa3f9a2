/* The admission queue: requests waiting for a slot on a pool whose replicas are all at
 * max_inflight_per_replica. Each worker queues its own requests (px_pool_slot_t, one per pool
 * per thread), FIFO, with one timer for the heads' deadlines; a freed slot goes to the oldest
 * head across the workers (tickets), so one worker's queue cannot keep it while another's
 * waits. The queue knows nothing of requests: it links an entry the request embeds and calls
 * back through the entry's ops. */
#ifndef PX_ADMISSION_H
#define PX_ADMISSION_H

#include <stdbool.h>
#include <stdint.h>

#include "net/client.h"
#include "net/fetch.h"
#include "proxy/core/affinity.h"
#include "proxy/core/pool.h"
#include "proxy/core/types.h"

typedef struct {
    /* A slot on r is the entry's (the pick took it); the entry has left the queue. */
    void (*granted)(px_admission_entry_t *e, px_replica_t *r);
    /* It waited the pool's queue_timeout_ms; it has left the queue. */
    void (*expired)(px_admission_entry_t *e);
    /* Every replica of the pool left the admitted set while it waited; it has left the queue. */
    void (*unavailable)(px_admission_entry_t *e);
} px_admission_ops_t;

/* A waiting request's place in its pool's queue on this worker. Zeroed when unused. */
struct px_admission_entry_s {
    px_admission_entry_t *next, *prev;
    px_pool_t *pool;
    px_affinity_t *aff; /* the request's routing key (NULL: none) */
    const px_admission_ops_t *ops;
    uint64_t wait_ms;  /* set by the caller: how long it may wait */
    uint64_t deadline; /* loop ms */
    uint64_t ticket;   /* its place in the pool's queue order across workers */
    bool ticketed;     /* ticket is set: kept when the entry is queued again */
    bool queued;
};

/* Queue e (pool, aff, ops and wait_ms set) on this worker's queue of e->pool: FIFO, but ahead
 * of every entry whose deadline comes later (a request back in the queue with less than the
 * whole queue_timeout_ms left has waited longer than they have). */
void px_admission_push(px_admission_entry_t *e);
/* Take e out of its queue, if it is in one. */
void px_admission_remove(px_admission_entry_t *e);
/* Hand free slots of p to this worker's queue, oldest first across the workers. True when the
 * queue is empty at the end. Callbacks run from here, and may free their entries. */
bool px_admission_serve(px_pool_t *p);
/* A slot on a replica of p was released: serve this worker's queue, and wake whoever else may
 * be waiting (other workers, this worker's queues of other generations). */
void px_admission_slot_freed(px_pool_t *p);
/* A slot taken with px_replica_take_spare_slot (one of detproxy's own requests: a copy, the
 * probe, the canary, an admin relay) goes back to r; any thread. A client queued for a slot of
 * its pool, on whichever worker, is woken to look. */
void px_admission_own_slot_done(px_t *px, px_replica_t *r);
/* Keep the slot the caller holds on r for exchange c, whose owner has gone while r's engine may
 * still be generating it: c becomes a drain in set for at most max_ms (net_creq_drain), and the
 * slot is freed, as px_admission_own_slot_done frees one, when the drain ends, whether or not r
 * is still there then (a reload may free it meanwhile). Any thread (set is the caller's); on
 * the control thread, also for r being freed. */
void px_admission_drain(px_t *px, px_replica_t *r, net_creq_t *c, net_drains_t *set,
                        uint64_t max_ms);
/* The same for a fetch (net_fetch_drain, with its rules on when it may be called). */
void px_admission_drain_fetch(px_t *px, px_replica_t *r, net_fetch_t *f, net_drains_t *set,
                              uint64_t max_ms);
/* Keep the slot the caller holds on r for max_ms with no exchange left to read: r closed the
 * connection after it took a whole request, and its engine may still be generating it (a
 * proxy in front of it cut only this side). Freed then as a drain's, or at
 * px_admission_holds_stop. Any thread, on its own loop. A drain that fails before its limit ends
 * the same way: a hold for the rest of its time. */
void px_admission_hold(px_t *px, px_replica_t *r, uint64_t max_ms);
/* End this thread's holds now (it stops), freeing their slots. */
void px_admission_holds_stop(void);
/* A generation was made (start, reload, discovery): every engine this process has just begun
 * to count that a single_sequence pool naming llama.cpp sends to gets a start check before
 * anything starts there, a hold asking its GET /slots (docs/configuration.md, "Deterministic
 * pools"). Control thread, before the generation reaches the workers. */
void px_admission_check_engines(px_t *px);
/* The same start check on engine e now, for `cause` (a literal, logged), when a single_sequence
 * pool naming llama.cpp sends there: a fleet member took e's key, and the member that held it
 * did not let go of it clean. Counted in e->checks, which its end brings down, with
 * e->check_unknown set when it did not find the engine clean; such an end also sets
 * e->closing (nothing new starts there). 1: begun; 0: a pool of the configuration in force
 * sends there, none naming llama.cpp (nothing to ask); -1: none sends there (a reload took it
 * away; a request queued under an earlier configuration may still wait for it). Control
 * thread. */
int px_admission_check_engine(px_t *px, px_engine_t *e, const char *cause);
/* A stop: start checks still asking end, logged and counted with result "stopped" (this process
 * will start nothing more; the next one makes its own). Control thread. */
void px_admission_start_checks_end(void);
/* Serve every non-empty queue of this worker (the wake-up of another worker's release). */
void px_admission_dispatch_waiting(void);

#endif
