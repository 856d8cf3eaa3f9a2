/* Native adapters on the frameworks' real response shapes (see docs/attestation.md for the
 * sources): each reports what its framework exposes and nothing else. */
#include <criterion/criterion.h>

#include <stdlib.h>
#include <string.h>

#include "attest/adapters.h"

#define IOV(s) ((dp_iovec_t){(s), strlen(s)})
#define NONE ((dp_iovec_t){NULL, 0})

static const char VLLM_MODELS[] =
    "{\"object\":\"list\",\"data\":["
    /* a LoRA adapter listed first: must not be taken for the base model */
    "{\"id\":\"sql-lora\",\"object\":\"model\",\"created\":1732900000,\"owned_by\":\"vllm\","
    "\"root\":\"/loras/sql\",\"parent\":\"meta-llama/"
    "Llama-3.1-8B-Instruct\",\"max_model_len\":null,"
    "\"permission\":[]},"
    "{\"id\":\"meta-llama/Llama-3.1-8B-Instruct\",\"object\":\"model\",\"created\":1732900000,"
    "\"owned_by\":\"vllm\",\"root\":\"/models/llama-3.1-8b\",\"parent\":null,"
    "\"max_model_len\":131072,\"permission\":[{\"id\":\"modelperm-8a1c\",\"object\":"
    "\"model_permission\",\"created\":1732900000,\"allow_create_engine\":false,"
    "\"allow_sampling\":true,\"allow_logprobs\":true,\"allow_search_indices\":false,"
    "\"allow_view\":true,\"allow_fine_tuning\":false,\"organization\":\"*\",\"group\":null,"
    "\"is_blocking\":false}]}]}";
static const char VLLM_VERSION[] = "{\"version\":\"0.6.3\"}";

static const char TGI2_INFO[] =
    "{\"model_id\":\"mistralai/Mistral-7B-Instruct-v0.2\",\"model_sha\":"
    "\"41b61a33a2483885c981aa79e0df6b32407ed873\",\"model_dtype\":\"torch.float16\","
    "\"model_device_type\":\"cuda\",\"model_pipeline_tag\":\"text-generation\","
    "\"max_concurrent_requests\":128,\"max_best_of\":2,\"max_stop_sequences\":4,"
    "\"max_input_tokens\":4095,\"max_total_tokens\":4096,\"waiting_served_ratio\":0.3,"
    "\"max_batch_total_tokens\":1310720,\"max_waiting_tokens\":20,\"max_batch_size\":null,"
    "\"validation_workers\":2,\"max_client_batch_size\":4,\"router\":\"text-generation-router\","
    "\"version\":\"2.0.4\",\"sha\":\"f426a33e1e4b4d5d1e8b9c3b2c6d6e5f7a8b9c0d\","
    "\"docker_label\":\"sha-f426a33\"}";
/* TGI 3.x: no model_dtype / model_device_type. */
static const char TGI3_INFO[] =
    "{\"model_id\":\"mistralai/Ministral-8B-Instruct-2410\",\"model_sha\":"
    "\"4847e87e5975a573a2a190399ca62cd266c899ad\",\"model_pipeline_tag\":null,"
    "\"max_concurrent_requests\":128,\"max_best_of\":2,\"max_stop_sequences\":4,"
    "\"max_input_tokens\":32767,\"max_total_tokens\":32768,\"validation_workers\":2,"
    "\"max_client_batch_size\":4,\"router\":\"text-generation-router\",\"version\":\"3.2.1\","
    "\"sha\":\"4d28897b4e345f4dfdd93d3434e50ac8afcdf9e1\",\"docker_label\":\"sha-4d28897\"}";
/* TGI 1.x: no router field yet. */
static const char TGI1_INFO[] =
    "{\"model_id\":\"bigscience/bloom-560m\",\"model_sha\":"
    "\"e985a63cdc139290c5f700ff1929f0b5942cced2\",\"model_dtype\":\"torch.bfloat16\","
    "\"model_device_type\":\"cuda\",\"model_pipeline_tag\":\"text-generation\","
    "\"max_concurrent_requests\":128,\"max_best_of\":2,\"max_stop_sequences\":4,"
    "\"max_input_length\":1024,\"max_total_tokens\":2048,\"waiting_served_ratio\":1.2,"
    "\"max_batch_total_tokens\":32000,\"max_waiting_tokens\":20,\"validation_workers\":2,"
    "\"version\":\"1.0.3\",\"sha\":null,\"docker_label\":\"sha-5485c14\"}";

static const char SGLANG_INFO[] =
    "{\"model_path\":\"meta-llama/Llama-3.1-8B-Instruct\",\"tokenizer_path\":"
    "\"meta-llama/"
    "Llama-3.1-8B-Instruct\",\"tokenizer_mode\":\"auto\",\"skip_tokenizer_init\":false,"
    "\"load_format\":\"auto\",\"trust_remote_code\":false,\"context_length\":null,"
    "\"is_embedding\":false,\"revision\":null,\"host\":\"0.0.0.0\",\"port\":30000,"
    "\"dtype\":\"bfloat16\",\"quantization\":\"fp8\",\"quantization_param_path\":null,"
    "\"kv_cache_dtype\":\"auto\",\"mem_fraction_static\":0.88,\"max_running_requests\":null,"
    "\"chunked_prefill_size\":8192,\"max_prefill_tokens\":16384,\"schedule_policy\":\"fcfs\","
    "\"device\":\"cuda\",\"tp_size\":1,\"random_seed\":42,\"api_key\":\"sk-never-copied\","
    "\"served_model_name\":\"llama-8b\",\"weight_version\":\"default\",\"chat_template\":null,"
    "\"max_total_num_tokens\":428576,\"max_req_input_len\":131066,"
    "\"internal_states\":[{\"attention_backend\":\"flashinfer\",\"last_gen_throughput\":0.0}],"
    "\"version\":\"0.4.6.post4\"}";
/* Launched without --dtype / --quantization: the flags' defaults, not resolved values. */
static const char SGLANG_DEFAULTS[] =
    "{\"model_path\":\"/models/qwen\",\"served_model_name\":\"/models/qwen\",\"dtype\":\"auto\","
    "\"quantization\":null,\"tp_size\":1,\"internal_states\":[],\"version\":\"0.5.1\"}";

static const char LLAMACPP_PROPS[] =
    "{\"default_generation_settings\":{\"id\":0,\"id_task\":-1,\"n_ctx\":4096,"
    "\"speculative\":false,\"is_processing\":false,\"params\":{\"n_predict\":-1,"
    "\"seed\":4294967295,\"temperature\":0.800000011920929,\"top_k\":40,\"top_p\":0."
    "949999988079071},"
    "\"prompt\":\"\"},\"total_slots\":1,\"model_path\":"
    "\"/models/Llama-3.2-1B-Instruct-Q4_K_M.gguf\",\"modalities\":{\"vision\":false,"
    "\"audio\":false},\"chat_template\":\"{% for message in messages %}{{ message.content }}"
    "{% endfor %}\",\"bos_token\":\"<|begin_of_text|>\",\"eos_token\":\"<|eot_id|>\","
    "\"build_info\":\"b5220-0d1bc6e1\"}";
static const char LLAMACPP_MODELS[] =
    "{\"models\":[{\"name\":\"llama-3.2-1b\",\"model\":\"llama-3.2-1b\",\"modified_at\":\"\","
    "\"size\":\"\",\"digest\":\"\",\"type\":\"model\",\"description\":\"\",\"tags\":[\"\"],"
    "\"capabilities\":[\"completion\"],\"parameters\":\"\",\"details\":{\"parent_model\":\"\","
    "\"format\":\"gguf\",\"family\":\"\",\"families\":[\"\"],\"parameter_size\":\"\","
    "\"quantization_level\":\"\"}}],\"object\":\"list\",\"data\":[{\"id\":\"llama-3.2-1b\","
    "\"object\":\"model\",\"created\":1735000000,\"owned_by\":\"llamacpp\",\"meta\":{"
    "\"vocab_type\":2,\"n_vocab\":128256,\"n_ctx_train\":131072,\"n_embd\":2048,"
    "\"n_params\":1235814432,\"size\":799862912}}]}";

static int run(cfg_attest_source_t s, dp_iovec_t b0, dp_iovec_t b1, attest_report_t *r,
               dp_buf_t *why)
{
    const attest_adapter_t *a = attest_adapter_for(s);
    cr_assert_not_null(a);
    dp_iovec_t bodies[2] = {b0, b1};
    memset(r, 0, sizeof(*r));
    return a->parse(bodies, a->npaths, r, why);
}

static void assert_str(const char *got, const char *want)
{
    if (want == NULL)
        cr_assert_null(got, "expected unattested, got %s", got);
    else
        cr_assert(got && strcmp(got, want) == 0, "got %s want %s", got ? got : "(null)", want);
}

Test(attest_adapters, table)
{
    cr_assert_null(attest_adapter_for(CFG_ATTEST_AGENT));
    cr_assert_null(attest_adapter_for(CFG_ATTEST_NONE));
    const attest_adapter_t *v = attest_adapter_by_name("vllm");
    cr_assert_eq(v->npaths, 2);
    cr_assert_str_eq(v->paths[0], "/v1/models");
    cr_assert_str_eq(v->paths[1], "/version");
    cr_assert_str_eq(attest_adapter_for(CFG_ATTEST_TGI)->paths[0], "/info");
    cr_assert_str_eq(attest_adapter_for(CFG_ATTEST_SGLANG)->paths[0], "/get_server_info");
    cr_assert_str_eq(attest_adapter_for(CFG_ATTEST_LLAMACPP)->paths[0], "/props");
    cr_assert_null(attest_adapter_by_name("ollama"));
}

Test(attest_adapters, vllm_reports_model_name_and_version_only)
{
    attest_report_t r;
    dp_buf_t why = {0};
    cr_assert_eq(run(CFG_ATTEST_VLLM, IOV(VLLM_MODELS), IOV(VLLM_VERSION), &r, &why), 0, "%s",
                 why.base);
    assert_str(r.model, "meta-llama/Llama-3.1-8B-Instruct");
    assert_str(r.framework_name, "vllm");
    assert_str(r.framework_version, "0.6.3");
    assert_str(r.checkpoint_sha256, NULL);
    assert_str(r.quantization, NULL);
    assert_str(r.dtype, NULL);
    cr_assert_str_eq(r.source, "vllm");
    cr_assert_not(r.is_signed);
    attest_report_clear(&r);
    /* /version not answering leaves the version unattested instead of failing. */
    cr_assert_eq(run(CFG_ATTEST_VLLM, IOV(VLLM_MODELS), NONE, &r, &why), 0);
    assert_str(r.framework_version, NULL);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_FRAMEWORK_VERSION],
                     "vllm GET /version gave no version");
    attest_report_clear(&r);
    dp_buf_free(&why);
}

Test(attest_adapters, vllm_errors)
{
    attest_report_t r;
    dp_buf_t why = {0};
    cr_assert_neq(run(CFG_ATTEST_VLLM, NONE, IOV(VLLM_VERSION), &r, &why), 0);
    cr_assert_str_eq(why.base, "vllm GET /v1/models: no answer");
    dp_buf_reset(&why);
    cr_assert_neq(run(CFG_ATTEST_VLLM, IOV("<html>502</html>"), NONE, &r, &why), 0);
    cr_assert_str_eq(why.base, "vllm GET /v1/models: not valid JSON");
    dp_buf_reset(&why);
    cr_assert_neq(run(CFG_ATTEST_VLLM,
                      IOV("{\"object\":\"list\",\"data\":[{\"id\":\"lora\","
                          "\"parent\":\"base\"}]}"),
                      NONE, &r, &why),
                  0);
    cr_assert_str_eq(why.base, "vllm GET /v1/models: no base model (entry without parent) in data");
    dp_buf_reset(&why);
    cr_assert_neq(run(CFG_ATTEST_VLLM, IOV(VLLM_MODELS), IOV("{\"version\":6}"), &r, &why), 0);
    cr_assert_str_eq(why.base, "vllm GET /version: version is not a string");
    cr_assert_null(r.model, "a failed parse leaves nothing behind");
    dp_buf_free(&why);
}

Test(attest_adapters, tgi_reports_model_dtype_version)
{
    attest_report_t r;
    dp_buf_t why = {0};
    cr_assert_eq(run(CFG_ATTEST_TGI, IOV(TGI2_INFO), NONE, &r, &why), 0, "%s", why.base);
    assert_str(r.model, "mistralai/Mistral-7B-Instruct-v0.2");
    assert_str(r.dtype, "float16"); /* "torch.float16" normalised */
    assert_str(r.framework_name, "tgi");
    assert_str(r.framework_version, "2.0.4");
    assert_str(r.checkpoint_sha256, NULL); /* model_sha is a Hub revision, not a content hash */
    assert_str(r.quantization, NULL);
    cr_assert(strstr(r.unattested_note[ATTEST_F_CHECKPOINT], "model_sha"));
    attest_report_clear(&r);

    cr_assert_eq(run(CFG_ATTEST_TGI, IOV(TGI3_INFO), NONE, &r, &why), 0);
    assert_str(r.dtype, NULL);
    cr_assert_str_eq(r.unattested_note[ATTEST_F_DTYPE],
                     "this TGI version's /info has no model_dtype");
    assert_str(r.framework_version, "3.2.1");
    attest_report_clear(&r);

    cr_assert_eq(run(CFG_ATTEST_TGI, IOV(TGI1_INFO), NONE, &r, &why), 0);
    assert_str(r.framework_name, "tgi");
    assert_str(r.dtype, "bfloat16");
    attest_report_clear(&r);

    /* Something else answering /info is not called TGI. */
    cr_assert_eq(run(CFG_ATTEST_TGI,
                     IOV("{\"model_id\":\"BAAI/bge\",\"router\":\"text-embeddings-router\","
                         "\"version\":\"1.5.0\"}"),
                     NONE, &r, &why),
                 0);
    assert_str(r.framework_name, "text-embeddings-router");
    attest_report_clear(&r);
    dp_buf_free(&why);
}

Test(attest_adapters, tgi_errors)
{
    attest_report_t r;
    dp_buf_t why = {0};
    cr_assert_neq(run(CFG_ATTEST_TGI, IOV("{\"version\":\"2.0.4\"}"), NONE, &r, &why), 0);
    cr_assert_str_eq(why.base, "tgi GET /info: no model_id");
    dp_buf_reset(&why);
    cr_assert_neq(
        run(CFG_ATTEST_TGI, IOV("{\"model_id\":\"m\",\"model_dtype\":16}"), NONE, &r, &why), 0);
    cr_assert_str_eq(why.base, "tgi GET /info: model_dtype is not a string");
    dp_buf_reset(&why);
    cr_assert_neq(run(CFG_ATTEST_TGI, IOV("[\"model_id\"]"), NONE, &r, &why), 0);
    cr_assert_str_eq(why.base, "tgi GET /info: expected a JSON object");
    dp_buf_free(&why);
}

Test(attest_adapters, sglang_reports_flags_it_was_given)
{
    attest_report_t r;
    dp_buf_t why = {0};
    cr_assert_eq(run(CFG_ATTEST_SGLANG, IOV(SGLANG_INFO), NONE, &r, &why), 0, "%s", why.base);
    assert_str(r.model, "llama-8b"); /* served_model_name, what clients send */
    assert_str(r.quantization, "fp8");
    assert_str(r.dtype, "bfloat16");
    assert_str(r.framework_name, "sglang");
    assert_str(r.framework_version, "0.4.6.post4");
    assert_str(r.checkpoint_sha256, NULL);
    /* The server's api_key is in /get_server_info: it must not travel into the report. */
    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    attest_report_write_json(&r, &w, NULL);
    cr_assert_null(strstr(out.base, "sk-never-copied"));
    dp_buf_free(&out);
    attest_report_clear(&r);

    cr_assert_eq(run(CFG_ATTEST_SGLANG, IOV(SGLANG_DEFAULTS), NONE, &r, &why), 0);
    assert_str(r.model, "/models/qwen");
    assert_str(r.dtype, NULL);
    assert_str(r.quantization, NULL);
    cr_assert(strstr(r.unattested_note[ATTEST_F_DTYPE], "\"auto\""));
    cr_assert(strstr(r.unattested_note[ATTEST_F_QUANTIZATION], "null"));
    attest_report_clear(&r);

    cr_assert_neq(run(CFG_ATTEST_SGLANG, IOV("{\"version\":\"0.5\"}"), NONE, &r, &why), 0);
    cr_assert_str_eq(why.base, "sglang GET /get_server_info: no served_model_name or model_path");
    dp_buf_free(&why);
}

Test(attest_adapters, llamacpp_reports_alias_and_build)
{
    attest_report_t r;
    dp_buf_t why = {0};
    cr_assert_eq(run(CFG_ATTEST_LLAMACPP, IOV(LLAMACPP_PROPS), IOV(LLAMACPP_MODELS), &r, &why), 0,
                 "%s", why.base);
    assert_str(r.model, "llama-3.2-1b");
    assert_str(r.framework_name, "llamacpp");
    assert_str(r.framework_version, "b5220-0d1bc6e1");
    assert_str(r.quantization, NULL); /* Q4_K_M is only in the file name: not reported */
    assert_str(r.dtype, NULL);
    assert_str(r.checkpoint_sha256, NULL);
    attest_report_clear(&r);

    cr_assert_eq(run(CFG_ATTEST_LLAMACPP, IOV(LLAMACPP_PROPS), NONE, &r, &why), 0);
    assert_str(r.model, NULL);
    attest_report_clear(&r);

    cr_assert_eq(run(CFG_ATTEST_LLAMACPP, IOV("{\"total_slots\":1}"), NONE, &r, &why), 0);
    assert_str(r.framework_version, NULL);
    attest_report_clear(&r);

    cr_assert_neq(run(CFG_ATTEST_LLAMACPP, NONE, IOV(LLAMACPP_MODELS), &r, &why), 0);
    cr_assert_str_eq(why.base, "llamacpp GET /props: no answer");
    dp_buf_free(&why);
}

Test(attest_adapters, oversized_body_is_refused)
{
    size_t n = ATTEST_ADAPTER_MAX_BODY + 1;
    char *big = malloc(n);
    memset(big, ' ', n);
    attest_report_t r;
    dp_buf_t why = {0};
    cr_assert_neq(run(CFG_ATTEST_TGI, (dp_iovec_t){big, n}, NONE, &r, &why), 0);
    cr_assert(strstr(why.base, "body too large"), "%s", why.base);
    free(big);
    dp_buf_free(&why);
}
