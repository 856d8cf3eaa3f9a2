/* The admin status page (docs/operations.md §2, `GET /`) and the gauges derived from replica and
 * drift state. */
#ifndef PX_STATUS_H
#define PX_STATUS_H

#include "proxy/core/px.h"

/* Render the HTML page into a 200 response. The caller has checked the admin token. */
void px_status_page(px_t *px, net_req_t *req);
/* Record a replica state change (r->state is the new state) for the page's history. */
void px_status_note_change(const px_replica_t *r, px_replica_state_t from);
/* detproxy_drift_verdict{pool,verdict} and detproxy_replica_quarantined{pool,replica}. */
void px_status_refresh_gauges(px_t *px);

#endif
