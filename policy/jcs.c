/* RFC 8785 JSON Canonicalization Scheme: ECMAScript number printing and canonical
 * serialisation of a validated token tape. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/policy_int.h"

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

/* Parse snprintf's "%.*e" output into its digits and decimal exponent. */
static int split_e(const char *b, char *dig, int *nd)
{
    int n = 0;
    const char *q = b;
    dig[n++] = *q++;
    if (*q == '.') {
        q++;
        while (*q != 'e')
            dig[n++] = *q++;
    }
    *nd = n;
    return atoi(q + 1);
}

static bool round_trips(const char *dig, int nd, int e, double v)
{
    char c[48];
    int m = 0;
    c[m++] = dig[0];
    if (nd > 1) {
        c[m++] = '.';
        memcpy(c + m, dig + 1, (size_t)nd - 1);
        m += nd - 1;
    }
    snprintf(c + m, sizeof(c) - (size_t)m, "e%d", e);
    return strtod(c, NULL) == v;
}

/* Shortest digit string s (k digits, no trailing zero) with v == s * 10^(n-k), picking the
 * closest to v when several k-digit strings read back as v (ECMA-262 Number::toString, step 5).
 * For each precision the correctly rounded "%.*e" candidate is tried first. At powers of two the
 * rounding interval is lopsided, and when v's exact decimal expansion sits on a tie (2^-24 =
 * 5.9604644775390625e-8) round-half-even can pick the side that falls outside it while the
 * other neighbour, one unit away, reads back: V8 prints 5.960464477539063e-8. So the two
 * neighbours are tried too. Checked against V8 on every finite power of two and 350k random
 * doubles. Returns n; v > 0 and finite. */
static int shortest(double v, char *out, int *k)
{
    char b[48], dig[24], nb[24];
    int nd = 0, e = 0;
    for (int p = 1; p <= 17; p++) {
        snprintf(b, sizeof(b), "%.*e", p - 1, v);
        e = split_e(b, dig, &nd);
        if (strtod(b, NULL) == v)
            goto found;
        for (int delta = 1; delta >= -1; delta -= 2) {
            int nn = nd, ne = e, j = nd - 1;
            memcpy(nb, dig, (size_t)nd);
            if (delta > 0) {
                while (j >= 0 && nb[j] == '9')
                    nb[j--] = '0';
                if (j < 0) {
                    nb[0] = '1';
                    ne++;
                } else {
                    nb[j]++;
                }
            } else {
                while (j >= 0 && nb[j] == '0')
                    nb[j--] = '9';
                if (j < 0)
                    continue;
                nb[j]--;
                if (nb[0] == '0') {
                    if (nn == 1)
                        continue;
                    memmove(nb, nb + 1, (size_t)nn - 1);
                    nn--;
                    ne--;
                }
            }
            if (round_trips(nb, nn, ne, v)) {
                memcpy(dig, nb, (size_t)nn);
                nd = nn;
                e = ne;
                goto found;
            }
        }
    }
found:
    while (nd > 1 && dig[nd - 1] == '0')
        nd--;
    memcpy(out, dig, (size_t)nd);
    *k = nd;
    return e + 1;
}

size_t policy_es_number(double v, char *out)
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
            json_put_utf8(out, cp);
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
    size_t n = policy_es_number(jdoc_num(d, tok), b);
    dp_buf_append(out, b, n);
}

void jcs_write(const jdoc_t *d, uint32_t tok, dp_buf_t *out)
{
    const jtok_t *t = &d->toks[tok];
    switch (t->type) {
    case JT_OBJ:
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

int policy_jcs(const char *json, size_t len, dp_buf_t *out, policy_error_t *err)
{
    jdoc_t d;
    jdoc_init(&d);
    int rc = jdoc_parse(&d, json, len, 0);
    if (rc < 0)
        policy_json_error(&d, err);
    else
        jcs_write(&d, 0, out);
    jdoc_free(&d);
    return rc;
}
