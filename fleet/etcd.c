/* See fleet/etcd.h. Calls are net_fetch exchanges on one upstream per endpoint; the watch is a
 * net_creq_t exchange whose chunked body never ends, cut into messages by fleet_ej_split_t. */
#include "fleet/etcd.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/list.h"
#include "common/util.h"
#include "net/client.h"
#include "net/fetch.h"
#include "net/resolve.h"
#include "net/tls.h"

#define DEFAULT_TIMEOUT_MS 2000
#define DEFAULT_MAX_ANSWER (4u << 20)
#define WATCH_BACKOFF_MIN_MS 100
#define WATCH_BACKOFF_MAX_MS 2000

typedef struct call_s call_t;

typedef struct {
    char *hostport;
    char *host;
    struct sockaddr_storage addr;
    net_upstream_t *up, *wup; /* calls; the watch (no idle limit: a quiet watch is normal) */
} endpoint_t;

struct fleet_etcd_s {
    uv_loop_t *loop;
    endpoint_t *eps;
    size_t neps, cur;
    net_tls_ctx_t *tls;
    char *user, *password, *token;
    uint32_t timeout_ms;
    size_t max;
    uint64_t requests;
    call_t *calls; /* in flight */
    /* the watch */
    char *wprefix;
    fleet_etcd_watch_cb_t wcb;
    void *wdata;
    net_creq_t *wreq;
    fleet_ej_split_t split;
    int64_t wnext; /* the revision to resume from */
    int wstatus;
    int64_t compacted; /* etcd said so: the stream is dropped, the owner resyncs */
    bool wactive, wcreated;
    uint32_t backoff_ms;
    uv_timer_t wtimer; /* the watch's retry; once the client is ending, its last call's limit */
    /* fleet_etcd_free_after's call, told once whether it was answered or its limit came */
    fleet_etcd_cb last_cb;
    void *last_data;
    size_t last_waiting; /* its copies (one per endpoint) not yet answered */
    bool freeing;
};

struct call_s {
    fleet_etcd_t *e;
    call_t *prev, *next;
    char *path;
    dp_buf_t body;
    fleet_etcd_cb cb;
    void *data;
    net_fetch_t *f;
    size_t tries;  /* endpoints tried */
    bool authing;  /* the fetch in flight is /v3/auth/authenticate */
    bool reauthed; /* a refused token was renewed once */
    size_t max;    /* this call's answer cap (0: the client's) */
    int ep;        /* sent to this endpoint only (no failover), or -1: e->cur, then the next */
};

static void call_start(fleet_etcd_t *e, int ep, const char *path, const dp_buf_t *body,
                       size_t max_bytes, fleet_etcd_cb cb, void *data);

static endpoint_t *call_ep(const call_t *c)
{
    return &c->e->eps[c->ep >= 0 ? (size_t)c->ep : c->e->cur];
}

/* ---- endpoints ------------------------------------------------------------------------- */

static void up_opts(const fleet_etcd_t *e, bool watch, net_upstream_opts_t *o)
{
    memset(o, 0, sizeof(*o));
    o->connect_timeout_ms = e->timeout_ms;
    o->first_byte_timeout_ms = e->timeout_ms;
    o->idle_timeout_ms = watch ? 86400000u : e->timeout_ms;
    o->max_idle = 4;
}

static net_upstream_t *endpoint_up(fleet_etcd_t *e, endpoint_t *ep, bool watch)
{
    net_upstream_t **u = watch ? &ep->wup : &ep->up;
    if (*u == NULL) {
        net_upstream_opts_t o;
        up_opts(e, watch, &o);
        *u = net_upstream_new(e->loop, (const struct sockaddr *)&ep->addr, &o);
        if (e->tls)
            net_upstream_set_tls(*u, e->tls, ep->host);
    }
    return *u;
}

fleet_etcd_t *fleet_etcd_new(uv_loop_t *loop, const fleet_etcd_opts_t *o, dp_buf_t *err)
{
    fleet_etcd_t *e = dp_xcalloc(1, sizeof(*e));
    e->loop = loop;
    e->timeout_ms = o->timeout_ms ? o->timeout_ms : DEFAULT_TIMEOUT_MS;
    e->max = o->max_answer ? o->max_answer : DEFAULT_MAX_ANSWER;
    e->split.max = e->max;
    e->eps = dp_xcalloc(o->nendpoints ? o->nendpoints : 1, sizeof(*e->eps));
    uv_timer_init(loop, &e->wtimer);
    e->wtimer.data = e;
    bool tls = false;
    for (size_t i = 0; i < o->nendpoints; i++) {
        endpoint_t *ep = &e->eps[e->neps];
        if (!net_resolve(o->endpoints[i].host, o->endpoints[i].port, &ep->addr)) {
            dp_buf_printf(err, "etcd endpoint %s: cannot resolve %s", o->endpoints[i].hostport,
                          o->endpoints[i].host);
            goto fail;
        }
        ep->hostport = dp_xstrdup(o->endpoints[i].hostport);
        ep->host = dp_xstrdup(o->endpoints[i].host);
        tls |= o->endpoints[i].tls;
        e->neps++;
    }
    if (tls) {
        e->tls = net_tls_client_ctx(o->ca_file, o->cert_file, o->key_file, err);
        if (e->tls == NULL)
            goto fail;
    }
    if (o->username) {
        e->user = dp_xstrdup(o->username);
        e->password = dp_xstrdup(o->password ? o->password : "");
    }
    return e;
fail:
    fleet_etcd_free(e);
    return NULL;
}

static void call_free(call_t *c);
static void call_finish(call_t *c, const cJSON *res, const char *why);

static void etcd_closed(uv_handle_t *h)
{
    fleet_etcd_t *e = h->data;
    free(e);
}

/* Each call still in flight ends with a failure (`why`) now, so its owner frees what it passed,
 * and the watch stops. */
static void calls_cancel(fleet_etcd_t *e, const char *why)
{
    while (e->calls) {
        call_t *c = e->calls;
        if (c->f)
            net_fetch_cancel(c->f);
        c->f = NULL;
        call_finish(c, NULL, why);
    }
    fleet_etcd_watch_stop(e);
}

void fleet_etcd_cancel(fleet_etcd_t *e)
{
    calls_cancel(e, "canceled: its caller stops");
}

void fleet_etcd_free(fleet_etcd_t *e)
{
    if (e == NULL)
        return;
    e->freeing = true;
    calls_cancel(e, "canceled: the etcd client is closing");
    for (size_t i = 0; i < e->neps; i++) {
        if (e->eps[i].up)
            net_upstream_free(e->eps[i].up);
        if (e->eps[i].wup)
            net_upstream_free(e->eps[i].wup);
        free(e->eps[i].hostport);
        free(e->eps[i].host);
    }
    free(e->eps);
    net_tls_ctx_unref(e->tls);
    free(e->user);
    if (e->password) {
        memset(e->password, 0, strlen(e->password));
        free(e->password);
    }
    free(e->token);
    fleet_ej_split_free(&e->split);
    free(e->wprefix);
    uv_close((uv_handle_t *)&e->wtimer, etcd_closed);
}

static void last_free(uv_timer_t *t)
{
    fleet_etcd_free(t->data);
}

/* One copy of the last call answered: the first success is told, or the last failure. */
static void last_answered(const cJSON *res, const char *why, void *data)
{
    fleet_etcd_t *e = data;
    e->last_waiting--;
    if (e->last_cb == NULL || (res == NULL && e->last_waiting > 0))
        return; /* told already, or another endpoint may still answer */
    fleet_etcd_cb cb = e->last_cb;
    e->last_cb = NULL;
    cb(res, why, e->last_data);
    if (!e->freeing) /* not inside the fetch's own callback: the connection goes with e */
        uv_timer_start(&e->wtimer, last_free, 0, 0);
}

void fleet_etcd_free_after(fleet_etcd_t *e, const char *path, const dp_buf_t *body,
                           uint32_t limit_ms, fleet_etcd_cb cb, void *data)
{
    calls_cancel(e, "canceled: the etcd client is closing");
    e->last_cb = cb;
    e->last_data = data;
    /* To every endpoint at once: the one calls went to may be the one that just went away, and
     * a failover would not fit in the limit (one endpoint's timeout may be longer). */
    e->last_waiting = e->neps;
    for (size_t i = 0; i < e->neps && e->last_cb; i++)
        call_start(e, (int)i, path, body, 0, last_answered, e);
    if (e->last_cb) /* not all refused at once */
        uv_timer_start(&e->wtimer, last_free, limit_ms, 0);
}

const char *fleet_etcd_endpoint(const fleet_etcd_t *e)
{
    return e->neps ? e->eps[e->cur].hostport : "";
}

uint64_t fleet_etcd_requests(const fleet_etcd_t *e)
{
    return e->requests;
}

/* ---- calls ------------------------------------------------------------------------------- */

static void call_free(call_t *c)
{
    fleet_etcd_t *e = c->e;
    DP_LIST_UNLINK(e->calls, c, next, prev);
    free(c->path);
    dp_buf_free(&c->body);
    free(c);
}

static void call_send(call_t *c);

static void call_finish(call_t *c, const cJSON *res, const char *why)
{
    fleet_etcd_cb cb = c->cb;
    void *data = c->data;
    call_free(c);
    cb(res, why, data);
}

/* An answer is the endpoint's fault (try the next) when the transport failed, the member has no
 * leader or timed out, or it answered 5xx. */
static bool endpoint_fault(int status, const char *err)
{
    if (status == 0 || status >= 500)
        return true;
    return err && (strstr(err, "no leader") || strstr(err, "timed out") ||
                   strstr(err, "not capable") || strstr(err, "unavailable"));
}

static void fetched(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                    const char *detail, void *data)
{
    (void)f;
    call_t *c = data;
    fleet_etcd_t *e = c->e;
    c->f = NULL;
    cJSON *res = NULL;
    char why[256] = "";
    if (status == 0) {
        snprintf(why, sizeof(why), "%s: %s", call_ep(c)->hostport,
                 detail ? detail : net_up_err_name(err));
    } else {
        /* A message that ended with the first object: keep-alive answers are a stream. */
        const char *end = NULL;
        res = body->len ? cJSON_ParseWithLengthOpts(body->base, body->len, &end, false) : NULL;
        if (!cJSON_IsObject(res)) {
            snprintf(why, sizeof(why), "%s: HTTP %d, not a JSON object", call_ep(c)->hostport,
                     status);
        } else {
            const char *ee = fleet_ej_error(res);
            if (ee || status != 200)
                snprintf(why, sizeof(why), "%s: HTTP %d: %s", call_ep(c)->hostport, status,
                         ee ? ee : "error");
        }
    }
    if (why[0] == '\0') {
        if (c->authing) {
            const cJSON *tok = cJSON_GetObjectItemCaseSensitive(res, "token");
            c->authing = false;
            if (!cJSON_IsString(tok) || tok->valuestring[0] == '\0') {
                cJSON_Delete(res);
                call_finish(c, NULL, "authenticate: no token in the answer");
                return;
            }
            free(e->token);
            e->token = dp_xstrdup(tok->valuestring);
            cJSON_Delete(res);
            call_send(c);
            return;
        }
        /* The gateway wraps streamed answers (keep-alive) in "result". */
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(res, "result");
        call_finish(c, cJSON_IsObject(r) ? r : res, NULL);
        cJSON_Delete(res);
        return;
    }
    const char *ee = res ? fleet_ej_error(res) : NULL;
    bool auth_refused =
        status == 401 ||
        (ee && (strstr(ee, "invalid auth token") || strstr(ee, "user name is empty")));
    bool fault = endpoint_fault(status, ee);
    cJSON_Delete(res);
    if (auth_refused && e->user && !c->authing && !c->reauthed) {
        c->reauthed = true;
        free(e->token);
        e->token = NULL;
        call_send(c);
        return;
    }
    if (fault && c->ep < 0 && ++c->tries < e->neps) {
        e->cur = (e->cur + 1) % e->neps;
        call_send(c);
        return;
    }
    if (fault && c->ep < 0)
        e->cur = (e->cur + 1) % e->neps; /* the next call starts elsewhere */
    call_finish(c, NULL, why);
}

static void call_send(call_t *c)
{
    fleet_etcd_t *e = c->e;
    endpoint_t *ep = call_ep(c);
    dp_buf_t auth = {0}, hdr = {0};
    const char *path = c->path;
    const dp_buf_t *body = &c->body;
    c->authing = false; /* sent again elsewhere: another call may have got the token meanwhile */
    if (e->user && e->token == NULL) {
        c->authing = true;
        path = "/v3/auth/authenticate";
        fleet_ej_auth(&auth, e->user, e->password);
        body = &auth;
    } else if (e->token) {
        dp_buf_printf(&hdr, "authorization: %s\r\n", e->token);
    }
    net_fetch_opts_t fo = {.method = "POST",
                           .hostport = ep->hostport,
                           .target = path,
                           .body = body->base ? body->base : "{}",
                           .body_len = body->base ? body->len : 2,
                           .max_bytes = c->max ? c->max : e->max,
                           .extra_headers = hdr.base};
    e->requests++;
    c->f = net_fetch(endpoint_up(e, ep, false), &fo, fetched, c);
    if (auth.base) {
        memset(auth.base, 0, auth.len);
        dp_buf_free(&auth);
    }
    dp_buf_free(&hdr);
}

void fleet_etcd_call(fleet_etcd_t *e, const char *path, const dp_buf_t *body, fleet_etcd_cb cb,
                     void *data)
{
    fleet_etcd_call_max(e, path, body, 0, cb, data);
}

static void call_start(fleet_etcd_t *e, int ep, const char *path, const dp_buf_t *body,
                       size_t max_bytes, fleet_etcd_cb cb, void *data)
{
    call_t *c = dp_xcalloc(1, sizeof(*c));
    c->ep = ep;
    c->max = max_bytes;
    c->e = e;
    c->path = dp_xstrdup(path);
    if (body && body->len)
        dp_buf_append(&c->body, body->base, body->len);
    c->cb = cb;
    c->data = data;
    DP_LIST_PUSH(e->calls, c, next, prev);
    call_send(c);
}

void fleet_etcd_call_max(fleet_etcd_t *e, const char *path, const dp_buf_t *body, size_t max_bytes,
                         fleet_etcd_cb cb, void *data)
{
    call_start(e, -1, path, body, max_bytes, cb, data);
}

/* ---- the watch ------------------------------------------------------------------------------ */

static void watch_connect(fleet_etcd_t *e);

static void watch_retry_cb(uv_timer_t *t)
{
    fleet_etcd_t *e = t->data;
    if (e->wactive && e->wreq == NULL)
        watch_connect(e);
}

/* The stream ended or failed: tell the owner, reconnect elsewhere after a backoff. */
static void watch_lost(fleet_etcd_t *e, const char *why)
{
    bool was = e->wcreated;
    e->wcreated = false;
    fleet_ej_split_free(&e->split);
    memset(&e->split, 0, sizeof(e->split));
    e->split.max = e->max;
    if (e->neps)
        e->cur = (e->cur + 1) % e->neps;
    e->backoff_ms = e->backoff_ms ? e->backoff_ms * 2 : WATCH_BACKOFF_MIN_MS;
    if (e->backoff_ms > WATCH_BACKOFF_MAX_MS)
        e->backoff_ms = WATCH_BACKOFF_MAX_MS;
    if (e->wactive)
        uv_timer_start(&e->wtimer, watch_retry_cb, e->backoff_ms, 0);
    if (was && e->wcb.on_link)
        e->wcb.on_link(e->wdata, why);
}

/* One message of the stream. Returns non-zero to stop reading (the stream is dropped). */
static int watch_msg(const char *p, size_t n, void *data)
{
    fleet_etcd_t *e = data;
    cJSON *m = cJSON_ParseWithLength(p, n);
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "result");
    if (!cJSON_IsObject(r)) {
        cJSON_Delete(m);
        return 1; /* an error object ("no leader") or garbage */
    }
    int64_t compact = fleet_ej_rev(r, "compact_revision");
    if (compact > 0) {
        cJSON_Delete(m);
        e->compacted = compact; /* reported once the stream is dropped (w_body) */
        return 2;
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "canceled"))) {
        cJSON_Delete(m);
        return 1;
    }
    if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(r, "created"))) {
        e->wcreated = true;
        e->backoff_ms = 0;
        if (e->wcb.on_link)
            e->wcb.on_link(e->wdata, NULL);
    }
    const cJSON *ev;
    fleet_kv_t kv = {0};
    int64_t last = 0;
    cJSON_ArrayForEach(ev, cJSON_GetObjectItemCaseSensitive(r, "events"))
    {
        if (fleet_ej_kv(cJSON_GetObjectItemCaseSensitive(ev, "kv"), &kv) != 0)
            continue;
        const cJSON *t = cJSON_GetObjectItemCaseSensitive(ev, "type");
        bool del = cJSON_IsString(t) && strcmp(t->valuestring, "DELETE") == 0;
        if (kv.mod_revision > last)
            last = kv.mod_revision;
        e->wcb.on_kv(e->wdata, &kv, del);
        if (!e->wactive || e->wreq == NULL)
            break; /* stopped from the callback */
    }
    fleet_kv_free(&kv);
    int64_t rev = fleet_ej_revision(r);
    if (last > rev)
        rev = last;
    cJSON_Delete(m);
    if (!e->wactive || e->wreq == NULL)
        return 2;
    if (rev >= e->wnext)
        e->wnext = rev + 1;
    if (e->wcb.on_rev && rev > 0)
        e->wcb.on_rev(e->wdata, rev);
    return 0;
}

static void w_head(net_creq_t *r, int status, const net_header_t *h, size_t n,
                   const net_framing_t *f)
{
    (void)h;
    (void)n;
    (void)f;
    fleet_etcd_t *e = r->data;
    e->wstatus = status;
}

static void w_body(net_creq_t *r, const char *p, size_t n)
{
    fleet_etcd_t *e = r->data;
    /* An error answer (not 200) is one object without "result": watch_msg stops at it. */
    int rc = fleet_ej_split_feed(&e->split, p, n, watch_msg, e);
    if (rc == 0)
        return;
    if (e->wreq == r) {
        net_creq_cancel(r);
        e->wreq = NULL;
    }
    if (rc == 2) {
        int64_t compact = e->compacted;
        e->compacted = 0;
        if (compact > 0) {
            /* The owner reads the prefix again and restarts the watch from there. */
            e->wactive = false;
            if (e->wcb.on_compacted)
                e->wcb.on_compacted(e->wdata, compact);
        }
        return;
    }
    if (rc < 0) {
        /* A message it cannot read (over the cap: a batch of large writes missed while away,
         * or garbage) would come again from the same revision at every reconnect: the owner
         * reads the prefix instead and watches from there, as after a compaction. */
        bool was = e->wcreated;
        e->wactive = e->wcreated = false;
        fleet_ej_split_free(&e->split);
        memset(&e->split, 0, sizeof(e->split));
        e->split.max = e->max;
        if (was && e->wcb.on_link)
            e->wcb.on_link(e->wdata, "watch message malformed or over the size cap");
        if (e->wcb.on_compacted)
            e->wcb.on_compacted(e->wdata, 0);
        return;
    }
    watch_lost(e, "watch canceled");
}

static void w_done(net_creq_t *r, net_up_err_t err, const char *detail)
{
    fleet_etcd_t *e = r->data;
    e->wreq = NULL;
    char why[200];
    snprintf(why, sizeof(why), "watch on %s ended: %s", e->eps[e->cur].hostport,
             err == NET_UP_OK ? "end of stream"
             : detail         ? detail
                              : net_up_err_name(err));
    watch_lost(e, why);
}

static const net_creq_cb_t watch_cb = {.on_head = w_head, .on_body = w_body, .on_done = w_done};

static void watch_connect(fleet_etcd_t *e)
{
    endpoint_t *ep = &e->eps[e->cur];
    if (e->user && e->token == NULL) {
        /* A call fetches the token first; the watch tries again after it. */
        e->backoff_ms = WATCH_BACKOFF_MIN_MS;
        uv_timer_start(&e->wtimer, watch_retry_cb, e->backoff_ms, 0);
        return;
    }
    dp_buf_t body = {0}, req = {0};
    fleet_ej_watch_create(&body, e->wprefix, e->wnext);
    dp_buf_printf(&req,
                  "POST /v3/watch HTTP/1.1\r\nhost: %s\r\naccept: application/json\r\n"
                  "grpc-metadata-hasleader: true\r\n",
                  ep->hostport);
    if (e->token)
        dp_buf_printf(&req, "authorization: %s\r\n", e->token);
    dp_buf_printf(&req, "content-type: application/json\r\ncontent-length: %zu\r\n\r\n", body.len);
    dp_buf_append(&req, body.base, body.len);
    e->wstatus = 0;
    e->requests++;
    uv_buf_t b = uv_buf_init(req.base, (unsigned)req.len);
    e->wreq = net_creq_start(endpoint_up(e, ep, true), &b, 1, false, false, &watch_cb, e);
    dp_buf_free(&req);
    dp_buf_free(&body);
}

void fleet_etcd_watch(fleet_etcd_t *e, const char *prefix, int64_t start_rev,
                      const fleet_etcd_watch_cb_t *cb, void *data)
{
    fleet_etcd_watch_stop(e);
    free(e->wprefix);
    e->wprefix = dp_xstrdup(prefix);
    e->wcb = *cb;
    e->wdata = data;
    e->wnext = start_rev;
    e->wactive = true;
    e->backoff_ms = 0;
    if (e->neps)
        watch_connect(e);
}

void fleet_etcd_watch_stop(fleet_etcd_t *e)
{
    e->wactive = false;
    e->wcreated = false;
    uv_timer_stop(&e->wtimer);
    if (e->wreq) {
        net_creq_cancel(e->wreq);
        e->wreq = NULL;
    }
    fleet_ej_split_free(&e->split);
    memset(&e->split, 0, sizeof(e->split));
    e->split.max = e->max;
}

void fleet_etcd_watch_kick(fleet_etcd_t *e)
{
    if (!e->wactive || e->wreq == NULL)
        return;
    net_creq_cancel(e->wreq);
    e->wreq = NULL;
    watch_lost(e, "watch dropped: its endpoint failed");
}

bool fleet_etcd_watching(const fleet_etcd_t *e)
{
    return e->wcreated;
}
