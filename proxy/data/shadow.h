/* Shadow sampling (docs/drift.md): copies of comparable requests to a second replica ("cross") or
 * the same one ("self"), compared off the loop to tell drift from batching noise. */
#ifndef PX_SHADOW_H
#define PX_SHADOW_H

#include "policy/policy.h"
#include "proxy/core/px.h"

/* Decide whether to shadow this request (after it was dispatched to `primary`) and to copy it
 * to the pool's candidates (docs/rollouts.md), and start the copies. Returns one handle to feed the
 * primary's output to, whatever the number of copies, or NULL when there is none. */
void *px_shadow_maybe(px_t *px, px_pool_t *pool, px_replica_t *primary, const cfg_tenant_t *t,
                      const policy_result_t *res, const net_req_t *req, const char *body,
                      size_t len);
/* The primary response's body bytes, as forwarded. */
void px_shadow_primary_bytes(void *s, const char *p, size_t n);
/* The primary is over (status 499: the client left; anything but 200 discards the sample). */
void px_shadow_primary_done(void *s, int status);

/* Make the shadow state (at start, before the workers run). */
void px_shadow_init(px_t *px);
/* Forget a replica's drift evidence (it left the pool: DNS discovery). */
void px_shadow_forget_replica(px_t *px, const char *pool, const char *replica);
/* Shutdown: cancel shadow exchanges in flight (their samples are dropped). */
void px_shadow_stop(px_t *px);
/* Free the drift statistics (after the loop has ended). */
void px_shadow_free(px_t *px);

/* detproxy_shadow_similarity buckets. */
extern const double px_shadow_similarity_bounds[];
extern const size_t px_shadow_similarity_nbounds;

/* The drift statistics of the pool named `pool` (created empty on first use), with the hints
 * refreshed from what attestation published (the status page and the verdict gauge judge now). */
struct drift_pool;
const struct drift_pool *px_shadow_drift_pool(px_t *px, const char *pool);
/* GET /admin/drift (docs/drift.md). */
void px_shadow_drift_json(px_t *px, dp_buf_t *out);
/* POST /admin/drift/reset[?pool=P] (docs/drift.md §7): every pool's drift statistics start over
 * (only the pool named only[0..only_len) when only is not NULL); out gets {"reset":[names]}.
 * Returns 0, or -ENOENT when the current configuration has no such pool. */
int px_shadow_drift_reset(px_t *px, const char *only, size_t only_len, dp_buf_t *out);
/* A replica's state changed (px->replica_hooks.changed): back in service after being out, it
 * starts every drift window it is in again (docs/drift.md §5, "History"). */
void px_shadow_replica_changed(const px_replica_t *r, px_replica_state_t from);
/* The verdict of candidate `cand` of pool `pool` (status page). */
struct drift_rollout_verdict_s;
void px_shadow_rollout_verdict(px_t *px, const char *pool, const char *cand,
                               struct drift_rollout_verdict_s *v);
/* The rollout statistics of candidate `cand` of pool `pool` (what a fleet member publishes). */
struct drift_rollout;
const struct drift_rollout *px_shadow_rollout_stats(px_t *px, const char *pool, const char *cand);
/* GET /admin/rollouts (docs/rollouts.md): every candidate of every pool (only the pool named
 * only[0..only_len) when only is not NULL), judged against that pool's drift windows. */
void px_shadow_rollouts_json(px_t *px, const char *only, size_t only_len, dp_buf_t *out);

#endif
