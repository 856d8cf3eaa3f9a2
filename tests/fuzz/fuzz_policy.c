/* libFuzzer target for the policy module: strict body validation, the rule engine with fixed
 * tenants and every framework, RFC 8785 canonicalisation, and both fingerprint rewriters.
 *
 * Input: byte 0 selects route (bit 0), tenant (bits 1-2, mod 3) and framework (bits 3-5, mod 6),
 * and the SSE split point; the rest is the
 * request body (or response body / SSE stream for the rewriters). Beyond "no crash, no UB,
 * no leak" it checks invariants, each an abort() when broken:
 *   - an accepted request yields a forwarded body that policy_parse accepts again, same model;
 *   - applying the same tenant and framework to that body forwards the very same bytes (the
 *     rules and the normalisation reach a fixpoint; a TGI tenant forcing top_p 1 still logs
 *     "forced" then "removed" each time, so the change list need not be empty), same seed;
 *   - a seed sent upstream is within [0, 2^63-1]; a derived one below 2^31;
 *   - every count a tenant's rule governs (max_tokens and each alias, n) is forwarded as an
 *     integer >= 1 or not at all (docs/policy.md §3, "Counts");
 *   - policy_jcs output is accepted by policy_jcs and maps to itself;
 *   - the SSE rewriter produces the same bytes whatever the split point.
 *
 * Build: clang -fsanitize=fuzzer,address,undefined, linked with dp_policy compiled with
 * -fsanitize=fuzzer-no-link,address,undefined (the DP_FUZZ CMake option). Seed corpus:
 * tests/fuzz/corpus/policy/. */
#define _GNU_SOURCE /* memmem */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "policy/policy.h"

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c))                                                                                  \
            abort();                                                                               \
    } while (0)

static char *deny[] = {"logit_bias", "logprobs"};

/* memcmp with NULL is undefined even for zero bytes; empty buffers stay NULL. */
static int same(const void *a, size_t an, const void *b, size_t bn)
{
    return an == bn && (an == 0 || memcmp(a, b, an) == 0);
}

static void tenants_init(cfg_tenant_t t[3])
{
    memset(t, 0, 3 * sizeof(*t));
    t[0].name = "bank";
    t[0].rules[CFG_PARAM_TEMPERATURE] = (cfg_rule_t){.has_force = true, .force = 0};
    t[0].rules[CFG_PARAM_TOP_P] = (cfg_rule_t){.has_force = true, .force = 1};
    t[0].rules[CFG_PARAM_SEED] = (cfg_rule_t){.has_force = true, .force = 1234};
    t[0].deny_params = deny;
    t[0].ndeny_params = 2;
    t[1].name = "default";
    t[1].rules[CFG_PARAM_TEMPERATURE] =
        (cfg_rule_t){.has_default = true, .def = 0.7, .has_max = true, .max = 1.0};
    t[1].rules[CFG_PARAM_SEED] = (cfg_rule_t){.derive = true};
    t[2].name = "limits";
    t[2].rules[CFG_PARAM_MAX_TOKENS] = (cfg_rule_t){.has_max = true, .max = 512};
    t[2].rules[CFG_PARAM_TOP_K] =
        (cfg_rule_t){.has_min = true, .min = 1, .has_max = true, .max = 100};
    t[2].rules[CFG_PARAM_N] = (cfg_rule_t){.has_default = true, .def = 1};
    t[2].rules[CFG_PARAM_PRESENCE_PENALTY] =
        (cfg_rule_t){.has_min = true, .min = -1, .has_max = true, .max = 1};
    t[2].rules[CFG_PARAM_FREQUENCY_PENALTY] = (cfg_rule_t){.has_max = true, .max = 0.5};
    t[2].rules[CFG_PARAM_TOP_P] = (cfg_rule_t){.has_max = true, .max = 0.95};
}

static const char *const frameworks[] = {NULL, "vllm", "tgi", "sglang", "llamacpp", "other"};

/* The forwarded body's counts: each one t governs is absent, or a number >= 1. cJSON reads
 * numbers as doubles, which keeps "below 1" exact. The body has no duplicate keys (refused). */
static void check_counts(const cfg_tenant_t *t, const char *body, size_t n)
{
    static const struct {
        const char *key;
        cfg_param_t rule;
    } counts[] = {{"max_tokens", CFG_PARAM_MAX_TOKENS},
                  {"max_completion_tokens", CFG_PARAM_MAX_TOKENS},
                  {"n_predict", CFG_PARAM_MAX_TOKENS},
                  {"max_new_tokens", CFG_PARAM_MAX_TOKENS},
                  {"n", CFG_PARAM_N}};
    /* cJSON ends strings at a NUL: "n\u0000x" would read as the key n. */
    if (memmem(body, n, "\\u0000", 6) != NULL)
        return;
    cJSON *doc = cJSON_ParseWithLength(body, n);
    if (doc == NULL) /* numbers cJSON cannot read (longer than it takes): nothing to check */
        return;
    for (size_t i = 0; i < sizeof(counts) / sizeof(counts[0]); i++) {
        const cfg_rule_t *r = &t->rules[counts[i].rule];
        if (!(r->has_force || r->has_default || r->has_min || r->has_max))
            continue;
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(doc, counts[i].key);
        CHECK(v == NULL || cJSON_IsNull(v) || (cJSON_IsNumber(v) && v->valuedouble >= 1));
    }
    cJSON_Delete(doc);
}

static void check_requests(const uint8_t sel, const char *body, size_t n)
{
    static cfg_tenant_t t[3];
    static policy_req_t *r, *r2;
    if (r == NULL) {
        tenants_init(t);
        r = policy_req_new();
        r2 = policy_req_new();
    }
    policy_route_t route = (sel & 1) ? POLICY_ROUTE_CHAT : POLICY_ROUTE_COMPLETIONS;
    const cfg_tenant_t *tn = &t[((sel >> 1) & 3) % 3];
    const char *fw = frameworks[((sel >> 3) & 7) % 6];
    policy_error_t err;
    policy_result_t res, res2;
    if (policy_parse(r, route, body, n, &err) < 0) {
        CHECK(err.status == 400 && err.message[0]);
        return;
    }
    if (policy_apply(r, tn, fw, &res, &err) < 0) {
        CHECK(err.status == 400 && err.message[0]);
        return;
    }
    CHECK(res.nchanges <= POLICY_MAX_CHANGES);
    CHECK(!res.has_seed || res.seed <= (uint64_t)INT64_MAX);
    CHECK(!res.seed_derived || res.seed < 2147483648u);
    CHECK(res.rewritten || (policy_body(r, &res).base == body && policy_body(r, &res).len == n));
    CHECK(res.comparable == ((res.has_temperature && res.temperature == 0) || res.has_seed));
    CHECK(!res.has_max_tokens || !(tn->rules[CFG_PARAM_MAX_TOKENS].has_max) || res.max_tokens >= 1);
    check_counts(tn, policy_body(r, &res).base, policy_body(r, &res).len);

    /* The forwarded body is policed again and nothing moves. */
    CHECK(policy_parse(r2, route, policy_body(r, &res).base, policy_body(r, &res).len, &err) == 0);
    dp_iovec_t m1 = res.model, m2 = policy_model(r2);
    CHECK(same(m1.base, m1.len, m2.base, m2.len));
    CHECK(policy_apply(r2, tn, fw, &res2, &err) == 0);
    CHECK(same(policy_body(r2, &res2).base, policy_body(r2, &res2).len, policy_body(r, &res).base,
               policy_body(r, &res).len));
    CHECK(res.rewritten || !res2.rewritten);
    CHECK(res2.has_seed == res.has_seed && res2.seed == res.seed);
    CHECK(res2.stream == res.stream);
}

static void check_jcs(const char *p, size_t n)
{
    dp_buf_t a = {0}, b = {0};
    policy_error_t err;
    if (policy_jcs(p, n, &a, &err) == 0) {
        CHECK(policy_jcs(a.base, a.len, &b, &err) == 0);
        CHECK(same(a.base, a.len, b.base, b.len));
    }
    dp_buf_free(&a);
    dp_buf_free(&b);
}

static void check_fingerprint(uint8_t sel, const char *p, size_t n)
{
    static const char fp[] = "fp_0123456789abcdef";
    dp_buf_t out = {0}, whole = {0}, split = {0};
    char prev[POLICY_FP_PREV_MAX];
    if (policy_fp_rewrite_json(p, n, fp, &out, prev, NULL)) {
        /* Still a JSON object, and rewriting again only reports our own fingerprint. */
        dp_buf_t again = {0};
        char prev2[POLICY_FP_PREV_MAX];
        CHECK(strlen(prev) < POLICY_FP_PREV_MAX);
        CHECK(policy_fp_rewrite_json(out.base, out.len, fp, &again, prev2, NULL) == 1);
        CHECK(strcmp(prev2, fp) == 0);
        CHECK(same(again.base, again.len, out.base, out.len));
        dp_buf_free(&again);
    }
    policy_sse_fp_t s;
    policy_sse_fp_init(&s, fp);
    CHECK(policy_sse_fp_feed(&s, p, n, &whole) == (ssize_t)n);
    policy_sse_fp_finish(&s, &whole);
    size_t cut = n ? (size_t)sel * 7919 % (n + 1) : 0;
    policy_sse_fp_init(&s, fp);
    policy_sse_fp_feed(&s, p, cut, &split);
    policy_sse_fp_feed(&s, p + cut, n - cut, &split);
    policy_sse_fp_finish(&s, &split);
    CHECK(same(whole.base, whole.len, split.base, split.len));
    dp_buf_free(&out);
    dp_buf_free(&whole);
    dp_buf_free(&split);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    uint8_t sel = data[0];
    /* A private copy: the fuzzer's buffer has no slack after it, so overreads show. */
    size_t n = size - 1;
    char *body = malloc(n ? n : 1);
    memcpy(body, data + 1, n);
    check_requests(sel, body, n);
    check_jcs(body, n);
    check_fingerprint(sel, body, n);
    free(body);
    return 0;
}
