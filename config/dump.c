/* The effective configuration as JSON (GET /admin/config): every key with the value in force,
 * defaults filled in, in the config file's own shape, so an operator can diff it against the
 * file or feed parts of it back. Secrets are redacted, never loaded into the output: the
 * contents of api_key_file and admin_token_file ("<redacted>" when set), tenant key digests
 * (their first 8 hex only, enough to tell keys apart) and header-match values. Paths are kept. */
#include "config/cfg_internal.h"

#include <stdio.h>
#include <string.h>

#include "common/jw.h"
#include "common/util.h"

#define REDACTED "<redacted>"

static void addr(dp_jw_t *w, const char *key, const cfg_addr_t *a)
{
    char b[80];
    snprintf(b, sizeof(b), strchr(a->host, ':') ? "[%s]:%u" : "%s:%u", a->host, a->port);
    dp_jw_str(w, key, b);
}

static void url(dp_jw_t *w, const char *key, const cfg_url_t *u)
{
    if (u->host == NULL) {
        dp_jw_null(w, key);
        return;
    }
    dp_buf_t b = {0};
    dp_buf_printf(&b, "%s://%s%s", u->tls ? "https" : "http", u->hostport, u->path ? u->path : "");
    dp_jw_str(w, key, b.base);
    dp_buf_free(&b);
}

static void strs(dp_jw_t *w, const char *key, char *const *a, size_t n)
{
    dp_jw_arr_begin(w, key);
    for (size_t i = 0; i < n; i++)
        dp_jw_str(w, NULL, a[i]);
    dp_jw_arr_end(w);
}

static void secret(dp_jw_t *w, const char *key, const char *value)
{
    dp_jw_str(w, key, value ? REDACTED : NULL);
}

/* A manifest under key (NULL in an array), its accept[] entries nested the same way. */
static void manifest(dp_jw_t *w, const char *key, const cfg_manifest_t *m)
{
    if (m == NULL) {
        dp_jw_null(w, key);
        return;
    }
    dp_jw_obj_begin(w, key);
    dp_jw_str(w, "model", m->model);
    dp_jw_str(w, "checkpoint_sha256", m->checkpoint_sha256);
    dp_jw_str(w, "quantization", m->quantization);
    dp_jw_str(w, "dtype", m->dtype);
    dp_jw_obj_begin(w, "framework");
    dp_jw_str(w, "name", m->framework_name);
    dp_jw_str(w, "version", m->framework_version);
    dp_jw_obj_end(w);
    dp_jw_str(w, "engine_fingerprint", m->engine_fingerprint);
    if (m->canary) {
        dp_jw_obj_begin(w, "canary");
        dp_jw_str(w, "prompt", m->canary->prompt);
        dp_jw_uint(w, "max_tokens", m->canary->max_tokens);
        dp_jw_str(w, "expected_sha256", m->canary->expected_sha256);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "canary");
    }
    if (m->oms_signer || m->oms_identity) {
        dp_jw_obj_begin(w, "oms");
        if (m->oms_signer)
            dp_jw_str(w, "signer", m->oms_signer);
        if (m->oms_identity) {
            dp_jw_str(w, "identity", m->oms_identity);
            dp_jw_str(w, "issuer", m->oms_issuer);
        }
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "oms");
    }
    if (m->determinism != CFG_DETERMINISM_NONE) {
        dp_jw_obj_begin(w, "determinism");
        dp_jw_str(w, "mode", cfg_determinism_names[m->determinism]);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "determinism");
    }
    dp_jw_str(w, "fingerprint", m->fingerprint);
    dp_jw_arr_begin(w, "accept");
    for (size_t i = 0; i < m->naccept; i++)
        manifest(w, NULL, &m->accept[i]);
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

static void pool(dp_jw_t *w, const cfg_t *cfg, const cfg_pool_t *p)
{
    static const char *const balance[] = {"least_inflight", "round_robin", "affinity"};
    dp_jw_obj_begin(w, NULL);
    dp_jw_str(w, "name", p->name);
    strs(w, "models", p->models, p->nmodels);
    manifest(w, "manifest", p->manifest);
    dp_jw_str(w, "balance", balance[p->balance]);
    if (p->balance == CFG_BALANCE_AFFINITY) {
        dp_jw_obj_begin(w, "affinity");
        dp_jw_str(w, "key", cfg_affinity_key_names[p->affinity.key]);
        dp_jw_uint(w, "prefix_bytes", p->affinity.prefix_bytes);
        dp_jw_str(w, "session_header", p->affinity.session_header);
        dp_jw_double(w, "load_factor", p->affinity.load_factor);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "affinity");
    }
    dp_jw_uint(w, "max_inflight_per_replica", p->max_inflight_per_replica);
    dp_jw_uint(w, "queue_limit", p->queue_limit);
    dp_jw_uint(w, "queue_timeout_ms", p->queue_timeout_ms);
    dp_jw_arr_begin(w, "candidates");
    for (size_t i = 0; i < p->ncandidates; i++) {
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "pool", p->candidates[i].pool);
        dp_jw_double(w, "rate", p->candidates[i].rate);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    dp_jw_arr_begin(w, "passthrough");
    for (size_t i = 0; i < p->npassthrough; i++)
        dp_jw_str(w, NULL, p->passthrough[i].text);
    dp_jw_arr_end(w);
    dp_jw_arr_begin(w, "replicas");
    for (size_t i = 0; i < p->nreplicas; i++) {
        const cfg_replica_t *r = &p->replicas[i];
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "name", r->name);
        url(w, "url", &r->url);
        dp_jw_str(w, "server_name", r->server_name);
        dp_jw_obj_begin(w, "attest");
        dp_jw_str(w, "source", cfg_attest_source_names[r->attest.source]);
        if (r->attest.source == CFG_ATTEST_AGENT)
            url(w, "url", &r->attest.url);
        dp_jw_obj_end(w);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    if (p->discovery) {
        const cfg_discovery_t *d = p->discovery;
        dp_jw_obj_begin(w, "discovery");
        dp_jw_str(w, "dns", d->dns);
        dp_jw_uint(w, "port", d->port);
        dp_jw_uint(w, "refresh_ms", d->refresh_ms);
        dp_jw_obj_begin(w, "attest");
        dp_jw_str(w, "source", cfg_attest_source_names[d->attest_source]);
        if (d->attest_source == CFG_ATTEST_AGENT)
            dp_jw_uint(w, "port", d->attest_port);
        dp_jw_obj_end(w);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "discovery");
    }
    if (p->upstream_tls) {
        dp_jw_obj_begin(w, "upstream_tls");
        dp_jw_str(w, "ca_file", p->upstream_tls->ca_file);
        dp_jw_str(w, "client_cert_file", p->upstream_tls->client_cert_file);
        dp_jw_str(w, "client_key_file", p->upstream_tls->client_key_file);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "upstream_tls");
    }
    dp_jw_str(w, "api_key_file", p->api_key_file);
    secret(w, "api_key", p->api_key);
    dp_jw_obj_begin(w, "attestation");
    dp_jw_bool(w, "require_signature", cfg_pool_require_signature(cfg, p));
    dp_jw_obj_end(w);
    dp_jw_obj_end(w);
}

static void rule(dp_jw_t *w, const char *name, const cfg_rule_t *r)
{
    if (!r->has_force && !r->has_default && !r->has_min && !r->has_max && !r->derive)
        return;
    dp_jw_obj_begin(w, name);
    if (r->has_force)
        dp_jw_double(w, "force", r->force);
    if (r->has_default)
        dp_jw_double(w, "default", r->def);
    if (r->has_min)
        dp_jw_double(w, "min", r->min);
    if (r->has_max)
        dp_jw_double(w, "max", r->max);
    if (r->derive)
        dp_jw_bool(w, "derive", true);
    dp_jw_obj_end(w);
}

static void tenant(dp_jw_t *w, const cfg_tenant_t *t)
{
    dp_jw_obj_begin(w, NULL);
    dp_jw_str(w, "name", t->name);
    dp_jw_obj_begin(w, "match");
    switch (t->match_kind) {
    case CFG_MATCH_API_KEYS:
        dp_jw_arr_begin(w, "api_keys_sha256");
        for (size_t i = 0; i < t->napi_keys; i++) {
            char hex[65], shown[32];
            dp_hex(t->api_keys[i], 32, hex);
            snprintf(shown, sizeof(shown), "%.8s...%s", hex, REDACTED);
            dp_jw_str(w, NULL, shown);
        }
        dp_jw_arr_end(w);
        break;
    case CFG_MATCH_HEADER:
        dp_jw_obj_begin(w, "header");
        dp_jw_str(w, "name", t->header_name);
        dp_jw_str(w, "value", REDACTED);
        dp_jw_obj_end(w);
        break;
    case CFG_MATCH_ANY:
        dp_jw_bool(w, "any", true);
        dp_jw_bool(w, "unknown_keys", t->any_unknown_keys);
        break;
    }
    dp_jw_obj_end(w);
    dp_jw_str(w, "pool", t->pool);
    dp_jw_obj_begin(w, "sampling");
    for (int i = 0; i < CFG_PARAM__COUNT; i++)
        rule(w, cfg_param_names[i], &t->rules[i]);
    dp_jw_obj_end(w);
    strs(w, "deny_params", t->deny_params, t->ndeny_params);
    if (t->allow_params)
        strs(w, "allow_params", t->allow_params, t->nallow_params);
    else
        dp_jw_null(w, "allow_params"); /* any top-level key */
    dp_jw_bool(w, "audit", t->audit);
    dp_jw_str(w, "require_determinism",
              t->require_determinism ? cfg_determinism_names[t->require_determinism] : NULL);
    if (t->shadow_rate >= 0)
        dp_jw_double(w, "shadow_rate", t->shadow_rate);
    else
        dp_jw_null(w, "shadow_rate");
    if (t->rate_rps > 0) {
        dp_jw_obj_begin(w, "rate_limit");
        dp_jw_double(w, "requests_per_second", t->rate_rps);
        dp_jw_uint(w, "burst", t->rate_burst);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "rate_limit");
    }
    dp_jw_obj_end(w);
}

void cfg_dump_json(const cfg_t *cfg, dp_buf_t *out)
{
    static const char *const levels[] = {"debug", "info", "warn", "error"};
    dp_jw_t jw, *w = &jw;
    dp_jw_init(w, out);
    dp_jw_obj_begin(w, NULL);
    dp_jw_str(w, "config_path", cfg->path);
    addr(w, "listen", &cfg->listen);
    addr(w, "admin_listen", &cfg->admin_listen);
    dp_jw_uint(w, "workers", cfg->workers);
    dp_jw_obj_begin(w, "limits");
    cfg_limits_dump(&cfg->limits, w);
    dp_jw_obj_end(w);
    const cfg_attestation_t *a = &cfg->attestation;
    dp_jw_obj_begin(w, "attestation");
    dp_jw_uint(w, "interval_ms", a->interval_ms);
    dp_jw_uint(w, "timeout_ms", a->timeout_ms);
    dp_jw_bool(w, "require_signature", a->require_signature);
    strs(w, "trusted_keys", a->trusted_keys, a->ntrusted_keys);
    dp_jw_obj_end(w);
    dp_jw_arr_begin(w, "pools");
    for (size_t i = 0; i < cfg->npools; i++)
        pool(w, cfg, &cfg->pools[i]);
    dp_jw_arr_end(w);
    dp_jw_obj_begin(w, "policy");
    dp_jw_arr_begin(w, "tenants");
    for (size_t i = 0; i < cfg->policy->ntenants; i++)
        tenant(w, &cfg->policy->tenants[i]);
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
    dp_jw_obj_begin(w, "shadow");
    dp_jw_double(w, "rate", cfg->shadow.rate);
    dp_jw_double(w, "self_rate", cfg->shadow.self_rate);
    dp_jw_uint(w, "max_inflight", cfg->shadow.max_inflight);
    dp_jw_uint(w, "max_output_bytes", cfg->shadow.max_output_bytes);
    dp_jw_bool(w, "quarantine", cfg->shadow.quarantine);
    dp_jw_obj_end(w);
    dp_jw_obj_begin(w, "log");
    dp_jw_str(w, "level", levels[cfg->log.level]);
    dp_jw_str(w, "audit_path", cfg->log.audit_path);
    dp_jw_str(w, "audit_store", cfg->log.audit_store);
    dp_jw_str(w, "audit_signing_key", cfg->log.audit_signing_key);
    dp_jw_uint(w, "audit_checkpoint_lines", cfg->log.audit_checkpoint_lines);
    dp_jw_str(w, "audit_fail", cfg_audit_fail_names[cfg->log.audit_fail_open]);
    dp_jw_obj_begin(w, "access");
    dp_jw_bool(w, "enabled", cfg->log.access.enabled);
    dp_jw_double(w, "sample_rate", cfg->log.access.sample_rate);
    dp_jw_arr_begin(w, "fields");
    for (int i = 0; i < CFG_ACCESS__COUNT; i++)
        if (cfg->log.access.fields & (1u << i))
            dp_jw_str(w, NULL, cfg_access_field_names[i]);
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
    dp_jw_obj_end(w);
    if (cfg->otel) {
        dp_jw_obj_begin(w, "otel");
        url(w, "endpoint", &cfg->otel->endpoint);
        dp_jw_double(w, "sample_rate", cfg->otel->sample_rate);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "otel");
    }
    if (cfg->tls) {
        dp_jw_obj_begin(w, "tls");
        dp_jw_str(w, "cert_file", cfg->tls->cert_file);
        dp_jw_str(w, "key_file", cfg->tls->key_file);
        dp_jw_str(w, "client_ca_file", cfg->tls->client_ca_file);
        dp_jw_obj_end(w);
    } else {
        dp_jw_null(w, "tls");
    }
    cfg_fleet_dump(cfg->fleet, w);
    dp_jw_str(w, "admin_token_file", cfg->admin_token_file);
    secret(w, "admin_token", cfg->admin_token);
    dp_jw_obj_end(w);
}
