/* Drift statistics per pool: sliding windows, the verdict, suspect naming, quarantine queries
 * and the /admin/drift rendering (docs/drift.md §7). Rules and thresholds are argued in
 * docs/drift.md §3-§6.
 *
 * Layout: one window per kind for the whole pool, one per replica pair (a triangular array
 * over replica slots, the diagonal being each replica's self pair), and one per replica of the
 * recent cross samples involving it (for the recovery query). A window is a ring of small
 * records with running counts, allocated on its first sample: 12 KB each, so a pool of R
 * replicas with every pair sampled holds about (R(R+1)/2 + R + 2) x 12 KB (a 64-replica pool:
 * 26 MB; a 5-replica pool: 264 KB).
 *
 * Each record remembers its pair so that the evidence involving one replica can be removed from
 * the pool-wide windows when its windows start again (a re-admission or an identity change).
 *
 * History (docs/drift.md §5): each replica's last change, and per cross pair the stretch its
 * window belongs to: which replica's change started it, and how its first samples went. With
 * two replicas that names the one whose change the divergence followed. */
#include "drift/drift.h"
#include "drift/window.h"

#include <assert.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "common/util.h"

#define NPAIRS (DRIFT_MAX_REPLICAS * (DRIFT_MAX_REPLICAS + 1) / 2)
#define PAIR_NONE DRIFT_REC_NO_PAIR

_Static_assert(NPAIRS < PAIR_NONE, "pair slots must fit a record's uint16_t");

#define NO_SLOT (-1)

/* A replica's last history change (drift_pool_replica_changed). */
typedef struct {
    bool set;
    uint64_t at_ms;
    char what[DRIFT_CHANGE_MAX];
} change_t;

/* The stretch of samples a cross pair's window belongs to. A stretch starts with a window,
 * except when the window starts again while the pair diverges: the divergence predates the
 * change, so the stretch (and who started it) carries on into the new window, until that
 * window's first DRIFT_ONSET_SAMPLES samples no longer diverge (pair_diverging). */
typedef struct {
    int8_t starter;  /* the slot whose change started it; NO_SLOT: none, or none alone */
    bool carried;    /* it goes on from before the window's last start */
    uint8_t early_n; /* its first DRIFT_ONSET_SAMPLES samples ... */
    uint8_t early_d; /* ... and how many of them diverged */
    uint8_t carry_n; /* while carried: the new window's first DRIFT_ONSET_SAMPLES samples ... */
    uint8_t carry_d; /* ... and how many of them diverged */
} stretch_t;

_Static_assert(DRIFT_MAX_REPLICAS <= INT8_MAX, "slots must fit a stretch's int8_t");
_Static_assert(DRIFT_ONSET_SAMPLES <= UINT8_MAX, "carry counts must fit a uint8_t");

struct drift_pool {
    char *name;
    drift_win_t kind[2];
    char *replicas[DRIFT_MAX_REPLICAS];     /* slot names; NULL = free */
    drift_win_t recent[DRIFT_MAX_REPLICAS]; /* cross samples involving the replica */
    drift_win_t *pairs;                     /* NPAIRS windows, indexed by pair_index */
    stretch_t *stretch;                     /* NPAIRS, the cross pairs' history */
    change_t changes[DRIFT_MAX_REPLICAS];
    drift_hint_t hints[DRIFT_MAX_REPLICAS];
    bool hinted[DRIFT_MAX_REPLICAS];
    /* The identity_changed_ms of each replica's previous hint (a later one is a change). */
    uint64_t identity_seen[DRIFT_MAX_REPLICAS];
    bool identity_known[DRIFT_MAX_REPLICAS];
};

const char *drift_kind_name(drift_kind_t k)
{
    return k == DRIFT_SELF ? "self" : "cross";
}

const char *drift_verdict_name(drift_verdict_kind_t v)
{
    switch (v) {
    case DRIFT_CONSISTENT:
        return "consistent";
    case DRIFT_BATCHING_NONDETERMINISM:
        return "batching_nondeterminism";
    case DRIFT_CROSS_REPLICA_DRIFT:
        return "cross_replica_drift";
    case DRIFT_INSUFFICIENT_DATA:
        break;
    }
    return "insufficient_data";
}

typedef struct {
    uint32_t n;
    uint32_t d;
} agg_t;

static agg_t win_agg(const drift_win_t *w)
{
    return (agg_t){w->count, w->diverged};
}

static double rate(agg_t a)
{
    return a.n ? (double)a.d / a.n : NAN;
}

/* ---- pool --------------------------------------------------------------------------------- */

static uint32_t pair_index(int i, int j)
{
    if (i > j) {
        int t = i;
        i = j;
        j = t;
    }
    return (uint32_t)(j * (j + 1) / 2 + i);
}

static const stretch_t no_stretch = {.starter = NO_SLOT};

/* Everything but the name, as drift_pool_new makes it. */
static void pool_init(drift_pool_t *p)
{
    p->pairs = dp_xcalloc(NPAIRS, sizeof(drift_win_t));
    p->stretch = dp_xmalloc(NPAIRS * sizeof(stretch_t));
    for (int k = 0; k < NPAIRS; k++)
        p->stretch[k] = no_stretch;
}

/* Release everything but the name; the pool is left zeroed apart from it. */
static void pool_release(drift_pool_t *p)
{
    for (int i = 0; i < 2; i++)
        drift_win_free(&p->kind[i]);
    for (int i = 0; i < DRIFT_MAX_REPLICAS; i++) {
        free(p->replicas[i]);
        p->replicas[i] = NULL;
        drift_win_free(&p->recent[i]);
    }
    for (int i = 0; i < NPAIRS; i++)
        drift_win_free(&p->pairs[i]);
    free(p->pairs);
    p->pairs = NULL;
    free(p->stretch);
    p->stretch = NULL;
    char *name = p->name;
    memset(p, 0, sizeof(*p));
    p->name = name;
}

drift_pool_t *drift_pool_new(const char *name)
{
    drift_pool_t *p = dp_xcalloc(1, sizeof(*p));
    p->name = dp_xstrdup(name);
    pool_init(p);
    return p;
}

void drift_pool_free(drift_pool_t *p)
{
    if (p == NULL)
        return;
    pool_release(p);
    free(p->name);
    p->name = NULL;
    free(p);
}

void drift_pool_clear(drift_pool_t *p)
{
    pool_release(p);
    pool_init(p);
}

const char *drift_pool_name(const drift_pool_t *p)
{
    return p->name;
}

static int find_replica(const drift_pool_t *p, const char *name)
{
    for (int i = 0; i < DRIFT_MAX_REPLICAS; i++)
        if (p->replicas[i] && strcmp(p->replicas[i], name) == 0)
            return i;
    return -1;
}

/* The replica's slot, taking a free one for a new name; -1 when all are taken. */
static int replica_slot(drift_pool_t *p, const char *name)
{
    int i = find_replica(p, name);
    if (i >= 0)
        return i;
    for (i = 0; i < DRIFT_MAX_REPLICAS; i++) {
        if (p->replicas[i] == NULL) {
            p->replicas[i] = dp_xstrdup(name);
            return i;
        }
    }
    return -1;
}

static bool name_ok(const char *s)
{
    return s && s[0] && strnlen(s, DRIFT_NAME_MAX) < DRIFT_NAME_MAX;
}

/* The self-noise baseline of gather(): the pool's self rate with DRIFT_MIN_SAMPLES of them
 * (else 0), and each replica's own self rate once its self pair has DRIFT_MIN_PAIR_SAMPLES. */
static double pool_self_rate(const drift_pool_t *p)
{
    agg_t self = win_agg(&p->kind[DRIFT_SELF]);
    return self.n >= DRIFT_MIN_SAMPLES ? rate(self) : 0;
}

static double self_rate(const drift_pool_t *p, int i, double pool_s)
{
    agg_t own = win_agg(&p->pairs[pair_index(i, i)]);
    return own.n >= DRIFT_MIN_PAIR_SAMPLES ? rate(own) : pool_s;
}

/* Samples a of cross pair (i, j) diverge: one of them did, and at a rate at least
 * DRIFT_MARGIN_ABS above what the two replicas' self noise predicts. No significance test:
 * this tells whether a divergence predates a change or follows it, from the few samples around
 * the change there may be. */
static bool pair_diverging(const drift_pool_t *p, int i, int j, agg_t a)
{
    double pool_s = pool_self_rate(p);
    double expected = (self_rate(p, i, pool_s) + self_rate(p, j, pool_s)) / 2;
    return a.d > 0 && rate(a) >= expected + DRIFT_MARGIN_ABS - 1e-9;
}

/* One sample of cross pair (i, j), for its stretch. */
static void stretch_add(drift_pool_t *p, int i, int j, bool match)
{
    stretch_t *st = &p->stretch[pair_index(i, j)];
    if (st->early_n < DRIFT_ONSET_SAMPLES) {
        st->early_n++;
        st->early_d += !match;
    }
    if (!st->carried || st->carry_n >= DRIFT_ONSET_SAMPLES)
        return;
    st->carry_n++;
    st->carry_d += !match;
    if (st->carry_n == DRIFT_ONSET_SAMPLES &&
        !pair_diverging(p, i, j, (agg_t){st->carry_n, st->carry_d}))
        *st = no_stretch; /* the divergence it carried is over: no change started what follows */
}

int drift_pool_add(drift_pool_t *p, const char *replica_a, const char *replica_b,
                   const drift_result_t *r)
{
    if (!name_ok(replica_a) || !name_ok(replica_b))
        return -EINVAL;
    drift_kind_t kind = strcmp(replica_a, replica_b) == 0 ? DRIFT_SELF : DRIFT_CROSS;
    int ia = replica_slot(p, replica_a);
    int ib = kind == DRIFT_SELF ? ia : replica_slot(p, replica_b);
    drift_rec_t rec = drift_win_rec_of(r);
    if (ia >= 0 && ib >= 0)
        rec.pair = (uint16_t)pair_index(ia, ib);
    drift_win_push(&p->kind[kind], rec);
    if (rec.pair != PAIR_NONE)
        drift_win_push(&p->pairs[rec.pair], rec);
    if (rec.pair != PAIR_NONE && kind == DRIFT_CROSS)
        stretch_add(p, ia, ib, r->match);
    if (kind == DRIFT_CROSS) {
        if (ia >= 0)
            drift_win_push(&p->recent[ia], rec);
        if (ib >= 0)
            drift_win_push(&p->recent[ib], rec);
    }
    return 0;
}

void drift_pool_summary(const drift_pool_t *p, drift_kind_t kind, drift_summary_t *out)
{
    drift_win_summary(&p->kind[kind == DRIFT_SELF], out);
}

int drift_pool_pair_summary(const drift_pool_t *p, const char *a, const char *b,
                            drift_summary_t *out)
{
    int ia = find_replica(p, a), ib = find_replica(p, b);
    if (ia < 0 || ib < 0)
        return -ENOENT;
    drift_win_summary(&p->pairs[pair_index(ia, ib)], out);
    return 0;
}

/* Cross pair (i, j)'s window starts again because slot `by` changed (NO_SLOT: evidence
 * dropped, no change): the rules of docs/drift.md §5, "History". Call before its window is
 * cleared. */
static void stretch_restart(drift_pool_t *p, int i, int j, int by)
{
    stretch_t *st = &p->stretch[pair_index(i, j)];
    const drift_win_t *w = &p->pairs[pair_index(i, j)];
    if (w->count == 0) {
        /* Nothing was seen since the last start: the stretch is still the same replica's, or
         * no one's (two changes with no sample between them cannot be told apart). */
        if (!st->carried && st->starter != by)
            st->starter = NO_SLOT;
        return;
    }
    if (pair_diverging(p, i, j, win_agg(w))) {
        /* Already diverging: the divergence is not this change's doing. */
        st->carried = true;
        st->carry_n = st->carry_d = 0;
        return;
    }
    /* The pair agreed up to the change: what it does from here follows the change. */
    *st = no_stretch;
    st->starter = (int8_t)by;
}

/* Remove the windowed evidence involving slot i; lifetime totals stay. by: the slot whose
 * change this is (i), or NO_SLOT. */
static void reset_slot(drift_pool_t *p, int i, int by)
{
    for (int j = 0; j < DRIFT_MAX_REPLICAS; j++)
        if (j != i && p->replicas[j])
            stretch_restart(p, i, j, by);
    bool *drop = dp_xcalloc(NPAIRS, sizeof(bool));
    for (int j = 0; j < DRIFT_MAX_REPLICAS; j++) {
        drop[pair_index(i, j)] = true;
        drift_win_clear(&p->pairs[pair_index(i, j)]);
    }
    drift_win_clear(&p->recent[i]);
    for (int k = 0; k < 2; k++)
        drift_win_filter(&p->kind[k], drop);
    for (int j = 0; j < DRIFT_MAX_REPLICAS; j++)
        if (j != i && p->recent[j].ring)
            drift_win_filter(&p->recent[j], drop);
    free(drop);
}

void drift_pool_reset_replica(drift_pool_t *p, const char *replica)
{
    int i = find_replica(p, replica);
    if (i >= 0) {
        reset_slot(p, i, NO_SLOT);
        p->hinted[i] = false;
    }
}

void drift_pool_replica_changed(drift_pool_t *p, const char *replica, const char *what,
                                uint64_t at_ms)
{
    int i = find_replica(p, replica);
    if (i < 0)
        return;
    reset_slot(p, i, i);
    p->hinted[i] = false;
    change_t *c = &p->changes[i];
    c->set = true;
    c->at_ms = at_ms;
    snprintf(c->what, sizeof(c->what), "%s", what ? what : "changed");
}

bool drift_pool_set_hint(drift_pool_t *p, const char *replica, const drift_hint_t *h)
{
    int i = find_replica(p, replica);
    if (i < 0)
        return false;
    bool changed = p->identity_known[i] && h->identity_changed_ms > p->identity_seen[i];
    p->identity_seen[i] = h->identity_changed_ms;
    p->identity_known[i] = true;
    if (changed)
        drift_pool_replica_changed(p, replica, "attested identity changed", h->identity_changed_ms);
    p->hints[i] = *h;
    p->hinted[i] = true;
    return changed;
}

void drift_pool_forget_replica(drift_pool_t *p, const char *replica)
{
    int i = find_replica(p, replica);
    if (i < 0)
        return;
    reset_slot(p, i, NO_SLOT);
    for (int j = 0; j < DRIFT_MAX_REPLICAS; j++) {
        drift_win_free(&p->pairs[pair_index(i, j)]);
        p->stretch[pair_index(i, j)] = no_stretch;
    }
    drift_win_free(&p->recent[i]);
    free(p->replicas[i]);
    p->replicas[i] = NULL;
    p->hinted[i] = false;
    memset(&p->changes[i], 0, sizeof(p->changes[i]));
    p->identity_seen[i] = 0;
    p->identity_known[i] = false;
}

/* ---- verdict ------------------------------------------------------------------------------ */

/* A divergence rate and the number of samples behind it. */
typedef struct {
    double r;
    uint32_t n;
} est_t;

static est_t est(agg_t a)
{
    return (est_t){rate(a), a.n};
}

/* Absolute margin, relative margin (Diffy's pair of thresholds) and a z-test, each needed: the
 * margins say what is worth reporting, the z-test that it is not the luck of a small window.
 * The variance uses the "plus two" estimate (d+1)/(n+2) so that 0 of n still carries its
 * uncertainty. Callers check minimum counts. */
bool drift_rate_exceeds(double a, uint32_t na, double b, uint32_t nb)
{
    double diff = a - b;
    if (!(diff >= DRIFT_MARGIN_ABS - 1e-9) || a < DRIFT_MARGIN_REL * b - 1e-9 || na == 0 || nb == 0)
        return false;
    double pa = (a * na + 1.0) / (na + 2.0), pb = (b * nb + 1.0) / (nb + 2.0);
    double var = pa * (1 - pa) / na + pb * (1 - pb) / nb;
    return diff * diff >= DRIFT_MARGIN_Z * DRIFT_MARGIN_Z * var;
}

static bool exceeds(est_t a, est_t b)
{
    return drift_rate_exceeds(a.r, a.n, b.r, b.n);
}

/* A reason line for the verdict (window.h). */
#define reason(v, ...) drift_win_reason((v)->reasons, &(v)->nreasons, __VA_ARGS__)

/* Everything the verdict reads, gathered in one pass over the pair windows. */
typedef struct {
    agg_t cross, self;                  /* pool-wide windows */
    bool base_ok;                       /* enough self samples for a noise baseline */
    double s[DRIFT_MAX_REPLICAS];       /* each replica's self divergence rate */
    agg_t inv[DRIFT_MAX_REPLICAS];      /* cross pairs involving the replica */
    double inv_exp[DRIFT_MAX_REPLICAS]; /* their divergence expected from self noise */
    agg_t pairs_all;                    /* all tracked cross pairs */
    double expected;                    /* cross divergence expected from self noise */
} facts_t;

/* Two copies from the same replica differ with probability s (its self rate); with a small
 * chance e of a deviant output per run, s ~ 2e, and a copy from X against one from Y differs
 * with probability ~ e_X + e_Y = (s_X + s_Y) / 2. Weighting that by each pair's samples gives the
 * cross divergence self noise alone would produce for this mix of pairs, so a single noisy
 * replica (whose pairs dominate cross but not self) is not mistaken for drift. */
static void gather(const drift_pool_t *p, facts_t *f)
{
    memset(f, 0, sizeof(*f));
    f->cross = win_agg(&p->kind[DRIFT_CROSS]);
    f->self = win_agg(&p->kind[DRIFT_SELF]);
    f->base_ok = f->self.n >= DRIFT_MIN_SAMPLES;
    double pool_s = pool_self_rate(p);
    for (int i = 0; i < DRIFT_MAX_REPLICAS; i++)
        f->s[i] = self_rate(p, i, pool_s);
    double exp_sum = 0;
    for (int j = 1; j < DRIFT_MAX_REPLICAS; j++) {
        for (int i = 0; i < j; i++) {
            const drift_win_t *w = &p->pairs[pair_index(i, j)];
            if (w->count == 0)
                continue;
            double e = w->count * (f->s[i] + f->s[j]) / 2;
            f->inv[i].n += w->count;
            f->inv[i].d += w->diverged;
            f->inv_exp[i] += e;
            f->inv[j].n += w->count;
            f->inv[j].d += w->diverged;
            f->inv_exp[j] += e;
            f->pairs_all.n += w->count;
            f->pairs_all.d += w->diverged;
            exp_sum += e;
        }
    }
    for (int i = 0; i < DRIFT_MAX_REPLICAS; i++)
        if (f->inv[i].n)
            f->inv_exp[i] /= f->inv[i].n;
    f->expected = f->pairs_all.n ? exp_sum / f->pairs_all.n : pool_s;
}

/* Per replica: its cross pairs (inv) against the cross pairs without it (out), and, with a
 * self baseline, against what self noise predicts for its pairs. A candidate disagrees with the
 * others beyond the noise both ways. Returns the number of candidates; the first goes to
 * *first; names lists them all; *with_data counts replicas with cross samples. */
static int find_candidates(const drift_pool_t *p, const facts_t *f, int *first, int *with_data,
                           char *names, size_t names_len)
{
    int n = 0;
    *with_data = 0;
    names[0] = '\0';
    for (int i = 0; i < DRIFT_MAX_REPLICAS; i++) {
        agg_t inv = f->inv[i];
        if (p->replicas[i] == NULL || inv.n == 0)
            continue;
        (*with_data)++;
        agg_t out = {f->pairs_all.n - inv.n, f->pairs_all.d - inv.d};
        if (inv.n < DRIFT_MIN_PAIR_SAMPLES || out.n < DRIFT_MIN_PAIR_SAMPLES ||
            !exceeds(est(inv), est(out)))
            continue;
        if (f->base_ok && !exceeds(est(inv), (est_t){f->inv_exp[i], f->self.n}))
            continue;
        if (n++ == 0)
            *first = i;
        size_t used = strlen(names);
        snprintf(names + used, names_len - used, "%s%s", used ? ", " : "", p->replicas[i]);
    }
    return n;
}

static const drift_hint_t *hint_of(const drift_pool_t *p, int i)
{
    static const drift_hint_t none = {0};
    return p->hinted[i] ? &p->hints[i] : &none;
}

/* The slot of a or b whose change their pair's divergence followed, or NO_SLOT: the change
 * started the pair's stretch after the pair had agreed, and the stretch's first
 * DRIFT_ONSET_SAMPLES samples already diverge (pair_diverging): the divergence began with it
 * (docs/drift.md §5, "History"). */
static int divergence_follows_change(const drift_pool_t *p, int a, int b)
{
    const stretch_t *st = &p->stretch[pair_index(a, b)];
    if ((st->starter != a && st->starter != b) ||
        !pair_diverging(p, a, b, (agg_t){st->early_n, st->early_d}))
        return NO_SLOT;
    assert(p->changes[st->starter].set); /* only a change starts a stretch */
    return st->starter;
}

/* Two replicas a and b (slots), both with cross samples: name the one the hints point at
 * (rules in drift.h), with a reason, or say exactly what would tell them apart. Returns the
 * suspect's slot or -1. */
static int two_replica_suspect(const drift_pool_t *p, int a, int b, drift_verdict_t *v)
{
    const drift_hint_t *ha = hint_of(p, a), *hb = hint_of(p, b);
    const char *na = p->replicas[a], *nb = p->replicas[b];
    int s = -1;
    /* 1. The canary compares with what the manifest pins: ground truth, not a vote. */
    if (ha->canary != hb->canary && ha->canary != DRIFT_CANARY_UNKNOWN &&
        hb->canary != DRIFT_CANARY_UNKNOWN) {
        s = ha->canary == DRIFT_CANARY_FAIL ? a : b;
        reason(v, "%s fails the manifest's canary and %s passes it", p->replicas[s],
               p->replicas[s == a ? b : a]);
        return s;
    }
    /* 2. A rollout in progress: the two serve different accepted identities. */
    if (ha->fingerprint[0] && hb->fingerprint[0] && strcmp(ha->fingerprint, hb->fingerprint) &&
        ha->accept_identity != hb->accept_identity) {
        s = ha->accept_identity ? a : b;
        int o = s == a ? b : a;
        reason(v,
               "%s serves the rollout's accepted identity %s, %s the manifest's %s: the "
               "difference is the rollout's",
               p->replicas[s], hint_of(p, s)->fingerprint, p->replicas[o],
               hint_of(p, o)->fingerprint);
        return s;
    }
    /* 3. History: the divergence began just after one of them changed (a restart seen as a
     * re-admission, a new identity), and they had agreed before. */
    s = divergence_follows_change(p, a, b);
    if (s != NO_SLOT) {
        const change_t *c = &p->changes[s];
        const stretch_t *st = &p->stretch[pair_index(a, b)];
        char at[32];
        dp_iso8601(at, c->at_ms);
        reason(v,
               "%s changed just before its pair with %s began to diverge: %s at %s; %u of the "
               "pair's first %u samples after it diverged, and the pair agreed before",
               p->replicas[s], p->replicas[s == a ? b : a], c->what, at, st->early_d, st->early_n);
        return s;
    }
    /* 4. Self noise: the replica that does not even agree with itself. */
    agg_t sa = win_agg(&p->pairs[pair_index(a, a)]), sb = win_agg(&p->pairs[pair_index(b, b)]);
    bool self_ok = sa.n >= DRIFT_MIN_PAIR_SAMPLES && sb.n >= DRIFT_MIN_PAIR_SAMPLES;
    if (self_ok && (exceeds(est(sa), est(sb)) || exceeds(est(sb), est(sa)))) {
        s = exceeds(est(sa), est(sb)) ? a : b;
        agg_t ss = s == a ? sa : sb, so = s == a ? sb : sa;
        reason(v,
               "%s's self pairs diverge %.1f%% (n=%u) vs %s's %.1f%% (n=%u): the replica "
               "that disagrees with itself is the likelier odd one",
               p->replicas[s], drift_win_pct(rate(ss)), ss.n, p->replicas[s == a ? b : a],
               drift_win_pct(rate(so)), so.n);
        return s;
    }
    const char *canary = ha->canary == DRIFT_CANARY_UNKNOWN || hb->canary == DRIFT_CANARY_UNKNOWN
                             ? "no canary result"
                         : ha->canary == DRIFT_CANARY_PASS ? "both pass the canary"
                                                           : "both fail the canary";
    char self[96];
    if (self_ok)
        snprintf(self, sizeof(self), "equal self-noise (%.1f%% n=%u, %.1f%% n=%u)",
                 drift_win_pct(rate(sa)), sa.n, drift_win_pct(rate(sb)), sb.n);
    else
        snprintf(self, sizeof(self), "too few self samples (%u, %u; need %d each)", sa.n, sb.n,
                 DRIFT_MIN_PAIR_SAMPLES);
    reason(v,
           "suspect undetermined: two replicas (%s, %s), %s, %s, no restart, re-admission or "
           "identity change of one just before their pair began to diverge: cannot tell which; "
           "add a canary to the manifest or a third replica",
           na, nb, canary, self);
    return -1;
}

void drift_pool_verdict(const drift_pool_t *p, drift_verdict_t *v)
{
    memset(v, 0, sizeof(*v));
    facts_t facts;
    const facts_t *f = &facts;
    gather(p, &facts);
    agg_t cross = f->cross, self = f->self;
    bool cross_ok = cross.n >= DRIFT_MIN_SAMPLES;
    bool self_noisy =
        f->base_ok && self.d >= DRIFT_SELF_NOISE_MIN && rate(self) >= DRIFT_SELF_NOISE_RATE;
    bool pool_drift = cross_ok && f->base_ok && exceeds(est(cross), (est_t){f->expected, self.n});

    int ncand = 0, first = -1, with_data = 0;
    char names[DRIFT_REASON_MAX];
    if (cross_ok)
        ncand = find_candidates(p, f, &first, &with_data, names, sizeof(names));

    if (ncand > 0 || pool_drift) {
        v->kind = DRIFT_CROSS_REPLICA_DRIFT;
        reason(v, "cross pairs diverge %.1f%% (n=%u); self noise %.1f%% (n=%u) predicts %.1f%%",
               drift_win_pct(rate(cross)), cross.n, drift_win_pct(rate(self)), self.n,
               drift_win_pct(f->expected));
        if (ncand == 1) {
            agg_t inv = f->inv[first];
            agg_t out = {f->pairs_all.n - inv.n, f->pairs_all.d - inv.d};
            v->has_suspect = true;
            snprintf(v->suspect, sizeof(v->suspect), "%s", p->replicas[first]);
            reason(v,
                   "%s disagrees with the others: %.1f%% of its cross samples diverge (n=%u) vs "
                   "%.1f%% of pairs without it (n=%u)",
                   v->suspect, drift_win_pct(rate(inv)), inv.n, drift_win_pct(rate(out)), out.n);
        } else if (ncand > 1) {
            reason(v, "suspect undetermined: several replicas disagree (%s)", names);
        } else if (with_data == 2) {
            int a = -1, b = -1;
            for (int i = 0; i < DRIFT_MAX_REPLICAS; i++)
                if (p->replicas[i] && f->inv[i].n)
                    *(a < 0 ? &a : &b) = i;
            int s = two_replica_suspect(p, a, b, v);
            if (s >= 0) {
                v->has_suspect = true;
                snprintf(v->suspect, sizeof(v->suspect), "%s", p->replicas[s]);
            }
        } else if (with_data < 2) {
            reason(v, "suspect undetermined: cross samples involve fewer than two tracked "
                      "replicas");
        } else {
            reason(v, "suspect undetermined: no single replica's pairs stand out");
        }
        if (self_noisy)
            reason(v, "self pairs also diverge %.1f%%: batching noise besides the drift",
                   drift_win_pct(rate(self)));
    } else if (self_noisy) {
        v->kind = DRIFT_BATCHING_NONDETERMINISM;
        reason(v,
               "self pairs diverge %.1f%% (n=%u): a replica answers the same request "
               "differently",
               drift_win_pct(rate(self)), self.n);
        if (cross_ok)
            reason(v, "cross pairs diverge %.1f%% (n=%u), within what self noise predicts (%.1f%%)",
                   drift_win_pct(rate(cross)), cross.n, drift_win_pct(f->expected));
    } else if (!cross_ok) {
        v->kind = DRIFT_INSUFFICIENT_DATA;
        reason(v, "%u cross samples in the window, need %d", cross.n, DRIFT_MIN_SAMPLES);
        if (!f->base_ok)
            reason(v, "%u self samples, need %d for a noise baseline (shadow.self_rate)", self.n,
                   DRIFT_MIN_SAMPLES);
    } else if (!f->base_ok && rate(cross) >= DRIFT_MARGIN_ABS) {
        v->kind = DRIFT_INSUFFICIENT_DATA;
        reason(v,
               "cross pairs diverge %.1f%% (n=%u) but %u self samples cannot tell drift from "
               "batching noise: raise shadow.self_rate",
               drift_win_pct(rate(cross)), cross.n, self.n);
    } else {
        v->kind = DRIFT_CONSISTENT;
        reason(v, "cross pairs diverge %.1f%% (n=%u), self %.1f%% (n=%u): within the noise",
               drift_win_pct(rate(cross)), cross.n, drift_win_pct(rate(self)), self.n);
    }
}

bool drift_pool_is_suspect(const drift_pool_t *p, const char *replica)
{
    drift_verdict_t v;
    drift_pool_verdict(p, &v);
    return v.kind == DRIFT_CROSS_REPLICA_DRIFT && v.has_suspect && strcmp(v.suspect, replica) == 0;
}

bool drift_pool_replica_recovered(const drift_pool_t *p, const char *replica)
{
    int i = find_replica(p, replica);
    if (i < 0)
        return false;
    const drift_win_t *w = &p->recent[i];
    if (w->count < DRIFT_RECOVERY_SAMPLES)
        return false;
    uint32_t d = 0;
    for (uint32_t k = 0, j = (w->head + DRIFT_WINDOW - 1) % DRIFT_WINDOW;
         k < DRIFT_RECOVERY_SAMPLES; k++, j = (j + DRIFT_WINDOW - 1) % DRIFT_WINDOW)
        d += !w->ring[j].match;
    agg_t self = win_agg(&p->kind[DRIFT_SELF]);
    double base = self.n >= DRIFT_MIN_SAMPLES ? rate(self) : 0;
    return (double)d / DRIFT_RECOVERY_SAMPLES <= base + DRIFT_RECOVERY_MARGIN;
}

/* ---- rendering ---------------------------------------------------------------------------- */

static void render_summary(dp_jw_t *w, const drift_summary_t *s, bool median)
{
    dp_jw_uint(w, "samples", s->samples);
    dp_jw_uint(w, "diverged", s->diverged);
    dp_jw_double(w, "exact_match_rate", s->exact_match_rate);
    dp_jw_double(w, "mean_similarity", s->mean_similarity);
    if (median) {
        if (s->median_divergence_offset >= 0)
            dp_jw_int(w, "median_divergence_offset", s->median_divergence_offset);
        else
            dp_jw_null(w, "median_divergence_offset");
    }
    dp_jw_uint(w, "samples_total", s->total_samples);
    dp_jw_uint(w, "matches_total", s->total_matches);
}

void drift_render_pool(dp_jw_t *w, const char *key, const drift_pool_t *p)
{
    drift_summary_t s;
    dp_jw_obj_begin(w, key);
    for (int k = 0; k < 2; k++) {
        dp_jw_obj_begin(w, drift_kind_name((drift_kind_t)k));
        drift_pool_summary(p, (drift_kind_t)k, &s);
        render_summary(w, &s, false);
        dp_jw_obj_end(w);
    }

    dp_jw_arr_begin(w, "pairs");
    for (int j = 0; j < DRIFT_MAX_REPLICAS; j++) {
        for (int i = 0; i <= j; i++) {
            const drift_win_t *pw = &p->pairs[pair_index(i, j)];
            if (p->replicas[i] == NULL || p->replicas[j] == NULL || pw->total == 0)
                continue;
            dp_jw_obj_begin(w, NULL);
            dp_jw_str(w, "kind", drift_kind_name(i == j ? DRIFT_SELF : DRIFT_CROSS));
            dp_jw_arr_begin(w, "replicas");
            dp_jw_str(w, NULL, p->replicas[i]);
            dp_jw_str(w, NULL, p->replicas[j]);
            dp_jw_arr_end(w);
            drift_win_summary(pw, &s);
            render_summary(w, &s, true);
            dp_jw_obj_end(w);
        }
    }
    dp_jw_arr_end(w);

    dp_jw_obj_begin(w, "replicas");
    for (int i = 0; i < DRIFT_MAX_REPLICAS; i++) {
        if (p->replicas[i] == NULL)
            continue;
        dp_jw_obj_begin(w, p->replicas[i]);
        drift_win_summary(&p->recent[i], &s);
        dp_jw_uint(w, "cross_samples", s.samples);
        dp_jw_double(w, "cross_divergence_rate", s.divergence_rate);
        dp_jw_bool(w, "within_self_baseline", drift_pool_replica_recovered(p, p->replicas[i]));
        const change_t *c = &p->changes[i];
        if (c->set) {
            char at[32];
            dp_iso8601(at, c->at_ms);
            dp_jw_obj_begin(w, "last_change");
            dp_jw_str(w, "what", c->what);
            dp_jw_str(w, "at", at);
            dp_jw_obj_end(w);
        } else {
            dp_jw_null(w, "last_change");
        }
        dp_jw_obj_end(w);
    }
    dp_jw_obj_end(w);

    drift_verdict_t v;
    drift_pool_verdict(p, &v);
    dp_jw_str(w, "verdict", drift_verdict_name(v.kind));
    if (v.has_suspect)
        dp_jw_str(w, "suspect", v.suspect);
    else
        dp_jw_null(w, "suspect");
    dp_jw_arr_begin(w, "reasons");
    for (int i = 0; i < v.nreasons; i++)
        dp_jw_str(w, NULL, v.reasons[i]);
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

void drift_render(dp_buf_t *out, const drift_pool_t *const *pools, size_t n)
{
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_uint(&w, "window", DRIFT_WINDOW);
    dp_jw_obj_begin(&w, "pools");
    for (size_t i = 0; i < n; i++)
        drift_render_pool(&w, pools[i]->name, pools[i]);
    dp_jw_obj_end(&w);
    dp_jw_obj_end(&w);
}

/* ---- 5. pooled statistics ------------------------------------------------------------------ */

void drift_pool_export(const drift_pool_t *p, dp_jw_t *w, const char *key)
{
    drift_summary_t s;
    dp_jw_arr_begin(w, key);
    for (int j = 0; j < DRIFT_MAX_REPLICAS; j++) {
        for (int i = 0; i <= j; i++) {
            const drift_win_t *pw = &p->pairs[pair_index(i, j)];
            if (p->replicas[i] == NULL || p->replicas[j] == NULL || pw->count == 0)
                continue;
            drift_win_summary(pw, &s);
            dp_jw_arr_begin(w, NULL);
            dp_jw_str(w, NULL, p->replicas[i]);
            dp_jw_str(w, NULL, p->replicas[j]);
            dp_jw_uint(w, NULL, pw->count);
            dp_jw_uint(w, NULL, pw->diverged);
            dp_jw_double(w, NULL, pw->sim_sum);
            dp_jw_int(w, NULL, s.median_divergence_offset);
            dp_jw_arr_end(w);
        }
    }
    dp_jw_arr_end(w);
}

int drift_pool_import(drift_pool_t *p, const cJSON *pairs)
{
    if (!cJSON_IsArray(pairs))
        return -EINVAL;
    const cJSON *e;
    cJSON_ArrayForEach(e, pairs)
    {
        const cJSON *a = cJSON_GetArrayItem(e, 0), *b = cJSON_GetArrayItem(e, 1),
                    *n = cJSON_GetArrayItem(e, 2), *d = cJSON_GetArrayItem(e, 3),
                    *sim = cJSON_GetArrayItem(e, 4), *off = cJSON_GetArrayItem(e, 5);
        if (!cJSON_IsString(a) || !cJSON_IsString(b) || !cJSON_IsNumber(n) || !cJSON_IsNumber(d) ||
            !cJSON_IsNumber(sim) || !cJSON_IsNumber(off) || n->valuedouble < 0 ||
            n->valuedouble > DRIFT_WINDOW || d->valuedouble < 0 || d->valuedouble > n->valuedouble)
            return -EINVAL;
        uint32_t nn = (uint32_t)n->valuedouble, dd = (uint32_t)d->valuedouble;
        /* Matches have similarity 1; the diverged ones share the rest of the sum. */
        double dsim = dd ? (sim->valuedouble - (double)(nn - dd)) / dd : 1.0;
        dsim = dsim < 0 ? 0 : dsim > 1 ? 1 : dsim;
        int64_t o = off->valuedouble < 0 ? 0 : dp_sat_i64(off->valuedouble);
        for (uint32_t k = 0; k < nn; k++) {
            /* The diverged samples spread evenly among the matches. */
            bool div = (uint64_t)(k + 1) * dd / nn > (uint64_t)k * dd / nn;
            drift_result_t r = {
                .match = !div, .divergence_offset = div ? o : -1, .similarity = div ? dsim : 1.0};
            if (drift_pool_add(p, a->valuestring, b->valuestring, &r) != 0)
                return -EINVAL;
        }
    }
    return 0;
}

void drift_pool_copy_hints(drift_pool_t *dst, const drift_pool_t *src)
{
    for (int i = 0; i < DRIFT_MAX_REPLICAS; i++)
        if (src->replicas[i] && src->hinted[i])
            drift_pool_set_hint(dst, src->replicas[i], &src->hints[i]);
}
