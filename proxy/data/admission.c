/* The admission queue (admission.h). Per worker: a FIFO per pool (px_pool_slot_t) and one list
 * of the non-empty ones, watched by the worker's one timer at the earliest head deadline. */
#include <assert.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attest/adapters.h"
#include "common/list.h"
#include "common/log.h"
#include "common/util.h"
#include "net/fetch.h"
#include "net/tls.h"
#include "policy/policy.h"
#include "proxy/core/gen.h"
#include "proxy/core/px.h"
#include "proxy/core/self.h"
#include "proxy/data/admission.h"
#include "proxy/data/router.h"
#include "proxy/data/worker.h"

static px_pool_slot_t *qslot(px_pool_t *p)
{
    return &p->slots[px_thread_slot()];
}

static void deactivate(px_pool_slot_t *sl)
{
    for (px_pool_slot_t **pp = px_worker_qactive(); *pp; pp = &(*pp)->active_next) {
        if (*pp == sl) {
            *pp = sl->active_next;
            break;
        }
    }
    sl->active_next = NULL;
    sl->active = false;
}

static void timer_cb(uv_timer_t *t);

/* The worker's one timer, at the earliest head deadline of its non-empty queues. */
static void queue_arm(void)
{
    uv_timer_t *t = px_worker_qtimer();
    uint64_t first = UINT64_MAX;
    for (px_pool_slot_t *sl = *px_worker_qactive(); sl; sl = sl->active_next)
        if (sl->q_head->deadline < first)
            first = sl->q_head->deadline;
    if (first == UINT64_MAX) {
        uv_timer_stop(t);
        return;
    }
    uint64_t now = uv_now(t->loop);
    uv_timer_start(t, timer_cb, first > now ? first - now : 0, 0);
}

static void publish_head(px_pool_slot_t *sl)
{
    atomic_store_explicit(&sl->head_ticket, sl->q_head ? sl->q_head->ticket + 1 : 0,
                          memory_order_relaxed);
}

void px_admission_remove(px_admission_entry_t *e)
{
    if (!e->queued)
        return;
    px_pool_t *p = e->pool;
    px_pool_slot_t *sl = qslot(p);
    assert(sl->qlen > 0 && sl->q_head != NULL);
    DP_TLIST_UNLINK(sl->q_head, sl->q_tail, e, next, prev);
    e->queued = false;
    sl->qlen--;
    publish_head(sl);
    atomic_fetch_sub(&p->waiting, 1);
    atomic_fetch_sub(&p->gen->px->queued, 1);
    if (sl->q_head == NULL) {
        deactivate(sl);
        queue_arm();
    }
}

void px_admission_push(px_admission_entry_t *e)
{
    assert(!e->queued && e->pool != NULL && e->ops != NULL);
    px_pool_t *p = e->pool;
    px_pool_slot_t *sl = qslot(p);
    e->queued = true;
    e->deadline = uv_now(px_worker_qtimer()->loop) + e->wait_ms;
    /* Back in the queue (routed again, retried), a request keeps its place in the order
     * across workers. */
    if (!e->ticketed) {
        e->ticket = atomic_fetch_add_explicit(&p->tickets, 1, memory_order_relaxed);
        e->ticketed = true;
    }
    /* The timer watches heads only, so the queue stays in deadline order. */
    px_admission_entry_t *after = sl->q_tail;
    while (after && after->deadline > e->deadline)
        after = after->prev;
    DP_TLIST_INSERT_AFTER(sl->q_head, sl->q_tail, after, e, next, prev);
    sl->qlen++;
    if (sl->q_head == e)
        publish_head(sl);
    atomic_fetch_add(&p->waiting, 1); /* seq_cst: pairs with px_admission_slot_freed's load */
    atomic_fetch_add(&p->gen->px->queued, 1);
    if (!sl->active) {
        sl->active = true;
        sl->active_next = *px_worker_qactive();
        *px_worker_qactive() = sl;
        queue_arm();
    } else if (sl->q_head == e) {
        queue_arm(); /* ahead of the old head: its deadline may be the earliest now */
    }
}

static void timer_cb(uv_timer_t *t)
{
    uint64_t now = uv_now(t->loop);
    /* One expired head at a time: failing it may empty its queue (and unlink it). */
    for (;;) {
        px_admission_entry_t *e = NULL;
        for (px_pool_slot_t *sl = *px_worker_qactive(); sl && !e; sl = sl->active_next)
            if (sl->q_head->deadline <= now)
                e = sl->q_head;
        if (e == NULL)
            break;
        px_admission_remove(e);
        e->ops->expired(e);
    }
    queue_arm();
}

/* Does another worker have a request for p that queued before this worker's head? */
static bool older_head_elsewhere(const px_pool_t *p, const px_pool_slot_t *sl)
{
    uint64_t mine = sl->q_head->ticket + 1;
    for (unsigned i = 1; i < p->gen->px->nslots; i++) {
        uint64_t t = atomic_load_explicit(&p->slots[i].head_ticket, memory_order_relaxed);
        if (&p->slots[i] != sl && t != 0 && t < mine)
            return true;
    }
    return false;
}

/* When another worker's head queued earlier, it is woken to take the slot and this queue
 * waits. */
bool px_admission_serve(px_pool_t *p)
{
    px_pool_slot_t *sl = qslot(p);
    while (sl->q_head) {
        if (older_head_elsewhere(p, sl)) {
            px_workers_wake(p->gen->px);
            return false;
        }
        int why;
        px_admission_entry_t *e = sl->q_head;
        px_replica_t *r = px_router_pick(p, NULL, e->aff, &why);
        if (r == NULL) {
            if (why != 0)
                return false;
            /* Every replica left the admitted set while requests waited. */
            px_admission_remove(e);
            e->ops->unavailable(e);
            continue;
        }
        px_admission_remove(e);
        e->ops->granted(e, r);
    }
    return true;
}

void px_admission_slot_freed(px_pool_t *p)
{
    px_t *px = p->gen->px;
    if (!px_admission_serve(p))
        return;
    /* Nothing waits here for this pool, but maybe on another worker, or for this pool's
     * replicas under another generation (a reload while requests queue): let them look. With
     * the release (a seq_cst decrement) and these seq_cst loads against px_admission_push's
     * increments and the dispatcher's px_admission_serve, a waiter either sees the free slot
     * or is seen. */
    if (atomic_load(&p->waiting) > 0 || atomic_load(&px->queued) > 0) {
        px_workers_wake(px);
        if (px_worker_self() && *px_worker_qactive())
            px_admission_dispatch_waiting(); /* this worker's queues of other generations */
    }
}

/* A slot was freed outside any pool's own accounting: whoever queues for one looks again (the
 * other workers woken, this worker's queues served when it is one). */
static void own_slot_freed(px_t *px)
{
    if (atomic_load(&px->queued) == 0)
        return;
    px_workers_wake(px);
    if (px_worker_self() && *px_worker_qactive())
        px_admission_dispatch_waiting();
}

void px_admission_own_slot_done(px_t *px, px_replica_t *r)
{
    px_replica_put_slot(r);
    own_slot_freed(px);
}

/* On the control thread the slot count itself is held: a replica being freed (its checks'
 * requests kept as drains) can be referenced no more, and the count is control's to free. A
 * worker holds the replica, which it has a reference to (its request's) and whose last
 * reference may drop there. */
typedef struct {
    px_t *px;
    px_slots_t *slots; /* control thread */
    px_replica_t *r;   /* a worker */
    char *pool;     /* the held request's, by name: it asks the engine first (GET /slots, below) */
    uint64_t until; /* a drain's: the end of its time (loop ms) */
} kept_slot_t;

static kept_slot_t *keep_slot(px_t *px, px_replica_t *r)
{
    kept_slot_t *k = dp_xcalloc(1, sizeof(*k));
    k->px = px;
    if (px_thread_on_control()) {
        k->slots = px_replica_slots_ref(r);
    } else {
        k->r = r;
        px_replica_ref(r);
    }
    k->pool = dp_xstrdup(r->pool_name);
    return k;
}

static const px_slots_t *kept_slots(const kept_slot_t *k)
{
    return k->slots ? k->slots : k->r->slots;
}

/* A replica of p on engine e that a look can reach (resolved; an https one with its TLS
 * context), if p names llama.cpp. */
static px_replica_t *llama_on(const px_pool_t *p, const px_engine_t *e)
{
    if (!policy_pool_no_cache_prompt(p->cfg))
        return NULL;
    for (size_t i = 0; i < p->nreplicas; i++) {
        px_replica_t *q = p->replicas[i];
        if (q->slots->eng == e && q->resolved && (!q->url.tls || q->tls_ctx))
            return q;
    }
    return NULL;
}

/* How to ask the engine k holds a slot of, as the configuration in force on this thread has
 * it: a pool that names llama.cpp and sends to this engine, the held request's own first,
 * gives the replica (its address, path and Host) and its API key, each the one that pool
 * uses there. NULL: none does now (a reload took llama.cpp away, or gave the name to a pool
 * of another engine, whose key is not this engine's). */
static px_replica_t *look_via(const kept_slot_t *k, const px_gen_t **gen, const cfg_pool_t **pc)
{
    px_gen_t *g = px_thread_gen(k->px);
    if (g == NULL)
        return NULL;
    const px_engine_t *e = kept_slots(k)->eng;
    px_pool_t *own = px_gen_pool_by_name(g, k->pool);
    px_replica_t *q = own ? llama_on(own, e) : NULL;
    for (size_t i = 0; q == NULL && i < g->npools; i++) {
        q = llama_on(&g->pools[i], e);
        own = &g->pools[i];
    }
    if (q) {
        *gen = g;
        *pc = own->cfg;
    }
    return q;
}

/* The TLS context a look at https replica q goes with on this thread (NULL: plain HTTP): the
 * control thread's own, or this worker's, as the replica's exchanges here use. */
static net_tls_ctx_t *look_tls(px_replica_t *q, const px_gen_t *g)
{
    if (!q->url.tls)
        return NULL;
    return px_thread_on_control() ? q->tls_ctx : px_worker_tls(q, g);
}

static void kept_slot_done(void *kept)
{
    kept_slot_t *k = kept;
    if (k->slots) {
        px_replica_slots_put_unref(k->slots);
    } else {
        px_replica_put_slot(k->r);
        px_replica_unref(k->r);
    }
    own_slot_freed(k->px);
    free(k->pool);
    free(k);
}

/* A slot kept with no exchange left to read waits out the drain's time: nothing else says
 * when the engine stops. Except on llama.cpp, which lists what its slots do (`GET /slots`):
 * the hold asks, on a connection of its own (the look is no sequence, and the engine answers
 * it between two steps of what it runs), HOLD_FIRST_LOOK_MS after it began and every
 * HOLD_LOOK_MS after, and once HOLD_IDLE_LOOKS answers in a row list no slot processing, what
 * it was kept for has ended (or the engine restarted without it) and the slot is freed. The
 * first look waits for a request the engine took just before the cut to reach a slot: it
 * tokenizes the prompt first, ~0.3 s per million tokens on llama.cpp 0.7.0 here, more than
 * any context holds. An answer of another shape, an error (`--no-slots` is 501; an API key
 * the engine refuses is 401), none, or one not whole within HOLD_LOOK_TIMEOUT_MS says nothing,
 * and so does a look with no pool to ask through (look_via): the hold runs on, and asks half
 * as often after each (down to every HOLD_LOOK_MAX_MS). docs/configuration.md, "Deterministic
 * pools". */
#define HOLD_FIRST_LOOK_MS 1000
#define HOLD_LOOK_MS 250
#define HOLD_LOOK_MAX_MS 4000 /* an engine that says nothing is asked less and less often */
#define HOLD_IDLE_LOOKS 2
#define HOLD_LOOK_TIMEOUT_MS 2000
#define HOLD_LOOK_MAX_BYTES (1u << 20) /* ~350 bytes a slot */

/* A start check (px_admission_check_engines) is the same hold, taken on an engine this process
 * has just begun to count, before anything starts there: an earlier process killed mid-answer
 * (SIGKILL, out of memory) may have left llama.cpp generating a request whose connection
 * closed, which it finishes. Its first look waits as a hold's does: a request that process
 * sent just before it died may still be on its way to a slot. An engine whose answers say
 * nothing START_SILENT_LOOKS times in a row ends it, with a warning: one not listening (a
 * refused connection) cannot be sent anything, one still loading its model runs nothing, and
 * one started with `--no-slots` cannot tell. An engine that takes the connection but does not
 * answer in time (stalled, or paused), or that cannot be reached (a connect or TLS handshake
 * that times out or fails) is not silent: it may run the request once it goes on, and it is
 * asked until it answers. */
#define START_SILENT_LOOKS 3
enum { LOOK_BUSY = 0, LOOK_IDLE = 1, LOOK_SILENT = -1, LOOK_NONE = -2, LOOK_STALLED = -3 };

/* px_admission_hold's: a timer that frees a kept slot, on its thread's list. */
typedef struct hold_s {
    uv_timer_t timer; /* the end of the drain's time */
    uv_timer_t look;  /* the next GET /slots */
    kept_slot_t *k;
    net_upstream_t *up;              /* the looks' own connection (NULL until the first) ... */
    struct sockaddr_storage up_addr; /* ... to this address ... */
    bool up_tls;                     /* ... over TLS (then made again for every look) */
    net_fetch_t *f;                  /* the look in flight */
    unsigned idle;                   /* answers in a row that listed no slot processing */
    unsigned silent;                 /* answers in a row that said nothing */
    uint64_t every;                  /* ms to the next look */
    bool start;                      /* a start check, ... */
    const char *cause;               /* ... why it was taken (a literal) ... */
    bool gates;                      /* ... and, not ending clean, nothing new starts there */
    bool engine_idle;                /* the timer was moved up for that ... */
    bool unanswered;                 /* ... or for START_SILENT_LOOKS silent answers ... */
    bool stopped;                    /* ... or the process stops */
    bool heard;                      /* a look got an answer that said nothing, or a refusal */
    unsigned open;                   /* handles not closed yet */
    uint64_t since;
    struct hold_s *next, *prev;
} hold_t;

static _Thread_local hold_t *t_holds;

static hold_t *hold_new(kept_slot_t *k, uint64_t max_ms);

/* A drain's end: read whole (what it was kept for has ended), over its time or ended by the
 * process's stop (what it was kept for may run on), or failed before its limit (the replica
 * closed or cut the answer, or it went silent). That says nothing of the engine, which may be
 * generating it still (a proxy in front of it cut only this side): the slot stays kept for the
 * rest of the drain's time, as a hold. */
static void kept_slot_drained(void *kept, uint64_t left_ms)
{
    kept_slot_t *k = kept;
    px_engine_t *e = kept_slots(k)->eng;
    bool stopped = left_ms == NET_DRAIN_STOPPED;
    bool ran_out = left_ms == 0 && uv_now(px_thread_self(k->px)->loop) >= k->until;
    const char *end = stopped ? "stopped" : left_ms > 0 ? "cut" : ran_out ? "time" : "whole";
    px_metrics_add(
        px_metrics_get("detproxy_slot_drains_total", "engine", e->label, "end", end, NULL), 1);
    if (left_ms > 0 && !stopped) {
        hold_new(k, left_ms);
        return;
    }
    if (stopped || ran_out)
        atomic_store(&e->unsure, true);
    if (ran_out) {
        dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "slot_drain_timeout");
        if (w) {
            dp_jw_str(w, "engine", e->label);
            dp_jw_str(w, "pool", k->pool);
            dp_jw_str(w, "reason",
                      "an answer nobody reads was not whole within the drain's time: "
                      "the engine may still generate it");
            dp_log_end(w);
        }
    }
    kept_slot_done(k);
}

static kept_slot_t *keep_slot_for(px_t *px, px_replica_t *r, uint64_t max_ms)
{
    kept_slot_t *k = keep_slot(px, r);
    k->until = uv_now(px_thread_self(px)->loop) + max_ms;
    return k;
}

void px_admission_drain(px_t *px, px_replica_t *r, net_creq_t *c, net_drains_t *set,
                        uint64_t max_ms)
{
    net_creq_drain(c, set, max_ms, kept_slot_drained, keep_slot_for(px, r, max_ms));
}

static void hold_closed(uv_handle_t *h)
{
    hold_t *hold = h->data;
    if (--hold->open == 0)
        free(hold);
}

static void hold_end(hold_t *h)
{
    if (h->gates) {
        /* Known clean: the engine listed nothing processing, or said nothing of its slots
         * itself (not merely none left to ask it through). Otherwise cut short or timed out:
         * nothing starts there with its slot (a request of an earlier generation may wait for
         * it), and the member lets the key go for whoever takes it next to check again. */
        px_engine_t *e = kept_slots(h->k)->eng;
        if (!h->engine_idle && !(h->unanswered && h->heard)) {
            e->check_unknown = true;
            atomic_store(&e->closing, true);
        }
        e->checks--;
    }
    DP_LIST_UNLINK(t_holds, h, next, prev);
    if (h->f)
        net_fetch_cancel(h->f);
    if (h->up)
        net_upstream_free(h->up);
    kept_slot_done(h->k);
    uv_close((uv_handle_t *)&h->timer, hold_closed);
    uv_close((uv_handle_t *)&h->look, hold_closed);
}

/* A start check's end: counted and logged (a silent engine at warn: nothing was known). */
static void start_checked(hold_t *h, const px_engine_t *e, uint64_t now)
{
    const char *result = h->engine_idle  ? "idle"
                         : h->unanswered ? "unanswered"
                         : h->stopped    ? "stopped"
                                         : "time";
    px_metrics_add(px_metrics_get("detproxy_engine_start_checks_total", "engine", e->label,
                                  "result", result, NULL),
                   1);
    dp_jw_t *w = dp_log_begin(h->unanswered ? DP_LOG_WARN : DP_LOG_INFO, "engine_start_check");
    if (w) {
        dp_jw_str(w, "engine", e->label);
        dp_jw_str(w, "result", result);
        dp_jw_str(w, "cause", h->cause);
        dp_jw_uint(w, "held_ms", now - h->since);
        if (h->unanswered)
            dp_jw_str(w, "reason",
                      "its /slots said nothing: whether it still runs a generation an earlier "
                      "process left is not known");
        else if (h->stopped)
            dp_jw_str(w, "reason", "this process stops: nothing of it starts there any more");
        dp_log_end(w);
    }
}

static void hold_due(uv_timer_t *t)
{
    hold_t *h = t->data;
    const px_engine_t *e = kept_slots(h->k)->eng;
    if (h->start) {
        start_checked(h, e, uv_now(t->loop));
        hold_end(h);
        return;
    }
    const char *end = h->engine_idle ? "engine_idle" : "time";
    if (!h->engine_idle) /* what it was kept for may run on (before the slot is freed) */
        atomic_store(&kept_slots(h->k)->eng->unsure, true);
    px_metrics_add(
        px_metrics_get("detproxy_slot_holds_total", "engine", e->label, "end", end, NULL), 1);
    if (h->engine_idle) {
        dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "slot_hold_released");
        if (w) {
            dp_jw_str(w, "engine", e->label);
            dp_jw_uint(w, "held_ms", uv_now(t->loop) - h->since);
            dp_jw_str(w, "reason", "the engine lists no slot processing");
            dp_log_end(w);
        }
    }
    hold_end(h);
}

static void look_due(uv_timer_t *t);

/* What a look learned: LOOK_IDLE, LOOK_BUSY, LOOK_SILENT (an answer that says nothing, or a
 * refused connection), LOOK_NONE (no pool to ask through), LOOK_STALLED (no whole answer in
 * time, or none: the engine unseen). */
static void look_told(hold_t *h, int idle)
{
    h->idle = idle == LOOK_IDLE ? h->idle + 1 : 0;
    /* A start check with none to ask through: no pool sends there now (a reload took the
     * engine away), or can reach it (its TLS context could not be made). */
    h->silent = idle == LOOK_SILENT || (idle == LOOK_NONE && h->start) ? h->silent + 1 : 0;
    h->heard |= idle == LOOK_SILENT;
    h->engine_idle = h->idle >= HOLD_IDLE_LOOKS;
    h->unanswered = h->start && h->silent >= START_SILENT_LOOKS;
    if (h->engine_idle || h->unanswered) {
        uv_timer_start(&h->timer, hold_due, 0, 0); /* outside the look's own callback */
        return;
    }
    if (idle >= 0)
        h->every = HOLD_LOOK_MS;
    else if (h->every < HOLD_LOOK_MAX_MS)
        h->every *= 2;
    uv_timer_start(&h->look, look_due, h->every, 0);
}

static void looked(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                   const char *detail, void *data)
{
    (void)f;
    hold_t *h = data;
    h->f = NULL;
    uv_timer_stop(&h->look); /* its deadline */
    /* Silent: an answer that says nothing, or nothing listening there. Any other failure (a
     * connect or TLS handshake that times out or fails, a connection closed unanswered) leaves
     * the engine unseen: it may be there, stalled or cut off. */
    bool refused =
        err == NET_UP_CONNECT && detail && strcmp(detail, uv_strerror(UV_ECONNREFUSED)) == 0;
    look_told(h, status == 200 && body   ? attest_llamacpp_slots_idle(body->base, body->len)
                 : status > 0 || refused ? LOOK_SILENT
                                         : LOOK_STALLED);
}

/* A look still going at HOLD_LOOK_TIMEOUT_MS (an answer that drips in, each byte within the
 * idle timeout) says nothing. */
static void look_late(uv_timer_t *t)
{
    hold_t *h = t->data;
    net_fetch_cancel(h->f);
    h->f = NULL;
    look_told(h, LOOK_STALLED);
}

static void look_due(uv_timer_t *t)
{
    hold_t *h = t->data;
    const px_gen_t *g = NULL;
    const cfg_pool_t *pc = NULL;
    px_replica_t *q = look_via(h->k, &g, &pc);
    net_tls_ctx_t *tls = q ? look_tls(q, g) : NULL;
    if (q == NULL || (q->url.tls && tls == NULL)) {
        look_told(h, LOOK_NONE); /* none to ask through now; a reload may bring one back */
        return;
    }
    /* Over TLS each look is a new handshake, with the context and name in force: a reload that
     * withdrew trust in the engine (or replaced the client certificate) replaces the context's
     * contents, not the pointer, and must not be outlived by a connection verified before it.
     * The plain HTTP connection is kept while the address stays. */
    if (h->up == NULL || tls || h->up_tls || memcmp(&h->up_addr, &q->addr, sizeof(q->addr)) != 0) {
        net_upstream_opts_t uo = {.connect_timeout_ms = HOLD_LOOK_TIMEOUT_MS,
                                  .first_byte_timeout_ms = HOLD_LOOK_TIMEOUT_MS,
                                  .idle_timeout_ms = HOLD_LOOK_TIMEOUT_MS,
                                  .max_idle = 1};
        if (h->up)
            net_upstream_free(h->up);
        h->up = net_upstream_new(t->loop, (const struct sockaddr *)&q->addr, &uo);
        h->up_addr = q->addr; /* the key goes where the pool that gives it sends */
        h->up_tls = tls != NULL;
        if (tls) /* checked as that pool's exchanges check the engine */
            net_upstream_set_tls(h->up, tls, q->server_name ? q->server_name : q->url.host);
    }
    dp_buf_t target = {0};
    dp_buf_printf(&target, "%s/slots", q->url.path); /* the path has no trailing slash */
    net_fetch_opts_t o = {.method = "GET",
                          .hostport = q->url.hostport,
                          .target = target.base,
                          .bearer = pc->api_key,
                          .max_bytes = HOLD_LOOK_MAX_BYTES,
                          .via = px_self_via_line(NULL)};
    h->f = net_fetch(h->up, &o, looked, h); /* which answers from the loop, later */
    dp_buf_free(&target);
    uv_timer_start(&h->look, look_late, HOLD_LOOK_TIMEOUT_MS, 0);
}

/* On the calling thread's loop, in its list. */
static hold_t *hold_new(kept_slot_t *k, uint64_t max_ms)
{
    hold_t *h = dp_xcalloc(1, sizeof(*h));
    uv_loop_t *loop = px_thread_self(k->px)->loop;
    h->k = k;
    h->since = uv_now(loop);
    uv_timer_init(loop, &h->timer);
    uv_timer_init(loop, &h->look);
    h->timer.data = h->look.data = h;
    h->open = 2;
    uv_timer_start(&h->timer, hold_due, max_ms, 0);
    if (max_ms > HOLD_FIRST_LOOK_MS + HOLD_LOOK_MS) {
        h->every = HOLD_LOOK_MS;
        uv_timer_start(&h->look, look_due, HOLD_FIRST_LOOK_MS, 0);
    }
    DP_LIST_PUSH(t_holds, h, next, prev);
    return h;
}

void px_admission_hold(px_t *px, px_replica_t *r, uint64_t max_ms)
{
    hold_new(keep_slot(px, r), max_ms);
}

/* Is r a replica of a single_sequence pool naming llama.cpp (one that a start check asks)? */
static bool llama_single(px_t *px, const px_replica_t *r)
{
    const px_pool_t *p = r->slots->one ? px_gen_pool_by_name(px->gen, r->pool_name) : NULL;
    return p != NULL && policy_pool_no_cache_prompt(p->cfg);
}

static hold_t *start_check(px_t *px, px_replica_t *r, const char *cause)
{
    px_replica_take_first_slot(r);
    hold_t *h = hold_new(keep_slot(px, r), policy_abandoned_drain_ms(&px->gen->cfg->limits));
    h->start = true;
    h->cause = cause;
    return h;
}

/* Each engine new to this process (fresh) that a single_sequence pool naming llama.cpp sends to
 * gets a start check; every other fresh engine is simply seen. */
static void check_fresh(px_replica_t *r, void *data)
{
    px_t *px = data;
    px_engine_t *e = r->slots->eng;
    if (!e->fresh || !llama_single(px, r))
        return;
    px_replica_engine_seen(e);
    start_check(px, r, "new to this process");
}

static void seen(px_replica_t *r, void *data)
{
    (void)data;
    px_replica_engine_seen(r->slots->eng);
}

void px_admission_check_engines(px_t *px)
{
    px_replica_each_live(check_fresh, px);
    px_replica_each_live(seen, NULL);
}

typedef struct {
    px_t *px;
    px_engine_t *e;
    const char *cause;
    int r;
} check_one_t;

static void check_one(px_replica_t *r, void *data)
{
    check_one_t *c = data;
    if (c->r > 0 || r->slots->eng != c->e || !px_gen_pool_by_name(c->px->gen, r->pool_name))
        return;
    c->r = 0;
    if (llama_single(c->px, r)) {
        start_check(c->px, r, c->cause)->gates = true;
        if (c->e->checks++ == 0)
            c->e->check_unknown = false;
        c->r = 1;
    }
}

int px_admission_check_engine(px_t *px, px_engine_t *e, const char *cause)
{
    check_one_t c = {px, e, cause, -1};
    px_replica_each_live(check_one, &c);
    return c.r;
}

void px_admission_holds_stop(void)
{
    px_admission_start_checks_end(); /* each said to have ended with the stop */
    while (t_holds)
        hold_end(t_holds);
}

void px_admission_start_checks_end(void)
{
    for (hold_t *h = t_holds, *next; h; h = next) {
        next = h->next;
        if (!h->start)
            continue;
        h->stopped = true;
        start_checked(h, kept_slots(h->k)->eng, uv_now(h->timer.loop));
        hold_end(h);
    }
}

void px_admission_drain_fetch(px_t *px, px_replica_t *r, net_fetch_t *f, net_drains_t *set,
                              uint64_t max_ms)
{
    net_fetch_drain(f, set, max_ms, kept_slot_drained, keep_slot_for(px, r, max_ms));
}

void px_admission_dispatch_waiting(void)
{
    px_pool_t *pools[64];
    size_t n = 0;
    for (px_pool_slot_t *sl = *px_worker_qactive(); sl && n < DP_ARRAY_SIZE(pools);
         sl = sl->active_next)
        pools[n++] = sl->q_head->pool;
    /* A pool's queued requests hold its generation: each pointer stays valid while it has
     * waiters, and a pool whose queue emptied is only looked at (nothing to dispatch). */
    for (size_t i = 0; i < n; i++) {
        px_pool_t *p = pools[i];
        if (!qslot(p)->active)
            continue;
        /* The last waiter may fail and drop the generation's last reference: keep it. */
        px_gen_t *g = p->gen;
        px_gen_ref(g);
        if (px_admission_serve(p) && atomic_load(&p->waiting) > 0)
            px_workers_wake(g->px); /* the wake-up was for a queue that emptied: pass it on */
        px_gen_unref(g);
    }
}
