/* Keyless Sigstore verification offline (see sigstore.h). */
#define _GNU_SOURCE
#include "attest/sigstore.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <openssl/ct.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ts.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "attest/dsse.h"
#include "attest/report.h"
#include "common/util.h"

#define ROOT_MEDIA_TYPE "application/vnd.dev.sigstore.trustedroot"
#define OID_ISSUER_LEGACY "1.3.6.1.4.1.57264.1.1"
#define OID_USERNAME "1.3.6.1.4.1.57264.1.7"
#define OID_ISSUER "1.3.6.1.4.1.57264.1.8"
/* A Merkle path has one hash per tree level: 64 covers any tree that can exist. */
#define MAX_PROOF_HASHES 64
/* A real trusted root lists a handful of each. */
#define MAX_ROOT_ENTRIES 64

/* A transparency log (Rekor or CT): its key, its id and when the key was in use. */
typedef struct {
    uint8_t id[32];
    EVP_PKEY *key;
    int64_t start, end; /* Unix seconds; end INT64_MAX when open */
} tlog_t;

/* A Fulcio CA: its chain, leaf-most first, the root last. */
typedef struct {
    STACK_OF(X509) * certs;
    int64_t start, end;
} ca_t;

struct sigstore_root_s {
    tlog_t *rekor, *ct;
    size_t nrekor, nct;
    ca_t *cas, *tsas; /* Fulcio CAs, RFC 3161 timestamp authorities */
    size_t ncas, ntsas;
};

/* ---- small helpers ---------------------------------------------------------------------------
 */

static const cJSON *member(const cJSON *o, const char *k)
{
    return cJSON_GetObjectItemCaseSensitive(o, k);
}

static const char *str_member(const cJSON *o, const char *k)
{
    const cJSON *v = member(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int b64_member(const cJSON *o, const char *k, dp_buf_t *out)
{
    const char *s = str_member(o, k);
    dp_buf_reset(out);
    return s && s[0] ? attest_b64_decode_any(s, strlen(s), out) : -1;
}

/* Protobuf JSON writes int64 as a decimal string (a number is accepted too). */
static int int_member(const cJSON *o, const char *k, int64_t *out)
{
    const cJSON *v = member(o, k);
    uint64_t u = 0;
    if (cJSON_IsString(v)) {
        size_t n = strlen(v->valuestring);
        if (n == 0 || n > 19 || dp_parse_u64(v->valuestring, n, &u) != 0 || u > INT64_MAX)
            return -1;
    } else if (cJSON_IsNumber(v) && v->valuedouble >= 0 && v->valuedouble < 9007199254740992.0 &&
               v->valuedouble == (double)(uint64_t)v->valuedouble) {
        u = (uint64_t)v->valuedouble;
    } else {
        return -1;
    }
    *out = (int64_t)u;
    return 0;
}

/* RFC 3339 ("2021-01-12T11:53:27Z", fractions dropped) to Unix seconds. */
static int parse_time(const char *s, int64_t *out)
{
    int64_t ms;
    if (dp_parse_time_ms(s, &ms) != 0)
        return -1;
    *out = ms >= 0 ? ms / 1000 : -((-ms + 999) / 1000);
    return 0;
}

static void fmt_time(int64_t t, char out[32])
{
    time_t tt = (time_t)t;
    struct tm tm;
    if (gmtime_r(&tt, &tm) == NULL || strftime(out, 32, "%Y-%m-%dT%H:%M:%SZ", &tm) == 0)
        snprintf(out, 32, "%lld", (long long)t);
}

static int valid_for(const cJSON *o, int64_t *start, int64_t *end)
{
    const cJSON *v = member(o, "validFor");
    *start = INT64_MIN;
    *end = INT64_MAX;
    if (v == NULL)
        return 0;
    if (!cJSON_IsObject(v))
        return -1;
    const cJSON *s = member(v, "start"), *e = member(v, "end");
    if ((s && parse_time(cJSON_GetStringValue(s), start) != 0) ||
        (e && parse_time(cJSON_GetStringValue(e), end) != 0))
        return -1;
    return 0;
}

static X509 *der_cert(const void *p, size_t n)
{
    const unsigned char *q = p;
    if (n == 0 || n >= INT_MAX)
        return NULL;
    X509 *x = d2i_X509(NULL, &q, (long)n);
    if (x && q != (const unsigned char *)p + n) { /* trailing bytes: not one certificate */
        X509_free(x);
        x = NULL;
    }
    return x;
}

/* Verify sig over msg with k: ECDSA with the digest of its curve size, Ed25519, or RSA
 * PKCS#1 v1.5 SHA-256 (CT logs may use RSA). */
static bool verify_sig(EVP_PKEY *k, const void *msg, size_t n, const void *sig, size_t siglen)
{
    const EVP_MD *md = NULL;
    int id = EVP_PKEY_get_base_id(k);
    if (id == EVP_PKEY_EC) {
        int bits = EVP_PKEY_get_bits(k);
        md = bits <= 256 ? EVP_sha256() : bits <= 384 ? EVP_sha384() : EVP_sha512();
    } else if (id != EVP_PKEY_ED25519) {
        md = EVP_sha256();
    }
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    bool ok = ctx && EVP_DigestVerifyInit(ctx, NULL, md, NULL, k) == 1 &&
              EVP_DigestVerify(ctx, sig, siglen, msg, n) == 1;
    EVP_MD_CTX_free(ctx);
    ERR_clear_error();
    return ok;
}

static void spki_sha256(EVP_PKEY *k, uint8_t out[32])
{
    unsigned char *der = NULL;
    int n = i2d_PUBKEY(k, &der);
    if (n > 0)
        dp_sha256(der, (size_t)n, out);
    else
        memset(out, 0, 32);
    OPENSSL_free(der);
}

/* ---- the trusted root ------------------------------------------------------------------------
 */

void sigstore_root_free(sigstore_root_t *r)
{
    if (r == NULL)
        return;
    for (size_t i = 0; i < r->nrekor; i++)
        EVP_PKEY_free(r->rekor[i].key);
    for (size_t i = 0; i < r->nct; i++)
        EVP_PKEY_free(r->ct[i].key);
    for (size_t i = 0; i < r->ncas; i++)
        sk_X509_pop_free(r->cas[i].certs, X509_free);
    for (size_t i = 0; i < r->ntsas; i++)
        sk_X509_pop_free(r->tsas[i].certs, X509_free);
    free(r->tsas);
    free(r->rekor);
    free(r->ct);
    free(r->cas);
    free(r);
}

static int parse_logs(const cJSON *root, const char *key, tlog_t **out, size_t *n, dp_buf_t *err)
{
    const cJSON *arr = member(root, key);
    if (arr == NULL)
        return 0;
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) > MAX_ROOT_ENTRIES) {
        dp_buf_printf(err, "%s: expected an array of at most %d logs", key, MAX_ROOT_ENTRIES);
        return -1;
    }
    *out = dp_xcalloc((size_t)cJSON_GetArraySize(arr) + 1, sizeof(**out));
    dp_buf_t raw = {0};
    int rc = -1;
    size_t i = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        const cJSON *pk = member(e, "publicKey"), *lid = member(e, "logId");
        if (!cJSON_IsObject(e) || !cJSON_IsObject(pk) || !cJSON_IsObject(lid)) {
            dp_buf_printf(err, "%s[%zu]: expected an object with publicKey and logId", key, i);
            goto out;
        }
        if (b64_member(lid, "keyId", &raw) != 0 || raw.len != 32) {
            dp_buf_printf(err, "%s[%zu].logId.keyId: expected 32 bytes of base64", key, i);
            goto out;
        }
        tlog_t *t = &(*out)[*n];
        memcpy(t->id, raw.base, 32);
        if (b64_member(pk, "rawBytes", &raw) != 0) {
            dp_buf_printf(err, "%s[%zu].publicKey.rawBytes: expected base64 DER", key, i);
            goto out;
        }
        const unsigned char *p = (const unsigned char *)raw.base;
        t->key = d2i_PUBKEY(NULL, &p, (long)raw.len);
        if (t->key == NULL) {
            dp_buf_printf(err, "%s[%zu].publicKey.rawBytes: not a SubjectPublicKeyInfo", key, i);
            goto out;
        }
        (*n)++;
        if (valid_for(pk, &t->start, &t->end) != 0) {
            dp_buf_printf(err, "%s[%zu].publicKey.validFor: expected RFC 3339 times", key, i);
            goto out;
        }
    }
    rc = 0;
out:
    dp_buf_free(&raw);
    ERR_clear_error();
    return rc;
}

static int parse_cas(const cJSON *root, const char *key, bool required, ca_t **cas, size_t *ncas,
                     dp_buf_t *err)
{
    const cJSON *arr = member(root, key);
    if (arr == NULL && !required)
        return 0;
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) > MAX_ROOT_ENTRIES) {
        dp_buf_printf(err, "%s: expected an array of at most %d", key, MAX_ROOT_ENTRIES);
        return -1;
    }
    *cas = dp_xcalloc((size_t)cJSON_GetArraySize(arr) + 1, sizeof(**cas));
    dp_buf_t raw = {0};
    int rc = -1;
    size_t i = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        const cJSON *chain = cJSON_IsObject(e) ? member(e, "certChain") : NULL;
        const cJSON *certs = cJSON_IsObject(chain) ? member(chain, "certificates") : NULL;
        if (!cJSON_IsArray(certs) || cJSON_GetArraySize(certs) < 1 ||
            cJSON_GetArraySize(certs) > 10) {
            dp_buf_printf(err, "%s[%zu].certChain.certificates: expected 1 to 10 certificates", key,
                          i);
            goto out;
        }
        ca_t *ca = &(*cas)[(*ncas)++];
        ca->certs = sk_X509_new_null();
        size_t j = 0;
        for (const cJSON *c = certs->child; c; c = c->next, j++) {
            X509 *x = NULL;
            if (cJSON_IsObject(c) && b64_member(c, "rawBytes", &raw) == 0)
                x = der_cert(raw.base, raw.len);
            if (x == NULL) {
                dp_buf_printf(err, "%s[%zu].certChain.certificates[%zu]: expected base64 DER", key,
                              i, j);
                goto out;
            }
            sk_X509_push(ca->certs, x);
        }
        if (valid_for(e, &ca->start, &ca->end) != 0) {
            dp_buf_printf(err, "%s[%zu].validFor: expected RFC 3339 times", key, i);
            goto out;
        }
    }
    rc = 0;
out:
    dp_buf_free(&raw);
    ERR_clear_error();
    return rc;
}

int sigstore_root_parse(const char *json, size_t len, sigstore_root_t **out, dp_buf_t *err)
{
    *out = NULL;
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!cJSON_IsObject(root)) {
        dp_buf_appends(err, "not a JSON object");
        cJSON_Delete(root);
        return -1;
    }
    sigstore_root_t *r = dp_xcalloc(1, sizeof(*r));
    int rc = -1;
    const char *mt = str_member(root, "mediaType");
    if (mt == NULL || strncmp(mt, ROOT_MEDIA_TYPE, strlen(ROOT_MEDIA_TYPE)) != 0) {
        dp_buf_printf(err, "mediaType: expected %s+json;version=0.1 (a Sigstore trusted root)",
                      ROOT_MEDIA_TYPE);
        goto out;
    }
    if (parse_logs(root, "tlogs", &r->rekor, &r->nrekor, err) != 0 ||
        parse_logs(root, "ctlogs", &r->ct, &r->nct, err) != 0 ||
        parse_cas(root, "certificateAuthorities", true, &r->cas, &r->ncas, err) != 0 ||
        parse_cas(root, "timestampAuthorities", false, &r->tsas, &r->ntsas, err) != 0)
        goto out;
    if (r->nrekor == 0 || r->nct == 0 || r->ncas == 0) {
        dp_buf_appends(err, "needs at least one of each: tlogs, ctlogs, certificateAuthorities");
        goto out;
    }
    rc = 0;
    *out = r;
    r = NULL;
out:
    sigstore_root_free(r);
    cJSON_Delete(root);
    return rc;
}

int sigstore_root_load(const char *path, sigstore_root_t **out, dp_buf_t *err)
{
    dp_buf_t json = {0};
    int r = dp_read_file(path, SIGSTORE_ROOT_MAX_BYTES, &json);
    if (r != 0) {
        dp_buf_printf(err, "cannot read %s: %s", path, dp_input_strerror(r));
        *out = NULL;
        return -1;
    }
    dp_buf_t why = {0};
    r = sigstore_root_parse(json.base ? json.base : "", json.len, out, &why);
    if (r != 0)
        dp_buf_printf(err, "%s: %s", path, why.base);
    dp_buf_free(&why);
    dp_buf_free(&json);
    return r;
}

static const tlog_t *find_log(const tlog_t *logs, size_t n, const uint8_t id[32])
{
    for (size_t i = 0; i < n; i++)
        if (memcmp(logs[i].id, id, 32) == 0)
            return &logs[i];
    return NULL;
}

/* ---- the certificate -------------------------------------------------------------------------
 */

const char *sigstore_signing_usage_problem(const void *cert)
{
    X509 *x = (X509 *)cert;
    uint32_t ku = X509_get_key_usage(x); /* UINT32_MAX: no keyUsage extension */
    if (ku == UINT32_MAX)
        return "no keyUsage extension (a signing certificate needs digitalSignature)";
    if (!(ku & KU_DIGITAL_SIGNATURE))
        return "keyUsage has no digitalSignature";
    if ((X509_get_extension_flags(x) & EXFLAG_XKUSAGE) &&
        !(X509_get_extended_key_usage(x) & XKU_CODE_SIGN))
        return "extendedKeyUsage has no codeSigning (a TLS or other certificate cannot sign)";
    return NULL;
}

/* The leaf chained to one CA of the root valid at t: 0 with the validated chain in *chain. */
static int verify_chain(const sigstore_root_t *root, X509 *leaf, int64_t t, STACK_OF(X509) * *chain,
                        dp_buf_t *why)
{
    const char *last = NULL;
    size_t candidates = 0;
    for (size_t i = 0; i < root->ncas && *chain == NULL; i++) {
        const ca_t *ca = &root->cas[i];
        if (t < ca->start || t > ca->end)
            continue;
        candidates++;
        int n = sk_X509_num(ca->certs);
        X509_STORE *st = X509_STORE_new();
        STACK_OF(X509) *inter = sk_X509_new_null();
        X509_STORE_CTX *ctx = X509_STORE_CTX_new();
        X509_STORE_add_cert(st, sk_X509_value(ca->certs, n - 1));
        for (int j = 0; j < n - 1; j++)
            sk_X509_push(inter, sk_X509_value(ca->certs, j));
        if (ctx && X509_STORE_CTX_init(ctx, st, leaf, inter) == 1) {
            X509_VERIFY_PARAM *p = X509_STORE_CTX_get0_param(ctx);
            X509_VERIFY_PARAM_set_time(p, (time_t)t);
            if (X509_verify_cert(ctx) == 1)
                *chain = X509_STORE_CTX_get1_chain(ctx);
            else
                last = X509_verify_cert_error_string(X509_STORE_CTX_get_error(ctx));
        }
        X509_STORE_CTX_free(ctx);
        sk_X509_free(inter);
        X509_STORE_free(st);
    }
    ERR_clear_error();
    if (*chain)
        return 0;
    char ts[32];
    fmt_time(t, ts);
    if (candidates == 0)
        dp_buf_printf(why,
                      "sigstore certificate chain: no Fulcio CA of the trusted root is valid "
                      "at the signing time %s",
                      ts);
    else
        dp_buf_printf(why,
                      "sigstore certificate chain: the certificate does not chain to a "
                      "Fulcio CA of the trusted root at %s (%s)",
                      ts, last ? last : "?");
    return -1;
}

/* Equal as a whole: length and bytes (an embedded NUL is not a shorter match). */
static bool asn1_eq(const ASN1_STRING *s, const char *want)
{
    size_t n = strlen(want);
    return s && (size_t)ASN1_STRING_length(s) == n &&
           memcmp(ASN1_STRING_get0_data(s), want, n) == 0;
}

static int check_identity(X509 *leaf, const char *identity, dp_buf_t *why)
{
    GENERAL_NAMES *gens = X509_get_ext_d2i(leaf, NID_subject_alt_name, NULL, NULL);
    ASN1_OBJECT *user = OBJ_txt2obj(OID_USERNAME, 1);
    bool ok = false;
    dp_buf_t seen = {0}, t = {0};
    for (int i = 0; gens && i < sk_GENERAL_NAME_num(gens) && !ok; i++) {
        const GENERAL_NAME *g = sk_GENERAL_NAME_value(gens, i);
        const ASN1_STRING *s = NULL;
        if (g->type == GEN_EMAIL || g->type == GEN_URI)
            s = g->d.ia5;
        else if (g->type == GEN_OTHERNAME && OBJ_cmp(g->d.otherName->type_id, user) == 0 &&
                 g->d.otherName->value->type == V_ASN1_UTF8STRING)
            s = g->d.otherName->value->value.utf8string;
        if (s == NULL)
            continue;
        ok = asn1_eq(s, identity);
        if (seen.len < 200) {
            char *v =
                dp_xstrndup((const char *)ASN1_STRING_get0_data(s), (size_t)ASN1_STRING_length(s));
            dp_buf_reset(&t);
            attest_abbrev(v, &t);
            dp_buf_printf(&seen, "%s%s", seen.len ? ", " : "", t.base);
            free(v);
        }
    }
    if (!ok) {
        dp_buf_reset(&t);
        attest_abbrev(identity, &t);
        dp_buf_printf(why, "sigstore identity: the certificate is for %s, not %s",
                      seen.len ? seen.base : "no email, URI or username", t.base);
    }
    GENERAL_NAMES_free(gens);
    ASN1_OBJECT_free(user);
    dp_buf_free(&seen);
    dp_buf_free(&t);
    return ok ? 0 : -1;
}

static int check_issuer(X509 *leaf, const char *issuer, dp_buf_t *why)
{
    int found = 0, bad = 0;
    char got[160] = "";
    for (int i = 0; i < X509_get_ext_count(leaf); i++) {
        X509_EXTENSION *e = X509_get_ext(leaf, i);
        char oid[64];
        if (OBJ_obj2txt(oid, sizeof(oid), X509_EXTENSION_get_object(e), 1) <= 0)
            continue;
        bool legacy = strcmp(oid, OID_ISSUER_LEGACY) == 0;
        if (!legacy && strcmp(oid, OID_ISSUER) != 0)
            continue;
        const ASN1_OCTET_STRING *d = X509_EXTENSION_get_data(e);
        ASN1_UTF8STRING *u = NULL;
        const ASN1_STRING *v = d;
        if (!legacy) { /* .1.8 holds a DER UTF8String, .1.1 the raw bytes */
            const unsigned char *p = ASN1_STRING_get0_data(d);
            u = d2i_ASN1_UTF8STRING(NULL, &p, ASN1_STRING_length(d));
            v = u;
        }
        found++;
        if (!asn1_eq(v, issuer)) {
            bad++;
            if (v && !got[0]) {
                char *s = dp_xstrndup((const char *)ASN1_STRING_get0_data(v),
                                      (size_t)ASN1_STRING_length(v));
                dp_buf_t t = {0};
                attest_abbrev(s, &t);
                snprintf(got, sizeof(got), "%s", t.base);
                dp_buf_free(&t);
                free(s);
            }
        }
        ASN1_UTF8STRING_free(u);
    }
    ERR_clear_error();
    if (found > 0 && bad == 0)
        return 0;
    dp_buf_t t = {0};
    attest_abbrev(issuer, &t);
    if (found == 0)
        dp_buf_printf(why, "sigstore issuer: the certificate has no OIDC issuer extension (%s)",
                      OID_ISSUER);
    else
        dp_buf_printf(why, "sigstore issuer: the certificate's OIDC issuer is %s, not %s",
                      got[0] ? got : "not a UTF8String", t.base);
    dp_buf_free(&t);
    return -1;
}

static void put_u16(dp_buf_t *b, size_t v)
{
    uint8_t x[2] = {(uint8_t)(v >> 8), (uint8_t)v};
    dp_buf_append(b, x, 2);
}

/* RFC 6962 §3.2: the digitally-signed struct of an SCT over a precertificate entry. */
static int sct_signed_data(const SCT *sct, X509 *leaf, X509 *issuer, dp_buf_t *out)
{
    X509 *pre = X509_dup(leaf);
    int idx = pre ? X509_get_ext_by_NID(pre, NID_ct_precert_scts, -1) : -1;
    if (idx < 0) {
        X509_free(pre);
        return -1;
    }
    X509_EXTENSION_free(X509_delete_ext(pre, idx));
    unsigned char *tbs = NULL;
    int tn = i2d_re_X509_tbs(pre, &tbs);
    X509_free(pre);
    if (tn <= 0 || tn >= (1 << 24)) {
        OPENSSL_free(tbs);
        return -1;
    }
    uint8_t ikh[32];
    unsigned char *spki = NULL;
    int sn = i2d_X509_PUBKEY(X509_get_X509_PUBKEY(issuer), &spki);
    if (sn <= 0) {
        OPENSSL_free(tbs);
        return -1;
    }
    dp_sha256(spki, (size_t)sn, ikh);
    OPENSSL_free(spki);
    uint64_t ts = SCT_get_timestamp(sct);
    uint8_t head[12] = {0 /* v1 */, 0 /* certificate_timestamp */};
    for (int i = 0; i < 8; i++)
        head[2 + i] = (uint8_t)(ts >> (56 - 8 * i));
    head[10] = 0;
    head[11] = 1; /* precert_entry */
    dp_buf_append(out, head, sizeof(head));
    dp_buf_append(out, ikh, 32);
    uint8_t l3[3] = {(uint8_t)(tn >> 16), (uint8_t)(tn >> 8), (uint8_t)tn};
    dp_buf_append(out, l3, 3);
    dp_buf_append(out, tbs, (size_t)tn);
    OPENSSL_free(tbs);
    unsigned char *ext = NULL;
    size_t en = SCT_get0_extensions(sct, &ext);
    put_u16(out, en);
    dp_buf_append(out, ext, en);
    return 0;
}

static int check_sct(const sigstore_root_t *root, X509 *leaf, X509 *issuer, dp_buf_t *why)
{
    STACK_OF(SCT) *scts = X509_get_ext_d2i(leaf, NID_ct_precert_scts, NULL, NULL);
    int rc = -1;
    const char *problem = "the certificate has no embedded SCT";
    dp_buf_t data = {0};
    for (int i = 0; scts && i < sk_SCT_num(scts) && rc != 0; i++) {
        const SCT *s = sk_SCT_value(scts, i);
        unsigned char *id = NULL, *sig = NULL;
        size_t idn = SCT_get0_log_id(s, &id);
        size_t sign = SCT_get0_signature(s, &sig);
        const tlog_t *log = SCT_get_version(s) == SCT_VERSION_V1 && idn == 32
                                ? find_log(root->ct, root->nct, id)
                                : NULL;
        if (log == NULL) {
            problem = "no SCT is from a CT log of the trusted root";
            continue;
        }
        int64_t t = (int64_t)(SCT_get_timestamp(s) / 1000);
        if (t < log->start || t > log->end) {
            problem = "the SCT's CT log key was not valid at the SCT's time";
            continue;
        }
        dp_buf_reset(&data);
        if (sct_signed_data(s, leaf, issuer, &data) != 0) {
            problem = "cannot rebuild the precertificate";
            continue;
        }
        if (verify_sig(log->key, data.base, data.len, sig, sign))
            rc = 0;
        else
            problem = "the SCT's signature does not verify (the certificate was altered, or the "
                      "SCT is not for it)";
    }
    if (rc != 0)
        dp_buf_printf(why, "sigstore SCT: %s", problem);
    SCT_LIST_free(scts);
    dp_buf_free(&data);
    ERR_clear_error();
    return rc;
}

/* ---- the transparency log entry --------------------------------------------------------------
 */

typedef struct {
    const cJSON *json;
    dp_buf_t body; /* canonicalizedBody, decoded */
    uint8_t log_id[32];
    const tlog_t *log;
    int64_t log_index, integrated_time;
    bool has_time;
} entry_t;

static int parse_entry(const sigstore_root_t *root, const cJSON *vm, entry_t *e, dp_buf_t *why)
{
    const cJSON *tl = member(vm, "tlogEntries");
    if (cJSON_GetArraySize(tl) != 1) {
        dp_buf_printf(why, "sigstore tlog entry: expected exactly one tlogEntries[] entry, got %d",
                      cJSON_GetArraySize(tl));
        return -1;
    }
    e->json = tl->child;
    const cJSON *kv = member(e->json, "kindVersion");
    const char *kind = str_member(kv, "kind"), *ver = str_member(kv, "version");
    if (!kind || !ver || strcmp(kind, "dsse") != 0 || strcmp(ver, "0.0.1") != 0) {
        dp_buf_t t = {0}, u = {0};
        attest_abbrev(kind ? kind : "?", &t);
        attest_abbrev(ver ? ver : "?", &u);
        dp_buf_printf(why,
                      "sigstore tlog entry: kind %s version %s (only dsse 0.0.1, Rekor v1, "
                      "is verified)",
                      t.base, u.base);
        dp_buf_free(&t);
        dp_buf_free(&u);
        return -1;
    }
    dp_buf_t id = {0};
    int r = b64_member(member(e->json, "logId"), "keyId", &id);
    if (r == 0 && id.len == 32)
        memcpy(e->log_id, id.base, 32);
    bool bad_id = r != 0 || id.len != 32;
    dp_buf_free(&id);
    if (bad_id) {
        dp_buf_printf(why, "sigstore tlog entry: logId.keyId: expected 32 bytes of base64");
        return -1;
    }
    e->log = find_log(root->rekor, root->nrekor, e->log_id);
    if (e->log == NULL) {
        dp_buf_printf(why, "sigstore tlog entry: logId is not a Rekor log of the trusted root");
        return -1;
    }
    if (int_member(e->json, "logIndex", &e->log_index) != 0) {
        dp_buf_printf(why, "sigstore tlog entry: logIndex: expected a decimal integer");
        return -1;
    }
    if (b64_member(e->json, "canonicalizedBody", &e->body) != 0) {
        dp_buf_printf(why, "sigstore tlog entry: canonicalizedBody: expected base64");
        return -1;
    }
    e->has_time = member(e->json, "integratedTime") != NULL;
    if (e->has_time && (int_member(e->json, "integratedTime", &e->integrated_time) != 0 ||
                        e->integrated_time == 0))
        e->has_time = false;
    return 0;
}

/* The SET: the Rekor key's signature over the RFC 8785 canonical JSON of body, integratedTime,
 * logID (hex) and logIndex (keys in that, sorted, order). */
static int check_set(const entry_t *e, dp_buf_t *why)
{
    const cJSON *ip = member(e->json, "inclusionPromise");
    dp_buf_t sig = {0}, msg = {0};
    int rc = -1;
    if (b64_member(ip, "signedEntryTimestamp", &sig) != 0) {
        dp_buf_printf(why, "sigstore signed entry timestamp: inclusionPromise."
                           "signedEntryTimestamp: expected base64");
        goto out;
    }
    char hex[65];
    dp_hex(e->log_id, 32, hex);
    dp_buf_appends(&msg, "{\"body\":\"");
    dp_base64_encode(e->body.base, e->body.len, &msg);
    dp_buf_printf(&msg, "\",\"integratedTime\":%lld,\"logID\":\"%s\",\"logIndex\":%lld}",
                  (long long)e->integrated_time, hex, (long long)e->log_index);
    char ts[32];
    fmt_time(e->integrated_time, ts);
    if (e->integrated_time < e->log->start || e->integrated_time > e->log->end)
        dp_buf_printf(why,
                      "sigstore signed entry timestamp: the Rekor key was not valid at the "
                      "integrated time %s",
                      ts);
    else if (!verify_sig(e->log->key, msg.base, msg.len, sig.base, sig.len))
        dp_buf_printf(why, "sigstore signed entry timestamp: does not verify with the Rekor key "
                           "(the entry, its time or its index was altered)");
    else
        rc = 0;
out:
    dp_buf_free(&sig);
    dp_buf_free(&msg);
    return rc;
}

static void hash_children(const uint8_t *l, const uint8_t *r, uint8_t out[32])
{
    uint8_t b[65];
    b[0] = 1;
    memcpy(b + 1, l, 32);
    memcpy(b + 33, r, 32);
    dp_sha256(b, sizeof(b), out);
}

static int bit_length(uint64_t v)
{
    int n = 0;
    while (v) {
        n++;
        v >>= 1;
    }
    return n;
}

/* RFC 6962 §2.1.1 / RFC 9162 §2.1.3.2: the root the proof gives for the leaf at index: the
 * first inner hashes below the point where the paths to index and size-1 part, the rest along
 * the right border. */
static void merkle_root(const uint8_t leaf[32], uint64_t index, const uint8_t (*hashes)[32],
                        size_t n, int inner, uint8_t out[32])
{
    uint8_t h[32];
    memcpy(h, leaf, 32);
    for (int i = 0; i < inner; i++) {
        if (((index >> i) & 1) == 0)
            hash_children(h, hashes[i], h);
        else
            hash_children(hashes[i], h, h);
    }
    for (size_t i = (size_t)inner; i < n; i++)
        hash_children(hashes[i], h, h);
    memcpy(out, h, 32);
}

/* A signed note (the checkpoint): "origin\nsize\nroot-b64\n[...]\n\n— name b64(hint4||sig)\n".
 * 0 when a line by the entry's Rekor key verifies over the text before the blank line and the
 * text names size and root. */
/* Signature lines of a checkpoint with the entry's key hint that are verified at most. */
#define CHECKPOINT_MAX_TRIES 4

static int check_checkpoint(const entry_t *e, const char *note, uint64_t size,
                            const uint8_t root[32], dp_buf_t *why)
{
    const char *sep = strstr(note, "\n\n");
    if (sep == NULL) {
        dp_buf_printf(why, "sigstore checkpoint: not a signed note (no blank line before the "
                           "signatures)");
        return -1;
    }
    size_t text_len = (size_t)(sep - note) + 1;
    /* The body: origin, tree size, root hash. */
    const char *l1 = memchr(note, '\n', text_len);
    const char *l2 = l1 ? memchr(l1 + 1, '\n', text_len - (size_t)(l1 + 1 - note)) : NULL;
    const char *l3 = l2 ? memchr(l2 + 1, '\n', text_len - (size_t)(l2 + 1 - note)) : NULL;
    uint64_t csize = 0;
    dp_buf_t croot = {0}, sig = {0};
    int rc = -1;
    if (l3 == NULL || dp_parse_u64(l1 + 1, (size_t)(l2 - l1 - 1), &csize) != 0 ||
        attest_b64_decode_any(l2 + 1, (size_t)(l3 - l2 - 1), &croot) != 0 || croot.len != 32) {
        dp_buf_printf(why, "sigstore checkpoint: expected origin, tree size and root hash lines");
        goto out;
    }
    if (csize != size || memcmp(croot.base, root, 32) != 0) {
        dp_buf_printf(why,
                      "sigstore checkpoint: it is for tree size %llu and another root than "
                      "the inclusion proof's (tree size %llu)",
                      (unsigned long long)csize, (unsigned long long)size);
        goto out;
    }
    static const char dash[] = "\xe2\x80\x94 "; /* U+2014 and a space */
    bool verified = false, hinted = false;
    /* The note names each signer once; lines stuffed with the same key hint would each cost a
     * verification: the first few are tried, no more. */
    unsigned tries = 0;
    for (const char *l = sep + 2; *l && !verified && tries < CHECKPOINT_MAX_TRIES;) {
        const char *nl = strchr(l, '\n');
        if (nl == NULL)
            break;
        const char *sp = strncmp(l, dash, 4) == 0 ? memchr(l + 4, ' ', (size_t)(nl - l - 4)) : NULL;
        if (sp && attest_b64_decode_any(sp + 1, (size_t)(nl - sp - 1), &sig) == 0 && sig.len > 4 &&
            memcmp(sig.base, e->log_id, 4) == 0) {
            hinted = true;
            tries++;
            verified = verify_sig(e->log->key, note, text_len, sig.base + 4, sig.len - 4);
        }
        dp_buf_reset(&sig);
        l = nl + 1;
    }
    if (!verified)
        dp_buf_printf(why, "sigstore checkpoint: %s",
                      hinted ? "the signature by the Rekor key does not verify (the checkpoint "
                               "was altered)"
                             : "no signature by the entry's Rekor key");
    else
        rc = 0;
out:
    dp_buf_free(&croot);
    dp_buf_free(&sig);
    return rc;
}

static int check_inclusion(const entry_t *e, dp_buf_t *why)
{
    const cJSON *p = member(e->json, "inclusionProof");
    int64_t index = 0, size = 0;
    dp_buf_t root = {0}, h = {0};
    uint8_t(*hashes)[32] = NULL;
    int rc = -1;
    if (!cJSON_IsObject(p)) {
        dp_buf_printf(why, "sigstore inclusion proof: missing");
        goto out;
    }
    const cJSON *hs = member(p, "hashes");
    if (int_member(p, "logIndex", &index) != 0 || int_member(p, "treeSize", &size) != 0 ||
        index >= size || b64_member(p, "rootHash", &root) != 0 || root.len != 32 ||
        !cJSON_IsArray(hs) || cJSON_GetArraySize(hs) > MAX_PROOF_HASHES) {
        dp_buf_printf(why,
                      "sigstore inclusion proof: expected logIndex < treeSize, a 32-byte "
                      "rootHash and at most %d hashes",
                      MAX_PROOF_HASHES);
        goto out;
    }
    size_t n = (size_t)cJSON_GetArraySize(hs), i = 0;
    hashes = dp_xcalloc(n + 1, 32);
    for (const cJSON *x = hs->child; x; x = x->next, i++) {
        if (!cJSON_IsString(x) ||
            attest_b64_decode_any(x->valuestring, strlen(x->valuestring), &h) != 0 || h.len != 32) {
            dp_buf_printf(why, "sigstore inclusion proof: hashes[%zu]: expected 32 bytes", i);
            goto out;
        }
        memcpy(hashes[i], h.base, 32);
        dp_buf_reset(&h);
    }
    uint64_t ui = (uint64_t)index, us = (uint64_t)size;
    int inner = bit_length(ui ^ (us - 1));
    int border = __builtin_popcountll(ui >> inner);
    if (n != (size_t)(inner + border)) {
        dp_buf_printf(why, "sigstore inclusion proof: %zu hashes, a leaf at %llu of %llu needs %d",
                      n, (unsigned long long)ui, (unsigned long long)us, inner + border);
        goto out;
    }
    dp_buf_t leafin = {0};
    dp_buf_appendc(&leafin, 0);
    dp_buf_append(&leafin, e->body.base, e->body.len);
    uint8_t leaf[32], got[32];
    dp_sha256(leafin.base, leafin.len, leaf);
    dp_buf_free(&leafin);
    merkle_root(leaf, ui, (const uint8_t(*)[32])hashes, n, inner, got);
    if (memcmp(got, root.base, 32) != 0) {
        dp_buf_printf(why, "sigstore inclusion proof: the entry's path does not lead to rootHash "
                           "(the entry or the proof was altered)");
        goto out;
    }
    const cJSON *cp = member(p, "checkpoint");
    const char *note = str_member(cp, "envelope");
    if (note == NULL) {
        dp_buf_printf(why, "sigstore checkpoint: missing (inclusionProof.checkpoint.envelope)");
        goto out;
    }
    rc = check_checkpoint(e, note, us, (const uint8_t *)root.base, why);
out:
    free(hashes);
    dp_buf_free(&root);
    dp_buf_free(&h);
    return rc;
}

/* The entry is a dsse v0.0.1 record of this envelope: payloadHash is the payload's SHA-256, and
 * signatures are this envelope's, each with this certificate (PEM, base64) as verifier. */
static int check_body(const entry_t *e, const sigstore_bundle_t *b, X509 *leaf, dp_buf_t *why)
{
    cJSON *body = cJSON_ParseWithLength(e->body.base ? e->body.base : "", e->body.len);
    const cJSON *spec = member(body, "spec");
    const cJSON *ph = member(spec, "payloadHash");
    const cJSON *sigs = member(spec, "signatures");
    const char *problem = NULL;
    dp_buf_t d = {0};
    char want[65];
    dp_sha256_hex(b->payload->base ? b->payload->base : "", b->payload->len, want);
    const char *alg = str_member(ph, "algorithm"), *val = str_member(ph, "value");
    if (!cJSON_IsObject(spec) || !alg || !val || !cJSON_IsArray(sigs))
        problem = "not a dsse v0.0.1 body (spec.payloadHash, spec.signatures)";
    else if (strcmp(str_member(body, "kind") ? str_member(body, "kind") : "", "dsse") != 0)
        problem = "kind is not dsse";
    else if (strcmp(alg, "sha256") != 0 || strcmp(val, want) != 0)
        problem = "payloadHash is not the SHA-256 of this bundle's payload (the entry is for "
                  "another envelope)";
    else if ((size_t)cJSON_GetArraySize(sigs) != b->nsigs)
        problem = "its signatures are not this envelope's";
    size_t i = 0;
    for (const cJSON *s = sigs ? sigs->child : NULL; s && !problem; s = s->next, i++) {
        if (b64_member(s, "signature", &d) != 0 || d.len != b->sigs[i].len ||
            memcmp(d.base, b->sigs[i].base, d.len) != 0) {
            problem = "its signatures are not this envelope's";
            break;
        }
        X509 *v = NULL;
        if (b64_member(s, "verifier", &d) == 0) {
            BIO *bio = BIO_new_mem_buf(d.base, (int)d.len);
            v = bio ? PEM_read_bio_X509(bio, NULL, NULL, NULL) : NULL;
            BIO_free(bio);
        }
        if (v == NULL || X509_cmp(v, leaf) != 0)
            problem = "its verifier is not this bundle's certificate";
        X509_free(v);
    }
    if (problem)
        dp_buf_printf(why, "sigstore log entry body: %s", problem);
    cJSON_Delete(body);
    dp_buf_free(&d);
    ERR_clear_error();
    return problem ? -1 : 0;
}

/* ---- RFC 3161 timestamps ----------------------------------------------------------------------
 */

/* One timestamp response: granted, signed by a timestamp authority of the root valid at its
 * time (the chain checked at that time, the signer's EKU timeStamping), over the hash of the
 * DSSE signature. 0 with the time in *t. */
static int check_tsa_one(const sigstore_root_t *root, const dp_buf_t *der, const dp_buf_t *sig,
                         int64_t *t, dp_buf_t *why)
{
    const unsigned char *p = (const unsigned char *)der->base;
    TS_RESP *resp = der->len < INT_MAX ? d2i_TS_RESP(NULL, &p, (long)der->len) : NULL;
    TS_TST_INFO *tst = resp ? TS_RESP_get_tst_info(resp) : NULL;
    int rc = -1;
    if (tst == NULL) {
        dp_buf_printf(why, "sigstore timestamp: not an RFC 3161 timestamp response with a token");
        goto out;
    }
    struct tm tm = {0};
    if (ASN1_TIME_to_tm(TS_TST_INFO_get_time(tst), &tm) != 1) {
        dp_buf_printf(why, "sigstore timestamp: bad genTime");
        goto out;
    }
    *t = (int64_t)timegm(&tm);
    const EVP_MD *md =
        EVP_get_digestbyobj(TS_MSG_IMPRINT_get_algo(TS_TST_INFO_get_msg_imprint(tst))->algorithm);
    unsigned char imprint[EVP_MAX_MD_SIZE];
    unsigned int ilen = 0;
    if (md == NULL || EVP_Digest(sig->base, sig->len, imprint, &ilen, md, NULL) != 1) {
        dp_buf_printf(why, "sigstore timestamp: unsupported message imprint hash");
        goto out;
    }
    size_t candidates = 0;
    for (size_t i = 0; i < root->ntsas && rc != 0; i++) {
        const ca_t *ca = &root->tsas[i];
        if (*t < ca->start || *t > ca->end)
            continue;
        candidates++;
        int n = sk_X509_num(ca->certs);
        X509_STORE *st = X509_STORE_new();
        STACK_OF(X509) *certs = sk_X509_new_null();
        TS_VERIFY_CTX *ctx = TS_VERIFY_CTX_new();
        X509_STORE_add_cert(st, sk_X509_value(ca->certs, n - 1));
        X509_VERIFY_PARAM_set_time(X509_STORE_get0_param(st), (time_t)*t);
        for (int j = 0; j < n - 1; j++) {
            X509_up_ref(sk_X509_value(ca->certs, j));
            sk_X509_push(certs, sk_X509_value(ca->certs, j));
        }
        TS_VERIFY_CTX_set_flags(ctx,
                                TS_VFY_VERSION | TS_VFY_SIGNATURE | TS_VFY_IMPRINT | TS_VFY_SIGNER);
        TS_VERIFY_CTX_set_store(ctx, st);
        TS_VERIFY_CTX_set_certs(ctx, certs);
        TS_VERIFY_CTX_set_imprint(ctx, OPENSSL_memdup(imprint, ilen), (long)ilen);
        if (TS_RESP_verify_response(ctx, resp) == 1)
            rc = 0;
        TS_VERIFY_CTX_free(ctx); /* frees st, certs and the imprint */
    }
    if (rc != 0)
        dp_buf_printf(why, "sigstore timestamp: %s",
                      candidates == 0 ? "no timestamp authority of the trusted root is valid at "
                                        "its time"
                                      : "does not verify with a timestamp authority of the "
                                        "trusted root (altered, or not over this signature)");
out:
    TS_RESP_free(resp);
    ERR_clear_error();
    return rc;
}

/* Every RFC 3161 timestamp of the bundle verifies; their times are appended to times. */
static int check_tsas(const sigstore_root_t *root, const cJSON *list, const sigstore_bundle_t *b,
                      int64_t *times, size_t *ntimes, size_t max, dp_buf_t *why)
{
    dp_buf_t der = {0};
    int rc = 0;
    size_t i = 0;
    for (const cJSON *ts = list ? list->child : NULL; ts && rc == 0; ts = ts->next, i++) {
        if (*ntimes == max || b->nsigs != 1) {
            dp_buf_printf(why,
                          "sigstore timestamp: expected at most %zu timestamps over one "
                          "signature",
                          max - 1);
            rc = -1;
        } else if (b64_member(ts, "signedTimestamp", &der) != 0) {
            dp_buf_printf(why,
                          "sigstore timestamp: rfc3161Timestamps[%zu].signedTimestamp: "
                          "expected base64",
                          i);
            rc = -1;
        } else {
            rc = check_tsa_one(root, &der, &b->sigs[0], &times[*ntimes], why);
            if (rc == 0)
                (*ntimes)++;
        }
    }
    dp_buf_free(&der);
    return rc;
}

/* ---- all of it --------------------------------------------------------------------------------
 */

int sigstore_verify(const sigstore_root_t *root, const char *identity, const char *issuer,
                    const sigstore_bundle_t *b, sigstore_result_t *out, dp_buf_t *why)
{
    memset(out, 0, sizeof(*out));
    const cJSON *vm = b->material;
    entry_t e = {0};
    X509 *leaf = der_cert(b->cert->base, b->cert->len);
    STACK_OF(X509) *chain = NULL;
    EVP_PKEY *k = NULL;
    dp_buf_t pae = {0};
    int rc = -1;
    if (leaf == NULL) {
        dp_buf_printf(why, "sigstore certificate: verificationMaterial.certificate is not a DER "
                           "certificate");
        goto out;
    }
    if (parse_entry(root, vm, &e, why) != 0)
        goto out;
    /* 1. The signing time: the log's (through its SET) and each RFC 3161 timestamp's. */
    int64_t times[9];
    size_t ntimes = 0;
    if (member(e.json, "inclusionPromise") != NULL) {
        if (!e.has_time) {
            dp_buf_printf(why, "sigstore signed entry timestamp: the entry has no integratedTime");
            goto out;
        }
        if (check_set(&e, why) != 0)
            goto out;
        times[ntimes++] = e.integrated_time;
    }
    const cJSON *tsv = member(vm, "timestampVerificationData");
    if (check_tsas(root, member(tsv, "rfc3161Timestamps"), b, times, &ntimes, DP_ARRAY_SIZE(times),
                   why) != 0)
        goto out;
    if (ntimes == 0) {
        dp_buf_printf(why, "sigstore signing time: neither a signed entry timestamp nor an RFC "
                           "3161 timestamp");
        goto out;
    }
    out->signed_at = times[0];
    /* 2-5. The certificate, valid at each of the times. */
    for (size_t i = 0; i < ntimes; i++) {
        sk_X509_pop_free(chain, X509_free);
        chain = NULL;
        if (verify_chain(root, leaf, times[i], &chain, why) != 0)
            goto out;
    }
    const char *usage = sigstore_signing_usage_problem(leaf);
    if (usage) {
        dp_buf_printf(why, "sigstore certificate usage: %s", usage);
        goto out;
    }
    if (sk_X509_num(chain) < 2 || check_sct(root, leaf, sk_X509_value(chain, 1), why) != 0) {
        if (sk_X509_num(chain) < 2)
            dp_buf_printf(why, "sigstore SCT: the certificate has no issuer in its chain");
        goto out;
    }
    if (check_identity(leaf, identity, why) != 0 || check_issuer(leaf, issuer, why) != 0)
        goto out;
    /* 6. The log: its key valid at each signing time (the SET checked it at the integrated time;
     * the checkpoint's signature rests on it too), then the inclusion proof and checkpoint. */
    for (size_t i = 0; i < ntimes; i++) {
        if (times[i] < e.log->start || times[i] > e.log->end) {
            dp_buf_printf(why, "sigstore checkpoint: the Rekor key was not valid at the signing "
                               "time");
            goto out;
        }
    }
    if (check_inclusion(&e, why) != 0)
        goto out;
    /* 7. Inside the certificate's validity (the chain check at each time implies it; this
     * names it). */
    for (size_t i = 0; i < ntimes; i++) {
        time_t t = (time_t)times[i];
        if (X509_cmp_time(X509_get0_notBefore(leaf), &t) > 0 ||
            X509_cmp_time(X509_get0_notAfter(leaf), &t) < 0) {
            dp_buf_printf(why, "sigstore signing time: outside the certificate's validity");
            goto out;
        }
    }
    /* 8. The signature. */
    k = X509_get_pubkey(leaf);
    attest_dsse_pae(b->payload_type, b->payload->base ? b->payload->base : "", b->payload->len,
                    &pae);
    bool ok = false;
    for (size_t i = 0; k && i < b->nsigs && !ok; i++)
        ok = verify_sig(k, pae.base, pae.len, b->sigs[i].base, b->sigs[i].len);
    if (!ok) {
        dp_buf_printf(why, "signature: does not verify with the signing certificate's key "
                           "(payload or signature altered, or another signer)");
        goto out;
    }
    /* 9. The entry is this envelope's. */
    if (check_body(&e, b, leaf, why) != 0)
        goto out;
    uint8_t fp[32];
    spki_sha256(k, fp);
    dp_hex(fp, 32, out->signer);
    rc = 0;
out:
    EVP_PKEY_free(k);
    sk_X509_pop_free(chain, X509_free);
    X509_free(leaf);
    dp_buf_free(&e.body);
    dp_buf_free(&pae);
    ERR_clear_error();
    return rc;
}
