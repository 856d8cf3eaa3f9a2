/* Unit tests for net/validate: the byte-level head and chunk scanners and the header
 * semantic checks that stand between llhttp 8.1 and request smuggling. */
#include <criterion/criterion.h>
#include <llhttp.h>
#include <string.h>

#include "net/validate.h"

static int scan_head(const char *s, size_t n, size_t *consumed, int *status, const char **why)
{
    net_head_scan_t hs = {0};
    hs.max_bytes = 1024;
    hs.max_headers = 8;
    return net_head_scan(&hs, s, n, consumed, status, why);
}

#define HEAD(lit) scan_head(lit, sizeof(lit) - 1, &used, &status, &why)

Test(head_scan, accepts_a_plain_head_and_stops_at_its_end)
{
    size_t used;
    int status;
    const char *why;
    const char req[] = "GET / HTTP/1.1\r\nHost: a\r\n\r\nGET /next";
    cr_assert_eq(HEAD(req), NET_SCAN_DONE);
    cr_assert_eq(used, strlen("GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
}

Test(head_scan, rejects_obs_fold)
{
    size_t used;
    int status;
    const char *why;
    cr_assert_eq(HEAD("GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_eq(status, 400);
    cr_assert_str_eq(why, "obsolete line folding");
}

Test(head_scan, rejects_bare_cr_in_value)
{
    size_t used;
    int status;
    const char *why;
    cr_assert_eq(HEAD("GET / HTTP/1.1\r\nHost: a\r\nX: a\rb\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_str_eq(why, "bare CR");
}

Test(head_scan, rejects_cr_lf_cr_x_ending)
{
    size_t used;
    int status;
    const char *why;
    cr_assert_eq(HEAD("GET / HTTP/1.1\r\nHost: a\r\n\rX\r\n"), NET_SCAN_ERROR);
    cr_assert_str_eq(why, "bare CR");
}

Test(head_scan, rejects_bare_lf_nul_and_ctl)
{
    size_t used;
    int status;
    const char *why;
    cr_assert_eq(HEAD("GET / HTTP/1.1\nHost: a\n\n"), NET_SCAN_ERROR);
    cr_assert_eq(HEAD("GET / HTTP/1.1\r\nHost: a\r\nX: a\0b\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_str_eq(why, "control character in head");
    cr_assert_eq(HEAD("GET / HTTP/1.1\r\nHo\x01st: a\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_eq(HEAD("GET / HTTP/1.1\r\nX: a\x7f\r\n\r\n"), NET_SCAN_ERROR);
}

Test(head_scan, tab_in_value_is_fine)
{
    size_t used;
    int status;
    const char *why;
    cr_assert_eq(HEAD("GET / HTTP/1.1\r\nHost: a\r\nX: a\tb\r\n\r\n"), NET_SCAN_DONE);
}

Test(head_scan, limits_give_431)
{
    size_t used;
    int status;
    const char *why;
    cr_assert_eq(HEAD("GET / HTTP/1.1\r\nA: 1\r\nB: 1\r\nC: 1\r\nD: 1\r\nE: 1\r\nF: 1\r\nG: "
                      "1\r\nH: 1\r\nI: 1\r\n\r\n"),
                 NET_SCAN_ERROR);
    cr_assert_eq(status, 431);
    char big[2048];
    memset(big, 'a', sizeof(big));
    memcpy(big, "GET /", 5);
    cr_assert_eq(scan_head(big, sizeof(big), &used, &status, &why), NET_SCAN_ERROR);
    cr_assert_eq(status, 431);
}

Test(head_scan, skips_leading_empty_lines)
{
    size_t used;
    int status;
    const char *why;
    cr_assert_eq(HEAD("\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n"), NET_SCAN_DONE);
    cr_assert_eq(used, 4 + strlen("GET / HTTP/1.1\r\nHost: a\r\n\r\n"));
}

Test(head_scan, byte_at_a_time_equals_whole)
{
    const char req[] = "POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\n\r\nabc";
    size_t head_len = strlen(req) - 3;
    net_head_scan_t hs = {0};
    hs.max_bytes = 1024;
    hs.max_headers = 8;
    for (size_t i = 0; i < head_len; i++) {
        size_t used;
        int status;
        const char *why;
        int r = net_head_scan(&hs, req + i, 1, &used, &status, &why);
        cr_assert_eq(used, 1);
        cr_assert_eq(r, i + 1 == head_len ? NET_SCAN_DONE : NET_SCAN_MORE, "at byte %zu", i);
    }
}

/* One head scanned whole and one byte at a time: the same verdict, status, reason and length
 * (a byte at a time, a line's ordinary bytes are never passed over in bulk). */
static int scan_both(const char *s, size_t n, size_t max_bytes, int *status, const char **why)
{
    net_head_scan_t whole = {0}, step = {0};
    whole.max_bytes = step.max_bytes = max_bytes;
    whole.max_headers = step.max_headers = 8;
    size_t used = 0, sused = 0;
    int r = net_head_scan(&whole, s, n, &used, status, why), sr = NET_SCAN_MORE, sst = 0;
    const char *swhy = NULL;
    size_t i = 0;
    for (; i < n && sr == NET_SCAN_MORE; i++)
        sr = net_head_scan(&step, s + i, 1, &sused, &sst, &swhy);
    cr_assert_eq(r, sr, "%.*s", (int)n, s);
    if (r == NET_SCAN_ERROR) {
        cr_assert_eq(*status, sst);
        cr_assert_str_eq(*why, swhy);
    } else if (r == NET_SCAN_DONE) {
        cr_assert_eq(used, i, "%.*s", (int)n, s);
    }
    return r;
}

Test(head_scan, every_byte_at_every_place_of_a_long_line)
{
    char head[128];
    const char start[] = "GET / HTTP/1.1\r\nX-Long: ";
    size_t sl = strlen(start), vl = 70;
    for (size_t at = 0; at < vl; at++) {
        for (int b = 0; b < 256; b++) {
            memcpy(head, start, sl);
            memset(head + sl, 'a', vl);
            head[sl + at] = (char)b;
            memcpy(head + sl + vl, "\r\n\r\n", 4);
            int status;
            const char *why;
            bool bad = (b < 0x20 && b != '\t') || b == 0x7f;
            int r = scan_both(head, sl + vl + 4, 1024, &status, &why);
            if (r != (bad ? NET_SCAN_ERROR : NET_SCAN_DONE))
                cr_assert_fail("byte 0x%02x at %zu: %d", b, at, r);
        }
    }
}

Test(head_scan, size_limit_inside_a_long_line)
{
    char head[160];
    const char start[] = "GET / HTTP/1.1\r\nX-Long: ";
    size_t sl = strlen(start), vl = 100, total = sl + vl + 4;
    memcpy(head, start, sl);
    memset(head + sl, 'a', vl);
    memcpy(head + sl + vl, "\r\n\r\n", 4);
    for (size_t max = sl; max <= total + 2; max++) {
        int status;
        const char *why;
        int r = scan_both(head, total, max, &status, &why);
        cr_assert_eq(r, max >= total ? NET_SCAN_DONE : NET_SCAN_ERROR, "max %zu", max);
        if (r == NET_SCAN_ERROR)
            cr_assert_eq(status, 431, "max %zu", max);
    }
}

static int scan_chunks(const char *s, size_t n, size_t *used, const char **why)
{
    net_chunk_scan_t cs = {0};
    return net_chunk_scan(&cs, s, n, used, why);
}

#define CHUNKS(lit) scan_chunks(lit, sizeof(lit) - 1, &used, &why)

Test(chunk_scan, valid_body_with_extension_and_trailer)
{
    size_t used;
    const char *why;
    cr_assert_eq(CHUNKS("5\r\nhello\r\n3;x=y\r\nabc\r\n0\r\nT: v\r\n\r\nNEXT"), NET_SCAN_DONE);
    cr_assert_eq(used, strlen("5\r\nhello\r\n3;x=y\r\nabc\r\n0\r\nT: v\r\n\r\n"));
}

Test(chunk_scan, data_not_followed_by_crlf)
{
    size_t used;
    const char *why;
    cr_assert_eq(CHUNKS("5\r\nhelloXX0\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_str_eq(why, "chunk data not followed by CRLF");
    cr_assert_eq(CHUNKS("5\r\nhello\rX0\r\n\r\n"), NET_SCAN_ERROR);
}

Test(chunk_scan, bad_sizes)
{
    size_t used;
    const char *why;
    cr_assert_eq(CHUNKS("\r\n"), NET_SCAN_ERROR);
    cr_assert_eq(CHUNKS("+5\r\nhello\r\n0\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_eq(CHUNKS("0x5\r\nhello\r\n0\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_eq(CHUNKS(" 5\r\nhello\r\n0\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_eq(CHUNKS("5 \r\nhello\r\n0\r\n\r\n"), NET_SCAN_ERROR);
    cr_assert_eq(CHUNKS("1000000000000000\r\n"), NET_SCAN_ERROR); /* 16 hex digits */
    cr_assert_str_eq(why, "chunk size too large");
    cr_assert_eq(CHUNKS("5\nhello\r\n"), NET_SCAN_ERROR);
}

Test(chunk_scan, split_at_every_byte)
{
    const char body[] = "5\r\nhello\r\na\r\n0123456789\r\n0\r\n\r\n";
    size_t n = sizeof(body) - 1;
    for (size_t cut = 1; cut < n; cut++) {
        net_chunk_scan_t cs = {0};
        size_t used;
        const char *why;
        cr_assert_eq(net_chunk_scan(&cs, body, cut, &used, &why), NET_SCAN_MORE, "cut %zu", cut);
        cr_assert_eq(used, cut);
        cr_assert_eq(net_chunk_scan(&cs, body + cut, n - cut, &used, &why), NET_SCAN_DONE);
        cr_assert_eq(used, n - cut);
    }
}

/* ---- header semantics ---- */

#define H(n, v)                                                                                    \
    {                                                                                              \
        {n, sizeof(n) - 1},                                                                        \
        {                                                                                          \
            v, sizeof(v) - 1                                                                       \
        }                                                                                          \
    }

static int check(const net_header_t *h, size_t n, int minor, int method, const char **why)
{
    net_framing_t f;
    return net_request_check(h, n, 1, (uint8_t)minor, method, "/", 1, &f, why);
}

Test(request_check, content_length_rules)
{
    const char *why;
    net_header_t ok[] = {H("Host", "a"), H("Content-Length", "5")};
    cr_assert_eq(check(ok, 2, 1, HTTP_POST, &why), 0);
    net_header_t plus[] = {H("Host", "a"), H("Content-Length", "+5")};
    cr_assert_eq(check(plus, 2, 1, HTTP_POST, &why), 400);
    net_header_t hex[] = {H("Host", "a"), H("Content-Length", "0x5")};
    cr_assert_eq(check(hex, 2, 1, HTTP_POST, &why), 400);
    net_header_t big[] = {H("Host", "a"), H("Content-Length", "99999999999999999999999")};
    cr_assert_eq(check(big, 2, 1, HTTP_POST, &why), 400);
    net_header_t two[] = {H("Host", "a"), H("Content-Length", "5"), H("content-length", "5")};
    cr_assert_eq(check(two, 3, 1, HTTP_POST, &why), 400);
    cr_assert_str_eq(why, "repeated Content-Length");
    net_header_t list[] = {H("Host", "a"), H("Content-Length", "5, 5")};
    cr_assert_eq(check(list, 2, 1, HTTP_POST, &why), 400);
}

Test(request_check, transfer_encoding_rules)
{
    const char *why;
    net_header_t ok[] = {H("Host", "a"), H("Transfer-Encoding", "chunked")};
    cr_assert_eq(check(ok, 2, 1, HTTP_POST, &why), 0);
    net_header_t cl[] = {H("Host", "a"), H("Transfer-Encoding", "chunked"),
                         H("Content-Length", "3")};
    cr_assert_eq(check(cl, 3, 1, HTTP_POST, &why), 400);
    net_header_t gz[] = {H("Host", "a"), H("Transfer-Encoding", "gzip, chunked")};
    cr_assert_eq(check(gz, 2, 1, HTTP_POST, &why), 400);
    net_header_t nonfinal[] = {H("Host", "a"), H("Transfer-Encoding", "chunked, gzip")};
    cr_assert_eq(check(nonfinal, 2, 1, HTTP_POST, &why), 400);
    net_header_t two[] = {H("Host", "a"), H("Transfer-Encoding", "chunked"),
                          H("Transfer-Encoding", "chunked")};
    cr_assert_eq(check(two, 3, 1, HTTP_POST, &why), 400);
    net_header_t te10[] = {H("Transfer-Encoding", "chunked")};
    cr_assert_eq(check(te10, 1, 0, HTTP_POST, &why), 400);
    cr_assert_str_eq(why, "Transfer-Encoding in an HTTP/1.0 message");
}

Test(request_check, host_rules)
{
    const char *why;
    cr_assert_eq(check(NULL, 0, 1, HTTP_GET, &why), 400);
    cr_assert_str_eq(why, "missing Host");
    cr_assert_eq(check(NULL, 0, 0, HTTP_GET, &why), 0); /* HTTP/1.0 may omit it */
    net_header_t two[] = {H("Host", "a"), H("Host", "b")};
    cr_assert_eq(check(two, 2, 1, HTTP_GET, &why), 400);
    net_header_t bad[] = {H("Host", "a b")};
    cr_assert_eq(check(bad, 1, 1, HTTP_GET, &why), 400);
    net_header_t v6[] = {H("Host", "[::1]:8080")};
    cr_assert_eq(check(v6, 1, 1, HTTP_GET, &why), 0);
}

Test(request_check, upgrade_connect_expect)
{
    const char *why;
    net_header_t up[] = {H("Host", "a"), H("Upgrade", "h2c")};
    cr_assert_eq(check(up, 2, 1, HTTP_GET, &why), 400);
    net_header_t conn[] = {H("Host", "a:443")};
    cr_assert_eq(check(conn, 1, 1, HTTP_CONNECT, &why), 400);
    net_header_t ex[] = {H("Host", "a"), H("Expect", "100-continue")};
    cr_assert_eq(check(ex, 2, 1, HTTP_POST, &why), 0);
    net_header_t exbad[] = {H("Host", "a"), H("Expect", "something")};
    cr_assert_eq(check(exbad, 2, 1, HTTP_POST, &why), 417);
}

Test(request_check, target_must_be_origin_form)
{
    const char *why;
    net_framing_t f;
    net_header_t h[] = {H("Host", "a")};
    cr_assert_eq(net_request_check(h, 1, 1, 1, HTTP_GET, "http://a/", 9, &f, &why), 400);
    cr_assert_eq(net_request_check(h, 1, 1, 1, HTTP_OPTIONS, "*", 1, &f, &why), 0);
    cr_assert_eq(net_request_check(h, 1, 1, 1, HTTP_GET, "*", 1, &f, &why), 400);
}

Test(response_check, framing_and_101)
{
    const char *why;
    net_framing_t f;
    net_header_t both[] = {H("Content-Length", "3"), H("Transfer-Encoding", "chunked")};
    cr_assert_eq(net_response_check(both, 2, 1, 1, 200, &f, &why), -1);
    cr_assert_eq(net_response_check(NULL, 0, 1, 1, 101, &f, &why), -1);
    net_header_t ok[] = {H("Content-Length", "3"), H("Connection", "keep-alive, close")};
    cr_assert_eq(net_response_check(ok, 2, 1, 1, 200, &f, &why), 0);
    cr_assert_eq(f.content_length, 3);
    cr_assert(f.conn_close);
}

Test(hop_by_hop, standard_and_connection_listed)
{
    dp_iovec_t conn = {"close, X-Secret", 15};
    cr_assert(net_header_is_hop("Keep-Alive", 10, NULL));
    cr_assert(net_header_is_hop("transfer-encoding", 17, NULL));
    cr_assert(net_header_is_hop("x-secret", 8, &conn));
    cr_assert_not(net_header_is_hop("x-secre", 7, &conn));
    cr_assert_not(net_header_is_hop("content-type", 12, &conn));
}
