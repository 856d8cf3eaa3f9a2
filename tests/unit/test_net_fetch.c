/* net_fetch and net_creq against the real net_server over loopback: what a fetch sends, the
 * response body cap (max_bytes), cancel, keep-alive between fetches, and chunked bodies in
 * both directions between the two halves of net/. */
#define _GNU_SOURCE /* memmem */
#include "net_harness.h"

#include <stdio.h>
#include <stdlib.h>

#include "net/client.h"
#include "net/fetch.h"
#include "net/server.h"

static net_server_t *g_srv;
static bool g_srv_closed;
static net_upstream_t *g_up;
static int g_aborts;
static net_req_t *g_held;
static uv_timer_t g_pump;
static char g_seen[1024]; /* the request as the server saw it: "name: value\n" lines + body */

static void note_header(const net_req_t *r, const char *name)
{
    const net_header_t *h = net_req_header(r, name);
    if (h == NULL)
        return;
    size_t l = strlen(g_seen);
    snprintf(g_seen + l, sizeof(g_seen) - l, "%s: %.*s\n", name, (int)h->value.len, h->value.base);
}

static bool is(const net_req_t *r, const char *path)
{
    return r->path.len == strlen(path) && memcmp(r->path.base, path, r->path.len) == 0;
}

/* /endless: a chunked body that never ends, 4 KB a millisecond. */
static void pump_cb(uv_timer_t *t)
{
    static char chunk[4096];
    memset(chunk, 'z', sizeof(chunk));
    if (g_held)
        net_resp_write(g_held, chunk, sizeof(chunk));
    (void)t;
}

static void h_complete(net_req_t *r)
{
    size_t l = (size_t)snprintf(g_seen, sizeof(g_seen), "%.*s %.*s\n", (int)r->method_name.len,
                                r->method_name.base, (int)r->target.len, r->target.base);
    (void)l;
    note_header(r, "host");
    note_header(r, "accept");
    note_header(r, "authorization");
    note_header(r, "x-extra");
    note_header(r, "via");
    note_header(r, "content-type");
    note_header(r, "content-length");
    size_t n = strlen(g_seen);
    snprintf(g_seen + n, sizeof(g_seen) - n, "%.*s", (int)r->body.len, r->body.base);
    if (is(r, "/echo")) {
        /* Chunked, in two pieces. */
        net_resp_start(r, 200, NULL, 0, -1);
        size_t half = r->body.len / 2;
        net_resp_write(r, r->body.base, half);
        net_resp_write(r, r->body.base + half, r->body.len - half);
        net_resp_end(r);
    } else if (is(r, "/hundred") || is(r, "/sixteen")) {
        static const char b[101] = "0123456789012345678901234567890123456789012345678901234567890"
                                   "123456789012345678901234567890123456789";
        size_t len = is(r, "/hundred") ? 100 : 16;
        net_resp_send(r, 200, "application/json", b, len, NULL, 0);
    } else if (is(r, "/huge-held")) {
        g_held = r; /* announces a megabyte, sends ten bytes, then nothing */
        net_resp_start(r, 200, NULL, 0, 1 << 20);
        net_resp_write(r, "0123456789", 10);
    } else if (is(r, "/endless")) {
        g_held = r;
        net_resp_start(r, 200, NULL, 0, -1);
        uv_timer_start(&g_pump, pump_cb, 1, 1);
    } else if (is(r, "/stall")) {
        g_held = r; /* an answer begun, then silent: net_resp_end ends it */
        net_resp_start(r, 200, NULL, 0, -1);
        net_resp_write(r, "abc", 3);
    } else if (is(r, "/hold")) {
        g_held = r;
    } else {
        net_resp_send(r, 200, "application/json", "{\"ok\":true}", 11, NULL, 0);
    }
}

static void h_abort(net_req_t *r)
{
    g_aborts++;
    if (g_held == r) {
        g_held = NULL;
        uv_timer_stop(&g_pump);
    }
}

static const net_handler_t handler = {.on_complete = h_complete, .on_abort = h_abort};

static void srv_closed(void *d)
{
    (void)d;
    g_srv_closed = true;
}

static void setup(void)
{
    harness_init();
    uv_timer_init(&g_loop, &g_pump);
    g_srv = net_server_new(&g_loop, &handler, NULL, NULL);
    cr_assert_eq(net_server_listen(g_srv, "127.0.0.1", 0), 0);
    struct sockaddr_in a = loopback(net_server_port(g_srv));
    g_up = net_upstream_new(&g_loop, (struct sockaddr *)&a, NULL);
}

static void teardown(void)
{
    uv_close((uv_handle_t *)&g_pump, NULL);
    net_upstream_free(g_up);
    net_server_close(g_srv, srv_closed, NULL);
    RUN_UNTIL(g_srv_closed);
    harness_fini();
}

TestSuite(net_fetch, .init = setup, .fini = teardown);

typedef struct {
    bool done;
    int status;
    net_up_err_t err;
    char detail[128];
    char body[256];
    size_t len;
} fr_t;

static void fetched(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                    const char *detail, void *data)
{
    fr_t *r = data;
    (void)f;
    cr_assert(!r->done, "the callback ran twice");
    r->done = true;
    r->status = status;
    r->err = err;
    snprintf(r->detail, sizeof(r->detail), "%s", detail ? detail : "");
    r->len = body->len;
    snprintf(r->body, sizeof(r->body), "%.*s", (int)body->len, body->base ? body->base : "");
}

static net_fetch_t *get(fr_t *r, const char *target, size_t max)
{
    memset(r, 0, sizeof(*r));
    net_fetch_opts_t o = {.method = "GET", .hostport = "h:1", .target = target, .max_bytes = max};
    return net_fetch(g_up, &o, fetched, r);
}

Test(net_fetch, get_sends_its_headers_and_returns_the_body)
{
    fr_t r = {0};
    net_fetch_opts_t o = {.method = "GET",
                          .hostport = "replica:8000",
                          .target = "/v1/models?x=1",
                          .bearer = "tok",
                          .extra_headers = "x-extra: 1\r\n",
                          .via = "via: 1.1 test\r\n"};
    net_fetch(g_up, &o, fetched, &r);
    cr_assert(!r.done);
    RUN_UNTIL(r.done);
    cr_assert_eq(r.err, NET_UP_OK, "%s", r.detail);
    cr_assert_eq(r.status, 200);
    cr_assert_str_eq(r.body, "{\"ok\":true}");
    cr_assert_str_eq(g_seen, "GET /v1/models?x=1\n"
                             "host: replica:8000\n"
                             "accept: application/json\n"
                             "authorization: Bearer tok\n"
                             "x-extra: 1\n"
                             "via: 1.1 test\n");
}

Test(net_fetch, post_sends_a_json_body_with_its_length)
{
    fr_t r = {0};
    net_fetch_opts_t o = {
        .method = "POST", .hostport = "h:1", .target = "/echo", .body = "{\"a\":1}", .body_len = 7};
    net_fetch(g_up, &o, fetched, &r);
    RUN_UNTIL(r.done);
    cr_assert_eq(r.err, NET_UP_OK, "%s", r.detail);
    cr_assert_str_eq(r.body, "{\"a\":1}");
    cr_assert_str_eq(g_seen, "POST /echo\nhost: h:1\naccept: application/json\n"
                             "content-type: application/json\ncontent-length: 7\n{\"a\":1}");
}

Test(net_fetch, fetches_share_one_keep_alive_connection)
{
    fr_t a, b;
    get(&a, "/", 0);
    RUN_UNTIL(a.done);
    get(&b, "/", 0);
    RUN_UNTIL(b.done);
    cr_assert_eq(a.status, 200);
    cr_assert_eq(b.status, 200);
    cr_assert_eq(net_server_accepted(g_srv), 1);
}

Test(net_fetch, body_of_exactly_max_bytes_is_accepted)
{
    fr_t r;
    get(&r, "/sixteen", 16);
    RUN_UNTIL(r.done);
    cr_assert_eq(r.err, NET_UP_OK, "%s", r.detail);
    cr_assert_eq(r.status, 200);
    cr_assert_eq(r.len, 16);
}

/* GET target with cap max: refused as over the cap (status 0, protocol, the reason). */
static void expect_too_big(const char *target, size_t max)
{
    fr_t r;
    get(&r, target, max);
    RUN_UNTIL(r.done);
    cr_assert_eq(r.status, 0);
    cr_assert_eq(r.err, NET_UP_PROTOCOL);
    char want[64];
    snprintf(want, sizeof(want), "response body larger than %zu bytes", max);
    cr_assert_str_eq(r.detail, want);
}

Test(net_fetch, content_length_over_max_bytes_fails)
{
    expect_too_big("/hundred", 50);
}

/* The cap is a bound on the fetch's time too: a replica announcing (or streaming) more than
 * max_bytes is not read to its end (the server sees the client leave). */
Test(net_fetch, announced_length_over_max_bytes_fails_at_the_head)
{
    expect_too_big("/huge-held", 50);
    RUN_UNTIL(g_aborts == 1);
}

Test(net_fetch, endless_chunked_body_is_cut_at_max_bytes)
{
    expect_too_big("/endless", 50000);
    RUN_UNTIL(g_aborts == 1);
}

Test(net_fetch, connect_failure_reports_status_0)
{
    net_upstream_free(g_up);
    struct sockaddr_in a = loopback(net_server_port(g_srv));
    net_server_close(g_srv, srv_closed, NULL);
    RUN_UNTIL(g_srv_closed);
    g_srv_closed = false;
    g_srv = net_server_new(&g_loop, &handler, NULL, NULL); /* for the teardown; not listening */
    g_up = net_upstream_new(&g_loop, (struct sockaddr *)&a, NULL);
    fr_t r;
    get(&r, "/", 0);
    RUN_UNTIL(r.done);
    cr_assert_eq(r.status, 0);
    cr_assert_eq(r.err, NET_UP_CONNECT);
}

Test(net_fetch, cancel_means_no_callback)
{
    fr_t r;
    net_fetch_t *f = get(&r, "/hold", 0);
    RUN_UNTIL(g_held != NULL);
    net_fetch_cancel(f);
    RUN_UNTIL(g_aborts == 1);
    run_idle();
    cr_assert(!r.done);
}

/* The client streams a chunked body, the server decodes it and answers chunked. */
typedef struct {
    dp_buf_t body;
    bool done, chunked;
    net_up_err_t err;
} ex_t;

static void x_head(net_creq_t *c, int status, const net_header_t *h, size_t n,
                   const net_framing_t *f)
{
    ex_t *x = c->data;
    (void)status;
    (void)h;
    (void)n;
    x->chunked = f->chunked;
}

static void x_body(net_creq_t *c, const char *p, size_t n)
{
    dp_buf_append(&((ex_t *)c->data)->body, p, n);
}

static void x_done(net_creq_t *c, net_up_err_t err, const char *detail)
{
    ex_t *x = c->data;
    (void)detail;
    x->done = true;
    x->err = err;
}

Test(net_fetch, chunked_bodies_both_ways_between_client_and_server)
{
    static const net_creq_cb_t cb = {.on_head = x_head, .on_body = x_body, .on_done = x_done};
    ex_t x = {0};
    const char *head = "POST /echo HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n";
    uv_buf_t b = uv_buf_init((char *)head, (unsigned)strlen(head));
    net_creq_t *c = net_creq_start(g_up, &b, 1, true, false, &cb, &x);
    uv_buf_t p1 = uv_buf_init("5\r\nhello\r\n", 10),
             p2 = uv_buf_init("6\r\n world\r\n0\r\n\r\n", 16);
    cr_assert_eq(net_creq_write(c, &p1, 1), 0);
    run_idle();
    cr_assert_eq(net_creq_write(c, &p2, 1), 0);
    net_creq_end(c);
    RUN_UNTIL(x.done);
    cr_assert_eq(x.err, NET_UP_OK);
    cr_assert(x.chunked);
    cr_assert_eq(x.body.len, 11);
    cr_assert_eq(memcmp(x.body.base, "hello world", 11), 0);
    cr_assert_eq(memcmp(g_seen, "POST /echo\nhost: h\nhello world", 30), 0, "%s", g_seen);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    dp_buf_free(&x.body);
}

/* ---- drains -------------------------------------------------------------------------------- */

static int g_drained;
static net_drains_t g_set;

static void count_drained(void *data, uint64_t left_ms)
{
    (void)left_ms;
    cr_assert_eq(data, &g_drained);
    g_drained++;
}

/* The fetch's callback, which makes the exchange a drain when told of a failure while it is
 * still open. */
static void fetched_or_drain(net_fetch_t *f, int status, const dp_buf_t *body, net_up_err_t err,
                             const char *detail, void *data)
{
    fetched(f, status, body, err, detail, data);
    if (net_fetch_open(f))
        net_fetch_drain(f, &g_set, 300, count_drained, &g_drained);
}

static net_upstream_t *short_first_byte_timeout(void)
{
    struct sockaddr_in a = loopback(net_server_port(g_srv));
    return net_upstream_new(&g_loop, (struct sockaddr *)&a,
                            &(net_upstream_opts_t){.first_byte_timeout_ms = 50});
}

/* Told of a first-byte timeout while the exchange is still open, a callback that does not
 * keep it ends it: the connection is closed, and the callback does not run again. */
Test(net_fetch, a_first_byte_timeout_is_told_once_and_ends_the_exchange)
{
    net_upstream_t *u = short_first_byte_timeout();
    fr_t r = {0};
    net_fetch(u, &(net_fetch_opts_t){.method = "GET", .hostport = "h:1", .target = "/hold"},
              fetched, &r);
    RUN_UNTIL(r.done);
    cr_assert_eq(r.status, 0);
    cr_assert_eq(r.err, NET_UP_FIRST_BYTE_TIMEOUT);
    RUN_UNTIL(g_aborts == 1);
    run_idle();
    net_upstream_free(u);
}

/* The callback told of a first-byte timeout may keep the exchange as a drain: the answer that
 * comes later is read and dropped, the drain's callback runs, the fetch's does not again. */
Test(net_fetch, a_fetch_told_of_a_first_byte_timeout_may_drain_it)
{
    net_upstream_t *u = short_first_byte_timeout();
    g_set = (net_drains_t){0};
    g_drained = 0;
    fr_t r = {0};
    net_fetch(u, &(net_fetch_opts_t){.method = "GET", .hostport = "h:1", .target = "/hold"},
              fetched_or_drain, &r);
    RUN_UNTIL(r.done);
    cr_assert_eq(r.err, NET_UP_FIRST_BYTE_TIMEOUT);
    cr_assert_not_null(g_set.head);
    run_for(150); /* past three more first-byte timeouts: kept for its 300 ms */
    cr_assert_eq(g_drained, 0);
    cr_assert_eq(g_aborts, 0);
    net_resp_send(g_held, 200, "application/json", "{}", 2, NULL, 0);
    RUN_UNTIL(g_drained == 1);
    cr_assert_null(g_set.head);
    net_upstream_free(u);
}

/* An answer that falls silent mid-way for the idle timeout is told the same way, with the
 * exchange still open: made a drain, silence no longer ends it, and the answer's end does. */
Test(net_fetch, a_fetch_told_of_an_idle_timeout_may_drain_it)
{
    struct sockaddr_in a = loopback(net_server_port(g_srv));
    net_upstream_t *u = net_upstream_new(&g_loop, (struct sockaddr *)&a,
                                         &(net_upstream_opts_t){.idle_timeout_ms = 50});
    g_set = (net_drains_t){0};
    g_drained = 0;
    fr_t r = {0};
    net_fetch(u, &(net_fetch_opts_t){.method = "GET", .hostport = "h:1", .target = "/stall"},
              fetched_or_drain, &r);
    RUN_UNTIL(r.done);
    cr_assert_eq(r.status, 0);
    cr_assert_eq(r.err, NET_UP_IDLE_TIMEOUT);
    cr_assert_not_null(g_set.head);
    run_for(150); /* three more idle timeouts: kept for its 300 ms */
    cr_assert_eq(g_drained, 0);
    cr_assert_eq(g_aborts, 0);
    net_resp_end(g_held);
    RUN_UNTIL(g_drained == 1);
    cr_assert_null(g_set.head);
    net_upstream_free(u);
}

/* An answer over the cap is told with the exchange still open, at its head (an announced
 * length) or mid-body: made a drain, it is read to its end, not reset, and the drain ends with
 * the answer, well before its deadline. */
static void expect_over_cap_drained(const char *target, size_t max, void (*finish)(void))
{
    g_set = (net_drains_t){0};
    g_drained = 0;
    fr_t r = {0};
    net_fetch(
        g_up,
        &(net_fetch_opts_t){.method = "GET", .hostport = "h:1", .target = target, .max_bytes = max},
        fetched_or_drain, &r);
    RUN_UNTIL(r.done);
    uint64_t t0 = uv_now(&g_loop);
    cr_assert_eq(r.status, 0);
    cr_assert_eq(r.err, NET_UP_PROTOCOL);
    cr_assert_not_null(g_set.head);
    run_for(30);
    cr_assert_eq(g_drained, 0);
    cr_assert_eq(g_aborts, 0, "the answer was cut, not drained");
    finish();
    RUN_UNTIL(g_drained == 1);
    cr_assert_lt(uv_now(&g_loop) - t0, 250, "ended by its 300 ms deadline, not by its answer");
    cr_assert_eq(g_aborts, 0);
    cr_assert_null(g_set.head);
}

static void send_the_megabyte(void)
{
    static char rest[(1 << 20) - 10];
    net_resp_write(g_held, rest, sizeof(rest));
    net_resp_end(g_held);
}

static void end_the_stall(void)
{
    net_resp_write(g_held, "defghij", 7);
    net_resp_end(g_held);
}

Test(net_fetch, a_fetch_told_its_answer_is_over_the_cap_may_drain_it)
{
    expect_over_cap_drained("/huge-held", 50, send_the_megabyte);
    expect_over_cap_drained("/stall", 2, end_the_stall);
}

/* A fetch made a drain before its callback ran: its callback never runs, the drain's does
 * once the answer is in. */
Test(net_fetch, a_fetch_drained_before_its_answer_calls_only_the_drain_back)
{
    g_set = (net_drains_t){0};
    g_drained = 0;
    fr_t r;
    net_fetch_t *f = get(&r, "/hold", 0);
    RUN_UNTIL(g_held != NULL);
    net_fetch_drain(f, &g_set, 0, count_drained, &g_drained);
    net_resp_send(g_held, 200, "application/json", "{}", 2, NULL, 0);
    RUN_UNTIL(g_drained == 1);
    run_idle();
    cr_assert_not(r.done);
}
