/* Blocking exchanges for the command-line tools (proxy/cli/fetch.h). */
#include "proxy/cli/fetch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "net/fetch.h"
#include "net/resolve.h"
#include "proxy/core/px.h"
#include "proxy/core/self.h"

void px_fetch_init(px_fetch_t *w)
{
    memset(w, 0, sizeof(*w));
    uv_loop_init(&w->loop);
}

void px_fetch_free(px_fetch_t *w)
{
    dp_buf_free(&w->body);
    dp_buf_free(&w->err);
    uv_run(&w->loop, UV_RUN_DEFAULT);
    uv_loop_close(&w->loop);
}

static void fetched(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                    const char *detail, void *data)
{
    (void)f;
    px_fetch_t *w = data;
    w->done = true;
    w->status = status;
    dp_buf_reset(&w->body);
    dp_buf_reset(&w->err);
    if (body && body->len)
        dp_buf_append(&w->body, body->base, body->len);
    if (status == 0)
        dp_buf_printf(&w->err, "%s%s%s", net_up_err_name(err), detail ? ": " : "",
                      detail ? detail : "");
}

static void deadline_cb(uv_timer_t *t)
{
    px_fetch_t *w = t->data;
    w->timed_out = true;
}

static void timer_closed(uv_handle_t *h)
{
    (void)h;
}

int px_fetch(px_fetch_t *w, const cfg_t *cfg, const char *host, uint16_t port, net_tls_ctx_t *tls,
             const char *server_name, const char *hostport, const char *method, const char *target,
             const char *bearer, const char *extra_headers, const char *body, size_t len)
{
    struct sockaddr_storage ss;
    if (!net_resolve(host, port, &ss)) {
        dp_buf_reset(&w->err);
        dp_buf_printf(&w->err, "host name '%s' did not resolve", host);
        return 0;
    }
    net_upstream_opts_t uo;
    px_replica_upstream_opts(cfg, &uo);
    uo.max_idle = 1;
    net_upstream_t *u = net_upstream_new(&w->loop, (struct sockaddr *)&ss, &uo);
    /* verified exactly as the proxy verifies its replicas (docs/security.md §3, "Replicas and
     * agents") */
    if (tls)
        net_upstream_set_tls(u, tls, server_name ? server_name : host);
    net_fetch_opts_t o = {.via = px_self_via_line(NULL),
                          .method = method,
                          .hostport = hostport,
                          .target = target,
                          .bearer = bearer,
                          .extra_headers = extra_headers,
                          .body = body,
                          .body_len = len,
                          .max_bytes = PX_FETCH_MAX_BODY};
    w->done = false;
    w->timed_out = false;
    uint64_t now = dp_now_ns();
    if (w->deadline_ns && now >= w->deadline_ns) {
        net_upstream_free(u);
        dp_buf_reset(&w->err);
        dp_buf_appends(&w->err, "deadline: --timeout passed");
        return 0;
    }
    uv_timer_t timer;
    uv_timer_init(&w->loop, &timer);
    timer.data = w;
    if (w->deadline_ns)
        uv_timer_start(&timer, deadline_cb, (w->deadline_ns - now) / 1000000 + 1, 0);
    net_fetch_t *f = net_fetch(u, &o, fetched, w);
    while (!w->done && !w->timed_out)
        uv_run(&w->loop, UV_RUN_ONCE);
    if (!w->done) {
        net_fetch_cancel(f);
        w->status = 0;
        dp_buf_reset(&w->body);
        dp_buf_reset(&w->err);
        dp_buf_appends(&w->err, "deadline: --timeout passed");
    }
    uv_close((uv_handle_t *)&timer, timer_closed);
    uv_run(&w->loop, UV_RUN_NOWAIT);
    net_upstream_free(u);
    uv_run(&w->loop, UV_RUN_NOWAIT);
    return w->status;
}

cfg_t *px_fetch_config(const char *path)
{
    cfg_errors_t errs = {0};
    cfg_t *cfg = NULL;
    if (cfg_load(path, &cfg, &errs) != 0)
        for (size_t i = 0; i < errs.count; i++)
            fprintf(stderr, "%s: %s\n", path, errs.items[i]);
    cfg_errors_free(&errs);
    return cfg;
}

int px_fetch_admin_addr(const char *cmd, const cfg_t *cfg, const char *flag, cfg_addr_t *out)
{
    const char *why = NULL;
    memset(out, 0, sizeof(*out));
    if (flag) {
        if (cfg_parse_addr(flag, out, &why) != 0) {
            fprintf(stderr, "%s: --admin %s: %s\n", cmd, flag, why);
            free(out->host);
            out->host = NULL;
            return 2;
        }
        return 0;
    }
    if (cfg->admin_listen.port == 0) {
        fprintf(stderr,
                "%s: admin_listen has port 0: say where the proxy's admin API is with --admin "
                "HOST:PORT\n",
                cmd);
        return 2;
    }
    out->host = dp_xstrdup(cfg->admin_listen.host);
    out->port = cfg->admin_listen.port;
    return 0;
}

void px_fetch_escape(const char *s, size_t n, dp_buf_t *out)
{
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 || c == 0x7f) {
            char e[4] = {'\\', 'x', hex[c >> 4], hex[c & 15]};
            dp_buf_append(out, e, 4);
        } else {
            dp_buf_appendc(out, (char)c);
        }
    }
}

const char *px_fetch_safe(unsigned slot, const char *s)
{
    static dp_buf_t bufs[4];
    dp_buf_t *b = &bufs[slot & 3];
    dp_buf_reset(b);
    if (s)
        px_fetch_escape(s, strlen(s), b);
    return b->base ? b->base : "";
}

static void admin_hostport(const cfg_addr_t *admin, char *hp, size_t n)
{
    const char *h = admin->host;
    snprintf(hp, n, strchr(h, ':') ? "[%s]:%u" : "%s:%u", h, (unsigned)admin->port);
}

int px_fetch_admin_post(px_fetch_t *w, const char *cmd, const cfg_t *cfg, const cfg_addr_t *admin,
                        const char *target, const char *extra_headers, const char *body, size_t len)
{
    char hp[300];
    admin_hostport(admin, hp, sizeof(hp));
    int st = px_fetch(w, cfg, admin->host, admin->port, NULL, NULL, hp, "POST", target,
                      cfg->admin_token, extra_headers, body, len);
    if (st == 0) {
        dp_buf_t e = {0};
        px_fetch_escape(w->err.base ? w->err.base : "", w->err.len, &e);
        fprintf(stderr, "%s: POST %s on %s: %s (is the proxy running?)\n", cmd, target, hp,
                e.base ? e.base : "");
        dp_buf_free(&e);
    }
    return st;
}

int px_fetch_admin_get(px_fetch_t *w, const char *cmd, const cfg_t *cfg, const cfg_addr_t *admin,
                       const char *target)
{
    char hp[300];
    admin_hostport(admin, hp, sizeof(hp));
    int st = px_fetch(w, cfg, admin->host, admin->port, NULL, NULL, hp, "GET", target,
                      cfg->admin_token, NULL, NULL, 0);
    if (st == 200)
        return 0;
    /* The answer is remote text: escaped, so it cannot forge a line on the terminal. */
    dp_buf_t e = {0};
    if (st)
        px_fetch_escape(w->body.base ? w->body.base : "", w->body.len > 300 ? 300 : w->body.len,
                        &e);
    else
        px_fetch_escape(w->err.base ? w->err.base : "", w->err.len, &e);
    if (st)
        fprintf(stderr, "%s: GET %s on %s: HTTP %d %s\n", cmd, target, hp, st,
                e.base ? e.base : "");
    else
        fprintf(stderr, "%s: GET %s on %s: %s (is the proxy running?)\n", cmd, target, hp,
                e.base ? e.base : "");
    dp_buf_free(&e);
    return -1;
}
