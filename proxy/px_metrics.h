/* Prometheus metrics: counters, gauges and histograms keyed by name + label set.
 *
 * Look-ups return stable pointers, so hot paths look a series up once (or per request, a hash
 * probe) and then bump a plain integer. Single-threaded: only the event loop touches them.
 * Label values are escaped at creation; rendering groups series by family with HELP/TYPE. */
#ifndef PX_METRICS_H
#define PX_METRICS_H

#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"

typedef enum { PX_COUNTER, PX_GAUGE, PX_HISTOGRAM } px_metric_type_t;

#define PX_HIST_MAX_BUCKETS 16

typedef struct px_series_s {
    char *key; /* name{labels} */
    char *name;
    char *labels; /* `a="x",b="y"` (escaped), may be "" */
    px_metric_type_t type;
    double value; /* counter / gauge */
    /* histogram */
    const double *bounds;
    size_t nbounds;
    uint64_t buckets[PX_HIST_MAX_BUCKETS];
    uint64_t count;
    double sum;
    struct px_series_s *next; /* hash chain */
} px_series_t;

/* Declare a family once (help text, type). */
void px_metrics_family(const char *name, px_metric_type_t type, const char *help);
/* Find or create a series. `labels` pairs: k1, v1, k2, v2, ..., NULL. */
px_series_t *px_metrics_get(const char *name, ...) __attribute__((sentinel));
px_series_t *px_metrics_hist(const char *name, const double *bounds, size_t nbounds, ...)
    __attribute__((sentinel));
static inline void px_metric_add(px_series_t *s, double v)
{
    s->value += v;
}
static inline void px_metric_set(px_series_t *s, double v)
{
    s->value = v;
}
void px_hist_observe(px_series_t *s, double v);
/* Forget every series (of any family) whose labels begin with k1="v1",k2="v2", e.g. ("pool",
 * "p", "replica", "10.0.0.7:8000"): a replica that is gone for good. Pointers to those series
 * die with them: call only when nothing holds one. Returns how many went. */
size_t px_metrics_drop(const char *k1, const char *v1, const char *k2, const char *v2);
/* Prometheus text exposition format 0.0.4. */
void px_metrics_render(dp_buf_t *out);
/* Drop every series and family (tests, shutdown). */
void px_metrics_reset(void);

/* Latency buckets in seconds shared by duration histograms. */
extern const double px_latency_bounds[];
extern const size_t px_latency_nbounds;

#endif
