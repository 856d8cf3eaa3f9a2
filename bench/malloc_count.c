/* LD_PRELOAD allocation counter for bench/profile.sh: counts malloc, calloc, realloc,
 * posix_memalign/aligned_alloc and free calls (and bytes asked for) in the process it is loaded
 * into, and rewrites $MALLOC_COUNT_FILE with the totals every 100 ms from a helper thread, so a
 * script can read the counters before and after a load run and divide by requests served.
 *
 * Build: cc -O2 -shared -fPIC bench/malloc_count.c -o malloc_count.so -ldl -lpthread
 *
 * Allocation calls made while dlsym resolves the real functions (glibc's dlsym may calloc) are
 * served from a small static arena. Counters are relaxed atomics: exact totals, no ordering. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static void *(*real_malloc)(size_t);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static void (*real_free)(void *);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);

static _Atomic uint64_t n_malloc, n_calloc, n_realloc, n_free, n_memalign, bytes;

static char boot[8192];
static size_t boot_used;
static int resolving;

static void *boot_alloc(size_t n)
{
    n = (n + 15) & ~(size_t)15;
    if (boot_used + n > sizeof(boot))
        return NULL;
    void *p = boot + boot_used;
    boot_used += n;
    return p;
}

static int in_boot(void *p)
{
    return (char *)p >= boot && (char *)p < boot + sizeof(boot);
}

static void resolve(void)
{
    if (real_malloc || resolving)
        return;
    resolving = 1;
    real_malloc = dlsym(RTLD_NEXT, "malloc");
    real_calloc = dlsym(RTLD_NEXT, "calloc");
    real_realloc = dlsym(RTLD_NEXT, "realloc");
    real_free = dlsym(RTLD_NEXT, "free");
    real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
    real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
    resolving = 0;
}

void *malloc(size_t n)
{
    resolve();
    if (real_malloc == NULL)
        return boot_alloc(n);
    atomic_fetch_add_explicit(&n_malloc, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&bytes, n, memory_order_relaxed);
    return real_malloc(n);
}

void *calloc(size_t a, size_t b)
{
    resolve();
    if (real_calloc == NULL) {
        void *p = boot_alloc(a * b);
        if (p)
            memset(p, 0, a * b);
        return p;
    }
    atomic_fetch_add_explicit(&n_calloc, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&bytes, a * b, memory_order_relaxed);
    return real_calloc(a, b);
}

void *realloc(void *p, size_t n)
{
    resolve();
    if (in_boot(p)) {
        void *q = malloc(n);
        if (q)
            memcpy(q, p, n); /* boot blocks are only ever small; over-read stays in boot[] */
        return q;
    }
    atomic_fetch_add_explicit(&n_realloc, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&bytes, n, memory_order_relaxed);
    return real_realloc(p, n);
}

void free(void *p)
{
    if (p == NULL || in_boot(p))
        return;
    resolve();
    atomic_fetch_add_explicit(&n_free, 1, memory_order_relaxed);
    real_free(p);
}

int posix_memalign(void **out, size_t al, size_t n)
{
    resolve();
    atomic_fetch_add_explicit(&n_memalign, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&bytes, n, memory_order_relaxed);
    return real_posix_memalign(out, al, n);
}

void *aligned_alloc(size_t al, size_t n)
{
    resolve();
    atomic_fetch_add_explicit(&n_memalign, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&bytes, n, memory_order_relaxed);
    return real_aligned_alloc(al, n);
}

static void *reporter(void *arg)
{
    const char *path = arg;
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    /* open/write, not stdio: the reporter must not allocate (it would count itself). */
    for (;;) {
        char line[512];
        int n = snprintf(line, sizeof(line),
                         "malloc %llu\ncalloc %llu\nrealloc %llu\nmemalign %llu\nfree %llu\n"
                         "bytes %llu\n",
                         (unsigned long long)n_malloc, (unsigned long long)n_calloc,
                         (unsigned long long)n_realloc, (unsigned long long)n_memalign,
                         (unsigned long long)n_free, (unsigned long long)bytes);
        int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
            if (write(fd, line, (size_t)n) == n)
                rename(tmp, path);
            close(fd);
        }
        usleep(100000);
    }
    return NULL;
}

__attribute__((constructor)) static void start(void)
{
    resolve();
    const char *path = getenv("MALLOC_COUNT_FILE");
    if (path == NULL)
        return;
    pthread_t t;
    pthread_attr_t a;
    pthread_attr_init(&a);
    pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
    pthread_create(&t, &a, reporter, strdup(path));
}
