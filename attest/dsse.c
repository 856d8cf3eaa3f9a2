/* Ed25519 keys and DSSE envelopes via OpenSSL EVP (see dsse.h). */
#define _GNU_SOURCE /* memmem */
#include "attest/dsse.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>

#include "attest/json.h"
#include "common/jw.h"
#include "common/pem.h"
#include "common/util.h"

#define ED25519_SIG_LEN 64

struct attest_key_s {
    EVP_PKEY *pkey;
    bool is_private;
    char keyid[65];
};

static int compute_keyid(EVP_PKEY *pkey, char out[65])
{
    unsigned char *der = NULL;
    int n = i2d_PUBKEY(pkey, &der);
    if (n <= 0)
        return -1;
    dp_sha256_hex(der, (size_t)n, out);
    OPENSSL_free(der);
    return 0;
}

int attest_key_from_pem(const char *pem, size_t len, bool is_private, attest_key_t **out,
                        dp_buf_t *err)
{
    EVP_PKEY *pkey = NULL;
    *out = NULL;
    if (dp_pem_ed25519(pem, len, is_private, &pkey, err) != 0)
        return -EINVAL;
    attest_key_t *k = dp_xcalloc(1, sizeof(*k));
    if (compute_keyid(pkey, k->keyid) != 0) {
        free(k);
        EVP_PKEY_free(pkey);
        ERR_clear_error();
        if (err)
            dp_buf_appends(err, "cannot encode the public key");
        return -EINVAL;
    }
    k->pkey = pkey;
    k->is_private = is_private;
    *out = k;
    return 0;
}

int attest_key_load(const char *path, bool is_private, attest_key_t **out, dp_buf_t *err)
{
    dp_buf_t pem = {0};
    *out = NULL;
    int rc = dp_read_file(path, DP_PEM_KEY_MAX, &pem);
    if (rc != 0) {
        if (err)
            dp_buf_printf(err, "%s: %s", path,
                          rc == -EFBIG ? "too large for a key file" : dp_input_strerror(rc));
        goto out;
    }
    dp_buf_t why = {0};
    rc = attest_key_from_pem(pem.base, pem.len, is_private, out, &why);
    if (rc != 0 && err)
        dp_buf_printf(err, "%s: %s", path, why.base ? why.base : "invalid key");
    dp_buf_free(&why);
out:
    if (pem.base)
        OPENSSL_cleanse(pem.base, pem.len);
    dp_buf_free(&pem);
    return rc;
}

void attest_key_free(attest_key_t *k)
{
    if (k == NULL)
        return;
    EVP_PKEY_free(k->pkey);
    free(k);
}

const char *attest_key_id(const attest_key_t *k)
{
    return k->keyid;
}

bool attest_key_is_private(const attest_key_t *k)
{
    return k->is_private;
}

void attest_key_public_pem(const attest_key_t *k, dp_buf_t *out)
{
    BIO *bio = BIO_new(BIO_s_mem());
    if (bio == NULL)
        return;
    if (PEM_write_bio_PUBKEY(bio, k->pkey) == 1) {
        char *p = NULL;
        long n = BIO_get_mem_data(bio, &p);
        if (n > 0)
            dp_buf_append(out, p, (size_t)n);
    }
    BIO_free(bio);
}

/* Write all of a memory BIO to a new file (O_EXCL: never clobber an existing key). */
static int write_new_file(const char *path, mode_t mode, BIO *bio, dp_buf_t *err)
{
    char *p = NULL;
    long n = BIO_get_mem_data(bio, &p);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
    if (fd < 0) {
        int e = errno;
        dp_buf_printf(err, "%s: %s", path,
                      e == EEXIST ? "already exists (not overwritten)" : strerror(e));
        return -e;
    }
    int rc = 0;
    /* umask can only remove bits; fchmod makes the mode exact whatever the umask was. */
    if (fchmod(fd, mode) != 0)
        rc = -errno;
    for (long off = 0; rc == 0 && off < n;) {
        ssize_t w = write(fd, p + off, (size_t)(n - off));
        if (w < 0) {
            if (errno == EINTR)
                continue;
            rc = -errno;
            break;
        }
        off += w;
    }
    if (rc == 0 && fsync(fd) != 0)
        rc = -errno;
    if (close(fd) != 0 && rc == 0)
        rc = -errno;
    if (rc != 0) {
        dp_buf_printf(err, "%s: %s", path, strerror(-rc));
        unlink(path);
    }
    return rc;
}

int attest_keygen(const char *prefix, char keyid_out[65], dp_buf_t *err)
{
    int rc = -EIO;
    dp_buf_t keypath = {0}, pubpath = {0};
    BIO *kbio = NULL, *pbio = NULL;
    EVP_PKEY *pkey = EVP_PKEY_Q_keygen(NULL, NULL, "ED25519");
    if (pkey == NULL) {
        dp_buf_appends(err, "Ed25519 key generation failed");
        goto out;
    }
    kbio = BIO_new(BIO_s_mem());
    pbio = BIO_new(BIO_s_mem());
    if (kbio == NULL || pbio == NULL ||
        PEM_write_bio_PKCS8PrivateKey(kbio, pkey, NULL, NULL, 0, NULL, NULL) != 1 ||
        PEM_write_bio_PUBKEY(pbio, pkey) != 1) {
        dp_buf_appends(err, "cannot encode the key pair");
        goto out;
    }
    dp_buf_printf(&keypath, "%s.key.pem", prefix);
    dp_buf_printf(&pubpath, "%s.pub.pem", prefix);
    rc = write_new_file(keypath.base, 0600, kbio, err);
    if (rc != 0)
        goto out;
    rc = write_new_file(pubpath.base, 0644, pbio, err);
    if (rc != 0) {
        unlink(keypath.base); /* a private key without its public half is just a trap */
        goto out;
    }
    if (keyid_out)
        compute_keyid(pkey, keyid_out);
out:
    if (kbio) {
        /* Scrub the PEM of the private key before the BIO frees it. */
        char *p = NULL;
        long n = BIO_get_mem_data(kbio, &p);
        if (n > 0)
            OPENSSL_cleanse(p, (size_t)n);
    }
    BIO_free(kbio);
    BIO_free(pbio);
    EVP_PKEY_free(pkey);
    dp_buf_free(&keypath);
    dp_buf_free(&pubpath);
    ERR_clear_error();
    return rc;
}

/* ---- key sets ----------------------------------------------------------------------------- */

const attest_key_t *attest_keyset_find(const attest_keyset_t *ks, const char *keyid)
{
    if (ks == NULL || keyid == NULL)
        return NULL;
    for (size_t i = 0; i < ks->count; i++)
        if (strcmp(ks->keys[i]->keyid, keyid) == 0)
            return ks->keys[i];
    return NULL;
}

void attest_keyset_add(attest_keyset_t *ks, attest_key_t *k)
{
    if (attest_keyset_find(ks, k->keyid) != NULL) {
        attest_key_free(k);
        return;
    }
    ks->keys = dp_xrealloc(ks->keys, (ks->count + 1) * sizeof(*ks->keys));
    ks->keys[ks->count++] = k;
}

int attest_keyset_add_file(attest_keyset_t *ks, const char *path, dp_buf_t *err)
{
    attest_key_t *k = NULL;
    int rc = attest_key_load(path, false, &k, err);
    if (rc == 0)
        attest_keyset_add(ks, k);
    return rc;
}

void attest_keyset_free(attest_keyset_t *ks)
{
    for (size_t i = 0; i < ks->count; i++)
        attest_key_free(ks->keys[i]);
    free(ks->keys);
    ks->keys = NULL;
    ks->count = 0;
}

/* ---- DSSE --------------------------------------------------------------------------------- */

void attest_dsse_pae(const char *type, const void *body, size_t n, dp_buf_t *out)
{
    dp_buf_appends(out, "DSSEv1 ");
    dp_buf_append_u64(out, strlen(type));
    dp_buf_appendc(out, ' ');
    dp_buf_appends(out, type);
    dp_buf_appendc(out, ' ');
    dp_buf_append_u64(out, n);
    dp_buf_appendc(out, ' ');
    dp_buf_append(out, body, n);
}

int attest_key_sign(const attest_key_t *k, const void *msg, size_t n,
                    unsigned char sig[ATTEST_SIG_LEN])
{
    if (!k->is_private)
        return -1;
    size_t siglen = ATTEST_SIG_LEN;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    /* Ed25519 is "pure": no digest is named, the whole message goes in one call. */
    int rc = ctx != NULL && EVP_DigestSignInit(ctx, NULL, NULL, NULL, k->pkey) == 1 &&
                     EVP_DigestSign(ctx, sig, &siglen, msg, n) == 1 && siglen == ATTEST_SIG_LEN
                 ? 0
                 : -1;
    EVP_MD_CTX_free(ctx);
    ERR_clear_error();
    return rc;
}

bool attest_key_verify(const attest_key_t *k, const void *msg, size_t n, const void *sig,
                       size_t siglen)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    bool ok = ctx != NULL && EVP_DigestVerifyInit(ctx, NULL, NULL, NULL, k->pkey) == 1 &&
              EVP_DigestVerify(ctx, sig, siglen, msg, n) == 1;
    EVP_MD_CTX_free(ctx);
    ERR_clear_error();
    return ok;
}

int attest_envelope_sign(const attest_key_t *key, const char *payload, size_t n, dp_buf_t *out,
                         dp_buf_t *err)
{
    int rc = -1;
    dp_buf_t pae = {0}, b64 = {0};
    unsigned char sig[ED25519_SIG_LEN];
    size_t siglen = sizeof(sig);
    if (!key->is_private) {
        dp_buf_appends(err, "signing needs a private key");
        goto out;
    }
    attest_dsse_pae(ATTEST_PAYLOAD_TYPE, payload, n, &pae);
    if (attest_key_sign(key, pae.base, pae.len, sig) != 0) {
        dp_buf_appends(err, "Ed25519 signing failed");
        goto out;
    }
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "payloadType", ATTEST_PAYLOAD_TYPE);
    dp_base64_encode(payload, n, &b64);
    dp_jw_strn(&w, "payload", b64.base, b64.len);
    dp_jw_arr_begin(&w, "signatures");
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "keyid", key->keyid);
    dp_buf_reset(&b64);
    dp_base64_encode(sig, siglen, &b64);
    dp_jw_strn(&w, "sig", b64.base, b64.len);
    dp_jw_obj_end(&w);
    dp_jw_arr_end(&w);
    dp_jw_obj_end(&w);
    rc = 0;
out:
    dp_buf_free(&pae);
    dp_buf_free(&b64);
    ERR_clear_error();
    return rc;
}

int attest_b64_decode_any(const char *s, size_t n, dp_buf_t *out)
{
    if (n % 4 == 1)
        return -1;
    dp_buf_t norm = {0};
    dp_buf_reserve(&norm, n + 2);
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        dp_buf_appendc(&norm, c == '-' ? '+' : c == '_' ? '/' : c);
    }
    while (norm.len % 4 != 0)
        dp_buf_appendc(&norm, '=');
    int rc = dp_base64_decode(norm.base, norm.len, out);
    dp_buf_free(&norm);
    return rc;
}

/* The first 8 characters of an id for a reason ("3fa2b1c4.."), sanitised. */
static void short_id(const char *s, dp_buf_t *out)
{
    if (strlen(s) > 10) {
        char head[9];
        memcpy(head, s, 8);
        head[8] = '\0';
        attest_abbrev(head, out);
        dp_buf_appends(out, "..");
    } else {
        attest_abbrev(s, out);
    }
}

static bool ed25519_verify(const attest_key_t *k, const dp_buf_t *msg, const dp_buf_t *sig)
{
    return attest_key_verify(k, msg->base, msg->len, sig->base, sig->len);
}

typedef struct {
    const char *keyid;
    dp_buf_t sig;
} env_sig_t;

int attest_envelope_verify(const char *json, size_t len, const attest_verify_opts_t *opts,
                           attest_report_t *out, dp_buf_t *why)
{
    int rc = -1;
    cJSON *root = NULL;
    dp_buf_t payload = {0}, pae = {0};
    env_sig_t sigs[ATTEST_MAX_SIGNATURES];
    size_t nsigs = 0;
    const char *signer = NULL;
    dp_buf_t sink = {0};
    static const attest_verify_opts_t strict = {.require_signature = true};
    if (why == NULL)
        why = &sink;
    if (opts == NULL)
        opts = &strict; /* no options: the safest reading, nothing unsigned passes */
    attest_report_clear(out);

    if (len > ATTEST_ENVELOPE_MAX_BYTES) {
        dp_buf_printf(why, "envelope: too large (%zu bytes, max %d)", len,
                      ATTEST_ENVELOPE_MAX_BYTES);
        goto out;
    }
    const char *bad = NULL;
    root = attest_json_parse(json, len, &bad);
    if (root == NULL) {
        dp_buf_printf(why, "envelope: %s", bad);
        goto out;
    }
    if (!cJSON_IsObject(root)) {
        dp_buf_appends(why, "envelope: expected a JSON object");
        goto out;
    }
    const cJSON *pt = cJSON_GetObjectItemCaseSensitive(root, "payloadType");
    if (!cJSON_IsString(pt) || strcmp(pt->valuestring, ATTEST_PAYLOAD_TYPE) != 0) {
        dp_buf_appends(why, pt ? "envelope.payloadType: expected \"" ATTEST_PAYLOAD_TYPE "\""
                               : "envelope.payloadType: missing");
        goto out;
    }
    const cJSON *pl = cJSON_GetObjectItemCaseSensitive(root, "payload");
    if (pl == NULL) {
        dp_buf_appends(why, "envelope.payload: missing");
        goto out;
    }
    if (!cJSON_IsString(pl) ||
        attest_b64_decode_any(pl->valuestring, strlen(pl->valuestring), &payload) != 0) {
        dp_buf_appends(why, cJSON_IsString(pl) ? "envelope.payload: bad base64"
                                               : "envelope.payload: expected a string");
        goto out;
    }

    /* Collect and check the shape of every signature before verifying any. */
    const cJSON *sa = cJSON_GetObjectItemCaseSensitive(root, "signatures");
    if (sa != NULL && !cJSON_IsNull(sa)) {
        if (!cJSON_IsArray(sa)) {
            dp_buf_appends(why, "envelope.signatures: expected an array");
            goto out;
        }
        int n = cJSON_GetArraySize(sa);
        if (n > ATTEST_MAX_SIGNATURES) {
            dp_buf_printf(why, "envelope.signatures: %d signatures, max %d", n,
                          ATTEST_MAX_SIGNATURES);
            goto out;
        }
        const cJSON *s;
        cJSON_ArrayForEach(s, sa)
        {
            size_t i = nsigs;
            const cJSON *kid = cJSON_GetObjectItemCaseSensitive(s, "keyid");
            const cJSON *sg = cJSON_GetObjectItemCaseSensitive(s, "sig");
            if (!cJSON_IsObject(s) || !cJSON_IsString(kid) || !cJSON_IsString(sg)) {
                dp_buf_printf(
                    why, "signature: malformed (signatures[%zu] needs string keyid and sig)", i);
                goto out;
            }
            sigs[i].keyid = kid->valuestring;
            memset(&sigs[i].sig, 0, sizeof(sigs[i].sig));
            nsigs++;
            if (attest_b64_decode_any(sg->valuestring, strlen(sg->valuestring), &sigs[i].sig) !=
                0) {
                dp_buf_printf(why, "signature: malformed (signatures[%zu].sig is not base64)", i);
                goto out;
            }
            if (sigs[i].sig.len != ED25519_SIG_LEN) {
                dp_buf_printf(why, "signature: malformed or truncated (sig is %zu bytes, want %d)",
                              sigs[i].sig.len, ED25519_SIG_LEN);
                goto out;
            }
        }
    }

    if (nsigs == 0) {
        if (opts->require_signature) {
            dp_buf_appends(why, "signature: missing (require_signature is set)");
            goto out;
        }
    } else {
        attest_dsse_pae(ATTEST_PAYLOAD_TYPE, payload.base, payload.len, &pae);
        const char *untrusted = NULL;
        for (size_t i = 0; i < nsigs; i++) {
            const attest_key_t *k = attest_keyset_find(opts->trusted, sigs[i].keyid);
            if (k == NULL) {
                if (untrusted == NULL)
                    untrusted = sigs[i].keyid;
                continue;
            }
            if (!ed25519_verify(k, &pae, &sigs[i].sig)) {
                dp_buf_appends(why, "signature: bad signature by key ");
                short_id(sigs[i].keyid, why);
                goto out;
            }
            if (signer == NULL)
                signer = k->keyid;
        }
        if (signer == NULL) {
            dp_buf_appends(why, "signature: key ");
            short_id(untrusted, why);
            dp_buf_appends(why, " not trusted");
            goto out;
        }
    }

    if (attest_payload_parse(payload.base ? payload.base : "", payload.len, out, why) != 0)
        goto out;
    if (opts->expected_nonce && strcmp(out->nonce, opts->expected_nonce) != 0) {
        dp_buf_appends(why, "nonce mismatch (replay?): got ");
        short_id(out->nonce, why);
        dp_buf_appends(why, " want ");
        short_id(opts->expected_nonce, why);
        attest_report_clear(out);
        goto out;
    }
    if (signer) {
        out->is_signed = true;
        memcpy(out->keyid, signer, sizeof(out->keyid));
    }
    rc = 0;
out:
    for (size_t i = 0; i < nsigs; i++)
        dp_buf_free(&sigs[i].sig);
    cJSON_Delete(root);
    dp_buf_free(&payload);
    dp_buf_free(&pae);
    dp_buf_free(&sink);
    return rc;
}

/* ---- the signing side --------------------------------------------------------------------- */

int attest_envelope_for(const attest_key_t *key, const attest_report_t *r, const char *nonce,
                        uint64_t issued_at_ms, dp_buf_t *out, dp_buf_t *err)
{
    char ts[32];
    dp_iso8601(ts, issued_at_ms ? issued_at_ms : dp_wall_ms());
    /* A shallow view of r with this request's nonce and time: the strings stay r's. */
    attest_report_t view = *r;
    view.nonce = (char *)nonce;
    view.issued_at = ts;
    dp_buf_t payload = {0}, b64 = {0};
    attest_payload_build(&view, &payload);
    int rc = 0;
    if (key) {
        rc = attest_envelope_sign(key, payload.base, payload.len, out, err);
    } else {
        /* Unsigned: the same envelope with an empty signature list, which a verifier accepts
         * only without require_signature. */
        dp_jw_t w;
        dp_jw_init(&w, out);
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "payloadType", ATTEST_PAYLOAD_TYPE);
        dp_base64_encode(payload.base, payload.len, &b64);
        dp_jw_strn(&w, "payload", b64.base, b64.len);
        dp_jw_arr_begin(&w, "signatures");
        dp_jw_arr_end(&w);
        dp_jw_obj_end(&w);
    }
    dp_buf_free(&payload);
    dp_buf_free(&b64);
    return rc;
}

int attest_envelope_for_keyfile(const char *key_path, const attest_report_t *r, const char *nonce,
                                dp_buf_t *out, dp_buf_t *err)
{
    attest_key_t *k = NULL;
    int rc = attest_key_load(key_path, true, &k, err);
    if (rc == 0)
        rc = attest_envelope_for(k, r, nonce, 0, out, err);
    attest_key_free(k);
    return rc < 0 ? -1 : rc;
}

bool attest_nonce_valid(const char *s, size_t n)
{
    if (n == 0 || n > ATTEST_NONCE_MAX)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                  c == '.' || c == '_' || c == '~' || c == '-';
        if (!ok)
            return false;
    }
    return true;
}

bool attest_nonce_copy(const char *s, size_t n, char out[ATTEST_NONCE_MAX + 1])
{
    if (!attest_nonce_valid(s, n))
        return false;
    memcpy(out, s, n);
    out[n] = '\0';
    return true;
}
