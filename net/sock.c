#include "net/sock.h"

#include <assert.h>
#include <errno.h>
#include <limits.h>
#include <linux/sockios.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "common/buf.h"
#include "net/tcpinfo.h"

/* One read buffer per thread (each event loop runs on its own thread): every read callback
 * consumes or copies its bytes before returning. */
static _Thread_local char g_read_buf[NET_READ_BUF_SIZE];
/* Decrypted bytes of one read (TLS): the same rule, consumed or copied before returning. */
static _Thread_local dp_buf_t g_plain;
/* Pieces of one TLS write gathered into one buffer (same rule: used within the call). */
static _Thread_local dp_buf_t g_tls_gather;

void net_sock_thread_free(void)
{
    dp_buf_free(&g_plain);
    dp_buf_free(&g_tls_gather);
}

static int raw_write(net_sock_t *s, const uv_buf_t *bufs, unsigned nbufs);
static int raw_write_now(net_sock_t *s, const uv_buf_t *bufs, unsigned nbufs);
static void fail(net_sock_t *s, int status);

/* ---- Write batching ---------------------------------------------------------------------
 * A proxy's loop iteration handles many connections' events; writing each response the moment
 * it is ready means every write may find its peer asleep in epoll_wait and pay a cross-CPU
 * wake-up (an IPI, ~2-3 us on a VM) in the sender's system time. Bench scenario 1 measured
 * 0.4 such wake-ups per request here against HAProxy's 0.1 (perf stat -e sched:sched_waking):
 * HAProxy, like most event-driven servers, sends at the end of its loop pass. So here: a small
 * write on a connection with nothing queued is copied into the loop's batch buffer, and the
 * check handle (which runs after the poll phase's callbacks) writes each connection's bytes in
 * one burst, in the order the connections wrote. One batch per thread, for the first loop that
 * thread makes sockets on (a socket on another loop of the same thread writes at once). While
 * bytes wait an idle handle is active: it keeps the loop alive and makes the poll phase not
 * block, so a write from a timer or a pending callback (which run before the poll) still goes
 * out in the same iteration instead of waiting for the next event. Both handles close with the
 * last socket of their loop: nothing is left to keep a loop alive or block uv_loop_close. */
/* A connection's batch holds at most this much; a write that would take it past goes at once
 * (after what waits): batching a large write would only copy it, and a writer producing a lot
 * in one callback must see its bytes queue up (net_sock_over) as it would without the batch. */
#define BATCH_MAX_BYTES (16 * 1024)
/* All of a loop's batch holds at most about this much: past it, writes go at once. Thousands
 * of streams each writing an event in one iteration would otherwise grow the batch by their
 * sum (8 MiB for 3,000 SSE streams starting together) for one syscall saved each. */
#define BATCH_TOTAL_MAX_BYTES (256 * 1024)

typedef struct {
    uv_check_t check;
    uv_idle_t idle; /* active while bytes wait (see above) */
    int open_handles;
    uv_loop_t *loop;
    dp_buf_t bytes;     /* every waiting connection's bytes, connection after connection */
    net_sock_t **socks; /* in first-write order; entries whose in_batch is false are skipped */
    size_t nsocks, cap;
    size_t live; /* open sockets on this loop */
} batch_t;

static _Thread_local batch_t *g_batch;

static void batch_closed(uv_handle_t *h)
{
    batch_t *b = h->data;
    assert(b->open_handles > 0);
    if (--b->open_handles > 0)
        return;
    dp_buf_free(&b->bytes);
    free(b->socks);
    free(b);
}

/* Write s's waiting bytes now (they stay valid until the batch is reset). */
static void batch_flush_one(net_sock_t *s)
{
    if (!s->in_batch)
        return;
    /* Only a batched socket joins the batch, and the batch outlives its sockets. */
    assert(s->batched && g_batch != NULL);
    assert(s->batch_off + s->batch_len <= g_batch->bytes.len);
    s->in_batch = false;
    uv_buf_t ub = uv_buf_init(g_batch->bytes.base + s->batch_off, (unsigned)s->batch_len);
    s->batch_len = 0;
    if (s->closing)
        return;
    /* Also after an error: these bytes were accepted before it (a TLS alert, an error page),
     * as a direct write would have sent them before the error was reported. */
    int r = raw_write_now(s, &ub, 1);
    if (r < 0)
        fail(s, r);
}

static void batch_cb(uv_check_t *c)
{
    batch_t *b = c->data;
    /* A flush may fail a connection whose error callback writes to another one: that write
     * appends to the batch being walked, hence the index loop re-reading nsocks. */
    for (size_t i = 0; i < b->nsocks; i++)
        batch_flush_one(b->socks[i]);
    b->nsocks = 0;
    dp_buf_reset(&b->bytes);
    if (b->bytes.cap > 1 << 20)
        dp_buf_free(&b->bytes);
    uv_idle_stop(&b->idle);
}

static void batch_idle_cb(uv_idle_t *h)
{
    (void)h; /* only there to keep the poll from blocking while bytes wait */
}

static void batch_join(uv_loop_t *loop, net_sock_t *s)
{
    if (g_batch == NULL) {
        batch_t *b = dp_xcalloc(1, sizeof(*b));
        b->loop = loop;
        uv_check_init(loop, &b->check);
        uv_idle_init(loop, &b->idle);
        b->check.data = b;
        b->idle.data = b;
        b->open_handles = 2;
        uv_check_start(&b->check, batch_cb);
        uv_unref((uv_handle_t *)&b->check);
        g_batch = b;
    }
    if (g_batch->loop != loop)
        return;
    s->batched = true;
    g_batch->live++;
}

/* s closes: its waiting bytes go out first (a close right after a write must still send it,
 * as the direct write did), then the batch closes with its loop's last socket. */
static void batch_leave(net_sock_t *s)
{
    if (!s->batched)
        return;
    batch_flush_one(s);
    s->batched = false;
    assert(g_batch != NULL && g_batch->live > 0);
    if (--g_batch->live == 0) {
        uv_close((uv_handle_t *)&g_batch->check, batch_closed);
        uv_close((uv_handle_t *)&g_batch->idle, batch_closed);
        g_batch = NULL;
    }
}

/* Append bufs to s's batch. False when they must be written at once instead. */
static bool batch_add(net_sock_t *s, const uv_buf_t *bufs, unsigned nbufs, size_t total)
{
    batch_t *b = g_batch;
    assert(s->batched && b != NULL && b->loop == s->tcp.loop);
    if (total + s->batch_len > BATCH_MAX_BYTES || b->bytes.len + total > BATCH_TOTAL_MAX_BYTES) {
        batch_flush_one(s);
        return false;
    }
    if (s->in_batch && s->batch_off + s->batch_len != b->bytes.len)
        batch_flush_one(s); /* another connection wrote since: keep s's bytes contiguous */
    if (s->queued > 0 || s->closing || s->errored)
        return false;
    if (!s->in_batch) {
        if (b->nsocks == b->cap) {
            b->cap = b->cap ? b->cap * 2 : 64;
            b->socks = dp_xrealloc(b->socks, b->cap * sizeof(*b->socks));
        }
        b->socks[b->nsocks++] = s;
        s->in_batch = true;
        s->batch_off = b->bytes.len;
        s->batch_len = 0;
        if (b->nsocks == 1)
            uv_idle_start(&b->idle, batch_idle_cb);
    }
    for (unsigned i = 0; i < nbufs; i++)
        dp_buf_append(&b->bytes, bufs[i].base, bufs[i].len);
    s->batch_len += total;
    return true;
}

typedef struct {
    uv_write_t req;
    net_sock_t *sock;
    size_t len;
    char data[];
} write_req_t;

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    net_sock_t *s = h->data;
    size_t len = 0;
    char *p = s->read_target && !s->tls ? s->read_target(s, &len) : NULL;
    (void)suggested;
    if (p) {
        buf->base = p;
        buf->len = len;
        return;
    }
    buf->base = g_read_buf;
    buf->len = len && len < sizeof(g_read_buf) ? len : sizeof(g_read_buf);
}

static void fail(net_sock_t *s, int status)
{
    if (s->errored || s->closing)
        return;
    s->errored = true;
    if (s->on_error)
        s->on_error(s, status);
}

/* Send whatever TLS produced (handshake messages, alerts, records). After net_sock_shutdown
 * it is taken and dropped: OpenSSL still writes on its own while reading (a no_renegotiation
 * alert answering a TLS 1.2 peer's ClientHello, once a cut answer sent no close_notify), the
 * peer can receive nothing after our FIN anyway, and a write failing there would close the
 * lingering connection with the rest of its answer still queued. */
static int tls_flush(net_sock_t *s)
{
    if (net_tls_pending_out(s->tls) == 0)
        return 0;
    dp_buf_t out = {0};
    net_tls_take_out(s->tls, &out);
    int r = 0;
    if (!s->write_shut) {
        uv_buf_t b = uv_buf_init(out.base, (unsigned)out.len);
        r = raw_write(s, &b, 1);
    }
    dp_buf_free(&out);
    return r;
}

static void tls_read(net_sock_t *s, const char *p, size_t n)
{
    bool was_done = net_tls_handshake_done(s->tls);
    dp_buf_reset(&g_plain);
    int r = net_tls_feed(s->tls, p, n, &g_plain);
    if (tls_flush(s) != 0 && r == NET_TLS_OK)
        r = NET_TLS_ERROR;
    if (r == NET_TLS_ERROR) {
        net_sock_read_stop(s);
        fail(s, UV_EPROTO);
        return;
    }
    if (!was_done && net_tls_handshake_done(s->tls) && s->connecting) {
        s->connecting = false;
        if (s->on_connect)
            s->on_connect(s, 0);
        if (s->closing || s->errored)
            return;
    } else if (!was_done && net_tls_handshake_done(s->tls) && s->on_handshake) {
        s->on_handshake(s);
    }
    if (g_plain.len && s->on_read)
        s->on_read(s, g_plain.base, g_plain.len);
    if (r == NET_TLS_CLOSED && !s->closing) {
        net_sock_read_stop(s);
        fail(s, UV_EOF);
    }
}

static void read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    net_sock_t *s = st->data;
    if (nread > 0) {
        if (s->tls)
            tls_read(s, buf->base, (size_t)nread);
        else if (s->on_read)
            s->on_read(s, buf->base, (size_t)nread);
        return;
    }
    if (nread < 0) {
        net_sock_read_stop(s);
        fail(s, (int)nread);
    }
}

int net_sock_init(uv_loop_t *loop, net_sock_t *s, void *owner)
{
    memset(s, 0, sizeof(*s));
    s->owner = owner;
    s->high_water = 256 * 1024;
    s->low_water = 64 * 1024;
    int r = uv_tcp_init(loop, &s->tcp);
    s->tcp.data = s;
    if (r == 0)
        batch_join(loop, s);
    return r;
}

int net_sock_read_start(net_sock_t *s)
{
    if (s->reading || s->closing || s->errored)
        return 0;
    int r = uv_read_start((uv_stream_t *)&s->tcp, alloc_cb, read_cb);
    if (r == 0)
        s->reading = true;
    return r;
}

void net_sock_read_stop(net_sock_t *s)
{
    if (!s->reading)
        return;
    uv_read_stop((uv_stream_t *)&s->tcp);
    s->reading = false;
}

static void close_cb(uv_handle_t *h)
{
    net_sock_t *s = h->data;
    assert(s->closing); /* only net_sock_close and net_sock_abort close the handle */
    net_tls_free(s->tls);
    s->tls = NULL;
    if (s->on_close)
        s->on_close(s);
}

void net_sock_close(net_sock_t *s)
{
    if (s->closing)
        return;
    batch_leave(s);
    s->closing = true;
    s->reading = false;
    uv_close((uv_handle_t *)&s->tcp, close_cb);
}

void net_sock_abort(net_sock_t *s)
{
    if (s->closing)
        return;
    batch_leave(s);
    s->closing = true;
    s->reading = false;
    /* Fails without a socket yet (connect not started) or after a shutdown: close plainly. */
    if (uv_tcp_close_reset(&s->tcp, close_cb) != 0)
        uv_close((uv_handle_t *)&s->tcp, close_cb);
}

static void write_cb(uv_write_t *req, int status)
{
    write_req_t *w = (write_req_t *)req;
    net_sock_t *s = w->sock;
    assert(s->queued >= w->len);
    s->queued -= w->len;
    free(w);
    if (s->closing)
        return;
    if (status < 0) {
        fail(s, status);
        return;
    }
    s->last_write = uv_now(s->tcp.loop);
    if (s->above_high && s->queued <= s->low_water) {
        s->above_high = false;
        if (s->on_drain)
            s->on_drain(s);
    }
}

int net_sock_write(net_sock_t *s, const uv_buf_t *bufs, unsigned nbufs)
{
    if (s->closing || s->errored || s->write_shut)
        return UV_EPIPE;
    if (s->tls) {
        /* One SSL_write for all the pieces: a response head and body then share a record
         * (one seal here, one open at the peer) instead of a record each. */
        const char *p = bufs[0].base;
        size_t n = bufs[0].len;
        if (nbufs > 1) {
            dp_buf_reset(&g_tls_gather);
            for (unsigned i = 0; i < nbufs; i++)
                dp_buf_append(&g_tls_gather, bufs[i].base, bufs[i].len);
            p = g_tls_gather.base;
            n = g_tls_gather.len;
        }
        int r = n ? net_tls_write(s->tls, p, n) : NET_TLS_OK;
        if (g_tls_gather.cap > 1 << 20)
            dp_buf_free(&g_tls_gather);
        if (r != NET_TLS_OK)
            return UV_EPROTO;
        return tls_flush(s);
    }
    return raw_write(s, bufs, nbufs);
}

static int raw_write(net_sock_t *s, const uv_buf_t *bufs, unsigned nbufs)
{
    size_t total = 0;
    for (unsigned i = 0; i < nbufs; i++)
        total += bufs[i].len;
    if (total == 0)
        return 0;
    if (s->batched && batch_add(s, bufs, nbufs, total))
        return 0;
    return raw_write_now(s, bufs, nbufs);
}

/* What the socket takes of bufs now, as uv_try_write does (bytes taken, UV_EAGAIN when none
 * fit), but with send/sendmsg: a socket's write(2)/writev(2) first goes through the file layer
 * (fdget_pos, vfs_write), a measurable share of a 1 KB request's kernel time. uv_buf_t is laid
 * out as struct iovec on Unix. With anything queued in libuv's stream or a connect under way,
 * uv_try_write says so itself. */
#define SEND_MAX_BUFS 64 /* more go through libuv, which splits them by the system's IOV_MAX */
static int try_send(net_sock_t *s, const uv_buf_t *bufs, unsigned nbufs)
{
    uv_os_fd_t fd;
    if (nbufs > SEND_MAX_BUFS || s->tcp.connect_req != NULL ||
        uv_stream_get_write_queue_size((uv_stream_t *)&s->tcp) ||
        uv_fileno((const uv_handle_t *)&s->tcp, &fd) != 0)
        return uv_try_write((uv_stream_t *)&s->tcp, bufs, nbufs);
    ssize_t n;
    do {
        if (nbufs == 1) {
            n = send(fd, bufs[0].base, bufs[0].len, MSG_NOSIGNAL | MSG_DONTWAIT);
        } else {
            struct msghdr m = {.msg_iov = (struct iovec *)bufs, .msg_iovlen = nbufs};
            n = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
    } while (n < 0 && errno == EINTR);
    if (n >= 0)
        return (int)(n > INT_MAX ? INT_MAX : n);
    /* ENOBUFS as libuv takes it: no room now, not an error of the connection. */
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS ? UV_EAGAIN : -errno;
}

/* Try the socket, queue what it did not take. */
static int raw_write_now(net_sock_t *s, const uv_buf_t *bufs, unsigned nbufs)
{
    size_t total = 0;
    for (unsigned i = 0; i < nbufs; i++)
        total += bufs[i].len;
    size_t done = 0;
    if (s->queued == 0) {
        int r = try_send(s, bufs, nbufs);
        if (r >= 0)
            done = (size_t)r;
        else if (r != UV_EAGAIN && r != UV_ENOSYS)
            return r;
        if (done == total) {
            s->handed += total;
            return 0;
        }
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
    s->handed += total;
    if (s->queued > s->high_water)
        s->above_high = true;
    return 0;
}

static void shutdown_cb(uv_shutdown_t *req, int status)
{
    (void)status;
    free(req);
}

void net_sock_shutdown(net_sock_t *s, bool notify)
{
    if (s->closing || s->errored || s->write_shut)
        return;
    if (s->tls && notify) {
        net_tls_shutdown(s->tls); /* close_notify, so the peer sees a clean end */
        tls_flush(s);
    }
    if (s->batched)
        batch_flush_one(s); /* uv_shutdown waits only for what libuv has queued */
    uv_shutdown_t *req = dp_xmalloc(sizeof(*req));
    if (uv_shutdown(req, (uv_stream_t *)&s->tcp, shutdown_cb) != 0)
        free(req);
    s->write_shut = true;
}

static void connect_cb(uv_connect_t *req, int status)
{
    net_sock_t *s = req->data;
    if (status == UV_ECANCELED || s->closing)
        return;
    if (status == 0)
        uv_tcp_nodelay(&s->tcp, 1);
    if (status == 0 && s->tls) {
        /* TCP is up: the connection is usable only once the handshake completes. */
        s->connecting = true;
        if (net_tls_handshake(s->tls) != NET_TLS_OK || tls_flush(s) != 0 ||
            net_sock_read_start(s) != 0) {
            s->connecting = false;
            if (s->on_connect)
                s->on_connect(s, UV_EPROTO);
        }
        return;
    }
    if (s->on_connect)
        s->on_connect(s, status);
}

void net_sock_use_tls(net_sock_t *s, net_tls_t *t)
{
    assert(s->tls == NULL); /* once per stream: a second one would leak the first */
    s->tls = t;
}

const char *net_sock_tls_error(const net_sock_t *s)
{
    return s->tls ? net_tls_error(s->tls) : "not a TLS connection";
}

int net_sock_connect(net_sock_t *s, const struct sockaddr *addr)
{
    s->connect_req.data = s;
    return uv_tcp_connect(&s->connect_req, &s->tcp, addr, connect_cb);
}

uint64_t net_sock_last_progress(net_sock_t *s)
{
    if (s->queued == 0 || s->closing)
        return s->last_write;
    /* Bytes still in the kernel's send queue, not yet acknowledged by the peer. */
    uv_os_fd_t fd;
    int unacked = 0;
    if (uv_fileno((const uv_handle_t *)&s->tcp, &fd) != 0 || ioctl(fd, SIOCOUTQ, &unacked) != 0)
        return s->last_write;
    uint64_t held = uv_stream_get_write_queue_size((const uv_stream_t *)&s->tcp) +
                    (uint64_t)(unacked > 0 ? unacked : 0);
    uint64_t taken = s->handed > held ? s->handed - held : 0;
    if (taken > s->taken) {
        s->taken = taken;
        s->last_write = uv_now(s->tcp.loop);
    }
    return s->last_write;
}

uint64_t net_sock_acked_since(net_sock_t *s, uint64_t from)
{
    uv_os_fd_t fd;
    uint64_t acked;
    if (uv_fileno((const uv_handle_t *)&s->tcp, &fd) != 0 || net_tcp_bytes_acked(fd, &acked) != 0)
        return UINT64_MAX;
    return acked > from ? acked - from : 0;
}

bool net_sock_peer(net_sock_t *s, char *out, size_t n, struct sockaddr_storage *into)
{
    struct sockaddr_storage ss;
    int len = sizeof(ss);
    out[0] = '\0';
    memset(&ss, 0, sizeof(ss));
    if (uv_tcp_getpeername(&s->tcp, (struct sockaddr *)&ss, &len) != 0)
        return false;
    if (into)
        *into = ss;
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
    return true;
}
