/* HTTP/1.1 server connections. See net/server.h for the contract.
 *
 * A connection moves through phases:
 *   IDLE  -> waiting for the first byte of a request (header timer from accept, then the
 *            keep-alive idle timer between requests)
 *   HEAD  -> reading the head: every byte goes through net_head_scan, then llhttp
 *   BODY  -> reading the body: chunked bytes through net_chunk_scan, Content-Length counted by
 *            us; llhttp is fed exactly the bytes of this message, never the next one's
 *   WAIT  -> request complete, response in progress; further bytes are kept unparsed in
 *            `pending` (pipelining) until the response ends
 *   LINGER-> an error was answered; write side shut, input discarded until EOF or a timer
 *
 * Re-entrancy rule: handler callbacks may call net_resp_* (which can finish the request). The
 * parse loop therefore re-reads c->req after every callback, net_resp_end never parses the next
 * request itself (a zero timer kicks it), and memory is only freed from close callbacks. */
#include "net/server.h"

#include <assert.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <llhttp.h>

#include "common/jw.h"
#include "common/log.h"
#include "common/util.h"
#include "net/hdrs.h"
#include "net/path.h"
#include "net/sock.h"

enum { PH_IDLE = 0, PH_HEAD, PH_BODY, PH_WAIT, PH_LINGER, PH_CLOSED };

#define LINGER_MS 2000
#define PAUSED_CHECK_MS 1000      /* how often a client whose body reads are paused is looked at */
#define PENDING_LIMIT (64 * 1024) /* pipelined bytes buffered before we stop reading */
#define REQ_CACHE_MAX 256

typedef struct req_impl_s {
    net_req_t r;
    struct req_impl_s *next_free;
    net_hdrs_t hd;    /* hd.buf: the request-target, then the header names and values */
    uint32_t url_len; /* the request-target's bytes at the start of hd.buf */
    bool head_done, msg_done;
    bool handed; /* on_head was called: the handler knows this request */
    net_body_mode_t mode;
    bool body_done;
    bool body_too_large;
    bool body_over_budget;
    uint64_t body_reserved; /* this request's share of the server's body_bytes */
    bool resp_started, resp_ended;
    bool resp_chunked, resp_no_body, resp_head_pending;
    bool abort_notified;
    int64_t resp_remaining; /* -1 unless Content-Length framing */
    dp_buf_t out;           /* response head not yet written */
    net_framing_t framing;
    struct req_impl_s *cork_prev, *cork_next; /* on the server's corked list while corked */
    bool corked;
} req_impl_t;

struct net_conn_s {
    net_sock_t sock; /* first: the sock's owner is the conn */
    uv_timer_t timer;
    net_server_t *srv;
    net_conn_t *prev, *next;
    llhttp_t parser;
    net_head_scan_t hs;
    net_chunk_scan_t cs;
    uint8_t phase;
    req_impl_t *req;
    dp_buf_t pending;
    uint64_t body_remaining;
    uint64_t deadline;      /* absolute uv_now() ms for the current timer purpose */
    uint64_t body_deadline; /* uv_now() by which a buffered body must be read (0: none) */
    uint64_t last_read;     /* uv_now() of the last read, for idle checks in BODY */
    int closes_pending;
    bool keep_alive;
    bool first_request;
    bool in_feed;
    bool kick;        /* the timer is a zero-delay kick to parse pipelined bytes, not a timeout */
    char remote[48];  /* the peer, "ip:port": looked up once, on the first request */
    bool read_paused; /* by pending overflow or by the handler */
    bool body_paused;
    bool wait_drain;  /* IDLE with responses queued above high-water: next request waits */
    bool handshaking; /* on the server's pending-handshake list */
    net_conn_t *hs_prev, *hs_next;
};

struct net_server_s {
    uv_loop_t *loop;
    uv_tcp_t listener;
    bool listening, draining, closing, listener_open, check_open;
    /* Responses whose head waits to be coalesced with the first body bytes; whatever is
     * still waiting when the loop finishes an iteration is flushed by `check`. */
    uv_check_t check;
    req_impl_t *corked;
    net_handler_t h;
    void *data;
    net_server_limits_t lim;
    llhttp_settings_t settings;
    atomic_size_t nconns, ninflight; /* read by other threads (px_workers_connections) */
    /* max_connections and max_inflight_body_bytes count here: this server's own, or those
     * of a group of servers on several threads sharing one limit (net_server_share). */
    net_server_shared_t own, *shared;
    net_conn_t *hs_head, *hs_tail; /* TLS handshakes in progress, oldest first */
    size_t nhandshakes;
    void (*on_overload)(const char *reason);
    uint64_t accepted;
    net_conn_t *conns;
    req_impl_t *free_reqs;
    size_t nfree;
    uint16_t port;
    struct sockaddr_storage bound; /* the listener's address, once listening */
    net_tls_ctx_t *tls;
    uint64_t last_accept_warn;
    void (*drain_cb)(net_server_t *s);
    void (*close_cb)(void *data);
    void *close_data;
};

static void conn_feed(net_conn_t *c, const char *p, size_t n);
static void conn_close(net_conn_t *c);
static void conn_reject(net_conn_t *c, int status, const char *reason);
static void conn_to_idle(net_conn_t *c);
static void maybe_server_done(net_server_t *s);

/* ---- small helpers ---------------------------------------------------------------------- */

static uint64_t g_id_seed;
static atomic_uint_fast64_t g_id_counter; /* servers on several threads draw from one counter */
static pthread_once_t g_id_once = PTHREAD_ONCE_INIT;

static void id_seed_init(void)
{
    if (dp_random_bytes(&g_id_seed, sizeof(g_id_seed)) != 0 || g_id_seed == 0)
        g_id_seed = dp_now_ns() | 1;
}

/* splitmix64 of a random seed plus a counter: unique per process (a bijection of the
 * counter) and unpredictable without the seed. */
static void make_request_id(char out[24])
{
    pthread_once(&g_id_once, id_seed_init);
    uint64_t n = atomic_fetch_add_explicit(&g_id_counter, 1, memory_order_relaxed) + 1;
    uint64_t z = dp_mix64(g_id_seed + n * 0x9E3779B97F4A7C15ULL);
    dp_hex(&z, 8, out);
}

static const char *reason_phrase(int status)
{
    switch (status) {
    case 100:
        return "Continue";
    case 200:
        return "OK";
    case 201:
        return "Created";
    case 202:
        return "Accepted";
    case 204:
        return "No Content";
    case 206:
        return "Partial Content";
    case 301:
        return "Moved Permanently";
    case 302:
        return "Found";
    case 304:
        return "Not Modified";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 409:
        return "Conflict";
    case 413:
        return "Content Too Large";
    case 415:
        return "Unsupported Media Type";
    case 417:
        return "Expectation Failed";
    case 422:
        return "Unprocessable Content";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    default:
        return "Status";
    }
}

/* "date: ..." is the same for every response within a second: format it once (per thread:
 * servers run on several loop threads). */
static const char *date_header(size_t *len)
{
    static _Thread_local char buf[64];
    static _Thread_local size_t blen;
    static _Thread_local time_t last;
    time_t now = time(NULL);
    if (now != last) {
        struct tm tm;
        gmtime_r(&now, &tm);
        blen = strftime(buf, sizeof(buf), "date: %a, %d %b %Y %H:%M:%S GMT\r\n", &tm);
        last = now;
    }
    *len = blen;
    return buf;
}

const char *net_error_type_for_status(int status)
{
    if (status == 401)
        return "authentication_error";
    if (status == 404)
        return "not_found_error";
    if (status == 429 || status == 503)
        return "overloaded_error";
    if (status >= 500)
        return "server_error";
    return "invalid_request_error";
}

void net_error_body(dp_buf_t *out, const char *type, const char *code, const char *param,
                    const char *message)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_obj_begin(&w, "error");
    dp_jw_str(&w, "message", message);
    dp_jw_str(&w, "type", type);
    dp_jw_str(&w, "param", param);
    dp_jw_str(&w, "code", code);
    dp_jw_obj_end(&w);
    dp_jw_obj_end(&w);
}

void net_server_limits_default(net_server_limits_t *l)
{
    memset(l, 0, sizeof(*l)); /* the bounds not set here are off (0) */
    l->max_header_bytes = 32768;
    l->max_headers = 100;
    l->max_body_bytes = 8388608;
    l->max_connections = 10000;
    l->client_header_timeout_ms = 10000;
    l->client_idle_timeout_ms = 60000;
    l->write_high_water = 256 * 1024;
}

/* ---- corking ------------------------------------------------------------------------------ */

static void cork_remove(net_server_t *s, req_impl_t *q)
{
    if (!q->corked)
        return;
    assert(q->cork_prev != NULL || s->corked == q);
    q->corked = false;
    if (q->cork_prev)
        q->cork_prev->cork_next = q->cork_next;
    else
        s->corked = q->cork_next;
    if (q->cork_next)
        q->cork_next->cork_prev = q->cork_prev;
    q->cork_prev = q->cork_next = NULL;
    if (s->corked == NULL)
        uv_check_stop(&s->check);
}

static void check_cb(uv_check_t *h);

static void cork_add(net_server_t *s, req_impl_t *q)
{
    if (q->corked)
        return;
    assert(q->cork_prev == NULL && q->cork_next == NULL);
    q->corked = true;
    q->cork_prev = NULL;
    q->cork_next = s->corked;
    if (s->corked)
        s->corked->cork_prev = q;
    else
        uv_check_start(&s->check, check_cb);
    s->corked = q;
}

/* ---- request objects ----------------------------------------------------------------------- */

static req_impl_t *req_get(net_conn_t *c)
{
    net_server_t *s = c->srv;
    req_impl_t *q = s->free_reqs;
    if (q) {
        /* req_put left it zeroed but for its buffers' capacity. */
        assert(s->nfree > 0);
        assert(q->r.conn == NULL && !q->corked && q->body_reserved == 0 && q->hd.n == 0);
        s->free_reqs = q->next_free;
        s->nfree--;
    } else {
        q = dp_xcalloc(1, sizeof(*q));
    }
    q->next_free = NULL;
    q->r.conn = c;
    q->r.server = s;
    q->r.content_length = -1;
    q->resp_remaining = -1;
    q->r.start_ns = dp_now_ns();
    make_request_id(q->r.id);
    return q;
}

/* Return to the cache with buffers kept (capacity reuse), or free when the cache is full.
 * q is detached already: off its connection, off the corked list, its budget given back. */
static void req_put(net_server_t *s, req_impl_t *q)
{
    assert(q->r.conn->req != q);
    assert(!q->corked && q->body_reserved == 0);
    net_hdrs_t hd = q->hd;
    dp_buf_t out = q->out, body = q->r.body;
    if (s->nfree >= REQ_CACHE_MAX || s->closing || body.cap > 1024 * 1024 ||
        hd.buf.cap > 64 * 1024) {
        net_hdrs_free(&hd);
        dp_buf_free(&out);
        dp_buf_free(&body);
        free(q);
        return;
    }
    memset(q, 0, sizeof(*q));
    net_hdrs_reset(&hd);
    dp_buf_reset(&out);
    dp_buf_reset(&body);
    q->hd = hd;
    q->out = out;
    q->r.body = body;
    q->next_free = s->free_reqs;
    s->free_reqs = q;
    s->nfree++;
}

/* Detach the finished request from its connection. */
static void conn_release_req(net_conn_t *c)
{
    req_impl_t *q = c->req;
    if (q == NULL)
        return;
    c->req = NULL;
    cork_remove(c->srv, q);
    atomic_fetch_sub(&c->srv->shared->body_bytes, q->body_reserved);
    q->body_reserved = 0;
    if (q->handed) {
        assert(c->srv->ninflight > 0);
        c->srv->ninflight--;
    }
    req_put(c->srv, q);
}

/* ---- llhttp callbacks: they only record; the parse loop acts ---------------------------- */

static int on_url(llhttp_t *p, const char *at, size_t n)
{
    req_impl_t *q = ((net_conn_t *)p->data)->req;
    dp_buf_append(&q->hd.buf, at, n);
    q->url_len += (uint32_t)n;
    return 0;
}

/* Fields after the head are a chunked body's trailers (llhttp reports them through the same
 * callbacks). They are dropped, never forwarded (net_chunk_scan bounds their size), and must not
 * touch the head's buffer: the request's header spans point into it until the request ends. */
static int on_header_field(llhttp_t *p, const char *at, size_t n)
{
    req_impl_t *q = ((net_conn_t *)p->data)->req;
    if (!q->head_done)
        net_hdrs_field(&q->hd, at, n);
    return 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t n)
{
    req_impl_t *q = ((net_conn_t *)p->data)->req;
    if (!q->head_done)
        net_hdrs_value(&q->hd, at, n);
    return 0;
}

static int on_headers_complete(llhttp_t *p)
{
    req_impl_t *q = ((net_conn_t *)p->data)->req;
    q->head_done = true;
    return 0;
}

/* Grow q's reservation of the server's body budget to `total` bytes; false (nothing taken)
 * when that would exceed max_inflight_body_bytes. */
static bool body_reserve(net_conn_t *c, uint64_t total)
{
    net_server_t *s = c->srv;
    req_impl_t *q = c->req;
    assert(total >= q->body_reserved); /* a reservation only grows */
    uint64_t more = total - q->body_reserved;
    uint64_t max = s->lim.max_inflight_body_bytes;
    uint64_t cur = atomic_load(&s->shared->body_bytes);
    do
        if (max && cur + more > max)
            return false;
    while (!atomic_compare_exchange_weak(&s->shared->body_bytes, &cur, cur + more));
    q->body_reserved = total;
    return true;
}

static void conn_overloaded(net_conn_t *c)
{
    if (c->srv->on_overload)
        c->srv->on_overload("body_budget");
    conn_reject(c, 503, "too many request bodies buffered (limits.max_inflight_body_bytes)");
}

static int on_body(llhttp_t *p, const char *at, size_t n)
{
    net_conn_t *c = p->data;
    req_impl_t *q = c->req;
    if (q == NULL || q->resp_ended)
        return 0; /* answered early: the body is being discarded */
    if (q->mode == NET_BODY_BUFFER) {
        if (q->r.body.len + n > c->srv->lim.max_body_bytes) {
            q->body_too_large = true;
            return HPE_USER;
        }
        if (q->r.body.len + n > q->body_reserved && !body_reserve(c, q->r.body.len + n)) {
            q->body_over_budget = true;
            return HPE_USER;
        }
        dp_buf_append(&q->r.body, at, n);
    } else if (c->srv->h.on_body) {
        c->srv->h.on_body(&q->r, at, n);
    }
    return 0;
}

static int on_message_complete(llhttp_t *p)
{
    net_conn_t *c = p->data;
    if (c->req)
        c->req->msg_done = true;
    return 0;
}

/* ---- timers ------------------------------------------------------------------------------- */

static void timer_cb(uv_timer_t *t);

static void conn_arm(net_conn_t *c, uint64_t ms)
{
    c->kick = false;
    c->deadline = uv_now(c->srv->loop) + ms;
    uv_timer_start(&c->timer, timer_cb, ms, 0);
}

/* Parse pipelined bytes left behind by the previous response (zero-delay timer). */
static void conn_kick(net_conn_t *c)
{
    c->kick = true;
    uv_timer_start(&c->timer, timer_cb, 0, 0);
}

/* While body reads are paused libuv has no interest in the socket, so a reset from the client
 * raises no event. Ask the kernel: after a RST the socket is TCP_CLOSE. (A FIN is not taken
 * as "gone": the rest of the body may be waiting in the receive buffer before it.) */
static bool conn_peer_reset(net_conn_t *c)
{
#if defined(__linux__)
    uv_os_fd_t fd;
    struct tcp_info ti;
    socklen_t len = sizeof(ti);
    if (uv_fileno((const uv_handle_t *)&c->sock.tcp, &fd) != 0 ||
        getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0)
        return false;
    return ti.tcpi_state == TCP_CLOSE;
#else
    (void)c;
    return false;
#endif
}

/* The next timer in PH_BODY: the idle wait, or sooner when the whole-body deadline is. */
static uint64_t body_wait(const net_conn_t *c, uint64_t now, uint64_t idle_wait)
{
    uint64_t bd = c->body_deadline;
    if (bd == 0)
        return idle_wait;
    return bd <= now ? 0 : bd - now < idle_wait ? bd - now : idle_wait;
}

static void timer_cb(uv_timer_t *t)
{
    net_conn_t *c = t->data;
    uint64_t now = uv_now(c->srv->loop);
    if (c->kick) {
        c->kick = false;
        bool body = c->phase == PH_BODY;
        if ((c->phase == PH_IDLE || (body && !c->body_paused)) && c->pending.len) {
            c->read_paused = false;
            dp_buf_t pend = c->pending;
            memset(&c->pending, 0, sizeof(c->pending));
            conn_feed(c, pend.base, pend.len);
            dp_buf_free(&pend);
        }
        if (c->phase == PH_BODY) {
            c->last_read = uv_now(c->srv->loop);
            conn_arm(c, body_wait(c, c->last_read, c->srv->lim.client_idle_timeout_ms));
        }
        if (c->phase != PH_CLOSED && c->phase != PH_WAIT && !c->read_paused && !c->body_paused &&
            !c->wait_drain)
            net_sock_read_start(&c->sock);
        return;
    }
    switch (c->phase) {
    case PH_IDLE: {
        /* Waiting for a slow reader to take its responses: cut it off only once nothing was
         * written for the idle timeout, as in PH_WAIT. */
        uint64_t idle = c->srv->lim.client_idle_timeout_ms;
        if (c->wait_drain && now - c->sock.last_write < idle) {
            conn_arm(c, idle - (now - c->sock.last_write));
            return;
        }
        conn_close(c); /* idle or never-started connection: close silently */
        return;
    }
    case PH_HEAD:
        if (!net_validate_head_scan_started(&c->hs)) {
            conn_close(c);
            return;
        }
        conn_reject(c, 408, "request head not received in time");
        return;
    case PH_BODY: {
        uint64_t idle = c->srv->lim.client_idle_timeout_ms;
        uint64_t bd = c->body_deadline;
        if (bd && now >= bd && !c->body_paused) {
            conn_reject(c, 408, "request body not received in time (client_body_timeout_ms)");
            return;
        }
        if (now - c->last_read < idle && !c->body_paused) {
            conn_arm(c, body_wait(c, now, idle - (now - c->last_read)));
            return;
        }
        if (c->body_paused) {
            /* The upstream is slow, not the client: no timeout, but a client that gave up
             * must not hold the upstream request until the first-byte timeout. */
            if (conn_peer_reset(c)) {
                dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "client_disconnected");
                if (w) {
                    dp_jw_str(w, "request_id", c->req ? c->req->r.id : "");
                    dp_jw_str(w, "during", "request body (paused)");
                    dp_log_end(w);
                }
                conn_close(c);
                return;
            }
            conn_arm(c, PAUSED_CHECK_MS);
            return;
        }
        conn_reject(c, 408, "request body not received in time");
        return;
    }
    case PH_WAIT: {
        /* A client that stopped reading a response: cut it off once nothing was written for
         * the idle timeout. A long silent generation (nothing queued) is not its fault. */
        uint64_t idle = c->srv->lim.client_idle_timeout_ms;
        if (c->sock.queued > 0 && now - c->sock.last_write >= idle) {
            dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "client_send_timeout");
            if (w) {
                dp_jw_str(w, "request_id", c->req ? c->req->r.id : "");
                dp_log_end(w);
            }
            conn_close(c);
            return;
        }
        conn_arm(c, idle);
        return;
    }
    case PH_LINGER:
        conn_close(c);
        return;
    default:
        return;
    }
}

/* ---- connection lifecycle ------------------------------------------------------------------ */

static void conn_abort_req(net_conn_t *c);

/* Last handle closed: only now does the handler hear about a request it still owned, so
 * on_abort never runs inside one of its own net_resp_* calls. */
static void conn_handle_closed(net_conn_t *c)
{
    assert(c->closes_pending > 0);
    if (--c->closes_pending > 0)
        return;
    net_server_t *s = c->srv;
    /* Both handles closed, which only conn_close and net_resp_abort start, and off the
     * handshake list (conn_close takes it off; a request to abort means the handshake ended). */
    assert(c->phase == PH_CLOSED);
    assert(!c->handshaking && c->hs_prev == NULL && c->hs_next == NULL);
    conn_abort_req(c);
    assert(c->req == NULL);
    assert(c->prev != NULL || s->conns == c);
    assert(s->nconns > 0);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    s->nconns--;
    atomic_fetch_sub(&s->shared->conns, 1);
    dp_buf_free(&c->pending);
    free(c);
    maybe_server_done(s);
}

static void sock_closed(net_sock_t *sk)
{
    conn_handle_closed((net_conn_t *)sk->owner);
}

static void timer_closed(uv_handle_t *h)
{
    conn_handle_closed(h->data);
}

/* Tell the handler its request is gone (once), then release it. */
static void conn_abort_req(net_conn_t *c)
{
    req_impl_t *q = c->req;
    if (q == NULL)
        return;
    if (q->handed && !q->resp_ended && !q->abort_notified) {
        q->abort_notified = true;
        if (c->srv->h.on_abort)
            c->srv->h.on_abort(&q->r);
    }
    conn_release_req(c);
}

/* ---- pending TLS handshakes (max_pending_handshakes) -------------------------------------- */

static void hs_remove(net_conn_t *c)
{
    net_server_t *s = c->srv;
    if (!c->handshaking)
        return;
    assert(s->nhandshakes > 0);
    assert(c->hs_prev != NULL || s->hs_head == c);
    assert(c->hs_next != NULL || s->hs_tail == c);
    c->handshaking = false;
    if (c->hs_prev)
        c->hs_prev->hs_next = c->hs_next;
    else
        s->hs_head = c->hs_next;
    if (c->hs_next)
        c->hs_next->hs_prev = c->hs_prev;
    else
        s->hs_tail = c->hs_prev;
    c->hs_prev = c->hs_next = NULL;
    s->nhandshakes--;
}

static void hs_done(net_sock_t *sk)
{
    hs_remove(sk->owner);
}

/* A new TLS connection starts its handshake; at the bound, the oldest pending one goes. */
static void hs_add(net_conn_t *c)
{
    net_server_t *s = c->srv;
    assert(!c->handshaking);
    if (s->lim.max_pending_handshakes && s->nhandshakes >= s->lim.max_pending_handshakes) {
        net_conn_t *old = s->hs_head;
        assert(old != NULL); /* nhandshakes > 0: the list is not empty */
        uint64_t now = uv_now(s->loop);
        if (now - s->last_accept_warn >= 1000) {
            s->last_accept_warn = now;
            dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "tls_handshake_limit");
            if (w) {
                dp_jw_uint(w, "max_pending_handshakes", s->lim.max_pending_handshakes);
                dp_jw_str(w, "action", "closed the oldest pending handshake");
                dp_log_end(w);
            }
        }
        conn_close(old); /* takes it off the list */
        assert(!old->handshaking);
    }
    c->handshaking = true;
    c->hs_prev = s->hs_tail;
    c->hs_next = NULL;
    if (s->hs_tail)
        s->hs_tail->hs_next = c;
    else
        s->hs_head = c;
    s->hs_tail = c;
    s->nhandshakes++;
    c->sock.on_handshake = hs_done;
}

static void conn_close(net_conn_t *c)
{
    if (c->phase == PH_CLOSED)
        return;
    hs_remove(c);
    c->phase = PH_CLOSED;
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, timer_closed);
    net_sock_close(&c->sock);
}

/* Answer with an error and close, lingering so the client can read the answer even while
 * it is still sending (closing with unread input would reset the connection). */
static void conn_reject(net_conn_t *c, int status, const char *reason)
{
    net_server_t *s = c->srv;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "request_rejected");
    if (w) {
        char remote[48];
        net_sock_peer(&c->sock, remote, sizeof(remote));
        dp_jw_int(w, "status", status);
        dp_jw_str(w, "reason", reason);
        dp_jw_str(w, "remote", remote);
        if (c->req)
            dp_jw_str(w, "request_id", c->req->r.id);
        dp_log_end(w);
    }
    if (c->req && c->req->resp_started) {
        /* Too late for an error response: just cut the connection. */
        conn_close(c);
        return;
    }
    const char *code = status == 431   ? "headers_too_large"
                       : status == 413 ? "body_too_large"
                       : status == 408 ? "timeout"
                       : status == 503 ? "overloaded"
                                       : "bad_request";
    if (s->h.on_reject) {
        req_impl_t *q = c->req;
        bool owned = q && q->handed && !q->resp_ended && !q->abort_notified;
        s->h.on_reject(s, owned ? &q->r : NULL, status, code);
    }
    conn_abort_req(c);
    dp_buf_t body = {0};
    net_error_body(&body, net_error_type_for_status(status), code, NULL, reason);
    dp_buf_t head = {0};
    size_t dlen;
    const char *date = date_header(&dlen);
    dp_buf_printf(&head, "HTTP/1.1 %d %s\r\n", status, reason_phrase(status));
    dp_buf_append(&head, date, dlen);
    dp_buf_printf(&head,
                  "content-type: application/json\r\ncontent-length: %zu\r\nconnection: "
                  "close\r\n\r\n",
                  body.len);
    uv_buf_t bufs[2] = {uv_buf_init(head.base, (unsigned)head.len),
                        uv_buf_init(body.base, (unsigned)body.len)};
    int r = net_sock_write(&c->sock, bufs, 2);
    dp_buf_free(&head);
    dp_buf_free(&body);
    if (r != 0) {
        conn_close(c);
        return;
    }
    c->phase = PH_LINGER;
    dp_buf_free(&c->pending);
    net_sock_shutdown(&c->sock);
    net_sock_read_start(&c->sock);
    conn_arm(c, LINGER_MS);
}

/* A client that sends (or pipelines) requests without reading the responses would make us
 * queue every answer in memory: /v1/models is 40 bytes in, 400 out. Like nginx, take the next
 * request only once the queue is back under its low-water mark (sock_drain resumes). */
static void conn_wait_drain(net_conn_t *c)
{
    c->wait_drain = true;
    net_sock_read_stop(&c->sock);
    conn_arm(c, c->srv->lim.client_idle_timeout_ms);
}

static void conn_to_idle(net_conn_t *c)
{
    net_server_t *s = c->srv;
    assert(c->req == NULL); /* IDLE holds no request: the next byte starts one */
    c->phase = PH_IDLE;
    c->body_paused = false;
    memset(&c->hs, 0, sizeof(c->hs));
    c->hs.max_bytes = s->lim.max_header_bytes;
    c->hs.max_headers = s->lim.max_headers;
    llhttp_reset(&c->parser);
    if (s->draining && c->pending.len == 0) {
        conn_close(c);
        return;
    }
    if (net_sock_over(&c->sock)) {
        conn_wait_drain(c);
        return;
    }
    if (c->pending.len && !c->in_feed) {
        conn_kick(c);
        return;
    }
    conn_arm(c, c->first_request ? s->lim.client_header_timeout_ms : s->lim.client_idle_timeout_ms);
    if (!c->read_paused)
        net_sock_read_start(&c->sock);
}

/* The request is finished from both sides (response ended, body read): next one. */
static void conn_request_done(net_conn_t *c)
{
    bool keep = c->keep_alive;
    conn_release_req(c);
    c->first_request = false;
    if (!keep) {
        c->phase = PH_LINGER;
        net_sock_shutdown(&c->sock);
        conn_arm(c, LINGER_MS);
        return;
    }
    conn_to_idle(c);
}

/* ---- parsing --------------------------------------------------------------------------- */

static void split_target(net_req_t *r)
{
    const char *q = memchr(r->target.base, '?', r->target.len);
    if (q) {
        r->path = (dp_iovec_t){r->target.base, (size_t)(q - r->target.base)};
        r->query = (dp_iovec_t){q + 1, r->target.len - r->path.len - 1};
    } else {
        r->path = r->target;
        r->query = (dp_iovec_t){r->target.base + r->target.len, 0};
    }
}

/* docs/requests.md §1 ("Routes"): the path is normalised in place (it only shrinks) before any
 * handler sees it, so what is classified, policed and forwarded is what a percent-decoding replica
 * would route. */
static int normalize_target(net_req_t *r, const char **reason)
{
    char *p = (char *)r->target.base;
    size_t n = net_path_normalize(p, r->path.len, reason);
    if (n == 0)
        return 400;
    if (n != r->path.len) {
        size_t tail = r->target.len - r->path.len; /* "?query", or nothing */
        memmove(p + n, p + r->path.len, tail);
        r->target.len = n + tail;
        split_target(r);
    }
    return 0;
}

static void write_continue(net_conn_t *c)
{
    static const char msg[] = "HTTP/1.1 100 Continue\r\n\r\n";
    uv_buf_t b = uv_buf_init((char *)msg, sizeof(msg) - 1);
    net_sock_write(&c->sock, &b, 1);
}

/* The head is complete and parsed: validate, hand to the handler, pick the body phase.
 * Returns false when the connection was rejected or closed. */
static bool conn_head_done(net_conn_t *c)
{
    net_server_t *s = c->srv;
    req_impl_t *q = c->req;
    net_req_t *r = &q->r;
    /* The header buffer no longer grows: pointers into it are stable from here on. */
    r->headers = net_hdrs_spans(&q->hd);
    r->nheaders = q->hd.n;
    r->target = (dp_iovec_t){q->hd.buf.base ? q->hd.buf.base : "", q->url_len};
    split_target(r);
    r->method = llhttp_get_method(&c->parser);
    const char *mname = llhttp_method_name((llhttp_method_t)r->method);
    r->method_name = (dp_iovec_t){mname, strlen(mname)};
    r->http_major = llhttp_get_http_major(&c->parser);
    r->http_minor = llhttp_get_http_minor(&c->parser);

    const char *reason = NULL;
    int st = net_request_check(r->headers, r->nheaders, r->http_major, r->http_minor, r->method,
                               r->target.base, r->target.len, &q->framing, &reason);
    if (st == 0 && r->target.base[0] == '/')
        st = normalize_target(r, &reason);
    if (st != 0) {
        conn_reject(c, st, reason);
        return false;
    }
    r->chunked = q->framing.chunked;
    r->content_length = q->framing.content_length;
    r->has_body = r->chunked || r->content_length > 0;
    c->keep_alive = !q->framing.conn_close && !s->draining &&
                    (r->http_minor == 1 || q->framing.conn_keep_alive);
    if (c->remote[0] == '\0')
        net_sock_peer(&c->sock, c->remote, sizeof(c->remote));
    memcpy(r->remote, c->remote, sizeof(r->remote));
    s->ninflight++;
    q->handed = true;

    c->phase = r->has_body ? PH_BODY : PH_WAIT;
    q->body_done = !r->has_body;
    c->body_remaining = r->chunked ? 0 : (uint64_t)(r->content_length > 0 ? r->content_length : 0);
    memset(&c->cs, 0, sizeof(c->cs));
    uv_timer_stop(&c->timer);

    q->mode = s->h.on_head ? s->h.on_head(r) : NET_BODY_BUFFER;
    if (c->req != q || c->phase == PH_CLOSED || c->phase == PH_LINGER)
        return false; /* answered and closed inside on_head */
    if (q->resp_ended) {
        /* Answered at once: a body we have not read makes the connection unusable. */
        if (!q->body_done) {
            c->keep_alive = false;
            conn_request_done(c);
            return false;
        }
        return true;
    }
    if (r->has_body) {
        if (q->mode == NET_BODY_BUFFER && r->content_length > 0 &&
            (uint64_t)r->content_length > s->lim.max_body_bytes) {
            conn_reject(c, 413, "request body too large");
            return false;
        }
        c->body_deadline = 0;
        if (q->mode == NET_BODY_BUFFER) {
            /* A known length is reserved whole now: memory stays within the budget however
             * slowly the bodies already admitted arrive. */
            if (r->content_length > 0 && !body_reserve(c, (uint64_t)r->content_length)) {
                conn_overloaded(c);
                return false;
            }
            c->body_deadline =
                s->lim.client_body_timeout_ms ? uv_now(s->loop) + s->lim.client_body_timeout_ms : 0;
        }
        if (q->framing.expect_continue && r->http_minor == 1)
            write_continue(c);
        c->last_read = uv_now(s->loop);
        /* on_head may already have paused the body (the request waits for a replica slot). */
        conn_arm(c, c->body_paused ? PAUSED_CHECK_MS
                                   : body_wait(c, c->last_read, s->lim.client_idle_timeout_ms));
    }
    return true;
}

/* The request (head and body) has been received. */
static void conn_msg_done(net_conn_t *c)
{
    req_impl_t *q = c->req;
    q->body_done = true;
    c->phase = PH_WAIT;
    /* While the response is produced, watch for a client that stops reading it. */
    conn_arm(c, c->srv->lim.client_idle_timeout_ms);
    if (c->srv->h.on_complete)
        c->srv->h.on_complete(&q->r);
}

static void conn_feed(net_conn_t *c, const char *p, size_t n)
{
    net_server_t *s = c->srv;
    c->in_feed = true;
    while (n > 0 && c->phase != PH_CLOSED) {
        size_t used = 0;
        int r;
        const char *reason = "invalid request";
        int status = 400;
        switch (c->phase) {
        case PH_LINGER:
            n = 0; /* discard */
            continue;
        case PH_WAIT:
            /* Pipelined bytes: keep them for after the response, within a bound. */
            dp_buf_append(&c->pending, p, n);
            n = 0;
            if (c->pending.len > PENDING_LIMIT) {
                c->read_paused = true;
                net_sock_read_stop(&c->sock);
            }
            continue;
        case PH_IDLE:
            if (s->draining) {
                conn_close(c);
                goto out;
            }
            if (c->wait_drain || net_sock_over(&c->sock)) {
                /* Answers to earlier requests are still queued: keep the rest for later. */
                dp_buf_append(&c->pending, p, n);
                n = 0;
                if (!c->wait_drain)
                    conn_wait_drain(c);
                continue;
            }
            assert(c->req == NULL);
            c->req = req_get(c);
            c->phase = PH_HEAD;
            if (!c->first_request)
                conn_arm(c, s->lim.client_header_timeout_ms);
            continue;
        case PH_HEAD: {
            r = net_head_scan(&c->hs, p, n, &used, &status, &reason);
            if (r == NET_SCAN_ERROR) {
                conn_reject(c, status, reason);
                goto out;
            }
            llhttp_errno_t e = llhttp_execute(&c->parser, p, used);
            /* Upgrade/CONNECT pause the parser; net_request_check refuses them with a reason. */
            if (e != HPE_OK && !(e == HPE_PAUSED_UPGRADE && c->req->head_done)) {
                conn_reject(c, 400, llhttp_get_error_reason(&c->parser));
                goto out;
            }
            p += used;
            n -= used;
            if (r != NET_SCAN_DONE)
                continue;
            if (!c->req->head_done) {
                conn_reject(c, 400, "malformed request head");
                goto out;
            }
            if (!conn_head_done(c))
                continue; /* rejected or answered: phase tells what to do with the rest */
            if (c->req && c->phase == PH_WAIT) {
                if (!c->req->msg_done) {
                    conn_reject(c, 400, "malformed request");
                    goto out;
                }
                conn_msg_done(c);
            }
            continue;
        }
        case PH_BODY: {
            req_impl_t *q = c->req;
            if (c->body_paused) {
                /* Paused from on_head (the request waits for a replica slot): body bytes that
                 * came in the head's read wait too. Handing them to on_body would give them
                 * to a handler that has nowhere to put them yet. */
                dp_buf_append(&c->pending, p, n);
                n = 0;
                net_sock_read_stop(&c->sock);
                continue;
            }
            if (q->r.chunked) {
                r = net_chunk_scan(&c->cs, p, n, &used, &reason);
                if (r == NET_SCAN_ERROR) {
                    conn_reject(c, 400, reason);
                    goto out;
                }
            } else {
                used = n < c->body_remaining ? n : (size_t)c->body_remaining;
                c->body_remaining -= used;
                r = c->body_remaining == 0 ? NET_SCAN_DONE : NET_SCAN_MORE;
            }
            c->last_read = uv_now(s->loop);
            llhttp_errno_t e = llhttp_execute(&c->parser, p, used);
            if (c->req != q || c->phase == PH_CLOSED)
                goto out; /* the handler closed the connection from on_body */
            if (e != HPE_OK) {
                if (q->body_too_large)
                    conn_reject(c, 413, "request body too large");
                else if (q->body_over_budget)
                    conn_overloaded(c);
                else
                    conn_reject(c, 400, llhttp_get_error_reason(&c->parser));
                goto out;
            }
            p += used;
            n -= used;
            if (r == NET_SCAN_DONE) {
                if (!q->msg_done) {
                    conn_reject(c, 400, "malformed request body");
                    goto out;
                }
                conn_msg_done(c);
            } else if (c->body_paused) {
                /* The handler asked us to stop: keep the rest of this read for later. */
                dp_buf_append(&c->pending, p, n);
                n = 0;
            }
            continue;
        }
        default:
            n = 0;
        }
    }
out:
    c->in_feed = false;
    /* A response that ended inside a callback left pipelined bytes: parse them next tick. */
    if (c->phase == PH_IDLE && c->pending.len && !c->wait_drain)
        conn_kick(c);
}

static void sock_read(net_sock_t *sk, const char *p, size_t n)
{
    net_conn_t *c = sk->owner;
    if (c->phase == PH_BODY && c->body_paused) {
        dp_buf_append(&c->pending, p, n);
        net_sock_read_stop(sk);
        return;
    }
    if (c->pending.len && c->phase != PH_WAIT && c->phase != PH_LINGER) {
        /* Keep byte order: older unparsed bytes go first. */
        dp_buf_append(&c->pending, p, n);
        dp_buf_t pend = c->pending;
        memset(&c->pending, 0, sizeof(c->pending));
        conn_feed(c, pend.base, pend.len);
        dp_buf_free(&pend);
        return;
    }
    conn_feed(c, p, n);
}

static void sock_error(net_sock_t *sk, int status)
{
    net_conn_t *c = sk->owner;
    (void)status;
    if (c->phase == PH_WAIT && c->req && !c->req->resp_ended) {
        dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "client_disconnected");
        if (w) {
            dp_jw_str(w, "request_id", c->req->r.id);
            dp_jw_str(w, "error", uv_err_name(status));
            dp_log_end(w);
        }
    } else if (c->phase == PH_BODY && c->req) {
        dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "client_disconnected");
        if (w) {
            dp_jw_str(w, "request_id", c->req->r.id);
            dp_jw_str(w, "during", "request body");
            dp_log_end(w);
        }
    }
    conn_close(c);
}

static void sock_drain(net_sock_t *sk)
{
    net_conn_t *c = sk->owner;
    if (c->wait_drain) {
        c->wait_drain = false;
        if (c->phase == PH_IDLE)
            conn_to_idle(c); /* parses what is pending (from the loop), or reads again */
        return;
    }
    if (c->req && c->req->resp_started && !c->req->resp_ended && c->srv->h.on_drain)
        c->srv->h.on_drain(&c->req->r);
}

/* ---- accept -------------------------------------------------------------------------------- */

static void warn_accept_failed(net_server_t *s, int status, const char *detail)
{
    uint64_t now = uv_now(s->loop);
    if (now - s->last_accept_warn < 1000)
        return;
    s->last_accept_warn = now;
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "accept_failed");
    if (w) {
        dp_jw_str(w, "error", uv_err_name(status));
        dp_jw_str(w, "detail", detail ? detail : uv_strerror(status));
        dp_log_end(w);
    }
}

/* True when the process has no descriptor to spare. libuv's answer to EMFILE on accept (its
 * "EMFILE trick": free a reserved descriptor, accept and close every pending connection) does
 * not call the connection callback at all (libuv 1.44, uv__server_io), so without this probe
 * an operator would never hear that connections are being shed. One fcntl + close per
 * accepted connection: noise next to the accept itself. */
static int fd_headroom_error(const net_server_t *s)
{
    uv_os_fd_t lfd;
    if (uv_fileno((const uv_handle_t *)&s->listener, &lfd) != 0)
        return 0;
    int probe = fcntl(lfd, F_DUPFD_CLOEXEC, 0);
    if (probe >= 0) {
        close(probe);
        return 0;
    }
    return errno == EMFILE || errno == ENFILE ? uv_translate_sys_error(errno) : 0;
}

static void on_connection(uv_stream_t *ls, int status)
{
    net_server_t *s = ls->data;
    if (status < 0) {
        /* EMFILE/ENFILE when libuv could not even shed the pending connection itself. */
        warn_accept_failed(s, status, NULL);
        return;
    }
    net_conn_t *c = dp_xcalloc(1, sizeof(*c));
    c->srv = s;
    if (net_sock_init(s->loop, &c->sock, c) != 0) {
        free(c);
        return;
    }
    uv_timer_init(s->loop, &c->timer);
    c->timer.data = c;
    c->closes_pending = 2;
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    s->nconns++;
    atomic_fetch_add(&s->shared->conns, 1);
    c->sock.on_read = sock_read;
    c->sock.on_error = sock_error;
    c->sock.on_drain = sock_drain;
    c->sock.on_close = sock_closed;
    c->sock.high_water = s->lim.write_high_water;
    c->sock.low_water = s->lim.write_high_water / 4;
    llhttp_init(&c->parser, HTTP_REQUEST, &s->settings);
    c->parser.data = c;
    c->first_request = true;
    if (uv_accept(ls, (uv_stream_t *)&c->sock.tcp) != 0) {
        conn_close(c);
        return;
    }
    int nofd = fd_headroom_error(s);
    if (nofd != 0) {
        /* This connection took the last descriptor: libuv sheds the next ones silently, and
         * requests already in flight could not open an upstream connection. Give it back and
         * say why. */
        warn_accept_failed(s, nofd, "out of file descriptors: new connections are closed at once");
        conn_close(c);
        return;
    }
    if (atomic_load(&s->shared->conns) > s->lim.max_connections || s->draining) {
        uint64_t now = uv_now(s->loop);
        if (now - s->last_accept_warn >= 1000) {
            s->last_accept_warn = now;
            dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "connection_limit");
            if (w) {
                dp_jw_uint(w, "max_connections", s->lim.max_connections);
                dp_log_end(w);
            }
        }
        conn_close(c);
        return;
    }
    uv_tcp_nodelay(&c->sock.tcp, 1);
    if (s->tls) {
        net_tls_t *t = net_tls_new_server(s->tls);
        if (t == NULL) {
            conn_close(c);
            return;
        }
        net_sock_use_tls(&c->sock, t);
        hs_add(c);
    }
    s->accepted++;
    conn_to_idle(c);
}

/* ---- server ---------------------------------------------------------------------------------- */

net_server_t *net_server_new(uv_loop_t *loop, const net_handler_t *h, void *data,
                             const net_server_limits_t *limits)
{
    net_server_t *s = dp_xcalloc(1, sizeof(*s));
    s->loop = loop;
    s->h = *h;
    s->data = data;
    if (limits)
        s->lim = *limits;
    else
        net_server_limits_default(&s->lim);
    if (s->lim.write_high_water == 0)
        s->lim.write_high_water = 256 * 1024;
    llhttp_settings_init(&s->settings);
    s->settings.on_url = on_url;
    s->settings.on_header_field = on_header_field;
    s->settings.on_header_value = on_header_value;
    s->settings.on_headers_complete = on_headers_complete;
    s->settings.on_body = on_body;
    s->settings.on_message_complete = on_message_complete;
    s->shared = &s->own;
    uv_check_init(loop, &s->check);
    s->check.data = s;
    s->check_open = true;
    return s;
}

int net_server_listen(net_server_t *s, const char *host, uint16_t port)
{
    return net_server_listen_opts(s, host, port, false);
}

int net_server_listen_opts(net_server_t *s, const char *host, uint16_t port, bool reuseport)
{
    struct sockaddr_storage ss;
    int r = strchr(host, ':') ? uv_ip6_addr(host, port, (struct sockaddr_in6 *)&ss)
                              : uv_ip4_addr(host, port, (struct sockaddr_in *)&ss);
    if (r != 0)
        return r;
    /* _ex creates the socket now, so SO_REUSEPORT can be set before the bind (libuv 1.44 has
     * no bind flag for it). */
    if ((r = uv_tcp_init_ex(s->loop, &s->listener, ss.ss_family)) != 0)
        return r;
    s->listener_open = true;
    s->listener.data = s;
    if (reuseport) {
        uv_os_fd_t fd;
        int one = 1;
        if (uv_fileno((uv_handle_t *)&s->listener, &fd) != 0 ||
            setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof(one)) != 0)
            return UV_ENOTSUP;
    }
    if ((r = uv_tcp_bind(&s->listener, (struct sockaddr *)&ss, 0)) != 0)
        return r;
    if ((r = uv_listen((uv_stream_t *)&s->listener, 1024, on_connection)) != 0)
        return r;
    s->listening = true;
    int len = sizeof(s->bound);
    uv_tcp_getsockname(&s->listener, (struct sockaddr *)&s->bound, &len);
    s->port = ntohs(s->bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&s->bound)->sin6_port
                                                   : ((struct sockaddr_in *)&s->bound)->sin_port);
    return 0;
}

const struct sockaddr *net_server_bound(const net_server_t *s)
{
    return s->listening || s->bound.ss_family ? (const struct sockaddr *)&s->bound : NULL;
}

void net_server_set_tls(net_server_t *s, net_tls_ctx_t *ctx)
{
    if (ctx)
        net_tls_ctx_ref(ctx);
    net_tls_ctx_unref(s->tls);
    s->tls = ctx;
}

void net_server_on_overload(net_server_t *s, void (*cb)(const char *reason))
{
    s->on_overload = cb;
}

uint64_t net_server_body_bytes(const net_server_t *s)
{
    return atomic_load(&s->shared->body_bytes);
}

uint16_t net_server_port(const net_server_t *s)
{
    return s->port;
}

void *net_server_data(const net_server_t *s)
{
    return s->data;
}

uv_loop_t *net_server_loop(const net_server_t *s)
{
    return s->loop;
}

void net_server_set_limits(net_server_t *s, const net_server_limits_t *limits)
{
    s->lim = *limits;
    if (s->lim.write_high_water == 0)
        s->lim.write_high_water = 256 * 1024;
}

size_t net_server_connections(const net_server_t *s)
{
    return s->nconns;
}

uint64_t net_server_accepted(const net_server_t *s)
{
    return s->accepted;
}

size_t net_server_inflight(const net_server_t *s)
{
    return s->ninflight;
}

static void listener_closed(uv_handle_t *h)
{
    net_server_t *s = h->data;
    s->listener_open = false;
    maybe_server_done(s);
}

static void stop_listening(net_server_t *s)
{
    if (s->listener_open && !uv_is_closing((uv_handle_t *)&s->listener)) {
        s->listening = false;
        uv_close((uv_handle_t *)&s->listener, listener_closed);
    }
}

static void check_closed(uv_handle_t *h)
{
    net_server_t *s = h->data;
    s->check_open = false;
    maybe_server_done(s);
}

static void maybe_server_done(net_server_t *s)
{
    if (s->nconns > 0 || s->listener_open)
        return;
    if (s->draining && s->drain_cb) {
        void (*cb)(net_server_t *) = s->drain_cb;
        s->drain_cb = NULL;
        cb(s);
    }
    if (s->closing && s->check_open) {
        if (!uv_is_closing((uv_handle_t *)&s->check))
            uv_close((uv_handle_t *)&s->check, check_closed);
        return;
    }
    if (s->closing) {
        void (*cb)(void *) = s->close_cb;
        void *d = s->close_data;
        /* Every connection has gone through conn_handle_closed: nothing refers to s now. */
        assert(s->conns == NULL && s->corked == NULL && s->ninflight == 0);
        assert(s->hs_head == NULL && s->hs_tail == NULL && s->nhandshakes == 0);
        while (s->free_reqs) {
            req_impl_t *q = s->free_reqs;
            s->free_reqs = q->next_free;
            net_hdrs_free(&q->hd);
            dp_buf_free(&q->out);
            dp_buf_free(&q->r.body);
            free(q);
        }
        net_tls_ctx_unref(s->tls);
        free(s);
        if (cb)
            cb(d);
    }
}

void net_server_drain(net_server_t *s, void (*done_cb)(net_server_t *s))
{
    s->draining = true;
    s->drain_cb = done_cb;
    stop_listening(s);
    for (net_conn_t *c = s->conns, *next; c; c = next) {
        next = c->next;
        c->keep_alive = false;
        if (c->phase == PH_IDLE && c->pending.len == 0)
            conn_close(c);
    }
    maybe_server_done(s);
}

void net_server_close(net_server_t *s, void (*done_cb)(void *data), void *data)
{
    s->closing = true;
    s->close_cb = done_cb;
    s->close_data = data;
    stop_listening(s);
    for (net_conn_t *c = s->conns, *next; c; c = next) {
        next = c->next;
        conn_close(c);
    }
    maybe_server_done(s);
}

/* ---- request accessors -------------------------------------------------------------------- */

const net_header_t *net_req_header(const net_req_t *req, const char *name)
{
    for (size_t i = 0; i < req->nheaders; i++)
        if (dp_strieq(req->headers[i].name.base, req->headers[i].name.len, name))
            return &req->headers[i];
    return NULL;
}

bool net_req_query(const net_req_t *req, const char *name, dp_iovec_t *out)
{
    dp_iovec_t q = req->query;
    size_t nl = strlen(name);
    size_t i = 0;
    while (i < q.len) {
        size_t end = i;
        while (end < q.len && q.base[end] != '&')
            end++;
        if (end - i > nl && memcmp(q.base + i, name, nl) == 0 && q.base[i + nl] == '=') {
            *out = (dp_iovec_t){q.base + i + nl + 1, end - i - nl - 1};
            return true;
        }
        i = end + 1;
    }
    return false;
}

void net_req_pause_body(net_req_t *req)
{
    net_conn_t *c = req->conn;
    if (c->phase != PH_BODY || c->body_paused)
        return;
    c->body_paused = true;
    net_sock_read_stop(&c->sock);
    conn_arm(c, PAUSED_CHECK_MS); /* see conn_peer_reset */
}

void net_req_resume_body(net_req_t *req)
{
    net_conn_t *c = req->conn;
    if (!c->body_paused)
        return;
    c->body_paused = false;
    if (c->phase != PH_BODY)
        return;
    c->last_read = uv_now(c->srv->loop);
    if (c->pending.len) {
        /* Parse what was held back from the loop, not from inside the caller's stack. */
        conn_kick(c);
        return;
    }
    if (!c->read_paused)
        net_sock_read_start(&c->sock);
}

/* ---- responses ----------------------------------------------------------------------------- */

static inline req_impl_t *impl(net_req_t *r)
{
    return dp_container_of(r, req_impl_t, r);
}

uint64_t net_req_take_body_budget(net_req_t *req)
{
    req_impl_t *q = impl(req);
    uint64_t n = q->body_reserved;
    q->body_reserved = 0;
    return n;
}

void net_server_return_body_budget(net_server_t *s, uint64_t bytes)
{
    atomic_fetch_sub(&s->shared->body_bytes, bytes);
}

void net_server_shared_return_body_budget(net_server_shared_t *shared, uint64_t bytes)
{
    atomic_fetch_sub(&shared->body_bytes, bytes);
}

void net_server_share(net_server_t *s, net_server_shared_t *shared)
{
    s->shared = shared;
}

static bool conn_usable(net_req_t *req)
{
    net_conn_t *c = req->conn;
    return c->req == impl(req) && c->phase != PH_CLOSED && c->phase != PH_LINGER;
}

int net_resp_start(net_req_t *req, int status, const net_header_t *hdrs, size_t nhdrs,
                   int64_t content_length)
{
    req_impl_t *q = impl(req);
    net_conn_t *c = req->conn;
    if (!conn_usable(req) || q->resp_started)
        return -1;
    q->resp_started = true;
    q->resp_no_body = req->method == HTTP_HEAD || status == 204 || status == 304 ||
                      (status >= 100 && status < 200);
    /* Answering before the body is read leaves unread input: this connection then closes. */
    if (!q->body_done)
        c->keep_alive = false;
    if (c->srv->draining)
        c->keep_alive = false;
    dp_buf_t *o = &q->out;
    dp_buf_reset(o);
    size_t dlen;
    const char *date = date_header(&dlen);
    dp_buf_reserve(o, 256);
    dp_buf_append(o, "HTTP/1.1 ", 9);
    dp_buf_append_u64(o, (uint64_t)status);
    dp_buf_appendc(o, ' ');
    dp_buf_appends(o, reason_phrase(status));
    dp_buf_append(o, "\r\n", 2);
    dp_buf_append(o, date, dlen);
    for (size_t i = 0; i < nhdrs; i++) {
        dp_buf_append(o, hdrs[i].name.base, hdrs[i].name.len);
        dp_buf_append(o, ": ", 2);
        dp_buf_append(o, hdrs[i].value.base, hdrs[i].value.len);
        dp_buf_append(o, "\r\n", 2);
    }
    if (content_length >= 0) {
        q->resp_remaining = content_length;
        if (status != 204 && status != 304 && !(status >= 100 && status < 200)) {
            dp_buf_append(o, "content-length: ", 16);
            dp_buf_append_u64(o, (uint64_t)content_length);
            dp_buf_append(o, "\r\n", 2);
        }
    } else if (!q->resp_no_body) {
        if (req->http_minor == 1) {
            q->resp_chunked = true;
            dp_buf_append(o, "transfer-encoding: chunked\r\n", 28);
        } else {
            c->keep_alive = false; /* HTTP/1.0: the close delimits the body */
        }
    }
    if (!c->keep_alive)
        dp_buf_append(o, "connection: close\r\n", 19);
    else if (req->http_minor == 0)
        dp_buf_append(o, "connection: keep-alive\r\n", 24);
    dp_buf_append(o, "\r\n", 2);
    q->resp_head_pending = true;
    cork_add(c->srv, q);
    return 0;
}

/* Write the pending head (if any) and up to three body pieces in one writev. */
static int resp_emit(net_req_t *req, const char *pre, size_t prelen, const char *p, size_t n,
                     const char *post, size_t postlen)
{
    req_impl_t *q = impl(req);
    uv_buf_t bufs[4];
    unsigned nb = 0;
    if (q->resp_head_pending) {
        bufs[nb++] = uv_buf_init(q->out.base, (unsigned)q->out.len);
        q->resp_head_pending = false;
        cork_remove(req->server, q);
    }
    if (prelen)
        bufs[nb++] = uv_buf_init((char *)pre, (unsigned)prelen);
    if (n)
        bufs[nb++] = uv_buf_init((char *)p, (unsigned)n);
    if (postlen)
        bufs[nb++] = uv_buf_init((char *)post, (unsigned)postlen);
    if (nb == 0)
        return 0;
    int r = net_sock_write(&req->conn->sock, bufs, nb);
    if (r != 0) {
        net_conn_t *c = req->conn;
        conn_close(c);
        return -1;
    }
    return 0;
}

static void check_cb(uv_check_t *h)
{
    net_server_t *s = h->data;
    while (s->corked) {
        req_impl_t *q = s->corked;
        cork_remove(s, q);
        if (q->resp_head_pending && conn_usable(&q->r))
            resp_emit(&q->r, NULL, 0, NULL, 0, NULL, 0);
    }
}

int net_resp_write(net_req_t *req, const char *p, size_t n)
{
    req_impl_t *q = impl(req);
    if (!conn_usable(req) || !q->resp_started || q->resp_ended)
        return -1;
    if (n == 0 || q->resp_no_body)
        return 0;
    if (q->resp_remaining >= 0) {
        if ((int64_t)n > q->resp_remaining)
            n = (size_t)q->resp_remaining; /* never write past the announced length */
        q->resp_remaining -= (int64_t)n;
        return resp_emit(req, NULL, 0, p, n, NULL, 0);
    }
    if (q->resp_chunked) {
        char pre[20];
        int pl = snprintf(pre, sizeof(pre), "%zx\r\n", n);
        return resp_emit(req, pre, (size_t)pl, p, n, "\r\n", 2);
    }
    return resp_emit(req, NULL, 0, p, n, NULL, 0);
}

/* The handler gave the request up (net_resp_end, net_resp_abort, net_resp_send failed on a
 * connection that is already closing): it drops its pointers right after such a call, so the
 * on_abort still due from the close callback must not reach it. Before this, a handler that
 * freed its state after a failed net_resp_end got on_abort with req->data dangling (client
 * half-closed while the upstream response completed). net_resp_start and net_resp_write failing
 * do not disown: the handler keeps the request and hears on_abort. */
static void resp_disown(req_impl_t *q)
{
    if (q->r.conn->req == q)
        q->resp_ended = true;
}

int net_resp_end(net_req_t *req)
{
    req_impl_t *q = impl(req);
    net_conn_t *c = req->conn;
    if (!conn_usable(req) || !q->resp_started || q->resp_ended) {
        resp_disown(q);
        return -1;
    }
    if (q->resp_remaining > 0 && !q->resp_no_body) {
        /* Shorter than announced: the client must not take it for a whole response. */
        net_resp_abort(req);
        return -1;
    }
    /* The body's share of the budget goes back before the last byte leaves: a client that
     * read this answer and sends its next body (to a server on another thread, sharing the
     * budget) finds it free, as it would on one thread. The bytes go a moment later. */
    atomic_fetch_sub(&c->srv->shared->body_bytes, q->body_reserved);
    q->body_reserved = 0;
    int r;
    if (q->resp_chunked && !q->resp_no_body)
        r = resp_emit(req, NULL, 0, "0\r\n\r\n", 5, NULL, 0);
    else
        r = resp_emit(req, NULL, 0, NULL, 0, NULL, 0);
    if (r != 0) {
        resp_disown(q);
        return -1;
    }
    q->resp_ended = true;
    if (!q->body_done) {
        /* Early answer: the rest of the body is discarded by closing after the flush. */
        c->keep_alive = false;
        conn_release_req(c);
        c->phase = PH_LINGER;
        net_sock_shutdown(&c->sock);
        conn_arm(c, LINGER_MS);
        return 0;
    }
    if (!c->keep_alive) {
        conn_release_req(c);
        c->phase = PH_LINGER;
        net_sock_shutdown(&c->sock);
        conn_arm(c, LINGER_MS);
        return 0;
    }
    conn_request_done(c);
    return 0;
}

void net_resp_abort(net_req_t *req)
{
    req_impl_t *q = impl(req);
    net_conn_t *c = req->conn;
    if (c->req != q)
        return;
    q->resp_ended = true; /* the handler is done with it: no on_abort */
    if (c->phase == PH_CLOSED)
        return; /* already closing: the close callback releases the request */
    conn_release_req(c);
    c->phase = PH_CLOSED;
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, timer_closed);
    /* Deliver what was written, then close without the final chunk. */
    net_sock_read_stop(&c->sock);
    net_sock_close_after_flush(&c->sock);
}

int net_resp_raw_and_close(net_req_t *req, const char *p, size_t n)
{
    req_impl_t *q = impl(req);
    net_conn_t *c = req->conn;
    if (!conn_usable(req) || q->resp_started) {
        resp_disown(q);
        return -1;
    }
    q->resp_started = true;
    uv_buf_t b = uv_buf_init((char *)p, (unsigned)n);
    int r = net_sock_write(&c->sock, &b, 1);
    net_resp_abort(req);
    return r == 0 ? 0 : -1;
}

size_t net_resp_pending(const net_req_t *req)
{
    return req->conn->sock.queued;
}

bool net_server_resp_started(const net_req_t *req)
{
    return impl((net_req_t *)req)->resp_started;
}

int net_resp_send(net_req_t *req, int status, const char *content_type, const char *body, size_t n,
                  const net_header_t *extra, size_t nextra)
{
    net_header_t hdrs[16];
    size_t nh = 0;
    req_impl_t *q = impl(req);
    if (content_type)
        hdrs[nh++] = (net_header_t){DP_IOV("content-type"), {content_type, strlen(content_type)}};
    for (size_t i = 0; i < nextra && nh < DP_ARRAY_SIZE(hdrs); i++)
        hdrs[nh++] = extra[i];
    if (net_resp_start(req, status, hdrs, nh, (int64_t)n) != 0) {
        resp_disown(q);
        return -1;
    }
    if (!q->resp_no_body && n) {
        q->resp_remaining = 0;
        if (resp_emit(req, NULL, 0, body, n, NULL, 0) != 0) {
            resp_disown(q);
            return -1;
        }
    }
    return net_resp_end(req);
}

int net_resp_error(net_req_t *req, int status, const char *type, const char *code,
                   const char *param, const char *message, const net_header_t *extra, size_t nextra)
{
    dp_buf_t b = {0};
    net_error_body(&b, type ? type : net_error_type_for_status(status), code, param, message);
    int r = net_resp_send(req, status, "application/json", b.base, b.len, extra, nextra);
    dp_buf_free(&b);
    return r;
}
