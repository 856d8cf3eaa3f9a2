/* Pools: their replicas (listed or discovered), how each replica is attested, the manifest they
 * must match, the TLS and credentials used to reach them, and the look-ups over the parsed pools
 * (by name, by model, by determinism mode) that the router and the cross-section checks make. */
#include "config/cfg_internal.h"

#include <assert.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

const char *const cfg_attest_source_names[] = {"none", "agent",  "vllm",
                                               "tgi",  "sglang", "llamacpp"};
_Static_assert(DP_ARRAY_SIZE(cfg_attest_source_names) == CFG_ATTEST_LLAMACPP + 1,
               "one name per cfg_attest_source_t, which indexes the table");

/* The sources a config may name: every one but "none". */
#define SOURCE_NAMES (&cfg_attest_source_names[CFG_ATTEST_AGENT])
#define NSOURCES ((size_t)(CFG_ATTEST_LLAMACPP - CFG_ATTEST_AGENT + 1))

#define COUNT_MAX 1000000u
#define AGENT_DEFAULT_PATH "/attestation"

static const char *const pool_keys[] = {
    "name",        "models",           "manifest",
    "balance",     "affinity",         "max_inflight_per_replica",
    "queue_limit", "queue_timeout_ms", "replicas",
    "discovery",   "upstream_tls",     "api_key_file",
    "candidates",  "passthrough",      "attestation",
    NULL};
static const char *const pool_attestation_keys[] = {"require_signature", NULL};
static const char *const replica_keys[] = {"name", "url", "server_name", "attest", NULL};
static const char *const attest_keys[] = {"source", "url", NULL};
static const char *const discovery_keys[] = {"dns",    "port",         "refresh_ms",
                                             "attest", "max_replicas", NULL};
static const char *const discovery_attest_keys[] = {"source", "port", NULL};
static const char *const upstream_tls_keys[] = {"ca_file", "client_cert_file", "client_key_file",
                                                NULL};
static const char *const balance_names[] = {"least_inflight", "round_robin", "affinity"};
static const char *const affinity_keys[] = {"key", "prefix_bytes", "session_header", "load_factor",
                                            NULL};
const char *const cfg_affinity_key_names[3] = {"prefix", "session", "seed"};
static const char *const candidate_keys[] = {"pool", "rate", NULL};

/* ---- look-ups -------------------------------------------------------------------------- */

const cfg_pool_t *cfg_pool_by_name(const cfg_t *cfg, const char *name)
{
    for (size_t i = 0; i < cfg->npools; i++)
        if (cfg->pools[i].name != NULL && strcmp(cfg->pools[i].name, name) == 0)
            return &cfg->pools[i];
    return NULL;
}

cfg_determinism_t cfg_pool_determinism(const cfg_pool_t *p)
{
    return p->manifest ? p->manifest->determinism : CFG_DETERMINISM_NONE;
}

const cfg_pool_t *cfg_pool_for_model(const cfg_t *cfg, const char *model, size_t len)
{
    return cfg_pool_for_model_mode(cfg, model, len, CFG_DETERMINISM_NONE);
}

static int str_order(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void index_models(cfg_pool_t *p)
{
    p->models_sorted = dp_xcalloc(p->nmodels + 1, sizeof(*p->models_sorted));
    for (size_t j = 0; j < p->nmodels; j++) {
        if (strcmp(p->models[j], "*") == 0)
            p->any_model = true;
        else
            p->models_sorted[p->nmodels_sorted++] = p->models[j];
    }
    qsort(p->models_sorted, p->nmodels_sorted, sizeof(*p->models_sorted), str_order);
}

/* Does p take requests for model (len bytes, not NUL-terminated)? A binary search in byte
 * order, as strcmp sorted it. */
static bool pool_lists(const cfg_pool_t *p, const char *model, size_t len)
{
    if (p->any_model)
        return true;
    size_t lo = 0, hi = p->nmodels_sorted;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2, n = strlen(p->models_sorted[mid]);
        int c = len && n ? memcmp(model, p->models_sorted[mid], len < n ? len : n) : 0;
        if (c == 0)
            c = (len > n) - (len < n);
        if (c == 0)
            return true;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return false;
}

/* O(pools x log models), once per request. */
const cfg_pool_t *cfg_pool_for_model_mode(const cfg_t *cfg, const char *model, size_t len,
                                          cfg_determinism_t mode)
{
    for (size_t i = 0; i < cfg->npools; i++) {
        const cfg_pool_t *p = &cfg->pools[i];
        if (p->is_candidate)
            continue; /* a rollout under evaluation gets candidate copies, not clients */
        if (mode != CFG_DETERMINISM_NONE && cfg_pool_determinism(p) != mode)
            continue;
        if (pool_lists(p, model, len))
            return p;
    }
    return NULL;
}

/* ---- attestation source ---------------------------------------------------------------- */

/* Only SGLang's server info, llama.cpp's /props and the agent can attest batch_invariant
 * (docs/attestation.md §10). */
static void warn_determinism_source(cfg_ctx_t *c, const cfg_manifest_t *m, cfg_attest_source_t s,
                                    const char *key)
{
    if ((s != CFG_ATTEST_VLLM && s != CFG_ATTEST_TGI) || m == NULL ||
        m->determinism != CFG_DETERMINISM_BATCH_INVARIANT)
        return;
    cfg_warn(c, key,
             "the %s adapter cannot attest determinism.mode \"batch_invariant\": this replica "
             "can never be admitted%s",
             cfg_attest_source_names[s],
             s == CFG_ATTEST_VLLM ? " (run the agent with --determinism batch_invariant beside it)"
                                  : "");
}

/* No source configured: the native adapter the manifest's framework.name names; else none,
 * which is only sound when the pool pins nothing (nothing to attest). */
static cfg_attest_source_t default_source(cfg_ctx_t *c, const cfg_manifest_t *m, const char *key)
{
    for (int s = CFG_ATTEST_VLLM; m != NULL && m->framework_name && s <= CFG_ATTEST_LLAMACPP; s++)
        if (strcmp(m->framework_name, cfg_attest_source_names[s]) == 0) {
            warn_determinism_source(c, m, (cfg_attest_source_t)s, key);
            return (cfg_attest_source_t)s;
        }
    if (cfg_manifest_pins(m))
        cfg_err(c, key,
                "required: the pool's manifest pins fields and its framework.name names no "
                "native adapter (vllm, tgi, sglang, llamacpp), so set attest.source");
    return CFG_ATTEST_NONE;
}

static bool get_source(cfg_ctx_t *c, const cJSON *obj, const cfg_manifest_t *m,
                       cfg_attest_source_t *out)
{
    int i;
    if (cfg_get(obj, "source") == NULL) {
        cfg_err(c, "source", "required");
        return false;
    }
    if (!cfg_get_enum(c, obj, "source", SOURCE_NAMES, NSOURCES, &i))
        return false;
    *out = (cfg_attest_source_t)(i + CFG_ATTEST_AGENT);
    /* A native adapter reports its own framework name, so another pinned name never matches. */
    if (*out >= CFG_ATTEST_VLLM && m != NULL && m->framework_name != NULL &&
        strcmp(m->framework_name, cfg_attest_source_names[*out]) != 0)
        cfg_warn(c, "source",
                 "the manifest pins framework.name \"%s\", which the %s adapter does not report: "
                 "this replica can never be admitted",
                 m->framework_name, cfg_attest_source_names[*out]);
    warn_determinism_source(c, m, *out, "source");
    return true;
}

static void parse_replica_attest(cfg_ctx_t *c, const cJSON *node, const cfg_manifest_t *m,
                                 cfg_attest_t *a)
{
    if (cfg_get(node, "attest") == NULL) {
        a->source = default_source(c, m, "attest");
        return;
    }
    const cJSON *o = cfg_get_obj(c, node, "attest", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "attest");
    cfg_check_keys(c, o, attest_keys);
    if (get_source(c, o, m, &a->source)) {
        if (a->source != CFG_ATTEST_AGENT) {
            if (cfg_get(o, "url") != NULL)
                cfg_err(c, "url", "only used with source agent");
        } else if (cfg_get_url(c, o, "url", true, &a->url) && a->url.path[0] == '\0') {
            free(a->url.path);
            a->url.path = dp_xstrdup(AGENT_DEFAULT_PATH);
        }
    }
    cfg_path_pop(c, mark);
}

/* ---- replicas -------------------------------------------------------------------------- */

static void parse_replica(cfg_ctx_t *c, const cJSON *node, const cfg_manifest_t *m,
                          cfg_replica_t *r)
{
    if (!cJSON_IsObject(node)) {
        cfg_err(c, NULL, "expected an object");
        return;
    }
    cfg_check_keys(c, node, replica_keys);
    if (cfg_get_str(c, node, "name", true, &r->name) && !cfg_valid_name(r->name))
        cfg_err(c, "name", CFG_NAME_RULE, CFG_NAME_MAX);
    bool have_url = cfg_get_url(c, node, "url", true, &r->url);
    if (cfg_get_str(c, node, "server_name", false, &r->server_name)) {
        if (!cfg_valid_hostname(r->server_name))
            cfg_err(c, "server_name", "must be a DNS name");
        else if (have_url && !r->url.tls)
            cfg_warn(c, "server_name", "ignored: only https:// URLs verify a server name");
    }
    parse_replica_attest(c, node, m, &r->attest);
}

/* Do a and b name one engine (cfg_url_engine)? */
/* Each replica's engine (cfg_url_engine), written once: the checks below compare every pair,
 * and a pool may list thousands. NULL for a replica without a URL. */
static char **engines_of(const cfg_pool_t *p)
{
    char **e = dp_xcalloc(p->nreplicas + 1, sizeof(*e));
    for (size_t i = 0; i < p->nreplicas; i++) {
        if (p->replicas[i].url.hostport == NULL)
            continue;
        dp_buf_t b = {0};
        cfg_url_engine(&p->replicas[i].url, &b);
        e[i] = dp_buf_steal(&b);
    }
    return e;
}

static void engines_free(char **e, size_t n)
{
    for (size_t i = 0; e && i < n; i++)
        free(e[i]);
    free(e);
}

/* Names are unique within a pool; two entries for one endpoint would make cross-replica
 * comparisons compare a replica with itself. */
static void check_replicas(cfg_ctx_t *c, const cfg_pool_t *p)
{
    char **eng = engines_of(p);
    cfg_seen_t names = {0}, engines = {0};
    for (size_t i = 0; i < p->nreplicas; i++) {
        const cfg_replica_t *r = &p->replicas[i];
        size_t mark = cfg_path_index(c, i);
        size_t j = r->name ? cfg_seen_add(&names, r->name, i) : CFG_UNSEEN;
        if (j != CFG_UNSEEN)
            cfg_err(c, "name", "duplicate replica name (also replicas[%zu])", j);
        j = eng[i] ? cfg_seen_add(&engines, eng[i], i) : CFG_UNSEEN;
        if (j != CFG_UNSEEN)
            cfg_warn(c, "url", "same engine as replicas[%zu]", j);
        cfg_path_pop(c, mark);
    }
    cfg_seen_free(&names);
    cfg_seen_free(&engines);
    engines_free(eng, p->nreplicas);
}

static void parse_replicas(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    const cJSON *arr = cfg_get_arr(c, node, "replicas", false);
    if (arr == NULL)
        return;
    p->nreplicas = (size_t)cJSON_GetArraySize(arr);
    p->replicas = dp_xcalloc(p->nreplicas + 1, sizeof(*p->replicas));
    size_t mark = cfg_path_key(c, "replicas"), i = 0;
    for (const cJSON *it = arr->child; it != NULL; it = it->next, i++) {
        size_t m = cfg_path_index(c, i);
        parse_replica(c, it, p->manifest, &p->replicas[i]);
        cfg_path_pop(c, m);
    }
    check_replicas(c, p);
    cfg_path_pop(c, mark);
}

/* ---- discovery ------------------------------------------------------------------------- */

static void parse_discovery_attest(cfg_ctx_t *c, const cJSON *node, const cfg_manifest_t *m,
                                   cfg_discovery_t *d)
{
    if (cfg_get(node, "attest") == NULL) {
        d->attest_source = default_source(c, m, "attest");
        return;
    }
    const cJSON *o = cfg_get_obj(c, node, "attest", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "attest");
    cfg_check_keys(c, o, discovery_attest_keys);
    if (get_source(c, o, m, &d->attest_source)) {
        if (d->attest_source == CFG_ATTEST_AGENT) {
            if (cfg_get(o, "port") == NULL)
                cfg_err(c, "port", "required with source agent");
            uint32_t port = 0;
            if (cfg_get_u32(c, o, "port", 1, 65535, &port))
                d->attest_port = (uint16_t)port;
        } else if (cfg_get(o, "port") != NULL) {
            cfg_err(c, "port", "only used with source agent");
        }
    }
    cfg_path_pop(c, mark);
}

static void parse_discovery(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    const cJSON *o = cfg_get_obj(c, node, "discovery", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "discovery");
    cfg_discovery_t *d = dp_xcalloc(1, sizeof(*d));
    p->discovery = d;
    d->refresh_ms = 5000;
    d->max_replicas = 64;
    cfg_check_keys(c, o, discovery_keys);
    if (cfg_get_str(c, o, "dns", true, &d->dns) && !cfg_valid_hostname(d->dns))
        cfg_err(c, "dns", "must be a DNS name");
    uint32_t port = 0;
    if (cfg_get(o, "port") == NULL)
        cfg_err(c, "port", "required");
    else if (cfg_get_u32(c, o, "port", 1, 65535, &port))
        d->port = (uint16_t)port;
    cfg_get_u32(c, o, "refresh_ms", 100, CFG_MS_MAX, &d->refresh_ms);
    cfg_get_u32(c, o, "max_replicas", 1, 4096, &d->max_replicas);
    parse_discovery_attest(c, o, p->manifest, d);
    cfg_path_pop(c, mark);
}

/* ---- manifest, TLS, credentials -------------------------------------------------------- */

static void parse_manifest_ref(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    const cJSON *v = cfg_get(node, "manifest");
    if (v == NULL)
        return;
    size_t mark = cfg_path_key(c, "manifest");
    cfg_manifest_t *m = NULL;
    if (cJSON_IsString(v)) {
        cJSON *doc = cfg_read_referenced(c, v->valuestring);
        m = doc != NULL ? cfg_manifest_from_json(c, doc) : NULL;
        cJSON_Delete(doc);
        c->file = NULL;
    } else if (cJSON_IsObject(v)) {
        m = cfg_manifest_from_json(c, v);
    } else {
        cfg_err(c, NULL, "expected a file path or an object");
    }
    cfg_path_pop(c, mark);
    /* "{}" pins nothing: the pool then behaves as one without a manifest. */
    if (m != NULL && !cfg_manifest_pins(m) && m->canary == NULL &&
        m->determinism == CFG_DETERMINISM_NONE) {
        cfg_manifest_free(m);
        m = NULL;
    }
    p->manifest = m;
}

static void parse_upstream_tls(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    const cJSON *o = cfg_get_obj(c, node, "upstream_tls", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "upstream_tls");
    cfg_upstream_tls_t *u = dp_xcalloc(1, sizeof(*u));
    p->upstream_tls = u;
    cfg_check_keys(c, o, upstream_tls_keys);
    if (cfg_get_path(c, o, "ca_file", false, &u->ca_file))
        cfg_check_ca_file(c, "ca_file", u->ca_file, false);
    bool cert = cfg_get_path(c, o, "client_cert_file", false, &u->client_cert_file);
    bool key = cfg_get_path(c, o, "client_key_file", false, &u->client_key_file);
    if (cert && key)
        cfg_check_key_pair(c, "client_cert_file", u->client_cert_file, "client_key_file",
                           u->client_key_file);
    else if (cert && cfg_get(o, "client_key_file") == NULL)
        cfg_err(c, "client_key_file", "required with client_cert_file");
    else if (key && cfg_get(o, "client_cert_file") == NULL)
        cfg_err(c, "client_cert_file", "required with client_key_file");
    cfg_path_pop(c, mark);
}

/* ---- balance ----------------------------------------------------------------------------- */

/* `affinity` tunes `balance: affinity` and means nothing to the other balances, so it is an
 * error beside them rather than a silently ignored block. */
static void parse_affinity(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    const cJSON *o = cfg_get_obj(c, node, "affinity", false);
    if (p->balance != CFG_BALANCE_AFFINITY) {
        if (o != NULL)
            cfg_err(c, "affinity", "only with \"balance\": \"affinity\"");
        return;
    }
    cfg_affinity_t *a = &p->affinity;
    a->key = CFG_AFFINITY_PREFIX;
    a->prefix_bytes = 4096;
    a->load_factor = 1.25;
    a->session_header = dp_xstrdup("x-session-id");
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "affinity");
    cfg_check_keys(c, o, affinity_keys);
    int key;
    if (cfg_get_enum(c, o, "key", cfg_affinity_key_names, DP_ARRAY_SIZE(cfg_affinity_key_names),
                     &key))
        a->key = (cfg_affinity_key_t)key;
    cfg_get_u32(c, o, "prefix_bytes", 1, 16u << 20, &a->prefix_bytes);
    if (cfg_get_str(c, o, "session_header", false, &a->session_header)) {
        if (!cfg_valid_header_name(a->session_header))
            cfg_err(c, "session_header", "not a valid HTTP header name");
        cfg_lowercase(a->session_header);
    }
    cfg_get_num(c, o, "load_factor", 1.0, 100.0, &a->load_factor);
    cfg_path_pop(c, mark);
}

/* ---- candidates (docs/configuration.md, "Candidates") ---------------------------------------- */

/* The entries as written; names are checked against the other pools once all are read
 * (check_candidates). */
static void parse_candidates(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    const cJSON *arr = cfg_get_arr(c, node, "candidates", false);
    if (arr == NULL)
        return;
    p->ncandidates = (size_t)cJSON_GetArraySize(arr);
    p->candidates = dp_xcalloc(p->ncandidates + 1, sizeof(*p->candidates));
    size_t mark = cfg_path_key(c, "candidates"), i = 0;
    for (const cJSON *it = arr->child; it != NULL; it = it->next, i++) {
        size_t m = cfg_path_index(c, i);
        cfg_candidate_t *k = &p->candidates[i];
        k->rate = -1;
        if (!cJSON_IsObject(it)) {
            cfg_err(c, NULL, "expected an object {\"pool\": NAME, \"rate\": 0..1}");
        } else {
            cfg_check_keys(c, it, candidate_keys);
            cfg_get_str(c, it, "pool", true, &k->pool);
            if (cfg_get(it, "rate") == NULL)
                cfg_err(c, "rate", "required (the fraction of comparable requests copied)");
            else
                cfg_get_num(c, it, "rate", 0.0, 1.0, &k->rate);
        }
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
}

/* Across pools, once all are read: every candidate names another pool, once. A candidate
 * pool gets no client traffic, so candidates of its own would never be sampled (and rollouts
 * would nest). Paths as written: pools[i].candidates[k].pool. */
static const char *candidate_problem(const cfg_t *cfg, const cfg_pool_t *p, size_t k, size_t *dup)
{
    const cfg_candidate_t *cand = &p->candidates[k];
    for (size_t j = 0; j < k; j++) {
        if (p->candidates[j].pool && strcmp(p->candidates[j].pool, cand->pool) == 0) {
            *dup = j;
            return "duplicate";
        }
    }
    const cfg_pool_t *t = cfg_pool_by_name(cfg, cand->pool);
    if (t == NULL)
        return "unknown";
    if (t == p)
        return "a pool cannot be its own candidate";
    return NULL;
}

static void check_candidates(cfg_ctx_t *c, cfg_t *cfg)
{
    size_t mark = cfg_path_key(c, "pools");
    for (size_t i = 0; i < cfg->npools; i++) {
        cfg_pool_t *p = &cfg->pools[i];
        size_t mi = cfg_path_index(c, i);
        cfg_path_key(c, "candidates");
        for (size_t k = 0; k < p->ncandidates; k++) {
            cfg_candidate_t *cand = &p->candidates[k];
            if (cand->pool == NULL)
                continue;
            size_t mk = cfg_path_index(c, k), dup = 0;
            const char *why = candidate_problem(cfg, p, k, &dup);
            if (why == NULL) {
                assert(cfg_pool_by_name(cfg, cand->pool) != NULL); /* candidate_problem found it */
                cand->index = (size_t)(cfg_pool_by_name(cfg, cand->pool) - cfg->pools);
                cfg->pools[cand->index].is_candidate = true;
            } else if (strcmp(why, "duplicate") == 0) {
                cfg_err(c, "pool", "duplicate candidate (also candidates[%zu])", dup);
            } else if (strcmp(why, "unknown") == 0) {
                cfg_err(c, "pool", "no pool is named \"%s\"", cand->pool);
            } else {
                cfg_err(c, "pool", "%s", why);
            }
            cfg_path_pop(c, mk);
        }
        cfg_path_pop(c, mi);
    }
    for (size_t i = 0; i < cfg->npools; i++) {
        const cfg_pool_t *p = &cfg->pools[i];
        size_t mi = cfg_path_index(c, i);
        if (p->is_candidate && p->ncandidates > 0)
            cfg_err(c, "candidates",
                    "pool %s is itself a candidate of another pool: a candidate gets no client "
                    "traffic, so its own candidates would never be sampled",
                    p->name);
        cfg_path_pop(c, mi);
    }
    cfg_path_pop(c, mark);
}

/* ---- passthrough (docs/configuration.md, "Pass-through routes") ------------------------------ */

static bool tchar(char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           strchr("!#$%&'*+-.^_`|~", ch) != NULL;
}

/* Why `path` (the part after an optional method) can never equal a normalised request path
 * (docs/requests.md §1), or NULL when it can. */
static const char *pattern_problem(const char *path, size_t n, bool prefix)
{
    if (n == 0 || path[0] != '/')
        return "the path must start with '/'";
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)path[i];
        if (ch <= 0x20 || ch >= 0x7f)
            return "spaces, control characters and non-ASCII bytes never reach a route";
        if (ch == '*')
            return "'*' is allowed only at the end (a prefix)";
        if (ch == '?' || ch == '#')
            return "the query and fragment are not part of the path compared";
        if (ch == '%')
            return "percent-escapes are decoded before the comparison: write the character";
        if (ch == '/' && i + 1 < n && path[i + 1] == '/')
            return "'//' is merged before the comparison";
    }
    /* Dot segments are resolved first; a prefix may end inside a segment ("/v1/fi*"). */
    for (size_t i = 0; i < n; i++) {
        if (path[i] != '/' || i + 1 >= n || path[i + 1] != '.')
            continue;
        size_t e = i + 2 < n && path[i + 2] == '.' ? i + 3 : i + 2;
        if ((e == n && !prefix) || (e < n && path[e] == '/'))
            return "'.' and '..' segments are resolved before the comparison";
    }
    return NULL;
}

static void parse_passthrough_entry(cfg_ctx_t *c, const cJSON *it, cfg_passthrough_t *e)
{
    if (!cJSON_IsString(it) || it->valuestring[0] == '\0') {
        cfg_err(c, NULL, "expected a string \"[METHOD ]/path\" or \"[METHOD ]/prefix*\"");
        return;
    }
    const char *s = it->valuestring;
    const char *sp = s[0] == '/' ? NULL : strchr(s, ' ');
    const char *path = sp ? sp + 1 : s;
    if (sp != NULL) {
        for (const char *m = s; m < sp; m++) {
            if (!tchar(*m)) {
                cfg_err(c, NULL, "\"%s\": the method must be an HTTP token (\"POST\")", s);
                return;
            }
        }
        if (sp == s) {
            cfg_err(c, NULL, "\"%s\": expected \"METHOD /path\" with one space", s);
            return;
        }
    }
    size_t n = strlen(path);
    bool prefix = n > 0 && path[n - 1] == '*';
    const char *why = pattern_problem(path, prefix ? n - 1 : n, prefix);
    if (why != NULL) {
        cfg_err(c, NULL, "\"%s\": %s", s, why);
        return;
    }
    if (sp != NULL && (sp - s == 3 && memcmp(s, "GET", 3) == 0)) {
        cfg_warn(c, NULL, "\"%s\": GET always passes through; the entry changes nothing", s);
    }
    e->text = dp_xstrdup(s);
    e->method = sp ? dp_xstrndup(s, (size_t)(sp - s)) : NULL;
    e->path = dp_xstrndup(path, prefix ? n - 1 : n);
    e->len = prefix ? n - 1 : n;
    e->prefix = prefix;
}

static void parse_passthrough(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    const cJSON *arr = cfg_get_arr(c, node, "passthrough", false);
    if (arr == NULL)
        return;
    p->npassthrough = (size_t)cJSON_GetArraySize(arr);
    p->passthrough = dp_xcalloc(p->npassthrough + 1, sizeof(*p->passthrough));
    size_t mark = cfg_path_key(c, "passthrough"), i = 0;
    cfg_seen_t seen = {0};
    for (const cJSON *it = arr->child; it != NULL; it = it->next, i++) {
        size_t m = cfg_path_index(c, i);
        parse_passthrough_entry(c, it, &p->passthrough[i]);
        size_t j =
            p->passthrough[i].text ? cfg_seen_add(&seen, p->passthrough[i].text, i) : CFG_UNSEEN;
        if (j != CFG_UNSEEN)
            cfg_err(c, NULL, "duplicate entry (also passthrough[%zu])", j);
        cfg_path_pop(c, m);
    }
    cfg_seen_free(&seen);
    cfg_path_pop(c, mark);
}

/* ---- pools ----------------------------------------------------------------------------- */

/* single_sequence (docs/configuration.md, "Deterministic pools") is enforced through the pool's own
 * admission: one request in flight per replica, whatever the pool says, so every path that takes a
 * replica slot obeys it. */
static void single_sequence_limit(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    if (cfg_pool_determinism(p) != CFG_DETERMINISM_SINGLE_SEQUENCE)
        return;
    if (cfg_get(node, "max_inflight_per_replica") != NULL && p->max_inflight_per_replica != 1)
        cfg_warn(c, "max_inflight_per_replica",
                 "%u is overridden: the manifest's determinism.mode \"single_sequence\" allows "
                 "one request in flight per replica (effective value 1)",
                 p->max_inflight_per_replica);
    p->max_inflight_per_replica = 1;
}

/* pools[].attestation: what differs from the top-level attestation for this pool (a candidate
 * pool attested natively beside a baseline whose agents sign: docs/rollouts.md). */
static void parse_pool_attestation(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    p->require_signature = -1;
    const cJSON *o = cfg_get_obj(c, node, "attestation", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "attestation");
    cfg_check_keys(c, o, pool_attestation_keys);
    bool req;
    if (cfg_get_bool(c, o, "require_signature", &req))
        p->require_signature = req;
    cfg_path_pop(c, mark);
}

static void parse_pool(cfg_ctx_t *c, const cJSON *node, cfg_pool_t *p)
{
    p->balance = CFG_BALANCE_LEAST_INFLIGHT;
    p->queue_limit = 1024;
    p->queue_timeout_ms = 30000;
    if (!cJSON_IsObject(node)) {
        cfg_err(c, NULL, "expected an object");
        return;
    }
    cfg_check_keys(c, node, pool_keys);
    if (cfg_get_str(c, node, "name", true, &p->name) && !cfg_valid_name(p->name))
        cfg_err(c, "name", CFG_NAME_RULE, CFG_NAME_MAX);
    if (cfg_get_str_array(c, node, "models", true, false, &p->models, &p->nmodels))
        index_models(p);
    parse_manifest_ref(c, node, p);
    int balance;
    if (cfg_get_enum(c, node, "balance", balance_names, DP_ARRAY_SIZE(balance_names), &balance))
        p->balance = (cfg_balance_t)balance;
    parse_affinity(c, node, p);
    cfg_get_u32(c, node, "max_inflight_per_replica", 0, COUNT_MAX, &p->max_inflight_per_replica);
    single_sequence_limit(c, node, p);
    cfg_get_u32(c, node, "queue_limit", 0, COUNT_MAX, &p->queue_limit);
    cfg_get_u32(c, node, "queue_timeout_ms", 1, CFG_MS_MAX, &p->queue_timeout_ms);
    parse_upstream_tls(c, node, p);
    if (cfg_get_path(c, node, "api_key_file", false, &p->api_key_file))
        p->api_key = cfg_read_secret(c, "api_key_file", p->api_key_file);
    parse_replicas(c, node, p);
    parse_discovery(c, node, p);
    parse_candidates(c, node, p);
    parse_pool_attestation(c, node, p);
    parse_passthrough(c, node, p);
    const cJSON *reps = cfg_get(node, "replicas");
    bool no_replicas = reps == NULL || (cJSON_IsArray(reps) && cJSON_GetArraySize(reps) == 0);
    if (no_replicas && cfg_get(node, "discovery") == NULL)
        cfg_err(c, NULL, "needs replicas or discovery");
}

/* An engine of a single_sequence pool that a pool of another mode sends to as well: that pool's
 * requests would run beside the one sequence (docs/configuration.md, "Deterministic pools").
 * Two single_sequence pools may share an engine: they share its one slot. */
static void check_shared_engines(cfg_ctx_t *c, const cfg_t *cfg)
{
    char ***eng = dp_xcalloc(cfg->npools + 1, sizeof(*eng));
    size_t total = 0;
    for (size_t i = 0; i < cfg->npools; i++) {
        eng[i] = engines_of(&cfg->pools[i]);
        total += cfg->pools[i].nreplicas;
    }
    /* Each engine's first replica in a pool of each kind (seen[1]: single_sequence), as an
     * index into where[] (pool, replica). */
    cfg_seen_t seen[2] = {{0}, {0}};
    size_t(*where)[2] = dp_xcalloc(total + 1, sizeof(*where)), nwhere = 0;
    size_t mark = cfg_path_key(c, "pools");
    for (size_t i = 0; i < cfg->npools; i++) {
        const cfg_pool_t *p = &cfg->pools[i];
        bool one = cfg_pool_determinism(p) == CFG_DETERMINISM_SINGLE_SEQUENCE;
        size_t m = cfg_path_index(c, i), r = cfg_path_key(c, "replicas");
        for (size_t k = 0; k < p->nreplicas; k++) {
            if (eng[i][k] == NULL)
                continue;
            size_t f = cfg_seen_find(&seen[!one], eng[i][k]);
            if (f != CFG_UNSEEN) {
                const cfg_pool_t *o = &cfg->pools[where[f][0]];
                size_t rk = cfg_path_index(c, k);
                cfg_err(c, "url",
                        "same engine as pools[%zu].replicas[%zu]: pool \"%s\" is "
                        "single_sequence (one request at a time per engine) and pool "
                        "\"%s\" is not, so its requests would run beside that one",
                        where[f][0], where[f][1], one ? p->name : o->name, one ? o->name : p->name);
                cfg_path_pop(c, rk);
            }
            where[nwhere][0] = i;
            where[nwhere][1] = k;
            if (cfg_seen_add(&seen[one], eng[i][k], nwhere) == CFG_UNSEEN)
                nwhere++;
        }
        cfg_path_pop(c, r);
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
    cfg_seen_free(&seen[0]);
    cfg_seen_free(&seen[1]);
    free(where);
    for (size_t i = 0; i < cfg->npools; i++)
        engines_free(eng[i], cfg->pools[i].nreplicas);
    free(eng);
}

/* A fleet's members take turns on a single_sequence engine through etcd (docs/fleet.md, "One
 * sequence per engine across the fleet"): they must name it by the same URL, and nothing starts
 * on it while etcd is out of reach. */
static void warn_fleet_single_sequence(cfg_ctx_t *c, const cfg_t *cfg)
{
    if (cfg->fleet == NULL)
        return;
    size_t mark = cfg_path_key(c, "pools");
    for (size_t i = 0; i < cfg->npools; i++) {
        if (cfg_pool_determinism(&cfg->pools[i]) != CFG_DETERMINISM_SINGLE_SEQUENCE)
            continue;
        size_t m = cfg_path_index(c, i), d = cfg_path_key(c, "manifest");
        size_t dd = cfg_path_key(c, "determinism");
        cfg_warn(c, "mode",
                 "single_sequence in a fleet: members take turns on each engine through etcd, so "
                 "every member must name it by the same URL, and no member starts a request on "
                 "it while etcd is out of reach (batch_invariant, which the engine keeps, needs "
                 "neither)");
        cfg_path_pop(c, dd);
        cfg_path_pop(c, d);
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
}

void cfg_parse_pools(cfg_ctx_t *c, const cJSON *doc, cfg_t *cfg)
{
    const cJSON *arr = cfg_get_arr(c, doc, "pools", true);
    if (arr == NULL)
        return;
    if (cJSON_GetArraySize(arr) == 0) {
        cfg_err(c, "pools", "must list at least one pool");
        return;
    }
    cfg->npools = (size_t)cJSON_GetArraySize(arr);
    cfg->pools = dp_xcalloc(cfg->npools, sizeof(*cfg->pools));
    size_t mark = cfg_path_key(c, "pools"), i = 0;
    cfg_seen_t seen = {0};
    for (const cJSON *it = arr->child; it != NULL; it = it->next, i++) {
        size_t m = cfg_path_index(c, i);
        parse_pool(c, it, &cfg->pools[i]);
        size_t j = cfg->pools[i].name ? cfg_seen_add(&seen, cfg->pools[i].name, i) : CFG_UNSEEN;
        if (j != CFG_UNSEEN)
            cfg_err(c, "name", "duplicate pool name (also pools[%zu])", j);
        cfg_path_pop(c, m);
    }
    cfg_seen_free(&seen);
    cfg_path_pop(c, mark);
    check_candidates(c, cfg);
    check_shared_engines(c, cfg);
    warn_fleet_single_sequence(c, cfg);
}

void cfg_pool_free(cfg_pool_t *p)
{
    free(p->name);
    cfg_str_array_free(p->models, p->nmodels);
    free(p->models_sorted);
    cfg_manifest_free(p->manifest);
    for (size_t i = 0; i < p->nreplicas; i++) {
        cfg_replica_t *r = &p->replicas[i];
        free(r->name);
        cfg_url_free(&r->url);
        free(r->server_name);
        cfg_url_free(&r->attest.url);
    }
    free(p->replicas);
    if (p->discovery != NULL)
        free(p->discovery->dns);
    free(p->discovery);
    if (p->upstream_tls != NULL) {
        free(p->upstream_tls->ca_file);
        free(p->upstream_tls->client_cert_file);
        free(p->upstream_tls->client_key_file);
    }
    free(p->upstream_tls);
    free(p->api_key_file);
    cfg_secret_free(p->api_key);
    free(p->affinity.session_header);
    for (size_t i = 0; i < p->ncandidates; i++)
        free(p->candidates[i].pool);
    free(p->candidates);
    for (size_t i = 0; i < p->npassthrough; i++) {
        free(p->passthrough[i].text);
        free(p->passthrough[i].method);
        free(p->passthrough[i].path);
    }
    free(p->passthrough);
    *p = (cfg_pool_t){0};
}
