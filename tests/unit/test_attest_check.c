/* The attestation check's pure part (attest/check.h): the requests for each source, what their
 * answers mean, and the verdict with its reasons. The proxy, diagnose and the agent all judge
 * through these, so every wording pinned here is what each of them shows. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attest/check.h"
#include "attest/match.h"

static const char VLLM_MODELS[] = "{\"object\":\"list\",\"data\":[{\"id\":\"m1\",\"object\":"
                                  "\"model\",\"root\":\"/models/m1\",\"parent\":null}]}";
static const char VLLM_VERSION[] = "{\"version\":\"0.6.3\"}";

static attest_answer_t ok(const char *body)
{
    return (attest_answer_t){.status = 200, .body = body, .len = strlen(body)};
}

static attest_answer_t http(int status, const char *body)
{
    return (attest_answer_t){.status = status, .body = body, .len = body ? strlen(body) : 0};
}

static attest_answer_t down(const char *error, const char *detail)
{
    return (attest_answer_t){.status = 0, .error = error, .detail = detail};
}

static void read1(cfg_attest_source_t src, const attest_answer_t *ans, attest_outcome_t *out)
{
    attest_check_t c;
    attest_check_plan(&c, src, "/base", NULL);
    attest_check_read(&c, ans, NULL, false, out);
}

Test(attest_check, plans_the_requests_of_each_source)
{
    attest_check_t c;
    attest_check_plan(&c, CFG_ATTEST_AGENT, "/ignored", NULL);
    cr_assert_eq(c.nrequests, 1);
    cr_assert_eq(strlen(c.nonce), 32);
    char want[64];
    snprintf(want, sizeof(want), "/attestation?nonce=%s", c.nonce);
    cr_assert_str_eq(c.requests[0].target, want);
    cr_assert(c.requests[0].required);
    cr_assert_eq(c.requests[0].max_bytes, ATTEST_ENVELOPE_MAX_BYTES);
    char first[33];
    memcpy(first, c.nonce, sizeof(first));
    attest_check_plan(&c, CFG_ATTEST_AGENT, "", "/att");
    cr_assert(strncmp(c.requests[0].target, "/att?nonce=", 11) == 0);
    cr_assert_str_neq(c.nonce, first, "every check asks for a fresh nonce");

    attest_check_plan(&c, CFG_ATTEST_VLLM, "/base", NULL);
    cr_assert_eq(c.nrequests, 2);
    cr_assert_str_eq(c.requests[0].target, "/base/v1/models");
    cr_assert_str_eq(c.requests[1].target, "/base/version");
    cr_assert(c.requests[0].required && !c.requests[1].required);
    cr_assert_str_eq(c.nonce, "");

    attest_check_plan(&c, CFG_ATTEST_NONE, "", NULL);
    cr_assert_eq(c.nrequests, 1);
    cr_assert_str_eq(c.requests[0].target, "/v1/models");
}

/* The disagreement this module removed: diagnose said "attestation endpoint answered 503: ..."
 * where the proxy said the agent's own sentence. A dead engine behind a live agent is the
 * engine being unreachable, and the agent's message says where. */
Test(attest_check, framework_unreachable_is_the_agents_own_reason)
{
    attest_outcome_t out = {0};
    attest_answer_t a = http(503, "{\"error\":{\"message\":\"framework at http://127.0.0.1:9: "
                                  "connection refused\",\"type\":\"server_error\",\"param\":null,"
                                  "\"code\":\"framework_unreachable\"}}");
    read1(CFG_ATTEST_AGENT, &a, &out);
    cr_assert_eq(out.verdict, ATTEST_V_UNREACHABLE);
    cr_assert_eq(out.status, 503);
    cr_assert_eq(out.reasons.count, 1);
    cr_assert_str_eq(out.reasons.items[0], "framework at http://127.0.0.1:9: connection refused");

    /* Any other agent error keeps the status in front of its message. */
    a = http(503, "{\"error\":{\"message\":\"hashing the model directory (for 2s)\","
                  "\"code\":\"hashing\"}}");
    read1(CFG_ATTEST_AGENT, &a, &out);
    cr_assert_eq(out.verdict, ATTEST_V_UNREACHABLE);
    cr_assert_str_eq(out.reasons.items[0],
                     "attestation endpoint answered 503: hashing the model directory (for 2s)");
    a = http(401, "unauthorized");
    read1(CFG_ATTEST_VLLM, (attest_answer_t[]){a, ok(VLLM_VERSION)}, &out);
    cr_assert_str_eq(out.reasons.items[0], "attestation endpoint answered 401");
    attest_outcome_clear(&out);
}

Test(attest_check, a_failed_exchange_is_unreachable_with_its_detail)
{
    attest_outcome_t out = {0};
    attest_answer_t a = down("connect", "connection refused");
    read1(CFG_ATTEST_AGENT, &a, &out);
    cr_assert_eq(out.verdict, ATTEST_V_UNREACHABLE);
    cr_assert_eq(out.status, 0);
    cr_assert_str_eq(out.reasons.items[0],
                     "attestation fetch failed (connect): connection refused");
    cr_assert_str_eq(out.detail, "connection refused");
    a = down("first_byte_timeout", NULL);
    read1(CFG_ATTEST_NONE, &a, &out);
    cr_assert_str_eq(out.detail, "first_byte_timeout");
    attest_outcome_clear(&out);
}

/* With several requests the first failing one, in request order, decides (the proxy took the
 * first to call back, which depended on timing). An optional path may fail. */
Test(attest_check, the_first_failing_request_in_order_decides)
{
    attest_outcome_t out = {0};
    read1(CFG_ATTEST_VLLM, (attest_answer_t[]){http(404, NULL), down("connect", "refused")}, &out);
    cr_assert_eq(out.verdict, ATTEST_V_UNREACHABLE);
    cr_assert_str_eq(out.reasons.items[0], "attestation endpoint answered 404");
    read1(CFG_ATTEST_VLLM, (attest_answer_t[]){ok(VLLM_MODELS), http(404, NULL)}, &out);
    cr_assert_eq(out.verdict, ATTEST_V_REPORTED, "/version is optional");
    cr_assert_str_eq(out.report.model, "m1");
    cr_assert_null(out.report.framework_version);
    read1(CFG_ATTEST_VLLM, (attest_answer_t[]){ok(VLLM_MODELS), down("connect", "refused")}, &out);
    cr_assert_eq(out.verdict, ATTEST_V_UNREACHABLE, "an exchange that failed is never optional");
    attest_outcome_clear(&out);
}

Test(attest_check, unreadable_answers_are_invalid)
{
    attest_outcome_t out = {0};
    read1(CFG_ATTEST_VLLM, (attest_answer_t[]){ok("not json"), ok(VLLM_VERSION)}, &out);
    cr_assert_eq(out.verdict, ATTEST_V_INVALID);
    cr_assert_str_eq(out.reasons.items[0], "vllm GET /v1/models: not valid JSON");
    attest_answer_t a = ok("{\"payloadType\":1}");
    read1(CFG_ATTEST_AGENT, &a, &out);
    cr_assert_eq(out.verdict, ATTEST_V_INVALID);
    cr_assert_eq(out.reasons.count, 1);
    cr_assert_null(out.report.model, "an invalid answer reports nothing");
    attest_outcome_clear(&out);
}

/* Source none: reachability, and the model /v1/models names (diagnose showed it, the proxy did
 * not; now both do). */
Test(attest_check, source_none_reports_the_model_it_serves)
{
    attest_outcome_t out = {0};
    attest_answer_t a = ok(VLLM_MODELS);
    read1(CFG_ATTEST_NONE, &a, &out);
    cr_assert_eq(out.verdict, ATTEST_V_REPORTED);
    cr_assert_str_eq(out.report.source, "none");
    cr_assert_str_eq(out.report.model, "m1");
    attest_check_judge(&out, NULL, false);
    cr_assert_eq(out.verdict, ATTEST_V_ADMITTED);
    a = ok("[]");
    read1(CFG_ATTEST_NONE, &a, &out);
    cr_assert_eq(out.verdict, ATTEST_V_REPORTED, "any 200 is reachable");
    cr_assert_null(out.report.model);
    attest_outcome_clear(&out);
}

/* An agent envelope: verified against the nonce asked for, then judged. */
Test(attest_check, agent_envelope_is_verified_then_judged)
{
    attest_check_t c;
    attest_check_plan(&c, CFG_ATTEST_AGENT, "", NULL);
    attest_report_t id = {0};
    attest_report_set(&id, ATTEST_F_MODEL, "m1");
    attest_report_set(&id, ATTEST_F_QUANTIZATION, "awq");
    dp_buf_t env = {0}, err = {0};
    cr_assert_eq(attest_envelope_for(NULL, &id, c.nonce, 0, &env, &err), 0);
    attest_answer_t a = ok(env.base);
    attest_outcome_t out = {0};
    attest_check_read(&c, &a, NULL, false, &out);
    cr_assert_eq(out.verdict, ATTEST_V_REPORTED);
    cr_assert_str_eq(out.report.quantization, "awq");
    cr_assert_not(attest_check_wants_probe(&c, &out), "an agent reports its own fingerprint");

    cfg_manifest_t m = {.model = "m1", .quantization = "gptq"};
    attest_check_judge(&out, &m, false);
    cr_assert_eq(out.verdict, ATTEST_V_MISMATCH);
    cr_assert_eq(out.reasons.count, 1);
    cr_assert_str_eq(out.reasons.items[0], "quantization mismatch: got awq want gptq");
    cr_assert_str_eq(out.report.quantization, "awq", "a mismatch keeps the report");

    /* require_signature: the unsigned envelope itself is refused. */
    attest_check_read(&c, &a, NULL, true, &out);
    cr_assert_eq(out.verdict, ATTEST_V_INVALID);

    /* Another check's nonce: a replay. */
    attest_check_t c2;
    attest_check_plan(&c2, CFG_ATTEST_AGENT, "", NULL);
    attest_check_read(&c2, &a, NULL, false, &out);
    cr_assert_eq(out.verdict, ATTEST_V_INVALID);
    cr_assert(strstr(out.reasons.items[0], "nonce mismatch") != NULL, "%s", out.reasons.items[0]);
    attest_outcome_clear(&out);
    attest_report_clear(&id);
    dp_buf_free(&env);
    dp_buf_free(&err);
}

/* Native: the engine-fingerprint probe completes the report. Diagnose did not send it, so a
 * manifest pinning engine_fingerprint read "unattested" there and "admitted" in the proxy. */
Test(attest_check, native_reports_are_completed_by_the_fingerprint_probe)
{
    attest_check_t c;
    attest_check_plan(&c, CFG_ATTEST_VLLM, "", NULL);
    attest_answer_t ans[2] = {ok(VLLM_MODELS), ok(VLLM_VERSION)};
    attest_outcome_t out = {0};
    attest_check_read(&c, ans, NULL, false, &out);
    cr_assert(attest_check_wants_probe(&c, &out));
    cr_assert_str_eq(attest_check_probe_model(&out, "fallback"), "m1");
    attest_answer_t p = ok("{\"id\":\"c\",\"system_fingerprint\":\"fp_abc\",\"choices\":[]}");
    attest_check_probe_read(&out, &p);
    cr_assert_str_eq(out.report.engine_fingerprint, "fp_abc");
    cfg_manifest_t m = {.model = "m1", .engine_fingerprint = "fp_abc"};
    attest_check_judge(&out, &m, false);
    cr_assert_eq(out.verdict, ATTEST_V_ADMITTED);
    cr_assert_eq(out.reasons.count, 0);

    attest_check_read(&c, ans, NULL, false, &out);
    p = http(404, "{\"error\":\"no such model\"}");
    attest_check_probe_read(&out, &p);
    cr_assert_null(out.report.engine_fingerprint);
    attest_check_judge(&out, &m, false);
    cr_assert_eq(out.verdict, ATTEST_V_MISMATCH);
    cr_assert_str_eq(out.reasons.items[0],
                     "engine_fingerprint unattested (the 1-token probe completion answered 404)");
    attest_outcome_clear(&out);
}

Test(attest_check, accept_list_admits_a_rollouts_identity)
{
    attest_check_t c;
    attest_check_plan(&c, CFG_ATTEST_VLLM, "", NULL);
    attest_answer_t ans[2] = {ok(VLLM_MODELS), ok(VLLM_VERSION)};
    attest_outcome_t out = {0};
    attest_check_read(&c, ans, NULL, false, &out);
    cfg_manifest_t next = {.model = "m1", .framework_version = "0.6.3"};
    cfg_manifest_t m = {.model = "m1", .framework_version = "0.5.0", .accept = &next, .naccept = 1};
    attest_check_judge(&out, &m, false);
    cr_assert_eq(out.verdict, ATTEST_V_ADMITTED);
    cr_assert_eq(attest_manifest_identity(&m, &out.report), &next);
    /* Judging twice is a no-op: the verdict is no longer REPORTED. */
    attest_check_judge(&out, NULL, false);
    cr_assert_eq(out.verdict, ATTEST_V_ADMITTED);
    attest_outcome_clear(&out);
}

Test(attest_check, verdict_names)
{
    cr_assert_str_eq(attest_verdict_names[ATTEST_V_ADMITTED], "admitted");
    cr_assert_str_eq(attest_verdict_names[ATTEST_V_UNREACHABLE], "unreachable");
}

/* The canary's reason: diagnose said "canary mismatch: output sha256 X.. want Y.." and
 * "canary not recorded (output sha256 X..; ...)" where the proxy said the sentences below. */
Test(attest_check, canary_reasons_are_the_proxys)
{
    static const char got[] = "14801932aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
    attest_reasons_t r = {0};
    attest_canary_reason(got, "8de3f2ffbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
                         &r);
    attest_canary_reason(got, "", &r);
    cr_assert_eq(r.count, 2);
    cr_assert_str_eq(r.items[0], "canary mismatch: output sha256 14801932.. want 8de3f2ff.. (not "
                                 "admitted until the canary matches)");
    cr_assert_str_eq(r.items[1],
                     "canary not recorded: the manifest has no canary.expected_sha256 "
                     "(this replica's output hashes to "
                     "14801932aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa; "
                     "'detproxy attest canary' prints it)");
    attest_reasons_free(&r);
}
