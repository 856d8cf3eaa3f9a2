/* The data plane's threads: `workers` event loops, each with its own client listener
 * (SO_REUSEPORT), connections, admission queues and upstream keep-alive pools, and the
 * messages between them and the control thread (net/mailbox.h).
 *
 * Control -> worker (always delivered): a generation to adopt, the listener's TLS context,
 * drain, stop; and the messages of the objects whose per-worker data it is (a replica's
 * upstreams: core/replica.c). Worker -> control: the last reference of a generation or replica
 * (freed there), replica events (core/event.h), and the hand-offs of the request hooks (audit
 * lines, shadow samples, spans).
 *
 * Shutdown: drain (every worker stops accepting and finishes its requests, then says so),
 * then stop (each loop ends, its thread frees its caches), then join; after the join the
 * control thread owns the workers' loops and closes what is left on them. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* sched_getaffinity, CPU_COUNT */
#endif
#include <assert.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "common/log.h"
#include "common/util.h"
#include "net/sock.h"
#include "net/tls.h"
#include "proxy/core/gen.h"
#include "proxy/core/px.h"
#include "proxy/data/worker.h"

struct px_worker_s {
    px_t *px;
    px_thread_t th; /* slot 1..nworkers; its gen is this worker's reference */
    const px_worker_ops_t *ops;
    uv_thread_t thread;
    uv_loop_t loop;
    net_mailbox_t mb;
    net_server_t *srv;
    uv_timer_t qtimer;
    uv_timer_t cwtimer; /* requests waiting for a check before a new connection (data/proxy.c) */
    uv_timer_t stimer;  /* the large-buffer stash's decay, so that it falls back after a burst */
    px_pool_slot_t *qactive; /* non-empty admission queues of this worker */
    uv_async_t wake;         /* another worker freed a slot */
    px_series_t *m_requests; /* detproxy_worker_requests_total{worker} */
    px_series_t *m_stash;    /* detproxy_body_stash_bytes{worker} */
    bool started;
};

static _Thread_local px_worker_t *t_self;
static _Thread_local bool t_closing; /* px_worker_closing */
static const char *const listener_name = "proxy";

px_worker_t *px_worker_self(void)
{
    return t_self;
}

unsigned px_workers_resolve(unsigned configured)
{
    if (configured)
        return configured;
    cpu_set_t set;
    CPU_ZERO(&set);
    int n = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
    if (n < 1)
        n = 1;
    return n > CFG_MAX_WORKERS ? CFG_MAX_WORKERS : (unsigned)n;
}

/* ---- messages ------------------------------------------------------------------------------ */

typedef struct {
    net_mb_node_t node;
    px_worker_t *w;
    px_gen_t *gen;
    net_tls_ctx_t *tls;
} wmsg_t;

static wmsg_t *wmsg(px_worker_t *w)
{
    wmsg_t *m = dp_xcalloc(1, sizeof(*m));
    m->w = w;
    return m;
}

void px_worker_limits(const cfg_t *cfg, net_server_limits_t *l)
{
    net_server_limits_default(l);
    l->max_header_bytes = cfg->limits.max_header_bytes;
    l->max_headers = cfg->limits.max_headers;
    l->max_body_bytes = cfg->limits.max_body_bytes;
    l->max_connections = cfg->limits.max_connections;
    l->max_connections_per_client = cfg->limits.max_connections_per_client;
    l->client_header_timeout_ms = cfg->limits.client_header_timeout_ms;
    l->client_idle_timeout_ms = cfg->limits.client_idle_timeout_ms;
    l->max_inflight_body_bytes = cfg->limits.max_inflight_body_bytes;
    l->client_body_timeout_ms = cfg->limits.client_body_timeout_ms;
    l->max_pending_handshakes = cfg->limits.max_pending_handshakes;
}

/* The client listener's limits for one worker: connections and buffered bodies are counted
 * across the workers (net_server_share); pending TLS handshakes are each worker's to close
 * oldest first, so each gets its share of the bound. */
static void worker_limits(const px_t *px, const cfg_t *cfg, net_server_limits_t *l)
{
    px_worker_limits(cfg, l);
    if (l->max_pending_handshakes) {
        uint32_t share = l->max_pending_handshakes / px->nworkers;
        l->max_pending_handshakes = share ? share : 1;
    }
}

static void apply_gen(px_worker_t *w, px_gen_t *g)
{
    px_gen_t *old = w->th.gen;
    w->th.gen = g; /* the message's reference becomes ours */
    net_server_limits_t lim;
    worker_limits(w->px, g->cfg, &lim);
    if (w->srv) /* NULL once closed (shutdown) */
        net_server_set_limits(w->srv, &lim);
    net_upstream_opts_t uo;
    px_replica_upstream_opts(g->cfg, &uo);
    for (size_t i = 0; i < g->npools; i++)
        for (size_t k = 0; k < g->pools[i].nreplicas; k++) {
            net_upstream_t *u = g->pools[i].replicas[k]->wup[w->th.slot];
            if (u)
                net_upstream_set_opts(u, &uo);
        }
    if (old)
        px_gen_unref(old);
}

static void on_gen(net_mb_node_t *n)
{
    wmsg_t *m = (wmsg_t *)n;
    apply_gen(m->w, m->gen);
    free(m);
}

/* One message to every running worker; each takes its own reference of what it carries. */
static void post_all(px_t *px, net_mb_fn fn, px_gen_t *g, net_tls_ctx_t *tls)
{
    PX_ASSERT_CONTROL();
    if (px == NULL || px->workers == NULL || px->workers_joined)
        return;
    for (unsigned i = 0; i < px->nworkers && px->workers[i].started; i++) {
        wmsg_t *m = wmsg(&px->workers[i]);
        if ((m->gen = g) != NULL)
            px_gen_ref(g);
        if ((m->tls = tls) != NULL)
            net_tls_ctx_ref(tls);
        net_mailbox_post(&px->workers[i].mb, &m->node, fn);
    }
}

void px_workers_publish(px_t *px)
{
    PX_ASSERT_CONTROL();
    if (px->gen->published)
        return;
    px->gen->published = true;
    post_all(px, on_gen, px->gen, NULL);
}

static void on_tls(net_mb_node_t *n)
{
    wmsg_t *m = (wmsg_t *)n;
    if (m->w->srv)
        net_server_set_tls(m->w->srv, m->tls);
    net_tls_ctx_unref(m->tls);
    free(m);
}

void px_workers_set_tls(px_t *px, net_tls_ctx_t *c)
{
    post_all(px, on_tls, NULL, c);
}

net_tls_ctx_t *px_worker_tls(px_replica_t *r, const px_gen_t *g)
{
    px_worker_t *w = t_self;
    assert(w != NULL);
    unsigned slot = w->th.slot;
    if (!r->url.tls || r->tls_ctx == NULL)
        return NULL;
    if (r->wtls[slot])
        return r->wtls[slot];
    /* Each worker has its own context: session caches are not shared between threads. */
    const px_pool_t *p = px_gen_pool_by_name(g, r->pool_name);
    const cfg_upstream_tls_t *ut = p ? p->cfg->upstream_tls : NULL;
    dp_buf_t err = {0};
    net_tls_ctx_t *t = net_tls_client_ctx(ut ? ut->ca_file : NULL, ut ? ut->client_cert_file : NULL,
                                          ut ? ut->client_key_file : NULL, &err);
    dp_buf_free(&err);
    if (t == NULL) { /* the files changed under us since the replica was made */
        t = r->tls_ctx;
        net_tls_ctx_ref(t);
    }
    r->wtls[slot] = t;
    return t;
}

net_upstream_t *px_worker_upstream(px_replica_t *r, const px_gen_t *g)
{
    px_worker_t *w = t_self;
    assert(w != NULL);
    unsigned slot = w->th.slot;
    net_upstream_t *u = r->wup[slot];
    if (u || !r->resolved)
        return u;
    net_upstream_opts_t o;
    px_replica_upstream_opts(g->cfg, &o);
    u = net_upstream_new(&w->loop, (struct sockaddr *)&r->addr, &o);
    px_event_watch_closes(r, u);
    net_tls_ctx_t *t = px_worker_tls(r, g);
    if (t)
        net_upstream_set_tls(u, t, r->server_name ? r->server_name : r->url.host);
    r->wup[slot] = u;
    px_thread_add_upstream(&w->th, u);
    return u;
}

/* ---- admission wake-ups -------------------------------------------------------------------- */

static void on_wake(uv_async_t *a)
{
    px_worker_t *w = a->data;
    w->ops->wake();
}

void px_workers_wake(px_t *px)
{
    for (unsigned i = 0; i < px->nworkers; i++)
        if (&px->workers[i] != t_self && px->workers[i].started)
            uv_async_send(&px->workers[i].wake);
}

px_pool_slot_t **px_worker_qactive(void)
{
    return &t_self->qactive;
}

uv_timer_t *px_worker_qtimer(void)
{
    return &t_self->qtimer;
}

uv_timer_t *px_worker_cwtimer(void)
{
    return t_self ? &t_self->cwtimer : NULL;
}

void px_worker_count_request(void)
{
    px_metrics_add(t_self->m_requests, 1);
}

/* ---- the thread ---------------------------------------------------------------------------- */

static void worker_main(void *arg)
{
    px_worker_t *w = arg;
    t_self = w;
    px_metrics_thread = w->th.slot;
    uv_run(&w->loop, UV_RUN_DEFAULT);
    w->ops->thread_exit();
    net_sock_thread_free();
    dp_log_thread_free();
}

static net_server_t *worker_server(px_t *px, px_worker_t *w)
{
    net_server_limits_t lim;
    worker_limits(px, px->gen->cfg, &lim);
    net_server_t *s = net_server_new(&w->loop, w->ops->handler, px, &lim);
    net_server_share(s, &px->listen_shared);
    net_server_on_overload(s, w->ops->overload);
    if (px->tls)
        net_server_set_tls(s, px->tls);
    return s;
}

static void stash_decay_cb(uv_timer_t *t)
{
    px_worker_t *w = t->data;
    dp_buf_stash_decay();
    px_metrics_set(w->m_stash, (double)dp_buf_stash_bytes());
}

static int worker_init(px_t *px, px_worker_t *w, unsigned slot, const px_worker_ops_t *ops)
{
    w->px = px;
    w->ops = ops;
    w->th.slot = slot;
    w->th.loop = &w->loop;
    w->th.mb = &w->mb;
    int r = uv_loop_init(&w->loop);
    if (r != 0)
        return r;
    net_mailbox_init(&w->mb, &w->loop, 0);
    uv_timer_init(&w->loop, &w->qtimer);
    uv_timer_init(&w->loop, &w->cwtimer);
    uv_timer_init(&w->loop, &w->stimer);
    w->stimer.data = w;
    uv_timer_start(&w->stimer, stash_decay_cb, DP_BUF_STASH_DECAY_MS, DP_BUF_STASH_DECAY_MS);
    uv_unref((uv_handle_t *)&w->stimer);
    uv_async_init(&w->loop, &w->wake, on_wake);
    w->wake.data = w;
    w->srv = worker_server(px, w);
    px_gen_ref(px->gen);
    w->th.gen = px->gen;
    px->threads[slot] = &w->th;
    char id[12];
    snprintf(id, sizeof(id), "%u", slot - 1);
    w->m_requests = px_metrics_get("detproxy_worker_requests_total", "worker", id, NULL);
    w->m_stash = px_metrics_get("detproxy_body_stash_bytes", "worker", id, NULL);
    return 0;
}

static void log_listening(const cfg_addr_t *a, int r, uint16_t port, unsigned n)
{
    dp_jw_t *w =
        dp_log_begin(r == 0 ? DP_LOG_INFO : DP_LOG_ERROR, r == 0 ? "listening" : "listen_failed");
    if (w) {
        dp_jw_str(w, "listener", listener_name);
        dp_jw_str(w, "host", a->host);
        dp_jw_uint(w, "port", port);
        dp_jw_uint(w, "workers", n);
        if (r != 0)
            dp_jw_str(w, "error", uv_strerror(r));
        dp_log_end(w);
    }
}

int px_workers_start(px_t *px, const cfg_addr_t *a, const px_worker_ops_t *ops)
{
    PX_ASSERT_CONTROL();
    assert(px->threads != NULL && px->nslots == px->nworkers + 1);
    px->workers = dp_xcalloc(px->nworkers, sizeof(*px->workers));
    for (unsigned i = 0; i < px->nworkers; i++) {
        int r = worker_init(px, &px->workers[i], i + 1, ops);
        if (r != 0) {
            log_listening(a, r, a->port, px->nworkers);
            return r;
        }
    }
    /* The first binds the configured port (maybe 0); the others bind the port it got. */
    uint16_t port = a->port;
    bool reuse = px->nworkers > 1;
    for (unsigned i = 0; i < px->nworkers; i++) {
        px_worker_t *w = &px->workers[i];
        int r = net_server_listen_opts(w->srv, a->host, port, reuse);
        if (r == UV_ENOTSUP && i == 0) {
            /* No SO_REUSEPORT: one listener; the other workers serve nothing (logged). */
            dp_log_msg(DP_LOG_WARN, "reuseport_unavailable",
                       "SO_REUSEPORT refused: one worker accepts every connection");
            net_server_close(w->srv, NULL, NULL);
            w->srv = worker_server(px, w);
            r = net_server_listen(w->srv, a->host, port);
            reuse = false;
        }
        if (r != 0) {
            log_listening(a, r, port, px->nworkers);
            return r;
        }
        port = net_server_port(w->srv);
        if (i == 0)
            memcpy(&px->listen_bound, net_server_bound(w->srv), sizeof(px->listen_bound));
        if (!reuse)
            break;
    }
    log_listening(a, 0, port, px->nworkers);
    for (unsigned i = 0; i < px->nworkers; i++) {
        px->workers[i].started = true;
        px->workers[i].th.running = true;
        uv_thread_create(&px->workers[i].thread, worker_main, &px->workers[i]);
    }
    return 0;
}

/* ---- drain, close, stop -------------------------------------------------------------------- */

typedef struct {
    net_mb_node_t node;
    px_t *px;
} drained_msg_t;

static void (*g_drained_cb)(px_t *px);

static void on_drained_ctl(net_mb_node_t *n)
{
    drained_msg_t *m = (drained_msg_t *)n;
    px_t *px = m->px;
    free(m);
    if (++px->ndrained == px->nworkers && g_drained_cb)
        g_drained_cb(px);
}

static void worker_drained(net_server_t *s)
{
    px_t *px = net_server_data(s);
    drained_msg_t *m = dp_xcalloc(1, sizeof(*m));
    m->px = px;
    px_thread_post_control(px, &m->node, on_drained_ctl);
}

static void on_drain(net_mb_node_t *n)
{
    wmsg_t *m = (wmsg_t *)n;
    if (m->w->srv)
        net_server_drain(m->w->srv, worker_drained);
    free(m);
}

void px_workers_drain(px_t *px, void (*done)(px_t *px))
{
    PX_ASSERT_CONTROL();
    g_drained_cb = done;
    post_all(px, on_drain, NULL, NULL);
}

bool px_worker_closing(void)
{
    return t_closing;
}

static void on_close(net_mb_node_t *n)
{
    wmsg_t *m = (wmsg_t *)n;
    t_closing = true; /* for good: the aborts run in the connections' close callbacks, later */
    if (m->w->srv) {
        net_server_close(m->w->srv, NULL, NULL);
        m->w->srv = NULL;
    }
    free(m);
}

void px_workers_close(px_t *px)
{
    PX_ASSERT_CONTROL();
    g_drained_cb = NULL;
    post_all(px, on_close, NULL, NULL);
}

static void on_stop(net_mb_node_t *n)
{
    wmsg_t *m = (wmsg_t *)n;
    px_worker_t *w = m->w;
    free(m);
    t_closing = true;
    if (w->srv) {
        net_server_close(w->srv, NULL, NULL);
        w->srv = NULL;
    }
    /* Pooled keep-alive connections would keep the loop alive until they time out. */
    for (size_t i = 0; i < w->th.nups; i++)
        net_upstream_flush_idle(w->th.ups[i]);
    w->ops->stop();
    uv_close((uv_handle_t *)&w->qtimer, NULL);
    uv_close((uv_handle_t *)&w->cwtimer, NULL);
    uv_close((uv_handle_t *)&w->stimer, NULL);
    uv_close((uv_handle_t *)&w->wake, NULL);
    /* The loop ends once what is still running here ends (a body being policed on the thread
     * pool, closes): the mailbox no longer keeps it alive. What is posted after that runs on
     * the control thread, after the join (px_workers_join). */
    uv_unref((uv_handle_t *)&w->mb.async);
}

void px_workers_join(px_t *px)
{
    PX_ASSERT_CONTROL();
    if (px->workers == NULL || px->workers_joined)
        return;
    post_all(px, on_stop, NULL, NULL);
    for (unsigned i = 0; i < px->nworkers; i++)
        if (px->workers[i].started)
            uv_thread_join(&px->workers[i].thread);
    px->workers_joined = true;
    /* The loops are ours now: free what is left on them and let the closes run. */
    for (unsigned i = 0; i < px->nworkers; i++) {
        px_worker_t *w = &px->workers[i];
        if (w->srv) {
            net_server_close(w->srv, NULL, NULL);
            w->srv = NULL;
        }
        if (!w->started) {
            uv_close((uv_handle_t *)&w->qtimer, NULL);
            uv_close((uv_handle_t *)&w->cwtimer, NULL);
            uv_close((uv_handle_t *)&w->stimer, NULL);
            uv_close((uv_handle_t *)&w->wake, NULL);
        }
        net_mailbox_close(&w->mb);
        for (size_t k = 0; k < w->th.nups; k++)
            net_upstream_free(w->th.ups[k]);
        free(w->th.ups);
        w->th.ups = NULL;
        w->th.nups = w->th.capups = 0;
        if (w->th.gen) {
            px_gen_unref(w->th.gen);
            w->th.gen = NULL;
        }
        uv_run(&w->loop, UV_RUN_DEFAULT);
        uv_loop_close(&w->loop);
    }
}

static size_t sum_servers(px_t *px, size_t (*count)(const net_server_t *s))
{
    size_t n = 0;
    for (unsigned i = 0; px->workers && i < px->nworkers; i++)
        n += px->workers[i].srv ? count(px->workers[i].srv) : 0; /* the counters are atomics */
    return n;
}

size_t px_workers_connections(px_t *px)
{
    return sum_servers(px, net_server_connections);
}

size_t px_workers_inflight(px_t *px)
{
    return sum_servers(px, net_server_inflight);
}
