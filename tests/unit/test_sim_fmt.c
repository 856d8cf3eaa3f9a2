/* detproxy-sim's response and metadata shapes, per flavor. */
#include <criterion/criterion.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/buf.h"
#include "tests/sim/sim_flavor.h"
#include "tests/sim/sim_fmt.h"

static cJSON *parse_buf(const dp_buf_t *b)
{
    cJSON *j = cJSON_ParseWithLength(b->base, b->len);
    cr_assert_not_null(j, "not JSON: %.*s", (int)b->len, b->base);
    return j;
}

static const cJSON *get(const cJSON *o, const char *k)
{
    return cJSON_GetObjectItemCaseSensitive(o, k);
}

static sim_fmt_ctx_t ctx(sim_flavor_t f, sim_api_t api, const char *fp)
{
    return (sim_fmt_ctx_t){f, api, "id-1", 1700000000, "m", fp};
}

Test(sim_fmt, completion_response_shape)
{
    sim_fmt_ctx_t c = ctx(SIM_FLAVOR_VLLM, SIM_API_COMPLETIONS, NULL);
    sim_choice_t ch[2] = {{0, " a b", 4, SIM_FINISH_LENGTH}, {1, " c", 2, SIM_FINISH_STOP}};
    sim_usage_t u = {3, 3};
    dp_buf_t out = {0};
    sim_fmt_response(&out, &c, ch, 2, &u);
    cJSON *j = parse_buf(&out);
    cr_assert_str_eq(get(j, "object")->valuestring, "text_completion");
    cr_assert_str_eq(get(j, "id")->valuestring, "id-1");
    cr_assert_eq(get(j, "created")->valuedouble, 1700000000);
    cr_assert_null(get(j, "system_fingerprint"), "vLLM leaves system_fingerprint out");
    const cJSON *choices = get(j, "choices");
    cr_assert_eq(cJSON_GetArraySize(choices), 2);
    const cJSON *c0 = cJSON_GetArrayItem(choices, 0), *c1 = cJSON_GetArrayItem(choices, 1);
    cr_assert_str_eq(get(c0, "text")->valuestring, " a b");
    cr_assert(cJSON_IsNull(get(c0, "logprobs")));
    cr_assert_str_eq(get(c0, "finish_reason")->valuestring, "length");
    cr_assert_str_eq(get(c1, "finish_reason")->valuestring, "stop");
    cr_assert_eq(get(c1, "index")->valueint, 1);
    const cJSON *usage = get(j, "usage");
    cr_assert_eq(get(usage, "prompt_tokens")->valueint, 3);
    cr_assert_eq(get(usage, "completion_tokens")->valueint, 3);
    cr_assert_eq(get(usage, "total_tokens")->valueint, 6);
    cJSON_Delete(j);
    dp_buf_free(&out);
}

Test(sim_fmt, chat_response_shape_per_flavor)
{
    for (int f = SIM_FLAVOR_VLLM; f <= SIM_FLAVOR_LLAMACPP; f++) {
        bool has_fp = f == SIM_FLAVOR_TGI || f == SIM_FLAVOR_LLAMACPP;
        sim_fmt_ctx_t c = ctx((sim_flavor_t)f, SIM_API_CHAT, has_fp ? "fp-1" : NULL);
        sim_choice_t ch = {0, "hello \"there\"", 13, SIM_FINISH_LENGTH};
        sim_usage_t u = {1, 2};
        dp_buf_t out = {0};
        sim_fmt_response(&out, &c, &ch, 1, &u);
        cJSON *j = parse_buf(&out);
        cr_assert_str_eq(get(j, "object")->valuestring, "chat.completion");
        const cJSON *msg = get(cJSON_GetArrayItem(get(j, "choices"), 0), "message");
        cr_assert_str_eq(get(msg, "role")->valuestring, "assistant");
        cr_assert_str_eq(get(msg, "content")->valuestring, "hello \"there\"");
        if (has_fp)
            cr_assert_str_eq(get(j, "system_fingerprint")->valuestring, "fp-1");
        else
            cr_assert_null(get(j, "system_fingerprint"));
        cJSON_Delete(j);
        dp_buf_free(&out);
    }
}

/* Split an SSE body into its data payloads. */
static int sse_events(const char *s, char ev[][2048], int max)
{
    int n = 0;
    const char *p = s;
    while (n < max && (p = strstr(p, "data: ")) != NULL) {
        p += 6;
        const char *e = strstr(p, "\n\n");
        cr_assert_not_null(e);
        size_t len = (size_t)(e - p);
        cr_assert_lt(len, 2048);
        memcpy(ev[n], p, len);
        ev[n][len] = '\0';
        n++;
        p = e + 2;
    }
    return n;
}

Test(sim_fmt, chat_stream_deltas_concatenate_to_the_text)
{
    for (int f = SIM_FLAVOR_VLLM; f <= SIM_FLAVOR_LLAMACPP; f++) {
        sim_fmt_ctx_t c = ctx((sim_flavor_t)f, SIM_API_CHAT, NULL);
        dp_buf_t out = {0}, text = {0};
        sim_fmt_chunk_role(&out, &c, 0);
        int32_t toks[3] = {3, 7, 11};
        for (uint32_t i = 0; i < 3; i++) {
            size_t start = text.len;
            sim_fmt_token_text(SIM_API_CHAT, i, toks[i], &text);
            sim_fmt_chunk(&out, &c, 0, text.base + start, text.len - start,
                          i == 2 ? SIM_FINISH_LENGTH : SIM_FINISH_NONE);
        }
        sim_usage_t u = {2, 3};
        sim_fmt_chunk_usage(&out, &c, &u);
        sim_fmt_done(&out);

        static char ev[16][2048];
        int n = sse_events(out.base, ev, 16);
        cr_assert_str_eq(ev[n - 1], "[DONE]");
        dp_buf_t joined = {0};
        bool saw_finish = false, saw_usage = false, saw_role = false;
        for (int i = 0; i < n - 1; i++) {
            cJSON *j = cJSON_Parse(ev[i]);
            cr_assert_not_null(j, "flavor %d chunk %d: %s", f, i, ev[i]);
            cr_assert_str_eq(get(j, "object")->valuestring, "chat.completion.chunk");
            const cJSON *choices = get(j, "choices");
            if (cJSON_GetArraySize(choices) == 0) {
                saw_usage = get(get(j, "usage"), "total_tokens")->valueint == 5;
            } else {
                const cJSON *c0 = cJSON_GetArrayItem(choices, 0);
                const cJSON *d = get(c0, "delta");
                if (cJSON_IsString(get(d, "role")))
                    saw_role = true;
                if (cJSON_IsString(get(d, "content")))
                    dp_buf_appends(&joined, get(d, "content")->valuestring);
                if (cJSON_IsString(get(c0, "finish_reason")))
                    saw_finish = true;
            }
            cJSON_Delete(j);
        }
        cr_assert_str_eq(joined.base, text.base, "flavor %d", f);
        cr_assert(text.base[0] != ' ', "chat text starts without a space");
        cr_assert(saw_finish && saw_usage && saw_role, "flavor %d", f);
        dp_buf_free(&joined);
        dp_buf_free(&text);
        dp_buf_free(&out);
    }
}

Test(sim_fmt, completion_stream_chunk)
{
    sim_fmt_ctx_t c = ctx(SIM_FLAVOR_SGLANG, SIM_API_COMPLETIONS, NULL);
    dp_buf_t out = {0};
    sim_fmt_chunk_role(&out, &c, 0);
    cr_assert_eq(out.len, 0, "completions have no role chunk");
    sim_fmt_chunk(&out, &c, 2, " word", 5, SIM_FINISH_STOP);
    cr_assert(strncmp(out.base, "data: ", 6) == 0);
    cr_assert(out.len > 2 && strcmp(out.base + out.len - 2, "\n\n") == 0);
    cJSON *j = cJSON_ParseWithLength(out.base + 6, out.len - 8);
    cr_assert_not_null(j);
    const cJSON *c0 = cJSON_GetArrayItem(get(j, "choices"), 0);
    cr_assert_str_eq(get(j, "object")->valuestring, "text_completion");
    cr_assert_str_eq(get(c0, "text")->valuestring, " word");
    cr_assert_eq(get(c0, "index")->valueint, 2);
    cr_assert_eq(get(c0, "matched_stop")->valueint, 128009);
    cJSON_Delete(j);
    dp_buf_free(&out);
}

Test(sim_fmt, ids_per_flavor)
{
    char id[48];
    sim_fmt_id(SIM_FLAVOR_VLLM, SIM_API_COMPLETIONS, 1, 2, id);
    cr_assert(strncmp(id, "cmpl-", 5) == 0 && strlen(id) == 37);
    sim_fmt_id(SIM_FLAVOR_VLLM, SIM_API_CHAT, 1, 2, id);
    cr_assert(strncmp(id, "chat-", 5) == 0);
    sim_fmt_id(SIM_FLAVOR_TGI, SIM_API_CHAT, 1, 2, id);
    cr_assert_str_eq(id, "");
    sim_fmt_id(SIM_FLAVOR_SGLANG, SIM_API_CHAT, 1, 2, id);
    cr_assert_eq(strlen(id), 32);
    sim_fmt_id(SIM_FLAVOR_LLAMACPP, SIM_API_CHAT, 1, 2, id);
    cr_assert(strncmp(id, "chatcmpl-", 9) == 0);
}

/* ---- flavor metadata ---- */

static cJSON *meta(const sim_identity_t *id, const char *path, int want_status)
{
    dp_buf_t out = {0};
    const char *ctype = NULL;
    int st = sim_flavor_get(id, path, strlen(path), &out, &ctype);
    cr_assert_eq(st, want_status, "%s on %s", path, sim_flavor_name(id->flavor));
    if (st == 0) {
        dp_buf_free(&out);
        return NULL;
    }
    cJSON *j = out.len ? parse_buf(&out) : NULL;
    dp_buf_free(&out);
    return j;
}

static void ident(sim_identity_t *id, sim_flavor_t f)
{
    sim_identity_defaults(id);
    id->flavor = f;
    sim_identity_set(&id->model, "meta-llama/Llama-3.1-8B-Instruct");
    sim_identity_set(&id->framework_version, sim_flavor_default_version(f));
    sim_identity_set(&id->quantization, "awq");
    sim_identity_set(&id->dtype, "bfloat16");
}

Test(sim_flavor, parse_and_defaults)
{
    cr_assert_eq(sim_flavor_parse("vllm"), SIM_FLAVOR_VLLM);
    cr_assert_eq(sim_flavor_parse("llamacpp"), SIM_FLAVOR_LLAMACPP);
    cr_assert_eq(sim_flavor_parse("VLLM"), -1);
    sim_identity_t id;
    sim_identity_defaults(&id);
    cr_assert_str_eq(id.model, "sim-model");
    cr_assert_str_eq(id.quantization, "none");
    cr_assert_str_eq(id.dtype, "float16");
    cr_assert_str_eq(id.checkpoint_sha256,
                     "507a9a8be3d145a86daa9644b28bf42a8dc0720d8baeabdf0406c393692bf082");
    cr_assert_str_eq(sim_identity_reported_quantization(&id), "none");
    sim_identity_set(&id.report_quantization, "awq");
    cr_assert_str_eq(sim_identity_reported_quantization(&id), "awq");
    sim_identity_free(&id);
}

Test(sim_flavor, vllm)
{
    sim_identity_t id;
    ident(&id, SIM_FLAVOR_VLLM);
    cJSON *m = meta(&id, "/v1/models", 200);
    const cJSON *d0 = cJSON_GetArrayItem(get(m, "data"), 0);
    cr_assert_str_eq(get(m, "object")->valuestring, "list");
    cr_assert_str_eq(get(d0, "id")->valuestring, "meta-llama/Llama-3.1-8B-Instruct");
    cr_assert_str_eq(get(d0, "owned_by")->valuestring, "vllm");
    cr_assert_eq(get(d0, "max_model_len")->valueint, 4096);
    cr_assert(cJSON_IsNull(get(d0, "parent")));
    const cJSON *perm = cJSON_GetArrayItem(get(d0, "permission"), 0);
    cr_assert_str_eq(get(perm, "object")->valuestring, "model_permission");
    cJSON_Delete(m);
    cJSON *v = meta(&id, "/version", 200);
    cr_assert_str_eq(get(v, "version")->valuestring, "0.6.3");
    cJSON_Delete(v);
    /* vLLM exposes no dtype / quantization / checkpoint anywhere. */
    meta(&id, "/info", 0);
    meta(&id, "/props", 0);
    meta(&id, "/get_server_info", 0);
    cr_assert_null(meta(&id, "/health", 200), "empty body");
    sim_identity_free(&id);
}

Test(sim_flavor, tgi)
{
    sim_identity_t id;
    ident(&id, SIM_FLAVOR_TGI);
    cJSON *i = meta(&id, "/info", 200);
    cr_assert_str_eq(get(i, "model_id")->valuestring, "meta-llama/Llama-3.1-8B-Instruct");
    cr_assert_str_eq(get(i, "model_dtype")->valuestring, "torch.bfloat16");
    cr_assert_str_eq(get(i, "model_device_type")->valuestring, "cuda");
    cr_assert_str_eq(get(i, "router")->valuestring, "text-generation-router");
    cr_assert_str_eq(get(i, "version")->valuestring, "2.0.4");
    cr_assert_eq(strlen(get(i, "model_sha")->valuestring), 40);
    cr_assert_eq(strlen(get(i, "sha")->valuestring), 40);
    cr_assert(strncmp(get(i, "docker_label")->valuestring, "sha-", 4) == 0);
    const char *ints[] = {"max_concurrent_requests", "max_best_of",      "max_stop_sequences",
                          "max_input_tokens",        "max_total_tokens", "validation_workers",
                          "max_client_batch_size"};
    for (size_t k = 0; k < sizeof(ints) / sizeof(ints[0]); k++)
        cr_assert(cJSON_IsNumber(get(i, ints[k])), "%s", ints[k]);
    cr_assert_null(get(i, "quantization"), "TGI's /info has no quantization");
    cJSON_Delete(i);
    meta(&id, "/version", 0);
    dp_buf_t fp = {0};
    cr_assert(sim_identity_has_fingerprint(&id));
    sim_identity_fingerprint(&id, &fp);
    cr_assert(strncmp(fp.base, "2.0.4-sha-", 10) == 0, "%s", fp.base);
    dp_buf_free(&fp);
    sim_identity_free(&id);
}

Test(sim_flavor, sglang)
{
    sim_identity_t id;
    ident(&id, SIM_FLAVOR_SGLANG);
    sim_identity_set(&id.report_quantization, "gptq");
    cJSON *s = meta(&id, "/get_server_info", 200);
    cr_assert_str_eq(get(s, "model_path")->valuestring, "meta-llama/Llama-3.1-8B-Instruct");
    cr_assert_str_eq(get(s, "served_model_name")->valuestring, "meta-llama/Llama-3.1-8B-Instruct");
    cr_assert_str_eq(get(s, "dtype")->valuestring, "bfloat16");
    cr_assert_str_eq(get(s, "quantization")->valuestring, "gptq", "reports the lie");
    cr_assert_str_eq(get(s, "version")->valuestring, "0.3.5");
    cr_assert(cJSON_IsString(get(s, "tokenizer_path")));
    cJSON_Delete(s);
    sim_identity_set(&id.report_quantization, "");
    sim_identity_set(&id.quantization, "none");
    s = meta(&id, "/get_server_info", 200);
    cr_assert(cJSON_IsNull(get(s, "quantization")), "unquantized is null, as in SGLang");
    cJSON_Delete(s);
    cJSON *mi = meta(&id, "/get_model_info", 200);
    cr_assert(cJSON_IsTrue(get(mi, "is_generation")));
    cJSON_Delete(mi);
    cr_assert(!sim_identity_has_fingerprint(&id));
    sim_identity_free(&id);
}

Test(sim_flavor, llamacpp)
{
    sim_identity_t id;
    ident(&id, SIM_FLAVOR_LLAMACPP);
    cJSON *p = meta(&id, "/props", 200);
    const cJSON *dgs = get(p, "default_generation_settings");
    cr_assert_eq(get(dgs, "n_ctx")->valueint, 4096);
    cr_assert_eq(get(get(dgs, "params"), "seed")->valuedouble, 4294967295.0);
    cr_assert_str_eq(get(p, "model_alias")->valuestring, "meta-llama/Llama-3.1-8B-Instruct");
    cr_assert_str_eq(get(p, "model_ftype")->valuestring, "awq"); /* the reported quantization */
    cr_assert(cJSON_IsNumber(get(p, "total_slots")));
    cr_assert_str_eq(get(p, "model_path")->valuestring,
                     "/models/meta-llama/Llama-3.1-8B-Instruct.gguf");
    cr_assert(cJSON_IsString(get(p, "chat_template")));
    cr_assert(strncmp(get(p, "build_info")->valuestring, "b11669-", 7) == 0);
    cJSON_Delete(p);
    cJSON *h = meta(&id, "/health", 200);
    cr_assert_str_eq(get(h, "status")->valuestring, "ok");
    cJSON_Delete(h);
    cJSON *m = meta(&id, "/v1/models", 200);
    cr_assert_str_eq(get(cJSON_GetArrayItem(get(m, "data"), 0), "owned_by")->valuestring,
                     "llamacpp");
    cJSON_Delete(m);
    sim_identity_set(&id.framework_version, "b5000-abcdef0");
    dp_buf_t fp = {0};
    sim_identity_fingerprint(&id, &fp);
    cr_assert_str_eq(fp.base, "b5000-abcdef0");
    dp_buf_free(&fp);
    sim_identity_free(&id);
}

Test(sim_flavor, not_found_bodies)
{
    sim_identity_t id;
    sim_identity_defaults(&id);
    dp_buf_t out = {0};
    const char *ct;
    cr_assert_eq(sim_flavor_not_found(&id, &out, &ct), 404);
    cr_assert_str_eq(out.base, "{\"detail\":\"Not Found\"}");
    dp_buf_free(&out);
    sim_identity_free(&id);
}
