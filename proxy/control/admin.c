/* The admin listener (docs/operations.md §2): health, readiness, metrics, replica state, the
 * effective configuration, draining and enabling replicas, drift statistics and their reset. */
#include <string.h>

#include "common/jw.h"
#include "common/util.h"
#include "net/mailbox.h"
#include "proxy/control/admin.h"
#include "proxy/control/audit_admin.h"
#include "proxy/control/fleet.h"
#include "proxy/control/attest.h"
#include "proxy/control/relay.h"
#include "proxy/control/reload.h"
#include "proxy/control/status.h"
#include "proxy/core/gen.h"
#include "proxy/core/px.h"
#include "proxy/data/admission.h"
#include "proxy/data/shadow.h"
#include "proxy/data/worker.h"

static bool path_is(const net_req_t *req, const char *p)
{
    size_t n = strlen(p);
    return req->path.len == n && memcmp(req->path.base, p, n) == 0;
}

static void send_json(net_req_t *req, int status, dp_buf_t *b)
{
    net_resp_send(req, status, "application/json", b->base, b->len, NULL, 0);
    dp_buf_free(b);
}

static void readyz(px_t *px, net_req_t *req)
{
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    bool ready = !px->draining;
    dp_jw_obj_begin(&w, NULL);
    dp_jw_arr_begin(&w, "unready_pools");
    for (size_t i = 0; i < px->gen->npools; i++) {
        px_pool_t *p = &px->gen->pools[i];
        /* A candidate pool (docs/rollouts.md) serves no client: the baseline does not wait for it.
         */
        if (px_pool_has_admitted(p) || p->cfg->only_candidate)
            continue;
        ready = false;
        dp_buf_t why = {0};
        px_pool_why_unavailable(p, &why);
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "pool", p->name);
        dp_jw_str(&w, "reason", why.base);
        dp_jw_obj_end(&w);
        dp_buf_free(&why);
    }
    dp_jw_arr_end(&w);
    dp_jw_arr_begin(&w, "unready_candidate_pools"); /* shown, not waited for */
    for (size_t i = 0; i < px->gen->npools; i++) {
        const px_pool_t *p = &px->gen->pools[i];
        if (p->cfg->only_candidate && !px_pool_has_admitted(p))
            dp_jw_str(&w, NULL, p->name);
    }
    dp_jw_arr_end(&w);
    if (!px_audit_admin_ready(px, &w))
        ready = false;
    if (px->draining)
        dp_jw_str(&w, "reason", "draining");
    dp_jw_str(&w, "status", ready ? "ready" : "unready");
    dp_jw_obj_end(&w);
    send_json(req, ready ? 200 : 503, &b);
}

void px_admin_replica_json(dp_jw_t *w, const px_replica_t *r)
{
    dp_jw_obj_begin(w, NULL);
    dp_jw_str(w, "pool", r->pool_name);
    dp_jw_str(w, "name", r->name);
    char url[8 + 300 + CFG_URL_PATH_MAX + 1]; /* scheme, hostport as cfg_parse_url makes it, path */
    snprintf(url, sizeof(url), "%s://%s%s", r->url.tls ? "https" : "http", r->url.hostport,
             r->url.path ? r->url.path : "");
    dp_jw_str(w, "url", url);
    dp_jw_str(w, "state", px_replica_state_names[r->state]);
    /* The accepted identity it was admitted as (its responses carry it). */
    dp_jw_str(w, "fingerprint", r->fingerprint[0] ? r->fingerprint : NULL);
    dp_jw_arr_begin(w, "reasons");
    for (size_t i = 0; i < r->nreasons; i++)
        dp_jw_str(w, NULL, r->reasons[i]);
    dp_jw_arr_end(w);
    px_attest_replica_json(w, r);
    if (r->last_attested_at) {
        char ts[32];
        dp_iso8601(ts, r->last_attested_at);
        dp_jw_str(w, "last_attested_at", ts);
    } else {
        dp_jw_null(w, "last_attested_at");
    }
    dp_jw_uint(w, "inflight", r->slots->inflight);
    dp_jw_uint(w, "relays_holding", atomic_load(&r->slots->held));
    dp_jw_uint(w, "requests", r->requests);
    dp_jw_bool(w, "discovered", r->discovered);
    dp_jw_bool(w, "drained", r->drained);
    dp_jw_bool(w, "serving", px_replica_serving(r));
    dp_jw_bool(w, "unverified", atomic_load(&r->unverified));
    dp_jw_obj_end(w);
}

static void replicas(px_t *px, net_req_t *req)
{
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_arr_begin(&w, "replicas");
    for (size_t i = 0; i < px->gen->npools; i++) {
        px_pool_t *p = &px->gen->pools[i];
        for (size_t k = 0; k < p->nreplicas; k++)
            px_admin_replica_json(&w, p->replicas[k]);
    }
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
    send_json(req, 200, &b);
}

/* Query parameter name, decoded into out: 1 present, 0 absent; -1 when it is malformed (then
 * answered 400). */
static int query(net_req_t *req, const char *name, dp_buf_t *out)
{
    int rc = net_req_query(req, name, out);
    if (rc < 0) {
        char msg[96];
        snprintf(msg, sizeof(msg), "the query's %s has a malformed %%-escape", name);
        net_resp_error(req, 400, NULL, "bad_request", name, msg, NULL, 0);
    }
    return rc;
}

/* 404 for a ?pool= that names no pool. */
static void pool_not_found(net_req_t *req, const char *name)
{
    dp_buf_t m = {0};
    dp_buf_printf(&m, "no pool is named %s", name);
    net_resp_error(req, 404, NULL, "pool_not_found", NULL, m.base, NULL, 0);
    dp_buf_free(&m);
}

/* Is a pool of the running configuration named name? */
static bool pool_named(const px_t *px, const dp_buf_t *name)
{
    for (size_t i = 0; i < px->gen->npools; i++)
        if (strcmp(px->gen->pools[i].name, name->base) == 0)
            return true;
    return false;
}

/* POST /admin/replicas/NAME/drain | /enable [?pool=P]: every replica of that name (in pool P
 * only, with ?pool). Answers the replicas changed, 404 when none has the name. */
static bool replica_admin(px_t *px, net_req_t *req)
{
    static const char prefix[] = "/admin/replicas/";
    const size_t pl = sizeof(prefix) - 1;
    const dp_iovec_t p = req->path;
    if (p.len <= pl || memcmp(p.base, prefix, pl) != 0)
        return false;
    const char *name = p.base + pl;
    const char *slash = p.base + p.len;
    while (slash > name && slash[-1] != '/')
        slash--;
    if (slash <= name + 1)
        return false;
    slash--; /* at the '/' before the action */
    size_t nl = (size_t)(slash - name), al = p.len - pl - nl - 1;
    bool drain;
    if (al == 5 && memcmp(slash + 1, "drain", 5) == 0)
        drain = true;
    else if (al == 6 && memcmp(slash + 1, "enable", 6) == 0)
        drain = false;
    else
        return false;
    if (req->method != 3 /* POST */) {
        net_resp_method_not_allowed(req, "POST");
        return true;
    }
    dp_buf_t only = {0}, why = {0};
    int by_pool = query(req, "pool", &only);
    /* ?reason=TEXT: recorded with the drain where the fleet shows it (docs/fleet.md). */
    int has_why = by_pool < 0 ? -1 : query(req, "reason", &why);
    char reason[128];
    if (has_why > 0 && why.len > 0)
        snprintf(reason, sizeof(reason), "%s", why.base);
    else
        snprintf(reason, sizeof(reason), "operator %s", drain ? "drain" : "enable");
    dp_buf_free(&why);
    if (by_pool < 0 || has_why < 0) {
        dp_buf_free(&only);
        return true;
    }
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_arr_begin(&w, "replicas");
    size_t n = 0;
    for (size_t i = 0; i < px->gen->npools; i++) {
        px_pool_t *pool = &px->gen->pools[i];
        if (by_pool && strcmp(pool->name, only.base) != 0)
            continue;
        for (size_t k = 0; k < pool->nreplicas; k++) {
            px_replica_t *r = pool->replicas[k];
            if (strlen(r->name) != nl || memcmp(r->name, name, nl) != 0)
                continue;
            px_replica_set_drained(r, drain);
            px_fleet_drained(px, r, drain, reason);
            if (!drain)
                px_admission_slot_freed(pool); /* queued requests may go to it now */
            px_admin_replica_json(&w, r);
            n++;
        }
    }
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
    if (n == 0) {
        dp_buf_free(&b);
        dp_buf_printf(&b, "no replica is named %.*s%s%s", (int)nl, name, by_pool ? " in pool " : "",
                      by_pool ? only.base : "");
        net_resp_error(req, 404, NULL, "replica_not_found", NULL, b.base, NULL, 0);
        dp_buf_free(&b);
    } else {
        send_json(req, 200, &b);
    }
    dp_buf_free(&only);
    return true;
}

/* Bring gauges up to date before /metrics renders. */
static void refresh_gauges(px_t *px)
{
    px_metrics_set(px_metrics_get("detproxy_connections", NULL),
                   (double)px_workers_connections(px));
    px_metrics_set(px_metrics_get("detproxy_inflight_requests", NULL),
                   (double)px_workers_inflight(px));
    px_metrics_set(px_metrics_get("detproxy_handoff_dropped_total", "queue", "control", NULL),
                   (double)net_mailbox_dropped(&px->mb));
    px_status_refresh_gauges(px);
}

/* ---- access, and the routes that answer from other planes' state ----------------------- */

static int authorize(px_t *px, net_req_t *req)
{
    const char *tok = px->gen->cfg->admin_token;
    if (tok == NULL)
        return 0;
    /* As the tenant matcher: two Authorization fields are ambiguous and match nothing. */
    const net_header_t *h = NULL;
    size_t n = 0;
    for (size_t i = 0; i < req->nheaders; i++) {
        if (dp_strieq(req->headers[i].name.base, req->headers[i].name.len, "authorization")) {
            h = &req->headers[i];
            n++;
        }
    }
    size_t tl = strlen(tok);
    dp_iovec_t got;
    if (n == 1 && dp_bearer_token(h->value, &got) && got.len == tl &&
        dp_ct_equal(got.base, tok, tl))
        return 0;
    static const net_header_t www = {DP_IOV("www-authenticate"), DP_IOV("Bearer")};
    net_resp_error(req, 401, NULL, "unauthorized", NULL,
                   "admin endpoints need Authorization: Bearer <admin token>", &www, 1);
    return -1;
}

/* POST /admin/drift/reset[?pool=P] (docs/drift.md §7): the drift statistics of every pool (of
 * pool P) start over; 404 when no pool is named P. */
static void drift_reset(px_t *px, net_req_t *req)
{
    dp_buf_t only = {0};
    int by_pool = query(req, "pool", &only);
    if (by_pool < 0) {
        dp_buf_free(&only);
        return;
    }
    dp_buf_t b = {0};
    if (px_shadow_drift_reset(px, by_pool ? only.base : NULL, only.len, &b) != 0) {
        dp_buf_free(&b);
        pool_not_found(req, only.base ? only.base : "");
        dp_buf_free(&only);
        return;
    }
    dp_buf_free(&only);
    send_json(req, 200, &b);
}

static int extra_route(px_t *px, net_req_t *req)
{
    if (path_is(req, "/admin/reload")) {
        if (req->method != 3 /* POST */) {
            net_resp_method_not_allowed(req, "POST");
            return 0;
        }
        dp_buf_t msg = {0};
        int rc = px_reload_msg(px, "POST /admin/reload", &msg);
        if (rc == 0) {
            static const char ok[] = "{\"status\":\"reloaded\"}";
            net_resp_send(req, 200, "application/json", ok, sizeof(ok) - 1, NULL, 0);
        } else if (rc == PX_RELOAD_DRAINING) {
            net_resp_error(req, 503, NULL, "draining", NULL, msg.base, NULL, 0);
        } else if (rc == PX_RELOAD_UNAVAILABLE) {
            /* A valid file naming what cannot be had now (another detproxy's audit trail or
             * store, a certificate the TLS library refuses): a conflict with the state of the
             * host, not a file to fix (docs/operations.md "Reload"). */
            net_resp_error(req, 409, NULL, "unavailable", NULL, msg.base, NULL, 0);
        } else {
            net_resp_error(req, 400, NULL, "invalid_config", NULL, msg.base, NULL, 0);
        }
        dp_buf_free(&msg);
        return 0;
    }
    if (path_is(req, "/admin/rollouts") && (req->method == 1 || req->method == 2)) {
        dp_buf_t only = {0};
        int by_pool = query(req, "pool", &only);
        if (by_pool > 0 && !pool_named(px, &only)) {
            pool_not_found(req, only.base);
        } else if (by_pool >= 0) {
            dp_buf_t b = {0};
            px_shadow_rollouts_json(px, by_pool ? only.base : NULL, only.len, &b);
            px_fleet_rollouts_json(px, by_pool ? only.base : NULL, only.len, &b);
            net_resp_send(req, 200, "application/json", b.base, b.len, NULL, 0);
            dp_buf_free(&b);
        }
        dp_buf_free(&only);
        return 0;
    }
    if (path_is(req, "/admin/drift/reset")) {
        if (req->method != 3 /* POST */) {
            net_resp_method_not_allowed(req, "POST");
            return 0;
        }
        drift_reset(px, req);
        return 0;
    }
    if (path_is(req, "/admin/fleet") && (req->method == 1 || req->method == 2)) {
        dp_buf_t b = {0};
        px_fleet_json(px, &b);
        send_json(req, 200, &b);
        return 0;
    }
    if (path_is(req, "/admin/drift") && (req->method == 1 || req->method == 2)) {
        dp_buf_t b = {0};
        px_shadow_drift_json(px, &b);
        px_fleet_drift_json(px, &b);
        net_resp_send(req, 200, "application/json", b.base, b.len, NULL, 0);
        dp_buf_free(&b);
        return 0;
    }
    return -1;
}

static void config_dump(px_t *px, net_req_t *req)
{
    dp_buf_t b = {0};
    cfg_dump_json(px->gen->cfg, &b);
    send_json(req, 200, &b);
}

static void metrics(px_t *px, net_req_t *req)
{
    dp_buf_t b = {0};
    refresh_gauges(px);
    px_metrics_render(&b);
    net_resp_send(req, 200, "text/plain; version=0.0.4; charset=utf-8", b.base, b.len, NULL, 0);
    dp_buf_free(&b);
}

/* The routes that only read: any other method is a 405 on them, not a 404. */
static bool is_read_route(net_req_t *req)
{
    static const char *const paths[] = {"/",
                                        "/metrics",
                                        "/healthz",
                                        "/readyz",
                                        "/admin/replicas",
                                        "/admin/config",
                                        "/admin/drift",
                                        "/admin/fleet",
                                        "/admin/rollouts"};
    for (size_t i = 0; i < DP_ARRAY_SIZE(paths); i++)
        if (path_is(req, paths[i]))
            return true;
    return false;
}

/* The probes, which need no token. */
static bool is_probe(net_req_t *req)
{
    bool get = req->method == 1 /* GET */ || req->method == 2 /* HEAD */;
    return get && (path_is(req, "/healthz") || path_is(req, "/readyz"));
}

static net_body_mode_t on_head(net_req_t *req)
{
    /* The token is checked before any body is read: a client without it holds no memory
     * here (the body is discarded, the connection closed if it is still coming). */
    if (!is_probe(req) && authorize(net_server_data(req->server), req) != 0)
        return NET_BODY_DISCARD;
    return NET_BODY_BUFFER;
}

static void on_complete(net_req_t *req)
{
    px_t *px = net_server_data(req->server);
    bool get = req->method == 1 /* GET */ || req->method == 2 /* HEAD */;
    if (path_is(req, "/healthz") && get) {
        static const char ok[] = "{\"status\":\"ok\"}";
        net_resp_send(req, 200, "application/json", ok, sizeof(ok) - 1, NULL, 0);
        return;
    }
    if (path_is(req, "/readyz") && get) {
        readyz(px, req);
        return;
    }
    /* authorized in on_head */
    if (path_is(req, "/") && get)
        px_status_page(px, req);
    else if (path_is(req, "/metrics") && get)
        metrics(px, req);
    else if (path_is(req, "/admin/replicas") && get)
        replicas(px, req);
    else if (path_is(req, "/admin/config") && get)
        config_dump(px, req);
    else if (replica_admin(px, req) || px_relay_route(px, req))
        return;
    else if (px_audit_admin_route(px, req))
        return;
    else if (extra_route(px, req) == 0)
        return;
    else if (is_read_route(req))
        net_resp_method_not_allowed(req, "GET, HEAD");
    else
        net_resp_error(req, 404, NULL, "not_found", NULL, "no such admin endpoint", NULL, 0);
}

const net_handler_t px_admin_handler = {
    .on_head = on_head, .on_complete = on_complete, .on_abort = px_relay_abort};
