/* GET /admin/audit and the audit member of /readyz (audit_admin.h). */
#include "proxy/control/audit_admin.h"

#include <string.h>

#include "common/buf.h"
#include "config/config.h"
#include "proxy/control/fleet.h"
#include "proxy/core/gen.h"
#include "proxy/obs/audit.h"

static void state_json(px_t *px, dp_jw_t *w)
{
    px_audit_state_t s;
    px_audit_state(px->audit, &s);
    dp_jw_str(w, "path", s.path);
    dp_jw_str(w, "store", s.store);
    dp_jw_bool(w, "writable", s.writable);
    dp_jw_str(w, "audit_fail", s.fail_closed ? "closed" : "open");
    dp_jw_bool(w, "signing", s.signing);
    dp_jw_uint(w, "lines_written", s.lines);
    dp_jw_uint(w, "lines_failed", s.errors);
    dp_jw_uint(w, "lines_store_failed", s.store_errors);
    if (s.seq) {
        dp_jw_obj_begin(w, "anchor");
        dp_jw_uint(w, "seq", s.seq);
        dp_jw_str(w, "sha256", s.sha256);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "anchor");
    }
    /* With a fleet, the checkpoint is also kept in etcd, out of this host's reach. */
    dp_buf_t key = {0};
    uint64_t seq = 0;
    if (px_fleet_anchor(px, &key, &seq)) {
        dp_jw_obj_begin(w, "fleet_anchor");
        dp_jw_str(w, "key", key.base);
        dp_jw_uint(w, "seq", seq);
        dp_jw_obj_end(w);
    }
    dp_buf_free(&key);
}

bool px_audit_admin_route(px_t *px, net_req_t *req)
{
    static const char path[] = "/admin/audit";
    if (req->path.len != sizeof(path) - 1 || memcmp(req->path.base, path, sizeof(path) - 1) != 0)
        return false;
    if (req->method != 1 /* GET */ && req->method != 2 /* HEAD */) {
        net_resp_method_not_allowed(req, "GET, HEAD");
        return true;
    }
    if (px->audit == NULL) {
        net_resp_error(req, 404, NULL, "not_found", NULL,
                       px->gen->cfg->log.audit_path
                           ? "the audit trail is not open (its lock is held by another process)"
                           : "no audit trail (log.audit_path)",
                       NULL, 0);
        return true;
    }
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    dp_jw_obj_begin(&w, NULL);
    state_json(px, &w);
    dp_jw_obj_end(&w);
    net_resp_send(req, 200, "application/json", b.base, b.len, NULL, 0);
    dp_buf_free(&b);
    return true;
}

bool px_audit_admin_ready(px_t *px, dp_jw_t *w)
{
    const cfg_t *cfg = px->gen->cfg;
    if (cfg->log.audit_path == NULL)
        return true;
    bool writable = px_audit_writable(px->audit);
    dp_jw_obj_begin(w, "audit");
    dp_jw_bool(w, "writable", writable);
    dp_jw_str(w, "audit_fail", cfg_audit_fail_names[cfg->log.audit_fail_open]);
    dp_jw_obj_end(w);
    return writable || cfg->log.audit_fail_open;
}
