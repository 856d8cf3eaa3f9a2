/* Replica events from the data plane to the control plane (event.h). */
#include <stdio.h>
#include <stdlib.h>

#include "common/util.h"
#include "net/client.h"
#include "proxy/core/px.h"

typedef struct {
    net_mb_node_t node;
    px_t *px;
    px_event_kind_t kind;
    px_replica_t *r; /* a reference */
    bool suspect;    /* this event set r->suspect */
    char seen[sizeof(((px_replica_t *)0)->engine_fp.w)];
} event_msg_t;

static void event_posted(net_mb_node_t *n)
{
    event_msg_t *m = (event_msg_t *)n;
    px_event_t ev = {.kind = m->kind, .r = m->r, .seen = m->seen};
    if (m->px->on_event)
        m->px->on_event(m->px, &ev);
    if (m->suspect) /* its state says now */
        atomic_store_explicit(&m->r->suspect, false, memory_order_release);
    px_replica_unref(m->r);
    free(m);
}

/* Hold r (unverified) until a check that begins from now on has its verdict: hold_after rises
 * to the number of the latest check begun (never falls: another thread may have held it for a
 * later one), then the flag is set. */
static void hold_replica(px_replica_t *r)
{
    uint64_t begun = atomic_load(&r->check_begun), was = atomic_load(&r->hold_after);
    while (was < begun && !atomic_compare_exchange_weak(&r->hold_after, &was, begun)) {
    }
    atomic_store(&r->unverified, true);
}

void px_event_post(px_t *px, const px_event_t *ev)
{
    if (px->on_event == NULL)
        return;
    bool hold = ev->kind == PX_EVENT_PEER_CLOSED;
    if (hold)
        hold_replica(ev->r);
    if (px_thread_on_control()) {
        px->on_event(px, ev);
        return;
    }
    event_msg_t *m = dp_xcalloc(1, sizeof(*m));
    m->px = px;
    m->kind = ev->kind;
    m->r = ev->r;
    px_replica_ref(ev->r);
    if (ev->seen)
        snprintf(m->seen, sizeof(m->seen), "%s", ev->seen);
    m->suspect = !hold && ev->kind != PX_EVENT_NEW_CONNECTION;
    if (m->suspect)
        atomic_store_explicit(&ev->r->suspect, true, memory_order_release);
    /* Not posted: a hold stays (fail closed) until the next regular check's verdict lifts it;
     * a wanted check is asked for again by the next request that needs it. */
    if (!px_thread_try_post_control(px, &m->node, event_posted)) {
        if (m->suspect)
            atomic_store_explicit(&ev->r->suspect, false, memory_order_release);
        if (ev->kind == PX_EVENT_NEW_CONNECTION)
            atomic_store(&ev->r->conn_wanted, false);
        px_replica_unref(m->r);
        free(m);
    }
}

bool px_event_err_holds(int net_up_err)
{
    switch ((net_up_err_t)net_up_err) {
    case NET_UP_SEND:
    case NET_UP_REUSED_CLOSED:
    case NET_UP_CLOSED:
    case NET_UP_TRUNCATED:
        return true;
    default:
        return false;
    }
}

void px_event_upstream_failed(px_t *px, px_replica_t *r, int net_up_err)
{
    if (net_up_err == NET_UP_CONNECT)
        px_event_post(px, &(px_event_t){.kind = PX_EVENT_CONNECT_FAILED, .r = r});
    else if (px_event_err_holds(net_up_err))
        px_event_post(px, &(px_event_t){.kind = PX_EVENT_PEER_CLOSED, .r = r});
}

/* A worker's upstream of r saw a pooled connection closed. r may be being freed on control
 * (its memory waits for this worker's upstream to go: replica.c): then nothing is said. */
static void idle_closed(void *data)
{
    px_replica_t *r = data;
    if (!px_replica_try_ref(r))
        return;
    px_event_post(r->px, &(px_event_t){.kind = PX_EVENT_PEER_CLOSED, .r = r});
    px_replica_unref(r);
}

void px_event_watch_closes(px_replica_t *r, net_upstream_t *u)
{
    net_upstream_on_idle_close(u, idle_closed, r);
}

bool px_event_pooled_ok(const px_replica_t *r, net_upstream_t *u, bool may_pool)
{
    /* Asked whatever r's attestation, so that no caller takes a connection past keep-alive. */
    bool pooled = u != NULL && may_pool && net_upstream_take_ready(u);
    return u == NULL || r->attest.source == CFG_ATTEST_NONE || pooled;
}

bool px_event_connection_checked(px_t *px, px_replica_t *r, uint64_t *want)
{
    if (r->attest.source == CFG_ATTEST_NONE)
        return true;
    if (*want == 0)
        *want = atomic_load(&r->check_begun) + 1;
    /* A close seen since (a hold) is decided by a check begun after it, not before. */
    uint64_t need = atomic_load(&r->hold_after) + 1;
    if (need < *want)
        need = *want;
    if (atomic_load(&r->check_settled) >= need)
        return true;
    /* Asked for once until a check begins (control/attest.c clears the flag first, so a
     * request that saw it set numbered its wait before that check did); not at all once the
     * check it waits for has begun (every check begun is settled, and the settle wakes it). */
    if (px->on_event && atomic_load(&r->check_begun) < need && !atomic_load(&r->conn_wanted) &&
        !atomic_exchange(&r->conn_wanted, true))
        px_event_post(px, &(px_event_t){.kind = PX_EVENT_NEW_CONNECTION, .r = r});
    return false;
}
