/* The ECMAScript number printer (jcs_es_number) against its two references: strtod (every
 * output reads back as the same double, and no shorter digit string would) and V8 itself
 * (node's JSON.stringify on a large generated sample). */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "policy/jcs.h"
#include "policy/jdoc.h"

static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;

static uint64_t rng(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double from_bits(uint64_t b)
{
    double d;
    memcpy(&d, &b, 8);
    return d;
}

/* The i-th sample: uniform bit patterns (every exponent), 17-significant-digit decimals (the
 * shape of a hostile 330k-number body), short decimals, integers around 2^53, powers of two and
 * their neighbours (lopsided intervals), subnormals. Finite only. */
static double sample(uint64_t i)
{
    uint64_t r = rng();
    double d;
    switch (i % 7) {
    case 0:
    case 1:
        d = from_bits(r);
        break;
    case 2: {
        char b[40];
        snprintf(b, sizeof(b), "%llu.%llue%d", (unsigned long long)(r % 9 + 1),
                 (unsigned long long)(rng() % 10000000000000000ULL), (int)(rng() % 60) - 30);
        d = strtod(b, NULL);
        break;
    }
    case 3: {
        char b[40];
        snprintf(b, sizeof(b), "%llue%d", (unsigned long long)(r % 100000), (int)(rng() % 40) - 25);
        d = strtod(b, NULL);
        break;
    }
    case 4:
        d = (double)((r % (1ULL << 56)) | 1) * ((r >> 60) & 1 ? 1 : -1);
        break;
    case 5: {
        uint64_t b = (r % 2046 + 1) << 52;
        d = from_bits(b + (uint64_t)((int64_t)(rng() % 3) - 1)); /* 2^e and its neighbours */
        break;
    }
    default:
        d = from_bits(r & ((1ULL << 52) - 1) >> (rng() % 52)); /* subnormals, tiny ones too */
        break;
    }
    return isfinite(d) ? d : 1.5;
}

/* Significant digits of a printed number: "-0.00125" and "125000" both have 3. */
static int digit_count(const char *s)
{
    int n = 0, last = 0;
    bool lead = true;
    for (; *s && *s != 'e'; s++) {
        if (*s < '0' || *s > '9' || (lead && *s == '0'))
            continue;
        lead = false;
        n++;
        if (*s != '0')
            last = n;
    }
    return last;
}

Test(es_number, strtod_round_trip_and_shortest)
{
    rng_state = 0x243F6A8885A308D3ULL;
    for (uint64_t i = 0; i < 300000; i++) {
        double v = sample(i);
        char out[40];
        /* Criterion runs with --full-stats, which records every passing assertion: inside the
         * loops assert only on failure. */
        size_t n = jcs_es_number(v, out);
        if (n != strlen(out))
            cr_assert_fail("%a: length %zu for %s", v, n, out);
        double back = strtod(out, NULL);
        if (back != v)
            cr_assert_fail("%a printed %s reads back as %a", v, out, back);
        /* Shortest: the correctly rounded string one digit shorter does not read back (its
         * neighbours at a lopsided power-of-two interval are the V8 test's business). */
        int nd = digit_count(out);
        if (nd > 1 && v != 0) {
            char c[48];
            snprintf(c, sizeof(c), "%.*e", nd - 2, v);
            if (strtod(c, NULL) == v)
                cr_assert_fail("%a: %s is shorter than %s", v, c, out);
        }
    }
}

/* jdoc_num reads a number literal as strtod does, bit for bit: the literals a few digits long
 * with a small exponent that it reads without strtod (every form: sign, fraction, exponent,
 * leading and trailing zeros, 2^53 and past it) and the ones around them that it leaves to it. */
Test(jdoc_num, reads_what_strtod_reads)
{
    rng_state = 0x13198A2E03707344ULL;
    static const char *fixed[] = {"0",
                                  "-0",
                                  "0.0",
                                  "-0.0",
                                  "0e0",
                                  "0E-0",
                                  "-0e+5",
                                  "1",
                                  "0.9",
                                  "0.1",
                                  "0.3",
                                  "1e22",
                                  "1e23",
                                  "1e-22",
                                  "1e-23",
                                  "9007199254740992",
                                  "9007199254740993",
                                  "9007199254740992e-22",
                                  "-9007199254740991.5",
                                  "1234567890123456789",
                                  "12345678901234567890",
                                  "0.1000000000000000055511",
                                  "123456789e22",
                                  "1.7976931348623157e308",
                                  "5e-324",
                                  "4.9406564584124654e-324",
                                  "2.2250738585072011e-308",
                                  "1e-4000"};
    char lit[64];
    for (size_t i = 0; i < sizeof(fixed) / sizeof(fixed[0]) + 200000; i++) {
        if (i < sizeof(fixed) / sizeof(fixed[0])) {
            snprintf(lit, sizeof(lit), "%s", fixed[i]);
        } else {
            uint64_t r = rng();
            int digits = (int)(r % 20) + 1, frac = (int)(rng() % 25), ex = (int)(rng() % 61) - 30;
            size_t o = 0;
            if (r >> 63)
                lit[o++] = '-';
            uint64_t m = rng();
            for (int k = 0; k < digits; k++) {
                lit[o++] = (char)('0' + (k == 0 && digits > 1 ? 1 + m % 9 : m % 10));
                m = m / 10 ? m / 10 : rng();
            }
            if (frac > 0 && frac < 20) {
                lit[o++] = '.';
                for (int k = 0; k < frac; k++, m = m / 10 ? m / 10 : rng())
                    lit[o++] = (char)('0' + m % 10);
            }
            if ((r >> 60 & 3) != 0)
                o += (size_t)snprintf(lit + o, sizeof(lit) - o, "%s%d", (r >> 59 & 1) ? "E" : "e",
                                      ex);
            lit[o] = '\0';
        }
        jdoc_t d;
        jdoc_init(&d);
        if (jdoc_parse(&d, lit, strlen(lit), 0) != 0 || d.toks[0].type != JT_NUM)
            cr_assert_fail("%s: not read as a number", lit);
        double got = jdoc_num(&d, 0), want = strtod(lit, NULL);
        jdoc_free(&d);
        if (memcmp(&got, &want, sizeof(got)) != 0)
            cr_assert_fail("%s: jdoc_num %a, strtod %a", lit, got, want);
    }
}

/* Run node on a file of hex bit patterns; returns its output or NULL when node is absent. */
static char *node_stringify(const char *inpath, size_t *len)
{
    static const char script[] =
        "const fs=require('fs');const L=fs.readFileSync(process.argv[1],'utf8').trim()"
        ".split('\\n');const b=Buffer.alloc(8);const o=[];for(const h of L){"
        "b.writeBigUInt64BE(BigInt('0x'+h));o.push(JSON.stringify(b.readDoubleBE(0)));}"
        "process.stdout.write(o.join('\\n')+'\\n');";
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "node -e \"%s\" %s 2>/dev/null", script, inpath);
    /* the script holds no double quote or dollar sign: safe inside "..." */
    FILE *p = popen(cmd, "r");
    if (p == NULL)
        return NULL;
    size_t cap = 1 << 20, n = 0;
    char *buf = malloc(cap);
    size_t r;
    while ((r = fread(buf + n, 1, cap - n, p)) > 0) {
        n += r;
        if (n == cap)
            buf = realloc(buf, cap *= 2);
    }
    int st = pclose(p);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0 || n == 0) {
        free(buf);
        return NULL;
    }
    *len = n;
    return buf;
}

Test(es_number, matches_v8_json_stringify)
{
    if (system("node --version >/dev/null 2>&1") != 0)
        cr_skip_test("node is not installed");
    enum { N = 400000 };
    char path[] = "/tmp/dp_es_number_XXXXXX";
    int fd = mkstemp(path);
    cr_assert(fd >= 0);
    FILE *f = fdopen(fd, "w");
    double *v = malloc(N * sizeof(*v));
    rng_state = 0x13198A2E03707344ULL;
    for (uint64_t i = 0; i < N; i++) {
        v[i] = sample(i);
        uint64_t b;
        memcpy(&b, &v[i], 8);
        fprintf(f, "%016llx\n", (unsigned long long)b);
    }
    fclose(f);
    size_t len = 0;
    char *js = node_stringify(path, &len);
    unlink(path);
    cr_assert(js != NULL, "node failed");
    char *line = js;
    size_t mismatches = 0;
    for (uint64_t i = 0; i < N; i++) {
        char *nl = memchr(line, '\n', len - (size_t)(line - js));
        if (nl == NULL)
            cr_assert_fail("node printed only %llu lines", (unsigned long long)i);
        *nl = '\0';
        char out[40];
        jcs_es_number(v[i], out);
        if (strcmp(out, line) != 0 && mismatches++ < 10)
            cr_log_error("%a: we print %s, V8 prints %s", v[i], out, line);
        line = nl + 1;
    }
    free(js);
    free(v);
    cr_assert_eq(mismatches, 0, "%zu of %d numbers differ from V8", mismatches, N);
}
