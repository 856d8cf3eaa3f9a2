/* Replica events from the data plane to the control plane (event.h). */
#include <stdio.h>
#include <stdlib.h>

#include "common/util.h"
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

void px_event_post(px_t *px, const px_event_t *ev)
{
    if (px->on_event == NULL)
        return;
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
    m->suspect = ev->kind != PX_EVENT_CONNECTION_LOST;
    if (m->suspect)
        atomic_store_explicit(&ev->r->suspect, true, memory_order_release);
    if (!px_thread_try_post_control(px, &m->node, event_posted)) {
        if (m->suspect)
            atomic_store_explicit(&ev->r->suspect, false, memory_order_release);
        px_replica_unref(m->r);
        free(m);
    }
}
