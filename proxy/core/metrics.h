/* Prometheus metrics: counters, gauges and histograms keyed by name + label set.
 *
 * Look-ups return stable pointers, so hot paths look a series up once (or per request, a hash
 * probe) and then bump a number. Threads (the control thread, every worker): each series has
 * one cell per thread, written only by that thread (relaxed atomic load and store, no
 * read-modify-write, no shared cache line), and a scrape sums the cells. Gauges are set, from
 * any thread, into one shared cell. Look-ups are lock-free (the hash chains are published with
 * release stores); creating, dropping and rendering series take a mutex (cold paths).
 * Label values are escaped at creation; rendering groups series by family with HELP/TYPE. */
#ifndef PX_METRICS_H
#define PX_METRICS_H

#include <stdalign.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

typedef enum { PX_COUNTER, PX_GAUGE, PX_HISTOGRAM } px_metric_type_t;

#define PX_HIST_MAX_BUCKETS 16

/* One thread's share of a series: its own cache line(s). */
typedef struct {
    alignas(64) _Atomic double value; /* counter */
    _Atomic uint64_t count;           /* histogram */
    _Atomic double sum;
    _Atomic uint64_t buckets[PX_HIST_MAX_BUCKETS];
} px_cell_t;

typedef struct px_series_s {
    char *key; /* name{labels} */
    char *name;
    char *labels; /* `a="x",b="y"` (escaped), may be "" */
    px_metric_type_t type;
    _Atomic double gauge; /* px_metrics_set */
    px_cell_t *cells;     /* px_metrics_threads() of them, indexed by px_metrics_thread */
    /* histogram */
    const double *bounds;
    size_t nbounds;
    _Atomic(struct px_series_s *) next; /* hash chain */
    struct px_series_s *retired_next;   /* px_metrics_drop */
} px_series_t;

/* The calling thread's cell index: 0 on the control thread, 1..workers on the workers. */
extern _Thread_local unsigned px_metrics_thread;
/* How many threads keep cells (1 + workers): set once, before any series exists. */
void px_metrics_set_threads(unsigned n);
unsigned px_metrics_threads(void);

/* Declare a family once (help text, type). */
void px_metrics_family(const char *name, px_metric_type_t type, const char *help);
/* Find or create a series. `labels` pairs: k1, v1, k2, v2, ..., NULL. */
px_series_t *px_metrics_get(const char *name, ...) __attribute__((sentinel));
/* The same for a histogram; bounds (kept, not copied) are fixed when the series is created:
 * a name and labels first looked up with px_metrics_get stay a counter. */
px_series_t *px_metrics_hist(const char *name, const double *bounds, size_t nbounds, ...)
    __attribute__((sentinel));
static inline void px_metrics_add(px_series_t *s, double v)
{
    _Atomic double *c = &s->cells[px_metrics_thread].value;
    atomic_store_explicit(c, atomic_load_explicit(c, memory_order_relaxed) + v,
                          memory_order_relaxed);
}
static inline void px_metrics_set(px_series_t *s, double v)
{
    atomic_store_explicit(&s->gauge, v, memory_order_relaxed);
}
/* The value a scrape would show (gauge plus every thread's cell). */
double px_metrics_value(const px_series_t *s);
void px_metrics_observe(px_series_t *s, double v);
/* A histogram's observations in bucket i (not cumulative) and in all, summed over threads. */
uint64_t px_metrics_bucket(const px_series_t *s, size_t i);
uint64_t px_metrics_count(const px_series_t *s);
/* Forget every series (of any family) whose labels begin with k1="v1",k2="v2", e.g. ("pool",
 * "p", "replica", "10.0.0.7:8000"): a replica that is gone for good. They leave the table (and
 * /metrics) at once; their memory is kept until px_metrics_reset, since a lock-free look-up
 * on another thread may be walking past them. Returns how many went. */
size_t px_metrics_drop(const char *k1, const char *v1, const char *k2, const char *v2);
/* Prometheus text exposition format 0.0.4. */
void px_metrics_render(dp_buf_t *out);
/* Drop every series and family (tests, shutdown). */
void px_metrics_reset(void);

/* Latency buckets in seconds shared by duration histograms. */
extern const double px_metrics_latency_bounds[];
extern const size_t px_metrics_latency_nbounds;

/* Declare every family the proxy exports (once, at start, after px_metrics_set_threads). */
void px_metrics_declare(void);

#endif
