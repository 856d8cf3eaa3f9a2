/* The router (proxy/data/router.h) and the eligibility rules of replicas and pools
 * (proxy/core/replica.h, pool.h): which replica a request goes to under each balance, who is
 * eligible at all (admitted, reachable, not drained), max_inflight_per_replica and what *why
 * says when nothing is picked, `avoid` (a retry's failed replica), affinity's key stability,
 * bounded loads and fallback, and the text of a 503 / /readyz with no replica.
 *
 * Pools are built by hand from the public structs; only the fields routing reads are set, in
 * the helpers below, so a change to how replicas keep them touches one place. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "common/util.h"
#include "proxy/core/pool.h"
#include "proxy/core/replica.h"
#include "proxy/data/router.h"

#define MAXR 8

typedef struct {
    cfg_pool_t cfg;
    px_pool_t pool;
    px_replica_t reps[MAXR];
    px_slots_t rslots[MAXR];
    px_engine_t engines[MAXR];
    px_replica_t *ptrs[MAXR];
    char names[MAXR][24];
    px_pool_slot_t slots[1]; /* the calling thread's (this test runs as the control thread) */
} tpool_t;

/* Stands in for a replica's upstream: the router only checks that there is one. */
static char g_fake_upstream;

static void set_inflight(px_replica_t *r, uint32_t n)
{
    r->slots->inflight = n;
}

/* n admitted replicas r1..rn listed in that order (reversed: rn..r1). */
static void tpool_init(tpool_t *t, cfg_balance_t balance, uint32_t max_inflight, size_t n,
                       bool reversed)
{
    memset(t, 0, sizeof(*t));
    t->cfg.name = "p";
    t->cfg.balance = balance;
    t->cfg.max_inflight_per_replica = max_inflight;
    t->cfg.affinity.load_factor = 1.25;
    t->pool.cfg = &t->cfg;
    t->pool.name = "p";
    t->pool.replicas = t->ptrs;
    t->pool.nreplicas = n;
    t->pool.slots = t->slots;
    for (size_t i = 0; i < n; i++) {
        size_t k = reversed ? n - 1 - i : i;
        px_replica_t *r = &t->reps[i];
        snprintf(t->names[i], sizeof(t->names[i]), "r%zu", k + 1);
        r->name = t->names[i];
        r->pool_name = "p";
        r->state = PX_REPLICA_ADMITTED;
        r->up = (net_upstream_t *)&g_fake_upstream;
        r->aff_id = px_affinity_hash(r->name, strlen(r->name));
        r->slots = &t->rslots[i];
        r->slots->eng = &t->engines[i];
        t->ptrs[i] = r;
    }
}

static px_replica_t *rep(tpool_t *t, const char *name)
{
    for (size_t i = 0; i < t->pool.nreplicas; i++)
        if (strcmp(t->reps[i].name, name) == 0)
            return &t->reps[i];
    cr_assert_fail("no replica %s", name);
    return NULL;
}

/* The picked replica's name ("-" for none) and *why. A pick takes a slot on what it picks
 * (px_replica_take_slot); it is given back here, so each call sees the loads the test set. */
static const char *pick(tpool_t *t, const char *avoid, px_affinity_t *aff, int *why)
{
    int w = -1;
    px_replica_t *r = px_router_pick(&t->pool, avoid ? rep(t, avoid) : NULL, aff, &w);
    if (why)
        *why = w;
    if (r)
        px_replica_put_slot(r);
    return r ? r->name : "-";
}

/* What a replica's reasons look like to the router (the text the control thread publishes). */
static void set_reasons(px_replica_t *r, const char *joined)
{
    px_seqstr_set(&r->why, joined);
}

Test(router, round_robin_takes_each_replica_in_turn)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_ROUND_ROBIN, 0, 3, false);
    const char *want[] = {"r1", "r2", "r3", "r1", "r2", "r3"};
    for (size_t i = 0; i < 6; i++)
        cr_assert_str_eq(pick(&t, NULL, NULL, NULL), want[i], "pick %zu", i);
}

Test(router, only_admitted_reachable_undrained_replicas_serve)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_ROUND_ROBIN, 0, 5, false);
    rep(&t, "r2")->state = PX_REPLICA_REJECTED;
    rep(&t, "r3")->drained = true;
    rep(&t, "r4")->up = NULL;
    cr_assert(px_replica_serving(rep(&t, "r1")));
    cr_assert_not(px_replica_serving(rep(&t, "r2")));
    cr_assert_not(px_replica_serving(rep(&t, "r3")));
    cr_assert_not(px_replica_serving(rep(&t, "r4")));
    int seen1 = 0, seen5 = 0;
    for (int i = 0; i < 10; i++) {
        const char *n = pick(&t, NULL, NULL, NULL);
        cr_assert(strcmp(n, "r1") == 0 || strcmp(n, "r5") == 0, "picked %s", n);
        seen1 += strcmp(n, "r1") == 0;
        seen5 += strcmp(n, "r5") == 0;
    }
    cr_assert(seen1 > 0 && seen5 > 0);
    cr_assert(px_pool_has_admitted(&t.pool));
}

Test(router, pending_quarantined_and_unreachable_do_not_serve)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_LEAST_INFLIGHT, 0, 3, false);
    rep(&t, "r1")->state = PX_REPLICA_PENDING;
    rep(&t, "r2")->state = PX_REPLICA_QUARANTINED;
    rep(&t, "r3")->state = PX_REPLICA_UNREACHABLE;
    int why;
    cr_assert_str_eq(pick(&t, NULL, NULL, &why), "-");
    cr_assert_eq(why, 0, "none admitted is why 0");
    cr_assert_not(px_pool_has_admitted(&t.pool));
}

Test(router, least_inflight_picks_the_least_loaded)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_LEAST_INFLIGHT, 0, 3, false);
    set_inflight(rep(&t, "r1"), 3);
    set_inflight(rep(&t, "r2"), 1);
    set_inflight(rep(&t, "r3"), 2);
    for (int i = 0; i < 6; i++)
        cr_assert_str_eq(pick(&t, NULL, NULL, NULL), "r2");
}

Test(router, least_inflight_spreads_ties)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_LEAST_INFLIGHT, 0, 3, false);
    set_inflight(rep(&t, "r1"), 1);
    set_inflight(rep(&t, "r2"), 1);
    set_inflight(rep(&t, "r3"), 5);
    int seen1 = 0, seen2 = 0;
    for (int i = 0; i < 6; i++) {
        const char *n = pick(&t, NULL, NULL, NULL);
        cr_assert_str_neq(n, "r3");
        seen1 += strcmp(n, "r1") == 0;
        seen2 += strcmp(n, "r2") == 0;
    }
    cr_assert(seen1 > 0 && seen2 > 0, "ties always went to one replica");
}

Test(router, max_inflight_full_pool_is_why_1_and_a_free_slot_is_taken)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_LEAST_INFLIGHT, 2, 2, false);
    set_inflight(rep(&t, "r1"), 2);
    set_inflight(rep(&t, "r2"), 2);
    int why;
    cr_assert_str_eq(pick(&t, NULL, NULL, &why), "-");
    cr_assert_eq(why, 1, "all at their limit is why 1");
    set_inflight(rep(&t, "r2"), 1);
    cr_assert_str_eq(pick(&t, NULL, NULL, &why), "r2");
    /* The pick itself takes the free slot (compare-and-swap: exact across workers). */
    cr_assert_not_null(px_router_pick(&t.pool, NULL, NULL, &why));
    cr_assert_eq(atomic_load(&rep(&t, "r2")->slots->inflight), 2);
    cr_assert_null(px_router_pick(&t.pool, NULL, NULL, &why));
    cr_assert_eq(why, 1);
    /* max_inflight 1, the single-sequence path: one in flight means full. */
    tpool_init(&t, CFG_BALANCE_ROUND_ROBIN, 1, 1, false);
    set_inflight(rep(&t, "r1"), 1);
    cr_assert_str_eq(pick(&t, NULL, NULL, &why), "-");
    cr_assert_eq(why, 1);
}

Test(router, empty_pool_is_why_0)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_ROUND_ROBIN, 0, 0, false);
    int why;
    cr_assert_str_eq(pick(&t, NULL, NULL, &why), "-");
    cr_assert_eq(why, 0);
}

Test(router, avoid_is_skipped_unless_it_is_the_only_one_left)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_LEAST_INFLIGHT, 2, 2, false);
    set_inflight(rep(&t, "r2"), 1);
    for (int i = 0; i < 4; i++)
        cr_assert_str_eq(pick(&t, "r1", NULL, NULL), "r2", "the retry went back to r1");
    rep(&t, "r2")->drained = true;
    cr_assert_str_eq(pick(&t, "r1", NULL, NULL), "r1", "better the failed one than none");
    set_inflight(rep(&t, "r1"), 2);
    int why;
    cr_assert_str_eq(pick(&t, "r1", NULL, &why), "-");
    cr_assert_eq(why, 1);
    rep(&t, "r1")->state = PX_REPLICA_REJECTED;
    set_inflight(rep(&t, "r1"), 0);
    cr_assert_str_eq(pick(&t, "r1", NULL, &why), "-", "an avoided replica must still serve");
    cr_assert_eq(why, 0);
}

static px_affinity_t key(const char *k)
{
    return (px_affinity_t){.has_key = true, .key = px_affinity_hash(k, strlen(k))};
}

Test(router, affinity_key_sticks_to_one_replica_whatever_the_listing_order)
{
    tpool_t t, rev;
    tpool_init(&t, CFG_BALANCE_AFFINITY, 0, 5, false);
    tpool_init(&rev, CFG_BALANCE_AFFINITY, 0, 5, true);
    int distinct = 0;
    const char *prev = NULL;
    for (int k = 0; k < 50; k++) {
        char s[16];
        snprintf(s, sizeof(s), "session-%d", k);
        px_affinity_t a = key(s), b = key(s);
        const char *first = pick(&t, NULL, &a, NULL);
        cr_assert_eq(a.result, PX_AFF_HIT);
        for (int i = 0; i < 5; i++)
            cr_assert_str_eq(pick(&t, NULL, &a, NULL), first, "key %s moved", s);
        cr_assert_str_eq(pick(&rev, NULL, &b, NULL), first, "key %s depends on order", s);
        distinct += prev && strcmp(prev, first) != 0;
        prev = first;
    }
    cr_assert_gt(distinct, 10, "keys do not spread");
}

Test(router, affinity_spills_past_an_overloaded_replica_and_returns)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_AFFINITY, 0, 4, false);
    px_affinity_t a = key("session-x");
    const char *first = pick(&t, NULL, &a, NULL);
    cr_assert_eq(a.result, PX_AFF_HIT);
    /* 10 in flight against a mean of 2.5: over 1.25 x mean + 1. */
    set_inflight(rep(&t, first), 10);
    const char *second = pick(&t, NULL, &a, NULL);
    cr_assert_str_neq(second, first);
    cr_assert_eq(a.result, PX_AFF_SPILL);
    /* 1 against a mean of 0.25 is under the bound (1.31): back to the first. */
    set_inflight(rep(&t, first), 1);
    cr_assert_str_eq(pick(&t, NULL, &a, NULL), first);
    cr_assert_eq(a.result, PX_AFF_HIT);
}

Test(router, affinity_moves_off_a_drained_replica_and_back)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_AFFINITY, 0, 3, false);
    px_affinity_t a = key("session-y");
    const char *first = pick(&t, NULL, &a, NULL);
    rep(&t, first)->drained = true;
    const char *other = pick(&t, NULL, &a, NULL);
    cr_assert_str_neq(other, first);
    /* The drained replica left the order: the new one is the key's first member now. */
    cr_assert_eq(a.result, PX_AFF_HIT);
    rep(&t, first)->drained = false;
    cr_assert_str_eq(pick(&t, NULL, &a, NULL), first);
}

Test(router, affinity_avoid_full_fallback_and_keyless)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_AFFINITY, 1, 2, false);
    px_affinity_t a = key("session-z");
    const char *first = pick(&t, NULL, &a, NULL);
    const char *other = strcmp(first, "r1") == 0 ? "r2" : "r1";
    /* A retry avoids the first: the other one, as a spill. */
    cr_assert_str_eq(pick(&t, first, &a, NULL), other);
    cr_assert_eq(a.result, PX_AFF_SPILL);
    /* The other is full: the avoided one is all that is left. */
    set_inflight(rep(&t, other), 1);
    cr_assert_str_eq(pick(&t, first, &a, NULL), first);
    cr_assert_eq(a.result, PX_AFF_SPILL);
    /* Both full: none, why 1, and no placement. */
    set_inflight(rep(&t, first), 1);
    int why;
    cr_assert_str_eq(pick(&t, NULL, &a, &why), "-");
    cr_assert_eq(why, 1);
    cr_assert_eq(a.result, PX_AFF_NONE);
    /* A fallback key is reported as such wherever it lands. */
    set_inflight(rep(&t, first), 0);
    set_inflight(rep(&t, other), 0);
    px_affinity_t f = key("prefix-stand-in");
    f.fallback = true;
    cr_assert_str_neq(pick(&t, NULL, &f, NULL), "-");
    cr_assert_eq(f.result, PX_AFF_FALLBACK);
    /* No key at all on an affinity pool: spread by load, the result untouched. */
    set_inflight(rep(&t, "r1"), 0);
    set_inflight(rep(&t, "r2"), 1);
    t.cfg.max_inflight_per_replica = 0;
    px_affinity_t none = {0};
    cr_assert_str_eq(pick(&t, NULL, &none, NULL), "r1");
    cr_assert_str_eq(pick(&t, NULL, NULL, NULL), "r1");
    cr_assert_eq(none.result, PX_AFF_NONE);
}

Test(router, why_unavailable_lists_every_replica_with_its_reasons)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_ROUND_ROBIN, 0, 3, false);
    px_replica_t *r1 = rep(&t, "r1");
    r1->state = PX_REPLICA_REJECTED;
    set_reasons(r1, "model digest mismatch; bad signature");
    rep(&t, "r2")->drained = true;
    rep(&t, "r3")->state = PX_REPLICA_UNREACHABLE;
    dp_buf_t b = {0};
    px_pool_why_unavailable(&t.pool, &b);
    cr_assert_str_eq(b.base, "pool p has no admitted replica: r1 rejected (model digest mismatch; "
                             "bad signature); r2 admitted drained; r3 unreachable.");
    dp_buf_free(&b);
    tpool_init(&t, CFG_BALANCE_ROUND_ROBIN, 0, 0, false);
    px_pool_why_unavailable(&t.pool, &b);
    cr_assert_str_eq(b.base, "pool p has no replicas");
    dp_buf_free(&b);
}

/* Two pools' slots on one engine: while a single_sequence pool names it, a slot of either is
 * taken only when nothing at all runs there (what a pool's earlier mode still runs counts), and
 * without one each pool counts its own requests under its own limit. */
Test(router, an_engine_a_single_sequence_pool_names_runs_one_request_whoever_sends_it)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_ROUND_ROBIN, 4, 2, false);
    px_replica_t *a = rep(&t, "r1"), *b = rep(&t, "r2");
    b->slots->eng = a->slots->eng; /* the same engine, another pool's slots */
    px_engine_t *e = a->slots->eng;
    cr_assert(px_replica_take_slot(&t.pool, a));
    cr_assert(px_replica_take_slot(&t.pool, b));
    cr_assert(px_replica_take_slot(&t.pool, a));
    cr_assert_eq(atomic_load(&e->running), 3);
    /* A reload makes one of them single_sequence: what runs now keeps the engine. */
    b->slots->one = true;
    atomic_store(&e->one, true);
    cr_assert_not(px_replica_take_slot(&t.pool, b));
    cr_assert_not(px_replica_take_slot(&t.pool, a));
    px_replica_put_slot(a);
    px_replica_put_slot(a);
    cr_assert_not(px_replica_take_slot(&t.pool, b));
    px_replica_put_slot(b);
    cr_assert_eq(atomic_load(&e->running), 0);
    cr_assert(px_replica_take_slot(&t.pool, b));
    cr_assert_not(px_replica_take_slot(&t.pool, a));
    cr_assert_not(px_replica_take_slot(&t.pool, b));
    cr_assert_eq(atomic_load(&a->slots->inflight), 0);
    cr_assert_eq(atomic_load(&b->slots->inflight), 1);
    px_replica_put_slot(b);
    cr_assert(px_replica_take_slot(&t.pool, a));
    cr_assert_not(px_replica_take_slot(&t.pool, b));
    px_replica_put_slot(a);
    cr_assert_eq(atomic_load(&e->running), 0);
}

/* Across a fleet a gated engine takes a slot only while this member holds its key, and only
 * until its lease surely lives: a member that wakes past it (paused, cut off) starts nothing. */
Test(router, a_fleet_engine_runs_only_while_its_key_is_held_and_its_lease_lives)
{
    tpool_t t;
    tpool_init(&t, CFG_BALANCE_ROUND_ROBIN, 1, 1, false);
    px_replica_t *a = rep(&t, "r1");
    px_engine_t *e = a->slots->eng;
    a->slots->one = true;
    atomic_store(&e->one, true);
    atomic_store(&e->gated, true);
    cr_assert_not(px_replica_take_slot(&t.pool, a));
    cr_assert(atomic_load(&e->want), "a refused take asks for the key");
    cr_assert_eq(atomic_load(&e->running), 0);
    atomic_store(&e->want, false);
    atomic_store(&e->held, true);
    atomic_store(&e->held_until, dp_now_ms() + 60000);
    cr_assert(px_replica_take_slot(&t.pool, a));
    px_replica_put_slot(a);
    atomic_store(&e->held_until, dp_now_ms() - 1);
    cr_assert_not(px_replica_take_slot(&t.pool, a));
    cr_assert(atomic_load(&e->want));
    cr_assert_eq(atomic_load(&e->running), 0);
    cr_assert_eq(atomic_load(&a->slots->inflight), 0);
}
