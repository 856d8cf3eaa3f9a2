/* Affinity routing (docs/configuration.md "Affinity routing"): rendezvous hashing with bounded
 * loads.
 *
 * Every replica taking part gets a score for a request's key, score = dp_mix64(key ^ id), the
 * key's order is the replicas by descending score: a pure function of the key and the replicas'
 * identities (their names), so every worker thread computes the same order from the same
 * snapshot, and a replica leaving moves only the keys it was first for (they come back when it
 * returns). Bounded loads: a replica whose in-flight count is over load_factor x the mean of
 * those taking part, plus one, is passed over for the next in the order.
 *
 * Pure: no libuv, no globals; unit-tested on its own (tests/unit/test_affinity.c). */
#ifndef PX_AFFINITY_H
#define PX_AFFINITY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What a request's placement was, for x-detproxy-affinity and detproxy_affinity_total. */
typedef enum {
    PX_AFF_NONE = 0, /* not routed by a key */
    PX_AFF_HIT,      /* the first replica of the key's order */
    PX_AFF_SPILL,    /* a later one: the first was over its load bound, full, or failed */
    PX_AFF_FALLBACK, /* the configured key was missing (no session, no seed): prefix used */
    PX_AFF__COUNT
} px_affinity_result_t;

/* "", "hit", "spill", "fallback". */
extern const char *const px_affinity_result_names[PX_AFF__COUNT];

/* A request's routing key, filled by the hooks before routing. */
typedef struct {
    bool has_key;
    bool fallback; /* the key is the prefix standing in for a missing session or seed */
    uint64_t key;
    px_affinity_result_t result; /* set by the router for the latest placement */
} px_affinity_t;

/* 64 bits of SHA-256 over the bytes: keys and replica identities. */
uint64_t px_affinity_hash(const void *p, size_t n);

/* Rendezvous score of replica `id` for `key`. */
uint64_t px_affinity_score(uint64_t key, uint64_t id);

/* The bounded-load rule: is `inflight` over load_factor x (total / n) + 1? */
bool px_affinity_overloaded(uint32_t inflight, uint64_t total, size_t n, double load_factor);

/* One replica as the chooser sees it. `member`: it takes part (admitted), so it is in the key's
 * order and in the mean; `usable`: it may take this request (a member with spare capacity that
 * is not being retried away from). */
typedef struct {
    uint64_t id;
    uint32_t inflight;
    bool member;
    bool usable;
} px_affinity_cand_t;

/* The index of the replica for `key`: the first usable one in the key's order that is not over
 * its load bound, else (every usable one is over it) the first usable one. n when none is
 * usable. *result is PX_AFF_HIT when that is the first member of the order, PX_AFF_SPILL
 * otherwise. */
size_t px_affinity_choose(uint64_t key, const px_affinity_cand_t *c, size_t n, double load_factor,
                          px_affinity_result_t *result);
/* The key's home: the first member in its order, usable or not (n when there is none). */
size_t px_affinity_home(uint64_t key, const px_affinity_cand_t *c, size_t n);

#endif
