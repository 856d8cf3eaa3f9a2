/* Manifest match, admission and canary history (see match.h). */
#include "attest/match.h"

#include <assert.h>
#include <string.h>
#include <strings.h>

#include "common/util.h"

const char *attest_manifest_get(const cfg_manifest_t *m, attest_field_t f)
{
    if (m == NULL)
        return NULL;
    switch (f) {
    case ATTEST_F_MODEL:
        return m->model;
    case ATTEST_F_CHECKPOINT:
        return m->checkpoint_sha256;
    case ATTEST_F_QUANTIZATION:
        return m->quantization;
    case ATTEST_F_DTYPE:
        return m->dtype;
    case ATTEST_F_FRAMEWORK_NAME:
        return m->framework_name;
    case ATTEST_F_FRAMEWORK_VERSION:
        return m->framework_version;
    case ATTEST_F_ENGINE_FINGERPRINT:
        return m->engine_fingerprint;
    case ATTEST_F_DETERMINISM:
        /* single_sequence is detproxy's own doing: nothing for a replica to attest. */
        return m->determinism == CFG_DETERMINISM_BATCH_INVARIANT
                   ? cfg_determinism_names[CFG_DETERMINISM_BATCH_INVARIANT]
                   : NULL;
    default:
        return NULL;
    }
}

/* "vllm adapter" / "agent": who failed to report a field, for the default note. */
static void source_phrase(const attest_report_t *r, dp_buf_t *out)
{
    if (r->source[0] == '\0')
        dp_buf_appends(out, "source");
    else if (strcmp(r->source, "agent") == 0)
        dp_buf_appends(out, "agent");
    else
        dp_buf_printf(out, "%s adapter", r->source);
}

/* The publisher's key, not just the pipeline's, must vouch for the files on disk
 * (docs/attestation.md §9). */
static int oms_match(const cfg_manifest_t *m, const attest_report_t *r, dp_buf_t *got,
                     dp_buf_t *want, attest_reasons_t *out)
{
    if (m->oms_signer == NULL && m->oms_identity == NULL)
        return 0;
    if (!r->oms_reported) {
        attest_reasons_add(out, "oms unattested (%s)",
                           strcmp(r->source, "agent") == 0
                               ? "agent did not report it: start it with --oms-bundle"
                               : "only the attestation agent verifies OMS bundles");
        return 1;
    }
    if (!r->oms_verified) {
        attest_reasons_add(out, "oms bundle not verified by the agent (see its log)");
        return 1;
    }
    /* Keyless: the key is ephemeral, the identity and its issuer are the publisher. */
    const char *const field[] = {"signer", "identity", "issuer"};
    const char *const have[] = {r->oms_signer, r->oms_identity, r->oms_issuer};
    const char *const pin[] = {m->oms_signer, m->oms_identity, m->oms_issuer};
    int n = 0;
    for (size_t i = 0; i < 3; i++) {
        if (pin[i] == NULL || strcmp(have[i], pin[i]) == 0)
            continue;
        dp_buf_reset(got);
        dp_buf_reset(want);
        attest_abbrev(have[i][0] ? have[i] : "(none: not a keyless bundle)", got);
        attest_abbrev(pin[i], want);
        attest_reasons_add(out, "oms.%s mismatch: got %s want %s", field[i], got->base, want->base);
        n++;
    }
    return n;
}

/* llama.cpp names GGUF file types in capitals ("Q8_0"); manifests may write "q8_0". That holds
 * for its own adapter and for an agent that measured a llama.cpp engine. */
static bool quant_caseless(const attest_report_t *r)
{
    return strcmp(r->source, "llamacpp") == 0 ||
           (strcmp(r->source, "agent") == 0 && (r->measured & (1u << ATTEST_F_QUANTIZATION)) &&
            r->framework_name && strcmp(r->framework_name, "llamacpp") == 0);
}

bool attest_value_matches(const attest_report_t *r, attest_field_t f, const char *v)
{
    const char *g = attest_report_get(r, f);
    return g && v &&
           (strcmp(g, v) == 0 ||
            (f == ATTEST_F_QUANTIZATION && quant_caseless(r) && strcasecmp(g, v) == 0));
}

/* One identity, its accept list ignored. */
static int match_one(const cfg_manifest_t *m, const attest_report_t *r, attest_reasons_t *out)
{
    int n = 0;
    dp_buf_t got = {0}, want = {0}, who = {0};
    for (int i = 0; i < ATTEST_F__COUNT; i++) {
        attest_field_t f = (attest_field_t)i;
        const char *w = attest_manifest_get(m, f);
        if (w == NULL)
            continue;
        const char *g = attest_report_get(r, f);
        if (g == NULL) {
            /* Fail closed: a pinned field nobody vouches for is not a match. */
            dp_buf_reset(&who);
            if (r->unattested_note[f]) {
                attest_abbrev_note(r->unattested_note[f], &who);
            } else {
                source_phrase(r, &who);
                dp_buf_appends(&who, strcmp(r->source, "agent") == 0 ? " did not report it"
                                                                     : " does not report it");
            }
            attest_reasons_add(out, "%s unattested (%s)", attest_field_names[f], who.base);
            n++;
            continue;
        }
        if (attest_value_matches(r, f, w))
            continue;
        dp_buf_reset(&got);
        dp_buf_reset(&want);
        attest_abbrev(g, &got);
        attest_abbrev(w, &want);
        attest_reasons_add(out, "%s mismatch: got %s want %s", attest_field_names[f], got.base,
                           want.base);
        n++;
    }
    n += oms_match(m, r, &got, &want, out);
    dp_buf_free(&got);
    dp_buf_free(&want);
    dp_buf_free(&who);
    return n;
}

const cfg_manifest_t *attest_manifest_identity(const cfg_manifest_t *m, const attest_report_t *r)
{
    const cfg_manifest_t *id;
    for (size_t i = 0; (id = cfg_manifest_identity(m, i)) != NULL; i++) {
        attest_reasons_t tmp = {0};
        int bad = match_one(id, r, &tmp);
        attest_reasons_free(&tmp);
        if (bad == 0)
            return id;
    }
    return NULL;
}

int attest_manifest_match(const cfg_manifest_t *m, const attest_report_t *r, attest_reasons_t *out)
{
    if (m == NULL)
        return 0;
    if (m->naccept == 0)
        return match_one(m, r, out);
    if (attest_manifest_identity(m, r) != NULL)
        return 0;
    /* The manifest's own reasons in full, then one line per accepted identity, so an operator
     * mid-rollout sees how far the replica is from each. */
    int n = match_one(m, r, out);
    for (size_t i = 0; i < m->naccept; i++) {
        attest_reasons_t tmp = {0};
        match_one(&m->accept[i], r, &tmp);
        dp_buf_t j = {0};
        attest_reasons_join(&tmp, "; ", &j);
        attest_reasons_add(out, "nor accept[%zu] (%s): %s", i, m->accept[i].fingerprint,
                           j.base ? j.base : "");
        dp_buf_free(&j);
        attest_reasons_free(&tmp);
        n++;
    }
    return n;
}

/* A flag the engine contradicts is a replica that is not what its operator says, whatever the
 * manifest pins (docs/attestation.md §4): one reason per contradiction, naming both values. */
static int contradictions(const attest_report_t *r, attest_reasons_t *out)
{
    dp_buf_t flag = {0}, engine = {0};
    for (size_t i = 0; i < r->ncontradictions; i++) {
        const attest_contradiction_t *c = &r->contradictions[i];
        const char *name = attest_contradiction_flag(c->field);
        dp_buf_reset(&flag);
        dp_buf_reset(&engine);
        attest_abbrev_note(c->flag, &flag);
        attest_abbrev_note(c->engine, &engine);
        if (name)
            attest_reasons_add(out, "agent: %s %s contradicts the engine's %s", name, flag.base,
                               engine.base);
        else
            attest_reasons_add(out, "agent: %.32s %s contradicts the engine's %s", c->field,
                               flag.base, engine.base);
    }
    dp_buf_free(&flag);
    dp_buf_free(&engine);
    return (int)r->ncontradictions;
}

int attest_admit(const cfg_manifest_t *m, const attest_report_t *r, bool require_signature,
                 attest_reasons_t *out)
{
    int n = 0;
    if (require_signature && !r->is_signed) {
        dp_buf_t who = {0};
        source_phrase(r, &who);
        attest_reasons_add(
            out, "unsigned attestation (%s) but attestation.require_signature is true", who.base);
        dp_buf_free(&who);
        n++;
    }
    n += contradictions(r, out);
    return n + attest_manifest_match(m, r, out);
}

/* ---- canary ------------------------------------------------------------------------------- */

bool attest_canary_record(attest_canary_t *c, bool matched)
{
    c->bits = (uint8_t)(((c->bits << 1) | (matched ? 0u : 1u)) & 7u);
    if (c->count < 3)
        c->count++;
    return attest_canary_rejected(c);
}

bool attest_canary_rejected(const attest_canary_t *c)
{
    assert(c->count <= 3); /* the window is the last three checks */
    unsigned window = c->bits & ((1u << c->count) - 1u);
    int mismatches = (window & 1u) + ((window >> 1) & 1u) + ((window >> 2) & 1u);
    return mismatches >= 2;
}

void attest_canary_reset(attest_canary_t *c)
{
    c->bits = 0;
    c->count = 0;
}

void attest_canary_sha256(const char *text, size_t n, char out[65])
{
    dp_sha256_hex(text, n, out);
}

bool attest_canary_matches(const cfg_canary_t *canary, const char *text, size_t n)
{
    if (canary == NULL || canary->expected_sha256 == NULL)
        return true;
    char hex[65];
    dp_sha256_hex(text, n, hex);
    return strcmp(hex, canary->expected_sha256) == 0;
}

void attest_canary_reason(const char *sha256, const char *expected, attest_reasons_t *out)
{
    if (expected && expected[0])
        attest_reasons_add(out,
                           "canary mismatch: output sha256 %.8s.. want %.8s.. (not admitted "
                           "until the canary matches)",
                           sha256, expected);
    else
        attest_reasons_add(out,
                           "canary not recorded: the manifest has no canary.expected_sha256 "
                           "(this replica's output hashes to %s; 'detproxy attest canary' "
                           "prints it)",
                           sha256);
}

cfg_attest_source_t attest_engine_source(const attest_report_t *attested)
{
    for (int s = CFG_ATTEST_VLLM; attested->framework_name && s <= CFG_ATTEST_LLAMACPP; s++)
        if (strcmp(attested->framework_name, cfg_attest_source_names[s]) == 0)
            return (cfg_attest_source_t)s;
    return CFG_ATTEST_NONE;
}

void attest_engine_reason(const attest_report_t *attested, const attest_report_t *engine,
                          attest_reasons_t *out)
{
    static const attest_field_t shown[] = {ATTEST_F_QUANTIZATION, ATTEST_F_DTYPE,
                                           ATTEST_F_FRAMEWORK_VERSION, ATTEST_F_ENGINE_FINGERPRINT};
    const char *src = cfg_attest_source_names[attest_engine_source(attested)];
    dp_buf_t diff = {0}, all = {0};
    for (size_t i = 0; i < DP_ARRAY_SIZE(shown); i++) {
        const char *eng = attest_report_get(engine, shown[i]);
        const char *att = attest_report_get(attested, shown[i]);
        if (eng == NULL)
            continue;
        dp_buf_printf(&all, "%s%s %s", all.len ? ", " : "", attest_field_names[shown[i]], eng);
        if (att == NULL || strcasecmp(eng, att) != 0)
            dp_buf_printf(&diff, "%s%s %s (attested %s)", diff.len ? ", " : "",
                          attest_field_names[shown[i]], eng, att ? att : "none");
    }
    const char *em = engine->model_path, *am = attested->model_path;
    if (em && am && strcmp(em, am) != 0)
        dp_buf_printf(&diff, "%smodel_path %s (attested %s)", diff.len ? ", " : "", em, am);
    if (diff.len)
        attest_reasons_add(out, "the engine itself (%s metadata) reports %s", src, diff.base);
    else if (all.len)
        attest_reasons_add(out,
                           "the engine itself (%s metadata) agrees with the attested identity "
                           "(%s): what changed is not in its metadata",
                           src, all.base);
    dp_buf_free(&diff);
    dp_buf_free(&all);
}
