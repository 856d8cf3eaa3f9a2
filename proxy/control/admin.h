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

#endif
