/* Native adapters: parse vLLM, TGI, SGLang and llama.cpp metadata (see adapters.h and the shapes
 * with their sources in docs/attestation.md). Rule of the file: a field is set only from a value
 * the framework itself reported; everything else gets an unattested note saying why. */
#include "attest/adapters.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "attest/json.h"
#include "common/util.h"

/* Parse body i of an adapter into a JSON object. Returns the tree (caller deletes), or NULL:
 * with *absent set when the GET did not answer 200, else with a reason appended to *why. */
static cJSON *body_object(const char *name, const char *path, const dp_iovec_t *b, bool *absent,
                          dp_buf_t *why)
{
    *absent = false;
    if (b == NULL || b->base == NULL) {
        *absent = true;
        return NULL;
    }
    if (b->len > ATTEST_ADAPTER_MAX_BODY) {
        dp_buf_printf(why, "%s GET %s: body too large (%zu bytes)", name, path, b->len);
        return NULL;
    }
    const char *bad = NULL;
    cJSON *root = attest_json_parse(b->base, b->len, &bad);
    if (root == NULL) {
        dp_buf_printf(why, "%s GET %s: %s", name, path, bad);
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        dp_buf_printf(why, "%s GET %s: expected a JSON object", name, path);
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

static const char *str_member(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* A string member that must be a string when present: -1 with a reason when it is not. */
static int typed_str(const char *name, const char *path, const cJSON *o, const char *key,
                     const char **out, dp_buf_t *why)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    *out = NULL;
    if (v == NULL || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsString(v)) {
        dp_buf_printf(why, "%s GET %s: %s is not a string", name, path, key);
        return -1;
    }
    *out = v->valuestring;
    return 0;
}

static void note(attest_report_t *r, attest_field_t f, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void note(attest_report_t *r, attest_field_t f, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tmp, sizeof(tmp), fmt, ap);
    va_end(ap);
    attest_report_set_unattested(r, f, tmp);
}

/* What the engine says it loaded (report.h, model_path): kept beside the identity, not in it. */
static void set_model_path(attest_report_t *out, const char *path)
{
    free(out->model_path);
    out->model_path = path && path[0] ? dp_xstrdup(path) : NULL;
}

static void begin(attest_report_t *out, const char *name)
{
    attest_report_clear(out);
    snprintf(out->source, sizeof(out->source), "%s", name);
}

/* The "data" array of an OpenAI-shaped model list, or NULL with a reason. */
static const cJSON *model_list(const char *name, const char *path, const cJSON *root, dp_buf_t *why)
{
    const cJSON *data = cJSON_GetObjectItemCaseSensitive(root, "data");
    if (!cJSON_IsArray(data)) {
        dp_buf_printf(why, "%s GET %s: no data array", name, path);
        return NULL;
    }
    return data;
}

/* ---- vLLM: GET /v1/models, GET /version ----------------------------------------------------
 * /v1/models lists the served model names (ModelCard id; `parent` is null for the base model,
 * the base name for a LoRA adapter) with owned_by "vllm"; /version is {"version": "0.6.3"}. */
static int parse_vllm(const dp_iovec_t *bodies, size_t nbodies, attest_report_t *out, dp_buf_t *why)
{
    int rc = -1;
    bool absent;
    cJSON *models = NULL, *ver = NULL;
    begin(out, "vllm");
    models = body_object("vllm", "/v1/models", nbodies > 0 ? &bodies[0] : NULL, &absent, why);
    if (models == NULL) {
        if (absent)
            dp_buf_appends(why, "vllm GET /v1/models: no answer");
        goto out;
    }
    const cJSON *data = model_list("vllm", "/v1/models", models, why);
    if (data == NULL)
        goto out;
    const cJSON *base = NULL, *e;
    cJSON_ArrayForEach(e, data)
    {
        const cJSON *parent = cJSON_GetObjectItemCaseSensitive(e, "parent");
        /* The first base model is the primary --served-model-name; later ones are aliases,
         * entries with a parent are LoRA adapters riding on it. */
        if (cJSON_IsObject(e) && str_member(e, "id") && (parent == NULL || cJSON_IsNull(parent))) {
            base = e;
            break;
        }
    }
    if (base == NULL) {
        dp_buf_appends(why, "vllm GET /v1/models: no base model (entry without parent) in data");
        goto out;
    }
    attest_report_set(out, ATTEST_F_MODEL, str_member(base, "id"));
    set_model_path(out, str_member(base, "root"));
    const char *owner = str_member(base, "owned_by");
    if (owner)
        attest_report_set(out, ATTEST_F_FRAMEWORK_NAME, owner);
    else
        note(out, ATTEST_F_FRAMEWORK_NAME, "vllm /v1/models entry has no owned_by");

    ver = body_object("vllm", "/version", nbodies > 1 ? &bodies[1] : NULL, &absent, why);
    if (ver == NULL && !absent)
        goto out;
    const char *v = NULL;
    if (ver && typed_str("vllm", "/version", ver, "version", &v, why) != 0)
        goto out;
    if (v)
        attest_report_set(out, ATTEST_F_FRAMEWORK_VERSION, v);
    else
        note(out, ATTEST_F_FRAMEWORK_VERSION, "vllm GET /version gave no version");
    note(out, ATTEST_F_CHECKPOINT,
         "vllm adapter does not report it: run the agent for a content hash");
    note(out, ATTEST_F_DETERMINISM, "vllm adapter cannot: run the agent with --determinism");
    rc = 0;
out:
    cJSON_Delete(models);
    cJSON_Delete(ver);
    if (rc != 0)
        begin(out, "vllm");
    return rc;
}

/* ---- TGI: GET /info ---------------------------------------------------------------------------
 * {"model_id","model_sha","model_dtype":"torch.float16","model_device_type",
 *  "model_pipeline_tag","max_concurrent_requests",...,"router":"text-generation-router",
 *  "version","sha","docker_label"}. model_dtype is absent from some releases' /info; router was
 * added in 2.0.x. model_sha is the Hub git revision, not a content hash of the weights. */
static int parse_tgi(const dp_iovec_t *bodies, size_t nbodies, attest_report_t *out, dp_buf_t *why)
{
    int rc = -1;
    bool absent;
    begin(out, "tgi");
    cJSON *info = body_object("tgi", "/info", nbodies > 0 ? &bodies[0] : NULL, &absent, why);
    if (info == NULL) {
        if (absent)
            dp_buf_appends(why, "tgi GET /info: no answer");
        goto out;
    }
    const char *model = NULL, *dtype = NULL, *version = NULL, *router = NULL;
    const char *quant = str_member(info, "quantize"); /* not in released /info shapes */
    if (typed_str("tgi", "/info", info, "model_id", &model, why) != 0 ||
        typed_str("tgi", "/info", info, "model_dtype", &dtype, why) != 0 ||
        typed_str("tgi", "/info", info, "version", &version, why) != 0 ||
        typed_str("tgi", "/info", info, "router", &router, why) != 0)
        goto out;
    if (model == NULL) {
        dp_buf_appends(why, "tgi GET /info: no model_id");
        goto out;
    }
    attest_report_set(out, ATTEST_F_MODEL, model);
    set_model_path(out, model); /* --model-id: a Hub id, or the local folder it loaded */

    /* Name: the router says which server this is; before the router field existed, the /info
     * shape (model_id + version + max_concurrent_requests) is TGI's own. */
    if (router) {
        if (strncmp(router, "text-generation-router", 22) == 0)
            attest_report_set(out, ATTEST_F_FRAMEWORK_NAME, "tgi");
        else
            attest_report_set(out, ATTEST_F_FRAMEWORK_NAME, router);
    } else if (version &&
               cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(info, "max_concurrent_requests"))) {
        attest_report_set(out, ATTEST_F_FRAMEWORK_NAME, "tgi");
    } else {
        note(out, ATTEST_F_FRAMEWORK_NAME, "tgi /info does not identify the server");
    }
    if (version)
        attest_report_set(out, ATTEST_F_FRAMEWORK_VERSION, version);
    else
        note(out, ATTEST_F_FRAMEWORK_VERSION, "tgi /info has no version");

    /* "torch.float16" -> "float16": manifests name dtypes the way vLLM and SGLang flags do. */
    if (dtype) {
        attest_report_set(out, ATTEST_F_DTYPE,
                          strncmp(dtype, "torch.", 6) == 0 ? dtype + 6 : dtype);
    } else {
        note(out, ATTEST_F_DTYPE, "this TGI version's /info has no model_dtype");
    }
    note(out, ATTEST_F_CHECKPOINT,
         "tgi reports only model_sha, the Hub revision, not a content hash: run the agent");
    if (quant)
        attest_report_set(out, ATTEST_F_QUANTIZATION, quant); /* a build whose /info has it */
    else
        note(out, ATTEST_F_QUANTIZATION,
             "tgi adapter does not report it (--quantize is not in /info)");
    rc = 0;
out:
    cJSON_Delete(info);
    if (rc != 0)
        begin(out, "tgi");
    return rc;
}

/* ---- SGLang: GET /get_server_info ----------------------------------------------------------
 * Every ServerArgs field (model_path, served_model_name, dtype, quantization, ...) merged with
 * scheduler info, "internal_states" and "version". served_model_name defaults to model_path.
 * dtype is the launch flag (default "auto") and quantization the flag (default null): SGLang
 * resolves both from the checkpoint's config at load time and does not report the result. */
static int parse_sglang(const dp_iovec_t *bodies, size_t nbodies, attest_report_t *out,
                        dp_buf_t *why)
{
    int rc = -1;
    bool absent;
    begin(out, "sglang");
    cJSON *info =
        body_object("sglang", "/get_server_info", nbodies > 0 ? &bodies[0] : NULL, &absent, why);
    if (info == NULL) {
        if (absent)
            dp_buf_appends(why, "sglang GET /get_server_info: no answer");
        goto out;
    }
    const char *served = NULL, *path = NULL, *dtype = NULL, *quant = NULL, *version = NULL;
    if (typed_str("sglang", "/get_server_info", info, "served_model_name", &served, why) != 0 ||
        typed_str("sglang", "/get_server_info", info, "model_path", &path, why) != 0 ||
        typed_str("sglang", "/get_server_info", info, "dtype", &dtype, why) != 0 ||
        typed_str("sglang", "/get_server_info", info, "quantization", &quant, why) != 0 ||
        typed_str("sglang", "/get_server_info", info, "version", &version, why) != 0)
        goto out;
    if (served == NULL && path == NULL) {
        dp_buf_appends(why, "sglang GET /get_server_info: no served_model_name or model_path");
        goto out;
    }
    attest_report_set(out, ATTEST_F_MODEL, served ? served : path);
    set_model_path(out, path);
    if (version) {
        attest_report_set(out, ATTEST_F_FRAMEWORK_NAME, "sglang");
        attest_report_set(out, ATTEST_F_FRAMEWORK_VERSION, version);
    } else {
        note(out, ATTEST_F_FRAMEWORK_NAME, "sglang /get_server_info has no version");
        note(out, ATTEST_F_FRAMEWORK_VERSION, "sglang /get_server_info has no version");
    }
    if (dtype && strcmp(dtype, "auto") != 0)
        attest_report_set(out, ATTEST_F_DTYPE, dtype);
    else
        note(out, ATTEST_F_DTYPE,
             "sglang reports dtype \"auto\", the launch flag, not the resolved dtype: "
             "start it with --dtype");
    if (quant)
        attest_report_set(out, ATTEST_F_QUANTIZATION, quant);
    else
        note(out, ATTEST_F_QUANTIZATION,
             "sglang reports quantization null (no --quantization flag; the checkpoint config "
             "may still quantize): start it with --quantization");
    note(out, ATTEST_F_CHECKPOINT, "sglang adapter does not report it: run the agent");
    /* --enable-deterministic-inference (SGLang 0.5.3+): batch-invariant kernels. */
    const cJSON *det = cJSON_GetObjectItemCaseSensitive(info, "enable_deterministic_inference");
    if (cJSON_IsTrue(det))
        attest_report_set(out, ATTEST_F_DETERMINISM, "batch_invariant");
    else if (cJSON_IsFalse(det))
        note(out, ATTEST_F_DETERMINISM, "sglang enable_deterministic_inference is false");
    else if (det == NULL || cJSON_IsNull(det))
        note(out, ATTEST_F_DETERMINISM,
             "this SGLang's /get_server_info has no enable_deterministic_inference");
    else
        note(out, ATTEST_F_DETERMINISM, "sglang enable_deterministic_inference is not a boolean");
    rc = 0;
out:
    cJSON_Delete(info);
    if (rc != 0)
        begin(out, "sglang");
    return rc;
}

/* A slot's one `is_processing` (cJSON keeps a repeated key, however escaped, as a second
 * member: such a slot says nothing, since parsers differ on which one counts). */
static const cJSON *slot_processing(const cJSON *slot)
{
    const cJSON *found = NULL, *m;
    if (!cJSON_IsObject(slot))
        return NULL;
    cJSON_ArrayForEach(m, slot)
    {
        if (m->string && strcmp(m->string, "is_processing") == 0) {
            if (found)
                return NULL;
            found = m;
        }
    }
    return cJSON_IsBool(found) ? found : NULL;
}

/* /slots: [{"id":0,"n_ctx":512,"speculative":false,"is_processing":false,"id_task",...},...],
 * one object per slot (b11669). The whole body is that array and nothing after it. */
int attest_llamacpp_slots_idle(const char *body, size_t len)
{
    const char *bad = NULL;
    cJSON *a = attest_json_parse(body, len, &bad);
    int idle = -1;
    if (cJSON_IsArray(a) && cJSON_GetArraySize(a) > 0) {
        idle = 1;
        const cJSON *s;
        cJSON_ArrayForEach(s, a)
        {
            const cJSON *p = slot_processing(s);
            if (p == NULL) {
                idle = -1; /* even after a busy one: the answer is not what it should be */
                break;
            }
            if (cJSON_IsTrue(p))
                idle = 0;
        }
    }
    cJSON_Delete(a);
    return idle;
}

/* ---- llama.cpp server: GET /props, GET /v1/models -------------------------------------------
 * Captured from llama-server b11669-Debian in tests/unit/data/llamacpp/:
 * /props: {"default_generation_settings":{...},"total_slots","model_alias","model_ftype":"F16",
 *          "model_path","media_marker":<random per process>,"chat_template",
 *          "build_info":"b11669-Debian",...}  (older builds: no model_ftype);
 * /v1/models: {"models":[<Ollama-style entries>],"object":"list","data":[{"id":<--alias, else
 *          the model path>,"aliases","object":"model","created":<now>,"owned_by":"llamacpp",
 *          "meta":{"n_params","size","ftype":"F16",...}}]}.
 * model_ftype is the GGUF file type as llama.cpp names it (F16, Q8_0, Q4_K_M): the quantization.
 * /version is 404 on llama-server: the version is build_info. */
static int parse_llamacpp(const dp_iovec_t *bodies, size_t nbodies, attest_report_t *out,
                          dp_buf_t *why)
{
    int rc = -1;
    bool absent;
    cJSON *props = NULL, *models = NULL;
    begin(out, "llamacpp");
    props = body_object("llamacpp", "/props", nbodies > 0 ? &bodies[0] : NULL, &absent, why);
    if (props == NULL) {
        if (absent)
            dp_buf_appends(why, "llamacpp GET /props: no answer");
        goto out;
    }
    const char *build = NULL, *ftype = NULL;
    if (typed_str("llamacpp", "/props", props, "build_info", &build, why) != 0 ||
        typed_str("llamacpp", "/props", props, "model_ftype", &ftype, why) != 0)
        goto out;
    set_model_path(out, str_member(props, "model_path")); /* the GGUF file -m named */
    if (build) {
        attest_report_set(out, ATTEST_F_FRAMEWORK_NAME, "llamacpp");
        attest_report_set(out, ATTEST_F_FRAMEWORK_VERSION, build);
        /* llama-server answers every completion with system_fingerprint = build_info: the
         * engine fingerprint is read here, and no probe completion is needed (one request
         * fewer beside client traffic on a one-sequence server). */
        attest_report_set(out, ATTEST_F_ENGINE_FINGERPRINT, build);
    } else {
        note(out, ATTEST_F_FRAMEWORK_NAME, "this llama.cpp /props has no build_info");
        note(out, ATTEST_F_FRAMEWORK_VERSION, "this llama.cpp /props has no build_info");
    }

    models = body_object("llamacpp", "/v1/models", nbodies > 1 ? &bodies[1] : NULL, &absent, why);
    if (models == NULL && !absent)
        goto out;
    const char *id = NULL;
    if (models) {
        /* "data", not the Ollama-style "models" list beside it (names without paths). */
        const cJSON *data = model_list("llamacpp", "/v1/models", models, why);
        if (data == NULL)
            goto out;
        const cJSON *first = cJSON_GetArrayItem(data, 0);
        id = cJSON_IsObject(first) ? str_member(first, "id") : NULL;
    }
    if (id)
        attest_report_set(out, ATTEST_F_MODEL, id);
    else
        note(out, ATTEST_F_MODEL, "llamacpp GET /v1/models gave no model id");
    if (ftype)
        attest_report_set(out, ATTEST_F_QUANTIZATION, ftype);
    else
        note(out, ATTEST_F_QUANTIZATION,
             "this llama.cpp /props has no model_ftype (builds before it was added)");
    note(out, ATTEST_F_CHECKPOINT, "llamacpp adapter does not report it: run the agent");
    /* One slot (--parallel 1) is one sequence at a time: no batch to vary with. */
    const cJSON *slots = cJSON_GetObjectItemCaseSensitive(props, "total_slots");
    if (cJSON_IsNumber(slots) && slots->valuedouble == 1)
        attest_report_set(out, ATTEST_F_DETERMINISM, "batch_invariant");
    else if (cJSON_IsNumber(slots))
        note(out, ATTEST_F_DETERMINISM, "llamacpp total_slots is %.0f, batch_invariant needs 1",
             slots->valuedouble >= 0 && slots->valuedouble < 1e9 ? slots->valuedouble : -1);
    else
        note(out, ATTEST_F_DETERMINISM, "this llama.cpp /props has no total_slots");
    rc = 0;
out:
    cJSON_Delete(props);
    cJSON_Delete(models);
    if (rc != 0)
        begin(out, "llamacpp");
    return rc;
}

/* ---- the engine fingerprint: a 1-token probe completion ------------------------------------ */

/* vLLM's dtype word in its fingerprint, in the spelling manifests use ("float16":
 * docs/attestation.md §5, "The engine fingerprint"). */
static const char *dtype_word(const char *s, size_t n)
{
    static const struct {
        const char *short_name, *name;
    } map[] = {{"bf16", "bfloat16"}, {"fp16", "float16"}, {"f16", "float16"},
               {"fp32", "float32"},  {"f32", "float32"},  {"half", "float16"}};
    for (size_t i = 0; i < DP_ARRAY_SIZE(map); i++)
        if (strlen(map[i].short_name) == n && strncmp(s, map[i].short_name, n) == 0)
            return map[i].name;
    return NULL;
}

/* "vllm-<version>-<gpu>-tp<N>-<dtype>-<hash8>": parsed from the right, so a GPU name with
 * dashes ("A100-SXM4-80GB") stays whole. Fields the adapter already has are kept. */
static bool parse_vllm_fingerprint(const char *fp, attest_report_t *out)
{
    size_t n = strlen(fp);
    if (n < 5 || strncmp(fp, "vllm-", 5) != 0 || n > 256)
        return false;
    const char *end = fp + n, *dash[3];
    const char *p = end;
    for (int i = 0; i < 3; i++) {
        while (p > fp + 5 && p[-1] != '-')
            p--;
        if (p <= fp + 5)
            return false;
        dash[i] = p - 1; /* dash[0] before hash, [1] before dtype, [2] before tpN */
        p--;
    }
    const char *hash = dash[0] + 1, *dtype = dash[1] + 1, *tp = dash[2] + 1;
    if ((size_t)(end - hash) != 8 || !dp_is_lower_hex(hash, 8))
        return false;
    if (tp[0] != 't' || tp[1] != 'p' || dtype - 1 - (tp + 2) < 1 || dtype - 1 - (tp + 2) > 4)
        return false;
    unsigned tpn = 0;
    for (const char *c = tp + 2; c < dtype - 1; c++) {
        if (*c < '0' || *c > '9')
            return false;
        tpn = tpn * 10 + (unsigned)(*c - '0');
    }
    const char *ver = fp + 5, *vend = memchr(ver, '-', (size_t)(tp - 1 - ver));
    if (vend == NULL || vend == ver || vend + 1 >= tp - 1)
        return false; /* no version or no GPU */
    char tmp[257];
    if (out->framework_name == NULL)
        attest_report_set(out, ATTEST_F_FRAMEWORK_NAME, "vllm");
    if (out->framework_version == NULL) {
        snprintf(tmp, sizeof(tmp), "%.*s", (int)(vend - ver), ver);
        attest_report_set(out, ATTEST_F_FRAMEWORK_VERSION, tmp);
    }
    size_t dn = (size_t)(dash[0] - dtype);
    const char *dname = dtype_word(dtype, dn);
    if (out->dtype == NULL) {
        snprintf(tmp, sizeof(tmp), "%.*s", (int)dn, dtype);
        attest_report_set(out, ATTEST_F_DTYPE, dname ? dname : tmp);
    }
    free(out->engine_hardware);
    out->engine_hardware = dp_xstrndup(vend + 1, (size_t)(tp - 1 - (vend + 1)));
    out->engine_tp = tpn;
    return true;
}

void attest_engine_fingerprint_set(attest_report_t *out, const char *fp)
{
    attest_report_set(out, ATTEST_F_ENGINE_FINGERPRINT, fp);
    if (fp)
        parse_vllm_fingerprint(fp, out);
}

/* Printable ASCII that JSON never escapes: the data path compares responses' fingerprints byte
 * for byte (other bytes read as '?', a stream's escapes as written), so only such a value can
 * match there on every response. */
static bool plain_ascii(const char *s)
{
    for (; *s; s++)
        if (*s < 0x20 || *s > 0x7e || *s == '"' || *s == '\\')
            return false;
    return true;
}

void attest_adapter_probe_parse(const dp_iovec_t *body, attest_report_t *out)
{
    cJSON *doc = body && body->base ? cJSON_ParseWithLength(body->base, body->len) : NULL;
    const char *fp = cJSON_IsObject(doc) ? str_member(doc, "system_fingerprint") : NULL;
    bool plain = fp && plain_ascii(fp);
    if (fp && fp[0] && strlen(fp) <= ATTEST_FINGERPRINT_MAX && plain)
        attest_engine_fingerprint_set(out, fp);
    else
        note(out, ATTEST_F_ENGINE_FINGERPRINT, "%s",
             body == NULL || body->base == NULL ? "the 1-token probe completion failed"
             : doc == NULL                      ? "the probe completion is not JSON"
             : fp && fp[0] && !plain ? "the engine's system_fingerprint is not plain visible ASCII"
             : fp && fp[0]           ? "the engine's system_fingerprint is too long"
                                     : "the engine puts no system_fingerprint on responses");
    cJSON_Delete(doc);
}

static const attest_adapter_t adapters[] = {
    {CFG_ATTEST_VLLM, "vllm", 2, {"/v1/models", "/version"}, {true, false}, parse_vllm},
    {CFG_ATTEST_TGI, "tgi", 1, {"/info"}, {true}, parse_tgi},
    {CFG_ATTEST_SGLANG, "sglang", 1, {"/get_server_info"}, {true}, parse_sglang},
    {CFG_ATTEST_LLAMACPP, "llamacpp", 2, {"/props", "/v1/models"}, {true, false}, parse_llamacpp},
};

const attest_adapter_t *attest_adapter_for(cfg_attest_source_t source)
{
    for (size_t i = 0; i < DP_ARRAY_SIZE(adapters); i++)
        if (adapters[i].source == source)
            return &adapters[i];
    return NULL;
}

const attest_adapter_t *attest_adapter_by_name(const char *name)
{
    for (size_t i = 0; i < DP_ARRAY_SIZE(adapters); i++)
        if (strcmp(adapters[i].name, name) == 0)
            return &adapters[i];
    return NULL;
}
