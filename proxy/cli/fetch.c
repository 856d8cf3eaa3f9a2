/* Blocking exchanges for the command-line tools (proxy/cli/fetch.h). */
#include "proxy/cli/fetch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

int px_fetch(px_fetch_t *w, const cfg_t *cfg, const char *host, uint16_t port, net_tls_ctx_t *tls,
             const char *server_name, const char *hostport, const char *method, const char *target,
             const char *bearer, const char *body, size_t len)
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
                          .body = body,
                          .body_len = len,
                          .max_bytes = PX_FETCH_MAX_BODY};
    w->done = false;
    net_fetch(u, &o, fetched, w);
    while (!w->done)
        uv_run(&w->loop, UV_RUN_ONCE);
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

int px_fetch_admin_get(px_fetch_t *w, const char *cmd, const cfg_t *cfg, const cfg_addr_t *admin,
                       const char *target)
{
    char hp[300];
    const char *h = admin->host;
    snprintf(hp, sizeof(hp), strchr(h, ':') ? "[%s]:%u" : "%s:%u", h, (unsigned)admin->port);
    int st =
        px_fetch(w, cfg, h, admin->port, NULL, NULL, hp, "GET", target, cfg->admin_token, NULL, 0);
    if (st == 200)
        return 0;
    if (st)
        fprintf(stderr, "%s: GET %s on %s: HTTP %d %.*s\n", cmd, target, hp, st,
                (int)(w->body.len > 300 ? 300 : w->body.len), w->body.base ? w->body.base : "");
    else
        fprintf(stderr, "%s: GET %s on %s: %.*s (is the proxy running?)\n", cmd, target, hp,
                (int)w->err.len, w->err.base ? w->err.base : "");
    return -1;
}
