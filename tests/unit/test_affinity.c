/* Rendezvous hashing with bounded loads (proxy/core/affinity.h): the key's order is stable and
 * independent of how the pool lists its replicas, a replica leaving moves only its own keys
 * (and they come back), keys spread evenly, and the load bound passes a busy replica over for
 * the next in the key's order. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "proxy/core/affinity.h"

#define NREP 5

static uint64_t id_of(const char *name)
{
    return px_affinity_hash(name, strlen(name));
}

static void pool_of(px_affinity_cand_t *c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        char name[24]; /* "r" and any size_t */
        snprintf(name, sizeof(name), "r%zu", i + 1);
        c[i] = (px_affinity_cand_t){id_of(name), 0, true, true};
    }
}

static uint64_t key_of(unsigned i)
{
    return px_affinity_hash(&i, sizeof(i));
}

/* The chosen replica's identity, for an idle pool (0 when none: never an id in practice).
 * Loops count failures and assert once: Criterion reports every assertion with --full-stats. */
static uint64_t first_for(uint64_t key, const px_affinity_cand_t *c, size_t n)
{
    px_affinity_result_t res;
    size_t k = px_affinity_choose(key, c, n, 1.25, &res);
    return k < n ? c[k].id : 0;
}

Test(affinity_order, stable_and_independent_of_listing_order)
{
    px_affinity_cand_t c[NREP], rev[NREP];
    pool_of(c, NREP);
    for (size_t i = 0; i < NREP; i++)
        rev[i] = c[NREP - 1 - i];
    unsigned bad = 0;
    for (unsigned k = 0; k < 2000; k++) {
        uint64_t a = first_for(key_of(k), c, NREP);
        bad += a == 0 || first_for(key_of(k), c, NREP) != a || first_for(key_of(k), rev, NREP) != a;
    }
    cr_assert_eq(bad, 0);
    /* Known answers pin the functions themselves, so another worker or release orders alike:
     * `printf r1 | sha256sum` starts 82f3e9c695dc6b8d; the score is splitmix64's finaliser of
     * the two XORed, computed independently in Python. */
    cr_assert_eq(px_affinity_hash("r1", 2), 0x82f3e9c695dc6b8dULL);
    cr_assert_eq(px_affinity_score(px_affinity_hash("session-1", 9), px_affinity_hash("r1", 2)),
                 0xd5e98fca82367abeULL);
}

Test(affinity_order, a_leaving_replica_moves_only_its_keys_and_they_come_back)
{
    enum { NKEYS = 20000 };
    static uint64_t before[NKEYS];
    px_affinity_cand_t c[NREP];
    pool_of(c, NREP);
    for (unsigned k = 0; k < NKEYS; k++)
        before[k] = first_for(key_of(k), c, NREP);
    c[2].member = c[2].usable = false; /* r3 leaves (rejected, unreachable, quarantined) */
    size_t moved = 0, wrong = 0, to_gone = 0, back = 0;
    for (unsigned k = 0; k < NKEYS; k++) {
        uint64_t now = first_for(key_of(k), c, NREP);
        to_gone += now == c[2].id;
        if (before[k] == c[2].id)
            moved++;
        else
            wrong += now != before[k]; /* moved though its replica stayed */
    }
    cr_assert_eq(to_gone, 0);
    cr_assert_eq(wrong, 0);
    cr_assert_gt(moved, NKEYS / NREP * 8 / 10);
    c[2].member = c[2].usable = true; /* r3 returns */
    for (unsigned k = 0; k < NKEYS; k++)
        back += first_for(key_of(k), c, NREP) == before[k];
    cr_assert_eq(back, NKEYS, "every key comes back to where it was");
}

Test(affinity_order, keys_spread_evenly)
{
    enum { NKEYS = 100000 };
    px_affinity_cand_t c[NREP];
    pool_of(c, NREP);
    size_t count[NREP] = {0}, hits = 0;
    for (unsigned k = 0; k < NKEYS; k++) {
        px_affinity_result_t res;
        count[px_affinity_choose(key_of(k), c, NREP, 1.25, &res)]++;
        hits += res == PX_AFF_HIT;
    }
    cr_assert_eq(hits, NKEYS);
    /* Binomial sd is ~126 at 20000: 3% is over 4 sd. */
    for (size_t i = 0; i < NREP; i++)
        cr_assert(count[i] > NKEYS / NREP * 97 / 100 && count[i] < NKEYS / NREP * 103 / 100,
                  "replica %zu got %zu of %d", i, count[i], NKEYS);
}

/* The key's order, by taking the first and marking it unusable, over and over. */
static void order_of(uint64_t key, px_affinity_cand_t *c, size_t n, size_t *order)
{
    px_affinity_cand_t tmp[NREP];
    memcpy(tmp, c, n * sizeof(*c));
    for (size_t i = 0; i < n; i++) {
        px_affinity_result_t res;
        order[i] = px_affinity_choose(key, tmp, n, 1.25, &res);
        cr_assert_lt(order[i], n);
        tmp[order[i]].usable = false;
    }
}

/* An idle pool of NREP and the order of key number k in it; returns the key. */
static uint64_t idle_pool_and_order(px_affinity_cand_t *c, unsigned k, size_t *order)
{
    pool_of(c, NREP);
    uint64_t key = key_of(k);
    order_of(key, c, NREP, order);
    return key;
}

Test(affinity_load, an_overloaded_replica_spills_to_the_next_in_order)
{
    px_affinity_cand_t c[NREP];
    size_t order[NREP];
    uint64_t key = idle_pool_and_order(c, 42, order);
    px_affinity_result_t res;
    /* Total 2 over 5: mean 0.4, bound 1.25 * 0.4 + 1 = 1.5. Two in flight is over it. */
    c[order[0]].inflight = 2;
    cr_assert_eq(px_affinity_choose(key, c, NREP, 1.25, &res), order[1]);
    cr_assert_eq(res, PX_AFF_SPILL);
    /* One in flight is not: the key stays home. */
    c[order[0]].inflight = 1;
    cr_assert_eq(px_affinity_choose(key, c, NREP, 1.25, &res), order[0]);
    cr_assert_eq(res, PX_AFF_HIT);
    /* The second is over its bound as well: the third. */
    c[order[0]].inflight = 4;
    c[order[1]].inflight = 4; /* mean 1.6, bound 3 */
    cr_assert_eq(px_affinity_choose(key, c, NREP, 1.25, &res), order[2]);
    cr_assert_eq(res, PX_AFF_SPILL);
    /* A larger load factor tolerates more: bound 4 * 1.6 + 1 = 7.4. */
    cr_assert_eq(px_affinity_choose(key, c, NREP, 4.0, &res), order[0]);
    cr_assert_eq(res, PX_AFF_HIT);
}

Test(affinity_load, bound_rule)
{
    /* inflight > load_factor x mean + 1, mean = total / n */
    cr_assert_not(px_affinity_overloaded(1, 1, 3, 1.25));
    cr_assert(px_affinity_overloaded(2, 2, 3, 1.25));      /* 2 > 1.83 */
    cr_assert_not(px_affinity_overloaded(6, 12, 3, 1.25)); /* 6 = 1.25 * 4 + 1 */
    cr_assert(px_affinity_overloaded(7, 13, 3, 1.25));
    cr_assert_not(px_affinity_overloaded(0, 0, 0, 1.25));
}

Test(affinity_load, unusable_replicas_are_skipped_but_count_in_the_mean)
{
    px_affinity_cand_t c[NREP];
    size_t order[NREP];
    uint64_t key = idle_pool_and_order(c, 7, order);
    px_affinity_result_t res;
    /* The first is full (max_inflight_per_replica) or being retried away from. */
    c[order[0]].usable = false;
    cr_assert_eq(px_affinity_choose(key, c, NREP, 1.25, &res), order[1]);
    cr_assert_eq(res, PX_AFF_SPILL);
    /* Every usable one over its bound: the first usable one still takes it (admission control,
     * not the load bound, refuses work). */
    for (size_t i = 0; i < NREP; i++)
        c[i].usable = i == order[3];
    c[order[0]].inflight = 0;
    c[order[3]].inflight = 9; /* mean 4.8, bound 7: over, but the only usable one */
    cr_assert_eq(px_affinity_choose(key, c, NREP, 1.25, &res), order[3]);
    cr_assert_eq(res, PX_AFF_SPILL);
    /* Nobody usable. */
    c[order[3]].usable = false;
    cr_assert_eq(px_affinity_choose(key, c, NREP, 1.25, &res), (size_t)NREP);
    /* Non-members neither take part in the order nor in the mean. */
    pool_of(c, NREP);
    c[order[0]].member = c[order[0]].usable = false;
    c[order[0]].inflight = 1000;
    cr_assert_eq(px_affinity_choose(key, c, NREP, 1.25, &res), order[1]);
    cr_assert_eq(res, PX_AFF_HIT); /* the first of the order among those taking part */
}
