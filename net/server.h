/* The HTTP/1.1 server side shared by the proxy listener, the admin listener, the attestation
 * agent and detproxy-sim: accept, parse (llhttp strict + our own head validation), keep-alive,
 * pipelining strictly in order, timeouts, limits, and a response writer that frames bodies
 * (Content-Length, chunked, or close-delimited for HTTP/1.0) and applies backpressure.
 *
 * What a handler sees: one px_req_t at a time per connection. Pipelined requests behind it stay
 * unparsed in the connection's buffer until the current response ends (px_resp_end), so they
 * are answered in order by construction.
 *
 * Lifetimes: a px_req_t lives from on_head until the later of (a) px_resp_end / px_resp_abort
 * and (b) the request body being fully read. If the client goes away first, on_abort is called
 * once and the request is freed right after it returns: the handler must drop every pointer to
 * it inside on_abort (cancel timers, detach upstreams). on_abort always comes from the loop
 * (the connection's close callback), never from inside a px_resp_* call; between the failure
 * and on_abort, px_resp_* calls return -1. After px_resp_end or px_resp_abort the handler must
 * not touch req again. */
#ifndef PX_HTTP_SERVER_H
#define PX_HTTP_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/buf.h"
#include "net/validate.h"

typedef struct px_server_s px_server_t;
typedef struct px_conn_s px_conn_t;
typedef struct px_req_s px_req_t;

typedef enum {
    PX_BODY_BUFFER = 0, /* collect the whole body in req->body (bounded by max_body_bytes) */
    PX_BODY_STREAM = 1, /* hand each decoded piece to on_body as it is read */
} px_body_mode_t;

struct px_req_s {
    px_conn_t *conn;
    px_server_t *server;
    void *data; /* the handler's per-request state */

    int method; /* llhttp_method_t */
    dp_iovec_t method_name;
    dp_iovec_t target; /* raw request-target, origin-form */
    dp_iovec_t path;   /* target up to '?' */
    dp_iovec_t query;  /* after '?', empty when none */
    uint8_t http_major, http_minor;
    px_header_t *headers; /* names as received; compare with dp_strieq */
    size_t nheaders;
    bool has_body;          /* Content-Length > 0 or chunked */
    bool chunked;           /* request body used chunked framing */
    int64_t content_length; /* -1 when chunked or absent */
    dp_buf_t body;          /* PX_BODY_BUFFER: the decoded body once on_complete runs */
    uint64_t start_ns;      /* when the first byte of this request was read */
    char remote[48];        /* client address, "ip:port" */
    char id[24];            /* request id: 16 hex of random, unique per process */
};

typedef struct {
    /* Head received and validated. Return the body mode. The handler may also answer at once
     * (px_resp_*); the server then discards the body, closing the connection if it is not
     * already fully read. */
    px_body_mode_t (*on_head)(px_req_t *req);
    /* PX_BODY_STREAM only: decoded body bytes; valid only during the call. */
    void (*on_body)(px_req_t *req, const char *p, size_t n);
    /* The request (and its body) is complete. */
    void (*on_complete)(px_req_t *req);
    /* The client went away, or the server failed the request, before px_resp_end. */
    void (*on_abort)(px_req_t *req);
    /* The response's write queue fell below the low-water mark after being above it. */
    void (*on_drain)(px_req_t *req);
    /* Optional: the server itself is answering with `status` (`code`: headers_too_large,
     * body_too_large, timeout, bad_request) and closing. req is the handler's request when it
     * owns one (on_abort follows), else NULL (the head never got that far). For counting. */
    void (*on_reject)(px_server_t *s, px_req_t *req, int status, const char *code);
} px_handler_t;

typedef struct {
    uint32_t max_header_bytes;
    uint32_t max_headers;
    uint64_t max_body_bytes;
    uint32_t max_connections; /* beyond it, new connections are accepted and closed at once */
    uint32_t client_header_timeout_ms;
    uint32_t client_idle_timeout_ms;
    size_t write_high_water; /* px_resp_pending above this: stop producing (default 256 KiB) */
    /* Bytes of PX_BODY_BUFFER bodies held across all connections (0: no bound). A request
     * whose body would exceed it is answered 503 `overloaded`; admitted ones keep their share
     * until they end. A Content-Length body reserves its whole length when its head is read. */
    uint64_t max_inflight_body_bytes;
    uint32_t client_body_timeout_ms; /* the whole read of a PX_BODY_BUFFER body (0: none) */
    /* TLS connections still in their handshake (0: no bound). Each holds ~47 KB of OpenSSL
     * state; beyond the bound the oldest pending one is closed to make room, so stalled
     * handshakes cannot crowd out clients that complete theirs in a round trip. */
    uint32_t max_pending_handshakes;
} px_server_limits_t;

void px_server_limits_default(px_server_limits_t *l);

px_server_t *px_server_new(uv_loop_t *loop, const px_handler_t *h, void *data,
                           const px_server_limits_t *limits);
/* Bind and listen. host is numeric IPv4/IPv6. Returns 0 or a negative libuv error. */
int px_server_listen(px_server_t *s, const char *host, uint16_t port);
/* The bound port (useful with port 0). */
uint16_t px_server_port(const px_server_t *s);
/* The address it listens on (NULL before px_server_listen succeeded). */
const struct sockaddr *px_server_bound(const px_server_t *s);
void *px_server_data(const px_server_t *s);
uv_loop_t *px_server_loop(const px_server_t *s);
void px_server_set_limits(px_server_t *s, const px_server_limits_t *limits);
/* Serve TLS with ctx (a reference is taken; NULL: plaintext). New connections use the context
 * set at their accept, so a certificate reload never disturbs open ones. */
struct px_tls_ctx_s;
void px_server_set_tls(px_server_t *s, struct px_tls_ctx_s *ctx);
/* Graceful drain: stop accepting, close idle connections now and others after their current
 * response. done_cb runs once no connection is left. */
void px_server_drain(px_server_t *s, void (*done_cb)(px_server_t *s));
/* Close everything now (in-flight requests get on_abort) and free the server once every handle
 * has closed; done_cb (may be NULL) runs after. */
void px_server_close(px_server_t *s, void (*done_cb)(void *data), void *data);
/* Connections open / requests being handled right now. */
size_t px_server_connections(const px_server_t *s);
/* Connections accepted since start. */
uint64_t px_server_accepted(const px_server_t *s);
size_t px_server_inflight(const px_server_t *s);
/* Tell cb whenever the server itself refuses a request 503 (reason: "body_budget"). */
void px_server_on_overload(px_server_t *s, void (*cb)(const char *reason));
/* Bytes of buffered request bodies reserved right now (max_inflight_body_bytes). */
uint64_t px_server_body_bytes(const px_server_t *s);
/* The handler keeps the request's body past the request (a worker thread still reads it after
 * the client left): the request's share of the body budget moves to the caller, who gives it
 * back with px_server_return_body_budget once the body is freed. Returns the bytes taken. */
uint64_t px_req_take_body_budget(px_req_t *req);
void px_server_return_body_budget(px_server_t *s, uint64_t bytes);

/* Case-insensitive header look-up; the first match or NULL. Count of matches in *count if set. */
const px_header_t *px_req_header(const px_req_t *req, const char *name);

/* The raw (undecoded) value of query parameter `name` ("a=1&b=2"): true and *out set when
 * present. */
bool px_req_query(const px_req_t *req, const char *name, dp_iovec_t *out);

/* PX_BODY_STREAM backpressure: stop / restart reading the client's body. */
void px_req_pause_body(px_req_t *req);
void px_req_resume_body(px_req_t *req);

/* ---- responses ------------------------------------------------------------------------------
 * content_length >= 0: exactly that many body bytes follow. -1: unknown length, sent chunked to
 * HTTP/1.1 clients and close-delimited to HTTP/1.0 clients. HEAD responses carry no body.
 * The server adds Date, Content-Length or Transfer-Encoding, and Connection. Handlers must not
 * pass hop-by-hop headers. All functions return 0, or -1 when the connection is already gone
 * (on_abort has been or is about to be called). */
int px_resp_start(px_req_t *req, int status, const px_header_t *hdrs, size_t nhdrs,
                  int64_t content_length);
int px_resp_write(px_req_t *req, const char *p, size_t n);
int px_resp_end(px_req_t *req);
/* Give up mid-response: close the connection without completing the framing, so the client
 * sees an error rather than a clean truncated success. on_abort is not called. */
void px_resp_abort(px_req_t *req);
/* Test simulators only: write raw bytes (no framing, no head) and close the connection after
 * they are flushed. For injecting broken responses; never used by the proxy. */
int px_resp_raw_and_close(px_req_t *req, const char *p, size_t n);
/* Bytes accepted by px_resp_write but not yet handed to the kernel. */
size_t px_resp_pending(const px_req_t *req);
bool px_resp_started(const px_req_t *req);
/* Whole response in one call. */
int px_resp_send(px_req_t *req, int status, const char *content_type, const char *body, size_t n,
                 const px_header_t *extra, size_t nextra);
/* An OpenAI-shaped error: {"error":{"message","type","param","code"}}. param/code may be NULL. */
int px_resp_error(px_req_t *req, int status, const char *type, const char *code, const char *param,
                  const char *message, const px_header_t *extra, size_t nextra);

/* Format the OpenAI error body into out (shared with code that sends errors by other means). */
void px_error_body(dp_buf_t *out, const char *type, const char *code, const char *param,
                   const char *message);
/* "invalid_request_error", "server_error", ... for a status. */
const char *px_error_type_for_status(int status);

#endif
