/* Micro-benchmark of the policy hot paths (no network): parse + apply + serialise a ~1 KB chat
 * body under tenants as docs/policy.md §1 describes them, the JSON fingerprint rewrite, and the
 * SSE fingerprint rewriter per event. Prints ns per operation.
 *
 * Build (Release flags matter):
 *   cc -O2 -I. bench/policy_bench.c build/release/policy/libdp_policy.a \
 *      build/release/config/libdp_config.a build/release/common/libdp_common.a -lcjson -lssl \
 *      -lcrypto -lm -o policy_bench
 * Run: policy_bench [ITERS [BODY_FILE]] (BODY_FILE: e.g. bench/gen_prompt.py's long prompt)
 * or in CMake: add_executable(policy_bench bench/policy_bench.c)
 *              target_link_libraries(policy_bench PRIVATE dp_policy) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "policy/policy.h"

#define ROUNDS 5

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static const char chat_body[] =
    "{\n"
    "  \"model\": \"meta-llama/Llama-3.1-8B-Instruct\",\n"
    "  \"messages\": [\n"
    "    {\"role\": \"system\", \"content\": \"You are a careful assistant for a bank's internal "
    "compliance team. Answer precisely, cite the policy section you rely on, and say so when you "
    "do not know. Never invent account numbers, names or figures.\"},\n"
    "    {\"role\": \"user\", \"content\": \"Summarise the attached note in three bullet points "
    "for the weekly review.\\nNote: the counterparty exposure limit for tier-2 institutions was "
    "revised from 4% to 3.5% of capital on 1 March; two desks exceeded the new limit in the "
    "first week and were asked to unwind within five business days. The risk committee wants "
    "a daily report until both are back under the limit.\"},\n"
    "    {\"role\": \"assistant\", \"content\": \"Understood. Please confirm the reporting "
    "format.\"},\n"
    "    {\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Plain text, no "
    "tables, under 120 words.\"}]}\n"
    "  ],\n"
    "  \"temperature\": 0.9,\n"
    "  \"max_tokens\": 256,\n"
    "  \"stream\": true\n"
    "}\n";

static const char resp_body[] =
    "{\"id\":\"chatcmpl-8f2a\",\"object\":\"chat.completion\",\"created\":1732900000,\"model\":"
    "\"meta-llama/Llama-3.1-8B-Instruct\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":"
    "[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"- Tier-2 counterparty limit "
    "cut from 4% to 3.5% of capital on 1 March.\\n- Two desks breached it in week one; unwind "
    "within five business days.\\n- Daily reporting to the risk committee until both are "
    "compliant.\"},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":"
    "231,\"completion_tokens\":52,\"total_tokens\":283}}";

static const char sse_event[] =
    "data: {\"id\":\"chatcmpl-8f2a\",\"object\":\"chat.completion.chunk\",\"created\":1732900000,"
    "\"model\":\"meta-llama/Llama-3.1-8B-Instruct\",\"system_fingerprint\":\"fp_44709d6fcb\","
    "\"choices\":[{\"index\":0,\"delta\":{\"content\":\" compliance\"},\"logprobs\":null,"
    "\"finish_reason\":null}]}\n\n";

static const char *g_body = chat_body;
static size_t g_body_len = sizeof(chat_body) - 1;

static void bench_apply(const char *label, const cfg_tenant_t *t, const char *fw, int iters)
{
    policy_req_t *r = policy_req_new();
    policy_result_t res;
    policy_error_t err;
    size_t len = g_body_len;
    unsigned long long sink = 0;
    for (int i = 0; i < 1000; i++) { /* warm the buffers */
        policy_parse(r, POLICY_ROUTE_CHAT, g_body, len, &err);
        policy_apply(r, t, fw, &res, &err);
    }
    double dt = 1e30;
    for (int round = 0; round < ROUNDS; round++) {
        double t0 = now_ns();
        for (int i = 0; i < iters; i++) {
            if (policy_parse(r, POLICY_ROUTE_CHAT, g_body, len, &err) < 0 ||
                policy_apply(r, t, fw, &res, &err) < 0) {
                fprintf(stderr, "%s: %s\n", label, err.message);
                exit(1);
            }
            sink += res.body_len + res.seed;
        }
        double x = (now_ns() - t0) / iters;
        dt = x < dt ? x : dt;
    }
    printf("%-44s %8.0f ns/req  (%zu B in, %zu B out, %s)  [%llu]\n", label, dt, len, res.body_len,
           res.rewritten ? "rewritten" : "unchanged", sink % 10);
    policy_req_free(r);
}

int main(int argc, char **argv)
{
    int iters = argc > 1 ? atoi(argv[1]) : 200000;
    if (argc > 2) { /* a request body from a file, e.g. bench/gen_prompt.py's long prompt */
        FILE *f = fopen(argv[2], "rb");
        static char big[8 << 20];
        if (!f || (g_body_len = fread(big, 1, sizeof(big), f)) == 0) {
            fprintf(stderr, "policy_bench: cannot read %s\n", argv[2]);
            return 1;
        }
        fclose(f);
        g_body = big;
    }

    cfg_tenant_t none, bank, dflt;
    memset(&none, 0, sizeof(none));
    none.name = "none";
    bank = none;
    bank.name = "bank";
    bank.rules[CFG_PARAM_TEMPERATURE] = (cfg_rule_t){.has_force = true, .force = 0};
    bank.rules[CFG_PARAM_TOP_P] = (cfg_rule_t){.has_force = true, .force = 1};
    bank.rules[CFG_PARAM_SEED] = (cfg_rule_t){.has_force = true, .force = 1234};
    dflt = none;
    dflt.name = "default";
    dflt.rules[CFG_PARAM_TEMPERATURE] =
        (cfg_rule_t){.has_default = true, .def = 0.7, .has_max = true, .max = 1.0};
    dflt.rules[CFG_PARAM_SEED] = (cfg_rule_t){.derive = true};

    printf("policy_bench: best of %d rounds of %d iterations, chat body %zu bytes\n", ROUNDS, iters,
           g_body_len);
    bench_apply("parse+apply, no rules (original bytes)", &none, NULL, iters);
    bench_apply("parse+apply+serialise, bank (force x3)", &bank, NULL, iters);
    bench_apply("parse+apply+serialise, bank on vllm", &bank, "vllm", iters);
    bench_apply("parse+apply+serialise, default (derive: JCS+SHA)", &dflt, NULL, iters);

    /* JSON fingerprint rewrite */
    {
        dp_buf_t out = {0};
        char prev[POLICY_FP_PREV_MAX];
        policy_usage_t usage = {0};
        size_t len = strlen(resp_body);
        double dt = 1e30;
        for (int round = 0; round < ROUNDS; round++) {
            double t0 = now_ns();
            for (int i = 0; i < iters; i++)
                policy_fp_rewrite_json(resp_body, len, "fp_0123456789abcdef", &out, prev, &usage);
            double x = (now_ns() - t0) / iters;
            dt = x < dt ? x : dt;
        }
        printf("%-44s %8.0f ns/resp (%zu B)\n", "fp rewrite, JSON response", dt, len);
        dp_buf_free(&out);
    }

    /* SSE: one event per feed call, as the relay would see them. */
    {
        dp_buf_t out = {0};
        policy_sse_fp_t s;
        policy_sse_fp_init(&s, "fp_0123456789abcdef");
        size_t len = strlen(sse_event);
        int n = iters * 5;
        double dt = 1e30, base = 1e30;
        for (int round = 0; round < ROUNDS; round++) {
            double t0 = now_ns();
            for (int i = 0; i < n; i++) {
                out.len = 0;
                policy_sse_fp_feed(&s, sse_event, len, &out);
            }
            double x = (now_ns() - t0) / n;
            dt = x < dt ? x : dt;
            t0 = now_ns();
            for (int i = 0; i < n; i++) { /* baseline: the copy the relay does anyway */
                out.len = 0;
                dp_buf_append(&out, sse_event, len);
            }
            x = (now_ns() - t0) / n;
            base = x < base ? x : base;
        }
        printf("%-44s %8.1f ns/event (%zu B; plain copy %.1f ns; %.2f ns/B)\n", "fp rewrite, SSE",
               dt, len, base, dt / (double)len);
        if (s.rewritten != (size_t)n * ROUNDS)
            fprintf(stderr, "SSE: %zu of %d rewritten\n", s.rewritten, n);
        dp_buf_free(&out);
    }
    return 0;
}
