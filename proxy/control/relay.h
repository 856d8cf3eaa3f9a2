/* The admin relay: one request to a named replica under the proxy's own admission rules
 * (docs/operations.md §2, "Relay"). */
#ifndef PX_RELAY_H
#define PX_RELAY_H

#include <stdbool.h>

#include "net/server.h"
#include "proxy/core/px.h"

/* Handle req when its path is /admin/relay/...: true when it was (answered now or later). */
bool px_relay_route(px_t *px, net_req_t *req);
/* The admin handler's on_abort: the relay of req, if any, stops and gives its slot back. */
void px_relay_abort(net_req_t *req);
/* Shutdown: relays whose client left and whose answer is still read are cancelled. */
void px_relay_stop(px_t *px);

#endif
