/* Attestation reports, payload JSON, reasons (see report.h). */
#include "attest/report.h"

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "attest/json.h"
#include "common/util.h"

const char *const attest_field_names[ATTEST_F__COUNT] = {
    "model",          "checkpoint_sha256", "quantization",       "dtype",
    "framework.name", "framework.version", "engine_fingerprint", "determinism.mode",
};

/* Field f's slot in the struct: one switch instead of six copies of every accessor. */
static char **slot(attest_report_t *r, attest_field_t f)
{
    switch (f) {
    case ATTEST_F_MODEL:
        return &r->model;
    case ATTEST_F_CHECKPOINT:
        return &r->checkpoint_sha256;
    case ATTEST_F_QUANTIZATION:
        return &r->quantization;
    case ATTEST_F_DTYPE:
        return &r->dtype;
    case ATTEST_F_FRAMEWORK_NAME:
        return &r->framework_name;
    case ATTEST_F_FRAMEWORK_VERSION:
        return &r->framework_version;
    case ATTEST_F_ENGINE_FINGERPRINT:
        return &r->engine_fingerprint;
    case ATTEST_F_DETERMINISM:
        return &r->determinism;
    default:
        return NULL;
    }
}

const char *attest_report_get(const attest_report_t *r, attest_field_t f)
{
    char **p = slot((attest_report_t *)r, f);
    return p ? *p : NULL;
}

void attest_report_set(attest_report_t *r, attest_field_t f, const char *v)
{
    char **p = slot(r, f);
    if (p == NULL)
        return;
    free(*p);
    *p = v ? dp_xstrdup(v) : NULL;
}

void attest_report_set_unattested(attest_report_t *r, attest_field_t f, const char *note)
{
    if ((unsigned)f >= ATTEST_F__COUNT)
        return;
    attest_report_set(r, f, NULL);
    free(r->unattested_note[f]);
    r->unattested_note[f] = note ? dp_xstrdup(note) : NULL;
}

void attest_report_add_contradiction(attest_report_t *r, const char *field, const char *flag,
                                     const char *engine)
{
    r->contradictions =
        dp_xrealloc(r->contradictions, (r->ncontradictions + 1) * sizeof(*r->contradictions));
    attest_contradiction_t *c = &r->contradictions[r->ncontradictions++];
    c->field = dp_xstrdup(field ? field : "");
    c->flag = dp_xstrdup(flag ? flag : "");
    c->engine = dp_xstrdup(engine ? engine : "");
}

void attest_report_clear_contradictions(attest_report_t *r)
{
    for (size_t i = 0; i < r->ncontradictions; i++) {
        free(r->contradictions[i].field);
        free(r->contradictions[i].flag);
        free(r->contradictions[i].engine);
    }
    free(r->contradictions);
    r->contradictions = NULL;
    r->ncontradictions = 0;
}

void attest_report_drop_contradiction(attest_report_t *r, const char *field)
{
    size_t kept = 0;
    for (size_t i = 0; i < r->ncontradictions; i++) {
        attest_contradiction_t *c = &r->contradictions[i];
        if (strcmp(c->field, field) == 0) {
            free(c->field);
            free(c->flag);
            free(c->engine);
        } else {
            r->contradictions[kept++] = *c;
        }
    }
    r->ncontradictions = kept;
}

const char *attest_contradiction_flag(const char *field)
{
    static const struct {
        const char *field, *flag;
    } flags[] = {{"quantization", "--quantization"},
                 {"dtype", "--dtype"},
                 {"model_dir", "--model-dir"},
                 {"model", "--model"}};
    for (size_t i = 0; field && i < DP_ARRAY_SIZE(flags); i++)
        if (strcmp(field, flags[i].field) == 0)
            return flags[i].flag;
    return NULL;
}

void attest_report_clear(attest_report_t *r)
{
    for (int f = 0; f < ATTEST_F__COUNT; f++) {
        char **p = slot(r, (attest_field_t)f);
        assert(p != NULL); /* slot() has a case for every field */
        free(*p);
        *p = NULL;
        free(r->unattested_note[f]);
        r->unattested_note[f] = NULL;
    }
    free(r->engine_hardware);
    free(r->model_path);
    attest_report_clear_contradictions(r);
    free(r->nonce);
    free(r->issued_at);
    memset(r, 0, sizeof(*r));
}

static char *dup_or_null(const char *s)
{
    return s ? dp_xstrdup(s) : NULL;
}

void attest_report_copy(attest_report_t *dst, const attest_report_t *src)
{
    memset(dst, 0, sizeof(*dst));
    for (int f = 0; f < ATTEST_F__COUNT; f++) {
        assert(slot(dst, (attest_field_t)f) != NULL);
        *slot(dst, (attest_field_t)f) = dup_or_null(attest_report_get(src, (attest_field_t)f));
        dst->unattested_note[f] = dup_or_null(src->unattested_note[f]);
    }
    dst->engine_hardware = dup_or_null(src->engine_hardware);
    dst->engine_tp = src->engine_tp;
    dst->model_path = dup_or_null(src->model_path);
    dst->measured = src->measured;
    for (size_t i = 0; i < src->ncontradictions; i++)
        attest_report_add_contradiction(dst, src->contradictions[i].field,
                                        src->contradictions[i].flag, src->contradictions[i].engine);
    dst->nonce = dup_or_null(src->nonce);
    dst->issued_at = dup_or_null(src->issued_at);
    dst->is_signed = src->is_signed;
    memcpy(dst->keyid, src->keyid, sizeof(dst->keyid));
    memcpy(dst->source, src->source, sizeof(dst->source));
    dst->oms_reported = src->oms_reported;
    dst->oms_verified = src->oms_verified;
    memcpy(dst->oms_signer, src->oms_signer, sizeof(dst->oms_signer));
    memcpy(dst->oms_root_digest, src->oms_root_digest, sizeof(dst->oms_root_digest));
    memcpy(dst->oms_identity, src->oms_identity, sizeof(dst->oms_identity));
    memcpy(dst->oms_issuer, src->oms_issuer, sizeof(dst->oms_issuer));
}

static void write_oms(const attest_report_t *r, dp_jw_t *w)
{
    if (!r->oms_reported)
        return;
    dp_jw_obj_begin(w, "oms");
    dp_jw_bool(w, "verified", r->oms_verified);
    dp_jw_str(w, "signer", r->oms_signer[0] ? r->oms_signer : NULL);
    dp_jw_str(w, "root_digest", r->oms_root_digest[0] ? r->oms_root_digest : NULL);
    if (r->oms_identity[0]) {
        dp_jw_str(w, "identity", r->oms_identity);
        dp_jw_str(w, "issuer", r->oms_issuer);
    }
    dp_jw_obj_end(w);
}

/* "oms": absent (not reported), or {"verified": bool, "signer", "root_digest"}: 64 hex each,
 * required when verified, null otherwise. */
static int parse_oms(const cJSON *root, attest_report_t *out, dp_buf_t *why)
{
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(root, "oms");
    if (o == NULL)
        return 0;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, "verified");
    if (!cJSON_IsObject(o) || !cJSON_IsBool(v)) {
        if (why)
            dp_buf_appends(why, "payload.oms: expected an object with a boolean \"verified\"");
        return -1;
    }
    out->oms_reported = true;
    out->oms_verified = cJSON_IsTrue(v);
    static const char *const keys[] = {"signer", "root_digest"};
    char *dst[] = {out->oms_signer, out->oms_root_digest};
    for (size_t i = 0; i < 2; i++) {
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, keys[i]);
        if (!out->oms_verified && (s == NULL || cJSON_IsNull(s)))
            continue;
        if (!cJSON_IsString(s) || !dp_is_lower_hex(s->valuestring, 64)) {
            if (why)
                dp_buf_printf(why, "payload.oms.%s: expected 64 lowercase hex%s", keys[i],
                              out->oms_verified ? " (verified is true)" : " or null");
            return -1;
        }
        memcpy(dst[i], s->valuestring, 65);
    }
    /* A keyless signer: identity and issuer together, only with verified. */
    static const char *const names[] = {"identity", "issuer"};
    char *ndst[] = {out->oms_identity, out->oms_issuer};
    int present = 0;
    for (size_t i = 0; i < 2; i++) {
        const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, names[i]);
        if (s == NULL)
            continue;
        size_t n = cJSON_IsString(s) ? strlen(s->valuestring) : 0;
        if (!out->oms_verified || n == 0 || n > ATTEST_OMS_NAME_MAX) {
            if (why)
                dp_buf_printf(why, "payload.oms.%s: expected 1 to %d bytes, with verified true",
                              names[i], ATTEST_OMS_NAME_MAX);
            return -1;
        }
        memcpy(ndst[i], s->valuestring, n + 1);
        present++;
    }
    if (present == 1) {
        if (why)
            dp_buf_appends(why, "payload.oms: identity and issuer go together");
        return -1;
    }
    return 0;
}

/* ---- payload ------------------------------------------------------------------------------ */

/* "determinism": only from an agent that checks it (a mode, or null with the note saying why). */
static void write_determinism(const attest_report_t *r, dp_jw_t *w)
{
    const char *note = r->unattested_note[ATTEST_F_DETERMINISM];
    if (r->determinism == NULL && note == NULL)
        return;
    dp_jw_obj_begin(w, "determinism");
    dp_jw_str(w, "mode", r->determinism);
    if (r->determinism == NULL)
        dp_jw_str(w, "note", note);
    dp_jw_obj_end(w);
}

/* "determinism": absent, or {"mode": "batch_invariant" | null, "note": string | absent}. */
static int parse_determinism(const cJSON *root, attest_report_t *out, dp_buf_t *why)
{
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(root, "determinism");
    if (d == NULL || cJSON_IsNull(d))
        return 0;
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(d, "mode");
    const cJSON *note = cJSON_GetObjectItemCaseSensitive(d, "note");
    if (!cJSON_IsObject(d) || (mode && !cJSON_IsNull(mode) && !cJSON_IsString(mode)) ||
        (note && !cJSON_IsNull(note) && !cJSON_IsString(note))) {
        if (why)
            dp_buf_appends(why, "payload.determinism: expected an object with a string or null "
                                "\"mode\" and an optional string \"note\"");
        return -1;
    }
    if (cJSON_IsString(mode))
        attest_report_set(out, ATTEST_F_DETERMINISM, mode->valuestring);
    else if (cJSON_IsString(note))
        attest_report_set_unattested(out, ATTEST_F_DETERMINISM, note->valuestring);
    return 0;
}

static const char *str_of(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* ---- what a measuring agent adds (docs/attestation.md §4) ---------------------------------- */

static void write_measured(const attest_report_t *r, dp_jw_t *w)
{
    if (r->measured == 0)
        return;
    dp_jw_arr_begin(w, "measured");
    for (int f = 0; f < ATTEST_F__COUNT; f++)
        if (r->measured & (1u << f))
            dp_jw_str(w, NULL, attest_field_names[f]);
    dp_jw_arr_end(w);
}

static void write_contradictions(const attest_report_t *r, dp_jw_t *w)
{
    if (r->ncontradictions == 0)
        return;
    dp_jw_arr_begin(w, "contradictions");
    for (size_t i = 0; i < r->ncontradictions; i++) {
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "field", r->contradictions[i].field);
        dp_jw_str(w, "flag", r->contradictions[i].flag);
        dp_jw_str(w, "engine", r->contradictions[i].engine);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
}

/* Why a null field is null, for the fields that have a note (determinism has its own object). */
static void write_unattested_notes(const attest_report_t *r, dp_jw_t *w)
{
    bool any = false;
    for (int f = 0; f < ATTEST_F__COUNT; f++) {
        if (f == ATTEST_F_DETERMINISM || attest_report_get(r, (attest_field_t)f) != NULL ||
            r->unattested_note[f] == NULL)
            continue;
        if (!any)
            dp_jw_obj_begin(w, "unattested");
        any = true;
        dp_jw_str(w, attest_field_names[f], r->unattested_note[f]);
    }
    if (any)
        dp_jw_obj_end(w);
}

static int field_by_name(const char *name)
{
    for (int f = 0; f < ATTEST_F__COUNT; f++)
        if (strcmp(name, attest_field_names[f]) == 0)
            return f;
    return -1;
}

/* "model_path", "measured", "contradictions", "unattested": each optional; a wrong type rejects
 * the payload, names this build does not know are ignored. */
static int parse_measurement(const cJSON *root, attest_report_t *out, dp_buf_t *why)
{
    const cJSON *mp = cJSON_GetObjectItemCaseSensitive(root, "model_path");
    if (mp && !cJSON_IsNull(mp)) {
        if (!cJSON_IsString(mp)) {
            if (why)
                dp_buf_appends(why, "payload.model_path: expected a string");
            return -1;
        }
        out->model_path = dp_xstrdup(mp->valuestring);
    }
    const cJSON *ms = cJSON_GetObjectItemCaseSensitive(root, "measured"), *e;
    if (ms && !cJSON_IsNull(ms)) {
        if (!cJSON_IsArray(ms)) {
            if (why)
                dp_buf_appends(why, "payload.measured: expected an array of field names");
            return -1;
        }
        cJSON_ArrayForEach(e, ms)
        {
            if (!cJSON_IsString(e)) {
                if (why)
                    dp_buf_appends(why, "payload.measured: expected an array of field names");
                return -1;
            }
            int f = field_by_name(e->valuestring);
            if (f >= 0)
                out->measured |= 1u << f;
        }
    }
    const cJSON *cs = cJSON_GetObjectItemCaseSensitive(root, "contradictions");
    if (cs && !cJSON_IsNull(cs)) {
        if (!cJSON_IsArray(cs)) {
            if (why)
                dp_buf_appends(why, "payload.contradictions: expected an array");
            return -1;
        }
        size_t i = 0;
        cJSON_ArrayForEach(e, cs)
        {
            const char *field = str_of(e, "field"), *flag = str_of(e, "flag"),
                       *engine = str_of(e, "engine");
            if (!cJSON_IsObject(e) || field == NULL || flag == NULL || engine == NULL) {
                if (why)
                    dp_buf_printf(why,
                                  "payload.contradictions[%zu]: expected an object with string "
                                  "field, flag and engine",
                                  i);
                return -1;
            }
            attest_report_add_contradiction(out, field, flag, engine);
            i++;
        }
    }
    const cJSON *un = cJSON_GetObjectItemCaseSensitive(root, "unattested");
    if (un && !cJSON_IsNull(un)) {
        if (!cJSON_IsObject(un)) {
            if (why)
                dp_buf_appends(why, "payload.unattested: expected an object of strings");
            return -1;
        }
        cJSON_ArrayForEach(e, un)
        {
            if (!cJSON_IsString(e)) {
                if (why)
                    dp_buf_printf(why, "payload.unattested.%.64s: expected a string", e->string);
                return -1;
            }
            int f = field_by_name(e->string);
            /* A note explains a null; it never replaces a value the payload carries. */
            if (f >= 0 && f != ATTEST_F_DETERMINISM && attest_report_get(out, f) == NULL) {
                free(out->unattested_note[f]);
                out->unattested_note[f] = dp_xstrdup(e->valuestring);
            }
        }
    }
    return 0;
}

void attest_payload_build(const attest_report_t *r, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "model", r->model);
    dp_jw_str(&w, "checkpoint_sha256", r->checkpoint_sha256);
    dp_jw_str(&w, "quantization", r->quantization);
    dp_jw_str(&w, "dtype", r->dtype);
    dp_jw_obj_begin(&w, "framework");
    dp_jw_str(&w, "name", r->framework_name);
    dp_jw_str(&w, "version", r->framework_version);
    dp_jw_obj_end(&w);
    if (r->engine_fingerprint)
        dp_jw_str(&w, "engine_fingerprint", r->engine_fingerprint);
    write_determinism(r, &w);
    if (r->model_path)
        dp_jw_str(&w, "model_path", r->model_path);
    write_measured(r, &w);
    write_contradictions(r, &w);
    write_unattested_notes(r, &w);
    dp_jw_str(&w, "nonce", r->nonce);
    dp_jw_str(&w, "issued_at", r->issued_at);
    write_oms(r, &w);
    dp_jw_obj_end(&w);
}

/* Optional string member: string -> copy, null/absent -> NULL, anything else -> error. */
static int opt_string(const cJSON *obj, const char *key, const char *path, char **out,
                      dp_buf_t *why)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (v == NULL || cJSON_IsNull(v))
        return 0;
    if (!cJSON_IsString(v) || v->valuestring == NULL) {
        if (why)
            dp_buf_printf(why, "%s: expected a string", path);
        return -1;
    }
    *out = dp_xstrdup(v->valuestring);
    return 0;
}

int attest_payload_parse(const char *json, size_t len, attest_report_t *out, dp_buf_t *why)
{
    int rc = -1;
    attest_report_clear(out);
    const char *bad = NULL;
    cJSON *root = attest_json_parse(json, len, &bad);
    if (root == NULL) {
        if (why)
            dp_buf_printf(why, "payload: %s", bad);
        goto out;
    }
    if (!cJSON_IsObject(root)) {
        if (why)
            dp_buf_appends(why, "payload: expected a JSON object");
        goto out;
    }
    if (opt_string(root, "model", "payload.model", &out->model, why) != 0 ||
        opt_string(root, "checkpoint_sha256", "payload.checkpoint_sha256", &out->checkpoint_sha256,
                   why) != 0 ||
        opt_string(root, "quantization", "payload.quantization", &out->quantization, why) != 0 ||
        opt_string(root, "dtype", "payload.dtype", &out->dtype, why) != 0 ||
        opt_string(root, "engine_fingerprint", "payload.engine_fingerprint",
                   &out->engine_fingerprint, why) != 0)
        goto out;
    const cJSON *fw = cJSON_GetObjectItemCaseSensitive(root, "framework");
    if (fw != NULL && !cJSON_IsNull(fw)) {
        if (!cJSON_IsObject(fw)) {
            if (why)
                dp_buf_appends(why, "payload.framework: expected an object");
            goto out;
        }
        if (opt_string(fw, "name", "payload.framework.name", &out->framework_name, why) != 0 ||
            opt_string(fw, "version", "payload.framework.version", &out->framework_version, why) !=
                0)
            goto out;
    }
    if (out->checkpoint_sha256 && !dp_is_lower_hex(out->checkpoint_sha256, 64)) {
        if (why)
            dp_buf_appends(why, "payload.checkpoint_sha256: expected 64 lowercase hex");
        goto out;
    }
    /* nonce and issued_at are what make a payload fresh: they are required. */
    if (opt_string(root, "nonce", "payload.nonce", &out->nonce, why) != 0 ||
        opt_string(root, "issued_at", "payload.issued_at", &out->issued_at, why) != 0)
        goto out;
    if (out->nonce == NULL) {
        if (why)
            dp_buf_appends(why, "payload.nonce: missing");
        goto out;
    }
    if (out->issued_at == NULL) {
        if (why)
            dp_buf_appends(why, "payload.issued_at: missing");
        goto out;
    }
    if (parse_oms(root, out, why) != 0 || parse_determinism(root, out, why) != 0 ||
        parse_measurement(root, out, why) != 0)
        goto out;
    snprintf(out->source, sizeof(out->source), "agent");
    rc = 0;
out:
    cJSON_Delete(root);
    if (rc != 0)
        attest_report_clear(out);
    return rc;
}

void attest_report_write_json(const attest_report_t *r, dp_jw_t *w, const char *key)
{
    dp_jw_obj_begin(w, key);
    dp_jw_str(w, "model", r->model);
    dp_jw_str(w, "checkpoint_sha256", r->checkpoint_sha256);
    dp_jw_str(w, "quantization", r->quantization);
    dp_jw_str(w, "dtype", r->dtype);
    dp_jw_obj_begin(w, "framework");
    dp_jw_str(w, "name", r->framework_name);
    dp_jw_str(w, "version", r->framework_version);
    dp_jw_obj_end(w);
    dp_jw_str(w, "engine_fingerprint", r->engine_fingerprint);
    if (r->engine_hardware || r->engine_tp) {
        dp_jw_obj_begin(w, "engine");
        dp_jw_str(w, "hardware", r->engine_hardware);
        if (r->engine_tp)
            dp_jw_uint(w, "tensor_parallel", r->engine_tp);
        else
            dp_jw_null(w, "tensor_parallel");
        dp_jw_obj_end(w);
    }
    dp_jw_obj_begin(w, "determinism");
    dp_jw_str(w, "mode", r->determinism);
    dp_jw_obj_end(w);
    dp_jw_str(w, "nonce", r->nonce);
    dp_jw_str(w, "issued_at", r->issued_at);
    dp_jw_bool(w, "signed", r->is_signed);
    if (r->keyid[0])
        dp_jw_str(w, "keyid", r->keyid);
    else
        dp_jw_null(w, "keyid");
    dp_jw_str(w, "source", r->source);
    write_oms(r, w);
    if (r->model_path)
        dp_jw_str(w, "model_path", r->model_path);
    write_measured(r, w);
    write_contradictions(r, w);
    dp_jw_obj_begin(w, "unattested");
    for (int f = 0; f < ATTEST_F__COUNT; f++)
        if (attest_report_get(r, (attest_field_t)f) == NULL)
            dp_jw_str(w, attest_field_names[f],
                      r->unattested_note[f] ? r->unattested_note[f] : "not reported");
    dp_jw_obj_end(w);
    dp_jw_obj_end(w);
}

/* ---- reasons ------------------------------------------------------------------------------ */

void attest_reasons_add(attest_reasons_t *r, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0)
        return;
    char *s = dp_xmalloc((size_t)n + 1);
    va_start(ap, fmt);
    vsnprintf(s, (size_t)n + 1, fmt, ap);
    va_end(ap);
    r->items = dp_xrealloc(r->items, (r->count + 1) * sizeof(*r->items));
    r->items[r->count++] = s;
}

void attest_reasons_free(attest_reasons_t *r)
{
    for (size_t i = 0; i < r->count; i++)
        free(r->items[i]);
    free(r->items);
    r->items = NULL;
    r->count = 0;
}

void attest_reasons_join(const attest_reasons_t *r, const char *sep, dp_buf_t *out)
{
    for (size_t i = 0; i < r->count; i++) {
        if (i)
            dp_buf_appends(out, sep);
        dp_buf_appends(out, r->items[i]);
    }
}

/* v cut to max bytes (max - 3 and "..." when longer), control characters as '?'. */
static void sanitize(const char *v, size_t max, dp_buf_t *out)
{
    assert(max > 3);
    size_t n = strlen(v);
    size_t keep = n > max ? max - 3 : n;
    for (size_t i = 0; i < keep; i++) {
        unsigned char c = (unsigned char)v[i];
        dp_buf_appendc(out, c < 0x20 || c == 0x7f ? '?' : (char)c);
    }
    if (n > max)
        dp_buf_appends(out, "...");
}

void attest_abbrev(const char *v, dp_buf_t *out)
{
    if (v == NULL) {
        dp_buf_appends(out, "(none)");
        return;
    }
    if (strlen(v) == 64 && dp_is_lower_hex(v, 64)) {
        dp_buf_append(out, v, 8);
        dp_buf_appends(out, "..");
        return;
    }
    sanitize(v, 64, out);
}

void attest_abbrev_note(const char *v, dp_buf_t *out)
{
    sanitize(v ? v : "(none)", ATTEST_NOTE_MAX, out);
}
