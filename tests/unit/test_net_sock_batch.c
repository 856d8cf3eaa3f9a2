/* net/sock.c write batching: small writes wait for the end of the loop iteration and then go
 * out in order; a close, a shutdown or a large write on the same connection sends what waits
 * first; a write from a timer callback is not held until the next event; the batch's handles
 * leave with the last socket so the loop closes cleanly. Peers are plain blocking sockets on
 * loopback, read with MSG_DONTWAIT right after the writing callback (loopback delivers inside
 * the sender's syscall, so "not there yet" means "not written yet"). */
#include <criterion/criterion.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "net/sock.h"

typedef struct {
    uv_loop_t loop;
    int lfd;
    struct sockaddr_in addr;
} env_t;

typedef struct {
    net_sock_t s;
    int connected; /* 1 ok, -1 failed */
    int closed;
    int peer; /* accepted fd */
} conn_t;

static void on_connect(net_sock_t *s, int status)
{
    ((conn_t *)s->owner)->connected = status == 0 ? 1 : -1;
}

static void on_read(net_sock_t *s, const char *p, size_t n)
{
    (void)s, (void)p, (void)n;
}

static void on_close(net_sock_t *s)
{
    ((conn_t *)s->owner)->closed = 1;
}

static void env_init(env_t *e)
{
    cr_assert_eq(uv_loop_init(&e->loop), 0);
    e->lfd = socket(AF_INET, SOCK_STREAM, 0);
    cr_assert_geq(e->lfd, 0);
    memset(&e->addr, 0, sizeof(e->addr));
    e->addr.sin_family = AF_INET;
    e->addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    cr_assert_eq(bind(e->lfd, (struct sockaddr *)&e->addr, sizeof(e->addr)), 0);
    socklen_t l = sizeof(e->addr);
    cr_assert_eq(getsockname(e->lfd, (struct sockaddr *)&e->addr, &l), 0);
    cr_assert_eq(listen(e->lfd, 16), 0);
}

static void conn_open(env_t *e, conn_t *c)
{
    memset(c, 0, sizeof(*c));
    cr_assert_eq(net_sock_init(&e->loop, &c->s, c), 0);
    c->s.on_connect = on_connect;
    c->s.on_close = on_close;
    cr_assert_eq(net_sock_connect(&c->s, (struct sockaddr *)&e->addr), 0);
    while (c->connected == 0)
        uv_run(&e->loop, UV_RUN_ONCE);
    cr_assert_eq(c->connected, 1);
    c->peer = accept(e->lfd, NULL, NULL);
    cr_assert_geq(c->peer, 0);
    /* Reading keeps the loop's poll willing to block: a batch must not wait on that. */
    c->s.on_read = on_read;
    cr_assert_eq(net_sock_read_start(&c->s), 0);
}

/* What the peer has now, without waiting: into buf (NUL-terminated); -1 when nothing. */
static ssize_t peek_now(int fd, char *buf, size_t cap)
{
    ssize_t n = recv(fd, buf, cap - 1, MSG_DONTWAIT);
    buf[n > 0 ? n : 0] = '\0';
    return n < 0 && errno == EAGAIN ? -1 : n;
}

/* Everything until EOF (blocking; the writer has closed or shut down). */
static size_t read_all(int fd, char *buf, size_t cap)
{
    size_t got = 0;
    for (;;) {
        ssize_t n = recv(fd, buf + got, cap - 1 - got, 0);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    buf[got] = '\0';
    return got;
}

static int write_str(conn_t *c, const char *p)
{
    uv_buf_t b = uv_buf_init((char *)p, (unsigned)strlen(p));
    return net_sock_write(&c->s, &b, 1);
}

static void env_close(env_t *e, conn_t *cs, int n)
{
    for (int i = 0; i < n; i++)
        if (!cs[i].s.closing)
            net_sock_close(&cs[i].s);
    uv_run(&e->loop, UV_RUN_DEFAULT);
    for (int i = 0; i < n; i++) {
        cr_assert_eq(cs[i].closed, 1);
        close(cs[i].peer);
    }
    close(e->lfd);
    /* The batch's check and idle handles went with the last socket. */
    cr_assert_eq(uv_loop_close(&e->loop), 0);
}

/* ---- a timer callback that writes, then records what the peers saw at once ---------------- */

typedef struct {
    conn_t *c;
    int n;
    void (*act)(conn_t *c, int n);
    ssize_t seen_at_once[4];
    char seen[4][64]; /* those bytes */
    int fired;
} job_t;

static void job_cb(uv_timer_t *t)
{
    job_t *j = t->data;
    j->act(j->c, j->n);
    for (int i = 0; i < j->n; i++)
        j->seen_at_once[i] = peek_now(j->c[i].peer, j->seen[i], sizeof(j->seen[i]));
    j->fired = 1;
}

static void guard_cb(uv_timer_t *t)
{
    *(int *)t->data = 1;
}

static void run_job(env_t *e, job_t *j)
{
    uv_timer_t t, guard;
    int guard_fired = 0;
    uv_timer_init(&e->loop, &t);
    uv_timer_init(&e->loop, &guard);
    t.data = j;
    guard.data = &guard_fired;
    uv_timer_start(&t, job_cb, 0, 0);
    uv_timer_start(&guard, guard_cb, 10000, 0);
    /* The timer runs before the poll phase, and the sockets are reading, so the poll would
     * block: the batch's idle handle must keep it from doing so, so the same iteration writes
     * the batch and uv_run returns long before the guard timer is due. */
    while (!j->fired)
        uv_run(&e->loop, UV_RUN_ONCE);
    cr_expect_eq(guard_fired, 0, "the iteration that wrote waited for the next event");
    uv_close((uv_handle_t *)&t, NULL);
    uv_close((uv_handle_t *)&guard, NULL);
    uv_run(&e->loop, UV_RUN_NOWAIT);
}

static void act_two(conn_t *c, int n)
{
    cr_assert_eq(write_str(&c[0], "hello "), 0);
    cr_assert_eq(write_str(&c[0], "world"), 0);
    cr_assert_eq(write_str(&c[1], "other"), 0);
}

Test(net_sock_batch, small_writes_wait_for_the_end_of_the_iteration, .timeout = 60)
{
    env_t e;
    env_init(&e);
    conn_t c[2];
    conn_open(&e, &c[0]);
    conn_open(&e, &c[1]);
    job_t j = {.c = c, .n = 2, .act = act_two};
    run_job(&e, &j);
    cr_expect_eq(j.seen_at_once[0], -1, "written inside the callback: not batched");
    cr_expect_eq(j.seen_at_once[1], -1, "written inside the callback: not batched");
    char buf[64];
    cr_assert_gt(peek_now(c[0].peer, buf, sizeof(buf)), 0, "batch not written by the iteration");
    cr_expect_str_eq(buf, "hello world");
    cr_assert_gt(peek_now(c[1].peer, buf, sizeof(buf)), 0);
    cr_expect_str_eq(buf, "other");
    env_close(&e, c, 2);
}

static void act_interleaved(conn_t *c, int n)
{
    cr_assert_eq(write_str(&c[0], "one "), 0);
    cr_assert_eq(write_str(&c[1], "other"), 0);
    cr_assert_eq(write_str(&c[0], "two "), 0);
    cr_assert_eq(write_str(&c[1], " more"), 0);
    cr_assert_eq(write_str(&c[0], "three"), 0);
}

Test(net_sock_batch, interleaved_connections_keep_each_ones_order, .timeout = 60)
{
    env_t e;
    env_init(&e);
    conn_t c[2];
    conn_open(&e, &c[0]);
    conn_open(&e, &c[1]);
    job_t j = {.c = c, .n = 2, .act = act_interleaved};
    run_job(&e, &j);
    for (int i = 0; i < 2; i++) {
        char rest[64];
        if (peek_now(c[i].peer, rest, sizeof(rest)) < 0)
            rest[0] = '\0';
        char all[128];
        snprintf(all, sizeof(all), "%s%s", j.seen_at_once[i] > 0 ? j.seen[i] : "", rest);
        cr_expect_str_eq(all, i == 0 ? "one two three" : "other more");
    }
    env_close(&e, c, 2);
}

static void act_write_close(conn_t *c, int n)
{
    cr_assert_eq(write_str(&c[0], "last words"), 0);
    net_sock_close(&c[0].s);
}

/* act writes `want` and then ends the connection (close, shutdown): the bytes went out when
 * it ended, inside the callback, and the peer then sees EOF. */
static void expect_sent_then_eof(void (*act)(conn_t *c, int n), const char *want)
{
    env_t e;
    env_init(&e);
    conn_t c[1];
    conn_open(&e, &c[0]);
    job_t j = {.c = c, .n = 1, .act = act};
    run_job(&e, &j);
    cr_expect_str_eq(j.seen[0], want, "written when the connection ended");
    uv_run(&e.loop, UV_RUN_NOWAIT); /* a shutdown request completes */
    char buf[64];
    cr_expect_eq(read_all(c[0].peer, buf, sizeof(buf)), 0, "then EOF");
    env_close(&e, c, 1);
}

Test(net_sock_batch, a_close_right_after_a_write_still_sends_it, .timeout = 60)
{
    expect_sent_then_eof(act_write_close, "last words");
}

static void act_write_shutdown(conn_t *c, int n)
{
    cr_assert_eq(write_str(&c[0], "then FIN"), 0);
    net_sock_shutdown(&c[0].s, true);
}

Test(net_sock_batch, a_shutdown_after_a_write_sends_the_bytes_before_the_fin, .timeout = 60)
{
    expect_sent_then_eof(act_write_shutdown, "then FIN");
}

static char big[40000];

static void act_small_then_big(conn_t *c, int n)
{
    cr_assert_eq(write_str(&c[0], "head:"), 0);
    memset(big, 'b', sizeof(big) - 1);
    big[sizeof(big) - 1] = '\0';
    cr_assert_eq(write_str(&c[0], big), 0);
}

Test(net_sock_batch, a_large_write_goes_at_once_after_what_waits, .timeout = 60)
{
    env_t e;
    env_init(&e);
    conn_t c[1];
    conn_open(&e, &c[0]);
    job_t j = {.c = c, .n = 1, .act = act_small_then_big};
    run_job(&e, &j);
    cr_assert_gt(j.seen_at_once[0], 5, "a large write is not batched");
    cr_expect_eq(strncmp(j.seen[0], "head:bbb", 8), 0, "what waited goes first: %s", j.seen[0]);
    static char got[sizeof(big) + 16];
    net_sock_close(&c[0].s);
    uv_run(&e.loop, UV_RUN_NOWAIT);
    size_t n = read_all(c[0].peer, got, sizeof(got));
    cr_expect_eq(n + (size_t)j.seen_at_once[0], 5 + sizeof(big) - 1);
    env_close(&e, c, 1);
}

static void act_many_small(conn_t *c, int n)
{
    static char kb[1025];
    memset(kb, 'k', 1024);
    for (int i = 0; i < 100; i++)
        cr_assert_eq(write_str(&c[0], kb), 0);
}

Test(net_sock_batch, a_writer_producing_a_lot_in_one_callback_is_not_held_back, .timeout = 60)
{
    /* 100 KB in 1 KB writes: past the batch's bound the bytes go to the kernel (and what it
     * does not take queues, visible to net_sock_over), instead of all waiting in the batch. */
    env_t e;
    env_init(&e);
    conn_t c[1];
    conn_open(&e, &c[0]);
    job_t j = {.c = c, .n = 1, .act = act_many_small};
    run_job(&e, &j);
    cr_expect_gt(j.seen_at_once[0], 0, "all 100 KB waited for the end of the iteration");
    env_close(&e, c, 1);
}

/* 8 connections, 5 rounds of 8,000 bytes each, one connection after another: 320 KB in one
 * callback. Each connection's batch stays under its own bound, but the loop's batch would hold
 * their sum: past its total bound the writes go at once, so the last round reaches every peer
 * inside the callback (without the bound, each connection's last 8,000 bytes would wait). */
enum { MANY = 8, ROUNDS = 5, CHUNK = 8000 };

typedef struct {
    conn_t *c;
    size_t got[MANY];
    int fired;
} many_t;

static void many_cb(uv_timer_t *t)
{
    many_t *m = t->data;
    static char chunk[CHUNK + 1];
    memset(chunk, 'm', CHUNK);
    for (int r = 0; r < ROUNDS; r++)
        for (int i = 0; i < MANY; i++)
            cr_assert_eq(write_str(&m->c[i], chunk), 0);
    static char buf[ROUNDS * CHUNK + 1];
    for (int i = 0; i < MANY; i++) {
        ssize_t n;
        while (m->got[i] < sizeof(buf) - 1 &&
               (n = recv(m->c[i].peer, buf, sizeof(buf) - 1 - m->got[i], MSG_DONTWAIT)) > 0)
            m->got[i] += (size_t)n;
    }
    m->fired = 1;
}

Test(net_sock_batch, the_loops_whole_batch_is_bounded, .timeout = 60)
{
    env_t e;
    env_init(&e);
    conn_t c[MANY];
    for (int i = 0; i < MANY; i++)
        conn_open(&e, &c[i]);
    many_t m = {.c = c};
    uv_timer_t t;
    uv_timer_init(&e.loop, &t);
    t.data = &m;
    uv_timer_start(&t, many_cb, 0, 0);
    while (!m.fired)
        uv_run(&e.loop, UV_RUN_ONCE);
    for (int i = 0; i < MANY; i++)
        cr_expect_eq(m.got[i], (size_t)ROUNDS * CHUNK, "connection %d: %zu bytes at once", i,
                     m.got[i]);
    uv_close((uv_handle_t *)&t, NULL);
    env_close(&e, c, MANY);
}
