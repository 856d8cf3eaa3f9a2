/* Files a config names: the manifest and policy files it references, secrets, certificates,
 * keys. They are checked at load so `detproxy check` and a reload catch a missing or wrong file
 * before the proxy needs it.
 *
 * Secrets: contents never reach a message (only the file's path does), and the buffers holding
 * them are wiped before they are freed. */
#include "config/cfg_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>

#include "common/pem.h"
#include "common/util.h"

#define SECRET_MAX 4096
#define TLS_PEM_MAX (1024 * 1024) /* a certificate chain or CA bundle, or a TLS key */

/* The versions of the folders read so far in this load: a folder and its `..data` link's target
 * then (the version folder's name). A load reads a handful of folders; past the table's size a
 * folder is read as it is at each read. */
#define VERSIONS_MAX 16
static _Thread_local struct {
    dev_t dev; /* the folder, however its path is spelled ("vol", "./vol", "/etc/x/vol") */
    ino_t ino;
    char *version;
} g_versions[VERSIONS_MAX];
static _Thread_local size_t g_nversions;
static _Thread_local bool g_versioned, g_version_gone;

void cfg_versions_begin(void)
{
    cfg_versions_end();
    g_versioned = true;
    g_version_gone = false;
}

void cfg_versions_end(void)
{
    for (size_t i = 0; i < g_nversions; i++)
        free(g_versions[i].version);
    g_nversions = 0;
    g_versioned = false;
}

bool cfg_versions_gone(void)
{
    return g_version_gone;
}

/* The version of folder dir this load reads: its `..data` link's target, read once. NULL: no
 * such link (not a Kubernetes volume), or the table is full. */
static const char *dir_version(const char *dir)
{
    struct stat st;
    if (stat(dir, &st) != 0)
        return NULL;
    for (size_t i = 0; i < g_nversions; i++)
        if (g_versions[i].dev == st.st_dev && g_versions[i].ino == st.st_ino)
            return g_versions[i].version;
    if (g_nversions == VERSIONS_MAX)
        return NULL;
    char link[PATH_MAX], target[NAME_MAX + 1];
    snprintf(link, sizeof(link), "%s/..data", dir);
    ssize_t n = readlink(link, target, sizeof(target) - 1);
    if (n <= 0 || memchr(target, '/', (size_t)n) != NULL)
        return NULL; /* the kubelet's link names a folder beside it */
    target[n] = '\0';
    g_versions[g_nversions].dev = st.st_dev;
    g_versions[g_nversions].ino = st.st_ino;
    g_versions[g_nversions].version = dp_xstrdup(target);
    return g_versions[g_nversions++].version;
}

/* path, or, for a link into its folder's `..data`, the same file in the version this load
 * reads (owned by the caller; NULL: path itself). */
static char *versioned(const char *path)
{
    char target[PATH_MAX];
    ssize_t n = g_versioned ? readlink(path, target, sizeof(target) - 1) : -1;
    if (n <= 0)
        return NULL;
    target[n] = '\0';
    if (strncmp(target, "..data/", 7) != 0)
        return NULL;
    const char *slash = strrchr(path, '/');
    char *dir =
        slash ? dp_xstrndup(path, slash == path ? 1 : (size_t)(slash - path)) : dp_xstrdup(".");
    const char *version = dir_version(dir);
    char *out = NULL;
    if (version) {
        dp_buf_t b = {0};
        dp_buf_printf(&b, "%s/%s/%s", dir, version, target + 7);
        out = dp_buf_steal(&b);
    }
    free(dir);
    return out;
}

/* Read `from`, the file the config names `path` (errors name that). */
static bool read_file(cfg_ctx_t *c, const char *key, const char *path, const char *from, size_t max,
                      dp_buf_t *out)
{
    /* Opened without blocking and then looked at, not looked at and then opened: a FIFO put at
     * the path in between would block the open (and the control thread, on a reload) until a
     * writer came. */
    int fd = open(from, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        cfg_err(c, key, "cannot read %s: %s", path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return false;
    }
    if (!S_ISREG(st.st_mode)) {
        cfg_err(c, key, "%s is not a regular file", path);
        close(fd);
        return false;
    }
    int rc = dp_read_fd(fd, max, out);
    close(fd);
    if (rc == -EFBIG)
        cfg_err(c, key, "%s is larger than %zu bytes", path, max);
    else if (rc != 0)
        cfg_err(c, key, "cannot read %s: %s", path, strerror(-rc));
    return rc == 0;
}

bool cfg_read_file(cfg_ctx_t *c, const char *key, const char *path, size_t max, dp_buf_t *out)
{
    char *in_version = versioned(path);
    bool ok = read_file(c, key, path, in_version ? in_version : path, max, out);
    if (!ok && in_version && access(in_version, F_OK) != 0 && errno == ENOENT)
        g_version_gone = true; /* the kubelet removed the version read so far */
    free(in_version);
    return ok;
}

cJSON *cfg_read_referenced(cfg_ctx_t *c, const char *rel)
{
    if (*rel == '\0') {
        cfg_err(c, NULL, "expected a file path or an object");
        return NULL;
    }
    char *full = cfg_resolve(c->dir, rel);
    dp_buf_t text = {0};
    cJSON *doc = NULL;
    if (cfg_read_file(c, NULL, full, CFG_DOC_MAX, &text)) {
        c->file = rel;
        doc = cfg_parse_json(c, text.base, text.len);
    }
    dp_buf_free(&text);
    free(full);
    return doc;
}

static void wipe(dp_buf_t *b)
{
    if (b->base != NULL)
        OPENSSL_cleanse(b->base, b->cap);
    dp_buf_free(b);
}

void cfg_check_secret_mode(cfg_ctx_t *c, const char *key, const char *path)
{
    struct stat st;
    if (stat(path, &st) == 0 && (st.st_mode & 077) != 0)
        cfg_warn(c, key, "%s is accessible by group or others (mode %04o): chmod 600 it", path,
                 (unsigned)(st.st_mode & 07777));
}

char *cfg_read_secret(cfg_ctx_t *c, const char *key, const char *path)
{
    dp_buf_t b = {0};
    char *secret = NULL;
    if (!cfg_read_file(c, key, path, SECRET_MAX, &b))
        goto out;
    cfg_check_secret_mode(c, key, path);
    while (b.len > 0 && strchr(" \t\r\n", b.base[b.len - 1]) != NULL)
        b.base[--b.len] = '\0';
    if (b.len == 0) {
        cfg_err(c, key, "%s is empty", path);
        goto out;
    }
    /* It goes into an HTTP header: a stray newline would split the request. */
    for (size_t i = 0; i < b.len; i++) {
        unsigned char ch = (unsigned char)b.base[i];
        if (ch < 0x20 || ch == 0x7f) {
            cfg_err(c, key, "%s contains control characters (it is sent in an HTTP header)", path);
            goto out;
        }
    }
    secret = dp_xstrndup(b.base, b.len);
out:
    wipe(&b);
    return secret;
}

void cfg_secret_free(char *s)
{
    if (s != NULL)
        OPENSSL_cleanse(s, strlen(s));
    free(s);
}

/* ---- PEM ------------------------------------------------------------------------------- */

/* Never prompt on the terminal for a passphrase: an encrypted key is simply unreadable. */
static int no_passphrase_cb(char *buf, int size, int rwflag, void *u)
{
    return 0;
}

static X509 *load_cert(cfg_ctx_t *c, const char *key, const char *path)
{
    dp_buf_t b = {0};
    X509 *x = NULL;
    if (!cfg_read_file(c, key, path, TLS_PEM_MAX, &b))
        goto out;
    BIO *bio = BIO_new_mem_buf(b.base, (int)b.len);
    x = bio != NULL ? PEM_read_bio_X509(bio, NULL, no_passphrase_cb, NULL) : NULL;
    BIO_free(bio);
    if (x == NULL)
        cfg_err(c, key, "%s has no PEM certificate", path);
out:
    ERR_clear_error();
    dp_buf_free(&b);
    return x;
}

static EVP_PKEY *load_private_key(cfg_ctx_t *c, const char *key, const char *path)
{
    dp_buf_t b = {0};
    EVP_PKEY *pk = NULL;
    if (!cfg_read_file(c, key, path, TLS_PEM_MAX, &b))
        goto out;
    cfg_check_secret_mode(c, key, path);
    BIO *bio = BIO_new_mem_buf(b.base, (int)b.len);
    pk = bio != NULL ? PEM_read_bio_PrivateKey(bio, NULL, no_passphrase_cb, NULL) : NULL;
    BIO_free(bio);
    if (pk == NULL)
        cfg_err(c, key, "%s is not an unencrypted PEM private key", path);
out:
    ERR_clear_error();
    wipe(&b);
    return pk;
}

bool cfg_check_cert_file(cfg_ctx_t *c, const char *key, const char *path)
{
    X509 *x = load_cert(c, key, path);
    X509_free(x);
    return x != NULL;
}

/* What the TLS library refuses when the proxy loads the files is refused here too, under the
 * file's key, by the calls the proxy makes (net/tls.c): the whole chain in a certificate file
 * (a key below the library's security level, such as RSA under 2048 bits, a certificate signed
 * with a digest it no longer trusts, a corrupt block after the first), and every certificate in
 * a CA file. `check`, `run` and a reload then agree. */
static void tls_refused(cfg_ctx_t *c, const char *key, const char *path, const char *what)
{
    /* The first error is the cause ("bad base64 decode"), later ones its consequences ("PEM
     * lib"); for a refused certificate there is one ("ca key too small"). */
    const char *why = ERR_reason_error_string(ERR_peek_error());
    cfg_err(c, key, "%s: the TLS library refuses %s: %s", path, what, why ? why : "unknown reason");
}

static bool tls_accepts(cfg_ctx_t *c, const char *cert_key, const char *cert_path,
                        const char *key_path)
{
    ERR_clear_error();
    SSL_CTX *ctx = SSL_CTX_new(TLS_method());
    if (ctx == NULL)
        return true; /* out of memory: the load itself will say so */
    bool ok = SSL_CTX_use_certificate_chain_file(ctx, cert_path) == 1 &&
              SSL_CTX_use_PrivateKey_file(ctx, key_path, SSL_FILETYPE_PEM) == 1 &&
              SSL_CTX_check_private_key(ctx) == 1;
    if (!ok)
        tls_refused(c, cert_key, cert_path, "this certificate and key");
    SSL_CTX_free(ctx);
    return ok;
}

bool cfg_check_ca_file(cfg_ctx_t *c, const char *key, const char *path, bool client_list)
{
    if (!cfg_check_cert_file(c, key, path))
        return false;
    ERR_clear_error();
    SSL_CTX *ctx = SSL_CTX_new(TLS_method());
    if (ctx == NULL)
        return true;
    STACK_OF(X509_NAME) *names = client_list ? SSL_load_client_CA_file(path) : NULL;
    bool ok =
        (!client_list || names != NULL) && SSL_CTX_load_verify_locations(ctx, path, NULL) == 1;
    if (!ok)
        tls_refused(c, key, path, "these certificates");
    sk_X509_NAME_pop_free(names, X509_NAME_free);
    SSL_CTX_free(ctx);
    ERR_clear_error();
    return ok;
}

bool cfg_check_key_pair(cfg_ctx_t *c, const char *cert_key, const char *cert_path,
                        const char *key_key, const char *key_path)
{
    X509 *x = load_cert(c, cert_key, cert_path);
    EVP_PKEY *pk = load_private_key(c, key_key, key_path);
    bool ok = x != NULL && pk != NULL;
    if (ok && X509_check_private_key(x, pk) != 1) {
        cfg_err(c, key_key, "%s does not match the certificate in %s", key_path, cert_path);
        ok = false;
    }
    if (ok)
        ok = tls_accepts(c, cert_key, cert_path, key_path);
    ERR_clear_error();
    EVP_PKEY_free(pk);
    X509_free(x);
    return ok;
}

/* The key file at path read by the rule the readers at run time apply (dp_pem_ed25519). */
static bool check_ed25519(cfg_ctx_t *c, const char *key, const char *path, bool is_private)
{
    dp_buf_t b = {0}, why = {0};
    EVP_PKEY *pk = NULL;
    bool ok = cfg_read_file(c, key, path, DP_PEM_KEY_MAX, &b) &&
              dp_pem_ed25519(b.base, b.len, is_private, &pk, &why) == 0;
    if (!ok && why.len)
        cfg_err(c, key, "%s: %s", path, why.base);
    EVP_PKEY_free(pk);
    if (b.base)
        OPENSSL_cleanse(b.base, b.len);
    dp_buf_free(&b);
    dp_buf_free(&why);
    return ok;
}

bool cfg_check_ed25519_pubkey(cfg_ctx_t *c, const char *key, const char *path)
{
    return check_ed25519(c, key, path, false);
}

bool cfg_check_ed25519_privkey(cfg_ctx_t *c, const char *key, const char *path)
{
    bool ok = check_ed25519(c, key, path, true);
    if (ok)
        cfg_check_secret_mode(c, key, path);
    return ok;
}
