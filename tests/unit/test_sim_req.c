/* detproxy-sim's request parsing: accepted shapes, defaults, and the 400s for bad input. */
#include <criterion/criterion.h>
#include <string.h>

#include "tests/sim/sim_req.h"

static int parse(sim_req_t *r, sim_api_t api, const char *body, sim_req_err_t *err)
{
    return sim_req_parse(r, api, body, strlen(body), err);
}

Test(sim_req, defaults)
{
    sim_req_t r;
    sim_req_err_t err;
    cr_assert_eq(parse(&r, SIM_API_COMPLETIONS, "{\"prompt\":\"hello world\"}", &err), 0);
    cr_assert_eq(r.nprompts, 1);
    cr_assert_eq(r.prompts[0].ntokens, 2);
    cr_assert_eq(r.n, 1);
    cr_assert_eq(r.max_tokens, SIM_REQ_DEFAULT_MAX_TOKENS);
    cr_assert_float_eq(r.temperature, 1.0, 1e-12);
    cr_assert_float_eq(r.top_p, 1.0, 1e-12);
    cr_assert_eq(r.top_k, -1);
    cr_assert(!r.has_seed && !r.stream && !r.include_usage && !r.top_p_given);
    cr_assert_null(r.model);
    sim_req_free(&r);
}

Test(sim_req, all_fields)
{
    sim_req_t r;
    sim_req_err_t err;
    const char *body = "{\"model\":\"m\",\"prompt\":\"x\",\"n\":3,\"max_tokens\":7,"
                       "\"temperature\":0,\"top_p\":0.9,\"top_k\":5,\"seed\":-42,"
                       "\"stream\":true,\"stream_options\":{\"include_usage\":true},"
                       "\"presence_penalty\":0.5,\"stop\":[\"\\n\"],\"user\":\"u\","
                       "\"logit_bias\":{},\"unknown_field\":[1,2]}";
    cr_assert_eq(parse(&r, SIM_API_COMPLETIONS, body, &err), 0, "%s", err.message);
    cr_assert_str_eq(r.model, "m");
    cr_assert_eq(r.n, 3);
    cr_assert_eq(r.max_tokens, 7);
    cr_assert_float_eq(r.temperature, 0, 1e-12);
    cr_assert_float_eq(r.top_p, 0.9, 1e-12);
    cr_assert(r.top_p_given);
    cr_assert_eq(r.top_k, 5);
    cr_assert(r.has_seed);
    cr_assert_eq(r.seed, -42);
    cr_assert(r.stream && r.include_usage);
    sim_req_free(&r);
}

Test(sim_req, prompt_shapes)
{
    sim_req_t r;
    sim_req_err_t err;
    cr_assert_eq(parse(&r, SIM_API_COMPLETIONS, "{\"prompt\":[\"a b\",\"c\"]}", &err), 0);
    cr_assert_eq(r.nprompts, 2);
    cr_assert_eq(r.prompts[0].ntokens, 2);
    cr_assert_eq(r.prompts[1].ntokens, 1);
    sim_req_free(&r);

    cr_assert_eq(parse(&r, SIM_API_COMPLETIONS, "{\"prompt\":[1,2,3]}", &err), 0);
    cr_assert_eq(r.nprompts, 1);
    cr_assert_eq(r.prompts[0].ntokens, 3);
    sim_req_free(&r);

    cr_assert_eq(parse(&r, SIM_API_COMPLETIONS, "{\"prompt\":[[1,2],[3]]}", &err), 0);
    cr_assert_eq(r.nprompts, 2);
    sim_req_free(&r);
}

Test(sim_req, chat_rendering)
{
    sim_req_t a, b, c;
    sim_req_err_t err;
    cr_assert_eq(parse(&a, SIM_API_CHAT,
                       "{\"messages\":[{\"role\":\"user\",\"content\":\"hello world\"}]}", &err),
                 0);
    /* Content parts' text is concatenated: same rendering as the plain string. */
    cr_assert_eq(parse(&b, SIM_API_CHAT,
                       "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\","
                       "\"text\":\"hello \"},{\"type\":\"image_url\",\"image_url\":{}},"
                       "{\"type\":\"text\",\"text\":\"world\"}]}]}",
                       &err),
                 0, "%s", err.message);
    cr_assert_eq(a.prompts[0].hash, b.prompts[0].hash);
    cr_assert_eq(parse(&c, SIM_API_CHAT,
                       "{\"messages\":[{\"role\":\"system\",\"content\":\"hello world\"}]}", &err),
                 0);
    cr_assert_neq(a.prompts[0].hash, c.prompts[0].hash, "the role is part of the prompt");
    sim_req_free(&a);
    sim_req_free(&b);
    sim_req_free(&c);

    cr_assert_eq(parse(&a, SIM_API_CHAT,
                       "{\"messages\":[{\"role\":\"assistant\",\"content\":null}],"
                       "\"max_completion_tokens\":4}",
                       &err),
                 0);
    cr_assert_eq(a.max_tokens, 4);
    sim_req_free(&a);
}

/* Each bad body gets -1 and names the offending parameter (NULL for the body itself). */
static const struct {
    sim_api_t api;
    const char *body;
    const char *param;
} bad_cases[] = {
    {SIM_API_COMPLETIONS, "", NULL},
    {SIM_API_COMPLETIONS, "{", NULL},
    {SIM_API_COMPLETIONS, "[]", NULL},
    {SIM_API_COMPLETIONS, "\"prompt\"", NULL},
    {SIM_API_COMPLETIONS, "{}", "prompt"},
    {SIM_API_COMPLETIONS, "{\"prompt\":5}", "prompt"},
    {SIM_API_COMPLETIONS, "{\"prompt\":[]}", "prompt"},
    {SIM_API_COMPLETIONS, "{\"prompt\":[1,-2]}", "prompt"},
    {SIM_API_COMPLETIONS, "{\"prompt\":[1.5]}", "prompt"},
    {SIM_API_COMPLETIONS, "{\"prompt\":[\"a\",{}]}", "prompt"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":\"hot\"}", "temperature"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"temperature\":-1}", "temperature"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":0}", "top_p"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"top_p\":1.5}", "top_p"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"top_k\":-5}", "top_k"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":1.5}", "seed"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":\"1\"}", "seed"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"seed\":1e19}", "seed"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"n\":0}", "n"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"n\":1000}", "n"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":0}", "max_tokens"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"max_tokens\":100000}", "max_tokens"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"stream\":\"yes\"}", "stream"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"stream_options\":{\"include_usage\":true}}",
     "stream_options"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"model\":7}", "model"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"presence_penalty\":3}", "presence_penalty"},
    {SIM_API_COMPLETIONS, "{\"prompt\":\"x\",\"stop\":5}", "stop"},
    {SIM_API_CHAT, "{}", "messages"},
    {SIM_API_CHAT, "{\"messages\":[]}", "messages"},
    {SIM_API_CHAT, "{\"messages\":[1]}", "messages"},
    {SIM_API_CHAT, "{\"messages\":[{\"content\":\"x\"}]}", "messages"},
    {SIM_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":5}]}", "messages"},
    {SIM_API_CHAT, "{\"messages\":[{\"role\":\"user\",\"content\":[{\"type\":\"text\"}]}]}",
     "messages"},
};

Test(sim_req, bad_input_is_refused)
{
    for (size_t i = 0; i < sizeof(bad_cases) / sizeof(bad_cases[0]); i++) {
        sim_req_t r;
        sim_req_err_t err;
        int rc = parse(&r, bad_cases[i].api, bad_cases[i].body, &err);
        cr_assert_eq(rc, -1, "case %zu (%s) accepted", i, bad_cases[i].body);
        cr_assert_neq(err.message[0], '\0');
        if (bad_cases[i].param)
            cr_assert_str_eq(err.param, bad_cases[i].param, "case %zu", i);
        else
            cr_assert_null(err.param, "case %zu", i);
        cr_assert_null(r.prompts);
        cr_assert_null(r.model);
    }
}

Test(sim_req, null_means_absent)
{
    sim_req_t r;
    sim_req_err_t err;
    cr_assert_eq(parse(&r, SIM_API_COMPLETIONS,
                       "{\"prompt\":\"x\",\"seed\":null,\"temperature\":null,\"max_tokens\":null,"
                       "\"stream_options\":null}",
                       &err),
                 0, "%s", err.message);
    cr_assert(!r.has_seed);
    cr_assert_eq(r.max_tokens, SIM_REQ_DEFAULT_MAX_TOKENS);
    sim_req_free(&r);
}

Test(sim_req, not_nul_terminated)
{
    const char body[] = "{\"prompt\":\"abc\"}XXXX";
    sim_req_t r;
    sim_req_err_t err;
    cr_assert_eq(sim_req_parse(&r, SIM_API_COMPLETIONS, body, 16, &err), 0, "%s", err.message);
    sim_req_free(&r);
}

Test(sim_req, duplicate_keys_last_one_wins_as_in_python)
{
    sim_req_t r;
    sim_req_err_t err;
    cr_assert_eq(parse(&r, SIM_API_COMPLETIONS,
                       "{\"prompt\":\"x\",\"temperature\":0,\"temperature\":0.9}", &err),
                 0);
    cr_assert_float_eq(r.temperature, 0.9, 1e-12);
    sim_req_free(&r);
}

/* Seeds are read from the literal, not through a double: vLLM takes the whole int64 range, and
 * neighbours above 2^53 are different seeds. */
Test(sim_req, seed_is_an_exact_int64)
{
    static const struct {
        const char *body;
        int64_t want;
    } ok[] = {
        {"{\"prompt\":\"x\",\"seed\":9223372036854775807}", INT64_MAX},
        {"{\"prompt\":\"x\",\"seed\":9223372036854775296}", INT64_C(9223372036854775296)},
        {"{\"prompt\":\"x\",\"seed\":-9223372036854775808}", INT64_MIN},
        {"{\"prompt\":\"x\",\"seed\":9007199254740993}", INT64_C(9007199254740993)},
        {"{\"prompt\":\"x\",\"seed\":9007199254740992}", INT64_C(9007199254740992)},
        {"{\"prompt\":\"x\",\"seed\":0}", 0},
        {"{\"prompt\":\"x\",\"seed\":5.0}", 5},
        /* The last of two duplicates wins, as in the Python servers; and escaped keys count. */
        {"{\"seed\":1,\"prompt\":\"x\", \"seed\" : 9007199254740993 }", INT64_C(9007199254740993)},
        {"{\"prompt\":\"x\",\"s\\u0065ed\":9007199254740995,\"metadata\":{\"seed\":1}}",
         INT64_C(9007199254740995)},
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        sim_req_t r;
        sim_req_err_t err;
        cr_assert_eq(parse(&r, SIM_API_COMPLETIONS, ok[i].body, &err), 0, "%s: %s", ok[i].body,
                     err.message);
        cr_assert(r.has_seed);
        cr_assert_eq(r.seed, ok[i].want, "%s: got %lld", ok[i].body, (long long)r.seed);
        sim_req_free(&r);
    }
    static const char *const bad[] = {
        "{\"prompt\":\"x\",\"seed\":9223372036854775808}",
        "{\"prompt\":\"x\",\"seed\":-9223372036854775809}",
        "{\"prompt\":\"x\",\"seed\":18446744073709551616}",
        "{\"prompt\":\"x\",\"seed\":123456789012345678901234567890}",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        sim_req_t r;
        sim_req_err_t err;
        cr_assert_eq(parse(&r, SIM_API_COMPLETIONS, bad[i], &err), -1, "%s accepted", bad[i]);
        cr_assert_str_eq(err.param, "seed");
    }
}
