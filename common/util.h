/* Small helpers shared by every module: time, hashing, hex, strict number parsing. */
#ifndef DP_UTIL_H
#define DP_UTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

#define DP_ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))
#define dp_container_of(ptr, type, member) ((type *)((char *)(ptr)-offsetof(type, member)))

/* Monotonic milliseconds / nanoseconds, and wall-clock milliseconds since the epoch. */
uint64_t dp_now_ms(void);
uint64_t dp_now_ns(void);
uint64_t dp_wall_ms(void);
/* "2026-11-29T17:30:46.123Z" into out (at least 25 bytes). */
void dp_iso8601(char *out, uint64_t wall_ms);
/* An RFC 3339 time ("2026-11-29T17:30:46Z", "...46.123+01:00", "t" and "z" too) or a date
 * alone (its midnight UTC) to milliseconds since the epoch (digits past the millisecond are
 * dropped); -1 for anything else, a day the month does not have included. */
int dp_parse_time_ms(const char *s, int64_t *ms);

/* The value of one hex digit (either case), or -1. */
int dp_hexval(unsigned char c);
/* Length of the well-formed UTF-8 sequence at p[0..n) (1 to 4), or 0: overlong forms,
 * surrogates and code points past U+10FFFF are not well formed. n >= 1. */
size_t dp_utf8_len(const unsigned char *p, size_t n);
/* Offset of the first byte of s[0..n) that does not start a well-formed UTF-8 sequence
 * (overlong forms, surrogates and code points past U+10FFFF are not), or n. */
size_t dp_utf8_invalid_at(const char *s, size_t n);
/* v without leading and trailing spaces and tabs (HTTP's optional whitespace). */
dp_iovec_t dp_trim_ows(dp_iovec_t v);
/* An Authorization value "Bearer <token>" (surrounding whitespace trimmed, scheme in any case,
 * one space, a token without spaces or controls): true with *tok set. */
bool dp_bearer_token(dp_iovec_t v, dp_iovec_t *tok);
/* Lowercase hex of n bytes into out (2n+1 bytes, NUL-terminated). */
void dp_hex(const void *p, size_t n, char *out);
/* Parse exactly 2n lowercase-or-uppercase hex chars into out; -1 on any bad char or length. */
int dp_unhex(const char *hex, size_t hexlen, uint8_t *out, size_t n);
bool dp_is_lower_hex(const char *s, size_t want_len);

/* splitmix64's finaliser: a fast bijective 64-bit mixer with full avalanche (not
 * cryptographic). */
uint64_t dp_mix64(uint64_t x);

void dp_sha256(const void *p, size_t n, uint8_t out[32]);
void dp_sha256_hex(const void *p, size_t n, char out[65]);
/* Incremental SHA-256 (EVP): begin returns NULL only when OpenSSL is out of memory; end frees
 * the context and writes 64 hex chars + NUL. */
typedef struct evp_md_ctx_st dp_sha256_ctx_t;
dp_sha256_ctx_t *dp_sha256_begin(void);
void dp_sha256_update(dp_sha256_ctx_t *c, const void *p, size_t n);
void dp_sha256_end_hex(dp_sha256_ctx_t *c, char out[65]);

/* Constant-time equality of two equal-length byte strings. */
bool dp_ct_equal(const void *a, const void *b, size_t n);

/* Fill with cryptographically random bytes (OpenSSL RAND_bytes). 0 or -1. */
int dp_random_bytes(void *p, size_t n);

/* Strict unsigned decimal: 1+ digits, no sign, no spaces, no overflow. 0 or -1. */
int dp_parse_u64(const char *s, size_t n, uint64_t *out);
/* The first n bytes of src (at most cap - 1 of them) into dst, NUL-terminated (cap > 0): what
 * snprintf(dst, cap, "%.*s", n, src) writes, without the format parsing. */
void dp_copy_str(char *dst, size_t cap, const char *src, size_t n);

/* A JSON number (a double) as an integer, saturating: NaN and what lies below the type's range
 * give 0 (u64) or INT64_MIN (i64), what lies above it the type's maximum. A plain cast of a
 * value out of range is undefined behaviour, and numbers here come from files and peers. */
static inline uint64_t dp_sat_u64(double v)
{
    if (!(v > 0))
        return 0;
    return v >= 18446744073709551616.0 ? UINT64_MAX : (uint64_t)v;
}
static inline int64_t dp_sat_i64(double v)
{
    if (v != v)
        return 0;
    if (v >= 9223372036854775808.0)
        return INT64_MAX;
    return v < -9223372036854775808.0 ? INT64_MIN : (int64_t)v;
}

/* ASCII case-insensitive equality of two n-byte strings. */
bool dp_memieq(const char *a, const char *b, size_t n);
/* ASCII case-insensitive equality of a length-delimited string with a C string. Inline, so that
 * a literal b's length is a constant: most calls (a header's name against each of the few that
 * detproxy reads) end at the length test. */
static inline bool dp_strieq(const char *a, size_t alen, const char *b)
{
    return alen == __builtin_strlen(b) && dp_memieq(a, b, alen);
}

/* Open path to read it as an input: a regular file or a pipe (a FIFO, a shell's process
 * substitution). Opened without blocking (a FIFO with no writer would hang the open), looked
 * at, and a pipe set back to blocking reads. The descriptor (O_CLOEXEC), or -errno; -EINVAL for
 * another kind of file (a directory, a device such as /dev/zero, which never ends). */
int dp_open_input(const char *path);

/* What an error of dp_open_input or dp_read_file means, for a message: -EINVAL "not a regular
 * file or a pipe", -EFBIG "too large", else strerror. */
const char *dp_input_strerror(int rc);

/* Read a whole file, at most max bytes (more is an error), opened as dp_open_input does (a FIFO
 * with no writer reads as empty instead of hanging the caller). 0, or -errno / -EFBIG. */
int dp_read_file(const char *path, size_t max, dp_buf_t *out);
/* dp_read_file of path, or of standard input when path is "-". */
int dp_read_input(const char *path, size_t max, dp_buf_t *out);
/* The same from an open descriptor (not closed here; one set non-blocking is waited on). */
int dp_read_fd(int fd, size_t max, dp_buf_t *out);

/* Base64 (standard alphabet, padded). Decode returns -1 on bad input. */
void dp_base64_encode(const void *p, size_t n, dp_buf_t *out);
int dp_base64_decode(const char *s, size_t n, dp_buf_t *out);

#endif
