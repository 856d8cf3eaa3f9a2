/* `detproxy run`: load the config, start the listeners, serve until SIGTERM/SIGINT drains. */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "common/log.h"
#include "common/util.h"
#include "common/version.h"
#include "net/sock.h"
#include "net/tls.h"
#include "proxy/cli/cli.h"
#include "proxy/core/px.h"
#include "proxy/control/admin.h"
#include "proxy/control/attest.h"
#include "proxy/obs/audit.h"
#include "proxy/control/discovery.h"
#include "proxy/obs/otel.h"
#include "proxy/data/hooks.h"
#include "proxy/core/self.h"
#include "proxy/data/shadow.h"
#include "proxy/control/status.h"

#define DRAIN_LIMIT_MS 30000

void px_metrics_declare(void)
{
    px_metrics_family("detproxy_requests_total", PX_COUNTER,
                      "Client requests by pool, tenant, final status and code (what answered).");
    px_metrics_family("detproxy_tokens_total", PX_COUNTER,
                      "Tokens the replicas reported in usage, by tenant, pool and kind.");
    px_metrics_family("detproxy_replica_drained", PX_GAUGE,
                      "1 while the replica is drained (POST /admin/replicas/NAME/drain).");
    px_metrics_family("detproxy_request_duration_seconds", PX_HISTOGRAM,
                      "Time from the first request byte to the end of the response.");
    px_metrics_family("detproxy_upstream_errors_total", PX_COUNTER,
                      "Failed exchanges with replicas by kind.");
    px_metrics_family("detproxy_replica_admitted", PX_GAUGE,
                      "1 when the replica is admitted (gets traffic), else 0.");
    px_metrics_family("detproxy_attestations_total", PX_COUNTER, "Attestation checks by result.");
    px_metrics_family(
        "detproxy_fingerprint_mismatch_total", PX_COUNTER,
        "Responses whose system_fingerprint differed from the replica's attested one.");
    px_metrics_family("detproxy_policy_overrides_total", PX_COUNTER,
                      "Sampling parameters changed by policy.");
    px_metrics_family("detproxy_shadow_total", PX_COUNTER, "Shadow samples by kind and result.");
    px_metrics_family("detproxy_shadow_similarity", PX_HISTOGRAM,
                      "Word-level similarity of shadow samples.");
    px_metrics_family("detproxy_candidate_total", PX_COUNTER,
                      "Candidate-pool copies (SPEC 14) by baseline pool, candidate and result.");
    px_metrics_family("detproxy_drift_verdict", PX_GAUGE,
                      "1 for the pool's current drift verdict (SPEC 9), 0 for the others.");
    px_metrics_family("detproxy_replica_quarantined", PX_GAUGE,
                      "1 while the replica is quarantined for cross-replica drift.");
    px_metrics_family("detproxy_otel_spans_total", PX_COUNTER,
                      "OpenTelemetry spans by result (exported, dropped, failed).");
    px_metrics_family("detproxy_affinity_total", PX_COUNTER,
                      "Placements of affinity pools by result (hit, spill, fallback).");
    px_metrics_family("detproxy_connections", PX_GAUGE, "Open client connections.");
    px_metrics_family("detproxy_inflight_requests", PX_GAUGE, "Client requests being handled.");
    px_metrics_family("detproxy_audit_write_errors_total", PX_COUNTER,
                      "Audit lines that could not be written.");
    px_metrics_family("detproxy_build_info", PX_GAUGE,
                      "Always 1; the labels name the running build.");
    px_metric_set(
        px_metrics_get("detproxy_build_info", "version", dp_version, "commit", dp_commit, NULL), 1);
    px_metrics_family("detproxy_overload_rejections_total", PX_COUNTER,
                      "Requests refused 503 overloaded, by reason (body_budget, queue_full).");
    px_metrics_family("detproxy_worker_requests_total", PX_COUNTER,
                      "Client requests each worker thread took (workers).");
    px_metrics_family("detproxy_handoff_dropped_total", PX_COUNTER,
                      "Messages from the workers the control thread's queue was too full to take.");
}

static void usage(FILE *f)
{
    fputs("usage: detproxy run -c CONFIG\n"
          "\n"
          "Run the proxy in the foreground. Logs are JSON lines on stderr.\n"
          "  -c, --config FILE   configuration file (see docs/configuration.md)\n"
          "  -h, --help          this help\n"
          "Signals: SIGTERM/SIGINT drain in-flight requests (up to 30 s) and exit 0;\n"
          "SIGHUP reloads the configuration.\n",
          f);
}

void px_server_limits_for(const cfg_t *cfg, net_server_limits_t *l)
{
    net_server_limits_default(l);
    l->max_header_bytes = cfg->limits.max_header_bytes;
    l->max_headers = cfg->limits.max_headers;
    l->max_body_bytes = cfg->limits.max_body_bytes;
    l->max_connections = cfg->limits.max_connections;
    l->client_header_timeout_ms = cfg->limits.client_header_timeout_ms;
    l->client_idle_timeout_ms = cfg->limits.client_idle_timeout_ms;
    l->max_inflight_body_bytes = cfg->limits.max_inflight_body_bytes;
    l->client_body_timeout_ms = cfg->limits.client_body_timeout_ms;
    l->max_pending_handshakes = cfg->limits.max_pending_handshakes;
}

void px_admin_refresh_gauges(px_t *px)
{
    px_metric_set(px_metrics_get("detproxy_connections", NULL), (double)px_workers_connections(px));
    px_metric_set(px_metrics_get("detproxy_inflight_requests", NULL),
                  (double)px_workers_inflight(px));
    px_metric_set(px_metrics_get("detproxy_handoff_dropped_total", "queue", "control", NULL),
                  (double)net_mailbox_dropped(&px->mb));
    px_status_refresh_gauges(px);
}

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

static void finish_shutdown(px_t *px)
{
    px_discovery_stop(px);
    px_attest_stop(px);
    px_shadow_stop(px);
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
    close_handle((uv_handle_t *)&px->drain_timer);
}

static void proxy_drained(px_t *px)
{
    dp_log_msg(DP_LOG_INFO, "drained", NULL);
    finish_shutdown(px);
}

static void drain_timeout(uv_timer_t *t)
{
    px_t *px = t->data;
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "drain_timeout");
    if (w) {
        dp_jw_uint(w, "inflight", px_workers_inflight(px));
        dp_log_end(w);
    }
    px_workers_close(px);
    finish_shutdown(px);
}

static void on_stop_signal(uv_signal_t *h, int signum)
{
    px_t *px = h->data;
    if (px->draining)
        return;
    px->draining = true;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "draining");
    if (w) {
        dp_jw_str(w, "signal", signum == SIGTERM ? "SIGTERM" : "SIGINT");
        dp_jw_uint(w, "inflight", px_workers_inflight(px));
        dp_log_end(w);
    }
    uv_timer_start(&px->drain_timer, drain_timeout, DRAIN_LIMIT_MS, 0);
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

int px_cmd_run(int argc, char **argv)
{
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'}, {"help", no_argument, NULL, 'h'}, {0}};
    const char *path = NULL;
    int c;
    optind = 1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "c:h", opts, NULL)) != -1) {
        switch (c) {
        case 'c':
            path = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            fprintf(stderr, "detproxy run: unknown or incomplete option '%s' (try --help)\n",
                    argv[optind - 1]);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "detproxy run: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (path == NULL) {
        fprintf(stderr, "detproxy run: -c CONFIG is required\n");
        return 2;
    }
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
    px.nworkers = px_workers_resolve(cfg->workers);
    px.nslots = px.nworkers + 1;
    px_metrics_set_threads(px.nslots); /* before any series: cells are sized by it */
    px_metrics_declare();
    net_mailbox_init(&px.mb, px.loop, 0);
    px.gen = px_gen_new(&px, cfg, NULL);
    px.gen->published = true; /* the workers start with it */
    if (cfg->log.audit_path) {
        px.audit = px_audit_open(px.loop, cfg->log.audit_path);
        px_audit_configure(px.audit, cfg->log.audit_store, cfg->log.audit_signing_key,
                           cfg->log.audit_checkpoint_lines);
    }
    px_shadow_init(&px);
    px_self_via_line(NULL); /* drawn once, here: the workers only read it */
    if (px_tls_reload(&px) != 0) {
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
    if (px_workers_start(&px, &cfg->listen) != 0 ||
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
    px_attest_start(&px);
    px_discovery_sync(&px);
    px_gen_publish(&px); /* discovery may have added replicas */
    px_otel_sync(&px);

    uv_run(px.loop, UV_RUN_DEFAULT);

    run_end(&px);
    dp_log_msg(DP_LOG_INFO, "exit", NULL);
    return px.exit_code;
}
