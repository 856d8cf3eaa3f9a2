/* Tenant matching, request validation, the rule engine, seed derivation and framework
 * normalisation. Reads top to bottom in the order the proxy calls it. */
#include <assert.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/crypto.h>

#include "common/jw.h"
#include "common/util.h"
#include "policy/jcs.h"
#include "policy/policy_int.h"

const char *const policy_action_names[POLICY_ACTION__COUNT] = {
    "forced", "defaulted", "clamped", "derived", "normalized",
};

/* ---- errors -------------------------------------------------------------------------------- */

void policy_set_error(policy_error_t *err, int status, const char *code, const char *param,
                      const char *fmt, ...)
{
    if (err == NULL)
        return;
    err->status = status;
    err->type = "invalid_request_error";
    err->code = code;
    snprintf(err->param, sizeof(err->param), "%s", param ? param : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof(err->message), fmt, ap);
    va_end(ap);
}

void policy_json_error(const jdoc_t *d, policy_error_t *err)
{
    if (d->err_tok != JDOC_NONE) {
        const char *k;
        size_t kn;
        jdoc_key(d, d->err_tok, &k, &kn);
        policy_set_error(err, 400, "duplicate_key", NULL,
                         "duplicate key \"%.*s\" at byte %zu: refused, because backends disagree "
                         "on which copy wins",
                         (int)(kn > 48 ? 48 : kn), k, d->err_at);
    } else if (strcmp(d->err, "not a JSON object") == 0) {
        policy_set_error(err, 400, "invalid_json", NULL, "request body must be a JSON object");
    } else if (strcmp(d->err, "nested too deeply") == 0) {
        policy_set_error(err, 400, "invalid_json", NULL, "request body nests deeper than %d levels",
                         JDOC_MAX_DEPTH);
    } else {
        policy_set_error(err, 400, "invalid_json", NULL,
                         "request body is not valid JSON: %s at byte %zu", d->err, d->err_at);
    }
}

void policy_error_json(const policy_error_t *e, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_obj_begin(&w, "error");
    dp_jw_str(&w, "message", e->message);
    dp_jw_str(&w, "type", e->type ? e->type : "invalid_request_error");
    if (e->param[0])
        dp_jw_str(&w, "param", e->param);
    else
        dp_jw_null(&w, "param");
    dp_jw_str(&w, "code", e->code);
    dp_jw_obj_end(&w);
    dp_jw_obj_end(&w);
}

/* ---- canonical JSON ------------------------------------------------------------------------ */

int policy_jcs(const char *json, size_t len, dp_buf_t *out, policy_error_t *err)
{
    jdoc_t d;
    jdoc_init(&d);
    int rc = jdoc_parse(&d, json, len, 0);
    if (rc < 0)
        policy_json_error(&d, err);
    else
        jcs_write(&d, 0, out);
    jdoc_free(&d);
    return rc;
}

/* ---- tenants ------------------------------------------------------------------------------- */

size_t policy_headers_lookup(void *ud, const char *lname, dp_iovec_t *value)
{
    const policy_headers_t *h = ud;
    size_t n = 0;
    for (size_t i = 0; i < h->count; i++) {
        if (dp_strieq(h->items[i].name.base, h->items[i].name.len, lname)) {
            if (n == 0)
                *value = h->items[i].value;
            n++;
        }
    }
    return n;
}

/* A request that carries credentials (any Authorization field) is served only by the tenant
 * they name, never by {"any": true} (unless "unknown_keys": true, for gateways): a mistyped key
 * must not silently drop a compliance tenant's rules (docs/policy.md §1). */
const cfg_tenant_t *policy_match_tenant(const cfg_policy_t *pol, policy_header_cb lookup, void *ud,
                                        policy_error_t *err)
{
    uint8_t digest[32];
    bool tried = false, have = false;
    const cfg_tenant_t *hit = NULL;
    dp_iovec_t auth;
    size_t nauth = lookup(ud, "authorization", &auth);
    for (size_t i = 0; pol && i < pol->ntenants && hit == NULL; i++) {
        const cfg_tenant_t *t = &pol->tenants[i];
        dp_iovec_t v;
        switch (t->match_kind) {
        case CFG_MATCH_ANY:
            if (nauth == 0 || t->any_unknown_keys)
                hit = t;
            break;
        case CFG_MATCH_HEADER:
            if (t->header_name && t->header_value && lookup(ud, t->header_name, &v) == 1) {
                v = dp_trim_ows(v);
                size_t want = strlen(t->header_value);
                if (v.len == want && dp_ct_equal(v.base, t->header_value, want))
                    hit = t;
            }
            break;
        case CFG_MATCH_API_KEYS:
            if (!tried) {
                dp_iovec_t tok;
                tried = true;
                /* Hash once, in place, for all tenants; two Authorization fields are ambiguous
                 * and match no key. */
                if (nauth == 1 && dp_bearer_token(auth, &tok)) {
                    dp_sha256(tok.base, tok.len, digest);
                    have = true;
                }
            }
            if (have) {
                /* Compare against every digest, no early exit: timing must not tell which key
                 * (or whether an early one) matched. */
                bool m = false;
                for (size_t k = 0; k < t->napi_keys; k++)
                    m |= dp_ct_equal(digest, t->api_keys[k], 32);
                if (m)
                    hit = t;
            }
            break;
        }
    }
    OPENSSL_cleanse(digest, sizeof(digest));
    if (hit == NULL && nauth > 1)
        policy_set_error(err, 401, "invalid_api_key", NULL,
                         "two Authorization fields: ambiguous credentials match no tenant");
    else if (hit == NULL && nauth == 1)
        policy_set_error(err, 401, "invalid_api_key", NULL,
                         "the credentials in Authorization match no tenant");
    else if (hit == NULL)
        policy_set_error(err, 401, "invalid_api_key", NULL,
                         "no tenant matched this request: missing credentials");
    return hit;
}

/* ---- known top-level keys ------------------------------------------------------------------ */

enum {
    S_TEMPERATURE = 0,
    S_TOP_P,
    S_TOP_K,
    S_SEED,
    S_MAX_TOKENS,
    S_N,
    S_PRESENCE_PENALTY,
    S_FREQUENCY_PENALTY,
    S_MAX_COMPLETION_TOKENS, /* aliases governed by max_tokens' rule */
    S_N_PREDICT,
    S_MAX_NEW_TOKENS,    /* TGI's and SGLang's native name, ruled wherever it is sent */
    S_MAX_OUTPUT_TOKENS, /* /v1/responses' max_tokens, governed by its rule */
    S_N_CMPL,            /* llama.cpp's name for n, governed by n's rule */
    S_MIN_P,             /* touched only by framework normalisation */
    S_REPETITION_PENALTY,
    S_REPEAT_PENALTY,
    S_CACHE_PROMPT, /* llama.cpp; forced false on single_sequence pools (docs/policy.md §5, N8) */
    S_NUMERIC_END,
    S_MODEL = S_NUMERIC_END,
    S_STREAM,
    S_STREAM_OPTIONS,
    S_USER,
    S_PROMPT,
    S_MESSAGES,
    S_INPUT,
    S_BEST_OF, /* read only for single_sequence pools (several_sequences) */
    S_USE_BEAM_SEARCH,
    S__COUNT
};

#define S_TYPED_END S_MIN_P /* slots below are type-checked */

_Static_assert(S_TEMPERATURE == (int)CFG_PARAM_TEMPERATURE && S_TOP_P == (int)CFG_PARAM_TOP_P &&
                   S_TOP_K == (int)CFG_PARAM_TOP_K && S_SEED == (int)CFG_PARAM_SEED &&
                   S_MAX_TOKENS == (int)CFG_PARAM_MAX_TOKENS && S_N == (int)CFG_PARAM_N &&
                   S_PRESENCE_PENALTY == (int)CFG_PARAM_PRESENCE_PENALTY &&
                   S_FREQUENCY_PENALTY == (int)CFG_PARAM_FREQUENCY_PENALTY &&
                   S_MAX_COMPLETION_TOKENS == (int)CFG_PARAM__COUNT,
               "slot order follows cfg_param_t");

static const struct {
    const char *name;
    uint8_t len;
    bool integer;
} slots[S__COUNT] = {
    [S_TEMPERATURE] = {"temperature", 11, false},
    [S_TOP_P] = {"top_p", 5, false},
    [S_TOP_K] = {"top_k", 5, true},
    [S_SEED] = {"seed", 4, true},
    [S_MAX_TOKENS] = {"max_tokens", 10, true},
    [S_N] = {"n", 1, true},
    [S_PRESENCE_PENALTY] = {"presence_penalty", 16, false},
    [S_FREQUENCY_PENALTY] = {"frequency_penalty", 17, false},
    [S_MAX_COMPLETION_TOKENS] = {"max_completion_tokens", 21, true},
    [S_N_PREDICT] = {"n_predict", 9, true},
    [S_MAX_NEW_TOKENS] = {"max_new_tokens", 14, true},
    [S_MAX_OUTPUT_TOKENS] = {"max_output_tokens", 17, true},
    [S_N_CMPL] = {"n_cmpl", 6, true},
    [S_MIN_P] = {"min_p", 5, false},
    [S_REPETITION_PENALTY] = {"repetition_penalty", 18, false},
    [S_REPEAT_PENALTY] = {"repeat_penalty", 14, false},
    [S_CACHE_PROMPT] = {"cache_prompt", 12, false},
    [S_MODEL] = {"model", 5, false},
    [S_STREAM] = {"stream", 6, false},
    [S_STREAM_OPTIONS] = {"stream_options", 14, false},
    [S_USER] = {"user", 4, false},
    [S_PROMPT] = {"prompt", 6, false},
    [S_MESSAGES] = {"messages", 8, false},
    [S_INPUT] = {"input", 5, false},
    [S_BEST_OF] = {"best_of", 7, false},
    [S_USE_BEAM_SEARCH] = {"use_beam_search", 15, false},
};

struct policy_req_s {
    jdoc_t doc;
    policy_route_t route;
    bool parsed;
    uint32_t key[S__COUNT]; /* key token of each known top-level member, or JDOC_NONE */
    dp_buf_t model;
    dp_buf_t out;   /* rewritten body */
    dp_buf_t canon; /* tenant name + "\n" + canonical request, for derive */
};

policy_req_t *policy_req_new(void)
{
    policy_req_t *r = dp_xcalloc(1, sizeof(*r));
    jdoc_init(&r->doc);
    return r;
}

void policy_req_reset(policy_req_t *r)
{
    jdoc_reset(&r->doc);
    r->parsed = false;
    dp_buf_reset(&r->model);
    dp_buf_reset(&r->out);
    dp_buf_reset(&r->canon);
}

void policy_req_free(policy_req_t *r)
{
    if (r == NULL)
        return;
    jdoc_free(&r->doc);
    dp_buf_free(&r->model);
    dp_buf_free(&r->out);
    dp_buf_free(&r->canon);
    free(r);
}

static int slot_of_name(const char *k, size_t kn)
{
    for (int s = 0; s < S__COUNT; s++)
        if (kn == slots[s].len && memcmp(k, slots[s].name, kn) == 0)
            return s;
    return -1;
}

/* Slot of a top-level key token, or -1. Compares token indices only: 19 integer compares. */
static int slot_of_tok(const policy_req_t *r, uint32_t k)
{
    for (int s = 0; s < S__COUNT; s++)
        if (r->key[s] == k)
            return s;
    return -1;
}

int policy_parse(policy_req_t *r, policy_route_t route, const char *body, size_t len,
                 policy_error_t *err)
{
    policy_req_reset(r);
    jdoc_t *d = &r->doc;
    if (jdoc_parse(d, body, len, JDOC_OBJECT_ONLY) < 0) {
        policy_json_error(d, err);
        return -1;
    }
    for (int s = 0; s < S__COUNT; s++)
        r->key[s] = JDOC_NONE;
    const jtok_t *root = &d->toks[0];
    for (uint32_t i = 1; i < root->end; i = d->toks[i + 1].end) {
        const char *k;
        size_t kn;
        jdoc_key(d, i, &k, &kn);
        int s = slot_of_name(k, kn);
        if (s >= 0)
            r->key[s] = i;
    }
    uint32_t mk = r->key[S_MODEL];
    if (mk == JDOC_NONE) {
        policy_set_error(err, 400, "invalid_value", "model", "you must provide a model parameter");
        return -1;
    }
    if (d->toks[mk + 1].type != JT_STR) {
        policy_set_error(err, 400, "invalid_value", "model", "model must be a string");
        return -1;
    }
    jdoc_str_decode(d, mk + 1, &r->model);
    if (r->model.len == 0) {
        policy_set_error(err, 400, "invalid_value", "model", "model must be a non-empty string");
        return -1;
    }
    r->route = route;
    r->parsed = true;
    return 0;
}

const jdoc_t *policy_req_doc(const policy_req_t *r, policy_route_t *route)
{
    *route = r->route;
    return r->parsed ? &r->doc : NULL;
}

dp_iovec_t policy_model(const policy_req_t *r)
{
    dp_iovec_t v = {r->model.base ? r->model.base : "", r->model.len};
    return v;
}

/* ---- shapes -------------------------------------------------------------------------------- */

static bool is_token_id(const jdoc_t *d, uint32_t tok)
{
    const jtok_t *t = &d->toks[tok];
    return t->type == JT_NUM && (t->flags & JF_INT) && !(t->flags & JF_NEG);
}

/* Every element of array arr is a non-negative integer (a token id). */
static bool all_token_ids(const jdoc_t *d, uint32_t arr)
{
    for (uint32_t i = arr + 1; i < d->toks[arr].end; i++)
        if (!is_token_id(d, i))
            return false;
    return true;
}

/* prompt: a string, an array of strings, an array of token ids, or an array of non-empty
 * token-id arrays (the four shapes the OpenAI API and vLLM accept). */
static int check_prompt(const policy_req_t *r, policy_error_t *err)
{
    const jdoc_t *d = &r->doc;
    uint32_t k = r->key[S_PROMPT];
    if (k == JDOC_NONE) {
        policy_set_error(err, 400, "invalid_value", "prompt", "prompt is required");
        return -1;
    }
    uint32_t v = k + 1;
    const jtok_t *t = &d->toks[v];
    if (t->type == JT_STR)
        return 0;
    if (t->type == JT_ARR && t->aux > 0) {
        uint8_t first = d->toks[v + 1].type;
        bool ok = true;
        for (uint32_t i = v + 1; ok && i < t->end; i = d->toks[i].end) {
            const jtok_t *e = &d->toks[i];
            if (first == JT_STR)
                ok = e->type == JT_STR;
            else if (first == JT_NUM)
                ok = is_token_id(d, i);
            else if (first == JT_ARR)
                ok = e->type == JT_ARR && e->aux > 0 && all_token_ids(d, i);
            else
                ok = false;
        }
        if (ok)
            return 0;
    }
    policy_set_error(err, 400, "invalid_value", "prompt",
                     "prompt must be a string, an array of strings, an array of token ids or an "
                     "array of non-empty token-id arrays");
    return -1;
}

/* messages: a non-empty array of objects, each with a string role and a content that is a
 * string or an array of content parts (objects with a string type; "text" parts with a string
 * text). content may be absent or null only for role "assistant" (tool calls). */
static int check_messages(const policy_req_t *r, policy_error_t *err)
{
    const jdoc_t *d = &r->doc;
    uint32_t k = r->key[S_MESSAGES];
    char param[64];
    if (k == JDOC_NONE) {
        policy_set_error(err, 400, "invalid_value", "messages", "messages is required");
        return -1;
    }
    uint32_t v = k + 1;
    if (d->toks[v].type != JT_ARR || d->toks[v].aux == 0) {
        policy_set_error(err, 400, "invalid_value", "messages",
                         "messages must be a non-empty array");
        return -1;
    }
    unsigned j = 0;
    for (uint32_t m = v + 1; m < d->toks[v].end; m = d->toks[m].end, j++) {
        if (d->toks[m].type != JT_OBJ) {
            snprintf(param, sizeof(param), "messages[%u]", j);
            policy_set_error(err, 400, "invalid_value", param, "%s must be an object", param);
            return -1;
        }
        uint32_t role = jdoc_get(d, m, "role");
        if (role == JDOC_NONE || d->toks[role].type != JT_STR) {
            snprintf(param, sizeof(param), "messages[%u].role", j);
            policy_set_error(err, 400, "invalid_value", param, "%s must be a string", param);
            return -1;
        }
        uint32_t c = jdoc_get(d, m, "content");
        uint8_t ct = c == JDOC_NONE ? JT_NULL : d->toks[c].type;
        if (ct == JT_STR)
            continue;
        if (ct == JT_NULL && jdoc_str_eq(d, role, "assistant"))
            continue;
        if (ct != JT_ARR) {
            snprintf(param, sizeof(param), "messages[%u].content", j);
            policy_set_error(err, 400, "invalid_value", param,
                             ct == JT_NULL ? "%s is required"
                                           : "%s must be a string or an array of content parts",
                             param);
            return -1;
        }
        unsigned pi = 0;
        for (uint32_t p = c + 1; p < d->toks[c].end; p = d->toks[p].end, pi++) {
            uint32_t ty = d->toks[p].type == JT_OBJ ? jdoc_get(d, p, "type") : JDOC_NONE;
            if (ty == JDOC_NONE || d->toks[ty].type != JT_STR) {
                snprintf(param, sizeof(param), "messages[%u].content[%u].type", j, pi);
                policy_set_error(err, 400, "invalid_value", param,
                                 "%s must be a string (content parts are objects)", param);
                return -1;
            }
            if (jdoc_str_eq(d, ty, "text")) {
                uint32_t tx = jdoc_get(d, p, "text");
                if (tx == JDOC_NONE || d->toks[tx].type != JT_STR) {
                    snprintf(param, sizeof(param), "messages[%u].content[%u].text", j, pi);
                    policy_set_error(err, 400, "invalid_value", param, "%s must be a string",
                                     param);
                    return -1;
                }
            }
        }
    }
    return 0;
}

/* input (/v1/responses): a string or a non-empty array of input items (strings or objects; the
 * items' own shapes are the replica's to judge). */
static int check_input(const policy_req_t *r, policy_error_t *err)
{
    const jdoc_t *d = &r->doc;
    uint32_t k = r->key[S_INPUT];
    if (k == JDOC_NONE) {
        policy_set_error(err, 400, "invalid_value", "input", "input is required");
        return -1;
    }
    const jtok_t *t = &d->toks[k + 1];
    if (t->type == JT_STR)
        return 0;
    if (t->type == JT_ARR && t->aux > 0) {
        unsigned j = 0;
        for (uint32_t i = k + 2; i < t->end; i = d->toks[i].end, j++) {
            if (d->toks[i].type != JT_OBJ && d->toks[i].type != JT_STR) {
                char param[64];
                snprintf(param, sizeof(param), "input[%u]", j);
                policy_set_error(err, 400, "invalid_value", param,
                                 "%s must be an object or a string", param);
                return -1;
            }
        }
        return 0;
    }
    policy_set_error(err, 400, "invalid_value", "input",
                     "input must be a string or a non-empty array of input items");
    return -1;
}

static int check_shape(const policy_req_t *r, policy_error_t *err)
{
    switch (r->route) {
    case POLICY_ROUTE_CHAT:
        return check_messages(r, err);
    case POLICY_ROUTE_RESPONSES:
        return check_input(r, err);
    default:
        return check_prompt(r, err);
    }
}

/* ---- the rule engine ------------------------------------------------------------------------ */

enum { PV_ABSENT = 0, PV_NULL, PV_NUM, PV_OTHER, PV_REMOVED, PV_FALSE };

typedef struct {
    uint8_t kind;
    double d;  /* value (integer slots: (double)i) */
    int64_t i; /* integer slots */
} pval_t;

typedef struct {
    pval_t orig[S_NUMERIC_END];
    pval_t cur[S_NUMERIC_END];
    bool dirty[S_NUMERIC_END];
    policy_result_t *out;
    const policy_req_t *r;
} apply_t;

static size_t put_i64(char *out, int64_t v)
{
    char t[24];
    size_t n = 0, o = 0;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do {
        t[n++] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        out[o++] = '-';
    while (n)
        out[o++] = t[--n];
    out[o] = '\0';
    return o;
}

/* JSON text of a value. A value still as the client wrote it (raw != NULL) is quoted verbatim
 * when it fits: the audit shows what was sent, and no number formatting is spent on it. */
_Static_assert(POLICY_VAL_LEN >= 32, "a value's text holds what jcs_es_number prints");
static void pval_text(int s, const pval_t *v, const char *raw, size_t rawlen, char *out)
{
    switch (v->kind) {
    case PV_NULL:
        memcpy(out, "null", 5);
        break;
    case PV_FALSE:
        memcpy(out, "false", 6);
        break;
    case PV_NUM:
        if (raw && rawlen < POLICY_VAL_LEN) {
            memcpy(out, raw, rawlen);
            out[rawlen] = '\0';
        } else if (slots[s].integer) {
            put_i64(out, v->i);
        } else {
            jcs_es_number(v->d, out);
        }
        break;
    case PV_OTHER: /* a value that is not ours (cache_prompt: true): as the client wrote it */
        if (raw && rawlen < POLICY_VAL_LEN) {
            memcpy(out, raw, rawlen);
            out[rawlen] = '\0';
        } else {
            out[0] = '\0';
        }
        break;
    default:
        out[0] = '\0';
        break;
    }
}

/* A slot changes at most twice (its rule, then framework normalisation), so the changes of
 * one request always fit. */
_Static_assert(2 * S_NUMERIC_END <= POLICY_MAX_CHANGES, "every slot's changes fit");
static void record(apply_t *a, int s, policy_action_t act, const pval_t *before,
                   const pval_t *after)
{
    policy_result_t *o = a->out;
    assert(s >= 0 && s < S_NUMERIC_END);
    assert(o->nchanges < POLICY_MAX_CHANGES); /* at most two changes per slot: see above */
    if (o->nchanges == POLICY_MAX_CHANGES)
        return;
    policy_change_t *c = &o->changes[o->nchanges++];
    c->param = slots[s].name;
    c->action = act;
    const char *raw = NULL;
    size_t rawlen = 0;
    if (!a->dirty[s] && a->r->key[s] != JDOC_NONE) { /* still the client's own value */
        const jtok_t *t = &a->r->doc.toks[a->r->key[s] + 1];
        raw = a->r->doc.src + t->start;
        rawlen = t->len;
    }
    pval_text(s, before, raw, rawlen, c->before);
    pval_text(s, after, NULL, 0, c->after);
}

static int64_t to_i64(double x)
{
    if (x >= 9223372036854775807.0)
        return INT64_MAX;
    if (x <= -9223372036854775808.0)
        return INT64_MIN;
    return (int64_t)x;
}

static void set_pv(apply_t *a, int s, policy_action_t act, pval_t nv)
{
    pval_t *v = &a->cur[s];
    if (v->kind == PV_NUM && (slots[s].integer ? v->i == nv.i : v->d == nv.d))
        return; /* already that value: keep the client's spelling */
    record(a, s, act, v, &nv);
    *v = nv;
    a->dirty[s] = true;
}

static void set_num(apply_t *a, int s, policy_action_t act, double x)
{
    pval_t nv = {.kind = PV_NUM};
    if (slots[s].integer) {
        nv.i = to_i64(x);
        nv.d = (double)nv.i;
    } else {
        nv.d = x;
    }
    set_pv(a, s, act, nv);
}

static void set_int(apply_t *a, int s, policy_action_t act, int64_t i)
{
    pval_t nv = {.kind = PV_NUM, .i = i, .d = (double)i};
    set_pv(a, s, act, nv);
}

static void remove_slot(apply_t *a, int s)
{
    pval_t *v = &a->cur[s];
    if (v->kind != PV_NUM && v->kind != PV_NULL)
        return;
    pval_t nv = {.kind = PV_REMOVED};
    record(a, s, POLICY_NORMALIZED, v, &nv);
    *v = nv;
    a->dirty[s] = true;
}

/* Send s as false, whatever the request says. */
static void force_false(apply_t *a, int s)
{
    pval_t *v = &a->cur[s];
    if (v->kind == PV_FALSE)
        return;
    pval_t nv = {.kind = PV_FALSE};
    record(a, s, POLICY_NORMALIZED, v, &nv);
    *v = nv;
    a->dirty[s] = true;
}

/* Set s to x when the request leaves it absent or null. */
static void pin(apply_t *a, int s, double x)
{
    if (a->cur[s].kind == PV_ABSENT || a->cur[s].kind == PV_NULL)
        set_num(a, s, POLICY_NORMALIZED, x);
}

static bool governed(const cfg_rule_t *r)
{
    return r->has_force || r->has_default || r->has_min || r->has_max || r->derive;
}

static double clamp_rule(const cfg_rule_t *r, double x)
{
    if (r->has_min && x < r->min)
        x = r->min;
    if (r->has_max && x > r->max)
        x = r->max;
    return x;
}

/* force: always set. default: set when absent (or null), then clamped by min/max. min/max:
 * clamp a value the request carries. Everything else is left alone. */
static void apply_rule(apply_t *a, int s, const cfg_rule_t *rule)
{
    pval_t *v = &a->cur[s];
    if (rule->has_force) {
        set_num(a, s, POLICY_FORCED, rule->force);
    } else if (v->kind != PV_NUM) {
        if (rule->has_default)
            set_num(a, s, POLICY_DEFAULTED, clamp_rule(rule, rule->def));
    } else {
        double x = slots[s].integer ? (double)v->i : v->d;
        if (rule->has_min && x < rule->min)
            set_num(a, s, POLICY_CLAMPED, rule->min);
        else if (rule->has_max && x > rule->max)
            set_num(a, s, POLICY_CLAMPED, rule->max);
    }
}

/* Does the request run more than one sequence at once on the engine? llama.cpp's server runs n
 * (or n_cmpl) choices, and a batch of prompts, in as many slots together; vLLM samples n and
 * best_of candidates, and beam search its beams, in one batch. A single_sequence pool runs one
 * sequence at a time per replica (docs/configuration.md, "Deterministic pools"): err (when not
 * NULL) says why such a request is refused there, naming the key, rather than cut to one answer
 * the client did not ask for. counts: n and n_cmpl as they will be sent (PV_OTHER: not an
 * integer literal). Only 1 is surely one sequence: engines read other counts their own way
 * (llama.cpp keeps the low 32 bits, so 3 - 2^32 is 3). prompt_batch: the route takes a batch of
 * prompts in `prompt`. */
static bool sequences_at_once(const jdoc_t *d, const uint32_t *key, bool prompt_batch,
                              const pval_t counts[2], policy_error_t *err)
{
    static const int names[] = {S_N, S_N_CMPL};
    for (size_t i = 0; i < 2; i++) {
        const pval_t *v = &counts[i];
        if (v->kind != PV_NUM && v->kind != PV_OTHER)
            continue;
        if (v->kind == PV_NUM && v->i == 1)
            continue;
        const char *name = slots[names[i]].name;
        if (err && v->kind == PV_NUM && v->i > 1)
            policy_set_error(err, 400, "policy_violation", name,
                             "%s %lld asks for %lld completions at once, and this pool runs one "
                             "sequence at a time per replica (determinism.mode single_sequence): "
                             "send one request per completion",
                             name, (long long)v->i, (long long)v->i);
        else if (err)
            policy_set_error(err, 400, "policy_violation", name,
                             "%s must be 1 on this pool, which runs one sequence at a time per "
                             "replica (determinism.mode single_sequence): engines read other "
                             "counts their own way",
                             name);
        return true;
    }
    /* A batch of prompts: an array of strings or of token-id arrays (an array of token ids is
     * one prompt; a mix, which a body no policy shaped may hold, counts as a batch). Each is a
     * sequence of its own. */
    uint32_t k = key[S_PROMPT];
    if (prompt_batch && k != JDOC_NONE && d->toks[k + 1].type == JT_ARR && d->toks[k + 1].aux > 1 &&
        !all_token_ids(d, k + 1)) {
        if (err)
            policy_set_error(err, 400, "policy_violation", "prompt",
                             "prompt holds %u prompts, each a sequence, all at once, and this "
                             "pool runs one sequence at a time per replica (determinism.mode "
                             "single_sequence): send one request per prompt",
                             (unsigned)d->toks[k + 1].aux);
        return true;
    }
    /* vLLM reads them leniently ("3" is 3, "yes" is true): only a number of at most 1, and
     * false, are surely one sequence. */
    k = key[S_BEST_OF];
    const jtok_t *t = k != JDOC_NONE ? &d->toks[k + 1] : NULL;
    if (t && t->type != JT_NULL && !(t->type == JT_NUM && jdoc_num(d, k + 1) <= 1)) {
        if (err)
            policy_set_error(err, 400, "policy_violation", "best_of",
                             "best_of %.*s may sample several candidates at once, and this pool "
                             "runs one sequence at a time per replica (determinism.mode "
                             "single_sequence)",
                             (int)(t->len < 32 ? t->len : 32), d->src + t->start);
        return true;
    }
    k = key[S_USE_BEAM_SEARCH];
    t = k != JDOC_NONE ? &d->toks[k + 1] : NULL;
    if (t && t->type != JT_NULL && t->type != JT_FALSE) {
        if (err)
            policy_set_error(err, 400, "policy_violation", "use_beam_search",
                             "use_beam_search runs its beams at once, and this pool runs one "
                             "sequence at a time per replica (determinism.mode single_sequence)");
        return true;
    }
    return false;
}

static bool several_sequences(const apply_t *a, policy_error_t *err)
{
    const pval_t counts[2] = {a->cur[S_N], a->cur[S_N_CMPL]};
    return sequences_at_once(&a->r->doc, a->r->key, a->r->route == POLICY_ROUTE_COMPLETIONS, counts,
                             err);
}

/* Every count a rule governs is an integer >= 1 once the rules ran (docs/policy.md §3, "Counts").
 * Engines read 0 and negative lengths as "no limit" (llama.cpp: n_predict -1 is infinite) or
 * as something of their own, so a -1 under `max: 100` would void the cap. A rule with a `min`
 * has already raised such a value (a clamp); what is still below 1 is refused, naming the key
 * the client sent. The rules themselves cannot produce one: config/ holds count rules to >= 1. */
static int check_counts(const apply_t *a, const cfg_tenant_t *t, policy_error_t *err)
{
    static const int counts[] = {S_MAX_TOKENS,     S_MAX_COMPLETION_TOKENS, S_N_PREDICT,
                                 S_MAX_NEW_TOKENS, S_MAX_OUTPUT_TOKENS,     S_N,
                                 S_N_CMPL};
    for (size_t i = 0; i < DP_ARRAY_SIZE(counts); i++) {
        int s = counts[i];
        bool n = s == S_N || s == S_N_CMPL;
        const cfg_rule_t *rule = &t->rules[n ? CFG_PARAM_N : CFG_PARAM_MAX_TOKENS];
        /* max_output_tokens is a length only on /v1/responses; elsewhere no rule reads it. */
        if (s == S_MAX_OUTPUT_TOKENS && a->r->route != POLICY_ROUTE_RESPONSES)
            continue;
        if (!governed(rule) || a->cur[s].kind != PV_NUM || a->cur[s].i >= 1)
            continue;
        policy_set_error(err, 400, "invalid_value", slots[s].name,
                         "%s must be an integer of at least 1 (got %lld): this tenant's policy "
                         "limits it",
                         slots[s].name, (long long)a->cur[s].i);
        return -1;
    }
    return 0;
}

/* Read and type-check the numeric slots. */
static int read_params(const policy_req_t *r, apply_t *a, policy_error_t *err)
{
    const jdoc_t *d = &r->doc;
    for (int s = 0; s < S_NUMERIC_END; s++) {
        pval_t *v = &a->orig[s];
        memset(v, 0, sizeof(*v));
        if (r->key[s] == JDOC_NONE)
            continue;
        uint32_t tok = r->key[s] + 1;
        const jtok_t *t = &d->toks[tok];
        if (t->type == JT_NULL) {
            v->kind = PV_NULL;
            continue;
        }
        if (t->type != JT_NUM) {
            if (s >= S_TYPED_END) {
                /* Not ours to judge; only normalisation may replace it. */
                v->kind = t->type == JT_FALSE ? PV_FALSE : PV_OTHER;
                continue;
            }
            policy_set_error(err, 400, "invalid_value", slots[s].name, "%s must be %s",
                             slots[s].name, slots[s].integer ? "an integer" : "a number");
            return -1;
        }
        v->kind = PV_NUM;
        if (!slots[s].integer) {
            v->d = jdoc_num(d, tok);
            continue;
        }
        if (s == S_SEED &&
            (!(t->flags & JF_INT) || (t->flags & JF_NEG) || jdoc_int64(d, tok, &v->i) < 0)) {
            policy_set_error(err, 400, "invalid_value", "seed",
                             "seed must be an integer between 0 and 9223372036854775807");
            return -1;
        }
        if (!(t->flags & JF_INT)) {
            policy_set_error(err, 400, "invalid_value", slots[s].name, "%s must be an integer",
                             slots[s].name);
            return -1;
        }
        if (jdoc_int64(d, tok, &v->i) < 0) {
            policy_set_error(err, 400, "invalid_value", slots[s].name,
                             "%s is out of range for a 64-bit integer", slots[s].name);
            return -1;
        }
        v->d = (double)v->i;
    }
    return 0;
}

/* ---- seed derivation ----------------------------------------------------------------------- */

static bool excluded_from_canon(int s)
{
    return s == S_SEED || s == S_STREAM || s == S_STREAM_OPTIONS || s == S_USER;
}

static void canon_value(int s, const pval_t *v, dp_buf_t *out)
{
    char b[32];
    size_t n = jcs_es_number(slots[s].integer ? (double)v->i : v->d, b);
    dp_buf_append(out, b, n);
}

/* tenant name + "\n" + RFC 8785 form of the post-rule body without seed, stream,
 * stream_options and user. The top-level object is merged from the tape's presorted member
 * list and the (ASCII-named) parameters the rules added. */
static void build_canonical(policy_req_t *r, const cfg_tenant_t *t, const apply_t *a)
{
    const jdoc_t *d = &r->doc;
    const jtok_t *root = &d->toks[0];
    dp_buf_t *c = &r->canon;
    dp_buf_reset(c);
    dp_buf_reserve(c, d->srclen + 64);
    dp_buf_appends(c, t->name ? t->name : "");
    dp_buf_appendc(c, '\n');
    dp_buf_appendc(c, '{');
    int added[S_NUMERIC_END], na = 0;
    for (int s = 0; s < S_NUMERIC_END; s++) {
        if (s == S_SEED || a->orig[s].kind != PV_ABSENT || a->cur[s].kind != PV_NUM)
            continue;
        int j = na++;
        while (j > 0 && strcmp(slots[added[j - 1]].name, slots[s].name) > 0) {
            added[j] = added[j - 1];
            j--;
        }
        added[j] = s;
    }
    uint32_t mi = 0;
    int ai = 0;
    bool first = true;
    while (mi < root->aux || ai < na) {
        bool take_added;
        uint32_t k = mi < root->aux ? d->order[root->aux2 + mi] : JDOC_NONE;
        if (k == JDOC_NONE) {
            take_added = true;
        } else if (ai >= na) {
            take_added = false;
        } else {
            const char *kp;
            size_t kn;
            jdoc_key(d, k, &kp, &kn);
            take_added = jdoc_utf16_cmp(slots[added[ai]].name, slots[added[ai]].len, kp, kn) < 0;
        }
        if (take_added) {
            int s = added[ai++];
            if (!first)
                dp_buf_appendc(c, ',');
            first = false;
            dp_buf_appendc(c, '"');
            dp_buf_append(c, slots[s].name, slots[s].len);
            dp_buf_append(c, "\":", 2);
            canon_value(s, &a->cur[s], c);
            continue;
        }
        mi++;
        int s = slot_of_tok(r, k);
        if (s >= 0 && excluded_from_canon(s))
            continue;
        if (s >= 0 && s < S_NUMERIC_END && a->dirty[s] && a->cur[s].kind == PV_REMOVED)
            continue;
        if (!first)
            dp_buf_appendc(c, ',');
        first = false;
        const jtok_t *kt = &d->toks[k];
        jcs_write_raw_string(d->src + kt->start, kt->len, kt->flags & JF_ESC, c);
        dp_buf_appendc(c, ':');
        if (s >= 0 && s < S_NUMERIC_END && a->dirty[s])
            canon_value(s, &a->cur[s], c);
        else
            jcs_write(d, k + 1, c);
    }
    dp_buf_appendc(c, '}');
}

static int64_t derive_seed(policy_req_t *r, const cfg_tenant_t *t, const apply_t *a)
{
    uint8_t h[32];
    build_canonical(r, t, a);
    dp_sha256(r->canon.base, r->canon.len, h);
    uint64_t x = 0;
    for (int i = 0; i < 8; i++)
        x = x << 8 | h[i];
    return (int64_t)(x & 0x7fffffffu); /* mod 2^31 */
}

/* ---- framework normalisation (docs/policy.md has the table and the reasons) ------------------ */

typedef enum { FW_NONE = 0, FW_VLLM, FW_TGI, FW_SGLANG, FW_LLAMACPP } fw_t;

static fw_t fw_parse(const char *s)
{
    static const struct {
        const char *name;
        fw_t fw;
    } names[] = {
        {"vllm", FW_VLLM},
        {"tgi", FW_TGI},
        {"text-generation-inference", FW_TGI},
        {"sglang", FW_SGLANG},
        {"llamacpp", FW_LLAMACPP},
        {"llama.cpp", FW_LLAMACPP},
        {"llama-cpp", FW_LLAMACPP},
        {"llama_cpp", FW_LLAMACPP},
    };
    if (s == NULL)
        return FW_NONE;
    for (size_t i = 0; i < DP_ARRAY_SIZE(names); i++)
        if (dp_strieq(s, strlen(s), names[i].name))
            return names[i].fw;
    return FW_NONE;
}

static void normalize(apply_t *a, const cfg_tenant_t *t, fw_t fw)
{
    if (fw == FW_NONE)
        return;
    const cfg_rule_t *R = t->rules;
    /* N1: a governed parameter the request leaves absent gets an explicit value: what OpenAI
     * means by absent, kept inside the rule's bounds. Absent top_k and max_tokens mean
     * "unbounded", so they become the rule's max, if any. */
    if (governed(&R[S_TEMPERATURE]))
        pin(a, S_TEMPERATURE, clamp_rule(&R[S_TEMPERATURE], 1));
    if (governed(&R[S_TOP_P])) {
        double x = clamp_rule(&R[S_TOP_P], 1);
        if (!(fw == FW_TGI && x == 1)) /* TGI rejects 1.0 and treats absent as 1.0 */
            pin(a, S_TOP_P, x);
    }
    if (governed(&R[S_TOP_K]) && fw != FW_TGI)
        pin(a, S_TOP_K, R[S_TOP_K].has_max ? R[S_TOP_K].max : fw == FW_LLAMACPP ? 0 : -1);
    if (governed(&R[S_MAX_TOKENS]) && R[S_MAX_TOKENS].has_max)
        pin(a, a->r->route == POLICY_ROUTE_RESPONSES ? S_MAX_OUTPUT_TOKENS : S_MAX_TOKENS,
            R[S_MAX_TOKENS].max);
    if (governed(&R[S_N]) && a->r->route != POLICY_ROUTE_RESPONSES) /* it has no n */
        pin(a, S_N, clamp_rule(&R[S_N], 1));
    if (governed(&R[S_PRESENCE_PENALTY]) && fw != FW_TGI)
        pin(a, S_PRESENCE_PENALTY, clamp_rule(&R[S_PRESENCE_PENALTY], 0));
    if (governed(&R[S_FREQUENCY_PENALTY]))
        pin(a, S_FREQUENCY_PENALTY, clamp_rule(&R[S_FREQUENCY_PENALTY], 0));

    bool sampling = governed(&R[S_TEMPERATURE]) || governed(&R[S_TOP_P]) || governed(&R[S_TOP_K]);
    switch (fw) {
    case FW_VLLM:
    case FW_SGLANG:
        /* N2: both fill omitted temperature/top_p/top_k/min_p/repetition_penalty from the
         * model's generation_config.json; pin them to the neutral values. */
        if (sampling) {
            pin(a, S_TEMPERATURE, 1);
            pin(a, S_TOP_P, 1);
            pin(a, S_TOP_K, -1);
            pin(a, S_MIN_P, 0);
            pin(a, S_REPETITION_PENALTY, 1);
        }
        break;
    case FW_LLAMACPP:
        /* N3: llama-server's own defaults (temp 0.8, top_k 40, top_p 0.95, min_p 0.05) fill
         * omitted fields; top_k 0 disables it. Seeds are uint32 and 0xFFFFFFFF means random. */
        if (sampling) {
            pin(a, S_TEMPERATURE, 1);
            pin(a, S_TOP_P, 1);
            pin(a, S_TOP_K, 0);
            pin(a, S_MIN_P, 0);
            pin(a, S_REPEAT_PENALTY, 1);
        }
        if (a->cur[S_SEED].kind == PV_NUM && a->cur[S_SEED].i > 4294967294)
            set_int(a, S_SEED, POLICY_NORMALIZED, a->cur[S_SEED].i % 4294967295);
        break;
    case FW_TGI:
        /* N4: an omitted temperature is sampling at 1.0 on TGI; say so explicitly (0 stays 0:
         * TGI's chat and completions handlers map it to greedy). */
        pin(a, S_TEMPERATURE, 1);
        /* N5: TGI rejects top_p == 1.0 ("must be in (0, 1)"); absent is 1.0. */
        if (a->cur[S_TOP_P].kind == PV_NUM && a->cur[S_TOP_P].d == 1)
            remove_slot(a, S_TOP_P);
        /* N6: TGI's chat route turns presence_penalty p into repetition_penalty p + 2, so 0
         * is not neutral there; absent is. */
        if (a->cur[S_PRESENCE_PENALTY].kind == PV_NUM && a->cur[S_PRESENCE_PENALTY].d == 0)
            remove_slot(a, S_PRESENCE_PENALTY);
        /* N7: TGI's OpenAI routes do not read top_k: a top_k rule cannot hold there, so the
         * audit should not claim it was sent. */
        if (governed(&R[S_TOP_K]))
            remove_slot(a, S_TOP_K);
        break;
    default:
        break;
    }
}

/* ---- output -------------------------------------------------------------------------------- */

static void body_value(int s, const pval_t *v, dp_buf_t *out)
{
    char b[POLICY_VAL_LEN];
    pval_text(s, v, NULL, 0, b);
    dp_buf_appends(out, b);
}

/* Compact re-serialisation: members in the client's order, changed ones rewritten in place,
 * removed ones dropped, added ones appended in slot order. */
static void build_body(policy_req_t *r, const apply_t *a)
{
    const jdoc_t *d = &r->doc;
    const jtok_t *root = &d->toks[0];
    dp_buf_t *o = &r->out;
    dp_buf_reset(o);
    dp_buf_reserve(o, d->srclen + 160);
    dp_buf_appendc(o, '{');
    bool first = true;
    for (uint32_t k = 1; k < root->end; k = d->toks[k + 1].end) {
        int s = slot_of_tok(r, k);
        bool changed = s >= 0 && s < S_NUMERIC_END && a->dirty[s];
        if (changed && a->cur[s].kind == PV_REMOVED)
            continue;
        if (!first)
            dp_buf_appendc(o, ',');
        first = false;
        dp_buf_append(o, d->src + d->toks[k].start, d->toks[k].len);
        dp_buf_appendc(o, ':');
        if (changed)
            body_value(s, &a->cur[s], o);
        else
            jdoc_write_compact(d, k + 1, o);
    }
    for (int s = 0; s < S_NUMERIC_END; s++) {
        if (!a->dirty[s] || a->orig[s].kind != PV_ABSENT ||
            (a->cur[s].kind != PV_NUM && a->cur[s].kind != PV_FALSE))
            continue;
        if (!first)
            dp_buf_appendc(o, ',');
        first = false;
        dp_buf_appendc(o, '"');
        dp_buf_append(o, slots[s].name, slots[s].len);
        dp_buf_append(o, "\":", 2);
        body_value(s, &a->cur[s], o);
    }
    dp_buf_appendc(o, '}');
}

static int apply(policy_req_t *r, const cfg_tenant_t *t, const char *framework,
                 bool single_sequence, policy_result_t *out, policy_error_t *err)
{
    memset(out, 0, offsetof(policy_result_t, changes));
    if (!r->parsed || t == NULL) {
        policy_set_error(err, 400, "invalid_value", NULL, "request was not parsed");
        return -1;
    }
    const jdoc_t *d = &r->doc;

    /* 1. deny_params, before anything else, so a client learns the policy first. */
    for (size_t i = 0; i < t->ndeny_params; i++) {
        if (jdoc_get(d, 0, t->deny_params[i]) != JDOC_NONE) {
            policy_set_error(err, 400, "policy_violation", t->deny_params[i],
                             "parameter '%s' is not allowed for this tenant", t->deny_params[i]);
            return -1;
        }
    }

    /* allow_params: every top-level key the client sent must be listed (the tape's keys are
     * decoded, so "\u0074op_k" is top_k here as it is for the replica). */
    if (t->allow_params) {
        const jtok_t *o = &d->toks[0];
        for (uint32_t m = 0; m < o->aux; m++) {
            const char *k;
            size_t kn;
            jdoc_key(d, d->order[o->aux2 + m], &k, &kn);
            bool ok = false;
            for (size_t i = 0; i < t->nallow_params && !ok; i++)
                ok = strlen(t->allow_params[i]) == kn && memcmp(t->allow_params[i], k, kn) == 0;
            if (!ok) {
                /* Named as the proxy names it: at most 48 bytes, never half a UTF-8
                 * character, a control byte as \u00XX. */
                char name[sizeof(err->param)];
                size_t n = kn > 48 ? 48 : kn, o = 0;
                if (n < kn)
                    while (n > 0 && ((unsigned char)k[n] & 0xC0) == 0x80)
                        n--;
                for (size_t i = 0; i < n && o + 7 <= sizeof(name); i++) {
                    unsigned char c = (unsigned char)k[i];
                    if (c < 0x20 || c == 0x7f)
                        o += (size_t)snprintf(name + o, sizeof(name) - o, "\\u%04x", c);
                    else
                        name[o++] = (char)c;
                }
                name[o] = '\0';
                policy_set_error(err, 400, "policy_violation", name,
                                 "parameter '%s' is not in this tenant's allow_params", name);
                return -1;
            }
        }
    }

    /* 2. types and shapes. */
    if (r->key[S_STREAM] != JDOC_NONE) {
        uint8_t ty = d->toks[r->key[S_STREAM] + 1].type;
        if (ty != JT_TRUE && ty != JT_FALSE && ty != JT_NULL) {
            policy_set_error(err, 400, "invalid_value", "stream", "stream must be a boolean");
            return -1;
        }
        out->stream = ty == JT_TRUE;
    }
    apply_t a;
    memset(a.dirty, 0, sizeof(a.dirty));
    a.out = out;
    a.r = r;
    if (read_params(r, &a, err) < 0)
        return -1;
    if (check_shape(r, err) < 0)
        return -1;
    memcpy(a.cur, a.orig, sizeof(a.cur));

    /* 3. rules, then derive. /v1/responses names the length max_output_tokens and has no n:
     * there max_tokens' rule governs max_output_tokens (a default adds that), and the rules of
     * max_tokens and n touch those keys only when a client sends them anyway. */
    const bool responses = r->route == POLICY_ROUTE_RESPONSES;
    for (int s = 0; s < CFG_PARAM__COUNT; s++) {
        if (responses && (s == S_MAX_TOKENS || s == S_N) && a.cur[s].kind != PV_NUM) {
            if (s == S_MAX_TOKENS)
                apply_rule(&a, S_MAX_OUTPUT_TOKENS, &t->rules[s]);
            continue;
        }
        apply_rule(&a, s, &t->rules[s]);
    }
    if (responses && a.cur[S_MAX_TOKENS].kind == PV_NUM &&
        a.cur[S_MAX_OUTPUT_TOKENS].kind == PV_NUM)
        apply_rule(&a, S_MAX_OUTPUT_TOKENS, &t->rules[S_MAX_TOKENS]);
    /* Aliases of max_tokens: vLLM prefers max_completion_tokens, llama.cpp n_predict, TGI and
     * SGLang name it max_new_tokens; each would otherwise carry an unpoliced length past the
     * rule. Only present ones are ruled. */
    const cfg_rule_t *mt = &t->rules[CFG_PARAM_MAX_TOKENS];
    for (int s = S_MAX_COMPLETION_TOKENS; s <= S_MAX_NEW_TOKENS; s++) {
        if (a.cur[s].kind != PV_NUM)
            continue;
        apply_rule(&a, s, mt); /* present, so a default cannot apply */
    }
    if (a.cur[S_N_CMPL].kind == PV_NUM)
        apply_rule(&a, S_N_CMPL, &t->rules[CFG_PARAM_N]);
    if (check_counts(&a, t, err) < 0)
        return -1;
    if (t->rules[CFG_PARAM_SEED].derive && a.cur[S_SEED].kind != PV_NUM) {
        set_int(&a, S_SEED, POLICY_DERIVED, derive_seed(r, t, &a));
        out->seed_derived = true;
    }

    /* 4. framework normalisation. */
    fw_t fw = fw_parse(framework);
    normalize(&a, t, fw);
    /* N8: llama.cpp documents its prompt cache as a source of nondeterminism (a cached prefix
     * is evaluated in different batches than a fresh one), so a single_sequence pool turns it
     * off on every request (docs/policy.md §5, N8). */
    if (single_sequence && fw == FW_LLAMACPP)
        force_false(&a, S_CACHE_PROMPT);
    if (single_sequence && several_sequences(&a, err))
        return -1;
    /* The Responses API has no seed. vLLM takes one as an extra sampling field; elsewhere it
     * would be dropped without a word, and a forced or derived seed is a promise to the
     * tenant: refuse rather than break it. */
    if (responses && a.cur[S_SEED].kind == PV_NUM && fw != FW_VLLM) {
        policy_set_error(err, 400, "policy_violation", "seed",
                         "this request needs seed %lld (%s), which /v1/responses cannot carry to "
                         "this pool's framework (%s); use /v1/chat/completions",
                         (long long)a.cur[S_SEED].i,
                         a.dirty[S_SEED] ? "set by this tenant's policy" : "sent by the client",
                         framework && *framework ? framework : "unknown");
        return -1;
    }

    /* 5. results. */
    out->model = policy_model(r);
    if (a.cur[S_SEED].kind == PV_NUM) {
        out->has_seed = true;
        out->seed = (uint64_t)a.cur[S_SEED].i;
    } else {
        out->seed_derived = false;
    }
    if (a.cur[S_TEMPERATURE].kind == PV_NUM) {
        out->has_temperature = true;
        out->temperature = a.cur[S_TEMPERATURE].d;
    }
    out->comparable = (out->has_temperature && out->temperature == 0) || out->has_seed;
    if (a.cur[S_TOP_P].kind == PV_NUM) {
        out->has_top_p = true;
        out->top_p = a.cur[S_TOP_P].d;
    }
    static const int lengths[] = {S_MAX_OUTPUT_TOKENS, S_MAX_TOKENS, S_MAX_COMPLETION_TOKENS,
                                  S_N_PREDICT, S_MAX_NEW_TOKENS};
    for (size_t i = responses ? 0 : 1; i < sizeof(lengths) / sizeof(lengths[0]); i++) {
        if (a.cur[lengths[i]].kind == PV_NUM) {
            out->has_max_tokens = true;
            out->max_tokens = a.cur[lengths[i]].i;
            break;
        }
    }
    bool dirty = false;
    for (int s = 0; s < S_NUMERIC_END; s++)
        dirty |= a.dirty[s];
    if (dirty) {
        build_body(r, &a);
        out->body.base = r->out.base;
        out->body.len = r->out.len;
        out->rewritten = true;
    } else {
        out->body.base = d->src;
        out->body.len = d->srclen;
    }
    return 0;
}

int policy_apply(policy_req_t *r, const cfg_tenant_t *t, const char *framework,
                 policy_result_t *out, policy_error_t *err)
{
    return apply(r, t, framework, false, out, err);
}

bool policy_pool_no_cache_prompt(const cfg_pool_t *pool)
{
    return cfg_pool_determinism(pool) == CFG_DETERMINISM_SINGLE_SEQUENCE &&
           fw_parse(pool->manifest ? pool->manifest->framework_name : NULL) == FW_LLAMACPP;
}

int policy_apply_pool(policy_req_t *r, const cfg_tenant_t *t, const cfg_pool_t *pool,
                      policy_result_t *out, policy_error_t *err)
{
    const char *fw = pool->manifest ? pool->manifest->framework_name : NULL;
    return apply(r, t, fw, cfg_pool_determinism(pool) == CFG_DETERMINISM_SINGLE_SEQUENCE, out, err);
}
