#include "common/buf.h"

#include <assert.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

void dp_buf_append(dp_buf_t *b, const void *p, size_t n)
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

void dp_buf_appendc(dp_buf_t *b, char c)
{
    dp_buf_reserve(b, 1);
    b->base[b->len++] = c;
    b->base[b->len] = '\0';
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

void dp_buf_append_u64(dp_buf_t *b, uint64_t v)
{
    char tmp[24];
    char *p = tmp + sizeof(tmp);
    do {
        *--p = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    dp_buf_append(b, p, (size_t)(tmp + sizeof(tmp) - p));
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
