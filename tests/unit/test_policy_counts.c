/* Counts after policy (docs/policy.md §3, "Counts"): every count a rule governs, under every
 * name an engine reads it by, is an integer >= 1 once the rules ran. 0 and negative values
 * (llama.cpp reads -1 as "no limit") are refused naming the key, or raised by the rule's min. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "policy/policy.h"

static policy_req_t *req;
static policy_result_t res;
static policy_error_t err;

static void setup(void)
{
    req = policy_req_new();
}

static void teardown(void)
{
    policy_req_free(req);
    req = NULL;
}

TestSuite(counts, .init = setup, .fini = teardown);

static cfg_tenant_t capped(double max)
{
    cfg_tenant_t t;
    memset(&t, 0, sizeof(t));
    t.name = "capped";
    t.match_kind = CFG_MATCH_ANY;
    t.shadow_rate = -1;
    t.rules[CFG_PARAM_MAX_TOKENS].has_max = true;
    t.rules[CFG_PARAM_MAX_TOKENS].max = max;
    return t;
}

static int run(const cfg_tenant_t *t, policy_route_t route, const char *body, const char *fw)
{
    memset(&err, 0, sizeof(err));
    int rc = policy_parse(req, route, body, strlen(body), &err);
    if (rc == 0)
        rc = policy_apply(req, t, fw, &res, &err);
    return rc;
}

static const char *const length_keys[] = {"max_tokens", "max_completion_tokens", "n_predict",
                                          "max_new_tokens"};
static const char *const bad_values[] = {"-1", "-2", "0", "-9223372036854775808", "-0"};
static const char *const frameworks[] = {NULL, "vllm", "tgi", "sglang", "llamacpp"};

Test(counts, below_one_never_passes_a_cap)
{
    cfg_tenant_t t = capped(100);
    char body[256];
    for (size_t k = 0; k < sizeof(length_keys) / sizeof(length_keys[0]); k++) {
        for (size_t v = 0; v < sizeof(bad_values) / sizeof(bad_values[0]); v++) {
            for (size_t f = 0; f < sizeof(frameworks) / sizeof(frameworks[0]); f++) {
                snprintf(body, sizeof(body),
                         "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],"
                         "\"%s\":%s}",
                         length_keys[k], bad_values[v]);
                cr_assert_eq(run(&t, POLICY_ROUTE_CHAT, body, frameworks[f]), -1, "%s", body);
                cr_assert_eq(err.status, 400);
                cr_assert_str_eq(err.type, "invalid_request_error");
                cr_assert_str_eq(err.code, "invalid_value");
                cr_assert_str_eq(err.param, length_keys[k], "%s", body);
                cr_assert(strstr(err.message, "at least 1"), "%s", err.message);
            }
        }
    }
}

Test(counts, completions_and_responses_too)
{
    cfg_tenant_t t = capped(100);
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"max_tokens\":-1}", "llamacpp"),
                 -1);
    cr_assert_str_eq(err.param, "max_tokens");
    cr_assert_eq(run(&t, POLICY_ROUTE_RESPONSES,
                     "{\"model\":\"m\",\"input\":\"hi\",\"max_output_tokens\":0}", "vllm"),
                 -1);
    cr_assert_str_eq(err.param, "max_output_tokens");
    cr_assert_eq(run(&t, POLICY_ROUTE_RESPONSES,
                     "{\"model\":\"m\",\"input\":\"hi\",\"max_tokens\":-5}", "vllm"),
                 -1);
    cr_assert_str_eq(err.param, "max_tokens");
    /* Elsewhere max_output_tokens is no length of the route: no rule reads it. */
    cr_assert_eq(run(&t, POLICY_ROUTE_CHAT,
                     "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],"
                     "\"max_output_tokens\":-1}",
                     NULL),
                 0);
}

Test(counts, a_min_raises_instead)
{
    cfg_tenant_t t = capped(100);
    t.rules[CFG_PARAM_MAX_TOKENS].has_min = true;
    t.rules[CFG_PARAM_MAX_TOKENS].min = 1;
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"max_tokens\":-1,\"n_predict\":0}", NULL),
                 0, "%s", err.message);
    const char *want = "{\"model\":\"m\",\"prompt\":\"p\",\"max_tokens\":1,\"n_predict\":1}";
    cr_assert_eq(policy_body(req, &res).len, strlen(want), "%.*s", (int)policy_body(req, &res).len,
                 policy_body(req, &res).base);
    cr_assert(memcmp(policy_body(req, &res).base, want, policy_body(req, &res).len) == 0);
    cr_assert(res.has_max_tokens && res.max_tokens == 1);
}

Test(counts, a_force_replaces_any_value)
{
    cfg_tenant_t t = capped(100);
    t.rules[CFG_PARAM_MAX_TOKENS] = (cfg_rule_t){.has_force = true, .force = 64};
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"max_tokens\":-9223372036854775808}",
                     NULL),
                 0);
    cr_assert(res.has_max_tokens && res.max_tokens == 64);
}

Test(counts, max_new_tokens_is_ruled_like_the_other_aliases)
{
    cfg_tenant_t t = capped(100);
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"max_new_tokens\":100000}", "tgi"),
                 0);
    const char *want = "{\"model\":\"m\",\"prompt\":\"p\",\"max_new_tokens\":100,\"temperature\":1,"
                       "\"max_tokens\":100}"; /* N1 pins the absent max_tokens */
    cr_assert_eq(policy_body(req, &res).len, strlen(want), "%.*s", (int)policy_body(req, &res).len,
                 policy_body(req, &res).base);
    cr_assert(memcmp(policy_body(req, &res).base, want, policy_body(req, &res).len) == 0);
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"max_new_tokens\":1.5}", NULL),
                 -1);
    cr_assert_str_eq(err.param, "max_new_tokens");
}

Test(counts, n_is_a_count)
{
    cfg_tenant_t t = capped(100);
    t.rules[CFG_PARAM_N] = (cfg_rule_t){.has_max = true, .max = 2};
    cr_assert_eq(
        run(&t, POLICY_ROUTE_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"p\",\"n\":0}", NULL), -1);
    cr_assert_str_eq(err.param, "n");
    cr_assert_eq(
        run(&t, POLICY_ROUTE_COMPLETIONS, "{\"model\":\"m\",\"prompt\":\"p\",\"n\":-1}", NULL), -1);
}

Test(counts, ungoverned_counts_are_the_replicas_business)
{
    cfg_tenant_t t = capped(100);
    t.rules[CFG_PARAM_MAX_TOKENS] = (cfg_rule_t){0};
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"max_tokens\":-1,\"n\":0}", NULL),
                 0);
    cr_assert_not(res.rewritten);
}

Test(counts, valid_values_pass_and_clamp)
{
    cfg_tenant_t t = capped(100);
    cr_assert_eq(
        run(&t, POLICY_ROUTE_COMPLETIONS,
            "{\"model\":\"m\",\"prompt\":\"p\",\"max_tokens\":1,\"n_predict\":9223372036854775807}",
            NULL),
        0);
    cr_assert(strstr(policy_body(req, &res).base, "\"n_predict\":100"));
    cr_assert(strstr(policy_body(req, &res).base, "\"max_tokens\":1"));
}

/* llama.cpp's n_cmpl is its name for n: n's rule governs it wherever it is sent, so a cap on n
 * cannot be passed by the other name, and a count below 1 is refused naming it. */
Test(counts, n_cmpl_is_ruled_as_n)
{
    cfg_tenant_t t;
    memset(&t, 0, sizeof(t));
    t.name = "one";
    t.match_kind = CFG_MATCH_ANY;
    t.shadow_rate = -1;
    t.rules[CFG_PARAM_N].has_max = true;
    t.rules[CFG_PARAM_N].max = 1;
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"n_cmpl\":8}", "llamacpp"),
                 0, "%s", err.message);
    const char *want = "{\"model\":\"m\",\"prompt\":\"p\",\"n_cmpl\":1,\"n\":1}";
    cr_assert_eq(policy_body(req, &res).len, strlen(want), "%.*s", (int)policy_body(req, &res).len,
                 policy_body(req, &res).base);
    cr_assert(memcmp(policy_body(req, &res).base, want, policy_body(req, &res).len) == 0);
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"n_cmpl\":0}", "llamacpp"),
                 -1);
    cr_assert_str_eq(err.param, "n_cmpl");
    cr_assert_eq(run(&t, POLICY_ROUTE_COMPLETIONS,
                     "{\"model\":\"m\",\"prompt\":\"p\",\"n_cmpl\":1.5}", "llamacpp"),
                 -1);
    cr_assert_str_eq(err.code, "invalid_value");
}
