#include "tests/sim/sim_flavor.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jw.h"
#include "common/util.h"

static const char *const flavor_names[] = {"vllm", "tgi", "sglang", "llamacpp"};
/* Versions contemporary with the shapes below (see docs/contributing/simulator.md). */
static const char *const default_versions[] = {"0.6.3", "2.0.4", "0.3.5", "b11669"};

int sim_flavor_parse(const char *s)
{
    for (int i = 0; i < (int)DP_ARRAY_SIZE(flavor_names); i++)
        if (strcmp(s, flavor_names[i]) == 0)
            return i;
    return -1;
}

const char *sim_flavor_name(sim_flavor_t f)
{
    return flavor_names[f];
}

const char *sim_flavor_default_version(sim_flavor_t f)
{
    return default_versions[f];
}

void sim_identity_set(char **field, const char *value)
{
    char *copy = dp_xstrdup(value);
    free(*field);
    *field = copy;
}

void sim_identity_defaults(sim_identity_t *id)
{
    char sha[65];
    memset(id, 0, sizeof(*id));
    id->flavor = SIM_FLAVOR_VLLM;
    sim_identity_set(&id->model, "sim-model");
    sim_identity_set(&id->framework_version, default_versions[SIM_FLAVOR_VLLM]);
    sim_identity_set(&id->quantization, "none");
    sim_identity_set(&id->report_quantization, "");
    sim_identity_set(&id->dtype, "float16");
    dp_sha256_hex("sim", 3, sha);
    sim_identity_set(&id->checkpoint_sha256, sha);
    id->max_model_len = 4096;
    id->total_slots = 4;
    id->created = dp_wall_ms() / 1000;
}

void sim_identity_free(sim_identity_t *id)
{
    char **fields[] = {&id->model,        &id->framework_version,
                       &id->quantization, &id->report_quantization,
                       &id->dtype,        &id->checkpoint_sha256};
    for (size_t i = 0; i < DP_ARRAY_SIZE(fields); i++) {
        free(*fields[i]);
        *fields[i] = NULL;
    }
}

const char *sim_identity_reported_quantization(const sim_identity_t *id)
{
    return id->report_quantization[0] ? id->report_quantization : id->quantization;
}

/* A stable pseudo git revision derived from a label, for fields that carry commit hashes in the
 * real servers (TGI's sha and model_sha, llama.cpp's build commit). */
static void fake_rev(const char *label, const char *value, char out[41])
{
    dp_buf_t b = {0};
    char hex[65];
    dp_buf_printf(&b, "%s:%s", label, value);
    dp_sha256_hex(b.base, b.len, hex);
    dp_buf_free(&b);
    memcpy(out, hex, 40);
    out[40] = '\0';
}

static void tgi_docker_label(const sim_identity_t *id, char out[12])
{
    char rev[41];
    fake_rev("tgi", id->framework_version, rev);
    memcpy(out, "sha-", 4);
    memcpy(out + 4, rev, 7);
    out[11] = '\0';
}

/* llama.cpp's build_info is "b<build number>-<commit>"; --framework-version gives the first
 * part, or the whole string when it already has a dash. */
static void llamacpp_build_info(const sim_identity_t *id, dp_buf_t *out)
{
    if (strchr(id->framework_version, '-') != NULL) {
        dp_buf_appends(out, id->framework_version);
        return;
    }
    char rev[41];
    fake_rev("llama.cpp", id->framework_version, rev);
    dp_buf_printf(out, "%s-%.7s", id->framework_version, rev);
}

/* The GGUF file type llama.cpp reports (/props model_ftype, /v1/models meta.ftype): the
 * reported quantization ("Q8_0", "Q4_K_M"), or for an unquantized model its dtype as llama.cpp
 * spells it ("F16", "BF16", "F32"). */
static const char *llamacpp_ftype(const sim_identity_t *id)
{
    const char *q = sim_identity_reported_quantization(id);
    if (q[0] != '\0' && strcmp(q, "none") != 0)
        return q;
    if (strcmp(id->dtype, "bfloat16") == 0)
        return "BF16";
    if (strcmp(id->dtype, "float32") == 0)
        return "F32";
    return "F16";
}

bool sim_identity_has_fingerprint(const sim_identity_t *id)
{
    return id->flavor == SIM_FLAVOR_TGI || id->flavor == SIM_FLAVOR_LLAMACPP;
}

void sim_identity_fingerprint(const sim_identity_t *id, dp_buf_t *out)
{
    if (id->flavor == SIM_FLAVOR_TGI) {
        /* TGI: format!("{version}-{docker_label or native}") */
        char label[12];
        tgi_docker_label(id, label);
        dp_buf_printf(out, "%s-%s", id->framework_version, label);
    } else if (id->flavor == SIM_FLAVOR_LLAMACPP) {
        llamacpp_build_info(id, out);
    }
}

static void models_vllm(const sim_identity_t *id, dp_jw_t *w)
{
    char perm[65];
    dp_sha256_hex(id->model, strlen(id->model), perm);
    perm[32] = '\0';
    dp_jw_obj_begin(w, NULL);
    dp_jw_str(w, "id", id->model);
    dp_jw_str(w, "object", "model");
    dp_jw_uint(w, "created", id->created);
    dp_jw_str(w, "owned_by", "vllm");
    dp_jw_str(w, "root", id->model);
    dp_jw_null(w, "parent");
    dp_jw_uint(w, "max_model_len", id->max_model_len);
    dp_jw_arr_begin(w, "permission");
    dp_jw_obj_begin(w, NULL);
    dp_buf_t pid = {0};
    dp_buf_printf(&pid, "modelperm-%s", perm);
    dp_jw_str(w, "id", pid.base);
    dp_buf_free(&pid);
    dp_jw_str(w, "object", "model_permission");
    dp_jw_uint(w, "created", id->created);
    dp_jw_bool(w, "allow_create_engine", false);
    dp_jw_bool(w, "allow_sampling", true);
    dp_jw_bool(w, "allow_logprobs", true);
    dp_jw_bool(w, "allow_search_indices", false);
    dp_jw_bool(w, "allow_view", true);
    dp_jw_bool(w, "allow_fine_tuning", false);
    dp_jw_str(w, "organization", "*");
    dp_jw_null(w, "group");
    dp_jw_bool(w, "is_blocking", false);
    dp_jw_obj_end(w);
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

/* llama-server lists its model twice: first Ollama's way ("models", names only)... */
static void models_ollama(const sim_identity_t *id, dp_jw_t *w)
{
    dp_jw_arr_begin(w, "models");
    dp_jw_obj_begin(w, NULL);
    dp_jw_str(w, "name", id->model);
    dp_jw_str(w, "model", id->model);
    static const char *const empty[] = {"modified_at", "size", "digest"};
    for (size_t i = 0; i < DP_ARRAY_SIZE(empty); i++)
        dp_jw_str(w, empty[i], "");
    dp_jw_str(w, "type", "model");
    dp_jw_str(w, "description", "");
    dp_jw_arr_begin(w, "tags");
    dp_jw_str(w, NULL, "");
    dp_jw_arr_end(w);
    dp_jw_arr_begin(w, "capabilities");
    dp_jw_str(w, NULL, "completion");
    dp_jw_arr_end(w);
    dp_jw_str(w, "parameters", "");
    dp_jw_obj_begin(w, "details");
    dp_jw_str(w, "parent_model", "");
    dp_jw_str(w, "format", "gguf");
    dp_jw_str(w, "family", "");
    dp_jw_arr_begin(w, "families");
    dp_jw_str(w, NULL, "");
    dp_jw_arr_end(w);
    dp_jw_str(w, "parameter_size", "");
    dp_jw_str(w, "quantization_level", "");
    dp_jw_obj_end(w);
    dp_jw_obj_end(w);
    dp_jw_arr_end(w);
}

static void models_json(const sim_identity_t *id, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    if (id->flavor == SIM_FLAVOR_LLAMACPP)
        models_ollama(id, &w); /* ...then OpenAI's ("data") */
    dp_jw_str(&w, "object", "list");
    dp_jw_arr_begin(&w, "data");
    switch (id->flavor) {
    case SIM_FLAVOR_VLLM:
        models_vllm(id, &w);
        break;
    case SIM_FLAVOR_TGI:
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "id", id->model);
        dp_jw_str(&w, "object", "model");
        dp_jw_uint(&w, "created", id->created);
        dp_jw_str(&w, "owned_by", id->model);
        dp_jw_obj_end(&w);
        break;
    case SIM_FLAVOR_SGLANG:
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "id", id->model);
        dp_jw_str(&w, "object", "model");
        dp_jw_uint(&w, "created", id->created);
        dp_jw_str(&w, "owned_by", "sglang");
        dp_jw_str(&w, "root", id->model);
        dp_jw_obj_end(&w);
        break;
    case SIM_FLAVOR_LLAMACPP:
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "id", id->model);
        dp_jw_arr_begin(&w, "aliases");
        dp_jw_str(&w, NULL, id->model);
        dp_jw_arr_end(&w);
        dp_jw_arr_begin(&w, "tags");
        dp_jw_arr_end(&w);
        dp_jw_str(&w, "object", "model");
        dp_jw_uint(&w, "created", dp_wall_ms() / 1000); /* llama-server: the time of the call */
        dp_jw_str(&w, "owned_by", "llamacpp");
        dp_jw_obj_begin(&w, "meta");
        dp_jw_int(&w, "vocab_type", 2);
        dp_jw_int(&w, "n_vocab", 128256);
        dp_jw_uint(&w, "n_ctx", id->max_model_len);
        dp_jw_uint(&w, "n_ctx_train", id->max_model_len);
        dp_jw_int(&w, "n_embd", 4096);
        dp_jw_int(&w, "n_params", 8030261248);
        dp_jw_int(&w, "size", 4912898304);
        dp_jw_str(&w, "ftype", llamacpp_ftype(id));
        dp_jw_obj_end(&w);
        dp_jw_obj_end(&w);
        break;
    }
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
}

/* TGI router/src/lib.rs `Info` as served by TGI 2.0.x. */
static void tgi_info(const sim_identity_t *id, dp_buf_t *out)
{
    char model_sha[41], sha[41], label[12];
    memcpy(model_sha, id->checkpoint_sha256, 40);
    model_sha[40] = '\0'; /* a git revision in real TGI, not a content hash */
    fake_rev("tgi", id->framework_version, sha);
    tgi_docker_label(id, label);
    dp_buf_t dtype = {0};
    dp_buf_printf(&dtype, "torch.%s", id->dtype);

    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "model_id", id->model);
    if (strlen(id->checkpoint_sha256) >= 40)
        dp_jw_str(&w, "model_sha", model_sha);
    else
        dp_jw_null(&w, "model_sha");
    dp_jw_str(&w, "model_dtype", dtype.base);
    dp_jw_str(&w, "model_device_type", "cuda");
    dp_jw_str(&w, "model_pipeline_tag", "text-generation");
    dp_jw_int(&w, "max_concurrent_requests", 128);
    dp_jw_int(&w, "max_best_of", 2);
    dp_jw_int(&w, "max_stop_sequences", 4);
    dp_jw_uint(&w, "max_input_tokens", id->max_model_len - 1);
    dp_jw_uint(&w, "max_total_tokens", id->max_model_len);
    dp_jw_double(&w, "waiting_served_ratio", 0.3);
    dp_jw_int(&w, "max_batch_total_tokens", 16000);
    dp_jw_int(&w, "max_waiting_tokens", 20);
    dp_jw_null(&w, "max_batch_size");
    dp_jw_int(&w, "validation_workers", 2);
    dp_jw_int(&w, "max_client_batch_size", 4);
    dp_jw_str(&w, "router", "text-generation-router");
    dp_jw_str(&w, "version", id->framework_version);
    dp_jw_str(&w, "sha", sha);
    dp_jw_str(&w, "docker_label", label);
    dp_jw_obj_end(&w);
    dp_buf_free(&dtype);
}

static void str_or_null(dp_jw_t *w, const char *key, const char *v)
{
    if (v == NULL || v[0] == '\0' || strcmp(v, "none") == 0)
        dp_jw_null(w, key);
    else
        dp_jw_str(w, key, v);
}

/* SGLang's /get_server_info: dataclasses.asdict(ServerArgs) merged with the scheduler's limits
 * and "version" (sglang 0.3.x). A representative subset of the ~80 server arguments. */
static void sglang_server_info(const sim_identity_t *id, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "model_path", id->model);
    dp_jw_str(&w, "tokenizer_path", id->model);
    dp_jw_str(&w, "tokenizer_mode", "auto");
    dp_jw_bool(&w, "skip_tokenizer_init", false);
    dp_jw_str(&w, "load_format", "auto");
    dp_jw_bool(&w, "trust_remote_code", false);
    dp_jw_str(&w, "dtype", id->dtype);
    dp_jw_str(&w, "kv_cache_dtype", "auto");
    /* ServerArgs.quantization is Optional[str]: null when the model is not quantized. */
    str_or_null(&w, "quantization", sim_identity_reported_quantization(id));
    dp_jw_null(&w, "context_length");
    dp_jw_str(&w, "device", "cuda");
    dp_jw_str(&w, "served_model_name", id->model);
    dp_jw_null(&w, "chat_template");
    dp_jw_bool(&w, "is_embedding", false);
    dp_jw_null(&w, "revision");
    dp_jw_str(&w, "host", "127.0.0.1");
    dp_jw_int(&w, "port", 30000);
    dp_jw_double(&w, "mem_fraction_static", 0.88);
    dp_jw_null(&w, "max_running_requests");
    dp_jw_null(&w, "max_total_tokens");
    dp_jw_int(&w, "chunked_prefill_size", 8192);
    dp_jw_int(&w, "max_prefill_tokens", 16384);
    dp_jw_str(&w, "schedule_policy", "lpm");
    dp_jw_double(&w, "schedule_conservativeness", 1.0);
    dp_jw_int(&w, "tp_size", 1);
    dp_jw_int(&w, "stream_interval", 1);
    dp_jw_int(&w, "random_seed", 42);
    dp_jw_null(&w, "constrained_json_whitespace_pattern");
    dp_jw_double(&w, "watchdog_timeout", 300);
    dp_jw_null(&w, "download_dir");
    dp_jw_int(&w, "base_gpu_id", 0);
    dp_jw_str(&w, "log_level", "info");
    dp_jw_null(&w, "log_level_http");
    dp_jw_bool(&w, "log_requests", false);
    dp_jw_bool(&w, "show_time_cost", false);
    dp_jw_bool(&w, "enable_metrics", false);
    dp_jw_int(&w, "decode_log_interval", 40);
    dp_jw_null(&w, "api_key");
    dp_jw_str(&w, "file_storage_pth", "SGLang_storage");
    dp_jw_bool(&w, "enable_cache_report", false);
    dp_jw_int(&w, "dp_size", 1);
    dp_jw_str(&w, "load_balance_method", "round_robin");
    dp_jw_null(&w, "dist_init_addr");
    dp_jw_int(&w, "nnodes", 1);
    dp_jw_int(&w, "node_rank", 0);
    dp_jw_obj_begin(&w, "json_model_override_args");
    dp_jw_obj_end(&w);
    dp_jw_null(&w, "lora_paths");
    dp_jw_int(&w, "max_loras_per_batch", 8);
    dp_jw_str(&w, "attention_backend", "flashinfer");
    dp_jw_str(&w, "sampling_backend", "flashinfer");
    dp_jw_str(&w, "grammar_backend", "outlines");
    dp_jw_bool(&w, "disable_radix_cache", false);
    dp_jw_bool(&w, "disable_jump_forward", false);
    dp_jw_bool(&w, "disable_cuda_graph", false);
    dp_jw_bool(&w, "disable_cuda_graph_padding", false);
    dp_jw_bool(&w, "disable_disk_cache", false);
    dp_jw_bool(&w, "disable_custom_all_reduce", false);
    dp_jw_bool(&w, "disable_mla", false);
    dp_jw_bool(&w, "disable_penalizer", false);
    dp_jw_bool(&w, "disable_nan_detection", false);
    dp_jw_bool(&w, "enable_overlap_schedule", false);
    dp_jw_bool(&w, "enable_mixed_chunk", false);
    dp_jw_bool(&w, "enable_torch_compile", false);
    dp_jw_int(&w, "torch_compile_max_bs", 32);
    dp_jw_int(&w, "cuda_graph_max_bs", 160);
    dp_jw_str(&w, "torchao_config", "");
    dp_jw_bool(&w, "enable_p2p_check", false);
    dp_jw_bool(&w, "triton_attention_reduce_in_fp32", false);
    dp_jw_int(&w, "num_continuous_decode_steps", 1);
    dp_jw_bool(&w, "delete_ckpt_after_loading", false);
    dp_jw_int(&w, "max_total_num_tokens", 500000);
    dp_jw_uint(&w, "max_req_input_len", id->max_model_len - 5);
    /* ServerArgs field since sglang 0.5.3 (--enable-deterministic-inference). */
    dp_jw_bool(&w, "enable_deterministic_inference", id->deterministic_inference);
    dp_jw_str(&w, "version", id->framework_version);
    dp_jw_obj_end(&w);
}

static const char llama3_template[] =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/* llama-server's /props as build b11669 serves it (tests/unit/data/llamacpp/props-f16.json):
 * the default slot's sampling parameters under "params", model alias, path and file type, a
 * media marker that is random per process, the chat template and its capabilities, the build. */
static void llamacpp_props(const sim_identity_t *id, dp_buf_t *out)
{
    static char marker[64];
    if (marker[0] == '\0') {
        uint8_t raw[16];
        char hex[33];
        dp_random_bytes(raw, sizeof(raw));
        dp_hex(raw, sizeof(raw), hex);
        snprintf(marker, sizeof(marker), "<__media_%s__>", hex);
    }
    dp_buf_t path = {0}, build = {0};
    dp_buf_printf(&path, "/models/%s.gguf", id->model);
    llamacpp_build_info(id, &build);

    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_obj_begin(&w, "default_generation_settings");
    dp_jw_obj_begin(&w, "params");
    dp_jw_uint(&w, "seed", 4294967295u);
    dp_jw_double(&w, "temperature", 0.800000011920929);
    dp_jw_int(&w, "top_k", 40);
    dp_jw_double(&w, "top_p", 0.949999988079071);
    dp_jw_double(&w, "min_p", 0.05000000074505806);
    dp_jw_int(&w, "repeat_last_n", 64);
    dp_jw_double(&w, "repeat_penalty", 1);
    dp_jw_int(&w, "max_tokens", -1);
    dp_jw_int(&w, "n_predict", -1);
    dp_jw_bool(&w, "ignore_eos", false);
    dp_jw_bool(&w, "stream", false);
    dp_jw_arr_begin(&w, "samplers");
    static const char *const samplers[] = {"penalties", "dry",   "top_n_sigma",
                                           "top_k",     "typ_p", "top_p",
                                           "min_p",     "xtc",   "temperature"};
    for (size_t i = 0; i < DP_ARRAY_SIZE(samplers); i++)
        dp_jw_str(&w, NULL, samplers[i]);
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
    dp_jw_uint(&w, "n_ctx", id->max_model_len);
    dp_jw_obj_end(&w);
    dp_jw_uint(&w, "total_slots", id->total_slots);
    dp_jw_str(&w, "model_alias", id->model);
    dp_jw_str(&w, "model_ftype", llamacpp_ftype(id));
    dp_jw_str(&w, "model_path", path.base);
    dp_jw_obj_begin(&w, "modalities");
    dp_jw_bool(&w, "vision", false);
    dp_jw_bool(&w, "video", false);
    dp_jw_bool(&w, "audio", false);
    dp_jw_obj_end(&w);
    dp_jw_str(&w, "media_marker", marker);
    dp_jw_bool(&w, "endpoint_slots", true);
    dp_jw_bool(&w, "endpoint_props", false);
    dp_jw_bool(&w, "endpoint_metrics", false);
    dp_jw_str(&w, "chat_template", llama3_template);
    dp_jw_str(&w, "bos_token", "<|begin_of_text|>");
    dp_jw_str(&w, "eos_token", "<|eot_id|>");
    dp_jw_str(&w, "build_info", build.base);
    dp_jw_bool(&w, "is_sleeping", false);
    dp_jw_obj_end(&w);
    dp_buf_free(&path);
    dp_buf_free(&build);
}

static bool path_is(const char *path, size_t n, const char *want)
{
    return strlen(want) == n && memcmp(path, want, n) == 0;
}

int sim_flavor_get(const sim_identity_t *id, const char *path, size_t n, dp_buf_t *out,
                   const char **ctype)
{
    *ctype = "application/json";
    if (path_is(path, n, "/health")) {
        if (id->flavor == SIM_FLAVOR_LLAMACPP) {
            dp_buf_appends(out, "{\"status\":\"ok\"}");
        } else {
            /* vLLM, TGI and SGLang answer 200 with an empty body. */
            *ctype = NULL;
        }
        return 200;
    }
    if (path_is(path, n, "/v1/models")) {
        models_json(id, out);
        return 200;
    }
    switch (id->flavor) {
    case SIM_FLAVOR_VLLM:
        if (path_is(path, n, "/version")) {
            dp_jw_t w;
            dp_jw_init(&w, out);
            dp_jw_obj_begin(&w, NULL);
            dp_jw_str(&w, "version", id->framework_version);
            dp_jw_obj_end(&w);
            return 200;
        }
        break;
    case SIM_FLAVOR_TGI:
        if (path_is(path, n, "/info")) {
            tgi_info(id, out);
            return 200;
        }
        break;
    case SIM_FLAVOR_SGLANG:
        if (path_is(path, n, "/get_server_info")) {
            sglang_server_info(id, out);
            return 200;
        }
        if (path_is(path, n, "/get_model_info")) {
            dp_jw_t w;
            dp_jw_init(&w, out);
            dp_jw_obj_begin(&w, NULL);
            dp_jw_str(&w, "model_path", id->model);
            dp_jw_str(&w, "tokenizer_path", id->model);
            dp_jw_bool(&w, "is_generation", true);
            dp_jw_obj_end(&w);
            return 200;
        }
        break;
    case SIM_FLAVOR_LLAMACPP:
        if (path_is(path, n, "/props")) {
            llamacpp_props(id, out);
            return 200;
        }
        break;
    }
    return 0;
}

int sim_flavor_not_found(const sim_identity_t *id, dp_buf_t *out, const char **ctype)
{
    switch (id->flavor) {
    case SIM_FLAVOR_VLLM:
    case SIM_FLAVOR_SGLANG:
        /* FastAPI / Starlette */
        *ctype = "application/json";
        dp_buf_appends(out, "{\"detail\":\"Not Found\"}");
        break;
    case SIM_FLAVOR_TGI:
        /* axum's fallback: empty 404 */
        *ctype = NULL;
        break;
    case SIM_FLAVOR_LLAMACPP:
        *ctype = "text/plain";
        dp_buf_appends(out, "File Not Found");
        break;
    }
    return 404;
}
