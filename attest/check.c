/* One attestation check, the pure part (see check.h). */
#include "attest/check.h"

#include <assert.h>
#include <stdio.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "attest/match.h"
#include "common/jw.h"
#include "common/util.h"

const char *const attest_verdict_names[ATTEST_V__COUNT] = {"admitted", "mismatch", "invalid",
                                                           "unreachable", "reported"};

void attest_check_plan(attest_check_t *c, cfg_attest_source_t source, const char *base,
                       const char *agent_path)
{
    memset(c, 0, sizeof(*c));
    c->source = source;
    if (base == NULL)
        base = "";
    if (source == CFG_ATTEST_AGENT) {
        uint8_t raw[16];
        dp_random_bytes(raw, sizeof(raw));
        dp_hex(raw, sizeof(raw), c->nonce);
        attest_request_t *q = &c->requests[c->nrequests++];
        snprintf(q->target, sizeof(q->target), "%s?nonce=%s",
                 agent_path && agent_path[0] ? agent_path : "/attestation", c->nonce);
        q->max_bytes = ATTEST_ENVELOPE_MAX_BYTES;
        q->required = true;
    } else if (source == CFG_ATTEST_NONE) {
        attest_request_t *q = &c->requests[c->nrequests++];
        snprintf(q->target, sizeof(q->target), "%s/v1/models", base);
        q->max_bytes = ATTEST_ADAPTER_MAX_BODY;
        q->required = true;
    } else {
        const attest_adapter_t *ad = attest_adapter_for(source);
        assert(ad == NULL || ad->npaths <= ATTEST_CHECK_MAX_REQUESTS);
        for (size_t i = 0; ad && i < ad->npaths; i++) {
            attest_request_t *q = &c->requests[c->nrequests++];
            snprintf(q->target, sizeof(q->target), "%s%s", base, ad->paths[i]);
            q->max_bytes = ATTEST_ADAPTER_MAX_BODY;
            q->required = ad->required[i];
        }
    }
}

/* Why the answer a made the replica unreachable (out->reasons, out->status, out->detail). */
static void unreachable(attest_outcome_t *out, const attest_answer_t *a)
{
    out->verdict = ATTEST_V_UNREACHABLE;
    out->status = a->status;
    if (a->status == 0) {
        snprintf(out->detail, sizeof(out->detail), "%s",
                 a->detail && a->detail[0] ? a->detail
                 : a->error                ? a->error
                                           : "failed");
        attest_reasons_add(&out->reasons, "attestation fetch failed (%s): %s",
                           a->error ? a->error : "error", a->detail ? a->detail : "");
        return;
    }
    /* An agent says why it cannot vouch (re-hashing after a change, the hash failed). */
    cJSON *doc = cJSON_ParseWithLength(a->body ? a->body : "", a->len);
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(doc, "error");
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(e, "message");
    const cJSON *code = cJSON_GetObjectItemCaseSensitive(e, "code");
    if (cJSON_IsString(msg) && cJSON_IsString(code) &&
        strcmp(code->valuestring, "framework_unreachable") == 0)
        /* A live agent before a dead engine: the engine is what is unreachable, and the agent's
         * message says where ("framework at http://..: connection refused"). */
        attest_reasons_add(&out->reasons, "%.200s", msg->valuestring);
    else if (cJSON_IsString(msg))
        attest_reasons_add(&out->reasons, "attestation endpoint answered %d: %.200s", a->status,
                           msg->valuestring);
    else
        attest_reasons_add(&out->reasons, "attestation endpoint answered %d", a->status);
    cJSON_Delete(doc);
}

static void invalid(attest_outcome_t *out, const dp_buf_t *why, const char *fallback)
{
    attest_report_clear(&out->report);
    out->verdict = ATTEST_V_INVALID;
    attest_reasons_add(&out->reasons, "%s", why->base ? why->base : fallback);
}

void attest_check_read(const attest_check_t *c, const attest_answer_t *answers,
                       const attest_keyset_t *keys, bool require_signature, attest_outcome_t *out)
{
    attest_outcome_clear(out);
    for (size_t i = 0; i < c->nrequests; i++) {
        const attest_answer_t *a = &answers[i];
        if (a->status == 0 || (a->status != 200 && c->requests[i].required)) {
            unreachable(out, a);
            return;
        }
    }
    dp_buf_t why = {0};
    out->verdict = ATTEST_V_REPORTED;
    if (c->source == CFG_ATTEST_AGENT) {
        dp_buf_append(&out->evidence, answers[0].body ? answers[0].body : "", answers[0].len);
    } else {
        for (size_t i = 0; i < c->nrequests; i++) {
            dp_buf_printf(&out->evidence, "GET %s %d %zu\n", c->requests[i].target,
                          answers[i].status, answers[i].len);
            dp_buf_append(&out->evidence, answers[i].body ? answers[i].body : "", answers[i].len);
            dp_buf_appendc(&out->evidence, '\n');
        }
    }
    /* attest_check_plan gives an agent and a source of none their one request. */
    assert((c->source != CFG_ATTEST_NONE && c->source != CFG_ATTEST_AGENT) || c->nrequests == 1);
    if (c->source == CFG_ATTEST_NONE) {
        /* Nothing to attest: /v1/models answering is reachability, and names the model. */
        cJSON *doc = cJSON_ParseWithLength(answers[0].body ? answers[0].body : "", answers[0].len);
        const cJSON *m = cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(doc, "data"), 0);
        const cJSON *id = cJSON_GetObjectItemCaseSensitive(m, "id");
        if (cJSON_IsString(id))
            attest_report_set(&out->report, ATTEST_F_MODEL, id->valuestring);
        cJSON_Delete(doc);
        snprintf(out->report.source, sizeof(out->report.source), "none");
    } else if (c->source == CFG_ATTEST_AGENT) {
        attest_verify_opts_t o = {keys, require_signature, c->nonce};
        if (attest_envelope_verify(answers[0].body ? answers[0].body : "", answers[0].len, &o,
                                   &out->report, &why) != 0)
            invalid(out, &why, "invalid attestation");
    } else {
        const attest_adapter_t *ad = attest_adapter_for(c->source);
        dp_iovec_t bodies[ATTEST_CHECK_MAX_REQUESTS] = {{0}};
        for (size_t i = 0; i < c->nrequests; i++)
            if (answers[i].status == 200)
                bodies[i] = (dp_iovec_t){answers[i].body ? answers[i].body : "", answers[i].len};
        if (ad == NULL || ad->parse(bodies, c->nrequests, &out->report, &why) != 0)
            invalid(out, &why, "unreadable metadata");
    }
    dp_buf_free(&why);
}

bool attest_check_wants_probe(const attest_check_t *c, const attest_outcome_t *out)
{
    return out->verdict == ATTEST_V_REPORTED && c->source != CFG_ATTEST_AGENT &&
           c->source != CFG_ATTEST_NONE;
}

const char *attest_check_metadata_fingerprint(const attest_check_t *c, const attest_outcome_t *out)
{
    if (out->verdict != ATTEST_V_REPORTED || c->source != CFG_ATTEST_LLAMACPP)
        return NULL;
    return out->report.framework_version; /* build_info (attest/adapters.c) */
}

const char *attest_check_probe_model(const attest_outcome_t *out, const char *fallback)
{
    return out->report.model ? out->report.model : fallback ? fallback : "";
}

void attest_check_probe_read(attest_outcome_t *out, const attest_answer_t *a)
{
    dp_buf_printf(&out->evidence, "POST /v1/completions %d %zu\n", a->status, a->len);
    dp_buf_append(&out->evidence, a->body ? a->body : "", a->len);
    dp_buf_appendc(&out->evidence, '\n');
    dp_iovec_t b = {NULL, 0};
    if (a->status == 200)
        b = (dp_iovec_t){a->body ? a->body : "", a->len};
    attest_adapter_probe_parse(&b, &out->report);
    if (a->status != 0 && a->status != 200) {
        char why[96];
        snprintf(why, sizeof(why), "the 1-token probe completion answered %d", a->status);
        attest_report_set_unattested(&out->report, ATTEST_F_ENGINE_FINGERPRINT, why);
    }
}

void attest_check_judge(attest_outcome_t *out, const cfg_manifest_t *m, bool require_signature)
{
    if (out->verdict != ATTEST_V_REPORTED)
        return;
    out->verdict = attest_admit(m, &out->report, require_signature, &out->reasons) == 0
                       ? ATTEST_V_ADMITTED
                       : ATTEST_V_MISMATCH;
}

const char *attest_outcome_reason(const attest_outcome_t *out, const char *fallback)
{
    return out->reasons.count ? out->reasons.items[0] : fallback;
}

void attest_outcome_clear(attest_outcome_t *out)
{
    attest_report_clear(&out->report);
    attest_reasons_free(&out->reasons);
    dp_buf_free(&out->evidence);
    memset(out, 0, sizeof(*out));
}

void attest_check_completion_body(const char *model, const char *prompt, uint32_t max_tokens,
                                  bool seed0, bool no_cache_prompt, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "model", model);
    dp_jw_str(&w, "prompt", prompt);
    dp_jw_uint(&w, "max_tokens", max_tokens);
    dp_jw_int(&w, "temperature", 0);
    if (seed0)
        dp_jw_int(&w, "seed", 0);
    if (no_cache_prompt)
        dp_jw_bool(&w, "cache_prompt", false);
    dp_jw_obj_end(&w);
}
