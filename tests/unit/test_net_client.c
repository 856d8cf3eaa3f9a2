/* net/client over loopback against scripted peers that answer with exact bytes: keep-alive
 * reuse and its close race, the error classes and which of them are retryable (docs/requests.md
 * §2, "Retries"), both
 * body framings, streamed request bodies, the timeouts, and response backpressure. */
#define _GNU_SOURCE /* memmem */
#include "net_harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "net/client.h"

typedef struct {
    int heads, status;
    net_framing_t framing;
    dp_buf_t body;
    bool done, reused;
    net_up_err_t err;
    char detail[256];
    bool pause_in_body; /* pause after the first body piece */
    int drains;
    size_t idle_at_done; /* the pool's idle connections when done was called */
    net_creq_t *r;
} ex_t;

static peer_t g_peer;
static net_upstream_t *g_up;

static void x_head(net_creq_t *r, int status, const net_header_t *h, size_t n,
                   const net_framing_t *f)
{
    ex_t *x = r->data;
    (void)h;
    (void)n;
    x->heads++;
    x->status = status;
    x->framing = *f;
}

static void x_body(net_creq_t *r, const char *p, size_t n)
{
    ex_t *x = r->data;
    dp_buf_append(&x->body, p, n);
    if (x->pause_in_body) {
        x->pause_in_body = false;
        net_creq_pause(r);
    }
}

static void x_done(net_creq_t *r, net_up_err_t err, const char *detail)
{
    ex_t *x = r->data;
    x->done = true;
    x->idle_at_done = net_client_upstream_idle(g_up);
    x->err = err;
    x->reused = r->reused;
    snprintf(x->detail, sizeof(x->detail), "%s", detail ? detail : "");
    x->r = NULL;
}

static void x_drain(net_creq_t *r)
{
    ((ex_t *)r->data)->drains++;
}

static const net_creq_cb_t x_cb = {
    .on_head = x_head, .on_body = x_body, .on_done = x_done, .on_drain = x_drain};

/* new_conn: net_creq_start_new, never a pooled connection. */
static void x_begin(ex_t *x, const char *req, bool body_follows, bool head, bool new_conn)
{
    memset(x, 0, sizeof(*x));
    uv_buf_t b = uv_buf_init((char *)req, (unsigned)strlen(req));
    x->r =
        (new_conn ? net_creq_start_new : net_creq_start)(g_up, &b, 1, body_follows, head, &x_cb, x);
    cr_assert_not_null(x->r);
    cr_assert(!x->done, "a callback fired inside net_creq_start");
}

static void x_start(ex_t *x, const char *req, bool body_follows, bool head)
{
    x_begin(x, req, body_follows, head, false);
}

#define GET_REQ "GET / HTTP/1.1\r\nhost: x\r\n\r\n"

static void x_get(ex_t *x)
{
    x_start(x, GET_REQ, false, false);
}

static void x_expect(ex_t *x, net_up_err_t err)
{
    RUN_UNTIL(x->done);
    cr_assert_eq(x->err, err, "got %s (%s), want %s", net_up_err_name(x->err), x->detail,
                 net_up_err_name(err));
}

static void x_free(ex_t *x)
{
    dp_buf_free(&x->body);
}

static void up_new(const net_upstream_opts_t *o)
{
    struct sockaddr_in a = loopback(g_peer.port);
    g_up = net_upstream_new(&g_loop, (struct sockaddr *)&a, o);
}

static void setup(void)
{
    harness_init();
}

static void teardown(void)
{
    if (g_up)
        net_upstream_free(g_up);
    g_up = NULL;
    if (g_peer.port)
        peer_stop(&g_peer);
    harness_fini();
}

TestSuite(net_client, .init = setup, .fini = teardown);

static void answer_ok(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
}

/* A server answering by `script`, and one exchange with it done: its connection pooled. */
static void one_pooled(ex_t *a, peer_script_cb script)
{
    peer_start(&g_peer, script);
    up_new(NULL);
    x_get(a);
    x_expect(a, NET_UP_OK);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
}

static void answer_nothing(peer_conn_t *c, int nth)
{
    (void)c;
    (void)nth;
}

static void close_on_request(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_conn_close(c);
}

Test(net_client, keep_alive_connection_is_pooled_and_reused)
{
    peer_start(&g_peer, answer_ok);
    up_new(NULL);
    ex_t a, b;
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    cr_assert_eq(a.status, 200);
    cr_assert(!a.reused);
    cr_assert_eq(a.body.len, 2);
    cr_assert_eq(memcmp(a.body.base, "ok", 2), 0);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    x_get(&b);
    cr_assert_eq(net_client_upstream_idle(g_up), 0);
    x_expect(&b, NET_UP_OK);
    cr_assert(b.reused);
    cr_assert_eq(g_peer.nconns, 1);
    cr_assert_eq(g_peer.requests, 2);
    x_free(&a);
    x_free(&b);
}

/* A pooled connection idles for keepalive_ms at most, whatever idle_timeout_ms is: its timer
 * closes it (detproxy's own close, not the server's: no on_idle_close). */
static int g_idle_closes;
static void count_idle_close(void *data)
{
    (void)data;
    g_idle_closes++;
}

Test(net_client, pooled_connection_closes_at_its_keepalive)
{
    peer_start(&g_peer, answer_ok);
    up_new(&(net_upstream_opts_t){.idle_timeout_ms = 60000, .keepalive_ms = 30});
    g_idle_closes = 0;
    net_upstream_on_idle_close(g_up, count_idle_close, NULL);
    ex_t a, b;
    uint64_t t0 = uv_now(&g_loop); /* no later than the pooling */
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    RUN_UNTIL(net_client_upstream_idle(g_up) == 0);
    cr_assert_geq(uv_now(&g_loop) - t0, 30);
    cr_assert_eq(g_idle_closes, 0, "closed as if the server had");
    x_get(&b);
    x_expect(&b, NET_UP_OK);
    cr_assert(!b.reused);
    cr_assert_eq(g_peer.nconns, 2);
    x_free(&a);
    x_free(&b);
}

/* The check a caller makes before it sends over a pooled connection goes by the clock, not by
 * whether the loop got round to the timer: a connection past its keep-alive is closed there
 * and the request goes over a new one. Within it, the pooled one is taken. */
Test(net_client, take_ready_drops_a_connection_past_keepalive)
{
    peer_start(&g_peer, answer_ok);
    up_new(&(net_upstream_opts_t){.keepalive_ms = 40});
    ex_t a, b, c;
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    cr_assert(net_upstream_take_ready(g_up));
    x_get(&b);
    x_expect(&b, NET_UP_OK);
    cr_assert(b.reused, "taken within its keep-alive");
    usleep(60 * 1000); /* the loop does not run: its timer cannot fire */
    uv_update_time(&g_loop);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    cr_assert(!net_upstream_take_ready(g_up));
    cr_assert_eq(net_client_upstream_idle(g_up), 0);
    x_get(&c);
    x_expect(&c, NET_UP_OK);
    cr_assert(!c.reused);
    cr_assert_eq(g_peer.nconns, 2);
    x_free(&a);
    x_free(&b);
    x_free(&c);
}

#define CHUNKED_OK "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"

/* llama.cpp's server: keep-alive in its head, yet it closes every connection it sent a
 * chunked answer on, right after the last chunk. */
static void chunked_answer_then_close(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, CHUNKED_OK);
    peer_conn_close(c);
}

static void chunked_kept(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, CHUNKED_OK);
}

/* A connection pooled after the first chunked answer is not taken at once: the next request
 * goes over a new one instead of racing the close. Once the server closed the first soon after
 * its answer, connections that carried a chunked answer are closed, never pooled, so no
 * request is ever sent on one that server is closing. */
Test(net_client, a_server_that_closes_after_chunked_answers_gets_no_request_on_those)
{
    peer_start(&g_peer, chunked_answer_then_close);
    up_new(NULL);
    ex_t a, b, c;
    x_get(&a);
    x_get(&b); /* waits in the same turn as a's end below: a's connection is still settling */
    x_expect(&a, NET_UP_OK);
    x_expect(&b, NET_UP_OK);
    cr_assert(!b.reused);
    RUN_UNTIL(net_client_upstream_idle(g_up) == 0); /* the server's closes */
    x_get(&c);
    x_expect(&c, NET_UP_OK);
    cr_assert(!c.reused);
    cr_assert_eq(c.idle_at_done, 0, "a chunked answer's connection pooled again");
    cr_assert_eq(g_peer.requests, 3);
    x_free(&a);
    x_free(&b);
    x_free(&c);
}

static ex_t g_next;

/* Starts the next request from a's end, the way the proxy dispatches a queued one. */
static void x_done_then_next(net_creq_t *r, net_up_err_t err, const char *detail)
{
    x_done(r, err, detail);
    x_get(&g_next);
}

Test(net_client, a_connection_settling_after_a_chunked_answer_is_not_taken_at_once)
{
    peer_start(&g_peer, chunked_answer_then_close);
    up_new(NULL);
    ex_t a;
    memset(&a, 0, sizeof(a));
    uv_buf_t req = uv_buf_init((char *)GET_REQ, (unsigned)strlen(GET_REQ));
    static const net_creq_cb_t then_next = {
        .on_head = x_head, .on_body = x_body, .on_done = x_done_then_next};
    cr_assert_not_null(net_creq_start(g_up, &req, 1, false, false, &then_next, &a));
    x_expect(&a, NET_UP_OK);
    x_expect(&g_next, NET_UP_OK);
    cr_assert(!g_next.reused, "sent on the connection its server was closing");
    cr_assert_eq(g_peer.nconns, 2);
    x_free(&a);
    x_free(&g_next);
}

/* A server that keeps them: the settling ends with the connection still open, and from then on
 * a connection is taken right after its chunked answer. */
Test(net_client, a_server_that_keeps_connections_after_chunked_answers_has_them_reused)
{
    peer_start(&g_peer, chunked_kept);
    up_new(NULL);
    ex_t a, b, c, d;
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    run_for(150);
    x_get(&b);
    x_expect(&b, NET_UP_OK);
    cr_assert(b.reused, "not taken after its settling");
    x_get(&c);
    x_get(&d);
    x_expect(&c, NET_UP_OK);
    x_expect(&d, NET_UP_OK);
    cr_assert_eq(g_peer.nconns, 2);
    x_free(&a);
    x_free(&b);
    x_free(&c);
    x_free(&d);
}

/* A server that keeps its connection after a chunked answer and closes it ms later: whether
 * the next chunked answer's connection is then pooled (1) or closed (0). */
static size_t pooled_after_a_close_at(int ms)
{
    peer_start(&g_peer, chunked_kept);
    up_new(NULL);
    ex_t a, b;
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    run_for(ms);
    peer_conn_close(g_peer.conns[0]);
    RUN_UNTIL(net_client_upstream_idle(g_up) == 0);
    x_get(&b);
    x_expect(&b, NET_UP_OK);
    cr_assert(!b.reused);
    size_t pooled = b.idle_at_done;
    x_free(&a);
    x_free(&b);
    return pooled;
}

/* A server that closes a little after its streams, past the settling: the close teaches its
 * habit all the same. */
Test(net_client, a_close_soon_after_a_chunked_answer_but_past_the_settling_is_learned)
{
    cr_assert_eq(pooled_after_a_close_at(150), 0, "a chunked answer's connection pooled again");
}

/* An idle close long after the stream (a keep-alive timeout) teaches nothing. */
Test(net_client, an_idle_close_long_after_a_chunked_answer_teaches_no_habit)
{
    cr_assert_eq(pooled_after_a_close_at(1100), 1, "judged to close after streams");
}

/* An answer with no length, ended by the connection's close. */
static void close_delimited_answer(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\nhello");
    peer_conn_close(c);
}

/* Taken as whole where a close cannot cut an answer that matters; refused on its head, before
 * the caller sees it, where the caller says a cut must not pass for an end. */
Test(net_client, an_answer_ended_by_its_close_is_refused_where_a_length_is_required)
{
    peer_start(&g_peer, close_delimited_answer);
    up_new(NULL);
    ex_t a, b;
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    cr_assert_eq(a.body.len, 5);
    x_get(&b);
    b.r->length_required = true;
    x_expect(&b, NET_UP_PROTOCOL);
    cr_assert_eq(b.heads, 0);
    cr_assert(strstr(b.detail, "Content-Length") != NULL, "%s", b.detail);
    x_free(&a);
    x_free(&b);
}

/* One that closed one by chance (a restart just after a stream): every REPROBE_EVERY-th
 * connection (64) its habit would close is pooled and held back instead; still open after the
 * settling, the habit is undone. */
static void close_after_the_first_chunked_answer(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, CHUNKED_OK);
    if (c->peer->requests == 1)
        peer_conn_close(c);
}

Test(net_client, a_server_judged_to_close_after_streams_is_tried_again)
{
    peer_start(&g_peer, close_after_the_first_chunked_answer);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_OK);
    x_free(&x);
    RUN_UNTIL(net_client_upstream_idle(g_up) == 0);
    int pooled_at = 0;
    for (int i = 1; i <= 64 && !pooled_at; i++) {
        x_get(&x);
        x_expect(&x, NET_UP_OK);
        cr_assert(!x.reused);
        if (x.idle_at_done)
            pooled_at = i;
        x_free(&x);
    }
    cr_assert_eq(pooled_at, 64, "tried again after %d", pooled_at);
    run_for(150);
    x_get(&x);
    x_expect(&x, NET_UP_OK);
    cr_assert(x.reused, "the server keeps them: its connection is taken");
    x_free(&x);
    x_get(&x);
    x_expect(&x, NET_UP_OK);
    cr_assert(x.reused);
    x_free(&x);
}

Test(net_client, reused_connection_closed_under_the_request_is_retryable)
{
    ex_t a, b;
    one_pooled(&a, answer_ok);
    /* The server's keep-alive close crosses the next request: the FIN is on its way before the
     * client's loop has seen it. */
    peer_conn_close(g_peer.conns[0]);
    x_get(&b);
    cr_assert_eq(net_client_upstream_idle(g_up), 0, "the pooled connection was not taken");
    x_expect(&b, NET_UP_REUSED_CLOSED);
    cr_assert(b.reused);
    cr_assert(net_up_err_retryable(b.err));
    cr_assert_str_eq(net_up_err_name(b.err), "reused_closed");
    cr_assert_eq(b.heads, 0);
    x_free(&a);
    x_free(&b);
}

/* The others the pool holds are as stale as the one found closed (a server's keep-alive
 * timeouts end them together): dropped with it, before its callback, so the retry it invites
 * goes over a new connection. The pool is last in, first out: the request takes the
 * connection that went idle last, whose close is sent first here, so the loop sees it before
 * the others' and only the drop can have emptied the pool by the callback. */
Test(net_client, a_reused_connection_found_closed_drops_the_other_pooled_ones)
{
    peer_start(&g_peer, answer_ok);
    up_new(NULL);
    ex_t a[3], b, c;
    for (int i = 0; i < 3; i++)
        x_get(&a[i]);
    for (int i = 0; i < 3; i++)
        x_expect(&a[i], NET_UP_OK);
    cr_assert_eq(net_client_upstream_idle(g_up), 3);
    for (int i = 2; i >= 0; i--)
        peer_conn_close(g_peer.conns[i]);
    x_get(&b);
    x_expect(&b, NET_UP_REUSED_CLOSED);
    cr_assert_eq(b.idle_at_done, 0);
    x_get(&c);
    x_expect(&c, NET_UP_OK);
    cr_assert(!c.reused);
    cr_assert_eq(g_peer.nconns, 4);
    for (int i = 0; i < 3; i++)
        x_free(&a[i]);
    x_free(&b);
    x_free(&c);
}

/* Answers the first request on each connection; reads the next whole, then closes without a
 * byte of answer. */
static void answer_once(peer_conn_t *c, int nth)
{
    if (nth == 1)
        answer_ok(c, nth);
    else
        peer_conn_close(c);
}

/* Reads the next request whole, then resets the connection (a proxy in front of an engine
 * that cut this side): its acknowledgement of the request, delayed, never goes out. */
static void answer_once_then_reset(peer_conn_t *c, int nth)
{
    if (nth == 1)
        answer_ok(c, nth);
    else
        peer_conn_reset(c);
}

/* A pooled connection the server closes after it read the next request, as script has it:
 * closed, and not to be sent again (the server may be working on it still). */
static void expect_read_then_closed(peer_script_cb script)
{
    ex_t a, b;
    one_pooled(&a, script);
    x_get(&b);
    x_expect(&b, NET_UP_CLOSED);
    cr_assert(b.reused);
    cr_assert(!net_up_err_retryable(b.err));
    cr_assert_eq(b.heads, 0);
    x_free(&a);
    x_free(&b);
}

/* A reset says nothing of what the server read (tcpi_bytes_acked may still be 0 although it
 * read every byte): not the keep-alive race. */
Test(net_client, a_reused_connection_reset_after_the_server_read_the_request_is_not_retryable)
{
    expect_read_then_closed(answer_once_then_reset);
}

/* The server took the request (its FIN acknowledged all of it) before it closed. */
Test(net_client, a_reused_connection_closed_after_the_server_took_the_request_is_not_retryable)
{
    expect_read_then_closed(answer_once);
}

Test(net_client, start_new_opens_a_connection_beside_a_pooled_one)
{
    ex_t a, b;
    one_pooled(&a, answer_ok);
    x_begin(&b, GET_REQ, false, false, true);
    cr_assert_eq(net_client_upstream_idle(g_up), 1, "the pooled connection was taken");
    x_expect(&b, NET_UP_OK);
    cr_assert(!b.reused);
    cr_assert_eq(g_peer.nconns, 2);
    cr_assert_eq(net_client_upstream_idle(g_up), 2);
    x_free(&a);
    x_free(&b);
}

Test(net_client, pooled_connection_the_server_closed_is_dropped_not_reused)
{
    ex_t a, b;
    one_pooled(&a, answer_ok);
    peer_conn_close(g_peer.conns[0]);
    RUN_UNTIL(net_client_upstream_idle(g_up) == 0);
    x_get(&b);
    x_expect(&b, NET_UP_OK);
    cr_assert(!b.reused);
    cr_assert_eq(g_peer.nconns, 2);
    x_free(&a);
    x_free(&b);
}

Test(net_client, fresh_connection_closed_before_a_response_is_not_retryable)
{
    peer_start(&g_peer, close_on_request);
    up_new(NULL);
    ex_t a;
    x_get(&a);
    x_expect(&a, NET_UP_CLOSED);
    cr_assert(!net_up_err_retryable(a.err));
    cr_assert_eq(g_peer.requests, 1);
    x_free(&a);
}

Test(net_client, connection_refused_is_connect_and_retryable)
{
    /* A port that was just free: bind it, note it, close it. */
    uv_tcp_t t;
    uv_tcp_init(&g_loop, &t);
    struct sockaddr_in a = loopback(0), b;
    cr_assert_eq(uv_tcp_bind(&t, (struct sockaddr *)&a, 0), 0);
    int len = sizeof(b);
    uv_tcp_getsockname(&t, (struct sockaddr *)&b, &len);
    uv_close((uv_handle_t *)&t, NULL);
    run_idle();
    g_up = net_upstream_new(&g_loop, (struct sockaddr *)&b, NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_CONNECT);
    cr_assert(net_up_err_retryable(x.err));
    cr_assert_str_eq(x.detail, uv_strerror(UV_ECONNREFUSED));
    x_free(&x);
}

Test(net_client, no_answer_within_first_byte_timeout)
{
    peer_start(&g_peer, answer_nothing);
    net_upstream_opts_t o = {.first_byte_timeout_ms = 50};
    up_new(&o);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_FIRST_BYTE_TIMEOUT);
    cr_assert(!net_up_err_retryable(x.err));
    cr_assert_eq(g_peer.requests, 1);
    cr_assert_eq(x.heads, 0);
    x_free(&x);
}

static void stall_mid_body(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc");
}

Test(net_client, silence_mid_body_is_idle_timeout)
{
    peer_start(&g_peer, stall_mid_body);
    net_upstream_opts_t o = {.idle_timeout_ms = 50};
    up_new(&o);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_IDLE_TIMEOUT);
    cr_assert_eq(x.status, 200);
    cr_assert_eq(x.body.len, 3);
    cr_assert_eq(net_client_upstream_idle(g_up), 0);
    x_free(&x);
}

static void short_body_then_close(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789");
    peer_conn_close(c);
}

Test(net_client, close_before_content_length_is_truncated)
{
    peer_start(&g_peer, short_body_then_close);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_TRUNCATED);
    cr_assert(!net_up_err_retryable(x.err));
    cr_assert_eq(x.body.len, 10);
    x_free(&x);
}

static void chunked_then_close(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n");
    peer_conn_close(c);
}

Test(net_client, close_before_the_last_chunk_is_truncated)
{
    peer_start(&g_peer, chunked_then_close);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_TRUNCATED);
    cr_assert_eq(x.body.len, 5);
    x_free(&x);
}

static void answer_in_pieces(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhel");
}

Test(net_client, content_length_body_arriving_in_pieces)
{
    peer_start(&g_peer, answer_in_pieces);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    RUN_UNTIL(x.body.len == 3);
    cr_assert(!x.done);
    cr_assert_eq(x.framing.content_length, 11);
    peer_writes(g_peer.conns[0], "lo world");
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(x.body.len, 11);
    cr_assert_eq(memcmp(x.body.base, "hello world", 11), 0);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    x_free(&x);
}

static void answer_chunked(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                   "5\r\nhello\r\n6;x=y\r\n world\r\n0\r\ntrailer: 1\r\n\r\n");
}

Test(net_client, chunked_body_is_decoded_and_the_connection_pooled)
{
    peer_start(&g_peer, answer_chunked);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_OK);
    cr_assert(x.framing.chunked);
    cr_assert_eq(x.body.len, 11);
    cr_assert_eq(memcmp(x.body.base, "hello world", 11), 0);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    x_free(&x);
}

static void answer_close_delimited(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\n\r\nabc");
    peer_conn_close(c);
}

Test(net_client, close_delimited_body_ends_at_eof)
{
    peer_start(&g_peer, answer_close_delimited);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(x.body.len, 3);
    cr_assert_eq(net_client_upstream_idle(g_up), 0);
    x_free(&x);
}

static void answer_head(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n");
}

Test(net_client, head_response_has_no_body_whatever_its_length)
{
    peer_start(&g_peer, answer_head);
    up_new(NULL);
    ex_t x;
    x_start(&x, "HEAD / HTTP/1.1\r\nhost: x\r\n\r\n", false, true);
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(x.body.len, 0);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    x_free(&x);
}

static void answer_interim_first(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 100 Continue\r\n\r\n"
                   "HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok");
}

Test(net_client, interim_response_is_skipped)
{
    peer_start(&g_peer, answer_interim_first);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(x.heads, 1);
    cr_assert_eq(x.status, 201);
    cr_assert_eq(x.body.len, 2);
    x_free(&x);
}

static void answer_huge_head(peer_conn_t *c, int nth)
{
    static char line[70000];
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\nx-big: ");
    memset(line, 'a', sizeof(line) - 1);
    peer_writes(c, line);
}

Test(net_client, response_head_over_the_limit_is_protocol)
{
    peer_start(&g_peer, answer_huge_head);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_PROTOCOL);
    cr_assert_eq(x.heads, 0);
    cr_assert(!net_up_err_retryable(x.err));
    x_free(&x);
}

static void answer_smuggled(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ntransfer-encoding: chunked\r\n\r\n"
                   "0\r\n\r\n");
}

Test(net_client, ambiguous_framing_is_protocol)
{
    peer_start(&g_peer, answer_smuggled);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_PROTOCOL);
    cr_assert_eq(x.heads, 0);
    RUN_UNTIL(g_peer.conns[0] == NULL || g_peer.conns[0]->eof);
    cr_assert_eq(net_client_upstream_idle(g_up), 0);
    x_free(&x);
}

static void answer_then_junk(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
}

Test(net_client, bytes_on_an_idle_pooled_connection_drop_it)
{
    peer_start(&g_peer, answer_then_junk);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    peer_writes(g_peer.conns[0], "HTTP/1.1 200 OK\r\n\r\n");
    RUN_UNTIL(net_client_upstream_idle(g_up) == 0);
    RUN_UNTIL(g_peer.conns[0]->eof);
    x_free(&x);
}

static void answer_after_body(peer_conn_t *c, int nth)
{
    (void)c;
    (void)nth; /* the test answers once the body is in */
}

Test(net_client, streamed_request_body_goes_out_exactly_as_written)
{
    peer_start(&g_peer, answer_after_body);
    up_new(NULL);
    ex_t x;
    const char *head = "POST / HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n";
    x_start(&x, head, true, false);
    uv_buf_t b1[3] = {uv_buf_init("5\r\n", 3), uv_buf_init("hello", 5), uv_buf_init("\r\n", 2)};
    cr_assert_eq(net_creq_write(x.r, b1, 3), 0);
    RUN_UNTIL(g_peer.nconns == 1 && g_peer.conns[0]->in.len == strlen(head) + 10);
    uv_buf_t b2 = uv_buf_init("0\r\n\r\n", 5);
    cr_assert_eq(net_creq_write(x.r, &b2, 1), 0);
    net_creq_end(x.r);
    dp_buf_t *in = &g_peer.conns[0]->in;
    RUN_UNTIL(in->len == strlen(head) + 15);
    cr_assert_eq(memcmp(in->base + strlen(head), "5\r\nhello\r\n0\r\n\r\n", 15), 0);
    answer_ok(g_peer.conns[0], 1);
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(net_client_upstream_idle(g_up), 1, "a fully sent request keeps the connection");
    x_free(&x);
}

static void answer_hello(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\nhello");
}

Test(net_client, paused_response_is_not_read_and_does_not_time_out)
{
    peer_start(&g_peer, answer_hello);
    /* 200 ms: the window the peer has after the resume, wide enough for a loaded machine. */
    net_upstream_opts_t o = {.idle_timeout_ms = 200};
    up_new(&o);
    ex_t x;
    x_get(&x);
    x.pause_in_body = true;
    RUN_UNTIL(x.body.len == 5);
    peer_writes(g_peer.conns[0], " world");
    /* Three idle timeouts go by while paused: nothing is read, nothing times out. */
    run_for(600);
    cr_assert(!x.done, "%s", x.detail);
    cr_assert_eq(x.body.len, 5);
    net_creq_resume(x.r);
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(x.body.len, 11);
    cr_assert_eq(memcmp(x.body.base, "hello world", 11), 0);
    x_free(&x);
}

Test(net_client, cancel_resets_the_connection_without_a_callback)
{
    peer_start(&g_peer, answer_nothing);
    up_new(NULL);
    ex_t x;
    x_get(&x);
    RUN_UNTIL(g_peer.requests == 1);
    net_creq_cancel(x.r);
    RUN_UNTIL(g_peer.conns[0]->eof);
    run_idle();
    cr_assert(!x.done);
    cr_assert_eq(net_client_upstream_idle(g_up), 0);
    x_free(&x);
}

static void answer_304_with_length(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 304 Not Modified\r\ncontent-length: 100\r\n\r\n");
}

Test(net_client, status_304_with_a_length_has_no_body_and_keeps_the_connection)
{
    peer_start(&g_peer, answer_304_with_length);
    up_new(NULL);
    ex_t a, b;
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    cr_assert_eq(a.status, 304);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    g_peer.script = answer_ok;
    x_get(&b);
    x_expect(&b, NET_UP_OK);
    cr_assert(b.reused);
    cr_assert_eq(b.body.len, 2);
    x_free(&a);
    x_free(&b);
}

static void answer_204_then_more(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno");
}

/* Bytes after a response that has no body, in the same read: the replica's framing is not
 * ours, so the connection is not reused (a response already waiting there would answer the
 * next request). */
Test(net_client, bytes_after_a_bodiless_response_close_the_connection)
{
    peer_start(&g_peer, answer_204_then_more);
    up_new(NULL);
    ex_t a, b;
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    cr_assert_eq(a.status, 204);
    cr_assert_eq(net_client_upstream_idle(g_up), 0, "pooled with bytes after the response");
    g_peer.script = answer_ok;
    x_get(&b);
    x_expect(&b, NET_UP_OK);
    cr_assert_not(b.reused);
    cr_assert_str_eq(b.body.base, "ok");
    x_free(&a);
    x_free(&b);
}

static void answer_early_then_wait(peer_conn_t *c, int nth)
{
    (void)nth;
    peer_writes(c, "HTTP/1.1 413 Content Too Large\r\ncontent-length: 0\r\n\r\n");
}

Test(net_client, answer_before_the_request_body_ends_is_not_pooled)
{
    peer_start(&g_peer, answer_early_then_wait);
    up_new(NULL);
    ex_t x;
    x_start(&x, "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n", true, false);
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(x.status, 413);
    cr_assert_eq(net_client_upstream_idle(g_up), 0, "pooled with 100 body bytes still owed");
    RUN_UNTIL(g_peer.conns[0] == NULL || g_peer.conns[0]->eof);
    x_free(&x);
}

static void stop_reading(peer_conn_t *c, int nth)
{
    (void)nth;
    uv_read_stop((uv_stream_t *)&c->tcp); /* a replica that stopped reading the upload */
}

/* Fill the socket with an upload the peer does not read: queued bytes stay in the client. */
static void upload_until_over(ex_t *x)
{
    static char chunk[256 * 1024];
    size_t sent = 0;
    while (!net_creq_over(x->r) && sent < (64u << 20)) {
        uv_buf_t b = uv_buf_init(chunk, sizeof(chunk));
        cr_assert_eq(net_creq_write(x->r, &b, 1), 0);
        sent += sizeof(chunk);
        run_idle();
    }
    cr_assert(net_creq_over(x->r), "never over high water after %zu bytes", sent);
}

Test(net_client, upload_to_a_replica_that_stops_reading_reports_over_then_drain)
{
    peer_start(&g_peer, stop_reading);
    net_upstream_opts_t o = {.write_high_water = 64 * 1024};
    up_new(&o);
    ex_t x;
    x_start(&x, "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 67108864\r\n\r\n", true, false);
    RUN_UNTIL(g_peer.requests == 1);
    upload_until_over(&x);
    cr_assert_gt(net_client_creq_pending(x.r), 64 * 1024);
    cr_assert_eq(x.drains, 0);
    peer_conn_t *pc = g_peer.conns[0];
    uv_read_start((uv_stream_t *)&pc->tcp, peer_alloc, peer_read);
    RUN_UNTIL(x.drains == 1);
    cr_assert_not(net_creq_over(x.r));
    net_creq_cancel(x.r);
    x_free(&x);
}

/* A 64 MiB upload begun (its head taken) to a replica that reads nothing more, on an upstream
 * whose idle timeout is 100 ms and first-byte timeout a minute. */
static void start_upload_to_a_stopped_reader(ex_t *x)
{
    peer_start(&g_peer, stop_reading);
    net_upstream_opts_t o = {
        .write_high_water = 64 * 1024, .idle_timeout_ms = 100, .first_byte_timeout_ms = 60000};
    up_new(&o);
    x_start(x, "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 67108864\r\n\r\n", true, false);
    RUN_UNTIL(g_peer.requests == 1);
}

/* A replica that stopped taking the upload is given up on after the idle timeout, not after
 * the first-byte timeout (minutes: the client would wait that long for nothing). */
Test(net_client, upload_the_replica_stops_taking_fails_after_the_idle_timeout)
{
    ex_t x;
    start_upload_to_a_stopped_reader(&x);
    upload_until_over(&x);
    uint64_t t0 = uv_now(&g_loop);
    x_expect(&x, NET_UP_SEND_TIMEOUT);
    cr_assert_geq(uv_now(&g_loop) - t0, 90, "failed before the idle timeout");
    cr_assert_not(net_up_err_retryable(x.err));
    cr_assert(strstr(x.detail, "100 ms"), "%s", x.detail);
    cr_assert_eq(net_client_upstream_idle(g_up), 0);
    x_free(&x);
}

/* A streamed upload in pieces small enough for the loop's write batch: each is written when
 * the loop iteration ends, and the one that finds the socket full queues there, not in the
 * call that handed it over. The replica that stopped taking them is caught all the same. */
Test(net_client, upload_in_small_pieces_the_replica_stops_taking_fails_after_the_idle_timeout)
{
    ex_t x;
    start_upload_to_a_stopped_reader(&x);
    static char piece[8 * 1024];
    size_t sent = 0;
    while (net_client_creq_pending(x.r) == 0 && sent < (64u << 20)) {
        uv_buf_t b = uv_buf_init(piece, sizeof(piece));
        cr_assert_eq(net_creq_write(x.r, &b, 1), 0);
        sent += sizeof(piece);
        run_idle(); /* the batch is written at the end of the iteration */
    }
    cr_assert_gt(net_client_creq_pending(x.r), 0, "never queued after %zu bytes", sent);
    x_expect(&x, NET_UP_SEND_TIMEOUT);
    x_free(&x);
}

static uv_timer_t g_late;

static void answer_late_cb(uv_timer_t *t)
{
    peer_writes(t->data, "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
}

/* Reads every byte of the request, then answers after 300 ms: a generation longer than the
 * idle timeout, which only the first-byte timeout bounds. */
static void read_all_then_answer_late(peer_conn_t *c, int nth)
{
    (void)nth;
    uv_timer_init(&g_loop, &g_late);
    g_late.data = c;
    uv_timer_start(&g_late, answer_late_cb, 300, 0);
}

Test(net_client, an_upload_taken_whole_waits_for_the_first_byte_timeout_only)
{
    peer_start(&g_peer, read_all_then_answer_late);
    net_upstream_opts_t o = {
        .write_high_water = 64 * 1024, .idle_timeout_ms = 100, .first_byte_timeout_ms = 5000};
    up_new(&o);
    ex_t x;
    static char body[8u << 20];
    char head[128];
    snprintf(head, sizeof(head), "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %zu\r\n\r\n",
             sizeof(body));
    x_start(&x, head, true, false);
    uv_buf_t b = uv_buf_init(body, sizeof(body));
    cr_assert_eq(net_creq_write(x.r, &b, 1), 0);
    cr_assert_gt(net_client_creq_pending(x.r), 0, "the upload was not queued at all");
    net_creq_end(x.r);
    x_expect(&x, NET_UP_OK);
    cr_assert_eq(x.status, 200);
    uv_close((uv_handle_t *)&g_late, NULL);
    x_free(&x);
}

/* A caller that paused its upload because the bytes waiting for the connect passed high water
 * hears on_drain once the connect hands them to a socket that took them: nothing else would
 * wake it (a socket that never went over high water never drains). */
Test(net_client, upload_over_high_water_while_connecting_drains_once_connected)
{
    peer_start(&g_peer, answer_nothing);
    net_upstream_opts_t o = {.write_high_water = 64 * 1024};
    up_new(&o);
    ex_t x;
    x_start(&x, "POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 1048576\r\n\r\n", true, false);
    static char chunk[96 * 1024];
    uv_buf_t b = uv_buf_init(chunk, sizeof(chunk));
    cr_assert_eq(net_creq_write(x.r, &b, 1), 0); /* still connecting: it waits */
    cr_assert(net_creq_over(x.r));
    RUN_UNTIL(x.drains == 1);
    cr_assert_not(net_creq_over(x.r));
    net_creq_cancel(x.r);
    x_free(&x);
}

/* ---- held new connections (net_creq_cb_t.on_connected, net_creq_release) ------------------ */

static int g_connected;
static bool g_release_at_once;

static void x_connected(net_creq_t *r)
{
    g_connected++;
    if (g_release_at_once)
        net_creq_release(r);
}

static const net_creq_cb_t x_held_cb = {.on_head = x_head,
                                        .on_body = x_body,
                                        .on_done = x_done,
                                        .on_drain = x_drain,
                                        .on_connected = x_connected};

/* A server answering 200, for exchanges over held new connections. */
static void held_peer(bool release_at_once)
{
    peer_start(&g_peer, answer_ok);
    up_new(NULL);
    g_connected = 0;
    g_release_at_once = release_at_once;
}

static void x_start_held(ex_t *x)
{
    memset(x, 0, sizeof(*x));
    static const char req[] = "GET / HTTP/1.1\r\nhost: x\r\n\r\n";
    uv_buf_t b = uv_buf_init((char *)req, sizeof(req) - 1);
    x->r = net_creq_start(g_up, &b, 1, false, false, &x_held_cb, x);
    cr_assert_not_null(x->r);
}

Test(net_client, a_held_connection_sends_nothing_until_released)
{
    held_peer(false);
    ex_t a;
    x_start_held(&a);
    RUN_UNTIL(g_connected == 1);
    /* Connected and held: a few more loop passes, and still nothing reached the server. */
    for (int i = 0; i < 20; i++)
        uv_run(&g_loop, UV_RUN_NOWAIT);
    cr_assert_eq(g_peer.nconns, 1);
    cr_assert_eq(g_peer.requests, 0, "a held connection sent its request");
    cr_assert(!a.done);
    net_creq_release(a.r);
    x_expect(&a, NET_UP_OK);
    cr_assert_eq(g_peer.requests, 1);
    cr_assert_eq(a.status, 200);
    /* Pooled like any other once its exchange ended; reused without being held. */
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    ex_t b;
    x_start_held(&b);
    x_expect(&b, NET_UP_OK);
    cr_assert(b.reused);
    cr_assert_eq(g_connected, 1, "a pooled connection was held");
    x_free(&a);
    x_free(&b);
}

Test(net_client, a_held_connection_the_server_closes_fails_as_never_sent)
{
    held_peer(false);
    ex_t a;
    x_start_held(&a);
    RUN_UNTIL(g_connected == 1 && g_peer.nconns == 1);
    peer_conn_close(g_peer.conns[0]);
    x_expect(&a, NET_UP_SEND);
    cr_assert(net_up_err_retryable(a.err), "a request that never left is retryable");
    cr_assert_eq(g_peer.requests, 0);
    x_free(&a);
}

Test(net_client, a_connection_released_in_its_callback_goes_on_at_once)
{
    held_peer(true);
    ex_t a;
    x_start_held(&a);
    x_expect(&a, NET_UP_OK);
    cr_assert_eq(g_connected, 1);
    cr_assert_eq(a.status, 200);
    x_free(&a);
}

Test(net_client, a_held_connection_the_server_speaks_on_first_fails_as_never_sent)
{
    held_peer(false);
    ex_t a;
    x_start_held(&a);
    RUN_UNTIL(g_connected == 1 && g_peer.nconns == 1);
    peer_writes(g_peer.conns[0], "HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nno");
    x_expect(&a, NET_UP_SEND);
    cr_assert_eq(a.heads, 0, "unrequested bytes were taken for the response");
    cr_assert(net_up_err_retryable(a.err));
    cr_assert_eq(g_peer.requests, 0);
    x_free(&a);
}

/* ---- start bytes sent from where they lie (net_creq_cb_t.start_bufs_kept) ----------------- */

static const net_creq_cb_t x_kept_cb = {.on_head = x_head,
                                        .on_body = x_body,
                                        .on_done = x_done,
                                        .on_drain = x_drain,
                                        .start_bufs_kept = true};
static const net_creq_cb_t x_kept_held_cb = {.on_head = x_head,
                                             .on_body = x_body,
                                             .on_done = x_done,
                                             .on_drain = x_drain,
                                             .on_connected = x_connected,
                                             .start_bufs_kept = true};

/* The request as the peer received it on its first connection. */
static const char *peer_got(void)
{
    return g_peer.nconns ? g_peer.conns[0]->in.base : "";
}

/* Start "GET /a" over a new connection, overwrite the caller's buffer with "GET /b" at once,
 * and return whether the peer received the request as it was at the start. */
static bool sent_as_at_start(const net_creq_cb_t *cb)
{
    peer_start(&g_peer, answer_ok);
    up_new(NULL);
    char req[] = "GET /a HTTP/1.1\r\nhost: x\r\n\r\n";
    uv_buf_t b = uv_buf_init(req, sizeof(req) - 1);
    ex_t x;
    memset(&x, 0, sizeof(x));
    x.r = net_creq_start(g_up, &b, 1, false, false, cb, &x);
    cr_assert_not_null(x.r);
    req[5] = 'b'; /* still connecting */
    x_expect(&x, NET_UP_OK);
    x_free(&x);
    cr_assert(strstr(peer_got(), "GET /a ") || strstr(peer_got(), "GET /b "), "got: %s",
              peer_got());
    return strstr(peer_got(), "GET /a ") != NULL;
}

Test(net_client, kept_start_bytes_are_sent_from_the_callers_memory_once_connected)
{
    cr_assert_not(sent_as_at_start(&x_kept_cb), "a copy taken at the start was sent");
}

Test(net_client, start_bytes_not_kept_are_copied_at_the_start)
{
    cr_assert(sent_as_at_start(&x_cb), "the caller's later bytes were sent");
}

/* A held connection sends the kept bytes at its release, then streamed bytes after them; a
 * cancelled one never reads them again (the buffer is freed at once: ASan would see a read). */
Test(net_client, kept_start_bytes_wait_for_the_release_and_precede_streamed_ones)
{
    held_peer(false);
    char *head = strdup("POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\n");
    uv_buf_t b = uv_buf_init(head, (unsigned)strlen(head));
    ex_t a;
    memset(&a, 0, sizeof(a));
    a.r = net_creq_start(g_up, &b, 1, true, false, &x_kept_held_cb, &a);
    uv_buf_t body = uv_buf_init("ab", 2);
    cr_assert_eq(net_creq_write(a.r, &body, 1), 0);
    cr_assert_eq(net_client_creq_pending(a.r), strlen(head) + 2);
    RUN_UNTIL(g_connected == 1 && g_peer.nconns == 1);
    body = uv_buf_init("cd", 2);
    cr_assert_eq(net_creq_write(a.r, &body, 1), 0);
    net_creq_end(a.r);
    net_creq_release(a.r);
    x_expect(&a, NET_UP_OK);
    cr_assert(strstr(peer_got(), "\r\n\r\nabcd") != NULL, "got: %s", peer_got());
    free(head);

    ex_t c; /* a second exchange while the first connection is busy in the pool: a new one */
    char *h2 = strdup("GET /c HTTP/1.1\r\nhost: x\r\n\r\n");
    b = uv_buf_init(h2, (unsigned)strlen(h2));
    ex_t d;
    memset(&d, 0, sizeof(d));
    d.r = net_creq_start(g_up, &b, 1, false, false, &x_kept_held_cb, &d); /* reuses a's */
    memset(&c, 0, sizeof(c));
    c.r = net_creq_start(g_up, &b, 1, false, false, &x_kept_held_cb, &c); /* a new one */
    net_creq_cancel(c.r);
    x_expect(&d, NET_UP_OK);
    free(h2);
    for (int i = 0; i < 20; i++)
        uv_run(&g_loop, UV_RUN_NOWAIT);
    cr_assert_eq(g_peer.requests, 2, "the cancelled exchange sent its bytes");
    x_free(&a);
    x_free(&d);
}

static void ok_then_nothing(peer_conn_t *c, int nth)
{
    if (nth == 1)
        answer_ok(c, nth);
}

/* An upstream connection's timer is left running when a deadline moves later: a pooled
 * connection (pooled-idle deadline 200 ms) reused 100 ms later must get its whole first-byte
 * timeout (600 ms), not fail when the pooled-idle timer it kept fires. */
Test(net_client, a_reused_connection_gets_its_whole_first_byte_timeout)
{
    peer_start(&g_peer, ok_then_nothing);
    net_upstream_opts_t o = {.idle_timeout_ms = 200, .first_byte_timeout_ms = 600};
    up_new(&o);
    ex_t a, b;
    x_get(&a);
    x_expect(&a, NET_UP_OK);
    run_for(100);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    uint64_t t0 = uv_now(&g_loop);
    x_get(&b);
    RUN_UNTIL_MS(b.done, 3000);
    cr_assert(b.reused);
    cr_assert_eq(b.err, NET_UP_FIRST_BYTE_TIMEOUT, "%s", net_up_err_name(b.err));
    cr_assert_geq(uv_now(&g_loop) - t0, 580, "failed after %llu ms",
                  (unsigned long long)(uv_now(&g_loop) - t0));
    x_free(&a);
    x_free(&b);
}

/* ---- drains -------------------------------------------------------------------------------- */

static peer_conn_t *g_waiting; /* the connection whose request waits for its answer */

static void keep_waiting(peer_conn_t *c, int nth)
{
    (void)nth;
    g_waiting = c;
}

static int g_drained; /* drain callbacks run */

static void count_drained(void *data, uint64_t left_ms)
{
    (void)left_ms;
    cr_assert_eq(data, &g_drained);
    g_drained++;
}

static const char ANSWER[] = "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";

/* A GET the peer has read and leaves unanswered (g_waiting is its connection), on a new
 * upstream with options o. */
static void start_unanswered(ex_t *x, const net_upstream_opts_t *o)
{
    peer_start(&g_peer, keep_waiting);
    up_new(o);
    g_drained = 0;
    x_get(x);
    RUN_UNTIL(g_peer.requests == 1);
}

/* A drained exchange is read to its end and dropped: its owner's callbacks no longer run,
 * the drain's runs once, and the connection, answered cleanly, is pooled. */
Test(net_client, a_drain_reads_the_answer_to_its_end_and_calls_back_once)
{
    ex_t x;
    start_unanswered(&x, &(net_upstream_opts_t){0});
    net_drains_t set = {0};
    net_creq_drain(x.r, &set, 5000, count_drained, &g_drained);
    peer_writes(g_waiting, ANSWER);
    RUN_UNTIL(g_drained == 1);
    cr_assert_null(set.head);
    cr_assert_eq(x.heads, 0);
    cr_assert_not(x.done);
    cr_assert_eq(x.body.len, 0);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    x_free(&x);
}

/* Silence mid-answer does not end a drain (a long prefill behind an early head): the answer
 * that then comes ends it, whole (the time left it reports is 0), and its connection is
 * pooled. */
static uint64_t g_left = 1;
static void note_left(void *data, uint64_t left_ms)
{
    (void)data;
    g_left = left_ms;
    g_drained++;
}

Test(net_client, silence_mid_answer_does_not_end_a_drain)
{
    ex_t x;
    start_unanswered(&x, &(net_upstream_opts_t){.idle_timeout_ms = 30});
    peer_writes(g_waiting, "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhe");
    RUN_UNTIL(x.heads == 1);
    net_drains_t set = {0};
    net_creq_drain(x.r, &set, 5000, note_left, NULL);
    run_for(120); /* four idle timeouts */
    cr_assert_eq(g_drained, 0, "ended by silence");
    peer_writes(g_waiting, "llo");
    RUN_UNTIL(g_drained == 1);
    cr_assert_eq(g_left, 0);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    x_free(&x);
}

/* A drain whose answer's head begins and stalls part-way (a status line cut short, an interim
 * 103 before a long prefill) is not ended by that: its deadline ends it, and the rest of the
 * answer, when it comes, does. */
Test(net_client, a_head_stalled_part_way_does_not_end_a_drain)
{
    ex_t x;
    start_unanswered(&x, &(net_upstream_opts_t){.first_byte_timeout_ms = 30});
    net_drains_t set = {0};
    net_creq_drain(x.r, &set, 5000, note_left, NULL);
    peer_writes(g_waiting, "HTTP/1.1 2");
    run_for(120); /* four first-byte timeouts */
    cr_assert_eq(g_drained, 0, "ended by a head stalled part-way");
    peer_writes(g_waiting, "00 OK\r\ncontent-length: 2\r\n\r\nok");
    RUN_UNTIL(g_drained == 1);
    cr_assert_eq(g_left, 0);
    x_free(&x);
}

static net_drains_t g_told_set;

/* Told that its answer fell silent: it keeps the exchange as a drain. */
static void x_silent_drain(net_creq_t *r, net_up_err_t err, const char *detail)
{
    cr_assert_eq(err, NET_UP_IDLE_TIMEOUT, "told %d (%s)", (int)err, detail);
    ((ex_t *)r->data)->drains++;
    net_creq_drain(r, &g_told_set, 5000, count_drained, &g_drained);
}

/* A head that begins and stalls is an answer fallen silent: its owner is told so
 * (NET_UP_IDLE_TIMEOUT), as mid-body, and may keep the exchange as a drain. */
Test(net_client, a_head_stalled_part_way_is_told_as_silence)
{
    peer_start(&g_peer, keep_waiting);
    up_new(&(net_upstream_opts_t){.first_byte_timeout_ms = 30});
    g_drained = 0;
    g_told_set = (net_drains_t){0};
    static const net_creq_cb_t told = {
        .on_head = x_head, .on_body = x_body, .on_done = x_done, .on_timeout = x_silent_drain};
    ex_t x;
    memset(&x, 0, sizeof(x));
    uv_buf_t req = uv_buf_init((char *)GET_REQ, (unsigned)strlen(GET_REQ));
    x.r = net_creq_start(g_up, &req, 1, false, false, &told, &x);
    RUN_UNTIL(g_peer.requests == 1);
    peer_writes(g_waiting, "HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 2");
    RUN_UNTIL(x.drains == 1);
    cr_assert_not(x.done);
    run_for(60);
    cr_assert_eq(g_drained, 0);
    peer_writes(g_waiting, "00 OK\r\ncontent-length: 2\r\n\r\nok");
    RUN_UNTIL(g_drained == 1);
    cr_assert_not(x.done);
    cr_assert_eq(x.heads, 0);
}

/* An exchange paused by its owner (a slow client) is read again once it is a drain. */
Test(net_client, a_paused_exchange_is_read_again_once_drained)
{
    ex_t x;
    start_unanswered(&x, &(net_upstream_opts_t){0});
    net_creq_pause(x.r);
    net_drains_t set = {0};
    net_creq_drain(x.r, &set, 5000, count_drained, &g_drained);
    peer_writes(g_waiting, ANSWER);
    RUN_UNTIL(g_drained == 1);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);
    x_free(&x);
}

/* A drain lasts max_ms at most: its first-byte timeout before then does not end it, and an
 * answer that comes in that time does; with none, it ends at max_ms. */
Test(net_client, a_drain_outlives_its_first_byte_timeout_until_its_deadline)
{
    ex_t x;
    start_unanswered(&x, &(net_upstream_opts_t){.first_byte_timeout_ms = 50});
    net_drains_t set = {0};
    net_creq_drain(x.r, &set, 300, count_drained, &g_drained);
    run_for(150); /* three first-byte timeouts: kept */
    cr_assert_eq(g_drained, 0);
    peer_writes(g_waiting, ANSWER);
    RUN_UNTIL(g_drained == 1);
    cr_assert_eq(net_client_upstream_idle(g_up), 1);

    uint64_t t0 = uv_now(&g_loop);
    x_get(&x);
    RUN_UNTIL(g_peer.requests == 2);
    net_creq_drain(x.r, &set, 200, count_drained, &g_drained);
    RUN_UNTIL(g_drained == 2);
    uint64_t took = uv_now(&g_loop) - t0;
    cr_assert(took >= 190 && took < 600, "ended after %llu ms", (unsigned long long)took);
    cr_assert_null(set.head);
    x_free(&x);
}

static void stream_forever(peer_conn_t *c, int nth)
{
    (void)nth;
    g_waiting = c;
    peer_writes(c, "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n");
}

/* An answer that never ends (a stream an engine generates on and on) ends the drain at its
 * deadline, though it never falls silent for the idle timeout. */
Test(net_client, a_drain_of_an_endless_answer_ends_at_its_deadline)
{
    peer_start(&g_peer, stream_forever);
    /* The idle timeout is ten chunks long: a loaded machine (sanitizers, tests beside) may stall
     * this thread for a few chunks' time without the answer falling silent for it. */
    up_new(&(net_upstream_opts_t){.idle_timeout_ms = 200});
    g_drained = 0;
    ex_t x;
    x_get(&x);
    RUN_UNTIL(x.heads == 1);
    net_drains_t set = {0};
    uint64_t t0 = uv_now(&g_loop);
    net_creq_drain(x.r, &set, 500, count_drained, &g_drained);
    for (int i = 0; i < 150 && g_drained == 0; i++) {
        run_for(20); /* a chunk every 20 ms: never idle for 200 */
        if (g_drained == 0)
            peer_writes(g_waiting, "5\r\nhello\r\n");
    }
    uint64_t took = uv_now(&g_loop) - t0;
    cr_assert_eq(g_drained, 1);
    cr_assert(took >= 490 && took < 1500, "ended after %llu ms", (unsigned long long)took);
    cr_assert_null(set.head);
    x_free(&x);
}

static net_drains_t g_fbt_set;

static void drain_at_first_byte_timeout(net_creq_t *r, net_up_err_t err, const char *detail)
{
    cr_assert_eq(err, NET_UP_FIRST_BYTE_TIMEOUT, "told %d (%s)", (int)err, detail);
    ((ex_t *)r->data)->heads = -1; /* told */
    net_creq_drain(r, &g_fbt_set, 300, count_drained, &g_drained);
}

/* The owner told of a first-byte timeout may keep the exchange as a drain, which has its
 * more_ms at once; the owner's on_done never runs. */
Test(net_client, a_first_byte_timeout_callback_may_keep_the_exchange_as_a_drain)
{
    static const net_creq_cb_t cb = {.on_head = x_head,
                                     .on_body = x_body,
                                     .on_done = x_done,
                                     .on_timeout = drain_at_first_byte_timeout};
    peer_start(&g_peer, keep_waiting);
    up_new(&(net_upstream_opts_t){.first_byte_timeout_ms = 50});
    g_fbt_set = (net_drains_t){0};
    g_drained = 0;
    ex_t x = {0};
    uv_buf_t b = uv_buf_init("GET / HTTP/1.1\r\nhost: x\r\n\r\n", 27);
    x.r = net_creq_start(g_up, &b, 1, false, false, &cb, &x);
    RUN_UNTIL(x.heads == -1);
    cr_assert_not_null(g_fbt_set.head);
    run_for(150);
    cr_assert_eq(g_drained, 0);
    peer_writes(g_waiting, ANSWER);
    RUN_UNTIL(g_drained == 1);
    cr_assert_not(x.done);
    cr_assert_null(g_fbt_set.head);
    x_free(&x);
}

/* Stopping a set ends each of its drains at once: the connection closed (never pooled), the
 * callback run. */
Test(net_client, stopping_a_set_ends_every_drain_in_it)
{
    peer_start(&g_peer, keep_waiting);
    up_new(&(net_upstream_opts_t){0});
    net_drains_t set = {0};
    g_drained = 0;
    ex_t x[3];
    for (int i = 0; i < 3; i++) {
        x_get(&x[i]);
        RUN_UNTIL(g_peer.requests == i + 1);
        net_creq_drain(x[i].r, &set, 1000, count_drained, &g_drained);
    }
    net_drains_stop(&set);
    cr_assert_eq(g_drained, 3);
    cr_assert_null(set.head);
    run_idle();
    cr_assert_eq(net_client_upstream_idle(g_up), 0);
    for (int i = 0; i < 3; i++)
        x_free(&x[i]);
}
