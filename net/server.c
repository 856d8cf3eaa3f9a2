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
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <llhttp.h>
#include <malloc.h>

#include "common/jw.h"
#include "common/list.h"
#include "common/log.h"
#include "common/util.h"
#include "net/hdrs.h"
#include "net/path.h"
#include "net/sock.h"

enum { PH_IDLE = 0, PH_HEAD, PH_BODY, PH_WAIT, PH_LINGER, PH_CLOSED };

#define LINGER_MS 2000
#define PAUSED_CHECK_MS 1000      /* how often a client whose body reads are paused is looked at */
#define PENDING_LIMIT (64 * 1024) /* pipelined bytes buffered before we stop reading */
/* Requests a connection may start in one turn of the loop: a client that keeps its pipeline
 * full of requests answered at once (a model list, a refusal that keeps the connection) gets
 * this many, then waits for the next turn behind everyone else. A new connection waits about
 * one round of every such client's turn, so the round is kept short: with 100 clients keeping
 * 64 model-list requests in flight, a new connection's answer took ~70 ms at 16 a turn and
 * ~15 ms at 4, and the flood's own rate was the same; at 1 a turn it fell by 15%. */
#define PIPELINE_BURST 4
#define REQ_CACHE_MAX 256
#define BUDGET_STEP (16 * 1024) /* a body's reservation grows by at least this much at a time */
#define BUDGET_RETRY_MS 50      /* a body waiting for shed bodies' room tries again this often */
#define BUDGET_WAIT_MS 2000     /* ... and is answered 503 after this long */
#define BUDGET_STALL_NS (1000 * 1000000ull) /* no byte for this long: slower than any sender */
#define REQ_CACHE_BODY_MAX (64 * 1024)      /* bigger body buffers go to dp_buf_release */
/* A body of known length up to this size gets a buffer of its whole size once a quarter of it
 * has arrived, or at once after a body at least half as long on the same connection, all of it
 * reserved in the budget then, while that stays at most half used (body_presize): one
 * allocation, no more copies and no half-used doubling. Until then it grows as any buffer does, so
 * a sender that declares a length and stops makes us hold (or map) at most 4x what it sent, which
 * the body budget bounds. Longer bodies grow by doubling. */
#define BODY_PRESIZE_MAX (1024 * 1024)
/* After a body buffered whole (Content-Length) of this length or more, up to BODY_PRESIZE_MAX,
 * the connection's next first read takes the last head's length and a little more, over plain
 * TCP (a TLS read is of records): the head is parsed alone, the body sized (body_presize) and
 * read straight into its buffer. One read more, and the first 64 KiB of the body not copied
 * out of the loop's buffer. */
#define HEAD_FIRST_MIN (32 * 1024)
#define HEAD_FIRST_SLACK 128
_Static_assert(BODY_PRESIZE_MAX + 1 + (BODY_PRESIZE_MAX + 1) / 2 <= DP_BUF_STASH_MAX,
               "a released body buffer must be one a presized body can take again");

enum { SHED_NONE = 0, SHED_SLOW, SHED_SHARE };

/* One client address's books: IPv4 address, or IPv6 /64 (one host's addresses, as one
 * subscriber's SLAAC prefix). Lives while a connection or a request refers to it. */
typedef struct net_budget_addr_s {
    struct net_budget_addr_s *next; /* bucket chain */
    uint8_t key[9];                 /* family byte, then 4 (IPv4) or 8 (IPv6 /64) bytes */
    uint32_t refs;
    uint32_t conns; /* its open connections (max_connections_per_client) */
    uint64_t held;  /* bytes of the budget its requests hold */
} budget_addr_t;

/* A NET_BODY_BUFFER body being read: a candidate for shedding. Everything here but `received`
 * and `last_ns` is under the books' lock; those two are written by the owning loop only. */
typedef struct net_budget_hold_s {
    struct net_budget_hold_s *prev, *next; /* shared->holds */
    bool listed;
    net_server_t *srv;
    net_conn_t *conn;
    uint64_t start_ns;
    _Atomic uint64_t received;
    _Atomic uint64_t last_ns; /* dp_now_ns() of its last bytes */
    uint8_t shed;             /* SHED_*: marked; its own loop closes it */
    bool shed_taken;          /* its loop has seen the mark */
    uint64_t shed_bytes;      /* its reservation when marked (counted in shared->shedding) */
    uint64_t shed_rate;       /* for the log line: bytes/s, its address's bytes and share */
    uint64_t shed_addr_held, shed_share;
    char shed_for[24]; /* the request it made room for */
} budget_hold_t;

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
    bool whole_tried;       /* body_presize asked the budget for all of the body once */
    uint32_t prev_body;     /* the connection's last body before this request (last_body) */
    uint64_t body_reserved; /* this request's share of the server's body_bytes (books' lock) */
    budget_addr_t *addr;    /* its client address's books, from its body's start (lock) */
    budget_hold_t hold;     /* on the shed candidates while its body is read */
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
    dp_buf_t pending; /* bytes read and not parsed yet: pending[pending_off..len) (pend_*) */
    size_t pending_off;
    dp_buf_t *feeding; /* while pend_feed parses them: the buffer they are in */
    uint64_t body_remaining;
    uint64_t deadline;      /* absolute uv_now() ms for the current timer purpose */
    uint64_t timer_due;     /* when the timer, while active, fires (may be before deadline) */
    uint64_t body_deadline; /* uv_now() by which a buffered body must be read (0: none) */
    uint64_t last_read;     /* uv_now() of the last read, for idle checks in BODY */
    uint32_t head_len;      /* the request's head bytes so far */
    uint32_t last_head;     /* the last request's head: its length */
    uint32_t last_body;     /* the last request's body, buffered whole: its Content-Length (0 once
                             * the next request starts, which keeps it as prev_body) */
    bool head_capped;       /* the read libuv asks for now is the head-first one */
    int closes_pending;
    bool counted; /* holds a place of max_connections (the shared count) */
    bool keep_alive;
    bool first_request;
    bool in_feed;
    bool kick;        /* kicked: pipelined or held-back bytes are parsed at the loop's next turn */
    bool kick_queued; /* on the server's kick queue (kq_head): the kick may since be cancelled */
    uint8_t burst;    /* requests started since the last read or kick (PIPELINE_BURST) */
    net_conn_t *kq_prev, *kq_next;
    char remote[48];  /* the peer, "ip:port": looked up once, at accept */
    bool read_paused; /* by pending overflow or by the handler */
    bool body_paused;
    bool wait_drain;  /* IDLE with responses queued above high-water: next request waits */
    bool handshaking; /* on the server's pending-handshake list */
    net_conn_t *hs_prev, *hs_next;
    uint8_t addr_key[9];   /* the peer for the body budget's fair share (see budget_addr_t) */
    budget_addr_t *client; /* its address's books, counting this connection (books' lock) */
    bool budget_wait;      /* the body waits for room being freed: reads stopped */
    uint64_t wait_since;   /* uv_now() when that wait began (0: not waiting) */
    uint64_t promised;     /* room held back for this body while it waits (books' lock) */
    net_conn_t *bw_prev, *bw_next; /* the server's waiting bodies */
};

struct net_server_s {
    uv_loop_t *loop;
    uv_tcp_t listener;
    bool listening, draining, closing, listener_open, check_open;
    /* Responses whose head waits to be coalesced with the first body bytes; whatever is
     * still waiting when the loop finishes an iteration is flushed by `check`. */
    uv_check_t check;
    req_impl_t *corked;
    /* Kicked connections, oldest first, each given one turn per loop iteration (kick_cb); the
     * idle handle, active while any wait, keeps the loop from blocking in its poll. */
    uv_idle_t kicker;
    bool kicker_open;
    net_conn_t *kq_head, *kq_tail;
    size_t nkicks;
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
    uint64_t head_reads; /* first reads of a request capped to a head's length */
    net_conn_t *conns;
    req_impl_t *free_reqs;
    size_t nfree;
    uint16_t port;
    struct sockaddr_storage bound; /* the listener's address, once listening */
    net_tls_ctx_t *tls;
    /* The body budget: woken from any thread when a body of this server is to be shed or
     * room came free for one that waits. */
    uv_async_t wake;
    bool wake_open;
    net_server_t *grp_next; /* shared->servers, under the books' lock */
    size_t nwait;           /* bodies waiting (bw_head), under the books' lock */
    net_conn_t *bw_head;
    uint64_t last_accept_warn;
    uint64_t last_client_warn; /* client_connection_limit, logged at most once a second */
    void (*drain_cb)(net_server_t *s);
    void (*close_cb)(void *data);
    void *close_data;
};

static void conn_feed(net_conn_t *c, const char *p, size_t n);
static void conn_close(net_conn_t *c);

/* ---- pending: bytes read and not parsed yet --------------------------------------------------
 * Parsing them (pend_feed) hands conn_feed the buffer itself. When a turn stops part way (its
 * share of pipelined requests used, or answers still unread), what it did not parse stays where
 * it is and only the offset moves: a pipeline of many small requests is copied once, not once
 * more per turn (64 KiB of them, 4 a turn, would be ~1,600 copies of what is left). */
static inline size_t pend_len(const net_conn_t *c)
{
    return c->pending.len - c->pending_off;
}

static void pend_free(net_conn_t *c)
{
    dp_buf_free(&c->pending);
    c->pending_off = 0;
}

/* Bytes read from the socket, after what already waits. */
static void pend_add(net_conn_t *c, const char *p, size_t n)
{
    if (c->pending_off) {
        dp_buf_consume(&c->pending, c->pending_off);
        c->pending_off = 0;
    }
    dp_buf_append(&c->pending, p, n);
}

/* The rest of what conn_feed was handed, from p on, waits for a later turn: in place when it
 * is the rest of the buffer pend_feed is parsing. */
static void pend_keep(net_conn_t *c, const char *p, size_t n)
{
    dp_buf_t *src = c->feeding;
    if (n == 0)
        return;
    if (src && pend_len(c) == 0 && p >= src->base && p + n == src->base + src->len) {
        pend_free(c);
        c->pending = *src;
        c->pending_off = (size_t)(p - src->base);
        memset(src, 0, sizeof(*src));
        return;
    }
    pend_add(c, p, n);
}

/* Parse what waits. The buffer is the connection's no longer while conn_feed runs: what a
 * handler or a turn's end puts in `pending` meanwhile starts a new one (or takes this one
 * back, pend_keep). */
static void pend_feed(net_conn_t *c)
{
    dp_buf_t pend = c->pending;
    size_t off = c->pending_off;
    memset(&c->pending, 0, sizeof(c->pending));
    c->pending_off = 0;
    c->feeding = &pend;
    conn_feed(c, pend.base + off, pend.len - off);
    c->feeding = NULL;
    dp_buf_free(&pend);
}
static void conn_reject(net_conn_t *c, int status, const char *reason);
static void conn_to_idle(net_conn_t *c);
static void maybe_server_done(net_server_t *s);
static void conn_arm(net_conn_t *c, uint64_t ms);
static void conn_kick(net_conn_t *c);
static void budget_unwait(net_conn_t *c);
static void budget_release(net_server_t *s, struct req_impl_s *q);

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
        assert(q->addr == NULL && !q->hold.listed);
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
    assert(!q->corked && q->body_reserved == 0 && q->addr == NULL && !q->hold.listed);
    net_hdrs_t hd = q->hd;
    dp_buf_t out = q->out, body = q->r.body;
    /* A cached body buffer is memory outside the body budget: only small ones are kept with
     * the request; a large one goes to the thread's bounded stash for the next large body. */
    if (body.cap > REQ_CACHE_BODY_MAX) {
        dp_buf_release(&body);
        q->r.body = body;
    }
    if (s->nfree >= REQ_CACHE_MAX || s->closing || hd.buf.cap > 64 * 1024) {
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
    budget_unwait(c);
    budget_release(c->srv, q);
    if (q->handed) {
        assert(c->srv->ninflight > 0);
        c->srv->ninflight--;
    }
    req_put(c->srv, q);
}

/* ---- the body budget ----------------------------------------------------------------------
 *
 * max_inflight_body_bytes bounds the NET_BODY_BUFFER bodies held by every server of a group
 * (net_server_share): one set of books, `shared`, under one spin lock, for every worker thread.
 * A body reserves what has arrived, before llhttp sees it (conn_feed), never what it declares:
 * a connection that declares 8 MiB and sends nothing holds nothing (but a body given its whole
 * buffer at once for its connection's last body reserves all of it then, while the budget is at
 * most half used: budget_take_whole). The sum of reservations never exceeds the budget, however
 * many bodies grow at once: each growth is checked and taken under the lock.
 *
 * When a body cannot grow, the budget is full: bodies still being read are shed to make room
 * (budget_make_room), and the body waits (reads stopped, what it read kept in `pending`) until
 * their loops have closed them and given their share back. Who may be shed:
 * - The fair share is the budget over the client addresses holding some of it (the growing
 *   body's counted too). An address over its share yields first: any of its bodies may be shed
 *   for a body of an address within its share.
 * - Otherwise a body is shed only for a faster one (bytes per second since its request began):
 *   a client trickling its body loses its room to one that sends it.
 * - Slowest first, those of over-share addresses before the others; nothing is shed unless
 *   what may be shed covers the whole need, and then the body is refused 503 at once.
 * The victims are marked here and closed by their own loop (the server's `wake` async): 503 when
 * their address was over its share, 408 when they were too slow, each with a `body_shed` log
 * line and an on_overload("body_shed"). */

static void books_lock(net_server_shared_t *b)
{
    for (unsigned spins = 0;; spins++) {
        if (!atomic_load_explicit(&b->lock, memory_order_relaxed) &&
            !atomic_exchange_explicit(&b->lock, true, memory_order_acquire))
            return;
        if (spins >= 64)
            sched_yield(); /* the holder may be off its core: let it run */
    }
}

static void books_unlock(net_server_shared_t *b)
{
    atomic_store_explicit(&b->lock, false, memory_order_release);
}

/* The fair-share key of a peer: IPv4 (IPv4-mapped IPv6 too) by address, IPv6 by /64. */
static void addr_key_of(const struct sockaddr_storage *ss, uint8_t key[9])
{
    memset(key, 0, 9);
    if (ss->ss_family == AF_INET) {
        key[0] = 4;
        memcpy(key + 1, &((const struct sockaddr_in *)ss)->sin_addr, 4);
    } else if (ss->ss_family == AF_INET6) {
        const uint8_t *a = ((const struct sockaddr_in6 *)ss)->sin6_addr.s6_addr;
        static const uint8_t mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
        if (memcmp(a, mapped, 12) == 0) {
            key[0] = 4;
            memcpy(key + 1, a + 12, 4);
        } else {
            key[0] = 6;
            memcpy(key + 1, a, 8);
        }
    }
}

static size_t addr_bucket(const uint8_t key[9])
{
    uint64_t h;
    memcpy(&h, key + 1, 8);
    return (size_t)(dp_mix64(h ^ key[0]) % NET_BUDGET_BUCKETS);
}

/* Lock held. The address's books with one more reference (created when new). */
static budget_addr_t *addr_ref(net_server_shared_t *b, const uint8_t key[9])
{
    budget_addr_t **head = &b->addrs[addr_bucket(key)];
    for (budget_addr_t *a = *head; a; a = a->next)
        if (memcmp(a->key, key, 9) == 0) {
            a->refs++;
            return a;
        }
    budget_addr_t *a = dp_xcalloc(1, sizeof(*a));
    memcpy(a->key, key, 9);
    a->refs = 1;
    a->next = *head;
    *head = a;
    return a;
}

/* Lock held. Drop a reference; the last one frees it (it holds nothing by then). */
static void addr_unref(net_server_shared_t *b, budget_addr_t *a)
{
    assert(a->refs > 0);
    if (--a->refs > 0)
        return;
    assert(a->held == 0);
    budget_addr_t **pp = &b->addrs[addr_bucket(a->key)];
    while (*pp != a)
        pp = &(*pp)->next;
    *pp = a->next;
    free(a);
}

/* Count a new connection against its address, looked up here once for the connection's
 * requests and log lines. False: the address is at max_connections_per_client. A socket with
 * no peer left is not counted; its first read finds it gone. */
static bool conn_client_take(net_conn_t *c)
{
    net_server_t *s = c->srv;
    struct sockaddr_storage ss;
    if (!net_sock_peer(&c->sock, c->remote, sizeof(c->remote), &ss))
        return true;
    addr_key_of(&ss, c->addr_key);
    net_server_shared_t *b = s->shared;
    uint32_t max = s->lim.max_connections_per_client;
    books_lock(b);
    budget_addr_t *a = addr_ref(b, c->addr_key);
    bool ok = max == 0 || a->conns < max;
    if (ok) {
        a->conns++;
        c->client = a;
    } else {
        addr_unref(b, a);
    }
    books_unlock(b);
    return ok;
}

static void conn_client_give(net_conn_t *c)
{
    if (c->client == NULL)
        return;
    net_server_shared_t *b = c->srv->shared;
    books_lock(b);
    assert(c->client->conns > 0);
    c->client->conns--;
    addr_unref(b, c->client);
    books_unlock(b);
    c->client = NULL;
}

/* Lock held. Move q's reservation by delta (positive: take; negative: give back). */
static void books_move(net_server_shared_t *b, req_impl_t *q, int64_t delta)
{
    atomic_store_explicit(&b->body_bytes,
                          atomic_load_explicit(&b->body_bytes, memory_order_relaxed) +
                              (uint64_t)delta,
                          memory_order_relaxed);
    q->body_reserved += (uint64_t)delta;
    budget_addr_t *a = q->addr;
    if (a) {
        bool was = a->held > 0;
        a->held += (uint64_t)delta;
        if (!was && a->held > 0)
            b->naddrs++;
        else if (was && a->held == 0)
            b->naddrs--;
    }
}

/* Lock held: room came free; tell the servers whose bodies wait for it. */
static void books_freed(net_server_shared_t *b)
{
    if (b->nwaiting == 0)
        return;
    for (net_server_t *s = b->servers; s; s = s->grp_next)
        if (s->nwait)
            uv_async_send(&s->wake);
}

/* Lock held. Take q off the shed candidates (its body is read, or it is going away). */
static void hold_unlist(net_server_shared_t *b, req_impl_t *q)
{
    budget_hold_t *h = &q->hold;
    if (!h->listed)
        return;
    DP_LIST_UNLINK(b->holds, h, next, prev);
    h->listed = false;
    if (h->shed) {
        assert(b->shedding >= h->shed_bytes);
        b->shedding -= h->shed_bytes;
        h->shed = SHED_NONE;
    }
}

/* A buffered body starts: books for its address, a place among the shed candidates. */
static void budget_begin(net_conn_t *c)
{
    net_server_t *s = c->srv;
    net_server_shared_t *b = s->shared;
    req_impl_t *q = c->req;
    books_lock(b);
    q->addr = addr_ref(b, c->addr_key);
    budget_hold_t *h = &q->hold;
    h->srv = s;
    h->conn = c;
    h->start_ns = q->r.start_ns;
    atomic_store_explicit(&h->received, 0, memory_order_relaxed);
    atomic_store_explicit(&h->last_ns, q->r.start_ns, memory_order_relaxed);
    DP_LIST_PUSH(b->holds, h, next, prev);
    h->listed = true;
    books_unlock(b);
}

/* The body has been read: no longer a candidate; its reservation stays until the response. */
static void budget_body_done(net_server_t *s, req_impl_t *q)
{
    if (!q->hold.listed)
        return;
    books_lock(s->shared);
    hold_unlist(s->shared, q);
    books_unlock(s->shared);
}

/* Give back all q holds, and its place in the books. */
static void budget_release(net_server_t *s, req_impl_t *q)
{
    if (q->body_reserved == 0 && q->addr == NULL && !q->hold.listed)
        return;
    net_server_shared_t *b = s->shared;
    books_lock(b);
    hold_unlist(b, q);
    bool freed = q->body_reserved > 0;
    books_move(b, q, -(int64_t)q->body_reserved);
    if (q->addr)
        addr_unref(b, q->addr);
    q->addr = NULL;
    if (freed)
        books_freed(b);
    books_unlock(b);
}

static uint64_t rate_of(uint64_t bytes, uint64_t start_ns, uint64_t now_ns)
{
    uint64_t ns = now_ns > start_ns ? now_ns - start_ns : 0;
    if (ns < 100000)
        ns = 100000; /* a body read within 0.1 ms of its head counts as read in 0.1 ms */
    return (uint64_t)((double)bytes * 1e9 / (double)ns);
}

/* How fast a body being read arrives, for shedding: bytes per second since its request began,
 * and 0 once it has sent nothing for BUDGET_STALL_NS (a small body cannot show a high rate in
 * its one read; a stalled one, however fast it began, is the slowest there is). */
static uint64_t hold_rate(budget_hold_t *h, uint64_t now_ns)
{
    uint64_t last = atomic_load_explicit(&h->last_ns, memory_order_relaxed);
    if (now_ns > last && now_ns - last >= BUDGET_STALL_NS)
        return 0;
    return rate_of(atomic_load_explicit(&h->received, memory_order_relaxed), h->start_ns, now_ns);
}

/* May h be shed for q, which wants `more` (its address over the share: q_over) at `rate`? Sets
 * *over (h's address is over the share, counting q's `more` when it is q's too) and *hr. */
static bool shed_eligible(budget_hold_t *h, const req_impl_t *q, uint64_t more, uint64_t share,
                          bool q_over, uint64_t rate, uint64_t now_ns, bool *over, uint64_t *hr)
{
    const req_impl_t *v = dp_container_of(h, req_impl_t, hold);
    if (v == q || h->shed || v->body_reserved == 0)
        return false;
    *over = v->addr->held + (v->addr == q->addr ? more : 0) > share;
    *hr = hold_rate(h, now_ns);
    /* Fairness: an over-share address yields to one within its share, at any speed. Speed:
     * a slower body yields to a faster one, unless only q's address is over its share. */
    return (*over && !q_over) || ((*over || !q_over) && *hr < rate);
}

/* Lock held. The budget is `deficit` bytes short for q, which wants `more` with `rate`: mark
 * bodies to shed (the order in the section comment). true when what is marked, with what was
 * marked before, covers it (q waits); false when nothing may be shed for it (nothing marked). */
static bool budget_make_room(net_server_t *s, req_impl_t *q, uint64_t more, uint64_t deficit,
                             uint64_t rate, uint64_t now_ns)
{
    net_server_shared_t *b = s->shared;
    if (b->shedding >= deficit)
        return true; /* bodies being shed already free enough */
    deficit -= b->shedding;
    size_t naddrs = b->naddrs + (q->addr->held == 0 ? 1 : 0);
    uint64_t share = s->lim.max_inflight_body_bytes / naddrs;
    bool q_over = q->addr->held + more > share;
    /* Two passes: the sum of what may be shed, then the victims one by one (O(k x bodies
     * being read); it runs only while the budget is full). */
    uint64_t can = 0;
    for (budget_hold_t *h = b->holds; h; h = h->next) {
        bool over;
        uint64_t vr;
        if (shed_eligible(h, q, more, share, q_over, rate, now_ns, &over, &vr))
            can += dp_container_of(h, req_impl_t, hold)->body_reserved;
    }
    if (can < deficit)
        return false;
    while (deficit > 0) {
        budget_hold_t *best = NULL;
        bool best_over = false;
        uint64_t best_rate = 0;
        for (budget_hold_t *h = b->holds; h; h = h->next) {
            bool over;
            uint64_t vr;
            if (!shed_eligible(h, q, more, share, q_over, rate, now_ns, &over, &vr))
                continue;
            if (best == NULL || (over && !best_over) || (over == best_over && vr < best_rate)) {
                best = h;
                best_over = over;
                best_rate = vr;
            }
        }
        assert(best != NULL); /* the first pass summed at least the deficit */
        req_impl_t *v = dp_container_of(best, req_impl_t, hold);
        /* Shed for fairness when q could not have taken it for speed alone. */
        best->shed = best_over && !q_over ? SHED_SHARE : SHED_SLOW;
        best->shed_taken = false;
        best->shed_bytes = v->body_reserved;
        best->shed_rate = best_rate;
        best->shed_addr_held = v->addr->held;
        best->shed_share = share;
        memcpy(best->shed_for, q->r.id, sizeof(best->shed_for));
        b->shedding += v->body_reserved;
        deficit = deficit > v->body_reserved ? deficit - v->body_reserved : 0;
        uv_async_send(&best->srv->wake);
    }
    return true;
}

/* Lock held. Room for `more` is held back for c until it tries again: what the bodies shed for
 * it give back goes to it, not to a body that happens to read first. */
static void budget_promise(net_conn_t *c, uint64_t more)
{
    net_server_shared_t *b = c->srv->shared;
    assert(b->promised >= c->promised);
    b->promised = b->promised - c->promised + more;
    c->promised = more;
}

/* Lock held: c waits for room (its loop's wake, or BUDGET_RETRY_MS, tries again). */
static void budget_wait(net_conn_t *c, uint64_t now, uint64_t more)
{
    net_server_t *s = c->srv;
    if (c->wait_since == 0)
        c->wait_since = now;
    budget_promise(c, more);
    if (c->budget_wait)
        return;
    c->budget_wait = true;
    DP_LIST_PUSH(s->bw_head, c, bw_next, bw_prev);
    s->nwait++;
    s->shared->nwaiting++;
}

/* c no longer waits: it tries again (keeping its promise, until budget_grow settles it) or,
 * with `forget`, goes away. */
static void budget_unwait_opt(net_conn_t *c, bool forget)
{
    if (!c->budget_wait && !(forget && c->promised))
        return;
    net_server_t *s = c->srv;
    books_lock(s->shared);
    if (forget)
        budget_promise(c, 0);
    if (!c->budget_wait) {
        books_unlock(s->shared);
        return;
    }
    c->budget_wait = false;
    DP_LIST_UNLINK(s->bw_head, c, bw_next, bw_prev);
    assert(s->nwait > 0 && s->shared->nwaiting > 0);
    s->nwait--;
    s->shared->nwaiting--;
    books_unlock(s->shared);
}

static void budget_unwait(net_conn_t *c)
{
    budget_unwait_opt(c, true);
}

enum { BUDGET_OK = 0, BUDGET_WAIT = 1, BUDGET_REFUSED = -1 };

/* Room for `extra` more bytes of c's buffered body (a read's worth, not yet parsed): BUDGET_OK
 * (reserved), BUDGET_WAIT (bodies are being shed for it: keep the bytes, stop reading, try
 * again when woken) or BUDGET_REFUSED (answer 503). */
static int budget_grow(net_conn_t *c, uint64_t extra)
{
    net_server_t *s = c->srv;
    net_server_shared_t *b = s->shared;
    req_impl_t *q = c->req;
    uint64_t max = s->lim.max_inflight_body_bytes;
    uint64_t limit =
        q->r.content_length > 0 ? (uint64_t)q->r.content_length : s->lim.max_body_bytes;
    uint64_t need = q->r.body.len + extra;
    if (need > limit)
        need = limit; /* past it the body is refused 413 (on_body) before it is held */
    if (need <= q->body_reserved) {
        c->wait_since = 0;
        if (c->promised) {
            books_lock(b);
            budget_promise(c, 0);
            books_unlock(b);
        }
        return BUDGET_OK;
    }
    uint64_t ahead = (need + BUDGET_STEP - 1) / BUDGET_STEP * BUDGET_STEP;
    if (ahead > limit)
        ahead = limit;
    uint64_t now = uv_now(s->loop);
    int rc = BUDGET_OK;
    books_lock(b);
    /* What others wait for is not free, however it came free. */
    uint64_t cur =
        atomic_load_explicit(&b->body_bytes, memory_order_relaxed) + (b->promised - c->promised);
    if (max == 0 || cur + (ahead - q->body_reserved) <= max) {
        books_move(b, q, (int64_t)(ahead - q->body_reserved));
    } else if (cur + (need - q->body_reserved) <= max) {
        books_move(b, q, (int64_t)(need - q->body_reserved)); /* no step ahead while full */
    } else if (c->wait_since && now - c->wait_since >= BUDGET_WAIT_MS) {
        rc = BUDGET_REFUSED;
    } else {
        uint64_t more = need - q->body_reserved;
        uint64_t rate = rate_of(need, q->r.start_ns, dp_now_ns());
        if (budget_make_room(s, q, more, cur + more - max, rate, dp_now_ns())) {
            budget_wait(c, now, more);
            rc = BUDGET_WAIT;
        } else {
            rc = BUDGET_REFUSED;
        }
    }
    if (rc != BUDGET_WAIT)
        budget_promise(c, 0);
    books_unlock(b);
    if (rc == BUDGET_OK)
        c->wait_since = 0;
    return rc;
}

static void conn_overloaded(net_conn_t *c)
{
    if (c->srv->on_overload)
        c->srv->on_overload("body_budget");
    conn_reject(c, 503, "too many request bodies buffered (limits.max_inflight_body_bytes)");
}

/* Close c, marked to be shed by budget_make_room (on whichever thread): log why, count it. */
static void conn_shed(net_conn_t *c, const budget_hold_t *h)
{
    net_server_t *s = c->srv;
    req_impl_t *q = c->req;
    uint64_t received = atomic_load_explicit(&q->hold.received, memory_order_relaxed);
    bool share = h->shed == SHED_SHARE;
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "body_shed");
    if (w) {
        dp_jw_str(w, "request_id", q->r.id);
        dp_jw_str(w, "remote", c->remote);
        dp_jw_str(w, "reason", share ? "address_over_share" : "slowest");
        dp_jw_int(w, "status", share ? 503 : 408);
        dp_jw_uint(w, "received_bytes", received);
        dp_jw_int(w, "content_length", q->r.content_length);
        dp_jw_uint(w, "elapsed_ms", (dp_now_ns() - q->r.start_ns) / 1000000);
        dp_jw_uint(w, "bytes_per_second", h->shed_rate);
        dp_jw_uint(w, "address_bytes", h->shed_addr_held);
        dp_jw_uint(w, "address_share", h->shed_share);
        dp_jw_uint(w, "max_inflight_body_bytes", s->lim.max_inflight_body_bytes);
        dp_jw_str(w, "for_request_id", h->shed_for);
        dp_log_end(w);
    }
    if (s->on_overload)
        s->on_overload("body_shed");
    if (share)
        conn_reject(c, 503,
                    "this client address holds more than its share of the request body budget "
                    "(limits.max_inflight_body_bytes) while others wait");
    else
        conn_reject(c, 408,
                    "request body too slow while the request body budget is full "
                    "(limits.max_inflight_body_bytes)");
}

/* From any thread's uv_async_send: shed this server's marked bodies, then let its waiting
 * bodies try again. */
static void wake_cb(uv_async_t *a)
{
    net_server_t *s = a->data;
    net_server_shared_t *b = s->shared;
    for (;;) {
        budget_hold_t info, *found = NULL;
        books_lock(b);
        for (budget_hold_t *h = b->holds; h; h = h->next)
            if (h->srv == s && h->shed && !h->shed_taken) {
                h->shed_taken = true;
                found = h;
                memcpy(&info, h, sizeof(info)); /* fields are read after the lock */
                break;
            }
        books_unlock(b);
        if (found == NULL)
            break;
        /* Only this loop unlists its own holds, and a listed one's connection is reading
         * its body (conn_close, conn_msg_done and the release unlist it). */
        assert(info.conn->phase == PH_BODY && &info.conn->req->hold == found);
        conn_shed(info.conn, &info);
    }
    while (s->bw_head) {
        net_conn_t *c = s->bw_head;
        budget_unwait_opt(c, false);
        conn_kick(c); /* parses what it kept, from the loop */
    }
}

/* Join the group whose books count this server's bodies. */
static void budget_join(net_server_t *s, net_server_shared_t *b)
{
    books_lock(b);
    s->shared = b;
    s->grp_next = b->servers;
    b->servers = s;
    books_unlock(b);
}

static void budget_leave(net_server_t *s)
{
    net_server_shared_t *b = s->shared;
    books_lock(b);
    assert(s->nwait == 0);
    net_server_t **pp = &b->servers;
    while (*pp && *pp != s)
        pp = &(*pp)->grp_next;
    if (*pp)
        *pp = s->grp_next;
    s->grp_next = NULL;
    books_unlock(b);
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

/* Reserve all of q's body (its Content-Length, cl) in the budget now if the budget stays at
 * most half used with it, and its client address within half its fair share: true when
 * reserved. A budget under pressure goes by what has arrived, as for every other body, so that
 * bodies are shed for speed and fairness as they would be without this: whole reservations
 * fill it ahead of the bytes, and honest uploaders at the same pace would shed each other
 * sooner; and one address's many connections cannot hold more than its share ahead. */
static bool budget_take_whole(net_conn_t *c, uint64_t cl)
{
    net_server_t *s = c->srv;
    net_server_shared_t *b = s->shared;
    req_impl_t *q = c->req;
    assert(c->phase == PH_BODY && q->mode == NET_BODY_BUFFER && !q->r.chunked);
    if (q->addr == NULL || c->budget_wait || c->promised)
        return false; /* not on the books, or waiting for room already */
    if (cl <= q->body_reserved)
        return true;
    uint64_t max = s->lim.max_inflight_body_bytes, more = cl - q->body_reserved;
    books_lock(b);
    uint64_t cur = atomic_load_explicit(&b->body_bytes, memory_order_relaxed) + b->promised;
    uint64_t naddrs = b->naddrs + (q->addr->held == 0); /* this one's counted too */
    bool ok = max == 0 || (cur + more <= max / 2 && q->addr->held + more <= max / 2 / naddrs);
    if (ok)
        books_move(b, q, (int64_t)more);
    books_unlock(b);
    return ok;
}

/* Size the buffered body of c's request for all its Content-Length at once, with `arrived`
 * bytes of it come (or about to be appended), when that is allowed:
 * - once a quarter has come: a client that declares a length and stops makes us hold or map
 *   at most 4x the bytes it sent of it, which the budget bounds;
 * - at once when the connection's last body, which came whole, was at least half as long,
 *   and the budget stays at most half used with all of it: all of it is reserved then, so
 *   such a body is held within the budget (what the client sent before is neither held nor
 *   counted any more, and cannot stand for it). */
static void body_presize(net_conn_t *c, size_t arrived)
{
    req_impl_t *q = c->req;
    dp_buf_t *body = &q->r.body;
    int64_t cl = q->r.content_length;
    if (cl <= 0 || cl > BODY_PRESIZE_MAX || (uint64_t)cl < arrived || body->len > (size_t)cl)
        return;
    bool quarter = (uint64_t)arrived * 4 >= (uint64_t)cl;
    if (!quarter) {
        if (q->whole_tried || (uint64_t)cl > 2 * (uint64_t)q->prev_body)
            return;
        q->whole_tried = true;
        if (!budget_take_whole(c, (uint64_t)cl))
            return;
    }
    dp_buf_reserve_exact(body, (size_t)cl - body->len);
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
        /* conn_feed reserved room for every byte of this read before llhttp saw it. */
        if (q->r.body.len + n > q->body_reserved) {
            q->body_over_budget = true;
            return HPE_USER;
        }
        dp_buf_t *body = &q->r.body;
        if (at == body->base + body->len) {
            /* Read straight into the body (sock_read_target): already in place. */
            body->len += n;
            body->base[body->len] = '\0';
        } else {
            if (body->len + n + 1 > body->cap)
                body_presize(c, body->len + n);
            dp_buf_append(body, at, n);
        }
        atomic_store_explicit(&q->hold.received, q->r.body.len, memory_order_relaxed);
        atomic_store_explicit(&q->hold.last_ns, dp_now_ns(), memory_order_relaxed);
    } else if (q->mode == NET_BODY_STREAM && c->srv->h.on_body) {
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

/* The connection's one timer, for `ms` from now. A timer already due no later than that is
 * left alone: when it fires before the deadline, timer_cb sets it again for the rest, so a
 * deadline moved later (the idle timeout after each response) costs no timer-heap removal and
 * insertion. Every start of c->timer goes through here or conn_kick, which keep timer_due
 * true: a start elsewhere would let this keep the wrong timer. */
static void conn_arm(net_conn_t *c, uint64_t ms)
{
    c->kick = false;
    c->deadline = uv_now(c->srv->loop) + ms;
    if (uv_is_active((uv_handle_t *)&c->timer) && c->timer_due <= c->deadline)
        return;
    c->timer_due = c->deadline;
    uv_timer_start(&c->timer, timer_cb, ms, 0);
}

static void kick_cb(uv_idle_t *h);

static void kick_remove(net_conn_t *c)
{
    net_server_t *s = c->srv;
    if (!c->kick_queued)
        return;
    assert(s->nkicks > 0);
    c->kick_queued = false;
    DP_TLIST_UNLINK(s->kq_head, s->kq_tail, c, kq_next, kq_prev);
    if (--s->nkicks == 0)
        uv_idle_stop(&s->kicker);
}

/* Parse pipelined bytes left behind by the previous response, or bytes held back, from the
 * loop at its next turn, after the loop has polled: one turn per kicked connection per
 * iteration, so new connections and other clients' bytes are served between them. (A
 * zero-delay timer would not do: libuv before 1.48, Debian 12's 1.44 among them, runs one
 * started from a timer callback in the same pass, and connections that kick again would hold
 * the loop.) The kick stands in for the connection's timer until it runs, and
 * conn_arm cancels it. */
static void conn_kick(net_conn_t *c)
{
    net_server_t *s = c->srv;
    c->kick = true;
    uv_timer_stop(&c->timer);
    if (c->kick_queued)
        return;
    c->kick_queued = true;
    DP_TLIST_APPEND(s->kq_head, s->kq_tail, c, kq_next, kq_prev);
    if (s->nkicks++ == 0)
        uv_idle_start(&s->kicker, kick_cb);
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

/* Milliseconds until `wait` has passed since the client last took bytes queued for it
 * (net_sock_last_progress); 0 once it has. */
static uint64_t send_wait_left(net_conn_t *c, uint64_t now, uint64_t wait)
{
    uint64_t since = now - net_sock_last_progress(&c->sock);
    return since < wait ? wait - since : 0;
}

/* A client that took none of the bytes queued for it for client_idle_timeout_ms: the line says
 * which request's answer, or what it was waiting for when no request is left. */
static void log_send_timeout(const char *request_id, const char *during)
{
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "client_send_timeout");
    if (w) {
        if (request_id)
            dp_jw_str(w, "request_id", request_id);
        if (during)
            dp_jw_str(w, "during", during);
        dp_log_end(w);
    }
}

/* A kicked connection's turn: what waits in `pending` is parsed, then reading goes on. */
static void kick_run(net_conn_t *c)
{
    c->kick = false;
    c->burst = 0;
    bool body = c->phase == PH_BODY;
    if ((c->phase == PH_IDLE || (body && !c->body_paused && !c->budget_wait)) && pend_len(c)) {
        c->read_paused = false;
        pend_feed(c);
    }
    if (c->phase == PH_BODY && c->budget_wait)
        return; /* waits again: reads stay stopped, the retry timer is armed */
    if (c->phase == PH_BODY) {
        c->last_read = uv_now(c->srv->loop);
        conn_arm(c, body_wait(c, c->last_read, c->srv->lim.client_idle_timeout_ms));
    }
    /* Reading goes on in PH_WAIT too: a request the turn sent on is watched for its client
     * leaving (and pipelined bytes after it are kept, within PENDING_LIMIT). */
    if (c->phase != PH_CLOSED && !c->read_paused && !c->body_paused && !c->wait_drain)
        net_sock_read_start(&c->sock);
}

/* The connections kicked before this turn, oldest first; one kicked again while they run
 * (more pipelined requests than PIPELINE_BURST) waits for the next turn. */
static void kick_cb(uv_idle_t *h)
{
    net_server_t *s = h->data;
    for (size_t n = s->nkicks; n > 0 && s->kq_head; n--) {
        net_conn_t *c = s->kq_head;
        kick_remove(c);
        if (c->kick && c->phase != PH_CLOSED)
            kick_run(c);
    }
}

static void timer_cb(uv_timer_t *t)
{
    net_conn_t *c = t->data;
    uint64_t now = uv_now(c->srv->loop);
    assert(!c->kick);        /* conn_kick stops the timer, conn_arm cancels the kick */
    if (now < c->deadline) { /* set early, the deadline moved on since (conn_arm) */
        conn_arm(c, c->deadline - now);
        return;
    }
    switch (c->phase) {
    case PH_IDLE: {
        /* Waiting for a slow reader to take its responses: cut it off only once nothing was
         * written for the idle timeout, as in PH_WAIT. */
        uint64_t left =
            c->wait_drain ? send_wait_left(c, now, c->srv->lim.client_idle_timeout_ms) : 0;
        if (left) {
            conn_arm(c, left);
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
        if (c->budget_wait) {
            /* Waiting for room, not for the client: try again (budget_grow bounds the wait). */
            budget_unwait_opt(c, false);
            conn_kick(c);
            return;
        }
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
        if (c->sock.queued > 0 && send_wait_left(c, now, idle) == 0) {
            log_send_timeout(c->req ? c->req->r.id : "", NULL);
            conn_close(c);
            return;
        }
        conn_arm(c, idle);
        return;
    }
    case PH_LINGER: {
        /* The answer's last bytes are still leaving: the client has the idle timeout to take
         * them, as in PH_WAIT. Once they are out, LINGER_MS more for it to read them and
         * send what it still has, then close. */
        bool sending = c->sock.queued > 0;
        uint64_t left =
            send_wait_left(c, now, sending ? c->srv->lim.client_idle_timeout_ms : LINGER_MS);
        if (left) {
            conn_arm(c, left < LINGER_MS ? left : LINGER_MS);
            return;
        }
        if (sending)
            log_send_timeout(NULL, "the end of an answer");
        conn_close(c);
        return;
    }
    default:
        return;
    }
}

/* ---- connection lifecycle ------------------------------------------------------------------ */

/* The connection ends after its last answer: the rest of that answer is written, then a FIN
 * (after TLS close_notify unless the answer was cut), and what the client still sends is read
 * and dropped (closing on unread input would reset the connection, and the client could lose
 * the answer's end) until timer_cb closes it. */
static void conn_linger(net_conn_t *c, bool cut)
{
    c->phase = PH_LINGER;
    pend_free(c);
    net_sock_shutdown(&c->sock, !cut);
    net_sock_read_start(&c->sock);
    conn_arm(c, LINGER_MS);
}

static void conn_abort_req(net_conn_t *c);

/* Last handle closed: only now does the handler hear about a request it still owned, so
 * on_abort never runs inside one of its own net_resp_* calls. */
static void conn_handle_closed(net_conn_t *c)
{
    assert(c->closes_pending > 0);
    if (--c->closes_pending > 0)
        return;
    net_server_t *s = c->srv;
    /* Both handles closed, which only conn_close starts, and off the handshake list
     * (conn_close takes it off). */
    assert(c->phase == PH_CLOSED);
    assert(!c->handshaking && c->hs_prev == NULL && c->hs_next == NULL);
    conn_abort_req(c);
    assert(c->req == NULL);
    assert(c->prev != NULL || s->conns == c);
    assert(s->nconns > 0);
    DP_LIST_UNLINK(s->conns, c, next, prev);
    s->nconns--;
    if (c->counted)
        atomic_fetch_sub(&s->shared->conns, 1);
    conn_client_give(c);
    pend_free(c);
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
    DP_TLIST_UNLINK(s->hs_head, s->hs_tail, c, hs_next, hs_prev);
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
    DP_TLIST_APPEND(s->hs_head, s->hs_tail, c, hs_next, hs_prev);
    s->nhandshakes++;
    c->sock.on_handshake = hs_done;
}

static void conn_close(net_conn_t *c)
{
    if (c->phase == PH_CLOSED)
        return;
    hs_remove(c);
    kick_remove(c);
    c->kick = false;
    budget_unwait(c);
    if (c->req)
        budget_body_done(c->srv, c->req); /* no longer one to shed; its share goes on close */
    c->phase = PH_CLOSED;
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, timer_closed);
    net_sock_close(&c->sock);
}

/* A body nobody wants (NET_BODY_DISCARD) whose framing breaks, or whose client stalls, while
 * its request's answer is still to come (a refusal waiting for its audit line) does not change
 * that answer: it is the request's, and may already be on record. Reading stops, the answer
 * goes out when the handler gives it, and the connection closes after it, as after any answer
 * given before the body ended. True when c's request is such. */
static bool discard_broken(net_conn_t *c, int status, const char *reason)
{
    req_impl_t *q = c->req;
    if (c->phase != PH_BODY || q == NULL || q->mode != NET_BODY_DISCARD || q->resp_started)
        return false;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "request_body_dropped");
    if (w) {
        dp_jw_str(w, "request_id", q->r.id);
        dp_jw_int(w, "status", status); /* what a wanted body's breakage would have answered */
        dp_jw_str(w, "reason", reason);
        dp_log_end(w);
    }
    c->keep_alive = false;
    c->phase = PH_WAIT;
    c->read_paused = true;
    net_sock_read_stop(&c->sock);
    pend_free(c);
    conn_arm(c, c->srv->lim.client_idle_timeout_ms);
    return true;
}

/* Answer with an error and close, lingering so the client can read the answer even while
 * it is still sending (closing with unread input would reset the connection); a request whose
 * unwanted body broke keeps the answer it has (discard_broken). */
static void conn_reject(net_conn_t *c, int status, const char *reason)
{
    net_server_t *s = c->srv;
    if (discard_broken(c, status, reason))
        return;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "request_rejected");
    if (w) {
        dp_jw_int(w, "status", status);
        dp_jw_str(w, "reason", reason);
        dp_jw_str(w, "remote", c->remote);
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
    conn_linger(c, false);
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

/* An idle connection ends because the server drains: at once, or, while its last answer is
 * still being written (a slow reader), once that is out (conn_linger), within the drain's
 * deadline. */
static void conn_end_idle(net_conn_t *c)
{
    if (net_sock_sending(&c->sock))
        conn_linger(c, false);
    else
        conn_close(c);
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
    if (s->draining && pend_len(c) == 0) {
        conn_end_idle(c);
        return;
    }
    if (net_sock_over(&c->sock)) {
        conn_wait_drain(c);
        return;
    }
    if (pend_len(c) && !c->in_feed) {
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
        conn_linger(c, false);
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
    memcpy(r->remote, c->remote, sizeof(r->remote));
    s->ninflight++;
    q->handed = true;

    c->phase = r->has_body ? PH_BODY : PH_WAIT;
    q->body_done = !r->has_body;
    c->body_remaining = r->chunked ? 0 : (uint64_t)(r->content_length > 0 ? r->content_length : 0);
    memset(&c->cs, 0, sizeof(c->cs));
    uv_timer_stop(&c->timer);

    /* on_head may answer at once, and the request may be freed with its answer's end (a large
     * head is not cached): q is looked at again only once it is known to be still there. */
    net_body_mode_t mode = s->h.on_head ? s->h.on_head(r) : NET_BODY_BUFFER;
    if (c->req != q || c->phase == PH_CLOSED || c->phase == PH_LINGER)
        return false; /* answered and closed inside on_head */
    q->mode = mode;
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
            /* Nothing is reserved for what the head declares: room is taken as bytes come
             * (conn_feed), so a connection that declares 8 MiB and stalls holds none. */
            budget_begin(c);
            c->body_deadline =
                s->lim.client_body_timeout_ms ? uv_now(s->loop) + s->lim.client_body_timeout_ms : 0;
        }
        if (q->framing.expect_continue && r->http_minor == 1 && q->mode != NET_BODY_DISCARD)
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
    c->last_body = q->mode == NET_BODY_BUFFER && !q->r.chunked && q->r.content_length > 0 &&
                           q->r.content_length <= BODY_PRESIZE_MAX
                       ? (uint32_t)q->r.content_length
                       : 0;
    budget_body_done(c->srv, q);
    c->phase = PH_WAIT;
    /* While the response is produced, watch for a client that stops reading it. */
    conn_arm(c, c->srv->lim.client_idle_timeout_ms);
    if (c->srv->h.on_complete && q->mode != NET_BODY_DISCARD)
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
            pend_keep(c, p, n);
            n = 0;
            if (pend_len(c) > PENDING_LIMIT) {
                c->read_paused = true;
                net_sock_read_stop(&c->sock);
            }
            continue;
        case PH_IDLE:
            if (s->draining) {
                conn_end_idle(c); /* the request is not read; an earlier answer still goes */
                goto out;
            }
            if (c->wait_drain || net_sock_over(&c->sock)) {
                /* Answers to earlier requests are still queued: keep the rest for later. */
                pend_keep(c, p, n);
                n = 0;
                if (!c->wait_drain)
                    conn_wait_drain(c);
                continue;
            }
            if (c->burst >= PIPELINE_BURST) {
                /* This turn's share is used: the rest waits for the next (conn_kick below). */
                pend_keep(c, p, n);
                n = 0;
                c->read_paused = true;
                net_sock_read_stop(&c->sock);
                continue;
            }
            c->burst++;
            assert(c->req == NULL);
            c->req = req_get(c);
            c->phase = PH_HEAD;
            c->head_len = 0;
            /* What the last request left is this one's to use, once (a request answered from
             * its head, or with no body, leaves nothing); its first read was the head-first
             * one, if any. */
            c->req->prev_body = c->last_body;
            c->last_body = 0;
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
            c->head_len += (uint32_t)used; /* within max_header_bytes */
            if (r != NET_SCAN_DONE)
                continue;
            c->last_head = c->head_len;
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
            if (c->body_paused || c->budget_wait) {
                /* Paused from on_head (the request waits for a replica slot): body bytes that
                 * came in the head's read wait too. Handing them to on_body would give them
                 * to a handler that has nowhere to put them yet. */
                pend_keep(c, p, n);
                n = 0;
                net_sock_read_stop(&c->sock);
                continue;
            }
            if (q->mode == NET_BODY_BUFFER && !q->resp_ended) {
                /* Room for this read before llhttp copies it: a chunked read's framing
                 * counts too (the decoded bytes are fewer), bounded by max_body_bytes. */
                int br = budget_grow(
                    c, q->r.chunked || n < c->body_remaining ? n : (size_t)c->body_remaining);
                if (br == BUDGET_WAIT) {
                    pend_keep(c, p, n);
                    n = 0;
                    net_sock_read_stop(&c->sock);
                    conn_arm(c, BUDGET_RETRY_MS);
                    continue;
                }
                if (br == BUDGET_REFUSED) {
                    conn_overloaded(c);
                    goto out;
                }
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
                pend_keep(c, p, n);
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
    if (c->phase == PH_IDLE && pend_len(c) && !c->wait_drain)
        conn_kick(c);
}

/* A body with a Content-Length, buffered whole, read once its buffer has room (body_presize):
 * the rest is read from the socket straight into it, not into the loop's read buffer and
 * copied. Only what the body still lacks, so the next request's bytes never land in it; and
 * never while earlier bytes wait in `pending` (they come first). */
#define READ_INTO_MIN (16 * 1024)
/* The most one such read asks for: a long prompt that has arrived is taken in one or two reads
 * (each read costs a system call on top of the copy), while one sender holds the loop for at
 * most ~25 us of copying per read (the body's own scan then takes longer). */
#define READ_INTO_MAX (256 * 1024)

static char *sock_read_target(net_sock_t *sk, size_t *len)
{
    net_conn_t *c = sk->owner;
    req_impl_t *q = c->req;
    if (c->phase == PH_IDLE && c->last_body >= HEAD_FIRST_MIN && c->last_head && !pend_len(c) &&
        !c->in_feed && !c->wait_drain) {
        c->head_capped = true; /* counted once bytes come (libuv may ask, and find none) */
        *len = c->last_head + HEAD_FIRST_SLACK;
        return NULL;
    }
    if (c->phase != PH_BODY || q == NULL || q->mode != NET_BODY_BUFFER || q->resp_ended ||
        q->r.chunked || c->body_paused || c->budget_wait || pend_len(c) || c->in_feed)
        return NULL;
    dp_buf_t *b = &q->r.body;
    if (b->cap < (size_t)q->r.content_length + 1)
        body_presize(c, b->len);
    size_t room = b->cap > b->len ? b->cap - b->len - 1 : 0; /* the NUL keeps its byte */
    size_t want = c->body_remaining < room ? (size_t)c->body_remaining : room;
    if (want == 0 || (want < READ_INTO_MIN && want < c->body_remaining))
        return NULL;
    if (want > READ_INTO_MAX)
        want = READ_INTO_MAX;
    *len = want;
    return b->base + b->len;
}

static void sock_read(net_sock_t *sk, const char *p, size_t n)
{
    net_conn_t *c = sk->owner;
    c->burst = 0;
    if (c->head_capped) {
        c->head_capped = false;
        c->srv->head_reads++;
    }
    if (c->phase == PH_BODY && (c->body_paused || c->budget_wait)) {
        pend_add(c, p, n);
        net_sock_read_stop(sk);
        return;
    }
    if (pend_len(c) && c->phase != PH_WAIT && c->phase != PH_LINGER) {
        /* Keep byte order: older unparsed bytes go first. */
        pend_add(c, p, n);
        pend_feed(c);
        return;
    }
    conn_feed(c, p, n);
}

static void sock_error(net_sock_t *sk, int status)
{
    net_conn_t *c = sk->owner;
    if (c->phase == PH_LINGER && status == UV_EOF && c->sock.queued > 0)
        return; /* done sending, not reading: the answer's rest still goes, timer_cb closes */
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
 * an operator would never hear that connections are being shed. One open + close per
 * accepted connection: noise next to the accept itself. */
static int fd_headroom_error(void)
{
    /* A new descriptor, not a copy of the listener's: libuv closes sockets with a raw close
     * system call, which ThreadSanitizer does not see, so a copy taking a number a worker's
     * connection had just freed would be reported as a race with that worker's reads. */
    int probe = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (probe >= 0) {
        close(probe);
        return 0;
    }
    return errno == EMFILE || errno == ENFILE ? uv_translate_sys_error(errno) : 0;
}

/* Close a connection refused at accept, giving its place of max_connections back at once: its
 * close completes a loop turn later, after the rest of the accept burst it came in, and a
 * burst refused for one address must not refuse other clients meanwhile. */
static void conn_refuse(net_conn_t *c)
{
    if (c->counted)
        atomic_fetch_sub(&c->srv->shared->conns, 1);
    c->counted = false;
    conn_close(c);
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
    DP_LIST_PUSH(s->conns, c, next, prev);
    s->nconns++;
    atomic_fetch_add(&s->shared->conns, 1);
    c->counted = true;
    c->sock.on_read = sock_read;
    c->sock.read_target = sock_read_target;
    c->sock.on_error = sock_error;
    c->sock.on_drain = sock_drain;
    c->sock.on_close = sock_closed;
    c->sock.high_water = s->lim.write_high_water;
    c->sock.low_water = s->lim.write_high_water / 4;
    llhttp_init(&c->parser, HTTP_REQUEST, &s->settings);
    c->parser.data = c;
    c->first_request = true;
    if (uv_accept(ls, (uv_stream_t *)&c->sock.tcp) != 0) {
        conn_refuse(c);
        return;
    }
    int nofd = fd_headroom_error();
    if (nofd != 0) {
        /* This connection took the last descriptor: libuv sheds the next ones silently, and
         * requests already in flight could not open an upstream connection. Give it back and
         * say why. */
        warn_accept_failed(s, nofd, "out of file descriptors: new connections are closed at once");
        conn_refuse(c);
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
        conn_refuse(c);
        return;
    }
    if (!conn_client_take(c)) {
        uint64_t now = uv_now(s->loop);
        if (now - s->last_client_warn >= 1000) {
            s->last_client_warn = now;
            dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "client_connection_limit");
            if (w) {
                dp_jw_str(w, "remote", c->remote);
                dp_jw_uint(w, "max_connections_per_client", s->lim.max_connections_per_client);
                dp_log_end(w);
            }
        }
        conn_refuse(c);
        return;
    }
    uv_tcp_nodelay(&c->sock.tcp, 1);
    if (s->tls) {
        net_tls_t *t = net_tls_new_server(s->tls);
        if (t == NULL) {
            conn_refuse(c);
            return;
        }
        net_sock_use_tls(&c->sock, t);
        hs_add(c);
    }
    s->accepted++;
    conn_to_idle(c);
}

/* ---- server ---------------------------------------------------------------------------------- */

static pthread_once_t g_malloc_once = PTHREAD_ONCE_INIT;

/* Buffered bodies of hundreds of KiB come and go at the rate clients send them. glibc's sliding
 * mmap threshold (raised to the size of each large block freed) would put them on the heap,
 * where what is freed stays resident: under churn from slow clients the process held twice
 * max_inflight_body_bytes. A fixed threshold keeps large bodies in mappings of their own, given
 * back to the kernel when freed, so resident memory follows the budget. */
static void malloc_tune(void)
{
#if defined(__GLIBC__)
    mallopt(M_MMAP_THRESHOLD, 128 * 1024);
#endif
}

net_server_t *net_server_new(uv_loop_t *loop, const net_handler_t *h, void *data,
                             const net_server_limits_t *limits)
{
    pthread_once(&g_malloc_once, malloc_tune);
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
    budget_join(s, &s->own);
    uv_check_init(loop, &s->check);
    s->check.data = s;
    s->check_open = true;
    uv_idle_init(loop, &s->kicker);
    s->kicker.data = s;
    s->kicker_open = true;
    uv_async_init(loop, &s->wake, wake_cb);
    s->wake.data = s;
    s->wake_open = true;
    uv_unref((uv_handle_t *)&s->wake); /* an idle server does not keep its loop running */
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

uint64_t net_server_head_reads(const net_server_t *s)
{
    return s->head_reads;
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

static void kicker_closed(uv_handle_t *h)
{
    net_server_t *s = h->data;
    s->kicker_open = false;
    maybe_server_done(s);
}

static void wake_closed(uv_handle_t *h)
{
    net_server_t *s = h->data;
    s->wake_open = false;
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
    if (s->closing && (s->check_open || s->kicker_open || s->wake_open)) {
        if (s->check_open && !uv_is_closing((uv_handle_t *)&s->check))
            uv_close((uv_handle_t *)&s->check, check_closed);
        if (s->kicker_open && !uv_is_closing((uv_handle_t *)&s->kicker))
            uv_close((uv_handle_t *)&s->kicker, kicker_closed);
        if (s->wake_open && !uv_is_closing((uv_handle_t *)&s->wake)) {
            budget_leave(s); /* no thread sends to `wake` once it is off the group */
            uv_close((uv_handle_t *)&s->wake, wake_closed);
        }
        return;
    }
    if (s->closing) {
        void (*cb)(void *) = s->close_cb;
        void *d = s->close_data;
        /* Every connection has gone through conn_handle_closed: nothing refers to s now. */
        assert(s->conns == NULL && s->corked == NULL && s->ninflight == 0);
        assert(s->kq_head == NULL && s->nkicks == 0);
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
        if (c->phase == PH_IDLE && pend_len(c) == 0)
            conn_end_idle(c);
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

int net_req_query(const net_req_t *req, const char *name, dp_buf_t *out)
{
    dp_iovec_t q = req->query;
    size_t nl = strlen(name);
    size_t i = 0;
    dp_buf_reset(out);
    while (i < q.len) {
        size_t end = i;
        while (end < q.len && q.base[end] != '&')
            end++;
        if (end - i == nl && memcmp(q.base + i, name, nl) == 0) {
            dp_buf_reserve(out, 1); /* "?pool": present and empty, as URLSearchParams has it */
            out->base[0] = '\0';
            return 1;
        }
        if (end - i > nl && memcmp(q.base + i, name, nl) == 0 && q.base[i + nl] == '=') {
            dp_buf_reserve(out, end - i);
            for (size_t k = i + nl + 1; k < end; k++) {
                char ch = q.base[k];
                if (ch == '%') {
                    if (end - k < 3)
                        return -1;
                    int h = dp_hexval((unsigned char)q.base[k + 1]),
                        l = dp_hexval((unsigned char)q.base[k + 2]);
                    if (h < 0 || l < 0)
                        return -1;
                    ch = (char)(h << 4 | l);
                    if (ch == '\0')
                        return -1; /* no name or text holds one: it would cut the value short */
                    k += 2;
                } else if (ch == '+') {
                    ch = ' '; /* as a form encodes a space */
                }
                out->base[out->len++] = ch;
            }
            out->base[out->len] = '\0';
            return 1;
        }
        i = end + 1;
    }
    return 0;
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
    if (pend_len(c)) {
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

void net_req_drop_body(net_req_t *req)
{
    req_impl_t *q = impl(req);
    if (!q->body_done)
        return;
    budget_release(req->conn->srv, q);
    dp_buf_release(&q->r.body); /* a large one to the thread's stash, as req_put does */
}

uint64_t net_req_take_body_budget(net_req_t *req)
{
    req_impl_t *q = impl(req);
    net_server_shared_t *b = req->server->shared;
    books_lock(b);
    hold_unlist(b, q);
    uint64_t n = q->body_reserved;
    if (q->addr) {
        /* The bytes stay in the budget; the address no longer answers for them. */
        budget_addr_t *a = q->addr;
        assert(a->held >= n);
        a->held -= n;
        if (n && a->held == 0)
            b->naddrs--;
        addr_unref(b, a);
        q->addr = NULL;
    }
    q->body_reserved = 0;
    books_unlock(b);
    return n;
}

void net_server_shared_return_body_budget(net_server_shared_t *shared, uint64_t bytes)
{
    books_lock(shared);
    uint64_t cur = atomic_load_explicit(&shared->body_bytes, memory_order_relaxed);
    assert(cur >= bytes);
    atomic_store_explicit(&shared->body_bytes, cur - bytes, memory_order_relaxed);
    if (bytes)
        books_freed(shared);
    books_unlock(shared);
}

void net_server_return_body_budget(net_server_t *s, uint64_t bytes)
{
    net_server_shared_return_body_budget(s->shared, bytes);
}

void net_server_share(net_server_t *s, net_server_shared_t *shared)
{
    assert(s->nconns == 0); /* before any connection: the books move with no body in them */
    budget_leave(s);
    budget_join(s, shared);
}

static bool conn_usable(net_req_t *req)
{
    net_conn_t *c = req->conn;
    return c->req == impl(req) && c->phase != PH_CLOSED && c->phase != PH_LINGER;
}

bool net_resp_bodiless(const net_req_t *req, int status)
{
    return req->method == HTTP_HEAD || status == 204 || status == 304 ||
           (status >= 100 && status < 200);
}

int net_resp_start(net_req_t *req, int status, const net_header_t *hdrs, size_t nhdrs,
                   int64_t content_length)
{
    req_impl_t *q = impl(req);
    net_conn_t *c = req->conn;
    if (!conn_usable(req) || q->resp_started)
        return -1;
    q->resp_started = true;
    q->resp_no_body = net_resp_bodiless(req, status);
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
    bool head = q->resp_head_pending;
    if (head) {
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
    /* The socket keeps no pointer into the head. A body of unknown length (an SSE answer) may
     * run for minutes: its head's buffer is given back now rather than held that long. */
    if (head && q->resp_remaining < 0)
        dp_buf_free(&q->out);
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
    budget_release(c->srv, q);
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
        /* Early answer: the rest of the body is read and dropped while the connection lingers. */
        c->keep_alive = false;
        conn_release_req(c);
        conn_linger(c, false);
        return 0;
    }
    if (!c->keep_alive) {
        conn_release_req(c);
        conn_linger(c, false);
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
    if (q->resp_head_pending && resp_emit(req, NULL, 0, NULL, 0, NULL, 0) != 0)
        return; /* the write failed: conn_close released it */
    conn_release_req(c);
    budget_unwait(c);
    /* Deliver what was written, then end the connection without the final chunk: a lingering
     * close, so a client that stops reading is cut off as in any other (timer_cb). */
    conn_linger(c, true);
}

bool net_resp_unstart(net_req_t *req)
{
    req_impl_t *q = impl(req);
    if (!q->resp_head_pending || q->resp_ended)
        return false;
    cork_remove(req->server, q);
    q->resp_head_pending = false;
    q->resp_started = false;
    q->resp_chunked = false;
    q->resp_no_body = false;
    q->resp_remaining = -1;
    dp_buf_reset(&q->out);
    return true;
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

int net_resp_method_not_allowed(net_req_t *req, const char *allow)
{
    const net_header_t h = {DP_IOV("allow"), {allow, strlen(allow)}};
    char msg[64];
    snprintf(msg, sizeof(msg), "use %s", allow);
    return net_resp_error(req, 405, NULL, "method_not_allowed", NULL, msg, &h, 1);
}
