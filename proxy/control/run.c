/* `detproxy run`: load the config, start the listeners, serve until SIGTERM/SIGINT drains. */
#include <errno.h>
#include <netdb.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/args.h"
#include "common/log.h"
#include "common/util.h"
#include "common/version.h"
#include "net/sock.h"
#include "net/tls.h"
#include "proxy/cli/cli.h"
#include "proxy/control/admin.h"
#include "proxy/control/attest.h"
#include "proxy/control/discovery.h"
#include "proxy/control/fleet.h"
#include "proxy/control/relay.h"
#include "proxy/control/reload.h"
#include "proxy/control/status.h"
#include "proxy/core/gen.h"
#include "proxy/core/px.h"
#include "proxy/core/replica.h"
#include "proxy/core/self.h"
#include "proxy/data/admission.h"
#include "proxy/data/hooks.h"
#include "proxy/data/proxy.h"
#include "proxy/data/shadow.h"
#include "proxy/data/worker.h"
#include "proxy/obs/audit.h"
#include "proxy/obs/otel.h"

typedef struct {
    const char *config;
} run_opts_t;

static const dp_arg_t run_table[] = {
    {.name = "--config",
     .shortopt = 'c',
     .kind = DP_ARG_STR,
     .off = offsetof(run_opts_t, config),
     .meta = "CONFIG",
     .help = "configuration file (see docs/configuration.md)",
     .flags = DP_ARG_REQUIRED},
};

static const dp_args_t run_spec = {
    .prog = "detproxy run",
    .usage = "detproxy run -c CONFIG",
    .about = "Run the proxy in the foreground. Logs are JSON lines on stderr.",
    .opts = run_table,
    .nopts = DP_ARRAY_SIZE(run_table),
    .epilog = "Signals: SIGTERM/SIGINT drain in-flight requests (up to\n"
              "limits.shutdown_timeout_ms, 30 s by default) and exit 0;\n"
              "SIGHUP reloads the configuration.",
};

/* ---- shutdown ------------------------------------------------------------------------------ */

static void close_handle(uv_handle_t *h)
{
    if (!uv_is_closing(h))
        uv_close(h, NULL);
}

static void admin_closed(void *data)
{
    (void)data;
}

/* clean: every client answered and nothing left running on a single_sequence engine (not cut
 * short by the drain's limit). */
static void finish_shutdown(px_t *px, bool clean)
{
    if (px->finished)
        return;
    px->finished = true;
    uv_timer_stop(&px->engines_timer);
    px_discovery_stop(px);
    px_fleet_stop(px, clean);
    px_attest_stop(px);
    px_shadow_stop(px);
    px_relay_stop(px);
    px_admission_holds_stop(); /* the control thread's: what its drains' failures kept */
    px_otel_stop(px);
    px_workers_join(px);        /* drained (or closed): their loops end, their threads exit */
    net_mailbox_close(&px->mb); /* nothing posts to the control thread any more */
    /* Pooled keep-alive connections would keep the loop alive until they time out. */
    for (size_t i = 0; i < px->gen->npools; i++) {
        for (size_t k = 0; k < px->gen->pools[i].nreplicas; k++) {
            px_replica_t *r = px->gen->pools[i].replicas[k];
            if (r->up)
                net_upstream_flush_idle(r->up);
            if (r->shadow_up)
                net_upstream_flush_idle(r->shadow_up);
        }
    }
    if (px->admin) {
        net_server_close(px->admin, admin_closed, NULL);
        px->admin = NULL;
    }
    close_handle((uv_handle_t *)&px->sig_term);
    close_handle((uv_handle_t *)&px->sig_int);
    close_handle((uv_handle_t *)&px->sig_hup);
    /* Closing them gave the signals back their default action, which ends the process: what
     * is left (a fleet member letting go of its engine keys and revoking its lease, up to 1.5 s) is
     * not cut short by a second SIGTERM, any more than the drain was. */
    signal(SIGTERM, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    signal(SIGHUP, SIG_IGN);
    close_handle((uv_handle_t *)&px->drain_timer);
    close_handle((uv_handle_t *)&px->engines_timer);
}

static void engines_check(uv_timer_t *t)
{
    px_t *px = t->data;
    if (px_replica_engines_quiesce() == 0)
        finish_shutdown(px, true);
}

/* Clients are answered. What still runs on a single_sequence engine (a relay, a check, a copy,
 * a drained answer) is waited for before the process goes, within the drain's limit, and
 * nothing new starts there: once this instance is gone it counts nothing there, and a fleet
 * member takes the engine as soon as the key goes. */
static void proxy_drained(px_t *px)
{
    px_admission_start_checks_end();
    unsigned running = px_replica_engines_quiesce();
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "drained");
    if (w) {
        dp_jw_uint(w, "single_sequence_running", running);
        dp_log_end(w);
    }
    if (running == 0) {
        finish_shutdown(px, true);
        return;
    }
    uv_timer_start(&px->engines_timer, engines_check, 10, 10);
}

static void drain_timeout(uv_timer_t *t)
{
    px_t *px = t->data;
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "drain_timeout");
    if (w) {
        dp_jw_uint(w, "inflight", px_workers_inflight(px));
        dp_jw_uint(w, "connections", px_workers_connections(px));
        dp_log_end(w);
    }
    px_workers_close(px);
    finish_shutdown(px, false);
}

static void on_stop_signal(uv_signal_t *h, int signum)
{
    px_t *px = h->data;
    if (px->draining)
        return;
    px->draining = true;
    /* The configuration in force when the signal came (a reload during the drain is ignored). */
    uint32_t limit_ms = px->gen->cfg->limits.shutdown_timeout_ms;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "draining");
    if (w) {
        dp_jw_str(w, "signal", signum == SIGTERM ? "SIGTERM" : "SIGINT");
        dp_jw_uint(w, "inflight", px_workers_inflight(px));
        dp_jw_uint(w, "connections", px_workers_connections(px));
        dp_jw_uint(w, "timeout_ms", limit_ms);
        dp_log_end(w);
    }
    uv_timer_start(&px->drain_timer, drain_timeout, limit_ms, 0);
    px_workers_drain(px, proxy_drained);
}

static void on_hup(uv_signal_t *h, int signum)
{
    (void)signum;
    px_t *px = h->data;
    px_reload(px, "SIGHUP");
}

/* ---- start-up ------------------------------------------------------------------------------ */

static void raise_nofile(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static void run_end(px_t *px)
{
    if (px->workers)
        px_workers_join(px);
    if (px->audit)
        px_audit_close(px->audit); /* flush and fsync: no audit line is lost on a clean exit */
    for (size_t i = 0; i < px->naudit_retired; i++)
        px_audit_close(px->audit_retired[i]);
    free(px->audit_retired);
    px->audit_retired = NULL;
    net_tls_ctx_unref(px->tls);
    px_gen_unref(px->gen);
    px->gen = NULL;
    net_mailbox_close(&px->mb);       /* what the workers handed over last */
    uv_run(px->loop, UV_RUN_DEFAULT); /* let the last close callbacks run */
    px_shadow_free(px);
    px_proxy_free_caches();
    px_hooks_free_caches();
    net_sock_thread_free();
    uv_loop_close(px->loop);
    free(px->workers);
    free(px->threads);
    px_metrics_reset();
}

static int listen_on(net_server_t *s, const cfg_addr_t *a, const char *what)
{
    int r = net_server_listen(s, a->host, a->port);
    dp_jw_t *w =
        dp_log_begin(r == 0 ? DP_LOG_INFO : DP_LOG_ERROR, r == 0 ? "listening" : "listen_failed");
    if (w) {
        dp_jw_str(w, "listener", what);
        dp_jw_str(w, "host", a->host);
        dp_jw_uint(w, "port", r == 0 ? net_server_port(s) : a->port);
        if (r != 0)
            dp_jw_str(w, "error", uv_strerror(r));
        dp_log_end(w);
    }
    return r;
}

/* Whether something already listens on a: a bind without SO_REUSEPORT (SO_REUSEADDR only, so
 * TIME_WAIT connections of a previous run do not count) fails exactly when a socket is bound
 * there. The listeners themselves use SO_REUSEPORT, which would let a second `detproxy run` on
 * the same config share the port silently and take half the traffic. Port 0: nothing to
 * check. 0 free; -1 taken (logged, naming the address). */
static int port_taken(const cfg_addr_t *a, const char *what)
{
    if (a->port == 0)
        return 0;
    char port[8];
    snprintf(port, sizeof(port), "%u", (unsigned)a->port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    if (getaddrinfo(a->host, port, &hints, &res) != 0 || res == NULL)
        return 0; /* the listener itself reports an address that does not resolve */
    int taken = 0;
    int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0) {
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, res->ai_addr, res->ai_addrlen) != 0 && errno == EADDRINUSE)
            taken = -1;
        close(fd);
    }
    freeaddrinfo(res);
    if (taken) {
        dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "listen_failed");
        if (w) {
            dp_jw_str(w, "listener", what);
            dp_jw_str(w, "host", a->host);
            dp_jw_uint(w, "port", a->port);
            dp_jw_str(w, "error", "address already in use (another detproxy on this config?)");
            dp_log_end(w);
        }
    }
    return taken;
}

/* px->replica_hooks.changed: the status page's history, the drift windows a replica back in
 * service starts again, and the fleet (a quarantine decided here). */
static void replica_changed(const px_replica_t *r, px_replica_state_t from)
{
    px_status_note_change(r, from);
    px_shadow_replica_changed(r, from);
    px_fleet_replica_changed(r, from);
}

/* The libuv thread pool (libuv reads its size at first use, after this) is the process's:
 * offloaded policing and held-answer checks take at most half of it, each worker its share and
 * at least one job, beside audit writes, DNS and shadow comparisons. Unless the operator sized
 * it, it gets two threads per worker (four at least), so one job per worker stays within the
 * half (docs/policy.md, "Known limits"). */
static void size_threadpool(unsigned nworkers)
{
    if (getenv("UV_THREADPOOL_SIZE"))
        return;
    unsigned n = nworkers < 2 ? 4 : 2 * nworkers; /* workers is at most 64 */
    char v[12];
    snprintf(v, sizeof(v), "%u", n);
    setenv("UV_THREADPOOL_SIZE", v, 0);
}

int px_cmd_run(int argc, char **argv)
{
    run_opts_t o = {0};
    int r = dp_args_parse(&run_spec, argc, argv, &o);
    if (r != 0)
        return dp_args_exit(r);
    const char *path = o.config;
    cfg_errors_t errs = {0};
    cfg_t *cfg = NULL;
    int rc = cfg_load(path, &cfg, &errs);
    for (size_t i = 0; i < errs.nwarnings; i++)
        dp_log_msg(DP_LOG_WARN, "config_warning", errs.warnings[i]);
    if (rc != 0) {
        for (size_t i = 0; i < errs.count; i++)
            dp_log_msg(DP_LOG_ERROR, "config_error", errs.items[i]);
        cfg_errors_free(&errs);
        return 1;
    }
    cfg_errors_free(&errs);
    dp_log_set_level((dp_log_level_t)cfg->log.level);
    /* A write error is an error code, never a signal: a closed client (EPIPE) or a full audit
     * disk under a file size limit (EFBIG) must not kill the process. */
    signal(SIGPIPE, SIG_IGN);
    signal(SIGXFSZ, SIG_IGN);
    raise_nofile();

    px_t px = {0};
    px.loop = uv_default_loop();
    px.started_ms = dp_wall_ms();
    px_thread_init(&px, px_workers_resolve(cfg->workers));
    size_threadpool(px.nworkers);
    px_metrics_set_threads(px.nslots); /* before any series: cells are sized by it */
    px_metrics_declare();
    /* What the control plane does with what replicas and requests tell it. */
    px.replica_hooks.changed = replica_changed;
    px.replica_hooks.freed = px_attest_replica_free;
    px.on_event = px_attest_on_event;
    px.gen = px_gen_new(&px, cfg, NULL);
    px.gen->published = true; /* the workers start with it */
    px_shadow_init(&px);
    if (cfg->log.audit_path) {
        /* One writer per audit trail: a second instance exits here, before it binds a port or
         * writes a byte (the lock's holder is named in the audit_locked line). */
        px.audit = px_audit_open(px.loop, cfg->log.audit_path, NULL);
        int store_lock = -1;
        if (px.audit && cfg->log.audit_store)
            store_lock = px_audit_store_lock(px.audit, cfg->log.audit_store, NULL);
        if (px.audit == NULL || (cfg->log.audit_store && store_lock < 0)) {
            run_end(&px);
            return 3;
        }
        px_audit_configure(px.audit, cfg->log.audit_store, store_lock, cfg->log.audit_signing_key,
                           cfg->log.audit_checkpoint_lines, !cfg->log.audit_fail_open);
    }
    /* Nothing is bound yet: a second instance on this config stops here. */
    if (port_taken(&cfg->listen, "client") != 0 || port_taken(&cfg->admin_listen, "admin") != 0) {
        run_end(&px);
        return 3;
    }
    px_self_via_line(NULL); /* drawn once, here: the workers only read it */
    if (px_reload_tls(&px) != 0) {
        run_end(&px);
        return 3;
    }
    net_server_limits_t alim;
    net_server_limits_default(&alim);
    px.admin = net_server_new(px.loop, &px_admin_handler, &px, &alim);
    /* Handlers before the "listening" lines: whoever waits for those may signal at once, and
     * the default action of SIGTERM/SIGHUP is to die without draining. */
    uv_signal_init(px.loop, &px.sig_term);
    uv_signal_init(px.loop, &px.sig_int);
    uv_signal_init(px.loop, &px.sig_hup);
    px.sig_term.data = px.sig_int.data = px.sig_hup.data = &px;
    uv_signal_start(&px.sig_term, on_stop_signal, SIGTERM);
    uv_signal_start(&px.sig_int, on_stop_signal, SIGINT);
    uv_signal_start(&px.sig_hup, on_hup, SIGHUP);
    if (px_workers_start(&px, &cfg->listen, &px_proxy_worker_ops) != 0 ||
        listen_on(px.admin, &cfg->admin_listen, "admin") != 0) {
        uv_close((uv_handle_t *)&px.sig_term, NULL);
        uv_close((uv_handle_t *)&px.sig_int, NULL);
        uv_close((uv_handle_t *)&px.sig_hup, NULL);
        net_server_close(px.admin, NULL, NULL);
        px.admin = NULL;
        run_end(&px);
        return 3;
    }
    uv_timer_init(px.loop, &px.drain_timer);
    px.drain_timer.data = &px;
    uv_timer_init(px.loop, &px.engines_timer);
    px.engines_timer.data = &px;
    px_admission_check_engines(&px); /* before the first probe can take a slot */
    px_fleet_start(&px);
    px_attest_start(&px);
    px_discovery_sync(&px);
    px_workers_publish(&px); /* discovery may have added replicas */
    px_otel_sync(&px);

    uv_run(px.loop, UV_RUN_DEFAULT);

    run_end(&px);
    dp_log_msg(DP_LOG_INFO, "exit", NULL);
    return px.exit_code;
}
