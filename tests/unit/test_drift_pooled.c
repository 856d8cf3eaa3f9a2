/* Pooled drift statistics (a fleet's members, docs/fleet.md): a pool's export imported into a
 * fresh pool gives the same windows, two members' exports sum, and the summed windows reach a
 * verdict neither member's alone does; malformed exports are refused. */
#include <cjson/cJSON.h>
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <string.h>

#include "common/buf.h"
#include "common/jw.h"
#include "drift/drift.h"

static void add_n(drift_pool_t *p, const char *a, const char *b, int n, int every_diverged)
{
    for (int i = 0; i < n; i++) {
        bool div = every_diverged && i % every_diverged == 0;
        drift_result_t r = {
            .match = !div, .divergence_offset = div ? 40 : -1, .similarity = div ? 0.5 : 1.0};
        cr_assert_eq(drift_pool_add(p, a, b, &r), 0);
    }
}

/* A member's export, parsed. */
static cJSON *exported(const drift_pool_t *p)
{
    dp_buf_t b = {0};
    dp_jw_t w;
    dp_jw_init(&w, &b);
    drift_pool_export(p, &w, NULL);
    cJSON *d = cJSON_ParseWithLength(b.base, b.len);
    dp_buf_free(&b);
    cr_assert(cJSON_IsArray(d));
    return d;
}

/* Three replicas, r3 drifting: n cross samples per pair, n self samples per replica. */
static void member(drift_pool_t *p, int n)
{
    add_n(p, "r1", "r2", n, 0);
    add_n(p, "r1", "r3", n, 2);
    add_n(p, "r2", "r3", n, 2);
    add_n(p, "r1", "r1", n, 0);
    add_n(p, "r2", "r2", n, 0);
    add_n(p, "r3", "r3", n, 0);
}

Test(drift_pooled, export_import_keeps_the_windows)
{
    drift_pool_t *a = drift_pool_new("p"), *f = drift_pool_new("p");
    member(a, 20);
    cJSON *e = exported(a);
    cr_assert_eq(drift_pool_import(f, e), 0);
    drift_summary_t sa, sf;
    const char *pairs[][2] = {{"r1", "r2"}, {"r1", "r3"}, {"r2", "r3"}, {"r3", "r3"}};
    for (size_t i = 0; i < 4; i++) {
        cr_assert_eq(drift_pool_pair_summary(a, pairs[i][0], pairs[i][1], &sa), 0);
        cr_assert_eq(drift_pool_pair_summary(f, pairs[i][0], pairs[i][1], &sf), 0);
        cr_assert_eq(sa.samples, sf.samples);
        cr_assert_eq(sa.diverged, sf.diverged);
        cr_assert_float_eq(sa.mean_similarity, sf.mean_similarity, 1e-6);
        cr_assert_eq(sa.median_divergence_offset, sf.median_divergence_offset);
    }
    drift_pool_summary(a, DRIFT_CROSS, &sa);
    drift_pool_summary(f, DRIFT_CROSS, &sf);
    cr_assert_eq(sa.samples, sf.samples);
    cr_assert_eq(sa.diverged, sf.diverged);
    cJSON_Delete(e);
    drift_pool_free(a);
    drift_pool_free(f);
}

Test(drift_pooled, two_members_sum_to_a_verdict_neither_has_alone)
{
    drift_pool_t *a = drift_pool_new("p"), *b = drift_pool_new("p"), *f = drift_pool_new("p");
    member(a, 8); /* 24 cross samples: too few for a verdict */
    member(b, 8);
    drift_verdict_t v;
    drift_pool_verdict(a, &v);
    cr_assert(
        !(v.kind == DRIFT_CROSS_REPLICA_DRIFT && v.has_suspect && strcmp(v.suspect, "r3") == 0));
    cJSON *ea = exported(a), *eb = exported(b);
    cr_assert_eq(drift_pool_import(f, ea), 0);
    cr_assert_eq(drift_pool_import(f, eb), 0);
    drift_summary_t s;
    drift_pool_summary(f, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, 48);
    drift_pool_verdict(f, &v);
    cr_assert_eq(v.kind, DRIFT_CROSS_REPLICA_DRIFT, "%s", v.reasons[0]);
    cr_assert_str_eq(v.suspect, "r3");
    cJSON_Delete(ea);
    cJSON_Delete(eb);
    drift_pool_free(a);
    drift_pool_free(b);
    drift_pool_free(f);
}

Test(drift_pooled, malformed_exports_are_refused)
{
    drift_pool_t *f = drift_pool_new("p");
    const char *bad[] = {"{}",
                         "[[\"a\",\"b\",3,4,1,0]]",
                         "[[\"a\",\"b\",-1,0,0,0]]",
                         "[[\"a\",\"b\",2000,0,0,0]]",
                         "[[\"a\",2,1,0,1,0]]",
                         "[[\"\",\"b\",1,0,1,0]]",
                         "[[\"a\",\"b\",1,0]]"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        cJSON *d = cJSON_Parse(bad[i]);
        cr_assert_eq(drift_pool_import(f, d), -EINVAL, "%s", bad[i]);
        cJSON_Delete(d);
    }
    drift_summary_t s;
    drift_pool_summary(f, DRIFT_CROSS, &s);
    cr_assert_eq(s.samples, 0);
    drift_pool_free(f);
}
