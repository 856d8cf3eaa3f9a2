/* The policy module against its oracle (tests/oracle/, the implementation it replaced) on a
 * fixed corpus: every seed of the policy fuzz targets and the bench bodies, each under every
 * selector byte (all routes, tenants and frameworks), plus hand-written bodies for the splice
 * rewrite's edges. The disagreements checked are those of tests/oracle/diff.h. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/jdoc.h"
#include "tests/oracle/diff.h"

static void check_all_selectors(const char *what, const char *body, size_t n)
{
    uint8_t *in = malloc(n + 1);
    memcpy(in + 1, body, n);
    char why[1024];
    for (int sel = 0; sel < 256; sel++) {
        in[0] = (uint8_t)sel;
        int rc = diff_check(in, n + 1, why, sizeof(why));
        cr_assert_eq(rc, 0, "%s, selector %d: %s", what, sel, why);
    }
    free(in);
}

static char *slurp(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    cr_assert_not_null(f, "%s", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)len + 1);
    cr_assert_eq(fread(b, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    *n = (size_t)len;
    return b;
}

static void corpus_dir(const char *dir)
{
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "%s", dir);
    struct dirent *e;
    int files = 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.')
            continue;
        char path[1024];
        snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
        size_t n;
        char *b = slurp(path, &n);
        /* the seed's own first byte selects in the fuzzer; here every selector is tried */
        if (n > 0)
            check_all_selectors(path, b + 1, n - 1);
        check_all_selectors(path, b, n);
        free(b);
        files++;
    }
    closedir(d);
    cr_assert_gt(files, 5, "%s: %d seeds", dir, files);
}

Test(oracle, fuzz_seed_corpus)
{
    corpus_dir(DP_SOURCE_DIR "/tests/fuzz/corpus/policy");
    corpus_dir(DP_SOURCE_DIR "/tests/fuzz/corpus/policy_oracle");
}

Test(oracle, bench_bodies)
{
    const char *files[] = {DP_SOURCE_DIR "/bench/chat_1k.json",
                           DP_SOURCE_DIR "/bench/chat_stream.json"};
    for (size_t i = 0; i < sizeof(files) / sizeof(files[0]); i++) {
        size_t n;
        char *b = slurp(files[i], &n);
        check_all_selectors(files[i], b, n);
        free(b);
    }
}

/* The splice rewrite's edges: removals first, last, in the middle and in a row, with and
 * without client whitespace, additions after them, and every value shape before a change. */
Test(oracle, splice_edges)
{
    static const char *const bodies[] = {
        "{\"model\":\"m\",\"prompt\":\"p\"}",
        "{ \"model\" : \"m\" , \"prompt\" : \"p\" }",
        "\n{\"model\":\"m\",\"prompt\":\"p\",\"temperature\":0.3}\n",
        "{\"top_p\":1,\"model\":\"m\",\"prompt\":\"p\"}",
        "{\"top_p\":1 , \"presence_penalty\":0 ,\"model\":\"m\",\"prompt\":\"p\"}",
        "{\"model\":\"m\",\"top_p\":1,\"presence_penalty\":0,\"prompt\":\"p\"}",
        "{\"model\":\"m\",\"prompt\":\"p\",\"top_p\":1,\"presence_penalty\":0}",
        "{\"model\":\"m\",\"prompt\":\"p\", \"top_p\" : 1 , \"presence_penalty\" : 0 }",
        "{\"model\":\"m\",\"prompt\":\"p\",\"top_k\":5,\"temperature\":null,\"seed\":null}",
        "{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}],\"n\":3,"
        "\"max_tokens\":9999,\"max_completion_tokens\":0,\"n_predict\":5}",
        "{\"model\":\"m\",\"input\":\"q\",\"max_output_tokens\":9999,\"temperature\":1.5}",
        "{\"model\":\"m\",\"prompt\":\"p\",\"cache_prompt\":true,\"seed\":99999999999}",
        "{\"model\":\"m\",\"prompt\":[1,2,3],\"top_p\":1,\"x\":{\"b\":1,\"a\":[1e400]}}",
        "{\"model\":\"m\",\"prompt\":[1,2,3],\"top_p\":1,\"x\":{\"b\":1,\"a\":[1e30,-0,0.1]}}",
        "{\"m\\u006fdel\":\"m\",\"pr\\u006fmpt\":\"\\ud83d\\ude00\",\"top_p\":0.999}",
        "{\"model\":\"m\",\"prompt\":\"p\",\"\\u0074op_p\":1}",
        "{\"model\":\"m\",\"prompt\":\"p\",\"temperature\":0,\"temperature\\u0000\":1}",
    };
    for (size_t i = 0; i < sizeof(bodies) / sizeof(bodies[0]); i++)
        check_all_selectors(bodies[i], bodies[i], strlen(bodies[i]));
}

/* A response or usage object with more tokens than the parsers' stack arrays (they move to the
 * heap mid-parse): same rewrite as the oracle's, and the usage scanner still reads it. */
Test(oracle, past_the_stack_token_arrays)
{
    dp_buf_t b = {0};
    dp_buf_appends(&b, "{\"id\":\"x\",\"choices\":[");
    for (int i = 0; i < 400; i++)
        dp_buf_appends(&b, i ? ",{\"i\":1}" : "{\"i\":1}");
    dp_buf_appends(&b, "],\"system_fingerprint\":\"fp_up\",\"usage\":{\"prompt_tokens\":7,");
    for (int i = 0; i < 40; i++)
        dp_buf_appends(&b, "\"x\":[1,2],");
    dp_buf_appends(&b, "\"completion_tokens\":3}}");
    check_all_selectors("large response", b.base, b.len);
    policy_usage_t u;
    memset(&u, 0, sizeof(u));
    policy_usage_feed(&u, b.base, b.len);
    cr_assert(u.found);
    cr_assert_eq(u.prompt_tokens, 7);
    cr_assert_eq(u.completion_tokens, 3);
    dp_buf_free(&b);
}

/* A long prompt's strings take the SIMD scanning and the streamed digest: the seed must still
 * be the oracle's. */
Test(oracle, long_prompt)
{
    dp_buf_t b = {0};
    dp_buf_appends(&b, "{\"model\":\"m\",\"messages\":[");
    for (int i = 0; i < 300; i++) {
        if (i)
            dp_buf_appendc(&b, ',');
        dp_buf_appends(&b, "{\"role\":\"user\",\"content\":\"");
        for (int k = 0; k < 40; k++)
            dp_buf_appends(&b, k % 7 == 3 ? "caf\xc3\xa9 \\\"quoted\\\" \\u00e9\\n"
                                          : "plain ascii words of a long prompt ");
        dp_buf_appends(&b, "\"}");
    }
    dp_buf_appends(&b, "],\"temperature\":0.9}");
    check_all_selectors("long prompt", b.base, b.len);
    dp_buf_free(&b);
}

/* Every string-scanning path (AVX2, SSE2, eight bytes at a time; those the CPU has) against
 * the oracle, with each kind of byte that ends a plain run at every offset across two vector
 * widths, and the corpus again. */
Test(oracle, every_simd_level)
{
    static const char *const specials[] = {"\"",   "\\n",          "\\u00e9", "\xc3\xa9", "\x01",
                                           "\xff", "\xed\xa0\x80", "\x7f",    "\x1f",     "\\"};
    for (int level = JDOC_SIMD_SCALAR; level <= JDOC_SIMD_AVX2; level++) {
        int got = jdoc_simd_select(level);
        cr_assert(got <= level);
        for (size_t s = 0; s < sizeof(specials) / sizeof(specials[0]); s++) {
            for (int off = 0; off < 70; off++) {
                dp_buf_t b = {0};
                dp_buf_appends(&b, "{\"model\":\"m\",\"prompt\":\"");
                for (int k = 0; k < off; k++)
                    dp_buf_appendc(&b, (char)('a' + k % 26));
                dp_buf_appends(&b, specials[s]);
                dp_buf_appends(&b, "tail of the string, long enough for a vector\"}");
                char why[1024];
                uint8_t *in = malloc(b.len + 1);
                memcpy(in + 1, b.base, b.len);
                in[0] = 0x00; /* completions, the bench tenant */
                cr_assert_eq(diff_check(in, b.len + 1, why, sizeof(why)), 0,
                             "level %d, special %zu at %d: %s", got, s, off, why);
                free(in);
                dp_buf_free(&b);
            }
        }
        corpus_dir(DP_SOURCE_DIR "/tests/fuzz/corpus/policy");
    }
    jdoc_simd_select(JDOC_SIMD_AVX2);
}
