/* net_path_normalize: the spellings an ASGI replica routes as the same path normalise to one
 * string; the ones with no safe reading are refused. */
#include <criterion/criterion.h>
#include <criterion/parameterized.h>
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
    /* idempotent */
    size_t m2 = net_path_normalize(b, m, &why);
    cr_assert(m2 == m && memcmp(b, want, m) == 0, "%s: not idempotent", in);
}

/* Only p[0..n) is the path: bytes after it (copied too) must never be read as part of it. */
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

Test(path, canonical_is_untouched)
{
    expect("/", "/");
    expect("/v1/completions", "/v1/completions");
    expect("/v1/chat/completions", "/v1/chat/completions");
    expect("/a-b_c.d~e/f", "/a-b_c.d~e/f");
    expect("/v1/models/", "/v1/models/");
}

Test(path, unreserved_escapes_decode)
{
    expect("/v1/%63ompletions", "/v1/completions");
    expect("/v1/chat/%63%6F%6d%70letions", "/v1/chat/completions");
    expect("/%76%31/completions", "/v1/completions");
    expect("/a%2Db%5Fc%2ed%7Ee", "/a-b_c.d~e");
    expect("/%41%5A%61%7A%30%39", "/AZaz09");
}

Test(path, reserved_escapes_stay_upper_cased)
{
    expect("/a%20b", "/a%20b");
    expect("/a%3fb%23c%25d", "/a%3Fb%23c%25d");
    expect("/a%3f", "/a%3F");
    expect("/%00", "/%00");
    expect("/%c3%a9", "/%C3%A9");
}

Test(path, slashes_merge)
{
    expect("//v1//completions", "/v1/completions");
    expect("/v1///chat////completions//", "/v1/chat/completions/");
    expect("//", "/");
}

Test(path, dot_segments_resolve)
{
    expect("/v1/./completions", "/v1/completions");
    expect("/v1/x/../completions", "/v1/completions");
    expect("/x/y/../../v1/chat/completions", "/v1/chat/completions");
    expect("/v1/%2e/completions", "/v1/completions");
    expect("/v1/x/%2E%2e/completions", "/v1/completions");
    expect("/v1/completions/.", "/v1/completions/");
    expect("/v1/completions/x/..", "/v1/completions/");
    expect("/a/..", "/");
    expect("/.", "/");
    expect("/...", "/...");
    expect("/..a/.b", "/..a/.b");
}

Test(path, refusals)
{
    refuse("/v1%2Fcompletions", "%2F");
    refuse("/v1%2fchat%2fcompletions", "%2F");
    refuse("/..", "root");
    refuse("/../v1/completions", "root");
    refuse("/a/../../v1/completions", "root");
    refuse("/%2e%2e/x", "root");
    refuse("/a%", "percent");
    refuse("/a%4", "percent");
    refuse("/a%zz", "percent");
    refuse("/a%4g/b", "percent");
    refuse("/v1/completions#x", "fragment");
}

/* Edge cases: mixed and encoded dot segments, climbing out through merged slashes, bytes above
 * 0x7f, and escapes cut by the end of the path. */
Test(path, mixed_and_encoded_dot_segments)
{
    expect("/a/.%2E/b", "/b");
    expect("/a/%2e./b", "/b");
    expect("/a/b/%2e%2e/", "/a/");
    expect("/a/%2e", "/a/");
    expect("/%2e", "/");
    expect("/a/./b/./", "/a/b/");
    expect("/a%2e%2e", "/a.."); /* dots inside a segment are not a dot segment */
    expect("/.../b/....", "/.../b/....");
    expect("/a/.b/..c/", "/a/.b/..c/");
}

Test(path, dot_dot_through_merged_slashes)
{
    expect("/a//..//b", "/b");
    expect("/a/b//../../c", "/c");
    expect("///a///.///", "/a/");
    refuse("/a/b/../../..", "root");
    refuse("//..//", "root");
    refuse("/a/%2E%2E/%2e%2e/x", "root");
}

Test(path, bytes_above_ascii_and_reserved_escapes_pass_through)
{
    expect("/caf\xc3\xa9/x", "/caf\xc3\xa9/x");
    expect("/a\\b", "/a\\b");
    expect("/a%5cb", "/a%5Cb");
    expect("/%7e%7E", "/~~");
    expect("/a%252e%252e/b", "/a%252e%252e/b"); /* one decoding only: %25 stays */
}

Test(path, escape_cut_by_the_end_of_the_path_is_refused)
{
    /* The bytes after n are hex digits: they must not complete the escape. */
    refuse_n("/a%41", 4, "percent");
    refuse_n("/a%41", 3, "percent");
    refuse("/a/%", "percent");
    refuse("/a/%%41", "percent");
    refuse("/a/..%2F", "%2F");
    refuse("/a#", "fragment");
}
