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

/* Each of n NUL-terminated bodies under every selector. */
static void check_strings(const char *const *bodies, size_t n)
{
    for (size_t i = 0; i < n; i++)
        check_all_selectors(bodies[i], bodies[i], strlen(bodies[i]));
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
    check_strings(bodies, sizeof(bodies) / sizeof(bodies[0]));
}

/* Response shapes where a usage read from the parse's top level and the scan could differ:
 * a held body must count what the scan counts. */
Test(oracle, usage_shapes)
{
    static const char *const bodies[] = {
        "{\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":5},\"choices\":[{\"usage\":"
        "{\"prompt_tokens\":9,\"completion_tokens\":9}}]}",
        "{\"choices\":[{\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}],\"usage\":{}}",
        "{\"usage\":{\"prompt_tokens\":\"7\"},\"x\":{\"usage\":{\"prompt_tokens\":7}}}",
        "{\"us\\u0061ge\":{\"prompt_tokens\":10,\"completion_tokens\":5}}",
        "{\"usage\":{\"prompt_tokens\":1},\"usage\":{\"prompt_tokens\":2}}",
        "{\"system_fingerprint\":{\"usage\":{\"prompt_tokens\":3}}}",
        "{\"usage\":{\"prompt_tokens\":4,\"prompt_tokens\":5,\"completion_tokens\":6}}",
    };
    check_strings(bodies, sizeof(bodies) / sizeof(bodies[0]));
    char big[1024];
    int n = snprintf(big, sizeof(big), "{\"usage\":{\"d\":\"%0600d\",\"prompt_tokens\":10}}", 0);
    check_all_selectors(big, big, (size_t)n);
    /* The usage copy fills on the quote that ends a string: both scan that byte on, and find
     * the top-level usage after it (x, not digits: a long run of digits is no plain number). */
    char pad[507];
    memset(pad, 'x', 506);
    pad[506] = '\0';
    n = snprintf(big, sizeof(big),
                 "{\"choices\":[{\"usage\":{\"a\":\"%s\"}}],\"usage\":"
                 "{\"prompt_tokens\":7,\"completion_tokens\":3}}",
                 pad);
    check_all_selectors(big, big, (size_t)n);
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
    policy_usage_free(&u);
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

/* Every string-scanning path (AVX-512, AVX2, SSE2, eight bytes at a time; those the CPU has)
 * against the oracle, with each kind of byte that ends a plain run, and each shape of
 * backslash run, at every offset across the first three 64-byte blocks (the plain blocks before
 * it passed over by their own loop), with the string's end far from the document's and right
 * before it, and the corpus again. */
Test(oracle, every_simd_level)
{
    static const char *const specials[] = {"\"",
                                           "\\n",
                                           "\\u00e9",
                                           "\xc3\xa9",
                                           "\x01",
                                           "\xff",
                                           "\xed\xa0\x80",
                                           "\x7f",
                                           "\x1f",
                                           "\\",
                                           "\\\\",
                                           "\\\"",
                                           "\\\\\\\"",
                                           "\\/",
                                           "\\x",
                                           "\\\\\\n",
                                           "\\\\\\\\\\\\\\\\",
                                           "\\ud83d\\ude00"};
    for (int level = JDOC_SIMD_SCALAR; level <= JDOC_SIMD_BEST; level++) {
        int got = jdoc_simd_select(level);
        cr_assert(got <= level);
        for (size_t s = 0; s < sizeof(specials) / sizeof(specials[0]); s++) {
            for (int off = 0; off < 200 * 2; off++) {
                dp_buf_t b = {0};
                dp_buf_appends(&b, "{\"model\":\"m\",\"prompt\":\"");
                for (int k = 0; k < off / 2; k++)
                    dp_buf_appendc(&b, (char)('a' + k % 26));
                dp_buf_appends(&b, specials[s]);
                dp_buf_appends(&b,
                               off % 2 ? "\"}" : "tail of the string, long enough for a vector\"}");
                char why[1024];
                uint8_t *in = malloc(b.len + 1);
                memcpy(in + 1, b.base, b.len);
                in[0] = 0x00; /* completions, the bench tenant */
                cr_assert_eq(diff_check(in, b.len + 1, why, sizeof(why)), 0,
                             "level %d, special %zu at %d%s: %s", got, s, off / 2,
                             off % 2 ? ", string at the end" : "", why);
                free(in);
                dp_buf_free(&b);
            }
        }
        corpus_dir(DP_SOURCE_DIR "/tests/fuzz/corpus/policy");
    }
    jdoc_simd_select(JDOC_SIMD_BEST);
}

/* The parse of body at `level` under `budget`: verdict, error and its byte, whether the budget
 * stopped it, and the token tape (spans and the escape flags the canonical form reads). */
typedef struct {
    int rc;
    const char *err;
    size_t at;
    bool over;
    uint32_t ntoks;
    jtok_t toks[64];
} parsed_t;

static void parse_full(int level, const char *body, size_t n, uint32_t budget, parsed_t *out)
{
    jdoc_simd_select(level);
    jdoc_t d;
    jdoc_init(&d);
    d.budget = budget;
    memset(out, 0, sizeof(*out));
    out->rc = jdoc_parse(&d, body, n, JDOC_OBJECT_ONLY);
    out->err = d.err;
    out->at = d.err_at;
    out->over = jdoc_over_budget(&d);
    out->ntoks = out->rc == 0 ? d.ntoks : 0;
    for (uint32_t k = 0; k < out->ntoks && k < 64; k++)
        out->toks[k] = d.toks[k];
    jdoc_free(&d);
}

/* The same verdict, error and its byte, budget stop and token tape? */
static bool same_parse(const parsed_t *got, const parsed_t *want)
{
    bool same = got->rc == want->rc && got->over == want->over && got->ntoks == want->ntoks &&
                (want->rc == 0 || (strcmp(got->err, want->err) == 0 && got->at == want->at));
    for (uint32_t k = 0; same && k < want->ntoks && k < 64; k++)
        same = got->toks[k].start == want->toks[k].start && got->toks[k].len == want->toks[k].len &&
               got->toks[k].flags == want->toks[k].flags;
    return same;
}

/* Strings drawn from the bytes that steer the block scanner (quotes, backslash runs, escape
 * letters, controls, '/', 'u' and hex digits, non-ASCII) at random lengths and offsets, so
 * that escapes, runs and closing quotes fall on every side of a 64-byte boundary: every level
 * gives the verdict, error, error byte, budget stop and token tape of the byte loop (with a
 * budget, of the AVX2 loop: see below), with no budget and with budgets that run out inside the
 * strings. */
Test(oracle, random_escape_runs_agree_at_every_level)
{
    static const char *const atoms[] = {"\\\\",
                                        "\\n",
                                        "\\\"",
                                        "\\t",
                                        "\\/",
                                        "\\u00e9",
                                        "\\ud83d\\ude00",
                                        "\\",
                                        "\"",
                                        "n",
                                        "t",
                                        "/",
                                        "u",
                                        "0",
                                        "\x01",
                                        "\xc3\xa9",
                                        " ",
                                        "xyz",
                                        "abcdefghijklmnop",
                                        "abcdefghijklmnopqrstuvwxyz012345"};
    const size_t natoms = sizeof(atoms) / sizeof(atoms[0]);
    uint64_t rng = 0x9e3779b97f4a7c15ull;
    size_t accepted = 0, refused = 0, stopped = 0;
    parsed_t *ref = malloc(sizeof(*ref)), *vec = malloc(sizeof(*vec)), *got = malloc(sizeof(*got));
    for (int round = 0; round < 20000; round++) {
        dp_buf_t b = {0};
        dp_buf_appends(&b, "{\"model\":\"m\",\"p\":\"");
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t pad = (size_t)(rng >> 33) % 80, natom = 1 + (size_t)(rng >> 45) % 40;
        for (size_t k = 0; k < pad; k++)
            dp_buf_appendc(&b, 'p');
        for (size_t k = 0; k < natom; k++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            dp_buf_appends(&b, atoms[(rng >> 33) % natoms]);
        }
        dp_buf_appends(&b, "\",\"q\":\"");
        for (size_t k = 0; k < 70; k++)
            dp_buf_appendc(&b, (char)('a' + k % 26));
        dp_buf_appends(&b, "\"}");
        /* budgets: none, and from 5 values' worth (the escapes run it out) up */
        uint32_t budget = round % 3 == 0 ? UINT32_MAX : 40 + (uint32_t)(rng >> 40) % 40;
        parse_full(JDOC_SIMD_SCALAR, b.base, b.len, budget, ref);
        parse_full(JDOC_SIMD_AVX2, b.base, b.len, budget, vec);
        for (int level = JDOC_SIMD_SSE2; level <= JDOC_SIMD_BEST; level++) {
            parse_full(level, b.base, b.len, budget, got);
            /* With a budget, the levels that validate UTF-8 as they scan (AVX2 and above) charge
             * nothing for a multi-byte character (docs/policy.md): they answer as AVX2 does. */
            const parsed_t *want = budget != UINT32_MAX && level >= JDOC_SIMD_AVX2 ? vec : ref;
            if (!same_parse(got, want))
                cr_assert_fail("level %d, budget %u, body %.*s: %d %s at %zu (over %d, %u tokens)"
                               " / reference %d %s at %zu (over %d, %u tokens)",
                               level, budget, (int)b.len, b.base, got->rc, got->rc ? got->err : "-",
                               got->at, got->over, got->ntoks, want->rc, want->rc ? want->err : "-",
                               want->at, want->over, want->ntoks);
        }
        accepted += ref->rc == 0;
        stopped += ref->over;
        refused += ref->rc != 0 && !ref->over;
        dp_buf_free(&b);
    }
    free(ref);
    free(vec);
    free(got);
    jdoc_simd_select(JDOC_SIMD_BEST);
    /* all three outcomes, each in numbers: a scanner that refused or accepted everything, or
     * a budget that never ran out, fails here */
    cr_log_info("%zu accepted, %zu refused, %zu stopped by the budget", accepted, refused, stopped);
    cr_assert_gt(accepted, 2000, "%zu accepted", accepted);
    cr_assert_gt(refused, 2000, "%zu refused", refused);
    cr_assert_gt(stopped, 500, "%zu stopped by the budget", stopped);
}

/* Long strings of non-ASCII text (two-, three- and four-byte characters) among ASCII runs
 * and escapes, with one ill-formed piece in about a third of them (a lone lead or
 * continuation, a cut sequence, a surrogate, an overlong form, a byte never in UTF-8), at
 * random places across several 64-byte blocks. The vector levels validate a string as they
 * scan it, only where a block holds non-ASCII bytes, and "\\u" escapes and controls hand
 * stretches to the byte loop: each level gives the byte loop's verdict, error, error byte and
 * token tape. */
Test(oracle, random_utf8_strings_agree_at_every_level)
{
    static const char *const good[] = {"\xc3\xa9",
                                       "\xe2\x80\x94",
                                       "\xf0\x9f\x9a\x80",
                                       "\xe6\x9d\xb1\xe4\xba\xac",
                                       "\xd0\x9f",
                                       "\\n",
                                       "\\u00e9",
                                       "\\\\",
                                       "\\\"",
                                       "\\/",
                                       "abcdefghijklmnopqrstuvwxyz0123456789",
                                       "x",
                                       " "};
    static const char *const bad[] = {
        "\xc3",     "\xa9",         "\xe2\x80",         "\xf0\x9f\x9a", "\xed\xa0\x80",
        "\xc0\xaf", "\xe0\x80\xaf", "\xf4\x90\x80\x80", "\xff",         "\xf8\x88\x80\x80\x80",
        "\x01"};
    const size_t ngood = sizeof(good) / sizeof(good[0]), nbad = sizeof(bad) / sizeof(bad[0]);
    uint64_t rng = 0x2545f4914f6cdd1dull;
    size_t accepted = 0, refused = 0;
    parsed_t *ref = malloc(sizeof(*ref)), *got = malloc(sizeof(*got));
    for (int round = 0; round < 20000; round++) {
        dp_buf_t b = {0};
        dp_buf_appends(&b, "{\"model\":\"m\",\"messages\":[");
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        size_t nstr = 1 + (size_t)(rng >> 60) % 4;
        bool spoil = (rng >> 40) % 3 == 0;
        size_t spoil_at = (size_t)(rng >> 20) % (nstr * 60);
        size_t piece = 0;
        for (size_t k = 0; k < nstr; k++) {
            dp_buf_appends(&b, k ? ",\"" : "\"");
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            size_t npieces = (size_t)(rng >> 33) % 60;
            for (size_t j = 0; j < npieces; j++, piece++) {
                rng = rng * 6364136223846793005ull + 1442695040888963407ull;
                if (spoil && piece == spoil_at)
                    dp_buf_appends(&b, bad[(rng >> 33) % nbad]);
                else
                    dp_buf_appends(&b, good[(rng >> 33) % ngood]);
            }
            dp_buf_appendc(&b, '"');
        }
        dp_buf_appends(&b, "]}");
        parse_full(JDOC_SIMD_SCALAR, b.base, b.len, UINT32_MAX, ref);
        for (int level = JDOC_SIMD_SSE2; level <= JDOC_SIMD_BEST; level++) {
            parse_full(level, b.base, b.len, UINT32_MAX, got);
            if (!same_parse(got, ref))
                cr_assert_fail("level %d, body %.*s: %d %s at %zu / byte loop %d %s at %zu", level,
                               (int)b.len, b.base, got->rc, got->rc ? got->err : "-", got->at,
                               ref->rc, ref->rc ? ref->err : "-", ref->at);
        }
        accepted += ref->rc == 0;
        refused += ref->rc != 0;
        dp_buf_free(&b);
    }
    free(ref);
    free(got);
    jdoc_simd_select(JDOC_SIMD_BEST);
    cr_log_info("%zu accepted, %zu refused", accepted, refused);
    cr_assert_gt(accepted, 10000, "%zu accepted", accepted);
    cr_assert_gt(refused, 2500, "%zu refused", refused);
}

/* jdoc_parse's verdict and error position for body at SIMD level `level`. */
static void parse_at(int level, const char *body, size_t n, int *rc, const char **err, size_t *at)
{
    jdoc_simd_select(level);
    jdoc_t d;
    jdoc_init(&d);
    *rc = jdoc_parse(&d, body, n, JDOC_OBJECT_ONLY);
    *err = d.err;
    *at = d.err_at;
    jdoc_free(&d);
}

/* The AVX2 and AVX-512 paths validate a string's UTF-8 as they scan it, 64 bytes a step (32 at
 * a time, each byte with the three before it); every other level checks each sequence where a
 * string holds it. Every one- to four-byte sequence built from the bytes where UTF-8's rules
 * change, inside a string and outside one, at offsets around the first 32- and 64-byte
 * boundaries and at the end of the document (there too on both sides of byte 64), gets the
 * same parse verdict and error at the same byte at each level as from the byte loop. */
Test(oracle, utf8_validation_matches_at_every_level)
{
    static const unsigned char edge[] = {0x00, 0x1f, 'a',  0x7f, 0x80, 0x8f, 0x90, 0x9f,
                                         0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xdf, 0xe0, 0xe1,
                                         0xec, 0xed, 0xee, 0xef, 0xf0, 0xf1, 0xf3, 0xf4,
                                         0xf5, 0xf7, 0xf8, 0xfe, 0xff, '"',  '\\'};
    const size_t ne = sizeof(edge);
    int top = jdoc_simd_select(JDOC_SIMD_BEST);
    if (top < JDOC_SIMD_AVX2) {
        cr_log_warn("no AVX2 on this CPU: only the checking path runs here");
        return;
    }
    if (top < JDOC_SIMD_AVX512)
        cr_log_warn("no AVX-512 on this CPU: its string scanner is not compared here");
    size_t cases = 0, accepted = 0;
    /* and each edge byte before a well-formed four-byte sequence (an error after a lead byte
     * that only the fifth byte shows) */
    static const unsigned char four[][4] = {
        {0xf0, 0x90, 0x80, 0x80}, {0xf1, 0x80, 0x80, 0x80}, {0xf4, 0x8f, 0xbf, 0xbf}};
    unsigned char seq[5] = {0};
    for (size_t len = 1; len <= 5; len++) {
        size_t total = len == 5 ? ne * (sizeof(four) / sizeof(four[0])) : 1;
        for (size_t k = 0; k < len && len < 5; k++)
            total *= ne;
        for (size_t idx = 0; idx < total; idx++) {
            size_t x = idx;
            if (len == 5) {
                seq[0] = edge[x % ne];
                memcpy(seq + 1, four[x / ne], 4);
            } else {
                for (size_t k = 0; k < len; k++, x /= ne)
                    seq[k] = edge[x % ne];
            }
            for (int where = 0; where < 3; where++) {
                /* where 0: in a string, at offsets across byte 32; 1: the string's last
                 * bytes, cut by the end of the document; 2: outside any string */
                char buf[96];
                size_t n = 0;
                const char *head = where == 2 ? "{\"k\":" : "{\"k\":\"";
                memcpy(buf, head, strlen(head));
                n = strlen(head);
                /* seq at 25..42 or 57..74; cut by the end at 6..10 or 55..76 */
                size_t pad = where == 1 ? (idx & 1 ? 0 : 50 + idx % 17)
                                        : ((idx >> 1) & 1 ? 52 : 20) + idx % 17;
                memset(buf + n, 'x', pad);
                n += pad;
                memcpy(buf + n, seq, len);
                n += len;
                if (where == 0) {
                    memcpy(buf + n, "\"}", 2);
                    n += 2;
                }
                int rc_s;
                const char *err_s;
                size_t at_s;
                parse_at(JDOC_SIMD_SCALAR, buf, n, &rc_s, &err_s, &at_s);
                for (int level = JDOC_SIMD_AVX2; level <= top; level++) {
                    int rc_v;
                    const char *err_v;
                    size_t at_v;
                    parse_at(level, buf, n, &rc_v, &err_v, &at_v);
                    /* plain comparisons: a criterion assertion per case (millions) would pass
                     * each one to the runner */
                    if (rc_v != rc_s || (rc_s < 0 && (strcmp(err_v, err_s) != 0 || at_v != at_s)))
                        cr_assert_fail("level %d, %02x %02x %02x %02x %02x (len %zu, where %d, n "
                                       "%zu): parse %d (%s at %zu) / %d (%s at %zu)",
                                       level, seq[0], seq[1], seq[2], seq[3], seq[4], len, where, n,
                                       rc_v, rc_v < 0 ? err_v : "-", at_v, rc_s,
                                       rc_s < 0 ? err_s : "-", at_s);
                }
                accepted += rc_s == 0;
                cases++;
            }
        }
    }
    jdoc_simd_select(JDOC_SIMD_BEST);
    /* the cases include both kinds in numbers: a test of a validator that accepted, or
     * refused, everything would fail here */
    cr_assert_gt(accepted, 500, "%zu of %zu accepted", accepted, cases);
    cr_assert_gt(cases - accepted, 100000, "%zu of %zu accepted", accepted, cases);
}

/* ---- the scan without a tape, against the parse ------------------------------------------- */

typedef struct {
    uint32_t n;
    jdoc_member_t m[64];
} members_t;

static void collect(void *data, const jdoc_t *d, const jdoc_member_t *m)
{
    (void)d;
    members_t *ms = data;
    if (ms->n < 64)
        ms->m[ms->n] = *m;
    ms->n++;
}

/* jdoc_scan_top gives jdoc_parse's verdict, error and its byte on body, and reports the top
 * level's members as the parse's tape holds them. */
static void check_scan_top(const char *body, size_t n)
{
    jdoc_t p, s;
    jdoc_init(&p);
    jdoc_init(&s);
    int rp = jdoc_parse(&p, body, n, JDOC_OBJECT_ONLY | JDOC_ALLOW_DUPS);
    members_t ms = {0};
    uint32_t count = 0;
    int rs = jdoc_scan_top(&s, body, n, collect, &ms, &count);
    cr_assert_eq(rs, rp, "verdicts differ on %.*s", (int)(n > 200 ? 200 : n), body);
    if (rp < 0) {
        cr_assert_str_eq(s.err, p.err, "%.*s", (int)(n > 200 ? 200 : n), body);
        cr_assert_eq(s.err_at, p.err_at, "%s at %zu / %zu", p.err, s.err_at, p.err_at);
    } else {
        const jtok_t *root = &p.toks[0];
        cr_assert_eq(count, root->aux);
        cr_assert_eq(ms.n, count);
        uint32_t i = 0;
        for (uint32_t k = 1; k < root->end && i < 64; k = p.toks[k + 1].end, i++) {
            const jtok_t *key = &p.toks[k], *v = &p.toks[k + 1];
            const jdoc_member_t *m = &ms.m[i];
            cr_assert(m->key_start == key->start && m->key_len == key->len &&
                          m->key_flags == key->flags && m->val_start == v->start &&
                          m->val_len == v->len && m->val_type == v->type &&
                          m->val_flags == v->flags,
                      "member %u of %.*s", i, (int)(n > 200 ? 200 : n), body);
        }
    }
    jdoc_free(&p);
    jdoc_free(&s);
}

/* Every seed of the fuzz corpora, each cut at every length and with each byte replaced by one
 * of the bytes that steer the parser, at every SIMD level. */
Test(oracle, the_scan_without_a_tape_agrees_with_the_parse)
{
    static const char *const dirs[] = {DP_SOURCE_DIR "/tests/fuzz/corpus/policy",
                                       DP_SOURCE_DIR "/tests/fuzz/corpus/policy_oracle"};
    static const char steer[] = "{}[]\",:\\ 0-.eEtn\x01\xc3\x80";
    int levels = jdoc_simd_select(JDOC_SIMD_BEST);
    for (int level = 0; level <= levels; level++) {
        jdoc_simd_select(level);
        for (size_t di = 0; di < 2; di++) {
            DIR *d = opendir(dirs[di]);
            cr_assert_not_null(d);
            struct dirent *e;
            while ((e = readdir(d)) != NULL) {
                if (e->d_name[0] == '.')
                    continue;
                char path[1024];
                snprintf(path, sizeof(path), "%s/%s", dirs[di], e->d_name);
                size_t n;
                char *b = slurp(path, &n);
                size_t lim = n > 600 ? 600 : n;
                for (size_t cut = 0; cut <= lim; cut++)
                    check_scan_top(b, cut);
                check_scan_top(b, n);
                for (size_t at = 0; at < lim; at++) {
                    char keep = b[at];
                    b[at] = steer[(at * 7 + (size_t)level) % (sizeof(steer) - 1)];
                    check_scan_top(b, n);
                    b[at] = keep;
                }
                free(b);
            }
            closedir(d);
        }
    }
    jdoc_simd_select(JDOC_SIMD_BEST);
    /* nesting at the limit and past it, inside a member and at the top */
    dp_buf_t b = {0};
    for (int depth = 62; depth <= 66; depth++) {
        dp_buf_reset(&b);
        dp_buf_appends(&b, "{\"a\":");
        for (int i = 1; i < depth; i++)
            dp_buf_appends(&b, i % 2 ? "[" : "{\"k\":");
        for (int i = depth - 1; i >= 1; i--)
            dp_buf_appends(&b, i % 2 ? "]" : "}");
        dp_buf_appends(&b, ",\"b\":[{},[]],\"c\":\"\\u00e9\",\"d\":-1.5e3,\"e\":null}");
        check_scan_top(b.base, b.len);
    }
    dp_buf_free(&b);
}
