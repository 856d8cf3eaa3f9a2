/* Drift comparison: byte match, divergence offset, word similarity, word Levenshtein, and the
 * divergence log record (docs/drift.md §2, §8). */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/jw.h"
#include "drift/drift.h"

static drift_result_t cmp(const char *a, const char *b)
{
    drift_result_t r;
    drift_compare_bytes(a, strlen(a), b, strlen(b), &r);
    return r;
}

static size_t wd(const char *a, const char *b)
{
    return drift_word_distance(a, strlen(a), b, strlen(b), 0, NULL, NULL, NULL);
}

Test(drift_compare, equal_outputs_match_with_offset_minus_one)
{
    drift_result_t r = cmp("The quick brown fox.", "The quick brown fox.");
    cr_assert(r.match);
    cr_assert_eq(r.divergence_offset, -1);
    cr_assert_float_eq(r.similarity, 1.0, 1e-12);
    cr_assert_not(r.length_differs);
    cr_assert_eq(r.words_a, 4);
}

Test(drift_compare, both_empty_is_a_match_with_similarity_one)
{
    drift_result_t r = cmp("", "");
    cr_assert(r.match);
    cr_assert_eq(r.divergence_offset, -1);
    cr_assert_float_eq(r.similarity, 1.0, 1e-12);

    drift_compare_bytes(NULL, 0, NULL, 0, &r);
    cr_assert(r.match);
    cr_assert_float_eq(r.similarity, 1.0, 1e-12);
}

Test(drift_compare, one_empty_side)
{
    drift_result_t r = cmp("", "two words");
    cr_assert_not(r.match);
    cr_assert_eq(r.divergence_offset, 0);
    cr_assert_float_eq(r.similarity, 0.0, 1e-12);
    cr_assert(r.length_differs);
}

Test(drift_compare, prefix_diverges_at_the_shorter_length)
{
    drift_result_t r = cmp("one two", "one two three");
    cr_assert_not(r.match);
    cr_assert_eq(r.divergence_offset, 7);
    cr_assert(r.length_differs);
    cr_assert_float_eq(r.similarity, 1.0 - 1.0 / 3.0, 1e-12);

    r = cmp("one two three", "one two");
    cr_assert_eq(r.divergence_offset, 7);
}

Test(drift_compare, first_differing_byte_inside_a_word)
{
    drift_result_t r = cmp("alpha beta gamma", "alpha bexa gamma");
    cr_assert_eq(r.divergence_offset, 8);
    cr_assert_not(r.length_differs);
    cr_assert_float_eq(r.similarity, 1.0 - 1.0 / 3.0, 1e-12);
}

Test(drift_compare, unicode_compares_bytes)
{
    /* "héllo w" is 8 bytes (é takes 2), so ö's first byte (0xC3) meets 'o' at offset 8. */
    drift_result_t r = cmp("h\xc3\xa9llo w\xc3\xb6rld", "h\xc3\xa9llo world");
    cr_assert_eq(r.divergence_offset, 8);
    cr_assert_float_eq(r.similarity, 0.5, 1e-12);

    /* Same first byte, different second byte of a 2-byte sequence: offset is the second. */
    r = cmp("caf\xc3\xa9", "caf\xc3\xa8");
    cr_assert_eq(r.divergence_offset, 4);
    cr_assert_float_eq(r.similarity, 0.0, 1e-12);
}

Test(drift_compare, one_word_changed_in_n_gives_one_minus_one_over_n)
{
    const char *a = "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17 w18 w19";
    const char *b = "w0 w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 XX w13 w14 w15 w16 w17 w18 w19";
    drift_result_t r = cmp(a, b);
    cr_assert_eq(r.words_a, 20);
    cr_assert_eq(r.word_distance, 1);
    cr_assert_float_eq(r.similarity, 1.0 - 1.0 / 20, 1e-12);
}

Test(drift_compare, whitespace_only_difference_is_no_word_difference)
{
    drift_result_t r = cmp("a b\nc", "a  b c");
    cr_assert_not(r.match);
    cr_assert_eq(r.divergence_offset, 2);
    cr_assert_float_eq(r.similarity, 1.0, 1e-12);
    /* every ASCII whitespace separates words */
    cr_assert_eq(wd("a\tb\vc\fd\re", "a b c d e"), 0);
}

Test(drift_compare, outputs_flags_finish_and_truncation)
{
    drift_output_t a = {0}, b = {0};
    dp_buf_appends(&a.text, "same");
    dp_buf_appends(&b.text, "same");
    dp_buf_appends(&a.finish, "stop");
    dp_buf_appends(&b.finish, "length");
    drift_result_t r;
    drift_compare(&a, &b, &r);
    cr_assert(r.match);
    cr_assert(r.finish_differs);
    cr_assert_not(r.truncated);
    cr_assert_float_eq(drift_sample_similarity(&r), 1.0, 1e-12);

    dp_buf_reset(&b.finish);
    dp_buf_appends(&b.finish, "stop");
    b.truncated = true;
    drift_compare(&a, &b, &r);
    cr_assert_not(r.finish_differs);
    cr_assert(r.truncated);

    /* Zeroed outputs (NULL buffers) compare as empty. */
    drift_output_t e1 = {0}, e2 = {0};
    drift_compare(&e1, &e2, &r);
    cr_assert(r.match);
    cr_assert_not(r.finish_differs);
    drift_output_free(&a);
    drift_output_free(&b);
}

Test(drift_levenshtein, known_answers)
{
    cr_assert_eq(wd("k i t t e n", "s i t t i n g"), 3);
    cr_assert_eq(wd("a b c", ""), 3);
    cr_assert_eq(wd("", "a b c"), 3);
    cr_assert_eq(wd("a b c d", "b c d e"), 2);
    cr_assert_eq(wd("a b", "b a"), 2);
    cr_assert_eq(wd("x y z", "x y z"), 0);
    cr_assert_eq(wd("a b a", "a"), 2);
    cr_assert_eq(wd("a a a", "a a"), 1);
    cr_assert_eq(wd("the cat sat on the mat", "the cat sat on a mat"), 1);
    cr_assert_eq(wd("saturday", "sunday"), 1); /* one word each, different */
    cr_assert_eq(wd("s a t u r d a y", "s u n d a y"), 3);
}

Test(drift_levenshtein, hash_collisions_are_still_different_words)
{
    /* FNV-1a 32-bit collides on these pairs; words are interned by hash then bytes. */
    cr_assert_eq(wd("x costarring y", "x liquid y"), 1);
    cr_assert_eq(wd("declinate altarage zinke", "macallums zinke altarage"), 3);
    cr_assert_eq(wd("liquid costarring", "costarring liquid"), 2);
}

/* Full-matrix Levenshtein over space-separated words, for cross-checking. */
static size_t naive(char **x, size_t n, char **y, size_t m)
{
    size_t *d = calloc((n + 1) * (m + 1), sizeof(*d));
    for (size_t i = 0; i <= n; i++)
        d[i * (m + 1)] = i;
    for (size_t j = 0; j <= m; j++)
        d[j] = j;
    for (size_t i = 1; i <= n; i++)
        for (size_t j = 1; j <= m; j++) {
            size_t best = d[(i - 1) * (m + 1) + j - 1] + (strcmp(x[i - 1], y[j - 1]) != 0);
            if (d[(i - 1) * (m + 1) + j] + 1 < best)
                best = d[(i - 1) * (m + 1) + j] + 1;
            if (d[i * (m + 1) + j - 1] + 1 < best)
                best = d[i * (m + 1) + j - 1] + 1;
            d[i * (m + 1) + j] = best;
        }
    size_t r = d[n * (m + 1) + m];
    free(d);
    return r;
}

static const char *vocab[] = {"a", "b", "c", "dd", "e"};

Test(drift_levenshtein, matches_full_matrix_on_random_inputs_and_cap_bounds_from_above)
{
    srand(42);
    for (int t = 0; t < 500; t++) {
        size_t n = (size_t)(rand() % 14), m = (size_t)(rand() % 14);
        char *x[16], *y[16];
        dp_buf_t a = {0}, b = {0};
        for (size_t i = 0; i < n; i++) {
            x[i] = (char *)vocab[rand() % 5];
            dp_buf_printf(&a, "%s%s", i ? " " : "", x[i]);
        }
        for (size_t j = 0; j < m; j++) {
            y[j] = (char *)vocab[rand() % 5];
            dp_buf_printf(&b, "%s%s", j ? "  " : "\n", y[j]);
        }
        size_t want = naive(x, n, y, m);
        bool capped = true;
        size_t na, nb;
        size_t got = drift_word_distance(a.base, a.len, b.base, b.len, 0, &na, &nb, &capped);
        cr_assert_eq(got, want, "case %d: got %zu want %zu", t, got, want);
        cr_assert_not(capped);
        cr_assert_eq(na, n);
        cr_assert_eq(nb, m);
        /* With a cap of 3 words the result is an upper bound, never below the exact value,
         * and never above the larger word count. */
        size_t bounded = drift_word_distance(a.base, a.len, b.base, b.len, 3, NULL, NULL, &capped);
        cr_assert_geq(bounded, want, "case %d", t);
        cr_assert_leq(bounded, n > m ? n : m);
        dp_buf_free(&a);
        dp_buf_free(&b);
    }
}

Test(drift_levenshtein, long_outputs_trim_common_parts_exactly)
{
    dp_buf_t a = {0}, b = {0};
    for (int i = 0; i < 20000; i++) {
        dp_buf_printf(&a, "w%d ", i);
        dp_buf_printf(&b, "w%d ", i == 10000 ? -1 : i);
    }
    bool capped = true;
    size_t d = drift_word_distance(a.base, a.len, b.base, b.len, 0, NULL, NULL, &capped);
    cr_assert_eq(d, 1);
    cr_assert_not(capped);
    drift_result_t r;
    drift_compare_bytes(a.base, a.len, b.base, b.len, &r);
    cr_assert_float_eq(r.similarity, 1.0 - 1.0 / 20000, 1e-12);
    dp_buf_free(&a);
    dp_buf_free(&b);
}

Test(drift_levenshtein, cap_bounds_work_on_unrelated_long_outputs)
{
    dp_buf_t a = {0}, b = {0};
    for (int i = 0; i < 6000; i++) {
        dp_buf_printf(&a, "a%d ", i);
        dp_buf_printf(&b, "b%d ", i);
    }
    dp_buf_appends(&b, "extra words");
    bool capped = false;
    size_t nb;
    size_t d = drift_word_distance(a.base, a.len, b.base, b.len, 0, NULL, &nb, &capped);
    cr_assert(capped);
    cr_assert_eq(nb, 6002);
    cr_assert_eq(d, 6002); /* every word differs: the bound is exact here */
    drift_result_t r;
    drift_compare_bytes(a.base, a.len, b.base, b.len, &r);
    cr_assert(r.words_capped);
    cr_assert_float_eq(r.similarity, 0.0, 1e-12);
    dp_buf_free(&a);
    dp_buf_free(&b);
}

Test(drift_divlog, hashes_not_texts)
{
    drift_result_t r = cmp("abc", "abd");
    drift_divlog_t rec;
    drift_divlog_fill(&rec, "req-1", "llama", "r1", "r2", &r, "abc", 3, "abd", 3);
    cr_assert_str_eq(rec.sha256_a,
                     "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    cr_assert_eq(rec.kind, DRIFT_CROSS);
    cr_assert_eq(rec.divergence_offset, 2);

    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    dp_jw_obj_begin(&w, NULL);
    drift_divlog_write(&rec, &w);
    dp_jw_obj_end(&w);
    cr_assert(strstr(out.base, "\"sha256_a\":\"ba7816bf") != NULL, "%s", out.base);
    cr_assert(strstr(out.base, "\"pair\":[\"r1\",\"r2\"]") != NULL, "%s", out.base);
    cr_assert(strstr(out.base, "\"divergence_offset\":2") != NULL, "%s", out.base);
    cr_assert(strstr(out.base, "\"kind\":\"cross\"") != NULL, "%s", out.base);
    cr_assert(strstr(out.base, "abd") == NULL, "the text must not be logged: %s", out.base);
    dp_buf_free(&out);

    drift_divlog_fill(&rec, "req-2", "llama", "r1", "r1", &r, "", 0, NULL, 0);
    cr_assert_eq(rec.kind, DRIFT_SELF);
    cr_assert_str_eq(rec.sha256_b,
                     "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
}
