/* OpenSSF Model Signing bundles: parsing and the schema and predicate rules (see oms.h). */
#define _GNU_SOURCE
#include "attest/oms_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>
#include <openssl/evp.h>

#include "attest/dsse.h"
#include "common/util.h"

const char *const oms_method_names[3] = {"key", "certificate", "sigstore"};
_Static_assert(OMS_METHOD_SIGSTORE + 1 == DP_ARRAY_SIZE(oms_method_names), "a name per method");

#define BUNDLE_MEDIA_TYPE "application/vnd.dev.sigstore.bundle.v0.3+json"
#define BUNDLE_MEDIA_TYPE_ALT "application/vnd.dev.sigstore.bundle+json;version=0.3"
#define DEPRECATED_PREDICATE "https://model_signing/Digests/v0.1"
/* Shard offsets are printed in decimal; more than 2^53 cannot round-trip a JSON number. */
#define SHARD_SIZE_MAX ((uint64_t)1 << 53)
/* A leaf and its intermediates; real chains are 2-4 certificates long. */
#define OMS_MAX_CHAIN 10

/* A value from the bundle for a message: sanitised and cut (attest_abbrev). */
const char *oms_bundle_shown(const char *v, dp_buf_t *tmp)
{
    dp_buf_reset(tmp);
    attest_abbrev(v, tmp);
    return tmp->base;
}

/* ---- small JSON helpers -----------------------------------------------------------------------
 */

/* Duplicate member names would let two parsers read different bundles: refuse them. With
 * allowed non-NULL, unknown members are refused too (the schema's additionalProperties false). */
static int cmp_member_names(const void *a, const void *b)
{
    return strcmp((*(const cJSON *const *)a)->string, (*(const cJSON *const *)b)->string);
}

static int check_members(const cJSON *obj, const char *where, const char *const *allowed,
                         dp_buf_t *why)
{
    dp_buf_t t = {0};
    size_t n = 0;
    for (const cJSON *a = obj->child; a; a = a->next, n++) {
        bool ok = allowed == NULL;
        for (size_t i = 0; !ok && allowed[i]; i++)
            ok = strcmp(a->string, allowed[i]) == 0;
        if (!ok) {
            dp_buf_printf(why, "%s: unknown member \"%s\"", where, oms_bundle_shown(a->string, &t));
            dp_buf_free(&t);
            return -1;
        }
    }
    if (n < 2)
        return 0;
    /* Sorted, so an object with many members costs n log n, not n^2. */
    const cJSON **m = dp_xmalloc(n * sizeof(*m));
    n = 0;
    for (const cJSON *a = obj->child; a; a = a->next)
        m[n++] = a;
    qsort(m, n, sizeof(*m), cmp_member_names);
    int rc = 0;
    for (size_t i = 1; i < n && rc == 0; i++) {
        if (strcmp(m[i - 1]->string, m[i]->string) == 0) {
            dp_buf_printf(why, "%s: duplicate member \"%s\"", where,
                          oms_bundle_shown(m[i]->string, &t));
            rc = -1;
        }
    }
    free(m);
    dp_buf_free(&t);
    return rc;
}

/* No object anywhere below node holds a member twice: readers that keep the first or the last
 * of two would see different bundles (a certificate, a time). */
static int no_duplicates_below(const cJSON *node, dp_buf_t *why)
{
    for (const cJSON *c = node->child; c; c = c->next) {
        if (cJSON_IsObject(c) && check_members(c, "bundle", NULL, why) != 0)
            return -1;
        if ((cJSON_IsObject(c) || cJSON_IsArray(c)) && no_duplicates_below(c, why) != 0)
            return -1;
    }
    return 0;
}

/* A bundle and its statement are parsed before the signature is checked, so their JSON is
 * hostile until then. Each '{', '[', ',' and ':' outside strings starts at most one value; a
 * 100k-file statement needs about 500k, and without a cap 64 MiB of "0," would be 32M nodes
 * (gigabytes). */
#define JSON_MAX_VALUES ((size_t)2 << 20)

/* Parse one whole JSON text strictly: no trailing data (a second reader could see another
 * document), no \u0000 escape or control character in a string (cJSON would end the string
 * at a NUL, a reader keeping it would not).
 * NULL with the reason appended to *why ("<what>: ..."). */
static cJSON *parse_strict(const char *s, size_t n, const char *what, dp_buf_t *why)
{
    size_t values = 0;
    bool in_str = false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '"') {
                in_str = false;
            } else if (c == '\\' && i + 1 < n) {
                if (s[i + 1] == 'u' && n - i >= 6 && memcmp(s + i + 2, "0000", 4) == 0) {
                    dp_buf_printf(why, "%s: a string holds \\u0000 (NUL)", what);
                    return NULL;
                }
                i++;
            } else if ((unsigned char)c < 0x20) { /* not JSON, and a raw NUL would cut too */
                dp_buf_printf(why, "%s: a control character inside a string", what);
                return NULL;
            }
        } else if (c == '"') {
            in_str = true;
        } else if ((c == '{' || c == '[' || c == ',' || c == ':') && ++values > JSON_MAX_VALUES) {
            dp_buf_printf(why, "%s: more than %zu JSON values", what, JSON_MAX_VALUES);
            return NULL;
        }
    }
    const char *end = NULL;
    cJSON *v = n > 0 ? cJSON_ParseWithLengthOpts(s, n, &end, false) : NULL;
    if (v == NULL) {
        dp_buf_printf(why, "%s: %s", what, n == 0 ? "empty file" : "not valid JSON");
        return NULL;
    }
    while (end < s + n && (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
        end++;
    if (end != s + n) {
        dp_buf_printf(why, "%s: data after the JSON value", what);
        cJSON_Delete(v);
        return NULL;
    }
    return v;
}

static const cJSON *member(const cJSON *obj, const char *key)
{
    return cJSON_GetObjectItemCaseSensitive(obj, key);
}

/* A required (or, with required false, optional) string member; NULL when absent or bad. */
static const char *get_str(const cJSON *obj, const char *where, const char *key, bool required,
                           bool nonempty, bool *bad, dp_buf_t *why)
{
    const cJSON *v = member(obj, key);
    if (v == NULL) {
        if (required) {
            dp_buf_printf(why, "%s.%s: missing", where, key);
            *bad = true;
        }
        return NULL;
    }
    if (!cJSON_IsString(v)) {
        dp_buf_printf(why, "%s.%s: expected a string", where, key);
        *bad = true;
        return NULL;
    }
    if (nonempty && v->valuestring[0] == '\0') {
        dp_buf_printf(why, "%s.%s: must not be empty", where, key);
        *bad = true;
        return NULL;
    }
    return v->valuestring;
}

static const cJSON *get_obj(const cJSON *obj, const char *where, const char *key, dp_buf_t *why)
{
    const cJSON *v = member(obj, key);
    if (v == NULL)
        dp_buf_printf(why, "%s.%s: missing", where, key);
    else if (!cJSON_IsObject(v))
        dp_buf_printf(why, "%s.%s: expected an object", where, key);
    else
        return v;
    return NULL;
}

/* Base64 as protobuf JSON writes it (standard alphabet; URL-safe and unpadded accepted). */
static int b64(const char *s, dp_buf_t *out)
{
    return attest_b64_decode_any(s, strlen(s), out);
}

bool oms_bundle_utf8_valid(const char *s)
{
    size_t n = strlen(s);
    return dp_utf8_invalid_at(s, n) == n;
}

/* OMS §6.1.2: relative, '/'-separated, no empty, "." or ".." component, no trailing '/'. */
static const char *path_problem(const char *p)
{
    if (p[0] == '\0')
        return "empty";
    if (p[0] == '/')
        return "absolute (starts with '/')";
    if (!oms_bundle_utf8_valid(p))
        return "not valid UTF-8";
    const char *c = p;
    for (;;) {
        const char *slash = strchr(c, '/');
        size_t n = slash ? (size_t)(slash - c) : strlen(c);
        if (n == 0)
            return slash ? "has an empty component (\"//\")" : "ends with '/'";
        if (n == 1 && c[0] == '.')
            return "has a \".\" component (not normalised)";
        if (n == 2 && c[0] == '.' && c[1] == '.')
            return "has a \"..\" component (parent traversal)";
        if (slash == NULL)
            return NULL;
        c = slash + 1;
    }
}

/* ---- parsing ----------------------------------------------------------------------------------
 */

void oms_bundle_free(oms_bundle_t *b)
{
    if (b == NULL)
        return;
    free(b->key_hint);
    dp_buf_free(&b->key_raw);
    for (size_t i = 0; i < b->ncerts; i++)
        dp_buf_free(&b->certs[i]);
    free(b->certs);
    cJSON_Delete(b->material);
    dp_buf_free(&b->payload);
    for (size_t i = 0; i < b->nsigs; i++)
        dp_buf_free(&b->sigs[i]);
    free(b->sigs);
    for (size_t i = 0; i < b->nignore; i++)
        free(b->ignore[i]);
    free(b->ignore);
    for (size_t i = 0; i < b->nres; i++) {
        free(b->res[i].name);
        free(b->res[i].path);
    }
    free(b->res);
    free(b->by_path);
    free(b);
}

oms_method_t oms_bundle_method(const oms_bundle_t *b)
{
    return b->method;
}

const char *oms_bundle_root_digest(const oms_bundle_t *b)
{
    return b->root_digest;
}

size_t oms_bundle_resource_count(const oms_bundle_t *b)
{
    return b->nres;
}

static int parse_certs(oms_bundle_t *b, const cJSON *chain, const char *where, dp_buf_t *why)
{
    const cJSON *certs = member(chain, "certificates");
    if (!cJSON_IsArray(certs) || cJSON_GetArraySize(certs) < 1) {
        dp_buf_printf(why, "%s.certificates: expected a non-empty array", where);
        return -1;
    }
    size_t n = (size_t)cJSON_GetArraySize(certs);
    if (n > OMS_MAX_CHAIN) {
        dp_buf_printf(why, "%s.certificates: %zu certificates (at most %d)", where, n,
                      OMS_MAX_CHAIN);
        return -1;
    }
    b->certs = dp_xcalloc(n, sizeof(*b->certs));
    for (const cJSON *c = certs->child; c; c = c->next) {
        bool bad = false;
        dp_buf_t ignored = {0};
        const char *raw = cJSON_IsObject(c)
                              ? get_str(c, "certificate", "rawBytes", true, true, &bad, &ignored)
                              : NULL;
        dp_buf_free(&ignored);
        if (raw == NULL || b64(raw, &b->certs[b->ncerts]) != 0) {
            dp_buf_printf(why, "%s.certificates[%zu].rawBytes: expected base64 DER", where,
                          b->ncerts);
            return -1;
        }
        b->ncerts++;
    }
    return 0;
}

static int parse_tlog(const cJSON *vm, bool required, dp_buf_t *why)
{
    const cJSON *t = member(vm, "tlogEntries");
    if (t == NULL) {
        if (required)
            dp_buf_printf(why,
                          "verificationMaterial.tlogEntries: missing (a sigstore bundle needs at "
                          "least one transparency log entry)");
        return required ? -1 : 0;
    }
    if (!cJSON_IsArray(t)) {
        dp_buf_printf(why, "verificationMaterial.tlogEntries: expected an array");
        return -1;
    }
    for (const cJSON *e = t->child; e; e = e->next) {
        if (!cJSON_IsObject(e)) {
            dp_buf_printf(why, "verificationMaterial.tlogEntries[]: expected objects");
            return -1;
        }
    }
    if (required && cJSON_GetArraySize(t) < 1) {
        dp_buf_printf(
            why, "verificationMaterial.tlogEntries: empty (a sigstore bundle needs at least one "
                 "transparency log entry)");
        return -1;
    }
    return 0;
}

static int parse_material(oms_bundle_t *b, const cJSON *root, dp_buf_t *why)
{
    const cJSON *vm = get_obj(root, "bundle", "verificationMaterial", why);
    if (vm == NULL)
        return -1;
    if (check_members(vm, "verificationMaterial", NULL, why) != 0)
        return -1;
    const cJSON *pk = member(vm, "publicKey");
    const cJSON *chain = member(vm, "x509CertificateChain");
    const cJSON *cert = member(vm, "certificate");
    int kinds = (pk != NULL) + (chain != NULL) + (cert != NULL);
    if (kinds == 0) {
        dp_buf_printf(why,
                      "verificationMaterial: none of publicKey (method key), x509CertificateChain "
                      "(method certificate), certificate (method sigstore)");
        return -1;
    }
    if (kinds > 1) {
        dp_buf_printf(why,
                      "verificationMaterial: more than one of publicKey, x509CertificateChain, "
                      "certificate (they are one protobuf oneof)");
        return -1;
    }
    const cJSON *tv = member(vm, "timestampVerificationData");
    if (tv != NULL && !cJSON_IsObject(tv)) {
        dp_buf_printf(why, "verificationMaterial.timestampVerificationData: expected an object");
        return -1;
    }
    bool bad = false;
    if (pk != NULL) {
        b->method = OMS_METHOD_KEY;
        if (!cJSON_IsObject(pk)) {
            dp_buf_printf(why, "verificationMaterial.publicKey: expected an object");
            return -1;
        }
        const char *hint =
            get_str(pk, "verificationMaterial.publicKey", "hint", false, false, &bad, why);
        const char *raw =
            get_str(pk, "verificationMaterial.publicKey", "rawBytes", false, false, &bad, why);
        if (bad)
            return -1;
        if (hint == NULL && raw == NULL) {
            dp_buf_printf(
                why, "verificationMaterial.publicKey: needs hint (or rawBytes, older bundles)");
            return -1;
        }
        if (hint && hint[0]) /* "" names no key (model_signing skips the check then too) */
            b->key_hint = dp_xstrdup(hint);
        if (raw && b64(raw, &b->key_raw) != 0) {
            dp_buf_printf(why, "verificationMaterial.publicKey.rawBytes: bad base64");
            return -1;
        }
        return parse_tlog(vm, false, why);
    }
    if (chain != NULL) {
        b->method = OMS_METHOD_CERTIFICATE;
        if (!cJSON_IsObject(chain)) {
            dp_buf_printf(why, "verificationMaterial.x509CertificateChain: expected an object");
            return -1;
        }
        if (parse_certs(b, chain, "verificationMaterial.x509CertificateChain", why) != 0)
            return -1;
        return parse_tlog(vm, false, why);
    }
    b->method = OMS_METHOD_SIGSTORE;
    const char *raw = NULL;
    if (!cJSON_IsObject(cert) || (raw = get_str(cert, "verificationMaterial.certificate",
                                                "rawBytes", true, true, &bad, why)) == NULL) {
        if (!bad)
            dp_buf_printf(why,
                          "verificationMaterial.certificate: expected an object with rawBytes");
        return -1;
    }
    b->certs = dp_xcalloc(1, sizeof(*b->certs));
    b->ncerts = 1;
    if (b64(raw, &b->certs[0]) != 0) {
        dp_buf_printf(why, "verificationMaterial.certificate.rawBytes: expected base64 DER");
        return -1;
    }
    if (parse_tlog(vm, true, why) != 0)
        return -1;
    b->material = cJSON_Duplicate(vm, true);
    return 0;
}

static int parse_envelope(oms_bundle_t *b, const cJSON *root, dp_buf_t *why)
{
    static const char *const env_keys[] = {"payload", "payloadType", "signatures", NULL};
    static const char *const sig_keys[] = {"sig", "keyid", NULL};
    const cJSON *env = get_obj(root, "bundle", "dsseEnvelope", why);
    if (env == NULL || check_members(env, "dsseEnvelope", env_keys, why) != 0)
        return -1;
    bool bad = false;
    const char *payload = get_str(env, "dsseEnvelope", "payload", true, true, &bad, why);
    const char *ptype = get_str(env, "dsseEnvelope", "payloadType", true, false, &bad, why);
    if (bad)
        return -1;
    if (strcmp(ptype, OMS_PAYLOAD_TYPE) != 0) {
        dp_buf_t t = {0};
        dp_buf_printf(why, "dsseEnvelope.payloadType: expected \"%s\", got \"%s\"",
                      OMS_PAYLOAD_TYPE, oms_bundle_shown(ptype, &t));
        dp_buf_free(&t);
        return -1;
    }
    const cJSON *sigs = member(env, "signatures");
    if (!cJSON_IsArray(sigs) || cJSON_GetArraySize(sigs) < 1) {
        dp_buf_printf(why, "dsseEnvelope.signatures: expected a non-empty array");
        return -1;
    }
    size_t n = (size_t)cJSON_GetArraySize(sigs);
    if (n > ATTEST_MAX_SIGNATURES) {
        dp_buf_printf(why, "dsseEnvelope.signatures: %zu signatures (at most %d)", n,
                      ATTEST_MAX_SIGNATURES);
        return -1;
    }
    b->sigs = dp_xcalloc(n, sizeof(*b->sigs));
    for (const cJSON *s = sigs->child; s; s = s->next) {
        char where[64];
        snprintf(where, sizeof(where), "dsseEnvelope.signatures[%zu]", b->nsigs);
        if (!cJSON_IsObject(s)) {
            dp_buf_printf(why, "%s: expected an object", where);
            return -1;
        }
        if (check_members(s, where, sig_keys, why) != 0)
            return -1;
        const cJSON *kid = member(s, "keyid");
        if (kid != NULL && !cJSON_IsString(kid) && !cJSON_IsNull(kid)) {
            dp_buf_printf(why, "%s.keyid: expected a string or null", where);
            return -1;
        }
        const char *sig = get_str(s, where, "sig", true, true, &bad, why);
        if (bad)
            return -1;
        if (b64(sig, &b->sigs[b->nsigs]) != 0) {
            dp_buf_printf(why, "%s.sig: bad base64", where);
            return -1;
        }
        b->nsigs++;
    }
    if (b64(payload, &b->payload) != 0) {
        dp_buf_printf(why, "dsseEnvelope.payload: bad base64");
        return -1;
    }
    return 0;
}

int oms_bundle_cmp_strp(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static const struct {
    const char *name, *md;
    size_t len;
} hash_types[] = {{"sha256", "SHA256", 32}, {"blake2b", "BLAKE2B-512", 64}, {"blake3", NULL, 32}};

static int parse_serialization(oms_bundle_t *b, const cJSON *pred, dp_buf_t *why)
{
    static const char *const keys[] = {"method",         "hash_type",    "shard_size",
                                       "allow_symlinks", "ignore_paths", NULL};
    const char *W = "predicate.serialization";
    const cJSON *s = get_obj(pred, "predicate", "serialization", why);
    if (s == NULL || check_members(s, W, keys, why) != 0)
        return -1;
    bool bad = false;
    const char *method = get_str(s, W, "method", true, false, &bad, why);
    const char *ht = get_str(s, W, "hash_type", true, false, &bad, why);
    if (bad)
        return -1;
    dp_buf_t t = {0};
    int rc = -1;
    if (strcmp(method, "files") == 0) {
        b->shards = false;
    } else if (strcmp(method, "shards") == 0) {
        b->shards = true;
    } else {
        dp_buf_printf(why, "%s.method: expected \"files\" or \"shards\", got \"%s\"", W,
                      oms_bundle_shown(method, &t));
        goto out;
    }
    size_t k = 0;
    while (k < DP_ARRAY_SIZE(hash_types) && strcmp(ht, hash_types[k].name) != 0)
        k++;
    if (k == DP_ARRAY_SIZE(hash_types)) {
        dp_buf_printf(why, "%s.hash_type: expected sha256, blake2b or blake3, got \"%s\"", W,
                      oms_bundle_shown(ht, &t));
        goto out;
    }
    if (hash_types[k].md == NULL) {
        dp_buf_printf(why,
                      "%s.hash_type: %s is not supported by this verifier (sha256 and blake2b are)",
                      W, ht);
        goto out;
    }
    snprintf(b->hash_type, sizeof(b->hash_type), "%s", ht);
    b->md_name = hash_types[k].md;
    b->digest_len = hash_types[k].len;
    const cJSON *ss = member(s, "shard_size");
    if (b->shards) {
        if (ss == NULL) {
            dp_buf_printf(why, "%s.shard_size: missing (required when method is \"shards\")", W);
            goto out;
        }
        if (!cJSON_IsNumber(ss) || ss->valuedouble < 1 ||
            ss->valuedouble > (double)SHARD_SIZE_MAX ||
            ss->valuedouble != (double)(uint64_t)ss->valuedouble) {
            dp_buf_printf(why, "%s.shard_size: expected a positive integer", W);
            goto out;
        }
        b->shard_size = (uint64_t)ss->valuedouble;
    } else if (ss != NULL) {
        dp_buf_printf(why, "%s.shard_size: must be absent when method is \"files\"", W);
        goto out;
    }
    const cJSON *as = member(s, "allow_symlinks");
    if (as == NULL) {
        dp_buf_printf(why, "%s.allow_symlinks: missing", W);
        goto out;
    }
    if (!cJSON_IsBool(as)) {
        dp_buf_printf(why, "%s.allow_symlinks: expected true or false", W);
        goto out;
    }
    b->allow_symlinks = cJSON_IsTrue(as);
    const cJSON *ip = member(s, "ignore_paths");
    if (ip != NULL) {
        if (!cJSON_IsArray(ip)) {
            dp_buf_printf(why, "%s.ignore_paths: expected an array of strings", W);
            goto out;
        }
        b->ignore = dp_xcalloc((size_t)cJSON_GetArraySize(ip) + 1, sizeof(*b->ignore));
        for (const cJSON *e = ip->child; e; e = e->next) {
            if (!cJSON_IsString(e) || e->valuestring[0] == '\0') {
                dp_buf_printf(why, "%s.ignore_paths[%zu]: expected a non-empty string", W,
                              b->nignore);
                goto out;
            }
            char *p = dp_xstrdup(e->valuestring);
            size_t n = strlen(p);
            while (n > 1 && p[n - 1] == '/')
                p[--n] = '\0'; /* "cache/" names the directory "cache" */
            const char *problem = strpbrk(p, "*?[") ? "contains a glob character" : path_problem(p);
            b->ignore[b->nignore++] = p;
            if (problem) {
                dp_buf_printf(why, "%s.ignore_paths[%zu] \"%s\": %s", W, b->nignore - 1,
                              oms_bundle_shown(e->valuestring, &t), problem);
                goto out;
            }
        }
    }
    if (b->nignore > 1) /* looked up for every entry of the walk */
        qsort(b->ignore, b->nignore, sizeof(*b->ignore), oms_bundle_cmp_strp);
    rc = 0;
out:
    dp_buf_free(&t);
    return rc;
}

/* "<path>:<start>:<end>": the last two colon-separated decimal fields (OMS §6.3.2). */
static int split_shard(oms_res_t *r)
{
    char *c2 = strrchr(r->name, ':');
    if (c2 == NULL || c2 == r->name)
        return -1;
    char *c1 = c2 - 1;
    while (c1 > r->name && *c1 != ':')
        c1--;
    if (*c1 != ':' || c1 == r->name)
        return -1;
    const char *s = c1 + 1, *e = c2 + 1;
    size_t sn = (size_t)(c2 - s), en = strlen(e);
    if (sn == 0 || en == 0 || (sn > 1 && s[0] == '0') || (en > 1 && e[0] == '0') ||
        dp_parse_u64(s, sn, &r->start) != 0 || dp_parse_u64(e, en, &r->end) != 0)
        return -1;
    r->path = dp_xstrndup(r->name, (size_t)(c1 - r->name));
    return 0;
}

static int cmp_by_path(const void *a, const void *b)
{
    const oms_res_t *x = *(oms_res_t *const *)a, *y = *(oms_res_t *const *)b;
    int c = strcmp(x->path, y->path);
    if (c != 0)
        return c;
    return x->start < y->start ? -1 : x->start > y->start;
}

static int parse_resources(oms_bundle_t *b, const cJSON *pred, dp_buf_t *why)
{
    const cJSON *res = member(pred, "resources");
    if (res == NULL) {
        dp_buf_printf(why, "predicate.resources: missing");
        return -1;
    }
    if (!cJSON_IsArray(res)) {
        dp_buf_printf(why, "predicate.resources: expected an array");
        return -1;
    }
    size_t n = (size_t)cJSON_GetArraySize(res);
    if (n == 0) {
        dp_buf_printf(why, "predicate.resources: empty (a model has at least one file)");
        return -1;
    }
    b->res = dp_xcalloc(n, sizeof(*b->res));
    dp_buf_t t = {0};
    int rc = -1;
    for (const cJSON *e = res->child; e; e = e->next) {
        size_t i = b->nres;
        char where[64];
        snprintf(where, sizeof(where), "predicate.resources[%zu]", i);
        if (!cJSON_IsObject(e)) {
            dp_buf_printf(why, "%s: expected an object", where);
            goto out;
        }
        if (check_members(e, where, NULL, why) != 0)
            goto out;
        bool bad = false;
        const char *name = get_str(e, where, "name", true, true, &bad, why);
        const char *digest = get_str(e, where, "digest", true, false, &bad, why);
        const char *alg = get_str(e, where, "algorithm", true, false, &bad, why);
        if (bad)
            goto out;
        oms_res_t *r = &b->res[b->nres++];
        r->name = dp_xstrdup(name);
        if (b->shards) {
            if (split_shard(r) != 0) {
                dp_buf_printf(why,
                              "%s.name \"%s\": expected \"<path>:<start>:<end>\" (method shards)",
                              where, oms_bundle_shown(name, &t));
                goto out;
            }
        } else {
            r->path = dp_xstrdup(name);
        }
        const char *problem = path_problem(r->path);
        if (problem) {
            dp_buf_printf(why, "%s.name \"%s\": %s", where, oms_bundle_shown(name, &t), problem);
            goto out;
        }
        if (b->shards && (r->start >= r->end || r->start % b->shard_size != 0 ||
                          r->end - r->start > b->shard_size)) {
            dp_buf_printf(why, "%s.name \"%s\": not a shard of shard_size %llu", where,
                          oms_bundle_shown(name, &t), (unsigned long long)b->shard_size);
            goto out;
        }
        if (i > 0 && strcmp(b->res[i - 1].name, name) >= 0) {
            dp_buf_printf(why,
                          "%s.name \"%s\": resources are not sorted by name (or repeat one): it "
                          "follows \"%s\"",
                          where, oms_bundle_shown(name, &t), b->res[i - 1].name);
            goto out;
        }
        if (strcmp(alg, b->hash_type) != 0) {
            dp_buf_printf(why, "%s.algorithm: \"%s\" differs from serialization.hash_type \"%s\"",
                          where, oms_bundle_shown(alg, &t), b->hash_type);
            goto out;
        }
        if (!dp_is_lower_hex(digest, strlen(digest))) {
            dp_buf_printf(why, "%s.digest: expected lowercase hex", where);
            goto out;
        }
        if (strlen(digest) != b->digest_len * 2) {
            dp_buf_printf(why, "%s.digest: %zu hex digits, %s gives %zu", where, strlen(digest),
                          b->hash_type, b->digest_len * 2);
            goto out;
        }
        dp_unhex(digest, b->digest_len * 2, r->digest, b->digest_len);
    }
    b->by_path = dp_xcalloc(b->nres, sizeof(*b->by_path));
    for (size_t i = 0; i < b->nres; i++)
        b->by_path[i] = &b->res[i];
    qsort(b->by_path, b->nres, sizeof(*b->by_path), cmp_by_path);
    /* Shards of one file must tile it: 0..s, s..2s, ... without gaps or overlaps. */
    for (size_t i = 0; b->shards && i < b->nres; i++) {
        const oms_res_t *r = b->by_path[i];
        bool first = i == 0 || strcmp(b->by_path[i - 1]->path, r->path) != 0;
        uint64_t want = first ? 0 : b->by_path[i - 1]->end;
        bool prev_full =
            first || b->by_path[i - 1]->end - b->by_path[i - 1]->start == b->shard_size;
        if (r->start != want || !prev_full) {
            dp_buf_printf(why,
                          "predicate.resources: the shards of \"%s\" do not cover it contiguously "
                          "(at \"%s\")",
                          oms_bundle_shown(r->path, &t), r->name);
            goto out;
        }
    }
    rc = 0;
out:
    dp_buf_free(&t);
    return rc;
}

static int parse_statement(oms_bundle_t *b, dp_buf_t *why)
{
    static const char *const st_keys[] = {"_type", "subject", "predicateType", "predicate", NULL};
    static const char *const pred_keys[] = {"resources", "serialization", NULL};
    int rc = -1;
    dp_buf_t t = {0};
    cJSON *st = parse_strict(b->payload.base ? b->payload.base : "", b->payload.len,
                             "statement (the decoded DSSE payload)", why);
    if (st == NULL)
        goto out;
    if (!cJSON_IsObject(st)) {
        dp_buf_printf(why, "statement (the decoded DSSE payload): not a JSON object");
        goto out;
    }
    bool bad = false;
    const char *pt = get_str(st, "statement", "predicateType", true, false, &bad, why);
    if (bad)
        goto out;
    if (strcmp(pt, DEPRECATED_PREDICATE) == 0) {
        dp_buf_printf(why,
                      "statement.predicateType: \"%s\" is the deprecated v0.1 format (not "
                      "supported; re-sign with a current model_signing)",
                      DEPRECATED_PREDICATE);
        goto out;
    }
    if (strcmp(pt, OMS_PREDICATE_TYPE) != 0) {
        dp_buf_printf(why, "statement.predicateType: expected \"%s\", got \"%s\"",
                      OMS_PREDICATE_TYPE, oms_bundle_shown(pt, &t));
        goto out;
    }
    if (check_members(st, "statement", st_keys, why) != 0)
        goto out;
    const char *type = get_str(st, "statement", "_type", true, false, &bad, why);
    if (bad)
        goto out;
    if (strcmp(type, OMS_STATEMENT_TYPE) != 0) {
        dp_buf_printf(why, "statement._type: expected \"%s\", got \"%s\"", OMS_STATEMENT_TYPE,
                      oms_bundle_shown(type, &t));
        goto out;
    }
    const cJSON *subj = member(st, "subject");
    if (!cJSON_IsArray(subj) || cJSON_GetArraySize(subj) != 1 || !cJSON_IsObject(subj->child)) {
        dp_buf_printf(why, "statement.subject: expected exactly one subject object");
        goto out;
    }
    if (check_members(subj->child, "statement.subject[0]", NULL, why) != 0 ||
        get_str(subj->child, "statement.subject[0]", "name", true, true, &bad, why) == NULL)
        goto out;
    const cJSON *dg = get_obj(subj->child, "statement.subject[0]", "digest", why);
    if (dg == NULL || check_members(dg, "statement.subject[0].digest", NULL, why) != 0)
        goto out;
    for (const cJSON *d = dg->child; d; d = d->next) {
        if (!cJSON_IsString(d) || !dp_is_lower_hex(d->valuestring, strlen(d->valuestring)) ||
            d->valuestring[0] == '\0') {
            dp_buf_printf(why, "statement.subject[0].digest.%s: expected lowercase hex",
                          oms_bundle_shown(d->string, &t));
            goto out;
        }
    }
    const char *root = get_str(dg, "statement.subject[0].digest", "sha256", true, false, &bad, why);
    if (bad)
        goto out;
    if (!dp_is_lower_hex(root, 64)) {
        dp_buf_printf(why, "statement.subject[0].digest.sha256: expected 64 hex digits");
        goto out;
    }
    memcpy(b->root_digest, root, 65);
    const cJSON *pred = get_obj(st, "statement", "predicate", why);
    if (pred == NULL || check_members(pred, "predicate", pred_keys, why) != 0)
        goto out;
    if (parse_serialization(b, pred, why) != 0 || parse_resources(b, pred, why) != 0)
        goto out;
    /* OMS §6.5.1: SHA-256 over the raw digests in resource order. The root digest is what the
     * agent reports, so it must describe exactly the resources that are verified. */
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    uint8_t md[32];
    unsigned int mdlen = 0;
    EVP_DigestInit_ex(ctx, EVP_sha256(), NULL);
    for (size_t i = 0; i < b->nres; i++)
        EVP_DigestUpdate(ctx, b->res[i].digest, b->digest_len);
    EVP_DigestFinal_ex(ctx, md, &mdlen);
    EVP_MD_CTX_free(ctx);
    char hex[65];
    dp_hex(md, sizeof(md), hex);
    if (strcmp(hex, b->root_digest) != 0) {
        dp_buf_printf(why,
                      "statement.subject[0].digest.sha256: %.8s.. is not the root digest of the "
                      "resources (%.8s..)",
                      b->root_digest, hex);
        goto out;
    }
    rc = 0;
out:
    cJSON_Delete(st);
    dp_buf_free(&t);
    return rc;
}

int oms_bundle_parse(const char *json, size_t len, oms_bundle_t **out, dp_buf_t *why)
{
    static const char *const root_keys[] = {"mediaType", "verificationMaterial", "dsseEnvelope",
                                            NULL};
    *out = NULL;
    oms_bundle_t *b = dp_xcalloc(1, sizeof(*b));
    int rc = -1;
    cJSON *root = parse_strict(json, len, "bundle", why);
    if (root == NULL)
        goto out;
    if (!cJSON_IsObject(root)) {
        dp_buf_printf(why, "bundle: expected a JSON object");
        goto out;
    }
    if (check_members(root, "bundle", root_keys, why) != 0 || no_duplicates_below(root, why) != 0)
        goto out;
    bool bad = false;
    const char *mt = get_str(root, "bundle", "mediaType", true, false, &bad, why);
    if (bad)
        goto out;
    if (strcmp(mt, BUNDLE_MEDIA_TYPE) != 0 && strcmp(mt, BUNDLE_MEDIA_TYPE_ALT) != 0) {
        dp_buf_t t = {0};
        dp_buf_printf(why, "bundle.mediaType: expected \"%s\" (Sigstore bundle v0.3), got \"%s\"",
                      BUNDLE_MEDIA_TYPE, oms_bundle_shown(mt, &t));
        dp_buf_free(&t);
        goto out;
    }
    if (parse_material(b, root, why) != 0 || parse_envelope(b, root, why) != 0 ||
        parse_statement(b, why) != 0)
        goto out;
    rc = 0;
    *out = b;
    b = NULL;
out:
    cJSON_Delete(root);
    oms_bundle_free(b);
    return rc;
}
