/* Drift statistics: windows, verdicts on synthetic sample streams, suspect naming, the
 * quarantine queries, and the /admin/drift rendering. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "drift/drift.h"

static drift_result_t res(bool match, int64_t offset, double sim)
{
    drift_result_t r = {0};
    r.match = match;
    r.divergence_offset = match ? -1 : offset;
    r.similarity = match ? 1.0 : sim;
    return r;
}

static void add(drift_pool_t *p, const char *a, const char *b, bool match)
{
    drift_result_t r = res(match, 40, 0.5);
    cr_assert_eq(drift_pool_add(p, a, b, &r), 0);
}

/* n samples of pair (a, b), diverged at the given rate, spread evenly (every k-th). */
static void add_n(drift_pool_t *p, const char *a, const char *b, int n, double div_rate)
{
    double acc = 0;
    for (int i = 0; i < n; i++) {
        acc += div_rate;
        bool diverge = acc >= 1.0 - 1e-9;
        if (diverge)
            acc -= 1.0;
        add(p, a, b, !diverge);
    }
}

static drift_verdict_t verdict(const drift_pool_t *p)
{
    drift_verdict_t v;
    drift_pool_verdict(p, &v);
    return v;
}

Test(drift_stats, window_wraps_at_1000_and_keeps_lifetime_totals)
{
    drift_pool_t *p = drift_pool_new("llama");
    for (int i = 0; i < 600; i++) {
        drift_result_t r = res(false, 5, 0.25);
        drift_pool_add(p, "r1", "r2", &r);
    }
    drift_summary_t s;
    drift_pool_summary(p, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, 600);
    cr_assert_eq(s.diverged, 600);
    cr_assert_float_eq(s.mean_similarity, 0.25, 1e-6);

    for (int i = 0; i < 1000; i++)
        add(p, "r1", "r2", true);
    drift_pool_summary(p, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, DRIFT_WINDOW);
    cr_assert_eq(s.diverged, 0);
    cr_assert_float_eq(s.exact_match_rate, 1.0, 1e-12);
    cr_assert_float_eq(s.mean_similarity, 1.0, 1e-9);
    cr_assert_eq(s.total_samples, 1600);
    cr_assert_eq(s.total_matches, 1000);
    cr_assert_eq(s.median_divergence_offset, -1);

    /* One more diverged sample evicts exactly one match. */
    drift_result_t r = res(false, 9, 0.0);
    drift_pool_add(p, "r1", "r2", &r);
    cr_assert_eq(drift_pool_pair_summary(p, "r2", "r1", &s), 0);
    cr_assert_eq(s.samples, DRIFT_WINDOW);
    cr_assert_eq(s.diverged, 1);
    cr_assert_float_eq(s.exact_match_rate, 0.999, 1e-12);
    cr_assert_float_eq(s.mean_similarity, 0.999, 1e-9);
    cr_assert_eq(s.median_divergence_offset, 9);
    cr_assert_eq(s.total_samples, 1601);

    /* Self samples go to their own window. */
    drift_pool_summary(p, DRIFT_SELF, &s);
    cr_assert_eq(s.samples, 0);
    cr_assert(isnan(s.exact_match_rate));
    drift_pool_free(p);
}

Test(drift_stats, median_offset_over_diverged_samples)
{
    drift_pool_t *p = drift_pool_new("x");
    int64_t offs[] = {30, 10, 40, 20};
    for (int i = 0; i < 4; i++) {
        drift_result_t r = res(false, offs[i], 0.5);
        drift_pool_add(p, "a", "b", &r);
        add(p, "a", "b", true); /* matches do not count */
    }
    drift_summary_t s;
    drift_pool_pair_summary(p, "a", "b", &s);
    cr_assert_eq(s.median_divergence_offset, 20); /* lower median of 10 20 30 40 */
    drift_result_t r = res(false, 25, 0.5);
    drift_pool_add(p, "a", "b", &r);
    drift_pool_pair_summary(p, "a", "b", &s);
    cr_assert_eq(s.median_divergence_offset, 25);
    cr_assert_eq(drift_pool_pair_summary(p, "a", "zz", &s), -ENOENT);
    drift_pool_free(p);
}

Test(drift_stats, names_are_validated)
{
    drift_pool_t *p = drift_pool_new("x");
    drift_result_t r = res(true, -1, 1);
    char longname[DRIFT_NAME_MAX + 1];
    memset(longname, 'n', DRIFT_NAME_MAX);
    longname[DRIFT_NAME_MAX] = '\0';
    cr_assert_eq(drift_pool_add(p, "", "r1", &r), -EINVAL);
    cr_assert_eq(drift_pool_add(p, "r1", longname, &r), -EINVAL);
    longname[DRIFT_NAME_MAX - 1] = '\0';
    cr_assert_eq(drift_pool_add(p, "r1", longname, &r), 0);
    drift_pool_free(p);
}

Test(drift_stats, more_replicas_than_slots_still_count_pool_wide)
{
    drift_pool_t *p = drift_pool_new("x");
    char a[16], b[16];
    for (int i = 0; i < DRIFT_MAX_REPLICAS + 6; i++) {
        snprintf(a, sizeof(a), "r%d", i);
        snprintf(b, sizeof(b), "r%d", i + 1);
        add(p, a, b, true);
    }
    drift_summary_t s;
    drift_pool_summary(p, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, DRIFT_MAX_REPLICAS + 6);
    cr_assert_eq(drift_pool_pair_summary(p, "r0", "r1", &s), 0);
    cr_assert_eq(drift_pool_pair_summary(p, "r66", "r67", &s), -ENOENT);
    drift_pool_free(p);
}

Test(drift_verdict, below_minimum_is_insufficient_data)
{
    drift_pool_t *p = drift_pool_new("x");
    cr_assert_eq(verdict(p).kind, DRIFT_INSUFFICIENT_DATA);
    add_n(p, "r1", "r2", DRIFT_MIN_SAMPLES - 1, 1.0); /* all diverge, but too few */
    add_n(p, "r1", "r1", 100, 0.0);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_INSUFFICIENT_DATA);
    cr_assert(strstr(v.reasons[0], "need 30") != NULL, "%s", v.reasons[0]);
    add(p, "r1", "r2", false);
    cr_assert_eq(verdict(p).kind, DRIFT_CROSS_REPLICA_DRIFT);
    drift_pool_free(p);
}

Test(drift_verdict, consistent_pool)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 40, 0.0);
    add_n(p, "r1", "r3", 40, 0.0);
    add_n(p, "r2", "r3", 40, 0.02); /* a stray divergence is not drift */
    add_n(p, "r1", "r1", 20, 0.0);
    add_n(p, "r2", "r2", 20, 0.0);
    add_n(p, "r3", "r3", 20, 0.0);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CONSISTENT, "%s", drift_verdict_name(v.kind));
    cr_assert_not(v.has_suspect);
    cr_assert_str_eq(drift_verdict_name(v.kind), "consistent");
    drift_pool_free(p);
}

Test(drift_verdict, consistent_without_self_samples_when_cross_agrees)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 100, 0.0);
    cr_assert_eq(verdict(p).kind, DRIFT_CONSISTENT);
    drift_pool_free(p);
}

Test(drift_verdict, noisy_replicas_are_batching_nondeterminism)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 100, 0.30);
    add_n(p, "r1", "r3", 100, 0.30);
    add_n(p, "r2", "r3", 100, 0.30);
    add_n(p, "r1", "r1", 40, 0.25);
    add_n(p, "r2", "r2", 40, 0.25);
    add_n(p, "r3", "r3", 40, 0.25);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_BATCHING_NONDETERMINISM, "%s", drift_verdict_name(v.kind));
    cr_assert_not(v.has_suspect);
    cr_assert_str_eq(drift_verdict_name(v.kind), "batching_nondeterminism");
    drift_pool_free(p);
}

/* One replica with batching noise: its cross pairs diverge about half as often as its own self
 * pair ((s_r2 + s_r1) / 2), which is what noise predicts. Self samples are uneven (r2's are a
 * sixth of them, its pairs two thirds of cross), so the raw pool self rate (10%) against the
 * cross rate (20%) would look like drift; the pair-weighted expectation (20%) does not. */
Test(drift_verdict, one_noisy_replica_is_not_named_a_drift_suspect)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 100, 0.30);
    add_n(p, "r2", "r3", 100, 0.30);
    add_n(p, "r1", "r3", 100, 0.0);
    add_n(p, "r1", "r1", 100, 0.0);
    add_n(p, "r2", "r2", 40, 0.60);
    add_n(p, "r3", "r3", 100, 0.0);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_BATCHING_NONDETERMINISM, "%s: %s", drift_verdict_name(v.kind),
                 v.reasons[0]);
    cr_assert_not(drift_pool_is_suspect(p, "r2"));
    drift_pool_free(p);
}

static drift_pool_t *drifted_pool(bool with_self)
{
    drift_pool_t *p = drift_pool_new("llama");
    /* interleave the pairs as a shadow stream would */
    for (int i = 0; i < 40; i++) {
        add(p, "r1", "r2", true);
        add(p, "r3", "r1", false);
        add(p, "r2", "r3", false);
        if (with_self && i % 2 == 0) {
            add(p, "r1", "r1", true);
            add(p, "r2", "r2", true);
            add(p, "r3", "r3", true);
        }
    }
    return p;
}

Test(drift_verdict, one_drifted_replica_of_three_is_named)
{
    drift_pool_t *p = drifted_pool(true);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT, "%s", drift_verdict_name(v.kind));
    cr_assert(v.has_suspect);
    cr_assert_str_eq(v.suspect, "r3");
    cr_assert_str_eq(drift_verdict_name(v.kind), "cross_replica_drift");
    cr_assert(strstr(v.reasons[1], "r3 disagrees") != NULL, "%s", v.reasons[1]);
    cr_assert(drift_pool_is_suspect(p, "r3"));
    cr_assert_not(drift_pool_is_suspect(p, "r1"));
    drift_pool_free(p);
}

Test(drift_verdict, pair_structure_names_the_suspect_without_self_samples)
{
    drift_pool_t *p = drifted_pool(false);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert_str_eq(v.suspect, "r3");
    drift_pool_free(p);
}

Test(drift_verdict, two_replicas_drift_but_suspect_is_undetermined)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 60, 1.0);
    add_n(p, "r1", "r1", 30, 0.0);
    add_n(p, "r2", "r2", 30, 0.0);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert_not(v.has_suspect);
    cr_assert_str_eq(v.suspect, "");
    /* Says exactly why: nothing else is known about them. */
    cr_assert_str_eq(v.reasons[1],
                     "suspect undetermined: two replicas (r1, r2), no canary result, equal "
                     "self-noise (0.0% n=30, 0.0% n=30), no restart, re-admission or identity "
                     "change of one just before their pair began to diverge: cannot tell which; "
                     "add a canary to the manifest or a third replica");
    cr_assert_not(drift_pool_is_suspect(p, "r1"));
    cr_assert_not(drift_pool_is_suspect(p, "r2"));
    drift_pool_free(p);
}

/* ---- two replicas: what else is known names the suspect (docs/drift.md §5) ----------------- */

static drift_pool_t *two_drifting(int self2_diverged_of_30)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 60, 1.0);
    add_n(p, "r1", "r1", 30, 0.0);
    add_n(p, "r2", "r2", 30, self2_diverged_of_30 / 30.0);
    return p;
}

static drift_hint_t hint(drift_canary_t canary, const char *fp, bool accept,
                         uint64_t identity_changed_ms)
{
    drift_hint_t h = {
        .canary = canary, .accept_identity = accept, .identity_changed_ms = identity_changed_ms};
    snprintf(h.fingerprint, sizeof(h.fingerprint), "%s", fp);
    return h;
}

Test(drift_two, the_canary_names_the_one_that_fails_it)
{
    drift_pool_t *p = two_drifting(0);
    drift_hint_t ok = hint(DRIFT_CANARY_PASS, "fp_a", false, 0);
    drift_hint_t bad = hint(DRIFT_CANARY_FAIL, "fp_a", false, 0);
    drift_pool_set_hint(p, "r1", &bad);
    drift_pool_set_hint(p, "r2", &ok);
    drift_pool_set_hint(p, "r9", &ok); /* untracked: ignored */
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert(v.has_suspect);
    cr_assert_str_eq(v.suspect, "r1");
    cr_assert_str_eq(v.reasons[1], "r1 fails the manifest's canary and r2 passes it");
    cr_assert(drift_pool_is_suspect(p, "r1"));
    /* Both fail: the canary cannot separate them (a stale expected hash, say). */
    drift_pool_set_hint(p, "r2", &bad);
    v = verdict(p);
    cr_assert_not(v.has_suspect);
    cr_assert(strstr(v.reasons[1], "both fail the canary") != NULL, "%s", v.reasons[1]);
    /* Re-admission drops the hint with the evidence. */
    drift_pool_set_hint(p, "r2", &ok);
    drift_pool_reset_replica(p, "r1");
    add_n(p, "r1", "r2", 60, 1.0);
    v = verdict(p);
    cr_assert_not(v.has_suspect, "%s", v.suspect);
    drift_pool_free(p);
}

Test(drift_two, a_rollout_identity_is_named_when_fingerprints_differ)
{
    drift_pool_t *p = two_drifting(0);
    drift_hint_t old = hint(DRIFT_CANARY_UNKNOWN, "fp_old", false, 0);
    drift_hint_t nu = hint(DRIFT_CANARY_UNKNOWN, "fp_new", true, 0);
    drift_pool_set_hint(p, "r1", &old);
    drift_pool_set_hint(p, "r2", &nu);
    drift_verdict_t v = verdict(p);
    cr_assert_str_eq(v.suspect, "r2");
    cr_assert_str_eq(v.reasons[1], "r2 serves the rollout's accepted identity fp_new, r1 the "
                                   "manifest's fp_old: the difference is the rollout's");
    drift_pool_free(p);
}

Test(drift_two, an_identity_change_before_the_divergence_is_named)
{
    /* The pair agrees; then r2's attested identity changes (a later identity_changed_ms than
     * its previous hint) and from there on the pair diverges. */
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 40, 0.0);
    add_n(p, "r1", "r1", 30, 0.0);
    add_n(p, "r2", "r2", 30, 0.0);
    drift_hint_t still = hint(DRIFT_CANARY_PASS, "fp_a", false, 0);
    drift_hint_t old = hint(DRIFT_CANARY_PASS, "fp_a", false, 1700000000000);
    drift_hint_t changed = hint(DRIFT_CANARY_PASS, "fp_a", false, 1700000120000);
    cr_assert_not(drift_pool_set_hint(p, "r1", &still));
    cr_assert_not(drift_pool_set_hint(p, "r2", &old)); /* the first one seen: no change */
    cr_assert_not(drift_pool_set_hint(p, "r2", &old));
    cr_assert(drift_pool_set_hint(p, "r2", &changed));
    drift_summary_t s;
    drift_pool_pair_summary(p, "r1", "r2", &s);
    cr_assert_eq(s.samples, 0); /* a new window for r2's pairs */
    add_n(p, "r1", "r2", 40, 1.0);
    add_n(p, "r2", "r2", 10, 0.0);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT, "%s", drift_verdict_name(v.kind));
    cr_assert_str_eq(v.suspect, "r2");
    cr_assert_str_eq(v.reasons[1], "r2 changed just before its pair with r1 began to diverge: "
                                   "attested identity changed at 2023-11-14T22:15:20.000Z; 30 of "
                                   "the pair's first 30 samples after it diverged, and the pair "
                                   "agreed before");
    /* An older or equal time is no change. */
    cr_assert_not(drift_pool_set_hint(p, "r2", &changed));
    cr_assert_not(drift_pool_set_hint(p, "r2", &old));
    cr_assert_str_eq(verdict(p).suspect, "r2");
    drift_pool_free(p);
}

Test(drift_two, the_noisier_replica_is_named_by_self_noise)
{
    drift_pool_t *p = two_drifting(15); /* r2 disagrees with itself half the time */
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT, "%s", drift_verdict_name(v.kind));
    cr_assert_str_eq(v.suspect, "r2");
    cr_assert(strstr(v.reasons[1], "r2's self pairs diverge 50.0% (n=30) vs r1's 0.0% (n=30)") !=
                  NULL,
              "%s", v.reasons[1]);
    drift_pool_free(p);
}

Test(drift_two, too_few_self_samples_is_said)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 60, 1.0);
    add_n(p, "r1", "r1", 25, 0.0);
    add_n(p, "r2", "r2", 5, 0.0);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert(strstr(v.reasons[1], "too few self samples (25, 5; need 10 each)") != NULL, "%s",
              v.reasons[1]);
    drift_pool_free(p);
}

Test(drift_verdict, two_replicas_diverging_without_self_baseline_is_insufficient)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 200, 0.5);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_INSUFFICIENT_DATA, "%s", drift_verdict_name(v.kind));
    cr_assert(strstr(v.reasons[0], "self_rate") != NULL, "%s", v.reasons[0]);
    drift_pool_free(p);
}

Test(drift_verdict, margins_absolute_and_relative)
{
    /* Large n (so the z-test passes): 8% over a 0% baseline is below the absolute margin. */
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 1000, 0.08);
    add_n(p, "r1", "r1", 1000, 0.0);
    cr_assert_eq(verdict(p).kind, DRIFT_CONSISTENT);
    drift_pool_free(p);

    /* 12% over 0%: both margins hold. */
    p = drift_pool_new("x");
    add_n(p, "r1", "r2", 1000, 0.12);
    add_n(p, "r1", "r1", 1000, 0.0);
    cr_assert_eq(verdict(p).kind, DRIFT_CROSS_REPLICA_DRIFT);
    drift_pool_free(p);

    /* 35% over 20%: +15 points, but less than twice the noise: batching, not drift. */
    p = drift_pool_new("x");
    add_n(p, "r1", "r2", 1000, 0.35);
    add_n(p, "r1", "r1", 1000, 0.20);
    cr_assert_eq(verdict(p).kind, DRIFT_BATCHING_NONDETERMINISM);
    drift_pool_free(p);

    /* 45% over 20%: both. */
    p = drift_pool_new("x");
    add_n(p, "r1", "r2", 1000, 0.45);
    add_n(p, "r1", "r1", 1000, 0.20);
    cr_assert_eq(verdict(p).kind, DRIFT_CROSS_REPLICA_DRIFT);
    drift_pool_free(p);
}

Test(drift_verdict, small_windows_need_significance)
{
    /* 30 samples: 4/30 = 13% over 0/30 passes both margins but not 3 standard errors. */
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 30, 4.0 / 30);
    add_n(p, "r1", "r1", 30, 0.0);
    cr_assert_eq(verdict(p).kind, DRIFT_CONSISTENT);
    drift_pool_free(p);
}

Test(drift_quarantine, suspect_recovers_then_reset_clears_the_evidence)
{
    drift_pool_t *p = drifted_pool(true);
    cr_assert(drift_pool_is_suspect(p, "r3"));
    cr_assert_not(drift_pool_replica_recovered(p, "r3"));
    cr_assert(drift_pool_replica_recovered(p, "r1") == false); /* r1's pairs with r3 diverge */

    /* r3 is quarantined: it only gets shadow copies of r1's and r2's traffic, which now agree.
     * Judged on its last 50 cross samples: after 47 good ones, 3 of 50 (6%) still diverge ... */
    for (int i = 0; i < 47; i++)
        add(p, i % 2 ? "r1" : "r2", "r3", true);
    cr_assert_not(drift_pool_replica_recovered(p, "r3"));
    /* ... after 48, 2 of 50 (4%) are within the 5-point margin over a 0% self baseline. */
    add(p, "r1", "r3", true);
    cr_assert(drift_pool_replica_recovered(p, "r3"));
    for (int i = 0; i < 2; i++)
        add(p, "r1", "r3", true);
    /* One diverged sample among the last 50 is 2%, still within the baseline margin ... */
    add(p, "r1", "r3", false);
    cr_assert(drift_pool_replica_recovered(p, "r3"));
    /* ... four are 8%, not. */
    for (int i = 0; i < 3; i++)
        add(p, "r1", "r3", false);
    cr_assert_not(drift_pool_replica_recovered(p, "r3"));
    for (int i = 0; i < DRIFT_RECOVERY_SAMPLES; i++)
        add(p, "r2", "r3", true);
    cr_assert(drift_pool_replica_recovered(p, "r3"));

    /* The old evidence would convict it again; the lead resets it on re-admission. */
    cr_assert(drift_pool_is_suspect(p, "r3"));
    drift_pool_reset_replica(p, "r3");
    cr_assert_not(drift_pool_is_suspect(p, "r3"));
    drift_summary_t s;
    drift_pool_summary(p, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, 40); /* only r1-r2 samples are left in the pool window */
    cr_assert_eq(s.diverged, 0);
    cr_assert_eq(s.total_samples, 40 * 3 + 2 * DRIFT_RECOVERY_SAMPLES + 4);
    cr_assert_eq(drift_pool_pair_summary(p, "r1", "r3", &s), 0);
    cr_assert_eq(s.samples, 0);
    cr_assert_gt(s.total_samples, 0);
    cr_assert_not(drift_pool_replica_recovered(p, "r3")); /* needs fresh samples */
    /* Pairs without r3 keep their windows. */
    drift_pool_pair_summary(p, "r1", "r2", &s);
    cr_assert_eq(s.samples, 40);
    drift_pool_free(p);
}

Test(drift_quarantine, recovery_baseline_follows_self_noise)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r1", 100, 0.20);
    add_n(p, "r1", "r2", DRIFT_RECOVERY_SAMPLES, 0.24);
    cr_assert(drift_pool_replica_recovered(p, "r2"));
    add_n(p, "r1", "r2", DRIFT_RECOVERY_SAMPLES, 0.30);
    cr_assert_not(drift_pool_replica_recovered(p, "r2"));
    cr_assert_not(drift_pool_replica_recovered(p, "nobody"));
    drift_pool_free(p);
}

Test(drift_stats, forget_releases_the_slot)
{
    drift_pool_t *p = drifted_pool(true);
    drift_pool_forget_replica(p, "r3");
    drift_summary_t s;
    cr_assert_eq(drift_pool_pair_summary(p, "r1", "r3", &s), -ENOENT);
    drift_pool_summary(p, DRIFT_SELF, &s);
    cr_assert_eq(s.samples, 40); /* r1 and r2 self samples remain */
    drift_pool_summary(p, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, 40);
    add(p, "r4", "r1", true); /* the slot is reused */
    cr_assert_eq(drift_pool_pair_summary(p, "r4", "r1", &s), 0);
    cr_assert_eq(s.samples, 1);
    drift_pool_forget_replica(p, "nobody");
    drift_pool_free(p);
}

Test(drift_render, admin_drift_json)
{
    drift_pool_t *p = drifted_pool(true);
    drift_pool_t *q = drift_pool_new("empty");
    const drift_pool_t *pools[] = {p, q};
    dp_buf_t out = {0};
    drift_render(&out, pools, 2);
    cJSON *root = cJSON_Parse(out.base);
    cr_assert_not_null(root, "%s", out.base);
    cr_assert_eq(cJSON_GetObjectItem(root, "window")->valueint, 1000);
    cJSON *pl = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "pools"), "llama");
    cr_assert_not_null(pl);
    cr_assert_str_eq(cJSON_GetObjectItem(pl, "verdict")->valuestring, "cross_replica_drift");
    cr_assert_str_eq(cJSON_GetObjectItem(pl, "suspect")->valuestring, "r3");
    cr_assert_geq(cJSON_GetArraySize(cJSON_GetObjectItem(pl, "reasons")), 2);
    cJSON *cross = cJSON_GetObjectItem(pl, "cross");
    cr_assert_eq(cJSON_GetObjectItem(cross, "samples")->valueint, 120);
    cr_assert_float_eq(cJSON_GetObjectItem(cross, "exact_match_rate")->valuedouble, 40.0 / 120,
                       1e-9);
    cr_assert_float_eq(cJSON_GetObjectItem(cross, "mean_similarity")->valuedouble,
                       (40 + 80 * 0.5) / 120, 1e-6);
    cr_assert_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(pl, "self"), "samples")->valueint, 60);

    cJSON *pairs = cJSON_GetObjectItem(pl, "pairs");
    cr_assert_eq(cJSON_GetArraySize(pairs), 6); /* 3 cross + 3 self */
    int seen = 0;
    cJSON *pr;
    cJSON_ArrayForEach(pr, pairs)
    {
        cJSON *names = cJSON_GetObjectItem(pr, "replicas");
        const char *a = cJSON_GetArrayItem(names, 0)->valuestring;
        const char *b = cJSON_GetArrayItem(names, 1)->valuestring;
        cJSON *med = cJSON_GetObjectItem(pr, "median_divergence_offset");
        if ((!strcmp(a, "r1") && !strcmp(b, "r3")) || (!strcmp(a, "r3") && !strcmp(b, "r1"))) {
            cr_assert_str_eq(cJSON_GetObjectItem(pr, "kind")->valuestring, "cross");
            cr_assert_eq(med->valueint, 40);
            cr_assert_float_eq(cJSON_GetObjectItem(pr, "exact_match_rate")->valuedouble, 0.0,
                               1e-12);
            seen++;
        }
        if (!strcmp(a, "r1") && !strcmp(b, "r2")) {
            cr_assert(cJSON_IsNull(med));
            seen++;
        }
    }
    cr_assert_eq(seen, 2);
    cJSON *r3 = cJSON_GetObjectItem(cJSON_GetObjectItem(pl, "replicas"), "r3");
    cr_assert_eq(cJSON_GetObjectItem(r3, "cross_samples")->valueint, 80);

    cJSON *e = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "pools"), "empty");
    cr_assert_str_eq(cJSON_GetObjectItem(e, "verdict")->valuestring, "insufficient_data");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(e, "suspect")));
    cr_assert(
        cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetObjectItem(e, "cross"), "exact_match_rate")));
    cJSON_Delete(root);
    dp_buf_free(&out);
    drift_pool_free(p);
    drift_pool_free(q);
}
