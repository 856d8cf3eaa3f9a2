#include "net/validate.h"

#include <assert.h>
#include <string.h>

#include <llhttp.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/util.h"

/* ---- head scanner ---------------------------------------------------------------------------
 * States: at the start of a line, inside a line, after a CR. The rules that matter for
 * smuggling are all local: every CR must be followed by LF, LF must follow CR, a header line
 * may not start with SP/HT (obs-fold), and no control byte other than HT may appear. */

enum { HS_LINE_START = 0, HS_IN_LINE, HS_AFTER_CR, HS_DONE };

/* Bytes that need a look inside a line: CR, LF, and controls other than HT. */
static const uint8_t line_special[256] = {
    [0] = 1,  [1] = 1,  [2] = 1,  [3] = 1,  [4] = 1,  [5] = 1,  [6] = 1,  [7] = 1,
    [8] = 1,  [10] = 1, [11] = 1, [12] = 1, [13] = 1, [14] = 1, [15] = 1, [16] = 1,
    [17] = 1, [18] = 1, [19] = 1, [20] = 1, [21] = 1, [22] = 1, [23] = 1, [24] = 1,
    [25] = 1, [26] = 1, [27] = 1, [28] = 1, [29] = 1, [30] = 1, [31] = 1, [127] = 1,
};

static inline bool is_ctl(unsigned char c)
{
    return (c < 0x20 && c != '\t') || c == 0x7f;
}

/* The first byte of u[i..end) that line_special marks, or end: sixteen bytes a step where the
 * CPU has SSE2 (a header line is mostly ordinary bytes, ~20-60 of them), one at a time in the
 * last sixteen. */
#if defined(__SSE2__)
static inline size_t plain_run(const unsigned char *u, size_t i, size_t end)
{
    const __m128i c1f = _mm_set1_epi8(0x1f), tab = _mm_set1_epi8('\t'), del = _mm_set1_epi8(0x7f);
    for (; i + 16 <= end; i += 16) {
        __m128i x = _mm_loadu_si128((const __m128i *)(const void *)(u + i));
        /* x <= 0x1f unsigned, but not HT; or DEL */
        __m128i ctl =
            _mm_andnot_si128(_mm_cmpeq_epi8(x, tab), _mm_cmpeq_epi8(_mm_min_epu8(x, c1f), x));
        unsigned mask = (unsigned)_mm_movemask_epi8(_mm_or_si128(ctl, _mm_cmpeq_epi8(x, del)));
        if (mask)
            return i + (size_t)__builtin_ctz(mask);
    }
    while (i < end && !line_special[u[i]])
        i++;
    return i;
}
#else
static inline size_t plain_run(const unsigned char *u, size_t i, size_t end)
{
    while (i < end && !line_special[u[i]])
        i++;
    return i;
}
#endif

int net_head_scan(net_head_scan_t *s, const char *p, size_t n, size_t *consumed, int *status,
                  const char **reason)
{
    const unsigned char *u = (const unsigned char *)p;
    size_t i = 0;
    *status = 400;
    for (; i < n; i++) {
        unsigned char c = u[i];
        if (s->started && ++s->bytes > s->max_bytes) {
            *status = 431;
            *reason = "request head too large";
            goto fail;
        }
        switch (s->state) {
        case HS_LINE_START:
            if (c == '\r') {
                s->state = HS_AFTER_CR;
                break;
            }
            if (!s->started) {
                if (c == '\n') {
                    *reason = "bare LF";
                    goto fail;
                }
                s->started = true;
                s->bytes = 1;
            } else if (c == ' ' || c == '\t') {
                *reason = "obsolete line folding";
                goto fail;
            } else if (++s->lines > s->max_headers) {
                *status = 431;
                *reason = "too many header fields";
                goto fail;
            }
            if (is_ctl(c) || c == '\n') {
                *reason = c == '\n' ? "bare LF" : "control character in head";
                goto fail;
            }
            s->line_len = 1;
            s->state = HS_IN_LINE;
            break;
        case HS_IN_LINE: {
            /* Fast path: skip ordinary bytes in bulk (most of a head). */
            if (!line_special[c]) {
                assert(s->bytes <= s->max_bytes);      /* checked for this byte above */
                size_t room = s->max_bytes - s->bytes; /* bytes still allowed */
                size_t lim = n - i - 1 < room ? n - i - 1 : room;
                size_t j = plain_run(u, i + 1, i + 1 + lim);
                size_t run = j - i;
                s->line_len += (uint32_t)run;
                s->bytes += (uint32_t)(run - 1); /* this byte was already counted */
                i = j - 1;
                break;
            }
            if (c == '\r') {
                s->state = HS_AFTER_CR;
            } else if (c == '\n') {
                *reason = "bare LF";
                goto fail;
            } else if (is_ctl(c)) {
                *reason = "control character in head";
                goto fail;
            } else {
                s->line_len++;
            }
            break;
        }
        case HS_AFTER_CR:
            if (c != '\n') {
                *reason = "bare CR";
                goto fail;
            }
            if (s->line_len == 0 && s->started) {
                s->state = HS_DONE;
                *consumed = i + 1;
                return NET_SCAN_DONE;
            }
            /* An empty line before the start line is skipped; any other ends a line. */
            s->line_len = 0;
            s->state = HS_LINE_START;
            break;
        default:
            *reason = "head already complete";
            goto fail;
        }
    }
    *consumed = n;
    return NET_SCAN_MORE;
fail:
    *consumed = i;
    return NET_SCAN_ERROR;
}

bool net_validate_head_scan_started(const net_head_scan_t *s)
{
    return s->started || s->state == HS_AFTER_CR;
}

/* ---- chunk scanner ------------------------------------------------------------------------ */

enum {
    CS_SIZE = 0, /* hex digits of a chunk size */
    CS_EXT,      /* ";ext" up to CR */
    CS_SIZE_LF,
    CS_DATA,
    CS_DATA_CR,
    CS_DATA_LF,
    CS_TRAILER_START, /* start of a trailer line or the final CRLF */
    CS_TRAILER_LINE,
    CS_TRAILER_LF,
    CS_FINAL_LF,
    CS_DONE,
};

int net_chunk_scan(net_chunk_scan_t *s, const char *p, size_t n, size_t *consumed,
                   const char **reason)
{
    const unsigned char *u = (const unsigned char *)p;
    uint32_t max_trailer = s->max_trailer_bytes ? s->max_trailer_bytes : 8192;
    size_t i = 0;
    while (i < n) {
        unsigned char c = u[i];
        switch (s->state) {
        case CS_SIZE: {
            int d = dp_hexval(c);
            if (d >= 0) {
                /* 15 hex digits keep the size below 2^60: no overflow anywhere downstream. */
                if (++s->digits > 15) {
                    *reason = "chunk size too large";
                    goto fail;
                }
                s->remaining = s->remaining << 4 | (uint64_t)d;
                i++;
                break;
            }
            if (s->digits == 0) {
                *reason = "invalid chunk size";
                goto fail;
            }
            if (c == ';') {
                s->state = CS_EXT;
            } else if (c == '\r') {
                s->state = CS_SIZE_LF;
            } else {
                *reason = "invalid chunk size";
                goto fail;
            }
            i++;
            break;
        }
        case CS_EXT:
            if (c == '\r') {
                s->state = CS_SIZE_LF;
            } else if (is_ctl(c)) {
                *reason = "control character in chunk extension";
                goto fail;
            }
            i++;
            break;
        case CS_SIZE_LF:
            if (c != '\n') {
                *reason = "bare CR after chunk size";
                goto fail;
            }
            i++;
            s->digits = 0;
            s->state = s->remaining == 0 ? CS_TRAILER_START : CS_DATA;
            break;
        case CS_DATA: {
            size_t take = n - i;
            if (take > s->remaining)
                take = (size_t)s->remaining;
            s->remaining -= take;
            i += take;
            if (s->remaining == 0)
                s->state = CS_DATA_CR;
            break;
        }
        case CS_DATA_CR:
            if (c != '\r') {
                *reason = "chunk data not followed by CRLF";
                goto fail;
            }
            s->state = CS_DATA_LF;
            i++;
            break;
        case CS_DATA_LF:
            if (c != '\n') {
                *reason = "chunk data not followed by CRLF";
                goto fail;
            }
            s->state = CS_SIZE;
            i++;
            break;
        case CS_TRAILER_START:
            if (c == '\r') {
                s->state = CS_FINAL_LF;
                i++;
                break;
            }
            if (c == ' ' || c == '\t' || c == '\n' || is_ctl(c)) {
                *reason = "invalid trailer line";
                goto fail;
            }
            s->state = CS_TRAILER_LINE;
            break;
        case CS_TRAILER_LINE:
            if (++s->trailer_bytes > max_trailer) {
                *reason = "trailer section too large";
                goto fail;
            }
            if (c == '\r') {
                s->state = CS_TRAILER_LF;
            } else if (c == '\n' || is_ctl(c)) {
                *reason = "invalid trailer line";
                goto fail;
            }
            i++;
            break;
        case CS_TRAILER_LF:
            if (c != '\n') {
                *reason = "bare CR in trailer";
                goto fail;
            }
            s->state = CS_TRAILER_START;
            i++;
            break;
        case CS_FINAL_LF:
            if (c != '\n') {
                *reason = "bare CR ending chunked body";
                goto fail;
            }
            s->state = CS_DONE;
            *consumed = i + 1;
            return NET_SCAN_DONE;
        default:
            *reason = "chunked body already complete";
            goto fail;
        }
    }
    *consumed = n;
    return NET_SCAN_MORE;
fail:
    *consumed = i;
    return NET_SCAN_ERROR;
}

/* ---- header semantics -------------------------------------------------------------------- */

/* Does a comma-separated list value contain `token` (case-insensitive)? */
static bool list_has(dp_iovec_t v, const char *token)
{
    size_t i = 0;
    while (i <= v.len) {
        size_t j = i;
        while (j < v.len && v.base[j] != ',')
            j++;
        dp_iovec_t item = dp_trim_ows((dp_iovec_t){v.base + i, j - i});
        if (dp_strieq(item.base, item.len, token))
            return true;
        i = j + 1;
    }
    return false;
}

static bool host_char_ok(unsigned char c)
{
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'))
        return true;
    return strchr("-._~%!$&'()*+,;=:[]", c) != NULL && c != '\0';
}

/* The rules shared by requests and responses: Content-Length and Transfer-Encoding. */
static int check_framing(const net_header_t *h, size_t n, uint8_t major, uint8_t minor,
                         net_framing_t *out, const char **reason)
{
    int ncl = 0, nte = 0;
    for (size_t i = 0; i < n; i++) {
        dp_iovec_t name = h[i].name;
        dp_iovec_t v = dp_trim_ows(h[i].value);
        if (dp_strieq(name.base, name.len, "content-length")) {
            uint64_t cl;
            if (++ncl > 1) {
                *reason = "repeated Content-Length";
                return -1;
            }
            /* 2^53 is far beyond any body we accept and keeps the value exact everywhere. */
            if (dp_parse_u64(v.base, v.len, &cl) != 0 || cl > (1ULL << 53)) {
                *reason = "invalid Content-Length";
                return -1;
            }
            out->content_length = (int64_t)cl;
        } else if (dp_strieq(name.base, name.len, "transfer-encoding")) {
            if (major == 1 && minor == 0) {
                *reason = "Transfer-Encoding in an HTTP/1.0 message";
                return -1;
            }
            if (++nte > 1) {
                *reason = "repeated Transfer-Encoding";
                return -1;
            }
            if (!dp_strieq(v.base, v.len, "chunked")) {
                *reason = "unsupported Transfer-Encoding (only \"chunked\" is accepted)";
                return -1;
            }
            out->chunked = true;
        } else if (dp_strieq(name.base, name.len, "connection")) {
            if (list_has(v, "close"))
                out->conn_close = true;
            if (list_has(v, "keep-alive"))
                out->conn_keep_alive = true;
        }
    }
    if (ncl && nte) {
        *reason = "both Content-Length and Transfer-Encoding";
        return -1;
    }
    return 0;
}

int net_request_check(const net_header_t *h, size_t n, uint8_t http_major, uint8_t http_minor,
                      int method, const char *target, size_t target_len, net_framing_t *out,
                      const char **reason)
{
    memset(out, 0, sizeof(*out));
    out->content_length = -1;
    if (http_major != 1 || http_minor > 1) {
        *reason = "unsupported HTTP version";
        return 400;
    }
    if (method == HTTP_CONNECT) {
        *reason = "CONNECT is not supported";
        return 400;
    }
    if (target_len == 0 ||
        (target[0] != '/' && !(method == HTTP_OPTIONS && target_len == 1 && target[0] == '*'))) {
        *reason = "request-target must be origin-form";
        return 400;
    }
    if (check_framing(h, n, http_major, http_minor, out, reason) != 0)
        return 400;
    int nhost = 0;
    for (size_t i = 0; i < n; i++) {
        dp_iovec_t name = h[i].name;
        if (dp_strieq(name.base, name.len, "host")) {
            if (++nhost > 1) {
                *reason = "repeated Host";
                return 400;
            }
            dp_iovec_t v = dp_trim_ows(h[i].value);
            for (size_t k = 0; k < v.len; k++) {
                if (!host_char_ok((unsigned char)v.base[k])) {
                    *reason = "invalid Host";
                    return 400;
                }
            }
        } else if (dp_strieq(name.base, name.len, "upgrade")) {
            *reason = "protocol upgrades are not supported";
            return 400;
        } else if (dp_strieq(name.base, name.len, "expect")) {
            dp_iovec_t v = dp_trim_ows(h[i].value);
            if (!dp_strieq(v.base, v.len, "100-continue")) {
                *reason = "unsupported Expect";
                return 417;
            }
            out->expect_continue = true;
        }
    }
    if (nhost == 0 && http_minor == 1) {
        *reason = "missing Host";
        return 400;
    }
    out->has_host = nhost == 1;
    return 0;
}

int net_response_check(const net_header_t *h, size_t n, uint8_t http_major, uint8_t http_minor,
                       int status, net_framing_t *out, const char **reason)
{
    memset(out, 0, sizeof(*out));
    out->content_length = -1;
    if (http_major != 1 || http_minor > 1) {
        *reason = "unsupported HTTP version";
        return -1;
    }
    if (status == 101) {
        *reason = "unexpected protocol switch";
        return -1;
    }
    if (status < 100 || status > 999) {
        *reason = "invalid status code";
        return -1;
    }
    return check_framing(h, n, http_major, http_minor, out, reason);
}

bool net_header_is_hop(const char *name, size_t len, const dp_iovec_t *connection)
{
    /* Switch on the length first: most end-to-end names fail here with no comparison at all
     * (this runs for every header of every request and response). */
    const char *cand = NULL, *cand2 = NULL;
    switch (len) {
    case 2:
        cand = "te";
        break;
    case 7:
        cand = "trailer";
        cand2 = "upgrade";
        break;
    case 10:
        cand = "connection";
        cand2 = "keep-alive";
        break;
    case 14:
        cand = "content-length";
        cand2 = "http2-settings";
        break;
    case 16:
        cand = "proxy-connection";
        break;
    case 17:
        cand = "transfer-encoding";
        break;
    case 18:
        cand = "proxy-authenticate";
        break;
    case 19:
        cand = "proxy-authorization";
        break;
    default:
        break;
    }
    if ((cand && dp_memieq(name, cand, len)) || (cand2 && dp_memieq(name, cand2, len)))
        return true;
    if (connection && connection->len) {
        /* Names listed in Connection are hop-by-hop for this message. */
        dp_iovec_t v = *connection;
        size_t i = 0;
        while (i <= v.len) {
            size_t j = i;
            while (j < v.len && v.base[j] != ',')
                j++;
            dp_iovec_t item = dp_trim_ows((dp_iovec_t){v.base + i, j - i});
            if (item.len == len && dp_memieq(name, item.base, len))
                return true;
            i = j + 1;
        }
    }
    return false;
}

bool net_content_coded(const net_header_t *hdrs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        if (!dp_strieq(hdrs[i].name.base, hdrs[i].name.len, "content-encoding"))
            continue;
        dp_iovec_t v = dp_trim_ows(hdrs[i].value);
        if (!dp_strieq(v.base, v.len, "identity"))
            return true;
    }
    return false;
}
