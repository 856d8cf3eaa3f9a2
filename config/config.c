/* Loading a config (docs/configuration.md, docs/security.md): the top-level sections, then the
 * checks that span sections (tenant -> pool, audit -> audit_path, admin exposure, signatures).
 * Pools are in pool.c, the manifest and policy documents in manifest.c and policy.c. */
#include "config/cfg_internal.h"

#include <errno.h>
#include <limits.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "common/util.h"

static const char *const top_keys[] = {
    "listen", "admin_listen", "limits",           "attestation", "pools",   "policy", "shadow",
    "log",    "tls",          "admin_token_file", "otel",        "workers", "fleet",  NULL};
static const char *const otel_keys[] = {"endpoint", "sample_rate", NULL};
static const char *const attestation_keys[] = {"interval_ms", "timeout_ms", "require_signature",
                                               "trusted_keys", NULL};
static const char *const shadow_keys[] = {
    "rate", "self_rate", "max_inflight", "max_output_bytes", "quarantine", NULL};
static const char *const log_keys[] = {"level",
                                       "audit_path",
                                       "access",
                                       "audit_store",
                                       "audit_signing_key",
                                       "audit_checkpoint_lines",
                                       "audit_fail",
                                       NULL};
static const char *const access_keys[] = {"enabled", "sample_rate", "fields", NULL};

const char *const cfg_access_field_names[CFG_ACCESS__COUNT] = {
    "tenant",      "pool",    "replica", "code", "model", "remote",
    "upstream_ms", "ttfb_ms", "tokens",  "seed", "policy"};
static const char *const tls_keys[] = {"cert_file", "key_file", "client_ca_file", NULL};
static const char *const level_names[] = {"debug", "info", "warn", "error"};
const char *const cfg_audit_fail_names[2] = {"closed", "open"};

/* limits: every one an unsigned integer with a default and a range. */
typedef struct {
    const char *key;
    size_t off;
    bool wide; /* uint64_t, else uint32_t */
    uint64_t def, lo, hi;
} limit_field_t;

/* clang-format off */
#define LIMIT(k, d, l, h) {#k, offsetof(cfg_limits_t, k), sizeof(((cfg_limits_t *)0)->k) == 8, d, l, h}
/* clang-format on */

static const limit_field_t limit_fields[] = {
    LIMIT(max_header_bytes, 32768, 1, 1u << 20),
    LIMIT(max_body_bytes, 8388608, 1, 1u << 30),
    LIMIT(max_connections, 10000, 1, 1000000),
    LIMIT(max_connections_per_client, 0, 0, 1000000),
    LIMIT(max_headers, 100, 1, 10000),
    LIMIT(client_header_timeout_ms, 10000, 1, CFG_MS_MAX),
    LIMIT(client_idle_timeout_ms, 60000, 1, CFG_MS_MAX),
    LIMIT(upstream_connect_timeout_ms, 2000, 1, CFG_MS_MAX),
    LIMIT(upstream_first_byte_timeout_ms, 600000, 1, CFG_MS_MAX),
    LIMIT(upstream_idle_timeout_ms, 60000, 1, CFG_MS_MAX),
    LIMIT(upstream_keepalive_timeout_ms, 4000, 1, CFG_MS_MAX),
    LIMIT(max_inflight_body_bytes, 268435456, 1, UINT64_C(1) << 40),
    LIMIT(client_body_timeout_ms, 60000, 1, CFG_MS_MAX),
    LIMIT(max_response_rewrite_bytes, 16777216, 1, 1u << 30),
    LIMIT(max_pending_handshakes, 1000, 1, 1000000),
    LIMIT(shutdown_timeout_ms, 30000, 1, CFG_MS_MAX),
};

static void set_limit(cfg_limits_t *l, const limit_field_t *f, uint64_t v)
{
    char *p = (char *)l + f->off;
    if (f->wide)
        *(uint64_t *)(void *)p = v;
    else
        *(uint32_t *)(void *)p = (uint32_t)v;
}

void cfg_limits_dump(const cfg_limits_t *l, dp_jw_t *w)
{
    for (size_t i = 0; i < DP_ARRAY_SIZE(limit_fields); i++) {
        const limit_field_t *f = &limit_fields[i];
        const char *p = (const char *)l + f->off;
        dp_jw_uint(w, f->key,
                   f->wide ? *(const uint64_t *)(const void *)p
                           : *(const uint32_t *)(const void *)p);
    }
}

static void set_defaults(cfg_t *cfg)
{
    const char *why;
    cfg_parse_addr("127.0.0.1:8080", &cfg->listen, &why);
    cfg_parse_addr("127.0.0.1:9901", &cfg->admin_listen, &why);
    for (size_t i = 0; i < DP_ARRAY_SIZE(limit_fields); i++)
        set_limit(&cfg->limits, &limit_fields[i], limit_fields[i].def);
    cfg->attestation.interval_ms = 10000;
    cfg->attestation.timeout_ms = 2000;
    cfg->attestation.require_signature = false;
    cfg->shadow.max_inflight = 4;
    cfg->shadow.max_output_bytes = 1048576;
    cfg->log.level = DP_LOG_INFO;
    cfg->log.audit_checkpoint_lines = 1000;
    cfg->log.access.enabled = true;
    cfg->log.access.sample_rate = 1.0;
    cfg->log.access.fields = (1u << CFG_ACCESS__COUNT) - 1;
}

/* ---- sections -------------------------------------------------------------------------- */

static void parse_addr_key(cfg_ctx_t *c, const cJSON *doc, const char *key, cfg_addr_t *out)
{
    char *s = NULL;
    if (!cfg_get_str(c, doc, key, false, &s))
        return;
    cfg_addr_t a;
    const char *why = NULL;
    if (cfg_parse_addr(s, &a, &why) == 0) {
        free(out->host);
        *out = a;
    } else {
        cfg_err(c, key, "%s", why);
    }
    free(s);
}

static void parse_limits(cfg_ctx_t *c, const cJSON *doc, cfg_limits_t *l)
{
    const cJSON *o = cfg_get_obj(c, doc, "limits", false);
    if (o == NULL)
        return;
    const char *keys[DP_ARRAY_SIZE(limit_fields) + 1];
    for (size_t i = 0; i < DP_ARRAY_SIZE(limit_fields); i++)
        keys[i] = limit_fields[i].key;
    keys[DP_ARRAY_SIZE(limit_fields)] = NULL;
    size_t mark = cfg_path_key(c, "limits");
    cfg_check_keys(c, o, keys);
    for (size_t i = 0; i < DP_ARRAY_SIZE(limit_fields); i++) {
        const limit_field_t *f = &limit_fields[i];
        uint64_t v;
        if (cfg_get_uint(c, o, f->key, f->lo, f->hi, &v))
            set_limit(l, f, v);
    }
    /* A budget below one body would refuse every body of the largest allowed size: an error
     * when set so, and the default grows to one body when max_body_bytes is raised past it. */
    if (l->max_inflight_body_bytes < l->max_body_bytes) {
        if (cfg_get(o, "max_inflight_body_bytes") != NULL)
            cfg_err(c, "max_inflight_body_bytes", "must be at least limits.max_body_bytes (%llu)",
                    (unsigned long long)l->max_body_bytes);
        else
            l->max_inflight_body_bytes = l->max_body_bytes;
    }
    cfg_path_pop(c, mark);
}

static void parse_trusted_keys(cfg_ctx_t *c, const cJSON *o, cfg_attestation_t *a)
{
    char **rel = NULL;
    size_t n = 0;
    if (!cfg_get_str_array(c, o, "trusted_keys", false, true, &rel, &n))
        return;
    a->trusted_keys = dp_xcalloc(n + 1, sizeof(*a->trusted_keys));
    a->ntrusted_keys = n;
    size_t mark = cfg_path_key(c, "trusted_keys");
    for (size_t i = 0; i < n; i++) {
        a->trusted_keys[i] = cfg_resolve(c->dir, rel[i]);
        size_t m = cfg_path_index(c, i);
        cfg_check_ed25519_pubkey(c, NULL, a->trusted_keys[i]);
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
    cfg_str_array_free(rel, n);
}

static void parse_attestation(cfg_ctx_t *c, const cJSON *doc, cfg_attestation_t *a)
{
    const cJSON *o = cfg_get_obj(c, doc, "attestation", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "attestation");
    cfg_check_keys(c, o, attestation_keys);
    cfg_get_u32(c, o, "interval_ms", 100, CFG_MS_MAX, &a->interval_ms);
    cfg_get_u32(c, o, "timeout_ms", 1, CFG_MS_MAX, &a->timeout_ms);
    parse_trusted_keys(c, o, a);
    /* Trusting keys means requiring signatures, unless said otherwise (docs/configuration.md,
     * "attestation"); without this an attacker on the path does better by stripping signatures
     * than by forging them. */
    a->require_signature = a->ntrusted_keys > 0;
    cfg_get_bool(c, o, "require_signature", &a->require_signature);
    if (a->require_signature && a->ntrusted_keys == 0 && cfg_get(o, "trusted_keys") == NULL)
        cfg_err(c, "trusted_keys", "required when require_signature is true");
    else if (a->require_signature && a->ntrusted_keys == 0)
        cfg_err(c, "trusted_keys", "must not be empty when require_signature is true");
    cfg_path_pop(c, mark);
}

static void parse_shadow(cfg_ctx_t *c, const cJSON *doc, cfg_shadow_t *s)
{
    const cJSON *o = cfg_get_obj(c, doc, "shadow", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "shadow");
    cfg_check_keys(c, o, shadow_keys);
    cfg_get_num(c, o, "rate", 0, 1, &s->rate);
    cfg_get_num(c, o, "self_rate", 0, 1, &s->self_rate);
    cfg_get_u32(c, o, "max_inflight", 1, 10000, &s->max_inflight);
    cfg_get_uint(c, o, "max_output_bytes", 1, 1u << 30, &s->max_output_bytes);
    cfg_get_bool(c, o, "quarantine", &s->quarantine);
    cfg_path_pop(c, mark);
}

static void parse_otel(cfg_ctx_t *c, const cJSON *doc, cfg_t *cfg)
{
    const cJSON *o = cfg_get_obj(c, doc, "otel", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "otel");
    cfg_check_keys(c, o, otel_keys);
    cfg_otel_t *t = dp_xcalloc(1, sizeof(*t));
    t->sample_rate = 1.0;
    cfg->otel = t;
    if (cfg_get_url(c, o, "endpoint", true, &t->endpoint) && t->endpoint.tls)
        cfg_err(c, "endpoint",
                "https is not supported for OTLP export: send to a collector "
                "on the host or pod (http://127.0.0.1:4318)");
    cfg_get_num(c, o, "sample_rate", 0, 1, &t->sample_rate);
    cfg_path_pop(c, mark);
}

/* Set while cfg_load_reader runs: the audit trail's files are read by whoever loads the config
 * that way (replay), never written, so their folders and the signing key need not be there. */
static _Thread_local bool g_reader;

/* The audit file is opened for append at start: it may not exist yet, but its folder must, and
 * one of the two must be writable. */
static void check_audit_path(cfg_ctx_t *c, const char *path)
{
    if (g_reader)
        return;
    struct stat st;
    if (stat(path, &st) == 0) {
        if (!S_ISREG(st.st_mode))
            cfg_err(c, "audit_path", "%s is not a regular file", path);
        else if (access(path, W_OK) != 0)
            cfg_err(c, "audit_path", "%s is not writable: %s", path, strerror(errno));
        return;
    }
    if (errno != ENOENT) {
        cfg_err(c, "audit_path", "cannot use %s: %s", path, strerror(errno));
        return;
    }
    const char *slash = strrchr(path, '/');
    char *dir = slash == NULL ? dp_xstrdup(".")
                              : dp_xstrndup(path, slash == path ? 1 : (size_t)(slash - path));
    if (access(dir, W_OK) != 0)
        cfg_err(c, "audit_path", "cannot create %s: %s: %s", path, dir, strerror(errno));
    free(dir);
}

/* The store holds one file per body, created at run time: the folder must exist and be writable
 * now, so a typo fails `check` rather than every audited request. */
static void check_audit_store(cfg_ctx_t *c, const char *dir)
{
    if (g_reader)
        return;
    struct stat st;
    if (stat(dir, &st) != 0)
        cfg_err(c, "audit_store", "cannot use %s: %s", dir, strerror(errno));
    else if (!S_ISDIR(st.st_mode))
        cfg_err(c, "audit_store", "%s is not a directory", dir);
    else if (access(dir, W_OK | X_OK) != 0)
        cfg_err(c, "audit_store", "%s is not writable: %s", dir, strerror(errno));
}

static void parse_access_log(cfg_ctx_t *c, const cJSON *log, cfg_access_log_t *a)
{
    const cJSON *o = cfg_get_obj(c, log, "access", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "access");
    cfg_check_keys(c, o, access_keys);
    cfg_get_bool(c, o, "enabled", &a->enabled);
    cfg_get_num(c, o, "sample_rate", 0, 1, &a->sample_rate);
    const cJSON *f = cfg_get_arr(c, o, "fields", false);
    if (f != NULL) {
        size_t fm = cfg_path_key(c, "fields");
        a->fields = 0;
        size_t i = 0;
        for (const cJSON *e = f->child; e; e = e->next, i++) {
            size_t k = CFG_ACCESS__COUNT;
            if (cJSON_IsString(e))
                for (k = 0; k < CFG_ACCESS__COUNT; k++)
                    if (strcmp(e->valuestring, cfg_access_field_names[k]) == 0)
                        break;
            if (k == CFG_ACCESS__COUNT) {
                size_t im = cfg_path_index(c, i);
                cfg_err(c, NULL,
                        "expected one of tenant, pool, replica, code, model, remote, "
                        "upstream_ms, ttfb_ms, tokens, seed, policy");
                cfg_path_pop(c, im);
                continue;
            }
            a->fields |= 1u << k;
        }
        cfg_path_pop(c, fm);
    }
    cfg_path_pop(c, mark);
}

static void parse_log(cfg_ctx_t *c, const cJSON *doc, cfg_log_t *l)
{
    const cJSON *o = cfg_get_obj(c, doc, "log", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "log");
    cfg_check_keys(c, o, log_keys);
    cfg_get_enum(c, o, "level", level_names, DP_ARRAY_SIZE(level_names), &l->level);
    if (cfg_get_path(c, o, "audit_path", false, &l->audit_path))
        check_audit_path(c, l->audit_path);
    if (cfg_get_path(c, o, "audit_store", false, &l->audit_store))
        check_audit_store(c, l->audit_store);
    if (cfg_get_path(c, o, "audit_signing_key", false, &l->audit_signing_key) && !g_reader)
        cfg_check_ed25519_privkey(c, "audit_signing_key", l->audit_signing_key);
    cfg_get_u32(c, o, "audit_checkpoint_lines", 1, 100000000, &l->audit_checkpoint_lines);
    int fail = l->audit_fail_open ? 1 : 0;
    if (cfg_get_enum(c, o, "audit_fail", cfg_audit_fail_names, 2, &fail))
        l->audit_fail_open = fail == 1;
    if ((l->audit_store || l->audit_signing_key) && l->audit_path == NULL)
        cfg_err(c, l->audit_store ? "audit_store" : "audit_signing_key", "requires log.audit_path");
    parse_access_log(c, o, &l->access);
    cfg_path_pop(c, mark);
}

static void parse_tls(cfg_ctx_t *c, const cJSON *doc, cfg_t *cfg)
{
    const cJSON *o = cfg_get_obj(c, doc, "tls", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "tls");
    cfg_tls_t *t = dp_xcalloc(1, sizeof(*t));
    cfg->tls = t;
    cfg_check_keys(c, o, tls_keys);
    bool cert = cfg_get_path(c, o, "cert_file", true, &t->cert_file);
    bool key = cfg_get_path(c, o, "key_file", true, &t->key_file);
    if (cert && key)
        cfg_check_key_pair(c, "cert_file", t->cert_file, "key_file", t->key_file);
    if (cfg_get_path(c, o, "client_ca_file", false, &t->client_ca_file))
        cfg_check_ca_file(c, "client_ca_file", t->client_ca_file, true);
    cfg_path_pop(c, mark);
}

/* Returns the policy file name as the config gives it (NULL when inline or absent): later
 * checks on tenants name it too. It points into doc. */
static const char *parse_policy(cfg_ctx_t *c, const cJSON *doc, cfg_t *cfg)
{
    const cJSON *v = cfg_get(doc, "policy");
    if (v == NULL) {
        cfg->policy = cfg_policy_default();
        return NULL;
    }
    const char *file = NULL;
    size_t mark = cfg_path_key(c, "policy");
    if (cJSON_IsString(v)) {
        file = v->valuestring;
        cJSON *pdoc = cfg_read_referenced(c, file);
        cfg->policy = pdoc != NULL ? cfg_policy_from_json(c, pdoc) : NULL;
        cJSON_Delete(pdoc);
        c->file = NULL;
    } else if (cJSON_IsObject(v)) {
        cfg->policy = cfg_policy_from_json(c, v);
    } else {
        cfg_err(c, NULL, "expected a file path or an object");
    }
    cfg_path_pop(c, mark);
    return file;
}

/* ---- checks across sections ------------------------------------------------------------ */

static bool is_wildcard(const char *host)
{
    return strcmp(host, "0.0.0.0") == 0 || strcmp(host, "::") == 0;
}

/* A token that a Bearer header can carry: visible bytes only (the header's parser refuses a
 * token with whitespace or a control byte in it, so such a token could never match). */
static void check_admin_token(cfg_ctx_t *c, const char *tok)
{
    for (size_t i = 0; tok && tok[i]; i++) {
        unsigned char b = (unsigned char)tok[i];
        if (b <= ' ' || b == 0x7f) {
            cfg_err(c, "admin_token_file",
                    "the token has whitespace or a control byte at byte %zu: no "
                    "Authorization: Bearer header can carry it",
                    i);
            return;
        }
    }
}

static void check_listeners(cfg_ctx_t *c, const cfg_t *cfg)
{
    const cfg_addr_t *l = &cfg->listen, *a = &cfg->admin_listen;
    if (!cfg_addr_is_loopback(a->host) && cfg->admin_token_file == NULL)
        cfg_err(c, "admin_listen",
                "not a loopback address: set admin_token_file to expose the admin endpoints");
    bool overlap = strcmp(l->host, a->host) == 0 || is_wildcard(l->host) || is_wildcard(a->host);
    if (l->port != 0 && l->port == a->port && overlap)
        cfg_err(c, "admin_listen", "overlaps listen (same port)");
}

/* A tenant requiring a determinism mode must have a pool that offers it (docs/configuration.md,
 * "Deterministic pools"). */
static void check_tenant_determinism(cfg_ctx_t *c, const cfg_t *cfg, const cfg_tenant_t *t,
                                     const cfg_pool_t *pinned)
{
    cfg_determinism_t want = t->require_determinism;
    if (want == CFG_DETERMINISM_NONE)
        return;
    const char *name = cfg_determinism_names[want];
    if (pinned != NULL) {
        if (cfg_pool_determinism(pinned) != want)
            cfg_err(c, "require_determinism",
                    "\"%s\", but its pool \"%s\" has determinism.mode \"%s\"", name, pinned->name,
                    cfg_determinism_names[cfg_pool_determinism(pinned)]);
        return;
    }
    for (size_t i = 0; i < cfg->npools; i++)
        if (cfg_pool_determinism(&cfg->pools[i]) == want)
            return;
    cfg_err(c, "require_determinism", "\"%s\", but no pool's manifest has determinism.mode \"%s\"",
            name, name);
}

static void check_tenants(cfg_ctx_t *c, const cfg_t *cfg, const char *policy_file)
{
    if (cfg->policy == NULL)
        return;
    c->file = policy_file;
    size_t mark = cfg_path_key(c, "policy");
    cfg_path_key(c, "tenants");
    for (size_t i = 0; i < cfg->policy->ntenants; i++) {
        const cfg_tenant_t *t = &cfg->policy->tenants[i];
        size_t m = cfg_path_index(c, i);
        const cfg_pool_t *p = t->pool != NULL ? cfg_pool_by_name(cfg, t->pool) : NULL;
        if (t->pool != NULL && p == NULL)
            cfg_err(c, "pool", "no pool is named \"%s\"", t->pool);
        check_tenant_determinism(c, cfg, t, p);
        if (t->audit && cfg->log.audit_path == NULL)
            cfg_err(c, "audit", "requires log.audit_path");
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
    c->file = NULL;
}

/* A candidate pool a tenant pins still serves that tenant's clients. */
static void mark_only_candidates(cfg_t *cfg)
{
    for (size_t i = 0; i < cfg->npools; i++) {
        cfg_pool_t *p = &cfg->pools[i];
        p->only_candidate = p->is_candidate;
        for (size_t k = 0; p->name && cfg->policy && k < cfg->policy->ntenants; k++) {
            const char *pin = cfg->policy->tenants[k].pool;
            if (pin && strcmp(pin, p->name) == 0)
                p->only_candidate = false;
        }
    }
}

/* Sources that can never pass: a native adapter (unsigned) under require_signature, and an
 * agent (always signed) with no key to trust. Warnings, as the replica merely stays rejected. */
static void check_source(cfg_ctx_t *c, const cfg_attestation_t *a, cfg_attest_source_t s,
                         bool *agent_seen)
{
    if (a->require_signature && s >= CFG_ATTEST_VLLM)
        cfg_warn(c, "attest",
                 "the %s adapter is unsigned and attestation.require_signature is true: "
                 "never admitted",
                 cfg_attest_source_names[s]);
    /* With require_signature, an empty trusted_keys is already an error. */
    if (s == CFG_ATTEST_AGENT && a->ntrusted_keys == 0 && !a->require_signature && !*agent_seen) {
        *agent_seen = true;
        cfg_warn(c, "attest",
                 "the agent signs its attestations but attestation.trusted_keys is empty: "
                 "every one will be rejected as untrusted");
    }
    if (s == CFG_ATTEST_AGENT && a->ntrusted_keys > 0 && !a->require_signature)
        cfg_warn(c, "attest",
                 "unsigned: attestation.require_signature is false, so an envelope stripped "
                 "of its signatures is admitted");
}

bool cfg_pool_require_signature(const cfg_t *cfg, const cfg_pool_t *p)
{
    return p->require_signature >= 0 ? p->require_signature != 0
                                     : cfg->attestation.require_signature;
}

static void check_signatures(cfg_ctx_t *c, const cfg_t *cfg)
{
    bool agent_seen = false;
    size_t mark = cfg_path_key(c, "pools");
    for (size_t i = 0; i < cfg->npools; i++) {
        const cfg_pool_t *p = &cfg->pools[i];
        size_t m = cfg_path_index(c, i);
        /* The pool's own setting, with the top level's keys. */
        cfg_attestation_t a = cfg->attestation;
        a.require_signature = cfg_pool_require_signature(cfg, p);
        if (p->require_signature == 1 && a.ntrusted_keys == 0) {
            size_t k = cfg_path_key(c, "attestation");
            cfg_err(c, "require_signature",
                    "needs attestation.trusted_keys (the keys to check signatures with)");
            cfg_path_pop(c, k);
        }
        if (p->discovery != NULL) {
            size_t d = cfg_path_key(c, "discovery");
            check_source(c, &a, p->discovery->attest_source, &agent_seen);
            cfg_path_pop(c, d);
        }
        size_t r = cfg_path_key(c, "replicas");
        for (size_t j = 0; j < p->nreplicas; j++) {
            size_t k = cfg_path_index(c, j);
            check_source(c, &a, p->replicas[j].attest.source, &agent_seen);
            cfg_path_pop(c, k);
        }
        cfg_path_pop(c, r);
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
}

/* A fleet keys its shared entries by pool and replica name (verdicts/<pool>/<replica>): a '/'
 * in either would let two pairs share a key. */
static void check_fleet_names(cfg_ctx_t *c, const cfg_t *cfg)
{
    if (cfg->fleet == NULL)
        return;
    static const char why[] = "no '/' with a fleet: pool and replica names are parts of its etcd "
                              "keys";
    size_t mark = cfg_path_key(c, "pools");
    for (size_t i = 0; i < cfg->npools; i++) {
        const cfg_pool_t *p = &cfg->pools[i];
        size_t m = cfg_path_index(c, i);
        if (p->name && strchr(p->name, '/'))
            cfg_err(c, "name", "%s", why);
        size_t r = cfg_path_key(c, "replicas");
        for (size_t j = 0; j < p->nreplicas; j++) {
            size_t k = cfg_path_index(c, j);
            if (p->replicas[j].name && strchr(p->replicas[j].name, '/'))
                cfg_err(c, "name", "%s", why);
            cfg_path_pop(c, k);
        }
        cfg_path_pop(c, r);
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
}

/* Whether pool p's clients can get shadow copies: a self rate, or a cross rate (a tenant's
 * shadow_rate in place of shadow.rate) of a tenant that can reach p; never on a
 * single_sequence pool, where a copy would be a second sequence in flight. */
static bool pool_has_shadows(const cfg_t *cfg, const cfg_pool_t *p)
{
    if (cfg_pool_determinism(p) == CFG_DETERMINISM_SINGLE_SEQUENCE)
        return false;
    if (cfg->shadow.self_rate > 0)
        return true;
    if (cfg->policy == NULL || cfg->policy->ntenants == 0)
        return cfg->shadow.rate > 0;
    for (size_t k = 0; k < cfg->policy->ntenants; k++) {
        const cfg_tenant_t *t = &cfg->policy->tenants[k];
        if (t->pool && (p->name == NULL || strcmp(t->pool, p->name) != 0))
            continue; /* pinned elsewhere */
        if (!t->pool && t->require_determinism != CFG_DETERMINISM_NONE &&
            cfg_pool_determinism(p) != t->require_determinism)
            continue; /* routed only to pools of its determinism mode */
        if ((t->shadow_rate >= 0 ? t->shadow_rate : cfg->shadow.rate) > 0)
            return true;
    }
    return false;
}

/* A rollout's verdict measures a candidate against the baseline's own noise, which only shadow
 * pairs give: a baseline that gets none keeps every candidate at insufficient_data. */
static void check_rollout_noise(cfg_ctx_t *c, const cfg_t *cfg)
{
    size_t mark = cfg_path_key(c, "pools");
    for (size_t i = 0; i < cfg->npools; i++) {
        const cfg_pool_t *p = &cfg->pools[i];
        if (p->ncandidates == 0 || pool_has_shadows(cfg, p))
            continue;
        size_t m = cfg_path_index(c, i);
        cfg_warn(c, "candidates",
                 "%s: the baseline has no noise figure, so every candidate's "
                 "verdict stays insufficient_data",
                 cfg_pool_determinism(p) == CFG_DETERMINISM_SINGLE_SEQUENCE
                     ? "a single_sequence pool gets no shadow copies"
                     : "no shadow.self_rate, and no cross rate (shadow.rate, or a tenant's "
                       "shadow_rate) for a tenant this pool serves");
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
}

/* ---- loading --------------------------------------------------------------------------- */

static void parse_config(cfg_ctx_t *c, const cJSON *doc, cfg_t *cfg)
{
    cfg_check_keys(c, doc, top_keys);
    parse_addr_key(c, doc, "listen", &cfg->listen);
    parse_addr_key(c, doc, "admin_listen", &cfg->admin_listen);
    cfg_get_u32(c, doc, "workers", 0, CFG_MAX_WORKERS, &cfg->workers);
    parse_limits(c, doc, &cfg->limits);
    parse_attestation(c, doc, &cfg->attestation);
    parse_shadow(c, doc, &cfg->shadow);
    parse_otel(c, doc, cfg);
    parse_log(c, doc, &cfg->log);
    parse_tls(c, doc, cfg);
    cfg_parse_fleet(c, doc, cfg);
    if (cfg_get_path(c, doc, "admin_token_file", false, &cfg->admin_token_file)) {
        cfg->admin_token = cfg_read_secret(c, "admin_token_file", cfg->admin_token_file);
        check_admin_token(c, cfg->admin_token);
    }
    cfg_parse_pools(c, doc, cfg);
    const char *policy_file = parse_policy(c, doc, cfg);
    check_listeners(c, cfg);
    check_tenants(c, cfg, policy_file);
    mark_only_candidates(cfg);
    check_signatures(c, cfg);
    check_fleet_names(c, cfg);
    check_rollout_noise(c, cfg);
}

/* Takes ownership of path (NULL for a string config). */
static int load(const char *json, size_t len, const char *dir, char *path, cfg_t **out,
                cfg_errors_t *errs)
{
    cfg_t *cfg = dp_xcalloc(1, sizeof(*cfg));
    cfg->path = path;
    cfg->dir = dp_xstrdup(dir);
    set_defaults(cfg);
    cfg_ctx_t c;
    cfg_ctx_init(&c, errs, NULL, "config", cfg->dir);
    cJSON *doc = cfg_parse_json(&c, json, len);
    if (doc != NULL && !cJSON_IsObject(doc))
        cfg_err(&c, NULL, "expected a JSON object");
    else if (doc != NULL)
        parse_config(&c, doc, cfg);
    cJSON_Delete(doc);
    if (c.nerrors > 0) {
        cfg_free(cfg);
        cfg = NULL;
    }
    cfg_ctx_free(&c);
    *out = cfg;
    return cfg != NULL ? 0 : -1;
}

/* An absolute path for the file, and its folder, without resolving symlinks: a Kubernetes
 * ConfigMap mount swaps a symlinked folder on update, and a reload must follow it. */
static char *absolute(const char *path)
{
    if (path[0] == '/')
        return dp_xstrdup(path);
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof(cwd)) == NULL)
        return NULL;
    return cfg_resolve(cwd, path);
}

static int load_once(const char *path, cfg_t **out, cfg_errors_t *errs)
{
    cfg_errors_t local = {0};
    cfg_ctx_t c;
    cfg_ctx_init(&c, errs != NULL ? errs : &local, NULL, "config", NULL);
    dp_buf_t text = {0};
    char *abs = NULL, *dir = NULL;
    int rc = -1;
    *out = NULL;
    cfg_versions_begin();
    if (!cfg_read_file(&c, NULL, path, CFG_DOC_MAX, &text))
        goto done;
    abs = absolute(path);
    if (abs == NULL) {
        cfg_err(&c, NULL, "cannot resolve %s: %s", path, strerror(errno));
        goto done;
    }
    char *slash = strrchr(abs, '/');
    dir = dp_xstrndup(abs, slash == abs ? 1 : (size_t)(slash - abs));
    rc = load(text.base, text.len, dir, abs, out, c.errs);
    abs = NULL; /* owned by the config, or freed with it */
done:
    cfg_versions_end();
    free(dir);
    free(abs);
    dp_buf_free(&text);
    cfg_ctx_free(&c);
    cfg_errors_free(&local);
    return rc;
}

int cfg_load(const char *path, cfg_t **out, cfg_errors_t *errs)
{
    /* A load that read a Kubernetes volume at a version the kubelet removed meanwhile is done
     * again, whole, at the new version: once, as a swap is rare and a second one as unlikely. */
    cfg_errors_t local = {0};
    int rc = load_once(path, out, errs ? errs : &local);
    if (rc != 0 && cfg_versions_gone()) {
        cfg_errors_free(errs ? errs : &local);
        rc = load_once(path, out, errs ? errs : &local);
    }
    cfg_errors_free(&local);
    return rc;
}

int cfg_load_reader(const char *path, cfg_t **out, cfg_errors_t *errs)
{
    g_reader = true;
    int rc = cfg_load(path, out, errs);
    g_reader = false;
    return rc;
}

int cfg_load_string(const char *json, size_t len, const char *dir, cfg_t **out, cfg_errors_t *errs)
{
    cfg_errors_t local = {0};
    char cwd[PATH_MAX];
    if (dir == NULL)
        dir = getcwd(cwd, sizeof(cwd)) != NULL ? cwd : ".";
    int rc = load(json, len, dir, NULL, out, errs != NULL ? errs : &local);
    cfg_errors_free(&local);
    return rc;
}

void cfg_free(cfg_t *cfg)
{
    if (cfg == NULL)
        return;
    free(cfg->path);
    free(cfg->dir);
    free(cfg->listen.host);
    free(cfg->admin_listen.host);
    cfg_str_array_free(cfg->attestation.trusted_keys, cfg->attestation.ntrusted_keys);
    for (size_t i = 0; i < cfg->npools; i++)
        cfg_pool_free(&cfg->pools[i]);
    free(cfg->pools);
    cfg_policy_free(cfg->policy);
    free(cfg->log.audit_path);
    free(cfg->log.audit_store);
    free(cfg->log.audit_signing_key);
    if (cfg->tls != NULL) {
        free(cfg->tls->cert_file);
        free(cfg->tls->key_file);
        free(cfg->tls->client_ca_file);
    }
    free(cfg->tls);
    if (cfg->otel != NULL)
        cfg_url_free(&cfg->otel->endpoint);
    free(cfg->otel);
    cfg_fleet_free(cfg->fleet);
    free(cfg->admin_token_file);
    cfg_secret_free(cfg->admin_token);
    free(cfg);
}
