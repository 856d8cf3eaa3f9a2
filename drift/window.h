/* Private to drift/: the sliding window of comparison records that the drift statistics
 * (drift.c) and the rollout statistics (rollout.c) both keep, and their reason lines. Not part of
 * the module's contract; drift.h and rollout.h are.
 *
 * A window is a ring of DRIFT_WINDOW small records with running counts, allocated on its first
 * sample (12 KB). Running sums are recounted from the ring every time it wraps, which also
 * clears float error from the add/subtract pairs. */
#ifndef DP_DRIFT_WINDOW_H
#define DP_DRIFT_WINDOW_H

#include <stdbool.h>
#include <stdint.h>

#include "drift/drift.h"

#define DRIFT_REC_NO_PAIR UINT16_MAX

typedef struct {
    float similarity;
    int32_t offset; /* -1 when matched; clamped to INT32_MAX */
    uint16_t pair;  /* drift.c's pair slot, or DRIFT_REC_NO_PAIR */
    uint8_t match;
} drift_rec_t;

typedef struct {
    drift_rec_t *ring; /* DRIFT_WINDOW records, or NULL before the first sample */
    uint32_t head;
    uint32_t count;
    uint32_t diverged;
    double sim_sum;
    uint64_t total;
    uint64_t total_match;
} drift_win_t;

/* The record of one comparison result (pair DRIFT_REC_NO_PAIR). */
drift_rec_t drift_win_rec_of(const drift_result_t *r);
void drift_win_push(drift_win_t *w, drift_rec_t r);
/* Empty the window, keeping lifetime totals. */
void drift_win_clear(drift_win_t *w);
/* Release the ring; the window is zeroed. */
void drift_win_free(drift_win_t *w);
/* Keep only records whose pair is not marked in drop[], preserving their order. */
void drift_win_filter(drift_win_t *w, const bool *drop);
/* Samples, rates, mean similarity, lower median divergence offset, lifetime totals. */
void drift_win_summary(const drift_win_t *w, drift_summary_t *s);

/* Append a printf-formatted reason to reasons[*n] (DRIFT_REASON_MAX bytes each, truncated),
 * unless DRIFT_MAX_REASONS are there already. */
void drift_win_reason(char (*reasons)[DRIFT_REASON_MAX], int *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* A rate as a percentage for a reason line (0 for NaN). */
double drift_win_pct(double r);

#endif
