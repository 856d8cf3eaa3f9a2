/* Upstream connections and exchanges. See net/client.h.
 *
 * A connection (uconn_t) is CONNECTING, then SENDING/HEAD (request going out, waiting for the
 * status line), BODY, and back to IDLE in its upstream's LIFO pool when the exchange ended
 * cleanly on a reusable connection; otherwise it is closed. An exchange (creq_t) is a small
 * separate object so a connection can go back to the pool before on_done runs (the callback
 * may start the next exchange and reuse it at once) without the caller's pointer aliasing it.
 *
 * Idle pooled connections keep reading: an EOF there removes them from the pool before a
 * request can race the server's keep-alive close; bytes there are a protocol error. */
#include "net/client.h"

#include <assert.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <llhttp.h>

#include "common/buf.h"
#include "common/list.h"
#include "common/util.h"
#include "net/hdrs.h"
#include "net/sock.h"

enum { UC_CONNECTING = 0, UC_HEAD, UC_BODY, UC_IDLE, UC_CLOSED };

typedef struct uconn_s uconn_t;

typedef struct net_creq_impl_s {
    net_creq_t pub;
    uconn_t *c;
    net_creq_cb_t cb;
    struct net_creq_impl_s *next_free;
    /* A drain (net_creq_drain): the set it is in and its links there, what its end calls
     * (with pub.data), and when it ends at the latest (uv_now() ms). */
    net_drains_t *dset;
    struct net_creq_impl_s *dnext, *dprev;
    net_drain_done_fn ddone;
    uint64_t ddeadline;
    /* net_creq_set_deadline: the whole answer by then (uv_now() ms; 0: none), and its length. */
    uint64_t edeadline;
    uint32_t edeadline_ms;
} creq_t;

struct uconn_s {
    net_sock_t sock;
    uv_timer_t timer;
    net_upstream_t *up;
    uconn_t *next_idle, *prev_idle;
    creq_t *req;
    llhttp_t parser;
    net_head_scan_t hs;
    net_chunk_scan_t cs;
    net_hdrs_t hd;  /* the response head's names and values */
    dp_buf_t outq;  /* request bytes waiting for the connect (after the lent ones) */
    uv_buf_t *lent; /* the caller's start bytes, waiting where they lie (start_bufs_kept) */
    unsigned nlent;
    size_t lent_len;
    uint8_t phase;
    int closes_pending;
    net_framing_t framing;
    uint64_t body_remaining;
    uint64_t last_read;
    bool head_done, msg_done;
    bool no_body, close_delimited;
    bool head_request;
    bool req_ended;    /* the caller has handed us every request byte */
    uint64_t req_from; /* sock.handed before the request's first byte (0 on a new connection) */
    /* Where the request's last byte ends in the socket's count (net_sock_written), once all of
     * it is with the socket; 0 before. Bytes the socket writes after it on its own (a TLS
     * alert answering the server) are not the request's. */
    uint64_t req_to;
    bool paused;
    bool connected;
    bool held;                 /* connected, request bytes kept back until net_creq_release */
    net_up_err_t deferred_err; /* reported by deferred_fail_cb */
    /* The timer's deadline for its phase (uv_now() ms), and, while it runs timer_cb (not a
     * deferred failure), when it fires: no later than the deadline (uconn_arm). */
    uint64_t deadline, timer_due;
    bool timer_lazy;
    /* Pooled (uv_now() ms) after a chunked answer or not, and not to be taken before
     * usable_at while its server's habit after chunked answers is being learned. */
    uint64_t pooled_at, usable_at;
    bool after_chunked;
};

/* Whether a server keeps a connection open after a chunked answer that did not say
 * `Connection: close`. Most do. llama.cpp's server closes every connection it streamed an
 * answer on, microseconds after the last chunk; a request sent on it meanwhile is read and
 * discarded, and the close that follows looks like an engine that took the request and may be
 * running it (a 502, never sent again: docs/requests.md, "Connection reuse"). Learned per
 * upstream: after its first chunked answer a connection is not taken for SETTLE_MS; a server
 * that closes it within that closes after streams, and such connections are closed here from
 * then on, before anything is sent on them; one still open then keeps them, and they are taken
 * at once. A close later than that but within HABIT_WINDOW_MS of a chunked answer, on a pooled
 * connection or under a request that reused one, is learned the same way (a server that closes
 * a little later costs the requests that met its closes until then, not every later one); no
 * engine's keep-alive timeout is that short, so an idle close never teaches it. One connection
 * in REPROBE_EVERY that a closing server's habit would close is pooled and held back so
 * instead, so that a server that closed one by chance (a restart just after a stream) is not
 * judged for good. Length-delimited answers are not held back so: every request would pay for
 * it, and engines keep those connections or say `Connection: close`. */
enum { HABIT_UNKNOWN = 0, HABIT_KEPT, HABIT_CLOSED };
#define SETTLE_MS 100
#define HABIT_WINDOW_MS 1000
#define REPROBE_EVERY 64

struct net_upstream_s {
    uv_loop_t *loop;
    struct sockaddr_storage addr;
    net_upstream_opts_t o;
    llhttp_settings_t settings;
    uconn_t *idle;
    size_t nidle;
    size_t refs; /* 1 for the owner + 1 per open connection */
    creq_t *free_reqs;
    size_t nfree;
    net_tls_ctx_t *tls;
    char *server_name;
    void (*on_idle_close)(void *data);
    void *idle_close_data;
    bool dead;             /* the owner let go: no more pooling */
    uint8_t chunked_habit; /* HABIT_*: what the server does after a chunked answer */
    uint8_t reprobe;       /* counts connections a closing server's habit closed */
};

static const char *const err_names[NET_UP__COUNT] = {
    "ok",           "connect",  "send",      "reused_closed", "closed", "first_byte_timeout",
    "idle_timeout", "protocol", "truncated", "send_timeout",
};

const char *net_up_err_name(net_up_err_t e)
{
    return (unsigned)e < NET_UP__COUNT ? err_names[e] : "unknown";
}

bool net_up_err_retryable(net_up_err_t e)
{
    return e == NET_UP_CONNECT || e == NET_UP_SEND || e == NET_UP_REUSED_CLOSED;
}

bool net_up_err_may_run(net_up_err_t e)
{
    return e == NET_UP_CLOSED || e == NET_UP_FIRST_BYTE_TIMEOUT || e == NET_UP_IDLE_TIMEOUT ||
           e == NET_UP_PROTOCOL || e == NET_UP_TRUNCATED;
}

static void up_unref(net_upstream_t *u)
{
    assert(u->refs > 0);
    if (--u->refs > 0)
        return;
    /* Every connection held a reference: none is left, pooled or not. */
    assert(u->dead && u->idle == NULL && u->nidle == 0);
    while (u->free_reqs) {
        creq_t *q = u->free_reqs;
        u->free_reqs = q->next_free;
        free(q);
    }
    free(u->server_name);
    net_tls_ctx_unref(u->tls);
    free(u);
}

/* ---- pool --------------------------------------------------------------------------------- */

static void idle_remove(uconn_t *c)
{
    net_upstream_t *u = c->up;
    if (c->prev_idle)
        c->prev_idle->next_idle = c->next_idle;
    else if (u->idle == c)
        u->idle = c->next_idle;
    else
        return; /* not pooled */
    assert(u->nidle > 0);
    if (c->next_idle)
        c->next_idle->prev_idle = c->prev_idle;
    c->next_idle = c->prev_idle = NULL;
    u->nidle--;
}

/* Pool c: only a connection whose exchange ended cleanly, with nothing of it left to send,
 * while the upstream still pools and has room (uconn_done decides). */
static void idle_push(uconn_t *c)
{
    net_upstream_t *u = c->up;
    assert(c->phase == UC_IDLE && c->req == NULL);
    assert(c->prev_idle == NULL && c->next_idle == NULL && u->idle != c); /* not pooled yet */
    assert(c->sock.queued == 0 && c->outq.len == 0 && c->nlent == 0);
    assert(!u->dead && u->nidle < u->o.max_idle);
    c->prev_idle = NULL;
    c->next_idle = u->idle;
    if (u->idle)
        u->idle->prev_idle = c;
    u->idle = c;
    u->nidle++;
}

/* ---- timers --------------------------------------------------------------------------------
 * One timer per connection, its meaning given by the phase: connect timeout, first-byte
 * timeout, mid-response idle timeout (checked lazily against last_read so a busy stream does
 * not restart a timer per read), or pooled-idle lifetime. While request bytes wait in the
 * socket before the response starts, it also comes back within the idle timeout to see whether
 * the upstream still takes them (send_stalled). */

static void uconn_fail(uconn_t *c, net_up_err_t err, const char *detail);
static void uconn_close(uconn_t *c);
static uconn_t *pool_pick(net_upstream_t *u);

static void uconn_arm(uconn_t *c, uint64_t ms);
static void timer_cb(uv_timer_t *t);

/* The timer for `ms` from now, the phase's deadline left where it is (uconn_arm). Never later
 * than the deadline of a drain on c, or of the exchange on it (net_creq_set_deadline): while
 * there is one, the timer is never due after it. */
static void uconn_timer_in(uconn_t *c, uint64_t ms)
{
    uint64_t now = uv_now(c->up->loop);
    creq_t *q = c->req;
    uint64_t end = q == NULL ? 0 : q->dset ? q->ddeadline : q->edeadline;
    if (end) {
        uint64_t left = end > now ? end - now : 0;
        if (left < ms)
            ms = left;
    }
    c->timer_due = now + ms;
    c->timer_lazy = true;
    uv_timer_start(&c->timer, timer_cb, ms, 0);
}

/* Request bytes wait in the socket for a replica that may have stopped reading them: the
 * timer comes back within the idle timeout to look (send_stalled), however far off the first
 * byte's deadline is. Like nginx's proxy_send_timeout, which has the same 60 s default.
 * `batched`: bytes still in the loop's write batch count too (they may queue when it is
 * written); not for a request's first bytes, which would set a timer for every request. */
static void uconn_watch_send(uconn_t *c, bool batched)
{
    if (c->phase != UC_HEAD || (c->sock.queued == 0 && !(batched && c->sock.in_batch)))
        return;
    uint64_t ms = c->up->o.idle_timeout_ms;
    if (uv_is_active((uv_handle_t *)&c->timer) &&
        (!c->timer_lazy || c->timer_due <= uv_now(c->up->loop) + ms))
        return; /* a deferred failure, or a timer due sooner */
    uconn_timer_in(c, ms);
}

/* Waiting for the response's first byte with request bytes still queued: true when the replica
 * has taken none of them for the idle timeout (then the first-byte timeout, minutes long,
 * would be the client's wait for a replica that will never answer). Otherwise the timer is set
 * to look again, or for the deadline when that comes first; *rearmed says so. */
static bool send_stalled(uconn_t *c, uint64_t now, bool *rearmed)
{
    *rearmed = false;
    if (c->phase != UC_HEAD || c->sock.queued == 0 || (c->req && c->req->pub.response_started))
        return false;
    uint64_t idle = c->up->o.idle_timeout_ms;
    uint64_t quiet = now - net_sock_last_progress(&c->sock);
    if (quiet >= idle)
        return true;
    if (now < c->deadline) {
        uint64_t left = c->deadline - now;
        uconn_timer_in(c, left < idle - quiet ? left : idle - quiet);
        *rearmed = true;
    }
    return false;
}

/* The answer is late (err, detail): its owner is told, and may make the exchange a drain,
 * which then runs to its deadline; otherwise the exchange fails so. */
static void late(uconn_t *c, net_up_err_t err, const char *detail, uint64_t now)
{
    creq_t *q = c->req;
    if (q && q->cb.on_timeout)
        q->cb.on_timeout(&q->pub, err, detail); /* may make q a drain */
    if (q && q->dset && now < q->ddeadline) {
        uconn_arm(c, q->ddeadline - now);
        return;
    }
    uconn_fail(c, err, detail);
}

static void timer_cb(uv_timer_t *t)
{
    uconn_t *c = t->data;
    net_upstream_t *u = c->up;
    uint64_t now = uv_now(u->loop);
    creq_t *q = c->req;
    if (q && q->dset && now >= q->ddeadline) {
        uconn_fail(c, NET_UP_IDLE_TIMEOUT, "drained for as long as it may be");
        return;
    }
    if (q && !q->dset && q->edeadline && now >= q->edeadline && c->phase != UC_IDLE) {
        /* However it trickles, the answer is not whole in time: late, as a silent one. */
        char why[96];
        snprintf(why, sizeof(why),
                 c->phase == UC_CONNECTING ? "connect timeout: not connected within %u ms"
                                           : "answer not whole within %u ms",
                 (unsigned)q->edeadline_ms);
        if (c->phase == UC_CONNECTING)
            uconn_fail(c, NET_UP_CONNECT, why);
        else
            late(c, q->pub.response_started ? NET_UP_IDLE_TIMEOUT : NET_UP_FIRST_BYTE_TIMEOUT, why,
                 now);
        return;
    }
    bool rearmed;
    if (send_stalled(c, now, &rearmed)) {
        char why[96];
        snprintf(why, sizeof(why), "took none of the request's bytes for %u ms",
                 (unsigned)u->o.idle_timeout_ms);
        uconn_fail(c, NET_UP_SEND_TIMEOUT, why);
        return;
    }
    if (rearmed)
        return;
    if (now < c->deadline) { /* set early, the deadline moved on since (uconn_arm) */
        uconn_arm(c, c->deadline - now);
        return;
    }
    switch (c->phase) {
    case UC_CONNECTING:
        uconn_fail(c, NET_UP_CONNECT, "connect timeout");
        return;
    case UC_HEAD: {
        if (q && q->dset) { /* a drain: silence does not end it, its deadline does */
            uconn_arm(c, q->ddeadline - now);
            return;
        }
        /* A head begun and stalled (part of a status line, an interim 103 before a long
         * prefill) is an answer fallen silent: the same choice as mid-body. */
        if (q && q->pub.response_started)
            late(c, NET_UP_IDLE_TIMEOUT, "response head stalled", now);
        else
            late(c, NET_UP_FIRST_BYTE_TIMEOUT, "no response before first-byte timeout", now);
        return;
    }
    case UC_BODY: {
        uint64_t idle = u->o.idle_timeout_ms;
        if (q && q->dset) { /* a drain: silence does not end it, its deadline does */
            uconn_arm(c, q->ddeadline - now);
            return;
        }
        if (c->paused || now - c->last_read < idle) {
            uconn_arm(c, c->paused ? idle : idle - (now - c->last_read));
            return;
        }
        late(c, NET_UP_IDLE_TIMEOUT, "response stalled mid-body", now);
        return;
    }
    case UC_IDLE:
        uconn_close(c);
        return;
    default:
        return;
    }
}

/* The timer, for `ms` from now. One already due no later than that is left alone: when it
 * fires before the deadline, timer_cb sets it again for the rest. A pooled connection moves
 * its deadline later on every exchange (first byte, body, pooled idle) and reaches it rarely,
 * so this saves a timer-heap removal and insertion each time. Every start of c->timer goes
 * through here or uconn_defer_fail (which clears timer_lazy): a start elsewhere would let this
 * keep the wrong timer. */
static void uconn_arm(uconn_t *c, uint64_t ms)
{
    c->deadline = uv_now(c->up->loop) + ms;
    if (c->timer_lazy && uv_is_active((uv_handle_t *)&c->timer) && c->timer_due <= c->deadline)
        return;
    uconn_timer_in(c, ms);
}

static void deferred_fail_cb(uv_timer_t *t);

/* Report err from the loop, never inside the caller's call. */
static void uconn_defer_fail(uconn_t *c, net_up_err_t err)
{
    c->deferred_err = err;
    c->timer_lazy = false;
    uv_timer_start(&c->timer, deferred_fail_cb, 0, 0);
}

/* ---- connection teardown ------------------------------------------------------------------ */

static void uconn_handle_closed(uconn_t *c)
{
    assert(c->closes_pending > 0);
    if (--c->closes_pending > 0)
        return;
    net_upstream_t *u = c->up;
    /* Closed by uconn_close_how only: no exchange attached, not in the pool. */
    assert(c->phase == UC_CLOSED && c->req == NULL);
    assert(c->prev_idle == NULL && c->next_idle == NULL && u->idle != c);
    net_hdrs_free(&c->hd);
    dp_buf_free(&c->outq);
    free(c);
    up_unref(u);
}

static void sock_closed(net_sock_t *s)
{
    uconn_handle_closed(s->owner);
}

static void timer_closed(uv_handle_t *h)
{
    uconn_handle_closed(h->data);
}

/* Every caller has detached the exchange first (uconn_fail and uconn_done report it after;
 * net_creq_cancel wants no callback): one still attached would never hear on_done. */
/* Forget the caller's lent bytes: they are not ours past the exchange. */
static void lent_drop(uconn_t *c)
{
    free(c->lent);
    c->lent = NULL;
    c->nlent = 0;
    c->lent_len = 0;
}

static void uconn_close_how(uconn_t *c, bool reset)
{
    assert(c->req == NULL);
    lent_drop(c);
    if (c->phase == UC_CLOSED)
        return;
    if (c->phase == UC_IDLE)
        idle_remove(c);
    c->phase = UC_CLOSED;
    uv_timer_stop(&c->timer);
    uv_close((uv_handle_t *)&c->timer, timer_closed);
    if (reset)
        net_sock_abort(&c->sock);
    else
        net_sock_close(&c->sock);
}

static void uconn_close(uconn_t *c)
{
    uconn_close_how(c, false);
}

/* q's exchange is over: its connection no longer points at it (the connection's memory is
 * still there: it is freed only from its close callbacks, later in the loop). */
static void creq_free(net_upstream_t *u, creq_t *q)
{
    assert(q->c != NULL && q->c->req != q);
    if (u->nfree < 256) {
        q->next_free = u->free_reqs;
        u->free_reqs = q;
        u->nfree++;
    } else {
        free(q);
    }
}

/* End the exchange with an error: close the connection, then tell the caller. */
static void uconn_fail(uconn_t *c, net_up_err_t err, const char *detail)
{
    creq_t *q = c->req;
    net_upstream_t *u = c->up;
    c->req = NULL;
    u->refs++; /* keep u alive across the callback */
    uconn_close(c);
    /* The server closed a pooled connection without saying so (no `Connection: close`): the
     * others it pooled are as stale (a server that closes every idle connection, or one that
     * restarted), so the retry this invites, and whatever follows, goes over a new one rather
     * than meeting the next stale connection (docs/requests.md, "Retries"). */
    if (err == NET_UP_REUSED_CLOSED)
        net_upstream_flush_idle(u);
    if (q) {
        if (q->cb.on_done)
            q->cb.on_done(&q->pub, err, detail);
        creq_free(u, q);
    }
    up_unref(u);
}

/* The response completed: pool or close the connection, then tell the caller. */
static void uconn_done(uconn_t *c)
{
    creq_t *q = c->req;
    net_upstream_t *u = c->up;
    c->req = NULL;
    bool chunked = c->framing.chunked;
    bool reusable = !c->framing.conn_close && !c->close_delimited && c->req_ended &&
                    c->nlent == 0 && c->sock.queued == 0 && c->outq.len == 0 &&
                    llhttp_should_keep_alive(&c->parser) && !u->dead && u->nidle < u->o.max_idle;
    bool settle = chunked && u->chunked_habit == HABIT_UNKNOWN;
    if (reusable && chunked && u->chunked_habit == HABIT_CLOSED)
        reusable = settle = ++u->reprobe % REPROBE_EVERY == 0;
    u->refs++;
    if (reusable) {
        c->phase = UC_IDLE;
        c->paused = false;
        idle_push(c);
        c->pooled_at = uv_now(u->loop);
        c->after_chunked = chunked;
        c->usable_at = settle ? c->pooled_at + SETTLE_MS : 0;
        uconn_arm(c, u->o.keepalive_ms);
        net_sock_read_start(&c->sock);
    } else {
        uconn_close(c);
    }
    if (q) {
        if (q->cb.on_done)
            q->cb.on_done(&q->pub, NET_UP_OK, NULL);
        creq_free(u, q);
    }
    up_unref(u);
}

/* ---- llhttp callbacks (record only) -------------------------------------------------------- */

/* A chunked response's trailers come through the same callbacks: dropped, as the request's
 * are (net/server.c), so the head's spans stay valid for the exchange. */
static int on_header_field(llhttp_t *p, const char *at, size_t n)
{
    uconn_t *c = p->data;
    if (!c->head_done)
        net_hdrs_field(&c->hd, at, n);
    return 0;
}

static int on_header_value(llhttp_t *p, const char *at, size_t n)
{
    uconn_t *c = p->data;
    if (!c->head_done)
        net_hdrs_value(&c->hd, at, n);
    return 0;
}

static int on_headers_complete(llhttp_t *p)
{
    uconn_t *c = p->data;
    c->head_done = true;
    /* 1 tells llhttp the response has no body: a HEAD request's, and a 204 or 304 whatever
     * length it announces (a 304's Content-Length is the representation's, RFC 9110 §8.6).
     * llhttp would otherwise wait for that many body bytes that never come. */
    int status = llhttp_get_status_code(p);
    return c->head_request || status == 204 || status == 304 ? 1 : 0;
}

static int on_body(llhttp_t *p, const char *at, size_t n)
{
    uconn_t *c = p->data;
    creq_t *q = c->req;
    if (q && q->cb.on_body)
        q->cb.on_body(&q->pub, at, n);
    return c->phase == UC_CLOSED ? HPE_USER : 0;
}

static int on_message_complete(llhttp_t *p)
{
    uconn_t *c = p->data;
    c->msg_done = true;
    return HPE_PAUSED; /* stop exactly at the end of this response */
}

/* ---- response parsing --------------------------------------------------------------------- */

static void head_reset(uconn_t *c)
{
    memset(&c->hs, 0, sizeof(c->hs));
    c->hs.max_bytes = 65536;
    c->hs.max_headers = 256;
    net_hdrs_reset(&c->hd);
    c->head_done = c->msg_done = false;
}

/* Head parsed: validate, pick the body framing, tell the caller. `more`: bytes follow the head
 * in this read. false when the exchange ended (error, complete, or the caller cancelled inside
 * on_head). */
static bool uconn_head_done(uconn_t *c, bool more)
{
    int status = llhttp_get_status_code(&c->parser);
    const net_header_t *hdrs = net_hdrs_spans(&c->hd);
    size_t nh = c->hd.n;
    const char *reason = NULL;
    if (net_response_check(hdrs, nh, llhttp_get_http_major(&c->parser),
                           llhttp_get_http_minor(&c->parser), status, &c->framing, &reason) != 0) {
        uconn_fail(c, NET_UP_PROTOCOL, reason);
        return false;
    }
    if (status >= 100 && status < 200) {
        /* Interim response (100 Continue, 103 Early Hints): skip it, a final one follows. */
        if (!c->msg_done) {
            uconn_fail(c, NET_UP_PROTOCOL, "interim response with a body");
            return false;
        }
        llhttp_resume(&c->parser);
        head_reset(c);
        return true;
    }
    c->no_body = c->head_request || status == 204 || status == 304;
    c->close_delimited = !c->no_body && !c->framing.chunked && c->framing.content_length < 0;
    c->body_remaining = c->framing.content_length > 0 ? (uint64_t)c->framing.content_length : 0;
    memset(&c->cs, 0, sizeof(c->cs));
    creq_t *q = c->req;
    if (c->close_delimited && q->pub.length_required) {
        uconn_fail(c, NET_UP_PROTOCOL,
                   "answer without Content-Length or chunked framing: a cut could not be told "
                   "from its end");
        return false;
    }
    if (q->cb.on_head)
        q->cb.on_head(&q->pub, status, hdrs, nh, &c->framing);
    if (c->phase == UC_CLOSED || c->req != q)
        return false;
    if (q->pub.refuse) {
        uconn_fail(c, NET_UP_PROTOCOL, q->pub.refuse);
        return false;
    }
    if (c->msg_done) {
        if (more) /* bytes after a bodiless response: its framing is not ours */
            c->framing.conn_close = true;
        uconn_done(c);
        return false;
    }
    c->phase = UC_BODY;
    /* A body of unknown length (an SSE answer) may run for minutes: the head's names and values
     * are given back now rather than held that long (a trailer section is not kept). */
    if (c->framing.content_length < 0)
        net_hdrs_free(&c->hd);
    c->last_read = uv_now(c->up->loop);
    uconn_arm(c, c->up->o.idle_timeout_ms);
    return true;
}

static void uconn_feed(uconn_t *c, const char *p, size_t n)
{
    while (n > 0 && c->phase != UC_CLOSED) {
        size_t used = 0;
        const char *reason = "invalid response";
        int status, r;
        if (c->phase == UC_IDLE || c->req == NULL) {
            uconn_fail(c, NET_UP_PROTOCOL, "unsolicited bytes on an idle connection");
            return;
        }
        if (c->phase == UC_HEAD) {
            r = net_head_scan(&c->hs, p, n, &used, &status, &reason);
            if (r == NET_SCAN_ERROR) {
                uconn_fail(c, NET_UP_PROTOCOL, reason);
                return;
            }
            llhttp_errno_t e = llhttp_execute(&c->parser, p, used);
            if (e != HPE_OK && e != HPE_PAUSED) {
                uconn_fail(c, NET_UP_PROTOCOL, llhttp_get_error_reason(&c->parser));
                return;
            }
            p += used;
            n -= used;
            if (r == NET_SCAN_DONE) {
                if (!c->head_done) {
                    uconn_fail(c, NET_UP_PROTOCOL, "malformed response head");
                    return;
                }
                if (!uconn_head_done(c, n > 0))
                    return;
            }
            continue;
        }
        /* UC_BODY */
        if (c->framing.chunked) {
            r = net_chunk_scan(&c->cs, p, n, &used, &reason);
            if (r == NET_SCAN_ERROR) {
                uconn_fail(c, NET_UP_PROTOCOL, reason);
                return;
            }
        } else if (c->close_delimited) {
            used = n;
            r = NET_SCAN_MORE;
        } else {
            used = n < c->body_remaining ? n : (size_t)c->body_remaining;
            c->body_remaining -= used;
            r = c->body_remaining == 0 ? NET_SCAN_DONE : NET_SCAN_MORE;
        }
        c->last_read = uv_now(c->up->loop);
        creq_t *q = c->req;
        llhttp_errno_t e = llhttp_execute(&c->parser, p, used);
        if (c->phase == UC_CLOSED || c->req != q)
            return; /* cancelled from on_body */
        if (e != HPE_OK && e != HPE_PAUSED) {
            uconn_fail(c, NET_UP_PROTOCOL, llhttp_get_error_reason(&c->parser));
            return;
        }
        p += used;
        n -= used;
        if (r == NET_SCAN_DONE) {
            if (!c->msg_done) {
                uconn_fail(c, NET_UP_PROTOCOL, "malformed response body");
                return;
            }
            if (n > 0) {
                /* Bytes after the response: the upstream's framing disagrees with ours. */
                c->framing.conn_close = true;
            }
            uconn_done(c);
            return;
        }
    }
}

/* ---- socket callbacks ---------------------------------------------------------------------- */

static void sock_read(net_sock_t *s, const char *p, size_t n)
{
    uconn_t *c = s->owner;
    if (c->held) { /* nothing of ours left: the request is as good as never sent */
        uconn_fail(c, NET_UP_SEND, "the upstream spoke before the request was sent");
        return;
    }
    if (c->req)
        c->req->pub.response_started = true;
    uconn_feed(c, p, n);
}

/* The server closed c: pooled, or under the request that reused it. Soon after a chunked
 * answer, that is its habit after them (HABIT_WINDOW_MS). */
static void learn_habit(uconn_t *c)
{
    net_upstream_t *u = c->up;
    bool since_pooled =
        c->phase == UC_IDLE || (c->req && c->req->pub.reused && !c->req->pub.response_started);
    if (since_pooled && c->after_chunked && uv_now(u->loop) - c->pooled_at < HABIT_WINDOW_MS)
        u->chunked_habit = HABIT_CLOSED;
}

/* EOF or error from the socket: classify it for the retry rule. */
static void sock_error(net_sock_t *s, int status)
{
    uconn_t *c = s->owner;
    /* A TLS failure after the handshake (an alert such as "certificate required" under TLS
     * 1.3) says more than "protocol error". */
    const char *why = status == UV_EPROTO ? net_sock_tls_error(s) : uv_strerror(status);
    learn_habit(c);
    if (c->phase == UC_IDLE || c->req == NULL) {
        net_upstream_t *u = c->up;
        u->refs++;      /* keep u alive across the callback */
        uconn_close(c); /* the server closed a pooled connection: drop it, and say so */
        if (!u->dead && u->on_idle_close)
            u->on_idle_close(u->idle_close_data);
        up_unref(u);
        return;
    }
    creq_t *q = c->req;
    if (c->held) { /* closed before anything was sent: the request never left */
        uconn_fail(c, NET_UP_SEND, status == UV_EOF ? "closed before the request was sent" : why);
        return;
    }
    if (c->phase == UC_CONNECTING) {
        uconn_fail(c, NET_UP_CONNECT,
                   status == UV_EPROTO ? net_sock_tls_error(&c->sock) : uv_strerror(status));
        return;
    }
    if (!q->pub.response_started) {
        /* Whether the replica can have begun the request decides whether it may be sent
         * again (docs/requests.md, "Retries"). Not while some of it had not left: a server
         * reads a request whole before it acts on it. Once all of it left, only a close with
         * a FIN says what the replica's TCP took (the FIN carries its acknowledgement, and a
         * server that closes with bytes unread resets instead): none of it on a reused
         * connection is the keep-alive race (its idle timeout closed it as the request went
         * out), some of it means the rest never arrived. A reset says nothing: a delayed
         * acknowledgement is never sent, so a proxy in front of an engine that read it all and
         * cut this side looks the same as a server that read nothing. Neither that, nor a
         * request taken whole, is sent again: the engine may be running it still, and a second
         * copy would be a second generation (on a single-sequence pool, beside the first). */
        uint64_t kernel = c->sock.handed - c->sock.queued; /* in the kernel */
        uint64_t end = c->req_to ? c->req_to : net_sock_written(&c->sock);
        bool left = c->req_to != 0 && kernel >= c->req_to;
        bool none_out = kernel <= c->req_from; /* nothing of it reached the kernel yet */
        uint64_t took = status == UV_EOF ? net_sock_acked_since(&c->sock, c->req_from) : 0;
        bool fin_short = status == UV_EOF && took < end - c->req_from;
        if (q->pub.reused && (none_out || (status == UV_EOF && took == 0)))
            uconn_fail(c, NET_UP_REUSED_CLOSED,
                       "reused connection closed before it took the request");
        else if (!left || fin_short)
            uconn_fail(c, NET_UP_SEND, why);
        else
            uconn_fail(c, NET_UP_CLOSED, status == UV_EOF ? "closed before the response" : why);
        return;
    }
    if (c->phase == UC_BODY && c->close_delimited && status == UV_EOF && c->sock.tls &&
        !net_tls_peer_closed(c->sock.tls)) {
        /* Over TLS only close_notify ends a close-delimited body: a bare TCP close may be an
         * attacker cutting the response short (RFC 8446 §6.1, RFC 9112 §9.8). */
        uconn_fail(c, NET_UP_TRUNCATED, "TLS connection closed without close_notify");
        return;
    }
    if (c->phase == UC_BODY && c->close_delimited && status == UV_EOF) {
        /* EOF ends a close-delimited body: that is a complete response. */
        llhttp_finish(&c->parser);
        c->framing.conn_close = true;
        uconn_done(c);
        return;
    }
    uconn_fail(c, NET_UP_TRUNCATED, status == UV_EOF ? "closed mid-response" : why);
}

static void sock_drain(net_sock_t *s)
{
    uconn_t *c = s->owner;
    if (c->req && c->req->cb.on_drain)
        c->req->cb.on_drain(&c->req->pub);
}

/* Every request byte may be with the socket now: note where they end (req_to). */
static void note_req_sent(uconn_t *c)
{
    if (c->req_ended && c->req_to == 0 && c->nlent == 0 && c->outq.len == 0 && !c->held &&
        c->phase != UC_CONNECTING)
        c->req_to = net_sock_written(&c->sock);
}

/* The request bytes that waited for the connection (or its release) go out: 0, or the write's
 * error. */
static int outq_send(uconn_t *c)
{
    int r = 0;
    if (c->nlent) /* the socket copies what it does not take now */
        r = net_sock_write(&c->sock, c->lent, c->nlent);
    lent_drop(c);
    if (r == 0 && c->outq.len) {
        uv_buf_t b = uv_buf_init(c->outq.base, (unsigned)c->outq.len);
        r = net_sock_write(&c->sock, &b, 1);
    }
    dp_buf_free(&c->outq);
    if (r == 0)
        note_req_sent(c);
    return r;
}

/* The bytes waiting for the connection (or its release) are above the socket's high water:
 * net_creq_over() says so while they wait. */
static bool waiting_over(const uconn_t *c)
{
    return c->outq.len + c->lent_len > c->sock.high_water;
}

static void sock_connected(net_sock_t *s, int status)
{
    uconn_t *c = s->owner;
    if (c->phase != UC_CONNECTING)
        return;
    if (status != 0) {
        uconn_fail(c, NET_UP_CONNECT,
                   status == UV_EPROTO ? net_sock_tls_error(&c->sock) : uv_strerror(status));
        return;
    }
    c->connected = true;
    c->phase = UC_HEAD;
    net_sock_read_start(&c->sock);
    if (c->req && c->req->cb.on_connected) {
        /* Held: no timer (the caller bounds the wait), nothing sent until released. */
        c->held = true;
        uv_timer_stop(&c->timer);
        c->req->cb.on_connected(&c->req->pub); /* may release or cancel: c is not used after */
        return;
    }
    uconn_arm(c, c->up->o.first_byte_timeout_ms);
    bool was_over = waiting_over(c);
    int r = outq_send(c);
    if (r != 0) {
        uconn_fail(c, NET_UP_SEND, uv_strerror(r));
        return;
    }
    uconn_watch_send(c, false);
    /* A caller paused on net_creq_over by the bytes that waited here: when the socket took
     * them without going over high water itself, no socket drain will come, so this is it. */
    if (was_over && !net_sock_over(&c->sock))
        sock_drain(&c->sock); /* may cancel the request: c is not used after */
}

/* ---- public API ---------------------------------------------------------------------------- */

static void opts_fill(net_upstream_opts_t *o, const net_upstream_opts_t *in)
{
    if (in)
        *o = *in;
    if (o->connect_timeout_ms == 0)
        o->connect_timeout_ms = 2000;
    if (o->first_byte_timeout_ms == 0)
        o->first_byte_timeout_ms = 600000;
    if (o->idle_timeout_ms == 0)
        o->idle_timeout_ms = 60000;
    if (o->keepalive_ms == 0)
        o->keepalive_ms = o->idle_timeout_ms;
    if (o->max_idle == 0)
        o->max_idle = 1024;
    if (o->write_high_water == 0)
        o->write_high_water = 256 * 1024;
}

net_upstream_t *net_upstream_new(uv_loop_t *loop, const struct sockaddr *addr,
                                 const net_upstream_opts_t *opts)
{
    net_upstream_t *u = dp_xcalloc(1, sizeof(*u));
    u->loop = loop;
    memcpy(&u->addr, addr,
           addr->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in));
    opts_fill(&u->o, opts);
    u->refs = 1;
    llhttp_settings_init(&u->settings);
    u->settings.on_header_field = on_header_field;
    u->settings.on_header_value = on_header_value;
    u->settings.on_headers_complete = on_headers_complete;
    u->settings.on_body = on_body;
    u->settings.on_message_complete = on_message_complete;
    return u;
}

void net_upstream_set_opts(net_upstream_t *u, const net_upstream_opts_t *opts)
{
    opts_fill(&u->o, opts);
}

void net_upstream_set_tls(net_upstream_t *u, net_tls_ctx_t *tls, const char *server_name)
{
    if (tls)
        net_tls_ctx_ref(tls);
    net_tls_ctx_unref(u->tls);
    u->tls = tls;
    free(u->server_name);
    u->server_name = server_name ? dp_xstrdup(server_name) : NULL;
}

void net_upstream_flush_idle(net_upstream_t *u)
{
    while (u->idle)
        uconn_close(u->idle);
}

void net_upstream_on_idle_close(net_upstream_t *u, void (*cb)(void *data), void *data)
{
    u->on_idle_close = cb;
    u->idle_close_data = data;
}

void net_upstream_free(net_upstream_t *u)
{
    u->dead = true;
    net_upstream_flush_idle(u);
    up_unref(u);
}

size_t net_client_upstream_idle(const net_upstream_t *u)
{
    return u->nidle;
}

bool net_upstream_take_ready(net_upstream_t *u)
{
    return pool_pick(u) != NULL;
}

static uconn_t *uconn_new(net_upstream_t *u)
{
    uconn_t *c = dp_xcalloc(1, sizeof(*c));
    c->up = u;
    u->refs++;
    c->closes_pending = 2;
    net_sock_init(u->loop, &c->sock, c);
    c->sock.on_read = sock_read;
    c->sock.on_error = sock_error;
    c->sock.on_drain = sock_drain;
    c->sock.on_connect = sock_connected;
    c->sock.on_close = sock_closed;
    c->sock.high_water = u->o.write_high_water;
    c->sock.low_water = u->o.write_high_water / 4;
    if (u->tls) {
        net_tls_t *t = net_tls_new_client(u->tls, u->server_name);
        if (t)
            net_sock_use_tls(&c->sock, t);
    }
    uv_timer_init(u->loop, &c->timer);
    c->timer.data = c;
    llhttp_init(&c->parser, HTTP_RESPONSE, &u->settings);
    c->parser.data = c;
    c->phase = UC_CONNECTING;
    return c;
}

/* Report a connect failure from the loop, never from inside net_creq_start. */
static void deferred_fail_cb(uv_timer_t *t)
{
    uconn_t *c = t->data;
    uconn_fail(c, c->deferred_err,
               c->deferred_err == NET_UP_CONNECT ? "connect failed"
               : c->deferred_err == NET_UP_SEND  ? "write failed"
                                                 : "pooled connection failed");
}

/* The pooled connection a request takes now: the newest that is neither past its keep-alive
 * (closed here: its timer closes it too, but late on a busy loop) nor still settling after its
 * answer (see SETTLE_MS). NULL: a new connection. */
static uconn_t *pool_pick(net_upstream_t *u)
{
    uint64_t now = uv_now(u->loop);
    uconn_t *next;
    for (uconn_t *c = u->idle; c; c = next) {
        next = c->next_idle;
        if (c->deadline <= now) {
            uconn_close(c);
            continue;
        }
        if (c->usable_at > now)
            continue;
        if (c->usable_at) { /* open past its settling: its server keeps them */
            c->usable_at = 0;
            u->chunked_habit = HABIT_KEPT;
        }
        return c;
    }
    return NULL;
}

static net_creq_t *creq_start(net_upstream_t *u, const uv_buf_t *bufs, unsigned nbufs,
                              bool body_follows, bool head_request, const net_creq_cb_t *cb,
                              void *data, bool pooled_ok)
{
    creq_t *q = u->free_reqs;
    if (q) {
        u->free_reqs = q->next_free;
        u->nfree--;
        memset(q, 0, sizeof(*q));
    } else {
        q = dp_xcalloc(1, sizeof(*q));
    }
    q->cb = *cb;
    q->pub.data = data;

    uconn_t *c = pooled_ok ? pool_pick(u) : NULL;
    if (c) {
        assert(c->phase == UC_IDLE && c->req == NULL);
        idle_remove(c);
        q->pub.reused = true;
        c->req_from = c->sock.handed;
        c->phase = UC_HEAD;
        uconn_arm(c, u->o.first_byte_timeout_ms);
    } else {
        c = uconn_new(u);
    }
    c->req = q;
    q->c = c;
    c->head_request = head_request;
    c->req_ended = !body_follows;
    c->req_to = 0;
    c->paused = false;
    c->body_remaining = 0;
    memset(&c->framing, 0, sizeof(c->framing));
    head_reset(c);
    llhttp_reset(&c->parser);

    if (c->phase == UC_CONNECTING) {
        assert(c->outq.len == 0 && c->nlent == 0);
        if (cb->start_bufs_kept && nbufs) {
            c->lent = dp_xmalloc(nbufs * sizeof(*c->lent));
            memcpy(c->lent, bufs, nbufs * sizeof(*c->lent));
            c->nlent = nbufs;
            for (unsigned i = 0; i < nbufs; i++)
                c->lent_len += bufs[i].len;
        } else {
            for (unsigned i = 0; i < nbufs; i++)
                dp_buf_append(&c->outq, bufs[i].base, bufs[i].len);
        }
        uconn_arm(c, u->o.connect_timeout_ms);
        if (u->tls && c->sock.tls == NULL) {
            /* No TLS state (out of memory): never fall back to plaintext to an https URL. */
            uconn_defer_fail(c, NET_UP_CONNECT);
        } else if (net_sock_connect(&c->sock, (const struct sockaddr *)&u->addr) != 0) {
            uconn_defer_fail(c, NET_UP_CONNECT);
        }
        return &q->pub;
    }
    if (net_sock_write(&c->sock, bufs, nbufs) != 0) {
        /* A pooled connection that died under us: the classic keep-alive race. */
        uconn_defer_fail(c, NET_UP_REUSED_CLOSED);
    } else {
        note_req_sent(c);
        uconn_watch_send(c, false);
    }
    return &q->pub;
}

net_creq_t *net_creq_start(net_upstream_t *u, const uv_buf_t *bufs, unsigned nbufs,
                           bool body_follows, bool head_request, const net_creq_cb_t *cb,
                           void *data)
{
    return creq_start(u, bufs, nbufs, body_follows, head_request, cb, data, true);
}

net_creq_t *net_creq_start_new(net_upstream_t *u, const uv_buf_t *bufs, unsigned nbufs,
                               bool body_follows, bool head_request, const net_creq_cb_t *cb,
                               void *data)
{
    return creq_start(u, bufs, nbufs, body_follows, head_request, cb, data, false);
}

static inline creq_t *cimpl(net_creq_t *r)
{
    return (creq_t *)r;
}

int net_creq_write(net_creq_t *r, const uv_buf_t *bufs, unsigned nbufs)
{
    uconn_t *c = cimpl(r)->c;
    if (c == NULL || c->phase == UC_CLOSED)
        return -1;
    if (c->phase == UC_CONNECTING || c->held) {
        for (unsigned i = 0; i < nbufs; i++)
            dp_buf_append(&c->outq, bufs[i].base, bufs[i].len);
        return 0;
    }
    if (c->msg_done || c->phase == UC_IDLE)
        return 0; /* the upstream already answered: the rest of the body is moot */
    if (net_sock_write(&c->sock, bufs, nbufs) != 0) {
        uconn_fail(c, r->response_started ? NET_UP_TRUNCATED : NET_UP_SEND, "write failed");
        return -1;
    }
    uconn_watch_send(c, true); /* a streamed upload: its last small piece may queue */
    return 0;
}

void net_creq_end(net_creq_t *r)
{
    uconn_t *c = cimpl(r)->c;
    if (c) {
        c->req_ended = true;
        note_req_sent(c);
    }
}

void net_creq_set_deadline(net_creq_t *r, uint32_t ms)
{
    creq_t *q = (creq_t *)r;
    uconn_t *c = q->c;
    assert(c != NULL && !q->dset);
    uint64_t now = uv_now(c->up->loop);
    q->edeadline = now + ms;
    q->edeadline_ms = ms;
    /* A timer due later comes by the deadline instead; none (a held connection) is set by
     * whoever sets it next, through uconn_timer_in. A deferred failure is left as it is. */
    if (c->timer_lazy && uv_is_active((uv_handle_t *)&c->timer) && c->timer_due > q->edeadline)
        uconn_timer_in(c, ms);
}

void net_creq_pause(net_creq_t *r)
{
    uconn_t *c = cimpl(r)->c;
    if (c == NULL || c->paused || c->phase == UC_CLOSED)
        return;
    c->paused = true;
    net_sock_read_stop(&c->sock);
}

void net_creq_resume(net_creq_t *r)
{
    uconn_t *c = cimpl(r)->c;
    if (c == NULL || !c->paused || c->phase == UC_CLOSED)
        return;
    c->paused = false;
    /* The peer's silence counts from now: the loop's cached time may be a whole pause old. */
    uv_update_time(c->up->loop);
    c->last_read = uv_now(c->up->loop);
    net_sock_read_start(&c->sock);
}

void net_creq_release(net_creq_t *r)
{
    uconn_t *c = cimpl(r)->c;
    if (c == NULL || !c->held || c->phase == UC_CLOSED)
        return;
    c->held = false;
    uconn_arm(c, c->up->o.first_byte_timeout_ms);
    if (outq_send(c) != 0) /* reported from the loop, never inside the caller's call */
        uconn_defer_fail(c, NET_UP_SEND);
    else
        uconn_watch_send(c, false);
}

void net_creq_cancel(net_creq_t *r)
{
    creq_t *q = cimpl(r);
    uconn_t *c = q->c;
    net_upstream_t *u = c->up;
    c->req = NULL;
    /* A reset: an upload stuck behind a replica that stopped reading would otherwise sit in
     * the kernel (and the replica keep the request) until it read it all. */
    uconn_close_how(c, true);
    creq_free(u, q);
}

bool net_creq_sent(const net_creq_t *r)
{
    const uconn_t *c = ((const creq_t *)r)->c;
    return c && c->phase != UC_CONNECTING && c->phase != UC_CLOSED && !c->held && c->req_ended &&
           net_client_creq_pending(r) == 0;
}

bool net_creq_lends(const net_creq_t *r)
{
    const uconn_t *c = ((const creq_t *)r)->c;
    return c && c->nlent > 0;
}

/* ---- drains -------------------------------------------------------------------------------- */

static void drain_done(net_creq_t *r, net_up_err_t err, const char *detail)
{
    creq_t *q = cimpl(r);
    (void)detail;
    uint64_t now = uv_now(q->c->up->loop);
    uint64_t left = err != NET_UP_OK && q->ddeadline > now ? q->ddeadline - now : 0;
    DP_LIST_UNLINK(q->dset->head, q, dnext, dprev);
    q->dset = NULL;
    q->ddone(r->data, left);
}

/* Only the end matters: the head and body are read and dropped. */
static const net_creq_cb_t drain_cb = {.on_done = drain_done};

void net_creq_drain(net_creq_t *r, net_drains_t *set, uint64_t max_ms, net_drain_done_fn done,
                    void *data)
{
    creq_t *q = cimpl(r);
    uconn_t *c = q->c;
    assert(q->dset == NULL);
    q->cb = drain_cb;
    r->data = data;
    r->refuse = NULL;
    q->dset = set;
    q->ddone = done;
    q->ddeadline = uv_now(c->up->loop) + max_ms;
    DP_LIST_PUSH(set->head, q, dnext, dprev);
    net_creq_resume(r);
    /* The timer comes by the deadline (uconn_timer_in keeps it so from now on), unless a
     * failure is already on its way (uconn_defer_fail). */
    bool due_by_then =
        uv_is_active((uv_handle_t *)&c->timer) && (!c->timer_lazy || c->timer_due <= q->ddeadline);
    if (!due_by_then)
        uconn_timer_in(c, max_ms);
}

void net_drains_stop(net_drains_t *set)
{
    while (set->head) {
        creq_t *q = set->head;
        net_drain_done_fn done = q->ddone;
        void *data = q->pub.data;
        DP_LIST_UNLINK(set->head, q, dnext, dprev);
        q->dset = NULL;
        net_creq_cancel(&q->pub);
        done(data, NET_DRAIN_STOPPED);
    }
}

size_t net_client_creq_pending(const net_creq_t *r)
{
    const uconn_t *c = ((const creq_t *)r)->c;
    return c ? c->sock.queued + c->outq.len + c->lent_len : 0;
}

bool net_creq_over(const net_creq_t *r)
{
    const uconn_t *c = ((const creq_t *)r)->c;
    return c && (net_sock_over(&c->sock) || waiting_over(c));
}
