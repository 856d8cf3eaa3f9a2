/* Manifests (docs/configuration.md, "Manifest"): the identity a pool pins, and its fingerprint. */
#include "config/cfg_internal.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static const char *const manifest_keys[] = {"model",
                                            "checkpoint_sha256",
                                            "quantization",
                                            "dtype",
                                            "framework",
                                            "engine_fingerprint",
                                            "canary",
                                            "oms",
                                            "accept",
                                            "determinism",
                                            NULL};
static const char *const oms_keys[] = {"signer", "identity", "issuer", NULL};
static const char *const determinism_keys[] = {"mode", NULL};

const char *const cfg_determinism_names[] = {"none", "batch_invariant", "single_sequence"};
_Static_assert(DP_ARRAY_SIZE(cfg_determinism_names) == CFG_DETERMINISM_SINGLE_SEQUENCE + 1,
               "one name per cfg_determinism_t, which indexes the table");
/* An accepted identity during a rollout: what differs from the manifest's own (no nesting). */
static const char *const accept_keys[] = {
    "model",     "checkpoint_sha256",  "quantization", "dtype",
    "framework", "engine_fingerprint", "canary",       "oms",
    NULL};
static const char *const framework_keys[] = {"name", "version", NULL};
static const char *const canary_keys[] = {"prompt", "max_tokens", "expected_sha256", NULL};

#define CANARY_MAX_TOKENS_DEFAULT 16
#define CANARY_MAX_TOKENS_MAX 4096
#define ACCEPT_MAX 8 /* a rollout has an old and a new identity; a few more is plenty */

/* A string that must be 64 lowercase hex digits (as sha256sum prints). */
static void get_sha256(cfg_ctx_t *c, const cJSON *obj, const char *key, bool required, char **out)
{
    char *v = NULL;
    if (!cfg_get_str(c, obj, key, required, &v))
        return;
    if (dp_is_lower_hex(v, 64)) {
        *out = v;
        return;
    }
    cfg_err(c, key, "must be 64 lowercase hex digits (a SHA-256 as sha256sum prints it)");
    free(v);
}

static void parse_framework(cfg_ctx_t *c, const cJSON *obj, cfg_manifest_t *m)
{
    const cJSON *fw = cfg_get_obj(c, obj, "framework", false);
    if (fw == NULL)
        return;
    size_t mark = cfg_path_key(c, "framework");
    cfg_check_keys(c, fw, framework_keys);
    cfg_get_str(c, fw, "name", false, &m->framework_name);
    cfg_get_str(c, fw, "version", false, &m->framework_version);
    cfg_path_pop(c, mark);
}

static void parse_canary(cfg_ctx_t *c, const cJSON *obj, cfg_manifest_t *m)
{
    const cJSON *cn = cfg_get_obj(c, obj, "canary", false);
    if (cn == NULL)
        return;
    size_t mark = cfg_path_key(c, "canary");
    cfg_canary_t *k = dp_xcalloc(1, sizeof(*k));
    m->canary = k;
    k->max_tokens = CANARY_MAX_TOKENS_DEFAULT;
    cfg_check_keys(c, cn, canary_keys);
    cfg_get_text(c, cn, "prompt", true, &k->prompt);
    cfg_get_u32(c, cn, "max_tokens", 1, CANARY_MAX_TOKENS_MAX, &k->max_tokens);
    get_sha256(c, cn, "expected_sha256", false, &k->expected_sha256);
    /* Recording the hash takes a running replica (`detproxy attest canary`), so a manifest may
     * carry the prompt first; until the hash is pinned no replica is admitted (fail closed). */
    if (cJSON_GetObjectItemCaseSensitive(cn, "expected_sha256") == NULL)
        cfg_warn(c, "expected_sha256",
                 "not recorded: no replica is admitted until it is ('detproxy attest canary' "
                 "prints it)");
    cfg_path_pop(c, mark);
}

/* "oms": {"signer": "<hex SHA-256 of the publisher's public key DER>"} and/or, for a keyless
 * (Sigstore) publisher, {"identity": "<certificate SAN>", "issuer": "<OIDC issuer URL>"}
 * (docs/attestation.md §9). */
static void parse_oms(cfg_ctx_t *c, const cJSON *obj, cfg_manifest_t *m)
{
    const cJSON *o = cfg_get_obj(c, obj, "oms", false);
    if (o == NULL)
        return;
    size_t mark = cfg_path_key(c, "oms");
    cfg_check_keys(c, o, oms_keys);
    get_sha256(c, o, "signer", false, &m->oms_signer);
    cfg_get_str(c, o, "identity", false, &m->oms_identity);
    cfg_get_str(c, o, "issuer", false, &m->oms_issuer);
    if (!m->oms_identity != !m->oms_issuer)
        cfg_err(c, m->oms_identity ? "issuer" : "identity",
                "required with %s: a keyless signer is an identity and its OIDC issuer",
                m->oms_identity ? "identity" : "issuer");
    else if (!m->oms_signer && !m->oms_identity)
        cfg_err(c, NULL, "needs signer (a key or certificate) or identity and issuer (keyless)");
    cfg_path_pop(c, mark);
}

/* "determinism": {"mode": "batch_invariant" | "single_sequence"}
 * (docs/configuration.md, "Deterministic pools"). */
static void parse_determinism(cfg_ctx_t *c, const cJSON *obj, cfg_manifest_t *m)
{
    const cJSON *d = cfg_get_obj(c, obj, "determinism", false);
    if (d == NULL)
        return;
    size_t mark = cfg_path_key(c, "determinism");
    cfg_check_keys(c, d, determinism_keys);
    int mode;
    if (cfg_get(d, "mode") == NULL)
        cfg_err(c, "mode", "required: \"batch_invariant\" or \"single_sequence\"");
    else if (cfg_get_enum(c, d, "mode", &cfg_determinism_names[1], 2, &mode))
        m->determinism = (cfg_determinism_t)(mode + 1);
    cfg_path_pop(c, mark);
}

/* The identity fields and canary of a manifest or of one of its accept[] entries. */
static void parse_identity(cfg_ctx_t *c, const cJSON *node, cfg_manifest_t *m)
{
    cfg_get_str(c, node, "model", false, &m->model);
    get_sha256(c, node, "checkpoint_sha256", false, &m->checkpoint_sha256);
    cfg_get_str(c, node, "quantization", false, &m->quantization);
    cfg_get_str(c, node, "dtype", false, &m->dtype);
    parse_framework(c, node, m);
    cfg_get_str(c, node, "engine_fingerprint", false, &m->engine_fingerprint);
    parse_canary(c, node, m);
    parse_oms(c, node, m);
}

static void inherit(char **own, const char *top)
{
    if (*own == NULL && top != NULL)
        *own = dp_xstrdup(top);
}

static bool same_str(const char *x, const char *y)
{
    return x == NULL ? y == NULL : y != NULL && strcmp(x, y) == 0;
}

/* The fingerprint covers the six identity fields (docs/configuration.md, "Manifest"); the engine
 * fingerprint and the OMS signer are pinned beside them. */
static bool same_identity(const cfg_manifest_t *a, const cfg_manifest_t *b)
{
    return strcmp(a->fingerprint, b->fingerprint) == 0 &&
           same_str(a->engine_fingerprint, b->engine_fingerprint) &&
           same_str(a->oms_signer, b->oms_signer) && same_str(a->oms_identity, b->oms_identity) &&
           same_str(a->oms_issuer, b->oms_issuer);
}

/* "accept": [{...}, ...]: identities admitted beside the manifest's own while a rollout runs.
 * Each entry lists what differs; everything else (the canary included) is the manifest's. */
static void parse_accept(cfg_ctx_t *c, const cJSON *node, cfg_manifest_t *m)
{
    const cJSON *arr = cfg_get_arr(c, node, "accept", false);
    if (arr == NULL)
        return;
    size_t mark = cfg_path_key(c, "accept");
    int n = cJSON_GetArraySize(arr);
    if (n < 1 || n > ACCEPT_MAX) {
        cfg_err(c, NULL, "must list 1 to %d identities (found %d)", ACCEPT_MAX, n);
        cfg_path_pop(c, mark);
        return;
    }
    if (!cfg_manifest_pins(m))
        cfg_err(c, NULL,
                "the manifest itself pins no identity, so every replica would be "
                "admitted: pin the identity being replaced at the top level");
    m->accept = dp_xcalloc((size_t)n, sizeof(*m->accept));
    const cJSON *it;
    cJSON_ArrayForEach(it, arr)
    {
        size_t im = cfg_path_index(c, m->naccept);
        cfg_manifest_t *e = &m->accept[m->naccept++];
        if (!cJSON_IsObject(it)) {
            cfg_err(c, NULL,
                    "expected an object (the identity fields that differ from the "
                    "manifest's)");
            cfg_path_pop(c, im);
            continue;
        }
        cfg_check_keys(c, it, accept_keys);
        parse_identity(c, it, e);
        inherit(&e->model, m->model);
        inherit(&e->checkpoint_sha256, m->checkpoint_sha256);
        inherit(&e->quantization, m->quantization);
        inherit(&e->dtype, m->dtype);
        inherit(&e->framework_name, m->framework_name);
        inherit(&e->framework_version, m->framework_version);
        inherit(&e->engine_fingerprint, m->engine_fingerprint);
        if (!e->oms_signer && !e->oms_identity) { /* "oms" is one pin: inherited whole */
            inherit(&e->oms_signer, m->oms_signer);
            inherit(&e->oms_identity, m->oms_identity);
            inherit(&e->oms_issuer, m->oms_issuer);
        }
        e->determinism = m->determinism; /* a pool property: every identity must attest it */
        if (e->canary == NULL && m->canary != NULL) {
            e->canary = dp_xcalloc(1, sizeof(*e->canary));
            e->canary->prompt = dp_xstrdup(m->canary->prompt);
            e->canary->max_tokens = m->canary->max_tokens;
            if (m->canary->expected_sha256)
                e->canary->expected_sha256 = dp_xstrdup(m->canary->expected_sha256);
        }
        cfg_manifest_fingerprint(e, e->fingerprint);
        if (same_identity(e, m))
            cfg_err(c, NULL,
                    "the same identity as the manifest itself (%s): list only the "
                    "fields that differ",
                    e->fingerprint);
        for (size_t k = 0; k + 1 < m->naccept; k++)
            if (same_identity(e, &m->accept[k])) {
                cfg_err(c, NULL, "the same identity as accept[%zu] (%s)", k, e->fingerprint);
                break;
            }
        cfg_path_pop(c, im);
    }
    cfg_path_pop(c, mark);
}

cfg_manifest_t *cfg_manifest_from_json(cfg_ctx_t *c, const cJSON *node)
{
    if (!cJSON_IsObject(node)) {
        cfg_err(c, NULL, "expected an object");
        return NULL;
    }
    cfg_manifest_t *m = dp_xcalloc(1, sizeof(*m));
    cfg_check_keys(c, node, manifest_keys);
    parse_identity(c, node, m);
    parse_determinism(c, node, m);
    cfg_manifest_fingerprint(m, m->fingerprint);
    parse_accept(c, node, m);
    return m;
}

cfg_manifest_t *cfg_manifest_parse(const char *json, size_t len, const char *path,
                                   cfg_errors_t *errs)
{
    cfg_errors_t local = {0};
    cfg_ctx_t c;
    cfg_ctx_init(&c, errs != NULL ? errs : &local, path, "manifest", NULL);
    cJSON *doc = cfg_parse_json(&c, json, len);
    cfg_manifest_t *m = doc != NULL ? cfg_manifest_from_json(&c, doc) : NULL;
    if (c.nerrors > 0) {
        cfg_manifest_free(m);
        m = NULL;
    }
    cJSON_Delete(doc);
    cfg_ctx_free(&c);
    cfg_errors_free(&local);
    return m;
}

static void manifest_clear(cfg_manifest_t *m)
{
    free(m->model);
    free(m->checkpoint_sha256);
    free(m->quantization);
    free(m->dtype);
    free(m->framework_name);
    free(m->framework_version);
    free(m->oms_signer);
    free(m->oms_identity);
    free(m->oms_issuer);
    free(m->engine_fingerprint);
    if (m->canary != NULL) {
        free(m->canary->prompt);
        free(m->canary->expected_sha256);
        free(m->canary);
    }
    for (size_t i = 0; i < m->naccept; i++)
        manifest_clear(&m->accept[i]);
    free(m->accept);
}

void cfg_manifest_free(cfg_manifest_t *m)
{
    if (m == NULL)
        return;
    manifest_clear(m);
    free(m);
}

const cfg_manifest_t *cfg_manifest_identity(const cfg_manifest_t *m, size_t i)
{
    if (m == NULL)
        return NULL;
    return i == 0 ? m : i <= m->naccept ? &m->accept[i - 1] : NULL;
}

bool cfg_manifest_pins(const cfg_manifest_t *m)
{
    return m != NULL &&
           (m->model || m->checkpoint_sha256 || m->quantization || m->dtype || m->framework_name ||
            m->framework_version || m->engine_fingerprint || m->oms_signer || m->oms_identity ||
            m->determinism == CFG_DETERMINISM_BATCH_INVARIANT);
}

void cfg_manifest_fingerprint(const cfg_manifest_t *m, char out[20])
{
    const char *fields[6] = {0};
    if (m != NULL) {
        fields[0] = m->model;
        fields[1] = m->checkpoint_sha256;
        fields[2] = m->quantization;
        fields[3] = m->dtype;
        fields[4] = m->framework_name;
        fields[5] = m->framework_version;
    }
    dp_buf_t b = {0};
    for (size_t i = 0; i < DP_ARRAY_SIZE(fields); i++) {
        if (i > 0)
            dp_buf_appendc(&b, '\n');
        if (fields[i] != NULL)
            dp_buf_appends(&b, fields[i]);
    }
    char hex[65];
    dp_sha256_hex(b.len > 0 ? b.base : "", b.len, hex);
    dp_buf_free(&b);
    memcpy(out, "fp_", 3);
    memcpy(out + 3, hex, 16);
    out[19] = '\0';
}
