/* Policies (docs/configuration.md, "Policy"; docs/policy.md): tenants, how a request is matched to
 * one, and its sampling rules. Validation guarantees what cfg_rule_t promises, so policy/ can apply
 * rules without checks. */
#include "config/cfg_internal.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* clang-format off */
const char *const cfg_param_names[CFG_PARAM__COUNT] = {
    "temperature", "top_p", "top_k", "seed", "max_tokens", "n",
    "presence_penalty", "frequency_penalty"};
/* clang-format on */

/* 2^53 - 1: JSON numbers reach us as doubles, and above this not every integer is one. */
#define MAX_SAFE_INT 9007199254740991.0
#define INT32_TOP 2147483647.0

/* The values a parameter accepts: [lo, hi], or (lo, hi] when lo_open. */
typedef struct {
    bool integral;
    bool lo_open;
    double lo, hi;
} param_range_t;

static const param_range_t param_ranges[CFG_PARAM__COUNT] = {
    [CFG_PARAM_TEMPERATURE] = {false, false, 0, INFINITY},
    [CFG_PARAM_TOP_P] = {false, true, 0, 1},
    [CFG_PARAM_TOP_K] = {true, false, -1, INT32_TOP},
    [CFG_PARAM_SEED] = {true, false, 0, MAX_SAFE_INT},
    [CFG_PARAM_MAX_TOKENS] = {true, false, 1, INT32_TOP},
    [CFG_PARAM_N] = {true, false, 1, INT32_TOP},
    [CFG_PARAM_PRESENCE_PENALTY] = {false, false, -2, 2},
    [CFG_PARAM_FREQUENCY_PENALTY] = {false, false, -2, 2},
};

static const char *const policy_keys[] = {"tenants", NULL};
static const char *const tenant_keys[] = {"name",        "match",
                                          "pool",        "sampling",
                                          "deny_params", "allow_params",
                                          "audit",       "shadow_rate",
                                          "rate_limit",  "require_determinism",
                                          NULL};
static const char *const rate_limit_keys[] = {"requests_per_second", "burst", NULL};
static const char *const match_keys[] = {"api_keys_sha256", "header", "any", "unknown_keys", NULL};
static const char *const header_keys[] = {"name", "value", NULL};
static const char *const rule_keys[] = {"force", "default", "min", "max", "derive", NULL};

/* ---- sampling rules -------------------------------------------------------------------- */

static void range_text(const param_range_t *r, char *out, size_t n)
{
    char lo[32], hi[32];
    cfg_fmt_num(lo, sizeof(lo), r->lo);
    cfg_fmt_num(hi, sizeof(hi), r->hi);
    if (isinf(r->hi))
        snprintf(out, n, "must be at least %s", lo);
    else if (r->lo_open)
        snprintf(out, n, "must be greater than %s and at most %s", lo, hi);
    else
        snprintf(out, n, "must be between %s and %s", lo, hi);
}

/* One of force/default/min/max: a number in the parameter's range. */
static bool get_param_value(cfg_ctx_t *c, const cJSON *rule, const char *key, cfg_param_t p,
                            double *out)
{
    const cJSON *v = cfg_get(rule, key);
    if (v == NULL)
        return false;
    const param_range_t *r = &param_ranges[p];
    double d = v->valuedouble;
    if (!cJSON_IsNumber(v) || !isfinite(d)) {
        cfg_err(c, key, "expected a number");
        return false;
    }
    if (r->integral && d != floor(d)) {
        cfg_err(c, key, "must be an integer");
        return false;
    }
    if (d < r->lo || (r->lo_open && d == r->lo) || d > r->hi) {
        char why[128];
        range_text(r, why, sizeof(why));
        cfg_err(c, key, "%s%s", why,
                p == CFG_PARAM_SEED ? " (2^53-1: larger JSON numbers lose precision)" : "");
        return false;
    }
    *out = d;
    return true;
}

static void get_derive(cfg_ctx_t *c, const cJSON *rule, cfg_param_t p, cfg_rule_t *r)
{
    if (cfg_get(rule, "derive") == NULL)
        return;
    if (p != CFG_PARAM_SEED) {
        cfg_err(c, "derive", "only seed can be derived");
        return;
    }
    bool v = false;
    if (!cfg_get_bool(c, rule, "derive", &v))
        return;
    if (!v)
        cfg_err(c, "derive", "must be true (omit it to not derive)");
    r->derive = v;
}

/* Rules that hold together: force alone; min <= max; default within them; derive without a
 * default (both would fill in an absent seed). */
static void check_rule(cfg_ctx_t *c, cfg_rule_t *r)
{
    char a[32], b[32];
    if (r->has_force && (r->has_default || r->has_min || r->has_max || r->derive)) {
        cfg_err(c, NULL, "force cannot be combined with default, min, max or derive");
        return;
    }
    if (r->derive && r->has_default)
        cfg_err(c, NULL, "derive and default cannot be combined");
    if (r->has_min && r->has_max && r->min > r->max) {
        cfg_fmt_num(a, sizeof(a), r->min);
        cfg_fmt_num(b, sizeof(b), r->max);
        cfg_err(c, NULL, "min (%s) is greater than max (%s)", a, b);
        return;
    }
    if (r->has_default && ((r->has_min && r->def < r->min) || (r->has_max && r->def > r->max)))
        cfg_err(c, "default", "must be within min and max");
}

static void parse_rule(cfg_ctx_t *c, const cJSON *node, cfg_param_t p, cfg_rule_t *r)
{
    if (!cJSON_IsObject(node)) {
        cfg_err(c, NULL, "expected an object such as {\"force\": 0} or {\"max\": 1}");
        return;
    }
    size_t before = c->nerrors;
    cfg_check_keys(c, node, rule_keys);
    r->has_force = get_param_value(c, node, "force", p, &r->force);
    r->has_default = get_param_value(c, node, "default", p, &r->def);
    r->has_min = get_param_value(c, node, "min", p, &r->min);
    r->has_max = get_param_value(c, node, "max", p, &r->max);
    get_derive(c, node, p, r);
    if (c->nerrors == before)
        check_rule(c, r);
}

static void parse_sampling(cfg_ctx_t *c, const cJSON *tenant, cfg_tenant_t *t)
{
    const cJSON *s = cfg_get_obj(c, tenant, "sampling", false);
    if (s == NULL)
        return;
    const char *keys[CFG_PARAM__COUNT + 1];
    memcpy(keys, cfg_param_names, sizeof(cfg_param_names));
    keys[CFG_PARAM__COUNT] = NULL;
    size_t mark = cfg_path_key(c, "sampling");
    cfg_check_keys(c, s, keys);
    for (int p = 0; p < CFG_PARAM__COUNT; p++) {
        const cJSON *node = cfg_get(s, cfg_param_names[p]);
        if (node == NULL)
            continue;
        size_t m = cfg_path_key(c, cfg_param_names[p]);
        parse_rule(c, node, (cfg_param_t)p, &t->rules[p]);
        cfg_path_pop(c, m);
    }
    cfg_path_pop(c, mark);
}

/* ---- match ----------------------------------------------------------------------------- */

/* Key digests: 64 hex digits in either case. The value is never echoed: an operator who pasted
 * the token itself instead of its hash must not find it in a log. */
static void parse_api_keys(cfg_ctx_t *c, const cJSON *match, cfg_tenant_t *t)
{
    const cJSON *arr = cfg_get_arr(c, match, "api_keys_sha256", true);
    if (arr == NULL)
        return;
    size_t n = (size_t)cJSON_GetArraySize(arr), i = 0;
    if (n == 0) {
        cfg_err(c, "api_keys_sha256", "must not be empty");
        return;
    }
    t->api_keys = dp_xcalloc(n, sizeof(*t->api_keys));
    t->napi_keys = n;
    size_t mark = cfg_path_key(c, "api_keys_sha256");
    for (const cJSON *it = arr->child; it != NULL; it = it->next, i++) {
        const char *s = cJSON_GetStringValue(it);
        if (s == NULL || dp_unhex(s, strlen(s), t->api_keys[i], 32) != 0) {
            size_t m = cfg_path_index(c, i);
            cfg_err(c, NULL,
                    "expected the SHA-256 of a bearer token as 64 hex digits "
                    "(not the token itself)");
            cfg_path_pop(c, m);
        }
    }
    cfg_path_pop(c, mark);
}

static void parse_header_match(cfg_ctx_t *c, const cJSON *match, cfg_tenant_t *t)
{
    const cJSON *h = cfg_get_obj(c, match, "header", true);
    if (h == NULL)
        return;
    size_t mark = cfg_path_key(c, "header");
    cfg_check_keys(c, h, header_keys);
    if (cfg_get_str(c, h, "name", true, &t->header_name)) {
        if (!cfg_valid_header_name(t->header_name))
            cfg_err(c, "name", "not a valid HTTP header name");
        cfg_lowercase(t->header_name);
    }
    cfg_get_str(c, h, "value", true, &t->header_value);
    cfg_path_pop(c, mark);
}

static void parse_match(cfg_ctx_t *c, const cJSON *tenant, cfg_tenant_t *t)
{
    const cJSON *match = cfg_get_obj(c, tenant, "match", true);
    if (match == NULL)
        return;
    size_t mark = cfg_path_key(c, "match");
    cfg_check_keys(c, match, match_keys);
    int forms = (cfg_get(match, "api_keys_sha256") != NULL) + (cfg_get(match, "header") != NULL) +
                (cfg_get(match, "any") != NULL);
    if (forms != 1) {
        cfg_err(c, NULL, "needs exactly one of api_keys_sha256, header, any");
    } else if (cfg_get(match, "api_keys_sha256") != NULL) {
        t->match_kind = CFG_MATCH_API_KEYS;
        parse_api_keys(c, match, t);
    } else if (cfg_get(match, "header") != NULL) {
        t->match_kind = CFG_MATCH_HEADER;
        parse_header_match(c, match, t);
    } else {
        bool any = false;
        t->match_kind = CFG_MATCH_ANY;
        if (cfg_get_bool(c, match, "any", &any) && !any)
            cfg_err(c, "any", "must be true");
        cfg_get_bool(c, match, "unknown_keys", &t->any_unknown_keys);
    }
    if (t->match_kind != CFG_MATCH_ANY && cfg_get(match, "unknown_keys") != NULL)
        cfg_err(c, "unknown_keys", "only with \"any\": true");
    cfg_path_pop(c, mark);
}

/* ---- tenants --------------------------------------------------------------------------- */

/* "rate_limit": {"requests_per_second": R, "burst": B}: R > 0 (fractions allowed: 0.5 is one
 * request every two seconds), B whole requests, default max(1, ceil(R)). */
static void parse_rate_limit(cfg_ctx_t *c, const cJSON *node, cfg_tenant_t *t)
{
    const cJSON *o = cfg_get_obj(c, node, "rate_limit", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "rate_limit");
    cfg_check_keys(c, o, rate_limit_keys);
    if (cfg_get(o, "requests_per_second") == NULL)
        cfg_err(c, "requests_per_second", "required");
    else if (cfg_get_num(c, o, "requests_per_second", 0, 1e6, &t->rate_rps) && t->rate_rps <= 0)
        cfg_err(c, "requests_per_second", "must be greater than 0");
    double def = ceil(t->rate_rps);
    t->rate_burst = def < 1 ? 1 : (uint32_t)def;
    cfg_get_u32(c, o, "burst", 1, 1000000, &t->rate_burst);
    cfg_path_pop(c, mark);
}

static void parse_tenant(cfg_ctx_t *c, const cJSON *node, cfg_tenant_t *t)
{
    t->shadow_rate = -1;
    if (!cJSON_IsObject(node)) {
        cfg_err(c, NULL, "expected an object");
        return;
    }
    cfg_check_keys(c, node, tenant_keys);
    if (cfg_get_str(c, node, "name", true, &t->name) && !cfg_valid_name(t->name))
        cfg_err(c, "name", CFG_NAME_RULE, CFG_NAME_MAX);
    parse_match(c, node, t);
    if (cfg_get_str(c, node, "pool", false, &t->pool) && !cfg_valid_name(t->pool))
        cfg_err(c, "pool", "not a valid pool name");
    parse_sampling(c, node, t);
    cfg_get_str_array(c, node, "deny_params", false, true, &t->deny_params, &t->ndeny_params);
    if (cfg_get_str_array(c, node, "allow_params", false, false, &t->allow_params,
                          &t->nallow_params)) {
        bool model = false;
        for (size_t i = 0; i < t->nallow_params; i++)
            model |= strcmp(t->allow_params[i], "model") == 0;
        if (!model)
            cfg_warn(c, "allow_params", "does not list \"model\": every request needs one");
    }
    cfg_get_bool(c, node, "audit", &t->audit);
    cfg_get_num(c, node, "shadow_rate", 0, 1, &t->shadow_rate);
    parse_rate_limit(c, node, t);
    int mode;
    if (cfg_get_enum(c, node, "require_determinism", &cfg_determinism_names[1], 2, &mode))
        t->require_determinism = (cfg_determinism_t)(mode + 1);
}

/* Duplicate names, and tenants that can never match because an earlier one matches anything. */
static void check_tenants(cfg_ctx_t *c, const cfg_policy_t *p)
{
    size_t any_at = SIZE_MAX;
    cfg_seen_t seen = {0};
    for (size_t i = 0; i < p->ntenants; i++) {
        const cfg_tenant_t *t = &p->tenants[i];
        size_t mark = cfg_path_index(c, i);
        size_t j = t->name ? cfg_seen_add(&seen, t->name, i) : CFG_UNSEEN;
        if (j != CFG_UNSEEN)
            cfg_err(c, "name", "duplicate tenant name (also tenants[%zu])", j);
        if (any_at != SIZE_MAX)
            cfg_warn(c, NULL, "never matches: tenants[%zu] matches every request", any_at);
        else if (t->match_kind == CFG_MATCH_ANY && t->any_unknown_keys && t->name != NULL)
            any_at = i;
        cfg_path_pop(c, mark);
    }
    cfg_seen_free(&seen);
}

cfg_policy_t *cfg_policy_from_json(cfg_ctx_t *c, const cJSON *node)
{
    if (!cJSON_IsObject(node)) {
        cfg_err(c, NULL, "expected an object");
        return NULL;
    }
    cfg_policy_t *p = dp_xcalloc(1, sizeof(*p));
    cfg_check_keys(c, node, policy_keys);
    const cJSON *arr = cfg_get_arr(c, node, "tenants", true);
    if (arr != NULL && cJSON_GetArraySize(arr) == 0)
        cfg_err(c, "tenants", "must list at least one tenant");
    if (arr != NULL) {
        p->ntenants = (size_t)cJSON_GetArraySize(arr);
        p->tenants = dp_xcalloc(p->ntenants, sizeof(*p->tenants));
        size_t mark = cfg_path_key(c, "tenants"), i = 0;
        for (const cJSON *it = arr->child; it != NULL; it = it->next, i++) {
            size_t m = cfg_path_index(c, i);
            parse_tenant(c, it, &p->tenants[i]);
            cfg_path_pop(c, m);
        }
        check_tenants(c, p);
        cfg_path_pop(c, mark);
    }
    return p;
}

cfg_policy_t *cfg_policy_parse(const char *json, size_t len, const char *path, cfg_errors_t *errs)
{
    cfg_errors_t local = {0};
    cfg_ctx_t c;
    cfg_ctx_init(&c, errs != NULL ? errs : &local, path, "policy", NULL);
    cJSON *doc = cfg_parse_json(&c, json, len);
    cfg_policy_t *p = doc != NULL ? cfg_policy_from_json(&c, doc) : NULL;
    if (c.nerrors > 0) {
        cfg_policy_free(p);
        p = NULL;
    }
    cJSON_Delete(doc);
    cfg_ctx_free(&c);
    cfg_errors_free(&local);
    return p;
}

cfg_policy_t *cfg_policy_default(void)
{
    cfg_policy_t *p = dp_xcalloc(1, sizeof(*p));
    p->ntenants = 1;
    p->tenants = dp_xcalloc(1, sizeof(*p->tenants));
    p->tenants[0].name = dp_xstrdup("default");
    p->tenants[0].match_kind = CFG_MATCH_ANY;
    /* No tenant has keys, so none can be mistyped: credentials (the OpenAI SDKs always send
     * one) are the replica's or a gateway's business. */
    p->tenants[0].any_unknown_keys = true;
    p->tenants[0].shadow_rate = -1;
    return p;
}

void cfg_policy_free(cfg_policy_t *p)
{
    if (p == NULL)
        return;
    for (size_t i = 0; i < p->ntenants; i++) {
        cfg_tenant_t *t = &p->tenants[i];
        free(t->name);
        free(t->api_keys);
        free(t->header_name);
        free(t->header_value);
        free(t->pool);
        cfg_str_array_free(t->deny_params, t->ndeny_params);
        cfg_str_array_free(t->allow_params, t->nallow_params);
    }
    free(p->tenants);
    free(p);
}
