/* net/server over loopback, driven by raw client sockets: keep-alive, body framings both ways,
 * pipelining in order, the limits and their statuses, the timeouts, body pause/resume, response
 * backpressure against a slow reader, and the handler's lifetimes (on_abort, early answers). */
#define _GNU_SOURCE /* memmem */
#include "net_harness.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "net/server.h"

static net_server_t *g_srv;
static bool g_srv_closed;
static int g_heads, g_completes, g_aborts, g_drains, g_rejects, g_reject_status;
static const char *g_reject_code;
static net_body_mode_t g_mode = NET_BODY_BUFFER;
static bool g_pause_in_head;
static net_req_t *g_req; /* the request a test answers itself (/hold, /slow, /big) */
static dp_buf_t g_streamed;
static int64_t g_content_length;
static bool g_chunked;
static size_t g_body_cap; /* the buffered body's capacity when its request completed */
static char g_path[256];
static dp_buf_t g_query_b;
static bool g_has_query_b;
static int g_query_c; /* net_req_query's answer for "c" */
static char g_hdr_value[64];

/* /big: a response far larger than the socket buffers, written while under high water. */
#define BIG (16u << 20)
static size_t g_big_written;
/* /many: a response written whole at once in many small writes, most of it left queued (so
 * the queue falls a few KiB at a time as the client reads). */
#define MANY (8u << 20)
static bool g_big_stalled;

static bool is(const net_req_t *r, const char *path)
{
    return r->path.len == strlen(path) && memcmp(r->path.base, path, r->path.len) == 0;
}

static void big_pump(net_req_t *r)
{
    static char chunk[65536];
    memset(chunk, 'x', sizeof(chunk));
    while (g_big_written < BIG) {
        if (net_resp_pending(r) > 64 * 1024) {
            g_big_stalled = true;
            return;
        }
        /* No assertion per write (with --full-stats Criterion sends each one to its runner):
         * the byte count is checked instead. */
        if (net_resp_write(r, chunk, sizeof(chunk)) != 0)
            return;
        g_big_written += sizeof(chunk);
    }
    cr_assert_eq(net_resp_end(r), 0);
    g_req = NULL;
}

static net_body_mode_t h_head(net_req_t *r)
{
    g_heads++;
    g_content_length = r->content_length;
    g_chunked = r->chunked;
    snprintf(g_path, sizeof(g_path), "%.*s", (int)r->path.len, r->path.base);
    g_has_query_b = net_req_query(r, "b", &g_query_b) == 1;
    dp_buf_t c = {0};
    g_query_c = net_req_query(r, "c", &c);
    dp_buf_free(&c);
    const net_header_t *h = net_req_header(r, "x-test");
    snprintf(g_hdr_value, sizeof(g_hdr_value), "%.*s", h ? (int)h->value.len : 0,
             h ? h->value.base : "");
    if (is(r, "/early")) {
        net_resp_error(r, 403, NULL, "denied", NULL, "not you", NULL, 0);
        return NET_BODY_BUFFER;
    }
    if (is(r, "/peek"))
        g_req = r; /* the test looks at its body buffer as the body arrives */
    if (g_pause_in_head) {
        g_req = r;
        net_req_pause_body(r);
    }
    return g_mode;
}

static void h_body(net_req_t *r, const char *p, size_t n)
{
    (void)r;
    dp_buf_append(&g_streamed, p, n);
}

static void h_complete(net_req_t *r)
{
    g_completes++;
    g_body_cap = r->body.cap;
    if (is(r, "/hold") || is(r, "/slow")) {
        g_req = r;
        return;
    }
    if (is(r, "/echo")) {
        const dp_buf_t *b = g_mode == NET_BODY_BUFFER ? &r->body : &g_streamed;
        net_resp_send(r, 200, "text/plain", b->base, b->len, NULL, 0);
        return;
    }
    if (is(r, "/chunked")) {
        cr_assert_eq(net_resp_start(r, 200, NULL, 0, -1), 0);
        net_resp_write(r, "hello", 5);
        net_resp_write(r, " ", 1);
        net_resp_write(r, "world", 5);
        net_resp_end(r);
        return;
    }
    if (is(r, "/sixtyfour")) {
        static char b[65536];
        net_resp_send(r, 200, "text/plain", b, sizeof(b), NULL, 0);
        return;
    }
    if (is(r, "/many")) { /* MANY bytes in 4 KiB writes at once, whatever is pending */
        static char chunk[4096];
        memset(chunk, 'm', sizeof(chunk));
        cr_assert_eq(net_resp_start(r, 200, NULL, 0, MANY), 0);
        for (size_t i = 0; i < MANY / sizeof(chunk); i++)
            net_resp_write(r, chunk, sizeof(chunk));
        cr_assert_eq(net_resp_end(r), 0);
        return;
    }
    if (is(r, "/big")) {
        g_req = r;
        cr_assert_eq(net_resp_start(r, 200, NULL, 0, BIG), 0);
        big_pump(r);
        return;
    }
    net_resp_send(r, 200, "text/plain", r->path.base, r->path.len, NULL, 0);
}

static void h_abort(net_req_t *r)
{
    g_aborts++;
    if (g_req == r)
        g_req = NULL;
}

static void h_drain(net_req_t *r)
{
    g_drains++;
    if (g_req == r && g_big_written < BIG) {
        g_big_stalled = false;
        big_pump(r);
    }
}

static void h_reject(net_server_t *s, net_req_t *r, int status, const char *code)
{
    (void)s;
    (void)r;
    g_rejects++;
    g_reject_status = status;
    g_reject_code = code;
}

static const net_handler_t handler = {h_head, h_body, h_complete, h_abort, h_drain, h_reject};

static void srv_start(const net_server_limits_t *lim)
{
    g_srv = net_server_new(&g_loop, &handler, NULL, lim);
    cr_assert_eq(net_server_listen(g_srv, "127.0.0.1", 0), 0);
    cr_assert_neq(net_server_port(g_srv), 0);
}

static net_server_limits_t limits(void)
{
    net_server_limits_t l;
    net_server_limits_default(&l);
    return l;
}

/* A server that stops writing at 64 KiB queued, and a client c with a 16 KiB receive window
 * that reads nothing until the test starts it. */
static void slow_reader_start(raw_t *c, net_server_limits_t l)
{
    l.write_high_water = 64 * 1024;
    srv_start(&l);
    raw_connect_opt(c, net_server_port(g_srv), false, 16 * 1024);
}

static void srv_closed(void *d)
{
    (void)d;
    g_srv_closed = true;
}

static void setup(void)
{
    harness_init();
}

static void teardown(void)
{
    if (g_srv) {
        net_server_close(g_srv, srv_closed, NULL);
        RUN_UNTIL(g_srv_closed);
        g_srv = NULL;
    }
    dp_buf_free(&g_streamed);
    harness_fini();
}

TestSuite(net_server, .init = setup, .fini = teardown);

/* The raw response bytes after the head, for a response that is the only one received. */
static const char *body_of(const raw_t *r)
{
    const char *e = memmem(r->in.base, r->in.len, "\r\n\r\n", 4);
    cr_assert_not_null(e, "no response head in: %.200s", r->in.base);
    return e + 4;
}

Test(net_server, keep_alive_serves_requests_in_turn_on_one_connection)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET /a HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "\r\n\r\n/a") == 1);
    raw_sends(&c, "GET /b HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "\r\n\r\n/b") == 1);
    cr_assert_eq(raw_count(&c, "HTTP/1.1 200 OK\r\n"), 2);
    cr_assert_eq(raw_count(&c, "content-length: 2\r\n"), 2);
    cr_assert_eq(raw_count(&c, "connection: close"), 0);
    cr_assert_eq(net_server_accepted(g_srv), 1);
    cr_assert_eq(net_server_connections(g_srv), 1);
    cr_assert(!c.eof);
    raw_close(&c);
}

Test(net_server, content_length_request_body_is_buffered_whole)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\nhello");
    run_idle();
    cr_assert_eq(g_completes, 0, "completed before the body was read");
    raw_sends(&c, " world");
    RUN_UNTIL(raw_count(&c, "hello world") == 1);
    cr_assert_eq(g_content_length, 11);
    cr_assert(!g_chunked);
    cr_assert_str_eq(body_of(&c), "hello world");
    cr_assert_eq(raw_count(&c, "content-length: 11\r\n"), 1);
    raw_close(&c);
}

/* A body of known length ends in one buffer of its size (and the NUL): not one grown by
 * doubling, which copies as it fills and leaves up to half of it unused (a 256 KiB prompt
 * would take 512 KiB). But a sender that declares a length and stops gets no buffer of that
 * length: the whole-size buffer comes once a quarter of the body is in, so what is held or
 * mapped is at most 4x what was sent (which the body budget bounds). */
Test(net_server, a_body_gets_its_whole_buffer_only_once_a_quarter_of_it_is_in)
{
    enum { LEN = 1000000 };
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n");
    static char piece[LEN];
    memset(piece, 'a', sizeof(piece));
    raw_send(&c, piece, 1000);
    RUN_UNTIL(g_req != NULL && g_req->body.len == 1000);
    cr_assert_leq(g_req->body.cap, 4096, "capacity %zu for 1,000 bytes in", g_req->body.cap);
    raw_send(&c, piece + 1000, LEN / 8);
    RUN_UNTIL(g_req->body.len == 1000 + LEN / 8);
    cr_assert_leq(g_req->body.cap, 2 * (1000 + LEN / 8), "capacity %zu", g_req->body.cap);
    raw_send(&c, piece, LEN - 1000 - LEN / 8);
    RUN_UNTIL(g_completes == 1);
    cr_assert_eq(g_body_cap, (size_t)LEN + 1, "capacity %zu for a %d-byte body", g_body_cap, LEN);
    raw_close(&c);
}

/* Once a body's buffer is sized, the rest of it is read from the socket straight into the
 * buffer. Exactly the rest: a pipelined request in the same segment as the body's end is not
 * read into it, and comes out as its own request. */
Test(net_server, a_body_read_straight_into_its_buffer_keeps_its_bytes_and_the_next_request)
{
    enum { LEN = 200000 };
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    static char body[LEN + 1];
    for (size_t i = 0; i < LEN; i++)
        body[i] = (char)('a' + (i * 7 + i / 251) % 26);
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n");
    raw_send(&c, body, LEN / 2); /* past a quarter: the buffer is sized to the whole body */
    run_idle();
    static char rest[LEN / 2 + 128];
    memcpy(rest, body + LEN / 2, LEN / 2);
    static const char next[] = "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello";
    memcpy(rest + LEN / 2, next, sizeof(next) - 1);
    raw_send(&c, rest, LEN / 2 + sizeof(next) - 1);
    RUN_UNTIL(raw_count(&c, "HTTP/1.1 200 OK") == 2 && c.in.len >= LEN + 5);
    cr_assert_eq(g_completes, 2);
    const char *b = body_of(&c);
    cr_assert(memcmp(b, body, LEN) == 0, "the echoed body differs");
    const char *e = memmem(b + LEN, c.in.len - (size_t)(b + LEN - c.in.base), "\r\n\r\n", 4);
    cr_assert(e && strncmp(e + 4, "hello", 5) == 0, "second request: %.200s", b + LEN);
    raw_close(&c);
}

/* Send a /peek request's head and the first 1,000 bytes of its body, and wait until the server
 * holds them (g_req: the request). */
static void peek_with_1000_in(raw_t *c, const char *head, const char *body)
{
    g_req = NULL;
    raw_sends(c, head);
    raw_send(c, body, 1000);
    RUN_UNTIL(g_req != NULL && g_req->body.len == 1000);
}

/* A connection whose last body came whole gets the whole-size buffer for a next one up to
 * twice as long on its first bytes (and the rest read straight into it), all of it reserved in
 * the body budget then. Longer than that, the quarter rule holds as on a new connection. */
Test(net_server, a_connection_whose_last_body_came_whole_gets_the_next_ones_buffer_at_once)
{
    enum { LEN = 200000 };
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    static char body[4 * LEN];
    memset(body, 'a', sizeof(body));
    raw_sends(&c, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n");
    raw_send(&c, body, LEN);
    RUN_UNTIL(g_completes == 1 && raw_count(&c, "HTTP/1.1 200 OK") == 1);
    peek_with_1000_in(&c, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 400000\r\n\r\n", body);
    cr_assert_eq(g_req->body.cap, (size_t)2 * LEN + 1, "capacity %zu with 1,000 bytes in",
                 g_req->body.cap);
    cr_assert_eq(net_server_body_bytes(g_srv), (uint64_t)2 * LEN);
    cr_assert_eq(net_server_head_reads(g_srv), 1, "the head was not read on its own");
    raw_send(&c, body, 2 * LEN - 1000);
    RUN_UNTIL(g_completes == 2 && raw_count(&c, "HTTP/1.1 200 OK") == 2);
    cr_assert_eq(g_body_cap, (size_t)2 * LEN + 1);
    peek_with_1000_in(&c, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 800001\r\n\r\n", body);
    cr_assert_leq(g_req->body.cap, 4096, "capacity %zu for 1,000 bytes in", g_req->body.cap);
    raw_send(&c, body, 4 * LEN + 1 - 1000);
    RUN_UNTIL(g_completes == 3);
    cr_assert_eq(net_server_head_reads(g_srv), 2);
    raw_close(&c);
}

/* The head-first read is once per long body, and "the last body" is the last request's: long
 * POST, then requests answered from their heads (pipelined, one segment), then a long POST
 * again. One read is taken at a head's length (the first after the long body), and the second
 * long body is not given its whole buffer at once: the request before it had no body. */
Test(net_server, only_the_request_right_after_a_long_body_is_read_head_first)
{
    enum { LEN = 200000, EARLY = 50 };
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    static char body[LEN];
    memset(body, 'a', sizeof(body));
    raw_sends(&c, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n");
    raw_send(&c, body, LEN);
    RUN_UNTIL(g_completes == 1 && raw_count(&c, "HTTP/1.1 200 OK") == 1);
    static const char early[] = "GET /early HTTP/1.1\r\nHost: x\r\n\r\n";
    dp_buf_t many = {0};
    for (int i = 0; i < EARLY; i++)
        dp_buf_append(&many, early, sizeof(early) - 1);
    raw_send(&c, many.base, many.len);
    RUN_UNTIL(raw_count(&c, "HTTP/1.1 403") == EARLY);
    cr_assert_eq(net_server_head_reads(g_srv), 1, "%" PRIu64 " reads at a head's length",
                 net_server_head_reads(g_srv));
    peek_with_1000_in(&c, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n", body);
    cr_assert_leq(g_req->body.cap, 4096, "capacity %zu for 1,000 bytes in", g_req->body.cap);
    cr_assert_eq(net_server_head_reads(g_srv), 1);
    dp_buf_free(&many);
    raw_close(&c);
}

/* A body sized at once for the connection's history holds all of its length in the budget, so
 * a budget that would be over half used with it leaves it to the quarter rule: without that,
 * clients that each sent one long body could then each declare another, send a byte and
 * stall, holding resident buffers the budget never counted. */
Test(net_server, a_body_is_sized_at_once_only_while_the_budget_has_room_for_all_of_it)
{
    enum { LEN = 200000 };
    net_server_limits_t l = limits();
    l.max_inflight_body_bytes = 600000;
    srv_start(&l);
    raw_t a, b;
    raw_connect(&a, net_server_port(g_srv));
    static char body[250000];
    memset(body, 'a', sizeof(body));
    raw_sends(&a, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n");
    raw_send(&a, body, LEN);
    RUN_UNTIL(g_completes == 1 && raw_count(&a, "HTTP/1.1 200 OK") == 1);
    RUN_UNTIL(net_server_body_bytes(g_srv) == 0);
    /* An empty budget: all 250,000 bytes reserved, under half of it. */
    peek_with_1000_in(&a, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 250000\r\n\r\n", body);
    cr_assert_eq(g_req->body.cap, 250001, "capacity %zu with 1,000 bytes in", g_req->body.cap);
    cr_assert_eq(net_server_body_bytes(g_srv), 250000);
    raw_send(&a, body, 249000);
    RUN_UNTIL(g_completes == 2 && raw_count(&a, "HTTP/1.1 200 OK") == 2);
    RUN_UNTIL(net_server_body_bytes(g_srv) == 0);
    /* Another client's body holds a sixth of the budget: 250,000 bytes more would use over half. */
    raw_connect(&b, net_server_port(g_srv));
    raw_sends(&b, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 200000\r\n\r\n");
    raw_send(&b, body, LEN / 2);
    RUN_UNTIL(net_server_body_bytes(g_srv) >= LEN / 2);
    uint64_t held = net_server_body_bytes(g_srv);
    peek_with_1000_in(&a, "POST /peek HTTP/1.1\r\nHost: x\r\nContent-Length: 250000\r\n\r\n", body);
    cr_assert_leq(g_req->body.cap, 4096, "capacity %zu for 1,000 bytes in", g_req->body.cap);
    cr_assert_lt(net_server_body_bytes(g_srv), held + 250000);
    raw_close(&a);
    raw_close(&b);
}

/* After a long body the next request's first read takes about its head's length (as long as
 * the last head): every byte still arrives in order whether the new head is longer than that
 * read (its rest read as usual) or shorter (some of the body came with it), with the next
 * request in the same segment as the body's end. */
Test(net_server, bodies_after_heads_longer_and_shorter_than_the_last_arrive_whole)
{
    enum { LEN = 100000, PAD = 600 };
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    static char bodies[3][LEN];
    for (size_t k = 0; k < 3; k++)
        for (size_t i = 0; i < LEN; i++)
            bodies[k][i] = (char)('a' + (i * 7 + k * 5 + i / 251) % 26);
    static char pad[PAD + 1];
    memset(pad, 'p', PAD);
    dp_buf_t heads[3] = {{0}, {0}, {0}};
    dp_buf_printf(&heads[0], "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n", LEN);
    dp_buf_printf(&heads[1],
                  "POST /echo HTTP/1.1\r\nHost: x\r\nX-Pad: %s\r\nContent-Length: %d\r\n\r\n", pad,
                  LEN);
    dp_buf_printf(&heads[2], "POST /echo HTTP/1.1\r\nContent-Length: %d\r\nHost: x\r\n\r\n", LEN);
    raw_send(&c, heads[0].base, heads[0].len);
    raw_send(&c, bodies[0], LEN);
    RUN_UNTIL(g_completes == 1 && c.in.len > LEN);
    /* The second and third requests in one go: the third's head right after the second's body. */
    raw_send(&c, heads[1].base, heads[1].len);
    raw_send(&c, bodies[1], LEN);
    raw_send(&c, heads[2].base, heads[2].len);
    raw_send(&c, bodies[2], LEN);
    RUN_UNTIL(raw_count(&c, "HTTP/1.1 200 OK") == 3 && c.in.len > 3 * LEN);
    cr_assert_eq(g_completes, 3);
    const char *at = c.in.base;
    for (size_t k = 0; k < 3; k++) {
        const char *e = memmem(at, c.in.len - (size_t)(at - c.in.base), "\r\n\r\n", 4);
        cr_assert_not_null(e, "response %zu has no head", k);
        cr_assert(c.in.len - (size_t)(e + 4 - c.in.base) >= LEN, "response %zu is short", k);
        cr_assert(memcmp(e + 4, bodies[k], LEN) == 0, "body %zu differs", k);
        at = e + 4 + LEN;
    }
    for (size_t k = 0; k < 3; k++)
        dp_buf_free(&heads[k]);
    raw_close(&c);
}

Test(net_server, chunked_request_body_is_decoded)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  "5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "hello world") == 1);
    cr_assert(g_chunked);
    cr_assert_eq(g_content_length, -1);
    cr_assert_str_eq(body_of(&c), "hello world");
    raw_close(&c);
}

Test(net_server, unknown_length_response_is_chunked_to_http11)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET /chunked HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "0\r\n\r\n") == 1);
    cr_assert_eq(raw_count(&c, "transfer-encoding: chunked\r\n"), 1);
    cr_assert_eq(raw_count(&c, "content-length"), 0);
    cr_assert_str_eq(body_of(&c), "5\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\n\r\n");
    raw_close(&c);
}

Test(net_server, unknown_length_response_is_close_delimited_to_http10)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET /chunked HTTP/1.0\r\nHost: x\r\n\r\n");
    RUN_UNTIL(c.eof);
    cr_assert_eq(c.err, UV_EOF);
    cr_assert_eq(raw_count(&c, "transfer-encoding"), 0);
    cr_assert_eq(raw_count(&c, "connection: close\r\n"), 1);
    cr_assert_str_eq(body_of(&c), "hello world");
    raw_close(&c);
}

Test(net_server, pipelined_requests_wait_for_the_response_before_them)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                  "GET /two HTTP/1.1\r\nHost: x\r\n\r\n"
                  "GET /three HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(g_req != NULL);
    run_idle();
    cr_assert_eq(g_heads, 1, "a pipelined request was parsed before the first was answered");
    cr_assert_eq(c.in.len, 0);
    net_resp_send(g_req, 200, "text/plain", "one", 3, NULL, 0);
    g_req = NULL;
    RUN_UNTIL(raw_count(&c, "HTTP/1.1 200 OK") == 3);
    const char *one = memmem(c.in.base, c.in.len, "\r\n\r\none", 7);
    const char *two = memmem(c.in.base, c.in.len, "\r\n\r\n/two", 8);
    const char *three = memmem(c.in.base, c.in.len, "\r\n\r\n/three", 10);
    cr_assert(one && two && three && one < two && two < three, "out of order: %.200s", c.in.base);
    cr_assert_eq(g_heads, 3);
    cr_assert_eq(net_server_accepted(g_srv), 1);
    raw_close(&c);
}

/* A rejection the server makes itself: status line, OpenAI error code, on_reject, close. */
static void expect_reject(raw_t *c, int status, const char *code)
{
    RUN_UNTIL(c->eof);
    char line[64];
    snprintf(line, sizeof(line), "HTTP/1.1 %d ", status);
    cr_assert_eq(strncmp(c->in.base, line, strlen(line)), 0, "got: %.200s", c->in.base);
    char want[64];
    snprintf(want, sizeof(want), "\"code\":\"%s\"", code);
    cr_assert_eq(raw_count(c, want), 1, "got: %.200s", c->in.base);
    cr_assert_eq(raw_count(c, "connection: close\r\n"), 1);
    cr_assert_eq(g_rejects, 1);
    cr_assert_eq(g_reject_status, status);
    cr_assert_str_eq(g_reject_code, code);
}

Test(net_server, head_over_max_header_bytes_is_431)
{
    net_server_limits_t l = limits();
    l.max_header_bytes = 1024;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    char big[2048];
    memset(big, 'a', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    raw_sends(&c, "GET / HTTP/1.1\r\nHost: x\r\nX-Big: ");
    raw_sends(&c, big);
    expect_reject(&c, 431, "headers_too_large");
    cr_assert_eq(g_heads, 0);
    raw_close(&c);
}

Test(net_server, more_than_max_headers_is_431)
{
    net_server_limits_t l = limits();
    l.max_headers = 4;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET / HTTP/1.1\r\nHost: x\r\nA: 1\r\nB: 2\r\nC: 3\r\nD: 4\r\n\r\n");
    expect_reject(&c, 431, "headers_too_large");
    raw_close(&c);
}

Test(net_server, content_length_over_max_body_bytes_is_413_before_reading_it)
{
    net_server_limits_t l = limits();
    l.max_body_bytes = 10;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n");
    expect_reject(&c, 413, "body_too_large");
    cr_assert_eq(g_completes, 0);
    raw_close(&c);
}

Test(net_server, chunked_body_growing_over_max_body_bytes_is_413)
{
    net_server_limits_t l = limits();
    l.max_body_bytes = 10;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  "6\r\nhello \r\n");
    run_idle();
    cr_assert_eq(c.in.len, 0, "10 bytes are allowed");
    raw_sends(&c, "5\r\nworld\r\n0\r\n\r\n");
    expect_reject(&c, 413, "body_too_large");
    cr_assert_eq(g_completes, 0);
    raw_close(&c);
}

Test(net_server, partial_head_past_client_header_timeout_is_408)
{
    net_server_limits_t l = limits();
    l.client_header_timeout_ms = 50;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    /* The second request's header timer starts when its first byte is read, so a loaded
     * machine cannot run it out before the partial head arrives (the first one's runs from
     * the accept, and a silent connection is closed without an answer: the next test). */
    raw_sends(&c, "GET /a HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "\r\n\r\n/a") == 1);
    dp_buf_reset(&c.in);
    raw_sends(&c, "GET / HTTP/1.1\r\nHost: x\r\n");
    expect_reject(&c, 408, "timeout");
    raw_close(&c);
}

Test(net_server, silent_connection_is_closed_without_an_answer_at_header_timeout)
{
    net_server_limits_t l = limits();
    l.client_header_timeout_ms = 50;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    RUN_UNTIL(c.eof);
    cr_assert_eq(c.in.len, 0);
    cr_assert_eq(g_rejects, 0);
    raw_close(&c);
}

Test(net_server, keep_alive_connection_closes_quietly_at_idle_timeout)
{
    net_server_limits_t l = limits();
    l.client_idle_timeout_ms = 50;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET /a HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(c.eof);
    cr_assert_eq(c.err, UV_EOF);
    cr_assert_eq(raw_count(&c, "HTTP/1.1"), 1);
    cr_assert_str_eq(body_of(&c), "/a");
    RUN_UNTIL(net_server_connections(g_srv) == 0);
    raw_close(&c);
}

/* The connection's timer is left running when a deadline moves later, and when it fires
 * early it sets itself again for the rest. Here the idle timeout armed when the request was
 * read (due 300 ms on) is moved 200 ms later by the answer: the connection must still be open
 * when the first due time has passed, and close quietly 300 ms after the answer. */
Test(net_server, an_idle_deadline_moved_later_by_a_late_answer_is_kept)
{
    net_server_limits_t l = limits();
    l.client_header_timeout_ms = 5000;
    l.client_idle_timeout_ms = 300;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(g_req != NULL);
    run_for(200);
    cr_assert_not(c.eof);
    net_resp_send(g_req, 200, "text/plain", "ok", 2, NULL, 0);
    g_req = NULL;
    uint64_t t0 = uv_now(&g_loop);
    RUN_UNTIL(raw_count(&c, "HTTP/1.1 200") == 1);
    run_for(180); /* past the first due time (read + 300 ms), before the answer + 300 ms */
    cr_assert_not(c.eof, "closed %llu ms after the answer",
                  (unsigned long long)(uv_now(&g_loop) - t0));
    RUN_UNTIL(c.eof);
    cr_assert_geq(uv_now(&g_loop) - t0, 270, "closed after %llu ms",
                  (unsigned long long)(uv_now(&g_loop) - t0));
    raw_close(&c);
}

Test(net_server, paused_body_is_not_read_until_resumed)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    g_mode = NET_BODY_STREAM;
    g_pause_in_head = true;
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello");
    RUN_UNTIL(g_heads == 1);
    run_idle();
    cr_assert_eq(g_streamed.len, 0, "read while paused");
    cr_assert_eq(g_completes, 0);
    net_req_resume_body(g_req);
    RUN_UNTIL(g_completes == 1);
    cr_assert_eq(g_streamed.len, 5);
    cr_assert_eq(memcmp(g_streamed.base, "hello", 5), 0);
    RUN_UNTIL(raw_count(&c, "\r\n\r\nhello") == 1);
    raw_close(&c);
}

Test(net_server, slow_reader_holds_the_writer_at_high_water_then_drains)
{
    raw_t c;
    slow_reader_start(&c, limits());
    raw_sends(&c, "GET /big HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(g_big_stalled);
    run_idle();
    cr_assert(g_big_stalled);
    cr_assert_lt(g_big_written, BIG / 2, "%zu bytes written to a reader that reads nothing",
                 g_big_written);
    cr_assert_eq(g_drains, 0);
    raw_start_reading(&c);
    RUN_UNTIL(g_req == NULL && c.in.len > BIG && body_of(&c) + BIG == c.in.base + c.in.len);
    cr_assert_gt(g_drains, 0);
    cr_assert_eq(g_big_written, BIG);
    raw_close(&c);
}

Test(net_server, client_leaving_mid_response_gets_on_abort_once)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(g_req != NULL);
    cr_assert_eq(net_server_inflight(g_srv), 1);
    raw_close(&c);
    RUN_UNTIL(g_aborts == 1);
    cr_assert_null(g_req);
    RUN_UNTIL(net_server_connections(g_srv) == 0);
    cr_assert_eq(net_server_inflight(g_srv), 0);
    cr_assert_eq(g_aborts, 1);
}

Test(net_server, answer_before_the_body_closes_the_connection)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /early HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc");
    RUN_UNTIL(c.eof);
    cr_assert_eq(strncmp(c.in.base, "HTTP/1.1 403 Forbidden\r\n", 24), 0, "%.200s", c.in.base);
    cr_assert_eq(raw_count(&c, "connection: close\r\n"), 1);
    cr_assert_eq(raw_count(&c, "\"code\":\"denied\""), 1);
    cr_assert_eq(g_completes, 0);
    cr_assert_eq(g_aborts, 0, "an answered request is not aborted");
    raw_close(&c);
}

Test(net_server, smuggling_framing_is_400)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n");
    expect_reject(&c, 400, "bad_request");
    cr_assert_eq(g_heads, 0);
    raw_close(&c);
}

Test(net_server, expect_100_continue_is_answered_before_the_body)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                  "Content-Length: 2\r\n\r\n");
    RUN_UNTIL(c.in.len >= 25);
    cr_assert_str_eq(c.in.base, "HTTP/1.1 100 Continue\r\n\r\n");
    raw_sends(&c, "ok");
    RUN_UNTIL(raw_count(&c, "\r\n\r\nok") == 1);
    raw_close(&c);
}

Test(net_server, target_is_normalised_and_query_and_headers_are_found)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "GET /v1//x/../%63hat?a=1&bb=2&b=3 HTTP/1.1\r\nHost: x\r\nX-TEST: yes\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "\r\n\r\n/v1/chat") == 1);
    cr_assert_str_eq(g_path, "/v1/chat");
    cr_assert(g_has_query_b);
    cr_assert_eq(g_query_b.len, 1);
    cr_assert_eq(g_query_b.base[0], '3');
    cr_assert_eq(g_query_c, 0);
    cr_assert_str_eq(g_hdr_value, "yes");
    /* values are percent-decoded, '+' as a space; a malformed escape is said to be one */
    raw_sends(&c, "GET /v1/chat?b=llama%3A8b%2Fv2+x&c=%4 HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "\r\n\r\n/v1/chat") == 2);
    cr_assert_str_eq(g_query_b.base, "llama:8b/v2 x");
    cr_assert_eq(g_query_c, -1);
    /* a name without '=' is there, empty (as URLSearchParams reads it), not absent */
    raw_sends(&c, "GET /v1/chat?bb=1&b&c=2 HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "\r\n\r\n/v1/chat") == 3);
    cr_assert(g_has_query_b);
    cr_assert_str_eq(g_query_b.base, "");
    cr_assert_eq(g_query_c, 1);
    raw_close(&c);
    dp_buf_free(&g_query_b);
}

Test(net_server, connections_beyond_max_connections_are_closed_at_once)
{
    net_server_limits_t l = limits();
    l.max_connections = 1;
    srv_start(&l);
    raw_t a, b;
    raw_connect(&a, net_server_port(g_srv));
    RUN_UNTIL(net_server_connections(g_srv) == 1);
    raw_connect(&b, net_server_port(g_srv));
    RUN_UNTIL(b.eof);
    cr_assert_eq(b.in.len, 0);
    raw_sends(&a, "GET /a HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(raw_count(&a, "\r\n\r\n/a") == 1);
    raw_close(&b);
    raw_close(&a);
}

Test(net_server, pipelining_client_that_does_not_read_is_not_answered_without_bound)
{
    raw_t c;
    slow_reader_start(&c, limits());
    dp_buf_t reqs = {0};
    for (int i = 0; i < 200; i++)
        dp_buf_appends(&reqs, "GET /sixtyfour HTTP/1.1\r\nHost: x\r\n\r\n");
    raw_send(&c, reqs.base, reqs.len);
    dp_buf_free(&reqs);
    RUN_UNTIL(g_completes > 0);
    run_idle();
    cr_assert_lt(g_completes, 100, "%d responses of 64 KB queued for a client reading nothing",
                 g_completes);
    raw_start_reading(&c);
    /* Every response has the same size (the date header is fixed-width): wait for 200 of
     * them by length, not by rescanning megabytes on every read. */
    RUN_UNTIL(c.in.len > 65536);
    size_t one = (size_t)(body_of(&c) - c.in.base) + 65536;
    RUN_UNTIL(c.in.len >= 200 * one);
    cr_assert_eq(c.in.len, 200 * one);
    cr_assert_eq(raw_count(&c, "HTTP/1.1 200 OK"), 200);
    cr_assert_eq(g_completes, 200);
    raw_close(&c);
}

Test(net_server, head_response_announces_the_length_but_sends_no_body)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "HEAD /abc HTTP/1.1\r\nHost: x\r\n\r\nGET /z HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(raw_count(&c, "HTTP/1.1 200 OK") == 2 && raw_count(&c, "\r\n\r\n/z") == 1);
    cr_assert_eq(raw_count(&c, "content-length: 4\r\n"), 1);
    cr_assert_eq(raw_count(&c, "/abc"), 0, "a HEAD response carried a body");
    raw_close(&c);
}

Test(net_server, connection_close_and_http10_keep_alive_are_honoured)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t a, b;
    raw_connect(&a, net_server_port(g_srv));
    raw_sends(&a, "GET /a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    RUN_UNTIL(a.eof);
    cr_assert_eq(raw_count(&a, "connection: close\r\n"), 1);
    cr_assert_str_eq(body_of(&a), "/a");
    raw_connect(&b, net_server_port(g_srv));
    raw_sends(&b, "GET /b HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    RUN_UNTIL(raw_count(&b, "\r\n\r\n/b") == 1);
    cr_assert_eq(raw_count(&b, "connection: keep-alive\r\n"), 1);
    raw_sends(&b, "GET /c HTTP/1.0\r\n\r\n");
    RUN_UNTIL(b.eof);
    cr_assert_eq(raw_count(&b, "\r\n\r\n/c"), 1);
    raw_close(&a);
    raw_close(&b);
}

Test(net_server, buffered_body_past_client_body_timeout_is_408)
{
    net_server_limits_t l = limits();
    l.client_body_timeout_ms = 50;
    srv_start(&l);
    raw_t c;
    raw_connect(&c, net_server_port(g_srv));
    raw_sends(&c, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc");
    expect_reject(&c, 408, "timeout");
    cr_assert_eq(g_completes, 0);
    raw_close(&c);
}

static int g_sheds, g_budget_refusals;

static void count_overload(const char *reason)
{
    if (strcmp(reason, "body_shed") == 0)
        g_sheds++;
    else if (strcmp(reason, "body_budget") == 0)
        g_budget_refusals++;
}

Test(net_server, a_body_reserves_what_arrived_not_what_it_declares)
{
    net_server_limits_t l = limits();
    l.max_inflight_body_bytes = 100;
    srv_start(&l);
    net_server_on_overload(g_srv, count_overload);
    raw_t a, b;
    raw_connect(&a, net_server_port(g_srv));
    /* Ten times the budget declared, nothing sent: nothing held. */
    raw_sends(&a, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n");
    RUN_UNTIL(g_heads == 1);
    cr_assert_eq(net_server_body_bytes(g_srv), 0);
    /* So a whole body of 50 is admitted, and held until its response. */
    raw_connect(&b, net_server_port(g_srv));
    raw_sends(&b, "POST /hold HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n"
                  "0123456789012345678901234567890123456789012345678901234567890123456789");
    RUN_UNTIL(g_completes == 1);
    cr_assert_eq(net_server_body_bytes(g_srv), 50);
    /* a's bytes take room as they come; one that finds none (and no body being read that may
     * be shed for it: b's is complete) is refused. */
    raw_sends(&a, "012345678901234567890123456789");
    RUN_UNTIL(net_server_body_bytes(g_srv) == 80);
    raw_sends(&a, "012345678901234567890123456789");
    expect_reject(&a, 503, "overloaded");
    cr_assert_eq(g_budget_refusals, 1);
    cr_assert_eq(g_sheds, 0);
    RUN_UNTIL(net_server_body_bytes(g_srv) == 50);
    cr_assert_eq(net_resp_send(g_req, 200, "text/plain", "ok", 2, NULL, 0), 0);
    g_req = NULL;
    RUN_UNTIL(net_server_body_bytes(g_srv) == 0);
    raw_close(&a);
    raw_close(&b);
}

Test(net_server, a_full_budget_sheds_the_slowest_body_being_read_for_a_faster_one)
{
    net_server_limits_t l = limits();
    l.max_inflight_body_bytes = 100;
    srv_start(&l);
    net_server_on_overload(g_srv, count_overload);
    raw_t slow, fast;
    raw_connect(&slow, net_server_port(g_srv));
    raw_sends(&slow, "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123456789");
    RUN_UNTIL(net_server_body_bytes(g_srv) == 100); /* a small body takes its length at once */
    usleep(20000); /* 10 bytes in 20 ms: slow next to 95 in one read */
    raw_connect(&fast, net_server_port(g_srv));
    char req[256];
    snprintf(req, sizeof(req), "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 95\r\n\r\n%.95s",
             "01234567890123456789012345678901234567890123456789"
             "01234567890123456789012345678901234567890123456789");
    raw_sends(&fast, req);
    expect_reject(&slow, 408, "timeout");
    RUN_UNTIL(raw_count(&fast, "\r\n\r\n01234") == 1);
    cr_assert_eq(raw_count(&fast, "HTTP/1.1 200 OK\r\n"), 1);
    cr_assert_eq(g_sheds, 1);
    cr_assert_eq(g_budget_refusals, 0);
    RUN_UNTIL(net_server_body_bytes(g_srv) == 0);
    raw_close(&slow);
    raw_close(&fast);
}

static bool g_drained;

static void drained(net_server_t *s)
{
    (void)s;
    g_drained = true;
}

Test(net_server, drain_closes_idle_connections_and_finishes_the_busy_one)
{
    net_server_limits_t l = limits();
    srv_start(&l);
    raw_t idle, busy;
    raw_connect(&idle, net_server_port(g_srv));
    raw_connect(&busy, net_server_port(g_srv));
    raw_sends(&busy, "GET /hold HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(g_req != NULL && net_server_connections(g_srv) == 2);
    net_server_drain(g_srv, drained);
    RUN_UNTIL(idle.eof);
    cr_assert_eq(idle.in.len, 0);
    cr_assert(!g_drained);
    net_resp_send(g_req, 200, "text/plain", "bye", 3, NULL, 0);
    g_req = NULL;
    RUN_UNTIL(busy.eof);
    cr_assert_eq(raw_count(&busy, "connection: close\r\n"), 1);
    cr_assert_str_eq(body_of(&busy), "bye");
    raw_close(&idle);
    raw_close(&busy); /* ends the server's lingering close */
    RUN_UNTIL(g_drained);
    cr_assert_eq(net_server_connections(g_srv), 0);
}

Test(net_server, drain_sends_a_finished_answer_to_a_slow_reader_before_it_closes)
{
    /* The answer ends with most of it queued and a request pipelined behind it (kept for
     * after the queue drains); then the drain. The rest of the answer goes out, the request
     * behind is not read. Before, once the queue fell to its low-water mark, the request was
     * parsed, found the server draining and closed the connection over the last of the
     * answer. */
    raw_t c;
    slow_reader_start(&c, limits());
    raw_sends(&c, "GET /many HTTP/1.1\r\nHost: x\r\n\r\nGET /second HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(g_completes == 1);
    run_idle();
    net_server_drain(g_srv, drained);
    raw_start_reading(&c);
    RUN_UNTIL(c.eof);
    const char *b = body_of(&c);
    cr_assert_not_null(b);
    cr_assert_eq((size_t)(c.in.base + c.in.len - b), MANY, "%zu of %u bytes",
                 (size_t)(c.in.base + c.in.len - b), MANY);
    cr_assert_eq(g_completes, 1, "the request behind it was read");
    raw_close(&c);
    RUN_UNTIL(g_drained);
    cr_assert_eq(net_server_connections(g_srv), 0);
}

Test(net_server, client_that_stops_reading_a_response_is_cut_off_at_idle_timeout)
{
    net_server_limits_t l = limits();
    l.client_idle_timeout_ms = 100;
    raw_t c;
    slow_reader_start(&c, l);
    raw_sends(&c, "GET /big HTTP/1.1\r\nHost: x\r\n\r\n");
    RUN_UNTIL(g_big_stalled);
    RUN_UNTIL(g_aborts == 1);
    cr_assert_null(g_req);
    cr_assert_lt(g_big_written, BIG);
    RUN_UNTIL(net_server_connections(g_srv) == 0);
    raw_close(&c);
}
