#include "net/fetch.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct px_fetch_s {
    px_creq_t *c;
    px_fetch_cb cb;
    void *data;
    int status;
    size_t max;
    bool too_big;
    dp_buf_t body;
};

static void f_free(px_fetch_t *f)
{
    dp_buf_free(&f->body);
    free(f);
}

static void on_head(px_creq_t *c, int status, const px_header_t *h, size_t n,
                    const px_framing_t *fr)
{
    px_fetch_t *f = c->data;
    (void)h;
    (void)n;
    f->status = status;
    if (fr->content_length > 0 && (uint64_t)fr->content_length > f->max)
        f->too_big = true;
}

static void on_body(px_creq_t *c, const char *p, size_t n)
{
    px_fetch_t *f = c->data;
    if (f->too_big)
        return;
    if (f->body.len + n > f->max) {
        f->too_big = true;
        return;
    }
    dp_buf_append(&f->body, p, n);
}

static void on_done(px_creq_t *c, px_up_err_t err, const char *detail)
{
    px_fetch_t *f = c->data;
    f->c = NULL;
    if (err == PX_UP_OK && f->too_big) {
        char why[96];
        snprintf(why, sizeof(why), "response body larger than %zu bytes", f->max);
        f->cb(f, 0, &f->body, PX_UP_PROTOCOL, why, f->data);
    } else {
        f->cb(f, err == PX_UP_OK ? f->status : 0, &f->body, err, detail, f->data);
    }
    f_free(f);
}

static const px_creq_cb_t fetch_cb = {on_head, on_body, on_done, NULL};

px_fetch_t *px_fetch(px_upstream_t *u, const px_fetch_opts_t *o, px_fetch_cb cb, void *data)
{
    px_fetch_t *f = dp_xcalloc(1, sizeof(*f));
    f->cb = cb;
    f->data = data;
    f->max = o->max_bytes ? o->max_bytes : 1 << 20;
    dp_buf_t req = {0};
    dp_buf_printf(&req, "%s %s HTTP/1.1\r\nhost: %s\r\naccept: application/json\r\n", o->method,
                  o->target, o->hostport);
    if (o->bearer)
        dp_buf_printf(&req, "authorization: Bearer %s\r\n", o->bearer);
    if (o->extra_headers)
        dp_buf_appends(&req, o->extra_headers);
    if (o->via)
        dp_buf_appends(&req, o->via);
    if (o->body) {
        dp_buf_printf(&req, "content-type: application/json\r\ncontent-length: %zu\r\n\r\n",
                      o->body_len);
        dp_buf_append(&req, o->body, o->body_len);
    } else {
        dp_buf_append(&req, "\r\n", 2);
    }
    uv_buf_t b = uv_buf_init(req.base, (unsigned)req.len);
    f->c = px_creq_start(u, &b, 1, false, false, &fetch_cb, f);
    dp_buf_free(&req);
    return f;
}

void px_fetch_cancel(px_fetch_t *f)
{
    if (f->c)
        px_creq_cancel(f->c);
    f_free(f);
}
