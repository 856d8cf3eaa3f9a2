/* The rule engine: deny, types, shapes, force/default/min/max per parameter, aliases, seed
 * derivation (known answers computed independently with Python's hashlib/json), framework
 * normalisation and the forwarded body. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
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

TestSuite(rules, .init = setup, .fini = teardown);

static cfg_tenant_t tenant(const char *name)
{
    cfg_tenant_t t;
    memset(&t, 0, sizeof(t));
    t.name = (char *)name;
    t.match_kind = CFG_MATCH_ANY;
    t.shadow_rate = -1;
    return t;
}

static void r_force(cfg_tenant_t *t, cfg_param_t p, double v)
{
    t->rules[p].has_force = true;
    t->rules[p].force = v;
}

static void r_default(cfg_tenant_t *t, cfg_param_t p, double v)
{
    t->rules[p].has_default = true;
    t->rules[p].def = v;
}

static void r_min(cfg_tenant_t *t, cfg_param_t p, double v)
{
    t->rules[p].has_min = true;
    t->rules[p].min = v;
}

static void r_max(cfg_tenant_t *t, cfg_param_t p, double v)
{
    t->rules[p].has_max = true;
    t->rules[p].max = v;
}

static int run_fw(const cfg_tenant_t *t, policy_route_t route, const char *body, const char *fw)
{
    memset(&err, 0, sizeof(err));
    int rc = policy_parse(req, route, body, strlen(body), &err);
    if (rc == 0)
        rc = policy_apply(req, t, fw, &res, &err);
    return rc;
}

static int run(const cfg_tenant_t *t, const char *body)
{
    return run_fw(t, POLICY_ROUTE_COMPLETIONS, body, NULL);
}

static void expect_body(const char *want)
{
    cr_assert_eq(policy_body(req, &res).len, strlen(want), "body %.*s\nwant %s",
                 (int)policy_body(req, &res).len, policy_body(req, &res).base, want);
    cr_assert(memcmp(policy_body(req, &res).base, want, policy_body(req, &res).len) == 0,
              "body %.*s\nwant %s", (int)policy_body(req, &res).len, policy_body(req, &res).base,
              want);
}

static const policy_change_t *change_for(const char *param, policy_action_t act)
{
    for (size_t i = 0; i < res.nchanges; i++)
        if (strcmp(res.changes[i].param, param) == 0 && res.changes[i].action == act)
            return &res.changes[i];
    return NULL;
}

/* ---- table: every rule against present / absent / null for every parameter ------------------ */

typedef struct {
    cfg_param_t p;
    const char *name;
    const char *present; /* a value the client sends */
    double force;        /* differs from present */
    const char *force_txt;
    double def;
    const char *def_txt;
    double lo, hi; /* present lies outside [lo, hi]: below lo for "min" cases, above hi */
    const char *lo_txt, *hi_txt;
    const char *below; /* a value below lo */
} param_case_t;

static const param_case_t params[] = {
    {CFG_PARAM_TEMPERATURE, "temperature", "0.9", 0, "0", 0.7, "0.7", 0.95, 0.5, "0.95", "0.5",
     "0.1"},
    {CFG_PARAM_TOP_P, "top_p", "0.5", 1, "1", 0.9, "0.9", 0.6, 0.25, "0.6", "0.25", "0.1"},
    {CFG_PARAM_TOP_K, "top_k", "50", 1, "1", 40, "40", 60, 20, "60", "20", "2"},
    {CFG_PARAM_SEED, "seed", "42", 1234, "1234", 7, "7", 100, 10, "100", "10", "3"},
    {CFG_PARAM_MAX_TOKENS, "max_tokens", "100", 16, "16", 256, "256", 200, 64, "200", "64", "8"},
    {CFG_PARAM_N, "n", "3", 1, "1", 1, "1", 4, 2, "4", "2", "1"},
    {CFG_PARAM_PRESENCE_PENALTY, "presence_penalty", "0.5", 0, "0", 0.1, "0.1", 0.75, 0.25, "0.75",
     "0.25", "-1.5"},
    {CFG_PARAM_FREQUENCY_PENALTY, "frequency_penalty", "0.5", 0, "0", 0.1, "0.1", 0.75, 0.25,
     "0.75", "0.25", "-1.5"},
};

#define BASE "{\"model\":\"m\",\"prompt\":\"p\""

static char *body_with(const char *name, const char *val)
{
    static char b[256];
    if (val)
        snprintf(b, sizeof(b), BASE ",\"%s\":%s}", name, val);
    else
        snprintf(b, sizeof(b), BASE "}");
    return b;
}

static void expect_change(const param_case_t *c, policy_action_t act, const char *before,
                          const char *after)
{
    char want[256];
    snprintf(want, sizeof(want), BASE ",\"%s\":%s}", c->name, after);
    expect_body(want);
    cr_assert(res.rewritten);
    cr_assert_eq(res.nchanges, 1, "%s: %zu changes", c->name, res.nchanges);
    cr_assert_str_eq(res.changes[0].param, c->name);
    cr_assert_eq(res.changes[0].action, act, "%s", c->name);
    cr_assert_str_eq(res.changes[0].before, before, "%s", c->name);
    cr_assert_str_eq(res.changes[0].after, after, "%s", c->name);
}

static void expect_untouched(const char *body, const char *what)
{
    cr_assert_not(res.rewritten, "%s rewritten", what);
    cr_assert_eq(res.nchanges, 0, "%s", what);
    cr_assert_eq(policy_body(req, &res).base, (const char *)body, "%s: not the client's bytes",
                 what);
}

Test(rules, force_present_absent_null_equal)
{
    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++) {
        const param_case_t *c = &params[i];
        cfg_tenant_t t = tenant("t");
        r_force(&t, c->p, c->force);
        cr_assert_eq(run(&t, body_with(c->name, c->present)), 0, "%s", err.message);
        expect_change(c, POLICY_FORCED, c->present, c->force_txt);
        cr_assert_eq(run(&t, body_with(c->name, NULL)), 0);
        expect_change(c, POLICY_FORCED, "", c->force_txt);
        cr_assert_eq(run(&t, body_with(c->name, "null")), 0);
        expect_change(c, POLICY_FORCED, "null", c->force_txt);
        /* Already the forced value: nothing changes, the client's bytes go through. */
        const char *b = body_with(c->name, c->force_txt);
        cr_assert_eq(run(&t, b), 0);
        expect_untouched(b, c->name);
    }
}

Test(rules, default_absent_null_present)
{
    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++) {
        const param_case_t *c = &params[i];
        cfg_tenant_t t = tenant("t");
        r_default(&t, c->p, c->def);
        cr_assert_eq(run(&t, body_with(c->name, NULL)), 0);
        expect_change(c, POLICY_DEFAULTED, "", c->def_txt);
        cr_assert_eq(run(&t, body_with(c->name, "null")), 0);
        expect_change(c, POLICY_DEFAULTED, "null", c->def_txt);
        const char *b = body_with(c->name, c->present);
        cr_assert_eq(run(&t, b), 0);
        expect_untouched(b, c->name);
    }
}

Test(rules, min_max_clamp_when_present_only)
{
    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++) {
        const param_case_t *c = &params[i];
        cfg_tenant_t t = tenant("t");
        r_max(&t, c->p, c->hi);
        cr_assert_eq(run(&t, body_with(c->name, c->present)), 0);
        expect_change(c, POLICY_CLAMPED, c->present, c->hi_txt);
        /* absent and null stay so without a framework (clamp when present) */
        const char *b = body_with(c->name, NULL);
        cr_assert_eq(run(&t, b), 0);
        expect_untouched(b, c->name);
        b = body_with(c->name, "null");
        cr_assert_eq(run(&t, b), 0);
        expect_untouched(b, c->name);
        /* below max: untouched */
        b = body_with(c->name, c->below);
        cr_assert_eq(run(&t, b), 0);
        expect_untouched(b, c->name);

        t = tenant("t");
        r_min(&t, c->p, c->lo);
        cr_assert_eq(run(&t, body_with(c->name, c->present)), 0);
        expect_change(c, POLICY_CLAMPED, c->present, c->lo_txt);
        b = body_with(c->name, NULL);
        cr_assert_eq(run(&t, b), 0);
        expect_untouched(b, c->name);
    }
}

Test(rules, default_is_clamped)
{
    cfg_tenant_t t = tenant("t");
    r_default(&t, CFG_PARAM_TEMPERATURE, 1.5);
    r_max(&t, CFG_PARAM_TEMPERATURE, 1.0);
    cr_assert_eq(run(&t, BASE "}"), 0);
    expect_body(BASE ",\"temperature\":1}");
    cr_assert_eq(res.changes[0].action, POLICY_DEFAULTED);
}

Test(rules, wrong_types_name_the_param)
{
    static const char *bad_num[] = {"\"hot\"", "true", "[0.5]", "{\"v\":1}"};
    for (size_t i = 0; i < sizeof(params) / sizeof(params[0]); i++) {
        cfg_tenant_t t = tenant("t"); /* types are checked whether or not a rule exists */
        for (size_t j = 0; j < sizeof(bad_num) / sizeof(bad_num[0]); j++) {
            cr_assert_eq(run(&t, body_with(params[i].name, bad_num[j])), -1, "%s=%s",
                         params[i].name, bad_num[j]);
            cr_assert_eq(err.status, 400);
            cr_assert_str_eq(err.code, "invalid_value");
            cr_assert_str_eq(err.param, params[i].name);
            cr_assert(strstr(err.message, params[i].name));
        }
    }
    cfg_tenant_t t = tenant("t");
    cr_assert_eq(run(&t, body_with("temperature", "\"hot\"")), -1);
    cr_assert_str_eq(err.message, "temperature must be a number");
}

Test(rules, integer_params_refuse_fractions_and_range)
{
    static const char *ints[] = {"top_k", "seed", "max_tokens", "n"};
    cfg_tenant_t t = tenant("t");
    for (size_t i = 0; i < 4; i++) {
        const char *bad[] = {"1.5", "1.0", "1e3", "99999999999999999999"};
        for (size_t j = 0; j < 4; j++) {
            cr_assert_eq(run(&t, body_with(ints[i], bad[j])), -1, "%s=%s", ints[i], bad[j]);
            cr_assert_str_eq(err.param, ints[i]);
        }
    }
    /* seed: [0, 2^63-1] */
    const char *bad_seed[] = {"-1", "9223372036854775808", "1.5", "-0.0", "18446744073709551616"};
    for (size_t j = 0; j < 5; j++) {
        cr_assert_eq(run(&t, body_with("seed", bad_seed[j])), -1, "seed=%s", bad_seed[j]);
        cr_assert_str_eq(err.param, "seed");
        cr_assert(strstr(err.message, "9223372036854775807"));
    }
    const char *b = body_with("seed", "9223372036854775807");
    cr_assert_eq(run(&t, b), 0);
    cr_assert(res.has_seed);
    cr_assert_eq(res.seed, 9223372036854775807ull);
    expect_untouched(b, "seed max");
    b = body_with("seed", "0");
    cr_assert_eq(run(&t, b), 0);
    cr_assert(res.has_seed);
    cr_assert_eq(res.seed, 0);
    /* top_k -1 (vLLM's "disabled") is an integer like any other */
    cr_assert_eq(run(&t, body_with("top_k", "-1")), 0);
}

Test(rules, big_seed_is_forwarded_exactly)
{
    /* A double would turn this into 9223372036854775808, above the range. */
    cfg_tenant_t t = tenant("t");
    r_max(&t, CFG_PARAM_TEMPERATURE, 0.5);
    cr_assert_eq(run(&t, BASE ",\"seed\":9223372036854775807,\"temperature\":1}"), 0);
    expect_body(BASE ",\"seed\":9223372036854775807,\"temperature\":0.5}");
}

Test(rules, stream_flag)
{
    cfg_tenant_t t = tenant("t");
    cr_assert_eq(run(&t, BASE ",\"stream\":true}"), 0);
    cr_assert(res.stream);
    cr_assert_eq(run(&t, BASE ",\"stream\":null}"), 0);
    cr_assert_not(res.stream);
    cr_assert_eq(run(&t, BASE "}"), 0);
    cr_assert_not(res.stream);
    cr_assert_eq(run(&t, BASE ",\"stream\":\"yes\"}"), -1);
    cr_assert_str_eq(err.param, "stream");
    cr_assert_eq(run(&t, BASE ",\"stream\":1}"), -1);
}

Test(rules, deny_params_first)
{
    cfg_tenant_t t = tenant("t");
    char *deny[] = {"logit_bias", "logprobs"};
    t.deny_params = deny;
    t.ndeny_params = 2;
    /* denied even though temperature is also wrong and the prompt is missing */
    cr_assert_eq(run(&t, "{\"model\":\"m\",\"temperature\":\"hot\",\"logit_bias\":{\"1\":5}}"), -1);
    cr_assert_eq(err.status, 400);
    cr_assert_str_eq(err.code, "policy_violation");
    cr_assert_str_eq(err.param, "logit_bias");
    cr_assert(strstr(err.message, "logit_bias"));
    /* an escaped spelling is the same key */
    cr_assert_eq(run(&t, BASE ",\"\\u006cogprobs\":true}"), -1);
    cr_assert_str_eq(err.code, "policy_violation");
    cr_assert_str_eq(err.param, "logprobs");
    /* only top-level keys */
    cr_assert_eq(run(&t, BASE ",\"extra\":{\"logit_bias\":1}}"), 0);
    /* a null value is still the key being present */
    cr_assert_eq(run(&t, BASE ",\"logit_bias\":null}"), -1);
}

Test(rules, allow_params_is_an_allowlist)
{
    cfg_tenant_t t = tenant("t");
    r_force(&t, CFG_PARAM_SEED, 7);
    char *allow[] = {"model", "prompt", "max_tokens", "temperature"};
    t.allow_params = allow;
    t.nallow_params = 4;
    cr_assert_eq(run(&t, "{\"model\":\"m\",\"prompt\":\"x\",\"temperature\":0.1}"), 0, "%s",
                 err.message);
    /* a forced seed is added by the policy, not by the client: allowed */
    cr_assert_eq(run(&t, "{\"model\":\"m\",\"prompt\":\"x\"}"), 0, "%s", err.message);
    static const char *const refused[][2] = {
        {"{\"model\":\"m\",\"prompt\":\"x\",\"min_p\":0.5}", "min_p"},
        {"{\"model\":\"m\",\"prompt\":\"x\",\"best_of\":4}", "best_of"},
        {"{\"model\":\"m\",\"prompt\":\"x\",\"seed\":3}", "seed"},
        {"{\"model\":\"m\",\"prompt\":\"x\",\"sampling_params\":{}}", "sampling_params"},
        {"{\"model\":\"m\",\"prompt\":\"x\",\"\\u006din_p\":0.5}", "min_p"}, /* escaped */
        {"{\"model\":\"m\",\"prompt\":\"x\",\"Temperature\":2}", "Temperature"},
        /* a NUL in the key is shown, not where the name ends: "model\0" is not "model" */
        {"{\"model\":\"m\",\"model\\u0000\":\"m\",\"prompt\":\"x\"}", "model\\u0000"},
        {"{\"model\":\"m\",\"prompt\":\"x\",\"logit\\u0000bias\":{}}", "logit\\u0000bias"},
    };
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        cr_assert_eq(run(&t, refused[i][0]), -1, "case %zu", i);
        cr_assert_eq(err.status, 400);
        cr_assert_str_eq(err.code, "policy_violation");
        cr_assert_str_eq(err.param, refused[i][1]);
        cr_assert(strstr(err.message, refused[i][1]) && strstr(err.message, "allow_params"));
    }
}

Test(rules, types_before_rules)
{
    cfg_tenant_t t = tenant("t");
    r_force(&t, CFG_PARAM_TEMPERATURE, 0);
    cr_assert_eq(run(&t, body_with("temperature", "\"hot\"")), -1);
    cr_assert_str_eq(err.param, "temperature");
}

Test(rules, max_tokens_aliases)
{
    cfg_tenant_t t = tenant("t");
    r_max(&t, CFG_PARAM_MAX_TOKENS, 512);
    cr_assert_eq(run(&t, BASE ",\"max_completion_tokens\":100000,\"n_predict\":4096}"), 0);
    expect_body(BASE ",\"max_completion_tokens\":512,\"n_predict\":512}");
    cr_assert_not_null(change_for("max_completion_tokens", POLICY_CLAMPED));
    cr_assert_not_null(change_for("n_predict", POLICY_CLAMPED));
    /* defaults never add an alias */
    t = tenant("t");
    r_default(&t, CFG_PARAM_MAX_TOKENS, 64);
    cr_assert_eq(run(&t, BASE "}"), 0);
    expect_body(BASE ",\"max_tokens\":64}");
    cr_assert_eq(run(&t, BASE ",\"max_completion_tokens\":\"x\"}"), -1);
    cr_assert_str_eq(err.param, "max_completion_tokens");
}

Test(rules, compliance_tenant_from_the_demo)
{
    /* The bank tenant of docs/policy.md §5: temperature 0.9 arrives as 0, with seed 1234. */
    cfg_tenant_t t = tenant("bank");
    r_force(&t, CFG_PARAM_TEMPERATURE, 0);
    r_force(&t, CFG_PARAM_TOP_P, 1);
    r_force(&t, CFG_PARAM_SEED, 1234);
    const char *b = "{\n  \"model\": \"m\",\n  \"messages\": [{\"role\": \"user\", \"content\": "
                    "\"hi\"}],\n  \"temperature\": 0.9,\n  \"stream\": true\n}";
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_CHAT, b, NULL), 0, "%s", err.message);
    /* The client's bytes stay as sent (whitespace too); the new values are spliced in. */
    expect_body(
        "{\n  \"model\": \"m\",\n  \"messages\": [{\"role\": \"user\", \"content\": "
        "\"hi\"}],\n  \"temperature\": 0,\n  \"stream\": true,\"top_p\":1,\"seed\":1234\n}");
    cr_assert(res.has_seed);
    cr_assert_eq(res.seed, 1234);
    cr_assert_not(res.seed_derived);
    cr_assert(res.has_temperature);
    cr_assert_eq(res.temperature, 0);
    cr_assert(res.comparable);
    cr_assert(res.stream);
    cr_assert_str_eq(res.model.base, "m");
    cr_assert_eq(res.nchanges, 3);
    const policy_change_t *c = change_for("temperature", POLICY_FORCED);
    cr_assert_not_null(c);
    cr_assert_str_eq(c->before, "0.9");
    cr_assert_str_eq(c->after, "0");
}

Test(rules, unchanged_body_is_the_clients_bytes)
{
    cfg_tenant_t t = tenant("t");
    const char *b = "{ \"model\" : \"m\",  \"prompt\": \"p\", \"temperature\": 0.5 }";
    cr_assert_eq(run(&t, b), 0);
    cr_assert_eq(policy_body(req, &res).base, b);
    cr_assert_eq(policy_body(req, &res).len, strlen(b));
    cr_assert_not(res.rewritten);
    cr_assert_not(res.comparable);
    cr_assert(res.has_temperature);
}

Test(rules, rewrite_keeps_untouched_values_verbatim)
{
    cfg_tenant_t t = tenant("t");
    r_force(&t, CFG_PARAM_TEMPERATURE, 0);
    const char *b = "{\"model\":\"m\", \"prompt\":[1, 2, 3],\"x\":1.50E+3,\"big\":"
                    "123456789012345678901234567890, \"s\":\"a\\u00e9\\n\\/\",\"temperature\":1}";
    cr_assert_eq(run(&t, b), 0);
    expect_body("{\"model\":\"m\", \"prompt\":[1, 2, 3],\"x\":1.50E+3,\"big\":"
                "123456789012345678901234567890, \"s\":\"a\\u00e9\\n\\/\",\"temperature\":0}");
}

/* ---- shapes --------------------------------------------------------------------------------- */

Test(rules, prompt_shapes)
{
    cfg_tenant_t t = tenant("t");
    const char *ok[] = {
        "{\"model\":\"m\",\"prompt\":\"text\"}",      "{\"model\":\"m\",\"prompt\":\"\"}",
        "{\"model\":\"m\",\"prompt\":[\"a\",\"b\"]}", "{\"model\":\"m\",\"prompt\":[1,2,3]}",
        "{\"model\":\"m\",\"prompt\":[[1,2],[3]]}",
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++)
        cr_assert_eq(run(&t, ok[i]), 0, "%s: %s", ok[i], err.message);
    const char *bad[] = {
        "{\"model\":\"m\"}",
        "{\"model\":\"m\",\"prompt\":null}",
        "{\"model\":\"m\",\"prompt\":5}",
        "{\"model\":\"m\",\"prompt\":[]}",
        "{\"model\":\"m\",\"prompt\":[\"a\",1]}",
        "{\"model\":\"m\",\"prompt\":[1,-2]}",
        "{\"model\":\"m\",\"prompt\":[1,2.5]}",
        "{\"model\":\"m\",\"prompt\":[[1],[]]}",
        "{\"model\":\"m\",\"prompt\":[[1],\"a\"]}",
        "{\"model\":\"m\",\"prompt\":[[\"a\"]]}",
        "{\"model\":\"m\",\"prompt\":[{\"t\":1}]}",
        "{\"model\":\"m\",\"prompt\":{\"text\":\"a\"}}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(run(&t, bad[i]), -1, "%s accepted", bad[i]);
        cr_assert_eq(err.status, 400);
        cr_assert_str_eq(err.param, "prompt", "%s", bad[i]);
    }
}

Test(rules, chat_message_shapes)
{
    cfg_tenant_t t = tenant("t");
    const char *ok[] = {
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}",
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
        "\"text\":\"hi\"},{\"type\":\"image_url\",\"image_url\":{\"url\":\"data:x\"}}]}]}",
        "{\"model\":\"m\",\"messages\":[{\"role\":\"system\",\"content\":\"s\"},{\"role\":"
        "\"assistant\",\"content\":null,\"tool_calls\":[]},{\"role\":\"assistant\"},{\"role\":"
        "\"tool\",\"content\":\"r\",\"tool_call_id\":\"1\"}]}",
        "{\"model\":\"m\",\"messages\":[{\"role\":\"\\u0061ssistant\",\"content\":null}]}",
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++)
        cr_assert_eq(run_fw(&t, POLICY_ROUTE_CHAT, ok[i], NULL), 0, "%s: %s", ok[i], err.message);
    static const struct {
        const char *body, *param;
    } bad[] = {
        {"{\"model\":\"m\"}", "messages"},
        {"{\"model\":\"m\",\"messages\":[]}", "messages"},
        {"{\"model\":\"m\",\"messages\":\"hi\"}", "messages"},
        {"{\"model\":\"m\",\"messages\":[\"hi\"]}", "messages[0]"},
        {"{\"model\":\"m\",\"messages\":[{\"content\":\"hi\"}]}", "messages[0].role"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":1,\"content\":\"hi\"}]}", "messages[0].role"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"a\"},{\"role\":"
         "\"user\"}]}",
         "messages[1].content"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":null}]}",
         "messages[0].content"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":5}]}",
         "messages[0].content"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
         "\"text\":\"a\"},{\"text\":\"b\"}]}]}",
         "messages[0].content[1].type"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[\"a\"]}]}",
         "messages[0].content[0].type"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
         "\"text\":7}]}]}",
         "messages[0].content[0].text"},
        {"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}",
         "messages[0].content[0].text"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cr_assert_eq(run_fw(&t, POLICY_ROUTE_CHAT, bad[i].body, NULL), -1, "%s accepted",
                     bad[i].body);
        cr_assert_eq(err.status, 400);
        cr_assert_str_eq(err.code, "invalid_value");
        cr_assert_str_eq(err.param, bad[i].param, "%s", bad[i].body);
    }
}

/* ---- derive --------------------------------------------------------------------------------- */

static cfg_tenant_t deriving(const char *name)
{
    cfg_tenant_t t = tenant(name);
    t.rules[CFG_PARAM_SEED].derive = true;
    return t;
}

#define CHAT_HI "\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]"

static uint64_t derived(const cfg_tenant_t *t, const char *body)
{
    cr_assert_eq(run_fw(t, POLICY_ROUTE_CHAT, body, NULL), 0, "%s", err.message);
    cr_assert(res.has_seed);
    cr_assert(res.seed_derived);
    cr_assert(res.comparable);
    const policy_change_t *c = change_for("seed", POLICY_DERIVED);
    cr_assert_not_null(c);
    cr_assert(strcmp(c->before, "") == 0 || strcmp(c->before, "null") == 0, "%s", c->before);
    return res.seed;
}

Test(rules, derive_known_answer)
{
    /* python3: h = sha256(b'default\n' + json.dumps(body, sort_keys=True,
     *   separators=(',', ':')).encode()); int.from_bytes(h[:8], 'big') % 2**31 */
    cfg_tenant_t t = deriving("default");
    const char *b = "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.5}";
    cr_assert_eq(derived(&t, b), 1173673760u);
    expect_body("{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.5,\"seed\":1173673760}");
    cr_assert_eq(run(&t, "{\"model\":\"llama\",\"prompt\":\"Count: one, two,\",\"max_tokens\":16}"),
                 0);
    cr_assert_eq(res.seed, 916057937u);
}

/* Strings around the canonical form's stage sizes: short runs copied into the stage, long ones
 * hashed where they lie, one after the other in order (1023 and 1024 bytes straddle the run
 * hashed in place; 9000 is more than a whole stage). */
Test(rules, derive_known_answer_long_strings)
{
    /* python3: the same formula as above over these five contents */
    static const struct {
        size_t n;
        char c;
    } parts[] = {{1023, 'a'}, {1024, 'b'}, {5000, 'c'}, {9000, 'd'}, {1, 'x'}};
    static const char *roles[] = {"user", "assistant", "user", "user", "user"};
    dp_buf_t b = {0};
    dp_buf_appends(&b, "{\"model\":\"m\",\"messages\":[");
    for (size_t i = 0; i < 5; i++) {
        dp_buf_printf(&b, "%s{\"role\":\"%s\",\"content\":\"", i ? "," : "", roles[i]);
        for (size_t k = 0; k < parts[i].n; k++)
            dp_buf_appendc(&b, parts[i].c);
        dp_buf_appends(&b, "\"}");
    }
    dp_buf_appends(&b, "],\"temperature\":0.5}");
    cfg_tenant_t t = deriving("default");
    cr_assert_eq(derived(&t, b.base), 751461751u);
    dp_buf_free(&b);
}

/* A stream's request is trimmed once it is policed: what is read after it (the body sent, the
 * model, the result) stays, the parse is gone, and the next request parses as if fresh. */
Test(rules, a_trimmed_request_keeps_its_body_model_and_result)
{
    cfg_tenant_t t = deriving("default");
    const char *b = "{\"model\":\"\\u006d\"," CHAT_HI ",\"temperature\":0.5}";
    cr_assert_eq(derived(&t, b), 1173673760u);
    policy_req_trim(req);
    policy_req_trim(req); /* idempotent */
    expect_body("{\"model\":\"\\u006d\"," CHAT_HI ",\"temperature\":0.5,\"seed\":1173673760}");
    dp_iovec_t m = policy_model(req);
    cr_assert(m.len == 1 && m.base[0] == 'm' && m.base[1] == '\0');
    policy_req_reset(req);
    cr_assert_eq(derived(&t, "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.5}"), 1173673760u);
}

Test(rules, derive_ignores_key_order_whitespace_spelling)
{
    cfg_tenant_t t = deriving("default");
    const char *same[] = {
        "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.5}",
        "{ \"temperature\" : 5e-1 ,\n \"messages\" : [ { \"content\" : \"hi\" , \"role\" : "
        "\"user\" } ] , \"model\" : \"m\" }",
        "{\"\\u006dodel\":\"\\u006d\",\"temperature\":0.50," CHAT_HI "}",
        /* seed, stream, stream_options and user are not part of the canonical request */
        "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.5,\"stream\":true,\"user\":\"u1\","
        "\"stream_options\":{\"include_usage\":true},\"seed\":null}",
    };
    for (size_t i = 0; i < sizeof(same) / sizeof(same[0]); i++)
        cr_assert_eq(derived(&t, same[i]), 1173673760u, "case %zu", i);
}

Test(rules, derive_differs_by_prompt_and_tenant)
{
    cfg_tenant_t t = deriving("default");
    uint64_t a = derived(&t, "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.5}");
    uint64_t b = derived(&t, "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":"
                             "\"hi!\"}],\"temperature\":0.5}");
    uint64_t c = derived(&t, "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.6}");
    cr_assert_neq(a, b);
    cr_assert_neq(a, c);
    cfg_tenant_t o = deriving("other");
    cr_assert_eq(derived(&o, "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.5}"), 293786043u);
    cr_assert(a < 2147483648u && b < 2147483648u);
}

Test(rules, derive_sees_post_policy_values)
{
    /* temperature absent, defaulted to 0.7: the canonical request carries 0.7. */
    cfg_tenant_t t = deriving("default");
    r_default(&t, CFG_PARAM_TEMPERATURE, 0.7);
    cr_assert_eq(derived(&t, "{\"model\":\"m\"," CHAT_HI "}"), 871702383u);
    /* so does a client that sent 0.7 itself, and one whose 0.9 is clamped down to 0.7 */
    cr_assert_eq(derived(&t, "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.7}"), 871702383u);
    r_max(&t, CFG_PARAM_TEMPERATURE, 0.7);
    cr_assert_eq(derived(&t, "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.9}"), 871702383u);
}

Test(rules, derive_keeps_a_client_seed)
{
    cfg_tenant_t t = deriving("default");
    const char *b = "{\"model\":\"m\"," CHAT_HI ",\"seed\":99}";
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_CHAT, b, NULL), 0);
    cr_assert(res.has_seed);
    cr_assert_eq(res.seed, 99);
    cr_assert_not(res.seed_derived);
    expect_untouched(b, "client seed");
}

Test(rules, derive_independent_of_framework)
{
    cfg_tenant_t t = deriving("default");
    r_force(&t, CFG_PARAM_TEMPERATURE, 0.5);
    const char *fws[] = {NULL, "vllm", "tgi", "sglang", "llamacpp"};
    for (size_t i = 0; i < 5; i++) {
        cr_assert_eq(run_fw(&t, POLICY_ROUTE_CHAT, "{\"model\":\"m\"," CHAT_HI "}", fws[i]), 0);
        cr_assert_eq(res.seed, 1173673760u, "%s", fws[i] ? fws[i] : "none");
    }
}

/* ---- framework normalisation ---------------------------------------------------------------- */

Test(rules, no_framework_no_normalisation)
{
    cfg_tenant_t t = tenant("t");
    r_max(&t, CFG_PARAM_TEMPERATURE, 1);
    const char *b = BASE "}";
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS, b, NULL), 0);
    expect_untouched(b, "NULL framework");
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS, b, "some-new-server"), 0);
    expect_untouched(b, "unknown framework");
}

Test(rules, vllm_pins_generation_config_fields)
{
    cfg_tenant_t t = tenant("t");
    r_force(&t, CFG_PARAM_TEMPERATURE, 0);
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS, BASE "}", "vllm"), 0);
    expect_body(BASE ",\"temperature\":0,\"top_p\":1,\"top_k\":-1,\"min_p\":0,"
                     "\"repetition_penalty\":1}");
    cr_assert_not_null(change_for("temperature", POLICY_FORCED));
    cr_assert_not_null(change_for("min_p", POLICY_NORMALIZED));
    /* client values are kept */
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS,
                        BASE ",\"top_p\":0.9,\"top_k\":20,\"min_p\":0.1,\"repetition_penalty\":1.1,"
                             "\"temperature\":0}",
                        "VLLM"),
                 0);
    cr_assert_not(res.rewritten);
    /* governed-but-absent values become explicit, inside the rule's bounds */
    t = tenant("t");
    r_max(&t, CFG_PARAM_TEMPERATURE, 0.8);
    r_max(&t, CFG_PARAM_MAX_TOKENS, 256);
    r_min(&t, CFG_PARAM_N, 1);
    r_max(&t, CFG_PARAM_FREQUENCY_PENALTY, 1);
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS, BASE "}", "vllm"), 0);
    expect_body(BASE ",\"temperature\":0.8,\"top_p\":1,\"top_k\":-1,\"max_tokens\":256,\"n\":1,"
                     "\"frequency_penalty\":0,\"min_p\":0,\"repetition_penalty\":1}");
}

/* /v1/responses has no n: a governed n is not filled in there (the length is, as
 * max_output_tokens), and an n the client sends anyway is still ruled. */
Test(rules, responses_gets_no_n_filled_in)
{
    cfg_tenant_t t = tenant("t");
    r_max(&t, CFG_PARAM_N, 1);
    r_max(&t, CFG_PARAM_MAX_TOKENS, 16);
    const char *b = "{\"model\":\"m\",\"input\":\"hi\"}";
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_RESPONSES, b, "vllm"), 0, "%s", err.message);
    expect_body("{\"model\":\"m\",\"input\":\"hi\",\"max_output_tokens\":16}");
    cr_assert_null(change_for("n", POLICY_NORMALIZED));
    cr_assert_eq(
        run_fw(&t, POLICY_ROUTE_RESPONSES, "{\"model\":\"m\",\"input\":\"hi\",\"n\":3}", "vllm"),
        0);
    expect_body("{\"model\":\"m\",\"input\":\"hi\",\"n\":1,\"max_output_tokens\":16}");
    cr_assert_not_null(change_for("n", POLICY_CLAMPED));
}

Test(rules, sglang_like_vllm)
{
    cfg_tenant_t t = tenant("t");
    r_force(&t, CFG_PARAM_TOP_K, 1);
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS, BASE "}", "sglang"), 0);
    expect_body(BASE ",\"temperature\":1,\"top_p\":1,\"top_k\":1,\"min_p\":0,"
                     "\"repetition_penalty\":1}");
}

Test(rules, llamacpp_pins_server_defaults_and_seed_range)
{
    cfg_tenant_t t = tenant("t");
    r_force(&t, CFG_PARAM_TEMPERATURE, 0.5);
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS, BASE ",\"seed\":1099511627776}", "llamacpp"),
                 0);
    /* 2^40 mod (2^32 - 1) = 256: llama.cpp seeds are uint32 and 0xFFFFFFFF means random */
    expect_body(BASE ",\"seed\":256,\"temperature\":0.5,\"top_p\":1,\"top_k\":0,\"min_p\":0,"
                     "\"repeat_penalty\":1}");
    const policy_change_t *c = change_for("seed", POLICY_NORMALIZED);
    cr_assert_not_null(c);
    cr_assert_str_eq(c->before, "1099511627776");
    cr_assert_eq(res.seed, 256);
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS, BASE ",\"seed\":4294967295}", "llama.cpp"),
                 0);
    cr_assert_eq(res.seed, 0);
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_COMPLETIONS, BASE ",\"seed\":4294967294}", "llamacpp"), 0);
    cr_assert_eq(res.seed, 4294967294u);
}

Test(rules, tgi_quirks)
{
    /* bank tenant on TGI: top_p 1 is dropped (TGI refuses 1.0; absent means 1.0) */
    cfg_tenant_t t = tenant("bank");
    r_force(&t, CFG_PARAM_TEMPERATURE, 0);
    r_force(&t, CFG_PARAM_TOP_P, 1);
    r_force(&t, CFG_PARAM_SEED, 1234);
    cr_assert_eq(run_fw(&t, POLICY_ROUTE_CHAT,
                        "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0.9,\"top_p\":0.5}", "tgi"),
                 0);
    expect_body("{\"model\":\"m\"," CHAT_HI ",\"temperature\":0,\"seed\":1234}");
    cr_assert_not_null(change_for("top_p", POLICY_FORCED));
    const policy_change_t *c = change_for("top_p", POLICY_NORMALIZED);
    cr_assert_not_null(c);
    cr_assert_str_eq(c->before, "1");
    cr_assert_str_eq(c->after, "");
    /* an omitted temperature is made explicit, even without a rule */
    cfg_tenant_t d = tenant("default");
    cr_assert_eq(run_fw(&d, POLICY_ROUTE_CHAT, "{\"model\":\"m\"," CHAT_HI "}", "tgi"), 0);
    expect_body("{\"model\":\"m\"," CHAT_HI ",\"temperature\":1}");
    cr_assert_not(res.comparable);
    /* presence_penalty 0 is not neutral on TGI (it becomes repetition_penalty 2): dropped */
    cr_assert_eq(run_fw(&d, POLICY_ROUTE_CHAT,
                        "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0,\"presence_penalty\":0}",
                        "text-generation-inference"),
                 0);
    expect_body("{\"model\":\"m\"," CHAT_HI ",\"temperature\":0}");
    cr_assert(res.comparable);
    /* a governed top_k cannot be honoured: removed so the audit does not claim it was sent */
    cfg_tenant_t k = tenant("k");
    r_force(&k, CFG_PARAM_TOP_K, 1);
    cr_assert_eq(
        run_fw(&k, POLICY_ROUTE_CHAT, "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0}", "tgi"), 0);
    expect_body("{\"model\":\"m\"," CHAT_HI ",\"temperature\":0}");
    cr_assert_not_null(change_for("top_k", POLICY_FORCED));
    cr_assert_not_null(change_for("top_k", POLICY_NORMALIZED));
    /* governed top_p clamped below 1 is sent */
    cfg_tenant_t p = tenant("p");
    r_max(&p, CFG_PARAM_TOP_P, 0.9);
    cr_assert_eq(
        run_fw(&p, POLICY_ROUTE_CHAT, "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0}", "tgi"), 0);
    expect_body("{\"model\":\"m\"," CHAT_HI ",\"temperature\":0,\"top_p\":0.9}");
}

Test(rules, apply_again_for_another_framework)
{
    cfg_tenant_t t = tenant("t");
    r_force(&t, CFG_PARAM_TOP_P, 1);
    const char *b = "{\"model\":\"m\"," CHAT_HI ",\"temperature\":0}";
    memset(&err, 0, sizeof(err));
    cr_assert_eq(policy_parse(req, POLICY_ROUTE_CHAT, b, strlen(b), &err), 0);
    cr_assert_eq(policy_apply(req, &t, "tgi", &res, &err), 0);
    expect_body("{\"model\":\"m\"," CHAT_HI ",\"temperature\":0}");
    cr_assert_eq(policy_apply(req, &t, NULL, &res, &err), 0);
    expect_body("{\"model\":\"m\"," CHAT_HI ",\"temperature\":0,\"top_p\":1}");
}

Test(rules, error_json_shape)
{
    cfg_tenant_t t = tenant("t");
    cr_assert_eq(run(&t, body_with("temperature", "\"hot\"")), -1);
    dp_buf_t out = {0};
    policy_error_json(&err, &out);
    cr_assert_str_eq(out.base, "{\"error\":{\"message\":\"temperature must be a number\","
                               "\"type\":\"invalid_request_error\",\"param\":\"temperature\","
                               "\"code\":\"invalid_value\"}}");
    dp_buf_free(&out);
}

/* docs/configuration.md "Candidates": a candidate pool serving another model name gets the
 * baseline's body with only `model` changed; a seed above 2^53 and the members' order survive byte
 * for byte. */
Test(replace_model, keeps_every_other_byte)
{
    const char *in = "{\"seed\":9007199254740993,\"model\":\"m\\u0031\",\"prompt\":\"a\\\"b\"}";
    dp_buf_t out = {0};
    cr_assert_eq(policy_replace_model(in, strlen(in), "next/\"q\"", &out), 0);
    cr_assert_eq(out.len, strlen("{\"seed\":9007199254740993,\"model\":\"next/\\\"q\\\"\","
                                 "\"prompt\":\"a\\\"b\"}"));
    cr_assert(
        memcmp(out.base,
               "{\"seed\":9007199254740993,\"model\":\"next/\\\"q\\\"\",\"prompt\":\"a\\\"b\"}",
               out.len) == 0,
        "%.*s", (int)out.len, out.base);
    dp_buf_free(&out);
    cr_assert_eq(policy_replace_model("{\"prompt\":\"x\"}", 14, "m", &out), -1);
    cr_assert_eq(policy_replace_model("[1]", 3, "m", &out), -1);
    cr_assert_eq(policy_replace_model("{\"model\":", 9, "m", &out), -1);
    cr_assert_eq(out.len, 0);
    /* A nested "model" is not the request's. */
    const char *nested = "{\"metadata\":{\"model\":\"x\"},\"model\":\"y\"}";
    cr_assert_eq(policy_replace_model(nested, strlen(nested), "z", &out), 0);
    cr_assert(memcmp(out.base, "{\"metadata\":{\"model\":\"x\"},\"model\":\"z\"}", out.len) == 0);
    dp_buf_free(&out);
}
