#include "proxy/sock.h"

#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "common/buf.h"

/* One read buffer for the whole process: every read callback consumes or copies its bytes
 * before returning, and there is one event loop per process. */
static char g_read_buf[PX_READ_BUF_SIZE];

typedef struct {
    uv_write_t req;
    px_sock_t *sock;
    size_t len;
    char data[];
} write_req_t;

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)h;
    (void)suggested;
    buf->base = g_read_buf;
    buf->len = sizeof(g_read_buf);
}

static void fail(px_sock_t *s, int status)
{
    if (s->errored || s->closing)
        return;
    s->errored = true;
    if (s->on_error)
        s->on_error(s, status);
}

static void read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    px_sock_t *s = st->data;
    (void)buf;
    if (nread > 0) {
        if (s->on_read)
            s->on_read(s, g_read_buf, (size_t)nread);
        return;
    }
    if (nread < 0) {
        px_sock_read_stop(s);
        fail(s, (int)nread);
    }
}

int px_sock_init(uv_loop_t *loop, px_sock_t *s, void *owner)
{
    memset(s, 0, sizeof(*s));
    s->owner = owner;
    s->high_water = 256 * 1024;
    s->low_water = 64 * 1024;
    int r = uv_tcp_init(loop, &s->tcp);
    s->tcp.data = s;
    return r;
}

int px_sock_read_start(px_sock_t *s)
{
    if (s->reading || s->closing || s->errored)
        return 0;
    int r = uv_read_start((uv_stream_t *)&s->tcp, alloc_cb, read_cb);
    if (r == 0)
        s->reading = true;
    return r;
}

void px_sock_read_stop(px_sock_t *s)
{
    if (!s->reading)
        return;
    uv_read_stop((uv_stream_t *)&s->tcp);
    s->reading = false;
}

static void close_cb(uv_handle_t *h)
{
    px_sock_t *s = h->data;
    if (s->on_close)
        s->on_close(s);
}

void px_sock_close(px_sock_t *s)
{
    if (s->closing)
        return;
    s->closing = true;
    s->reading = false;
    uv_close((uv_handle_t *)&s->tcp, close_cb);
}

static void write_cb(uv_write_t *req, int status)
{
    write_req_t *w = (write_req_t *)req;
    px_sock_t *s = w->sock;
    s->queued -= w->len;
    free(w);
    if (s->closing)
        return;
    if (status < 0) {
        if (s->close_on_flush)
            px_sock_close(s);
        else
            fail(s, status);
        return;
    }
    s->last_write = uv_now(s->tcp.loop);
    if (s->queued == 0 && s->close_on_flush) {
        px_sock_close(s);
        return;
    }
    if (s->above_high && s->queued <= s->low_water) {
        s->above_high = false;
        if (s->on_drain)
            s->on_drain(s);
    }
}

int px_sock_write(px_sock_t *s, const uv_buf_t *bufs, unsigned nbufs)
{
    if (s->closing || s->errored)
        return UV_EPIPE;
    size_t total = 0;
    for (unsigned i = 0; i < nbufs; i++)
        total += bufs[i].len;
    if (total == 0)
        return 0;
    size_t done = 0;
    if (s->queued == 0) {
        int r = uv_try_write((uv_stream_t *)&s->tcp, bufs, nbufs);
        if (r >= 0)
            done = (size_t)r;
        else if (r != UV_EAGAIN && r != UV_ENOSYS)
            return r;
        if (done == total)
            return 0;
    }
    /* Queue the rest in one copy: the caller's buffers are not ours to keep. */
    size_t rest = total - done;
    write_req_t *w = dp_xmalloc(sizeof(*w) + rest);
    w->sock = s;
    w->len = rest;
    char *o = w->data;
    size_t skip = done;
    for (unsigned i = 0; i < nbufs; i++) {
        const char *b = bufs[i].base;
        size_t l = bufs[i].len;
        if (skip >= l) {
            skip -= l;
            continue;
        }
        memcpy(o, b + skip, l - skip);
        o += l - skip;
        skip = 0;
    }
    uv_buf_t ub = uv_buf_init(w->data, (unsigned)rest);
    int r = uv_write(&w->req, (uv_stream_t *)&s->tcp, &ub, 1, write_cb);
    if (r < 0) {
        free(w);
        return r;
    }
    if (s->queued == 0)
        s->last_write = uv_now(s->tcp.loop);
    s->queued += rest;
    if (s->queued > s->high_water)
        s->above_high = true;
    return 0;
}

void px_sock_close_after_flush(px_sock_t *s)
{
    if (s->queued == 0 || s->errored)
        px_sock_close(s);
    else
        s->close_on_flush = true;
}

static void shutdown_cb(uv_shutdown_t *req, int status)
{
    (void)status;
    free(req);
}

void px_sock_shutdown(px_sock_t *s)
{
    if (s->closing || s->errored)
        return;
    uv_shutdown_t *req = dp_xmalloc(sizeof(*req));
    if (uv_shutdown(req, (uv_stream_t *)&s->tcp, shutdown_cb) != 0)
        free(req);
}

static void connect_cb(uv_connect_t *req, int status)
{
    px_sock_t *s = req->data;
    if (status == UV_ECANCELED || s->closing)
        return;
    if (status == 0)
        uv_tcp_nodelay(&s->tcp, 1);
    if (s->on_connect)
        s->on_connect(s, status);
}

int px_sock_connect(px_sock_t *s, const struct sockaddr *addr)
{
    s->connect_req.data = s;
    return uv_tcp_connect(&s->connect_req, &s->tcp, addr, connect_cb);
}

void px_sock_peer(px_sock_t *s, char *out, size_t n)
{
    struct sockaddr_storage ss;
    int len = sizeof(ss);
    out[0] = '\0';
    if (uv_tcp_getpeername(&s->tcp, (struct sockaddr *)&ss, &len) != 0)
        return;
    char ip[INET6_ADDRSTRLEN] = "";
    int port = 0;
    if (ss.ss_family == AF_INET) {
        struct sockaddr_in *a = (struct sockaddr_in *)&ss;
        uv_ip4_name(a, ip, sizeof(ip));
        port = ntohs(a->sin_port);
        snprintf(out, n, "%s:%d", ip, port);
    } else if (ss.ss_family == AF_INET6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)&ss;
        uv_ip6_name(a, ip, sizeof(ip));
        port = ntohs(a->sin6_port);
        snprintf(out, n, "[%s]:%d", ip, port);
    }
}
