/* OpenSSF Model Signing bundles: trust, signature, directory verification, and what the agent
 * needs (see oms.h; parsing is oms_bundle.c). */
#define _GNU_SOURCE
#include "attest/oms_int.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <openssl/x509_vfy.h>

#include "attest/dsse.h"
#include "common/pem.h"
#include "common/util.h"

/* ---- trust and signatures ---------------------------------------------------------------------
 */

static const char *ec_curve_problem(EVP_PKEY *k)
{
    if (EVP_PKEY_get_base_id(k) != EVP_PKEY_EC)
        return "not an EC key (OMS signs with ECDSA P-256, P-384 or P-521)";
    char curve[64] = "";
    size_t n = 0;
    if (EVP_PKEY_get_utf8_string_param(k, "group", curve, sizeof(curve), &n) != 1)
        return "EC key without a named curve";
    if (strcmp(curve, "prime256v1") != 0 && strcmp(curve, "secp384r1") != 0 &&
        strcmp(curve, "secp521r1") != 0)
        return "unsupported EC curve (OMS signs with P-256, P-384 or P-521)";
    return NULL;
}

/* The ECDSA digest goes with the curve (Sigstore algorithm registry). */
static const EVP_MD *ec_md(EVP_PKEY *k)
{
    int bits = EVP_PKEY_get_bits(k);
    return bits <= 256 ? EVP_sha256() : bits <= 384 ? EVP_sha384() : EVP_sha512();
}

static void spki_fingerprint(EVP_PKEY *k, char out[65])
{
    unsigned char *der = NULL;
    int n = i2d_PUBKEY(k, &der);
    if (n <= 0) {
        out[0] = '\0';
        return;
    }
    dp_sha256_hex(der, (size_t)n, out);
    OPENSSL_free(der);
}

/* What model_signing writes as publicKey.hint: SHA-256 of the PEM text of the key. */
static void pem_fingerprint(EVP_PKEY *k, char out[65])
{
    out[0] = '\0';
    BIO *bio = BIO_new(BIO_s_mem());
    if (bio && PEM_write_bio_PUBKEY(bio, k) == 1) {
        char *p = NULL;
        long n = BIO_get_mem_data(bio, &p);
        if (n > 0)
            dp_sha256_hex(p, (size_t)n, out);
    }
    BIO_free(bio);
}

int oms_trust_load_pubkey(oms_trust_t *t, const char *path, dp_buf_t *err)
{
    dp_buf_t pem = {0};
    int rc = -1;
    int r = dp_read_file(path, DP_PEM_KEY_MAX, &pem);
    if (r != 0) {
        dp_buf_printf(err, "cannot read %s: %s", path, dp_input_strerror(r));
        goto out;
    }
    /* The key file rule of every key detproxy reads (common/pem.h): its PEM block alone. */
    EVP_PKEY *k = NULL;
    dp_buf_t why = {0};
    const char *problem = dp_pem_key(pem.base, pem.len, false, &k, &why) != 0
                              ? (why.base ? why.base : "not a PEM public key")
                              : ec_curve_problem(k);
    if (problem)
        dp_buf_printf(err, "%s: %s", path, problem);
    dp_buf_free(&why);
    if (problem) {
        EVP_PKEY_free(k);
        goto out;
    }
    EVP_PKEY_free(t->pubkey);
    t->pubkey = k;
    rc = 0;
out:
    ERR_clear_error();
    dp_buf_free(&pem);
    return rc;
}

int oms_trust_load_ca(oms_trust_t *t, const char *path, dp_buf_t *err)
{
    X509_STORE *st = X509_STORE_new();
    if (st == NULL || X509_STORE_load_file(st, path) != 1) {
        dp_buf_printf(err, "%s: cannot load CA certificates (PEM)", path);
        X509_STORE_free(st);
        ERR_clear_error();
        return -1;
    }
    X509_STORE_free(t->ca_store);
    t->ca_store = st;
    return 0;
}

int oms_trust_load_sigstore(oms_trust_t *t, const char *root_path, const char *identity,
                            const char *issuer, dp_buf_t *err)
{
    static const char *const what[] = {"identity", "issuer"};
    const char *v[] = {identity, issuer};
    for (size_t i = 0; i < 2; i++) {
        size_t n = v[i] ? strlen(v[i]) : 0;
        if (n == 0 || n > SIGSTORE_NAME_MAX || !oms_bundle_utf8_valid(v[i])) {
            dp_buf_printf(err, "%s: expected 1 to %d bytes of UTF-8", what[i], SIGSTORE_NAME_MAX);
            return -1;
        }
        for (size_t j = 0; j < n; j++) {
            if ((unsigned char)v[i][j] < 0x20 || v[i][j] == 0x7f) {
                dp_buf_printf(err, "%s: a control character", what[i]);
                return -1;
            }
        }
    }
    sigstore_root_t *r = NULL;
    if (sigstore_root_load(root_path, &r, err) != 0)
        return -1;
    sigstore_root_free(t->sigstore_root);
    free(t->identity);
    free(t->issuer);
    t->sigstore_root = r;
    t->identity = dp_xstrdup(identity);
    t->issuer = dp_xstrdup(issuer);
    return 0;
}

/* Lexically normalised absolute path: no ".", "..", empty components or trailing '/'. */
static char *normalise(const char *p)
{
    char *out = dp_xmalloc(strlen(p) + 2);
    size_t n = 0;
    const char *c = p;
    while (*c) {
        while (*c == '/')
            c++;
        const char *e = strchrnul(c, '/');
        size_t len = (size_t)(e - c);
        if (len == 0 || (len == 1 && c[0] == '.')) {
            /* skip */
        } else if (len == 2 && c[0] == '.' && c[1] == '.') {
            while (n > 0 && out[n - 1] != '/')
                n--;
            if (n > 0)
                n--;
        } else {
            out[n++] = '/';
            memcpy(out + n, c, len);
            n += len;
        }
        c = e;
    }
    if (n == 0)
        out[n++] = '/';
    out[n] = '\0';
    return out;
}

/* The absolute form of p with symlinks resolved in its parent directory when that exists (the
 * model directory is compared in its realpath form). */
static char *resolve(const char *p)
{
    char *abs = NULL;
    if (p[0] == '/') {
        abs = normalise(p);
    } else {
        char *cwd = getcwd(NULL, 0);
        if (cwd == NULL)
            return NULL;
        dp_buf_t b = {0};
        dp_buf_printf(&b, "%s/%s", cwd, p);
        abs = normalise(b.base);
        dp_buf_free(&b);
        free(cwd);
    }
    char *slash = strrchr(abs, '/');
    if (slash == abs || slash[1] == '\0')
        return abs;
    *slash = '\0';
    char *parent = realpath(abs, NULL);
    *slash = '/';
    if (parent == NULL)
        return abs;
    dp_buf_t b = {0};
    dp_buf_printf(&b, "%s%s", strcmp(parent, "/") == 0 ? "" : parent, slash);
    free(parent);
    free(abs);
    return dp_buf_steal(&b);
}

int oms_trust_add_ignore(oms_trust_t *t, const char *dir, const char *path, dp_buf_t *err)
{
    char *d = realpath(dir, NULL), *p = path[0] ? resolve(path) : NULL;
    int rc = -1;
    if (d == NULL) {
        dp_buf_printf(err, "%s: the model directory: %s", dir, strerror(errno));
        goto out;
    }
    size_t n = strlen(d);
    /* Strictly inside: "d/x" (p has no trailing '/'; d "/" is the one realpath ending in '/'). */
    bool inside =
        p && strncmp(p, d, n) == 0 && (n == 1 ? p[1] != '\0' : p[n] == '/' && p[n + 1] != '\0');
    if (!inside) {
        dp_buf_printf(err, "%s: not inside the model directory %s", path, dir);
        goto out;
    }
    char *rel = dp_xstrdup(p + n + (n > 1));
    t->ignore = dp_xrealloc(t->ignore, (t->nignore + 1) * sizeof(*t->ignore));
    t->ignore[t->nignore++] = rel;
    qsort(t->ignore, t->nignore, sizeof(*t->ignore), oms_bundle_cmp_strp);
    rc = 0;
out:
    free(d);
    free(p);
    return rc;
}

void oms_trust_free(oms_trust_t *t)
{
    EVP_PKEY_free(t->pubkey);
    X509_STORE_free(t->ca_store);
    sigstore_root_free(t->sigstore_root);
    free(t->identity);
    free(t->issuer);
    for (size_t i = 0; i < t->nignore; i++)
        free(t->ignore[i]);
    free(t->ignore);
    memset(t, 0, sizeof(*t));
}

void oms_trust_pubkey_fingerprint(const oms_trust_t *t, char out[65])
{
    out[0] = '\0';
    if (t->pubkey)
        spki_fingerprint(t->pubkey, out);
}

static X509 *der_cert(const dp_buf_t *d)
{
    const unsigned char *p = (const unsigned char *)d->base;
    return d->len > 0 && d->len < INT_MAX ? d2i_X509(NULL, &p, (long)d->len) : NULL;
}

/* The leaf's key after validating the chain against the CA store (validity period included). */
static EVP_PKEY *cert_key(const oms_bundle_t *b, X509_STORE *store, dp_buf_t *why)
{
    EVP_PKEY *k = NULL;
    X509 *leaf = der_cert(&b->certs[0]);
    STACK_OF(X509) *chain = sk_X509_new_null();
    X509_STORE_CTX *ctx = X509_STORE_CTX_new();
    if (leaf == NULL) {
        dp_buf_printf(why, "verificationMaterial.x509CertificateChain.certificates[0]: not a DER "
                           "certificate");
        goto out;
    }
    for (size_t i = 1; i < b->ncerts; i++) {
        X509 *c = der_cert(&b->certs[i]);
        if (c == NULL) {
            dp_buf_printf(why,
                          "verificationMaterial.x509CertificateChain.certificates[%zu]: not a DER "
                          "certificate",
                          i);
            goto out;
        }
        sk_X509_push(chain, c);
    }
    if (ctx == NULL || X509_STORE_CTX_init(ctx, store, leaf, chain) != 1) {
        dp_buf_printf(why, "certificate: cannot set up chain validation");
        goto out;
    }
    if (X509_verify_cert(ctx) != 1) {
        int e = X509_STORE_CTX_get_error(ctx);
        dp_buf_printf(why, "certificate: the signing certificate does not chain to --ca-file (%s)",
                      X509_verify_cert_error_string(e));
        goto out;
    }
    /* RFC 5280 key usage: a certificate the CA issued for something else (a TLS server or
     * client, a CA) cannot sign a model. */
    const char *usage = sigstore_signing_usage_problem(leaf);
    if (usage) {
        dp_buf_printf(why, "certificate: the signing certificate is not for signing: %s", usage);
        goto out;
    }
    k = X509_get_pubkey(leaf);
    const char *problem = k ? ec_curve_problem(k) : "no public key";
    if (problem) {
        dp_buf_printf(why, "certificate: the signing certificate's key: %s", problem);
        EVP_PKEY_free(k);
        k = NULL;
    }
out:
    X509_STORE_CTX_free(ctx);
    sk_X509_pop_free(chain, X509_free);
    X509_free(leaf);
    ERR_clear_error();
    return k;
}

static bool sig_verifies(EVP_PKEY *k, const dp_buf_t *pae, const dp_buf_t *sig)
{
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    bool ok = ctx && EVP_DigestVerifyInit(ctx, NULL, ec_md(k), NULL, k) == 1 &&
              EVP_DigestVerify(ctx, (const unsigned char *)sig->base, sig->len,
                               (const unsigned char *)pae->base, pae->len) == 1;
    EVP_MD_CTX_free(ctx);
    ERR_clear_error();
    return ok;
}

int oms_verify_signature(const oms_bundle_t *b, const oms_trust_t *t, char signer[65],
                         int64_t *signed_at, dp_buf_t *why)
{
    signer[0] = '\0';
    if (signed_at)
        *signed_at = 0;
    EVP_PKEY *k = NULL;
    bool owned = false;
    switch (b->method) {
    case OMS_METHOD_SIGSTORE: {
        if (t->sigstore_root == NULL) {
            dp_buf_printf(why, "signature: the bundle is keyless (method sigstore): give "
                               "--trusted-root, --identity and --issuer");
            return -1;
        }
        sigstore_bundle_t sb = {.cert = &b->certs[0],
                                .material = b->material,
                                .payload_type = OMS_PAYLOAD_TYPE,
                                .payload = &b->payload,
                                .sigs = b->sigs,
                                .nsigs = b->nsigs};
        sigstore_result_t sr;
        if (sigstore_verify(t->sigstore_root, t->identity, t->issuer, &sb, &sr, why) != 0)
            return -1;
        memcpy(signer, sr.signer, 65);
        if (signed_at)
            *signed_at = sr.signed_at;
        return 0;
    }
    case OMS_METHOD_CERTIFICATE:
        if (t->ca_store == NULL) {
            dp_buf_printf(
                why, "signature: the bundle is signed with a certificate (method certificate): "
                     "give --ca-file");
            return -1;
        }
        k = cert_key(b, t->ca_store, why);
        if (k == NULL)
            return -1;
        owned = true;
        break;
    case OMS_METHOD_KEY: {
        if (t->pubkey == NULL) {
            dp_buf_printf(why,
                          "signature: the bundle is signed with a key (method key): give --pubkey");
            return -1;
        }
        k = t->pubkey;
        char der[65], pem[65];
        spki_fingerprint(k, der);
        pem_fingerprint(k, pem);
        if (b->key_hint && strcmp(b->key_hint, pem) != 0 && strcmp(b->key_hint, der) != 0) {
            dp_buf_t tmp = {0};
            dp_buf_printf(why,
                          "signature: the bundle names key %s (publicKey.hint), --pubkey is %.8s..",
                          oms_bundle_shown(b->key_hint, &tmp), der);
            dp_buf_free(&tmp);
            return -1;
        }
        if (b->key_raw.len > 0) {
            unsigned char *d = NULL;
            int n = i2d_PUBKEY(k, &d);
            bool same =
                n > 0 && (size_t)n == b->key_raw.len && memcmp(d, b->key_raw.base, (size_t)n) == 0;
            OPENSSL_free(d);
            if (!same) {
                dp_buf_printf(why, "signature: the bundle's publicKey.rawBytes is not --pubkey");
                return -1;
            }
        }
        break;
    }
    }
    dp_buf_t pae = {0};
    attest_dsse_pae(OMS_PAYLOAD_TYPE, b->payload.base ? b->payload.base : "", b->payload.len, &pae);
    bool ok = false;
    for (size_t i = 0; i < b->nsigs && !ok; i++)
        ok = sig_verifies(k, &pae, &b->sigs[i]);
    if (ok)
        spki_fingerprint(k, signer);
    else
        dp_buf_printf(why,
                      "signature: does not verify with the %s (payload or signature altered, or "
                      "another signer)",
                      b->method == OMS_METHOD_KEY ? "--pubkey key" : "signing certificate's key");
    dp_buf_free(&pae);
    if (owned)
        EVP_PKEY_free(k);
    return ok ? 0 : -1;
}

/* ---- the directory ----------------------------------------------------------------------------
 */

static const char *const default_ignores[] = {".git", ".gitignore", ".gitattributes", ".github"};

typedef struct {
    const oms_bundle_t *b;
    const oms_trust_t *t;
    char *bundle_rel; /* the bundle's path inside the model directory, or NULL */
    attest_reasons_t *findings;
    int nfindings;
} walk_ctx_t;

static bool exclude_cb(const char *rel, void *data)
{
    const walk_ctx_t *w = data;
    if (strchr(rel, '/') == NULL)
        for (size_t i = 0; i < DP_ARRAY_SIZE(default_ignores); i++)
            if (strcmp(rel, default_ignores[i]) == 0)
                return true;
    if (w->b->nignore > 0 &&
        bsearch(&rel, w->b->ignore, w->b->nignore, sizeof(char *), oms_bundle_cmp_strp) != NULL)
        return true;
    if (w->t && w->t->nignore > 0 &&
        bsearch(&rel, w->t->ignore, w->t->nignore, sizeof(char *), oms_bundle_cmp_strp) != NULL)
        return true;
    return w->bundle_rel && strcmp(rel, w->bundle_rel) == 0;
}

static void finding(walk_ctx_t *w, const char *fmt, const char *rel, const char *detail)
{
    dp_buf_t t = {0};
    attest_abbrev(rel, &t);
    attest_reasons_add(w->findings, fmt, t.base, detail ? detail : "");
    dp_buf_free(&t);
    w->nfindings++;
}

static int symlink_cb(const char *rel, void *data)
{
    finding(data, "symlink not allowed (the bundle records allow_symlinks false): %s%s", rel, NULL);
    return 0;
}

/* OMS §6.1: a model is files and directories; anything else (a FIFO or device an engine might
 * read) is not verifiable, so it cannot be part of a verified model. */
static int special_cb(const char *rel, void *data)
{
    finding(data, "not a regular file (a FIFO, socket or device cannot be signed): %s%s", rel,
            NULL);
    return 0;
}

static int list_special_cb(const char *rel, void *data)
{
    (void)rel;
    (void)data;
    return 1;
}

/* The model-relative path of the bundle when it lies inside dir (it is then not a model file,
 * OMS §6.2). */
static char *bundle_relpath(const char *dir, const char *bundle_path)
{
    if (bundle_path == NULL)
        return NULL;
    char *d = realpath(dir, NULL), *f = realpath(bundle_path, NULL), *rel = NULL;
    if (d && f) {
        size_t n = strlen(d);
        if (strncmp(f, d, n) == 0 && (d[n - 1] == '/' || f[n] == '/'))
            rel = dp_xstrdup(f + n + (d[n - 1] == '/' ? 0 : 1));
    }
    free(d);
    free(f);
    return rel;
}

/* The resources signed for one file: [*lo, *hi) in by_path. */
static void lookup_path(const oms_bundle_t *b, const char *path, size_t *lo, size_t *hi)
{
    size_t l = 0, h = b->nres;
    while (l < h) {
        size_t m = l + (h - l) / 2;
        if (strcmp(b->by_path[m]->path, path) < 0)
            l = m + 1;
        else
            h = m;
    }
    *lo = l;
    while (l < b->nres && strcmp(b->by_path[l]->path, path) == 0)
        l++;
    *hi = l;
}

/* Check one file; returns 0, or a negative errno when it could not be read. */
static int check_file(walk_ctx_t *w, attest_filehasher_t *fh, const char *dir,
                      const attest_file_t *f, dp_buf_t *digests, dp_buf_t *err)
{
    const oms_bundle_t *b = w->b;
    if (!oms_bundle_utf8_valid(f->relpath)) {
        finding(w, "extra file (its name is not valid UTF-8, so it cannot be signed): %s%s",
                f->relpath, NULL);
        return 0;
    }
    size_t lo, hi;
    lookup_path(b, f->relpath, &lo, &hi);
    if (lo == hi) {
        if (!(b->shards && f->size == 0)) /* empty files have no shards (OMS §6.3.2) */
            finding(w, "extra file (not in the bundle): %s%s", f->relpath, NULL);
        return 0;
    }
    for (size_t i = lo; i < hi; i++)
        b->by_path[i]->seen = true;
    char detail[160];
    if (b->shards && b->by_path[hi - 1]->end != f->size) {
        snprintf(detail, sizeof(detail), " (size %llu, signed %llu)", (unsigned long long)f->size,
                 (unsigned long long)b->by_path[hi - 1]->end);
        finding(w, "changed file: %s%s", f->relpath, detail);
        return 0;
    }
    dp_buf_reset(digests);
    int rc = attest_filehasher_file(fh, dir, f, b->shards ? b->shard_size : 0, digests, err);
    if (rc != 0)
        return rc;
    size_t got = digests->len / b->digest_len;
    if (got != hi - lo) {
        snprintf(detail, sizeof(detail), " (%zu pieces, %zu signed)", got, hi - lo);
        finding(w, "changed file: %s%s", f->relpath, detail);
        return 0;
    }
    for (size_t i = 0; i < got; i++) {
        const oms_res_t *r = b->by_path[lo + i];
        const uint8_t *d = (const uint8_t *)digests->base + i * b->digest_len;
        if (memcmp(d, r->digest, b->digest_len) == 0)
            continue;
        char gh[17], wh[17];
        dp_hex(d, 8, gh);
        dp_hex(r->digest, 8, wh);
        if (b->shards)
            snprintf(detail, sizeof(detail), " (bytes %llu..%llu: %s %s.. signed %s..)",
                     (unsigned long long)r->start, (unsigned long long)r->end, b->hash_type, gh,
                     wh);
        else
            snprintf(detail, sizeof(detail), " (%s %s.. signed %s..)", b->hash_type, gh, wh);
        finding(w, "changed file: %s%s", f->relpath, detail);
        return 0;
    }
    return 0;
}

int oms_verify_dir(const oms_bundle_t *b, const char *dir, const char *bundle_path,
                   const oms_trust_t *t, const attest_hash_opts_t *opts, attest_reasons_t *findings,
                   attest_snapshot_t *snap_out, dp_buf_t *err)
{
    walk_ctx_t w = {
        .b = b, .t = t, .bundle_rel = bundle_relpath(dir, bundle_path), .findings = findings};
    attest_walk_opts_t wo = {.include_hidden = true,
                             .any_file_name = true,
                             .no_follow_symlinks = !b->allow_symlinks,
                             .exclude = exclude_cb,
                             .on_symlink = symlink_cb,
                             .on_special = special_cb,
                             .data = &w};
    for (size_t i = 0; i < b->nres; i++)
        b->res[i].seen = false;
    attest_snapshot_t snap = {0};
    dp_buf_t digests = {0};
    attest_filehasher_t *fh = NULL;
    int rc = attest_snapshot_take_opts(dir, &wo, &snap, err);
    if (rc != 0)
        goto out;
    fh = attest_filehasher_new(b->md_name, opts, err);
    if (fh == NULL) {
        rc = -EIO;
        goto out;
    }
    for (size_t i = 0; i < snap.count && rc == 0; i++)
        rc = check_file(&w, fh, dir, &snap.files[i], &digests, err);
    if (rc != 0)
        goto out;
    for (size_t i = 0; i < b->nres; i++) {
        const oms_res_t *r = b->by_path[i];
        if (!r->seen && (i == 0 || strcmp(b->by_path[i - 1]->path, r->path) != 0))
            finding(&w, "missing file: %s%s", r->path, NULL);
    }
    rc = w.nfindings > 0 ? 1 : 0;
out:
    if (snap_out != NULL && rc >= 0)
        *snap_out = snap;
    else
        attest_snapshot_free(&snap);
    attest_filehasher_free(fh);
    dp_buf_free(&digests);
    free(w.bundle_rel);
    return rc;
}

/* ---- all of it --------------------------------------------------------------------------------
 */

void oms_result_clear(oms_result_t *r)
{
    attest_reasons_free(&r->findings);
    attest_snapshot_free(&r->snap);
    oms_bundle_free(r->bundle);
    memset(r, 0, sizeof(*r));
}

/* The bundle as one regular file: O_NONBLOCK so that a FIFO put in its place (it often lies in
 * the model directory) cannot hang the verifier; dev and ino of what was read. */
static int read_bundle(const char *path, dp_buf_t *json, oms_result_t *out)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0)
        return -errno;
    struct stat st;
    int rc = fstat(fd, &st) != 0 ? -errno : !S_ISREG(st.st_mode) ? -EINVAL : 0;
    if (rc == 0) {
        out->bundle_dev = (uint64_t)st.st_dev;
        out->bundle_ino = (uint64_t)st.st_ino;
        rc = dp_read_fd(fd, OMS_BUNDLE_MAX_BYTES, json);
    }
    close(fd);
    return rc;
}

int oms_verify(const char *bundle_path, const char *dir, const oms_trust_t *t,
               const attest_hash_opts_t *opts, oms_result_t *out)
{
    dp_buf_t json = {0}, why = {0};
    int rc = read_bundle(bundle_path, &json, out);
    if (rc != 0) {
        attest_reasons_add(&out->findings, "bundle: cannot read %s: %s", bundle_path,
                           rc == -EINVAL ? "not a regular file" : strerror(-rc));
        goto out;
    }
    rc = 1;
    if (oms_bundle_parse(json.base ? json.base : "", json.len, &out->bundle, &why) != 0) {
        attest_reasons_add(&out->findings, "%s", why.base);
        goto out;
    }
    out->method = oms_method_names[out->bundle->method];
    memcpy(out->root_digest, out->bundle->root_digest, sizeof(out->root_digest));
    if (oms_verify_signature(out->bundle, t, out->signer, &out->signed_at, &why) != 0) {
        attest_reasons_add(&out->findings, "%s", why.base);
        goto out;
    }
    rc = oms_verify_dir(out->bundle, dir, bundle_path, t, opts, &out->findings, &out->snap, &why);
    if (rc < 0)
        attest_reasons_add(&out->findings, "model directory: %s",
                           why.base ? why.base : strerror(-rc));
    out->verified = rc == 0;
out:
    dp_buf_free(&json);
    dp_buf_free(&why);
    return rc;
}

int oms_verify_checkpoint(const char *bundle_path, const char *dir, const oms_trust_t *t,
                          const attest_hash_opts_t *opts, const attest_snapshot_t *ckpt,
                          const dp_buf_t *lines, oms_result_t *out)
{
    int rc = oms_verify(bundle_path, dir, t, opts, out);
    if (rc == 0 && oms_cross_check(out, ckpt, lines->base, lines->len, &out->findings) > 0) {
        out->verified = false;
        rc = 1;
    }
    return rc;
}

int oms_watch_take(const char *bundle_path, const char *dir, oms_watch_t *out, dp_buf_t *err)
{
    /* Special files too: one appearing makes a verified directory unverifiable. */
    static const attest_walk_opts_t all_files = {
        .include_hidden = true, .any_file_name = true, .on_special = list_special_cb};
    memset(out, 0, sizeof(*out));
    struct stat st;
    if (stat(bundle_path, &st) == 0) { /* else all 0: oms_verify names the error */
        out->bundle_dev = (uint64_t)st.st_dev;
        out->bundle_ino = (uint64_t)st.st_ino;
        out->bundle_size = (uint64_t)st.st_size;
        out->bundle_mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    }
    return attest_snapshot_take_opts(dir, &all_files, &out->files, err);
}

bool oms_watch_differs(const oms_watch_t *a, const oms_watch_t *b, dp_buf_t *why)
{
    if (a->bundle_dev != b->bundle_dev || a->bundle_ino != b->bundle_ino ||
        a->bundle_size != b->bundle_size || a->bundle_mtime_ns != b->bundle_mtime_ns) {
        dp_buf_appends(why, "OMS bundle changed");
        return true;
    }
    return attest_snapshot_differs(&a->files, &b->files, why);
}

void oms_watch_free(oms_watch_t *w)
{
    attest_snapshot_free(&w->files);
    memset(w, 0, sizeof(*w));
}

int oms_cross_check(const oms_result_t *r, const attest_snapshot_t *ckpt, const char *lines,
                    size_t lines_len, attest_reasons_t *findings)
{
    int n = 0;
    const oms_bundle_t *b = r->bundle;
    bool compare_digests = b && !b->shards && strcmp(b->hash_type, "sha256") == 0;
    size_t j = 0, off = 0;
    dp_buf_t t = {0};
    for (size_t i = 0; i < ckpt->count; i++) {
        const attest_file_t *f = &ckpt->files[i];
        const char *line = off + 66 <= lines_len ? lines + off : NULL;
        const char *nl = line ? memchr(line, '\n', lines_len - off) : NULL;
        off = nl ? (size_t)(nl - lines) + 1 : lines_len;
        if (f->ino == r->bundle_ino && f->dev == r->bundle_dev)
            continue;
        while (j < r->snap.count && strcmp(r->snap.files[j].relpath, f->relpath) < 0)
            j++;
        const attest_file_t *o =
            j < r->snap.count && strcmp(r->snap.files[j].relpath, f->relpath) == 0
                ? &r->snap.files[j]
                : NULL;
        const char *problem = NULL;
        if (o == NULL || !b)
            problem = "is not covered by the OMS bundle (ignored or excluded there)";
        else if (o->dev != f->dev || o->ino != f->ino || o->size != f->size ||
                 o->mtime_ns != f->mtime_ns)
            problem = "changed between the checkpoint hash and the OMS verification";
        else if (compare_digests) {
            size_t lo, hi;
            lookup_path(b, f->relpath, &lo, &hi);
            uint8_t d[32];
            if (line == NULL || lo == hi || dp_unhex(line, 64, d, 32) != 0 ||
                memcmp(d, b->by_path[lo]->digest, 32) != 0)
                problem = "has a different digest in the checkpoint hash and the OMS bundle";
        }
        if (problem) {
            dp_buf_reset(&t);
            attest_abbrev(f->relpath, &t);
            attest_reasons_add(findings, "checkpoint file %s %s", t.base, problem);
            n++;
        }
    }
    dp_buf_free(&t);
    return n;
}
