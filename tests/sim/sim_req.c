#include "tests/sim/sim_req.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/buf.h"

static int fail(sim_req_err_t *err, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int fail(sim_req_err_t *err, const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
    err->param = param;
    return -1;
}

/* cJSON keeps numbers as doubles: an integer is a finite double with no fractional part. Values
 * at or beyond 2^63 cannot be an int64 and are refused rather than wrapped. */
static bool as_int64(const cJSON *v, int64_t *out)
{
    if (!cJSON_IsNumber(v))
        return false;
    double d = v->valuedouble;
    if (!isfinite(d) || d != floor(d) || d < -9223372036854775808.0 || d >= 9223372036854775808.0)
        return false;
    *out = (int64_t)d;
    return true;
}

/* ---- raw literals: cJSON turns every number into a double, so a seed above 2^53 would
 * merge with its neighbours and one above 2^63 - 512 would round out of range. The body has
 * already been validated by cJSON; these helpers only find spans in it. */

static size_t skip_ws(const char *s, size_t i, size_t n)
{
    while (i < n && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r'))
        i++;
    return i;
}

/* s[i] is '"': the index just past the closing quote. */
static size_t skip_string(const char *s, size_t i, size_t n)
{
    for (i++; i < n && s[i] != '"'; i++)
        if (s[i] == '\\')
            i++;
    return i + 1;
}

static size_t skip_value(const char *s, size_t i, size_t n)
{
    if (i < n && s[i] == '"')
        return skip_string(s, i, n);
    int depth = 0;
    for (; i < n; i++) {
        char c = s[i];
        if (c == '"') {
            i = skip_string(s, i, n) - 1;
        } else if (c == '{' || c == '[') {
            depth++;
        } else if (c == '}' || c == ']') {
            if (depth == 0)
                return i;
            if (--depth == 0)
                return i + 1;
        } else if (depth == 0 && (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r')) {
            return i;
        }
    }
    return i;
}

/* The raw text of the last top-level member called `name` (keys compared after unescaping,
 * as cJSON compares them), so the literal is the one field() picked. */
static bool raw_member(const char *s, size_t n, const char *name, const char **out, size_t *len)
{
    bool found = false;
    size_t i = skip_ws(s, 0, n) + 1; /* past '{' */
    while ((i = skip_ws(s, i, n)) < n && s[i] == '"') {
        size_t k = i, kend = skip_string(s, i, n);
        bool match;
        if (memchr(s + k, '\\', kend - k) == NULL) {
            match = kend - k - 2 == strlen(name) && memcmp(s + k + 1, name, kend - k - 2) == 0;
        } else {
            cJSON *key = cJSON_ParseWithLength(s + k, kend - k);
            match = cJSON_IsString(key) && strcmp(key->valuestring, name) == 0;
            cJSON_Delete(key);
        }
        i = skip_ws(s, skip_ws(s, kend, n) + 1, n); /* past ':' */
        size_t vend = skip_value(s, i, n);
        if (match) {
            *out = s + i;
            *len = vend - i;
            found = true;
        }
        i = skip_ws(s, vend, n);
        if (i >= n || s[i] != ',')
            break;
        i++;
    }
    return found;
}

/* A JSON integer literal ("-"? digits) in the int64 range, read exactly. Other number forms
 * (a fraction or exponent, `5.0`, `1e3`) are whole doubles: as_int64 takes them. */
static int raw_int64(const char *p, size_t n, int64_t *out)
{
    size_t i = p[0] == '-';
    if (n <= i || n > 24)
        return 1;
    for (size_t k = i; k < n; k++)
        if (p[k] < '0' || p[k] > '9')
            return 1; /* not an integer literal */
    uint64_t v = 0;
    for (size_t k = i; k < n; k++) {
        unsigned d = (unsigned)(p[k] - '0');
        if (v > (UINT64_MAX - d) / 10)
            return -1;
        v = v * 10 + d;
    }
    if (i ? v > (uint64_t)INT64_MAX + 1 : v > (uint64_t)INT64_MAX)
        return -1;
    *out = i ? (int64_t)(0 - v) : (int64_t)v;
    return 0;
}

/* Absent or JSON null both mean "not given". With duplicate keys the *last* one wins, as in
 * the Python servers being simulated (cJSON's own look-up returns the first): a body whose
 * duplicates slipped past a proxy then behaves here as it would on vLLM. */
static const cJSON *field(const cJSON *o, const char *name)
{
    const cJSON *v = NULL, *it;
    cJSON_ArrayForEach(it, o)
    {
        if (it->string && strcmp(it->string, name) == 0)
            v = it;
    }
    return cJSON_IsNull(v) ? NULL : v;
}

static int parse_prompt(sim_req_t *r, const cJSON *p, sim_req_err_t *err)
{
    if (p == NULL)
        return fail(err, "prompt", "`prompt` is required");
    if (cJSON_IsString(p)) {
        r->prompts = dp_xcalloc(1, sizeof(*r->prompts));
        r->nprompts = 1;
        sim_prompt_init(&r->prompts[0]);
        sim_prompt_add_text(&r->prompts[0], p->valuestring, strlen(p->valuestring));
        return 0;
    }
    if (!cJSON_IsArray(p))
        return fail(err, "prompt",
                    "`prompt` must be a string, an array of strings, an array of "
                    "token ids or an array of token id arrays");
    int count = cJSON_GetArraySize(p);
    if (count == 0)
        return fail(err, "prompt", "`prompt` must not be empty");
    const cJSON *first = cJSON_GetArrayItem(p, 0);
    if (cJSON_IsNumber(first)) {
        /* One prompt given as token ids. */
        r->prompts = dp_xcalloc(1, sizeof(*r->prompts));
        r->nprompts = 1;
        sim_prompt_init(&r->prompts[0]);
        const cJSON *t;
        cJSON_ArrayForEach(t, p)
        {
            int64_t id;
            if (!as_int64(t, &id) || id < 0)
                return fail(err, "prompt", "token ids in `prompt` must be non-negative integers");
            sim_prompt_add_token(&r->prompts[0], id);
        }
        return 0;
    }
    if (count > SIM_REQ_MAX_PROMPTS)
        return fail(err, "prompt", "at most %d prompts per request", SIM_REQ_MAX_PROMPTS);
    r->prompts = dp_xcalloc((size_t)count, sizeof(*r->prompts));
    r->nprompts = (size_t)count;
    size_t i = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, p)
    {
        sim_prompt_t *pr = &r->prompts[i++];
        sim_prompt_init(pr);
        if (cJSON_IsString(e)) {
            sim_prompt_add_text(pr, e->valuestring, strlen(e->valuestring));
        } else if (cJSON_IsArray(e)) {
            const cJSON *t;
            cJSON_ArrayForEach(t, e)
            {
                int64_t id;
                if (!as_int64(t, &id) || id < 0)
                    return fail(err, "prompt",
                                "token ids in `prompt` must be non-negative integers");
                sim_prompt_add_token(pr, id);
            }
        } else {
            return fail(err, "prompt",
                        "each entry of `prompt` must be a string or an array of "
                        "token ids");
        }
    }
    return 0;
}

/* Render the conversation the way a chat template would, closely enough for a hash:
 * "<|role|> content" per message, then "<|assistant|>" for the reply. */
static int parse_messages(sim_req_t *r, const cJSON *m, sim_req_err_t *err)
{
    if (m == NULL)
        return fail(err, "messages", "`messages` is required");
    if (!cJSON_IsArray(m) || cJSON_GetArraySize(m) == 0)
        return fail(err, "messages", "`messages` must be a non-empty array");
    dp_buf_t text = {0};
    int rc = 0;
    const cJSON *msg;
    cJSON_ArrayForEach(msg, m)
    {
        if (!cJSON_IsObject(msg)) {
            rc = fail(err, "messages", "each message must be an object");
            goto out;
        }
        const cJSON *role = field(msg, "role");
        if (!cJSON_IsString(role)) {
            rc = fail(err, "messages", "each message needs a string `role`");
            goto out;
        }
        dp_buf_printf(&text, "<|%s|> ", role->valuestring);
        const cJSON *content = field(msg, "content");
        if (content == NULL) {
            /* assistant turns with tool calls have null content */
        } else if (cJSON_IsString(content)) {
            dp_buf_appends(&text, content->valuestring);
        } else if (cJSON_IsArray(content)) {
            const cJSON *part;
            cJSON_ArrayForEach(part, content)
            {
                const cJSON *type = field(part, "type");
                if (!cJSON_IsObject(part) || !cJSON_IsString(type)) {
                    rc = fail(err, "messages",
                              "each content part must be an object with a "
                              "string `type`");
                    goto out;
                }
                if (strcmp(type->valuestring, "text") != 0 &&
                    strcmp(type->valuestring, "input_text") != 0 &&
                    strcmp(type->valuestring, "output_text") != 0)
                    continue; /* images and audio do not reach the toy model */
                const cJSON *t = field(part, "text");
                if (!cJSON_IsString(t)) {
                    rc = fail(err, "messages", "a text content part needs a string `text`");
                    goto out;
                }
                dp_buf_appends(&text, t->valuestring);
            }
        } else {
            rc = fail(err, "messages",
                      "message `content` must be a string, an array of "
                      "content parts or null");
            goto out;
        }
        dp_buf_appendc(&text, '\n');
    }
    dp_buf_appends(&text, "<|assistant|>");
    r->prompts = dp_xcalloc(1, sizeof(*r->prompts));
    r->nprompts = 1;
    sim_prompt_init(&r->prompts[0]);
    sim_prompt_add_text(&r->prompts[0], text.base, text.len);
out:
    dp_buf_free(&text);
    return rc;
}

/* /v1/responses `input`: a string (one user message) or an array of message items, rendered
 * like chat messages; a response has one output (no `n`). */
static int parse_input(sim_req_t *r, const cJSON *in, sim_req_err_t *err)
{
    if (in == NULL)
        return fail(err, "input", "`input` is required");
    r->n = 1;
    if (!cJSON_IsString(in))
        return parse_messages(r, in, err);
    dp_buf_t text = {0};
    dp_buf_printf(&text, "<|user|> %s\n<|assistant|>", in->valuestring);
    r->prompts = dp_xcalloc(1, sizeof(*r->prompts));
    r->nprompts = 1;
    sim_prompt_init(&r->prompts[0]);
    sim_prompt_add_text(&r->prompts[0], text.base, text.len);
    dp_buf_free(&text);
    return 0;
}

static int parse_number(const cJSON *o, const char *name, double *out, bool *given,
                        sim_req_err_t *err)
{
    const cJSON *v = field(o, name);
    if (given)
        *given = v != NULL;
    if (v == NULL)
        return 0;
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
        return fail(err, name, "`%s` must be a number", name);
    *out = v->valuedouble;
    return 0;
}

static int parse_fields(sim_req_t *r, const cJSON *o, const char *body, size_t blen,
                        sim_req_err_t *err)
{
    const cJSON *v;

    if ((v = field(o, "model")) != NULL) {
        if (!cJSON_IsString(v))
            return fail(err, "model", "`model` must be a string");
        r->model = dp_xstrdup(v->valuestring);
    }

    if ((v = field(o, "n")) != NULL) {
        int64_t n;
        if (!as_int64(v, &n) || n < 1 || n > SIM_REQ_MAX_N)
            return fail(err, "n", "`n` must be an integer between 1 and %d", SIM_REQ_MAX_N);
        r->n = (uint32_t)n;
    }

    v = field(o, r->api == SIM_API_RESPONSES ? "max_output_tokens" : "max_tokens");
    if (v == NULL && r->api == SIM_API_CHAT)
        v = field(o, "max_completion_tokens");
    if (v != NULL) {
        int64_t mt;
        if (!as_int64(v, &mt) || mt < 1)
            return fail(err, "max_tokens", "`max_tokens` must be a positive integer");
        if (mt > SIM_REQ_MAX_TOKENS_LIMIT)
            return fail(err, "max_tokens",
                        "This model's maximum context length is %d tokens. However, you "
                        "requested %lld tokens for the completion.",
                        SIM_REQ_MAX_TOKENS_LIMIT, (long long)mt);
        r->max_tokens = (uint32_t)mt;
    }

    if (parse_number(o, "temperature", &r->temperature, NULL, err) < 0)
        return -1;
    if (r->temperature < 0)
        return fail(err, "temperature", "`temperature` must be non-negative, got %g",
                    r->temperature);
    if (parse_number(o, "top_p", &r->top_p, &r->top_p_given, err) < 0)
        return -1;
    if (!(r->top_p > 0 && r->top_p <= 1))
        return fail(err, "top_p", "`top_p` must be in (0, 1], got %g", r->top_p);

    if ((v = field(o, "top_k")) != NULL) {
        int64_t k;
        if (!as_int64(v, &k) || k < -1 || k > INT32_MAX)
            return fail(err, "top_k", "`top_k` must be -1 (disable), 0 or a positive integer");
        r->top_k = (int32_t)k;
    }

    for (size_t i = 0; i < 2; i++) {
        static const char *const pen[] = {"presence_penalty", "frequency_penalty"};
        double d = 0;
        if (parse_number(o, pen[i], &d, NULL, err) < 0)
            return -1;
        if (d < -2 || d > 2)
            return fail(err, pen[i], "`%s` must be in [-2, 2], got %g", pen[i], d);
    }

    if ((v = field(o, "seed")) != NULL) {
        const char *lit = NULL;
        size_t ll = 0;
        int exact = cJSON_IsNumber(v) && raw_member(body, blen, "seed", &lit, &ll)
                        ? raw_int64(lit, ll, &r->seed)
                        : 1;
        if (exact < 0 || (exact > 0 && !as_int64(v, &r->seed)))
            return fail(err, "seed", "`seed` must be an integer in the int64 range");
        r->has_seed = true;
    }

    if ((v = field(o, "stream")) != NULL) {
        if (!cJSON_IsBool(v))
            return fail(err, "stream", "`stream` must be a boolean");
        r->stream = cJSON_IsTrue(v);
    }
    if ((v = field(o, "stream_options")) != NULL) {
        if (!cJSON_IsObject(v))
            return fail(err, "stream_options", "`stream_options` must be an object");
        if (!r->stream)
            return fail(err, "stream_options",
                        "Stream options can only be defined when `stream=True`.");
        const cJSON *iu = field(v, "include_usage");
        if (iu != NULL) {
            if (!cJSON_IsBool(iu))
                return fail(err, "stream_options", "`include_usage` must be a boolean");
            r->include_usage = cJSON_IsTrue(iu);
        }
    }

    if ((v = field(o, "stop")) != NULL && !cJSON_IsString(v) && !cJSON_IsArray(v))
        return fail(err, "stop", "`stop` must be a string or an array of strings");
    if ((v = field(o, "logit_bias")) != NULL && !cJSON_IsObject(v))
        return fail(err, "logit_bias", "`logit_bias` must be an object");
    if ((v = field(o, "user")) != NULL && !cJSON_IsString(v))
        return fail(err, "user", "`user` must be a string");
    return 0;
}

int sim_req_parse(sim_req_t *r, sim_api_t api, const char *body, size_t n, sim_req_err_t *err)
{
    memset(r, 0, sizeof(*r));
    err->param = NULL;
    err->message[0] = '\0';
    r->api = api;
    r->n = 1;
    r->max_tokens = SIM_REQ_DEFAULT_MAX_TOKENS;
    r->temperature = 1.0;
    r->top_p = 1.0;
    r->top_k = -1;

    cJSON *root = cJSON_ParseWithLength(body, n);
    if (root == NULL)
        return fail(err, NULL, "request body is not valid JSON");
    int rc;
    if (!cJSON_IsObject(root)) {
        rc = fail(err, NULL, "request body must be a JSON object");
        goto out;
    }
    rc = parse_fields(r, root, body, n, err);
    if (rc < 0)
        goto out;
    if (api == SIM_API_COMPLETIONS)
        rc = parse_prompt(r, field(root, "prompt"), err);
    else if (api == SIM_API_CHAT)
        rc = parse_messages(r, field(root, "messages"), err);
    else
        rc = parse_input(r, field(root, "input"), err);
    if (rc < 0)
        goto out;
    if (r->nprompts * r->n > SIM_REQ_MAX_CHOICES)
        rc = fail(err, "n", "at most %d choices per request", SIM_REQ_MAX_CHOICES);
out:
    cJSON_Delete(root);
    if (rc < 0)
        sim_req_free(r);
    return rc;
}

void sim_req_free(sim_req_t *r)
{
    free(r->model);
    r->model = NULL;
    free(r->prompts);
    r->prompts = NULL;
    r->nprompts = 0;
}
