/* libFuzzer target for the ECMAScript number printer (jcs_es_number), differential against
 * strtod and against a slow reference that finds the shortest round-trip digits by search
 * (snprintf "%.*e" at every precision 1-17 plus both neighbours of each candidate, closest to
 * the value, ties to even: ECMA-262 Number::toString). Invariants, each an abort():
 *   - the output reads back (strtod) as the very value (-0 prints 0, NaN and infinities null);
 *   - its significant digits are exactly the reference's, and so is the whole string;
 *   - the text matches ECMAScript's layout: plain digits for 1e-7 < |v| < 1e21, else d.ddde±x.
 * Input: 8 bytes are a double's bits; anything else is parsed with strtod as text. Seeds:
 * tests/fuzz/corpus/policy/. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/jcs.h"

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c))                                                                                  \
            abort();                                                                               \
    } while (0)

/* Digits (no trailing zeros) and decimal exponent n (value = 0.d1d2... 10^n) of "%.*e" text. */
static int split(const char *b, char *dig, int *nd)
{
    int k = 0;
    for (const char *p = b; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9')
            dig[k++] = *p;
    const char *e = strchr(b, 'e');
    int x = atoi(e + 1);
    while (k > 1 && dig[k - 1] == '0')
        k--;
    *nd = k;
    return x + 1;
}

static double value_of(const char *dig, int nd, int n)
{
    char c[64];
    snprintf(c, sizeof(c), "0.%.*se%d", nd, dig, n);
    return strtod(c, NULL);
}

/* Exact big integers, enough for 2^1100 * 5^350: the midpoint comparison must not round. */
typedef struct {
    uint32_t w[160];
    int n;
} big_t;

static void big_set(big_t *b, uint64_t v)
{
    b->w[0] = (uint32_t)v;
    b->w[1] = (uint32_t)(v >> 32);
    b->n = 2;
}

static void big_mul(big_t *b, uint32_t m)
{
    uint64_t carry = 0;
    for (int i = 0; i < b->n; i++) {
        uint64_t t = (uint64_t)b->w[i] * m + carry;
        b->w[i] = (uint32_t)t;
        carry = t >> 32;
    }
    if (carry)
        b->w[b->n++] = (uint32_t)carry;
}

static void big_pow(big_t *b, uint32_t base, int e)
{
    for (; e > 0; e--)
        big_mul(b, base);
}

static int big_cmp(big_t *a, big_t *b)
{
    while (a->n > 1 && a->w[a->n - 1] == 0)
        a->n--;
    while (b->n > 1 && b->w[b->n - 1] == 0)
        b->n--;
    if (a->n != b->n)
        return a->n < b->n ? -1 : 1;
    for (int i = a->n - 1; i >= 0; i--)
        if (a->w[i] != b->w[i])
            return a->w[i] < b->w[i] ? -1 : 1;
    return 0;
}

/* Sign of v - (c + 1/2) 10^e, exactly (v > 0 finite). */
static int cmp_midpoint(double v, uint64_t c, int e)
{
    int be;
    double fr = frexp(v, &be);
    uint64_t m = (uint64_t)ldexp(fr, 53);
    int a2 = be - 53, a5 = 0, b2 = e - 1, b5 = e; /* v = m 2^a2; mid = (2c+1) 2^(e-1) 5^e */
    int m2 = a2 < b2 ? a2 : b2, m5 = a5 < b5 ? a5 : b5;
    big_t A, B;
    big_set(&A, m);
    big_pow(&A, 2, a2 - m2);
    big_pow(&A, 5, a5 - m5);
    big_set(&B, 2 * c + 1);
    big_pow(&B, 2, b2 - m2);
    big_pow(&B, 5, b5 - m5);
    return big_cmp(&A, &B);
}

/* Reference shortest digits of v > 0: the first precision p at which the correctly rounded
 * candidate or one of its two neighbours reads back; of those that do, the closest to v (an
 * exact comparison with the midpoint), ties to the even one. */
static int reference(double v, char *best, int *bnd)
{
    for (int p = 1; p <= 17; p++) {
        char b[64];
        snprintf(b, sizeof(b), "%.*e", p - 1, v);
        char dig[24];
        int nd, n = split(b, dig, &nd);
        char full[24];
        memset(full, '0', sizeof(full));
        memcpy(full, dig, (size_t)nd);
        uint64_t m = 0;
        for (int i = 0; i < p; i++)
            m = m * 10 + (uint64_t)(full[i] - '0');
        int e = n - p; /* candidates are c 10^e */
        bool ok[3];
        for (int d = -1; d <= 1; d++) {
            uint64_t c = m + (uint64_t)d;
            char cs[32];
            int cl = snprintf(cs, sizeof(cs), "%llu", (unsigned long long)c);
            ok[d + 1] = c > 0 && value_of(cs, cl, e + cl) == v;
        }
        uint64_t pick = 0;
        if (ok[0] && ok[1])
            pick = cmp_midpoint(v, m - 1, e) < 0 || (cmp_midpoint(v, m - 1, e) == 0 && (m & 1))
                       ? m - 1
                       : m;
        else if (ok[1] && ok[2])
            pick =
                cmp_midpoint(v, m, e) < 0 || (cmp_midpoint(v, m, e) == 0 && !(m & 1)) ? m : m + 1;
        else if (ok[1])
            pick = m;
        else if (ok[0])
            pick = m - 1;
        else if (ok[2])
            pick = m + 1;
        if (pick) {
            int cl = snprintf(best, 24, "%llu", (unsigned long long)pick);
            int bn = e;
            while (cl > 1 && best[cl - 1] == '0') {
                cl--;
                bn++;
            }
            *bnd = cl;
            return bn + cl;
        }
    }
    abort(); /* 17 digits always read back */
}

/* Lay the digits out the ECMAScript way (Number::toString steps 6-10). */
static void layout(const char *dig, int k, int n, bool neg, char *out)
{
    char *o = out;
    if (neg)
        *o++ = '-';
    if (k <= n && n <= 21) {
        memcpy(o, dig, (size_t)k), o += k;
        for (int i = 0; i < n - k; i++)
            *o++ = '0';
    } else if (0 < n && n <= 21) {
        memcpy(o, dig, (size_t)n), o += n;
        *o++ = '.';
        memcpy(o, dig + n, (size_t)(k - n)), o += k - n;
    } else if (-6 < n && n <= 0) {
        *o++ = '0', *o++ = '.';
        for (int i = 0; i < -n; i++)
            *o++ = '0';
        memcpy(o, dig, (size_t)k), o += k;
    } else {
        *o++ = dig[0];
        if (k > 1) {
            *o++ = '.';
            memcpy(o, dig + 1, (size_t)k - 1), o += k - 1;
        }
        o += sprintf(o, "e%c%d", n - 1 < 0 ? '-' : '+', abs(n - 1));
    }
    *o = '\0';
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    double v;
    if (size == 8) {
        memcpy(&v, data, 8);
    } else {
        char t[128];
        size_t n = size < sizeof(t) - 1 ? size : sizeof(t) - 1;
        memcpy(t, data, n);
        t[n] = '\0';
        v = strtod(t, NULL);
    }
    char out[40];
    size_t len = jcs_es_number(v, out);
    CHECK(len == strlen(out) && len < 32);
    if (!isfinite(v)) {
        CHECK(strcmp(out, "null") == 0);
        return 0;
    }
    if (v == 0) {
        CHECK(strcmp(out, "0") == 0);
        return 0;
    }
    CHECK(strtod(out, NULL) == v);
    char dig[24], want[40];
    int k, n = reference(fabs(v), dig, &k);
    layout(dig, k, n, v < 0, want);
    CHECK(strcmp(out, want) == 0);
    return 0;
}
