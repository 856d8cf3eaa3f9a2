/* Rollout statistics (docs/rollouts.md §3): a candidate pool judged against its baseline pool's own
 * noise. Pure: no libuv, no sockets, no logging (like drift.h, whose comparison results feed it).
 *
 * A candidate sample is one comparable request answered by the baseline (the client's answer)
 * and, as a copy, by the candidate; drift_compare says whether they match. An equivalent
 * candidate behaves like one more baseline replica, so its divergence from the baseline should
 * stay within what the baseline's own shadow samples show: cross pairs (one replica against
 * another) and self pairs (a replica against itself). The verdict compares the candidate's
 * divergence rate with the larger of the two (each counted only with DRIFT_MIN_SAMPLES in its
 * window; with fewer in each but that many together, their pooled rate), with the drift
 * verdict's noise test (drift_rate_exceeds). Rules: docs/rollouts.md.
 *
 * Ownership: a drift_rollout_t owns everything it holds; names and request ids are copied.
 * Not synchronised: one thread (the loop) adds, queries and renders. */
#ifndef DP_DRIFT_ROLLOUT_H
#define DP_DRIFT_ROLLOUT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/jw.h"
#include "drift/drift.h"

#define ROLLOUT_MAX_TENANTS 64 /* tenants tracked apart per candidate; more count overall only */
#define ROLLOUT_EXAMPLES 5     /* diverged request ids kept (the most recent) */
#define ROLLOUT_ID_MAX 40      /* request id bytes kept, NUL included */

typedef enum {
    ROLLOUT_INSUFFICIENT_DATA = 0,
    ROLLOUT_EQUIVALENT,
    ROLLOUT_DIVERGES,
} drift_rollout_kind_t;

/* What became of a candidate copy that produced no sample (detproxy_candidate_total results
 * besides match and diverged). */
typedef enum {
    ROLLOUT_SKIPPED = 0, /* no admitted candidate replica, or too many copies in flight */
    ROLLOUT_ERROR,       /* either side failed or was unreadable */
    ROLLOUT_NOT_COMPARABLE,
    ROLLOUT__NOUTCOMES
} drift_rollout_outcome_t;

const char *drift_rollout_kind_name(drift_rollout_kind_t k); /* "equivalent", ... */

/* Lifetime counts of copies that gave no sample, and why the last of each did. */
typedef struct {
    uint64_t n[ROLLOUT__NOUTCOMES];
    char last[ROLLOUT__NOUTCOMES][160];
} drift_rollout_misses_t;

/* The verdict over one set of candidate samples (overall or one tenant's). */
typedef struct drift_rollout_verdict_s {
    drift_rollout_kind_t kind;
    drift_summary_t candidate; /* the candidate's samples: rates, similarity, median offset */
    double noise_rate;         /* the baseline divergence an equivalent candidate should show */
    uint32_t noise_samples;    /* behind noise_rate; 0 when there is no usable baseline */
    const char *noise_source;  /* "cross", "self", "cross+self" (static); NULL: no baseline */
    double excess;             /* candidate divergence rate - noise_rate (NaN without both) */
    char reasons[DRIFT_MAX_REASONS][DRIFT_REASON_MAX];
    int nreasons;
} drift_rollout_verdict_t;

/* Judge candidate samples against the baseline's cross and self windows (drift_pool_summary of
 * the baseline pool). misses may be NULL; with it, an insufficient_data verdict says what kept
 * copies from becoming samples. Pure function of its arguments. */
void drift_rollout_judge(const drift_summary_t *candidate, const drift_summary_t *cross,
                         const drift_summary_t *self, const drift_rollout_misses_t *misses,
                         drift_rollout_verdict_t *v);

typedef struct drift_rollout drift_rollout_t;

/* Statistics of candidate pool `candidate` against baseline pool `pool` (names copied). */
drift_rollout_t *drift_rollout_new(const char *pool, const char *candidate);
void drift_rollout_free(drift_rollout_t *r); /* NULL is fine */
const char *drift_rollout_pool(const drift_rollout_t *r);
const char *drift_rollout_candidate(const drift_rollout_t *r);

/* One sample: the baseline's answer against the candidate's, for request_id of tenant (NULL
 * or "": overall only). A diverged sample's id joins the examples. */
void drift_rollout_add(drift_rollout_t *r, const char *tenant, const char *request_id,
                       const drift_result_t *res);
/* A copy that gave no sample, and why (copied, truncated; NULL for none). */
void drift_rollout_miss(drift_rollout_t *r, drift_rollout_outcome_t o, const char *why);

/* The samples of tenant (NULL: all), in the window of the last DRIFT_WINDOW; -ENOENT for a
 * tenant never seen. */
int drift_rollout_summary(const drift_rollout_t *r, const char *tenant, drift_summary_t *out);
/* drift_rollout_judge over the samples of tenant (NULL: all); an unknown tenant has none. */
void drift_rollout_verdict(const drift_rollout_t *r, const char *tenant,
                           const drift_summary_t *cross, const drift_summary_t *self,
                           drift_rollout_verdict_t *v);

/* One candidate as a JSON object (key NULL inside an array): pool, candidate, rate, samples,
 * exact_match_rate, mean_similarity, median_divergence_offset, baseline_noise, verdict,
 * excess_divergence, reasons, example_request_ids, copies_without_sample, tenants{...}. */
void drift_rollout_render(dp_jw_t *w, const char *key, const drift_rollout_t *r, double rate,
                          const drift_summary_t *cross, const drift_summary_t *self);

/* ---- pooled statistics (a fleet's instances, docs/fleet.md) ------------------------------ */

/* The candidate's overall window as a JSON array under key (NULL inside an array):
 * [samples, diverged, similarity_sum, median_divergence_offset, skipped, error, not_comparable]
 * (the last three: copies without a sample, lifetime counts). What a fleet member publishes. */
void drift_rollout_export(const drift_rollout_t *r, dp_jw_t *w, const char *key);
/* Add one exported array to r's overall samples, re-created as drift_pool_import does (matches
 * at similarity 1, the diverged ones spread evenly at the median offset, sharing the rest of the
 * similarity sum), and its copy counts to r's. 0, or -EINVAL for a malformed array (r
 * unchanged). Tenants are not pooled. */
struct cJSON;
int drift_rollout_import(drift_rollout_t *r, const struct cJSON *a);

#endif
