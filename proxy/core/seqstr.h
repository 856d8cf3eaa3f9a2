/* A short string one thread writes and others read without a lock: a sequence lock over
 * 64-bit atomic words (the reader retries when a write overlapped its copy). No fences: the
 * words are stored with release and loaded with acquire, so a reader that sees any word of a
 * newer write also sees the sequence number that write made odd (Boehm, "Can seqlocks get
 * along with programming language memory models?", 2012). For what the
 * control thread publishes to the workers a few times a minute at most: a replica's attested
 * fingerprints and the reasons it is out of service. */
#ifndef PX_SEQSTR_H
#define PX_SEQSTR_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* cap bytes, terminator included (a multiple of 8). */
#define PX_SEQSTR(cap)                                                                             \
    struct {                                                                                       \
        atomic_uint seq;                                                                           \
        _Atomic uint64_t w[(cap) / 8];                                                             \
    }

static inline void px_seqstr_set_(atomic_uint *seq, _Atomic uint64_t *w, size_t nw, const char *s)
{
    uint64_t tmp[nw];
    memset(tmp, 0, sizeof(tmp));
    size_t n = s ? strlen(s) : 0;
    if (n > nw * 8 - 1)
        n = nw * 8 - 1;
    if (n)
        memcpy(tmp, s, n);
    unsigned v = atomic_load_explicit(seq, memory_order_relaxed);
    atomic_store_explicit(seq, v + 1, memory_order_relaxed); /* odd: a write is under way */
    for (size_t i = 0; i < nw; i++)
        atomic_store_explicit(&w[i], tmp[i], memory_order_release);
    atomic_store_explicit(seq, v + 2, memory_order_release);
}

static inline void px_seqstr_get_(const atomic_uint *seq, const _Atomic uint64_t *w, size_t nw,
                                  char *out)
{
    uint64_t tmp[nw];
    for (;;) {
        unsigned a = atomic_load_explicit(seq, memory_order_acquire);
        if (a & 1)
            continue;
        for (size_t i = 0; i < nw; i++)
            tmp[i] = atomic_load_explicit(&w[i], memory_order_acquire);
        if (atomic_load_explicit(seq, memory_order_relaxed) == a)
            break;
    }
    memcpy(out, tmp, nw * 8);
    out[nw * 8 - 1] = '\0';
}

#define px_seqstr_set(x, s) px_seqstr_set_(&(x)->seq, (x)->w, sizeof((x)->w) / 8, (s))
/* out has room for the whole capacity. */
#define px_seqstr_get(x, out) px_seqstr_get_(&(x)->seq, (x)->w, sizeof((x)->w) / 8, (out))

#endif
