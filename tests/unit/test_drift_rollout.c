/* Rollout statistics (docs/rollouts.md §3): candidate samples judged against the baseline's own
 * cross and self noise, per candidate and per tenant, and the /admin/rollouts rendering. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "drift/rollout.h"

static drift_result_t res(bool match, int64_t offset, double sim)
{
    drift_result_t r = {0};
    r.match = match;
    r.divergence_offset = match ? -1 : offset;
    r.similarity = match ? 1.0 : sim;
    return r;
}

/* n samples for tenant t, diverged at div_rate spread evenly; diverged ones at offset off. */
static void add_n(drift_rollout_t *r, const char *t, int n, double div_rate, int64_t off)
{
    double acc = 0;
    for (int i = 0; i < n; i++) {
        acc += div_rate;
        bool diverge = acc >= 1.0 - 1e-9;
        if (diverge)
            acc -= 1.0;
        char id[32];
        snprintf(id, sizeof(id), "req-%s-%d", t ? t : "x", i);
        drift_result_t s = res(!diverge, off, 0.4);
        drift_rollout_add(r, t, id, &s);
    }
}

/* A baseline window summary with n samples of which d diverged. */
static drift_summary_t base(uint32_t n, uint32_t d)
{
    drift_summary_t s = {0};
    s.samples = n;
    s.diverged = d;
    s.divergence_rate = n ? (double)d / n : NAN;
    s.exact_match_rate = n ? 1.0 - s.divergence_rate : NAN;
    s.median_divergence_offset = -1;
    return s;
}

static bool has_reason(const drift_rollout_verdict_t *v, const char *needle)
{
    for (int i = 0; i < v->nreasons; i++)
        if (strstr(v->reasons[i], needle))
            return true;
    return false;
}

static void dump(const drift_rollout_verdict_t *v)
{
    for (int i = 0; i < v->nreasons; i++)
        fprintf(stderr, "  reason: %s\n", v->reasons[i]);
}

Test(rollout, kind_names)
{
    cr_assert_str_eq(drift_rollout_kind_name(ROLLOUT_EQUIVALENT), "equivalent");
    cr_assert_str_eq(drift_rollout_kind_name(ROLLOUT_DIVERGES), "diverges");
    cr_assert_str_eq(drift_rollout_kind_name(ROLLOUT_INSUFFICIENT_DATA), "insufficient_data");
}

Test(rollout, equivalent_when_matching_and_the_baseline_is_quiet)
{
    drift_rollout_t *r = drift_rollout_new("llama", "llama-next");
    add_n(r, "t1", 40, 0.0, 0);
    drift_summary_t cross = base(40, 0), self = base(40, 0);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, NULL, &cross, &self, &v);
    dump(&v);
    cr_assert_eq(v.kind, ROLLOUT_EQUIVALENT);
    cr_assert_eq(v.candidate.samples, 40);
    cr_assert_float_eq(v.candidate.exact_match_rate, 1.0, 1e-12);
    cr_assert_float_eq(v.candidate.mean_similarity, 1.0, 1e-6);
    cr_assert_eq(v.candidate.median_divergence_offset, -1);
    cr_assert(has_reason(&v, "within the noise"));
    drift_rollout_free(r);
}

Test(rollout, diverges_beyond_noise_with_offset_and_examples)
{
    drift_rollout_t *r = drift_rollout_new("llama", "llama-q8");
    add_n(r, "t1", 40, 0.5, 57);
    drift_summary_t cross = base(50, 1), self = base(50, 0);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, NULL, &cross, &self, &v);
    dump(&v);
    cr_assert_eq(v.kind, ROLLOUT_DIVERGES);
    cr_assert_str_eq(v.noise_source, "cross", "the larger of the two baseline rates");
    cr_assert_float_eq(v.noise_rate, 0.02, 1e-12);
    cr_assert_float_eq(v.excess, 0.48, 1e-9);
    cr_assert_eq(v.candidate.median_divergence_offset, 57);
    cr_assert(has_reason(&v, "50.0% of samples (n=40)"));
    cr_assert(has_reason(&v, "48.0 points beyond the noise"));
    cr_assert(has_reason(&v, "median divergence offset 57 bytes"));
    drift_rollout_free(r);
}

/* Batching noise in the baseline: a candidate that diverges as much as the baseline's replicas
 * do from themselves is not a regression. */
Test(rollout, noisy_baseline_absorbs_the_same_divergence)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    add_n(r, NULL, 60, 0.3, 10);
    drift_summary_t cross = base(10, 0) /* too few: ignored */, self = base(60, 18);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, NULL, &cross, &self, &v);
    dump(&v);
    cr_assert_eq(v.kind, ROLLOUT_EQUIVALENT);
    cr_assert_str_eq(v.noise_source, "self");
    cr_assert_eq(v.noise_samples, 60);
    drift_rollout_free(r);
}

/* The margins: 8 points above a quiet baseline stays below DRIFT_MARGIN_ABS. */
/* Neither window holds DRIFT_MIN_SAMPLES alone, both together do: their pooled rate. */
Test(rollout, pooled_noise_when_each_window_is_short)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    add_n(r, NULL, 40, 1.0, 3);
    drift_summary_t cross = base(15, 1), self = base(25, 1);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, NULL, &cross, &self, &v);
    dump(&v);
    cr_assert_eq(v.kind, ROLLOUT_DIVERGES);
    cr_assert_str_eq(v.noise_source, "cross+self");
    cr_assert_eq(v.noise_samples, 40);
    cr_assert_float_eq(v.noise_rate, 0.05, 1e-12);
    drift_rollout_free(r);
}

Test(rollout, small_excess_is_not_reported)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    add_n(r, NULL, 200, 0.08, 10);
    drift_summary_t cross = base(200, 0), self = base(200, 0);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, NULL, &cross, &self, &v);
    cr_assert_eq(v.kind, ROLLOUT_EQUIVALENT);
    drift_rollout_free(r);
}

Test(rollout, insufficient_candidate_samples_say_how_many)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    add_n(r, NULL, 12, 1.0, 3);
    drift_summary_t cross = base(40, 0), self = base(40, 0);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, NULL, &cross, &self, &v);
    dump(&v);
    cr_assert_eq(v.kind, ROLLOUT_INSUFFICIENT_DATA, "12 diverged samples are not yet evidence");
    cr_assert(has_reason(&v, "12 candidate samples in the window, need 30"));
    drift_rollout_free(r);
}

Test(rollout, insufficient_baseline_noise_names_the_shadow_keys)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    add_n(r, NULL, 50, 1.0, 3);
    drift_summary_t cross = base(5, 0), self = base(24, 0);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, NULL, &cross, &self, &v);
    dump(&v);
    cr_assert_eq(v.kind, ROLLOUT_INSUFFICIENT_DATA);
    cr_assert(has_reason(&v, "5 cross and 24 self shadow samples"));
    cr_assert(has_reason(&v, "shadow.self_rate"));
    cr_assert_null(v.noise_source);
    cr_assert(isnan(v.excess));
    /* No baseline windows at all (NULL) reads as empty ones. */
    drift_rollout_verdict(r, NULL, NULL, NULL, &v);
    cr_assert_eq(v.kind, ROLLOUT_INSUFFICIENT_DATA);
    cr_assert(has_reason(&v, "0 cross and 0 self"));
    drift_rollout_free(r);
}

Test(rollout, misses_explain_missing_samples)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    drift_rollout_miss(r, ROLLOUT_SKIPPED, "pool c has no admitted replica");
    drift_rollout_miss(r, ROLLOUT_SKIPPED, "pool c has no admitted replica");
    drift_rollout_miss(r, ROLLOUT_ERROR, NULL);
    drift_rollout_miss(r, (drift_rollout_outcome_t)99, "ignored");
    drift_summary_t cross = base(40, 0);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, NULL, &cross, NULL, &v);
    dump(&v);
    cr_assert_eq(v.kind, ROLLOUT_INSUFFICIENT_DATA);
    cr_assert(has_reason(&v, "0 candidate samples"));
    cr_assert(has_reason(&v, "2 candidate copies skipped (last: pool c has no admitted replica)"));
    cr_assert(has_reason(&v, "1 candidate copies error"));
    drift_rollout_free(r);
}

Test(rollout, per_tenant_verdicts_are_apart)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    add_n(r, "clean", 40, 0.0, 0);
    add_n(r, "hit", 40, 1.0, 9);
    drift_summary_t cross = base(40, 0), self = base(40, 0);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(r, "clean", &cross, &self, &v);
    cr_assert_eq(v.kind, ROLLOUT_EQUIVALENT);
    drift_rollout_verdict(r, "hit", &cross, &self, &v);
    cr_assert_eq(v.kind, ROLLOUT_DIVERGES);
    drift_rollout_verdict(r, NULL, &cross, &self, &v);
    cr_assert_eq(v.kind, ROLLOUT_DIVERGES, "half the samples diverge overall");
    cr_assert_eq(v.candidate.samples, 80);
    drift_summary_t s;
    cr_assert_eq(drift_rollout_summary(r, "nobody", &s), -ENOENT);
    cr_assert_eq(s.samples, 0);
    drift_rollout_verdict(r, "nobody", &cross, &self, &v);
    cr_assert_eq(v.kind, ROLLOUT_INSUFFICIENT_DATA);
    drift_rollout_free(r);
}

Test(rollout, tenants_beyond_the_cap_count_overall)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    char name[16];
    for (int i = 0; i < ROLLOUT_MAX_TENANTS + 5; i++) {
        snprintf(name, sizeof(name), "t%d", i);
        add_n(r, name, 1, 0.0, 0);
    }
    drift_summary_t s;
    cr_assert_eq(drift_rollout_summary(r, NULL, &s), 0);
    cr_assert_eq(s.samples, ROLLOUT_MAX_TENANTS + 5);
    snprintf(name, sizeof(name), "t%d", ROLLOUT_MAX_TENANTS);
    cr_assert_eq(drift_rollout_summary(r, name, &s), -ENOENT);
    drift_rollout_free(r);
}

Test(rollout, window_slides)
{
    drift_rollout_t *r = drift_rollout_new("p", "c");
    add_n(r, NULL, DRIFT_WINDOW, 1.0, 5); /* an old regression, since fixed */
    add_n(r, NULL, DRIFT_WINDOW, 0.0, 0);
    drift_summary_t s;
    drift_rollout_summary(r, NULL, &s);
    cr_assert_eq(s.samples, DRIFT_WINDOW);
    cr_assert_eq(s.diverged, 0);
    cr_assert_eq(s.total_samples, 2 * DRIFT_WINDOW);
    drift_rollout_free(r);
}

Test(rollout, render_json)
{
    drift_rollout_t *r = drift_rollout_new("llama", "llama-next");
    add_n(r, "t1", 35, 1.0, 21);
    for (int i = 0; i < 3; i++)
        drift_rollout_miss(r, ROLLOUT_NOT_COMPARABLE, "temperature 0.7 without a seed");
    drift_summary_t cross = base(0, 0), self = base(40, 0);
    dp_buf_t out = {0};
    dp_jw_t w;
    dp_jw_init(&w, &out);
    drift_rollout_render(&w, NULL, r, 0.05, &cross, &self);
    cJSON *j = cJSON_ParseWithLength(out.base, out.len);
    cr_assert_not_null(j, "%.*s", (int)out.len, out.base);
    cr_assert_str_eq(cJSON_GetObjectItem(j, "pool")->valuestring, "llama");
    cr_assert_str_eq(cJSON_GetObjectItem(j, "candidate")->valuestring, "llama-next");
    cr_assert_float_eq(cJSON_GetObjectItem(j, "rate")->valuedouble, 0.05, 1e-12);
    cr_assert_str_eq(cJSON_GetObjectItem(j, "verdict")->valuestring, "diverges");
    cr_assert_eq(cJSON_GetObjectItem(j, "samples")->valueint, 35);
    cr_assert_eq(cJSON_GetObjectItem(j, "median_divergence_offset")->valueint, 21);
    cr_assert_float_eq(cJSON_GetObjectItem(j, "exact_match_rate")->valuedouble, 0.0, 1e-12);
    cr_assert_float_eq(cJSON_GetObjectItem(j, "excess_divergence")->valuedouble, 1.0, 1e-12);
    const cJSON *ex = cJSON_GetObjectItem(j, "example_request_ids");
    cr_assert_eq(cJSON_GetArraySize(ex), ROLLOUT_EXAMPLES);
    cr_assert_str_eq(cJSON_GetArrayItem(ex, 0)->valuestring, "req-t1-34", "newest first");
    const cJSON *noise = cJSON_GetObjectItem(j, "baseline_noise");
    cr_assert_str_eq(cJSON_GetObjectItem(noise, "source")->valuestring, "self");
    cr_assert_eq(cJSON_GetObjectItem(cJSON_GetObjectItem(noise, "cross"), "samples")->valueint, 0);
    cr_assert(
        cJSON_IsNull(cJSON_GetObjectItem(cJSON_GetObjectItem(noise, "cross"), "divergence_rate")));
    const cJSON *miss = cJSON_GetObjectItem(j, "copies_without_sample");
    cr_assert_eq(cJSON_GetObjectItem(miss, "not_comparable")->valueint, 3);
    const cJSON *t1 = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "tenants"), "t1");
    cr_assert_str_eq(cJSON_GetObjectItem(t1, "verdict")->valuestring, "diverges");
    cr_assert_eq(cJSON_GetObjectItem(t1, "samples")->valueint, 35);
    cJSON_Delete(j);
    dp_buf_free(&out);
    drift_rollout_free(r);
}

/* ---- pooled statistics (a fleet's members) ------------------------------------------------ */

static char *export_of(const drift_rollout_t *r)
{
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    drift_rollout_export(r, &w, NULL);
    return dp_buf_steal(&b);
}

Test(rollout, exports_of_two_members_sum_to_the_fleet_window)
{
    drift_rollout_t *a = drift_rollout_new("p", "next"), *b = drift_rollout_new("p", "next");
    add_n(a, "t1", 20, 0.5, 12);
    add_n(b, NULL, 20, 0.25, 12);
    drift_rollout_miss(a, ROLLOUT_ERROR, "timeout");
    drift_rollout_miss(b, ROLLOUT_ERROR, "reset");
    drift_rollout_miss(b, ROLLOUT_SKIPPED, NULL);
    drift_rollout_t *fleet = drift_rollout_new("p", "next");
    char *ea = export_of(a), *eb = export_of(b);
    cJSON *ja = cJSON_Parse(ea), *jb = cJSON_Parse(eb);
    cr_assert_eq(drift_rollout_import(fleet, ja), 0, "%s", ea);
    cr_assert_eq(drift_rollout_import(fleet, jb), 0, "%s", eb);
    drift_summary_t s;
    drift_rollout_summary(fleet, NULL, &s);
    cr_assert_eq(s.samples, 40);
    cr_assert_eq(s.diverged, 15); /* 10 + 5 */
    cr_assert_eq(s.median_divergence_offset, 12);
    cr_assert_float_eq(s.mean_similarity, (25 + 15 * 0.4) / 40.0, 1e-6);
    /* 40 samples: a verdict, where each member alone (20) has none. */
    drift_summary_t quiet = base(100, 0);
    drift_rollout_verdict_t v;
    drift_rollout_verdict(a, NULL, &quiet, &quiet, &v);
    cr_assert_eq(v.kind, ROLLOUT_INSUFFICIENT_DATA);
    drift_rollout_verdict(fleet, NULL, &quiet, &quiet, &v);
    cr_assert_eq(v.kind, ROLLOUT_DIVERGES);
    /* Copy counts add up; tenants are not pooled. */
    char *ef = export_of(fleet);
    cr_assert(strstr(ef, ",1,2,0]") != NULL, "%s", ef);
    cr_assert_eq(drift_rollout_summary(fleet, "t1", &s), -ENOENT);
    cJSON_Delete(ja);
    cJSON_Delete(jb);
    free(ea);
    free(eb);
    free(ef);
    drift_rollout_free(a);
    drift_rollout_free(b);
    drift_rollout_free(fleet);
}

Test(rollout, malformed_exports_are_refused_and_change_nothing)
{
    static const char *const bad[] = {
        "{}",
        "[1,0,1,-1,0,0]",         /* too short */
        "[2,3,2,-1,0,0,0]",       /* more diverged than samples */
        "[1001,0,1001,-1,0,0,0]", /* more than a window */
        "[-1,0,0,-1,0,0,0]",      /* negative */
        "[1,0,1,-1,\"x\",0,0]",   /* not a number */
        "[1,0,1,-1,0,0,1e300]",   /* absurd count */
    };
    drift_rollout_t *r = drift_rollout_new("p", "next");
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cJSON *j = cJSON_Parse(bad[i]);
        cr_assert_eq(drift_rollout_import(r, j), -EINVAL, "%s", bad[i]);
        cJSON_Delete(j);
    }
    drift_summary_t s;
    drift_rollout_summary(r, NULL, &s);
    cr_assert_eq(s.samples, 0);
    char *e = export_of(r);
    cr_assert_str_eq(e, "[0,0,0,-1,0,0,0]");
    free(e);
    drift_rollout_free(r);
}
