/* net_path_normalize edge cases beyond tests/unit/test_httpv_path.c: mixed and encoded dot
 * segments, climbing out through merged slashes, bytes above 0x7f, and escapes cut by the end
 * of the path (the bytes after it must never be read as part of it). */
#include <criterion/criterion.h>
#include <string.h>

#include "net/path.h"

static void expect(const char *in, const char *want)
{
    char b[256];
    size_t n = strlen(in);
    memcpy(b, in, n);
    const char *why = NULL;
    size_t m = net_path_normalize(b, n, &why);
    cr_assert(m > 0, "%s refused: %s", in, why ? why : "?");
    cr_assert(m <= n);
    cr_assert(m == strlen(want) && memcmp(b, want, m) == 0, "%s -> %.*s, want %s", in, (int)m, b,
              want);
    size_t m2 = net_path_normalize(b, m, &why);
    cr_assert(m2 == m && memcmp(b, want, m) == 0, "%s: not idempotent", in);
}

static void refuse_n(const char *in, size_t n, const char *reason_part)
{
    char b[256];
    memcpy(b, in, strlen(in));
    const char *why = NULL;
    cr_assert_eq(net_path_normalize(b, n, &why), 0, "%.*s accepted", (int)n, in);
    cr_assert(why && strstr(why, reason_part), "%s: reason %s", in, why ? why : "(none)");
}

static void refuse(const char *in, const char *reason_part)
{
    refuse_n(in, strlen(in), reason_part);
}

Test(net_path, mixed_and_encoded_dot_segments)
{
    expect("/a/.%2E/b", "/b");
    expect("/a/%2e./b", "/b");
    expect("/a/b/%2e%2e/", "/a/");
    expect("/a/%2e", "/a/");
    expect("/%2e", "/");
    expect("/a/./b/./", "/a/b/");
    expect("/a%2e%2e", "/a..");   /* dots inside a segment are not a dot segment */
    expect("/.../b/....", "/.../b/....");
    expect("/a/.b/..c/", "/a/.b/..c/");
}

Test(net_path, dot_dot_through_merged_slashes)
{
    expect("/a//..//b", "/b");
    expect("/a/b//../../c", "/c");
    expect("///a///.///", "/a/");
    refuse("/a/b/../../..", "root");
    refuse("//..//", "root");
    refuse("/a/%2E%2E/%2e%2e/x", "root");
}

Test(net_path, bytes_above_ascii_and_reserved_escapes_pass_through)
{
    expect("/caf\xc3\xa9/x", "/caf\xc3\xa9/x");
    expect("/a\\b", "/a\\b");
    expect("/a%5cb", "/a%5Cb");
    expect("/%7e%7E", "/~~");
    expect("/a%252e%252e/b", "/a%252e%252e/b"); /* one decoding only: %25 stays */
}

Test(net_path, escape_cut_by_the_end_of_the_path_is_refused)
{
    /* The bytes after n are hex digits: they must not complete the escape. */
    refuse_n("/a%41", 4, "percent");
    refuse_n("/a%41", 3, "percent");
    refuse("/a/%", "percent");
    refuse("/a/%%41", "percent");
    refuse("/a/..%2F", "%2F");
    refuse("/a#", "fragment");
}
