/* The HTTP/1.1 client side: a keep-alive connection pool per upstream address, and exchanges
 * (one request, one response) over it. Used for client traffic, attestation, canaries, shadow
 * copies and `detproxy diagnose`, so all of them share one set of timeouts, framing checks and
 * error classes.
 *
 * Responses go through the same validation as requests (net_head_scan, net_chunk_scan,
 * net_response_check) and llhttp in strict mode; a response that fails them ends the exchange
 * with NET_UP_PROTOCOL and its connection is never reused.
 *
 * Lifetimes: a net_creq_t lives from net_creq_start until on_done returns (or net_creq_cancel,
 * or net_creq_drain hands it over). After that the caller must drop its pointer. Callbacks never
 * fire from inside net_creq_start. */
#ifndef NET_CLIENT_H
#define NET_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "net/validate.h"

typedef struct net_upstream_s net_upstream_t;
typedef struct net_creq_s net_creq_t;

typedef struct {
    uint32_t connect_timeout_ms;
    uint32_t first_byte_timeout_ms;
    uint32_t idle_timeout_ms; /* silence mid-response, or a request's bytes not taken */
    uint32_t keepalive_ms;    /* how long a pooled connection may idle before it is closed
                               * and never reused (0: idle_timeout_ms) */
    uint32_t max_idle;        /* idle connections kept per upstream (default 1024: fewer than the
                               * requests sent to one replica at once, and a burst closes and reopens
                               * connections, each new one waiting for its identity check) */
    size_t write_high_water;  /* request bytes queued above this: net_creq_over() */
} net_upstream_opts_t;

typedef enum {
    NET_UP_OK = 0,
    NET_UP_CONNECT,            /* connect failed or timed out: nothing was sent */
    NET_UP_SEND,               /* the connection failed before the request was fully sent */
    NET_UP_REUSED_CLOSED,      /* a reused keep-alive connection closed before any response byte */
    NET_UP_CLOSED,             /* a fresh connection closed after the request, before a response */
    NET_UP_FIRST_BYTE_TIMEOUT, /* no response within first_byte_timeout_ms */
    NET_UP_IDLE_TIMEOUT,       /* silence mid-response beyond idle_timeout_ms */
    NET_UP_PROTOCOL,           /* invalid response (framing, garbage, smuggling) */
    NET_UP_TRUNCATED,          /* closed or reset mid-body */
    NET_UP_SEND_TIMEOUT,       /* before any response byte, the upstream took none of the
                                * request's queued bytes for idle_timeout_ms */
    NET_UP__COUNT
} net_up_err_t;

const char *net_up_err_name(net_up_err_t e);
/* The retry rule (docs/requests.md §2, "Retries"): only when nothing of the response was seen and
 * either the request never fully left, or a reused connection raced its keep-alive close. */
bool net_up_err_retryable(net_up_err_t e);
/* May the replica have begun the request, and be generating it still, when an exchange ended
 * so? Once the whole request was taken and no whole answer came: closed, cut, unreadable or
 * silent. Not when the request never left whole (a server reads it whole before it acts). */
bool net_up_err_may_run(net_up_err_t e);

typedef struct {
    /* Response head; headers valid only during the call. `f` gives the body framing. */
    void (*on_head)(net_creq_t *r, int status, const net_header_t *h, size_t n,
                    const net_framing_t *f);
    /* Decoded body bytes; valid only during the call. */
    void (*on_body)(net_creq_t *r, const char *p, size_t n);
    /* The exchange ended. NET_UP_OK: the whole response was received. r is freed after. */
    void (*on_done)(net_creq_t *r, net_up_err_t err, const char *detail);
    /* Request bytes queued toward the upstream fell below the low-water mark. */
    void (*on_drain)(net_creq_t *r);
    /* Optional. When set and the exchange opens a new connection, the connection is held once
     * established: nothing is sent (request bytes wait) until net_creq_release, and this is
     * called (it may release or cancel r at once). A pooled connection is never held. */
    void (*on_connected)(net_creq_t *r);
    /* The bytes given to net_creq_start stay where they are until the exchange ends (on_done
     * or net_creq_cancel): a new connection then sends them from there once established,
     * instead of holding a copy while it connects. Bytes of net_creq_write are always copied. */
    bool start_bufs_kept;
    /* Optional. The answer is late: none began within first_byte_timeout_ms
     * (NET_UP_FIRST_BYTE_TIMEOUT), or it fell silent mid-way (NET_UP_IDLE_TIMEOUT): in its body
     * for idle_timeout_ms, or in a head begun before first_byte_timeout_ms passed (part of a
     * status line, an interim 103). err and detail are what the exchange ends with. The
     * callback may keep the exchange by making it a drain (net_creq_drain); otherwise it ends
     * with them as without the callback. It may not cancel r. */
    void (*on_timeout)(net_creq_t *r, net_up_err_t err, const char *detail);
} net_creq_cb_t;

struct net_creq_s {
    void *data;            /* the caller's */
    bool response_started; /* a response byte arrived */
    bool reused;           /* the connection came from the idle pool */
    /* Set by on_head to refuse the response it was shown (static text saying why): the exchange
     * ends as NET_UP_PROTOCOL with that detail, and no byte of the body is read. */
    const char *refuse;
    /* Set by the caller after net_creq_start when an answer whose end is its connection's close
     * must not be taken as whole: a close after part of it cannot be told from its end, and
     * the engine may be generating on (docs/configuration.md, "Deterministic pools"). Such an
     * answer is refused on its head, NET_UP_PROTOCOL, before on_head. */
    bool length_required;
};

net_upstream_t *net_upstream_new(uv_loop_t *loop, const struct sockaddr *addr,
                                 const net_upstream_opts_t *opts);
void net_upstream_set_opts(net_upstream_t *u, const net_upstream_opts_t *opts);
/* Speak TLS to this upstream: verify its certificate for server_name (SNI unless an IP
 * literal). A reference on ctx is taken; NULL turns TLS off. */
struct net_tls_ctx_s;
void net_upstream_set_tls(net_upstream_t *u, struct net_tls_ctx_s *ctx, const char *server_name);
/* Release: idle connections close now; exchanges in flight finish normally, then it is freed. */
void net_upstream_free(net_upstream_t *u);
size_t net_client_upstream_idle(const net_upstream_t *u);
/* Will the next net_creq_start go over a pooled connection? Pooled connections idle for
 * keepalive_ms or longer are closed first (never reused: an engine closes its idle keep-alive
 * connections on its own timer, and a request sent as it does is lost in the race). Decided
 * with the loop's time, so a net_creq_start in the same callback takes the one it found. */
bool net_upstream_take_ready(net_upstream_t *u);
/* Close pooled idle connections (e.g. after the replica failed attestation). */
void net_upstream_flush_idle(net_upstream_t *u);
/* Call cb(data) whenever the server closes (or resets) one of u's pooled idle connections:
 * the server went away or restarted, or its keep-alive timeout ran out; the two look alike
 * from here. Exchanges that fail report their own error through on_done. NULL: no call. */
void net_upstream_on_idle_close(net_upstream_t *u, void (*cb)(void *data), void *data);

/* Start an exchange: bufs hold the request head (and body, if any) ready to send. With
 * body_follows the caller streams the rest with net_creq_write and ends with net_creq_end.
 * head_request: the request method is HEAD (the response has no body). Never NULL. */
net_creq_t *net_creq_start(net_upstream_t *u, const uv_buf_t *bufs, unsigned nbufs,
                           bool body_follows, bool head_request, const net_creq_cb_t *cb,
                           void *data);
/* As net_creq_start, over a new connection even when one is pooled: for a request resent after
 * a pooled connection failed under it, as the others pooled beside it may be as stale. */
net_creq_t *net_creq_start_new(net_upstream_t *u, const uv_buf_t *bufs, unsigned nbufs,
                               bool body_follows, bool head_request, const net_creq_cb_t *cb,
                               void *data);
int net_creq_write(net_creq_t *r, const uv_buf_t *bufs, unsigned nbufs);
void net_creq_end(net_creq_t *r);
/* Response backpressure: stop / restart reading (the idle timeout is suspended meanwhile). */
/* The whole answer within ms from now, however it trickles: the first-byte and idle timeouts
 * bound silence, not a replica that sends a byte now and then. Past it the exchange is late as
 * a silent one is (on_timeout, then NET_UP_FIRST_BYTE_TIMEOUT or NET_UP_IDLE_TIMEOUT, or
 * NET_UP_CONNECT while it connects), with "answer not whole within N ms". A drain made of r
 * keeps its own deadline instead. Right after net_creq_start. */
void net_creq_set_deadline(net_creq_t *r, uint32_t ms);
void net_creq_pause(net_creq_t *r);
void net_creq_resume(net_creq_t *r);
/* Abort: close the connection at once, no further callbacks. */
void net_creq_cancel(net_creq_t *r);
/* Send what a held exchange (net_creq_cb_t.on_connected) has waiting, and what follows; a no-op
 * for one not held. A failure is reported through on_done, from the loop. */
void net_creq_release(net_creq_t *r);
size_t net_client_creq_pending(const net_creq_t *r);
/* Every byte of the request has left: none waits for the connect, a release or the socket, and
 * the caller ended it. The upstream may be working on it. */
bool net_creq_sent(const net_creq_t *r);
/* The exchange still means to send the caller's start bytes from where they lie
 * (start_bufs_kept): they must stay put until it no longer does. */
bool net_creq_lends(const net_creq_t *r);
bool net_creq_over(const net_creq_t *r);

/* Drains. An exchange whose owner has gone may still be at work upstream: an engine that
 * finishes an answer whose connection closed (llama.cpp), on a pool that lets it run one
 * sequence at a time, must be sent nothing more until it has. A drain reads the rest of the
 * answer and drops it, and calls back once when the exchange is over, however it ended: what
 * the owner held for it (a slot) is released there. Its owner keeps its drains in a set, to end
 * them all when it stops. A set belongs to its loop's thread, as the exchanges in it do. */
typedef struct net_drains_s {
    struct net_creq_impl_s *head;
} net_drains_t;

/* How a drain ended: left_ms 0 when its answer ended whole or it ran to its limit,
 * NET_DRAIN_STOPPED when net_drains_stop ended it; else it failed (the server closed or cut it,
 * or it went silent) with left_ms of its limit unused, and what generated the answer may be at
 * work still. */
typedef void (*net_drain_done_fn)(void *data, uint64_t left_ms);
#define NET_DRAIN_STOPPED UINT64_MAX

/* Make r a drain in set: what follows of its answer is read and dropped (reading resumed if
 * it was paused), and done(data, left_ms) runs exactly once, when the exchange ends or
 * net_drains_stop ends it. It ends max_ms from now at the latest (its connection closed then):
 * neither its first-byte timeout nor silence mid-answer ends it before that (an answer late
 * rather than lost, or a long prefill behind an early head), and the deadline ends an answer
 * that never ends (a stream). Allowed from on_timeout and on_head (an answer its owner will
 * not take, read to its end all the same). The caller drops r. */
void net_creq_drain(net_creq_t *r, net_drains_t *set, uint64_t max_ms, net_drain_done_fn done,
                    void *data);
/* End every drain in set now (their connections are closed), calling each one's done with
 * NET_DRAIN_STOPPED. */
void net_drains_stop(net_drains_t *set);

#endif
