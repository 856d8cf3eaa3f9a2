/* Sliding windows of comparison records, shared by the drift and rollout statistics
 * (window.h). */
#include "drift/window.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t oldest(const drift_win_t *w)
{
    return (w->head + DRIFT_WINDOW - w->count) % DRIFT_WINDOW;
}

/* Recount the running sums from the ring; also clears float error from add/subtract pairs. */
static void recount(drift_win_t *w)
{
    w->diverged = 0;
    w->sim_sum = 0;
    for (uint32_t k = 0, i = oldest(w); k < w->count; k++, i = (i + 1) % DRIFT_WINDOW) {
        w->diverged += !w->ring[i].match;
        w->sim_sum += w->ring[i].similarity;
    }
}

void drift_win_push(drift_win_t *w, drift_rec_t r)
{
    if (w->ring == NULL)
        w->ring = dp_xcalloc(DRIFT_WINDOW, sizeof(drift_rec_t));
    if (w->count == DRIFT_WINDOW) {
        w->diverged -= !w->ring[w->head].match;
        w->sim_sum -= w->ring[w->head].similarity;
    } else {
        w->count++;
    }
    w->ring[w->head] = r;
    w->head = (w->head + 1) % DRIFT_WINDOW;
    w->diverged += !r.match;
    w->sim_sum += r.similarity;
    w->total++;
    w->total_match += r.match;
    if (w->head == 0)
        recount(w);
}

void drift_win_clear(drift_win_t *w)
{
    w->head = w->count = w->diverged = 0;
    w->sim_sum = 0;
}

void drift_win_free(drift_win_t *w)
{
    free(w->ring);
    memset(w, 0, sizeof(*w));
}

void drift_win_filter(drift_win_t *w, const bool *drop)
{
    if (w->count == 0)
        return;
    drift_rec_t *kept = dp_xmalloc(w->count * sizeof(*kept));
    uint32_t n = 0;
    for (uint32_t k = 0, i = oldest(w); k < w->count; k++, i = (i + 1) % DRIFT_WINDOW)
        if (w->ring[i].pair == DRIFT_REC_NO_PAIR || !drop[w->ring[i].pair])
            kept[n++] = w->ring[i];
    memcpy(w->ring, kept, n * sizeof(*kept));
    free(kept);
    w->count = n;
    w->head = n % DRIFT_WINDOW;
    recount(w);
}

static int cmp_i32(const void *x, const void *y)
{
    int32_t a = *(const int32_t *)x, b = *(const int32_t *)y;
    return (a > b) - (a < b);
}

void drift_win_summary(const drift_win_t *w, drift_summary_t *s)
{
    memset(s, 0, sizeof(*s));
    s->samples = w->count;
    s->diverged = w->diverged;
    s->exact_match_rate = w->count ? (double)(w->count - w->diverged) / w->count : NAN;
    s->divergence_rate = w->count ? (double)w->diverged / w->count : NAN;
    s->mean_similarity = w->count ? w->sim_sum / w->count : NAN;
    s->total_samples = w->total;
    s->total_matches = w->total_match;
    s->median_divergence_offset = -1;
    if (w->diverged == 0)
        return;
    int32_t *v = dp_xmalloc(w->diverged * sizeof(*v));
    uint32_t k = 0;
    for (uint32_t j = 0, i = oldest(w); j < w->count; j++, i = (i + 1) % DRIFT_WINDOW)
        if (!w->ring[i].match)
            v[k++] = w->ring[i].offset;
    qsort(v, k, sizeof(*v), cmp_i32);
    s->median_divergence_offset = v[(k - 1) / 2];
    free(v);
}

drift_rec_t drift_win_rec_of(const drift_result_t *r)
{
    return (drift_rec_t){
        .similarity = (float)r->similarity,
        .offset = r->divergence_offset > INT32_MAX ? INT32_MAX : (int32_t)r->divergence_offset,
        .pair = DRIFT_REC_NO_PAIR,
        .match = r->match,
    };
}

void drift_win_reason(char (*reasons)[DRIFT_REASON_MAX], int *n, const char *fmt, ...)
{
    if (*n >= DRIFT_MAX_REASONS)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reasons[(*n)++], DRIFT_REASON_MAX, fmt, ap);
    va_end(ap);
}

double drift_win_pct(double r)
{
    return isnan(r) ? 0 : 100.0 * r;
}
