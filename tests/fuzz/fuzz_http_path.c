/* libFuzzer target for the request-path normaliser (net_path_normalize), differential against a
 * second, deliberately naive implementation: decode every escape into a token list, split on
 * '/', resolve with a stack, join. Invariants, each an abort() when broken:
 *   - both accept or both refuse the same input;
 *   - accepted: the same output; never longer than the input; starts with '/'; no "//", no "."
 *     or ".." segment, no escape of an unreserved character, no lower-case escape hex;
 *   - normalising the output again changes nothing.
 * Input: the path bytes after a leading '/'. Seeds: tests/fuzz/corpus/http/. */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"
#include "net/path.h"

#define CHECK(c)                                                                                   \
    do {                                                                                           \
        if (!(c))                                                                                  \
            abort();                                                                               \
    } while (0)

enum { MAXP = 4096 };

static bool unres(unsigned c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '.' || c == '_' || c == '~';
}

/* The reference: returns the length or 0 when refused. */
static size_t naive(const char *in, size_t n, char *out)
{
    /* 1. tokens: each output character with "is a separator" */
    static char tok[MAXP * 3];
    static bool sep[MAXP * 3];
    size_t nt = 0;
    for (size_t i = 0; i < n;) {
        unsigned char c = (unsigned char)in[i];
        if (c == '#')
            return 0;
        if (c == '%') {
            if (i + 2 >= n || dp_hexval((unsigned char)in[i + 1]) < 0 ||
                dp_hexval((unsigned char)in[i + 2]) < 0)
                return 0;
            int h = dp_hexval((unsigned char)in[i + 1]), l = dp_hexval((unsigned char)in[i + 2]);
            unsigned d = (unsigned)(h * 16 + l);
            if (d == '/')
                return 0;
            if (unres(d)) {
                tok[nt] = (char)d;
                sep[nt++] = false;
            } else {
                const char *hx = "0123456789ABCDEF";
                tok[nt] = '%', sep[nt++] = false;
                tok[nt] = hx[h], sep[nt++] = false;
                tok[nt] = hx[l], sep[nt++] = false;
            }
            i += 3;
            continue;
        }
        tok[nt] = (char)c;
        sep[nt++] = c == '/';
        i++;
    }
    /* 2. segments, resolved on a stack */
    static size_t segs[MAXP * 3], lens[MAXP * 3];
    size_t ns = 0;
    bool dir = false;
    for (size_t i = 0; i < nt;) {
        if (sep[i]) {
            i++;
            dir = true;
            continue;
        }
        size_t s = i;
        while (i < nt && !sep[i])
            i++;
        size_t l = i - s;
        if (l == 1 && tok[s] == '.') {
            dir = true;
        } else if (l == 2 && tok[s] == '.' && tok[s + 1] == '.') {
            if (ns == 0)
                return 0;
            ns--;
            dir = true;
        } else {
            segs[ns] = s;
            lens[ns++] = l;
            dir = false;
        }
        if (i < nt)
            dir = true;
    }
    size_t o = 0;
    for (size_t k = 0; k < ns; k++) {
        out[o++] = '/';
        memcpy(out + o, tok + segs[k], lens[k]);
        o += lens[k];
    }
    if (o == 0 || dir)
        out[o++] = '/';
    return o;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size >= MAXP)
        return 0;
    static char a[MAXP + 1], b[MAXP * 3 + 1];
    a[0] = '/';
    memcpy(a + 1, data, size);
    size_t n = size + 1;
    size_t want = naive(a, n, b);
    const char *why = NULL;
    size_t got = net_path_normalize(a, n, &why);
    CHECK((got == 0) == (want == 0));
    if (got == 0) {
        CHECK(why != NULL && why[0] != '\0');
        return 0;
    }
    CHECK(got <= n && got == want && memcmp(a, b, got) == 0);
    CHECK(a[0] == '/');
    for (size_t i = 0; i + 1 < got; i++)
        CHECK(!(a[i] == '/' && a[i + 1] == '/'));
    for (size_t i = 0; i < got; i++) {
        if (a[i] == '%') {
            CHECK(i + 2 < got);
            int h = dp_hexval((unsigned char)a[i + 1]), l = dp_hexval((unsigned char)a[i + 2]);
            CHECK(h >= 0 && l >= 0 && !(a[i + 1] >= 'a') && !(a[i + 2] >= 'a'));
            CHECK(!unres((unsigned)(h * 16 + l)) && h * 16 + l != '/');
        }
        if (a[i] == '/') {
            size_t e = i + 1;
            while (e < got && a[e] != '/')
                e++;
            size_t l = e - i - 1;
            CHECK(!(l == 1 && a[i + 1] == '.'));
            CHECK(!(l == 2 && a[i + 1] == '.' && a[i + 2] == '.'));
        }
    }
    memcpy(b, a, got);
    size_t again = net_path_normalize(b, got, &why);
    CHECK(again == got && memcmp(a, b, got) == 0);
    return 0;
}
