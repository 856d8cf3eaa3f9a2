/* Request-path normalisation: one left-to-right pass, writing behind the read position. */
#include "net/path.h"

#include <assert.h>
#include <stdbool.h>

#include "common/util.h"

static bool unreserved(unsigned char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
           c == '.' || c == '_' || c == '~';
}

size_t net_path_normalize(char *p, size_t n, const char **reason)
{
    static const char hexu[] = "0123456789ABCDEF";
    assert(n > 0 && p[0] == '/');
    size_t i = 0, o = 0;
    bool trailing = false;
    /* Invariant: o <= i, and p[0..o) is "/seg/seg..." with no empty, "." or ".." segment. */
    while (i < n) {
        while (i < n && p[i] == '/')
            i++;
        if (i == n) {
            trailing = true;
            break;
        }
        size_t seg = o;
        p[o++] = '/';
        size_t s = o;
        while (i < n && p[i] != '/') {
            unsigned char c = (unsigned char)p[i];
            if (c == '#') {
                *reason = "a fragment ('#') in the request-target";
                return 0;
            }
            if (c != '%') {
                p[o++] = (char)c;
                i++;
                continue;
            }
            int hi = i + 2 < n ? dp_hexval((unsigned char)p[i + 1]) : -1;
            int lo = hi >= 0 ? dp_hexval((unsigned char)p[i + 2]) : -1;
            if (lo < 0) {
                *reason = "malformed percent-encoding in the path";
                return 0;
            }
            unsigned char d = (unsigned char)(hi << 4 | lo);
            if (d == '/') {
                *reason = "an encoded '/' (%2F) in the path";
                return 0;
            }
            if (unreserved(d)) {
                p[o++] = (char)d;
            } else {
                p[o++] = '%';
                p[o++] = hexu[hi];
                p[o++] = hexu[lo];
            }
            i += 3;
        }
        assert(o <= i);
        size_t len = o - s;
        bool dot = len == 1 && p[s] == '.', dotdot = len == 2 && p[s] == '.' && p[s + 1] == '.';
        trailing = false;
        if (dot || dotdot) {
            o = seg;
            trailing = i == n; /* "/a/." and "/a/b/.." name a directory: "/a/" */
        }
        if (dotdot) {
            if (o == 0) {
                *reason = "the path climbs above the root ('..')";
                return 0;
            }
            while (p[o - 1] != '/')
                o--;
            o--;
        }
    }
    if (o == 0 || trailing)
        p[o++] = '/';
    assert(o <= n);
    return o;
}
