/* Drift: the pure half of shadow comparison (docs/drift.md). No libuv, no sockets, no logging.
 *
 * Four parts, in the order a shadow sample goes through them:
 *   1. extraction: the output text and finish_reason(s) of a response body, either whole
 *      (drift_extract_json) or fed incrementally as SSE bytes arrive (drift_sse_*);
 *   2. comparison of two outputs (drift_compare): match, divergence offset, word similarity;
 *   3. statistics per pool (drift_pool_*): sliding windows per kind and per replica pair, the
 *      verdict, suspect naming and the quarantine queries;
 *   4. rendering for GET /admin/drift and the divergence log record.
 *
 * Ownership and threads:
 *   - drift_output_t owns its buffers; release with drift_output_free (safe on a zeroed one).
 *   - drift_sse_t is zero-initialised by the caller and owns what it buffers; drift_sse_free
 *     releases it at any point and is a no-op after drift_sse_finish.
 *   - Input bytes are only borrowed for the duration of a call; nothing here keeps a pointer
 *     into a caller's read buffer.
 *   - drift_compare, drift_word_distance and drift_divlog_fill touch only their arguments and
 *     the heap: call them from uv_queue_work threads freely. drift_extract_json and drift_sse_*
 *     use cJSON, whose parser writes a process-wide error slot on every call, so run them on the
 *     loop thread (where the response bytes arrive anyway).
 *   - A drift_pool_t is not synchronised: one thread (the loop) adds samples, queries and
 *     renders it. Feed results back from the worker's after_work callback.
 *
 * Errors: functions that can fail return 0 or a negative errno-style code; the incremental SSE
 * parser follows picohttpparser (bytes consumed when complete, -2 need more, -1 error).
 * Allocation failure aborts (common/buf.h). */
#ifndef DP_DRIFT_H
#define DP_DRIFT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/buf.h"
#include "common/jw.h"

/* ---- limits and thresholds (see docs/drift.md for why these values) ---------------------- */

#define DRIFT_DEFAULT_MAX_OUTPUT 1048576 /* shadow.max_output_bytes default */
#define DRIFT_MAX_CHOICES 128            /* choices[].index beyond this is an error */
#define DRIFT_SSE_EVENT_SLACK 65536      /* one SSE event may be max_output + this long */
#define DRIFT_MAX_WORDS 4096 /* words per side given to the exact Levenshtein (after trimming) */

#define DRIFT_WINDOW 1000          /* samples kept per window (pool/kind, pair, replica) */
#define DRIFT_MAX_REPLICAS 64      /* replicas tracked per pool; more still count pool-wide */
#define DRIFT_NAME_MAX 128         /* replica names, including the NUL */
#define DRIFT_MIN_SAMPLES 30       /* cross (and self, for a baseline) before any verdict */
#define DRIFT_MIN_PAIR_SAMPLES 10  /* per aggregate used to name a suspect */
#define DRIFT_MARGIN_ABS 0.10      /* cross rate - baseline rate must reach this ... */
#define DRIFT_MARGIN_REL 2.0       /* ... and cross rate >= this x baseline rate ... */
#define DRIFT_MARGIN_Z 3.0         /* ... and the difference >= this many standard errors */
#define DRIFT_SELF_NOISE_RATE 0.02 /* self divergence rate that means batching noise ... */
#define DRIFT_SELF_NOISE_MIN 3     /* ... with at least this many diverged self samples */
#define DRIFT_RECOVERY_SAMPLES 50  /* recent cross samples a quarantined replica is judged on */
#define DRIFT_RECOVERY_MARGIN 0.05 /* recovered when recent rate <= baseline + this */
#define DRIFT_ONSET_SAMPLES 30     /* a change's doing diverges in this many samples after it */

/* ---- 1. extraction ------------------------------------------------------------------------ */

/* One side's output: choices' text concatenated in index order, and their finish_reasons in
 * index order joined with ',' ("stop", "stop,length"; empty when none was given). */
typedef struct {
    dp_buf_t text;
    dp_buf_t finish;
    bool truncated; /* text was capped at max_output_bytes, or an oversized event was skipped */
    bool done;      /* SSE only: `data: [DONE]` was seen */
} drift_output_t;

void drift_output_free(drift_output_t *o);

/* A whole (non-streamed) completions or chat completions response body. Takes
 * choices[i].text, else choices[i].message.content; non-string content counts as empty.
 * max_output_bytes 0 means DRIFT_DEFAULT_MAX_OUTPUT. Returns 0, or -EINVAL when the body is not
 * a JSON object with a "choices" array, carries an "error" object, or an index is out of range.
 * out must be zeroed or freed; on error it is left empty. */
int drift_extract_json(const char *body, size_t len, size_t max_output_bytes, drift_output_t *out);

struct drift_choice; /* private */

/* Private: per-choice text and finish reasons, shared by both extractors. */
typedef struct {
    struct drift_choice *v; /* indexed by choices[].index */
    uint32_t n;
    size_t captured; /* text bytes kept across choices */
    size_t cap;
    bool truncated;
} drift_acc_t;

/* Incremental extractor over a streamed response body (after HTTP de-chunking). Zero it, set
 * max_output_bytes (0: default), feed bytes as they arrive in any split. Memory is bounded by
 * max_output_bytes for captured text plus one event of at most max_output_bytes +
 * DRIFT_SSE_EVENT_SLACK; a longer event is skipped and marks the output truncated. */
typedef struct {
    size_t max_output_bytes;
    /* private below */
    dp_buf_t line; /* the current line, unterminated */
    dp_buf_t data; /* the current event's data lines, each followed by '\n' */
    drift_acc_t acc;
    size_t line_bytes; /* bytes of the current line, including skipped ones */
    bool cr_seen;      /* the last byte was a CR: a following LF belongs to it */
    bool skipping;     /* the current event outgrew its cap: drop until the blank line */
    bool done;
    bool failed;
} drift_sse_t;

/* Feed n bytes. Returns the number of bytes consumed up to and including the end of the
 * `data: [DONE]` event once it is seen (later bytes are ignored: later calls return 0, or 1 for
 * the LF of a CRLF that the read boundary split from the event), -2 when all bytes were consumed
 * and more are needed, -1 on a malformed event or an "error" event (sticky: later calls return
 * -1 too). The caller keeps forwarding its bytes unchanged whatever this returns; the return
 * value only tells the shadow what became of the capture. */
long drift_sse_feed(drift_sse_t *st, const char *p, size_t n);

/* End of stream: dispatch a final event left without its blank line, then move the result into
 * out (zeroed or freed) and release st. Returns 0, or -1 when the stream failed (out empty).
 * A stream that ended without [DONE] is not an error: out->done tells. */
int drift_sse_finish(drift_sse_t *st, drift_output_t *out);

/* Release st whatever state it is in; safe to call twice and after drift_sse_finish. */
void drift_sse_free(drift_sse_t *st);

/* ---- 2. comparison ------------------------------------------------------------------------ */

typedef struct {
    bool match;                /* bytes equal */
    int64_t divergence_offset; /* first differing byte; -1 when equal; the shorter length when
                                  one is a prefix of the other */
    double similarity;         /* 1 - word Levenshtein distance / max word count; 1.0 if both
                                  are empty */
    bool finish_differs;
    bool length_differs;
    bool truncated;    /* either side was capped: the comparison covers what was captured */
    bool words_capped; /* the exact distance was bounded (see drift_word_distance) */
    size_t len_a, len_b;
    size_t words_a, words_b;
    size_t word_distance;
} drift_result_t;

/* Word-level Levenshtein distance; words are maximal runs of non-ASCII-whitespace bytes
 * (space, \t, \n, \v, \f, \r) compared bytewise. The common prefix and suffix of words are
 * trimmed first (exact). When more than max_words words per side remain (0, or more than
 * UINT32_MAX / 2, means DRIFT_MAX_WORDS), the distance over the first max_words of each
 * remainder is exact and each word beyond counts as an edit: an upper bound, and *capped (may be
 * NULL) is set. Time O(words + max_words^2), memory O(max_words). Word counts go to *na and *nb
 * (may be NULL). */
size_t drift_word_distance(const char *a, size_t alen, const char *b, size_t blen, size_t max_words,
                           size_t *na, size_t *nb, bool *capped);

/* Compare raw bytes: fills everything except finish_differs and truncated. */
void drift_compare_bytes(const char *a, size_t alen, const char *b, size_t blen, drift_result_t *r);
/* Compare two extracted outputs (a = the primary, b = the shadow). */
void drift_compare(const drift_output_t *a, const drift_output_t *b, drift_result_t *r);

/* The value for detproxy_shadow_similarity{pool,kind}; the metrics code buckets it. */
double drift_sample_similarity(const drift_result_t *r);

/* ---- 3. statistics and verdict ------------------------------------------------------------ */

typedef enum { DRIFT_CROSS = 0, DRIFT_SELF = 1 } drift_kind_t;

typedef enum {
    DRIFT_INSUFFICIENT_DATA = 0,
    DRIFT_CONSISTENT,
    DRIFT_BATCHING_NONDETERMINISM,
    DRIFT_CROSS_REPLICA_DRIFT,
} drift_verdict_kind_t;

const char *drift_kind_name(drift_kind_t k);            /* "cross", "self" */
const char *drift_verdict_name(drift_verdict_kind_t v); /* "consistent", ... (docs/drift.md §4) */

typedef struct drift_pool drift_pool_t;

/* A pool's drift state. name is copied. Free with drift_pool_free (NULL is fine). */
drift_pool_t *drift_pool_new(const char *name);
void drift_pool_free(drift_pool_t *p);
const char *drift_pool_name(const drift_pool_t *p);

/* Record one sample: the primary ran on replica_a, the shadow on replica_b; equal names make it
 * a self sample. Names are copied. Returns 0, or -EINVAL for an empty name or one of
 * DRIFT_NAME_MAX bytes or more. When the pool already tracks DRIFT_MAX_REPLICAS replicas, a
 * sample involving a new one still counts in the pool-wide window but in no pair. */
int drift_pool_add(drift_pool_t *p, const char *replica_a, const char *replica_b,
                   const drift_result_t *r);

/* Window and lifetime numbers of one aggregate. Rates are NaN when samples is 0;
 * median_divergence_offset is -1 when no windowed sample diverged. */
typedef struct {
    uint32_t samples;  /* in the window */
    uint32_t diverged; /* samples - exact matches, in the window */
    double exact_match_rate;
    double divergence_rate;
    double mean_similarity;
    int64_t median_divergence_offset; /* lower median over diverged windowed samples */
    uint64_t total_samples;           /* lifetime */
    uint64_t total_matches;
} drift_summary_t;

void drift_pool_summary(const drift_pool_t *p, drift_kind_t kind, drift_summary_t *out);
/* The pair (a, b) in either order; a == b is that replica's self pair. -ENOENT if unknown. */
int drift_pool_pair_summary(const drift_pool_t *p, const char *a, const char *b,
                            drift_summary_t *out);

/* Does divergence rate a (over na samples) exceed rate b (over nb) beyond noise? Both margins
 * (DRIFT_MARGIN_ABS, DRIFT_MARGIN_REL) and a DRIFT_MARGIN_Z z-test must hold; false when either
 * count is 0. The one noise test of the module: the drift verdict and the rollout verdict
 * (rollout.h) both use it. */
bool drift_rate_exceeds(double a, uint32_t na, double b, uint32_t nb);

#define DRIFT_MAX_REASONS 4
#define DRIFT_REASON_MAX 360

/* What the control plane knows about a replica besides shadow samples. With two replicas the
 * samples cannot say which side drifted (each pair involves both); these can. */
typedef enum {
    DRIFT_CANARY_UNKNOWN = 0, /* no canary configured, or no completed check yet */
    DRIFT_CANARY_PASS,        /* the last completed canary check matched */
    DRIFT_CANARY_FAIL,        /* it did not */
} drift_canary_t;

typedef struct {
    drift_canary_t canary;
    char fingerprint[20]; /* the accepted identity it was admitted as; "" unknown */
    bool accept_identity; /* that identity is a manifest "accept" entry (a rollout's new one) */
    uint64_t identity_changed_ms; /* wall ms its attested identity last changed; 0 never */
} drift_hint_t;

/* Replace what is known about a replica the pool tracks (ignored for an untracked name: it has
 * no samples to explain). Call before a verdict; reset, a change and forget clear it. A hint
 * whose identity_changed_ms is later than the one the previous hint carried is a change of the
 * replica's history: drift_pool_replica_changed(p, replica, "attested identity changed", that
 * time) runs first, and true is returned. */
bool drift_pool_set_hint(drift_pool_t *p, const char *replica, const drift_hint_t *h);

/* A replica's history changed: it was re-admitted (back to admitted after being out: restarted,
 * unreachable, rejected or quarantined) or its attested identity changed. Verdicts follow the
 * present: every window it is in starts again (its cross pairs and its self pair, its recent
 * ring, its samples in the pool-wide windows; lifetime totals stay), and the change is
 * remembered for naming one of two replicas (docs/drift.md §5, "History"). `what` says what
 * happened, for the reasons ("re-admitted from unreachable"; copied, truncated to
 * DRIFT_CHANGE_MAX); at_ms is when (wall ms). Ignored for an untracked replica: it has no
 * samples yet. */
#define DRIFT_CHANGE_MAX 48
void drift_pool_replica_changed(drift_pool_t *p, const char *replica, const char *what,
                                uint64_t at_ms);

typedef struct {
    drift_verdict_kind_t kind;
    bool has_suspect;             /* only with DRIFT_CROSS_REPLICA_DRIFT */
    char suspect[DRIFT_NAME_MAX]; /* "" when undetermined */
    char reasons[DRIFT_MAX_REASONS][DRIFT_REASON_MAX];
    int nreasons;
} drift_verdict_t;

/* Verdict over the current windows and hints (rules in docs/drift.md). With two replicas the
 * suspect is named, in this order: the only one failing the canary; the only one on a rollout's
 * accept identity when their fingerprints differ; the one whose change (drift_pool_replica_changed)
 * started their pair's window, when the pair agreed before it and the window's first
 * DRIFT_ONSET_SAMPLES samples already diverge DRIFT_MARGIN_ABS beyond their self noise; the one
 * whose self pairs diverge beyond the other's (both with DRIFT_MIN_PAIR_SAMPLES). Else a reason
 * says which of these was missing. One pass over the pair slots (DRIFT_MAX_REPLICAS^2 / 2):
 * microseconds, cheap enough to call after every sample. */
void drift_pool_verdict(const drift_pool_t *p, drift_verdict_t *v);

/* Quarantine loop (shadow.quarantine, docs/drift.md §6). is_suspect: the verdict is
 * cross_replica_drift and names this replica. recovered: the replica's last DRIFT_RECOVERY_SAMPLES
 * cross samples diverge at most DRIFT_RECOVERY_MARGIN above the self baseline (false with fewer
 * samples). A quarantined replica must keep getting cross shadows for recovery to be observable. */
bool drift_pool_is_suspect(const drift_pool_t *p, const char *replica);
bool drift_pool_replica_recovered(const drift_pool_t *p, const char *replica);

/* Drop the windowed evidence involving a replica (its pairs, its recent samples, and its
 * samples in the pool-wide windows), keeping lifetime totals, without recording a change (a
 * history change does this and more: drift_pool_replica_changed). forget also releases the
 * replica's slot (a replica gone from the pool, e.g. by discovery). clear forgets every sample,
 * total, change and hint of the pool, as if it had just been made (POST /admin/drift/reset). */
void drift_pool_reset_replica(drift_pool_t *p, const char *replica);
void drift_pool_forget_replica(drift_pool_t *p, const char *replica);
void drift_pool_clear(drift_pool_t *p);

/* ---- 4. rendering -------------------------------------------------------------------------- */

/* One pool as a JSON object (key NULL inside an array):
 * {"cross":{...},"self":{...},"pairs":[...],"replicas":{...},"verdict","suspect","reasons"}.
 * Computes the verdict. */
void drift_render_pool(dp_jw_t *w, const char *key, const drift_pool_t *p);
/* The whole GET /admin/drift body: {"window":1000,"pools":{"<name>":{...},...}}. */
void drift_render(dp_buf_t *out, const drift_pool_t *const *pools, size_t n);

/* ---- 5. pooled statistics (a fleet's instances, docs/fleet.md) --------------------------- */

/* The pool's window aggregates as a JSON array under key (NULL inside an array): one
 * [a, b, samples, diverged, similarity_sum, median_divergence_offset] per pair with samples
 * (a == b: a self pair). What a fleet member publishes. */
void drift_pool_export(const drift_pool_t *p, dp_jw_t *w, const char *key);
/* Add one exported array to p, each pair's samples as that many samples (matches at similarity
 * 1, the diverged ones spread evenly, at the median offset, sharing the rest of the similarity
 * sum): summing every member's export into a fresh pool gives the fleet's windows, and
 * drift_pool_verdict the fleet's verdict. 0, or -EINVAL for a malformed array (what was added
 * before it stays). */
struct cJSON;
int drift_pool_import(drift_pool_t *p, const struct cJSON *pairs);
/* What src knows about its replicas besides samples (drift_pool_set_hint), for dst's tracked
 * ones. */
void drift_pool_copy_hints(drift_pool_t *dst, const drift_pool_t *src);

/* A divergence log line's fields. The strings are borrowed from the caller and must outlive the
 * record; the outputs themselves are only hashed, never kept or logged. */
typedef struct {
    const char *request_id;
    const char *pool;
    const char *replica_a;
    const char *replica_b;
    drift_kind_t kind;
    int64_t divergence_offset;
    double similarity;
    bool finish_differs;
    size_t len_a, len_b;
    char sha256_a[65]; /* lowercase hex of each side's extracted text */
    char sha256_b[65];
    bool candidate; /* a candidate pool's copy (docs/rollouts.md): logged as kind "candidate" */
} drift_divlog_t;

void drift_divlog_fill(drift_divlog_t *rec, const char *request_id, const char *pool,
                       const char *replica_a, const char *replica_b, const drift_result_t *r,
                       const char *a, size_t alen, const char *b, size_t blen);
/* Append the record's fields to an open JSON object (e.g. one from dp_log_begin). */
void drift_divlog_write(const drift_divlog_t *rec, dp_jw_t *w);

#endif
