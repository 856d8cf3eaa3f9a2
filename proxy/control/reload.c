/* Live reload (SIGHUP, POST /admin/reload): validate the whole new config first; on any error
 * keep the old one and say why. On success new requests use the new generation while in-flight
 * ones finish on the old; replicas whose definition is unchanged are carried over with their
 * attestation state and keep-alive connections. */
#include <assert.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"
#include "net/tls.h"
#include "proxy/control/attest.h"
#include "proxy/control/reload.h"
#include "proxy/data/admission.h"
#include "proxy/obs/audit.h"
#include "proxy/control/discovery.h"
#include "proxy/control/fleet.h"
#include "proxy/obs/otel.h"
#include "proxy/data/shadow.h"
#include "proxy/core/gen.h"
#include "proxy/core/metrics.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"
#include "proxy/data/worker.h"

/* The reload's outcome, for alerting on a configuration file the process does not run. */
static void count_reload(bool ok)
{
    px_metrics_add(
        px_metrics_get("detproxy_config_reloads_total", "result", ok ? "reloaded" : "failed", NULL),
        1);
    px_metrics_set(px_metrics_get("detproxy_config_last_reload_successful", NULL), ok);
    if (ok)
        px_metrics_set(
            px_metrics_get("detproxy_config_last_reload_success_timestamp_seconds", NULL),
            (double)dp_wall_ms() / 1000.0);
}

static int last_reload_errors(cfg_errors_t *errs, dp_buf_t *msg)
{
    count_reload(false);
    for (size_t i = 0; i < errs->count; i++) {
        if (msg) {
            if (i)
                dp_buf_append(msg, "; ", 2);
            dp_buf_appends(msg, errs->items[i]);
        }
    }
    return (int)errs->count;
}

static bool addr_eq(const cfg_addr_t *a, const cfg_addr_t *b)
{
    return a->port == b->port && strcmp(a->host, b->host) == 0;
}

static void addr_keep(cfg_addr_t *to, const cfg_addr_t *from)
{
    free(to->host);
    to->host = dp_xstrdup(from->host);
    to->port = from->port;
}

static cfg_tls_t *tls_copy(const cfg_tls_t *t)
{
    cfg_tls_t *c = dp_xcalloc(1, sizeof(*c));
    c->cert_file = dp_xstrdup(t->cert_file);
    c->key_file = dp_xstrdup(t->key_file);
    c->client_ca_file = t->client_ca_file ? dp_xstrdup(t->client_ca_file) : NULL;
    return c;
}

/* What a configuration names could not be had: why (fallback when it says nothing), as a
 * configuration error under key. */
static void key_error(cfg_errors_t *errs, const char *key, const dp_buf_t *why,
                      const char *fallback)
{
    dp_buf_t e = {0};
    dp_buf_printf(&e, "%s: %s", key, why->base ? why->base : fallback);
    cfg_errors_add(errs, e.base);
    dp_buf_free(&e);
}

/* The listener's TLS context for t, or the reason it cannot be had, as a configuration error
 * naming the key. */
static int tls_load(const cfg_tls_t *t, net_tls_ctx_t **out, cfg_errors_t *errs)
{
    dp_buf_t err = {0};
    *out = net_tls_server_ctx(t->cert_file, t->key_file, t->client_ca_file, &err);
    if (*out == NULL)
        key_error(errs, "tls", &err, "cannot be loaded");
    dp_buf_free(&err);
    return *out ? 0 : -1;
}

/* The listener takes c (NULL: the configuration has no tls). */
static void tls_install(px_t *px, net_tls_ctx_t *c)
{
    if (c == NULL) {
        if (px->tls && px->workers)
            dp_log_msg(DP_LOG_WARN, "tls_unchanged",
                       "turning TLS off needs a restart: the listener keeps TLS");
        return;
    }
    px_workers_set_tls(px, c);
    net_tls_ctx_unref(px->tls);
    px->tls = c;
    const cfg_tls_t *t = px->gen->cfg->tls;
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "tls_loaded");
    if (w) {
        dp_jw_str(w, "cert_file", t->cert_file);
        dp_jw_bool(w, "client_certificates_required", t->client_ca_file != NULL);
        dp_log_end(w);
    }
}

/* Does the new configuration write its audit trail to another file than the old one? */
static bool audit_moved(const cfg_t *old, const cfg_t *cfg)
{
    if ((cfg->log.audit_path == NULL) != (old->log.audit_path == NULL))
        return true;
    if (cfg->log.audit_path == NULL || strcmp(cfg->log.audit_path, old->log.audit_path) == 0)
        return false;
    /* Another spelling of the file written (a/./x, a link to its folder, a hard link) is the
     * same trail: moving onto it would find its own locks taken. */
    struct stat a, b;
    return stat(old->log.audit_path, &a) != 0 || stat(cfg->log.audit_path, &b) != 0 ||
           a.st_dev != b.st_dev || a.st_ino != b.st_ino;
}

/* Move the audit writer to path, or open one there when the running configuration has none.
 * 0; -1 when path's locks are another process's (another detproxy writes that trail), with the
 * reason as a configuration error naming the key, and the writer left on its file. */
static int audit_take(px_t *px, const char *path, cfg_errors_t *errs)
{
    dp_buf_t why = {0};
    int rc = 0;
    if (px->audit)
        rc = px_audit_reopen(px->audit, path, &why);
    else if ((px->audit = px_audit_open(px->loop, path, &why)) == NULL)
        rc = -1;
    if (rc != 0)
        key_error(errs, "log.audit_path", &why, "cannot be locked");
    dp_buf_free(&why);
    return rc;
}

/* The new configuration has no audit trail (no tenant is audited: config validation): the
 * writer finishes the lines queued before the reload in its file, then closes it and lets go
 * of its locks, as a move lets go of the old path's, so another detproxy may take the trail
 * on. Lines submitted from now on (requests begun under the old configuration) have no writer:
 * their callbacks get UV_ECANCELED. */
static void audit_retire(px_t *px)
{
    px_audit_retire(px->audit);
    px->audit_retired =
        dp_xrealloc(px->audit_retired, (px->naudit_retired + 1) * sizeof(*px->audit_retired));
    px->audit_retired[px->naudit_retired++] = px->audit;
    px->audit = NULL;
}

/* The lock of the audit store store for the writer: *lock, or -1 when another process holds it
 * (another detproxy stores its bodies there), with the reason as a configuration error naming
 * the key. */
static int store_take(px_t *px, const char *store, int *lock, cfg_errors_t *errs)
{
    dp_buf_t why = {0};
    *lock = px_audit_store_lock(px->audit, store, &why);
    if (*lock < 0)
        key_error(errs, "log.audit_store", &why, "cannot be locked");
    dp_buf_free(&why);
    return *lock < 0 ? -1 : 0;
}

/* Take what cfg names before anything of it is applied, so that a reload that cannot have all
 * of it fails whole with the running configuration kept: the listener's certificate (*tls, NULL
 * without tls), the audit store's lock (*store_lock, -1 without a store), then the audit path's
 * locks when the trail moves (*audit_to). Those last are taken by moving the writer, which
 * cannot be undone, so they come last and nothing after them refuses. 0 with all of them; -1
 * with none held, the reasons in errs. */
static int take_named(px_t *px, const cfg_t *old, const cfg_t *cfg, net_tls_ctx_t **tls,
                      int *store_lock, bool *audit_to, cfg_errors_t *errs)
{
    *tls = NULL;
    *store_lock = -1;
    *audit_to = audit_moved(old, cfg) && cfg->log.audit_path;
    if (cfg->tls && tls_load(cfg->tls, tls, errs) != 0)
        return -1;
    if (cfg->log.audit_path && cfg->log.audit_store &&
        store_take(px, cfg->log.audit_store, store_lock, errs) != 0)
        goto release;
    if (*audit_to && audit_take(px, cfg->log.audit_path, errs) != 0)
        goto release;
    return 0;
release:
    if (*store_lock >= 0)
        close(*store_lock);
    *store_lock = -1;
    net_tls_ctx_unref(*tls);
    *tls = NULL;
    return -1;
}

int px_reload_msg(px_t *px, const char *why, dp_buf_t *msg)
{
    cfg_t *old = px->gen->cfg;
    /* Log rotation: the audit file is reopened on every reload request, valid config or not;
     * onto the new config's audit_path when that moved, in one step (reopening the old file
     * first would close it with a checkpoint while no lock file yet names the chain's head at
     * the new path: a crash then started the new file at genesis), once the rest of the new
     * configuration has loaded (audit_take). */
    if (px->draining) { /* a process stops with the configuration it ran */
        if (px->audit)
            px_audit_reopen(px->audit, NULL, NULL);
        dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "reload_ignored");
        if (w) {
            dp_jw_str(w, "trigger", why);
            dp_jw_str(w, "detail", "draining: the configuration is kept, the audit file reopened");
            dp_log_end(w);
        }
        if (msg)
            dp_buf_appends(msg, "the process is stopping: it keeps the configuration it runs");
        return PX_RELOAD_DRAINING;
    }
    cfg_errors_t errs = {0};
    cfg_t *cfg = NULL;
    int rc = cfg_load(old->path, &cfg, &errs);
    for (size_t i = 0; i < errs.nwarnings; i++)
        dp_log_msg(DP_LOG_WARN, "config_warning", errs.warnings[i]);
    if (rc == 0 && !cfg_addr_is_loopback(old->admin_listen.host) && cfg->admin_token == NULL) {
        /* The listeners keep their addresses until a restart: the token rule (docs/security.md)
         * holds for the address the admin listener is bound to, whatever the file says now. */
        char e[300];
        snprintf(e, sizeof(e),
                 "admin_token_file: the admin listener stays on %s:%u until a restart, not a "
                 "loopback address: a reload cannot remove its token",
                 old->admin_listen.host, (unsigned)old->admin_listen.port);
        cfg_errors_add(&errs, e);
        cfg_free(cfg);
        cfg = NULL;
        rc = -1;
    }
    /* What the configuration names is taken before anything of the reload is applied
     * (take_named): a certificate the TLS library refuses, an audit store or audit path another
     * detproxy holds (a generation requiring bodies or lines no writer can store would refuse
     * every audited request, or answer it without them) fails the reload whole. */
    net_tls_ctx_t *tls = NULL;
    int store_lock = -1;
    bool audit_to = false, invalid = rc != 0;
    if (rc == 0 && take_named(px, old, cfg, &tls, &store_lock, &audit_to, &errs) != 0) {
        cfg_free(cfg);
        cfg = NULL;
        rc = -1;
    }
    if (rc != 0) {
        /* Which of the two failed: a file to fix (what `detproxy check` says too), or a valid
         * file whose certificate, audit file or store cannot be had now (another detproxy's). */
        dp_jw_t *w = dp_log_begin(DP_LOG_ERROR, "reload_failed");
        if (w) {
            dp_jw_str(w, "trigger", why);
            dp_jw_str(w, "cause", invalid ? "config_invalid" : "unavailable");
            dp_jw_str(w, "detail",
                      invalid ? "configuration invalid: keeping the running one"
                              : "configuration valid, but what it names cannot be had (a "
                                "certificate the TLS library refuses, an audit file or store "
                                "another detproxy holds): keeping the running one");
            dp_jw_arr_begin(w, "errors");
            for (size_t i = 0; i < errs.count; i++)
                dp_jw_str(w, NULL, errs.items[i]);
            dp_jw_arr_end(w);
            dp_log_end(w);
        }
        last_reload_errors(&errs, msg);
        cfg_errors_free(&errs);
        if (px->audit)
            px_audit_reopen(px->audit, NULL, NULL);
        return invalid ? -1 : PX_RELOAD_UNAVAILABLE;
    }
    cfg_errors_free(&errs);
    if (!addr_eq(&cfg->listen, &old->listen) || !addr_eq(&cfg->admin_listen, &old->admin_listen))
        dp_log_msg(DP_LOG_WARN, "reload_listen_unchanged",
                   "listen/admin_listen changes take effect only after a restart");
    /* Each generation carries the addresses the listeners are bound to, not the file's: the
     * token rule above is checked against them (two reloads, one moving the address and one
     * dropping the token, would otherwise get past it), and /admin/config shows what runs. */
    addr_keep(&cfg->listen, &old->listen);
    addr_keep(&cfg->admin_listen, &old->admin_listen);
    /* The same for what else a reload cannot change: the worker threads, and TLS on a listener
     * that has it (turning it off needs a restart; tls_install warns). */
    if (px_workers_resolve(cfg->workers) != px->nworkers)
        dp_log_msg(DP_LOG_WARN, "reload_workers_unchanged",
                   "a change of workers takes effect only after a restart");
    cfg->workers = old->workers;
    if (cfg->tls == NULL && px->tls && px->workers && old->tls)
        cfg->tls = tls_copy(old->tls);
    if (!audit_to && cfg->log.audit_path && old->log.audit_path &&
        strcmp(cfg->log.audit_path, old->log.audit_path) != 0) {
        /* The running file named another way: it keeps the name it is written under, so the
         * next reload compares with the file really written (a link retargeted, a rotation of
         * the other name, make it another file, and the trail moves then). */
        free(cfg->log.audit_path);
        cfg->log.audit_path = dp_xstrdup(old->log.audit_path);
    }
    px_fleet_keep(px, old, cfg);
    px_gen_t *prev = px->gen;
    px_gen_t *g = px_gen_new(px, cfg, prev);
    px->gen = g;
    dp_log_set_level((dp_log_level_t)cfg->log.level);
    if (px->audit && cfg->log.audit_path == NULL)
        audit_retire(px);
    else if (px->audit && !audit_to) /* moved (audit_take) or opened there already */
        px_audit_reopen(px->audit, NULL, NULL);
    if (cfg->log.audit_path) {
        assert(px->audit != NULL); /* opened at start, or by take_named */
        px_audit_configure(px->audit, cfg->log.audit_store, store_lock, cfg->log.audit_signing_key,
                           cfg->log.audit_checkpoint_lines, !cfg->log.audit_fail_open);
    }
    px_discovery_sync(px);
    px_admission_check_engines(px);
    px_workers_publish(px);
    px_attest_sync(px);
    px_fleet_reloaded(px);
    px_otel_sync(px);
    tls_install(px, tls);
    px_gen_unref(prev);
    count_reload(true);
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "reloaded");
    if (w) {
        dp_jw_str(w, "trigger", why);
        dp_jw_uint(w, "pools", cfg->npools);
        dp_jw_uint(w, "tenants", cfg->policy->ntenants);
        dp_log_end(w);
    }
    return 0;
}

int px_reload_tls(px_t *px)
{
    net_tls_ctx_t *c = NULL;
    cfg_errors_t errs = {0};
    int rc = px->gen->cfg->tls ? tls_load(px->gen->cfg->tls, &c, &errs) : 0;
    if (rc != 0)
        dp_log_msg(DP_LOG_ERROR, "tls_load_failed", errs.items[0]);
    else
        tls_install(px, c);
    cfg_errors_free(&errs);
    return rc;
}

int px_reload(px_t *px, const char *why)
{
    return px_reload_msg(px, why, NULL);
}
