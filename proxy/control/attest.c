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
#include "proxy/core/self.h"
#include "net/resolve.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/core/px.h"
#include "proxy/data/worker.h"

#define RECHECK_MIN_MS 100          /* out-of-turn re-checks: at most this often */
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
    uint32_t running; /* checks in flight (att_t.checking) */
};
typedef struct px_attest_ctx_s att_ctx_t;

typedef struct att_s {
    px_replica_t *r; /* NULL once the replica is gone */
    px_t *px;
    uv_timer_t timer;
    net_upstream_t *up; /* to the agent, or to the replica for metadata (short timeouts) */
    probe_t *probe;     /* the check in flight */
    probe_canary_t *canary;
    bool recheck; /* a fingerprint mismatch arrived during a check: check again */
    bool checking;
    /* One of the replica's admission slots, held by the check's own request to it (the probe
     * completion, then the canary): they are requests like any other there. */
    bool holds_slot;
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

static void count(const px_replica_t *r, const char *result)
{
    px_metrics_add(px_metrics_get("detproxy_attestations_total", "pool", r->pool_name, "replica",
                                  r->name, "result", result, NULL),
                   1);
}

/* The pool definition currently holding this replica (the generation may have changed). */
static const cfg_pool_t *pool_of(px_t *px, const px_replica_t *r)
{
    px_pool_t *p = px_gen_pool_by_name(px->gen, r->pool_name);
    return p ? p->cfg : NULL;
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
    if (ctx(a->px)->stopped)
        return;
    uv_timer_start(&a->timer, timer_cb, ms, 0);
}

/* Check again as soon as allowed: at most every RECHECK_MIN_MS, so a replica that keeps
 * failing connections or flapping its fingerprint cannot drive a storm of checks. */
static void recheck_soon(att_t *a)
{
    uint64_t since = uv_now(a->px->loop) - a->last_check_ms;
    schedule(a, since >= RECHECK_MIN_MS ? 0 : RECHECK_MIN_MS - since);
}

/* A slot on the replica for one of our requests to it, under its pool's
 * max_inflight_per_replica: never while clients of the pool wait for one. */
static bool take_slot(att_t *a)
{
    px_pool_t *p = px_gen_pool_by_name(a->px->gen, a->r->pool_name);
    if (p == NULL || !px_replica_take_spare_slot(p, a->r))
        return false;
    a->holds_slot = true;
    return true;
}

static void put_slot(att_t *a)
{
    if (!a->holds_slot)
        return;
    a->holds_slot = false;
    px_replica_put_slot(a->r);
    if (atomic_load(&a->px->queued) > 0) /* a client queued for it: its worker looks */
        px_workers_wake(a->px);
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

static void check_end(att_t *a)
{
    if (a->r)
        put_slot(a);
    if (a->checking)
        ctx(a->px)->running--;
    a->checking = false;
    if (a->r == NULL)
        return;
    if (a->recheck) {
        a->recheck = false;
        recheck_soon(a);
        return;
    }
    /* A replica that went away usually comes back soon (restart, reschedule): look again
     * sooner than the interval so it is re-admitted, or caught as something else, quickly. */
    uint32_t next = cur(a)->attestation.interval_ms;
    if (a->r->state == PX_REPLICA_UNREACHABLE && next > UNREACHABLE_RECHECK_MS)
        next = UNREACHABLE_RECHECK_MS;
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

static void canary_done(const probe_canary_result_t *res, void *data)
{
    att_t *a = data;
    a->canary = NULL;
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
        check_end(a);
        return;
    }
    bool ok = res->matched;
    memcpy(a->canary_last, res->sha256, sizeof(a->canary_last));
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
    }
    if (rejected) {
        char why[160];
        snprintf(why, sizeof(why),
                 "canary mismatch: output sha256 %.8s.. want %.8s.. in 2 of "
                 "the last 3 checks",
                 a->canary_last, res->expected);
        set_state1(r, PX_REPLICA_REJECTED, why);
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
    if (id == NULL || id->canary == NULL || a->r->up == NULL || ctx(a->px)->stopped) {
        check_end(a); /* a reload removed the canary meanwhile */
        return;
    }
    if (!take_slot(a)) {
        if (keep_waiting(a)) {
            uv_timer_start(&a->timer, canary_retry_cb, SLOT_RETRY_MS, 0);
            return;
        }
        count(a->r, "canary_skipped");
        check_end(a);
        return;
    }
    a->slot_wait_ns = 0;
    canary_start(a, pc, id);
}

static void canary_start(att_t *a, const cfg_pool_t *pc, const cfg_manifest_t *id)
{
    /* The replica's own upstream: the canary takes the path client traffic takes. */
    a->canary = probe_canary_start(a->r->up, pc, id, a->r->url.hostport, a->r->url.path,
                                   px_self_via_line(NULL), canary_done, a);
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
    attest_check_judge(out, m, cur(a)->attestation.require_signature);
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
    count(r, "admitted");
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
     * one stays until the 2-of-3 rule rejects it (docs/attestation.md §6). */
    bool canary = id && id->canary && r->up;
    a->admit_on_canary =
        canary && r->state != PX_REPLICA_ADMITTED && r->state != PX_REPLICA_QUARANTINED;
    if (!a->admit_on_canary && r->state != PX_REPLICA_QUARANTINED)
        set_state(r, PX_REPLICA_ADMITTED, NULL);
    if (canary) {
        canary_try(a);
        return;
    }
    check_end(a);
}

static void checked(attest_outcome_t *out, void *data)
{
    att_t *a = data;
    px_replica_t *r = a->r;
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
    if (r == NULL || a->checking || ctx(a->px)->stopped)
        return;
    if (ctx(a->px)->running >= MAX_CONCURRENT_CHECKS) {
        /* Jittered, so waiting checks do not all retry in the same tick. */
        uint8_t j;
        dp_random_bytes(&j, 1);
        schedule(a, PACE_MS + j % PACE_MS);
        return;
    }
    const cfg_pool_t *pc = pool_of(a->px, r);
    /* A native source's check ends with a 1-token probe completion to the replica. Not needed
     * when a client response carried the attested engine fingerprint during the interval; else
     * it holds a slot like any request there, waiting for one at most timeout_ms, after which
     * the fingerprint attested last stands for this check. */
    const char *known = NULL;
    bool native = r->attest.source != CFG_ATTEST_AGENT && r->attest.source != CFG_ATTEST_NONE;
    if (native && a->up) {
        const char *last = a->have_report ? a->report.engine_fingerprint : NULL;
        uint64_t seen = atomic_load_explicit(&r->fp_seen_ns, memory_order_relaxed);
        uint64_t now = dp_now_ns();
        if (last && seen && !a->must_probe && r->state == PX_REPLICA_ADMITTED &&
            now - seen <= (uint64_t)cur(a)->attestation.interval_ms * 1000000u) {
            known = last;
        } else if (!take_slot(a)) {
            if (keep_waiting(a)) {
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
    a->last_check_ms = uv_now(a->px->loop);
    if (a->up == NULL) {
        /* Nothing to connect to (the host name did not resolve). */
        ctx(a->px)->running--;
        a->checking = false;
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
                      .require_signature = cur(a)->attestation.require_signature,
                      .model = pc ? probe_canary_model(pc, NULL) : NULL,
                      .known_fingerprint = known};
    a->probe = probe_start(&o, checked, a);
}

/* ---- per-replica lifecycle ------------------------------------------------------------------ */

static void att_timer_closed(uv_handle_t *h)
{
    att_t *a = h->data;
    attest_report_clear(&a->report);
    free(a);
}

static void att_teardown(att_t *a)
{
    put_slot(a);
    px_seqstr_set(&a->r->engine_fp, ""); /* no report: nothing to compare responses with */
    a->r->canary = PX_CANARY_UNKNOWN;
    a->r->identity_changed_ms = 0;
    probe_cancel(a->probe);
    a->probe = NULL;
    if (a->canary) {
        probe_canary_cancel(a->canary);
        a->canary = NULL;
    }
    if (a->up) {
        net_upstream_free(a->up);
        a->up = NULL;
    }
    if (a->r)
        a->r->attest_state = NULL;
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

void px_attest_start(px_t *px)
{
    px->attest = dp_xcalloc(1, sizeof(att_ctx_t));
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

void px_attest_stop(px_t *px)
{
    att_ctx_t *c = ctx(px);
    if (c == NULL || c->stopped)
        return;
    c->stopped = true;
    for (size_t i = 0; px->gen && i < px->gen->npools; i++) {
        px_pool_t *p = &px->gen->pools[i];
        for (size_t k = 0; k < p->nreplicas; k++)
            if (p->replicas[k]->attest_state)
                att_teardown(p->replicas[k]->attest_state);
    }
    attest_keyset_free(&c->keys);
    free(c);
    px->attest = NULL;
}

static void connection_failed_here(px_t *px, px_replica_t *r, bool deadmit)
{
    PX_ASSERT_CONTROL();
    att_t *a = r->attest_state;
    if (a != NULL)
        a->must_probe = true;
    if (a == NULL || a->checking || ctx(px) == NULL || ctx(px)->stopped)
        return;
    /* A restarted replica may come back as something else: no new requests until re-admitted. */
    if (deadmit && r->state == PX_REPLICA_ADMITTED)
        set_state1(r, PX_REPLICA_PENDING, "re-attesting after a failed connection");
    recheck_soon(a);
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
    else if (ctx(px) && !ctx(px)->stopped)
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
        connection_failed_here(px, ev->r, true);
        break;
    case PX_EVENT_CONNECTION_LOST:
        connection_failed_here(px, ev->r, false);
        break;
    case PX_EVENT_FINGERPRINT:
        mismatch_here(px, ev->r, ev->seen);
        break;
    }
}
