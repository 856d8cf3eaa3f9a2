/* Replica admission (docs/attestation.md §2-§6): one timer per replica re-attests it every
 * interval_ms with a fresh nonce, and at once after a failed connection. A check is probe_start()
 * (probe/probe.h: the agent envelope, or a native adapter's endpoints and the engine-fingerprint
 * probe, or GET /v1/models for reachability; the same check diagnose and the agent run), then
 * attest_check_judge() against the pool manifest in force when it answers, and for admitted
 * replicas of a manifest with a canary, the canary prompt through the same upstream code as
 * client traffic.
 *
 * Per-replica state (att_t) outlives its replica by one close callback: when a replica is freed
 * (reload, discovery) its in-flight fetches are cancelled and the timer closes, then att_t goes. */
#include "proxy/control/attest.h"

#include <netdb.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "attest/check.h"
#include "attest/dsse.h"
#include "attest/match.h"
#include "attest/report.h"
#include "common/log.h"
#include "common/util.h"
#include "probe/probe.h"
#include "proxy/control/admin.h"
#include "proxy/control/fleet.h"
#include "proxy/core/self.h"
#include "net/resolve.h"
#include "policy/policy.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"
#include "proxy/data/admission.h"
#include "proxy/data/worker.h"

#define RECHECK_MIN_MS 100 /* out-of-turn re-checks: at most this often */
/* ... but a held replica's (clients wait for it; each is one cheap read, no probe or canary) */
#define HOLD_RECHECK_MIN_MS 10
#define UNREACHABLE_RECHECK_MS 1000 /* an unreachable replica is retried at least this often */
/* Checks running at once, over all replicas: 200 discovered addresses must not become 400
 * simultaneous connections. A check over the bound waits and starts within PACE_MS or so. */
#define MAX_CONCURRENT_CHECKS 16
#define PACE_MS 25
/* The probe completion and the canary wait for a free slot on the replica, looking this often,
 * for at most the attestation timeout_ms. */
#define SLOT_RETRY_MS 10

struct px_attest_ctx_s {
    attest_keyset_t keys;
    bool stopped;
    uint32_t running;     /* checks in flight (att_t.checking) */
    net_drains_t orphans; /* requests kept past their check (orphan_keep) */
};
typedef struct px_attest_ctx_s att_ctx_t;

typedef struct att_s {
    px_replica_t *r; /* NULL once the replica is gone */
    px_t *px;
    uv_timer_t timer;
    net_upstream_t *up; /* to the agent, or to the replica for metadata (short timeouts) */
    probe_t *probe;     /* the check in flight */
    probe_canary_t *canary;
    probe_t *engine_read; /* after a canary mismatch: the engine's own metadata */
    bool recheck; /* a fingerprint mismatch or a close arrived during a check: check again */
    bool checking;
    /* One of the replica's admission slots, held by the check's own request to it (the probe
     * completion, then the canary): they are requests like any other there. */
    bool holds_slot;
    /* ... and the pool it was taken under lets the engine finish an answer whose connection
     * closed (policy_pool_drains_abandoned): a request holding it is drained (orphan_keep). Set
     * then, for a reload may rename or remove the pool while the engine stays. */
    bool slot_drains;
    uint64_t slot_wait_ns; /* when the wait for a slot began; 0: not waiting */
    /* The next check probes whatever client responses carried: something happened to the
     * replica (a failed connection, another fingerprint on a response). */
    bool must_probe;
    uint64_t last_check_ms;
    attest_report_t report;
    bool have_report;
    attest_canary_t canary_hist;
    bool admit_on_canary; /* metadata matched; admission waits for a matching canary */
    char canary_last[65];
    char canary_bad[65]; /* the output hash of the last mismatching canary */
    /* Something this instance saw (a failed connection, another fingerprint on a response)
     * wants a check here, whoever holds the replica's attestation duty in the fleet. */
    bool local_due;
    /* Clients wait for this check: the replica was held (px_replica_t.unverified) or a request
     * wanted a new connection to it (conn_wanted) when it began. It is about identity (no
     * canary on an admitted replica, no probe completion), and out of turn. */
    bool hold_check;
    /* A request wanted a new connection while this check ran: another check follows it (this
     * one's verdict still stands; it began before that need). */
    bool wanted_after;
    uint64_t seq;          /* this check's number (px_replica_t.check_begun) */
    uint64_t periodic_ms;  /* loop time the next regular check is due (0: none scheduled yet) */
    uint32_t unreach_ms;   /* the re-check interval while unreachable after a hold (0: regular) */
    char verdict_from[64]; /* the fleet member whose verdict is in force; "": checked here */
} att_t;

static void check_start(att_t *a);

/* The configuration in force now. Never keep a pointer to one across callbacks: a reload may
 * free the generation a check started under while its fetches are still running. */
static const cfg_t *cur(const att_t *a)
{
    return a->px->gen->cfg;
}

static void timer_cb(uv_timer_t *t)
{
    check_start(t->data);
}

static att_ctx_t *ctx(px_t *px)
{
    return px->attest;
}

/* Nothing new is checked: the process is stopping, or the context is gone (a replica a reload
 * replaced can outlive it while something holds it). */
static bool att_off(px_t *px)
{
    return ctx(px) == NULL || ctx(px)->stopped;
}

static void count(const px_replica_t *r, const char *result)
{
    px_metrics_add(px_metrics_get("detproxy_attestations_total", "pool", r->pool_name, "replica",
                                  r->name, "result", result, NULL),
                   1);
}

/* A check that matched the metadata and had a canary counts as what it left the replica:
 * admitted (serving after it), or pending (waiting for its canary to match). */
static void count_outcome(const px_replica_t *r)
{
    count(r, px_replica_state(r) == PX_REPLICA_ADMITTED ? "admitted" : "pending");
}

/* The pool definition currently holding this replica (the generation may have changed). */

static const cfg_pool_t *pool_of(px_t *px, const px_replica_t *r)
{
    px_pool_t *p = px_gen_pool_by_name(px->gen, r->pool_name);
    return p ? p->cfg : NULL;
}

/* The pool's signature rule; the top level's for a replica whose pool a reload removed. */
static bool require_signature(const att_t *a, const cfg_pool_t *pc)
{
    return pc ? cfg_pool_require_signature(cur(a), pc) : cur(a)->attestation.require_signature;
}

static void set_state(px_replica_t *r, px_replica_state_t st, const attest_reasons_t *why)
{
    const char *list[PX_MAX_REASONS + 1] = {0};
    size_t n = 0;
    for (; why && n < why->count && n < PX_MAX_REASONS; n++)
        list[n] = why->items[n];
    px_replica_set_state(r, st, list);
}

static void set_state1(px_replica_t *r, px_replica_state_t st, const char *reason)
{
    const char *list[2] = {reason, NULL};
    px_replica_set_state(r, st, reason ? list : NULL);
}

static void schedule(att_t *a, uint64_t ms)
{
    if (att_off(a->px))
        return;
    uv_timer_start(&a->timer, timer_cb, ms, 0);
}

/* Check again as soon as allowed: at most every RECHECK_MIN_MS, so a replica that keeps
 * failing connections or flapping its fingerprint cannot drive a storm of checks. */
/* How long until a check may start under this pace (ms since the last one began). */
static uint64_t pace_left(const att_t *a, uint64_t pace)
{
    uint64_t since = uv_now(a->px->loop) - a->last_check_ms;
    return since >= pace ? 0 : pace - since;
}

static void recheck_after(att_t *a, uint64_t pace)
{
    schedule(a, pace_left(a, pace));
}

static void recheck_soon(att_t *a)
{
    recheck_after(a, atomic_load(&a->r->unverified) ? HOLD_RECHECK_MIN_MS : RECHECK_MIN_MS);
}

/* Clients wait for a check of r: it is held, or a request wants a new connection to it (and
 * may hold one of its slots meanwhile). Our own requests to r then never wait for a slot. */
static bool clients_wait(const px_replica_t *r)
{
    return atomic_load(&r->unverified) || atomic_load(&r->conn_wanted);
}

/* A slot on the replica for one of our requests to it, under its pool's
 * max_inflight_per_replica: never while clients of the pool wait for one. */
static bool take_slot(att_t *a)
{
    px_pool_t *p = px_gen_pool_by_name(a->px->gen, a->r->pool_name);
    if (p == NULL || !px_replica_take_spare_slot(p, a->r))
        return false;
    a->holds_slot = true;
    a->slot_drains = policy_pool_drains_abandoned(p->cfg);
    return true;
}

static void put_slot(att_t *a)
{
    if (!a->holds_slot)
        return;
    a->holds_slot = false;
    px_admission_own_slot_done(a->px, a->r);
}

/* A check numbered seq has its verdict (the replica's state says it): a hold set before it
 * began goes (core/replica.h: hold_after), and clients queued meanwhile are woken to look; a
 * request waiting for a check begun from its number on may open its new connection. */
static void settle(px_t *px, px_replica_t *r, uint64_t seq)
{
    uint64_t was = atomic_load(&r->check_settled);
    while (was < seq && !atomic_compare_exchange_weak(&r->check_settled, &was, seq)) {
    }
    bool released = false;
    if (atomic_load(&r->unverified) && seq > atomic_load(&r->hold_after)) {
        atomic_store(&r->unverified, false);
        /* A worker that held it meanwhile (hold_after first, then the flag) keeps its hold. */
        if (seq <= atomic_load(&r->hold_after))
            atomic_store(&r->unverified, true);
        else
            released = true;
    }
    /* Requests waiting with a slot on r for this verdict (data/proxy.c) look again, once the
     * hold is gone; queued ones when it went. */
    if (atomic_load(&px->conn_waiting) > 0 || (released && atomic_load(&px->queued) > 0))
        px_workers_wake(px);
}

/* No check will decide (no attestation state, stopping, nothing to connect to): settled by a
 * number of its own, so neither the hold nor a cold start waits for ever. */
static void release_unchecked(px_t *px, px_replica_t *r)
{
    settle(px, r, atomic_fetch_add(&r->check_begun, 1) + 1);
}

/* Waiting for a slot: true while the wait is shorter than the attestation timeout (the caller
 * looks again in SLOT_RETRY_MS); false once it is over (the wait is forgotten). */
static bool keep_waiting(att_t *a)
{
    uint64_t now = dp_now_ns();
    if (a->slot_wait_ns == 0)
        a->slot_wait_ns = now;
    if (now - a->slot_wait_ns < (uint64_t)cur(a)->attestation.timeout_ms * 1000000u)
        return true;
    a->slot_wait_ns = 0;
    return false;
}

/* This check has its verdict (the replica's state says it): settle() by its number. Called
 * before a canary too, which can take a generation's time and judges an admitted replica on
 * its own; settling the same number twice is harmless. */
static void settle_hold(att_t *a)
{
    if (a->seq)
        settle(a->px, a->r, a->seq);
}

static void check_end(att_t *a)
{
    bool checked_here = a->checking && a->r && !a->recheck;
    if (a->r)
        put_slot(a);
    if (a->checking)
        ctx(a->px)->running--;
    a->checking = false;
    if (a->r == NULL)
        return;
    settle_hold(a);
    if (checked_here) {
        a->verdict_from[0] = '\0';
        px_fleet_attested(a->px, a->r, a->have_report ? &a->report : NULL);
    }
    if (a->recheck) {
        a->recheck = a->wanted_after = false;
        a->hold_check = false;
        recheck_soon(a);
        return;
    }
    /* A replica that went away usually comes back soon (restart, reschedule): look again
     * sooner than the interval so it is re-admitted, or caught as something else, quickly. */
    uint64_t now = uv_now(a->px->loop), next = cur(a)->attestation.interval_ms;
    if (a->hold_check) /* out of turn: the regular checks (and canaries) keep their beat */
        next = a->periodic_ms > now ? a->periodic_ms - now : 0;
    else
        a->periodic_ms = now + next;
    /* An engine that just went away under a hold (a restart, most often) is looked for every
     * RECHECK_MIN_MS at first, backing off to UNREACHABLE_RECHECK_MS: a fast restart is back
     * in service within a tenth of a second of answering. */
    if (a->r->state == PX_REPLICA_UNREACHABLE) {
        if (a->hold_check)
            a->unreach_ms = RECHECK_MIN_MS;
        else if (a->unreach_ms)
            a->unreach_ms = a->unreach_ms * 2 < UNREACHABLE_RECHECK_MS ? a->unreach_ms * 2
                                                                       : UNREACHABLE_RECHECK_MS;
        uint64_t cap = a->unreach_ms ? a->unreach_ms : UNREACHABLE_RECHECK_MS;
        if (next > cap)
            next = cap;
    } else {
        a->unreach_ms = 0;
    }
    a->hold_check = false;
    /* A request wanted a new connection while this check ran: the next one is its, as soon as
     * the pace allows. */
    if (a->wanted_after) {
        a->wanted_after = false;
        uint64_t pace = pace_left(a, HOLD_RECHECK_MIN_MS);
        if (next > pace)
            next = pace;
    }
    schedule(a, next);
}

/* ---- canary (docs/attestation.md §6) ------------------------------------------------------ */

/* The canary's last verdict, where drift verdicts read it (replica.h). */
static void publish_canary(att_t *a)
{
    const attest_canary_t *h = &a->canary_hist;
    a->r->canary = h->count == 0 ? PX_CANARY_UNKNOWN
                   : h->bits & 1 ? PX_CANARY_FAIL
                                 : PX_CANARY_PASS;
}

/* ---- after a canary mismatch: what the engine itself says ---------------------------------- */

/* One more reason on r, in whatever state it is in now. */
static void add_reason(px_replica_t *r, const char *reason)
{
    attest_reasons_t why = {0}; /* copies: px_replica_set_state frees r's own */
    for (size_t n = 0; n < r->nreasons && n < PX_MAX_REASONS - 1; n++) {
        if (strcmp(r->reasons[n], reason) == 0) {
            attest_reasons_free(&why);
            return;
        }
        attest_reasons_add(&why, "%s", r->reasons[n]);
    }
    attest_reasons_add(&why, "%s", reason);
    set_state(r, r->state, &why);
    attest_reasons_free(&why);
}

/* The canary says the model behaves otherwise than the identity it was attested as: the
 * engine's own metadata (GETs only: no sequence, no slot) says what differs, or that nothing
 * the engine reports does. The reason goes beside the canary's on /admin/replicas and the
 * status page. */
static void engine_read_done(attest_outcome_t *out, void *data)
{
    att_t *a = data;
    a->engine_read = NULL;
    px_replica_t *r = a->r;
    if (out->verdict != ATTEST_V_REPORTED || !a->have_report ||
        (r->state != PX_REPLICA_REJECTED && r->state != PX_REPLICA_PENDING))
        return; /* no answer, or it recovered meanwhile */
    attest_reasons_t why = {0};
    attest_engine_reason(&a->report, &out->report, &why);
    if (why.count)
        add_reason(r, why.items[0]);
    attest_reasons_free(&why);
}

static void engine_read_start(att_t *a)
{
    cfg_attest_source_t src = a->have_report ? attest_engine_source(&a->report) : CFG_ATTEST_NONE;
    const cfg_pool_t *pc = pool_of(a->px, a->r);
    /* A native source's identity is the engine's metadata already: only a signed one (the
     * agent's) can differ from what the engine says. */
    if (src == CFG_ATTEST_NONE || a->r->attest.source != CFG_ATTEST_AGENT || a->engine_read ||
        a->r->up == NULL || pc == NULL)
        return;
    probe_opts_t o = {.up = a->r->up,
                      .source = src,
                      .hostport = a->r->url.hostport,
                      .base = a->r->url.path,
                      .bearer = pc->api_key,
                      .via = px_self_via_line(NULL),
                      .known_fingerprint = "", /* never a completion: metadata only */
                      .metadata_fingerprint = true,
                      .deadline_ms = cur(a)->attestation.timeout_ms};
    a->engine_read = probe_start(&o, engine_read_done, a);
}

static void orphan_read_on(att_t *a, net_fetch_t *f);
static void orphan_hold(att_t *a);

static void canary_done(const probe_canary_result_t *res, void *data)
{
    att_t *a = data;
    a->canary = NULL;
    orphan_read_on(a, res->open);
    if (res->may_run)
        orphan_hold(a);
    px_replica_t *r = a->r;
    const cfg_pool_t *pc = pool_of(a->px, r);
    if (pc == NULL || pc->manifest == NULL || pc->manifest->canary == NULL) {
        check_end(a); /* a reload removed the canary meanwhile */
        return;
    }
    if (!res->answered) {
        /* No answer says nothing about the model: reachability is the metadata check's job. */
        dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "canary_failed");
        if (w) {
            dp_jw_str(w, "pool", r->pool_name);
            dp_jw_str(w, "replica", r->name);
            dp_jw_int(w, "status", res->status);
            dp_jw_str(w, "detail", res->error);
            dp_log_end(w);
        }
        count_outcome(r);
        check_end(a);
        return;
    }
    bool ok = res->matched;
    memcpy(a->canary_last, res->sha256, sizeof(a->canary_last));
    if (!ok)
        memcpy(a->canary_bad, res->sha256, sizeof(a->canary_bad));
    count(r, ok ? "canary_ok" : "canary_mismatch");
    bool rejected = attest_canary_record(&a->canary_hist, ok);
    publish_canary(a);
    if (!rejected && ok && a->admit_on_canary) {
        /* Metadata matched and the model answered as expected: now it may take traffic. */
        a->admit_on_canary = false;
        set_state(r, PX_REPLICA_ADMITTED, NULL);
    } else if (!rejected && !ok && a->admit_on_canary) {
        attest_reasons_t why = {0};
        attest_canary_reason(a->canary_last, res->expected, &why);
        set_state(r, PX_REPLICA_PENDING, &why);
        attest_reasons_free(&why);
        engine_read_start(a);
    }
    if (rejected)
        count(r, "rejected");
    else
        count_outcome(r);
    if (rejected) {
        char why[200];
        if (ok) /* recovering: this one matched, two of the last three did not */
            snprintf(why, sizeof(why),
                     "canary mismatch in 2 of the last 3 checks (the last mismatch: output "
                     "sha256 %.8s.. want %.8s..; the latest check matched)",
                     a->canary_bad, res->expected);
        else
            snprintf(why, sizeof(why),
                     "canary mismatch: output sha256 %.8s.. want %.8s.. in 2 of the last 3 "
                     "checks",
                     a->canary_last, res->expected);
        set_state1(r, PX_REPLICA_REJECTED, why);
        if (!ok)
            engine_read_start(a);
    } else if (!ok) {
        dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "canary_mismatch");
        if (w) {
            dp_jw_str(w, "pool", r->pool_name);
            dp_jw_str(w, "replica", r->name);
            dp_jw_str(w, "got_sha256", a->canary_last);
            dp_jw_str(w, "want_sha256", res->expected);
            dp_log_end(w);
        }
    }
    check_end(a);
}

static void canary_start(att_t *a, const cfg_pool_t *pc, const cfg_manifest_t *id);

static void canary_try(att_t *a);

static void canary_retry_cb(uv_timer_t *t)
{
    canary_try(t->data);
}

/* The canary waits for a free slot (at most timeout_ms), or is skipped this interval and
 * counted (detproxy_attestations_total{result="canary_skipped"}): a replica waiting for its
 * canary to be admitted stays out until one runs. */
static void canary_try(att_t *a)
{
    const cfg_pool_t *pc = pool_of(a->px, a->r);
    const cfg_manifest_t *id = pc && pc->manifest && a->have_report
                                   ? attest_manifest_identity(pc->manifest, &a->report)
                                   : NULL;
    if (id == NULL || id->canary == NULL || a->r->up == NULL || att_off(a->px)) {
        check_end(a); /* a reload removed the canary meanwhile */
        return;
    }
    if (!take_slot(a)) {
        /* Held or wanted meanwhile: clients wait for the check that follows this one (some
         * with a slot), so this canary would only wait for slots they block: skipped, not
         * waited for. */
        if (!clients_wait(a->r) && keep_waiting(a)) {
            uv_timer_start(&a->timer, canary_retry_cb, SLOT_RETRY_MS, 0);
            return;
        }
        a->slot_wait_ns = 0;
        count(a->r, "canary_skipped");
        count_outcome(a->r);
        check_end(a);
        return;
    }
    a->slot_wait_ns = 0;
    canary_start(a, pc, id);
}

static void canary_start(att_t *a, const cfg_pool_t *pc, const cfg_manifest_t *id)
{
    /* The replica's own upstream: the canary takes the path client traffic takes. */
    const probe_route_t to = {.hostport = a->r->url.hostport,
                              .base = a->r->url.path,
                              .bearer = pc->api_key,
                              .via = px_self_via_line(NULL),
                              .length_required = px_replica_drains_abandoned(a->r),
                              .deadline_ms = probe_answer_deadline_ms(cur(a))};
    a->canary = probe_canary_start(a->r->up, pc, id, &to, canary_done, a);
}

/* ---- the metadata check ---------------------------------------------------------------------- */

/* A REPORTED outcome, judged against the manifest in force now. */
static void decide(att_t *a, attest_outcome_t *out)
{
    px_replica_t *r = a->r;
    if (a->recheck) {
        /* A response showed a changed engine while this check ran: what it read may predate
         * the change. It admits nothing; the check that follows decides. */
        check_end(a);
        return;
    }
    const cfg_pool_t *pc = pool_of(a->px, r);
    const cfg_manifest_t *m = pc ? pc->manifest : NULL;
    attest_check_judge(out, m, require_signature(a, pc));
    const attest_report_t *rep = &out->report;
    for (int f = 0; a->have_report && f < ATTEST_F__COUNT; f++) {
        const char *was = attest_report_get(&a->report, (attest_field_t)f);
        const char *now = attest_report_get(rep, (attest_field_t)f);
        if (was == NULL ? now != NULL : now == NULL || strcmp(was, now) != 0) {
            r->identity_changed_ms = dp_wall_ms(); /* a drift suspect hint (drift.h) */
            break;
        }
    }
    attest_report_clear(&a->report);
    attest_report_copy(&a->report, rep);
    a->have_report = true;
    px_seqstr_set(&r->engine_fp, a->report.engine_fingerprint); /* for the workers' checks */
    r->last_attested_at = dp_wall_ms();
    /* What admitted it, for the audit lines of the requests it serves from now on. */
    px_replica_set_evidence(r, out->verdict == ATTEST_V_ADMITTED ? &out->evidence : NULL);
    if (out->verdict != ATTEST_V_ADMITTED) {
        count(r, "rejected");
        r->fingerprint[0] = '\0'; /* no accepted identity */
        px_seqstr_set(&r->wfingerprint, "");
        set_state(r, PX_REPLICA_REJECTED, &out->reasons);
        attest_canary_reset(&a->canary_hist);
        publish_canary(a);
        check_end(a);
        return;
    }
    /* The identity it matched (one of several during a rollout) gives its responses their
     * fingerprint and its canary. */
    const cfg_manifest_t *id = attest_manifest_identity(m, rep);
    px_pool_t *pool = px_gen_pool_by_name(a->px->gen, r->pool_name);
    snprintf(r->fingerprint, sizeof(r->fingerprint), "%s",
             id     ? id->fingerprint
             : pool ? pool->fingerprint
                    : "");
    px_seqstr_set(&r->wfingerprint, r->fingerprint);
    /* With a canary, a replica that is not admitted yet (new, back from unreachable, or
     * rejected) is admitted only once its canary output matches too: fail closed. An admitted
     * one stays until the 2-of-3 rule rejects it (docs/attestation.md §6). A check asked for by a
     * hold leaves an admitted replica's canary to the regular checks: it is about identity, and
     * idle replicas ask for one every few seconds. */
    bool canary = id && id->canary && r->up && !(a->hold_check && r->state == PX_REPLICA_ADMITTED);
    a->admit_on_canary =
        canary && r->state != PX_REPLICA_ADMITTED && r->state != PX_REPLICA_QUARANTINED;
    if (!a->admit_on_canary && r->state != PX_REPLICA_QUARANTINED)
        set_state(r, PX_REPLICA_ADMITTED, NULL);
    if (!canary)
        count(r, "admitted"); /* with a canary, its answer decides what this check counts */
    if (canary) {
        settle_hold(a);
        canary_try(a);
        return;
    }
    check_end(a);
}

static void checked(attest_outcome_t *out, void *data)
{
    att_t *a = data;
    px_replica_t *r = a->r;
    orphan_read_on(a, probe_take_completion(a->probe));
    if (probe_completion_may_run(a->probe))
        orphan_hold(a);
    a->probe = NULL;
    put_slot(a); /* the probe completion's, if it sent one */
    switch (out->verdict) {
    case ATTEST_V_UNREACHABLE:
        count(r, "unreachable");
        set_state(r, PX_REPLICA_UNREACHABLE, &out->reasons);
        check_end(a);
        break;
    case ATTEST_V_INVALID:
        count(r, "rejected");
        set_state(r, PX_REPLICA_REJECTED, &out->reasons);
        check_end(a);
        break;
    default:
        decide(a, out);
        break;
    }
}

static void check_start(att_t *a)
{
    px_replica_t *r = a->r;
    if (r == NULL || a->checking || att_off(a->px))
        return;
    /* In a fleet, another member may hold this replica's attestation duty: its published
     * verdict is applied here instead (px_attest_apply_verdict). */
    if (!a->local_due && !px_fleet_should_attest(a->px, r)) {
        schedule(a, cur(a)->attestation.interval_ms);
        return;
    }
    /* Held, or wanted for a new connection: clients wait for this check, so it neither queues
     * behind other replicas' checks (each replica asks at most every HOLD_RECHECK_MIN_MS) nor
     * waits for a slot for its probe. */
    bool held = clients_wait(r);
    if (!held && ctx(a->px)->running >= MAX_CONCURRENT_CHECKS) {
        /* Jittered, so waiting checks do not all retry in the same tick. */
        uint8_t j;
        dp_random_bytes(&j, 1);
        schedule(a, PACE_MS + j % PACE_MS);
        return;
    }
    const cfg_pool_t *pc = pool_of(a->px, r);
    /* A native source's check ends with a 1-token probe completion to the replica. Not needed
     * when a client response carried the attested engine fingerprint during the interval, nor
     * for a check a hold asked for on an admitted replica (its metadata says which model the
     * engine runs; clients wait for this check); else it holds a slot like any request there,
     * waiting for one at most timeout_ms, after which the fingerprint attested last stands for
     * this check. */
    const char *known = NULL;
    bool native = r->attest.source != CFG_ATTEST_AGENT && r->attest.source != CFG_ATTEST_NONE;
    if (native && a->up) {
        const char *last = a->have_report ? a->report.engine_fingerprint : NULL;
        uint64_t seen = atomic_load_explicit(&r->fp_seen_ns, memory_order_relaxed);
        uint64_t now = dp_now_ns();
        bool recent = seen && now - seen <= (uint64_t)cur(a)->attestation.interval_ms * 1000000u;
        if (last && !a->must_probe && r->state == PX_REPLICA_ADMITTED && (recent || held)) {
            known = last;
        } else if (!take_slot(a)) {
            /* Clients queued behind a held replica wait for this check: its metadata decides
             * then, without waiting for a slot they would have to give up first. */
            if (!held && keep_waiting(a)) {
                schedule(a, SLOT_RETRY_MS);
                return;
            }
            known = last ? last : "";
            count(r, "probe_skipped");
        }
        a->slot_wait_ns = 0;
        if (known == NULL)
            a->must_probe = false;
    }
    ctx(a->px)->running++;
    a->checking = true;
    a->local_due = false;
    /* Out of turn, a check clients wait for is about identity; one that falls due on the
     * regular beat stays a regular check (its canary runs after its verdict has released
     * them), so a steady stream of new connections cannot starve the canary. */
    uint64_t now_ms = uv_now(a->px->loop);
    a->hold_check = held && a->periodic_ms != 0 && now_ms < a->periodic_ms;
    /* Cleared before the number is drawn: a request that still saw it set drew its own number
     * first, so this check is one it waits for (px_event_connection_checked). */
    atomic_store(&r->conn_wanted, false);
    /* Every check goes over a new connection: a pooled one may still reach an engine a
     * balancer has since switched away from, and the checks that clients' new connections
     * wait for must see what a new connection reaches (one connect per check). */
    if (a->up)
        net_upstream_flush_idle(a->up);
    a->seq = atomic_fetch_add(&r->check_begun, 1) + 1;
    a->last_check_ms = uv_now(a->px->loop);
    if (a->up == NULL) {
        /* Nothing to connect to (the host name did not resolve). */
        ctx(a->px)->running--;
        a->checking = false;
        a->seq = 0;
        release_unchecked(a->px, r);
        schedule(a, cur(a)->attestation.interval_ms);
        return;
    }
    /* A replica (URL or discovered address) that is detproxy itself would attest through us
     * to whatever we forward to, and then take client requests round in a loop. */
    const char *self = NULL;
    if (px_self_is_listener(a->px, (const struct sockaddr *)&r->addr, &self)) {
        char why[160];
        snprintf(why, sizeof(why), "address %s is detproxy's own %s listener", r->url.hostport,
                 self);
        count(r, "rejected");
        set_state1(r, PX_REPLICA_REJECTED, why);
        check_end(a);
        return;
    }
    bool agent = r->attest.source == CFG_ATTEST_AGENT;
    probe_opts_t o = {.up = a->up,
                      .source = r->attest.source,
                      .hostport = agent ? r->attest.url.hostport : r->url.hostport,
                      .base = r->url.path,
                      .agent_path = r->attest.url.path,
                      .bearer = pc ? pc->api_key : NULL,
                      .via = px_self_via_line(NULL),
                      .keys = &ctx(a->px)->keys,
                      .require_signature = require_signature(a, pc),
                      .model = pc ? probe_canary_model(pc, NULL) : NULL,
                      .known_fingerprint = known,
                      .length_required = px_replica_drains_abandoned(r),
                      .deadline_ms = cur(a)->attestation.timeout_ms};
    a->probe = probe_start(&o, checked, a);
}

/* ---- per-replica lifecycle ------------------------------------------------------------------ */

/* A replica freed (a reload that changed its definition, discovery) while its canary or probe
 * completion generates on a single_sequence pool whose engine finishes an answer whose
 * connection closed (llama.cpp), or such a request of a check that failed with its exchange
 * still open (a timeout, an answer over its size cap): the request is left to end as a drain
 * (net/client.h) and its answer dropped, and only then is the slot freed (the engine's slots are
 * shared with the replica object that replaced it), as data/proxy.c does for a client's
 * (drain_abandoned). Ended at px_attest_stop. */

/* Can a's slot go to an orphan (see above)? */
static bool orphan_may(att_t *a)
{
    return a->holds_slot && (a->slot_drains || px_replica_drains_abandoned(a->r)) &&
           !att_off(a->px);
}

/* a's slot goes to a drain of f, a's request (net_fetch_drain: from the callback of its
 * first-byte timeout, or before any callback). */
static void orphan_keep(att_t *a, net_fetch_t *f)
{
    px_admission_drain_fetch(a->px, a->r, f, &ctx(a->px)->orphans,
                             policy_abandoned_drain_ms(&cur(a)->limits));
    a->holds_slot = false; /* the drain frees it */
}

/* Keep a's slot for its canary or probe completion still generating when a is torn down. */
static void orphan_adopt(att_t *a)
{
    if (!orphan_may(a))
        return;
    net_fetch_t *f = NULL;
    if (a->canary) {
        f = probe_canary_detach(a->canary);
        a->canary = NULL;
    } else {
        f = probe_take_completion(a->probe);
    }
    if (f)
        orphan_keep(a, f);
}

/* The same for a's request that failed with its exchange still open (its callback runs: no
 * answer within the first-byte timeout, one silent mid-way, or one over the size cap): the
 * engine may be generating it still, and what is left of the answer is read to its end. */
static void orphan_read_on(att_t *a, net_fetch_t *f)
{
    if (f && orphan_may(a))
        orphan_keep(a, f);
}

/* The same for a's request that failed once the engine had it, with no exchange left to read
 * (closed, cut mid-answer: net_up_err_may_run): a's slot is kept for as long as a drain would
 * have lasted. */
static void orphan_hold(att_t *a)
{
    if (!orphan_may(a))
        return;
    px_admission_hold(a->px, a->r, policy_abandoned_drain_ms(&cur(a)->limits));
    a->holds_slot = false; /* the hold frees it */
}

static void att_timer_closed(uv_handle_t *h)
{
    att_t *a = h->data;
    attest_report_clear(&a->report);
    free(a);
}

static void att_teardown(att_t *a)
{
    orphan_adopt(a);
    put_slot(a);
    px_seqstr_set(&a->r->engine_fp, ""); /* no report: nothing to compare responses with */
    a->r->canary = PX_CANARY_UNKNOWN;
    a->r->identity_changed_ms = 0;
    probe_cancel(a->probe);
    a->probe = NULL;
    probe_cancel(a->engine_read);
    a->engine_read = NULL;
    if (a->canary) {
        probe_canary_cancel(a->canary);
        a->canary = NULL;
    }
    if (a->up) {
        net_upstream_free(a->up);
        a->up = NULL;
    }
    if (a->r) {
        a->r->attest_state = NULL;
        atomic_store(&a->r->conn_wanted, false);
        release_unchecked(a->px, a->r);
    }
    a->r = NULL;
    if (a->checking && ctx(a->px))
        ctx(a->px)->running--;
    a->checking = false;
    uv_close((uv_handle_t *)&a->timer, att_timer_closed);
}

void px_attest_replica_free(px_replica_t *r)
{
    if (r->attest_state)
        att_teardown(r->attest_state);
}

static void att_adopt(px_t *px, px_replica_t *r)
{
    if (r->attest_state || !r->resolved)
        return;
    att_t *a = dp_xcalloc(1, sizeof(*a));
    a->r = r;
    a->px = px;
    /* Exported from the start at 0, so increase() sees the first mismatch. */
    px_metrics_add(px_metrics_get("detproxy_fingerprint_mismatch_total", "pool", r->pool_name,
                                  "replica", r->name, NULL),
                   0);
    r->attest_state = a;
    uv_timer_init(px->loop, &a->timer);
    a->timer.data = a;
    net_upstream_opts_t o;
    probe_attest_upstream_opts(px->gen->cfg, &o);
    struct sockaddr_storage ss;
    const struct sockaddr *addr = (const struct sockaddr *)&r->addr;
    if (r->attest.source == CFG_ATTEST_AGENT) {
        if (!net_resolve(r->attest.url.host, r->attest.url.port, &ss)) {
            set_state1(r, PX_REPLICA_UNREACHABLE, "attestation agent host did not resolve");
            return;
        }
        addr = (const struct sockaddr *)&ss;
    }
    a->up = net_upstream_new(px->loop, addr, &o);
    px_replica_upstream_tls(r, a->up,
                            r->attest.source == CFG_ATTEST_AGENT ? &r->attest.url : &r->url);
    uv_timer_start(&a->timer, timer_cb, 0, 0);
}

/* ---- module API ----------------------------------------------------------------------------- */

static void load_keys(px_t *px)
{
    att_ctx_t *c = ctx(px);
    attest_keyset_free(&c->keys);
    const cfg_attestation_t *at = &px->gen->cfg->attestation;
    for (size_t i = 0; i < at->ntrusted_keys; i++) {
        dp_buf_t err = {0};
        if (attest_keyset_add_file(&c->keys, at->trusted_keys[i], &err) != 0)
            dp_log_msg(DP_LOG_ERROR, "trusted_key_unreadable", err.base);
        dp_buf_free(&err);
    }
}

static bool apply_verdict(px_replica_t *r, const px_fleet_verdict_t *v);

void px_attest_start(px_t *px)
{
    px->attest = dp_xcalloc(1, sizeof(att_ctx_t));
    px_fleet_set_verdict_sink(px, apply_verdict);
    px_attest_sync(px);
}

void px_attest_sync(px_t *px)
{
    if (px->attest == NULL)
        return;
    load_keys(px);
    for (size_t i = 0; i < px->gen->npools; i++) {
        px_pool_t *p = &px->gen->pools[i];
        for (size_t k = 0; k < p->nreplicas; k++)
            att_adopt(px, p->replicas[k]);
    }
}

static void teardown_cb(px_replica_t *r, void *data)
{
    (void)data;
    if (r->attest_state)
        att_teardown(r->attest_state);
}

void px_attest_stop(px_t *px)
{
    att_ctx_t *c = ctx(px);
    if (c == NULL || c->stopped)
        return;
    c->stopped = true;
    net_drains_stop(&c->orphans);
    /* Every replica checked, not only the current generation's: one a reload replaced is still
     * checked while something (a relay waiting for its slot) holds it, and its timer must not
     * outlive the context. */
    px_replica_each_live(teardown_cb, NULL);
    attest_keyset_free(&c->keys);
    free(c);
    px->attest = NULL;
}

static void connection_failed_here(px_t *px, px_replica_t *r)
{
    PX_ASSERT_CONTROL();
    att_t *a = r->attest_state;
    if (a != NULL) {
        a->must_probe = true;
        a->local_due = true;
    }
    if (a == NULL || a->checking || att_off(px))
        return;
    /* A restarted replica may come back as something else: no new requests until re-admitted. */
    if (r->state == PX_REPLICA_ADMITTED)
        set_state1(r, PX_REPLICA_PENDING, "re-attesting after a failed connection");
    recheck_soon(a);
}

/* A check that clients wait for, out of turn: at once, or after the one in flight (which began
 * before the need and so decides nothing for it). False when nothing here would ever check r:
 * then it is settled unchecked, so no wait lasts for ever. */
static bool check_wanted_here(px_t *px, px_replica_t *r)
{
    PX_ASSERT_CONTROL();
    att_t *a = r->attest_state;
    if (a == NULL || r->attest.source == CFG_ATTEST_NONE || att_off(px)) {
        atomic_store(&r->conn_wanted, false);
        release_unchecked(px, r);
        return false;
    }
    a->local_due = true;
    if (a->checking)
        a->wanted_after = true;
    else
        recheck_after(a, HOLD_RECHECK_MIN_MS);
    return true;
}

/* The replica closed a connection: it may be another engine now (a restart on the same port, or
 * a balancer's switch, answers the next connection). It stays unverified, taking no new
 * requests, until a check that begins after this one has its verdict; the check starts at once
 * (or after the one in flight, whose answer may predate the restart and so admits nothing). A
 * keep-alive timeout looks the same from here, so an idle replica costs a check per close it
 * makes and one when traffic comes back. */
static void hold_here(px_t *px, px_replica_t *r)
{
    PX_ASSERT_CONTROL();
    if (!check_wanted_here(px, r))
        return;
    att_t *a = r->attest_state;
    if (a->checking) /* what it read may predate the close: it admits nothing */
        a->recheck = true;
    /* Held even if a check that began before this event released it meanwhile. */
    atomic_store(&r->unverified, true);
}

/* The control thread's half: out of service and re-attested, once per change. */
static void mismatch_here(px_t *px, px_replica_t *r, const char *seen)
{
    PX_ASSERT_CONTROL();
    att_t *a = r->attest_state;
    if (a == NULL || !a->have_report || a->report.engine_fingerprint == NULL ||
        strcmp(seen, a->report.engine_fingerprint) == 0)
        return; /* re-attested in the meantime */
    a->must_probe = true;
    a->local_due = true;
    if (r->state != PX_REPLICA_ADMITTED)
        return; /* already out of service, or already being re-attested */
    dp_buf_t why = {0};
    dp_buf_appends(&why, "engine fingerprint changed on a response: got ");
    attest_abbrev(seen, &why);
    dp_buf_appends(&why, " attested ");
    attest_abbrev(a->report.engine_fingerprint, &why);
    dp_buf_appends(&why, " (re-attesting)");
    set_state1(r, PX_REPLICA_PENDING, why.base);
    dp_buf_free(&why);
    /* The report stays what the replica attested: responses still in flight are compared with
     * it (and flagged) until the next check replaces it. */
    if (a->checking)
        a->recheck = true;
    else if (!att_off(px))
        recheck_soon(a);
}

const attest_report_t *px_attest_report(const px_replica_t *r)
{
    const att_t *a = r->attest_state;
    return a && a->have_report ? &a->report : NULL;
}

void px_attest_replica_json(dp_jw_t *w, const px_replica_t *r)
{
    const att_t *a = r->attest_state;
    dp_jw_obj_begin(w, "attestation");
    dp_jw_str(w, "source", cfg_attest_source_names[r->attest.source]);
    dp_jw_str(w, "verdict_from", a && a->verdict_from[0] ? a->verdict_from : NULL);
    if (a && a->have_report) {
        attest_report_write_json(&a->report, w, "report");
    } else {
        dp_jw_null(w, "report");
    }
    if (a && a->canary_hist.count) {
        dp_jw_obj_begin(w, "canary");
        dp_jw_uint(w, "checks", a->canary_hist.count);
        dp_jw_bool(w, "rejected", attest_canary_rejected(&a->canary_hist));
        dp_jw_str(w, "last_output_sha256", a->canary_last);
        dp_jw_obj_end(w);
    }
    dp_jw_obj_end(w);
}

void px_attest_on_event(px_t *px, const px_event_t *ev)
{
    switch (ev->kind) {
    case PX_EVENT_CONNECT_FAILED:
        connection_failed_here(px, ev->r);
        break;
    case PX_EVENT_PEER_CLOSED:
        hold_here(px, ev->r);
        break;
    case PX_EVENT_NEW_CONNECTION:
        check_wanted_here(px, ev->r);
        break;
    case PX_EVENT_FINGERPRINT:
        mismatch_here(px, ev->r, ev->seen);
        break;
    }
}

/* The fleet's verdict sink (px_fleet_set_verdict_sink). */
static bool apply_verdict(px_replica_t *r, const px_fleet_verdict_t *v)
{
    PX_ASSERT_CONTROL();
    att_t *a = r->attest_state;
    /* A check of our own in flight or due decides instead. */
    if (a == NULL || a->checking || a->local_due || att_off(a->px))
        return false;
    for (int f = 0; a->have_report && f < ATTEST_F__COUNT; f++) {
        const char *was = attest_report_get(&a->report, (attest_field_t)f);
        const char *now = v->report ? attest_report_get(v->report, (attest_field_t)f) : NULL;
        if (was == NULL ? now != NULL : now == NULL || strcmp(was, now) != 0) {
            r->identity_changed_ms = dp_wall_ms();
            break;
        }
    }
    attest_report_clear(&a->report);
    a->have_report = v->report != NULL;
    if (v->report)
        attest_report_copy(&a->report, v->report);
    /* Responses here are still compared with the attested engine fingerprint. */
    px_seqstr_set(&r->engine_fp, a->have_report ? a->report.engine_fingerprint : "");
    r->last_attested_at = v->at_ms;
    snprintf(r->fingerprint, sizeof(r->fingerprint), "%s",
             v->state == PX_REPLICA_ADMITTED && v->fingerprint ? v->fingerprint : "");
    px_seqstr_set(&r->wfingerprint, r->fingerprint);
    px_replica_set_evidence(r, v->state == PX_REPLICA_ADMITTED ? v->evidence : NULL);
    r->canary = v->canary;
    snprintf(a->verdict_from, sizeof(a->verdict_from), "%s", v->origin);
    /* A quarantine is the fleet's drift verdict, lifted on its own (fleet.c). */
    if (r->state != PX_REPLICA_QUARANTINED)
        px_replica_set_state(r, v->state, v->reasons);
    count(r, "fleet_verdict");
    return true;
}
