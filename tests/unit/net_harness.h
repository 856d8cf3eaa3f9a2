/* Shared by the tests/unit/test_net_*.c files: one uv loop per test, driven until a condition
 * holds (never slept on), and two kinds of scripted peer built on plain libuv streams, so they
 * share no code with what they test:
 *   raw_t   a client that writes exact bytes and collects every byte it is sent;
 *   peer_t  a server whose answer to each request head is a test-chosen script.
 * Each test runs in its own process (Criterion), so the globals here are per test. Assertion
 * messages print at most a bounded prefix of what was received: with --full-stats Criterion
 * sends every message, passing ones too, and a megabyte-sized one stalls the test. */
#ifndef NET_HARNESS_H
#define NET_HARNESS_H

#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <uv.h>

#include "common/buf.h"

static uv_loop_t g_loop;
static uv_timer_t g_guard;
static bool g_timed_out;

static inline void guard_cb(uv_timer_t *t)
{
    (void)t;
    g_timed_out = true;
}

static inline void harness_init(void)
{
    cr_assert_eq(uv_loop_init(&g_loop), 0);
    uv_timer_init(&g_loop, &g_guard);
}

/* Close what the test left (its own objects were released by the test), then insist the loop
 * is empty: a handle still open here is a leak in the code under test. */
static inline void harness_fini(void)
{
    uv_close((uv_handle_t *)&g_guard, NULL);
    for (int i = 0; i < 100 && uv_run(&g_loop, UV_RUN_NOWAIT) != 0; i++)
        ;
    cr_assert_eq(uv_loop_close(&g_loop), 0, "handles left open on the loop");
}

/* Drive the loop until cond holds; fail after ms. */
#define RUN_UNTIL_MS(cond, ms)                                                                     \
    do {                                                                                           \
        g_timed_out = false;                                                                       \
        uv_timer_start(&g_guard, guard_cb, (ms), 0);                                               \
        while (!(cond) && !g_timed_out)                                                            \
            uv_run(&g_loop, UV_RUN_ONCE);                                                          \
        uv_timer_stop(&g_guard);                                                                   \
        cr_assert((cond), "timed out waiting for: %s", #cond);                                     \
    } while (0)
#define RUN_UNTIL(cond) RUN_UNTIL_MS(cond, 2000)

/* Let the loop handle everything already readable or due, without waiting. Loopback delivers
 * a send into the peer's receive buffer before send returns, so after this nothing that was
 * sent is still in flight: what a paused reader has not seen, it did not read. */
static inline void run_idle(void)
{
    for (int i = 0; i < 20; i++)
        uv_run(&g_loop, UV_RUN_NOWAIT);
}

/* Drive the loop for ms: only to show that something does NOT happen within that time (a
 * paused reader reads nothing, a suspended timeout does not fire). */
static inline void run_for(uint64_t ms)
{
    g_timed_out = false;
    uv_timer_start(&g_guard, guard_cb, ms, 0);
    while (!g_timed_out)
        uv_run(&g_loop, UV_RUN_ONCE);
}

static inline struct sockaddr_in loopback(uint16_t port)
{
    struct sockaddr_in a;
    uv_ip4_addr("127.0.0.1", port, &a);
    return a;
}

/* ---- raw client ------------------------------------------------------------------------ */

typedef struct {
    uv_tcp_t tcp;
    uv_connect_t creq;
    dp_buf_t in;
    bool connected, eof, closed;
    int err; /* negative libuv error that ended the stream (UV_EOF for a clean end) */
} raw_t;

static inline void raw_alloc(uv_handle_t *h, size_t sz, uv_buf_t *b)
{
    raw_t *r = h->data;
    dp_buf_reserve(&r->in, 65536);
    b->base = r->in.base + r->in.len;
    b->len = 65536;
    (void)sz;
}

static inline void raw_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b)
{
    raw_t *r = s->data;
    (void)b;
    if (n > 0) {
        r->in.len += (size_t)n;
        r->in.base[r->in.len] = '\0';
    } else if (n < 0) {
        r->eof = true;
        r->err = (int)n;
        uv_read_stop(s);
    }
}

static inline void raw_connected(uv_connect_t *c, int status)
{
    raw_t *r = c->data;
    cr_assert_eq(status, 0, "raw connect: %s", uv_strerror(status));
    r->connected = true;
}

static inline void raw_start_reading(raw_t *r)
{
    uv_read_start((uv_stream_t *)&r->tcp, raw_alloc, raw_read);
}

/* Connect to 127.0.0.1:port; rcvbuf > 0 shrinks the receive window (a slow reader). */
static inline void raw_connect_opt(raw_t *r, uint16_t port, bool read, int rcvbuf)
{
    memset(r, 0, sizeof(*r));
    cr_assert_eq(uv_tcp_init_ex(&g_loop, &r->tcp, AF_INET), 0);
    r->tcp.data = r;
    r->creq.data = r;
    if (rcvbuf > 0) {
        uv_os_fd_t fd;
        uv_fileno((uv_handle_t *)&r->tcp, &fd);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    }
    struct sockaddr_in a = loopback(port);
    cr_assert_eq(uv_tcp_connect(&r->creq, &r->tcp, (struct sockaddr *)&a, raw_connected), 0);
    RUN_UNTIL(r->connected);
    if (read)
        raw_start_reading(r);
}

static inline void raw_connect(raw_t *r, uint16_t port)
{
    raw_connect_opt(r, port, true, 0);
}

static inline void raw_send(raw_t *r, const char *p, size_t n)
{
    while (n > 0) {
        uv_buf_t b = uv_buf_init((char *)p, (unsigned)n);
        int w = uv_try_write((uv_stream_t *)&r->tcp, &b, 1);
        if (w == UV_EAGAIN) {
            run_idle();
            continue;
        }
        cr_assert(w > 0, "raw send: %s", uv_strerror(w));
        p += w;
        n -= (size_t)w;
    }
}

static inline void raw_sends(raw_t *r, const char *s)
{
    raw_send(r, s, strlen(s));
}

static inline void raw_closed(uv_handle_t *h)
{
    ((raw_t *)h->data)->closed = true;
}

static inline void raw_close(raw_t *r)
{
    if (!uv_is_closing((uv_handle_t *)&r->tcp))
        uv_close((uv_handle_t *)&r->tcp, raw_closed);
    RUN_UNTIL(r->closed);
    dp_buf_free(&r->in);
}

/* Occurrences of s in what r received. */
static inline size_t raw_count(const raw_t *r, const char *s)
{
    size_t n = 0, l = strlen(s);
    for (const char *p = r->in.base;
         p && (p = memmem(p, r->in.len - (size_t)(p - r->in.base), s, l)) != NULL; p += l)
        n++;
    return n;
}

/* ---- scripted upstream peer ------------------------------------------------------------ */

typedef struct peer_conn_s peer_conn_t;
typedef struct peer_s peer_t;
/* A request head (through "\r\n\r\n") arrived on c; nth counts heads on this connection. */
typedef void (*peer_script_cb)(peer_conn_t *c, int nth);

struct peer_conn_s {
    uv_tcp_t tcp;
    peer_t *peer;
    dp_buf_t in;
    size_t scanned; /* bytes of `in` already searched for the end of a head */
    int heads;
    bool eof, closed;
};

struct peer_s {
    uv_tcp_t listener;
    uint16_t port;
    peer_script_cb script;
    peer_conn_t *conns[128];
    int nconns;
    int requests; /* heads seen over all connections */
    bool closed;
};

static inline void peer_alloc(uv_handle_t *h, size_t sz, uv_buf_t *b)
{
    peer_conn_t *c = h->data;
    dp_buf_reserve(&c->in, 65536);
    b->base = c->in.base + c->in.len;
    b->len = 65536;
    (void)sz;
}

static inline void peer_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b)
{
    peer_conn_t *c = s->data;
    (void)b;
    if (n < 0) {
        c->eof = true;
        uv_read_stop(s);
        return;
    }
    c->in.len += (size_t)n;
    c->in.base[c->in.len] = '\0';
    const char *e;
    while (!c->closed &&
           (e = memmem(c->in.base + c->scanned, c->in.len - c->scanned, "\r\n\r\n", 4)) != NULL) {
        c->scanned = (size_t)(e - c->in.base) + 4;
        c->heads++;
        c->peer->requests++;
        if (c->peer->script)
            c->peer->script(c, c->heads);
    }
    if (!c->closed && c->in.len >= 3 && c->scanned < c->in.len - 3)
        c->scanned = c->in.len - 3; /* a head can only end past what was scanned */
}

static inline void peer_conn_closed(uv_handle_t *h)
{
    peer_conn_t *c = h->data;
    dp_buf_free(&c->in);
    free(c);
}

/* Close one connection now: the kernel sends the FIN before this returns. */
static inline void peer_conn_close(peer_conn_t *c)
{
    if (c->closed)
        return;
    c->closed = true;
    peer_t *p = c->peer;
    for (int i = 0; i < p->nconns; i++)
        if (p->conns[i] == c)
            p->conns[i] = NULL;
    uv_close((uv_handle_t *)&c->tcp, peer_conn_closed);
}

/* Close one connection with a reset (SO_LINGER 0): whatever the client sent that was not
 * acknowledged yet stays so. */
static inline void peer_conn_reset(peer_conn_t *c)
{
    uv_os_fd_t fd;
    struct linger lg = {1, 0};
    cr_assert_eq(uv_fileno((uv_handle_t *)&c->tcp, &fd), 0);
    cr_assert_eq(setsockopt(fd, SOL_SOCKET, SO_LINGER, &lg, sizeof(lg)), 0);
    peer_conn_close(c);
}

static inline void peer_write(peer_conn_t *c, const char *p, size_t n)
{
    uv_buf_t b = uv_buf_init((char *)p, (unsigned)n);
    int w = uv_try_write((uv_stream_t *)&c->tcp, &b, 1);
    cr_assert_eq(w, (int)n, "peer write: %d of %zu", w, n);
}

static inline void peer_writes(peer_conn_t *c, const char *s)
{
    peer_write(c, s, strlen(s));
}

static inline void peer_accept(uv_stream_t *l, int status)
{
    peer_t *p = l->data;
    cr_assert_eq(status, 0);
    peer_conn_t *c = calloc(1, sizeof(*c));
    c->peer = p;
    uv_tcp_init(&g_loop, &c->tcp);
    c->tcp.data = c;
    cr_assert_eq(uv_accept(l, (uv_stream_t *)&c->tcp), 0);
    cr_assert(p->nconns < 128);
    p->conns[p->nconns++] = c;
    uv_read_start((uv_stream_t *)&c->tcp, peer_alloc, peer_read);
}

static inline void peer_start(peer_t *p, peer_script_cb script)
{
    memset(p, 0, sizeof(*p));
    p->script = script;
    uv_tcp_init(&g_loop, &p->listener);
    p->listener.data = p;
    struct sockaddr_in a = loopback(0);
    cr_assert_eq(uv_tcp_bind(&p->listener, (struct sockaddr *)&a, 0), 0);
    cr_assert_eq(uv_listen((uv_stream_t *)&p->listener, 16, peer_accept), 0);
    struct sockaddr_in b;
    int len = sizeof(b);
    uv_tcp_getsockname(&p->listener, (struct sockaddr *)&b, &len);
    p->port = ntohs(b.sin_port);
}

static inline void peer_listener_closed(uv_handle_t *h)
{
    ((peer_t *)h->data)->closed = true;
}

static inline void peer_stop(peer_t *p)
{
    for (int i = 0; i < p->nconns; i++)
        if (p->conns[i])
            peer_conn_close(p->conns[i]);
    uv_close((uv_handle_t *)&p->listener, peer_listener_closed);
    RUN_UNTIL(p->closed);
}

#endif
