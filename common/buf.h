/* Growable byte buffers and slices: the two data shapes every module shares. */
#ifndef DP_BUF_H
#define DP_BUF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* A borrowed view of bytes; never owns them. */
typedef struct {
    const char *base;
    size_t len;
} dp_iovec_t;

#define DP_IOV(s) ((dp_iovec_t){(s), sizeof(s) - 1})

/* An owned, growable buffer. Zero-initialise to get an empty one; dp_buf_free releases it.
 * `base` is always NUL-terminated when non-NULL so it can be handed to string functions, but
 * `len` never counts that byte. Allocation failure aborts: the process cannot do anything
 * useful once malloc fails, and every caller would otherwise grow an untestable error path. */
typedef struct {
    char *base;
    size_t len;
    size_t cap;
} dp_buf_t;

void dp_buf_reserve(dp_buf_t *b, size_t extra);
/* As dp_buf_reserve, but when it must grow it grows to exactly len + extra (and the NUL): for
 * a buffer whose final size is known, one allocation and no copy as it fills. A large one is
 * taken from this thread's stash of released buffers when one fits (dp_buf_release). */
void dp_buf_reserve_exact(dp_buf_t *b, size_t extra);
/* Buffers of this capacity and up to DP_BUF_STASH_MAX are kept by dp_buf_release: what a
 * dp_buf_reserve_exact of up to 1 MiB can take (a kept buffer serves a need it exceeds by at
 * most half). */
#define DP_BUF_STASH_MIN (64 * 1024)
#define DP_BUF_STASH_MAX (1536 * 1024 + 2)
/* Free b's memory, or keep it for reuse by this thread's next dp_buf_reserve_exact when its
 * capacity is in [DP_BUF_STASH_MIN, DP_BUF_STASH_MAX] (a request body of hundreds of KiB).
 * The thread keeps at most 256 buffers and 64 MiB, the newest: resident memory outside any
 * budget. Leaves b empty. The stash is freed when the thread exits, or by dp_buf_stash_free. */
void dp_buf_release(dp_buf_t *b);
void dp_buf_stash_free(void);
/* Free the stashed buffers that the last window (DP_BUF_STASH_DECAY_MS) never reached for,
 * as each use of the stash does: a thread that may stop taking large bodies calls it on a
 * timer, so that after a burst its stash falls back within two windows. */
#define DP_BUF_STASH_DECAY_MS 2000
void dp_buf_stash_decay(void);
/* Bytes this thread's stash holds now. */
size_t dp_buf_stash_bytes(void);
/* dp_buf_append and dp_buf_appendc when b must grow first. */
void dp_buf_append_grow(dp_buf_t *b, const void *p, size_t n);
/* Inline: heads, JSON and log lines are built from many short pieces, and a piece that fits
 * (nearly every one) is then a bounds test and a copy the compiler sees the length of. */
static inline void dp_buf_append(dp_buf_t *b, const void *p, size_t n)
{
    if (n >= b->cap - b->len) { /* no room for n bytes and the NUL (cap 0: always) */
        dp_buf_append_grow(b, p, n);
        return;
    }
    if (n)
        memcpy(b->base + b->len, p, n);
    b->len += n;
    b->base[b->len] = '\0';
}
static inline void dp_buf_appendc(dp_buf_t *b, char c)
{
    dp_buf_append(b, &c, 1);
}
void dp_buf_appends(dp_buf_t *b, const char *s);
void dp_buf_printf(dp_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* v in decimal into out, NUL-terminated (at most 20 digits); its length. */
size_t dp_u64_dec(uint64_t v, char out[21]);
void dp_buf_append_u64(dp_buf_t *b, uint64_t v);
/* Drop the first n bytes, keeping the rest (used for partially consumed input). */
void dp_buf_consume(dp_buf_t *b, size_t n);
void dp_buf_reset(dp_buf_t *b);
void dp_buf_free(dp_buf_t *b);
/* Hand the bytes to the caller (who must free()) and leave b empty. */
char *dp_buf_steal(dp_buf_t *b);

void *dp_xmalloc(size_t n);
void *dp_xcalloc(size_t n, size_t m);
void *dp_xrealloc(void *p, size_t n);
char *dp_xstrdup(const char *s);
char *dp_xstrndup(const char *s, size_t n);

#endif
