#include "policy/jdoc.h"

#include "common/util.h"

#include <assert.h>
#include <float.h>
#include <stdatomic.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* 1 for bytes that end the fast path inside a string: controls, '"', '\\' and non-ASCII. */
static const uint8_t str_special[256] = {
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
};

/* The same for a document already known to be valid UTF-8 (utf8_valid_avx2):
 * non-ASCII bytes are plain text, only controls, '"' and '\\' end a run. */
static const uint8_t str_special_utf8ok[256] = {
    1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
    0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0,
};

static const char over_budget[] = "over its budget of tokens and slow steps";

void jdoc_init(jdoc_t *d)
{
    memset(d, 0, sizeof(*d));
    d->err_tok = JDOC_NONE;
    d->budget = UINT32_MAX;
}

/* Count `slow` more slow steps; has the parse used up its budget? */
static inline bool over_budget_now(jdoc_t *d, uint64_t slow)
{
    uint64_t n = d->nslow + slow;
    d->nslow = n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
    return (uint64_t)d->ntoks * JDOC_TOKEN_UNITS + d->nslow > d->budget;
}

bool jdoc_over_budget(const jdoc_t *d)
{
    return d->err == over_budget;
}

void jdoc_reset(jdoc_t *d)
{
    d->src = NULL;
    d->srclen = 0;
    d->ntoks = 0;
    d->norder = 0;
    d->nslow = 0;
    dp_buf_reset(&d->keys);
    d->err = NULL;
    d->err_at = 0;
    d->err_tok = JDOC_NONE;
}

void jdoc_init_with(jdoc_t *d, jtok_t *toks, uint32_t cap)
{
    jdoc_init(d);
    d->toks = toks;
    d->cap = cap;
    d->toks_borrowed = true;
}

void jdoc_free(jdoc_t *d)
{
    if (!d->toks_borrowed)
        free(d->toks);
    free(d->order);
    free(d->tmp);
    dp_buf_free(&d->keys);
    jdoc_init(d);
}

static int fail(jdoc_t *d, const char *why, size_t at)
{
    d->err = why;
    d->err_at = at;
    return -1;
}

static __attribute__((noinline, cold)) void grow_toks(jdoc_t *d)
{
    uint32_t ncap = d->cap ? d->cap * 2 : 64;
    if (d->toks_borrowed) {
        jtok_t *t = dp_xmalloc((size_t)ncap * sizeof(jtok_t));
        memcpy(t, d->toks, (size_t)d->ntoks * sizeof(jtok_t));
        d->toks = t;
        d->toks_borrowed = false;
    } else {
        d->toks = dp_xrealloc(d->toks, (size_t)ncap * sizeof(jtok_t));
    }
    d->cap = ncap;
}

/* Inlined at each of its few call sites: a token per value and key is the parse's rhythm. */
static inline __attribute__((always_inline)) uint32_t push_tok(jdoc_t *d, uint8_t type,
                                                               size_t start)
{
    if (__builtin_expect(d->ntoks == d->cap, 0))
        grow_toks(d);
    jtok_t *t = &d->toks[d->ntoks];
    t->start = (uint32_t)start;
    t->len = 0;
    t->end = d->ntoks + 1;
    t->aux = 0;
    t->aux2 = 0;
    t->type = type;
    t->flags = 0;
    return d->ntoks++;
}

/* Four hex digits at p (bounds checked by the caller) or -1. */
static int32_t hex4(const unsigned char *p)
{
    int a = dp_hexval(p[0]), b = dp_hexval(p[1]), c = dp_hexval(p[2]), e = dp_hexval(p[3]);
    if ((a | b | c | e) < 0)
        return -1;
    return (int32_t)(a << 12 | b << 8 | c << 4 | e);
}

/* Any byte of x a control, '"', '\\' or non-ASCII? May report false positives (borrows
 * propagate past a real hit), never false negatives; the byte loop sorts them out. */
static inline bool swar_special(uint64_t x)
{
    const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    uint64_t q = x ^ (ones * '"'), b = x ^ (ones * '\\');
    uint64_t t = ((q - ones) & ~q) | ((b - ones) & ~b) | (x - ones * 0x20) | x;
    return (t & highs) != 0;
}

/* ---- plain string runs: AVX2, SSE2 or eight bytes at a time ------------------------------ */

/* The first byte at or after i that ends a plain run (a control, '"', '\\' or non-ASCII), or
 * a position near n from which the byte loop goes on: vector loads never pass n. One signed
 * compare catches controls and non-ASCII together (bytes >= 0x80 are negative). */
typedef size_t (*plain_run_fn)(const unsigned char *p, size_t i, size_t n);

static inline size_t plain_run_swar(const unsigned char *p, size_t i, size_t n)
{
    while (i + 8 <= n) {
        uint64_t x;
        memcpy(&x, p + i, 8);
        if (swar_special(x))
            break;
        i += 8;
    }
    return i;
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>

__attribute__((target("sse2"))) static inline size_t plain_run_sse2(const unsigned char *p,
                                                                    size_t i, size_t n)
{
    const __m128i q = _mm_set1_epi8('"'), b = _mm_set1_epi8('\\'), sp = _mm_set1_epi8(0x20);
    while (i + 16 <= n) {
        __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(p + i));
        __m128i m = _mm_or_si128(_mm_or_si128(_mm_cmpeq_epi8(x, q), _mm_cmpeq_epi8(x, b)),
                                 _mm_cmplt_epi8(x, sp));
        unsigned mask = (unsigned)_mm_movemask_epi8(m);
        if (mask)
            return i + (size_t)__builtin_ctz(mask);
        i += 16;
    }
    return plain_run_swar(p, i, n);
}

__attribute__((target("avx2"))) static inline size_t plain_run_avx2(const unsigned char *p,
                                                                    size_t i, size_t n)
{
    const __m256i q = _mm256_set1_epi8('"'), b = _mm256_set1_epi8('\\'),
                  sp = _mm256_set1_epi8(0x20);
    while (i + 32 <= n) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)(p + i));
        __m256i m =
            _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(x, q), _mm256_cmpeq_epi8(x, b)),
                            _mm256_cmpgt_epi8(sp, x));
        unsigned mask = (unsigned)_mm256_movemask_epi8(m);
        if (mask)
            return i + (size_t)__builtin_ctz(mask);
        i += 32;
    }
    return plain_run_sse2(p, i, n);
}
/* As plain_run_avx2 for a document already validated as UTF-8: an unsigned compare, so
 * non-ASCII bytes stay in the run. */
__attribute__((target("avx2"))) static inline size_t plain_run_avx2_utf8ok(const unsigned char *p,
                                                                           size_t i, size_t n)
{
    const __m256i q = _mm256_set1_epi8('"'), b = _mm256_set1_epi8('\\'), c = _mm256_set1_epi8(0x1f);
    while (i + 32 <= n) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)(p + i));
        __m256i ctl = _mm256_cmpeq_epi8(_mm256_min_epu8(x, c), x); /* x <= 0x1f */
        __m256i m =
            _mm256_or_si256(_mm256_or_si256(_mm256_cmpeq_epi8(x, q), _mm256_cmpeq_epi8(x, b)), ctl);
        unsigned mask = (unsigned)_mm256_movemask_epi8(m);
        if (mask)
            return i + (size_t)__builtin_ctz(mask);
        i += 32;
    }
    return i;
}

/* UTF-8 validation 32 bytes at a time: the lookup method of Keiser and Lemire, "Validating
 * UTF-8 In Less Than One Instruction Per Byte" (2021). Each byte is classified together with
 * the byte before it by three 16-entry tables, indexed by the earlier byte's high and low
 * nibble and this byte's high nibble; a bit set in all three names an error of that pair.
 * The second and third continuations of 3- and 4-byte sequences are checked separately,
 * from the bytes two and three before. */
enum {
    U8_TOO_SHORT = 1 << 0,      /* lead byte followed by ASCII or another lead */
    U8_TOO_LONG = 1 << 1,       /* ASCII followed by a continuation */
    U8_OVERLONG_3 = 1 << 2,     /* E0 80..9F */
    U8_TOO_LARGE = 1 << 3,      /* F4 90..BF, F5..FF 90..BF: above U+10FFFF */
    U8_SURROGATE = 1 << 4,      /* ED A0..BF */
    U8_OVERLONG_2 = 1 << 5,     /* C0..C1 80..BF */
    U8_TOO_LARGE_1000 = 1 << 6, /* F5..FF 80..8F */
    U8_OVERLONG_4 = 1 << 6,     /* F0 80..8F (shares the bit: never confused, see byte_1_low) */
    U8_TWO_CONTS = 1 << 7,      /* continuation followed by continuation */
    U8_CARRY = U8_TOO_SHORT | U8_TOO_LONG | U8_TWO_CONTS,
};

/* The three tables, 16 entries each, repeated in each 16-byte lane (the byte shuffles look up
 * within a lane). */
#define U8_TL (U8_CARRY | U8_TOO_LARGE | U8_TOO_LARGE_1000)
#define U8_CONT2 (U8_TOO_LONG | U8_OVERLONG_2 | U8_TWO_CONTS)
static const uint8_t u8_byte_1_high[16] __attribute__((aligned(16))) = {
    U8_TOO_LONG,
    U8_TOO_LONG,
    U8_TOO_LONG,
    U8_TOO_LONG,
    U8_TOO_LONG,
    U8_TOO_LONG,
    U8_TOO_LONG,
    U8_TOO_LONG,
    U8_TWO_CONTS,
    U8_TWO_CONTS,
    U8_TWO_CONTS,
    U8_TWO_CONTS,
    U8_TOO_SHORT | U8_OVERLONG_2,
    U8_TOO_SHORT,
    U8_TOO_SHORT | U8_OVERLONG_3 | U8_SURROGATE,
    U8_TOO_SHORT | U8_TOO_LARGE | U8_TOO_LARGE_1000 | U8_OVERLONG_4};
static const uint8_t u8_byte_1_low[16]
    __attribute__((aligned(16))) = {U8_CARRY | U8_OVERLONG_3 | U8_OVERLONG_2 | U8_OVERLONG_4,
                                    U8_CARRY | U8_OVERLONG_2,
                                    U8_CARRY,
                                    U8_CARRY,
                                    U8_CARRY | U8_TOO_LARGE,
                                    U8_TL,
                                    U8_TL,
                                    U8_TL,
                                    U8_TL,
                                    U8_TL,
                                    U8_TL,
                                    U8_TL,
                                    U8_TL,
                                    U8_TL | U8_SURROGATE,
                                    U8_TL,
                                    U8_TL};
static const uint8_t u8_byte_2_high[16]
    __attribute__((aligned(16))) = {U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_CONT2 | U8_OVERLONG_3 | U8_TOO_LARGE_1000 | U8_OVERLONG_4,
                                    U8_CONT2 | U8_OVERLONG_3 | U8_TOO_LARGE,
                                    U8_CONT2 | U8_SURROGATE | U8_TOO_LARGE,
                                    U8_CONT2 | U8_SURROGATE | U8_TOO_LARGE,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT,
                                    U8_TOO_SHORT};
#undef U8_TL
#undef U8_CONT2

#define U8_T256(t) _mm256_broadcastsi128_si256(_mm_load_si128((const __m128i *)(const void *)(t)))
/* The 32 bytes ending k before `in`'s first byte: the tail of prev, then in. */
#define U8_PREV(in, prev, k)                                                                       \
    _mm256_alignr_epi8((in), _mm256_permute2x128_si256((prev), (in), 0x21), 16 - (k))

__attribute__((target("avx2"))) static inline __m256i u8_block(__m256i in, __m256i prev)
{
    const __m256i lo4 = _mm256_set1_epi8(0x0f);
    __m256i prev1 = U8_PREV(in, prev, 1);
    __m256i sc = _mm256_and_si256(
        _mm256_and_si256(_mm256_shuffle_epi8(U8_T256(u8_byte_1_high),
                                             _mm256_and_si256(_mm256_srli_epi16(prev1, 4), lo4)),
                         _mm256_shuffle_epi8(U8_T256(u8_byte_1_low), _mm256_and_si256(prev1, lo4))),
        _mm256_shuffle_epi8(U8_T256(u8_byte_2_high),
                            _mm256_and_si256(_mm256_srli_epi16(in, 4), lo4)));
    /* Bytes two after a 3- or 4-byte lead, or three after a 4-byte lead, must be
     * continuations: exactly where TWO_CONTS may, and must, be set. */
    __m256i third = _mm256_subs_epu8(U8_PREV(in, prev, 2), _mm256_set1_epi8(0xe0 - 0x80));
    __m256i fourth = _mm256_subs_epu8(U8_PREV(in, prev, 3), _mm256_set1_epi8(0xf0 - 0x80));
    __m256i must23 = _mm256_and_si256(_mm256_or_si256(third, fourth), _mm256_set1_epi8((char)0x80));
    return _mm256_xor_si256(must23, sc);
}

/* Nonzero where a sequence begun in the last three bytes of in needs bytes after them. */
__attribute__((target("avx2"))) static inline __m256i u8_incomplete(__m256i in)
{
    const __m256i max = _mm256_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         (char)(0xf0 - 1), (char)(0xe0 - 1), (char)(0xc0 - 1));
    return _mm256_subs_epu8(in, max);
}

/* How far ahead the string scanner asks for bytes. A prefetch never faults, even past the end;
 * its address is formed as an integer, so no pointer past the object is made either. */
#define U8_PREFETCH 4096

#undef U8_T256
#undef U8_PREV

#define JDOC_HAVE_X86 1
#endif

/* 0 unset, else JDOC_SIMD_* + 1; set once (the CPU does not change), or by jdoc_simd_select. */
static _Atomic int g_simd;

static int simd_supported(void)
{
#ifdef JDOC_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("popcnt"))
        return JDOC_SIMD_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi") &&
        __builtin_cpu_supports("popcnt"))
        return JDOC_SIMD_AVX2;
    if (__builtin_cpu_supports("sse2"))
        return JDOC_SIMD_SSE2;
#endif
    return JDOC_SIMD_SCALAR;
}

int jdoc_simd_select(int max)
{
    int best = simd_supported();
    int level = max < best ? max : best;
    if (level < JDOC_SIMD_SCALAR)
        level = JDOC_SIMD_SCALAR;
    atomic_store_explicit(&g_simd, level + 1, memory_order_relaxed);
    return level;
}

/* The length of the well-formed multi-byte UTF-8 sequence at p (p[0] >= 0x80, avail bytes
 * readable), or 0 when it is ill-formed or cut short (RFC 3629 table 3-7). */
static inline size_t utf8_seq_len(const unsigned char *p, size_t avail)
{
    unsigned char c = p[0], lo = 0x80, hi = 0xBF;
    size_t need;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
    } else if (c == 0xE0) {
        need = 2;
        lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
        need = 2;
    } else if (c == 0xED) {
        need = 2;
        hi = 0x9F;
    } else if (c == 0xF0) {
        need = 3;
        lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
        need = 3;
    } else if (c == 0xF4) {
        need = 3;
        hi = 0x8F;
    } else {
        return 0;
    }
    if (avail <= need || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t k = 2; k <= need; k++)
        if ((p[k] & 0xC0) != 0x80)
            return 0;
    return need + 1;
}

/* One byte that ends a plain run, p[*ip], inside the string whose quote is at *pos: the closing
 * quote (1, *pos left after it), an escape or a non-ASCII sequence (0, *ip moved past it), or
 * an error (-1). */
static inline __attribute__((always_inline)) int scan_special(jdoc_t *d, size_t *pos, size_t *ip,
                                                              uint8_t *flags)
{
    const unsigned char *p = (const unsigned char *)d->src;
    size_t n = d->srclen, i = *ip;
    unsigned char c = p[i];
    if (c == '"') {
        *pos = i + 1;
        return 1;
    }
    if (c == '\\') {
        *flags |= JF_ESC;
        if (over_budget_now(d, 1))
            return fail(d, over_budget, i);
        if (i + 1 >= n)
            return fail(d, "unterminated string", *pos);
        switch (p[i + 1]) {
        case '/':
            *flags |= JF_REESC;
            *ip = i + 2;
            return 0;
        case '"':
        case '\\':
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't':
            *ip = i + 2;
            return 0;
        case 'u':
            *flags |= JF_REESC;
            break;
        default:
            return fail(d, "invalid escape in string", i);
        }
        if (i + 6 > n)
            return fail(d, "truncated \\u escape", i);
        int32_t cp = hex4(p + i + 2);
        if (cp < 0)
            return fail(d, "invalid \\u escape", i);
        if (cp >= 0xDC00 && cp <= 0xDFFF)
            return fail(d, "lone surrogate in \\u escape", i);
        if (cp >= 0xD800 && cp <= 0xDBFF) {
            if (i + 12 > n || p[i + 6] != '\\' || p[i + 7] != 'u')
                return fail(d, "lone surrogate in \\u escape", i);
            int32_t lo = hex4(p + i + 8);
            if (lo < 0xDC00 || lo > 0xDFFF)
                return fail(d, "lone surrogate in \\u escape", i);
            *ip = i + 12;
        } else {
            *ip = i + 6;
        }
        return 0;
    }
    if (c < 0x20)
        return fail(d, "control character in string", i);
    /* Non-ASCII: one well-formed UTF-8 sequence (RFC 3629 table 3-7). */
    if (over_budget_now(d, 1))
        return fail(d, over_budget, i);
    size_t len = utf8_seq_len(p + i, n - i);
    if (len == 0)
        return fail(d, "invalid UTF-8 in string", i);
    *ip = i + len;
    return 0;
}

/* Scan the string from *ip (inside the string whose quote is at *pos) through at least byte
 * `through`, a special byte at a time; 1 when the string ended first, 0 or -1 as scan_special. */
static inline __attribute__((always_inline)) int scan_through(jdoc_t *d, size_t *pos, size_t *ip,
                                                              size_t through, uint8_t *flags,
                                                              const plain_run_fn run,
                                                              const uint8_t *special)
{
    const unsigned char *p = (const unsigned char *)d->src;
    size_t n = d->srclen, i = *ip;
    do {
        /* Plain ASCII runs are most of every prompt: 32, 16 or 8 bytes per step. */
        i = run(p, i, n);
        while (i < n && !special[p[i]])
            i++;
        if (i >= n)
            return fail(d, "unterminated string", *pos);
        int r = scan_special(d, pos, &i, flags);
        if (r != 0)
            return r;
    } while (i <= through);
    *ip = i;
    return 0;
}

/* Validate the string starting at the quote at *pos; leaves *pos after the closing quote. */
static inline __attribute__((always_inline)) int scan_string_with(jdoc_t *d, size_t *pos,
                                                                  uint8_t *flags,
                                                                  const plain_run_fn run,
                                                                  const uint8_t *special)
{
    size_t i = *pos + 1;
    int r = scan_through(d, pos, &i, SIZE_MAX, flags, run, special);
    return r < 0 ? -1 : 0;
}

typedef int (*scan_string_fn)(jdoc_t *d, size_t *pos, uint8_t *flags);

/* One copy of the string scanner per vector unit, each with its plain-run loop inlined. */
static int scan_string_swar(jdoc_t *d, size_t *pos, uint8_t *flags)
{
    return scan_string_with(d, pos, flags, plain_run_swar, str_special);
}

#ifdef JDOC_HAVE_X86
__attribute__((target("sse2"))) static int scan_string_sse2(jdoc_t *d, size_t *pos, uint8_t *flags)
{
    return scan_string_with(d, pos, flags, plain_run_sse2, str_special);
}

__attribute__((target("avx2"))) static int scan_string_avx2(jdoc_t *d, size_t *pos, uint8_t *flags)
{
    return scan_string_with(d, pos, flags, plain_run_avx2, str_special);
}

/* ---- strings 64 bytes at a time, escapes as bit masks (AVX2 and AVX-512)
 * -------------------------- */

/* The bytes right after each run of backslashes of odd length: the escaped characters other
 * than a backslash. A run that starts on an even bit ends, counted with its escaped byte, on
 * an odd one exactly when its length is odd, and the other way round; adding a run's first
 * bit to the run carries to the byte after it. Langdale and Lemire, "Parsing Gigabytes of JSON
 * per Second" (2019), section 3.1.1. The caller keeps a run that reaches bit 63 out of use:
 * its carry leaves the word. */
static inline uint64_t escaped_after_odd_runs(uint64_t bs)
{
    const uint64_t even = 0x5555555555555555ull;
    uint64_t starts = bs & ~(bs << 1);
    uint64_t after_even = (bs + (starts & even)) & ~bs;
    uint64_t after_odd = (bs + (starts & ~even)) & ~bs;
    return (after_even & ~even) | (after_odd & even);
}

/* For each byte b < 0x80: b itself when "\\b" is an escape the block scanner takes as it is
 * ('"' b f n r t, which RFC 8785 writes as they are, and '/', which it writes unescaped: the
 * scanner marks the string JF_REESC; a backslash never follows an odd run), else 0xFF, a byte
 * a document that passed the UTF-8 check never holds. "\\u" is left to scan_special (its hex
 * digits and surrogates are checked there). */
static const uint8_t esc_kept[128] __attribute__((aligned(64))) = {
    /* 0x00 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x08 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x10 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x18 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x20 */ 0xff, 0xff, '"',  0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x28 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '/',
    /* 0x30 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x38 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x40 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x48 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x50 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x58 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
    /* 0x60 */ 0xff, 0xff, 'b',  0xff, 0xff, 0xff, 'f',  0xff,
    /* 0x68 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 'n',  0xff,
    /* 0x70 */ 0xff, 0xff, 'r',  0xff, 't',  0xff, 0xff, 0xff,
    /* 0x78 */ 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
};

/* The masks of one 64-byte block at p: its quotes, backslashes, controls and non-ASCII bytes. */
typedef struct {
    uint64_t q, bs, ctl, hi;
} blk_masks_t;

/* UTF-8 validation as the block scanner goes: the error bits so far, and those of a sequence
 * the last 32 bytes validated leave unfinished (an error if ASCII comes next). */
typedef struct {
    __m256i err, pend;
} u8_acc_t;

/* The 32 bytes before p[i] (NULs before the document's start). */
__attribute__((target("avx2"))) static inline __m256i u8_before(const unsigned char *p, size_t i)
{
    if (i >= 32)
        return _mm256_loadu_si256((const __m256i *)(const void *)(p + i - 32));
    unsigned char t[32] = {0};
    memcpy(t + 32 - i, p, i);
    return _mm256_loadu_si256((const __m256i *)(const void *)t);
}

/* 32 bytes `in` after `prev`, as utf8_valid_avx2 takes them. */
__attribute__((target("avx2"))) static inline void u8_feed(u8_acc_t *a, __m256i in, __m256i prev)
{
    if (_mm256_movemask_epi8(in) == 0) {
        a->err = _mm256_or_si256(a->err, a->pend);
        a->pend = _mm256_setzero_si256();
    } else {
        a->err = _mm256_or_si256(a->err, u8_block(in, prev));
        a->pend = u8_incomplete(in);
    }
}

/* p[i, end), 32 bytes a step after the bytes before i; the last step padded with NULs, so a
 * sequence cut at end is an error (end follows an ASCII byte, or the string is refused). */
__attribute__((target("avx2"))) static inline void u8_span(u8_acc_t *a, const unsigned char *p,
                                                           size_t i, size_t end)
{
    __m256i prev = u8_before(p, i);
    for (; i < end; i += 32) {
        __m256i in;
        if (end - i >= 32) {
            in = _mm256_loadu_si256((const __m256i *)(const void *)(p + i));
        } else {
            unsigned char t[32] = {0};
            memcpy(t, p + i, end - i);
            in = _mm256_loadu_si256((const __m256i *)(const void *)t);
        }
        u8_feed(a, in, prev);
        prev = in;
    }
}

/* The 64-byte block at p[i], whose non-ASCII bytes are `hi` (the scanner's mask). */
__attribute__((target("avx2"))) static inline void u8_block64(u8_acc_t *a, const unsigned char *p,
                                                              size_t i, uint64_t hi)
{
    if (hi == 0) { /* most blocks of most prompts */
        a->err = _mm256_or_si256(a->err, a->pend);
        a->pend = _mm256_setzero_si256();
        return;
    }
    __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)(p + i));
    __m256i up = _mm256_loadu_si256((const __m256i *)(const void *)(p + i + 32));
    u8_feed(a, lo, u8_before(p, i));
    u8_feed(a, up, lo);
}

/* The string's bytes in the block at p[i] through its closing quote at i + e. */
__attribute__((target("avx2"))) static inline void u8_last(u8_acc_t *a, const unsigned char *p,
                                                           size_t i, unsigned e, uint64_t hi)
{
    uint64_t upto = e == 63 ? ~0ull : (2ull << e) - 1;
    if ((hi & upto) == 0 && _mm256_testz_si256(a->pend, a->pend))
        return; /* ASCII after a finished sequence: nothing to check */
    u8_span(a, p, i, i + e + 1);
}

/* Each 64-byte block gives masks of its quotes, backslashes, controls and non-ASCII bytes,
 * and, when it holds a backslash, of the bytes that may follow one as they are and of its
 * slashes; from them, with no branch per escape, the escaped bytes, the closing quote and
 * whether anything needs a closer look: a control, "\\u", an invalid escape or a budget about to
 * run out. Such a block, and the tail shorter than 64 bytes, go through scan_special a byte at
 * a time as at every other level. UTF-8 is validated as the string goes, 32 bytes a step
 * (utf8_valid_avx2's method) only where a block holds non-ASCII bytes, while they are in the
 * cache: one pass over a prompt instead of two. A string that fails anything is scanned again
 * by the checking scanner (scan_string_avx2), from its quote, so errors and their positions
 * are the same as at every other level. One loop for both vector widths: `masks`, `kept` and
 * `slashes` read the block at p. */
__attribute__((target("avx2,bmi,popcnt"))) static inline __attribute__((always_inline)) int
scan_string_blocks(jdoc_t *d, size_t *pos, uint8_t *flags,
                   size_t (*const plain)(const unsigned char *p, size_t i, size_t n),
                   void (*const masks)(const unsigned char *p, blk_masks_t *m),
                   uint64_t (*const kept_of)(const unsigned char *p),
                   uint64_t (*const slashes)(const unsigned char *p))
{
    const unsigned char *p = (const unsigned char *)d->src;
    const size_t n = d->srclen, quote = *pos;
    const uint32_t nslow = d->nslow;
    const uint8_t flags0 = *flags;
    u8_acc_t u8 = {_mm256_setzero_si256(), _mm256_setzero_si256()};
    size_t i = quote + 1;
    for (;;) {
        size_t through = SIZE_MAX; /* where the byte loop may hand back; the end by default */
        while (i + 64 <= n) {
            /* Most of a prompt is blocks of plain ASCII (no quote, backslash or control): they
             * are passed over by a loop that tests nothing else, and an unfinished UTF-8
             * sequence before them is an error, as u8_block64 has it. */
            size_t j = plain(p, i, n);
            if (j != i) {
                u8.err = _mm256_or_si256(u8.err, u8.pend);
                u8.pend = _mm256_setzero_si256();
                i = j;
                if (i + 64 > n)
                    break;
            }
            blk_masks_t m;
            masks(p + i, &m);
            __builtin_prefetch((const void *)((uintptr_t)p + i + U8_PREFETCH));
            uint64_t q = m.q, bs = m.bs, ctl = m.ctl;
            if (bs == 0) { /* most blocks: no escape, and a key or value ends at its first quote */
                uint64_t in = q ? (q & -q) - 1 : ~0ull;
                if (ctl & in) {
                    through = i + (size_t)__builtin_ctzll(ctl & in);
                    break;
                }
                if (q) {
                    unsigned e = (unsigned)__builtin_ctzll(q);
                    u8_last(&u8, p, i, e, m.hi);
                    *pos = i + e + 1;
                    goto done;
                }
                u8_block64(&u8, p, i, m.hi);
                i += 64;
                continue;
            }
            uint64_t kept = kept_of(p + i);
            /* A run of backslashes that reaches the block's end starts the next block (a
             * branch, not arithmetic on the masks: the next block's load must not wait for
             * this block's). */
            uint64_t avail = ~0ull;
            size_t step = 64;
            if (__builtin_expect((int64_t)bs < 0, 0)) {
                if (~bs == 0) {
                    through = i + 63;
                    break;
                }
                unsigned run = (unsigned)__builtin_clzll(~bs); /* the run's length */
                step = 64 - run;
                avail = ~0ull >> run;
            }
            uint64_t escd = escaped_after_odd_runs(bs);
            uint64_t end = q & ~escd & avail;
            uint64_t in = end ? (end & -end) - 1 : avail; /* the string's bytes in this block */
            uint64_t bad = (ctl | (escd & ~kept)) & in;
            if (bad) {
                /* The byte loop takes the rest of this block and the next three (a few
                 * hundred bytes at its own pace), so a body with a rare escape every block or
                 * so, or dense with them, is not scanned a block at a time only to hand one
                 * escape over each time (such a body at AVX-512 took twice AVX2's time). */
                through = i + 255;
                break;
            }
            /* every escape is two bytes: "\\\\" or a backslash and an escaped byte */
            uint32_t nesc =
                (uint32_t)(__builtin_popcountll(bs & in) + __builtin_popcountll(escd & in)) / 2;
            if (nesc) {
                if ((uint64_t)d->ntoks * JDOC_TOKEN_UNITS + d->nslow + nesc > d->budget) {
                    through = i + 63; /* the byte loop finds the escape that runs it out */
                    break;
                }
                d->nslow += nesc;
                *flags |= JF_ESC;
                /* "\\/" (PHP's json_encode writes every '/' so): RFC 8785 writes '/' */
                if (slashes(p + i) & escd & in)
                    *flags |= JF_REESC;
            }
            if (end) {
                unsigned e = (unsigned)__builtin_ctzll(end);
                u8_last(&u8, p, i, e, m.hi);
                *pos = i + e + 1;
                goto done;
            }
            if (step == 64)
                u8_block64(&u8, p, i, m.hi);
            else if ((m.hi & avail) || !_mm256_testz_si256(u8.pend, u8.pend))
                u8_span(&u8, p, i, i + step); /* the run of backslashes after it: ASCII */
            i += step;
        }
        size_t from = i;
        int r = scan_through(d, pos, &i, through, flags, plain_run_avx2_utf8ok, str_special_utf8ok);
        if (r < 0)
            goto again;
        u8_span(&u8, p, from, r ? *pos : i); /* both follow an ASCII byte */
        if (r)
            goto done;
    }
done:
    if (_mm256_testz_si256(u8.err, u8.err))
        return 0;
again:
    d->nslow = nslow;
    *flags = flags0;
    *pos = quote;
    return scan_string_avx2(d, pos, flags);
}

/* From p[i], the 64-byte blocks that hold only bytes 0x20-0x7f other than '"' and '\\': the
 * offset of the first block that holds another, or of the first that is not whole. A signed
 * compare with 0x20 finds controls and non-ASCII bytes (0x80-0xff are negative) at once. A page
 * ahead is asked for: this is the first pass over a body that arrived a read at a time, among
 * many clients' bodies, so its bytes have mostly left the cache (a 254 KiB prompt not in cache:
 * 47 us for the whole parse without, 32 us with). */
__attribute__((target("avx2"))) static inline size_t plain_blocks_avx2(const unsigned char *p,
                                                                       size_t i, size_t n)
{
    const __m256i sp = _mm256_set1_epi8(0x20), quote = _mm256_set1_epi8('"'),
                  bslash = _mm256_set1_epi8('\\');
    for (; i + 64 <= n; i += 64) {
        __builtin_prefetch((const void *)((uintptr_t)p + i + U8_PREFETCH));
        __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)(p + i));
        __m256i hi = _mm256_loadu_si256((const __m256i *)(const void *)(p + i + 32));
        __m256i bad = _mm256_or_si256(
            _mm256_or_si256(_mm256_cmpgt_epi8(sp, lo), _mm256_cmpgt_epi8(sp, hi)),
            _mm256_or_si256(
                _mm256_or_si256(_mm256_cmpeq_epi8(lo, quote), _mm256_cmpeq_epi8(hi, quote)),
                _mm256_or_si256(_mm256_cmpeq_epi8(lo, bslash), _mm256_cmpeq_epi8(hi, bslash))));
        if (!_mm256_testz_si256(bad, bad))
            break;
    }
    return i;
}

/* 64 bytes as two halves of 32. */
__attribute__((target("avx2"))) static inline void blk_masks_avx2(const unsigned char *p,
                                                                  blk_masks_t *m)
{
    const __m256i quote = _mm256_set1_epi8('"'), bslash = _mm256_set1_epi8('\\'),
                  c = _mm256_set1_epi8(0x1f);
    __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)p);
    __m256i hi = _mm256_loadu_si256((const __m256i *)(const void *)(p + 32));
#define BLK_MASK(v) ((uint64_t)(uint32_t)_mm256_movemask_epi8(v))
    m->q = BLK_MASK(_mm256_cmpeq_epi8(lo, quote)) | BLK_MASK(_mm256_cmpeq_epi8(hi, quote)) << 32;
    m->bs = BLK_MASK(_mm256_cmpeq_epi8(lo, bslash)) | BLK_MASK(_mm256_cmpeq_epi8(hi, bslash)) << 32;
    m->ctl = BLK_MASK(_mm256_cmpeq_epi8(_mm256_min_epu8(lo, c), lo)) | /* x <= 0x1f */
             BLK_MASK(_mm256_cmpeq_epi8(_mm256_min_epu8(hi, c), hi)) << 32;
    m->hi = BLK_MASK(lo) | BLK_MASK(hi) << 32;
}

/* The bytes esc_kept keeps ('"' b f n r t /), each half by seven compares. */
__attribute__((target("avx2"))) static inline __m256i kept_half_avx2(__m256i x)
{
    __m256i k = _mm256_cmpeq_epi8(x, _mm256_set1_epi8('"'));
    k = _mm256_or_si256(k, _mm256_cmpeq_epi8(x, _mm256_set1_epi8('b')));
    k = _mm256_or_si256(k, _mm256_cmpeq_epi8(x, _mm256_set1_epi8('f')));
    k = _mm256_or_si256(k, _mm256_cmpeq_epi8(x, _mm256_set1_epi8('n')));
    k = _mm256_or_si256(k, _mm256_cmpeq_epi8(x, _mm256_set1_epi8('r')));
    k = _mm256_or_si256(k, _mm256_cmpeq_epi8(x, _mm256_set1_epi8('t')));
    return _mm256_or_si256(k, _mm256_cmpeq_epi8(x, _mm256_set1_epi8('/')));
}

__attribute__((target("avx2"))) static inline uint64_t kept_avx2(const unsigned char *p)
{
    __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)p);
    __m256i hi = _mm256_loadu_si256((const __m256i *)(const void *)(p + 32));
    return BLK_MASK(kept_half_avx2(lo)) | BLK_MASK(kept_half_avx2(hi)) << 32;
}

__attribute__((target("avx2"))) static inline uint64_t slashes_avx2(const unsigned char *p)
{
    const __m256i sl = _mm256_set1_epi8('/');
    __m256i lo = _mm256_loadu_si256((const __m256i *)(const void *)p);
    __m256i hi = _mm256_loadu_si256((const __m256i *)(const void *)(p + 32));
    return BLK_MASK(_mm256_cmpeq_epi8(lo, sl)) | BLK_MASK(_mm256_cmpeq_epi8(hi, sl)) << 32;
}
#undef BLK_MASK

#define X512_ATTR __attribute__((target("avx2,avx512f,avx512bw,avx512vbmi,bmi,popcnt")))

/* plain_blocks_avx2 with one 64-byte vector. */
X512_ATTR static inline size_t plain_blocks_avx512(const unsigned char *p, size_t i, size_t n)
{
    const __m512i sp = _mm512_set1_epi8(0x20), quote = _mm512_set1_epi8('"'),
                  bslash = _mm512_set1_epi8('\\');
    for (; i + 64 <= n; i += 64) {
        __builtin_prefetch((const void *)((uintptr_t)p + i + U8_PREFETCH));
        __m512i x = _mm512_loadu_si512((const void *)(p + i));
        __mmask64 ok = _mm512_cmpge_epi8_mask(x, sp);
        ok = _mm512_mask_cmpneq_epi8_mask(ok, x, quote);
        ok = _mm512_mask_cmpneq_epi8_mask(ok, x, bslash);
        if (~ok)
            break;
    }
    return i;
}

X512_ATTR static inline void blk_masks_avx512(const unsigned char *p, blk_masks_t *m)
{
    __m512i x = _mm512_loadu_si512((const void *)p);
    m->q = _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8('"'));
    m->bs = _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8('\\'));
    m->ctl = _mm512_cmplt_epu8_mask(x, _mm512_set1_epi8(0x20));
    m->hi = _mm512_movepi8_mask(x);
}

/* One byte lookup for all 64 (VBMI): a byte is kept where esc_kept maps it to itself. */
X512_ATTR static inline uint64_t kept_avx512(const unsigned char *p)
{
    __m512i x = _mm512_loadu_si512((const void *)p);
    __m512i lo = _mm512_load_si512((const void *)esc_kept),
            hi = _mm512_load_si512((const void *)(esc_kept + 64));
    return _mm512_cmpeq_epi8_mask(_mm512_permutex2var_epi8(lo, x, hi), x);
}

X512_ATTR static inline uint64_t slashes_avx512(const unsigned char *p)
{
    return _mm512_cmpeq_epi8_mask(_mm512_loadu_si512((const void *)p), _mm512_set1_epi8('/'));
}

X512_ATTR static __attribute__((noinline)) int scan_string_avx512_long(jdoc_t *d, size_t *pos,
                                                                       uint8_t *flags)
{
    return scan_string_blocks(d, pos, flags, plain_blocks_avx512, blk_masks_avx512, kept_avx512,
                              slashes_avx512);
}

/* Keys and short values, most strings of every request, end in the 64 bytes after their quote
 * with nothing before the closing quote to look at (no backslash, control or non-ASCII byte):
 * they are done here, without the block loop's frame. */
X512_ATTR static int scan_string_avx512_blocks(jdoc_t *d, size_t *pos, uint8_t *flags)
{
    const unsigned char *p = (const unsigned char *)d->src;
    size_t i = *pos + 1;
    if (i + 64 <= d->srclen) {
        __m512i x = _mm512_loadu_si512((const void *)(p + i));
        uint64_t q = _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8('"'));
        uint64_t other = _mm512_cmplt_epi8_mask(x, _mm512_set1_epi8(0x20)) |
                         _mm512_cmpeq_epi8_mask(x, _mm512_set1_epi8('\\'));
        if (q && (other & ((q & -q) - 1)) == 0) {
            *pos = i + (size_t)__builtin_ctzll(q) + 1;
            return 0;
        }
    }
    return scan_string_avx512_long(d, pos, flags);
}
#undef X512_ATTR

/* The same 64 bytes a step with AVX2 (two 32-byte halves). */
__attribute__((target("avx2,bmi,popcnt"))) static __attribute__((noinline)) int
scan_string_avx2_long(jdoc_t *d, size_t *pos, uint8_t *flags)
{
    return scan_string_blocks(d, pos, flags, plain_blocks_avx2, blk_masks_avx2, kept_avx2,
                              slashes_avx2);
}

/* scan_string_avx512_blocks's short strings, 32 bytes at a time. */
__attribute__((target("avx2,bmi,popcnt"))) static int
scan_string_avx2_blocks(jdoc_t *d, size_t *pos, uint8_t *flags)
{
    const unsigned char *p = (const unsigned char *)d->src;
    size_t i = *pos + 1;
    if (i + 32 <= d->srclen) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)(p + i));
        uint32_t q = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(x, _mm256_set1_epi8('"')));
        uint32_t other = (uint32_t)_mm256_movemask_epi8(
            _mm256_or_si256(_mm256_cmpgt_epi8(_mm256_set1_epi8(0x20), x),
                            _mm256_cmpeq_epi8(x, _mm256_set1_epi8('\\'))));
        if (q && (other & ((q & -q) - 1)) == 0) {
            *pos = i + (size_t)__builtin_ctz(q) + 1;
            return 0;
        }
    }
    return scan_string_avx2_long(d, pos, flags);
}
#endif

/* The level in use: the best the CPU has unless jdoc_simd_select chose one. */
static int simd_level(void)
{
    int v = atomic_load_explicit(&g_simd, memory_order_relaxed);
    return v ? v - 1 : jdoc_simd_select(JDOC_SIMD_BEST);
}

/* With AVX2 or AVX-512, strings 64 bytes a step, UTF-8 validated as they go
 * (scan_string_blocks). Both levels validate 32 bytes a step: a 64-byte validator (three VBMI
 * byte permutes for the bytes before each block) measured 1.5-2x the AVX2 one's time on an
 * Intel Xeon, where those permutes are several micro-ops each, and gained only 12% on an AMD
 * EPYC (bench/PROFILE.md). */
static scan_string_fn scan_string_pick(void)
{
    switch (simd_level()) {
#ifdef JDOC_HAVE_X86
    case JDOC_SIMD_AVX512:
        return scan_string_avx512_blocks;
    case JDOC_SIMD_AVX2:
        return scan_string_avx2_blocks;
    case JDOC_SIMD_SSE2:
        return scan_string_sse2;
#endif
    default:
        return scan_string_swar;
    }
}

static bool is_digit(unsigned char c)
{
    return c >= '0' && c <= '9';
}

/* The powers of ten a double holds exactly. */
static const double exact_pow10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                     1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                     1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* A validated number whose digits, read as an integer, are at most 2^53 and whose power of ten
 * is within 10^-22..10^22 (0.9, 1e-3, 1234.5): both are exact doubles, so one IEEE multiply or
 * divide rounds the value once, to the same double strtod's correct rounding gives (Clinger,
 * "How to read floating point numbers accurately", 1990). false for the others, which
 * strtod reads. */
static bool num_exact(const char *p, size_t len, double *out)
{
#if FLT_EVAL_METHOD != 0
    return false; /* an extended-precision intermediate would round twice */
#endif
    size_t i = p[0] == '-' ? 1 : 0;
    uint64_t m = 0;
    int digits = 0, e = 0;
    for (; i < len && is_digit((unsigned char)p[i]); i++) {
        if (++digits > 19)
            return false;
        m = m * 10 + (uint64_t)(p[i] - '0');
    }
    if (i < len && p[i] == '.') {
        for (i++; i < len && is_digit((unsigned char)p[i]); i++, e--) {
            if (++digits > 19)
                return false;
            m = m * 10 + (uint64_t)(p[i] - '0');
        }
    }
    if (i < len && (p[i] == 'e' || p[i] == 'E')) {
        bool eneg = ++i < len && p[i] == '-';
        if (i < len && (p[i] == '-' || p[i] == '+'))
            i++;
        int x = 0;
        for (; i < len && is_digit((unsigned char)p[i]); i++) {
            if (x > 1000)
                return false;
            x = x * 10 + (p[i] - '0');
        }
        e += eneg ? -x : x;
    }
    if (i != len || m > (1ull << 53) || e < -22 || e > 22)
        return false;
    double v = e < 0 ? (double)m / exact_pow10[-e] : (double)m * exact_pow10[e];
    *out = p[0] == '-' ? -v : v;
    return true;
}

/* strtod wants a terminator; numbers are short, so copy to the stack. */
static double num_value(const char *p, size_t len)
{
    double v;
    if (len > 0 && num_exact(p, len, &v))
        return v;
    char tmp[64];
    if (len < sizeof(tmp)) {
        memcpy(tmp, p, len);
        tmp[len] = '\0';
        return strtod(tmp, NULL);
    }
    char *h = dp_xstrndup(p, len);
    v = strtod(h, NULL);
    free(h);
    return v;
}

static int scan_number(jdoc_t *d, size_t *pos, uint8_t *flags)
{
    const unsigned char *p = (const unsigned char *)d->src;
    size_t n = d->srclen, i = *pos, start = *pos, intdigits = 1;
    uint8_t f = JF_INT;
    long exp = 0;
    if (p[i] == '-') {
        f |= JF_NEG;
        i++;
    }
    if (i >= n)
        return fail(d, "invalid number", start);
    if (p[i] == '0') {
        i++;
    } else if (p[i] >= '1' && p[i] <= '9') {
        size_t d0 = i;
        while (i < n && is_digit(p[i]))
            i++;
        intdigits = i - d0;
    } else {
        return fail(d, "invalid number", start);
    }
    if (i < n && p[i] == '.') {
        f &= (uint8_t)~JF_INT;
        i++;
        if (i >= n || !is_digit(p[i]))
            return fail(d, "invalid number", start);
        while (i < n && is_digit(p[i]))
            i++;
    }
    if (i < n && (p[i] == 'e' || p[i] == 'E')) {
        bool eneg = false;
        f &= (uint8_t)~JF_INT;
        i++;
        if (i < n && (p[i] == '+' || p[i] == '-'))
            eneg = p[i++] == '-';
        if (i >= n || !is_digit(p[i]))
            return fail(d, "invalid number", start);
        while (i < n && is_digit(p[i])) {
            if (exp < 100000)
                exp = exp * 10 + (p[i] - '0');
            i++;
        }
        if (eneg)
            exp = -exp;
    }
    *pos = i;
    *flags = f;
    /* No request needs a longer number, and strtod on megabytes of digits would stall the
     * event loop (cJSON refuses anything past 63 characters). */
    if (i - start > JDOC_MAX_NUMBER)
        return fail(d, "number too long", start);
    /* A number that overflows a double has no canonical form (RFC 8785 §3.2.2.3) and means
     * different things to different backends: refuse it. |v| < 10^(intdigits + exp), so only
     * numbers near DBL_MAX's 10^308 need strtod's verdict; 1e-5 and 2.5E+3 skip it. */
    if ((long)intdigits + exp > 300 && !isfinite(num_value(d->src + start, i - start)))
        return fail(d, "number out of range", start);
    return 0;
}

static int key_cmp(const jdoc_t *d, uint32_t a, uint32_t b)
{
    const char *pa, *pb;
    size_t na, nb;
    jdoc_key(d, a, &pa, &na);
    jdoc_key(d, b, &pb, &nb);
    return jdoc_utf16_cmp(pa, na, pb, nb);
}

/* Sort v[0..n) of key tokens; returns the index i>0 with v[i-1] == v[i] if any duplicate
 * exists, else 0. Insertion sort below 16 keys (request objects), bottom-up merge above, so a
 * hostile object with 100k keys costs n log n. */
static uint32_t sort_keys(jdoc_t *d, uint32_t *v, uint32_t n)
{
    if (n < 2)
        return 0;
    if (n <= 16) {
        for (uint32_t i = 1; i < n; i++) {
            uint32_t x = v[i], j = i;
            while (j > 0 && key_cmp(d, v[j - 1], x) > 0) {
                v[j] = v[j - 1];
                j--;
            }
            v[j] = x;
        }
    } else {
        if (d->tmpcap < n) {
            d->tmp = dp_xrealloc(d->tmp, (size_t)n * sizeof(uint32_t));
            d->tmpcap = n;
        }
        uint32_t *src = v, *dst = d->tmp;
        for (uint32_t w = 1; w < n; w *= 2) {
            for (uint32_t lo = 0; lo < n; lo += 2 * w) {
                uint32_t mid = lo + w < n ? lo + w : n;
                uint32_t hi = lo + 2 * w < n ? lo + 2 * w : n;
                uint32_t a = lo, b = mid, k = lo;
                while (a < mid && b < hi)
                    dst[k++] = key_cmp(d, src[a], src[b]) <= 0 ? src[a++] : src[b++];
                while (a < mid)
                    dst[k++] = src[a++];
                while (b < hi)
                    dst[k++] = src[b++];
            }
            uint32_t *t = src;
            src = dst;
            dst = t;
        }
        if (src != v)
            memcpy(v, src, (size_t)n * sizeof(uint32_t));
    }
    for (uint32_t i = 1; i < n; i++)
        if (key_cmp(d, v[i - 1], v[i]) == 0)
            return i;
    return 0;
}

static int close_object(jdoc_t *d, uint32_t obj, int flags)
{
    jtok_t *t = &d->toks[obj];
    if (flags & JDOC_ALLOW_DUPS)
        return 0;
    uint32_t n = t->aux;
    t->aux2 = d->norder;
    if (n == 0)
        return 0; /* also keeps d->order, maybe still NULL, out of pointer arithmetic */
    if (d->norder + n > d->ordercap) {
        uint32_t ncap = d->ordercap ? d->ordercap : 64;
        while (ncap < d->norder + n)
            ncap *= 2;
        d->order = dp_xrealloc(d->order, (size_t)ncap * sizeof(uint32_t));
        d->ordercap = ncap;
    }
    uint32_t base = d->norder, k = 0;
    uint64_t key_bytes = 0;
    for (uint32_t i = obj + 1; i < t->end; i = d->toks[i + 1].end) {
        d->order[base + k++] = i;
        key_bytes += d->toks[i].len;
    }
    assert(k == n); /* aux counted the members: the list fills exactly the room reserved */
    /* The sort compares keys byte by byte at each of its ~log2(n) levels: many long keys
     * sharing a prefix cost far more than their tokens (2,000 keys of 250 bytes: 4 ms). */
    unsigned levels = n > 1 ? 32 - (unsigned)__builtin_clz(n - 1) : 0;
    if (over_budget_now(d, key_bytes * levels / JDOC_KEY_BYTE_LEVELS))
        return fail(d, over_budget, t->start);
    d->norder += n;
    t->aux2 = base;
    uint32_t dup = sort_keys(d, d->order + base, n);
    if (dup) {
        uint32_t a = d->order[base + dup - 1], b = d->order[base + dup];
        uint32_t later = a > b ? a : b;
        d->err_tok = later;
        return fail(d, "duplicate key", d->toks[later].start);
    }
    return 0;
}

/* JSON's four whitespace bytes, as bits of a mask indexed by the byte (all are below 64). */
#define WS_BITS ((1ull << ' ') | (1ull << '\n') | (1ull << '\r') | (1ull << '\t'))

static inline size_t skip_ws(const char *p, size_t n, size_t i)
{
    /* Between tokens there is mostly no whitespace or one space: one compare decides. */
    while (i < n && (unsigned char)p[i] <= ' ' && (WS_BITS >> (unsigned char)p[i] & 1))
        i++;
    return i;
}

enum { S_VALUE, S_KEY_OR_CLOSE, S_KEY, S_VALUE_OR_CLOSE, S_COMMA_OR_CLOSE };

/* The ':' after a key (whitespace first); 0, or -1 (failed). */
static inline __attribute__((always_inline)) int colon(jdoc_t *d, const char *src, size_t n,
                                                       size_t *i)
{
    *i = skip_ws(src, n, *i);
    if (*i >= n || src[*i] != ':')
        return fail(d, "expected ':'", *i);
    (*i)++;
    return 0;
}

/* After a member or an element: a ',' (then *state is the next one's), or the container's
 * close. 0: go on; 1: at the close; -1: failed. */
static inline __attribute__((always_inline)) int
comma_or_close(jdoc_t *d, const char *src, size_t n, size_t *i, bool is_obj, int *state)
{
    if (*i < n && src[*i] == ',') {
        (*i)++;
        *state = is_obj ? S_KEY : S_VALUE;
        return 0;
    }
    if (*i < n && src[*i] == (is_obj ? '}' : ']'))
        return 1;
    return fail(d, is_obj ? "expected ',' or '}'" : "expected ',' or ']'", *i);
}

int jdoc_parse(jdoc_t *d, const char *src, size_t n, int flags)
{
    jdoc_reset(d);
    d->src = src;
    d->srclen = n;
    if (n >= UINT32_MAX)
        return fail(d, "document too large", 0);
    const scan_string_fn scan_string = scan_string_pick();
    uint32_t stack[JDOC_MAX_DEPTH + 1];
    int depth = 0;
    size_t i = skip_ws(src, n, 0);
    if ((flags & JDOC_OBJECT_ONLY) && (i >= n || src[i] != '{'))
        return fail(d, "not a JSON object", i);
    int state = S_VALUE;
    for (;;) {
        if (over_budget_now(d, 0))
            return fail(d, over_budget, i);
        i = skip_ws(src, n, i);
        if (state == S_KEY_OR_CLOSE || state == S_KEY) {
            if (i < n && src[i] == '}' && state == S_KEY_OR_CLOSE)
                goto close;
            if (i >= n || src[i] != '"')
                return fail(d, "expected a string key", i);
            d->toks[stack[depth - 1]].aux++;
            uint8_t f = JF_KEY;
            size_t s = i;
            if (scan_string(d, &i, &f) < 0)
                return -1;
            uint32_t k = push_tok(d, JT_STR, s);
            d->toks[k].len = (uint32_t)(i - s);
            d->toks[k].flags = f;
            if (f & JF_ESC) {
                d->toks[k].aux = (uint32_t)d->keys.len;
                jdoc_unescape(src + s + 1, i - s - 2, &d->keys);
                d->toks[k].aux2 = (uint32_t)(d->keys.len - d->toks[k].aux);
            }
            if (colon(d, src, n, &i) < 0)
                return -1;
            state = S_VALUE;
            continue;
        }
        if (state == S_VALUE_OR_CLOSE) {
            if (i < n && src[i] == ']')
                goto close;
            state = S_VALUE;
        }
        if (state == S_COMMA_OR_CLOSE) {
            int r = comma_or_close(d, src, n, &i, d->toks[stack[depth - 1]].type == JT_OBJ, &state);
            if (r < 0)
                return -1;
            if (r > 0)
                goto close;
            continue;
        }
        /* S_VALUE */
        if (i >= n)
            return fail(d, "unexpected end of input", i);
        if (depth > 0 && d->toks[stack[depth - 1]].type == JT_ARR)
            d->toks[stack[depth - 1]].aux++;
        {
            unsigned char c = (unsigned char)src[i];
            size_t s = i;
            uint32_t t;
            uint8_t f = 0;
            switch (c) {
            case '{':
            case '[':
                if (depth == JDOC_MAX_DEPTH)
                    return fail(d, "nested too deeply", i);
                t = push_tok(d, c == '{' ? JT_OBJ : JT_ARR, s);
                stack[depth++] = t;
                i++;
                state = c == '{' ? S_KEY_OR_CLOSE : S_VALUE_OR_CLOSE;
                continue;
            case '"':
                if (scan_string(d, &i, &f) < 0)
                    return -1;
                t = push_tok(d, JT_STR, s);
                break;
            case 't':
                if (n - i < 4 || memcmp(src + i, "true", 4) != 0)
                    return fail(d, "invalid literal", i);
                i += 4;
                t = push_tok(d, JT_TRUE, s);
                break;
            case 'f':
                if (n - i < 5 || memcmp(src + i, "false", 5) != 0)
                    return fail(d, "invalid literal", i);
                i += 5;
                t = push_tok(d, JT_FALSE, s);
                break;
            case 'n':
                if (n - i < 4 || memcmp(src + i, "null", 4) != 0)
                    return fail(d, "invalid literal", i);
                i += 4;
                t = push_tok(d, JT_NULL, s);
                break;
            default:
                if (c != '-' && !is_digit(c))
                    return fail(d, "unexpected character", i);
                if (scan_number(d, &i, &f) < 0)
                    return -1;
                /* a long literal costs strtod (once to check it, again to canonicalise it) */
                if (over_budget_now(d, (i - s) / JDOC_NUMBER_BYTES))
                    return fail(d, over_budget, s);
                t = push_tok(d, JT_NUM, s);
                break;
            }
            d->toks[t].len = (uint32_t)(i - s);
            d->toks[t].flags = f;
            goto value_done;
        }
    close : {
        assert(depth > 0); /* only a '}' or ']' state reaches here, inside a container */
        uint32_t c = stack[--depth];
        jtok_t *t = &d->toks[c];
        t->end = d->ntoks;
        t->len = (uint32_t)(i + 1 - t->start);
        i++;
        if (t->type == JT_OBJ && close_object(d, c, flags) < 0)
            return -1;
    }
    value_done:
        if (depth == 0) {
            i = skip_ws(src, n, i);
            if (i != n)
                return fail(d, "trailing bytes after the JSON value", i);
            return 0;
        }
        state = S_COMMA_OR_CLOSE;
    }
}

int jdoc_scan_top(jdoc_t *d, const char *src, size_t n,
                  void (*fn)(void *data, const jdoc_t *d, const jdoc_member_t *m), void *data,
                  uint32_t *nmembers)
{
    jdoc_reset(d);
    d->src = src;
    d->srclen = n;
    *nmembers = 0;
    if (n >= UINT32_MAX)
        return fail(d, "document too large", 0);
    const scan_string_fn scan_string = scan_string_pick();
    const uint32_t budget = d->budget;
    d->budget = UINT32_MAX; /* no tape: its work is its bytes' */
    uint64_t objs = 0;      /* bit k: the container k deep (0 = the top level) is an object */
    int depth = 0;
    jdoc_member_t m = {0};
    int rc = -1;
    size_t i = skip_ws(src, n, 0);
    if (i >= n || src[i] != '{') {
        fail(d, "not a JSON object", i);
        goto out;
    }
    int state = S_VALUE;
    for (;;) {
        i = skip_ws(src, n, i);
        if (state == S_KEY_OR_CLOSE || state == S_KEY) {
            if (i < n && src[i] == '}' && state == S_KEY_OR_CLOSE)
                goto close;
            if (i >= n || src[i] != '"') {
                fail(d, "expected a string key", i);
                goto out;
            }
            uint8_t f = JF_KEY;
            size_t s = i;
            if (scan_string(d, &i, &f) < 0)
                goto out;
            if (depth == 1)
                m = (jdoc_member_t){
                    .key_start = (uint32_t)s, .key_len = (uint32_t)(i - s), .key_flags = f};
            if (colon(d, src, n, &i) < 0)
                goto out;
            state = S_VALUE;
            continue;
        }
        if (state == S_VALUE_OR_CLOSE) {
            if (i < n && src[i] == ']')
                goto close;
            state = S_VALUE;
        }
        if (state == S_COMMA_OR_CLOSE) {
            int r = comma_or_close(d, src, n, &i, objs >> (depth - 1) & 1, &state);
            if (r < 0)
                goto out;
            if (r > 0)
                goto close;
            continue;
        }
        /* S_VALUE */
        if (i >= n) {
            fail(d, "unexpected end of input", i);
            goto out;
        }
        {
            unsigned char c = (unsigned char)src[i];
            size_t s = i;
            uint8_t f = 0, type;
            switch (c) {
            case '{':
            case '[':
                if (depth == JDOC_MAX_DEPTH) {
                    fail(d, "nested too deeply", i);
                    goto out;
                }
                if (depth == 1) {
                    m.val_start = (uint32_t)s;
                    m.val_type = c == '{' ? JT_OBJ : JT_ARR;
                }
                objs = c == '{' ? objs | 1ull << depth : objs & ~(1ull << depth);
                depth++;
                i++;
                state = c == '{' ? S_KEY_OR_CLOSE : S_VALUE_OR_CLOSE;
                continue;
            case '"':
                if (scan_string(d, &i, &f) < 0)
                    goto out;
                type = JT_STR;
                break;
            case 't':
            case 'f':
            case 'n': {
                const char *lit = c == 't' ? "true" : c == 'f' ? "false" : "null";
                size_t ln = c == 'f' ? 5 : 4;
                if (n - i < ln || memcmp(src + i, lit, ln) != 0) {
                    fail(d, "invalid literal", i);
                    goto out;
                }
                i += ln;
                type = c == 't' ? JT_TRUE : c == 'f' ? JT_FALSE : JT_NULL;
                break;
            }
            default:
                if (c != '-' && !is_digit(c)) {
                    fail(d, "unexpected character", i);
                    goto out;
                }
                if (scan_number(d, &i, &f) < 0)
                    goto out;
                type = JT_NUM;
                break;
            }
            if (depth == 1) {
                m.val_start = (uint32_t)s;
                m.val_len = (uint32_t)(i - s);
                m.val_type = type;
                m.val_flags = f;
                (*nmembers)++;
                fn(data, d, &m);
            }
            goto value_done;
        }
    close:
        depth--;
        i++;
        if (depth == 1) { /* a member's object or array value ended */
            m.val_len = (uint32_t)(i - m.val_start);
            m.val_flags = 0;
            (*nmembers)++;
            fn(data, d, &m);
        }
    value_done:
        if (depth == 0) {
            i = skip_ws(src, n, i);
            if (i != n) {
                fail(d, "trailing bytes after the JSON value", i);
                goto out;
            }
            rc = 0;
            goto out;
        }
        state = S_COMMA_OR_CLOSE;
    }
out:
    d->budget = budget;
    return rc;
}

void jdoc_key(const jdoc_t *d, uint32_t tok, const char **p, size_t *n)
{
    assert(tok < d->ntoks && (d->toks[tok].flags & JF_KEY));
    const jtok_t *t = &d->toks[tok];
    if (t->flags & JF_ESC) {
        *p = d->keys.base + t->aux;
        *n = t->aux2;
    } else {
        *p = d->src + t->start + 1;
        *n = t->len - 2;
    }
}

uint32_t jdoc_get(const jdoc_t *d, uint32_t obj, const char *name)
{
    assert(obj < d->ntoks);
    const jtok_t *t = &d->toks[obj];
    if (t->type != JT_OBJ)
        return JDOC_NONE;
    size_t nl = strlen(name);
    for (uint32_t i = obj + 1; i < t->end; i = d->toks[i + 1].end) {
        const char *k;
        size_t kn;
        jdoc_key(d, i, &k, &kn);
        if (kn == nl && memcmp(k, name, nl) == 0)
            return i + 1;
    }
    return JDOC_NONE;
}

bool jdoc_str_eq(const jdoc_t *d, uint32_t tok, const char *s)
{
    assert(tok < d->ntoks);
    const jtok_t *t = &d->toks[tok];
    if (t->type != JT_STR)
        return false;
    size_t sl = strlen(s);
    if (!(t->flags & JF_ESC))
        return t->len - 2 == sl && memcmp(d->src + t->start + 1, s, sl) == 0;
    if (t->flags & JF_KEY) {
        const char *k;
        size_t kn;
        jdoc_key(d, tok, &k, &kn);
        return kn == sl && memcmp(k, s, sl) == 0;
    }
    /* Escaped values are rare (a role spelled with \u escapes); decode on the side. */
    dp_buf_t b = {0};
    jdoc_unescape(d->src + t->start + 1, t->len - 2, &b);
    bool eq = b.len == sl && memcmp(b.base, s, sl) == 0;
    dp_buf_free(&b);
    return eq;
}

void jdoc_str_decode(const jdoc_t *d, uint32_t tok, dp_buf_t *out)
{
    assert(tok < d->ntoks && d->toks[tok].type == JT_STR);
    const jtok_t *t = &d->toks[tok];
    if (t->flags & JF_ESC)
        jdoc_unescape(d->src + t->start + 1, t->len - 2, out);
    else
        dp_buf_append(out, d->src + t->start + 1, t->len - 2);
}

double jdoc_num(const jdoc_t *d, uint32_t tok)
{
    assert(tok < d->ntoks && d->toks[tok].type == JT_NUM);
    return num_value(d->src + d->toks[tok].start, d->toks[tok].len);
}

int jdoc_int64(const jdoc_t *d, uint32_t tok, int64_t *out)
{
    assert(tok < d->ntoks);
    const jtok_t *t = &d->toks[tok];
    const char *p = d->src + t->start;
    size_t n = t->len, i = 0;
    bool neg = false;
    if (!(t->flags & JF_INT))
        return -1;
    if (p[0] == '-') {
        neg = true;
        i = 1;
    }
    uint64_t v = 0, lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; i < n; i++) {
        uint64_t dg = (uint64_t)(p[i] - '0');
        if (v > (lim - dg) / 10)
            return -1;
        v = v * 10 + dg;
    }
    *out = neg ? (int64_t)(0 - v) : (int64_t)v;
    return 0;
}

int jdoc_utf16_cmp(const char *a, size_t an, const char *b, size_t bn)
{
    const unsigned char *x = (const unsigned char *)a, *y = (const unsigned char *)b;
    size_t n = an < bn ? an : bn, i = 0;
    while (i < n && x[i] == y[i])
        i++;
    if (i == n)
        return an < bn ? -1 : an > bn ? 1 : 0;
    /* UTF-8 byte order is code point order; UTF-16 differs only where a supplementary character
     * (a surrogate pair, 0xD800..) meets U+E000..U+FFFF. The differing byte's character starts
     * at the same offset in both strings, since everything before it is equal. */
    size_t s = i;
    while (s > 0 && (x[s] & 0xC0) == 0x80)
        s--;
    unsigned char la = x[s], lb = y[s];
    bool a_sup = la >= 0xF0, b_sup = lb >= 0xF0;
    bool a_hi = la == 0xEE || la == 0xEF, b_hi = lb == 0xEE || lb == 0xEF;
    if (a_sup && b_hi)
        return -1;
    if (b_sup && a_hi)
        return 1;
    return x[i] < y[i] ? -1 : 1;
}

/* Writes at w, which has room for the subtree's raw length: dropping whitespace never grows
 * it, since every token and separator is copied from the input. Returns the new end. */
static char *compact(const jdoc_t *d, uint32_t tok, char *w)
{
    const jtok_t *t = &d->toks[tok];
    if (t->type == JT_OBJ) {
        *w++ = '{';
        for (uint32_t i = tok + 1; i < t->end; i = d->toks[i + 1].end) {
            if (i != tok + 1)
                *w++ = ',';
            memcpy(w, d->src + d->toks[i].start, d->toks[i].len);
            w += d->toks[i].len;
            *w++ = ':';
            w = compact(d, i + 1, w);
        }
        *w++ = '}';
    } else if (t->type == JT_ARR) {
        *w++ = '[';
        for (uint32_t i = tok + 1; i < t->end; i = d->toks[i].end) {
            if (i != tok + 1)
                *w++ = ',';
            w = compact(d, i, w);
        }
        *w++ = ']';
    } else {
        memcpy(w, d->src + t->start, t->len);
        w += t->len;
    }
    return w;
}

void jdoc_write_compact(const jdoc_t *d, uint32_t tok, dp_buf_t *out)
{
    dp_buf_reserve(out, d->toks[tok].len);
    char *end = compact(d, tok, out->base + out->len);
    assert((size_t)(end - out->base) - out->len <= d->toks[tok].len); /* within the reserve */
    out->len = (size_t)(end - out->base);
    out->base[out->len] = '\0';
}

void jdoc_put_utf8(dp_buf_t *out, uint32_t cp)
{
    char b[4];
    dp_buf_append(out, b, jdoc_utf8_encode(cp, b));
}

void jdoc_unescape(const char *s, size_t n, dp_buf_t *out)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        const unsigned char *bs = memchr(p + i, '\\', n - i);
        size_t run = bs ? (size_t)(bs - (p + i)) : n - i;
        dp_buf_append(out, s + i, run);
        i += run;
        if (i >= n)
            break;
        char e = s[i + 1];
        i += 2;
        switch (e) {
        case 'b':
            dp_buf_appendc(out, '\b');
            break;
        case 'f':
            dp_buf_appendc(out, '\f');
            break;
        case 'n':
            dp_buf_appendc(out, '\n');
            break;
        case 'r':
            dp_buf_appendc(out, '\r');
            break;
        case 't':
            dp_buf_appendc(out, '\t');
            break;
        case 'u': {
            uint32_t cp = (uint32_t)hex4(p + i);
            i += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                uint32_t lo = (uint32_t)hex4(p + i + 2);
                i += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
            jdoc_put_utf8(out, cp);
            break;
        }
        default: /* '"', '\\', '/' */
            dp_buf_appendc(out, e);
            break;
        }
    }
}
