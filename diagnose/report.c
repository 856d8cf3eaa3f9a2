/* `detproxy diagnose`: judging a finished run and printing it (no I/O but the final print).
 *
 * The rules (docs/diagnose.md "Verdict rules" says the same in prose):
 *   step 1  any of checkpoint, quantization, dtype, framework name/version reported differently
 *           by two replicas -> cross_replica_drift naming the odd ones (reference: the manifest's
 *           pin, else the unique most common value, else none and every replica is named);
 *           a replica with an attestation source that could not be attested -> unattested_replica;
 *   step 2  two unseeded temperature-0.8 outputs differ -> unseeded_sampling, unless the policy
 *           pins sampling for every tenant that can reach the pool; two seeded outputs differ on
 *           a replica that is stable at temperature 0 -> seed_ignored;
 *   step 3  >1 distinct sequential temperature-0 output -> nondeterministic_replica; sequential
 *           identical but concurrent ones differ (among themselves or from the sequential one)
 *           -> batching_nondeterminism;
 *   step 4  the stable replicas' temperature-0 outputs split into groups of identical text; the
 *           reference group is the unique largest (ties broken by step 1: the one group without
 *           a replica step 1 named); everyone else -> cross_replica_drift;
 *   and a replica that answered no completion request at all, or failed more than half of
 *   them -> replica_error.
 * Causes are independent: each is something different to fix, so every one found is listed. */
#include "diagnose/diagnose.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "attest/match.h"
#include "common/jw.h"
#include "common/util.h"
#include "drift/drift.h"

const char *const dg_cause_names[DG__CAUSES] = {
    "cross_replica_drift", "nondeterministic_replica", "batching_nondeterminism", "seed_ignored",
    "unseeded_sampling",   "unattested_replica",       "replica_error",
};

/* The identity fields compared across replicas (docs/diagnose.md, "1. Metadata"; model names
 * are aliases). */
static const attest_field_t cmp_fields[] = {ATTEST_F_CHECKPOINT, ATTEST_F_QUANTIZATION,
                                            ATTEST_F_DTYPE, ATTEST_F_FRAMEWORK_NAME,
                                            ATTEST_F_FRAMEWORK_VERSION};

/* ---- helpers --------------------------------------------------------------------------------- */

static bool same_out(const dg_out_t *a, const dg_out_t *b)
{
    return a->ok && b->ok && a->len == b->len && memcmp(a->text, b->text, a->len) == 0;
}

/* The value of f as step 1 saw it: NULL when the replica was not attested or does not say. */
static const char *field_of(const dg_replica_t *r, attest_field_t f)
{
    if (!r->att_ok || r->source == CFG_ATTEST_NONE)
        return NULL;
    return attest_report_get(&r->report, f);
}

/* Does replica r report v for f, as admission would judge it (a llama.cpp quantization in any
 * case)? */
static bool same_value(const dg_replica_t *r, attest_field_t f, const char *v)
{
    return field_of(r, f) && attest_value_matches(&r->report, f, v);
}

/* A replica-supplied value made safe and short for a message or a table cell. */
static void abbrev(dp_buf_t *out, const char *v)
{
    attest_abbrev(v, out);
}

/* "r1, r2, r3" for the replicas flagged in sel. */
static void names(dp_buf_t *out, const dg_run_t *run, const bool *sel)
{
    bool first = true;
    for (size_t i = 0; i < run->n; i++) {
        if (!sel[i])
            continue;
        dp_buf_printf(out, "%s%s", first ? "" : ", ", run->r[i].name);
        first = false;
    }
}

static dg_finding_t *finding(dg_run_t *run, dg_cause_t c)
{
    dg_finding_t *f = &run->findings[c];
    if (!f->found) {
        f->found = true;
        run->nfindings++;
    }
    if (f->detail.len)
        dp_buf_appends(&f->detail, "; ");
    return f;
}

/* ---- policy (step 2's protection) ------------------------------------------------------------ */

/* How a tenant pins sampling, or NULL when it does not. */
static const char *tenant_pin(const cfg_tenant_t *t)
{
    const cfg_rule_t *s = &t->rules[CFG_PARAM_SEED], *tp = &t->rules[CFG_PARAM_TEMPERATURE];
    if (tp->has_force && tp->force == 0)
        return "temperature forced to 0";
    if (tp->has_default && tp->def == 0 && tp->has_max && tp->max == 0)
        return "temperature 0 by default and at most";
    if (s->has_force)
        return "seed forced";
    if (s->derive)
        return "seed derived";
    if (s->has_default)
        return "seed filled in by default";
    return NULL;
}

bool dg_policy_pins(const cfg_t *cfg, const cfg_pool_t *pool, dp_buf_t *why)
{
    const cfg_policy_t *p = cfg->policy;
    dp_buf_t pinned = {0}, loose = {0};
    size_t nloose = 0, reach = 0;
    for (size_t i = 0; p && i < p->ntenants; i++) {
        const cfg_tenant_t *t = &p->tenants[i];
        bool reaches = t->pool == NULL || strcmp(t->pool, pool->name) == 0;
        if (reaches) {
            reach++;
            const char *how = tenant_pin(t);
            dp_buf_t *b = how ? &pinned : &loose;
            dp_buf_printf(b, "%s\"%s\"", b->len ? ", " : "", t->name);
            if (how)
                dp_buf_printf(b, ": %s", how);
            else
                nloose++;
        }
        /* Nothing after a catch-all tenant ever matches. */
        if (t->match_kind == CFG_MATCH_ANY)
            break;
    }
    if (reach == 0)
        dp_buf_printf(why, "no tenant's requests reach pool \"%s\"", pool->name);
    else if (nloose == 0)
        dp_buf_printf(why, "every tenant that can reach pool \"%s\" pins sampling (%s)", pool->name,
                      pinned.base);
    else
        dp_buf_printf(why, "the policy leaves seed and temperature to the client for %s %s",
                      nloose == 1 ? "tenant" : "tenants", loose.base);
    dp_buf_free(&pinned);
    dp_buf_free(&loose);
    return nloose == 0;
}

/* ---- analysis -------------------------------------------------------------------------------- */

static void phase_stats(const dg_out_t *o, size_t n, dg_phase_t *ps)
{
    memset(ps, 0, sizeof(*ps));
    ps->requests = n;
    ps->first_ok = -1;
    for (size_t i = 0; i < n; i++) {
        if (!o[i].ok) {
            if (ps->first_err == NULL)
                ps->first_err = o[i].err;
            continue;
        }
        ps->ok++;
        if (ps->first_ok < 0)
            ps->first_ok = (int)i;
        bool seen = false;
        for (size_t j = 0; j < i && !seen; j++)
            seen = same_out(&o[j], &o[i]);
        ps->unique += !seen;
    }
}

static int pair_state(const dg_out_t *a, const dg_out_t *b)
{
    if (!a->ok || !b->ok)
        return -1;
    return same_out(a, b) ? 0 : 1;
}

static void replica_stats(const dg_run_t *run, dg_replica_t *r)
{
    dg_stats_t *st = &r->st;
    st->unseeded = pair_state(&r->sampling[0], &r->sampling[1]);
    st->seeded = pair_state(&r->sampling[2], &r->sampling[3]);
    phase_stats(r->seq, run->repeat, &st->seq);
    phase_stats(r->conc, run->repeat, &st->conc);
    st->stable = st->seq.ok > 0 && st->seq.unique == 1;
    st->group = -1;
    st->divergence_offset = -1;
    st->similarity = 1.0;
    /* Distinct texts over both phases: the concurrent ones new relative to the sequential. */
    st->total_unique = st->seq.unique;
    for (size_t i = 0; i < run->repeat; i++) {
        const dg_out_t *c = &r->conc[i];
        if (!c->ok)
            continue;
        bool in_seq = false;
        for (size_t j = 0; j < run->repeat && !in_seq; j++)
            in_seq = same_out(&r->seq[j], c);
        if (st->stable && !in_seq)
            st->conc_differ++;
        bool seen = in_seq;
        for (size_t j = 0; j < i && !seen; j++)
            seen = same_out(&r->conc[j], c);
        st->total_unique += !seen;
    }
    st->answered = st->seq.ok + st->conc.ok > 0;
    st->sent = st->seq.requests + st->conc.requests;
    st->failed = st->sent - st->seq.ok - st->conc.ok;
    for (size_t i = 0; i < DG_SAMPLES; i++) {
        st->answered = st->answered || r->sampling[i].ok;
        st->sent += r->sampling[i].done;
        st->failed += r->sampling[i].done && !r->sampling[i].ok;
    }
}

static void analyse_metadata(dg_run_t *run)
{
    const cfg_manifest_t *m = run->pool->manifest;
    for (size_t k = 0; k < DP_ARRAY_SIZE(cmp_fields); k++) {
        attest_field_t f = cmp_fields[k];
        dg_fielddiff_t *d = &run->diffs[f];
        d->odd = dp_xcalloc(run->n ? run->n : 1, sizeof(bool));
        /* Distinct values, byte for byte, and how many replicas report each (O(n^2); n is a
         * pool's size). Each replica is then judged against the reference by admission's own
         * rule (attest_value_matches: a llama.cpp quantization in any case). */
        size_t ndistinct = 0, best = 0, best_count = 0;
        bool best_tied = false;
        for (size_t i = 0; i < run->n; i++) {
            const char *v = field_of(&run->r[i], f);
            if (v == NULL)
                continue;
            bool earlier = false;
            for (size_t j = 0; j < i && !earlier; j++) {
                const char *w = field_of(&run->r[j], f);
                earlier = w && strcmp(v, w) == 0;
            }
            if (earlier)
                continue;
            ndistinct++;
            size_t count = 0;
            for (size_t j = i; j < run->n; j++) {
                const char *w = field_of(&run->r[j], f);
                count += w && strcmp(v, w) == 0;
            }
            if (count > best_count) {
                best = i;
                best_count = count;
                best_tied = false;
            } else if (count == best_count) {
                best_tied = true;
            }
        }
        if (ndistinct < 2)
            continue;
        if (attest_manifest_get(m, f)) {
            d->reference = attest_manifest_get(m, f);
            d->reference_pinned = true;
        } else if (!best_tied) {
            d->reference = field_of(&run->r[best], f);
        }
        for (size_t i = 0; i < run->n; i++) {
            const char *v = field_of(&run->r[i], f);
            d->odd[i] = v && (d->reference == NULL || !same_value(&run->r[i], f, d->reference));
            if (d->odd[i])
                run->r[i].st.meta_odd = d->differs = true;
        }
        /* Values that differ only as admission allows (a llama.cpp quantization's case) are no
         * difference: d->differs stays false. */
    }
}

/* The canary ran, was answered, and its output is not the pinned one (or none is pinned). */
static bool canary_failed(const dg_replica_t *r)
{
    return r->canary.ran && r->canary.answered && !r->canary.matched;
}

static const dg_out_t *seq_out(const dg_replica_t *r)
{
    return &r->seq[r->st.seq.first_ok];
}

static void analyse_outputs(dg_run_t *run)
{
    run->groups = dp_xcalloc(run->n ? run->n : 1, sizeof(dg_group_t));
    run->ref_group = -1;
    for (size_t i = 0; i < run->n; i++) {
        dg_replica_t *r = &run->r[i];
        if (!r->st.stable)
            continue;
        run->compared++;
        size_t g = 0;
        while (g < run->ngroups && !same_out(seq_out(&run->r[run->groups[g].first]), seq_out(r)))
            g++;
        if (g == run->ngroups)
            run->groups[run->ngroups++] = (dg_group_t){i, 0};
        run->groups[g].count++;
        r->st.group = (int)g;
    }
    if (run->compared < 2)
        return;
    size_t max = 0, nmax = 0;
    for (size_t g = 0; g < run->ngroups; g++)
        max = run->groups[g].count > max ? run->groups[g].count : max;
    for (size_t g = 0; g < run->ngroups; g++) {
        if (run->groups[g].count != max)
            continue;
        nmax++;
        run->ref_group = (int)g;
    }
    if (nmax > 1) {
        /* A tie (1 vs 1, 2 vs 2): side with the group step 1 found nothing wrong with (metadata,
         * then the canary), if exactly one such group exists; otherwise, with the group whose
         * replicas showed no batching noise in step 3; otherwise there is no telling. */
        for (int rule = 0; rule < 2 && nmax > 1; rule++) {
            int clean = -1, nclean = 0;
            for (size_t g = 0; g < run->ngroups; g++) {
                if (run->groups[g].count != max)
                    continue;
                bool any_odd = false;
                for (size_t i = 0; i < run->n; i++) {
                    const dg_replica_t *r = &run->r[i];
                    bool odd =
                        rule == 0 ? r->st.meta_odd || canary_failed(r) : r->st.conc_differ > 0;
                    any_odd = any_odd || (r->st.group == (int)g && odd);
                }
                if (!any_odd) {
                    clean = (int)g;
                    nclean++;
                }
            }
            if (nclean == 1) {
                run->ref_group = clean;
                run->tie_broken_by = rule == 0 ? "step 1" : "step 3";
                nmax = 1;
            }
        }
        if (nmax > 1)
            run->ref_group = -1;
    }
    for (size_t i = 0; i < run->n; i++) {
        dg_replica_t *r = &run->r[i];
        if (r->st.group < 0)
            continue;
        int against = run->ref_group;
        if (against < 0) /* no reference: compare with the first other group */
            against = r->st.group == 0 ? 1 : 0;
        r->st.out_odd = r->st.group != run->ref_group;
        if (r->st.group == against)
            continue;
        const dg_out_t *a = seq_out(&run->r[run->groups[against].first]), *b = seq_out(r);
        drift_result_t res;
        drift_compare_bytes(a->text, a->len, b->text, b->len, &res);
        r->st.divergence_offset = res.divergence_offset;
        r->st.similarity = res.similarity;
    }
}

static void metadata_findings(dg_run_t *run)
{
    for (size_t k = 0; k < DP_ARRAY_SIZE(cmp_fields); k++) {
        attest_field_t f = cmp_fields[k];
        const dg_fielddiff_t *d = &run->diffs[f];
        if (!d->differs)
            continue;
        dg_finding_t *fd = finding(run, DG_CROSS_REPLICA_DRIFT);
        dp_buf_t *b = &fd->detail;
        size_t nodd = 0;
        for (size_t i = 0; i < run->n; i++)
            nodd += d->odd[i];
        if (d->reference == NULL) {
            dp_buf_printf(b, "%s differs across replicas with no majority (",
                          attest_field_names[f]);
        } else {
            names(b, run, d->odd);
            dp_buf_printf(b, " %s in %s (", nodd == 1 ? "differs" : "differ",
                          attest_field_names[f]);
        }
        bool first = true;
        for (size_t i = 0; i < run->n; i++) {
            if (!d->odd[i])
                continue;
            fd->replicas[i] = true;
            if (!first)
                dp_buf_appends(b, ", ");
            first = false;
            if (nodd > 1 || d->reference == NULL)
                dp_buf_printf(b, "%s ", run->r[i].name);
            abbrev(b, field_of(&run->r[i], f));
        }
        if (d->reference) {
            dp_buf_appends(b, " vs ");
            abbrev(b, d->reference);
            if (d->reference_pinned)
                dp_buf_appends(b, " pinned by the manifest");
        }
        dp_buf_appendc(b, ')');
    }
}

/* A replica whose canary output is not the manifest's: the proxy does not admit it. */
static void canary_findings(dg_run_t *run)
{
    size_t answered = 0, failed = 0;
    for (size_t i = 0; i < run->n; i++) {
        answered += run->r[i].canary.ran && run->r[i].canary.answered;
        failed += canary_failed(&run->r[i]);
    }
    if (failed == 0)
        return;
    dg_finding_t *fd = finding(run, DG_CROSS_REPLICA_DRIFT);
    bool first = true;
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        if (!canary_failed(r))
            continue;
        fd->replicas[i] = true;
        if (!r->canary.expected[0])
            dp_buf_printf(&fd->detail,
                          "%s%s's canary output hashes to %.8s.. and the manifest "
                          "pins no expected_sha256",
                          first ? "" : "; ", r->name, r->canary.sha256);
        else
            dp_buf_printf(&fd->detail,
                          "%s%s's canary output differs from the manifest's "
                          "(sha256 %.8s.. want %.8s..): the proxy does not admit it",
                          first ? "" : "; ", r->name, r->canary.sha256, r->canary.expected);
        first = false;
    }
    if (failed == answered && answered > 1 && run->r[0].canary.expected[0])
        dp_buf_appends(&fd->detail, " (every replica differs: is expected_sha256 stale? "
                                    "'detproxy attest canary' prints the current hash)");
}

/* Two replicas disagree and nothing tells which is odd: say exactly what is missing. */
static void why_no_reference(const dg_run_t *run, dp_buf_t *b)
{
    size_t ran = 0, matched = 0;
    for (size_t i = 0; i < run->n; i++) {
        ran += run->r[i].canary.ran && run->r[i].canary.answered;
        matched += run->r[i].canary.ran && run->r[i].canary.matched;
    }
    dp_buf_appends(b, ": cannot tell which is odd; ");
    if (ran == 0)
        dp_buf_appends(b, "no canary in the manifest");
    else if (matched == ran)
        dp_buf_appends(b, "every replica passes the canary");
    else
        dp_buf_appends(b, "the canary does not separate them");
    bool meta = false;
    for (size_t i = 0; i < run->n; i++)
        meta = meta || (run->r[i].st.group >= 0 && run->r[i].st.meta_odd);
    dp_buf_appends(b, meta ? ", step 1's differences name both sides"
                           : ", step 1 found no identity difference between the groups");
    dp_buf_appends(b, ", and their batching noise in step 3 is alike; add a canary to the "
                      "manifest ('detproxy attest canary' records one) or a third replica");
}

static void output_findings(dg_run_t *run)
{
    if (run->compared < 2 || run->ngroups < 2)
        return;
    dg_finding_t *fd = finding(run, DG_CROSS_REPLICA_DRIFT);
    dp_buf_t *b = &fd->detail;
    if (run->ref_group < 0) {
        bool *sel = dp_xcalloc(run->n, sizeof(bool));
        for (size_t i = 0; i < run->n; i++)
            sel[i] = fd->replicas[i] = run->r[i].st.group >= 0;
        dp_buf_appends(b, "temperature-0 outputs disagree with no majority (");
        names(b, run, sel);
        dp_buf_printf(b, " give %zu different texts)", run->ngroups);
        why_no_reference(run, b);
        free(sel);
        return;
    }
    const dg_group_t *ref = &run->groups[run->ref_group];
    bool *members = dp_xcalloc(run->n, sizeof(bool));
    for (size_t i = 0; i < run->n; i++)
        members[i] = run->r[i].st.group == run->ref_group;
    bool first = true;
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        if (r->st.group < 0 || !r->st.out_odd)
            continue;
        fd->replicas[i] = true;
        if (!first)
            dp_buf_appends(b, "; ");
        first = false;
        dp_buf_printf(b, "%s's temperature-0 output differs from %s (", r->name,
                      ref->count * 2 > run->compared ? "the majority"
                      : run->tie_broken_by           ? "the replica(s) that pass"
                                                     : "the reference");
        names(b, run, members);
        dp_buf_printf(b, ") at byte %lld, similarity %.2f", (long long)r->st.divergence_offset,
                      r->st.similarity);
        if (run->tie_broken_by && ref->count * 2 <= run->compared)
            dp_buf_printf(b, " (a tie, told apart by %s: %s)", run->tie_broken_by,
                          canary_failed(r)    ? "its canary fails"
                          : r->st.meta_odd    ? "its attested identity differs"
                          : r->st.conc_differ ? "it alone shows batching noise"
                                              : "the other side is clean");
    }
    free(members);
}

static void replica_findings(dg_run_t *run)
{
    for (size_t i = 0; i < run->n; i++) {
        dg_replica_t *r = &run->r[i];
        const dg_stats_t *st = &r->st;
        if (!st->answered) {
            if (run->answered == 0)
                continue; /* nobody answered: a runtime failure, not a finding */
            dg_finding_t *f = finding(run, DG_REPLICA_ERROR);
            f->replicas[i] = true;
            const char *why = r->skip_reason ? r->skip_reason : st->seq.first_err;
            dp_buf_printf(&f->detail, "%s answered no completion request (%s)", r->name,
                          why ? why : "unknown error");
            continue;
        }
        if (2 * st->failed > st->sent) {
            /* Most of its answers failed: what it did answer says little about it. */
            dg_finding_t *f = finding(run, DG_REPLICA_ERROR);
            f->replicas[i] = true;
            dp_buf_printf(&f->detail, "%s failed %zu of its %zu completion requests (first: %s)",
                          r->name, st->failed, st->sent,
                          st->seq.first_err    ? st->seq.first_err
                          : st->conc.first_err ? st->conc.first_err
                                               : "a sampling request");
        }
        if (r->source != CFG_ATTEST_NONE && !r->att_ok) {
            dg_finding_t *f = finding(run, DG_UNATTESTED_REPLICA);
            f->replicas[i] = true;
            dp_buf_printf(&f->detail,
                          "%s could not be attested (%s): its identity is unverified "
                          "and detproxy gives it no traffic",
                          r->name, r->att_err ? r->att_err : "no report");
        }
        if (st->seq.ok >= 2 && st->seq.unique > 1) {
            dg_finding_t *f = finding(run, DG_NONDETERMINISTIC_REPLICA);
            f->replicas[i] = true;
            dp_buf_printf(&f->detail,
                          "%s gave %zu different outputs to %zu sequential "
                          "temperature-0 requests",
                          r->name, st->seq.unique, st->seq.ok);
        } else if (st->stable && st->conc.ok > 0 && (st->conc.unique > 1 || st->conc_differ > 0)) {
            dg_finding_t *f = finding(run, DG_BATCHING_NONDETERMINISM);
            f->replicas[i] = true;
            dp_buf_printf(&f->detail,
                          "%s: %zu sequential outputs identical, but with %u in "
                          "flight %zu of %zu differ from them (%zu distinct in all)",
                          r->name, st->seq.ok, run->concurrency, st->conc_differ, st->conc.ok,
                          st->total_unique);
        }
        if (st->seeded == 1 && st->stable) {
            dg_finding_t *f = finding(run, DG_SEED_IGNORED);
            f->replicas[i] = true;
            dp_buf_printf(&f->detail,
                          "%s gave different outputs to two requests with seed %d at "
                          "temperature %.1f",
                          r->name, DG_SEED, DG_TEMPERATURE);
        }
    }
    if (run->findings[DG_SEED_IGNORED].found)
        dp_buf_appends(&run->findings[DG_SEED_IGNORED].detail,
                       ": seeds are not honoured there, so a policy seed cannot make sampling "
                       "repeatable (force temperature 0 instead)");
}

static void sampling_findings(dg_run_t *run)
{
    if (!run->unseeded_varies || run->policy_pins)
        return;
    dg_finding_t *f = finding(run, DG_UNSEEDED_SAMPLING);
    bool *sel = f->replicas;
    for (size_t i = 0; i < run->n; i++)
        sel[i] = run->r[i].st.unseeded == 1;
    dp_buf_printf(&f->detail,
                  "two requests at temperature %.1f without a seed gave different "
                  "outputs on ",
                  DG_TEMPERATURE);
    names(&f->detail, run, sel);
    dp_buf_printf(&f->detail,
                  ", and %s: pin it with the policy (\"seed\": {\"derive\": true}, "
                  "or \"temperature\": {\"force\": 0})",
                  run->policy_why.base);
}

void dg_analyse(dg_run_t *run)
{
    for (size_t c = 0; c < DG__CAUSES; c++)
        run->findings[c].replicas = dp_xcalloc(run->n ? run->n : 1, sizeof(bool));
    bool any_seeded = false;
    run->seeds_honoured = true;
    for (size_t i = 0; i < run->n; i++) {
        replica_stats(run, &run->r[i]);
        run->answered += run->r[i].st.answered;
        run->unseeded_varies = run->unseeded_varies || run->r[i].st.unseeded == 1;
        if (run->r[i].st.seeded >= 0)
            any_seeded = true;
        if (run->r[i].st.seeded == 1)
            run->seeds_honoured = false;
    }
    run->seeds_honoured = run->seeds_honoured && any_seeded;
    run->policy_pins = dg_policy_pins(run->cfg, run->pool, &run->policy_why);
    analyse_metadata(run);
    analyse_outputs(run);
    metadata_findings(run);
    canary_findings(run);
    output_findings(run);
    replica_findings(run);
    sampling_findings(run);
}

int dg_exit_code(const dg_run_t *run)
{
    if (run->answered == 0)
        return 3;
    return run->nfindings ? 1 : 0;
}

/* ---- text rendering -------------------------------------------------------------------------- */

/* An aligned table: cells row-major, owned. Widths count UTF-8 code points, not bytes. */
typedef struct {
    char **cells;
    size_t ncols, n, cap;
} tbl_t;

static void tbl_add(tbl_t *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void tbl_add(tbl_t *t, const char *fmt, ...)
{
    if (t->n == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 32;
        t->cells = dp_xrealloc(t->cells, t->cap * sizeof(char *));
    }
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    char *s = dp_xmalloc((size_t)len + 1);
    va_start(ap, fmt);
    vsnprintf(s, (size_t)len + 1, fmt, ap);
    va_end(ap);
    t->cells[t->n++] = s;
}

static size_t width(const char *s)
{
    size_t w = 0;
    for (; *s; s++)
        w += ((unsigned char)*s & 0xC0) != 0x80;
    return w;
}

static void tbl_print(tbl_t *t, FILE *f)
{
    size_t *w = dp_xcalloc(t->ncols, sizeof(size_t));
    for (size_t i = 0; i < t->n; i++) {
        size_t c = i % t->ncols, cw = width(t->cells[i]);
        w[c] = cw > w[c] ? cw : w[c];
    }
    for (size_t i = 0; i < t->n; i++) {
        size_t c = i % t->ncols;
        if (c == 0)
            fputs("  ", f);
        fputs(t->cells[i], f);
        if (c + 1 == t->ncols || i + 1 == t->n) {
            fputc('\n', f);
        } else {
            for (size_t k = width(t->cells[i]); k < w[c] + 2; k++)
                fputc(' ', f);
        }
        free(t->cells[i]);
    }
    free(t->cells);
    free(w);
    t->cells = NULL;
    t->n = t->cap = 0;
}

/* A short, printable excerpt of an output: control bytes as '?', cut at a UTF-8 boundary. */
static void snippet(dp_buf_t *b, const dg_out_t *o, size_t max)
{
    size_t n = o->len;
    if (n > max) {
        n = max;
        while (n > 0 && ((unsigned char)o->text[n] & 0xC0) == 0x80)
            n--;
    }
    dp_buf_appendc(b, '"');
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)o->text[i];
        dp_buf_appendc(b, c < 0x20 || c == 0x7f ? '?' : (char)c);
    }
    dp_buf_appends(b, n < o->len ? "...\"" : "\"");
}

static const char *tri(int v, const char *eq, const char *ne)
{
    return v < 0 ? "failed" : v ? ne : eq;
}

static void canary_cell(tbl_t *t, const dg_replica_t *r)
{
    if (!r->canary.ran)
        tbl_add(t, "%s", "-");
    else if (!r->canary.answered)
        tbl_add(t, "%s", "no answer");
    else if (r->canary.matched)
        tbl_add(t, "ok %.8s..", r->canary.sha256);
    else if (!r->canary.expected[0])
        tbl_add(t, "%.8s.. (not pinned)", r->canary.sha256);
    else
        tbl_add(t, "MISMATCH %.8s..", r->canary.sha256);
}

static void print_metadata(const dg_run_t *run, FILE *f)
{
    fprintf(f, "\nstep 1/4  metadata: what each replica attests to\n");
    tbl_t t = {.ncols = 10};
    const char *hdr[] = {"replica", "source",    "model",  "checkpoint", "quantization",
                         "dtype",   "framework", "signed", "canary",     "admission"};
    for (size_t k = 0; k < t.ncols; k++)
        tbl_add(&t, "%s", hdr[k]);
    dp_buf_t b = {0};
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        const attest_report_t *rep = &r->report;
        tbl_add(&t, "%s", r->name);
        tbl_add(&t, "%s", cfg_attest_source_names[r->source]);
        if (!r->att_ok) {
            for (size_t k = 0; k < 6; k++)
                tbl_add(&t, "%s", "-");
            canary_cell(&t, r);
            dp_buf_reset(&b);
            abbrev(&b, r->att_err);
            tbl_add(&t, "%s: %s", r->source == CFG_ATTEST_NONE ? "unreachable" : "NOT ATTESTED",
                    b.base);
            continue;
        }
        const char *vals[] = {rep->model, rep->checkpoint_sha256, rep->quantization, rep->dtype};
        for (size_t k = 0; k < 4; k++) {
            dp_buf_reset(&b);
            if (vals[k])
                abbrev(&b, vals[k]);
            tbl_add(&t, "%s", vals[k] ? b.base : "-");
        }
        dp_buf_reset(&b);
        if (rep->framework_name || rep->framework_version) {
            abbrev(&b, rep->framework_name ? rep->framework_name : "-");
            dp_buf_appendc(&b, ' ');
            abbrev(&b, rep->framework_version ? rep->framework_version : "-");
        } else {
            dp_buf_appends(&b, "-");
        }
        tbl_add(&t, "%s", b.base);
        tbl_add(&t, "%s", r->source == CFG_ATTEST_NONE ? "-" : rep->is_signed ? "yes" : "no");
        canary_cell(&t, r);
        if (r->admitted) {
            tbl_add(&t, "%s", run->pool->manifest ? "admitted" : "admitted (no manifest)");
        } else {
            dp_buf_reset(&b);
            attest_reasons_join(&r->admit_reasons, "; ", &b);
            tbl_add(&t, "rejected: %s", b.base ? b.base : "");
        }
    }
    tbl_print(&t, f);
    bool any = false;
    for (size_t k = 0; k < DP_ARRAY_SIZE(cmp_fields); k++) {
        attest_field_t fld = cmp_fields[k];
        const dg_fielddiff_t *d = &run->diffs[fld];
        if (!d->differs)
            continue;
        any = true;
        fprintf(f, "  => %s differs:", attest_field_names[fld]);
        for (size_t i = 0; i < run->n; i++) {
            const char *v = field_of(&run->r[i], fld);
            if (v == NULL)
                continue;
            dp_buf_reset(&b);
            abbrev(&b, v);
            fprintf(f, " %s=%s%s", run->r[i].name, b.base, d->odd[i] ? " (odd)" : "");
        }
        if (d->reference) {
            dp_buf_reset(&b);
            abbrev(&b, d->reference);
            fprintf(f, "; reference %s (%s)", b.base,
                    d->reference_pinned ? "the manifest's pin" : "the most common value");
        } else {
            fprintf(f, "; no majority");
        }
        fputc('\n', f);
    }
    size_t attested = 0;
    for (size_t i = 0; i < run->n; i++)
        attested += run->r[i].att_ok && run->r[i].source != CFG_ATTEST_NONE;
    if (!any && attested >= 2)
        fprintf(f,
                "  => the %zu attested replicas agree on checkpoint, quantization, dtype and "
                "framework (where reported)\n",
                attested);
    else if (!any && attested == 1)
        fprintf(f, "  => only one replica attested: nothing to compare\n");
    else if (!any)
        fprintf(f, "  => no replica attested (no attestation source, or it failed): identity not "
                   "compared; steps 3 and 4 still compare behaviour\n");
    dp_buf_free(&b);
}

static void print_sampling(const dg_run_t *run, FILE *f)
{
    fprintf(f,
            "\nstep 2/4  sampling: two requests at temperature %.1f without a seed, then two "
            "with seed %d\n",
            DG_TEMPERATURE, DG_SEED);
    tbl_t t = {.ncols = 3};
    tbl_add(&t, "replica");
    tbl_add(&t, "unseeded");
    tbl_add(&t, "seed %d", DG_SEED);
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        tbl_add(&t, "%s", r->name);
        tbl_add(&t, "%s", tri(r->st.unseeded, "equal", "differ"));
        tbl_add(&t, "%s", tri(r->st.seeded, "equal", "differ"));
    }
    tbl_print(&t, f);
    if (run->unseeded_varies)
        fprintf(f, "  => unseeded sampling varies: it explains different answers to clients that "
                   "sample without a seed\n");
    else
        fprintf(f, "  => unseeded sampling did not vary in this probe\n");
    bool any_seeded = false;
    for (size_t i = 0; i < run->n; i++)
        any_seeded = any_seeded || run->r[i].st.seeded >= 0;
    if (any_seeded)
        fprintf(f, "  => seeds are %s\n",
                run->seeds_honoured ? "honoured" : "NOT honoured everywhere");
    fprintf(f, "  => policy: %s%s\n", run->policy_why.base,
            run->policy_pins ? " (so unseeded sampling is not listed as a cause)" : "");
}

static void print_single(const dg_run_t *run, FILE *f)
{
    fprintf(f,
            "\nstep 3/4  single replica: %u requests at temperature 0 each, sequentially, "
            "then %u in flight\n",
            run->repeat, run->concurrency);
    unsigned lim = run->pool->max_inflight_per_replica;
    if (run->relayed && lim && lim < run->concurrency)
        fprintf(f,
                "  (through the running proxy: at most %u in flight per replica, its "
                "max_inflight_per_replica, as for client traffic)\n",
                lim);
    tbl_t t = {.ncols = 6};
    const char *hdr[] = {"replica",       "sequential ok", "distinct",
                         "concurrent ok", "distinct",      "differ from sequential"};
    for (size_t k = 0; k < t.ncols; k++)
        tbl_add(&t, "%s", hdr[k]);
    for (size_t i = 0; i < run->n; i++) {
        const dg_stats_t *st = &run->r[i].st;
        tbl_add(&t, "%s", run->r[i].name);
        tbl_add(&t, "%zu/%zu", st->seq.ok, st->seq.requests);
        tbl_add(&t, "%zu", st->seq.unique);
        tbl_add(&t, "%zu/%zu", st->conc.ok, st->conc.requests);
        tbl_add(&t, "%zu", st->conc.unique);
        if (st->stable)
            tbl_add(&t, "%zu", st->conc_differ);
        else
            tbl_add(&t, "%s", "-");
    }
    tbl_print(&t, f);
    for (size_t i = 0; i < run->n; i++) {
        const dg_phase_t *ps[] = {&run->r[i].st.seq, &run->r[i].st.conc};
        const char *err = ps[0]->first_err ? ps[0]->first_err : ps[1]->first_err;
        if (err)
            fprintf(f, "  %s: first error: %s\n", run->r[i].name, err);
    }
    const dg_finding_t *nd = &run->findings[DG_NONDETERMINISTIC_REPLICA];
    const dg_finding_t *bn = &run->findings[DG_BATCHING_NONDETERMINISM];
    if (!nd->found && !bn->found)
        fprintf(f, "  => every replica that answered is deterministic at temperature 0, alone and "
                   "under concurrency\n");
    dp_buf_t b = {0};
    if (nd->found) {
        names(&b, run, nd->replicas);
        fprintf(f, "  => nondeterministic even one request at a time: %s\n", b.base);
    }
    if (bn->found) {
        dp_buf_reset(&b);
        names(&b, run, bn->replicas);
        fprintf(f, "  => identical alone, different under concurrency (batching): %s\n", b.base);
    }
    dp_buf_free(&b);
}

static void print_across(const dg_run_t *run, FILE *f)
{
    fprintf(f, "\nstep 4/4  across replicas: the temperature-0 outputs compared\n");
    tbl_t t = {.ncols = 6};
    const char *hdr[] = {"replica", "output", "agrees", "divergence", "similarity", "text"};
    for (size_t k = 0; k < t.ncols; k++)
        tbl_add(&t, "%s", hdr[k]);
    dp_buf_t b = {0};
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        tbl_add(&t, "%s", r->name);
        if (r->st.group < 0) {
            tbl_add(&t, "%s", "-");
            tbl_add(&t, "%s",
                    r->st.seq.ok ? "not compared (unstable)" : "not compared (no output)");
            for (size_t k = 0; k < 3; k++)
                tbl_add(&t, "%s", "");
            continue;
        }
        const dg_out_t *o = seq_out(r);
        char hex[65];
        dp_sha256_hex(o->text, o->len, hex);
        tbl_add(&t, "%.8s..", hex);
        if (run->compared < 2)
            tbl_add(&t, "%s", "-");
        else
            tbl_add(&t, "%s", r->st.out_odd ? "NO" : "yes");
        if (r->st.out_odd) {
            tbl_add(&t, "byte %lld", (long long)r->st.divergence_offset);
            tbl_add(&t, "%.2f", r->st.similarity);
        } else {
            tbl_add(&t, "%s", "-");
            tbl_add(&t, "%s", "-");
        }
        dp_buf_reset(&b);
        snippet(&b, o, 40);
        tbl_add(&t, "%s", b.base);
    }
    tbl_print(&t, f);
    dp_buf_free(&b);
    if (run->compared < 2)
        fprintf(f, "  => fewer than two stable replicas: nothing to compare\n");
    else if (run->ngroups == 1)
        fprintf(f, "  => all %zu compared replicas give the same bytes\n", run->compared);
    else if (run->ref_group < 0)
        fprintf(f, "  => %zu different outputs and no majority\n", run->ngroups);
    else
        fprintf(f, "  => %zu different outputs; the reference is the %s\n", run->ngroups,
                run->groups[run->ref_group].count * 2 > run->compared ? "majority"
                : run->tie_broken_by && strcmp(run->tie_broken_by, "step 3") == 0
                    ? "group without batching noise in step 3"
                    : "group whose metadata and canary step 1 did not question");
}

void dg_print_text(const dg_run_t *run, FILE *f)
{
    fprintf(f, "detproxy diagnose: pool \"%s\", %zu %s, model %s\n", run->pool->name, run->n,
            run->n == 1 ? "replica" : "replicas", run->model);
    dp_buf_t p = {0};
    dg_out_t fake = {.ok = true, .text = (char *)run->prompt, .len = strlen(run->prompt)};
    snippet(&p, &fake, 200);
    fprintf(f, "prompt %s, max_tokens %d\n", p.base, DG_MAX_TOKENS);
    dp_buf_free(&p);
    print_metadata(run, f);
    print_sampling(run, f);
    print_single(run, f);
    print_across(run, f);
    fputc('\n', f);
    if (run->nfindings == 0)
        fprintf(f, "verdict: consistent\n");
    for (size_t c = 0; c < DG__CAUSES; c++)
        if (run->findings[c].found)
            fprintf(f, "verdict: %s: %s\n", dg_cause_names[c], run->findings[c].detail.base);
}

/* ---- JSON rendering -------------------------------------------------------------------------- */

static void json_tri(dp_jw_t *w, const char *key, int v, const char *eq, const char *ne)
{
    if (v < 0)
        dp_jw_null(w, key);
    else
        dp_jw_str(w, key, v ? ne : eq);
}

static void json_names(dp_jw_t *w, const char *key, const dg_run_t *run, const bool *sel)
{
    dp_jw_arr_begin(w, key);
    for (size_t i = 0; i < run->n; i++)
        if (sel[i])
            dp_jw_str(w, NULL, run->r[i].name);
    dp_jw_arr_end(w);
}

static void json_phase(dp_jw_t *w, const char *key, const dg_phase_t *ps)
{
    dp_jw_obj_begin(w, key);
    dp_jw_uint(w, "requests", ps->requests);
    dp_jw_uint(w, "ok", ps->ok);
    dp_jw_uint(w, "distinct", ps->unique);
    dp_jw_str(w, "first_error", ps->first_err);
    dp_jw_obj_end(w);
}

/* Every distinct output of a replica in step 3, with how often each phase saw it. */
static void json_outputs(dp_jw_t *w, const dg_run_t *run, const dg_replica_t *r)
{
    dp_jw_arr_begin(w, "outputs");
    size_t n = run->repeat;
    for (size_t k = 0; k < 2 * n; k++) {
        const dg_out_t *o = k < n ? &r->seq[k] : &r->conc[k - n];
        if (!o->ok)
            continue;
        bool seen = false;
        for (size_t j = 0; j < k && !seen; j++)
            seen = same_out(j < n ? &r->seq[j] : &r->conc[j - n], o);
        if (seen)
            continue;
        size_t cs = 0, cc = 0;
        for (size_t j = 0; j < n; j++) {
            cs += same_out(&r->seq[j], o);
            cc += same_out(&r->conc[j], o);
        }
        char hex[65];
        dp_sha256_hex(o->text, o->len, hex);
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "sha256", hex);
        dp_jw_uint(w, "sequential", cs);
        dp_jw_uint(w, "concurrent", cc);
        dp_jw_strn(w, "text", o->text, o->len);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
}

static void json_manifest(dp_jw_t *w, const cfg_manifest_t *m)
{
    if (m == NULL) {
        dp_jw_null(w, "manifest");
        return;
    }
    dp_jw_obj_begin(w, "manifest");
    for (size_t f = 0; f < ATTEST_F__COUNT; f++)
        if (attest_manifest_get(m, (attest_field_t)f))
            dp_jw_str(w, attest_field_names[f], attest_manifest_get(m, (attest_field_t)f));
    dp_jw_str(w, "fingerprint", m->fingerprint);
    dp_jw_obj_end(w);
}

static void json_metadata(dp_jw_t *w, const dg_run_t *run)
{
    dp_jw_obj_begin(w, "metadata");
    json_manifest(w, run->pool->manifest);
    dp_jw_arr_begin(w, "replicas");
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "name", r->name);
        dp_jw_str(w, "url", r->url);
        dp_jw_str(w, "source", cfg_attest_source_names[r->source]);
        dp_jw_bool(w, "attested", r->att_ok && r->source != CFG_ATTEST_NONE);
        dp_jw_str(w, "attestation", attest_verdict_names[r->verdict]);
        dp_jw_str(w, "error", r->att_ok ? NULL : r->att_err);
        if (r->att_ok)
            attest_report_write_json(&r->report, w, "report");
        else
            dp_jw_null(w, "report");
        if (r->att_ok)
            dp_jw_bool(w, "admitted", r->admitted);
        else
            dp_jw_null(w, "admitted");
        dp_jw_arr_begin(w, "reasons");
        for (size_t k = 0; k < r->admit_reasons.count; k++)
            dp_jw_str(w, NULL, r->admit_reasons.items[k]);
        dp_jw_arr_end(w);
        if (r->canary.ran) {
            dp_jw_obj_begin(w, "canary");
            dp_jw_bool(w, "answered", r->canary.answered);
            dp_jw_str(w, "output_sha256", r->canary.answered ? r->canary.sha256 : NULL);
            dp_jw_str(w, "expected_sha256", r->canary.expected[0] ? r->canary.expected : NULL);
            dp_jw_bool(w, "matched", r->canary.matched);
            dp_jw_str(w, "error", r->canary.err);
            dp_jw_obj_end(w);
        } else {
            dp_jw_null(w, "canary");
        }
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    dp_jw_arr_begin(w, "differences");
    for (size_t k = 0; k < DP_ARRAY_SIZE(cmp_fields); k++) {
        attest_field_t f = cmp_fields[k];
        const dg_fielddiff_t *d = &run->diffs[f];
        if (!d->differs)
            continue;
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "field", attest_field_names[f]);
        dp_jw_str(w, "reference", d->reference);
        dp_jw_str(w, "reference_from",
                  d->reference == NULL  ? NULL
                  : d->reference_pinned ? "manifest"
                                        : "majority");
        dp_jw_obj_begin(w, "values");
        for (size_t i = 0; i < run->n; i++)
            if (field_of(&run->r[i], f))
                dp_jw_str(w, run->r[i].name, field_of(&run->r[i], f));
        dp_jw_obj_end(w);
        json_names(w, "odd", run, d->odd);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

static void json_sampling(dp_jw_t *w, const dg_run_t *run)
{
    dp_jw_obj_begin(w, "sampling");
    dp_jw_double(w, "temperature", DG_TEMPERATURE);
    dp_jw_int(w, "seed", DG_SEED);
    dp_jw_arr_begin(w, "replicas");
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "name", r->name);
        json_tri(w, "unseeded", r->st.unseeded, "equal", "differ");
        json_tri(w, "seeded", r->st.seeded, "equal", "differ");
        const char *err = NULL;
        for (size_t k = 0; k < DG_SAMPLES && !err; k++)
            err = r->sampling[k].ok ? NULL : r->sampling[k].err;
        dp_jw_str(w, "first_error", err);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    dp_jw_bool(w, "unseeded_varies", run->unseeded_varies);
    dp_jw_bool(w, "seeds_honoured", run->seeds_honoured);
    dp_jw_bool(w, "policy_pins_sampling", run->policy_pins);
    dp_jw_str(w, "policy", run->policy_why.base);
    dp_jw_obj_end(w);
}

static void json_single(dp_jw_t *w, const dg_run_t *run)
{
    dp_jw_obj_begin(w, "single_replica");
    dp_jw_int(w, "temperature", 0);
    dp_jw_uint(w, "repeat", run->repeat);
    dp_jw_uint(w, "concurrency", run->concurrency);
    dp_jw_arr_begin(w, "replicas");
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "name", r->name);
        json_phase(w, "sequential", &r->st.seq);
        json_phase(w, "concurrent", &r->st.conc);
        if (r->st.stable)
            dp_jw_uint(w, "concurrent_differ_from_sequential", r->st.conc_differ);
        else
            dp_jw_null(w, "concurrent_differ_from_sequential");
        dp_jw_uint(w, "distinct", r->st.total_unique);
        dp_jw_bool(w, "stable", r->st.stable);
        json_outputs(w, run, r);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

static void json_across(dp_jw_t *w, const dg_run_t *run)
{
    dp_jw_obj_begin(w, "across_replicas");
    dp_jw_uint(w, "compared", run->compared);
    if (run->compared < 2)
        dp_jw_null(w, "agree");
    else
        dp_jw_bool(w, "agree", run->ngroups == 1);
    if (run->ref_group >= 0) {
        bool *sel = dp_xcalloc(run->n ? run->n : 1, sizeof(bool));
        for (size_t i = 0; i < run->n; i++)
            sel[i] = run->r[i].st.group == run->ref_group;
        json_names(w, "reference", run, sel);
        free(sel);
    } else {
        dp_jw_null(w, "reference");
    }
    dp_jw_arr_begin(w, "replicas");
    for (size_t i = 0; i < run->n; i++) {
        const dg_replica_t *r = &run->r[i];
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "name", r->name);
        if (r->st.group < 0) {
            dp_jw_null(w, "output_sha256");
            dp_jw_str(w, "excluded", r->st.seq.ok ? "unstable at temperature 0" : "no output");
        } else {
            char hex[65];
            dp_sha256_hex(seq_out(r)->text, seq_out(r)->len, hex);
            dp_jw_str(w, "output_sha256", hex);
            dp_jw_int(w, "group", r->st.group);
            if (run->compared >= 2)
                dp_jw_bool(w, "agrees", !r->st.out_odd);
            if (r->st.out_odd) {
                dp_jw_int(w, "divergence_offset", r->st.divergence_offset);
                dp_jw_double(w, "similarity", r->st.similarity);
            }
        }
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

void dg_print_json(const dg_run_t *run, dp_buf_t *out)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "pool", run->pool->name);
    dp_jw_str(&w, "model", run->model);
    dp_jw_str(&w, "prompt", run->prompt);
    dp_jw_int(&w, "max_tokens", DG_MAX_TOKENS);
    dp_jw_uint(&w, "repeat", run->repeat);
    dp_jw_uint(&w, "concurrency", run->concurrency);
    dp_jw_bool(&w, "through_proxy", run->relayed);
    dp_jw_obj_begin(&w, "steps");
    json_metadata(&w, run);
    json_sampling(&w, run);
    json_single(&w, run);
    json_across(&w, run);
    dp_jw_obj_end(&w);
    dp_jw_arr_begin(&w, "findings");
    for (size_t c = 0; c < DG__CAUSES; c++) {
        const dg_finding_t *f = &run->findings[c];
        if (!f->found)
            continue;
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "cause", dg_cause_names[c]);
        json_names(&w, "replicas", run, f->replicas);
        dp_jw_str(&w, "detail", f->detail.base);
        dp_jw_obj_end(&w);
    }
    dp_jw_arr_end(&w);
    dp_jw_bool(&w, "consistent", run->nfindings == 0);
    dp_jw_arr_begin(&w, "verdict");
    if (run->nfindings == 0)
        dp_jw_str(&w, NULL, "consistent");
    for (size_t c = 0; c < DG__CAUSES; c++) {
        if (!run->findings[c].found)
            continue;
        dp_buf_t line = {0};
        dp_buf_printf(&line, "%s: %s", dg_cause_names[c], run->findings[c].detail.base);
        dp_jw_str(&w, NULL, line.base);
        dp_buf_free(&line);
    }
    dp_jw_arr_end(&w);
    dp_jw_int(&w, "exit_code", dg_exit_code(run));
    dp_jw_obj_end(&w);
    dp_buf_appendc(out, '\n');
}

/* ---- cleanup --------------------------------------------------------------------------------- */

static void out_free(dg_out_t *o)
{
    free(o->text);
    free(o->err);
    o->text = o->err = NULL;
}

void dg_run_free(dg_run_t *run)
{
    for (size_t i = 0; i < run->n; i++) {
        dg_replica_t *r = &run->r[i];
        free(r->name);
        free(r->url);
        free(r->att_err);
        free(r->canary.err);
        free(r->skip_reason);
        attest_report_clear(&r->report);
        attest_reasons_free(&r->admit_reasons);
        for (size_t k = 0; k < DG_SAMPLES; k++)
            out_free(&r->sampling[k]);
        for (size_t k = 0; r->seq && k < run->repeat; k++)
            out_free(&r->seq[k]);
        for (size_t k = 0; r->conc && k < run->repeat; k++)
            out_free(&r->conc[k]);
        free(r->seq);
        free(r->conc);
    }
    free(run->r);
    run->r = NULL;
    for (size_t f = 0; f < ATTEST_F__COUNT; f++) {
        free(run->diffs[f].odd);
        run->diffs[f].odd = NULL;
    }
    for (size_t c = 0; c < DG__CAUSES; c++) {
        free(run->findings[c].replicas);
        run->findings[c].replicas = NULL;
        dp_buf_free(&run->findings[c].detail);
    }
    free(run->groups);
    run->groups = NULL;
    dp_buf_free(&run->policy_why);
    run->n = 0;
}
