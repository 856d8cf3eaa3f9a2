/* libFuzzer target: the policy module against its oracle, the implementation it replaced
 * (tests/oracle/). Every disagreement tests/oracle/diff.h defines (accept/refuse, error, seed,
 * forwarded bytes, canonical form, response fingerprint) aborts with the reason on stderr.
 * Where the CPU has AVX-512, the oracle is asked again with the AVX2 string scanner (the same
 * block loop at another width). The vector UTF-8 validator is checked against the byte loop on
 * every input as well (the parse falls back to the checking path when it refuses, so only
 * this sees a false refusal).
 * Input: byte 0 selects route, tenant and framework; the rest is the body. Seed corpus:
 * tests/fuzz/corpus/policy/ (the module's) and tests/fuzz/corpus/policy_oracle/. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/jdoc.h"
#include "tests/oracle/diff.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char why[1024];
    /* A private copy: the fuzzer's buffer has no slack after it, so overreads show. */
    uint8_t *copy = malloc(size ? size : 1);
    memcpy(copy, data, size);
    if (diff_check(copy, size, why, sizeof(why)) != 0) {
        fprintf(stderr, "oracle disagreement: %s\n", why);
        abort();
    }
    int top = jdoc_simd_select(JDOC_SIMD_BEST);
    if (top > JDOC_SIMD_AVX2) {
        jdoc_simd_select(JDOC_SIMD_AVX2);
        int rc = diff_check(copy, size, why, sizeof(why));
        jdoc_simd_select(JDOC_SIMD_BEST);
        if (rc != 0) {
            fprintf(stderr, "oracle disagreement at the AVX2 level: %s\n", why);
            abort();
        }
    }
    if (size > 0 && top >= JDOC_SIMD_AVX2) {
        jdoc_simd_select(JDOC_SIMD_SCALAR);
        bool bytes = jdoc_utf8_valid((const char *)copy + 1, size - 1);
        for (int level = JDOC_SIMD_AVX2; level <= top; level++) {
            jdoc_simd_select(level);
            bool vec = jdoc_utf8_valid((const char *)copy + 1, size - 1);
            if (vec != bytes) {
                fprintf(stderr, "UTF-8 validators disagree: level %d %d, byte loop %d\n", level,
                        vec, bytes);
                abort();
            }
        }
        jdoc_simd_select(JDOC_SIMD_BEST);
    }
    free(copy);
    return 0;
}
