/* Pieces of the admin listener other modules provide or use. */
#ifndef PX_ADMIN_H
#define PX_ADMIN_H

#include "common/jw.h"
#include "proxy/core/px.h"

/* One replica as JSON (shared by /admin/replicas and diagnose). */
void px_admin_replica_json(dp_jw_t *w, const px_replica_t *r);
/* The "attestation" object of a replica (px_attest.c). */
void px_attest_replica_json(dp_jw_t *w, const px_replica_t *r);
/* Bring gauges up to date before /metrics renders. */
void px_admin_refresh_gauges(px_t *px);
/* Admin token check (SPEC §13); /healthz and /readyz are exempt. 0 when allowed; otherwise it
 * has answered 401. */
int px_admin_authorize(px_t *px, net_req_t *req);
/* Routes owned by other modules (/admin/drift, /admin/reload): 0 when answered, -1 when the
 * path is not theirs. */
int px_admin_extra_route(px_t *px, net_req_t *req);

#endif
