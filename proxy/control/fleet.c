/* See proxy/control/fleet.h. Keys under /detproxy/<fleet>/ (docs/fleet.md, "Keys"):
 *   instances/<instance>       a member, on its lease: version, config fingerprint, listeners
 *   drain/<pool>/<replica>     an operator drain or enable: drained, origin, reason, at
 *   quarantine/<pool>/<replica> a quarantine: origin, reason, at (deleted when it ends)
 *   verdicts/<pool>/<replica>  the latest attestation verdict, on its publisher's lease
 *   anchors/<instance>         the instance's latest audit checkpoint (seq, SHA-256), kept
 *   stats/<instance>           its drift windows' aggregates per pool and its candidates'
 *                              rollout aggregates, on its lease
 * One connect sequence at a time: lease, member key, writes that failed meanwhile, a read of
 * the whole prefix (the state to apply), then the watch from the revision after that read. */
#include "proxy/control/fleet.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <netinet/in.h>

#include <cjson/cJSON.h>

#include "common/log.h"
#include "common/util.h"
#include "common/version.h"
#include "drift/drift.h"
#include "drift/rollout.h"
#include "fleet/etcd.h"
#include "proxy/core/gen.h"
#include "proxy/core/pool.h"
#include "proxy/data/admission.h"
#include "proxy/data/hooks.h"
#include "proxy/data/shadow.h"
#include "proxy/control/seqlock.h"
#include "proxy/obs/audit.h"

/* The whole fleet state, read in one range at connect: bounded, but well above what a fleet's
 * keys hold (member keys, one verdict and one drain per replica, statistics per member); a
 * writer to the prefix that fills it past this keeps instances apart (docs/fleet.md: restrict
 * writers with etcd RBAC). */
#define FLEET_STATE_MAX ((size_t)64 << 20)

typedef struct {
    char *instance, *version, *listen, *admin;
    char fp[65];
    int64_t lease;           /* its instances/ key's: what it writes on its lease is its own */
    uint64_t lease_moved_ms; /* when its key last moved to another lease while it lived */
    uint64_t started_ms, seen_ms;
    bool skew;
} member_t;

/* A drain or quarantine the fleet holds. */
typedef struct {
    char *key; /* relative to the prefix: "drain/p/r1" */
    char *pool, *replica, *origin, *reason;
    bool drained;   /* drain/ */
    uint64_t at_ms; /* when it was decided */
    bool applied;   /* applied here (false: ours, or its origin is config_skew) */
} entry_t;

/* A replica's latest published attestation verdict, as this instance last saw it. */
typedef struct {
    char *key; /* "<pool>/<replica>" */
    char *origin;
    char state[16];
    uint64_t at_ms;  /* when its origin checked (wall) */
    uint64_t got_ms; /* when it reached us (loop time) */
    bool applied;    /* applied here */
} verdict_t;

/* A member's published statistics (stats/<instance>): the raw JSON, parsed when merged. */
typedef struct {
    char *instance;
    char *json;
} mstats_t;

/* Evidence larger than this is published by its SHA-256 alone. */
#define VERDICT_EVIDENCE_MAX (256 * 1024)

/* A write that failed while etcd was away, sent again on reconnect (the latest per key). */
typedef struct {
    char *key;
    char *value; /* NULL: delete */
} pending_t;

enum { ST_IDLE = 0, ST_GRANT, ST_RENEW, ST_MEMBER, ST_RANGE };

struct px_fleet_s {
    px_t *px;
    fleet_etcd_t *etcd;
    char *name;   /* the fleet's, as started: a reload does not move it (px_fleet_reloaded) */
    char *prefix; /* "/detproxy/<name>/" */
    char *instance;
    char fp[65];
    uint32_t ttl_ms;
    uv_timer_t tick;
    int64_t lease;
    int step; /* the connect sequence's step in flight */
    bool connected, ever_connected, stopping, keepalive_busy;
    uint64_t since_ms; /* connected or disconnected since */
    char why[400];     /* why it is disconnected */
    member_t *members;
    size_t nmembers;
    entry_t *entries;
    size_t nentries;
    pending_t *pending;
    size_t npending;
    verdict_t *verdicts;
    size_t nverdicts;
    mstats_t *stats;
    size_t nstats;
    char *stats_sent; /* what stats/<instance> holds now (NULL: to be written) */
    uint64_t verdicts_published, verdicts_applied, attested_overdue;
    uint32_t rate_share; /* rate_limit refills run at R / this */
    uint64_t anchor_seq; /* the audit checkpoint last written to anchors/<instance> */
    char anchor_sha[65];
    int64_t rev; /* the fleet state read up to here */
    /* The watch's liveness (watch_check): a write under the prefix the watch had not delivered
     * when last looked (lag_rev, 0: none), since lag_ms; a look in flight. */
    int64_t lag_rev;
    uint64_t lag_ms;
    bool check_busy;
    char ref_fp[65]; /* the fleet's fingerprint: most members', ties to the oldest member's */
    px_series_t *m_connected, *m_members;
    px_seqlock_t *seq; /* single_sequence engines taken in turn (NULL: no etcd client) */
    /* The lease surely lives until lease_until (dp_now_ms): the send time of the grant or
     * keep-alive that last set its TTL, plus that TTL. */
    uint64_t lease_until, call_sent_ms, keepalive_sent_ms;
    /* Our member key written back (loop ms), and one more write-back owed: at most one per
     * keep-alive period, so two live processes given one instance name do not rewrite it in
     * turn as fast as etcd answers. */
    uint64_t restored_ms;
    bool restore_due;
    int64_t restore_lease; /* the live lease it was last found on since, if another's */
};

static bool g_applying; /* a change the fleet applies is not published back */
static px_fleet_verdict_sink_t g_verdict_sink;

void px_fleet_set_verdict_sink(px_t *px, px_fleet_verdict_sink_t sink)
{
    (void)px;
    g_verdict_sink = sink;
}

static void count_event(const char *kind)
{
    px_metrics_add(px_metrics_get("detproxy_fleet_events_total", "kind", kind, NULL), 1);
}

/* ---- the config fingerprint ------------------------------------------------------------- */

/* SHA-256 of the effective config (defaults filled in, secrets redacted) without what differs
 * per instance by design: where the file is, the listeners and the instance name. */
static void config_fingerprint(const cfg_t *cfg, char out[65])
{
    dp_buf_t b = {0};
    cfg_dump_json(cfg, &b);
    cJSON *d = cJSON_ParseWithLength(b.base, b.len);
    dp_buf_free(&b);
    cJSON_DeleteItemFromObjectCaseSensitive(d, "config_path");
    cJSON_DeleteItemFromObjectCaseSensitive(d, "listen");
    cJSON_DeleteItemFromObjectCaseSensitive(d, "admin_listen");
    cJSON_DeleteItemFromObjectCaseSensitive(cJSON_GetObjectItemCaseSensitive(d, "fleet"),
                                            "instance");
    char *s = cJSON_PrintUnformatted(d);
    dp_sha256_hex(s ? s : "", s ? strlen(s) : 0, out);
    cJSON_free(s);
    cJSON_Delete(d);
}

/* The fleet section as /admin/config shows it (empty without one). */
static void fleet_section(const cfg_t *cfg, dp_buf_t *out)
{
    dp_buf_t b = {0};
    cfg_dump_json(cfg, &b);
    cJSON *d = cJSON_ParseWithLength(b.base, b.len);
    dp_buf_free(&b);
    char *s = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(d, "fleet"));
    if (s)
        dp_buf_appends(out, s);
    cJSON_free(s);
    cJSON_Delete(d);
}

/* ---- the view ------------------------------------------------------------------------------ */

static member_t *member_find(px_fleet_t *f, const char *inst)
{
    for (size_t i = 0; i < f->nmembers; i++)
        if (strcmp(f->members[i].instance, inst) == 0)
            return &f->members[i];
    return NULL;
}

static void member_clear(member_t *m)
{
    free(m->instance);
    free(m->version);
    free(m->listen);
    free(m->admin);
    memset(m, 0, sizeof(*m));
}

static void members_clear(px_fleet_t *f)
{
    for (size_t i = 0; i < f->nmembers; i++)
        member_clear(&f->members[i]);
    free(f->members);
    f->members = NULL;
    f->nmembers = 0;
}

static const char *jstr(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static uint64_t juint(const cJSON *o, const char *k)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(v) ? dp_sat_u64(v->valuedouble) : 0;
}

/* Which fingerprint the fleet runs: the most members', ties to the longest-running member's.
 * Every member computes the same from the same keys. */
static void compute_skew(px_fleet_t *f)
{
    const member_t *best = NULL;
    size_t best_n = 0;
    for (size_t i = 0; i < f->nmembers; i++) {
        size_t n = 0;
        for (size_t k = 0; k < f->nmembers; k++)
            n += strcmp(f->members[i].fp, f->members[k].fp) == 0;
        const member_t *m = &f->members[i];
        if (best == NULL || n > best_n ||
            (n == best_n &&
             (m->started_ms < best->started_ms ||
              (m->started_ms == best->started_ms && strcmp(m->instance, best->instance) < 0)))) {
            best = m;
            best_n = n;
        }
    }
    snprintf(f->ref_fp, sizeof(f->ref_fp), "%s", best ? best->fp : f->fp);
    for (size_t i = 0; i < f->nmembers; i++) {
        member_t *m = &f->members[i];
        bool skew = strcmp(m->fp, f->ref_fp) != 0;
        if (skew && !m->skew) {
            count_event("config_skew");
            dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "fleet_config_skew");
            if (w) {
                dp_jw_str(w, "instance", m->instance);
                dp_jw_str(w, "config_fingerprint", m->fp);
                dp_jw_str(w, "fleet_fingerprint", f->ref_fp);
                dp_log_end(w);
            }
        }
        m->skew = skew;
    }
    px_metrics_set(f->m_members, (double)f->nmembers);
    /* rate_limit by share: the live members split every tenant's rate (kept while etcd is
     * away: the others are still serving). */
    f->rate_share = f->nmembers ? (uint32_t)f->nmembers : 1;
    px_hooks_set_rate_share(f->rate_share);
}

static void member_put(px_fleet_t *f, const char *inst, const char *json, int64_t lease)
{
    cJSON *d = cJSON_Parse(json);
    const char *fpv = jstr(d, "config_fingerprint");
    if (!cJSON_IsObject(d) || fpv == NULL || strlen(fpv) != 64 ||
        strspn(fpv, "0123456789abcdef") != 64 || juint(d, "started_ms") == 0) {
        /* Not what a member writes (member_value): a key that does not say which
         * configuration it runs, or since when, would decide the fleet's fingerprint (a tie
         * goes to the earliest start) and put every member in config skew. */
        cJSON_Delete(d);
        return;
    }
    member_t *m = member_find(f, inst);
    bool joined = m == NULL;
    /* A live member's key moved to another lease: a restart of that instance before its old
     * lease expired, or someone else writing its key (whom the member writes back). */
    uint64_t moved = m && m->lease != lease ? uv_now(f->px->loop) : m ? m->lease_moved_ms : 0;
    if (m == NULL) {
        f->members = dp_xrealloc(f->members, (f->nmembers + 1) * sizeof(*f->members));
        m = &f->members[f->nmembers++];
        memset(m, 0, sizeof(*m));
    } else {
        bool skew = m->skew;
        member_clear(m);
        m->skew = skew;
    }
    m->instance = dp_xstrdup(inst);
    const char *v = jstr(d, "version"), *fp = jstr(d, "config_fingerprint");
    m->version = dp_xstrdup(v ? v : "");
    snprintf(m->fp, sizeof(m->fp), "%s", fp ? fp : "");
    m->listen = dp_xstrdup(jstr(d, "listen") ? jstr(d, "listen") : "");
    m->admin = dp_xstrdup(jstr(d, "admin_listen") ? jstr(d, "admin_listen") : "");
    m->started_ms = juint(d, "started_ms");
    m->lease = lease;
    m->lease_moved_ms = moved;
    m->seen_ms = dp_wall_ms();
    cJSON_Delete(d);
    if (joined && strcmp(inst, f->instance) != 0) {
        count_event("member_joined");
        dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "fleet_member_joined");
        if (w) {
            dp_jw_str(w, "instance", inst);
            dp_log_end(w);
        }
    }
}

static void member_del(px_fleet_t *f, const char *inst)
{
    member_t *m = member_find(f, inst);
    if (m == NULL)
        return;
    count_event("member_left");
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "fleet_member_left");
    if (w) {
        dp_jw_str(w, "instance", inst);
        dp_log_end(w);
    }
    member_clear(m);
    *m = f->members[--f->nmembers];
}

static bool origin_skewed(px_fleet_t *f, const char *origin)
{
    const member_t *m = member_find(f, origin);
    /* A member that left is judged by the fingerprint it had: unknown ones are applied, since
     * an operator's drain outlives the instance it was made on. */
    return m != NULL && m->skew;
}

static entry_t *entry_find(px_fleet_t *f, const char *key)
{
    for (size_t i = 0; i < f->nentries; i++)
        if (strcmp(f->entries[i].key, key) == 0)
            return &f->entries[i];
    return NULL;
}

static void entry_clear(entry_t *e)
{
    free(e->key);
    free(e->pool);
    free(e->replica);
    free(e->origin);
    free(e->reason);
    memset(e, 0, sizeof(*e));
}

static void entries_clear(px_fleet_t *f)
{
    for (size_t i = 0; i < f->nentries; i++)
        entry_clear(&f->entries[i]);
    free(f->entries);
    f->entries = NULL;
    f->nentries = 0;
}

/* The replicas named pool/replica in the current generation: each passed to fn. */
static size_t each_replica(px_t *px, const char *pool, const char *name,
                           void (*fn)(px_pool_t *, px_replica_t *, void *), void *arg)
{
    size_t n = 0;
    px_pool_t *p = px_gen_pool_by_name(px->gen, pool);
    for (size_t k = 0; p && k < p->nreplicas; k++) {
        if (strcmp(p->replicas[k]->name, name) == 0) {
            fn(p, p->replicas[k], arg);
            n++;
        }
    }
    return n;
}

static void apply_drain_cb(px_pool_t *p, px_replica_t *r, void *arg)
{
    const entry_t *e = arg;
    if (r->drained == e->drained)
        return;
    px_replica_set_drained(r, e->drained);
    if (!e->drained)
        px_admission_slot_freed(p);
}

static size_t admitted_in(const px_pool_t *p)
{
    size_t n = 0;
    for (size_t k = 0; k < p->nreplicas; k++)
        n += px_replica_state(p->replicas[k]) == PX_REPLICA_ADMITTED;
    return n;
}

static void apply_quarantine_cb(px_pool_t *p, px_replica_t *r, void *arg)
{
    entry_t *e = arg;
    /* As a local quarantine: never the pool's last admitted replica. */
    if (px_replica_state(r) != PX_REPLICA_ADMITTED || admitted_in(p) <= 1)
        return;
    char why[600];
    snprintf(why, sizeof(why), "quarantined by fleet member %s: %s", e->origin,
             e->reason ? e->reason : "");
    const char *list[] = {why, NULL};
    g_applying = true;
    px_replica_set_state(r, PX_REPLICA_QUARANTINED, list);
    g_applying = false;
    e->applied = true;
}

static void lift_quarantine_cb(px_pool_t *p, px_replica_t *r, void *arg)
{
    (void)p;
    const entry_t *e = arg;
    if (px_replica_state(r) != PX_REPLICA_QUARANTINED)
        return;
    char why[300];
    snprintf(why, sizeof(why), "fleet quarantine lifted by %s", e->origin);
    const char *list[] = {why, NULL};
    g_applying = true;
    px_replica_set_state(r, PX_REPLICA_ADMITTED, list);
    g_applying = false;
}

/* "drain/<pool>/<replica>": split (pool and replica names have no '/'). */
static bool split_key(const char *rel, const char *kind, char **pool, char **replica)
{
    size_t kl = strlen(kind);
    if (strncmp(rel, kind, kl) != 0 || rel[kl] != '/')
        return false;
    const char *p = rel + kl + 1, *slash = strchr(p, '/');
    if (slash == NULL || slash == p || slash[1] == '\0' || strchr(slash + 1, '/'))
        return false;
    *pool = dp_xstrndup(p, (size_t)(slash - p));
    *replica = dp_xstrdup(slash + 1);
    return true;
}

static void entry_log(const char *msg, const entry_t *e, bool applied)
{
    dp_jw_t *w = dp_log_begin(DP_LOG_INFO, msg);
    if (w) {
        dp_jw_str(w, "pool", e->pool);
        dp_jw_str(w, "replica", e->replica);
        dp_jw_str(w, "origin", e->origin);
        dp_jw_str(w, "reason", e->reason);
        dp_jw_bool(w, "applied", applied);
        dp_log_end(w);
    }
}

/* A drain or quarantine key was put (json) or deleted (NULL). */
static void entry_event(px_fleet_t *f, const char *rel, const char *json)
{
    bool drain = strncmp(rel, "drain/", 6) == 0;
    char *pool = NULL, *replica = NULL;
    if (!split_key(rel, drain ? "drain" : "quarantine", &pool, &replica))
        return;
    entry_t *e = entry_find(f, rel);
    if (json == NULL) {
        if (e != NULL && !drain) {
            if (e->applied) {
                each_replica(f->px, e->pool, e->replica, lift_quarantine_cb, e);
                count_event("quarantine_lifted");
                entry_log("fleet_quarantine_lifted", e, true);
            }
        }
        if (e != NULL) {
            entry_clear(e);
            *e = f->entries[--f->nentries];
        }
        free(pool);
        free(replica);
        return;
    }
    cJSON *d = cJSON_Parse(json);
    if (!cJSON_IsObject(d)) {
        cJSON_Delete(d);
        free(pool);
        free(replica);
        return;
    }
    if (e == NULL) {
        f->entries = dp_xrealloc(f->entries, (f->nentries + 1) * sizeof(*f->entries));
        e = &f->entries[f->nentries++];
        memset(e, 0, sizeof(*e));
        e->key = dp_xstrdup(rel);
    } else {
        free(e->pool);
        free(e->replica);
        free(e->origin);
        free(e->reason);
    }
    e->pool = pool;
    e->replica = replica;
    const char *origin = jstr(d, "origin"), *reason = jstr(d, "reason");
    e->origin = dp_xstrdup(origin ? origin : "");
    e->reason = reason ? dp_xstrdup(reason) : NULL;
    e->drained = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(d, "drained"));
    e->at_ms = juint(d, "at_ms");
    cJSON_Delete(d);
    bool ours = strcmp(e->origin, f->instance) == 0;
    if (ours) {
        e->applied = false; /* decided here: already in force */
        return;
    }
    if (origin_skewed(f, e->origin)) {
        e->applied = false;
        count_event("ignored_config_skew");
        entry_log(drain ? "fleet_drain_ignored" : "fleet_quarantine_ignored", e, false);
        return;
    }
    if (drain) {
        each_replica(f->px, e->pool, e->replica, apply_drain_cb, e);
        e->applied = true;
        count_event(e->drained ? "drain" : "enable");
        entry_log(e->drained ? "fleet_drain" : "fleet_enable", e, true);
    } else {
        each_replica(f->px, e->pool, e->replica, apply_quarantine_cb, e);
        count_event("quarantine");
        entry_log("fleet_quarantine", e, e->applied);
    }
}

/* ---- attestation duty ------------------------------------------------------------------- */

static bool self_skewed(const px_fleet_t *f)
{
    return strcmp(f->fp, f->ref_fp) != 0;
}

/* The rendezvous score of (member, replica): FNV-1a over both names, then a 64-bit mixer. Every
 * member computes the same, so every member agrees on who holds a replica's duty. */
static uint64_t duty_score(const char *inst, const char *pool, const char *replica)
{
    uint64_t h = 1469598103934665603ull;
    const char *parts[3] = {inst, pool, replica};
    for (int i = 0; i < 3; i++) {
        for (const unsigned char *c = (const unsigned char *)parts[i]; *c; c++)
            h = (h ^ *c) * 1099511628211ull;
        h = (h ^ 0xffu) * 1099511628211ull; /* a separator no name contains */
    }
    h ^= h >> 30;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 27;
    h *= 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}

/* Who attests pool/replica: the live member without config_skew with the highest score. */
static const member_t *duty_owner(const px_fleet_t *f, const char *pool, const char *replica)
{
    const member_t *best = NULL;
    uint64_t best_s = 0;
    for (size_t i = 0; i < f->nmembers; i++) {
        const member_t *m = &f->members[i];
        if (m->skew)
            continue;
        uint64_t sc = duty_score(m->instance, pool, replica);
        if (best == NULL || sc > best_s ||
            (sc == best_s && strcmp(m->instance, best->instance) < 0)) {
            best = m;
            best_s = sc;
        }
    }
    return best;
}

static verdict_t *verdict_find(px_fleet_t *f, const char *pool, const char *replica)
{
    size_t pl = strlen(pool);
    for (size_t i = 0; i < f->nverdicts; i++) {
        const char *k = f->verdicts[i].key;
        if (strncmp(k, pool, pl) == 0 && k[pl] == '/' && strcmp(k + pl + 1, replica) == 0)
            return &f->verdicts[i];
    }
    return NULL;
}

static verdict_t *verdict_get(px_fleet_t *f, const char *pool, const char *replica)
{
    verdict_t *v = verdict_find(f, pool, replica);
    if (v != NULL)
        return v;
    f->verdicts = dp_xrealloc(f->verdicts, (f->nverdicts + 1) * sizeof(*f->verdicts));
    v = &f->verdicts[f->nverdicts++];
    memset(v, 0, sizeof(*v));
    dp_buf_t k = {0};
    dp_buf_printf(&k, "%s/%s", pool, replica);
    v->key = dp_buf_steal(&k);
    return v;
}

static void verdicts_clear(px_fleet_t *f)
{
    for (size_t i = 0; i < f->nverdicts; i++) {
        free(f->verdicts[i].key);
        free(f->verdicts[i].origin);
    }
    free(f->verdicts);
    f->verdicts = NULL;
    f->nverdicts = 0;
}

/* Attesting everything here: no etcd (or not yet), or this instance's config is not the
 * fleet's (its verdicts are not applied by the others, and theirs not by it). */
static bool attesting_alone(const px_fleet_t *f)
{
    return f->etcd == NULL || !f->connected || self_skewed(f);
}

bool px_fleet_should_attest(px_t *px, const px_replica_t *r)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL || attesting_alone(f))
        return true;
    const member_t *o = duty_owner(f, r->pool_name, r->name);
    if (o == NULL || strcmp(o->instance, f->instance) == 0)
        return true;
    /* Overdue: nothing published for two intervals and a lease (the attester is stuck, or has
     * just left and its lease has not expired yet): checked here meanwhile. */
    const verdict_t *v = verdict_find(f, r->pool_name, r->name);
    uint64_t iv = px->gen->cfg->attestation.interval_ms;
    if (v == NULL || uv_now(px->loop) - v->got_ms > 2 * iv + f->ttl_ms) {
        f->attested_overdue++;
        return true;
    }
    return false;
}

static const char *canary_name(px_canary_t c)
{
    return c == PX_CANARY_PASS ? "pass" : c == PX_CANARY_FAIL ? "fail" : "unknown";
}

static void verdict_written(const cJSON *res, const char *why, void *data)
{
    (void)res;
    (void)why;
    (void)data; /* a lost verdict is replaced by the next check's; a lost etcd shows elsewhere */
}

void px_fleet_attested(px_t *px, px_replica_t *r, const attest_report_t *rep)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL || attesting_alone(f) || f->lease == 0)
        return;
    px_replica_state_t st = px_replica_state(r);
    if (st == PX_REPLICA_QUARANTINED)
        st = PX_REPLICA_ADMITTED; /* attested as admitted; the quarantine is its own key */
    char sha[65];
    dp_buf_t ev = {0}, v = {0}, key = {0}, body = {0};
    px_replica_get_evidence(r, sha, &ev);
    uint64_t now = dp_wall_ms();
    dp_jw_t w;
    dp_jw_init(&w, &v);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "origin", f->instance);
    dp_jw_str(&w, "state", px_replica_state_names[st]);
    dp_jw_arr_begin(&w, "reasons");
    for (size_t i = 0; i < r->nreasons; i++)
        dp_jw_str(&w, NULL, r->reasons[i]);
    dp_jw_arr_end(&w);
    dp_jw_str(&w, "fingerprint", r->fingerprint);
    dp_jw_str(&w, "canary", canary_name(r->canary));
    if (rep) {
        dp_jw_obj_begin(&w, "report");
        for (int i = 0; i < ATTEST_F__COUNT; i++) {
            const char *x = attest_report_get(rep, (attest_field_t)i);
            if (x)
                dp_jw_str(&w, attest_field_names[i], x);
        }
        dp_jw_obj_end(&w);
    } else {
        dp_jw_null(&w, "report");
    }
    dp_jw_str(&w, "evidence_sha256", sha);
    if (ev.len && ev.len <= VERDICT_EVIDENCE_MAX) {
        dp_buf_t b64 = {0};
        dp_base64_encode(ev.base, ev.len, &b64);
        dp_jw_str(&w, "evidence_base64", b64.base);
        dp_buf_free(&b64);
    }
    dp_jw_uint(&w, "at_ms", now);
    dp_jw_uint(&w, "interval_ms", px->gen->cfg->attestation.interval_ms);
    dp_jw_obj_end(&w);
    dp_buf_printf(&key, "%sverdicts/%s/%s", f->prefix, r->pool_name, r->name);
    fleet_ej_put(&body, key.base, v.base, v.len, f->lease);
    fleet_etcd_call(f->etcd, "/v3/kv/put", &body, verdict_written, NULL);
    f->verdicts_published++;
    verdict_t *vt = verdict_get(f, r->pool_name, r->name);
    free(vt->origin);
    vt->origin = dp_xstrdup(f->instance);
    snprintf(vt->state, sizeof(vt->state), "%s", px_replica_state_names[st]);
    vt->at_ms = now;
    vt->got_ms = uv_now(px->loop);
    vt->applied = false;
    dp_buf_free(&ev);
    dp_buf_free(&v);
    dp_buf_free(&key);
    dp_buf_free(&body);
}

static int state_by_name(const char *s)
{
    for (int i = PX_REPLICA_PENDING; s && i <= PX_REPLICA_UNREACHABLE; i++)
        if (strcmp(px_replica_state_names[i], s) == 0)
            return i;
    return -1;
}

typedef struct {
    px_fleet_verdict_t v;
    dp_buf_t ev;
    size_t applied;
} apply_t;

static void apply_verdict_cb(px_pool_t *p, px_replica_t *r, void *arg)
{
    (void)p;
    apply_t *ap = arg;
    dp_buf_t copy = {0};
    dp_buf_append(&copy, ap->ev.base, ap->ev.len);
    ap->v.evidence = &copy;
    ap->applied += g_verdict_sink && g_verdict_sink(r, &ap->v);
    dp_buf_free(&copy);
}

/* A verdict key was put (json) or deleted (NULL: its publisher's lease went). */
/* Has m's key moved to another lease within a lease's time? Its verdicts wait that long: a
 * writer that puts a copy of a member's key on its own lease, with a verdict in the member's
 * name beside it, has the key taken back at once (member_publish), but not before the others
 * read both. Meanwhile its replicas are checked locally when their verdicts fall overdue. */
static bool lease_unsettled(const px_fleet_t *f, const member_t *m)
{
    return m->lease_moved_ms && uv_now(f->px->loop) - m->lease_moved_ms < f->ttl_ms;
}

static void verdict_event(px_fleet_t *f, const char *rel, const char *json, int64_t lease)
{
    char *pool = NULL, *replica = NULL;
    if (!split_key(rel, "verdicts", &pool, &replica))
        return;
    cJSON *d = json ? cJSON_Parse(json) : NULL;
    verdict_t *vt = verdict_find(f, pool, replica);
    const char *origin = jstr(d, "origin");
    if (json == NULL || origin == NULL) {
        if (vt != NULL) {
            free(vt->key);
            free(vt->origin);
            *vt = f->verdicts[--f->nverdicts];
        }
        goto out;
    }
    if (strcmp(origin, f->instance) == 0)
        goto out; /* ours, echoed back */
    vt = verdict_get(f, pool, replica);
    free(vt->origin);
    vt->origin = dp_xstrdup(origin);
    snprintf(vt->state, sizeof(vt->state), "%s", jstr(d, "state") ? jstr(d, "state") : "");
    vt->at_ms = juint(d, "at_ms");
    vt->got_ms = uv_now(f->px->loop);
    vt->applied = false;
    int st = state_by_name(jstr(d, "state"));
    if (st < 0)
        goto out;
    if (origin_skewed(f, origin) || self_skewed(f)) {
        count_event("ignored_config_skew");
        goto out;
    }
    /* Only the replica's attester speaks for it: a live member whose duty it is, writing on its
     * own lease (an `origin` field anyone with write access can set; the lease is the member's),
     * with the evidence an admission rests on. Anything else is kept (shown) but not applied. */
    const member_t *owner = duty_owner(f, pool, replica), *from = member_find(f, origin);
    if (from == NULL || from->lease != lease || lease_unsettled(f, from) || owner == NULL ||
        strcmp(owner->instance, origin) != 0 ||
        (st == PX_REPLICA_ADMITTED &&
         (!cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(d, "report")) ||
          jstr(d, "evidence_sha256") == NULL))) {
        count_event("ignored_not_attester");
        goto out;
    }
    apply_t ap = {.v = {.origin = origin,
                        .state = (px_replica_state_t)st,
                        .fingerprint = jstr(d, "fingerprint"),
                        .at_ms = vt->at_ms}};
    const char *reasons[PX_MAX_REASONS + 1] = {0};
    size_t n = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(d, "reasons"))
    {
        if (cJSON_IsString(it) && n < PX_MAX_REASONS)
            reasons[n++] = it->valuestring;
    }
    ap.v.reasons = reasons;
    const char *c = jstr(d, "canary");
    ap.v.canary = c && strcmp(c, "pass") == 0   ? PX_CANARY_PASS
                  : c && strcmp(c, "fail") == 0 ? PX_CANARY_FAIL
                                                : PX_CANARY_UNKNOWN;
    attest_report_t rep = {0};
    const cJSON *ro = cJSON_GetObjectItemCaseSensitive(d, "report");
    if (cJSON_IsObject(ro)) {
        for (int i = 0; i < ATTEST_F__COUNT; i++) {
            const char *x = jstr(ro, attest_field_names[i]);
            if (x)
                attest_report_set(&rep, (attest_field_t)i, x);
        }
        ap.v.report = &rep;
    }
    const char *b64 = jstr(d, "evidence_base64");
    if (b64 && dp_base64_decode(b64, strlen(b64), &ap.ev) != 0)
        dp_buf_reset(&ap.ev);
    g_applying = true;
    each_replica(f->px, pool, replica, apply_verdict_cb, &ap);
    g_applying = false;
    attest_report_clear(&rep);
    dp_buf_free(&ap.ev);
    if (ap.applied) {
        vt->applied = true;
        f->verdicts_applied++;
    }
out:
    cJSON_Delete(d);
    free(pool);
    free(replica);
}

/* ---- pooled statistics ------------------------------------------------------------------ */

static void stats_set(px_fleet_t *f, const char *inst, const char *json)
{
    for (size_t i = 0; i < f->nstats; i++) {
        if (strcmp(f->stats[i].instance, inst) == 0) {
            free(f->stats[i].json);
            if (json) {
                f->stats[i].json = dp_xstrdup(json);
            } else {
                free(f->stats[i].instance);
                f->stats[i] = f->stats[--f->nstats];
            }
            return;
        }
    }
    if (json == NULL)
        return;
    f->stats = dp_xrealloc(f->stats, (f->nstats + 1) * sizeof(*f->stats));
    f->stats[f->nstats].instance = dp_xstrdup(inst);
    f->stats[f->nstats].json = dp_xstrdup(json);
    f->nstats++;
}

static void stats_clear(px_fleet_t *f)
{
    for (size_t i = 0; i < f->nstats; i++) {
        free(f->stats[i].instance);
        free(f->stats[i].json);
    }
    free(f->stats);
    f->stats = NULL;
    f->nstats = 0;
}

/* This instance's drift aggregates, written when they changed (checked every tick). */
static void stats_publish(px_fleet_t *f)
{
    px_t *px = f->px;
    if (attesting_alone(f) || f->lease == 0)
        return;
    dp_buf_t v = {0};
    dp_jw_t w;
    dp_jw_init(&w, &v);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_obj_begin(&w, "drift");
    for (size_t i = 0; i < px->gen->npools; i++)
        drift_pool_export(px_shadow_drift_pool(px, px->gen->pools[i].name), &w,
                          px->gen->pools[i].name);
    dp_jw_obj_end(&w);
    /* "rollouts": {"<pool>": {"<candidate>": [...]}} */
    dp_jw_obj_begin(&w, "rollouts");
    for (size_t i = 0; i < px->gen->npools; i++) {
        const px_pool_t *p = &px->gen->pools[i];
        if (p->cfg->ncandidates == 0)
            continue;
        dp_jw_obj_begin(&w, p->name);
        for (size_t k = 0; k < p->cfg->ncandidates; k++)
            drift_rollout_export(px_shadow_rollout_stats(px, p->name, p->cfg->candidates[k].pool),
                                 &w, p->cfg->candidates[k].pool);
        dp_jw_obj_end(&w);
    }
    dp_jw_obj_end(&w);
    dp_jw_obj_end(&w);
    if (f->stats_sent && strcmp(f->stats_sent, v.base) == 0) {
        dp_buf_free(&v);
        return;
    }
    dp_buf_t key = {0}, body = {0};
    dp_buf_printf(&key, "%sstats/%s", f->prefix, f->instance);
    fleet_ej_put(&body, key.base, v.base, v.len, f->lease);
    fleet_etcd_call(f->etcd, "/v3/kv/put", &body, verdict_written, NULL);
    free(f->stats_sent);
    f->stats_sent = dp_buf_steal(&v);
    dp_buf_free(&key);
    dp_buf_free(&body);
}

/* One pool's windows summed over this instance and every member without config_skew. */
static drift_pool_t *fleet_pool(px_fleet_t *f, const drift_pool_t *local, size_t *members)
{
    const char *name = drift_pool_name(local);
    drift_pool_t *fp = drift_pool_new(name);
    dp_buf_t own = {0};
    dp_jw_t w;
    dp_jw_init(&w, &own);
    drift_pool_export(local, &w, NULL);
    cJSON *d = cJSON_ParseWithLength(own.base, own.len);
    drift_pool_import(fp, d);
    cJSON_Delete(d);
    dp_buf_free(&own);
    *members = 1;
    for (size_t i = 0; i < f->nstats; i++) {
        if (strcmp(f->stats[i].instance, f->instance) == 0 ||
            origin_skewed(f, f->stats[i].instance))
            continue;
        d = cJSON_Parse(f->stats[i].json);
        const cJSON *pairs =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(d, "drift"), name);
        if (pairs && drift_pool_import(fp, pairs) == 0)
            (*members)++;
        cJSON_Delete(d);
    }
    drift_pool_copy_hints(fp, local);
    return fp;
}

void px_fleet_drift_json(px_t *px, dp_buf_t *out)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL || out->len < 2 || out->base[out->len - 1] != '}')
        return;
    out->len--; /* reopen the object */
    dp_buf_appends(out, ",\"fleet\":");
    dp_jw_t jw, *w = &jw;
    dp_jw_init(w, out);
    dp_jw_obj_begin(w, NULL);
    dp_jw_bool(w, "connected", f->connected);
    dp_jw_obj_begin(w, "pools");
    for (size_t i = 0; i < px->gen->npools; i++) {
        size_t members = 0;
        const drift_pool_t *local = px_shadow_drift_pool(px, px->gen->pools[i].name);
        drift_pool_t *fp = fleet_pool(f, local, &members);
        drift_render_pool(w, drift_pool_name(local), fp);
        drift_pool_free(fp);
    }
    dp_jw_obj_end(w);
    dp_jw_arr_begin(w, "members");
    dp_jw_str(w, NULL, f->instance);
    for (size_t i = 0; i < f->nstats; i++)
        if (strcmp(f->stats[i].instance, f->instance) != 0 &&
            !origin_skewed(f, f->stats[i].instance))
            dp_jw_str(w, NULL, f->stats[i].instance);
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
    dp_buf_appendc(out, '}');
}

/* Whether a published statistics entry counts for the fleet: another member, not config_skew. */
static bool stats_pooled(px_fleet_t *f, size_t i)
{
    return strcmp(f->stats[i].instance, f->instance) != 0 &&
           !origin_skewed(f, f->stats[i].instance);
}

/* One candidate's statistics summed over this instance and every pooled member. */
static drift_rollout_t *fleet_rollout(px_fleet_t *f, const char *pool, const char *cand)
{
    drift_rollout_t *fr = drift_rollout_new(pool, cand);
    dp_buf_t own = {0};
    dp_jw_t w;
    dp_jw_init(&w, &own);
    drift_rollout_export(px_shadow_rollout_stats(f->px, pool, cand), &w, NULL);
    cJSON *d = cJSON_ParseWithLength(own.base, own.len);
    drift_rollout_import(fr, d);
    cJSON_Delete(d);
    dp_buf_free(&own);
    for (size_t i = 0; i < f->nstats; i++) {
        if (!stats_pooled(f, i))
            continue;
        d = cJSON_Parse(f->stats[i].json);
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(d, "rollouts");
        const cJSON *a =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(r, pool), cand);
        if (a)
            drift_rollout_import(fr, a);
        cJSON_Delete(d);
    }
    return fr;
}

void px_fleet_rollouts_json(px_t *px, const char *only, size_t only_len, dp_buf_t *out)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL || out->len < 2 || out->base[out->len - 1] != '}')
        return;
    out->len--; /* reopen the object */
    dp_buf_appends(out, ",\"fleet\":");
    dp_jw_t jw, *w = &jw;
    dp_jw_init(w, out);
    dp_jw_obj_begin(w, NULL);
    dp_jw_bool(w, "connected", f->connected);
    dp_jw_arr_begin(w, "rollouts");
    for (size_t i = 0; i < px->gen->npools; i++) {
        const px_pool_t *p = &px->gen->pools[i];
        if (only && !(strlen(p->name) == only_len && memcmp(p->name, only, only_len) == 0))
            continue;
        if (p->cfg->ncandidates == 0)
            continue;
        /* The baseline's noise is the fleet's too: its pooled drift windows. */
        size_t members = 0;
        drift_pool_t *fp = fleet_pool(f, px_shadow_drift_pool(px, p->name), &members);
        drift_summary_t cross, self;
        drift_pool_summary(fp, DRIFT_CROSS, &cross);
        drift_pool_summary(fp, DRIFT_SELF, &self);
        for (size_t k = 0; k < p->cfg->ncandidates; k++) {
            const cfg_candidate_t *c = &p->cfg->candidates[k];
            drift_rollout_t *fr = fleet_rollout(f, p->name, c->pool);
            drift_rollout_render(w, NULL, fr, c->rate, &cross, &self);
            drift_rollout_free(fr);
        }
        drift_pool_free(fp);
    }
    dp_jw_arr_end(w);
    dp_jw_arr_begin(w, "members");
    dp_jw_str(w, NULL, f->instance);
    for (size_t i = 0; i < f->nstats; i++)
        if (stats_pooled(f, i))
            dp_jw_str(w, NULL, f->stats[i].instance);
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
    dp_buf_appendc(out, '}');
}

static void member_publish(px_fleet_t *f, fleet_etcd_cb cb);
static void member_rewritten(const cJSON *res, const char *why, void *data);
static bool member_value_is(px_fleet_t *f, const char *value);

/* Our member key, found changed by someone else (now on `lease`, 0: none or deleted), written
 * back. A key on another live lease is most likely another process given our instance name. */
static void member_restore_now(px_fleet_t *f, int64_t lease)
{
    f->restored_ms = uv_now(f->px->loop);
    f->restore_due = false;
    f->restore_lease = 0;
    if (lease != 0 && lease != f->lease) {
        dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "fleet_member_key_contested");
        if (w) {
            dp_jw_str(w, "instance", f->instance);
            dp_jw_int(w, "lease", lease);
            dp_jw_str(w, "hint",
                      "written on another live lease: another process may have "
                      "this instance name");
            dp_log_end(w);
        }
    }
    member_publish(f, member_rewritten);
}

/* May our member key be written back now: none was within the last keep-alive period? */
static bool member_restore_may(const px_fleet_t *f)
{
    return f->restored_ms == 0 || uv_now(f->px->loop) - f->restored_ms >= f->ttl_ms / 3;
}

/* The same at most once per keep-alive period: a change found within one of a write-back is
 * written back on a tick once the period has passed. */
static void member_restore(px_fleet_t *f, int64_t lease)
{
    bool other = lease != 0 && lease != f->lease;
    if (member_restore_may(f)) {
        member_restore_now(f, other ? lease : 0);
    } else {
        f->restore_due = true;
        if (other)
            f->restore_lease = lease;
    }
}

/* lease: the kv's lease (0: none); rev: the revision of the change (0: not known, our own
 * write). Member keys and verdicts live on their writer's lease: one without a lease is no live
 * member's and counts as absent. */
static void kv_event(px_fleet_t *f, const char *key, const char *value, int64_t lease, int64_t rev,
                     bool deleted)
{
    size_t pl = strlen(f->prefix);
    if (strncmp(key, f->prefix, pl) != 0)
        return;
    const char *rel = key + pl;
    if (strncmp(rel, "instances/", 10) == 0) {
        const char *inst = rel + 10;
        if (deleted || lease == 0)
            member_del(f, inst);
        else
            member_put(f, inst, value, lease);
        compute_skew(f);
        /* Our own key, changed by someone else (or moved off our lease): written back. */
        if (strcmp(inst, f->instance) == 0 && f->lease != 0 && f->step == ST_IDLE &&
            (deleted || lease != f->lease || !member_value_is(f, value)))
            member_restore(f, deleted ? 0 : lease);
    } else if (strncmp(rel, "drain/", 6) == 0 || strncmp(rel, "quarantine/", 11) == 0) {
        entry_event(f, rel, deleted ? NULL : value);
    } else if (strncmp(rel, "verdicts/", 9) == 0) {
        verdict_event(f, rel, deleted || lease == 0 ? NULL : value, lease);
    } else if (strncmp(rel, "stats/", 6) == 0 && rel[6] && !strchr(rel + 6, '/')) {
        stats_set(f, rel + 6, deleted ? NULL : value);
    } else if (strncmp(rel, "engines/", 8) == 0) {
        px_seqlock_kv(f->seq, rel, lease, rev, deleted);
    }
}

/* ---- writes ------------------------------------------------------------------------------- */

static void pending_set(px_fleet_t *f, const char *key, const char *value)
{
    for (size_t i = 0; i < f->npending; i++) {
        if (strcmp(f->pending[i].key, key) == 0) {
            free(f->pending[i].value);
            f->pending[i].value = value ? dp_xstrdup(value) : NULL;
            return;
        }
    }
    f->pending = dp_xrealloc(f->pending, (f->npending + 1) * sizeof(*f->pending));
    f->pending[f->npending].key = dp_xstrdup(key);
    f->pending[f->npending].value = value ? dp_xstrdup(value) : NULL;
    f->npending++;
}

typedef struct {
    px_fleet_t *f;
    char *key, *value;
} write_t;

static void written(const cJSON *res, const char *why, void *data)
{
    write_t *w = data;
    if (res == NULL && !w->f->stopping) {
        pending_set(w->f, w->key, w->value); /* sent again when etcd is back */
        dp_jw_t *j = dp_log_begin(DP_LOG_WARN, "fleet_write_failed");
        if (j) {
            dp_jw_str(j, "key", w->key);
            dp_jw_str(j, "error", why);
            dp_log_end(j);
        }
    }
    free(w->key);
    free(w->value);
    free(w);
}

/* Put (value) or delete (NULL) prefix+rel; kept for later when it fails. */
static void fleet_write(px_fleet_t *f, const char *key, const char *value)
{
    write_t *w = dp_xcalloc(1, sizeof(*w));
    w->f = f;
    w->key = dp_xstrdup(key);
    w->value = value ? dp_xstrdup(value) : NULL;
    dp_buf_t body = {0};
    if (value)
        fleet_ej_put(&body, key, value, strlen(value), 0);
    else
        fleet_ej_delete(&body, key);
    fleet_etcd_call(f->etcd, value ? "/v3/kv/put" : "/v3/kv/deleterange", &body, written, w);
    dp_buf_free(&body);
}

static void flush_pending(px_fleet_t *f)
{
    pending_t *p = f->pending;
    size_t n = f->npending;
    f->pending = NULL;
    f->npending = 0;
    for (size_t i = 0; i < n; i++) {
        fleet_write(f, p[i].key, p[i].value);
        free(p[i].key);
        free(p[i].value);
    }
    free(p);
}

/* ---- connection -------------------------------------------------------------------------- */

static void set_connected(px_fleet_t *f, bool up, const char *why)
{
    px_seqlock_lease(f->seq, up ? f->lease : 0, f->lease_until);
    if (up == f->connected && (up || strcmp(f->why, why ? why : "") == 0))
        return;
    bool changed = up != f->connected;
    f->connected = up;
    snprintf(f->why, sizeof(f->why), "%s", up ? "" : why ? why : "");
    px_metrics_set(f->m_connected, up ? 1 : 0);
    if (!changed)
        return;
    f->since_ms = dp_wall_ms();
    count_event(up ? "connected" : "disconnected");
    dp_jw_t *w =
        dp_log_begin(up ? DP_LOG_INFO : DP_LOG_WARN, up ? "fleet_connected" : "fleet_disconnected");
    if (w) {
        dp_jw_str(w, "endpoint", fleet_etcd_endpoint(f->etcd));
        if (up) {
            dp_jw_uint(w, "members", f->nmembers);
        } else {
            dp_jw_str(w, "error", why);
            dp_jw_str(w, "fallback",
                      "serving with the last fleet state and local decisions, attesting every "
                      "replica here");
        }
        dp_log_end(w);
    }
}

static void connect_step(px_fleet_t *f);

static void fail_step(px_fleet_t *f, const char *what, const char *why)
{
    char msg[300];
    snprintf(msg, sizeof(msg), "%s: %s", what, why ? why : "failed");
    f->step = ST_IDLE;
    set_connected(f, false, msg);
}

static void w_kv(void *data, const fleet_kv_t *kv, bool deleted)
{
    kv_event(data, kv->key.base, kv->value.base ? kv->value.base : "", kv->lease, kv->mod_revision,
             deleted);
}

static void w_rev(void *data, int64_t rev)
{
    px_fleet_t *f = data;
    if (rev > f->rev)
        f->rev = rev;
}

static void w_compacted(void *data, int64_t rev)
{
    px_fleet_t *f = data;
    count_event(rev ? "compacted" : "watch_unreadable");
    dp_jw_t *w =
        dp_log_begin(DP_LOG_WARN, rev ? "fleet_watch_compacted" : "fleet_watch_unreadable");
    if (w) {
        if (rev)
            dp_jw_int(w, "compact_revision", rev);
        else
            dp_jw_str(w, "detail",
                      "a watch message over the size cap or malformed: the state is "
                      "read again and watched from there");
        dp_log_end(w);
    }
    /* Events were lost: read the whole state again, then watch from there. */
    if (f->step == ST_IDLE) {
        f->step = ST_RANGE;
        connect_step(f);
    }
}

static void w_link(void *data, const char *why)
{
    px_fleet_t *f = data;
    if (why) {
        dp_jw_t *w = dp_log_begin(DP_LOG_INFO, "fleet_watch_lost");
        if (w) {
            dp_jw_str(w, "error", why);
            dp_log_end(w);
        }
    }
    (void)f;
}

static const fleet_etcd_watch_cb_t watch_cbs = {w_kv, w_rev, w_compacted, w_link};

static void ranged(const cJSON *res, const char *why, void *data)
{
    px_fleet_t *f = data;
    if (f->stopping)
        return;
    if (res == NULL) {
        fail_step(f, "reading the fleet state", why);
        return;
    }
    /* The whole state: what is absent now was deleted while we were away. */
    int64_t rev = fleet_ej_revision(res);
    /* The members are read anew, but a key that moved to another lease meanwhile has moved
     * (lease_unsettled): the leases they had are kept to compare. */
    size_t nwas = f->nmembers;
    member_t *was = f->members;
    f->members = NULL;
    f->nmembers = 0;
    verdicts_clear(f);
    stats_clear(f);
    free(f->stats_sent); /* written again on the next tick (a new lease, maybe) */
    f->stats_sent = NULL;
    entry_t *old = f->entries;
    size_t nold = f->nentries;
    f->entries = NULL;
    f->nentries = 0;
    const cJSON *kv;
    fleet_kv_t k = {0};
    cJSON_ArrayForEach(kv, cJSON_GetObjectItemCaseSensitive(res, "kvs"))
    {
        if (fleet_ej_kv(kv, &k) == 0 && k.lease != 0 &&
            strncmp(k.key.base, f->prefix, strlen(f->prefix)) == 0 &&
            strncmp(k.key.base + strlen(f->prefix), "instances/", 10) == 0)
            member_put(f, k.key.base + strlen(f->prefix) + 10, k.value.base, k.lease);
    }
    for (size_t i = 0; i < nwas; i++) {
        member_t *m = member_find(f, was[i].instance);
        if (m)
            m->lease_moved_ms =
                m->lease != was[i].lease ? uv_now(f->px->loop) : was[i].lease_moved_ms;
        member_clear(&was[i]);
    }
    free(was);
    compute_skew(f);
    /* Entries after members: their origins' skew decides whether they apply. An entry that was
     * applied and is gone now is lifted. An engine key on our lease is ours again. */
    px_seqlock_lease(f->seq, f->lease, f->lease_until);
    cJSON_ArrayForEach(kv, cJSON_GetObjectItemCaseSensitive(res, "kvs"))
    {
        if (fleet_ej_kv(kv, &k) == 0)
            kv_event(f, k.key.base, k.value.base, k.lease, k.mod_revision, false);
    }
    fleet_kv_free(&k);
    for (size_t i = 0; i < nold; i++) {
        entry_t *now = entry_find(f, old[i].key);
        if (now != NULL && old[i].applied) {
            now->applied = true; /* in force here already */
        } else if (now == NULL && old[i].applied && strncmp(old[i].key, "quarantine/", 11) == 0) {
            each_replica(f->px, old[i].pool, old[i].replica, lift_quarantine_cb, &old[i]);
            count_event("quarantine_lifted");
            entry_log("fleet_quarantine_lifted", &old[i], true);
        }
        entry_clear(&old[i]);
    }
    free(old);
    f->rev = rev;
    count_event("resync");
    fleet_etcd_watch(f->etcd, f->prefix, rev + 1, &watch_cbs, f);
    f->step = ST_IDLE;
    f->ever_connected = true;
    set_connected(f, true, NULL);
    /* Our member key was written on our lease just before this read: found elsewhere (another
     * process with our instance name wrote it since), it is written back as on a watch event. */
    const member_t *me = member_find(f, f->instance);
    if (me == NULL || me->lease != f->lease)
        member_restore(f, me ? me->lease : 0);
}

static unsigned bound_port(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET)
        return ntohs(((const struct sockaddr_in *)ss)->sin_port);
    if (ss->ss_family == AF_INET6)
        return ntohs(((const struct sockaddr_in6 *)ss)->sin6_port);
    return 0;
}

static void member_value(px_fleet_t *f, dp_buf_t *out)
{
    px_t *px = f->px;
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "instance", f->instance);
    dp_jw_str(&w, "version", dp_version);
    dp_jw_str(&w, "commit", dp_commit);
    dp_jw_str(&w, "config_fingerprint", f->fp);
    char a[80];
    snprintf(a, sizeof(a), "%s:%u", px->gen->cfg->listen.host, bound_port(&px->listen_bound));
    dp_jw_str(&w, "listen", a);
    snprintf(a, sizeof(a), "%s:%u", px->gen->cfg->admin_listen.host,
             px->admin ? (unsigned)net_server_port(px->admin)
                       : (unsigned)px->gen->cfg->admin_listen.port);
    dp_jw_str(&w, "admin_listen", a);
    dp_jw_uint(&w, "started_ms", px->started_ms);
    dp_jw_obj_end(&w);
}

static bool member_value_is(px_fleet_t *f, const char *value)
{
    dp_buf_t v = {0};
    member_value(f, &v);
    bool same = value && v.base && strcmp(v.base, value) == 0;
    dp_buf_free(&v);
    return same;
}

static void member_rewritten(const cJSON *res, const char *why, void *data)
{
    (void)data;
    count_event(res ? "member_key_restored" : "member_key_restore_failed");
    dp_jw_t *w = dp_log_begin(res ? DP_LOG_WARN : DP_LOG_ERROR, "fleet_member_key_restored");
    if (w) {
        dp_jw_bool(w, "ok", res != NULL);
        if (res == NULL)
            dp_jw_str(w, "error", why);
        dp_log_end(w);
    }
}

/* Our member key, written again with what member_value says now, on our lease. */
static void member_publish(px_fleet_t *f, fleet_etcd_cb cb)
{
    dp_buf_t body = {0}, key = {0}, v = {0};
    member_value(f, &v);
    dp_buf_printf(&key, "%sinstances/%s", f->prefix, f->instance);
    fleet_ej_put(&body, key.base, v.base, v.len, f->lease);
    fleet_etcd_call(f->etcd, "/v3/kv/put", &body, cb, f);
    dp_buf_free(&body);
    dp_buf_free(&key);
    dp_buf_free(&v);
}

/* The TTL an answer about our lease gives it, in ms: 0 when it is gone. Never more than the
 * TTL asked for: a longer one (a hostile or broken etcd) would let this member believe it
 * still holds its lease, and the single-sequence engines it holds, after it has lapsed. */
static uint64_t granted_ms(const px_fleet_t *f, const cJSON *res)
{
    int64_t ttl = fleet_ej_int(res, "TTL", 0);
    uint64_t asked = (uint64_t)(f->ttl_ms + 999) / 1000;
    if (ttl <= 0)
        return 0;
    return ((uint64_t)ttl < asked ? (uint64_t)ttl : asked) * 1000;
}

static void step_done(const cJSON *res, const char *why, void *data)
{
    px_fleet_t *f = data;
    if (f->stopping)
        return;
    if (res == NULL) {
        if (f->step == ST_MEMBER && why && strstr(why, "lease not found"))
            f->lease = 0; /* expired while we were away: a new one next time */
        fail_step(f,
                  f->step == ST_GRANT   ? "granting the lease"
                  : f->step == ST_RENEW ? "renewing the lease"
                                        : "writing the member key",
                  why);
        return;
    }
    if (f->step == ST_GRANT) {
        f->lease = fleet_ej_int(res, "ID", 0);
        f->lease_until = f->call_sent_ms + granted_ms(f, res);
        if (f->lease == 0) {
            fail_step(f, "granting the lease", "no lease ID in the answer");
            return;
        }
        f->step = ST_MEMBER;
    } else if (f->step == ST_RENEW) {
        uint64_t ttl = granted_ms(f, res);
        if (ttl == 0) { /* it expired while we were away: a new one */
            f->lease = 0;
            f->step = ST_GRANT;
        } else {
            f->lease_until = f->call_sent_ms + ttl;
            f->step = ST_MEMBER;
        }
    } else if (f->step == ST_MEMBER) {
        flush_pending(f);
        f->step = ST_RANGE;
    }
    connect_step(f);
}

static void connect_step(px_fleet_t *f)
{
    dp_buf_t body = {0}, key = {0};
    switch (f->step) {
    case ST_GRANT:
        f->call_sent_ms = dp_now_ms();
        fleet_ej_lease_grant(&body, (f->ttl_ms + 999) / 1000);
        fleet_etcd_call(f->etcd, "/v3/lease/grant", &body, step_done, f);
        break;
    case ST_RENEW:
        f->call_sent_ms = dp_now_ms();
        fleet_ej_lease_id(&body, f->lease);
        fleet_etcd_call(f->etcd, "/v3/lease/keepalive", &body, step_done, f);
        break;
    case ST_MEMBER: {
        dp_buf_t v = {0};
        f->restore_due = false; /* written now: what was owed, and who had it, is moot */
        f->restore_lease = 0;
        member_value(f, &v);
        dp_buf_printf(&key, "%sinstances/%s", f->prefix, f->instance);
        fleet_ej_put(&body, key.base, v.base, v.len, f->lease);
        dp_buf_free(&v);
        fleet_etcd_call(f->etcd, "/v3/kv/put", &body, step_done, f);
        break;
    }
    case ST_RANGE:
        fleet_ej_range_prefix(&body, f->prefix);
        fleet_etcd_call_max(f->etcd, "/v3/kv/range", &body, FLEET_STATE_MAX, ranged, f);
        break;
    default:
        break;
    }
    dp_buf_free(&body);
    dp_buf_free(&key);
}

static void connect_start(px_fleet_t *f)
{
    if (f->step != ST_IDLE)
        return;
    /* A lease kept from before etcd was lost is renewed first: how long it surely lives is
     * known again (its engine keys may be run on until then), and one that expired meanwhile
     * is replaced before anything is written on it. */
    f->step = f->lease ? ST_RENEW : ST_GRANT;
    connect_step(f);
}

static void watch_checked(const cJSON *res, const char *why, void *data)
{
    px_fleet_t *f = data;
    (void)why;
    f->check_busy = false;
    if (f->stopping || res == NULL)
        return; /* etcd away: the keep-alive says so */
    fleet_kv_t k = {0};
    const cJSON *kvs = cJSON_GetObjectItemCaseSensitive(res, "kvs");
    int64_t latest = fleet_ej_kv(cJSON_GetArrayItem(kvs, 0), &k) == 0 ? k.mod_revision : 0;
    fleet_kv_free(&k);
    uint64_t now = uv_now(f->px->loop);
    if (latest <= f->rev) {
        f->lag_rev = 0; /* the watch has delivered everything written under the prefix */
        return;
    }
    if (f->lag_rev == 0 || f->rev >= f->lag_rev) {
        f->lag_rev = latest; /* written since: the watch has until the next look */
        f->lag_ms = now;
        return;
    }
    /* A write a whole keep-alive interval old that the watch never delivered: its connection
     * is dead without a word (a NAT or balancer that forgot the flow). The whole state is read
     * again (what the watch missed applies now), and watched from there on a new connection. */
    count_event("watch_stale");
    dp_jw_t *w = dp_log_begin(DP_LOG_WARN, "fleet_watch_stale");
    if (w) {
        dp_jw_int(w, "watch_revision", f->rev);
        dp_jw_int(w, "written_revision", f->lag_rev);
        dp_jw_uint(w, "behind_ms", now - f->lag_ms);
        dp_log_end(w);
    }
    f->lag_rev = 0;
    if (f->step == ST_IDLE) {
        f->step = ST_RANGE;
        connect_step(f);
    }
}

/* A watch has no heartbeat of its own (etcd's progress notices come every ten minutes by
 * default), so its silence cannot tell "nothing happened" from "its connection died". With
 * each keep-alive, the latest write under the prefix is looked up: one the watch has not
 * delivered by the next keep-alive means the watch is gone. */
static void watch_check(px_fleet_t *f)
{
    /* Whether or not the watch is up: one that keeps failing to come back misses writes as
     * surely as a silent one. */
    if (f->check_busy || f->step != ST_IDLE)
        return;
    f->check_busy = true;
    dp_buf_t body = {0};
    fleet_ej_range_latest(&body, f->prefix);
    fleet_etcd_call(f->etcd, "/v3/kv/range", &body, watch_checked, f);
    dp_buf_free(&body);
}

static void kept_alive(const cJSON *res, const char *why, void *data)
{
    px_fleet_t *f = data;
    f->keepalive_busy = false;
    if (f->stopping)
        return;
    if (res == NULL) {
        char msg[300];
        snprintf(msg, sizeof(msg), "lease keep-alive: %s", why ? why : "failed");
        set_connected(f, false, msg);
        fleet_etcd_watch_kick(f->etcd);
        return;
    }
    uint64_t ttl = granted_ms(f, res);
    if (ttl == 0) {
        /* The lease expired (etcd was away longer than its TTL): everything again. */
        f->lease = 0;
        set_connected(f, false, "lease expired");
        connect_start(f);
        return;
    }
    f->lease_until = f->keepalive_sent_ms + ttl;
    if (f->connected) {
        px_seqlock_lease(f->seq, f->lease, f->lease_until);
        watch_check(f);
    }
}

/* The latest audit checkpoint goes to anchors/<instance> (not on the lease: evidence outlives
 * the instance), once per new checkpoint; a write that fails is sent again on reconnect. */
static void anchor_publish(px_fleet_t *f)
{
    if (f->px->audit == NULL)
        return;
    px_audit_state_t st;
    px_audit_state(f->px->audit, &st);
    if (st.seq == 0 || (st.seq == f->anchor_seq && strcmp(st.sha256, f->anchor_sha) == 0))
        return;
    f->anchor_seq = st.seq;
    snprintf(f->anchor_sha, sizeof(f->anchor_sha), "%s", st.sha256);
    dp_buf_t key = {0}, v = {0};
    dp_buf_printf(&key, "%sanchors/%s", f->prefix, f->instance);
    dp_jw_t w;
    dp_jw_init(&w, &v);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_str(&w, "instance", f->instance);
    dp_jw_uint(&w, "seq", st.seq);
    dp_jw_str(&w, "sha256", st.sha256);
    dp_jw_str(&w, "audit_path", st.path);
    dp_jw_uint(&w, "at_ms", dp_wall_ms());
    dp_jw_obj_end(&w);
    fleet_write(f, key.base, v.base);
    dp_buf_free(&key);
    dp_buf_free(&v);
}

static void on_tick(uv_timer_t *t)
{
    px_fleet_t *f = t->data;
    anchor_publish(f);
    stats_publish(f);
    if (!f->connected) {
        connect_start(f);
        return;
    }
    if (f->restore_due && f->step == ST_IDLE && f->lease != 0 && member_restore_may(f))
        member_restore_now(f, f->restore_lease);
    if (f->keepalive_busy)
        return;
    f->keepalive_busy = true;
    f->keepalive_sent_ms = dp_now_ms();
    dp_buf_t body = {0};
    fleet_ej_lease_id(&body, f->lease);
    fleet_etcd_call(f->etcd, "/v3/lease/keepalive", &body, kept_alive, f);
    dp_buf_free(&body);
}

/* ---- public ------------------------------------------------------------------------------- */

void px_fleet_start(px_t *px)
{
    const cfg_fleet_t *c = px->gen->cfg->fleet;
    if (c == NULL)
        return;
    px_metrics_family("detproxy_fleet_connected", PX_GAUGE,
                      "1 while this instance holds its fleet lease in etcd, else 0.");
    px_metrics_family("detproxy_fleet_members", PX_GAUGE, "Live fleet members this instance sees.");
    px_metrics_family("detproxy_fleet_events_total", PX_COUNTER,
                      "Fleet events by kind (connected, disconnected, drain, quarantine, ...).");
    px_fleet_t *f = dp_xcalloc(1, sizeof(*f));
    f->px = px;
    f->m_connected = px_metrics_get("detproxy_fleet_connected", NULL);
    f->m_members = px_metrics_get("detproxy_fleet_members", NULL);
    dp_buf_t b = {0};
    f->name = dp_xstrdup(c->name);
    dp_buf_printf(&b, "/detproxy/%s/", c->name);
    f->prefix = dp_buf_steal(&b);
    const char *colon = strrchr(c->instance, ':');
    if (c->instance_default && colon && px->admin) { /* the port bound, as admin port 0 is */
        dp_buf_printf(&b, "%.*s:%u", (int)(colon - c->instance), c->instance,
                      (unsigned)net_server_port(px->admin));
        f->instance = dp_buf_steal(&b);
    } else {
        f->instance = dp_xstrdup(c->instance);
    }
    f->ttl_ms = c->lease_ttl_ms;
    config_fingerprint(px->gen->cfg, f->fp);
    snprintf(f->ref_fp, sizeof(f->ref_fp), "%s", f->fp);
    fleet_etcd_opts_t o = {.endpoints = c->endpoints,
                           .nendpoints = c->nendpoints,
                           .ca_file = c->ca_file,
                           .cert_file = c->cert_file,
                           .key_file = c->key_file,
                           .username = c->username,
                           .password = c->password,
                           .timeout_ms = f->ttl_ms / 5 < 2000 ? f->ttl_ms / 5 : 2000};
    dp_buf_t err = {0};
    f->etcd = fleet_etcd_new(px->loop, &o, &err);
    snprintf(f->why, sizeof(f->why), "%s", f->etcd ? "connecting" : err.base);
    if (f->etcd == NULL)
        dp_log_msg(DP_LOG_ERROR, "fleet_disabled", err.base);
    dp_buf_free(&err);
    f->since_ms = dp_wall_ms();
    px->fleet = f;
    uv_timer_init(px->loop, &f->tick);
    f->tick.data = f;
    if (f->etcd) {
        f->seq = px_seqlock_start(px, f->etcd, f->prefix, f->instance);
        uv_timer_start(&f->tick, on_tick, f->ttl_ms / 3, f->ttl_ms / 3);
        connect_start(f);
    }
}

static void tick_closed(uv_handle_t *h)
{
    px_fleet_t *f = h->data;
    free(f);
}

/* How long a stopping member waits for etcd to revoke its lease. */
#define REVOKE_LIMIT_MS 1000

/* A clean stop's lease, revoked once the engine keys known clean are let go of marked. */
typedef struct {
    fleet_etcd_t *etcd;
    int64_t lease;
} leaving_t;

static void revoked(const cJSON *res, const char *why, void *data)
{
    (void)data;
    dp_jw_t *w = dp_log_begin(res ? DP_LOG_INFO : DP_LOG_WARN,
                              res ? "fleet_lease_revoked" : "fleet_lease_revoke_unconfirmed");
    if (w) {
        if (res == NULL)
            dp_jw_str(w, "error", why ? why : "");
        dp_log_end(w);
    }
}

/* Revoking the lease hands the member's other engine keys on, and takes its member key, now
 * rather than lease_ttl_ms after the last keep-alive. The process waits for the answer, at
 * most REVOKE_LIMIT_MS. */
static void revoke(void *data)
{
    leaving_t *lv = data;
    dp_buf_t body = {0};
    fleet_ej_lease_id(&body, lv->lease);
    fleet_etcd_free_after(lv->etcd, "/v3/lease/revoke", &body, REVOKE_LIMIT_MS, revoked, NULL);
    dp_buf_free(&body);
    free(lv);
}

void px_fleet_stop(px_t *px, bool leave)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL)
        return;
    px->fleet = NULL;
    f->stopping = true;
    px_seqlock_stop(f->seq);
    if (leave && f->connected && f->lease != 0) {
        /* Nothing of this member runs on a single_sequence engine any more (the stop waited).
         * Its calls in flight end now, while f is whole; the engine keys it holds clean are let
         * go of marked (the next taker needs no check), then the lease is revoked. */
        fleet_etcd_cancel(f->etcd);
        leaving_t *lv = dp_xcalloc(1, sizeof(*lv));
        lv->etcd = f->etcd;
        lv->lease = f->lease;
        px_seqlock_close(f->seq, revoke, lv);
    } else {
        /* Cut short, or etcd away: the keys go when the lease expires (docs/fleet.md). */
        fleet_etcd_free(f->etcd);
        px_seqlock_close(f->seq, NULL, NULL);
    }
    f->seq = NULL;
    f->etcd = NULL;
    members_clear(f);
    entries_clear(f);
    verdicts_clear(f);
    stats_clear(f);
    free(f->stats_sent);
    for (size_t i = 0; i < f->npending; i++) {
        free(f->pending[i].key);
        free(f->pending[i].value);
    }
    free(f->pending);
    free(f->name);
    free(f->prefix);
    free(f->instance);
    px_hooks_set_rate_share(1);
    uv_close((uv_handle_t *)&f->tick, tick_closed);
}

void px_fleet_drained(px_t *px, const px_replica_t *r, bool drained, const char *reason)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL || f->etcd == NULL)
        return;
    dp_buf_t key = {0}, v = {0};
    dp_buf_printf(&key, "%sdrain/%s/%s", f->prefix, r->pool_name, r->name);
    dp_jw_t w;
    dp_jw_init(&w, &v);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_bool(&w, "drained", drained);
    dp_jw_str(&w, "origin", f->instance);
    dp_jw_str(&w, "reason", reason);
    dp_jw_uint(&w, "at_ms", dp_wall_ms());
    dp_jw_obj_end(&w);
    fleet_write(f, key.base, v.base);
    /* Our own view, so /admin/fleet shows it before the watch echoes it back. */
    kv_event(f, key.base, v.base, 0, 0, false);
    dp_buf_free(&key);
    dp_buf_free(&v);
}

void px_fleet_replica_changed(const px_replica_t *r, px_replica_state_t from)
{
    px_fleet_t *f = r->px->fleet;
    if (f == NULL || f->etcd == NULL || g_applying)
        return;
    px_replica_state_t to = px_replica_state(r);
    bool q = to == PX_REPLICA_QUARANTINED, was = from == PX_REPLICA_QUARANTINED;
    if (q == was)
        return;
    dp_buf_t key = {0};
    dp_buf_printf(&key, "%squarantine/%s/%s", f->prefix, r->pool_name, r->name);
    const entry_t *e = entry_find(f, key.base + strlen(f->prefix));
    if (q) {
        dp_buf_t v = {0};
        dp_jw_t w;
        dp_jw_init(&w, &v);
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "origin", f->instance);
        dp_jw_str(&w, "reason", r->nreasons ? r->reasons[0] : "quarantined");
        dp_jw_uint(&w, "at_ms", dp_wall_ms());
        dp_jw_obj_end(&w);
        fleet_write(f, key.base, v.base);
        kv_event(f, key.base, v.base, 0, 0, false);
        dp_buf_free(&v);
    } else if (e && strcmp(e->origin, f->instance) == 0) {
        /* Our quarantine ended here: it ends for the fleet. */
        fleet_write(f, key.base, NULL);
        kv_event(f, key.base, NULL, 0, 0, true);
    }
    dp_buf_free(&key);
}

bool px_fleet_enabled(const px_t *px)
{
    return px->fleet != NULL;
}

bool px_fleet_connected(const px_t *px)
{
    return px->fleet && px->fleet->connected;
}

size_t px_fleet_members(const px_t *px)
{
    return px->fleet ? px->fleet->nmembers : 0;
}

static void entries_json(const px_fleet_t *f, dp_jw_t *w, const char *name, bool drains)
{
    dp_jw_arr_begin(w, name);
    for (size_t i = 0; i < f->nentries; i++) {
        const entry_t *e = &f->entries[i];
        if ((strncmp(e->key, "drain/", 6) == 0) != drains)
            continue;
        dp_jw_obj_begin(w, NULL);
        dp_jw_str(w, "pool", e->pool);
        dp_jw_str(w, "replica", e->replica);
        if (drains)
            dp_jw_bool(w, "drained", e->drained);
        dp_jw_str(w, "origin", e->origin);
        dp_jw_str(w, "reason", e->reason);
        char at[32];
        dp_iso8601(at, e->at_ms);
        dp_jw_str(w, "at", at);
        const member_t *m = member_find((px_fleet_t *)f, e->origin);
        dp_jw_bool(w, "origin_config_skew", m && m->skew);
        dp_jw_bool(w, "local", strcmp(e->origin, f->instance) == 0);
        dp_jw_obj_end(w);
    }
    dp_jw_arr_end(w);
}

/* Who attests which replica, the verdict in force, and whether this instance attests alone. */
static void attestation_json(px_fleet_t *f, dp_jw_t *w)
{
    px_t *px = f->px;
    bool alone = attesting_alone(f);
    dp_jw_obj_begin(w, "attestation");
    dp_jw_str(w, "mode", alone ? "local" : "shared");
    dp_jw_str(w, "why",
              !alone ? "each replica is attested by one member, the others apply its verdict"
              : f->etcd == NULL || !f->connected ? "etcd unreachable: attesting every replica here"
                                                 : "config_skew: attesting every replica here");
    dp_jw_uint(w, "verdicts_published", f->verdicts_published);
    dp_jw_uint(w, "verdicts_applied", f->verdicts_applied);
    dp_jw_uint(w, "checked_overdue", f->attested_overdue);
    dp_jw_arr_begin(w, "replicas");
    for (size_t i = 0; px->gen && i < px->gen->npools; i++) {
        const px_pool_t *p = &px->gen->pools[i];
        for (size_t k = 0; k < p->nreplicas; k++) {
            const px_replica_t *r = p->replicas[k];
            const member_t *o = alone ? NULL : duty_owner(f, r->pool_name, r->name);
            dp_jw_obj_begin(w, NULL);
            dp_jw_str(w, "pool", r->pool_name);
            dp_jw_str(w, "replica", r->name);
            dp_jw_str(w, "attester", o ? o->instance : f->instance);
            dp_jw_bool(w, "self", o == NULL || strcmp(o->instance, f->instance) == 0);
            const verdict_t *v = verdict_find(f, r->pool_name, r->name);
            if (v) {
                dp_jw_obj_begin(w, "last_verdict");
                dp_jw_str(w, "origin", v->origin);
                dp_jw_str(w, "state", v->state);
                char at[32];
                dp_iso8601(at, v->at_ms);
                dp_jw_str(w, "at", at);
                dp_jw_bool(w, "applied", v->applied);
                dp_jw_obj_end(w);
            } else {
                dp_jw_null(w, "last_verdict");
            }
            dp_jw_obj_end(w);
        }
    }
    dp_jw_arr_end(w);
    dp_jw_obj_end(w);
}

bool px_fleet_anchor(px_t *px, dp_buf_t *key, uint64_t *seq)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL || f->etcd == NULL)
        return false;
    dp_buf_printf(key, "%sanchors/%s", f->prefix, f->instance);
    *seq = f->anchor_seq;
    return true;
}

static void member_updated(const cJSON *res, const char *why, void *data)
{
    px_fleet_t *f = data;
    dp_jw_t *w = dp_log_begin(res ? DP_LOG_INFO : DP_LOG_WARN, "fleet_member_updated");
    if (w) {
        dp_jw_str(w, "config_fingerprint", f->fp);
        dp_jw_bool(w, "ok", res != NULL);
        if (res == NULL)
            dp_jw_str(w, "error", why); /* the next registration writes it (member_value) */
        dp_log_end(w);
    }
}

void px_fleet_keep(px_t *px, cfg_t *old, cfg_t *cfg)
{
    dp_buf_t was = {0}, now = {0};
    fleet_section(old, &was);
    fleet_section(cfg, &now);
    if (was.len != now.len || (was.len && memcmp(was.base, now.base, was.len) != 0)) {
        dp_log_msg(DP_LOG_WARN, "config_warning",
                   px->fleet ? "fleet: its settings change only with a restart: this instance "
                               "stays in the fleet it started in, with the settings it started "
                               "with"
                             : "fleet: joining a fleet takes a restart");
        /* The new generation carries the section that runs (old's is freed with it). */
        cfg_fleet_t *t = cfg->fleet;
        cfg->fleet = old->fleet;
        old->fleet = t;
    }
    dp_buf_free(&was);
    dp_buf_free(&now);
}

void px_fleet_reloaded(px_t *px)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL)
        return;
    /* The other members judge config skew by our fingerprint: the one of what runs now. */
    char fp[65];
    config_fingerprint(px->gen->cfg, fp);
    if (strcmp(fp, f->fp) == 0)
        return;
    memcpy(f->fp, fp, sizeof(f->fp));
    compute_skew(f);
    if (f->connected && f->lease)
        member_publish(f, member_updated);
}

void px_fleet_json(px_t *px, dp_buf_t *out)
{
    px_fleet_t *f = px->fleet;
    dp_jw_t w;
    dp_jw_init(&w, out);
    dp_jw_obj_begin(&w, NULL);
    dp_jw_bool(&w, "enabled", f != NULL);
    if (f == NULL) {
        dp_jw_obj_end(&w);
        return;
    }
    dp_jw_str(&w, "fleet", f->name);
    dp_jw_str(&w, "instance", f->instance);
    dp_jw_bool(&w, "connected", f->connected);
    dp_jw_str(&w, "mode", f->connected ? "fleet" : "local");
    char at[32];
    dp_iso8601(at, f->since_ms);
    dp_jw_str(&w, "since", at);
    dp_jw_str(&w, "error", f->connected ? NULL : f->why);
    dp_jw_str(&w, "endpoint", f->etcd ? fleet_etcd_endpoint(f->etcd) : NULL);
    dp_jw_uint(&w, "etcd_requests", f->etcd ? fleet_etcd_requests(f->etcd) : 0);
    dp_jw_str(&w, "config_fingerprint", f->fp);
    dp_jw_str(&w, "fleet_config_fingerprint", f->ref_fp);
    dp_jw_bool(&w, "config_skew", strcmp(f->fp, f->ref_fp) != 0);
    dp_jw_uint(&w, "lease_ttl_ms", f->ttl_ms);
    /* How long the lease surely lives (the send time of its last grant or keep-alive, plus its
     * TTL): what this member's engine keys may be run on for without another keep-alive. */
    uint64_t mono = dp_now_ms();
    dp_jw_uint(&w, "lease_left_ms",
               f->connected && f->lease_until > mono ? f->lease_until - mono : 0);
    dp_jw_uint(&w, "rate_share", f->rate_share ? f->rate_share : 1);
    px_seqlock_json(f->seq, &w);
    dp_jw_arr_begin(&w, "members");
    uint64_t now = dp_wall_ms();
    for (size_t i = 0; i < f->nmembers; i++) {
        const member_t *m = &f->members[i];
        dp_jw_obj_begin(&w, NULL);
        dp_jw_str(&w, "instance", m->instance);
        dp_jw_bool(&w, "self", strcmp(m->instance, f->instance) == 0);
        dp_jw_str(&w, "version", m->version);
        dp_jw_str(&w, "config_fingerprint", m->fp);
        dp_jw_bool(&w, "config_skew", m->skew);
        dp_jw_str(&w, "listen", m->listen);
        dp_jw_str(&w, "admin_listen", m->admin);
        dp_iso8601(at, m->started_ms);
        dp_jw_str(&w, "started_at", at);
        /* A member is live while its lease is: as of now while we are connected. */
        dp_iso8601(at, f->connected ? now : f->since_ms);
        dp_jw_str(&w, "last_seen", at);
        dp_jw_obj_end(&w);
    }
    dp_jw_arr_end(&w);
    entries_json(f, &w, "drains", true);
    entries_json(f, &w, "quarantines", false);
    dp_jw_uint(&w, "pending_writes", f->npending);
    attestation_json(f, &w);
    if (f->anchor_seq) {
        dp_jw_obj_begin(&w, "audit_anchor");
        dp_buf_t k = {0};
        dp_buf_printf(&k, "%sanchors/%s", f->prefix, f->instance);
        dp_jw_str(&w, "key", k.base);
        dp_buf_free(&k);
        dp_jw_uint(&w, "seq", f->anchor_seq);
        dp_jw_str(&w, "sha256", f->anchor_sha);
        dp_jw_obj_end(&w);
    } else {
        dp_jw_null(&w, "audit_anchor");
    }
    dp_jw_obj_end(&w);
}

void px_fleet_summary(px_t *px, dp_buf_t *out)
{
    px_fleet_t *f = px->fleet;
    if (f == NULL)
        return;
    if (f->connected)
        dp_buf_printf(out, "fleet %s as %s: connected to etcd %s; ", f->name, f->instance,
                      fleet_etcd_endpoint(f->etcd));
    else
        dp_buf_printf(out,
                      "fleet %s as %s: NOT connected (%s): serving with the last fleet state "
                      "and local decisions; ",
                      f->name, f->instance, f->why);
    dp_buf_printf(out, "%zu members:", f->nmembers);
    for (size_t i = 0; i < f->nmembers; i++)
        dp_buf_printf(out, " %s%s", f->members[i].instance,
                      f->members[i].skew ? " (config_skew)" : "");
    size_t nd = 0, nq = 0;
    for (size_t i = 0; i < f->nentries; i++) {
        if (strncmp(f->entries[i].key, "drain/", 6) == 0)
            nd += f->entries[i].drained;
        else
            nq++;
    }
    dp_buf_printf(out, "; %zu fleet drains, %zu fleet quarantines; attestation %s", nd, nq,
                  attesting_alone(f) ? "local (every replica attested here)"
                                     : "shared (one attester per replica)");
}
