/* libFuzzer target over the drift extractors and comparison.
 *
 * Input: byte 0 seeds how the rest is cut into reads, byte 1 picks max_output_bytes (0: the
 * default, else 1..255 bytes, so the cap and oversized-event paths are reached), the rest is an
 * SSE stream. Checked beyond "no crash, no leak, no UB":
 *   - the SSE extractor gives the same result whether fed whole or in arbitrary pieces;
 *   - comparison invariants: match <=> offset -1, offset within the shorter length, similarity
 *     in [0, 1] and 1 on a match, symmetric distance;
 *   - the whole-body extractor and the statistics/rendering accept whatever comes out. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "drift/drift.h"

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c))                                                                                  \
            __builtin_trap();                                                                      \
    } while (0)

typedef struct {
    int rc; /* drift_sse_finish */
    long consumed;
    drift_output_t out;
} run_t;

/* Feed data cut at pseudo-random points from seed (0: one piece). */
static void run_sse(const uint8_t *data, size_t n, size_t cap, uint32_t seed, run_t *r)
{
    drift_sse_t st = {.max_output_bytes = cap};
    size_t at = 0;
    long rc = -2;
    while (at < n && rc == -2) {
        size_t piece = n - at;
        if (seed) {
            seed = seed * 1103515245u + 12345u;
            piece = 1 + (seed >> 16) % 17;
            if (piece > n - at)
                piece = n - at;
        }
        rc = drift_sse_feed(&st, (const char *)data + at, piece);
        if (rc >= 0) {
            rc = (long)at + rc;
            /* a CRLF's LF may be in the rest */
            if (at + piece < n)
                rc += drift_sse_feed(&st, (const char *)data + at + piece, n - at - piece);
            break;
        }
        at += piece;
    }
    r->consumed = rc;
    r->rc = drift_sse_finish(&st, &r->out);
    drift_sse_free(&st);
}

static void check_compare(const char *a, size_t alen, const char *b, size_t blen)
{
    drift_result_t r, s;
    drift_compare_bytes(a, alen, b, blen, &r);
    drift_compare_bytes(b, blen, a, alen, &s);
    CHECK(r.match == (r.divergence_offset == -1));
    CHECK(r.match == (alen == blen && memcmp(a, b, alen) == 0));
    CHECK(r.divergence_offset <= (int64_t)(alen < blen ? alen : blen));
    CHECK(r.similarity >= 0.0 && r.similarity <= 1.0);
    CHECK(!r.match || r.similarity == 1.0);
    CHECK(r.word_distance == s.word_distance && r.divergence_offset == s.divergence_offset);
    /* a small cap only ever raises the distance */
    size_t capped = drift_word_distance(a, alen, b, blen, 2, NULL, NULL, NULL);
    CHECK(capped >= r.word_distance || r.words_capped);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 2)
        return 0;
    uint32_t seed = data[0] | 1u;
    size_t cap = data[1];
    data += 2;
    size -= 2;

    run_t whole = {0}, split = {0};
    run_sse(data, size, cap, 0, &whole);
    run_sse(data, size, cap, seed, &split);
    CHECK(whole.rc == split.rc);
    CHECK(whole.consumed == split.consumed);
    CHECK(whole.out.text.len == split.out.text.len);
    CHECK(whole.out.text.len == 0 ||
          memcmp(whole.out.text.base, split.out.text.base, whole.out.text.len) == 0);
    CHECK(whole.out.finish.len == split.out.finish.len);
    CHECK(whole.out.done == split.out.done && whole.out.truncated == split.out.truncated);
    CHECK(whole.out.text.len <= (cap ? cap : DRIFT_DEFAULT_MAX_OUTPUT));

    drift_output_t body = {0};
    (void)drift_extract_json((const char *)data, size, cap, &body);

    drift_result_t r;
    drift_compare(&whole.out, &body, &r);
    check_compare((const char *)data, size / 2, (const char *)data + size / 2, size - size / 2);

    drift_pool_t *p = drift_pool_new("fuzz");
    drift_pool_add(p, "r1", size % 3 ? "r2" : "r1", &r);
    dp_buf_t js = {0};
    const drift_pool_t *pools[] = {p};
    drift_render(&js, pools, 1);
    dp_buf_free(&js);
    drift_pool_free(p);

    drift_output_free(&body);
    drift_output_free(&whole.out);
    drift_output_free(&split.out);
    return 0;
}
