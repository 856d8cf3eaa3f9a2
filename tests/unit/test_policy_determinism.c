/* Deterministic pools (docs/configuration.md "Deterministic pools"), the policy side: cache_prompt
 * false on single_sequence llama.cpp pools, and require_determinism choosing the pool. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <string.h>

#include "policy/policy.h"

static const char CONFIG[] =
    "{\"listen\":\"127.0.0.1:0\",\"admin_listen\":\"127.0.0.1:0\",\"pools\":["
    "{\"name\":\"fast\",\"models\":[\"m\",\"other\"],\"replicas\":[{\"name\":\"a\","
    "\"url\":\"http://127.0.0.1:1\"}]},"
    "{\"name\":\"seq\",\"models\":[\"m\"],\"max_inflight_per_replica\":8,\"manifest\":{\"model\":"
    "\"m\",\"framework\":{\"name\":\"llamacpp\"},\"determinism\":{\"mode\":\"single_sequence\"}},"
    "\"replicas\":[{\"name\":\"b\",\"url\":\"http://127.0.0.1:2\"}]}],"
    "\"policy\":{\"tenants\":[{\"name\":\"strict\",\"match\":{\"header\":{\"name\":\"x-t\","
    "\"value\":\"s\"}},\"require_determinism\":\"single_sequence\"},"
    "{\"name\":\"default\",\"match\":{\"any\":true}}]}}";

static cfg_t *cfg;
static cfg_errors_t errs;
static policy_req_t *req;

static void setup(void)
{
    memset(&errs, 0, sizeof(errs));
    cr_assert_eq(cfg_load_string(CONFIG, sizeof(CONFIG) - 1, "/", &cfg, &errs), 0, "%s",
                 errs.count ? errs.items[0] : "");
    req = policy_req_new();
}

static void teardown(void)
{
    policy_req_free(req);
    cfg_free(cfg);
    cfg_errors_free(&errs);
}

TestSuite(determinism_policy, .init = setup, .fini = teardown);

static int decide(int tenant, const char *body, const cfg_pool_t **pool, policy_result_t *res,
                  policy_error_t *err)
{
    return policy_decide(cfg, &cfg->policy->tenants[tenant], req, POLICY_ROUTE_COMPLETIONS, body,
                         strlen(body), pool, res, err);
}

Test(determinism_policy, single_sequence_pool_is_one_in_flight_and_check_warns)
{
    const cfg_pool_t *seq = cfg_pool_by_name(cfg, "seq");
    cr_assert_eq(seq->max_inflight_per_replica, 1);
    cr_assert_eq(cfg_pool_by_name(cfg, "fast")->max_inflight_per_replica, 0);
    cr_assert_eq(errs.nwarnings, 1);
    cr_assert_str_eq(errs.warnings[0],
                     "pools[1].max_inflight_per_replica: 8 is overridden: the manifest's "
                     "determinism.mode \"single_sequence\" allows one request in flight per "
                     "replica (effective value 1)");
}

Test(determinism_policy, tenants_route_by_mode)
{
    const cfg_pool_t *pool;
    policy_result_t res;
    policy_error_t err;
    cr_assert_eq(decide(1, "{\"model\":\"m\",\"prompt\":\"x\"}", &pool, &res, &err), 0);
    cr_assert_str_eq(pool->name, "fast");
    cr_assert_not(res.rewritten, "no cache_prompt on the plain pool");
    policy_req_reset(req);
    cr_assert_eq(decide(0, "{\"model\":\"m\",\"prompt\":\"x\"}", &pool, &res, &err), 0);
    cr_assert_str_eq(pool->name, "seq");
    policy_req_reset(req);
    cr_assert_eq(decide(0, "{\"model\":\"other\",\"prompt\":\"x\"}", &pool, &res, &err), -1);
    cr_assert_eq(err.status, 404);
    cr_assert_str_eq(err.code, "determinism_unavailable");
    cr_assert_str_eq(err.param, "model");
    cr_assert_str_eq(err.message, "this tenant requires determinism single_sequence and no pool "
                                  "with that determinism.mode serves this model");
    policy_req_reset(req);
    cr_assert_eq(decide(0, "{\"model\":\"nope\",\"prompt\":\"x\"}", &pool, &res, &err), -1);
    cr_assert_str_eq(err.code, "model_not_found");
}

static void forwarded(const char *body, const char *want, const char *before)
{
    const cfg_pool_t *pool;
    policy_result_t res;
    policy_error_t err;
    policy_req_reset(req);
    cr_assert_eq(decide(0, body, &pool, &res, &err), 0, "%s", err.message);
    cr_assert_eq((int)policy_body(req, &res).len, (int)strlen(want), "%.*s",
                 (int)policy_body(req, &res).len, policy_body(req, &res).base);
    cr_assert(memcmp(policy_body(req, &res).base, want, policy_body(req, &res).len) == 0, "%.*s",
              (int)policy_body(req, &res).len, policy_body(req, &res).base);
    if (before == NULL) {
        cr_assert_eq(res.nchanges, 0);
        return;
    }
    cr_assert_eq(res.nchanges, 1);
    cr_assert_str_eq(res.changes[0].param, "cache_prompt");
    cr_assert_eq(res.changes[0].action, POLICY_NORMALIZED);
    cr_assert_str_eq(res.changes[0].before, before);
    cr_assert_str_eq(res.changes[0].after, "false");
}

Test(determinism_policy, llamacpp_single_sequence_forwards_cache_prompt_false)
{
    forwarded("{\"model\":\"m\",\"prompt\":\"x\"}",
              "{\"model\":\"m\",\"prompt\":\"x\",\"cache_prompt\":false}", "");
    forwarded("{\"model\":\"m\", \"cache_prompt\": true, \"prompt\":\"x\"}",
              "{\"model\":\"m\", \"cache_prompt\": false, \"prompt\":\"x\"}", "true");
    forwarded("{\"model\":\"m\",\"cache_prompt\":null,\"prompt\":\"x\"}",
              "{\"model\":\"m\",\"cache_prompt\":false,\"prompt\":\"x\"}", "null");
    forwarded("{\"model\":\"m\",\"cache_prompt\":\"yes\",\"prompt\":\"x\"}",
              "{\"model\":\"m\",\"cache_prompt\":false,\"prompt\":\"x\"}", "\"yes\"");
    /* The client's value as it wrote it, on one line (the audit line holds it): the whitespace
     * between its tokens goes, a string's own bytes stay. */
    forwarded("{\"model\":\"m\",\"cache_prompt\":[\n1 ,\r\n\t\"a \\\" b\\\\\" ],\"prompt\":\"x\"}",
              "{\"model\":\"m\",\"cache_prompt\":false,\"prompt\":\"x\"}", "[1,\"a \\\" b\\\\\"]");
    forwarded("{\"model\":\"m\",\"cache_prompt\":{ \"k\" :\n \"v\\n\" },\"prompt\":\"x\"}",
              "{\"model\":\"m\",\"cache_prompt\":false,\"prompt\":\"x\"}", "{\"k\":\"v\\n\"}");
    /* Already false: the client's own bytes go, untouched. */
    forwarded("{\"model\":\"m\", \"cache_prompt\":false, \"prompt\":\"x\"}",
              "{\"model\":\"m\", \"cache_prompt\":false, \"prompt\":\"x\"}", NULL);
}

Test(determinism_policy, policy_apply_itself_never_touches_cache_prompt)
{
    policy_result_t res;
    policy_error_t err;
    static const char body[] = "{\"model\":\"m\",\"cache_prompt\":true,\"prompt\":\"x\"}";
    cr_assert_eq(policy_parse(req, POLICY_ROUTE_COMPLETIONS, body, sizeof(body) - 1, &err), 0);
    cr_assert_eq(policy_apply(req, &cfg->policy->tenants[1], "llamacpp", &res, &err), 0);
    cr_assert_not(res.rewritten);
}

static void refused(const char *body, const char *param, const char *says)
{
    const cfg_pool_t *pool;
    policy_result_t res;
    policy_error_t err;
    policy_req_reset(req);
    cr_assert_eq(decide(0, body, &pool, &res, &err), -1, "%s", body);
    cr_assert_eq(err.status, 400);
    cr_assert_str_eq(err.code, "policy_violation");
    cr_assert_str_eq(err.param, param);
    cr_assert(strstr(err.message, says) && strstr(err.message, "single_sequence"), "%s",
              err.message);
}

/* A request for several completions is several sequences at once on the engine (llama.cpp runs
 * n or n_cmpl choices in as many slots together): a single_sequence pool refuses it, naming
 * the key, and takes one. */
Test(determinism_policy, single_sequence_refuses_several_sequences_at_once)
{
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"n\":3}", "n", "n 3 asks for 3 completions");
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"n_cmpl\":2}", "n_cmpl",
            "n_cmpl 2 asks for 2 completions");
    /* Only 1 is surely one: llama.cpp keeps the low 32 bits of a count (3 - 2^32 is 3). */
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"n\":-4294967293}", "n", "n must be 1");
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"n_cmpl\":0}", "n_cmpl", "n_cmpl must be 1");
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"best_of\":4}", "best_of", "best_of 4 may sample");
    /* What vLLM reads leniently as more than one is refused too. */
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"best_of\":\"3\"}", "best_of", "best_of \"3\"");
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"use_beam_search\":\"yes\"}", "use_beam_search",
            "beams at once");
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"use_beam_search\":1}", "use_beam_search",
            "beams at once");
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"best_of\":1.5}", "best_of", "best_of 1.5");
    refused("{\"model\":\"m\",\"prompt\":\"x\",\"use_beam_search\":true}", "use_beam_search",
            "beams at once");
    refused("{\"model\":\"m\",\"prompt\":[\"x\",\"y\"]}", "prompt", "prompt holds 2 prompts");
    refused("{\"model\":\"m\",\"prompt\":[[1,2],[3]]}", "prompt", "prompt holds 2 prompts");
    static const char *const one[] = {
        "{\"model\":\"m\",\"prompt\":\"x\",\"n\":1,\"n_cmpl\":1,\"best_of\":1,"
        "\"use_beam_search\":false,\"cache_prompt\":false}",
        "{\"model\":\"m\",\"prompt\":\"x\",\"n\":null,\"best_of\":null,\"use_beam_search\":null,"
        "\"cache_prompt\":false}",
        "{\"model\":\"m\",\"prompt\":[\"x\"],\"cache_prompt\":false}",
        "{\"model\":\"m\",\"prompt\":[1,2,3],\"cache_prompt\":false}",
        "{\"model\":\"m\",\"prompt\":[[1,2,3]],\"cache_prompt\":false}",
    };
    for (size_t i = 0; i < sizeof(one) / sizeof(one[0]); i++)
        forwarded(one[i], one[i], NULL);
}

/* Elsewhere they pass, and the result says so (no copy of them goes to a single_sequence
 * candidate pool). */
Test(determinism_policy, several_sequences_pass_on_other_pools_and_are_marked)
{
    const cfg_pool_t *pool;
    policy_result_t res;
    policy_error_t err;
    static const char body[] = "{\"model\":\"other\",\"prompt\":\"x\",\"n\":3}";
    cr_assert_eq(decide(1, body, &pool, &res, &err), 0, "%s", err.message);
    cr_assert_str_eq(pool->name, "fast");
    cr_assert(res.several_sequences);
    policy_req_reset(req);
    cr_assert_eq(decide(1, "{\"model\":\"other\",\"prompt\":\"x\",\"n\":1}", &pool, &res, &err), 0);
    cr_assert_not(res.several_sequences);
}

/* A fleet shares verdicts, not admission: check says a single_sequence pool's one sequence is
 * each member's own. */
Test(determinism_policy, single_sequence_in_a_fleet_warns_that_each_member_counts_alone)
{
    char text[sizeof(CONFIG) + 128];
    snprintf(text, sizeof(text),
             "%.*s,\"fleet\":{\"name\":\"f\",\"etcd\":{\"endpoints\":"
             "[\"http://127.0.0.1:2379\"]}}}",
             (int)(sizeof(CONFIG) - 2), CONFIG);
    cfg_t *fleet;
    cfg_errors_t e = {0};
    cr_assert_eq(cfg_load_string(text, strlen(text), "/", &fleet, &e), 0, "%s",
                 e.count ? e.items[0] : "");
    cr_assert_eq(e.nwarnings, 2);
    cr_assert(strncmp(e.warnings[1],
                      "pools[1].manifest.determinism.mode: single_sequence in a fleet: "
                      "members take turns on each engine through etcd",
                      110) == 0,
              "%s", e.warnings[1]);
    cfg_free(fleet);
    cfg_errors_free(&e);
}

/* Bodies no tenant policy shaped (the admin relay's, a pass-through path's) are held to the
 * same rule on a single_sequence pool, batches of embeddings inputs and rerank documents
 * included; what an engine could read as several (duplicate keys, a count that is not an
 * integer literal) is refused too. */
Test(determinism_policy, a_body_no_policy_shaped_is_held_to_one_sequence)
{
    static const struct {
        const char *body, *param;
    } refused_bodies[] = {
        {"{\"prompt\":\"x\",\"n\":3}", "n"},
        {"{\"prompt\":\"x\",\"n\":3.0}", "n"},
        {"{\"prompt\":\"x\",\"n_cmpl\":\"3\"}", "n_cmpl"},
        {"{\"prompt\":\"x\",\"n\":-4294967293}", "n"},
        {"{\"prompt\":[[1],[2]]}", "prompt"},
        {"{\"prompt\":[1,[2,3]]}", "prompt"},
        {"{\"prompt\":[1,\"a\"]}", "prompt"},
        {"{\"prompt\":\"x\",\"best_of\":2}", "best_of"},
        {"{\"prompt\":\"x\",\"use_beam_search\":true}", "use_beam_search"},
        {"{\"input\":[\"a\",\"b\"]}", "input"},
        {"{\"input\":[[1,2],[3]]}", "input"},
        {"{\"input\":[1,\"a\"]}", "input"},
        {"{\"inputs\":[\"a\",\"b\"]}", "inputs"},
        {"{\"content\":[\"a\",\"b\"]}", "content"},
        {"{\"query\":\"q\",\"documents\":[\"a\",\"b\"]}", "documents"},
        {"{\"query\":\"q\",\"documents\":[{\"text\":\"a\"},{\"text\":\"b\"}]}", "documents"},
        {"{\"query\":\"q\",\"texts\":[\"a\",\"b\"]}", "texts"},
        {"{\"text_1\":\"q\",\"text_2\":[\"a\",\"b\"]}", "text_2"},
        /* vLLM's multimodal score and rerank: the list under "content" */
        {"{\"text_1\":\"q\",\"text_2\":{\"content\":[{\"type\":\"text\",\"text\":\"a\"},{}]}}",
         "text_2"},
        {"{\"query\":\"q\",\"documents\":{\"content\":[{},{}]}}", "documents"},
        /* llama.cpp: each multimodal prompt object a prompt of its own */
        {"{\"content\":[{\"prompt_string\":\"a\"},{\"prompt_string\":\"b\"}]}", "content"},
        {"{\"input\":[{\"prompt_string\":\"a\"},{\"prompt_string\":\"b\"}]}", "input"},
        {"{\"prompt\":\"x\",\"n\":1,\"n\":3}", ""},
        {"[1]", ""},
    };
    policy_error_t err;
    for (size_t i = 0; i < sizeof(refused_bodies) / sizeof(refused_bodies[0]); i++) {
        const char *b = refused_bodies[i].body;
        cr_assert_eq(policy_one_sequence(req, b, strlen(b), false, &err), -1, "%s", b);
        cr_assert_eq(err.status, 400, "%s", b);
        cr_assert_str_eq(err.code,
                         refused_bodies[i].param[0] ? "policy_violation"
                         : b[0] == '['              ? "invalid_json"
                                                    : "duplicate_key",
                         "%s", b);
        cr_assert_str_eq(err.param, refused_bodies[i].param, "%s", b);
    }
    static const char *const one[] = {"{\"prompt\":\"x\"}",
                                      "{\"prompt\":[1,2],\"n\":1}",
                                      "{\"messages\":[],\"n\":null,\"best_of\":1}",
                                      "{\"input\":\"a\"}",
                                      "{\"input\":[\"a\"]}",
                                      "{\"input\":[1,2,3]}",
                                      "{\"content\":\"a b\"}",
                                      "{\"query\":\"q\",\"documents\":[\"a\"]}",
                                      "{\"query\":\"q\",\"documents\":{\"content\":[{}]}}"};
    for (size_t i = 0; i < sizeof(one) / sizeof(one[0]); i++)
        cr_assert_eq(policy_one_sequence(req, one[i], strlen(one[i]), false, &err), 0, "%s: %s",
                     one[i], err.message);
    /* /v1/responses: its input items are one conversation. */
    static const char items[] = "{\"input\":[{\"role\":\"user\",\"content\":\"x\"},"
                                "{\"role\":\"assistant\",\"content\":\"y\"}]}";
    cr_assert_eq(policy_one_sequence(req, items, strlen(items), true, &err), 0, "%s", err.message);
    cr_assert_eq(policy_one_sequence(req, items, strlen(items), false, &err), -1);
}
