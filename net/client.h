/* The HTTP/1.1 client side: a keep-alive connection pool per upstream address, and exchanges
 * (one request, one response) over it. Used for client traffic, attestation, canaries, shadow
 * copies and `detproxy diagnose`, so all of them share one set of timeouts, framing checks and
 * error classes.
 *
 * Responses go through the same validation as requests (px_head_scan, px_chunk_scan,
 * px_response_check) and llhttp in strict mode; a response that fails them ends the exchange
 * with PX_UP_PROTOCOL and its connection is never reused.
 *
 * Lifetimes: a px_creq_t lives from px_creq_start until on_done returns (or px_creq_cancel).
 * After that the caller must drop its pointer. Callbacks never fire from inside px_creq_start. */
#ifndef PX_HTTP_CLIENT_H
#define PX_HTTP_CLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "net/validate.h"

typedef struct px_upstream_s px_upstream_t;
typedef struct px_creq_s px_creq_t;

typedef struct {
    uint32_t connect_timeout_ms;
    uint32_t first_byte_timeout_ms;
    uint32_t idle_timeout_ms; /* silence mid-response; also how long a pooled connection idles */
    uint32_t max_idle;        /* idle connections kept per upstream (default 64) */
    size_t write_high_water;  /* request bytes queued above this: px_creq_over() */
} px_upstream_opts_t;

typedef enum {
    PX_UP_OK = 0,
    PX_UP_CONNECT,            /* connect failed or timed out: nothing was sent */
    PX_UP_SEND,               /* the connection failed before the request was fully sent */
    PX_UP_REUSED_CLOSED,      /* a reused keep-alive connection closed before any response byte */
    PX_UP_CLOSED,             /* a fresh connection closed after the request, before a response */
    PX_UP_FIRST_BYTE_TIMEOUT, /* no response within first_byte_timeout_ms */
    PX_UP_IDLE_TIMEOUT,       /* silence mid-response beyond idle_timeout_ms */
    PX_UP_PROTOCOL,           /* invalid response (framing, garbage, smuggling) */
    PX_UP_TRUNCATED,          /* closed or reset mid-body */
    PX_UP__COUNT
} px_up_err_t;

const char *px_up_err_name(px_up_err_t e);
/* SPEC §7's retry rule: only when nothing of the response was seen and either the request
 * never fully left, or a reused connection raced its keep-alive close. */
bool px_up_err_retryable(px_up_err_t e);

typedef struct {
    /* Response head; headers valid only during the call. `f` gives the body framing. */
    void (*on_head)(px_creq_t *r, int status, const px_header_t *h, size_t n,
                    const px_framing_t *f);
    /* Decoded body bytes; valid only during the call. */
    void (*on_body)(px_creq_t *r, const char *p, size_t n);
    /* The exchange ended. PX_UP_OK: the whole response was received. r is freed after. */
    void (*on_done)(px_creq_t *r, px_up_err_t err, const char *detail);
    /* Request bytes queued toward the upstream fell below the low-water mark. */
    void (*on_drain)(px_creq_t *r);
} px_creq_cb_t;

struct px_creq_s {
    void *data;               /* the caller's */
    bool response_started;    /* a response byte arrived */
    bool reused;              /* the connection came from the idle pool */
    uint64_t start_ns;        /* px_creq_start time */
    uint64_t first_byte_ns;   /* first response byte time (0 before) */
};

px_upstream_t *px_upstream_new(uv_loop_t *loop, const struct sockaddr *addr,
                               const px_upstream_opts_t *opts);
void px_upstream_set_opts(px_upstream_t *u, const px_upstream_opts_t *opts);
/* Speak TLS to this upstream: verify its certificate for server_name (SNI unless an IP
 * literal). A reference on ctx is taken; NULL turns TLS off. */
struct px_tls_ctx_s;
void px_upstream_set_tls(px_upstream_t *u, struct px_tls_ctx_s *ctx, const char *server_name);
/* Release: idle connections close now; exchanges in flight finish normally, then it is freed. */
void px_upstream_free(px_upstream_t *u);
size_t px_upstream_idle(const px_upstream_t *u);
/* Close pooled idle connections (e.g. after the replica failed attestation). */
void px_upstream_flush_idle(px_upstream_t *u);

/* Start an exchange: bufs hold the request head (and body, if any) ready to send. With
 * body_follows the caller streams the rest with px_creq_write and ends with px_creq_end.
 * head_request: the request method is HEAD (the response has no body). Never NULL. */
px_creq_t *px_creq_start(px_upstream_t *u, const uv_buf_t *bufs, unsigned nbufs,
                         bool body_follows, bool head_request, const px_creq_cb_t *cb,
                         void *data);
int px_creq_write(px_creq_t *r, const uv_buf_t *bufs, unsigned nbufs);
void px_creq_end(px_creq_t *r);
/* Response backpressure: stop / restart reading (the idle timeout is suspended meanwhile). */
void px_creq_pause(px_creq_t *r);
void px_creq_resume(px_creq_t *r);
/* Abort: close the connection at once, no further callbacks. */
void px_creq_cancel(px_creq_t *r);
size_t px_creq_pending(const px_creq_t *r);
bool px_creq_over(const px_creq_t *r);

#endif
