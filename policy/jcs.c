/* RFC 8785 JSON Canonicalization Scheme: ECMAScript number printing and canonical
 * serialisation of a validated token tape. */
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "policy/jcs_pow10.h"
#include "policy/jcs.h"

#include <openssl/evp.h>

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

/* ---- output: a buffer, or a buffer staged into SHA-256 ---------------------------------- */

/* Staged bytes are hashed once this many wait (runs of JCS_DIRECT or more skip the stage). */
#define JCS_STAGE 8192

static void feed(jcs_out_t *o, const void *p, size_t n)
{
    if (!o->begun) {
        EVP_DigestInit_ex(o->sha, o->md, NULL);
        o->begun = true;
    }
    EVP_DigestUpdate(o->sha, p, n);
}

void jcs_flush(jcs_out_t *o)
{
    if (o->sha && o->buf->len) {
        feed(o, o->buf->base, o->buf->len);
        dp_buf_reset(o->buf);
    }
}

/* Does n more bytes fit o's buffer as it is, with no stage to hash first? (Most writes are a
 * brace, a comma or a short key: they are stored here, not through dp_buf_append.) */
static inline bool fits(const jcs_out_t *o, size_t n)
{
    size_t len = o->buf->len + n;
    return len < o->buf->cap && !(o->sha && len > JCS_STAGE);
}

/* A run at least this long is hashed where it lies, after what waits in the stage: a prompt's
 * strings (most are a few KB) are not copied into the stage first (bench/gen_prompt.py's 254 KiB
 * prompt: ~3 us less per derived seed, policy_bench). Shorter runs are cheaper copied than given
 * a digest call of their own. */
#define JCS_DIRECT 1024

void jcs_emit(jcs_out_t *o, const char *p, size_t n)
{
    if (o->sha && n >= JCS_DIRECT) {
        jcs_flush(o);
        feed(o, p, n);
        return;
    }
    if (fits(o, n)) {
        dp_buf_t *b = o->buf;
        memcpy(b->base + b->len, p, n);
        b->len += n;
        b->base[b->len] = '\0';
        return;
    }
    if (o->sha && o->buf->len + n > JCS_STAGE)
        jcs_flush(o);
    dp_buf_append(o->buf, p, n);
}

static inline void emitc(jcs_out_t *o, char c)
{
    if (fits(o, 1)) {
        dp_buf_t *b = o->buf;
        b->base[b->len++] = c;
        b->base[b->len] = '\0';
        return;
    }
    jcs_emit(o, &c, 1);
}

static void put_utf8(jcs_out_t *o, uint32_t cp)
{
    char b[4];
    jcs_emit(o, b, jdoc_utf8_encode(cp, b));
}

/* RFC 8785 §3.2.2.2: escape '"', '\\' and controls (short forms for \b \t \n \f \r, else
 * \u00xx lowercase); everything else, non-ASCII included, is written as UTF-8. The input was
 * validated, so escapes are well formed and surrogates paired. */
void jcs_write_raw_string_to(const char *raw, size_t n, bool has_escapes, jcs_out_t *out)
{
    assert(n >= 2 && raw[0] == '"' && raw[n - 1] == '"');
    if (!has_escapes) { /* validated literals hold no raw control, quote or backslash byte, and
                           \" \\ \b \f \n \r \t are already how RFC 8785 writes them */
        jcs_emit(out, raw, n);
        return;
    }
    static const char hexd[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)raw + 1;
    size_t m = n - 2, i = 0;
    emitc(out, '"');
    while (i < m) {
        const unsigned char *bs = memchr(p + i, '\\', m - i);
        size_t run = bs ? (size_t)(bs - (p + i)) : m - i;
        jcs_emit(out, (const char *)p + i, run);
        i += run;
        if (i >= m)
            break;
        unsigned char e = p[i + 1];
        i += 2;
        uint32_t cp;
        switch (e) {
        case '"':
            jcs_emit(out, "\\\"", 2);
            continue;
        case '\\':
            jcs_emit(out, "\\\\", 2);
            continue;
        case '/':
            emitc(out, '/');
            continue;
        case 'b':
        case 'f':
        case 'n':
        case 'r':
        case 't': {
            char s[2] = {'\\', (char)e};
            jcs_emit(out, s, 2);
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
                jcs_emit(out, sf, 2);
            } else {
                char u[6] = {'\\', 'u', '0', '0', hexd[cp >> 4], hexd[cp & 15]};
                jcs_emit(out, u, 6);
            }
        } else if (cp == '"') {
            jcs_emit(out, "\\\"", 2);
        } else if (cp == '\\') {
            jcs_emit(out, "\\\\", 2);
        } else {
            put_utf8(out, cp);
        }
    }
    emitc(out, '"');
}

static void jcs_number(const jdoc_t *d, uint32_t tok, jcs_out_t *out)
{
    const jtok_t *t = &d->toks[tok];
    const char *p = d->src + t->start;
    /* Integer literals below 10^15 print as themselves (JSON forbids leading zeros); "-0" is 0. */
    if ((t->flags & JF_INT) && t->len - ((t->flags & JF_NEG) ? 1 : 0) <= 15) {
        if (t->len == 2 && p[0] == '-' && p[1] == '0')
            emitc(out, '0');
        else
            jcs_emit(out, p, t->len);
        return;
    }
    char b[32];
    size_t n = jcs_es_number(jdoc_num(d, tok), b);
    jcs_emit(out, b, n);
}

void jcs_write_to(const jdoc_t *d, uint32_t tok, jcs_out_t *out)
{
    const jtok_t *t = &d->toks[tok];
    switch (t->type) {
    case JT_OBJ:
        /* The sorted member list exists only when the parse checked duplicates. */
        assert(t->aux == 0 || (d->order != NULL && t->aux2 + t->aux <= d->norder));
        emitc(out, '{');
        for (uint32_t m = 0; m < t->aux; m++) {
            uint32_t k = d->order[t->aux2 + m];
            if (m)
                emitc(out, ',');
            jcs_write_raw_string_to(d->src + d->toks[k].start, d->toks[k].len,
                                    d->toks[k].flags & JF_REESC, out);
            emitc(out, ':');
            jcs_write_to(d, k + 1, out);
        }
        emitc(out, '}');
        break;
    case JT_ARR:
        emitc(out, '[');
        for (uint32_t i = tok + 1; i < t->end; i = d->toks[i].end) {
            if (i != tok + 1)
                emitc(out, ',');
            jcs_write_to(d, i, out);
        }
        emitc(out, ']');
        break;
    case JT_STR:
        jcs_write_raw_string_to(d->src + t->start, t->len, t->flags & JF_REESC, out);
        break;
    case JT_NUM:
        jcs_number(d, tok, out);
        break;
    default: /* true, false, null */
        jcs_emit(out, d->src + t->start, t->len);
        break;
    }
}

void jcs_write(const jdoc_t *d, uint32_t tok, dp_buf_t *out)
{
    jcs_out_t o = {out, NULL, NULL, false};
    jcs_write_to(d, tok, &o);
}

void jcs_write_raw_string(const char *raw, size_t n, bool has_escapes, dp_buf_t *out)
{
    jcs_out_t o = {out, NULL, NULL, false};
    jcs_write_raw_string_to(raw, n, has_escapes, &o);
}
