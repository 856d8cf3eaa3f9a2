#include "common/util.h"

#include <errno.h>
#include <pthread.h>
#include <fcntl.h>
#include <poll.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <openssl/sha.h>

uint64_t dp_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

uint64_t dp_now_ms(void)
{
    return dp_now_ns() / 1000000u;
}

uint64_t dp_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

void dp_iso8601(char *out, uint64_t wall_ms)
{
    time_t secs = (time_t)(wall_ms / 1000);
    struct tm tm;
    gmtime_r(&secs, &tm);
    size_t n = strftime(out, 25, "%Y-%m-%dT%H:%M:%S", &tm);
    unsigned ms = (unsigned)(wall_ms % 1000);
    out[n++] = '.';
    out[n++] = (char)('0' + ms / 100);
    out[n++] = (char)('0' + ms / 10 % 10);
    out[n++] = (char)('0' + ms % 10);
    out[n++] = 'Z';
    out[n] = '\0';
}

/* n decimal digits at s (no sign, no space), or -1. */
static int digits(const char *s, int n)
{
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        v = v * 10 + (s[i] - '0');
    }
    return v;
}

/* Days from 1970-01-01 to y-m-d of the proleptic Gregorian calendar (H. Hinnant's
 * days_from_civil): no struct tm, no normalising of a 30 February. */
static int64_t days_from_civil(int64_t y, int m, int d)
{
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

int dp_parse_time_ms(const char *s, int64_t *ms)
{
    static const int mdays[12] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (s == NULL || strlen(s) < 10 || s[4] != '-' || s[7] != '-')
        return -1;
    int y = digits(s, 4), mo = digits(s + 5, 2), d = digits(s + 8, 2);
    if (y < 0 || mo < 1 || mo > 12 || d < 1 || d > mdays[mo - 1])
        return -1;
    bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    if (mo == 2 && d == 29 && !leap)
        return -1;
    int64_t t = days_from_civil(y, mo, d) * 86400;
    int frac = 0;
    const char *e = s + 10;
    if (*e != '\0') {
        if ((*e != 'T' && *e != 't') || strlen(e) < 9 || e[3] != ':' || e[6] != ':')
            return -1;
        int h = digits(e + 1, 2), mi = digits(e + 4, 2), sec = digits(e + 7, 2);
        if (h < 0 || h > 23 || mi < 0 || mi > 59 || sec < 0 || sec > 60) /* 60: a leap second */
            return -1;
        t += h * 3600 + mi * 60 + sec;
        e += 9;
        if (*e == '.') {
            int n = 0;
            for (e++; *e >= '0' && *e <= '9'; e++, n++)
                if (n < 3)
                    frac += (*e - '0') * (n == 0 ? 100 : n == 1 ? 10 : 1);
            if (n == 0)
                return -1;
        }
        if (*e == 'Z' || *e == 'z') {
            e++;
        } else if ((*e == '+' || *e == '-') && strlen(e) == 6 && e[3] == ':') {
            int oh = digits(e + 1, 2), om = digits(e + 4, 2);
            if (oh < 0 || oh > 23 || om < 0 || om > 59)
                return -1;
            t -= (*e == '+' ? 1 : -1) * (oh * 3600 + om * 60);
            e += 6;
        } else {
            return -1;
        }
        if (*e != '\0')
            return -1;
    }
    *ms = t * 1000 + frac;
    return 0;
}

void dp_hex(const void *p, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * n] = '\0';
}

size_t dp_utf8_len(const unsigned char *p, size_t n)
{
    unsigned char c = p[0];
    if (c < 0x80)
        return 1;
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
        len = 2;
        cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
        len = 3;
        cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
        len = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (len > n)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (p[i] & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min_cp[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return len;
}

size_t dp_utf8_invalid_at(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0, k; i < n; i += k)
        if ((k = dp_utf8_len(p + i, n - i)) == 0)
            return i;
    return n;
}

int dp_hexval(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

dp_iovec_t dp_trim_ows(dp_iovec_t v)
{
    while (v.len && (v.base[0] == ' ' || v.base[0] == '\t')) {
        v.base++;
        v.len--;
    }
    while (v.len && (v.base[v.len - 1] == ' ' || v.base[v.len - 1] == '\t'))
        v.len--;
    return v;
}

bool dp_bearer_token(dp_iovec_t v, dp_iovec_t *tok)
{
    v = dp_trim_ows(v);
    if (v.len < 8 || !dp_strieq(v.base, 6, "bearer") || v.base[6] != ' ')
        return false;
    tok->base = v.base + 7;
    tok->len = v.len - 7;
    for (size_t i = 0; i < tok->len; i++)
        if ((unsigned char)tok->base[i] <= ' ' || tok->base[i] == 0x7f)
            return false;
    return true;
}

int dp_unhex(const char *hex, size_t hexlen, uint8_t *out, size_t n)
{
    if (hexlen != 2 * n)
        return -1;
    for (size_t i = 0; i < n; i++) {
        int hi = dp_hexval((unsigned char)hex[2 * i]),
            lo = dp_hexval((unsigned char)hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return -1;
        out[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}

bool dp_is_lower_hex(const char *s, size_t want_len)
{
    size_t n = strlen(s);
    if (n != want_len)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return false;
    return true;
}

/* OpenSSL 3's one-shot SHA256() fetches the algorithm and allocates a context on every call
 * (EVP_Q_digest): on the request path that is three allocations per hash. Fetch once per
 * process, keep one context per thread (hashes also run in libuv's thread pool and on worker
 * threads). The key's destructor frees a thread's context when the thread exits (libuv joins
 * its pool at exit; workers are joined at shutdown), so none is lost. */
static EVP_MD *g_sha256;
static pthread_once_t g_sha256_once = PTHREAD_ONCE_INIT;
static pthread_key_t g_ctx_key;
static _Thread_local EVP_MD_CTX *t_ctx;

static void ctx_free(void *c)
{
    EVP_MD_CTX_free(c);
}

static void sha256_fetch(void)
{
    g_sha256 = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (pthread_key_create(&g_ctx_key, ctx_free) != 0)
        abort();
}

uint64_t dp_mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

void dp_sha256(const void *p, size_t n, uint8_t out[32])
{
    pthread_once(&g_sha256_once, sha256_fetch);
    if (t_ctx == NULL && (t_ctx = EVP_MD_CTX_new()) != NULL)
        pthread_setspecific(g_ctx_key, t_ctx);
    unsigned len = 0;
    if (g_sha256 == NULL || t_ctx == NULL || EVP_DigestInit_ex(t_ctx, g_sha256, NULL) != 1 ||
        EVP_DigestUpdate(t_ctx, p, n) != 1 || EVP_DigestFinal_ex(t_ctx, out, &len) != 1)
        SHA256(p, n, out); /* the slow path still gives the right answer */
}

void dp_sha256_hex(const void *p, size_t n, char out[65])
{
    uint8_t d[32];
    dp_sha256(p, n, d);
    dp_hex(d, 32, out);
}

dp_sha256_ctx_t *dp_sha256_begin(void)
{
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    if (c && EVP_DigestInit_ex(c, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(c);
        c = NULL;
    }
    return c;
}

void dp_sha256_update(dp_sha256_ctx_t *c, const void *p, size_t n)
{
    if (c)
        EVP_DigestUpdate(c, p, n);
}

void dp_sha256_end_hex(dp_sha256_ctx_t *c, char out[65])
{
    uint8_t d[32] = {0};
    unsigned len = 0;
    if (c)
        EVP_DigestFinal_ex(c, d, &len);
    EVP_MD_CTX_free(c);
    dp_hex(d, 32, out);
}

bool dp_ct_equal(const void *a, const void *b, size_t n)
{
    return CRYPTO_memcmp(a, b, n) == 0;
}

int dp_random_bytes(void *p, size_t n)
{
    return RAND_bytes(p, (int)n) == 1 ? 0 : -1;
}

int dp_parse_u64(const char *s, size_t n, uint64_t *out)
{
    if (n == 0 || n > 20)
        return -1;
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        uint64_t d = (uint64_t)(s[i] - '0');
        if (v > (UINT64_MAX - d) / 10)
            return -1;
        v = v * 10 + d;
    }
    *out = v;
    return 0;
}

void dp_copy_str(char *dst, size_t cap, const char *src, size_t n)
{
    if (n >= cap)
        n = cap - 1;
    if (n)
        memcpy(dst, src, n);
    dst[n] = '\0';
}

static inline char lower(char c)
{
    return c >= 'A' && c <= 'Z' ? (char)(c + 32) : c;
}

/* Each ASCII capital of the eight bytes in x made small (bytes from 0x80 are left alone): a
 * byte's low seven bits plus 0x80 - 'A' carry into its top bit when they are at least 'A', plus
 * 0x80 - 'Z' - 1 when they are above 'Z'; the capitals gain 0x20. */
static inline uint64_t lower8(uint64_t x)
{
    const uint64_t ones = 0x0101010101010101ull, highs = 0x8080808080808080ull;
    uint64_t low7 = x & ~highs;
    uint64_t upper = (low7 + ones * (0x80 - 'A')) & ~(low7 + ones * (0x80 - 'Z' - 1)) & ~x & highs;
    return x | upper >> 2;
}

/* Header names, eight bytes a step. A name of eight bytes or more ends with the eight bytes
 * before its end, which overlap the last full step's (bytes already found equal compare equal
 * again); one of four to seven bytes is its first and last four, overlapping too. Only names
 * of one to three bytes go a byte at a time. */
bool dp_memieq(const char *a, const char *b, size_t n)
{
    uint64_t x, y;
    if (n >= 8) {
        for (size_t i = 0; i + 8 < n; i += 8) {
            memcpy(&x, a + i, 8);
            memcpy(&y, b + i, 8);
            if (x != y && lower8(x) != lower8(y))
                return false;
        }
        memcpy(&x, a + n - 8, 8);
        memcpy(&y, b + n - 8, 8);
        return x == y || lower8(x) == lower8(y);
    }
    if (n >= 4) {
        uint32_t a0, a1, b0, b1;
        memcpy(&a0, a, 4);
        memcpy(&a1, a + n - 4, 4);
        memcpy(&b0, b, 4);
        memcpy(&b1, b + n - 4, 4);
        x = (uint64_t)a1 << 32 | a0;
        y = (uint64_t)b1 << 32 | b0;
        return x == y || lower8(x) == lower8(y);
    }
    for (size_t i = 0; i < n; i++)
        if (lower(a[i]) != lower(b[i]))
            return false;
    return true;
}

int dp_open_input(const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return -errno;
    struct stat st;
    int rc = fstat(fd, &st) != 0 ? -errno : 0;
    if (rc == 0 && !S_ISREG(st.st_mode) && !S_ISFIFO(st.st_mode))
        rc = -EINVAL;
    if (rc == 0 && S_ISFIFO(st.st_mode) && fcntl(fd, F_SETFL, O_RDONLY) != 0)
        rc = -errno;
    if (rc != 0) {
        close(fd);
        return rc;
    }
    return fd;
}

const char *dp_input_strerror(int rc)
{
    if (rc == -EINVAL)
        return "not a regular file or a pipe";
    if (rc == -EFBIG)
        return "too large";
    return strerror(rc < 0 ? -rc : rc);
}

int dp_read_file(const char *path, size_t max, dp_buf_t *out)
{
    int fd = dp_open_input(path);
    if (fd < 0)
        return fd;
    int rc = dp_read_fd(fd, max, out);
    close(fd);
    return rc;
}

int dp_read_input(const char *path, size_t max, dp_buf_t *out)
{
    if (strcmp(path, "-") == 0)
        return dp_read_fd(STDIN_FILENO, max, out);
    return dp_read_file(path, max, out);
}

int dp_read_fd(int fd, size_t max, dp_buf_t *out)
{
    int rc = 0;
    for (;;) {
        dp_buf_reserve(out, 65536);
        ssize_t r = read(fd, out->base + out->len, 65536);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                /* A descriptor someone else made non-blocking (a standard input a libuv or Node
                 * parent handed over): wait for its bytes, as a blocking read would. */
                struct pollfd pfd = {.fd = fd, .events = POLLIN};
                if (poll(&pfd, 1, -1) >= 0 || errno == EINTR)
                    continue;
            }
            rc = -errno;
            break;
        }
        if (r == 0)
            break;
        out->len += (size_t)r;
        out->base[out->len] = '\0';
        if (out->len > max) {
            rc = -EFBIG;
            break;
        }
    }
    return rc;
}

/* The largest input EVP_EncodeBlock takes at once: a multiple of 3 whose encoding fits an int. */
#define B64_PIECE ((size_t)3 << 28)

void dp_base64_encode(const void *p, size_t n, dp_buf_t *out)
{
    dp_buf_reserve(out, 4 * ((n + 2) / 3));
    const unsigned char *in = p;
    do { /* OpenSSL counts in int: whole groups of three, a piece at a time */
        size_t k = n < B64_PIECE ? n : B64_PIECE;
        int w = EVP_EncodeBlock((unsigned char *)out->base + out->len, in, (int)k);
        out->len += (size_t)w;
        in += k;
        n -= k;
    } while (n > 0);
    out->base[out->len] = '\0';
}

int dp_base64_decode(const char *s, size_t n, dp_buf_t *out)
{
    if (n % 4 != 0)
        return -1;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        bool ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                  c == '+' || c == '/' || (c == '=' && i >= n - 2);
        if (!ok)
            return -1;
    }
    size_t pad = 0;
    if (n >= 1 && s[n - 1] == '=')
        pad++;
    if (n >= 2 && s[n - 2] == '=')
        pad++;
    if (pad == 1 && n >= 2 && s[n - 2] == '=')
        return -1;
    dp_buf_reserve(out, n / 4 * 3);
    size_t len0 = out->len;
    do { /* whole groups of four; only the last piece can hold padding */
        size_t k = n < B64_PIECE / 3 * 4 ? n : B64_PIECE / 3 * 4;
        int w = EVP_DecodeBlock((unsigned char *)out->base + out->len, (const unsigned char *)s,
                                (int)k);
        if (w < 0) {
            out->len = len0;
            out->base[len0] = '\0';
            return -1;
        }
        out->len += (size_t)w;
        s += k;
        n -= k;
    } while (n > 0);
    out->len -= pad;
    out->base[out->len] = '\0';
    return 0;
}
