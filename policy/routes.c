/* Route classification: the policed routes, the engine-native generation routes refused for
 * every tenant, and the default-deny rule for everything else a policed tenant sends. */
#include "policy/routes.h"

#include <string.h>

#include "common/util.h"

static bool iov_eq(dp_iovec_t v, const char *s)
{
    size_t n = strlen(s);
    return v.len == n && memcmp(v.base, s, n) == 0;
}

/* A segment of a route pattern: a literal, or "{}" for any one non-empty segment. */
static bool segment_matches(const char *pat, size_t pn, const char *seg, size_t sn)
{
    if (pn == 2 && pat[0] == '{' && pat[1] == '}')
        return sn > 0;
    return pn == sn && memcmp(pat, seg, sn) == 0;
}

/* pattern ("/v2/models/{}/infer") against path, segment by segment; one trailing '/' on the
 * path is the same route. */
static bool route_matches(const char *pattern, dp_iovec_t path)
{
    const char *p = pattern, *s = path.base;
    size_t pl = strlen(pattern), sl = path.len;
    if (sl > 1 && s[sl - 1] == '/')
        sl--;
    if (pl == 1 || sl == 1) /* the root */
        return pl == sl && p[0] == '/' && s[0] == '/';
    size_t i = 0, j = 0;
    while (i < pl && j < sl) {
        if (p[i] != '/' || s[j] != '/')
            return false;
        size_t pe = i + 1, se = j + 1;
        while (pe < pl && p[pe] != '/')
            pe++;
        while (se < sl && s[se] != '/')
            se++;
        if (!segment_matches(p + i + 1, pe - i - 1, s + j + 1, se - j - 1))
            return false;
        i = pe;
        j = se;
    }
    return i == pl && j == sl;
}

/* Engines generate on more routes than the three detproxy polices. Passed through, each would
 * be a completion with no forced value, no seed and no audit line. For a policed tenant the
 * default-deny rule already closes every non-GET route nobody listed; this list says why, and
 * refuses these routes for every tenant (clients use the policed routes, where fingerprints,
 * shadows and the access log see them) whatever a pool's passthrough list says.
 * `any_method`: refused whatever the method, GET included (a GET that generates belongs here
 * so); otherwise GET and HEAD pass (TGI's `GET /` is its info page, `POST /` its generate). */
static const struct {
    const char *pattern;
    bool any_method;
} generation_routes[] = {
    /* llama.cpp server */
    {"/completion", true},
    {"/completions", true},
    {"/chat/completions", true},
    {"/infill", true},
    {"/v1/messages", true},
    /* Ollama's shape, which llama.cpp server also serves */
    {"/api/chat", true},
    {"/api/generate", true},
    /* TGI: the root is compat_generate, /vertex its Vertex AI route, the KServe feature's
     * generate and infer routes */
    {"/", false},
    {"/vertex", true},
    {"/generate", true},
    {"/generate_stream", true},
    {"/v2/models/{}/infer", true},
    {"/v2/models/{}/versions/{}/infer", true},
    {"/v2/models/{}/generate", true},
    {"/v2/models/{}/generate_stream", true},
    /* vLLM and SGLang (SageMaker's route, vLLM's native one, speech-to-text with sampling) */
    {"/invocations", true},
    {"/inference/v1/generate", true},
    {"/v1/audio/transcriptions", true},
    {"/v1/audio/translations", true},
    /* SGLang: its Vertex AI prediction route (the default of AIP_PREDICT_ROUTE), and the batch
     * API, whose POST runs every chat or completion request of an uploaded file; reading a
     * batch's state (GET) generates nothing */
    {"/vertex_generate", true},
    {"/v1/batches", false},
};

static bool is_read(dp_iovec_t method)
{
    return iov_eq(method, "GET") || iov_eq(method, "HEAD");
}

policy_class_t policy_routes_classify(dp_iovec_t method, dp_iovec_t path)
{
    /* The policed routes first: they are nearly every request, and no generation route's
     * pattern matches one of them (tests/unit/test_policy_routes.c checks), so the order
     * changes no answer. */
    if (iov_eq(method, "POST")) {
        if (route_matches("/v1/chat/completions", path))
            return POLICY_CLASS_CHAT;
        if (route_matches("/v1/completions", path))
            return POLICY_CLASS_COMPLETIONS;
        if (route_matches("/v1/responses", path))
            return POLICY_CLASS_RESPONSES;
    }
    for (size_t i = 0; i < DP_ARRAY_SIZE(generation_routes); i++)
        if ((generation_routes[i].any_method || !is_read(method)) &&
            route_matches(generation_routes[i].pattern, path))
            return POLICY_CLASS_GENERATION;
    if (iov_eq(method, "GET") && route_matches("/v1/models", path))
        return POLICY_CLASS_MODELS;
    return POLICY_CLASS_PASS;
}

bool policy_routes_tenant_policed(const cfg_tenant_t *t)
{
    if (t == NULL)
        return false;
    for (int i = 0; i < CFG_PARAM__COUNT; i++) {
        const cfg_rule_t *r = &t->rules[i];
        if (r->has_force || r->has_default || r->has_min || r->has_max || r->derive)
            return true;
    }
    return t->ndeny_params > 0 || t->allow_params != NULL || t->audit ||
           t->require_determinism != CFG_DETERMINISM_NONE;
}

bool policy_routes_entry_matches(const cfg_passthrough_t *e, dp_iovec_t method, dp_iovec_t path)
{
    if (e->method != NULL && !iov_eq(method, e->method))
        return false;
    if (e->prefix)
        return path.len >= e->len && memcmp(path.base, e->path, e->len) == 0;
    return path.len == e->len && memcmp(path.base, e->path, e->len) == 0;
}

bool policy_routes_passthrough(const cfg_pool_t *p, const cfg_tenant_t *t, dp_iovec_t method,
                               dp_iovec_t path)
{
    if (!policy_routes_tenant_policed(t) || is_read(method))
        return true;
    for (size_t i = 0; i < p->npassthrough; i++)
        if (policy_routes_entry_matches(&p->passthrough[i], method, path))
            return true;
    return false;
}
