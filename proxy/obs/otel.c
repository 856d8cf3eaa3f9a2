/* OpenTelemetry spans over OTLP/HTTP JSON (docs/operations.md §7); see otel.h for the shape of it.
 *
 * Attribute names follow the OpenTelemetry GenAI semantic conventions (gen_ai.*, openai.*),
 * plus detproxy.* for what only the proxy knows. Request values are the post-policy ones: what
 * the replica was asked, not what the client sent. Response values come from the bytes the
 * client got (so openai.response.system_fingerprint is the pool fingerprint detproxy put
 * there; the replica's own value is detproxy.upstream_fingerprint). */
#include "proxy/obs/otel.h"

#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "common/jw.h"
#include "common/log.h"
#include "common/util.h"
#include "net/fetch.h"
#include "net/resolve.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/self.h"

#define OTEL_QUEUE_SPANS 2048       /* finished spans waiting for export */
#define OTEL_QUEUE_BYTES (8u << 20) /* and their serialised size */
#define OTEL_BATCH_SPANS 256        /* export at once when this many wait */
#define OTEL_FLUSH_MS 1000          /* else at least this often */
#define OTEL_TIMEOUT_MS 10000       /* connect and response deadline of one export */
#define OTEL_HEAD_BYTES 65536       /* response bytes kept from the start... */
#define OTEL_TAIL_BYTES 16384       /* ...and from the end (a stream's last events) */
#define OTEL_MAX_FINISH 8           /* finish reasons recorded (choices 0..7) */

struct px_otel_ctx_s {
    char *key; /* hostport + path of the endpoint the upstream below speaks to */
    char *hostport;
    char *target; /* <path>/v1/traces */
    net_upstream_t *up;
    uv_timer_t timer;
    bool timer_ready;
    dp_buf_t queue; /* serialised spans, comma-separated */
    size_t nqueued;
    net_fetch_t *inflight;
    size_t ninflight;
    bool failing; /* the last export failed: logged once until one succeeds */
};
typedef struct px_otel_ctx_s otel_ctx_t;

struct px_span_s {
    uint8_t trace[16], span[8], parent[8];
    bool has_parent;
    uint64_t start_wall_ns, start_mono_ns;
    const char *route;
    char *model, *tenant, *pool, *fingerprint, *framework, *replica, *refused;
    bool stream, shadowed, has_policy;
    policy_result_t res; /* numbers only: body/model pointers are not kept valid */
    dp_buf_t overrides;  /* "param=action" strings, NUL-terminated one after another */
    dp_buf_t head, tail;
};

static px_series_t *count_series(const char *result)
{
    return px_metrics_get("detproxy_otel_spans_total", "result", result, NULL);
}

static otel_ctx_t *ctx_of(px_t *px)
{
    return px->otel;
}

/* ---- export ---------------------------------------------------------------------------------- */

static void export_now(px_t *px);

static void exported(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                     const char *detail, void *data)
{
    (void)f;
    (void)body;
    px_t *px = data;
    otel_ctx_t *c = ctx_of(px);
    c->inflight = NULL;
    bool ok = status >= 200 && status < 300;
    px_metrics_add(count_series(ok ? "exported" : "failed"), (double)c->ninflight);
    if (!ok && !c->failing) {
        dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "otel_export_failed");
        if (w) {
            dp_jw_str(w, "endpoint", c->hostport);
            dp_jw_int(w, "status", status);
            dp_jw_str(w, "error", status ? "bad status" : net_up_err_name(err));
            dp_jw_str(w, "detail", detail ? detail : "");
            dp_jw_uint(w, "spans", c->ninflight);
            dp_log_end(w);
        }
    }
    c->failing = !ok;
    c->ninflight = 0;
    if (c->nqueued >= OTEL_BATCH_SPANS)
        export_now(px);
}

static void export_now(px_t *px)
{
    otel_ctx_t *c = ctx_of(px);
    if (c == NULL || c->inflight || c->nqueued == 0 || c->up == NULL)
        return;
    dp_buf_t body = {0};
    dp_buf_reserve(&body, c->queue.len + 256);
    dp_buf_appends(&body, "{\"resourceSpans\":[{\"resource\":{\"attributes\":[{\"key\":"
                          "\"service.name\",\"value\":{\"stringValue\":\"detproxy\"}}]},"
                          "\"scopeSpans\":[{\"scope\":{\"name\":\"detproxy\"},\"spans\":[");
    dp_buf_append(&body, c->queue.base, c->queue.len);
    dp_buf_appends(&body, "]}]}]}");
    c->ninflight = c->nqueued;
    c->nqueued = 0;
    dp_buf_reset(&c->queue);
    net_fetch_opts_t o = {.via = px_self_via_line(NULL),
                          .method = "POST",
                          .hostport = c->hostport,
                          .target = c->target,
                          .body = body.base,
                          .body_len = body.len,
                          .max_bytes = 65536};
    c->inflight = net_fetch(c->up, &o, exported, px);
    dp_buf_free(&body);
}

static void on_timer(uv_timer_t *t)
{
    export_now(t->data);
}

static void drop_ctx_upstream(otel_ctx_t *c)
{
    if (c->inflight) {
        net_fetch_cancel(c->inflight);
        c->inflight = NULL;
        px_metrics_add(count_series("failed"), (double)c->ninflight);
        c->ninflight = 0;
    }
    if (c->up)
        net_upstream_free(c->up);
    c->up = NULL;
    free(c->key);
    free(c->hostport);
    free(c->target);
    c->key = c->hostport = c->target = NULL;
}

void px_otel_sync(px_t *px)
{
    const cfg_otel_t *o = px->gen->cfg->otel;
    otel_ctx_t *c = ctx_of(px);
    if (o == NULL) {
        if (c)
            drop_ctx_upstream(c);
        return;
    }
    if (c == NULL) {
        c = px->otel = dp_xcalloc(1, sizeof(*c));
        uv_timer_init(px->loop, &c->timer);
        c->timer.data = px;
        c->timer_ready = true;
        uv_timer_start(&c->timer, on_timer, OTEL_FLUSH_MS, OTEL_FLUSH_MS);
        uv_unref((uv_handle_t *)&c->timer); /* never what keeps the process alive */
    }
    dp_buf_t key = {0};
    dp_buf_printf(&key, "%s%s", o->endpoint.hostport, o->endpoint.path ? o->endpoint.path : "");
    if (c->key && strcmp(c->key, key.base) == 0) {
        dp_buf_free(&key);
        return;
    }
    drop_ctx_upstream(c);
    struct sockaddr_storage addr;
    if (!net_resolve(o->endpoint.host, o->endpoint.port, &addr)) {
        dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "otel_endpoint_unresolved");
        if (w) {
            dp_jw_str(w, "endpoint", key.base);
            dp_log_end(w);
        }
        dp_buf_free(&key);
        return; /* spans are dropped (counted) until a reload resolves it */
    }
    net_upstream_opts_t uo;
    px_replica_upstream_opts(px->gen->cfg, &uo);
    uo.connect_timeout_ms = OTEL_TIMEOUT_MS;
    uo.first_byte_timeout_ms = OTEL_TIMEOUT_MS;
    uo.idle_timeout_ms = OTEL_TIMEOUT_MS;
    uo.max_idle = 1;
    c->up = net_upstream_new(px->loop, (struct sockaddr *)&addr, &uo);
    c->key = dp_buf_steal(&key);
    c->hostport = dp_xstrdup(o->endpoint.hostport);
    dp_buf_t t = {0};
    dp_buf_printf(&t, "%s/v1/traces", o->endpoint.path ? o->endpoint.path : "");
    c->target = dp_buf_steal(&t);
}

static void ctx_closed(uv_handle_t *h)
{
    free(dp_container_of((uv_timer_t *)h, otel_ctx_t, timer));
}

void px_otel_stop(px_t *px)
{
    otel_ctx_t *c = ctx_of(px);
    if (c == NULL)
        return;
    drop_ctx_upstream(c);
    px_metrics_add(count_series("dropped"), (double)c->nqueued);
    dp_buf_free(&c->queue);
    c->nqueued = 0;
    px->otel = NULL;
    if (c->timer_ready)
        uv_close((uv_handle_t *)&c->timer, ctx_closed); /* frees c */
    else
        free(c);
}

/* ---- W3C trace context ----------------------------------------------------------------------- */

static bool hex_field(const char *p, size_t n, uint8_t *out)
{
    if (dp_unhex(p, n, out, n / 2) != 0)
        return false;
    for (size_t i = 0; i < n; i++)
        if (p[i] >= 'A' && p[i] <= 'F')
            return false; /* lowercase only */
    for (size_t i = 0; i < n / 2; i++)
        if (out[i])
            return true;
    return false; /* all zero is invalid */
}

/* "00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>"; later versions may append fields.
 * Returns the flags, or -1 when the header is invalid (then it is ignored). */
static int parse_traceparent(dp_iovec_t v, uint8_t trace[16], uint8_t parent[8])
{
    v = dp_trim_ows(v);
    uint8_t ver, flags;
    if (v.len < 55 || v.base[2] != '-' || v.base[35] != '-' || v.base[52] != '-')
        return -1;
    if (dp_unhex(v.base, 2, &ver, 1) != 0 || ver == 0xff || (ver == 0 && v.len != 55) ||
        (v.len > 55 && v.base[55] != '-'))
        return -1;
    if (!hex_field(v.base + 3, 32, trace) || !hex_field(v.base + 36, 16, parent) ||
        dp_unhex(v.base + 53, 2, &flags, 1) != 0 || (v.base[53] >= 'A' && v.base[53] <= 'F') ||
        (v.base[54] >= 'A' && v.base[54] <= 'F'))
        return -1;
    return flags;
}

/* The caller's trace context: its flags, or -1 when there is none to continue (absent, invalid,
 * or sent twice: which of two would be the parent is anyone's guess, so neither is). */
static int client_trace(const net_req_t *req, uint8_t trace[16], uint8_t parent[8])
{
    const net_header_t *tp = NULL;
    for (size_t i = 0; i < req->nheaders; i++) {
        const net_header_t *h = &req->headers[i];
        if (!dp_strieq(h->name.base, h->name.len, "traceparent"))
            continue;
        if (tp)
            return -1;
        tp = h;
    }
    return tp ? parse_traceparent(tp->value, trace, parent) : -1;
}

static char *dup_or_null(const char *s)
{
    return s ? dp_xstrdup(s) : NULL;
}

px_span_t *px_otel_start(px_t *px, const net_req_t *req, const char *route, char traceparent[56],
                         bool *new_trace)
{
    traceparent[0] = '\0';
    *new_trace = false;
    const cfg_otel_t *o = px_thread_gen(px)->cfg->otel;
    if (o == NULL)
        return NULL;
    uint8_t trace[16], parent[8];
    int flags = client_trace(req, trace, parent);
    bool sampled;
    if (flags >= 0) {
        sampled = flags & 1; /* parent-based: the caller decided */
    } else {
        uint64_t r = 0;
        dp_random_bytes(&r, sizeof(r));
        sampled = (double)(r >> 11) * 0x1p-53 < o->sample_rate;
    }
    if (!sampled)
        return NULL;
    px_span_t *s = dp_xcalloc(1, sizeof(*s));
    if (flags >= 0) {
        memcpy(s->trace, trace, 16);
        memcpy(s->parent, parent, 8);
        s->has_parent = true;
    } else {
        *new_trace = true;
        do
            dp_random_bytes(s->trace, sizeof(s->trace));
        while (!s->trace[0] && !memcmp(s->trace, s->trace + 1, 15));
    }
    do
        dp_random_bytes(s->span, sizeof(s->span));
    while (!s->span[0] && !memcmp(s->span, s->span + 1, 7));
    s->start_wall_ns = dp_wall_ms() * 1000000ull;
    s->start_mono_ns = dp_now_ns();
    s->route = route;
    char th[33], sh[17];
    dp_hex(s->trace, 16, th);
    dp_hex(s->span, 8, sh);
    snprintf(traceparent, 56, "00-%s-%s-01", th, sh);
    return s;
}

void px_otel_request(px_span_t *s, const char *tenant, const px_pool_t *pool,
                     const policy_result_t *res)
{
    if (s == NULL)
        return;
    s->tenant = dup_or_null(tenant);
    s->pool = dup_or_null(pool->name);
    s->fingerprint = dup_or_null(pool->fingerprint);
    s->framework = dup_or_null(pool->cfg->manifest ? pool->cfg->manifest->framework_name : NULL);
    s->model = dp_xstrndup(res->model.base, res->model.len);
    s->stream = res->stream;
    s->has_policy = true;
    s->res = *res;
    s->res.parts = NULL; /* the body pieces and changes are the request's, gone by export */
    s->res.nparts = 0;
    s->res.changes = NULL;
    s->res.nchanges = 0;
    s->res.model = (dp_iovec_t){0};
    for (size_t i = 0; i < res->nchanges; i++) {
        dp_buf_printf(&s->overrides, "%s=%s", res->changes[i].param,
                      policy_action_names[res->changes[i].action]);
        dp_buf_appendc(&s->overrides, '\0');
    }
}

void px_otel_refused(px_span_t *s, const char *code)
{
    if (s && s->refused == NULL)
        s->refused = dp_xstrdup(code ? code : "refused");
}

void px_otel_replica(px_span_t *s, const char *replica, bool shadowed)
{
    if (s == NULL)
        return;
    free(s->replica);
    s->replica = dup_or_null(replica);
    s->shadowed |= shadowed;
}

void px_otel_bytes(px_span_t *s, const char *p, size_t n)
{
    if (s == NULL || n == 0)
        return;
    size_t room = s->head.len < OTEL_HEAD_BYTES ? OTEL_HEAD_BYTES - s->head.len : 0;
    size_t k = n < room ? n : room;
    dp_buf_append(&s->head, p, k);
    p += k;
    n -= k;
    if (n == 0)
        return;
    if (n >= OTEL_TAIL_BYTES) {
        dp_buf_reset(&s->tail);
        dp_buf_append(&s->tail, p + n - OTEL_TAIL_BYTES, OTEL_TAIL_BYTES);
        return;
    }
    dp_buf_append(&s->tail, p, n);
    if (s->tail.len > 2 * OTEL_TAIL_BYTES)
        dp_buf_consume(&s->tail, s->tail.len - OTEL_TAIL_BYTES);
}

/* ---- the response's attributes --------------------------------------------------------------- */

typedef struct {
    char id[128], model[128], fp[128];
    char finish[OTEL_MAX_FINISH][32];
    bool has_in, has_out;
    double in, out;
} resp_info_t;

static void take_str(char *dst, size_t cap, const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    if (dst[0] == '\0' && cJSON_IsString(v) && v->valuestring)
        snprintf(dst, cap, "%s", v->valuestring);
}

static void take_usage(resp_info_t *ri, const cJSON *u)
{
    static const char *const in[] = {"prompt_tokens", "input_tokens"};
    static const char *const out[] = {"completion_tokens", "output_tokens"};
    if (!cJSON_IsObject(u))
        return;
    for (int i = 0; i < 2; i++) {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(u, in[i]);
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(u, out[i]);
        /* A count out of range (a replica's 1e300) is no count: the span's integer attribute
         * takes it as an int64_t. */
        if (cJSON_IsNumber(a) && a->valuedouble >= 0 && a->valuedouble <= 1e15) {
            ri->has_in = true;
            ri->in = a->valuedouble;
        }
        if (cJSON_IsNumber(b) && b->valuedouble >= 0 && b->valuedouble <= 1e15) {
            ri->has_out = true;
            ri->out = b->valuedouble;
        }
    }
}

/* A whole response, a chat/completions chunk, or a Responses stream event. */
static void info_from(resp_info_t *ri, const cJSON *o)
{
    if (!cJSON_IsObject(o))
        return;
    const cJSON *inner = cJSON_GetObjectItemCaseSensitive(o, "response");
    if (cJSON_IsObject(inner)) /* response.created / .completed / ... events */
        o = inner;
    take_str(ri->id, sizeof(ri->id), o, "id");
    take_str(ri->model, sizeof(ri->model), o, "model");
    take_str(ri->fp, sizeof(ri->fp), o, "system_fingerprint");
    take_usage(ri, cJSON_GetObjectItemCaseSensitive(o, "usage"));
    const cJSON *obj = cJSON_GetObjectItemCaseSensitive(o, "object");
    const cJSON *status = cJSON_GetObjectItemCaseSensitive(o, "status");
    if (cJSON_IsString(obj) && strcmp(obj->valuestring, "response") == 0 &&
        cJSON_IsString(status) && strcmp(status->valuestring, "in_progress") != 0)
        snprintf(ri->finish[0], sizeof(ri->finish[0]), "%s", status->valuestring);
    const cJSON *ch;
    int pos = 0;
    cJSON_ArrayForEach(ch, cJSON_GetObjectItemCaseSensitive(o, "choices"))
    {
        const cJSON *ix = cJSON_GetObjectItemCaseSensitive(ch, "index");
        /* Converted only once known to fit (a replica's "index": 1e300 would not). */
        int i = pos++;
        if (cJSON_IsNumber(ix))
            i = ix->valuedouble >= 0 && ix->valuedouble < OTEL_MAX_FINISH ? (int)ix->valuedouble
                                                                          : -1;
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(ch, "finish_reason");
        if (i >= 0 && i < OTEL_MAX_FINISH && cJSON_IsString(f) && f->valuestring)
            snprintf(ri->finish[i], sizeof(ri->finish[i]), "%s", f->valuestring);
    }
}

/* Every `data:` line of an SSE capture (a tail may start mid-line: that line does not parse). */
static void info_from_sse(resp_info_t *ri, const dp_buf_t *b)
{
    const char *p = b->base, *end = b->base + b->len;
    while (p && p < end) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        if (le - p > 5 && memcmp(p, "data:", 5) == 0) {
            const char *d = p + 5;
            while (d < le && *d == ' ')
                d++;
            cJSON *j = cJSON_ParseWithLength(d, (size_t)(le - d));
            info_from(ri, j);
            cJSON_Delete(j);
        }
        p = nl ? nl + 1 : NULL;
    }
}

/* ---- serialisation --------------------------------------------------------------------------- */

static void attr_begin(dp_jw_t *w, const char *key)
{
    dp_jw_obj_begin(w, NULL);
    dp_jw_str(w, "key", key);
    dp_jw_obj_begin(w, "value");
}

static void attr_end(dp_jw_t *w)
{
    dp_jw_obj_end(w);
    dp_jw_obj_end(w);
}

static void attr_str(dp_jw_t *w, const char *key, const char *v)
{
    if (v == NULL || v[0] == '\0')
        return;
    attr_begin(w, key);
    dp_jw_str(w, "stringValue", v);
    attr_end(w);
}

static void attr_int(dp_jw_t *w, const char *key, int64_t v)
{
    char b[24];
    snprintf(b, sizeof(b), "%lld", (long long)v); /* OTLP JSON: 64-bit integers as strings */
    attr_begin(w, key);
    dp_jw_str(w, "intValue", b);
    attr_end(w);
}

static void attr_double(dp_jw_t *w, const char *key, double v)
{
    attr_begin(w, key);
    dp_jw_double(w, "doubleValue", v);
    attr_end(w);
}

/* An array attribute from n NUL-terminated strings packed one after another. */
static void attr_strs(dp_jw_t *w, const char *key, const char *packed, size_t len)
{
    if (len == 0)
        return;
    attr_begin(w, key);
    dp_jw_obj_begin(w, "arrayValue");
    dp_jw_arr_begin(w, "values");
    for (const char *p = packed; p < packed + len; p += strlen(p) + 1) {
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "stringValue", p);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
    attr_end(w);
}

static const char *operation(const char *route)
{
    return route && strcmp(route, "/v1/completions") == 0 ? "text_completion" : "chat";
}

static void serialise(const px_span_t *s, int status, const char *request_id,
                      const char *upstream_fp, const resp_info_t *ri, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    char th[33], sh[17], ph[17];
    dp_hex(s->trace, 16, th);
    dp_hex(s->span, 8, sh);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "traceId", th);
    dp_jw_str(&w, "spanId", sh);
    if (s->has_parent) {
        dp_hex(s->parent, 8, ph);
        dp_jw_str(&w, "parentSpanId", ph);
    }
    dp_buf_t name = {0};
    dp_buf_printf(&name, "%s %s", operation(s->route), s->model ? s->model : "");
    dp_jw_str(&w, "name", name.base);
    dp_buf_free(&name);
    dp_jw_int(&w, "kind", 2); /* SPAN_KIND_SERVER: detproxy serves the client's request */
    char ts[24];
    snprintf(ts, sizeof(ts), "%llu", (unsigned long long)s->start_wall_ns);
    dp_jw_str(&w, "startTimeUnixNano", ts);
    snprintf(ts, sizeof(ts), "%llu",
             (unsigned long long)(s->start_wall_ns + (dp_now_ns() - s->start_mono_ns)));
    dp_jw_str(&w, "endTimeUnixNano", ts);

    dp_jw_arr_begin(&w, "attributes");
    attr_str(&w, "gen_ai.operation.name", operation(s->route));
    attr_str(&w, "gen_ai.system", s->framework ? s->framework : "openai");
    attr_str(&w, "gen_ai.request.model", s->model);
    const policy_result_t *r = &s->res;
    if (s->has_policy) {
        if (r->has_temperature)
            attr_double(&w, "gen_ai.request.temperature", r->temperature);
        if (r->has_seed)
            attr_int(&w, "gen_ai.request.seed", (int64_t)r->seed);
        if (r->has_top_p)
            attr_double(&w, "gen_ai.request.top_p", r->top_p);
        if (r->has_max_tokens)
            attr_int(&w, "gen_ai.request.max_tokens", r->max_tokens);
    }
    attr_str(&w, "gen_ai.response.model", ri->model);
    attr_str(&w, "gen_ai.response.id", ri->id);
    dp_buf_t fin = {0};
    for (int i = 0; i < OTEL_MAX_FINISH; i++) {
        if (ri->finish[i][0]) {
            dp_buf_appends(&fin, ri->finish[i]);
            dp_buf_appendc(&fin, '\0');
        }
    }
    attr_strs(&w, "gen_ai.response.finish_reasons", fin.base, fin.len);
    dp_buf_free(&fin);
    attr_str(&w, "openai.response.system_fingerprint", ri->fp);
    if (ri->has_in)
        attr_int(&w, "gen_ai.usage.input_tokens", (int64_t)ri->in);
    if (ri->has_out)
        attr_int(&w, "gen_ai.usage.output_tokens", (int64_t)ri->out);
    attr_str(&w, "http.request.method", "POST");
    attr_str(&w, "http.route", s->route);
    attr_int(&w, "http.response.status_code", status);
    if (s->refused)
        attr_str(&w, "error.type", s->refused);
    else if (status >= 500 || status == 499)
        attr_str(&w, "error.type", status == 499 ? "client_closed" : "upstream");
    attr_str(&w, "detproxy.request_id", request_id);
    attr_str(&w, "detproxy.tenant", s->tenant);
    attr_str(&w, "detproxy.pool", s->pool);
    attr_str(&w, "detproxy.replica", s->replica);
    attr_str(&w, "detproxy.fingerprint", s->fingerprint);
    attr_str(&w, "detproxy.upstream_fingerprint", upstream_fp);
    attr_strs(&w, "detproxy.policy.overrides", s->overrides.base, s->overrides.len);
    if (s->has_policy) {
        /* The shadow's comparison ends after the client's response: its result is in
         * detproxy_shadow_total and /admin/drift, keyed by the same request id. */
        attr_str(&w, "detproxy.shadow", s->shadowed ? "sampled" : "none");
    }
    dp_jw_arr_end(&w);
    dp_jw_obj_begin(&w, "status");
    dp_jw_int(&w, "code", status >= 500 ? 2 : 0); /* ERROR for 5xx, else UNSET */
    dp_jw_obj_end(&w);
    dp_jw_obj_end(&w);
}

static void span_free(px_span_t *s)
{
    free(s->model);
    free(s->tenant);
    free(s->pool);
    free(s->fingerprint);
    free(s->framework);
    free(s->replica);
    free(s->refused);
    dp_buf_free(&s->overrides);
    dp_buf_free(&s->head);
    dp_buf_free(&s->tail);
    free(s);
}

static void end_here(px_t *px, px_span_t *s, int status, const char *request_id,
                     const char *upstream_fingerprint);

/* A finished span, from a worker to the exporter on the control thread. */
typedef struct {
    net_mb_node_t node;
    px_t *px;
    px_span_t *s;
    int status;
    char request_id[24];
    char upstream_fp[128];
    bool has_fp;
} span_msg_t;

static void end_posted(net_mb_node_t *n)
{
    span_msg_t *m = (span_msg_t *)n;
    end_here(m->px, m->s, m->status, m->request_id, m->has_fp ? m->upstream_fp : NULL);
    free(m);
}

void px_otel_end(px_t *px, px_span_t *s, int status, const char *request_id,
                 const char *upstream_fingerprint)
{
    if (s == NULL)
        return;
    if (px_thread_on_control()) {
        end_here(px, s, status, request_id, upstream_fingerprint);
        return;
    }
    span_msg_t *m = dp_xmalloc(sizeof(*m));
    m->px = px;
    m->s = s;
    m->status = status;
    snprintf(m->request_id, sizeof(m->request_id), "%s", request_id ? request_id : "");
    m->has_fp = upstream_fingerprint != NULL;
    snprintf(m->upstream_fp, sizeof(m->upstream_fp), "%s",
             upstream_fingerprint ? upstream_fingerprint : "");
    if (!px_thread_try_post_control(px, &m->node, end_posted)) {
        px_metrics_add(count_series("dropped"), 1); /* the control thread is that far behind */
        span_free(s);
        free(m);
    }
}

static void end_here(px_t *px, px_span_t *s, int status, const char *request_id,
                     const char *upstream_fingerprint)
{
    PX_ASSERT_CONTROL();
    otel_ctx_t *c = ctx_of(px);
    if (c == NULL || c->up == NULL || c->nqueued >= OTEL_QUEUE_SPANS ||
        c->queue.len >= OTEL_QUEUE_BYTES) {
        px_metrics_add(count_series("dropped"), 1);
        span_free(s);
        return;
    }
    resp_info_t ri;
    memset(&ri, 0, sizeof(ri));
    if (s->stream) {
        info_from_sse(&ri, &s->head);
        info_from_sse(&ri, &s->tail);
    } else if (s->tail.len == 0 && s->head.len) {
        cJSON *j = cJSON_ParseWithLength(s->head.base, s->head.len);
        info_from(&ri, j);
        cJSON_Delete(j);
    }
    if (c->nqueued)
        dp_buf_appendc(&c->queue, ',');
    serialise(s, status, request_id, upstream_fingerprint, &ri, &c->queue);
    c->nqueued++;
    span_free(s);
    if (c->nqueued >= OTEL_BATCH_SPANS)
        export_now(px);
}
