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

/* NULL when pem[0..len) starts with a PEM block and has only whitespace after that block's END
 * line; else what is wrong. The first "-----END " line ends the block that starts at the first
 * byte: a later block is text after it. Whether the block is a key is OpenSSL's to say. */
static const char *not_alone(const char *pem, size_t len)
{
    static const char begin[] = "-----BEGIN", end[] = "\n-----END ";
    if (len < sizeof(begin) - 1 || memcmp(pem, begin, sizeof(begin) - 1) != 0)
        return "text before the PEM block: the file must start with -----BEGIN";
    const char *stop = pem + len;
    const char *p = memmem(pem, len, end, sizeof(end) - 1);
    p = p ? memmem(p + sizeof(end) - 1, (size_t)(stop - p) - (sizeof(end) - 1), "-----", 5) : NULL;
    if (p == NULL)
        return "no END line after the PEM block";
    for (p += 5; p < stop; p++)
        if (*p != ' ' && *p != '\t' && *p != '\r' && *p != '\n')
            return "text after the PEM block's END line: the file holds one key and nothing else";
    return NULL;
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
