/* libFuzzer target: the policy module against its oracle, the implementation it replaced
 * (tests/oracle/). Every disagreement tests/oracle/diff.h defines (accept/refuse, error, seed,
 * forwarded bytes, canonical form, response fingerprint) aborts with the reason on stderr.
 * Where the CPU has AVX-512, the oracle is asked again with the AVX2 string scanner (the same
 * block loop at another width). The parse at every vector level is checked against the byte
 * loop's on every input as well: verdict, error, its byte and the token tape (a vector level
 * scans a string it refuses again with the checking path, so a false refusal there would cost
 * time, not a wrong answer).
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
        /* The body's parse at every vector level against the byte loop's: verdict, error and
         * its byte, tape. */
        jdoc_t ref, got;
        jdoc_simd_select(JDOC_SIMD_SCALAR);
        jdoc_init(&ref);
        int rc_ref = jdoc_parse(&ref, (const char *)copy + 1, size - 1, JDOC_OBJECT_ONLY);
        for (int level = JDOC_SIMD_SSE2; level <= top; level++) {
            jdoc_simd_select(level);
            jdoc_init(&got);
            int rc = jdoc_parse(&got, (const char *)copy + 1, size - 1, JDOC_OBJECT_ONLY);
            bool same = rc == rc_ref && got.ntoks == ref.ntoks &&
                        (rc == 0 || (strcmp(got.err, ref.err) == 0 && got.err_at == ref.err_at));
            for (uint32_t k = 0; same && rc == 0 && k < ref.ntoks; k++)
                same = got.toks[k].start == ref.toks[k].start &&
                       got.toks[k].len == ref.toks[k].len && got.toks[k].flags == ref.toks[k].flags;
            if (!same) {
                fprintf(stderr,
                        "parse differs at level %d: %d %s at %zu / byte loop %d %s at %zu\n", level,
                        rc, rc ? got.err : "-", got.err_at, rc_ref, rc_ref ? ref.err : "-",
                        ref.err_at);
                abort();
            }
            jdoc_free(&got);
        }
        jdoc_free(&ref);
        jdoc_simd_select(JDOC_SIMD_BEST);
    }
    free(copy);
    return 0;
}
