/* Verdicts follow the present (docs/drift.md §5, "History"): a replica's change starts every
 * window it is in again, the one of two replicas whose change the divergence followed is the
 * suspect, a fixed replica's verdict clears, and the statistics can be cleared. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <stdio.h>
#include <string.h>

#include "common/buf.h"
#include "drift/drift.h"

#define T0 1700000000000ULL /* 2023-11-14T22:13:20.000Z */

static void add(drift_pool_t *p, const char *a, const char *b, bool match)
{
    drift_result_t r = {0};
    r.match = match;
    r.divergence_offset = match ? -1 : 40;
    r.similarity = match ? 1.0 : 0.5;
    cr_assert_eq(drift_pool_add(p, a, b, &r), 0);
}

static void add_n(drift_pool_t *p, const char *a, const char *b, int n, bool match)
{
    for (int i = 0; i < n; i++)
        add(p, a, b, match);
}

static drift_verdict_t verdict(const drift_pool_t *p)
{
    drift_verdict_t v;
    drift_pool_verdict(p, &v);
    return v;
}

static uint32_t pair_samples(const drift_pool_t *p, const char *a, const char *b)
{
    drift_summary_t s;
    if (drift_pool_pair_summary(p, a, b, &s) != 0)
        return UINT32_MAX;
    return s.samples;
}

/* Two replicas that agree, with a self baseline on r1 (which r2's changes leave alone). */
static drift_pool_t *two_agreeing(void)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 40, true);
    add_n(p, "r1", "r1", 30, true);
    add_n(p, "r2", "r2", 10, true);
    cr_assert_eq(verdict(p).kind, DRIFT_CONSISTENT);
    return p;
}

Test(drift_history, a_change_starts_every_window_the_replica_is_in)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r2", 20, true);
    add_n(p, "r1", "r3", 20, false);
    add_n(p, "r2", "r3", 20, false);
    add_n(p, "r3", "r3", 10, true);
    add_n(p, "r1", "r1", 10, true);
    drift_pool_replica_changed(p, "r3", "re-admitted from unreachable", T0);
    cr_assert_eq(pair_samples(p, "r1", "r3"), 0);
    cr_assert_eq(pair_samples(p, "r2", "r3"), 0);
    cr_assert_eq(pair_samples(p, "r3", "r3"), 0); /* its self samples too */
    cr_assert_eq(pair_samples(p, "r1", "r2"), 20);
    cr_assert_eq(pair_samples(p, "r1", "r1"), 10);
    drift_summary_t s;
    drift_pool_summary(p, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, 20); /* the pool-wide window keeps only what did not involve r3 */
    cr_assert_eq(s.diverged, 0);
    cr_assert_eq(s.total_samples, 60); /* lifetime totals stay */
    drift_pool_summary(p, DRIFT_SELF, &s);
    cr_assert_eq(s.samples, 10);
    /* An untracked replica has nothing to start again. */
    drift_pool_replica_changed(p, "r9", "re-admitted from pending", T0);
    cr_assert_eq(pair_samples(p, "r9", "r1"), UINT32_MAX);
    drift_pool_free(p);
}

Test(drift_history, the_replica_that_changed_before_the_divergence_is_the_suspect)
{
    drift_pool_t *p = two_agreeing();
    /* r2 restarts as something else: the proxy sees it leave service and come back. */
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0 + 1234);
    cr_assert_eq(verdict(p).kind, DRIFT_INSUFFICIENT_DATA); /* a new window: nothing yet */
    add(p, "r1", "r2", true);                               /* one prompt happens to agree */
    add_n(p, "r1", "r2", 39, false);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT, "%s", drift_verdict_name(v.kind));
    cr_assert(v.has_suspect);
    cr_assert_str_eq(v.suspect, "r2");
    cr_assert_str_eq(v.reasons[1], "r2 changed just before its pair with r1 began to diverge: "
                                   "re-admitted from unreachable at 2023-11-14T22:13:21.234Z; "
                                   "29 of the pair's first 30 samples after it diverged, and "
                                   "the pair agreed before");
    cr_assert(drift_pool_is_suspect(p, "r2")); /* the quarantine loop's query */
    cr_assert_not(drift_pool_is_suspect(p, "r1"));
    /* The canary, ground truth, still comes first. */
    drift_hint_t pass = {.canary = DRIFT_CANARY_PASS}, fail = {.canary = DRIFT_CANARY_FAIL};
    drift_pool_set_hint(p, "r1", &fail);
    drift_pool_set_hint(p, "r2", &pass);
    cr_assert_str_eq(verdict(p).suspect, "r1");
    drift_pool_free(p);
}

Test(drift_history, a_divergence_that_begins_later_is_not_the_change_s_doing)
{
    /* The change's doing when its first DRIFT_ONSET_SAMPLES samples already diverge 10 points
     * beyond the noise (here 0): 3 of 30 do, 2 of 30 point at something later. */
    for (int before = 27; before <= 28; before++) {
        drift_pool_t *p = two_agreeing();
        drift_pool_replica_changed(p, "r2", "re-admitted from pending", T0);
        add_n(p, "r1", "r2", before, true);
        add_n(p, "r1", "r2", 200, false);
        drift_verdict_t v = verdict(p);
        cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
        cr_assert_eq(v.has_suspect, before == 27, "before=%d: %s", before, v.reasons[1]);
        drift_pool_free(p);
    }
}

Test(drift_history, a_noise_divergence_just_after_a_change_does_not_take_a_later_drift)
{
    /* 5% self noise; r2 restarts fine (one noise divergence among its first 30), and only
     * much later does the pair diverge, with no change: not r2's restart's doing. */
    drift_pool_t *p = drift_pool_new("x");
    for (int i = 0; i < 40; i++) {
        add(p, "r1", "r2", i % 20 != 0);
        add(p, "r1", "r1", i % 20 != 0);
    }
    drift_pool_replica_changed(p, "r2", "re-admitted from pending", T0);
    add(p, "r1", "r2", false);
    add_n(p, "r1", "r2", 99, true);
    add_n(p, "r1", "r2", 100, false);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert_not(v.has_suspect, "%s", v.suspect);
    drift_pool_free(p);
}

Test(drift_history, a_change_made_while_the_pair_already_diverged_is_not_named)
{
    /* r2 serves something else from the start (no change of its own is known); r1 restarts. */
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r1", "r1", 30, true);
    add_n(p, "r1", "r2", 40, false);
    cr_assert_not(verdict(p).has_suspect);
    drift_pool_replica_changed(p, "r1", "re-admitted from pending", T0);
    add_n(p, "r1", "r1", 30, true);
    add_n(p, "r1", "r2", 40, false);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert_not(v.has_suspect, "%s", v.suspect);
    cr_assert(strstr(v.reasons[1], "no restart, re-admission or identity change of one just "
                                   "before their pair began to diverge") != NULL,
              "%s", v.reasons[1]);
    drift_pool_free(p);
}

Test(drift_history, the_first_changer_stays_named_through_the_other_s_restart)
{
    drift_pool_t *p = two_agreeing();
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0);
    add_n(p, "r1", "r2", 5, false);
    /* r1 restarts too, while the pair diverges: the divergence is still r2's. */
    drift_pool_replica_changed(p, "r1", "re-admitted from pending", T0 + 5000);
    add_n(p, "r1", "r1", 30, true);
    add_n(p, "r1", "r2", 40, false);
    cr_assert_str_eq(verdict(p).suspect, "r2");
    /* r2 restarts still broken: still r2's. */
    drift_pool_replica_changed(p, "r2", "re-admitted from quarantined", T0 + 9000);
    add_n(p, "r1", "r2", 40, false);
    cr_assert_str_eq(verdict(p).suspect, "r2");
    drift_pool_free(p);
}

Test(drift_history, two_changes_with_nothing_between_them_name_no_one)
{
    drift_pool_t *p = two_agreeing();
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0);
    drift_pool_replica_changed(p, "r1", "re-admitted from unreachable", T0 + 10);
    add_n(p, "r1", "r1", 30, true);
    add_n(p, "r1", "r2", 40, false);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert_not(v.has_suspect, "%s", v.suspect);
    /* The same replica changing twice stays that replica's. */
    drift_pool_free(p);
    p = two_agreeing();
    drift_pool_replica_changed(p, "r2", "re-admitted from pending", T0);
    drift_pool_replica_changed(p, "r2", "attested identity changed", T0 + 10);
    add_n(p, "r1", "r2", 40, false);
    cr_assert_str_eq(verdict(p).suspect, "r2");
    cr_assert(strstr(verdict(p).reasons[1], "attested identity changed at") != NULL);
    drift_pool_free(p);
}

Test(drift_history, a_change_before_the_pair_was_ever_seen_agreeing_names_no_one)
{
    drift_pool_t *p = drift_pool_new("x");
    add_n(p, "r2", "r2", 5, true); /* r2 is tracked, but its pair with r1 has no samples */
    add_n(p, "r1", "r1", 30, true);
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0);
    add_n(p, "r1", "r2", 40, false);
    cr_assert_not(verdict(p).has_suspect);
    drift_pool_free(p);
}

Test(drift_history, a_fixed_replica_s_verdict_clears)
{
    drift_pool_t *p = two_agreeing();
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0);
    add_n(p, "r1", "r2", 40, false);
    cr_assert_str_eq(verdict(p).suspect, "r2");
    /* Fixed: restarted (or recovered from quarantine) as it should be. */
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0 + 60000);
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_INSUFFICIENT_DATA, "%s", drift_verdict_name(v.kind));
    add_n(p, "r1", "r2", DRIFT_MIN_SAMPLES, true);
    v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CONSISTENT, "%s", v.reasons[0]);
    cr_assert_not(drift_pool_is_suspect(p, "r2"));
    /* Its first DRIFT_ONSET_SAMPLES samples agreed: the stretch it carried is over, and a
     * divergence now (with no change) is nobody's by history. */
    add_n(p, "r1", "r2", 200, false);
    v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert_not(v.has_suspect, "%s", v.suspect);
    drift_pool_free(p);
}

Test(drift_history, noise_below_the_margin_before_the_change_still_counts_as_agreeing)
{
    /* Self noise of 5% on both; the cross pair diverges 5% before r2's change. */
    drift_pool_t *p = drift_pool_new("x");
    for (int i = 0; i < 40; i++) {
        add(p, "r1", "r2", i % 20 != 0);
        add(p, "r1", "r1", i % 20 != 0);
    }
    drift_pool_replica_changed(p, "r2", "re-admitted from pending", T0);
    add_n(p, "r1", "r2", 60, false);
    cr_assert_str_eq(verdict(p).suspect, "r2");
    drift_pool_free(p);
}

Test(drift_history, reset_and_forget_are_no_change)
{
    drift_pool_t *p = two_agreeing();
    drift_pool_reset_replica(p, "r2"); /* evidence dropped, no history */
    add_n(p, "r1", "r2", 40, false);
    cr_assert_not(verdict(p).has_suspect);
    drift_pool_free(p);
    p = two_agreeing();
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0);
    drift_pool_forget_replica(p, "r2");
    add_n(p, "r2", "r2", 10, true); /* a new replica of the same name */
    add_n(p, "r1", "r2", 40, false);
    cr_assert_not(verdict(p).has_suspect);
    drift_pool_free(p);
}

Test(drift_history, clear_forgets_everything)
{
    drift_pool_t *p = two_agreeing();
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0);
    add_n(p, "r1", "r2", 40, false);
    cr_assert_eq(verdict(p).kind, DRIFT_CROSS_REPLICA_DRIFT);
    drift_pool_clear(p);
    cr_assert_str_eq(drift_pool_name(p), "x");
    drift_verdict_t v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_INSUFFICIENT_DATA);
    drift_summary_t s;
    drift_pool_summary(p, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, 0);
    cr_assert_eq(s.total_samples, 0);
    cr_assert_eq(pair_samples(p, "r1", "r2"), UINT32_MAX); /* no replica is tracked */
    /* It works as a new pool: the same divergence, with no change known, names no one. */
    add_n(p, "r1", "r1", 30, true);
    add_n(p, "r1", "r2", 40, false);
    v = verdict(p);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT);
    cr_assert_not(v.has_suspect);
    drift_pool_free(p);
}

Test(drift_history, the_last_change_is_rendered)
{
    drift_pool_t *p = two_agreeing();
    drift_pool_replica_changed(p, "r2", "re-admitted from unreachable", T0);
    dp_buf_t b = {0};
    const drift_pool_t *pools[] = {p};
    drift_render(&b, pools, 1);
    cJSON *doc = cJSON_ParseWithLength(b.base, b.len);
    cr_assert_not_null(doc);
    cJSON *reps = cJSON_GetObjectItem(cJSON_GetObjectItem(cJSON_GetObjectItem(doc, "pools"), "x"),
                                      "replicas");
    cJSON *c = cJSON_GetObjectItem(cJSON_GetObjectItem(reps, "r2"), "last_change");
    cr_assert_str_eq(cJSON_GetObjectItem(c, "what")->valuestring, "re-admitted from unreachable");
    cr_assert_str_eq(cJSON_GetObjectItem(c, "at")->valuestring, "2023-11-14T22:13:20.000Z");
    cr_assert(cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetObjectItem(reps, "r1"), "last_change")));
    cJSON_Delete(doc);
    dp_buf_free(&b);
    drift_pool_free(p);
}
