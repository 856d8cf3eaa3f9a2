/* RFC 8785 JSON Canonicalization Scheme: ECMAScript number printing and canonical
 * serialisation of a validated token tape. */
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "policy/jcs_pow10.h"
#include "policy/jcs.h"

static size_t put_u64(char *o, uint64_t v)
{
    char t[24];
    size_t n = 0;
    do {
        t[n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    for (size_t i = 0; i < n; i++)
        o[i] = t[n - 1 - i];
    return n;
}

/* ---- shortest round-trip digits (Schubfach) -------------------------------------------------
 * R. Giulietti, "The Schubfach way to render doubles" (2020). For v = c 2^q the rounding
 * interval R_v (closed when c is even, as round-half-even reads it back) is scaled by 10^-k so
 * that its width is at most one unit of 10^k; the shortest decimal in R_v is then one of two
 * multiples of 10^(k+1), or one of s, s+1 (the closest, ties to even: ECMA-262 Number::toString
 * step 5). 10^-k comes from a 126-bit table; rop() is the round-to-odd product of section 9.9, so
 * every comparison below is exact. No division, no loop, a few 64x64 multiplies. */

enum { SF_K_MIN = -324, SF_Q_MIN = -1074 };
#define SF_C_MIN (1ULL << 52)
#define SF_MASK63 ((1ULL << 63) - 1)

static inline uint64_t mul_hi(uint64_t a, uint64_t b)
{
    return (uint64_t)(((unsigned __int128)a * b) >> 64);
}

/* floor(log10(2^e)), floor(log10(3/4 2^e)), floor(log2(10^e)) for the exponents used here. */
static inline int flog10pow2(int e)
{
    return (int)((int64_t)e * 661971961083LL >> 41);
}

static inline int flog10_3q_pow2(int e)
{
    return (int)(((int64_t)e * 661971961083LL - 274743187321LL) >> 41);
}

static inline int flog2pow10(int e)
{
    return (int)((int64_t)e * 913124641741LL >> 38);
}

/* cp g 2^-127 rounded to odd (g = g1 2^63 + g0). */
static inline uint64_t rop(uint64_t g1, uint64_t g0, uint64_t cp)
{
    uint64_t x1 = mul_hi(g0, cp);
    uint64_t y0 = g1 * cp;
    uint64_t y1 = mul_hi(g1, cp);
    uint64_t z = (y0 >> 1) + x1;
    uint64_t vbp = y1 + (z >> 63);
    return vbp | (((z & SF_MASK63) + SF_MASK63) >> 63);
}

/* v = c 2^q, c > 0: *f 10^*e is the shortest, closest decimal that reads back as v. */
static void sf_decimal(int q, uint64_t c, uint64_t *f, int *e)
{
    assert(c > 0);
    uint64_t out = c & 1, cb = c << 2, cbr = cb + 2, cbl;
    int k;
    if (c != SF_C_MIN || q == SF_Q_MIN) {
        cbl = cb - 2;
        k = flog10pow2(q);
    } else { /* at a power of two the interval below v is half as wide */
        cbl = cb - 1;
        k = flog10_3q_pow2(q);
    }
    assert(k - SF_K_MIN >= 0 && (size_t)(k - SF_K_MIN) < sizeof(jcs_g) / sizeof(jcs_g[0]));
    int h = q + flog2pow10(-k) + 2;
    uint64_t g1 = jcs_g[k - SF_K_MIN][0], g0 = jcs_g[k - SF_K_MIN][1];
    uint64_t vb = rop(g1, g0, cb << h);
    uint64_t vbl = rop(g1, g0, cbl << h);
    uint64_t vbr = rop(g1, g0, cbr << h);
    uint64_t s = vb >> 2;
    if (s >= 10) { /* Java's Double.toString wants two digits (s >= 100); ECMAScript one */
        uint64_t sp10 = 10 * mul_hi(s, 115292150460684698ULL << 4); /* 10 floor(s / 10) */
        uint64_t tp10 = sp10 + 10;
        bool upin = vbl + out <= sp10 << 2;
        bool wpin = (tp10 << 2) + out <= vbr;
        if (upin != wpin) {
            *f = upin ? sp10 : tp10;
            *e = k;
            return;
        }
    }
    uint64_t t = s + 1;
    bool uin = vbl + out <= s << 2;
    bool win = (t << 2) + out <= vbr;
    *e = k;
    if (uin != win) {
        *f = uin ? s : t;
        return;
    }
    int64_t cmp = (int64_t)(vb - ((s + t) << 1));
    *f = cmp < 0 || (cmp == 0 && (s & 1) == 0) ? s : t;
}

/* Shortest digit string (k digits, no trailing zero) with v == digits 10^(n-k), the closest to
 * v when several of that length read back (ECMA-262 Number::toString step 5). Returns n; v > 0
 * and finite. */
static int shortest(double v, char *out, int *k)
{
    assert(v > 0 && isfinite(v));
    uint64_t bits;
    memcpy(&bits, &v, sizeof(bits));
    uint64_t t = bits & (SF_C_MIN - 1), f;
    int bq = (int)(bits >> 52) & 0x7ff, e;
    if (bq != 0) {
        sf_decimal(bq - 1075, SF_C_MIN | t, &f, &e);
    } else {
        sf_decimal(SF_Q_MIN, t, &f, &e);
    }
    while (f % 10 == 0) {
        f /= 10;
        e++;
    }
    int nd = (int)put_u64(out, f);
    *k = nd;
    return e + nd;
}

size_t jcs_es_number(double v, char *out)
{
    if (!isfinite(v)) {
        memcpy(out, "null", 5);
        return 4;
    }
    if (v == 0) { /* also -0 */
        out[0] = '0';
        out[1] = '\0';
        return 1;
    }
    size_t o = 0;
    if (v < 0) {
        out[o++] = '-';
        v = -v;
    }
    if (v < 9007199254740992.0 && v == floor(v)) {
        o += put_u64(out + o, (uint64_t)v);
        out[o] = '\0';
        return o;
    }
    char dig[24];
    int k, n = shortest(v, dig, &k);
    if (k <= n && n <= 21) {
        memcpy(out + o, dig, (size_t)k);
        o += (size_t)k;
        for (int i = 0; i < n - k; i++)
            out[o++] = '0';
    } else if (0 < n && n <= 21) {
        memcpy(out + o, dig, (size_t)n);
        o += (size_t)n;
        out[o++] = '.';
        memcpy(out + o, dig + n, (size_t)(k - n));
        o += (size_t)(k - n);
    } else if (-6 < n && n <= 0) {
        out[o++] = '0';
        out[o++] = '.';
        for (int i = 0; i < -n; i++)
            out[o++] = '0';
        memcpy(out + o, dig, (size_t)k);
        o += (size_t)k;
    } else {
        int x = n - 1;
        out[o++] = dig[0];
        if (k > 1) {
            out[o++] = '.';
            memcpy(out + o, dig + 1, (size_t)k - 1);
            o += (size_t)k - 1;
        }
        out[o++] = 'e';
        out[o++] = x < 0 ? '-' : '+';
        o += put_u64(out + o, (uint64_t)(x < 0 ? -x : x));
    }
    assert(o < 32); /* the caller's buffer holds 32 bytes */
    out[o] = '\0';
    return o;
}

static int hexv(unsigned char c)
{
    return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
}

static uint32_t hex4(const unsigned char *p)
{
    return (uint32_t)(hexv(p[0]) << 12 | hexv(p[1]) << 8 | hexv(p[2]) << 4 | hexv(p[3]));
}

/* RFC 8785 §3.2.2.2: escape '"', '\\' and controls (short forms for \b \t \n \f \r, else
 * \u00xx lowercase); everything else, non-ASCII included, is written as UTF-8. The input was
 * validated, so escapes are well formed and surrogates paired. */
void jcs_write_raw_string(const char *raw, size_t n, bool has_escapes, dp_buf_t *out)
{
    assert(n >= 2 && raw[0] == '"' && raw[n - 1] == '"');
    if (!has_escapes) { /* raw JSON strings hold no control, quote or backslash bytes */
        dp_buf_append(out, raw, n);
        return;
    }
    static const char hexd[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)raw + 1;
    size_t m = n - 2, i = 0;
    dp_buf_appendc(out, '"');
    while (i < m) {
        const unsigned char *bs = memchr(p + i, '\\', m - i);
        size_t run = bs ? (size_t)(bs - (p + i)) : m - i;
        dp_buf_append(out, (const char *)p + i, run);
        i += run;
        if (i >= m)
            break;
        unsigned char e = p[i + 1];
        i += 2;
        uint32_t cp;
        switch (e) {
        case '"':
            dp_buf_append(out, "\\\"", 2);
            continue;
        case '\\':
            dp_buf_append(out, "\\\\", 2);
            continue;
        case '/':
            dp_buf_appendc(out, '/');
            continue;
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't': {
            char s[2] = {'\\', (char)e};
            dp_buf_append(out, s, 2);
            continue;
        }
        default: /* 'u' */
            cp = hex4(p + i);
            i += 4;
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                uint32_t lo = hex4(p + i + 2);
                i += 6;
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            }
        }
        if (cp < 0x20) {
            const char *sf = cp == '\b'   ? "\\b"
                             : cp == '\t' ? "\\t"
                             : cp == '\n' ? "\\n"
                             : cp == '\f' ? "\\f"
                             : cp == '\r' ? "\\r"
                                          : NULL;
            if (sf) {
                dp_buf_append(out, sf, 2);
            } else {
                char u[6] = {'\\', 'u', '0', '0', hexd[cp >> 4], hexd[cp & 15]};
                dp_buf_append(out, u, 6);
            }
        } else if (cp == '"') {
            dp_buf_append(out, "\\\"", 2);
        } else if (cp == '\\') {
            dp_buf_append(out, "\\\\", 2);
        } else {
            jdoc_put_utf8(out, cp);
        }
    }
    dp_buf_appendc(out, '"');
}

static void jcs_number(const jdoc_t *d, uint32_t tok, dp_buf_t *out)
{
    const jtok_t *t = &d->toks[tok];
    const char *p = d->src + t->start;
    /* Integer literals below 10^15 print as themselves (JSON forbids leading zeros); "-0" is 0. */
    if ((t->flags & JF_INT) && t->len - ((t->flags & JF_NEG) ? 1 : 0) <= 15) {
        if (t->len == 2 && p[0] == '-' && p[1] == '0')
            dp_buf_appendc(out, '0');
        else
            dp_buf_append(out, p, t->len);
        return;
    }
    char b[32];
    size_t n = jcs_es_number(jdoc_num(d, tok), b);
    dp_buf_append(out, b, n);
}

void jcs_write(const jdoc_t *d, uint32_t tok, dp_buf_t *out)
{
    const jtok_t *t = &d->toks[tok];
    switch (t->type) {
    case JT_OBJ:
        /* The sorted member list exists only when the parse checked duplicates. */
        assert(t->aux == 0 || (d->order != NULL && t->aux2 + t->aux <= d->norder));
        dp_buf_appendc(out, '{');
        for (uint32_t m = 0; m < t->aux; m++) {
            uint32_t k = d->order[t->aux2 + m];
            if (m)
                dp_buf_appendc(out, ',');
            jcs_write_raw_string(d->src + d->toks[k].start, d->toks[k].len,
                                 d->toks[k].flags & JF_ESC, out);
            dp_buf_appendc(out, ':');
            jcs_write(d, k + 1, out);
        }
        dp_buf_appendc(out, '}');
        break;
    case JT_ARR:
        dp_buf_appendc(out, '[');
        for (uint32_t i = tok + 1; i < t->end; i = d->toks[i].end) {
            if (i != tok + 1)
                dp_buf_appendc(out, ',');
            jcs_write(d, i, out);
        }
        dp_buf_appendc(out, ']');
        break;
    case JT_STR:
        jcs_write_raw_string(d->src + t->start, t->len, t->flags & JF_ESC, out);
        break;
    case JT_NUM:
        jcs_number(d, tok, out);
        break;
    default: /* true, false, null */
        dp_buf_append(out, d->src + t->start, t->len);
        break;
    }
}
