/* The HTTP/1.1 server side shared by the proxy listener, the admin listener, the attestation
 * agent and detproxy-sim: accept, parse (llhttp strict + our own head validation), keep-alive,
 * pipelining strictly in order, timeouts, limits, and a response writer that frames bodies
 * (Content-Length, chunked, or close-delimited for HTTP/1.0) and applies backpressure.
 *
 * What a handler sees: one net_req_t at a time per connection. Pipelined requests behind it stay
 * unparsed in the connection's buffer until the current response ends (net_resp_end), so they
 * are answered in order by construction.
 *
 * Lifetimes: a net_req_t lives from on_head until the later of (a) net_resp_end / net_resp_abort
 * and (b) the request body being fully read. If the client goes away first, on_abort is called
 * once and the request is freed right after it returns: the handler must drop every pointer to
 * it inside on_abort (cancel timers, detach upstreams). on_abort always comes from the loop
 * (the connection's close callback), never from inside a net_resp_* call; between the failure
 * and on_abort, net_resp_* calls return -1. After net_resp_end or net_resp_abort the handler must
 * not touch req again. */
#ifndef NET_SERVER_H
#define NET_SERVER_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/buf.h"
#include "net/validate.h"

typedef struct net_server_s net_server_t;
typedef struct net_conn_s net_conn_t;
typedef struct net_req_s net_req_t;

typedef enum {
    NET_BODY_BUFFER = 0, /* collect the whole body in req->body (bounded by max_body_bytes) */
    NET_BODY_STREAM = 1, /* hand each decoded piece to on_body as it is read */
    /* Answered, or to be answered, without it (a refusal from the head that waits for its
     * audit line): the body is read and dropped, with no size limit, budget, body timeout or
     * 100 Continue, so nothing but a broken framing or an idle client changes the answer;
     * neither on_body nor on_complete is called. */
    NET_BODY_DISCARD = 2,
} net_body_mode_t;

struct net_req_s {
    net_conn_t *conn;
    net_server_t *server;
    void *data; /* the handler's per-request state */

    int method; /* llhttp_method_t */
    dp_iovec_t method_name;
    dp_iovec_t target; /* raw request-target, origin-form */
    dp_iovec_t path;   /* target up to '?' */
    dp_iovec_t query;  /* after '?', empty when none */
    uint8_t http_major, http_minor;
    net_header_t *headers; /* names as received; compare with dp_strieq */
    size_t nheaders;
    bool has_body;          /* Content-Length > 0 or chunked */
    bool chunked;           /* request body used chunked framing */
    int64_t content_length; /* -1 when chunked or absent */
    dp_buf_t body;          /* NET_BODY_BUFFER: the decoded body once on_complete runs */
    uint64_t start_ns;      /* when the first byte of this request was read */
    char remote[48];        /* client address, "ip:port" */
    char id[24];            /* request id: 16 hex of random, unique per process */
};

typedef struct {
    /* Head received and validated. Return the body mode. The handler may also answer at once
     * (net_resp_*); the server then discards the body, closing the connection if it is not
     * already fully read. */
    net_body_mode_t (*on_head)(net_req_t *req);
    /* NET_BODY_STREAM only: decoded body bytes; valid only during the call. */
    void (*on_body)(net_req_t *req, const char *p, size_t n);
    /* The request (and its body) is complete; not called for NET_BODY_DISCARD. */
    void (*on_complete)(net_req_t *req);
    /* The client went away, or the server failed the request, before net_resp_end. */
    void (*on_abort)(net_req_t *req);
    /* The response's write queue fell below the low-water mark after being above it. */
    void (*on_drain)(net_req_t *req);
    /* Optional: the server itself is answering with `status` (`code`: headers_too_large,
     * body_too_large, timeout, bad_request) and closing. req is the handler's request when it
     * owns one (on_abort follows), else NULL (the head never got that far). For counting. */
    void (*on_reject)(net_server_t *s, net_req_t *req, int status, const char *code);
} net_handler_t;

typedef struct {
    uint32_t max_header_bytes;
    uint32_t max_headers;
    uint64_t max_body_bytes;
    uint32_t max_connections; /* beyond it, new connections are accepted and closed at once */
    /* Open connections from one client address (IPv4 address, IPv6 /64; 0: no bound). Beyond
     * it, that address's new connections are accepted and closed at once, so one host cannot
     * take every slot of max_connections. */
    uint32_t max_connections_per_client;
    uint32_t client_header_timeout_ms;
    uint32_t client_idle_timeout_ms;
    size_t write_high_water; /* net_resp_pending above this: stop producing (default 256 KiB) */
    /* Bytes of NET_BODY_BUFFER bodies held across all connections (0: no bound). A body
     * reserves what has arrived (in steps of 16 KiB, never past its Content-Length), not what
     * it declares. When a body cannot grow, bodies still being read are shed to make room
     * (those of client addresses over their fair share first, then the slowest; see
     * docs/configuration.md, "limits"); when nothing can be, it is answered 503 `overloaded`.
     * Admitted bodies keep their share until their response ends. */
    uint64_t max_inflight_body_bytes;
    uint32_t client_body_timeout_ms; /* the whole read of a NET_BODY_BUFFER body (0: none) */
    /* TLS connections still in their handshake (0: no bound). Each holds ~47 KB of OpenSSL
     * state; beyond the bound the oldest pending one is closed to make room, so stalled
     * handshakes cannot crowd out clients that complete theirs in a round trip. */
    uint32_t max_pending_handshakes;
} net_server_limits_t;

void net_server_limits_default(net_server_limits_t *l);

net_server_t *net_server_new(uv_loop_t *loop, const net_handler_t *h, void *data,
                             const net_server_limits_t *limits);
/* Servers on several loop threads serving one listen address: max_connections and
 * max_inflight_body_bytes hold for them together (zero-initialise it, outlive them). */
#define NET_BUDGET_BUCKETS 1024
typedef struct net_server_shared_s {
    atomic_size_t conns;
    _Atomic uint64_t body_bytes; /* read without the lock; written under it */
    /* The body budget's books, private to net/server.c, under `lock` (a spin lock: held for
     * a few loads and stores, or one walk over the bodies being read when the budget is full). */
    atomic_bool lock;
    uint64_t shedding;               /* reservations of bodies marked to be shed */
    size_t naddrs;                   /* client addresses holding some of the budget */
    size_t nwaiting;                 /* bodies waiting for room, over every server */
    uint64_t promised;               /* room held back for them */
    struct net_budget_hold_s *holds; /* bodies being read, on every server of the group */
    struct net_server_s *servers;    /* the group, to wake a server whose bodies wait */
    struct net_budget_addr_s *addrs[NET_BUDGET_BUCKETS]; /* per client address (IPv6: /64) */
} net_server_shared_t;
void net_server_share(net_server_t *s, net_server_shared_t *shared);
/* net_server_return_body_budget for budget taken from servers sharing `shared`: valid after
 * the server it came from is gone. */
void net_server_shared_return_body_budget(net_server_shared_t *shared, uint64_t bytes);
/* Bind and listen. host is numeric IPv4/IPv6. Returns 0 or a negative libuv error. */
int net_server_listen(net_server_t *s, const char *host, uint16_t port);
/* The same with SO_REUSEPORT (Linux): several servers, one per loop thread, bind the same
 * address and the kernel spreads new connections across them. UV_ENOTSUP when the kernel
 * refuses the option. */
int net_server_listen_opts(net_server_t *s, const char *host, uint16_t port, bool reuseport);
/* The bound port (useful with port 0). */
uint16_t net_server_port(const net_server_t *s);
/* The address it listens on (NULL before net_server_listen succeeded). */
const struct sockaddr *net_server_bound(const net_server_t *s);
void *net_server_data(const net_server_t *s);
uv_loop_t *net_server_loop(const net_server_t *s);
void net_server_set_limits(net_server_t *s, const net_server_limits_t *limits);
/* Serve TLS with ctx (a reference is taken; NULL: plaintext). New connections use the context
 * set at their accept, so a certificate reload never disturbs open ones. */
struct net_tls_ctx_s;
void net_server_set_tls(net_server_t *s, struct net_tls_ctx_s *ctx);
/* Graceful drain: stop accepting, close idle connections now and others after their current
 * response. done_cb runs once no connection is left. */
void net_server_drain(net_server_t *s, void (*done_cb)(net_server_t *s));
/* Close everything now (in-flight requests get on_abort) and free the server once every handle
 * has closed; done_cb (may be NULL) runs after. */
void net_server_close(net_server_t *s, void (*done_cb)(void *data), void *data);
/* Connections open / requests being handled right now. */
size_t net_server_connections(const net_server_t *s);
/* Connections accepted since start. */
uint64_t net_server_accepted(const net_server_t *s);
size_t net_server_inflight(const net_server_t *s);
/* Tell cb whenever the server itself refuses a request 503 (reason "body_budget": no room
 * in max_inflight_body_bytes) or sheds a body being read to make room (reason "body_shed",
 * answered 408 or 503). */
void net_server_on_overload(net_server_t *s, void (*cb)(const char *reason));
/* Bytes of buffered request bodies reserved right now (max_inflight_body_bytes). */
uint64_t net_server_body_bytes(const net_server_t *s);
/* First reads of a request taken at a head's length, so that a long body after it is read
 * straight into its own buffer (since start). */
uint64_t net_server_head_reads(const net_server_t *s);
/* The handler keeps the request's body past the request (a worker thread still reads it after
 * the client left): the request's share of the body budget moves to the caller, who gives it
 * back with net_server_return_body_budget once the body is freed. Returns the bytes taken.
 * From here the bytes count in the budget but no longer in the client address's share. */
uint64_t net_req_take_body_budget(net_req_t *req);
void net_server_return_body_budget(net_server_t *s, uint64_t bytes);

/* Case-insensitive header look-up; the first match or NULL. Count of matches in *count if set. */
const net_header_t *net_req_header(const net_req_t *req, const char *name);

/* The value of query parameter `name` ("a=1&b=2"), percent-decoded ('+' read as a space, as
 * forms encode it) into out, which is reset first and NUL-terminated: 1 when present ("b" with
 * no '=' is present and empty, as WHATWG's URLSearchParams reads it), 0 when absent, -1 when
 * an escape is malformed or is %00. out may hold memory in every case. */
int net_req_query(const net_req_t *req, const char *name, dp_buf_t *out);

/* The handler will not read req->body again (its answer streams, and nothing resends or stores
 * the bytes): the buffer goes, and its share of the body budget (docs/configuration.md,
 * max_inflight_body_bytes) is given back now rather than when the answer ends, which for a
 * streamed answer may be minutes later. req->body is empty after. A no-op while the body is
 * still being read. */
void net_req_drop_body(net_req_t *req);

/* NET_BODY_STREAM backpressure: stop / restart reading the client's body. */
void net_req_pause_body(net_req_t *req);
void net_req_resume_body(net_req_t *req);

/* ---- responses ------------------------------------------------------------------------------
 * content_length >= 0: exactly that many body bytes follow. -1: unknown length, sent chunked to
 * HTTP/1.1 clients and close-delimited to HTTP/1.0 clients. HEAD responses carry no body.
 * The server adds Date, Content-Length or Transfer-Encoding, and Connection. Handlers must not
 * pass hop-by-hop headers. All functions return 0, or -1 when the connection is already gone
 * (on_abort has been or is about to be called). */
/* Does an answer with this status to req carry no body, whatever its headers say (a HEAD
 * request's, a 1xx, 204 or 304: RFC 9110 §6.4.1)? */
bool net_resp_bodiless(const net_req_t *req, int status);
int net_resp_start(net_req_t *req, int status, const net_header_t *hdrs, size_t nhdrs,
                   int64_t content_length);
int net_resp_write(net_req_t *req, const char *p, size_t n);
int net_resp_end(net_req_t *req);
/* Give up mid-response: close the connection without completing the framing, so the client
 * sees an error rather than a clean truncated success. A head not yet written goes out first.
 * on_abort is not called. */
void net_resp_abort(net_req_t *req);
/* Take back a response whose head has not been written yet (net_resp_start waits for the first
 * body bytes or the end of the loop pass): true, and another response may be started; false
 * once a byte of it went to the socket. */
bool net_resp_unstart(net_req_t *req);
/* Test simulators only: write raw bytes (no framing, no head) and close the connection after
 * they are flushed. For injecting broken responses; never used by the proxy. */
int net_resp_raw_and_close(net_req_t *req, const char *p, size_t n);
/* Bytes accepted by net_resp_write but not yet handed to the kernel. */
size_t net_resp_pending(const net_req_t *req);
bool net_server_resp_started(const net_req_t *req);
/* Whole response in one call. */
int net_resp_send(net_req_t *req, int status, const char *content_type, const char *body, size_t n,
                  const net_header_t *extra, size_t nextra);
/* An OpenAI-shaped error: {"error":{"message","type","param","code"}}. param/code may be NULL. */
int net_resp_error(net_req_t *req, int status, const char *type, const char *code,
                   const char *param, const char *message, const net_header_t *extra,
                   size_t nextra);

/* 405 for a method the route does not take, with the Allow header (RFC 9110 §15.5.6) naming
 * what it takes, e.g. "GET, HEAD". */
int net_resp_method_not_allowed(net_req_t *req, const char *allow);

/* Format the OpenAI error body into out (shared with code that sends errors by other means). */
void net_error_body(dp_buf_t *out, const char *type, const char *code, const char *param,
                    const char *message);
/* "invalid_request_error", "server_error", ... for a status. */
const char *net_error_type_for_status(int status);

#endif
