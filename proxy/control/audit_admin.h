/* The audit trail on the admin listener (docs/operations.md, "Evidence"): GET /admin/audit
 * gives the writer's state and its anchor (the latest checkpoint's seq and SHA-256), and
 * /readyz's audit member says whether it can write. */
#ifndef PX_AUDIT_ADMIN_H
#define PX_AUDIT_ADMIN_H

#include <stdbool.h>

#include "common/jw.h"
#include "net/server.h"
#include "proxy/core/px.h"

/* GET /admin/audit: answered (true), or not this route (false). */
bool px_audit_admin_route(px_t *px, net_req_t *req);
/* /readyz: an "audit" member when there is an audit trail; false when it cannot write and
 * log.audit_fail is closed (audited tenants are refused: the proxy is not ready for them). */
bool px_audit_admin_ready(px_t *px, dp_jw_t *w);

#endif
