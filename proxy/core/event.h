/* What the data plane saw about a replica, for the control plane to act on: one event type,
 * carried through the control thread's mailbox to the handler the control plane set at start
 * (px->on_event). Workers never change a replica's state themselves. */
#ifndef PX_EVENT_H
#define PX_EVENT_H

#include "proxy/core/types.h"

typedef enum {
    /* A connect was refused or timed out: no new requests until it is attested again. */
    PX_EVENT_CONNECT_FAILED,
    /* A connection closed under a request: attest it again soon. */
    PX_EVENT_CONNECTION_LOST,
    /* A response carried another engine fingerprint than the one attested. */
    PX_EVENT_FINGERPRINT,
} px_event_kind_t;

typedef struct {
    px_event_kind_t kind;
    px_replica_t *r;
    const char *seen; /* PX_EVENT_FINGERPRINT: the fingerprint the response carried */
} px_event_t;

typedef void (*px_event_cb)(px_t *px, const px_event_t *ev);

/* Tell the control plane: at once on the control thread, else through its mailbox. A replica
 * that failed a connect or changed fingerprint is suspect (no worker picks it) until the event
 * is handled. Dropped when the control thread is far behind: the next request that sees the
 * same tells it again. Nothing happens while no handler is set. */
void px_event_post(px_t *px, const px_event_t *ev);

#endif
