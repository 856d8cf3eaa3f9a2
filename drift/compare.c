/* Comparison of two outputs (docs/drift.md §2): byte match, first differing byte, word similarity.
 *
 * Runs in uv_queue_work threads: no globals, no logging, only the heap. The word distance
 * trims the common prefix and suffix first, which is exact for unit-cost Levenshtein and makes
 * the usual case (outputs that agree up to a point, or differ in a few words) linear; what
 * remains is bounded by max_words per side, so the quadratic part is at most max_words^2 cells
 * (4096^2 = 16.8M, tens of milliseconds) whatever the output length. */
#include "drift/drift.h"

#include <stdlib.h>
#include <string.h>

#include "common/util.h"

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

typedef struct {
    const char *p;
    size_t len;
    uint32_t h; /* FNV-1a, for interning */
} word_t;

/* The next word at or after *pos, below end. */
static bool next_word(const char *s, size_t end, size_t *pos, word_t *w)
{
    size_t i = *pos;
    while (i < end && is_ws(s[i]))
        i++;
    size_t j = i;
    while (j < end && !is_ws(s[j]))
        j++;
    *pos = j;
    if (i == j)
        return false;
    w->p = s + i;
    w->len = j - i;
    return true;
}

/* The word ending at or before *pos, not below lo. */
static bool prev_word(const char *s, size_t lo, size_t *pos, word_t *w)
{
    size_t j = *pos;
    while (j > lo && is_ws(s[j - 1]))
        j--;
    size_t i = j;
    while (i > lo && !is_ws(s[i - 1]))
        i--;
    if (i == j)
        return false;
    *pos = i;
    w->p = s + i;
    w->len = j - i;
    return true;
}

static bool word_eq(const word_t *x, const word_t *y)
{
    return x->len == y->len && memcmp(x->p, y->p, x->len) == 0;
}

static uint32_t fnv1a(const char *p, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)p[i];
        h *= 16777619u;
    }
    return h;
}

static size_t count_words(const char *s, size_t lo, size_t hi)
{
    size_t n = 0;
    word_t w;
    while (next_word(s, hi, &lo, &w))
        n++;
    return n;
}

/* Up to max words of s[lo, hi) into a fresh array; *n gets how many. */
static word_t *tokenize(const char *s, size_t lo, size_t hi, size_t max, size_t *n)
{
    word_t *v = dp_xmalloc(max * sizeof(*v));
    size_t k = 0;
    while (k < max && next_word(s, hi, &lo, &v[k])) {
        v[k].h = fnv1a(v[k].p, v[k].len);
        k++;
    }
    *n = k;
    return v;
}

/* Replace each word by a small integer, equal words getting equal ids, so the quadratic loop
 * compares integers only. Open addressing over a power-of-two table at most half full. */
static void intern(const word_t *x, size_t n, const word_t *y, size_t m, uint32_t *xid,
                   uint32_t *yid)
{
    size_t cap = 16;
    while (cap < 2 * (n + m))
        cap *= 2;
    const word_t **slot = dp_xcalloc(cap, sizeof(*slot));
    uint32_t *ids = dp_xmalloc(cap * sizeof(*ids));
    uint32_t next = 0;
    for (size_t k = 0; k < n + m; k++) {
        const word_t *w = k < n ? &x[k] : &y[k - n];
        size_t i = w->h & (cap - 1);
        while (slot[i] && !(slot[i]->h == w->h && word_eq(slot[i], w)))
            i = (i + 1) & (cap - 1);
        if (slot[i] == NULL) {
            slot[i] = w;
            ids[i] = next++;
        }
        if (k < n)
            xid[k] = ids[i];
        else
            yid[k - n] = ids[i];
    }
    free(ids);
    free(slot);
}

/* Exact Levenshtein over id arrays, one row of min(n, m) + 1 cells. */
static size_t levenshtein(const uint32_t *x, size_t n, const uint32_t *y, size_t m)
{
    if (n < m) {
        const uint32_t *t = x;
        x = y;
        y = t;
        size_t tn = n;
        n = m;
        m = tn;
    }
    if (m == 0)
        return n;
    /* uint32_t cells: a cell is at most max(n, m) <= max_words, which the caller keeps below
     * UINT32_MAX / 2, and the narrower row runs faster. */
    uint32_t *row = dp_xmalloc((m + 1) * sizeof(*row));
    for (size_t j = 0; j <= m; j++)
        row[j] = (uint32_t)j;
    for (size_t i = 1; i <= n; i++) {
        uint32_t diag = row[0]; /* row[i-1][j-1] */
        uint32_t left = (uint32_t)i;
        row[0] = left;
        uint32_t xi = x[i - 1];
        for (size_t j = 1; j <= m; j++) {
            uint32_t up = row[j];
            uint32_t best = diag + (xi != y[j - 1]);
            uint32_t edit = (up < left ? up : left) + 1;
            best = edit < best ? edit : best;
            diag = up;
            row[j] = left = best;
        }
    }
    size_t d = row[m];
    free(row);
    return d;
}

size_t drift_word_distance(const char *a, size_t alen, const char *b, size_t blen, size_t max_words,
                           size_t *na, size_t *nb, bool *capped)
{
    if (max_words == 0 || max_words > UINT32_MAX / 2)
        max_words = DRIFT_MAX_WORDS;
    size_t wa = count_words(a, 0, alen), wb = count_words(b, 0, blen);
    if (na)
        *na = wa;
    if (nb)
        *nb = wb;
    if (capped)
        *capped = false;

    /* Common prefix of words: [0, pa) and [0, pb) agree word for word. */
    size_t pa = 0, pb = 0, same = 0;
    for (;;) {
        size_t ia = pa, ib = pb;
        word_t x, y;
        if (!next_word(a, alen, &ia, &x) || !next_word(b, blen, &ib, &y) || !word_eq(&x, &y))
            break;
        pa = ia;
        pb = ib;
        same++;
    }
    /* Common suffix, not reaching back into the prefix: [ea, alen) and [eb, blen) agree. */
    size_t ea = alen, eb = blen;
    for (;;) {
        size_t ia = ea, ib = eb;
        word_t x, y;
        if (!prev_word(a, pa, &ia, &x) || !prev_word(b, pb, &ib, &y) || !word_eq(&x, &y))
            break;
        ea = ia;
        eb = ib;
        same++;
    }
    size_t ma = wa - same, mb = wb - same; /* words left in the middles */
    if (ma == 0 || mb == 0)
        return ma + mb;

    size_t ca, cb;
    word_t *x = tokenize(a, pa, ea, ma < max_words ? ma : max_words, &ca);
    word_t *y = tokenize(b, pb, eb, mb < max_words ? mb : max_words, &cb);
    uint32_t *xid = dp_xmalloc((ca + cb) * sizeof(*xid));
    uint32_t *yid = xid + ca;
    intern(x, ca, y, cb, xid, yid);
    free(x);
    free(y);
    size_t d = levenshtein(xid, ca, yid, cb);
    free(xid);
    /* Words past the cap: d(A, B) <= d(A1, B1) + max(|A2|, |B2|) for A = A1A2, B = B1B2, so
     * counting each as an edit bounds the distance from above (similarity from below). */
    size_t ra = ma - ca, rb = mb - cb;
    if (ra || rb) {
        d += ra > rb ? ra : rb;
        if (capped)
            *capped = true;
    }
    size_t most = wa > wb ? wa : wb;
    return d < most ? d : most;
}

void drift_compare_bytes(const char *a, size_t alen, const char *b, size_t blen, drift_result_t *r)
{
    memset(r, 0, sizeof(*r));
    if (a == NULL)
        a = "";
    if (b == NULL)
        b = "";
    size_t n = alen < blen ? alen : blen;
    size_t i = 0;
    while (i < n && a[i] == b[i])
        i++;
    r->match = i == n && alen == blen;
    r->divergence_offset = r->match ? -1 : (int64_t)i;
    r->length_differs = alen != blen;
    r->len_a = alen;
    r->len_b = blen;
    r->word_distance =
        drift_word_distance(a, alen, b, blen, 0, &r->words_a, &r->words_b, &r->words_capped);
    size_t most = r->words_a > r->words_b ? r->words_a : r->words_b;
    r->similarity = most == 0 ? 1.0 : 1.0 - (double)r->word_distance / (double)most;
}

static const char *str_or_empty(const dp_buf_t *b)
{
    return b->base ? b->base : "";
}

void drift_compare(const drift_output_t *a, const drift_output_t *b, drift_result_t *r)
{
    drift_compare_bytes(a->text.base, a->text.len, b->text.base, b->text.len, r);
    r->finish_differs = strcmp(str_or_empty(&a->finish), str_or_empty(&b->finish)) != 0;
    r->truncated = a->truncated || b->truncated;
}

double drift_sample_similarity(const drift_result_t *r)
{
    return r->similarity;
}

void drift_divlog_fill(drift_divlog_t *rec, const char *request_id, const char *pool,
                       const char *replica_a, const char *replica_b, const drift_result_t *r,
                       const char *a, size_t alen, const char *b, size_t blen)
{
    memset(rec, 0, sizeof(*rec));
    rec->request_id = request_id;
    rec->pool = pool;
    rec->replica_a = replica_a;
    rec->replica_b = replica_b;
    rec->kind = strcmp(replica_a, replica_b) == 0 ? DRIFT_SELF : DRIFT_CROSS;
    rec->candidate = false;
    rec->divergence_offset = r->divergence_offset;
    rec->similarity = r->similarity;
    rec->finish_differs = r->finish_differs;
    rec->len_a = alen;
    rec->len_b = blen;
    dp_sha256_hex(a ? a : "", alen, rec->sha256_a);
    dp_sha256_hex(b ? b : "", blen, rec->sha256_b);
}

void drift_divlog_write(const drift_divlog_t *rec, dp_jw_t *w)
{
    dp_jw_str(w, "request_id", rec->request_id);
    dp_jw_str(w, "pool", rec->pool);
    dp_jw_str(w, "kind", rec->candidate ? "candidate" : drift_kind_name(rec->kind));
    dp_jw_arr_begin(w, "pair");
    dp_jw_str(w, NULL, rec->replica_a);
    dp_jw_str(w, NULL, rec->replica_b);
    dp_jw_arr_end(w);
    dp_jw_int(w, "divergence_offset", rec->divergence_offset);
    dp_jw_double(w, "similarity", rec->similarity);
    dp_jw_bool(w, "finish_differs", rec->finish_differs);
    dp_jw_uint(w, "len_a", rec->len_a);
    dp_jw_uint(w, "len_b", rec->len_b);
    dp_jw_str(w, "sha256_a", rec->sha256_a);
    dp_jw_str(w, "sha256_b", rec->sha256_b);
}
