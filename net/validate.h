/* Byte-level HTTP/1.1 framing validation, independent of llhttp and of libuv.
 *
 * Debian's llhttp 8.1 accepts inputs that llhttp 9 and nginx reject (obs-fold, a bare CR in a
 * header value, "\r\n\rX" ending the head, chunk data not followed by CRLF). We do not rely on
 * the parser's version: every byte of a message head and of chunked framing goes through these
 * scanners before llhttp sees it, and the semantic checks (Host, Content-Length,
 * Transfer-Encoding, Upgrade, ...) run on the parsed header list. Where the two disagree we
 * reject, so llhttp can only ever make us stricter.
 *
 * Scanners are incremental: zero-initialise the state (then set limits), feed bytes as they
 * arrive; each call reports how many bytes it consumed and whether the element is complete. */
#ifndef NET_VALIDATE_H
#define NET_VALIDATE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

typedef struct {
    dp_iovec_t name;
    dp_iovec_t value;
} net_header_t;

enum {
    NET_SCAN_ERROR = -1, /* invalid input: see status and reason */
    NET_SCAN_MORE = 0,   /* everything given was consumed; the element is not complete */
    NET_SCAN_DONE = 1,   /* complete; *consumed tells where it ended */
};

/* ---- message head (request or status line + header lines + empty line) ---- */

typedef struct {
    uint32_t max_bytes;   /* head larger than this: 431 (requests) */
    uint32_t max_headers; /* more header lines than this: 431 */
    /* internal state */
    uint8_t state;
    uint32_t bytes;
    uint32_t lines; /* header lines seen (excluding the start line) */
    uint32_t line_len;
    bool started; /* a non-CRLF byte of the start line was seen */
} net_head_scan_t;

/* Scan n bytes. Returns NET_SCAN_DONE with *consumed = bytes up to and including the final LF,
 * NET_SCAN_MORE with *consumed = n, or NET_SCAN_ERROR with *status (400 or 431) and *reason.
 * Leading empty lines before the start line are skipped (RFC 9112 §2.2) and count as
 * consumed. */
int net_head_scan(net_head_scan_t *s, const char *p, size_t n, size_t *consumed, int *status,
                  const char **reason);
/* True once any byte of a message was seen (decides 408 vs a silent idle close). */
bool net_validate_head_scan_started(const net_head_scan_t *s);

/* ---- chunked body framing ---- */

typedef struct {
    uint32_t max_trailer_bytes; /* 0 means 8192 */
    /* internal state */
    uint8_t state;
    uint8_t digits;
    uint64_t remaining;
    uint32_t trailer_bytes;
} net_chunk_scan_t;

/* Scan n bytes of a chunked body. NET_SCAN_DONE when the last chunk and trailer section ended
 * (*consumed = bytes up to and including the final LF); NET_SCAN_MORE when more is needed;
 * NET_SCAN_ERROR with *reason otherwise. */
int net_chunk_scan(net_chunk_scan_t *s, const char *p, size_t n, size_t *consumed,
                   const char **reason);

/* ---- header semantics ---- */

typedef struct {
    int64_t content_length; /* -1 when absent */
    bool chunked;
    bool has_host;
    bool expect_continue; /* "Expect: 100-continue" */
    bool conn_close;      /* "Connection: close" */
    bool conn_keep_alive; /* "Connection: keep-alive" (matters for HTTP/1.0) */
} net_framing_t;

/* Validate a request's headers (method is llhttp_method_t). Returns 0, or the HTTP status to
 * answer (400, 417, 501) with *reason. Rejects: Content-Length that is not plain decimal
 * digits, overflowing, repeated (even when equal) or a list; Transfer-Encoding on HTTP/1.0,
 * repeated, or other than exactly "chunked"; both Content-Length and Transfer-Encoding;
 * missing Host on HTTP/1.1 or repeated Host or a Host with characters outside a host name;
 * Upgrade and CONNECT (never tunnelled); Expect other than 100-continue; a request-target
 * that is not origin-form (or "*" for OPTIONS). */
int net_request_check(const net_header_t *h, size_t n, uint8_t http_major, uint8_t http_minor,
                      int method, const char *target, size_t target_len, net_framing_t *out,
                      const char **reason);

/* Validate a response's headers. Returns 0 or -1 with *reason. Same Content-Length and
 * Transfer-Encoding rules; no Host/Upgrade rules. A 101 is refused (we never upgrade). */
int net_response_check(const net_header_t *h, size_t n, uint8_t http_major, uint8_t http_minor,
                       int status, net_framing_t *out, const char **reason);

/* Hop-by-hop headers (RFC 9110 §7.6.1) plus those a proxy regenerates: true when `name` must not
 * be copied from one side to the other. Also true for any name listed in the message's
 * Connection header (pass the Connection value, may be NULL). */
bool net_header_is_hop(const char *name, size_t len, const dp_iovec_t *connection);

/* Does a Content-Encoding among these headers name a coding, i.e. anything but "identity"
 * (RFC 9110 §8.4.1; whitespace and case aside)? A coded body is one detproxy cannot read. */
bool net_content_coded(const net_header_t *hdrs, size_t n);
/* What a request whose body is coded is told (415 unsupported_content_encoding). */
#define NET_CODED_BODY_MESSAGE                                                                     \
    "a request body with Content-Encoding cannot be policed; send it as plain JSON"

#endif
