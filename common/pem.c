#define _GNU_SOURCE /* memmem */
#include "common/pem.h"

#include <stdint.h>
#include <string.h>

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>

/* PEM reading must never prompt on a terminal for a passphrase: refuse encrypted keys instead. */
static int no_passphrase_cb(char *buf, int size, int rwflag, void *u)
{
    (void)buf;
    (void)size;
    (void)rwflag;
    (void)u;
    return 0;
}

/* NULL when pem[0..len) is one PEM block and whitespace: its first line "-----BEGIN LABEL-----",
 * the first END line after it "-----END LABEL-----" with the same label, nothing but whitespace
 * after that; else what is wrong. (OpenSSL skips a first line that is no BEGIN line of its
 * form, and text up to the next one: a well-formed first line is the block it reads.) Whether
 * the block is a key is OpenSSL's to say. */
static const char *not_alone(const char *pem, size_t len)
{
    static const char begin[] = "-----BEGIN ", dashes[] = "-----";
    const char *stop = pem + len, *label = pem + sizeof(begin) - 1, *p = label;
    if (len < sizeof(begin) - 1 || memcmp(pem, begin, sizeof(begin) - 1) != 0)
        return "text before the PEM block: the file must start with -----BEGIN";
    while (p < stop && ((*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') || *p == ' '))
        p++;
    size_t n = (size_t)(p - label);
    if (n == 0 || n > 64 || (size_t)(stop - p) < sizeof(dashes) - 1 ||
        memcmp(p, dashes, sizeof(dashes) - 1) != 0)
        return "the first line is not a PEM BEGIN line (-----BEGIN LABEL-----)";
    p += sizeof(dashes) - 1;
    p += p < stop && *p == '\r';
    if (p >= stop || *p != '\n')
        return "text after the PEM BEGIN line on its line";
    char end[96];
    int m = snprintf(end, sizeof(end), "\n-----END %.*s-----", (int)n, label);
    const char *e = memmem(p, (size_t)(stop - p), "\n-----END ", 10);
    if (e == NULL)
        return "no END line after the PEM block";
    if ((size_t)(stop - e) < (size_t)m || memcmp(e, end, (size_t)m) != 0)
        return "the PEM block's END line does not name its BEGIN line's label";
    for (p = e + m; p < stop; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n')
            return "text after the PEM block's END line: the file holds one key and nothing else";
    return NULL;
}

/* Does the key fill its PEM block? OpenSSL reads the first key of a block's bytes and ignores
 * what follows it, where another reader (python-cryptography) refuses the block. */
static bool one_key(const char *pem, size_t len, bool is_private)
{
    BIO *bio = len <= INT32_MAX ? BIO_new_mem_buf(pem, (int)len) : NULL;
    char *name = NULL, *header = NULL;
    unsigned char *der = NULL;
    long n = 0;
    bool ok = false;
    if (bio != NULL && PEM_read_bio(bio, &name, &header, &der, &n) == 1 && n > 0) {
        const unsigned char *q = der;
        EVP_PKEY *k = is_private ? d2i_AutoPrivateKey(NULL, &q, n) : d2i_PUBKEY(NULL, &q, n);
        ok = k != NULL && q == der + n;
        EVP_PKEY_free(k);
    }
    OPENSSL_free(name);
    OPENSSL_free(header);
    OPENSSL_free(der);
    BIO_free(bio);
    return ok;
}

/* Why OpenSSL read no key of the kind wanted from pem, naming the usual mix-ups rather than a
 * bare "parse error". */
static const char *unread(const char *pem, size_t len, bool is_private)
{
    if (!is_private && memmem(pem, len, "PRIVATE KEY", 11) != NULL)
        return "expected a public key (BEGIN PUBLIC KEY), got a private key";
    if (is_private && memmem(pem, len, "ENCRYPTED", 9) != NULL)
        return "encrypted private keys are not supported";
    return is_private ? "not a PEM private key (PKCS#8)"
                      : "not a PEM public key (SubjectPublicKeyInfo)";
}

int dp_pem_key(const char *pem, size_t len, bool is_private, EVP_PKEY **out, dp_buf_t *err)
{
    EVP_PKEY *pkey = NULL;
    BIO *bio = NULL;
    const char *why = NULL;
    *out = NULL;
    if (len == 0)
        pem = ""; /* an empty file's buffer may have no bytes at all */
    /* Text with no BEGIN line at all is no PEM (a DER or an SSH key): OpenSSL's reason. */
    if (memmem(pem, len, "-----BEGIN", 10) != NULL && (why = not_alone(pem, len)) != NULL)
        goto refused;
    if (len <= INT32_MAX)
        bio = BIO_new_mem_buf(pem, (int)len);
    if (bio != NULL)
        pkey = is_private ? PEM_read_bio_PrivateKey(bio, NULL, no_passphrase_cb, NULL)
                          : PEM_read_bio_PUBKEY(bio, NULL, no_passphrase_cb, NULL);
    BIO_free(bio);
    if (pkey == NULL) {
        why = unread(pem, len, is_private);
        goto refused;
    }
    if (!one_key(pem, len, is_private)) {
        why = "the PEM block holds more than one key: the file holds one key and nothing else";
        EVP_PKEY_free(pkey);
        pkey = NULL;
        goto refused;
    }
    ERR_clear_error(); /* the queue is per thread: do not leave stale errors for other code */
    *out = pkey;
    return 0;
refused:
    if (err)
        dp_buf_appends(err, why);
    ERR_clear_error();
    return -1;
}

int dp_pem_ed25519(const char *pem, size_t len, bool is_private, EVP_PKEY **out, dp_buf_t *err)
{
    EVP_PKEY *pkey = NULL;
    if (dp_pem_key(pem, len, is_private, &pkey, err) != 0) {
        *out = NULL;
        return -1;
    }
    if (EVP_PKEY_get_id(pkey) != EVP_PKEY_ED25519) {
        const char *t = EVP_PKEY_get0_type_name(pkey);
        if (err)
            dp_buf_printf(err, "key type is %s, expected Ed25519", t ? t : "unknown");
        EVP_PKEY_free(pkey);
        *out = NULL;
        return -1;
    }
    *out = pkey;
    return 0;
}
