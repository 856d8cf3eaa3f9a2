/* Rollout statistics: candidate samples per candidate and per tenant, judged against the
 * baseline's noise (rollout.h). Tenants live in a small array scanned linearly: a policy has
 * tens of tenants, and the scan runs once per sample, not per request. */
#include "drift/rollout.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "drift/window.h"

/* One set of samples with the most recent diverged request ids. */
typedef struct {
    drift_win_t win;
    char examples[ROLLOUT_EXAMPLES][ROLLOUT_ID_MAX];
    uint32_t nexamples, next; /* next: the slot the next example overwrites */
} series_t;

typedef struct {
    char *name;
    series_t s;
} tenant_t;

struct drift_rollout {
    char *pool;
    char *candidate;
    series_t all;
    tenant_t tenants[ROLLOUT_MAX_TENANTS];
    size_t ntenants;
    drift_rollout_misses_t misses;
};

static const char *const outcome_names[ROLLOUT__NOUTCOMES] = {"skipped", "error", "not_comparable"};

const char *drift_rollout_kind_name(drift_rollout_kind_t k)
{
    switch (k) {
    case ROLLOUT_EQUIVALENT:
        return "equivalent";
    case ROLLOUT_DIVERGES:
        return "diverges";
    case ROLLOUT_INSUFFICIENT_DATA:
        break;
    }
    return "insufficient_data";
}

/* ---- the verdict ------------------------------------------------------------------------- */

/* A reason line for the verdict (window.h). */
#define reason(v, ...) drift_win_reason((v)->reasons, &(v)->nreasons, __VA_ARGS__)

/* The baseline's noise: the larger divergence rate of its cross and self windows that hold
 * DRIFT_MIN_SAMPLES. The larger, because an equivalent candidate differs from the baseline at
 * least as its replicas differ from each other (cross) and from themselves (self); the smaller
 * would call batching noise a regression. When neither holds enough alone but both together
 * do, their pooled rate: both measure the baseline disagreeing with itself. */
static void pick_noise(const drift_summary_t *cross, const drift_summary_t *self,
                       drift_rollout_verdict_t *v)
{
    uint32_t nc = cross ? cross->samples : 0, ns = self ? self->samples : 0;
    bool cross_ok = nc >= DRIFT_MIN_SAMPLES, self_ok = ns >= DRIFT_MIN_SAMPLES;
    v->noise_rate = NAN;
    v->noise_samples = 0;
    v->noise_source = NULL;
    if (cross_ok && (!self_ok || cross->divergence_rate >= self->divergence_rate)) {
        v->noise_rate = cross->divergence_rate;
        v->noise_samples = nc;
        v->noise_source = "cross";
    } else if (self_ok) {
        v->noise_rate = self->divergence_rate;
        v->noise_samples = ns;
        v->noise_source = "self";
    } else if (nc + ns >= DRIFT_MIN_SAMPLES) {
        v->noise_rate = (double)(cross->diverged + self->diverged) / (nc + ns);
        v->noise_samples = nc + ns;
        v->noise_source = "cross+self";
    }
}

void drift_rollout_judge(const drift_summary_t *candidate, const drift_summary_t *cross,
                         const drift_summary_t *self, const drift_rollout_misses_t *misses,
                         drift_rollout_verdict_t *v)
{
    memset(v, 0, sizeof(*v));
    v->candidate = *candidate;
    pick_noise(cross, self, v);
    const drift_summary_t *c = candidate;
    bool cand_ok = c->samples >= DRIFT_MIN_SAMPLES;
    v->excess = c->samples && v->noise_source ? c->divergence_rate - v->noise_rate : NAN;
    if (!cand_ok || v->noise_source == NULL) {
        v->kind = ROLLOUT_INSUFFICIENT_DATA;
        if (!cand_ok)
            reason(v, "%u candidate samples in the window, need %d", c->samples, DRIFT_MIN_SAMPLES);
        if (v->noise_source == NULL)
            reason(v,
                   "baseline noise unknown: %u cross and %u self shadow samples in the "
                   "baseline pool, need %d (shadow.rate, shadow.self_rate)",
                   cross ? cross->samples : 0, self ? self->samples : 0, DRIFT_MIN_SAMPLES);
        for (int o = 0; misses && o < ROLLOUT__NOUTCOMES; o++) {
            if (misses->n[o] == 0)
                continue;
            if (misses->last[o][0])
                reason(v, "%llu candidate copies %s (last: %s)", (unsigned long long)misses->n[o],
                       outcome_names[o], misses->last[o]);
            else
                reason(v, "%llu candidate copies %s", (unsigned long long)misses->n[o],
                       outcome_names[o]);
        }
        return;
    }
    if (drift_rate_exceeds(c->divergence_rate, c->samples, v->noise_rate, v->noise_samples)) {
        v->kind = ROLLOUT_DIVERGES;
        reason(v,
               "candidate diverges from the baseline in %.1f%% of samples (n=%u); the "
               "baseline's own %s pairs diverge %.1f%% (n=%u): %.1f points beyond the noise",
               drift_win_pct(c->divergence_rate), c->samples, v->noise_source,
               drift_win_pct(v->noise_rate), v->noise_samples, drift_win_pct(v->excess));
        if (c->median_divergence_offset >= 0)
            reason(v, "median divergence offset %lld bytes, mean similarity %.3f",
                   (long long)c->median_divergence_offset, c->mean_similarity);
        return;
    }
    v->kind = ROLLOUT_EQUIVALENT;
    reason(v,
           "candidate diverges from the baseline in %.1f%% of samples (n=%u); the baseline's "
           "own %s pairs diverge %.1f%% (n=%u): within the noise",
           drift_win_pct(c->divergence_rate), c->samples, v->noise_source,
           drift_win_pct(v->noise_rate), v->noise_samples);
}

/* ---- samples ----------------------------------------------------------------------------- */

drift_rollout_t *drift_rollout_new(const char *pool, const char *candidate)
{
    drift_rollout_t *r = dp_xcalloc(1, sizeof(*r));
    r->pool = dp_xstrdup(pool);
    r->candidate = dp_xstrdup(candidate);
    return r;
}

void drift_rollout_free(drift_rollout_t *r)
{
    if (r == NULL)
        return;
    drift_win_free(&r->all.win);
    for (size_t i = 0; i < r->ntenants; i++) {
        free(r->tenants[i].name);
        drift_win_free(&r->tenants[i].s.win);
    }
    free(r->pool);
    free(r->candidate);
    free(r);
}

const char *drift_rollout_pool(const drift_rollout_t *r)
{
    return r->pool;
}

const char *drift_rollout_candidate(const drift_rollout_t *r)
{
    return r->candidate;
}

static series_t *tenant_series(drift_rollout_t *r, const char *tenant, bool create)
{
    for (size_t i = 0; i < r->ntenants; i++)
        if (strcmp(r->tenants[i].name, tenant) == 0)
            return &r->tenants[i].s;
    if (!create || r->ntenants >= ROLLOUT_MAX_TENANTS)
        return NULL;
    tenant_t *t = &r->tenants[r->ntenants++];
    t->name = dp_xstrdup(tenant);
    return &t->s;
}

static void series_add(series_t *s, const char *request_id, const drift_result_t *res)
{
    drift_win_push(&s->win, drift_win_rec_of(res));
    if (res->match || request_id == NULL || request_id[0] == '\0')
        return;
    snprintf(s->examples[s->next], ROLLOUT_ID_MAX, "%s", request_id);
    s->next = (s->next + 1) % ROLLOUT_EXAMPLES;
    if (s->nexamples < ROLLOUT_EXAMPLES)
        s->nexamples++;
}

void drift_rollout_add(drift_rollout_t *r, const char *tenant, const char *request_id,
                       const drift_result_t *res)
{
    series_add(&r->all, request_id, res);
    series_t *t = tenant && tenant[0] ? tenant_series(r, tenant, true) : NULL;
    if (t)
        series_add(t, request_id, res);
}

void drift_rollout_miss(drift_rollout_t *r, drift_rollout_outcome_t o, const char *why)
{
    if (o < 0 || o >= ROLLOUT__NOUTCOMES)
        return;
    r->misses.n[o]++;
    snprintf(r->misses.last[o], sizeof(r->misses.last[o]), "%s", why ? why : "");
}

int drift_rollout_summary(const drift_rollout_t *r, const char *tenant, drift_summary_t *out)
{
    const series_t *s = tenant ? tenant_series((drift_rollout_t *)r, tenant, false) : &r->all;
    if (s == NULL) {
        drift_win_summary(&(drift_win_t){0}, out);
        return -ENOENT;
    }
    drift_win_summary(&s->win, out);
    return 0;
}

void drift_rollout_verdict(const drift_rollout_t *r, const char *tenant,
                           const drift_summary_t *cross, const drift_summary_t *self,
                           drift_rollout_verdict_t *v)
{
    drift_summary_t s;
    drift_rollout_summary(r, tenant, &s);
    drift_rollout_judge(&s, cross, self, tenant ? NULL : &r->misses, v);
}

/* ---- rendering ---------------------------------------------------------------------------- */

static void render_series(dp_jw_t *w, const series_t *s, const drift_summary_t *cross,
                          const drift_summary_t *self, const drift_rollout_misses_t *misses)
{
    drift_summary_t sum;
    drift_win_summary(&s->win, &sum);
    drift_rollout_verdict_t v;
    drift_rollout_judge(&sum, cross, self, misses, &v);
    dp_jw_str(w, "verdict", drift_rollout_kind_name(v.kind));
    dp_jw_uint(w, "samples", sum.samples);
    dp_jw_uint(w, "diverged", sum.diverged);
    dp_jw_double(w, "exact_match_rate", sum.exact_match_rate);
    dp_jw_double(w, "mean_similarity", sum.mean_similarity);
    if (sum.median_divergence_offset >= 0)
        dp_jw_int(w, "median_divergence_offset", sum.median_divergence_offset);
    else
        dp_jw_null(w, "median_divergence_offset");
    dp_jw_uint(w, "samples_total", sum.total_samples);
    dp_jw_double(w, "excess_divergence", v.excess);
    dp_jw_arr_begin(w, "reasons");
    for (int i = 0; i < v.nreasons; i++)
        dp_jw_str(w, NULL, v.reasons[i]);
    dp_jw_arr_end(w);
    dp_jw_arr_begin(w, "example_request_ids"); /* newest first */
    for (uint32_t k = 1; k <= s->nexamples; k++)
        dp_jw_str(w, NULL, s->examples[(s->next + ROLLOUT_EXAMPLES - k) % ROLLOUT_EXAMPLES]);
    dp_jw_arr_end(w);
}

static void render_noise(dp_jw_t *w, const drift_summary_t *cross, const drift_summary_t *self)
{
    drift_rollout_verdict_t v;
    pick_noise(cross, self, &v);
    dp_jw_obj_begin(w, "baseline_noise");
    const drift_summary_t *k[2] = {cross, self};
    for (int i = 0; i < 2; i++) {
        dp_jw_obj_begin(w, i ? "self" : "cross");
        dp_jw_uint(w, "samples", k[i] ? k[i]->samples : 0);
        dp_jw_double(w, "divergence_rate", k[i] ? k[i]->divergence_rate : NAN);
        dp_jw_obj_end(w);
    }
    dp_jw_str(w, "source", v.noise_source);
    dp_jw_double(w, "divergence_rate", v.noise_rate);
    dp_jw_uint(w, "samples", v.noise_samples);
    dp_jw_obj_end(w);
}

void drift_rollout_render(dp_jw_t *w, const char *key, const drift_rollout_t *r, double rate,
                          const drift_summary_t *cross, const drift_summary_t *self)
{
    dp_jw_obj_begin(w, key);
    dp_jw_str(w, "pool", r->pool);
    dp_jw_str(w, "candidate", r->candidate);
    dp_jw_double(w, "rate", rate);
    render_series(w, &r->all, cross, self, &r->misses);
    render_noise(w, cross, self);
    dp_jw_obj_begin(w, "copies_without_sample");
    for (int o = 0; o < ROLLOUT__NOUTCOMES; o++)
        dp_jw_uint(w, outcome_names[o], r->misses.n[o]);
    /* Why the last copy of each kind became no sample: an operator's first question. */
    dp_jw_obj_begin(w, "last_reason");
    for (int o = 0; o < ROLLOUT__NOUTCOMES; o++)
        if (r->misses.n[o])
            dp_jw_str(w, outcome_names[o], r->misses.last[o]);
    dp_jw_obj_end(w);
    dp_jw_obj_end(w);
    dp_jw_obj_begin(w, "tenants");
    for (size_t i = 0; i < r->ntenants; i++) {
        dp_jw_obj_begin(w, r->tenants[i].name);
        render_series(w, &r->tenants[i].s, cross, self, NULL);
        dp_jw_obj_end(w);
    }
    dp_jw_obj_end(w);
    dp_jw_obj_end(w);
}

/* ---- pooled statistics -------------------------------------------------------------------- */

void drift_rollout_export(const drift_rollout_t *r, dp_jw_t *w, const char *key)
{
    drift_summary_t s;
    drift_win_summary(&r->all.win, &s);
    dp_jw_arr_begin(w, key);
    dp_jw_uint(w, NULL, r->all.win.count);
    dp_jw_uint(w, NULL, r->all.win.diverged);
    dp_jw_double(w, NULL, r->all.win.sim_sum);
    dp_jw_int(w, NULL, s.median_divergence_offset);
    for (int o = 0; o < ROLLOUT__NOUTCOMES; o++)
        dp_jw_uint(w, NULL, r->misses.n[o]);
    dp_jw_arr_end(w);
}

int drift_rollout_import(drift_rollout_t *r, const cJSON *a)
{
    const cJSON *v[4 + ROLLOUT__NOUTCOMES];
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != 4 + ROLLOUT__NOUTCOMES)
        return -EINVAL;
    for (int i = 0; i < 4 + ROLLOUT__NOUTCOMES; i++) {
        v[i] = cJSON_GetArrayItem(a, i);
        if (!cJSON_IsNumber(v[i]) || (i != 3 && v[i]->valuedouble < 0) || v[i]->valuedouble > 1e15)
            return -EINVAL;
    }
    double n = v[0]->valuedouble, d = v[1]->valuedouble;
    if (n > DRIFT_WINDOW || d > n)
        return -EINVAL;
    uint32_t nn = (uint32_t)n, dd = (uint32_t)d;
    /* Matches have similarity 1; the diverged ones share the rest of the sum. */
    double dsim = dd ? (v[2]->valuedouble - (double)(nn - dd)) / dd : 1.0;
    dsim = dsim < 0 ? 0 : dsim > 1 ? 1 : dsim;
    int64_t off = v[3]->valuedouble < 0 ? 0 : (int64_t)v[3]->valuedouble;
    for (uint32_t k = 0; k < nn; k++) {
        /* The diverged samples spread evenly among the matches. */
        bool div = (uint64_t)(k + 1) * dd / nn > (uint64_t)k * dd / nn;
        drift_result_t res = {
            .match = !div, .divergence_offset = div ? off : -1, .similarity = div ? dsim : 1.0};
        drift_win_push(&r->all.win, drift_win_rec_of(&res));
    }
    for (int o = 0; o < ROLLOUT__NOUTCOMES; o++)
        r->misses.n[o] += (uint64_t)v[4 + o]->valuedouble;
    return 0;
}
