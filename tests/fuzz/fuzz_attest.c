/* libFuzzer target for everything in attest/ that reads untrusted bytes: DSSE envelope
 * verification, payload parsing, the native adapters' parsers, and the manifest match and JSON
 * output run on whatever they produce. The first input byte picks the entry point; the rest is
 * the input (adapters: two bodies separated by the first NUL byte).
 *
 * The envelope mode trusts one fixed Ed25519 key and does not require signatures, so unsigned
 * inputs reach the payload parser and signed seeds (tests/fuzz/corpus/attest/) reach the
 * signature check. Invariants asserted: no crash, no leak, a failure always has a reason and
 * leaves the report empty. CHECK, not assert: fuzz builds are RelWithDebInfo (NDEBUG). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attest/adapters.h"
#include "attest/dsse.h"
#include "attest/match.h"

/* The public half of tests/unit/test_attest_dsse.c's K1 test key: corpus seeds are signed by it. */
static const char TRUSTED_PUB[] = "-----BEGIN PUBLIC KEY-----\n"
                                  "MCowBQYDK2VwAyEAYK5Yw9F5FDRzguVPZJKbR25+fNqQzWcRB3t6LTxo3SU=\n"
                                  "-----END PUBLIC KEY-----\n";

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c))                                                                                  \
            abort();                                                                               \
    } while (0)

static attest_keyset_t g_trusted;

static void exercise_report(const attest_report_t *r)
{
    /* Everything a verified report is used for downstream. */
    cfg_manifest_t m = {0};
    m.model = "m";
    m.checkpoint_sha256 = "ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34ab12cd34";
    m.quantization = "awq";
    m.dtype = "float16";
    m.framework_name = "vllm";
    m.framework_version = "0.6.3";
    attest_reasons_t why = {0};
    int n = attest_admit(&m, r, true, &why);
    CHECK(n >= 0 && (size_t)n == why.count);
    dp_buf_t out = {0};
    attest_reasons_join(&why, "; ", &out);
    dp_jw_t w;
    dp_jw_init(&w, &out);
    attest_report_write_json(r, &w, NULL);
    attest_report_t copy;
    attest_report_copy(&copy, r);
    dp_buf_t payload = {0};
    attest_payload_build(&copy, &payload);
    attest_report_clear(&copy);
    attest_reasons_free(&why);
    dp_buf_free(&out);
    dp_buf_free(&payload);
}

static void check_failure(int rc, const attest_report_t *r, const dp_buf_t *why)
{
    if (rc == 0)
        return;
    CHECK(why->len > 0);
    CHECK(r->model == NULL && r->nonce == NULL && r->checkpoint_sha256 == NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (g_trusted.count == 0) {
        attest_key_t *k = NULL;
        if (attest_key_from_pem(TRUSTED_PUB, strlen(TRUSTED_PUB), false, &k, NULL) == 0)
            attest_keyset_add(&g_trusted, k);
    }
    if (size == 0)
        return 0;
    uint8_t mode = data[0] % 8;
    const char *p = (const char *)data + 1;
    size_t n = size - 1;
    attest_report_t r = {0};
    dp_buf_t why = {0};
    int rc = 0;

    switch (mode) {
    case 0:
    case 1: {
        attest_verify_opts_t o = {.trusted = &g_trusted,
                                  .require_signature = mode == 1,
                                  .expected_nonce = mode == 1 ? "n" : NULL};
        rc = attest_envelope_verify(p, n, &o, &r, &why);
        break;
    }
    case 2:
        rc = attest_payload_parse(p, n, &r, &why);
        break;
    default: {
        static const cfg_attest_source_t srcs[] = {CFG_ATTEST_VLLM, CFG_ATTEST_TGI,
                                                   CFG_ATTEST_SGLANG, CFG_ATTEST_LLAMACPP,
                                                   CFG_ATTEST_VLLM};
        const attest_adapter_t *a = attest_adapter_for(srcs[mode - 3]);
        const char *nul = memchr(p, '\0', n);
        dp_iovec_t bodies[2] = {{p, nul ? (size_t)(nul - p) : n}, {NULL, 0}};
        if (nul)
            bodies[1] = (dp_iovec_t){nul + 1, n - (size_t)(nul - p) - 1};
        rc = a->parse(bodies, a->npaths, &r, &why);
        break;
    }
    }
    check_failure(rc, &r, &why);
    if (rc == 0)
        exercise_report(&r);
    attest_report_clear(&r);
    dp_buf_free(&why);
    return 0;
}
