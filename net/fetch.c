#include "net/fetch.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct net_fetch_s {
    net_creq_t *c;
    net_fetch_cb cb;
    void *data;
    int status;
    size_t max;
    bool in_open_cb; /* the callback runs with the exchange still open (net_fetch_open) */
    bool told;       /* ... and has had its answer: the exchange ends (on_done frees f) */
    bool drained;    /* ... and made the exchange a drain: f is freed once it returns */
    dp_buf_t body;
};

static void f_free(net_fetch_t *f)
{
    dp_buf_free(&f->body);
    free(f);
}

/* Over the cap: the fetch fails now. A replica that announces a huge body, or streams one
 * without end, would otherwise hold the fetch (an attestation, a canary) for as long as it keeps
 * sending, only for the body to be refused at its end. The callback is told while the exchange
 * is still open, so one whose engine may still be at work on it can read the rest to its end as
 * a drain; otherwise the connection is reset. Runs inside on_head / on_body, where both
 * net_creq_drain and net_creq_cancel are allowed. */
static void too_big(net_fetch_t *f)
{
    char why[96];
    snprintf(why, sizeof(why), "response body larger than %zu bytes", f->max);
    f->in_open_cb = true;
    f->cb(f, 0, &f->body, NET_UP_PROTOCOL, why, f->data);
    f->in_open_cb = false;
    if (!f->drained)
        net_creq_cancel(f->c);
    f_free(f);
}

static void on_head(net_creq_t *c, int status, const net_header_t *h, size_t n,
                    const net_framing_t *fr)
{
    net_fetch_t *f = c->data;
    assert(f->c == c); /* callbacks never fire inside net_creq_start, so f->c is set */
    (void)h;
    (void)n;
    f->status = status;
    bool bodiless = status == 204 || status == 304; /* their length is not a body's */
    if (!bodiless && fr->content_length > 0 && (uint64_t)fr->content_length > f->max)
        too_big(f);
}

static void on_body(net_creq_t *c, const char *p, size_t n)
{
    net_fetch_t *f = c->data;
    assert(f->c == c);
    if (f->body.len + n > f->max) {
        too_big(f);
        return;
    }
    dp_buf_append(&f->body, p, n);
}

static void on_done(net_creq_t *c, net_up_err_t err, const char *detail)
{
    net_fetch_t *f = c->data;
    assert(f->c == c);
    f->c = NULL;
    if (!f->told)
        f->cb(f, err == NET_UP_OK ? f->status : 0, &f->body, err, detail, f->data);
    f_free(f);
}

/* No answer began in time, or the answer fell silent mid-way: the callback is told now, while
 * the exchange is still open, and may make it a drain (net_fetch_drain). */
static void timed_out(net_creq_t *c, net_up_err_t err, const char *detail)
{
    net_fetch_t *f = c->data;
    assert(f->c == c);
    f->in_open_cb = true;
    f->cb(f, 0, &f->body, err, detail, f->data);
    f->in_open_cb = false;
    if (f->drained) {
        f_free(f);
        return;
    }
    f->told = true; /* the exchange ends now: on_done frees f */
}

static const net_creq_cb_t fetch_cb = {
    .on_head = on_head, .on_body = on_body, .on_done = on_done, .on_timeout = timed_out};

net_fetch_t *net_fetch(net_upstream_t *u, const net_fetch_opts_t *o, net_fetch_cb cb, void *data)
{
    net_fetch_t *f = dp_xcalloc(1, sizeof(*f));
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
    f->c = net_creq_start(u, &b, 1, false, false, &fetch_cb, f);
    f->c->length_required = o->length_required;
    if (o->deadline_ms)
        net_creq_set_deadline(f->c, o->deadline_ms);
    dp_buf_free(&req);
    return f;
}

bool net_fetch_open(const net_fetch_t *f)
{
    return f->in_open_cb;
}

bool net_fetch_failed_running(const net_fetch_t *f, int status, net_up_err_t err)
{
    return status == 0 && !net_fetch_open(f) && net_up_err_may_run(err);
}

bool net_fetch_sent(const net_fetch_t *f)
{
    return f->c && net_creq_sent(f->c);
}

void net_fetch_drain(net_fetch_t *f, net_drains_t *set, uint64_t max_ms, net_drain_done_fn done,
                     void *data)
{
    assert(f->c != NULL && !f->told && !f->drained);
    net_creq_drain(f->c, set, max_ms, done, data);
    if (f->in_open_cb)
        f->drained = true; /* freed once the callback returns */
    else
        f_free(f);
}

void net_fetch_cancel(net_fetch_t *f)
{
    assert(!f->drained); /* f is gone: the exchange is the drain's */
    if (f->in_open_cb)   /* the exchange ends when the callback returns */
        return;
    if (f->c)
        net_creq_cancel(f->c);
    f_free(f);
}
