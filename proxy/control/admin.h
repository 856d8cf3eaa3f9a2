/* The admin listener (docs/operations.md §2): health, readiness, metrics, replica state, the
 * effective configuration, draining and enabling replicas, reload, drift and rollouts, the
 * status page; every route behind the admin token when one is set (docs/security.md §4). */
#ifndef PX_ADMIN_H
#define PX_ADMIN_H

#include "common/jw.h"
#include "net/server.h"
#include "proxy/core/px.h"

extern const net_handler_t px_admin_handler;

/* One replica as JSON (/admin/replicas). */
void px_admin_replica_json(dp_jw_t *w, const px_replica_t *r);

/* 405 for a method the route does not take, with the Allow header (RFC 9110 §15.5.6) naming
 * what it takes, e.g. "GET, HEAD". */
void px_admin_method_not_allowed(net_req_t *req, const char *allow);

#endif
