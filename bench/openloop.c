/* bench-load: the load generators `make bench` needs beyond wrk. One thread, plain epoll,
 * llhttp (the build's static copy) for response framing. Three modes:
 *
 *   rate   Open loop: request i is due at t0 + i/RATE whatever happened to earlier ones, and its
 *          latency is measured from that due time, not from when it was written. A response
 *          that keeps every connection busy therefore delays later sends, and that wait is
 *          charged to them: queueing is part of the number (no coordinated omission). Timeouts
 *          use epoll_pwait2 (ns resolution) so the schedule is kept without spinning.
 *   sse    --conns streaming requests at a time, each re-sent when it ends, for --duration s.
 *          The upstream (bench/upstream.c) puts "@<CLOCK_MONOTONIC ns>" in every event; for
 *          each one we record (time the read returned) - (that stamp). Same clock, same host.
 *          --ramp S opens stream i (connection and first request) at t0 + i*S/conns, so
 *          thousands of streams neither flood the listener's accept backlog nor tick in phase;
 *          recording starts --warmup s after the last one opened.
 *   idle   Open --conns connections, send one request on each (batches of 128, each waiting
 *          for its answers), print "READY n" and keep them all open and idle until SIGTERM or
 *          --duration s.
 *
 * Output: one line "LOADJSON {...}" on stdout (rate, sse), latencies in microseconds.
 * Usage: bench-load MODE --target HOST:PORT [--path P] [--body FILE] [--rate R] [--conns C]
 *                   [--duration S] [--warmup S] [--ramp S] [--header "Name: value"]...
 *
 * Samples are kept whole (8 bytes each) and sorted at the end: exact percentiles, and a 5 s run
 * at 50k rps is only 2 MB. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <llhttp.h>

enum { M_RATE, M_SSE, M_IDLE };

typedef struct {
    int fd;
    llhttp_t parser;
    bool connected;
    bool busy;        /* a request is out, its response not complete */
    bool want_out;    /* EPOLLOUT armed */
    bool in_idle;     /* on the idle stack (rate mode) */
    bool sent_once;   /* idle mode: its one request went out */
    bool opened;      /* sse: its ramp slot came (see --ramp) */
    size_t woff;      /* bytes of the request already written */
    uint64_t due_ns;  /* rate: when this request was due */
    uint64_t read_ns; /* when the current read returned */
    int status;
    bool complete;
    /* sse: "@digits" scanner state, kept across reads */
    bool in_ts;
    uint64_t ts;
    uint32_t events;
} conn_t;

typedef struct {
    uint64_t *v;
    size_t n, cap;
} samples_t;

static struct {
    int mode;
    struct sockaddr_in addr;
    const char *host;
    const char *path;
    char *req;
    size_t reqlen;
    double rate;
    int conns;
    double duration, warmup, ramp;
    const char *hdrs[8];
    int nhdrs;
    int busy; /* connections with a request out or not yet connected (sse) */
    int ep;
    conn_t *c;
    samples_t lat;
    uint64_t sent, completed, errors, non2xx, late, reconnects, chunks_bad;
    uint64_t record_from_ns;
    volatile sig_atomic_t stop;
    int last_err; /* errno of the last failed connect */
} G;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void die(const char *what)
{
    fprintf(stderr, "bench-load: %s: %s\n", what, strerror(errno));
    exit(3);
}

static void sample_add(samples_t *s, uint64_t v)
{
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 65536;
        s->v = realloc(s->v, s->cap * sizeof(*s->v));
        if (s->v == NULL)
            die("realloc");
    }
    s->v[s->n++] = v;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

/* Nearest-rank percentile of sorted samples, in microseconds. */
static double pct_us(const samples_t *s, double p)
{
    if (s->n == 0)
        return 0;
    size_t k = (size_t)((p / 100.0) * (double)s->n + 0.999999);
    if (k == 0)
        k = 1;
    if (k > s->n)
        k = s->n;
    return (double)s->v[k - 1] / 1000.0;
}

/* ---- llhttp callbacks ------------------------------------------------------------------------ */

static int on_headers_complete(llhttp_t *p)
{
    conn_t *c = p->data;
    c->status = p->status_code;
    return 0;
}

/* SSE: find "@" followed by decimal digits in the decoded body; the number ends at the first
 * non-digit. Pieces may split anywhere, hence the state in conn_t. */
static int on_body(llhttp_t *p, const char *at, size_t n)
{
    conn_t *c = p->data;
    if (G.mode != M_SSE)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char ch = at[i];
        if (c->in_ts) {
            if (ch >= '0' && ch <= '9') {
                c->ts = c->ts * 10 + (uint64_t)(ch - '0');
                continue;
            }
            c->in_ts = false;
            c->events++;
            if (c->ts != 0 && c->read_ns >= c->ts) {
                if (c->read_ns >= G.record_from_ns)
                    sample_add(&G.lat, c->read_ns - c->ts);
            } else {
                G.chunks_bad++;
            }
        }
        if (ch == '@') {
            c->in_ts = true;
            c->ts = 0;
        }
    }
    return 0;
}

static int on_message_complete(llhttp_t *p)
{
    conn_t *c = p->data;
    c->complete = true;
    return HPE_PAUSED; /* handle one response at a time; resumed in conn_read */
}

static llhttp_settings_t settings;

/* ---- connections ----------------------------------------------------------------------------- */

static void ep_set(conn_t *c, bool out)
{
    struct epoll_event ev = {.events = EPOLLIN | (out ? EPOLLOUT : 0), .data.ptr = c};
    if (epoll_ctl(G.ep, EPOLL_CTL_MOD, c->fd, &ev) != 0)
        die("epoll_ctl");
    c->want_out = out;
}

static void conn_open(conn_t *c)
{
    c->fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (c->fd < 0)
        die("socket");
    int one = 1;
    setsockopt(c->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    c->connected = false;
    c->busy = false;
    c->sent_once = false; /* a reconnected idle-mode connection asks again */
    c->woff = 0;
    c->complete = false;
    c->in_ts = false;
    llhttp_init(&c->parser, HTTP_RESPONSE, &settings);
    c->parser.data = c;
    int r = connect(c->fd, (struct sockaddr *)&G.addr, sizeof(G.addr));
    if (r != 0 && errno != EINPROGRESS)
        die("connect");
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT, .data.ptr = c};
    if (epoll_ctl(G.ep, EPOLL_CTL_ADD, c->fd, &ev) != 0)
        die("epoll_ctl add");
    c->want_out = true;
}

static void conn_reset(conn_t *c)
{
    epoll_ctl(G.ep, EPOLL_CTL_DEL, c->fd, NULL);
    close(c->fd);
    if (c->busy) {
        G.errors++;
        G.busy--;
    }
    G.reconnects++;
    conn_open(c);
}

/* Write (the rest of) the request. */
static void conn_flush(conn_t *c)
{
    while (c->woff < G.reqlen) {
        ssize_t w = send(c->fd, G.req + c->woff, G.reqlen - c->woff, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EAGAIN) {
                if (!c->want_out)
                    ep_set(c, true);
                return;
            }
            conn_reset(c);
            return;
        }
        c->woff += (size_t)w;
    }
    if (c->want_out)
        ep_set(c, false);
}

static void conn_send(conn_t *c, uint64_t due)
{
    c->busy = true;
    G.busy++;
    c->complete = false;
    c->due_ns = due;
    c->woff = 0;
    c->events = 0;
    G.sent++;
    conn_flush(c);
}

/* A response ended on c at time t. */
static void response_done(conn_t *c, uint64_t t)
{
    c->busy = false;
    G.busy--;
    G.completed++;
    if (c->status < 200 || c->status > 299)
        G.non2xx++;
    if (G.mode == M_RATE && c->due_ns >= G.record_from_ns)
        sample_add(&G.lat, t - c->due_ns);
}

/* Read what is there. Returns true when a response completed. */
static bool conn_read(conn_t *c)
{
    char buf[65536];
    bool done = false;
    for (;;) {
        ssize_t n = recv(c->fd, buf, sizeof(buf), 0);
        if (n < 0 && errno == EAGAIN)
            return done;
        if (n <= 0) {
            conn_reset(c);
            return done;
        }
        c->read_ns = now_ns();
        const char *p = buf;
        size_t left = (size_t)n;
        while (left > 0) {
            llhttp_errno_t e = llhttp_execute(&c->parser, p, left);
            if (e == HPE_PAUSED) {
                const char *stop = llhttp_get_error_pos(&c->parser);
                left -= (size_t)(stop - p);
                p = stop;
                llhttp_resume(&c->parser);
                bool keep = llhttp_should_keep_alive(&c->parser);
                response_done(c, c->read_ns);
                done = true;
                if (!keep) {
                    conn_reset(c);
                    return done;
                }
                continue;
            }
            if (e != HPE_OK) {
                fprintf(stderr, "bench-load: bad response: %s\n", llhttp_errno_name(e));
                conn_reset(c);
                return done;
            }
            left = 0;
        }
    }
}

/* EPOLLOUT on a connecting socket: finish the connect. */
static void conn_connected(conn_t *c)
{
    int err = 0;
    socklen_t l = sizeof(err);
    getsockopt(c->fd, SOL_SOCKET, SO_ERROR, &err, &l);
    if (err != 0) {
        G.last_err = err;
        G.errors++;
        usleep(1000);
        conn_reset(c);
        return;
    }
    c->connected = true;
    ep_set(c, false);
}

/* One epoll round with a timeout of at most timeout_ns (-1: block). Calls cb for each
 * connection that completed a response or became usable. */
static void poll_once(int64_t timeout_ns, void (*ready)(conn_t *c))
{
    struct epoll_event evs[256];
    struct timespec ts, *tp = NULL;
    if (timeout_ns >= 0) {
        ts.tv_sec = timeout_ns / 1000000000;
        ts.tv_nsec = timeout_ns % 1000000000;
        tp = &ts;
    }
    int n = epoll_pwait2(G.ep, evs, 256, tp, NULL);
    if (n < 0) {
        if (errno == EINTR)
            return;
        die("epoll_pwait2");
    }
    for (int i = 0; i < n; i++) {
        conn_t *c = evs[i].data.ptr;
        uint32_t e = evs[i].events;
        if (!c->connected) {
            if (e & (EPOLLOUT | EPOLLERR | EPOLLHUP)) {
                conn_connected(c);
                if (c->connected && ready)
                    ready(c);
            }
            continue;
        }
        if ((e & EPOLLOUT) && c->busy)
            conn_flush(c);
        if (e & (EPOLLIN | EPOLLERR | EPOLLHUP)) {
            bool fin = conn_read(c);
            if (fin && c->connected && !c->busy && ready)
                ready(c);
        }
    }
}

/* ---- modes ----------------------------------------------------------------------------------- */

static conn_t **idle;
static size_t nidle;

static void push_idle(conn_t *c)
{
    if (c->in_idle)
        return;
    c->in_idle = true;
    idle[nidle++] = c;
}

/* An idle connection the server closed meanwhile is being reconnected: skip it (it is pushed
 * again once connected). */
static conn_t *pop_idle(void)
{
    while (nidle > 0) {
        conn_t *c = idle[--nidle];
        c->in_idle = false;
        if (c->connected && !c->busy)
            return c;
    }
    return NULL;
}

static void connect_all(void)
{
    G.c = calloc((size_t)G.conns, sizeof(conn_t));
    idle = calloc((size_t)G.conns, sizeof(conn_t *));
    for (int i = 0; i < G.conns; i++)
        conn_open(&G.c[i]);
}

static int run_rate(void)
{
    connect_all();
    uint64_t deadline = now_ns() + 5000000000ull;
    while (nidle < (size_t)G.conns && now_ns() < deadline)
        poll_once(10000000, push_idle);
    if (nidle < (size_t)G.conns) {
        fprintf(stderr, "bench-load: only %zu of %d connections up\n", nidle, G.conns);
        return 3;
    }
    double period = 1e9 / G.rate;
    uint64_t total = (uint64_t)((G.warmup + G.duration) * G.rate);
    uint64_t t0 = now_ns() + 1000000;
    G.record_from_ns = t0 + (uint64_t)(G.warmup * 1e9);
    uint64_t end = t0 + (uint64_t)((G.warmup + G.duration) * 1e9);
    uint64_t i = 0;
    for (;;) {
        uint64_t t = now_ns();
        while (i < total && nidle > 0) {
            uint64_t due = t0 + (uint64_t)((double)i * period);
            if (due > t)
                break;
            conn_t *c = pop_idle();
            if (c == NULL)
                break;
            if (t - due > 1000000)
                G.late++; /* no free connection for over 1 ms: the pool, not the server */
            conn_send(c, due);
            i++;
        }
        if (i >= total && G.sent == G.completed + G.errors)
            break;
        if (t > end + 2000000000ull)
            break; /* stragglers: counted below */
        int64_t to = 100000000;
        if (i < total && nidle > 0) {
            uint64_t due = t0 + (uint64_t)((double)i * period);
            to = due > t ? (int64_t)(due - t) : 0;
        }
        poll_once(to, push_idle);
    }
    uint64_t outstanding = G.sent - G.completed - G.errors;
    double secs = G.duration + G.warmup;
    qsort(G.lat.v, G.lat.n, sizeof(uint64_t), cmp_u64);
    printf("LOADJSON {\"mode\":\"rate\",\"rate\":%.1f,\"seconds\":%.2f,\"sent\":%llu,"
           "\"completed\":%llu,\"achieved_rps\":%.1f,\"errors\":%llu,\"timeouts\":%llu,"
           "\"non2xx\":%llu,\"late_sends\":%llu,\"samples\":%zu,\"p50_us\":%.1f,\"p90_us\":%.1f,"
           "\"p99_us\":%.1f,\"p999_us\":%.1f,\"max_us\":%.1f}\n",
           G.rate, secs, (unsigned long long)G.sent, (unsigned long long)G.completed,
           (double)G.completed / secs, (unsigned long long)G.errors,
           (unsigned long long)outstanding, (unsigned long long)G.non2xx,
           (unsigned long long)G.late, G.lat.n, pct_us(&G.lat, 50), pct_us(&G.lat, 90),
           pct_us(&G.lat, 99), pct_us(&G.lat, 99.9), pct_us(&G.lat, 100));
    return 0;
}

static uint64_t sse_end;

static void sse_again(conn_t *c)
{
    if (c->opened && now_ns() < sse_end)
        conn_send(c, now_ns());
}

static int run_sse(void)
{
    G.c = calloc((size_t)G.conns, sizeof(conn_t));
    uint64_t t0 = now_ns();
    uint64_t ramp_ns = (uint64_t)(G.ramp * 1e9);
    G.record_from_ns = t0 + ramp_ns + (uint64_t)(G.warmup * 1e9);
    sse_end = G.record_from_ns + (uint64_t)(G.duration * 1e9);
    uint64_t hard_end = sse_end + 10000000000ull;
    int next = 0; /* the next stream to open */
    for (;;) {
        uint64_t t = now_ns();
        while (next < G.conns && t >= t0 + ramp_ns * (uint64_t)next / (uint64_t)G.conns) {
            conn_t *c = &G.c[next++];
            conn_open(c);
            c->opened = true;
        }
        /* not connected yet counts as busy: it still owes its first stream */
        int pending = G.busy;
        for (int k = next - 1; k >= 0 && pending == 0 && t >= sse_end; k--)
            pending += !G.c[k].connected;
        if ((t >= sse_end && next == G.conns && pending == 0) || t > hard_end)
            break;
        int64_t to = 50000000;
        if (next < G.conns) {
            uint64_t due = t0 + ramp_ns * (uint64_t)next / (uint64_t)G.conns;
            to = due > t ? (int64_t)(due - t) : 0;
        }
        poll_once(to, sse_again);
    }
    qsort(G.lat.v, G.lat.n, sizeof(uint64_t), cmp_u64);
    printf("LOADJSON {\"mode\":\"sse\",\"conns\":%d,\"streams\":%llu,\"errors\":%llu,"
           "\"non2xx\":%llu,\"reconnects\":%llu,\"bad_chunks\":%llu,\"chunks\":%zu,"
           "\"seconds\":%.2f,\"p50_us\":%.1f,\"p90_us\":%.1f,\"p99_us\":%.1f,"
           "\"p999_us\":%.1f,\"max_us\":%.1f}\n",
           G.conns, (unsigned long long)G.completed, (unsigned long long)G.errors,
           (unsigned long long)G.non2xx, (unsigned long long)G.reconnects,
           (unsigned long long)G.chunks_bad, G.lat.n, G.duration, pct_us(&G.lat, 50),
           pct_us(&G.lat, 90), pct_us(&G.lat, 99), pct_us(&G.lat, 99.9), pct_us(&G.lat, 100));
    return 0;
}

static void on_term(int sig)
{
    G.stop = 1;
}

/* Open in batches so a listener's accept backlog never overflows (a dropped SYN costs 1 s). */
static int run_idle(void)
{
    const int batch = 128;
    G.c = calloc((size_t)G.conns, sizeof(conn_t));
    idle = calloc((size_t)G.conns, sizeof(conn_t *));
    int opened = 0;
    uint64_t deadline = now_ns() + 60000000000ull;
    while (opened < G.conns) {
        int n = G.conns - opened < batch ? G.conns - opened : batch;
        for (int i = 0; i < n; i++)
            conn_open(&G.c[opened + i]);
        /* wait until each of the batch is connected and (if a body is set) answered */
        for (;;) {
            int ok = 0;
            for (int i = 0; i < n; i++) {
                conn_t *c = &G.c[opened + i];
                if (c->connected && !c->busy && (G.reqlen == 0 || c->complete)) {
                    ok++;
                } else if (c->connected && !c->busy && G.reqlen > 0 && !c->sent_once) {
                    c->sent_once = true;
                    conn_send(c, now_ns());
                }
            }
            if (ok == n)
                break;
            if (now_ns() > deadline) {
                fprintf(stderr,
                        "bench-load: idle: stuck at %d connections (sent %llu, completed %llu, "
                        "errors %llu, non2xx %llu, reconnects %llu, last connect error: %s)\n",
                        opened + ok, (unsigned long long)G.sent, (unsigned long long)G.completed,
                        (unsigned long long)G.errors, (unsigned long long)G.non2xx,
                        (unsigned long long)G.reconnects,
                        G.last_err ? strerror(G.last_err) : "none");
                return 3;
            }
            poll_once(100000000, NULL);
        }
        opened += n;
    }
    printf("READY %d completed=%llu errors=%llu non2xx=%llu reconnects=%llu\n", opened,
           (unsigned long long)G.completed, (unsigned long long)G.errors,
           (unsigned long long)G.non2xx, (unsigned long long)G.reconnects);
    fflush(stdout);
    signal(SIGTERM, on_term);
    signal(SIGINT, on_term);
    uint64_t end = now_ns() + (uint64_t)(G.duration * 1e9);
    while (!G.stop && now_ns() < end)
        poll_once(100000000, NULL);
    return 0;
}

/* ---- main ------------------------------------------------------------------------------------ */

static char *read_file(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (f == NULL)
        die(path);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b == NULL || fread(b, 1, (size_t)n, f) != (size_t)n)
        die("read body");
    fclose(f);
    *len = (size_t)n;
    return b;
}

static int usage(void)
{
    fputs("usage: bench-load rate|sse|idle --target HOST:PORT [--path P] [--body FILE]\n"
          "       [--rate R] [--conns C] [--duration S] [--warmup S] [--ramp S]\n"
          "       [--header \"Name: value\"]...\n",
          stderr);
    return 2;
}

int main(int argc, char **argv)
{
    if (argc < 2)
        return usage();
    if (strcmp(argv[1], "rate") == 0)
        G.mode = M_RATE;
    else if (strcmp(argv[1], "sse") == 0)
        G.mode = M_SSE;
    else if (strcmp(argv[1], "idle") == 0)
        G.mode = M_IDLE;
    else
        return usage();
    const char *target = NULL, *body = NULL;
    G.path = "/v1/chat/completions";
    G.conns = 32;
    G.duration = 5;
    G.warmup = 1;
    for (int i = 2; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (strcmp(a, "--target") == 0)
            target = v;
        else if (strcmp(a, "--path") == 0)
            G.path = v;
        else if (strcmp(a, "--body") == 0)
            body = v;
        else if (strcmp(a, "--rate") == 0)
            G.rate = atof(v);
        else if (strcmp(a, "--conns") == 0)
            G.conns = atoi(v);
        else if (strcmp(a, "--duration") == 0)
            G.duration = atof(v);
        else if (strcmp(a, "--warmup") == 0)
            G.warmup = atof(v);
        else if (strcmp(a, "--ramp") == 0)
            G.ramp = atof(v);
        else if (strcmp(a, "--header") == 0 && G.nhdrs < 8)
            G.hdrs[G.nhdrs++] = v;
        else
            return usage();
    }
    if (target == NULL || G.conns <= 0 || (G.mode == M_RATE && G.rate <= 0))
        return usage();
    const char *colon = strrchr(target, ':');
    if (colon == NULL)
        return usage();
    char host[64];
    snprintf(host, sizeof(host), "%.*s", (int)(colon - target), target);
    G.addr.sin_family = AF_INET;
    G.addr.sin_port = htons((uint16_t)atoi(colon + 1));
    if (inet_pton(AF_INET, host, &G.addr.sin_addr) != 1)
        return usage();
    if (body) {
        size_t blen;
        char *b = read_file(body, &blen);
        size_t cap = blen + 512;
        for (int k = 0; k < G.nhdrs; k++)
            cap += strlen(G.hdrs[k]) + 2;
        G.req = malloc(cap);
        int h = snprintf(G.req, cap,
                         "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n",
                         G.path, target);
        for (int k = 0; k < G.nhdrs; k++)
            h += snprintf(G.req + h, cap - (size_t)h, "%s\r\n", G.hdrs[k]);
        h += snprintf(G.req + h, cap - (size_t)h, "Content-Length: %zu\r\n\r\n", blen);
        memcpy(G.req + h, b, blen);
        G.reqlen = (size_t)h + blen;
        free(b);
    } else if (G.mode != M_IDLE) {
        return usage();
    }
    struct rlimit rl = {65536, 65536};
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) {
        getrlimit(RLIMIT_NOFILE, &rl);
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    signal(SIGPIPE, SIG_IGN);
    llhttp_settings_init(&settings);
    settings.on_headers_complete = on_headers_complete;
    settings.on_body = on_body;
    settings.on_message_complete = on_message_complete;
    G.ep = epoll_create1(EPOLL_CLOEXEC);
    if (G.ep < 0)
        die("epoll_create1");
    switch (G.mode) {
    case M_RATE:
        return run_rate();
    case M_SSE:
        return run_sse();
    default:
        return run_idle();
    }
}
