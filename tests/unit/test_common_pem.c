/* The key file rule (common/pem.h): a key's PEM block alone, whatever the key's type, for the
 * Ed25519 keys of agents, trust and the audit trail and the EC keys of OMS publishers alike. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <string.h>

#include <openssl/evp.h>
#include <openssl/pem.h>

#include "common/pem.h"

static const char P256_PUB[] = "-----BEGIN PUBLIC KEY-----\n"
                               "MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEcPtnmPlDLUiBJbpaz/Oz4JDi8bAo\n"
                               "sz0Eimbc5ZZh+Uv97rxuRuBogIlHTtuM8Jc/NHNkduaC1wE587YS95dw/g==\n"
                               "-----END PUBLIC KEY-----\n";
static const char ED25519_PUB[] = "-----BEGIN PUBLIC KEY-----\n"
                                  "MCowBQYDK2VwAyEAEnjhciCF9AXGi2bWLsyssO6DzbvlGSoDbYl+yvxgg4s=\n"
                                  "-----END PUBLIC KEY-----\n";

/* dp_pem_key on before + key + after: 0 with the key's type in *id, or -1 with why in *err. */
static int read_key(const char *before, const char *key, const char *after, int *id, dp_buf_t *err)
{
    char pem[1024];
    snprintf(pem, sizeof(pem), "%s%s%s", before, key, after);
    EVP_PKEY *k = NULL;
    int rc = dp_pem_key(pem, strlen(pem), false, &k, err);
    cr_assert_eq(rc == 0, k != NULL);
    *id = k ? EVP_PKEY_get_id(k) : 0;
    EVP_PKEY_free(k);
    return rc;
}

Test(pem, a_key_of_any_type_is_its_pem_block_alone)
{
    static const struct {
        const char *before, *after, *why;
    } refused[] = {
        {"garbage\n", "", "text before the PEM block"},
        {"\n", "", "text before the PEM block"},
        {"", "garbage\n", "text after the PEM block's END line"},
        {"", ED25519_PUB, "text after the PEM block's END line"},
        /* OpenSSL skips a first line that is no BEGIN line of its form, and what follows up
         * to the next: such a line is no PEM block's start. */
        {"-----BEGIN anything\njunk lines\n", "", "the first line is not a PEM BEGIN line"},
        {"-----BEGIN X-----junk\n", "", "text after the PEM BEGIN line on its line"},
        {"-----BEGIN X-----\n-----END Y-----\n", "", "does not name its BEGIN line's label"},
    };
    const char *keys[] = {P256_PUB, ED25519_PUB};
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        for (size_t j = 0; j < sizeof(refused) / sizeof(refused[0]); j++) {
            dp_buf_t err = {0};
            int id;
            cr_assert_neq(read_key(refused[j].before, keys[i], refused[j].after, &id, &err), 0,
                          "%zu %zu", i, j);
            cr_assert(strstr(err.base ? err.base : "", refused[j].why), "%zu %zu: %s", i, j,
                      err.base);
            dp_buf_free(&err);
        }
    }
    int id;
    cr_assert_eq(read_key("", P256_PUB, " \r\n\t\n", &id, NULL), 0);
    char crlf[512];
    size_t k = 0;
    for (const char *c = P256_PUB; *c; c++) {
        if (*c == '\n')
            crlf[k++] = '\r';
        crlf[k++] = *c;
    }
    crlf[k] = '\0';
    cr_assert_eq(read_key("", crlf, "", &id, NULL), 0, "CRLF line ends");
    cr_assert_eq(id, EVP_PKEY_EC);
    cr_assert_eq(read_key("", ED25519_PUB, "", &id, NULL), 0);
    cr_assert_eq(id, EVP_PKEY_ED25519);
}

/* The DER of a PEM text's block (the caller frees it). */
static unsigned char *der_of(const char *pem, long *n)
{
    BIO *b = BIO_new_mem_buf(pem, -1);
    char *name = NULL, *header = NULL;
    unsigned char *der = NULL;
    cr_assert_eq(PEM_read_bio(b, &name, &header, &der, n), 1);
    OPENSSL_free(name);
    OPENSSL_free(header);
    BIO_free(b);
    return der;
}

Test(pem, a_block_holds_one_key)
{
    /* Two keys' DER in one block: OpenSSL reads the first and ignores the rest, where
     * python-cryptography refuses the block ("extra data"). */
    long n1, n2;
    unsigned char *a = der_of(P256_PUB, &n1), *b = der_of(ED25519_PUB, &n2);
    unsigned char both[512];
    memcpy(both, a, (size_t)n1);
    memcpy(both + n1, b, (size_t)n2);
    unsigned char b64[1024];
    int m = EVP_EncodeBlock(b64, both, (int)(n1 + n2));
    char pem[1200];
    int k = snprintf(pem, sizeof(pem), "-----BEGIN PUBLIC KEY-----\n");
    for (int i = 0; i < m; i += 64)
        k += snprintf(pem + k, sizeof(pem) - (size_t)k, "%.64s\n", (const char *)b64 + i);
    snprintf(pem + k, sizeof(pem) - (size_t)k, "-----END PUBLIC KEY-----\n");
    EVP_PKEY *key = NULL;
    dp_buf_t err = {0};
    cr_assert_eq(dp_pem_key(pem, strlen(pem), false, &key, &err), -1);
    cr_assert_null(key);
    cr_assert(strstr(err.base, "holds more than one key"), "%s", err.base);
    dp_buf_free(&err);
    OPENSSL_free(a);
    OPENSSL_free(b);
}

Test(pem, only_dp_pem_ed25519_asks_for_ed25519)
{
    EVP_PKEY *k = NULL;
    dp_buf_t err = {0};
    cr_assert_neq(dp_pem_ed25519(P256_PUB, strlen(P256_PUB), false, &k, &err), 0);
    cr_assert_null(k);
    cr_assert_str_eq(err.base, "key type is EC, expected Ed25519");
    dp_buf_reset(&err);
    cr_assert_neq(dp_pem_ed25519("junk", 4, false, &k, &err), 0);
    cr_assert_str_eq(err.base, "not a PEM public key (SubjectPublicKeyInfo)");
    dp_buf_free(&err);
    cr_assert_eq(dp_pem_ed25519(ED25519_PUB, strlen(ED25519_PUB), false, &k, NULL), 0);
    EVP_PKEY_free(k);
}
