/* The llama.cpp adapter and the probe parser over bodies captured from a real llama-server
 * (b11669-Debian, tests/unit/data/llamacpp/, made by scripts/real-engine.sh), and the simulator's
 * llamacpp flavor checked against the same adapter: it must read the same fields from both. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "attest/adapters.h"
#include "attest/match.h"
#include "tests/sim/sim_flavor.h"

#define REAL DP_SOURCE_DIR "/tests/unit/data/llamacpp/"

static dp_buf_t slurp(const char *name)
{
    dp_buf_t b = {0};
    char path[512];
    snprintf(path, sizeof(path), REAL "%s", name);
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    char tmp[4096];
    size_t n;
    while ((n = fread(tmp, 1, sizeof(tmp), f)) > 0)
        dp_buf_append(&b, tmp, n);
    fclose(f);
    return b;
}

static void parse(const dp_buf_t *props, const dp_buf_t *models, attest_report_t *r)
{
    const attest_adapter_t *a = attest_adapter_for(CFG_ATTEST_LLAMACPP);
    dp_iovec_t b[2] = {{props->base, props->len}, {models->base, models->len}};
    dp_buf_t why = {0};
    memset(r, 0, sizeof(*r));
    cr_assert_eq(a->parse(b, 2, r, &why), 0, "%s", why.base);
    dp_buf_free(&why);
}

Test(attest_llamacpp, real_f16_server)
{
    dp_buf_t p = slurp("props-f16.json"), m = slurp("models-f16.json");
    attest_report_t r;
    parse(&p, &m, &r);
    cr_assert_str_eq(r.model, "/work/a.gguf"); /* no --alias: data[0].id is the path */
    cr_assert_str_eq(r.quantization, "F16");
    cr_assert_str_eq(r.framework_name, "llamacpp");
    cr_assert_str_eq(r.framework_version, "b11669-Debian");
    cr_assert_null(r.dtype);
    cr_assert_null(r.checkpoint_sha256);
    attest_report_clear(&r);
    dp_buf_free(&p);
    dp_buf_free(&m);
}

Test(attest_llamacpp, real_q8_0_is_rejected_by_an_f16_manifest)
{
    dp_buf_t p = slurp("props-q8_0-alias.json"), m = slurp("models-q8_0-alias.json");
    attest_report_t r;
    parse(&p, &m, &r);
    cr_assert_str_eq(r.model, "tiny"); /* --alias: data[0].id, not the Ollama "models" list */
    cr_assert_str_eq(r.quantization, "Q8_0");
    cfg_manifest_t man = {.quantization = "F16"};
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&man, &r, &why), 1);
    cr_assert_str_eq(why.items[0], "quantization mismatch: got Q8_0 want F16");
    attest_reasons_free(&why);
    /* llama.cpp's own capitals are not a difference for this adapter. */
    man.quantization = "q8_0";
    cr_assert_eq(attest_manifest_match(&man, &r, &why), 0);
    attest_report_clear(&r);
    dp_buf_free(&p);
    dp_buf_free(&m);
}

Test(attest_llamacpp, case_blind_only_for_llamacpp)
{
    attest_report_t r = {0};
    snprintf(r.source, sizeof(r.source), "vllm");
    attest_report_set(&r, ATTEST_F_QUANTIZATION, "AWQ");
    cfg_manifest_t man = {.quantization = "awq"};
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&man, &r, &why), 1);
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

Test(attest_llamacpp, probe_learns_the_build_as_engine_fingerprint)
{
    dp_buf_t c = slurp("completion-1tok.json");
    attest_report_t r = {0};
    attest_adapter_probe_parse(&(dp_iovec_t){c.base, c.len}, &r);
    cr_assert_str_eq(r.engine_fingerprint, "b11669-Debian");
    cr_assert_null(r.engine_hardware); /* not vLLM's form: nothing more to read from it */
    cr_assert_null(r.framework_name);
    cfg_manifest_t man = {.engine_fingerprint = "b11669-Debian"};
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&man, &r, &why), 0);
    man.engine_fingerprint = "b12000-Debian";
    cr_assert_eq(attest_manifest_match(&man, &r, &why), 1);
    cr_assert_str_eq(why.items[0],
                     "engine_fingerprint mismatch: got b11669-Debian want b12000-Debian");
    attest_reasons_free(&why);
    attest_report_clear(&r);
    dp_buf_free(&c);
}

Test(attest_llamacpp, probe_failures_leave_it_unattested)
{
    attest_report_t r = {0};
    attest_adapter_probe_parse(&(dp_iovec_t){NULL, 0}, &r);
    cr_assert_null(r.engine_fingerprint);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_ENGINE_FINGERPRINT],
                     "the 1-token probe completion failed");
    const char *nofp = "{\"choices\":[{\"text\":\"x\"}]}";
    attest_adapter_probe_parse(&(dp_iovec_t){nofp, strlen(nofp)}, &r);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_ENGINE_FINGERPRINT],
                     "the engine puts no system_fingerprint on responses");
    attest_adapter_probe_parse(&(dp_iovec_t){"[1", 2}, &r);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_ENGINE_FINGERPRINT],
                     "the probe completion is not JSON");
    cfg_manifest_t man = {.engine_fingerprint = "b1"};
    attest_reasons_t why = {0};
    cr_assert_eq(attest_manifest_match(&man, &r, &why), 1); /* fail closed */
    cr_assert(strstr(why.items[0], "engine_fingerprint unattested"), "%s", why.items[0]);
    attest_reasons_free(&why);
    attest_report_clear(&r);
}

/* The data path sees a response's fingerprint with bytes outside visible ASCII as '?' and, in
 * streams, escapes as written: a value it cannot compare exactly would mismatch on every
 * response and keep the replica in re-attestation. */
Test(attest_llamacpp, probe_refuses_a_fingerprint_the_data_path_cannot_compare)
{
    const char *bodies[] = {
        "{\"system_fingerprint\":\"fp-\\u00e9\"}", "{\"system_fingerprint\":\"fp-\xc3\xa9\"}",
        "{\"system_fingerprint\":\"a\\\"b\"}",     "{\"system_fingerprint\":\"a\\\\b\"}",
        "{\"system_fingerprint\":\"a\\tb\"}",      "{\"system_fingerprint\":\"a\\u007fb\"}",
    };
    for (size_t i = 0; i < sizeof(bodies) / sizeof(bodies[0]); i++) {
        attest_report_t r = {0};
        attest_adapter_probe_parse(&(dp_iovec_t){bodies[i], strlen(bodies[i])}, &r);
        cr_assert_null(r.engine_fingerprint, "%s", bodies[i]);
        cr_assert_str_eq(r.unattested_note[ATTEST_F_ENGINE_FINGERPRINT],
                         "the engine's system_fingerprint is not plain visible ASCII", "%s",
                         bodies[i]);
        attest_report_clear(&r);
    }
    const char *ok = "{\"system_fingerprint\":\"vllm-0.11.0 H100/x_y:z+1\"}";
    attest_report_t r = {0};
    attest_adapter_probe_parse(&(dp_iovec_t){ok, strlen(ok)}, &r);
    cr_assert_str_eq(r.engine_fingerprint, "vllm-0.11.0 H100/x_y:z+1");
    attest_report_clear(&r);
}

Test(attest_llamacpp, vllm_fingerprint_is_parsed)
{
    attest_report_t r = {0};
    attest_engine_fingerprint_set(&r, "vllm-0.11.0-H100-tp8-bf16-a3b21f94");
    cr_assert_str_eq(r.engine_fingerprint, "vllm-0.11.0-H100-tp8-bf16-a3b21f94");
    cr_assert_str_eq(r.framework_name, "vllm");
    cr_assert_str_eq(r.framework_version, "0.11.0");
    cr_assert_str_eq(r.dtype, "bfloat16");
    cr_assert_str_eq(r.engine_hardware, "H100");
    cr_assert_eq(r.engine_tp, 8);
    attest_report_t c;
    attest_report_copy(&c, &r);
    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    attest_report_write_json(&c, &w, NULL);
    cr_assert(strstr(out.base, "\"engine_fingerprint\":\"vllm-0.11.0-H100-tp8-bf16-a3b21f94\","
                               "\"engine\":{\"hardware\":\"H100\",\"tensor_parallel\":8}"),
              "%s", out.base);
    dp_buf_free(&out);
    attest_report_clear(&c);
    attest_report_clear(&r);

    /* A GPU name with dashes stays whole; what the adapter already has is kept. */
    attest_report_set(&r, ATTEST_F_FRAMEWORK_VERSION, "0.11.1");
    attest_engine_fingerprint_set(&r, "vllm-0.11.1rc1-A100-SXM4-80GB-tp2-fp16-0011aabb");
    cr_assert_str_eq(r.framework_version, "0.11.1");
    cr_assert_str_eq(r.engine_hardware, "A100-SXM4-80GB");
    cr_assert_eq(r.engine_tp, 2);
    cr_assert_str_eq(r.dtype, "float16");
    attest_report_clear(&r);

    /* Not vLLM's form: only the fingerprint itself is attested. */
    static const char *const odd[] = {"vllm-0.11.0-tp8-bf16-a3b21f94",
                                      "vllm-0.11.0-H100-tpx-bf16-a3b21f94",
                                      "vllm-0.11.0-H100-tp8-bf16-A3B21F94",
                                      "vllm--H100-tp8-bf16-a3b21f94",
                                      "vllm-",
                                      "vllm-0.11.0-H100-tp8-bf16-a3b21f9",
                                      "fp_1234"};
    for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); i++) {
        attest_engine_fingerprint_set(&r, odd[i]);
        cr_assert_str_eq(r.engine_fingerprint, odd[i]);
        cr_assert_null(r.engine_hardware, "%s", odd[i]);
        cr_assert_null(r.framework_version, "%s", odd[i]);
        attest_report_clear(&r);
    }
}

/* The simulator imitating the captured server reads the same through the same adapter. */
Test(attest_llamacpp, simulator_matches_the_real_server)
{
    dp_buf_t rp = slurp("props-q8_0-alias.json"), rm = slurp("models-q8_0-alias.json");
    attest_report_t real, sim;
    parse(&rp, &rm, &real);

    sim_identity_t id;
    sim_identity_defaults(&id);
    id.flavor = SIM_FLAVOR_LLAMACPP;
    sim_identity_set(&id.model, "tiny");
    sim_identity_set(&id.quantization, "Q8_0");
    sim_identity_set(&id.framework_version, "b11669-Debian");
    dp_buf_t sp = {0}, sm = {0};
    const char *ct;
    cr_assert_eq(sim_flavor_get(&id, "/props", 6, &sp, &ct), 200);
    cr_assert_eq(sim_flavor_get(&id, "/v1/models", 10, &sm, &ct), 200);
    cr_assert_eq(sim_flavor_get(&id, "/version", 8, &(dp_buf_t){0}, &ct), 0); /* 404 */
    parse(&sp, &sm, &sim);
    for (int f = 0; f < ATTEST_F__COUNT; f++) {
        const char *a = attest_report_get(&real, (attest_field_t)f);
        const char *b = attest_report_get(&sim, (attest_field_t)f);
        cr_assert((a == NULL) == (b == NULL) && (a == NULL || strcmp(a, b) == 0),
                  "%s: real %s sim %s", attest_field_names[f], a ? a : "-", b ? b : "-");
    }

    /* Same shape: every top-level key of the real /props and /v1/models (but the UI's), and
     * the Ollama-style list before "data". */
    static const char *const ui_only[] = {"ui", "ui_settings", "chat_template_caps",
                                          "cors_proxy_enabled"};
    const dp_buf_t *pairs[2][2] = {{&rp, &sp}, {&rm, &sm}};
    for (int k = 0; k < 2; k++) {
        cJSON *r = cJSON_ParseWithLength(pairs[k][0]->base, pairs[k][0]->len);
        cJSON *s = cJSON_ParseWithLength(pairs[k][1]->base, pairs[k][1]->len);
        const cJSON *e;
        cJSON_ArrayForEach(e, r)
        {
            bool skip = false;
            for (size_t i = 0; i < sizeof(ui_only) / sizeof(ui_only[0]); i++)
                skip |= strcmp(e->string, ui_only[i]) == 0;
            cr_assert(skip || cJSON_GetObjectItemCaseSensitive(s, e->string) != NULL,
                      "simulator lacks %s", e->string);
        }
        cr_assert_str_eq(r->child->string, s->child->string);
        cJSON_Delete(r);
        cJSON_Delete(s);
    }
    cJSON *s = cJSON_ParseWithLength(sm.base, sm.len);
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(s, "data"), 0), "meta");
    cr_assert_str_eq(cJSON_GetObjectItemCaseSensitive(meta, "ftype")->valuestring, "Q8_0");
    cJSON_Delete(s);

    dp_buf_t fp = {0};
    sim_identity_fingerprint(&id, &fp);
    cr_assert_str_eq(fp.base, "b11669-Debian"); /* what the real one puts on responses */
    dp_buf_free(&fp);
    attest_report_clear(&real);
    attest_report_clear(&sim);
    sim_identity_free(&id);
    dp_buf_free(&rp);
    dp_buf_free(&rm);
    dp_buf_free(&sp);
    dp_buf_free(&sm);
}

/* GET /slots, as a slot kept with no answer left to read asks it (proxy/data/admission.c):
 * idle only when every slot listed says it is not processing. */
Test(llamacpp_slots, real_answers_read_idle_and_busy)
{
    dp_buf_t idle = slurp("slots-idle.json"), busy = slurp("slots-busy.json");
    cr_assert_eq(attest_llamacpp_slots_idle(idle.base, idle.len), 1);
    cr_assert_eq(attest_llamacpp_slots_idle(busy.base, busy.len), 0);
    dp_buf_free(&idle);
    dp_buf_free(&busy);
}

Test(llamacpp_slots, other_shapes_say_nothing)
{
    static const char *const nothing[] = {
        "",
        "[]",
        "{}",
        "{\"is_processing\":false}",
        "[{\"id\":0}]",
        "[{\"id\":0,\"is_processing\":0}]",
        "[{\"id\":0,\"is_processing\":\"false\"}]",
        "[{\"id\":0,\"is_processing\":null}]",
        "[{\"id\":0,\"is_processing\":true},{\"id\":1}]",
        "[{\"id\":0,\"is_processing\":false},7]",
        "[{\"id\":0,\"is_processing\":false}",
        "{\"error\":{\"code\":501,\"message\":\"This server does not support slots "
        "endpoint.\",\"type\":\"not_supported_error\"}}",
        "File Not Found",
        /* a repeated key, however written, and anything after the array */
        "[{\"id\":0,\"is_processing\":false,\"is_processing\":true}]",
        "[{\"id\":0,\"is_processing\":false,\"is_proc\\u0065ssing\":true}]",
        "[{\"id\":0,\"is_processing\":false}] ]]garbage",
        "[{\"id\":0,\"is_processing\":false}][{\"id\":0,\"is_processing\":true}]",
    };
    for (size_t i = 0; i < sizeof(nothing) / sizeof(nothing[0]); i++)
        cr_assert_eq(attest_llamacpp_slots_idle(nothing[i], strlen(nothing[i])), -1, "%s",
                     nothing[i]);
    const char nul_inside[] = "[{\"id\":0,\"is_processing\":false}]\0[{\"is_processing\":true}]";
    cr_assert_eq(attest_llamacpp_slots_idle(nul_inside, sizeof(nul_inside) - 1), -1);
    const char spaced[] = " [{\"id\":0,\"is_processing\":false}]\r\n";
    cr_assert_eq(attest_llamacpp_slots_idle(spaced, sizeof(spaced) - 1), 1);
    const char one_busy[] =
        "[{\"id\":0,\"is_processing\":false},{\"id\":1,\"is_processing\":true}]";
    cr_assert_eq(attest_llamacpp_slots_idle(one_busy, sizeof(one_busy) - 1), 0);
    const char two_idle[] =
        "[{\"id\":0,\"is_processing\":false},{\"id\":1,\"is_processing\":false}]";
    cr_assert_eq(attest_llamacpp_slots_idle(two_idle, sizeof(two_idle) - 1), 1);
}
