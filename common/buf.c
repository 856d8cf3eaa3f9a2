#include "common/buf.h"

#include <assert.h>
#include <pthread.h>
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(__SANITIZE_ADDRESS__)
#define __SANITIZE_ADDRESS__ 1 /* clang's spelling of GCC's macro */
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define STASH_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define STASH_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define STASH_POISON(p, n) ((void)(p), (void)(n))
#define STASH_UNPOISON(p, n) ((void)(p), (void)(n))
#endif
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void oom(void)
{
    fputs("{\"level\":\"fatal\",\"msg\":\"out of memory\"}\n", stderr);
    abort();
}

void *dp_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (p == NULL)
        oom();
    return p;
}

void *dp_xcalloc(size_t n, size_t m)
{
    void *p = calloc(n ? n : 1, m ? m : 1);
    if (p == NULL)
        oom();
    return p;
}

void *dp_xrealloc(void *p, size_t n)
{
    p = realloc(p, n ? n : 1);
    if (p == NULL)
        oom();
    return p;
}

char *dp_xstrdup(const char *s)
{
    return dp_xstrndup(s, strlen(s));
}

char *dp_xstrndup(const char *s, size_t n)
{
    char *p = dp_xmalloc(n + 1);
    memcpy(p, s, n);
    p[n] = '\0';
    return p;
}

#ifndef NDEBUG
/* What every function here relies on: a buffer is unallocated and empty (base NULL, cap 0, len
 * 0), or has room for its bytes and the NUL after them (len < cap). */
static bool buf_valid(const dp_buf_t *b)
{
    return b->base ? b->len < b->cap : b->cap == 0 && b->len == 0;
}
#endif

void dp_buf_reserve(dp_buf_t *b, size_t extra)
{
    assert(buf_valid(b));
    if (extra > SIZE_MAX / 2 - b->len) /* no allocation that large can succeed: and need, */
        oom();                         /* or the doubling below, would wrap around */
    size_t need = b->len + extra + 1;
    if (need <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need)
        cap *= 2;
    b->base = dp_xrealloc(b->base, cap);
    b->cap = cap;
    assert(buf_valid(b) && b->len + extra < b->cap);
}

/* ---- a thread's stash of large buffers ------------------------------------------------------
 * Request bodies of hundreds of KiB come and go at the rate clients send them. Each one
 * allocated afresh is a new mapping (net/server.c fixes glibc's mmap threshold so that freed
 * bodies go back to the kernel): its pages fault in, zeroed, as the body is copied in, and its
 * munmap flushes the TLB of every CPU the process runs on. Released ones kept per thread are
 * reused warm. The stash must absorb the swing between bodies arriving and bodies finished:
 * 64 buffers were too few for 150 clients sending 254 KiB prompts on one worker (every body a
 * fresh mapping again: CPU per request 2.5x). It is bounded (256 buffers, 64 MiB), and it
 * decays: buffers the last DP_BUF_STASH_DECAY_MS never reached for are freed at the next use
 * (or by dp_buf_stash_decay on a timer), so
 * resident memory follows the bodies being held. Under AddressSanitizer a stashed buffer is
 * poisoned: a pointer kept into a released body is caught as it would be after free(). */
#define STASH_SLOTS 256
#define STASH_BYTES (64u << 20)

typedef struct {
    char *base[STASH_SLOTS];
    size_t cap[STASH_SLOTS];
    unsigned n;
    size_t bytes;
    unsigned low;       /* the fewest buffers stashed since window_ms */
    uint64_t window_ms; /* CLOCK_MONOTONIC_COARSE */
} stash_t;

static pthread_key_t g_stash_key;
static pthread_once_t g_stash_once = PTHREAD_ONCE_INIT;

static void stash_destroy(void *v)
{
    stash_t *st = v;
    for (unsigned i = 0; i < st->n; i++) {
        STASH_UNPOISON(st->base[i], st->cap[i]);
        free(st->base[i]);
    }
    free(st);
}

static void stash_key_make(void)
{
    if (pthread_key_create(&g_stash_key, stash_destroy) != 0)
        oom();
}

static stash_t *stash_get(bool make)
{
    pthread_once(&g_stash_once, stash_key_make);
    stash_t *st = pthread_getspecific(g_stash_key);
    if (st == NULL && make) {
        st = dp_xcalloc(1, sizeof(*st));
        if (pthread_setspecific(g_stash_key, st) != 0)
            oom();
    }
    return st;
}

/* Take entry i out, keeping the others oldest first. */
static char *stash_remove(stash_t *st, unsigned i, size_t *cap)
{
    char *base = st->base[i];
    *cap = st->cap[i];
    st->bytes -= *cap;
    st->n--;
    memmove(&st->base[i], &st->base[i + 1], (st->n - i) * sizeof(st->base[0]));
    memmove(&st->cap[i], &st->cap[i + 1], (st->n - i) * sizeof(st->cap[0]));
    STASH_UNPOISON(base, *cap);
    return base;
}

/* Free the buffers that stayed in the stash through a whole window (the oldest: the newest
 * are what the traffic sends now), then start the next window. */
static void stash_decay(stash_t *st)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    uint64_t now = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    if (now - st->window_ms < DP_BUF_STASH_DECAY_MS)
        return;
    for (unsigned idle = st->low; idle > 0 && st->n > 0; idle--) {
        size_t cap;
        free(stash_remove(st, 0, &cap));
    }
    st->low = st->n;
    st->window_ms = now;
}

/* The stashed buffer that fits need best, at most half again as big (a reused buffer's pages
 * are all resident), taken out of the stash; NULL when none fits. */
static char *stash_take(size_t need, size_t *cap)
{
    stash_t *st = stash_get(false);
    if (st == NULL)
        return NULL;
    stash_decay(st);
    unsigned best = st->n;
    for (unsigned i = 0; i < st->n; i++)
        if (st->cap[i] >= need && st->cap[i] - need <= need / 2 &&
            (best == st->n || st->cap[i] < st->cap[best]))
            best = i;
    if (best == st->n)
        return NULL;
    char *base = stash_remove(st, best, cap);
    if (st->n < st->low)
        st->low = st->n;
    return base;
}

void dp_buf_release(dp_buf_t *b)
{
    assert(buf_valid(b));
    if (b->cap < DP_BUF_STASH_MIN || b->cap > DP_BUF_STASH_MAX) {
        dp_buf_free(b);
        return;
    }
    /* The newest buffers are what the traffic sends now: the oldest make room for them, so a
     * burst of one size cannot leave the stash full of buffers nothing fits any more. */
    stash_t *st = stash_get(true);
    stash_decay(st);
    while (st->n == STASH_SLOTS || st->bytes + b->cap > STASH_BYTES) {
        size_t cap;
        free(stash_remove(st, 0, &cap));
    }
    if (st->n < st->low)
        st->low = st->n;
    STASH_POISON(b->base, b->cap);
    st->base[st->n] = b->base;
    st->cap[st->n] = b->cap;
    st->n++;
    st->bytes += b->cap;
    *b = (dp_buf_t){0};
}

void dp_buf_stash_free(void)
{
    stash_t *st = stash_get(false);
    if (st == NULL)
        return;
    pthread_setspecific(g_stash_key, NULL);
    stash_destroy(st);
}

void dp_buf_stash_decay(void)
{
    stash_t *st = stash_get(false);
    if (st)
        stash_decay(st);
}

size_t dp_buf_stash_bytes(void)
{
    stash_t *st = stash_get(false);
    return st ? st->bytes : 0;
}

void dp_buf_reserve_exact(dp_buf_t *b, size_t extra)
{
    assert(buf_valid(b));
    if (extra > SIZE_MAX / 2 - b->len)
        oom();
    size_t need = b->len + extra + 1;
    if (need <= b->cap)
        return;
    size_t cap;
    char *base = need >= DP_BUF_STASH_MIN ? stash_take(need, &cap) : NULL;
    if (base) {
        if (b->base)
            memcpy(base, b->base, b->len + 1);
        free(b->base);
        b->base = base;
        b->cap = cap;
        return;
    }
    b->base = dp_xrealloc(b->base, need);
    b->cap = need;
}

void dp_buf_append_grow(dp_buf_t *b, const void *p, size_t n)
{
    assert(p != NULL || n == 0);
    dp_buf_reserve(b, n);
    if (n)
        memcpy(b->base + b->len, p, n);
    b->len += n;
    b->base[b->len] = '\0';
}

void dp_buf_appends(dp_buf_t *b, const char *s)
{
    dp_buf_append(b, s, strlen(s));
}

void dp_buf_printf(dp_buf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n <= 0)
        return;
    dp_buf_reserve(b, (size_t)n);
    va_start(ap, fmt);
    vsnprintf(b->base + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* Its digit count first (from its bit length, no division), then two digits a step from the
 * end, written in place: a 10-digit seed is five divisions by 100, not ten by 10 and a copy. */
size_t dp_u64_dec(uint64_t v, char out[21])
{
    static const char pairs[] = "00010203040506070809101112131415161718192021222324252627282930"
                                "31323334353637383940414243444546474849505152535455565758596061"
                                "62636465666768697071727374757677787980818283848586878889909192"
                                "93949596979899";
    /* clang-format off */
    static const uint64_t pow10[20] = {
        1ull, 10ull, 100ull, 1000ull, 10000ull, 100000ull, 1000000ull, 10000000ull, 100000000ull,
        1000000000ull, 10000000000ull, 100000000000ull, 1000000000000ull, 10000000000000ull,
        100000000000000ull, 1000000000000000ull, 10000000000000000ull, 100000000000000000ull,
        1000000000000000000ull, 10000000000000000000ull};
    /* clang-format on */
    /* floor(log10(w)) is t or t - 1, where t = floor((bits of w) * log10(2)) (1233 / 4096);
     * w = v | 1 has the same digits as v and is never 0 */
    uint64_t w = v | 1;
    unsigned t = (unsigned)(64 - __builtin_clzll(w)) * 1233 >> 12;
    size_t n = t + 1 - (w < pow10[t]);
    char *o = out + n;
    *o = '\0';
    while (v >= 100) {
        o -= 2;
        memcpy(o, pairs + 2 * (v % 100), 2);
        v /= 100;
    }
    if (v >= 10) {
        memcpy(o - 2, pairs + 2 * v, 2);
    } else {
        o[-1] = (char)('0' + v);
    }
    return n;
}

void dp_buf_append_u64(dp_buf_t *b, uint64_t v)
{
    char tmp[21];
    dp_buf_append(b, tmp, dp_u64_dec(v, tmp));
}

void dp_buf_consume(dp_buf_t *b, size_t n)
{
    assert(buf_valid(b));
    if (n >= b->len) {
        b->len = 0;
    } else {
        memmove(b->base, b->base + n, b->len - n);
        b->len -= n;
    }
    if (b->base)
        b->base[b->len] = '\0';
}

void dp_buf_reset(dp_buf_t *b)
{
    assert(buf_valid(b));
    b->len = 0;
    if (b->base)
        b->base[0] = '\0';
}

void dp_buf_free(dp_buf_t *b)
{
    free(b->base);
    b->base = NULL;
    b->len = b->cap = 0;
}

char *dp_buf_steal(dp_buf_t *b)
{
    char *p = b->base;
    if (p == NULL)
        p = dp_xstrdup("");
    b->base = NULL;
    b->len = b->cap = 0;
    return p;
}
