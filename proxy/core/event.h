/* What the data plane saw about a replica, for the control plane to act on: one event type,
 * carried through the control thread's mailbox to the handler the control plane set at start
 * (px->on_event). Workers never change a replica's state themselves. */
#ifndef PX_EVENT_H
#define PX_EVENT_H

#include "proxy/core/types.h"

typedef enum {
    /* A connect was refused or timed out: no new requests until it is attested again. */
    PX_EVENT_CONNECT_FAILED,
    /* The replica closed a connection (a pooled idle one, or one under a request): its engine
     * may have restarted as something else. It takes no new requests (they queue) until a
     * check that began after this has said what it is (px_replica_t.unverified). */
    PX_EVENT_PEER_CLOSED,
    /* A new connection to the replica is established, nothing sent on it yet: the engine that
     * answers it may have replaced the one attested (a restart, a switch behind a balancer).
     * Its request waits for a check begun after that (px_event_connection_checked); the
     * replica is not held, since requests over the pooled connections meet the engine that
     * was attested when those were let through. */
    PX_EVENT_NEW_CONNECTION,
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
 * is handled; one that closed a connection is unverified until re-checked. Dropped when the
 * control thread is far behind: the next request that sees the same tells it again. Nothing
 * happens while no handler is set. */
void px_event_post(px_t *px, const px_event_t *ev);

/* What a failed exchange with r says (net_up_err_t): a refused or timed-out connect says the
 * replica is gone (out of service until re-admitted); a connection it closed or reset says it
 * may have restarted (held until re-checked; the keep-alive race is routine with vLLM's 5 s
 * keep-alive, so that costs a check, not the replica's place). Our own timeouts say nothing of
 * its identity. */
void px_event_upstream_failed(px_t *px, px_replica_t *r, int net_up_err);
/* Does a failed exchange with this error hold its replica (PX_EVENT_PEER_CLOSED)? */
bool px_event_err_holds(int net_up_err);
/* u is r's, for client requests or copies: a pooled connection r closes is posted as
 * PX_EVENT_PEER_CLOSED. Not for attestation's own connections: their keep-alive closes would
 * each start the next check, for ever. */
struct net_upstream_s;
void px_event_watch_closes(px_replica_t *r, struct net_upstream_s *u);
/* May a request be sent to r over u, this thread's pool of connections to r, as it is? Yes
 * when a pooled connection is free (every one was opened under the rule below) and the request
 * may take one (may_pool: not a request resent after a connection failed under it, which goes
 * over a new one), or r is not attested at all. Else the request needs a new connection, held
 * for its check. */
bool px_event_pooled_ok(const px_replica_t *r, struct net_upstream_s *u, bool may_pool);
/* A new connection to r has been established (held: nothing sent on it yet). May the request
 * be sent on it? Only once a check of r begun after the connection was established, and after
 * any close that held r since, has its verdict (*want records which: 0 before the first call,
 * which must come after the connect). Until then false, with that check asked for
 * (PX_EVENT_NEW_CONNECTION); the workers are woken when it has its verdict. Requests whose
 * connections came up at once share one check. An engine switched in before the connection
 * was established is the one the check meets (unless the switch is undone while it runs); one
 * switched in after meets the check, and the connection stays with the engine it reached. */
bool px_event_connection_checked(px_t *px, px_replica_t *r, uint64_t *want);

#endif
