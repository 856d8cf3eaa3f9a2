/* DSSE envelopes and Ed25519 keys: PAE and signature known answers (computed with the openssl
 * CLI when this test was written), the sign/verify round trip, and every rejection. */
#define _GNU_SOURCE
#include <criterion/criterion.h>

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "attest/dsse.h"
#include "common/pem.h"
#include "common/util.h"

/* Fixed test keys (generated with `openssl genpkey -algorithm ED25519`): never used elsewhere. */
static const char K1_PRIV[] = "-----BEGIN PRIVATE KEY-----\n"
                              "MC4CAQAwBQYDK2VwBCIEIB0OoKNzgDa8CsIHV28cp6Ybf9YhYU248/EPoojhf1f8\n"
                              "-----END PRIVATE KEY-----\n";
static const char K1_PUB[] = "-----BEGIN PUBLIC KEY-----\n"
                             "MCowBQYDK2VwAyEAYK5Yw9F5FDRzguVPZJKbR25+fNqQzWcRB3t6LTxo3SU=\n"
                             "-----END PUBLIC KEY-----\n";
static const char K2_PRIV[] = "-----BEGIN PRIVATE KEY-----\n"
                              "MC4CAQAwBQYDK2VwBCIEIIM7zTV1gtnSB78obXY7Pq8UBn7WvO7gTyQzcqpZTbhe\n"
                              "-----END PRIVATE KEY-----\n";
static const char K2_PUB[] = "-----BEGIN PUBLIC KEY-----\n"
                             "MCowBQYDK2VwAyEAAnHjtac+JUGlHn/Rb6GPlrdn6yScIfVc9JYnQ+vRplM=\n"
                             "-----END PUBLIC KEY-----\n";
static const char RSA_PUB[] = "-----BEGIN PUBLIC KEY-----\n"
                              "MIGfMA0GCSqGSIb3DQEBAQUAA4GNADCBiQKBgQDDwaiFa7yfohFOoQuJflvOoLAN\n"
                              "WdDcZ47CAFmmWC7m11lRsUirgHCw2AK/K28ZdasiIJIx6iWxVnYV5daOHulEMzQ+\n"
                              "YHtCd2Gcy+ubxeDt0vTuzhasDCVcipBdfhl21KKVx0+YerL4VI6lhJPMsr97qprd\n"
                              "MvBmE9PyABKGpc7SiwIDAQAB\n"
                              "-----END PUBLIC KEY-----\n";
/* `openssl pkey -pubin -in k1.pub -outform DER | sha256sum` */
#define K1_ID "09f5a8029bb309d196e34a799264863b4240e6e94f98886ee84e1ff90db8ebe4"
#define K2_ID "741c4afec1d663db1937eaaad800628abee3550b397a642b3b245b4ec0edf071"

/* The payload attest_envelope_for builds for kat_report() with nonce "n1" at 2026-01-01, and
 * `openssl pkeyutl -sign -rawin -inkey k1.pem -in PAE | base64` over its DSSE PAE. */
#define KAT_PAYLOAD                                                                                \
    "{\"model\":\"m\",\"checkpoint_sha256\":null,\"quantization\":\"awq\",\"dtype\":"              \
    "\"float16\",\"framework\":{\"name\":\"vllm\",\"version\":\"0.6.3\"},\"nonce\":\"n1\","        \
    "\"issued_at\":\"2026-01-01T00:00:00.000Z\"}"
#define KAT_SIG                                                                                    \
    "NAVaJOketQ4zTaKnlp08mknWUaLVsZi19uEkpDnK5O7hFScdkcfnF09PXfA9LTCgQStkRaHZkdxpZ0kI/iI3Cw=="
#define KAT_MS 1767225600000ull

static attest_key_t *key(const char *pem, bool priv)
{
    attest_key_t *k = NULL;
    dp_buf_t err = {0};
    cr_assert_eq(attest_key_from_pem(pem, strlen(pem), priv, &k, &err), 0, "%s",
                 err.base ? err.base : "");
    dp_buf_free(&err);
    return k;
}

static void kat_report(attest_report_t *r)
{
    memset(r, 0, sizeof(*r));
    attest_report_set(r, ATTEST_F_MODEL, "m");
    attest_report_set(r, ATTEST_F_QUANTIZATION, "awq");
    attest_report_set(r, ATTEST_F_DTYPE, "float16");
    attest_report_set(r, ATTEST_F_FRAMEWORK_NAME, "vllm");
    attest_report_set(r, ATTEST_F_FRAMEWORK_VERSION, "0.6.3");
}

Test(attest_dsse, pae_known_answer)
{
    /* The example from the DSSE specification (protocol.md). */
    dp_buf_t out = {0};
    attest_dsse_pae("http://example.com/HelloWorld", "hello world", 11, &out);
    cr_assert_str_eq(out.base, "DSSEv1 29 http://example.com/HelloWorld 11 hello world");
    dp_buf_reset(&out);
    attest_dsse_pae("t", "", 0, &out);
    cr_assert_str_eq(out.base, "DSSEv1 1 t 0 ");
    dp_buf_free(&out);
}

Test(attest_dsse, keyid_is_sha256_of_spki_der)
{
    attest_key_t *priv = key(K1_PRIV, true), *pub = key(K1_PUB, false);
    cr_assert_str_eq(attest_key_id(priv), K1_ID);
    cr_assert_str_eq(attest_key_id(pub), K1_ID);
    cr_assert(attest_key_is_private(priv));
    cr_assert_not(attest_key_is_private(pub));
    dp_buf_t pem = {0};
    attest_key_public_pem(priv, &pem);
    cr_assert_str_eq(pem.base, K1_PUB);
    dp_buf_free(&pem);
    attest_key_free(priv);
    attest_key_free(pub);
}

Test(attest_dsse, signature_known_answer)
{
    attest_key_t *k = key(K1_PRIV, true);
    attest_report_t r;
    kat_report(&r);
    dp_buf_t env = {0}, err = {0}, b64 = {0};
    cr_assert_eq(attest_envelope_for(k, &r, "n1", KAT_MS, &env, &err), 0);
    dp_base64_encode(KAT_PAYLOAD, strlen(KAT_PAYLOAD), &b64);
    dp_buf_t want = {0};
    dp_buf_printf(&want,
                  "{\"payloadType\":\"application/vnd.detproxy.attestation+json\",\"payload\":"
                  "\"%s\",\"signatures\":[{\"keyid\":\"" K1_ID "\",\"sig\":\"" KAT_SIG "\"}]}",
                  b64.base);
    cr_assert_str_eq(env.base, want.base);
    attest_report_clear(&r);
    attest_key_free(k);
    dp_buf_free(&env);
    dp_buf_free(&err);
    dp_buf_free(&b64);
    dp_buf_free(&want);
}

/* ---- verify ------------------------------------------------------------------------------- */

typedef struct {
    attest_keyset_t trusted;
    attest_key_t *k1, *k2;
} fx_t;

static fx_t fx;

static void fx_init(void)
{
    memset(&fx, 0, sizeof(fx));
    fx.k1 = key(K1_PRIV, true);
    fx.k2 = key(K2_PRIV, true);
    attest_keyset_add(&fx.trusted, key(K1_PUB, false));
}

static void fx_fini(void)
{
    attest_key_free(fx.k1);
    attest_key_free(fx.k2);
    attest_keyset_free(&fx.trusted);
}

TestSuite(attest_verify, .init = fx_init, .fini = fx_fini);

static void signed_env(const attest_key_t *k, const char *nonce, dp_buf_t *env)
{
    attest_report_t r;
    kat_report(&r);
    attest_report_set(&r, ATTEST_F_CHECKPOINT,
                      "ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34");
    cr_assert_eq(attest_envelope_for(k, &r, nonce, 0, env, NULL), 0);
    attest_report_clear(&r);
}

/* Verify and return the reason ("" when it passed). */
static const char *verify(const char *json, bool require, const char *nonce, attest_report_t *r)
{
    static char reason[512];
    dp_buf_t why = {0};
    attest_verify_opts_t o = {
        .trusted = &fx.trusted, .require_signature = require, .expected_nonce = nonce};
    int rc = attest_envelope_verify(json, strlen(json), &o, r, &why);
    snprintf(reason, sizeof(reason), "%s", rc == 0 ? "" : (why.base ? why.base : "(no reason)"));
    cr_assert(rc == 0 || reason[0], "failure without a reason");
    dp_buf_free(&why);
    return reason;
}

Test(attest_verify, round_trip)
{
    dp_buf_t env = {0};
    signed_env(fx.k1, "abc123", &env);
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "abc123", &r), "");
    cr_assert(r.is_signed);
    cr_assert_str_eq(r.keyid, K1_ID);
    cr_assert_str_eq(r.source, "agent");
    cr_assert_str_eq(r.model, "m");
    cr_assert_str_eq(r.quantization, "awq");
    cr_assert_str_eq(r.framework_version, "0.6.3");
    cr_assert_str_eq(r.nonce, "abc123");
    cr_assert_eq(strlen(r.issued_at), 24);
    attest_report_clear(&r);
    dp_buf_free(&env);
}

Test(attest_verify, nonce_mismatch_is_a_replay)
{
    dp_buf_t env = {0};
    signed_env(fx.k1, "old-nonce-1234567890", &env);
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "fresh-nonce-0987654321", &r),
                     "nonce mismatch (replay?): got old-nonc.. want fresh-no..");
    cr_assert_null(r.model, "a rejected report must not leak fields");
    dp_buf_free(&env);
}

Test(attest_verify, untrusted_key)
{
    dp_buf_t env = {0};
    signed_env(fx.k2, "n", &env);
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "n", &r), "signature: key 741c4afe.. not trusted");
    /* Not a silent downgrade either when signatures are optional. */
    cr_assert_str_eq(verify(env.base, false, "n", &r), "signature: key 741c4afe.. not trusted");
    dp_buf_free(&env);
}

/* Replace the first occurrence of from with to in env. */
static void edit(dp_buf_t *env, const char *from, const char *to)
{
    char *p = strstr(env->base, from);
    cr_assert_not_null(p, "%s not in %s", from, env->base);
    dp_buf_t out = {0};
    dp_buf_append(&out, env->base, (size_t)(p - env->base));
    dp_buf_appends(&out, to);
    dp_buf_appends(&out, p + strlen(from));
    dp_buf_free(env);
    *env = out;
}

Test(attest_verify, bad_signature)
{
    dp_buf_t env = {0};
    signed_env(fx.k1, "n", &env);
    /* Flip one character of the signature's base64, keeping it valid base64 of 64 bytes. */
    char *sig = strstr(env.base, "\"sig\":\"") + 7;
    sig[10] = sig[10] == 'A' ? 'B' : 'A';
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "n", &r), "signature: bad signature by key 09f5a802..");
    cr_assert_str_eq(verify(env.base, false, "n", &r),
                     "signature: bad signature by key 09f5a802..");
    dp_buf_free(&env);
}

Test(attest_verify, tampered_payload)
{
    dp_buf_t env = {0}, payload = {0}, b64 = {0};
    signed_env(fx.k1, "n", &env);
    /* Re-encode a payload that says something else, keeping the original signature. */
    char *p = strstr(env.base, "\"payload\":\"") + 11;
    char *end = strchr(p, '"');
    cr_assert_eq(dp_base64_decode(p, (size_t)(end - p), &payload), 0);
    char *q = strstr(payload.base, "awq");
    memcpy(q, "fp8", 3);
    dp_base64_encode(payload.base, payload.len, &b64);
    memcpy(p, b64.base, b64.len);
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "n", &r), "signature: bad signature by key 09f5a802..");
    dp_buf_free(&env);
    dp_buf_free(&payload);
    dp_buf_free(&b64);
}

Test(attest_verify, truncated_signature)
{
    dp_buf_t env = {0};
    signed_env(fx.k1, "n", &env);
    char *sig = strstr(env.base, "\"sig\":\"") + 7;
    char *end = strchr(sig, '"');
    /* Keep 44 base64 chars = 33 bytes: a signature cut short in transit. */
    memmove(sig + 44, end, strlen(end) + 1);
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "n", &r),
                     "signature: malformed or truncated (sig is 33 bytes, want 64)");
    dp_buf_free(&env);
}

Test(attest_verify, missing_signatures)
{
    dp_buf_t env = {0};
    signed_env(fx.k1, "n", &env);
    char *s = strstr(env.base, ",\"signatures\"");
    strcpy(s, "}");
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "n", &r),
                     "signature: missing (require_signature is set)");
    /* Without require_signature an unsigned envelope is accepted, and says so. */
    cr_assert_str_eq(verify(env.base, false, "n", &r), "");
    cr_assert_not(r.is_signed);
    cr_assert_str_eq(r.keyid, "");
    attest_report_clear(&r);
    dp_buf_free(&env);
}

Test(attest_verify, empty_signature_list_is_unsigned)
{
    dp_buf_t env = {0};
    signed_env(fx.k1, "n", &env);
    char *s = strstr(env.base, "[{");
    strcpy(s, "[]}");
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "n", &r),
                     "signature: missing (require_signature is set)");
    dp_buf_free(&env);
}

Test(attest_verify, second_signature_by_trusted_key_is_enough)
{
    /* k2 (untrusted) and k1 (trusted) both sign: accepted on k1's signature. */
    dp_buf_t e1 = {0}, e2 = {0};
    signed_env(fx.k1, "n", &e1);
    char *p1 = strstr(e1.base, "\"payload\":\"") + 11;
    *strchr(p1, '"') = '\0';
    dp_buf_t payload = {0};
    cr_assert_eq(dp_base64_decode(p1, strlen(p1), &payload), 0);
    cr_assert_eq(attest_envelope_sign(fx.k2, payload.base, payload.len, &e2, NULL), 0);
    dp_buf_free(&e1);
    cr_assert_eq(attest_envelope_sign(fx.k1, payload.base, payload.len, &e1, NULL), 0);
    /* Splice k1's signature object after k2's. */
    char *k1sig = strstr(e1.base, "[{") + 1;
    k1sig[strlen(k1sig) - 2] = '\0'; /* drop "]}" */
    char *tail = strstr(e2.base, "}]}");
    dp_buf_t both = {0};
    dp_buf_append(&both, e2.base, (size_t)(tail - e2.base) + 1);
    dp_buf_appendc(&both, ',');
    dp_buf_appends(&both, k1sig);
    dp_buf_appends(&both, "]}");
    attest_report_t r = {0};
    cr_assert_str_eq(verify(both.base, true, "n", &r), "", "%s", both.base);
    cr_assert_str_eq(r.keyid, K1_ID);
    attest_report_clear(&r);
    dp_buf_free(&e1);
    dp_buf_free(&e2);
    dp_buf_free(&both);
    dp_buf_free(&payload);
}

Test(attest_verify, url_safe_unpadded_base64_is_accepted)
{
    dp_buf_t env = {0};
    signed_env(fx.k1, "n", &env);
    for (char *c = strstr(env.base, "\"payload\""); *c; c++) {
        if (*c == '+')
            *c = '-';
        else if (*c == '/')
            *c = '_';
    }
    while (strstr(env.base, "=\""))
        edit(&env, "=\"", "\"");
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "n", &r), "");
    attest_report_clear(&r);
    dp_buf_free(&env);
}

Test(attest_verify, envelope_shape_errors)
{
    attest_report_t r = {0};
    cr_assert_str_eq(verify("garbage", true, NULL, &r), "envelope: not valid JSON");
    cr_assert_str_eq(verify("", true, NULL, &r), "envelope: not valid JSON");
    cr_assert_str_eq(verify("[1,2]", true, NULL, &r), "envelope: expected a JSON object");
    cr_assert_str_eq(verify("{\"payload\":\"e30=\"}", true, NULL, &r),
                     "envelope.payloadType: missing");
    cr_assert_str_eq(
        verify("{\"payloadType\":\"application/json\",\"payload\":\"e30=\"}", true, NULL, &r),
        "envelope.payloadType: expected \"" ATTEST_PAYLOAD_TYPE "\"");
    cr_assert_str_eq(verify("{\"payloadType\":\"" ATTEST_PAYLOAD_TYPE "\"}", true, NULL, &r),
                     "envelope.payload: missing");
    cr_assert_str_eq(verify("{\"payloadType\":\"" ATTEST_PAYLOAD_TYPE "\",\"payload\":\"e3$=\"}",
                            true, NULL, &r),
                     "envelope.payload: bad base64");
    cr_assert_str_eq(
        verify("{\"payloadType\":\"" ATTEST_PAYLOAD_TYPE "\",\"payload\":7}", true, NULL, &r),
        "envelope.payload: expected a string");
    cr_assert_str_eq(verify("{\"payloadType\":\"" ATTEST_PAYLOAD_TYPE
                            "\",\"payload\":\"e30=\",\"signatures\":{}}",
                            true, NULL, &r),
                     "envelope.signatures: expected an array");
    cr_assert_str_eq(verify("{\"payloadType\":\"" ATTEST_PAYLOAD_TYPE
                            "\",\"payload\":\"e30=\",\"signatures\":[{\"keyid\":1}]}",
                            true, NULL, &r),
                     "signature: malformed (signatures[0] needs string keyid and sig)");
    cr_assert_str_eq(
        verify("{\"payloadType\":\"" ATTEST_PAYLOAD_TYPE
               "\",\"payload\":\"e30=\",\"signatures\":[{\"keyid\":\"x\",\"sig\":\"!\"}]}",
               true, NULL, &r),
        "signature: malformed (signatures[0].sig is not base64)");
}

Test(attest_verify, payload_errors_after_a_valid_signature)
{
    static const struct {
        const char *payload;
        const char *reason;
    } cases[] = {
        {"not json", "payload: not valid JSON"},
        {"[]", "payload: expected a JSON object"},
        {"{\"model\":1,\"nonce\":\"n\",\"issued_at\":\"t\"}", "payload.model: expected a string"},
        {"{\"framework\":\"vllm\",\"nonce\":\"n\",\"issued_at\":\"t\"}",
         "payload.framework: expected an object"},
        {"{\"framework\":{\"version\":6},\"nonce\":\"n\",\"issued_at\":\"t\"}",
         "payload.framework.version: expected a string"},
        {"{\"checkpoint_sha256\":\"ABCD\",\"nonce\":\"n\",\"issued_at\":\"t\"}",
         "payload.checkpoint_sha256: expected 64 lowercase hex"},
        {"{\"issued_at\":\"t\"}", "payload.nonce: missing"},
        {"{\"nonce\":\"n\"}", "payload.issued_at: missing"},
        {"{\"nonce\":[],\"issued_at\":\"t\"}", "payload.nonce: expected a string"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        dp_buf_t env = {0};
        cr_assert_eq(
            attest_envelope_sign(fx.k1, cases[i].payload, strlen(cases[i].payload), &env, NULL), 0);
        attest_report_t r = {0};
        cr_assert_str_eq(verify(env.base, true, NULL, &r), cases[i].reason, "case %zu", i);
        dp_buf_free(&env);
    }
}

Test(attest_verify, oversized_envelope)
{
    size_t n = ATTEST_ENVELOPE_MAX_BYTES + 1;
    char *big = malloc(n + 1);
    memset(big, ' ', n);
    big[n] = '\0';
    attest_report_t r = {0};
    cr_assert_str_eq(verify(big, true, NULL, &r), "envelope: too large (65537 bytes, max 65536)");
    free(big);
}

Test(attest_verify, unknown_payload_keys_are_ignored)
{
    const char *p = "{\"model\":\"m\",\"future\":{\"x\":1},\"nonce\":\"n\",\"issued_at\":\"t\"}";
    dp_buf_t env = {0};
    cr_assert_eq(attest_envelope_sign(fx.k1, p, strlen(p), &env, NULL), 0);
    attest_report_t r = {0};
    cr_assert_str_eq(verify(env.base, true, "n", &r), "");
    cr_assert_str_eq(r.model, "m");
    cr_assert_null(r.dtype);
    attest_report_clear(&r);
    dp_buf_free(&env);
}

/* ---- keys --------------------------------------------------------------------------------- */

Test(attest_keys, refuses_wrong_kinds_of_key)
{
    attest_key_t *k = NULL;
    dp_buf_t err = {0};
    cr_assert_neq(attest_key_from_pem(RSA_PUB, strlen(RSA_PUB), false, &k, &err), 0);
    cr_assert_str_eq(err.base, "key type is RSA, expected Ed25519");
    dp_buf_reset(&err);
    cr_assert_neq(attest_key_from_pem(K1_PRIV, strlen(K1_PRIV), false, &k, &err), 0);
    cr_assert_str_eq(err.base, "expected a public key (BEGIN PUBLIC KEY), got a private key");
    dp_buf_reset(&err);
    cr_assert_neq(attest_key_from_pem(K1_PUB, strlen(K1_PUB), true, &k, &err), 0);
    cr_assert_str_eq(err.base, "not a PEM private key (PKCS#8)");
    dp_buf_reset(&err);
    cr_assert_neq(attest_key_from_pem("junk", 4, false, &k, &err), 0);
    cr_assert_null(k);
    dp_buf_reset(&err);
    cr_assert_neq(attest_key_load("/nonexistent/k.pem", false, &k, &err), 0);
    cr_assert_str_eq(err.base, "/nonexistent/k.pem: No such file or directory");
    dp_buf_free(&err);
    /* A public key cannot sign. */
    attest_key_t *pub = key(K1_PUB, false);
    dp_buf_t env = {0};
    err = (dp_buf_t){0};
    cr_assert_neq(attest_envelope_sign(pub, "{}", 2, &env, &err), 0);
    attest_key_free(pub);
    dp_buf_free(&env);
    dp_buf_free(&err);
}

/* The rule `detproxy check` applies to a key file (config/): the PEM block from the first byte,
 * only whitespace after its END line; public and private keys alike. */
Test(attest_keys, a_key_is_its_pem_block_alone)
{
    static const struct {
        const char *before, *key, *after;
    } refused[] = {
        {"garbage\n", K1_PUB, ""}, {" ", K1_PUB, ""},  {"", K1_PUB, "garbage\n"},
        {"", K1_PUB, K2_PUB},      {"x", K1_PRIV, ""}, {"", K1_PRIV, "-----BEGIN"},
    };
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++) {
        char pem[512];
        snprintf(pem, sizeof(pem), "%s%s%s", refused[i].before, refused[i].key, refused[i].after);
        bool priv = refused[i].key == K1_PRIV;
        attest_key_t *k = NULL;
        dp_buf_t err = {0};
        cr_assert_neq(attest_key_from_pem(pem, strlen(pem), priv, &k, &err), 0, "%s", pem);
        cr_assert_null(k);
        cr_assert(strstr(err.base ? err.base : "", refused[i].before[0]
                                                       ? "text before the PEM block"
                                                       : "text after the PEM block's END line"),
                  "%s: %s", pem, err.base);
        dp_buf_free(&err);
    }
    char pem[512];
    snprintf(pem, sizeof(pem), "%s\r\n \t\n", K1_PUB);
    attest_key_free(key(pem, false));
    snprintf(pem, sizeof(pem), "%s\n\n", K1_PRIV);
    attest_key_free(key(pem, true));
}

/* The key file limit `detproxy check` applies (config/): a file of DP_PEM_KEY_MAX bytes, a key
 * and the whitespace after it, loads; one byte more does not. */
Test(attest_keys, a_key_file_is_at_most_the_key_file_limit)
{
    char dir[] = "/tmp/dp-attest-keys-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char path[64];
    snprintf(path, sizeof(path), "%s/k.pub.pem", dir);
    char *text = malloc(DP_PEM_KEY_MAX + 1);
    cr_assert_not_null(text);
    memcpy(text, K1_PUB, strlen(K1_PUB));
    memset(text + strlen(K1_PUB), '\n', DP_PEM_KEY_MAX + 1 - strlen(K1_PUB));
    for (size_t n = DP_PEM_KEY_MAX; n <= DP_PEM_KEY_MAX + 1; n++) {
        FILE *f = fopen(path, "wb");
        cr_assert_not_null(f);
        cr_assert_eq(fwrite(text, 1, n, f), n);
        fclose(f);
        attest_key_t *k = NULL;
        dp_buf_t err = {0};
        int rc = attest_key_load(path, false, &k, &err);
        if (n == DP_PEM_KEY_MAX) {
            cr_assert_eq(rc, 0, "%s", err.base ? err.base : "");
        } else {
            cr_assert_neq(rc, 0);
            cr_assert(strstr(err.base, "too large for a key file"), "%s", err.base);
        }
        attest_key_free(k);
        dp_buf_free(&err);
    }
    free(text);
    unlink(path);
    rmdir(dir);
}

Test(attest_keys, keyset_deduplicates)
{
    attest_keyset_t ks = {0};
    attest_keyset_add(&ks, key(K1_PUB, false));
    attest_keyset_add(&ks, key(K1_PUB, false));
    attest_keyset_add(&ks, key(K2_PUB, false));
    cr_assert_eq(ks.count, 2);
    cr_assert_not_null(attest_keyset_find(&ks, K2_ID));
    cr_assert_null(attest_keyset_find(&ks, "00"));
    attest_keyset_free(&ks);
}

Test(attest_keys, keygen_writes_a_usable_pair_and_never_overwrites)
{
    char dir[] = "/tmp/dp-attest-keys-XXXXXX";
    cr_assert_not_null(mkdtemp(dir));
    char prefix[128], kp[160], pp[160];
    snprintf(prefix, sizeof(prefix), "%s/pipeline", dir);
    snprintf(kp, sizeof(kp), "%s.key.pem", prefix);
    snprintf(pp, sizeof(pp), "%s.pub.pem", prefix);
    mode_t old = umask(0);
    char id[65];
    dp_buf_t err = {0};
    cr_assert_eq(attest_keygen(prefix, id, &err), 0, "%s", err.base ? err.base : "");
    umask(old);
    struct stat st;
    cr_assert_eq(stat(kp, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0600);
    cr_assert_eq(stat(pp, &st), 0);
    cr_assert_eq(st.st_mode & 0777, 0644);

    attest_key_t *priv = NULL, *pub = NULL;
    cr_assert_eq(attest_key_load(kp, true, &priv, NULL), 0);
    cr_assert_eq(attest_key_load(pp, false, &pub, NULL), 0);
    cr_assert_str_eq(attest_key_id(priv), id);
    cr_assert_str_eq(attest_key_id(pub), id);
    dp_buf_t pem = {0};
    cr_assert_eq(dp_read_file(kp, 4096, &pem), 0);
    cr_assert(strstr(pem.base, "-----BEGIN PRIVATE KEY-----"), "PKCS#8 expected");
    dp_buf_free(&pem);

    cr_assert_eq(attest_keygen(prefix, NULL, &err), -EEXIST);
    cr_assert(strstr(err.base, "already exists"), "%s", err.base);
    attest_key_t *again = NULL;
    cr_assert_eq(attest_key_load(kp, true, &again, NULL), 0);
    cr_assert_str_eq(attest_key_id(again), id, "existing key must be left untouched");

    attest_key_free(priv);
    attest_key_free(pub);
    attest_key_free(again);
    dp_buf_free(&err);
    unlink(kp);
    unlink(pp);
    rmdir(dir);
}

Test(attest_keys, nonce_charset)
{
    cr_assert(attest_nonce_valid("abc-DEF_0.9~", 12));
    cr_assert_not(attest_nonce_valid("", 0));
    cr_assert_not(attest_nonce_valid("a b", 3));
    cr_assert_not(attest_nonce_valid("a%20", 4));
    char long_nonce[130];
    memset(long_nonce, 'a', sizeof(long_nonce));
    cr_assert(attest_nonce_valid(long_nonce, 128));
    cr_assert_not(attest_nonce_valid(long_nonce, 129));
    /* The copy a server answers with: only of a valid nonce, NUL-terminated at its length. */
    char out[ATTEST_NONCE_MAX + 1];
    memset(out, 'z', sizeof(out));
    cr_assert(attest_nonce_copy("n-1xyz", 3, out));
    cr_assert_str_eq(out, "n-1");
    cr_assert(attest_nonce_copy(long_nonce, 128, out));
    cr_assert_eq(strlen(out), 128);
    memset(out, 'z', sizeof(out));
    cr_assert_not(attest_nonce_copy(long_nonce, 129, out));
    cr_assert_not(attest_nonce_copy("a b", 3, out));
    cr_assert_eq(out[0], 'z'); /* nothing written for a refused one */
}
